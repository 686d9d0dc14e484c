"""The house rules of docs/architecture.md, read off every module's imports (ast), function-level ones too.

The two shared vocabularies (schedules/, traces/) import nothing of ours; profiles are pure data; nothing
on the simulator's side imports torch; the torch side (workload/, calibrate/, executor/) never imports
the simulator or the planners. `units` (constants), `files` (reading user files), `choices` (the refusal of a
value outside a fixed few), `launch` (how this process was started) and `memory_parts` (the names of a device's
memory parts) are leaves anyone may import; a leaf imports no other but `choices`, which imports none.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schedules", "traces", "profiles", "hardware", "sim", "planning", "workload", "calibrate", "executor",
            "study", "commands")
LEAVES = {"units", "files", "launch", "memory_parts", "choices"}
OURS = {*PACKAGES, "cli", *LEAVES}

# package -> import prefixes (ours as "pipesim.x", third-party by name) it must never import, and why.
FORBIDDEN = {
    "schedules": ({f"pipesim.{p}" for p in OURS - {"schedules", *LEAVES}} | {"torch", "simpy", "plotly"},
                  "a shared vocabulary"),
    "traces": ({f"pipesim.{p}" for p in OURS - {"traces", *LEAVES}} | {"torch", "simpy"}, "a shared vocabulary"),
    "profiles": ({f"pipesim.{p}" for p in OURS - {"profiles", *LEAVES}} | {"torch", "simpy", "plotly"},
                 "pure profile data"),
    "hardware": ({f"pipesim.{p}" for p in OURS - {"hardware", *LEAVES}} | {"torch", "simpy", "plotly"},
                 "pure catalogue data"),
    "sim": ({"pipesim.study", "pipesim.planning", "pipesim.workload", "pipesim.calibrate", "pipesim.executor",
             "pipesim.commands", "pipesim.cli", "torch", "plotly"}, "the simulator never imports torch"),
    "planning": ({"pipesim.study", "pipesim.workload", "pipesim.calibrate", "pipesim.executor", "pipesim.commands",
                  "pipesim.cli", "torch"}, "planning runs on the simulator, without torch"),
    "workload": ({"pipesim.study", "pipesim.sim", "pipesim.planning", "pipesim.calibrate", "pipesim.executor",
                  "pipesim.commands", "pipesim.cli"}, "the torch side never imports the simulator"),
    "calibrate": ({"pipesim.study", "pipesim.sim", "pipesim.planning", "pipesim.commands", "pipesim.cli"},
                  "measurement never imports the simulator (it times the executor's own code)"),
    "executor": ({"pipesim.study", "pipesim.sim", "pipesim.planning", "pipesim.calibrate", "pipesim.commands",
                  "pipesim.cli"}, "the executor never imports the simulator or measurement"),
    "study": ({"pipesim.commands", "pipesim.cli"}, "the study is the commands' to drive"),
    # a leaf imports no other but `choices`, which imports nothing of ours (files' refusals of an unknown field)
    **{leaf: ({f"pipesim.{p}" for p in OURS - {leaf, "choices"}}, "a leaf") for leaf in LEAVES - {"choices"}},
    "choices": ({f"pipesim.{p}" for p in OURS - {"choices"}}, "a leaf that imports no other"),
}


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved against its package."""
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    package = ["pipesim", *path.relative_to(ROOT).parent.parts]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{module}.{alias.name}" if node.level and not node.module else module)
                      for alias in node.names]
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    rel = path.relative_to(ROOT)
    layer = rel.parts[0].removesuffix(".py")
    if layer not in FORBIDDEN:
        return []
    forbidden, why = FORBIDDEN[layer]
    return [f"{rel}:{line} imports {module} ({layer}: {why})" for line, module in imports(path, source)
            if any(module == f or module.startswith(f + ".") for f in forbidden)]


def modules() -> list[Path]:
    return sorted(p for name in (*PACKAGES, *(f"{leaf}.py" for leaf in LEAVES)) for p in
                  ((ROOT / name).rglob("*.py") if (ROOT / name).is_dir() else [ROOT / name]) if p.exists())


def test_no_module_imports_across_a_forbidden_arrow():
    found = [v for path in modules() for v in violations(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("where,source", [
    ("workload/models.py", "import pipesim.sim\n"),
    ("calibrate/links.py", "def f():\n    from ..sim.engine import simulate\n"),
    ("executor/runtime.py", "from ..calibrate.measure import calibrate\n"),
    ("schedules/ir.py", "from ..traces import Trace\n"),
    ("traces/view.py", "from pipesim.schedules import Kind\n"),
    ("sim/engine.py", "def price():\n    import torch\n"),
    ("profiles/schema.py", "import simpy\n"),
])
def test_the_check_catches_a_forbidden_import(where, source):
    assert violations(ROOT / where, source), f"{source!r} in {where} went unnoticed"


def test_allowed_imports_pass():
    assert not violations(ROOT / "sim/engine.py", "from ..schedules.lowering import lower\nfrom ..units import MIB\n")
    assert not violations(ROOT / "workload/optim.py", "from ..profiles.schema import OPTIMIZERS\nimport torch\n")


def test_simulate_and_planning_start_without_torch():
    probe = ("import sys\nimport pipesim.cli, pipesim.commands.simulate, pipesim.planning.scenario, "
             "pipesim.planning.sweep, pipesim.planning.tune, pipesim.sim, pipesim.traces.view\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'simpy')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "torch" not in out and "simpy" in out  # the probe ran the imports and saw the simulator's
