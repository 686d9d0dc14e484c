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
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import numpy as np

from ..traces.trace import Trace
from ..units import MIB
from .costs import TRANSIENT_KINDS

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_REQUEST_BYTES = 1 * MIB  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT_BYTES = 2 * MIB  # kSmallBuffer: the small pool's segments
LARGE_SEGMENT_BYTES = 20 * MIB  # kLargeBuffer: the segment of a large-pool request under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc: from it up, a request gets a segment of its own size
LARGE_ROUNDING_BYTES = 2 * MIB  # kRoundLarge: what such a segment is rounded up to


class AllocatorOutOfMemory(MemoryError):
    """A segment that does not fit beside what is reserved, even once every whole cached segment is released."""


@dataclass(eq=False)
class Block:
    """A range of one segment, allocated or cached; `before` and `after`: its neighbours within the segment."""

    address: int
    size_bytes: int
    stream: int
    small_pool: bool
    allocated: bool = False
    before: Block | None = None
    after: Block | None = None

    @property
    def pool_key(self) -> tuple[int, int, int]:
        """How a pool orders its cached blocks (BlockComparatorSize): by stream, then size, then address."""
        return (self.stream, self.size_bytes, self.address)


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


@dataclass
class CachingAllocator:
    """One device's caching allocator. `capacity_bytes`: what cudaMalloc can hand out in all (None: unbounded);
    `max_split_bytes`: max_split_size (None: unset, torch's default). Addresses are the allocator's own: each
    segment starts above every earlier one, which orders equal-sized cached blocks as first made first."""

    capacity_bytes: int | None = None
    max_split_bytes: int | None = None
    reserved_bytes: int = 0
    allocated_bytes: int = 0  # the blocks handed out, rounded as the allocator's own statistics count them
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    _next_address: int = 0
    _allocated: dict[int, Block] = field(default_factory=dict)  # by address
    _cached: dict[bool, list[tuple[int, int, int]]] = field(
        default_factory=lambda: {True: [], False: []})  # pool keys, sorted, by small_pool
    _cached_blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Hand out a block for `nbytes` on `stream` as torch would; returns its address (for `free`)."""
        request_bytes = round_request(nbytes)
        small_pool = request_bytes <= SMALL_REQUEST_BYTES
        block = self._take_cached(request_bytes, stream, small_pool) or self._new_segment(
            request_bytes, stream, small_pool)
        if self._should_split(block, request_bytes):
            rest = Block(block.address + request_bytes, block.size_bytes - request_bytes, stream, small_pool,
                         before=block, after=block.after)
            if block.after is not None:
                block.after.before = rest
            block.after = rest
            block.size_bytes = request_bytes
            self._cache(rest)
        block.allocated = True
        self._allocated[block.address] = block
        self.allocated_bytes += block.size_bytes
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.address

    def free(self, address: int) -> None:
        """Give back the block at `address`: cached for its stream, merged with its free neighbours."""
        block = self._allocated.pop(address)
        block.allocated = False
        self.allocated_bytes -= block.size_bytes
        for neighbour in (block.before, block.after):
            if neighbour is not None and not neighbour.allocated:
                self._uncache(neighbour)
                block.size_bytes += neighbour.size_bytes
                if neighbour is block.before:
                    block.address, block.before = neighbour.address, neighbour.before
                    if block.before is not None:
                        block.before.after = block
                else:
                    block.after = neighbour.after
                    if block.after is not None:
                        block.after.before = block
        self._cache(block)

    def replay(self, allocations: Iterable[tuple[int, int]], stream: int = 0, held: Set[int] = frozenset(),
               only: Set[int] | None = None) -> dict[int, int]:
        """Allocate and free on `stream` as a pass did (its storages' numbers and bytes, negative where freed, as
        `LayerCount.allocations` without the shapes), but never free those `held`, and with `only`, make those
        alone; the addresses of the storages it left live, by number. An empty storage takes nothing (torch's
        allocator hands out no block for 0 bytes), and its free reads as 0 bytes too: both are passed over."""
        live: dict[int, int] = {}
        for number, nbytes in allocations:
            if nbytes == 0 or only is not None and number not in only:
                continue
            if nbytes >= 0:
                live[number] = self.malloc(nbytes, stream)
            elif number not in held:
                self.free(live.pop(number))
        return live

    def _should_split(self, block: Block, request_bytes: int) -> bool:
        remaining = block.size_bytes - request_bytes
        if block.small_pool:
            return remaining >= MIN_BLOCK_BYTES
        return self._under_max_split(request_bytes) and remaining > SMALL_REQUEST_BYTES

    def _under_max_split(self, nbytes: int) -> bool:
        return self.max_split_bytes is None or nbytes < self.max_split_bytes

    def _take_cached(self, request_bytes: int, stream: int, small_pool: bool) -> Block | None:
        """The smallest cached block of the pool and stream that holds the request, taken out of the cache."""
        keys = self._cached[small_pool]
        at = bisect.bisect_left(keys, (stream, request_bytes, -1))
        if at == len(keys) or keys[at][0] != stream:
            return None
        block = self._cached_blocks[keys[at]]
        if self.max_split_bytes is not None:
            if request_bytes < self.max_split_bytes <= block.size_bytes:
                return None
            if request_bytes >= self.max_split_bytes and block.size_bytes >= request_bytes + LARGE_SEGMENT_BYTES:
                return None
        self._uncache(block)
        return block

    def _new_segment(self, request_bytes: int, stream: int, small_pool: bool) -> Block:
        size_bytes = segment_bytes(request_bytes)
        if self.capacity_bytes is not None and self.reserved_bytes + size_bytes > self.capacity_bytes:
            self._release_whole_segments()
            if self.reserved_bytes + size_bytes > self.capacity_bytes:
                raise AllocatorOutOfMemory(
                    f"{size_bytes} bytes beside {self.reserved_bytes} reserved exceed {self.capacity_bytes}")
        block = Block(self._next_address, size_bytes, stream, small_pool)
        self._next_address += size_bytes
        self.reserved_bytes += size_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _release_whole_segments(self) -> None:
        """What a failed cudaMalloc makes torch do (`release_cached_blocks`): free every cached whole segment."""
        for block in [b for b in self._cached_blocks.values() if b.before is None and b.after is None]:
            self._uncache(block)
            self.reserved_bytes -= block.size_bytes

    def _cache(self, block: Block) -> None:
        bisect.insort(self._cached[block.small_pool], block.pool_key)
        self._cached_blocks[block.pool_key] = block

    def _uncache(self, block: Block) -> None:
        keys = self._cached[block.small_pool]
        del keys[bisect.bisect_left(keys, block.pool_key)]
        del self._cached_blocks[block.pool_key]


# A layer's pass on one rank: its storages' numbers and bytes in order, negative where freed (`CachingAllocator.replay`)
PassAllocations = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class LayerAllocations:
    """One layer's passes on one rank by pass of `PASSES`; `saved`: the forward's storages autograd saves (the rest
    it leaves live is its output). Under a recomputation, `rerun`: the forward's storages its backward makes
    again first (torch's checkpoint: all but what its policy keeps; Megatron-LM's selective: the attention
    core's), holding what of them autograd saves until the layer's backward is done; the forward drops those as
    it ends. `kept`: what a policy holds for the backward even where the forward freed it (torchtitan's op
    policy keeps every second product's output). None: no recomputation."""

    passes: Mapping[str, PassAllocations]
    saved: frozenset[int] = frozenset()
    rerun: frozenset[int] | None = None
    kept: frozenset[int] = frozenset()


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


def replay_device(static_bytes: Sequence[int], rows: Sequence[tuple[str, int, Hashable]],
                  layers: Mapping[int, Sequence[LayerAllocations]],
                  capacity_bytes: int | None = None) -> CachingAllocator:
    """One device's step through the caching allocator: its state (`static_bytes`, a block each: weights,
    gradients, optimizer state) allocated first and held, then its `rows` in the order they run, each (pass of
    `PASSES`, stage, micro-batch) with `layers[stage]` the stage's layers. A forward runs its layers in order,
    each keeping what it leaves live but what its backward reruns (`LayerAllocations`) until its full or weight
    backward; a backward runs them reversed, each rerunning first what its forward did not keep, and
    freeing what its own pass leaves live (the gradients, which the runtime accumulates into the state's or
    hands to the layer before) once the layer is done. The allocator as it ends: its peak reserved and
    allocated bytes (an AllocatorOutOfMemory where the step does not fit in `capacity_bytes` even with the
    cache released)."""
    allocator = CachingAllocator(capacity_bytes=capacity_bytes)
    for nbytes in static_bytes:
        allocator.malloc(nbytes)
    held: dict[tuple[int, int, Hashable], list[int]] = {}  # by (stage, layer, micro-batch): what its backward frees
    for name, stage, microbatch in rows:
        order = range(len(layers[stage])) if name == "fwd" else reversed(range(len(layers[stage])))
        for index in order:
            layer, key = layers[stage][index], (stage, index, microbatch)
            if name == "fwd":
                held[key] = _forward(allocator, layer)
                continue
            if name != "wgrad" and layer.rerun is not None:
                held[key] += _recomputed(allocator, layer)
            done = allocator.replay(layer.passes.get(name, ()))
            for address in [*done.values(), *(held.pop(key) if name != "igrad" else ())]:
                allocator.free(address)
    return allocator


def _forward(allocator: CachingAllocator, layer: LayerAllocations) -> list[int]:
    """A layer's forward replayed: the addresses it holds for its backward."""
    live = allocator.replay(layer.passes.get("fwd", ()), held=layer.kept)
    for number in (layer.saved & (layer.rerun or frozenset())) & live.keys():  # the backward makes them again
        allocator.free(live.pop(number))
    return list(live.values())


def _recomputed(allocator: CachingAllocator, layer: LayerAllocations) -> list[int]:
    """A recomputation before a layer's backward: the forward's `rerun` storages made again, what autograd saves
    of them held for the backward, the rest freed (the output made again: the next layer has its own)."""
    live = allocator.replay(layer.passes.get("fwd", ()), only=layer.rerun)
    for number in live.keys() - layer.saved:
        allocator.free(live.pop(number))
    return list(live.values())
