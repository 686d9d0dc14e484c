"""A model's work counted by torch itself, on the meta device: tensors with shapes and no data, so a 175B
model costs no memory and seconds of time, and the counts are those of the real module, not of a formula.

Per layer and per micro-batch of b samples:
- FLOPs of the forward, the input-gradient and the weight-gradient backward (`torch.utils.flop_counter`:
  matrix products and attention; elementwise work is not counted as FLOPs). The input gradient is
  autograd.grad with respect to the layer's input alone (autograd then skips every weight-gradient product);
  the weight gradient is what the full backward adds to it, as a zero-bubble W pass computes;
- bytes moved by the ops torch counts no FLOPs for (norms, activations, softmax, copies, the optimizer step):
  every tensor such an op reads plus every tensor it writes, the memory-bound part of the time; views move
  nothing and are left out; a gather or scatter by index (`INDEXED`) moves the elements it indexes, not the
  whole tensor it indexes;
- bytes autograd saves for the backward (saved-tensor hooks), each storage once per layer, weights and buffers
  left out (the rule calibration measures by);
- parameter, gradient and optimizer-state bytes (each optimizer of `OPTIMIZERS`, after one real step) and the
  bytes that step moves;
- the tensor the layer outputs: what a stage ending there sends (the last layer's output is its loss);
- per pass, its transient tensors (`_LiveBytes`): those it creates and frees within itself, as live at their
  peak, above its inputs and what it keeps (saved tensors, gradients, its output); a forward's at the moment of
  the most bytes live counting what it keeps, which the simulator holds from the forward's start. The loss's
  backward holds two float32 tokens x vocabulary tensors (nll_loss_backward's and _log_softmax_backward_data's)
  beside the log-softmax it saved, three as torch's loss_parallel computes it (`loss_parallel`, workload/loss.py),
  none as Megatron-core computes it (`cross_entropy` "megatron": the saved softmax becomes the gradient in place),
  only autograd's cast of that gradient to the logits' dtype.

Attention is counted as the kernel a GPU would run: "math" materialises the s x s scores in the model's dtype
(as Megatron-LM 2021 and Korthikanti et al. 2022 ran it; torch upcasts them to float32 off CUDA, which the
count turns off), "flash" is torch's fused flash kernel (no scores saved: what torch picks on a recent GPU). A
fused kernel under a sliding window (`attention_window`: Mistral's `sliding_window`, gpt-oss's sliding layers) is
recorded with its window, forward and backward, so that it is priced at the query-key pairs it computes
(planning/estimate.py `kernel_flops`); the unfused one computes the whole s x s scores whatever the mask.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from ..choices import choose_from
from ..profiles.workload import CHECKPOINTED_REGIONS, LayerCount, OpCount, WorkloadCount, transient_peak
from .gdn import context_exchanges, is_gated_delta_net
from .loss import megatron_cross_entropy, vocabulary_parallel_cross_entropy
from .mamba import is_mamba2_mixer
from .models import BATCH, FOLLOWS_PREVIOUS, Model, ModelError, classification_loss, tied_layers
from .moe import (
    BLOCK_NORM,
    CHECKPOINT_REGION,
    NORM_APART,
    OPEN_REGIONS,
    Dispatched,
    dispatches,
    fused_swiglu,
    gating_now,
    host_waits_now,
    in_fused_kernel,
    in_product_kernel,
    kernel_listeners,
    per_expert_now,
    router_now,
)
from .moe import router_aux_loss as moe_router_aux_loss
from .norms import NO_RMSNORM_TO_FUSE, fused_norms, is_transformers_rms_norm
from .optim import OPTIMIZERS, make_optimizer
from .rope import NO_ROPE_TO_FUSE, fused_rope
from .sizes import CROSS_ENTROPY, REPEAT_KV_UNDER_MATH, kernels_refusal

__all__ = ["ATTENTION", "CROSS_ENTROPY", "LayerCount", "OpCount", "WorkloadCount", "count_built", "count_model"]

ATTENTION = ("math", "flash")
META = torch.device("meta")
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
ATTENTION_KERNELS = {str(op).removeprefix("aten.") for op in flop_registry if "attention" in str(op)}


@dataclass
class _Tally:
    flops: int = 0
    moved_bytes: int = 0  # of the memory-bound ops
    kernel_flops: int = 0  # those of the compute-bound fused kernels (`_MovedBytes._fused`), which torch does not see
    # (op, kind, shape, flops, moved bytes, routed, causal, kv group, gating, window, soft-capping, per expert,
    # host waits)
    ops: Counter = field(default_factory=Counter)
    transient: tuple[tuple[tuple[int, ...], int], ...] = ()  # `_LiveBytes.transient`
    allocations: tuple[tuple[int, tuple[int, ...], int, str], ...] = ()  # `_LiveBytes.allocations`
    products: tuple[tuple[int, tuple[int, ...]], ...] = ()  # `_LiveBytes.products`
    live: _LiveBytes = field(default_factory=lambda: _LiveBytes())  # what recorded them (`_LiveBytes.alive`)

    def records(self) -> tuple[OpCount, ...]:
        return tuple(OpCount(*key[:5], count=n, routed=key[5], causal=key[6], kv_group=key[7], gating=key[8],
                             window=key[9], softcap=key[10], per_expert=key[11], host_waits=key[12])
                     for key, n in self.ops.items() if n > 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shape(name: str, tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """A matrix product's (batch, m, n, k), an attention kernel's (batch·heads, query length, key length, head
    size), from its tensor arguments (addmm and baddbmm start with the added term)."""
    if name in MATMULS:
        a, b = tensors[-2:]
        return (a.shape[0] if a.dim() == 3 else 1, a.shape[-2], b.shape[-1], a.shape[-1])
    if name in ATTENTION_KERNELS:
        grad_first = name.endswith("_backward")  # (grad_out, query, key, ...)
        q, k = tensors[1:3] if grad_first else tensors[:2]
        return (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3])
    return ()


def _kv_group(name: str, tensors: list[torch.Tensor]) -> int:
    """An attention kernel's query heads per key/value head: grouped-query attention hands the kernel its fewer
    key/value heads (enable_gqa), a repeated one as many as the queries; 1 for any other op."""
    if name not in ATTENTION_KERNELS:
        return 1
    q, k = tensors[1:3] if name.endswith("_backward") else tensors[:2]
    return q.shape[1] // k.shape[1]


UNMARKED = (0, False)  # an attention kernel's (sliding window, soft-capping) where it has neither
_open_marks: list[tuple[int, bool]] = []  # the (window, soft-capping) of the attentions under way, innermost last
# (`attention_window`)
# by the id of a marked kernel's output storage, its (window, soft-capping): its backward, which reads that output,
# runs after the attention's forward has returned (entries leave as the storages are freed)
_marked: dict[int, tuple[int, bool]] = {}


@contextmanager
def attention_window(keys: int | None, softcap: bool = False) -> Iterator[None]:
    """Record the fused attention kernels run inside, and their backwards, as attending each query to at most
    `keys` keys, itself the last (a sliding window; None: every key before it), and as soft-capping their scores
    (`softcap`: Gemma 2's cap·tanh(score/cap), in the kernel)."""
    _open_marks.append((keys or 0, softcap))
    try:
        yield
    finally:
        _open_marks.pop()


def _kernel_marks(name: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> tuple[int, bool]:
    """An attention kernel's (window, soft-capping) (`UNMARKED` for any other op): the one open where it runs
    forward, its forward's for a backward."""
    if name not in ATTENTION_KERNELS:
        return UNMARKED
    if name.endswith("_backward"):
        return next((_marked[id(t.untyped_storage())] for t in reads if id(t.untyped_storage()) in _marked),
                    UNMARKED)
    marks = _open_marks[-1] if _open_marks else UNMARKED
    if marks != UNMARKED:
        key = id(writes[0].untyped_storage())
        _marked[key] = marks
        weakref.finalize(writes[0].untyped_storage(), _marked.pop, key, None)
    return marks


def _memory_key(name: str, shape: tuple[int, ...], moved: int, experts: bool, gating: bool = False) -> tuple:
    """A memory-bound op's key in `_Tally.ops`: no FLOPs, and none of an attention kernel's mask, key/value group,
    window or capping; an op a runtime issues once a local expert (`per_expert_now`) is a routed expert's; a
    kernel the host waits for the GPU before (`host_waits_now`) is marked so."""
    return (name, "memory", shape, 0, moved, experts or per_expert_now(), False, 1, gating, *UNMARKED,
            per_expert_now(), host_waits_now())


def _kind(name: str) -> str:
    return "matmul" if name in MATMULS else "attention" if name in ATTENTION_KERNELS else "compute"


# Ops that gather or scatter elements by index: their kernels touch the indexed elements of the tensor indexed, not
# all of it (`_indexed_moved`). Out of place, a scatter first copies the tensor it scatters into; an embedding's
# backward zeroes the table it scatters into.
GATHERS = {"index", "gather", "index_select", "embedding"}
SCATTERS = {"index_put_", "scatter_", "scatter_add_", "scatter", "scatter_add", "embedding_dense_backward"}
INDEXED = GATHERS | SCATTERS


def _index_positions(source: torch.Tensor, indices: list) -> int:
    """The elements of `source` that aten `index`'s `indices` (None for a dimension taken whole) pick, each as
    often as picked. A boolean mask counts as many positions as it has elements (all may be set)."""
    positions, covered = [], 1
    dim = 0
    for index in indices:
        if index is None:
            dim += 1
            continue
        span = index.dim() if index.dtype == torch.bool else 1
        covered *= math.prod(source.shape[dim:dim + span])
        positions.append((index.numel(),) if index.dtype == torch.bool else tuple(index.shape))
        dim += span
    return math.prod(torch.broadcast_shapes(*positions)) * (source.numel() // covered)


def _indexed_moved(name: str, args: tuple, writes: list[torch.Tensor]) -> int:
    """The bytes an `INDEXED` op moves, as its CUDA kernel moves them (PyTorch 2.x aten/src/ATen/native/cuda/:
    IndexKernel.cu `index_kernel`, `index_put_kernel`; ScatterGatherKernel.cu `gather`, `scatter_`,
    `scatter_add_`; Indexing.cu `index_select`: one thread an indexed element; Embedding.cpp `embedding` is
    `weight.index_select(0, indices)`, and Embedding.cu `embedding_dense_backward_cuda` zeroes the table's gradient
    (`at::zeros`) and adds each index's gradient row into its row). Its index tensors read; the indexed
    elements of the tensor indexed read (a gather) or written (a scatter; scatter_add's and the embedding's read
    too, as their adds read them), at most all of that tensor (an element indexed again taken as cached); a gather's
    output written, a scatter's values read, one a written element; plus, out of place, a scatter's copy of its
    input into its output (read and written), which its kernel touches whole, or the embedding's zeroed table
    (written)."""
    if name == "embedding_dense_backward":  # (grad, indices, rows, ...): the table is its output
        grad, table = args[0], writes[0]
        rows = min(args[1].numel(), table.shape[0]) * _nbytes(table[0])
        return _nbytes(args[1]) + _nbytes(grad) + 2 * rows + _nbytes(table)
    source, whole = args[0], 0
    if name in {"index", "index_put_"}:
        indices = [index for index in args[1] if index is not None]
        indexed = _index_positions(source, args[1])
    elif name in {"index_select", "embedding"}:  # (self, dim, index); the embedding's (weight, indices): rows
        dim, index = (args[1], args[2]) if name == "index_select" else (0, args[1])
        indices, indexed = [index], index.numel() * (source.numel() // max(source.shape[dim], 1))
    else:  # gather and the scatters: (self, dim, index, ...)
        indices, indexed = [args[2]], args[2].numel()
    if name in GATHERS:
        other = sum(map(_nbytes, writes))
    elif name == "index_put_":
        other = _nbytes(args[2])
    else:
        values = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
        other = indexed * values.element_size() if values is not None else 0
        whole = 0 if name.endswith("_") else 2 * _nbytes(source)
    touched = min(indexed, source.numel()) * source.element_size() * (2 if name.startswith("scatter_add") else 1)
    return sum(map(_nbytes, indices)) + touched + other + whole


class _MovedBytes(TorchDispatchMode):
    """Records every op with its FLOPs (torch's formula) and the bytes it reads and writes, and sums the bytes of
    those torch has no FLOP formula for, except views (ops whose outputs alias an input without writing it).
    With `routed`, an op reading a routed expert's weights or products is marked as the experts'."""

    def __init__(self, tally: _Tally, routed: Dispatched | None = None, regions: _Regions | None = None) -> None:
        super().__init__()
        self.tally = tally
        self.routed = routed
        self.regions = regions

    def __enter__(self) -> _MovedBytes:
        kernel_listeners.append(self._fused)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        kernel_listeners.remove(self._fused)
        super().__exit__(*exc)

    def _fused(self, name: str, reads: tuple[torch.Tensor, ...], writes: tuple[torch.Tensor, ...], flops: int) -> None:
        """A fused kernel (workload/moe.py `Fused`, workload/mamba.py's) recorded as the one op it is: memory-bound
        without products, else compute-bound at its products' `flops` (priced as the larger of its FLOPs at the
        products' rate and its bytes at the memory's: planning/estimate.py `op_ms`)."""
        moved = sum(map(_nbytes, reads)) + sum(map(_nbytes, writes))
        experts = self.routed is not None and self.routed.reads_experts(list(reads))
        if not flops:
            self.tally.moved_bytes += moved
            self._record(_memory_key(name, tuple(max(writes, key=_nbytes).shape), moved, experts))
            return
        self.tally.kernel_flops += flops
        self._record((name, "compute", (), flops, moved, experts, False, 1, False, *UNMARKED, False, False))

    def _record(self, key: tuple) -> None:
        self.tally.ops[key] += 1
        for kind in self.regions.last if self.regions is not None else ():
            self.regions.ops.setdefault(kind, Counter())[key] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if in_fused_kernel():  # its kernel is recorded once it has run (`_fused`)
            return out
        reads = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        experts = self.routed is not None and self.routed.reads_experts(reads)
        if func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
            moved = sum(map(_nbytes, reads)) + sum(map(_nbytes, writes))
            given = {**dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {})}
            causal = bool(given.get("is_causal", False))  # an attention kernel's mask; no other op has one
            self._record((name, _kind(name), _shape(name, reads), flops, moved, experts, causal,
                          _kv_group(name, reads), gating_now(), *_kernel_marks(name, reads, writes), False, False))
            return out
        if not writes and func._schema.is_mutable:  # in place, returning nothing (torch._foreach_add_)
            written = [value for arg, value in zip(func._schema.arguments, args)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            writes = [t for t in tree_leaves(written) if isinstance(t, torch.Tensor)]
        read_storages = {id(t.untyped_storage()) for t in reads}
        if not func._schema.is_mutable and all(id(t.untyped_storage()) in read_storages for t in writes):
            return out  # a view
        moved = (_indexed_moved(name, args, writes) if name in INDEXED
                 else sum(map(_nbytes, reads)) + sum(map(_nbytes, writes)))
        self.tally.moved_bytes += moved
        largest = max(writes, key=_nbytes, default=None)
        self._record(_memory_key(name, tuple(largest.shape) if largest is not None else (), moved, experts,
                                 gating_now()))
        return out


class _LiveBytes(TorchDispatchMode):
    """The storages the ops inside create, each with its bytes and the shape of its first tensor, and when each is
    freed (a weak reference's callback: torch keeps a storage's Python object while the storage lives), in order,
    so that the pass's transient peak can be read when it ends (`transient`)."""

    def __init__(self, regions: _Regions | None = None) -> None:
        super().__init__()
        self.created: dict[int, tuple[weakref.ref, tuple[int, ...], int, str]] = {}  # by event number, with its op
        self.events: list[tuple[int, bool]] = []  # (event number of the creation, created: else freed)
        self.known: dict[int, int] = {}  # the ids of the live storages created inside -> their numbers
        self.outside: dict[int, torch.UntypedStorage] = {}  # those an op read that were not: held, ids kept
        self.regions = regions
        self.region_kinds: dict[int, tuple[str, ...]] = {}  # by number: the regions that created it (`_Regions`)
        self.made_from: dict[int, set[int]] = {}  # by number: those created inside that its ops read (`reads`)
        self.products: dict[int, tuple[int, ...]] = {}  # by number: a matrix product's output, its (batch, m, n, k)
        self.unpacked: list[tuple[int, int]] = []  # (a saved storage's id, the events before it): autograd read it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        read: set[int] = set()
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if id(storage) in self.known:
                read.add(self.known[id(storage)])
            else:
                self.outside.setdefault(id(storage), storage)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if id(storage) in self.known:  # a view, or written in place: what it was made from, and what wrote it
                number = self.known[id(storage)]
                self.made_from[number] |= read - {number}
                continue
            if id(storage) in self.outside:
                continue
            number = len(self.events)
            self.known[id(storage)] = number
            if self.regions is not None:
                self.region_kinds[number] = tuple(self.regions.kinds.get(id(storage), ()))
            self.created[number] = (weakref.ref(storage, lambda _, n=number, key=id(storage): self._freed(n, key)),
                                    tuple(t.shape), storage.nbytes(), func.overloadpacket.__name__)
            self.made_from[number] = set(read)
            if func.overloadpacket.__name__ in MATMULS:
                self.products[number] = _shape(func.overloadpacket.__name__,
                                               [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])
            self.events.append((number, True))
        return out

    def _freed(self, number: int, key: int) -> None:
        self.known.pop(key, None)
        self.events.append((number, False))

    def transient(self, beside_kept: bool = False) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(shape, bytes) of the storages created and freed inside that were live at once at their most bytes
        (`transient_peak`, with `beside_kept`): what the pass holds above its inputs and what outlives it."""
        peak = transient_peak([(number, self.created[number][2]) for number, _ in self.events], beside_kept)
        return tuple(self.created[number][1:3] for number in peak)

    def allocations(self) -> tuple[tuple[int, tuple[int, ...], int, str], ...]:
        """Every storage created inside and each one freed so far, in order, as (its number in the pass, its shape,
        its bytes, negative where freed, and the op that created it): the pass's own allocations, replayed through
        the caching allocator's rules (sim/caching_allocator.py) to read what it reserves and not only what it
        holds; the op tells what a recomputation policy keeps (torchtitan's op policy saves by op)."""
        return tuple((number, shape, nbytes * (1 if created else -1), op)
                     for number, created in self.events for _, shape, nbytes, op in (self.created[number],))

    def saved_reads(self, saved: dict[int, Any], events: int) -> tuple[tuple[int, int], ...]:
        """Per storage of `saved` (by identity, in its order), where this backward, of `events` events, reads it
        (`unpacked`), as positions in `allocations`: (where autograd first unpacks it, where the node that last
        unpacks it has ended: the next node's unpacking, else the pass's end); (-1, -1) where it does not."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for key, at in self.unpacked:
            first.setdefault(key, at)
            last[key] = at
        positions = sorted({at for _, at in self.unpacked})

        def ended(at: int) -> int:
            later = bisect.bisect_right(positions, at)
            return positions[later] if later < len(positions) else events

        return tuple((first[key], ended(last[key])) if key in first else (-1, -1) for key in saved)

    def reads(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per storage created inside, in order, (its number, the numbers of those created inside that the ops
        making or writing it read): the pass's data flow, which tells what a compiled backward needs of what a
        recomputation policy keeps (planning/estimate.py `_unread_kept`)."""
        return tuple((number, tuple(sorted(self.made_from[number]))) for number in self.created)

    def alive(self, storages: dict[int, Any]) -> tuple[int, ...]:
        """The numbers of the storages created inside that are among `storages` (by identity) and still live."""
        return tuple(number for number, (ref, *_) in self.created.items()
                     if ref() is not None and id(ref()) in storages)


# MLA's up-projections (`RECOMPUTE_REGIONS`' "mla_up_proj"; the routed experts' activation, workload/moe.py marks)
_MLA_UP_NAMES = {"q_b_proj", "kv_b_proj", "linear_q_up_proj", "linear_kv_up_proj"}  # transformers', Megatron-core's
# the norms before them (transformers'), which Megatron-core fuses into linear_q_up_proj and linear_kv_up_proj
# (TELayerNormColumnParallelLinear under qk_layernorm: gpt_layer_specs.py at d98e8a64dd), so in their region
_MLA_NORM_NAMES = {"q_a_layernorm", "kv_a_layernorm"}
# MLA's down-projections (transformers', Megatron-core's): TransformerEngine linears of their own in Megatron-core's
# MLA layer spec, so the input norm they read is a norm module of its own (`_Regions.read_by`)
_MLA_DOWN_NAMES = {"q_a_proj", "kv_a_proj_with_mqa", "linear_q_down_proj", "linear_kv_down_proj"}
# The prefix of the region a block's own norm (workload/moe.py `BLOCK_NORM`) is traced in alone, by its qualified
# name; `_region_fields` merges them by what reads them (`_Regions.merged`)
_OWN_NORM = "norm@"


# The query's and key's norms (transformers' Qwen3 q_norm and k_norm, which Megatron-Bridge loads into
# Megatron-core's q_layernorm and k_layernorm; MLA's q_a_layernorm is fused into linear_q_up_proj there, as
# `layer_norm_weight`, so not one of them)
_QK_NORM_NAMES = {"q_norm", "k_norm", "q_layernorm", "k_layernorm"}


# The learned position embeddings (the built-in gpt's `positions`, workload/models.py `_Embed`; GPT-2's `wpe`;
# Megatron-core's LanguageModelEmbedding `position_embeddings`): a plain Embedding, not a vocabulary-parallel one
_POSITION_EMBEDDING_NAMES = {"positions", "wpe", "position_embeddings"}


def _module_bytes(layer: torch.nn.Module, kept: Callable[[str, torch.nn.Module], bool],
                  names: set[str] | None = None) -> int:
    """The bytes of the own parameters of `layer`'s submodules that `kept` (qualified name, module) keeps, of those
    whose own name is among `names` if given."""
    return sum(_nbytes(p) for name, module in layer.named_modules() if kept(name, module)
               and (names is None or name.rpartition(".")[2] in names) for p in module.parameters(recurse=False))


def is_norm(name: str, module: torch.nn.Module) -> bool:
    """Whether a submodule (its qualified name, itself) is a norm, by its class or its own name."""
    return "norm" in type(module).__name__.lower() or _module_part(name.rpartition(".")[2]) == "norms"


def _region_kinds(name: str, module: torch.nn.Module, every_norm_own: bool = False) -> tuple[str, ...]:
    """The recomputation regions a submodule (its qualified name, itself) is: the one its model marked it
    (`CHECKPOINT_REGION`); a norm by its class or name, a block's own (`BLOCK_NORM`, or any under
    `every_norm_own`) also alone (`_OWN_NORM`), MLA's q and kv norms also in its up-projections' region (but where
    run apart from them, `NORM_APART`); MLA's
    up-projections by name."""
    marked = getattr(module, CHECKPOINT_REGION, None)
    if marked is not None:
        return (marked,)
    word = name.rpartition(".")[2]
    if is_norm(name, module):
        own = every_norm_own or getattr(module, BLOCK_NORM, False)
        return ("layernorm", *((f"{_OWN_NORM}{name}",) if own else ()),
                *(("mla_up_proj",) if word in _MLA_NORM_NAMES and not getattr(module, NORM_APART, False) else ()))
    return ("mla_up_proj",) if word in _MLA_UP_NAMES else ()


class _Regions(TorchDispatchMode):
    """Which forward ops each region (profiles/workload.py `TRACED_REGIONS`) runs, what they create and what they
    read that they did not create: the ops inside a region's module (or workload/moe.py's `OPEN_REGIONS`; the
    attention kernel for "attention_out"), and after them, until a product or an attention kernel, the ops the
    module's parent runs on what they made (MLA's RoPE and concatenations of the up-projections' outputs, which the
    attention then saves). A recomputation drops the saved tensors a region created, keeps what it read, and
    reruns its ops (planning/estimate.py `Regions`). Holds no storage: a storage's regions are forgotten when it is
    freed."""

    def __init__(self, layer: torch.nn.Module, every_norm_own: bool = False) -> None:
        super().__init__()
        self.params = {id(p.untyped_storage()) for p in (*layer.parameters(), *shared_weights(layer))}
        self.stack: list[str] = []  # the qualified names of the submodules under way, outermost first
        self.region_of = {name: kinds for name, module in layer.named_modules()
                          if (kinds := _region_kinds(name, module, every_norm_own))}
        # per own norm (its `_OWN_NORM` region), the regions what reads it with a product makes it one of (`merged`)
        self.read_by: dict[str, set[str]] = {}
        self.kinds: dict[int, dict[str, str]] = {}  # a live storage's id -> {region: where its ops may go on}
        self.inputs: dict[str, dict[Any, tuple[int, tuple[int, ...], int, tuple[str, ...]]]] = {}
        self.outside: list[int] = []  # the storages read that the layer's ops did not create, in order
        self.last: tuple[str, ...] = ()  # the regions of the op just run (`_MovedBytes` records it in them)
        self.ops: dict[str, Counter] = {}  # per region, its ops as `_Tally.ops` (`_MovedBytes` fills it)
        self.live: _LiveBytes | None = None  # its storage numbers

    def own(self) -> dict[str, str]:
        """The regions the ops running now are inside, each with its module's parent (where its ops go on), a plain
        checkpoint's with its module itself (its ops end with it)."""
        mine = {kind: name if kind in CHECKPOINTED_REGIONS else name.rpartition(".")[0]
                for name in self.stack for kind in self.region_of.get(name, ())}
        return {**mine, **{kind: self.stack[-1] if self.stack else "" for kind in OPEN_REGIONS}}

    def merged(self, kinds: Iterable[str]) -> tuple[str, ...]:
        """`kinds` as a count records them (profiles/workload.py `TRACED_REGIONS`): an own norm's (`_OWN_NORM`) by
        what read it (`read_by`): "block_norm" where a product did (an input or pre-MLP norm; a post-norm, Gemma's,
        feeds the residual add), "separate_norm" where a mixture of experts or MLA's down-projections did, "mlp_norm"
        where a dense MLP did."""
        merged = []
        for kind in kinds:
            for name in sorted(self.read_by.get(kind, ())) if kind.startswith(_OWN_NORM) else (kind,):
                if name not in merged:
                    merged.append(name)
        return tuple(merged)

    def _note_readers(self, reads: list[torch.Tensor], here: str) -> None:
        """Note what a product running now under `here` makes each own norm it reads one of (`read_by`)."""
        inside = {kind for name in self.stack for kind in self.region_of.get(name, ())}
        tags = {"block_norm", *(("separate_norm",) if "moe" in inside or here.rpartition(".")[2] in _MLA_DOWN_NAMES
                                else ()), *(("mlp_norm",) if "mlp" in inside else ())}
        for t in reads:
            for kind in self.kinds.get(id(t.untyped_storage()), {}):
                if kind.startswith(_OWN_NORM):
                    self.read_by.setdefault(kind, set()).update(tags)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reads = [t for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.params]
        here = self.stack[-1] if self.stack else ""
        heavy = func.overloadpacket in flop_registry or in_product_kernel()
        kinds = {kind: where for t in reads for kind, where in self.kinds.get(id(t.untyped_storage()), {}).items()
                 if not heavy and where == here}
        kinds.update(self.own())
        if func.overloadpacket.__name__ in ATTENTION_KERNELS:
            kinds["attention_out"] = here
        if heavy:
            self._note_readers(reads, here)
        out = func(*args, **(kwargs or {}))
        for t in reads:
            made = self.kinds.get(id(t.untyped_storage()), {})
            for kind in kinds.keys() - made.keys():
                self._read(kind, t, tuple(made))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.kinds:
                    weakref.finalize(storage, self.kinds.pop, id(storage), None)
                self.kinds[id(storage)] = {**self.kinds.get(id(storage), {}), **kinds}
        self.last = tuple(kinds)
        return out

    def _read(self, kind: str, tensor: torch.Tensor, made: tuple[str, ...]) -> None:
        """Note that region `kind` read `tensor`'s storage, which regions `made` created (none: no region)."""
        storage = tensor.untyped_storage()
        number = self.live.known.get(id(storage)) if self.live is not None else None
        if number is None:  # made before the layer: held by the layer's caller meanwhile, its id kept
            if id(storage) not in self.outside:
                self.outside.append(id(storage))
            number = -1 - self.outside.index(id(storage))
        self.inputs.setdefault(kind, {}).setdefault(number, (number, tuple(tensor.shape), storage.nbytes(), made))

    @contextmanager
    def tracing(self, layer: torch.nn.Module) -> Iterator[_Regions]:
        """Follow `layer`'s submodules (the one it was made for) while it runs inside."""
        def enter(name: str) -> Callable[..., None]:
            return lambda *_: self.stack.append(name)

        def leave(*_: Any) -> None:
            self.stack.pop()

        hooks = [hook for name, module in layer.named_modules() if name
                 for hook in (module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave))]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()


@contextmanager
def _counting(routed: Dispatched | None = None, forward: bool = False,
              regions: _Regions | None = None, reading: _Reading | None = None) -> Iterator[_Tally]:
    """FLOPs, moved bytes and transient tensors of what runs inside, filled in when it ends; `forward`: a forward,
    whose saved tensors the simulator holds from its start (`_LiveBytes.transient`); `regions`: its recomputation
    regions traced too; `reading`: a backward, the saved tensors it reads noted (`_LiveBytes.unpacked`)."""
    tally = _Tally()
    flops = FlopCounterMode(display=False)
    live = _LiveBytes(regions)
    if regions is not None:
        regions.live = live
    if reading is not None:
        reading.live = live
    with regions if regions is not None else contextlib.nullcontext(), flops, _MovedBytes(tally, routed, regions), \
            live:
        yield tally
    if reading is not None:
        reading.live = None
    tally.flops = flops.get_total_flops() + tally.kernel_flops
    tally.transient = live.transient(beside_kept=forward)
    tally.allocations = live.allocations()
    tally.products = tuple(live.products.items())
    tally.live = live


class _GpuKernels(TorchFunctionMode):
    """The kernels a GPU runs where the meta device would decompose or pick another: dropout as one fused
    kernel (torch's native_dropout, as CUDA runs it: the output and a mask written in one pass); with
    `flash`, scaled_dot_product_attention as torch's flash kernel; without, an attention with dropout as
    Megatron-LM's unfused attention (scores, masked softmax, fused dropout, product), since torch's math path
    would decompose its dropout. With `repeat_kv`, grouped-query attention's keys and values are first copied to
    every query head, as torchtitan's Llama does before torch's attention (torchtitan/models/llama/model.py at
    9dec370, `repeat_kv`: unsqueeze, expand, reshape), so the kernel saves them, and a context-parallel ring passes
    them, at the queries' heads (`OpCount.kv_group` 1)."""

    def __init__(self, flash: bool, repeat_kv: bool = False) -> None:
        super().__init__()
        self.flash = flash
        self.repeat_kv = repeat_kv
        self.repeated = False  # whether `repeat_kv` copied any attention's keys and values (none: it changes nothing)
        self.attended = False  # whether the model computed attention (an MLP's count names no kernel for it)
        self.scores_bytes = 0  # the largest s x s scores an unfused attention made (`LayerCount.scores_bytes`)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.attended |= func is F.scaled_dot_product_attention
        if func is F.dropout:
            given = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
            p, training = given.get("p", 0.5), given.get("training", True)
            if training and 0 < p < 1:
                return torch.native_dropout(given["input"], p, True)[0]
            return func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = {**dict(zip(names, args)), **kwargs}
        query, key = given["query"], given["key"]
        repeats = query.shape[-3] // key.shape[-3] if self.repeat_kv and query.dim() > 2 else 1
        if repeats > 1:
            self.repeated = True
            given |= {"key": _repeated_heads(given["key"], repeats), "value": _repeated_heads(given["value"], repeats),
                      "enable_gqa": False}
            args, kwargs = (), given
        if not self.flash:  # its scores: batch x query heads x query length x key length, in the queries' dtype
            scores = given["query"].shape[:-1].numel() * given["key"].shape[-2] * given["query"].element_size()
            self.scores_bytes = max(self.scores_bytes, scores)
        if given.get("attn_mask") is not None:
            return func(*args, **kwargs)  # flash takes none: torch falls back too
        q, k, v, p, causal = (given["query"], given["key"], given["value"], given.get("dropout_p", 0.0),
                              given.get("is_causal", False))
        if self.flash:  # grouped-query too (enable_gqa): torch's flash kernel reads the fewer key/value heads
            # one head size for queries, keys and values: values of a smaller one (DeepSeek's MLA, 192 and 128)
            # padded to it and the output cut back, as transformers 4.x's DeepseekV3Attention ran flash_attention_2
            wide = q.shape[-1] - v.shape[-1]
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, F.pad(v, (0, wide)) if wide else v, p,
                                                                     causal, scale=given.get("scale"))[0]
            return out[..., :v.shape[-1]] if wide else out
        if not p:
            return func(*args, **kwargs)
        if given.get("enable_gqa"):  # the unfused product needs a key and value head for every query head
            k, v = (part.repeat_interleave(q.shape[-3] // part.shape[-3], dim=-3) for part in (k, v))
        scale = given.get("scale") or q.shape[-1] ** -0.5
        scores = q @ k.transpose(-2, -1) * scale
        if causal:
            future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.native_dropout(scores.softmax(-1), p, True)[0] @ v


_fused: list[bool] = []  # whether each count under way runs attention as one fused kernel, innermost last


def fused_attention() -> bool:
    """Whether the count under way runs attention as one fused kernel ("flash"), not as its products and softmax."""
    return bool(_fused) and _fused[-1]


def unfused_count() -> bool:
    """Whether a count is under way that runs attention as its products and softmax ("math")."""
    return bool(_fused) and not _fused[-1]


def _repeated_heads(part: torch.Tensor, repeats: int) -> torch.Tensor:
    """`part` (..., heads, tokens, head size) with each head `repeats` times in a row, a copy (torchtitan's
    `repeat_kv`: a reshape of the expanded view, which no strides can hold)."""
    shape = part.shape
    return part.unsqueeze(-3).expand(*shape[:-2], repeats, *shape[-2:]).reshape(*shape[:-3], -1, *shape[-2:])


@contextmanager
def _attention(kind: str, repeat_kv: bool = False) -> Iterator[_GpuKernels]:
    if kind not in ATTENTION:
        raise ValueError(choose_from("attention", ATTENTION, kind))
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    _fused.append(kind == "flash")
    try:
        with _GpuKernels(kind == "flash", repeat_kv) as kernels:
            yield kernels
    finally:
        _fused.pop()
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


# What saves an activation (`SAVED_PARTS`): these torch functions, else a submodule's name (`_module_part`).
_FUNCTION_PART = {F.layer_norm: "norms", F.group_norm: "norms", F.batch_norm: "norms", F.instance_norm: "norms",
                  F.dropout: "dropout", F.dropout1d: "dropout", F.dropout2d: "dropout", F.dropout3d: "dropout",
                  F.alpha_dropout: "dropout", F.scaled_dot_product_attention: "attention",
                  **({F.rms_norm: "norms"} if hasattr(F, "rms_norm") else {})}
_ATTENTION_NAMES = {"qkv", "proj", "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "query", "key", "value",
                    "c_attn"}
_MLP_NAMES = {"fc1", "fc2", "c_fc", "up_proj", "down_proj", "gate_proj", "w1", "w2", "w3"}


def _module_part(name: str) -> str | None:
    """The part a submodule's own name says it is (`mlp`, `self_attn.q_proj`'s `q_proj`), or None."""
    word = name.lower()
    if "norm" in word:  # before the words below: transformers' post_attention_layernorm is a norm
        return "norms"
    if word in _ATTENTION_NAMES or "attn" in word or "attention" in word:
        return "attention"
    if word in _MLP_NAMES or any(key in word for key in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    return None


@dataclass(frozen=True)
class _Product:
    """A product whose weights take a gradient, as `_SaverParts` records it."""

    shape: tuple[int, int, int, int]  # (batch, m, n, k)
    output_bytes: int
    input_storage: torch.UntypedStorage  # held, so that no identity is reused
    routed: bool  # the routed experts' grouped one (`LayerCount.weight_grad_routed`)
    router: bool  # a mixture of experts' router's (`LayerCount.weight_grad_router`)
    bias_bytes: int  # its linear's bias's (`LayerCount.weight_grad_bias_bytes`)


class _SaverParts(TorchFunctionMode):
    """Which part is saving now: the torch functions of `_FUNCTION_PART` under way, innermost last; and whether
    a product with weights is: a linear layer's (F.linear) or the routed experts' grouped one (a batched product
    of `routed`'s expert weights, their bias added or not, TransformerEngine's GroupedLinear under Megatron-core):
    what it saves is its input, kept for its weight gradient. `products`: each such product whose weights take a
    gradient (`_Product`), in the forward's order."""

    def __init__(self, routed: Dispatched | None = None) -> None:
        super().__init__()
        self.running: list[str] = []
        self.linear = 0
        self.routed = routed
        self.products: list[_Product] = []

    def _weighted(self, func: Callable[..., Any], args: tuple, kwargs: dict
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A product with weights' (input, weight, added bias or None), by what it computes: F.linear's, or a matrix
        product (`MATMULS`: its two factors last, after the term addmm and baddbmm add) whose second factor is the
        routed experts' (bmm; baddbmm where the product adds their bias, as gpt-oss's up product); None otherwise."""
        if func is F.linear:
            return (args[0], args[1] if len(args) > 1 else kwargs["weight"],
                    args[2] if len(args) > 2 else kwargs.get("bias"))
        if getattr(func, "__name__", None) not in MATMULS or self.routed is None:
            return None
        *added, x, weight = (a for a in args if torch.is_tensor(a))
        return (x, weight, (*added, None)[0]) if self.routed.reads_experts([weight]) else None

    def _record_product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        out: torch.Tensor) -> None:
        """A product with weights as (batch, m, n, k) and its output's bytes, where its weights take a gradient:
        F.linear's input rows by the weight's (n, k), or the grouped product's (experts, rows, n, k)."""
        if not weight.requires_grad:
            return
        shape = ((1, math.prod(x.shape[:-1]), *weight.shape) if weight.dim() == 2
                 else (*out.shape, x.shape[-1]))
        self.products.append(_Product(shape, _nbytes(out), x.untyped_storage(), weight.dim() != 2, router_now(),
                                      _nbytes(bias) if bias is not None and bias.requires_grad else 0))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        part = _FUNCTION_PART.get(func)
        if part is not None:
            self.running.append(part)
        terms = self._weighted(func, args, kwargs or {})
        weighted = terms is not None
        self.linear += weighted
        try:
            out = func(*args, **(kwargs or {}))
            if terms is not None and self.linear == 1:
                self._record_product(*terms, out)
            return out
        finally:
            self.linear -= weighted
            if part is not None:
                self.running.pop()


@dataclass
class _Save:
    """A storage autograd saves, as `_saved` records it: the shape of the first tensor saved on it, what saved it
    (one of `SAVED_PARTS`), whether it is the input of a product with weights (`LINEAR_INPUT_SAVES`) and, where
    the attention kernel alone saved it, the distinct tensors it saved on it (their bytes by offset, shape and
    strides; None where anything else saved it too: `_attention_copied`); `under`: the qualified names of the
    submodules under way when it was first saved ("": the layer), outermost first."""

    storage: torch.UntypedStorage
    shape: tuple[int, ...]
    part: str
    linear: str
    views: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] | None
    under: tuple[str, ...] = ()


@dataclass
class _Reading:
    """The backward pass being counted (`_counting`), whose `_LiveBytes` notes each saved storage autograd reads
    (`_saved`'s unpack hook); None between passes."""

    live: _LiveBytes | None = None


@contextmanager
def _saved(layer: torch.nn.Module, routed: Dispatched | None = None, reading: _Reading | None = None
           ) -> Iterator[tuple[dict[int, _Save], list[_Product]]]:
    """The storages autograd saves inside, by identity (meta storages have no address), each as a `_Save`
    (`routed`: the routed experts running inside). `layer`'s weights and buffers left out: the module
    holds them whatever autograd saves (the gpt's RoPE angles, which its fused RoPE saves). Every storage compared
    is held meanwhile, so no identity is reused. Yields them with the products whose weights take a gradient
    (`_SaverParts.products`); `reading`: where a later backward reads them (`_LiveBytes.unpacked`)."""
    weights = [p.untyped_storage() for p in (*layer.parameters(), *shared_weights(layer), *layer.buffers())]
    params = {id(storage) for storage in weights}
    saved: dict[int, _Save] = {}
    modules: list[str | None] = []  # the submodules under way, outermost first: the part each name says
    names: list[str] = []  # and their qualified names
    hooks = []
    def enter(part: str | None, name: str) -> Callable[..., None]:
        def entered(*_: Any) -> None:
            modules.append(part)  # None: the module's inputs and outputs stay as they are
            names.append(name)
        return entered

    def leave(*_: Any) -> None:
        modules.pop()
        names.pop()

    for name, module in layer.named_modules():
        hooks.append(module.register_forward_pre_hook(enter(_module_part(name.rpartition(".")[2]) if name else None,
                                                            name)))
        hooks.append(module.register_forward_hook(leave))
    functions = _SaverParts(routed)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        linear = "only" if functions.linear else ""
        attention = functions.running[-1:] == ["attention"]
        view = {(t.storage_offset(), tuple(t.shape), t.stride()): _nbytes(t)} if attention else None
        if id(storage) in saved:
            first = saved[id(storage)]
            first.linear = first.linear if first.linear == linear else "also"
            first.views = None if first.views is None or view is None else {**first.views, **view}
        elif id(storage) not in params:
            named = [part for part in reversed(modules) if part is not None]
            part = functions.running[-1] if functions.running else named[0] if named else "other"
            saved[id(storage)] = _Save(storage, tuple(t.shape), part, linear, view, tuple(names))
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if reading is not None and reading.live is not None:
            reading.live.unpacked.append((id(t.untyped_storage()), len(reading.live.events)))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), functions:
            yield saved, functions.products
    finally:
        for hook in hooks:
            hook.remove()


def _attention_copied(save: _Save) -> int:
    """The bytes a saved storage holds where the attention kernel's inputs are made contiguous before it saves
    them (TransformerEngine's context-parallel branch, `x.contiguous()`: a view of a wider product, as the v of a
    fused QKV product, becomes a copy of its own, and the product is freed): the distinct tensors the attention
    alone saved on it, at most the storage; the storage's own bytes where anything else saved it (`views` None)."""
    nbytes = save.storage.nbytes()
    return nbytes if save.views is None else min(sum(save.views.values()), nbytes)


def _optimizer_step(name: str, shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> tuple[int, int]:
    """(state bytes, bytes moved) of a step of optimizer `name` over meta weights of `shapes`: the sum of each
    weight's own (workload/optim.py's foreach kernels read and write each tensor of their lists once, and its state
    is per tensor), one weight of each shape and dtype stepped (`_weight_step`): a MoE layer's hundreds of experts'
    weights are a few shapes."""
    state_bytes = moved_bytes = 0
    for (shape, dtype), copies in Counter(shapes).items():
        state, moved = _weight_step(name, shape, dtype, torch.get_default_dtype())
        state_bytes, moved_bytes = state_bytes + copies * state, moved_bytes + copies * moved
    return state_bytes, moved_bytes


@functools.cache
def _weight_step(name: str, shape: tuple[int, ...], dtype: torch.dtype, default_dtype: torch.dtype) -> tuple[int, int]:
    """`stepped` over one weight of `shape` and `dtype`; `default_dtype`, torch's, is that of Adam's step count."""
    return stepped(name, ((shape, dtype),))


def stepped(name: str, shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> tuple[int, int]:
    """(state bytes, bytes moved) of the second step of optimizer `name` over meta weights of `shapes`, stepped
    together (the first step creates the state instead of updating it)."""
    weights = [torch.empty(shape, dtype=dtype, device=META, requires_grad=True) for shape, dtype in shapes]
    for weight in weights:
        weight.grad = torch.empty_like(weight)
    optimizer = make_optimizer(name, weights, 1e-3)
    optimizer.step()
    tally = _Tally()
    with _MovedBytes(tally):
        optimizer.step()
    state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return state, tally.moved_bytes


def count_model(model: Model, microbatch_size: int, dtype: torch.dtype, attention: str = "math",
                loss_parallel: bool = False, swiglu_fusion: bool = True,
                cross_entropy: str = "torch", norm_kernel: str = "eager", rope_kernel: str = "eager",
                router_aux_loss: str = "none", repeat_kv: bool = False) -> WorkloadCount:
    """Count `model` for a micro-batch of `microbatch_size` samples in `dtype`. Its layers are moved to the meta
    device (their values are lost): build it there (`with torch.device("meta")`, as `count_built` does). Layers
    alike (`_signature`) are counted once: a 175B GPT's 96 blocks cost one. `loss_parallel`: its cross entropy
    computed as torch's loss_parallel computes it (workload/loss.py). `swiglu_fusion`: a gated MLP's activation (a
    routed expert's scaled by the router's weights) counted as one fused kernel (`workload.moe.fused_swiglu`).
    `cross_entropy`: whose cross entropy, of `CROSS_ENTROPY` (megatron: workload/loss.py `megatron_cross_entropy`).
    `norm_kernel`: how its RMSNorms run, of `NORM_KERNELS` (fused: workload/norms.py's TransformerEngine kernel).
    `rope_kernel`: how its RoPE runs, of `ROPE_KERNELS` (fused: workload/rope.py's TransformerEngine kernel). A model
    with no RMSNorm or RoPE a fused kernel replaces is refused it, so that the flag never silently changes nothing.
    `router_aux_loss`: its routed experts' load-balancing loss, of ROUTER_AUX_LOSSES (`workload.moe.with_aux_loss`).
    `repeat_kv`: grouped keys and values copied to every query head before the attention kernel (`_GpuKernels`); a
    model with none to copy is refused it, as one with no RMSNorm or RoPE is a fused kernel."""
    if (refused := kernels_refusal(cross_entropy, norm_kernel, rope_kernel, loss_parallel, router_aux_loss)):
        raise ModelError(refused)
    flag = "--loss-parallel" if loss_parallel else "--cross-entropy megatron"
    if (loss_parallel or cross_entropy != "torch") and model.loss is not classification_loss:
        raise ModelError(f"{flag}: model {model.name!r} has a loss of its own, not a cross entropy pipesim can "
                         "compute as another runtime does")
    if loss_parallel:
        model = replace(model, loss=vocabulary_parallel_cross_entropy)
    elif cross_entropy == "megatron":
        model = replace(model, loss=megatron_cross_entropy)
    for layer in model.layers:
        if hasattr(layer, "criterion"):  # a layer computing a loss of its own (workload/hf.py's multi-token prediction)
            layer.criterion = model.loss
    # one sample made on the host, the micro-batch's b of it on the meta device (its values are never read):
    # `count -b 10**12` made 512 TB of tokens on the host first, an allocation's traceback
    sample, target = model.make_batch(1, torch.Generator().manual_seed(0))
    with _addressable(microbatch_size):
        batch = torch.empty(microbatch_size, *sample.shape[1:], device=META,
                            dtype=dtype if sample.is_floating_point() else sample.dtype)
        target = torch.empty(microbatch_size, *target.shape[1:], device=META, dtype=target.dtype) \
            if torch.is_tensor(target) else target
    outputs: dict[int, torch.Tensor] = {BATCH: batch}
    names, last = model.layer_names(), len(model.layers) - 1
    alike: dict[tuple, tuple[LayerCount, torch.Tensor]] = {}
    steps: dict[tuple, tuple[int, int]] = {}  # (optimizer, weight shapes) -> (state bytes, moved bytes)
    # a model that marks none of its norms a layer's own (one of the user's): each one its own, by what reads it
    every_norm_own = not any(getattr(module, BLOCK_NORM, False) for layer in model.layers for module in layer.modules())
    counted = []
    for layer in model.layers:  # all before any is counted: a layer may read another's weights (`shared_weights`)
        layer.to(device=META, dtype=dtype).train()
    with _attention(attention, repeat_kv) as kernels, fused_swiglu(swiglu_fusion), \
            moe_router_aux_loss(router_aux_loss), _addressable(microbatch_size):
        for i, layer in enumerate(model.layers):
            inputs = [outputs[s].detach().requires_grad_(s != BATCH and outputs[s].is_floating_point())
                      for s in model.inputs[i]]
            key = _signature(layer, inputs, i == last)
            if key not in alike:
                kernels.scores_bytes = 0
                with fused_norms(layer, norm_kernel == "fused"), fused_rope(layer, rope_kernel == "fused"), \
                        runs_on_meta(model.name, f"layer {names[i]}"):
                    count, out = _count_layer(model, layer, inputs, target, i == last, steps, every_norm_own)
                alike[key] = replace(count, scores_bytes=kernels.scores_bytes), out
            count, outputs[i] = alike[key]
            counted.append(replace(count, name=names[i], inputs=tuple(model.inputs[i])))
    counted = [replace(count, tied_layer=tied) for count, tied in zip(counted, tied_layers(model.layers))]
    fused = {op.op for count in counted for op in count.ops["fwd"]}
    transformers_norms = any(map(is_transformers_rms_norm, (m for layer in model.layers for m in layer.modules())))
    for kernel, replaced, refusal in ((norm_kernel, transformers_norms, NO_RMSNORM_TO_FUSE),  # torch's RMSNorm runs
                                      (rope_kernel, "fused_rope" in fused, NO_ROPE_TO_FUSE)):  # fused either way
        if kernel == "fused" and not replaced:
            raise ModelError(refusal)
    if router_aux_loss != "none" and not any(op.routed for count in counted for op in count.ops["fwd"]):
        raise ModelError(f"--router-aux-loss {router_aux_loss}: this model routes no tokens to experts: leave it out "
                         "or pass none")
    if repeat_kv and not kernels.repeated:
        raise ModelError("--repeat-kv: this model's attention takes as many key/value heads as query heads (no "
                         "grouped-query attention, or one whose code copies them already): there is nothing to copy; "
                         "leave it out")
    if repeat_kv and not kernels.flash:  # the copies changed the caching allocator's replay alone
        raise ModelError(REPEAT_KV_UNDER_MATH)
    return WorkloadCount(model.name, dict(model.options), microbatch_size, str(dtype).removeprefix("torch."),
                         attention if kernels.attended else None, counted)


@contextmanager
def runs_on_meta(model: str, what: str) -> Iterator[None]:
    """What model `model`'s own code raised running `what` (a layer, its forward) on the meta device, as one line
    naming it: a Hugging Face model's modelling code on a config it was not written for (DeepSeek-V4's rotary
    embedding keyed by its own names, not its layer types; Gemma 4's per-layer inputs, which pipesim's cut does not
    pass), a module of the user's own. An error raised last in pipesim's own code (`_raised_by_pipesim`) keeps its
    traceback: a bug of pipesim's is no input's fault. The count's own refusals (`ModelError`) and a tensor past
    what torch addresses (`_addressable`'s) pass as they are."""
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:
        if _past_address(exc) or _raised_by_pipesim(exc):
            raise
        raise ModelError(f"--model {model}: {what} cannot run on torch's meta device to be counted: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no message'}") from None


PIPESIM_ROOT = Path(__file__).resolve().parents[1]
TORCH_ROOT = Path(torch.__file__).resolve().parent


def _raised_by_pipesim(exc: BaseException) -> bool:
    """Whether the deepest frame of `exc`'s traceback outside torch's own code is pipesim's (its stand-ins and
    counting code), not the model's: torch's kernels raise on whoever called them wrongly, and the count's modes
    (`__torch_function__`, `__torch_dispatch__`), which see every op, only hand on one that torch then refused."""
    import traceback

    in_torch = False
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(TORCH_ROOT):
            in_torch = True
        elif not (in_torch and frame.name in ("__torch_function__", "__torch_dispatch__")):
            # (an environment made inside the checkout, as .ci/run's .venv, holds transformers below pipesim's)
            return path.is_relative_to(PIPESIM_ROOT) and "site-packages" not in path.parts
    return False


def _past_address(exc: BaseException) -> bool:
    """Torch's refusal of a tensor past what it addresses (`_addressable`)."""
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
    return isinstance(exc, (RuntimeError, TypeError, OverflowError)) and "overflow" in first_line.lower()


@contextmanager
def _addressable(microbatch_size: int) -> Iterator[None]:
    """Torch's refusal of a tensor past what it addresses (a size past a 64-bit integer, or its bytes past one),
    which a micro-batch large enough makes on the meta device too (`count -b 10**12` of a 4,096-token, 8,192-wide
    model's embedding), as the line naming --microbatch-size; any other error keeps its traceback."""
    try:
        yield
    except (RuntimeError, TypeError, OverflowError) as exc:
        if not _past_address(exc):
            raise
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"--microbatch-size {microbatch_size:,}: a tensor of the micro-batch is larger than torch "
                         f"can address ({first_line}); give a smaller one") from None


def shared_weights(layer: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """Weights `layer` reads and gives gradients to that another layer holds and is counted with (`shared_weights`:
    workload/hf.py's multi-token prediction reads the embedding's and the head's): not its own bytes, gradients or
    optimizer state, and not activations it saves."""
    return tuple(getattr(layer, "shared_weights", ()))


def _signature(layer: torch.nn.Module, inputs: list[torch.Tensor], last: bool) -> tuple:
    """What a layer's count depends on: each submodule's class, plain attributes (sizes, heads, flags) and
    weight shapes, and the inputs' shapes. Not where the layer sits: transformers numbers each decoder layer
    (`layer_idx`), and what that number changes in a layer (a sliding window, a dense or an expert MLP) is set
    as an attribute or a class of its own, which count."""
    def plain(module: torch.nn.Module) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                            if isinstance(v, (bool, int, float, str, tuple, type(None))) and k != "layer_idx"))

    def tensors(named) -> tuple:
        return tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in named)

    modules = tuple((name, type(m), plain(m), tensors(m.named_parameters(recurse=False)),
                     tensors(m.named_buffers(recurse=False))) for name, m in layer.named_modules())
    return modules, tensors(enumerate(inputs)), last


def _count_layer(model: Model, layer: torch.nn.Module, inputs: list[torch.Tensor], target: Any, last: bool,
                 steps: dict[tuple, tuple[int, int]], every_norm_own: bool) -> tuple[LayerCount, torch.Tensor]:
    """One layer counted (the last with its loss), and its output; `steps` caches optimizer steps by shapes;
    `every_norm_own`: the model marks none of its norms a layer's own (`_Regions`)."""
    weights = [p for p in layer.parameters() if p.requires_grad]
    regions, reading = _Regions(layer, every_norm_own), _Reading()
    with dispatches() as routed, regions.tracing(layer), _counting(routed, True, regions) as fwd, \
            _saved(layer, routed, reading) as (saved, products):
        out = layer(*inputs)
        model_output_bytes = _nbytes(out) if last else 0  # not held: the loss frees it as it goes
        out = model.loss(out, target) if last else out
    igrad, wgrad, full = _backward(out, [x for x in inputs if x.requires_grad], weights + list(shared_weights(layer)),
                                   routed, reading)
    saved_reads = {name: tally.live.saved_reads(saved, len(tally.allocations))  # found once, read twice
                   for name, tally in (("bwd", full), ("igrad", igrad))}
    shapes = tuple((tuple(w.shape), w.dtype) for w in weights)
    for name in OPTIMIZERS:
        if (name, shapes) not in steps:
            steps[name, shapes] = _optimizer_step(name, shapes) if weights else (0, 0)
    count = LayerCount(
        name="", fwd_flops=fwd.flops, igrad_flops=igrad.flops, wgrad_flops=full.flops - igrad.flops,
        fwd_moved_bytes=fwd.moved_bytes, igrad_moved_bytes=igrad.moved_bytes,
        wgrad_moved_bytes=full.moved_bytes - igrad.moved_bytes,
        saved_bytes=sum(s.storage.nbytes() for s in saved.values()),
        saved_tensors=tuple((s.shape, s.storage.nbytes()) for s in saved.values()),
        saved_parts=tuple(s.part for s in saved.values()),
        linear_input_saves=tuple(s.linear for s in saved.values()),
        weight_grad_outputs=_weight_grad_outputs(products),
        weight_grad_routed=tuple(product.routed for product in products),
        weight_grad_router=tuple(product.router for product in products),
        weight_grad_bias_bytes=tuple(product.bias_bytes for product in products),
        router_input_saves=_router_input_saves(saved, products),
        attention_copied_bytes=tuple(map(_attention_copied, saved.values())),
        sequence_inputs=_sequence_inputs(saved, fwd.live),
        param_bytes=sum(_nbytes(p) for p in layer.parameters()), grad_bytes=sum(map(_nbytes, weights)),
        norm_param_bytes=_module_bytes(layer, is_norm),
        qk_norm_param_bytes=_module_bytes(layer, is_norm, _QK_NORM_NAMES),
        position_embedding_bytes=_module_bytes(layer, lambda _, module: isinstance(module, torch.nn.Embedding),
                                               _POSITION_EMBEDDING_NAMES),
        optimizer_state_bytes={name: steps[name, shapes][0] for name in OPTIMIZERS},
        optimizer_step_moved_bytes={name: steps[name, shapes][1] for name in OPTIMIZERS},
        output_shape=() if last else tuple(out.shape), output_bytes=0 if last else _nbytes(out), inputs=(),
        model_output_bytes=model_output_bytes,
        decoder_block=bool(getattr(layer, "decoder_block", False)),
        follows_previous=bool(getattr(layer, FOLLOWS_PREVIOUS, False)),
        mamba_layer=_mamba_layer(layer),
        context_exchanges=tuple(context_exchanges(module) for module in layer.modules() if is_gated_delta_net(module)),
        expert_param_bytes=routed.expert_weight_bytes, expert_bias_tensors=routed.bias_tensors,
        dispatched_bytes=routed.token_bytes, routed_blocks=tuple(routed.blocks),
        routed_model_share=routed.routed_copies / routed.computed_copies if routed.computed_copies else 1.0,
        ops={"fwd": fwd.records(), "bwd": full.records(), "igrad": igrad.records(),
             "wgrad": _Tally(ops=full.ops - igrad.ops).records()},
        transient_tensors={"fwd": fwd.transient, "bwd": full.transient, "igrad": igrad.transient,
                           "wgrad": wgrad.transient},
        allocations={"fwd": fwd.allocations, "bwd": full.allocations, "igrad": igrad.allocations,
                     "wgrad": wgrad.allocations},
        product_allocations={"fwd": fwd.products, "bwd": full.products, "igrad": igrad.products,
                             "wgrad": wgrad.products},
        saved_allocations=fwd.live.alive(saved), saved_storages=tuple(fwd.live.known.get(key, -1) for key in saved),
        forward_reads=fwd.live.reads(),
        saved_reads=saved_reads,
        saved_region_entries={name: _saved_region_entries(saved, regions, reads)
                              for name, reads in saved_reads.items()},
        **_region_fields(regions, fwd.live, saved))
    return count, out.detach()


def _mamba_layer(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a Mamba-2 mixer and its norm alone (`LayerCount.mamba_layer`): every weight it holds is a
    Mamba-2 mixer's or a norm's (GraniteMoeHybrid's layers add an MLP, experts or both)."""
    mixers = [module for module in layer.modules() if is_mamba2_mixer(module)]
    held = {id(p) for module in mixers for p in module.parameters()} | {
        id(p) for name, module in layer.named_modules() if is_norm(name, module) for p in module.parameters()}
    return bool(mixers) and all(id(p) in held for p in layer.parameters())


def _saved_region_entries(saved: dict[int, _Save], regions: _Regions, reads: tuple[tuple[int, int], ...]
                          ) -> tuple[dict[str, int], ...]:
    """`LayerCount.saved_region_entries` of a backward pass whose `reads` of `saved` are `_LiveBytes.saved_reads`':
    per storage of `saved`, per region that made it, where the pass first reads it or any storage saved under the
    submodule that region runs in, if earlier. A recomputed region (Megatron-core's CheckpointWithoutOutput,
    megatron/core/tensor_parallel/random.py) is made again by a hook on the gradient of a later tensor in that
    submodule (`discard_output_and_register_recompute`: a transformer layer's attention or MLP output, for the norm
    before it), which the backward reaches no earlier than its entry into the submodule, taken as its first read of
    a storage saved under it: what a region made is held from there at the most. Kept per region, since a storage
    two regions made is made again where the one recomputed is entered, not the other (planning/estimate.py
    `_transient_bytes`)."""
    entered: dict[str, int] = {}  # a submodule's qualified name -> the pass's first read of a storage saved under it
    for (first, _), save in zip(reads, saved.values()):
        for name in save.under if first >= 0 else ():
            entered[name] = min(entered.get(name, first), first)
    entries = []
    for key, (first, _) in zip(saved, reads):
        entry: dict[str, int] = {}
        for kind, where in regions.kinds.get(key, {}).items() if first >= 0 else ():
            for merged in regions.merged((kind,)):
                entry[merged] = min(entry.get(merged, first), entered.get(where, first))
        entries.append(entry)
    return tuple(entries)


def _weight_grad_outputs(products: list[_Product]
                         ) -> tuple[tuple[tuple[int, int, int, int], int, bool], ...]:
    """`LayerCount.weight_grad_outputs` of a forward's `_SaverParts.products`: each one's shape, output bytes and
    whether another product reads its input too."""
    readers = Counter(id(product.input_storage) for product in products)
    return tuple((product.shape, product.output_bytes, readers[id(product.input_storage)] > 1) for product in products)


def _router_input_saves(saved: dict[int, _Save], products: list[_Product]) -> tuple[int, ...]:
    """`LayerCount.router_input_saves` of a forward's `saved` storages: those gating products read and no other."""
    others = {id(product.input_storage) for product in products if not product.router}
    routers = {id(product.input_storage) for product in products if product.router} - others
    return tuple(i for i, key in enumerate(saved) if key in routers)


def _sequence_inputs(saved: dict[int, _Save], live: _LiveBytes) -> tuple[tuple[int, int], ...]:
    """`LayerCount.sequence_inputs` of a forward's `saved` storages, `live` its allocations: those a product alone
    saves that a norm made (its "layernorm" region, `_Regions`) or that the layer was given (not made inside)."""
    inputs = []
    for i, (key, save) in enumerate(saved.items()):
        number = live.known.get(key, -1)
        if save.linear == "only" and (number < 0 or "layernorm" in live.region_kinds.get(number, ())):
            inputs.append((i, number))
    return tuple(inputs)


def _region_fields(regions: _Regions, live: _LiveBytes, saved: dict[int, Any]) -> dict[str, dict]:
    """`LayerCount`'s region fields (`region_saves` and on) of a forward's traced `regions`, `saved` its saves, each
    own norm's merged into the regions it is one of (`_Regions.merged`)."""
    index = {key: i for i, key in enumerate(saved)}  # saved_tensors' order
    numbered = {live.known[key]: i for key, i in index.items() if key in live.known}
    traced = {kind: regions.merged((kind,)) for kind in regions.ops}
    kinds = sorted({kind for merged in traced.values() for kind in merged})
    made_by = {number: regions.merged(made) for number, made in live.region_kinds.items()}
    made = {kind: tuple(n for n, merged in made_by.items() if kind in merged) for kind in kinds}
    outside = {-1 - i: index.get(key, -1) for i, key in enumerate(regions.outside)}
    inputs: dict[str, dict[Any, tuple]] = {}
    for source, merged in traced.items():
        for key, (number, shape, nbytes, made_by) in regions.inputs.get(source, {}).items():
            read = (number, shape, nbytes, regions.merged(made_by))
            for kind in merged:
                if kind not in read[3]:  # what one own norm made and another read is the merged region's own
                    inputs.setdefault(kind, {}).setdefault(key, read)
    ops: dict[str, Counter] = {}
    for source, merged in traced.items():
        for kind in merged:
            ops[kind] = ops.get(kind, Counter()) + regions.ops[source]
    # what a plain checkpoint's module made and an op after it saved (its output, read by the residual add) is kept
    under = [{kind for name in save.under for kind in regions.region_of.get(name, ())} for save in saved.values()]
    return {"region_saves": {kind: tuple(sorted(i for n in numbers if (i := numbered.get(n)) is not None
                                                and (kind not in CHECKPOINTED_REGIONS or kind in under[i])))
                             for kind, numbers in made.items()},
            "region_inputs": {kind: tuple((*read, numbered.get(read[0], outside.get(read[0], -1)))
                                          for read in inputs.get(kind, {}).values())
                              for kind in kinds},
            "region_ops": {kind: _Tally(ops=counted).records() for kind, counted in ops.items()},
            "region_allocations": made}


def _backward(out: torch.Tensor, inputs: list[torch.Tensor], weights: list[torch.Tensor],
              routed: Dispatched | None = None, reading: _Reading | None = None) -> tuple[_Tally, _Tally, _Tally]:
    """The input-gradient pass alone, the weight-gradient pass's transient tensors and allocations (autograd.grad
    on the weights over the graph the input pass kept, as a zero-bubble W runs; with no input to differentiate,
    the full backward's), and the full backward (inputs and weights), counted; `routed`: the forward's routed
    experts, whose ops the backward's reading their weights or products are; `reading`: the saved tensors the input
    pass and the full backward read noted (`_counting`)."""
    igrad = full = _Tally()
    if not out.requires_grad:
        return igrad, full, full
    grad = torch.ones_like(out)
    wgrad = None
    if inputs:
        with _counting(routed, reading=reading) as igrad:
            kept = torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True)  # noqa: F841
        if weights:  # (the gradients held until the pass's transients are read: they outlive it)
            with _LiveBytes() as live:
                kept = torch.autograd.grad(out, weights, grad, retain_graph=True, allow_unused=True)  # noqa: F841
            wgrad = _Tally(transient=live.transient(), allocations=live.allocations(),
                           products=tuple(live.products.items()))
    with _counting(routed, reading=reading) as full:
        kept = torch.autograd.grad(out, inputs + weights, grad, allow_unused=True)  # noqa: F841
    return igrad, full if wgrad is None else wgrad, full


def count_built(name: str, options: dict[str, Any], microbatch_size: int, dtype: torch.dtype,
                attention: str = "math", loss_parallel: bool = False, swiglu_fusion: bool = True,
                cross_entropy: str = "torch", norm_kernel: str = "eager", rope_kernel: str = "eager",
                router_aux_loss: str = "none", repeat_kv: bool = False) -> WorkloadCount:
    """Build model `name` (built-in or package.module:attribute, with `options`) on the meta device and count it."""
    from .models import build_model

    with META:
        model = build_model(name, **options)
    return count_model(model, microbatch_size, dtype, attention, loss_parallel, swiglu_fusion, cross_entropy,
                       norm_kernel, rope_kernel, router_aux_loss, repeat_kv)
