"""The workload counted on the meta device, held against closed forms: a linear layer's 2·b·i·o, Narayanan et
al.'s GPT block FLOPs, Korthikanti et al.'s activation bytes (differing by named terms only), parameter and
optimizer-state sizes."""

from __future__ import annotations

import json
import math
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipesim.sim.caching_allocator import left_live
from pipesim.workload.count import LayerCount, count_built, count_model
from pipesim.workload.models import Model, ModelError
from pipesim.workload.optim import OPTIMIZERS
from tests.conftest import pipesim

B, S, H, A = 2, 32, 64, 4  # micro-batch, sequence, hidden, heads of the small gpt
GPT = dict(layers=2, width=H, heads=A, seq_len=S, vocab=128)


@cache
def gpt_block(attention: str) -> LayerCount:
    """The small gpt's first block in fp16, counted once per test session."""
    return count_built("gpt", GPT, B, torch.float16, attention).layers[1]


def _linear_chain(inputs: int, outputs: int) -> Model:
    def batch(b: int, gen: torch.Generator):
        return torch.randn(b, inputs, generator=gen), None

    with torch.device("meta"):
        layers = [nn.Linear(inputs, outputs), nn.Linear(outputs, outputs)]
    return Model("linear", layers, batch, lambda out, target: out.float().square().mean())


@settings(max_examples=5, deadline=None)
@given(b=st.integers(1, 64), i=st.integers(1, 512), o=st.integers(1, 512))
def test_a_linear_layer_is_2bio_forward_and_twice_that_backward_split_evenly(b, i, o):
    first, second = count_model(_linear_chain(i, o), b, torch.float32).layers
    assert (second.fwd_flops, second.igrad_flops, second.wgrad_flops) == (2 * b * o * o,) * 3
    assert (first.fwd_flops, first.igrad_flops, first.wgrad_flops) == (2 * b * i * o, 0, 2 * b * i * o)  # no igrad
    assert first.output_shape == (b, o) and first.output_bytes == 4 * b * o and second.output_bytes == 0  # a loss
    assert first.param_bytes == first.grad_bytes == 4 * (i * o + o)


def test_memory_bound_ops_move_what_they_read_and_write_and_views_nothing():
    b, i, o = 3, 5, 7
    with torch.device("meta"):
        layers = [nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o)]
    model = Model("relu", layers, lambda n, gen: (torch.randn(n, i, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    first, relu, _ = count_model(model, b, torch.float32).layers
    activation = 4 * b * o
    assert (relu.fwd_moved_bytes, relu.igrad_moved_bytes, relu.wgrad_moved_bytes) == (
        2 * activation, 3 * activation, 0)  # relu reads x, writes y; its gradient reads dy and y, writes dx
    assert relu.saved_bytes == activation and relu.fwd_flops == 0
    assert first.fwd_moved_bytes == 0  # the product (FLOPs) and the views of its weight move nothing here
    assert first.wgrad_moved_bytes == activation + 4 * o  # the bias gradient: a sum over the batch


class _Rows(nn.Module):
    """Rows of its input by index: `repeats` copies of each of its first `rows`."""

    def __init__(self, rows: int, repeats: int) -> None:
        super().__init__()
        self.rows, self.repeats = rows, repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.arange(self.rows, device=x.device).repeat_interleave(self.repeats)]


@pytest.mark.parametrize(("rows", "repeats", "read_rows"), [(1, 1, 1), (8, 2, 8)])
def test_a_gather_by_index_reads_the_rows_it_indexes_at_most_its_whole_tensor(rows, repeats, read_rows):
    """aten `index` of 8 rows of 16 float32s: one row read where it takes one; the whole tensor once where it takes
    each row twice (the second read taken as cached); its int64 indices read and its output written either way."""
    with torch.device("meta"):
        layers = [nn.Linear(16, 16), _Rows(rows, repeats)]
    model = Model("rows", layers, lambda n, gen: (torch.randn(n, 16, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    gather = [op for op in count_model(model, 8, torch.float32).layers[1].ops["fwd"] if op.op == "index"]
    taken = rows * repeats
    assert [op.moved_bytes for op in gather] == [8 * taken + 4 * 16 * (read_rows + taken)]


class _ByIndex(nn.Module):
    """Of an 8 x 16 float32 input: one element a row gathered, two rows selected, one element a row scattered into
    zeros in place and one a row scatter-added out of place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        column = torch.zeros(8, 1, dtype=torch.long, device=x.device)
        gathered = torch.gather(x, 1, column)
        rows = torch.index_select(x, 0, torch.arange(2, device=x.device))
        ones = torch.zeros_like(x).scatter_(1, column, 1.0)
        return x.scatter_add(1, column, gathered) + ones + rows.sum()


def test_gathers_and_scatters_move_the_elements_they_index_not_the_whole_tensor():
    """By hand, for the 8 x 16 float32 input x (512 bytes) and an 8 x 1 int64 index (64 bytes): gather reads the
    index and one element a row and writes them (64 + 32 + 32); index_select of 2 rows reads 2 int64s and the
    rows and writes them (16 + 128 + 128); scatter_ of a value writes one element a row in place (64 + 32);
    out-of-place scatter_add copies x (512 read, 512 written), reads the index and one source element a row and
    reads and writes one element a row (64 + 32 + 2 x 32). The old figures read every input whole."""
    with torch.device("meta"):
        layers = [nn.Linear(16, 16), _ByIndex()]
    model = Model("by-index", layers, lambda n, gen: (torch.randn(n, 16, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    ops = {op.op: op.moved_bytes for op in count_model(model, 8, torch.float32).layers[1].ops["fwd"]}
    by_hand = {"gather": 64 + 32 + 32, "index_select": 16 + 128 + 128, "scatter_": 64 + 32,
               "scatter_add": 2 * 512 + 64 + 32 + 2 * 32}
    whole = {"gather": 512 + 64 + 32, "index_select": 512 + 16 + 128, "scatter_": 512 + 64 + 512,
             "scatter_add": 512 + 64 + 32 + 512}
    assert {name: ops[name] for name in by_hand} == by_hand
    assert all(ops[name] != whole[name] for name in whole)


def test_the_embedding_reads_the_rows_it_picks_and_its_backward_zeroes_the_whole_table():
    """By hand, the gpt's token table of 512 x 16 bf16s (16 KiB) over 2 x 8 int64 ids (T = 16 tokens, 128 bytes):
    the forward (Embedding.cpp `embedding`: `weight.index_select(0, ids)`) reads the ids and a row an id and writes
    them, 128 + 2 x 16 x 32; the backward (Embedding.cu `embedding_dense_backward_cuda`) reads the ids and the
    output's gradient, zeroes the table's gradient and adds each id's row into it (read and written), 128 + 512 +
    16 KiB + 2 x 512. The forward once read the whole table, 128 + 16 KiB + 512."""
    shape = dict(layers=1, width=16, heads=2, seq_len=8, vocab=512, rotary_percent=1.0)  # no position table
    embed = count_built("gpt", shape, 2, torch.bfloat16, "flash").layers[0]
    rows, table = 16 * 16 * 2, 512 * 16 * 2
    assert [(op.op, op.moved_bytes) for op in embed.ops["fwd"]] == [("embedding", 128 + 2 * rows)]
    assert [(op.op, op.moved_bytes) for op in embed.ops["bwd"]] == [("embedding_dense_backward",
                                                                      128 + rows + table + 2 * rows)]


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_gpt_block_forward_flops_are_narayanans_24bsh2_plus_4bs2h(attention):
    block = gpt_block(attention)
    linear, scores = 24 * B * S * H * H, 4 * B * S * S * H
    assert block.fwd_flops == linear + scores
    assert block.wgrad_flops == linear  # every weight's gradient is one product as large as its forward
    # the input gradient: each linear's once, attention's two products twice (math); flash also recomputes
    # the scores (torch counts its backward as 5 products of 4: 2.5x)
    assert block.igrad_flops == linear + (2 * scores if attention == "math" else 5 * scores // 2)


def test_gpt_block_saved_bytes_are_korthikantis_less_what_this_model_does_not_have():
    """Korthikanti et al. 2022, eq. 1, fp16: 34·s·b·h + 5·a·s²·b bytes per layer. The gpt has no dropout, so
    no masks (attention's a·s²·b, and s·b·h after attention and after the MLP) and no dropped copy of the
    softmax (2·a·s²·b); its LayerNorms keep a float32 mean and 1/std per position, which the paper leaves out."""
    counted = gpt_block("math").saved_bytes
    korthikanti = 34 * S * B * H + 5 * A * S * S * B
    dropout_masks = A * S * S * B + 2 * S * B * H
    dropout_output = 2 * A * S * S * B
    norm_statistics = 2 * 2 * 4 * B * S
    assert counted == korthikanti - dropout_masks - dropout_output + norm_statistics


def test_flash_attention_saves_no_scores():
    """Flash keeps q, k, v (the fused projection's output, 6·s·b·h as the paper's Q, K and V), its output (laid
    out so that it is the projection's input), a float32 log-sum-exp per row and two uint64 random-generator
    words: no s x s term, as Korthikanti et al.'s selective recomputation."""
    counted = gpt_block("flash").saved_bytes
    dropout_masks = 2 * S * B * H
    logsumexp, generator = 4 * A * S * B, 2 * 8 + 8
    norm_statistics = 2 * 2 * 4 * B * S
    assert counted == 34 * S * B * H - dropout_masks + logsumexp + generator + norm_statistics


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_a_block_marks_the_linear_layers_inputs_it_saves(attention):
    """Each of the four products' input (b·s·h, the MLP's second 4·b·s·h) is saved by its product for the weight
    gradient; under flash the output projection's input is the attention kernel's output, which the kernel saves
    too; nothing else is marked."""
    block = gpt_block(attention)
    marked = {how: sorted(nbytes for (_, nbytes), saves in zip(block.saved_tensors, block.linear_input_saves)
                          if saves == how) for how in ("only", "also")}
    linear_inputs = sorted([2 * B * S * H] * 3 + [2 * B * S * 4 * H])
    if attention == "flash":
        assert marked == {"only": sorted([2 * B * S * H] * 2 + [2 * B * S * 4 * H]), "also": [2 * B * S * H]}
    else:
        assert marked == {"only": linear_inputs, "also": []}


def test_grouped_keys_and_values_are_saved_with_their_own_heads_under_flash_and_repeated_under_math():
    """A flash kernel reads each key and value head for its group (Megatron-core's TransformerEngine attention,
    flash-attn's GQA), so a block with one kv head saves k and v at 1/A of the full heads' size; the math path
    multiplies repeated ones, saving them at every head as a full-heads block does."""
    one, full = ({attention: count_built("gpt", {**GPT, "kv_heads": kv}, B, torch.float16, attention).layers[1]
                  for attention in ("flash", "math")} for kv in (1, A))
    head = H // A
    assert full["flash"].saved_bytes - one["flash"].saved_bytes == 2 * B * S * (A - 1) * head * 2  # k, v in fp16
    assert one["math"].saved_bytes == full["math"].saved_bytes


def test_a_gated_gpt_blocks_fused_swiglu_keeps_fc1s_output_only():
    """Under --swiglu-fusion (the default) the gated gpt's SwiGLU is Megatron-core's bias_swiglu_impl: it keeps
    fc1's output (gate and up, 2·b·s·ffn values) where the eager ops also keep silu's output (b·s·ffn more), and
    runs as one kernel reading gate and up and writing its output, where silu and the product move 5·b·s·ffn
    values; the products' FLOPs are the same."""
    ffn = 96
    fused, eager = (count_built("gpt", {**GPT, "ffn": ffn, "gated": True}, B, torch.bfloat16, "flash",
                                swiglu_fusion=fusion).layers[1] for fusion in (True, False))
    assert eager.saved_bytes - fused.saved_bytes == B * S * ffn * 2
    assert eager.fwd_moved_bytes - fused.fwd_moved_bytes == 2 * B * S * ffn * 2
    assert [op.op for op in fused.ops["fwd"] if op.op.startswith("fused_swiglu")] == ["fused_swiglu"]
    for name in ("fwd_flops", "igrad_flops", "wgrad_flops"):
        assert getattr(fused, name) == getattr(eager, name)


def test_a_fused_swiglu_leaves_live_after_the_forward_what_autograd_saves_and_the_output_only():
    """The fused kernel computes silu's output in its registers and keeps nothing but its input: the forward's
    storages live as it ends (what the caching allocator's replay holds until the backward, sim/caching_allocator.py
    `_forward`) are those autograd saves and the block's output, as under the eager ops. A graph kept aside for
    the kernel's backward held silu's output live too, b·s·ffn values a block and micro-batch in flight that no
    runtime holds: the replay of the 70B's interleaved 1F1B at p = 16, t = 2 ran out of 80 GiB at a 63 GiB peak."""
    ffn = 96
    for fusion in (True, False):
        block = count_built("gpt", {**GPT, "ffn": ffn, "gated": True}, B, torch.bfloat16, "flash",
                            swiglu_fusion=fusion).layers[1]
        live = left_live(tuple((number, nbytes) for number, _, nbytes, _ in block.allocations["fwd"]))
        assert [nbytes for number, nbytes in live.items() if number not in block.saved_allocations] == [
            block.output_bytes]


def test_a_large_model_is_counted_on_the_meta_device_with_its_closed_form_parameters():
    """70B parameters: 140 GB in bf16 that this machine does not have, counted in a second."""
    layers, h, s, v, ffn, kv = 80, 8192, 4096, 32000, 28672, 8  # Llama-2-70B's shape (the blocks with biases)
    count = count_built("gpt", dict(layers=layers, width=h, heads=64, seq_len=s, vocab=v, ffn=ffn, kv_heads=kv,
                                    gated=True), 1, torch.bfloat16)
    kv_width = kv * h // 64
    block = (h * (h + 2 * kv_width) + h + 2 * kv_width) + (h * h + h) + (h * 2 * ffn + 2 * ffn) + (ffn * h + h) + 4 * h
    elements = v * h + s * h + layers * block + 2 * h + h * v  # the head without a bias
    assert count.total("param_bytes") == 2 * elements and len(count.layers) == layers + 2
    adam = count.layers[1].optimizer_state_bytes
    assert adam["sgd"] == 0 and adam["momentum"] == count.layers[1].param_bytes
    assert adam["adam"] == 2 * count.layers[1].param_bytes + 4 * 12  # two moments; a float32 step per tensor (12)
    assert count.layers[1].output_shape == (1, s, h) and count.layers[1].output_bytes == 2 * s * h


def test_optimizer_steps_move_what_torch_reads_and_writes():
    block = gpt_block("math")
    moved = {name: n / block.param_bytes for name, n in block.optimizer_step_moved_bytes.items()}
    assert moved["sgd"] == 3  # read w and g, write w
    assert moved["momentum"] == 8  # m *= mu (2), m += g (3), w -= lr m (3)
    assert 19 <= moved["adam"] < 20 and moved["adamw"] > moved["adam"]  # torch's unfused ops (a fused kernel: 7)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_over_many_weights_moves_and_keeps_what_each_weights_own_step_does(name):
    """The count steps one weight of each shape and dtype and multiplies (a MoE layer's experts are hundreds of
    weights of a few shapes): what stepping them all together moves and keeps, as the optimizer runs them."""
    from pipesim.workload.count import _optimizer_step, stepped

    shapes = 3 * (((64, 32), torch.bfloat16),) + (((32,), torch.float32), ((7, 5, 3), torch.bfloat16))
    together = stepped(name, shapes)
    assert _optimizer_step(name, shapes) == together and together[1] > 0


def test_bad_model_options_and_attention_are_named():
    with pytest.raises(ModelError, match="--kv-heads"):
        count_built("gpt", dict(heads=4, kv_heads=3), 1, torch.float32)
    with pytest.raises(ValueError, match="attention: choose from math, flash"):
        count_built("gpt", {}, 1, torch.float32, "sparse")


def test_count_prints_a_table_and_json_whose_totals_are_the_layers_sums():
    code, out, err = pipesim("count", "--layers", 3, "--width", 32, "--heads", 4, "--seq-len", 16, "--vocab", 64,
                             "-b", 2, "--dtype", "fp16", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert [layer["name"] for layer in document["layers"]] == ["0:_Embed", "1:_Block", "2:_Block", "3:_Block",
                                                                  "4:Sequential"]
    assert document["totals"]["fwd_flops"] == sum(layer["fwd_flops"] for layer in document["layers"])
    assert document["layers"][1]["fwd_flops"] == 24 * 2 * 16 * 32 * 32 + 4 * 2 * 16 * 16 * 32
    assert document["dtype"] == "float16" and document["layers"][1]["output_shape"] == [2, 16, 32]
    code, out, err = pipesim("count", "--layers", 3, "--width", 32, "--heads", 4, "--seq-len", 16, "--vocab", 64)
    assert code == 0 and "1:_Block..3" in out and "total" in out  # alike blocks fold into one row


def test_counts_notes_are_each_one_line_where_piped():
    """The note on how routed experts are counted, piped or logged, is one line as every other note and warning
    (commands/tables.py print_message): it wrapped at 120 columns, breaking "... of a" / "micro-batch's 16 tokens"."""
    code, out, err = pipesim("count", "--layers", 1, "--width", 32, "--heads", 4, "--seq-len", 16, "--vocab", 64,
                             "--experts", 4, "--capacity-factor", 1.25)
    assert code == 0 and err.splitlines()[0] == (
        "routed experts counted at balanced routing: each of the 4 computes 10 of a micro-batch's 16 tokens (top 2, "
        "padded to its capacity)"), err


def test_a_micro_batch_past_the_hosts_memory_is_counted_on_the_meta_device_alone():
    """The count made the batch on the host first: `-b 10**12` of the gpt's tokens was torch's allocation traceback
    (simulate, estimate and tune --gpu too); one sample is made there now, the micro-batch on the meta device."""
    small = ("--layers", 1, "--width", 32, "--heads", 4, "--seq-len", 16, "--vocab", 64, "--json")
    code, out, err = pipesim("count", *small, "-b", 10**12)
    assert code == 0, err
    huge = json.loads(out)["layers"][:-1]  # the last outputs the loss, one number at any b
    code, out, err = pipesim("count", *small, "-b", 1)
    assert code == 0, err
    one = json.loads(out)["layers"][:-1]
    assert [layer["output_shape"][0] for layer in huge] == [10**12] * len(one)
    assert [layer["output_bytes"] for layer in huge] == [10**12 * layer["output_bytes"] for layer in one]


@pytest.mark.parametrize("sizes, microbatch_size", [
    (("--width", 8192, "--heads", 64, "--seq-len", 4096), 10**12),  # the embedding's output past 2**63 bytes
    (("--width", 32, "--heads", 4, "--seq-len", 16), 10**20),  # the batch's size past a 64-bit integer
])
def test_a_micro_batch_past_what_torch_addresses_is_refused_naming_its_size(sizes, microbatch_size):
    """The meta device holds no bytes, but torch still refuses a tensor it cannot address: a traceback before."""
    code, out, err = pipesim("count", "--layers", 1, "--vocab", 64, *sizes, "-b", microbatch_size)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"--microbatch-size {microbatch_size:,}: a tensor of the micro-batch is larger than torch" in err


@pytest.mark.parametrize("args, fragment", [
    (("--dtype", "fp64"), "--dtype: choose from fp32, bf16, fp16"),
    (("--attention", "sparse"), "--attention: choose from math, flash"),
    (("--model", "mlp", "--heads", 2), "--heads does not apply to mlp"),
    (("--model", "nowhere:thing"), "cannot import nowhere"),
    # a model file beside the user's folder, not in it: say where the import looked
    (("--model", "nowhere.model:thing"), "No module named 'nowhere' (looked in the current folder, "),
])
def test_count_refuses_bad_input_in_one_line(args, fragment):
    code, out, err = pipesim("count", *args)
    assert code == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [("count",), ("run", "-s", "1f1b", "--model", "mlp"),
                                     ("calibrate", "--model", "mlp", "--out", "p.json")])
def test_fp8_where_it_is_not_taken_is_refused_saying_where_it_is(command, tmp_path, monkeypatch):
    """`count --help` says a what-if estimate also takes fp8, and `count --dtype fp8` listed the other dtypes alone:
    the refusal names the commands that take it (test_fp8.py runs each of them with it)."""
    monkeypatch.chdir(tmp_path)
    assert pipesim(*command, "--dtype", "fp8") == (
        2, "", "error: --dtype: choose from fp32, bf16, fp16, float32, bfloat16, float16 (got 'fp8'); fp8 prices a "
               "what-if GPU: give it to estimate, simulate --gpu, sweep --gpu or tune --gpu\n")
    assert list(tmp_path.iterdir()) == []


DROPOUT_ALLOWED = "--dropout: give a finite number at least 0 and below 1"


@pytest.mark.parametrize("args, line", [
    (("--dropout", "1"), f"{DROPOUT_ALLOWED} (got 1)"),
    (("--dropout", "-0.5"), f"{DROPOUT_ALLOWED} (got -0.5)"),
    (("--dropout", "nan"), f"{DROPOUT_ALLOWED} (got nan)"),
    (("--width", 100, "--heads", 12), "--width: give a multiple of --heads 12 (got 100)"),
    (("--width", 16, "--heads", 4, "--kv-heads", 3), "--heads: give a multiple of --kv-heads 3 (got 4)"),
    (("--experts", 4, "--top-k", 5), "--top-k: give at most --experts 4 (got 5)"),
])
def test_a_gpts_shape_is_refused_in_the_one_wording(args, line):
    """--dropout read "--dropout (1.0) must be at least 0 and below 1", and a rule between two flags "--width (100)
    must be a multiple of --heads (12)": now "FLAG: give WHAT IS ALLOWED (got VALUE)", the other flag named with its
    value as it is typed."""
    code, out, err = pipesim("count", "--model", "gpt", *args)
    assert (code, out, err) == (2, "", f"error: {line}\n")


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_op_records_add_up_to_the_passes_totals_and_name_the_products_shapes(attention):
    block = gpt_block(attention)

    def flops(name: str) -> int:
        return sum(op.flops * op.count for op in block.ops[name])

    def memory(name: str) -> int:
        return sum(op.moved_bytes * op.count for op in block.ops[name] if op.kind == "memory")

    assert (flops("fwd"), flops("igrad"), flops("wgrad")) == (block.fwd_flops, block.igrad_flops, block.wgrad_flops)
    assert flops("bwd") == block.igrad_flops + block.wgrad_flops
    assert (memory("fwd"), memory("igrad"), memory("bwd")) == (
        block.fwd_moved_bytes, block.igrad_moved_bytes, block.igrad_moved_bytes + block.wgrad_moved_bytes)
    products = {op.shape for op in block.ops["fwd"] if op.kind == "matmul"}
    assert {(1, B * S, 3 * H, H), (1, B * S, H, H), (1, B * S, 4 * H, H), (1, B * S, H, 4 * H)} <= products
    assert all(2 * math.prod(op.shape) == op.flops for op in block.ops["bwd"] if op.kind == "matmul")
    if attention == "flash":
        kernels = [op for op in block.ops["fwd"] if op.kind == "attention"]
        assert [op.shape for op in kernels] == [(B * A, S, S, H // A)]
    else:
        assert (B * A, S, S, H // A) in {op.shape for op in block.ops["fwd"] if op.kind == "matmul"}


def test_dropout_is_counted_as_the_fused_kernel_a_gpu_runs_with_korthikantis_mask_bytes_saved():
    plain = gpt_block("math")
    dropped = count_built("gpt", {**GPT, "dropout": 0.1}, B, torch.float16, "math").layers[1]
    kernels = {op.shape: (op.count, op.moved_bytes) for op in dropped.ops["fwd"] if op.op == "native_dropout"}
    scores, hidden = B * A * S * S, B * S * H
    assert kernels == {(B, A, S, S): (1, 5 * scores), (B, S, H): (2, 5 * hidden)}  # fp16 in and out, a bool mask
    assert not any(op.op in ("bernoulli_", "empty_like") for op in dropped.ops["fwd"])  # not the meta decomposition
    # Korthikanti et al.'s dropout terms: the scores' mask (a·s²·b) and dropped copy (2·a·s²·b), a mask after
    # attention and after the MLP (s·b·h each); plus the causal mask the unfused softmax reads (s² bytes)
    assert dropped.saved_bytes - plain.saved_bytes == 3 * scores + 2 * hidden + S * S
    assert dropped.fwd_flops == plain.fwd_flops


def test_a_count_names_the_attention_kernel_only_for_a_model_that_attends():
    """A plain MLP's header said "math attention"."""
    assert count_built("gpt", GPT, B, torch.float32, "flash").attention == "flash"
    assert count_built("mlp", dict(layers=2, width=8), B, torch.float32, "math").attention is None
    code, out, err = pipesim("count", "--model", "mlp", "--layers", 2, "--width", 8)
    assert code == 0, err
    assert "mlp layers=2 width=8, b=1, bfloat16: per layer" in out and "attention" not in out.splitlines()[0]
    code, out, err = pipesim("count", "--layers", 2, "--width", 32, "--heads", 4, "--seq-len", 16, "--vocab", 64)
    assert code == 0 and "bfloat16, math attention: per layer" in " ".join(out.split())


def test_the_count_says_what_each_column_counts():
    """"moved B 7.17 k" stood beside three FLOP columns with nothing to say it is the three passes' bytes together,
    or that k is 10^3."""
    code, out, err = pipesim("count", "--model", "mlp", "--layers", 2, "--width", 8)
    said = " ".join(out.split())
    assert code == 0 and "moved B: bytes the other ops read and write (norms, activations, copies), the three passes " \
                         "together" in said and "k, M, G, ...: 10^3, 10^6, 10^9, ... (decimal)" in said, out


def test_counts_take_an_si_prefix_up_to_yotta_and_never_an_exponent():
    """A 24-trillion-parameter config's totals read "8.22e+03 P" where the prefixes ended at peta; 999.6 T read
    "1e+03 T" at three digits."""
    from pipesim.commands.count import _si

    assert [_si(int(n)) for n in (999, 1234, 999_600, 8.22e18, 999.6e15, 3e27)] == [
        "999", "1.23 k", "1 M", "8.22 E", "1 E", "3,000 Y"]
