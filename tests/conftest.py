"""Helpers the test modules share, imported as `from tests.conftest import ...`.

- `pipesim(*args)`: the command line run in-process, its output captured: (code, out, err).
- `pipesim_fresh(*commands)`: commands run one after another in a new Python process: each one's (code, out, err)
  and the packages the process imported (torch?).
- `fresh_process(commands, cwd, env, timeout_s, python)`: `pipesim_fresh` in an environment or interpreter of the
  caller's, with what its process wrote to stderr beside the commands (their ranks').
- `at_columns(monkeypatch, columns)`: the terminal width the command line prints for, as a process would see it.
- `simulate_json(*args)`: `pipesim simulate ... --json`, which must succeed: its results.
- `build(name, p, m, n)`: a method's schedule in its default shape (the V schedules' two chunks, AvgPipe's two
  pipelines) unless the call overrides it.
- `host_counters(others_cores, own_cores, load_1min)`: a host's CPU counters as traces/hostload.py reads them.
- `simulated(schedule, ...)` and `run(name, p, m, ...)`: simulate with the same costs on every model stage and a
  uniform link: (schedule, trace, summary).
- `estimate_json(tmp_path, *args)`: `pipesim estimate ARGS` into a file of its own in tmp_path: the profile's JSON.
- `tune_rows(document)`: every layout a `pipesim tune --json` document lists.
- `help_records()`: each command's name, each of its parameters and the (names, text) its --help lists for it.
- `reductions(split, ops, name)`: pass `name`'s reductions of the products `ops` on one rank, per reduced shape.
- `tensor_reductions` (a fixture): each all-reduce and reduce-scatter planning/estimate.py prices, as (bytes,
  ranks), each priced at 0 ms.
- `script_module(name)`: benchmarks/NAME.py imported as a module while the context lasts.
- `needs_transformers`: the mark that skips a test without transformers (an optional extra: `pipesim[hf]`).
- A module that says `RUN_EARLY = True` runs first (`pytest_collection_modifyitems`).

Tests marked `slow` (real transports, Ray, calibration that measures links) are left out by `-m "not slow"`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import settings

# pytest-xdist starts its workers with COLUMNS=80, which a serial run does not have: the commands' consoles, made at
# import (commands/common.py), would wrap at 80 columns instead of a pipe's 120.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

from pipesim.profiles.partition import LayerCost
from pipesim.schedules import METHODS, Schedule, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import Summary, Trace, summarize

# Every property test draws the same examples on every run: a draw that fails once fails every run, the same one CI
# and a developer see. A test's own @settings keep this (hypothesis takes the loaded profile as their parent).
settings.register_profile("pipesim", derandomize=True)
settings.load_profile("pipesim")

if importlib.util.find_spec("tqdm") is not None:  # installed with transformers
    import tqdm

    # No tqdm monitor thread: torch.fx's Interpreter makes a bar (disabled) under torch.compile (test_torch_compile),
    # whose monitor lived as long as the test worker, and a process running another thread spawns its tune and
    # simulate workers, fresh interpreters importing the simulator, where the command line forks them
    # (planning/tune.py start_workers): 143 of a run's 215 worker pools, about 1.6 CPU s each.
    tqdm.tqdm.monitor_interval = 0

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install 'pipesim[hf]')")


@pytest.fixture(scope="session", autouse=True)
def host_cache_dir(tmp_path_factory):
    """Calibration's per-host cache in a temporary folder for the whole session (spawned ranks inherit it), so
    no test reads or fills the user's."""
    saved = os.environ.get("PIPESIM_CACHE_DIR")
    os.environ["PIPESIM_CACHE_DIR"] = str(tmp_path_factory.mktemp("host-cache"))
    yield
    if saved is None:
        os.environ.pop("PIPESIM_CACHE_DIR", None)
    else:
        os.environ["PIPESIM_CACHE_DIR"] = saved


def host_counters(others_cores: float, own_cores: float = 0.0, load_1min: float | None = 0.0):
    """A stand-in for traces/hostload.py's `sample`: a host whose other work keeps `others_cores` busy while this
    command keeps `own_cores` busy, and whose load average reads `load_1min`, on a clock that moves 1 s a
    reading."""
    import itertools

    from pipesim.traces.hostload import CpuSample

    readings = itertools.count()

    def sample() -> CpuSample:
        seconds = float(next(readings))
        return CpuSample(seconds, (others_cores + own_cores) * seconds, own_cores * seconds, load_1min)

    return sample


@pytest.fixture(scope="session", autouse=True)
def steady_host_load():
    """The host's load as calibration and runs read it (traces/hostload.py), held at one figure: whether a cached
    term is reused must not depend on what else the test machine runs. Tests of that rule set their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pipesim.traces.hostload.sample", host_counters(0.0))
        patch.setattr("pipesim.traces.hostload.QUIET_WINDOW_S", 0.0)
        yield


@contextlib.contextmanager
def compiling_checkpointed_hf() -> Iterator[None]:
    """Inside: torch.compile traces a transformers layer under torch's checkpoint whole. With the `kernels` package
    installed (transformers 5.25 requires it) an attention class's forward (kernels' `use_kernelized_func`) sets a
    context variable and resets it before it returns, which dynamo refuses under a checkpoint as a side effect the
    backward's recomputation would not replay; set and reset cancel, so skipping the replay loses nothing. After:
    dynamo's caches reset, so one test's compiled graphs do not serve another's."""
    import torch._dynamo

    try:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            yield
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests (its `pytestmark = pytest.mark.usefixtures("one_torch_thread")`): on
    a shared 2-core machine two OpenMP threads wait on each other's time slices, which makes small timings jump by
    scheduler ticks."""
    import torch  # not at import: most test modules never load it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that say `RUN_EARLY = True` (their tests wait mostly on processes of their own: the README's
    commands, a bare install's, Chromium) run first: pytest-xdist's first worker starts on them while the other takes
    the rest, and the README's sections, which its module fixture runs together, stay on one worker (a worker that
    runs out of tests takes the others' last ones, never their first)."""
    items.sort(key=lambda item: not getattr(getattr(item, "module", None), "RUN_EARLY", False))  # stable


class Cli(NamedTuple):
    code: int
    out: str
    err: str


def pipesim(*args: Any) -> Cli:
    """Run the command line in-process: (exit code, stdout, stderr). Arguments may be numbers or paths.

    It captures its own output, so module-scoped fixtures can call it too (capsys is per test)."""
    from pipesim.cli import main  # not at import: a test module that never runs the CLI does not load it

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return Cli(exc.value.code, out.getvalue(), err.getvalue())


FRESH = """
import contextlib, io, json, sys, traceback
from pipesim.cli import main
runs = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
            code = None
        except SystemExit as exc:
            code = exc.code
        except Exception:  # past the command line's handling: as Python ends its process, the traceback and 1
            traceback.print_exc()
            code = 1
    runs.append([code, out.getvalue(), err.getvalue()])
print(json.dumps([runs, sorted(sys.modules)]))
"""


class Fresh(NamedTuple):
    runs: list[Cli]
    imported: set[str]  # the modules the process imported by its end: "torch", "multiprocessing.forkserver"


def pipesim_fresh(*commands: Iterable[Any], cwd: Path | None = None) -> Fresh:
    """Each of `commands` (the command line's arguments) run as `pipesim` runs it, one after another in one new
    Python process, which imported nothing before: what a command imports (torch) shows in `imported`."""
    return fresh_process(commands, cwd)[0]


def fresh_process(commands: Iterable[Iterable[Any]], cwd: Path | None = None, env: dict[str, str] | None = None,
                  timeout_s: float | None = None, python: Path | str = sys.executable) -> tuple[Fresh, str]:
    """`pipesim_fresh`'s process, in `env` (else this one's), ended after `timeout_s`, of interpreter `python` (another
    venv's): its Fresh, and what the process wrote to stderr besides the commands' own output (their child
    processes', such as a run's ranks)."""
    argv = json.dumps([[str(arg) for arg in command] for command in commands])
    done = subprocess.run([python, "-c", FRESH, argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr  # the process itself failed (its start, its last line)
    runs, imported = json.loads(done.stdout.splitlines()[-1])
    return Fresh([Cli(*run) for run in runs], set(imported)), done.stderr


def at_columns(monkeypatch: pytest.MonkeyPatch, columns: int | None) -> None:
    """$COLUMNS at `columns` (None: unset), and the command line's consoles as wide as a process started so makes
    them (they are made at import)."""
    from pipesim.commands import common

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    for console in (common.stdout, common.stderr):
        monkeypatch.setattr(console, "width", columns or 120)


def tune_rows(document: dict) -> list[dict]:
    """Every layout a `pipesim tune --json` document lists: its choice, the runners-up and those excluded."""
    return [document["choice"], *document["runners_up"], *document["excluded"]]


def refused(*args: Any) -> str:
    """The command line run in the current folder (a test's empty tmp_path), which must refuse in one line with exit
    2 and write nothing, on stdout either: its message."""
    code, out, err = pipesim(*args)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, (code, out, err)
    assert not list(Path.cwd().iterdir())
    return err


def flags_with(flags: Iterable[Any], *given: Any) -> tuple:
    """`flags` with the options `given` in place of theirs and the others added: the command line refuses an option
    of one value given twice. An option is a word that starts with "-" (a negative number is a value); its values
    are the words up to the next option, none for a switch such as --p2p-sync."""
    replaced = {option for option, *_ in _options(given)}
    kept = [word for option, *values in _options(flags) if option not in replaced for word in (option, *values)]
    return (*kept, *given)


def _options(words: Iterable[Any]) -> list[list]:
    """Each option among `words` with the values that follow it, in their order."""
    options: list[list] = []
    for word in words:
        if isinstance(word, str) and word.startswith("-") and not _is_number(word):
            options.append([word])
        else:
            assert options, f"flags_with: the value {word!r} follows no option"
            options[-1].append(word)
    return options


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def simulate_json(*args: Any) -> list[dict]:
    """`pipesim simulate ARGS --json`, which must exit 0: its results, one per schedule."""
    code, out, err = pipesim("simulate", *args, "--json")
    assert code == 0, err
    return json.loads(out)["results"]


def estimate_json(tmp_path: Path, *args: Any) -> dict:
    """`pipesim estimate ARGS -o FILE`, which must exit 0, FILE a new one in tmp_path each call: the profile's JSON."""
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
    code, _, err = pipesim("estimate", *args, "-o", out)
    assert code == 0, err
    return json.loads(out.read_text())


def reductions(split: Any, ops: Iterable[Any], name: str) -> dict[tuple[int, ...], float]:
    """Pass `name`'s reductions of the products `ops` on one rank (planning/estimate.py `_Split.products` of
    `split`), per reduced product's shape: how many, each op's calls times its share of them times its part of the
    reduction (`_Reduction.part`: 1/3 where q, k and v reduce one sum)."""
    counted: dict[tuple[int, ...], float] = {}
    for op in ops:
        for _, reduction, share in split.products(op, name):
            if reduction is not None:
                shape = reduction.op.shape
                counted[shape] = counted.get(shape, 0.0) + op.count * share * reduction.part
    return counted


@pytest.fixture
def tensor_reductions(monkeypatch) -> list[tuple[int, int]]:
    """Each all-reduce and reduce-scatter planning/estimate.py prices while the test runs, as (bytes, ranks), in
    its order; each priced at 0 ms."""
    from pipesim.planning import estimate

    reduced: list[tuple[int, int]] = []

    def recorded(nbytes: int, ranks: int, *_: object) -> float:
        reduced.append((nbytes, ranks))
        return 0.0

    monkeypatch.setattr(estimate, "all_reduce_ms", recorded)
    monkeypatch.setattr(estimate, "reduce_scatter_ms", recorded)
    return reduced


def help_records() -> Iterator[tuple[str, Any, tuple[str, str] | None]]:
    """Each command's name, each of its parameters and the (names, text) its --help lists for it (click's
    `get_help_record`, as the command's own context renders it; None for a parameter the help leaves out)."""
    import click
    import typer

    from pipesim.cli import make_app

    group = typer.main.get_command(make_app())
    for name, command in group.commands.items():
        context = click.Context(command, info_name=name, parent=click.Context(group))
        for param in command.params:
            yield name, param, param.get_help_record(context)


def build(name: str, p: int, m: int, n: int = 1, **params: Any) -> Schedule:
    """Method `name` on p devices (p·v model stages), m micro-batches, n mini-batches; `params` (chunks,
    pipelines, advance, ...) override the method's defaults. A method searched from the costs (auto) is searched
    for `simulated`'s default costs."""
    method = METHODS[name]
    if method.needs_costs:
        from pipesim.planning.auto import search_schedule

        return search_schedule(method.params(p, m, n, **params), Costs.per_stage(p, fwd_ms=1.0, bwd_ms=2.0),
                               Cluster.uniform(p, 0.0))
    return build_schedule(name, method.params(p, m, n, **params))


class Run(NamedTuple):
    schedule: Schedule
    trace: Trace
    summary: Summary


def simulated(schedule: Schedule, fwd: float = 1.0, bwd: float = 2.0, comm: float = 0.0, **costs: Any) -> Run:
    """Simulate with `fwd`/`bwd` ms on every model stage (and `costs`: wgrad_fraction, param_mb, ...) and a
    uniform `comm` ms link between every pair of devices."""
    per_stage = Costs.per_stage(schedule.num_stages, fwd_ms=fwd, bwd_ms=bwd, **costs)
    trace = simulate(schedule, per_stage, Cluster.uniform(schedule.num_devices, comm))
    return Run(schedule, trace, summarize(trace))


def run(name: str, p: int, m: int, n: int = 1, *, chunks: int | None = None, fwd: float = 1.0, bwd: float = 2.0,
        comm: float = 0.0, **costs: Any) -> Run:
    """`build` then `simulated`: method `name` with p devices and, with `chunks` v, p·v model stages."""
    return simulated(build(name, p, m, n, chunks=chunks), fwd=fwd, bwd=bwd, comm=comm, **costs)


def stage_ms(layers: list[LayerCost], start: int, stop: int) -> float:
    """The partitioner's oracle: forward + backward ms of layers [start, stop), math.fsum's correctly rounded sum
    (profiles/partition.py's table is held to it bit for bit)."""
    return math.fsum(layer.ms for layer in layers[start:stop])


def spy_reserves(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each call of the allocator's per-device replay (`caching_allocator._reserve`) as its arguments by name,
    defaults filled in, the replay itself run as before: a test reads what a command handed the replay without
    restating its signature."""
    import inspect

    from pipesim.sim import caching_allocator

    replayed = caching_allocator._reserve.__wrapped__
    signature = inspect.signature(replayed)
    seen: list[dict[str, Any]] = []

    def reserve(*args: Any, **kwargs: Any) -> int:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(dict(bound.arguments))
        return replayed(*args, **kwargs)

    monkeypatch.setattr(caching_allocator, "_reserve", reserve)
    return seen


@contextlib.contextmanager
def script_module(name: str) -> Iterator[Any]:
    """The script benchmarks/`name`.py (benchmarks/ is no package) imported as module `name`, registered in
    sys.modules while the context lasts (dataclasses look their module up by name), with benchmarks/ on sys.path
    meanwhile so that its imports of sibling scripts (probe_replay, probe_moe) resolve; those are dropped after."""
    benchmarks = Path(__file__).parent.parent / "benchmarks"
    added = str(benchmarks) not in sys.path
    if added:
        sys.path.insert(0, str(benchmarks))
    loaded = set(sys.modules)
    spec = importlib.util.spec_from_file_location(name, benchmarks / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for sibling in set(sys.modules) - loaded:
            if Path(getattr(sys.modules[sibling], "__file__", None) or "/").parent == benchmarks:
                del sys.modules[sibling]
        sys.modules.pop(name, None)
        if added:
            sys.path.remove(str(benchmarks))
