"""The trace vocabulary: schema, Chrome Trace JSON I/O, metrics and views. Imports nothing else of pipesim
(but the leaf `units`)."""

from .metrics import DeviceMetrics, StageMetrics, Summary, summarize
from .trace import (
    STREAMS,
    Counter,
    Ops,
    Stream,
    Trace,
    TraceError,
    TraceMeta,
    read_trace,
    write_atomic,
    write_trace,
    write_traces,
)

__all__ = ["STREAMS", "Counter", "DeviceMetrics", "Ops", "StageMetrics", "Stream", "Summary", "Trace", "TraceError",
           "TraceMeta", "read_trace", "summarize", "write_atomic", "write_trace", "write_traces"]
