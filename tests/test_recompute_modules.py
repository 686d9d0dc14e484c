"""--recompute-modules (planning/estimate.py `Regions`, workload/count.py `_Regions`): the saved tensors a layer's
norms, MLA's up-projections or the experts' activation made are dropped and made again in the backward from what
they read, as Megatron-core's output-discarding checkpoints and DeepSeek-V3's report (3.2.3) do; those a dense MLP
or a mixture of experts saved, as its plain checkpoints do; traced on the meta device, not matched by size."""

from __future__ import annotations

import shlex
from dataclasses import replace
from functools import cache

import pytest
import torch
from torch import nn

from pipesim.planning.estimate import (
    EstimateError,
    Parallelism,
    estimate_layer,
    estimate_profile,
    layer_allocations,
    op_ms,
)
from pipesim.workload.count import WorkloadCount, count_built, count_model
from pipesim.workload.models import Model
from pipesim.workload.moe import BLOCK_NORM, CHECKPOINT_REGION
from tests.conftest import needs_transformers, pipesim
from tests.helpers import H100, B, H, S, ep_gpt_count
from tests.helpers import H100_BF16 as DEVICE
from tests.helpers import priced_recomputing as priced
from tests.helpers import tiny_deepseek_count as deepseek

TOKENS = B * S


@cache
def gpt() -> WorkloadCount:
    return count_built("gpt", dict(layers=1, width=H, heads=4, seq_len=S, vocab=100), B, torch.bfloat16, "flash")


def test_recomputing_the_norms_drops_exactly_their_outputs_and_statistics_and_reruns_them():
    """A GPT block's two LayerNorms: each keeps its input for its own backward (the block's input, the residual
    after the attention: read, not made, so kept), and what it made is dropped: its output, which the next linear
    saved (tokens x width in bf16), and its float32 mean and reciprocal deviation; its two calls rerun."""
    block = gpt().layers[1]
    made = 2 * (TOKENS * H * 2 + 2 * TOKENS * 4)
    assert priced(block).activation_bytes - priced(block, "layernorm").activation_bytes == made
    rerun = [op for op in block.region_ops["layernorm"]]
    assert [(op.op, op.count) for op in rerun] == [("native_layer_norm", 2)]
    assert priced(block, "layernorm").bwd_ms - priced(block).bwd_ms == pytest.approx(
        sum(op.count * op_ms(op, DEVICE) for op in rerun))
    assert priced(block, "mla_up_proj", "moe_act").activation_bytes == priced(block).activation_bytes  # none here


def test_norms_directly_under_the_layer_are_made_again_as_its_backward_begins():
    """A recomputed region is made again no earlier than the backward's entry into the submodule it runs in
    (planning/estimate.py `_transient_bytes`): a GPT block's norms run in the block itself, so each backward pass
    holds what they made beside its own peak, as a layer's full recomputation holds the layer."""
    block = gpt().layers[1]
    made = 2 * (TOKENS * H * 2 + 2 * TOKENS * 4)
    for name in ("bwd", "igrad"):
        assert priced(block, "layernorm").transient_bytes[name] == priced(block).transient_bytes[name] + made


@pytest.mark.parametrize(("tensor", "runtime"), [(2, "megatron"), (4, "megatron"), (2, "torch"), (4, "torch")])
def test_under_sequence_parallelism_the_norms_are_made_again_among_the_ranks_own_events(tensor, runtime):
    """As above on one of t ranks under sequence parallelism, whose pass holds storages the count's has not (a
    gathered gradient, a reduce-scatter's output: planning/estimate.py `_rank_pass`): what the norms made is placed
    at the count's positions among the rank's events, so each backward pass holds what their recomputation dropped
    beside its own peak, as at t = 1."""
    def block(*modules: str):
        parallel = Parallelism(tensor=tensor, sequence_parallel=True, tp_runtime=runtime, recompute_modules=modules)
        return estimate_profile(gpt(), H100, parallel).layers[1]

    plain, recomputed = block(), block("layernorm")
    dropped = plain.activation_bytes - recomputed.activation_bytes
    assert dropped > 0
    for name in ("bwd", "igrad"):
        assert recomputed.transient_bytes[name] == plain.transient_bytes[name] + dropped, name


class _UpProjection(nn.Module):
    """A norm inside an up-projection (a module named as MLA's, "q_b_proj"), marked a layer's own norm (which
    "layernorm" recomputes): what the norm makes is in both regions, the norm's, run in the up-projection, and the
    up-projection's, run in the attention above it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(H), nn.Linear(H, H)
        setattr(self.norm, BLOCK_NORM, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class _Attention(nn.Module):
    """The up-projection, then a product 8 times as wide, whose gradients make the backward's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.q_b_proj, self.up, self.down = _UpProjection(), nn.Linear(H, 8 * H), nn.Linear(8 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.q_b_proj(x))))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


def test_a_tensor_two_regions_made_is_made_again_where_the_recomputed_one_is_entered():
    """The norm's output and statistics are in both regions: recomputing the up-projection makes them again as the
    backward enters the attention, beside the wide product's gradients (the peak); recomputing the norm alone, as
    the backward enters the up-projection, after that peak, so the passes' peaks stay as without recomputation.
    Taking the earliest entry of every region that made them, recomputed or not, put them beside the peak."""
    with torch.device("meta"):
        layers = [nn.Linear(H, H), _Block()]
    model = Model("nested-regions", layers, lambda n, gen: (torch.randn(n, H, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    block = count_model(model, TOKENS, torch.bfloat16).layers[1]
    norms = block.region_saves["layernorm"]
    assert norms and set(norms) < set(block.region_saves["mla_up_proj"])
    for name in ("bwd", "igrad"):
        entries = block.saved_region_entries[name]
        assert all(entries[i]["mla_up_proj"] < entries[i]["layernorm"] for i in norms), name
    plain, norm, up = priced(block), priced(block, "layernorm"), priced(block, "mla_up_proj")
    assert norm.activation_bytes < plain.activation_bytes
    dropped = plain.activation_bytes - up.activation_bytes
    for name in ("bwd", "igrad"):
        assert norm.transient_bytes[name] == plain.transient_bytes[name], name
        assert up.transient_bytes[name] == plain.transient_bytes[name] + dropped, name


def test_the_allocator_replays_the_norms_outputs_made_again_in_the_backward():
    (_, block, *_) = layer_allocations(gpt(), Parallelism(recompute_modules=("layernorm",)))
    assert block.rerun == frozenset(gpt().layers[1].region_allocations["layernorm"])
    assert block.rerun and block.rerun <= {number for number, *_ in gpt().layers[1].allocations["fwd"]}
    assert layer_allocations(gpt(), Parallelism())[1].rerun is None


@needs_transformers
def test_mla_up_projections_drop_the_attentions_queries_keys_and_values_and_keep_the_roped_key():
    """MLA (2 heads, queries and keys of 16 + 8 RoPE, values of 16 padded to 24 for the flash kernel; a q rank of
    24, a kv rank of 16): the attention saved the queries, keys and values that the up-projections, the RoPE and
    the concatenations made, and the up-projections saved what the q and kv norms before them made (Megatron-core
    fuses those norms into linear_q_up_proj and linear_kv_up_proj): all dropped. The down-projections' outputs the
    norms read (kv's with its RoPE part) and the RoPE'd shared key (B, 1 head, S, 8), which nothing saved, are
    kept."""
    layer = deepseek().layers[1]
    dropped = [layer.saved_tensors[i] for i in layer.region_saves["mla_up_proj"]]
    assert dropped[-3:] == [((B, 2, S, 24), B * 2 * S * 24 * 2)] * 3
    norms = set(layer.region_saves["layernorm"]) & set(layer.region_saves["mla_up_proj"])
    assert len(norms) == len(dropped) - 3 == 8  # each norm's float32 input, statistics, output and its cast
    kept = [(shape, nbytes) for _, shape, nbytes, made_by, saved in layer.region_inputs["mla_up_proj"]
            if saved < 0 and not made_by]
    assert kept == [((B, S, 24), B * S * 24 * 2), ((B, S, 16), B * S * 24 * 2),
                    ((B, 2, S, 8), B * 1 * S * 8 * 2)]  # the key expanded to the heads, stored once
    assert priced(layer).activation_bytes - priced(layer, "mla_up_proj").activation_bytes == \
        sum(nbytes for _, nbytes in dropped) - sum(nbytes for _, nbytes in kept)


@needs_transformers
def test_the_experts_activation_drops_exactly_the_down_products_input():
    """moe_act: the gated activation scaled by the router's weights (one fused kernel) keeps its input and the
    weights; its output, which the down product saved, is dropped: each of 8 experts' 16 tokens x 32."""
    layer = deepseek().layers[2]
    assert [layer.saved_tensors[i] for i in layer.region_saves["moe_act"]] == [((8, 16, 32), 8 * 16 * 32 * 2)]
    assert priced(layer).activation_bytes - priced(layer, "moe_act").activation_bytes == 8 * 16 * 32 * 2


@needs_transformers
def test_recomputed_regions_feeding_each_other_keep_only_what_neither_made():
    """The q and kv norms make the up-projections' inputs: recomputing both keeps the down-projections' outputs
    (what the norms read) instead, and drops every tensor either made."""
    layer = deepseek().layers[1]
    both = priced(layer, "layernorm", "mla_up_proj")
    dropped = {*layer.region_saves["layernorm"], *layer.region_saves["mla_up_proj"]}
    kept_inputs = {number: nbytes for name in ("layernorm", "mla_up_proj")
                   for number, _, nbytes, made_by, saved in layer.region_inputs[name]
                   if saved < 0 and not {"layernorm", "mla_up_proj"} & set(made_by)}
    assert priced(layer).activation_bytes - both.activation_bytes == \
        sum(layer.saved_tensors[i][1] for i in dropped) - sum(kept_inputs.values())


def test_bad_recompute_modules_are_refused_in_one_line():
    for args, message in ((("--recompute-modules", "norms"), "--recompute-modules: a comma list of layernorm"),
                          (("--recompute-modules", "layernorm,layernorm"), "each once"),
                          (("--recompute", "full", "--recompute-modules", "layernorm"),
                           "beside --recompute none or selective")):
        code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "-p", "2",
                                 *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out
    with pytest.raises(EstimateError, match="recompute_modules: a comma list of"):
        Parallelism(recompute_modules=("norms",))


def test_tune_tries_full_recomputation_beside_recompute_modules(monkeypatch):
    """tune searches none, selective and full: --recompute-modules reruns its parts under the first two; full
    keeps only each layer's input, nothing more to drop, so it is tried as it is rather than refused."""
    from pipesim.commands import tune

    estimated = set()
    estimate = tune.estimated_profile
    monkeypatch.setattr(tune, "estimated_profile", lambda what, counted, parallel, *args: estimated.add(
        (parallel.recompute, parallel.recompute_modules)) or estimate(what, counted, parallel, *args))
    monkeypatch.setattr(tune, "usable_cpus", lambda: 1)  # estimated here, where the set is, not in the workers
    # One method: tune estimates every setting before its search, whatever the methods.
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "4", "--devices", "4",
                             "--recompute-modules", "layernorm", "-s", "1f1b")
    assert code == 0, err
    assert estimated == {("none", ("layernorm",)), ("selective", ("layernorm",)), ("full", ())}


def test_the_costs_line_names_the_recomputed_modules_only_where_given():
    args = ("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "-p", "2")
    code, out, err = pipesim(*args)
    assert code == 0 and "recompute modules" not in " ".join(out.split()), err
    code, out, err = pipesim(*args, "--recompute-modules", "layernorm,mlp")
    assert code == 0 and "recompute modules layernorm,mlp" in " ".join(out.split()), err


def _block_saves(layer, kind: str) -> list[tuple[tuple[int, ...], int]]:
    return [layer.saved_tensors[i] for i in layer.region_saves[kind]]


def test_a_recomputed_mixture_of_experts_drops_all_it_saved_keeps_its_input_and_reruns_its_forward():
    """moe (Megatron-core's MoELayer forward under tensor_parallel.checkpoint): every tensor the block's router,
    permutations, experts and combine saved is dropped; the pre-MLP norm's output it reads stays saved (the router
    saved it), and the backward reruns the block's forward ops, none of the attention's."""
    layer = ep_gpt_count().layers[1]
    dropped = set(layer.region_saves["moe"])
    norm_output = [i for _, _, _, made_by, i in layer.region_inputs["moe"] if "layernorm" in made_by]
    assert len(norm_output) == 1 and norm_output[0] not in dropped and norm_output[0] in layer.region_saves["layernorm"]
    assert set(layer.region_saves["moe_act"]) < dropped
    assert not dropped & set(layer.region_saves["attention_out"])
    assert priced(layer).activation_bytes - priced(layer, "moe").activation_bytes == \
        sum(layer.saved_tensors[i][1] for i in dropped)
    rerun = layer.region_ops["moe"]
    assert {op.kind for op in rerun} == {"matmul", "memory"} and any(op.routed for op in rerun)
    assert rerun[0].kind == "matmul" and not rerun[0].routed  # the router's product first
    assert priced(layer, "moe").bwd_ms - priced(layer).bwd_ms == pytest.approx(
        sum(ms for _, ms in priced(layer, "moe").timed_ops["bwd"][:len(rerun)]))
    assert [op for op, _ in priced(layer, "moe").timed_ops["bwd"][:len(rerun)]] == list(rerun)


def test_a_recomputed_dense_mlp_drops_its_activation_and_product_inputs_and_keeps_the_norms_output():
    """mlp (a dense layer's MLP under a plain checkpoint): a GPT block's GELU input and output, which it and the
    down product saved, are dropped; the norm's output, which the up product saved, is kept."""
    layer = gpt().layers[1]
    ffn = 4 * H
    assert _block_saves(layer, "mlp") == [((B, S, ffn), TOKENS * ffn * 2), ((TOKENS, ffn), TOKENS * ffn * 2)]
    [(_, _, _, made_by, saved)] = layer.region_inputs["mlp"]
    assert "layernorm" in made_by and saved in layer.region_saves["layernorm"]
    assert priced(layer).activation_bytes - priced(layer, "mlp").activation_bytes == 2 * TOKENS * ffn * 2
    assert priced(layer, "mlp").bwd_ms > priced(layer).bwd_ms


class _Gate(nn.Module):
    """A module marked as a plain checkpoint's MLP whose output the product after it saves (x · mlp(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        setattr(self.mlp, CHECKPOINT_REGION, "mlp")
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x * self.mlp(x))


def test_a_plain_checkpoint_keeps_its_output_where_an_op_after_it_saved_it():
    """tensor_parallel.checkpoint saves its inputs and returns its output as any module does: a product after it
    that saves the output keeps it, and is not rerun. Only what was saved inside the module is dropped; an
    output-discarding checkpoint's region (a norm's) would drop its output too."""
    with torch.device("meta"):
        layers = [nn.Linear(H, H), _Gate()]
    model = Model("gated-output", layers, lambda n, gen: (torch.randn(n, H, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    layer = count_model(model, TOKENS, torch.bfloat16).layers[1]
    assert _block_saves(layer, "mlp") == [((TOKENS, 4 * H), TOKENS * 4 * H * 2)] * 2  # GELU's input and output
    output = max(layer.region_allocations["mlp"])  # the MLP's last made: its output, saved by the multiplication
    assert output in layer.saved_allocations
    assert [op.op for op in layer.region_ops["mlp"]] == ["addmm", "gelu", "addmm"]  # not the multiplication after


def test_recomputing_the_experts_whole_reruns_their_all_to_alls_and_the_dispatchers_wait():
    """With the block recomputed, the backward runs its dispatch and combine again before its own two exchanges
    (planning/estimate.py `reruns_dispatch`), and a dropless dispatcher's wait for the tokens each expert receives
    with them: the backward's issue waits for the GPU, as only the forward's did; as under full recomputation."""
    parallel = Parallelism(expert=4, data=4)
    plain = estimate_profile(ep_gpt_count(), H100, parallel).layers[1]
    rerun = estimate_profile(ep_gpt_count(), H100, replace(parallel, recompute_modules=("moe",))).layers[1]
    assert plain.all_to_all_bwd_ms > 0 and rerun.all_to_all_fwd_ms == plain.all_to_all_fwd_ms
    assert rerun.all_to_all_bwd_ms == pytest.approx(2 * plain.all_to_all_bwd_ms)
    assert plain.host_issue["fwd"].synchronises and rerun.host_issue["fwd"].synchronises
    assert not plain.host_issue["bwd"].synchronises and rerun.host_issue["bwd"].synchronises
    assert not rerun.host_issue["wgrad"].synchronises
    full = estimate_profile(ep_gpt_count(), H100, replace(parallel, recompute="full")).layers[1]
    assert full.all_to_all_bwd_ms == pytest.approx(rerun.all_to_all_bwd_ms) and full.host_issue["bwd"].synchronises


def test_recompute_modules_a_model_lacks_or_moe_beside_the_expert_overlap_are_refused_in_one_line():
    """Each part must rerun something: one the model has no module of, or whose modules its linears fuse away."""
    moe = ("--model", "gpt", "--layers", "2", "--experts", "4", "--gpu", "h100-sxm", "-p", "2")
    for args, message in (
            (("--model", "gpt", "--layers", "2", "--gpu", "h100-sxm", "-p", "2", "--recompute-modules", "moe"),
             "--recompute-modules moe: no layer of the model has a mixture of experts to recompute"),
            ((*moe, "--recompute-modules", "layernorm,mlp"),
             "--recompute-modules mlp: no layer of the model has a dense MLP to recompute"),
            ((*moe, "--expert-parallel", "2", "--data-parallel", "2", "--overlap-expert-comm",
              "--recompute-modules", "moe"), "--recompute-modules moe reruns each mixture of experts whole"),
            # a dense model's norms, each fused into the linear after it: Megatron-core reruns none, silently
            (("--model", "gpt", "--layers", "2", "--gpu", "h100-sxm", "-p", "2", "--linear-kernel", "te",
              "--recompute-modules", "layernorm"), "--recompute-modules layernorm: under TransformerEngine's layers "
                                                   "(--linear-kernel te) no layer"),
            # the recipe's layers, --linear-kernel not given (eager would be refused beside it): leave it out
            (("--model", "gpt", "--layers", "2", "--gpu", "h100-sxm", "-p", "2", "--dtype", "fp8", "--fp8-recipe",
              "te", "--recompute-modules", "layernorm"),
             "(those --fp8-recipe te runs) no layer of the model has a norm of its own to recompute")):
        code, out, err = pipesim("simulate", *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out, err


@needs_transformers
def test_a_hugging_face_layers_dense_mlp_and_mixture_of_experts_are_their_regions():
    """DeepSeek's first layer's dense MLP is "mlp"; its MoE layer is "moe" whole, its shared expert inside it, so
    not an "mlp" of its own."""
    dense, routed = deepseek().layers[1:3]
    assert "mlp" in dense.region_ops and "moe" not in dense.region_ops
    assert "moe" in routed.region_ops and "mlp" not in routed.region_ops
    assert any(op.gating for op in routed.region_ops["moe"]) and any(op.routed for op in routed.region_ops["moe"])
    assert sum(op.flops * op.count for op in routed.region_ops["moe"]) > \
        sum(op.flops * op.count for op in routed.region_ops["moe_act"])


@needs_transformers
def test_a_recomputed_shared_expert_drops_what_it_saved_and_reruns_its_mlp_alone():
    """shared_experts (Megatron-core's SharedExpertMLP under a plain checkpoint, the Model Zoo's Qwen3-Next run's
    `--recompute-modules moe_act shared_experts layernorm`): what DeepSeek's shared expert saved is dropped, none
    of what the router or the routed experts saved; the backward reruns its products and activation, none routed,
    first; a model with no shared expert is refused it in one line."""
    layer = deepseek().layers[2]
    dropped = set(layer.region_saves["shared_experts"])
    assert dropped and dropped < set(layer.region_saves["moe"]) and not dropped & set(layer.region_saves["moe_act"])
    assert priced(layer).activation_bytes - priced(layer, "shared_experts").activation_bytes == \
        sum(layer.saved_tensors[i][1] for i in dropped)
    rerun = layer.region_ops["shared_experts"]
    assert [(op.kind, op.count) for op in rerun] == [("matmul", 2), ("memory", 1), ("matmul", 1)]  # gate, up; down
    assert not any(op.routed for op in rerun)
    assert [op for op, _ in priced(layer, "shared_experts").timed_ops["bwd"][:len(rerun)]] == list(rerun)
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--experts", "4", "--gpu", "h100-sxm",
                             "-p", "2", "--recompute-modules", "shared_experts")
    assert (code, out) == (2, "") and err.strip() == ("error: --recompute-modules shared_experts: no layer of the "
                                                      "model has a shared expert to recompute; leave it out"), err


def _norm_saves(layer, region: str) -> int:
    return sum(layer.saved_tensors[i][1] for i in layer.region_saves.get(region, ()))


@pytest.mark.parametrize("experts", [None, 4])
def test_layernorm_reruns_the_norms_megatron_core_holds_as_modules_of_their_own(experts):
    """Megatron-core recomputes a transformer layer's input and pre-MLP norms where they are not an IdentityOp:
    under its local layers both, under TransformerEngine's only a mixture of experts' pre-MLP norm (a TENorm its
    router reads), the others being fused into linear_qkv and linear_fc1 (TELayerNormColumnParallelLinear)."""
    layer = count_built("gpt", dict(layers=1, width=H, heads=4, seq_len=S, vocab=100, experts=experts), B,
                        torch.bfloat16, "flash").layers[1]
    both, pre_mlp = set(layer.region_saves["block_norm"]), set(layer.region_saves.get("separate_norm", ()))
    assert both == set(layer.region_saves["layernorm"]) and pre_mlp < both
    assert len(pre_mlp) == (3 if experts else 0)  # the pre-MLP norm's output and statistics
    plain = priced(layer).activation_bytes
    for linear_kernel, dropped in (("eager", both), ("te", pre_mlp)):
        parallel = Parallelism(recompute_modules=("layernorm",), linear_kernel=linear_kernel)
        assert plain - estimate_layer(layer, DEVICE, parallel, None, 2).activation_bytes == sum(
            layer.saved_tensors[i][1] for i in dropped), linear_kernel


@needs_transformers
def test_a_query_or_key_norm_is_not_a_layers_own_and_a_hybrids_moe_layer_alone_keeps_its_norm_apart(tmp_path):
    """Qwen3's q_norm and k_norm run inside its attention: not an input or pre-MLP norm, which "layernorm" alone
    reruns. Of Nemotron-H's layers' own norms only the MoE layer's is one of its own under TransformerEngine's
    layers; the Mamba-2 and attention layers' are fused into in_proj and linear_qkv (mamba_layer_specs.py)."""
    from tests.helpers import QWEN3_MOE, count_config
    from tests.test_mamba import HYBRID

    qwen = count_config(tmp_path / "qwen", QWEN3_MOE, "flash").layers[1]
    assert _norm_saves(qwen, "layernorm") > _norm_saves(qwen, "block_norm") > _norm_saves(qwen, "separate_norm") > 0
    hybrid = count_config(tmp_path / "hybrid", HYBRID, "flash").layers[1:5]  # M, *, -, E
    assert all(layer.region_saves["block_norm"] for layer in hybrid)
    assert [bool(layer.region_saves.get("separate_norm")) for layer in hybrid] == [False, False, False, True]


def test_under_transformer_engines_layers_a_recomputed_dense_mlp_takes_its_norm_with_it():
    """Megatron-core's TransformerEngine dense layer fuses its pre-MLP norm into linear_fc1, inside the MLP's
    checkpoint: "mlp" drops the norm's output and statistics too. Under torch's linears the norm is a module before
    the MLP's, whose output the checkpoint keeps."""
    layer = gpt().layers[1]
    pre_mlp = set(layer.region_saves["mlp_norm"])
    assert len(pre_mlp) == 3 and pre_mlp < set(layer.region_saves["block_norm"])
    plain = priced(layer).activation_bytes
    for linear_kernel, dropped in (("eager", set(layer.region_saves["mlp"])),
                                   ("te", set(layer.region_saves["mlp"]) | pre_mlp)):
        parallel = Parallelism(recompute_modules=("mlp",), linear_kernel=linear_kernel)
        assert plain - estimate_layer(layer, DEVICE, parallel, None, 2).activation_bytes == sum(
            layer.saved_tensors[i][1] for i in dropped), linear_kernel


class _PostNormBlock(nn.Module):
    """An input norm before a product and a post-norm (Gemma's) on the product's output before the residual add, both
    its own norms."""

    def __init__(self, marked: bool) -> None:
        super().__init__()
        self.norm, self.proj, self.post_norm = nn.LayerNorm(H), nn.Linear(H, H), nn.LayerNorm(H)
        for own in (self.norm, self.post_norm) if marked else ():
            setattr(own, BLOCK_NORM, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_norm(self.proj(self.norm(x)))


@pytest.mark.parametrize("marked", [True, False])
def test_a_post_norm_is_no_input_or_pre_mlp_norm_and_a_model_marking_none_has_each_its_own(marked):
    """"layernorm" reruns the norms a product reads (an input or pre-MLP norm), not a post-norm the residual add
    reads; a model that marks none of its norms a layer's own (one of the user's) has each one its own, so its input
    norm is rerun all the same."""
    with torch.device("meta"):
        layers = [nn.Linear(H, H), _PostNormBlock(marked)]
    model = Model("post-norm", layers, lambda n, gen: (torch.randn(n, H, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    layer = count_model(model, TOKENS, torch.bfloat16).layers[1]
    assert len(layer.region_saves["layernorm"]) > len(layer.region_saves["block_norm"]) > 0
    assert priced(layer, "layernorm").activation_bytes < priced(layer).activation_bytes


def test_tune_prints_no_recomputed_modules_beside_the_whole_layers_it_chose():
    """tune tries --recompute full without --recompute-modules (full keeps each layer's input alone), so a choice of
    full prints a simulate command without them, which simulate runs: with them it refuses the pair."""
    args = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "4", "--experts", "4", "--recompute-modules", "moe")
    code, out, err = pipesim("tune", *args, "--devices", "2", "--memory-gb", "0.0907")
    assert code == 0, err
    command = " ".join(out.split("the choice, as simulate gives it:")[1].split("searched")[0].split())
    assert "--recompute full" in command and "--recompute-modules" not in command
    code, _, err = pipesim(*shlex.split(command.replace("\\", ""))[1:])
    assert code == 0, err
