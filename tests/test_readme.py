"""Every command the README shows runs, as written, and succeeds.

The README is what a new user copies. Each `## ` section's ```bash blocks run in order in a fresh folder that
holds the repository's `examples/`, `traces/` and `benchmarks/` (the paths the commands name), so a section's
later commands read what its earlier ones wrote; its `pipesim` commands run one after another in one new Python
process, as the command line runs each. The install-and-run lines of the Quick start run their pipesim part here,
through the shell (the `pipesim` console script); CI runs their install part on a fresh machine.
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

import pytest

from tests.conftest import fresh_process
from tests.helpers import H100, README
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


def user_folder(folder: Path, host_cache: Path) -> dict[str, str]:
    """Lay out `folder` as a user's copy of the repository holds what the docs' commands read (`SHARED_PATHS`, linked),
    and the environment they run in there: this venv's commands first on PATH, `host_cache` the host cache."""
    for name in SHARED_PATHS:
        (folder / name).symlink_to(REPO / name)
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                PIPESIM_CACHE_DIR=str(host_cache))


COMMAND_TIMEOUT_S = 600
SHELL_SECTIONS = ("Quick start",)  # the install line's pipesim step: as the user's shell runs it, the console script


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


def _run_section(title: str, commands: list[str], folder: Path, host_cache: Path) -> str | None:
    """Run one section's commands in order in `folder`: None, or what the first one that failed printed. A section
    of `pipesim` commands alone runs them in one new Python process, one after another as the command line runs
    each (a process's start and imports, torch's and transformers' 3-8 CPU-s, once a section); any other, and the
    Quick start's, through the shell, as typed."""
    env = user_folder(folder, host_cache)
    arguments = [pipesim_arguments(command) for command in commands]
    if title in SHELL_SECTIONS or None in arguments:
        for command in commands:
            done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            if done.returncode != 0:
                return f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            if "Traceback" in done.stderr:
                return f"{command!r}:\n{done.stderr}"
        return None
    (runs, _), children_err = fresh_process(arguments, folder, env, COMMAND_TIMEOUT_S * len(commands))
    for command, (code, out, err) in zip(commands, runs):
        if code not in (None, 0):
            return f"{command!r} exited {code}:\n{out}\n{err}"
        if "Traceback" in err:
            return f"{command!r}:\n{err}"
    if "Traceback" in children_err:
        return f"the section's commands' processes:\n{children_err}"
    return None


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory) -> Path:
    """The host cache the README's sections share, as one user's machine does."""
    return tmp_path_factory.mktemp("pipesim-cache")


@pytest.fixture(scope="module")
def section_runs(request, tmp_path_factory, host_cache) -> Iterator[dict[str, Future]]:
    """The selected sections, started at once in two chains, as two users on a 2-core machine would: the sections
    that measure (calibrate, run, study) one after another in one, every other section in the other, all sharing
    `host_cache`. Each section still runs its commands in order in a folder of its own: section -> its outcome
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
    failure = section_runs[section].result()
    assert failure is None, failure


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
