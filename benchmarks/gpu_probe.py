"""The GPU probe: one script, torch alone, for the questions docs/hardware.md leaves to hardware.

(a) *Host-bound MoE* ("Host-bound execution", "TransformerEngine's module calls"): a dropless MoE layer in eager
    torch shaped like Qwen3-30B-A3B (hidden 2,048, expert FFN 768, SwiGLU, top-8 of 128, 4,096 tokens a
    micro-batch) at 4, 8 and 16 local experts: router, permute, the host's synchronisation for the tokens per
    expert (`.tolist()`, as Megatron-core's all-to-all dispatcher waits at "before_ep_alltoall"), one GEMM a local
    expert (fc1, SwiGLU, fc2), weighted unpermute; forward and backward. It times the host from the
    synchronisation to the layer's last launch against the device in the same span, and the device alone in that
    span and the backward each behind a held device; and counts the ops and the kernels, each kernel's device time
    kept by name and by the op that launched it (torch.profiler, `moe.kernels`), so a kernel's host cost, an
    expert's cost and the kernels pipesim misprices can be read off.
(b) *Context parallelism's attention as TransformerEngine runs it* ("Llama 3.1 8B's C = 2 step, read from its
    code"): Llama 3.1 8B's attention (32 heads of 128, 8 KV heads, causal, 8,192 tokens) through torch's SDPA,
    whole at C = 1 and as TransformerEngine 1.10's p2p ring runs it at C = 2 on one rank
    (`AttnFuncWithCPAndKVP2P`, sbhd): step 0 causal over the rank's two chunks of 2,048, step 1 unmasked (rank 0:
    its second half of the queries against all the keys; rank 1: all its queries against the first half of the
    keys), and the passes that join them (the forward's softmax-statistics and output corrections, the backward's
    buffer copy, joins and adds), eager and compiled as TE compiles them; the rank's forward also with step 1 on
    a second stream, as TE runs it. Each span starts behind a held device (`HOLD_CYCLES`), so it times the
    device's work, not the host's issue (traces/measured/gpu-probe-h200.json, from before the hold, does not).
(c) *The experts' GEMMs*: each of an expert's six products (fc1 and fc2; forward, input and weight gradients) as
    a loop of one GEMM a local expert at 4 and 16 local experts, against the same FLOPs as one GEMM; BF16 with
    torch.mm, FP8 with torch._scaled_mm where the GPU has FP8; each loop also behind a held device (the device's time
    a GEMM apart from the host's) and profiled once (its kernels a GEMM, by name).
(d) *The combine's kernels*: at (a)'s shape in BF16 and float32, each alone behind a held device, the ops that could
    sum the rows back into their tokens (index_add_, scatter_add_, index_put_ accumulating, a gather and a sum over
    top_k) and a product and silu on contiguous, broadcast and strided operands, each with the bytes it moves
    (`combine_ops`).
(e) *The Llama 3.1 rows' dense products* (docs/hardware.md, the Llama rows' missing step): each product a rank of
    the published 8B (t = 1) and 70B (t = 4) rows runs a layer, at C = 2's 4,096 tokens (`LLAMA31_DENSE`): qkv, proj,
    fc1 (gate and up) and fc2, forward, input and weight gradient, and at t = 4 the forward and input gradient in
    the userbuffers overlap's chunks of 1/t of the rows; one GEMM a span behind a held device, in BF16 (the weight
    gradient also into float32, as TransformerEngine accumulates it) and in FP8 (e4m3 with and without fast
    accumulation; HYBRID's e5m2 gradients by e4m3 without), each with its kernel by name (`dense_kinds`); and each
    layer's products as the rows run them (`RECIPES`) back to back for 32 layers, with the SM clock and power
    meanwhile (`time_sustained`).
    benchmarks/probe_dense.py prices the same products with pipesim.
(f) *The expert weights' backward* (docs/hardware.md, "The unexplained time scales with a layer's local experts"):
    (a)'s experts' products at 4 and 16 local experts (fc1, SwiGLU, fc2; a GEMM an expert as TransformerEngine's
    GroupedLinear loops them) with each weight's gradient handed over as autograd does (part (a)'s) or as
    Megatron-core runs TransformerEngine (`WEIGHT_PATHS`: the weight-gradient GEMM adding into `main_grad`, a dummy
    `torch.empty` gradient a weight, DDP's post-hook on each AccumulateGrad node), and the same without the products
    (the host's work a weight alone): forward host, backward host and device apart, ops and kernels.
(g) *A collective's kernel beside products* (docs/hardware.md, "The pair's contention"): a copy on 24 or 32 CTAs,
    the shape of NCCL's, DeepEP's and HybridEP's kernels (benchmarks/sm_copy.py, Triton), on one stream beside BF16
    products back to back on another (4096^3, and the 30B's fc1 at E16): each alone, the copy issued first, and the
    copy launched by the host while the products run, each launch with what was left of the product it met. Does
    the copy wait for that product's end (the persistent products' rule pipesim prices) and does it run slower
    once started? (A copy through HBM, not a network's: its own slowing is memory's and multiprocessors', not a
    NIC's.)
(h) *A link-bound kernel beside products* (`link`): (g) with the copy writing into pinned host memory, its CTAs'
    stores across PCIe, so that a link bounds it as NVLink or the NIC bounds a collective's kernel: is what (g)
    measured the multiprocessors' (it stays) or HBM's (it goes)?

Device times are CUDA events; host times time.perf_counter; every figure is the median of `--repeats` after
`--warmup` runs, with its spread. One JSON lands at `--out`. On a CPU (`--device cpu --quick`) the same code runs
tiny, device times are the host's (an aten op's own time stands for a kernel's), and the GPU-only parts (kernel
counts, FP8, compiled passes, the second stream) say why they skip.

    python benchmarks/gpu_probe.py --out probe.json    # one H100/H200: 28 s on an H200 before the kernels by name
    python benchmarks/gpu_probe.py --device cpu --quick --out /tmp/probe.json  # the same code, tiny, on a CPU
    python benchmarks/gpu_probe.py --parts dense --out probe.json  # some of the parts only
"""

from __future__ import annotations

import json
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from one_line_parser import OneLineParser  # this folder's

# --- timing ------------------------------------------------------------------------------------------------------

# The GPU clock cycles parts (b) and (c) hold the device for before each span they time (`Clock.held_start`): 10^7,
# 5 ms at Hopper's 1.98 GHz boost (longer at lower clocks), where the spans' issue took under 2 ms of the first H200
# run's host; part (a)'s held spans, 3 x 10^7 (15 ms), where its backward at 16 local experts took 6 ms to issue.
HOLD_CYCLES = 10**7
MOE_HOLD_CYCLES = 3 * 10**7


@dataclass(frozen=True)
class Mark:
    """A point in a run: the host's clock, and on a GPU an event the device reaches in its stream's order."""

    host_s: float
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class Clock:
    """Marks and their differences; on a CPU the device's time is the host's (its ops run as they are called)."""

    cuda: bool

    def mark(self) -> Mark:
        host_s = time.perf_counter()
        if not self.cuda:
            return Mark(host_s, None)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return Mark(host_s, event)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def held_start(self, cycles: int = HOLD_CYCLES) -> Mark:
        """A span's start that the device reaches only after `cycles` of a spinning kernel, by when the host has
        issued the span's work behind it: the span is then the device's time alone, not the host's issue (from an
        idle device, the first H200 run's C = 2 forward spans timed the host: docs/hardware.md, "What the H200
        probe settled"). On a CPU, a plain start."""
        self.synchronize()
        if self.cuda:
            torch.cuda._sleep(cycles)
        return self.mark()

    def held_ms(self, run: Callable[[], object]) -> float:
        """The device's time for what `run` issues, from a `held_start`: its time alone, not the host's issue."""
        start = self.held_start()
        run()
        end = self.mark()
        self.synchronize()
        return self.device_ms(start, end)

    def still_held(self, start: Mark) -> bool | None:
        """Whether the device has not yet reached `start` (a `held_start`): asked as the host ends a span's issue,
        True says the hold outlasted the issue, so the span holds no host gap. None on a CPU."""
        return not start.event.query() if self.cuda else None

    @staticmethod
    def host_ms(start: Mark, end: Mark) -> float:
        return (end.host_s - start.host_s) * 1e3

    def device_ms(self, start: Mark, end: Mark) -> float:
        return start.event.elapsed_time(end.event) if self.cuda else self.host_ms(start, end)


@dataclass(frozen=True)
class Timing:
    """One quantity over the repeats: its median, its spread and every sample, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    samples_ms: list[float]

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms), [round(s, 5) for s in samples_ms])


@dataclass(frozen=True)
class Budget:
    """How often each measurement runs: untimed warm-up runs, then timed repeats."""

    warmup: int
    repeats: int


def repeat(step: Callable[[], dict[str, float]], budget: Budget) -> dict[str, Timing]:
    """Run `step` (which returns its named milliseconds, its device drained) warm-up times, then the repeats."""
    for _ in range(budget.warmup):
        step()
    samples = [step() for _ in range(budget.repeats)]
    return {name: Timing.of([sample[name] for sample in samples]) for name in samples[0]}


def skipped(error: Exception) -> dict[str, str]:
    """A part that cannot run here, with the first line of why."""
    lines = str(error).strip().splitlines()
    return {"skipped": f"{type(error).__name__}: {lines[0] if lines else ''}"}


# --- (a) the MoE layer -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """A MoE layer's shape: Qwen3-30B-A3B's config.json (hidden_size 2048, moe_intermediate_size 768, num_experts
    128, num_experts_per_tok 8) at a micro-batch of 4,096 tokens (sequence 4,096, MBS 1, as NVIDIA's recipe)."""

    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int

    def rows_per_expert(self, local_experts: int) -> int:
        """A local expert's rows when the rank's experts receive, balanced, as many rows as its own tokens choose."""
        return self.tokens * self.top_k // local_experts


QWEN3_30B_A3B = MoeShape(hidden=2048, ffn=768, experts=128, top_k=8, tokens=4096)
QUICK_MOE = MoeShape(hidden=64, ffn=32, experts=16, top_k=4, tokens=64)
LOCAL_EXPERTS = (4, 8, 16)


@dataclass
class Routed:
    """The permuted rows of a micro-batch, each a token's copy for one of its experts, sorted by local expert."""

    rows: torch.Tensor
    weights: torch.Tensor
    token_of_row: torch.Tensor
    tokens_per_expert: list[int]
    tokens: int


class MoeLayer:
    """A dropless MoE layer in eager torch, as Megatron-core's all-to-all dispatcher and SequentialMLP run one on a
    rank (megatron/core/transformer/moe/token_dispatcher.py, experts.py): a softmax router with its top-k
    renormalised (Qwen3's norm_topk_prob), the rows permuted by expert, the host waiting for the tokens per expert,
    one fc1 GEMM, SwiGLU and one fc2 GEMM a local expert, the rows scattered back weighted by their probabilities.
    One GPU has no all-to-all: the rank's own tokens stand for the ones a balanced expert-parallel group of
    experts / local_experts ranks would send it, each choice folded onto local expert (expert mod local_experts),
    so every local expert gets about tokens · top_k / local_experts rows, as it would."""

    def __init__(self, shape: MoeShape, local_experts: int, device: torch.device, dtype: torch.dtype) -> None:
        def weight(rows: int, columns: int) -> torch.Tensor:
            return (torch.randn(rows, columns, device=device) * columns**-0.5).to(dtype).requires_grad_()

        self.shape = shape
        self.local_experts = local_experts
        self.router = weight(shape.experts, shape.hidden)
        self.fc1 = [weight(2 * shape.ffn, shape.hidden) for _ in range(local_experts)]
        self.fc2 = [weight(shape.hidden, shape.ffn) for _ in range(local_experts)]

    def parameters(self) -> list[torch.Tensor]:
        return [self.router, *self.fc1, *self.fc2]

    def route(self, x: torch.Tensor) -> Routed:
        """Router and permute, then the host's wait for the tokens per expert; returns as the wait ends."""
        scores = (x @ self.router.t()).float().softmax(dim=-1)
        probabilities, chosen = scores.topk(self.shape.top_k, dim=-1)
        probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
        local = (chosen % self.local_experts).flatten()
        order = local.argsort(stable=True)
        token_of_row = order // self.shape.top_k
        rows = x.index_select(0, token_of_row)
        weights = probabilities.flatten().index_select(0, order).to(x.dtype)
        tokens_per_expert = torch.bincount(local, minlength=self.local_experts).tolist()
        return Routed(rows, weights, token_of_row, tokens_per_expert, x.shape[0])

    def combine(self, routed: Routed) -> torch.Tensor:
        """Each local expert's SwiGLU MLP on its rows, then the rows summed back into their tokens."""
        outputs = []
        for rows, fc1, fc2 in zip(routed.rows.split(routed.tokens_per_expert), self.fc1, self.fc2):
            gate, up = (rows @ fc1.t()).chunk(2, dim=-1)
            outputs.append((F.silu(gate) * up) @ fc2.t())
        weighted = torch.cat(outputs) * routed.weights[:, None]
        return weighted.new_zeros(routed.tokens, self.shape.hidden).index_add(0, routed.token_of_row, weighted)


def _has_aten_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def _caller(event) -> str:
    """Who asked for `event`'s work: in a backward the autograd node it runs under (`MmBackward0`), else the
    top-level aten op (the one Python called) it runs in."""
    top = event
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name.startswith(AUTOGRAD_NODE):
            return event.name.removeprefix(AUTOGRAD_NODE)
        if event.name.startswith("aten::"):
            top = event
    return top.name


@dataclass(frozen=True)
class Launch:
    """One kernel the device ran: its name, the aten op that launched it (the innermost), who asked for that op
    (`_caller`) and its device time. On a CPU each aten op stands for a kernel, its own CPU time (its children's
    left out) for the device's (the probe's convention there)."""

    kernel: str
    op: str | None
    caller: str | None
    device_us: float


# The profiler's record of CUPTI asking for a buffer, to which torch 2.11's profiler links the kernel running then a
# second time, beside the aten op that launched it (the H200 probe of day 9: each GEMM loop's first mm and its
# memset twice, the layer's one GEMM a span): its kernels are counted under their op already.
BUFFER_REQUEST = "Activity Buffer Request"


def launches(events: list, on_device: list | None) -> list[Launch]:
    """The kernels of a profiled run (`on_device`: the device's events; None on a CPU) by the op that launched
    each (the profiler links a kernel to its op through their correlation), none twice (`BUFFER_REQUEST`); any it
    could not link in rows with no op, so that the rows sum to every kernel."""
    if on_device is None:
        return [Launch(e.name, e.name, _caller(e), e.self_cpu_time_total) for e in events
                if e.name.startswith("aten::")]
    linked = [Launch(kernel.name, e.name, _caller(e), kernel.duration) for e in events
              if e.device_type == torch.autograd.DeviceType.CPU and e.name != BUFFER_REQUEST for kernel in e.kernels]
    unlinked = len(on_device) - len(linked)
    if unlinked > 0:
        rest_us = sum(e.time_range.elapsed_us() for e in on_device) - sum(launch.device_us for launch in linked)
        linked += [Launch("(no launching op found)", None, None, rest_us / unlinked)] * unlinked
    return linked


ELEMENTWISE_FAMILIES = {"vectorized_elementwise_kernel": "elementwise", "unrolled_elementwise_kernel": "elementwise",
                        "elementwise_kernel": "elementwise", "reduce_kernel": "reduce"}
GENERIC_FUNCTORS = {"BinaryFunctor", "UnaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "gpu_kernel",
                    "gpu_kernel_impl", "gpu_kernel_impl_nocast"}


def short_kernel(name: str) -> str:
    """A kernel's name to print: its function without namespaces, templates or arguments, and for torch's
    elementwise and reduction kernels the functor or kernel they apply ("elementwise Fill", "reduce sum")."""
    if name.startswith(("Memcpy", "Memset", "(")):
        return name
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (name.find("<"), name.find("(")) if i >= 0), default=len(name))
    base = name[:cut].rsplit("::", 1)[-1]
    applied = [found for found in re.findall(r"(\w+?(?:Functor|_functor|_kernel_cuda|_kernel))\b", name[cut:])
               if found not in GENERIC_FUNCTORS and found != base]
    if base not in ELEMENTWISE_FAMILIES or not applied:
        return base
    detail = re.sub(r"(Functor|_functor|_kernel_cuda|_kernel)$", "", applied[0])
    return f"{ELEMENTWISE_FAMILIES[base]} {detail}"


TOP_KERNELS = 20  # kernels a span keeps by name; the rest summed in one row


def _tally(launched: list[Launch], key: Callable[[Launch], object]) -> dict:
    """The launches' count and device microseconds per `key`, longest first."""
    totals: dict[object, list] = {}
    for launch in launched:
        entry = totals.setdefault(key(launch), [0, 0.0])
        entry[0] += 1
        entry[1] += launch.device_us
    return dict(sorted(totals.items(), key=lambda item: -item[1][1]))


def by_kernel(launched: list[Launch], top: int = TOP_KERNELS) -> dict:
    """A span's kernels: per (op, caller, kernel name) their count and device microseconds, the `top` longest
    and the rest in one row (`by_kernel`), and per launching op, all of them (`by_op`)."""
    ranked = list(_tally(launched, lambda launch: (launch.op, launch.caller, launch.kernel)).items())
    rows = [{"kernel": kernel, "short": short_kernel(kernel), "op": op, "caller": caller, "count": count,
             "device_us": round(device_us, 3)} for (op, caller, kernel), (count, device_us) in ranked[:top]]
    if rest := ranked[top:]:
        rows.append({"kernel": f"({len(rest)} more)", "short": f"({len(rest)} more)", "op": None, "caller": None,
                     "count": sum(count for _, (count, _) in rest),
                     "device_us": round(sum(us for _, (_, us) in rest), 3)})
    return {"by_kernel": rows, "by_op": {op: {"count": count, "device_us": round(device_us, 3)} for op, (
        count, device_us) in _tally(launched, lambda launch: str(launch.op)).items()}}


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The time covered by the union of (start, end) intervals in microseconds, in milliseconds."""
    busy_us, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            busy_us += end - max(start, reached)
            reached = end
    return busy_us / 1e3


def activity(run: Callable[[], object], cuda: bool) -> tuple[object, dict, dict]:
    """Run `run` once under torch.profiler: the aten ops it dispatched from the top (Python's or autograd's, each
    one the host pays for), and on a GPU the kernels, copies and sets the device ran and the time they kept it
    busy. Returns run's result, the counts and the kernels by name and by op (`by_kernel`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        result = run()
        if cuda:
            torch.cuda.synchronize()
    events = profile.events()
    ops = sum(1 for e in events if e.name.startswith("aten::") and not _has_aten_ancestor(e))
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = {"ops": ops, "kernels": len(on_device) if cuda else None,
              "device_busy_ms": _busy_ms([(e.time_range.start, e.time_range.end) for e in on_device]) if cuda
              else None}
    return result, counts, by_kernel(launches(events, on_device if cuda else None))


def timed_backward(clock: Clock, out: torch.Tensor, grad_out: torch.Tensor) -> tuple[float, float]:
    """`out`'s backward from a drained device: the host's time to issue it and the device's to run it, ms."""
    clock.synchronize()
    start = clock.mark()
    out.backward(grad_out)
    launched = clock.mark()
    clock.synchronize()
    return clock.host_ms(start, launched), clock.device_ms(start, launched)


def probe_moe(shape: MoeShape, device: torch.device, dtype: torch.dtype, budget: Budget) -> dict:
    """(a): per local-expert count, the forward's and backward's device and host times, the device's alone after
    the synchronisation and in the backward (`*_held_device_ms`, with how often the hold outlasted the host's issue),
    their op and kernel counts, and their kernels by name (`kernels`)."""
    clock = Clock(device.type == "cuda")
    layers, kernels = [], []
    for local_experts in LOCAL_EXPERTS:
        layer = MoeLayer(shape, local_experts, device, dtype)
        x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)

        def forget_grads() -> None:
            for tensor in (x, *layer.parameters()):
                tensor.grad = None

        def step() -> dict[str, float]:
            forget_grads()
            clock.synchronize()
            start = clock.mark()
            routed = layer.route(x)
            synchronised = clock.mark()
            out = layer.combine(routed)
            launched = clock.mark()
            backward_host_ms, backward_device_ms = timed_backward(clock, out, grad_out)
            return {"forward_device_ms": clock.device_ms(start, launched),
                    "before_sync_host_ms": clock.host_ms(start, synchronised),
                    "after_sync_host_ms": clock.host_ms(synchronised, launched),
                    "after_sync_device_ms": clock.device_ms(synchronised, launched),
                    "backward_host_ms": backward_host_ms, "backward_device_ms": backward_device_ms}

        held: dict[str, list[bool | None]] = {"after_sync": [], "backward": []}

        def held_step() -> dict[str, float]:
            """The spans that issue from an empty queue, each behind a held device: their device time alone."""
            forget_grads()
            routed = layer.route(x)
            start = clock.held_start(MOE_HOLD_CYCLES)
            out = layer.combine(routed)
            launched = clock.mark()
            held["after_sync"].append(clock.still_held(start))
            backward_start = clock.held_start(MOE_HOLD_CYCLES)
            out.backward(grad_out)
            backward_launched = clock.mark()
            held["backward"].append(clock.still_held(backward_start))
            clock.synchronize()
            return {"after_sync_held_device_ms": clock.device_ms(start, launched),
                    "backward_held_device_ms": clock.device_ms(backward_start, backward_launched)}

        timings = repeat(step, budget) | repeat(held_step, budget)
        routed, before_sync, before_sync_kernels = activity(lambda: layer.route(x), clock.cuda)
        out, after_sync, after_sync_kernels = activity(lambda: layer.combine(routed), clock.cuda)
        forget_grads()
        _, backward, backward_kernels = activity(lambda: out.backward(grad_out), clock.cuda)
        layers.append({"local_experts": local_experts, "rows_per_expert": shape.rows_per_expert(local_experts),
                       "tokens_per_expert_seen": routed.tokens_per_expert, "timings": timings,
                       "counts": {"before_sync": before_sync, "after_sync": after_sync, "backward": backward},
                       "hold": {"cycles": MOE_HOLD_CYCLES if clock.cuda else 0, "outlasted_issue": {
                           span: None if None in runs else sum(runs) / len(runs) for span, runs in held.items()}}})
        kernels.append({"local_experts": local_experts, "before_sync": before_sync_kernels,
                        "after_sync": after_sync_kernels, "backward": backward_kernels})
    return {"shape": asdict(shape), "dtype": str(dtype), "layers": layers, "derived": moe_derived(layers),
            "kernels": kernels}


def moe_derived(layers: list[dict]) -> dict:
    """What the questions read off: the host's microseconds a kernel (and an op) from the synchronisation to the
    last launch and over the backward, per local-expert count, and each median's growth a local expert between
    the fewest and the most local experts (the per-expert cost, whatever the tokens)."""
    per_layer = []
    for layer in layers:
        t, c = layer["timings"], layer["counts"]
        entry = {"local_experts": layer["local_experts"]}
        for span, host in (("after_sync", "after_sync_host_ms"), ("backward", "backward_host_ms")):
            for unit in ("ops", "kernels"):
                count = c[span][unit]
                entry[f"{span}_host_us_per_{unit[:-1]}"] = t[host].median_ms * 1e3 / count if count else None
        per_layer.append(entry)
    fewest, most = layers[0], layers[-1]
    added = most["local_experts"] - fewest["local_experts"]
    growth = {name: (most["timings"][name].median_ms - timing.median_ms) / added
              for name, timing in fewest["timings"].items()}
    return {"per_layer": per_layer, "ms_per_added_local_expert": growth}


# --- (b) context parallelism's attention -------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShape:
    """Llama 3.1 8B's attention (config.json: 32 attention heads, 8 key-value heads, hidden 4,096) over a sequence
    of 8,192 tokens, one sequence a micro-batch."""

    heads: int
    kv_heads: int
    head_dim: int
    tokens: int


LLAMA31_8B = AttentionShape(heads=32, kv_heads=8, head_dim=128, tokens=8192)
QUICK_ATTENTION = AttentionShape(heads=4, kv_heads=2, head_dim=16, tokens=256)
CONTEXT_PARALLEL = 2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA on sbhd tensors ([tokens, batch, heads, dim], Megatron's layout), grouped-query; out in sbhd."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal,
                                         enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def lse_correction(lse: torch.Tensor, lse_step: torch.Tensor) -> None:
    """TransformerEngine 1.10's flash_attn_fwd_softmax_lse_correction: lse = log(exp(lse) + exp(lse_step))."""
    larger = torch.max(lse, lse_step)
    smaller = torch.min(lse, lse_step)
    lse.copy_(larger + torch.log(1 + torch.exp(smaller - larger)))


def out_correction(out: torch.Tensor, out_step: torch.Tensor, lse: torch.Tensor, lse_step: torch.Tensor) -> None:
    """TransformerEngine 1.10's flash_attn_fwd_out_correction for sbhd (seq_dim 0): a step's block added into the
    output scaled by exp(its statistics less the joined ones)."""
    scale = torch.exp(lse_step - lse).movedim(2, 0).unsqueeze(-1)
    out.add_(out_step * scale)


@dataclass
class RankInputs:
    """One C = 2 rank's tensors in TransformerEngine's sbhd layout: its two chunks of queries ([2, chunk, b, h, d])
    and the key-value buffer the ring sends ([2, chunk, b, 2, kv_heads, d]: chunks, then k and v)."""

    q: torch.Tensor
    kv: torch.Tensor


def rank_blocks(rank: int, inputs: RankInputs, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The (q, k, v, causal) of step `step` on `rank` at C = 2, as AttnFuncWithCPAndKVP2P.forward picks them: step
    0 the rank's own chunks, causal; step 1 unmasked, rank 0 its second half of queries against all the keys it
    received, rank 1 all its queries against their first half. Views, as sbhd's halves need no copy."""
    q, kv = inputs.q, inputs.kv
    whole_q = q.flatten(0, 1)
    if step == 0:
        return whole_q, kv[..., 0, :, :].flatten(0, 1), kv[..., 1, :, :].flatten(0, 1), True
    if rank == 0:
        return q[1], kv[..., 0, :, :].flatten(0, 1), kv[..., 1, :, :].flatten(0, 1), False
    return whole_q, kv[0][..., 0, :, :], kv[0][..., 1, :, :], False


def forward_passes(rank: int, q: torch.Tensor, outs: list[torch.Tensor], lses: list[torch.Tensor],
                   lse_correct: Callable, out_correct: Callable) -> torch.Tensor:
    """What AttnFuncWithCPAndKVP2P.forward (TE 1.10) does after its C = 2 steps: a zeroed output, the first step's
    statistics cloned to float64 and joined with the second's (whole on rank 1, the second half on rank 0), then
    each step's block added in (rank 0's second step into the output's second half)."""
    out = torch.zeros_like(q)
    lse = lses[0].clone().to(torch.double)
    lse_halves = lse.view(*lse.shape[:-1], 2, lse.shape[-1] // 2)
    lse_correct(lse if rank >= 1 else lse_halves[..., 1, :], lses[1])
    joined = lse.to(torch.float)
    for step in range(CONTEXT_PARALLEL):
        if step <= rank:
            out_correct(out.view(*outs[step].shape), outs[step], joined, lses[step])
        else:
            out_correct(out[1], outs[step], lse_halves[..., 1, :], lses[step])
    return out


def backward_join(rank: int, step: int, dq: torch.Tensor, dkv: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> None:
    """One step of AttnFuncWithCPAndKVP2P.backward's joins (TE 1.10, BF16, sbhd, C = 2) after the step's kernel:
    its key and value gradients joined (`torch.cat`) and copied or added into `dkv` ([k or v, chunk half, ...]),
    the sum that travels with the keys (at step 1 the one the other rank sent), its query gradient copied or
    added into the rank's `dq`, halves where the step covered half. Step 0 is the off-diagonal block, 1 the
    causal one, the backward's order."""
    dq_step, dk_step, dv_step = grads
    joined = torch.cat((dk_step.unsqueeze(0), dv_step.unsqueeze(0)), dim=0)
    if step == 0 and rank == 0:
        dq[1].copy_(dq_step)
        dkv.copy_(joined.view(dkv.shape))
    elif step == 0:
        dq.copy_(dq_step.view(dq.shape))
        dkv[:, 0].copy_(joined)
    elif rank == 0:
        halves = dq_step.view(dq.shape)
        dq[0].copy_(halves[0])
        dq[1].add_(halves[1])
        joined = joined.view(dkv.shape)
        dkv[:, 0].add_(joined[:, 0])
        dkv[:, 1].copy_(joined[:, 1])
    else:
        dq.add_(dq_step.view(dq.shape))
        dkv.add_(joined.view(dkv.shape))


def gradient_sum(kv: torch.Tensor) -> torch.Tensor:
    """An empty travelling sum of key and value gradients for a key-value buffer ([k or v, chunk half, ...])."""
    return torch.empty((2, *kv.shape[:-3], *kv.shape[-2:]), dtype=kv.dtype, device=kv.device)


def backward_passes(rank: int, inputs: RankInputs, grads: list[tuple[torch.Tensor, ...]]) -> None:
    """What AttnFuncWithCPAndKVP2P.backward (TE 1.10) does around a rank's C = 2 kernels: the key-value buffer
    copied into the first send buffer, then each step's joins. One rank has no ring, so step 1 joins into the sum
    step 0 wrote rather than the other rank's, the same passes over the same bytes."""
    send = torch.empty((2, *inputs.kv.shape), dtype=inputs.kv.dtype, device=inputs.kv.device)
    send[0].copy_(inputs.kv)
    dq = torch.empty_like(inputs.q)
    dkv = gradient_sum(inputs.kv)
    for step, step_grads in enumerate(grads):
        backward_join(rank, step, dq, dkv, step_grads)


def _leaf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)


def time_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, clock: Clock,
               budget: Budget) -> dict[str, Timing]:
    """One attention kernel's forward and backward (q, k, v as leaves of these shapes)."""
    leaves = [_leaf(t.shape, t.device, t.dtype) for t in (q, k, v)]
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)

    def step() -> dict[str, float]:
        for leaf in leaves:
            leaf.grad = None
        start = clock.held_start()
        out = attend(*leaves, causal)
        forward_done = clock.mark()
        out.backward(dout)
        backward_done = clock.mark()
        clock.synchronize()
        return {"forward_ms": clock.device_ms(start, forward_done),
                "backward_ms": clock.device_ms(forward_done, backward_done)}

    return repeat(step, budget)


def rank_inputs(shape: AttentionShape, device: torch.device, dtype: torch.dtype) -> RankInputs:
    """Random queries and key-value buffer of one C = 2 rank."""
    chunk = shape.tokens // (2 * CONTEXT_PARALLEL)
    return RankInputs(q=torch.randn(2, chunk, 1, shape.heads, shape.head_dim, device=device, dtype=dtype),
                      kv=torch.randn(2, chunk, 1, 2, shape.kv_heads, shape.head_dim, device=device, dtype=dtype))


def time_rank(rank: int, shape: AttentionShape, device: torch.device, dtype: torch.dtype, clock: Clock,
              budget: Budget, compiled: tuple[Callable, Callable] | str) -> dict:
    """A C = 2 rank's forward (the buffer's join, both steps, the passes) and backward (the passes around both
    steps' kernels), whole and the passes alone, the passes also as TE compiles them (`compiled`, or why not), the
    forward also with step 1 on a second stream as TE runs it (on a GPU);
    the statistics are random, as their values cost nothing. The forward's kernels run as in training, keeping
    what their backward needs; its passes, as inside TE's autograd.Function, record nothing."""
    inputs = rank_inputs(shape, device, dtype)
    blocks = [rank_blocks(rank, inputs, step) for step in range(CONTEXT_PARALLEL)]
    lses = [torch.randn(1, shape.heads, q.shape[0], device=device) for q, *_ in blocks]
    outs = [attend(*block) for block in blocks]
    q = _leaf(inputs.q.shape, device, dtype)
    k, v = (_leaf(inputs.kv[..., 0, :, :].shape, device, dtype) for _ in range(2))

    def forward(side: torch.cuda.Stream | None = None) -> Callable[[], dict[str, float]]:
        """The rank's forward, its steps on the current stream, or step 1 on `side` as TE 1.10 runs it
        (`flash_attn_streams`, "to resolve wave quantization issue"): after the receive that TE issues behind the
        buffer's join and before step 0, so that step 1's tiles may fill step 0's tail."""
        def step() -> dict[str, float]:
            start = clock.held_start()
            kv = torch.cat((k.unsqueeze(-3), v.unsqueeze(-3)), dim=-3)
            received = clock.mark()
            step_outs = [attend(*rank_blocks(rank, RankInputs(q, kv), 0))]
            with torch.cuda.stream(side):  # None: the current stream
                if side:
                    side.wait_event(received.event)
                step_outs.append(attend(*rank_blocks(rank, RankInputs(q, kv), 1)))
            if side:
                torch.cuda.current_stream().wait_stream(side)
            with torch.no_grad():
                forward_passes(rank, q, step_outs, lses, lse_correction, out_correction)
            end = clock.mark()
            clock.synchronize()
            return {"forward_two_streams_ms" if side else "forward_ms": clock.device_ms(start, end)}
        return step

    def passes(lse_correct: Callable, out_correct: Callable) -> Callable[[], dict[str, float]]:
        def step() -> dict[str, float]:
            return {"forward_passes_ms": clock.held_ms(
                lambda: forward_passes(rank, inputs.q, outs, lses, lse_correct, out_correct))}
        return step

    # The backward runs the off-diagonal step first and the causal one last, as TE's backward loop does.
    leaves = [[_leaf(t.shape, device, dtype) for t in block[:3]] for block in reversed(blocks)]
    causal = [block[3] for block in reversed(blocks)]
    douts = [torch.randn(q.shape, device=device, dtype=dtype) for q, *_ in leaves]
    step_grads = [tuple(torch.randn(t.shape, device=device, dtype=dtype) for t in block) for block in leaves]

    def backward() -> dict[str, float]:
        graphs = [attend(*block, flag) for block, flag in zip(leaves, causal)]
        start = clock.held_start()
        grads = [torch.autograd.grad(out, block, dout) for out, block, dout in zip(graphs, leaves, douts)]
        backward_passes(rank, inputs, grads)
        end = clock.mark()
        clock.synchronize()
        return {"backward_ms": clock.device_ms(start, end)}

    def backward_alone() -> dict[str, float]:
        return {"backward_passes_ms": clock.held_ms(lambda: backward_passes(rank, inputs, step_grads))}

    result = {}
    for step in (forward(), backward, passes(lse_correction, out_correction), backward_alone):
        result.update(repeat(step, budget))
    result.update(repeat(forward(torch.cuda.Stream()), budget) if clock.cuda
                  else {"forward_two_streams_ms": {"skipped": "a second stream needs a CUDA GPU"}})
    if isinstance(compiled, str):
        result["forward_passes_compiled"] = {"skipped": compiled}
        return result
    try:
        result["forward_passes_compiled"] = repeat(passes(*compiled), budget)["forward_passes_ms"]
    except Exception as error:  # whatever Inductor or Triton raise, the eager figures stand
        result["forward_passes_compiled"] = skipped(error)
    return result


def sdpa_backends(cuda: bool) -> dict[str, object]:
    """The SDPA kernels to time: FlashAttention-2 and cuDNN's fused attention (TransformerEngine's kernel on
    Hopper) on a GPU, torch's flash kernel on a CPU."""
    from torch.nn.attention import SDPBackend

    backends = {"flash": SDPBackend.FLASH_ATTENTION}
    if cuda:
        backends["cudnn"] = SDPBackend.CUDNN_ATTENTION
    return backends


def probe_attention(shape: AttentionShape, device: torch.device, dtype: torch.dtype, budget: Budget,
                    no_compile: bool) -> dict:
    """(b): per SDPA kernel, C = 1's whole causal attention, C = 2's steps, and each C = 2 rank whole."""
    from torch.nn.attention import sdpa_kernel

    clock = Clock(device.type == "cuda")
    compiled = ("torch.compile's passes run on a CUDA GPU only" if not clock.cuda else "--no-compile" if no_compile
                else (torch.compile(lse_correction), torch.compile(out_correction)))
    whole = [torch.randn(shape.tokens, 1, heads, shape.head_dim, device=device, dtype=dtype)
             for heads in (shape.heads, shape.kv_heads, shape.kv_heads)]
    results = {}
    for name, backend in sdpa_backends(clock.cuda).items():
        with sdpa_kernel(backend):
            result = {"c1": attempt(partial(time_block, *whole, True, clock, budget))}
            for rank in range(CONTEXT_PARALLEL):
                inputs = rank_inputs(shape, device, dtype)
                for step in range(CONTEXT_PARALLEL):
                    if step or not rank:  # step 0's causal block is the same shape on both ranks
                        key = f"c2_step{step}" + (f"_rank{rank}" if step else "")
                        result[key] = attempt(partial(time_block, *rank_blocks(rank, inputs, step), clock, budget))
                result[f"c2_rank{rank}"] = attempt(partial(time_rank, rank, shape, device, dtype, clock, budget,
                                                           compiled))
        results[name] = result
    return {"shape": asdict(shape), "context_parallel": CONTEXT_PARALLEL, "dtype": str(dtype),
            "held_cycles": HOLD_CYCLES if clock.cuda else 0, "kernels": results,
            "c2_rank_over_half_c1": {name: ring_over_half_c1(result) for name, result in results.items()}}


def attempt(measure: Callable[[], dict]) -> dict:
    """A measurement, or why this GPU or torch cannot take it (an SDPA kernel refusing a shape or a layout)."""
    try:
        return measure()
    except RuntimeError as error:
        return skipped(error)


def ring_over_half_c1(result: dict) -> dict[str, float]:
    """Each C = 2 rank's forward and backward over half of C = 1's: 1 where splitting the sequence in two costs
    each rank exactly half the whole kernel's time (none where either was skipped)."""
    return {f"rank{rank}_{pass_}": result[f"c2_rank{rank}"][f"{pass_}_ms"].median_ms
            / (result["c1"][f"{pass_}_ms"].median_ms / CONTEXT_PARALLEL)
            for rank in range(CONTEXT_PARALLEL) for pass_ in ("forward", "backward")
            if "skipped" not in result["c1"] and "skipped" not in result[f"c2_rank{rank}"]}


# --- (c) the experts' GEMMs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Product:
    """A linear layer's GEMM, (m x k) @ (k x n), in one of `ORIENTATIONS`; `token_dim` names which of m and k the
    tokens run along, the one a single GEMM over every local expert's rows grows."""

    name: str
    m: int
    k: int
    n: int
    token_dim: str
    orientation: str

    def one_gemm(self, local_experts: int) -> tuple[int, int, int]:
        """The (m, k, n) of one GEMM doing the loop's FLOPs, the local experts' rows stacked along the tokens."""
        if self.token_dim == "m":
            return self.m * local_experts, self.k, self.n
        return self.m, self.k * local_experts, self.n


ORIENTATIONS = ("forward", "input grad", "weight grad")


def linear_products(layer: str, rows: int, inputs: int, outputs: int) -> list[Product]:
    """A linear layer's three products over `rows` tokens: forward (rows x inputs by inputs x outputs), input
    gradient (rows x outputs by outputs x inputs) and weight gradient (outputs x rows by rows x inputs)."""
    forward, input_grad, weight_grad = ORIENTATIONS
    return [Product(f"{layer} {forward}", rows, inputs, outputs, "m", forward),
            Product(f"{layer} {input_grad}", rows, outputs, inputs, "m", input_grad),
            Product(f"{layer} {weight_grad}", outputs, rows, inputs, "k", weight_grad)]


def expert_products(shape: MoeShape, local_experts: int) -> list[Product]:
    """fc1 (hidden -> 2 x ffn, gate and up) and fc2 (ffn -> hidden): forward, input gradient, weight gradient."""
    rows = shape.rows_per_expert(local_experts)
    return [*linear_products("fc1", rows, shape.hidden, 2 * shape.ffn),
            *linear_products("fc2", rows, shape.ffn, shape.hidden)]


@dataclass(frozen=True)
class GemmKind:
    """How a product (m, k, n) is made and multiplied: `operands` its arguments, the first operand row-major
    (m x k) and the second column-major (a weight stored n x k, transposed, as torch._scaled_mm wants it and
    TransformerEngine's float8 products read theirs), and `multiply` what runs on them."""

    name: str
    operands: Callable[[int, int, int], tuple[torch.Tensor, ...]]
    multiply: Callable[..., torch.Tensor]


def plain_kind(device: torch.device, dtype: torch.dtype, accumulate: torch.dtype | None = None) -> GemmKind:
    """Products in `dtype` through torch.mm; with `accumulate`, each added to an m x n tensor of that dtype, the sum
    written in it (torch.addmm's out_dtype, into a new tensor: the same bytes read and written as in place), as
    TransformerEngine's weight-gradient product accumulates into Megatron-core's float32 main_grad
    (`fuse_wgrad_accumulation`: cuBLASLt's D = A.B + C, C = D). A CPU's torch has no kernel for it."""

    def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
        a, b = (torch.randn(rows, k, device=device, dtype=dtype) for rows in (m, n))
        return (a, b.t()) if accumulate is None else (torch.zeros(m, n, device=device, dtype=accumulate), a, b.t())

    name = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    if accumulate is None:
        return GemmKind(name, operands, torch.mm)
    return GemmKind(f"{name} into {str(accumulate).removeprefix('torch.').replace('float32', 'fp32')}", operands,
                    partial(torch.addmm, out_dtype=accumulate))


def no_float8(device: torch.device) -> RuntimeError | None:
    """Why this device or torch cannot run a float8 product (None: it can): _scaled_mm needs a CUDA GPU of compute
    capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return RuntimeError("FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer")
    if not hasattr(torch, "_scaled_mm"):
        return RuntimeError(f"torch {torch.__version__} has no torch._scaled_mm")
    return None


def float8_kind(name: str, device: torch.device, first: torch.dtype = torch.float8_e4m3fn, fast_accum: bool = False,
                out: torch.dtype = torch.bfloat16) -> GemmKind:
    """Float8 products through torch._scaled_mm with per-tensor scales (delayed scaling's: one float32 each): the
    first operand in `first` (e4m3, or e5m2 for a gradient under TransformerEngine's HYBRID format), the second in
    e4m3, `fast_accum` cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM, the result in `out`."""
    unit = torch.ones((), device=device)

    def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(m, k, device=device).to(first),
                torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t())

    return GemmKind(name, operands, lambda a, b: torch._scaled_mm(a, b, unit, unit, out_dtype=out,
                                                                  use_fast_accum=fast_accum))


def gemm_kinds(device: torch.device, dtype: torch.dtype) -> dict[str, GemmKind | Exception]:
    """BF16 always; FP8 (e4m3, accumulating split: _scaled_mm's default) where the GPU and torch can (`no_float8`)."""
    return {"bf16": plain_kind(device, dtype), "fp8": no_float8(device) or float8_kind("fp8", device)}


def time_gemms(kind: GemmKind, sizes: list[tuple[int, int, int]], clock: Clock,
               budget: Budget) -> tuple[dict[str, Timing], dict]:
    """A loop of GEMMs of these (m, k, n), each on its own operands, issued back to back: device and host time from
    an idle device, and the device's time alone behind a held one (`held_device_ms`); and one loop profiled (its
    ops and kernels, and the kernels by name: `activity`)."""
    operands = [kind.operands(m, k, n) for m, k, n in sizes]

    def loop() -> None:
        for arguments in operands:
            kind.multiply(*arguments)

    def step() -> dict[str, float]:
        clock.synchronize()
        start = clock.mark()
        loop()
        launched = clock.mark()
        clock.synchronize()
        return {"device_ms": clock.device_ms(start, launched), "host_ms": clock.host_ms(start, launched)}

    def held_step() -> dict[str, float]:
        return {"held_device_ms": clock.held_ms(loop)}

    timings = repeat(step, budget) | repeat(held_step, budget)
    _, counts, kernels = activity(loop, clock.cuda)
    return timings, {**counts, **kernels}


def probe_gemms(shape: MoeShape, device: torch.device, dtype: torch.dtype, budget: Budget,
                local_counts: tuple[int, ...] = (4, 16)) -> dict:
    """(c): each expert product as a loop of one GEMM a local expert, and as one GEMM of the same FLOPs."""
    clock = Clock(device.type == "cuda")
    results = {}
    for name, kind in gemm_kinds(device, dtype).items():
        if isinstance(kind, Exception):
            results[name] = skipped(kind)
            continue
        rows = []
        try:
            for local_experts in local_counts:
                for product in expert_products(shape, local_experts):
                    loop, loop_profile = time_gemms(kind, [(product.m, product.k, product.n)] * local_experts,
                                                    clock, budget)
                    one, one_profile = time_gemms(kind, [product.one_gemm(local_experts)], clock, budget)
                    flop = 2 * product.m * product.k * product.n * local_experts
                    kernels = loop_profile["kernels"]
                    rows.append({"local_experts": local_experts, **asdict(product), "flop": flop,
                                 "loop": loop, "one_gemm": one,
                                 "loop_tflops": flop / loop["device_ms"].median_ms / 1e9,
                                 "one_gemm_tflops": flop / one["device_ms"].median_ms / 1e9,
                                 "loop_us_per_gemm": loop["device_ms"].median_ms * 1e3 / local_experts,
                                 "loop_held_us_per_gemm": loop["held_device_ms"].median_ms * 1e3 / local_experts,
                                 "loop_kernels_per_gemm": kernels / local_experts if kernels is not None else None,
                                 "loop_profile": loop_profile, "one_gemm_profile": one_profile})
        except RuntimeError as error:
            results[name] = skipped(error)
            continue
        results[name] = rows
    return results


# --- (d) the combine's kernels and elementwise layouts -------------------------------------------------------------


COMBINE_DTYPES = (torch.bfloat16, torch.float32)
COMBINE_LOCAL_EXPERTS = 16  # the rows' order: sorted by local expert, as part (a)'s at 16


def combine_ops(shape: MoeShape, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable, int]]:
    """Part (d)'s ops at part (a)'s shape (tokens x top_k rows of the hidden size, ordered by local expert), each
    with the bytes it must read and write: the ways to sum the rows back into their tokens, index_add_ (eager's
    combine: torch's ReduceAdd, an atomic add an element), scatter_add_ (Megatron-core's unfused unpermute,
    moe_utils.py), index_put_ accumulating (the count's op: sorted, no atomics), and the gather and the sum over
    top_k that TransformerEngine's fused unpermute reads and writes in one kernel; and one product and one silu
    on contiguous, broadcast (a column, as the router's weights) and strided (a chunk's halves, as SwiGLU's)
    operands, of which torch vectorises the contiguous only."""
    tokens, top_k, hidden = shape.tokens, shape.top_k, shape.hidden
    rows = tokens * top_k
    chosen = torch.randint(0, COMBINE_LOCAL_EXPERTS, (rows,), device=device)
    order = chosen.argsort(stable=True)
    token_of_row = order // top_k
    source, out = torch.randn(rows, hidden, device=device, dtype=dtype), torch.zeros(tokens, hidden, device=device,
                                                                                       dtype=dtype)
    other, weights = torch.randn_like(source), torch.randn(rows, 1, device=device, dtype=dtype)
    halves = torch.randn(rows, 2 * hidden, device=device, dtype=dtype)
    gathered = source.index_select(0, order)
    size = source.element_size()
    rows_bytes, tokens_bytes = rows * hidden * size, tokens * hidden * size
    scatter = rows_bytes + 2 * tokens_bytes
    return {"index_add_": (lambda: out.index_add_(0, token_of_row, source), scatter),
            "scatter_add_": (lambda: out.scatter_add_(0, token_of_row[:, None].expand(-1, hidden), source), scatter),
            "index_put_ accumulate": (lambda: out.index_put_((token_of_row,), source, accumulate=True), scatter),
            "index_select": (lambda: source.index_select(0, order), 2 * rows_bytes),
            "sum over top_k": (lambda: gathered.view(tokens, top_k, hidden).sum(1), rows_bytes + tokens_bytes),
            "mul contiguous": (lambda: source * other, 3 * rows_bytes),
            "mul broadcast": (lambda: source * weights, 2 * rows_bytes + rows * size),
            "mul strided": (lambda: halves[:, :hidden] * halves[:, hidden:], 3 * rows_bytes),
            "silu contiguous": (lambda: F.silu(source), 2 * rows_bytes),
            "silu strided": (lambda: F.silu(halves[:, :hidden]), 2 * rows_bytes)}


def probe_combine(shape: MoeShape, device: torch.device, budget: Budget) -> dict:
    """(d): per dtype (`COMBINE_DTYPES`), each of `combine_ops` alone behind a held device: its device time and
    the bytes it moves, whose ratio is its achieved bandwidth (on a CPU, the host's time)."""
    clock = Clock(device.type == "cuda")
    results = {}
    for dtype in COMBINE_DTYPES:
        ops = {}
        for name, (run, moved_bytes) in combine_ops(shape, device, dtype).items():
            def step(run: Callable = run) -> dict[str, float]:
                return {"device_ms": clock.held_ms(run)}

            ops[name] = {"device_ms": repeat(step, budget)["device_ms"], "moved_bytes": moved_bytes}
        results[str(dtype).removeprefix("torch.")] = ops
    return results


# --- (e) the Llama 3.1 rows' dense products ----------------------------------------------------------------------


@dataclass(frozen=True)
class DenseShape:
    """A published Llama 3.1 row's transformer layer as one of its ranks multiplies it: the model's config.json
    (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim 128) over `tensor` ranks
    (Megatron-core's column-parallel linear_qkv and linear_fc1, gate and up fused, and row-parallel linear_proj and
    linear_fc2), at the `tokens` a rank's products read: the sequence over the context-parallel ranks times the
    micro-batch (8,192 / 2 x 1 in every row of benchmarks/published/nvidia-dgxc-h100.csv; sequence parallelism
    gathers the tensor-parallel ranks' shares before a product, so `tensor` does not divide them)."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tensor: int
    tokens: int


LLAMA31_DENSE = (DenseShape("Llama 3.1 8B", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, tensor=1,
                            tokens=4096),
                 DenseShape("Llama 3.1 70B", hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, tensor=4,
                            tokens=4096))
QUICK_DENSE = (DenseShape("quick", hidden=64, ffn=96, heads=4, kv_heads=2, head_dim=16, tensor=2, tokens=32),)


def dense_products(shape: DenseShape) -> list[Product]:
    """A rank's products of one layer, each as `linear_products` (forward, input and weight gradient): qkv
    (hidden -> its share of the query, key and value heads), proj (its share of the heads -> hidden), fc1 (hidden ->
    its share of gate and up) and fc2 (its share of the FFN -> hidden); at t > 1 also each forward and input gradient
    over 1/t of the tokens, the chunks TransformerEngine's userbuffers overlap runs them in and pipesim prices
    (planning/estimate.py `overlapped_ms`)."""
    t = shape.tensor
    attention = shape.heads * shape.head_dim
    layers = (("qkv", shape.hidden, (shape.heads + 2 * shape.kv_heads) * shape.head_dim // t),
              ("proj", attention // t, shape.hidden), ("fc1", shape.hidden, 2 * shape.ffn // t),
              ("fc2", shape.ffn // t, shape.hidden))
    products = []
    for layer, inputs, outputs in layers:
        products += linear_products(layer, shape.tokens, inputs, outputs)
        if t > 1:
            products += [replace(product, name=f"{product.name}, a 1/{t} chunk", m=product.m // t)
                         for product in linear_products(layer, shape.tokens, inputs, outputs)[:2]]
    return products


def dense_kinds(device: torch.device, dtype: torch.dtype) -> dict[str, tuple[tuple[str, ...], GemmKind | Exception]]:
    """Part (e)'s kinds of product, each with the orientations (of `ORIENTATIONS`) it runs: BF16, and its weight
    gradient into float32 as TransformerEngine accumulates it (`plain_kind`); float8 e4m3 by e4m3 with fast
    accumulation and without; and TransformerEngine's HYBRID format's gradients (e5m2, the first operand) by e4m3,
    without fast accumulation as its backward runs (transformer_engine/pytorch/module/base.py `_2X_ACC_DGRAD` and
    `_2X_ACC_WGRAD` True, `_2X_ACC_FPROP` False), the weight gradient also into float32 (the first operand's e5m2
    rows, written, not added: torch._scaled_mm has no C)."""
    gradients = ORIENTATIONS[1:]
    kinds: dict[str, tuple[tuple[str, ...], GemmKind | Exception]] = {
        "bf16": (ORIENTATIONS, plain_kind(device, dtype)),
        "bf16 into fp32": (ORIENTATIONS[2:], plain_kind(device, dtype, torch.float32))}
    unavailable = no_float8(device)
    for name, orientations, first, fast_accum, out in (
            ("fp8 fast accum", ORIENTATIONS, torch.float8_e4m3fn, True, torch.bfloat16),
            ("fp8", ORIENTATIONS, torch.float8_e4m3fn, False, torch.bfloat16),
            ("fp8 e5m2 grad", gradients, torch.float8_e5m2, False, torch.bfloat16),
            ("fp8 e5m2 grad into fp32", ORIENTATIONS[2:], torch.float8_e5m2, False, torch.float32)):
        kinds[name] = (orientations, unavailable or float8_kind(name, device, first, fast_accum, out))
    return kinds


# a layer's products as the rows run them: the kind (of `dense_kinds`) of each orientation (of `ORIENTATIONS`)
RECIPES = {"bf16": {"forward": "bf16", "input grad": "bf16", "weight grad": "bf16 into fp32"},
           "fp8 (TE hybrid)": {"forward": "fp8 fast accum", "input grad": "fp8 e5m2 grad",
                               "weight grad": "fp8 e5m2 grad into fp32"}}
SUSTAINED_LAYERS = 32  # layers a sustained span runs back to back: about 0.2 s of the 8B's BF16 products
SUSTAINED_REPEATS = 5


def gpu_clocks() -> dict[str, float] | None:
    """The GPU's SM clock (MHz) and power draw (W) now, as nvidia-smi reads them (None where it cannot)."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
        sm_mhz, power_w = (float(value) for value in line.split(","))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None
    return {"sm_mhz": sm_mhz, "power_w": power_w}


def time_sustained(products: list[tuple[GemmKind, Product]], clock: Clock, budget: Budget) -> dict:
    """A layer's products (each in its recipe's kind) run `SUSTAINED_LAYERS` times back to back behind a held
    device, as a step's layers keep the GPU busy for seconds where a span of one GEMM does not: the device's time a
    layer, and the SM clock and power nvidia-smi read while they ran (a GPU holding its clocks down at its power
    limit runs them slower than short spans show)."""
    operands = [(kind, kind.operands(product.m, product.k, product.n)) for kind, product in products]
    clocks: list[dict[str, float] | None] = []

    def step() -> dict[str, float]:
        start = clock.held_start()
        for _ in range(SUSTAINED_LAYERS):
            for kind, arguments in operands:
                kind.multiply(*arguments)
        end = clock.mark()
        if clock.cuda:
            clocks.append(gpu_clocks())
        clock.synchronize()
        return {"layer_ms": clock.device_ms(start, end) / SUSTAINED_LAYERS}

    timings = repeat(step, Budget(min(budget.warmup, 1), min(budget.repeats, SUSTAINED_REPEATS)))
    return {"layers": SUSTAINED_LAYERS, "layer_ms": timings["layer_ms"], "clocks": clocks}


def probe_dense(shapes: tuple[DenseShape, ...], device: torch.device, dtype: torch.dtype, budget: Budget) -> dict:
    """(e): each rank's product of each shape (`dense_products`) in each kind that runs its orientation
    (`dense_kinds`), one GEMM a span: its device time from an idle device and behind a held one, its host's, its
    TFLOP/s (held) and its kernels by name; a kind this GPU or torch cannot run is skipped, with why."""
    clock = Clock(device.type == "cuda")
    kinds = dense_kinds(device, dtype)
    rows = []
    for shape in shapes:
        for product in dense_products(shape):
            for name, (orientations, kind) in kinds.items():
                if isinstance(kind, Exception) or product.orientation not in orientations:
                    continue
                flop = 2 * product.m * product.k * product.n
                try:
                    timings, profile = time_gemms(kind, [(product.m, product.k, product.n)], clock, budget)
                except (RuntimeError, TypeError) as error:  # a torch without a kind's op, or refusing its dtypes
                    rows.append({"model": shape.name, "kind": name, **asdict(product), **skipped(error)})
                    continue
                rows.append({"model": shape.name, "kind": name, **asdict(product), "flop": flop, "timings": timings,
                             "tflops": flop / timings["held_device_ms"].median_ms / 1e9, "profile": profile})
    sustained = []
    for shape in shapes:
        whole = [product for product in dense_products(shape) if "chunk" not in product.name]
        for recipe, chosen in RECIPES.items():
            layer = [(kinds[chosen[product.orientation]][1], product) for product in whole]
            unavailable = next((kind for kind, _ in layer if isinstance(kind, Exception)), None)
            try:
                measured = skipped(unavailable) if unavailable else time_sustained(layer, clock, budget)
            except (RuntimeError, TypeError) as error:
                measured = skipped(error)
            sustained.append({"model": shape.name, "recipe": recipe, **measured})
    return {"shapes": [asdict(shape) for shape in shapes], "held_cycles": HOLD_CYCLES if clock.cuda else 0,
            "kinds": {name: {"orientations": list(orientations)} | (skipped(kind) if isinstance(kind, Exception)
                                                                    else {})
                      for name, (orientations, kind) in kinds.items()},
            "products": rows, "sustained": sustained}


# --- (f) the expert weights' backward as Megatron-core and TransformerEngine run it -------------------------------


@dataclass(frozen=True)
class WeightPath:
    """How part (f)'s expert weights get their gradients. `gemms`: the products run (else the passes issue none of
    their kernels, leaving the host's work a weight alone); `fused`: TransformerEngine's fuse_wgrad_accumulation
    under Megatron-core, each weight-gradient GEMM adding into its weight's `main_grad` (fetched a weight) and the
    weight handed a dummy gradient, a `torch.empty` (grouped_linear.py `handle_custom_ddp_from_mcore`, TE v2.2 to
    v2.9; v2.12 on hand out a cached one's `.detach()`), else autograd's own gradients, as part (a)'s; `hooked`:
    Megatron-core DDP's post-hook on each weight's AccumulateGrad node (distributed_data_parallel.py
    `_make_backward_post_hook`, Megatron-LM 1e057005)."""

    gemms: bool
    fused: bool
    hooked: bool


WEIGHT_PATHS = {"autograd": WeightPath(gemms=True, fused=False, hooked=False),
                "megatron": WeightPath(gemms=True, fused=True, hooked=True),
                "no products": WeightPath(gemms=False, fused=False, hooked=False),
                "dummies": WeightPath(gemms=False, fused=True, hooked=False),
                "dummies + hooks": WeightPath(gemms=False, fused=True, hooked=True)}
WEIGHT_LOCAL_EXPERTS = (4, 16)


class ExpertProducts(torch.autograd.Function):
    """One GEMM a local expert on its rows of `x` into one output, as TransformerEngine's GroupedLinear runs them
    (torch.split of the input, `general_grouped_gemm`'s loop), and its backward: an input-gradient and a
    weight-gradient GEMM an expert, each weight's gradient as `path` hands it over."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, splits: list[int], path: WeightPath, *weights: torch.Tensor) -> torch.Tensor:
        ctx.splits, ctx.path = splits, path
        ctx.save_for_backward(x, *weights)
        ctx.main_grad_funcs = [lambda weight=weight: weight.main_grad for weight in weights] if path.fused else []
        out = x.new_empty(x.shape[0], weights[0].shape[0])
        if path.gemms:
            for rows, weight, into in zip(x.split(splits), weights, out.split(splits)):
                torch.mm(rows, weight.t(), out=into)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        path = ctx.path
        main_grads = [get() for get in ctx.main_grad_funcs]
        grad_x, grad_weights = None, [None] * len(weights)
        if path.gemms:
            grad_x = x.new_empty(x.shape)
            pieces = list(zip(x.split(ctx.splits), grad_out.split(ctx.splits), grad_x.split(ctx.splits)))
            for (rows, grads, into), weight in zip(pieces, weights):
                torch.mm(grads, weight, out=into)
            for i, (rows, grads, _) in enumerate(pieces):
                if path.fused:
                    main_grads[i].addmm_(grads.t(), rows)  # cuBLAS's C = A·B + C, as fuse_wgrad_accumulation
                else:
                    grad_weights[i] = grads.t() @ rows
        if path.fused:
            for i, weight in enumerate(weights):
                weight.grad_added_to_main_grad = True
                grad_weights[i] = torch.empty(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
        return grad_x, None, None, *grad_weights


def ddp_post_hooks(weights: list[torch.Tensor]) -> list:
    """Megatron-core DDP's backward post-hook on each weight's AccumulateGrad node, registered as it registers them
    (`param.expand_as(param).grad_fn.next_functions[0][0].register_hook`); returns the nodes, which must be kept."""
    buckets = dict.fromkeys(weights)  # param_to_bucket_group

    def post_hook(param: torch.Tensor, *unused) -> None:
        if param in buckets:
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None

    accumulators = []
    for weight in weights:
        accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]
        accumulator.register_hook(partial(post_hook, weight))
        accumulators.append(accumulator)
    return accumulators


def expert_weights(shape: MoeShape, local_experts: int, device: torch.device, dtype: torch.dtype
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fc1's and fc2's weights a local expert, each with a `main_grad` of its own (16-bit, Megatron-Bridge's)."""
    def weight(rows: int, columns: int) -> torch.Tensor:
        made = (torch.randn(rows, columns, device=device) * columns**-0.5).to(dtype).requires_grad_()
        made.main_grad = torch.zeros_like(made)
        made.grad_added_to_main_grad = False
        return made

    return ([weight(2 * shape.ffn, shape.hidden) for _ in range(local_experts)],
            [weight(shape.hidden, shape.ffn) for _ in range(local_experts)])


def routed_experts(x: torch.Tensor, splits: list[int], fc1: list[torch.Tensor], fc2: list[torch.Tensor],
                   path: WeightPath) -> torch.Tensor:
    """TEGroupedMLP's experts on rows already sorted by local expert: fc1, SwiGLU over all the rows, fc2."""
    gate, up = ExpertProducts.apply(x, splits, path, *fc1).chunk(2, dim=-1)
    return ExpertProducts.apply(F.silu(gate) * up, splits, path, *fc2)


def probe_weights(shape: MoeShape, device: torch.device, dtype: torch.dtype, budget: Budget) -> dict:
    """(f): per weight path (`WEIGHT_PATHS`) and local-expert count, the experts' forward's host time, their
    backward's host and device times (and the device's alone, behind a held device), and the backward's op and
    kernel counts; derived, the host's microseconds a weight beyond the products' (each path against "no
    products") and each time's growth a local expert."""
    clock = Clock(device.type == "cuda")
    runs = []
    for name, path in WEIGHT_PATHS.items():
        for local_experts in WEIGHT_LOCAL_EXPERTS:
            fc1, fc2 = expert_weights(shape, local_experts, device, dtype)
            weights = [*fc1, *fc2]
            kept = ddp_post_hooks(weights) if path.hooked else []
            rows = shape.rows_per_expert(local_experts)
            splits = [rows] * local_experts
            x = torch.randn(rows * local_experts, shape.hidden, device=device, dtype=dtype, requires_grad=True)
            grad_out = torch.randn(rows * local_experts, shape.hidden, device=device, dtype=dtype)

            def forget_grads() -> None:
                for tensor in (x, *weights):
                    tensor.grad = None
                for weight in weights:
                    weight.grad_added_to_main_grad = False

            def step() -> dict[str, float]:
                forget_grads()
                clock.synchronize()
                start = clock.mark()
                out = routed_experts(x, splits, fc1, fc2, path)
                forward_launched = clock.mark()
                backward_host_ms, backward_device_ms = timed_backward(clock, out, grad_out)
                return {"forward_host_ms": clock.host_ms(start, forward_launched),
                        "backward_host_ms": backward_host_ms, "backward_device_ms": backward_device_ms}

            def held_step() -> dict[str, float]:
                forget_grads()
                out = routed_experts(x, splits, fc1, fc2, path)
                start = clock.held_start(MOE_HOLD_CYCLES)
                out.backward(grad_out)
                end = clock.mark()
                clock.synchronize()
                return {"backward_held_device_ms": clock.device_ms(start, end)}

            timings = repeat(step, budget) | repeat(held_step, budget)
            forget_grads()
            out = routed_experts(x, splits, fc1, fc2, path)
            _, counts, kernels = activity(lambda: out.backward(grad_out), clock.cuda)
            runs.append({"path": name, **asdict(path), "local_experts": local_experts, "weights": len(weights),
                         "hooks": len(kept), "rows_per_expert": rows, "timings": timings, "counts": counts,
                         "kernels": kernels["by_op"]})
    return {"shape": asdict(shape), "dtype": str(dtype), "runs": runs, "derived": weights_derived(runs)}


def weights_derived(runs: list[dict]) -> dict:
    """Per path, each median's growth a local expert between the fewest and the most local experts (us), and the
    backward's host microseconds a weight beyond "no products"'s at each local-expert count."""
    found = {(run["path"], run["local_experts"]): run for run in runs}
    fewest, most = WEIGHT_LOCAL_EXPERTS[0], WEIGHT_LOCAL_EXPERTS[-1]

    def median(path: str, local_experts: int, key: str) -> float:
        return found[path, local_experts]["timings"][key].median_ms

    return {path: {"us_per_added_local_expert": {key: (median(path, most, key) - median(path, fewest, key)) * 1e3
                                                 / (most - fewest) for key in found[path, most]["timings"]},
                   "backward_host_us_per_weight_over_no_products": {
                       str(n): (median(path, n, "backward_host_ms") - median("no products", n, "backward_host_ms"))
                       * 1e3 / found[path, n]["weights"] for n in WEIGHT_LOCAL_EXPERTS}}
            for path in WEIGHT_PATHS}


# --- (g) a collective's kernel beside products ---------------------------------------------------------------------


@dataclass(frozen=True)
class PairShape:
    """Part (g)'s products (m x k by k x n, BF16, back to back on one stream) and the copy on `ctas` CTAs that stands
    for a collective's kernel on another (`benchmarks/sm_copy.py`)."""

    name: str
    m: int
    k: int
    n: int
    copy_bytes: int
    ctas: int
    target: str = "device"  # where the copy writes: "device" (HBM) or "host" (pinned host memory, across PCIe)


PAIR_SHAPES = (PairShape("4096^3, 24 CTAs", 4096, 4096, 4096, 64 << 20, 24),  # a product of about 0.18 ms
               PairShape("4096^3, 24 CTAs, 4x the copy", 4096, 4096, 4096, 256 << 20, 24),
               PairShape("4096^3, 8 CTAs", 4096, 4096, 4096, 64 << 20, 8),
               PairShape("4096^3, 32 CTAs", 4096, 4096, 4096, 64 << 20, 32),
               PairShape("8192^3, 24 CTAs", 8192, 8192, 8192, 64 << 20, 24),  # about 1.4 ms
               PairShape("4096x4096x14336, 24 CTAs", 4096, 4096, 14336, 64 << 20, 24),  # about 0.6 ms
               # the 30B's fc1 and fc2 at E16 (8 local experts: 4,096 rows), and at 16 local experts (2,048 rows)
               PairShape("30B fc1 at E16, 24 CTAs", 4096, 2048, 1536, 64 << 20, 24),
               PairShape("30B fc2 at 16 local experts, 24 CTAs", 2048, 768, 2048, 64 << 20, 24))
QUICK_PAIR = (PairShape("quick", 64, 64, 64, 1 << 16, 2),)
# (h): the same copy writing into pinned host memory, so that its CTAs' stores cross PCIe and the link, not HBM, bounds
# it, as a collective's kernel is bound by NVLink or the NIC; 16 MiB takes about 0.3 ms at PCIe 5's rate
LINK_SHAPES = (PairShape("4096^3, 24 CTAs", 4096, 4096, 4096, 16 << 20, 24, "host"),
               PairShape("4096^3, 24 CTAs, 4x the copy", 4096, 4096, 4096, 64 << 20, 24, "host"),
               PairShape("4096^3, 8 CTAs", 4096, 4096, 4096, 16 << 20, 8, "host"),
               PairShape("4096^3, 32 CTAs", 4096, 4096, 4096, 16 << 20, 32, "host"),
               PairShape("8192^3, 24 CTAs", 8192, 8192, 8192, 16 << 20, 24, "host"),
               PairShape("4096x4096x14336, 24 CTAs", 4096, 4096, 14336, 16 << 20, 24, "host"),
               PairShape("30B fc1 at E16, 24 CTAs", 4096, 2048, 1536, 16 << 20, 24, "host"),
               PairShape("30B fc2 at 16 local experts, 24 CTAs", 2048, 768, 2048, 16 << 20, 24, "host"))
QUICK_LINK = (PairShape("quick", 64, 64, 64, 1 << 16, 2, "host"),)
PAIR_SPAN_MS = 8.0  # the products' span: the copy is launched inside it
PAIR_MOST_PRODUCTS = 400  # at most, so that the host issues them within the hold (`MOE_HOLD_CYCLES`)
PAIR_LAUNCH_SHARES = (0.2, 0.4, 0.6, 0.8)  # when the copy is launched, as shares of that span
# How the copy is launched inside: by the host, at a random moment of a product (its stream's mark, before Triton's
# launch, so its time holds the launch), or queued behind the end of the product at that share (`wait_event`), so
# that it is ready on the device the moment that product ends, beside the next one queued, with no host between:
# issued after every product ("boundary") or before the next one ("boundary-first", as Megatron-core's pair issues a
# pass's all-to-all before the other pass's compute node that becomes ready with it)
PAIR_LAUNCHES = ("host", "boundary", "boundary-first")
PAIR_HEAD_CYCLES = 2 * 10**4  # products wait about 10 us after the hold, so that the copy issued first starts first


def pair_running_left_ms(ready_ms: float, product_ends_ms: list[float]) -> float:
    """What is left of the product running when a kernel is launched at `ready_ms` (0 once the products are done):
    how long it waits where a product launched on every multiprocessor holds them to its end (planning/experts.py
    `paired_exposed_ms`'s rule, whose mean over a random moment is half the product)."""
    return next((end - ready_ms for end in product_ends_ms if end > ready_ms), 0.0)


def probe_pair(shapes: tuple[PairShape, ...], device: torch.device, dtype: torch.dtype, budget: Budget) -> dict:
    """(g) and (h): per shape, one product, the copy and the products' span each alone behind a held device;
    the two side by side with the copy issued first (`copy_first`); and the copy launched at `PAIR_LAUNCH_SHARES`
    of the products' span while they run (`inside`; `PAIR_LAUNCHES`: by the host at a random moment of a product,
    or queued behind a product's end, issued after every product or before the next): per launch, when its stream
    reached it, what was left of the product then running, the next products' ends, the copy's time from there to
    its end, the host's launch and the products' span. The products run behind a held device, their events made
    beforehand, so that the host's issue stays ahead of them; the host launches the copy once the device has
    reached them."""
    if device.type != "cuda":
        return skipped(RuntimeError("needs a CUDA GPU: two streams beside each other, and Triton's copy"))
    from sm_copy import copy_on_ctas  # this folder's; Triton, on a GPU only

    clock = Clock(cuda=True)
    products_stream, copy_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    runs = []
    for shape in shapes:
        a = torch.randn(shape.m, shape.k, device=device, dtype=dtype)
        b = torch.randn(shape.n, shape.k, device=device, dtype=dtype).t()
        source = torch.randn(shape.copy_bytes // 2, device=device, dtype=torch.bfloat16)
        target = (torch.empty_like(source) if shape.target == "device" else
                  torch.empty(source.shape, dtype=source.dtype, pin_memory=True))  # mapped: the device stores into it
        copy_on_ctas(source, target, shape.ctas)
        torch.cuda.synchronize(device)
        if not torch.equal(source.cpu(), target.cpu()):
            raise RuntimeError(f"the copy on {shape.ctas} CTAs into {shape.target} memory did not copy")
        product = repeat(lambda: {"ms": clock.held_ms(lambda: torch.mm(a, b))}, budget)["ms"]
        count = min(PAIR_MOST_PRODUCTS, max(8, round(PAIR_SPAN_MS / product.median_ms)))

        def events(how_many: int) -> list[torch.cuda.Event]:
            return [torch.cuda.Event(enable_timing=True) for _ in range(how_many)]

        def issue_products(start: Mark, ends: list[torch.cuda.Event], head_cycles: int = 0,
                           before: tuple[int, Callable[[], None]] | None = None) -> None:
            """The products behind `start` on their stream, each end recorded in `ends` (the first: their start);
            `before` (i, issue): `issue()` is called before the host issues product i + 1."""
            products_stream.wait_event(start.event)
            with torch.cuda.stream(products_stream):
                if head_cycles:
                    torch.cuda._sleep(head_cycles)
                ends[0].record()
                for index, end in enumerate(ends[1:]):
                    if before is not None and index == before[0]:
                        before[1]()
                    torch.mm(a, b)
                    end.record()

        def issue_copy(stream: torch.cuda.Stream, marks: list[torch.cuda.Event]) -> None:
            with torch.cuda.stream(stream):
                marks[0].record()
                copy_on_ctas(source, target, shape.ctas)
                marks[1].record()

        def alone() -> dict[str, float]:
            ends, marks = events(count + 1), events(2)
            issue_products(clock.held_start(MOE_HOLD_CYCLES), ends)
            clock.synchronize()
            copy_stream.wait_event(clock.held_start().event)
            issue_copy(copy_stream, marks)
            clock.synchronize()
            unheld = events(2)
            issue_copy(copy_stream, unheld)  # from an idle device, as a copy launched inside runs: its launch shows
            clock.synchronize()
            return {"products_ms": ends[0].elapsed_time(ends[-1]), "copy_ms": marks[0].elapsed_time(marks[1]),
                    "copy_unheld_ms": unheld[0].elapsed_time(unheld[1])}

        def copy_first() -> dict[str, float]:
            ends, marks = events(count + 1), events(2)
            start = clock.held_start(MOE_HOLD_CYCLES)
            copy_stream.wait_event(start.event)
            issue_copy(copy_stream, marks)
            issue_products(start, ends, PAIR_HEAD_CYCLES)
            clock.synchronize()
            return {"copy_ms": marks[0].elapsed_time(marks[1]), "products_ms": ends[0].elapsed_time(ends[-1])}

        timings = {"product_ms": product, **{f"alone_{key}": value for key, value in repeat(alone, budget).items()},
                   **{f"copy_first_{key}": value for key, value in repeat(copy_first, budget).items()}}
        span_s = timings["alone_products_ms"].median_ms / 1e3
        inside = []
        jitter = random.Random(0)
        for launch in PAIR_LAUNCHES:
            for share in PAIR_LAUNCH_SHARES:
                for index in range(budget.warmup + budget.repeats):
                    ends, marks = events(count + 1), events(2)
                    start = clock.held_start(MOE_HOLD_CYCLES)
                    met = round(share * count)

                    def queue_copy() -> None:
                        copy_stream.wait_event(ends[met])
                        issue_copy(copy_stream, marks)

                    issue_products(start, ends, before=(met, queue_copy) if launch == "boundary-first" else None)
                    held = clock.still_held(start)  # the products all issued before the device reached them
                    launch_ms = None
                    if launch == "boundary":
                        queue_copy()
                    elif launch == "host":
                        while not ends[0].query():
                            pass
                        reached_s = time.perf_counter()
                        at_s = reached_s + share * span_s + jitter.random() * product.median_ms / 1e3
                        while time.perf_counter() < at_s:
                            pass
                        issue_copy(copy_stream, marks)
                        launch_ms = (time.perf_counter() - at_s) * 1e3
                    clock.synchronize()
                    if index < budget.warmup:
                        continue
                    ready_ms = ends[0].elapsed_time(marks[0])
                    product_ends_ms = [ends[0].elapsed_time(end) for end in ends[1:]]
                    inside.append({"launch": launch, "launch_share": share, "hold_outlasted_issue": held,
                                   "ready_ms": ready_ms,
                                   "running_left_ms": pair_running_left_ms(ready_ms, product_ends_ms),
                                   "next_ends_ms": [end - ready_ms for end in product_ends_ms if end > ready_ms][:8],
                                   "copy_ms": marks[0].elapsed_time(marks[1]), "launch_host_ms": launch_ms,
                                   "products_ms": product_ends_ms[-1]})
        runs.append({"shape": asdict(shape), "products": count, "timings": timings, "inside": inside,
                     "derived": pair_derived_by_launch(timings, inside)})
    return {"dtype": str(dtype), "launch_shares": list(PAIR_LAUNCH_SHARES), "runs": runs}


def pair_derived_by_launch(timings: dict[str, Timing], inside: list[dict]) -> dict[str, dict[str, float]]:
    """`pair_derived` of each way the copy was launched inside (`PAIR_LAUNCHES`, those the run has), from its rows of
    `inside`."""
    return {launch: pair_derived(timings, [row for row in inside if row["launch"] == launch], launch)
            for launch in dict.fromkeys(row["launch"] for row in inside)}


def pair_derived(timings: dict[str, Timing], inside: list[dict], launch: str) -> dict[str, float]:
    """What the pair costs each side against each alone (medians, ms): the copy issued first, and launched inside
    the products, when it ends after its launch (its stream's mark, less the host's launch), what was left of the
    product it met (the persistent rule's wait) and its time past that over its own (how much slower it runs beside
    the products), and the products' span past theirs. A copy queued behind a product's end
    holds no host: its mark is that product's end, its time past the held copy's the pair's. One the host launches
    is timed from its stream's mark before the launch (Triton's launcher), taken off as the copy timed so from an
    idle device holds it (`copy_unheld`), which is no constant (0.02 to 0.14 ms over the H200 run's shapes), and
    the product it met is read at the mark, before the copy reached the device: its figures are the less sure."""
    copy_ms, products_ms = timings["alone_copy_ms"].median_ms, timings["alone_products_ms"].median_ms
    # the host's launch a copy timed from its mark holds: none where it was queued on the device
    launch_ms = timings["alone_copy_unheld_ms"].median_ms - copy_ms if launch == "host" else 0.0
    ends_ms = [row["copy_ms"] - launch_ms for row in inside]
    return {"inside_copy_ends_ms": statistics.median(ends_ms),
            "inside_run_over_own": statistics.median((end - row["running_left_ms"]) / copy_ms
                                                     for end, row in zip(ends_ms, inside)),
            "copy_first_copy_over_alone_ms": timings["copy_first_copy_ms"].median_ms - copy_ms,
            "copy_first_products_over_alone_ms": timings["copy_first_products_ms"].median_ms - products_ms,
            "inside_running_left_ms": statistics.median(row["running_left_ms"] for row in inside),
            "inside_products_over_alone_ms": statistics.median(row["products_ms"] - products_ms for row in inside)}


# --- the report --------------------------------------------------------------------------------------------------


@dataclass
class Table:
    """A table to print: its title, headers, rows of text, the columns that name a row (repeated when it prints
    in parts) and lines after it (what was skipped and why)."""

    title: str
    headers: list[str]
    keys: int
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def cell(value: float | int | None, style: str = "") -> str:
    """A number as `style` formats it, or "-" where there is none."""
    return "-" if value is None else format(value, style)


def moe_tables(moe_result: dict) -> list[Table]:
    """Part (a)'s layers and their longest kernels."""
    moe = Table("(a) MoE layer, ms (host after sync: from the .tolist() to the last launch; held: the device's "
                "time alone, behind a held device)",
                ["local experts", "rows an expert", "forward", "host after sync", "device after sync",
                 "held after sync", "busy after sync", "ops after sync", "kernels after sync", "backward",
                 "backward host", "held backward", "backward ops", "backward kernels"], keys=1)
    for layer in moe_result["layers"]:
        t, c = layer["timings"], layer["counts"]
        moe.rows.append([str(layer["local_experts"]), f"{layer['rows_per_expert']:,}",
                         *(f"{t[key].median_ms:.3f}" for key in ("forward_device_ms", "after_sync_host_ms",
                                                                 "after_sync_device_ms", "after_sync_held_device_ms")),
                         cell(c["after_sync"]["device_busy_ms"], ".3f"), cell(c["after_sync"]["ops"]),
                         cell(c["after_sync"]["kernels"]),
                         *(f"{t[key].median_ms:.3f}" for key in ("backward_device_ms", "backward_host_ms",
                                                                 "backward_held_device_ms")),
                         cell(c["backward"]["ops"]), cell(c["backward"]["kernels"])])
    return [moe, moe_kernel_table(moe_result)]


def attention_tables(attention_result: dict) -> list[Table]:
    """Part (b)'s kernels and spans."""
    attention = Table("(b) attention, ms", ["kernel", "part", "forward", "backward", "passes fwd", "passes bwd",
                                            "passes fwd compiled", "fwd two streams"], keys=2)
    for kernel, parts in attention_result["kernels"].items():
        for part, timings in parts.items():
            if "skipped" in timings:
                attention.notes.append(f"{kernel} {part}: skipped, {timings['skipped']}")
                continue
            cells = [f"{timings[key].median_ms:.3f}" if key in timings else "" for key in
                     ("forward_ms", "backward_ms", "forward_passes_ms", "backward_passes_ms")]
            for key, what in (("forward_passes_compiled", "compiled passes"),
                              ("forward_two_streams_ms", "two streams")):
                timing = timings.get(key)
                if isinstance(timing, dict):
                    attention.notes.append(f"{kernel} {part}'s {what}: skipped, {timing['skipped']}")
                cells.append(f"{timing.median_ms:.3f}" if isinstance(timing, Timing) else "")
            attention.rows.append([kernel, part, *cells])
    return [attention]


def gemm_tables(gemm_result: dict) -> list[Table]:
    """Part (c)'s loops against one GEMM."""
    gemm = Table("(c) expert GEMMs: a loop of one a local expert against one of the same FLOPs",
                 ["type", "local experts", "product", "m x k x n", "loop ms", "loop TFLOP/s", "us a GEMM",
                  "held us a GEMM", "kernels a GEMM", "one ms", "one TFLOP/s"], keys=3)
    for name, rows in gemm_result.items():
        if isinstance(rows, dict):
            gemm.notes.append(f"{name}: skipped, {rows['skipped']}")
            continue
        for row in rows:
            gemm.rows.append([name, str(row["local_experts"]), row["name"], f"{row['m']}x{row['k']}x{row['n']}",
                              f"{row['loop']['device_ms'].median_ms:.3f}", f"{row['loop_tflops']:.4g}",
                              f"{row['loop_us_per_gemm']:.1f}", f"{row['loop_held_us_per_gemm']:.1f}",
                              cell(row["loop_kernels_per_gemm"], "g"), f"{row['one_gemm']['device_ms'].median_ms:.3f}",
                              f"{row['one_gemm_tflops']:.4g}"])
    return [gemm]


def combine_tables(combine_result: dict) -> list[Table]:
    """Part (d)'s ops and their bandwidth."""
    combine = Table("(d) the combine's kernels and elementwise layouts at (a)'s shape, each alone",
                    ["dtype", "op", "device ms", "GB moved", "GB/s"], keys=2)
    for dtype, ops in combine_result.items():
        for name, op in ops.items():
            ms = op["device_ms"].median_ms
            combine.rows.append([dtype, name, f"{ms:.3f}", f"{op['moved_bytes'] / 1e9:.3f}",
                                 f"{op['moved_bytes'] / 1e6 / ms:,.0f}"])
    return [combine]


def dense_tables(dense_result: dict) -> list[Table]:
    """Part (e)'s products: a row a rank's product, a column a kind, each cell its held device ms (TFLOP/s)."""
    kinds = list(dense_result["kinds"])
    dense = Table("(e) the Llama 3.1 rows' products on a rank, held device ms (TFLOP/s)",
                  ["model", "product", "m x k x n", *kinds], keys=3)
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in dense_result["products"]:
        found = cells.setdefault((row["model"], row["name"], f"{row['m']}x{row['k']}x{row['n']}"), {})
        found[row["kind"]] = ("skipped" if "skipped" in row else
                              f"{row['timings']['held_device_ms'].median_ms:.3f} ({row['tflops']:.0f})")
    dense.rows = [[*key, *(found.get(kind, "") for kind in kinds)] for key, found in cells.items()]
    dense.notes = [f"{name}: skipped, {kind['skipped']}" for name, kind in dense_result["kinds"].items()
                   if "skipped" in kind]
    dense.notes += [f"{row['model']} {row['name']} {row['kind']}: skipped, {row['skipped']}"
                    for row in dense_result["products"] if "skipped" in row]
    sustained = Table(f"(e) a layer's products as the rows run them, {SUSTAINED_LAYERS} layers back to back, ms a "
                      "layer (SM clock and power while they ran)", ["model", "recipe", "layer ms", "SM MHz", "W"],
                      keys=2)
    for row in dense_result["sustained"]:
        if "skipped" in row:
            sustained.notes.append(f"{row['model']} {row['recipe']}: skipped, {row['skipped']}")
            continue
        read = [clocks for clocks in row["clocks"] if clocks]
        sustained.rows.append([row["model"], row["recipe"], f"{row['layer_ms'].median_ms:.3f}",
                               *(f"{min(c[key] for c in read):.0f}-{max(c[key] for c in read):.0f}" if read else "-"
                                 for key in ("sm_mhz", "power_w"))])
    return [dense, sustained]


def weights_tables(weights_result: dict) -> list[Table]:
    """Part (f)'s paths: host and device ms a run, and the host's us a weight beyond the products'."""
    table = Table("(f) the experts' weights' backward by path, ms (held: the device's time alone)",
                  ["path", "local experts", "forward host", "backward host", "backward device", "held backward",
                   "backward ops", "backward kernels", "host us a weight over no products"], keys=2)
    for run in weights_result["runs"]:
        t = run["timings"]
        over = weights_result["derived"][run["path"]]["backward_host_us_per_weight_over_no_products"]
        table.rows.append([run["path"], str(run["local_experts"]),
                           *(f"{t[key].median_ms:.3f}" for key in ("forward_host_ms", "backward_host_ms",
                                                                   "backward_device_ms", "backward_held_device_ms")),
                           cell(run["counts"]["ops"]), cell(run["counts"]["kernels"]),
                           f"{over[str(run['local_experts'])]:.1f}"])
    return [table]


def pair_tables(pair_result: dict, title: str = "(g) a copy on a collective's CTAs") -> list[Table]:
    """Parts (g) and (h): each side's time alone and what the pair adds to it, with the copy first and launched
    inside."""
    table = Table(f"{title} beside BF16 products: medians, ms (+: over each alone)",
                  ["shape", "launch", "product", "products", "copy alone", "copy first: copy +", "products +",
                   "inside: copy ends", "product left", "its run over its own", "products +"], keys=2)
    if "skipped" in pair_result:
        table.notes.append(f"skipped: {pair_result['skipped']}")
        return [table]
    for run in pair_result["runs"]:
        t = run["timings"]
        for launch, d in run["derived"].items():
            table.rows.append([run["shape"]["name"], launch, f"{t['product_ms'].median_ms:.3f}", str(run["products"]),
                               f"{t['alone_copy_ms'].median_ms:.3f}",
                               *(f"{d[key]:.3f}" for key in ("copy_first_copy_over_alone_ms",
                                                             "copy_first_products_over_alone_ms",
                                                             "inside_copy_ends_ms", "inside_running_left_ms")),
                               f"{d['inside_run_over_own']:.2f}", f"{d['inside_products_over_alone_ms']:.3f}"])
    return [table]


TABLES = {"moe": moe_tables, "attention": attention_tables, "gemm": gemm_tables, "combine": combine_tables,
          "dense": dense_tables, "weights": weights_tables, "pair": pair_tables,
          "link": partial(pair_tables, title="(h) the copy into host memory, bound by PCIe")}


def tables(result: dict) -> list[Table]:
    """The medians of the parts the probe ran, as tables: MoE layers, attention kernels, expert GEMMs, the
    combine's kernels, the Llama rows' products, the experts' weights' backward."""
    return [table for part, build in TABLES.items() if part in result for table in build(result[part])]


TOP_PRINTED = 5  # kernels a span of part (a) prints by name (the JSON keeps `TOP_KERNELS`)
SPANS = {"before_sync": "before sync", "after_sync": "after sync", "backward": "backward"}


def moe_kernel_table(moe: dict) -> Table:
    """Part (a)'s longest kernels a span, by the op that launched them, per local-expert count: device us and
    count, the rest of the span's kernels summed."""
    layers = moe["kernels"]
    table = Table("(a) MoE layer's longest kernels a span: device us (kernels) by the op that launched them",
                  ["span", "op (asked by)", "kernel", *(f"{layer['local_experts']} local experts" for layer in layers)],
                  keys=1)

    def op_name(row: dict) -> str:
        op, caller = (str(name).removeprefix("aten::") for name in (row["op"], row["caller"]))
        return op if op == caller else f"{op} ({caller})"

    for span, title in SPANS.items():
        found = [{(row["op"], row["caller"], row["kernel"]): row for row in layer[span]["by_kernel"]
                  if row["op"] is not None} for layer in layers]
        longest = sorted({key for rows in found for key in rows},
                         key=lambda key: -max(rows[key]["device_us"] if key in rows else 0.0 for rows in found))
        shown = longest[:TOP_PRINTED]
        for key in shown:
            row = next(rows[key] for rows in found if key in rows)
            table.rows.append([title, op_name(row), row["short"], *(
                f"{rows[key]['device_us']:,.0f} ({rows[key]['count']})" if key in rows else "-" for rows in found)])
        rest = []
        for layer, rows in zip(layers, found):
            total = [sum(op[unit] for op in layer[span]["by_op"].values()) for unit in ("count", "device_us")]
            kept = [sum(rows[key][unit] for key in shown if key in rows) for unit in ("count", "device_us")]
            rest.append(f"{total[1] - kept[1]:,.0f} ({total[0] - kept[0]})")
        table.rows.append([title, "the rest", "", *rest])
    return table


def show(table: Table) -> None:
    """Through pipesim's print_table (never cuts a number) where pipesim and rich import; plain lines otherwise."""
    try:
        from rich.table import Table as RichTable

        from pipesim.commands.tables import print_table
    except ImportError:
        widths = [max(len(cell) for cell in column) for column in zip(table.headers, *table.rows)]
        print(f"\n{table.title}")
        for row in (table.headers, *table.rows):
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        print(*table.notes, sep="\n")
        return
    rich_table = RichTable(title=table.title)
    for header in table.headers:
        rich_table.add_column(header, justify="right")
    for row in table.rows:
        rich_table.add_row(*row)
    print_table(rich_table, keys=table.keys)
    print(*table.notes, sep="\n")


def environment(device: torch.device) -> dict:
    """What ran the probe: the device's name, torch's, CUDA's and cuDNN's versions."""
    cuda = device.type == "cuda"
    return {"device": device.type, "name": torch.cuda.get_device_name(device) if cuda else platform.processor()
            or platform.machine(), "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
            if cuda else None, "python": platform.python_version()}


def to_json(value: object) -> object:
    """Dataclasses (Timing) as dicts, all the way down."""
    if isinstance(value, Timing):
        return asdict(value)
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write (every median and its spread).")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="Tiny shapes (a CPU smoke run of the same code).")
    parser.add_argument("--repeats", type=int, help="Timed repeats a measurement (default 20, quick 3).")
    parser.add_argument("--warmup", type=int, help="Untimed runs before them (default 3, quick 1).")
    parser.add_argument("--no-compile", action="store_true",
                        help="Skip the torch.compile'd context-parallel passes (they compile for a few seconds).")
    parser.add_argument("--parts", default=",".join(TABLES),
                        help=f"The parts to run, comma-separated, of {', '.join(TABLES)} (default: all).")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.parts.split(",")]
    unknown = [name for name in chosen if name not in TABLES]
    if unknown or not chosen:
        named = ", ".join(map(repr, unknown))
        parser.error(f"--parts: {named} {'is no part' if len(unknown) == 1 else 'are no parts'}; give some of "
                     f"{', '.join(TABLES)}, comma-separated")
    for flag, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value is not None and value < (1 if flag == "--repeats" else 0):
            parser.error(f"{flag}: {value} is not allowed; give a whole number of at least "
                         f"{1 if flag == '--repeats' else 0}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; --device cpu --quick runs the same code tiny on a "
                     "CPU")
    if not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    device = torch.device(args.device)
    budget = Budget(warmup=args.warmup if args.warmup is not None else 1 if args.quick else 3,
                    repeats=args.repeats or (3 if args.quick else 20))
    moe_shape, attention_shape, dense_shapes = ((QUICK_MOE, QUICK_ATTENTION, QUICK_DENSE) if args.quick else
                                                (QWEN3_30B_A3B, LLAMA31_8B, LLAMA31_DENSE))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    result = {"probe": "benchmarks/gpu_probe.py", "environment": environment(device), "quick": args.quick,
              "budget": asdict(budget), "seconds": {}}
    parts = {"moe": partial(probe_moe, moe_shape, device, dtype, budget),
             "attention": partial(probe_attention, attention_shape, device, dtype, budget, args.no_compile),
             "gemm": partial(probe_gemms, moe_shape, device, dtype, budget),
             "combine": partial(probe_combine, moe_shape, device, budget),
             "dense": partial(probe_dense, dense_shapes, device, dtype, budget),
             "weights": partial(probe_weights, moe_shape, device, dtype, budget),
             "pair": partial(probe_pair, QUICK_PAIR if args.quick else PAIR_SHAPES, device, dtype, budget),
             "link": partial(probe_pair, QUICK_LINK if args.quick else LINK_SHAPES, device, dtype, budget)}
    for name in (name for name in parts if name in chosen):
        probe = parts[name]
        started = time.perf_counter()
        result[name] = probe()
        result["seconds"][name] = time.perf_counter() - started
        print(f"{name}: {result['seconds'][name]:.1f} s", flush=True)  # where a run cut short by a timeout got
    result["elapsed_s"] = sum(result["seconds"].values())
    for table in tables(result):
        show(table)
    written = args.out.with_name(args.out.name + ".partial")
    written.write_text(json.dumps(to_json(result), indent=1))
    written.replace(args.out)
    print(f"\n{result['elapsed_s']:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
