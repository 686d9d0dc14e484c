"""--cross-entropy megatron: the loss computed as Megatron-core computes it (workload/loss.py), the same loss and
gradient as aten's cross entropy (tests/test_loss_parallel.py), its float32 softmax kept and turned into the
gradient in place, so its backward holds no float32 tokens x vocabulary tensor where aten's holds two."""

from __future__ import annotations

import json

import pytest

from tests.conftest import pipesim

torch = pytest.importorskip("torch")

B, S, VOCAB = 2, 32, 1000
TINY_GPT = {"layers": 2, "width": 64, "heads": 2, "seq_len": S, "vocab": VOCAB}


def test_its_backward_holds_only_the_16_bit_gradient_and_it_keeps_the_float32_softmax():
    """aten's backward holds two float32 tokens x V tensors; Megatron-core's writes into the softmax it kept and
    holds only autograd's bfloat16 cast of it. Both keep one float32 tokens x V tensor for the backward."""
    from pipesim.workload.count import count_built

    tokens = B * S
    aten, megatron = (count_built("gpt", TINY_GPT, B, torch.bfloat16, "math", cross_entropy=kind).layers[-1]
                      for kind in ("torch", "megatron"))
    assert sorted(aten.transient_tensors["bwd"]) == [((tokens, VOCAB), tokens * VOCAB * 4)] * 2
    assert [held for held in megatron.transient_tensors["bwd"] if held[0] == (tokens, VOCAB)] \
        == [((tokens, VOCAB), tokens * VOCAB * 2)]
    kept = [(shape, n) for shape, n in megatron.saved_tensors if shape == (tokens, VOCAB)]
    assert kept == [((tokens, VOCAB), tokens * VOCAB * 4)]
    assert abs(megatron.saved_bytes - aten.saved_bytes) < tokens * 8


def test_the_last_devices_transient_falls_from_two_float32_tensors_to_one_16_bit():
    """A GPT whose head dwarfs its blocks (64 tokens x 32768: 8 MiB a float32 tensor, 4 MiB a bfloat16)."""
    args = ["simulate", "--model", "gpt", "--layers", "4", "--width", "64", "--heads", "2", "--seq-len", "32",
            "--vocab", "32768", "-b", "2", "--gpu", "a100-sxm-80gb", "-p", "2", "-m", "4", "-s", "1f1b", "--json"]
    held = []
    for flags in ((), ("--cross-entropy", "megatron")):
        code, out, err = pipesim(*args, *flags)
        assert code == 0, err
        held.append(json.loads(out)["results"][0]["devices"][-1]["peak_memory_parts_mb"]["transient"])
    assert held[0] == pytest.approx(2 * 8, rel=0.01)
    assert held[1] == pytest.approx(4, rel=0.05)



def test_the_targets_gather_and_scatter_move_one_element_a_token_not_the_logits():
    """Megatron-core's `logits_2d[arange, target]` (aten `index`) and the backward's `grad_2d[arange, target] -=`
    (`index`, then `index_put_`) read their two int64 index tensors and one float32 logit a token, and write one
    float32 a token: the kernels touch the indexed elements, not the tokens x V logits they index."""
    from pipesim.workload.count import count_built

    tokens = B * S
    head = count_built("gpt", TINY_GPT, B, torch.bfloat16, "math", cross_entropy="megatron").layers[-1]
    indexed = [(op.op, op.moved_bytes, op.count) for op in (*head.ops["fwd"], *head.ops["bwd"])
               if op.op in ("index", "index_put_")]
    one_a_token = 2 * tokens * 8 + 2 * tokens * 4  # the indices, then the elements read and written
    assert sorted(indexed) == [("index", one_a_token, 1), ("index", one_a_token, 1), ("index_put_", one_a_token, 1)]

@pytest.mark.parametrize(("flags", "message"), [
    (("--cross-entropy", "fused"), "--cross-entropy: choose from torch, megatron (got 'fused')"),
    (("--cross-entropy", "megatron", "--loss-parallel", "--tensor-parallel", "2"),
     "--loss-parallel is torch's cross entropy: leave out --cross-entropy megatron"),
])
def test_a_bad_setting_is_refused_in_one_line(flags, message):
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "2",
                             "--seq-len", "32", "--vocab", "512", "--gpu", "a100-sxm-80gb", "-p", "1", "-m", "1",
                             "-s", "gpipe", *flags)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1
