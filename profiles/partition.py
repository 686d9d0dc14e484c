"""Split a model's layers into p contiguous stages so that the slowest stage (forward + backward) is as
fast as possible, as PipeDream's planner does by dynamic programming, optionally under a per-device
memory cap. Pure Python: `pipesim simulate` re-partitions profiles with it without importing torch.

Memory model of stage k of p (0 is the input stage), planned for 1F1B: its layers' weights, gradients
and optimizer state, plus the activations of the p - k micro-batches 1F1B keeps in flight there (p-k-1
warm-up forwards and the one whose backward has not run yet). Communication buffers are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

GIB = 1 << 30


class PartitionError(ValueError):
    """No split satisfies the request; the message says why and what would."""


@dataclass(frozen=True)
class LayerCost:
    """What the partitioner needs of one layer. `shared_with_previous_bytes`: part of its saved activations
    that the layer before it saves too (a ReLU output the next Linear keeps as its input), counted once
    when both are in one stage."""

    ms: float
    static_bytes: int
    activation_bytes: int
    shared_with_previous_bytes: int = 0


def stage_ms(layers: Sequence[LayerCost], start: int, stop: int) -> float:
    """Forward + backward ms of layers [start, stop), summed exactly so any two callers agree to the bit."""
    return math.fsum(layer.ms for layer in layers[start:stop])


def stage_activation_bytes(layers: Sequence[LayerCost], start: int, stop: int) -> int:
    return sum(layer.activation_bytes for layer in layers[start:stop]) - sum(
        layer.shared_with_previous_bytes for layer in layers[start + 1:stop])


def stage_memory_bytes(layers: Sequence[LayerCost], start: int, stop: int, stage: int, stages: int) -> int:
    """Peak bytes of layers [start, stop) as stage `stage` of `stages` under 1F1B (see the module docstring)."""
    static = sum(layer.static_bytes for layer in layers[start:stop])
    return static + (stages - stage) * stage_activation_bytes(layers, start, stop)


StageBytes = Callable[[int, int, int], float]  # (stage, start, stop) -> bytes that stage would hold
StageTime = Callable[[int, int, int], float]  # (stage, start, stop) -> ms that stage would take


def partition(layers: Sequence[LayerCost], stages: int, memory_cap_bytes: int | None = None,
              stage_bytes: StageBytes | None = None, stage_time: StageTime | None = None) -> list[int]:
    """Stage bounds [0, b1, ..., n]: stage k holds layers bounds[k] .. bounds[k+1]-1. Minimises the slowest
    stage; ties keep the earliest cut, so the result is deterministic. `stage_bytes` replaces the 1F1B
    memory model of the module docstring (a schedule that holds other activations or weight versions),
    `stage_time` the layers' forward + backward (a schedule that splits backwards, or counts its updates)."""
    n = _check(layers, stages)
    memory = stage_bytes or _one_f_one_b_bytes(layers, stages)
    time_ms = stage_time or _forward_backward_ms(layers)

    def time_within_cap(k: int, i: int, j: int) -> float:
        if memory_cap_bytes is not None and memory(k, i, j) > memory_cap_bytes:
            return math.inf
        return time_ms(k, i, j)

    slowest_ms, bounds = _min_max_split(n, stages, time_within_cap)
    if slowest_ms == math.inf:
        least_bytes, _ = leanest_partition(layers, stages, memory)
        raise PartitionError(
            f"no split of {n} layers into {stages} stages fits {memory_cap_bytes / GIB:.3g} GiB per device: "
            f"the least memory any split needs on its fullest device is {least_bytes / GIB:.3g} GiB"
            + ("" if stage_bytes else " (1F1B activations in flight included)"))
    return bounds


def leanest_partition(layers: Sequence[LayerCost], stages: int,
                      stage_bytes: StageBytes | None = None) -> tuple[float, list[int]]:
    """The split whose fullest stage holds the least memory (by `stage_bytes`, default 1F1B's), and those
    bytes: what to fall back on, and to report, when no split fits a cap."""
    _check(layers, stages)
    return _min_max_split(len(layers), stages, stage_bytes or _one_f_one_b_bytes(layers, stages))


def equal_blocks(kinds: Sequence[str], stages: int) -> list[int]:
    """Stage bounds giving every stage the same number of the model's blocks (the layers of its most common kind,
    one contiguous run), the layers before them with the first stage and those after with the last: how
    Megatron-LM cuts a transformer (the embedding with the first stage, the head with the last), which refuses a
    block count the stages do not divide (megatron/model/transformer.py, `_get_num_layers`)."""
    _check(kinds, stages)
    kind = max(dict.fromkeys(kinds), key=kinds.count)  # on a tie, the first seen
    where = [i for i, k in enumerate(kinds) if k == kind]
    first, blocks = where[0], len(where)
    if where[-1] - first + 1 != blocks:
        raise PartitionError(f"the model's {blocks} {kind} layers are not one run of blocks, so equal blocks per "
                             "stage are not defined for it")
    if blocks % stages:
        raise PartitionError(f"{blocks} blocks ({kind}) do not divide into {stages} model stages (p·v)")
    per = blocks // stages
    return [0, *(first + per * k for k in range(1, stages)), len(kinds)]


def _check(layers: Sequence, stages: int) -> int:
    n = len(layers)
    if stages < 1:
        raise PartitionError(f"stages must be >= 1 (got {stages})")
    if stages > n:
        raise PartitionError(f"{stages} stages but the model has {n} layers: each stage needs at least one layer")
    return n


def _forward_backward_ms(layers: Sequence[LayerCost]) -> StageTime:
    time_ms = cache(lambda i, j: stage_ms(layers, i, j))  # the DP asks for each range once per stage count
    return lambda k, i, j: time_ms(i, j)


def _one_f_one_b_bytes(layers: Sequence[LayerCost], stages: int) -> StageBytes:
    static = cache(lambda i, j: sum(layer.static_bytes for layer in layers[i:j]))
    activations = cache(lambda i, j: stage_activation_bytes(layers, i, j))
    return lambda k, i, j: float(static(i, j) + (stages - k) * activations(i, j))


def _min_max_split(n: int, p: int, cost: Callable[[int, int, int], float]) -> tuple[float, list[int]]:
    """Minimise max_k cost(k, start_k, stop_k) over splits of n items into p non-empty contiguous parts.

    best[k][j]: the least max over the first j items in k+1 parts; O(p n^2) calls of `cost`."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(p)]
    cut = [[0] * (n + 1) for _ in range(p)]
    for j in range(1, n - p + 2):
        best[0][j] = cost(0, 0, j)
    for k in range(1, p):
        for j in range(k + 1, n - p + k + 2):
            for i in range(k, j):
                value = max(best[k - 1][i], cost(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(p - 1, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return best[p - 1][n], [0, *reversed(bounds)]
