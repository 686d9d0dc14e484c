"""The GPU probe's measurements (benchmarks/gpu_probe.py, its JSON in traces/measured/) against pipesim's
prediction of what it ran, nothing fitted: (a) its MoE layer, forward and backward, and (c) its loops of one GEMM
a local expert.

(a) The probe's layer is Qwen3-30B-A3B's MoE block alone (router, permute, the host's wait for the tokens per
expert, one fc1, SwiGLU and fc2 a local expert, the weighted combine) in eager torch on one GPU, its 4,096 tokens
folded onto 4, 8 or 16 local experts as a balanced expert-parallel rank of experts / local ranks receives them, with
no all-to-all. pipesim prices it as such a rank: the gpt's MoE MLP (workload/models.py `_ExpertsMLP`) counted at the
probe's shape with its SwiGLU unfused (the probe's chunk, silu and product), one rank of an expert-parallel group of
experts / local ranks (planning/experts.py `ExpertGroup.local`: each local expert's rows are the ranks' share of
theirs) whose dispatcher permutes once (HybridEP's: no chunk sort, as the probe sorts by local expert once, and no
index conversion, which DeepEP's path of Megatron-core runs), its products one GEMM a local expert
(`per_expert_products`) on one stream, as the probe's loop issues them, at the GPU's BF16 peak, no all-to-all, the
forward waiting for the host before the first expert's GEMM (planning/host.py `pass_kernels`) and priced in its
kernels' order (`waited_ms`). Compared: the GPU's time (pipesim's kernels against the profiler's busy time, before
and after the wait), the host's issue after the wait (and of the backward) against the probe's host time there, and
the pass (the max-plus result) against the device's time over the span (CUDA events: the forward from the router to
the last launch, its wait included; the backward from its start on an empty queue). Where the probe kept its kernels
by name (`moe.kernels`), each pass's kernels are compared by role (`ROLES`: GEMM, index, top-k and sort, fill, copy
and cast, elementwise), pipesim's ops against the kernels the profiler saw, each by the aten op that launched it,
with the probe's longest kernel of each role.

(c) Each product of the probe's loops (fc1 and fc2, forward, input and weight gradient, at 4 and 16 local
experts) priced as pipesim prices one local expert's product (`matmul_ms`, BF16, or FP8 at the float8 peak with
split accumulation: the probe's torch._scaled_mm runs its default use_fast_accum=False) issued back to back from an
empty queue at the host's cost a kernel (`waited_ms`), against the loop's device time, and its one GEMM of the same
FLOPs against the probe's.

    python benchmarks/probe_moe.py                                        # the day-9 H200 probe
    python benchmarks/probe_moe.py --probe traces/measured/gpu-probe-h200.json  # the first, no kernels by name
    python benchmarks/probe_moe.py --probe PROBE.json --gpu h100-sxm --host-kernel-us 12
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from pathlib import Path

import torch
from one_line_parser import OneLineParser, refuse  # this folder's
from probe_replay import replayed
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, write_json
from pipesim.commands.tables import print_table
from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import (
    Device,
    LayerEstimate,
    Parallelism,
    accumulating,
    estimate_layer,
    kernel_curve,
    links_of,
    matmul_ms,
    node_placement,
)
from pipesim.planning.experts import ExpertGroup, per_expert_products
from pipesim.planning.host import HOST_KERNEL_US, Kernels, issued_ms, pass_kernels, waited_ms
from pipesim.profiles.workload import LayerCount, OpCount
from pipesim.workload.count import META, count_model
from pipesim.workload.models import Model, build_model

MEASURED = Path(__file__).resolve().parents[1] / "traces" / "measured"
PROBE = MEASURED / "gpu-probe-h200-day9.json"  # the second H200 probe: each kernel's device time by name
FIRST_PROBE = MEASURED / "gpu-probe-h200.json"  # the first, whose pooled host cost is HOST_KERNEL_US
GPU = "h200"  # the part the committed probes ran on (their environment's name: NVIDIA H200)
HEADS = 16  # the gpt's attention, which the layer counted leaves out: any divisor of the hidden size


@dataclass(frozen=True)
class LayerPass:
    """One pass of the probe's MoE layer, predicted or measured (ms): over the span the host issues from an empty
    queue (the forward's after the dispatcher's wait, the whole backward) the GPU's busy time, the host's issue and
    its kernels; and the whole pass (the forward's wait included)."""

    gpu_ms: float
    issue_ms: float
    kernels: int
    pass_ms: float


MOE_SHAPE = ("hidden", "ffn", "experts", "top_k", "tokens")  # the probe's `moe.shape`, as probe_layer takes it


@cache
def probe_layer(hidden: int, ffn: int, experts: int, top_k: int, tokens: int) -> LayerCount:
    """The probe's MoE block alone (its JSON's `moe.shape`), counted on the meta device in BF16: the gpt's MoE MLP
    between its embedding (so that its input takes a gradient, as the probe's does) and its head."""
    with META:
        gpt = build_model("gpt", layers=1, width=hidden, heads=HEADS, seq_len=tokens, vocab=1000, gated=True,
                          experts=experts, top_k=top_k, expert_ffn=ffn)
    embedding, block, head = gpt.layers
    model = Model("probe", [embedding, block.mlp, head], gpt.make_batch, gpt.loss)
    return count_model(model, 1, torch.bfloat16, swiglu_fusion=False).layers[1]


def price_layer(layer: LayerCount, experts: int, local_experts: int, gpu_name: str,
                host_kernel_us: float) -> LayerEstimate:
    """The probe's layer at `local_experts` (module docstring) as pipesim's estimate prices it, op by op."""
    gpu = load_catalogue().find(gpu_name)
    curve = kernel_curve(gpu.curve, "flash2", gpu.name)
    placement = node_placement(gpu, None, curve)
    links = links_of(placement, 1, 1, 1)
    ranks = experts // local_experts
    group = ExpertGroup(ranks, placement.gpus_per_node, links.tensor, links.tensor, experts, dispatcher="hybridep")
    split = per_expert_products(group.local(layer))
    one_stream = replace(split, ops={name: tuple(replace(op, streams=1) for op in ops)
                                     for name, ops in split.ops.items()})
    parallel = Parallelism(data=ranks, expert=ranks, expert_gemm="per-expert", host_kernel_us=host_kernel_us)
    return estimate_layer(one_stream, Device.of(gpu, "bf16", curve), parallel, links.tensor, 2)


def predict_layer(priced: LayerEstimate, host_kernel_us: float) -> dict[str, LayerPass]:
    """The probe's layer as pipesim runs it (`price_layer`), forward and backward."""
    forward_ops = [op for op, _ in priced.timed_ops["fwd"]]
    passes = {}
    for name in ("fwd", "bwd"):
        kernels = pass_kernels(priced.timed_ops[name], forward_ops, False, host_kernel_us, name,
                               synchronised=name == "fwd")
        after = kernels[next((i for i, run in enumerate(kernels) if run.waits), 0):]
        passes[name] = LayerPass(sum(run.count * run.gpu_ms for run in after), issued_ms(after),
                                 sum(run.count for run in after if not run.waits),
                                 sum(run.count * run.gpu_ms for run in kernels) + waited_ms(kernels)[0])
    return passes


def measured_layer(layer: dict) -> dict[str, LayerPass]:
    """The probe's figures of one layer (its medians; the busy times from its one profiled run)."""
    timings, counts = layer["timings"], layer["counts"]
    return {"fwd": LayerPass(counts["after_sync"]["device_busy_ms"], timings["after_sync_host_ms"]["median_ms"],
                             counts["after_sync"]["kernels"], timings["forward_device_ms"]["median_ms"]),
            "bwd": LayerPass(counts["backward"]["device_busy_ms"], timings["backward_host_ms"]["median_ms"],
                             counts["backward"]["kernels"], timings["backward_device_ms"]["median_ms"])}


def host_us_per(probe: dict, unit: str = "kernels") -> float | None:
    """The probe's host microseconds a kernel (`unit` "kernels") or a top-level op ("ops": each one Python or the
    autograd engine dispatched, views and kernel-less ops too) over its layer's spans that issue from an empty
    queue (the forward after the dispatcher's wait, the backward), every local-expert count pooled: their host
    time over the kernels the profiler saw the device run in them, or the ops it saw dispatched (None from a CPU
    run, which counts no kernels)."""
    spans = [(layer["timings"][host]["median_ms"], layer["counts"][span][unit])
             for layer in probe["moe"]["layers"]
             for span, host in (("after_sync", "after_sync_host_ms"), ("backward", "backward_host_ms"))]
    if any(count is None for _, count in spans):
        return None
    return sum(ms for ms, _ in spans) * 1e3 / sum(count for _, count in spans)


def layer_rows(probe: dict, gpu: str, host_kernel_us: float) -> list[dict]:
    """Per local-expert count and pass, pipesim's prediction beside the probe's measurement."""
    shape = probe["moe"]["shape"]
    layer = probe_layer(**shape)
    rows = []
    for measured in probe["moe"]["layers"]:
        predicted = predict_layer(price_layer(layer, shape["experts"], measured["local_experts"], gpu,
                                              host_kernel_us), host_kernel_us)
        for name, seen in measured_layer(measured).items():
            rows.append({"local_experts": measured["local_experts"], "pass": name,
                         "predicted": asdict(predicted[name]), "measured": asdict(seen),
                         "error": predicted[name].pass_ms / seen.pass_ms - 1})
    return rows


# An op's role in the layer, for pipesim's priced ops and the probe's kernels alike (by the aten op that launched
# each, its trailing underscore dropped): the rest are elementwise ops and reductions.
ROLES = {"GEMM": {"mm", "bmm", "matmul", "addmm", "_scaled_mm"},
         "index": {"index_select", "index", "index_put", "_index_put_impl", "index_add", "scatter", "scatter_add",
                   "gather"},
         "top-k, sort": {"topk", "sort", "argsort", "bincount", "histc", "cumsum", "remainder", "floor_divide"},
         "fill": {"fill", "zero", "zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty", "ones"},
         "copy, cast": {"copy", "_to_copy", "to", "cat", "clone", "_local_scalar_dense"}}
ELEMENTWISE = "elementwise"  # and reductions
UNLINKED = "no op"  # kernels the profiler linked to no op
SPANS = {"fwd": ("before_sync", "after_sync"), "bwd": ("backward",)}  # the probe's spans (moe.kernels) a pass


def profiled(op: str) -> bool:
    """Whether the probe's kernels linked to `op` are counted here: those of aten ops and those linked to none, not
    those the profiler also linked to a record of its own (gpu_probe.py `BUFFER_REQUEST`, which probes before it
    kept: the day-9 one's spans each list one of their GEMMs under it a second time)."""
    return op == "None" or op.startswith("aten::")


def role(op: str | None) -> str:
    """The role (`ROLES`) of an op, named as pipesim counts it (`index_add`) or as the profiler (`aten::index_add_`)."""
    if op is None or op == "None":
        return UNLINKED
    name = op.removeprefix("aten::").removesuffix("_")
    return next((group for group, ops in ROLES.items() if name in ops), ELEMENTWISE)


def kernel_rows(probe: dict, gpu: str, host_kernel_us: float) -> list[dict]:
    """Per local-expert count, pass and role (`ROLES`), pipesim's priced kernels beside the probe's (`moe.kernels`,
    the forward's two spans together): their count and GPU microseconds, the ops pipesim priced and the probe's
    longest kernel by name; each pass's total last ("all"). Empty from a probe that kept no kernels by name."""
    if "kernels" not in probe["moe"]:
        return []
    shape = probe["moe"]["shape"]
    layer = probe_layer(**shape)
    rows = []
    for measured in probe["moe"]["kernels"]:
        priced = price_layer(layer, shape["experts"], measured["local_experts"], gpu, host_kernel_us)
        for name, spans in SPANS.items():
            roles: dict[str, dict] = {group: {"local_experts": measured["local_experts"], "pass": name, "role": group,
                                              "priced_ops": [], "predicted_kernels": 0, "predicted_us": 0.0,
                                              "measured_kernels": 0, "measured_us": 0.0, "measured_longest": None}
                                      for group in (*ROLES, ELEMENTWISE, UNLINKED, "all")}
            for op, ms in priced.timed_ops[name]:
                roles[role(op.op)]["priced_ops"] = sorted({*roles[role(op.op)]["priced_ops"], op.op})
                for group in (role(op.op), "all"):
                    roles[group]["predicted_kernels"] += op.count
                    roles[group]["predicted_us"] += ms * 1e3
            for span in spans:
                for op, seen in measured[span]["by_op"].items():
                    for group in ((role(op), "all") if profiled(op) else ()):
                        roles[group]["measured_kernels"] += seen["count"]
                        roles[group]["measured_us"] += seen["device_us"]
                for kernel in measured[span]["by_kernel"]:  # the longest by name, the rest (no op) left out
                    for group in ((role(kernel["op"]), "all") if kernel["op"] is not None and profiled(kernel["op"])
                                  else ()):
                        longest = roles[group]["measured_longest"]
                        if longest is None or kernel["device_us"] > longest["device_us"]:
                            roles[group]["measured_longest"] = kernel
            rows += [entry for entry in roles.values() if entry["predicted_kernels"] or entry["measured_kernels"]]
    return rows


def probe_product(m: int, k: int, n: int, float8: bool = False, split_accumulation: bool = False,
                  out_bytes: int = 2, accumulated: bool = False) -> OpCount:
    """One of the probe's GEMMs, (m x k) by (k x n), as pipesim counts a product: its FLOPs, its operands read (an
    element a byte in float8, else two) and its output written at `out_bytes` an element (BF16, as the probe's;
    float32 4), or where `accumulated` added into, read and written (planning/estimate.py `accumulating`); a
    `float8` one at the float8 peak, its partial sums added into float32 where `split_accumulation`."""
    moved = (m * k + k * n) * (1 if float8 else 2) + m * n * out_bytes
    product = OpCount("mm", "matmul", (1, m, n, k), 2 * m * n * k, moved, 1, float8=float8,
                      split_accumulation=split_accumulation)
    return accumulating(product, out_bytes, out_bytes) if accumulated else product


def gemm_rows(probe: dict, gpu_name: str, host_kernel_us: float) -> list[dict]:
    """Per loop of part (c), pipesim's loop and one GEMM beside the probe's device times."""
    gpu = load_catalogue().find(gpu_name)
    curve = kernel_curve(gpu.curve, "flash2", gpu.name)
    rows = []
    for kind, loops in probe["gemm"].items():
        if not isinstance(loops, list):
            continue  # a part the probe skipped (no FP8 there)
        float8 = kind == "fp8"
        device = Device.of(gpu, "bf16", curve, fp8=float8)
        for loop in loops:
            m, k, n, local = loop["m"], loop["k"], loop["n"], loop["local_experts"]
            product = partial(probe_product, n=n, float8=float8, split_accumulation=float8)
            each_ms = matmul_ms(product(m, k), device)
            one_m, one_k = (m * local, k) if loop["token_dim"] == "m" else (m, k * local)
            loop_ms = local * each_ms + waited_ms([Kernels(local, host_kernel_us / 1e3, each_ms)])[0]
            rows.append({"kind": kind, "local_experts": local, "name": loop["name"], "m": m, "k": k, "n": n,
                         "predicted_loop_ms": loop_ms, "measured_loop_ms": loop["loop"]["device_ms"]["median_ms"],
                         "predicted_one_ms": matmul_ms(product(one_m, one_k), device),
                         "measured_one_ms": loop["one_gemm"]["device_ms"]["median_ms"],
                         "measured_loop_host_ms": loop["loop"]["host_ms"]["median_ms"]})
    return rows


def pair(predicted: float | None, measured: float | None, style: str = ".3f") -> str:
    """A cell "pipesim / measured", "-" for a figure the probe has not (a CPU run's GPU times)."""
    return " / ".join("-" if value is None else format(value, style) for value in (predicted, measured))


def print_kernels(rows: list[dict], gpu: str) -> None:
    """`kernel_rows` as a table: per local-expert count, pass and role, pipesim's kernels and GPU time beside the
    probe's, then the ops pipesim priced and the probe's longest kernel by name (its op, count and time)."""
    table = Table(title=f"(a) the layer's kernels by role on {gpu}, pipesim / measured (forward: the whole pass)")
    for name in ("experts", "pass", "role", "kernels", "GPU ms"):
        table.add_column(name, justify="right")
    table.add_column("pipesim's ops; the probe's longest kernel")
    for r in rows:
        longest = r["measured_longest"]
        if longest is not None:
            op = longest["op"].removeprefix("aten::")
            longest = (f"{longest['short']}{'' if op == longest['short'] else f' ({op})'} x{longest['count']}: "
                       f"{longest['device_us'] / 1e3:.3f} ms")
        table.add_row(str(r["local_experts"]), r["pass"], r["role"],
                      pair(r["predicted_kernels"], r["measured_kernels"], "d"),
                      pair(r["predicted_us"] / 1e3, r["measured_us"] / 1e3),
                      f"{', '.join(r['priced_ops']) or '-'}; {longest or '-'}")
    print_table(table, keys=3)


def summary(errors: list[float]) -> str:
    magnitudes = [abs(e) for e in errors]
    return f"median {statistics.median(magnitudes):.1%}, worst {max(magnitudes):.1%} over {len(errors)}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, default=PROBE, help="the probe's JSON (default: the day-9 H200's)")
    parser.add_argument("--gpu", default=GPU, help=f"the catalogue's part the probe ran on (default {GPU})")
    parser.add_argument("--host-kernel-us", type=float, default=HOST_KERNEL_US,
                        help=f"the host's issue of a kernel (default pipesim's, {HOST_KERNEL_US:g})")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    if args.host_kernel_us < 0:
        refuse(f"--host-kernel-us: {args.host_kernel_us:g} is negative; give 0 or more microseconds")
        return 2

    def price(probe: dict) -> tuple:
        if not isinstance(probe["moe"]["layers"], list) or not probe["moe"]["layers"] or not isinstance(
                probe["gemm"], dict):
            raise TypeError("moe.layers is no list of layers or gemm no table")
        if not isinstance(probe["moe"]["shape"], dict) or sorted(probe["moe"]["shape"]) != sorted(MOE_SHAPE):
            raise TypeError(f"moe.shape is not {', '.join(MOE_SHAPE)}")
        if not isinstance(probe["moe"].get("kernels", []), list):
            raise TypeError("moe.kernels is no list")
        compared, host_us = layer_rows(probe, args.gpu, args.host_kernel_us), host_us_per(probe)
        return (compared, host_us, None if host_us is None else host_us_per(probe, "ops"),
                kernel_rows(probe, args.gpu, args.host_kernel_us), gemm_rows(probe, args.gpu, args.host_kernel_us))

    replay = replayed(args, "moe and gemm parts", "GEMMs", price)
    if replay is None:
        return 2
    compared, host_us, host_op_us, kernels, loops = replay
    table = Table(title=f"(a) the probe's MoE layer on {args.gpu} at {args.host_kernel_us:g} us a kernel: "
                        "pipesim / measured, ms (GPU, host: after the wait)")
    for name in ("experts", "pass", "GPU", "host", "kernels", "pass ms", "error"):
        table.add_column(name, justify="right")
    for r in compared:
        p, m = r["predicted"], r["measured"]
        table.add_row(str(r["local_experts"]), r["pass"], pair(p["gpu_ms"], m["gpu_ms"]),
                      pair(p["issue_ms"], m["issue_ms"]), pair(p["kernels"], m["kernels"], "d"),
                      pair(p["pass_ms"], m["pass_ms"]), f"{r['error']:+.1%}")
    print_table(table)
    print(f"|error| of the pass: {summary([r['error'] for r in compared])}; " + (
        "the probe counted no kernels (a CPU run)" if host_us is None else
        f"the probe's host {host_us:.1f} us a kernel ({host_op_us:.1f} an op) after the wait and "
        "in the backward, pooled"))
    if kernels:
        print_kernels(kernels, args.gpu)
    else:
        print("(a) by kernel: this probe kept no kernels by name (moe.kernels: probes since they were recorded)")
    table = Table(title=f"(c) a GEMM a local expert at {args.host_kernel_us:g} us a kernel: pipesim / measured, ms")
    for name in ("type", "experts", "product", "loop", "loop error", "one GEMM", "one error"):
        table.add_column(name, justify="right")
    for r in loops:
        table.add_row(r["kind"], str(r["local_experts"]), r["name"],
                      f"{r['predicted_loop_ms']:.3f} / {r['measured_loop_ms']:.3f}",
                      f"{r['predicted_loop_ms'] / r['measured_loop_ms'] - 1:+.1%}",
                      f"{r['predicted_one_ms']:.3f} / {r['measured_one_ms']:.3f}",
                      f"{r['predicted_one_ms'] / r['measured_one_ms'] - 1:+.1%}")
    print_table(table)
    for kind in dict.fromkeys(r["kind"] for r in loops):
        mine = [r for r in loops if r["kind"] == kind]
        host_us = [r["measured_loop_host_ms"] * 1e3 / r["local_experts"] for r in mine]
        print(f"{kind}: loop |error| {summary([r['predicted_loop_ms'] / r['measured_loop_ms'] - 1 for r in mine])}; "
              f"one GEMM {summary([r['predicted_one_ms'] / r['measured_one_ms'] - 1 for r in mine])}; the loop's "
              f"host {min(host_us):.1f}-{max(host_us):.1f} us a GEMM (one op)")
    write_json(args.json, {"probe": str(args.probe), "gpu": args.gpu, "host_kernel_us": args.host_kernel_us,
                           "layers": compared, "kernels": kernels, "gemms": loops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
