"""Blocking exchanges (`--blocking-comm`): a device posts the SENDs and RECVs between two of its other rows together
and waits for them whole, and a SEND moves once its receiver has posted the RECV (schedules/passes.py
`exchange_order`, sim/engine.py `_exchange_posts`)."""

from dataclasses import replace

import numpy as np
import pytest

from pipesim.schedules import METHODS, Kind, lowering
from pipesim.schedules.lowering import check_transfer_order, lower
from pipesim.schedules.passes import _waits_forever, exchange_order
from pipesim.schedules.table import KINDS
from pipesim.schedules.torch_csv import from_torch_csv
from pipesim.sim import Cluster, Costs, Link, SimulationError, simulate
from pipesim.traces import summarize
from tests.conftest import build


def _schedule(name, p, **params):
    """`name` at p devices (graphpipe's 4 at least), 4p micro-batches, 2 mini-batches, interleaved with v = 2."""
    chunks = 2 if name == "interleaved-1f1b" else None
    return build(name, max(p, 4) if name == "graphpipe" else p, 4 * p, 2, chunks=chunks, **params)


def _collective_costs(schedule, **costs):
    """F 1 ms, B 2, 1 MB outputs; each all-to-all and ring 0.3 ms on the network (what the schedule has of them)."""
    per_stage = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, output_mb=1.0, **costs)
    return replace(per_stage, stages=tuple(replace(c, all_to_all_fwd_ms=0.3, all_to_all_bwd_ms=0.3, ring_fwd_ms=0.3,
                                                   ring_bwd_ms=0.3) for c in per_stage.stages))


# A pass's collectives (all-to-alls of expert parallelism, the ring of context parallelism) right before its sends
COLLECTIVE_CASES = [("1f1b", 2, {"expert_parallel": 2}), ("1f1b", 4, {"context_parallel": 2}),
                    ("interleaved-1f1b", 2, {"expert_parallel": 2}), ("interleaved-1f1b", 4, {"context_parallel": 2}),
                    ("zb-v", 2, {"expert_parallel": 2, "context_parallel": 2})]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_finishes_blocking_and_waiting_costs_no_less_than_overlapping(name, p):
    """Every method runs to its end with blocking exchanges, and waiting for them costs no less than overlapping
    them, where transfers hold no compute (`Costs.transfers_hold_products` False, the default). Where they do, a
    held product loses the transfer's time whether it overlaps or waits, and a blocking exchange moves a device's
    sends and receives at once, each once its receiver has posted: blocking may price cheaper there, which
    docs/hardware.md says ("Blocking priced below overlapping where transfers hold the products")."""
    schedule = _schedule(name, p)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, output_mb=1.0)
    for comm_ms in (0.0, 0.5):
        overlapped, blocking = (summarize(simulate(schedule, costs, Cluster.uniform(
            schedule.num_devices, comm_ms, overlap_comm=overlap))).makespan_ms for overlap in (True, False))
        assert blocking >= overlapped


@pytest.mark.parametrize("params", [{}, {"expert_parallel": 2}])
def test_one_device_exchanges_nothing_and_blocks_as_it_overlaps(params):
    schedule = build("1f1b", 1, 4, 2, **params)
    costs = _collective_costs(schedule)
    overlapped, blocking = (simulate(schedule, costs, Cluster.uniform(1, 0.5, overlap_comm=overlap))
                            for overlap in (True, False))
    assert np.array_equal(blocking.ops.end_us, overlapped.ops.end_us)


def _exchanges(lowered, device):
    """Device `device`'s rows as text, its exchanges in brackets."""
    t, out, inside = lowered.table, [], False
    for row in lowered.rows(device):
        kind = KINDS[t.kind[row]]
        transfer = kind.value.startswith(("SEND", "RECV"))
        if transfer != inside:
            out.append("[" if transfer else "]")
            inside = transfer
        out.append(f"{kind.value}{t.stage[row]}.{t.microbatch[row]}")
    return " ".join(out + ["]"] * inside)


def _blocking(schedule):
    natural = lower(schedule)
    return natural, lower(schedule, exchange_ps=np.ones(len(natural.table.kind), dtype=np.int64))


def test_one_f_one_b_exchanges_are_megatrons_as_lowered():
    """1F1B's exchanges as lowered (a SEND after its pass, a RECV before the pass that needs it) are those
    Megatron-core's 1F1B posts (send_forward_recv_backward after a forward, send_backward_recv_forward after a
    backward): the order stays."""
    natural, blocking = _blocking(build("1f1b", 4, 8))
    assert np.array_equal(blocking.origin, natural.origin)
    assert "F1.3 [ SEND_F1.3 RECV_B1.1 ] B1.1 [ SEND_B1.1 RECV_F1.4 ] F1.4" in _exchanges(blocking, 1)


def test_interleaved_exchanges_once_for_a_forward_and_the_backward_after_it():
    """Megatron-core's interleaved steady state: a forward, a backward, then one exchange sending both outputs and
    receiving both next inputs (send_forward_backward_recv_forward_backward)."""
    _, blocking = _blocking(build("interleaved-1f1b", 4, 8, chunks=2))
    check_transfer_order(blocking)
    assert "F1.4 B5.0 [ SEND_F1.4 SEND_B5.0 RECV_F1.5 RECV_B5.1 ] F1.5 B5.1" in _exchanges(blocking, 1)


@pytest.mark.parametrize("name", ["zb-h2", "zb-v", "dualpipev", "dualpipe", "spectrain", "avgpipe"])
def test_orders_whose_exchanges_as_lowered_wait_forever_move_sends_to_their_receivers_exchange(name):
    schedule = _schedule(name, 4)
    natural, blocking = _blocking(schedule)
    t = natural.table
    assert _waits_forever(t.kind, t.device, natural.transfer)  # each SEND at the exchange after its pass
    b = blocking.table
    assert not _waits_forever(b.kind, b.device, blocking.transfer)
    check_transfer_order(blocking)
    assert sorted(blocking.origin.tolist()) == sorted(natural.origin.tolist())
    moved = exchange_order(schedule, t, natural.transfer, np.ones(len(t.kind), dtype=np.int64))
    assert np.array_equal(t.device[moved], t.device)  # each device's rows stay its own
    sends = np.flatnonzero(np.isin(b.kind, [KINDS.index(Kind.SEND_F), KINDS.index(Kind.SEND_B)]))
    made = np.maximum.accumulate(np.where(blocking.origin >= 0, np.arange(len(b.kind)), -1))
    assert np.all(b.device[made[sends]] == b.device[sends])  # each after a row of its own device


def _pair_orders(ops, placement):
    """Per ordered pair of devices (sender, receiver), the transfers the sender sends in its order and those the
    receiver receives in its, each (direction, sending stage, micro-batch, mini-batch, pipeline)."""
    sent, received = {}, {}
    for i, kind in enumerate(KINDS[k].value for k in ops.kind):
        unit = (int(ops.microbatch[i]), int(ops.minibatch[i]), int(ops.pipeline[i]))
        if kind.startswith("SEND"):
            sent.setdefault((int(ops.device[i]), placement[ops.peer[i]]), []).append((kind[5:], ops.stage[i], *unit))
        elif kind.startswith("RECV"):
            received.setdefault((placement[ops.peer[i]], int(ops.device[i])), []).append((kind[5:], ops.peer[i], *unit))
    return sent, received


@pytest.mark.parametrize("name", list(METHODS))
def test_each_device_sends_to_a_peer_in_the_order_the_peer_receives(name):
    """NCCL runs a pair's sends and receives in the order each end posts them ("point-to-point calls within a
    group targeting the same peer ... are executed in order", its user guide's point-to-point page): a blocking
    runtime's order sends to each peer what the peer receives next (dualpipe once received two of an exchange the
    other way round)."""
    schedule = _schedule(name, 4)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, output_mb=1.0)
    ops = simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.5, overlap_comm=False)).ops
    sent, received = _pair_orders(ops, schedule.placement)
    assert sent == received


@pytest.mark.parametrize(("resource", "holds"), [(None, True), ("bus", False), ("bus", True)])
def test_a_send_whose_receive_its_peer_posts_first_goes_first(resource, holds):
    """zb-v p 2 m 4, the last stage's B 6 ms: device 0 once sent F0.2 and then B3.0 in one exchange, which device 1
    receives the other way round, an exchange apart, so a timed run (transfers holding the compute, or one bus both
    devices send on) waited forever for F0.2's receiver. The exchange sends B3.0 first, and the run ends as the
    untimed one does."""
    schedule = build("zb-v", 2, 4, 1)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=[2.0, 2.0, 2.0, 6.0])
    untimed = simulate(schedule, costs, Cluster(2, Link(latency_ms=0), overlap_comm=False))
    timed = simulate(schedule, replace(costs, transfers_hold_products=holds),
                     Cluster(2, Link(latency_ms=0, resource=resource), overlap_comm=False))
    sent, received = _pair_orders(timed.ops, schedule.placement)
    assert sent == received
    assert summarize(timed).makespan_ms == summarize(untimed).makespan_ms == 42


# A torch CSV a user could give: 6 stages on 3 ranks, as interleaved.
RING_ORDER = "0F0,0F1,3F1,3B1,3F0,0B1,3B0,0B0\n1F0,1F1,4F1,4B1,1B1,4F0,4B0,1B0\n2F1,2F0,5F1,5B1,2B1,5F0,5B0,2B0"


@pytest.mark.parametrize(("resource", "holds"), [(None, True), ("bus", False), ("pair", False)])
def test_an_exchanges_send_moves_while_its_send_to_another_peer_waits(resource, holds):
    """NCCL runs a group's sends to different peers independently: device 2's exchange sends F2.0 to device 0 and
    B5.1 to device 1, and device 0 posts F2.0's receive only after B3.1, which needs B4.1 from device 1, which needs
    B5.1. A timed run (transfers holding the compute, one bus, or a link per pair) once issued B5.1 only after F2.0
    and waited forever; it ends as the untimed run does."""
    schedule = from_torch_csv(RING_ORDER, "order.csv")
    costs = Costs.per_stage(6, fwd_ms=[4.0, 3.0, 1.0, 1.0, 1.0, 4.0], bwd_ms=[4.0, 8.0, 6.0, 8.0, 2.0, 4.0])
    untimed = simulate(schedule, costs, Cluster(3, Link(latency_ms=0), overlap_comm=False))
    links = {(a, b): Link(latency_ms=0, resource=f"{a}->{b}" if resource == "pair" else resource)
             for a in range(3) for b in range(3) if a != b}
    timed = simulate(schedule, replace(costs, transfers_hold_products=holds), Cluster(3, links=links,
                                                                                     overlap_comm=False))
    assert summarize(timed).makespan_ms == summarize(untimed).makespan_ms == 83


def test_an_exchanges_sends_on_one_link_take_it_in_the_order_their_receivers_posted():
    """Each device's sends on one egress link of its own: device 2's exchange after B6.0 (44 ms) sends F6.2 to
    device 3, which posts its receive at 45 ms, and B6.0 to device 1, which has posted: B6.0 takes the link at 44 ms,
    as a link serves what reaches it in time order, where issued in the exchange's order it waited behind F6.2 until
    45.5 ms (the run 215.5 ms, not 213)."""
    schedule = build("interleaved-1f1b", 4, 8, 1)
    costs = Costs.per_stage(8, fwd_ms=[2, 1, 4, 2, 3, 3, 1, 2], bwd_ms=[8, 6, 6, 4, 2, 8, 8, 8], output_mb=1.0)
    egress = {(a, b): Link(latency_ms=0.5, resource=f"out{a}") for a in range(4) for b in range(4) if a != b}
    ops = simulate(schedule, costs, Cluster(4, links=egress, overlap_comm=False)).ops

    def start_ms(kind: Kind, microbatch: int) -> float:
        """When device 2's send of stage 6's `kind` for `microbatch` took the link."""
        return ops.start_us[(ops.device == 2) & (ops.kind == KINDS.index(kind)) & (ops.stage == 6)
                            & (ops.microbatch == microbatch)].item() / 1000

    assert (start_ms(Kind.SEND_B, 0), start_ms(Kind.SEND_F, 2)) == (44.0, 45.0)
    assert ops.end_us.max() == 213_000.0


@pytest.mark.parametrize("params", [{}, {"expert_parallel": 2, "context_parallel": 2}])
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "avgpipe"])
def test_the_timed_run_waits_as_the_untimed_one(name, params):
    """Where transfers hold the compute or links queue, the run is timed (`_Model.timed_coroutine`), and an exchange's
    SENDs after its first (`_BESIDE`) are issued at its post as the untimed run prices them, not after the SEND before
    them, an exchange after a pass's collectives once they have ended: with no link taken by two transfers at once,
    both give one timeline."""
    schedule = _schedule(name, 4, **params)
    costs = _collective_costs(schedule)
    devices = range(schedule.num_devices)
    plain = {(a, b): Link(latency_ms=0.5) for a in devices for b in devices if a != b}
    queued = {(a, b): Link(latency_ms=0.5, resource=f"{a}->{b}") for a in devices for b in devices if a != b}
    untimed = simulate(schedule, costs, Cluster(len(devices), links=plain, overlap_comm=False))
    for timed in (simulate(schedule, costs, Cluster(len(devices), links=queued, overlap_comm=False)),
                  simulate(schedule, replace(costs, transfers_hold_products=True),
                           Cluster(len(devices), links=plain, overlap_comm=False))):
        assert np.array_equal(timed.ops.start_us, untimed.ops.start_us)
        assert np.array_equal(timed.ops.end_us, untimed.ops.end_us)


def _posts_ms(ops):
    """Per row of a trace's ops (each device's rows together, in its order), where a SEND or RECV: when its
    exchange was posted, the end of its device's last other row before it (0: none)."""
    transfer = np.isin(ops.kind, [KINDS.index(k) for k in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B)])
    ended = np.where(transfer, 0.0, ops.end_us)
    first = np.r_[True, ops.device[1:] != ops.device[:-1]]
    posts = np.zeros(len(ended))
    for lo, hi in zip(np.flatnonzero(first), np.r_[np.flatnonzero(first)[1:], len(ended)]):
        posts[lo:hi] = np.maximum.accumulate(np.r_[0.0, ended[lo:hi - 1]])
    return posts


@pytest.mark.parametrize(("name", "p", "params"), COLLECTIVE_CASES)
def test_a_send_after_its_passs_collectives_moves_once_its_receiver_has_posted(name, p, params):
    """A pass's outputs are sent once its collectives have ended, and a blocking SEND moves once its receiver has
    posted too: the receiver's exchange is posted once the device's rows before it have ended (a pass's
    collectives among them), and a transfer starts at neither end's post before it."""
    schedule = _schedule(name, p, **params)
    ops = simulate(schedule, _collective_costs(schedule), Cluster.uniform(schedule.num_devices, 0.5,
                                                                          overlap_comm=False)).ops
    kind = np.array([KINDS[k].value for k in ops.kind])
    after_collective = np.r_[False, np.char.startswith(kind[:-1], "A2A") | np.char.startswith(kind[:-1], "RING")]
    sends = np.flatnonzero(np.char.startswith(kind, "SEND"))
    assert after_collective[sends].any()
    receive_of = {(k[5:], s, q, mb, n, pp): i for i, (k, s, q, mb, n, pp) in enumerate(zip(
        kind, ops.stage, ops.peer, ops.microbatch, ops.minibatch, ops.pipeline)) if k.startswith("RECV")}
    receives = [receive_of[kind[i][5:], ops.peer[i], ops.stage[i], ops.microbatch[i], ops.minibatch[i],
                           ops.pipeline[i]] for i in sends]
    posts = _posts_ms(ops)
    assert np.all(ops.start_us[sends] >= np.maximum(posts[sends], posts[receives]) - 1e-6)  # (µs of whole ps)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h2", "zb-v", "dualpipev", "spectrain"])
@pytest.mark.parametrize("params", [{"expert_parallel": 2}, {"context_parallel": 2}])
def test_the_run_waits_forever_where_the_exchanges_order_does_beside_collectives(monkeypatch, name, params):
    """Run in the order as lowered (each SEND after its pass and its collectives), blocking exchanges wait forever
    exactly where `_waits_forever` says: the run refuses those orders and runs the others to their end."""
    monkeypatch.setattr(lowering, "exchange_order", lambda schedule, t, *_: np.arange(len(t.kind)))
    schedule = _schedule(name, 2, **params)
    natural = lower(schedule)
    forever = _waits_forever(natural.table.kind, natural.table.device, natural.transfer)
    try:
        simulate(schedule, _collective_costs(schedule), Cluster.uniform(2, 0.5, overlap_comm=False))
    except SimulationError:
        assert forever
    else:
        assert not forever


def test_exchanges_that_wait_for_each_other_are_refused_in_one_line(monkeypatch):
    """zb-v's exchanges as lowered (each SEND after its pass) wait forever where they block: were they run so, the
    run stops and says why, in one line."""
    monkeypatch.setattr(lowering, "exchange_order", lambda schedule, t, *_: np.arange(len(t.kind)))
    schedule = _schedule("zb-v", 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0)
    with pytest.raises(SimulationError, match=r"^zb-v: \d+ devices never finished: their blocking exchanges wait for "
                                              r"each other \(leave out --blocking-comm\)$"):
        simulate(schedule, costs, Cluster.uniform(2, 0.5, overlap_comm=False))
