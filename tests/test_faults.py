"""Faults in `pipesim run`: a rank killed or stopped mid-run, and Ctrl-C. The command stops every rank, names
the one at fault and its last action, writes the incomplete trace, and leaves no process behind.

The fault is injected deterministically with PIPESIM_TEST_FAULT=RANK:ROWS:SIGNAL (test-only, read by the rank
wrapper in executor/runners.py): rank RANK sends itself SIGNAL after its ROWS-th row.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipesim.executor.runners import FAULT_ENV
from pipesim.schedules import lower
from pipesim.traces import read_trace
from pipesim.traces.metrics import summarize
from tests.conftest import build

pytestmark = pytest.mark.slow

MINIBATCHES = 1000  # far longer than a test waits: every run here ends by its fault
RUN = ["--schedule", "1f1b", "--model", "mlp", "--layers", "3", "--width", "64", "--stages", "2",
       "--microbatches", "4", "--minibatches", str(MINIBATCHES)]
BOUND_S = 60  # a hung command fails the test here (start-up included) instead of hanging the suite


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _children(pid: int) -> set[int]:
    """The processes `pid` started and theirs (ranks are forked by the forkserver the command starts)."""
    parents = _parents()
    found, new = set(), {pid}
    while new:
        new = {child for child, parent in parents.items() if parent in new} - found
        found |= new
    return found


def _is_rank(pid: int) -> bool:
    """A spawned rank, or one forked by the forkserver."""
    try:
        parent = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return False
    return "spawn_main" in _cmdline(pid) or "forkserver" in _cmdline(parent)


def _state(pid: int) -> str:
    """The process's state letter (R running, S sleeping, T stopped, Z a zombie), "" once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running or stopped (a zombie has ended)."""
    return _state(pid) not in ("", "Z")


def _launch(tmp_path: Path, fault: str | None, stall_timeout_s: int = 3, *flags: str) -> subprocess.Popen:
    env = {name: value for name, value in os.environ.items() if name != FAULT_ENV}
    if fault is not None:
        env[FAULT_ENV] = fault
    # SIGINT as a terminal's foreground command has it: a shell's background job (CI started with `&`) would
    # hand down SIGINT ignored, and Ctrl-C would then mean nothing to the command
    return subprocess.Popen([sys.executable, "-m", "pipesim.cli", "run", *RUN, "--stall-timeout",
                             str(stall_timeout_s), "--trace", str(tmp_path / "t.json"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _watch(proc: subprocess.Popen, until=None) -> set[int]:
    """Every process the command started (its children, the ranks among them), polled until it exits or
    `until(seen)` says to stop watching."""
    seen: set[int] = set()
    deadline = time.monotonic() + BOUND_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _children(proc.pid)
        if until is not None and until(seen):
            break
        time.sleep(0.05)
    return seen


def _none_left(pids: set[int]) -> bool:
    deadline = time.monotonic() + 10  # the ranks are reaped already; give stragglers (resource tracker) a moment
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("fault, message, flags", [
    ("1:60:KILL", "rank 1 was killed by signal 9 (last action 1", ("--json",)),
    ("1:12:STOP", "rank 1 made no progress for 3 s (last action 1", ()),
])
def test_a_rank_that_dies_or_stops_ends_the_run(tmp_path, fault, message, flags):
    """With --json the standard output holds its document or nothing: "wrote t.json (incomplete)" was there, and
    `| jq` failed on it."""
    proc = _launch(tmp_path, fault, 3, *flags)
    seen = _watch(proc)
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 1, err
    assert message in err and "Traceback" not in err
    wrote = f"wrote {tmp_path / 't.json'} (incomplete)"
    assert (out, wrote in err) == ("", True) if flags else wrote in out, (out, err)
    assert len(seen) >= 2 and _none_left(seen)
    trace = read_trace(tmp_path / "t.json")
    assert not trace.meta.complete and trace.meta.failed_rank == 1
    all_rows = len(lower(build("1f1b", 2, 4, MINIBATCHES)).table.kind)
    assert 0 < (trace.ops.device == 1).sum() and len(trace.ops) < all_rows  # what ran before the fault
    # and its memory until then, a sample at each of its rows' ends at least (it was one sample of 0: "13.8 / 0")
    memory = trace.counters["memory_bytes"][1]
    assert len(memory.values) > (trace.ops.device == 1).sum() and summarize(trace).devices[1].peak_memory_mb > 0
    # and the loss of each mini-batch both ranks finished, which rank 1, the last stage, computed (all were lost)
    finished = [loss for loss in trace.meta.extra["losses"][0] if not math.isnan(loss)]
    opts = trace.ops.kind == trace.kinds.index("OPT")
    assert len(finished) == min(np.bincount(trace.ops.device[opts], minlength=2)) and all(map(math.isfinite, finished))
    if fault.endswith("KILL"):  # after 60 of its rows: its first mini-batches done
        assert len(finished) >= 2


def test_a_rank_spinning_in_a_wait_on_a_peer_is_stalled_not_working(tmp_path):
    """A host spinning in a receive (gloo, a CUDA event) burns a core without progress: the run is stalled
    after --stall-timeout, not left to the transfer timeout (120 s, past BOUND_S)."""
    proc = _launch(tmp_path, "1:12:SPIN")
    seen = _watch(proc)
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 1, err
    # the rank that stalled first, named with the wait it is in (rank 0's receive from the spinning rank 1)
    assert re.search(r"rank (\d) made no progress for 3 s \(last action \S+; waiting on rank \1: ", err), err
    assert "Traceback" not in err
    assert len(seen) >= 2 and _none_left(seen)


def test_ctrl_c_ends_every_rank(tmp_path):
    """No stall limit within reach: a rank held off the CPU a few seconds on a loaded host must not end it first."""
    proc = _launch(tmp_path, None, stall_timeout_s=10 * BOUND_S)
    ranks = _watch(proc, until=lambda seen: sum(map(_is_rank, seen)) >= 2)
    time.sleep(2)  # into the run
    ranks |= _children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C: the whole foreground group
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert _none_left(ranks)


def test_ctrl_c_keeps_what_was_measured(tmp_path):
    """Ctrl-C writes the rows the ranks reported as an incomplete trace, as a failed rank's are kept, then
    exits 130. Rank 1 stops itself after 12 rows (and the stall limit is far off), so the run is mid-way, with a
    known count of rows measured, when Ctrl-C comes."""
    proc = _launch(tmp_path, "1:12:STOP", stall_timeout_s=10 * BOUND_S)
    ranks = _watch(proc, until=lambda seen: any(_is_rank(pid) and _state(pid) == "T" for pid in seen))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert f"wrote {tmp_path / 't.json'} (incomplete)" in out
    trace = read_trace(tmp_path / "t.json")
    assert not trace.meta.complete and trace.meta.failed_rank is None
    assert (trace.ops.device == 1).sum() == 12 and (trace.ops.device == 0).sum() > 0
    assert _none_left(ranks)


# The terminal's Ctrl-C, sent the moment the command first imports torch (its ranks not started yet)
CTRL_C_AT_TORCH = """
import os, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlC())
from pipesim.cli import main
main(sys.argv[1:])
"""


def test_ctrl_c_while_run_imports_torch_is_one_line(tmp_path):
    """Ctrl-C in a run's first seconds, while it imports torch, ended in an UnboundLocalError traceback (the
    executor's error class, imported after torch, named by an except clause)."""
    proc = subprocess.run([sys.executable, "-c", CTRL_C_AT_TORCH, "run", *RUN, "--trace", str(tmp_path / "t.json")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=BOUND_S,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-2:] == [
        f"note: --trace {tmp_path / 't.json'}: not written, the run was interrupted before its ranks started",
        "interrupted"] and "Traceback" not in proc.stderr  # it said "interrupted" alone of the trace asked for
    assert not (tmp_path / "t.json").exists()


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_text()
    except OSError:
        return ""
