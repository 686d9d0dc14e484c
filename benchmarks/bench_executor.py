"""pipesim's executor against torch.distributed.pipelining on the same model, partition and micro-batches.

Both sides: the built-in mlp (default 8 Linear(1024)+ReLU blocks and a classifier), cut evenly over the
ranks by `executor.cut`, gloo on CPU, one process and one intra-op thread per rank, SGD, micro-batches from
`executor.microbatch_data`. pipesim runs `run_multiprocess`; torch runs `PipelineStage` with `ScheduleGPipe` or
`Schedule1F1B` (built by torch_pipelining.py), each rank timing `schedule.step` plus the optimizer step. A
mini-batch's time is the gap between the moments the last rank finishes it and the one before (ranks share the
host's monotonic clock), the same measure on both sides. Warm-up mini-batches are dropped; each repeat is a fresh
set of processes.
The noise floor is pipesim run twice on the same configuration: the ratio of the two medians.

    python benchmarks/bench_executor.py            # b=32, m=8, 2 ranks, 5 repeats of 2+10 mini-batches
    python benchmarks/bench_executor.py --quick    # smaller model, fewer repeats: a smoke run
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from one_line_parser import OneLineParser, positive_int  # this folder's
from torch_pipelining import torch_steps  # this folder's: torch's runtime on pipesim's stages

from pipesim.executor import RunSpec, run_multiprocess
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.units import count_text, degree_text
from pipesim.workload.transport import Rendezvous, served_rendezvous

METHODS = ("gpipe", "1f1b")  # run by torch's own ScheduleGPipe and Schedule1F1B


@dataclass(frozen=True)
class Config:
    method: str
    ranks: int
    microbatches: int
    microbatch_size: int
    layers: int
    width: int
    warmup: int
    steps: int
    lr: float = 0.01

    def spec(self) -> RunSpec:
        params = ScheduleParams(stages=self.ranks, microbatches=self.microbatches,
                                minibatches=self.warmup + self.steps)
        return RunSpec(schedule=build_schedule(self.method, params), model="mlp",
                       model_options={"layers": self.layers, "width": self.width},
                       microbatch_size=self.microbatch_size, lr=self.lr, threads_per_rank=1, timeout_s=600.0)


def _step_ms(finished_ns: np.ndarray, warmup: int) -> list[float]:
    """Per mini-batch ms from the moments each one finished, the warm-up ones dropped."""
    return list(np.diff(finished_ns.astype(np.float64))[max(warmup - 1, 0):] / 1e6)


def pipesim_steps(config: Config) -> list[float]:
    """One run of pipesim's executor; a mini-batch finishes when its last row on any device ends."""
    ops = run_multiprocess(config.spec()).trace.ops
    ends_us = ops.start_us + ops.dur_us
    finished_us = np.array([ends_us[ops.minibatch == b].max() for b in range(config.warmup + config.steps)])
    return _step_ms(finished_us * 1e3, config.warmup)




def _torch_rank(rank: int, config: Config, rendezvous: Rendezvous, out: str) -> None:
    torch.set_num_threads(1)
    rendezvous.join("gloo", rank, config.ranks)
    step = torch_steps(config.spec(), rank, config.method)
    finished_ns = []
    dist.barrier()
    for b in range(config.warmup + config.steps):
        step(b)
        finished_ns.append(time.monotonic_ns())
    Path(out, f"rank{rank}.json").write_text(json.dumps(finished_ns))
    dist.barrier()
    dist.destroy_process_group()


def torch_run(config: Config) -> list[float]:
    """One run under torch.distributed.pipelining, in its own spawned processes."""
    with tempfile.TemporaryDirectory() as out:
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            with served_rendezvous() as rendezvous:
                mp.start_processes(_torch_rank, args=(config, rendezvous, out), nprocs=config.ranks,
                                   start_method="spawn")
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(config.ranks)]
    return _step_ms(np.max(np.array(per_rank, dtype=np.int64), axis=0), config.warmup)


def _summary(samples: list[float]) -> str:
    q1, q3 = np.percentile(samples, [25, 75])
    return f"{statistics.median(samples):8.2f} [{q1:.2f}, {q3:.2f}]"


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--ranks", type=positive_int, default=2)
    parser.add_argument("--microbatches", type=positive_int, default=8)
    parser.add_argument("--microbatch-size", type=positive_int, default=32)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--width", type=positive_int, default=1024)
    parser.add_argument("--warmup", type=positive_int, default=2, help="mini-batches dropped at the start of each "
                        "run, at least 1: the first has no earlier finish to measure from")
    parser.add_argument("--steps", type=positive_int, default=10, help="mini-batches timed per run")
    parser.add_argument("--repeats", type=positive_int, default=5, help="fresh runs per side")
    parser.add_argument("--quick", action="store_true", help="width 256, 1 warm-up, 4 steps, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.warmup, args.steps, args.repeats = 256, 1, 4, 2

    print(f"mlp {args.layers}x{args.width}, {degree_text('b', args.microbatch_size)}, "
          f"{degree_text('m', args.microbatches)}, {count_text(args.ranks, 'rank')}, gloo CPU, 1 thread/rank; "
          f"{count_text(args.repeats, 'run')} x {count_text(args.steps, 'mini-batch')} after {args.warmup:,} warm-up")
    print(f"{'method':7} {'pipesim ms [IQR]':>24} {'torch ms [IQR]':>24} {'pipesim/torch':>14} {'noise':>7}")
    for method in args.methods:
        config = Config(method, args.ranks, args.microbatches, args.microbatch_size, args.layers, args.width,
                        args.warmup, args.steps)
        first: list[float] = []
        second: list[float] = []
        reference: list[float] = []
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every side
            first += pipesim_steps(config)
            reference += torch_run(config)
            second += pipesim_steps(config)
        ours = first + second
        ratio = statistics.median(ours) / statistics.median(reference)
        noise = statistics.median(first) / statistics.median(second)
        print(f"{method:7} {_summary(ours):>24} {_summary(reference):>24} {ratio:14.3f} {noise:7.3f}")


if __name__ == "__main__":
    main()
