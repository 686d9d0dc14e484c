"""Starting the processes that stand for a run's ranks (the executor's, calibration's contention probe and link
measurement).

A spawned interpreter imports torch and the executor for every rank: seconds per start on a loaded 2-core host.
So ranks are forked from a forkserver that imported them once; a command starts it first thing (`prepare`), so
that its imports overlap the command's own, and waits for it (`ready`) before anything it times. A rank also
has what its first backward from a given gradient would import (`FIRST_BACKWARD`) before its work, from the
server or, spawned, on its own: 27-48 ms on the 2-core host, all in stage 0's first B otherwise (32-48 ms
against 3-4 ms after), which a short run carries and calibration, timing warm passes, never sees. Where
forkserver is missing (Windows, and macOS's default is spawn) or its server fails to start, ranks are spawned,
with one line saying why. A forked rank has the server's environment, not the parent's, so every process
carries the parent's environment and applies it before its work.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_PACKAGE = __name__.rsplit(".", 2)[0]
# torch 2.13's `_make_grads` imports it (and sympy) on the first backward given a gradient: every stage's but the last
FIRST_BACKWARD = "torch.fx.experimental.symbolic_shapes"
PRELOAD = ["torch", FIRST_BACKWARD, f"{_PACKAGE}.executor.runners", f"{_PACKAGE}.calibrate.contention",
           f"{_PACKAGE}.calibrate.links", f"{_PACKAGE}.workload.server_exit"]  # the last: it exits first
READY_TIMEOUT_S = 120.0  # the server's imports on a loaded machine
HEARTBEAT_S = 0.2  # a rank reports to the parent at most this often (executor/runners.py)
# The least --stall-timeout: the parent hears of a rank's progress at its heartbeats alone, so a limit of a few of
# them would call a rank stalled between two (one run at 0.03 s was stopped as stalled after it had run every row)
STALL_LEAST_S = 5 * HEARTBEAT_S


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile: a process started now, spawned or the forkserver, starts with it
    blocked, so that a Ctrl-C (it reaches the whole terminal group) cannot end it through its imports (the server
    ignores it once they are done, which drops one pending), and the parent alone answers it, by ending them all.
    One that comes meanwhile waits, and is raised here once this ends; ignored instead, it was dropped (another
    thread of this process takes a signal this one blocks, and ignored it there too): a Ctrl-C as the forkserver
    started was lost, and `pipesim calibrate` went on to exit 0 (3 of 8 tries). Where there are no signal masks
    (Windows, which spawns its ranks), ignored as before."""
    if hasattr(signal, "pthread_sigmask"):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """A Ctrl-C meanwhile is raised once this ends, not inside it. For torch's import: it runs Python from C++
    (pybind11), where a KeyboardInterrupt aborts the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'", exit -6) where the command should exit 130. Blocking SIGINT in this thread is
    not enough: another thread (rich's status) takes it, and Python raises it here all the same. Outside the main
    thread, which alone may set handlers, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:  # a handler set outside Python reads as None: restored as the default
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if came:  # as it would have been taken: raised (Python's handler), ended (the default) or ignored
            signal.raise_signal(signal.SIGINT)


def _server_ready() -> None:
    """What the first process forked from the server runs: nothing (it returns once the imports are done)."""


class _Starter:
    """The start method of this process's ranks: forkserver once its server answered, else spawn."""

    def __init__(self) -> None:
        self.method: str | None = None  # chosen by `ready`
        self.started = False
        self.lock = threading.Lock()

    def prepare(self, also: Sequence[str] = ()) -> None:
        """Start the forkserver, its imports (`PRELOAD`, `also` before its last) included, without waiting for it.
        A server already started keeps the imports it started with."""
        with self.lock:
            if self.started or self.method is not None:
                return
            if "forkserver" not in multiprocessing.get_all_start_methods():
                self._fall_back("this platform has no forkserver")
                return
            from multiprocessing import forkserver, resource_tracker

            forkserver.set_forkserver_preload([*PRELOAD[:-1], *also, PRELOAD[-1]])
            try:
                resource_tracker.ensure_running()  # first: its start unblocks SIGINT, which the server's must not
                with _sigint_deferred():
                    forkserver.ensure_running()
            except (OSError, ValueError) as exc:
                self._fall_back(f"the forkserver did not start ({exc})")
                return
            self.started = True

    def ready(self) -> str:
        """The start method, once the forkserver (started here if `prepare` was not called) has finished its
        imports: one process is forked from it and joined. Ctrl-C meanwhile raises KeyboardInterrupt here: the
        probe is forked by the server, whose SIGINT is ignored, so nothing here need ignore it (ignored, a Ctrl-C
        during the server's seconds of imports was lost, and the command went on)."""
        self.prepare()
        with self.lock:
            if self.method is not None:
                return self.method
            context = multiprocessing.get_context("forkserver")
            probe = context.Process(target=_server_ready, name="pipesim-forkserver-ready", daemon=True)
            try:
                probe.start()
                probe.join(READY_TIMEOUT_S)
            except OSError as exc:
                self._fall_back(f"the forkserver did not answer ({exc})")
                return self.method
            if probe.exitcode != 0:
                if probe.is_alive():
                    probe.kill()
                    probe.join()
                    self._fall_back(f"the forkserver did not answer within {READY_TIMEOUT_S:g} s")
                else:
                    self._fall_back(f"a process forked from the forkserver exited with code {probe.exitcode}")
                return self.method
            self.method = "forkserver"
            return self.method

    def stop(self) -> None:
        """End the forkserver now, whatever it is doing, and the resource tracker started with it, and reap both: a
        command interrupted while the server still imported (Ctrl-C in `calibrate`'s or `run`'s first seconds)
        left it importing on after the command had exited, 1.7-8 s, holding the terminal's output open. Killed,
        not asked: asked (its "alive" pipe closed, as exiting closes it) it answers only once its imports are done.
        First what multiprocessing does as a process exits (its rank processes ended, its semaphores unlinked,
        which the tracker would otherwise clean and warn of); it offers no public stop: `_stop` is how its own tests
        stop the server and the tracker."""
        with self.lock:
            if not self.started:
                return
            from multiprocessing import forkserver, resource_tracker, util

            util._exit_function()  # again at exit, with nothing left to do
            server = forkserver._forkserver
            if server._forkserver_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server._forkserver_pid, signal.SIGKILL)
                with contextlib.suppress(FileNotFoundError):  # its socket, gone with the finalizers' temporary folder
                    server._stop()
            resource_tracker._resource_tracker._stop()
            self.started, self.method = False, None

    def _fall_back(self, why: str) -> None:
        self.method = "spawn"
        print(f"note: rank processes are spawned (slower to start): {why}", file=sys.stderr)


_STARTER = _Starter()

def prepare(also: Sequence[str] = ()) -> None:
    """Start the forkserver now, so that its imports overlap the caller's; `ready` waits for it. `also`: modules
    the ranks import beyond `PRELOAD` (workload/hfconfig.py `build_imports`), imported once there, not in each."""
    _STARTER.prepare(also)


def ready() -> None:
    """Wait until ranks can be forked (call it before timing anything: the server's imports take a core)."""
    _STARTER.ready()


def stop() -> None:
    """End the forkserver, if this process started one, before this process ends (`_Starter.stop`)."""
    _STARTER.stop()


def rank_context() -> Any:
    """The multiprocessing context to make rank processes and what they share (queues, pipes, locks) with."""
    import torch.multiprocessing  # its pickling of tensors, in the queues the ranks report through

    return torch.multiprocessing.get_context(_STARTER.ready())


@dataclass(frozen=True)
class _Entry:
    """What a rank process runs: the parent's environment as it was when the process was made (a forked rank
    has the forkserver's), SIGINT ignored, its thread count and what its first backward would import, then
    `target(*args)`."""

    target: Callable[..., None]
    args: tuple
    env: dict[str, str]
    threads: int

    def __call__(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ.clear()
        os.environ.update(self.env)
        torch = sys.modules.get("torch")
        if torch is not None:  # imported before OMP_NUM_THREADS was ours (by the forkserver, or unpickling)
            torch.set_num_threads(self.threads)
            importlib.import_module(FIRST_BACKWARD)  # a forked rank has it from the server
        self.target(*self.args)


def rank_process(context: Any, target: Callable[..., None], args: tuple, name: str, threads: int) -> Any:
    """A daemon process of `context` that runs `target(*args)` with `threads` torch threads and the environment
    this process has now (OMP_NUM_THREADS set to `threads`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return context.Process(target=_Entry(target, args, env, threads), name=name, daemon=True)


def start_processes(procs: list[Any], threads_per_process: int) -> None:
    """Start `procs` (made by `rank_process`) with SIGINT deferred meanwhile, and OMP_NUM_THREADS set to
    `threads_per_process` in this process's environment meanwhile: a spawned interpreter reads it as it imports
    torch, before its entry runs."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process)
    try:
        with _sigint_deferred():
            for proc in procs:
                proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
