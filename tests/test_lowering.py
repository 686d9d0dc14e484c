"""The shared lowering: the rows the simulator prices and the executor runs."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.schedules import (
    KIND_CODE,
    METHODS,
    SYNCHRONOUS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    weight_versions,
)
from pipesim.schedules.lowering import check_transfer_order, lower, preflight
from pipesim.sim import Cluster, Costs, simulate
from tests.conftest import build
from tests.helpers import two_stage_schedule


def refused(name, p, m):
    """The shapes the methods refuse, as their docs state them."""
    return {"zb-h2": m < 2 * p - 1, "dualpipev": m < 2 * p, "dualpipe": p % 2 or m % 2 or m < 2 * p,
            "interleaved-1f1b": m % p != 0, "graphpipe": p < 4, "pipedream-2bw": m < p - 1}.get(name, False)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(METHODS)), st.integers(2, 5), st.integers(1, 10), st.integers(1, 3))
def test_every_send_pairs_with_one_receive_on_its_channel(name, p, m, n):
    assume(not refused(name, p, m))
    schedule = build(name, p, m, n)
    lowered = lower(schedule)
    t = lowered.table
    transfers = lowered.transfer[lowered.transfer >= 0]
    sends = lowered.transfer[lowered.is_send]
    recvs = lowered.transfer[~lowered.is_compute & ~lowered.is_send]
    assert sorted(sends) == sorted(recvs) == sorted(set(transfers.tolist()))
    for row in np.flatnonzero(lowered.transfer >= 0)[:200]:
        channel = lowered.channels[lowered.channel_of(lowered.transfer[row])]
        if lowered.is_send[row]:
            assert (t.device[row], t.stage[row], t.peer[row]) == (channel.src_device, channel.sender, channel.receiver)
        else:
            assert (t.device[row], t.stage[row], t.peer[row]) == (channel.dst_device, channel.receiver, channel.sender)
    check_transfer_order(lowered)


@pytest.mark.parametrize("name", list(METHODS))
def test_compute_rows_carry_the_versions_of_the_schedule(name):
    schedule = build(name, 4, 8, 3)
    lowered = lower(schedule)
    versions = weight_versions(schedule)
    compute = lowered.origin >= 0
    assert np.array_equal(lowered.version[compute], versions.read[lowered.origin[compute]])
    assert np.array_equal(lowered.prediction[compute], versions.prediction[lowered.origin[compute]])
    assert np.array_equal(lowered.copies_delta[compute], versions.copies_delta[lowered.origin[compute]])
    assert np.all(lowered.version[~compute] == -1) and np.all(lowered.copies_delta[~compute] == 0)
    # Every version kept beside the current one is freed again.
    for d in range(schedule.num_devices):
        assert lowered.copies_delta[lowered.rows(d)].sum() == 0


def test_rows_are_grouped_by_device_in_order():
    schedule = build("1f1b", 3, 4, 1)
    lowered = lower(schedule)
    assert np.all(np.diff(lowered.table.device) >= 0)
    compute = lowered.table.select(np.flatnonzero(lowered.origin >= 0))
    assert compute.to_orders(3) == tuple(map(tuple, schedule.orders))


def test_crossing_transfers_are_refused_naming_both_ends():
    # Device 1 runs micro-batch 1's forward first, but device 0 sends micro-batch 0's activation first.
    crossed = two_stage_schedule("0F0 0F1 0B1 0B0 0OPT", "1F1 1F0 1B1 1B0 1OPT")
    preflight(crossed, dry_run=True)  # a valid order ...
    with pytest.raises(ScheduleError, match=r"device 0 sends 0SEND_F0>1 to device 1 when device 1 expects "
                                            r"1RECV_F1<0.*stage edge 0->1 \(activations\) crosses"):
        check_transfer_order(lower(crossed))  # ... that a FIFO channel cannot deliver


def test_preflight_dry_run_finds_a_deadlock_across_devices():
    # 0B0 waits for 1B0, which comes after 1F1, which waits for 0F1, which comes after 0B0.
    stuck = two_stage_schedule("0F0 0B0 0F1 0B1 0OPT", "1F1 1F0 1B0 1B1 1OPT")
    preflight(stuck)  # each device's own order is fine: the simulator finds the stall when it runs
    with pytest.raises(ScheduleError, match=r"device 0: 0B0 can never start.*device 1: 1F1 can never start"):
        preflight(stuck, dry_run=True)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(stuck, Costs.per_stage(2, fwd_ms=1, bwd_ms=2), Cluster.uniform(2, 0.1))


def test_preflight_refuses_an_incomplete_schedule():
    with pytest.raises(ScheduleError, match=r"1B1: needs one B"):
        preflight(two_stage_schedule("0F0 0F1 0B0 0B1 0OPT", "1F0 1F1 1B0 1OPT"))


def test_a_field_beyond_a_columns_32_bits_is_refused_naming_it():
    with pytest.raises(ScheduleError, match="microbatch 2147483648"):
        preflight(two_stage_schedule("0F0 0F2147483648 0B0 0OPT", "1F0 1B0 1OPT"))


def test_a_schedule_whose_transfer_ids_pass_32_bits_is_refused():
    orders = (tuple(map(Action.parse, "0F0 0B0 0OPT".split())), tuple(map(Action.parse, "1F0 1B0 1OPT".split())))
    huge = Schedule("hand", StageGraph.chain(2), (0, 1), orders, SYNCHRONOUS, 2**30)  # 2 channels x 2^30 units
    with pytest.raises(ScheduleError, match="2,147,483,648 rows or transfers"):
        lower(huge)
    assert lower(Schedule("hand", StageGraph.chain(2), (0, 1), orders, SYNCHRONOUS, 2**29)).transfer.max() == 2**29
    with pytest.raises(ScheduleError, match="3,221,225,472 units"):  # checked before the index could wrap
        preflight(Schedule("hand", StageGraph.chain(3), (0, 1, 2), orders + ((),), SYNCHRONOUS, 2**30))


def test_transfers_of_a_dag_use_the_graph_edges():
    from pipesim.schedules.graph import graph_schedule, two_branch_graph

    schedule = graph_schedule(ScheduleParams(6, 4), two_branch_graph(6))
    lowered = lower(schedule)
    assert {c.edge for c in lowered.channels} == set(schedule.graph.edges)
    assert {c.backward for c in lowered.channels} == {False, True}
    check_transfer_order(lowered)
    sends = lowered.table.kind[lowered.is_send]
    assert len(sends) == 2 * len(schedule.graph.edges) * 4  # every edge, both directions, every micro-batch
    assert np.count_nonzero(sends == KIND_CODE[Kind.SEND_F]) == len(schedule.graph.edges) * 4
