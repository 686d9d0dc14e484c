"""Imported by the forkserver alone, last of its preloads (workload/processes.py): when the command that
started it ends, the server exits at once instead of tearing torch down, which took 0.4-0.5 s of CPU on the
2-core host after the command had returned, and the next command's measurement of the host's load
(traces/hostload.py) counted it as other work. Ranks forked from the server leave through os._exit and never
run it."""

import atexit
import os

atexit.register(os._exit, 0)
