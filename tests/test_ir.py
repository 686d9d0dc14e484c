"""The schedule IR: text forms, stage graphs, validation and deadlock detection."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.schedules import (
    SEND_KINDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    WeightPolicy,
    add_communication,
    build_schedule,
    find_deadlock,
    validate,
)

_kinds = st.sampled_from(list(Kind))


@st.composite
def actions(draw):
    kind = draw(_kinds)
    transfer = kind.value.startswith(("SEND", "RECV"))
    per_minibatch = kind in (Kind.OPT, Kind.AVG)
    return Action(
        kind,
        draw(st.integers(0, 500)),
        -1 if per_minibatch else draw(st.integers(-1 if kind is Kind.PRED else 0, 5000)),
        draw(st.integers(0, 100)),
        draw(st.integers(0, 8)),
        draw(st.integers(0, 500)) if transfer else -1,
    )


@given(actions())
def test_action_text_round_trips(action):
    assert Action.parse(str(action)) == action


def test_action_text_matches_torch_for_plain_actions():
    assert str(Action(Kind.F, 2, 0)) == "2F0"
    assert str(Action(Kind.W, 1, 7, 3)) == "1W7.3"
    assert str(Action(Kind.OPT, 0, -1, 2)) == "0OPT.2"
    assert str(Action(Kind.SEND_F, 0, 4, 0, 1, 1)) == "P1:0SEND_F4>1"
    assert Action.parse("1RECV_B3<2") == Action(Kind.RECV_B, 1, 3, 0, 0, 2)


@pytest.mark.parametrize("text,kind,on_a_pipeline", [("2A2A_F5", Kind.A2A_F, "P1:0A2A_B3.2"),
                                                    ("2RING_F5", Kind.RING_F, "P1:0RING_B3.2")])
def test_an_all_to_all_or_ring_action_reads_and_prints_as_its_kind_stage_and_micro_batch(text, kind, on_a_pipeline):
    action = Action.parse(text)
    assert (action.kind, action.stage, action.microbatch) == (kind, 2, 5) and str(action) == text
    assert str(Action.parse(on_a_pipeline)) == on_a_pipeline


@pytest.mark.parametrize("text", ["", "F0", "2X0", "0SEND_F1", "0F1>2", "0RECV_F1>2", "0F1.x"])
def test_bad_action_text_is_rejected(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


def test_schedule_text_round_trips():
    schedule = build_schedule("pipedream", ScheduleParams(3, 2, 3))
    assert Schedule.orders_from_text(schedule.to_text()) == schedule.orders


def test_stage_graph_rejects_cycles_and_bad_edges():
    with pytest.raises(ScheduleError, match="cycle"):
        StageGraph(3, ((0, 1), (1, 2), (2, 0)))
    with pytest.raises(ScheduleError, match="distinct stages"):
        StageGraph(2, ((0, 2),))
    dag = StageGraph(4, ((0, 1), (0, 2), (1, 3), (2, 3)))
    assert dag.succs[0] == (1, 2) and dag.preds[3] == (1, 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])  # tests/test_catalogue.py covers the rest
@pytest.mark.parametrize("p,m,n", [(1, 1, 1), (2, 1, 3), (4, 8, 2), (5, 3, 4), (8, 16, 1)])
def test_baseline_builds_a_valid_schedule(name, p, m, n):
    schedule = build_schedule(name, ScheduleParams(p, m, n))
    validate(schedule)
    assert find_deadlock(schedule) == {}
    assert len(schedule.table.kind) == p * n * (2 * m + 1)  # F and B per micro-batch, one OPT per mini-batch


def _swap_first(schedule, device, a, b):
    orders = [list(o) for o in schedule.orders]
    i, j = orders[device].index(a), orders[device].index(b)
    orders[device][i], orders[device][j] = orders[device][j], orders[device][i]
    return schedule.with_orders(tuple(tuple(o) for o in orders))


def test_deadlock_names_first_blocked_action_per_device():
    schedule = build_schedule("1f1b", ScheduleParams(2, 2))
    # Device 0 waits for the gradient of micro-batch 1 before sending micro-batch 1 forward: a cycle.
    broken = _swap_first(schedule, 0, Action(Kind.F, 0, 1), Action(Kind.B, 0, 0))
    broken = _swap_first(broken, 0, Action(Kind.F, 0, 1), Action(Kind.B, 0, 1))
    stuck = find_deadlock(broken)
    assert set(stuck) == {0, 1}
    assert str(stuck[0][0]) == "0B1" and str(stuck[1][0]) == "1F1"
    with pytest.raises(ScheduleError, match=r"device 0: 0B1 can never start .*device 1: 1F1 can never start"):
        validate(broken)


def test_valid_reordering_is_not_reported():
    """GPipe with its last device in 1F1B order (F0 B0 F1 B1 ...): a different order, still deadlock-free,
    while the same device starting with a backward whose forward comes later is reported."""
    schedule = build_schedule("gpipe", ScheduleParams(3, 4))
    last = [Action(Kind.F, 2, j) for j in range(4)], [Action(Kind.B, 2, j) for j in range(4)]
    interleaved = tuple(a for pair in zip(*last) for a in pair) + (Action(Kind.OPT, 2),)
    reordered = schedule.with_orders((*schedule.orders[:2], interleaved))
    assert reordered.orders != schedule.orders and sorted(map(str, interleaved)) == sorted(map(str, schedule.orders[2]))
    assert find_deadlock(reordered) == {}
    validate(reordered)
    broken = _swap_first(reordered, 2, Action(Kind.F, 2, 1), Action(Kind.B, 2, 1))  # 2B1 before 2F1
    assert str(find_deadlock(broken)[2][0]) == "2B1"


def test_incomplete_and_misplaced_schedules_are_rejected():
    schedule = build_schedule("gpipe", ScheduleParams(2, 2))
    orders = [list(o) for o in schedule.orders]
    orders[1].remove(Action(Kind.B, 1, 1))
    with pytest.raises(ScheduleError, match="1B1: needs one B"):
        validate(schedule.with_orders(tuple(map(tuple, orders))))
    orders = [list(o) for o in schedule.orders]
    orders[0].insert(0, Action(Kind.F, 1, 0))
    with pytest.raises(ScheduleError, match="placed on device 1"):
        validate(schedule.with_orders(tuple(map(tuple, orders))))
    orders = [list(o) for o in schedule.orders]
    orders[0].append(Action(Kind.F, 0, 0))
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(schedule.with_orders(tuple(map(tuple, orders))))


def test_communication_pass_pairs_every_send_with_a_receive():
    schedule = add_communication(build_schedule("1f1b", ScheduleParams(4, 6, 2)))
    sends, recvs = set(), set()
    for device, order in enumerate(schedule.orders):
        for i, a in enumerate(order):
            if a.kind in SEND_KINDS:
                assert order[i - 1].kind in (Kind.F, Kind.B)  # right after its producer
                sends.add((a.kind.value[-1], a.stage, a.peer, a.microbatch, a.minibatch))
            elif a.kind.value.startswith("RECV"):
                recvs.add((a.kind.value[-1], a.peer, a.stage, a.microbatch, a.minibatch))
    assert sends == recvs
    assert len(sends) == 2 * 3 * 6 * 2  # both directions, 3 links, m·N micro-batches


def test_impossible_configurations_name_the_method():
    with pytest.raises(ScheduleError, match="1f1b places one model stage per device"):
        build_schedule("1f1b", ScheduleParams(4, 8, chunks=2))
    with pytest.raises(ScheduleError, match="--schedule: unknown 'zb'"):
        build_schedule("zb", ScheduleParams(4, 8))
    with pytest.raises(ScheduleError, match=r"microbatches: give a whole number of at least 1 \(got 0\)"):
        ScheduleParams(4, 0)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_stages_on_lists_each_devices_stages_in_order(placement):
    devices = max(placement) + 1
    schedule = Schedule("test", StageGraph.chain(len(placement)), tuple(placement), ((),) * devices,
                        WeightPolicy(), microbatches=1)
    for device in range(devices):
        assert schedule.stages_on(device) == [s for s, d in enumerate(placement) if d == device]


def test_a_policys_master_copies_are_some_of_its_extra_copies():
    assert WeightPolicy(extra_copies=2, master_copies=1).master_copies == 1
    for extra, master in ((0, 1), (1, -1)):
        with pytest.raises(ScheduleError, match=rf"master_copies \({master}\) counts some of extra_copies \({extra}\)"):
            WeightPolicy(extra_copies=extra, master_copies=master)


def test_a_traces_policy_records_its_master_copies_and_one_written_before_still_reads():
    from pathlib import Path

    from pipesim.schedules.asynchronous import AVGPIPE_POLICY
    from pipesim.traces.trace import read_trace

    assert AVGPIPE_POLICY.describe()["master_copies"] == 1 and WeightPolicy().describe()["master_copies"] == 0
    before = read_trace(Path(__file__).parent.parent / "traces" / "measured" / "gpu-check-h200-day9" / "run-1f1b.json")
    assert "master_copies" not in before.meta.policy and before.meta.policy["extra_copies"] == 0
