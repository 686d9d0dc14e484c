"""The caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), each case
written out by hand from c10/cuda/CUDACachingAllocator.cpp (`ExpandableSegments`) beside what the default
allocator (`CachingAllocator`) reserves for the same requests."""

import pytest

from pipesim.sim.caching_allocator import AllocatorOutOfMemory, CachingAllocator, ExpandableSegments
from pipesim.units import GIB, KIB, MIB


def test_a_freed_tensors_pages_serve_a_larger_one_after_it():
    """The loss's 4 GiB of 16-bit logits freed before an 8 GiB float32 tensor: by default the 4 GiB segment stays
    cached beside a new 8 GiB one (12 GiB reserved); expandable, the logits' 205 pages of 20 MiB (4,100 MiB) are
    the segment's free end, and 205 more are mapped after them: 8,200 MiB reserved, 8 MiB of it free."""
    for allocator, reserved in ((CachingAllocator(), 12 * GIB), (ExpandableSegments(), 8200 * MIB)):
        allocator.free(allocator.malloc(4 * GIB))
        allocator.malloc(8 * GIB)
        assert (allocator.reserved_bytes, allocator.peak_allocated_bytes) == (reserved, 8 * GIB)


def test_small_requests_map_2_mib_pages_and_large_ones_20_mib_a_segment_a_stream():
    """1,000 bytes take 1 KiB (512-byte rounding) of one 2 MiB page of the small pool; 11 MiB takes one 20 MiB
    page of the large pool, and a second 11 MiB the 9 MiB left at its end and one more page (40 MiB), where the
    default allocator gives each a segment of its own rounded to 2 MiB (12 + 12). Another stream's 11 MiB maps a
    page of its own segment beside the 18 MiB free at the first's end (a block never serves another stream)."""
    allocator = ExpandableSegments()
    allocator.malloc(1000)
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (2 * MIB, 1 * KIB)
    for reserved_mib in (22, 42):
        allocator.malloc(11 * MIB)
        assert allocator.reserved_bytes == reserved_mib * MIB
    allocator.malloc(11 * MIB, stream=1)
    assert allocator.reserved_bytes == 62 * MIB
    default = CachingAllocator()
    default.malloc(11 * MIB)
    default.malloc(11 * MIB)
    assert default.reserved_bytes == 24 * MIB


def freed_before(allocator: CachingAllocator, freed_mib: int, kept_mib: int) -> int:
    """A (`freed_mib`) and B (`kept_mib`) allocated, A freed: A's address."""
    first = allocator.malloc(freed_mib * MIB)
    allocator.malloc(kept_mib * MIB)
    allocator.free(first)
    return first


def test_a_block_is_split_whenever_512_bytes_remain():
    """A (30 MiB: two pages, 10 MiB free at the end) and B (10 MiB, that end) mapped, A freed: 29.5 MiB takes A's
    block and the 0.5 MiB left is a free block of its own (`should_split`: 512 bytes or more, in either pool), 39.5
    MiB allocated; the default allocator keeps a large block whole unless over 1 MiB remains: 40."""
    for allocator, allocated in ((ExpandableSegments(), 39 * MIB + 512 * KIB), (CachingAllocator(), 40 * MIB)):
        freed_before(allocator, 30, 10)
        allocator.malloc(30 * MIB - 512 * KIB)
        assert (allocator.allocated_bytes, allocator.reserved_bytes) == (allocated, 40 * MIB)


def test_a_block_at_the_mapped_end_serves_only_what_no_other_block_holds():
    """A (40 MiB), B (20) and C (25 MiB, two pages: 15 MiB free at the end) mapped, A freed: a 10 MiB request takes
    A's front, not the smaller free end (it could grow past any size: `get_free_block`'s expandable_size), so a
    35 MiB request then finds no block holding it and maps one more page after the end's 15 MiB: 120 MiB. Best
    fit alone would have put 10 MiB at the end and 35 in A: 100 MiB."""
    allocator = ExpandableSegments()
    first = allocator.malloc(40 * MIB)
    allocator.malloc(20 * MIB)
    allocator.malloc(25 * MIB)
    allocator.free(first)
    assert allocator.malloc(10 * MIB) == first
    allocator.malloc(35 * MIB)
    assert allocator.reserved_bytes == 120 * MIB


def test_the_loss_backwards_second_float32_gradient_maps_new_pages_beside_the_logits_hole():
    """torchtitan's loss at Table 2's 32,768 tokens (docs/benchmarks.md): the bf16 logits A (8,016 MiB: 401 pages,
    8,020), their float32 copy B (16,032: the 4 MiB free end and 802 pages) and the log-softmax C (16,032: the
    12 MiB free end and 801 pages) mapped end to end, 40,080 MiB; B freed, then A: one free block of 24,048 at
    the segment's front. nll_loss_backward's gradient D (16,032) takes its front by best fit, leaving 8,016
    free; _log_softmax_backward_data's E (16,032) fits no free block and maps 802 more pages: 56,120 MiB reserved
    for 48,096 allocated, the 8,016 hole among them, as CUDACachingAllocator.cpp's rules put it."""
    allocator = ExpandableSegments()
    logits, copied = allocator.malloc(8016 * MIB), allocator.malloc(16032 * MIB)
    allocator.malloc(16032 * MIB)
    allocator.free(copied)
    allocator.free(logits)
    assert allocator.malloc(16032 * MIB) == logits
    assert allocator.malloc(16032 * MIB) == 40080 * MIB
    assert (allocator.reserved_bytes, allocator.peak_allocated_bytes) == (56120 * MIB, 48096 * MIB)


def test_a_mapping_that_fails_unmaps_every_free_page_then_maps_again():
    """100 MiB of memory: A (60 MiB) and B (20) mapped, A freed; C (70 MiB) needs four more pages (160 > 100), so
    A's three pages are unmapped (20 reserved), which still do not hold C beside B; C maps four pages after B:
    100 MiB reserved, 90 allocated at most. The default allocator releases A's whole segment and takes one of
    70 MiB: 90. A further 20 MiB fits in neither: C's free 10 MiB is no whole page."""
    for allocator, reserved in ((CachingAllocator(capacity_bytes=100 * MIB), 90 * MIB),
                                (ExpandableSegments(capacity_bytes=100 * MIB), 100 * MIB)):
        freed_before(allocator, 60, 20)
        allocator.malloc(70 * MIB)
        assert (allocator.reserved_bytes, allocator.peak_reserved_bytes, allocator.peak_allocated_bytes) == (
            reserved, reserved, 90 * MIB)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(20 * MIB + 512)


def test_unmapped_pages_inside_the_segment_are_mapped_again_first():
    """210 MiB of memory: A (60 MiB) and B (20) mapped, A freed, C (140) needs seven more pages (220 > 210): A's
    three are unmapped and C maps seven after B (160 reserved). A 40 MiB request then maps two pages where A was,
    the lowest unmapped pages that hold it (`find_expandable_block`), not after C: 200 MiB reserved."""
    allocator = ExpandableSegments(capacity_bytes=210 * MIB)
    first = freed_before(allocator, 60, 20)
    allocator.malloc(140 * MIB)
    assert allocator.reserved_bytes == 160 * MIB
    assert allocator.malloc(40 * MIB) == first
    assert allocator.reserved_bytes == 200 * MIB


def test_a_segment_left_wholly_unmapped_is_released_and_a_new_one_taken():
    """100 MiB of memory, so a large pool's segment spans 9/8 of it in 20 MiB pages (six): A (100 MiB, five pages)
    freed, 101 MiB needs a sixth page (120 > 100); A's five unmapped leave the whole segment unmapped, which is
    released (`release_expandable_segment`), and the retry takes a new segment, whose six pages do not fit
    either: out of memory, nothing reserved. 100 MiB then maps five pages of that new segment."""
    allocator = ExpandableSegments(capacity_bytes=100 * MIB)
    first = allocator.malloc(100 * MIB)
    allocator.free(first)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(101 * MIB)
    assert allocator.reserved_bytes == 0 and list(allocator._segments.values()) == [120 * MIB]
    assert allocator.malloc(100 * MIB) != first
    assert allocator.reserved_bytes == 100 * MIB


@pytest.mark.parametrize("seed", range(6))
def test_every_mapped_byte_is_a_block_handed_out_or_free(seed):
    """Any mallocs and frees on two streams, bounded or not: the mapped pages are exactly the blocks handed out
    and the free ones, which never overlap, and free neighbours are always merged."""
    import random

    rng = random.Random(seed)
    allocator = ExpandableSegments(capacity_bytes=rng.choice([None, 400 * MIB]))
    live: list[int] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(allocator.malloc(rng.choice([300, 700 * KIB, 3 * MIB, 12 * MIB, 45 * MIB]),
                                             stream=rng.randrange(2)))
            except AllocatorOutOfMemory:
                continue
        blocks = sorted([*allocator._allocated.items(), *allocator._cached_at.items()])
        assert sum(size for _, size in blocks) == allocator.reserved_bytes
        assert all(address + size <= following for (address, size), (following, _) in zip(blocks, blocks[1:]))
        assert not any(address + size in allocator._cached_at for address, size in allocator._cached_at.items())
        assert allocator.allocated_bytes == sum(allocator._allocated.values())


SMALL_GPT = ["--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "4",
             "--seq-len", "256", "--vocab", "8192"]


def test_simulate_sweep_and_tune_replay_each_device_with_expandable_segments(tmp_path):
    """--allocator expandable replays each device's step with `ExpandableSegments`: the tensors' parts are the
    default's, the reserve its own (its 20 MiB pages map more than this small model's 2 MiB-rounded segments),
    and sweep and tune read the peak simulate reads."""
    import csv

    from tests.conftest import pipesim, simulate_json

    schedule = ["-p", "2", "-m", "4", "-s", "1f1b"]
    (caching,), (expandable,) = (simulate_json(*SMALL_GPT, *schedule, "--allocator", allocator)
                                 for allocator in ("caching", "expandable"))
    for default, grown in zip(caching["devices"], expandable["devices"]):
        parts, grown_parts = default["peak_memory_parts_mb"], grown["peak_memory_parts_mb"]
        assert {**grown_parts, "reserve": 0} == pytest.approx({**parts, "reserve": 0}, rel=1e-12)
        assert grown_parts["reserve"] > parts["reserve"]
    peak = max(device["peak_memory_mb"] for device in expandable["devices"])
    out = tmp_path / "sweep.csv"
    code, _, err = pipesim("sweep", *SMALL_GPT, *schedule, "--allocator", "expandable", "--workers", "1", "--out", out)
    assert code == 0, err
    (row,) = csv.DictReader(out.open())
    assert float(row["peak_memory_mb"]) == pytest.approx(peak, rel=1e-9)
    from tests.helpers import simulated_peak_mib, tuned_peak_mib

    tuned = tuned_peak_mib("--allocator", "expandable")
    assert tuned == pytest.approx(simulated_peak_mib("--allocator", "expandable"))
    assert tuned != pytest.approx(tuned_peak_mib())
