"""`pipesim calibrate`: measure a torch model into a profile. The only command that imports torch, and only
once it runs."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..choices import choose_from, device_refusal
from ..profiles.workload import is_hf, too_many_stages
from ..traces.compare import TORCH_RUNTIME
from ..traces.metrics import mib_text, percent_text, signed_text
from ..units import GIB, KIB, MIB, bytes_text, count_text
from .common import DTYPES as DTYPE_NAMES  # --dtype's names -> torch's (calibrate.measure's DTYPES: torch's dtypes)
from .common import (
    MODEL_SIZES,
    PROFILE,
    STARTING_STATUS,
    CapacityFactor,
    ExpertFfn,
    Experts,
    Ffn,
    Gated,
    Heads,
    InputError,
    KvHeads,
    Layers,
    SeqLen,
    SharedExperts,
    TopK,
    Vocab,
    Width,
    check_dtype,
    check_expert_parallel,
    check_expert_parallel_unbuilt,
    check_outputs,
    check_threads,
    description_column,
    fail,
    flag_of,
    host_memory_refusal,
    is_given,
    memory_gb_bytes,
    model_reads,
    output_path,
    read_error,
    refuse,
    refuse_out_of_host_memory,
    require,
    require_model,
    say_part_counted,
    stderr,
    stdout,
    transient_status,
    writing,
)
from .estimate import fit_device_curve, print_fitted_curve
from .tables import print_message, print_table

MAX_RUNS = 1_000  # --repeats' and --warmup's bound: every measurement runs them, a calibration's time grows with them
# --passes-as: the code a stage's passes are timed with -> what the summary says runs them
RUNS_PASSES = {"executor": "the executor", "torch": TORCH_RUNTIME}


def calibrate(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(
        "--model", metavar="NAME", help="mlp, cnn, gpt, two-branch, package.module:attribute naming a "
                                        "torch.nn.Sequential, a list of modules, or a zero-argument callable returning "
                                        "one, or hf:PATH, a Hugging Face config.json or its folder (with --seq-len; "
                                        "built with its weights on the device).")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="JSON", parser=output_path, help="Profile JSON to write (replaced atomically).")],
    stages: Annotated[int, typer.Option(
        "--stages", "-p", metavar="P", min=1, help="Pipeline stages p to partition the layers into.")] = 2,
    microbatch_size: Annotated[int, typer.Option(
        "--microbatch-size", "-b", metavar="B", min=1, help="Samples per micro-batch.")] = 8,
    device: Annotated[str | None, typer.Option(
        "--device", metavar="DEVICE", help="cpu or cuda (default: cuda when torch sees a GPU).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="DTYPE", help="float32, bfloat16 or float16 (or fp32, bf16, fp16).")] = "float32",
    memory_gb: Annotated[float | None, typer.Option(
        "--memory-gb", metavar="GIB", help="Per-device memory cap in GiB for the partition (1F1B: weights, gradients, "
                                           "optimizer state, in-flight activations).")] = None,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", metavar="NAME", help="Optimizer whose state the memory cap counts: sgd, momentum, "
                                            "adam, adamw.")] = "adam",
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
    repeats: Annotated[int, typer.Option(
        "--repeats", metavar="N", min=1, help="Timed runs per measurement at most (the median is kept; a measurement "
                                              "stops after 5 once its median's 90 % interval is within 10 %, or 3 % of "
                                              "its stage's F + B for a stage's passes, 1 % for a step), and rounds "
                                              "over the link sizes. At most 1,000.")] = 10,
    warmup: Annotated[int, typer.Option(
        "--warmup", metavar="N", min=0, help="Untimed runs before them (one at most for the layers, passes and steps: "
                                             "what ran just before warmed them). At most 1,000.")] = 2,
    links: Annotated[bool, typer.Option(
        "--links/--no-links", help="Measure the point-to-point link and the all-reduce between two local "
                                   "ranks.")] = True,
    expert_parallel: Annotated[int, typer.Option(
        "--expert-parallel", metavar="E", min=2, help="With --experts: the expert-parallel ranks the all-to-all is "
                                                      "measured over, at the sizes the layers exchange, for runs of "
                                                      "`pipesim run --expert-parallel E`.")] = 2,
    link_max_mb: Annotated[float, typer.Option(
        "--link-max-mb", metavar="MIB", help="Largest link message in MiB (powers of two from 4 KiB).")] = 64.0,
    threads: Annotated[int, typer.Option(
        "--threads", min=1, metavar="T", help="Torch threads to measure with: as many as each rank of the "
                                              "run has (`pipesim run --threads-per-rank`), at most the cores "
                                              "pipesim may run on.")] = 1,
    runtime: Annotated[bool, typer.Option(
        "--runtime/--no-runtime", help="Measure the executor's own cost per row: two ranks running a tiny model "
                                       "(kept in the host cache), then the calibrated model where the host "
                                       "time between its rows can change a prediction.")] = True,
    passes_as: Annotated[str, typer.Option(
        "--passes-as", metavar="RUNTIME", help="Time each stage's passes as this runtime computes them: executor "
                                               "(pipesim run's: functional_call under saved-tensor hooks) or torch "
                                               "(torch.distributed.pipelining's stage: the module called plainly, "
                                               "torch's stage_backward into .grad), to predict a torch run; torch "
                                               "leaves out the runtime probe, which times pipesim's executor.")
    ] = "executor",
    contention: Annotated[bool, typer.Option(
        "--contention/--no-contention", help="Measure how much ranks computing at once on this CPU host slow each "
                                             "other: the stages' forward and backward in one process per stage "
                                             "(two at least), each alone, then together (windows of 0.25 s, "
                                             "or a warm-up and 2 of the slowest stage's iterations; kept in the "
                                             "host cache for a calibration of the same model again). Not run on "
                                             "cuda, whose profile has none.")] = True,
    ranks: Annotated[int | None, typer.Option(
        "--ranks", metavar="N", min=2, help="The most ranks a run of this profile will have on this host, which the "
                                            "contention probe runs up to (default: one per stage; AvgPipe's P "
                                            "pipelines have P per stage). Beyond it the simulator holds the last "
                                            "measured slowdown.")] = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Measure the per-host terms again (the link, all-reduce and the runtime probe, kept in "
                        "$PIPESIM_CACHE_DIR, else $XDG_CACHE_HOME/pipesim or ~/.cache/pipesim, per host, torch "
                        "version, threads, dtype and sizes; and contention, per model, options, cut and micro-batch "
                        "too) instead of reusing them.")] = False,
) -> None:
    """Measure a model on this machine into a profile. `pipesim simulate --profile` reads it.

    Per layer: forward, backward and its input/weight-gradient split, saved activations, output, weight,
    gradient and optimizer-state bytes. Per stage of the partition: optimizer, weight-prediction and
    averaging steps. And the p2p link (a piecewise fit) and all-reduce between two ranks, the executor's
    own cost per row (compute, send, receive, the gap between rows), and on CPU how much ranks computing at
    once slow each other. What depends on the host and not on the model is kept in a cache and reused
    (`--fresh` measures it again); a line per phase on stderr says what each took.
    """
    from ..profiles.partition import PartitionError
    from ..profiles.schema import optimizer_refusal, profile_json
    from ..traces import write_atomic
    from ..traces.hostload import HostLoad, mark
    from ..workload.hfconfig import build_imports
    from ..workload.processes import prepare, ready
    from ..workload.sizes import flag_sizes_refusal, model_name_refusal, stages_refusal

    runtime = runtime and passes_as != "torch"  # its per-row costs are the executor's, not torch's runtime's
    starts_processes = runtime or contention or links
    try:
        # first the flags, which need nothing started: a bad one is refused before the load window and the
        # processes' server (whose imports take a core for seconds)
        check_outputs([("--out", out, PROFILE)], model_reads(ctx.params))
        refuse(model_name_refusal(model))
        model_sizes = {name: ctx.params.get(name) for name in MODEL_SIZES}
        refuse(flag_sizes_refusal(model, model_sizes)
               or stages_refusal(f"--stages {stages:,}", stages, model, model_sizes))
        if passes_as not in RUNS_PASSES:
            raise InputError(choose_from("--passes-as", RUNS_PASSES, passes_as))
        if passes_as == "torch" and is_given(ctx, "runtime") and ctx.params["runtime"]:
            raise InputError("--runtime times pipesim's executor's per-row costs, which a torch run has not: "
                             "leave it out with --passes-as torch")
        check_dtype(dtype)
        dtype = DTYPE_NAMES[dtype]
        refuse(optimizer_refusal(optimizer, "--optimizer"))
        if device is not None:  # None: cuda where torch sees a GPU, asked of torch later
            refuse(device_refusal(device))
        memory_cap_bytes = memory_gb_bytes(memory_gb)
        check_threads("--threads", threads)
        for flag, runs in (("--repeats", repeats), ("--warmup", warmup)):
            if runs > MAX_RUNS:
                raise InputError(f"{flag}: give at most {MAX_RUNS:,} runs a measurement, a hundred times the default "
                                 f"--repeats (got {runs:,})")
        for flag in ("link_max_mb", "expert_parallel"):
            if not links and is_given(ctx, flag):
                raise InputError(f"{flag_of(flag)} sizes the link measurement, which --no-links skips: "
                                 "give one")
        if is_given(ctx, "expert_parallel") and not is_hf(model):  # a config's experts: once transformers reads it
            check_expert_parallel_unbuilt(expert_parallel, model, {"experts": experts})
        if ranks is not None and not contention:
            raise InputError("--ranks sizes the contention probe, which --no-contention skips: give one")
        if links and not 8 * KIB <= link_max_mb * MIB <= 4 * GIB:
            raise InputError(f"--link-max-mb: give from 8 KiB ({8 * KIB / MIB:g} MiB: two sizes to fit a line) to "
                             f"{4 * GIB // MIB:,} MiB (got {link_max_mb:g})")
        began = mark()  # the host's load before this calibration starts anything
        # what a cached host term is reused under: the others' load with nothing of this calibration running yet
        load_now = HostLoad.now(began) if starts_processes else None
        if starts_processes:  # before torch's import: their server imports it while this process does
            prepare(build_imports(model))
        with transient_status(STARTING_STATUS, quiet=False):  # torch's import: seconds before the phases' bar
            require_model("pipesim calibrate", model)  # torch imported, so a broken build stops here
            if runtime:  # its probe times the executor on a small mlp, which draws the digits
                require("pipesim calibrate's runtime probe (--no-runtime skips it)", "sklearn")
            from ..calibrate.cache import HostCache
            from ..calibrate.contention import ContentionError, ContentionProbe
            from ..calibrate.links import LinkError
            from ..calibrate.measure import DTYPES, DeviceError, Settings, resolve_device
            from ..calibrate.measure import calibrate as run_calibration
            from ..calibrate.runtime import RuntimeProbeError
            from ..profiles.linkfit import default_sizes
            from ..workload.models import ModelError, build_model

        try:
            settings = Settings(resolve_device(device), DTYPES[dtype], microbatch_size, warmup, repeats, threads)
            options = dict(layers=layers, width=width, heads=heads, seq_len=seq_len, vocab=vocab, ffn=ffn,
                           kv_heads=kv_heads, gated=gated, experts=experts, top_k=top_k,
                           shared_experts=shared_experts, expert_ffn=expert_ffn, capacity_factor=capacity_factor)
            refuse(host_memory_refusal("calibrate", model, options, microbatch_size if settings.device.type == "cpu"
                                       else None, dtype))  # a GPU's forward holds its micro-batch there
            net = build_model(model, **options)
            say_part_counted(model)
            # a model that is no built-in, once built
            refuse(too_many_stages(f"--stages {stages:,}", stages, net.name, net.options, net.layers))
            if is_given(ctx, "expert_parallel"):
                check_expert_parallel(expert_parallel, net)
            sizes = default_sizes(int(link_max_mb * MIB)) if links else []
            if ranks is not None and settings.device.type != "cpu":
                raise InputError(f"--ranks sizes the CPU contention probe; a {settings.device.type} profile has "
                                 "none: leave it out")
            contention = contention and settings.device.type == "cpu"
            cache = HostCache(fresh=fresh, load_now=load_now)
            with _phases(f"calibrating {net.name}") as (advance, phase):
                if starts_processes:  # nothing is timed while the server imports
                    ready()
                profile = run_calibration(
                    net, settings, stages=stages, optimizer=optimizer, dtype_name=dtype, link_sizes=sizes,
                    memory_cap_bytes=memory_cap_bytes, advance=advance,
                    cache=cache, phase=phase, expert_parallel=expert_parallel, passes_as=passes_as)
                probe = ContentionProbe(profile, model, options, advance, ranks) if contention else None
                kept = cache.find("contention", probe.cache_key()) if probe is not None else None
                if runtime:
                    profile = profile.model_copy(update={"runtime": measure_runtime(
                        profile, settings, advance, model, options, cache=cache, phase=phase,
                        alongside=probe if kept is None else None)})
                if probe is not None:
                    profile = profile.model_copy(update={"contention": _contention(probe, kept, cache, phase)})
                profile = fit_device_curve(profile, phase)
            # the most busy tasks it ran at once: the contention probe's processes, else the link's or the
            # runtime probe's two ranks, else itself
            busy = max(probe.count if probe is not None else 0, 2 if links or runtime else 1) * threads
            profile = profile.model_copy(update={"environment": profile.environment.model_copy(update={
                "load": HostLoad.since(began, busy).to_dict(),
                "ranks": probe.count if probe is not None else stages})})
            if cache.unwritable:
                print_message(f"note: the host cache could not be written ({cache.unwritable}); the next "
                              "calibration measures its terms again", stderr)
        except (ModelError, DeviceError, PartitionError, LinkError, RuntimeProbeError, ContentionError) as exc:
            raise InputError(str(exc)) from None
        except (MemoryError, RuntimeError) as exc:  # the model or its batch does not fit in memory
            refuse_out_of_host_memory(exc, model, microbatch_size)
        except OSError as exc:
            raise InputError(f"calibration failed: {read_error(exc)}") from None
        with writing("--out"):
            write_atomic(out, profile_json(profile))
    except InputError as exc:
        fail(str(exc))
    _print_profile(profile)
    stdout.print(f"wrote {out}", highlight=False)


def measure_runtime(profile, settings, advance, model: str, options: dict, cache=None,
                    phase=lambda title: nullcontext([]), alongside=None):
    """The executor's per-row costs: the probe model (one tiny block and the classifier, its boundary as wide
    as the profile's) calibrated, then run for real (`probe_schedule`) on two ranks over the run's transport
    with `settings.threads` per rank, taken from the host `cache` (calibrate/cache.py) where it holds them;
    and, every time, the same schedules run on the calibrated model itself (`model` with `options`, at the
    profile's partition), whose host time between rows runs on the caches its stages' compute leaves
    (calibrate/runtime.py reads the traces). Each part runs inside `phase(title)`. A contention probe
    `alongside` (calibrate/contention.py) needing as many processes as that run has ranks measures in them
    first, sharing their start-up."""
    from ..calibrate.cache import fresh
    from ..calibrate.runtime import (
        PROBE_MICROBATCHES,
        PROBE_SCHEDULES,
        PROBE_STEADY,
        WARMUP_ROWS,
        host_plan,
        host_share,
        host_times,
        probe_width,
    )
    from ..profiles.schema import RuntimeProfile
    from ..workload.transport import choose_transport

    env = profile.environment
    probe_options = {"layers": 1, "width": probe_width(profile, settings.dtype.itemsize)}
    # its two ranks' transport: their sends, and on a GPU they share, the passes its terms are read against, as
    # issued from an idle GPU (`StagePasses.issued`), so a probe made under another is not reused
    key = {"device": env.device, "transport": choose_transport(env.device, 2).kind, "dtype": env.dtype,
           "microbatch_size": env.microbatch_size, "threads": settings.threads, "repeats": settings.repeats,
           "warmup": settings.warmup, "probe": probe_options, "schedules": PROBE_SCHEDULES,
           "microbatches": PROBE_MICROBATCHES, "steady": PROBE_STEADY, "warmup_rows": WARMUP_ROWS}
    with phase(f"runtime probe ({' then '.join(PROBE_SCHEDULES)} on two ranks)") as notes:
        measure = lambda: _probe_terms(profile, settings, advance, probe_options).model_dump(mode="json")  # noqa: E731
        probe = cache.get("runtime-probe", key, measure, own_tasks=2 * settings.threads) if cache is not None \
            else fresh(measure)
        runtime = RuntimeProfile.model_validate(probe.value)
        if cache is not None:
            notes.append(probe.describe())
        stages = profile.partition.stages
        plan = host_plan(profile, runtime) if stages >= 2 else None
        share = host_share(profile, runtime)
        if stages >= 2 and plan is None:
            notes.append(f"the gaps and sends from it too: {share:.2%} of the shortest stage's F + B, too little "
                         "for the calibrated model's run to change")
    meta = {**runtime.meta, "host_times_from": "the probe", "host_share": round(share, 5)}
    if plan is not None:
        hosted = alongside if alongside is not None and alongside.count == stages else None
        shape = ", ".join([count_text(stages, "rank"), count_text(plan.microbatches, "micro-batch"),
                           count_text(plan.minibatches, "mini-batch")])
        with phase(f"running the calibrated model ({shape}"
                   f"{'; contention measured in its ranks first' if hosted else ''})"):
            trace = _probe_run(model, {k: v for k, v in options.items() if v is not None}, profile.partition.bounds,
                               settings, env, plan, f"the calibrated model's {count_text(stages, 'rank')}", advance,
                               hosted.prelude(phase) if hosted else None)
        runtime = host_times(runtime, [trace])
        meta.update(host_times_from="the calibrated model", host_microbatches=plan.microbatches,
                    host_minibatches=plan.minibatches)
    if cache is not None:
        meta["host_cache"] = probe.meta()
    return runtime.model_copy(update={"meta": meta})


def _contention(probe, kept, cache, phase):
    """The contention `probe`'s factors: `kept` in the host cache by a calibration of the same workload, else
    measured (in the ranks of the calibrated model's run, before it, or now in processes of its own) and kept."""
    from ..profiles.schema import ContentionProfile

    if kept is None:
        if not probe.done:
            with phase(f"measuring contention ({probe.count} processes)"):
                probe.run()
        kept = cache.keep("contention", probe.cache_key(), probe.result().model_dump(mode="json"), probe.load)
        print_message(f"contention ({probe.count} processes): {kept.describe()}", stderr)
    else:
        with phase(f"contention ({probe.count} processes)") as notes:
            notes.append(kept.describe())
    measured = ContentionProfile.model_validate(kept.value)
    return measured.model_copy(update={"meta": {**measured.meta, "host_cache": kept.meta()}})


def _probe_terms(profile, settings, advance, probe_options: dict):
    """The runtime probe itself: its model calibrated and run (calibrate/runtime.py's `runtime_terms`)."""
    from ..calibrate.measure import calibrate as run_calibration
    from ..calibrate.runtime import PROBE_OPTIMIZER, PROBE_PLAN, PROBE_SCHEDULES, runtime_terms
    from ..workload.models import build_model

    env = profile.environment
    probe = run_calibration(build_model("mlp", **probe_options), settings, stages=2, optimizer=PROBE_OPTIMIZER,
                            memory_cap_bytes=None, link_sizes=[], dtype_name=env.dtype,
                            advance=lambda what: advance(f"runtime probe: {what}"))
    trace = _probe_run("mlp", probe_options, probe.partition.bounds, settings, env, PROBE_PLAN, "two ranks",
                       advance)
    meta = {"model": "mlp", "options": probe_options, "boundary_bytes": probe.stages[0].output_bytes,
            "schedules": list(PROBE_SCHEDULES), "ranks": 2, "threads_per_rank": settings.threads,
            "microbatches": PROBE_PLAN.microbatches, "minibatches": PROBE_PLAN.minibatches,
            **trace.meta.hardware}
    return runtime_terms([trace], probe, meta)


def _probe_run(name: str, given: dict, bounds: list[int], settings, env, plan, what: str, advance, prelude=None):
    """The probe's schedules (`plan`, a `RunPlan`) run for real on model `name` cut at `bounds` (after `prelude`
    in its ranks, if given): its trace, timed for its rows alone (the trained model is not scored)."""
    from ..calibrate.runtime import PROBE_OPTIMIZER, RuntimeProbeError
    from ..executor import ExecutorError, RunSpec, run_multiprocess

    advance(f"runtime probe: running {what}")
    spec = RunSpec(plan.schedule(len(bounds) - 1), name, given, microbatch_size=env.microbatch_size,
                   optimizer=PROBE_OPTIMIZER, dtype=env.dtype, bounds=tuple(bounds),
                   threads_per_rank=settings.threads, heldout=False)
    try:
        return run_multiprocess(spec, device=env.device, prelude=prelude).trace
    except ExecutorError as exc:
        raise RuntimeProbeError(f"the runtime probe failed: {str(exc).splitlines()[0]}") from None


@contextmanager
def _phases(title: str):
    """Yields (advance, phase): `phase(name)` wraps one phase of the calibration and prints "name ... 3.1 s"
    (with the notes its body adds) on stderr when it ends, also when stderr is not a terminal; on a terminal a
    transient bar under those lines names the unit of work running (`advance(what)`, called as each starts)."""
    from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), description_column(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        task = bar.add_task(title)

        def advance(what: str) -> None:
            bar.update(task, description=f"{title}: {what}")

        @contextmanager
        def phase(name: str):
            notes: list[str] = []
            bar.update(task, description=f"{title}: {name}")
            started = time.perf_counter()
            yield notes
            said = f" ({'; '.join(notes)})" if notes else ""
            print_message(f"{name} ... {time.perf_counter() - started:.1f} s{said}", stderr)

        yield advance, phase


def _print_profile(profile) -> None:
    """Per stage: layers, times, the backward's split, memory; the host's load; then the runtime's terms,
    contention, the link fit and all-reduce points."""
    from ..profiles.schema import PASSES
    from ..traces.hostload import HostLoad

    env = profile.environment
    table = Table(title=f"{profile.model.name} on {env.device_name} ({env.device}, {env.dtype}, micro-batch "
                        f"{env.microbatch_size}, {count_text(env.threads, 'thread')}), partitioned for "
                        f"{profile.partition.optimizer}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption=f"per micro-batch, each stage timed as one pass as {RUNS_PASSES[env.passes_as]} runs it; "
                          "x layers: that "
                          "over the sum of its layers timed alone (F/B); I/W: input- and weight-gradient passes of "
                          "the split backward; peak: 1F1B estimate (weights, grads, optimizer state, activations "
                          "in flight)",
                  caption_justify="left")
    for header in ("stage", "layers", "fwd ms", "bwd ms", "x layers", "I/W ms", "W share", "act MiB", "params MiB",
                   "peak MiB"):
        table.add_column(header, justify="left" if header in ("stage", "layers") else "right", no_wrap=True)
    for k, stage in enumerate(profile.stages):
        first, stop = stage.layers
        mine = profile.layers[first:stop]
        ratios = [ms / summed if summed > 0 else 1.0 for ms, summed in (
            (stage.fwd_ms, sum(layer.fwd.median_ms for layer in mine)),
            (stage.bwd_ms, sum(layer.bwd.median_ms for layer in mine)))] if stage.passes else []
        table.add_row(str(k), f"{first}-{stop - 1}" if stop - first > 1 else str(first), f"{stage.fwd_ms:,.3f}",
                      f"{stage.bwd_ms:,.3f}", "/".join(f"{r:.2f}" for r in ratios) or "-",
                      f"{stage.igrad_ms:,.3f}/{stage.wgrad_ms:,.3f}",
                      percent_text(stage.wgrad_fraction), mib_text(stage.activation_bytes / MIB),
                      mib_text(stage.param_bytes / MIB), mib_text(stage.memory_bytes / MIB))
    print_table(table)
    idle = [(k, stage.passes.idle) for k, stage in enumerate(profile.stages)
            if stage.passes is not None and stage.passes.idle]
    if idle:
        stdout.print("above: each pass queued behind the one before, as ranks with a GPU each issue them; from an "
                     "idle GPU, as ranks sharing GPUs do (F/B/I/W ms): " + "; ".join(
                         f"stage {k} " + "/".join(f"{getattr(times, name).median_ms:.3f}" for name in PASSES)
                         for k, times in idle), highlight=False)
    print_fitted_curve(profile)
    load = HostLoad.from_dict(env.load)
    if load is not None:
        stdout.print(f"host while calibrating: {load.describe()}; calibrated for {count_text(env.ranks, 'rank')} "
                     "computing at once", highlight=False)
    if profile.runtime is not None:
        rt = profile.runtime
        compute = ", ".join(f"{kind} {t.median_ms * 1e3:.0f}" for kind, t in rt.compute_ms.items())
        gaps = ", ".join(f"{kind} {t.median_ms * 1e3:.0f}" for kind, t in rt.gap_ms.items())
        ran = rt.meta.get("host_times_from") == "the calibrated model"
        stdout.print(f"runtime per row, us: compute {compute}; send {rt.send_ms.median_ms * 1e3:.0f} (its CPU time), "
                     f"receive {rt.recv_ms.median_ms * 1e3:.0f}; gap after {gaps}"
                     + (" (the send and gaps from the calibrated model's run)" if ran else "")
                     + _cached(rt.meta, "the probe's other terms" if ran else "the probe's terms"), highlight=False)
        if rt.warmup_ms:
            stdout.print(f"warm-up: a fresh rank's first compute rows, {rt.warmup_rows} at a time, cost "
                         + ", ".join(f"+{ms * 1e3:.0f}" for ms in rt.warmup_ms) + " us each beyond their steady "
                         "time (the probe's; a short run's time per mini-batch carries them)", highlight=False)
    if profile.contention is not None:
        meta = profile.contention.meta
        at_once = ", ".join(f"{k} ranks computing at once {slowdown:.2f}x their time alone" if k == 2 else
                            f"{k}: {slowdown:.2f}x" for k, slowdown in enumerate(profile.contention.slowdown[1:], 2))
        threads = meta.get("threads_per_process")
        stdout.print(f"contention: {at_once} ({count_text(threads, 'thread')} per rank, "
                     f"{meta.get('cpus_usable')} cores); a rank alone: mean {profile.contention.tail:.3f}x its "
                     "median iteration in CPU time (the passes are priced at their mean)"
                     + _cached(meta, "the factors"), highlight=False)
        solo_ms, of = meta.get("solo_median_ms", meta.get("solo_ms")), meta.get("workload", {}).get("stages")
        if solo_ms and of and all(stage.passes is not None for stage in profile.stages):
            drift = [ms / (profile.stages[k].fwd_ms + profile.stages[k].bwd_ms) - 1 for ms, k in zip(solo_ms, of)]
            stdout.print("contention probe, each rank alone, against its stage's calibrated F + B: "
                         + ", ".join(signed_text(100 * d, 0) + "%" for d in drift)
                         + " (the same code: the host's drift in between)",
                         highlight=False)
    if profile.link is None:
        stdout.print("links: not measured (--no-links)", highlight=False)
        return
    from ..profiles.linkfit import MAX_BYTES_PER_MS

    meta = profile.link.meta
    # a segment whose times did not grow with size is fitted at the ceiling: "1e+06 GB/s" read as a measurement
    lines = [f"from {bytes_text(s.min_bytes)}: {s.latency_ms * 1e3:.1f} us "
             + ("at any size (its times did not grow)" if s.bytes_per_ms >= MAX_BYTES_PER_MS else
                f"+ {s.bytes_per_ms / 1e6:.3g} GB/s") for s in profile.link.segments]
    stdout.print(f"p2p link fit ({meta.get('backend')}, {meta.get('device')}): " + "; ".join(lines)
                 + _cached(meta, "the link and all-reduce"), highlight=False)
    points = profile.allreduce.points
    stdout.print(f"all-reduce ({profile.allreduce.world_size} ranks): " + ", ".join(
        f"{bytes_text(p.nbytes)} {p.ms:.3g} ms" for p in (points[0], points[len(points) // 2], points[-1])),
        highlight=False)
    if profile.all_to_all is not None:
        term = profile.all_to_all
        stdout.print(f"all-to-all ({term.world_size} ranks, {term.meta.get('backend')}): " + "; ".join(
            f"from {bytes_text(s.min_bytes)}: {s.latency_ms * 1e3:.1f} us + {s.bytes_per_ms / 1e6:.3g} GB/s"
            for s in term.segments) + f" (a rank's buffer, {bytes_text(term.points[0].nbytes)} to "
            f"{bytes_text(term.points[-1].nbytes)})" + _cached(term.meta, "the all-to-all"), highlight=False)


def _cached(meta: dict, what: str) -> str:
    """Where a per-host term (`what`) taken from the host cache says how old it is and under what load it was
    measured."""
    from ..traces.hostload import HostLoad, format_age

    cached = meta.get("host_cache") or {}
    if not cached.get("reused"):
        return ""
    load = HostLoad.from_dict(cached.get("load"))
    return (f" ({what} from the host cache, measured {format_age(cached['age_s'])} ago at "
            f"{load.describe() if load is not None else 'load not recorded'})")
