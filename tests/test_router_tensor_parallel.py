"""A mixture of experts' router, a model's norms, its row-parallel linears' biases and its learned position embedding
under tensor parallelism, as Megatron-core runs them: their weights whole on every rank; the router's gating product
on the rank's tokens (1/t under sequence parallelism, all of them without), no reduction of its input gradient;
their gradients all-reduced over the t ranks once a step under sequence parallelism, the position embedding's aside
(planning/estimate.py `_weight_splits`, `_Split._replicated_at`, `replicated_share`, `replicated_reduce_ms`). The
count marks the router (workload/moe.py `routing`): the gpt's `--experts` one, which reads the norm's output, and a
Hugging Face model's `gate`, which reads a float32 cast of it; and the norms', the biases' and the position
embedding's bytes (`LayerCount.norm_param_bytes`, `weight_grad_bias_bytes`, `position_embedding_bytes`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.planning import estimate
from pipesim.planning.estimate import Parallelism, _Split, estimate_layer, estimate_profile, placement_links
from pipesim.profiles.workload import weighted_products
from tests.conftest import needs_transformers
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE

torch = pytest.importorskip("torch")

B, S, H, EXPERTS, TOP_K, E = 2, 32, 64, 6, 2, 2  # micro-batch, sequence, width, routed experts, top k, bf16 bytes
TOKENS, T = B * S, 2
ROUTER = (1, TOKENS, EXPERTS, H)  # its forward product: the tokens' scores, one per routed expert
QWEN3 = {"model_type": "qwen3_moe", "hidden_size": H, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "vocab_size": 100, "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def gpt_moe():
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=1, width=H, heads=4, seq_len=S, vocab=100, experts=EXPERTS, top_k=TOP_K),
                       B, torch.bfloat16, "flash")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from pipesim.workload.count import count_built

    folder = tmp_path_factory.mktemp("qwen3")
    (folder / "config.json").write_text(json.dumps(QWEN3))
    return count_built(f"hf:{folder}", {"seq_len": S}, B, torch.bfloat16, "flash")


@pytest.fixture(params=["gpt", pytest.param("qwen3", marks=needs_transformers)])
def counted(request):
    return request.getfixturevalue({"gpt": "gpt_moe", "qwen3": "qwen3_moe"}[request.param])


@pytest.fixture
def layer(counted):
    return counted.layers[1]


def test_the_count_marks_the_router_alone(layer):
    marked = [shape for (shape, _, _), router in zip(layer.weight_grad_outputs, layer.weight_grad_router) if router]
    assert marked == [ROUTER]


@pytest.mark.parametrize("sequence_parallel, runtime, tokens", [
    (True, "megatron", TOKENS // T), (False, "megatron", TOKENS), (True, "torch", TOKENS), (False, "torch", TOKENS)])
def test_the_routers_products_run_on_the_ranks_tokens_whole_and_reduce_nothing(layer, sequence_parallel, runtime,
                                                                               tokens):
    """Forward (tokens, experts, width), input gradient (tokens, width, experts), weight gradient (experts, width,
    tokens): the experts and the width whole, the tokens the rank's (under torch the gathered input's, all)."""
    split = _Split.of(layer, Parallelism(tensor=T, sequence_parallel=sequence_parallel, tp_runtime=runtime))
    shapes = {"fwd": (1, tokens, EXPERTS, H), "igrad": (1, tokens, H, EXPERTS), "wgrad": (1, EXPERTS, H, tokens)}
    whole = {"fwd": ROUTER, "igrad": (1, TOKENS, H, EXPERTS), "wgrad": (1, EXPERTS, H, TOKENS)}
    for name, shape in whole.items():
        [op] = [op for op in layer.ops[name] if op.kind == "matmul" and op.shape == shape]
        [(mine, reduction, share)] = split.products(op, name)
        assert (mine.shape, reduction, share) == (shapes[name], None, 1.0)
        assert mine.flops == op.flops * tokens // TOKENS


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_routers_input_gradient_adds_no_reduction(layer, tensor_reductions, sequence_parallel):
    """Each backward (the full one, the input-gradient pass) reduces once less than the router split as a linear
    layer (column-parallel by its input, or by its shape) would: the count without its router marked."""
    parallel = Parallelism(tensor=T, sequence_parallel=sequence_parallel)
    counts = []
    for priced in (layer, replace(layer, weight_grad_router=())):
        tensor_reductions.clear()
        estimate_layer(priced, DEVICE, parallel, placement_links(H100, parallel).tensor, E)
        counts.append(len(tensor_reductions))
    assert counts[0] == counts[1] - 2


def test_a_rank_holds_the_routers_weight_whole(counted):
    """The MoE layer's weights, gradients and optimizer state on one of t = 2 ranks: 1/t of the rest, all of the
    router's (experts x width), of its norms' and of its row-parallel biases'
    (`test_a_rank_holds_the_norms_and_row_parallel_biases_whole`)."""
    router = EXPERTS * H * E + counted.layers[1].norm_param_bytes + estimate._row_bias_bytes(counted.layers[1])
    whole, split = (estimate_profile(counted, H100, Parallelism(tensor=t, sequence_parallel=True)).layers[1]
                    for t in (1, T))
    assert split.param_bytes == (whole.param_bytes - router) // T + router
    assert split.grad_bytes == (whole.grad_bytes - 2 * router) // T + 2 * router  # float32 main gradients
    assert split.optimizer_state_bytes["adam"] == (whole.optimizer_state_bytes["adam"] - 6 * router) // T + 6 * router


@pytest.mark.parametrize("sequence_parallel, runtime, reduced", [
    (True, "megatron", True), (False, "megatron", False), (True, "torch", False)])
def test_the_routers_gradient_is_all_reduced_over_the_ranks_once_a_step_under_sequence_parallelism(
        gpt_moe, tensor_reductions, sequence_parallel, runtime, reduced):
    """Megatron-core's finalize_model_grads all-reduces a `sequence_parallel` parameter's main gradient (float32:
    the router's, experts x width, every norm's and the attention's output projection's bias) over the
    tensor-parallel group, not the position embedding's, whole on each rank; without sequence parallelism every rank
    saw every token."""
    estimate.replicated_reduce_ms(gpt_moe.layers, Parallelism(tensor=T, sequence_parallel=sequence_parallel,
                                                              tp_runtime=runtime),
                                  Parallelism().held(gpt_moe.dtype), E, placement_links(H100, Parallelism()).tensor)
    norms = 3 * 2 * H  # a LayerNorm's scale and shift: the block's two, the head's final one
    assert tensor_reductions == ([((EXPERTS * H + norms + H) * 4, T)] if reduced else [])


@pytest.fixture(scope="module")
def gpt_dense():
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=1, width=H, heads=4, seq_len=S, vocab=100), B, torch.bfloat16, "flash")


def test_the_count_marks_the_norms_weights(gpt_dense):
    """A LayerNorm's scale and shift (the gpt's): the embedding none, each block two of the width, the head its
    final one; no query or key norm."""
    assert [layer.norm_param_bytes for layer in gpt_dense.layers] == [0, 2 * 2 * H * E, 2 * H * E]
    assert not any(layer.qk_norm_param_bytes for layer in gpt_dense.layers)


def test_the_count_marks_the_biases_and_the_learned_position_embedding(gpt_dense):
    """Per product, its linear's bias (q, k and v's, the attention output's, the MLP's up and down; the head none);
    the embedding's positions table, seq x width, its position embedding; of the biases the row-parallel ones, the
    attention output's and the MLP down projection's, width each."""
    assert [layer.weight_grad_bias_bytes for layer in gpt_dense.layers] == [
        (), (3 * H * E, H * E, 4 * H * E, H * E), (0,)]
    assert [layer.position_embedding_bytes for layer in gpt_dense.layers] == [S * H * E, 0, 0]
    assert [estimate._row_bias_bytes(layer) for layer in gpt_dense.layers] == [0, 2 * H * E, 0]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_rank_holds_the_position_embedding_whole_and_reduces_none_of_it(gpt_dense, tensor_reductions,
                                                                          sequence_parallel):
    """Megatron-core's LanguageModelEmbedding holds its position embedding as a plain Embedding, whole on each rank,
    the word embedding 1/t (VocabParallelEmbedding); the position embedding is added before the scatter to the
    sequence-parallel region, so each rank's gradient is whole and finalize_model_grads all-reduces none of it: the
    step's tensor all-reduce moves the norms' and the row-parallel biases' main gradients alone."""
    parallel = Parallelism(tensor=T, sequence_parallel=sequence_parallel)
    positions = gpt_dense.layers[0].position_embedding_bytes
    whole, split = (estimate_profile(gpt_dense, H100, replace(parallel, tensor=t)).layers[0] for t in (1, T))
    assert split.param_bytes == (whole.param_bytes - positions) // T + positions
    tensor_reductions.clear()  # the profiles' own
    estimate.replicated_reduce_ms(gpt_dense.layers, parallel, Parallelism().held(gpt_dense.dtype), E,
                                  placement_links(H100, Parallelism()).tensor)
    norms, biases = 3 * 2 * H, 2 * H
    assert tensor_reductions == ([((norms + biases) * 4, T)] if sequence_parallel else [])


@needs_transformers
def test_the_count_marks_an_rms_norms_weights_and_the_query_and_key_norms(qwen3_moe):
    """An RMSNorm's scale (Qwen3's, its q and k norms' of a head's width among them): the embedding none, each
    block two of the width, the head its final one."""
    assert [layer.norm_param_bytes for layer in qwen3_moe.layers] == [0, (2 * H + 2 * 16) * E, H * E, 0]
    assert [layer.qk_norm_param_bytes for layer in qwen3_moe.layers] == [0, 2 * 16 * E, 0, 0]


@needs_transformers
@pytest.mark.parametrize("sequence_parallel, runtime", [(False, "megatron"), (True, "megatron"), (False, "torch")])
def test_the_query_and_key_norms_gradients_are_all_reduced_even_without_sequence_parallelism(
        qwen3_moe, tensor_reductions, sequence_parallel, runtime):
    """Qwen3's q and k norms (a head's width each) normalise each rank's own heads, so Megatron-core all-reduces
    their main gradients (float32) over the t ranks whatever sequence parallelism (finalize_model_grads.py
    `_allreduce_non_tensor_model_parallel_grads`, its `qk_layernorm` branch), those alone without it, among every
    norm's and the router's with it; torch's tensor parallelism none."""
    estimate.replicated_reduce_ms(qwen3_moe.layers, Parallelism(tensor=T, sequence_parallel=sequence_parallel,
                                                                tp_runtime=runtime),
                                  Parallelism().held(qwen3_moe.dtype), E, placement_links(H100, Parallelism()).tensor)
    qk_norms = 2 * 16
    every = EXPERTS * H + 2 * H + qk_norms + H  # the router, the block's two norms and its q and k's, the final norm
    assert tensor_reductions == {(False, "megatron"): [(qk_norms * 4, T)], (True, "megatron"): [(every * 4, T)],
                                 (False, "torch"): []}[sequence_parallel, runtime]


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_rank_holds_the_norms_and_row_parallel_biases_whole(gpt_dense, runtime, sequence_parallel):
    """Megatron-core's norms (TransformerEngine's LayerNormLinear's too) and torchtitan's, and RowParallelLinear's
    and RowwiseParallel's biases, are whole on each of the t ranks: a dense block's weights, gradients and optimizer
    state 1/t of the rest, all of its two norms' and of its attention output's and MLP down projection's biases."""
    norms = gpt_dense.layers[1].norm_param_bytes + 2 * H * E
    whole, split = (estimate_profile(gpt_dense, H100, Parallelism(tensor=t, sequence_parallel=sequence_parallel,
                                                                  tp_runtime=runtime)).layers[1] for t in (1, T))
    assert split.param_bytes == (whole.param_bytes - norms) // T + norms
    assert split.grad_bytes == (whole.grad_bytes - 2 * norms) // T + 2 * norms
    assert split.optimizer_state_bytes["adam"] == (whole.optimizer_state_bytes["adam"] - 6 * norms) // T + 6 * norms


QWEN2 = {**{k: v for k, v in QWEN3.items() if k != "head_dim"}, "model_type": "qwen2_moe",
         "shared_expert_intermediate_size": 64}


@needs_transformers
def test_a_shared_experts_gate_is_held_as_the_router(tmp_path):
    """Qwen2-MoE's shared_expert_gate, a Linear(width, 1) that reads the norm's output with the shared expert's gate
    and up, is replicated as Megatron-core's SharedExpertMLP `gate_weight` is, not column-parallel: its weight
    whole on each rank, its products on the rank's tokens."""
    from pipesim.workload.count import count_built

    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    layer = count_built(f"hf:{tmp_path}", {"seq_len": S}, B, torch.bfloat16, "flash").layers[1]
    marked = [shape for (shape, _, _), router in zip(layer.weight_grad_outputs, layer.weight_grad_router) if router]
    assert marked == [(1, TOKENS, 1, H), ROUTER]  # the shared expert, its gate inside, before the router
    split = _Split.of(layer, Parallelism(tensor=T, sequence_parallel=True))
    assert [split.weights[j] for j, router in enumerate(layer.weight_grad_router) if router] == ["replicated"] * 2
    assert (estimate.replicated_share(layer, E, "megatron") * layer.param_bytes
            == (EXPERTS + 1) * H * E + layer.norm_param_bytes)


@pytest.mark.parametrize("sequence_parallel, runtime, tokens", [
    (True, "megatron", TOKENS // T), (False, "megatron", TOKENS), (True, "torch", TOKENS), (False, "torch", TOKENS)])
def test_a_rank_holds_the_routers_outputs_as_its_products_write_them(layer, sequence_parallel, runtime, tokens):
    """What a rank's pass makes of the router's products (`_rank_pass`): its scores (tokens x experts) and its
    input's gradient (tokens x width) of the rank's tokens, all of them without sequence parallelism and under
    torch, not 1/t as a tensor of the scores' shape otherwise is; its weight's gradient (experts x width) whole."""
    split = _Split.of(layer, Parallelism(tensor=T, sequence_parallel=sequence_parallel, tp_runtime=runtime))
    for name, role, share in (("fwd", "output", tokens / TOKENS), ("bwd", "input", tokens / TOKENS),
                              ("bwd", "weight", 1.0)):
        [number] = [number for number, (j, how, of) in weighted_products(layer, split.weights, name).items()
                    if how == "replicated" and of == role]
        made = {n: nbytes for n, _, nbytes, _ in layer.allocations[name] if nbytes > 0}
        on_rank = {n: nbytes for n, nbytes in estimate._rank_pass(layer, split, name, E) if nbytes > 0}
        assert on_rank[number] == made[number] * share


def test_a_deferred_weight_pass_keeps_nothing_of_the_router(counted):
    """Megatron-core's router makes its weight gradient in B (a plain Parameter through F.linear, not the zero-bubble
    fork's WeightGradStore): a deferred W keeps neither its output gradient nor the input only it saves (the norm's
    output, tokens x width), and the replay holds no storage of it until W."""
    layer = counted.layers[1]
    [i] = layer.router_input_saves
    assert layer.saved_tensors[i][1] == TOKENS * H * E
    inputs, gradients = estimate.wgrad_kept_tensors(layer, _Split.of(layer, Parallelism()), 1.0)
    assert gradients == tuple(nbytes for (_, nbytes, _), router in zip(layer.weight_grad_outputs,
                                                                       layer.weight_grad_router) if not router)
    assert sum(inputs) == sum(nbytes for j, ((_, nbytes), how) in enumerate(zip(layer.saved_tensors,
                                                                                 layer.linear_input_saves))
                              if how and j != i)
    reads = dict(layer.forward_reads)
    [scores] = [number for number, shape in layer.product_allocations["fwd"] if shape == ROUTER]
    read = set(reads[scores]) & set(layer.saved_allocations)
    kept = estimate.layer_allocations(counted, Parallelism())[1].wgrad_kept
    assert read and kept and not read & kept
