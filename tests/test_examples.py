"""The files under examples/ that the README's commands name are accepted by those commands; and examples/
stays in the repository, out of the installed package, whose package list names every package folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import pipesim

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("args,check", [
    (("simulate", "-s", "1f1b", "--cluster", EXAMPLES / "cluster.json", "--output-mb", 32, "--json"),
     lambda doc: [d["memory_limit_mb"] for d in doc["results"][0]["devices"]] == [80 * 1024] * 4),
    (("simulate", "-s", "graphpipe", "--graph", EXAMPLES / "dag.json", "--json"),
     lambda doc: len(doc["results"][0]["devices"]) == 6),
    (("simulate", "--schedule-file", EXAMPLES / "order.csv", "--json"),  # torch's own dump, transfers and all
     lambda doc: len(doc["results"][0]["devices"]) == 2 and doc["results"][0]["bubble_fraction"] > 0),
])
def test_each_example_file_is_accepted_by_its_command(args, check):
    code, out, err = pipesim(*args)
    assert code == 0, err
    assert check(json.loads(out))


def test_the_example_grid_sweeps_every_axis_it_names(tmp_path):
    results = tmp_path / "r.csv"
    code, _, err = pipesim("sweep", "--grid", EXAMPLES / "grid.toml", "-j", 1, "--out", results)
    assert code == 0, err
    rows = results.read_text().splitlines()
    header = rows[0].split(",")
    schedules = {row.split(",")[header.index("schedule")] for row in rows[1:]}
    assert schedules == {"1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "pipedream"}
    # p, m, cost scale; three methods once, zb-v at its one v (2), interleaved-1f1b per v less v = 1 (1f1b's run,
    # 1f1b's row)
    assert len(rows) - 1 == 2 * 2 * 2 * (3 + 1 + 2 - 1)


def test_examples_are_in_the_repository_but_not_in_the_installed_package():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {f"pipesim.{init.parent.name}" for init in ROOT.glob("*/__init__.py")}
    assert packages == {"pipesim", *folders}  # every package folder installs
    assert {"cluster.json", "dag.json", "order.csv", "grid.toml"} <= {p.name for p in EXAMPLES.iterdir()}
    assert not (EXAMPLES / "__init__.py").exists() and "pipesim.examples" not in packages


def test_the_own_model_example_is_a_model_the_docs_commands_count(monkeypatch):
    """docs/hardware.md and docs/calibrate.md bring a model of their own as `--model examples.own_model:build`, run
    from a folder holding examples/ (the repository's root, or the docs runner's folder)."""
    monkeypatch.chdir(ROOT)
    code, out, err = pipesim("count", "--model", "examples.own_model:build", "-b", 8, "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert len(layers) == 5 and sum(layer["param_bytes"] for layer in layers) > 0
