"""The `pipesim` command line. It orchestrates: schedules -> sim -> traces. Heavy imports stay inside
the commands that need them, so `pipesim simulate` starts fast and never imports torch."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
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
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile from `pipesim calibrate`: per-stage times, bytes and links from measurements (replaces the cost and size flags; other stage counts re-partition its layers).")] = None,
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
        measured = _load_profile(ctx, profile) if profile is not None else None
        if measured is not None and not _given(ctx, "stages"):
            stages = measured.partition.stages

        def build(name: str):
            defaults = METHODS[name].defaults
            params = ScheduleParams(
                dag[0].num_stages if dag and name == "graphpipe" else stages, microbatches, minibatches,
                chunks if chunks is not None else defaults.get("chunks", 1),
                pipelines if pipelines is not None else defaults.get("pipelines", 1),
                advance, average_every, elastic_alpha)
            if name == "graphpipe" and (dag or measured):
                from .schedules.graph import graph_schedule

                return graph_schedule(params, *dag) if dag else graph_schedule(params, _profile_graph(measured, stages))
            return build_schedule(name, params)

        def costs_for(sched) -> Costs:
            """Per-model-stage costs. The example spreads one device's share of the model over its chunks,
            so every method trains the same model."""
            if measured is not None:
                return _profile_costs(measured, sched, optimizer)
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
            links = topology or (
                _profile_cluster(measured, sched.num_devices, not blocking_comm) if measured and measured.link
                else Cluster.uniform(sched.num_devices, comm_ms[0], overlap_comm=not blocking_comm))
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


PROFILE_COSTS = ("fwd", "bwd", "wgrad_fraction", "opt", "pred", "avg", "param_mb", "activation_mb", "output_mb",
                 "microbatch_size", "graph")


def _load_profile(ctx: typer.Context, path: Path):
    """A calibration profile. It fixes the costs, sizes and (when it measured them) links, so flags that set
    those would be silently ignored: refuse them instead."""
    from .calibrate.profile import ProfileError, load_profile

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
    """The profile's own partition for its stage count; other counts re-partition its layers for time (the
    memory cap applied at calibration, for 1F1B with one stage per device)."""
    from .calibrate.partition import partition
    from .calibrate.profile import layer_costs

    if num_stages == measured.partition.stages:
        return measured.partition.bounds
    if num_stages > len(measured.layers):
        raise InputError(f"--profile: the schedule has {num_stages} model stages but the profile's model has "
                         f"{len(measured.layers)} layers; lower --stages or --chunks")
    return partition(layer_costs(measured.layers, measured.partition.optimizer), num_stages)


def _profile_graph(measured, num_stages: int):
    """The stage DAG of the profile's model cut into `num_stages` (a chain unless its layers branch)."""
    from .calibrate.profile import stage_edges
    from .schedules.ir import StageGraph

    return StageGraph(num_stages, tuple(stage_edges(measured.layers, _profile_bounds(measured, num_stages))))


def _profile_costs(measured, sched, optimizer: str):
    """Costs of the profile's layers cut into the schedule's model stages, with `optimizer`'s update and
    prediction; AvgPipe's averaging step pulls all P replicas."""
    from .calibrate.profile import stages_for
    from .schedules.ir import StageGraph
    from .sim import Costs, StageCosts

    n = sched.num_stages
    stages = stages_for(measured, _profile_bounds(measured, n), dag=sched.graph.edges != StageGraph.chain(n).edges)
    return Costs(tuple(StageCosts(
        fwd_ms=s.fwd_ms, bwd_ms=s.bwd_ms, wgrad_fraction=s.wgrad_fraction, opt_ms=s.steps[optimizer].step.median_ms,
        pred_ms=s.steps[optimizer].predict.median_ms, avg_ms=s.average.median_ms * sched.pipelines,
        param_bytes=s.param_bytes, activation_bytes=s.activation_bytes, output_bytes=s.output_bytes,
        optimizer_state_bytes=s.optimizer_state_bytes[optimizer]) for s in stages),
        microbatch_size=measured.environment.microbatch_size)


def _profile_cluster(measured, num_devices: int, overlap_comm: bool):
    """Every device pair gets the measured p2p link, a resource of its own (transfers on one link queue);
    devices are the calibrated device with its memory (or the cap calibration planned for)."""
    from .sim import Cluster, Link

    env = measured.environment
    segments = tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in measured.link.segments)
    pairs = {(a, b): Link(resource=f"link {a}->{b}", segments=segments)
             for a in range(num_devices) for b in range(num_devices) if a != b}
    memory = env.memory_cap_bytes or env.device_memory_bytes
    return Cluster(num_devices, Link(segments=segments), pairs, (env.device_name,) * num_devices,
                   (memory,) * num_devices, overlap_comm)


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
    from .calibrate.partition import PartitionError
    from .calibrate.profile import OPTIMIZERS, profile_json
    from .traces import write_atomic

    try:
        _writable("--out", out)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(f"--dtype: choose float32, bfloat16 or float16 (got {dtype!r})")
        if optimizer not in OPTIMIZERS:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZERS)} (got {optimizer!r})")
        if memory_gb is not None and not 0 < memory_gb < float("inf"):
            raise InputError(f"--memory-gb: must be a number of GiB > 0 (got {memory_gb})")
        if not links and _given(ctx, "link_max_mb"):
            raise InputError("--link-max-mb sizes the link measurement, which --no-links skips: give one")
        if links and not 4 << 10 <= link_max_mb * MIB < float("inf"):
            raise InputError(f"--link-max-mb: must be at least 4 KiB ({4 / 1024:g} MiB), got {link_max_mb}")
        from .calibrate.links import LinkError, default_sizes
        from .calibrate.measure import DTYPES, DeviceError, Settings, resolve_device
        from .calibrate.measure import calibrate as run_calibration
        from .calibrate.models import ModelError, build_model

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
        write_atomic(out, profile_json(profile))
    except InputError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write output: {exc.filename}: {exc.strerror}")
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
