"""benchmarks/gpu_probe.py's part (e) priced by pipesim, no GPU needed: each product a rank of the published Llama 3.1
8B and 70B rows runs a layer (qkv, proj, fc1, fc2; forward, input and weight gradient; at t = 4 also in the
userbuffers overlap's chunks), in each kind the probe ran it, priced as pipesim prices one product (planning/
estimate.py `matmul_ms`: its FLOPs at the catalogue part's large-product efficiency times its tile fill, or its
bytes, whichever is slower, plus the kernel overhead) beside the probe's device time behind a held device.

A kind's product is pipesim's: BF16 at the BF16 peak; float8 at the float8 peak, with fast accumulation at
`matmul_efficiency` and without at `fp8_split_accumulation_efficiency` (planning/fp8.py); one "into fp32" moving its
float32 gradient in and out (`accumulated_in_products`; the probe's float8 one writes it only: torch._scaled_mm adds
into no C). pipesim has no e5m2 of its own: HYBRID's e5m2 gradients are priced as its e4m3 products.

Then each layer as the rows run it (`RECIPES`): BF16's forward and input gradient, its weight gradient into float32
(`--grad-accumulation fused`); TransformerEngine's float8 (HYBRID delayed scaling) forward with fast accumulation,
its gradients e5m2 without, the weight gradient into float32; at t > 1 also with the forward and input gradient
in t chunks, as the overlap runs them; and beside each whole layer the probe's same products run back to back for
many layers (`dense.sustained`), as a step keeps the GPU busy, which a span of one GEMM from a held device does not.

    python benchmarks/probe_dense.py                     # the H200's record, traces/measured/gpu-probe-h200-dense.json
    python benchmarks/probe_dense.py --probe PROBE.json  # another gpu_probe.py run with part (e)
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from gpu_probe import RECIPES
from one_line_parser import OneLineParser  # this folder's
from probe_moe import probe_product, summary
from probe_replay import replayed
from rich.table import Table

from pipesim.commands.tables import print_table
from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, matmul_ms

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "traces" / "measured" / "gpu-probe-h200-dense.json"
GPU = "h200"


@dataclass(frozen=True)
class Kind:
    """How pipesim counts one of the probe's kinds of product (gpu_probe.py `dense_kinds`)."""

    float8: bool
    split_accumulation: bool
    out_bytes: int = 2  # the output's bytes an element: BF16 2, float32 4
    accumulated: bool = False  # added into its output (read and written in the epilogue), not only written


KINDS = {"bf16": Kind(False, False), "bf16 into fp32": Kind(False, False, 4, accumulated=True),
         "fp8 fast accum": Kind(True, False), "fp8": Kind(True, True),
         "fp8 e5m2 grad": Kind(True, True), "fp8 e5m2 grad into fp32": Kind(True, True, 4)}
LAYERS = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True)
class Row:
    """One of the probe's products in one kind: pipesim's price and the held device's median, ms."""

    model: str
    name: str
    orientation: str
    kind: str
    m: int
    k: int
    n: int
    predicted_ms: float
    measured_ms: float
    kernel: str | None = None  # the longest kernel the probe's profiler saw it run (None: it kept none)

    @property
    def ratio(self) -> float:
        return self.predicted_ms / self.measured_ms

    @property
    def measured_tflops(self) -> float:
        return 2 * self.m * self.k * self.n / self.measured_ms / 1e9


def rows(probe: dict, gpu_name: str) -> list[Row]:
    """Every product the probe timed (not skipped), priced on `gpu_name`."""
    gpu = load_catalogue().find(gpu_name)
    device = Device.of(gpu, "bf16", fp8=gpu.dense_tflops.fp8 is not None)
    table = []
    for product in probe["dense"]["products"]:
        if "skipped" in product:
            continue
        kind = KINDS[product["kind"]]
        m, k, n = product["m"], product["k"], product["n"]
        predicted = matmul_ms(probe_product(m, k, n, kind.float8, kind.split_accumulation, kind.out_bytes,
                                            kind.accumulated), device)
        kernels = product.get("profile", {}).get("by_kernel") or [{}]
        table.append(Row(product["model"], product["name"], product["orientation"], product["kind"], m, k, n,
                         predicted, product["timings"]["held_device_ms"]["median_ms"], kernels[0].get("short")))
    return table


@dataclass(frozen=True)
class LayerSum:
    """A layer's products of one model as a recipe runs them, summed: pipesim's and measured (each alone), ms; and
    the layer measured with its products back to back for many layers (`sustained_ms`, the whole products only;
    None where the probe has none)."""

    model: str
    recipe: str
    chunked: bool
    predicted_ms: float
    measured_ms: float
    sustained_ms: float | None = None


def layer_sums(table: list[Row], tensor: dict[str, int], sustained: list[dict] = ()) -> list[LayerSum]:
    """Per model and recipe (gpu_probe.py `RECIPES`), its layer's products summed (each orientation in the recipe's
    kind), and at t > 1 (`tensor`, a model's t) also with its forward and input gradients as t chunks of 1/t of the
    rows; a sum the probe left a product of out (a kind skipped) is not given. `sustained`: the probe's layers back
    to back (`dense.sustained`), set beside the whole products' sum."""
    found = {(row.model, row.name, row.kind): row for row in table}
    back_to_back = {(row["model"], row["recipe"]): row["layer_ms"]["median_ms"] for row in sustained
                    if "layer_ms" in row}
    sums = []
    for model, t in tensor.items():
        for recipe, kinds in RECIPES.items():
            for chunked in (False, True) if t > 1 else (False,):
                parts = []
                for layer in LAYERS:
                    for orientation, kind in kinds.items():
                        chunk = chunked and orientation != "weight grad"
                        name = f"{layer} {orientation}" + (f", a 1/{t} chunk" if chunk else "")
                        parts.append((found.get((model, name, kind)), t if chunk else 1))
                if all(row is not None for row, _ in parts):
                    sums.append(LayerSum(model, recipe, chunked, sum(row.predicted_ms * times for row, times in parts),
                                         sum(row.measured_ms * times for row, times in parts),
                                         None if chunked else back_to_back.get((model, recipe))))
    return sums


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, default=PROBE, help="the probe's JSON with part (e) (gpu_probe.py --out)")
    parser.add_argument("--gpu", default=GPU, help=f"the catalogue's part the probe ran on (default {GPU})")
    args = parser.parse_args(argv)

    def price(probe: dict) -> tuple[list[Row], list[LayerSum]]:
        dense = probe["dense"]
        if not isinstance(dense["products"], list) or not isinstance(dense["shapes"], list):
            raise TypeError("dense.products or dense.shapes is no list")
        unknown = sorted({row["kind"] for row in dense["products"]} - set(KINDS))
        if unknown:
            raise TypeError(f"kinds {', '.join(unknown)} are not this replay's ({', '.join(KINDS)})")
        tensor = {shape["name"]: shape["tensor"] for shape in dense["shapes"]}
        table = rows(probe, args.gpu)
        return table, layer_sums(table, tensor, dense.get("sustained", []))

    replay = replayed(args, "dense part", "products", price)
    if replay is None:
        return 2
    table, layers = replay
    printed = Table(title=f"The Llama 3.1 rows' products on a rank: pipesim {args.gpu} against {args.probe.name}, ms")
    for column in ("model", "product", "kind", "m x k x n", "pipesim", "measured", "pipesim / measured",
                   "measured TFLOP/s", "kernel"):
        printed.add_column(column, justify="left" if column in ("model", "product", "kind", "kernel") else "right")
    for row in table:
        printed.add_row(row.model, row.name, row.kind, f"{row.m}x{row.k}x{row.n}", f"{row.predicted_ms:.3f}",
                        f"{row.measured_ms:.3f}", f"{row.ratio:.3f}", f"{row.measured_tflops:.0f}", row.kernel or "-")
    print_table(printed, keys=3)
    for kind in dict.fromkeys(row.kind for row in table):
        mine = [row for row in table if row.kind == kind]
        print(f"{kind}: pipesim / measured median {statistics.median(row.ratio for row in mine):.3f}, "
              f"|error| {summary([row.ratio - 1 for row in mine])}")
    sums = Table(title="A layer's products as the rows run them, summed, ms")
    for column in ("model", "recipe", "forward and input grad", "pipesim", "measured alone", "pipesim / alone",
                   "back to back", "pipesim / back to back"):
        sums.add_column(column, justify="left" if column in ("model", "recipe") else "right")
    for layer in layers:
        sustained = layer.sustained_ms
        sums.add_row(layer.model, layer.recipe, "in t chunks" if layer.chunked else "whole",
                     f"{layer.predicted_ms:.3f}", f"{layer.measured_ms:.3f}",
                     f"{layer.predicted_ms / layer.measured_ms:.3f}", "-" if sustained is None else f"{sustained:.3f}",
                     "-" if sustained is None else f"{layer.predicted_ms / sustained:.3f}")
    print_table(sums, keys=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
