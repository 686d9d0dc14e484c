"""--ema (planning/estimate.py `EMA_PLACES`): an exponential moving average of the weights on the GPU costs a
float32 copy beside the master weights, sharded as they are, and a read of the new weights with a read and write
of the average after each step; on the host, as DeepSeek-V3 kept it (its report, 3.2.3), nothing on the GPUs."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from pipesim.planning.estimate import EstimateError, Parallelism, estimate_profile
from pipesim.workload.count import WorkloadCount, count_built
from tests.conftest import pipesim
from tests.helpers import H100


@cache
def gpt() -> WorkloadCount:
    return count_built("gpt", dict(layers=2, width=64, heads=4, seq_len=32, vocab=100), 2, torch.bfloat16)


def profiles(**kwargs):
    return [estimate_profile(gpt(), H100, Parallelism(pipeline=2, data=4, **kwargs, ema=ema))
            for ema in (None, "gpu", "cpu")]


@pytest.mark.parametrize("sharded", [False, True])
def test_an_average_on_the_gpu_holds_four_bytes_a_weight_as_the_master_copy_is_sharded(sharded):
    none, gpu, cpu = profiles(sharded_optimizer=sharded)
    for before, after, host in zip(none.layers, gpu.layers, cpu.layers):
        weights = before.param_bytes // 2  # bf16
        assert after.optimizer_state_bytes["adam"] - before.optimizer_state_bytes["adam"] == \
            4 * weights // (4 if sharded else 1)
        assert host.optimizer_state_bytes == before.optimizer_state_bytes
    for before, after, host in zip(none.stages, gpu.stages, cpu.stages):
        weights = sum(layer.param_bytes // 2 for layer in none.layers[before.layers[0]:before.layers[1]])
        extra_ms = after.steps["adam"].step.median_ms - before.steps["adam"].step.median_ms
        assert extra_ms == pytest.approx(12 * weights / (4 if sharded else 1) / (
            H100.memory_bandwidth_gb_s * 1e6 * H100.curve.memory_efficiency))
        assert host.steps == before.steps


def test_a_bad_place_is_refused_in_one_line():
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "-p", "2",
                             "--ema", "disk")
    assert code == 2 and "--ema: choose from gpu, cpu (got 'disk')" in err and len(err.splitlines()) == 1
    with pytest.raises(EstimateError, match="ema: choose from"):
        Parallelism(ema="disk")
