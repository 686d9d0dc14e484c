"""Every method pipesim knows, by the name the command line uses."""

from __future__ import annotations

from ..choices import unknown_names
from .asynchronous import ASYNCHRONOUS
from .graph import GRAPH
from .ir import Schedule, ScheduleError
from .methods import BASELINES, Method, ScheduleParams
from .rivals import RIVALS


def _searched(params: ScheduleParams) -> Schedule:
    """`auto` without costs: its order is searched from them, which this cost-free package does not know."""
    raise ScheduleError("auto searches its order from the stage costs, which it needs: build it where costs are "
                        "known (pipesim simulate, sweep or tune; planning.scenario.Scenario.build)")


SEARCHED = (
    Method("auto", "Searched for the costs given: the fastest synchronous order (split backward where it helps) "
           "under --activation-limit", _searched, options=frozenset({"activation_limit", "search_seconds"}),
           needs_costs=True, partitioned_as="1f1b", splits_backward=True),
)
_ALL = {method.name: method for method in (*BASELINES, *RIVALS, *SEARCHED, *ASYNCHRONOUS, *GRAPH)}
# The order the command line lists them in: fixed synchronous methods, the searched one, asynchronous ones, the rest.
_ORDER = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe", "auto", "pipedream",
          "pipedream-2bw", "spectrain", "pipeoptim", "xpipe", "avgpipe", "graphpipe")
METHODS: dict[str, Method] = {name: _ALL[name] for name in sorted(_ALL, key=lambda n: (_ORDER + (n,)).index(n))}


def method_named(name: str) -> Method:
    """The method called `name`; an unknown name raises ScheduleError listing the known ones, naming --schedule,
    the flag every command takes a method by (as simulate's and sweep's own check of it says)."""
    method = METHODS.get(name)
    if method is None:
        raise ScheduleError(unknown_names("--schedule", [name], METHODS))
    return method


def build_schedule(name: str, params: ScheduleParams) -> Schedule:
    """Build the named method's schedule; unknown names and impossible configurations raise ScheduleError."""
    return method_named(name).build(params)
