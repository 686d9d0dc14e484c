"""The benchmark scripts' argument parser: a bad flag or value is one line on stderr, "error: " and what is wrong,
exit 2, before anything runs (no usage block, no torch imported for it), as pipesim's own commands refuse."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from pipesim.units import given_text, number_allowed


def refuse(message: str) -> None:
    """Say why the script stops, in one line on stderr, as pipesim's own commands do ("error: " first)."""
    print(f"error: {message}", file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals, and the script's own (`parser.error`), in one line: "error: " and the flag and what it
    allows, exit 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        refuse(message)
        raise SystemExit(2)


def whole_number_of(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `least`, refused in the command line's words ("give a whole
    number of at least 1 (got 0)", units.py `number_allowed`) before anything runs."""
    def parsed(text: str) -> int:
        if not text.strip().lstrip("-").isdecimal() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{number_allowed(least, None)} (got {given_text(text.strip())})")
        return int(text)
    return parsed


# A flag's count (repeats, rounds, mini-batches), where 0 ended in a traceback on an empty median or an empty table
positive_int = whole_number_of(1)


def positive_number(text: str) -> float:
    """A flag's finite number above 0 (seconds, a budget)."""
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{number_allowed(0, None, whole=False, finite=True, above=True)} "
                                         f"(got {given_text(text.strip())})")
    return number


def positive_ints(text: str) -> list[int]:
    """A flag's comma-separated counts ("1,2")."""
    if not all(part.strip().isdigit() and int(part) >= 1 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"give whole numbers of at least 1, comma-separated, such as 1,2 "
                                         f"(got {text!r})")
    return [int(part) for part in text.split(",")]


def pipeline_sizes(text: str) -> list[tuple[int, int]]:
    """A flag's comma-separated pipeline sizes, each stages x micro-batches ("8x32,32x256")."""
    sizes = [part.split("x") for part in text.split(",")]
    if not all(len(size) == 2 and all(n.strip().isdigit() and int(n) >= 1 for n in size) for size in sizes):
        raise argparse.ArgumentTypeError(f"give sizes PxM (stages x micro-batches, each at least 1), "
                                         f"comma-separated, such as 8x32,32x256 (got {text!r})")
    return [(int(p), int(m)) for p, m in sizes]
