"""A Hugging Face model named as `hf:PATH` (its config.json, or a folder holding one): where the config is and what
it says, read without torch or transformers, so that a what-if finds its count in the host cache by the config's
content before importing either (workload/hf.py builds the model from it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HF_PREFIX = "hf:"
CONFIG_NAME = "config.json"


class HfConfigError(ValueError):
    """A config that cannot be read; the message is one line naming the file and what is wrong."""


def is_hf(model: str) -> bool:
    """Whether --model names a Hugging Face config (`hf:PATH`) rather than a built-in or a user's module."""
    return model.startswith(HF_PREFIX)


@dataclass(frozen=True)
class HfConfig:
    """`spec` as the user wrote it (`hf:PATH`), the config.json it names and that file's JSON object."""

    spec: str
    path: Path
    fields: dict[str, Any]

    @property
    def model_type(self) -> str:
        return self.fields["model_type"]

    @property
    def digest(self) -> str:
        """What the model is, whatever the file is called or how it is laid out: its fields, sorted."""
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()


def read_hf_config(spec: str) -> HfConfig:
    """The config `spec` names; a missing or unreadable file, or one without a model_type, is `HfConfigError`."""
    given = spec.removeprefix(HF_PREFIX)
    if not given:
        raise HfConfigError(f"--model {spec}: give hf:PATH, a {CONFIG_NAME} or a folder holding one")
    path = Path(given)
    if path.is_dir():
        path = path / CONFIG_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HfConfigError(f"--model {spec}: no {path}; give hf:PATH, a {CONFIG_NAME} or a folder holding "
                            "one") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HfConfigError(f"--model {spec}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HfConfigError(f"--model {spec}: {path} is not JSON ({exc.msg} at line {exc.lineno}); give a Hugging "
                            f"Face {CONFIG_NAME}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise HfConfigError(f"--model {spec}: {path} has no model_type; give a Hugging Face {CONFIG_NAME} "
                            "(model_type says which transformers model it configures)")
    return HfConfig(spec, path, fields)
