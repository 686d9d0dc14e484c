"""The host's load while something was measured, and the rule for when two such loads differ.

A CPU host's other work takes cores from a measurement: the same calibration measured two ranks computing at
once 1.24x their time alone, and 2.31x twenty minutes later, and a contention factor kept from a busy hour
doubled predictions in a quiet one. So every measurement that may be reused or compared (a host cache entry, a
calibration, a run) records the others' load over its window (`HostLoad`): where Linux's /proc keeps CPU time,
the cores the host's other work kept busy, measured directly (`others_cores`): the busy time of the usable CPUs
(/proc/stat) less the CPU time of this process tree (its live processes, read from /proc/PID/stat, and those it
waited for), over the wall time. The tree is the command's: itself, its forkserver and every rank forked from
it, alive or ended; under torchrun, the agent's, whose children are this host's ranks of the job. A process whose
parent ends before it (a rank's helper, ranks whose launcher died) would leave the tree for init, which reaps it,
taking its CPU time with it and counting it as others' work: the command is its descendants' subreaper instead
(Linux's prctl), so they stay in its tree (the torchrun agent is not ours to set: its orphans still leave). Elsewhere it
falls back on the 1-minute load average at the window's start and end, less the most the measurement's own
tasks can have added (the kernel's average moves towards the running count by 1 - e^(-t/60) over t seconds);
that average still counts the tail of the command before (on an idle 2-core host, a run at once after a
calibration read 0.26 to 0.80 per core), which CPU time does not. With neither, the load is unknown, and said so.

"Usable" CPUs are this process's affinity: a container's cpuset or a taskset. /proc/stat lists the host's
CPUs by the same numbers, so others' work on cores the measurement cannot use does not count; where /proc/stat
is a container's own view (lxcfs: its own numbering) and does not name each of them, all its CPUs count. A CPU quota
without a cpuset (cgroup cpu.max) leaves every host CPU usable: the load is then the whole host's, per host
core. In a virtual machine, time the hypervisor gave other machines (steal) counts as others' work.

CPU time counts what the others ran, not what they wanted to: while the measurement's own tasks fill the cores,
other work gets its share of them only (4 busy processes beside 2 ranks on 2 cores run 0.67 per core, not the
2 they would alone). So the
load before a calibration, which decides whether a cached term holds (`HostLoad.now`), is taken over
QUIET_WINDOW_S with nothing of the command running, and a cached term keeps the load taken so when the
calibration that measured it began, to be compared like with like.

Two loads differ when their others' load per usable core differs by more than LOAD_TOLERANCE_PER_CORE: on the
2-core host one more busy process beside a 2-rank run takes a third of each rank's time. Loads taken by the two
measures are not compared. A host is busy when other work shared every rank's core: from BUSY_CPU_PER_CORE of
each core's time to others (one busy process per core beside a rank per core takes half), or a load average of
BUSY_LOAD_PER_CORE. Such load moves from minute to minute (the same calibration and run at a load average of 2
per core once predicted +96 %, each condition alike).
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

from ..launch import under_torchrun
from ..units import count_text

LOAD_TOLERANCE_PER_CORE = 0.25  # others' load per core that two measurements may differ by and still compare
BUSY_CPU_PER_CORE = 0.5  # others' share of every usable core's time from which the host is busy (CPU time)
BUSY_LOAD_PER_CORE = 1.0  # the same, read from the load average: another runnable task on every core
LOAD_AVERAGE_WINDOW_S = 60.0  # the 1-minute load average's time constant
QUIET_WINDOW_S = 0.25  # the load now: others' CPU time over this long, with nothing of ours running
# /proc/stat's columns after a cpuN label that count busy time: user, nice, system, irq, softirq and steal (a
# hypervisor running other machines); idle and iowait are not, guest time is inside user already
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
PR_SET_CHILD_SUBREAPER = 36  # Linux's prctl option


def read_load_1min() -> float | None:
    """The host's 1-minute load average now, or None where the platform keeps none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def usable_cpus() -> int:
    """The cores this process may run on (a container's or taskset's share), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# how each memory cgroup hierarchy names its mount, limit, charge (page cache included) and the statistic of the
# page cache the kernel reclaims first, by /proc/self/cgroup's controllers field: v2's is empty, v1's names memory.
# Its working set, the charge less that cache, is what cAdvisor reports and Kubernetes evicts on
# (google/cadvisor container/libcontainer/handler.go setMemoryStats)
MEMORY_CGROUPS = {"": ("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                  "memory": ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file")}


def available_memory_bytes(root: Path = Path("/")) -> int | None:
    """The memory this process may still take without swapping or the kernel's OOM killer: Linux's MemAvailable,
    under a memory cgroup's limit (a container's or a systemd slice's, v2 or v1, on its cgroup or an ancestor's)
    what the cgroup's working set leaves of it where less; None where the platform says neither. A cgroup's charge
    counts its page cache, which a container that read files fills up to its limit and the kernel reclaims before
    any OOM kill: less the inactive part, as MemAvailable counts it. `root`: the file system these are read on."""
    readings: list[int] = []
    with suppress(OSError, ValueError, StopIteration):
        with open(root / "proc/meminfo") as meminfo:
            readings.append(1024 * int(next(line for line in meminfo if line.startswith("MemAvailable:")).split()[1]))
    with suppress(OSError):
        membership = (root / "proc/self/cgroup").read_text().splitlines()
        for _, controllers, path in (line.split(":", 2) for line in membership if line.count(":") >= 2):
            hierarchy = "" if controllers == "" else "memory" if "memory" in controllers.split(",") else None
            if hierarchy is None:
                continue
            mount, *files = MEMORY_CGROUPS[hierarchy]
            folder = root / mount / path.strip("/")
            # its ancestors' limits bind it too; under cgroup v1 a container's mount is its own cgroup, not `path`
            for cgroup in (folder, *folder.parents[:len(folder.parts) - len((root / mount).parts)]):
                readings.extend(_memory_left(cgroup, *files))
    return min(readings, default=None)


def oom_kills(root: Path = Path("/")) -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot, its own or a memory cgroup's
    (Linux's /proc/vmstat `oom_kill`, since 4.13); None where the platform does not say. A rank ended by signal 9
    while it rose was ended for the host's memory, not by a person (executor/runners.py)."""
    with suppress(OSError, ValueError, StopIteration):
        with open(root / "proc/vmstat") as vmstat:
            return int(next(line for line in vmstat if line.startswith("oom_kill ")).split()[1])
    return None


def _memory_left(cgroup: Path, limit_file: str, charge_file: str, cache: str) -> list[int]:
    """What `cgroup`'s memory limit leaves beside its working set: one reading, or none where it sets no limit or
    does not exist here."""
    with suppress(OSError, ValueError, StopIteration):
        limit = int((cgroup / limit_file).read_text())  # v2's "max": no limit, a ValueError
        charge = int((cgroup / charge_file).read_text())
        with open(cgroup / "memory.stat") as stat:
            inactive = int(next(line for line in stat if line.startswith(f"{cache} ")).split()[1])
        return [max(limit - (charge - inactive), 0)]
    return []


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class CpuSample:
    """What the host had run by one moment: the monotonic clock, the CPU-seconds its usable CPUs had been busy
    since boot and those this process tree had used (None: no /proc to read them from), and the 1-minute load
    average (None: the platform keeps none)."""

    monotonic_s: float
    busy_cpu_s: float | None
    own_cpu_s: float | None
    load_1min: float | None


def sample() -> CpuSample:
    """The host's counters now (tests replace this function, and shorten QUIET_WINDOW_S: no test reads the
    machine's load)."""
    return CpuSample(time.monotonic(), _busy_cpu_s(), _own_cpu_s(), read_load_1min())


def _busy_cpu_s() -> float | None:
    """The CPU-seconds the usable CPUs have been busy since boot (all /proc/stat lists where it does not name
    each of them), or None without /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            rows = {int(label[3:]): [int(value) for value in values]
                    for label, *values in (line.split() for line in stat)
                    if label.startswith("cpu") and label[3:].isdigit()}
    except (OSError, ValueError):
        return None
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    counted = [rows[cpu] for cpu in usable] if usable and usable <= rows.keys() else list(rows.values())
    ticks = sum(values[column] for values in counted for column in BUSY_COLUMNS if column < len(values))
    return ticks / os.sysconf("SC_CLK_TCK") if counted else None


def _own_cpu_s() -> float | None:
    """The CPU-seconds this command's process tree has used (under torchrun, the agent's: this host's ranks of
    the job), or None without /proc."""
    if under_torchrun():
        return tree_cpu_s(os.getppid())
    _adopt_orphans()
    processes = _processes()
    if processes is not None:
        _reap_orphans(processes)
    return _tree_cpu_s(processes, os.getpid())


@cache
def _adopt_orphans() -> None:
    """Make this process its descendants' subreaper (Linux; elsewhere nothing changes): one whose parent ends is
    re-parented here, not to init, so `tree_cpu_s` still walks to it, and once it ends its CPU time stays in the
    tree, in its zombie's /proc stat until reaped (`_reap_orphans`), then in this process's cutime."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, TypeError, AttributeError):  # no process-wide C library, or one without prctl
        pass


@dataclass(frozen=True)
class _Process:
    """A process as /proc/PID/stat tells it: its parent, state ("Z": ended, not yet reaped), start (clock ticks
    after boot: with the pid, which a new process may take once this one is reaped, it names this one) and the
    CPU ticks it and the children it waited for used."""

    parent: int
    state: str
    started: int
    ticks: int


# (pid, start) of the processes seen below a child of this command's (alive, or adopted here since): the orphans
# it may reap once they end (`_reap_orphans`)
_below_children: set[tuple[int, int]] = set()


def _reap_orphans(processes: dict[int, _Process]) -> None:
    """Reap the ended orphans this command adopted (`_adopt_orphans`), else they would stay zombies as long as it
    runs (pytest's whole session). Only a process first seen below one of its children is reaped: its own
    children are its subprocesses' and multiprocessing's to wait for, which reaping would rob of their exit
    status. An orphan born and ended between two readings was never seen so; it stays a zombie until this
    command ends (its CPU time counted all the same, in its stat)."""
    me = os.getpid()
    tree = _descendants(processes, me)
    for pid in tree[1:]:
        process = processes[pid]
        key = (pid, process.started)
        if process.parent == me and key in _below_children:
            if process.state == "Z":
                with suppress(ChildProcessError):  # reaped meanwhile by a wait for any child
                    os.waitpid(pid, os.WNOHANG)  # its time moves into this process's cutime: the tree's stays
                _below_children.discard(key)
        elif process.parent != me:
            _below_children.add(key)
    _below_children.intersection_update((pid, processes[pid].started) for pid in tree)


def _processes() -> dict[int, _Process] | None:
    """Every process /proc lists now, by pid, or None without /proc."""
    try:
        names = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    processes = {}
    for name in names:
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:  # ended meanwhile
            continue
        after_name = text[text.rindex(b")") + 2:].split()  # the name in brackets may hold spaces
        processes[int(name)] = _Process(int(after_name[1]), after_name[0].decode(), int(after_name[19]),
                                        sum(int(ticks) for ticks in after_name[11:15]))  # utime, stime, cutime, cstime
    return processes


def _descendants(processes: dict[int, _Process], root: int) -> list[int]:
    """`root`, then every process below it."""
    children: dict[int, list[int]] = {}
    for pid, process in processes.items():
        children.setdefault(process.parent, []).append(pid)
    tree, found = [root], []
    while tree:
        pid = tree.pop()
        found.append(pid)
        tree += children.get(pid, [])
    return found


def tree_cpu_s(root: int) -> float | None:
    """The CPU-seconds process `root` and its descendants have used: each live process's own and what its ended
    children used (those it waited for), or None without /proc or where `root` has ended."""
    return _tree_cpu_s(_processes(), root)


def _tree_cpu_s(processes: dict[int, _Process] | None, root: int) -> float | None:
    if processes is None or root not in processes:
        return None
    return sum(processes[pid].ticks for pid in _descendants(processes, root)) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class LoadMark:
    """The start of a measurement: when (UTC, ISO 8601) and the host's counters then."""

    at: str
    counters: CpuSample


def mark() -> LoadMark:
    return LoadMark(utc_now(), sample())


@dataclass(frozen=True)
class HostLoad:
    """The host's load over one measurement: the cores the host's other work kept busy (`others_cores`, from
    CPU time; None: not measured, a record from before it was or a platform without /proc), the 1-minute load
    average at its start (`before`) and end (`after`; None: the platform keeps none), `seconds` between them,
    the usable `cpus`, the busy tasks the measurement ran itself at most (`own_tasks`: processes x threads, for
    the load average), and when it began (`began_at`, UTC)."""

    before: float | None
    after: float | None
    seconds: float
    cpus: int
    own_tasks: int
    began_at: str
    others_cores: float | None = None

    @classmethod
    def since(cls, start: LoadMark, own_tasks: int) -> HostLoad:
        """The load from `start` until now, of a measurement that ran up to `own_tasks` busy tasks."""
        first, last = start.counters, sample()
        seconds = last.monotonic_s - first.monotonic_s
        others = None
        if None not in (first.busy_cpu_s, last.busy_cpu_s, first.own_cpu_s, last.own_cpu_s) and seconds > 0:
            others_cpu_s = (last.busy_cpu_s - first.busy_cpu_s) - (last.own_cpu_s - first.own_cpu_s)
            others = round(max(0.0, others_cpu_s) / seconds, 3)
        return cls(first.load_1min, last.load_1min, round(seconds, 2), usable_cpus(), own_tasks, start.at, others)

    @classmethod
    def now(cls, start: LoadMark | None = None) -> HostLoad:
        """The others' load now: their CPU time over QUIET_WINDOW_S from `start` (default: now) while this
        command runs nothing (where /proc has none: the load average at `start`)."""
        start = start if start is not None else mark()
        if start.counters.busy_cpu_s is None:
            return cls(start.counters.load_1min, start.counters.load_1min, 0.0, usable_cpus(), 0, start.at)
        time.sleep(QUIET_WINDOW_S)
        return cls.since(start, 0)

    @property
    def measure(self) -> str | None:
        """What the load was read from: "CPU time" or "load average" (None: neither, unknown)."""
        if self.others_cores is not None:
            return "CPU time"
        return None if self.before is None or self.after is None else "load average"

    @property
    def others(self) -> float | None:
        """The load of the host's other work: the cores it kept busy, else the mean of the load average at the
        start and the one at the end less what the measurement's own tasks can have added (None: unknown)."""
        if self.others_cores is not None:
            return self.others_cores
        if self.before is None or self.after is None:
            return None
        own = self.own_tasks * (1 - math.exp(-self.seconds / LOAD_AVERAGE_WINDOW_S))
        return (self.before + max(0.0, self.after - own)) / 2

    @property
    def per_core(self) -> float | None:
        others = self.others
        return None if others is None else others / self.cpus

    @property
    def busy_from(self) -> float:
        """The others' load per core from which the host is busy, by its measure."""
        return BUSY_CPU_PER_CORE if self.others_cores is not None else BUSY_LOAD_PER_CORE

    @property
    def busy(self) -> bool:
        return self.per_core is not None and self.per_core >= self.busy_from

    def figure(self) -> str:
        """E.g. "0.05 on 2 cores (0.03 per core, from CPU time)", or that it is unknown."""
        if self.others is None:
            return "unknown (this platform keeps neither CPU time nor a load average)"
        return (f"{self.others:.2f} on {count_text(self.cpus, 'core')} ({self.per_core:.2f} per core, "
                f"from {self.measure})")

    def describe(self) -> str:
        """E.g. "others' load 0.05 on 2 cores (0.03 per core, from CPU time)"."""
        return f"others' load {self.figure()}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> HostLoad | None:
        """A load as `to_dict` wrote it, or as it was written before `others_cores` was (None there); None where
        `doc` is absent or not one (a file from before loads were recorded, or edited by hand)."""
        names = {field.name for field in fields(cls)}
        if not isinstance(doc, dict) or set(doc) not in (names, names - {"others_cores"}):
            return None
        number = (int, float)
        readings = all(doc.get(name) is None or isinstance(doc[name], number) for name in ("before", "after"))
        counts = all(isinstance(doc[name], int) and doc[name] >= 0 for name in ("cpus", "own_tasks"))
        others = doc.get("others_cores")
        measured = others is None or isinstance(others, number) and others >= 0
        if not (readings and counts and measured and doc["cpus"] >= 1 and isinstance(doc["seconds"], number)
                and isinstance(doc["began_at"], str)):
            return None
        return cls(**doc)


def ranks_per_host(hardware: dict[str, Any] | None) -> int | None:
    """The most ranks a measured run had on one host (its `hardware["compute"]` names each rank's `host/device`;
    without it, all its ranks), or None where it does not say."""
    hardware = hardware or {}
    places = [place.rsplit("/", 1)[0] for place in hardware.get("compute") or [] if isinstance(place, str)]
    if places:
        return max(places.count(host) for host in set(places))
    ranks = hardware.get("ranks")
    return int(ranks) if isinstance(ranks, int) else None


def loads_differ(first: HostLoad | None, second: HostLoad | None) -> bool:
    """Whether the others' load per core of two measurements differs by more than LOAD_TOLERANCE_PER_CORE
    (False where either is unknown or they were read by different measures: nothing to tell them apart by)."""
    if first is None or second is None or first.measure is None or first.measure != second.measure:
        return False
    return abs(first.per_core - second.per_core) > LOAD_TOLERANCE_PER_CORE


def quieter_now(measured: HostLoad | None, now: HostLoad) -> bool:
    """Whether a term `measured` on a busy host (the others' load beside its ranks, which leave them less than they
    take alone: compared one way only) finds the host quiet `now` (the others' load with nothing of the command
    running), by more than LOAD_TOLERANCE_PER_CORE a core less. The busy/quiet line alone measured a term again
    where the others kept 0.50 per core busy beside its ranks and 0.49 alone, and called 0.49 quiet."""
    if measured is None or not measured.busy or now.busy or now.per_core is None or measured.measure != now.measure:
        return False
    return measured.per_core - now.per_core > LOAD_TOLERANCE_PER_CORE


def queues_differ(first: HostLoad | None, second: HostLoad | None) -> bool:
    """Whether two loads that both read busy from CPU time had 1-minute load averages at their start more than
    BUSY_LOAD_PER_CORE apart per usable core (another runnable task on every core). The others' CPU time cannot
    exceed the cores they are left, so once they fill them it reads the same however many of them wait: five
    calibrations of one model began at 0.81-0.86 per core and load averages of 6.6 to 14.0 on 2 cores, and a busy
    loop alone took 3.2x to 7.5x its median iteration. The load average counts the waiting ones (and the tail of
    this command's own previous one, at most 0.8 per core on the idle 2-core host: within the margin)."""
    if first is None or second is None or not (first.busy and second.busy) or first.measure != "CPU time" \
            or second.measure != "CPU time" or first.before is None or second.before is None:
        return False
    return abs(first.before / first.cpus - second.before / second.cpus) > BUSY_LOAD_PER_CORE


def format_age(seconds: float) -> str:
    """E.g. "12 s", "5 min", "3 h", "2 d"."""
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit}"
    return f"{seconds:.0f} s"


def seconds_between(earlier: str, later: str) -> float | None:
    """Seconds from ISO 8601 time `earlier` to `later`; None where either does not parse."""
    try:
        return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()
    except (TypeError, ValueError):
        return None
