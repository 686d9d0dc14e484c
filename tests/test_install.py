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

from tests.conftest import fresh_process

ROOT = Path(__file__).resolve().parents[1]
TORCH_HINT = "pip install 'pipesim[torch]'"
RUN_EARLY = True  # first (conftest.py): a venv and its processes


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

    help_text = subprocess.run([bare / "pipesim", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert help_text.returncode == 0, help_text.stderr
    listed = set(re.findall(r"^  (\w+)  ", help_text.stdout, re.MULTILINE))
    trace, profile = tmp_path / "t.json", ROOT / "traces" / "profiles" / "gpt-cpu.json"
    works = {
        "simulate": ("simulate", "-s", "1f1b", "-p", 2, "-m", 2, "--json", "--trace", trace),
        "schedules": ("schedules",),
        "export": ("export", "-s", "1f1b", "-p", 2, "-m", 2, "--format", "torch-csv", "-o", "o.csv"),
        "sweep": ("sweep", "-s", "1f1b,gpipe", "-p", 2, "-m", 2, "-j", 1, "--out", "r.csv", "--html", "s.html"),
        "tune": ("tune", "--profile", profile, "--devices", 2, "--memory-gb", 1),
        "view": ("view", trace, "--html", "v.html"),  # view and compare read simulate's trace
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
    # One process of the bare venv's runs the commands one after another as its `pipesim` runs each (the console
    # script's start is --help's above): a process's start and imports, compiled where this venv's are not, once.
    (runs, _), _ = fresh_process([*works.values(), *(args for args, _ in needs.values())], tmp_path,
                                 python=bare / "python", timeout_s=600)
    for name, (code, _, err) in zip(works, runs):
        assert code in (None, 0), f"{name}: {err}"
    for (name, (_, hint)), (code, _, err) in zip(needs.items(), runs[len(works):]):
        assert code == 2 and "Traceback" not in err, f"{name}: {err}"
        assert len(err.strip().splitlines()) == 1 and hint in err, f"{name}: {err}"
    assert not any((tmp_path / name).exists() for name in ("g.json", "m.json", "s.json", "e.json", "r.parquet"))
