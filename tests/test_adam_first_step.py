"""Adam's moments as torch's AdamW makes them under FSDP2 (sim/caching_allocator.py ADAM_STATE, ADAM_STEP): at the
optimizer's first step, after the first step's gradients were freed, not held from the start, so in the default
allocator they take the gradients' cached blocks and the second step's gradients a segment more."""

from __future__ import annotations

import pytest

from pipesim.sim.caching_allocator import LayerAllocations, replay_device, stage_program, step_events
from pipesim.units import MIB

# saves 40 MiB, makes a 20 MiB gradient; its whole weights 10 MiB, float32 gradients 30, their shard 10
LAYER = LayerAllocations({"fwd": [(0, 40 * MIB)], "bwd": [(0, 20 * MIB)]}, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),))


def test_the_moments_made_at_the_first_step_take_a_gradients_block_and_the_next_gradients_a_new_segment():
    """One layer, one micro-batch a step, two steps. The first step makes, on the compute stream, the whole weights
    (10 MiB), the activation (40), the gradient (20) and the float32 gradients (30), a segment each, and frees them
    all (the reduce-scatter input, 30, takes the activation's block), 100 MiB reserved; 10 more on each of the
    reduce-scatter and all-gather streams. Its optimizer then makes the two 10 MiB moments: the first takes the
    weights' 10 MiB block, the second the front of the gradient's 20 (split), and the square roots' 10 MiB its
    back, freed again. The second step's weights take that back, its gradient the front of the 30 MiB block, and
    its float32 gradients find no 30 MiB block: a new segment, 130 MiB reserved on the compute stream, 150 in all.
    The moments held as one 20 MiB block from the start instead (the state `replay_device` is given) reserve 120
    and 140; the most allocated is 130 either way (the second step's backward beside the moments)."""
    rows = [(name, stage, microbatch[1:]) for name, stage, microbatch in step_events(
        [(name, 0, (0, step, 0)) for step in range(2) for name in ("fwd", "bwd")])]
    programs = {0: stage_program([LAYER])}
    held = replay_device([20 * MIB], rows, programs)
    made = replay_device([], rows, programs, adam_at_first_step=True)
    assert (held.peak_reserved_bytes, held.peak_allocated_bytes) == (140 * MIB, 130 * MIB)
    assert (made.peak_reserved_bytes, made.peak_allocated_bytes) == (150 * MIB, 130 * MIB)


@pytest.mark.parametrize("optimizer,minibatches,made", [("adamw", 1, True), ("adamw", 2, True), ("adam", 2, True),
                                                        ("momentum", 2, False), ("sgd", 2, False)])
def test_simulate_makes_the_moments_at_the_first_step(monkeypatch, optimizer, minibatches, made):
    """The first mini-batch runs as a first step and the optimizer state is not among the blocks held, over one
    mini-batch too (a flushing order's step is replayed again as the steps after it run, `steady_rows`). Only
    Adam's and AdamW's: another optimizer's state (SGD's none, momentum's one buffer) is no two moments."""
    from tests.conftest import simulate_json, spy_reserves

    seen = spy_reserves(monkeypatch)
    simulate_json("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "4",
                  "--seq-len", "256", "--vocab", "8192", "-p", "2", "-m", "4", "-s", "1f1b", "--data-parallel", "2",
                  "--zero", "3", "--precision", "fsdp2", "-n", str(minibatches), "--optimizer", optimizer)
    # each device: the weights' shards, and the moments unless made
    assert [(len(call["static_bytes"]), call["adam_at_first_step"]) for call in seen] == [(1 if made else 2, made)] * 2
