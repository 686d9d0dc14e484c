"""The stall watchdog of `run_multiprocess` on rows that outlast it. At `run -s 1f1b --model mlp -m 4 -b 200000`
on 2 cores a row takes 8-20 s, and after its update the last stage waits in a receive through the first stage's
last backward, its update and the next forward: more than the 20 s stall limit, so the run was stopped with
"rank 1 made no progress for 20 s (last action 1OPT.1)" while both ranks were sound. A rank waiting on a
working peer is not stalled, nor is a rank working through a long row."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from pipesim.executor import ExecutorError, run_multiprocess, runners
from pipesim.executor.runners import HEARTBEAT_S, Heartbeat, _Reporter, _Supervisor
from pipesim.schedules import lower
from pipesim.traces.hostload import oom_kills
from pipesim.workload import data
from pipesim.workload.models import Model, classification_loss
from tests.helpers import spec_for

BURN_CPU_S = 2.5  # CPU seconds the first stage's backward takes: more than STALL_S of wall time on any host
STALL_S = 1.0


def _burn(cpu_s: float) -> None:
    """Keep this thread busy until the process has used `cpu_s` more CPU seconds."""
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward computes for BURN_CPU_S: a long backward row, as a large micro-batch's is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _burn(BURN_CPU_S)
        return grad


class _SlowBackwardLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def slow_backward_mlp() -> Model:
    """Two layers on the digits: the first (stage 0 of two) with a backward of BURN_CPU_S."""
    return Model("slow-backward", [nn.Sequential(nn.Linear(data.DIGIT_SIDE ** 2, 16), _SlowBackwardLayer()),
                                   nn.Linear(16, data.DIGIT_CLASSES)], data.digit_batch, classification_loss)


@pytest.mark.slow
def test_a_rank_waiting_on_a_peers_long_backward_is_not_stalled():
    """Rank 1 ends mini-batch 0 with its update, then waits in a receive for BURN_CPU_S and more while rank 0
    runs its backward: before, the run stopped there, "rank 1 made no progress for 1 s (last action 1OPT.0)"."""
    spec = replace(spec_for("1f1b", stages=2, m=1, n=2), model=slow_backward_mlp, model_options={})
    result = run_multiprocess(spec, stall_timeout_s=STALL_S, timeout_s=60)
    assert len(result.losses[0]) == 2 and result.trace.meta.complete


class _Messages:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def put(self, message: tuple) -> None:
        self.sent.append(message)


def test_a_rank_computing_within_a_row_beats_as_working_and_a_waiting_one_stays_silent():
    lowered = lower(spec_for("1f1b", stages=2, m=1, n=1).schedule)
    messages = _Messages()
    reporter = _Reporter(0, lowered, messages)
    reporter.start()
    _burn(5 * HEARTBEAT_S)
    computing = len(messages.sent)
    time.sleep(5 * HEARTBEAT_S)
    reporter.stop()
    beats = [beat for _, beat in messages.sent]
    assert computing >= 3 and all(beat.working and beat.rows_done == 0 for beat in beats[1:computing])
    assert len(beats) <= computing + 2  # waiting: the beat that closes the computing period at most, and stop's


class _Process:
    pid, exitcode = os.getpid(), None


def _beat(rank: int, rows_done: int, working: bool = False) -> tuple:
    return "beat", Heartbeat(rank, rows_done, "1OPT.0" if rank else "0B0.0", {}, [], working)


class _Exited:
    pid, exitcode = os.getpid(), 0


def test_a_rank_that_exited_cleanly_is_not_dead_while_its_result_waits_behind_unread_heartbeats(monkeypatch):
    """A rank puts its result before it exits, but a loaded parent reads the heartbeats queued before it slower
    than they came: rank 1 of calibrate's runtime probe, finished, was declared dead, "exited with code 0 (last
    action 1OPT.11)", with 1 s of reading allowed behind a fault and 2 s of backlog."""
    import queue

    spec = spec_for("1f1b", stages=2, m=1, n=2)
    supervisor = _Supervisor(spec, lower(spec.schedule), [_Process(), _Exited()], stall_timeout_s=60)
    messages: queue.Queue = queue.Queue()
    for rows in range(40):
        messages.put(_beat(1, rows))
    messages.put(("done", 1, "rank 1's result"))
    take = supervisor.take
    monkeypatch.setattr(supervisor, "take", lambda message: (time.sleep(0.05), take(message)))
    assert supervisor.dead() == [1]
    runners._read_behind(messages, supervisor)
    assert supervisor.dead() == [] and supervisor.results[1] == "rank 1's result" and supervisor.fault() is None


def test_a_rank_that_exited_cleanly_with_no_result_says_so():
    """Nothing behind its heartbeats: the fault names what is missing, not a bare exit code 0, which reads as
    success."""
    import queue

    spec = spec_for("1f1b", stages=2, m=1, n=2)
    supervisor = _Supervisor(spec, lower(spec.schedule), [_Process(), _Exited()], stall_timeout_s=60)
    supervisor.take(_beat(1, 3))
    runners._read_behind(queue.Queue(), supervisor)
    assert supervisor.fault() == (1, "rank 1 exited (code 0) without its result reaching the parent (last action "
                                     "1OPT.0)", False)


class _SentUntilExiting:
    """Pickles as itself until its process is shutting down, then fails, as anything a feeder thread sends may
    where what the sending uses is being torn down."""

    def __reduce__(self):
        import multiprocessing.util

        if multiprocessing.util.is_exiting():
            raise OSError("torn down")
        return _SentUntilExiting, ()


class _NoSetup:
    """A rank's set-up pipe that fails as it is read: `_rank_main` then reports the error and ends."""

    def recv(self):
        raise ExecutorError("no set-up")


class _LastSentUntilExiting:
    """A rank's queue (`messages`) whose every item carries a `_SentUntilExiting` last: what `_rank_main` puts as it
    ends (its error here) is lost unless it flushes the queue before the process exits."""

    def __init__(self, messages) -> None:
        self.messages = messages

    def put(self, item: tuple) -> None:
        self.messages.put((*item, _SentUntilExiting()))

    def close(self) -> None:
        self.messages.close()

    def join_thread(self) -> None:
        self.messages.join_thread()


def _put_and_return(messages, in_rank_main: bool) -> None:
    """Put an item as a rank does: `_rank_main` puts its error (its set-up fails) and flushes the queue as it ends;
    a process that puts one and returns leaves it to the exit."""
    if in_rank_main:
        runners._rank_main(_NoSetup(), 1, None, None, _LastSentUntilExiting(messages), None)
    else:
        messages.put(("error", 1, "no set-up", False, _SentUntilExiting()))


@pytest.mark.parametrize("in_rank_main", [True, False])
def test_a_rank_sends_what_it_put_before_it_exits(in_rank_main):
    """A rank's queue is flushed in `_rank_main`, not at the process's exit, where multiprocessing's feeder thread
    drops an item it fails to send without a word: the parent then saw a rank that had put its result exit with
    code 0 and never read it (calibrate's runtime probe in CI, "rank 1 exited with code 0 (last action 1OPT.4)").
    `_rank_main`'s last item (its error, which fails to send once the process is exiting) arrives; left to the exit,
    the same item is lost (what this guards against)."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("fork")
    messages = context.Queue()
    process = context.Process(target=_put_and_return, args=(messages, in_rank_main))
    process.start()
    process.join(30)
    assert process.exitcode == 0
    try:
        message = messages.get(timeout=2)
    except queue.Empty:
        message = None
    if in_rank_main:
        assert message is not None and message[:4] == ("error", 1, "no set-up", False)
        assert isinstance(message[4], _SentUntilExiting)
    else:
        assert message is None


def test_the_reporter_sends_nothing_after_it_stops():
    """`stop` joins the heartbeat thread before the last beat, so no heartbeat is put after `_rank_main` closes
    the queue (a put on a closed queue raises in that thread)."""
    import queue

    messages: queue.Queue = queue.Queue()
    spec = spec_for("1f1b", stages=2, m=1, n=2)
    reporter = _Reporter(0, lower(spec.schedule), messages)
    reporter.start()
    time.sleep(2.5 * HEARTBEAT_S)
    reporter.stop()
    assert not reporter.thread.is_alive()
    sent = messages.qsize()
    time.sleep(2 * HEARTBEAT_S)
    assert messages.qsize() == sent


def test_the_run_stalls_when_no_rank_moves_not_while_one_works():
    spec = spec_for("1f1b", stages=2, m=1, n=2)
    supervisor = _Supervisor(spec, lower(spec.schedule), [_Process(), _Process()], stall_timeout_s=0.2)
    supervisor.take(_beat(0, 3))
    supervisor.take(_beat(1, 5))
    time.sleep(0.3)
    supervisor.take(_beat(0, 4))  # rank 0 finished a row; rank 1 waits on it
    assert supervisor.fault() is None
    time.sleep(0.3)
    supervisor.take(_beat(0, 4, working=True))  # rank 0 within a long row
    assert supervisor.fault() is None
    time.sleep(0.3)  # now neither moves
    rank, text, diverged = supervisor.fault()
    assert (rank, diverged) == (1, False) and text == "rank 1 made no progress for 0.2 s (last action 1OPT.0)"


def test_a_rank_left_waiting_when_its_peer_finishes_gets_the_limit_from_then():
    """Rank 1 waits in a receive past the limit while rank 0 computes its long last rows, then rank 0 sends and
    finishes: rank 1, alone, had not beaten since, and the run stopped with "rank 1 made no progress for 1 s (last
    action 1OPT; waiting on rank 1: receive #1 from rank 0)" (2 of 5 runs of the slow backward's test made with only
    its first backward slow). A peer's finish is the run moving: the stall limit counts from it."""
    spec = spec_for("1f1b", stages=2, m=1, n=2)
    supervisor = _Supervisor(spec, lower(spec.schedule), [_Process(), _Process()], stall_timeout_s=0.2)
    supervisor.take(_beat(1, 5))
    for _ in range(3):
        time.sleep(0.1)
        supervisor.take(_beat(0, 3, working=True))  # rank 0 within its long backward; rank 1 waits on it
    assert supervisor.fault() is None
    supervisor.take(("done", 0, object()))
    assert supervisor.fault() is None
    time.sleep(0.3)  # rank 1 neither moves nor finishes
    rank, text, _ = supervisor.fault()
    assert rank == 1 and text.startswith("rank 1 made no progress for 0.2 s"), text


class _Killed:
    pid, exitcode = os.getpid(), -signal.SIGKILL


@pytest.mark.parametrize("kills, said", [((3, 4), True), ((3, 3), False), ((None, None), False)])
def test_a_rank_the_out_of_memory_killer_ended_is_said_to_have_outgrown_the_host(monkeypatch, kills, said):
    """`run -b 1000000` ran 2 minutes, then said "rank 0 was killed by signal 9": the kernel's out-of-memory killer
    had ended it, which its count (/proc/vmstat oom_kill) rising while the ranks ran tells; a signal 9 without that
    (a person's kill -9), or where the platform keeps no count, is said as before."""
    before, now = kills
    monkeypatch.setattr(runners, "oom_kills", lambda: now)
    spec = spec_for("1f1b", stages=2, m=1, n=2)
    supervisor = _Supervisor(spec, lower(spec.schedule), [_Killed(), _Process()], stall_timeout_s=60,
                             oom_kills_before=before)
    rank, text, _ = supervisor.fault()
    assert rank == 0 and text.startswith("rank 0 was killed by signal 9"), text
    assert text.endswith("(last action setup)" + (": the kernel's out-of-memory killer ended a process meanwhile, "
                         "most likely it, the ranks having outgrown this host's memory; a smaller --microbatch-size, "
                         "or fewer ranks, holds less" if said else "")), text


def test_the_kernels_out_of_memory_kills_are_read_from_vmstat(tmp_path):
    (tmp_path / "proc").mkdir()
    assert oom_kills(tmp_path) is None
    (tmp_path / "proc" / "vmstat").write_text("nr_free_pages 12\noom_kill 7\nnuma_hit 3\n")
    assert oom_kills(tmp_path) == 7


def test_ctrl_c_while_ranks_run_in_process_stops_them_before_it_returns(monkeypatch):
    """A study trains its ranks as threads of its process: Ctrl-C reached the main thread's join, the ranks ran on
    in torch's kernels as the interpreter ended, and it aborted ("terminate called without an active exception",
    exit 134). The ranks stop at their next wait, and are gone before the interrupt goes on."""
    import threading

    joined = threading.Thread.join
    interrupted = []

    def join(thread, timeout=None):
        if thread.name.startswith("pipesim-rank") and not interrupted:
            interrupted.append(thread.name)
            time.sleep(0.2)  # the ranks under way
            raise KeyboardInterrupt
        return joined(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", join)
    with pytest.raises(KeyboardInterrupt):
        runners.run_in_process(spec_for("1f1b", stages=2, m=4, n=500))
    assert interrupted and not [t for t in threading.enumerate() if t.name.startswith("pipesim-rank")]
