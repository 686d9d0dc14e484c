"""`pipesim gpus`: the GPUs pipesim knows, from the catalogue shipped with it and the user's own file."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..traces.metrics import figure_text
from .common import GpusFile, fail
from .tables import add_columns, print_table, said_as, said_once

# a network's kind as the table writes it and in words: "400 infiniband" took the 6 columns that printed the
# catalogue's table in two parts at 80
NETWORK_SHORT = {"infiniband": "IB", "roce": "RoCE", "ethernet": "Eth"}
NETWORK_NAMES = {"infiniband": "InfiniBand", "roce": "RDMA over Converged Ethernet", "ethernet": "Ethernet"}
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")]


def gpus(extra: GpusFile = None, as_json: Json = False) -> None:
    """List the GPUs pipesim knows and their figures. Dense peak TFLOP/s per dtype, memory (as torch is given it)
    and its bandwidth, the link inside a node and the network between nodes per GPU; each figure's source is in
    --json and in the catalogue file."""
    from ..hardware.catalogue import DTYPES, CatalogueError, load_catalogue

    try:
        catalogue = load_catalogue(extra)
    except CatalogueError as exc:
        fail(f"--gpus: {exc}" if extra is not None else str(exc))
    if as_json:
        sys.stdout.write(json.dumps(catalogue.model_dump(mode="json"), indent=2) + "\n")
        return
    parts = catalogue.gpu.values()
    columns = {
        "GiB": [figure_text(round(part.device_memory.gib, 2)) if part.device_memory is not None
                else f"{figure_text(part.memory_gib)}*" for part in parts],
        "GB/s": [figure_text(part.memory_bandwidth_gb_s) for part in parts],
        **{dtype: [figure_text(value) if (value := getattr(part.dense_tflops, dtype)) is not None else "-"
                   for part in parts] for dtype in DTYPES},
        "in node": [f"{part.intra_node.link} {figure_text(part.intra_node.gb_s_per_direction)}" for part in parts],
        "per node": [str(part.intra_node.gpus_per_node) for part in parts],
        "network Gb/s": [f"{figure_text(part.network.gbit_s)} {NETWORK_SHORT[part.network.kind]}" for part in parts],
    }
    said = said_once(columns, ("per node",))
    # a dtype's peaks equal to another's on every part (fp16 as bf16) said once: a 15-letter part of the user's
    # file printed the table in two parts at 80 columns
    repeated = said_as(columns, DTYPES)
    kinds = dict.fromkeys(part.network.kind for part in parts)
    table = Table(title="GPUs: dense peak TFLOP/s; memory bandwidth and links in GB/s, per direction, per GPU",
                  box=box.SIMPLE_HEAD, caption_justify="left",
                  caption="GiB: the memory torch is given of the datasheet's (its total_memory)"
                  + (", *: the datasheet's, torch's not known" if any(part.device_memory is None for part in parts)
                     else "") + "; "
                  + "".join(f"{header}: as {other} in every row; " for header, other in repeated.items())
                  + "per node: GPUs a node holds" + (f", {said['per node']} in every row" if said else "")
                  + "; " + ", ".join(f"{NETWORK_SHORT[kind]}: {NETWORK_NAMES[kind]}" for kind in kinds))
    table.add_column("gpu", no_wrap=True)
    shown = add_columns(table, columns, {**said, **repeated}, left=("in node", "network Gb/s"))
    for row, name in enumerate(catalogue.gpu):
        table.add_row(name, *[columns[header][row] for header in shown])
    print_table(table)
    if catalogue.cluster:
        clusters = Table(title="clusters", box=box.SIMPLE_HEAD)
        for column in ("cluster", "gpu", "nodes", "GPUs per node", "network"):
            clusters.add_column(column)
        for name, cluster in catalogue.cluster.items():
            part = catalogue.gpu[cluster.gpu]
            network = cluster.network or part.network
            clusters.add_row(name, cluster.gpu, str(cluster.nodes),
                             str(cluster.gpus_per_node or (cluster.intra_node or part.intra_node).gpus_per_node),
                             f"{network.kind} {figure_text(network.gbit_s)} Gb/s")
        print_table(clusters)
