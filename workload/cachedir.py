"""Where pipesim keeps what it measures or derives once per host: calibration's per-host terms
(calibrate/cache.py) and the digits split (workload/data.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PIPESIM_CACHE_DIR, else $XDG_CACHE_HOME/pipesim, else ~/.cache/pipesim."""
    if os.environ.get("PIPESIM_CACHE_DIR"):
        return Path(os.environ["PIPESIM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipesim"
