"""The `pipesim` command line. It orchestrates: schedules -> sim -> traces. Heavy imports stay inside
the commands that need them, so `pipesim simulate` starts fast and never imports torch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    name="pipesim",
    help="Simulate, run and compare pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
stdout = Console(width=None if sys.stdout.isatty() else 120)  # pipes and CI logs get full rows
stderr = Console(stderr=True, width=None if sys.stderr.isatty() else 120)

EXAMPLE = dict(stages=4, microbatches=8, minibatches=4, comm="0.1", opt=0.1, html=Path("pipesim-example.html"))


class InputError(Exception):
    """Bad input found by the CLI itself; reported as one line with exit code 2."""


def fail(message: str) -> NoReturn:
    stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # keep [..] text
    raise SystemExit(2)


def _numbers(flag: str, text: str) -> list[float]:
    """One number or a comma-separated list of them, each finite and >= 0."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InputError(f"{flag}: expected a number or comma-separated numbers, got {text!r}") from None
        if not value >= 0 or value == float("inf"):
            raise InputError(f"{flag}: values must be finite and >= 0, got {part.strip()!r}")
        values.append(value)
    return values


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set option `name` (rather than it taking its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _writable(flag: str, path: Optional[Path]) -> None:
    """Refuse an output path before any work is done, so nothing is half-written later."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{flag}: {path} is a directory; give a file path")
    if not parent.is_dir():
        raise InputError(f"{flag}: cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{flag}: cannot write {path}: folder {parent} is not writable")


def _output_paths(path: Path, names: list[str]) -> list[Path]:
    """PATH for one schedule; PATH with `-<schedule>` before the suffix for several."""
    if len(names) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{name}{path.suffix}") for name in names]


@app.command()
def simulate(
    ctx: typer.Context,
    schedule: Annotated[Optional[list[str]], typer.Option(
        "--schedule", "-s", help="Method to simulate (repeat to compare; see `pipesim schedules`). Default: all.")] = None,
    schedule_file: Annotated[Optional[Path], typer.Option(
        "--schedule-file", help="Simulate a torch.distributed.pipelining schedule CSV (one row per rank) instead of --schedule.")] = None,
    stages: Annotated[int, typer.Option("--stages", "-p", min=1, help="Pipeline depth p: devices in one pipeline.")] = 4,
    chunks: Annotated[Optional[int], typer.Option("--chunks", "-v", min=1, help="Model chunks per device v (interleaved / V schedules; p·v model stages). Default: the method's (2 for V schedules, else 1).")] = None,
    microbatches: Annotated[int, typer.Option("--microbatches", "-m", min=1, help="Micro-batches per mini-batch m.")] = 8,
    minibatches: Annotated[int, typer.Option("--minibatches", "-n", min=1, help="Mini-batches (optimizer steps) N.")] = 1,
    pipelines: Annotated[Optional[int], typer.Option("--pipelines", "-P", min=1, help="Parallel pipelines P sharing the devices (avgpipe; default 2).")] = None,
    advance: Annotated[Optional[int], typer.Option("--advance", min=0, help="avgpipe: forwards beyond 1F1B's warm-up before the first backward (0: 1F1B, >= m: all forwards first). Default: AvgPipe's 2(p-k)-1 forwards first.")] = None,
    average_every: Annotated[int, typer.Option("--average-every", min=1, help="avgpipe: elastic averaging period in mini-batches.")] = 1,
    elastic_alpha: Annotated[Optional[float], typer.Option("--elastic-alpha", help="avgpipe: elastic averaging coefficient (default 0.9/P).")] = None,
    graph: Annotated[Optional[Path], typer.Option("--graph", help='graphpipe: stage DAG JSON {"stages": n, "edges": [[a, b], ...], "placement": [...]} (default: built-in two-branch model).')] = None,
    fwd: Annotated[str, typer.Option("--fwd", help="Forward ms per micro-batch: one number, or one per model stage.")] = "1",
    bwd: Annotated[str, typer.Option("--bwd", help="Full backward ms per micro-batch: one number, or one per model stage.")] = "2",
    wgrad_fraction: Annotated[float, typer.Option("--wgrad-fraction", min=0.0, max=1.0, help="Share of the backward that is the weight gradient (split-backward schedules).")] = 0.5,
    opt: Annotated[float, typer.Option("--opt", min=0.0, help="Optimizer step ms per stage.")] = 0.0,
    pred: Annotated[Optional[float], typer.Option("--pred", min=0.0, help="Weight prediction (PRED) ms per stage (default: --opt).")] = None,
    avg: Annotated[Optional[float], typer.Option("--avg", min=0.0, help="Elastic averaging (AVG) ms per stage (default: --opt).")] = None,
    comm: Annotated[str, typer.Option("--comm", help="Ms per activation or gradient transfer between devices (no contention).")] = "0",
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="Cluster JSON (devices, links with latency and bandwidth, shared resources); replaces --comm.")] = None,
    param_mb: Annotated[str, typer.Option("--param-mb", help="Parameter MiB per model stage (one number, or one per stage).")] = "256",
    activation_mb: Annotated[str, typer.Option("--activation-mb", help="Activation MiB a micro-batch saves per model stage.")] = "64",
    output_mb: Annotated[str, typer.Option("--output-mb", help="MiB a stage sends to the next per micro-batch (sizes transfers on --cluster links).")] = "8",
    optimizer: Annotated[str, typer.Option("--optimizer", help="Optimizer whose state is held: sgd, momentum, adam, adamw.")] = "adam",
    microbatch_size: Annotated[int, typer.Option("--microbatch-size", min=1, help="Samples per micro-batch (for samples/s).")] = 1,
    blocking_comm: Annotated[bool, typer.Option("--blocking-comm", help="Sends block the compute stream until they finish.")] = False,
    jitter: Annotated[float, typer.Option("--jitter", min=0.0, help="Sigma of a log-normal factor on every compute time (0: none).")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for --jitter.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write an interactive timeline (self-contained HTML).")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write Chrome Trace Event JSON (Perfetto); -<schedule> is added for several.")] = None,
) -> None:
    """Predict timelines, bubbles, memory and staleness of schedules side by side.

    With no options: a built-in example comparing every method on a 4-stage pipeline.
    """
    example = not any(_given(ctx, name) for name in ctx.params)
    if example:
        stages, microbatches, minibatches, comm, opt, html = (
            EXAMPLE[k] for k in ("stages", "microbatches", "minibatches", "comm", "opt", "html"))
    from .schedules import METHODS, ScheduleError, ScheduleParams, build_schedule
    from .sim import OPTIMIZER_STATE_FACTOR, Cluster, ClusterError, CostError, Costs, SimulationError, load_cluster
    from .sim import simulate as run_simulation
    from .traces import summarize, write_trace

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
        for flag, name, only in (("--advance", "advance", "avgpipe"), ("--average-every", "average_every", "avgpipe"),
                                 ("--elastic-alpha", "elastic_alpha", "avgpipe"), ("--graph", "graph", "graphpipe")):
            if _given(ctx, name) and only not in names:
                raise InputError(f"{flag} applies to {only} only; add --schedule {only}")
        if elastic_alpha is not None and not 0 < elastic_alpha <= 1:
            raise InputError(f"--elastic-alpha: must be in (0, 1] (got {elastic_alpha})")
        _writable("--html", html)
        _writable("--trace", trace)
        per_stage = {flag: _numbers(flag, text) for flag, text in (
            ("--fwd", fwd), ("--bwd", bwd), ("--param-mb", param_mb), ("--activation-mb", activation_mb),
            ("--output-mb", output_mb))}
        if optimizer not in OPTIMIZER_STATE_FACTOR:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZER_STATE_FACTOR)} (got {optimizer!r})")
        comm_ms = _numbers("--comm", comm)
        if len(comm_ms) != 1:
            raise InputError("--comm: give one number of milliseconds")
        topology = None
        if cluster is not None:
            if _given(ctx, "comm"):
                raise InputError("--comm and --cluster both describe links: give one")
            topology = load_cluster(cluster)
            if blocking_comm:
                topology = type(topology)(**{**vars(topology), "overlap_comm": False})
        dag = _load_graph(graph) if graph is not None else None

        def build(name: str):
            defaults = METHODS[name].defaults
            params = ScheduleParams(
                dag[0].num_stages if dag and name == "graphpipe" else stages, microbatches, minibatches,
                chunks if chunks is not None else defaults.get("chunks", 1),
                pipelines if pipelines is not None else defaults.get("pipelines", 1),
                advance, average_every, elastic_alpha)
            if dag and name == "graphpipe":
                from .schedules.graph import graph_schedule

                return graph_schedule(params, *dag)
            return build_schedule(name, params)

        def costs_for(sched) -> Costs:
            """Per-model-stage costs. The example spreads one device's share of the model over its chunks,
            so every method trains the same model."""
            n = sched.num_stages
            if example:
                share = sched.num_devices / n
                values = {flag: [v * share for v in per_stage[flag]] for flag in ("--fwd", "--bwd", "--param-mb",
                                                                                   "--activation-mb")}
                values["--output-mb"] = per_stage["--output-mb"]
            else:
                values = per_stage
            for flag, given in values.items():
                if len(given) not in (1, n):
                    where = f"in {schedule_file}" if loaded else f"for {sched.method}"
                    raise InputError(f"{flag}: {len(given)} values given; give one, or one per model stage "
                                     f"({n} {where})")
            return Costs.per_stage(
                n, fwd_ms=values["--fwd"], bwd_ms=values["--bwd"], wgrad_fraction=wgrad_fraction, opt_ms=opt,
                pred_ms=pred, avg_ms=avg, param_mb=values["--param-mb"], activation_mb=values["--activation-mb"],
                output_mb=values["--output-mb"], optimizer=optimizer, microbatch_size=microbatch_size)

        built = [loaded] if loaded else [build(name) for name in names]
        summaries, traces = [], []
        for sched in _progress(built, as_json):
            links = topology or Cluster.uniform(sched.num_devices, comm_ms[0], overlap_comm=not blocking_comm)
            result = run_simulation(sched, costs_for(sched), links, jitter=jitter, seed=seed)
            traces.append(result)
            summaries.append(summarize(result))
        if trace is not None:
            for path, result in zip(_output_paths(trace, names), traces):
                write_trace(result, path)
        if html is not None:
            from .traces.view import timeline_figure, write_html

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
    from .schedules.torch_csv import from_torch_csv

    if _given(ctx, "schedule"):
        raise InputError("--schedule and --schedule-file both say what to simulate: give one")
    fixed = [f"--{name}" for name in ("stages", "chunks", "microbatches", "minibatches", "pipelines")
             if _given(ctx, name)]
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


def _load_graph(path: Path):
    from .schedules import ScheduleError
    from .schedules.graph import load_graph

    try:
        return load_graph(path)
    except ScheduleError as exc:
        raise InputError(f"--graph: {exc}") from None


def _progress(items: list, quiet: bool):
    """Iterate with a transient progress bar on an interactive terminal (simulations can take seconds)."""
    if quiet or not stderr.is_terminal or len(items) < 2:
        yield from items
        return
    from rich.progress import track

    yield from track(items, description="simulating", console=stderr, transient=True)


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


EXPORT_FORMATS = ("torch-csv",)


@app.command()
def export(
    schedule: Annotated[str, typer.Option("--schedule", "-s", help="Method to export (see `pipesim schedules`).")],
    fmt: Annotated[str, typer.Option("--format", help="Output format: torch-csv (torch.distributed.pipelining's "
                                     "schedule CSV, one row per rank; synchronous one-pipeline methods).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="File to write (replaced atomically).")],
    stages: Annotated[int, typer.Option("--stages", "-p", min=1, help="Pipeline depth p: devices in one pipeline.")] = 4,
    chunks: Annotated[Optional[int], typer.Option("--chunks", "-v", min=1, help="Model chunks per device (interleaved / V schedules). Default: the method's.")] = None,
    microbatches: Annotated[int, typer.Option("--microbatches", "-m", min=1, help="Micro-batches per mini-batch m.")] = 8,
) -> None:
    """Write one training step of a method's schedule for another runtime (e.g. torch's `_load_csv`)."""
    from .schedules import METHODS, ScheduleError, ScheduleParams, build_schedule
    from .schedules.torch_csv import to_torch_csv
    from .traces import write_atomic

    try:
        if fmt not in EXPORT_FORMATS:
            raise InputError(f"--format: unknown {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
        _writable("--out", out)
        method = METHODS.get(schedule)
        if chunks is None and method is not None:
            chunks = method.defaults.get("chunks", 1)
        text = to_torch_csv(build_schedule(schedule, ScheduleParams(stages, microbatches, 1, chunks or 1)))
        write_atomic(out, text)
    except (InputError, ScheduleError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write output: {exc.filename}: {exc.strerror}")
    stdout.print(f"wrote {out}", highlight=False)


@app.command("schedules")
def list_schedules() -> None:
    """List the methods pipesim knows: what each does and which weights its ops read."""
    from .schedules import METHODS, ScheduleParams

    table = Table(show_header=True, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("what it does")
    table.add_column("weights read (s: prediction distance)")
    for method in METHODS.values():
        policy = method.build(ScheduleParams(4, 8, **method.defaults)).policy
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


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: usage errors become one line and exit code 2, never a traceback."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="pipesim", standalone_mode=False)
    except typer.Abort:
        raise SystemExit(1) from None
    except Exception as exc:
        if not callable(getattr(exc, "format_message", None)):
            raise
        fail(exc.format_message())  # click's usage and parameter errors
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
