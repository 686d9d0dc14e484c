"""Every method pipesim knows, by the name the command line uses."""

from __future__ import annotations

from .asynchronous import ASYNCHRONOUS
from .graph import GRAPH
from .ir import Schedule, ScheduleError
from .methods import BASELINES, Method, ScheduleParams
from .rivals import RIVALS

_ALL = {method.name: method for method in (*BASELINES, *RIVALS, *ASYNCHRONOUS, *GRAPH)}
# The order the command line lists them in: synchronous methods, then asynchronous ones, then the rest.
_ORDER = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "pipedream",
          "pipedream-2bw", "spectrain", "pipeoptim", "xpipe", "avgpipe", "graphpipe")
METHODS: dict[str, Method] = {name: _ALL[name] for name in sorted(_ALL, key=lambda n: (_ORDER + (n,)).index(n))}


def method_named(name: str) -> Method:
    """The method called `name`; an unknown name raises ScheduleError listing the known ones."""
    method = METHODS.get(name)
    if method is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(METHODS)}")
    return method


def build_schedule(name: str, params: ScheduleParams) -> Schedule:
    """Build the named method's schedule; unknown names and impossible configurations raise ScheduleError."""
    return method_named(name).build(params)
