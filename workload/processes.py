"""Starting the processes that stand for a run's ranks (the executor's, and calibration's contention probe)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def start_processes(procs: list[Any], threads_per_process: int) -> None:
    """Start `procs` with OMP_NUM_THREADS set for them (torch reads it as it loads; this process keeps its own)
    and SIGINT ignored, which a spawned interpreter keeps: Ctrl-C reaches the whole terminal group, and the
    parent alone answers it, by ending them all. Their arguments are small, so the parent ignores SIGINT only
    for the moments each start takes."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process)
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for proc in procs:
            proc.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
