"""`pipesim run`: execute a schedule for real, train the model, and write the measured trace. Ranks are
processes this command spawns and supervises on this machine, or, under torchrun, this process is one rank.
Torch is imported only once the command runs."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NamedTuple

import typer
from rich import box
from rich.table import Table

from ..profiles.workload import too_many_stages
from ..traces.metrics import loss_text, mib_text, percent_text, rate_text
from ..units import count_text, degree_text, float_text, number_allowed, rounds_text
from ..workload.processes import HEARTBEAT_S, STALL_LEAST_S
from .common import (
    DTYPES,
    SEARCH_COSTS,
    STARTING_STATUS,
    ActivationLimit,
    Advance,
    AverageEvery,
    CapacityFactor,
    Chunks,
    ElasticAlpha,
    ExpertFfn,
    Experts,
    Ffn,
    Gated,
    Heads,
    InputError,
    KvHeads,
    Layers,
    Microbatches,
    MicrobatchGroup,
    Minibatches,
    OverlapExpertComm,
    Pipelines,
    PredictionSource,
    Rounds,
    SearchActivationMb,
    SearchBwd,
    SearchComm,
    SearchFwd,
    SearchSeconds,
    SearchWgradFraction,
    Seed,
    SeqLen,
    SharedExperts,
    Stages,
    TopK,
    Vocab,
    Width,
    built_schedule,
    check_dtype,
    check_estimate_experts,
    check_expert_parallel,
    check_expert_parallel_unbuilt,
    check_method_options,
    check_optimizer_held,
    check_outputs,
    check_prediction,
    check_threads,
    counted_bar_columns,
    fail,
    flag_of,
    host_memory_refusal,
    is_given,
    model_reads,
    output_path,
    read_error,
    read_profile,
    refuse,
    refuse_out_of_host_memory,
    refused_with_flags,
    require_model,
    say_part_counted,
    search_options,
    searched_scenario,
    stderr,
    stdout,
    transient_status,
    with_help,
    writing,
)
from .tables import piped_lines, print_message, print_table

DataParallel = Annotated[int, typer.Option(
    "--data-parallel", metavar="D", min=1, help="Data-parallel replicas of the pipeline: p x D ranks (numbered as "
                                                "--rank-order says); each replica trains on its own M micro-batches "
                                                "of a D x M mini-batch, and each stage averages its gradients over "
                                                "its replicas before its update.")]
RunRankOrder = Annotated[str, typer.Option(
    "--rank-order", metavar="ORDER", help="How the p x D ranks are numbered: pipesim (rank = replica x p + device, "
                                          "a replica's stages on consecutive ranks) or megatron (Megatron-core's "
                                          "stages outermost: rank = device x D + replica, a stage's replicas on "
                                          "consecutive ranks), as simulate --rank-order prices them; the trace "
                                          "names each rank by its replica and device either way.")]
ExpertParallel = Annotated[int, typer.Option(
    "--expert-parallel", metavar="E", min=1, help="gpt with --experts: its routed experts placed over E of the D "
                                                  "data-parallel replicas (E divides --data-parallel D and "
                                                  "--experts), each holding 1/E of them; the tokens go to their "
                                                  "experts' ranks and back by all-to-alls (CPU ranks, gloo).")]


def run(
    ctx: typer.Context,
    schedule: Annotated[str, typer.Option(
        "--schedule", "-s", metavar="NAME", help="Method to run (see `pipesim schedules`).")],
    model: Annotated[str | None, typer.Option(
        "--model", metavar="NAME", show_default=False,
        help="mlp, cnn, gpt, two-branch (graphpipe's), package.module:attribute naming a torch.nn.Sequential, a list "
             "of modules, or a zero-argument callable returning one, or hf:PATH with a --profile calibrated from it. "
             "Default: --profile's model.")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="PATH", parser=output_path,
        help="Measured trace to write (Chrome Trace Event JSON; written whole, also for a run that stopped part-way or "
             "was interrupted, then marked incomplete).")] = None,
    stages: Stages = 2,
    chunks: Chunks = None,
    microbatches: Microbatches = 4,
    minibatches: Minibatches = 10,
    pipelines: Pipelines = None,
    data_parallel: DataParallel = 1,
    expert_parallel: ExpertParallel = 1,
    rounds: Rounds = 1,
    rank_order: RunRankOrder = "pipesim",
    overlap_expert_comm: OverlapExpertComm = False,
    advance: Advance = None,
    microbatch_group: MicrobatchGroup = None,
    average_every: AverageEvery = 1,
    elastic_alpha: ElasticAlpha = None,
    prediction: PredictionSource = None,
    activation_limit: ActivationLimit = None,
    search_seconds: SearchSeconds = None,
    fwd: SearchFwd = None,
    bwd: SearchBwd = None,
    wgrad_fraction: SearchWgradFraction = 0.5,
    comm: SearchComm = None,
    activation_mb: SearchActivationMb = None,
    microbatch_size: Annotated[int, typer.Option(
        "--microbatch-size", "-b", metavar="B", min=1, show_default=False, help="Samples per micro-batch (default 8, "
                                                                                "or the profile's).")] = 8,
    layers: Layers = None,
    width: Width = None,
    heads: Heads = None,
    seq_len: SeqLen = None,
    vocab: Vocab = None,
    ffn: Ffn = None,
    kv_heads: KvHeads = None,
    gated: Gated = None,
    experts: Experts = None,
    top_k: TopK = None,
    shared_experts: SharedExperts = None,
    expert_ffn: ExpertFfn = None,
    capacity_factor: CapacityFactor = None,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str | None, typer.Option(
        "--dtype", metavar="DTYPE", show_default=False, help="The model's weights and activations: float32, bfloat16 "
                                                             "or float16 (or fp32, bf16, fp16; default the "
                                                             "profile's, else float32). 16 bits train in mixed "
                                                             "precision: float32 master weights, gradients and "
                                                             "optimizer state; float16 without loss scaling.")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", metavar="NAME", help="auto (gloo on CPU; NCCL with a GPU per rank, else host-staged gloo), gloo "
                                          "or nccl.")] = "auto",
    optimizer: Annotated[str, typer.Option(
        "--optimizer", metavar="NAME", help="sgd, momentum, adam or adamw.")] = "sgd",
    lr: Annotated[float, typer.Option("--lr", metavar="LR", help="Learning rate.")] = 0.05,
    seed: with_help(Seed, "of the model and the data.") = 0,
    profile: Annotated[Path | None, typer.Option(
        "--profile", metavar="JSON", help="Profile from `pipesim calibrate`: its partition gives the stage layer "
                                          "bounds (and the model's size options); auto's order is searched for its "
                                          "costs.")] = None,
    stage_cut: Annotated[str | None, typer.Option(
        "--stage-cut", metavar="HOW", show_default=False,
        help="With --profile: how its layers are cut into the p·v stages the ranks run, as simulate's --stage-cut "
             "(balanced, equal-blocks, padded-blocks, first-last:F,L, layout:STRING, whose stages may hold no "
             "layer, or layers:N,N,...). Default: the profile's partition.")] = None,
    threads_per_rank: Annotated[int, typer.Option(
        "--threads-per-rank", metavar="T", min=1, help="Torch threads per rank, at most the cores pipesim may "
                                                       "run on.")] = 1,
    timeout: Annotated[float, typer.Option(
        "--timeout", metavar="S", help="Seconds a rank waits for a transfer or a process-group operation.")] = 120.0,
    stall_timeout: Annotated[float, typer.Option(
        "--stall-timeout", metavar="S", help="Seconds the run may go with no rank finishing a row or computing, or "
        f"with a rank's process suspended, before every rank is stopped; at least {STALL_LEAST_S:g} (ranks report "
        f"every {HEARTBEAT_S:g} s).")] = 20.0,
    heldout: Annotated[bool, typer.Option(
        "--heldout/--no-heldout", help="Score the trained model on its held-out set after the run (the table's "
                                       "held-out loss / acc: how well it learned beyond its training data): one "
                                       "forward of the whole set in this process, after the ranks' times are "
                                       "taken; the default gpt's 256 x 128 tokens take about 11 CPU s, more than "
                                       "a short run's training. --no-heldout skips it: not scored.")] = True,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", parser=output_path, help="Write the timeline page (self-contained HTML).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
) -> None:
    """Run a schedule for real with torch, and trace it. It trains the model with the method's weight semantics and
    writes the measured trace (same schema as `simulate --trace`). auto runs the order searched for --profile's
    costs, or for --fwd and --bwd.

    Spawns one process per device (per device and replica with --data-parallel), or, started by torchrun, runs
    this rank and rank 0 writes the trace.
    """
    from ..choices import BACKENDS, choose_from, device_refusal
    from ..launch import speaks_for_host, under_torchrun
    from ..planning.scenario import all_to_all_refusal
    from ..profiles.schema import layer_costs, optimizer_refusal, threads_mismatch
    from ..profiles.workload import is_hf
    from ..schedules import ScheduleError
    from ..schedules.catalogue import method_named
    from ..schedules.ranks import RANK_ORDERS
    from ..sim import CostError
    from ..traces import summarize, write_trace
    from ..traces.compare import passes_warning
    from ..traces.hostload import HostLoad, mark, ranks_per_host
    from ..workload.hfconfig import build_imports
    from ..workload.processes import prepare
    from ..workload.sizes import flag_sizes_refusal, model_name_refusal, stages_refusal

    # the executor's class, imported below after torch: bound before, so a Ctrl-C while torch imports reaches
    # cli.main's "interrupted" through the except clauses, not an UnboundLocalError
    ExecutorError: type[Exception] = InputError
    started = False  # whether the ranks have started: a failure before is the same on every rank of a host
    unwritten: list[str] = []  # why each output that could not be written was not, said after the results
    try:
        method = method_named(schedule)
        check_method_options(ctx, [method.name], ("--advance", "--microbatch-group", "--average-every",
                                                  "--elastic-alpha", "--chunks", "--pipelines", "--prediction",
                                                  "--activation-limit", "--search-seconds"))
        search = search_options(activation_limit, search_seconds)
        if backend not in BACKENDS:
            raise InputError(choose_from("--backend", BACKENDS, backend))
        if rank_order not in RANK_ORDERS:
            raise InputError(choose_from("--rank-order", RANK_ORDERS, rank_order))
        refuse(optimizer_refusal(optimizer, "--optimizer"))
        refuse(device_refusal(device))
        for flag, value, least, most in (("--lr", lr, 0, None), ("--timeout", timeout, 0, MAX_WAIT_S),
                                         ("--stall-timeout", stall_timeout, STALL_LEAST_S, MAX_WAIT_S)):
            if not (least < value if least == 0 else least <= value) or not value < math.inf or (
                    most is not None and value > most):
                allowed = number_allowed(least, most, whole=False, finite=True, above=least == 0)
                raise InputError(f"{flag}: {allowed} (got {float_text(value)})")
        check_prediction(prediction)
        check_threads("--threads-per-rank", threads_per_rank)
        if dtype is not None:  # None: the profile's, else float32
            check_dtype(dtype)
        options = {key: value for key, value in (("layers", layers), ("width", width), ("heads", heads),
                                                 ("seq_len", seq_len), ("vocab", vocab), ("ffn", ffn),
                                                 ("kv_heads", kv_heads), ("gated", gated),
                                                 ("experts", experts), ("top_k", top_k),
                                                 ("shared_experts", shared_experts), ("expert_ffn", expert_ffn),
                                                 ("capacity_factor", capacity_factor)) if value is not None}
        # the profile is checked against the run's flags before torch is imported (5-10 s), as is the schedule's
        # stage count against its partition
        bounds, measured = None, None
        _check_stage_cut(stage_cut, profile)
        if profile is not None:
            measured, bounds = _partition(profile, model, options)
            # the profile's step, priced for the run's optimizer, is what auto searches and compare predicts from
            check_optimizer_held(optimizer, None, measured)
            model = measured.model.name
            context = int(measured.estimated_parallelism.get("context", 1))
            if context > 1:  # its schedule would reduce over context-parallel ranks the executor does not start
                raise InputError(f"--profile {profile}: estimated for context parallelism C={context}, which pipesim "
                                 "simulates but does not run; estimate it without --context-parallel")
            why = threads_mismatch(measured, threads_per_rank)
            if why:
                raise InputError(f"--profile {profile}: {why}")
            if expert_parallel > 1 and measured.estimate is None:  # `compare` prices its A2A rows on the profile's
                why = all_to_all_refusal(measured, expert_parallel)
                if why:
                    raise InputError(why)
            profiled_b = measured.environment.microbatch_size
            made, again, _ = _made(measured)
            if is_given(ctx, "microbatch_size") and microbatch_size != profiled_b:
                raise InputError(f"--microbatch-size {microbatch_size:,}: the profile {profile} was {made} at "
                                 f"{count_text(profiled_b, 'sample')} per micro-batch, and its times hold there "
                                 f"only; drop the flag or {again}")
            microbatch_size = profiled_b
            profiled_dtype = measured.environment.dtype
            if dtype is not None and DTYPES[dtype] != profiled_dtype:
                raise InputError(f"--dtype {dtype}: the profile {profile} was {made} in {profiled_dtype}, and its "
                                 f"times hold there only; drop the flag or {again}")
            dtype = profiled_dtype
        elif model is None:
            raise InputError("--model: give the model to run, or --profile, whose model it runs")
        elif is_hf(model):  # run has no --seq-len: a profile carries it
            raise InputError(f"--model {model}: run builds a Hugging Face model at the sequence length it was "
                             "calibrated at: give --profile, from `pipesim calibrate --model hf:PATH --seq-len N`")
        sized = {**options, "seq_len": measured.model.options.get("seq_len")} if measured else options
        if measured is not None and not is_given(ctx, "model") and (named := model_name_refusal(model)):
            raise InputError(f"--profile {profile}: its model.name {model!r} is no model run can build "
                             f"({named.removeprefix('--model: ')})")  # the profile's name, not a --model given
        refuse(model_name_refusal(model) or flag_sizes_refusal(model, sized))  # require_model's first check and the
        # sizes' bounds, before the server starts (a config is built at its profile's sequence length)
        check_outputs([("--trace", trace), ("--html", html)],
                      [("--profile", profile), *model_reads({**ctx.params, "model": model})], as_json)
        if expert_parallel > 1:  # its experts first: a dense model's --data-parallel would be the wrong fix
            check_expert_parallel_unbuilt(expert_parallel, model, measured.model.options if measured else options,
                                          placed=True)
            _check_expert_replicas(expert_parallel, data_parallel, device)
        scenario = searched_scenario(ctx, method, measured)
        if scenario is not None:  # the order searched runs the estimate's E (a built one runs --expert-parallel's)
            check_estimate_experts(measured, stages, data_parallel)
        if bounds is not None and stage_cut is None and not is_given(ctx, "stages"):  # not --stages' default
            stages = _profiled_devices(method, len(bounds) - 1, stages, microbatches, chunks, pipelines)
        params = method.params(stages, microbatches, minibatches, chunks, pipelines, advance=advance,
                               average_every=average_every, elastic_alpha=elastic_alpha, prediction=prediction,
                               data_parallel=data_parallel, expert_parallel=expert_parallel,
                               overlap_expert_comm=overlap_expert_comm, rounds=rounds,
                               **method.read_options({"microbatch_group": microbatch_group, **search}))
        # a searched order: for the costs of the stages the run cuts (the profile's partition, where it fits; where
        # --stage-cut is given, the scenario's cut, which is that)
        built = built_schedule(method, params, scenario, as_json, None if stage_cut else bounds)
        if stage_cut is not None:
            bounds = _cut(measured, built, stage_cut)
        per_copy = built.graph.stages_per_copy  # a profile's cut is one model copy's (DualPipe runs two)
        asked = f"--stages {stages:,}" + (f" x --chunks {params.chunks:,}" if params.chunks > 1 else "")
        from ..planning.scenario import EMPTYING_CUTS, gives_layers

        emptied = stage_cut is not None and gives_layers(stage_cut)  # its stages may hold no layer
        if not emptied:  # before the partition's count: a fix it names must be one the model's layers allow
            refuse(stages_refusal(asked, per_copy, model, options, EMPTYING_CUTS) if measured is None
                   else too_many_stages(asked, per_copy, model, measured.model.options, measured.layers,
                                        profiled=True, emptied_by=EMPTYING_CUTS))
        if bounds is not None and len(bounds) - 1 != per_copy:
            copies = " in each model copy" if per_copy != built.num_stages else ""
            raise InputError(f"--profile {profile}: its partition has {len(bounds) - 1} stages, but {schedule} on "
                             f"{stages} devices has {per_copy}{copies}; "
                             f"give --stage-cut balanced (its layers cut again), {_made(measured).command} with "
                             f"--stages {per_copy} or drop --profile")
        # every flag that needs nothing started is read: a refusal starts no server and imports no torch
        began = mark()  # the host's load before this run starts anything
        if not under_torchrun():  # this command starts the ranks: their server's imports overlap this one's
            prepare(build_imports(model))
        # torch's import (begun by the ranks' server above) and the model: seconds before the ranks' bar
        with transient_status(f"{STARTING_STATUS} ({model})", quiet=as_json or under_torchrun()):
            require_model("pipesim run", model)  # torch imported, so a broken build stops here
            from ..calibrate.measure import DeviceError, resolve_device
            from ..executor import ExecutorError, RunSpec, carried_bounds
            from ..executor.replicas import Layout
            from ..executor.runners import RunFailed, RunInterrupted, TorchrunEnv, run_multiprocess, run_torchrun
            from ..workload.models import ModelError, build_model, rebuilt_options
            from ..workload.transport import TransportError, choose_transport

            try:  # calibrate's rule: cuda where torch sees a GPU, said before the ranks start (after
                # expert parallelism's refusal of any device but cpu, which holds on every machine)
                resolve_device(device)
            except DeviceError as exc:
                raise InputError(str(exc)) from None
            if measured is not None:
                options = rebuilt_options(model, measured.model.options)
            try:
                # built on the meta device: the same refusals; its first forward runs here, on the host
                # each torchrun rank measures its host when it gets here
                refuse(host_memory_refusal("run", model, options, microbatch_size, DTYPES[dtype or "float32"]),
                       every_rank=True)
                net = build_model(model, **options)  # a wrong name or option, in one line, before any rank starts
                if speaks_for_host():
                    say_part_counted(model)
            except ModelError as exc:
                raise InputError(str(exc)) from None
        if expert_parallel > 1:
            check_expert_parallel(expert_parallel, net, placed=True)
        spec = RunSpec(built, model, options, microbatch_size=microbatch_size, optimizer=optimizer, lr=lr,
                       seed=seed, dtype=DTYPES[dtype or "float32"], bounds=bounds,
                       threads_per_rank=threads_per_rank, timeout_s=timeout, heldout=heldout, rank_order=rank_order)
        if not emptied:  # no built-in, once built
            refuse(too_many_stages(asked, per_copy, model, net.options, net.layers, emptied_by=EMPTYING_CUTS))
        if bounds is None and carried_bounds(spec, model=net) is None:
            raise InputError(_no_cut(spec, len(net.layers)))
        if bounds is not None:
            carried = carried_bounds(spec, [cost.ms for cost in layer_costs(measured.layers, optimizer)], model=net)
            if carried is None:
                raise InputError(f"--profile {profile}: {schedule}'s stage graph can carry no cut of the profile's "
                                 f"{len(measured.layers)} layers into {per_copy} stages")
            if carried != bounds and stage_cut is not None:
                raise InputError(f"--stage-cut {stage_cut}: {schedule}'s stage graph cannot carry the cut at layers "
                                 f"{list(bounds)}; give another cut (layers:N,N,...)")
            if carried != bounds:
                spec = dataclasses.replace(spec, bounds=carried)
                if not as_json:
                    stdout.print(f"note: {schedule}'s stage graph cannot carry the profile's partition (layers "
                                 f"{list(bounds)}, cut as a chain); running on layers {list(carried)}, the cut it "
                                 "carries with the fastest slowest stage (`pipesim compare` re-cuts the profile "
                                 "there)", highlight=False)
        job, layout = TorchrunEnv.detect(), Layout.of(built)
        if job is None:
            _check_rank_count(layout.ranks)
        else:  # refused here, as bad input: said once per host (`fail`), where the executor's error is each rank's
            refuse(job.world_refusal(built, layout))
        try:  # the transport the ranks will open, refused before any starts
            choose_transport(device, job.local_world_size if job else layout.ranks, backend=backend)
        except TransportError as exc:
            raise InputError(str(exc)) from None
        if measured is not None and measured.environment.passes_as == "torch":  # what compare would predict from
            print_message(f"warning: {passes_warning(torch_run=False)}", stderr)
        failure = None
        started = True  # from here on, what fails may be one rank's alone, which each such rank says
        with _progress_bar(minibatches, disable=as_json or (job is not None and job.rank != 0)) as show:
            try:
                if job is None:
                    result = run_multiprocess(spec, device=device, backend=backend, stall_timeout_s=stall_timeout,
                                              on_progress=show)
                else:
                    result = run_torchrun(spec, job, device=device, backend=backend, on_progress=show)
            except RunFailed as exc:
                failure, result = exc, exc.result
        if result is None:  # a torchrun rank other than 0: rank 0 reports
            return
        ranks = ranks_per_host(result.trace.meta.hardware) or 1
        result.trace.meta.extra["host_load"] = HostLoad.since(began, ranks * threads_per_rank).to_dict()
        if measured is not None:  # what `pipesim compare` predicts the run from
            result.trace.meta.extra["profile"] = measured.model_dump(mode="json")
        elif scenario is not None:  # the what-if costs the order was searched for
            result.trace.meta.extra["searched_for"] = {flag_of(name): ctx.params[name]
                                                       for name in SEARCH_COSTS if is_given(ctx, name)}
        # a write that fails (a full disk) is said after the run's results, which it would otherwise lose
        if trace is not None:
            if not _written(lambda: write_trace(result.trace, trace), "--trace", unwritten):
                trace = None
        if failure is not None:
            for why in unwritten:
                print_message(why, stderr, "error: ", "bold red")
            if trace is not None:  # on stderr beside --json, whose standard output holds its document or nothing
                (stderr if as_json else stdout).print(f"wrote {trace} (incomplete)", highlight=False)
            if isinstance(failure, RunInterrupted):
                raise KeyboardInterrupt  # cli.main's one line, "interrupted", and exit code 130
            if failure.diverged:
                raise InputError(str(failure))
            print_message(str(failure), stderr, "error: ", "bold red")
            raise SystemExit(1)  # not bad input: the run itself failed
        summary = summarize(result.trace)
        if html is not None:
            from ..traces.view import write_timeline_page

            if not _written(lambda: write_timeline_page(
                    [result.trace], html, title=f"pipesim run: {schedule} (measured)",
                    labels=[f"{schedule} measured"], summaries=[summary]), "--html", unwritten):
                html = None
    except KeyboardInterrupt:  # first: the names of the clauses after it are imported with torch
        if trace is not None and not started:  # a started run writes what its ranks measured, and says so
            print_message(f"--trace {trace}: not written, the run was interrupted before its ranks started", stderr,
                          "note: ")
        raise
    except (InputError, ScheduleError, CostError) as exc:  # a too low --activation-limit included
        fail(str(exc), started or getattr(exc, "every_rank", False))
    except ExecutorError as exc:
        fail(str(exc), every_rank=True)
    except OSError as exc:
        fail(read_error(exc), started)
    except (MemoryError, RuntimeError) as exc:  # the micro-batch the ranks are sent, made here first
        refuse_out_of_host_memory(exc, model, microbatch_size, started)
    if as_json:
        sys.stdout.write(json.dumps(_document(result, summary, trace, html), indent=2) + "\n")
    else:
        _print_table(result, summary, trace, html)
    for why in unwritten[:-1]:
        print_message(why, stderr, "error: ", "bold red")
    if unwritten:
        fail(unwritten[-1], every_rank=True)  # the one rank that reports


def _profiled_devices(method, cut_stages: int, stages: int, microbatches: int, chunks: int | None,
                      pipelines: int | None) -> int:
    """The devices a profile's cut into `cut_stages` model stages (one copy's) runs on under `method`, each device
    running its share of a copy's stages as the method's order at `stages` devices does (v, 2 for a V; a searched
    order's as the order it is partitioned as, which needs no costs): `stages` where the cut divides into none."""
    from ..schedules import ScheduleError
    from ..schedules.catalogue import method_named

    shape = method_named(method.partitioned_as) if method.needs_costs else method
    try:  # two mini-batches: the fewest that show an order's shape
        probe = shape.build(shape.params(stages, microbatches, 2, chunks, pipelines))
    except ScheduleError:  # the run's own build says why
        return stages
    devices = cut_stages * stages / probe.graph.stages_per_copy
    return int(devices) if devices.is_integer() and devices >= 1 else stages


def _written(write: Callable[[], None], flag: str, unwritten: list[str]) -> bool:
    """Run `write` (the output of `flag`): whether it wrote; where not, the line that says why is added to
    `unwritten`."""
    try:
        with writing(flag):
            write()
    except InputError as exc:
        unwritten.append(str(exc))
        return False
    return True


# The files this process holds open per rank it starts (executor/runners.py's run_multiprocess): a pipe's two ends
# that send the rank its work, and the process's sentinel and its pipe to the forkserver.
RANK_FILES = 4


def _check_rank_count(ranks: int) -> None:
    """The ranks `run` starts on this host, one process each, within this process's open-file limit: `--stages 2
    --data-parallel 10**12` opened pipes for 18 s, then stopped at "[Errno 24] Too many open files"."""
    import resource

    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY and ranks * RANK_FILES > files:
        raise InputError(f"--stages x --pipelines x --data-parallel: {ranks:,} ranks, one process each on this host, "
                         f"and its open-file limit (ulimit -n {files:,}) starts {files // RANK_FILES:,} at most; "
                         "give fewer")


def _check_expert_replicas(expert_parallel: int, data_parallel: int, device: str) -> None:
    """--expert-parallel E draws its ranks from the --data-parallel replicas (executor/experts.py), which E must
    divide: simulate's rule, so the flags that run a layout are the flags that simulate it (run took d = E where
    --data-parallel was not given, and started twice the ranks the same flags simulate)."""
    if device != "cpu":
        raise InputError(f"--expert-parallel {expert_parallel:,}: runs on CPU ranks (gloo) only; drop --device "
                         f"{device}")
    from ..schedules.ranks import check_expert_replicas

    with refused_with_flags():
        check_expert_replicas(expert_parallel, data_parallel)


def _check_stage_cut(stage_cut: str | None, profile: Path | None) -> None:
    """Refuse a --stage-cut run cannot take, before anything is read: one without a profile, whose layers it cuts;
    fit, a cut simulate searches within each device's memory; a form simulate does not know."""
    from ..planning.scenario import FIT, CostError, first_last

    if stage_cut is None:
        return
    if profile is None:
        raise InputError(f"--stage-cut {stage_cut}: it cuts a profile's layers: give --profile (without one, run "
                         "cuts the model evenly)")
    if stage_cut == FIT:
        raise InputError(f"--stage-cut {FIT}: a cut simulate searches within each device's memory; give the one it "
                         "found as layers:N,N,..., each stage's layers (`pipesim simulate ... --json`'s stage_bounds, "
                         "differenced)")
    try:
        first_last(stage_cut)
    except CostError as exc:
        raise InputError(str(exc)) from None


def _cut(measured, built, stage_cut: str) -> tuple[int, ...]:
    """The profile's layers cut into one model copy's stages of `built` as `stage_cut` says (planning/scenario.py
    `profile_bounds`, each device's stages as the schedule places them)."""
    from ..planning.scenario import CostError, device_stages, profile_bounds

    per_copy = built.graph.stages_per_copy
    try:
        return tuple(profile_bounds(measured, per_copy, stage_cut, device_stages(built, per_copy)))
    except CostError as exc:
        raise InputError(str(exc)) from None


def _partition(path: Path, model: str | None, options: dict[str, int]):
    """The profile and the stage bounds its partition gives; the model (`model`: --model's, None where not given)
    and the model options given on the command line must be those it was calibrated or estimated with. A profile of
    another model is refused, naming both."""
    measured = read_profile(path)
    if model is not None and measured.model.name != model:
        raise InputError(f"--profile {path}: it profiles model {measured.model.name!r}, not {model!r}; give "
                         f"--model {measured.model.name} or a profile of {model}")
    clash = [key for key, value in options.items() if measured.model.options.get(key) != value]
    if clash:
        made, again, _ = _made(measured)
        raise InputError(f"--{clash[0]} {options[clash[0]]}: the profile {path} was {made} with "
                         f"{clash[0]} {measured.model.options.get(clash[0])}; drop the flag or {again}")
    return measured, tuple(measured.partition.bounds)


class Made(NamedTuple):
    """How a profile's times were made and how to make them again, as a refusal of another size says: an
    estimate was never calibrated."""

    made: str  # estimated or calibrated
    again: str  # what to do for another size
    command: str  # the pipesim command that makes one: estimate or calibrate


def _made(measured) -> Made:
    """The profile's: by `pipesim estimate` where it holds an estimate, else by `pipesim calibrate`."""
    return (Made("estimated", "estimate it again", "estimate") if measured.estimate
            else Made("calibrated", "recalibrate", "calibrate"))


# --timeout's and --stall-timeout's seconds at most: torch's process groups wait in a C int of milliseconds (24.8
# days), past which a rank failed with an OverflowError; a day is past any transfer's or step's wait
MAX_WAIT_S = 86_400
LAYERS_TRIED = 12  # --layers values a model the stage graph cannot carry is tried at, to say which work


def _no_cut(spec, layers: int) -> str:
    """The one line for a model of `layers` layers the schedule's stage graph carries no cut of: for a built-in
    model, which --layers values it does carry (its branches then land on the graph's branches); else which
    built-in models do, at which --layers."""
    from ..executor.stages import MAX_CUTS_SEARCHED
    from ..workload.models import MODELS

    schedule = spec.schedule
    if math.comb(layers - 1, schedule.num_stages - 1) > MAX_CUTS_SEARCHED:
        return (f"model {spec.model!r} ({layers} layers) has more than {MAX_CUTS_SEARCHED:,} cuts into "
                f"{schedule.num_stages} stages, too many to search for one that {schedule.method}'s stage graph "
                "carries: give fewer --layers")
    line = (f"{schedule.method}'s stage graph {sorted(schedule.graph.edges)} carries no cut of model {spec.model!r} "
            f"({layers} layers) into {schedule.num_stages} contiguous stages")
    if spec.model in MODELS:
        works = _layers_carried(spec, spec.model, spec.model_options)
        if works:
            return f"{line}; --layers {_listed(works)} give one (of 1 to {LAYERS_TRIED} tried)"
        line += f"; no --layers from 1 to {LAYERS_TRIED} gives one"
    others = [f"--model {name} carries one at --layers {_listed(works)}" for name in MODELS if name != spec.model
              for works in [_layers_carried(spec, name, {})] if works]
    return f"{line}: give a model that branches as the graph does" + (f" ({'; '.join(others)})" if others else "")


def _layers_carried(spec, model: str, options: dict) -> list[int]:
    """The --layers values from 1 to LAYERS_TRIED at which built-in `model`, with its other `options`, has a cut
    the schedule's stage graph carries."""
    from ..executor import carried_bounds

    return [n for n in range(1, LAYERS_TRIED + 1)
            if carried_bounds(dataclasses.replace(spec, model=model, model_options={**options, "layers": n}))]


def _listed(numbers: list[int]) -> str:
    """Ascending whole numbers as text: "1 to 12" for three or more in a row, else "2, 3, 7"."""
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]} to {numbers[-1]}"
    return ", ".join(map(str, numbers))


@contextmanager
def _progress_bar(minibatches: int, disable: bool):
    """A progress bar on an interactive terminal: mini-batches every device has finished, and the last loss; piped,
    a line of the same now and then (`piped_lines`). Yields the runner's `on_progress`."""
    from rich.progress import Progress

    if not disable and not stderr.is_terminal:
        line = piped_lines("run", stderr)

        def say(progress) -> None:
            loss = "" if progress.last_loss is None else f", loss {progress.last_loss:.4g}"
            line(f"{progress.minibatches_done:,}/{minibatches:,} mini-batches{loss}")

        yield say
        return
    with Progress(*counted_bar_columns(), console=stderr, transient=True, disable=disable) as bar:
        task = bar.add_task("training", total=minibatches)

        def show(progress) -> None:
            loss = "" if progress.last_loss is None else f", loss {progress.last_loss:.4g}"
            bar.update(task, completed=progress.minibatches_done, description=f"training{loss}")

        yield show


def _loss_ends(result) -> tuple[float, float]:
    """The first and last mini-batch's loss, averaged over the pipelines."""
    first = sum(losses[0] for losses in result.losses) / len(result.losses)
    last = sum(losses[-1] for losses in result.losses) / len(result.losses)
    return first, last


def _document(result, summary, trace: Path | None, html: Path | None) -> dict:
    first, last = _loss_ends(result)
    meta = result.trace.meta
    return {"schedule": meta.schedule, "data_parallel": int(meta.params.get("data_parallel", 1)),
            "expert_parallel": int(meta.params.get("expert_parallel", 1)),
            "ms_per_step": summary.time_per_minibatch_ms,
            "samples_per_s": summary.samples_per_s, "makespan_ms": summary.makespan_ms,
            "bubble_fraction": summary.bubble_fraction, "loss_first": first, "loss_last": last,
            "heldout": meta.extra.get("heldout"), "heldout_scored": _heldout_scored(meta.extra),
            "losses": result.losses, "hardware": meta.hardware, "complete": meta.complete,
            "devices": [{"device": d.device, "busy_ms": d.busy_ms, "peak_memory_mb": d.peak_memory_mb}
                        for d in summary.devices],
            "trace": None if trace is None else str(trace), "html": None if html is None else str(html)}


def _heldout_scored(extra: dict) -> bool:
    """Whether the run scored its model on the held-out set: not with --no-heldout (`score_heldout` false); a trace
    written before the flag scored every complete run."""
    return extra.get("score_heldout", True)


def _heldout_text(extra: dict) -> str:
    """The table's held-out loss / accuracy (loss alone for a model that is no classifier): "not scored" with
    --no-heldout, "-" where the model has no held-out set."""
    if not _heldout_scored(extra):
        return "not scored"
    heldout = extra.get("heldout")
    if not heldout:
        return "-"
    return loss_text(heldout["loss"]) + (f" / {percent_text(heldout['accuracy'])}" if "accuracy" in heldout else "")


def _step_text(minibatches: int) -> str:
    """What run's step column measures (traces/metrics.py `summarize`): the mean time between mini-batch ends, from
    the first's on, the last left out where mini-batches overlap; with one mini-batch, that one, marked *."""
    if minibatches == 1:
        return "* step: the one mini-batch, all warm-up (N=1): give --minibatches 2 or more for a steady step"
    return ("step: one mini-batch, the mean time between mini-batch ends from the first's on (the warm-up left out; "
            "the last too where mini-batches overlap)")


def _print_table(result, summary, trace: Path | None, html: Path | None) -> None:
    from ..executor.weights import trained_in

    meta = result.trace.meta
    hardware = meta.hardware or {}
    first, last = _loss_ends(result)
    replicas = int(meta.params.get("data_parallel", 1))
    experts = int(meta.params.get("expert_parallel", 1))
    shares = "".join(f"{count_text(count, noun)} x " for count, noun in meta.batch_copies if count > 1)
    degrees = ", ".join([degree_text(*degree) for degree in [("p", len(summary.devices) // replicas), ("d", replicas)]
                         + [("E", experts)] * (experts > 1)]
                        + ["Megatron-core's rank order"] * (meta.extra.get("rank_order") == "megatron"))
    table = Table(title=f"{meta.schedule} measured: {count_text(meta.minibatches, 'mini-batch')} of "
                        f"{shares}{meta.microbatches:,} x "
                        f"{meta.microbatch_size:,} samples{rounds_text(meta.rounds)}, "
                        f"{count_text(hardware['ranks'], 'rank')}"
                        f"{f' ({degrees})' if replicas > 1 else ''} over "
                        f"{hardware.get('transport')} ({hardware.get('device')})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption=f"{_step_text(meta.minibatches)}; "
                          f"{meta.extra.get('optimizer')} at lr {meta.extra.get('lr')} in "
                          f"{trained_in(meta.extra.get('dtype'))} (--optimizer, --lr, --dtype)",
                  caption_justify="left")
    held = _heldout_text(meta.extra)
    for header in ("ms/step", "samples/s", "loss first -> last", "held-out loss / acc", "peak MiB per device"):
        table.add_column(header, justify="right", no_wrap=True)
    peaks = [mib_text(d.peak_memory_mb) for d in summary.devices]
    if replicas > 1:  # a trace's device is replica·p + device, whatever the rank order
        p = len(peaks) // replicas
        peaks = [f"replica {r:,}: " + ", ".join(peaks[r * p:(r + 1) * p]) for r in range(replicas)]
    else:
        peaks = [f"{device:,}: {peak}" for device, peak in enumerate(peaks)]
    table.add_row(f"{summary.time_per_minibatch_ms:,.2f}{'*' * (meta.minibatches == 1)}",
                  rate_text(summary.samples_per_s),
                  f"{loss_text(first)} -> {loss_text(last)}", held,
                  "; ".join(peaks) if replicas > 1 else ", ".join(peaks))
    print_table(table)
    for path in (path for path in (trace, html) if path is not None):
        stdout.print(f"wrote {path}", highlight=False)
