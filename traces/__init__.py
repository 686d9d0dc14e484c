"""The trace vocabulary: schema, Chrome Trace JSON I/O, metrics and views. Imports nothing else of pipesim."""

from .metrics import DeviceMetrics, StageMetrics, Summary, summarize
from .trace import STREAMS, Counter, Ops, Trace, TraceError, read_trace, write_atomic, write_trace

__all__ = ["STREAMS", "Counter", "DeviceMetrics", "Ops", "StageMetrics", "Summary", "Trace", "TraceError",
           "read_trace", "summarize", "write_atomic", "write_trace"]
