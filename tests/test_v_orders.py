"""The V schedules' orders (ZB-V, DualPipeV, DualPipe) are written as runs of passes and numbered as columns
(`schedules.rivals._VOrder`); here that numbering is held to the rules walked pass by pass, as the sources issue
them: each (pass, chunk) its next micro-batch, B and I sharing the backward count, each W the oldest I without
one (of its chunk, or of either), micro-batches beyond m dropped, and an overlapped pair apart where a part is
dropped. tests/test_order_digests.py holds the methods' whole orders to the ones recorded before."""

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import KIND_CODE, Kind
from pipesim.schedules.rivals import _PASSES, F0B1, F1B0, I0, I1, W0, W1, W, _VOrder

STAGES = (3, 8)
EITHER_CHUNK, OWN_CHUNK = (W,), (W0, W1)


def walked(microbatches: int, first: tuple[int, int], passes: list[int]) -> list[tuple[int, int, int, int]]:
    """(kind code, stage, micro-batch, peer) of each action, pass by pass."""
    issued = {Kind.F: [0, 0], Kind.B: [0, 0]}
    pending: tuple[deque, deque] = (deque(), deque())  # per chunk: (order queued, micro-batch) of I's without a W
    queued, actions = 0, []

    def emit(kind: Kind, chunk: int, j: int, peer: int = -1) -> None:
        if j < microbatches:
            actions.append((KIND_CODE[kind], STAGES[chunk], first[chunk] + j, peer))

    def issue(kind: Kind, chunk: int) -> int:
        counts = issued[Kind.F if kind is Kind.F else Kind.B]
        counts[chunk] += 1
        return counts[chunk] - 1

    for code in passes:
        (kind, chunk), *other = _PASSES[code]
        if other:  # an overlapped pair: forward of `chunk`, backward of the other's
            backward_chunk = other[0][1]
            forward, backward = issue(Kind.F, chunk), issue(Kind.B, backward_chunk)
            paired = forward < microbatches and backward < microbatches
            emit(Kind.F, chunk, forward, STAGES[backward_chunk] if paired else -1)
            emit(Kind.B, backward_chunk, backward, STAGES[chunk] if paired else -1)
        elif kind is Kind.W:
            if chunk < 0:
                chunk = min((c for c in (0, 1) if pending[c]), key=lambda c: pending[c][0])
            emit(kind, chunk, pending[chunk].popleft()[1])
        else:
            j = issue(kind, chunk)
            if kind is Kind.I:
                pending[chunk].append((queued, j))
                queued += 1
            emit(kind, chunk, j)
    return actions


@st.composite
def pass_lists(draw):
    """Passes a source could write: W's of one kind only (of a chunk's own queue or of either), none before an I
    it could take."""
    weights = draw(st.sampled_from((EITHER_CHUNK, OWN_CHUNK)))
    others = [code for code in range(len(_PASSES)) if code not in (W, W0, W1)]
    passes, without_weight = [], [0, 0]  # per chunk, I's written and not yet taken by a W
    for code in draw(st.lists(st.sampled_from(others + list(weights)), max_size=60)):
        kind, chunk = _PASSES[code][0]
        if kind is Kind.W:
            takes = [c for c in ((0, 1) if chunk < 0 else (chunk,)) if without_weight[c]]
            if not takes:
                continue
            without_weight[takes[0]] -= 1  # of either chunk: the count, not which, decides what may follow
        elif kind is Kind.I:
            without_weight[chunk] += 1
        passes.append(code)
    return passes


@settings(max_examples=300, deadline=None)
@given(pass_lists(), st.integers(1, 12), st.sampled_from([(0, 0), (0, 5)]), st.integers(1, 3))
def test_columns_number_the_passes_as_walked_one_by_one(passes, microbatches, first, run):
    order = _VOrder(STAGES, microbatches, first)
    for start in range(0, len(passes), run):  # in runs of a few passes each
        order.repeat(1, *passes[start:start + run])
    kind, stage, microbatch, peer = order.columns()
    assert list(zip(kind.tolist(), stage.tolist(), microbatch.tolist(), peer.tolist())) == \
        walked(microbatches, first, passes)


def test_a_run_repeats_its_passes_and_counts_the_pending_inputs():
    repeated, written = _VOrder(STAGES, 4), _VOrder(STAGES, 4)
    repeated.repeat(3, F0B1, F1B0)
    repeated.repeat(0, W0)
    written.repeat(1, *[F0B1, F1B0] * 3)
    assert all((a == b).all() for a, b in zip(repeated.columns(), written.columns()))
    order = _VOrder(STAGES, 2)
    order.repeat(3, I0, I1)
    order.repeat(2, W1)
    assert (order.pending_of(0), order.pending_of(1)) == (3, 1)
