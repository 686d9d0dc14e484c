"""`peak_per_stage` (the most micro-batches in flight and superseded weight versions a stage holds, which tune reads
off every order it builds) against the plain walk it stands for: each stage's running count, in program order,
changed at every action's start and at its end, at its highest, and 0 where it never rises."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import ActionTable, peak_per_stage
from pipesim.schedules.table import FIELD_DTYPE, KIND_DTYPE


def walked_peaks(stage: list[int], at_start: list[int], at_end: list[int], num_stages: int) -> list[int]:
    """Row by row: a stage's count moves by the row's start change, is read, moves by its end change, is read."""
    count, peak = [0] * num_stages, [0] * num_stages
    for s, start, end in zip(stage, at_start, at_end):
        for change in (start, end):
            count[s] += change
            peak[s] = max(peak[s], count[s])
    return peak


@st.composite
def counted_rows(draw):
    """A table's stage column (runs of rows of one stage, interleaved as a device holding several stages runs
    them, or stage by stage as one stage a device) and each row's changes at its start and end."""
    num_stages = draw(st.integers(1, 5))
    rows = draw(st.integers(0, 40))
    stage = draw(st.lists(st.integers(0, num_stages - 1), min_size=rows, max_size=rows))
    if draw(st.booleans()):
        stage.sort()
    changes = st.lists(st.integers(-3, 3), min_size=rows, max_size=rows)
    at_start = draw(changes) if draw(st.booleans()) else [0] * rows
    return num_stages, stage, at_start, draw(changes)


@settings(max_examples=300, deadline=None)
@given(counted_rows())
def test_peaks_are_the_walked_running_counts(drawn):
    num_stages, stage, at_start, at_end = drawn
    rows = len(stage)
    column = np.array(stage, dtype=FIELD_DTYPE)
    table = ActionTable(column, np.zeros(rows, dtype=KIND_DTYPE), column, *np.zeros((3, rows), dtype=FIELD_DTYPE),
                        np.full(rows, -1, dtype=FIELD_DTYPE))
    peak = peak_per_stage(table, np.array(at_start, dtype=np.int64), np.array(at_end, dtype=np.int64), num_stages)
    assert peak.dtype == np.int64
    assert peak.tolist() == walked_peaks(stage, at_start, at_end, num_stages)
