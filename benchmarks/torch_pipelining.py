"""Run a pipesim schedule under torch.distributed.pipelining's own runtime and record torch.profiler traces,
one per rank, that `pipesim compare DIR PREDICTED.json` holds against pipesim's prediction.

The model, its partition and every micro-batch are pipesim's (`executor.cut`, `executor.microbatch_data`), so
the two runtimes train the same thing. A synchronous pipesim schedule is handed to torch as its schedule CSV
(`pipesim export --format torch-csv`) and run by `_PipelineScheduleRuntime`, which wraps every action in a
`PP:<action>` profiler range; `--torch-schedule gpipe` (1f1b, interleaved-zb, zbv, dualpipev) uses torch's own
`ScheduleGPipe` (and so on) instead, on the stages the pipesim schedule places on each rank (zbv: `--schedule zb-v`).
Each stage's optimizer step is wrapped in `PP:<stage>OPT`. Gloo on CPU, one process per rank.

A prediction holds for the model, cut, micro-batch size and threads its profile measured, so calibrate first
and hand the profile to this script too: it then runs exactly what the profile describes. Calibrate the stages'
passes as torch's stage computes them (`--passes-as torch`, which leaves out pipesim's own runtime's per-row
costs too: they describe pipesim's executor, not torch's):

    pipesim calibrate --model mlp --layers 8 --width 1024 -b 32 -p 2 --threads 1 --device cpu --passes-as torch \
        --out torch-mlp.json
    python benchmarks/torch_pipelining.py --profile torch-mlp.json --schedule 1f1b --microbatches 8 --steps 3 \
        --out torch-run/
    pipesim simulate -s 1f1b -m 8 -n 3 --profile torch-mlp.json --optimizer sgd --trace predicted.json
    pipesim compare torch-run/ predicted.json

Without --profile it prints the calibrate command matching its flags.

Recording without this script: wrap the training loop in `torch.profiler.profile(activities=[ProfilerActivity.CPU],
on_trace_ready=torch.profiler.tensorboard_trace_handler(DIR))` on every rank (add CUDA on GPUs), and wrap
`optimizer.step()` in `torch.profiler.record_function(f"PP:{stage}OPT")` to time the updates.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from one_line_parser import OneLineParser, whole_number_of  # this folder's
from rich.console import Console

from pipesim.commands.common import stdout
from pipesim.commands.tables import print_message
from pipesim.executor import RunSpec, Stages, cut, microbatch_data
from pipesim.planning.torch_profile import events_read
from pipesim.schedules import build_schedule
from pipesim.schedules.catalogue import method_named
from pipesim.schedules.ir import Schedule, ScheduleError
from pipesim.schedules.torch_csv import to_torch_csv
from pipesim.workload.optim import make_optimizer
from pipesim.workload.transport import Rendezvous, served_rendezvous


def _prune(path: Path) -> None:
    """Keep only what pipesim reads (planning/torch_profile.py's `events_read`): the pipelining ranges, the rank,
    and inside each range the events that tell an F's or B's wait for its receive and an overlapped pair's forward
    from its backward; the full trace records every aten op."""
    doc = json.loads(path.read_text())
    doc["traceEvents"] = events_read(doc.get("traceEvents", []))
    path.write_text(json.dumps(doc))


# pipesim's order via torch's CSV runtime, or one of torch's own schedule classes (with the stages pipesim's
# --schedule places on each rank: one for gpipe and 1f1b, two or more for the rest, which split B into I and W)
RUNTIMES = {"csv": "_PipelineScheduleRuntime", "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
            "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
            "dualpipev": "ScheduleDualPipeV"}


def stage_example(spec: RunSpec, stages: Stages, stage: int) -> torch.Tensor:
    """The input stage `stage` is built with, laid out as the micro-batches torch's runtime hands it (views of
    one contiguous mini-batch), since the stage checks their strides against it: a gpt's token ids are a slice of
    seq_len + 1 tokens, which failed every run ("stride mismatch: (129, 1) vs (128, 1)")."""
    if stage == 0:
        return microbatch_data(spec, stages.model, 0, 0)[0].contiguous()
    edge = (stage - 1, stage)
    return torch.zeros(stages.edge_shapes[edge], dtype=stages.edge_dtypes[edge])


def torch_steps(spec: RunSpec, rank: int, runtime: str) -> Callable[[int], None]:
    """Rank `rank`'s stages of `spec`'s model (those `spec`'s schedule places on it) under torch's runtime (the
    process group must be up): returns step(b), which trains mini-batch b (`schedule.step`) and steps each stage's
    optimizer inside a `PP:<stage>OPT` range. `runtime`: "csv" runs `spec`'s schedule through
    `_PipelineScheduleRuntime`; the others torch's own schedule class of that name (`RUNTIMES`)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.profiler import record_function

    stages = cut(spec)
    mine = [k for k, device in enumerate(spec.schedule.placement) if device == rank]
    count = len(stages.modules)
    built = [PipelineStage(stages.modules[k], k, count, torch.device("cpu"),
                           input_args=stage_example(spec, stages, k)) for k in mine]
    m, loss_fn = spec.schedule.microbatches, stages.model.loss
    if runtime == "csv":
        runner = _PipelineScheduleRuntime(built, m, loss_fn=loss_fn)
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(to_torch_csv(spec.schedule))
        runner._load_csv(f.name, format="compute_only")
        os.unlink(f.name)
    elif runtime in ("gpipe", "1f1b"):
        runner = getattr(pipelining, RUNTIMES[runtime])(built[0], m, loss_fn=loss_fn)
    else:
        runner = getattr(pipelining.schedules, RUNTIMES[runtime])(built, m, loss_fn=loss_fn)
    optimizers = {k: make_optimizer(spec.optimizer, stages.modules[k].parameters(), spec.lr) for k in mine}

    def step(b: int) -> None:
        batches = [microbatch_data(spec, stages.model, b, j) for j in range(m)]
        for optimizer in optimizers.values():
            optimizer.zero_grad()
        given = [torch.cat([x for x, _ in batches])] if 0 in mine else []
        target = {"target": torch.cat([t for _, t in batches])} if count - 1 in mine else {}
        runner.step(*given, **target)
        for k, optimizer in optimizers.items():
            with record_function(f"PP:{k}OPT"):
                optimizer.step()

    return step


def _schedule(args: argparse.Namespace) -> Schedule:
    """pipesim's --schedule on --stages ranks, for --microbatches."""
    return build_schedule(args.schedule, method_named(args.schedule).params(args.stages, args.microbatches))


def placement_refusal(schedule: Schedule, runtime: str) -> str | None:
    """Why torch's `runtime` cannot run `schedule`'s stages where pipesim places them (None: it can): torch's
    classes place their own, one stage per rank (gpipe, 1f1b), looped (interleaved-zb: rank r holds r, r + p, ...)
    or in a V (zbv, dualpipev: rank r holds r and 2p - 1 - r); the CSV runs any order it can say."""
    if runtime == "csv":
        try:
            to_torch_csv(schedule)
        except ScheduleError as exc:
            return str(exc)
        return None
    p, count = len(schedule.orders), len(schedule.placement)
    looped = tuple(k % p for k in range(count))
    wanted = {"gpipe": tuple(range(p)), "1f1b": tuple(range(p)), "interleaved-zb": looped,
              "zbv": tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))}
    wanted["dualpipev"] = wanted["zbv"]
    if schedule.placement == wanted[runtime]:
        return None
    return (f"--torch-schedule {runtime}: torch's {RUNTIMES[runtime]} places stages {list(wanted[runtime])} on the "
            f"ranks, {schedule.method} places them {list(schedule.placement)}: choose a --schedule that places them "
            "as torch does")


def _rank(rank: int, args: argparse.Namespace, rendezvous: Rendezvous) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads_per_rank)
    rendezvous.join("gloo", rank, args.stages)
    spec = RunSpec(schedule=_schedule(args), model=args.model, model_options=json.loads(args.model_options),
                   microbatch_size=args.microbatch_size, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                   bounds=args.bounds)
    step = torch_steps(spec, rank, args.torch_schedule)
    for b in range(args.warmup):
        step(b)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in range(args.warmup, args.warmup + args.steps):
            step(b)
    out = Path(args.out) / f"rank{rank}.json"
    prof.export_chrome_trace(str(out))
    _prune(out)
    dist.barrier()
    dist.destroy_process_group()


def stages_a_rank(method: str) -> int:
    """How many stages pipesim's `method` places on each rank: its chunks (two for a V or interleaved one)."""
    return method_named(method).shape()[0]


def profile_ranks(stages: int, method: str) -> int:
    """The ranks that run a profile's `stages` under `method`: its stages over the method's stages a rank (zb-v
    on a 4-stage profile: 2). ScheduleError: a count `method` cannot place on whole ranks."""
    per_rank = stages_a_rank(method)
    if stages % per_rank:
        raise ScheduleError(f"--profile: its cut has {stages} stages, and {method} places {per_rank} a rank: "
                            f"calibrate with -p a multiple of {per_rank}, or choose another --schedule")
    return stages // per_rank


# What a profile fixes about a run: flag -> (built-in default, the profile's value under --schedule).
PROFILED = {
    "--model": ("mlp", lambda p, method: p.model.name),
    "--model-options": ('{"layers": 8, "width": 1024}', lambda p, method: json.dumps(p.model.options)),
    "--microbatch-size": (32, lambda p, method: p.environment.microbatch_size),
    "--threads-per-rank": (1, lambda p, method: p.environment.threads),
    "--stages": (2, lambda p, method: profile_ranks(p.partition.stages, method)),
}


def _settle(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the flags a profile fixes from --profile (a flag given as well must agree with it), else from their
    defaults; the profile's cut becomes the run's (`args.bounds`; None: the even cut), on the ranks that
    --schedule places its stages on."""
    from pipesim.profiles.schema import ProfileError, load_profile

    profile = None
    if args.profile is not None:
        try:
            profile = load_profile(args.profile)
        except ProfileError as exc:
            parser.error(str(exc))
        if profile.environment.device != "cpu":
            parser.error(f"--profile: {args.profile} was measured on {profile.environment.device}; this script runs "
                         "gloo on CPU: calibrate with --device cpu")
    for flag, (default, measured) in PROFILED.items():
        name = flag[2:].replace("-", "_")
        given = getattr(args, name)
        if profile is None:
            setattr(args, name, default if given is None else given)
            continue
        try:
            value = measured(profile, args.schedule)
        except ScheduleError as exc:  # an unknown --schedule, or a cut it cannot place on whole ranks
            parser.error(str(exc))
        if given is not None and _parsed(parser, flag, given) != _parsed(parser, flag, value):
            parser.error(f"{flag} {given}: the profile {args.profile} measured {value}; drop {flag} (--profile "
                         "sets it)")
        setattr(args, name, value)
    _parsed(parser, "--model-options", args.model_options)  # fails here, not in the ranks
    args.bounds = tuple(profile.partition.bounds) if profile is not None else None
    args.passes_as = profile.environment.passes_as if profile is not None else None


def _parsed(parser: argparse.ArgumentParser, flag: str, value):
    """A flag's value as compared: --model-options as the JSON object it spells."""
    if flag != "--model-options":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        parser.error(f"--model-options: not JSON ({exc})")


def _next_steps(args: argparse.Namespace) -> str:
    """The commands that predict this run and compare it: calibrate first if no profile was given."""
    predict = (f"pipesim simulate -s {args.schedule} -p {args.stages} -m {args.microbatches} -n {args.steps} --profile "
               f"{args.profile or 'PROFILE.json'} --optimizer {args.optimizer} --trace predicted.json\n"
               f"  pipesim compare {args.out} predicted.json")
    if args.profile is not None:
        note = "" if args.passes_as == "torch" else (
            f"\nnote: {args.profile} timed its stages' passes as pipesim's executor runs them; calibrate with "
            "--passes-as torch to time them as torch's stage runs them")
        return "predict it and compare:\n  " + predict + note
    options = "".join(f" --{key.replace('_', '-')} {value}" for key, value in json.loads(args.model_options).items())
    return ("to predict it, calibrate what it ran (its stages' passes as torch's stage computes them, pipesim's own "
            "runtime costs left out), run this again with --profile PROFILE.json (the profile's cut), then predict "
            "and compare:\n"
            f"  pipesim calibrate --model {args.model}{options} -b {args.microbatch_size} "
            f"-p {args.stages * stages_a_rank(args.schedule)} "
            f"--threads {args.threads_per_rank} --device cpu --passes-as torch --out PROFILE.json\n  " + predict)


def print_written(args: argparse.Namespace, console: Console = stdout) -> None:
    """What the run wrote and the commands that predict and compare it, as the command line prints a message
    (`print_message`): on a terminal wrapped between words, where one of 80 columns broke a command inside a flag
    ("--optimizer s" over "gd"); piped, each command on one line, to copy."""
    print_message(f"wrote {args.stages} profiler traces to {args.out}; {_next_steps(args)}", console)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with what --profile fixes filled in (or the defaults)."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b",
                        help="a synchronous pipesim method: the stages it places on each rank (and with csv its order)")
    parser.add_argument("--torch-schedule", choices=RUNTIMES, default="csv",
                        help="csv: pipesim's order through torch's runtime; the others torch's own schedule class "
                             "(gpipe, 1f1b: ScheduleGPipe, Schedule1F1B, which records no per-action ranges; "
                             "interleaved-zb, zbv, dualpipev: ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
                             "ScheduleDualPipeV, which split B into I and W) on the stages --schedule places")
    parser.add_argument("--profile", help="a CPU profile from `pipesim calibrate`: run the model, options, "
                                          "micro-batch size, threads, stages and cut it measured")
    parser.add_argument("--stages", type=whole_number_of(1), help="ranks (default 2; with --profile its stages over "
                                                                  "the stages --schedule places a rank)")
    parser.add_argument("--microbatches", type=whole_number_of(1), default=8)
    parser.add_argument("--steps", type=whole_number_of(1), default=5, help="profiled mini-batches")
    parser.add_argument("--warmup", type=whole_number_of(0), default=2, help="mini-batches run before profiling")
    parser.add_argument("--model", help="default mlp")
    parser.add_argument("--model-options", help='JSON (default {"layers": 8, "width": 1024})')
    parser.add_argument("--microbatch-size", type=whole_number_of(1), help="default 32")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads-per-rank", type=whole_number_of(1), help="default 1")
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    args = parser.parse_args(argv)
    _settle(parser, args)
    try:
        schedule = _schedule(args)
    except ScheduleError as exc:  # an unknown method, or one these stages and micro-batches cannot build
        parser.error(str(exc))
    why = placement_refusal(schedule, args.torch_schedule)
    if why:
        parser.error(why)
    return args


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    # the ranks write to the terminal's stderr themselves, torch 2.13's kineto two lines a rank ("USDT: ...
    # SyncActivityProfilerHandler.cpp:52] profiler_start", "...:59] profiler_stop"): nothing passes through here
    with served_rendezvous() as rendezvous:
        mp.start_processes(_rank, args=(args, rendezvous), nprocs=args.stages, start_method="spawn")
    print_written(args)


if __name__ == "__main__":
    main()
