"""A Hugging Face model named as `hf:PATH` (its config.json, or a folder holding one): where the config is and what
it says, read without torch or transformers, so that a what-if finds its count in the host cache by the config's
content before importing either (workload/hf.py builds the model from it)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import read_json
from ..profiles.workload import HF_PREFIX

CONFIG_NAME = "config.json"
# The figures a dense decoder's config must give (transformers would fill a missing one with its default, another
# model's size), as pipesim names them: its options, which the estimate's tensor-parallel checks read.
FIGURES = {"layers": "num_hidden_layers", "width": "hidden_size", "heads": "num_attention_heads",
           "ffn": "intermediate_size", "vocab": "vocab_size"}
# The sizes a config gives (the key/value heads where it is not the attention heads', the keys a sliding window
# holds), each a whole number of at least 1 where given: transformers builds a model of no decoder layers at 0 or
# fewer, torch fails deep in the count at a width, head or vocabulary of 0, and a window of 0 or fewer holds no
# key (transformers' mask) yet was priced as no window or at negative FLOPs (planning/estimate.py `kernel_flops`)
SIZES = (*FIGURES.values(), "num_key_value_heads", "sliding_window")


class HfConfigError(ValueError):
    """A config that cannot be read; the message is one line naming the file and what is wrong."""


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


def hf_config_path(spec: str) -> Path:
    """The config.json `spec` (`hf:PATH`) names: PATH, or PATH/config.json where PATH is a folder."""
    path = Path(spec.removeprefix(HF_PREFIX))
    return path / CONFIG_NAME if os.path.isdir(path) else path  # False where it cannot be looked at: read it says why


def read_hf_config(spec: str) -> HfConfig:
    """The config `spec` names; a missing or unreadable file, one not a JSON object, one without a model_type or
    one whose `SIZES` are not whole numbers of 1 or more, is `HfConfigError`."""
    given = spec.removeprefix(HF_PREFIX)
    if not given:
        raise HfConfigError(f"--model {spec}: give hf:PATH, a {CONFIG_NAME} or a folder holding one")
    path = hf_config_path(spec)
    try:
        missing = not path.exists()
    except OSError:  # a name too long, a folder that cannot be searched: reading it says which
        missing = False
    if missing:
        raise HfConfigError(f"--model {spec}: no {path}; give hf:PATH, a {CONFIG_NAME} or a folder holding one")
    fields = read_json(path, HfConfigError, "Hugging Face config", f"--model {spec}: ")
    if not isinstance(fields, dict):  # an array, number or string: no fields to read
        raise HfConfigError(f"--model {spec}: {path} is not a JSON object; give a Hugging Face {CONFIG_NAME} "
                            "(an object of fields, model_type among them)")
    if not isinstance(fields.get("model_type"), str):
        raise HfConfigError(f"--model {spec}: {path} has no model_type; give a Hugging Face {CONFIG_NAME} "
                            "(model_type says which transformers model it configures)")
    for field in SIZES:
        value = fields.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HfConfigError(f"--model {spec}: {path} gives {field} {json.dumps(value)}; it must be a whole "
                                "number, 1 or more")
    return HfConfig(spec, path, fields)
