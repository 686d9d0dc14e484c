"""The vectorised machinery that builds orders, held against small reference oracles written action by action
(as the order code was before it was vectorised for tune): the 1F1B pattern of many rows at once, the zero-bubble
deferral of W, one mini-batch's rows repeated per mini-batch, rows inserted into a table, whether an order flushes,
and the caches the builds share."""

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import (
    KIND_CODE,
    Action,
    ActionTable,
    Kind,
    Schedule,
    StageGraph,
    WeightPolicy,
    evaluate_formula,
    flushes,
)
from pipesim.schedules.methods import interleave_1f1b, interleave_1f1b_rows
from pipesim.schedules.rivals import _defer_weight_gradients
from pipesim.schedules.table import _FIELDS, FIELD_DTYPE, KIND_DTYPE, OrderView


def one_forward_one_backward(count: int, warmup: int) -> list[tuple[Kind, int]]:
    """Oracle: `warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    w = min(warmup, count)
    steps = [(Kind.F, j) for j in range(w)]
    for j in range(w, count):
        steps += [(Kind.F, j), (Kind.B, j - w)]
    return steps + [(Kind.B, j) for j in range(count - w, count)]


def deferred(steps: list[tuple[Kind, int]], lag: int) -> list[tuple[Kind, int]]:
    """Oracle: every B split into I then W, each W held back until `lag` later I's have run, the rest at the end."""
    out, pending = [], deque()
    for kind, j in steps:
        if kind is not Kind.B:
            out.append((kind, j))
            continue
        out.append((Kind.I, j))
        pending.append(j)
        if len(pending) > lag:
            out.append((Kind.W, pending.popleft()))
    return out + [(Kind.W, j) for j in pending]


@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_interleave_1f1b_rows_is_each_rows_pattern(count):
    warmups = np.array([0, 1, 3, count, count + 4])
    backward, position = interleave_1f1b_rows(count, warmups)
    for row, warmup in enumerate(warmups.tolist()):
        expected = one_forward_one_backward(count, warmup)
        assert [(Kind.B if b else Kind.F, j) for b, j in zip(backward[row].tolist(), position[row].tolist())] \
            == expected
        single = interleave_1f1b(count, warmup)
        assert single[0].tolist() == backward[row].tolist() and single[1].tolist() == position[row].tolist()


@pytest.mark.parametrize("count,lag", [(1, 0), (4, 0), (4, 2), (4, 4), (4, 9), (7, 3)])
def test_deferred_weight_gradients_match_the_oracle(count, lag):
    warmups, lags = np.array([0, 2, count + 1]), np.array([lag, 0, lag + 1])
    kind, microbatch = _defer_weight_gradients(*interleave_1f1b_rows(count, warmups), lags)
    for row in range(len(warmups)):
        expected = deferred(one_forward_one_backward(count, int(warmups[row])), int(lags[row]))
        assert list(zip(kind[row].tolist(), microbatch[row].tolist())) == [(KIND_CODE[k], j) for k, j in expected]


def test_per_minibatch_repeats_each_devices_rows_with_its_minibatch():
    orders = [[Action(Kind.F, 0, 0), Action(Kind.B, 0, 0, peer=1), Action(Kind.OPT, 0)], [],
              [Action(Kind.W, 2, 1), Action(Kind.OPT, 2)]]
    repeated = ActionTable.from_orders(orders, "test").per_minibatch(3)
    expected = ActionTable.from_orders([[a._replace(minibatch=b) for b in range(3) for a in order]
                                        for order in orders], "test")
    for column in ("device", "kind", "stage", "microbatch", "minibatch", "pipeline", "peer"):
        got, wanted = getattr(repeated, column), getattr(expected, column)
        assert got.dtype == wanted.dtype and got.tolist() == wanted.tolist(), column


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_with_rows_inserts_each_column_as_np_insert_does(data):
    rows = data.draw(st.integers(1, 30))
    numbers = st.lists(st.integers(-5, 50), min_size=rows, max_size=rows)
    table = ActionTable(**{name: np.array(data.draw(numbers), dtype=KIND_DTYPE if name == "kind" else FIELD_DTYPE)
                           for name in _FIELDS})
    added = data.draw(st.integers(0, 12))
    before, copied, kinds = (np.array(data.draw(st.lists(st.integers(0, top), min_size=added, max_size=added)),
                                      dtype=np.int64) for top in (rows, rows - 1, 12))
    got = table.with_rows(before, copied, kind=kinds, peer=-1)
    for name in _FIELDS:
        column = getattr(table, name)
        wanted = np.insert(column, before, kinds if name == "kind" else -1 if name == "peer" else column[copied])
        assert getattr(got, name).dtype == wanted.dtype and getattr(got, name).tolist() == wanted.tolist(), name


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=4))
def test_an_order_flushes_where_no_device_goes_back_to_an_earlier_minibatch(minibatches):
    rows = sum(map(len, minibatches))
    table = ActionTable(np.repeat(np.arange(len(minibatches)), list(map(len, minibatches))).astype(FIELD_DTYPE),
                        np.zeros(rows, dtype=KIND_DTYPE), *np.zeros((2, rows), dtype=FIELD_DTYPE),
                        np.array(sum(minibatches, []), dtype=FIELD_DTYPE), *np.zeros((2, rows), dtype=FIELD_DTYPE))
    schedule = Schedule("test", StageGraph.chain(1), (0,), OrderView(table, len(minibatches)), WeightPolicy(), 1)
    assert flushes(schedule) == all(order == sorted(order) for order in minibatches)


def test_the_builds_share_chains_and_compiled_formulas():
    assert StageGraph.chain(6) is StageGraph.chain(6)
    assert StageGraph.chain(6, copies=2) == StageGraph(6, ((0, 1), (1, 2), (3, 4), (4, 5)), 2)
    assert [evaluate_formula("k//2 + p-k-1", 8, k, 4) for k in (0, 3, 7)] == [7, 5, 3]
