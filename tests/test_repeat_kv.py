"""--repeat-kv: grouped-query attention's keys and values copied to every query head before the attention kernel, as
torchtitan's Llama does (torchtitan/models/llama/model.py at 9dec370, `repeat_kv`), so the kernel saves them and a
context-parallel ring passes them at the queries' heads."""
from pathlib import Path

import torch
import torch.nn.functional as F

from pipesim.planning.estimate import ContextRing
from pipesim.workload.count import _GpuKernels, count_built
from pipesim.workload.sizes import REPEAT_KV_UNDER_MATH

from .conftest import pipesim, pipesim_fresh
from .helpers import estimated_layers

HEADS, KV_HEADS, SEQ, HEAD_SIZE, BATCH = 8, 2, 256, 32, 2
GQA_GPT = {"layers": 1, "width": HEADS * HEAD_SIZE, "heads": HEADS, "kv_heads": KV_HEADS, "seq_len": SEQ,
           "vocab": 128, "gated": True}
GQA_GPT_FLAGS = ("--model", "gpt", "--layers", 1, "--width", HEADS * HEAD_SIZE, "--heads", HEADS,
                 "--kv-heads", KV_HEADS, "--seq-len", SEQ, "--vocab", 128, "--gated", "--attention", "flash",
                 "--gpu", "h100-sxm")


def _block(repeat_kv: bool):
    return count_built("gpt", GQA_GPT, BATCH, torch.bfloat16, "flash", repeat_kv=repeat_kv).layers[1]


def _kernel(block):
    return next(op for op in block.ops["fwd"] if op.op == "_scaled_dot_product_flash_attention")


def test_the_kernel_takes_and_saves_every_query_heads_keys_and_values():
    grouped, repeated = _block(False), _block(True)
    assert (_kernel(grouped).kv_group, _kernel(repeated).kv_group) == (HEADS // KV_HEADS, 1)
    assert ContextRing.keys_values(_kernel(repeated)) == HEADS // KV_HEADS * ContextRing.keys_values(_kernel(grouped))
    # the kernel saves the copies (bf16 keys and values at every head); the grouped ones stay in the qkv product's
    # output, which the kernel's query, a view of it, holds
    assert repeated.saved_bytes - grouped.saved_bytes == 2 * BATCH * HEADS * SEQ * HEAD_SIZE * 2


def test_a_context_ring_gathers_the_repeated_keys_and_values(tmp_path):
    ring = ("--context-parallel", 2, "--cp-rotate", "allgather")
    grouped = estimated_layers(tmp_path, *GQA_GPT_FLAGS, *ring)[1]["ring_buffer_bytes"]
    repeated = estimated_layers(tmp_path, *GQA_GPT_FLAGS, *ring, "--repeat-kv")[1]["ring_buffer_bytes"]
    # the forward's all-gather holds C + 1 = 3 bf16 key-and-value buffers of the rank's SEQ / 2 tokens
    # (`ContextRing.buffer_bytes`), each (HEADS - KV_HEADS) heads larger; its float32 merges are the queries'
    assert repeated["fwd"] - grouped["fwd"] == 3 * 2 * (HEADS - KV_HEADS) * (SEQ // 2) * HEAD_SIZE * 2


def test_an_attention_of_unbatched_tensors_is_counted_with_or_without_the_repeat():
    """torch's attention takes a 2-D query, key and value (tokens x head size), which have no heads to repeat."""
    for repeat_kv in (False, True):
        with _GpuKernels(False, repeat_kv):
            out = F.scaled_dot_product_attention(*(torch.ones(4, HEAD_SIZE) for _ in range(3)))
        assert out.shape == (4, HEAD_SIZE)


def test_a_model_without_grouped_keys_and_values_is_refused_the_repeat(tmp_path, monkeypatch):
    """--repeat-kv of a model whose every query head has its own key/value head (the gpt's default), or of one with
    no attention (mlp), changed nothing and was taken silently: refused, as --rope-kernel fused is without a RoPE."""
    monkeypatch.chdir(tmp_path)
    dense = ("gpt", "--layers", 1, "--width", HEADS * HEAD_SIZE, "--heads", HEADS, "--seq-len", SEQ, "--vocab", 128)
    said = [pipesim("estimate", "--gpu", "h100-sxm", "--model", *model, "--repeat-kv", "--out", "p.json")
            for model in (dense, ("mlp",))]
    assert said == [(2, "", "error: --repeat-kv: this model's attention takes as many key/value heads as query heads "
                             "(no grouped-query attention, or one whose code copies them already): there is nothing "
                             "to copy; leave it out\n")] * 2
    assert list(tmp_path.iterdir()) == []


def test_grouped_keys_and_values_under_math_attention_are_refused_the_repeat(tmp_path, monkeypatch):
    """torch's math attention copies grouped-query keys and values to every query head itself (enable_gqa), so the
    copies --repeat-kv makes before it changed no tensor and no time, only the caching allocator's reserve (137.5 ->
    30.5 MiB on a 16-head gpt of 2 key/value heads, its peak falling by the copies it added): refused."""
    monkeypatch.chdir(tmp_path)
    flags = [*GQA_GPT_FLAGS[:GQA_GPT_FLAGS.index("--attention")], *GQA_GPT_FLAGS[GQA_GPT_FLAGS.index("--gpu"):]]
    for attention in ((), ("--attention", "math")):
        assert pipesim("estimate", *flags, *attention, "--repeat-kv", "--out", "p.json") == (
            2, "", "error: --repeat-kv: under --attention math torch's attention copies grouped-query keys and values "
                   "to every query head itself, the copies --repeat-kv would make: leave it out, or give --attention "
                   "flash\n")
    assert list(tmp_path.iterdir()) == []
    assert pipesim("estimate", *GQA_GPT_FLAGS, "--repeat-kv", "--out", "p.json").code == 0


def test_a_hugging_face_model_under_math_attention_is_refused_the_repeat_before_its_count():
    """Llama 3.1 405B's count ran whole (torch imported, 126 layers traced) before the refusal, which needs only
    the flags."""
    config = Path(__file__).parents[1] / "examples" / "llama3.1-405b"
    fresh = pipesim_fresh(["simulate", "--gpu", "h100-sxm", "--model", f"hf:{config}", "--seq-len", 8192, "-p", 16,
                           "-s", "1f1b", "--attention", "math", "--repeat-kv"])
    assert [run.code for run in fresh.runs] == [2] and "torch" not in fresh.imported
    assert fresh.runs[0].err == f"error: {REPEAT_KV_UNDER_MATH}\n"
