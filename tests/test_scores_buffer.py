"""--scores-buffer (planning/estimate.py `scores_buffer_bytes`): Megatron-LM's unfused attention hands torch.baddbmm a
tensor of its scores' size from the global memory buffer, which keeps it for the whole run: b x a/t x s x s bytes
of the queries' dtype held from the start as the runtime_buffers part, one a device however many stages it holds,
beside the scores each forward still makes."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from pipesim.planning.estimate import EstimateError, Parallelism, estimate_profile
from pipesim.planning.scenario import Scenario
from pipesim.sim import StageCosts
from pipesim.sim.engine import held_static_parts
from pipesim.units import MIB
from pipesim.workload.count import WorkloadCount, count_built
from tests.conftest import build, pipesim, simulate_json
from tests.helpers import A100

SHAPE = dict(layers=4, width=64, heads=4, seq_len=1024, vocab=100)
B = 2
SCORES = B * 4 * 1024 * 1024 * 2  # b x a x s x s in fp16: 16 MiB


@cache
def gpt(attention: str) -> WorkloadCount:
    return count_built("gpt", SHAPE, B, torch.float16, attention)


def test_the_count_records_each_blocks_unfused_scores_and_none_under_flash():
    math_layers, flash_layers = gpt("math").layers, gpt("flash").layers
    assert [layer.scores_bytes for layer in math_layers] == [0, SCORES, SCORES, SCORES, SCORES, 0]
    assert all(layer.scores_bytes == 0 for layer in flash_layers)


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_estimate_holds_one_ranks_share_per_layer_and_a_stage_its_largest(tensor):
    kept = estimate_profile(gpt("math"), A100, Parallelism(pipeline=2, tensor=tensor, scores_buffer=True))
    assert [layer.runtime_buffer_bytes for layer in kept.layers] == [0, *[SCORES // tensor] * 4, 0]
    assert [stage.runtime_buffer_bytes for stage in kept.stages] == [SCORES // tensor] * 2
    plain = estimate_profile(gpt("math"), A100, Parallelism(pipeline=2, tensor=tensor))
    assert all(layer.runtime_buffer_bytes == 0 for layer in plain.layers)
    with pytest.raises(EstimateError, match="scores_buffer.*flash attention"):
        estimate_profile(gpt("flash"), A100, Parallelism(pipeline=2, scores_buffer=True))


def test_a_device_holds_one_buffer_the_largest_of_its_stages():
    schedule = build("interleaved-1f1b", 2, 4, chunks=2)
    assert [schedule.stages_on(d) for d in range(2)] == [[0, 2], [1, 3]]
    stages = [StageCosts(fwd_ms=1, bwd_ms=2, runtime_buffer_bytes=nbytes) for nbytes in (5, 0, 9, 3)]
    held = [held_static_parts(schedule, [stages[s] for s in schedule.stages_on(d)]) for d in range(2)]
    assert [parts["runtime_buffers"] for parts in held] == [9, 3]  # not 14: one buffer a process


def test_every_device_holds_the_buffer_at_its_peak_beside_the_same_tensors():
    args = ["--gpu", "a100-sxm-80gb", "--model", "gpt", *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()],
            "--dtype", "fp16", "--attention", "math", "-b", str(B), "-p", "2", "-m", "4", "-s", "1f1b"]
    (plain,), (kept,) = simulate_json(*args), simulate_json(*args, "--scores-buffer")
    for before, after in zip(plain["devices"], kept["devices"], strict=True):
        assert before["peak_memory_parts_mb"]["runtime_buffers"] == 0
        assert after["peak_memory_parts_mb"] == {**before["peak_memory_parts_mb"], "runtime_buffers": SCORES / MIB}
        assert after["peak_memory_mb"] == pytest.approx(before["peak_memory_mb"] + SCORES / MIB, rel=1e-12)


def test_a_fused_attention_is_refused_in_one_line():
    code, _, err = pipesim("simulate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "-p", "2",
                           "--attention", "flash", "--scores-buffer")
    assert code == 2 and "--scores-buffer" in err and "give --attention math" in err and len(err.splitlines()) == 1


def test_a_model_without_attention_is_refused_in_one_line_naming_what_takes_the_flag():
    code, out, err = pipesim("simulate", "--gpu", "a100-sxm-80gb", "--model", "mlp", "-p", "2", "--scores-buffer")
    assert code == 2 and not out and err == (
        "error: --scores-buffer keeps the buffer Megatron-LM's unfused attention (--attention math) computes its "
        "scores beside; this model has no attention: drop --scores-buffer\n")


def test_the_fit_cut_holds_a_stages_buffer_once_however_many_layers_ask():
    """`--stage-cut fit` weighs each range of layers as the simulator holds it (planning/scenario.py
    `Scenario.stage_memory`): the buffer of a range of attention layers is one, the largest, not one a layer."""
    schedule = build("1f1b", 2, 4)
    held = {}
    for kept in (False, True):
        measured = estimate_profile(gpt("math"), A100, Parallelism(pipeline=2, scores_buffer=kept))
        scenario = Scenario(per_stage={}, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None, avg_ms=None, optimizer="adam",
                            microbatch_size=B, comm_ms=0.0, overlap_comm=True, measured=measured)
        held[kept] = scenario.stage_memory(schedule).held
    for plain, kept in zip(held[False], held[True], strict=True):
        assert kept[0, 6] - plain[0, 6] == kept[1, 5] - plain[1, 5] == kept[1, 2] - plain[1, 2] == SCORES
        assert kept[0, 1] - plain[0, 1] == kept[5, 6] - plain[5, 6] == 0  # the embedding's and the head's: none
