"""Every method pipesim knows, by the name the command line uses (DESIGN §7)."""

from __future__ import annotations

from .ir import Schedule, ScheduleError
from .methods import BASELINES, Method, ScheduleParams

METHODS: dict[str, Method] = {method.name: method for method in (*BASELINES,)}


def build_schedule(name: str, params: ScheduleParams) -> Schedule:
    """Build the named method's schedule; unknown names and impossible configurations raise ScheduleError."""
    method = METHODS.get(name)
    if method is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(METHODS)}")
    return method.build(params)
