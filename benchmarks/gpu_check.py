"""The one-shot GPU check: on a machine with one CUDA GPU, in one go (under 8 minutes on an H100):

1. calibrate a GPT on the GPU (`pipesim calibrate --device cuda --stages 2`);
2. run it for real with the executor on 2 ranks sharing the GPU (1F1B and ZB-H1), measured traces;
3. compare each run with pipesim's prediction from that profile (`pipesim compare`);
4. predict the same model from the GPU catalogue alone (`pipesim estimate`, the what-if path that needs no GPU),
   and with the part's curve fitted to this calibration (`--curve-from`): each on two GPUs over the catalogue's
   NVLink, as `pipesim simulate` prices it, and as the run ran (`as_run_ms`): both ranks on the one GPU, over the
   calibration's host-staged links, with the executor's own costs per row;

then time the stages' passes in this process queued and from an idle GPU (`pass_issue`: what their host's issue adds
where the run's ranks share the GPU), and print per stage and op the estimated, calibrated and measured milliseconds
side by side, and per schedule the iteration time each way. `--again zb-h1` runs a method a second time: the two
runs' difference is the measurement's noise floor. Everything lands in `--out` (profiles, traces, the comparisons,
`check.json`): commit the small files under traces/measured/ so that tests and CI can replay them. The estimates are
optional: one that fails is kept in check.json's `failed` and its table column, the check prints the rest (what a
GPU session pays for) and exits 1; any other step's failure stops it.

    python benchmarks/gpu_check.py --out traces/measured/gpu-check-h100        # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu-check  # the same steps on a CPU, small
    python benchmarks/gpu_check.py --device cpu --quick --dtype bfloat16 --out /tmp/gpu-check  # ... in bf16

The device tool's machines lack simpy, plotly and pydantic: carry them as wheels (docs/benchmarks.md says how);
this script then runs with `PYTHONPATH` set to them and to a folder holding this checkout as `pipesim`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from one_line_parser import OneLineParser  # this folder's
from rich import box
from rich.table import Table

from pipesim.commands.common import stdout
from pipesim.commands.tables import print_paragraph, print_table
from pipesim.hardware.catalogue import CatalogueError, load_catalogue
from pipesim.planning.replay import predict_measured
from pipesim.profiles.schema import PASSES, Profile, load_profile, stages_for
from pipesim.traces.compare import compare
from pipesim.traces.trace import read_trace, write_atomic

METHODS = ("1f1b", "zb-h1")
SHAPES = {  # a GPT whose layers take about a millisecond on an H100, and a small one for a CPU smoke run
    "full": ["--layers", "8", "--width", "2048", "--heads", "16", "--seq-len", "1024", "--vocab", "32000",
             "-b", "4"],
    "quick": ["--layers", "4", "--width", "128", "--heads", "4", "--seq-len", "64", "--vocab", "512", "-b", "2"],
}
console = stdout  # the terminal's width, its table fitted there (commands/tables.py); piped, whole rows


def pipesim(*args: str, log: Path, failed: dict[str, str] | None = None) -> str | None:
    """Run one pipesim command as a user would; its output is kept in `log`. A failure stops the check, or, for
    an optional step (`failed` given), is kept there under the log's name and None returned, so that the check
    goes on to measure and print the rest."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipesim.cli", *args], capture_output=True, text=True)
    log.write_text(f"$ pipesim {' '.join(args)}\n{done.stdout}{done.stderr}")
    console.print(f"[dim]{time.perf_counter() - started:6.1f} s[/dim]  pipesim {' '.join(args)}", highlight=False)
    if done.returncode == 0:
        return done.stdout
    console.print(done.stdout + done.stderr, markup=False, highlight=False)
    why = f"pipesim {args[0]} failed (exit {done.returncode}); see {log}"
    if failed is None:
        raise SystemExit(why)
    failed[log.stem] = f"{why}: {(done.stderr.strip().splitlines() or [''])[-1]}"
    return None


def catalogue_part(device: str) -> str | None:
    """The catalogue's part for this machine's GPU: the one whose name shares the most words with torch's."""
    if device != "cuda":
        return None
    import torch

    seen = set(torch.cuda.get_device_name().lower().replace("-", " ").split())
    parts = load_catalogue().gpu
    scores = {key: len(seen & set(part.name.lower().replace("-", " ").split())) for key, part in parts.items()}
    return max(scores, key=scores.get)


def measured_ms(trace_path: Path) -> dict[tuple[int, str], float]:
    """Per (stage, kind) the median duration of the measured compute ops."""
    trace = read_trace(trace_path)
    ops = trace.ops
    duration_ms = ops.dur_us / 1e3
    result = {}
    for code, kind in enumerate(trace.kinds):
        for stage in np.unique(ops.stage[ops.kind == code]):
            chosen = (ops.kind == code) & (ops.stage == stage)
            result[(int(stage), kind)] = float(np.median(duration_ms[chosen]))
    return result


def as_run_ms(estimate: Profile, calibrated: Profile, trace_path: Path) -> float:
    """The estimate's compute as the measured run placed it (its ranks on the GPU they shared, the simulator
    serialising their compute as the executor's lock does), over the calibration's links, with its runtime terms
    (the executor's own costs per row): per mini-batch, as `pipesim compare` measures the calibrated prediction.
    It carries the run's device as its own, the same on a GPU: a CPU dry run's estimate (a GPU's) would be refused
    as another device's (`check_comparable`)."""
    measured = read_trace(trace_path)
    on_the_run = estimate.environment.model_copy(update={"device": calibrated.environment.device})
    as_run = estimate.model_copy(update={"runtime": calibrated.runtime, "environment": on_the_run})
    return compare(predict_measured(measured.meta, as_run, links_from=calibrated), measured).predicted_ms


def calibrated_ms(calibrated: Profile) -> list[dict[str, float]]:
    """Per stage, the F, B, I and W (ms) `pipesim compare` predicts the check's runs from: the profile's passes as
    a run whose ranks share a GPU issues them (`StagePasses.issued`: from an idle GPU, where the profile timed them
    so: on CUDA), for both ranks run on the one GPU."""
    return [{name: getattr(stage, f"{name}_ms") for name in PASSES}
            for stage in stages_for(calibrated, calibrated.partition.bounds, shared_gpu=True)]


def pass_issue(calibrated: Profile, device: str, dtype: str) -> dict[str, list[dict[str, float]]]:
    """Each stage's F, B, I and W as calibration times them, queued behind the pass before and from an idle GPU
    (profiles/schema.py `StagePasses`: the run's rows on a GPU its ranks share start idle), twice in one
    process: per way, per stage, the medians (ms) of its two timings. Where the idle times exceed the queued
    ones, the pass's host issue outlasts its kernels (on CPU the two ways are the same timing). Timed with the
    calibration's torch threads, as `calibrate` times them: torch's default, every core, on a busy CPU host made
    each pass wait on its own threads' time slices (a CPU dry run's forward passes 3-18x their calibrated time)."""
    import torch

    from pipesim.calibrate.measure import DTYPES, Settings, measure_passes, place, threads
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    model = build_model(calibrated.model.name, **calibrated.model.options)
    settings = Settings(torch.device(device), DTYPES[dtype], calibrated.environment.microbatch_size, warmup=1,
                        repeats=10, threads=calibrated.environment.threads)
    place(model, settings.device, settings.dtype)
    runs = stage_runs(model, list(calibrated.partition.bounds), dtype, settings.microbatch_size)
    stage_ms = [stage.fwd_ms + stage.bwd_ms for stage in calibrated.stages]
    timed = {way: [] for way in ("queued", "idle")}
    with threads(settings.threads):
        for _ in range(2):
            passes = measure_passes(runs, settings, lambda what: None, stage_ms)
            for way, found in timed.items():
                found.append([stage.issued(shared_gpu=way == "idle") for stage in passes])
    del runs, model
    if settings.cuda:
        torch.cuda.empty_cache()
    return {way: [{name: float(np.median([getattr(rounds[k], name).median_ms for rounds in found]))
                   for name in PASSES} for k in range(len(stage_ms))]
            for way, found in timed.items()}


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for profiles, traces and check.json.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="A small GPT (for a CPU smoke run of the steps).")
    parser.add_argument("--gpu", help="Catalogue part to estimate for (default: matched from the GPU's name).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="Weights and activations (default bfloat16 on cuda, float32 on cpu; a CPU run in "
                             "bfloat16 goes through the GPU's 16-bit paths).")
    parser.add_argument("--again", action="append", choices=METHODS, default=[],
                        help="Run this method once more after the others (repeatable): the noise floor.")
    args = parser.parse_args(argv)
    if args.gpu:  # refused now, not after the runs it would have spent the GPU's time on
        try:
            load_catalogue().find(args.gpu)
        except CatalogueError as exc:  # it names the parts the catalogue knows
            parser.error(f"--gpu: {exc}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA GPU here; --device cpu --quick runs the same steps small")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, or no right to write
        parser.error(f"--out {args.out}: cannot make a folder there ({exc.strerror}); give a folder")
    shape = ["--model", "gpt", *SHAPES["quick" if args.quick else "full"]]
    dtype = ["--dtype", args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    minibatches = ["-m", "8", "-n", "4" if args.quick else "8"]
    part = args.gpu or catalogue_part(args.device)
    check: dict = {"device": args.device, "catalogue_part": part, "shape": shape, "steps": {},
                   "failed": {}}  # an optional step's failure (the estimates): log name -> why
    if args.device == "cuda":
        import torch

        check["gpu"] = torch.cuda.get_device_name()
        check["torch"] = torch.__version__

    def save() -> None:  # after each step: a check stopped by the device's time limit keeps what it measured
        write_atomic(args.out / "check.json", json.dumps(check, indent=1))

    save()
    profile = args.out / "profile.json"
    pipesim("calibrate", *shape, *dtype, "--device", args.device, "--stages", "2", "--out", str(profile),
            log=args.out / "calibrate.log")
    calibrated = load_profile(profile)
    check["calibrated_stages_ms"] = calibrated_ms(calibrated)
    save()
    for step in [*METHODS, *(f"{method}-again" for method in args.again)]:
        method = step.removesuffix("-again")
        trace = args.out / f"run-{step}.json"
        pipesim("run", "-s", method, *shape[:2], "--profile", str(profile), "--device", args.device, *minibatches,
                "--trace", str(trace), log=args.out / f"run-{step}.log")
        compared = json.loads(pipesim("compare", str(trace), "--json", log=args.out / f"compare-{step}.log"))
        (args.out / f"compare-{step}.json").write_text(json.dumps(compared, indent=1))
        check["steps"][step] = {"calibrated_ms": compared["predicted_ms"], "measured_ms": compared["measured_ms"],
                                "error": compared["iteration_time_error"],
                                "ops": {f"{stage}{kind}": ms for (stage, kind), ms in measured_ms(trace).items()}}
        save()
    started = time.perf_counter()  # after the runs, whose GPU this process would otherwise hold memory on
    check["pass_issue_ms"] = pass_issue(calibrated, args.device, dtype[1])
    console.print(f"[dim]{time.perf_counter() - started:6.1f} s[/dim]  stage passes queued and from an idle GPU",
                  highlight=False)
    save()

    estimated = {}  # the catalogue's curve, and the part's curve fitted to this calibration
    sources = {"catalogue": [], "fitted": ["--curve-from", str(profile)]} if part else {}
    for source, curve in sources.items():
        estimate = args.out / f"estimate-{source}.json"
        if pipesim("estimate", "--gpu", part, *shape, *dtype, "--stages", "2", *curve, "--out", str(estimate),
                   log=args.out / f"estimate-{source}.log", failed=check["failed"]) is None:
            save()
            continue
        estimated[source] = load_profile(estimate)
        # both methods in one simulate, as a user compares them: one process's start and imports, not one a method
        methods = [flag for method in METHODS for flag in ("-s", method)]
        simulated = pipesim("simulate", "--profile", str(estimate), *methods, "-p", "2", *minibatches, "--json",
                            log=args.out / f"simulate-{source}.log", failed=check["failed"])
        if simulated is not None:
            for row in json.loads(simulated)["results"]:
                method = row["schedule"]
                check["steps"][method][f"estimated_{source}_ms"] = row["time_per_minibatch_ms"]
                check["steps"][method][f"estimated_{source}_as_run_ms"] = as_run_ms(
                    estimated[source], calibrated, args.out / f"run-{method}.json")
        save()

    table = Table(box=box.SIMPLE_HEAD, title="per stage and micro-batch, ms (measured: median)")
    issued = " (idle GPU)" if args.device == "cuda" else ""  # the timing `calibrated_ms` takes
    for column in ("stage", "op", *(f"estimated ({part}, {source} curve)" for source in sources),
                   f"calibrated{issued}", *(f"measured ({method})" for method in METHODS)):
        table.add_column(column, justify="right")
    for k, passes_ms in enumerate(check["calibrated_stages_ms"]):
        for kind, name in zip("FBIW", PASSES):
            guesses = [f"{getattr(estimated[source].stages[k], f'{name}_ms'):.3f}" if source in estimated
                       else "failed" for source in sources]
            measured = [check["steps"][method]["ops"].get(f"{k}{kind}") for method in METHODS]
            table.add_row(str(k), kind, *guesses, f"{passes_ms[name]:.3f}",
                          *("-" if ms is None else f"{ms:.3f}" for ms in measured))
    print_table(table, console, keys=2)  # a row: its stage and op
    for k, (queued, idle) in enumerate(zip(*check["pass_issue_ms"].values())):
        print_paragraph(f"stage {k} passes queued / from an idle GPU, ms: " + ", ".join(
            f"{name} {queued[name]:.3f} / {idle[name]:.3f}" for name in queued), console)
    if estimated:
        print_paragraph(f"estimated: on two {part}s over the catalogue's NVLink, as `pipesim simulate` prices the "
                        "estimate; as run: the estimate's compute where the run's ranks computed (one GPU for "
                        "both), over the calibration's links, with its runtime terms", console)
    for step, found in check["steps"].items():
        guess = "".join(f"estimated ({source} curve) {found[f'estimated_{source}_ms']:.2f} ms, as run "
                        f"{found[f'estimated_{source}_as_run_ms']:.2f} ms, " for source in estimated
                        if f"estimated_{source}_ms" in found)
        print_paragraph(f"{step} per mini-batch: {guess}calibrated {found['calibrated_ms']:.2f} ms, measured "
                        f"{found['measured_ms']:.2f} ms (calibrated's error {found['error']:+.1%})", console)
        if step.endswith("-again"):
            first = check["steps"][step.removesuffix("-again")]["measured_ms"]
            console.print(f"  noise floor: the two {step.removesuffix('-again')} runs measured "
                          f"{found['measured_ms'] / first - 1:+.1%} apart", highlight=False)
    for step, why in check["failed"].items():
        console.print(f"failed: {step}: {why}", markup=False, highlight=False)
    if check["failed"]:
        raise SystemExit(1)

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
