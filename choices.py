"""The one line refusing a value that is not one of a fixed few, written once, so that every reader of a flag or a
field (the commands, the schedules, the costs, the count, the estimate) says it alike. A leaf module (it imports
nothing of pipesim, nor torch), so any of them may use it, `pipesim simulate` included."""

from __future__ import annotations

from collections.abc import Iterable


def choose_from(flag: str, choices: Iterable[object], value: object) -> str:
    """The refusal "flag: choose from a, b, c (got 'value')": the flag or field as its reader names it, each choice
    as its str (ZeRO's stages are numbers), the value as given (its repr, so that an empty or spaced one shows)."""
    return f"{flag}: choose from {', '.join(map(str, choices))} (got {value!r})"
