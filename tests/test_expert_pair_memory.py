"""An overlapped F&B pair's activations: Megatron-core's pair runs the forward's layer i beside the backward's layer
L-1-i and frees each backward layer's state as it goes (model_chunk_schedule_plan.py at Megatron-LM 01cf4fb5), so
while it runs the device holds the older micro-batch's activations and one layer of the newer one's, not both
micro-batches' (sim/costs.py `StageCosts.pair_layer_bytes`)."""

from __future__ import annotations

from dataclasses import replace

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import Costs
from pipesim.sim.engine import simulate
from pipesim.traces.metrics import summarize
from tests.conftest import simulate_json

MIB = 2**20
GPT = ("--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000,
       "--gated", "--experts", 8, "--top-k", 2, "--expert-ffn", 512, "--gpu", "h100-sxm", "-p", 1, "-m", 4,
       "-s", "1f1b", "--data-parallel", 2, "--expert-parallel", 2)


def peak_activations_mib(pair_layer_bytes: int | None) -> tuple[float, int]:
    """One stage of 8 MiB of activations a micro-batch, each forward after the first paired with the backward
    before it: the peak activations (MiB) and micro-batches held."""
    schedule = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=4, expert_parallel=2,
                                                     overlap_expert_comm=True))
    costs = Costs.per_stage(1, fwd_ms=2, bwd_ms=4, activation_mb=8.0)
    costs = replace(costs, stages=tuple(replace(s, pair_layer_bytes=pair_layer_bytes) for s in costs.stages))
    (device,) = summarize(simulate(schedule, costs, Cluster.uniform(1, 0.0))).devices
    return device.peak_memory_parts_mb["activations"], device.peak_activations


def test_a_pair_holds_one_micro_batch_and_one_layer_of_the_next():
    assert peak_activations_mib(1 * MIB) == (8 + 1, 2)  # the older micro-batch's, and a layer of the newer
    assert peak_activations_mib(None) == (2 * 8, 2)  # a layer not known: both micro-batches, as before


def test_simulate_counts_the_pair_as_a_micro_batch_and_its_largest_layer():
    """A profile's stage knows its layers: with the overlap the 4 blocks' stage holds more than one micro-batch's
    activations (the newer micro-batch's first layer beside the older's) and less than two (before: two)."""
    (alone,) = simulate_json(*GPT)
    (paired,) = simulate_json(*GPT, "--overlap-expert-comm")
    one = alone["devices"][0]["peak_memory_parts_mb"]["activations"]
    held = paired["devices"][0]["peak_memory_parts_mb"]["activations"]
    assert one < held < 1.5 * one


def test_a_pair_without_all_to_alls_keeps_both_micro_batches():
    """DualPipeV's F&B without expert parallelism: its example overlapped_forward_backward runs the whole forward,
    then the backward, so a known layer size changes nothing."""
    schedule = build_schedule("dualpipev", ScheduleParams(stages=2, microbatches=8, chunks=2))
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=2, bwd_ms=4, activation_mb=8.0)
    peaks = []
    for layer in (None, 1 * MIB):
        known = replace(costs, stages=tuple(replace(s, pair_layer_bytes=layer) for s in costs.stages))
        devices = summarize(simulate(schedule, known, Cluster.uniform(schedule.num_devices, 0.0))).devices
        peaks.append([device.peak_memory_parts_mb["activations"] for device in devices])
    assert peaks[0] == peaks[1] and max(peaks[0]) > 0
