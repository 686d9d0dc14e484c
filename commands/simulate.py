"""`pipesim simulate`, `pipesim schedules` and `pipesim export`: schedules by name, simulated side by side,
listed, or written for torch's runtime."""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from ..allocator import keep_freed_memory, no_huge_pages
from ..choices import unknown_names
from ..traces.hostload import usable_cpus
from ..traces.metrics import STALENESS_HEADER, mib_text, ms_text, percent_text, rate_text
from ..units import MAX_MS, MIB, count_text, degree_text, rounds_text
from .common import (
    LEAST_MS,
    TORCH_CSV,
    ActivationLimit,
    Advance,
    Allocator,
    AverageEvery,
    BlockingComm,
    Chunks,
    DataParallel,
    DeviceMemoryGb,
    ElasticAlpha,
    HeldOptimizer,
    HeldPrecision,
    InputError,
    Microbatches,
    MicrobatchGroup,
    MicrobatchSize,
    NetworkGbS,
    OptimizerBuckets,
    OptimizerStep,
    Pipelines,
    PpRuntime,
    PredictionSource,
    Recompute,
    ReduceAfterFlush,
    Rounds,
    SearchActivationMb,
    SearchBwd,
    SearchComm,
    SearchFwd,
    SearchSeconds,
    SearchWgradFraction,
    Seed,
    ShardedOptimizer,
    StageCut,
    Stages,
    TensorParallel,
    WgradFraction,
    Zero,
    allocator_fields,
    built_schedule,
    check_allocator,
    check_cluster_memory,
    check_estimate_experts,
    check_estimate_overlap,
    check_memory_cap,
    check_method_options,
    check_outputs,
    check_p2p_sync,
    check_prediction,
    check_row_costs,
    check_writable,
    expert_overlap_options,
    fail,
    finite_from,
    is_given,
    load_profile_flag,
    memory_gb_bytes,
    model_reads,
    optional_what_if_options,
    out_of_memory,
    out_of_memory_line,
    output_path,
    progress,
    read_error,
    refuse,
    refused_with_flags,
    say_what_if_counted,
    scenario_from_flags,
    search_options,
    searched_scenario,
    stderr,
    stdout,
    transient_status,
    with_help,
    writing,
    wrote_text,
    zero_stage,
)
from .estimate import (
    COUNTING_STATUS,
    MFU_PAST_PEAK_TEXT,
    ModelWork,
    check_estimate_limits,
    count_what_if,
    estimated_profile,
    expert_span_text,
    experts_moved_text,
    parallelism_text,
    peak_text,
    tensor_span_text,
    what_if,
)
from .tables import add_columns, print_message, print_table, said_once

if TYPE_CHECKING:
    from ..planning.scenario import SearchedAgain
    from ..planning.tune import Workers
    from ..sim.caching_allocator import LayerAllocations

EXAMPLE = {"stages": 4, "microbatches": 8, "comm": "0.1", "opt": 0.1, "html": Path("pipesim-example.html")}
# --jitter's log-normal sigma at most: at 3 a 3-sigma draw already multiplies a time by e^9 (about 8,000); larger
# ones overflowed the simulator's clock (inf x 0: its times summed to nan)
MAX_JITTER = 3.0
PROBE_MINIBATCHES = 2  # the fewest that show whether an order flushes (see steady_minibatches)


def _output_paths(path: Path, names: list[str]) -> list[Path]:
    """PATH for one schedule; PATH with `-<schedule>` before the suffix for several, PATH a file's name: a folder
    is refused as for one schedule (its traces were written beside it, `DIR-1f1b`, ...), and so is a stream
    (/dev/stdout, a FIFO: they were written to new files beside it, `/dev/stdout-1f1b`, ...)."""
    from ..traces.trace import writes_in_place

    if len(names) == 1:
        return [path]
    check_writable("--trace", path)
    if writes_in_place(path):
        raise InputError(f"--trace: {path} takes one trace, and {len(names)} methods' are written to files named "
                         "from PATH (PATH-<method>): give a file path, or one method")
    return [path.with_name(f"{path.stem}-{name}{path.suffix}") for name in names]


@optional_what_if_options
@expert_overlap_options
def simulate(
    ctx: typer.Context,
    schedule: Annotated[list[str] | None, typer.Option(
        "--schedule", "-s", help="Method to simulate (repeat to compare; see `pipesim schedules`). Default: "
                                 "all.", metavar="NAME")] = None,
    schedule_file: Annotated[Path | None, typer.Option(
        "--schedule-file", help="Simulate a torch.distributed.pipelining schedule CSV (one row per rank) instead of "
                                "--schedule.", metavar="CSV")] = None,
    stages: Stages = 4,
    chunks: Chunks = None,
    microbatches: Microbatches = 8,
    minibatches: Annotated[int | None, typer.Option(
        "--minibatches", "-n", metavar="N", min=1, help="Mini-batches (optimizer steps) N. Default: enough for "
                                                        "every method compared to reach its steady state; a "
                                                        "--schedule-file's step once.")] = None,
    pipelines: Pipelines = None,
    advance: Advance = None,
    microbatch_group: MicrobatchGroup = None,
    average_every: AverageEvery = 1,
    elastic_alpha: ElasticAlpha = None,
    prediction: PredictionSource = None,
    activation_limit: ActivationLimit = None,
    search_seconds: SearchSeconds = None,
    memory_gb: DeviceMemoryGb = None,
    graph: Annotated[Path | None, typer.Option(
        "--graph", help='graphpipe: stage DAG JSON {"stages": n, "edges": [[a, b], ...], "placement": [...]} (default: '
                        'built-in two-branch model).', metavar="JSON")] = None,
    fwd: Annotated[str, typer.Option(
        "--fwd", metavar="MS[,MS...]", help="Forward ms per micro-batch: one number, a device's share of the model "
                                            "(split over its chunks); p numbers, one per device; or p·v, one per "
                                            "model stage.")] = "1",
    bwd: Annotated[str, typer.Option(
        "--bwd", metavar="MS[,MS...]", help="Full backward ms per micro-batch, as --fwd.")] = "2",
    wgrad_fraction: WgradFraction = 0.5,
    fb_hidden_fraction: Annotated[float, typer.Option(
        "--fb-hidden-fraction", callback=finite_from(0, 1), metavar="H", show_default=False,
        help="Of each overlapped F&B pair (dualpipev), the share of its shorter part hidden under the longer: the pair "
             "takes F + B - H x min(F, B). Default 0: without expert parallelism's all-to-all there is nothing to "
             "hide.")] = 0.0,
    opt: Annotated[float, typer.Option(
        "--opt", callback=finite_from(0, MAX_MS, least=LEAST_MS), metavar="MS",
        help="Optimizer step ms per device (split over its chunks).")] = 0.0,
    pred: Annotated[float | None, typer.Option(
        "--pred", callback=finite_from(0, MAX_MS, least=LEAST_MS), metavar="MS",
        help="Weight prediction (PRED) ms per device (default: --opt).")] = None,
    avg: Annotated[float | None, typer.Option(
        "--avg", callback=finite_from(0, MAX_MS, least=LEAST_MS), metavar="MS",
        help="Elastic averaging (AVG) ms per device and pipeline: averaging P pipelines' replicas takes P times it "
             "(default: --opt).")] = None,
    cost_scale: Annotated[float, typer.Option(
        "--cost-scale", metavar="X", help="Factor on every compute time: a faster or slower accelerator on the same "
                                          "links (a sweep's --cost-scale axis).")] = 1.0,
    comm: Annotated[str, typer.Option(
        "--comm", metavar="MS", help="Milliseconds per activation or gradient transfer between devices (no "
                                     "contention).")] = "0",
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", metavar="JSON", help="Cluster JSON (devices and their memory, links with latency and bandwidth, "
                                          "shared resources); replaces --comm. A peak over a device's memory is "
                                          "marked OOM.")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", metavar="JSON", help="Profile from `pipesim calibrate` (or `pipesim estimate`): per-stage "
                                          "times, bytes and links (replaces the cost and size flags; other stage "
                                          "counts re-partition its layers).")] = None,
    param_mb: Annotated[str, typer.Option(
        "--param-mb", metavar="MIB[,MIB...]", help="Parameter MiB, as --fwd.")] = "256",
    activation_mb: Annotated[str, typer.Option(
        "--activation-mb", metavar="MIB[,MIB...]", help="Activation MiB a micro-batch saves, as --fwd.")] = "64",
    output_mb: Annotated[str, typer.Option(
        "--output-mb", metavar="MIB[,MIB...]", help="MiB a model stage sends to the next per micro-batch (one "
                                                    "number, or one per model stage; not split): sizes transfers "
                                                    "on --cluster links.")] = "8",
    optimizer: HeldOptimizer = "adam",
    microbatch_size: MicrobatchSize = 1,
    blocking_comm: BlockingComm = False,
    tensor_parallel: TensorParallel = 1,
    data_parallel: DataParallel = 1,
    network_gb_s: NetworkGbS = None,
    sharded_optimizer: ShardedOptimizer = False,
    zero: Zero = None,
    precision: HeldPrecision = None,
    reduce_after_flush: ReduceAfterFlush = False,
    rounds: Rounds = 1,
    optimizer_buckets: OptimizerBuckets = "megatron",
    recompute: Recompute = "none",
    allocator: Allocator = "caching",
    optimizer_step: OptimizerStep = "held",
    pp_runtime: PpRuntime = "pipesim",
    stage_cut: StageCut = "balanced",
    jitter: Annotated[float, typer.Option(
        "--jitter", callback=finite_from(0, MAX_JITTER), metavar="SIGMA",
        help="Sigma of a log-normal factor on every compute time (0: none).")] = 0.0,
    seed: with_help(Seed, "for --jitter.") = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
    memory_view: Annotated[bool, typer.Option(
        "--memory", help="Print each device's peak memory by what holds it (weights, gradients, optimizer state, "
                         "activations, transfer buffers) instead of the timing table.")] = False,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", parser=output_path,
        help="Write an interactive timeline (self-contained HTML).")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="PATH", parser=output_path,
        help="Write Chrome Trace Event JSON (Perfetto); -<schedule> is added for several.")] = None,
) -> None:
    """Predict schedules' timelines, bubbles, memory and staleness.

    With no options: a built-in example comparing every method on a 4-stage pipeline. With --gpu, the costs are
    the model's (--model and its size flags), counted on torch's meta device and estimated on a catalogue GPU.
    """
    # numpy's arrays of millions of rows, made and dropped: otherwise a quarter of the page faults and a third of
    # the system time of `simulate -p 128 -m 4096` (docs/benchmarks.md)
    keep_freed_memory()
    no_huge_pages()
    example = not any(is_given(ctx, name) for name in ctx.params)
    if example:
        stages, microbatches, comm, opt, html = (
            EXAMPLE[k] for k in ("stages", "microbatches", "comm", "opt", "html"))
    from ..schedules import METHODS, ScheduleError, steady_minibatches
    from ..schedules.analysis import overlapped_pairs
    from ..schedules.methods import above_zero_refusal
    from ..sim import ClusterError, CostError, SimulationError
    from ..sim import simulate as run_simulation
    from ..traces import write_traces

    names = schedule or list(METHODS)
    loaded = None
    try:
        if schedule_file is not None:
            loaded = _schedule_file(ctx, schedule_file)
            names = [loaded.method]
        # what the methods' rules are checked for: a schedule file's order is not the catalogue method its file
        # may be named after (its method is the file's name), so it reads no method's options nor --p2p-sync
        compared = [f"--schedule-file {schedule_file}"] if loaded else names
        unknown = [n for n in schedule or () if n not in METHODS]
        if unknown:
            raise InputError(unknown_names("--schedule", unknown, METHODS))
        if len(set(names)) != len(names):
            raise InputError("--schedule: each method may be given once")
        check_prediction(prediction)
        check_method_options(ctx, compared, ("--advance", "--microbatch-group", "--average-every", "--elastic-alpha",
                                              "--graph", "--prediction", "--activation-limit", "--search-seconds"))
        check_row_costs(ctx, names, loaded)
        check_p2p_sync(ctx, compared)  # the flag's refusals before the model is counted (a --profile's once read)
        search = search_options(activation_limit, search_seconds)
        memory_bytes = memory_gb_bytes(memory_gb)
        if jitter == 0 and is_given(ctx, "seed"):  # it seeds --jitter's draws alone: taken silently, it changed nothing
            raise InputError("--seed seeds --jitter's draws, and no --jitter was given: give --jitter SIGMA, or leave "
                             "--seed out")
        refuse(above_zero_refusal(cost_scale, "--cost-scale"))
        check_outputs([*(("--trace", path) for path in (_output_paths(trace, names) if trace else [])),
                       ("--html", html)],
                      [("--profile", profile), ("--cluster", cluster), ("--graph", graph),
                       ("--schedule-file", schedule_file), *model_reads(ctx.params)], as_json)
        if memory_view and as_json:
            raise InputError("--memory is a table; --json gives each device's breakdown as peak_memory_parts_mb: "
                             "give one")
        what = what_if(ctx, profile_reads=("expert_parallel",))
        check_allocator(ctx, what)
        if what is not None:  # before the count; a --profile's device once the scenario has read it
            check_memory_cap(memory_bytes, what.gpu.device_memory_bytes, ctx.params["gpu"])
        counted = parallel = estimated = None
        if what is not None:
            with transient_status(COUNTING_STATUS, as_json):
                counted = count_what_if(what, microbatch_size)
                parallel = what.parallelism(stages, tensor_parallel, data_parallel, recompute)
                estimated = estimated_profile(what, counted, parallel, optimizer)
                check_estimate_limits(estimated)
            say_what_if_counted(what)
        scenario = replace(scenario_from_flags(ctx, "device", schedule_file if loaded else None, estimated, comm=comm,
                                               opt=opt), overlap_hidden_fraction=fb_hidden_fraction,
                           cost_scale=cost_scale, memory_bytes=memory_bytes,
                           **allocator_fields(allocator, counted, parallel, optimizer_step))
        if what is None and scenario.measured is not None:  # a profile's part as it records it
            check_memory_cap(memory_bytes, scenario.measured.environment.device_memory_bytes,
                             scenario.measured.estimate and scenario.measured.estimate.gpu)
        check_p2p_sync(ctx, compared, scenario.measured)
        if scenario.dag is not None and is_given(ctx, "stages") and stages != scenario.dag[0].num_stages:
            placed = scenario.dag[0].num_stages  # graphpipe ran at the file's p whatever --stages said
            raise InputError(f"--stages: give {placed:,}, the --graph file's stages (graphpipe's p), or leave it out "
                             f"(got {stages:,})")
        work = ModelWork.of(scenario.measured)
        if work is not None:  # a part --cost-scale times as slow peaks at 1/--cost-scale of its FLOP/s
            work = replace(work, peak_flops_per_s=work.peak_flops_per_s / cost_scale)
        if scenario.measured is not None and not is_given(ctx, "stages"):
            stages = scenario.measured.partition.stages
        data_parallel = ctx.params["data_parallel"]  # a --profile estimate's own d where none was given
        experts = ctx.params.get("expert_parallel", 1)
        if what is None and experts > 1:
            _check_profile_experts(scenario.measured, experts, data_parallel)
        if what is None:
            check_estimate_experts(scenario.measured, stages, data_parallel)
            check_estimate_overlap(scenario.measured, ctx.params.get("overlap_expert_comm", False))

        def build(name: str, count: int, at=None):
            method = METHODS[name]
            options = method.read_options({"prediction": prediction, "microbatch_group": microbatch_group, **search})
            params = method.params(stages, microbatches, count, chunks, pipelines, advance=advance,
                                   average_every=average_every, elastic_alpha=elastic_alpha,
                                   data_parallel=data_parallel, zero=zero_stage(ctx.params),
                                   reduce_after_flush=reduce_after_flush, expert_parallel=experts, rounds=rounds,
                                   **options)
            return built_schedule(method, params, scenario if at is None else at, as_json)

        searched_again = {}  # per method searched again within the caching allocator's reserve

        requested, skipped = names, {}  # skipped: method -> why it cannot run here
        schedules = {loaded.method: loaded} if loaded else {}
        for name in () if loaded else names:
            try:
                schedules[name] = build(name, minibatches or PROBE_MINIBATCHES)
            except (ScheduleError, CostError) as exc:  # a searched method prices its costs as it is built
                from ..planning.auto import ActivationLimitError  # here: only auto raises it, and imports it

                if isinstance(exc, ActivationLimitError):  # a flag's value, not a method that cannot run here
                    raise InputError(str(exc)) from None
                skipped[name] = str(exc)
        if minibatches is None and not loaded:  # one N for the table: the most any method compared needs
            count = max(map(steady_minibatches, schedules.values()), default=PROBE_MINIBATCHES)
            for name, sched in list(schedules.items()):
                try:
                    schedules[name] = sched if sched.minibatches == count else build(name, count)
                except ScheduleError as exc:
                    del schedules[name]
                    skipped[name] = str(exc)
        _check_cost_lists(scenario, schedules)
        check_cluster_memory(memory_bytes, scenario.topology, cluster,
                             max((sched.num_devices for sched in schedules.values()), default=0))
        pairs = {name: overlapped_pairs(sched) for name, sched in schedules.items()}
        if fb_hidden_fraction and not any(pairs.values()):
            raise InputError(f"--fb-hidden-fraction prices overlapped F&B pairs, and none of {', '.join(schedules)} "
                             "runs one (dualpipev does): leave it out")
        summaries, traces, memory, cuts, costed = [], [], [], {}, {}
        with _Replays.started(scenario, schedules.values()) as replays:
            ran = []  # each method's schedule, trace and links, and its reserves as the workers find them
            for name, sched in progress(list(schedules.items()), as_json):
                try:
                    cuts[name] = scenario.cut(sched) if scenario.measured is not None else None
                    costs = costed[name] = scenario.costs(sched, cuts[name])
                    links = scenario.links(sched)  # built once: the simulation, reserve and memory checks read it
                    # each memory part's curve is drawn by the page and kept in a trace file, read by nothing else
                    result = run_simulation(sched, costs, links, jitter=jitter, seed=seed,
                                            part_curves=html is not None or trace is not None)
                except (ScheduleError, CostError, ClusterError, SimulationError) as exc:
                    skipped[name] = str(exc)
                    continue
                ran.append((name, sched, result, links, replays.start(scenario, sched, result, cuts[name], links)))
            for name, sched, result, links, reserves in progress(ran, as_json or scenario.allocations is None,
                                                                 doing=REPLAYING):
                scenario.add_reserve(sched, result, cuts[name], links, reserves())
                sched, result, summary, checks, again = scenario.within_reserve(
                    sched, result, links, lambda at: build(name, sched.minibatches, at),
                    lambda again, links: run_simulation(
                        again, scenario.costs(again, cuts[name]), links, jitter=jitter, seed=seed,
                        part_curves=html is not None or trace is not None))
                if again is not None:
                    searched_again[name] = again
                schedules[name] = sched
                traces.append(result)
                summaries.append(summary)
                memory.append(checks)
                result.meta.memory_checks = [check.record() for check in memory[-1]]  # for view's page of the trace
        names = [name for name in requested if name not in skipped]  # the methods that ran, in order
        skipped = {name: skipped[name] for name in requested if name in skipped}
        if not names:
            raise InputError(_nothing_runs(requested, skipped))
        built = [schedules[name] for name in names]
        steady = [sched.minibatches >= steady_minibatches(sched) for sched in built]
        gpus_used = [sched.num_devices * sched.data_parallel * (work.gpus_per_device if work else 1)
                     for sched in built]
        rates = [work.metrics(summary.samples_per_s, used) if work else {}
                 for summary, used in zip(summaries, gpus_used)]
        trace_paths = []
        if trace is not None:
            named = dict(zip(requested, _output_paths(trace, requested)))  # as asked for, whatever was skipped
            trace_paths = [named[name] for name in names]
            with writing("--trace"):  # all or none: a later one that cannot be written leaves no earlier
                write_traces(zip(traces, trace_paths))
        if html is not None:
            from ..traces.view import write_timeline_page

            replaced = example and html.is_file()  # the example's page has a name of its own: say what it replaced
            heading = ", ".join(names) if len(names) <= 4 else f"{len(names)} methods side by side"
            with writing("--html"):
                write_timeline_page(traces, html, title=f"pipesim: {heading}", labels=names, summaries=summaries,
                                    notes=[f"skipped: {_skip_text(name, reason)}" for name, reason in skipped.items()]
                                    + _out_of_memory_lines(summaries, memory)
                                    # the chart marks it where there is one (two methods or more)
                                    + ([] if all(steady) else [_unsteady_text(built, steady, len(built) > 1)]),
                                    memory_checks=memory, unsteady=[not is_steady for is_steady in steady])
    except (InputError, ScheduleError, CostError, ClusterError, SimulationError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(read_error(exc))

    if as_json:
        results = [summary.to_dict() for summary in summaries]
        for result, sched, is_steady, used, rate in zip(results, built, steady, gpus_used, rates):
            result["prediction"] = sched.params.get("prediction")  # the source of s used; null: no prediction
            result["minibatches"] = sched.minibatches
            result["rounds"] = sched.rounds  # flushes a mini-batch's micro-batches run in
            result["chunks"] = sched.num_stages // sched.num_devices  # v: the model stages a device runs, as labelled
            result["microbatch_group"] = sched.params.get("microbatch_group")  # G given; null: p, or none taken
            result["steady_state"] = is_steady  # false: time_per_minibatch_ms includes the warm-up
            result["overlapped_pairs"] = pairs[sched.method]  # F&B pairs over every device and mini-batch
            result["fb_hidden_fraction"] = fb_hidden_fraction if pairs[sched.method] else None
            result["pp_runtime"] = scenario.pp_runtime  # whose runtime held the boundary tensors (the peaks differ)
            result["cost_scale"] = cost_scale  # every compute time x it
            result["stage_bounds"] = cuts[sched.method]  # one copy's model stages' first layers, then the count
            if work:  # the what-if's totals: every GPU of the t x p x d
                result.update(gpus=used, **rate)
        for result, checks in zip(results, memory):
            for device, check in zip(result["devices"], checks):
                device.update(memory_limit_mb=None if check.limit_bytes is None else check.limit_bytes / MIB,
                              out_of_memory=check.out_of_memory,
                              memory_shared_with=[d for d in check.sharers if d != check.device])
        document = {"results": results, "skipped": [{"schedule": name, "reason": reason}
                                                    for name, reason in skipped.items()]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        if memory_view:
            _print_memory_table(summaries, built, memory, skipped)
        else:
            _print_table(summaries, built, steady, example, skipped, memory,
                         _cost_basis(scenario, built, work, peak_text(scenario.measured, what, scenario))
                         + _overlap_text(built, pairs, fb_hidden_fraction) + _scale_text(cost_scale, work)
                         + _runtime_text(scenario) + _cluster_text(scenario, built)
                         + _cut_text(scenario, {name: cuts[name] for name in names})
                         + _host_text(scenario, {name: cuts[name] for name in names})
                         + _searched_again_text(searched_again)
                         + _held_back_text(built, summaries, memory, [costed[name] for name in names]),
                         [rate.get("mfu") for rate in rates], work.per_device_text() if work else "")
        for path in trace_paths:  # --memory's too: it wrote them without a word
            stdout.print(f"wrote {path}", highlight=False)
        if html is not None:
            stdout.print(wrote_text(html, replaced), highlight=False)
    _warn(skipped, summaries, memory)


# where `_Replays` starts workers: a replay runs some 1.5-1.8 us an allocator op (the 70B's four schedules at p = 8,
# m = 64: 2.2 M ops in 3.6 CPU s), and two workers take about 0.1-0.2 CPU s to fork and 0.05 s a schedule to ship its
# trace: at this floor (some 0.3 CPU s) half the replay on another core pays for them
REPLAY_OPS_FOR_WORKERS = 200_000
# what the bar says while each schedule's devices replay (in the workers, or here): seconds on a large what-if, where
# the simulations' bar had ended and nothing showed
REPLAYING = "replaying memory"


@dataclass
class _Replays:
    """The caching allocator's replays of the schedules' devices (`Scenario.reserves`), in tune's worker processes
    (planning/tune.py `start_workers`, a share of each trace's devices a worker, `device_shares`) while this one
    simulates the next schedule, where there is enough to replay to pay for them; here otherwise (`pool` None)."""

    workers: int
    pool: Workers | None

    @classmethod
    def started(cls, scenario, schedules: Iterable) -> _Replays:
        """Workers as many as this process may use cores (`usable_cpus`), no more than the devices to
        replay, where the allocator ops the replays run (`replay_ops`) come to REPLAY_OPS_FOR_WORKERS or more; else
        none."""
        schedules = list(schedules)
        if scenario.allocations is None:
            return cls(1, None)
        workers = min(usable_cpus(), sum(sched.num_devices for sched in schedules))
        if workers < 2 or replay_ops(scenario.allocations, schedules) < REPLAY_OPS_FOR_WORKERS:
            return cls(1, None)
        from ..planning.tune import start_workers

        return cls(workers, start_workers(workers))

    def start(self, scenario, sched, trace, cut: list[int] | None, links) -> Callable[[], list[int] | None]:
        """The trace's devices' reserves started in the workers: a call that waits for them (None: `add_reserve`
        finds them here)."""
        if self.pool is None:
            return lambda: None
        from ..planning.tune import dealt_back, device_shares

        shipped = pickle.dumps((scenario, sched, trace, cut, links), pickle.HIGHEST_PROTOCOL)  # once, not a share each
        found = [self.pool.submit(_shipped_reserves, shipped, share)
                 for share in device_shares(sched.num_devices, self.workers)]
        return lambda: dealt_back([share.result() for share in found])

    def __enter__(self) -> _Replays:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """The workers stopped: at once after an error or Ctrl-C (`Workers.stop`)."""
        if self.pool is not None:
            self.pool.stop(at_once=kind is not None)


def replay_ops(layers: Sequence[LayerAllocations], schedules: Iterable) -> int:
    """About how many allocator ops the replays of `schedules`' devices run (`Scenario.reserves`), before they are
    simulated: each device's forward and backward rows in its order, as many as the replay's skip leaves
    (`replayed_rows`), each its stage's share of the model's `layers`' allocations and frees for its pass."""
    from ..sim.caching_allocator import replayed_rows
    from ..sim.costs import TRANSIENT_KINDS

    passes = {kind: name for name, kind in TRANSIENT_KINDS.items()}
    events = {name: sum(len(layer.passes.get(name, ())) for layer in layers) for name in TRANSIENT_KINDS}
    for name in ("bwd", "igrad"):  # a recomputation makes its forward again first
        events[name] += sum(len(layer.passes.get("fwd", ())) for layer in layers if layer.rerun is not None)
    ops = 0
    for sched in schedules:
        for order in sched.orders:
            rows = [(passes[action.kind], action.stage, (action.pipeline, action.minibatch, action.microbatch))
                    for action in order if action.kind in passes]
            if rows:
                ops += (replayed_rows(rows) * sum(events[name] for name, _, _ in rows)
                        // (len(rows) * sched.graph.stages_per_copy))
    return ops


def _shipped_reserves(shipped: bytes, devices: Sequence[int]) -> list[int]:
    """In a worker: the reserves of `devices` (`Scenario.reserves`) in the trace `_Replays.start` shipped."""
    scenario, sched, trace, cut, links = pickle.loads(shipped)
    return scenario.reserves(sched, trace, cut, links, devices)


def _check_profile_experts(measured, experts: int, data_parallel: int) -> None:
    """--expert-parallel E beside a calibrated --profile: its ranks drawn from the d replicas, as `pipesim run`
    draws them, and its all-to-alls priced on the profile's (planning/scenario.py `measured_all_to_alls`). An
    estimate runs the E it was estimated with, which the flag may restate."""
    from ..planning.scenario import all_to_all_refusal
    from ..schedules.ranks import check_expert_replicas

    if measured.estimate is not None:
        if experts == int(measured.estimate.parallelism.get("expert", 1)):
            return
        raise InputError(f"--expert-parallel {experts:,}: the profile is an estimate, made for the expert parallelism "
                         f"it was estimated with (E={measured.estimate.parallelism.get('expert', 1)}); drop "
                         "--expert-parallel, or estimate again with it")
    with refused_with_flags():
        check_expert_replicas(experts, data_parallel)
    refusal = all_to_all_refusal(measured, experts)
    if refusal is not None:
        raise InputError(refusal)


def _schedule_file(ctx: typer.Context, path: Path):
    """The schedule a torch CSV describes, run --minibatches times (once by default), as torch's runtime runs it
    every step. It fixes p, v and m, so flags that set them would be silently ignored: refuse them instead."""
    from ..files import read_text
    from ..schedules import ScheduleError
    from ..schedules.torch_csv import from_torch_csv

    if is_given(ctx, "schedule"):
        raise InputError("--schedule and --schedule-file both say what to simulate: give one")
    fixed = [f"--{name}" for name in ("stages", "chunks", "microbatches", "pipelines", "rounds") if is_given(ctx, name)]
    if fixed:
        raise InputError(f"{', '.join(fixed)}: the schedule file fixes stages, chunks and micro-batches (one "
                         f"step, which --minibatches repeats); drop {'these flags' if len(fixed) > 1 else fixed[0]}")
    if ctx.params.get("overlap_expert_comm"):
        raise InputError("--overlap-expert-comm pairs a method's order as it is built; the schedule file runs its "
                         "order as written (a pair is written (F;B)OVERLAP_F_B): drop the flag")
    if (ctx.params.get("data_parallel") or 1) > 1:  # --zero and the like need it, so they are refused with it
        raise InputError("--data-parallel: the schedule file is one pipeline's ranks, without data-parallel "
                         "replicas; simulate d replicas of a method with --schedule")
    text = read_text(path, InputError, "--schedule-file: ")
    try:
        return from_torch_csv(text, path.stem, ctx.params.get("minibatches") or 1)
    except ScheduleError as exc:
        raise InputError(f"--schedule-file: {exc}") from None


def _check_cost_lists(scenario, schedules: dict) -> None:
    """A cost list that fits none of the methods compared is a wrong flag value: name the lengths allowed. (One
    that fits some skips the others, each with the reason; a lone method's costs say it themselves.)"""
    if scenario.measured is not None or len(schedules) < 2:
        return
    for flag, given in scenario.per_stage.items():
        allowed: dict[tuple[int, str], list[str]] = {}
        for name, sched in schedules.items():
            p, n = sched.num_devices, sched.num_stages
            lengths = [(n, "one per model stage")] if flag == "--output-mb" else \
                [(p, "one per device"), *([(n, "one per model stage")] if n != p else [])]
            for option in lengths:
                allowed.setdefault(option, []).append(name)
        if len(given) == 1 or len(given) in {length for length, _ in allowed}:
            continue
        choices = [f"{length} ({meaning}{'' if len(who) == len(schedules) else ': ' + ', '.join(who)})"
                   for (length, meaning), who in sorted(allowed.items())]
        raise InputError(f"{flag}: {len(given)} values given; give one number, or {' or '.join(choices)}")


def _skip_text(name: str, reason: str) -> str:
    """Why `name` cannot run, starting with its name."""
    return reason if reason.startswith(name) else f"{name}: {reason}"


def _nothing_runs(requested: list[str], skipped: dict[str, str]) -> str:
    """One line for a comparison none of whose methods can run: each reason once (the same reason of several
    methods, their names aside, is given for the first and counted for the rest)."""
    if len(requested) == 1:
        return skipped[requested[0]]
    groups: dict[str, list[str]] = {}
    for name in requested:
        groups.setdefault(skipped[name].replace(name, "\0"), []).append(name)
    texts = []
    for first, *rest in groups.values():
        likewise = "" if not rest else f" (likewise {', '.join(rest)})" if len(rest) <= 3 else \
            f" (likewise {len(rest)} more)"
        texts.append(_skip_text(first, skipped[first]) + likewise)
    return f"none of the {len(requested)} methods can run: " + "; ".join(texts)


def _cost_basis(scenario, schedules: list, work: ModelWork | None, peak: str) -> str:
    """What the cost flags' numbers describe, for the table's caption; for an estimate, what its MFU is over (`work`;
    None: an estimate that recorded no MFU's figures) and `peak`: what its peak column is (`peak_text`)."""
    if scenario.measured is not None and scenario.measured.estimate is not None:
        estimate = scenario.measured.estimate
        _, p, d = estimate.degrees
        placed = any((sched.num_devices, sched.data_parallel) != (p, d) for sched in schedules)
        elsewhere = f" at p={p} d={d}, links priced for this run's p and d" if placed else ""
        moved = experts_moved_text(estimate, ((sched.num_devices, sched.data_parallel) for sched in schedules))
        elsewhere += f", but not the all-to-alls: {moved}" * bool(moved)
        sharded = bool(estimate.parallelism.get("sharded_optimizer"))
        if any(sched.sharded_optimizer != sharded for sched in schedules):  # by --zero, or at d = 1 (the header)
            elsewhere += f", the optimizer state {'un' * sharded}sharded for this run"
        span = tensor_span_text(estimate)
        degrees = parallelism_text(estimate.parallelism, estimate.attention, shape=False) + (
            f", the tensor-parallel group{span}" if span else "") + expert_span_text(scenario.measured)
        return (f"costs: estimated on {estimate.gpu} ({degrees}) from the model counted on the meta device{elsewhere}"
                + "".join(f"; {text}" for text in (work.mfu_text() if work else "", peak) if text))
    if scenario.measured is not None:  # the optimizer prices the updates and sizes their state: say whose
        return f"costs: measured (--profile), {scenario.optimizer}'s updates and state (--optimizer)"
    stage_flags = sorted({flag for sched in schedules for flag in scenario.stage_flags(sched)})
    chunked = any(sched.graph.stages_per_copy > sched.num_devices for sched in schedules)
    copied = [sched.method for sched in schedules if sched.graph.copies > 1]
    basis = "costs: per device" + (", split over its chunks" if chunked else "") + (
        f" ({', '.join(copied)}: for each model copy it holds)" if copied else "")
    if stage_flags:
        basis += f"; {', '.join(stage_flags)} per model stage (p·v values)"
    return basis


def _searched_again_text(searched_again: dict[str, SearchedAgain]) -> str:
    """For the caption: each searched order searched again within the caching allocator's reserve
    (`Scenario.within_reserve`), so that its row is not read as the first search's."""
    return "".join(f"; {name} searched again leaving up to {mib_text(again.held_bytes / MIB)} MiB a device for the "
                   f"caching allocator's reserve (its first order peaked at {mib_text(again.first_peak_bytes / MIB)} "
                   "MiB)" for name, again in searched_again.items())


def _held_back_text(built: list, summaries: list, memory: list, costs: list) -> str:
    """For the caption: a searched order (auto) that steps slower than a one-stage-a-device order beside it which
    fits its devices' memory and holds more activations than the searched one's limit R allows (its own R,
    `activation_ratio`, over R), with the least R that lets the search hold as much: so that the row is read as the
    limit's, not the search's (ZB-H1 on Llama 3.1 8B at p = 8, whose two heavier last stages hold 1.1 times 1F1B's
    peak, ran 0.7 % ahead of auto at R = 1). One out of memory is no order to hold as much as (ZB-H2 there)."""
    from ..planning.auto import activation_ratio, least_limit

    texts = []
    for sched, summary in zip(built, summaries):
        limit = sched.params.get("activation_limit")  # a searched order's alone
        if limit is None:
            continue
        for other, other_summary, checks, other_costs in zip(built, summaries, memory, costs):
            faster = 1 - other_summary.time_per_minibatch_ms / summary.time_per_minibatch_ms
            if (other.params.get("activation_limit") is not None or other.num_stages != other.num_devices
                    or other.pipelines != 1 or other_summary.max_staleness or percent_text(faster) == "0.0%"
                    or faster < 0 or any(check.out_of_memory for check in checks)):
                continue
            held = activation_ratio(other, other_costs)
            if held > limit + 1e-9:
                texts.append(f"; {other.method}, holding {held:.3g} times 1F1B's peak activations where "
                             f"{sched.method}'s --activation-limit R = {limit:g} holds less, steps "
                             f"{percent_text(faster)} faster ({least_limit(held, 1.0)} lets {sched.method} hold as "
                             "much)")
    return "".join(texts)


def _scale_text(cost_scale: float, work: ModelWork | None) -> str:
    """For the caption: the factor on every compute time (--cost-scale), where not 1, and that the MFU is over the
    peak of a part that much faster or slower (else a tenth of the time read 380 % of the part's)."""
    if cost_scale == 1:
        return ""
    return (f"; every compute time x {cost_scale:g} (--cost-scale)"
            + (", the MFU over a peak scaled alike" if work is not None else ""))


CLUSTER_NAMES_SHOWN = 8  # the caption names the --cluster file's devices that ran up to this many


def _runtime_text(scenario) -> str:
    """For the caption: whose pipeline runtime holds the tensors passed between stages, where not pipesim's (the
    peaks differ by it)."""
    if scenario.pp_runtime == "pipesim":
        return ""
    return (f"; tensors between stages held as {scenario.pp_runtime}'s pipeline runtime holds them (--pp-runtime "
            f"{scenario.pp_runtime})")


def _cluster_text(scenario, built: list) -> str:
    """For the caption: which of a --cluster file's devices the schedules ran on, where they ran on fewer than it
    lists (its first ones: a 4-device file at -p 2 ran on two without a word, and an out-of-memory device was named
    by a number the file does not give)."""
    cluster = scenario.topology
    used = max((sched.num_devices for sched in built), default=0)
    if cluster is None or not 0 < used < cluster.num_devices:
        return ""
    names = cluster.device_names[:used]  # a file's own, not the "device 0" of one that gives a count alone
    named = (f" ({', '.join(names)})" if names and len(names) <= CLUSTER_NAMES_SHOWN
             and names != tuple(f"device {d}" for d in range(used)) else "")
    ran = f"devices 0-{used - 1}{named}, the first {used:,}" if used > 1 else f"device 0{named}, the first"
    return f"; run on {ran} of the --cluster file's {cluster.num_devices:,}"


def _cut_text(scenario, cuts: dict[str, list[int]]) -> str:
    """For the caption: the layers each model stage holds where `--stage-cut fit` chose them (the cut is the
    planner's, and a user asks which it chose); the stages a given cut leaves empty, which run no layer."""
    from ..planning.scenario import FIT
    from ..profiles.partition import empty_stages

    if scenario.stage_cut != FIT:  # a cut given alike to every method (a layout, layer counts): one set of stages
        empty = sorted({k for cut in cuts.values() if cut for k in empty_stages(cut)})
        if not empty:
            return ""
        said = f"model stage {empty[0]} holds" if len(empty) == 1 else f"model stages {', '.join(map(str, empty))} hold"
        return f"; {said} no layer (--stage-cut): each passes its input on, holding it until its backward"
    held = ", ".join(f"{name} {'/'.join(str(stop - start) for start, stop in zip(cut, cut[1:]))}"
                     for name, cut in cuts.items())
    return f"; layers a model stage, cut for time within each device's memory (--stage-cut {FIT}): {held}"


HOST_BOUND_SHOWN = 0.1  # the caption says how long passes wait for their host where a stage waits at least this share


def _host_text(scenario, cuts: dict[str, list[int]]) -> str:
    """For the caption: where an estimate's passes wait for the host to issue their kernels (its host-bound
    stages, profiles/schema.py `stage_host_share`), the most any stage waits, so that a step slowed by the host (a
    float8 step slower than bfloat16's, each TransformerEngine module call costing its host) reads as that."""
    measured = scenario.measured
    if measured is None:  # typed costs: nothing was issued (and the profile schema stays unimported)
        return ""
    from ..profiles.schema import p2p_synced, stage_host_share

    synced = p2p_synced(measured)
    stages = {(start, stop) for cut in cuts.values() if cut for start, stop in zip(cut, cut[1:])}  # methods share cuts
    share = max((stage_host_share(measured.layers, start, stop, synced) for start, stop in stages), default=0.0)
    if share < HOST_BOUND_SHOWN:
        return ""
    graphs = ("" if measured.estimated_parallelism.get("cuda_graphs")
              else "; --cuda-graphs issues a graph at one kernel's cost")
    return (f"; host-bound: a stage's forward and backward wait up to {percent_text(share)} of their time for the "
            f"host to issue their kernels and module calls (as estimated with --host-kernel-us and --host-module-us"
            f"{graphs})")


def _overlap_text(schedules: list, pairs: dict[str, int], fraction: float) -> str:
    """For the caption: which methods overlap F&B pairs, how many per mini-batch (every device's together), and
    what each costs."""
    overlapping = [f"{sched.method} {pairs[sched.method] // sched.minibatches:,}" for sched in schedules
                   if pairs[sched.method]]
    if not overlapping:
        return ""
    price = ("taking F + B, neither compute hidden under the other" if fraction == 0
             else f"taking F + B less {fraction:g} of the shorter compute") + " (--fb-hidden-fraction)"
    experts = any(sched.expert_parallel > 1 for sched in schedules)
    hidden = ", each part's expert all-to-alls hidden under the other part's compute" if experts else ""
    return f"; F&B pairs per mini-batch over all devices: {', '.join(overlapping)}, each {price}{hidden}"


def _zero_text(schedule) -> str:
    """What d replicas shard, for a title: ', ZeRO-3' (nothing without sharding)."""
    return f", ZeRO-{schedule.zero}" if schedule.zero else ""


def _warn(skipped: dict[str, str], summaries: list, memory: list) -> None:
    """On stderr: the methods that could not run and why, and the devices that run out of memory."""
    for name, reason in skipped.items():
        print_message(f"skipped: {_skip_text(name, reason)}", stderr)
    for line in _out_of_memory_lines(summaries, memory):
        print_message(f"warning: {line}", stderr)


def _out_of_memory_lines(summaries: list, memory: list) -> list[str]:
    """Each method whose devices run out of memory, in words: a warning on stderr, and a note on the page, whose
    bars and curves do not show the devices' memory."""
    return [line for summary, checks in zip(summaries, memory)
            if (line := out_of_memory_line(summary.schedule, checks)) is not None]


# what simulate's and tune's bubble counts: every wait of the compute, the pipeline's and exposed communication's
BUBBLE_TEXT = "bubble: idle share of that step (exposed communication's waits included)"


def _steady_text(schedules: list, steady: list[bool]) -> str:
    """What the step column means, saying plainly which rows (marked *) are no steady state and why."""
    if all(steady):
        return f"step: one mini-batch in steady state; {BUBBLE_TEXT}"
    return f"step: one mini-batch in steady state; {_unsteady_text(schedules, steady)}; {BUBBLE_TEXT}"


def _unsteady_text(schedules: list, steady: list[bool], marked: bool = True) -> str:
    """What the * the table and the page mark the rows that are no steady state with means, and why they are not
    (some are); where nothing is `marked` (a page of one method has no chart), which is no steady state."""
    from ..schedules import steady_minibatches

    short = [sched for sched, is_steady in zip(schedules, steady) if not is_steady]
    n = short[0].minibatches
    why = "one mini-batch (N=1) is all warm-up" if n == 1 else f"N={n} is short of it (" + ", ".join(
        f"{sched.method} needs N>={steady_minibatches(sched)}" for sched in short) + ")"
    enough = ("give --minibatches 2 or more, which repeat the file's step" if short[0].params.get("format")
              == "torch-csv" else "leave out --minibatches for enough")
    said = "* marks no steady state" if marked else f"{short[0].method} is no steady state"
    return (f"{said}: {why}, so step and samples/s include the warm-up and staleness can be below a longer run's; "
            f"{enough}")


def _print_table(summaries: list, schedules: list, steady: list[bool], example: bool, skipped: dict[str, str],
                 memory: list, basis: str, mfu: list[float | None], per_device: str) -> None:
    """The results side by side; with an estimate, MFU instead of the makespan (in --json), which N sets. The
    columns of `SAID_ONCE` whose rows all agree are said once in the caption instead (`said_once`)."""
    first, estimated = schedules[0], any(share is not None for share in mfu)
    title = (f"p={count_text(first.num_devices, 'device')} per pipeline, "
             f"m={count_text(first.microbatches, 'micro-batch')}{rounds_text(first.rounds)}, "
             f"N={count_text(first.minibatches, 'mini-batch')}"
             + (f", {degree_text('d', first.data_parallel)} replicas" if first.data_parallel > 1 else "")
             + _zero_text(first)
             + (f", {per_device}" if per_device else ""))
    limited = any(check.limit_bytes is not None for checks in memory for check in checks)
    overs = [out_of_memory(checks) for checks in memory]
    marks = ["" if is_steady else "*" for is_steady in steady]
    columns = {
        "ms/step": [ms_text(s.time_per_minibatch_ms) + mark for s, mark in zip(summaries, marks)],
        "samples/s": [rate_text(s.samples_per_s) + mark for s, mark in zip(summaries, marks)],
        **({"MFU": [percent_text(share) for share in mfu]} if estimated else {}),
        "bubble": [percent_text(s.bubble_fraction) for s in summaries],
        "peak MiB": [mib_text(s.peak_memory_mb) for s in summaries],
        "peak act": [f"{max((d.peak_activations for d in s.devices), default=0):,}" for s in summaries],
        "copies": [f"{max((d.peak_weight_versions for d in s.devices), default=0):,}" for s in summaries],
        STALENESS_HEADER: [str(s.max_staleness) + mark for s, mark in zip(summaries, marks)],
        **({} if estimated else {"makespan": [ms_text(s.makespan_ms) for s in summaries]}),
        **({"memory": ["OOM" if over else "fits" for over in overs]} if limited else {}),
    }
    said = said_once(columns, SAID_ONCE)
    ooms = [f"{_label(s, sched)} {over[0]}" for s, sched, over in zip(summaries, schedules, overs) if over]
    memory_text = ("" if not limited else "; memory: every device fits" if not ooms
                   else f"; memory: {' and '.join(ooms)}" + (", the others fit" if len(ooms) < len(summaries) else ""))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption=f"{basis}"
                          + (f"; {MFU_PAST_PEAK_TEXT}" if any(share is not None and share > 1 for share in mfu)
                             else "")
                          + f"; {_steady_text(schedules, steady)}; peak act: micro-batches of activations "
                          "held" + (", each a chunk's where a device holds several"
                                    if any(sched.num_stages > sched.num_devices for sched in schedules) else "")
                          + "; copies: versions of one stage's weights held"
                          + (f", {said['copies']} in every row" if "copies" in said else "")
                          + (f"; {STALENESS_HEADER}: {said[STALENESS_HEADER]} in every row"
                             if STALENESS_HEADER in said else "")
                          + ("" if estimated else "; makespan: ms from the first op to the last")
                          + memory_text
                          + ("; s: the source of prediction distances" if any(_source(s) for s in schedules) else "")
                          + ("; skipped: why on stderr" if skipped else ""),
                  caption_justify="left")
    table.add_column("schedule", no_wrap=True)
    shown = add_columns(table, columns, said, left=("memory",))
    for row, (s, sched, over) in enumerate(zip(summaries, schedules, overs)):
        table.add_row(_label(s, sched), *[columns[header][row] for header in shown], style="red" if over else None)
    for name in skipped:
        table.add_row(name, "skipped", *[""] * (len(shown) - 1), style="dim")
    print_table(table)
    if example:
        stdout.print("Built-in example: one model (per device: forward 1 ms, backward 2 ms, 256 MiB of weights; "
                     "update, prediction and averaging 0.1 ms; transfers 0.1 ms), split over each method's chunks.",
                     highlight=False)
        # on a line of its own, short enough not to wrap: run on after the sentence, it broke at 80 columns, and
        # the half a user copied ran without --stages and --microbatches
        stdout.print(f"Try: {EXAMPLE_TRY}", highlight=False)


# simulate's columns said once in the caption where every row agrees: what a method keeps (its weights' copies,
# their staleness) and whether it fits, alike for most sets of methods: the README's 175B what-if, one row, needed
# 82 columns with them and was printed in two parts at 80.
SAID_ONCE = ("copies", STALENESS_HEADER, "memory")


EXAMPLE_TRY = "pipesim simulate -s 1f1b -s xpipe -p 8 -m 32 --html t.html"  # the built-in example's next step

MEMORY_COLUMNS = {"parameters": "weights", "gradients": "gradients", "optimizer_state": "optimizer",
                  "activations": "activations", "communication": "buffers", "runtime_buffers": "runtime",
                  "transient": "transient", "reserve": "reserve"}  # MEMORY_PARTS -> the table's words


def _print_memory_table(summaries: list, schedules: list, memory: list, skipped: dict[str, str]) -> None:
    """`--memory`: per method and device, the MiB each part holds at the device's peak, which they sum to, and the
    most it may hold (`MemoryCheck.room_bytes`: where ranks share a GPU, its memory less the others' peaks, as the
    page's line is drawn), so that a red row's peak is over its limit (it read 2,216 against 3,072 in red: two
    ranks' peaks on one 3 GiB GPU)."""
    from ..traces.trace import MEMORY_PARTS

    first = schedules[0]
    degrees = [("p", first.num_devices), ("m", first.microbatches)] + [("d", first.data_parallel)] * (
        first.data_parallel > 1)
    table = Table(title="memory at each device's peak (MiB), " + ", ".join(degree_text(*d) for d in degrees)
                        + _zero_text(first),
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                  caption="the parts sum to the peak: weights with the copies a method keeps, gradients as "
                          "accumulated, optimizer state with the master weights a precision keeps, activations saved "
                          "for the backward, buffers of transfers in flight (--pp-runtime torch: its stages' kept "
                          "ones), the "
                          "runtime's own buffers (--scores-buffer), what the running pass creates and frees "
                          "within itself, the segments torch's caching allocator keeps cached beside them (--gpu's "
                          "--allocator caching or expandable; not replayed for a mixture of experts); --json: "
                          "peak_memory_parts_mb"
                          + ("; limit: a GPU's memory, less the peaks of the other ranks on it where ranks share one"
                             if any(len(check.sharers) > 1 for checks in memory for check in checks) else ""))
    table.add_column("schedule", no_wrap=True)
    table.add_column("device", justify="right", no_wrap=True)
    # the runtime's buffers and the reserve only where any device holds some (none kept, not replayed: all 0)
    parts = tuple(part for part in MEMORY_PARTS if part not in ("runtime_buffers", "reserve")
                  or any(device.peak_memory_parts_mb[part] for s in summaries for device in s.devices))
    for part in parts:
        table.add_column(MEMORY_COLUMNS[part], justify="right", no_wrap=True)
    table.add_column("peak", justify="right", no_wrap=True)
    limited = any(check.limit_bytes is not None for checks in memory for check in checks)
    if limited:
        table.add_column("limit", justify="right", no_wrap=True)
    for s, sched, checks in zip(summaries, schedules, memory):
        for d, (device, check) in enumerate(zip(s.devices, checks)):
            whole = _summing_whole([device.peak_memory_parts_mb[part] for part in parts])
            table.add_row(
                _label(s, sched) if d == 0 else "", str(device.device), *[f"{mib:,}" for mib in whole],
                f"{sum(whole):,}",
                *([f"{check.room_bytes / MIB:,.0f}" if check.room_bytes is not None else ""] if limited else []),
                style="red" if check.out_of_memory else None, end_section=d == len(s.devices) - 1)
    for name in skipped:
        table.add_row(name, "skipped", style="dim")
    print_table(table, keys=2)  # a row is a schedule's device: both lead each part


def _label(summary, sched) -> str:
    """A method's row label in simulate's tables, with the shape that tells its runs apart: "interleaved-1f1b
    (v=2)", "(v=2, g=16)" with a micro-batch group given (--memory's table said "interleaved-1f1b" alone)."""
    shape = [degree_text("v", sched.num_stages // sched.num_devices)] if sched.num_stages > sched.num_devices else []
    shape += [degree_text("P", sched.pipelines)] if sched.pipelines > 1 else []
    shape += [degree_text("g", group)] if (group := sched.params.get("microbatch_group")) is not None else []
    shape += [f"s: {_source(sched)}"] if _source(sched) else []
    return summary.schedule + (f" ({', '.join(shape)})" if shape else "")


def _summing_whole(values: list[float]) -> list[int]:
    """`values` as whole numbers that still sum to their sum's rounding: each rounded at its running total, so a
    table's parts add up to the peak it prints beside them (rounded alone, 863 MiB of parts stood by 864)."""
    totals = [round(sum(values[:k + 1])) for k in range(len(values))]
    return [total - before for total, before in zip(totals, [0, *totals[:-1]])]


def _source(sched) -> str | None:
    """Where the schedule's prediction distances come from (None: it predicts no weights; a torch CSV has no
    params)."""
    return sched.params.get("prediction")


def list_schedules() -> None:
    """List the methods, what each does and the weights its ops read."""
    from ..schedules import METHODS, SYNCHRONOUS

    table = Table(show_header=True, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("what it does")
    table.add_column("weights read")
    # The prediction distances in a table of their own, each closed form on one line: as a fourth column beside
    # the others, XPipe's (2*p + 3*m - k - 4)//(2*m) broke over two lines and its B form over three at 80 columns.
    sources = Table(show_header=True, box=box.SIMPLE_HEAD, pad_edge=False,
                    title="prediction distance s, by --prediction source", title_justify="left")
    sources.add_column("name", no_wrap=True)
    sources.add_column("--prediction", no_wrap=True)
    sources.add_column("s (k: the stage, p stages, m micro-batches)")
    for method in METHODS.values():
        policy = SYNCHRONOUS if method.needs_costs else method.build(method.params(4, 8)).policy
        table.add_row(method.name, method.summary, _policy_text(policy))
        for k, source in enumerate(policy.sources):
            sources.add_row("" if k else method.name, source + (" (primary)" if source == policy.primary_source
                                                                 else ""), _forms_text(policy, source))
    print_table(table)
    stdout.print()
    print_table(sources)
    stdout.print("Sources and where they disagree: docs/methods.md", highlight=False)


def _policy_text(policy) -> str:
    """One line per side: the version read, and whether the weights are predicted."""
    lines = []
    for side, read, prediction in (("F", policy.forward, policy.predict_forward),
                                   ("B", policy.backward, policy.predict_backward)):
        lines.append(f"{side}: {read.value}" + (", predicted" if prediction is not None else ""))
    if policy.extra_copies:
        lines.append(f"+{count_text(policy.extra_copies, 'weight copy')}")
    return "\n".join(lines)


def _forms_text(policy, source: str) -> str:
    """The policy's closed forms of s from `source`, one line per side that predicts (F, B); the counted source's
    s is read from the order."""
    forms = [f"{side}: {prediction.forms[source]}" for side, prediction in
             (("F", policy.predict_forward), ("B", policy.predict_backward))
             if prediction is not None and source in prediction.forms]
    return "\n".join(forms) or "from the order"


EXPORT_FORMATS = ("torch-csv",)


def export(
    ctx: typer.Context,
    schedule: Annotated[str, typer.Option(
        "--schedule", "-s", metavar="NAME", help="Method to export (see `pipesim schedules`).")],
    fmt: Annotated[str, typer.Option(
        "--format", metavar="FORMAT", help="Output format: torch-csv (torch.distributed.pipelining's schedule CSV, "
                                           "one row per rank; synchronous one-pipeline methods).")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="FILE", parser=output_path, help="File to write (replaced atomically).")],
    stages: Annotated[int, typer.Option(
        "--stages", "-p", metavar="P", min=1, show_default=False, help="Pipeline depth p: devices in one pipeline "
                                                                       "(default 4, or the profile's).")] = 4,
    chunks: Annotated[int | None, typer.Option(
        "--chunks", "-v", metavar="V", min=1, help="Model chunks per device (interleaved / V schedules). Default: the "
                                      "method's.")] = None,
    microbatches: Annotated[int, typer.Option(
        "--microbatches", "-m", metavar="M", min=1, help="Micro-batches per mini-batch m.")] = 8,
    microbatch_group: MicrobatchGroup = None,
    activation_limit: ActivationLimit = None,
    search_seconds: SearchSeconds = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", metavar="JSON", help="auto: a profile from `pipesim calibrate` whose costs, sizes and links its "
                                          "order is searched for (instead of --fwd and --bwd).")] = None,
    fwd: SearchFwd = None,
    bwd: SearchBwd = None,
    wgrad_fraction: SearchWgradFraction = 0.5,
    comm: SearchComm = None,
    activation_mb: SearchActivationMb = None,
) -> None:
    """Write a method's training step for another runtime. One step of its schedule, for a runtime such as
    torch's (`_load_csv`); auto's order is searched for the costs given (--fwd and --bwd, or --profile)."""
    from ..schedules import ScheduleError
    from ..schedules.catalogue import method_named
    from ..schedules.torch_csv import to_torch_csv
    from ..sim import CostError
    from ..traces import write_atomic

    try:
        if fmt not in EXPORT_FORMATS:
            raise InputError(unknown_names("--format", [fmt], EXPORT_FORMATS))
        check_outputs([("--out", out, TORCH_CSV)], [("--profile", profile)])
        method = method_named(schedule)
        check_method_options(ctx, [method.name], ("--microbatch-group", "--activation-limit", "--search-seconds"))
        search = search_options(activation_limit, search_seconds)
        if profile is not None and not method.needs_costs:
            raise InputError(f"--profile: only a schedule searched from the costs (auto) reads it, not {method.name}")
        measured = load_profile_flag(ctx, profile) if profile is not None else None
        scenario = searched_scenario(ctx, method, measured)
        if measured is not None and not is_given(ctx, "stages"):
            stages = measured.partition.stages
        # at the method's own P: a CSV is one pipeline, and AvgPipe's two are refused (at one it averages nothing)
        params = method.params(stages, microbatches, chunks=chunks,
                               **method.read_options({"microbatch_group": microbatch_group, **search}))
        if scenario is not None:
            check_estimate_experts(measured, stages, 1, one_replica="export")
        built = built_schedule(method, params, scenario, False)
        text = to_torch_csv(built)
        with writing("--out"):
            write_atomic(out, text)
    except (InputError, ScheduleError, CostError) as exc:  # a too low --activation-limit included
        fail(str(exc))
    except OSError as exc:
        fail(read_error(exc))
    stdout.print(f"wrote {out}", highlight=False)
