"""benchmarks/gpu_probe.py's part (b) priced by pipesim, no GPU needed: Llama 3.1 8B's attention in the probe's shape
(32 heads of 128, 8 key/value heads, 8,192 tokens, causal, bf16) at C = 1 and one rank of TransformerEngine 1.10's
C = 2 ring, each part as pipesim's estimate prices it beside what the probe measured (by default
traces/measured/gpu-probe-h200-day9.json: an H200, torch 2.11, cuDNN 9.19, every span behind a held device).

The attention op is the gpt's as `pipesim estimate` counts it (torch on the meta device); a part is priced on the
probe's GPU (`--gpu`, h200) and on the one the published rows ran on (h100-sxm), with the probe's cuDNN kernel as
pipesim's `cudnn` and its flash kernel (torch's FlashAttention-2) as `flash2`:
- C = 1: the causal kernel over the whole sequence (planning/estimate.py `op_ms`);
- C = 2, one rank (`ContextRing`, p2p): step 0 causal over the rank's two chunks and step 1 unmasked
  (`blocks_ms`), the passes that join them (`merge_ms`; the probe's passes-alone span leaves out the key-value
  buffer's `torch.cat`, 34 MB, about 0.01 ms), and the rank whole. The probe's k and v are contiguous leaves, so
  `copies_ms` (v's copy out of Megatron-core's fused QKV) is left out.
- the rank's forward as TransformerEngine runs it: its output and statistics corrections are `jit_fuser` functions,
  torch.compile'd (transformer_engine/pytorch/jit.py at v1.10, NVTE_TORCH_COMPILE unset in the runs' configure.sh),
  where the probe's rank runs them eager; measured, the rank's forward less its eager passes plus the compiled ones,
  each timed alone.

How the probe timed a part decides what it can check (docs/hardware.md, "What the H200 probe settled"): a run with
`attention.held_cycles` (the default record) starts each span behind a held device, so that every span is the
device's work; in one without (traces/measured/gpu-probe-h200.json, the first) a forward span holds the host's issue.
The test (tests/test_probe_attention.py) holds the model to the default record. The rank's forward with step 1 on a
second stream, as TransformerEngine runs it, is priced as the rank's forward: pipesim does not model the overlap.

    python benchmarks/probe_attention.py                           # the table
    python benchmarks/probe_attention.py --probe probe.json        # another run of the probe
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from one_line_parser import OneLineParser  # this folder's
from probe_replay import replayed
from rich.table import Table

from pipesim.commands.estimate import count_model_of
from pipesim.commands.tables import print_table
from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import (
    ContextRing,
    Device,
    Parallelism,
    _Split,
    kernel_curve,
    op_ms,
    placement_links,
)
from pipesim.profiles.workload import OpCount

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "traces" / "measured" / "gpu-probe-h200-day9.json"
KERNELS = {"cudnn": "cudnn", "flash": "flash2"}  # the probe's SDPA kernel -> pipesim's --attention-kernel
PASSES = {"fwd": "forward", "bwd": "backward"}
ELEMENT_BYTES = 2  # bf16
CONTEXT = 2
ATTENTION_SHAPE = ("heads", "kv_heads", "head_dim", "tokens")  # the probe's `attention.shape` attention_ops reads


@dataclass(frozen=True)
class Priced:
    """One pass (forward or backward) of the probe's attention as pipesim prices it, ms: whole at C = 1, and one
    C = 2 rank's blocks (step 0 causal, step 1 unmasked), the passes that join them, and the rank whole."""

    c1: float
    step0: float
    step1: float
    passes: float

    @property
    def rank(self) -> float:
        return self.step0 + self.step1 + self.passes


def attention_ops(shape: dict[str, int]) -> dict[str, OpCount]:
    """The forward and backward attention ops of one gpt layer of the probe's `shape` (heads, kv_heads, head_dim,
    tokens), as `pipesim estimate` counts them (the rest of the layer, which the probe does not run, kept small)."""
    options = {"layers": 1, "width": shape["heads"] * shape["head_dim"], "ffn": 256, "heads": shape["heads"],
               "kv_heads": shape["kv_heads"], "seq_len": shape["tokens"], "vocab": 256}
    counted = count_model_of("gpt", options, 1, "bfloat16", "flash", "the probe's attention")
    return {name: op for layer in counted.layers for name in PASSES for op in layer.ops.get(name, ())
            if op.kind == "attention"}


def priced(ops: dict[str, OpCount], gpu_name: str, kernel: str) -> dict[str, Priced]:
    """Each pass of `ops` on `gpu_name` with attention kernel `kernel` (of pipesim's ATTENTION_KERNELS)."""
    gpu = load_catalogue().find(gpu_name)
    device = Device.of(gpu, "bf16", kernel_curve(gpu.curve, kernel, gpu_name))
    parallel = Parallelism(context=CONTEXT, cp_rotate="p2p")
    ring = ContextRing(CONTEXT, placement_links(gpu, parallel).context, "p2p")
    result = {}
    for name, op in ops.items():
        mine = _Split(1, False, op.shape[0] * op.shape[3], op.shape[1], op.shape[1], CONTEXT).attention(op)
        step0, step1 = ring.blocks_ms(mine, device)
        result[name] = Priced(op_ms(op, device), step0, step1, ring.merge_ms(mine, device, ELEMENT_BYTES))
    return result


def measured_ms(kernel: dict, part: str, key: str) -> float | None:
    """The probe's median of `key` in `part` of one kernel's results (None where it did not run)."""
    timing = kernel.get(part, {}).get(key)
    return timing["median_ms"] if isinstance(timing, dict) and "median_ms" in timing else None


def compiled_forward_ms(kernel: dict, part: str) -> float | None:
    """A rank's forward with TransformerEngine's compiled passes for the probe's eager ones: the rank's forward, less
    its eager passes, plus the compiled passes, each span timed alone (None where one did not run)."""
    spans = [measured_ms(kernel, part, key) for key in ("forward_ms", "forward_passes_ms", "forward_passes_compiled")]
    if None in spans:
        return None
    whole, eager, compiled = spans
    return whole - eager + compiled


@dataclass(frozen=True)
class Row:
    """One part and pass: pipesim's price on the probe's GPU and on the rows' GPU, and the probe's median."""

    kernel: str
    part: str
    pass_name: str
    predicted_ms: float
    measured_ms: float | None
    rows_gpu_ms: float

    @property
    def ratio(self) -> float | None:
        return self.predicted_ms / self.measured_ms if self.measured_ms else None


def rows(probe: dict, gpu_name: str, rows_gpu: str = "h100-sxm") -> list[Row]:
    """Every part the probe measured, per kernel and pass, priced on `gpu_name` and on `rows_gpu`."""
    attention = probe["attention"]
    ops = attention_ops(attention["shape"])
    table = []
    for probe_kernel, kernel in KERNELS.items():
        measured = attention["kernels"].get(probe_kernel)
        if measured is None:
            continue
        mine, theirs = priced(ops, gpu_name, kernel), priced(ops, rows_gpu, kernel)
        for name, word in PASSES.items():
            parts = [("C = 1", "c1", f"{word}_ms", "c1"), ("C = 2 step 0, causal", "c2_step0", f"{word}_ms", "step0")]
            for rank in range(CONTEXT):
                parts += [(f"C = 2 step 1, rank {rank}", f"c2_step1_rank{rank}", f"{word}_ms", "step1"),
                          (f"C = 2 passes, rank {rank}", f"c2_rank{rank}", f"{word}_passes_ms", "passes"),
                          (f"C = 2 rank {rank}", f"c2_rank{rank}", f"{word}_ms", "rank")]
                if name == "fwd":
                    parts += [(f"C = 2 passes compiled, rank {rank}", f"c2_rank{rank}", "forward_passes_compiled",
                               "passes"),
                              (f"C = 2 rank {rank} as TE runs it", f"c2_rank{rank}", None, "rank"),
                              (f"C = 2 rank {rank}, two streams", f"c2_rank{rank}", "forward_two_streams_ms", "rank")]
            for label, part, key, field in parts:
                probe_ms = compiled_forward_ms(measured, part) if key is None else measured_ms(measured, part, key)
                table.append(Row(kernel, label, word, getattr(mine[name], field), probe_ms,
                                 getattr(theirs[name], field)))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, default=PROBE, help="the probe's JSON (gpu_probe.py --out)")
    parser.add_argument("--gpu", default="h200", help="the catalogue's name of the GPU the probe ran on")
    args = parser.parse_args(argv)

    def price(probe: dict) -> list:
        attention = probe["attention"]
        if not isinstance(attention["kernels"], dict) or not isinstance(attention["shape"], dict) or any(
                name not in attention["shape"] for name in ATTENTION_SHAPE):
            raise TypeError(f"attention.kernels is no table or attention.shape not {', '.join(ATTENTION_SHAPE)}")
        return rows(probe, args.gpu)

    priced_rows = replayed(args, "attention part", "attention", price)
    if priced_rows is None:
        return 2
    table = Table(title=f"Llama 3.1 8B's attention, ms a layer and micro-batch: pipesim against {args.probe.name}")
    for column in ("kernel", "part", "pass", f"pipesim {args.gpu}", "measured", "pipesim / measured",
                   "pipesim h100-sxm"):
        table.add_column(column, justify="left" if column in ("kernel", "part", "pass") else "right")
    for row in priced_rows:
        table.add_row(row.kernel, row.part, row.pass_name, f"{row.predicted_ms:.3f}",
                      "-" if row.measured_ms is None else f"{row.measured_ms:.3f}",
                      "-" if row.ratio is None else f"{row.ratio:.2f}", f"{row.rows_gpu_ms:.3f}")
    print_table(table, keys=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
