"""tune --gpu starts its search's worker processes before it estimates its profiles, so that they start on the core
the estimates leave idle (planning/tune.py `start_workers`), with their cycle collector held off; the search and
its answer are those of workers started by the search, and the answer that of a search without workers."""

import gc
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import pytest

from pipesim.commands import tune as command
from pipesim.planning import tune as planning
from pipesim.units import GIB
from tests.conftest import pipesim
from tests.helpers import GPT_CPU, gpt_on_8, tune_document

SMALL = ("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 64, "--heads", 4, "--seq-len", 32,
         "--vocab", 1000, "-D", 8, "-b", 1, "--json")


def test_tune_starts_its_workers_before_its_estimates_and_answers_as_without_them(monkeypatch):
    events = []
    start, estimated = planning.start_workers, command._estimated_settings

    def started(workers):
        events.append(("workers", workers))
        return start(workers)

    def refused_once(workers):
        """None the first time, as the command did before it started its workers: the search starts them."""
        events.append(("workers", workers))
        return start(workers) if len(events) > 1 else None

    def estimating(*args, **kwargs):
        events.append(("estimates",))
        return estimated(*args, **kwargs)

    monkeypatch.setattr(command, "_estimated_settings", estimating)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    monkeypatch.setattr(planning, "start_workers", started)
    code, early, err = pipesim(*SMALL)
    assert code == 0, err
    assert events == [("workers", 2), ("estimates",)]
    with monkeypatch.context() as patch:
        patch.setattr(planning._Built, "ahead", lambda self, *args: None)
        code, handed, err = pipesim(*SMALL)
    assert code == 0, err
    # What idle workers take ahead (`_Built.ahead`) changes when work is done, never what the search builds,
    # simulates or keeps: the same JSON, the search's counts included, as workers that only take what it hands them.
    assert tune_document(early) == tune_document(handed)
    events.clear()
    monkeypatch.setattr(planning, "start_workers", refused_once)
    code, late, err = pipesim(*SMALL)
    assert code == 0, err
    assert events == [("workers", 2), ("estimates",), ("workers", 2)]
    assert tune_document(early) == tune_document(late)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(1)))
    code, alone, err = pipesim(*SMALL)
    assert code == 0, err
    # What the search built depends on how many candidates its workers take at once; its answer does not.
    assert {**tune_document(early), "search": None} == {**tune_document(alone), "search": None}


def test_tune_starts_a_worker_per_core_this_process_may_use_not_per_core_of_the_host(monkeypatch):
    """A container's or taskset's share of a larger host: tune on one usable core of 64 searches here, where it
    started 64 workers on that one core (os.cpu_count); simulate's replays already counted usable cores."""
    asked = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(planning, "start_workers", lambda workers, *args, **kwargs: asked.append(workers))
    code, _, err = pipesim(*SMALL)
    assert code == 0, err
    assert asked and set(asked) == {1}  # before the estimates, and again after (`start_workers`: None for 1)


def test_tune_of_a_profile_forks_its_workers_before_its_search_shows_what_it_does(monkeypatch):
    """tune --profile left its workers to the search, which started them under `_working`'s thread (its status or
    its one-second note): spawned, a fresh interpreter each importing the simulator again (0.7 CPU s a worker), where
    a fork of this process has it. The README's tune went 4.57 -> 2.64 CPU s."""
    seen, threads = [], threading.active_count()  # 1, unless an earlier test left one running (Ray's)
    start = planning.start_workers

    def started(workers, *args, **kwargs):
        running = threading.active_count()  # before the pool's own
        pool = start(workers, *args, **kwargs)
        seen.append((running, pool._mp_context.get_start_method()))
        return pool

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    monkeypatch.setattr(planning, "start_workers", started)
    code, _, err = pipesim("tune", "--profile", GPT_CPU, "--devices", 2, "--memory-gb", 0.3)
    assert code == 0, err
    assert seen == [(threads, "fork" if threads == 1 else "spawn")]  # before the command's own thread


def _collecting_in_two_workers() -> list[bool]:
    """Whether the cycle collector is on in the workers of a fresh pool of two, asked four times."""
    pool = planning.start_workers(2)
    try:
        return [pool.submit(gc.isenabled).result() for _ in range(4)]
    finally:
        pool.shutdown()


def test_the_search_workers_hold_their_cycle_collector_off():
    assert _collecting_in_two_workers() == [False] * 4
    assert planning.start_workers(1) is None


def test_workers_ahead_of_the_search_find_what_the_search_would_find_itself(monkeypatch):
    """Idle workers cost a fixed chain's partition and find a candidate's critical path ahead of the search
    (`_Built.ahead`, the scenario and links shipped once, `_run`); the search takes their results as the ones it
    would find itself, to the bit. Here the parent's own costing and critical path are broken once the work is
    out: only the workers can have found what the search takes."""
    settings, prob = gpt_on_8(0.3)
    alone_orders, ahead_orders = planning._Orders(), planning._Orders()
    shapes = planning._shapes(settings, prob, alone_orders)[0]
    alone, costed, tightened = planning._Built(prob, alone_orders), 0, 0
    costing, path_bound = planning._costed, planning._path_bound
    with planning._Built(prob, ahead_orders, workers=2) as ahead:
        for shape in planning._shapes(settings, prob, ahead_orders)[0]:
            here, there = alone.advance(shape), ahead.advance(shape)
            if shape.index not in ahead._plans:  # not a fixed chain's partition
                continue
            own = alone.candidate(here)
            ahead.ahead([(-there.max_samples_per_s, shape.index, there)], deque(), *_EVERYTHING)
            ahead._costing[shape.index].result()
            monkeypatch.setattr(planning, "_costed", _broken)
            found = ahead.candidate(there)
            monkeypatch.setattr(planning, "_costed", costing)
            assert found.costs == own.costs and found.busy_ms.tolist() == own.busy_ms.tolist()
            assert (found.staleness, found.memory_floor_bytes, found.allreduce_ms, found.max_samples_per_s) == (
                own.staleness, own.memory_floor_bytes, own.allreduce_ms, own.max_samples_per_s)
            tight = alone.tighten(own).max_samples_per_s
            ahead.ahead([(-found.max_samples_per_s, shape.index, found)], deque(), *_EVERYTHING)
            ahead._tightening[shape.index].result()
            monkeypatch.setattr(planning, "_path_bound", _broken)
            assert ahead.tighten(found).max_samples_per_s == tight
            monkeypatch.setattr(planning, "_path_bound", path_bound)
            costed, tightened = costed + 1, tightened + 1
            if costed == 6:
                break
    assert costed == tightened == 6
    assert len(shapes) > costed


def test_the_search_awaits_a_critical_path_a_worker_is_finding(monkeypatch):
    """A path handed out and not done is under way or queued, and cannot be taken back: the search takes the
    worker's bound when it comes (`_Built.tighten`), not one found again here; one not yet handed out, or taken
    back, it finds here."""
    settings, prob = gpt_on_8(0.3)
    orders = planning._Orders()
    built = planning._Built(prob, orders)
    shape = next(shape for shape in planning._shapes(settings, prob, orders)[0]
                 if isinstance(built.advance(shape), planning.Shape) and shape.index in built._plans)
    candidate = built.candidate(built.advance(shape))
    own = planning._Built(prob, orders).tighten(candidate).max_samples_per_s
    running = Future()
    assert running.set_running_or_notify_cancel()  # as the pool marks a task it has queued for a worker
    built._tightening[shape.index] = running
    threading.Timer(0.2, running.set_result, (own,)).start()
    monkeypatch.setattr(planning, "_path_bound", _broken)
    assert built.tighten(candidate).max_samples_per_s == own and shape.index not in built._tightening
    monkeypatch.undo()
    queued = Future()  # still pending: taken back, and found here
    built._tightening[shape.index] = queued
    assert built.tighten(candidate).max_samples_per_s == own and queued.cancelled()


_EVERYTHING = (-math.inf, lambda result: True)  # `ahead`'s bar (none) and worth_replaying


def _broken(*args):
    raise AssertionError("found in the parent, not taken from the worker")


def test_workers_are_forked_where_no_other_thread_runs_and_spawned_where_one_does(monkeypatch):
    """A fork starts a worker with the simulator already imported (tune --gpu starts them before any thread of
    its own); where another thread runs (a progress bar), whose locks a fork would copy held, they are spawned.
    Either way they work, with their cycle collector held off."""
    methods, get_context = [], multiprocessing.get_context

    def context(method):
        methods.append(method)
        return get_context(method)

    monkeypatch.setattr(multiprocessing, "get_context", context)
    alone = threading.active_count() == 1  # as under a plain pytest
    running, stop = [], threading.Event()
    for _ in range(2):
        assert _collecting_in_two_workers() == [False] * 4
        running.append(threading.Thread(target=stop.wait))
        running[-1].start()
    stop.set()
    assert methods == ["fork" if alone else "spawn", "spawn"]


def test_a_simulation_back_and_worth_replaying_is_replayed_ahead_as_the_search_would_replay_it(monkeypatch):
    """Once a candidate's simulation has come back, an idle worker replays its caching allocator (`_Built.ahead`)
    if the result is worth replaying as things stand, and the search takes that peak as its own replay's; one not
    worth replaying is left to the search."""
    from tests.helpers import searched_settings

    settings = searched_settings("-D", 4, "-B", 32, "-b", 2, "--tensor-parallel", 1, "--recompute", "none")
    prob = planning.Problem(4, int(80 * GIB), 32, ("1f1b", "gpipe"))
    alone_orders, ahead_orders = planning._Orders(), planning._Orders()
    alone = planning._Built(prob, alone_orders)
    own = [c for c in map(alone.candidate, planning._shapes(settings, prob, alone_orders)[0]) if c is not None]
    reserved = planning.Scenario.reserves
    with planning._Built(prob, ahead_orders, workers=2) as ahead:
        found = [c for c in map(ahead.candidate, planning._shapes(settings, prob, ahead_orders)[0]) if c is not None]
        assert len(found) == len(own) >= 2
        for candidate in found:
            ahead.submit(candidate)
            ahead._simulating[candidate.index].result()
        ahead._replay_ahead(found[0], lambda result: False)
        assert found[0].index not in ahead._replaying
        shares = []
        for candidate in found[1:]:
            ahead._replay_ahead(candidate, lambda result: True)
            shares.append(len(ahead._replaying[candidate.index]))  # each worker replays a share of the devices
            for share in ahead._replaying[candidate.index]:
                share.result()
        assert shares == [min(2, candidate.schedule.num_devices) for candidate in found[1:]] and 2 in shares
        monkeypatch.setattr(planning.Scenario, "reserves", _broken)
        replayed = [ahead.result(candidate).peak_memory_bytes for candidate in found[1:]]
        monkeypatch.setattr(planning.Scenario, "reserves", reserved)
        assert replayed == [alone.result(candidate).peak_memory_bytes for candidate in own[1:]]
        assert ahead.result(found[0]).peak_memory_bytes == alone.result(own[0]).peak_memory_bytes


def _released(path: str) -> None:
    """In a worker: waits (a minute at most) for `path` to exist."""
    for _ in range(600):
        if os.path.exists(path):
            return None
        time.sleep(0.1)
    raise AssertionError(f"{path} never came: the search handed nothing out while it waited")


def test_a_search_waiting_for_one_result_hands_the_idle_workers_their_work_ahead(tmp_path):
    """The search takes its results in the order it handed them out; while it waits for one, the workers that have
    finished theirs are handed what it would hand them ahead (`_Built.idle`, `top_groups`' `ahead`), not left idle
    until that result comes (the 70B's stale p = 32 orders: a worker idle 25 s of 90 at a load of 10). Here the
    search waits for a shape's candidate searched by a worker (`_Built.candidate`), and what is handed out is what
    lets that search finish: waiting on it alone, the search would wait the minute out."""
    from tests.helpers import searched_settings

    settings = searched_settings("-D", 4, "-B", 32, "-b", 2, "--tensor-parallel", 1, "--recompute", "none")
    prob = planning.Problem(4, int(80 * GIB), 32, ("1f1b",))
    orders = planning._Orders()
    shape = planning._shapes(settings, prob, orders)[0][0]
    release = tmp_path / "released"
    with planning._Built(prob, orders, workers=2) as built:
        built._searching[shape.index] = built._submit(_released, str(release))  # its search, as `ahead` hands it
        built._submit(len, ())  # the other worker's, finished first
        handed = []
        built.idle = lambda: handed.append(release.touch())
        assert built.candidate(shape) is None and handed


_CTRL_C_IN_WORKERS = '''
import contextlib, multiprocessing.connection, os, signal, sys, threading
if __name__ == "__mp_main__":  # a spawned worker starting: this file is imported before its initializer runs
    os.kill(os.getpid(), signal.SIGINT)
if __name__ == "__main__":
    from pipesim.planning.tune import start_workers
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever started this
    if sys.argv[1] == "spawn":  # another thread runs: the workers are spawned
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    pool = start_workers(2)
    pid = pool.submit(os.getpid).result()  # a worker that has started
    worker = pool._processes[pid]
    while True:  # a SIGINT as it hands a result back ends that, not the worker (concurrent.futures): again, idle
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        if multiprocessing.connection.wait([worker.sentinel], timeout=1):
            break
    pool.shutdown()
    print(worker.exitcode)
'''


def test_ctrl_c_ends_the_workers_without_a_traceback_while_they_start_or_idle(tmp_path):
    """Ctrl-C reaches the whole foreground group; the command says "interrupted" once (cli.py), so a worker says
    nothing: an idle one exits 130 quietly, forked or spawned, and a spawned one starting (here: signalled as
    this script is imported in it, before its initializer) goes on starting."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_IN_WORKERS)
    for method in ("fork", "spawn"):
        ran = subprocess.run([sys.executable, script, method], capture_output=True, text=True, timeout=120)
        assert (ran.returncode, ran.stdout, ran.stderr) == (0, "130\n", ""), method


_STARTING_HELD = '''
import os, pathlib, time
here = pathlib.Path(__file__).parent
if __name__ == "__mp_main__":  # a spawned worker starting (its imports, seconds on a busy host), held until released
    (here / f"starting-{os.getpid()}").touch()
    held_until = time.monotonic() + 30
    while not (here / "released").exists() and time.monotonic() < held_until:
        time.sleep(0.05)
    (here / f"started-{os.getpid()}").touch()
if __name__ == "__main__":
    import threading
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # another thread: tune's are spawned too
    from pipesim.cli import main
    main()
'''


@pytest.mark.parametrize("command", [
    ("tune", "--profile", GPT_CPU, "--devices", 8, "--memory-gb", 0.3),
    ("sweep", "--grid", Path(__file__).resolve().parents[1] / "examples" / "grid.toml", "-j", 2, "--out", "out.csv")])
def test_ctrl_c_ends_workers_still_starting_rather_than_wait_for_them(tmp_path, command):
    """Ctrl-C while tune's (or sweep's) spawned workers still start, Ctrl-C ignored (`_ignoring_ctrl_c`): the
    command ends them and says "interrupted", where it waited for them to start before it gave the prompt back."""
    script = tmp_path / "pipesim_held.py"
    script.write_text(_STARTING_HELD)
    workers = 2 if command[0] == "sweep" else len(os.sched_getaffinity(0))  # tune's: one per core it may use
    proc = subprocess.Popen([sys.executable, script, *map(str, command)], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as at a terminal
    try:
        while len(list(tmp_path.glob("starting-*"))) < workers and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C: the whole foreground group
        _, err = proc.communicate(timeout=120)
        starting = [int(path.name.split("-")[1]) for path in tmp_path.glob("starting-*")]
        assert (proc.returncode, err.splitlines()[-1:], len(starting)) == (130, ["interrupted"], workers), err
        assert not list(tmp_path.glob("started-*"))
        assert not [pid for pid in starting if _alive(pid)]
    finally:
        (tmp_path / "released").touch()
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sweeps_workers_keep_their_cycle_collector_where_tunes_hold_it_off():
    """sweep's workers, started as tune's are since they share Ctrl-C's handling, live the whole grid: holding
    their cycle collector off as tune's (one search) would let a long grid's cycles pile up."""
    for collect in (True, False):
        pool = planning.start_workers(2, forked=False, collect=collect)
        try:
            assert pool.submit(gc.isenabled).result(timeout=120) is collect
        finally:
            pool.shutdown()


STOP_WHILE_SENDING = """
import os, threading
from concurrent.futures import as_completed
from pipesim.planning.tune import start_workers, submit

def sent(i):
    return bytes(400_000)  # one (b, t, E) group of tune --gpu's estimates is 150-490 KB

if __name__ == "__main__":
    for _ in range(4):
        pool = start_workers(2)
        futures = [submit(pool, sent, i) for i in range(200)]
        next(as_completed(futures)).result()
        watchdog = threading.Timer(20, lambda: (print("hung", flush=True), os._exit(99)))
        watchdog.start()
        pool.stop(at_once=True)  # as tune's `finally` after an error or Ctrl-C
        watchdog.cancel()
    print("stopped")
"""


STOP_WITH_LARGE_TASKS_QUEUED = """
import math, time
from pipesim.planning.tune import Workers

def held(blob):
    time.sleep(60)

if __name__ == "__main__":
    pool = Workers(1, "fork", collect=False)
    assert pool.submit(math.sqrt, 4.0).result(timeout=60) == 2.0
    blob = bytes(1_000_000)  # a search's shipped problem, pickled into each task
    running = [pool.submit(held, blob) for _ in range(3)]
    time.sleep(1)
    assert pool.submit(held, blob).cancel()
    pool.stop(at_once=True)
    print("stopped", flush=True)
"""


def test_stopping_at_once_with_large_tasks_queued_lets_the_process_exit(tmp_path):
    """The tasks' pipe, whose feeder thread was blocked writing a task no worker would read, was left open where
    Python 3.11's pool manager failed on a cancelled task before closing it: the process hung as it exited, joining
    that thread (`Workers.stop` closes it)."""
    script = tmp_path / "exit.py"
    script.write_text(STOP_WITH_LARGE_TASKS_QUEUED)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "stopped", "")


def test_stopping_at_once_while_workers_send_large_results_never_hangs(tmp_path):
    """A worker ended mid-send left half a result in the pipe, and the pool's manager thread waited for the rest
    forever (the parent holds the write end): tune --gpu hung after Ctrl-C or an error during its estimates, 5 of 6
    times in this script before `Workers.stop` closed the write end."""
    script = tmp_path / "stop.py"
    script.write_text(STOP_WHILE_SENDING)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr


class _EndsTheWorker:
    """Unpickled in a worker, it ends it at once, as the kernel's OOM killer would."""

    def __reduce__(self):
        return os._exit, (1,)


def test_a_worker_killed_during_the_estimates_is_one_line_not_a_traceback(monkeypatch):
    """The estimates run in the search's workers (commands/tune.py `_estimate_groups`): one killed mid-task raised
    BrokenProcessPool's traceback, where the estimates had run in this process before."""
    from pipesim.commands import tune as command
    from tests.conftest import pipesim

    made_here = command._estimate_groups
    monkeypatch.setattr(command, "usable_cpus", lambda: 2)
    monkeypatch.setattr(command, "_estimate_groups", lambda groups, *rest: made_here(
        [(_EndsTheWorker(), made, group) for _, made, group in groups], *rest))
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 128, "--heads", 4,
                             "--seq-len", 64, "--devices", 4, "--batch-size", 8)
    assert (code, out) == (1, "") and err.strip().splitlines()[-1] == (  # after the progress line, if it came
        "error: a worker process of the search ended abruptly (killed, or out of the host's memory): run it again")
    assert "Traceback" not in err


def test_ending_the_workers_at_once_passes_over_one_that_never_started():
    """A worker whose start failed has no process: ending it raised AttributeError over the error that stopped the
    search (`Workers.stop`)."""
    pool = planning.Workers(1, "fork", collect=False)
    assert pool.submit(math.sqrt, 4.0).result(timeout=60) == 2.0  # one worker started
    unstarted = multiprocessing.get_context("fork").Process(target=print)
    pool._launched.append(unstarted)
    pool.stop(at_once=True)
    started = [process for process in pool._launched if process is not unstarted]
    assert started and all(process.exitcode is not None for process in started) and unstarted.pid is None


def test_ending_the_workers_at_once_with_work_the_search_cancelled_reports_nothing(monkeypatch):
    """Python 3.11's pool manager, finding a worker ended, fails every task still queued, and raised
    InvalidStateError, printed with a traceback from its thread, on one the search had cancelled (`_if_done`): a
    refusal of tune, which ends the workers at once, printed it under load."""
    reported = []
    monkeypatch.setattr(threading, "excepthook", reported.append)
    pool = planning.Workers(1, "fork", collect=False)
    assert pool.submit(math.sqrt, 4.0).result(timeout=60) == 2.0
    # one in the worker and up to two in the call queue (max_workers + EXTRA_QUEUED_CALLS): once the worker has
    # taken the first, which a slow main thread lets it do, a third fits in the call queue (two sleeps left none)
    running = [pool.submit(time.sleep, 60) for _ in range(3)]
    cancelled = pool.submit(time.sleep, 60)  # the manager cannot have taken it from its pending tasks: cancellable
    assert cancelled.cancel()
    feeder = pool._call_queue._thread
    pool.stop(at_once=True)
    assert all(future.done() for future in running) and reported == []
    assert not feeder.is_alive()  # else the process's next pool is spawned (another thread runs), not forked
