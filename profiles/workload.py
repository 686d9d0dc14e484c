"""A model's counted work as data: what workload/count.py measures with torch on the meta device, in plain
dataclasses, so that the planning side prices counts (planning/estimate.py) without importing torch."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, NamedTuple

from ..units import count_text
from .partition import FOLLOWS_WHY, stage_starts

HF_PREFIX = "hf:"  # --model hf:PATH counts a Hugging Face decoder from its config (workload/hfconfig.py)


def is_hf(model: str) -> bool:
    """Whether --model names a Hugging Face config (`hf:PATH`) rather than a built-in or a user's module: here, beside
    the counts, so that the planner may tell a profile's model apart without the torch side."""
    return model.startswith(HF_PREFIX)


def follows_flags(layers: Sequence[Any]) -> list[bool]:
    """Per layer of `layers` (a count's, a profile's, or a model's modules, which carry workload/models.py
    `FOLLOWS_PREVIOUS` where set), whether no stage may start at it."""
    return [bool(getattr(layer, "follows_previous", False)) for layer in layers]


def most_stages(layers: Sequence[Any]) -> int:
    """The most stages `layers` (`follows_flags`) can be cut into: one at each layer a stage may start at
    (profiles/partition.py `stage_starts`)."""
    return len(stage_starts(follows_flags(layers)))


def layers_text(layers: Sequence[Any]) -> str:
    """`layers` counted as a bound on the stages: "81 layers", or where some may start no stage "24 layers a stage
    may start at (of 81)"."""
    most = most_stages(layers)
    if most == len(layers):
        return f"{len(layers):,} layers"
    return f"{most:,} layers a stage may start at (of {len(layers):,})"


def too_many_stages(stages: str, count: int, model: str, options: Mapping[str, Any], layers: Sequence[Any],
                    profiled: bool = False, emptied_by: str | None = None) -> str | None:
    """`too_few_layers`' line where `count` stages (asked for by the flags `stages`) are more than `layers` can be cut
    into (`most_stages`); None where they fit."""
    most = most_stages(layers)
    if count <= most:
        return None
    return too_few_layers(stages, model, options, len(layers), profiled=profiled, starts=most, emptied_by=emptied_by)


def too_few_layers(stages: str, model: str, options: Mapping[str, Any], layers: int, profiled: bool = False,
                   starts: int | None = None, emptied_by: str | None = None) -> str:
    """The one line for more stages than the model has layers (`stages`: the flags that ask for them), which the
    command line says of a model it builds or counts and the planner of a profile's (`profiled`: a --profile file's,
    whose blocks no --layers gave). --layers counts a built-in model's blocks, and a pipeline cuts between all its
    layers, the embedding or classifier around the blocks too: both counts are said, so that 4 blocks and 6 layers
    do not read as a contradiction. `starts`: the layers a stage may start at, where fewer (`most_stages`).
    `emptied_by`: the cuts that may leave a stage empty where the command takes one (a layout's), said as the other
    fix, in place of "each needs at least one layer", which they would contradict."""
    given = "" if is_hf(model) or profiled else " (--layers)"  # a Hugging Face config gives its own
    blocks = f" of {count_text(options['layers'], 'block')}{given}" if "layers" in options else ""
    whose = "the profile's " if profiled else ""
    if starts is not None and starts < layers:
        counted, most = f", {starts} of which may start a stage (each other {FOLLOWS_WHY})", starts
    else:
        counted, most = "", layers
    other = (" (each needs at least one layer)" if emptied_by is None and not counted
             else "" if emptied_by is None
             else f", or a cut that may leave stages between the first and the last empty ({emptied_by})")
    return f"{stages}: {whose}{model}{blocks} has {layers} layers in all{counted}; give at most {most} stages{other}"


# forward, full backward, and the backward split into its input-gradient and weight-gradient passes: the weight
# pass's ops are the full backward's that the input pass does not run alike (a LayerNorm's backward, which
# computes its weights' gradients with its input's, is there whole)
PASSES = ("fwd", "bwd", "igrad", "wgrad")
OpKind = Literal["matmul", "attention", "compute", "memory"]
# Whether a saved tensor is a linear layer's input, which its product keeps for the weight gradient (and a float8
# recipe may keep cast instead): "only" (no other op saved it), "also" (another op saved it too), "" (not one)
LINEAR_INPUT_SAVES = ("only", "also", "")
# The parts of a layer a recomputation may drop the outputs of and rerun in the backward, by Megatron-core's names
# (`recompute_modules`, megatron/core/transformer/transformer_config.py at d98e8a64dd): with its output-discarding
# checkpoints, a transformer layer's input and pre-MLP norms ("layernorm", those a runtime keeps as norm modules of
# their own: planning/estimate.py `Parallelism.recomputed_regions`), MLA's up-projections with the norms before
# them, the RoPE and concatenations that make the attention's queries, keys and values ("mla_up_proj"), the
# routed experts' activation ("moe_act") and a Gated DeltaNet mixer's gated norm, its output out_proj keeps
# ("gdn_norm_out", workload/gdn.py);
# with its plain checkpoints (`CHECKPOINTED_REGIONS`), a dense layer's MLP ("mlp"), a mixture of experts whole,
# router, dispatch, experts and combine ("moe"), and a mixture of experts' shared expert ("shared_experts")
RECOMPUTED_PARTS = {"layernorm": "an input or pre-MLP norm", "mla_up_proj": "MLA's up-projections",
                    "moe_act": "routed experts", "mlp": "a dense MLP", "moe": "a mixture of experts",
                    "shared_experts": "a shared expert", "gdn_norm_out": "a Gated DeltaNet's gated norm"}
RECOMPUTE_REGIONS = tuple(RECOMPUTED_PARTS)
# The regions a plain checkpoint runs (tensor_parallel.checkpoint, megatron/core/tensor_parallel/random.py): the
# module's own ops alone, its inputs kept and its output too (the ops after it are not the region's, as they are
# after an output-discarding one)
CHECKPOINTED_REGIONS = ("mlp", "moe", "shared_experts")
# DeepSeek Sparse Attention's fused kernels, which workload/dsa.py records with their FLOPs: the indexer's scores, the
# sparse attention forward (FlashMLA's), the loss's recomputed scores, the indexer's backward, the sparse backward
SPARSE_ATTENTION_KERNELS = ("dsa_indexer_forward", "flash_mla_sparse_fwd", "flash_mla_sparse_fwd_lse",
                            "sparse_attn_score_recompute", "dsa_indexer_backward", "sparse_attention_backward")
# The forward's kernels a gradient-free pass skips: DSA's indexer loss (and, under top-k sharing, the FlashMLA forward
# run for its log-sum-exp alone), which Megatron-core computes only where torch.is_grad_enabled() (dsa.py
# `use_indexer_loss`), so under full recomputation in the rerun alone, not in the first, checkpointed forward
# (tensor_parallel/random.py runs it under torch.no_grad())
GRAD_ONLY_KERNELS = ("dsa_topk_prepare", "flash_mla_sparse_fwd_lse", "dsa_indexer_log_softmax",
                     "sparse_attn_score_recompute", "dsa_indexer_target_normalize", "dsa_indexer_kl",
                     "dsa_indexer_pad_heads", "dsa_indexer_backward", "dsa_indexer_slice_heads")
# Products of float32 tensors that PyTorch runs as TF32 on the tensor cores in NVIDIA's NGC containers, where Megatron's
# recipes run (their layer ENV TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 overrides torch's default of full float32): the
# per-head scores of a DSA indexer under top-k sharing (workload/dsa.py `_top_k_per_head`), at the part's TF32 peak
TF32_PRODUCT_KERNELS = ("bmm_fp32",)
# The regions the count traces (`LayerCount.region_saves` and on): those ("layernorm" every norm), the attention
# kernel's output with the copies made of it before the next product ("attention_out"), which a float8 recipe may
# keep once for both the attention's backward and that product's (planning/fp8.py `Fp8Recipe.attention_output_bytes`),
# a layer's own input and pre-MLP norms ("block_norm", workload/moe.py `BLOCK_NORM`: the `layernorm` recompute
# module's, planning/estimate.py `Parallelism.recomputed_regions`), of them those a mixture of experts or MLA's
# down-projections read ("separate_norm") and those a dense MLP reads ("mlp_norm")
TRACED_REGIONS = (*RECOMPUTE_REGIONS, "attention_out", "block_norm", "separate_norm", "mlp_norm")


def module_regions(module: str, te_layers: bool) -> tuple[str, ...]:
    """The traced regions a `--recompute-modules` part reruns, as Megatron-core reruns it (transformer_layer.py at
    d98e8a64dd). "layernorm": a transformer
    layer's input and pre-MLP norms where they are norm modules of their own (not an IdentityOp), under
    TransformerEngine's layers (`te_layers`) only those a mixture of experts or MLA's down-projections read
    ("separate_norm": the MoE layers' pre_mlp_layernorm, a TENorm, and MLA's input norm; the others fused into the
    TELayerNormColumnParallelLinear after them, linear_qkv, linear_fc1, a Mamba mixer's in_proj: gpt_layer_specs.py,
    mamba_layer_specs.py), else each ("block_norm"); never a query's or key's norm. "mlp": a dense MLP, under
    TransformerEngine's layers with the pre-MLP norm fused into its linear_fc1 ("mlp_norm")."""
    if module == "layernorm":
        return ("separate_norm",) if te_layers else ("block_norm",)
    return (module, "mlp_norm") if module == "mlp" and te_layers else (module,)


@dataclass(frozen=True)
class OpCount:
    """`count` calls of one op on the same shapes within a pass. `kind`: "matmul" (mm, addmm, bmm, baddbmm;
    `shape` is (batch, m, n, k): batch products of an m×k by a k×n matrix), "attention" (a fused attention
    kernel, forward or backward; `shape` is (batch·heads, query length, key length, head size)), "compute"
    (other ops torch counts FLOPs for, convolutions; no shape), "memory" (ops it counts none for: norms,
    activations, softmax, copies; `shape` is that of the largest tensor it writes). `flops` and `moved_bytes`
    (every tensor read plus every tensor written, but an output added into: `epilogue_bytes`) are per call."""

    op: str
    kind: OpKind
    shape: tuple[int, ...]
    flops: int
    moved_bytes: int
    count: int
    float8: bool = False  # a product a float8 recipe runs at the part's float8 peak (planning/fp8.py); never counted
    routed: bool = False  # a routed expert's op (workload/moe.py), of which a busy expert-parallel rank runs more
    causal: bool = False  # an attention kernel under a causal mask (its is_causal), which skips the masked blocks
    kv_group: int = 1  # an attention kernel's query heads per key/value head (grouped-query attention; 1: as many)
    gating: bool = False  # a router's gating product or its casts (workload/moe.py), kept out of float8 recipes
    window: int = 0  # an attention kernel's sliding window: the keys each query attends to at most (0: all)
    softcap: bool = False  # an attention kernel that soft-caps its scores in the kernel (Gemma 2's cap·tanh(s/cap))
    split_accumulation: bool = False  # a float8 product adding its partial sums into float32 every few steps
    streams: int = 1  # a product issued once per local expert, this many running at once on streams of their own
    # (planning/experts.py `per_expert_products`); never counted
    # a product that adds its output into a tensor of this many bytes an element (its epilogue reads it and writes
    # it back, `epilogue_bytes`, apart from `moved_bytes`: planning/estimate.py `accumulating`); 0: it writes its
    # output, counted in `moved_bytes`; never counted
    accumulates_into: int = 0
    # an op Megatron-core issues once a local expert where the count batches it over the experts (`_apply_bias`'s
    # mul and add, their backward: workload/moe.py `per_expert_now`), which `per_expert_products` issues so
    per_expert: bool = False
    # a kernel whose call first makes the host wait for the GPU to drain its queue (a synchronous copy to the device:
    # workload/moe.py `host_waits_now`), which planning/host.py prices so; never counted
    host_waits: bool = False

    @property
    def epilogue_bytes(self) -> int:
        """The bytes a product's epilogue moves adding into its output (`accumulates_into`): each element read and
        written; 0 where it only writes it."""
        if not self.accumulates_into:
            return 0
        batch, m, n, _ = self.shape
        return 2 * batch * m * n * self.accumulates_into




class RoutedBlock(NamedTuple):
    """One mixture-of-experts block's dispatch (workload/moe.py `routed_experts`): the tokens its router routes, the
    copies of each (its top-k) and the bytes of the copies it sends, padded to a capacity where the model drops
    tokens (of `LayerCount.dispatched_bytes`, which sums a layer's blocks')."""

    tokens: int
    top_k: int
    sent_bytes: int


# a LayerCount's numbers of its weights and what they hold beside them, which a tied layer shares with its tie
HELD_WITH_WEIGHTS = ("param_bytes", "grad_bytes", "norm_param_bytes", "position_embedding_bytes")


@dataclass(frozen=True)
class LayerCount:
    """One layer's work for one micro-batch (FLOPs, bytes) and its sizes (bytes). `*_moved_bytes` sum the
    memory-bound ops' traffic only; `ops` lists every op of each pass of `PASSES`, the products included."""

    name: str
    fwd_flops: int
    igrad_flops: int
    wgrad_flops: int
    fwd_moved_bytes: int
    igrad_moved_bytes: int
    wgrad_moved_bytes: int
    saved_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: dict[str, int]
    optimizer_step_moved_bytes: dict[str, int]
    output_shape: tuple[int, ...]
    output_bytes: int
    inputs: tuple[int, ...]  # the layers it reads (-1: the batch)
    saved_tensors: tuple[tuple[tuple[int, ...], int], ...] = ()  # (shape, bytes) per storage saved_bytes sums
    ops: dict[str, tuple[OpCount, ...]] = field(default_factory=dict)
    saved_parts: tuple[str, ...] = ()  # per saved tensor, what saved it (memory_parts.SAVED_PARTS); (): not attributed
    linear_input_saves: tuple[str, ...] = ()  # per saved tensor, `LINEAR_INPUT_SAVES`; (): not recorded
    # per product with weights that take a gradient (`LINEAR_INPUT_SAVES`' products), its shape as an OpCount's
    # (batch, m, n, k), its output's bytes (the output gradient a weight-gradient pass reads beside the saved
    # input: `wgrad_kept_bytes`) and whether another product reads the same input (q, k and v; a gated MLP's gate
    # and up); (): none, or not recorded
    weight_grad_outputs: tuple[tuple[tuple[int, int, int, int], int, bool], ...] = ()
    # per product of weight_grad_outputs, whether it is the routed experts' grouped one (workload/moe.py): its batch
    # is their number, 1 for one routed expert as for a linear product, so the batch alone cannot tell; (): none
    weight_grad_routed: tuple[bool, ...] = ()
    # per product of weight_grad_outputs, whether it is a mixture of experts' gating product (its router's, one score
    # per routed expert; its shared expert's gate's, one a token: workload/moe.py `routing`), whose weight tensor
    # parallelism keeps whole; (): none
    weight_grad_router: tuple[bool, ...] = ()
    # the indices in saved_tensors of the storages that only gating products (weight_grad_router) save as their input,
    # which their weight gradient, computed in the input-gradient pass, reads there (planning/estimate.py
    # `wgrad_kept`); (): none, or not recorded
    router_input_saves: tuple[int, ...] = ()
    # per product of weight_grad_outputs, the bytes of its linear's bias (0: none); a row-parallel product's
    # tensor parallelism keeps whole on every rank (planning/estimate.py `replicated_share`); (): not recorded
    weight_grad_bias_bytes: tuple[int, ...] = ()
    # of param_bytes, its learned position embedding's (workload/count.py `_POSITION_EMBEDDING_NAMES`), which tensor
    # parallelism keeps whole on every rank (planning/estimate.py `replicated_share`)
    position_embedding_bytes: int = 0
    # of param_bytes, its norms' weights (their scales and shifts): no product reads them, and tensor parallelism
    # keeps them whole on every rank (planning/estimate.py `replicated_share`)
    norm_param_bytes: int = 0
    # of norm_param_bytes, the query's and key's norms' (transformers' q_norm and k_norm, Megatron-core's
    # q_layernorm and k_layernorm), whose gradients Megatron-core all-reduces over the t ranks even without sequence
    # parallelism (planning/estimate.py `replicated_reduce_ms`)
    qk_norm_param_bytes: int = 0
    # per saved tensor, its bytes were the attention kernel's inputs made contiguous before it saved them, as
    # TransformerEngine's context-parallel ring does (workload/count.py `_attention_copied`); (): not recorded
    attention_copied_bytes: tuple[int, ...] = ()
    # per storage only a product with weights saves (its input) that is in the residual stream's layout, made by a
    # norm or before the layer (the layer's input): (its index in saved_tensors, its number in allocations["fwd"],
    # -1: made before the layer). Sequence parallelism holds such a tensor split by tokens, so a column-parallel
    # product gathers it whole first (planning/estimate.py `gathered_saves`); (): none, or not recorded
    sequence_inputs: tuple[tuple[int, int], ...] = ()
    # a mixture of experts' routed experts (workload/moe.py): their weights' bytes, of param_bytes, which expert
    # parallelism shards; and the bytes of the token copies a micro-batch's dispatches send (the combines return
    # as many), which its all-to-alls carry
    expert_param_bytes: int = 0
    dispatched_bytes: int = 0
    # per mixture-of-experts block its forward runs, in order (a decoder layer's one; DeepSeek's multi-token-prediction
    # layer's one a module): each dispatches and combines its own copies (planning/experts.py); (): none
    routed_blocks: tuple[RoutedBlock, ...] = ()
    # the routed experts' biases as the runtime holds them, one parameter an expert and product (TransformerEngine's
    # GroupedLinear `bias{i}`; gpt-oss's up and down: 2 an expert): each takes a gradient no product accumulates
    # (planning/host.py `pass_kernels`' `hook_adds`); expert parallelism shards them with the experts
    expert_bias_tensors: int = 0
    # of the routed experts' products, the share that is model work: the k·T token copies routing sends over the
    # E·(expected share or capacity) the experts compute; below 1 where a capacity factor pads the experts (the
    # padding's FLOPs are work, not the model's: `model_flops`) and by ⌈k·T/E⌉'s rounding
    routed_model_share: float = 1.0
    # Per pass of `PASSES`, the tensors it creates and frees within itself that were live at once at their most
    # bytes, (shape, bytes) each: its transient peak above its inputs and what outlives it (workload/count.py's
    # `_LiveBytes`); {}: a count from before they were recorded
    transient_tensors: dict[str, tuple[tuple[tuple[int, ...], int], ...]] = field(default_factory=dict)
    # Per pass of `PASSES`, every storage it creates and each one it frees, in order: (its number in the pass, its
    # shape, its bytes, negative: freed, the op that created it) (`_LiveBytes.allocations`), what the caching
    # allocator replays; {}: a count from before they were recorded
    allocations: dict[str, tuple[tuple[int, tuple[int, ...], int, str], ...]] = field(default_factory=dict)
    # Per pass of `PASSES`, the storages of `allocations` a matrix product made: (its number, the product's shape as
    # an OpCount's, (batch, m, n, k)), which tell what tensor parallelism holds whole while a product runs
    # (planning/estimate.py `_rank_pass`); {}: a count from before they were recorded
    product_allocations: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = field(default_factory=dict)
    # the numbers, in `allocations["fwd"]`, of the forward's storages that autograd saves for the backward (the
    # rest it leaves live is its output), which a recomputation drops and the backward makes again
    saved_allocations: tuple[int, ...] = ()
    # per saved tensor (saved_tensors' order), its storage's number in allocations["fwd"] (-1: made outside the
    # layer: its input, tables handed to it); (): a count from before it was recorded
    saved_storages: tuple[int, ...] = ()
    # per storage of allocations["fwd"], (its number, the numbers of those the ops making or writing it read): the
    # forward's data flow (workload/count.py `_LiveBytes.reads`); (): a count from before it was recorded
    forward_reads: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # per backward pass ("bwd", "igrad"), per saved tensor (saved_tensors' order), where autograd reads it, as
    # positions in allocations[pass] (the events before): (its first unpacking, the end of the node that unpacks it
    # last: the next node's unpacking, else the pass's end); (-1, -1): not read; {}: a count from before they were
    # recorded (workload/count.py `_LiveBytes.saved_reads`)
    saved_reads: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # per backward pass, per saved tensor, per region of `RECOMPUTE_REGIONS` that made it, the position in
    # allocations[pass] where recomputing that region makes it again at the earliest: the pass's entry into the
    # submodule the region runs in, if before its first unpacking (workload/count.py `_saved_region_entries`)
    saved_region_entries: dict[str, tuple[dict[str, int], ...]] = field(default_factory=dict)
    # Per region of `TRACED_REGIONS` that the layer runs (workload/count.py `_Regions`), what recomputing it
    # changes: `region_saves`, the indices in `saved_tensors` of those its ops created (dropped);
    # `region_inputs`, the storages its ops read and did not create, each (its number in allocations["fwd"], or
    # negative: made before the layer; its shape; bytes; the regions that created it; its index in saved_tensors,
    # -1: not saved), which the recomputation keeps; `region_ops`, its forward's ops, which the backward reruns;
    # `region_allocations`, the numbers in allocations["fwd"] of the storages it creates
    region_saves: dict[str, tuple[int, ...]] = field(default_factory=dict)
    region_inputs: dict[str, tuple[tuple[int, tuple[int, ...], int, tuple[str, ...], int], ...]] = field(
        default_factory=dict)
    region_ops: dict[str, tuple[OpCount, ...]] = field(default_factory=dict)
    region_allocations: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the last layer's: the model's output its loss reads (the logits), which a runtime that computes the loss in
    # its schedule keeps (torch's pipelining: sim/costs.py `held_as_runtime`); 0 for every other layer
    model_output_bytes: int = 0
    # the s x s scores of the layer's unfused attention (`--attention math`), its largest call's, every head's: what
    # Megatron-LM's CoreAttention asks of its global memory buffer (planning/estimate.py `--scores-buffer`); 0 with
    # a fused kernel or no attention
    scores_bytes: int = 0
    # a decoder layer of a Hugging Face model (workload/hf.py `DecoderLayer`), whatever its mixer: attention, experts,
    # a Mamba-2 mixer or an MLP (`transformer_layer`)
    decoder_block: bool = False
    # no pipeline stage may start at it (workload/models.py `FOLLOWS_PREVIOUS`)
    follows_previous: bool = False
    # the earlier layer whose weights are all of this one's (a tied head's are the embedding's: transformers'
    # tie_word_embeddings), one tensor where a stage holds both (profiles/partition.py `tied_pairs`); on stages
    # apart the later keeps its own copy, as Megatron-LM's last stage does; -1: its own
    tied_layer: int = -1
    # a Mamba-2 mixer and its norm alone, Megatron-core's MambaLayer: what CUDA graphs of the "mamba" scope capture
    # whole (planning/estimate.py `CUDA_GRAPH_SCOPES`)
    mamba_layer: bool = False
    # per Gated DeltaNet mixer, the elements a token its two context-parallel all-to-alls exchange (its in_proj's output
    # in, its gated norm's out: Megatron-core trades the sequence's split for one of the heads around the mixer,
    # workload/gdn.py `context_exchanges`); (): none
    context_exchanges: tuple[tuple[int, int], ...] = ()

    @property
    def transformer_layer(self) -> bool:
        """A transformer layer, as Megatron-LM and torchtitan say: what a whole layer's recomputation reruns and a
        float8 recipe's linears run in (the embedding and the head are neither). It attends (a fused attention
        kernel, batched products or routed experts' products in its forward), or it is a decoder block: a hybrid's
        Mamba-2 and MLP blocks too, which Megatron-core's HybridStack recomputes and runs in float8 as its attention
        blocks (and NeMo AutoModel checkpoints every block)."""
        return self.decoder_block or any(
            op.kind == "attention" or (op.kind == "matmul" and (op.shape[0] > 1 or op.routed))
            for op in self.ops.get("fwd", ()))

    @property
    def model_flops(self) -> int:
        """The forward's and backward's FLOPs without recomputation, the routed experts' products at their model
        share (`routed_model_share`): MFU's numerator, which counts each token's k experts whatever the capacity,
        as Megatron-LM's `num_floating_point_operations` (training.py: `moe_router_topk`, no capacity factor). An
        attention under a sliding window of w keys counts w of them a query where torch counts every key (its
        count, as a full attention's, ignores the causal mask): a 128-key window at 131,072 tokens was counted as
        the whole square, and a Mistral-like model's MFU read 121 % (19 % counted so). A fused attention kernel's
        backward recomputes the scores, which torch counts (torch/utils/flop_counter.py `sdpa_backward_flop_count`:
        five products, the first "We recompute the scores matrix"); the model's backward is its forward's two products
        twice over, as an unfused attention's counts, so the rest is left out: counted, Llama 3.1 8B's MFU at 131,072
        tokens read 47.9 % where 42.1 % is the model's."""
        ops = [op for name in ("fwd", "bwd") for op in self.ops.get(name, ())]
        routed = sum(op.flops * op.count for op in ops if op.routed)
        # each pass's attention kernels as counted, and within a sliding window of w keys, w of them a query
        counted = {name: [op.flops * op.count for op in self.ops.get(name, ()) if op.kind == "attention"]
                   for name in ("fwd", "bwd")}
        windowed = {name: sum(op.flops * op.count * (op.window / op.shape[2] if 0 < op.window < op.shape[2] else 1)
                              for op in self.ops.get(name, ()) if op.kind == "attention") for name in counted}
        outside_window = sum(map(sum, counted.values())) - sum(windowed.values())
        recomputed = max(0.0, windowed["bwd"] - 2 * windowed["fwd"])
        return round(self.fwd_flops + self.igrad_flops + self.wgrad_flops - (1 - self.routed_model_share) * routed
                     - outside_window - recomputed)


def weighted_products(layer: LayerCount, weights: dict[int, str], name: str) -> dict[int, tuple[int, str, str]]:
    """Pass `name`'s products that belong to a product with weights (`LayerCount.weight_grad_outputs`), by number
    in `product_allocations`: (its index there, how tensor parallelism splits it, `weights`' (planning/estimate.py
    `_weight_splits`), or "", which product it is). Which product: "output" in the forward; in a backward its input
    gradient, (batch, tokens, in, out), or its weight gradient, (batch, out, in, tokens) or (batch, in, out, tokens),
    matched in order, each product's after the next one's (the backward runs them in reverse); where both shapes are
    one (tokens == out) the weight gradient first, as torch's MmBackward0 computes the weight's (mat2's) before the
    input's; the input-gradient pass computes input gradients only, the weight-gradient pass weight gradients."""
    def forms(shape: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        batch, m, n, k = shape
        weight = (("weight", (batch, n, k, m)), ("weight", (batch, k, n, m)))
        grad_input = (("input", (batch, m, k, n)),)
        return {"fwd": (("output", shape),), "igrad": grad_input, "wgrad": weight}.get(name, (*weight, *grad_input))

    order = [(j, forms(shape)) for j, (shape, _, _) in enumerate(layer.weight_grad_outputs)]
    matched = _matched(layer.product_allocations.get(name, ()), order if name == "fwd" else order[::-1])
    return {number: (j, weights.get(j, ""), role) for number, (j, role) in matched.items()}


def _matched(products: Sequence[tuple[int, tuple[int, ...]]],
             order: Sequence[tuple[int, tuple[tuple[str, tuple[int, ...]], ...]]]) -> dict[int, tuple[int, str]]:
    """`products` (number, shape), in the pass's order, each matched to the first product of `order` at or after
    the last one matched, (index, its products' (role, shape))), whose role of that shape is not yet taken:
    number -> (index, role). A product that fits none (an attention's, one without weights) is left out."""
    taken: set[tuple[int, str]] = set()
    matched: dict[int, tuple[int, str]] = {}
    at = 0
    for number, shape in products:
        for i in range(at, len(order)):
            j, forms = order[i]
            role = next((role for role, form in forms if form == tuple(shape) and (j, role) not in taken), None)
            if role is not None:
                taken.add((j, role))
                matched[number] = (j, role)
                at = i
                break
    return matched


def transient_peak(events: Sequence[tuple[int, int]], beside_kept: bool = False) -> tuple[int, ...]:
    """Of a pass's `events` in order ((number, bytes): a storage made, then, if it is, freed: `LayerCount.allocations`
    without the shapes, the bytes' sign aside), the numbers of those made and freed within the pass that are live
    at once at their most bytes: what the pass holds above its inputs and what outlives it. `beside_kept`: at the
    last moment of the most bytes live counting those that outlive the pass too, for a pass whose kept tensors the
    simulator holds from its start (a forward's saved tensors): a tensor kept is then counted once, not again beside
    transients freed before it was made (torch's decomposed log-softmax frees its exponential before writing its
    result)."""
    seen = Counter(number for number, _ in events)
    steps = [(number, abs(nbytes)) for number, nbytes in events if beside_kept or seen[number] > 1]
    made: set[int] = set()
    signed = []
    for number, nbytes in steps:
        signed.append(-nbytes if number in made else nbytes)
        made.add(number)
    running = list(itertools.accumulate(signed))
    if not running or max(running) <= 0:
        return ()
    peak = len(running) - running[::-1].index(max(running)) if beside_kept else running.index(max(running)) + 1
    live: dict[int, None] = {}  # in the order made
    for number, _ in steps[:peak]:
        if number in live:
            del live[number]
        else:
            live[number] = None
    return tuple(number for number in live if seen[number] > 1)


@dataclass(frozen=True)
class WorkloadCount:
    """A model counted at micro-batch size `microbatch_size` in `dtype`, its attention as the `attention` kernel
    (None: the model computes none); `layers` in the model's order."""

    model: str
    options: dict[str, int | float | str]  # size options (ints, gated a bool), the dropout probability, the norm
    microbatch_size: int
    dtype: str
    attention: str | None
    layers: list[LayerCount] = field(default_factory=list)

    def total(self, name: str) -> int:
        """The sum over layers of LayerCount's number `name` (a field or `model_flops`), the model's weights once: a
        tied layer's weights, their gradients and optimizer state (`HELD_WITH_WEIGHTS`) are its tie's."""
        return sum(getattr(layer, name) for layer in self.layers
                   if name not in HELD_WITH_WEIGHTS or layer.tied_layer < 0)

    @property
    def top_k(self) -> int:
        """The most routed experts a token of any mixture-of-experts block goes to, as counted (1: none routes)."""
        return max((block.top_k for layer in self.layers for block in layer.routed_blocks), default=1)

    @cached_property
    def same_as(self) -> tuple[int | None, ...]:
        """Per layer, the first layer before it that it is but for its name and inputs (None: none is), which an
        estimate prices once: a model's repeated blocks, and blocks of a few kinds in turn (gpt-oss's sliding and
        full attention, a dense layer among MoE ones); found once a count, since comparing two whole layers costs
        about what pricing one does and tune estimates a count hundreds of times. Each layer is compared with the
        first of each kind before it, the kind of the layer before it first."""
        layers = self.layers
        firsts: list[int] = []  # the first layer of each kind, in the order found
        found: list[int | None] = []
        for i, layer in enumerate(layers):
            before = None if i == 0 else i - 1 if found[-1] is None else found[-1]  # the kind of the layer before
            same = next((first for first in sorted(firsts, key=lambda first: first != before)
                         if replace(layer, name=layers[first].name, inputs=layers[first].inputs) == layers[first]),
                        None)
            found.append(same)
            if same is None:
                firsts.append(i)
        return tuple(found)
