"""A compiled block's first forward under its checkpoint frees what autograd would save once nothing later reads it
(planning/estimate.py `_compiled_checkpoint_forward`: torch's checkpoint holds none of it, Inductor frees each buffer
after its last use; sim/caching_allocator.py `LayerAllocations.first_forward`), while the backward's rerun makes and
holds it as before. Each case written out by hand."""


from pipesim.planning.estimate import _compiled_checkpoint_forward
from pipesim.sim.caching_allocator import LayerAllocations, replay_device, stage_program
from pipesim.units import MIB
from tests.helpers import small_gpt_count

# A block's forward that saves 30 MiB (0) and 12 MiB (1, made from 0) and outputs 16 (2, made from 1)
EAGER = ((0, 30 * MIB), (1, 12 * MIB), (2, 16 * MIB))
READS = ((0, ()), (1, (0,)), (2, (1,)))
COMPILED = ((0, 30 * MIB), (1, 12 * MIB), (0, -30 * MIB), (2, 16 * MIB), (1, -12 * MIB))


def test_each_saved_storage_the_checkpoint_reruns_is_freed_after_the_last_made_from_it():
    assert _compiled_checkpoint_forward(EAGER, READS, frozenset({0, 1})) == COMPILED


def test_a_saved_storage_nothing_reads_goes_as_it_is_made_and_one_not_rerun_stays():
    """0 read by nothing later (the backward alone reads it); 1 not rerun (a policy keeps it): held as counted."""
    reads = ((0, ()), (1, ()), (2, (1,)))
    assert _compiled_checkpoint_forward(EAGER, reads, frozenset({0})) == (
        (0, 30 * MIB), (0, -30 * MIB), (1, 12 * MIB), (2, 16 * MIB))


def test_a_count_without_its_data_flow_keeps_the_forward_as_counted():
    assert _compiled_checkpoint_forward(EAGER, (), frozenset({0, 1})) == EAGER


BACKWARD = ((0, 20 * MIB), (0, -20 * MIB))


def _replayed(first_forward):
    layers = [LayerAllocations({"fwd": EAGER, "bwd": BACKWARD}, saved=frozenset({0, 1}), rerun=frozenset({0, 1, 2}),
                               first_forward=first_forward)]
    allocator = replay_device([], [("fwd", 0, 0), ("bwd", 0, 0)], {0: stage_program(layers)})
    return allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes


def test_the_first_forward_frees_what_the_rerun_makes_and_holds_again():
    """Compiled, F frees 0 once 1 is made and 1 once the output is: at most 30 + 12 allocated, the output 16 taking
    the front of 0's 30 MiB segment. B reruns 0 (a new 30), 1 (the cached 12) and the output (a new 16, freed),
    holding 0 and 1 beside F's output for its own 20 (a new segment): 16 + 30 + 12 + 20 at most; reserved 30 + 12
    + 30 + 16 + 20. Eager (the forward as counted), F holds 0 and 1 to its end, its output a segment of its own,
    and B's rerun takes them back from the cache: 30 + 12 + 16 + 16 + 20 reserved, 30 + 12 + 16 at F's end."""
    assert _replayed(COMPILED) == (108 * MIB, 78 * MIB, 0)
    assert _replayed(None) == (94 * MIB, 78 * MIB, 0)


def test_an_estimate_frees_a_compiled_blocks_saved_storages_within_its_forward():
    """A GPT block under full recomputation: compiled, its forward leaves only its output live, each saved storage
    freed after the last storage made from it; eager, it holds them all to the block's end."""
    from pipesim.planning.estimate import Parallelism, layer_allocations

    counted = small_gpt_count("flash")
    block = counted.layers[1]
    eager, compiled = (layer_allocations(counted, Parallelism(recompute="full", torch_compile=on))[1]
                       for on in (False, True))
    saved = frozenset(block.saved_allocations)
    assert saved and eager.passes == compiled.passes and eager.first_forward is None

    def live(events):
        left: dict[int, int] = {}
        for number, nbytes in events:
            left[number] = left.get(number, 0) + nbytes
        return {number for number, nbytes in left.items() if nbytes}

    assert saved <= live(eager.passes["fwd"]) and not saved & live(compiled.first_forward)
    made_before, seen = {}, set()  # each free's place: the storage whose making (its first event) it follows
    for number, _ in compiled.first_forward:
        if number not in seen:
            seen.add(number)
            last_made = number
        elif number in saved:
            made_before[number] = last_made
    assert made_before == {number: max((reader for reader, read in block.forward_reads if number in read),
                                       default=number) for number in saved}


def test_an_in_place_write_holds_what_it_writes_and_reads_until_what_it_reads_is_made():
    """0 (8 MiB, saved: the in-place op saves its result, as relu_ does) is written in place reading 1 (30 MiB,
    saved) and 2 (4 MiB), both made after it; nothing later reads them. The write runs once 2 is made, so 0 and 1
    are held until then (8 + 30 + 4 MiB at once), not freed as each is made (at most 30 + 4)."""
    eager = ((0, 8 * MIB), (1, 30 * MIB), (2, 4 * MIB), (3, 16 * MIB))
    reads = ((0, (1, 2)), (1, ()), (2, ()), (3, ()))
    assert _compiled_checkpoint_forward(eager, reads, frozenset({0, 1})) == (
        (0, 8 * MIB), (1, 30 * MIB), (2, 4 * MIB), (0, -8 * MIB), (1, -30 * MIB), (3, 16 * MIB))
