"""Data parallelism as rows of the IR: the REDUCE (and ZeRO-1's GATHER) pass, and its checks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

_SYNCHRONOUS_BUILT = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "pipedream", "xpipe", "avgpipe")


def _params(name: str, **extra) -> ScheduleParams:
    """Small shapes every method listed accepts (m a multiple of p, m >= 2p)."""
    return METHODS[name].params(2, 4, 2, **extra)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(_SYNCHRONOUS_BUILT), st.integers(2, 4), st.booleans())
def test_one_reduce_per_update_after_the_stages_last_backward(name, d, sharded):
    plain = build_schedule(name, _params(name))
    schedule = build_schedule(name, _params(name, data_parallel=d, sharded_optimizer=sharded))
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
    with pytest.raises(ScheduleError, match="data_parallel must be a whole number >= 1"):
        ScheduleParams(2, 2, data_parallel=0)
    with pytest.raises(ScheduleError, match="sharded_optimizer must be true or false"):
        ScheduleParams(2, 2, data_parallel=2, sharded_optimizer="yes")


def test_lowering_reads_no_weights_in_a_collective_and_torch_csv_leaves_it_out():
    schedule = build_schedule("1f1b", ScheduleParams(2, 2, data_parallel=2, sharded_optimizer=True))
    lowered = lower(schedule)
    collective = np.isin([a.kind for o in schedule.orders for a in o], [Kind.REDUCE, Kind.GATHER])
    assert np.all(np.asarray(lowered.version)[lowered.origin >= 0][collective] == -1)
    assert to_torch_csv(schedule) == to_torch_csv(build_schedule("1f1b", ScheduleParams(2, 2)))
