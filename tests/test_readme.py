"""Every command the README shows runs, as written, and succeeds, and prints the tables the README shows beside it.

The README is what a new user copies. Each `## ` section's ```bash blocks run in order in a fresh folder that
holds the repository's `examples/`, `traces/` and `benchmarks/` (the paths the commands name), so a section's
later commands read what its earlier ones wrote; its `pipesim` commands run one after another in one new Python
process, as the command line runs each. The install-and-run lines of the Quick start run their pipesim part here,
through the shell (the `pipesim` console script); CI runs their install part on a fresh machine.

The deterministic tables beside a command (what-if costs, auto's order, tune's pick from a committed profile, a
run's losses) and the figures the prose reads from a command's output are what that command printed in its
section's run, compared row by row, word by word: a README row that ends in "..." is the printed row cut short,
compared up to there. Where a section was not run here (a test picked alone), its command runs in-process.
test_readme_figures.py holds the prose's other figures.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from pipesim.schedules import METHODS
from tests.conftest import Cli, fresh_process, pipesim
from tests.helpers import H100, NUMBER_WORDS, README, readme_section, shown_after
from tests.helpers import bash_commands as _commands
from tests.helpers import readme_prose as prose

REPO = Path(__file__).resolve().parents[1]
SHARED_PATHS = ("examples", "traces", "benchmarks")
README_MAX_LINES = 250


def readme_sections() -> dict[str, list[str]]:
    """Section title -> its commands, in the README's order."""
    sections: dict[str, list[str]] = {}
    title = "top"
    for part in re.split(r"^(## .*)$", README.read_text(), flags=re.M):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        for block in re.findall(r"```bash\n(.*?)```", part, flags=re.S):
            sections.setdefault(title, []).extend(_commands(block))
    return sections


def test_the_readme_is_short_and_shows_commands():
    assert len(README.read_text().splitlines()) < README_MAX_LINES
    sections = readme_sections()
    assert "pipesim simulate" in sections["Quick start"]
    assert sum(map(len, sections.values())) >= 10


RUN_EARLY = True  # first, on one worker (conftest.py): `section_runs` runs every selected section at once
MEASURING = ("pipesim calibrate", "pipesim run", "pipesim study")  # they time this machine and share its host cache


def lay_out(folder: Path) -> None:
    """Lay out `folder` as a user's copy of the repository holds what the docs' commands read (`SHARED_PATHS`,
    linked)."""
    for name in SHARED_PATHS:
        (folder / name).symlink_to(REPO / name)


def user_folder(folder: Path, host_cache: Path) -> dict[str, str]:
    """`lay_out` `folder`, and the environment the commands run in there: this venv's commands first on PATH,
    `host_cache` the host cache."""
    lay_out(folder)
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                PIPESIM_CACHE_DIR=str(host_cache))


COMMAND_TIMEOUT_S = 600
SHELL_SECTIONS = ("Quick start",)  # the install line's pipesim step: as the user's shell runs it, the console script
RUN_TITLE = "Run: the same schedules, for real"
# The Run section's losses and held-out scores are compared with the README's (seeded: the same run after run): its
# ranks' matrix products are held to kernels that sum in one order on any x86 host. 50 mini-batches of XPipe's
# predicted weights carry a kernel's rounding to another loss (last loss 0.7765 on a Sapphire Rapids host's AVX-512
# kernels; held-out 0.4590 on an AMD EPYC host, where MKL takes its own path whatever MKL_ENABLE_INSTRUCTIONS says).
# MKL's conditional numerical reproducibility (MKL_CBWR=COMPATIBLE: the same results on Intel and AMD processors,
# Intel's oneMKL developer guide), oneDNN's AVX2 kernels (ONEDNN_MAX_CPU_ISA), both read when each rank's library
# first runs, and ATen's own vectorized kernels at AVX2 (ATEN_CPU_CAPABILITY, read at torch's first dispatch): on an
# AVX-512 AMD EPYC host the first two alone left the last loss 0.777 (ATen's AVX-512 kernels), 0.689 with the third.
# That section alone: the sections that time this machine keep its fastest kernels.
SECTION_ENV = {RUN_TITLE: {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


class SectionRun(NamedTuple):
    failure: str | None  # what the first command that failed printed; None where every one succeeded
    printed: list[tuple[str, Cli]]  # each command run, as the section lists it: its exit code, stdout and stderr


def pipesim_arguments(command: str) -> list[str] | None:
    """The arguments of a command that is `pipesim` and its arguments alone; None for a line with any other word
    the shell reads (an operator, a redirection, a variable, a pattern)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if words[:1] != ["pipesim"] or re.search(r"[$`*?~]", command) or any(
            set(word) <= set(lexer.punctuation_chars) for word in words):
        return None
    return words[1:]


def _run_section(title: str, commands: list[str], folder: Path, host_cache: Path) -> SectionRun:
    """Run one section's commands in order in `folder` (in `SECTION_ENV`'s settings for it): what each printed, and
    None or what the first one that failed printed. A section of `pipesim` commands alone runs them in one new
    Python process, one after another as the command line runs each (a process's start and imports, torch's and
    transformers' 3-8 CPU-s, once a section); any other, and the Quick start's, through the shell, as typed."""
    env = {**user_folder(folder, host_cache), **SECTION_ENV.get(title, {})}
    arguments = [pipesim_arguments(command) for command in commands]
    if title in SHELL_SECTIONS or None in arguments:
        printed = []
        for command in commands:
            done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            printed.append((command, Cli(done.returncode, done.stdout, done.stderr)))
            if done.returncode != 0:
                return SectionRun(f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}", printed)
            if "Traceback" in done.stderr:
                return SectionRun(f"{command!r}:\n{done.stderr}", printed)
        return SectionRun(None, printed)
    (runs, _), children_err = fresh_process(arguments, folder, env, COMMAND_TIMEOUT_S * len(commands))
    printed = list(zip(commands, runs))
    for command, (code, out, err) in printed:
        if code not in (None, 0):
            return SectionRun(f"{command!r} exited {code}:\n{out}\n{err}", printed)
        if "Traceback" in err:
            return SectionRun(f"{command!r}:\n{err}", printed)
    if "Traceback" in children_err:
        return SectionRun(f"the section's commands' processes:\n{children_err}", printed)
    return SectionRun(None, printed)


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory) -> Path:
    """The host cache the README's sections share, as one user's machine does."""
    return tmp_path_factory.mktemp("pipesim-cache")


@pytest.fixture(scope="module")
def section_runs(request, tmp_path_factory, host_cache) -> Iterator[dict[str, Future]]:
    """The selected sections, started at once in two chains, as two users on a 2-core machine would: the sections
    that measure (calibrate, run, study) one after another in one, every other section in the other, all sharing
    `host_cache`. Each section still runs its commands in order in a folder of its own: section -> its run
    (`_run_section`)."""
    selected = {item.callspec.params["section"] for item in request.session.items
                if item.originalname == "test_every_readme_command_runs_as_written"}
    sections = {title: commands for title, commands in readme_sections().items() if title in selected}
    chains = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
    runs = {title: chains[any(c.startswith(MEASURING) for c in commands)].submit(
                _run_section, title, commands, tmp_path_factory.mktemp("section"), host_cache)
            for title, commands in sections.items()}
    yield runs
    for chain in chains:
        chain.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("section", list(readme_sections()))
def test_every_readme_command_runs_as_written(section, section_runs):
    failure = section_runs[section].result().failure
    assert failure is None, failure


def printed(title: str, command: str, section_runs: dict[str, Future], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> str:
    """What section `title`'s `command` (as the README writes it) printed, which must exit 0: in its section's run
    where the section ran here, else run in-process in `tmp_path` laid out as a user's folder, in the section's
    settings."""
    if title in section_runs:
        run = section_runs[title].result()
        ran = [cli for listed, cli in run.printed if listed.split() == command.split()]
        assert ran, f"{command!r} did not run: {run.failure}"
        code, out, err = ran[0]
    else:
        lay_out(tmp_path)
        monkeypatch.chdir(tmp_path)
        for name, value in SECTION_ENV.get(title, {}).items():
            monkeypatch.setenv(name, value)
        code, out, err = pipesim(*shlex.split(command)[1:])
    assert code in (None, 0), err
    return out


def rows_not_printed(shown: list[str], printed: str, first_words: tuple[str, ...]) -> list[str]:
    """The shown lines starting with one of `first_words` that start no printed line, word for word (up to a
    "..."); where the README's block has no such line, that is said instead: nothing would be compared."""
    printed_rows = [line.split() for line in printed.splitlines()]
    rows = [line.split() for line in shown if line.split()[:1] and line.split()[0] in first_words]
    if not rows:
        return [f"no row of {first_words} in the README's block"]
    return [" ".join(row) for row in rows
            if not any(p[:len(words)] == words for p in printed_rows
                       for words in [row[:row.index("...")] if "..." in row else row])]


@pytest.mark.parametrize("title, command_start, first_words", [
    ("Simulate: what-if, side by side", "pipesim simulate -s 1f1b",
     ("p=4", "schedule", "1f1b", "zb-h1", "pipedream", "xpipe")),
    ("auto: the schedule searched for your costs", "pipesim simulate -s auto",
     ("schedule", "auto", "zb-h1", "zb-h2", "1f1b")),
    ("Sweep and tune: many configurations at once", "pipesim tune", ("best", "over", "note:")),
])
def test_a_readme_table_is_what_its_command_prints(title, command_start, first_words, section_runs, tmp_path,
                                                   monkeypatch):
    command, shown = shown_after(readme_section(title), command_start)
    out = printed(title, command, section_runs, tmp_path, monkeypatch)
    assert rows_not_printed(shown, out, first_words) == [], out


def test_the_sweep_runs_the_grids_configurations_the_prose_counts(section_runs, tmp_path, monkeypatch):
    title = "Sweep and tune: many configurations at once"
    (command,) = [line for line in readme_section(title).splitlines() if line.startswith("pipesim sweep")]
    out = printed(title, command, section_runs, tmp_path, monkeypatch)
    counts = re.search(r"of the (\d+) configurations that ran \((?:(\d+) more skipped, )?(\d+) more the same "
                       r"schedule", " ".join(out.split()))
    assert counts, out
    assert f"simulates the grid's {sum(int(n) for n in counts.groups() if n)} configurations" in prose(title)


def test_the_committed_studys_figures_are_what_its_plot_prints(section_runs, tmp_path, monkeypatch):
    """`study --plot-only` of the committed study: its methods, optimizers and seeds as the prose counts them, and
    PipeDream's loss of accuracy against 1F1B under momentum."""
    title = "Study: what staleness does to training"
    (command,) = [line for line in readme_section(title).splitlines() if line.startswith("pipesim study --plot-only")]
    out = printed(title, command, section_runs, tmp_path, monkeypatch)
    blocks = re.split(r"^ (\w+), lr [\d.]+ *$", out, flags=re.M)[1:]
    accuracy = {(optimizer, row.split()[0]): float(row.split()[1])
                for optimizer, rows in zip(blocks[::2], blocks[1::2]) for row in rows.splitlines()
                if row.split()[:1] and row.split()[0] in METHODS and not row.split()[1].startswith("(")}
    methods = {method for _, method in accuracy}
    seeds = int(re.search(r"mean ± std over (\d+) seeds", " ".join(out.split())).group(1))
    text = prose(title)
    assert (f"the committed study ({NUMBER_WORDS[len(methods)]} methods, {NUMBER_WORDS[len(blocks) // 2]} "
            f"optimizers, {NUMBER_WORDS[seeds]} seeds") in text
    lost = accuracy["momentum", "1f1b"] - accuracy["momentum", "pipedream"]
    assert f"one update of staleness costs PipeDream {lost:.1f} points under momentum" in text


@pytest.mark.slow
def test_a_runs_losses_are_what_its_command_prints(section_runs, tmp_path, monkeypatch):
    """`pipesim run`'s shape line and its losses and held-out scores (seeded, in `SECTION_ENV`'s kernels); its
    step, samples/s and peak memory are measured and not compared."""
    command, shown = shown_after(readme_section(RUN_TITLE), "pipesim run")
    out = printed(RUN_TITLE, command, section_runs, tmp_path, monkeypatch)
    assert rows_not_printed([line for line in shown if line.startswith("xpipe")], out, ("xpipe",)) == [], out
    (row,), (printed_row,) = ([line.split() for line in lines if re.match(r" +[\d.]+ ", line)]
                              for lines in (shown, out.splitlines()))
    assert printed_row[2:8] == row[2:8]  # first -> last loss, held-out loss / accuracy


def test_the_models_sections_figures_are_what_its_commands_print(section_runs, host_cache, monkeypatch):
    """The prose under "Models and parallelism of now" quotes DeepSeek-V3's step and peak per schedule (and
    DualPipeV's peak in BF16, the same command) and Llama 3.1 405B's GPUs and step: each is what its command prints, to
    the digit quoted, and DualPipeV fits an H100 where ZB-V and BF16 do not. Where the section ran here, its commands
    (`--json` added) read the counts it kept, as they would on the user's machine after it."""
    from tests.conftest import simulate_json

    title = "Models and parallelism of now"
    if title in section_runs:
        section_runs[title].result()
        monkeypatch.setenv("PIPESIM_CACHE_DIR", str(host_cache))
    commands = readme_sections()[title]
    (deepseek,) = [" ".join(c.split()) for c in commands if "deepseek-v3" in c]
    (llama,) = [c for c in commands if "llama3.1-405b" in c]
    in_bf16 = deepseek.replace("--dtype fp8 --fp8-recipe deepseek", "--dtype bf16")
    assert in_bf16 != deepseek  # the command's FP8 flags, as the BF16 sentence drops them

    def results(command: str) -> dict[str, dict]:
        """`command` (pipesim simulate ...) run: its results by schedule."""
        return {r["schedule"]: r for r in simulate_json(*command.split()[2:])}

    fp8, bf16 = results(deepseek), results(in_bf16)
    llama_1f1b = results(llama)["1f1b"]
    text = prose(title)
    quoted = {f"DualPipeV {fp8['dualpipev']['time_per_minibatch_ms'] / 1e3:.1f} s a step in "
              f"{fp8['dualpipev']['peak_memory_mb'] / 1024:.1f} GiB against 1F1B's "
              f"{fp8['1f1b']['time_per_minibatch_ms'] / 1e3:.1f}",
              f"ZB-V ({fp8['zb-v']['time_per_minibatch_ms'] / 1e3:.1f} s) needs "
              f"{fp8['zb-v']['peak_memory_mb'] / 1024:.1f}",
              f"in BF16 DualPipeV's {bf16['dualpipev']['peak_memory_mb'] / 1024:.1f} GiB does not fit",
              f"Llama 3.1 405B on {llama_1f1b['gpus']} H100s",
              f"{llama_1f1b['time_per_minibatch_ms'] / 1e3:.1f} s a step"}
    for figure in quoted:
        assert figure in text
    h100_gib = H100.memory_gib  # what fits and what does not, as the prose says
    assert fp8["dualpipev"]["peak_memory_mb"] / 1024 < h100_gib < fp8["zb-v"]["peak_memory_mb"] / 1024
    assert bf16["dualpipev"]["peak_memory_mb"] / 1024 > h100_gib
