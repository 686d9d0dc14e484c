"""The host's load while something was measured, and the rule for when two such loads differ.

A CPU host's other work takes cores from a measurement: the same calibration measured two ranks computing at
once 1.24x their time alone, and 2.31x twenty minutes later, and a contention factor kept from a busy hour
doubled predictions in a quiet one. So every measurement that may be reused or compared (a host cache entry, a
calibration, a run) records the host's 1-minute load average when it began and when it ended, over how many
seconds, on how many usable cores, and how many busy tasks of its own it ran (`HostLoad`). The load it reports
is the others' load: the average of the reading at its start and the one at its end less the most its own
tasks can have added to it (the kernel's average moves towards the running count by 1 - e^(-t/60) over t
seconds). Where the platform keeps no load average (Windows) the load is unknown, and said so.

Two loads differ when their others' load per usable core differs by more than LOAD_TOLERANCE_PER_CORE: on the
2-core host one more busy process beside a 2-rank run takes a third of each rank's time. A host is busy from
BUSY_PER_CORE: every rank then shares its core with other work, whose load moves from minute to minute (the
same calibration and run at 2 per core once predicted +96 %, each condition alike).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

LOAD_TOLERANCE_PER_CORE = 0.25  # others' load per core that two measurements may differ by and still compare
BUSY_PER_CORE = 1.0  # others' load per core from which every rank shares its core with other work
LOAD_AVERAGE_WINDOW_S = 60.0  # the 1-minute load average's time constant


def read_load_1min() -> float | None:
    """The host's 1-minute load average now, or None where the platform keeps none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def usable_cpus() -> int:
    """The cores this process may run on (a container's or taskset's share), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LoadMark:
    """The start of a measurement: the load then, when (UTC, ISO 8601), and the monotonic clock."""

    load_1min: float | None
    at: str
    monotonic_s: float


def mark() -> LoadMark:
    return LoadMark(read_load_1min(), utc_now(), time.monotonic())


@dataclass(frozen=True)
class HostLoad:
    """The host's load over one measurement: the 1-minute load average at its start (`before`) and end
    (`after`; None: the platform keeps none), `seconds` between them, the usable `cpus`, the busy tasks the
    measurement ran itself at most (`own_tasks`: processes x threads), and when it began (`began_at`, UTC)."""

    before: float | None
    after: float | None
    seconds: float
    cpus: int
    own_tasks: int
    began_at: str

    @classmethod
    def since(cls, start: LoadMark, own_tasks: int) -> HostLoad:
        """The load from `start` until now, of a measurement that ran up to `own_tasks` busy tasks."""
        return cls(start.load_1min, read_load_1min(), round(time.monotonic() - start.monotonic_s, 2), usable_cpus(),
                   own_tasks, start.at)

    @classmethod
    def at(cls, start: LoadMark) -> HostLoad:
        """The load at `start` alone (before the measurement started anything)."""
        return cls(start.load_1min, start.load_1min, 0.0, usable_cpus(), 0, start.at)

    @classmethod
    def now(cls) -> HostLoad:
        return cls.at(mark())

    @property
    def others(self) -> float | None:
        """The load of the host's other work: the mean of the reading at the start and the one at the end less
        what the measurement's own tasks can have added (None: unknown)."""
        if self.before is None or self.after is None:
            return None
        own = self.own_tasks * (1 - math.exp(-self.seconds / LOAD_AVERAGE_WINDOW_S))
        return (self.before + max(0.0, self.after - own)) / 2

    @property
    def per_core(self) -> float | None:
        others = self.others
        return None if others is None else others / self.cpus

    def describe(self) -> str:
        """E.g. "load 4.52 on 2 cores (2.26 per core)", or that the platform keeps none."""
        if self.others is None:
            return "load unknown (this platform keeps no load average)"
        return f"load {self.others:.2f} on {self.cpus} core{'s' * (self.cpus != 1)} ({self.per_core:.2f} per core)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> HostLoad | None:
        """A load as `to_dict` wrote it; None where `doc` is absent or not one (a file from before loads were
        recorded)."""
        if not isinstance(doc, dict) or set(doc) != set(cls.__dataclass_fields__):
            return None
        number = (int, float)
        readings = all(doc[name] is None or isinstance(doc[name], number) for name in ("before", "after"))
        counts = all(isinstance(doc[name], int) and doc[name] >= 0 for name in ("cpus", "own_tasks"))
        if not (readings and counts and doc["cpus"] >= 1 and isinstance(doc["seconds"], number)
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
    (False where either is unknown: nothing to tell them apart by)."""
    if first is None or second is None or first.per_core is None or second.per_core is None:
        return False
    return abs(first.per_core - second.per_core) > LOAD_TOLERANCE_PER_CORE


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
