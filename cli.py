"""The `pipesim` command line. It orchestrates: schedules -> sim -> traces. Heavy imports stay inside
the commands that need them, so `pipesim simulate` starts fast and never imports torch."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from .profiles.schema import Profile
    from .schedules import Schedule, ScheduleParams
    from .sim import Cluster, Costs

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


# Options `simulate` and `sweep` share word for word.
WgradFraction = Annotated[float, typer.Option("--wgrad-fraction", min=0.0, max=1.0, help="Share of the backward that is the weight gradient (split-backward schedules).")]
HeldOptimizer = Annotated[str, typer.Option("--optimizer", help="Optimizer whose state is held: sgd, momentum, adam, adamw.")]
MicrobatchSize = Annotated[int, typer.Option("--microbatch-size", min=1, help="Samples per micro-batch (for samples/s).")]
BlockingComm = Annotated[bool, typer.Option("--blocking-comm", help="Sends block the compute stream until they finish.")]

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
    wgrad_fraction: WgradFraction = 0.5,
    opt: Annotated[float, typer.Option("--opt", min=0.0, help="Optimizer step ms per stage.")] = 0.0,
    pred: Annotated[Optional[float], typer.Option("--pred", min=0.0, help="Weight prediction (PRED) ms per stage (default: --opt).")] = None,
    avg: Annotated[Optional[float], typer.Option("--avg", min=0.0, help="Elastic averaging (AVG) ms per stage (default: --opt).")] = None,
    comm: Annotated[str, typer.Option("--comm", help="Ms per activation or gradient transfer between devices (no contention).")] = "0",
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="Cluster JSON (devices, links with latency and bandwidth, shared resources); replaces --comm.")] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile from `pipesim calibrate`: per-stage times, bytes and links from measurements (replaces the cost and size flags; other stage counts re-partition its layers).")] = None,
    param_mb: Annotated[str, typer.Option("--param-mb", help="Parameter MiB per model stage (one number, or one per stage).")] = "256",
    activation_mb: Annotated[str, typer.Option("--activation-mb", help="Activation MiB a micro-batch saves per model stage.")] = "64",
    output_mb: Annotated[str, typer.Option("--output-mb", help="MiB a stage sends to the next per micro-batch (sizes transfers on --cluster links).")] = "8",
    optimizer: HeldOptimizer = "adam",
    microbatch_size: MicrobatchSize = 1,
    blocking_comm: BlockingComm = False,
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
    from .schedules import METHODS, ScheduleError, ScheduleParams
    from .sim import ClusterError, CostError, SimulationError
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
        for flag, option in (("--advance", "advance"), ("--average-every", "average_every"),
                             ("--elastic-alpha", "elastic_alpha"), ("--graph", "graph")):
            readers = [m.name for m in METHODS.values() if option in m.options]
            if _given(ctx, option) and not set(readers) & set(names):
                raise InputError(f"{flag} applies to {', '.join(readers)} only; add --schedule {readers[0]}")
        if elastic_alpha is not None and not 0 < elastic_alpha <= 1:
            raise InputError(f"--elastic-alpha: must be in (0, 1] (got {elastic_alpha})")
        _writable("--html", html)
        _writable("--trace", trace)
        scenario = _scenario(ctx, "device" if example else "stage", schedule_file if loaded else None, comm=comm,
                             opt=opt)
        if scenario.measured is not None and not _given(ctx, "stages"):
            stages = scenario.measured.partition.stages

        def build(name: str):
            defaults = METHODS[name].defaults
            return scenario.build(name, ScheduleParams(
                stages, microbatches, minibatches, chunks if chunks is not None else defaults.get("chunks", 1),
                pipelines if pipelines is not None else defaults.get("pipelines", 1), advance, average_every,
                elastic_alpha))

        built = [loaded] if loaded else [build(name) for name in names]
        summaries, traces = [], []
        for sched in _progress(built, as_json):
            result = run_simulation(sched, scenario.costs(sched), scenario.links(sched), jitter=jitter, seed=seed)
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


@dataclass(frozen=True)
class Scenario:
    """What the cost flags, --cluster, --profile and --graph describe, apart from the schedule's shape: one
    picklable value, so `sweep`'s worker processes build exactly the schedules, costs and links `simulate`
    builds."""

    per_stage: dict[str, list[float]]  # by flag: --fwd, --bwd, --param-mb, --activation-mb, --output-mb
    wgrad_fraction: float
    opt_ms: float
    pred_ms: Optional[float]
    avg_ms: Optional[float]
    optimizer: str
    microbatch_size: int
    comm_ms: float
    overlap_comm: bool
    topology: Optional[Cluster] = None  # --cluster
    measured: Optional[Profile] = None  # --profile
    dag: Optional[tuple] = None  # --graph: (StageGraph, placement)
    per: str = "stage"  # what --fwd, --bwd, --param-mb, --activation-mb describe: see `costs`
    source: Optional[Path] = None  # the schedule file, named in errors

    def build(self, name: str, params: ScheduleParams, bounds: Optional[Sequence[int]] = None) -> Schedule:
        """The named method's schedule; a method that runs any stage DAG (graphpipe) gets the --graph DAG, or
        the profile's model cut into p stages (at `bounds` if given)."""
        from .schedules import METHODS, build_schedule

        on_graph = METHODS[name].on_graph
        if on_graph is None or not (self.dag or self.measured):
            return build_schedule(name, params)
        if self.dag:
            return on_graph(replace(params, stages=self.dag[0].num_stages), *self.dag)
        return on_graph(params, _profile_graph(self.measured, params.stages, bounds))

    def costs(self, sched: Schedule, bounds: Optional[Sequence[int]] = None) -> Costs:
        """Per-model-stage costs. The flags' values are per model "stage", or one "device"'s share of the model
        split over its chunks (the built-in example: every method trains the same model), or the whole
        "model" split over all stages (a sweep, where the stage count varies too)."""
        from .sim import CostError, Costs

        if self.measured is not None:
            return _profile_costs(self.measured, sched, self.optimizer, bounds)
        n = sched.num_stages
        share = {"stage": 1.0, "device": sched.num_devices / n, "model": 1.0 / n}[self.per]
        values = {flag: given if flag == "--output-mb" else [v * share for v in given]
                  for flag, given in self.per_stage.items()}
        for flag, given in values.items():
            if len(given) not in (1, n):
                where = f"in {self.source}" if self.source else f"for {sched.method}"
                raise CostError(f"{flag}: {len(given)} values given; give one, or one per model stage ({n} {where})")
        def shared(ms: Optional[float]) -> Optional[float]:  # an update's work scales with the stage's weights
            return None if ms is None else ms * share

        return Costs.per_stage(
            n, fwd_ms=values["--fwd"], bwd_ms=values["--bwd"], wgrad_fraction=self.wgrad_fraction,
            opt_ms=shared(self.opt_ms), pred_ms=shared(self.pred_ms), avg_ms=shared(self.avg_ms),
            param_mb=values["--param-mb"],
            activation_mb=values["--activation-mb"], output_mb=values["--output-mb"], optimizer=self.optimizer,
            microbatch_size=self.microbatch_size)

    def links(self, sched: Schedule) -> Cluster:
        from .sim import Cluster

        if self.topology is not None:
            return self.topology
        if self.measured is not None and self.measured.link:
            return _profile_cluster(self.measured, sched.num_devices, self.overlap_comm)
        return Cluster.uniform(sched.num_devices, self.comm_ms, overlap_comm=self.overlap_comm)


def _scenario(ctx: typer.Context, per: str, source: Optional[Path] = None, **overrides) -> Scenario:
    """The Scenario the command's cost flags describe (read by parameter name, which `simulate` and `sweep`
    share; `overrides` replace their values), checked before any work."""
    from .sim import OPTIMIZER_STATE_FACTOR, load_cluster

    flags = {**ctx.params, **overrides}
    per_stage = {flag: _numbers(flag, flags[flag[2:].replace("-", "_")])
                 for flag in ("--fwd", "--bwd", "--param-mb", "--activation-mb", "--output-mb")}
    if flags["optimizer"] not in OPTIMIZER_STATE_FACTOR:
        raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZER_STATE_FACTOR)} (got {flags['optimizer']!r})")
    comm_ms = _numbers("--comm", flags["comm"])
    if len(comm_ms) != 1:
        raise InputError("--comm: give one number of milliseconds")
    topology = None
    if flags["cluster"] is not None:
        if _given(ctx, "comm"):
            raise InputError("--comm and --cluster both describe links: give one")
        topology = load_cluster(flags["cluster"])
        if flags["blocking_comm"]:
            topology = replace(topology, overlap_comm=False)
    graph = flags.get("graph")
    return Scenario(
        per_stage, flags["wgrad_fraction"], flags["opt"], flags["pred"], flags["avg"], flags["optimizer"],
        flags["microbatch_size"], comm_ms[0], not flags["blocking_comm"], topology,
        _load_profile(ctx, flags["profile"]) if flags["profile"] is not None else None,
        _load_graph(graph) if graph is not None else None, per, source)


PROFILE_COSTS = ("fwd", "bwd", "wgrad_fraction", "opt", "pred", "avg", "param_mb", "activation_mb", "output_mb",
                 "microbatch_size", "graph")


def _load_profile(ctx: typer.Context, path: Path):
    """A calibration profile. It fixes the costs, sizes and (when it measured them) links, so flags that set
    those would be silently ignored: refuse them instead."""
    from .profiles.schema import ProfileError, load_profile

    try:
        measured = load_profile(path)
    except ProfileError as exc:
        raise InputError(f"--profile: {exc}") from None
    fixed = [*PROFILE_COSTS, *(("comm", "cluster") if measured.link else ())]
    clash = [f"--{name.replace('_', '-')}" for name in fixed if _given(ctx, name)]
    if clash:
        raise InputError(f"{', '.join(clash)}: the profile {path} gives the costs, sizes, stage graph"
                         f"{' and links' if measured.link else ''}; drop these flags")
    return measured


def _profile_bounds(measured, num_stages: int) -> list[int]:
    """The profile's own partition for its stage count; other counts re-partition its layers for time
    alone (the calibration's memory cap planned for its own stage count, so it is not applied here)."""
    from .profiles.partition import partition
    from .profiles.schema import layer_costs
    from .sim import CostError

    if num_stages == measured.partition.stages:
        return measured.partition.bounds
    if num_stages > len(measured.layers):
        raise CostError(f"--profile: the schedule has {num_stages} model stages but the profile's model has "
                        f"{len(measured.layers)} layers; lower --stages or --chunks")
    return partition(layer_costs(measured.layers, measured.partition.optimizer), num_stages)


def _profile_graph(measured, num_stages: int, bounds: Optional[Sequence[int]] = None):
    """The stage DAG of the profile's model cut into `num_stages` (at `bounds`, default `_profile_bounds`; a
    chain unless its layers branch)."""
    from .profiles.schema import stage_edges
    from .schedules.ir import StageGraph

    cut = list(bounds) if bounds is not None else _profile_bounds(measured, num_stages)
    return StageGraph(num_stages, tuple(stage_edges(measured.layers, cut)))


def _profile_costs(measured, sched, optimizer: str, bounds: Optional[Sequence[int]] = None):
    """Costs of the profile's layers cut into the schedule's model stages (at `bounds`, default
    `_profile_bounds`), with `optimizer`'s update and prediction; AvgPipe's averaging step pulls all P replicas."""
    from .profiles.schema import stages_for
    from .schedules.ir import StageGraph
    from .sim import Costs, StageCosts

    n = sched.num_stages
    cut = list(bounds) if bounds is not None else _profile_bounds(measured, n)
    stages = stages_for(measured, cut, dag=sched.graph.edges != StageGraph.chain(n).edges)
    return Costs(tuple(StageCosts(
        fwd_ms=s.fwd_ms, bwd_ms=s.bwd_ms, igrad_ms=s.igrad_ms, wgrad_ms=s.wgrad_ms, wgrad_fraction=s.wgrad_fraction,
        opt_ms=s.steps[optimizer].step.median_ms,
        pred_ms=s.steps[optimizer].predict.median_ms, avg_ms=s.average.median_ms * sched.pipelines,
        param_bytes=s.param_bytes, activation_bytes=s.activation_bytes, output_bytes=s.output_bytes,
        optimizer_state_bytes=s.optimizer_state_bytes[optimizer]) for s in stages),
        microbatch_size=measured.environment.microbatch_size)


def _profile_cluster(measured, num_devices: int, overlap_comm: bool):
    """Every device pair gets the measured p2p link, a resource of its own (transfers on one link queue);
    the devices are named, with their memory (or the calibration's cap), in the trace's metadata."""
    from .sim import Cluster, Link

    env = measured.environment
    segments = tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in measured.link.segments)
    pairs = {(a, b): Link(resource=f"link {a}->{b}", segments=segments)
             for a in range(num_devices) for b in range(num_devices) if a != b}
    memory = env.memory_cap_bytes or env.device_memory_bytes
    return Cluster(num_devices, Link(segments=segments), pairs, (env.device_name,) * num_devices,
                   (memory,) * num_devices, overlap_comm)


MAX_MEMORY_GB = 1 << 20  # a PiB per device: beyond any machine, and safely inside an int64 of bytes


def _check_memory_gb(memory_gb: Optional[float]) -> None:
    if memory_gb is not None and not 0 < memory_gb <= MAX_MEMORY_GB:
        raise InputError(f"--memory-gb: give GiB per device, more than 0 and at most {MAX_MEMORY_GB:,} (got {memory_gb})")


def _load_graph(path: Path):
    from .schedules import ScheduleError
    from .schedules.graph import load_graph

    try:
        return load_graph(path)
    except ScheduleError as exc:
        raise InputError(f"--graph: {exc}") from None


def _progress(items: Iterable, quiet: bool, total: Optional[int] = None):
    """Iterate with a transient progress bar on an interactive terminal (simulations can take seconds); `total`
    counts the items of an iterator."""
    total = len(items) if total is None else total
    if quiet or not stderr.is_terminal or total < 2:
        yield from items
        return
    from rich.progress import track

    yield from track(items, total=total, description="simulating", console=stderr, transient=True)


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


MIB, GIB = 1 << 20, 1 << 30


@app.command()
def calibrate(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="mlp, cnn, gpt, two-branch, or package.module:attribute naming a torch.nn.Sequential, a list of modules, or a zero-argument callable returning one.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write (replaced atomically).")],
    stages: Annotated[int, typer.Option("--stages", "-p", min=1, help="Pipeline stages p to partition the layers into.")] = 2,
    microbatch_size: Annotated[int, typer.Option("--microbatch-size", "-b", min=1, help="Samples per micro-batch.")] = 8,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: cuda when torch sees a GPU).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")] = "float32",
    memory_gb: Annotated[Optional[float], typer.Option("--memory-gb", help="Per-device memory cap in GiB for the partition (1F1B: weights, gradients, optimizer state, in-flight activations).")] = None,
    optimizer: Annotated[str, typer.Option("--optimizer", help="Optimizer whose state the memory cap counts: sgd, momentum, adam, adamw.")] = "adam",
    layers: Annotated[Optional[int], typer.Option("--layers", help="Built-in models: layers (blocks; per branch for two-branch).")] = None,
    width: Annotated[Optional[int], typer.Option("--width", help="Built-in models: hidden width (channels for cnn and two-branch).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="gpt: attention heads.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="gpt: sequence length.")] = None,
    vocab: Annotated[Optional[int], typer.Option("--vocab", help="gpt: vocabulary size.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs per measurement, and rounds over the link sizes (the median is kept).")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs before them.")] = 2,
    links: Annotated[bool, typer.Option("--links/--no-links", help="Measure the point-to-point link and the all-reduce between two local ranks.")] = True,
    link_max_mb: Annotated[float, typer.Option("--link-max-mb", help="Largest link message in MiB (powers of two from 4 KiB).")] = 64.0,
) -> None:
    """Measure a model on this machine into a profile for `pipesim simulate --profile`.

    Per layer: forward, backward and its input/weight-gradient split, saved activations, output, weight,
    gradient and optimizer-state bytes. Per stage of the partition: optimizer, weight-prediction and
    averaging steps. And the p2p link (a piecewise fit) and all-reduce between two ranks.
    """
    from .profiles.partition import PartitionError
    from .profiles.schema import OPTIMIZERS, profile_json
    from .traces import write_atomic

    try:
        _writable("--out", out)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(f"--dtype: choose float32, bfloat16 or float16 (got {dtype!r})")
        if optimizer not in OPTIMIZERS:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZERS)} (got {optimizer!r})")
        _check_memory_gb(memory_gb)
        if not links and _given(ctx, "link_max_mb"):
            raise InputError("--link-max-mb sizes the link measurement, which --no-links skips: give one")
        if links and not 8 << 10 <= link_max_mb * MIB <= 4 << 30:
            raise InputError(f"--link-max-mb: give from 8 KiB ({8 / 1024:g} MiB: two sizes to fit a line) to "
                             f"4096 MiB (got {link_max_mb})")
        from .calibrate.links import LinkError
        from .profiles.linkfit import default_sizes
        from .calibrate.measure import DTYPES, DeviceError, Settings, resolve_device
        from .calibrate.measure import calibrate as run_calibration
        from .workload.models import ModelError, build_model

        try:
            settings = Settings(resolve_device(device), DTYPES[dtype], microbatch_size, warmup, repeats)
            net = build_model(model, layers=layers, width=width, heads=heads, seq_len=seq_len, vocab=vocab)
            if stages > len(net.layers):
                raise InputError(f"--stages {stages}: {net.name} has {len(net.layers)} layers; give at most "
                                 f"{len(net.layers)} (each stage needs at least one layer)")
            sizes = default_sizes(int(link_max_mb * MIB)) if links else []
            work = warmup + repeats + 5 * stages + (2 * (repeats + 1) if sizes else 0)
            with _steps(work, f"calibrating {net.name}") as advance:
                profile = run_calibration(
                    net, settings, stages=stages, optimizer=optimizer, dtype_name=dtype, link_sizes=sizes,
                    memory_cap_bytes=int(memory_gb * GIB) if memory_gb is not None else None, advance=advance)
        except (ModelError, DeviceError, PartitionError, LinkError) as exc:
            raise InputError(str(exc)) from None
        except (MemoryError, RuntimeError) as exc:  # the model or its batch does not fit in memory
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            if not isinstance(exc, MemoryError) and not any(w in first_line.lower() for w in ("alloc", "memory")):
                raise
            raise InputError(f"{model} does not fit in memory at micro-batch size {microbatch_size}: "
                             f"{first_line}; make it smaller (--width, --layers, --microbatch-size)") from None
        except OSError as exc:
            raise InputError(f"calibration failed: {exc}") from None
        try:
            write_atomic(out, profile_json(profile))
        except OSError as exc:
            raise InputError(f"cannot write output: {exc.filename}: {exc.strerror}") from None
    except InputError as exc:
        fail(str(exc))
    _print_profile(profile)
    stdout.print(f"wrote {out}", highlight=False)


@contextmanager
def _steps(total: int, title: str):
    """A progress bar on an interactive terminal over `total` units of work; yields `advance(what)`, called
    as each unit starts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        task = bar.add_task(title, total=total)
        started = 0

        def advance(what: str) -> None:
            nonlocal started
            bar.update(task, completed=min(started, total), description=f"{title}: {what}")
            started += 1

        yield advance


def _print_profile(profile) -> None:
    """Per stage: layers, times, the backward's split, memory; then the link fit and all-reduce points."""
    env = profile.environment
    table = Table(title=f"{profile.model.name} on {env.device_name} ({env.device}, {env.dtype}, micro-batch "
                        f"{env.microbatch_size}), partitioned for {profile.partition.optimizer}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="per micro-batch; I/W: input- and weight-gradient passes of the split backward; "
                          "peak: 1F1B estimate (weights, grads, optimizer state, activations in flight)",
                  caption_justify="left")
    for header in ("stage", "layers", "fwd ms", "bwd ms", "I/W ms", "W share", "act MiB", "params MiB",
                   "peak MiB"):
        table.add_column(header, justify="left" if header in ("stage", "layers") else "right", no_wrap=True)
    for k, stage in enumerate(profile.stages):
        first, stop = stage.layers
        table.add_row(str(k), f"{first}-{stop - 1}" if stop - first > 1 else str(first), f"{stage.fwd_ms:.3f}",
                      f"{stage.bwd_ms:.3f}", f"{stage.igrad_ms:.3f}/{stage.wgrad_ms:.3f}",
                      f"{stage.wgrad_fraction:.0%}", f"{stage.activation_bytes / MIB:,.2f}",
                      f"{stage.param_bytes / MIB:,.2f}", f"{stage.memory_bytes / MIB:,.1f}")
    stdout.print(table)
    if profile.link is None:
        stdout.print("links: not measured (--no-links)", highlight=False)
        return
    meta = profile.link.meta
    lines = [f"from {_size(s.min_bytes)}: {s.latency_ms * 1e3:.1f} us + {s.bytes_per_ms / 1e6:.3g} GB/s"
             for s in profile.link.segments]
    stdout.print(f"p2p link fit ({meta.get('backend')}, {meta.get('device')}): " + "; ".join(lines), highlight=False)
    points = profile.allreduce.points
    stdout.print(f"all-reduce ({profile.allreduce.world_size} ranks): " + ", ".join(
        f"{_size(p.nbytes)} {p.ms:.3g} ms" for p in (points[0], points[len(points) // 2], points[-1])),
        highlight=False)


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


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


@app.command()
def sweep(
    ctx: typer.Context,
    schedule: Annotated[Optional[str], typer.Option("--schedule", "-s", help="Methods, comma-separated (default: all).")] = None,
    stages: Annotated[Optional[str], typer.Option("--stages", "-p", help="Pipeline depths p, comma-separated (default: 4, or the profile's).")] = None,
    microbatches: Annotated[Optional[str], typer.Option("--microbatches", "-m", help="Micro-batches per mini-batch m, comma-separated (default: 8).")] = None,
    chunks: Annotated[Optional[str], typer.Option("--chunks", "-v", help="Chunks per device v, comma-separated; only interleaved and V schedules read them (default: each method's).")] = None,
    pipelines: Annotated[Optional[str], typer.Option("--pipelines", "-P", help="Parallel pipelines P, comma-separated; only avgpipe reads them (default: 2).")] = None,
    cost_scale: Annotated[Optional[str], typer.Option("--cost-scale", help="Factors on every compute time, comma-separated: a faster or slower accelerator on the same links (default: 1).")] = None,
    grid: Annotated[Optional[Path], typer.Option("--grid", help="TOML file giving axes by these flags' names, e.g. stages = [4, 8] and cost-scale = [0.5, 1].")] = None,
    minibatches: Annotated[int, typer.Option("--minibatches", "-n", min=1, help="Mini-batches N per run (several, so time per mini-batch is the steady state).")] = 4,
    fwd: Annotated[str, typer.Option("--fwd", help="Forward ms per micro-batch of the whole model, split evenly over each configuration's p·v model stages (every configuration trains the same model).")] = "4",
    bwd: Annotated[str, typer.Option("--bwd", help="Full backward ms per micro-batch of the whole model (split likewise).")] = "8",
    wgrad_fraction: WgradFraction = 0.5,
    opt: Annotated[float, typer.Option("--opt", min=0.0, help="Optimizer step ms of the whole model (split likewise).")] = 0.4,
    pred: Annotated[Optional[float], typer.Option("--pred", min=0.0, help="Weight prediction (PRED) ms of the whole model (split likewise; default: --opt).")] = None,
    avg: Annotated[Optional[float], typer.Option("--avg", min=0.0, help="Elastic averaging (AVG) ms of the whole model (split likewise; default: --opt).")] = None,
    comm: Annotated[str, typer.Option("--comm", help="Ms per activation or gradient transfer between devices (no contention).")] = "0.1",
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="Cluster JSON (devices, links, shared resources); replaces --comm.")] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile from `pipesim calibrate`: its layers cut into each configuration's stages give the costs, sizes and links.")] = None,
    param_mb: Annotated[str, typer.Option("--param-mb", help="Parameter MiB of the whole model (split likewise).")] = "1024",
    activation_mb: Annotated[str, typer.Option("--activation-mb", help="Activation MiB a micro-batch saves in the whole model (split likewise).")] = "256",
    output_mb: Annotated[str, typer.Option("--output-mb", help="MiB a stage sends to the next per micro-batch.")] = "8",
    optimizer: HeldOptimizer = "adam",
    microbatch_size: MicrobatchSize = 1,
    blocking_comm: BlockingComm = False,
    workers: Annotated[Optional[int], typer.Option("--workers", "-j", min=1, help="Worker processes (default: one per CPU core).")] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Run the tasks on the Ray cluster at this address instead (auto, ray://host:10001, or local to start one); needs pipesim[ray].")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Results, one row per configuration: .csv, or .parquet (needs pyarrow); replaced atomically.")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write the trade-off view: time per mini-batch vs peak memory, staleness as colour, the Pareto fronts (self-contained HTML).")] = None,
) -> None:
    """Simulate a grid of configurations in parallel; find the Pareto fronts of time, memory and staleness.

    Axes are comma lists, or a TOML file (--grid).
    A configuration a method cannot run is a row with status "skipped" and the reason.
    One front per p, cost scale and mini-batch size (m·P): only the same work on the same hardware competes.
    Costs are the whole model's, split over each configuration's stages (default: the built-in example's).
    """
    from importlib.util import find_spec

    from .schedules import METHODS
    from .sim import ClusterError
    from .planning.sweep import AXES, Grid, GridError, load_grid, parse_axis, pareto_front, run, write_results

    try:
        _writable("--out", out)
        _writable("--html", html)
        if out is not None and out.suffix not in (".csv", ".parquet"):
            raise InputError(f"--out: give a .csv or .parquet file (got {out})")
        if out is not None and out.suffix == ".parquet" and find_spec("pyarrow") is None:
            raise InputError("--out: writing Parquet needs pyarrow, which is not installed: pip install pyarrow "
                             "(or give a .csv file)")
        if ray is not None and find_spec("ray") is None:
            raise InputError("--ray: Ray is not installed: pip install 'pipesim[ray]'")
        if ray is not None and workers is not None:
            raise InputError("--workers sizes the local process pool, --ray runs on the cluster's CPUs: give one")
        axes = load_grid(grid) if grid is not None else {}
        for key in AXES:
            text = ctx.params[key.replace("-", "_")]
            if text is not None and key in axes:
                raise InputError(f"--{key} and --grid both give {key}: give one")
            if text is not None:
                axes[key] = parse_axis(key, text)
        scenario = _scenario(ctx, "model")
        lists = [flag for flag, values in scenario.per_stage.items() if len(values) > 1]
        if lists:
            raise InputError(f"{lists[0]}: give one number, the whole model's; the stage count varies across a "
                             "sweep, so one value per stage fits no grid (--profile gives per-layer costs)")
        configs = Grid(
            axes.get("schedule", tuple(METHODS)),
            axes.get("stages", (scenario.measured.partition.stages if scenario.measured else 4,)),
            axes.get("microbatches", (8,)), minibatches, axes.get("chunks"), axes.get("pipelines"),
            axes.get("cost-scale", (1.0,))).configs()
        results = [None] * len(configs)
        for i, result in _progress(run(scenario, configs, workers or os.cpu_count() or 1, ray), False, len(configs)):
            results[i] = result
        front = pareto_front(results)
        if out is not None:
            write_results(results, out)
        if html is not None:
            from .planning.sweep import write_tradeoff_html

            write_tradeoff_html(results, front, html)
    except (InputError, GridError, ClusterError) as exc:
        fail(str(exc))
    except ConnectionError as exc:  # Ray could not reach the cluster
        fail(f"--ray {ray}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
    except OSError as exc:
        fail(f"cannot write output: {exc.filename}: {exc.strerror}")
    _print_front(results, front)
    for path in (out, html):
        if path is not None:
            stdout.print(f"wrote {path}", highlight=False)


FRONT_ROWS = 20  # the terminal's share of the Pareto fronts; --out and --html have them all


def _print_front(results: list, front: list[int]) -> None:
    """The Pareto fronts, one section per p, cost scale and mini-batch size, fastest first."""
    from .planning.sweep import front_group

    skipped = sum(r.metrics is None for r in results)
    table = Table(title=f"Pareto fronts over time per mini-batch, peak memory and staleness, one per p, cost scale and "
                        f"mini-batch size: {len(front)} of {len(results) - skipped} configurations that ran "
                        f"({skipped} skipped)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption=f"and {len(front) - FRONT_ROWS} more: --out or --html lists them all" if len(front) > FRONT_ROWS
                  else None, caption_justify="left")
    table.add_column("schedule", no_wrap=True)
    for header in ("p", "m", "v", "P", "cost×", "ms/step", "samples/s", "bubble", "peak MiB", "staleness"):
        table.add_column(header, justify="right", no_wrap=True)
    group = None
    for i in front[:FRONT_ROWS]:
        c, m = results[i].config, results[i].metrics
        if group is not None and group != front_group(c):
            table.add_section()
        group = front_group(c)
        table.add_row(c.schedule, str(c.stages), str(c.microbatches), str(c.chunks), str(c.pipelines),
                      f"{c.cost_scale:g}", f"{m.time_per_minibatch_ms:.3f}", f"{m.samples_per_s:,.1f}",
                      f"{m.bubble_fraction:.1%}", f"{m.peak_memory_mb:,.0f}", str(m.max_staleness))
    stdout.print(table)


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


@app.command()
def tune(
    ctx: typer.Context,
    profile: Annotated[Path, typer.Option("--profile", help="Profile from `pipesim calibrate`: the model's layers, link and all-reduce, measured at its micro-batch size b.")],
    devices: Annotated[int, typer.Option("--devices", "-D", min=1, help="Devices D: r = D/p data-parallel replicas of a p-deep pipeline (p divides D).")],
    memory_gb: Annotated[Optional[float], typer.Option("--memory-gb", help="Memory cap per device, GiB. Default: the profiled device's memory (or the calibration's cap).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", "-B", min=1, help="Samples per optimizer step over all devices, a multiple of b. Default: 4·D·b, so a p-deep pipeline runs m = 4p micro-batches (GPipe's rule for a small bubble).")] = None,
    schedule: Annotated[Optional[list[str]], typer.Option("--schedule", "-s", help="Candidate method (repeat; see `pipesim schedules`). Default: all.")] = None,
    max_staleness: Annotated[int, typer.Option("--max-staleness", min=0, help="Largest staleness allowed. Default 1: PipeDream-2BW's one-step delay, shown to train like synchronous SGD; 0 keeps synchronous semantics.")] = 1,
    max_chunks: Annotated[int, typer.Option("--max-chunks", min=1, help="Largest v tried: model chunks per device (interleaved and V schedules).")] = 4,
    max_pipelines: Annotated[int, typer.Option("--max-pipelines", min=1, help="Largest P tried: pipelines sharing the devices (avgpipe).")] = 4,
    optimizer: Annotated[str, typer.Option("--optimizer", help="Optimizer whose state is held and whose step is timed: sgd, momentum, adam, adamw.")] = "adam",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
) -> None:
    """Pick the fastest schedule, depth p, micro-batches m, chunks v, pipelines P and layer partition for a
    profiled model on D devices under a per-device memory cap.

    The problem: B samples per optimizer step (--batch-size) on D devices of G GiB (--memory-gb); the
    profile's micro-batch size b stays fixed (its times hold at b). The devices run r = D/p data-parallel
    replicas of a p-deep pipeline, whose P pipelines each run m = B/(r·P·b) micro-batches per step (whole).
    Maximise samples/s with every device's peak memory <= G and staleness <= --max-staleness; ties go to
    less memory, then less staleness. Each stage all-reduces its gradients over the r replicas before its
    update (a ring scaled from the profile's 2-rank all-reduce, not overlapped with the backward). The
    layers are split into p·v stages by the memory-capped partitioner with the schedule's own memory model.

    The search bounds before it simulates: staleness and a memory floor from the schedule alone, a
    throughput bound from the busiest device's compute; the choice and its five runners-up are exact.
    """
    from .schedules import METHODS, ScheduleError
    from .sim import OPTIMIZER_STATE_FACTOR, CostError, SimulationError
    from .planning.tune import GIB, Problem, TuneError
    from .planning.tune import tune as search

    try:
        schedule = [name.strip() for given in schedule or () for name in given.split(",")]  # as sweep takes them
        unknown = [name for name in schedule if name not in METHODS]
        if unknown:
            raise InputError(f"--schedule: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}")
        if optimizer not in OPTIMIZER_STATE_FACTOR:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZER_STATE_FACTOR)} (got {optimizer!r})")
        _check_memory_gb(memory_gb)
        measured = _load_profile(ctx, profile)
        env = measured.environment
        if memory_gb is None and not (env.memory_cap_bytes or env.device_memory_bytes):
            raise InputError(f"--memory-gb: the profile {profile} does not record its device's memory; give the cap")
        b = env.microbatch_size
        batch = batch_size if batch_size is not None else 4 * devices * b
        if batch % b:
            raise InputError(f"--batch-size {batch}: must be a multiple of the profile's micro-batch size {b} "
                             "(its times were measured at that size)")
        problem = Problem(devices, int(memory_gb * GIB) if memory_gb is not None else
                          env.memory_cap_bytes or env.device_memory_bytes, batch,
                          tuple(dict.fromkeys(schedule)) if schedule else tuple(METHODS), max_staleness, max_chunks,
                          max_pipelines)
        tuning = search(profile_scenario(measured, optimizer), problem)
    except (InputError, TuneError, ScheduleError, CostError, SimulationError) as exc:
        fail(str(exc))
    if as_json:
        sys.stdout.write(json.dumps(tuning.to_dict(), indent=2) + "\n")
        return
    _print_tuning(tuning, measured)


def profile_scenario(measured: Profile, optimizer: str) -> Scenario:
    """The Scenario of a profile alone: its layers give every cost and size, its link (if measured) the
    transfers; the what-if fields are unused."""
    return Scenario(per_stage={}, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None, avg_ms=None, optimizer=optimizer,
                    microbatch_size=measured.environment.microbatch_size, comm_ms=0.0, overlap_comm=True,
                    measured=measured)


def _print_tuning(tuning, measured) -> None:
    """The choice and its runners-up, then what breaks a limit but would be faster, each with why it lost."""
    from .planning.tune import memory_text

    problem, env, stats = tuning.problem, measured.environment, tuning.stats
    table = Table(title=f"{measured.model.name} on {problem.devices} x {env.device_name} ({env.device}), "
                        f"{memory_text(problem.memory_cap_bytes)} each; batch {problem.batch_size} samples "
                        f"(micro-batch {env.microbatch_size}), staleness <= {problem.max_staleness}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                  caption="p: devices per pipeline (D/p replicas), v: chunks per device, P: pipelines, m: micro-batches "
                          "per pipeline and step; bubble: 1 - mean compute / step time; ms/step: the busiest "
                          "device's compute per step")
    for header in ("", "schedule", "p", "v", "P", "m", "samples/s", "bubble", "peak", "stale", "why not"):
        table.add_column(header, justify="left" if header in ("schedule", "why not") else "right",
                         no_wrap=header != "why not")

    def add(mark: str, row, style: Optional[str] = None) -> None:
        c, result = row.result.config, row.result
        same = f"same as {', '.join(twin.label() for twin in row.twins)}" if row.twins else ""
        table.add_row(mark, c.schedule, str(c.stages), str(c.chunks), str(c.pipelines), str(c.microbatches),
                      f"{result.samples_per_s:,.1f}", f"{result.bubble_fraction:.0%}",
                      memory_text(result.peak_memory_bytes), str(result.staleness),
                      "; ".join(filter(None, (row.why, same))), style=style)

    add("best", tuning.choice, style="bold")
    for rank, row in enumerate(tuning.runners_up, 2):
        add(str(rank), row)
    if tuning.excluded:
        table.add_section()
        for row in tuning.excluded:
            add("over", row, style="dim")
    stdout.print(table)
    bounds = tuning.choice.result.candidate.bounds
    stdout.print("partition (layers per model stage): " + " | ".join(
        f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in zip(bounds, bounds[1:])) + "; all-reduce "
        f"{tuning.choice.result.candidate.allreduce_ms:,.1f} ms per step", highlight=False)
    stdout.print(f"searched {stats.configurations} configurations ({stats.refused} more shapes refused by their "
                 f"method): {stats.stale} too stale and {stats.over_memory_floor} over the cap by their memory floor "
                 f"({stats.simulated_over_limits} of them simulated to show what the limits cost), {stats.pruned} "
                 f"pruned by the throughput bound, {stats.simulated} simulated; {stats.seconds:.2f} s",
                 highlight=False)
    for note in tuning.notes:
        stdout.print(f"note: {note}", highlight=False)

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
