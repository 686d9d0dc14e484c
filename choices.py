"""The one line refusing a value that is not one of a fixed few (or a list with names not among them), written once,
so that every reader of a flag or a field (the commands, the schedules, the costs, the count, the estimate, the
sweep's grid) says it alike. A leaf module (it imports
nothing of pipesim, nor torch), so any of them may use it, `pipesim simulate` included."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def choose_from(flag: str, choices: Iterable[object], value: object) -> str:
    """The refusal "flag: choose from a, b, c (got 'value')": the flag or field as its reader names it, each choice
    as its str (ZeRO's stages are numbers), the value as given (its repr, so that an empty or spaced one shows)."""
    return f"{flag}: choose from {', '.join(map(str, choices))} (got {value!r})"


def nearest_text(name: object, known: Iterable[object], prefix: str = "") -> str:
    """" (did you mean '1f1b'?)" for the known name closest to a misspelt one (its case and underscores aside:
    "H100_SXM", "1FB1"), else nothing: the one meant is easy to miss in the list of every name that follows. A name
    that begins known ones is answered with them (" (did you mean 'h100-sxm' or 'h100-pcie'?)"), where the closest
    spelling of "h100" was 'h800'. `prefix`, which every name (given and known) begins with, is no part of the
    likeness: "--zero" was near "--lr" by its dashes."""
    if not isinstance(name, str):
        return ""
    given = name.removeprefix(prefix).lower().replace("_", "-")
    names = [str(known_name).removeprefix(prefix) for known_name in known]
    nearest = [known_name for known_name in names if given and known_name.startswith(given)] or (
        difflib.get_close_matches(given, names, n=1))
    if not nearest:
        return ""
    *others, last = (repr(prefix + known_name) for known_name in nearest)
    return f" (did you mean {', '.join(others) + ' or ' if others else ''}{last}?)"


def unknown_names(flag: str, unknown: Iterable[object], choices: Iterable[object]) -> str:
    """The refusal "flag: unknown 'x' (did you mean 'y'?), 'z'; choose from a, b, c" of a list of names (a comma list
    of schedules, a grid's axis) or one name, each unknown one as given (its repr) with the nearest choice, if any."""
    choices = list(choices)
    named = ", ".join(f"{name!r}{nearest_text(name, choices)}" for name in unknown)
    return f"{flag}: unknown {named}; choose from {', '.join(map(str, choices))}"


DEVICES = ("cpu", "cuda")  # --device's names (calibrate, run): torch's device types pipesim runs on


def device_refusal(name: str) -> str | None:
    """The one line refusing a --device that is not one of `DEVICES` (None for one that is), read before torch is
    imported: whether torch sees a GPU is asked only of a name that is."""
    return None if name in DEVICES else choose_from("--device", DEVICES, name)


BACKENDS = ("auto", "gloo", "nccl")  # run's --backend: the ranks' torch.distributed backend (auto: by the device)


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")  # the simulator's --optimizer names; momentum is SGD-momentum


def optimizer_refusal(name: str, flag: str = "optimizer") -> str | None:
    """The one line refusing an optimizer that is not one of `OPTIMIZERS`, naming it as its reader does (`flag`: the
    commands' --optimizer); None for one that is. Every reader of an optimizer's name, from the commands to the
    estimate and the executor's optimizers, refuses with it. Here, not in the profile schema (which re-exports
    both), so that a run from cost flags checks --optimizer without importing the schema."""
    return None if name in OPTIMIZERS else choose_from(flag, OPTIMIZERS, name)
