"""Data parallelism as rows of the IR: the REDUCE (and ZeRO-1's GATHER) pass, and its checks."""

from dataclasses import asdict, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.planning.scenario import CollectiveLink, Scenario, fitted_link, profile_scenario
from pipesim.profiles.schema import Estimate, EstimateLink, load_profile
from pipesim.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    build_schedule,
    lower,
    preflight,
)
from pipesim.schedules.catalogue import METHODS
from pipesim.schedules.torch_csv import to_torch_csv
from pipesim.sim import Cluster, Costs, Link, simulate
from pipesim.traces import Stream, read_trace, summarize, write_trace
from pipesim.units import MIB
from tests.conftest import pipesim, refused
from tests.helpers import A100, GPT_CPU

_SYNCHRONOUS_BUILT = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "pipedream", "xpipe", "avgpipe")


def _params(name: str, **extra) -> ScheduleParams:
    """Small shapes every method listed accepts (m a multiple of p, m >= 2p)."""
    return METHODS[name].params(2, 4, 2, **extra)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(_SYNCHRONOUS_BUILT), st.integers(2, 4), st.booleans())
def test_one_reduce_per_update_after_the_stages_last_backward(name, d, sharded):
    plain = build_schedule(name, _params(name))
    schedule = build_schedule(name, _params(name, data_parallel=d, zero=int(sharded)))
    preflight(schedule, dry_run=True)
    assert schedule.data_parallel == d and schedule.sharded_optimizer is sharded
    for before, after in zip(plain.orders, schedule.orders):
        # The pass only inserts: the method's own order is untouched.
        assert [a for a in after if a.kind not in (Kind.REDUCE, Kind.GATHER)] == list(before)
        for i, a in enumerate(after):
            if a.kind is not Kind.OPT:
                continue
            step = (a.stage, a.minibatch, a.pipeline)
            mine = [(j, b) for j, b in enumerate(after) if (b.stage, b.minibatch, b.pipeline) == step]
            reduces = [j for j, b in mine if b.kind is Kind.REDUCE]
            gathers = [j for j, b in mine if b.kind is Kind.GATHER]
            assert len(reduces) == 1 and len(gathers) == int(sharded)
            last_grad = max(j for j, b in enumerate(after[:i]) if b.kind in (Kind.B, Kind.W)
                            and (b.stage, b.pipeline) == (a.stage, a.pipeline))
            assert reduces[0] == last_grad + 1  # right after the stage's last backward, on its device
            assert gathers == ([i + 1] if sharded else [])
    # Text round-trip, as every other row.
    assert Schedule.orders_from_text(schedule.to_text()) == tuple(tuple(o) for o in schedule.orders)


def test_a_reduce_overlaps_the_other_chunks_backward_on_a_v_device():
    schedule = build_schedule("zb-v", _params("zb-v", data_parallel=2))
    order = [str(a) for a in schedule.orders[0]]
    # Device 0 holds stages 0 and 3: stage 3 finishes its backward first, and its all-reduce runs while
    # stage 0's last input- and weight-gradients still do.
    assert order.index("3REDUCE.1") < order.index("0W3.1") < order.index("0REDUCE.1")


def test_text_forms_parse():
    assert Action.parse("1REDUCE.2") == Action(Kind.REDUCE, 1, -1, 2)
    assert str(Action(Kind.GATHER, 0, -1, 3, 1)) == "P1:0GATHER.3"


def test_checks_refuse_a_misplaced_or_missing_reduce():
    schedule = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=2))
    orders = [list(o) for o in schedule.orders]
    reduce_at = next(i for i, a in enumerate(orders[1]) if a.kind is Kind.REDUCE)
    moved = orders[1].pop(reduce_at)
    orders[1].insert(0, moved)  # before the stage's gradients exist
    with pytest.raises(ScheduleError, match="REDUCE"):
        preflight(schedule.with_orders(tuple(map(tuple, orders))))
    orders[1].pop(0)  # no REDUCE at all with d = 2
    with pytest.raises(ScheduleError, match=r"1REDUCE appears 0 times \(d = 2: 1 per update\)"):
        preflight(schedule.with_orders(tuple(map(tuple, orders))))


def test_d_must_be_a_whole_number():
    with pytest.raises(ScheduleError, match=r"data_parallel: give a whole number of at least 1 \(got 0\)"):
        ScheduleParams(2, 2, data_parallel=0)
    for zero in (True, 4, "1"):
        with pytest.raises(ScheduleError, match="zero: choose from 0, 1, 2, 3"):
            ScheduleParams(2, 2, data_parallel=2, zero=zero)


def test_lowering_reads_no_weights_in_a_collective_and_torch_csv_leaves_it_out():
    schedule = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=2, zero=1))
    lowered = lower(schedule)
    collective = np.isin([a.kind for o in schedule.orders for a in o], [Kind.REDUCE, Kind.GATHER])
    assert np.all(np.asarray(lowered.version)[lowered.origin >= 0][collective] == -1)
    assert to_torch_csv(schedule) == to_torch_csv(build_schedule("1f1b", ScheduleParams(2, 2)))


def _with_collectives(costs: Costs, reduce_ms, gather_ms=0.0) -> Costs:
    """`costs` with each stage's REDUCE (a list: per stage) and GATHER network times."""
    reduce_ms = reduce_ms if isinstance(reduce_ms, list) else [reduce_ms] * len(costs.stages)
    return replace(costs, stages=tuple(replace(c, reduce_ms=r, gather_ms=gather_ms)
                                       for c, r in zip(costs.stages, reduce_ms)))


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.integers(0, 20),
       st.integers(0, 3), st.booleans())
def test_1f1b_iteration_is_the_pipeline_plus_the_first_stages_all_reduce(p, m, fwd, bwd, reduce, opt, shared):
    """Stage 0 ends its backwards last, at (m + p - 1)(f + b); its all-reduce then runs with nothing left to
    hide it, and its OPT waits for it: the iteration is that, plus the all-reduce, plus the update. (With
    links that queue, the simulator runs in SimPy's timed mode: the same numbers.)"""
    schedule = build_schedule("1f1b", ScheduleParams(p, m, data_parallel=2))
    costs = _with_collectives(Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd, opt_ms=opt), reduce)
    link = Link(resource="shared") if shared else Link()
    trace = simulate(schedule, costs, Cluster(p, link))
    summary = summarize(trace)
    assert summary.makespan_ms == (m + p - 1) * (fwd + bwd) + reduce + opt
    assert summary.devices[0].exposed_collective_ms == reduce
    plain = summarize(simulate(build_schedule("1f1b", ScheduleParams(p, m)), costs, Cluster(p, link)))
    assert summary.makespan_ms == plain.makespan_ms + reduce
    assert summary.samples_per_s == pytest.approx(2 * plain.samples_per_s * plain.makespan_ms / summary.makespan_ms)


def test_a_v_device_hides_one_chunks_all_reduce_behind_the_other_chunks_backward():
    schedule = build_schedule("zb-v", METHODS["zb-v"].params(2, 4, 1, data_parallel=2))
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, opt_ms=0.5)
    baseline = simulate(schedule, _with_collectives(costs, 0.0), Cluster.uniform(2, 0.0))

    def times(trace, kind):
        """Start and end of stage 3's row of `kind` (stage 3 is device 0's second chunk)."""
        i = np.flatnonzero((trace.ops.stage == 3) & (trace.ops.kind == trace.kind_code(kind)))[0]
        return trace.ops.start_us[i] / 1e3, trace.ops.end_us[i] / 1e3

    # Stage 3 issues its all-reduce when its backward ends; device 0 still has stage 0's last backward parts
    # and update to run before stage 3's update.
    slack = times(baseline, "OPT")[0] - times(baseline, "REDUCE")[0]
    assert slack > 0
    hidden = simulate(schedule, _with_collectives(costs, [0.0, 0.0, 0.0, slack]), Cluster.uniform(2, 0.0))
    assert summarize(hidden).makespan_ms == summarize(baseline).makespan_ms
    reduce_start, reduce_end = times(hidden, "REDUCE")
    assert reduce_end - reduce_start == slack
    late = simulate(schedule, _with_collectives(costs, [0.0, 0.0, 0.0, slack + 2.5]), Cluster.uniform(2, 0.0))
    reduce_end = times(late, "REDUCE")[1]
    assert reduce_end == times(baseline, "OPT")[0] + 2.5
    # Stage 0's all-reduce queues behind it on device 0's network, so both updates wait for its end; the 2.5 ms
    # more (device 0 has nothing left to compute) are exposed.
    assert times(late, "OPT")[1] == reduce_end + 2 * 0.5
    assert summarize(late).devices[0].exposed_collective_ms == summarize(hidden).devices[0].exposed_collective_ms + 2.5


def test_after_the_flush_no_reduce_overlaps_a_backward_and_the_hidden_all_reduce_shows():
    """`reduce_after_flush` (Megatron-LM's DDP): a device's REDUCEs come after its last backward, every stage's,
    in the order of the updates; the method's own order is untouched. The all-reduce zb-v's device 0 hid behind
    stage 0's last backward parts now adds to the iteration."""
    params = METHODS["zb-v"].params(2, 4, 1, data_parallel=2)
    overlapped = build_schedule("zb-v", params)
    flushed = build_schedule("zb-v", replace(params, reduce_after_flush=True))
    preflight(flushed, dry_run=True)
    assert flushed.reduce_after_flush and not overlapped.reduce_after_flush
    for plain, after in zip(overlapped.orders, flushed.orders):
        assert [a for a in after if a.kind is not Kind.REDUCE] == [a for a in plain if a.kind is not Kind.REDUCE]
        kinds = [a.kind for a in after]
        last_grad = max(i for i, k in enumerate(kinds) if k in (Kind.B, Kind.W))
        reduces = [a.stage for i, a in enumerate(after) if a.kind is Kind.REDUCE]
        assert [i for i, k in enumerate(kinds) if k is Kind.REDUCE] == list(range(last_grad + 1,
                                                                                  last_grad + 1 + len(reduces)))
        assert reduces == [a.stage for a in after if a.kind is Kind.OPT]
    # Device 0's last backward (stage 0's W) ends at 24 ms, device 1's update at 26 ms. Overlapped, stage 3's 3 ms
    # all-reduce ran from 20 ms (its W's end) to 23 ms; after the flush it runs from 24 ms, and stage 3's update
    # (after stage 0's, 0.5 ms, which hides 0.5 ms of it) waits for it: 27.5 ms.
    costs = _with_collectives(Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, opt_ms=0.5), [0.0, 0.0, 0.0, 3.0])
    hidden, shown = (summarize(simulate(s, costs, Cluster.uniform(2, 0.0))) for s in (overlapped, flushed))
    assert (hidden.makespan_ms, hidden.devices[0].exposed_collective_ms) == (26.0, 0.0)
    assert (shown.makespan_ms, shown.devices[0].exposed_collective_ms) == (27.5, 2.5)
    with pytest.raises(ScheduleError, match=r"reduce_after_flush: give true or false \(got 1\)"):
        replace(params, reduce_after_flush=1)


def test_collectives_on_one_device_run_one_after_another():
    """Device 0's two all-reduces share its network: the second begins when the first ends."""
    schedule = build_schedule("zb-v", METHODS["zb-v"].params(2, 4, 1, data_parallel=2))
    costs = _with_collectives(Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0), 100.0)
    trace = simulate(schedule, costs, Cluster.uniform(2, 0.0))
    network = np.flatnonzero((trace.ops.device == 0) & (trace.ops.stream == Stream.NETWORK))
    first, second = sorted(network, key=lambda i: trace.ops.start_us[i])
    assert trace.ops.start_us[second] == trace.ops.end_us[first]


def test_a_sharded_optimizer_keeps_a_dth_of_the_state_and_gathers_after_the_update():
    params = dict(stages=2, microbatches=2, minibatches=2)
    costs = _with_collectives(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=1.0, param_mb=8.0, optimizer="adam"), 1.0, 2.0)
    full = simulate(build_schedule("1f1b", ScheduleParams(**params, data_parallel=4)), costs, Cluster.uniform(2, 0))
    sharded = simulate(build_schedule("1f1b", ScheduleParams(**params, data_parallel=4, zero=1)),
                       costs, Cluster.uniform(2, 0))
    state = 2 * 8 * MIB  # Adam: two moments of 8 MiB of weights
    for d in range(2):
        assert full.counters["memory_bytes"][d].values[0] - sharded.counters["memory_bytes"][d].values[0] == (
            state - state // 4)
    # Stage 0's next forward waits for the weights its GATHER brings: its backwards end at (m + p - 1)(f + b)
    # = 6 ms, then the reduce-scatter (1 ms), the update (0 ms) and the all-gather (2 ms).
    labels = [sharded.op_label(i) for i in range(len(sharded.ops))]
    gather, forward = labels.index("GATHER"), labels.index("F0.1")
    assert sharded.ops.device[forward] == 0 and sharded.ops.start_us[forward] == sharded.ops.end_us[gather] == 9e3


def _what_if(**extra) -> Scenario:
    per_stage = {"--fwd": [1.0], "--bwd": [2.0], "--param-mb": [64.0], "--activation-mb": [0.0], "--output-mb": [0.0]}
    return Scenario(per_stage=per_stage, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None, avg_ms=None,
                    optimizer="adam", microbatch_size=1, comm_ms=0.01, overlap_comm=True, per="stage", **extra)


def test_typed_costs_price_the_all_reduce_on_comm_per_ring_step_and_the_network_bandwidth():
    grads = 64 * MIB
    sched = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=4))
    stage = _what_if(network_gb_s=10.0).costs(sched).stages[0]
    # Ring: 2(d-1) steps of 0.01 ms and 2(d-1)/d of the gradients through each GPU's 10 GB/s (1e7 bytes/ms);
    # the tree's 2·log2(d) steps move 2 buffers at 92 % of it, slower here.
    assert stage.reduce_ms == pytest.approx(6 * 0.01 + grads * 6 / 4 / 1e7) and stage.gather_ms == 0.0
    sharded = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=4, zero=1))
    stage = _what_if(network_gb_s=10.0).costs(sharded).stages[0]
    assert stage.reduce_ms == stage.gather_ms == pytest.approx(3 * 0.01 + grads * 3 / 4 / 1e7)
    # ZeRO-3 under FSDP2's precision: the float32 gradients (twice the 16-bit weights) are reduce-scattered
    fsdp = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=4, zero=3))
    stage = _what_if(network_gb_s=10.0, precision="fsdp2").costs(fsdp).stages[0]
    assert stage.reduce_ms == pytest.approx(3 * 0.01 + 2 * grads * 3 / 4 / 1e7)
    assert stage.gather_ms == pytest.approx(3 * 0.01 + grads * 3 / 4 / 1e7)
    # Without a bandwidth, --comm alone: the tree's 2·log2(4) latency steps.
    assert _what_if().costs(sched).stages[0].reduce_ms == pytest.approx(4 * 0.01)
    assert _what_if().costs(build_schedule("1f1b", ScheduleParams(2, 2))).stages[0].reduce_ms == 0.0


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("precision, grads_per_weight", [("fp32", 1), ("megatron", 2), ("megatron-16bit-grads", 1),
                                                        ("megatron-bf16-moments", 2), ("nemo-bf16-adam", 1)])
def test_the_replicas_reduce_the_gradients_as_the_precision_accumulates_them(precision, grads_per_weight, zero):
    """Megatron-LM accumulates and reduces float32 main gradients under --bf16 (megatron/training/arguments.py
    sets accumulate_allreduce_grads_in_fp32 unless --grad-reduce-in-bf16: DistributedDataParallelConfig's
    grad_reduce_in_fp32): its REDUCE, an all-reduce or a reduce-scatter, moves twice the 16-bit weights' bytes at
    every ZeRO stage; megatron-16bit-grads and NeMo's bf16 grad_sync_dtype reduce in 16 bits, fp32 its weights'
    bytes. The GATHER brings the weights."""
    weights = 64 * MIB
    sched = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=4, zero=zero))
    stage = _what_if(network_gb_s=10.0, precision=precision).costs(sched).stages[0]
    if zero:
        assert stage.reduce_ms == pytest.approx(3 * 0.01 + grads_per_weight * weights * 3 / 4 / 1e7)
        assert stage.gather_ms == pytest.approx(3 * 0.01 + weights * 3 / 4 / 1e7)
    else:
        assert stage.reduce_ms == pytest.approx(6 * 0.01 + grads_per_weight * weights * 6 / 4 / 1e7)


@pytest.mark.parametrize("precision, grads_per_weight", [(None, 2), ("megatron-16bit-grads", 1)])
def test_an_estimates_replicas_reduce_the_gradients_as_its_precision_accumulates_them(precision, grads_per_weight):
    """A bf16 estimate under Megatron-LM's mixed precision (its default) all-reduces, or under ZeRO-1
    reduce-scatters, its float32 main gradients, twice its weights' bytes; with 16-bit gradients their bytes."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=4, width=512, heads=8, seq_len=512, vocab=8192), 1, torch.bfloat16)
    for zero in (0, 1):
        profile = estimate_profile(count, A100,
                                   Parallelism(data=4, sharded_optimizer=bool(zero), precision=precision))
        scenario = profile_scenario(profile, "adam")
        sched = scenario.build("1f1b", ScheduleParams(2, 4, data_parallel=4, zero=zero))
        link, stage = scenario.data_parallel_link(sched), scenario.costs(sched).stages[1]  # stage 0: buckets
        assert stage.grad_bytes == grads_per_weight * stage.param_bytes > 0
        collective = link.reduce_scatter_ms if zero else link.all_reduce_ms
        assert stage.reduce_ms == pytest.approx(collective(grads_per_weight * stage.param_bytes, 4), rel=1e-12)
        if zero:
            assert stage.gather_ms == pytest.approx(link.reduce_scatter_ms(stage.param_bytes, 4), rel=1e-12)


def test_a_calibrated_all_reduce_is_fitted_to_a_link():
    latency_ms, bytes_per_ms, ranks = 0.02, 1e6, 4
    points = [(n, 2 * (ranks - 1) * (latency_ms + n / ranks / bytes_per_ms)) for n in (4096, 65536, 1 << 20)]
    link = fitted_link(ranks, points)
    assert link.latency_ms == pytest.approx(latency_ms) and link.bytes_per_ms == pytest.approx(bytes_per_ms)


def test_a_profile_prices_the_reduce_rows_it_simulates():
    scenario = profile_scenario(load_profile(GPT_CPU), "adam")
    sched = scenario.build("1f1b", ScheduleParams(2, 4, data_parallel=2))
    costs = scenario.costs(sched)
    assert scenario.data_parallel_link(sched).source == "the profile's all-reduce over 2 ranks, fitted"
    assert all(c.reduce_ms > 0 for c in costs.stages)
    trace = simulate(sched, costs, scenario.links(sched))
    network = trace.ops.stream == Stream.NETWORK
    assert np.allclose(np.sort(trace.ops.dur_us[network]), np.sort([c.reduce_ms * 1e3 for c in costs.stages]))


def test_an_estimate_prices_on_its_data_parallel_link_and_its_state_is_divided_once():
    profile = load_profile(GPT_CPU)
    link = EstimateLink(kind="infiniband", latency_ms=0.014, bytes_per_ms=25e6)
    estimate = Estimate(gpu="h100-sxm", parallelism={"pipeline": 2, "data": 4, "sharded_optimizer": True},
                        attention="sdpa", curve={}, tensor_link=link, stage_link=link, data_parallel_link=link)
    measured, estimated = (profile_scenario(p, "adam")
                           for p in (profile, profile.model_copy(update={"estimate": estimate})))
    sched = estimated.build("1f1b", ScheduleParams(2, 4, data_parallel=4, zero=1))
    assert estimated.data_parallel_link(sched) == CollectiveLink(0.014, 25e6, "the estimate's infiniband")
    # The estimate holds one shard of the state per GPU; the simulator divides each replica's whole state by d.
    assert [c.optimizer_state_bytes for c in estimated.costs(sched).stages] == [
        4 * c.optimizer_state_bytes for c in measured.costs(sched).stages]


def test_a_trace_with_collectives_reads_back_whole(tmp_path):
    schedule = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=2, zero=1))
    trace = simulate(schedule, _with_collectives(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=1.0), 1.0, 0.5),
                     Cluster.uniform(2, 0.1))
    write_trace(trace, tmp_path / "dp.json")
    assert read_trace(tmp_path / "dp.json") == trace
    assert set(trace.ops.stream[np.isin(trace.ops.kind, [trace.kind_code("REDUCE"), trace.kind_code("GATHER")])]) == {
        Stream.NETWORK}


def test_a_trace_of_an_older_pipesim_reads_its_sharded_optimizer_as_zero_1():
    recorded = asdict(ScheduleParams(2, 4, data_parallel=2))
    del recorded["zero"]
    assert ScheduleParams.recorded({**recorded, "sharded_optimizer": True}).zero == 1
    assert ScheduleParams.recorded({**recorded, "sharded_optimizer": False}).zero == 0
    assert ScheduleParams.recorded(asdict(ScheduleParams(2, 4, data_parallel=2, zero=3))).zero == 3


@pytest.mark.parametrize("precision", ["nemo-bf16-adam", "megatron-bf16-moments"])
def test_a_precision_that_holds_adams_moments_refuses_another_optimizer(tmp_path, monkeypatch, precision):
    """NeMo's distributed Adam and Megatron-LM's bf16 moments (its Adam's `exp_avg_dtype`) hold Adam's moments:
    SGD, with or without momentum, is refused under them, given as --precision (before the model is counted) or as
    the profile was estimated, by every command that prices a step, and by run, whose auto order is searched on
    the profile's step."""
    pytest.importorskip("torch")
    profile = tmp_path / "profile.json"
    gpt = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 2, "--seq-len", 32)
    assert pipesim("estimate", *gpt, "-p", 2, "--precision", precision, "--out", profile).code == 0
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    for optimizer in ("sgd", "momentum"):
        why = f"--optimizer {optimizer}: --precision {precision} holds Adam's two moments ("
        given = ("--precision", precision, "--optimizer", optimizer)
        assert why in refused("estimate", *gpt, "-p", 2, *given, "--out", "e.json")
        assert why in refused("simulate", *gpt, "-p", 2, "-s", "1f1b", *given, "--json")
        assert why in refused("sweep", *gpt, "-p", 2, "-s", "1f1b", *given, "--out", "r.csv")
        assert why in refused("tune", *gpt, "--devices", 2, "-s", "1f1b", *given)
        from_profile = (f"--optimizer {optimizer}: the profile was estimated with --precision {precision}, which "
                        f"holds Adam's two moments (")
        assert from_profile in refused("simulate", "--profile", profile, "-s", "1f1b", "--optimizer", optimizer)
        assert from_profile in refused("tune", "--profile", profile, "--devices", 2, "--optimizer", optimizer)
        assert from_profile in refused("run", "--profile", profile, "-s", "1f1b", "--optimizer", optimizer)
    assert from_profile.replace("momentum", "sgd") in refused("run", "--profile", profile, "-s", "1f1b")  # its default
    assert pipesim("simulate", "--profile", profile, "-s", "1f1b", "--optimizer", "adamw").code == 0
