"""The gpt as NeMo's Llama and Nemotron-4 runs shape it: `--no-linear-bias` (Megatron-LM's --disable-bias-linear)
drops every linear layer's bias and with it its gradient's reduction; `--norm rmsnorm` (--normalization RMSNorm)
builds torch's RMSNorm, counted as the one kernel each way torch runs on a GPU, keeping its input and one float32 a
token where LayerNorm keeps two."""

from __future__ import annotations

import json

import pytest
import torch

from pipesim.workload.count import count_built
from pipesim.workload.models import ModelError
from pipesim.workload.norms import NO_RMSNORM_TO_FUSE
from tests.conftest import pipesim, refused, simulate_json

B, S, H, V, E = 2, 8, 16, 32, 2  # micro-batch, sequence, width, vocabulary; bytes per bf16 element
TINY = dict(layers=1, width=H, heads=2, seq_len=S, vocab=V)  # ffn 4·H, qkv 3·H
TOKENS = B * S


def _count(**options):
    return count_built("gpt", {**TINY, **options}, B, torch.bfloat16, "flash")


def _norm_saves(layer) -> int:
    return sum(n for (_, n), part in zip(layer.saved_tensors, layer.saved_parts) if part == "norms")


def test_no_linear_bias_drops_each_bias_and_its_gradients_reduction():
    """By hand: a bias of n outputs is n weights, and its gradient a reduction over the tokens, reading the output's
    gradient (tokens·n elements) and writing n: qkv 3H, proj H, fc1 4H, fc2 H in a block; the head has none either
    way. Nothing else moves: the forward's bias add is the product's epilogue, and a bias saves nothing."""
    biased, bare = _count(), _count(linear_bias=False)
    block_outputs, head_outputs = (3 * H, H, 4 * H, H), ()
    for i, outputs in ((1, block_outputs), (2, head_outputs)):
        assert biased.layers[i].param_bytes - bare.layers[i].param_bytes == sum(outputs) * E
        reductions = sum((TOKENS * n + n) * E for n in outputs)
        assert biased.layers[i].wgrad_moved_bytes - bare.layers[i].wgrad_moved_bytes == reductions
        for name in ("fwd", "igrad"):
            assert getattr(biased.layers[i], f"{name}_moved_bytes") == getattr(bare.layers[i], f"{name}_moved_bytes")
        assert biased.layers[i].saved_bytes == bare.layers[i].saved_bytes
        assert biased.layers[i].fwd_flops == bare.layers[i].fwd_flops
    assert not any(op.op == "sum" for op in bare.layers[1].ops["wgrad"])
    assert bare.options["linear_bias"] is False and "linear_bias" not in biased.options


def test_the_head_has_no_bias_as_megatron_lms_output_layer():
    """Megatron-LM's output layer is ColumnParallelLinear(..., bias=False) (megatron/core/models/gpt/gpt_model.py at
    d98e8a64; the legacy model's parallel_lm_logits a product with the embedding's weight): the head holds its norm's
    scale and shift and its V x H weight, and its backward reduces no bias gradient over the tokens."""
    head = _count().layers[2]
    assert head.param_bytes == (2 * H + V * H) * E
    assert not any(op.op == "sum" for name in ("bwd", "wgrad") for op in head.ops[name])
    assert [op.op for op in head.ops["fwd"] if op.kind == "matmul"] == ["mm"]  # no bias added in its epilogue


def test_rmsnorm_is_one_kernel_each_way_keeping_its_input_and_a_float32_a_token():
    """A block's two norms and the head's: forward, the 16-bit input and the weight read, the output and one float32
    1/rms a token written; backward (input and weight), the output's gradient, the input, the weight and the 1/rms
    read and both gradients written. Saved: the input and 4 bytes a token, where LayerNorm keeps a mean beside its
    1/std (4 more a token). Its weights: the scale alone, LayerNorm's shift gone."""
    layernorm, rmsnorm = _count(), _count(norm="rmsnorm")
    x, weight, rms = TOKENS * H * E, H * E, TOKENS * 4
    for i, norms in ((1, 2), (2, 1)):
        (forward,) = [op for op in rmsnorm.layers[i].ops["fwd"] if op.op == "fused_rmsnorm"]
        assert (forward.count, forward.moved_bytes) == (norms, x + weight + x + rms)
        (backward,) = [op for op in rmsnorm.layers[i].ops["bwd"] if op.op == "fused_rmsnorm_backward"]
        assert (backward.count, backward.moved_bytes) == (norms, x + x + weight + rms + x + weight)
        assert not any(op.op == "native_layer_norm" for op in rmsnorm.layers[i].ops["fwd"])
        assert _norm_saves(rmsnorm.layers[i]) == norms * (x + rms)
        assert _norm_saves(layernorm.layers[i]) - _norm_saves(rmsnorm.layers[i]) == norms * TOKENS * 4
        assert layernorm.layers[i].param_bytes - rmsnorm.layers[i].param_bytes == norms * H * E


def test_fused_norms_are_refused_for_the_gpts_rmsnorm_which_runs_fused_anyway():
    with pytest.raises(ModelError, match="RMSNorm keep what TransformerEngine's keep already"):
        count_built("gpt", {**TINY, "norm": "rmsnorm"}, B, torch.bfloat16, "flash", norm_kernel="fused")


@pytest.mark.parametrize(("args", "fragment"), [
    (["--norm", "rms"], "--norm: choose from layernorm, rmsnorm (got 'rms')"),
    (["--norm", "rmsnorm", "--norm-kernel", "fused"], NO_RMSNORM_TO_FUSE),
])
def test_a_bad_norm_is_refused_in_one_line(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    assert fragment in refused("estimate", "--model", "gpt", "--layers", "1", "--width", H, "--heads", "2",
                               "--seq-len", S, "--vocab", V, "--gpu", "h100-sxm", "-p", "1", *args,
                               "--out", "profile.json")


def test_a_hugging_face_config_takes_neither_flag():
    code, out, err = pipesim("count", "--model", "hf:examples/llama3.1-8b", "--seq-len", "64", "--no-linear-bias")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--linear-bias does not apply to hf:examples/llama3.1-8b" in err


def test_simulate_and_tune_take_them_as_the_other_shape_flags():
    """Each command's step is the shaped model's: without the biases' gradient reductions and LayerNorm's shift,
    fewer kernels, so a shorter step than the default gpt's (this small model's passes are their kernels' issue)."""
    shape = ["--model", "gpt", "--layers", "2", "--width", H, "--heads", "2", "--seq-len", S, "--vocab", V,
             "--gpu", "h100-sxm"]
    shaped = ["--norm", "rmsnorm", "--no-linear-bias"]
    (plain,), (bare,) = (simulate_json(*shape, *flags, "-p", "2", "-m", "2", "-s", "1f1b") for flags in ((), shaped))
    assert bare["time_per_minibatch_ms"] < plain["time_per_minibatch_ms"]
    chosen = []
    for flags in ((), shaped):
        code, out, err = pipesim("tune", *shape, *flags, "--devices", "2", "--batch-size", "4", "-s", "1f1b",
                                 "--json")
        assert code == 0, err
        chosen.append(json.loads(out)["choice"]["samples_per_s"])
    assert chosen[1] > chosen[0]
