"""--cp-rotate: how the context ring passes keys and values, by torch's rotate_method or TransformerEngine's ring
(p2p, last below; planning/estimate.py `ContextRing.rotate`). The figures are written out by hand from torch's code
(torch/distributed/tensor/experimental/_context_parallel/_attention.py): `_AllGatherRotater` all-gathers every
rank's concatenated keys and values once, at the first step, into a C x buffer it keeps; the backward's key and
value gradients go round the ring in float32 whatever the option (its dkv rotater is `_AllToAllRotater`)."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from pipesim.planning.estimate import (
    ContextRing,
    Device,
    EstimateError,
    Parallelism,
    estimate_profile,
    kernel_curve,
)
from pipesim.profiles.schema import EstimateLink
from pipesim.profiles.workload import OpCount
from tests.conftest import pipesim, simulate_json
from tests.helpers import H100, ring_gpt_count, searched_settings
from tests.helpers import H100_BF16 as DEVICE

SLOW = EstimateLink(kind="infiniband", latency_ms=0.01, bytes_per_ms=1e6)  # every transfer outlasts its block
FORWARD = OpCount("_flash_attention_forward", "attention", (16, 64, 256, 32), 1, 1, 1)
BACKWARD = OpCount("_flash_attention_backward", "attention", (16, 64, 256, 32), 1, 1, 1)
KEYS_VALUES = 2 * 16 * 64 * 32  # K and V: batch x heads 16, the rank's 64 tokens, head size 32
GRADIENTS = KEYS_VALUES * 4  # dK and dV in float32 (convert_to_f32)
QUERIES = 16 * 64 * 32  # Q, the output and its gradient: batch x heads 16, the rank's 64 tokens, head size 32
MERGED_FORWARD = 4 * QUERIES * 4  # the merge's float32 output, block copy and two temporaries
MERGED_BACKWARD = 2 * QUERIES * 4  # the float32 query gradient and its load-balanced concatenation


def test_allgather_gathers_the_other_ranks_keys_and_values_at_the_first_step_and_rings_the_gradients():
    ring = ContextRing(4, SLOW, "allgather")
    assert ring.step_bytes(FORWARD, 2) == ([3 * KEYS_VALUES * 2, 0, 0, 0], 0)
    assert ring.step_bytes(BACKWARD, 2) == ([3 * KEYS_VALUES * 2, GRADIENTS, GRADIENTS, GRADIENTS], GRADIENTS)


def test_allgather_prices_the_all_gather_as_nccls_ring_under_the_first_block_only():
    ring = ContextRing(4, SLOW, "allgather")
    gather_ms = 3 * 0.01 + 3 * KEYS_VALUES * 2 / 1e6  # C - 1 ring steps of one rank's K/V
    blocks = ring.blocks_ms(FORWARD, DEVICE)
    assert ring.exchange_ms(FORWARD, DEVICE, 2) == pytest.approx((gather_ms, blocks[0]))
    gradient_ms = 0.01 + GRADIENTS / 1e6
    blocks = ring.blocks_ms(BACKWARD, DEVICE)
    assert ring.exchange_ms(BACKWARD, DEVICE, 2) == pytest.approx((gather_ms + 4 * gradient_ms, sum(blocks)))


@pytest.mark.parametrize("c, forward_copies, backward_copies", [
    (4, 4 + 1, 4 + 2),  # the gathered 4 and the copy sent; the backward's next concatenation beside the last
    (2, 2 + 1, 2 + 1),  # C = 2: the backward's last step (the second) concatenates none
])
def test_allgather_holds_the_gathered_keys_and_values_and_its_concatenations(c, forward_copies, backward_copies):
    ring = ContextRing(c, SLOW, "allgather")
    assert ring.buffer_bytes(FORWARD, 2) == forward_copies * KEYS_VALUES * 2 + MERGED_FORWARD
    assert ring.buffer_bytes(BACKWARD, 2) == backward_copies * KEYS_VALUES * 2 + 3 * GRADIENTS + MERGED_BACKWARD


def test_alltoall_is_the_default_and_its_ring_is_unchanged():
    ring = ContextRing(4, SLOW)
    assert ring == ContextRing(4, SLOW, "alltoall")
    assert ring.step_bytes(FORWARD, 2) == ([KEYS_VALUES * 2] * 3 + [0], 0)
    assert ring.step_bytes(BACKWARD, 2) == ([KEYS_VALUES * 2, KEYS_VALUES * 2 + GRADIENTS, KEYS_VALUES * 2 + GRADIENTS,
                                             GRADIENTS], GRADIENTS)
    assert ring.buffer_bytes(BACKWARD, 2) == 3 * KEYS_VALUES * 2 + 3 * GRADIENTS + MERGED_BACKWARD
    assert Parallelism(context=4).cp_rotate == "alltoall"
    with pytest.raises(EstimateError, match="cp_rotate: choose from alltoall, allgather"):
        Parallelism(context=4, cp_rotate="ring")


def test_torchs_rings_merge_the_blocks_and_the_query_gradient_in_float32():
    """torch's ring (_attention.py, convert_to_f32) on 16 x 64 queries of head size 32 (32,768 elements) and as
    many keys and values (65,536 elements with V): at a merge the forward holds the merged output in float32, the
    block's output copied to float32, `out - block_out` and its product with the sigmoid, 4 x 32,768 x 4 =
    524,288 bytes, beside alltoall's 3 key/value buffers at C = 4 (393,216 in bf16); the backward its float32
    query gradient and, at rank 0's load-balanced steps, `_partial_update`'s concatenation of it, 2 x 32,768 x 4
    = 262,144, beside the 3 key/value buffers and the 3 float32 key/value gradients (786,432).
    TransformerEngine's ring (p2p) merges in the keys' dtype: its 4 forward buffers alone (524,288)."""
    assert ContextRing(4, SLOW).buffer_bytes(FORWARD, 2) == 393_216 + 524_288
    assert ContextRing(4, SLOW).buffer_bytes(BACKWARD, 2) == 393_216 + 786_432 + 262_144
    assert ContextRing(4, SLOW, "allgather").buffer_bytes(FORWARD, 2) == 5 * 131_072 + 524_288
    assert ContextRing(4, SLOW, "p2p").buffer_bytes(FORWARD, 2) == 524_288


def test_the_estimate_prices_and_holds_the_named_rotation(flash_gpt):
    default, gathered = (estimate_profile(flash_gpt, H100, Parallelism(context=4, **rotate))
                         for rotate in ({}, {"cp_rotate": "allgather"}))
    assert gathered.estimate.parallelism["cp_rotate"] == "allgather"
    block, gathered_block = default.layers[1], gathered.layers[1]
    keys_values = 2 * (2 * 8) * (256 // 4) * (192 // 8) * 2  # batch 2 x heads 8, the rank's 64 tokens, head 24
    assert gathered_block.ring_buffer_bytes["fwd"] - block.ring_buffer_bytes["fwd"] == (5 - 3) * keys_values
    assert gathered_block.ring_buffer_bytes["bwd"] - block.ring_buffer_bytes["bwd"] == (6 - 3) * keys_values
    assert (gathered_block.fwd, gathered_block.bwd) == (block.fwd, block.bwd)  # the blocks alike


@pytest.fixture(scope="module")
def flash_gpt():
    pytest.importorskip("torch")
    return ring_gpt_count()


WHAT_IF = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 4096,
           "--attention", "flash")


def test_simulate_holds_the_all_gathers_buffers_and_the_default_keeps_todays_figures():
    """b = 1, 4 heads of 64, 1,024 tokens a rank: a K/V of 1 MiB; allgather's backward holds 6 of them, alltoall's 3."""
    args = (*WHAT_IF, "-p", 2, "-m", 4, "-s", "1f1b", "--context-parallel", 4)
    default, alltoall, allgather = (simulate_json(*args, *rotate)[0] for rotate in
                                    ((), ("--cp-rotate", "alltoall"), ("--cp-rotate", "allgather")))
    assert default == alltoall
    parts = [r["devices"][0]["peak_memory_parts_mb"]["communication"] for r in (alltoall, allgather)]
    assert parts[1] - parts[0] == pytest.approx(3.0)
    assert allgather["exposed_comm_ms"] > alltoall["exposed_comm_ms"]


def test_estimate_sweep_and_tune_take_the_rotation(tmp_path):
    code, _, err = pipesim("estimate", *WHAT_IF, "-p", 2, "--context-parallel", 2, "--cp-rotate", "allgather",
                           "--out", tmp_path / "p.json")
    assert code == 0, err
    assert json.loads((tmp_path / "p.json").read_text())["estimate"]["parallelism"]["cp_rotate"] == "allgather"
    peaks = []
    for rotate in ("alltoall", "allgather"):
        code, _, err = pipesim("sweep", *WHAT_IF, "-p", 2, "-m", 4, "-s", "1f1b", "--context-parallel", 2,
                               "--cp-rotate", rotate, "-o", tmp_path / f"{rotate}.csv")
        assert code == 0, err
        [row] = csv.DictReader((tmp_path / f"{rotate}.csv").open())
        peaks.append(float(row["peak_memory_mb"]))
    assert peaks[1] > peaks[0]  # C = 2: allgather's backward holds 3 K/V, alltoall's 2
    # tune takes the flag: every layout it searches beside the C given is estimated with the rotation
    settings = searched_settings("-D", 4, "--context-parallel", 2, "--cp-rotate", "allgather", model=WHAT_IF)
    assert {s.scenario.measured.estimate.parallelism["cp_rotate"] for s in settings} == {"allgather"}


@pytest.mark.parametrize("args, line", [
    (("--context-parallel", 2, "--cp-rotate", "ring"),
     "--cp-rotate: choose from alltoall, allgather, p2p (got 'ring')"),
    (("--cp-rotate", "allgather"), "--cp-rotate sets how the context ring passes keys and values: give "
                                   "--context-parallel 2 or more"),
])
def test_a_bad_rotation_is_one_line_and_writes_nothing(args, line, tmp_path):
    code, _, err = pipesim("estimate", *WHAT_IF, "-p", 2, *args, "--out", tmp_path / "p.json")
    assert code == 2 and err.strip() == f"error: {line}" and not (tmp_path / "p.json").exists()


def test_the_costs_line_names_the_rotation_only_where_there_is_a_ring():
    args = (*WHAT_IF, "-p", 2, "-m", 4, "-s", "1f1b")
    code, out, err = pipesim("simulate", *args, "--context-parallel", 4, "--cp-rotate", "allgather")
    assert code == 0 and "cp rotate allgather" in " ".join(out.split()), err
    code, out, err = pipesim("simulate", *args)
    assert code == 0 and "cp rotate" not in " ".join(out.split()), err


# p2p: the ring as TransformerEngine 1.x's `AttnFuncWithCPAndKVP2P` runs it under Megatron-core
# (transformer_engine/pytorch/attention.py at v1.10): its forward sends as torch's ring does; its backward's buffers
# are [K/V, dK/dV] in the keys' dtype, step 0 sends K/V, each later step both, the last dK/dV alone, received within
# that step: no transfer after the last block, the gradients 16-bit.
@pytest.mark.parametrize("c, backward", [(4, [KEYS_VALUES * 2, 4 * KEYS_VALUES, 4 * KEYS_VALUES, KEYS_VALUES * 2]),
                                         (2, [KEYS_VALUES * 2, KEYS_VALUES * 2])])
def test_p2p_sends_as_torchs_ring_forward_and_its_gradients_16_bit_within_the_steps(c, backward):
    p2p, torch = ContextRing(c, SLOW, "p2p"), ContextRing(c, SLOW)
    assert p2p.step_bytes(FORWARD, 2) == torch.step_bytes(FORWARD, 2) == ([KEYS_VALUES * 2] * (c - 1) + [0], 0)
    assert p2p.step_bytes(BACKWARD, 2) == (backward, 0)


def test_p2p_runs_each_transfer_under_its_steps_block_and_none_after_the_last():
    ring = ContextRing(2, SLOW, "p2p")
    transfer_ms = 0.01 + KEYS_VALUES * 2 / 1e6
    assert ring.exchange_ms(BACKWARD, DEVICE, 2) == pytest.approx((2 * transfer_ms,
                                                                    sum(ring.blocks_ms(BACKWARD, DEVICE))))
    torch_link_ms, _ = ContextRing(2, SLOW).exchange_ms(BACKWARD, DEVICE, 2)
    assert torch_link_ms == pytest.approx(transfer_ms + 2 * (0.01 + GRADIENTS / 1e6))


@pytest.mark.parametrize("c", [2, 4])
def test_p2p_keeps_every_forward_steps_buffer_and_two_of_keys_values_and_gradients_backward(c):
    ring = ContextRing(c, SLOW, "p2p")
    assert ring.buffer_bytes(FORWARD, 2) == c * KEYS_VALUES * 2
    assert ring.buffer_bytes(BACKWARD, 2) == 4 * KEYS_VALUES * 2


def test_an_estimate_and_a_what_if_run_transformer_engines_ring(flash_gpt, monkeypatch):
    """The what-if runs p2p's ring: its smaller backward exchanges shorten the step, its copies aside
    (`ContextRing.copy_kernels`: its copy of v a layer's forward, which torch's rings do not make, priced on the GPU
    by `copies_ms` and issued by the host)."""
    torch, p2p = (estimate_profile(flash_gpt, H100, Parallelism(context=4, cp_rotate=rotate)).layers[1]
                  for rotate in ("alltoall", "p2p"))
    assert p2p.ring_bwd_ms < torch.ring_bwd_ms and p2p.ring_fwd_ms == torch.ring_fwd_ms
    args = (*WHAT_IF, "-p", 2, "-m", 4, "-s", "1f1b", "--context-parallel", 4)
    monkeypatch.setattr(ContextRing, "copy_kernels", lambda ring, op: 0)
    (alltoall,), (ring,) = simulate_json(*args), simulate_json(*args, "--cp-rotate", "p2p")
    assert ring["time_per_minibatch_ms"] < alltoall["time_per_minibatch_ms"]


def test_p2p_backward_covers_the_same_link_time_with_its_causal_block_last_as_transformer_engine_runs_it():
    """TransformerEngine's backward runs its forward's steps in reverse, the causal block at i == cp_size - 1, where
    the ring prices it first (torch's order): under p2p the first and last steps send the same bytes, so the blocks
    cover the same link time either way; torch's alltoall, whose last step sends float32 gradients, would not."""
    cudnn = kernel_curve(H100.curve, "cudnn", "h100-sxm")
    device = Device(DEVICE.peak_flops_per_ms, DEVICE.memory_bytes_per_ms, cudnn)
    causal = replace(BACKWARD, flops=10**12, causal=True)
    blocks = ContextRing(2, SLOW, "p2p").blocks_ms(causal, device)
    link = EstimateLink(kind="infiniband", latency_ms=0.0, bytes_per_ms=KEYS_VALUES * 2 / (sum(blocks) / 2))
    covered = {}
    for rotate in ("p2p", "alltoall"):
        ring = ContextRing(2, link, rotate)
        assert ring.blocks_ms(causal, device) == blocks
        transfers = [ring.step_link_ms(step, nbytes) for step, nbytes in enumerate(ring.step_bytes(causal, 2)[0])]
        assert blocks[0] > transfers[0] > blocks[1]  # the causal block the slower, each transfer between them
        _, covered[rotate] = ring.exchange_ms(causal, device, 2)
        reversed_order = sum(map(min, zip(transfers, reversed(blocks))))
        assert (covered[rotate] == pytest.approx(reversed_order)) == (rotate == "p2p")
