"""The caching allocator's rules, each case written out by hand from c10/cuda/CUDACachingAllocator.cpp."""

import pytest

from pipesim.sim.caching_allocator import AllocatorOutOfMemory, CachingAllocator, round_request, segment_bytes
from pipesim.units import KIB, MIB


def test_requests_round_to_512_bytes():
    assert [round_request(n) for n in (0, 1, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]


def test_segment_sizes_by_request():
    assert segment_bytes(512) == 2 * MIB
    assert segment_bytes(1 * MIB) == 2 * MIB  # at most 1 MiB: the small pool
    assert segment_bytes(1 * MIB + 512) == 20 * MIB
    assert segment_bytes(10 * MIB - 512) == 20 * MIB
    assert segment_bytes(10 * MIB) == 10 * MIB  # from 10 MiB up: its own size, rounded to 2 MiB
    assert segment_bytes(11 * MIB) == 12 * MIB


def test_small_requests_pack_into_2_mib_segments():
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(512 * KIB)
    assert allocator.reserved_bytes == 2 * MIB
    allocator.malloc(1)
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (4 * MIB, 2 * MIB + 512)


def test_a_middle_request_splits_a_20_mib_segment():
    allocator = CachingAllocator()
    allocator.malloc(3 * MIB)
    allocator.malloc(3 * MIB)  # from the first segment's remaining 17 MiB
    assert allocator.reserved_bytes == 20 * MIB


def test_a_large_segment_is_split_only_when_over_1_mib_remains():
    allocator = CachingAllocator()
    allocator.malloc(11 * MIB)  # 12 MiB segment, 1 MiB left: not split, the block is the whole segment
    assert allocator.allocated_bytes == 12 * MIB
    allocator.malloc(10 * MIB + 512)  # 12 MiB segment, 2 MiB - 512 left: split
    assert allocator.allocated_bytes == 22 * MIB + 512
    allocator.malloc(3 * MIB // 2)  # served by the remainder: no 20 MiB segment
    assert allocator.reserved_bytes == 24 * MIB


def _cached(allocator: CachingAllocator, *sizes_mib: int) -> list[int]:
    """Allocate a block of each size in MiB, then free them all: they stay cached. Their addresses."""
    addresses = [allocator.malloc(size * MIB) for size in sizes_mib]
    for address in addresses:
        allocator.free(address)
    return addresses


def test_best_fit_among_cached_blocks():
    allocator = CachingAllocator()
    first, second = _cached(allocator, 50, 30)
    assert allocator.malloc(25 * MIB) == second  # the smallest that holds it, at its front
    assert allocator.malloc(40 * MIB) == first
    assert allocator.reserved_bytes == 80 * MIB


def test_blocks_of_different_segments_never_merge():
    allocator = CachingAllocator()
    _cached(allocator, 20, 20)
    allocator.malloc(40 * MIB)
    assert (allocator.reserved_bytes, allocator.peak_reserved_bytes) == (80 * MIB, 80 * MIB)


def test_freed_neighbours_merge_within_a_segment():
    allocator = CachingAllocator()
    first, second = allocator.malloc(3 * MIB), allocator.malloc(3 * MIB)
    allocator.free(second)
    allocator.free(first)  # first, second and the rest are one 20 MiB block again
    assert allocator.malloc(18 * MIB) == first
    assert allocator.reserved_bytes == 20 * MIB


def test_a_block_freed_on_one_stream_never_serves_another():
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(100 * MIB, stream=0))
    allocator.malloc(100 * MIB, stream=1)
    assert allocator.reserved_bytes == 200 * MIB


def test_a_freed_tensor_keeps_its_segment_beside_a_larger_one():
    """The 8B's loss: the 16-bit logits (4,008 MiB) freed before a float32 tensor twice their size."""
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(4008 * MIB))
    allocator.malloc(8016 * MIB)
    assert (allocator.allocated_bytes, allocator.peak_reserved_bytes) == (8016 * MIB, 12024 * MIB)


def test_max_split_size_keeps_oversize_blocks_whole():
    allocator = CachingAllocator(max_split_bytes=200 * MIB)
    allocator.free(allocator.malloc(300 * MIB))
    allocator.malloc(100 * MIB)  # under max_split_size: never an oversize cached block
    assert allocator.reserved_bytes == 400 * MIB
    allocator.free(allocator.malloc(260 * MIB))  # its own 260 MiB segment
    taken = allocator.malloc(250 * MIB)  # within 20 MiB of the 260 MiB block: taken whole, not split
    assert allocator.allocated_bytes == 100 * MIB + 260 * MIB and allocator.reserved_bytes == 660 * MIB
    allocator.free(taken)
    allocator.malloc(230 * MIB)  # 30 MiB under both cached blocks: a segment of its own
    assert allocator.reserved_bytes == 890 * MIB


def test_a_failed_cuda_malloc_releases_whole_cached_segments_then_gives_up():
    allocator = CachingAllocator(capacity_bytes=100 * MIB)
    kept = allocator.malloc(3 * MIB)  # a 20 MiB segment, split: not released while part of it is held
    allocator.free(allocator.malloc(40 * MIB))
    allocator.malloc(60 * MIB)  # 20 + 40 + 60 > 100: the cached 40 MiB segment is released
    assert (allocator.reserved_bytes, allocator.peak_reserved_bytes) == (80 * MIB, 80 * MIB)
    allocator.free(kept)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(90 * MIB)  # even with the 20 MiB segment released, 60 + 90 > 100


def test_the_counts_allocations_are_each_passs_creations_and_frees_in_order():
    """Per pass, every storage freed was created before in the same pass, with the same bytes, and the freed ones
    live at once at their most are the pass's transient tensors."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 32, "vocab": 1000}, 2,
                          torch.bfloat16)
    for layer in counted.layers[1:]:
        assert set(layer.allocations) == {"fwd", "bwd", "igrad", "wgrad"}
        for name in ("bwd", "igrad", "wgrad"):
            created = {number: nbytes for number, _, nbytes in layer.allocations[name] if nbytes >= 0}
            freed = [(number, -nbytes) for number, _, nbytes in layer.allocations[name] if nbytes < 0]
            assert all(created[number] == nbytes for number, nbytes in freed)
            live, most = 0, 0
            for number, _, nbytes in layer.allocations[name]:
                if number in dict(freed):
                    live += nbytes
                    most = max(most, live)
            assert most == sum(nbytes for _, nbytes in layer.transient_tensors[name])


def test_the_losss_16_bit_logits_stay_reserved_beside_its_backwards_float32_tensors():
    """The loss layer (final norm, head, cross entropy upcast to float32) over 2,048 tokens of an 8,192-word
    vocabulary, its forward then its backward replayed: the forward reserves 2 MiB for its small tensors, 32 MiB
    for the bf16 logits, 64 for their float32 copy and 64 for the log-softmax it saves, and frees the first two
    large ones; the backward's two float32 gradients take the copy's cached block and one new 64 MiB segment
    (the logits' 32 MiB block holds neither), and its bf16 gradient the logits' block. Reserved: 226 MiB, of
    which the logits' segment is not held at the peak."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 1024, "vocab": 8192}, 2,
                          torch.bfloat16)
    loss = counted.layers[-1]
    allocator = CachingAllocator()
    kept = allocator.replay(loss.allocations["fwd"])
    assert allocator.reserved_bytes == (2 + 32 + 2 * 64) * MIB and len(kept) == 6  # the log-softmax among them
    allocator.replay(loss.allocations["bwd"])
    assert allocator.peak_reserved_bytes == (2 + 32 + 3 * 64) * MIB
    assert allocator.peak_reserved_bytes - allocator.peak_allocated_bytes > 32 * MIB
