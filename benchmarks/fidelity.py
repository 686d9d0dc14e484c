"""Fidelity: how close pipesim's prediction comes to what its executor, and torch's runtime, measure.

`--repeats` times: calibrate (`pipesim calibrate --threads 1`, the runtime probe on) -> run every method for
real once, in fresh processes -> predict each run from its repeat's profile alone
(`planning.replay.predict_measured`: the profile is measured just before, never fitted to the run) -> compare
(`traces.compare`). Calibrating per repeat keeps the shared machine's drift between a calibration and the runs
it predicts to one repeat's few minutes, and interleaving the methods spreads a slow spell over all of them.
One table: per method the prediction (median over repeats), the measured iteration time (median over repeats,
and its spread: (max - min) / median, the noise floor of that run repeated), the iteration-time error (median
over repeats of each run's against its own prediction), the per-op duration error (median |error| over
compute ops, median over repeats) and the peak-memory error (largest over devices, median over repeats).
Then the terms table: the same predictions with the profile's terms turned on one after another, from a
profile timed with every core and nothing of the runtime (what pipesim predicted before) to all of them, so each
term's line shows the error it removed. Then the same runs with every op at its own measured mean (what the
schedule's structure alone predicts, and the per-op error a run's own scatter leaves), and its ops by context
(right after a wait, with the other ranks computing). Last, GPipe and 1F1B run by torch.distributed.pipelining
on the same model and cut (`bench_executor.torch_run`), against pipesim's prediction without its own runtime's
terms (but with the host's contention: torch's ranks share the cores as pipesim's do) and with torch's runtime
cost per forward and backward action, measured by running torch's same schedule on a probe: the same pipeline
on a model of one block of the same width, whose passes its own calibration times.

Targets (issue 12): iteration time within 2 %, median per-op duration within 5 %, peak memory within 5 %.

    python benchmarks/fidelity.py            # mlp 8x512, b=32, p=2, m=4, 3 repeats of 2+6 mini-batches
    python benchmarks/fidelity.py --quick    # smaller, 3 methods, 2 repeats: a smoke run
    python benchmarks/fidelity.py --keep runs/ --json out.json   # keep profiles and traces; tables as JSON
    python benchmarks/fidelity.py --from runs/                   # the tables again from kept runs, running nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from bench_executor import Config, torch_run  # this folder's: torch's runtime on pipesim's stages
from one_line_parser import OneLineParser, positive_int  # this folder's
from rich import box
from rich.console import Console
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_paragraph, print_table
from pipesim.executor import RunSpec, carried_bounds, even_bounds, run_multiprocess
from pipesim.planning.replay import predict_measured
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.linkfit import piecewise_ms
from pipesim.profiles.schema import Profile, RuntimeProfile, Timing, layer_costs, load_profile
from pipesim.schedules import KINDS, NUM_COMPUTE_KINDS, Kind, ScheduleParams
from pipesim.schedules.catalogue import METHODS, method_named
from pipesim.sim import simulate
from pipesim.sim.costs import RowOverhead
from pipesim.traces import summarize
from pipesim.traces.compare import Comparison, compare
from pipesim.traces.metrics import merged_intervals
from pipesim.traces.trace import Stream, Trace, read_trace, write_trace
from pipesim.units import count_text, degree_text

TARGETS = {"iteration": 0.02, "per_op": 0.05, "memory": 0.05}
WAIT_MS = 0.5  # a rank idle this long before an op: on the 2-core VMs here it has lost part of its caches
TORCH_METHODS = ("gpipe", "1f1b")
ZERO = Timing(median_ms=0.0, spread_ms=0.0, repeats=1)


@dataclass(frozen=True)
class Workload:
    """A model, its size, and the pipeline it runs in: p devices, m micro-batches of b samples."""

    model: str
    options: dict[str, int]
    microbatch_size: int
    stages: int
    microbatches: int
    warmup: int
    steps: int


@dataclass
class Case:
    """One method on one workload, and what its repeats measured and compared."""

    method: str
    workload: Workload
    runs: list[Trace] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ profiles


def calibrate(workload: Workload, out: Path, *, threads: int, runtime: bool, links: bool, quick: bool) -> Profile:
    """`pipesim calibrate` as a user runs it (its own process, so its threads are its own)."""
    options = [f"--{key.replace('_', '-')}={value}" for key, value in workload.options.items()]
    command = [sys.executable, "-m", "pipesim.cli", "calibrate", "--fresh", "--model", workload.model, *options,
               "--microbatch-size", str(workload.microbatch_size), "--stages", str(workload.stages), "--device", "cpu",
               "--threads", str(threads),
               *(["--runtime", "--contention"] if runtime else ["--no-runtime", "--no-contention"]),
               *(["--link-max-mb", "0.25" if quick else "1"] if links else ["--no-links"]),
               *(["--repeats", "5", "--warmup", "1"] if quick else []), "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return load_profile(out)


def _runtime(profile: Profile, compute: bool, messages: bool, delivery: bool, gaps: bool, kept: bool,
             posted: bool) -> RuntimeProfile:
    """The profile's runtime terms with those not named zeroed, every row at the steady pace (no warm-up);
    delivery off keeps the link fit's own time."""
    runtime = profile.runtime
    fit = tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in profile.link.segments)
    pinged = Timing(median_ms=piecewise_ms(fit, runtime.delivery_bytes), spread_ms=0.0, repeats=1)
    return runtime.model_copy(update={
        "compute_ms": runtime.compute_ms if compute else {kind: ZERO for kind in runtime.compute_ms},
        "send_ms": runtime.send_ms if messages else ZERO, "recv_ms": runtime.recv_ms if messages else ZERO,
        "delivery_ms": runtime.delivery_ms if delivery else pinged,
        "gap_ms": runtime.gap_ms if gaps else {kind: ZERO for kind in runtime.gap_ms},
        "kept_gradients": runtime.kept_gradients if kept else 0.0, "recv_window": runtime.recv_window if posted else 0,
        "warmup_ms": []})


def term_variants(profile: Profile, all_cores: Profile) -> list[tuple[str, Profile]]:
    """The profile with its terms turned on one after another, each line adding one cause to the one before:
    the first is what pipesim predicted before these terms (every core, the layers and steps alone)."""
    def unsaved(p: Profile) -> list:
        """`p`'s layers as a profile from before calibration recorded what autograd saves of them."""
        return [layer.model_copy(update={"output_saved": None}) for layer in p.layers]

    def layers_only(p: Profile, accumulate: bool = False) -> Profile:
        return p.model_copy(update={"runtime": None, "contention": None, "layers": unsaved(p), "stages": [
            s.model_copy(update={"passes": None, "weight_copy": None, "accumulate": s.accumulate if accumulate
                                 else None}) for s in p.stages]})

    terms = ("compute", "messages", "delivery", "gaps", "kept", "posted")

    def first(count: int, copies: bool = True, boundary: bool = False) -> Profile:
        stages = profile.stages if copies else [s.model_copy(update={"weight_copy": None}) for s in profile.stages]
        return profile.model_copy(update={
            "contention": None, "stages": stages, "layers": profile.layers if boundary else unsaved(profile),
            "runtime": _runtime(profile, **{t: i < count for i, t in enumerate(terms)})})

    untailed = profile.contention.model_copy(update={"tail": 1.0}) if profile.contention is not None else None
    steady = profile.model_copy(update={"runtime": _runtime(profile, *(True,) * len(terms))})

    return [
        ("all cores, layers only (before)", layers_only(all_cores.model_copy(update={"link": profile.link}))),
        ("+ calibrated on one thread, as a rank runs", layers_only(profile)),
        ("+ gradient accumulation per backward", layers_only(profile, accumulate=True)),
        ("+ stages timed as one pass, as the executor computes them", first(0, copies=False)),
        ("+ a copy-on-write update copies the weights first", first(0)),
        ("+ runtime's fixed cost per compute row", first(1)),
        ("+ host time of each send and receive", first(2)),
        ("+ delivery as a pre-posted receive sees it", first(3)),
        ("+ bookkeeping gap after each row", first(4)),
        ("+ gradient kept through the update (memory)", first(5)),
        ("+ receive buffers held from their posting (memory)", first(len(terms))),
        ("+ boundary tensors the stage's own from F to backward (memory)", first(len(terms), boundary=True)),
        ("+ ranks computing at once slow each other", steady.model_copy(update={"contention": untailed})),
        ("+ a rank's passes priced at their mean (their tail)", steady),
        ("+ a fresh rank's first rows at their own pace (warm-up)", profile),
    ]


# ------------------------------------------------------------------------------------------------- running


def params(method: str, workload: Workload, minibatches: int) -> ScheduleParams:
    """The method's parameters on the workload: chunked methods get two chunks (so p*2 model stages)."""
    spec = method_named(method)
    chunks = 2 if spec.reads("chunks") and method != "graphpipe" else None
    return spec.params(workload.stages, workload.microbatches, minibatches, chunks)


def run_once(case: Case, profile: Profile) -> Trace:
    """One real run in fresh processes; the cut is the profile's partition where the stage counts agree and
    the schedule's stage graph can carry it (calibration cuts a branching model as a chain, which GraphPipe's
    diamond may not carry: then the carried cut with the fastest slowest stage), the prediction replaying the
    cut the run used."""
    w, method = case.workload, method_named(case.method)
    built = params(case.method, w, w.warmup + w.steps)
    fits = built.stages * (built.chunks or 1) == profile.partition.stages
    # auto's order is searched for the costs of the stages the run cuts, as `pipesim run --profile` does
    schedule = (profile_scenario(profile, "sgd").build(case.method, built, profile.partition.bounds if fits else None)
                if method.needs_costs else method.build(built))
    bounds = tuple(profile.partition.bounds) if schedule.num_stages == profile.partition.stages else None
    spec = RunSpec(schedule, w.model, w.options, microbatch_size=w.microbatch_size, optimizer="sgd", lr=0.01,
                   bounds=bounds, threads_per_rank=profile.environment.threads, timeout_s=300.0)
    if bounds is not None:
        spec = replace(spec, bounds=carried_bounds(spec, [c.ms for c in layer_costs(profile.layers, "sgd")]))
    return run_multiprocess(spec).trace


def comparisons(case: Case, profiles: list[Profile]) -> list[Comparison]:
    """Every repeat of the case against its prediction from its repeat's profile."""
    return [compare(predict_measured(run.meta, profile), run) for run, profile in zip(case.runs, profiles)]


def profile_path(folder: Path, model: str, repeat: int) -> Path:
    """Repeat `repeat`'s calibration of `model`: each repeat calibrates just before its runs, so the machine's
    drift between a calibration and the runs it predicts stays that of one repeat (a folder from before this
    kept one calibration, for every repeat)."""
    own = folder / "profiles" / f"{model}.{repeat}.json"
    return own if own.exists() else folder / f"{model}.json"


def steady_state(run: Trace) -> np.ndarray:
    """Per op, whether it is past the first mini-batch (warm-up: first allocations, lazy set-up), if there is more
    than one."""
    return run.ops.minibatch >= min(1, int(run.ops.minibatch.max()))


def with_measured_ops(run: Trace, profile: Profile) -> Trace:
    """The run re-simulated with every compute op of a (stage, kind) at that kind's mean measured duration on
    the stage (steady state: after the first mini-batch), contention and the per-row compute cost off (the
    durations hold them), the links and gaps between rows the profile's: what the schedule's structure alone
    predicts once the op times are right. Its error against the run is the part no op-time term can remove."""
    ops, steady = run.ops, steady_state(run)
    kinds = np.array(run.kinds)[ops.kind]

    def mean_ms(kind: str, stage: int, otherwise: float | None) -> float | None:
        mine = steady & (kinds == kind) & (ops.stage == stage)
        return float(ops.dur_us[mine].mean()) / 1e3 if mine.any() else otherwise

    scenario = profile_scenario(profile, str(run.meta.extra.get("optimizer", "sgd")))
    bounds = run.meta.extra.get("bounds")
    schedule = scenario.build(run.meta.schedule, ScheduleParams.recorded(run.meta.params), bounds)
    costs = scenario.costs(schedule, bounds)
    stages = tuple(replace(s, fwd_ms=mean_ms("F", k, 0.0), bwd_ms=mean_ms("B", k, s.bwd_ms),
                           igrad_ms=mean_ms("I", k, s.igrad_ms), wgrad_ms=mean_ms("W", k, s.wgrad_ms),
                           opt_ms=mean_ms("OPT", k, 0.0), pred_ms=mean_ms("PRED", k, 0.0),
                           avg_ms=mean_ms("AVG", k, 0.0), accumulate_ms=0.0) for k, s in enumerate(costs.stages))
    overhead = replace(costs.overhead, compute_ms=(0.0,) * len(costs.overhead.compute_ms))
    links = replace(scenario.links(schedule), hosts=(), contention=())
    return simulate(schedule, replace(costs, stages=stages, overhead=overhead), links)


def op_contexts(runs: list[Trace]) -> dict[str, tuple[float, int]]:
    """Steady-state F, B, I and W ops by what surrounded them, each as its duration over the median of its
    run's ops of the same device, stage and kind: right after its rank idled WAIT_MS or more, or not; and while
    no other rank computed (during under a fifth of the op) or some other did (over four fifths). Per context,
    the mean ratio and the ops counted: what a wait's cold caches and contention cost in the runs themselves."""
    ratios: dict[str, list[float]] = {"after a wait": [], "back to back": [], "others idle": [],
                                      "others computing": []}
    for run in runs:
        ops = run.ops
        names = np.asarray(run.kinds)[ops.kind]
        compute = ops.stream == Stream.COMPUTE
        end_us = ops.start_us + ops.dur_us
        passes = compute & np.isin(names, ["F", "B", "I", "W"]) & steady_state(run)
        for d in range(run.num_devices):
            mine = np.flatnonzero(compute & (ops.device == d))
            mine = mine[np.argsort(ops.start_us[mine], kind="stable")]
            idle_ms = np.r_[np.inf, (ops.start_us[mine[1:]] - end_us[mine[:-1]]) / 1e3]
            others = compute & (ops.device != d)
            busy_from, busy_to = merged_intervals(ops.start_us[others], end_us[others])
            timed = mine[passes[mine]]
            key = ops.stage[timed] * len(run.kinds) + ops.kind[timed]  # (stage, kind) as one number
            median = {k: float(np.median(ops.dur_us[timed][key == k])) for k in np.unique(key)}
            for i, idle, k in zip(timed, idle_ms[passes[mine]], key):
                ratio = float(ops.dur_us[i]) / median[k]
                ratios["after a wait" if idle >= WAIT_MS else "back to back"].append(ratio)
                overlap = np.clip(np.minimum(end_us[i], busy_to) - np.maximum(ops.start_us[i], busy_from), 0, None)
                shared = overlap.sum() / max(float(ops.dur_us[i]), 1.0)
                if shared < 0.2 or shared > 0.8:
                    ratios["others idle" if shared < 0.2 else "others computing"].append(ratio)
    return {context: (float(np.mean(found)) if found else float("nan"), len(found))
            for context, found in ratios.items()}


def torch_predicted_ms(method: str, workload: Workload, profile: Profile, action_ms: float = 0.0) -> float:
    """pipesim's iteration time for torch's runtime: the profile's layers cut evenly (as bench_executor cuts),
    without the terms that price pipesim's own executor, each forward and backward action costing `action_ms`
    of torch's runtime beyond its pass."""
    scenario = profile_scenario(profile, "sgd")
    schedule = scenario.build(method, params(method, workload, workload.warmup + workload.steps))
    costs = scenario.costs(schedule, even_bounds(len(profile.layers), schedule.num_stages))
    compute_ms = tuple(action_ms if kind in (Kind.F, Kind.B) else 0.0 for kind in KINDS[:NUM_COMPUTE_KINDS])
    trace = simulate(schedule, replace(costs, overhead=RowOverhead(compute_ms=compute_ms)), scenario.links(schedule))
    return summarize(trace).time_per_minibatch_ms


def torch_probe(workload: Workload) -> Workload:
    """The same pipeline on a model of one block of the same width (the block and the classifier, a stage
    each for p = 2): torch's runtime costs per action dominate its time."""
    return replace(workload, options={**workload.options, "layers": workload.stages - 1})


def torch_action_ms(method: str, workload: Workload, probe: Profile, probe_ms: float) -> float:
    """torch's runtime cost per forward and backward action, measured on the probe: what each must cost beyond
    its pass for pipesim's timeline of the probe to take the probe's measured iteration time (the timeline
    grows with it, so bisection finds it; 0 where the passes alone already take longer)."""
    def predicted(ms: float) -> float:
        return torch_predicted_ms(method, torch_probe(workload), probe, ms)

    low, high = 0.0, probe_ms
    if predicted(low) >= probe_ms:
        return 0.0
    while high - low > 1e-4:
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) < probe_ms else (low, middle)
    return (low + high) / 2


# ------------------------------------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class Row:
    """One method's fidelity over its repeats."""

    method: str
    predicted_ms: float
    measured_ms: float  # median of the repeats' iteration times
    spread: float  # (max - min) / median of them: the noise floor of this run
    iteration_error: float  # median over repeats of each run against its own prediction
    per_op_error: float | None  # median over repeats of the median |duration error| of compute ops
    memory_error: float | None  # median over repeats of the largest |peak error| over devices
    per_op_noise: float | None = None  # the same, between repeats of the run: the per-op noise floor


def row(method: str, found: list[Comparison], runs: list[Trace] = ()) -> Row:
    """One method's row; given its `runs`, with the per-op noise floor: op by op, how far repeats of the same
    run are apart (median over pairs of repeats of the median |duration difference|)."""
    measured = np.array([c.measured_ms for c in found])
    median = float(np.median(measured))
    per_op = [c.compute_duration_median for c in found if c.compute_duration_median is not None]
    memory = [max(abs(d.peak_memory_error) for d in c.devices) for c in found
              if all(d.peak_memory_error is not None for d in c.devices)]
    pairs = [compare(a, b).compute_duration_median for i, a in enumerate(runs) for b in runs[i + 1:]]
    pairs = [p for p in pairs if p is not None]
    errors = [c.iteration_time_error for c in found]  # each run against its own repeat's calibration
    return Row(method, float(np.median([c.predicted_ms for c in found])), median,
               float((measured.max() - measured.min()) / median), float(np.median(errors)),
               float(np.median(per_op)) if per_op else None,
               float(np.median(memory)) if memory else None, float(np.median(pairs)) if pairs else None)


def _pct(value: float | None, target: float | None = None, signed: bool = True) -> str:
    if value is None:
        return "-"
    text = f"{value:+.1%}" if signed else f"{value:.1%}"
    if target is None:
        return text
    return f"[green]{text}[/]" if abs(value) <= target else f"[red]{text}[/]"


def method_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD,
                  caption="spread: (max - min) / median of the repeats' measured iteration times (noise floor); "
                          "error: median over repeats of (predicted - measured) / measured, each run against its own "
                          "repeat's calibration; per-op: median |duration "
                          "error| of compute ops (per-op noise: the same between repeats); memory: largest |peak "
                          "error| over devices. Green: within target "
                          f"({TARGETS['iteration']:.0%}, {TARGETS['per_op']:.0%}, {TARGETS['memory']:.0%}).",
                  caption_justify="left")
    for header in ("method", "predicted ms", "measured ms", "spread", "iteration error", "per-op error",
                   "per-op noise", "peak-memory error"):
        table.add_column(header, justify="left" if header == "method" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r.method, f"{r.predicted_ms:,.2f}", f"{r.measured_ms:,.2f}", _pct(r.spread, signed=False),
                      _pct(r.iteration_error, TARGETS["iteration"]), _pct(r.per_op_error, TARGETS["per_op"], False),
                      _pct(r.per_op_noise, signed=False), _pct(r.memory_error, TARGETS["memory"], False))
    return table


def terms_table(lines: list[tuple[str, list[Row]]], focus: str) -> Table:
    table = Table(title="causes of error, as terms of the profile turned on one after another",
                  title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left",
                  caption="median over methods of |iteration error|, per-op and peak-memory error; and "
                          f"{focus}'s signed iteration error")
    for header in ("prediction from", "|iteration error|", f"{focus} error", "per-op error", "peak-memory error"):
        table.add_column(header, justify="left" if header == "prediction from" else "right", no_wrap=True)
    for label, rows in lines:
        mine = next((r for r in rows if r.method == focus), rows[0])
        per_op = [r.per_op_error for r in rows if r.per_op_error is not None]
        memory = [r.memory_error for r in rows if r.memory_error is not None]
        table.add_row(label, _pct(float(np.median([abs(r.iteration_error) for r in rows])), signed=False),
                      _pct(mine.iteration_error), _pct(float(np.median(per_op)) if per_op else None, signed=False),
                      _pct(float(np.median(memory)) if memory else None, signed=False))
    return table


# ------------------------------------------------------------------------------------------------------ main


def workloads(quick: bool) -> tuple[Workload, Workload]:
    """The chain every method runs on, and GraphPipe's two-branch DAG (it needs p >= 4)."""
    steps = (1, 3) if quick else (2, 6)
    chain = Workload("mlp", {"layers": 4 if quick else 8, "width": 256 if quick else 512}, 32, 2, 4, *steps)
    dag = Workload("two-branch", {"layers": 2, "width": 32}, 32, 4, 4, *steps)
    return chain, dag


def measure(args: argparse.Namespace, methods: list[str], folder: Path, say: Callable[[str], None]) -> None:
    """Per repeat: calibrate, then run every method once and torch's runtimes, keeping it all in `folder`: the
    profiles, each measured trace, torch's iteration times."""
    chain, dag = workloads(args.quick)
    say(f"calibrating {chain.model} {chain.options} on every core, layers only (the table's first line)")
    calibrate(chain, folder / "cores.json", threads=os.cpu_count() or 1, runtime=False, links=False, quick=args.quick)
    (folder / "profiles").mkdir(exist_ok=True)
    torch_ms: dict[str, list[float]] = {m: [] for m in TORCH_METHODS if not args.quick}
    probe_ms: dict[str, list[float]] = {m: [] for m in torch_ms}
    for repeat in range(args.repeats):
        say(f"repeat {repeat + 1}/{args.repeats}: calibrating {chain.model} {chain.options} (one thread, runtime "
            "probe)" + (f" and {dag.model} {dag.options} for graphpipe" if "graphpipe" in methods else ""))
        profiles = {w.model: calibrate(w, folder / "profiles" / f"{w.model}.{repeat}.json", threads=1, runtime=True,
                                       links=True, quick=args.quick)
                    for w in (chain, *([dag] if "graphpipe" in methods else []))}
        say(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(methods)
            + (", torch " + ", ".join(torch_ms) if torch_ms else ""))
        for method in methods:
            case = Case(method, dag if method == "graphpipe" else chain)
            write_trace(run_once(case, profiles[case.workload.model]), folder / f"{method}.{repeat}.json")
        if torch_ms:  # torch's runtime on the model, then on its one-block probe (calibrated for its passes)
            probe = torch_probe(chain)
            calibrate(probe, folder / "profiles" / f"torch-probe.{repeat}.json", threads=1, runtime=False,
                      links=False, quick=args.quick)
        for method in torch_ms:
            for workload, found in ((chain, torch_ms), (torch_probe(chain), probe_ms)):
                config = Config(method, workload.stages, workload.microbatches, workload.microbatch_size,
                                workload.options["layers"], workload.options["width"], workload.warmup, workload.steps)
                found[method].append(float(np.median(torch_run(config))))
        (folder / "torch.json").write_text(json.dumps(torch_ms))
        (folder / "torch-probe.json").write_text(json.dumps(probe_ms))


def workload_text(chain: Workload, dag: Workload, repeats: int, device_name: str) -> str:
    """The table's second title line and the JSON's "workload": the workloads, their shape as every label writes it
    ("b=32, p=2, m=4"), and the host."""
    shape = ", ".join(degree_text(*degree) for degree in [("b", chain.microbatch_size), ("p", chain.stages),
                                                          ("m", chain.microbatches)])
    return (f"{chain.model} {chain.options}, {shape}, {count_text(chain.steps, 'timed mini-batch')} after "
            f"{chain.warmup:,}; gloo CPU, 1 thread/rank; {count_text(repeats, 'repeat')} (graphpipe: {dag.model} "
            f"{dag.options}, {degree_text('p', dag.stages)}); {device_name}")


def report(quick: bool, folder: Path, console: Console, out: Path | None) -> None:
    """The tables, from what `measure` kept in `folder`."""
    chain, dag = workloads(quick)
    all_cores = load_profile(folder / "cores.json")
    cases = {}
    for path in sorted(folder.glob("*.*.json"), key=lambda p: int(p.name.split(".")[-2])):
        method = path.name.split(".")[0]
        case = cases.setdefault(method, Case(method, dag if method == "graphpipe" else chain))
        case.runs.append(read_trace(path))
    cases = [cases[m] for m in METHODS if m in cases]
    repeats = min(len(c.runs) for c in cases)
    profiles = {w.model: [load_profile(profile_path(folder, w.model, r)) for r in range(repeats)] for w in (chain, dag)
                if profile_path(folder, w.model, 0).exists()}
    rows = [row(c.method, comparisons(c, profiles[c.workload.model]), c.runs) for c in cases]
    workload = workload_text(chain, dag, repeats, all_cores.environment.device_name)
    print_table(method_table(rows, f"fidelity: predicted (profile only) vs measured (pipesim's executor)\n{workload}"),
                console)
    noise = float(np.median([r.spread for r in rows]))
    op_noise = [r.per_op_noise for r in rows if r.per_op_noise is not None]
    op_noise = float(np.median(op_noise)) if op_noise else None
    print_paragraph(f"noise floor: the same run repeated varies by {noise:.1%} (median over methods of (max - min) / "
                    f"median of its repeats), and op by op by {_pct(op_noise, signed=False)} (median per-op noise); "
                    "errors below them are not resolved", console)

    chain_cases = [c for c in cases if c.workload == chain]
    variants = [term_variants(profile, all_cores) for profile in profiles[chain.model]]  # per repeat
    lines = [(label, [row(c.method, comparisons(c, [terms[i][1] for terms in variants])) for c in chain_cases])
             for i, (label, _) in enumerate(variants[0])]
    focus = "1f1b" if "1f1b" in {c.method for c in chain_cases} else chain_cases[0].method
    print_table(terms_table(lines, focus), console)
    at_means = {c.method: [compare(with_measured_ops(run, profile), run) for run, profile in
                           zip(c.runs, profiles[chain.model])] for c in chain_cases}
    structure = {method: float(np.median([c.iteration_time_error for c in found]))
                 for method, found in at_means.items()}
    # With every op at its own (stage, kind) mean, the per-op error left is how far one run's ops scatter about
    # their means: what pricing each stage and kind at its mean leaves, however well it was calibrated.
    op_floor = float(np.median([np.median(errors) for found in at_means.values()
                                if (errors := [c.compute_duration_median for c in found
                                               if c.compute_duration_median is not None])]))
    print_paragraph(f"with every compute op at its measured mean (the schedule, links and row gaps alone): median "
                    f"|iteration error| {float(np.median(np.abs(list(structure.values())))):.1%}, {focus} "
                    f"{structure[focus]:+.1%}; the rest of each method's error is in the op times. Per op "
                    f"{op_floor:.1%}: how far a run's ops scatter about their own (stage, kind) mean, which pricing "
                    "each stage and kind at its mean leaves", console)
    contexts = op_contexts([run for c in chain_cases for run in c.runs])
    print_paragraph("in the runs, F, B, I and W against their own (stage, kind) median: " + "; ".join(
        f"{context} {ratio:.3f}x ({count} ops)" for context, (ratio, count) in contexts.items()) +
        f" (a wait: the rank idle {WAIT_MS:g} ms or more before the op; others idle or computing: another rank "
        "computing during under a fifth or over four fifths of it). Cold caches after a wait and contention are both "
        "in these ratios, and an op with the others idle more often follows a wait", console)

    torch_rows = []
    # torch's ranks are processes on the same cores: the host's terms apply, pipesim's runtime's do not; its
    # stages run their layers back to back as pipesim's passes do (without functional_call and the hooks).
    torch_terms = [terms[3][1].model_copy(update={"contention": profile.contention})
                   for terms, profile in zip(variants, profiles[chain.model])]
    measured_torch = json.loads((folder / "torch.json").read_text()) if (folder / "torch.json").exists() else {}
    measured_probe = (json.loads((folder / "torch-probe.json").read_text())
                      if (folder / "torch-probe.json").exists() else {})
    action_ms: dict[str, float] = {}
    for method, samples in measured_torch.items():
        actions = []
        for repeat, profile in enumerate(profiles[chain.model]):
            probe_path = folder / "profiles" / f"torch-probe.{repeat}.json"
            probed = measured_probe.get(method, [])
            if repeat < len(probed) and probe_path.exists():  # the probe shares the repeat's link and host terms
                probe = load_profile(probe_path).model_copy(update={"link": profile.link,
                                                                    "contention": profile.contention})
                actions.append(torch_action_ms(method, chain, probe, probed[repeat]))
            else:  # a folder from before the probe
                actions.append(0.0)
        action_ms[method] = float(np.median(actions))
        measured = float(np.median(samples))
        predicted = float(np.median([torch_predicted_ms(method, chain, terms, action)
                                     for terms, action in zip(torch_terms, actions)]))
        torch_rows.append(Row(f"{method} (torch)", predicted, measured,
                              float((max(samples) - min(samples)) / measured), (predicted - measured) / measured,
                              None, None))
    if torch_rows:
        print_table(method_table(torch_rows, "torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B), same "
                                             "model and even cut: predicted from the profile's stage passes, "
                                             "threads and contention, and torch's cost per forward and backward "
                                             "action measured on a one-block probe (pipesim's runtime terms "
                                             "left out)"), console)
        print_paragraph("torch's cost per action (median over repeats): " + ", ".join(
            f"{method} {ms:.3f} ms" for method, ms in action_ms.items()), console)
    write_json(out, {
        "workload": workload, "noise_floor": noise, "per_op_noise_floor": op_noise,
        "methods": [vars(r) for r in rows], "structure_only": structure, "per_op_floor": op_floor,
        "op_contexts": {context: {"mean_ratio": r, "ops": n} for context, (r, n) in contexts.items()},
        "terms": [{"prediction_from": label, "methods": [vars(r) for r in found]} for label, found in lines],
        "torch": [vars(r) for r in torch_rows], "torch_action_ms": action_ms})


def parse_arguments(description: str, *, runs: str, methods: str, quick: str,
                    more: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
                    argv: list[str] | None = None) -> argparse.Namespace:
    """The options every fidelity benchmark takes (`runs`, `methods`, `quick`: what its own mean), and those
    `more` adds; --quick caps the repeats at 2."""
    parser = OneLineParser(description=description)
    more(parser)
    parser.add_argument("--repeats", type=positive_int, default=3, help=f"fresh runs {runs}")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), help=methods)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--keep", type=Path, help="keep the profiles and measured traces in this folder")
    parser.add_argument("--from", dest="source", type=Path, help="report on a folder --keep filled; run nothing")
    parser.add_argument("--json", type=Path, help="also write the tables as JSON here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    if args.source is not None and not args.source.is_dir():
        parser.error(f"--from {args.source}: give the folder a run's --keep filled, not a file or a missing path")
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def measure_then_report(args: argparse.Namespace, measuring: Callable[[Path], None],
                        reporting: Callable[[Path], None]) -> None:
    """Report on the folder --from names; or measure into --keep's folder (or a scratch one), then report."""
    if args.source is not None:
        reporting(args.source)
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        measuring(folder)
        reporting(folder)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(__doc__.split("\n\n")[0], runs="per method", argv=argv,
                           methods="default: every method (--quick: three)",
                           quick="mlp 4x256, 1+3 mini-batches, 2 repeats, no torch")
    methods = args.methods or (["gpipe", "1f1b", "zb-h1"] if args.quick else list(METHODS))
    console = stdout  # the terminal's width, its tables fitted there (commands/tables.py); piped, whole rows
    measure_then_report(args, lambda folder: measure(args, methods, folder, lambda text: console.print(
        text, style="dim", highlight=False)), lambda folder: report(args.quick, folder, console, args.json))


if __name__ == "__main__":
    main()
