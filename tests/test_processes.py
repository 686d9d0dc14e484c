"""Rank processes forked from the forkserver: each runs with the environment its parent had when it was made
(not the server's), its own thread count and SIGINT ignored; the server has imported torch and all a first
backward imports, without starting a thread; where forkserver is missing or its server fails, ranks are
spawned, with one line why.

This module imports no torch at its top: a forked rank that finds torch loaded got it from the server."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest

from pipesim.workload import processes
from tests.conftest import needs_transformers


def _report(out, *_) -> None:
    """A rank's view of itself: a variable the test sets, its threads, its SIGINT handler, whether torch was
    preloaded, the modules its first backward from a given gradient imported (as every stage's but the last
    does; 27-48 ms of a short run's stage 0 when torch's symbolic shapes were not preloaded), and how many
    threads its parent runs (for a forked rank, the server)."""
    preloaded = "torch" in sys.modules
    import torch

    before = set(sys.modules)
    weight = torch.ones(3, requires_grad=True)
    torch.autograd.backward([weight * 2.0], [torch.ones(3)])
    imported = sorted(set(sys.modules) - before)
    parent_threads = len(os.listdir(f"/proc/{os.getppid()}/task")) if Path("/proc").exists() else None
    out.put((os.environ.get("PIPESIM_TEST_PROCESSES"), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(),
             signal.getsignal(signal.SIGINT) == signal.SIG_IGN, preloaded, imported, parent_threads))


def _run_one(threads: int, *more) -> tuple:
    context = processes.rank_context()
    out = context.Queue()
    proc = processes.rank_process(context, _report, (out, *more), "pipesim-test-rank", threads)
    processes.start_processes([proc], threads)
    try:
        return out.get(timeout=60)
    finally:
        proc.join(timeout=10)


def test_a_rank_gets_the_environment_of_its_making_and_its_threads_and_ignores_sigint(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # ranks import this module
    processes.ready()  # the server starts with the environment of now, before the variable is set
    seen = []
    for value, threads in (("first", 1), ("second", 2)):
        monkeypatch.setenv("PIPESIM_TEST_PROCESSES", value)
        seen.append(_run_one(threads))
    assert [s[:4] for s in seen] == [("first", "1", 1, True), ("second", "2", 2, True)]
    if processes._STARTER.method == "forkserver" and Path("/proc").exists():
        assert all(s[4] for s in seen)  # imported once, by the server
        assert [s[5] for s in seen] == [[], []]  # and what the first backward imports
        assert all(s[6] == 1 for s in seen)  # it forks without a thread (OpenMP's pool) besides its own


def test_a_spawned_rank_has_what_its_first_backward_imports_before_its_work(monkeypatch):
    """Where ranks are spawned, a rank whose target brings torch (as the executor's does; here a tensor among its
    arguments) imports what its first backward would before its work, as a forked rank has it from the server."""
    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # ranks import this module
    monkeypatch.setattr(processes._STARTER, "method", "spawn")
    seen = _run_one(1, torch.zeros(1))
    assert seen[4] and seen[5] == []


def _loaded(out, modules: list[str]) -> None:
    """A rank's report of which of `modules` it holds as it starts its work."""
    out.put([name in sys.modules for name in modules])


@needs_transformers
def test_a_hugging_face_configs_ranks_are_forked_with_transformers_model_code_imported():
    """Each rank of `run --model hf:PATH` imported transformers' model code itself (4.3 s of a quiet core, the two
    ranks' side by side on 2 cores): the server imports it once (`build_imports`), before its last preload, which
    must stay last. A fresh process, for a server of its own; a rank's view as its work starts."""
    import subprocess
    import textwrap

    from pipesim.workload.hfconfig import build_imports

    assert build_imports("mlp") == () and build_imports("pkg.mod:model") == ()
    script = textwrap.dedent("""
        import sys
        from multiprocessing import forkserver
        from pipesim.workload import processes
        from pipesim.workload.hfconfig import build_imports
        from tests.test_processes import _loaded
        processes.prepare(build_imports("hf:examples/llama3.1-8b"))
        context = processes.rank_context()
        out = context.Queue()
        names = ["transformers.modeling_utils", "pipesim.workload.hf"]
        proc = processes.rank_process(context, _loaded, (out, names), "pipesim-test-rank", 1)
        processes.start_processes([proc], 1)
        print(processes._STARTER.method, out.get(timeout=60), forkserver._forkserver._preload_modules[-1])
        proc.join(timeout=10)
    """)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "forkserver [True, True] pipesim.workload.server_exit", done.stdout


@pytest.mark.parametrize("broken", ["platform", "start", "answer"])
def test_without_a_working_forkserver_ranks_are_spawned_with_one_line_why(monkeypatch, capsys, broken):
    if broken == "platform":
        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    elif broken == "start":
        def refuse() -> None:
            raise OSError("no room for a socket")
        monkeypatch.setattr(forkserver, "ensure_running", refuse)
    else:
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the process imports this module
        monkeypatch.setattr(processes, "_server_ready", _exit_3)
    starter = processes._Starter()
    assert starter.ready() == "spawn" and starter.ready() == "spawn"
    err = capsys.readouterr().err
    why = {"platform": "has no forkserver", "start": "no room for a socket", "answer": "exited with code 3"}[broken]
    assert err.count("\n") == 1 and err.startswith("note: rank processes are spawned") and why in err


def _exit_3() -> None:
    os._exit(3)


def test_ctrl_c_while_the_forkserver_imports_interrupts_the_wait():
    """Ctrl-C while `ready` waits for the forkserver's imports (seconds of torch's) raises KeyboardInterrupt: it
    was ignored there, so the signal was lost and `pipesim study`, interrupted while it calibrated, went on to
    train and exited 0. A fresh process, for a server still importing; the SIGINT comes 0.2 s into the wait."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import os, signal, threading
        from pipesim.workload import processes
        processes.prepare()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            processes.ready()
        except KeyboardInterrupt:
            print("interrupted")
        else:
            print("ready")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.stdout.strip() == "interrupted", (done.stdout, done.stderr)


def test_ctrl_c_while_torch_imports_is_raised_once_it_has_imported():
    """Ctrl-C during a command's import of torch (`require`) is raised after it, not inside: raised inside, where
    torch's C++ ran Python (pybind11), it aborted the process (exit -6, "terminate called after throwing an instance
    of 'pybind11::error_already_set'": seen once in `pipesim calibrate`'s Ctrl-C test under load) where the command
    exits 130. A fresh process, torch not yet imported; the SIGINT comes 0.1 s into its import (seconds)."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import os, signal, sys, threading
        from pipesim.commands.common import require
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            require("pipesim calibrate", "torch")
        except KeyboardInterrupt:
            print("interrupted after the import" if "torch" in sys.modules else "interrupted inside the import")
        else:
            print("not interrupted")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.stdout.strip() == "interrupted after the import", (done.stdout, done.stderr)


def _group(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (zombies left out), by /proc: each one's command line."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            state_and_group = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_text().replace("\0", " ")
        except (OSError, IndexError):  # not a process, or one gone meanwhile
            continue
        if int(state_and_group[2]) == pgid and state_and_group[0] != "Z":
            alive.append(command)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from Linux's /proc")
def test_ctrl_c_while_the_forkserver_imports_leaves_no_process_behind(tmp_path):
    """Ctrl-C of `pipesim calibrate` while its forkserver still imported torch: the command exited (130), and the
    server imported on, 1.7-8 s on the 2-core host, its stderr the terminal's. The command ends it first (cli.main
    calls `processes.stop`, as a process ending does), with the resource tracker: none of its process group is
    left the moment it has exited. Its own session, so that the SIGINT reaches its group alone, as a terminal's."""
    import subprocess
    import time

    command = [sys.executable, "-c", "from pipesim.cli import main; main()", "calibrate", "--model", "mlp", "--out",
               str(tmp_path / "p.json")]
    with open(tmp_path / "err.txt", "w") as err:  # a file, not a pipe: a pipe's end would wait for the server too
        # a terminal's command starts with SIGINT's default, whatever this test process started with (a shell's
        # background job, as CI's, has SIGINT ignored; that is inherited through exec, and Python keeps it ignored)
        proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not any("forkserver" in line for line in _group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # past the server's start, around which SIGINT is ignored; its imports take seconds more
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        left = _group(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, left) == (130, []), (tmp_path / "err.txt").read_text()


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="signal masks are POSIX's")
def test_a_ctrl_c_while_processes_start_is_raised_after_not_lost():
    """The forkserver and the ranks start with SIGINT held off (`_sigint_deferred`); a Ctrl-C meanwhile is raised
    once they have started. Ignored there instead, it was dropped: `pipesim calibrate` interrupted as its
    forkserver started went on to exit 0 (3 of 8 tries on the 2-core host)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal's Python handler runs in the main thread")
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a command's, even as a background job
    try:
        with pytest.raises(KeyboardInterrupt):
            with processes._sigint_deferred():
                # to this thread: sent to the process, the kernel hands it to a thread that does not block it (an
                # xdist worker's I/O thread), and Python raises it here at once, or after this test has ended
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # held off here: nothing is raised inside
                assert signal.SIGINT in signal.sigpending()
    finally:
        signal.signal(signal.SIGINT, handler)
