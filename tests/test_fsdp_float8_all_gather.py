"""`--fsdp-float8-all-gather`: FSDP2's float8 all-gather as torchtitan runs it with torchao
(`enable_fsdp_float8_all_gather`, `precompute_float8_dynamic_scale_for_fsdp`; planning/fp8.py): the float8 linears'
weights all-gathered and held whole at 1 byte an element, their shard cast before each all-gather instead of every
pass casting the weight, and the scales computed once after the step."""

from dataclasses import replace

import pytest

from pipesim.planning.scenario import CollectiveLink, collective_costs
from pipesim.schedules import build_schedule
from pipesim.schedules.catalogue import METHODS
from pipesim.sim import Cluster, Costs, simulate
from pipesim.units import MIB
from tests.conftest import pipesim
from tests.helpers import H100

GB_PER_S = 1e6  # bytes per ms in a GB/s
WIDTH, FFN, LAYERS, D = 256, 512, 2, 4


def _costs(all_gather_mb: float | None, gather_cast_ms: float = 0.0):
    """1F1B over 2 stages, d = 2, ZeRO-3, 100 MiB of 16-bit weights a stage, all-gathered as `all_gather_mb`."""
    schedule = build_schedule("1f1b", METHODS["1f1b"].params(2, 4, 2, data_parallel=2, zero=3))
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, precision="fsdp2")
    gathered = None if all_gather_mb is None else round(all_gather_mb * MIB)
    costs = replace(costs, stages=tuple(replace(c, all_gather_bytes=gathered, gather_cast_ms=gather_cast_ms)
                                        for c in costs.stages))
    return schedule, collective_costs(costs, schedule, CollectiveLink(0.0, 20 * GB_PER_S, "test"))


def test_the_gather_moves_and_the_stage_holds_the_weights_as_all_gathered():
    """Half the weights' bytes all-gathered (every weight a float8 linear's): the GATHER moves half and adds the
    cast before it; the whole weights held from it are half, the float32 shards and gradients as they were."""
    schedule, sixteen_bit = _costs(None)
    _, float8 = _costs(50.0, gather_cast_ms=0.25)
    half = collective_costs(replace(sixteen_bit, stages=tuple(replace(c, param_bytes=c.param_bytes // 2)
                                                               for c in sixteen_bit.stages)),
                            schedule, CollectiveLink(0.0, 20 * GB_PER_S, "test"))
    assert float8.stages[0].gather_ms == pytest.approx(half.stages[0].gather_ms + 0.25)
    parts = [simulate(schedule, costs, Cluster.uniform(2, 0.0)).meta.peak_memory_parts[0]
             for costs in (sixteen_bit, float8)]
    assert parts[0]["parameters"] - parts[1]["parameters"] == 50 * MIB
    assert parts[0]["gradients"] == parts[1]["gradients"]
    assert parts[0]["optimizer_state"] == parts[1]["optimizer_state"]


@pytest.fixture(scope="module")
def estimates():
    """A small Llama-shaped gpt's estimates under FSDP2 over d = 4 with torchao's float8, with and without the
    float8 all-gather."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=LAYERS, width=WIDTH, heads=4, seq_len=128, vocab=1000), 2,
                          torch.bfloat16)
    parallel = Parallelism(data=D, sharded_optimizer=True, precision="fsdp2", fp8="torchao")
    return counted, [estimate_profile(counted, H100, replace(parallel, fsdp_float8_all_gather=on), bounds=[0, 4])
                     for on in (False, True)]


def test_a_blocks_linear_weights_are_gathered_at_one_byte_and_their_casts_leave_the_passes(estimates):
    """Each block's float8 linears (the count's forward products of shape (1, m, n, k)): their n x k weights at 1
    byte where bf16 has 2, and a float32 scale each; the embedding and head as they are. No pass casts a weight,
    so each pass of a block is faster; the stage casts its shard before each all-gather, and its step computes the
    scales."""
    counted, (plain, gathered) = estimates
    for layer, before, after in zip(counted.layers, plain.layers, gathered.layers):
        weights = [op.count * op.shape[2] * op.shape[3] for op in layer.ops["fwd"]
                   if op.kind == "matmul" and op.shape[0] == 1]
        block = any(op.kind in ("attention", "matmul") and op.shape[0] > 1 for op in layer.ops["fwd"])
        assert before.all_gather_bytes is None
        if block:
            assert after.all_gather_bytes == after.param_bytes - sum(weights) + 4 * len(weights)
            assert after.fwd.median_ms < before.fwd.median_ms and after.bwd.median_ms < before.bwd.median_ms
        else:
            assert after.all_gather_bytes == after.param_bytes
            assert after.fwd == before.fwd and after.bwd == before.bwd
    stage_before, stage_after = plain.stages[0], gathered.stages[0]
    assert stage_before.gather_cast_ms == 0.0 < stage_after.gather_cast_ms
    assert stage_after.all_gather_bytes == sum(layer.all_gather_bytes for layer in gathered.layers)
    assert stage_after.steps["adam"].step.median_ms > stage_before.steps["adam"].step.median_ms


def test_the_simulated_run_holds_fewer_whole_weights_and_gathers_faster(estimates):
    """The same estimates simulated with --zero 3: device 0's parameters at the peak lower by the float8 bytes
    saved of the weights it holds whole, and each GATHER shorter (half the linears' bytes on the link)."""
    from pipesim.planning.scenario import profile_costs

    _, profiles = estimates
    schedule = build_schedule("1f1b", METHODS["1f1b"].params(1, 2, 2, data_parallel=D, zero=3))
    link = CollectiveLink(0.0, 20 * GB_PER_S, "test")
    runs = [collective_costs(profile_costs(p, "adam", [0, 4]), schedule, link) for p in profiles]
    stage = runs[1].stages[0]
    assert stage.gathered_weight_bytes < stage.param_bytes
    assert stage.gather_ms < runs[0].stages[0].gather_ms
    peaks = [simulate(schedule, costs, Cluster.uniform(1, 0.0)).meta.peak_memory_parts[0]["parameters"]
             for costs in runs]
    # one stage: two neighbours' whole weights held at once, as all-gathered
    pair = stage.gathered_bytes
    assert peaks[0] - peaks[1] == pair - pair * stage.gathered_weight_bytes // stage.param_bytes


@pytest.mark.parametrize(("flags", "named"), [
    (["--dtype", "bf16", "--zero", "3", "--precision", "fsdp2"], "give --dtype fp8"),
    (["--dtype", "fp8", "--zero", "3", "--precision", "fsdp2"], "--fp8-recipe te"),
    (["--dtype", "fp8", "--fp8-recipe", "torchao", "--zero", "1"], "--precision not given"),
])
def test_without_torchaos_float8_under_fsdp2_the_flag_is_one_line_and_exit_2(flags, named):
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                             "--seq-len", 32, "--gpu", "h100-sxm", "-p", 1, "-m", 1, "-s", "gpipe",
                             "--data-parallel", 2, *flags, "--fsdp-float8-all-gather")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "--fsdp-float8-all-gather" in err and named in err


def test_the_parallelism_refuses_a_recipe_that_casts_no_weight_per_use_naming_each_that_does():
    """Outside the CLI too (tune and the benchmarks build a Parallelism): te casts its weights once a step, so
    FSDP2 has no per-use cast to move before its all-gather; the message names every recipe that has one."""
    from pipesim.planning.estimate import EstimateError, Parallelism

    with pytest.raises(EstimateError, match=r"give fp8 torchao or torchao-2024 and precision fsdp2 \(got fp8 te, "):
        Parallelism(data=D, sharded_optimizer=True, precision="fsdp2", fp8="te", fsdp_float8_all_gather=True)
    Parallelism(data=D, sharded_optimizer=True, precision="fsdp2", fp8="torchao-2024", fsdp_float8_all_gather=True)


def test_tune_does_not_offer_it_since_it_takes_no_zero_or_precision():
    """tune runs no FSDP2 (it has no --zero or --precision), so the flag could only be refused there: it is not one
    of tune's, and estimate, simulate and sweep keep it."""
    for command in ("estimate", "simulate", "sweep", "tune"):
        code, out, _ = pipesim(command, "--help")
        assert code == 0 and ("--fsdp-float8-all-gather" in out) == (command != "tune"), command
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "-D", 8, "--dtype", "fp8",
                             "--fp8-recipe", "torchao", "--fsdp-float8-all-gather")
    assert (code, out, err) == (2, "", "error: `pipesim tune` has no option --fsdp-float8-all-gather (simulate, "
                                       "sweep and estimate take it); see `pipesim tune --help`\n")
