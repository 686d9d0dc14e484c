"""The one line refusing a value that is not one of a fixed few (or a list with names not among them), written once,
so that every reader of a flag or a field (the commands, the schedules, the costs, the count, the estimate, the
sweep's grid) says it alike. A leaf module (it imports
nothing of pipesim, nor torch), so any of them may use it, `pipesim simulate` included."""

from __future__ import annotations

from collections.abc import Iterable


def choose_from(flag: str, choices: Iterable[object], value: object) -> str:
    """The refusal "flag: choose from a, b, c (got 'value')": the flag or field as its reader names it, each choice
    as its str (ZeRO's stages are numbers), the value as given (its repr, so that an empty or spaced one shows)."""
    return f"{flag}: choose from {', '.join(map(str, choices))} (got {value!r})"


def unknown_names(flag: str, unknown: Iterable[object], choices: Iterable[object]) -> str:
    """The refusal "flag: unknown 'x', 'y'; choose from a, b, c" of a list of names (a comma list of schedules, a
    grid's axis) or one name, each unknown one as given (its repr)."""
    return f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(map(str, choices))}"
