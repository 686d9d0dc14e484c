"""`pipesim sweep`: a grid of configurations simulated in parallel, and the Pareto fronts of the results."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from ..traces.metrics import STALENESS_HEADER, mib_text, ms_text, percent_text, rate_text
from ..units import MAX_MS, count_text, degree_text, rounds_text, whole_number
from .common import (
    COUNTING_MODEL,
    LEAST_MS,
    ROW_COSTS,
    SWEEP_RESULTS,
    Allocator,
    BlockingComm,
    DataParallel,
    DeviceMemoryGb,
    HeldOptimizer,
    HeldPrecision,
    InputError,
    MicrobatchSize,
    NetworkGbS,
    OptimizerStep,
    PpRuntime,
    Recompute,
    ReduceAfterFlush,
    Rounds,
    SearchSeconds,
    ShardedOptimizer,
    StageCut,
    TensorParallel,
    WgradFraction,
    Zero,
    allocator_fields,
    check_allocator,
    check_cluster_memory,
    check_estimate_experts,
    check_estimate_overlap,
    check_memory_cap,
    check_method_options,
    check_outputs,
    check_p2p_sync,
    check_row_costs,
    expert_overlap_options,
    fail,
    finite_from,
    flag_of,
    given_simulate_flags,
    memory_gb_bytes,
    model_reads,
    optional_what_if_options,
    output_path,
    prices_rows_of,
    progress,
    read_error,
    require,
    say_what_if_counted,
    scenario_from_flags,
    search_options,
    stderr,
    stdout,
    transient_status,
    writing,
    zero_stage,
)
from .estimate import count_what_if, estimated_profile, experts_moved_text, peak_text, what_if
from .tables import add_columns, print_message, print_table, said_once

if TYPE_CHECKING:
    from ..planning.sweep import Config

MAX_PORT = 65_535  # a TCP port's largest
RAY_NAMED = ("auto", "local")  # --ray addresses Ray resolves itself: the cluster running here, or a new one


def _check_answers(address: str) -> None:
    """Refuse a --ray HOST:PORT (or ray://HOST:PORT) that nothing answers at, before any work: ray.init retries one
    for minutes, writing its own log lines (`--ray nosuch:1` still had no answer after 5 minutes). "auto" and
    "local" are Ray's to resolve; an address without a host or a port (`--ray foo`: ray.init's traceback), or with
    digits that are no port (past 65,535, where socket dialled another; '²', which int() refuses), is refused."""
    import socket

    if address in RAY_NAMED:
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    number = whole_number(port, MAX_PORT) if port.isdigit() else None  # isdigit passes '²', which int() refuses
    if not host.strip() or number is None:  # ray.init's traceback ("Invalid address format: foo")
        raise InputError(f"--ray: give auto, local, HOST:PORT or ray://HOST:PORT, with a port from 0 to "
                         f"{MAX_PORT:,} (got {address!r})")
    try:
        socket.create_connection((host.strip("[]"), number), timeout=5).close()
    except OSError as exc:
        raise InputError(f"--ray {address}: nothing answers at {host}:{port} ({exc.strerror or exc})") from None


def _unreached(address: str, exc: ConnectionError) -> str:
    """Ray's first line of why it reached no cluster, in pipesim's words: `--ray auto` with none running here said
    to set "the `--address` flag", which is Ray's CLI's, not pipesim's."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if address == "auto" and "Could not find any running Ray instance" in said:
        return ("--ray auto: no Ray cluster runs on this host: start one (`ray start --head`), give its HOST:PORT, "
                "or give --ray local to start one for this sweep")
    return f"--ray {address}: {said}"


@optional_what_if_options
@expert_overlap_options
def sweep(
    ctx: typer.Context,
    schedule: Annotated[list[str] | None, typer.Option(
        "--schedule", "-s", metavar="NAME[,NAME...]", help="Methods, comma-separated (default: all).")] = None,
    stages: Annotated[list[str] | None, typer.Option(
        "--stages", "-p", metavar="P[,P...]", help="Pipeline depths p, comma-separated (default: 4, or the "
                                                   "profile's).")] = None,
    microbatches: Annotated[list[str] | None, typer.Option(
        "--microbatches", "-m", metavar="M[,M...]", help="Micro-batches per mini-batch m, comma-separated "
                                                         "(default: 8).")] = None,
    chunks: Annotated[list[str] | None, typer.Option(
        "--chunks", "-v", metavar="V[,V...]", help="Chunks per device v, comma-separated; only interleaved and V "
                                                   "schedules read them (default: each method's).")] = None,
    pipelines: Annotated[list[str] | None, typer.Option(
        "--pipelines", "-P", metavar="P[,P...]", help="Parallel pipelines P, comma-separated; only avgpipe reads them "
                                                      "(default: 2).")] = None,
    prediction: Annotated[list[str] | None, typer.Option(
        "--prediction", metavar="SOURCE[,SOURCE...]", help="Sources of the prediction distance s, comma-separated: "
                                                           "paper, code, counted; only spectrain, pipeoptim and xpipe "
                                                           "read them, and a method skips a source it records no form "
                                                           "from (default: each method's primary source).")] = None,
    activation_limit: Annotated[list[str] | None, typer.Option(
        "--activation-limit", metavar="R[,R...]", help="auto's activation limits R, comma-separated: the peak "
                                                       "activation memory any device may hold, as a multiple of "
                                                       "1F1B's peak on its fullest device (default: 1); only auto "
                                                       "reads them.")] = None,
    search_seconds: SearchSeconds = None,
    cost_scale: Annotated[list[str] | None, typer.Option(
        "--cost-scale", metavar="X[,X...]", help="Factors on every compute time, comma-separated: a faster or slower "
                                                 "accelerator on the same links (default: 1).")] = None,
    grid: Annotated[Path | None, typer.Option(
        "--grid", metavar="TOML", help="TOML file giving axes by these flags' names, e.g. stages = [4, 8] and "
                                       "cost-scale = [0.5, 1].")] = None,
    minibatches: Annotated[int, typer.Option(
        "--minibatches", "-n", metavar="N", min=1, help="Mini-batches N per run (several, so time per mini-batch is "
                                                        "the steady state).")] = 4,
    fwd: Annotated[str, typer.Option(
        "--fwd", metavar="MS", help="Forward ms per micro-batch of the whole model, split evenly over each "
                                    "configuration's p·v model stages (every configuration trains the same "
                                    "model).")] = "4",
    bwd: Annotated[str, typer.Option(
        "--bwd", metavar="MS", help="Full backward ms per micro-batch of the whole model (split likewise).")] = "8",
    wgrad_fraction: WgradFraction = 0.5,
    opt: Annotated[float, typer.Option(
        "--opt", metavar="MS", callback=finite_from(0, MAX_MS, least=LEAST_MS),
        help="Optimizer step ms of the whole model (split likewise).")] = 0.4,
    pred: Annotated[float | None, typer.Option(
        "--pred", metavar="MS", callback=finite_from(0, MAX_MS, least=LEAST_MS),
        help="Weight prediction (PRED) ms of the whole model (split likewise; default: --opt).")] = None,
    avg: Annotated[float | None, typer.Option(
        "--avg", metavar="MS", callback=finite_from(0, MAX_MS, least=LEAST_MS),
        help="Elastic averaging (AVG) ms of the whole model per pipeline (split likewise; averaging P pipelines' "
             "replicas takes P times it; default: --opt).")] = None,
    comm: Annotated[str, typer.Option(
        "--comm", metavar="MS", help="Milliseconds per activation or gradient transfer between devices "
                                     "(no contention).")] = "0.1",
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", metavar="JSON", help="Cluster JSON (devices, links, shared resources); replaces --comm.")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", metavar="JSON", help="Profile from `pipesim calibrate` (or `pipesim estimate`): its layers cut "
                                          "into each configuration's stages give the costs, sizes and links.")] = None,
    param_mb: Annotated[str, typer.Option(
        "--param-mb", metavar="MIB", help="Parameter MiB of the whole model (split likewise).")] = "1024",
    activation_mb: Annotated[str, typer.Option(
        "--activation-mb", metavar="MIB", help="Activation MiB a micro-batch saves in the whole model (split "
                                               "likewise).")] = "256",
    output_mb: Annotated[str, typer.Option(
        "--output-mb", metavar="MIB", help="MiB a stage sends to the next per micro-batch.")] = "8",
    optimizer: HeldOptimizer = "adam",
    precision: HeldPrecision = None,
    microbatch_size: MicrobatchSize = 1,
    blocking_comm: BlockingComm = False,
    tensor_parallel: TensorParallel = 1,
    data_parallel: DataParallel = 1,
    reduce_after_flush: ReduceAfterFlush = False,
    rounds: Rounds = 1,
    sharded_optimizer: ShardedOptimizer = False,
    zero: Zero = None,
    network_gb_s: NetworkGbS = None,
    recompute: Recompute = "none",
    allocator: Allocator = "caching",
    optimizer_step: OptimizerStep = "held",
    pp_runtime: PpRuntime = "pipesim",
    stage_cut: StageCut = "balanced",
    memory_gb: DeviceMemoryGb = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", "-j", metavar="N", min=1,
        help="Worker processes (default: one per CPU core this process may use, where the grid's work pays for "
             "starting them).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS", help="Run the tasks on the Ray cluster at this address instead (auto, "
                                         "ray://host:10001, or local to start one); needs pipesim[ray] (ray:// "
                                         "needs ray[client]).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar="FILE", parser=output_path,
        help="Results, one row per configuration: .csv, or .parquet (needs pyarrow); replaced atomically.")] = None,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", parser=output_path,
        help="Write the trade-off view: time per mini-batch vs peak memory, a colour per schedule, a symbol per "
             "staleness, one Pareto front at a time (self-contained HTML).")] = None,
) -> None:
    """Simulate a grid of configurations; find their Pareto fronts. The configurations run in parallel; the
    fronts are of time, memory and staleness.

    Axes are comma lists (an axis flag given again adds its values), or a TOML file (--grid).
    A configuration a method cannot run is a row with status "skipped" and the reason.
    One front per p, cost scale and mini-batch size (m·P): only the same work on the same hardware competes.
    Costs are the whole model's, split over each configuration's stages (default: the built-in example's), or
    with --gpu the model's (--model and its size flags) estimated on a catalogue GPU for each p.
    """

    from ..planning.sweep import (
        AXES,
        Grid,
        GridError,
        Result,
        estimate_degrees,
        load_grid,
        one_row_per_schedule,
        pareto_front,
        parse_axis,
        run,
        where_text,
        write_results,
    )
    from ..profiles.workload import most_stages
    from ..schedules import METHODS
    from ..sim import ClusterError

    try:
        if out is not None and out.suffix not in (".csv", ".parquet"):  # first: no other file would be taken
            raise InputError(f"--out: give a .csv or .parquet file (got {out})")
        check_outputs([("--out", out, SWEEP_RESULTS), ("--html", html)],
                      [("--grid", grid), ("--profile", profile), ("--cluster", cluster), *model_reads(ctx.params)])
        if out is not None and out.suffix == ".parquet":
            require(f"--out {out} (Parquet; a .csv file needs nothing more)", "pyarrow")
        if ray is not None:
            require(f"--ray {ray}", "ray")
            if ray.startswith("ray://") and importlib.util.find_spec("grpc") is None:  # else ray.init's traceback
                raise InputError(f"--ray {ray}: a ray:// address is Ray Client's, which needs grpcio: pip install "
                                 "'ray[client]'")
            _check_answers(ray)
        if ray is not None and workers is not None:
            raise InputError("--workers sizes the local process pool, --ray runs on the cluster's CPUs: give one")
        search = search_options(None, search_seconds)
        # an axis flag given again adds its values: `-s 1f1b -s zb-h1` sweeps both (click kept the last alone)
        given = {key: ",".join(ctx.params[key.replace("-", "_")]) for key in AXES if ctx.params[key.replace("-", "_")]}
        for limit in given["activation-limit"].split(",") if "activation-limit" in given else ():
            search_options(limit.strip(), None)  # each R as simulate checks its one
        axes = load_grid(grid) if grid is not None else {}
        if grid is not None and not axes:  # an empty or all-comment file swept the default grid, exit 0
            raise InputError(f"--grid: {grid} gives no axis; give one or more of {', '.join(AXES)}")
        for key, text in given.items():
            if key in axes:
                raise InputError(f"--{key} and --grid both give {key}: give one")
            axes[key] = parse_axis(key, text)
        # an axis of options no method in the grid reads was dropped, as if not given: `-s 1f1b --chunks 2`, or
        # `-s 1f1b` with a --grid file's `chunks = [2]`
        check_method_options(ctx, axes.get("schedule", METHODS), ("--chunks", "--pipelines", "--prediction",
                                                                  "--activation-limit", "--search-seconds"),
                             given=(key.replace("-", "_") for key in axes))
        check_row_costs(ctx, axes.get("schedule", METHODS))
        what = what_if(ctx)
        check_allocator(ctx, what)
        memory_bytes = memory_gb_bytes(memory_gb)
        if what is not None:
            check_memory_cap(memory_bytes, what.gpu.device_memory_bytes, ctx.params["gpu"])
        scenario = replace(scenario_from_flags(ctx, "model"), memory_bytes=memory_bytes)
        if scenario.measured is not None and what is None:  # a profile's part as it records it
            check_memory_cap(memory_bytes, scenario.measured.environment.device_memory_bytes,
                             scenario.measured.estimate and scenario.measured.estimate.gpu)
        data_parallel = ctx.params["data_parallel"]  # a --profile estimate's own d where none was given
        check_p2p_sync(ctx, axes.get("schedule", METHODS), scenario.measured)
        lists = [flag for flag, values in scenario.per_stage.items() if len(values) > 1]
        if lists:
            raise InputError(f"{lists[0]}: give one number, the whole model's; the stage count varies across a "
                             "sweep, so one value per stage fits no grid (--profile gives per-layer costs)")
        configs = Grid(
            axes.get("schedule", tuple(METHODS)),
            axes.get("stages", (scenario.measured.partition.stages if scenario.measured else 4,)),
            axes.get("microbatches", (8,)), minibatches, axes.get("chunks"), axes.get("pipelines"),
            axes.get("cost-scale", (1.0,)), axes.get("prediction"), axes.get("activation-limit"),
            search["search_seconds"], data_parallel, reduce_after_flush, zero_stage(ctx.params), rounds).configs()
        check_cluster_memory(memory_bytes, scenario.topology, cluster, max(config.stages for config in configs))
        for p in sorted({config.stages for config in configs}) if what is None else ():
            check_estimate_experts(scenario.measured, p, data_parallel)
        if what is None:
            check_estimate_overlap(scenario.measured, ctx.params.get("overlap_expert_comm", False))
        # (scenario, the configurations it runs): an estimate depends on p (which links a stage boundary crosses)
        jobs = [(scenario, list(range(len(configs))))]
        too_deep = []  # (index, result) of each configuration whose p has more stages than the model has layers
        if what is not None:
            with transient_status(COUNTING_MODEL, quiet=False):  # a first count imports torch: seconds
                counted = count_what_if(what, microbatch_size)
            jobs = []
            for p in sorted({config.stages for config in configs}):
                indices = [i for i, config in enumerate(configs) if config.stages == p]
                parallel = what.parallelism(p, tensor_parallel, data_parallel, recompute)
                try:
                    estimated = estimated_profile(what, counted, parallel, optimizer)
                except InputError as exc:  # skipped, as --profile skips it (the whole grid had stopped); another
                    if p <= most_stages(counted.layers):  # refusal holds at every p: its one line
                        raise
                    too_deep += [(i, Result(configs[i], reason=str(exc))) for i in indices]
                    continue
                jobs.append((replace(scenario_from_flags(ctx, "model", estimated=estimated), memory_bytes=memory_bytes,
                                     **allocator_fields(allocator, counted, parallel, optimizer_step)), indices))
            say_what_if_counted(what)
        results = [None] * len(configs)
        sweeps = [(indices, run(shared, [configs[i] for i in indices], workers, ray)) for shared, indices in jobs]
        finished = itertools.chain(too_deep, ((indices[i], result) for indices, sweep in sweeps for i, result in sweep))
        for i, result in progress(finished, False, len(configs)):
            results[i] = result
        refused = _limit_refused(results)
        if refused:
            raise InputError(refused)
        if all(r.metrics is None for r in results):  # an empty front, exit 0 and no reason, before: as simulate
            raise InputError(f"no configuration runs: {results[0].reason}" + (  # says when none of its methods can
                f" (and {len(results) - 1:,} more skipped)" if len(results) > 1 else ""))
        line = _simulate_line(ctx, scenario.measured is None and what is None,
                              what is None and scenario.topology is None and not (scenario.measured
                                                                                 and scenario.measured.link))
        results = one_row_per_schedule([replace(r, command=line(r.config)) for r in results])
        front = pareto_front(results)
        shown = jobs[0][0]  # under --gpu an estimate's, its allocations replayed or not as every p's are
        degrees = estimate_degrees(shown.measured)
        if out is not None:
            with writing("--out"):
                write_results(results, out, degrees)
        if html is not None:
            from ..planning.sweep import write_tradeoff_html

            with writing("--html"):
                write_tradeoff_html(results, front, html, degrees)
    except (InputError, GridError, ClusterError) as exc:
        fail(str(exc))
    except ConnectionError as exc:  # Ray could not reach the cluster
        fail(_unreached(ray, exc))
    except OSError as exc:
        fail(read_error(exc))
    estimate = shown.measured.estimate if shown.measured is not None else None
    moved = "" if estimate is None or what is not None else experts_moved_text(
        estimate, ((r.config.stages, r.config.data_parallel) for r in results))
    _print_front(results, front, peak_text(shown.measured, what, shown), out, html, moved, degrees)
    _print_skipped(results, out)
    _warn_if_none_fits(results)
    stdout.print(where_text([sweep for _, sweep in sweeps]), highlight=False)
    for path in (out, html):
        if path is not None:
            stdout.print(f"wrote {path}", highlight=False, markup=False)


# Sweep's built-in costs are the whole model's, split over each configuration's p·v stages; simulate's a device's,
# split over its v: a row's line gives simulate each one over p. Sweep's --comm default (0.1 ms, the built-in
# example's) is not simulate's (0), so a row's line gives it wherever it prices the links.
WHOLE_MODEL_COSTS = ("fwd", "bwd", "opt", "pred", "avg", "param_mb", "activation_mb")
# What each row's line gives of its own (its configuration), or simulate reads otherwise (--html: sweep's page)
ROW_OWN = ("schedule", "stages", "microbatches", "minibatches", "chunks", "pipelines", "prediction",
           "activation_limit", "search_seconds", "cost_scale", "html")


def _simulate_line(ctx: typer.Context, built_in: bool, comm_read: bool) -> Callable[[Config], str]:
    """Each row's `pipesim simulate` line: the flags the user gave that simulate takes alike, then the row's
    configuration; where the costs are the built-in flags' (`built_in`), each a device's share of the whole model's,
    and where the links are --comm's (`comm_read`), its milliseconds, whose defaults differ between the two. A flag
    pricing rows the row's order does not run (`ROW_COSTS`) is left out of its line, which simulate would refuse."""
    from ..schedules import METHODS

    left_out = {*ROW_OWN, *(WHOLE_MODEL_COSTS if built_in else ()), *(("comm",) if comm_read else ())}
    comm = [["--comm", ctx.params["comm"]]] if comm_read else []

    @functools.cache
    def given(method: str) -> list[list[str]]:
        return given_simulate_flags(ctx, left_out | {p for p in ROW_COSTS if not prices_rows_of(METHODS[method], p)})

    def line(c: Config) -> str:
        method = METHODS[c.schedule]
        costs = [[flag_of(name), repr(float(ctx.params[name]) / c.stages)] for name in WHOLE_MODEL_COSTS
                 if built_in and ctx.params[name] is not None and prices_rows_of(method, name)]
        own = [("-s", c.schedule), ("-p", c.stages), ("-m", c.microbatches), ("-n", c.minibatches),
               ("-v", c.chunks if method.reads("chunks") else None),
               ("-P", c.pipelines if method.reads("pipelines") else None), ("--prediction", c.prediction),
               ("--activation-limit", c.activation_limit), ("--search-seconds", c.search_seconds),
               ("--cost-scale", c.cost_scale if c.cost_scale != 1 else None)]
        pieces = [["pipesim", "simulate"], *given(c.schedule), *comm, *costs,
                  *([flag, repr(value) if isinstance(value, float) else str(value)] for flag, value in own
                    if value is not None)]
        return " ".join(map(shlex.join, pieces))
    return line


SKIPPED_REASONS = 5  # the skipped rows' reasons the terminal gives; --out holds each row's
# a reason's figures, not the digits of a name (zb-h2, 1f1b, fp8): its form is the reason without them
FIGURE = re.compile(r"(?<![\w-])\d[\d,.]*(?!\w)")


def _print_skipped(results: list, out: Path | None) -> None:
    """Why configurations were skipped, on stderr as simulate says it: each reason once, after the configurations
    it holds for (`Config.label`), the first `SKIPPED_REASONS` of them. Reasons that differ in their figures alone
    (zb-h2's "at least 2p-1 = 5 micro-batches (got m=4)" at each p and m) are one: the first said whole, the
    configurations of the rest counted after it."""
    by_form: dict[str, dict[str, list[str]]] = {}
    for r in results:
        if r.metrics is None:
            by_form.setdefault(FIGURE.sub("#", r.reason), {}).setdefault(r.reason, []).append(r.config.label)
    for by_reason in list(by_form.values())[:SKIPPED_REASONS]:
        (reason, labels), *others = by_reason.items()
        named = ", ".join(labels[:3]) + (f" and {len(labels) - 3:,} more" if len(labels) > 3 else "")
        likewise = sum(len(other) for _, other in others)
        alike = (f" (likewise {count_text(likewise, 'more configuration')}, each with its own figures)" if likewise
                 else "")
        print_message(f"{named}: {reason}{alike}", stderr, "skipped: ")
    if len(by_form) > SKIPPED_REASONS:
        more = count_text(len(by_form) - SKIPPED_REASONS, "more reason")
        where = f"{out}'s reason column gives" if out is not None else "--out FILE.csv's reason column would give"
        print_message(f"{more}: {where} each row's", stderr, "skipped: ")


def _warn_if_none_fits(results: list) -> None:
    """Where every configuration that ran is past a device's memory, say so on stderr, as simulate warns of a row
    out of memory: the table's OOM column alone said it, row by row."""
    ran = [r for r in results if r.metrics is not None]
    if ran and all(r.metrics.out_of_memory for r in ran):
        leanest = min(ran, key=lambda r: r.metrics.peak_memory_mb)
        print_message(f"no configuration fits its devices' memory: the leanest, {leanest.config.label}, peaks at "
                      f"{mib_text(leanest.metrics.peak_memory_mb)} MiB", stderr, "warning: ")


def _limit_refused(results: list) -> str | None:
    """The reason, if an activation limit leaves less than one micro-batch of activations in every configuration
    searched with it: a flag value no configuration can use (where only some cannot, those are skipped rows)."""
    by_limit: dict[float, list] = {}
    for r in results:
        if r.config.activation_limit is not None:
            by_limit.setdefault(r.config.activation_limit, []).append(r)
    return next((rows[0].reason for rows in by_limit.values() if all(r.limit_refused for r in rows)), None)


FRONT_ROWS = 20  # the terminal's share of the Pareto fronts; --out and --html have them all
# the fronts' short headers in words, under the table: a header must stay narrow for the table to fit 80 columns;
# each column every row agrees on is said there once instead (`said_once`: the grid sweep's s and R, all "-")
FRONT_HEADERS = {"v": "chunks per device", "P": "pipelines", "cost×": "the costs' scale",
                 "s": "the source of prediction distances (--prediction)",
                 "R": "auto's activation limit, in 1F1B's peak"}


def _replicas_text(config) -> str:
    """For the caption: the data-parallel replicas every configuration runs (one --data-parallel, or a --profile
    estimate's own d) and how they shard and reduce, where there are more than one, and the rounds a mini-batch
    runs in (--rounds), where more than one: no column shows them."""
    rounds = f"; each mini-batch{rounds_text(config.rounds)} (--rounds) in every row" if config.rounds > 1 else ""
    if config.data_parallel == 1:
        return rounds
    zero = f", ZeRO-{config.zero}" if config.zero else ""
    flush = ", each reduced after its flush" if config.reduce_after_flush else ""
    return f"; {degree_text('d', config.data_parallel)} replicas in every row{zero}{flush}{rounds}"


def _whole_fronts(results: list, front: list[int]) -> list[int]:
    """The first fronts whose rows together are at most FRONT_ROWS (of a first front longer than that, its fastest
    FRONT_ROWS): the terminal cut one front after 2 of its 3 rows."""
    from ..planning.sweep import front_group

    groups = [front_group(results[i].config) for i in front]
    ends = [k for k in range(1, len(front) + 1) if k == len(front) or groups[k] != groups[k - 1]]
    return front[:max([end for end in ends if end <= FRONT_ROWS], default=FRONT_ROWS)]


def _on_fronts_text(results: list, front: list[int]) -> str:
    """How many of the configurations that ran are on a front: "18 of the 40 configurations that ran", or "the 1
    configuration that ran" where all are (it read "1 of the 1 configuration that ran")."""
    from ..planning.sweep import ran_text

    ran = sum(r.metrics is not None for r in results)
    return f"{'the' if len(front) == ran else f'{len(front):,} of the'} {ran_text(results)}"


def _print_front(results: list, front: list[int], peak: str, out: Path | None, html: Path | None,
                 moved: str = "", degrees: dict[str, int] | None = None) -> None:
    """The Pareto fronts, one section per p, cost scale and mini-batch size, fastest first; `peak`: what the peak
    column is (`peak_text`); `moved`: how a --profile's all-to-alls are priced where a row's p and d place its
    expert-parallel group otherwise (`experts_moved_text`); `degrees`: the estimate's t, C and E every row runs
    (`estimate_degrees`)."""
    from ..planning.sweep import degrees_text, front_group

    shown = _whole_fronts(results, front)
    every = degrees_text(degrees or {})
    over = any(results[i].metrics.out_of_memory for i in shown)  # a front of a model the devices cannot hold
    folds = any(results[i].same_as for i in shown)
    configs, metrics = [results[i].config for i in shown], [results[i].metrics for i in shown]
    marks = ["" if m.steady_state else "*" for m in metrics]
    columns = {
        "p": [str(c.stages) for c in configs], "m": [str(c.microbatches) for c in configs],
        "v": [str(c.chunks) for c in configs], "P": [str(c.pipelines) for c in configs],
        "cost×": [f"{c.cost_scale:g}" for c in configs], "s": [c.prediction or "-" for c in configs],
        "R": ["-" if c.activation_limit is None else f"{c.activation_limit:g}" for c in configs],
        "ms/step": [ms_text(m.time_per_minibatch_ms) + mark for m, mark in zip(metrics, marks)],
        "samples/s": [rate_text(m.samples_per_s) + mark for m, mark in zip(metrics, marks)],
        "bubble": [percent_text(m.bubble_fraction) for m in metrics],
        "peak MiB": [mib_text(m.peak_memory_mb) for m in metrics],
        STALENESS_HEADER: [str(m.max_staleness) for m in metrics],
        **({"memory": ["OOM" if m.out_of_memory else "fits" for m in metrics]} if over else {}),
        **({"same schedule as": [", ".join(s.variant for s in results[i].same_as) or "-" for i in shown]}
           if folds else {}),
    }
    said = said_once(columns, tuple(FRONT_HEADERS))
    table = Table(title=f"Pareto fronts over time per mini-batch, peak memory and staleness, one per p, cost scale and "
                        f"mini-batch size: {_on_fronts_text(results, front)}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                  caption="; ".join(f"{header}: {text}" + (f", {said[header]} in every row" if header in said else "")
                                    for header, text in FRONT_HEADERS.items()) + "; -: not the method's"
                  + (f"; {peak}" if peak else "") + (f"; {every} in every row" if every else "")
                  + _replicas_text(configs[0])
                  + (f"; the all-to-alls are the profile's, {moved}" if moved else "")
                  + ("; memory: OOM where a device's peak is past its memory (simulate names the devices)"
                     if over else "")
                  + ("; * marks no steady state: -n is short of the order's, so step and samples/s include the "
                     "warm-up (leave out -n for enough)" if any(marks) else ""))
    table.add_column("schedule", no_wrap=True)
    shown_headers = add_columns(table, columns, said, left=("memory", "same schedule as"))
    group = None
    for row, c in enumerate(configs):
        if group is not None and group != front_group(c):
            table.add_section()
        group = front_group(c)
        table.add_row(c.schedule, *[columns[header][row] for header in shown_headers])
    print_table(table)
    if len(front) > len(shown):
        listed = [f"{out}'s pareto_front column marks them"] if out is not None else []
        listed += [f"{html} draws them"] if html is not None else []
        stdout.print(f"and {count_text(len(front) - len(shown), 'more row')} on the fronts after these: "
                     + (" and ".join(listed) if listed else "--out lists them (its pareto_front column), --html "
                        "draws them"), highlight=False, markup=False)

