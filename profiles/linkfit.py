"""Link measurements as data, and their piecewise α–β fit.

The simulator's links cost `latency + bytes / bandwidth`; real transports change protocol with size
(eager vs rendezvous, chunking), so a link is one line per size range, with breakpoints where the measured
curve bends. Pure numpy: the simulator, the tuner and the executor read fits without importing torch;
`calibrate/links.py` measures the points.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..units import KIB, MIB

MIN_BYTES = 4 * KIB
# Bandwidth ceiling (1 PB/s) for a segment whose times do not grow with size: keeps bytes_per_ms finite for JSON.
MAX_BYTES_PER_MS = 1e12
_MIN_POINTS_PER_SEGMENT = 3

@dataclass(frozen=True)
class LinkPoint:
    """One message size: the median time of the repeats and their interquartile range, in ms.

    Point-to-point: one-way time (send until the receiver has the data), half a ping-pong round trip.
    All-reduce: time of the whole collective, as seen by the slowest rank.
    """

    nbytes: int
    ms: float
    spread_ms: float


class LinkPoints(list):
    """A list of LinkPoint plus `meta`: how it was measured (backend, device, host staging, repeats)."""

    def __init__(self, points: Iterable[LinkPoint] = (), meta: Mapping[str, Any] | None = None):
        super().__init__(points)
        self.meta = dict(meta or {})


@dataclass(frozen=True)
class LinkSegment:
    """`latency_ms + nbytes / bytes_per_ms` for sizes from `min_bytes` up to the next segment's min_bytes."""

    min_bytes: int
    latency_ms: float
    bytes_per_ms: float

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


@dataclass(frozen=True)
class LinkFit:
    """Piecewise α–β model of a link. The first segment also covers sizes below its min_bytes.

    `ms()` never decreases with size: where a segment starts below where the previous one ended (fit noise
    at a protocol change), it is held at the previous value until its line catches up.
    `meta` carries how the points were measured (see LinkPoints) so a profile can say so.
    """

    segments: tuple[LinkSegment, ...]
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a link fit needs at least one segment")
        starts = [s.min_bytes for s in self.segments]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"segment min_bytes must increase (got {starts})")
        for s in self.segments:
            if not (math.isfinite(s.latency_ms) and s.latency_ms >= 0):
                raise ValueError(f"segment at {s.min_bytes} B: latency_ms must be finite and >= 0 (got {s.latency_ms})")
            if not (math.isfinite(s.bytes_per_ms) and s.bytes_per_ms > 0):
                raise ValueError(f"segment at {s.min_bytes} B: bytes_per_ms must be finite and > 0 "
                                 f"(got {s.bytes_per_ms})")

    def ms(self, nbytes: int) -> float:
        return piecewise_ms(tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in self.segments), nbytes)


def piecewise_ms(segments: tuple[tuple[int, float, float], ...], nbytes: float) -> float:
    """Time of a piecewise α–β link, segments (min_bytes, latency_ms, bytes_per_ms): the line of the
    segment whose range holds nbytes (the first one's also below its start), held at least at the
    previous line's value where it starts, so times never fall with size."""
    floor_ms = 0.0
    _, latency_ms, bytes_per_ms = segments[0]
    for min_bytes, next_latency_ms, next_bytes_per_ms in segments[1:]:
        if nbytes < min_bytes:
            break
        floor_ms = max(floor_ms, latency_ms + min_bytes / bytes_per_ms)
        latency_ms, bytes_per_ms = next_latency_ms, next_bytes_per_ms
    return max(latency_ms + nbytes / bytes_per_ms, floor_ms)


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(latency_ms, ms_per_byte, cost) minimising the squared relative error Σ((a + b·x − y)/y)², a ≥ 0, b > 0.

    Relative error, so that 4 KiB points (tens of µs) weigh as much as 64 MiB ones (tens of ms).
    """
    w = 1.0 / y  # residual r_i = w_i (a + b x_i - y_i)
    wx, wy = w * x, w * y

    def cost(a: float, b: float) -> float:
        return float(np.sum((w * a + wx * b - wy) ** 2))

    (a, b), *_ = np.linalg.lstsq(np.column_stack([w, wx]), wy, rcond=None)
    if a >= 0 and b > 0:
        candidates = [(float(a), float(b))]
    else:  # the constrained optimum lies on a boundary: through the origin, or flat at the slope floor
        b_floor = 1 / MAX_BYTES_PER_MS
        through_origin = (0.0, max(float(wx @ wy / (wx @ wx)), b_floor))
        flat = (max(float(w @ (wy - wx * b_floor) / (w @ w)), 0.0), b_floor)
        candidates = [through_origin, flat]
    a, b = min(candidates, key=lambda ab: cost(*ab))
    return a, b, cost(a, b)


def fit_link(points: Sequence[LinkPoint], max_segments: int = 3, penalty: float = 0.05) -> LinkFit:
    """Piecewise α–β fit with breakpoints at measured sizes.

    Chooses the segmentation (each segment ≥ 3 points when there are enough) minimising
    Σ squared relative error + n·penalty²·(segments − 1): an extra segment must cut the RMS relative error
    by about `penalty` (5%), so one clean α–β line with a few % noise stays one segment, while a protocol
    change (a jump in latency or bandwidth) gets its own. Where two neighbouring lines cross between the
    measured sizes on either side, the breakpoint moves to the crossing so `ms()` is continuous there.
    """
    pts = sorted(points, key=lambda p: p.nbytes)
    if len(pts) < 2:
        raise ValueError(f"fitting a link needs at least two sizes (got {len(pts)})")
    if len({p.nbytes for p in pts}) != len(pts) or any(p.nbytes <= 0 or not p.ms > 0 for p in pts):
        raise ValueError("link points need distinct sizes > 0 and times > 0")
    x = np.array([p.nbytes for p in pts], dtype=float)
    y = np.array([p.ms for p in pts], dtype=float)
    n = len(pts)
    min_pts = _MIN_POINTS_PER_SEGMENT if n >= 2 * _MIN_POINTS_PER_SEGMENT else n
    k_max = max(1, min(max_segments, n // min_pts))

    # line[i][j]: best single line over points i..j-1.
    line: dict[tuple[int, int], tuple[float, float, float]] = {}
    for i in range(n):
        for j in range(i + min_pts, n + 1):
            line[i, j] = _fit_line(x[i:j], y[i:j])

    # best[k][j]: (cost, start of last segment) for the first j points in k segments.
    inf = (math.inf, -1)
    best = [[inf] * (n + 1) for _ in range(k_max + 1)]
    best[0][0] = (0.0, -1)
    for k in range(1, k_max + 1):
        for j in range(k * min_pts, n + 1):
            best[k][j] = min(((best[k - 1][i][0] + line[i, j][2], i)
                              for i in range((k - 1) * min_pts, j - min_pts + 1) if best[k - 1][i][0] < math.inf),
                             default=inf)
    k_best = min(range(1, k_max + 1), key=lambda k: best[k][n][0] + n * penalty ** 2 * (k - 1))

    bounds, j = [], n
    for k in range(k_best, 0, -1):
        i = best[k][j][1]
        bounds.append((i, j))
        j = i
    bounds.reverse()

    segments: list[LinkSegment] = []
    for i, j in bounds:
        a, b, _ = line[i, j]
        start = 0
        if segments:
            prev = segments[-1]
            start = int(x[i])
            if b != 1 / prev.bytes_per_ms:  # the crossing of the two lines, if it lies between the measured sizes
                cross = (a - prev.latency_ms) / (1 / prev.bytes_per_ms - b)
                if x[i - 1] < cross < x[i]:
                    start = math.ceil(cross)
        segments.append(LinkSegment(start, a, 1 / b))
    return LinkFit(tuple(segments), dict(getattr(points, "meta", {})))


def default_sizes(max_bytes: int = 64 * MIB) -> list[int]:
    """Powers of two from 4 KiB (latency-bound) to `max_bytes` (bandwidth-bound), enough to see protocol changes."""
    if max_bytes < MIN_BYTES:
        raise ValueError(f"max_bytes must be at least {MIN_BYTES} (got {max_bytes})")
    return [1 << e for e in range(MIN_BYTES.bit_length() - 1, max_bytes.bit_length()) if (1 << e) <= max_bytes]
