"""`pipesim calibrate`: measure a torch model into a profile. The only command that imports torch, and only
once it runs."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..units import GIB, KIB, MIB
from .common import (
    InputError,
    check_memory_gb,
    check_writable,
    fail,
    is_given,
    require,
    require_model_data,
    stderr,
    stdout,
    write_error,
)


def calibrate(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(
        "--model", help="mlp, cnn, gpt, two-branch, or package.module:attribute naming a torch.nn.Sequential, a list "
                        "of modules, or a zero-argument callable returning one.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write (replaced atomically).")],
    stages: Annotated[int, typer.Option(
        "--stages", "-p", min=1, help="Pipeline stages p to partition the layers into.")] = 2,
    microbatch_size: Annotated[int, typer.Option(
        "--microbatch-size", "-b", min=1, help="Samples per micro-batch.")] = 8,
    device: Annotated[str | None, typer.Option(
        "--device", help="cpu or cuda (default: cuda when torch sees a GPU).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")] = "float32",
    memory_gb: Annotated[float | None, typer.Option(
        "--memory-gb", help="Per-device memory cap in GiB for the partition (1F1B: weights, gradients, optimizer "
                            "state, in-flight activations).")] = None,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", help="Optimizer whose state the memory cap counts: sgd, momentum, adam, adamw.")] = "adam",
    layers: Annotated[int | None, typer.Option(
        "--layers", help="Built-in models: layers (blocks; per branch for two-branch).")] = None,
    width: Annotated[int | None, typer.Option(
        "--width", help="Built-in models: hidden width (channels for cnn and two-branch).")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="gpt: attention heads.")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="gpt: sequence length.")] = None,
    vocab: Annotated[int | None, typer.Option("--vocab", help="gpt: vocabulary size.")] = None,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Timed runs per measurement, and rounds over the link sizes (the median is "
                                 "kept).")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed runs before them.")] = 2,
    links: Annotated[bool, typer.Option(
        "--links/--no-links", help="Measure the point-to-point link and the all-reduce between two local "
                                   "ranks.")] = True,
    link_max_mb: Annotated[float, typer.Option(
        "--link-max-mb", help="Largest link message in MiB (powers of two from 4 KiB).")] = 64.0,
    threads: Annotated[int, typer.Option(
        "--threads", min=1, metavar="T", help="Torch threads to measure with: as each rank of the run has them "
                                              "(`pipesim run --threads-per-rank`, default 1).")] = 1,
    runtime: Annotated[bool, typer.Option(
        "--runtime/--no-runtime", help="Measure the executor's own cost per row (a few seconds of two ranks "
                                       "running a tiny model).")] = True,
    contention: Annotated[bool, typer.Option(
        "--contention/--no-contention", help="Measure how much ranks computing at once on this CPU host slow each "
                                             "other: the stages' forward and backward in one process per stage "
                                             "(two at least), each alone, then together (about 5 s for two "
                                             "stages, 2-3 s more per further stage). Not run on cuda, whose "
                                             "profile has none.")] = True,
    ranks: Annotated[int | None, typer.Option(
        "--ranks", min=2, help="The most ranks a run of this profile will have on this host, which the contention "
                               "probe runs up to (default: one per stage; AvgPipe's P pipelines have P per "
                               "stage). Beyond it the simulator holds the last measured slowdown.")] = None,
) -> None:
    """Measure a model on this machine into a profile for `pipesim simulate --profile`.

    Per layer: forward, backward and its input/weight-gradient split, saved activations, output, weight,
    gradient and optimizer-state bytes. Per stage of the partition: optimizer, weight-prediction and
    averaging steps. And the p2p link (a piecewise fit) and all-reduce between two ranks, the executor's
    own cost per row (compute, send, receive, the gap between rows), and on CPU how much ranks computing at
    once slow each other.
    """
    from ..profiles.partition import PartitionError
    from ..profiles.schema import OPTIMIZERS, profile_json
    from ..traces import write_atomic

    try:
        require("pipesim calibrate", "torch")
        require_model_data("pipesim calibrate", model)
        if runtime:  # its probe times the executor on a small mlp, which draws the digits
            require("pipesim calibrate's runtime probe (--no-runtime skips it)", "sklearn")
        check_writable("--out", out)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(f"--dtype: choose float32, bfloat16 or float16 (got {dtype!r})")
        if optimizer not in OPTIMIZERS:
            raise InputError(f"--optimizer: choose from {', '.join(OPTIMIZERS)} (got {optimizer!r})")
        check_memory_gb(memory_gb)
        if not links and is_given(ctx, "link_max_mb"):
            raise InputError("--link-max-mb sizes the link measurement, which --no-links skips: give one")
        if ranks is not None and not contention:
            raise InputError("--ranks sizes the contention probe, which --no-contention skips: give one")
        if links and not 8 << 10 <= link_max_mb * MIB <= 4 << 30:
            raise InputError(f"--link-max-mb: give from 8 KiB ({8 / 1024:g} MiB: two sizes to fit a line) to "
                             f"4096 MiB (got {link_max_mb})")
        from ..calibrate.contention import ContentionError, measure_contention, progress_units
        from ..calibrate.links import LinkError
        from ..calibrate.measure import DTYPES, DeviceError, Settings, resolve_device
        from ..calibrate.measure import calibrate as run_calibration
        from ..calibrate.runtime import PROBE_SCHEDULES, RuntimeProbeError
        from ..profiles.linkfit import default_sizes
        from ..workload.models import ModelError, build_model

        try:
            settings = Settings(resolve_device(device), DTYPES[dtype], microbatch_size, warmup, repeats, threads)
            options = dict(layers=layers, width=width, heads=heads, seq_len=seq_len, vocab=vocab)
            net = build_model(model, **options)
            if stages > len(net.layers):
                raise InputError(f"--stages {stages}: {net.name} has {len(net.layers)} layers; give at most "
                                 f"{len(net.layers)} (each stage needs at least one layer)")
            sizes = default_sizes(int(link_max_mb * MIB)) if links else []
            if ranks is not None and settings.device.type != "cpu":
                raise InputError(f"--ranks sizes the CPU contention probe; a {settings.device.type} profile has "
                                 "none: leave it out")
            contention = contention and settings.device.type == "cpu"
            rounds = warmup + repeats  # the layers' rounds, then the stages' as one pass
            work = 2 * rounds + 5 * stages + (2 * (repeats + 1) if sizes else 0) + (
                2 * rounds + 10 + 2 * len(PROBE_SCHEDULES) if runtime else 0) + (
                progress_units(ranks or stages) if contention else 0)
            with _steps(work, f"calibrating {net.name}") as advance:
                profile = run_calibration(
                    net, settings, stages=stages, optimizer=optimizer, dtype_name=dtype, link_sizes=sizes,
                    memory_cap_bytes=int(memory_gb * GIB) if memory_gb is not None else None, advance=advance)
                if runtime:
                    profile = profile.model_copy(update={"runtime": measure_runtime(profile, settings, advance, model,
                                                                                    options)})
                if contention:
                    measured = measure_contention(profile, model, options, advance, ranks)
                    profile = profile.model_copy(update={"contention": measured})
        except (ModelError, DeviceError, PartitionError, LinkError, RuntimeProbeError, ContentionError) as exc:
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
            raise InputError(write_error(exc)) from None
    except InputError as exc:
        fail(str(exc))
    _print_profile(profile)
    stdout.print(f"wrote {out}", highlight=False)


def measure_runtime(profile, settings, advance, model: str, options: dict):
    """The executor's per-row costs: calibrate the probe model (one tiny block and the classifier, its boundary
    as wide as the profile's), then run it for real with each probe schedule on two ranks over the run's
    transport with `settings.threads` per rank; and the same schedules on the calibrated model itself (`model`
    with `options`, at the profile's partition), whose host time between rows runs on the caches its stages'
    compute leaves (calibrate/runtime.py reads the traces)."""
    from ..calibrate.measure import calibrate as run_calibration
    from ..calibrate.runtime import (
        PROBE_MICROBATCHES,
        PROBE_MINIBATCHES,
        PROBE_OPTIMIZER,
        PROBE_SCHEDULES,
        RuntimeProbeError,
        probe_width,
        runtime_terms,
    )
    from ..executor import ExecutorError, RunSpec, run_multiprocess
    from ..schedules import ScheduleParams, build_schedule
    from ..workload.models import build_model

    env = profile.environment
    probe_options = {"layers": 1, "width": probe_width(profile, settings.dtype.itemsize)}
    probe = run_calibration(build_model("mlp", **probe_options), settings, stages=2, optimizer=PROBE_OPTIMIZER,
                            memory_cap_bytes=None, link_sizes=[], dtype_name=env.dtype,
                            advance=lambda what: advance(f"runtime probe: {what}"))
    def runs(name: str, given: dict, bounds: list[int], what: str) -> list:
        """Each probe schedule run for real on model `name` cut at `bounds`."""
        params = ScheduleParams(stages=len(bounds) - 1, microbatches=PROBE_MICROBATCHES,
                                minibatches=PROBE_MINIBATCHES)
        traces = []
        for schedule in PROBE_SCHEDULES:
            advance(f"runtime probe: running {schedule} on {what}")
            spec = RunSpec(build_schedule(schedule, params), name, given, microbatch_size=env.microbatch_size,
                           optimizer=PROBE_OPTIMIZER, dtype=env.dtype, bounds=tuple(bounds),
                           threads_per_rank=settings.threads)
            try:
                traces.append(run_multiprocess(spec, device=env.device).trace)
            except ExecutorError as exc:
                raise RuntimeProbeError(f"the runtime probe failed: {str(exc).splitlines()[0]}") from None
        return traces

    traces = runs("mlp", probe_options, probe.partition.bounds, "two ranks")
    calibrated = {key: value for key, value in options.items() if value is not None}
    stages = profile.partition.stages
    host = runs(model, calibrated, profile.partition.bounds, f"the calibrated model's {stages} ranks") \
        if stages >= 2 else []
    meta = {"model": "mlp", "options": probe_options, "boundary_bytes": probe.stages[0].output_bytes,
            "schedules": list(PROBE_SCHEDULES), "ranks": 2,
            "threads_per_rank": settings.threads, "microbatches": PROBE_MICROBATCHES,
            "minibatches": PROBE_MINIBATCHES, "host_times_from": "the calibrated model" if host else "the probe",
            **traces[0].meta.hardware}
    return runtime_terms(traces, probe, meta, host)


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
                        f"{env.microbatch_size}, {env.threads} thread{'s' * (env.threads != 1)}), partitioned for "
                        f"{profile.partition.optimizer}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="per micro-batch, each stage timed as one pass as the executor runs it; x layers: that "
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
        table.add_row(str(k), f"{first}-{stop - 1}" if stop - first > 1 else str(first), f"{stage.fwd_ms:.3f}",
                      f"{stage.bwd_ms:.3f}", "/".join(f"{r:.2f}" for r in ratios) or "-",
                      f"{stage.igrad_ms:.3f}/{stage.wgrad_ms:.3f}",
                      f"{stage.wgrad_fraction:.0%}", f"{stage.activation_bytes / MIB:,.2f}",
                      f"{stage.param_bytes / MIB:,.2f}", f"{stage.memory_bytes / MIB:,.1f}")
    stdout.print(table)
    if profile.runtime is not None:
        rt = profile.runtime
        compute = ", ".join(f"{kind} {t.median_ms * 1e3:.0f}" for kind, t in rt.compute_ms.items())
        gaps = ", ".join(f"{kind} {t.median_ms * 1e3:.0f}" for kind, t in rt.gap_ms.items())
        stdout.print(f"runtime per row, us: compute {compute}; send {rt.send_ms.median_ms * 1e3:.0f}, receive "
                     f"{rt.recv_ms.median_ms * 1e3:.0f}; gap after {gaps}", highlight=False)
    if profile.contention is not None:
        meta = profile.contention.meta
        at_once = ", ".join(f"{k} ranks computing at once {slowdown:.2f}x their time alone" if k == 2 else
                            f"{k}: {slowdown:.2f}x" for k, slowdown in enumerate(profile.contention.slowdown[1:], 2))
        threads = meta.get("threads_per_process")
        stdout.print(f"contention: {at_once} ({threads} thread{'s' * (threads != 1)} per rank, "
                     f"{meta.get('cpus_usable')} cores); a rank alone: mean {profile.contention.tail:.3f}x its "
                     "median iteration (the passes are priced at their mean)", highlight=False)
        solo_ms, of = meta.get("solo_median_ms", meta.get("solo_ms")), meta.get("workload", {}).get("stages")
        if solo_ms and of and all(stage.passes is not None for stage in profile.stages):
            drift = [ms / (profile.stages[k].fwd_ms + profile.stages[k].bwd_ms) - 1 for ms, k in zip(solo_ms, of)]
            stdout.print("contention probe, each rank alone, against its stage's calibrated F + B: "
                         + ", ".join(f"{d:+.0%}" for d in drift) + " (the same code: the host's drift in between)",
                         highlight=False)
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
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"
