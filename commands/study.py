"""`pipesim study`: train the same model on the same data, initialisation and sample budget under each method,
with each optimizer, over several seeds; report accuracy, loss, throughput and staleness; draw the page.
Torch is imported only once the command trains."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..choices import choose_from
from ..traces.metrics import STALENESS_HEADER
from ..units import count_text, degree_text
from .common import (
    STARTING_STATUS,
    InputError,
    Microbatches,
    Minibatches,
    Pipelines,
    PredictionSource,
    Stages,
    check_method_options,
    check_outputs,
    check_prediction,
    counted_bar_columns,
    fail,
    host_memory_refusal,
    is_given,
    output_path,
    read_error,
    refuse,
    refuse_out_of_host_memory,
    require_model,
    stderr,
    stdout,
    transient_status,
    writing,
    wrote_text,
)
from .tables import piped_lines, print_message, print_table


def _optimizers(specs: list[str]) -> dict[str, float]:
    """`NAME` or `NAME=LR` per --optimizer, in order; a name without a rate takes the study's default."""
    from ..study.plan import DEFAULT_LR

    out: dict[str, float] = {}
    for spec in specs:
        name, given, rate = spec.partition("=")
        if name not in DEFAULT_LR:
            raise InputError(f"{choose_from('--optimizer', DEFAULT_LR, spec)}; each optionally as NAME=LR")
        try:
            lr = float(rate) if given else DEFAULT_LR[name]  # `adam=` names no rate: refused, not the default
        except ValueError:
            lr = math.nan
        if not 0 < lr < math.inf:
            raise InputError(f"--optimizer: give NAME=LR with a finite learning rate above 0 (got {spec!r})")
        if name in out:
            raise InputError(f"--optimizer: give each optimizer once (got {name!r} twice)")
        out[name] = lr
    return out


# The models a study trains: classifiers of scikit-learn's digits, scored by held-out accuracy (--help said so,
# yet `--model gpt` started a study of minutes instead of saying it).
STUDY_MODELS = ("mlp", "cnn")

# Seeds a study trains at most: each trains every arm again (the committed study took 3), and --seeds 10**12 was a
# MemoryError's traceback as its list was made.
MAX_SEEDS = 1000

# The default study as measured (docs/study.md), which `--plot-only` shows without training: in the repository this
# package is (an editable install's), absent from a wheel's.
COMMITTED_STUDY = Path(__file__).resolve().parents[1] / "traces" / "study" / "digits-mlp-p4.json"


def _committed_study_text() -> str:
    """How to show the committed study from the current folder: its path as given here, relative where it lies under
    this folder (the repository's root: "traces/study/digits-mlp-p4.json"), else whole, as a relative path named from
    another folder is not there; nothing where this install holds none."""
    if not COMMITTED_STUDY.is_file():
        return ""
    here = Path.cwd().resolve()
    shown = COMMITTED_STUDY.relative_to(here) if COMMITTED_STUDY.is_relative_to(here) else COMMITTED_STUDY
    return f", or show the committed study: --results {shlex.quote(str(shown))}"


def study(
    ctx: typer.Context,
    schedules: Annotated[list[str] | None, typer.Option(
        "--schedule", "-s", metavar="NAME", help="Method to train (repeatable). Default: gpipe, 1f1b, pipedream, "
                                                 "pipedream-2bw, spectrain, pipeoptim, xpipe, avgpipe.")] = None,
    optimizers: Annotated[list[str] | None, typer.Option(
        "--optimizer", metavar="NAME[=LR]", help="Optimizer, optionally with its learning rate (repeatable): "
                                                 "sgd, momentum, adam, adamw. Default: momentum=0.05 and "
                                                 "adam=0.002.")] = None,
    seeds: Annotated[int, typer.Option("--seeds", min=1, max=MAX_SEEDS, metavar="K",
                                       help="Seeds 0..K-1 per arm.")] = 3,
    stages: Stages = 4,
    microbatches: Microbatches = 4,
    minibatches: Minibatches = 60,
    microbatch_size: Annotated[int, typer.Option(
        "--microbatch-size", "-b", metavar="B", min=1, help="Samples per micro-batch.")] = 16,
    pipelines: Pipelines = 2,
    prediction: PredictionSource = None,
    model: Annotated[str, typer.Option(
        "--model", metavar="NAME", help=f"Built-in model ({', '.join(STUDY_MODELS)}).")] = "mlp",
    layers: Annotated[int, typer.Option("--layers", metavar="N", min=1, help="Model layers (blocks).")] = 8,
    width: Annotated[int, typer.Option("--width", metavar="N", min=1, help="Hidden width (channels for cnn).")] = 128,
    timing: Annotated[bool, typer.Option(
        "--timing/--no-timing", help="Time every arm on spawned ranks (one process per device) against the "
                                     "simulator's prediction from a calibration of the setting.")] = True,
    timing_repeats: Annotated[int, typer.Option(
        "--timing-repeats", min=1, metavar="R", help="Fresh timed runs per arm (the median is kept).")] = 3,
    results: Annotated[Path, typer.Option(
        "--results", metavar="JSON", parser=output_path,
        help="Results file: written after every run; a study with the same setting resumes from it.")
    ] = Path("study.json"),
    html: Annotated[Path, typer.Option(
        "--html", metavar="PATH", parser=output_path, help="The study's page.")] = Path("study.html"),
    plot_only: Annotated[bool, typer.Option(
        "--plot-only", help="Train nothing: show the table and write the page from --results.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
) -> None:
    """Train every method alike: accuracy, throughput and staleness. Each on the same model, data, initialisation
    and sample budget, per optimizer and seed: held-out accuracy and loss (mean ± std over seeds), measured and
    predicted throughput, and the staleness and prediction distance of every stage. A predicting method also runs
    with each other source of s that changes its distances (unless --prediction picks one)."""
    from ..schedules import METHODS, ScheduleError
    from ..schedules.catalogue import method_named
    from ..study.plan import DEFAULT_METHODS, DEFAULT_OPTIMIZERS, Setting, arms
    from ..study.results import ResultsError, load_results, open_results, recorded_arms, summarize
    from ..workload.sizes import stages_refusal

    try:
        check_outputs([("--results", None if plot_only else results), ("--html", html)],
                      [("--results", results if plot_only else None)], as_json)
        if plot_only:
            trained = ["/".join([param.opts[0], *param.secondary_opts]) for param in ctx.command.params
                       if is_given(ctx, param.name)
                       and param.name not in ("results", "html", "plot_only", "as_json")]
            if trained:  # ignored, where the table and page showed --results' own setting
                raise InputError(f"{', '.join(trained)}: --plot-only trains nothing and shows --results as it was "
                                 "recorded; leave it out")
            try:
                saved = load_results(results)
            except ResultsError as exc:  # a new user's first `--plot-only`, before any study ran here
                raise exc if results.exists() else ResultsError(f"{exc}; `pipesim study` writes it (about 3 minutes "
                                                                f"on 2 cores){_committed_study_text()}") from None
            setting = Setting(**saved.setting)
            chosen, rates, seed_list = recorded_arms(saved)
            if not chosen:
                raise InputError(f"--plot-only: {results} holds no finished run yet")
        else:
            if model not in STUDY_MODELS:
                raise InputError(choose_from("--model", STUDY_MODELS, model))
            check_prediction(prediction)
            if not timing and is_given(ctx, "timing_repeats"):  # dropped, as calibrate refuses --no-links' sizes
                raise InputError("--timing-repeats sizes the timing, which --no-timing skips: give one")
            rates = _optimizers(optimizers or list(DEFAULT_OPTIMIZERS))
            setting = Setting(model, {"layers": layers, "width": width}, stages, microbatches, microbatch_size,
                              minibatches, pipelines)
            searched = [name for name in schedules or [] if name in METHODS and method_named(name).needs_costs]
            if searched:  # its build's refusal named the planner's API, and no flag
                raise InputError(f"--schedule {searched[0]}: its order is searched from the stages' costs, which a "
                                 f"study does not price: train it with `pipesim run -s {searched[0]} --profile "
                                 "PROFILE`, or give a fixed method")
            chosen = arms(setting, schedules or list(DEFAULT_METHODS), prediction)
            # given to methods that do not read them, they were dropped: `-s 1f1b --pipelines 3` trained 1F1B alone;
            # after `arms`, which names a method that is none (`-s bogus --pipelines 3` was "not bogus")
            check_method_options(ctx, schedules or DEFAULT_METHODS, ("--pipelines", "--prediction"))
            seed_list = list(range(seeds))
            refuse(stages_refusal(f"--stages {stages:,}", stages, model, setting.model_options))
            _check_cuts(setting, chosen)
            with transient_status(f"{STARTING_STATUS} ({model})", quiet=as_json):  # torch's import: seconds
                require_model("pipesim study", model)
                _check_model(setting)
            saved = open_results(results, setting)
            from ..calibrate.contention import ContentionError
            from ..calibrate.runtime import RuntimeProbeError
            from ..executor import ExecutorError

            try:
                _train(saved, setting, chosen, rates, seed_list, timing, timing_repeats, results, quiet=as_json,
                       repeats_given=is_given(ctx, "timing_repeats"))
            # a run or a probe failed, not the input: earlier runs are kept
            except (ExecutorError, RuntimeProbeError, ContentionError) as exc:
                print_message(f"{exc}; the finished runs are in {results}", stderr, "error: ", "bold red")
                raise SystemExit(1) from None
        summaries = summarize(saved, chosen, rates, seed_list)
        from ..study.page import write_study_page

        replaced = html.is_file()
        with writing("--html"):
            write_study_page(summaries, list(rates), html, title=_title(setting))
    except (InputError, ScheduleError) as exc:
        fail(str(exc))
    except ResultsError as exc:
        fail(f"--results: {exc}")
    except OSError as exc:
        fail(read_error(exc))
    except (MemoryError, RuntimeError) as exc:  # a micro-batch this host cannot hold, made as a run starts
        refuse_out_of_host_memory(exc, model, microbatch_size)
    if as_json:
        print(json.dumps({"setting": setting.as_dict(), "samples": setting.samples, "results": str(results),
                          "html": str(html), "arms": [s.as_dict() for s in summaries]}, indent=2))
    else:
        _print_table(setting, summaries)
        stdout.print(wrote_text(html, replaced) + ("" if plot_only else f" and {results}"), highlight=False)


def _check_cuts(setting, chosen) -> None:
    """Each method's model stages cut from the study's chain of layers (study/train.py `_spec`): p·v of them for
    a V schedule, refused where the model has fewer layers; a graph of stages (graphpipe's) carries no cut of a
    chain. Said before the calibration and the first run, which each method had failed at, leaving a results file
    of no run."""
    from ..schedules.ir import StageGraph
    from ..study.plan import build
    from ..workload.sizes import stages_refusal

    for method in dict.fromkeys(arm.method for arm in chosen):
        schedule = build(setting, method)
        if schedule.graph != StageGraph.chain(schedule.num_stages):
            raise InputError(f"--schedule {method}: its stage graph {sorted(schedule.graph.edges)} branches, and "
                             f"study's models ({', '.join(STUDY_MODELS)}) are chains of layers: train it with "
                             "`pipesim run --model two-branch`")
        chunks = schedule.num_stages // setting.stages
        if chunks > 1:
            refuse(stages_refusal(f"--stages {setting.stages:,} x {method}'s {chunks} chunks", schedule.num_stages,
                                  setting.model, setting.model_options))


def _check_model(setting) -> None:
    from ..workload.models import ModelError, build_model

    try:  # a micro-batch past the host's memory before any is made (`-b 100000000`, 23.8 GiB, was torch's failure)
        refuse(host_memory_refusal("study", setting.model, setting.model_options, setting.microbatch_size))
        build_model(setting.model, **setting.model_options)
    except ModelError as exc:
        raise InputError(str(exc)) from None


def _title(setting) -> str:
    options = ", ".join(f"{k} {v:,}" for k, v in setting.model_options.items())
    degrees = ", ".join(degree_text(*degree) for degree in [("p", setting.stages), ("m", setting.microbatches),
                                                            ("b", setting.microbatch_size)])
    return f"pipesim study: {setting.model} ({options}), {degrees}, {setting.samples:,} samples"


def _train(saved, setting, chosen, rates, seed_list, timing: bool, repeats: int, path: Path, quiet: bool,
           repeats_given: bool = False) -> None:
    """Every run and timing the results file lacks, saving it after each, behind one progress bar; a timing it
    holds of other `repeats` than --timing-repeats gives (`repeats_given`) is taken again, and said so: kept, the
    flag changed nothing (a resumed study timed 1 run each where --timing-repeats 2 was given). Left to the default,
    the file's timings are kept, whose repeats the caption says."""
    from rich.progress import Progress

    from ..profiles.schema import Profile
    from ..study.plan import RunKey, build
    from ..study.train import time_arm, train

    def save() -> None:
        with writing("--results"):
            saved.save(path)

    runs = [(arm, RunKey(arm.method, arm.source, optimizer, lr, seed)) for optimizer, lr in rates.items()
            for arm in chosen for seed in seed_list]
    runs = [(arm, key) for arm, key in runs if not saved.done(key)]
    timings: list = []  # one arm per method: the order and the work do not depend on the source of s
    for arm in chosen:
        held = saved.timing(arm)
        if held is not None and repeats_given and held.repeats != repeats:
            print_message(f"timing {arm.label} again: --results {path} holds {count_text(held.repeats, 'run')} of it, "
                          f"and --timing-repeats {repeats:,} asks for {repeats:,}", stderr, "note: ")
            saved.timings.remove(held)
            held = None
        if timing and held is None and all(t.method != arm.method for t in timings):
            timings.append(arm)
    calibrating = bool(timings) and saved.profile is None
    total, piped = len(runs) + len(timings) + calibrating, not quiet and not stderr.is_terminal
    line = piped_lines("study", stderr)
    with Progress(*counted_bar_columns(), console=stderr, transient=True, disable=quiet or piped) as bar:
        task = bar.add_task("study", total=total)

        def doing(what: str) -> None:
            """The bar's description; piped (a log, CI), a line of it now and then, as run says its progress there:
            a study of minutes said nothing."""
            bar.update(task, description=what)
            if piped:
                line(f"{bar.tasks[0].completed:,.0f}/{total:,} done; {what}")

        if calibrating:
            ranks = max(build(setting, arm.method, arm.source).num_devices for arm in timings)
            profile = _calibrate(setting, next(iter(rates)), ranks,
                                 lambda what: doing(f"calibrating the setting: {what}"))
            saved.profile = profile.model_dump(mode="json")
            save()
            bar.advance(task)
        for arm, key in runs:
            doing(f"training {arm.label}, {key.optimizer}, seed {key.seed}")
            saved.runs.append(train(setting, arm, key.optimizer, key.lr, key.seed))
            save()
            bar.advance(task)
        profile = Profile.model_validate(saved.profile) if timings else None
        for arm in timings:
            doing(f"timing {arm.label} on {count_text(setting.stages, 'rank')}")
            run = saved.trained(arm, rates, seed_list)  # after training: a run known to reach the end
            if run is not None:
                saved.timings.append(time_arm(setting, arm, run.optimizer, run.lr, run.seed, profile, repeats))
                save()
            bar.advance(task)


def _calibrate(setting, optimizer: str, ranks: int, advance: Callable[[str], None]):
    """The profile a study's timings are predicted from, measured once per study as `pipesim calibrate`
    measures one: the setting's model and link, the executor's own cost per row (the same runtime probe), and
    how `ranks` ranks computing at once on this host slow each other. The per-host terms (link, runtime probe)
    come from calibrate's host cache where it holds them for this host, torch and thread count."""
    from ..calibrate.cache import HostCache
    from ..calibrate.contention import measure_contention
    from ..study.train import calibrate_setting, measurement
    from .calibrate import measure_runtime

    cache = HostCache()
    profile = calibrate_setting(setting, optimizer, advance, cache)
    runtime = measure_runtime(profile, measurement(setting), advance, setting.model, setting.model_options, cache)
    contention = measure_contention(profile, setting.model, setting.model_options, advance, ranks)
    return profile.model_copy(update={"runtime": runtime, "contention": contention})


def _repeats_text(repeats: list[int]) -> str:
    """How the measured samples/s were taken: one run said as such (it read "median of repeats" at
    --timing-repeats 1), else the median of how many."""
    if repeats == [1]:
        return "one run each (--timing-repeats 1)"
    return f"median of {' or '.join(f'{n:,}' for n in repeats)} runs"


def _print_table(setting, summaries) -> None:
    from ..study.results import DIVERGED_RISE

    timed = any(s.timing for s in summaries)
    repeats = sorted({s.timing.repeats for s in summaries if s.timing})
    seeds = max((len(s.runs) for s in summaries), default=0)
    spread = (f"mean ± std over {seeds} seeds less those that diverged" if seeds > 1
              else "of one seed (no spread: give --seeds 2 or more)")
    table = Table(title=_title(setting).removeprefix("pipesim study: "), title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, caption=f"held-out accuracy and final training loss (the last 10% of mini-batches), "
                                          f"{spread}; div.: seeds that diverged (the loss went non-finite, or ended "
                                          f"{DIVERGED_RISE:g}x its first), left out of every figure; "
                                          f"{STALENESS_HEADER} and s: staleness and prediction distance per stage, as "
                                          "the executor measured them"
                                          + (f"; samples/s on spawned ranks, {_repeats_text(repeats)}, and the "
                                             "simulator's prediction" if timed else ""),
                  caption_justify="left")
    headers = ["arm", "acc %", "loss", "div."]
    headers += ["samples/s", "predicted"] if timed else []
    headers += [STALENESS_HEADER, "s (F)", "s (B)"]
    for header in headers:
        table.add_column(header, justify="left" if header == "arm" else "right", no_wrap=True)
    previous = None
    for s in summaries:
        if s.optimizer != previous:
            if previous is not None:
                table.add_section()
            table.add_row(f"[bold]{s.optimizer}, lr {s.lr:g}[/]")
        previous = s.optimizer
        row = [s.arm.label, s.heldout_accuracy.text(lambda share: f"{100 * share:.1f}"), s.final_loss.text(),
               f"{s.diverged}/{len(s.runs)}" if s.diverged else ""]
        if timed:
            row += ["-", "-"] if s.timing is None else [f"{s.timing.measured_samples_per_s:,.0f}",
                                                        f"{s.timing.predicted_samples_per_s:,.0f}"]
        row += [s.per_stage(name) for name in ("forward_staleness", "prediction_distance",
                                               "backward_prediction_distance")]
        table.add_row(*row)
    print_table(table)
