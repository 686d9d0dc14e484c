"""The host's load while something was measured (traces/hostload.py): the others' CPU time over a window, this
command's own process tree left out, else the load average; a cached host term taken under another load is
measured again, the profile and a run's trace record their load and ranks, and `compare` names what differs
between them (tests/test_contention.py calibrates under two loads). The load is read through `sample`, set here
with `host_counters`: no test reads the machine's."""

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pipesim.traces import hostload
from pipesim.traces.hostload import CpuSample, HostLoad, loads_differ, ranks_per_host
from tests.conftest import host_counters, pipesim

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "traces" / "measured" / "fidelity-cpu2-day3-runs"  # recorded before loads were
BEGAN = "2026-11-29T03:00:00+00:00"


def host_is(monkeypatch, others_cores: float, own_cores: float = 0.0, load_1min: float | None = 0.0) -> None:
    monkeypatch.setattr(hostload, "sample", host_counters(others_cores, own_cores, load_1min))
    monkeypatch.setattr(hostload, "usable_cpus", lambda: 2)


def test_others_load_is_the_host_cpu_time_less_this_commands_own(monkeypatch):
    # an idle host right after a command of ours: the load average still counts that command, CPU time does not
    host_is(monkeypatch, others_cores=0.0, own_cores=1.9, load_1min=1.6)
    load = HostLoad.since(hostload.mark(), own_tasks=2)
    assert load.others_cores == 0.0 and load.per_core == 0.0 and not load.busy and load.seconds == 1.0
    assert load.describe() == "others' load 0.00 on 2 cores (0.00 per core, from CPU time)"
    busy = HostLoad(1.6, 1.6, 10.0, 2, 2, BEGAN, others_cores=1.1)  # others' half of both cores beside our ranks
    assert busy.busy and busy.per_core == pytest.approx(0.55) and loads_differ(busy, load)
    assert HostLoad.from_dict(busy.to_dict()) == busy
    assert HostLoad.from_dict({**busy.to_dict(), "others_cores": -1}) is None  # a hand-edited file: not recorded


def test_a_load_average_from_before_cpu_time_was_recorded_reads_as_before():
    # 2 busy tasks for 60 s add at most 2 (1 - 1/e) = 1.26 to the 1-minute average
    old = {"before": 0.5, "after": 2.0, "seconds": 60.0, "cpus": 2, "own_tasks": 2, "began_at": BEGAN}
    load = HostLoad.from_dict(old)
    assert load.others_cores is None and load.measure == "load average"
    assert load.others == pytest.approx((0.5 + 2.0 - 2 * (1 - 2.718281828 ** -1)) / 2, abs=1e-6)
    assert load.per_core == pytest.approx(load.others / 2)
    assert "on 2 cores" in load.describe() and "from load average" in load.describe()
    assert HostLoad.from_dict(load.to_dict()) == load
    assert HostLoad.from_dict(None) is None and HostLoad.from_dict({"cpus": 2}) is None
    assert HostLoad.from_dict({**old, "before": "4.6"}) is None  # a hand-edited file: not recorded
    assert HostLoad.from_dict({**old, "cpus": 0}) is None
    unknown = HostLoad(None, None, 1.0, 2, 0, BEGAN)
    assert unknown.others is None and "unknown" in unknown.describe()
    assert not loads_differ(unknown, load) and not loads_differ(None, load)
    busy = HostLoad(4.6, 4.6, 0.0, 2, 0, BEGAN)
    quiet = HostLoad(0.2, 0.2, 0.0, 2, 0, BEGAN)
    assert loads_differ(busy, quiet) and not loads_differ(quiet, HostLoad(0.6, 0.6, 0.0, 2, 0, BEGAN))
    assert busy.busy and not HostLoad(1.6, 1.6, 0.0, 2, 0, BEGAN).busy  # 0.8 per core: busy from 1 on this measure
    # read by different measures, two loads are not compared
    assert not loads_differ(busy, HostLoad(0.2, 0.2, 0.0, 2, 0, BEGAN, others_cores=0.1))
    assert ranks_per_host({"ranks": 4, "compute": ["a/cpu", "b/cpu", "a/cpu", "a/cpu"]}) == 3
    assert ranks_per_host({"ranks": 4}) == 4 and ranks_per_host(None) is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_own_cpu_time_counts_descendants_alive_and_ended():
    """A grandchild burns 0.3 s of CPU and waits: this command's CPU time holds it while it lives (unlike
    getrusage's children, which counts only those waited for) and after it and its parent have ended."""
    burn = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\nsys.stdin.read()"
    before = hostload._own_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              f"{burn!r}])"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"
        alive = hostload._own_cpu_s() - before
    finally:
        child.stdin.close()
        child.wait(30)
    ended = hostload._own_cpu_s() - before
    # /proc counts CPU in clock ticks (10 ms), each process's rounded down: the grandchild's 0.3 s can read 0.28;
    # uncounted, it would read only the two interpreters' start-up, well under 0.2
    assert alive >= 0.25 and ended >= alive


def _ended_unreaped(pid: int) -> None:
    """Wait until process `pid` has ended and is a zombie, not yet reaped."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_an_adopted_orphan_is_reaped_once_it_ends():
    """A grandchild seen while its parent lives, then orphaned (re-parented here) and ended, is reaped by the
    next reading, not left a zombie for as long as the command (a pytest session) runs."""
    orphan = ("import os, time\nparent = os.getppid()\nprint(os.getpid(), flush=True)\n"
              "while os.getppid() == parent: time.sleep(0.01)")
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                              f"{orphan!r}])\nsys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    grandchild = int(child.stdout.readline())  # once it knows its parent
    hostload._own_cpu_s()  # sees it below its parent
    child.stdin.close()  # its parent reads the end and ends
    assert child.wait(30) == 0
    _ended_unreaped(grandchild)
    hostload._own_cpu_s()
    with pytest.raises(ChildProcessError):  # reaped: no longer a child of this process
        os.waitpid(grandchild, os.WNOHANG)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_child_of_this_commands_own_is_left_for_its_waiter():
    """A subprocess that has ended but is not yet waited for keeps its exit status for its Popen."""
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    hostload._own_cpu_s()
    _ended_unreaped(child.pid)
    hostload._own_cpu_s()
    assert child.wait(30) == 3


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_own_cpu_time_keeps_a_descendant_whose_parent_ended_first():
    """A child starts a grandchild that burns 0.3 s of CPU and ends at once, without waiting for it: the orphan
    is this command's work, and its CPU time stays this command's after it ends (re-parented to init, it was
    lost: the two interpreters' start-up alone, well under 0.2 s)."""
    burn = "import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)"
    before = hostload._own_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                              f"'-c', {burn!r}])"], stdout=subprocess.PIPE, text=True)
    assert child.wait(30) == 0  # the grandchild lives on
    assert child.stdout.read() == "burnt\n"  # the end of the pipe: the grandchild has ended too
    assert hostload._own_cpu_s() - before >= 0.25


def test_the_load_now_is_others_cpu_over_a_quiet_window(monkeypatch):
    host_is(monkeypatch, others_cores=0.6, own_cores=0.0, load_1min=3.0)
    now = HostLoad.now()
    assert now.others_cores == 0.6 and now.own_tasks == 0 and now.per_core == pytest.approx(0.3)
    monkeypatch.setattr(hostload, "sample", lambda: CpuSample(time.monotonic(), None, None, 3.0))  # no /proc
    fallback = HostLoad.now()
    assert fallback.others_cores is None and fallback.others == 3.0 and fallback.measure == "load average"


def test_a_term_cached_under_high_load_is_measured_again_when_the_load_is_low(tmp_path, monkeypatch):
    from pipesim.calibrate.cache import MAX_AGE_S, HostCache

    measured = []

    def measure():
        measured.append(len(measured) + 1)
        return {"ms": measured[-1]}

    def get():
        return HostCache(tmp_path).get("links", {"sizes": [4096]}, measure, 2)

    host_is(monkeypatch, others_cores=1.8, own_cores=0.2)  # busy: 0.9 per core
    busy = get()
    assert busy.fresh and busy.load.per_core == pytest.approx(0.9) and busy.meta()["load"]["others_cores"] == 1.8
    assert busy.meta()["measured_because"] == "none was cached"
    again = get()  # the same load: reused, and it says under what load it was measured
    assert not again.fresh and again.value == {"ms": 1}
    assert "at others' load 1.80 on 2 cores (0.90 per core, from CPU time)" in again.describe()
    host_is(monkeypatch, others_cores=0.2, own_cores=1.8)  # quiet, however busy this command keeps the cores
    quiet = get()
    assert quiet.fresh and quiet.value == {"ms": 2} and quiet.load.per_core == pytest.approx(0.1)
    assert ("the cached one's calibration began at others' load 1.80 on 2 cores (0.90 per core, from CPU time), "
            "this one at 0.10 per core, more than 0.25 apart") in quiet.describe()
    assert not get().fresh  # the quiet one kept
    # an entry older than MAX_AGE_S is measured again, whatever its load
    (entry,) = tmp_path.glob("links-*.json")
    doc = json.loads(entry.read_text())
    doc["measured_at"] = (datetime.now(timezone.utc) - timedelta(seconds=MAX_AGE_S + 60)).isoformat()
    entry.write_text(json.dumps(doc))
    old = get()
    assert old.fresh and "old, kept 1 d at most" in old.describe()
    # an entry that does not say the load its calibration began at is measured again
    doc = json.loads(entry.read_text())
    del doc["load_before"]
    entry.write_text(json.dumps(doc))
    unrecorded = get()
    assert unrecorded.fresh and "does not say the host's load" in unrecorded.describe()
    # an entry cut short is measured again, and said unreadable, not missing
    entry.write_text('{"garbage": ')
    cut_short = get()
    assert cut_short.fresh and cut_short.meta()["measured_because"] == "the cached one could not be read " \
                                                                       "(JSONDecodeError)"
    # where the platform keeps neither CPU time nor a load average nothing tells two loads apart: reused, said unknown
    monkeypatch.setattr(hostload, "sample", lambda: CpuSample(time.monotonic(), None, None, None))
    entry.unlink()
    assert get().fresh
    unknown = get()
    assert not unknown.fresh and "at others' load unknown" in unknown.describe()


def test_a_term_measured_in_a_busy_moment_after_a_quiet_start_is_not_reused_on_a_quiet_host(tmp_path, monkeypatch):
    """The load a calibration began at can be quiet and the term still measured in a busy spell (the mlp's send,
    13-21 ms of descheduled time on the 2-core host): a term whose others kept the host busy even beside its
    ranks is measured again where the host is quiet now; still busy now, it is reused."""
    from pipesim.calibrate.cache import HostCache

    host_is(monkeypatch, others_cores=0.2)  # quiet: 0.1 per core
    first = HostCache(tmp_path)
    assert first.find("links", {"sizes": [4096]}) is None
    busy = HostLoad(before=None, after=None, seconds=2.0, cpus=2, own_tasks=2, began_at=BEGAN, others_cores=1.6)
    first.keep("links", {"sizes": [4096]}, {"ms": 21.0}, busy)
    again = HostCache(tmp_path).get("links", {"sizes": [4096]}, lambda: {"ms": 0.3}, 2)
    assert again.fresh and again.value == {"ms": 0.3}
    assert ("the cached one was measured on a busy host (others' load 1.60 on 2 cores (0.80 per core, from CPU "
            "time) beside its own ranks), and the host is quiet now (0.10 per core, more than 0.25 less)"
            ) in again.describe()
    host_is(monkeypatch, others_cores=1.0)  # a calibration that began busy (0.5 per core) keeps it ...
    HostCache(tmp_path).keep("links", {"sizes": [4096]}, {"ms": 21.0}, busy)
    kept = HostCache(tmp_path).find("links", {"sizes": [4096]})  # ... for one on the host as busy
    assert kept is not None and kept.value == {"ms": 21.0}


@pytest.mark.parametrize("now_cores, again", [(0.98, False), (0.5, False), (0.48, True)])
def test_a_busy_terms_host_is_quieter_now_only_by_more_than_the_tolerance(tmp_path, monkeypatch, now_cores, again):
    """A term measured while the others kept 0.50 per core busy beside its ranks was measured again at 0.49 per core
    "quiet now" (a new user's calibrate, twice in a row): a line between busy and quiet read a hundredth as a change.
    It is measured again where the host is quiet now by more than LOAD_TOLERANCE_PER_CORE less."""
    from pipesim.calibrate.cache import HostCache

    busy = HostLoad(before=None, after=None, seconds=2.0, cpus=2, own_tasks=2, began_at=BEGAN, others_cores=1.0)
    host_is(monkeypatch, others_cores=0.5)  # its calibration began at 0.25 a core: within the tolerance of each now
    HostCache(tmp_path).keep("links", {"sizes": [4096]}, {"ms": 21.0}, busy)  # measured at 0.50 a core, busy
    host_is(monkeypatch, others_cores=now_cores)
    again_said = HostCache(tmp_path).get("links", {"sizes": [4096]}, lambda: {"ms": 0.3}, 2)
    assert again_said.fresh == again
    assert ("and the host is quiet now" in again_said.describe()) == again


def test_a_term_kept_from_a_full_host_is_measured_again_where_more_or_fewer_now_wait_for_its_cores(tmp_path,
                                                                                                   monkeypatch):
    """Once the others fill the cores their CPU time reads the same however many wait (docs/auto.md's mlp: 0.81-0.86
    per core at load averages of 6.6 to 14.0 on 2 cores): a term kept from a full host is reused on one full now
    only where the load averages at the two calibrations' starts are within one task a core, and where they are not it
    is measured again, naming both. The load is the cache file's own recorded figure, rewritten here."""
    from pipesim.calibrate.cache import HostCache

    def get():
        return HostCache(tmp_path).get("contention", {"model": "mlp"}, lambda: {"tail": 7.45}, 2)

    host_is(monkeypatch, others_cores=1.64, load_1min=14.0)  # 0.82 per core: the cores are full
    kept = get()
    assert kept.fresh and kept.load_before.before == 14.0
    (entry,) = tmp_path.glob("contention-*.json")
    doc = json.loads(entry.read_text())
    doc["load_before"]["before"] = doc["load_before"]["after"] = 6.6  # kept at a start as full, fewer waiting
    doc["value"] = {"tail": 3.3}
    entry.write_text(json.dumps(doc))
    again = get()
    assert again.fresh and again.value == {"tail": 7.45}
    assert ("the cached one's calibration began at others' load 1.64 on 2 cores (0.82 per core, from CPU time) and a "
            "load average of 6.6, this one at 0.82 per core and a load average of 14.0: the others fill the cores, and "
            "their load averages are more than 1 a core apart") in again.describe()
    doc["load_before"]["before"] = doc["load_before"]["after"] = 12.5  # within one task a core: reused
    entry.write_text(json.dumps(doc))
    assert not get().fresh and get().value == {"tail": 3.3}
    host_is(monkeypatch, others_cores=0.6, load_1min=3.0)  # not full (0.3 per core): CPU time tells, 0.25 apart
    assert "more than 0.25 apart" in get().describe()


def test_back_to_back_calibrations_on_an_idle_host_reuse_the_cache(tmp_path, monkeypatch):
    """The first calibration's own ranks leave the load average at 1.6 for the next; its CPU time is its own, so
    the second, at once after, finds the host as idle as the first did and reuses the term."""
    from pipesim.calibrate.cache import HostCache

    host_is(monkeypatch, others_cores=0.0, own_cores=0.0, load_1min=0.1)
    first = HostCache(tmp_path).get("links", {"sizes": [4096]}, lambda: {"ms": 1}, 2)
    host_is(monkeypatch, others_cores=0.0, own_cores=2.0, load_1min=1.6)
    second = HostCache(tmp_path).get("links", {"sizes": [4096]}, lambda: {"ms": 2}, 2)
    assert first.fresh and not second.fresh and second.value == {"ms": 1}


def test_a_run_records_its_load_and_ranks(tmp_path, monkeypatch):
    from pipesim.traces import read_trace

    host_is(monkeypatch, others_cores=0.4, own_cores=1.6, load_1min=1.5)
    trace = tmp_path / "run.json"
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--layers", 2, "--width", 16, "-b", 2, "-m", 2,
                           "-n", 2, "--trace", trace, "--no-heldout")
    assert code == 0, err
    meta = read_trace(trace).meta
    load = HostLoad.from_dict(meta.extra["host_load"])
    assert (load.others_cores, load.before, load.after, load.own_tasks, load.cpus) == (0.4, 1.5, 1.5, 2, 2)
    assert meta.hardware["ranks"] == 2 and time.time() - datetime.fromisoformat(load.began_at).timestamp() < 600


def _recorded(tmp_path: Path, name: str, run_load: float | None, calibrated_load: float | None,
              contention_load: float | None = None) -> Path:
    """The committed 1F1B run with its profile (recorded before loads were), the others' cores given written in
    as measured from CPU time."""
    doc = json.loads((RUNS / "1f1b.json").read_text())
    profile = json.loads((RUNS / "mlp-profile.json").read_text())
    began = "2026-11-25T20:30:00+00:00"

    def load(cores: float, seconds: float) -> dict:
        return HostLoad(1.5, 1.5, seconds, 2, 2, began, others_cores=cores).to_dict()

    if calibrated_load is not None:
        profile["environment"].update(load=load(calibrated_load, 5.0), ranks=2)
    if contention_load is not None:
        profile["link"]["meta"]["host_cache"] = {"measured_at": "2026-11-25T19:30:00+00:00", "age_s": 2760.0,
                                                 "reused": True, "load": load(contention_load, 5.0)}
    extra = doc["pipesim"]["meta"]["extra"]
    extra["profile"] = profile
    if run_load is not None:
        extra["host_load"] = load(run_load, 10.0)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_compare_indents_a_condition_wrapped_at_80_columns_under_its_first_line(tmp_path, monkeypatch):
    """The host's load ran on from column 0 under "conditions:" at 80 columns, reading as lines of their own: each
    condition starts 2 spaces in and the lines it wraps onto 4, up to the next section."""
    from pipesim.commands import common

    monkeypatch.setattr(common.stdout, "width", 80)
    code, out, err = pipesim("compare", _recorded(tmp_path, "busy.json", run_load=1.4, calibrated_load=0.1,
                                                  contention_load=1.3))
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index("conditions:") + 1
    block = lines[start:next(k for k in range(start, len(lines)) if not lines[k].startswith(" "))]
    firsts = [line for line in block if not line.startswith("    ")]
    assert [line.split(":")[0].strip() for line in firsts] == ["calibrated", "others' load on the host", "ranks",
                                                                "link and all-reduce"]
    assert len(block) > len(firsts) and all(line.startswith("  ") and len(line) <= 80 for line in block), out


def test_compare_names_the_conditions_that_differ_beside_the_error(tmp_path):
    code, out, err = pipesim("compare", _recorded(tmp_path, "busy.json", run_load=1.4, calibrated_load=0.1,
                                                  contention_load=1.3))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "conditions: calibrated: 14 min before the run" in flat
    assert ("others' load on the host: 0.10 on 2 cores (0.05 per core, from CPU time) while calibrating; 1.40 on 2 "
            "cores (0.70 per core, from CPU time) while running (differs)") in flat
    assert "ranks: calibrated for 2 computing at once; ran 2 on one host link" in flat  # not marked: the next line
    assert ("link and all-reduce: from the host cache, measured 1 h before the run at others' load 1.30 on 2 cores "
            "(0.65 per core, from CPU time)") in flat
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "the host's load differed: 0.05 per core while calibrating, 0.70 while running" \
        in warnings[0]
    assert ("the host was busy (others' load 0.70 per core while running (busy from 0.5, CPU time): other work "
            "shared every rank's core)") in warnings[1]
    code, out, err = pipesim("compare", _recorded(tmp_path, "same.json", run_load=0.3, calibrated_load=0.2,
                                                  contention_load=1.3), "--json")
    assert code == 0, err
    found = json.loads(out)["conditions"]
    assert not found["load_differs"] and found["host_terms"][0]["load_differs"] and found["run_ranks"] == 2
    assert err.count("warning:") == 1 and "link and all-reduce came from the host cache, measured at others' load " \
        "0.65 per core, the run's was 0.15" in err


def test_a_busy_host_is_flagged_while_our_own_ranks_keep_the_cores_busy(tmp_path):
    # both ranks computing take what they can; the others still held 0.55 of each core: every rank shared its own
    code, _, err = pipesim("compare", _recorded(tmp_path, "shared.json", run_load=1.1, calibrated_load=1.0))
    assert code == 0, err
    assert err.count("warning:") == 1 and "the host was busy (others' load 0.50 per core while calibrating (busy " \
        "from 0.5, CPU time), 0.55 per core while running" in " ".join(err.split())


@pytest.mark.parametrize("others_cores", [0.0, 1.1])
def test_calibrate_then_run_at_once_is_judged_by_the_others_load_alone(tmp_path, monkeypatch, others_cores):
    """The documented workflow. On a host where nothing else runs, the calibration's and the run's ranks keep
    both cores busy and leave the load average high for the next command, but the others' CPU time is nil: compare
    marks nothing as differing and warns of nothing. On a busy one, other work holding 0.55 of each core while
    our ranks take the rest is flagged."""
    host_is(monkeypatch, others_cores=others_cores, own_cores=2.0 - others_cores, load_1min=1.6)
    profile, trace = tmp_path / "p.json", tmp_path / "run.json"
    code, _, err = pipesim("calibrate", "--model", "mlp", "--layers", 2, "--width", 16, "-b", 2, "--stages", 2,
                           "--repeats", 3, "--warmup", 1, "--no-links", "--no-runtime", "--no-contention",
                           "--out", profile)
    assert code == 0, err
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--profile", profile, "-m", 2, "-n", 2,
                           "--trace", trace, "--no-heldout")
    assert code == 0, err
    code, out, err = pipesim("compare", trace)
    assert code == 0, err
    flat, per_core = " ".join(out.split()), others_cores / 2
    assert (f"others' load on the host: {others_cores:.2f} on 2 cores ({per_core:.2f} per core, from CPU time) "
            f"while calibrating; {others_cores:.2f} on 2 cores ({per_core:.2f} per core, from CPU time) while "
            "running") in flat
    assert "(differs)" not in flat
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    if others_cores:
        assert len(warnings) == 1 and f"the host was busy (others' load {per_core:.2f} per core while calibrating" \
            in warnings[0]
    else:
        assert not warnings


def test_compare_says_more_ranks_than_calibrated_for(tmp_path):
    from dataclasses import replace

    from pipesim.planning.replay import predict_measured
    from pipesim.traces import read_trace
    from pipesim.traces.compare import compare

    measured = read_trace(_recorded(tmp_path, "dp.json", run_load=0.2, calibrated_load=0.2))
    predicted = predict_measured(measured.meta)

    def ran_on(*places: str):
        hardware = {**measured.meta.hardware, "ranks": len(places), "compute": list(places)}
        return compare(predicted, replace(measured, meta=replace(measured.meta, hardware=hardware)))

    found = ran_on(*["vm/cpu"] * 4)  # say, two data-parallel replicas of the 2-stage pipeline on one host
    assert found.conditions.ranks_differ and (found.conditions.calibrated_ranks, found.conditions.run_ranks) == (2, 4)
    assert any("the run had 4 ranks" in w and "--ranks 4" in w for w in found.warnings)
    spread = ran_on("a/cpu", "a/cpu", "b/cpu", "b/cpu")  # two per host: as calibrated
    assert spread.conditions.run_ranks == 2 and not spread.conditions.ranks_differ
    assert not any("ranks" in w for w in spread.warnings)


def test_files_from_before_loads_were_recorded_still_compare_and_say_so(tmp_path):
    code, out, err = pipesim("compare", _recorded(tmp_path, "old.json", run_load=None, calibrated_load=None))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "conditions: calibrated: not recorded how long before the run" in flat
    assert "others' load on the host: not recorded while calibrating; not recorded while running" in flat
    assert "ranks: not recorded for the calibration; ran 2 on one host" in flat
    assert "warning" not in err
    from pipesim.profiles.schema import load_profile

    for path in (*(ROOT / "traces" / "profiles").glob("*.json"), RUNS / "mlp-profile.json"):
        assert load_profile(path).environment.load is None


def test_the_forkserver_exits_without_tearing_torch_down():
    """The server's teardown once ran 0.4-0.5 s of CPU after the command had returned, which the next command's
    load counted as other work: its last preload makes its exit the first thing it does at exit."""
    from pipesim.workload.processes import PRELOAD

    assert PRELOAD[-1] == "pipesim.workload.server_exit"
    done = subprocess.run([sys.executable, "-c", "import atexit; atexit.register(print, 'torn down'); "
                           "import pipesim.workload.server_exit"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "torn down" not in done.stdout


def _host_files(root: Path, files: dict[str, str]) -> Path:
    """A file system under `root` holding `files` (paths under it: their text)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_containers_memory_left_counts_its_reclaimable_page_cache_and_its_cgroups_ancestors(tmp_path):
    """calibrate refuses a model whose weights outgrow the memory left (`available_memory_bytes`). A container's
    cgroup charge counts its page cache, which reading files fills up to its limit and the kernel reclaims before
    an OOM kill: the limit less the charge read about nothing left, where the working set (the charge less the
    inactive file cache, as cAdvisor counts it) leaves most of it. A cgroup v1 limit, and one set on an ancestor
    (a systemd slice's), were not read at all."""
    gib = 2 ** 30
    meminfo = f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {48 * gib // 1024} kB\n"
    v2 = _host_files(tmp_path / "v2", {
        "proc/meminfo": meminfo, "proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": f"{8 * gib}\n",
        "sys/fs/cgroup/memory.current": f"{8 * gib}\n",
        "sys/fs/cgroup/memory.stat": f"anon {gib}\nfile {7 * gib}\ninactive_file {6 * gib}\n"})
    assert hostload.available_memory_bytes(v2) == 6 * gib
    v1 = _host_files(tmp_path / "v1", {  # docker on cgroup v1: the mount is the container's cgroup, not its path
        "proc/meminfo": meminfo, "proc/self/cgroup": "5:memory:/docker/0a1b\n1:cpu,cpuacct:/docker/0a1b\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * gib}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{3 * gib}\n",
        "sys/fs/cgroup/memory/memory.stat": f"cache {2 * gib}\ntotal_inactive_file {gib}\n"})
    assert hostload.available_memory_bytes(v1) == 2 * gib
    slice_ = _host_files(tmp_path / "slice", {  # the limit on the slice, none on the process's own cgroup
        "proc/meminfo": meminfo, "proc/self/cgroup": "0::/user.slice/session-3.scope\n",
        "sys/fs/cgroup/user.slice/memory.max": f"{10 * gib}\n", "sys/fs/cgroup/user.slice/memory.current": f"{gib}\n",
        "sys/fs/cgroup/user.slice/memory.stat": "inactive_file 0\n",
        "sys/fs/cgroup/user.slice/session-3.scope/memory.max": "max\n"})
    assert hostload.available_memory_bytes(slice_) == 9 * gib
    unlimited = _host_files(tmp_path / "unlimited", {"proc/meminfo": meminfo, "proc/self/cgroup": "0::/\n",
                                                     "sys/fs/cgroup/memory.max": "max\n"})
    assert hostload.available_memory_bytes(unlimited) == 48 * gib
    assert hostload.available_memory_bytes(tmp_path / "bare") is None
