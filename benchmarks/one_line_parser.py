"""The benchmark scripts' argument parser: a bad flag or value is one line on stderr, "error: " and what is wrong,
exit 2, before anything runs (no usage block, no torch imported for it), as pipesim's own commands refuse."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def refuse(message: str) -> None:
    """Say why the script stops, in one line on stderr, as pipesim's own commands do ("error: " first)."""
    print(f"error: {message}", file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals, and the script's own (`parser.error`), in one line: "error: " and the flag and what it
    allows, exit 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        refuse(message)
        raise SystemExit(2)
