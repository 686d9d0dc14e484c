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

from ..traces.trace import Counter, Trace
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


@dataclass(eq=False, slots=True)
class Block:
    """A range of one segment, allocated or cached; `before` and `after`: its neighbours within the segment."""

    address: int
    size_bytes: int
    stream: int
    small_pool: bool
    allocated: bool = False
    before: Block | None = None
    after: Block | None = None


# How a pool and stream order their cached blocks (BlockComparatorSize): by size, then address, as one number,
# size << ADDRESS_BITS | address, which a list bisects faster than a tuple (the allocator's addresses: < 256 TiB)
ADDRESS_BITS = 48


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
    # per pool (small or not) and stream, the cached blocks' pool keys, sorted; the blocks by pool and key
    _cached: dict[tuple[bool, int], list[int]] = field(default_factory=dict)
    _cached_blocks: dict[tuple[bool, int], dict[int, Block]] = field(default_factory=dict)

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Hand out a block for `nbytes` on `stream` as torch would; returns its address (for `free`)."""
        request_bytes = max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)  # `round_request`
        small_pool = request_bytes <= SMALL_REQUEST_BYTES
        block = self._take_cached(request_bytes, stream, small_pool) or self._new_segment(
            request_bytes, stream, small_pool)
        remaining = block.size_bytes - request_bytes
        if (remaining >= MIN_BLOCK_BYTES if small_pool else  # `should_split`
                remaining > SMALL_REQUEST_BYTES and (self.max_split_bytes is None
                                                     or request_bytes < self.max_split_bytes)):
            rest = Block(block.address + request_bytes, remaining, stream, small_pool, before=block,
                         after=block.after)
            if block.after is not None:
                block.after.before = rest
            block.after = rest
            block.size_bytes = request_bytes
            self._cache(rest)
        block.allocated = True
        self._allocated[block.address] = block
        self.allocated_bytes += block.size_bytes
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block.address

    def free(self, address: int) -> None:
        """Give back the block at `address`: cached for its stream, merged with its free neighbours."""
        block = self._allocated.pop(address)
        block.allocated = False
        self.allocated_bytes -= block.size_bytes
        before, after = block.before, block.after
        if before is not None and not before.allocated:
            self._uncache(before)
            block.size_bytes += before.size_bytes
            block.address, block.before = before.address, before.before
            if block.before is not None:
                block.before.after = block
        if after is not None and not after.allocated:
            self._uncache(after)
            block.size_bytes += after.size_bytes
            block.after = after.after
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
        malloc, free = self.malloc, self.free
        for number, nbytes in allocations:
            if nbytes == 0 or only is not None and number not in only:
                continue
            if nbytes > 0:
                live[number] = malloc(nbytes, stream)
            elif number not in held:
                free(live.pop(number))
        return live

    def _take_cached(self, request_bytes: int, stream: int, small_pool: bool) -> Block | None:
        """The smallest cached block of the pool and stream that holds the request, taken out of the cache."""
        keys = self._cached.get((small_pool, stream))
        if not keys:
            return None
        at = bisect.bisect_left(keys, request_bytes << ADDRESS_BITS)
        if at == len(keys):
            return None
        blocks = self._cached_blocks[small_pool, stream]
        block = blocks[keys[at]]
        if self.max_split_bytes is not None:
            if request_bytes < self.max_split_bytes <= block.size_bytes:
                return None
            if request_bytes >= self.max_split_bytes and block.size_bytes >= request_bytes + LARGE_SEGMENT_BYTES:
                return None
        del blocks[keys[at]], keys[at]
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
        for block in [b for blocks in self._cached_blocks.values() for b in blocks.values()
                      if b.before is None and b.after is None]:
            self._uncache(block)
            self.reserved_bytes -= block.size_bytes

    def _cache(self, block: Block) -> None:
        pool, key = (block.small_pool, block.stream), block.size_bytes << ADDRESS_BITS | block.address
        if pool not in self._cached:
            self._cached[pool], self._cached_blocks[pool] = [], {}
        bisect.insort(self._cached[pool], key)
        self._cached_blocks[pool][key] = block

    def _uncache(self, block: Block) -> None:
        pool, key = (block.small_pool, block.stream), block.size_bytes << ADDRESS_BITS | block.address
        keys = self._cached[pool]
        del keys[bisect.bisect_left(keys, key)], self._cached_blocks[pool][key]


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
    cache released).

    A pipeline's steady state repeats its rows, thousands of them at p = 64 and m = 512, more than a simulation
    may spend replaying: once a run of rows has brought back what the step had after an earlier row (the same
    micro-batches' layers held, counted back from the last begun, the same bytes allocated and reserved, no new
    peak) and the rows go on repeating that run, each further repetition is taken to do the same and skipped
    (`_Replay.skip`). The one reading not from torch's rules: the blocks may have traded places meanwhile (best
    fit takes the lowest address among equal sizes), and a later repetition can then split a block the first
    did not and take a segment more (docs/benchmarks.md: the zero-bubble 1.5B's 1F1B middle stages reserve 322
    MiB where every row replayed reserves 610)."""
    replay = _Replay(CachingAllocator(capacity_bytes=capacity_bytes), rows)
    for nbytes in static_bytes:
        replay.allocator.malloc(nbytes)
    seen: dict[tuple, list[int]] = {}  # a state after a row: the rows after which it was, the last first
    at = 0
    while at < len(rows):
        replay.run(rows[at], layers)
        earlier = seen.setdefault(replay.state(at), [])
        for before in earlier:  # a state can come back within a repetition (after an input and a weight pass)
            skipped = replay.skip(before, at)
            if skipped > at:
                at = skipped
                break
        earlier.insert(0, at)
        at += 1
    return replay.allocator


@dataclass
class _Replay:
    """`replay_device`'s step in progress: the allocator, and what each layer's backward frees by (stage, layer,
    micro-batch); micro-batches numbered in the order the rows begin them (`begun[row]`: how many by then)."""

    allocator: CachingAllocator
    rows: Sequence[tuple[str, int, Hashable]]
    held: dict[tuple[int, int, Hashable], list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.number: dict[Hashable, int] = {}
        self.begun: list[int] = []
        for _, _, microbatch in self.rows:
            self.number.setdefault(microbatch, len(self.number))
            self.begun.append(len(self.number))
        self.microbatches = list(self.number)
        # what a row does, its micro-batch named by its place among those begun before it
        self.shapes = [(name, stage, self.number[microbatch] - (self.begun[at - 1] if at else 0))
                       for at, (name, stage, microbatch) in enumerate(self.rows)]

    def run(self, row: tuple[str, int, Hashable], layers: Mapping[int, Sequence[LayerAllocations]]) -> None:
        name, stage, microbatch = row
        allocator = self.allocator
        order = range(len(layers[stage])) if name == "fwd" else reversed(range(len(layers[stage])))
        for index in order:
            layer, key = layers[stage][index], (stage, index, microbatch)
            if name == "fwd":
                self.held[key] = _forward(allocator, layer)
                continue
            if name != "wgrad" and layer.rerun is not None:
                self.held[key] += _recomputed(allocator, layer)
            done = allocator.replay(layer.passes.get(name, ()))
            for address in [*done.values(), *(self.held.pop(key) if name != "igrad" else ())]:
                allocator.free(address)

    def state(self, at: int) -> tuple:
        """After row `at`, what `replay_device` compares to see the rows repeat: the allocated, reserved and peak
        bytes, and the layers held, each under its micro-batch counted back from the last begun."""
        allocator, begun = self.allocator, self.begun[at]
        held = sorted((stage, index, self.number[microbatch] - begun) for stage, index, microbatch in self.held)
        return (allocator.allocated_bytes, allocator.reserved_bytes, allocator.peak_allocated_bytes,
                allocator.peak_reserved_bytes, tuple(held))

    def skip(self, before: int, at: int) -> int:
        """After row `at`, the state as after row `before`: skip each further whole repetition of the rows
        between while the rows repeat them, renaming the held blocks' micro-batches; the last row skipped."""
        period = at - before
        repeated = 0
        while at + repeated + 1 < len(self.rows) and (
                self.shapes[at + repeated + 1] == self.shapes[at + repeated + 1 - period]):
            repeated += 1
        cycles = repeated // period
        if cycles == 0:
            return at
        shift = cycles * (self.begun[at] - self.begun[before])
        self.held = {(stage, index, self.microbatches[self.number[microbatch] + shift]): addresses
                     for (stage, index, microbatch), addresses in self.held.items()}
        return at + cycles * period


def device_reserves(trace: Trace, layers: Mapping[int, Sequence[LayerAllocations]],
                    capacity_bytes: Sequence[int | None]) -> list[int]:
    """Per device, the bytes the caching allocator reserves beyond its tensors: its step replayed
    (`replay_device`: its parameters, gradients and optimizer state at the prediction's peak as a block each, then
    its rows in the order they start, `layers[stage]` each stage's), the most it reserves less the most it
    allocates: what torch's max reserved adds to its max allocated. Its own difference, not its reserved less the
    prediction's peak: the replay frees layer by layer where the prediction holds a stage's activations and a
    pass's transient peak for whole rows, so it can allocate less than the prediction holds and that difference
    would read nothing. `capacity_bytes`: each device's memory (None: unbounded), whose cached segments torch
    releases when a cudaMalloc fails; where the step does not fit even then (torch's out of memory), its reserve
    is what it would take without that bound, which puts the device's peak over its memory."""
    reserves = []
    for device, held in enumerate(trace.meta.peak_memory_parts or ()):
        static = [held[part] for part in ("parameters", "gradients", "optimizer_state")]
        rows = device_rows(trace, device)
        try:
            replayed = replay_device(static, rows, layers, capacity_bytes[device])
        except AllocatorOutOfMemory:
            replayed = replay_device(static, rows, layers)
        reserves.append(replayed.peak_reserved_bytes - replayed.peak_allocated_bytes)
    return reserves


def add_reserve(trace: Trace, reserve_bytes: Sequence[int]) -> None:
    """Each device's reserve (`device_reserves`) in the trace's memory as the part `reserve`: held throughout the
    step (nothing cached is released, so from the second step on a device's reserved bytes never drop), on its
    memory curve, in its parts at the peak, and as a curve beside the other parts' on each device that has them."""
    for device, reserve in enumerate(reserve_bytes):
        curve = trace.counters["memory_bytes"][device]
        curve.values = curve.values + reserve
        trace.meta.peak_memory_parts[device]["reserve"] = reserve
    drawn = trace.counters["memory_bytes.reserve"]
    for device, curve in enumerate(drawn):
        if len(curve.times_us):
            drawn[device] = Counter(curve.times_us, curve.values + reserve_bytes[device])


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
