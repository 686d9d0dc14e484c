"""Reading the files users give: one-line errors that name the file and the first field that is wrong.

A leaf like `units`: the catalogue, the profile schema and the sweep's grid read their files through it, so every
file a user hands pipesim fails the same way."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def read_toml(path: Path, error: type[Exception], prefix: str = "") -> dict:
    """The TOML document at `path`; an unreadable, non-UTF-8 or invalid file raises `error` (its message led by
    `prefix`, e.g. the flag that named the file)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{prefix}cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{prefix}{path} is not a text (UTF-8) file") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{prefix}{path} is not valid TOML: {exc}") from None


def first_error(exc: Any) -> str:
    """A pydantic ValidationError's first error as `field.path: message` (just the message at the top level)."""
    err = exc.errors()[0]
    where = ".".join(map(str, err["loc"]))
    return f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}"
