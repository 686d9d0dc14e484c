"""Measure the links between ranks on this machine: point-to-point, all-reduce and all-to-all times per message
size.

Point-to-point runs through the executor's own transports (workload/transport.py: gloo on CPU, NCCL with one
GPU per rank, host-staged gloo when ranks share a GPU), so a profile prices what the executor pays per message,
receive buffer included. The all-reduce and the all-to-all (`all_to_all_single`, the call expert parallelism's
exchange makes: workload/moe.py) run on the default process group, staged through the host when ranks share a
GPU. `profiles.linkfit` fits the points.
"""

from __future__ import annotations

import math
import queue as queue_mod
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..profiles.linkfit import LinkPoint, LinkPoints
from ..workload.processes import rank_context, rank_process, start_processes
from ..workload.transport import (
    Rendezvous,
    TransportChoice,
    TransportError,
    choose_transport,
    connect,
    served_rendezvous,
)

Progress = Callable[[int, int], Any]
LINK_THREADS = 1  # ranks share the machine's cores with each other and the transport's threads
# `measure_allreduce_beside_compute`'s all-reduce beside computing ranks: each computing rank multiplies a
# (rows x width) by a (width x width) float32 matrix on its LINK_THREADS until the all-reduce completes (a rank's
# passes keep a core as busy), and each count of computing ranks is timed this many times a round
BESIDE_COMPUTE = {"rows": 32, "width": 512, "per_round": 3}


class LinkError(RuntimeError):
    """A link measurement that failed or did not finish in time; the message is one line saying which."""


Plan = tuple[int, int, float]  # repeats, warmup, min_time_s


def measure_p2p(sizes: Iterable[int], *, device: str = "cpu", repeats: int = 20, warmup: int = 3,
                progress: Progress | None = None, min_time_s: float = 0.15, timeout_s: float = 120.0) -> LinkPoints:
    """One-way point-to-point time per size between two ranks on this machine (ping-pong round trip / 2).

    `repeats` rounds each visit every size; a size runs at least once a round and, if cheap, more often, for
    about `min_time_s` in all: waking a blocked rank sometimes costs milliseconds (a timer tick on a busy VM),
    so small messages need many samples for a steady median. `progress(done, total)` follows the rounds
    (done=0 once the ranks are up). A failure, or a run past `timeout_s`, raises LinkError with the ranks ended.
    """
    return _measure([("p2p", sizes, (repeats, warmup, min_time_s), progress)], 2, device, timeout_s)[0]


def measure_allreduce(sizes: Iterable[int], *, world_size: int = 2, device: str = "cpu", repeats: int = 10,
                      warmup: int = 2, progress: Progress | None = None, min_time_s: float = 0.15,
                      timeout_s: float = 120.0) -> LinkPoints:
    """Sum all-reduce time per size over `world_size` ranks, float32 like gradients (sizes round down to a
    multiple of 4 bytes). Back-to-back collectives after one barrier, so ranks pace each other as in
    data-parallel training; each repeat counts as long as its slowest rank. Other arguments as measure_p2p.
    """
    if world_size < 2:
        raise ValueError(f"an all-reduce needs world_size >= 2 (got {world_size})")
    return _measure([("allreduce", sizes, (repeats, warmup, min_time_s), progress)], world_size, device,
                    timeout_s)[0]


def measure_p2p_and_allreduce(sizes: Iterable[int], *, device: str = "cpu", repeats: int = 10, warmup: int = 2,
                              progress: tuple[Progress | None, Progress | None] = (None, None),
                              min_time_s: float = 0.15, timeout_s: float = 120.0) -> tuple[LinkPoints, LinkPoints]:
    """`measure_p2p` then `measure_allreduce` over two ranks with these settings, in the same two ranks one
    after the other: one start-up (spawning, importing torch, joining the group) for both. `progress` follows
    each; `timeout_s` is each one's."""
    plan = (repeats, warmup, min_time_s)
    p2p, reduced = _measure([("p2p", sizes, plan, progress[0]), ("allreduce", sizes, plan, progress[1])], 2, device,
                            2 * timeout_s)
    return p2p, reduced


def measure_allreduce_beside_compute(nbytes: int, *, repeats: int = 10, warmup: int = 2,
                                     timeout_s: float = 120.0) -> dict[str, Any]:
    """On a CPU host, two ranks time an all-reduce of `nbytes` (a calibration gives its largest stage's gradients,
    the all-reduce a REDUCE row makes) beside k = 0, 1, 2 of them computing (`BESIDE_COMPUTE`), from its issue to
    its completion, the k alternating within each of `repeats` rounds: gloo's threads reduce and send on the cores
    the ranks compute on. What the all-reduce's meta records of it: `beside_compute` (per k, its median over
    k = 0's, never below the one for fewer computing, as the contention factors (`contention.slowdowns`)),
    `beside_compute_points` (per k, its time) and `beside_compute_workload`."""
    from .contention import slowdowns  # here: that module imports this one (through measure.py)

    points = _measure([("beside", [nbytes], (repeats, warmup, 0.0), None)], 2, "cpu", timeout_s)[0]
    alone_ms = max(points[0].ms, 1e-6)
    return {"beside_compute": [round(f, 4) for f in slowdowns([point.ms / alone_ms for point in points])],
            "beside_compute_points": [asdict(point) for point in points],
            "beside_compute_workload": {"bytes": points[0].nbytes, **BESIDE_COMPUTE, "threads": LINK_THREADS}}


def measure_all_to_all(sizes: Iterable[int], *, world_size: int = 2, device: str = "cpu", repeats: int = 10,
                       warmup: int = 2, progress: Progress | None = None, min_time_s: float = 0.15,
                       timeout_s: float = 120.0) -> LinkPoints:
    """All-to-all time per size over `world_size` ranks: each rank's buffer of that many bytes (rounded down to a
    multiple of `world_size`) split evenly among the ranks, as an expert-parallel group's dispatch sends a rank's
    token copies. Paced and counted as `measure_allreduce`'s collectives; other arguments as measure_p2p."""
    if world_size < 2:
        raise ValueError(f"an all-to-all needs world_size >= 2 (got {world_size})")
    return _measure([("alltoall", sizes, (repeats, warmup, min_time_s), progress)], world_size, device,
                    timeout_s)[0]


# An op to time in the ranks: its name ("p2p", "allreduce", "alltoall", or "beside": an all-reduce beside computing
# ranks, `_time_beside`), sizes, plan and progress callback.
Job = tuple[str, Iterable[int], Plan, Progress | None]


def _measure(jobs: list[Job], world_size: int, device: str, timeout_s: float) -> list[LinkPoints]:
    """Each job's points, timed in turn in the same `world_size` spawned ranks."""
    plans = []
    for op, sizes, plan, _ in jobs:
        sizes = sorted({int(s) for s in sizes})
        if not sizes or sizes[0] <= 0:
            raise ValueError("sizes must be a non-empty list of byte counts > 0")
        if op in ("allreduce", "beside"):
            sizes = sorted({max(4, s - s % 4) for s in sizes})
        elif op == "alltoall":  # an even split among the ranks
            sizes = sorted({max(world_size, s - s % world_size) for s in sizes})
        repeats, warmup, min_time_s = plan
        if repeats < 1 or warmup < 0 or min_time_s < 0:
            raise ValueError(f"need repeats >= 1, warmup >= 0, min_time_s >= 0 (got {repeats}, {warmup}, "
                             f"{min_time_s})")
        plans.append((op, sizes, plan))
    try:
        choice = choose_transport(device, world_size)
    except TransportError as exc:
        raise LinkError(str(exc)) from None
    ctx = rank_context()
    results = ctx.Queue()
    with served_rendezvous() as rendezvous:  # held from the port's choice until the ranks are gone
        procs = [rank_process(ctx, _worker, (rank, world_size, rendezvous, plans, choice, timeout_s, results),
                              f"pipesim-link-{rank}", LINK_THREADS) for rank in range(world_size)]
        what = f"{' and '.join(op for op, _, _ in plans)} link measurement ({choice.kind}, {world_size} ranks)"
        deadline = time.monotonic() + timeout_s
        samples: dict[int, list[list[float]]] = {}
        try:
            start_processes(procs, LINK_THREADS)
            while len(samples) < len(plans):
                if time.monotonic() > deadline:  # before reading: a rank's own timeout error queued late is this one
                    raise LinkError(f"{what} timed out after {timeout_s:g} s")
                try:
                    msg = results.get(timeout=0.2)
                except queue_mod.Empty:
                    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if failed:
                        raise LinkError(f"{what}: rank {failed[0][0]} exited with code {failed[0][1]}") from None
                    if all(p.exitcode == 0 for p in procs):
                        raise LinkError(f"{what}: ranks exited without a result") from None
                    continue
                if msg[0] == "progress":
                    progress = jobs[msg[1]][3]
                    if progress is not None:
                        progress(msg[2], msg[3])
                elif msg[0] == "error":
                    raise LinkError(f"{what}: rank {msg[1]}: {msg[2]}")
                else:
                    samples[msg[1]] = msg[2]
        finally:
            finished = len(samples) == len(plans)
            for p in procs:  # ranks that finished get a moment to leave the group; stuck ones are killed at once
                if p.pid is None:  # never started
                    continue
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if finished else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()

    measured = []
    for index, (op, sizes, (repeats, warmup, min_time_s)) in enumerate(plans):
        points = []
        if op == "beside":  # a point per count of computing ranks, all of one size
            sizes = sizes * len(samples[index])
        for nbytes, ms in zip(sizes, samples[index]):
            q1, med, q3 = np.percentile(ms, [25, 50, 75])
            points.append(LinkPoint(nbytes, float(med), float(q3 - q1)))
        meta = {"op": op, "world_size": world_size, "repeats": repeats, "warmup": warmup, "min_time_s": min_time_s,
                "samples": [len(ms) for ms in samples[index]], **choice.meta()}
        measured.append(LinkPoints(points, meta))
    return measured


def _worker(rank: int, world_size: int, rendezvous: Rendezvous, plans: list[tuple[str, list[int], Plan]],
            choice: TransportChoice, timeout_s: float, results: Any) -> None:
    """One rank: join the group, then per op time every size, and (rank 0) report progress and per-repeat times
    in ms."""
    transport = None
    try:
        torch.set_num_threads(LINK_THREADS)
        # The all-reduce needs only the default group: no point-to-point edges for it.
        transport = connect(choice, rank, world_size, rendezvous=rendezvous, timeout_s=timeout_s,
                            edges=None if any(op == "p2p" for op, _, _ in plans) else ())
        for index, (op, sizes, plan) in enumerate(plans):
            if rank == 0:
                results.put(("progress", index, 0, plan[0]))  # the group is up: startup is over
            samples = _time_beside(rank, world_size, sizes[0], plan) if op == "beside" else _time_sizes(
                rank, op, sizes, plan, choice, transport,
                lambda done, total, index=index: results.put(("progress", index, done, total)))
            if rank == 0:
                results.put(("done", index, samples))
    except Exception as exc:  # noqa: BLE001 - any failure becomes one line for the parent's LinkError
        results.put(("error", rank, (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0]))
    finally:
        if transport is not None:
            transport.close()
        if dist.is_initialized():  # the transport failed to open after creating the group
            dist.destroy_process_group()


def _time_sizes(rank: int, op: str, sizes: list[int], plan: Plan, choice: TransportChoice, transport: Any,
                progress: Progress) -> list[list[float]]:
    """Per size, this rank's times (ms) of `op` in `plan`'s rounds; rank 0 reports each round to `progress`."""
    cuda = choice.device == "cuda"
    dtype = torch.float32 if op == "allreduce" else torch.uint8
    numel = sizes[-1] // dtype.itemsize
    buf = torch.ones(numel, dtype=dtype, device=transport.device)
    host = torch.empty(numel, dtype=dtype, pin_memory=True) if choice.host_staged and op != "p2p" else None
    received = torch.empty_like(buf) if op == "alltoall" else None
    host_received = torch.empty_like(host) if host is not None and op == "alltoall" else None

    def p2p(t: torch.Tensor) -> None:
        """A ping-pong: each message is sent, then received. A send is not waited on, as the executor
        does not: the peer's answer comes after it arrived, and the transport lets go of it meanwhile."""
        peer = 1 - rank
        if rank == 0:
            transport.send(t, peer)
            transport.recv(t.shape, t.dtype, peer).wait()
        else:
            transport.recv(t.shape, t.dtype, peer).wait()
            transport.send(t, peer)

    def allreduce(t: torch.Tensor) -> None:
        if host is None:
            dist.all_reduce(t)
            return
        h = host[: t.numel()]
        h.copy_(t)
        dist.all_reduce(h)
        t.copy_(h)

    def all_to_all(t: torch.Tensor) -> None:
        out = received[: t.numel()]
        if host is None:
            dist.all_to_all_single(out, t)
            return
        h, g = host[: t.numel()], host_received[: t.numel()]
        h.copy_(t)
        dist.all_to_all_single(g, h)
        out.copy_(g)

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
        return lambda: {"p2p": p2p, "allreduce": allreduce, "alltoall": all_to_all}[op](t)

    def before_batch() -> None:  # a collective's ranks start each batch together, then pace each other
        if op != "p2p":
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()

    repeats, warmup, min_time_s = plan
    comm_dev = transport.device if choice.backend == "nccl" else torch.device("cpu")
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
            progress(done, repeats)
    if op == "p2p":  # a round trip is two one-way transfers
        samples = [[ms / 2 for ms in times] for times in samples]
    else:
        samples = _slowest(samples, comm_dev)
    return samples


def _slowest(samples: list[list[float]], device: Any = "cpu") -> list[list[float]]:
    """`samples` (ms) with each replaced by the slowest rank's: a repeat lasts as long as its slowest rank."""
    flat = torch.tensor([ms for times in samples for ms in times], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    slowest = iter(flat.tolist())
    return [[next(slowest) for _ in times] for times in samples]


def _time_beside(rank: int, world_size: int, nbytes: int, plan: Plan) -> list[list[float]]:
    """Per k = 0 .. `world_size`: the times (ms, each the slowest rank's) of a float32 all-reduce of `nbytes` from
    its issue to its completion (its future's callback, as the executor's REDUCE rows time it) while ranks 0 .. k-1
    compute (`BESIDE_COMPUTE`) until it completes and the others wait in it; the k alternate within each round."""
    repeats, warmup, _ = plan
    buf = torch.ones(nbytes // 4)
    rows, width = torch.randn(BESIDE_COMPUTE["rows"], BESIDE_COMPUTE["width"]), torch.randn(
        BESIDE_COMPUTE["width"], BESIDE_COMPUTE["width"])

    def once(computing: bool) -> float:
        dist.barrier()
        began = time.perf_counter_ns()
        work = dist.all_reduce(buf, async_op=True)
        done = work.get_future().then(lambda _: time.perf_counter_ns())
        while computing and not done.done():
            torch.mm(rows, width)
        work.wait()
        return (done.wait() - began) / 1e6

    for k in list(range(world_size + 1)) * max(warmup, 1):
        once(rank < k)
    samples: list[list[float]] = [[] for _ in range(world_size + 1)]
    for _ in range(repeats * BESIDE_COMPUTE["per_round"]):
        for k, times in enumerate(samples):
            times.append(once(rank < k))
    return _slowest(samples)
