"""`pipesim count`: a model's work per layer, counted by torch on the meta device (workload/count.py)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from ..choices import choose_from
from ..workload.sizes import attention_of, flag_sizes_refusal
from .common import (
    COUNTING_MODEL,
    DTYPES,
    MODEL_SIZES,
    InputError,
    ModelName,
    check_dtype,
    fail,
    model_shape_options,
    refuse,
    require_model,
    say_part_counted,
    stderr,
    transient_status,
)
from .tables import print_message, print_table

if TYPE_CHECKING:
    from ..workload.count import LayerCount, WorkloadCount


@model_shape_options
def count(
    ctx: typer.Context,
    model: ModelName = "gpt",
    microbatch_size: Annotated[int, typer.Option(
        "--microbatch-size", "-b", metavar="B", min=1, help="Samples per micro-batch.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
) -> None:
    """Count a model's work per layer on torch's meta device. Per micro-batch, with no memory and at any size:
    forward, input-gradient and weight-gradient FLOPs, bytes moved by memory-bound ops, bytes saved for the
    backward, weight and Adam-state bytes, and the tensor each layer outputs (what a stage ending there sends)."""
    dtype, attention = ctx.params["dtype"], attention_of(ctx.params["attention"], model)
    try:
        refuse(flag_sizes_refusal(model, {name: ctx.params[name] for name in MODEL_SIZES}))  # before torch's import
        require_model("pipesim count", model)
        check_dtype(dtype)
        with transient_status(COUNTING_MODEL, as_json):
            import torch

            from ..workload.count import ATTENTION, count_built
            from ..workload.models import ModelError

            if attention not in ATTENTION:
                raise InputError(choose_from("--attention", ATTENTION, attention))
            options = {name: ctx.params[name] for name in MODEL_SIZES}
            started = time.perf_counter()
            try:
                counted = count_built(model, options, microbatch_size, getattr(torch, DTYPES[dtype]), attention)
            except ModelError as exc:
                raise InputError(str(exc)) from None
    except InputError as exc:
        fail(str(exc))
    if as_json:
        sys.stdout.write(json.dumps(_document(counted), indent=2) + "\n")
        return
    print_table(_table(counted))
    say_part_counted(model)
    if counted.options.get("experts"):
        print_message(_routing_note(counted), stderr)
    if any(layer.follows_previous for layer in counted.layers):
        print_message(_stage_starts_note(counted), stderr)
    if tied := [(layer, counted.layers[layer.tied_layer]) for layer in counted.layers if layer.tied_layer >= 0]:
        print_message(_tied_note(tied), stderr)
    print_message(f"counted on the meta device in {time.perf_counter() - started:.1f} s", stderr)


def _tied_note(tied: list[tuple[LayerCount, LayerCount]]) -> str:
    """Which layers' weights are another's (a tied head's, the embedding's), counted once in the total."""
    pairs = ", ".join(f"{layer.name}'s are {tie.name}'s" for layer, tie in tied)
    return (f"tied weights: {pairs}, counted once in the total; a stage holding both holds them once, stages apart "
            "each their own copy (Megatron-LM's last stage keeps one)")


def _stage_starts_note(counted: WorkloadCount) -> str:
    """Which layers a pipeline stage may start at, where some may not (a sparse attention sharing its top k)."""
    from ..profiles.partition import FOLLOWS_WHY
    from ..profiles.workload import follows_flags, most_stages

    follows = [i for i, follows in enumerate(follows_flags(counted.layers)) if follows]
    runs = [[i for _, i in run] for _, run in itertools.groupby(enumerate(follows), lambda at: at[1] - at[0])]
    return (f"a stage may start at {most_stages(counted.layers):,} of the {len(counted.layers):,} layers, not at "
            f"{', '.join(f'{run[0]}' if len(run) == 1 else f'{run[0]}-{run[-1]}' for run in runs)}: each "
            f"{FOLLOWS_WHY}")


def _routing_note(counted: WorkloadCount) -> str:
    """How a mixture of experts' data-dependent routing was counted (workload/moe.py)."""
    from ..workload.moe import expected_tokens

    options = counted.options
    tokens, experts, top_k = counted.microbatch_size * options["seq_len"], options["experts"], counted.top_k
    each = expected_tokens(tokens, top_k, experts, options.get("capacity_factor"))
    return (f"routed experts counted at balanced routing: each of the {experts} computes {each:,} of a micro-batch's "
            f"{tokens:,} tokens (top {top_k}{', padded to its capacity' if options.get('capacity_factor') else ''})")


TOTALS = ("fwd_flops", "igrad_flops", "wgrad_flops", "fwd_moved_bytes", "igrad_moved_bytes", "wgrad_moved_bytes",
          "saved_bytes", "param_bytes", "grad_bytes", "output_bytes")


def _document(counted: WorkloadCount) -> dict:
    return {**asdict(counted), "totals": {name: counted.total(name) for name in TOTALS}}


def _table(counted: WorkloadCount) -> Table:
    """One row per run of alike consecutive layers (a GPT's blocks are one row), then the model's totals."""
    shape = " ".join(f"{key}={value}" for key, value in counted.options.items())
    attention = f", {counted.attention} attention" if counted.attention is not None else ""  # an MLP has none
    title = (f"{' '.join(filter(None, (counted.model, shape)))}, b={counted.microbatch_size}, {counted.dtype}"
             f"{attention}: per layer and micro-batch")  # a module of the user's own has no size options
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for column in ("layers", "fwd FLOP", "igrad FLOP", "wgrad FLOP", "moved B", "saved B", "params B", "Adam B",
                   "output", "output B"):
        table.add_column(column, justify="left" if column in ("layers", "output") else "right", no_wrap=True)
    runs: list[list[LayerCount]] = []
    for layer in counted.layers:
        if runs and replace(runs[-1][0], name="", inputs=()) == replace(layer, name="", inputs=()):  # field by field
            runs[-1].append(layer)
        else:
            runs.append([layer])
    for run in runs:
        first = run[0]
        label = first.name if len(run) == 1 else f"{first.name}..{run[-1].name.split(':')[0]}"
        moved = first.fwd_moved_bytes + first.igrad_moved_bytes + first.wgrad_moved_bytes
        table.add_row(label, *_figures(first.fwd_flops, first.igrad_flops, first.wgrad_flops, moved, first.saved_bytes,
                                       first.param_bytes, first.optimizer_state_bytes["adam"]),
                      "x".join(map(str, first.output_shape)) or "(loss)", _si(first.output_bytes))
    table.add_section()
    moved = sum(counted.total(name) for name in ("fwd_moved_bytes", "igrad_moved_bytes", "wgrad_moved_bytes"))
    adam = sum(layer.optimizer_state_bytes["adam"] for layer in counted.layers if layer.tied_layer < 0)
    table.add_row("total", *_figures(counted.total("fwd_flops"), counted.total("igrad_flops"),
                                     counted.total("wgrad_flops"), moved, counted.total("saved_bytes"),
                                     counted.total("param_bytes"), adam), "", "")
    table.caption = COLUMNS_TEXT
    table.caption_justify = "left"
    return table


# What each column counts, said under the table (its headers are a word each; `docs/hardware.md` has the long form)
COLUMNS_TEXT = ("FLOP: of the matrix products and attention, forward, input-gradient (igrad) and weight-gradient "
                "(wgrad) passes; moved B: bytes the other ops read and write (norms, activations, copies), the three "
                "passes together; saved B: the activations the backward keeps; Adam B: torch.optim Adam's two "
                "moments in the weights' dtype (mixed precision, simulate's default in 16 bits, keeps float32 "
                "moments and a float32 master copy: 12 B a parameter); output: the layer's output shape; k, M, G, "
                "...: 10^3, 10^6, 10^9, ... (decimal)")


def _figures(*counts: int) -> list[str]:
    return [_si(n) for n in counts]


def _si(n: int) -> str:
    """Three digits and an SI prefix (decimal: 1 G = 10^9), up to yotta, past which the digits grow, grouped (a
    24-trillion-parameter config's totals read "8.22e+03 P" when the prefixes ended at peta)."""
    for prefix, scale in (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6),
                          ("k", 1e3)):
        value = n / scale
        if float(f"{value:.3g}") >= 1:  # as it reads: 999.6 T is 1 P
            return f"{value:.3g} {prefix}" if value < 999.5 else f"{value:,.0f} {prefix}"
    return f"{n:g}"
