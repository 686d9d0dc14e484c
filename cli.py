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

EXAMPLE = dict(stages=4, microbatches=8, minibatches=4, comm="0.1", html=Path("pipesim-example.html"))


class InputError(Exception):
    """Bad input found by the CLI itself; reported as one line with exit code 2."""


def fail(message: str) -> NoReturn:
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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
    stages: Annotated[int, typer.Option("--stages", "-p", min=1, help="Pipeline depth p: devices in one pipeline.")] = 4,
    chunks: Annotated[int, typer.Option("--chunks", "-v", min=1, help="Model chunks per device (interleaved / V schedules).")] = 1,
    microbatches: Annotated[int, typer.Option("--microbatches", "-m", min=1, help="Micro-batches per mini-batch m.")] = 8,
    minibatches: Annotated[int, typer.Option("--minibatches", "-n", min=1, help="Mini-batches (optimizer steps) N.")] = 1,
    fwd: Annotated[str, typer.Option("--fwd", help="Forward ms per micro-batch: one number, or one per model stage.")] = "1",
    bwd: Annotated[str, typer.Option("--bwd", help="Full backward ms per micro-batch: one number, or one per model stage.")] = "2",
    wgrad_fraction: Annotated[float, typer.Option("--wgrad-fraction", min=0.0, max=1.0, help="Share of the backward that is the weight gradient (split-backward schedules).")] = 0.5,
    opt: Annotated[float, typer.Option("--opt", min=0.0, help="Optimizer step ms per stage.")] = 0.0,
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
        stages, microbatches, minibatches, comm, html = (EXAMPLE[k] for k in
                                                         ("stages", "microbatches", "minibatches", "comm", "html"))
    from .schedules import METHODS, ScheduleError, ScheduleParams, build_schedule
    from .sim import OPTIMIZER_STATE_FACTOR, Cluster, ClusterError, CostError, Costs, SimulationError, load_cluster
    from .sim import simulate as run_simulation
    from .traces import summarize, write_trace

    names = schedule or list(METHODS)
    try:
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise InputError(f"--schedule: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}")
        if len(set(names)) != len(names):
            raise InputError("--schedule: each method may be given once")
        _writable("--html", html)
        _writable("--trace", trace)
        params = ScheduleParams(stages, microbatches, minibatches, chunks)
        num_stages = stages * chunks
        per_stage = {flag: _numbers(flag, text) for flag, text in (
            ("--fwd", fwd), ("--bwd", bwd), ("--param-mb", param_mb), ("--activation-mb", activation_mb),
            ("--output-mb", output_mb))}
        for flag, values in per_stage.items():
            if len(values) not in (1, num_stages):
                raise InputError(f"{flag}: {len(values)} values given; give one, or one per model stage "
                                 f"({num_stages} = stages {stages} × chunks {chunks})")
        if optimizer not in OPTIMIZER_STATE_FACTOR:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZER_STATE_FACTOR)} (got {optimizer!r})")
        comm_ms = _numbers("--comm", comm)
        if len(comm_ms) != 1:
            raise InputError("--comm: give one number of milliseconds")
        costs = Costs.per_stage(
            num_stages, fwd_ms=per_stage["--fwd"], bwd_ms=per_stage["--bwd"], wgrad_fraction=wgrad_fraction,
            opt_ms=opt, param_mb=per_stage["--param-mb"], activation_mb=per_stage["--activation-mb"],
            output_mb=per_stage["--output-mb"], optimizer=optimizer, microbatch_size=microbatch_size,
        )
        if cluster is not None:
            if _given(ctx, "comm"):
                raise InputError("--comm and --cluster both describe links: give one")
            topology = load_cluster(cluster)
            if blocking_comm:
                topology = type(topology)(**{**vars(topology), "overlap_comm": False})
        else:
            topology = Cluster.uniform(stages, comm_ms[0], overlap_comm=not blocking_comm)
        built = [build_schedule(name, params) for name in names]
        summaries, traces = [], []
        for sched in _progress(built, as_json):
            result = run_simulation(sched, costs, topology, jitter=jitter, seed=seed)
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
    _print_table(summaries, params, example)
    written = [*(_output_paths(trace, names) if trace else []), *([html] if html else [])]
    for path in written:
        stdout.print(f"wrote {path}", highlight=False)


def _progress(items: list, quiet: bool):
    """Iterate with a transient progress bar on an interactive terminal (simulations can take seconds)."""
    if quiet or not stderr.is_terminal or len(items) < 2:
        yield from items
        return
    from rich.progress import track

    yield from track(items, description="simulating", console=stderr, transient=True)


def _print_table(summaries: list, params, example: bool) -> None:
    title = (f"p={params.stages} stages, m={params.microbatches} micro-batches, "
             f"N={params.minibatches} mini-batches" + (f", v={params.chunks}" if params.chunks > 1 else ""))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="step: one mini-batch in steady state; peak act: micro-batches of activations held",
                  caption_justify="left")
    table.add_column("schedule", no_wrap=True)
    for header in ("ms/step", "samples/s", "bubble", "peak MiB", "peak act", "staleness", "makespan"):
        table.add_column(header, justify="right", no_wrap=True)
    for s in summaries:
        table.add_row(
            s.schedule,
            f"{s.time_per_minibatch_ms:.3f}",
            f"{s.samples_per_s:,.1f}",
            f"{s.bubble_fraction:.1%}",
            f"{s.peak_memory_mb:,.0f}",
            str(max((d.peak_activations for d in s.devices), default=0)),
            str(s.max_staleness),
            f"{s.makespan_ms:.3f}",
        )
    stdout.print(table)
    if example:
        stdout.print("Built-in example (uniform costs: forward 1 ms, backward 2 ms, transfer 0.1 ms). "
                     "Try: pipesim simulate --schedule 1f1b --stages 8 --microbatches 32 --html t.html",
                     highlight=False)


@app.command("schedules")
def list_schedules() -> None:
    """List the methods pipesim knows, with a one-line description each."""
    from .schedules import METHODS

    table = Table(show_header=True)
    table.add_column("name")
    table.add_column("what it does")
    for method in METHODS.values():
        table.add_row(method.name, method.summary)
    stdout.print(table)


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
