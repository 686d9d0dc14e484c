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
from .tables import print_table

Json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")]


def gpus(extra: GpusFile = None, as_json: Json = False) -> None:
    """List the GPUs pipesim knows and their figures. Dense peak TFLOP/s per dtype, memory and its bandwidth, the
    link inside a node and the network between nodes per GPU; each figure's source is in --json and in the
    catalogue file."""
    from ..hardware.catalogue import CatalogueError, load_catalogue

    try:
        catalogue = load_catalogue(extra)
    except CatalogueError as exc:
        fail(f"--gpus: {exc}" if extra is not None else str(exc))
    if as_json:
        sys.stdout.write(json.dumps(catalogue.model_dump(mode="json"), indent=2) + "\n")
        return
    table = Table(title="GPUs: dense peak TFLOP/s; memory bandwidth and links in GB/s, per direction, per GPU",
                  box=box.SIMPLE_HEAD)
    for column in ("gpu", "GiB", "GB/s", "fp32", "tf32", "bf16", "fp16", "fp8", "in node", "network Gb/s"):
        table.add_column(column, justify="left" if column in ("gpu", "in node", "network Gb/s") else "right",
                         no_wrap=True)
    for name, part in catalogue.gpu.items():
        peak = part.dense_tflops
        link = part.intra_node
        table.add_row(name, figure_text(part.memory_gib), figure_text(part.memory_bandwidth_gb_s),
                      *(figure_text(value) if value is not None else "-" for value in
                        (peak.fp32, peak.tf32, peak.bf16, peak.fp16, peak.fp8)),
                      f"{link.link} {figure_text(link.gb_s_per_direction)} x{link.gpus_per_node}",
                      f"{figure_text(part.network.gbit_s)} {part.network.kind}")
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
