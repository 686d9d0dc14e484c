"""The early pytest (tests/conftest.py, `RUN_EARLY`) ends, with all it started, and its folder is removed, however the
session that started it ends: a SIGTERM, which pytest does not handle, ends that session at once, without its
`pytest_sessionfinish`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

# A test that runs early: it starts a process in its group, says the group and the early pytest's folder, then waits
# longer than the test does.
EARLY_TEST = """
import os, subprocess, time
RUN_EARLY = True

def test_waits(tmp_path):
    subprocess.Popen(["sleep", "300"])
    with open(os.environ["GROUP_FILE"] + ".part", "w") as group:
        group.write(f"{os.getpgid(0)} {os.path.dirname(os.environ['PIPESIM_TEST_EARLY_REPORTS'])}")
    os.rename(os.environ["GROUP_FILE"] + ".part", os.environ["GROUP_FILE"])
    time.sleep(300)
    assert False
"""


def live_members(group: int) -> list[int]:
    """The processes of process group `group` that have not ended (a zombie, ended but not yet reaped, has)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, _, rest = stat.read_text().partition(" (")
        except OSError:  # ended while listed
            continue
        state, _, pgrp = rest.rpartition(") ")[2].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(int(pid))
    return members


def test_a_sigterm_to_the_session_ends_the_early_pytest_and_its_processes_and_removes_its_folder(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_early.py").write_text(EARLY_TEST)
    group_file = tmp_path / "group"
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTEST_", "PIPESIM_TEST_"))}  # a session of its own, not an xdist worker
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", tmp_path],
                               cwd=tmp_path, env=dict(env, GROUP_FILE=str(group_file)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # the early pytest started and its test is waiting (at most 60 s)
            if group_file.exists() or session.poll() is not None:
                break
            time.sleep(0.1)
        assert group_file.exists(), f"the early test never started (session exit code {session.returncode})"
        said_group, folder = group_file.read_text().split()
        group = int(said_group)
        assert Path(folder, "output.txt").exists()
        assert len(live_members(group)) == 2  # the early pytest and the process its test started
        session.send_signal(signal.SIGTERM)
        assert session.wait(timeout=30) == -signal.SIGTERM
        for _ in range(100):  # at most 10 s
            if not live_members(group):
                break
            time.sleep(0.1)
        assert live_members(group) == []
        assert not Path(folder).exists()
    finally:  # nothing left behind where the test failed
        session.kill()
        session.wait()
        for pid in live_members(int(group_file.read_text().split()[0])) if group_file.exists() else []:
            os.kill(pid, signal.SIGKILL)
