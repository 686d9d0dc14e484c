"""Properties every method's schedule holds whatever its shape and costs: each micro-batch's passes run in its
data's order (F on a stage before F on the stages it feeds, B there before B here, W after its B), the step at
least the busiest device's compute and the bubble in [0, 1), every time scaled by c when every cost is, blocking
exchanges ending no device's step earlier than overlapped ones and sending to each peer in the order it receives,
and every order's text read back as written."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.schedules import METHODS, Kind, Schedule, kind_mask
from pipesim.schedules.lowering import Lowered, lower
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.cluster import Link
from pipesim.traces import summarize
from tests.conftest import build
from tests.helpers import method_shape

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PS_PER_US = 10**6
MIB = 2**20


@st.composite
def problems(draw, name: str):
    """Method `name` in a shape it builds (p 2..4), with or without data, expert and context parallelism, whole
    milliseconds per stage (F, B, the update, the REDUCE, the all-to-alls, the ring) and per link (its latency, a
    MiB's transfer), so that every time the engine sums is exact."""
    p, m, n = method_shape(name, draw, most_devices=4, most_microbatches=10)
    schedule = build(name, p, m, n, data_parallel=draw(st.sampled_from((1, 2))),
                     expert_parallel=draw(st.sampled_from((1, 2))), context_parallel=draw(st.sampled_from((1, 2))))
    stages = schedule.num_stages
    ms = st.lists(st.integers(1, 4), min_size=stages, max_size=stages)
    costs = Costs.per_stage(stages, fwd_ms=draw(ms), bwd_ms=[2 * b for b in draw(ms)], opt_ms=draw(st.integers(0, 2)),
                            output_mb=draw(st.lists(st.sampled_from((0.0, 1.0)), min_size=stages, max_size=stages)))
    collective = st.integers(0, 2)
    costs = replace(costs, stages=tuple(replace(c, reduce_ms=draw(collective), all_to_all_fwd_ms=draw(collective),
                                                all_to_all_bwd_ms=draw(collective), ring_fwd_ms=draw(collective),
                                                ring_bwd_ms=draw(collective), product_ms=draw(collective))
                                        for c in costs.stages), transfers_hold_products=draw(st.booleans()))
    link = Link(latency_ms=draw(st.integers(0, 2)), bandwidth_bytes_per_ms=MIB)
    return schedule, costs, Cluster(schedule.num_devices, link, overlap_comm=draw(st.booleans()))


def _critical_path_ms(schedule: Schedule, costs: Costs) -> float:
    """One micro-batch's forward through the stage graph's longest path and its input gradient back: no step is
    shorter."""
    graph, forward_ms, backward_ms = schedule.graph, {}, {}
    order = graph.topological_order()
    for s in order:
        forward_ms[s] = max((forward_ms[q] for q in graph.preds[s]), default=0) + costs.stages[s].fwd_ms
    for s in reversed(order):
        before = max((backward_ms[q] for q in graph.succs[s]), default=forward_ms[s])
        backward_ms[s] = before + costs.stages[s].bwd_ms * (1 - costs.stages[s].wgrad_fraction)
    return max(backward_ms.values())


def _spans(trace, *kinds: str, by_peer: bool = False) -> dict[tuple[int, ...], tuple[int, int]]:
    """(stage, micro-batch, mini-batch, pipeline) -> (start, end) in the engine's whole picoseconds of the ops of
    `kinds`, each key once; `by_peer`: (stage, peer, ...) for transfers."""
    ops = trace.ops
    rows = np.flatnonzero(np.isin(ops.kind, [trace.kinds.index(k) for k in kinds]))
    columns = (ops.stage, *((ops.peer,) if by_peer else ()), ops.microbatch, ops.minibatch, ops.pipeline)
    keys = list(zip(*(column[rows].tolist() for column in columns)))
    assert len(set(keys)) == len(keys)
    start, dur = (np.rint(column[rows] * PS_PER_US).astype(np.int64) for column in (ops.start_us, ops.dur_us))
    return dict(zip(keys, zip(start.tolist(), (start + dur).tolist())))


@pytest.mark.parametrize("name", list(METHODS))
@SETTINGS
@given(data=st.data())
def test_every_micro_batch_runs_its_passes_in_its_datas_order(name, data):
    """F on a stage ends before F on each stage it feeds starts, B there before B here, each W after its B; each
    SEND is received once, the RECV ending no earlier than the SEND and before the pass that reads it."""
    schedule, costs, cluster = data.draw(problems(name))
    trace = simulate(schedule, costs, cluster)
    forward, backward, weight = _spans(trace, "F"), _spans(trace, "B", "I"), _spans(trace, "W")
    assert forward.keys() == backward.keys()
    late = []
    for src, dst in schedule.graph.edges:
        for (stage, *unit), (_, end) in forward.items():
            if stage == src and forward[(dst, *unit)][0] < end:
                late.append(f"F{src}{unit} ends at {end} after F{dst} starts at {forward[(dst, *unit)][0]}")
            if stage == src and backward[(dst, *unit)][1] > backward[(src, *unit)][0]:
                late.append(f"B{dst}{unit} ends at {backward[(dst, *unit)][1]} after B{src} starts")
    late += [f"W{key} starts before its B ends" for key, (start, _) in weight.items() if start < backward[key][1]]
    for direction, reader in (("F", forward), ("B", backward)):
        sends = _spans(trace, f"SEND_{direction}", by_peer=True)
        recvs = _spans(trace, f"RECV_{direction}", by_peer=True)
        assert sorted((peer, stage, *unit) for stage, peer, *unit in sends) == sorted(recvs)
        for (stage, peer, *unit), (_, sent) in sends.items():
            received = recvs[(peer, stage, *unit)][1]
            if not sent <= received <= reader[(peer, *unit)][0]:
                late.append(f"{direction}{stage}>{peer}{unit} sent by {sent}, received at {received}, read at "
                            f"{reader[(peer, *unit)][0]}")
    assert late == []


@pytest.mark.parametrize("name", list(METHODS))
@SETTINGS
@given(data=st.data())
def test_the_step_holds_the_busiest_devices_compute_and_scales_with_every_cost(name, data):
    schedule, costs, cluster = data.draw(problems(name))
    trace = simulate(schedule, costs, cluster)
    summary = summarize(trace)
    assert summary.makespan_ms >= max(max(d.busy_ms for d in summary.devices), _critical_path_ms(schedule, costs))
    assert 0 <= summary.bubble_fraction < 1
    c = data.draw(st.integers(2, 5))
    scaled = replace(costs, stages=tuple(replace(s, **{f.name: getattr(s, f.name) * c for f in fields(s)
                                                       if f.name.endswith("_ms") and getattr(s, f.name)})
                                         for s in costs.stages))
    link = replace(cluster.default_link, latency_ms=cluster.default_link.latency_ms * c, bandwidth_bytes_per_ms=MIB / c)
    again = simulate(schedule, scaled, replace(cluster, default_link=link))
    # Held compute ends at fractions of a picosecond, which each run rounds, by half a picosecond a row at most and
    # along every row before; else exact.
    off_ps = c * len(trace.ops) if costs.transfers_hold_products else 0
    for column in ("start_us", "dur_us"):
        got = np.rint(getattr(again.ops, column) * PS_PER_US).astype(np.int64)
        want = np.rint(getattr(trace.ops, column) * PS_PER_US).astype(np.int64) * c
        assert np.abs(got - want).max(initial=0) <= off_ps, column


@pytest.mark.parametrize("name", list(METHODS))
@SETTINGS
@given(data=st.data())
def test_blocking_exchanges_end_no_devices_step_earlier(name, data):
    """Where transfers hold no compute (the default): docs/hardware.md says blocking may price lower where they do."""
    schedule, costs, cluster = data.draw(problems(name))
    costs = replace(costs, transfers_hold_products=False)
    ends = []
    for overlap in (True, False):
        ops = simulate(schedule, costs, replace(cluster, overlap_comm=overlap)).ops
        end = ops.start_us + ops.dur_us
        ends.append([end[ops.device == d].max() for d in range(schedule.num_devices)])
    overlapped, blocking = ends
    assert [b >= o for o, b in zip(overlapped, blocking)] == [True] * schedule.num_devices


@pytest.mark.parametrize("name", list(METHODS))
@SETTINGS
@given(data=st.data())
def test_every_order_reads_back_from_its_text(name, data):
    schedule, _, _ = data.draw(problems(name))
    assert Schedule.orders_from_text(schedule.to_text()) == tuple(map(tuple, schedule.orders))


def _pair_transfers(lowered: Lowered) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """Per ordered pair of devices (sender, receiver): the transfer ids the sender's SENDs carry in its row order,
    and those the receiver's RECVs carry in its."""
    t, transfer = lowered.table, lowered.transfer
    sending, receiving = kind_mask(t.kind, Kind.SEND_F, Kind.SEND_B), kind_mask(t.kind, Kind.RECV_F, Kind.RECV_B)
    sender, receiver = (np.zeros(int(transfer.max(initial=-1)) + 1, dtype=np.int64) for _ in range(2))
    sender[transfer[sending]], receiver[transfer[receiving]] = t.device[sending], t.device[receiving]
    sent, received = {}, {}
    for row in np.flatnonzero(sending | receiving).tolist():  # each device's rows together, in its order
        xid = int(transfer[row])
        orders = sent if sending[row] else received
        orders.setdefault((int(sender[xid]), int(receiver[xid])), []).append(xid)
    return sent, received


@pytest.mark.parametrize("name", list(METHODS))
@SETTINGS
@given(data=st.data())
def test_blocking_exchanges_send_to_each_peer_in_the_order_it_receives_over_the_whole_run(name, data):
    """NCCL matches a pair's sends and receives in the order each end posts them (its user guide's point-to-point
    page): a blocking runtime's order (`exchange_order`), whatever each row's time, sends to each peer over the
    whole run in the order that peer posts the receives, within an exchange (`_in_pair_order`) and across them."""
    schedule, _, _ = data.draw(problems(name))
    natural = lower(schedule)
    seed = data.draw(st.integers(0, 2**32 - 1))
    row_ps = np.random.default_rng(seed).integers(1, 9, len(natural.table.kind))  # per row, the time it holds
    sent, received = _pair_transfers(lower(schedule, row_ps, natural))
    assert sent == received
