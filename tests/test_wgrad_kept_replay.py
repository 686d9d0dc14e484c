"""Under a split backward the caching allocator's replay holds from a layer's input pass (I) to its weight pass (W)
what the simulation holds (sim/engine.py `_memory_tables`, `Costs.wgrad_held_bytes`): Megatron-LM's deferred W
the products' saved inputs and output gradients (`LayerAllocations.wgrad_kept`, `wgrad_gradients`), torch's pipelining
the whole forward (None), so the replay's allocated peak is the simulation's and its reserve is read against it."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim import caching_allocator as allocator
from pipesim.sim.caching_allocator import LayerAllocations, device_rows, replay_device, stage_program
from pipesim.sim.costs import held_as_runtime
from pipesim.units import MIB
from tests.conftest import build, pipesim

# A stage of one layer: its forward leaves 10 storages live (the frame); its I keeps two of them (the products'
# inputs) and makes two output gradients for its W. Each 10 MiB or more and a multiple of 2 MiB: a segment of its
# own, and a cached block it takes is split wherever larger (by 2 MiB or more), so no block is rounded up
FRAME = [(number, (10 + 2 * number) * MIB) for number in range(10)]
INPUTS = frozenset({2, 7})
GRADIENTS = (12 * MIB, 16 * MIB)
LAYER = LayerAllocations({"fwd": FRAME}, wgrad_kept=INPUTS, wgrad_gradients=GRADIENTS)


def peaks(layer: LayerAllocations, pp_runtime: str, method: str) -> list[tuple[int, int]]:
    """Per device of `method` at p = 4, m = 8: (the replay's allocated peak, the simulation's peak) with the
    stages' activations the frame, what W reads the kept inputs and gradients, held as `pp_runtime` holds them."""
    schedule = build(method, 4, 8)
    kept = sum(nbytes for number, nbytes in FRAME if number in INPUTS)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(costs, stages=tuple(replace(c, activation_bytes=sum(nbytes for _, nbytes in FRAME),
                                                wgrad_kept_bytes=kept, wgrad_gradient_bytes=sum(GRADIENTS))
                                        for c in costs.stages))
    trace = simulate(schedule, held_as_runtime(costs, schedule, pp_runtime), Cluster.uniform(4, 0.0))
    result = []
    for device in range(schedule.num_devices):
        rows = device_rows(trace, device)
        programs = {stage: stage_program([layer]) for _, stage, _ in rows}
        replayed = replay_device((), rows, programs)
        result.append((replayed.peak_allocated_bytes, int(np.max(trace.counters["memory_bytes"][device].values))))
    return result


@pytest.mark.parametrize("method", ["zb-h1", "zb-h2"])
def test_the_replays_allocated_peak_is_the_simulations_under_a_deferred_weight_pass(method):
    """Megatron-LM's store (`--pp-runtime pipesim`): the I frees the frame but the inputs and makes the output
    gradients, the W frees them; torch's retained graph (`--pp-runtime torch`) holds the whole frame to W. Either
    way each device's allocated peak is the simulation's, to the byte."""
    stored = peaks(LAYER, "pipesim", method)
    assert all(replayed == simulated for replayed, simulated in stored), stored
    retained = peaks(replace(LAYER, wgrad_kept=None), "torch", method)
    assert all(replayed == simulated for replayed, simulated in retained), retained
    assert any(whole > kept for (whole, _), (kept, _) in zip(retained, stored, strict=True))  # ZB's Ws wait


def test_a_stage_fed_by_the_batch_runs_no_input_gradient_and_its_whole_backward_in_w():
    """`runs` (profiles/schema.py `stage_passes`): the first stage's I runs none of its layers' input-gradient
    passes (their transient is never made), so it frees none of the frame and makes none of the output gradients
    (`fed_by_the_batch`), and its W runs their full backward on the whole frame, as the simulation prices them."""
    layer = replace(LAYER, passes={"fwd": FRAME, "igrad": [(0, 40 * MIB), (0, -40 * MIB)],
                                   "bwd": [(0, 30 * MIB), (0, -30 * MIB)], "wgrad": [(0, 1 * MIB), (0, -1 * MIB)]})
    rows = [("fwd", 0, 0), ("igrad", 0, 0), ("wgrad", 0, 0)]
    frame = sum(nbytes for _, nbytes in FRAME)
    own = replay_device((), rows, {0: stage_program([layer])}).peak_allocated_bytes
    fed = replay_device((), rows, {0: stage_program([layer], runs={"igrad": None, "wgrad": "bwd"})})
    assert own == frame + 40 * MIB
    assert fed.peak_allocated_bytes == frame + 30 * MIB  # the frame kept whole and no gradients made: not 66 + 30


@pytest.mark.parametrize("pp_runtime", ["pipesim", "torch"])
def test_a_first_stage_replays_the_whole_frame_held_from_i_to_w_as_the_simulation_holds_it(pp_runtime):
    """ZB-H1's first stage: fed by the batch alone, its I keeps the whole frame and makes no gradients (its costs'
    kept bytes the activations, no gradient bytes: profiles/schema.py `wgrad_held_ranges`), and its W's full backward
    makes 300 MiB on it, in the replay as in the simulation, to the byte, on every device (keeping the products'
    inputs and output gradients alone, the replay's first device peaked 124 MiB below the simulation's)."""
    schedule = build("zb-h1", 4, 8)
    frame = sum(nbytes for _, nbytes in FRAME)
    kept = sum(nbytes for number, nbytes in FRAME if number in INPUTS)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(costs, stages=tuple(replace(c, activation_bytes=frame, wgrad_kept_bytes=frame if k == 0 else kept,
                                                wgrad_gradient_bytes=0 if k == 0 else sum(GRADIENTS),
                                                transient_bytes={"wgrad": 300 * MIB} if k == 0 else {})
                                        for k, c in enumerate(costs.stages)))
    trace = simulate(schedule, held_as_runtime(costs, schedule, pp_runtime), Cluster.uniform(4, 0.0))
    layer = LAYER if pp_runtime == "pipesim" else replace(LAYER, wgrad_kept=None)
    fed = replace(layer, passes={"fwd": FRAME, "bwd": [(0, 300 * MIB), (0, -300 * MIB)]})
    for device in range(schedule.num_devices):
        rows = device_rows(trace, device)
        programs = {stage: stage_program([fed], runs={"igrad": None, "wgrad": "bwd"}) if stage == 0 else
                    stage_program([layer]) for _, stage, _ in rows}
        replayed = replay_device((), rows, programs).peak_allocated_bytes
        assert replayed == int(np.max(trace.counters["memory_bytes"][device].values)), device


def test_the_weight_pass_keeps_the_storages_the_products_read():
    """`LayerAllocations.wgrad_kept` holds each weighted product's input where the forward made it: in a GPT block
    the two norms' outputs (q, k and v's, the first MLP product's), the attention's context (the projection's; not
    the query or the key before it, as large) and the activation's output (the second MLP product's; not the first
    product's output, as large), the storages the ops making the products' outputs read (`forward_reads`)."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, layer_allocations
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=1, width=256, heads=4, seq_len=128, vocab=1000), 2, torch.float16)
    block = counted.layers[1]
    made = {number: (shape, op) for number, shape, nbytes, op in block.allocations["fwd"] if nbytes > 0}
    weighted = {shape for shape, _, _ in block.weight_grad_outputs}
    reads = dict(block.forward_reads)
    read = {number for product, shape in block.product_allocations["fwd"] if shape in weighted
            for number in reads[product]}
    for recompute in ("none", "selective", "full"):
        kept = layer_allocations(counted, Parallelism(recompute=recompute))[1].wgrad_kept
        assert kept == read, recompute
    assert sorted(made[number] for number in kept) == [
        ((2, 128, 4, 64), "clone"), ((2, 128, 256), "native_layer_norm"), ((2, 128, 256), "native_layer_norm"),
        ((2, 128, 1024), "gelu")]


GPT = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
       "--vocab", 1000, "-D", 4, "-B", 32, "-b", 2, "--tensor-parallel", 1, "--data-parallel", 2, "--recompute", "none",
       "-s", "zb-h1")


def test_the_4_gpu_gpts_zb_h1_replays_its_last_stage_within_what_the_simulation_holds(monkeypatch):
    """The 4-GPU GPT's ZB-H1 at p = 2, d = 2, b = 2 (tests/test_tune_reserve.py's model): the last device's stage
    keeps from I to W what Megatron-LM's store does, so its replay allocates no more than the simulation holds
    (223.0 MiB against 224.9), where holding each micro-batch's forward whole to W it allocated 243.2."""
    import pipesim.planning.scenario as scenario

    replayed, simulated = [], []
    real_replay, real_reserves = allocator.replay_device, scenario.device_reserves

    def replay(*args, **kwargs):
        result = real_replay(*args, **kwargs)
        replayed.append(result.peak_allocated_bytes)
        return result

    def reserves(trace, *args, **kwargs):
        simulated.extend(int(np.max(curve.values)) for curve in trace.counters["memory_bytes"])
        return real_reserves(trace, *args, **kwargs)

    monkeypatch.setattr(allocator, "replay_device", replay)
    monkeypatch.setattr(scenario, "device_reserves", reserves)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # the search in this process, where the spies are
    allocator._reserve.cache_clear()
    code, out, err = pipesim("tune", *GPT, "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    assert (choice["schedule"], choice["stages"], choice["replicas"]) == ("zb-h1", 2, 2)
    assert len(replayed) == len(simulated) == 2 and replayed[1] <= simulated[1]
