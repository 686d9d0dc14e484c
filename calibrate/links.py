"""Measure the links between ranks (point-to-point and all-reduce) and fit them with piecewise α–β lines.

The simulator's links cost `latency + bytes / bandwidth` (sim/cluster.py); real transports change protocol
with size (eager vs rendezvous, chunking), so one line per size range, with breakpoints where the measured
curve bends. Measurements run the transport the executor uses (DESIGN §5): gloo on CPU, NCCL with one GPU
per rank, and gloo with host-staged tensors when ranks share a GPU (NCCL refuses that).
"""

from __future__ import annotations

import itertools
import math
import queue as queue_mod
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from ..sim.cluster import piecewise_ms

MIN_BYTES = 4 << 10
# Bandwidth ceiling (1 PB/s) for a segment whose times do not grow with size: keeps bytes_per_ms finite for JSON.
_MAX_BYTES_PER_MS = 1e12
_MIN_POINTS_PER_SEGMENT = 3

Progress = Callable[[int, int], Any]


class LinkError(RuntimeError):
    """A link measurement that failed or did not finish in time; the message is one line saying which."""


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


# ---------------------------------------------------------------------------------------------------------------
# Fit


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
        b_floor = 1 / _MAX_BYTES_PER_MS
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


def default_sizes(max_bytes: int = 64 << 20) -> list[int]:
    """Powers of two from 4 KiB (latency-bound) to `max_bytes` (bandwidth-bound), enough to see protocol changes."""
    if max_bytes < MIN_BYTES:
        raise ValueError(f"max_bytes must be at least {MIN_BYTES} (got {max_bytes})")
    return [1 << e for e in range(MIN_BYTES.bit_length() - 1, max_bytes.bit_length()) if (1 << e) <= max_bytes]


# ---------------------------------------------------------------------------------------------------------------
# Measurement


def measure_p2p(sizes: Iterable[int], *, device: str = "cpu", repeats: int = 20, warmup: int = 3,
                progress: Progress | None = None, min_time_s: float = 0.15, timeout_s: float = 120.0) -> LinkPoints:
    """One-way point-to-point time per size between two ranks on this machine (ping-pong round trip / 2).

    `repeats` rounds each visit every size; a size runs at least once a round and, if cheap, more often, for
    about `min_time_s` in all: waking a blocked rank sometimes costs milliseconds (a timer tick on a busy VM),
    so small messages need many samples for a steady median. `progress(done, total)` follows the rounds
    (done=0 once the ranks are up). A failure, or a run past `timeout_s`, raises LinkError with the ranks ended.
    """
    return _measure("p2p", sizes, 2, device, (repeats, warmup, min_time_s), progress, timeout_s)


def measure_allreduce(sizes: Iterable[int], *, world_size: int = 2, device: str = "cpu", repeats: int = 10,
                      warmup: int = 2, progress: Progress | None = None, min_time_s: float = 0.15,
                      timeout_s: float = 120.0) -> LinkPoints:
    """Sum all-reduce time per size over `world_size` ranks, float32 like gradients (sizes round down to a
    multiple of 4 bytes). Back-to-back collectives after one barrier, so ranks pace each other as in
    data-parallel training; each repeat counts as long as its slowest rank. Other arguments as measure_p2p.
    """
    if world_size < 2:
        raise ValueError(f"an all-reduce needs world_size >= 2 (got {world_size})")
    return _measure("allreduce", sizes, world_size, device, (repeats, warmup, min_time_s), progress, timeout_s)


def _transport(device: str, world_size: int) -> dict[str, Any]:
    """Which backend the executor would use for `world_size` ranks on `device` (DESIGN §5)."""
    if device == "cpu":
        return {"backend": "gloo", "device": "cpu", "host_staged": False, "timer": "monotonic"}
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda' (got {device!r})")
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise LinkError("device 'cuda' asked for, but torch sees no GPU")
    if gpus >= world_size:
        return {"backend": "nccl", "device": "cuda", "host_staged": False, "timer": "cuda-events"}
    # NCCL refuses two ranks on one GPU: stage through host memory and send with gloo, as the executor does.
    return {"backend": "gloo", "device": "cuda", "host_staged": True, "timer": "cuda-events", "gpus": gpus}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(op: str, sizes: Iterable[int], world_size: int, device: str, plan: tuple[int, int, float],
             progress: Progress | None, timeout_s: float) -> LinkPoints:
    import torch.multiprocessing as mp

    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] <= 0:
        raise ValueError("sizes must be a non-empty list of byte counts > 0")
    if op == "allreduce":
        sizes = sorted({max(4, s - s % 4) for s in sizes})
    repeats, warmup, min_time_s = plan
    if repeats < 1 or warmup < 0 or min_time_s < 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0, min_time_s >= 0 (got {repeats}, {warmup}, {min_time_s})")
    transport = _transport(device, world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(rank, world_size, port, op, sizes, transport, plan, timeout_s, results))
             for rank in range(world_size)]
    what = f"{op} link measurement ({transport['backend']}, {world_size} ranks)"
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        for p in procs:
            p.start()
        while True:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise LinkError(f"{what} timed out after {timeout_s:g} s") from None
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise LinkError(f"{what}: rank {failed[0][0]} exited with code {failed[0][1]}") from None
                if all(p.exitcode == 0 for p in procs):
                    raise LinkError(f"{what}: ranks exited without a result") from None
                continue
            if msg[0] == "progress":
                if progress is not None:
                    progress(msg[1], msg[2])
            elif msg[0] == "error":
                raise LinkError(f"{what}: rank {msg[1]}: {msg[2]}")
            else:
                samples = msg[1]
                finished = True
                break
    finally:
        for p in procs:  # ranks that finished get a moment to leave the group; stuck ones are killed at once
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if finished else 0.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()

    points = []
    for nbytes, ms in zip(sizes, samples):
        q1, med, q3 = np.percentile(ms, [25, 50, 75])
        points.append(LinkPoint(nbytes, float(med), float(q3 - q1)))
    meta = {"op": op, "world_size": world_size, "repeats": repeats, "warmup": warmup, "min_time_s": min_time_s,
            "samples": [len(ms) for ms in samples], **transport}
    return LinkPoints(points, meta)


def _worker(rank: int, world_size: int, port: int, op: str, sizes: list[int], transport: dict[str, Any],
            plan: tuple[int, int, float], timeout_s: float, results: Any) -> None:
    """One rank: join the group, time every size, and (rank 0) report progress and per-repeat times in ms."""
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)  # ranks share the machine's cores with each other and the transport's threads
        cuda = transport["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(transport["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        dtype = torch.uint8 if op == "p2p" else torch.float32
        numel = sizes[-1] // dtype.itemsize
        dev = torch.device("cuda") if cuda else torch.device("cpu")
        buf = torch.ones(numel, dtype=dtype, device=dev)
        host = torch.empty(numel, dtype=dtype, pin_memory=True) if transport["host_staged"] else None
        if rank == 0:
            results.put(("progress", 0, plan[0]))  # the group is up: startup is over

        def staged(fn: Callable[[torch.Tensor], Any], t: torch.Tensor) -> None:
            if host is None:
                fn(t)
                return
            h = host[: t.numel()]
            h.copy_(t)
            fn(h)
            t.copy_(h)

        def p2p(t: torch.Tensor) -> None:
            if rank == 0:
                staged(lambda h: dist.send(h, 1), t)
                staged(lambda h: dist.recv(h, 1), t)
            else:
                staged(lambda h: dist.recv(h, 0), t)
                staged(lambda h: dist.send(h, 0), t)

        def allreduce(t: torch.Tensor) -> None:
            staged(dist.all_reduce, t)

        def timed_ms(fn: Callable[[], Any]) -> float:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                return start.elapsed_time(end)
            t0 = time.perf_counter_ns()
            fn()
            return (time.perf_counter_ns() - t0) / 1e6

        def step_for(nbytes: int) -> Callable[[], None]:
            t = buf[: nbytes // dtype.itemsize]
            return (lambda: p2p(t)) if op == "p2p" else (lambda: allreduce(t))

        def before_batch() -> None:  # all-reduce ranks start each batch together, then pace each other
            if op == "allreduce":
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()

        repeats, warmup, min_time_s = plan
        comm_dev = dev if transport["backend"] == "nccl" else torch.device("cpu")
        steps = [step_for(n) for n in sizes]
        # Warm-up pass; its times tell rank 0 how often a round repeats each size so that the size runs at
        # least `repeats` times and for about min_time_s in all. Every rank must run the same count.
        per_round = torch.ones(len(sizes), dtype=torch.int64, device=comm_dev)
        for i, step in enumerate(steps):
            before_batch()
            warm_ms = sorted(timed_ms(step) for _ in range(max(warmup, 1)))[max(warmup, 1) // 2]
            per_round[i] = math.ceil(min_time_s * 1e3 / max(warm_ms, 1e-3) / repeats)
        dist.broadcast(per_round, 0)
        counts = [max(1, int(c)) for c in per_round.tolist()]

        # Rounds visit every size in turn, so each size's samples span the whole run and a slow spell of the
        # machine (timer-tick wake-ups on a busy VM) spreads over all sizes instead of bending the curve.
        # Rounds go up then down the sizes: a size follows a neighbour, never 4 KiB straight after 64 MiB.
        samples: list[list[float]] = [[] for _ in sizes]
        for done in range(1, repeats + 1):
            order = range(len(sizes)) if done % 2 else range(len(sizes) - 1, -1, -1)
            for i in order:
                step = steps[i]
                before_batch()
                samples[i] += [timed_ms(step) for _ in range(counts[i])]
            if rank == 0:
                results.put(("progress", done, repeats))
        if op == "p2p":  # a round trip is two one-way transfers
            samples = [[ms / 2 for ms in times] for times in samples]
        else:  # a repeat lasts as long as its slowest rank
            flat = torch.tensor([ms for times in samples for ms in times], dtype=torch.float64, device=comm_dev)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            slowest = iter(flat.tolist())
            samples = [[next(slowest) for _ in times] for times in samples]
        if rank == 0:
            results.put(("done", samples))
    except Exception as exc:  # noqa: BLE001 - any failure becomes one line for the parent's LinkError
        results.put(("error", rank, (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
