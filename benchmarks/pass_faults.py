"""What moves a calibrated pass on a CPU host: the allocator's page faults, and the other core being busy.

Calibration times a stage's forward then backward, repeated (`calibrate.passes.stage_runs`). A backward makes
each weight's gradient afresh and frees it after adding it into the mini-batch's buffer; a gradient above
glibc's mmap threshold (a Linear(1024)'s 4 MiB) may go back to the OS when freed, and the next backward faults
its pages in again, or may stay in the heap, depending on the allocator's history in that process. Per size
(those of `fidelity_sizes.py`), each in `--processes` fresh processes (each its own allocator history), with
glibc's defaults and with freed memory kept (`pipesim.allocator.keep_freed_memory`, as `pipesim simulate` keeps it;
calibration and the ranks do not yet: docs/fidelity.md, What limits it): per pass, its
median time with and without faults (the thread's minor faults) and the share of passes that faulted. Then,
with freed memory kept, the same passes' thread CPU time while the other core idles, spins in a Python loop
(no memory traffic: what any other process does to a core's sibling), or multiplies matrices (a peer rank
computing), each over idle, in rounds that alternate the three; and with the last-level cache flushed (a buffer
twice its size streamed, `calibrate.measure.eviction_buffer`) before the F, or between the F and its B, as a
peer's traffic or the rank's own other rows leave it, over back to back.

    python benchmarks/pass_faults.py                  # 4 sizes, 2 processes each way, 60 passes each
    python benchmarks/pass_faults.py --json out.json  # also the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fidelity_sizes import SIZES  # this folder's
from one_line_parser import OneLineParser, positive_int, whole_number_of  # this folder's
from rich import box
from rich.table import Table

FAULTED = 50  # minor faults in one pass that mark it as faulting (a faulting backward has hundreds)
NEIGHBOURS = ("idle", "spin", "compute")
FLUSHES = ("before F", "before B")  # where the last-level cache is flushed
PRIMING = 3  # passes untimed at the start of a process


def _neighbour(mode: str, stop: multiprocessing.synchronize.Event) -> None:
    """The other core's work until `stop`: a Python loop, or one thread multiplying matrices."""
    import torch

    torch.set_num_threads(1)
    a, w = torch.randn(512, 1024), torch.randn(1024, 1024)
    while not stop.is_set():
        if mode == "spin":
            until = time.perf_counter() + 0.01
            while time.perf_counter() < until:
                pass
        else:
            a @ w


def child(width: int, microbatch_size: int, passes: int, neighbours: bool, kept: bool) -> dict:
    """Stage 0's F and B of mlp 8 x `width` cut in two, `passes` times: per pass (wall ms, CPU ms, faults);
    with `neighbours`, per neighbour mode and per place of a cache flush instead. `kept`: freed memory kept."""
    import torch

    from pipesim.allocator import keep_freed_memory
    from pipesim.calibrate.measure import DTYPES, eviction_buffer, place
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    if kept:
        keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("mlp", layers=8, width=width)
    place(model, torch.device("cpu"), DTYPES["float32"])
    run = stage_runs(model, [0, 4, 9], "float32", microbatch_size)[0]
    run.into = [None] * len(run.weights)

    def timed(work, *args) -> tuple[object, list[float]]:
        faults, cpu, wall = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time_ns(),
                             time.perf_counter_ns())
        out = work(*args)
        return out, [(time.perf_counter_ns() - wall) / 1e6, (time.thread_time_ns() - cpu) / 1e6,
                     resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults]

    flush = eviction_buffer(torch.device("cpu"))

    def one(flushed: str | None = None) -> dict[str, list[float]]:
        if flushed == "before F":
            flush.add_(1.0)
        saved, forward = timed(run.forward)
        if flushed == "before B":
            flush.add_(1.0)
        _, backward = timed(run.backward, saved)
        return {"F": forward, "B": backward}

    for _ in range(PRIMING):
        one()
    if not neighbours:
        samples = [one() for _ in range(passes)]
        return {kind: [s[kind] for s in samples] for kind in ("F", "B")}
    context = multiprocessing.get_context("fork")
    found: dict[str, dict[str, list]] = {mode: {"F": [], "B": []} for mode in (*NEIGHBOURS, *FLUSHES)}
    rounds = max(1, passes // 10)
    for _ in range(rounds):
        for mode in NEIGHBOURS:
            stop = context.Event()
            other = context.Process(target=_neighbour, args=(mode, stop)) if mode != "idle" else None
            if other is not None:
                other.start()
                time.sleep(0.05)
            for _ in range(10):
                for kind, sample in one().items():
                    found[mode][kind].append(sample)
            stop.set()
            if other is not None:
                other.join()
        for flushed in FLUSHES:
            for _ in range(10):
                for kind, sample in one(flushed).items():
                    found[flushed][kind].append(sample)
    return found


def in_process(width: int, microbatch_size: int, passes: int, neighbours: bool, kept: bool) -> dict:
    """`child` in a fresh process (its own allocator history), freed memory kept where `kept`."""
    command = [sys.executable, __file__, "--child", str(width), str(microbatch_size), str(passes),
               *(["--neighbours"] if neighbours else []), *(["--kept"] if kept else [])]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def fault_summary(samples: list[list[float]]) -> dict:
    """Median ms without and with faults, the share that faulted, and the faulting passes' median pages."""
    a = np.asarray(samples, dtype=float)
    clean, faulting = a[a[:, 2] < FAULTED], a[a[:, 2] >= FAULTED]
    return {"median_ms": float(np.median(a[:, 0])),
            "median_ms_without_faults": float(np.median(clean[:, 0])) if len(clean) else None,
            "median_ms_faulting": float(np.median(faulting[:, 0])) if len(faulting) else None,
            "faulting_share": len(faulting) / len(a),
            "pages_faulting": int(np.median(faulting[:, 2])) if len(faulting) else 0}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=positive_int, default=2,
                        help="fresh processes per size and allocator setting")
    parser.add_argument("--passes", type=whole_number_of(10), default=60, help="timed passes per process")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--neighbours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kept", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.neighbours, args.kept)))
        return
    # not in a child: its allocator's history
    from pipesim.commands.common import refuse_unwritable, stdout, write_json
    from pipesim.commands.tables import print_paragraph, print_table

    refuse_unwritable(("--json", args.json))
    console = stdout  # the terminal's width, its tables fitted there (commands/tables.py); piped, whole rows
    faults = Table(title="stage 0's passes as calibration times them, per fresh process: ms without / with page "
                   "faults, share of passes faulting", title_justify="left", box=box.SIMPLE_HEAD)
    for header in ("size", "allocator", "pass", "without faults ms", "faulting ms", "pages", "share faulting"):
        faults.add_column(header, justify="left" if header in ("size", "allocator", "pass") else "right")
    busy = Table(title="the same passes' thread CPU time with the other core busy, or the cache flushed, over idle "
                       "and back to back (freed memory kept)",
                 title_justify="left", box=box.SIMPLE_HEAD)
    for header in ("size", "pass", "idle ms", "other core spinning", "other core computing", "cache flushed before F",
                   "before B"):
        busy.add_column(header, justify="left" if header in ("size", "pass") else "right")
    out: dict = {"load_average": [os.getloadavg()[0]], "cpus": os.cpu_count(), "sizes": {}}
    for size in SIZES:
        console.print(f"{size.key}: passes in {2 * args.processes} processes, then with the other core busy",
                      style="dim", highlight=False)
        found = {name: [in_process(size.width, size.microbatch_size, args.passes, False, kept)
                        for _ in range(args.processes)] for name, kept in (("default", False), ("kept", True))}
        record = {name: {kind: [fault_summary(p[kind]) for p in procs] for kind in ("F", "B")}
                  for name, procs in found.items()}
        for name in found:
            for kind in ("F", "B"):
                rows = record[name][kind]
                faults.add_row(f"{size.label} ({size.key})", name, kind,
                               " / ".join(_ms(r["median_ms_without_faults"]) for r in rows),
                               " / ".join(_ms(r["median_ms_faulting"]) for r in rows),
                               " / ".join(str(r["pages_faulting"]) for r in rows),
                               " / ".join(f"{r['faulting_share']:.0%}" for r in rows))
        near = in_process(size.width, size.microbatch_size, args.passes, True, True)
        cpu = {mode: {kind: float(np.median([s[1] for s in near[mode][kind]])) for kind in ("F", "B")}
               for mode in (*NEIGHBOURS, *FLUSHES)}
        for kind in ("F", "B"):
            idle = cpu["idle"][kind]
            busy.add_row(f"{size.label} ({size.key})", kind, f"{idle:.3f}",
                         *(f"{cpu[mode][kind] / idle:.3f}x" for mode in (*NEIGHBOURS[1:], *FLUSHES)))
        out["sizes"][size.key] = {"passes": record, "neighbour_cpu_ms": cpu}
    out["load_average"].append(os.getloadavg()[0])
    print_table(faults, console, keys=3)  # a row: its size, allocator and pass
    print_table(busy, console, keys=2)  # a row: its size and pass
    print_paragraph(f"the host's load average ran {min(out['load_average']):.1f}-{max(out['load_average']):.1f} on "
                    f"{out['cpus']} cores", console)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
