"""PyTorch's CUDA caching allocator, its rules replayed on a sequence of allocations and frees, so that a device's
peak can be read as runtimes report it: max *reserved* (the segments taken from cudaMalloc), not the bytes the
tensors hold. torchtitan's and most runtimes' memory figures are reserved bytes; a tensor freed before a larger
one is made keeps its segment, since a cached block serves only requests it can hold.

The rules, from c10/cuda/CUDACachingAllocator.cpp (`DeviceCachingAllocator::malloc`, `get_free_block`,
`should_split`, `get_allocation_size`, `free_block`, `try_merge_blocks`, `release_cached_blocks`), with
expandable segments off (the default) and no garbage-collection threshold:

- a request is rounded up to a multiple of 512 bytes (`round_size`, no power-of-two divisions);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large pool,
  whose segments are 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- a request takes the smallest cached block of its pool and stream that holds it (ties: the lowest address),
  else a new segment; a block is split when what remains is at least 512 bytes (small pool), or over 1 MiB and
  the request under `max_split_size` (large pool); the request takes the block's front;
- with `max_split_size` set (PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb), a request under it never takes a
  cached block of at least that size, and one at or above it takes a block at most 20 MiB larger;
- a freed block merges with its free neighbours of the same segment; blocks of different segments never merge
  and a block freed on one stream never serves another;
- nothing cached is given back, short of a cudaMalloc that fails: then every cached block that is a whole
  segment is released (all pools and streams) and the segment is tried once more.

With expandable segments on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, `--allocator expandable`), a pool's
one segment grows page by page instead: `ExpandableSegments`.
"""

from __future__ import annotations

import functools
from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..traces.trace import Counter, Trace
from ..units import MIB
from .costs import TRANSIENT_KINDS

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_REQUEST_BYTES = 1 * MIB  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT_BYTES = 2 * MIB  # kSmallBuffer: the small pool's segments
LARGE_SEGMENT_BYTES = 20 * MIB  # kLargeBuffer: the segment of a large-pool request under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc: from it up, a request gets a segment of its own size
LARGE_ROUNDING_BYTES = 2 * MIB  # kRoundLarge: what such a segment is rounded up to

# The allocator's addresses are its own: a pool (`pool_of`: a stream's small or large pool) has an address space of
# its own above POOL_SHIFT, in which each segment starts SEGMENT_GAP_BYTES above the end of the one before, so that
# a block's end is another block's start only within a segment (blocks of different segments never merge), and
# equal-sized cached blocks of a pool order as first made first (best fit's ties: the lowest address). No pool's
# reservations reach the next pool's addresses: the count refuses a tensor past 2^63 bytes (workload/count.py
# `_addressable`), so it would take 2^65 of them (an unbounded replay's, `_reserve`, passed 2^48 bytes: gpt at -b 6e7)
POOL_SHIFT = 128
SEGMENT_GAP_BYTES = MIN_BLOCK_BYTES
# `CachingAllocator` keeps its addresses and sizes in units of MIN_BLOCK_BYTES (every request, block and segment is
# a multiple of it): a large pool's addresses pass 2^30 bytes, past which CPython's ints take two digits and each sum,
# hash and comparison of them costs more; in units they stay one digit to 512 GiB. `malloc` hands its addresses out
# in bytes, the same ones an allocator in bytes gives.
UNIT_SHIFT = 9

# A pass as a step's first of the stage runs it, and what its last runs after it (`StageProgram`)
FIRST = ":first"
LAST = ":last"
RELEASE = "release"
# A stage's last full or weight backward of a mini-batch, after which its pipeline runtime concatenates the model
# outputs the stage kept into one tensor and frees it (sim/costs.py `merges_outputs`: torch's `_merge_outputs`)
MERGE = ":merge"
# A device's first row of a mini-batch, before which the optimizer's zero_grad frees the gradient shards
# (ZERO_GRAD); what the step before left, made as the replay starts (LEFT: the shards, the last all-gather's output)
ZERO = ":zero"
ZERO_GRAD = "zero_grad"
LEFT = "left"
# torch's AdamW as torchtitan steps it (foreach): each parameter's two moments made at the optimizer's first step
# (ADAM_STATE: `_init_group`, exp_avg and exp_avg_sq, zeros_like the parameter's float32 shard), and each step the
# square roots of the second moments, a list of them made and freed (ADAM_STEP: `_multi_tensor_adamw`'s
# `_foreach_sqrt`; the other foreach ops are in place)
ADAM_STATE = "adam_state"
ADAM_STEP = "adam_step"
# Megatron-LM's 16-bit optimizer (Float16OptimizerWithFloat16Params, megatron/optimizer/optimizer.py) each step:
# `_copy_model_grads_to_main_grads` makes every parameter's float32 main gradient (`main_grad.float()`, a copy
# where the gradient buffer is 16-bit) before Apex's FusedAdam runs (MAIN_GRADS), and the next step's `zero_grad`
# frees them (set_to_none: ZERO_MAIN_GRADS)
MAIN_GRADS = "main_grads"
ZERO_MAIN_GRADS = "zero_main_grads"
# FSDP2 without a pipeline: each pass gathers (and a forward reshards, a backward reduce-scatters) block by block
# (`_unpipelined`); a pass so named runs its EACH program
EACH = ":each"
# A row whose pass the row before ran too, with no other between (GPipe's order): a forward after a forward finds
# FSDP2's root and last block still whole, a backward after a backward finds them resharded (`_unpipelined`)
AGAIN = ":again"
# FSDP2 makes a reduce-scatter's output on its reduce-scatter stream and an all-gather's flat output on its
# all-gather stream (`FSDPCommContext`), whose cached blocks serve no other stream; a device's second model part
# the next two, and so on (`stage_program`'s part)
REDUCE_SCATTER_STREAM = 1
ALL_GATHER_STREAM = 2

# What `CachingAllocator.run` replays: (slot, request bytes, pool) a block each, the request rounded (`round_request`)
# and its pool decided (`pool_of`) once, its address put in the slot; a request of 0 bytes frees the slot's block
Op = tuple[int, int, int]


class AllocatorOutOfMemory(MemoryError):
    """A segment that does not fit beside what is reserved, even once every whole cached segment is released."""


def round_request(nbytes: int) -> int:
    """The bytes a request of `nbytes` takes (`round_size`): at least 512, a multiple of 512."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_bytes(request_bytes: int) -> int:
    """The segment a rounded request gets when no cached block holds it (`get_allocation_size`)."""
    if request_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if request_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-request_bytes // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES


def pool_of(request_bytes: int, stream: int) -> int:
    """The pool a rounded request on `stream` takes its block from: the stream's small one (odd) or large one."""
    if stream < 0:
        raise ValueError(f"stream: 0 or more (got {stream})")
    return stream << 1 | (request_bytes <= SMALL_REQUEST_BYTES)


@dataclass
class CachingAllocator:
    """One device's caching allocator. `capacity_bytes`: what cudaMalloc can hand out in all (None: unbounded);
    `max_split_bytes`: max_split_size (None: unset, torch's default). No block objects: a block is its address
    and size, its neighbours within the segment what ends where it starts and what starts where it ends; both in
    units of `1 << unit_shift` bytes (UNIT_SHIFT), in which `run`'s slots hold the addresses."""

    capacity_bytes: int | None = None
    max_split_bytes: int | None = None
    reserved_bytes: int = 0
    allocated_bytes: int = 0  # the blocks handed out, rounded as the allocator's own statistics count them
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    _allocated: dict[int, int] = field(default_factory=dict)  # the blocks handed out: size by address
    _cached_at: dict[int, int] = field(default_factory=dict)  # the cached blocks: size by address
    _cached_ending: dict[int, int] = field(default_factory=dict)  # the cached blocks: address by where they end
    # per pool, how it orders its cached blocks (BlockComparatorSize: by size, then address): their sizes, sorted
    # and each once, and by size their addresses, sorted, so that best fit is a bisection over the few sizes a step
    # makes and its tie the first of that size's list (`_cache`, `_uncache`)
    _pools: dict[int, tuple[list[int], dict[int, list[int]]]] = field(default_factory=dict)
    _segments: dict[int, int] = field(default_factory=dict)  # every segment's size by address
    _next_address: dict[int, int] = field(default_factory=dict)  # per pool, where its next segment starts
    unit_shift: ClassVar[int] = UNIT_SHIFT  # its units' bytes, as a shift

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Hand out a block for `nbytes` on `stream` as torch would; returns its address in bytes (for `free`)."""
        request_bytes, slots = round_request(nbytes), [0]
        self.run(((0, request_bytes, pool_of(request_bytes, stream)),), slots)
        return slots[0] << self.unit_shift

    def free(self, address: int) -> None:
        """Give back the block at `address` (bytes): cached for its stream, merged with its free neighbours."""
        self.run(((0, 0, 0),), [address >> self.unit_shift])

    def run(self, ops: Iterable[Op], slots: list[int]) -> None:
        """Replay `ops` (`Program`), each block's address in `slots` at its op's slot. A request takes the
        smallest cached block of its pool that holds it (`get_free_block`), else a new segment, and its front
        when the block is split (`should_split`); a freed block merges with its cached neighbours (`free_block`,
        `try_merge_blocks`) and is cached. The rules as one loop, `malloc` and `free` included (one op each):
        a device's step is millions of them. Requests in bytes, the rest in units (UNIT_SHIFT)."""
        allocated, cached_at, cached_ending, pools = self._allocated, self._cached_at, self._cached_ending, self._pools
        max_split = self.max_split_bytes
        allocated_units = self.allocated_bytes >> UNIT_SHIFT
        peak_allocated_units = self.peak_allocated_bytes >> UNIT_SHIFT
        pool_shift, small_request = POOL_SHIFT - UNIT_SHIFT, SMALL_REQUEST_BYTES >> UNIT_SHIFT
        try:
            for slot, request, pool in ops:
                if request:
                    request >>= UNIT_SHIFT
                    try:
                        sizes, buckets = pools[pool]
                    except KeyError:
                        sizes, buckets = pools[pool] = [], {}
                    bucket = buckets.get(request)
                    if bucket is not None:  # a cached block of the request's own size: best fit, nothing to split
                        address = bucket.pop(0)
                        if not bucket:
                            del buckets[request], sizes[bisect_left(sizes, request)]
                        del cached_at[address], cached_ending[address + request]
                        size = request
                    else:
                        at = bisect_left(sizes, request)
                        if at < len(sizes) and (max_split is None or _may_take(
                                request << UNIT_SHIFT, sizes[at] << UNIT_SHIFT, max_split)):
                            size = sizes[at]
                            bucket = buckets[size]
                            address = bucket.pop(0)
                            if not bucket:
                                del buckets[size], sizes[at]
                            del cached_at[address], cached_ending[address + size]
                        else:
                            address, size = self._new_segment(request, pool)
                    remaining = size - request
                    if remaining and (pool & 1 or  # `should_split`: 512 bytes, over 1 MiB
                                      remaining > small_request and (max_split is None or
                                                                     request << UNIT_SHIFT < max_split)):
                        size = request
                    else:
                        remaining = 0
                    allocated[address] = size
                    allocated_units += size
                    if allocated_units > peak_allocated_units:
                        peak_allocated_units = allocated_units
                    slots[slot] = address
                    if not remaining:
                        continue
                    address, size = address + request, remaining  # the rest of the block, cached below
                    end = address + size
                else:
                    address = slots[slot]
                    size = allocated.pop(address)
                    allocated_units -= size
                    sizes, buckets = pools[address >> pool_shift]
                    before = cached_ending.pop(address, None)
                    if before is not None:  # merged with the cached block ending where it starts (`_uncache`)
                        merged = cached_at.pop(before)
                        bucket = buckets[merged]
                        if len(bucket) == 1:
                            del buckets[merged], sizes[bisect_left(sizes, merged)]
                        else:
                            del bucket[bisect_left(bucket, before)]
                        address, size = before, size + merged
                    end = address + size
                    after = cached_at.pop(end, None)
                    if after is not None:  # and with the one starting where it ends
                        del cached_ending[end + after]
                        bucket = buckets[after]
                        if len(bucket) == 1:
                            del buckets[after], sizes[bisect_left(sizes, after)]
                        else:
                            del bucket[bisect_left(bucket, end)]
                        size += after
                        end += after
                bucket = buckets.get(size)  # the block cached (`_cache`, written out: the loop's hottest lines)
                if bucket is None:
                    buckets[size] = [address]
                    insort(sizes, size)
                else:
                    insort(bucket, address)
                cached_at[address], cached_ending[end] = size, address
        finally:
            self.allocated_bytes = allocated_units << UNIT_SHIFT
            self.peak_allocated_bytes = peak_allocated_units << UNIT_SHIFT

    def _new_segment(self, request: int, pool: int) -> tuple[int, int]:
        """A new segment for the request (`alloc_block`), both in units: its address and size."""
        size_bytes = segment_bytes(request << UNIT_SHIFT)
        if self.capacity_bytes is not None and self.reserved_bytes + size_bytes > self.capacity_bytes:
            self._release_whole_segments()
            if self.reserved_bytes + size_bytes > self.capacity_bytes:
                raise AllocatorOutOfMemory(
                    f"{size_bytes} bytes beside {self.reserved_bytes} reserved exceed {self.capacity_bytes}")
        size = size_bytes >> UNIT_SHIFT
        address = self._next_address.get(pool, pool << (POOL_SHIFT - UNIT_SHIFT))
        self._next_address[pool] = address + size + (SEGMENT_GAP_BYTES >> UNIT_SHIFT)
        self._segments[address] = size
        self.reserved_bytes += size_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return address, size

    def _release_whole_segments(self) -> None:
        """What a failed cudaMalloc makes torch do (`release_cached_blocks`): free every cached whole segment."""
        for address, size in [(address, size) for address, size in self._cached_at.items()
                              if self._segments.get(address) == size]:
            _uncache(*self._pools[address >> (POOL_SHIFT - UNIT_SHIFT)], address, size)
            del self._cached_at[address], self._cached_ending[address + size], self._segments[address]
            self.reserved_bytes -= size << UNIT_SHIFT


def _cache(sizes: list[int], buckets: dict[int, list[int]], address: int, size_bytes: int) -> None:
    """Put a block among its pool's cached ones (`CachingAllocator._pools`)."""
    bucket = buckets.get(size_bytes)
    if bucket is None:
        buckets[size_bytes] = [address]
        insort(sizes, size_bytes)
    else:
        insort(bucket, address)


def _uncache(sizes: list[int], buckets: dict[int, list[int]], address: int, size_bytes: int) -> None:
    """Take a block out of its pool's cached ones (`CachingAllocator._pools`)."""
    bucket = buckets[size_bytes]
    if len(bucket) == 1:
        del buckets[size_bytes], sizes[bisect_left(sizes, size_bytes)]
    else:
        del bucket[bisect_left(bucket, address)]


def _may_take(request_bytes: int, block_bytes: int, max_split_bytes: int) -> bool:
    """Whether a request may take the smallest cached block that holds it, with max_split_size set: a request under
    it never an oversize block, one at or above it a block at most 20 MiB larger."""
    if request_bytes < max_split_bytes:
        return block_bytes < max_split_bytes
    return block_bytes < request_bytes + LARGE_SEGMENT_BYTES


# Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), `ExpandableSegments`: a pool's segment is
# an address range of 9/8 of the GPU's memory (unbounded where the memory is not known) mapped page by page, its
# pages its pool's segment size (ExpandableSegment's segment_size: kSmallBuffer, kLargeBuffer)
UNBOUNDED_ADDRESS_SPACE_BYTES = 1 << 44


def page_bytes(pool: int) -> int:
    """What an expandable segment of `pool` maps at a time (`find_expandable_block`'s segment_size): 2 MiB pages
    for a small pool, 20 MiB for a large one."""
    return SMALL_SEGMENT_BYTES if pool & 1 else LARGE_SEGMENT_BYTES


@dataclass
class ExpandableSegments(CachingAllocator):
    """One device's caching allocator with expandable segments on, as torchtitan's one-host launcher runs it
    (run_llama_train.sh: PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"): `CachingAllocator`'s interface and
    blocks, its segments address spaces here, its max_split_size kept as `get_free_block` keeps it. The rules, from
    c10/cuda/CUDACachingAllocator.cpp as read at pytorch 001074d (its "Note [Expandable Segments]";
    `get_free_block`, `should_split`, `alloc_block`, `try_allocate_expandable_block`, `find_expandable_block`,
    `map_block`, `ExpandableSegment::map` and `unmap`, `release_blocks`, `unmap_block`; the torchtitan rows ran
    torch 1963fc8, which is not among the stored sources):

    - requests round and take their pool as without (`round_size`, `get_pool`); each pool and stream has one
      segment, an address range that grows: reserved bytes are its mapped pages, 2 MiB in a small pool, 20 MiB
      in a large one (`ExpandableSegment::map` rounds the range it maps up to whole pages);
    - a request takes the smallest free mapped block that holds it, but a block whose end meets the segment's
      unmapped pages counts as the size it could grow to (`get_free_block`'s `expandable_size`), so a block at the
      mapped end serves a request only where no other block holds it; the block is split whenever 512 bytes or
      more remain, in either pool (`should_split`), the request taking its front;
    - no block holding it: the lowest-addressed unmapped pages, with the free block just before them, that hold
      it (`find_expandable_block`; a new segment where none does) are mapped, only as many pages as the request
      lacks (`try_allocate_expandable_block`), and merged with the free block before them: the segment grows at
      its end rather than a new one being taken, so a freed tensor's pages serve a larger one after it;
    - a freed block merges with its free mapped neighbours; nothing is unmapped short of a mapping that fails
      (the GPU's memory full): then every free block's whole pages are unmapped, in every pool (`release_blocks`,
      `unmap_block`), and the request is tried once more."""

    # beside the blocks handed out and the free mapped ones (`CachingAllocator`'s cached blocks, which merge only
    # with each other), the unmapped pages: bytes by address, address by where they end, and per pool sorted
    _unmapped_at: dict[int, int] = field(default_factory=dict)
    _unmapped_ending: dict[int, int] = field(default_factory=dict)
    _unmapped: defaultdict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    unit_shift: ClassVar[int] = 0  # its addresses and sizes in bytes

    def run(self, ops: Iterable[Op], slots: list[int]) -> None:
        """Replay `ops` (`Program`), each block's address in `slots` at its op's slot."""
        for slot, request, pool in ops:
            if not request:
                address = slots[slot]
                size = self._allocated.pop(address)
                self.allocated_bytes -= size
                self._put_free(address, size)
                continue
            address, size = self._best_fit(request, pool) or self._grown(request, pool)
            if size - request >= MIN_BLOCK_BYTES:  # `should_split` under expandable segments
                self._cache_free(address + request, size - request)
                size = request
            self._allocated[address] = size
            self.allocated_bytes += size
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
            slots[slot] = address

    def _best_fit(self, request_bytes: int, pool: int) -> tuple[int, int] | None:
        """The free mapped block `get_free_block` takes for the request, taken out of the free ones; None where none
        holds it. From the smallest that holds it (the lowest address among equals), the next in that order is
        taken while the size it could grow to is smaller: only a block at the mapped end can grow, past any
        other's size, so the walk leaves it for the next block that is not one."""
        sizes, buckets = self._pools.setdefault(pool, ([], {}))
        at = bisect_left(sizes, request_bytes)
        if at == len(sizes):
            return None
        size, order = sizes[at], 1
        address = buckets[size][0]
        while address + size in self._unmapped_at:  # grows to size + the pages after it: is the next smaller?
            bucket = buckets[size]
            if order < len(bucket):
                following, order = (size, bucket[order]), order + 1
            elif at + 1 < len(sizes):
                at += 1
                following, order = (sizes[at], buckets[sizes[at]][0]), 1
            else:
                break
            if following[0] + self._unmapped_at.get(following[0] + following[1], 0) >= (
                    size + self._unmapped_at[address + size]):
                break
            size, address = following
        if self.max_split_bytes is not None and not _may_take(request_bytes, size, self.max_split_bytes):
            return None
        self._take_free(address, size)
        return address, size

    def _grown(self, request_bytes: int, pool: int) -> tuple[int, int]:
        """A block for the request from newly mapped pages (`alloc_block`), taken out of the free ones; where the
        GPU's memory cannot map them, every free block's whole pages unmapped and tried once more
        (`release_cached_blocks`), else AllocatorOutOfMemory."""
        grown = self._mapped_for(request_bytes, pool)
        if grown is None:
            self._unmap_free()
            grown = self._mapped_for(request_bytes, pool)
            if grown is None:
                raise AllocatorOutOfMemory(f"{request_bytes} bytes beside {self.reserved_bytes} reserved exceed "
                                           f"{self.capacity_bytes}")
        self._take_free(*grown)
        return grown

    def _mapped_for(self, request_bytes: int, pool: int) -> tuple[int, int] | None:
        """`try_allocate_expandable_block`: from the candidate `find_expandable_block` gives, its pages mapped
        (those the request lacks, each range rounded up to pages) until one free block holds the request; that
        block (free, mapped), or None where a mapping fails."""
        address = self._candidate(request_bytes, pool)
        if address in self._unmapped_at:
            mapped = self._map(address, min(self._unmapped_at[address], request_bytes), pool)
            if mapped is None:
                return None
            address, size = mapped
        else:
            size = self._cached_at[address]
        while size < request_bytes:  # a free block, then unmapped pages
            after = address + size
            mapped = self._map(after, min(request_bytes - size, self._unmapped_at[after]), pool)
            if mapped is None:
                return None
            address, size = mapped
        return address, size

    def _candidate(self, request_bytes: int, pool: int) -> int:
        """`find_expandable_block`: the lowest-addressed unmapped range of the pool (with the free block just before
        it, if any) whose run of free and unmapped blocks holds the request; else a new segment's start."""
        for unmapped in self._unmapped[pool]:
            start = self._cached_ending.get(unmapped, unmapped)
            room, at = 0, start
            while room < request_bytes:
                size = self._cached_at.get(at) or self._unmapped_at.get(at)
                if size is None:
                    break
                room, at = room + size, at + size
            if room >= request_bytes:
                return start
        page = page_bytes(pool)
        space = (UNBOUNDED_ADDRESS_SPACE_BYTES if self.capacity_bytes is None else
                 -(-(self.capacity_bytes + self.capacity_bytes // 8) // page) * page)
        start = -(-self._next_address.get(pool, pool << POOL_SHIFT) // page) * page
        self._next_address[pool] = start + space + SEGMENT_GAP_BYTES
        self._segments[start] = space
        self._put_unmapped(pool, start, space)
        return start

    def _map(self, address: int, nbytes: int, pool: int) -> tuple[int, int] | None:
        """`map_block`: the whole pages holding `nbytes` from the unmapped range at `address` mapped, merged with
        the free mapped blocks on either side; the merged free block, or None where the GPU's memory cannot hold
        the pages (`ExpandableSegment::map`: cuMemCreate out of memory maps none of them)."""
        page = page_bytes(pool)
        size = -(-nbytes // page) * page
        if self.capacity_bytes is not None and self.reserved_bytes + size > self.capacity_bytes:
            return None
        unmapped = self._unmapped_at[address]
        self._take_unmapped(pool, address, unmapped)
        if size < unmapped:
            self._put_unmapped(pool, address + size, unmapped - size)
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return self._put_free(address, size)

    def _unmap_free(self) -> None:
        """`release_blocks` over every pool: each free block's whole pages unmapped (`unmap_block`), what is left
        of it on either side kept free, the unmapped range merged with its unmapped neighbours, and a segment left
        wholly unmapped released."""
        for address, size in list(self._cached_at.items()):
            pool = address >> POOL_SHIFT
            page = page_bytes(pool)
            begin, end = -(-address // page) * page, (address + size) // page * page
            if begin >= end:
                continue
            self._take_free(address, size)
            for start, stop in ((address, begin), (end, address + size)):
                if stop > start:
                    self._cache_free(start, stop - start)
            self.reserved_bytes -= end - begin
            before = self._unmapped_ending.get(begin)
            if before is not None:
                self._take_unmapped(pool, before, begin - before)
                begin = before
            after = self._unmapped_at.get(end)
            if after is not None:
                self._take_unmapped(pool, end, after)
                end += after
            if self._segments.get(begin) == end - begin:  # `release_expandable_segment`
                del self._segments[begin]
            else:
                self._put_unmapped(pool, begin, end - begin)

    def _put_free(self, address: int, size: int) -> tuple[int, int]:
        """A mapped block made free, merged with the free mapped blocks either side (`try_merge_blocks`); the
        merged block."""
        before = self._cached_ending.get(address)
        if before is not None:
            merged = self._cached_at[before]
            self._take_free(before, merged)
            address, size = before, size + merged
        after = self._cached_at.get(address + size)
        if after is not None:
            self._take_free(address + size, after)
            size += after
        self._cache_free(address, size)
        return address, size

    def _cache_free(self, address: int, size: int) -> None:
        _cache(*self._pools.setdefault(address >> POOL_SHIFT, ([], {})), address, size)
        self._cached_at[address], self._cached_ending[address + size] = size, address

    def _take_free(self, address: int, size: int) -> None:
        _uncache(*self._pools[address >> POOL_SHIFT], address, size)
        del self._cached_at[address], self._cached_ending[address + size]

    def _put_unmapped(self, pool: int, address: int, size: int) -> None:
        insort(self._unmapped[pool], address)
        self._unmapped_at[address], self._unmapped_ending[address + size] = size, address

    def _take_unmapped(self, pool: int, address: int, size: int) -> None:
        unmapped = self._unmapped[pool]
        del unmapped[bisect_left(unmapped, address)]
        del self._unmapped_at[address], self._unmapped_ending[address + size]


@dataclass
class Program:
    """Allocations and frees written down for `CachingAllocator.run` rather than made: each request a new slot,
    its bytes rounded and its pool decided once, so that a pass replayed a thousand times is read once. A request
    is on the compute stream (0), where a pass's tensors are made, unless it names another (FSDP2's
    reduce-scatter and all-gather outputs: `REDUCE_SCATTER_STREAM`, `ALL_GATHER_STREAM`)."""

    ops: list[Op] = field(default_factory=list)
    slots: int = 0

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        slot, request_bytes = self.slots, round_request(nbytes)
        self.ops.append((slot, request_bytes, pool_of(request_bytes, stream)))
        self.slots += 1
        return slot

    def free(self, slot: int) -> None:
        self.ops.append((slot, 0, 0))

    def replay(self, allocations: Iterable[tuple[int, int]], held: Set[int] = frozenset(),
               only: Set[int] | None = None) -> dict[int, int]:
        """Allocate and free as a pass did (its storages' numbers and bytes, negative where freed, as
        `LayerCount.allocations` without the shapes), but never free those `held`, and with `only`, make those
        alone; the slots of the storages it left live, by number. An empty storage takes nothing (torch's
        allocator hands out no block for 0 bytes), and its free reads as 0 bytes too: both are passed over."""
        live: dict[int, int] = {}
        for number, nbytes in allocations:
            if nbytes == 0 or only is not None and number not in only:
                continue
            if nbytes > 0:
                live[number] = self.malloc(nbytes)
            elif number not in held:
                self.free(live.pop(number))
        return live


# A layer's pass on one rank: its storages' numbers and bytes in order, negative where freed (`Program.replay`)
PassAllocations = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class LayerAllocations:
    """One layer's passes on one rank by pass of `PASSES`; `saved`: the forward's storages autograd saves (the rest
    it leaves live is its output). Under a recomputation, `rerun`: the forward's storages its backward makes
    again first (torch's checkpoint: all but what its policy keeps; Megatron-LM's selective: the attention
    core's), holding what of them autograd saves until the layer's backward is done; the forward drops those as
    it ends. `kept`: what a policy holds for the backward even where the forward freed it (torchtitan's op
    policy keeps every second product's output). None: no recomputation. `unsharded`: per parameter, its whole
    weights as FSDP2 gathers them, its whole gradient as FSDP2 accumulates it and that gradient's shard, which
    FSDP2 under a pipeline makes as the layer's first forward of a step begins, as its first backward ends and
    after its last, freeing the first two there (torch's pipelining, stage.py `backward_maybe_with_nosync`: no
    resharding nor reduce-scatter before the last; FSDP2's `to_accumulated_grad_if_needed`, `foreach_reduce`: a
    reduce-scatter input of the layer's gradients beside them, its output one tensor on the reduce-scatter
    stream, held until the next step's zero_grad); (): held as the state's blocks from the step's start. Without a
    pipeline FSDP2 gathers, reshards and reduce-scatters block by block in each pass (`stage_program`); `fsdp_root`:
    the layer's parameters are the model's root's (torchtitan's parallelize_llama at 9dec370 runs `fully_shard` on
    each transformer block, then on the model: its embedding, final norm and head), one group gathered before the
    forward and reduce-scattered after the backward, the rest a block each. `first_forward`: the forward as a
    compiled block runs it inside its checkpoint, freeing what its backward reruns once nothing later reads it
    (planning/estimate.py `_compiled_checkpoint_forward`), where the rerun makes and holds them as passes["fwd"]
    does; None: passes["fwd"]. `stepped`: under Megatron-LM's 16-bit optimizer with its float32 master weights, per
    parameter on a rank, the float32 main gradient each step makes (0: the gradients are float32 already) and one
    Adam moment's bytes (MAIN_GRADS; the moments made at the first step, ADAM_STATE); () under any other.
    Under a split backward, what the input pass keeps for the weight pass as Megatron-LM's zero-bubble fork keeps
    it (planning/estimate.py `wgrad_kept`): each weighted product's saved input and its output gradient, which its
    B puts in `WeightGradStore` (megatron/core/tensor_parallel/layers.py,
    `LinearWithGradAccumulationAndAsyncCommunication.backward`, sail-sg/zero-bubble-pipeline-parallelism at
    425b42e5) while autograd frees the rest of the layer's saved tensors as the backward walks past them:
    `wgrad_kept`, the storages of passes["fwd"] it holds where the forward made them (the inputs), the rest of the
    layer's freed as the input pass ends, then made, the bytes of each: `wgrad_inputs`, the inputs the layer's
    forward did not make, and `wgrad_gradients`, the output gradients; all freed as the weight pass ends. None:
    the input pass keeps the layer's whole forward until the weight pass, as torch's pipelining does
    (`stage_backward_input` runs autograd.grad with retain_graph=True, and the graph holds every saved tensor
    until `stage_backward_weight` walks it: torch/distributed/pipelining/_backward.py at torch 2.13), with the
    gradients arriving where the weights' gradients branch off, `wgrad_gradients`; or where the count does not say
    which inputs the products save (then no `wgrad_gradients` either)."""

    passes: Mapping[str, PassAllocations]
    saved: frozenset[int] = frozenset()
    rerun: frozenset[int] | None = None
    kept: frozenset[int] = frozenset()
    unsharded: tuple[tuple[int, int, int], ...] = ()
    fsdp_root: bool = False
    first_forward: PassAllocations | None = None
    stepped: tuple[tuple[int, int], ...] = ()
    wgrad_kept: frozenset[int] | None = None
    wgrad_inputs: tuple[int, ...] = ()
    wgrad_gradients: tuple[int, ...] = ()


def device_rows(trace: Trace, device: int) -> list[tuple[str, int, tuple[int, int, int]]]:
    """A device's forward and backward rows in the order they start, as `replay_device` takes them: (pass of
    `PASSES`, stage, the micro-batch as (pipeline, mini-batch, micro-batch), so that each forward's tensors meet
    their own backward whatever the method runs between them)."""
    ops = trace.ops
    passes = {trace.kinds.index(kind.value): name for name, kind in TRANSIENT_KINDS.items()
              if kind.value in trace.kinds}
    mine = np.flatnonzero((ops.device == device) & np.isin(ops.kind, list(passes)))
    return [(passes[int(ops.kind[row])], int(ops.stage[row]),
             (int(ops.pipeline[row]), int(ops.minibatch[row]), int(ops.microbatch[row])))
            for row in mine[np.argsort(ops.start_us[mine], kind="stable")]]


# How many steps past the trace's `steady_rows` replays at most: the cache grows where a step takes a segment the
# one before did not, which the steps seen so far (Llama 3.1 8B's zb-h1 at t = 2 grew at its third) did by the third.
STEADY_STEPS = 4


def steady_rows(rows: Sequence[tuple[str, int, tuple[int, int, int]]], steps: int = STEADY_STEPS
                ) -> list[tuple[str, int, tuple[int, int, int]]]:
    """`device_rows`' rows, then the last mini-batch's `steps` times more, numbered as the mini-batches after it,
    where the device runs its mini-batches one after another, each alike (a flushing order): torch's max reserved
    is read after many steps, the cache each step leaves carried into the next, and a step can take a segment the
    one before did not (Llama 3.1 8B's zb-h1 p = 2 at t = 2: 1.6 GiB more from its third step, so simulate's
    default two steps read less than tune's three). The replay skips the further steps once one brings back what
    the step before left (`_Replay.skip`), so a cache already steady costs nothing more. An order whose mini-batches
    interleave on the device (the asynchronous methods') repeats within the trace and is left as it is."""
    minibatches = [minibatch for _, _, (_, minibatch, _) in rows]
    if not rows or any(later < earlier for earlier, later in zip(minibatches, minibatches[1:])):
        return list(rows)
    def runs(minibatch: int) -> list[tuple[str, int, tuple[int, int]]]:  # its rows, the mini-batch left out
        return [(name, stage, (pipeline, micro)) for name, stage, (pipeline, of, micro) in rows if of == minibatch]

    last = minibatches[-1]
    tail = runs(last)
    if last > minibatches[0] and runs(last - 1) != tail:  # each alike: the mini-batch before runs the same rows
        return list(rows)
    return [*rows, *((name, stage, (pipeline, last + step, micro))
                     for step in range(1, steps + 1) for name, stage, (pipeline, micro) in tail)]


def replay_device(static_bytes: Sequence[int], rows: Sequence[tuple[str, int, Hashable]],
                  programs: Mapping[int, StageProgram], capacity_bytes: int | None = None,
                  expandable: bool = False, adam_at_first_step: bool = False,
                  merged_bytes: int = 0) -> CachingAllocator | ExpandableSegments:
    """One device's step through the caching allocator: its state (`static_bytes`, a block each: weights,
    gradients, optimizer state) allocated first and held, then its `rows` in the order they run, each (pass of
    `PASSES`, stage, micro-batch) with `programs[stage]` the stage's layers written down (`stage_program`). A
    forward runs its layers in order, each keeping what it leaves live but what its backward reruns
    (`LayerAllocations`) until its full or weight backward; a backward runs them reversed, each rerunning first
    what its forward did not keep, and freeing what its own pass leaves live (the gradients, which the runtime
    accumulates into the state's or hands to the layer before) once the layer is done. The allocator as it ends:
    its peak reserved and allocated bytes (an AllocatorOutOfMemory where the step does not fit in
    `capacity_bytes` even with the cache released).

    A pipeline's steady state repeats its rows, thousands of them at p = 64 and m = 512, more than a simulation
    may spend replaying: once a run of rows has brought back what the step had after an earlier row (the same
    micro-batches' layers held, counted back from the last begun, the same bytes allocated and reserved, no new
    peak) and the rows go on repeating that run, each further repetition is taken to do the same and skipped
    (`_Replay.skip`). The one reading not from torch's rules: the blocks may have traded places meanwhile (best
    fit takes the lowest address among equal sizes), and a later repetition can then split a block the first
    did not and take a segment more (docs/benchmarks.md: the zero-bubble 1.5B's 1F1B middle stages reserve 322
    MiB where every row replayed reserves 610). `expandable`: with expandable segments (`ExpandableSegments`).
    `adam_at_first_step`: FSDP2's rows (ZERO) over two mini-batches or more (`steady_rows`), the optimizer state not
    among `static_bytes`: the first mini-batch's rows run before the optimizer made its moments (its FSDP2 shards and
    last all-gather output as any step before leaves them, LEFT), and each later one after the optimizer's step
    (ADAM_STATE the first time, ADAM_STEP each time). `merged_bytes`: what the runtime concatenates after each row
    named MERGE (`device_reserves`)."""
    replay = _Replay((ExpandableSegments if expandable else CachingAllocator)(capacity_bytes=capacity_bytes), rows,
                     programs, adam_at_first_step=adam_at_first_step, merged_bytes=merged_bytes)
    for nbytes in static_bytes:
        replay.allocator.malloc(nbytes)
    if any(ZERO in name for name, _, _ in rows):  # FSDP2's tensors as the step before left them
        each = EACH if any(EACH in name for name, _, _ in rows) else ""
        for stage in programs:
            replay.step_pass(stage, LEFT + each)
    seen: dict[tuple, list[int]] = {}  # a state after a row: the rows after which it was, the last first
    at = 0
    while at < len(rows):
        replay.run(at)
        earlier = seen.setdefault(replay.state(at), [])
        for before in earlier:  # a state can come back within a repetition (after an input and a weight pass)
            skipped = replay.skip(before, at)
            if skipped > at:
                at = skipped
                break
        earlier.insert(0, at)
        at += 1
    return replay.allocator


@dataclass(frozen=True, eq=False)
class StageProgram:
    """A stage's rows written down once (`stage_program`): per pass of `PASSES`, what its layers allocate and free
    in the order they run, as `CachingAllocator.run` replays it, on one list of `slots` addresses a micro-batch
    (a frame) that its forward begins and its full or weight backward ends; `layers`: how many the stage has.
    Equal as the same object: `stage_program` gives the same one for layers of the same content while it keeps
    it, which is what `device_reserves` reads. With FSDP2's whole tensors (`LayerAllocations.unsharded`), the
    passes a step's first forward and first full or weight backward run make them (FIRST), RELEASE frees them
    after its last, and `carried`, the slots that hold them, pass from row to row of the stage."""

    layers: int
    slots: int
    passes: Mapping[str, tuple[Op, ...]]
    carried: tuple[int, ...] = ()


def stage_program(layers: Sequence[LayerAllocations], part: int = 0,
                  runs: Mapping[str, str | None] | None = None) -> StageProgram:
    """`layers`' rows written down (`StageProgram`), once a process for layers of the same content
    (`_written_stage`): a pipeline's stages repeat their layers, and a search replays the same stages again.
    `part`: the stage's place among its device's, each a model part FSDP2 shards as a root of its own, with its
    own all-gather and reduce-scatter streams (`FSDPCommContext.lazy_init`). `runs`: per backward pass of the
    stage, the layers' pass it runs where another (None: none; profiles/schema.py `stage_passes`: a stage fed by
    the batch alone runs no input gradient in its I and the whole backward in its W); none: its own."""
    return _written_stage(tuple((tuple((name, tuple(events)) for name, events in layer.passes.items()), layer.saved,
                                 layer.rerun, layer.kept, layer.unsharded, layer.fsdp_root,
                                 None if layer.first_forward is None else tuple(layer.first_forward), layer.stepped,
                                 layer.wgrad_kept, layer.wgrad_inputs, layer.wgrad_gradients) for layer in layers),
                          part, tuple(sorted((runs or {}).items())))


@functools.lru_cache(maxsize=64)
def _written_stage(layers: tuple[tuple, ...], part: int = 0, runs: tuple[tuple[str, str | None], ...] = ()
                   ) -> StageProgram:
    """`stage_program`'s layers, each as its content (passes' items, saved, rerun, kept, unsharded, fsdp_root,
    first_forward, stepped, wgrad_kept, wgrad_inputs, wgrad_gradients), written down: a forward runs them in order,
    each holding what it leaves live but what its backward reruns until its full or weight backward; a backward runs
    them reversed, each rerunning first what its forward did not keep, then freeing what its own pass leaves live
    and what the layer held, but for the input pass, which holds what the layer held for the weight pass after it,
    or, with `wgrad_kept`, those of it and makes `wgrad_inputs`, and makes `wgrad_gradients` (an input pass that
    runs none, a stage fed by the batch alone's: the frame whole, nothing made); a pass of `runs` runs the layers'
    pass it names there (a full backward its rerun first). FSDP2's whole tensors (`StageProgram`): a
    step's first forward gathers each layer's weights as the layer begins (`unshard`, `wait_for_unshard`: the
    all-gather's flat output made on its stream, the previous layer's freed, the weights copied out of it), its
    first full or weight backward makes each layer's gradients once the layer's pass has made its own; RELEASE, in
    the model's order as FSDP2's post_backward runs each layer (`reshard`, `foreach_reduce`): its weights freed, the
    previous layer's reduce-scatter input freed, its own made (its gradients' bytes), its gradients freed, its shard
    made on the reduce-scatter stream; ZERO_GRAD frees the shards; LEFT makes the shards and the last layer's
    all-gather output, as the step before left them. Under Megatron-LM's 16-bit optimizer (`stepped`), MAIN_GRADS
    makes the float32 main gradients, ZERO_MAIN_GRADS frees them, and ADAM_STATE makes the moments, two a parameter
    in the model's order, as Apex's FusedAdam makes its state at its first step."""
    stage = [LayerAllocations(dict(passes), *content) for passes, *content in layers]
    program = Program()
    # each layer's whole weights', gradients', shard's and all-gather output's slots, and the ops that make them
    gathered, accumulated, sharded, flat = [], [], [], []
    gathers, accumulates, shards, flats = [], [], [], []
    for layer in stage:
        parts = list(zip(*layer.unsharded, strict=True)) or [(), (), ()]
        for slots, ops, made, stream in (
                (gathered, gathers, parts[0], 0), (accumulated, accumulates, parts[1], 0),
                (sharded, shards, [sum(parts[2])] if layer.unsharded else [], REDUCE_SCATTER_STREAM + 2 * part),
                (flat, flats, [sum(parts[0])] if layer.unsharded else [], ALL_GATHER_STREAM + 2 * part)):
            begins = len(program.ops)
            slots.append([program.malloc(nbytes, stream) for nbytes in made])
            ops.append(tuple(program.ops[begins:]))
    del program.ops[:]
    unsharded = [index for index, layer in enumerate(stage) if layer.unsharded]
    before = {index: flat[unsharded[at - 1]][0] for at, index in enumerate(unsharded)}  # the last's: the step's
    layers_pass = dict(runs)

    def written(name: str, held: dict[int, dict[int, int]]) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
        """The pass, and the pass as a step's first runs it (FSDP2's whole tensors made at each layer)."""
        ops: list[Op] = []
        first: list[Op] = []
        for index in range(len(stage)) if name == "fwd" else reversed(range(len(stage))):
            layer = stage[index]
            begins = len(program.ops)
            if name == "fwd":
                held[index] = _forward(program, layer)
                ops += program.ops[begins:]
                forward = program.ops[begins:]
                if index in before:  # the previous output freed once this one is made (one slot: before it)
                    program.free(before[index])
                    freed = program.ops.pop()
                    made = [*flats[index], freed] if before[index] != flat[index][0] else [freed, *flats[index]]
                    first += [*made, *gathers[index]]
                first += forward
                continue
            run = layers_pass.get(name, name)
            if run in ("bwd", "igrad") and layer.rerun is not None:
                held[index] = held[index] | _recomputed(program, layer)
            done = program.replay(layer.passes.get(run, ()))
            computed = program.ops[begins:]
            freed = len(program.ops)
            frame = held.pop(index)
            kept = {} if name != "igrad" else frame if layer.wgrad_kept is None or run is None else {
                number: slot for number, slot in frame.items() if number in layer.wgrad_kept}
            for slot in [*done.values(), *(slot for number, slot in frame.items() if number not in kept)]:
                program.free(slot)
            if name == "igrad":  # what the weight pass reads (an I that runs none: all the frame, as it was)
                made = [] if run is None else [*(layer.wgrad_inputs if layer.wgrad_kept is not None else ()),
                                               *layer.wgrad_gradients]
                held[index] = kept | {-1 - at: program.malloc(nbytes) for at, nbytes in enumerate(made)}
            ops += program.ops[begins:]
            first += [*computed, *(accumulates[index] if name != "igrad" else ()), *program.ops[freed:]]
        return tuple(ops), tuple(first)

    held: dict[int, dict[int, int]] = {}
    passes = {}
    for name in ("fwd", "bwd", "igrad", "wgrad"):  # the full backward on a copy: the split one frees them too
        passes[name], first = written(name, dict(held) if name == "bwd" else held)
        if name != "igrad":  # an input pass makes no weight gradients
            passes[name + FIRST] = first
    reduced, releases = None, len(program.ops)
    for index, layer in enumerate(stage):
        if not layer.unsharded:
            continue
        for slot in [*gathered[index], *([reduced] if reduced is not None else ())]:
            program.free(slot)
        reduced = program.malloc(sum(gradient for _, gradient, _ in layer.unsharded))
        for slot in accumulated[index]:
            program.free(slot)
        program.ops += shards[index]
    if reduced is not None:
        program.free(reduced)
    passes[RELEASE] = tuple(program.ops[releases:])
    passes[LEFT] = (*(op for ops in shards for op in ops), *(flats[unsharded[-1]] if unsharded else ()))
    zeroed = len(program.ops)
    for slots in sharded:
        for slot in slots:
            program.free(slot)
    passes[ZERO_GRAD] = tuple(program.ops[zeroed:])
    stepped_bytes = [each for layer in stage for each in layer.stepped]
    made = len(program.ops)
    main_grads = [program.malloc(nbytes) for nbytes, _ in stepped_bytes if nbytes]
    passes[MAIN_GRADS] = tuple(program.ops[made:])
    zeroed = len(program.ops)
    for slot in main_grads:
        program.free(slot)
    passes[ZERO_MAIN_GRADS] = tuple(program.ops[zeroed:])
    shard_bytes = [shard for layer in stage for _, _, shard in layer.unsharded]
    made = len(program.ops)
    moments = [program.malloc(nbytes) for nbytes in [*shard_bytes, *(moment for _, moment in stepped_bytes)]
               for _ in ("exp_avg", "exp_avg_sq")]
    passes[ADAM_STATE] = tuple(program.ops[made:])
    stepped = len(program.ops)
    for slot in [program.malloc(nbytes) for nbytes in shard_bytes]:
        program.free(slot)
    passes[ADAM_STEP] = tuple(program.ops[stepped:])
    root = _unpipelined(program, stage, passes, part, (gathered, gathers), (flat, flats), (sharded, shards))
    carried = tuple(slot for slots in (*gathered, *accumulated, *sharded, *flat, root, moments, main_grads)
                    for slot in slots)
    return StageProgram(len(stage), program.slots, passes, carried)


@dataclass
class _Group:
    """An FSDP2 parameter group as `_unpipelined` writes it: its layers, its all-gather output's slot and the op
    making it, its reduce-scatter output's (the gradients' shard) slot, op and bytes, and its reduce-scatter
    input's bytes."""

    layers: list[int]
    flat: int
    gather: tuple[Op, ...]
    shard: int
    reduce: tuple[Op, ...]
    shard_bytes: int
    reduced_bytes: int


def _unpipelined(program: Program, stage: Sequence[LayerAllocations], passes: dict[str, tuple[Op, ...]], part: int,
                 gathered: tuple[list[list[int]], list[tuple[Op, ...]]], flat: tuple[list[list[int]], list[tuple]],
                 sharded: tuple[list[list[int]], list[tuple]]) -> list[int]:
    """FSDP2's passes without a pipeline written into `passes` (EACH; torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py and _fsdp_collectives.py as of torch 2.5-2.6, the page's): the root group (the
    `fsdp_root` layers) is gathered before the forward and not resharded after it (`FSDPState._lazy_init`), each
    block as its forward begins (`pre_forward`: `unshard` makes the all-gather output on the all-gather stream,
    `wait_for_unshard` frees the previous forward's, kept as `all_gather_state`, then copies the weights out)
    and resharded after it (`post_forward`) but the last (torchtitan: `reshard_after_forward=False` for it). A
    backward gathers each resharded block again as its backward begins (`pre_backward`: the output freed once
    copied out, the block before's then gathered ahead, `_backward_prefetch`) and after it (`post_backward`)
    frees its weights, the previous reduce-scatter input, makes its own (float32, `foreach_reduce`), frees the
    gradients and makes their shard on the reduce-scatter stream, held to zero_grad, or, on a later backward of
    the mini-batch, added to the held one and freed; the root's gradients wait for the backward's end
    (`_root_post_backward_final_callback`), which frees the last reduce-scatter input. AGAIN: a forward after a
    forward (`_unpipelined_forward`), a backward after a backward (`_unpipelined_backward`). LEFT + EACH makes the
    shards and the last block's all-gather output as the step before left them (where that step's last forward came
    after another, its last output was the block's before, as large in a model of like blocks); ZERO_GRAD + EACH
    frees the shards. The root group's two slots, which the stage's rows carry."""
    blocks = [index for index, layer in enumerate(stage) if layer.unsharded and not layer.fsdp_root]
    roots = [index for index, layer in enumerate(stage) if layer.unsharded and layer.fsdp_root]
    def summed(indices: list[int], which: int) -> int:
        return sum(each[which] for index in indices for each in stage[index].unsharded)

    groups = [_Group([index], flat[0][index][0], flat[1][index], sharded[0][index][0], sharded[1][index],
                     summed([index], 2), summed([index], 1)) for index in blocks]
    if roots:
        begins = len(program.ops)
        made = [program.malloc(summed(roots, 0), ALL_GATHER_STREAM + 2 * part),
                program.malloc(summed(roots, 2), REDUCE_SCATTER_STREAM + 2 * part)]
        gather, reduce = program.ops[begins:begins + 1], program.ops[begins + 1:]
        del program.ops[begins:]
        groups.insert(0, _Group(roots, made[0], tuple(gather), made[1], tuple(reduce), summed(roots, 2),
                                summed(roots, 1)))
    if not groups:
        return []
    kept = groups[-1]  # left whole by a forward; its all-gather output held to the next forward (`all_gather_state`)
    begins = len(program.ops)
    held: dict[int, dict[int, int]] = {}
    forwards = []  # each layer's forward, then its block's weights freed where resharded (`post_forward`)
    for index, layer in enumerate(stage):
        start = len(program.ops)
        held[index] = _forward(program, layer)
        if layer.unsharded and not layer.fsdp_root and index not in kept.layers:
            for slot in gathered[0][index]:
                program.free(slot)
        forwards.append(program.ops[start:])
    for again in (False, True):
        passes["fwd" + EACH + (AGAIN if again else "")] = _unpipelined_forward(
            program, stage, groups, forwards, gathered[1], again)
    program.malloc(summed(kept.layers, 0), ALL_GATHER_STREAM + 2 * part)
    regathered = program.ops.pop()  # a backward's all-gather output of the kept group, beside the one held
    for first, again in ((True, False), (False, False), (False, True)):  # a mini-batch's first follows a forward
        passes["bwd" + EACH + (AGAIN if again else "") + (FIRST if first else "")] = _unpipelined_backward(
            program, stage, dict(held), groups, gathered, first, REDUCE_SCATTER_STREAM + 2 * part,
            regathered if again else None)
    del program.ops[begins:]
    passes[LEFT + EACH] = (*(op for group in groups for op in group.reduce), *kept.gather)
    zeroed = len(program.ops)
    for group in groups:
        program.free(group.shard)
    passes[ZERO_GRAD + EACH] = tuple(program.ops[zeroed:])
    return [groups[0].flat, groups[0].shard] if roots else []


def _unpipelined_forward(program: Program, stage: Sequence[LayerAllocations], groups: list[_Group],
                         forwards: list[list[Op]], copies: list[tuple[Op, ...]], again: bool) -> tuple[Op, ...]:
    """`_unpipelined`'s forward of `forwards` (each layer's), FSDP2's groups gathered as they begin, the root's
    before the first layer (`pre_forward`: `unshard`, then `wait_for_unshard` frees the output held since the
    forward before, `all_gather_state`, and copies the weights out); `again`, after a forward with no backward
    between (GPipe's order), the root and the last block still whole (`unshard` is a no-op for them). The
    forward's last all-gather output is made in the last group's slot, where the next forward and LEFT find it."""
    kept = groups[-1]
    gathering = [group for group in groups if not again or group is not kept and not stage[group.layers[0]].fsdp_root]
    ops: list[Op] = []
    previous = kept.flat
    for index, forward in enumerate(forwards):
        for group in gathering:
            if index != (0 if stage[group.layers[0]].fsdp_root else group.layers[0]):
                continue
            (slot, request, pool), = group.gather
            into = kept.flat if group is gathering[-1] else slot
            program.free(previous)
            freed = program.ops.pop()
            made = (into, request, pool)
            # the output made before the previous one is freed, but in one slot (a forward of one gather)
            ops += [freed, made] if into == previous else [made, freed]
            ops += [op for layer in group.layers for op in copies[layer]]
            previous = into
        ops += forward
    return tuple(ops)


def _unpipelined_backward(program: Program, stage: Sequence[LayerAllocations], held: dict[int, dict[int, int]],
                          groups: list[_Group], gathered: tuple[list[list[int]], list[tuple[Op, ...]]],
                          first: bool, stream: int, regathered: Op | None) -> tuple[Op, ...]:
    """`_unpipelined`'s backward: `first`, the mini-batch's first, whose shards are held to zero_grad; `stream`:
    the reduce-scatter stream; `regathered`, where a backward came after it with no forward between (GPipe's
    order), the op making the last group's all-gather output again, the root and the last block resharded by that
    backward: the root's `pre_backward` gathers it and prefetches the last block before the head's backward, or
    without a root the last block's own gathers it; None: a forward left them whole."""
    begins = len(program.ops)
    kept = groups[-1]
    blocks = [group for group in groups if not stage[group.layers[0]].fsdp_root]
    rooted = len(blocks) < len(groups)
    at = {group.layers[0]: place for place, group in enumerate(blocks)}
    reduced: list[int] = []  # the reduce-scatter input FSDP2 keeps until the next group's (`reduce_scatter_state`)
    root_gradients: list[int] = []

    def gather(group: _Group) -> tuple[Op, ...]:
        """The op making the group's all-gather output."""
        return group.gather if regathered is None or group is not kept else (regathered,)

    def copy_out(group: _Group) -> None:
        """`wait_for_unshard` in a backward: the weights copied out, the all-gather output (its op's slot) freed at
        once."""
        program.ops += [op for index in group.layers for op in gathered[1][index]]
        program.free(gather(group)[0][0])

    def post_backward(group: _Group, gradients: Iterable[int]) -> None:
        for slot in [*(slot for index in group.layers for slot in gathered[0][index]), *reduced]:
            program.free(slot)
        reduced[:] = [program.malloc(group.reduced_bytes)]
        for slot in gradients:
            program.free(slot)
        if first:
            program.ops += group.reduce
        else:  # added to the shard held since the mini-batch's first backward, then freed
            program.free(program.malloc(group.shard_bytes, stream))

    if regathered is not None and rooted:
        program.ops += gather(groups[0])
        copy_out(groups[0])
        if blocks:
            program.ops += gather(kept)
    for index in reversed(range(len(stage))):
        layer = stage[index]
        place = at.get(index)
        if place is not None:  # pre_backward: the prefetched output copied out and freed, the block before's made
            if blocks[place] is not kept or regathered is not None:
                if blocks[place] is kept and not rooted:
                    program.ops += gather(kept)
                copy_out(blocks[place])
            if place:
                program.ops += blocks[place - 1].gather
        if layer.rerun is not None:
            held[index] = held[index] | _recomputed(program, layer)
        done = program.replay(layer.passes.get("bwd", ()))
        for slot in held.pop(index).values():
            program.free(slot)
        if place is not None:
            post_backward(blocks[place], done.values())
            continue
        gradients = _gradient_numbers(layer) if layer.fsdp_root and layer.unsharded else frozenset()
        root_gradients += [slot for number, slot in done.items() if number in gradients]
        for number, slot in done.items():
            if number not in gradients:
                program.free(slot)
    if rooted:
        post_backward(groups[0], root_gradients)
    for slot in reduced:  # the final callback's: the last reduce-scatter input
        program.free(slot)
    return tuple(program.ops[begins:])


def _gradient_numbers(layer: LayerAllocations) -> frozenset[int]:
    """The storages a layer's backward leaves live that are its parameters' gradients: matched by bytes to those
    its weight-gradient pass leaves live (each pass numbers its storages apart); all of them where it has none."""
    backward = left_live(layer.passes.get("bwd", ()))
    if "wgrad" not in layer.passes:
        return frozenset(backward)
    by_bytes: defaultdict[int, list[int]] = defaultdict(list)
    for number, nbytes in backward.items():
        by_bytes[nbytes].append(number)
    return frozenset(by_bytes[nbytes].pop(0) for nbytes in left_live(layer.passes["wgrad"]).values()
                     if by_bytes[nbytes])


def left_live(allocations: PassAllocations) -> dict[int, int]:
    """The bytes of the storages a pass leaves live, by number."""
    live: dict[int, int] = {}
    for number, nbytes in allocations:
        if nbytes > 0:
            live[number] = nbytes
        elif nbytes < 0:
            live.pop(number, None)
    return live


def _numbered(rows: Sequence[tuple[str, int, Hashable]]
              ) -> tuple[list[int], list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """`rows`' micro-batches numbered in the order the rows begin them: how many are begun by each row, the rows
    with their micro-batches' numbers, and what each row does (its shape: its micro-batch named by its place among
    those begun before it), which `_Replay.skip` compares."""
    number: dict[Hashable, int] = {}
    begun: list[int] = []
    for _, _, microbatch in rows:
        number.setdefault(microbatch, len(number))
        begun.append(len(number))
    numbered = [(name, stage, number[microbatch]) for name, stage, microbatch in rows]
    shapes = [(name, stage, microbatch - (begun[at - 1] if at else 0))
              for at, (name, stage, microbatch) in enumerate(numbered)]
    return begun, numbered, shapes


def replayed_rows(rows: Sequence[tuple[str, int, Hashable]]) -> int:
    """About how many of a device's `rows` (`device_rows`) `replay_device` runs, without running them: all but the
    whole repetitions its skip passes over (`_Replay.skip`), taking the state to come back after the first run of
    one micro-batch's rows (their number over the micro-batches begun) wherever the rows repeat that run. A
    pipeline's steady state is what it skips: p = 8 and m = 64 leave some 1 in 5 rows to run, m = p every row."""
    if not rows:
        return 0
    _, _, shapes = _numbered(rows)
    period = max(len(rows) // len({microbatch for _, _, microbatch in rows}), 1)
    skipped = repeated = 0
    for at in range(period, len(rows) + 1):
        if at < len(rows) and shapes[at] == shapes[at - period]:
            repeated += 1
            continue
        skipped += max(repeated - period, 0) // period * period  # the first period run, then whole ones skipped
        repeated = 0
    return len(rows) - skipped


@dataclass
class _Replay:
    """`replay_device`'s step in progress: the allocator, each stage's program, and each micro-batch's frame of
    addresses by (stage, micro-batch), held from its forward to its full or weight backward, and per stage the
    micro-batches it holds as bits (`held`, which `state` reads); micro-batches numbered in the order the rows begin
    them (`begun[row]`: how many by then)."""

    allocator: CachingAllocator | ExpandableSegments
    rows: Sequence[tuple[str, int, Hashable]]
    programs: Mapping[int, StageProgram]
    frames: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)  # per stage, bit m set while micro-batch m's frame is held
    carried: dict[int, dict[int, int]] = field(default_factory=dict)  # per stage, FSDP2's whole tensors by slot
    adam_at_first_step: bool = False  # `replay_device`'s
    merged_bytes: int = 0  # `replay_device`'s
    zeros: int = 0  # the mini-batches begun (ZERO rows run)

    def __post_init__(self) -> None:
        self.begun, self.numbered, self.shapes = _numbered(self.rows)

    def run(self, at: int) -> None:
        """Row `at`: its pass (with ZERO, every stage's ZERO_GRAD before it, after the optimizer's step where
        `adam_at_first_step` and a mini-batch ran before; with FIRST, as a step's first runs it;
        with LAST, RELEASE after it; with EACH, as FSDP2 runs it without a pipeline; with MERGE, the merged outputs
        made and freed last), FSDP2's whole tensors' addresses carried from the stage's earlier rows and kept for
        its later ones."""
        name, stage, microbatch = self.numbered[at]
        program = self.programs[stage]
        each = EACH + (AGAIN if AGAIN in name else "") if EACH in name else ""
        if ZERO in name:
            stepped = self.adam_at_first_step and self.zeros  # the optimizer's step ended the mini-batch before
            if stepped:
                for other in self.programs:  # Megatron-LM's: every main gradient made before Adam steps
                    self.step_pass(other, MAIN_GRADS)
                for other in self.programs:  # torchtitan's optimizers, a model part's each, in turn
                    for step in (ADAM_STATE, ADAM_STEP) if self.zeros == 1 else (ADAM_STEP,):
                        self.step_pass(other, step)
            for other in self.programs:
                self.step_pass(other, ZERO_GRAD + each)
                if stepped:
                    self.step_pass(other, ZERO_MAIN_GRADS)
            self.zeros += 1
        if not program.layers:
            return
        base = name.split(":")[0]
        if base == "fwd":
            frame = self.frames[stage, microbatch] = [0] * program.slots
            self.held[stage] = self.held.get(stage, 0) | 1 << microbatch
        elif base == "igrad":
            frame = self.frames[stage, microbatch]
        else:
            frame = self.frames.pop((stage, microbatch))
            self.held[stage] &= ~(1 << microbatch)
        self._carrying(stage, frame, program.passes[base + each + (FIRST if FIRST in name else "")],
                       *([program.passes[RELEASE]] if LAST in name else []))
        if MERGE in name:
            self.allocator.free(self.allocator.malloc(self.merged_bytes))

    def step_pass(self, stage: int, name: str) -> None:
        """A stage's pass of no micro-batch (LEFT, ZERO_GRAD) on the addresses its rows carry."""
        program = self.programs[stage]
        self._carrying(stage, [0] * program.slots, program.passes.get(name, ()))

    def _carrying(self, stage: int, frame: list[int], *passes: tuple[Op, ...]) -> None:
        """`passes` run on `frame` with the stage's carried slots as its earlier rows left them, kept after."""
        slots, carried = self.programs[stage].carried, self.carried.setdefault(stage, {})
        for slot in slots:
            frame[slot] = carried.get(slot, 0)
        for ops in passes:
            self.allocator.run(ops, frame)
        for slot in slots:
            carried[slot] = frame[slot]

    def state(self, at: int) -> tuple:
        """After row `at`, what `replay_device` compares to see the rows repeat: the allocated, reserved and peak
        bytes, and the stages' micro-batches held, each counted back from the last begun: `held`'s bits shifted
        by the micro-batches begun after row `at` (one int a stage, not a pair a micro-batch); where Adam's moments
        are made at the first step's end, whether no step, one or more ran before (`run` tells no others apart)."""
        allocator, back = self.allocator, self.begun[-1] - self.begun[at]
        held = tuple((stage, bits << back) for stage, bits in self.held.items() if bits)
        return (allocator.allocated_bytes, allocator.reserved_bytes, allocator.peak_allocated_bytes,
                allocator.peak_reserved_bytes, held, self.adam_at_first_step and min(self.zeros, 2))

    def skip(self, before: int, at: int) -> int:
        """After row `at`, the state as after row `before`: skip each further whole repetition of the rows
        between while the rows repeat them, renaming the held frames' micro-batches; the last row skipped."""
        period = at - before
        repeated = 0
        while at + repeated + 1 < len(self.rows) and (
                self.shapes[at + repeated + 1] == self.shapes[at + repeated + 1 - period]):
            repeated += 1
        cycles = repeated // period
        if cycles == 0:
            return at
        shift = cycles * (self.begun[at] - self.begun[before])
        self.frames = {(stage, microbatch + shift): frame for (stage, microbatch), frame in self.frames.items()}
        self.held = {stage: bits << shift for stage, bits in self.held.items()}
        return at + cycles * period


def device_reserves(trace: Trace, layers: Mapping[int, Sequence[LayerAllocations]],
                    capacity_bytes: Sequence[int | None], expandable: bool = False,
                    adam: bool = False, merged_bytes: Mapping[int, int] | None = None,
                    runs: Mapping[int, Mapping[str, str | None]] | None = None,
                    devices: Sequence[int] | None = None) -> list[int]:
    """Per device, the bytes the caching allocator reserves beyond its tensors: its step replayed (`replay_device`:
    its parameters, gradients, optimizer state and runtime buffer at the prediction's peak as a block each, then its
    rows in the order they start, `layers[stage]` each stage's), the most it reserves less the most it allocates:
    what torch's max reserved adds to its max allocated. Its own difference, not its reserved less the
    prediction's peak: the replay frees layer by layer where the prediction holds a stage's activations and a
    pass's transient peak for whole rows, so it can allocate less than the prediction holds and that difference
    would read nothing. `capacity_bytes`: each device's memory (None: unbounded), whose cached segments torch
    releases when a cudaMalloc fails; where the step does not fit even then (torch's out of memory), its reserve
    is what it would take without that bound. That puts the device's peak over its memory where the replay
    allocates no more than the simulation holds; under a split backward each layer holds from its input pass to its
    weight pass what the simulation holds (`LayerAllocations.wgrad_kept`, its `wgrad_kept_bytes`). Under a
    pipeline, FSDP2's whole weights and gradients (`LayerAllocations.unsharded`) are made and freed as its rows run
    (`step_events`), not held as blocks: the parameters' block is their shards alone, and no gradients' block;
    without one, gathered, resharded and reduce-scattered block by block in each pass (`unpipelined_events`).
    Under FSDP2 over two mini-batches or more (a flushing order's one, repeated: `steady_rows`) with `adam` (the
    optimizer torch's Adam or AdamW), its moments are made at the first step's end (AdamW makes them at its first
    `step()`), not held as a block from the start (`replay_device`'s adam_at_first_step); another optimizer's state
    stays the block it is. Likewise under Megatron-LM's 16-bit optimizer (`LayerAllocations.stepped`): its float32
    master weights a block from the start (made as it is built), Apex's FusedAdam's moments made at the first step's end
    (its `step` makes a parameter's state when it has none; megatron/optimizer/__init__.py at the zero-bubble fork's
    425b42e5 builds it), after each step's float32 main gradients, which the next step's zero_grad frees.
    `expandable`: the allocator with expandable segments (`ExpandableSegments`). `merged_bytes`: per stage, the
    model output a micro-batch that its runtime keeps and concatenates once the device's last full or weight
    backward of a mini-batch ends (sim/costs.py `merges_outputs`): a tensor of all its forwards' outputs of the
    mini-batch made and freed there (MERGE); none: {}. `runs`: per stage, the layers' pass each of its backward
    passes runs where another (`stage_program`); none: {}. `devices`: of those devices alone, in that order (default
    every device): each device replays apart, so a trace's devices can replay in several processes."""
    programs: dict[tuple[int, int], StageProgram] = {}  # by stage and its place among its device's
    reserves = []
    parts = trace.meta.peak_memory_parts or ()
    for device in range(len(parts)) if devices is None else devices:
        held, rows = parts[device], steady_rows(device_rows(trace, device))
        # the rows with their stages and micro-batches numbered as they come: the same wherever the content is
        stages: dict[int, int] = {}
        for _, stage, _ in rows:
            stages.setdefault(stage, len(stages))
        mine = set(stages.items())
        for stage, part in mine - programs.keys():
            programs[stage, part] = stage_program(layers[stage], part, (runs or {}).get(stage))
        gathered = sum(weights for stage in stages for layer in layers[stage] for weights, _, _ in layer.unsharded)
        if len(layers) > 1 and gathered:
            rows = step_events(rows)
            static = (max(held["parameters"] - gathered, 0), held["optimizer_state"])
        elif gathered and all(name in ("fwd", "bwd") for name, _, _ in rows):
            rows = unpipelined_events(rows)
            # FSDP2's float32 weight shards, as many bytes as its float32 gradients' shards
            static = (sum(shard for stage in stages for layer in layers[stage] for _, _, shard in layer.unsharded),
                      held["optimizer_state"])
        else:
            static = tuple(held[part] for part in ("parameters", "gradients", "optimizer_state"))
        if held["runtime_buffers"]:  # the runtime's buffer, a block of its own held from the first pass on
            static = (held["runtime_buffers"], *static)
        # Megatron-LM's 16-bit optimizer: each parameter's two moments
        moments = 2 * sum(moment for stage in stages for layer in layers[stage] for _, moment in layer.stepped)
        if adam and moments:
            rows = minibatch_events(rows)
        # over two mini-batches or more (`steady_rows`): Adam's moments made at the first step's end, not held from
        # the start
        adam_at_first_step = adam and sum(ZERO in name for name, _, _ in rows) > 1
        if adam_at_first_step:
            static = (*static[:-1], *([max(static[-1] - moments, 0)] if moments else ()))
        merging = {stage: nbytes for stage, nbytes in (merged_bytes or {}).items() if nbytes and stage in stages}
        merged = 0
        if merging:  # each step's merge (a mini-batch's, or a round's): the outputs of its forwards (as many each)
            rows = merge_events(rows, trace.meta.microbatches // trace.meta.rounds)
            merged = (sum(merging.get(stage, 0) for name, stage, _ in rows if name.startswith("fwd"))
                      // sum(MERGE in name for name, _, _ in rows))
        place: dict[Hashable, int] = {}
        numbered = tuple((name, stages[stage], place.setdefault(microbatch, len(place)))
                         for name, stage, microbatch in rows)
        reserves.append(_reserve(static, numbered, tuple(programs[stage, part] for stage, part in stages.items()),
                                 capacity_bytes[device], expandable, adam_at_first_step, merged))
    return reserves


def step_events(rows: Sequence[tuple[str, int, tuple[int, int, int]]]) -> list[tuple[str, int, tuple[int, int, int]]]:
    """`device_rows`' rows, each pass named with what FSDP2 does around it in its mini-batch: ZERO, the device's
    first row (the optimizer's zero_grad before it, torchtitan's train loop); FIRST, a stage's first forward
    (gathering the weights) and first full or weight backward (making the gradients); LAST, its last full or
    weight backward (resharding and reduce-scattering after it)."""
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for at, (name, stage, (pipeline, minibatch, _)) in enumerate(rows):
        first.setdefault((pipeline, minibatch), at)
        if name != "igrad":
            first.setdefault((name == "fwd", stage, pipeline, minibatch), at)
        if name in ("bwd", "wgrad"):
            last[stage, pipeline, minibatch] = at
    return [(name + (ZERO if first[pipeline, minibatch] == at else "")
             + (FIRST if first.get((name == "fwd", stage, pipeline, minibatch)) == at else "")
             + (LAST if last.get((stage, pipeline, minibatch)) == at else ""), stage, (pipeline, minibatch, micro))
            for at, (name, stage, (pipeline, minibatch, micro)) in enumerate(rows)]


def merge_events(rows: Sequence[tuple[str, int, tuple[int, int, int]]], per_step: int
                 ) -> list[tuple[str, int, tuple[int, int, int]]]:
    """`device_rows`' rows (perhaps named with events already), MERGE on the device's last full or weight backward
    of each `schedule.step`, once it has run every row of its stages (torch's `step` merges then): a mini-batch's,
    or each round's of `per_step` micro-batches where it runs in rounds (`--rounds`; torch's runtime runs one model
    copy, so a round is micro-batches in a row)."""
    last = {(pipeline, minibatch, micro // per_step): at for at, (name, _, (pipeline, minibatch, micro))
            in enumerate(rows) if name.split(":")[0] in ("bwd", "wgrad")}
    ends = set(last.values())
    return [(name + (MERGE if at in ends else ""), stage, microbatch)
            for at, (name, stage, microbatch) in enumerate(rows)]


def minibatch_events(rows: Sequence[tuple[str, int, tuple[int, int, int]]]
                     ) -> list[tuple[str, int, tuple[int, int, int]]]:
    """`device_rows`' rows with ZERO on each mini-batch's first, before which Megatron-LM's train_step runs the
    optimizer's zero_grad (one optimizer a device, whatever pipelines its stages are of)."""
    first: dict[int, int] = {}
    for at, (_, _, (_, minibatch, _)) in enumerate(rows):
        first.setdefault(minibatch, at)
    return [(name + (ZERO if first[microbatch[1]] == at else ""), stage, microbatch)
            for at, (name, stage, microbatch) in enumerate(rows)]


def unpipelined_events(rows: Sequence[tuple[str, int, tuple[int, int, int]]]
                       ) -> list[tuple[str, int, tuple[int, int, int]]]:
    """`device_rows`' rows of a device without a pipeline named as FSDP2 runs each (EACH: `_unpipelined`), ZERO on
    its mini-batch's first row, AGAIN on a row whose pass the row before ran too, FIRST on its first backward (whose
    shards are held to the next zero_grad). The step before ended with a backward, as each does."""
    passes = [name for name, _, _ in rows]
    return [(name.split(":")[0] + (ZERO if ZERO in name else "") + EACH
             + (AGAIN if at and passes[at - 1] == passes[at] else "")
             + (FIRST if FIRST in name and not name.startswith("fwd") else ""), stage, microbatch)
            for at, (name, stage, microbatch) in enumerate(step_events(rows))]


@functools.lru_cache(maxsize=64)
def _reserve(static_bytes: tuple[int, ...], rows: tuple[tuple[str, int, int], ...],
             programs: tuple[StageProgram, ...], capacity_bytes: int | None, expandable: bool = False,
             adam_at_first_step: bool = False, merged_bytes: int = 0) -> int:
    """`device_reserves`' reading of one device, once a process for the same content (`rows`' stages numbered
    into `programs`): a search simulates configurations whose devices replay the same step (the same stages and
    rows, another data-parallel degree)."""
    stages = dict(enumerate(programs))
    try:
        replayed = replay_device(static_bytes, rows, stages, capacity_bytes, expandable, adam_at_first_step,
                                 merged_bytes)
    except AllocatorOutOfMemory:
        replayed = replay_device(static_bytes, rows, stages, None, expandable, adam_at_first_step, merged_bytes)
    return replayed.peak_reserved_bytes - replayed.peak_allocated_bytes


def add_reserve(trace: Trace, reserve_bytes: Sequence[int]) -> None:
    """Each device's reserve (`device_reserves`) in the trace's memory as the part `reserve`: held throughout the
    step (nothing cached is released, so from the second step on a device's reserved bytes never drop), on its
    memory curve, in its parts at the peak, and as a curve beside the other parts' on each device that has them."""
    for device, reserve in enumerate(reserve_bytes):
        curve = trace.counters["memory_bytes"][device]
        curve.values = curve.values + reserve
        trace.meta.peak_memory_parts[device]["reserve"] = reserve
    drawn = trace.counters.get("memory_bytes.reserve", [])  # none where the parts' curves were not made
    for device, curve in enumerate(drawn):
        if len(curve.times_us):
            drawn[device] = Counter(curve.times_us, curve.values + reserve_bytes[device])


def _forward(program: Program, layer: LayerAllocations) -> dict[int, int]:
    """A layer's forward written down (its `first_forward` where it has one): the slots it holds for its
    backward, by storage number."""
    forward = layer.passes.get("fwd", ()) if layer.first_forward is None else layer.first_forward
    live = program.replay(forward, held=layer.kept)
    for number in (layer.saved & (layer.rerun or frozenset())) & live.keys():  # the backward makes them again
        program.free(live.pop(number))
    return live


def _recomputed(program: Program, layer: LayerAllocations) -> dict[int, int]:
    """A recomputation before a layer's backward: the forward's `rerun` storages made again, what autograd saves
    of them held for the backward, the rest freed (the output made again: the next layer has its own)."""
    live = program.replay(layer.passes.get("fwd", ()), only=layer.rerun)
    for number in live.keys() - layer.saved:
        program.free(live.pop(number))
    return live
