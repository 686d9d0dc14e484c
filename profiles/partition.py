"""Split a model's layers into p contiguous stages so that the slowest stage (forward + backward) is as
fast as possible, as PipeDream's planner does by dynamic programming, optionally under a per-device
memory cap. numpy, no torch: `pipesim simulate` re-partitions profiles with it.

Memory model of stage k of p (0 is the input stage), planned for 1F1B: its layers' weights, gradients
and optimizer state, plus the activations of the p - k micro-batches 1F1B keeps in flight there (p-k-1
warm-up forwards and the one whose backward has not run yet). Communication buffers are not counted.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np

from ..units import GIB, whole_number

Owned = TypeVar("Owned")  # a layer of any kind that has `tied_layer` (`owners`)

# `_least_busy_devices`: the share by which a cut's busiest device is less busy than the best's where it beats it:
# more than rounding's (the same times summed in another order)
BEATS = 1e-9


class PartitionError(ValueError):
    """No split satisfies the request; the message says why and what would."""


class OverCapError(PartitionError):
    """No split fits the memory cap; `leanest`: the split whose fullest stage holds the least (`leanest_partition`),
    which the message's figure is of, for a caller that falls back on it."""

    def __init__(self, message: str, leanest: list[int]) -> None:
        super().__init__(message, leanest)
        self.leanest = leanest

    def __str__(self) -> str:
        return self.args[0]


class _TooManyPrefixes(Exception):
    """A search (`searched_partition`'s at one time, `_least_busy_devices`) passed its limit of prefixes."""


@dataclass(frozen=True)
class LayerCost:
    """What the partitioner needs of one layer. `shared_with_previous_bytes`: part of its saved activations
    that the layer before it saves too (a ReLU output the next Linear keeps as its input), counted once
    when both are in one stage. `follows_previous`: no stage may start at it (`starts_refusal`). `tied_layer`: the
    earlier layer whose weights this one's are (a tied head's, the embedding's; -1: none), its `static_bytes` held
    once where a stage holds both (`tied_pairs`)."""

    ms: float
    static_bytes: int
    activation_bytes: int
    shared_with_previous_bytes: int = 0
    follows_previous: bool = False
    tied_layer: int = -1


def stage_activation_bytes(layers: Sequence[LayerCost], start: int, stop: int) -> int:
    return sum(layer.activation_bytes for layer in layers[start:stop]) - sum(
        layer.shared_with_previous_bytes for layer in layers[start + 1:stop])


def stage_memory_bytes(layers: Sequence[LayerCost], start: int, stop: int, stage: int, stages: int) -> int:
    """Peak bytes of layers [start, stop) as stage `stage` of `stages` under 1F1B (see the module docstring)."""
    static = sum(layer.static_bytes for layer in owners(layers, start, stop))
    return static + (stages - stage) * stage_activation_bytes(layers, start, stop)


def tied_pairs(layers: Sequence) -> list[tuple[int, int]]:
    """(layer, the earlier layer whose weights its weights are) for each tied layer of `layers` (LayerCost,
    LayerProfile or LayerCount: each has `tied_layer`)."""
    return [(i, layer.tied_layer) for i, layer in enumerate(layers) if layer.tied_layer >= 0]


def owned_at(layers: Sequence, start: int, stop: int) -> list[int]:
    """The layers of [start, stop) whose weights a stage holding them holds as their own, by index: all but a tied
    one whose tie lies among them (the two are one tensor there; on stages apart each keeps a copy, Megatron-LM's
    way)."""
    return [i for i in range(start, stop) if not start <= layers[i].tied_layer < stop]


def owners(layers: Sequence[Owned], start: int, stop: int) -> list[Owned]:
    """`owned_at`'s layers."""
    return [layers[i] for i in owned_at(layers, start, stop)]


def product_mean_ms(parts: Iterable[tuple[float, float]]) -> float:
    """How long the product a kernel launched at a random moment meets runs, of parts that share the compute (a
    stage's layers, a device's stages) given as (their `product_ms`, their forward + backward ms, the share of the
    compute each runs): the parts' times weighted by theirs. A part's 0 says it runs no product whose time is
    known, an embedding's layer none, a measured profile's layers none timed: left out, since its share holds
    back no product the mean could speak for; 0 where no part has one (not known, which the simulator charges
    the kernel's whole time: sim/costs.py `Costs.transfers_hold_products`). The one rule by which a profile's
    stage weighs its layers and the simulator a device its stages, so a device of one stage reads its own."""
    known = [(ms, weight_ms) for ms, weight_ms in parts if ms]
    total_ms = math.fsum(weight_ms for _, weight_ms in known)
    return math.fsum(ms * weight_ms for ms, weight_ms in known) / total_ms if total_ms else 0.0


StageCosts = Callable[[int], np.ndarray]  # stage k -> its cost for every [start, stop): an (n+1, n+1) array


@dataclass(frozen=True)
class ScaledRanges:
    """Stage costs (a `StageCosts`) that are one table of every range plus others each counted so many times on
    stage k: `base + scales[k] · table + ...`, the memory of a stage that keeps its layers' weights and state and
    so many weight versions and micro-batches' activations (the 1F1B model, `_one_f_one_b_bytes`; tune's orders).
    Given so, `_stage_blocks` reads the blocks of every stage at once from views of the tables, not a whole table
    made per stage (tune partitions hundreds of orders of up to 64 stages); in integers, exact either way."""

    base: np.ndarray
    terms: tuple[tuple[Sequence[int], np.ndarray], ...]  # (each stage's count, the table counted)

    def __call__(self, k: int) -> np.ndarray:
        total = self.base
        for scales, table in self.terms:
            total = total + scales[k] * table
        return total

    def at(self, k: int, start: int, stop: int) -> int:
        """Stage k's cost of layers start .. stop-1: the entry [start, stop] of `self(k)`, no table made."""
        return self.base[start, stop] + sum(scales[k] * table[start, stop] for scales, table in self.terms)

    def blocks(self, n: int, p: int) -> np.ndarray:
        """`_stage_blocks`' [k, r, c] of these costs, every stage's at once."""
        total = _bands(self.base, n, p)
        for scales, table in self.terms:
            total = total + np.asarray(scales)[:, None, None] * _bands(table, n, p)
        return total


@dataclass(frozen=True)
class MostOfRanges:
    """Stage costs that are the most of several `ScaledRanges`, each a way a stage may hold its micro-batches at once
    (a split backward's: so many from their forward with all their activations, so many more from their input-gradient
    pass with what their weight pass reads, in a few combinations, none the most for every range)."""

    rows: tuple[ScaledRanges, ...]

    def __call__(self, k: int) -> np.ndarray:
        return np.maximum.reduce([row(k) for row in self.rows])

    def at(self, k: int, start: int, stop: int) -> int:
        return max(row.at(k, start, stop) for row in self.rows)

    def blocks(self, n: int, p: int) -> np.ndarray:
        return np.maximum.reduce([row.blocks(n, p) for row in self.rows])


def _bands(table: np.ndarray, n: int, p: int) -> np.ndarray:
    """A read-only view [k, r, c] of `table`'s entry [k + r, k + 1 + c], the ranges stage k of p may hold
    (`_stage_blocks`)."""
    m = n - p + 1
    rows, columns = table.strides
    return np.lib.stride_tricks.as_strided(table[:, 1:], (p, m, m), (rows + columns, rows, columns), writeable=False)


def partition(layers: Sequence[LayerCost], stages: int, memory_cap_bytes: int | None = None,
              stage_bytes: StageCosts | None = None, stage_time: StageCosts | None = None,
              devices: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Stage bounds [0, b1, ..., n]: stage k holds layers bounds[k] .. bounds[k+1]-1. Minimises the slowest
    stage; ties keep the earliest cut, so the result is deterministic, or, given `devices` (per device, the stages
    it runs), the cut among them whose busiest device is least busy, on large problems a local optimum of that
    (`_least_busy_devices`). `stage_bytes` replaces the 1F1B memory model of the module docstring (a schedule that
    holds other activations or weight versions), `stage_time` the layers' forward + backward (a schedule that
    splits backwards, or counts its updates); each gives stage k's bytes or ms for every range of layers at once,
    entry [i, j] for layers i .. j-1."""
    n = _check_starts(layers, stages)
    # read only under a cap (tune partitions uncapped), where no split fitting it falls back on the leanest
    memory = None if memory_cap_bytes is None else stage_bytes or _one_f_one_b_bytes(layers, stages)
    over_cap = None if memory is None else _stage_blocks(n, stages, memory, memory_cap_bytes)
    times = _stage_blocks(n, stages, _starting(layers, stage_time or _forward_backward_ms(layers)))
    slowest_ms, bounds = _min_max_split(n, stages, times, over_cap)
    if devices is not None and slowest_ms < math.inf and any(len(held) > 1 for held in devices):
        bounds = _least_busy_devices(n, times, devices, slowest_ms, over_cap, bounds)
    if slowest_ms == math.inf:
        least_bytes, leanest = leanest_partition(layers, stages, memory)
        raise OverCapError(
            f"no split of {n} layers into {stages} stages fits {memory_cap_bytes / GIB:.3g} GiB per device: "
            f"the least memory any split needs on its fullest device is {least_bytes / GIB:.3g} GiB"
            + ("" if stage_bytes else " (1F1B activations in flight included)"), leanest)
    return bounds


# A device's memory in a mirrored pair's cut (`mirrored_partition`): its bytes for every range [i, i') of the pair's
# front stage, for every range [j', j) of its back stage (zeros where it holds none), and its capacity
PairBytes = tuple[np.ndarray, np.ndarray, float]


def mirrored_partition(layers: Sequence[LayerCost], stages: int, pair_bytes: Callable[[int], list[PairBytes]],
                       stage_time: StageCosts | None = None) -> list[int]:
    """Stage bounds minimising the slowest stage (`stage_time`, default and meaning as `partition`'s) where each
    device's memory depends on the ranges of stages k and stages-1-k together (`pair_bytes(k)`: the devices holding
    either, each with its capacity; the middle stage of an odd count, k = stages-1-k: its bytes in front), as a
    bidirectional or V-shaped placement puts both on one device (DualPipe's device k holds stage k of one copy and
    stages-1-k of the other; DualPipeV's and ZB-V's chunks) and a device holding one stage is a pair with nothing.
    Solved exactly from the outside in: best[a, b] is the least slowest stage of the pairs still to cut over
    layers [a, b), each pair a choice of its front's end a' and its back's start b'; ties keep the earliest cut
    (a', then b'). PartitionError where no cut fits."""
    n = _check_starts(layers, stages)
    stage_time = _starting(layers, stage_time or _forward_backward_ms(layers))
    inf, middle = math.inf, stages // 2
    best = np.full((n + 1, n + 1), inf)
    if stages % 2:  # the middle stage, a pair of its own
        fits = np.logical_and.reduce([front <= cap for front, _, cap in pair_bytes(middle)])
        best = np.where(fits, stage_time(middle), inf)
    else:
        np.fill_diagonal(best, 0.0)  # every layer cut
    choices = []
    for k in range(middle - 1, -1, -1):
        front_ms, back_ms = stage_time(k), stage_time(stages - 1 - k)
        over = [(front, back - cap) for front, back, cap in pair_bytes(k)]  # above its capacity by
        inner = np.maximum(back_ms[None, :, :], best[:, :, None])  # [a', b', b]
        level, chosen = np.full((n + 1, n + 1), inf), np.zeros((n + 1, n + 1), dtype=np.int64)
        # the front stage starts at a (0 for the first; at least a layer for each stage before it and after its
        # back), ends at a' > a; the back starts at b' >= a' and ends at b, a layer for each stage between on
        for a in range(k, n - stages + k + 1) if k else (0,):
            after, ends = slice(a + 1, None), slice(a + stages - 2 * k, n - k + 1)
            slowest = np.maximum(front_ms[a, after, None, None], inner[after, after, ends])
            most, sum_ = np.full(slowest.shape, -inf), np.empty(slowest.shape)
            for front, back in over:  # the most any device holds above its capacity
                np.maximum(most, np.add(front[a, after, None, None], back[None, after, ends], out=sum_), out=most)
            slowest[most > 0] = inf
            flat = slowest.reshape(-1, slowest.shape[2])
            first = np.argmin(flat, axis=0)
            chosen[a, ends] = (a + 1 + first // (n - a)) * (n + 1) + a + 1 + first % (n - a)
            level[a, ends] = flat[first, np.arange(slowest.shape[2])]
        best = level
        choices.append(chosen)
    if best[0, n] == inf:
        raise PartitionError(f"no cut of {n} layers into {stages} stages fits every device's memory")
    front_cuts, back_cuts, a, b = [0], [n], 0, n
    for chosen in reversed(choices):
        a, b = divmod(int(chosen[a, b]), n + 1)
        front_cuts.append(a)
        back_cuts.append(b)
    return front_cuts + back_cuts[::-1][stages % 2 == 0:]


def searched_partition(layers: Sequence[LayerCost], stages: int, fits: Callable[[list[int]], bool],
                       max_prefixes: int = 100_000, stage_time: StageCosts | None = None) -> list[int] | None:
    """Stage bounds minimising the slowest stage (`stage_time`, default and meaning as `partition`'s) among
    the cuts `fits` accepts, where a device's memory may depend on any of its stages (interleaved chunks): `fits`
    is given each prefix [0, b1, ..., b(k+1)] as stage k is cut, and refuses one that no completion can make fit
    (what the stages cut so far hold alone bounds it from below). The slowest stage is bisected over the ranges'
    times, from the time-balanced cut's up; at each, the earliest cut within it is searched depth first, stages
    that cannot cover the layers left within it pruned. None where none fits, or where a search passes
    `max_prefixes` prefixes (then nothing is claimed of that time)."""
    n = _check_starts(layers, stages)
    ms = _starting(layers, stage_time or _forward_backward_ms(layers))(0)
    least = max(ms[i, j] for i, j in itertools.pairwise(partition(layers, stages, stage_time=stage_time)))
    limits = np.unique(ms[np.isfinite(ms) & (ms >= least)])

    def cut_within(limit: float) -> list[int] | None:
        # [j]: the fewest stages within `limit` that cover layers j .. n-1, the least over the stops a stage from j
        # reaches (the farthest alone is not it where a stage may not start at every layer)
        fewest = np.full(n + 1, math.inf)
        fewest[n] = 0
        for j in range(n - 1, -1, -1):
            reach = ms[j, j + 1:] <= limit
            fewest[j] = 1 + fewest[j + 1:][reach].min() if reach.any() else math.inf
        bounds, tried = [0], 0

        def extend(k: int) -> bool:
            nonlocal tried
            if k == stages:
                return True
            start, left = bounds[-1], stages - k - 1
            for stop in range(start + 1, n - left + 1):
                if ms[start, stop] > limit:
                    break
                if fewest[stop] > left:
                    continue
                tried += 1
                if tried > max_prefixes:
                    raise _TooManyPrefixes
                bounds.append(stop)
                if fits(bounds) and extend(k + 1):
                    return True
                bounds.pop()
            return False

        try:
            return bounds if extend(0) else None
        except _TooManyPrefixes:
            return None

    found, low, high = None, 0, len(limits) - 1
    while low <= high:
        middle = (low + high) // 2
        cut = cut_within(limits[middle])
        if cut is None:
            low = middle + 1
        else:
            found, high = cut, middle - 1
    return found


def ranges(prefix: Sequence[float] | np.ndarray) -> np.ndarray:
    """Entry [i, j]: prefix[j] - prefix[i], what items i .. j-1 add up to given the prefix sums (0 first)."""
    values = np.asarray(prefix)
    return values[None, :] - values[:, None]


def range_sums(values: Iterable[float], tied: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """Entry [i, j]: what items i .. j-1 of `values` add up to (`ranges` of their prefix sums), each item k of a
    `tied` pair (k, t) (`tied_pairs`) left out of the ranges that hold item t too (a tied layer's weights, one
    tensor with its tie's there)."""
    values = list(values)
    sums = ranges(np.cumsum([0, *values]))
    for k, t in tied:
        sums[:t + 1, k + 1:] -= values[k]
    return sums


def leanest_partition(layers: Sequence[LayerCost], stages: int,
                      stage_bytes: StageCosts | None = None) -> tuple[float, list[int]]:
    """The split whose fullest stage holds the least memory (by `stage_bytes`, default 1F1B's), and those
    bytes: what to fall back on, and to report, when no split fits a cap."""
    n = _check_starts(layers, stages)
    refused = (_stage_blocks(n, stages, _starting(layers, lambda k: np.zeros((n + 1, n + 1))), 0.0)
               if _barred(layers) else None)
    return _min_max_split(n, stages, _stage_blocks(n, stages, stage_bytes or _one_f_one_b_bytes(layers, stages)),
                          refused)


def equal_blocks(kinds: Sequence[str], stages: int) -> list[int]:
    """Stage bounds giving every stage the same number of the model's blocks (the layers of its most common kind,
    one contiguous run), the layers before them with the first stage and those after with the last: how
    Megatron-LM cuts a transformer (the embedding with the first stage, the head with the last), which refuses a
    block count the stages do not divide (megatron/model/transformer.py, `_get_num_layers`)."""
    _check(kinds, stages)
    first, blocks, kind = _block_run(kinds)
    if blocks % stages:
        raise PartitionError(f"{blocks} blocks ({kind}) do not divide into {stages} model stages (p·v)")
    return _bounds(kinds, first, [blocks // stages] * stages)


def padded_blocks(kinds: Sequence[str], stages: int) -> list[int]:
    """Stage bounds as the zero-bubble paper's Megatron-LM fork cuts a block count the stages do not divide
    (`--allow-padding-num-layers`; sail-sg/zero-bubble-pipeline-parallelism, megatron/arguments.py and
    `ParallelTransformer.get_offset`): padded up to a multiple of the stages, each stage as many blocks, then one
    fewer in the last stage, the first, the second, ... for each padded block, so that with two the ends, which
    also hold the embedding and the loss, have one block fewer than the rest (the paper's section 5.1)."""
    _check(kinds, stages)
    first, blocks, _ = _block_run(kinds)
    per = -(-blocks // stages)
    sizes = [per] * stages
    for stage in range(-1, per * stages - blocks - 1):
        sizes[stage] -= 1
    return _bounds(kinds, first, sizes)


def first_last_blocks(kinds: Sequence[str], stages: int, first_blocks: int, last_blocks: int) -> list[int]:
    """Stage bounds as Megatron-core cuts uneven ends (`--decoder-first-pipeline-num-layers`,
    `--decoder-last-pipeline-num-layers`): the first stage `first_blocks` of the model's blocks (with the layers
    before them, the embedding), the last `last_blocks` (with those after, the norm and head), every other stage an
    equal share of the rest, refused where they do not divide it (as TransformerConfig's check refuses it)."""
    _check(kinds, stages)
    first, blocks, kind = _block_run(kinds)
    middle, inner = blocks - first_blocks - last_blocks, stages - 2
    if stages < 2:
        raise PartitionError(f"it cuts a first and a last stage: give p·v 2 or more model stages (got {stages})")
    given = f"{first_blocks} first and {last_blocks} last blocks"
    most = f"F + L at most {blocks}" if inner else f"F + L = {blocks}"
    if middle < 0:
        raise PartitionError(f"{given} are more than the model's {blocks} ({kind}): give {most}")
    if not inner and middle:
        raise PartitionError(f"{given} leave {middle} of the model's {blocks} ({kind}) to no stage at p·v = 2: "
                             f"give {most}")
    if inner and middle % inner:
        raise PartitionError(f"{blocks} blocks ({kind}) less {first_blocks} first and {last_blocks} last do not "
                             f"divide into the {inner} model stages between (p·v = {stages})")
    return _bounds(kinds, first, [first_blocks, *[middle // inner] * inner, last_blocks] if inner else
                   [first_blocks, last_blocks])


# Megatron-core's --pipeline-model-parallel-layout: its letters, and its repeats in the order it unrolls them, a
# group's and then a letter's (megatron/core/transformer/pipeline_parallel_layer_layout.py `parse_str_to_list`, the
# same from 77732c3 to d98e8a6)
LAYOUT_LETTERS = {"E": "the embedding", "t": "a decoder layer", "m": "a multi-token-prediction layer",
                  "L": "the loss, with the final norm and head"}
LAYOUT_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
LAYOUT_GRAMMAR = (f"letters {', '.join(f'{letter} ({what})' for letter, what in LAYOUT_LETTERS.items())}, "
                  "| between stages, (...)*n and x*n repeats, commas ignored")
# The most characters a layout may unroll to: far past any model's layers and pipesim's stages (MAX_STAGES), where a
# repeat of 10**12 ran out of memory or for minutes
LAYOUT_MOST_CHARACTERS = 1_000_000


def megatron_layout(layout: str) -> list[str]:
    """Each stage's letters in `layout`, parsed as Megatron-core parses it: commas dropped, every (...)*n and then
    every x*n unrolled once, the rest split at |; a character that is not a letter it knows refused (so is a
    parenthesis left unbalanced, nested or without *n, as Megatron-core refuses it), and so is one that would
    unroll past LAYOUT_MOST_CHARACTERS, before it is unrolled."""
    unrolled = layout.replace(",", "")
    for repeat in LAYOUT_REPEATS:
        length = len(unrolled) + sum(len(match.group(1)) * _repeats(match) - len(match.group(0))
                                     for match in repeat.finditer(unrolled))
        if length > LAYOUT_MOST_CHARACTERS:
            raise PartitionError(f"its repeats unroll to more than {LAYOUT_MOST_CHARACTERS:,} characters, far more "
                                 "than a model's layers")
        unrolled = repeat.sub(lambda match: match.group(1) * _repeats(match), unrolled)
    stages = unrolled.split("|")
    for k, stage in enumerate(stages):
        unknown = next((letter for letter in stage if letter not in LAYOUT_LETTERS), None)
        if unknown is not None:
            what = " (a parenthesis unbalanced, nested or without *n)" if unknown in "()" else ""
            raise PartitionError(f"stage {k} holds {unknown!r}{what}; a layout has {LAYOUT_GRAMMAR}")
    return stages


def _repeats(match: re.Match) -> int:
    """A layout repeat's n; one past LAYOUT_MOST_CHARACTERS as one past it (unrolled, either is refused)."""
    repeats = whole_number(match.group(2), LAYOUT_MOST_CHARACTERS)
    return LAYOUT_MOST_CHARACTERS + 1 if repeats is None else repeats


def layout_blocks(kinds: Sequence[str], stages: int, layout: Sequence[str], mtp_layers: int = 0,
                  mtp_kind: str = "", devices: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Stage bounds as Megatron-core's `layout` (`megatron_layout`'s stages) cuts the model: its stage i is model
    stage i, which Megatron-core runs on pipeline rank i mod p as virtual stage i // p (interleaved 1F1B's
    placement). Refused as TransformerConfig refuses it (`validate_layer_layout`): E first and L last, once each,
    as many t as the model's blocks and m as its `mtp_layers`, every m after the last t, in one stage, the last
    its device runs (`devices`: each device's stages); and where its stages are not the schedule's `stages`. The
    layers before the blocks go with E and those after with L, but that with m the final norm goes with the last
    t (`TransformerBlock.has_final_layernorm_in_this_stage`) and the `mtp_kind` layer with the m. A stage may hold
    no layer, as Megatron-core allows (its bound repeats the next one's): its device passes the activation on."""
    if len(layout) != stages:
        raise PartitionError(f"its {len(layout)} stages are not the schedule's {stages} model stages (a model "
                             f"copy's): give a layout of {stages} stages, or the --stages (and --chunks) that make "
                             f"{len(layout)}")
    first, blocks, kind = _block_run(kinds)
    flat = "".join(layout)
    at = {letter: [k for k, stage in enumerate(layout) for held in stage if held == letter] for letter in "Etm"}
    mtp_fix = (f": leave the m out, or count an hf: model's with --mtp-layers {len(at['m'])}"
               if not mtp_layers and at["m"] else "")
    rules = ((flat[:1] == "E" and flat[-1:] == "L", "E first and L last"),
             (flat.count("E") == flat.count("L") == 1, "E and L once each"),
             # GPTModel's pre_process and post_process follow the stage's place, not the layout
             ("E" in layout[0] and "L" in layout[-1], "E in the first stage and L in the last, where Megatron-core "
                                                      "builds the embedding and the loss whatever the layout says"),
             (len(at["t"]) == blocks, f"a t for each of the model's {blocks} blocks ({kind}); it has {len(at['t'])}"),
             (len(at["m"]) == mtp_layers, f"an m for each multi-token prediction layer (--mtp-layers {mtp_layers}); "
                                          f"it has {len(at['m'])}{mtp_fix}"),
             ("t" not in flat.partition("m")[2], "every t before the first m"),
             (len(set(at["m"])) < 2, "every m in one stage"),
             (not at["m"] or devices is None or any(max(held) == at["m"][0] for held in devices),
              "its m in the last stage its device runs (Megatron-core's last virtual stage of its rank)"))
    for holds, rule in rules:
        if not holds:
            raise PartitionError(f"a layout needs {rule}")
    after, loss = len(kinds) - first - blocks, next(k for k, stage in enumerate(layout) if "L" in stage)
    if at["m"]:
        mtp_at = list(kinds[first + blocks:]).index(mtp_kind)
        tail = [at["t"][-1]] * mtp_at + at["m"][:1] + [loss] * (after - mtp_at - 1)
    else:
        tail = [loss] * after
    held = [at["E"][0]] * first + at["t"] + tail
    bounds = [sum(stage < k for stage in held) for k in range(stages)] + [len(kinds)]
    return bounds


def _block_run(kinds: Sequence[str]) -> tuple[int, int, str]:
    """Where the model's blocks (the layers of its most common kind, on a tie the first seen between the first
    and last layers: one block ties with the embedding) start, how many there are, and their kind; refused where
    they are not one contiguous run."""
    kind = max(dict.fromkeys(kinds[1:-1] or kinds), key=kinds.count)
    where = [i for i, k in enumerate(kinds) if k == kind]
    first, blocks = where[0], len(where)
    if where[-1] - first + 1 != blocks:
        raise PartitionError(f"the model's {blocks} {kind} layers are not one run of blocks, so equal blocks per "
                             "stage are not defined for it")
    return first, blocks, kind


def _bounds(kinds: Sequence[str], first: int, sizes: Sequence[int]) -> list[int]:
    """Bounds of stages holding `sizes` blocks each from `first`, the layers before with the first stage and
    those after with the last; refused where a stage would hold no layer."""
    bounds = [0, *(first + sum(sizes[:k]) for k in range(1, len(sizes))), len(kinds)]
    if any(b >= c for b, c in itertools.pairwise(bounds)):
        raise PartitionError(f"{sum(sizes)} blocks cut as {sizes} leave a model stage without a layer")
    return bounds


def _check(layers: Sequence, stages: int) -> int:
    n = len(layers)
    if stages < 1:
        raise PartitionError(f"stages must be >= 1 (got {stages})")
    if stages > n:
        raise PartitionError(f"{stages} stages but the model has {n} layers: each stage needs at least one layer")
    return n


# Why a layer may start no stage (`LayerCost.follows_previous`), as every refusal of such a cut says it
FOLLOWS_WHY = "reuses the top k a sparse attention before it kept, which no stage boundary passes on"


def stage_starts(follows_previous: Sequence[bool]) -> list[int]:
    """The layers a stage may start at: the first, and each that does not follow the layer before it (a sparse
    attention reusing the top k a layer before it kept, GLM-5.2's; Megatron-core refuses a cut there:
    experimental_attention_variant_module_specs.py `_validate_dsa_index_share_pipeline_split`, d98e8a64)."""
    return [i for i, follows in enumerate(follows_previous) if not follows or i == 0]


def empty_stages(bounds: Sequence[int]) -> list[int]:
    """The stages a cut at `bounds` leaves without a layer, whose bound repeats the next one's (a layout's: Megatron-
    core allows them, `layout_blocks`)."""
    return [k for k, (start, stop) in enumerate(itertools.pairwise(bounds)) if start == stop]


def starts_refusal(follows_previous: Sequence[bool], bounds: Sequence[int]) -> str | None:
    """Why a cut at `bounds` is refused (None: it is not): a stage would start at a layer no stage may start at."""
    barred = next((start for start in bounds[1:-1] if follows_previous[start]), None)
    if barred is None:
        return None
    return (f"a stage would start at layer {barred}, which {FOLLOWS_WHY}: start each stage at one of the "
            f"{_starts_text(follows_previous)}")


def _starts_text(follows_previous: Sequence[bool]) -> str:
    """The layers a stage may start at, counted, the first of them named."""
    starts = stage_starts(follows_previous)
    shown = ", ".join(map(str, starts[:8])) + (", ..." if len(starts) > 8 else "")
    return f"{len(starts)} of the {len(follows_previous)} layers that may ({shown})"


def _check_starts(layers: Sequence[LayerCost], stages: int) -> int:
    """`_check`, and refused where fewer layers than stages may start one (`stage_starts`)."""
    n = _check(layers, stages)
    follows = [layer.follows_previous for layer in layers]
    if len(stage_starts(follows)) < stages:
        raise PartitionError(f"{stages} stages, but a stage may start only at the {_starts_text(follows)}; the others "
                             f"each {FOLLOWS_WHY}")
    return n


def _barred(layers: Sequence[LayerCost]) -> list[int]:
    """The layers no stage may start at (all but `stage_starts`)."""
    starts = set(stage_starts([layer.follows_previous for layer in layers]))
    return [i for i in range(len(layers)) if i not in starts]


def _starting(layers: Sequence[LayerCost], stage_time: StageCosts) -> StageCosts:
    """`stage_time` with every range that starts at a layer no stage may start at (`_barred`) infinitely slow, so
    that every search here cuts only where a stage may start; itself where every layer may."""
    barred = _barred(layers)
    if not barred:
        return stage_time

    def barred_time(k: int) -> np.ndarray:
        table = np.array(stage_time(k), dtype=float)
        table[barred, :] = math.inf
        return table

    return barred_time


def _forward_backward_ms(layers: Sequence[LayerCost]) -> StageCosts:
    """Every range's forward + backward ms, its layers' times summed exactly (math.fsum's correctly rounded sum)
    so that equal ranges tie to the bit, for every stage (`_range_ms`)."""
    table = _range_ms(tuple(float(layer.ms) for layer in layers))
    return lambda k: table


def exact_range_sums(values: Iterable[float]) -> np.ndarray:
    """Entry [i, j] (j > i): what items i .. j-1 of `values` add up to, rounded once as math.fsum rounds it
    (`_range_ms`, kept for the values; read-only); inf where j <= i."""
    return _range_ms(tuple(float(value) for value in values))


def with_range_ms(layers: Sequence[LayerCost], beyond_ms: np.ndarray) -> StageCosts:
    """Every range's forward + backward ms (`_forward_backward_ms`) and, added, its entry of `beyond_ms` (what
    the stage takes beyond its layers' times: profiles/schema.py `stage_time`), for every stage."""
    table = _forward_backward_ms(layers)(0) + beyond_ms
    return lambda k: table


@lru_cache(maxsize=256)
def _range_ms(times: tuple[float, ...]) -> np.ndarray:
    """Every range's sum of `times`, read-only: each range's exact sum rounded once, as math.fsum rounds it, taken
    off integer prefix sums of the times over their common power-of-two denominator (Python's int division rounds
    correctly, half to even as fsum): n^2 divisions instead of n^3 additions. A time that is not finite has no such
    integer: each range summed by fsum then. Kept for the times: tune partitions one estimate's layers for every
    depth p it searches, and its stages' waits for their host (profiles/schema.py `stage_waits_ms`) with them."""
    n = len(times)
    table = np.full((n + 1, n + 1), math.inf)
    if all(map(math.isfinite, times)):
        ratios = [ms.as_integer_ratio() for ms in times]
        scale = max(denominator for _, denominator in ratios)
        prefix = list(itertools.accumulate((numerator * (scale // denominator) for numerator, denominator in ratios),
                                           initial=0))
        for i in range(n):
            table[i, i + 1:] = [(total - prefix[i]) / scale for total in prefix[i + 1:]]
    else:
        for i in range(n):
            table[i, i + 1:] = [math.fsum(times[i:j]) for j in range(i + 1, n + 1)]
    table.flags.writeable = False
    return table


def _one_f_one_b_bytes(layers: Sequence[LayerCost], stages: int) -> ScaledRanges:
    return ScaledRanges(range_sums((layer.static_bytes for layer in layers), tied_pairs(layers)),
                        ((range(stages, 0, -1), activation_ranges(layers)),))


def activation_ranges(layers: Sequence[LayerCost]) -> np.ndarray:
    """`stage_activation_bytes` of every range [i, j) at once: its layers' saved bytes, less what layers
    i+1 .. j-1 share with the layer before them."""
    saved = np.cumsum([0, *(layer.activation_bytes for layer in layers)])
    shared = np.cumsum([0, *(layer.shared_with_previous_bytes for layer in layers)])
    after_first = np.append(shared[1:], shared[-1])  # prefix up to layer i+1: what [i, j) does not share
    return ranges(saved) - (shared[None, :] - after_first[:, None])


def _stage_blocks(n: int, p: int, cost: StageCosts, above: float | None = None) -> np.ndarray:
    """[k, r, c]: stage k's cost over layers [k + r, k + 1 + c), the only ranges stage k of a split of n layers into p
    non-empty stages can hold (it starts at k .. n-p+k and ends at k+1 .. n-p+k+1), r > c no range; or, given
    `above`, whether that cost is over it (a cap: one byte an entry, read off each stage's costs as they come)."""
    m = n - p + 1
    if isinstance(cost, (ScaledRanges, MostOfRanges)):
        blocks = cost.blocks(n, p)
        return blocks.astype(float) if above is None else blocks > above
    blocks = np.empty((p, m, m), dtype=float if above is None else bool)  # floats as the split compares them
    for k in range(p):
        block = cost(k)[k:k + m, k + 1:k + 1 + m]
        if above is None:
            blocks[k] = block
        else:
            np.greater(block, above, out=blocks[k])
    return blocks


def _min_max_split(n: int, p: int, blocks: np.ndarray, refused: np.ndarray | None = None) -> tuple[float, list[int]]:
    """Minimise max_k cost(k)[start_k, stop_k] over splits of n items into p non-empty contiguous parts, the costs
    given as `_stage_blocks` lays them out (`blocks`, no cost NaN); `refused` (laid out so) marks ranges no stage
    may hold.

    best[c]: the least max over the first k+1+c items in k+1 parts, a stage's candidates at once (numpy over the
    m x m ranges that can end stage k, p times); ties keep the earliest cut (argmin's first). Where no split is
    finite the bounds are p zeros and n, as the full (n+1)-wide table's argmins over columns of inf gave them."""
    m = n - p + 1
    no_range = np.tri(m, k=-1, dtype=bool)
    costs = np.where(no_range if refused is None else refused | no_range, math.inf, blocks)
    best, columns, candidates = costs[0, 0], np.arange(m), np.empty((m, m))
    cuts = np.empty((p, m), dtype=np.int64)  # [k, c]: row r of stage k's best start for its stop k + 1 + c
    for k in range(1, p):
        np.maximum(best[:, None], costs[k], out=candidates)
        candidates.argmin(axis=0, out=cuts[k])
        best = candidates[cuts[k], columns]
    slowest = float(best[-1])
    if slowest == math.inf:
        return slowest, [0] * p + [n]
    bounds, at = [n], m - 1
    for k in range(p - 1, 0, -1):
        at = int(cuts[k, at])
        bounds.append(k + at)  # the start of stage k is the stop of stage k-1, column `at` of its blocks
    return slowest, [0, *reversed(bounds)]


def _least_busy_devices(n: int, times: np.ndarray, devices: Sequence[Sequence[int]], slowest_ms: float,
                        refused: np.ndarray | None, bounds: list[int], max_prefixes: int = 1_000) -> list[int]:
    """Of the cuts whose every stage is within `slowest_ms` (the least slowest stage: of the stages' `times`, laid out
    as `_stage_blocks` lays them, [k, r, c]: stage k over layers [k + r, k + 1 + c)) and not `refused`, the one
    whose busiest device is least busy, a device's busy time the sum of the times of the stages it runs
    (`devices`; a stage twice where it runs it twice as often): a device runs each of its stages for every
    micro-batch, Megatron-LM's interleaved schedule stage s of p·v on device s mod p, a V-shape stages k and
    2p-1-k on device k. The slowest stage alone leaves ties (whole blocks of equal time, or stages bound by their
    kernels' issue) whose earliest cut can put more of the slow stages on one device. Searched depth first,
    earliest cut first, bounded by the best so far: a branch ends where a device, its stages left each at their
    shortest (`shortest`), is already as busy, or where the devices' mean busy time, with the least the stages left
    can add (`least`), is. `bounds` (the slowest-stage cut) is kept unless a cut beats it by more than `BEATS` of
    its busiest device's time. Exact where the search ends within `max_prefixes` prefixes (small problems: every
    search of tests/tune_digests.json); past them (the 70B's p16 and p32 interleaved and V cuts of 82 layers into
    24 to 64 stages, where an exact cut is as hard as PARTITION), the best found so far made a local optimum by
    `_levelled_devices` (the search's earliest-first order often leaves it the slowest-stage cut there)."""
    stages, count = len(bounds) - 1, len(devices)
    m = n - stages + 1
    allowed = (times <= slowest_ms) & ~np.tri(m, k=-1, dtype=bool)
    if refused is not None:
        allowed &= ~refused
    counts = [[0] * count for _ in range(stages)]  # [k][d]: how often device d runs stage k
    for device, held in enumerate(devices):
        for k in held:
            counts[k][device] += 1
    runs = np.array(counts, dtype=float)
    stage_runs = runs.sum(axis=1)  # [k]: how often stage k runs, over every device
    per_stage = stage_runs.tolist()
    least = np.full((stages + 1, m), math.inf)  # [k, r]: the least busy time stages k.. add from row r
    least[stages, m - 1] = 0.0
    with np.errstate(invalid="ignore"):
        busy = np.where(allowed, stage_runs[:, None, None] * times, math.inf)  # stage k's over each range
    for k in range(stages - 1, -1, -1):
        least[k] = (busy[k] + least[k + 1]).min(axis=1)
    open_ = allowed & np.isfinite(least[1:, None, :])  # [k, r, c]: stage k may end at c, the stages after cover c..
    # the least each device's stages add, each the shortest range it may hold anywhere
    shortest = np.where(open_, times, math.inf).min(axis=(1, 2)).tolist()
    owners = [[(d, float(runs_d)) for d, runs_d in enumerate(row) if runs_d] for row in counts]
    least_ms, ends = least.tolist(), {}  # the search's Python numbers; ends: (k, r) -> stage k's ends from r, their ms

    def ends_from(k: int, start: int) -> tuple[list[int], list[float]]:
        if (k, start) not in ends:
            stops = np.flatnonzero(open_[k, start])
            ends[k, start] = stops.tolist(), times[k, start, stops].tolist()
        return ends[k, start]

    def busy_of(columns: Sequence[int]) -> np.ndarray:  # each stage's end column: the next stage's start row
        return sum((runs[k] * times[k, r, c] for k, (r, c) in enumerate(itertools.pairwise([0, *columns]))),
                   np.zeros(count))

    given = [stop - k - 1 for k, stop in enumerate(bounds[1:])]
    below_ms, best, columns, tried = float(busy_of(given).max()) * (1 - BEATS), given, [], 0

    def extend(k: int, least_busy: list[float], total_ms: float) -> None:
        """Stage k cut at each end it may take; `least_busy`: each device's busy time so far and the least its
        stages left add, `total_ms` the devices' busy times so far summed."""
        nonlocal below_ms, best, tried
        if k == stages:
            busiest = float(busy_of(columns).max())
            if busiest < below_ms:
                below_ms, best = busiest * (1 - BEATS), list(columns)
            return
        start = columns[-1] if columns else 0
        for stop, ms in zip(*ends_from(k, start)):
            summed = total_ms + per_stage[k] * ms
            if (summed + least_ms[k + 1][stop]) / count >= below_ms:
                continue
            grown = least_busy.copy()
            for device, runs_k in owners[k]:
                grown[device] += runs_k * (ms - shortest[k])
            if max(grown) >= below_ms:
                continue
            tried += 1
            if tried > max_prefixes:
                raise _TooManyPrefixes
            columns.append(stop)
            extend(k + 1, grown, summed)
            columns.pop()

    try:
        extend(0, (runs * np.array(shortest)[:, None]).sum(axis=0).tolist(), 0.0)
    except _TooManyPrefixes:
        best = _levelled_devices(times, runs, allowed, best)
    return [0, *(k + 1 + c for k, c in enumerate(best))]


def _levelled_devices(times: np.ndarray, runs: np.ndarray, allowed: np.ndarray, columns: Sequence[int]) -> list[int]:
    """`columns` (stage k over rows columns[k-1] .. columns[k] of `times`, as `_least_busy_devices` lays cuts out;
    `runs` [k, d] how often device d runs stage k) moved to a local optimum. A move takes one layer from a stage to
    another, the stages between shifting by one layer each: boundaries a .. b all one layer earlier or later, every
    stage kept `allowed` (within the slowest stage and the memory cap). The best move is taken while it lowers the
    busiest device, or keeps it and lowers the devices' sum of squared busy times (a more even spread, from which
    the busiest can drop next), or keeps both (within `BEATS`) and moves boundaries later: where blocks tie, many
    cuts are as good, and the memory cap forbids some shifts, so the way down can lie across such a plateau, and
    one direction on it keeps the walk from returning. At most stages·rows moves, each O(stages²·devices)."""
    stages, m, _ = times.shape
    at, cut = np.arange(stages), np.array(columns)
    ordered = np.triu(np.ones((stages - 1, stages - 1), dtype=bool))  # [a, b]: boundaries a .. b, a <= b
    for _ in range(stages * m):
        rows = np.concatenate([[0], cut[:-1]])
        now_ms = times[at, rows, cut]
        busy = now_ms @ runs
        top, spread = busy.max(), busy @ busy

        def moved(r: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Each stage's devices' change where it holds rows r .. c, and whether it may."""
            inside, r, c = (r >= 0) & (c < m), np.clip(r, 0, m - 1), np.clip(c, 0, m - 1)
            ok = inside & allowed[at, r, c]
            return np.where(ok, times[at, r, c] - now_ms, 0.0)[:, None] * runs, ok

        # move (step, a, b), boundaries a .. b (stage a's end .. stage b + 1's start) each moved by step, leaves
        # the devices busy heads[step, a] + tails[step, b]: stage a's end moved, stages a + 1 .. b shifted (prefix
        # sums `shifted`), stage b + 1's start moved
        heads, tails, valid = [], [], []
        for step in (-1, 1):
            end, end_ok = moved(rows, cut + step)
            both, both_ok = moved(rows + step, cut + step)
            start, start_ok = moved(rows + step, cut)
            shifted = np.concatenate([np.zeros((1, runs.shape[1])), np.cumsum(both, axis=0)])
            barred = np.concatenate([[0], np.cumsum(~both_ok)])
            heads.append(busy + end[:-1] - shifted[1:-1])
            tails.append(shifted[1:-1] + start[1:])
            valid.append(ordered & end_ok[:-1, None] & start_ok[None, 1:] & (barred[1:-1, None] == barred[None, 1:-1]))
        heads, tails, valid = np.array(heads), np.array(tails), np.array(valid)  # [step, a, device], [step, b, device]
        busiest = np.full(valid.shape, math.inf)  # [step, a, b]: the busiest device after the move, the valid only
        step, a, b = np.nonzero(valid)
        busiest[step, a, b] = (heads[step, a] + tails[step, b]).max(axis=-1)
        squares = (np.einsum("sad,sad->sa", heads, heads)[:, :, None] + 2 * heads @ tails.transpose(0, 2, 1)
                   + np.einsum("sbd,sbd->sb", tails, tails)[:, None, :])
        rank = np.where(busiest < top * (1 - BEATS), 0, np.where(squares < spread * (1 - BEATS), 1, 2))
        plateau = (squares <= spread * (1 + BEATS)) & (np.arange(2) == 1)[:, None, None]  # step +1: later
        taken = valid & (busiest <= top * (1 + BEATS)) & ((rank < 2) | plateau)
        if not taken.any():
            break
        options = np.flatnonzero(taken)
        keys = (options, np.where(rank <= 1, squares, 0.0).flat[options],
                np.where(rank == 0, busiest, 0.0).flat[options], rank.flat[options])
        step, a, b = np.unravel_index(options[np.lexsort(keys)[0]], taken.shape)
        cut[a:b + 1] += 2 * step - 1
    return cut.tolist()


def least_slowest(weights: Sequence[float]) -> np.ndarray:
    """[k] for k = 1 .. n: the least largest sum any split of `weights` (n, each >= 0) into k contiguous non-empty
    parts can have; [0] is inf. The optimum is one of the ranges' sums, so every range sum is tried at once as a
    threshold, each split greedily (the fewest parts whose sums stay within it); a threshold is stretched by
    1e-12 so that sums in another order pass it, which can only lower what is returned: a bound from below."""
    prefix = np.concatenate([[0.0], np.cumsum(weights, dtype=float)])
    n = len(prefix) - 1
    thresholds = np.unique(ranges(prefix)[np.triu_indices(n + 1, k=1)])
    stretched = thresholds * (1 + 1e-12)
    at = np.zeros(len(thresholds), dtype=np.int64)
    parts = np.zeros(len(thresholds))
    while (open_ := at < n).any():
        reach = np.searchsorted(prefix, prefix[at] + stretched, side="right") - 1
        parts += open_
        parts[open_ & (reach <= at)] = math.inf  # one weight alone over the threshold: no split keeps within it
        at = np.where(open_ & (reach > at), reach, n)
    least = np.full(n + 1, math.inf)
    for k in range(1, n + 1):
        fits = parts <= k  # more parts than the greedy needs only split further (down to one weight each)
        least[k] = thresholds[np.argmax(fits)] if fits.any() else math.inf
    return least
