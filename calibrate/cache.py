"""Per-host calibration terms, measured once and kept in the user's cache directory.

Some of what `pipesim calibrate` measures depends on the host, the torch build and the thread count but not on
the model being calibrated: the p2p link and all-reduce between two local ranks, and the executor's own costs
per row on its probe model (calibrate/runtime.py). Measuring them takes most of a calibration's time (each
spawns ranks that import torch), so they are kept here, keyed by everything they depend on, and reused until
`--fresh` measures them again. How the model's stages slow each other on the host (calibrate/contention.py)
depends on both, and is kept too, keyed by the model's workload as well (model, options, cut, dtype,
micro-batch, threads, processes), for a calibration of the same model again. What depends on the model alone
(its layers, stage passes and steps, the gaps after its rows) is measured every time.

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..traces import write_atomic
from ..workload.cachedir import cache_dir

CACHE_VERSION = 3  # raised when what a cached entry holds, or how it is measured, changes


def host_identity() -> dict[str, Any]:
    """What a per-host term depends on beyond its own settings: the machine, its cores, python and torch."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cache_version": CACHE_VERSION}


@dataclass(frozen=True)
class Cached:
    """A per-host term as used: its value, when it was measured (UTC, ISO 8601), and whether this calibration
    measured it (False: taken from the cache)."""

    value: Any
    measured_at: str
    fresh: bool

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - datetime.fromisoformat(self.measured_at).timestamp())

    def meta(self) -> dict[str, Any]:
        """What the profile records of it (in the term's `meta["host_cache"]`)."""
        return {"measured_at": self.measured_at, "age_s": round(self.age_s, 1), "reused": not self.fresh}

    def describe(self) -> str:
        """One phrase for the output: measured now, or how old the cached measurement is."""
        return "measured now, kept in the host cache" if self.fresh else \
            f"from the host cache, measured {format_age(self.age_s)} ago; --fresh measures again"


def fresh(measure: Callable[[], Any]) -> Cached:
    """`measure()` taken now, kept nowhere."""
    return measured_now(measure())


def measured_now(value: Any) -> Cached:
    """`value`, measured just now."""
    return Cached(value, datetime.now(timezone.utc).isoformat(timespec="seconds"), fresh=True)


def format_age(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit}"
    return f"{seconds:.0f} s"


class HostCache:
    """The per-host terms in `directory` (default `cache_dir()`); `fresh` measures every term again (and keeps
    the new value). A directory that cannot be written only loses the reuse: the measurement still counts."""

    def __init__(self, directory: Path | None = None, fresh: bool = False) -> None:
        self.directory = directory if directory is not None else cache_dir()
        self.fresh = fresh
        self.unwritable: str | None = None  # why the last store failed, if it did

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{kind}-{digest}.json"

    def get(self, kind: str, settings: dict[str, Any], measure: Callable[[], Any]) -> Cached:
        """The term `kind` measured with `settings` on this host: from the cache unless fresh or not there,
        else `measure()` (a JSON-serialisable value), which is then kept."""
        found = self.find(kind, settings)
        return found if found is not None else self.keep(kind, settings, measure())

    def find(self, kind: str, settings: dict[str, Any]) -> Cached | None:
        """The term `kind` measured with `settings` on this host, if the cache holds it and is not fresh."""
        return None if self.fresh else _read(*self._located(kind, settings))

    def keep(self, kind: str, settings: dict[str, Any], value: Any) -> Cached:
        """`value` (JSON-serialisable), measured now with `settings`, kept for the next calibration."""
        entry = measured_now(value)
        path, key = self._located(kind, settings)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"key": key, "measured_at": entry.measured_at, "value": entry.value}) + "\n")
        except OSError as exc:
            self.unwritable = f"{self.directory}: {exc.strerror or exc}"
        return entry

    def _located(self, kind: str, settings: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        key = json.loads(json.dumps({"kind": kind, **settings, **host_identity()}))  # as it reads back
        return self.path(kind, key), key


def _read(path: Path, key: dict[str, Any]) -> Cached | None:
    """The entry at `path` if it is readable and was measured for `key`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw["key"] != key:
            return None
        datetime.fromisoformat(raw["measured_at"])
        return Cached(raw["value"], raw["measured_at"], fresh=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None
