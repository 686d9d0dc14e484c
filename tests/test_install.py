"""Installed without extras (`pip install -e .` into a fresh venv that cannot see this one's packages, so no
torch, scikit-learn, pyarrow or ray), every pipesim command either works or, where it needs an extra, says
in one line how to install it and exits 2, with no traceback. Needs the package index (or pip's cache)."""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_HINT = "pip install 'pipesim[torch]'"
RUN_EARLY = True  # first (conftest.py): a venv and commands, each a process


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A fresh venv with pipesim installed editable and only its required dependencies: its bin folder."""
    home = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True).create(home)
    python = home / "bin" / "python"
    # This venv's pip installs into it (`--python`), where a pip of its own (ensurepip) took 7 of the setup's 23 CPU-s.
    # --no-compile: byte-compiling every installed module (plotly's thousands) costs more than the modules the
    # commands below import compile on first use (install 20.6 -> 15.5 s, first simulate --html +0.3 s)
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check",
                    "--no-compile", "-e", ROOT], check=True, capture_output=True, timeout=600)
    return home / "bin"


@pytest.mark.slow
def test_every_command_runs_or_names_the_extra_it_needs(bare, tmp_path):
    missing = subprocess.run([bare / "python", "-c", "import importlib.util as u; print([m for m in "
                              "('torch', 'sklearn', 'pyarrow', 'ray') if u.find_spec(m)])"],
                             capture_output=True, text=True, check=True)
    assert missing.stdout.strip() == "[]"  # the venv sees none of the extras

    def started(*args) -> subprocess.Popen:
        return subprocess.Popen([bare / "pipesim", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path)

    def pipesim(*args) -> subprocess.CompletedProcess:
        return finished(started(*args))

    def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
        out, err = process.communicate(timeout=300)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    help_text = pipesim("--help")
    assert help_text.returncode == 0, help_text.stderr
    listed = set(re.findall(r"^  (\w+)  ", help_text.stdout, re.MULTILINE))
    trace, profile = tmp_path / "t.json", ROOT / "traces" / "profiles" / "gpt-cpu.json"
    works = {
        "simulate": ("simulate", "-s", "1f1b", "-p", 2, "-m", 2, "--json", "--trace", trace),
        "schedules": ("schedules",),
        "export": ("export", "-s", "1f1b", "-p", 2, "-m", 2, "--format", "torch-csv", "-o", "o.csv"),
        "sweep": ("sweep", "-s", "1f1b,gpipe", "-p", 2, "-m", 2, "-j", 1, "--out", "r.csv", "--html", "s.html"),
        "tune": ("tune", "--profile", profile, "--devices", 2, "--memory-gb", 1),
        "view": ("view", trace, "--html", "v.html"),
        "compare": ("compare", trace, trace, "--json"),
        "gpus": ("gpus", "--json"),
    }
    needs = {
        "calibrate": (("calibrate", "--model", "gpt", "--device", "cpu", "--stages", 2, "--out", "g.json"), TORCH_HINT),
        "run": (("run", "-s", "1f1b", "--model", "mlp", "--trace", "m.json"), TORCH_HINT),
        "study": (("study", "--seeds", 1, "--results", "s.json", "--html", "s.html"), TORCH_HINT),
        "count": (("count", "--model", "gpt", "--layers", 2), TORCH_HINT),
        "estimate": (("estimate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2, "--out", "e.json"),
                     TORCH_HINT),
        "simulate --gpu": (("simulate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2), TORCH_HINT),
        "sweep --out .parquet": (("sweep", "-s", "1f1b", "--out", "r.parquet"), "pip install 'pipesim[parquet]'"),
        "sweep --ray": (("sweep", "-s", "1f1b", "--ray", "local"), "pip install 'pipesim[ray]'"),
    }
    assert listed == set(works) | {name.split()[0] for name in needs}  # every command is tried
    # The commands run side by side, each its own process; view and compare, which read simulate's trace, start
    # once simulate is done, and the refusals write and read nothing.
    readers = ("view", "compare")
    running = {name: started(*args) for name, args in works.items() if name not in readers}
    refusals = {name: started(*args) for name, (args, _) in needs.items()}
    for name in works:  # simulate first
        done = finished(running.pop(name))
        assert done.returncode == 0, f"{name}: {done.stderr}"
        if name == "simulate":
            running |= {reader: started(*works[reader]) for reader in readers}
    for name, (_, hint) in needs.items():
        done = finished(refusals[name])
        assert done.returncode == 2 and "Traceback" not in done.stderr, f"{name}: {done.stderr}"
        assert len(done.stderr.strip().splitlines()) == 1 and hint in done.stderr, f"{name}: {done.stderr}"
    assert not any((tmp_path / name).exists() for name in ("g.json", "m.json", "s.json", "e.json", "r.parquet"))
