"""Installed without extras (`pip install -e .` into a fresh venv that cannot see this one's packages, so no
torch, scikit-learn, pyarrow or ray), every pipesim command either works or, where it needs an extra, says
in one line how to install it and exits 2, with no traceback. Needs the package index (or pip's cache).

The venv is made and the commands run as the session starts (`start_early`), in a process of their own, this
file run as a script: they use the core the tests before this one leave idle, and the test reads what they did."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_HINT = "pip install 'pipesim[torch]'"


def commands(folder: Path) -> tuple[dict[str, tuple], dict[str, tuple[tuple, str]]]:
    """The commands run in `folder`: those that work without extras by name, and those that need one by name,
    with the hint they must print."""
    trace, profile = folder / "t.json", ROOT / "traces" / "profiles" / "gpt-cpu.json"
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
    return works, needs


def run_bare(home: Path, folder: Path) -> dict[str, Any]:
    """Make a fresh venv in `home` with pipesim installed editable and only its required dependencies, then run
    in `folder`, with its `pipesim`: the extras it finds, `--help`, and every command of `commands`, side by side,
    each its own process (view and compare, which read simulate's trace, start once simulate is done; the
    refusals write and read nothing). What each printed: "missing" (the extras' names), "help", "works" and
    "needs" by name, each a (code, stdout, stderr)."""
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(home)
    bare = home / "bin"
    # --no-compile: byte-compiling every installed module (plotly's thousands) costs more than the modules the
    # commands below import compile on first use (install 20.6 -> 15.5 s, first simulate --html +0.3 s)
    subprocess.run([bare / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                    "-e", ROOT], check=True, capture_output=True, timeout=600)
    missing = subprocess.run([bare / "python", "-c", "import importlib.util as u; print([m for m in "
                              "('torch', 'sklearn', 'pyarrow', 'ray') if u.find_spec(m)])"],
                             capture_output=True, text=True, check=True)

    def started(*args) -> subprocess.Popen:
        return subprocess.Popen([bare / "pipesim", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=folder)

    def finished(process: subprocess.Popen) -> tuple[int, str, str]:
        out, err = process.communicate(timeout=300)
        return process.returncode, out, err

    done = {"missing": missing.stdout, "help": finished(started("--help")), "works": {}}
    works, needs = commands(folder)
    readers = ("view", "compare")
    running = {name: started(*args) for name, args in works.items() if name not in readers}
    refusals = {name: started(*args) for name, (args, _) in needs.items()}
    for name in works:  # simulate first
        done["works"][name] = finished(running.pop(name))
        if name == "simulate":
            running |= {reader: started(*works[reader]) for reader in readers}
    done["needs"] = {name: finished(process) for name, process in refusals.items()}
    return done


BARE_RUNS = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def start_early(session: pytest.Session, tmp_path_factory: pytest.TempPathFactory) -> subprocess.Popen | None:
    """`run_bare`'s process, started as the session starts (conftest.py's `started_early`) where the test is
    selected."""
    if not any(item.originalname == "test_every_command_runs_or_names_the_extra_it_needs" for item in session.items):
        return None
    home, folder = tmp_path_factory.mktemp("bare-venv"), tmp_path_factory.mktemp("bare-commands")
    runs = subprocess.Popen([sys.executable, __file__, str(home), str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    session.stash[BARE_RUNS] = runs, folder
    return runs


@pytest.mark.slow
def test_every_command_runs_or_names_the_extra_it_needs(request):
    runs, folder = request.session.stash[BARE_RUNS]
    out, err = runs.communicate(timeout=1800)
    assert runs.returncode == 0, err
    done = json.loads(out)
    assert done["missing"].strip() == "[]"  # the venv sees none of the extras
    code, help_out, help_err = done["help"]
    assert code == 0, help_err
    listed = set(re.findall(r"^  (\w+)  ", help_out, re.MULTILINE))
    works, needs = commands(folder)
    assert listed == set(works) | {name.split()[0] for name in needs}  # every command is tried
    for name in works:
        code, _, err = done["works"][name]
        assert code == 0, f"{name}: {err}"
    for name, (_, hint) in needs.items():
        code, _, err = done["needs"][name]
        assert code == 2 and "Traceback" not in err, f"{name}: {err}"
        assert len(err.strip().splitlines()) == 1 and hint in err, f"{name}: {err}"
    assert not any((folder / name).exists() for name in ("g.json", "m.json", "s.json", "e.json", "r.parquet"))


if __name__ == "__main__":  # `start_early`'s process: `run_bare`'s outcome printed as JSON
    print(json.dumps(run_bare(Path(sys.argv[1]), Path(sys.argv[2]))))
