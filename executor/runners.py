"""Running a schedule for real: ranks as threads of this process (tests), or as processes on this machine
over gloo; and the measured trace both give.

Both runners check the schedule first (`preflight` with the deadlock dry run, and the per-channel transfer
order), build the same setup on every rank (the model from one seed, cut into the schedule's stages), run one
`DeviceLoop` per device and merge what each device reports into one `RunResult`.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..schedules import KINDS, check_transfer_order, lower, preflight
from ..schedules.ir import ScheduleError
from ..traces.trace import Counter, Ops, Stream, Trace, TraceMeta
from ..workload.transport import GlooTransport, InProcessTransport
from .runtime import DeviceLoop, DeviceResult
from .stages import ExecutorError, RunSpec, cut

_STREAM_OF_KIND = Stream.of_kinds(tuple(k.value for k in KINDS))


@dataclass
class RunResult:
    """A finished run: the measured trace, the loss per mini-batch (per pipeline), and every stage replica's
    final weights keyed by (stage, pipeline), in the stage module's parameter order."""

    trace: Trace
    losses: list[list[float]]  # [pipeline][mini-batch]
    weights: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)


def _lowered(spec: RunSpec):
    try:
        preflight(spec.schedule, dry_run=True)
        lowered = lower(spec.schedule)
        check_transfer_order(lowered)
    except ScheduleError as exc:
        raise ExecutorError(str(exc)) from None
    return lowered


def run_in_process(spec: RunSpec) -> RunResult:
    """Every device a thread of this process, over the in-process transport. The setups are built one after
    another here (model construction draws from torch's global generator), then the threads run."""
    lowered = _lowered(spec)
    devices = spec.schedule.num_devices
    transports = InProcessTransport.connected(devices, timeout_s=spec.timeout_s)
    loops = [DeviceLoop(spec, lowered, cut(spec), d, transports[d]) for d in range(devices)]
    results: list[DeviceResult | None] = [None] * devices
    errors: list[str] = []

    def work(d: int) -> None:
        try:
            results[d] = loops[d].run()
        except Exception as exc:  # reported by the caller, naming the device
            errors.append(f"device {d}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(d,), name=f"pipesim-device-{d}", daemon=True)
               for d in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ExecutorError("; ".join(sorted(errors)))
    return _merge(spec, lowered, results, {"backend": "in-process", "device": "cpu", "ranks": devices})


# ------------------------------------------------------------------------------------- one process per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(spec: RunSpec, rank: int, world: int, init_method: str, out: Any) -> None:
    """One rank of `run_multiprocess` (a spawned process): run the device, put (rank, result or error)."""
    try:
        torch.set_num_threads(spec.threads_per_rank)
        lowered = _lowered(spec)
        stages = cut(spec)
        links = [(c.src_device, c.dst_device, i) for i, c in enumerate(lowered.channels)]
        with GlooTransport(rank, world, init_method=init_method, timeout_s=spec.timeout_s,
                           edges=links) as transport:
            result = DeviceLoop(spec, lowered, stages, rank, transport).run()
        out.put((rank, result, None))
    except BaseException as exc:
        out.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))


def run_multiprocess(spec: RunSpec, *, timeout_s: float | None = None) -> RunResult:
    """One spawned process per device on this machine, over gloo (CPU). `timeout_s` bounds the whole run
    (default: the spec's timeout times the number of rows of the busiest device, generously)."""
    lowered = _lowered(spec)
    cut(spec)  # fail here, in one line, on a model the schedule cannot be cut into
    world = spec.schedule.num_devices
    context = torch.multiprocessing.get_context("spawn")
    results_queue = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(spec.threads_per_rank)
    try:
        procs = [context.Process(target=_rank_main, args=(spec, rank, world, init_method, results_queue),
                                 name=f"pipesim-rank-{rank}") for rank in range(world)]
        for proc in procs:
            proc.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    results: list[DeviceResult | None] = [None] * world
    limit = timeout_s if timeout_s is not None else spec.timeout_s * 4
    try:
        for _ in range(world):
            try:
                rank, result, error = results_queue.get(timeout=limit)
            except queue.Empty:
                missing = [r for r in range(world) if results[r] is None]
                raise ExecutorError(f"ranks {missing} did not finish within {limit:g} s") from None
            if error is not None:
                raise ExecutorError(f"rank {rank} failed: {error.splitlines()[0]}")
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return _merge(spec, lowered, results, {"backend": "gloo", "device": "cpu", "ranks": world,
                                           "threads_per_rank": spec.threads_per_rank})


# ---------------------------------------------------------------------------------------------- the trace


def _merge(spec: RunSpec, lowered: Any, results: list[DeviceResult | None], hardware: dict[str, Any]) -> RunResult:
    """One measured trace from every device's rows (ranks on one host share the monotonic clock)."""
    schedule = lowered.schedule
    done = [r for r in results if r is not None]
    if len(done) != schedule.num_devices:
        raise ExecutorError("a device reported nothing")
    start_ns = np.concatenate([r.start_ns for r in results])
    end_ns = np.concatenate([r.end_ns for r in results])
    t0 = int(start_ns.min()) if len(start_ns) else 0
    t = lowered.table
    ops = Ops(device=t.device, stream=_STREAM_OF_KIND[t.kind], kind=t.kind, stage=t.stage, microbatch=t.microbatch,
              minibatch=t.minibatch, pipeline=t.pipeline, peer=t.peer, version=lowered.version,
              prediction=lowered.prediction, start_us=(start_ns - t0) / 1e3, dur_us=(end_ns - start_ns) / 1e3)
    held = np.concatenate([r.held for r in results])
    base = 1 + schedule.policy.extra_copies
    counters = {"weight_versions": [
        Counter(np.concatenate([[0.0], (end_ns[rows] - t0) / 1e3]), np.concatenate([[base], held[rows]]))
        for rows in (lowered.rows(d) for d in range(schedule.num_devices))]}
    losses_by = {key: value for r in results for key, value in r.losses.items()}
    losses = [[losses_by.get((p, b), float("nan")) for b in range(schedule.minibatches)]
              for p in range(schedule.pipelines)]
    meta = TraceMeta(
        source="measured", schedule=schedule.method, params=dict(schedule.params),
        microbatches=schedule.microbatches, minibatches=schedule.minibatches, pipelines=schedule.pipelines,
        microbatch_size=spec.microbatch_size, placement=list(schedule.placement),
        stage_edges=[list(e) for e in schedule.graph.edges], policy=schedule.policy.describe(),
        tool=f"pipesim {__version__}", hardware=hardware, seed=spec.seed,
        extra={"losses": losses, "optimizer": spec.optimizer, "lr": spec.lr, "dtype": spec.dtype,
               "model": spec.model if isinstance(spec.model, str) else getattr(spec.model, "__name__", "custom")})
    weights = {key: [torch.from_numpy(w) for w in ws] for r in results for key, ws in r.weights.items()}
    return RunResult(Trace(tuple(k.value for k in KINDS), schedule.num_devices, ops, meta, counters), losses, weights)
