"""Per-host calibration terms, measured once and kept in the user's cache directory.

Some of what `pipesim calibrate` measures depends on the host, the torch build and the thread count but not on
the model being calibrated: the p2p link and all-reduce between two local ranks, and the executor's own costs
per row on its probe model (calibrate/runtime.py). Measuring them takes most of a calibration's time (each
spawns ranks that import torch), so they are kept here, keyed by everything they depend on, and reused until
`--fresh` measures them again. How the model's stages slow each other on the host (calibrate/contention.py)
depends on both, and is kept too, keyed by the model's workload as well (model, options, cut, dtype,
micro-batch, threads, processes), for a calibration of the same model again. What depends on the model alone
(its layers, stage passes and steps, the gaps after its rows) is measured every time.

A cache never changes an answer silently: an entry records when it was measured, the host's load meanwhile and the
load when the calibration that measured it began (traces/hostload.py), and is measured again, saying why, when it
is older than MAX_AGE_S or that load per core differs from the load when this calibration began (the 2-core host's
contention factor went from 1.24x to 2.31x in 20 minutes, and a factor kept from a busy hour doubled a quiet hour's
predictions). Both are taken with nothing of the calibration running: the load while a term is measured is only the
others' share of the cores its ranks leave them, so it is compared one way only: a term measured while the others
kept the host busy even beside its ranks (a busy moment that can come after a quiet start) is measured again where
the host is quiet now, by more than LOAD_TOLERANCE_PER_CORE less (`quieter_now`), for the others would have had
more of the cores with the ranks gone. Where the others fill the cores, their CPU time reads the same however many
wait, so a term kept from a busy host is reused on one busy now only where the load averages at the two starts are
within BUSY_LOAD_PER_CORE a core (`queues_differ`: five calibrations of docs/auto.md's mlp began at 0.81-0.86 per
core from CPU time and load averages of 6.6 to 14.0 on 2 cores, and a busy loop alone took 3.2x to 7.5x its median
iteration).

The directory is `$PIPESIM_CACHE_DIR`, else `$XDG_CACHE_HOME/pipesim`, else `~/.cache/pipesim`. One JSON file
per entry, written atomically; a file that cannot be read or does not match its key is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..traces import write_atomic
from ..traces.hostload import (
    BUSY_LOAD_PER_CORE,
    LOAD_TOLERANCE_PER_CORE,
    HostLoad,
    format_age,
    loads_differ,
    mark,
    queues_differ,
    quieter_now,
    utc_now,
)
from ..workload.cachedir import cache_dir

CACHE_VERSION = 6  # raised when what a cached entry holds, or how it is measured, changes (6: the kept gradients)
MAX_AGE_S = 24 * 3600.0  # a kept term older than this is measured again


def host_identity() -> dict[str, Any]:
    """What a per-host term depends on beyond its own settings: the machine, its cores, python and torch."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cache_version": CACHE_VERSION}


@dataclass(frozen=True)
class Cached:
    """A per-host term as used: its value, when it was measured (UTC, ISO 8601), whether this calibration
    measured it (False: taken from the cache), the host's load while it was measured and when the calibration
    that measured it began (`load_before`; None: not recorded) and, where measured now, why
    (`measured_because`)."""

    value: Any
    measured_at: str
    fresh: bool
    load: HostLoad | None = None
    load_before: HostLoad | None = None
    measured_because: str = ""

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - datetime.fromisoformat(self.measured_at).timestamp())

    def meta(self) -> dict[str, Any]:
        """What the profile records of it (in the term's `meta["host_cache"]`)."""
        return {"measured_at": self.measured_at, "age_s": round(self.age_s, 1), "reused": not self.fresh,
                "load": self.load.to_dict() if self.load is not None else None,
                **({"measured_because": self.measured_because} if self.fresh else {})}

    def describe(self) -> str:
        """One phrase for the output: measured now and why, or how old the cached measurement is and under what
        load it was taken."""
        load = self.load.describe() if self.load is not None else "load not recorded"
        if self.fresh:
            return f"measured now at {load}, kept in the host cache; {self.measured_because}"
        return f"from the host cache, measured {format_age(self.age_s)} ago at {load}; --fresh measures again"


def fresh(measure: Callable[[], Any]) -> Cached:
    """`measure()` taken now, kept nowhere."""
    return Cached(measure(), utc_now(), fresh=True, measured_because="no host cache")


class HostCache:
    """The per-host terms in `directory` (default `cache_dir()`); `fresh` measures every term again (and keeps
    the new value). A kept term is measured again, not reused, when it is older than MAX_AGE_S or when the
    host's load per core when the calibration that measured it began differs from `load_now` (the load when
    this calibration began, `HostLoad.now`; default: taken when first needed) by more than
    LOAD_TOLERANCE_PER_CORE (traces/hostload.py), or when it does not say, or when both are busy and their load
    averages differ by more than BUSY_LOAD_PER_CORE a core, or when the host was busy while it was measured and is
    quiet now. A directory that cannot be written only loses the reuse: the measurement
    still counts."""

    def __init__(self, directory: Path | None = None, fresh: bool = False, load_now: HostLoad | None = None) -> None:
        self.directory = directory if directory is not None else cache_dir()
        self.fresh = fresh
        self._load_now = load_now
        self.unwritable: str | None = None  # why the last store failed, if it did
        self._missed: dict[Path, str] = {}  # why `find` found no term to reuse at a path, for `keep` to say

    @property
    def load_now(self) -> HostLoad:
        if self._load_now is None:
            self._load_now = HostLoad.now()
        return self._load_now

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{kind}-{digest}.json"

    def get(self, kind: str, settings: dict[str, Any], measure: Callable[[], Any], own_tasks: int) -> Cached:
        """The term `kind` measured with `settings` on this host: from the cache where it holds one to reuse,
        else `measure()` (a JSON-serialisable value, running up to `own_tasks` busy tasks of its own), which is
        then kept with the host's load while it ran."""
        found = self.find(kind, settings)
        if found is not None:
            return found
        start = mark()
        value = measure()
        return self.keep(kind, settings, value, HostLoad.since(start, own_tasks))

    def find(self, kind: str, settings: dict[str, Any]) -> Cached | None:
        """The term `kind` measured with `settings` on this host, if the cache holds one to reuse (not `fresh`,
        not too old, measured under the load there is now)."""
        path, key = self._located(kind, settings)
        entry, unread = (None, "--fresh") if self.fresh else _read(path, key)
        why = unread if entry is None else self._stale(entry)
        if why is None:
            return entry
        self._missed[path] = why
        return None

    def _stale(self, entry: Cached) -> str | None:
        """Why a kept `entry` must be measured again, or None where it holds now."""
        if entry.age_s > MAX_AGE_S:
            return f"the cached one is {format_age(entry.age_s)} old, kept {format_age(MAX_AGE_S)} at most"
        then, now = entry.load_before, self.load_now
        if then is None and now.per_core is not None:
            return "the cached one does not say the host's load when it was measured"
        if loads_differ(then, now):
            return (f"the cached one's calibration began at {then.describe()}, this one at "
                    f"{now.per_core:.2f} per core, more than {LOAD_TOLERANCE_PER_CORE} apart")
        if queues_differ(then, now):
            return (f"the cached one's calibration began at {then.describe()} and a load average of {then.before:.1f}, "
                    f"this one at {now.per_core:.2f} per core and a load average of {now.before:.1f}: the others fill "
                    f"the cores, and their load averages are more than {BUSY_LOAD_PER_CORE:g} a core apart")
        if quieter_now(entry.load, now):
            return (f"the cached one was measured on a busy host ({entry.load.describe()} beside its own ranks), "
                    f"and the host is quiet now ({now.per_core:.2f} per core, more than {LOAD_TOLERANCE_PER_CORE} "
                    "less)")
        return None

    def keep(self, kind: str, settings: dict[str, Any], value: Any, load: HostLoad) -> Cached:
        """`value` (JSON-serialisable), measured just now with `settings` under `load`, kept for the next
        calibration."""
        path, key = self._located(kind, settings)
        entry = Cached(value, utc_now(), fresh=True, load=load, load_before=self.load_now,
                       measured_because=self._missed.pop(path, "none was cached"))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"key": key, "measured_at": entry.measured_at, "load": load.to_dict(),
                                           "load_before": self.load_now.to_dict(), "value": entry.value}) + "\n")
        except OSError as exc:
            self.unwritable = f"{self.directory}: {exc.strerror or exc}"
        return entry

    def _located(self, kind: str, settings: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        key = json.loads(json.dumps({"kind": kind, **settings, **host_identity()}))  # as it reads back
        return self.path(kind, key), key


def _read(path: Path, key: dict[str, Any]) -> tuple[Cached | None, str]:
    """The entry at `path` if it is readable and was measured for `key`, else None and why: none kept, or one that
    cannot be read (cut short, edited), which is measured again too but not said to be missing."""
    if not path.exists():
        return None, "none was cached"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw["key"] != key:
            return None, "none was cached"
        datetime.fromisoformat(raw["measured_at"])
        return Cached(raw["value"], raw["measured_at"], fresh=False, load=HostLoad.from_dict(raw.get("load")),
                      load_before=HostLoad.from_dict(raw.get("load_before"))), ""
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the cached one could not be read ({type(exc).__name__})"
