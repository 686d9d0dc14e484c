"""Expert parallelism (EP) in an estimate: a mixture of experts' routed experts placed over E ranks, each holding
1/E of them, and the token dispatch and combine as all-to-alls over those ranks.

Where the E ranks of an expert-parallel group sit follows the rank order (schedules/ranks.py). pipesim's draws them
from the data-parallel replicas (the expert layers E-way expert parallel and d/E-way data parallel, the other
layers d-way data parallel), so E divides d and a group's ranks sit t·C·p apart: max(node / (t·C·p), 1) of them
share a node. Megatron-core's ("megatron") folds them over the t·C·d ranks of a stage, ETP apart for an
expert-tensor-parallel size ETP (default t), so E·ETP divides t·C·d and max(node / ETP, 1) of them share a node; a
rank then holds 1/(E·ETP) of the routed experts' weights, and the experts' work per rank is unchanged (its t·C-th
share of the token copies through whole experts at ETP = 1, or every copy of its group through 1/t of each at
ETP = t: the same FLOPs, priced as the count's experts split t ways).

An all-to-all of a rank's token copies (the count's `dispatched_bytes`, 1/t of them per tensor-parallel rank)
keeps 1/E of them and sends the rest, (E-1)/E, as E-1 messages issued at once (NCCL's all-to-all is grouped
point-to-point sends): those to the group's ranks on the same node over the node's link, those to other nodes
over the rank's own NIC, both at once. Routing is balanced, as the count assumes (workload/moe.py). A layer's
forward runs two (dispatch, combine), its input-gradient pass two more (the gradients' way back); the weight
gradient none. They are rows of the schedule (`schedules.passes.add_expert_parallel`), on the device's network
stream, which the pass's next row waits for.

DeepEP's dispatch (`dispatcher` "deepep": DeepEP's normal kernels; "hybridep": NVIDIA's HybridEP; the two backends
of Megatron-core's flex dispatcher, `FLEX_DISPATCHERS`) sends a token once to each rank holding any of its k
experts, and across nodes once to each node holding any: over the NIC to the rank of the same local index there,
which forwards it over the node's link to that node's ranks (DeepSeek-V3 technical report, arXiv 2412.19437, section
3.2.2; github.com/deepseek-ai/DeepEP, its normal kernels' NVLink-to-RDMA forwarding). With balanced routing a
token's k experts are k of the n drawn alike, so a group of g of them misses all k with chance C(n - g, k) / C(n,
k): a rank (g = n/E) or a node (g its ranks' experts) receives the token with one minus that. The NIC carries one
copy per other node receiving it, the node's link one per other rank receiving it on each node
(`ExpertGroup.all_to_all_ms`). HybridEP across nodes is priced at its own published rate where the part's curve
holds one measured at the group's expert-parallel ranks a node (hardware/catalogue.py `DispatcherRates`, an H100's:
its algorithm bandwidth, which counts a token once for each node it reaches, its own included): the bytes a token
carries to each of those nodes over the rate at the group's rank count (in GB/s, 1e6 bytes a ms), half the
dispatch's, half the combine's, the two an all-to-all of the pass prices (a forward's dispatch and combine, a
backward's gradients of each), after the NIC's step latency as NCCL's (within a percent of the table's transfers, 2
ms and more). Inside a node, or on a part without the table, it is priced as DeepEP's. Where the router limits a
token to M of G expert groups of s = n/G (DeepSeek-V3's node-limited routing, M = 4 of 8, a group a node: its
report, section 2.1.2; transformers' DeepseekV3 router, n_group and topk_group), its M groups are M of the G drawn
alike and its k experts k of their M·s: a rank whose experts lie in one group receives it with chance
M/G·(1 - C(Ms - g, k)/C(Ms, k)), a node holding j whole groups with one minus the sum over the i of its groups
chosen (hypergeometric: C(j, i)·C(G - j, M - i)/C(G, M)) of C((M - i)s, k)/C(Ms, k). A placement whose ranks or
nodes split groups otherwise is priced without the limit.

Routing is data-dependent; balanced, every rank computes the same. With the busiest expert taking a share S of a
micro-batch's routed token copies (`hot_share`; balanced: 1/n of n experts), the rank holding it and n/E - 1
others at the rest's even share, (1 - S)/(n - 1) each, computes E·(S + (n/E - 1)(1 - S)/(n - 1)) times the
balanced work (`ExpertGroup.load`) and receives as many token copies, and every rank of the group waits for it at
the combine. On one rank (E = 1) the work is the same whatever the routing (dropless: every copy computed once).
Under random routing (`routing` "random") each token's k experts are k of the n drawn alike, token by token, as
Megatron-core's forced balance draws them (`moe_router_force_load_balancing`: moe_utils.py `RandomSTE` replaces
the router's logits by normal draws, a seed per rank): the shares are even only on average, and the busiest rank
of the E, which the combine waits for, holds `random_routing_load` times the mean.
Pure arithmetic: no torch, no simulator."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cache, lru_cache
from statistics import NormalDist
from typing import NamedTuple

from ..hardware.catalogue import DispatcherRates
from ..profiles.schema import EstimateLink, EstimatePlacement
from ..profiles.workload import LayerCount, OpCount, RoutedBlock
from ..schedules.ranks import RankOrderError, SettingsError, expert_grid
from ..sim.costs import held_compute

# Per MoE layer and micro-batch: the dispatch and combine after its forward (an A2A_F row), and the gradients' way
# back after its backward (an A2A_B after B, or after I: the weight-gradient pass routes nothing)
ALL_TO_ALLS = {"fwd": 2, "bwd": 2}
# NCCL's all-to-all of every copy (the default); DeepEP's and HybridEP's deduplicated one, which differ in where a
# float8 run pads each local expert's tokens (`ExpertGroup.float8_padded`) and in the multiprocessors they hold
DISPATCHERS = ("alltoall", "deepep", "hybridep")
FLEX_DISPATCHERS = ("deepep", "hybridep")  # Megatron-core's flex dispatcher's backends (moe_flex_dispatcher_backend)
ROUTINGS = ("balanced", "random")  # each expert its even share (the count's); each token's experts drawn alike
# how a rank runs its local experts' products: one grouped kernel over them all (the count's), or one product
# per local expert, as TransformerEngine's GroupedLinear runs them (`per_expert_products`)
EXPERT_GEMMS = ("grouped", "per-expert")
GEMM_STREAMS = 4  # TransformerEngine's compute streams (common/util/multi_stream.cpp `get_num_compute_streams`)
# the rows TransformerEngine's Fp8Padding pads each local expert's split of the tokens to before the float8 products
# (transformer_engine/pytorch/module/fp8_padding.py at v2.9 to v2.14: 32 under MXFP8, 16 for every other recipe)
FLOAT8_PADDING_ROWS = 16
# the aten ops Megatron-core's flex dispatcher runs, DeepEP's path, to turn the received tokens' top-k indices into
# each local expert's routing map and weights (`ExpertGroup.multihot_conversion`), one kernel each: the forward's,
# then the backward's of the weights' gathers
MULTIHOT_OPS = {"fwd": ("zeros", "zeros", "ne", "index", "arange", "sum", "repeat_interleave", "index_select",
                        "index_put_", "index", "index_put_", "_to_copy"),
                "bwd": ("index", "new_zeros", "index_put")}


class ExpertParallelError(SettingsError):
    """An expert-parallel degree the model or the placement cannot take."""


@dataclass(frozen=True)
class ExpertGroup:
    """The E ranks of an expert-parallel group: how many share each node, the links between them, the routed
    experts' count and busiest share (None: balanced), how tokens are dispatched to them, and the experts' tensor
    split ETP beside the dense layers' t."""

    ranks: int
    per_node: int
    node_link: EstimateLink
    network_link: EstimateLink
    experts: int | None = None
    hot_share: float | None = None
    dispatcher: str | None = None  # of `DISPATCHERS` (None: alltoall)
    tensor: int = 1  # ETP: the ranks each expert's weights are split over
    dense_tensor: int = 1  # t: the ranks each dense layer's weights are split over
    groups: tuple[int, int] | None = None  # (G, M): a token's experts lie in M of G expert groups (None: any)
    context: int = 1  # C: the context-parallel ranks a stage's tokens are split over beside the t
    routing: str = "balanced"  # of `ROUTINGS`
    # HybridEP's (dispatch, combine) algorithm bandwidth in GB/s at `ranks` across nodes (None: priced on the links)
    hybridep_gb_s: tuple[float, float] | None = None

    @property
    def weight_shards(self) -> int | Fraction:
        """`weight_shards` of the group."""
        return weight_shards(self.ranks, self.tensor, self.dense_tensor)

    @property
    def load(self) -> float:
        """The busiest rank's routed work over a balanced rank's (module docstring)."""
        if self.hot_share is None or not self.experts or self.experts == 1:
            return 1.0
        n, share = self.experts, self.hot_share
        return self.ranks * (share + (n // self.ranks - 1) * (1 - share) / (n - 1))

    def layer_load(self, layer: LayerCount) -> float:
        """The busiest rank's routed work over a balanced rank's in `layer`: `load` with a hot expert or balanced
        routing; under random routing the expected busiest of the E ranks in each of its MoE blocks, each rank
        receiving the copies of the E·ETP/(t·C) shares of the micro-batch's tokens its group dispatches
        (`random_routing_load`), the blocks weighted by their copies (each block's combine waits for its own)."""
        if self.routing == "balanced" or self.hot_share is not None or not layer.dispatched_bytes:
            return self.load
        copies = sum(block.tokens * block.top_k for block in layer.routed_blocks)
        return sum(random_routing_load(self.experts, block.top_k, self.ranks, self.dispatched_tokens(block))
                   * (block.tokens * block.top_k / copies) for block in layer.routed_blocks)

    def dispatched_tokens(self, block: RoutedBlock) -> float:
        """The tokens the group's E ranks dispatch in a MoE `block`: each of the E·ETP ranks' 1/(t·C) of the
        micro-batch's."""
        return block.tokens * self.ranks * self.tensor / (self.dense_tensor * self.context)

    def local(self, layer: LayerCount) -> LayerCount:
        """`layer` as the group's busiest rank runs it: its routed experts' grouped products at the shapes
        Megatron-core's grouped GEMM runs them on the rank (`local_product`), its other routed ops (`OpCount.routed`)
        `layer_load` times larger. The rest is the count's, which the estimate splits over the t·C ranks.

        Each product's roles follow from the forward's, whose m is the tokens and whose k × n is an expert's weight
        (the first fc1, split on its output n by ETP; the second fc2, split on its contraction k): a backward
        product whose m × n is a weight computes its gradient (the tokens its k), any other the input's gradient
        (m the tokens, n × k the weight transposed)."""
        forward = [op.shape[:0:-1][:2] for op in layer.ops.get("fwd", ()) if _grouped(op)]  # (k, n) each
        split = {weight: 1 if i == 0 else 0 for i, weight in reversed(list(enumerate(forward)))}  # of (k, n)
        load = self.layer_load(layer)

        def roles(op: OpCount, in_forward: bool) -> tuple[int, tuple[int, int]]:
            """The token dimension of (m, n, k) and those of the weight's (k, n)."""
            if in_forward:
                return 0, (2, 1)
            return (2, (0, 1)) if op.shape[1:3] in split else (0, (1, 2))

        def mine(op: OpCount, in_forward: bool) -> OpCount:
            if _grouped(op):
                tokens, weight = roles(op, in_forward)
                rows_cols = tuple(op.shape[1:][i] for i in weight)
                return self.local_product(op, tokens, weight[split.get(rows_cols, 1)], load)
            if op.routed and load != 1.0:
                return replace(op, flops=round(op.flops * load), moved_bytes=round(op.moved_bytes * load))
            return op

        sorts = self.chunk_sorts(layer, load)
        converted = self.multihot_conversion(layer, load)
        ops = {name: (*(mine(op, name == "fwd") for op in ops), *sorts.get(name, ()))
               for name, ops in layer.ops.items()}
        if converted:  # after the dispatch, before the permutation: where the forward's first routed op runs
            first = next(i for i, op in enumerate(ops["fwd"]) if op.routed)
            ops = {name: (*ops[name][:first], *converted[name], *ops[name][first:]) if name == "fwd"
                   else (*done, *converted.get(name, ())) for name, done in ops.items()}
        return replace(layer, ops=ops,
                       region_ops={name: tuple(mine(op, True) for op in ops) for name, ops in layer.region_ops.items()})

    def chunk_sorts(self, layer: LayerCount, load: float) -> dict[str, tuple[OpCount, ...]]:
        """Per pass, the copies Megatron-core's all-to-all dispatcher makes on a rank holding more than one of the
        routed experts, beyond the count's gather and scatter (its permutation 1 and unpermutation 1). What the
        all-to-all delivers is ordered by source rank, then expert, so MoEAlltoAllTokenDispatcher sorts it by
        local expert for the grouped product ("Permutation 2", `dispatch_postprocess`) and back before the
        combine ("Unpermutation 2", `combine_preprocess`), each `sort_chunks_by_idxs` (moe_utils.py: split and
        cat, or TransformerEngine's fused `moe_sort_chunks_by_index` under `moe_permute_fusion`), whose backward
        is the inverse sort of the gradient (megatron/core/transformer/moe/token_dispatcher.py at Megatron-LM
        d98e8a64dd; since the dispatcher came in, 9208adbdc7). Each reads and writes every copy the rank received:
        the layer's dispatched bytes times ETP (gathered over the expert-tensor group first) and `load` (the
        busiest rank's, `layer_load`), which
        the estimate splits over the t·C ranks. The router's weights sorted beside (4 bytes a copy against
        2·hidden) are left out. DeepEP's flex dispatcher receives each token once a rank and permutes it to its
        experts there, as the count's gather and scatter do, so it adds none; nor does one local expert."""
        if (self.dispatcher not in (None, "alltoall") or self.ranks == 1 or not self.experts
                or self.experts // self.ranks == 1 or not layer.dispatched_bytes):
            return {}
        sorts = self.received_copies_pass(layer, load, "moe_sort_chunks_by_index", 2)
        backward = tuple(replace(sort, op="moe_sort_chunks_by_index_backward") for sort in sorts)
        return {"fwd": sorts, "bwd": backward, "igrad": backward}

    def multihot_conversion(self, layer: LayerCount, load: float) -> dict[str, tuple[OpCount, ...]]:
        """Per pass, the ops DeepEP's path of Megatron-core's flex dispatcher runs on what a rank received, beyond the
        count's permutation: DeepEP hands over each received token once with its top-k expert indices (-1 where
        an expert is not the rank's), and `_DeepepManager.get_permuted_hidden_states_by_experts` turns them into
        a [tokens, local experts] routing map and weights for the permutation by `_indices_to_multihot` (two
        zero fills, a comparison, the valid indices and the weights each taken by a boolean mask, a row index
        repeated per valid entry, two index_puts, a cast: `MULTIHOT_OPS`, the aten ops it dispatches; the
        weights' gradient back through their gathers), unless Megatron-core's experimental flag and permute
        fusion select the fused `fused_indices_to_multihot` (megatron/core/transformer/moe/token_dispatcher.py at
        Megatron-LM 1e057005 and, the same code, b0cc2706, 0d8e0714cd and d98e8a64dd; the flag, ENABLE_EXPERIMENTAL,
        False unless `--enable-experimental`, megatron/core/config.py, which Megatron-Bridge never sets:
        scripts/translate_mlm_to_bridge.py at 067f987df skips it). Each op a kernel over the routing map, the
        received tokens (each of the E·ETP ranks' 1/(t·C) of the micro-batch, reaching the rank with the chance
        DeepEP's dispatch is priced by, times `load`) by the local experts in int64. The boolean masks and the
        repeat by a tensor each wait on the host for their output's size (three waits), which the host's count
        (planning/host.py) does not model: the dispatch's own wait is the forward's one. HybridEP (`hybridep`)
        permutes inside its own path, and the all-to-all dispatcher's map is the router's: neither converts."""
        if self.dispatcher != "deepep" or not self.experts or not layer.dispatched_bytes:
            return {}
        local = self.experts // self.ranks
        converted = Counter(round(self.dispatched_tokens(block) * self._receives(local, block.top_k) * load)
                            for block in layer.routed_blocks)  # each block's received tokens, alike ones together
        return {name: tuple(OpCount(op, "memory", (received, local), 0, received * local * 8, blocks, routed=True)
                            for received, blocks in converted.items() for op in ops)
                for name, ops in (("fwd", MULTIHOT_OPS["fwd"]), ("bwd", MULTIHOT_OPS["bwd"]),
                                  ("igrad", MULTIHOT_OPS["bwd"]))}

    def received_copies_pass(self, layer: LayerCount, load: float, name: str, kernels: int) -> tuple[OpCount, ...]:
        """`kernels` memory-bound kernels named `name` a MoE block (alike blocks' in one), each reading and writing
        every token copy the rank received in it: the block's dispatched bytes times ETP (gathered over the
        expert-tensor group first) and `load` (the busiest rank's, `layer_load`), which the estimate splits over
        the t·C ranks."""
        width = layer.output_shape[-1]
        blocks = Counter(block.sent_bytes for block in layer.routed_blocks)
        return tuple(OpCount(name, "memory", (round(sent * self.tensor * load / (width * layer.output_bytes)
                                                    * math.prod(layer.output_shape)), width),
                             0, round(2 * sent * self.tensor * load), kernels * alike, routed=True)
                     for sent, alike in blocks.items())

    def float8_padded(self, layer: LayerCount, dropless: bool) -> LayerCount:
        """`layer` as one rank runs it (`local`) under TransformerEngine's float8 recipes, with the copies
        Megatron-core's TEGroupedMLP makes to pad each local expert's split of the tokens to `FLOAT8_PADDING_ROWS`
        rows, the float8 GEMMs' alignment: under `fp8` its forward pads the permuted tokens and the router's
        weights (`quantization_padding`, TransformerEngine's Fp8Padding: `fused_multi_row_padding` into a new
        buffer) and unpads the second product's output (Fp8Unpadding: `fused_multi_row_unpadding`), and the
        backward runs each the other way on the gradients (megatron/core/transformer/moe/experts.py at every
        Megatron-LM pin from core_v0.14.0 (NeMo 25.09) and 0d8e0714cd (Megatron-Bridge v0.2.1, NeMo 25.11) to
        2a75ac12c5 (Megatron-Bridge 067f987df0); fp8_padding.py at TransformerEngine v2.9 to v2.14). Fp8Padding
        returns its input untouched where every split is aligned already, so a capacity-padded layer pays
        nothing where its capacity rows a local expert are a multiple of the alignment, and a dropless one pays
        always, its splits data-dependent (all n/E aligned by chance one time in 16^(n/E)). The permutations of
        Megatron-core's all-to-all dispatcher never pad. HybridEP (`hybridep`) pads inside its fused dispatch
        (`_HybridEPManager.dispatch` passes `hybrid_ep_dispatch` the float8 `pad_multiple` at b0cc2706, r0.3.0,
        and 55ac708, r0.3.1), so each split reaches Fp8Padding aligned and is not copied (later pins skip the
        experts' padding for it outright, moe_utils.py `skip_routed_expert_padding` at d98e8a64dd). DeepEP
        (`deepep`) pads nothing in its dispatch (`_DeepepManager` pads the routing map only under
        `moe_router_padding_for_quantization`, which no Qwen3 recipe sets), so its experts pad as the all-to-all's
        do (experts.py at b0cc2706 pads under `fp8` whatever the dispatcher). The router's weights (a [copies, 1]
        tensor) are one kernel each way, their bytes left out beside the copies' 2·hidden a copy."""
        forward = next((op for op in layer.ops.get("fwd", ()) if _grouped(op)), None)
        if forward is None or self.dispatcher == "hybridep" or not layer.dispatched_bytes:
            return layer
        if not dropless and forward.shape[1] % FLOAT8_PADDING_ROWS == 0:  # each local expert's capacity rows
            return layer
        pads = tuple(pad for tokens in self.received_copies_pass(layer, self.layer_load(layer), "fp8_padding", 2)
                     for pad in (tokens, OpCount("fp8_padding_router_weights", "memory", (tokens.shape[0], 1), 0, 0,
                                                 tokens.count // 2, routed=True)))  # one a block, its tokens' two
        backward = tuple(replace(op, op=f"{op.op}_backward") for op in pads)
        added = {"fwd": pads, "bwd": backward, "igrad": backward}
        return replace(layer, ops={name: (*ops, *added.get(name, ())) for name, ops in layer.ops.items()})

    def local_product(self, op: OpCount, tokens: int, hidden: int, load: float) -> OpCount:
        """One of the count's grouped products (`op.shape` (n, m, n', k): each of the n routed experts' m × k by
        k × n' product, at its share of the whole micro-batch's tokens) as one rank of the group runs it:
        Megatron-core's TEGroupedMLP / GroupedMLP (megatron/core/transformer/moe/experts.py) runs the rank's n/E
        local experts (batch n/E), each on the tokens dispatched to it from the E·ETP ranks of its expert- and
        expert-tensor-parallel groups, each rank holding 1/(t·C) of the micro-batch's tokens: the token dimension
        (`tokens`: 0, 1, 2 for m, n', k) times E·ETP/(t·C), and `load` on the busiest rank (`layer_load`); the
        expert's hidden
        dimension (`hidden`) its 1/ETP. The same FLOPs a rank as the count's split over t·C, but only the local
        experts' weights read, where the count's product read all n experts' on every rank."""
        batch, *dims = op.shape
        local = list(dims)
        local[tokens] = max(round(dims[tokens] * self.ranks * self.tensor * load
                                  / (self.dense_tensor * self.context)), 1)
        local[hidden] = dims[hidden] // self.tensor
        shape = (batch // self.ranks, *local)

        def elements(shape: tuple[int, ...]) -> int:  # of both operands and the output
            b, m, n, k = shape
            return b * (m * k + k * n + m * n)

        return replace(op, shape=shape, flops=round(op.flops * math.prod(shape) / math.prod(op.shape)),
                       moved_bytes=round(op.moved_bytes * elements(shape) / elements(op.shape)))

    def all_to_all_ms(self, nbytes: float, copies: int = 1) -> float:
        """One all-to-all of a rank's `nbytes`, `copies` of each token (its k experts' routed copies): its (E-1)/E
        sent, the share for its node's ranks over the node's link beside the share for other nodes' over its NIC;
        DeepEP's sends each token once to each other rank and node receiving it; HybridEP's across nodes, at its
        published rate, the mean of a dispatch's and a combine's (module docstring)."""
        if self.ranks == 1 or nbytes == 0:
            return 0.0
        nodes, token = self.ranks / self.per_node, nbytes / copies
        if self.dispatcher == "hybridep" and self.hybridep_gb_s and self.experts and nodes > 1:
            reached = token * nodes * self._receives(self.experts // self.ranks * self.per_node, copies)
            return self.network_link.latency_ms + sum(reached / (gb_s * 1e6) for gb_s in self.hybridep_gb_s) / 2
        if self.dispatcher in FLEX_DISPATCHERS and self.experts:
            inside = token * nodes * (self.per_node - 1) * self._receives(self.experts // self.ranks, copies)
            outside = token * (nodes - 1) * self._receives(self.experts // self.ranks * self.per_node, copies)
        else:
            inside = nbytes * (self.per_node - 1) / self.ranks
            outside = nbytes * (self.ranks - self.per_node) / self.ranks
        return max(self.node_link.latency_ms + inside / self.node_link.bytes_per_ms if inside else 0.0,
                   self.network_link.latency_ms + outside / self.network_link.bytes_per_ms if outside else 0.0)

    def _receives(self, held: int, copies: int) -> float:
        """The chance that a group of ranks holding `held` of the experts receives a token routed to `copies` of
        them, drawn alike (balanced routing), within the token's M of G groups where the router limits it (module
        docstring)."""
        if self.groups is None:
            return 1 - math.comb(self.experts - held, copies) / math.comb(self.experts, copies)
        groups, chosen = self.groups
        size = self.experts // groups
        reach = math.comb(chosen * size, copies)
        if held <= size:
            return chosen / groups * (1 - math.comb(chosen * size - held, copies) / reach)
        whole = held // size
        return 1 - sum(math.comb(whole, i) * math.comb(groups - whole, chosen - i) / math.comb(groups, chosen)
                       * math.comb((chosen - i) * size, copies) / reach for i in range(min(whole, chosen) + 1))


def random_routing_load(experts: int, top_k: int, ranks: int, tokens: float) -> float:
    """The expected busiest of `ranks` ranks' routed copies over their mean, `tokens` tokens each sending `top_k`
    copies to experts drawn alike from `experts` (n/E on each rank). A token sends a rank a hypergeometric number of
    copies (mean k/E, variance k·(1/E)(1 - 1/E)(n - k)/(n - 1)), independently of the other tokens, so a rank's
    count is about normal with N times those; the E counts sum to N·k, exchangeable with correlation -1/(E - 1),
    so their maximum is the mean plus sigma/sqrt(1 - 1/E) times the expected maximum of E standard normal draws."""
    if ranks == 1:
        return 1.0
    share = 1 / ranks
    mean = tokens * top_k * share
    variance = tokens * top_k * share * (1 - share) * (experts - top_k) / (experts - 1)
    return 1 + expected_normal_maximum(ranks) * math.sqrt(variance / (1 - share)) / mean


@cache
def expected_normal_maximum(draws: int) -> float:
    """The expected largest of `draws` standard normal draws, the integral of x·d(Phi(x)^draws) by the midpoint
    rule over 8 standard deviations each side (1/sqrt(pi) for two)."""
    normal, steps = NormalDist(), 4000
    width = 16 / steps
    points = (-8 + (i + 0.5) * width for i in range(steps))
    return sum(x * draws * normal.pdf(x) * normal.cdf(x) ** (draws - 1) for x in points) * width


# Layers of one pair run back to back in `paired_exposed_ms`, enough for its two streams to settle into their
# steady state, and the last of them it averages over
PAIRED_LAYERS, PAIRED_STEADY_LAYERS = 8, 4


@dataclass(frozen=True)
class MoePass:
    """One pass (a forward or a backward) of a mixture-of-experts layer as Megatron-core's overlap splits it
    (megatron/core/models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan), each node's GPU time:
    the compute outside the routed experts (`attention_ms`: attention, norms, router; its weight gradients in a
    backward), the routed experts' compute (`experts_ms`, with theirs), its dispatch and combine all-to-alls'
    network time, and the compute its combine node runs on the communication stream (`combine_compute_ms`: the
    unpermutation and the residual add, `mlp_bda`, after a forward's combine; their gradients before a backward's;
    not in `attention_ms`). Of a backward's, the weight gradients each part runs after its input gradients
    (`attention_wgrad_ms`, `experts_wgrad_ms`: TransformerEngine's modules hold them back under
    `delay_wgrad_compute`, and the pair runs them as `backward_dw`, outside its nodes). The `*_issue_ms`: the
    host's issue of each part's kernels (planning/host.py `issued_ms`; 0 where the layer never makes the host wait,
    so that it stays ahead), its weight gradients' of it. `product_ms`: the mean product of the pass a kernel
    launched at a random moment of its compute meets where products are launched on every multiprocessor
    (planning/estimate.py `persistent_product_ms`; 0: in waves, or given a target, DeepSeek's)."""

    attention_ms: float
    experts_ms: float
    dispatch_ms: float
    combine_ms: float
    attention_wgrad_ms: float = 0.0
    experts_wgrad_ms: float = 0.0
    attention_issue_ms: float = 0.0
    experts_issue_ms: float = 0.0
    attention_wgrad_issue_ms: float = 0.0
    experts_wgrad_issue_ms: float = 0.0
    combine_compute_ms: float = 0.0
    combine_issue_ms: float = 0.0
    product_ms: float = 0.0


class _ComputeNode(NamedTuple):
    """A compute node of `paired_exposed_ms`'s pair: when it starts, its own time, how much slower it runs beside an
    all-to-all (`slower`), when the host has issued it, the pass whose event it records ("": none) and that pass's
    mean product (`MoePass.product_ms`)."""

    start_ms: float
    run_ms: float
    slower: float
    issued_ms: float
    records: str
    product_ms: float

    def end_ms(self, kernels: list[tuple[float, float]]) -> float:
        """When the node ends beside the all-to-alls' `kernels` (begin, end), held by the engine's rule for compute
        beside a transfer (sim/costs.py `held_compute`): its products, of its pass's mean (0: in waves, or under an
        SM target), `slower` while a kernel runs, at its own speed otherwise."""
        return held_compute(kernels, self.start_ms, self.run_ms, self.product_ms, self.slower)[0]


@lru_cache(maxsize=1024)  # a model's repeated layers pair alike: each is priced once
def paired_exposed_ms(forward: MoePass, backward: MoePass, charged_ms: float | None = None,
                      experts_wait: bool = False, slower: tuple[float, float] = (1.0, 1.0)) -> float:
    """What a layer's forward paired with a backward of the same layer (Megatron-core's combined 1F1B,
    `overlap_moe_expert_parallel_comm`) takes beyond what its two parts are charged (`charged_ms`; None: their
    compute): the all-to-all time its order leaves exposed, and the host's issue and waits where they outlast it.
    `TransformerLayerSchedulePlan.run` (Megatron-LM 0d8e0714cd and b0cc2706 alike) issues, on a communication and a
    compute stream,

        comm: combine_bwd | dispatch_fwd -> dispatch_bwd          | combine_fwd
        comp: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd      | attn_bwd -> attn_bwd_dw

    each node waiting on its pass's event (pipeline_parallel/utils.py `stream_acquire_context`: a node waits for
    the event its pass's last node recorded, then records it), so a pass's nodes run in order, and the streams run
    theirs in issue order. The combine node is more than its all-to-all (models/gpt/fine_grained_callables.py
    `submodule_combine_forward`, at 0d8e0714cd and b0cc2706 alike): after the combine it unpermutes the tokens
    (the dispatcher's `combine_postprocess`, "Unpermutation 1") and adds the residual (`mlp_bda`), and its
    backward runs their gradients before the all-to-all, all on the communication stream
    (`MoePass.combine_compute_ms`); the dispatch node is its all-to-all alone (the permutations run in the
    attention and experts nodes: `dispatch_preprocess`, `dispatch_postprocess`). The weight gradients
    (`backward_dw`, under `delay_wgrad_compute`, which every Megatron-Bridge recipe setting `moe_a2a_overlap` sets
    with it: `set_moe_a2a_overlap_overrides`) run on the compute stream outside any node and record no event: the
    backward's dispatch waits for its experts' input gradients only, and the next layer's combine_bwd for this
    layer's attention's input gradients only, beside its attention's weight gradients. So each all-to-all hides
    only under what runs beside it, not under the other pass's whole compute (a 4-node Qwen3-235B layer's pair:
    8.2 ms of all-to-alls, 2.3 ms beyond its compute).

    One host issues all of it, in that order: a node's kernels run no sooner than it issues them. It runs ahead
    until it waits for the GPU: once a pair in the forward's dispatch, for the split sizes the attention node's
    router made (token_dispatcher.py `_maybe_dtoh_and_synchronize` at "before_ep_alltoall"; DeepEP's
    `Buffer.dispatch`, whose CPU waits for the receive counts: fused_a2a.py), and under `experts_wait` again
    before issuing the forward's experts, for the dispatched tokens (the flex dispatcher's DeepEP path at b0cc2706
    turns their indices into a routing map with boolean-mask indexing and `repeat_interleave`, each a
    synchronisation, `_DeepepManager._indices_to_multihot`, unless Megatron-core's experimental flag, which no
    Qwen3 recipe sets, picks the fused kernel). Where the host issues slower than the GPU runs, a pair takes at
    least both passes' issue, however its all-to-alls hide.

    The all-to-alls' kernels hold multiprocessors while they run (NCCL's channels, DeepEP's and HybridEP's SMs): a
    compute node beside them runs `slower` (the forward's, the backward's: its time beside them over its own,
    `LayerProfile.fwd_sharing_ms`; planning/estimate.py `sharing_dispatcher`: persistent products held, the rest on
    the multiprocessors left) for as long as they run beside it, at its own speed otherwise, so a node held off the
    pair's path costs nothing. A compute node's end waits for the all-to-alls that can run beside it: those the host
    issues before the next compute node or before a node that waits for it. The other order too: an all-to-all
    launched while a product launched on every multiprocessor runs finds none free for its CTAs until that
    product's end (github.com/NVIDIA/nccl issue 1431; TransformerEngine launches its own overlaps' communication
    first on Hopper for it, comm_gemm_overlap.cpp), so it starts later by half the mean product of the running
    node's pass (`MoePass.product_ms`, the product met at a random moment; no later than the node's end), and that
    product, begun before it, runs at its own speed. One released as a node starts (on the event the node before
    recorded, as most are) is taken to start first: no source says whether the node's first product takes the SMs
    first.

    Layers run back to back (`PAIRED_LAYERS`), each carrying the streams, events and host the one before left; the
    steady state's time a layer (`PAIRED_STEADY_LAYERS`) less what its parts are charged is what it leaves
    exposed."""
    comp = comm = forward_done = backward_done = host = 0.0  # each stream free, each pass's event, the host's time
    kernels: list[tuple[float, float]] = []  # the all-to-alls' (begin, end), in the communication stream's order
    pending: _ComputeNode | None = None  # the compute node started last, whose end waits for the kernels beside it
    ends: list[float] = []

    def node(stream: float, done: float, run_ms: float, issue_ms: float) -> tuple[float, float]:
        """When a node's work on `stream` starts and ends: started once its stream, its event and its issue allow,
        ended no sooner than its last kernel is issued."""
        nonlocal host
        start = max(stream, done, host)
        host += issue_ms
        return start, max(start + run_ms, host)

    def finish() -> float:
        """Ends the compute node started last, beside the all-to-alls issued so far, and records its event."""
        nonlocal comp, forward_done, backward_done, pending
        if pending is not None:
            comp = max(pending.end_ms(kernels), pending.issued_ms)
            forward_done = comp if pending.records == "forward" else forward_done
            backward_done = comp if pending.records == "backward" else backward_done
            pending = None
        return comp

    def compute(done: float, run_ms: float, issue_ms: float, part: tuple[float, float], records: str = "") -> None:
        """Starts a compute node once the stream, its event (`done`) and its issue allow; `part`: its pass's
        slowing beside the all-to-alls and mean product; `records`: the pass whose event it records."""
        nonlocal pending
        start, issued = node(finish(), done, 0.0, issue_ms)
        pending = _ComputeNode(start, run_ms, part[0], issued, records, part[1])

    def product_left_ms(launched: float) -> float:
        """How long a kernel launched at `launched` waits for the product running on every multiprocessor then: half
        the running compute node's mean product, no longer than the node runs on."""
        if pending is None or not pending.product_ms or pending.start_ms >= launched:
            return 0.0
        return min(pending.product_ms / 2, max(pending.end_ms(kernels) - launched, 0.0))

    def event(name: str) -> float:
        """A pass's event as a node waiting for it reads it (the compute node recording it ended first)."""
        if pending is not None and pending.records == name:
            finish()
        return forward_done if name == "forward" else backward_done

    def communicate(done: float, compute_ms: float, all_to_all_ms: float, issue_ms: float, first: bool) -> float:
        """A communication node: its compute and its all-to-all, the all-to-all `first` or after it."""
        nonlocal comm
        start, comm = node(comm, done, compute_ms + all_to_all_ms, issue_ms)
        begin = start if first else comm - all_to_all_ms
        waited_ms = product_left_ms(begin)
        begin += waited_ms
        comm += waited_ms
        kernels.append((begin, begin + all_to_all_ms))
        return comm

    forward_part, backward_part = (slower[0], forward.product_ms), (slower[1], backward.product_ms)
    layer_comm = 0.0
    for layer in range(PAIRED_LAYERS + 1):
        # the combine's gradients, then its all-to-all, which the host issues after them
        backward_done = communicate(event("backward"), backward.combine_compute_ms, backward.combine_ms,
                                    backward.combine_issue_ms, False)
        if layer:  # the layer before ends with its weight gradients, beside this combine's all-to-all
            ends.append(max(finish(), layer_comm))
        if layer == PAIRED_LAYERS:
            break
        compute(event("forward"), forward.attention_ms, forward.attention_issue_ms, forward_part, "forward")
        compute(event("backward"), backward.experts_ms - backward.experts_wgrad_ms,
                backward.experts_issue_ms - backward.experts_wgrad_issue_ms, backward_part, "backward")
        host = max(host, event("forward"))  # the dispatch's wait for the router's split sizes
        forward_done = communicate(event("forward"), 0.0, forward.dispatch_ms, 0.0, True)
        compute(0.0, backward.experts_wgrad_ms, backward.experts_wgrad_issue_ms, backward_part)
        backward_done = communicate(event("backward"), 0.0, backward.dispatch_ms, 0.0, True)
        if experts_wait:  # for the dispatched tokens, once the stream reaches the experts
            host = max(host, finish(), event("forward"))
        compute(event("forward"), forward.experts_ms, forward.experts_issue_ms, forward_part, "forward")
        forward_done = communicate(event("forward"), forward.combine_compute_ms, forward.combine_ms,
                                   forward.combine_issue_ms, True)
        compute(event("backward"), backward.attention_ms - backward.attention_wgrad_ms,
                backward.attention_issue_ms - backward.attention_wgrad_issue_ms, backward_part, "backward")
        compute(0.0, backward.attention_wgrad_ms, backward.attention_wgrad_issue_ms, backward_part)
        layer_comm = comm
    layer_ms = (ends[-1] - ends[-1 - PAIRED_STEADY_LAYERS]) / PAIRED_STEADY_LAYERS
    if charged_ms is None:
        charged_ms = sum(part.attention_ms + part.experts_ms + part.combine_compute_ms for part in (forward, backward))
    return max(layer_ms - charged_ms, 0.0)  # never below what its rows charge


def _grouped(op: OpCount) -> bool:
    """A routed experts' grouped product (workload/moe.py: a batched product over the experts)."""
    return op.routed and op.kind == "matmul"


def weight_shards(ranks: int, tensor: int | None, dense_tensor: int) -> int | Fraction:
    """E·ETP/t: of E expert-parallel `ranks` each splitting its experts over ETP `tensor` ranks (None: the dense layers'
    t, `dense_tensor`), a rank holds 1/weight_shards of the routed experts' weights beside its 1/t of the dense ones'
    (E where ETP = t; a whole number as an int, so an unfolded group is priced exactly as before)."""
    shards = Fraction(ranks * (dense_tensor if tensor is None else tensor), dense_tensor)
    return shards.numerator if shards.denominator == 1 else shards


def held_share(layer: LayerCount, shards: int | Fraction) -> float | Fraction:
    """The share of `layer`'s weights (and their gradients and optimizer state) a rank holds before the tensor
    split: the dense ones and 1/shards of its routed experts' (`ExpertGroup.weight_shards`)."""
    if not layer.param_bytes:
        return 1.0
    return 1 - layer.expert_param_bytes * (1 - 1 / shards) / layer.param_bytes


def check_expert_ranks(ranks: int, experts: int | None) -> None:
    """`ranks` expert-parallel ranks each hold an equal share of the model's `experts` routed experts (None: a dense
    model, which has none to place)."""
    if ranks > 1 and not experts:
        raise ExpertParallelError(f"expert: {ranks}, but the model has no routed experts to place (a mixture of "
                                  "experts: gpt --experts, or a Hugging Face MoE config)")
    if experts and experts % ranks:
        fitting = [n for n in range(1, experts + 1) if experts % n == 0]
        raise ExpertParallelError(f"expert: {ranks} does not divide the model's {experts} routed experts; give one "
                                  f"of {', '.join(map(str, fitting))}")


def check_routing(experts: int, top_k: int, hot_share: float | None, routing: str) -> None:
    """`ExpertParallelError` for routing no ranks make sense of: a busiest expert's share that is no share of
    `experts` experts' tokens (from balanced, 1/experts, to every token's copy, 1/top_k), or random routing beside
    one (tune checks them where it estimates E = 1 without them, commands/tune.py `_as_estimated`)."""
    if hot_share is not None and not 1 / experts <= hot_share <= 1 / top_k:
        most = "1" if top_k == 1 else f"1/{top_k} (each token's {top_k} copies go to {top_k} distinct experts)"
        raise ExpertParallelError(f"hot_expert_share: {hot_share} is not a share of {experts} experts' tokens: "
                                  f"from 1/{experts} (balanced) to {most}")
    if routing == "random" and hot_share is not None:
        raise ExpertParallelError("routing: random draws each token's experts alike, where --hot-expert-share names "
                                  "one busiest expert's share: give one of them")


def expert_group(placement: EstimatePlacement, ranks: int, experts: int | None, tensor: int, context: int,
                 pipeline: int, data: int, hot_share: float | None = None, dispatcher: str | None = None,
                 order: str = "pipesim", expert_tensor: int | None = None,
                 groups: tuple[int, int] | None = None, routing: str = "balanced",
                 hybridep: DispatcherRates | None = None, top_k: int = 1) -> ExpertGroup:
    """The group of `ranks` experts-parallel ranks of a model with `experts` routed experts (None: a dense
    model), placed as the rank `order` says (schedules/ranks.py) with each expert split over `expert_tensor` ranks
    (None: t), its busiest expert taking `hot_share` of the routed token copies (None: balanced), its tokens
    dispatched by `dispatcher` (of `DISPATCHERS`; None: alltoall), each routed within M of G expert `groups` (None:
    any; kept only where each rank's and each node's experts lie in one group or hold whole ones), by `routing` (of
    `ROUTINGS`; `Parallelism` refuses another dispatcher or routing), HybridEP priced at the part's `hybridep`
    table where it has one measured at the group's ranks a node (else, or None: on the links); an impossible
    degree or share, or a dispatcher or routing that needs more ranks, is `ExpertParallelError`. A token's `top_k`
    copies go to as many distinct experts, so an expert receives at most 1/top_k of them."""
    check_expert_ranks(ranks, experts)
    try:
        grid = expert_grid(order, tensor, context, pipeline, data, ranks, expert_tensor)
    except RankOrderError as exc:
        raise ExpertParallelError(*exc.args) from None  # its {settings} as they are
    if hot_share is not None and ranks == 1:
        raise ExpertParallelError("hot_expert_share: changes nothing on one expert-parallel rank (the experts' "
                                  "work is the same however the tokens are routed); give --expert-parallel above 1")
    if dispatcher is not None and ranks == 1:
        raise ExpertParallelError("token_dispatcher: dispatches tokens between expert-parallel ranks; give "
                                  "--expert-parallel above 1")
    if routing == "random" and ranks == 1:
        raise ExpertParallelError("routing: random changes nothing on one expert-parallel rank (it waits for no "
                                  "busier one); give --expert-parallel above 1")
    check_routing(experts, top_k, hot_share, routing)
    per_node = grid.per_node(("ep",), placement.gpus_per_node)
    if groups is not None and not (experts and experts % groups[0] == 0 and all(
            _aligned(experts // ranks * count, experts // groups[0]) for count in (1, per_node))):
        groups = None
    measured_alike = hybridep is not None and hybridep.gpus_per_node == per_node  # the table's ranks a node
    rates = hybridep.gb_s(ranks) if measured_alike and dispatcher == "hybridep" else None
    return ExpertGroup(ranks, per_node, placement.node_link, placement.network_link, experts, hot_share, dispatcher,
                       grid.size("tp"), tensor, groups, context, routing, rates)


def _aligned(held: int, size: int) -> bool:
    """Whether `held` experts placed in order lie in one group of `size` or hold whole groups."""
    return size % held == 0 if held <= size else held % size == 0


def per_expert_products(layer: LayerCount) -> LayerCount:
    """`layer` as one rank runs it (`ExpertGroup.local`) with each of its routed experts' grouped products run as
    one product per local expert: Megatron-core's TEGroupedMLP (its experts under `moe_grouped_gemm` with
    TransformerEngine's layer spec, unless `moe_use_legacy_grouped_gemm`) calls TransformerEngine's
    GroupedLinear, whose `general_grouped_gemm` issues one cuBLAS GEMM per expert (common/gemm/cublaslt_gemm.cu
    `nvte_multi_stream_cublas_gemm`: a loop over the GEMMs, the i-th on compute stream i mod 4) and quantises each
    expert's split of its input and output gradient on its own (pytorch/csrc/extensions/cast.cpp
    `split_quantize`, `multi_tensor_quantize_impl` at 006b336: one fused kernel for all splits under delayed
    scaling only, planning/fp8.py `Fp8Recipe.fuses_split_casts`). Each product is then one expert's, a kernel the
    host issues (planning/host.py), running beside the GEMMs on the other streams (`GEMM_STREAMS`, or as many as
    there are experts): each a share of the waves they fill together and of one kernel overhead
    (planning/estimate.py `matmul_ms`), as the streams overlap one GEMM's tail with the next's start.

    The ops the count marks as a local expert's each (`OpCount.per_expert`: TEGroupedMLP's `_apply_bias`, which
    adds the down product's bias to each local expert's split apart, `t + b * p`, then joins the splits by one
    `torch.cat`: megatron/core/transformer/moe/experts.py at 0d8e0714cd line 843, b0cc2706 and 55ac708 line 609,
    core_v0.17.0 line 251) run once a local expert too, each a kernel the host issues: forward its mul and add,
    backward the mul's two products by the other operand and their reductions to the bias's and the weights'
    shapes, the add passing its gradient on."""
    local = next((op.shape[0] for op in layer.ops.get("fwd", ()) if _grouped(op)), 1)

    def split(op: OpCount) -> OpCount:
        if op.per_expert and local > 1:
            return replace(op, count=op.count * local, flops=op.flops // local, moved_bytes=op.moved_bytes // local)
        if not _grouped(op) or op.shape[0] == 1:
            return op
        batch, *dims = op.shape
        return replace(op, shape=(1, *dims), count=op.count * batch, flops=op.flops // batch,
                       moved_bytes=op.moved_bytes // batch, streams=min(batch, GEMM_STREAMS))

    return replace(layer, ops={name: tuple(split(op) for op in ops) for name, ops in layer.ops.items()},
                   region_ops={name: tuple(split(op) for op in ops) for name, ops in layer.region_ops.items()})
