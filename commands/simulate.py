"""`pipesim simulate`, `pipesim schedules` and `pipesim export`: schedules by name, simulated side by side,
listed, or written for torch's runtime."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from .common import (
    BlockingComm,
    HeldOptimizer,
    InputError,
    MicrobatchSize,
    WgradFraction,
    check_writable,
    fail,
    is_given,
    progress,
    scenario_from_flags,
    stdout,
)

EXAMPLE = {"stages": 4, "microbatches": 8, "minibatches": 4, "comm": "0.1", "opt": 0.1,
           "html": Path("pipesim-example.html")}


def _output_paths(path: Path, names: list[str]) -> list[Path]:
    """PATH for one schedule; PATH with `-<schedule>` before the suffix for several."""
    if len(names) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{name}{path.suffix}") for name in names]


def simulate(
    ctx: typer.Context,
    schedule: Annotated[list[str] | None, typer.Option(
        "--schedule", "-s", help="Method to simulate (repeat to compare; see `pipesim schedules`). Default: "
                                 "all.")] = None,
    schedule_file: Annotated[Path | None, typer.Option(
        "--schedule-file", help="Simulate a torch.distributed.pipelining schedule CSV (one row per rank) instead of "
                                "--schedule.")] = None,
    stages: Annotated[int, typer.Option(
        "--stages", "-p", min=1, help="Pipeline depth p: devices in one pipeline.")] = 4,
    chunks: Annotated[int | None, typer.Option(
        "--chunks", "-v", min=1, help="Model chunks per device v (interleaved / V schedules; p·v model stages). "
                                      "Default: the method's (2 for V schedules, else 1).")] = None,
    microbatches: Annotated[int, typer.Option(
        "--microbatches", "-m", min=1, help="Micro-batches per mini-batch m.")] = 8,
    minibatches: Annotated[int, typer.Option(
        "--minibatches", "-n", min=1, help="Mini-batches (optimizer steps) N.")] = 1,
    pipelines: Annotated[int | None, typer.Option(
        "--pipelines", "-P", min=1, help="Parallel pipelines P sharing the devices (avgpipe; default 2).")] = None,
    advance: Annotated[int | None, typer.Option(
        "--advance", min=0, help="avgpipe: forwards beyond 1F1B's warm-up before the first backward (0: 1F1B, >= m: "
                                 "all forwards first). Default: AvgPipe's 2(p-k)-1 forwards first.")] = None,
    average_every: Annotated[int, typer.Option(
        "--average-every", min=1, help="avgpipe: elastic averaging period in mini-batches.")] = 1,
    elastic_alpha: Annotated[float | None, typer.Option(
        "--elastic-alpha", help="avgpipe: elastic averaging coefficient (default 0.9/P).")] = None,
    graph: Annotated[Path | None, typer.Option(
        "--graph", help='graphpipe: stage DAG JSON {"stages": n, "edges": [[a, b], ...], "placement": [...]} (default: '
                        'built-in two-branch model).')] = None,
    fwd: Annotated[str, typer.Option(
        "--fwd", help="Forward ms per micro-batch: one number, or one per model stage.")] = "1",
    bwd: Annotated[str, typer.Option(
        "--bwd", help="Full backward ms per micro-batch: one number, or one per model stage.")] = "2",
    wgrad_fraction: WgradFraction = 0.5,
    opt: Annotated[float, typer.Option("--opt", min=0.0, help="Optimizer step ms per stage.")] = 0.0,
    pred: Annotated[float | None, typer.Option(
        "--pred", min=0.0, help="Weight prediction (PRED) ms per stage (default: --opt).")] = None,
    avg: Annotated[float | None, typer.Option(
        "--avg", min=0.0, help="Elastic averaging (AVG) ms per stage and pipeline: averaging P pipelines' replicas "
                               "takes P times it (default: --opt).")] = None,
    comm: Annotated[str, typer.Option(
        "--comm", help="Ms per activation or gradient transfer between devices (no contention).")] = "0",
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", help="Cluster JSON (devices, links with latency and bandwidth, shared resources); replaces "
                          "--comm.")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="Profile from `pipesim calibrate`: per-stage times, bytes and links from measurements "
                          "(replaces the cost and size flags; other stage counts re-partition its layers).")] = None,
    param_mb: Annotated[str, typer.Option(
        "--param-mb", help="Parameter MiB per model stage (one number, or one per stage).")] = "256",
    activation_mb: Annotated[str, typer.Option(
        "--activation-mb", help="Activation MiB a micro-batch saves per model stage.")] = "64",
    output_mb: Annotated[str, typer.Option(
        "--output-mb", help="MiB a stage sends to the next per micro-batch (sizes transfers on --cluster "
                            "links).")] = "8",
    optimizer: HeldOptimizer = "adam",
    microbatch_size: MicrobatchSize = 1,
    blocking_comm: BlockingComm = False,
    jitter: Annotated[float, typer.Option(
        "--jitter", min=0.0, help="Sigma of a log-normal factor on every compute time (0: none).")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for --jitter.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
    html: Annotated[Path | None, typer.Option(
        "--html", help="Write an interactive timeline (self-contained HTML).")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Write Chrome Trace Event JSON (Perfetto); -<schedule> is added for several.")] = None,
) -> None:
    """Predict timelines, bubbles, memory and staleness of schedules side by side.

    With no options: a built-in example comparing every method on a 4-stage pipeline.
    """
    example = not any(is_given(ctx, name) for name in ctx.params)
    if example:
        stages, microbatches, minibatches, comm, opt, html = (
            EXAMPLE[k] for k in ("stages", "microbatches", "minibatches", "comm", "opt", "html"))
    from ..schedules import METHODS, ScheduleError
    from ..sim import ClusterError, CostError, SimulationError
    from ..sim import simulate as run_simulation
    from ..traces import summarize, write_trace

    names = schedule or list(METHODS)
    loaded = None
    try:
        if schedule_file is not None:
            loaded = _schedule_file(ctx, schedule_file)
            names = [loaded.method]
        unknown = [n for n in schedule or () if n not in METHODS]
        if unknown:
            raise InputError(f"--schedule: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}")
        if len(set(names)) != len(names):
            raise InputError("--schedule: each method may be given once")
        for flag, option in (("--advance", "advance"), ("--average-every", "average_every"),
                             ("--elastic-alpha", "elastic_alpha"), ("--graph", "graph")):
            readers = [m.name for m in METHODS.values() if m.reads(option)]
            if is_given(ctx, option) and not set(readers) & set(names):
                raise InputError(f"{flag} applies to {', '.join(readers)} only; add --schedule {readers[0]}")
        if elastic_alpha is not None and not 0 < elastic_alpha <= 1:
            raise InputError(f"--elastic-alpha: must be in (0, 1] (got {elastic_alpha})")
        check_writable("--html", html)
        check_writable("--trace", trace)
        scenario = scenario_from_flags(ctx, "device" if example else "stage", schedule_file if loaded else None,
                                       comm=comm, opt=opt)
        if scenario.measured is not None and not is_given(ctx, "stages"):
            stages = scenario.measured.partition.stages

        def build(name: str):
            return scenario.build(name, METHODS[name].params(
                stages, microbatches, minibatches, chunks, pipelines, advance=advance, average_every=average_every,
                elastic_alpha=elastic_alpha))

        built = [loaded] if loaded else [build(name) for name in names]
        summaries, traces = [], []
        for sched in progress(built, as_json):
            result = run_simulation(sched, scenario.costs(sched), scenario.links(sched), jitter=jitter, seed=seed)
            traces.append(result)
            summaries.append(summarize(result))
        if trace is not None:
            for path, result in zip(_output_paths(trace, names), traces):
                write_trace(result, path)
        if html is not None:
            from ..traces.view import timeline_figure, write_html

            write_html([(name, timeline_figure(t)) for name, t in zip(names, traces)], html,
                       title="pipesim: " + ", ".join(names))
    except (InputError, ScheduleError, CostError, ClusterError, SimulationError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write output: {exc.filename}: {exc.strerror}")

    if as_json:
        sys.stdout.write(json.dumps({"results": [s.to_dict() for s in summaries]}, indent=2) + "\n")
        return
    _print_table(summaries, built, example)
    written = [*(_output_paths(trace, names) if trace else []), *([html] if html else [])]
    for path in written:
        stdout.print(f"wrote {path}", highlight=False)


def _schedule_file(ctx: typer.Context, path: Path):
    """The schedule a torch CSV describes. It fixes p, v and m (and is one mini-batch), so flags that set
    them would be silently ignored: refuse them instead."""
    from ..schedules.torch_csv import from_torch_csv

    if is_given(ctx, "schedule"):
        raise InputError("--schedule and --schedule-file both say what to simulate: give one")
    fixed = [f"--{name}" for name in ("stages", "chunks", "microbatches", "minibatches", "pipelines")
             if is_given(ctx, name)]
    if fixed:
        raise InputError(f"{', '.join(fixed)}: the schedule file fixes stages, chunks and micro-batches "
                         "(one mini-batch); drop these flags")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--schedule-file: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"--schedule-file: {path} is not a text (UTF-8) CSV file") from None
    return from_torch_csv(text, path.stem)


def _print_table(summaries: list, schedules: list, example: bool) -> None:
    first = schedules[0]
    title = (f"p={first.num_devices} devices per pipeline, m={first.microbatches} "
             f"micro-batches, N={first.minibatches} mini-batches")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="step: one mini-batch in steady state; peak act: micro-batches of activations held; "
                          "weights: copies of one stage's weights held",
                  caption_justify="left")
    table.add_column("schedule", no_wrap=True)
    for header in ("ms/step", "samples/s", "bubble", "peak MiB", "peak act", "weights", "staleness", "makespan"):
        table.add_column(header, justify="right", no_wrap=True)
    for s, sched in zip(summaries, schedules):
        shape = [f"v={sched.num_stages // sched.num_devices}"] if sched.num_stages > sched.num_devices else []
        shape += [f"P={sched.pipelines}"] if sched.pipelines > 1 else []
        table.add_row(
            s.schedule + (f" ({', '.join(shape)})" if shape else ""),
            f"{s.time_per_minibatch_ms:.3f}",
            f"{s.samples_per_s:,.1f}",
            f"{s.bubble_fraction:.1%}",
            f"{s.peak_memory_mb:,.0f}",
            str(max((d.peak_activations for d in s.devices), default=0)),
            str(max((d.peak_weight_versions for d in s.devices), default=0)),
            str(s.max_staleness),
            f"{s.makespan_ms:.3f}",
        )
    stdout.print(table)
    if example:
        stdout.print("Built-in example: one model (per device: forward 1 ms, backward 2 ms, 256 MiB of weights; "
                     "update, prediction and averaging 0.1 ms; transfers 0.1 ms), split over each method's chunks. "
                     "Try: pipesim simulate --schedule 1f1b --schedule xpipe --stages 8 --microbatches 32 "
                     "--html t.html", highlight=False)


def list_schedules() -> None:
    """List the methods pipesim knows: what each does and which weights its ops read."""
    from ..schedules import METHODS

    table = Table(show_header=True, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("what it does")
    table.add_column("weights read (s: prediction distance)")
    for method in METHODS.values():
        policy = method.build(method.params(4, 8)).policy
        table.add_row(method.name, method.summary, _policy_text(policy))
    stdout.print(table)
    stdout.print("Sources and where they disagree: docs/methods.md", highlight=False)


def _policy_text(policy) -> str:
    """One line per side: the version read, and how far and by which rule weights are predicted."""
    lines = []
    for side, read, prediction in (("F", policy.forward, policy.predict_forward),
                                   ("B", policy.backward, policy.predict_backward)):
        text = f"{side}: {read.value}"
        if prediction is not None:
            text += f", predicted s = {prediction.formula or 'counted'}"
            if prediction.other:
                text += f" ({prediction.other_source}: {prediction.other})"
        lines.append(text)
    if policy.extra_copies:
        lines.append(f"+{policy.extra_copies} weight copy")
    return "\n".join(lines)


EXPORT_FORMATS = ("torch-csv",)


def export(
    schedule: Annotated[str, typer.Option("--schedule", "-s", help="Method to export (see `pipesim schedules`).")],
    fmt: Annotated[str, typer.Option("--format", help="Output format: torch-csv (torch.distributed.pipelining's "
                                     "schedule CSV, one row per rank; synchronous one-pipeline methods).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="File to write (replaced atomically).")],
    stages: Annotated[int, typer.Option(
        "--stages", "-p", min=1, help="Pipeline depth p: devices in one pipeline.")] = 4,
    chunks: Annotated[int | None, typer.Option(
        "--chunks", "-v", min=1, help="Model chunks per device (interleaved / V schedules). Default: the "
                                      "method's.")] = None,
    microbatches: Annotated[int, typer.Option(
        "--microbatches", "-m", min=1, help="Micro-batches per mini-batch m.")] = 8,
) -> None:
    """Write one training step of a method's schedule for another runtime (e.g. torch's `_load_csv`)."""
    from ..schedules import ScheduleError
    from ..schedules.catalogue import method_named
    from ..schedules.torch_csv import to_torch_csv
    from ..traces import write_atomic

    try:
        if fmt not in EXPORT_FORMATS:
            raise InputError(f"--format: unknown {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
        check_writable("--out", out)
        method = method_named(schedule)
        # torch's CSV is one pipeline: AvgPipe is refused for its averaging, not its default of two pipelines.
        text = to_torch_csv(method.build(method.params(stages, microbatches, chunks=chunks, pipelines=1)))
        write_atomic(out, text)
    except (InputError, ScheduleError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write output: {exc.filename}: {exc.strerror}")
    stdout.print(f"wrote {out}", highlight=False)

