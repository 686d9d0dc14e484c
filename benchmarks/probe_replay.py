"""What the GPU probe's replays (probe_moe.py, probe_dense.py, probe_attention.py) share: reading the probe's JSON
and pricing it on a catalogue part, a bad `--gpu` or `--probe` refused in one line. No torch, so the attention replay
stays torch-free."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, TypeVar

from one_line_parser import refuse  # this folder's

from pipesim.hardware.catalogue import CatalogueError, load_catalogue
from pipesim.planning.estimate import EstimateError

Priced = TypeVar("Priced")


def refused_gpu(name: str) -> bool:
    """Whether `--gpu` `name` is no part of the catalogue, said in one line on stderr (the parts it knows)."""
    try:
        load_catalogue().find(name)
    except CatalogueError as exc:
        refuse(f"--gpu: {exc}")
        return True
    return False


def replayed(args: argparse.Namespace, part: str, priced_what: str,
             price: Callable[[dict[str, Any]], Priced]) -> Priced | None:
    """`price` of the probe `args.probe` holds on `args.gpu`; None after one line on stderr: `--gpu` for a part the
    catalogue lacks or one that cannot price what the probe timed (`priced_what`, e.g. float8 GEMMs on an A100),
    `--probe` for a file that is not the probe's JSON with its `part` ("dense part"; a malformed field raises in
    `price`)."""
    if refused_gpu(args.gpu):
        return None
    try:
        return price(json.loads(args.probe.read_text()))
    except EstimateError as error:  # a ValueError: the part publishes no rate for a kind the probe timed
        refuse(f"--gpu: {args.gpu} cannot price {args.probe.name}'s {priced_what}: {error}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        refuse(f"--probe: {args.probe} is not a gpu_probe.py JSON with its {part} "
               f"({type(error).__name__}: {error})")
    return None
