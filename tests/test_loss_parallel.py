"""--loss-parallel: the loss computed as torch's loss_parallel computes it (workload/loss.py), the same loss and
gradient as aten's cross entropy, counted with its fused backward's one more float32 tokens x vocabulary tensor,
and that tensor held on the last device, split over t."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import pipesim

torch = pytest.importorskip("torch")

B, S, VOCAB = 2, 32, 1000
TINY_GPT = {"layers": 2, "width": 64, "heads": 2, "seq_len": S, "vocab": VOCAB}


@pytest.mark.parametrize("computed_as", ["vocabulary_parallel_cross_entropy", "megatron_cross_entropy"])
def test_it_computes_aten_cross_entropys_loss_and_gradient(computed_as):
    """Real numbers on the CPU, an ignored target among them: torch's loss_parallel over one rank is the loss, and
    so is Megatron-core's vocabulary-parallel cross entropy (--cross-entropy megatron, tests/test_cross_entropy.py)."""
    import torch.nn.functional as F

    from pipesim.workload import loss as losses
    from pipesim.workload.loss import IGNORE_INDEX

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, 11, (2, 5), generator=gen)
    target[0, 1] = IGNORE_INDEX
    expected = F.cross_entropy(logits.float().reshape(-1, 11), target.reshape(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)
    loss = getattr(losses, computed_as)(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_it_holds_what_torchs_own_loss_parallel_functions_hold():
    """torch's loss_parallel handlers' functions run on one gloo rank's vocabulary shard (its all-reduces over one
    rank): the same log-softmax and gradient, and the same float32 tokens x V tensors live at each pass's peak (the
    forward's shifted logits beside the log-softmax it keeps; the backward's three)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss as torch_loss

    from pipesim.workload.count import _LiveBytes
    from pipesim.workload.loss import _VocabularyParallelCrossEntropy

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with no process group of its own running")
    tokens, vocab = 64, 512
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(tokens, vocab, generator=gen), torch.randint(0, vocab, (tokens,), generator=gen)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with _LiveBytes() as torch_forward:
            log_probs = torch_loss._log_softmax(logits, 1, False, mesh, 0)
        with _LiveBytes() as torch_backward:
            grad = torch_loss._nll_loss_and_log_softmax_backward(
                torch.tensor(1.0), log_probs, target, None, 1, -100, torch.tensor(float(tokens)), logits.shape, 1,
                mesh, 0)
    finally:
        dist.destroy_process_group()

    class Saved:
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    ctx = Saved()
    with _LiveBytes() as forward:
        _VocabularyParallelCrossEntropy.forward(ctx, logits, target)
    with _LiveBytes() as backward:
        ours, _ = _VocabularyParallelCrossEntropy.backward(ctx, torch.tensor(1.0))
    torch.testing.assert_close(ctx.saved_tensors[0], log_probs)
    torch.testing.assert_close(ours, grad)
    whole = ((tokens, vocab), tokens * vocab * 4)
    for theirs, mine, count in ((torch_forward.transient(beside_kept=True), forward.transient(beside_kept=True), 1),
                                (torch_backward.transient(), backward.transient(), 3)):
        assert [held for held in theirs if held == whole] == [held for held in mine if held == whole] == [whole] * count


def test_its_backward_holds_three_float32_tokens_by_vocabulary_tensors_and_its_forward_the_shifted_logits():
    """aten's loss backward holds two float32 tokens x V tensors beside the saved log-softmax; loss_parallel's fused
    backward three (grad_input, the exponential, their sum). Its forward holds the 16-bit logits, their float32
    copy and the shifted logits when it writes the log-softmax it keeps (not also the exponential, freed before)."""
    from pipesim.workload.count import count_built

    tokens = B * S
    aten, fused = (count_built("gpt", TINY_GPT, B, torch.bfloat16, "math", parallel).layers[-1]
                   for parallel in (False, True))
    float32 = ((tokens, VOCAB), tokens * VOCAB * 4)
    assert sorted(aten.transient_tensors["bwd"]) == [float32] * 2
    assert [held for held in fused.transient_tensors["bwd"] if held[0] == (tokens, VOCAB)] == [float32] * 3
    assert sum(n for _, n in aten.transient_tensors["fwd"]) == tokens * VOCAB * (2 + 4)
    assert sum(n for shape, n in fused.transient_tensors["fwd"] if shape[-1:] == (VOCAB,)) \
        == tokens * VOCAB * (2 + 4 + 4)
    assert fused.saved_bytes == aten.saved_bytes


@pytest.mark.parametrize("loss,flag", [({"loss_parallel": True}, "--loss-parallel"),
                                       ({"cross_entropy": "megatron"}, "--cross-entropy megatron")])
def test_a_model_with_a_loss_of_its_own_is_refused(loss, flag):
    """Either loss computed as a framework computes it (this one's or tests/test_cross_entropy.py's) replaces the
    cross entropy: a model whose loss is its own has none to replace."""
    from pipesim.workload.count import count_model
    from pipesim.workload.models import Model, ModelError

    with torch.device("meta"):
        model = Model("own", [torch.nn.Linear(4, 4)], lambda b, gen: (torch.zeros(b, 4), torch.zeros(b, 4)),
                      lambda out, target: (out - target).square().mean())
    with pytest.raises(ModelError, match=f"{flag}: model 'own' has a loss of its own"):
        count_model(model, 2, torch.float32, **loss)


def test_the_last_device_holds_one_more_tokens_by_vocabulary_over_t_tensor():
    """A GPT whose head dwarfs its blocks (64 tokens x 32768 x 4 bytes = 8 MiB a float32 tensor): with
    --loss-parallel the last device's transient is three such tensors where it was two, each split over t = 2."""
    args = ["simulate", "--model", "gpt", "--layers", "4", "--width", "64", "--heads", "2", "--seq-len", "32",
            "--vocab", "32768", "-b", "2", "--gpu", "a100-sxm-80gb", "--tensor-parallel", "2", "-p", "2", "-m", "4",
            "-s", "1f1b", "--json"]
    held = []
    for flags in ((), ("--loss-parallel",)):
        code, out, err = pipesim(*args, *flags)
        assert code == 0, err
        held.append(json.loads(out)["results"][0]["devices"][-1]["peak_memory_parts_mb"]["transient"])
    assert held == [pytest.approx(2 * 8 / 2, rel=0.01), pytest.approx(3 * 8 / 2, rel=0.01)]


def test_the_costs_line_and_an_estimated_profile_say_so(tmp_path, monkeypatch):
    model = ["--model", "gpt", "--layers", "2", "--width", "64", "--heads", "2", "--seq-len", "32", "--vocab", "512",
             "--gpu", "a100-sxm-80gb", "--tensor-parallel", "2", "--loss-parallel"]
    code, out, err = pipesim("simulate", *model, "-p", "1", "-m", "1", "-s", "gpipe")
    assert code == 0, err
    assert re.search(r"\(t=2, [^)]*loss parallel[,)]", " ".join(out.split()))
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("estimate", *model, "--out", "e.json")
    assert code == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["estimate"]["parallelism"]["loss_parallel"] is True


def test_without_gpu_it_is_refused_in_one_line():
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--loss-parallel")
    assert code == 2 and out == ""
    assert "--loss-parallel: only --gpu's estimate reads it" in err and len(err.strip().splitlines()) == 1


def test_tune_prices_a_searched_t_of_1_with_atens_loss():
    """torchtitan runs loss_parallel at t > 1 only: on one device tune's rows are those without the flag, where
    they priced the loss's dozen more kernels."""
    args = ["tune", "--model", "gpt", *(f"--{k.replace('_', '-')}={v}" for k, v in TINY_GPT.items()), "--gpu",
            "a100-sxm-80gb", "-D", "1", "-b", "4", "-s", "1f1b", "--json"]
    rates = []
    for flags in ((), ("--loss-parallel",)):
        code, out, err = pipesim(*args, *flags)
        assert code == 0, err
        rates.append(json.loads(out)["choice"]["samples_per_s"])
    assert rates[0] == rates[1]
