"""The benchmark scripts' argument parser: a bad flag or value is one line on stderr, exit 2, before anything runs
(no usage block, no torch imported for it)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals in one line (the flag and what it allows), exit 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        print(message, file=sys.stderr)
        raise SystemExit(2)
