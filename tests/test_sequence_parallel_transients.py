"""Sequence parallelism's whole transients: a tensor-parallel product's partial sums before their reduce-scatter and
a row-parallel product's gathered output gradient (planning/estimate.py `_rank_pass`)."""

import json
import math

import pytest

from pipesim.planning.estimate import (
    Parallelism,
    estimate_layer,
    gathered_gradient_element_bytes,
    placement_links,
)
from pipesim.profiles.workload import transient_peak, weighted_products
from tests.conftest import needs_transformers, pipesim, reductions
from tests.helpers import H100, H100_BF16

B, S, W, HEADS, KV_HEADS, FFN = 2, 40, 64, 8, 2, 32
T = B * S  # 80 tokens: no product dimension equals another's (`separate_projections`, below: they do)
QKV = W + 2 * KV_HEADS * (W // HEADS)  # 96: q, k and v's fused output
SHAPE = ("--layers", 2, "--width", W, "--heads", HEADS, "--kv-heads", KV_HEADS, "--ffn", FFN, "--seq-len", S,
         "--vocab", 128, "-b", B, "--attention", "flash", "--dtype", "bf16")


@pytest.fixture(scope="module")
def block():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=2, width=W, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, seq_len=S,
                                      vocab=128), B, torch.bfloat16, "flash")
    return counted, counted.layers[1]


def test_the_count_marks_each_products_output_with_its_shape(block):
    _, layer = block
    made = dict((number, shape) for number, shape, nbytes, _ in layer.allocations["fwd"] if nbytes > 0)
    products = layer.product_allocations["fwd"]
    assert [shape for _, shape in products] == [(1, T, QKV, W), (1, T, W, W), (1, T, FFN, W), (1, T, W, FFN)]
    assert [made[number] for number, _ in products] == [(T, QKV), (T, W), (T, FFN), (T, W)]


def test_transient_peak_reads_the_live_storages_at_the_most_bytes():
    events = [(0, 4), (1, 8), (0, -4), (2, 2), (1, -8), (3, 16), (2, -2)]  # 3 outlives the pass
    assert transient_peak(events) == (0, 1)  # 12 bytes
    assert transient_peak(events, beside_kept=True) == (2,)  # 3 and 2 live: 18 bytes, 3 kept


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_a_t2_sequence_parallel_blocks_backward_holds_its_partial_sums_and_gathered_gradient_whole(tmp_path, runtime):
    """t = 2 with sequence parallelism, both runtimes, bf16 (2 bytes an element); whole, tokens x width is 10,240
    bytes. The full backward's peak is at q, k and v's input-gradient product: the residual stream's gradient, 1/t
    (5,120), the q, k, v gradients concatenated, 1/t (T x 96: 7,680), and the product's partial sums whole before
    their reduce-scatter (10,240): 23,040, where every tensor 1/t was 20,480 (the count's 40,960 halved). The
    weight-gradient pass's is at the attention output projection's weight gradient: the residual gradient (5,120),
    that product's output gradient gathered whole (10,240) and its input gradient, the heads' half (5,120): 20,480,
    against 15,360. The forward's: the MLP's second product's output whole before its reduce-scatter (10,240).
    Each reduce-scatter's output, 1/t (5,120), is made while its partial sums live (Megatron-core's torch.empty
    before `_reduce_scatter_base`, `sub_grad_input` in the backward; torch's `allocate_reduce_scatter_output`):
    the backward's peak holds q, k and v's beside their partial sums (28,160); the forward's, under Megatron-core,
    the MLP's ties the residual sum the count makes next while the partial sums are held whole (10,240 either way).
    Under torch each peak holds one whole copy more, made beside its collective and freed right after
    (`Parallelism.collective_copies`: funcol's chunk-and-cat, eager without async TP): beside the MLP's and q, k
    and v's partial sums their concatenation on the first dimension, which the reduce-scatter reads, and the
    output beside it; in the weight-gradient pass the all-gather's output beside the gathered gradient's
    concatenation on the sequence."""
    whole = T * W * 2
    copy = whole if runtime == "torch" else 0
    scattered = copy + whole // 2
    code, _, err = pipesim("estimate", "--model", "gpt", *SHAPE, "--gpu", "h100-sxm", "--tensor-parallel", 2,
                           "--sequence-parallel", "--tp-runtime", runtime, "--out", tmp_path / "e.json")
    assert code == 0, err
    layer = json.loads((tmp_path / "e.json").read_text())["layers"][1]
    backward = whole // 2 + T * QKV + whole + scattered
    assert layer["transient_bytes"] == {"fwd": whole + (scattered if copy else 0), "bwd": backward,
                                        "igrad": backward, "wgrad": 2 * whole + copy}


def test_without_sequence_parallelism_the_peak_is_the_ranks_own(block):
    """t = 1 is the count's peak; t = 2 without sequence parallelism keeps the residual stream whole and the rest
    1/t, and its peak is that of the rank's tensors so sized, here 30,720 bytes, not the count's peak tensors so
    sized (25,600): halving some tensors and not others moves the moment of the most bytes live."""
    _, layer = block
    device = H100_BF16
    link = placement_links(H100, Parallelism(tensor=2)).tensor
    one = estimate_layer(layer, device, Parallelism(), link, 2).transient_bytes
    assert one["bwd"] == sum(nbytes for _, nbytes in layer.transient_tensors["bwd"])
    two = estimate_layer(layer, device, Parallelism(tensor=2), link, 2).transient_bytes
    halved = {number: nbytes if shape[-1] == W and math.prod(shape) == T * W else nbytes // 2
              for number, shape, nbytes, _ in layer.allocations["bwd"] if nbytes > 0}
    events = [(number, halved[number] if nbytes > 0 else -halved[number])
              for number, _, nbytes, _ in layer.allocations["bwd"]]
    assert two["bwd"] == sum(halved[number] for number in transient_peak(events)) == 30720
    assert sum(nbytes if shape[-1] == W and math.prod(shape) == T * W else nbytes // 2
               for shape, nbytes in layer.transient_tensors["bwd"]) == 25600


def _weight_roles(layer) -> dict[int, tuple[int, str]]:
    """The backward's products that belong to a product with weights: number -> (index, "input" or "weight")."""
    return {number: (j, role) for number, (j, _, role) in weighted_products(layer, {}, "bwd").items()}


def replayed_backward(counted, parallel: Parallelism) -> tuple[list[tuple[int, int]], list[int]]:
    """The first block's backward as the allocator replays it on a rank (`layer_allocations`): its (storage, bytes)
    events, and the bytes of those the count never made (the rank's own: its gathers and its collectives' copies)."""
    from pipesim.planning.estimate import layer_allocations

    backward = layer_allocations(counted, parallel)[1].passes["bwd"]
    numbered = {number for number, *_ in counted.layers[1].allocations["bwd"]}
    return backward, [nbytes for number, nbytes in backward if number not in numbered]


def test_the_allocator_replays_the_gathered_gradients_whole(block):
    """The backward's replay (`layer_allocations`) under Megatron-core gathers each row-parallel product's output
    gradient whole, the MLP's second product's and the attention output projection's, made and freed around its two
    products; and beside each column-parallel input gradient, whole, the MLP's first product's and q, k and v's,
    `sub_grad_input`, 1/t, made before the reduce-scatter and freed after the weight gradient (core_v0.9.0
    `LinearWithGradAccumulationAndAsyncCommunication.backward`)."""
    counted, layer = block
    backward, gathers = replayed_backward(counted, Parallelism(tensor=2, sequence_parallel=True))
    assert gathers == [T * W * 2, -T * W * 2, T * W, -T * W] * 2
    numbered = {number for number, *_ in layer.allocations["bwd"]}
    outputs = [i for i, (number, nbytes) in enumerate(backward) if number not in numbered and nbytes == T * W]
    weights = {number for number, (_, role) in _weight_roles(layer).items() if role == "weight"}
    for i in outputs:
        freed = backward.index((backward[i][0], -T * W))
        assert backward[i - 1][1] == T * W * 2 and [number for number, nbytes in backward[i + 1:freed]
                                                    if nbytes > 0] == [backward[freed - 1][0]]
        assert backward[freed - 1][0] in weights


@pytest.mark.parametrize("fp8, runtime, element", [(None, "torch", 2), ("te", "megatron", 1),
                                                   ("torchao-2024", "torch", 1), ("torchao", "torch", 1),
                                                   ("torchao", "megatron", 2)])
def test_a_gathered_gradient_is_float8_where_the_runtime_casts_before_it_gathers(block, fp8, runtime, element):
    """TransformerEngine casts the output gradient before its gather; torchao's Float8RowwiseParallel (eab345c)
    casts it after the redistribute in the forward, so before the gather in the backward; plain bf16 otherwise.
    The head, no float8 layer, gathers bf16."""
    counted, layer = block
    parallel = Parallelism(tensor=2, sequence_parallel=True, tp_runtime=runtime, fp8=fp8)
    assert gathered_gradient_element_bytes(layer, parallel, 2) == element
    assert gathered_gradient_element_bytes(counted.layers[-1], parallel, 2) == 2


@pytest.fixture(scope="module")
def separate_projections(tmp_path_factory):
    """A Hugging Face Llama block, q, k, v and o separate and all width x width (as many kv heads as heads), whose
    tokens equal its width (2 x 24 = 48): every projection's input- and weight-gradient products are one shape."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "rope_theta": 10000.0}))
    return count_built(f"hf:{folder}", {"seq_len": 24}, 2, torch.bfloat16, "flash")


@needs_transformers
@pytest.mark.parametrize("fp8, runtime, element", [(None, "megatron", 2), (None, "torch", 2), ("te", "megatron", 1),
                                                   ("torchao", "torch", 1)])
def test_separate_projections_are_told_by_their_roles_not_their_shapes(separate_projections, fp8, runtime, element):
    """t = 2 with sequence parallelism, tokens = width = 48. Only o's and down's output gradients are gathered whole
    (48 x 48 x `element` bytes each, made before their weight- and input-gradient products and freed after), not q's,
    k's or v's, whose products have o's shape; and q's, k's and v's input gradients are partial sums whole before
    their one reduce-scatter, 48 x 48 x 2 = 4,608 bytes, beside their weight gradients' halves (2,304): under torch
    each (DTensor's Partial gradients, summed before it), under Megatron-core the first only (v's, the backward's
    first), the fused product's, the others halves. Under torch (eager, without async TP) each collective copies its
    whole tensor once more (`Parallelism.collective_copies`: funcol's chunk-and-cat), a copy beside it freed right
    after: the all-gather's output (`element` bytes: torchao's `float8_cat`) beside each gathered gradient, freed
    once that is concatenated, and the bf16 concatenation of gate's and up's (q's, k's and v's) summed input
    gradients, made once autograd frees what the sum read, with the reduce-scatter's output (half) beside it."""
    counted = separate_projections
    layer = counted.layers[1]
    parallel = Parallelism(tensor=2, sequence_parallel=True, tp_runtime=runtime, fp8=fp8)
    backward, gathers = replayed_backward(counted, parallel)
    gathered, summed = 48 * 48 * element, 48 * 48 * 2
    each = [gathered, gathered, -gathered, -gathered, summed, summed // 2, -summed, -summed // 2
            ] if runtime == "torch" else [gathered, -gathered, summed // 2, -summed // 2]
    assert gathers == each * 2  # down's and gate and up's, then o's and q, k and v's
    made = dict(reversed(backward))  # each number's first bytes: as made
    qkv = [number for number, _ in layer.product_allocations["bwd"][-6:]]  # v's, k's, q's weight and input gradients
    later = 48 * 48 * 2 if runtime == "torch" else 48 * 48
    assert [made[number] for number in qkv] == [48 * 48, 48 * 48 * 2, *[48 * 48, later] * 2]


@needs_transformers
@pytest.mark.parametrize("runtime, summed", [("megatron", 48 * 48), ("torch", 48 * 48 * 2)])
def test_autograds_sums_of_partial_gradients_are_whole_under_torch(separate_projections, runtime, summed):
    """t = 2 with sequence parallelism, tokens = width = 48: autograd sums the attention input's gradients, v's and
    k's, then q's, each sum a tensor of 48 x 48 x 2 = 4,608 bytes made right after k's (q's) input gradient: under
    torch a sum of DTensor's Partial gradients, whole on each rank until their one reduce-scatter; under
    Megatron-core, whose fused product writes no sum, the rank's half of the reduced gradient (2,304)."""
    layer = separate_projections.layers[1]
    parallel = Parallelism(tensor=2, sequence_parallel=True, tp_runtime=runtime)
    backward, _ = replayed_backward(separate_projections, parallel)
    made = dict(reversed(backward))
    inputs = [number for number, _ in layer.product_allocations["bwd"][-6:]][1::2]  # v's, k's, q's input gradients
    order = [number for number, _, nbytes, _ in layer.allocations["bwd"] if nbytes > 0]
    sums = [order[order.index(number) + 1] for number in inputs[1:]]
    assert [made[number] for number in sums] == [summed] * 2


@needs_transformers
def test_separate_projections_split_by_their_roles_not_their_shapes(separate_projections):
    """t = 2, tokens = width = 48, q, k, v and o one shape (48 x 48 x 48): q, k and v are column-parallel (split on
    their outputs, their input gradients on their contraction), o and down row-parallel (their forwards split on
    their contraction): two reductions in the forward, o's and down's, not five as the shape alone has it; five
    products split on their contraction in the input gradient, q's, k's, v's, gate's and up's, which reduce their
    summed gradients twice, once per shared input (`_Reduction`: the attention's 48 x 48 over q, k and v's 3 x 24
    outputs, the MLP's over gate's and up's 2 x 20); none in the weight gradient. Each pass's FLOPs halve."""
    from pipesim.planning.estimate import _Split

    layer = separate_projections.layers[1]
    split = _Split.of(layer, Parallelism(tensor=2))
    reduced, reduction_counts = {}, {}
    for name in ("fwd", "bwd", "igrad", "wgrad"):
        products = [op for op in layer.ops[name] if op.kind == "matmul" and op.shape[0] == 1]
        mine = [(op, split.products(op, name)) for op in products]
        assert sum(op.count * share * rank.flops for op, split_as in mine for rank, _, share in split_as) * 2 == \
            sum(op.count * op.flops for op in products)
        reduced[name] = sorted((rank.shape, op.count * share) for op, split_as in mine
                               for rank, reduction, share in split_as if reduction is not None)
        reduction_counts[name] = reductions(split, products, name)
    assert reduced["fwd"] == [((1, 48, 48, 20), 1.0), ((1, 48, 48, 24), 1.0)]  # down's, o's
    assert reduced["igrad"] == [((1, 48, 48, 20), 2.0), ((1, 48, 48, 24), 3.0)]  # gate's and up's; q's, k's, v's
    assert reduced["bwd"] == reduced["igrad"] and reduced["wgrad"] == []
    assert reduction_counts["fwd"] == {(1, 48, 48, 20): 1.0, (1, 48, 48, 24): 1.0}
    assert reduction_counts["igrad"] == {(1, 48, 48, 40): 1.0, (1, 48, 48, 72): 1.0}  # gate and up's; q, k and v's
    assert reduction_counts["bwd"] == reduction_counts["igrad"] and reduction_counts["wgrad"] == {}
