"""The routed experts' load-balancing loss, counted as Megatron-core computes it (workload/moe.py `with_aux_loss`,
--router-aux-loss): its kernels in every MoE layer's forward and backward, priced as every other op is."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import QWEN3_MOE, B, S, count_config, write_config

CONFIG = {**QWEN3_MOE, "num_experts": 8}
RECORDED = json.loads((Path(__file__).parents[1] / "benchmarks" / "published_moe.json").read_text())["rows"]


def _moe_layer(tmp_path, kind: str):
    return count_config(tmp_path / "qwen3-moe", CONFIG, router_aux_loss=kind).layers[1]


def _kernels(layer, names=None) -> dict[str, int]:
    return {part: sum(op.count for op in ops if names is None or op.op in names) for part, ops in layer.ops.items()}


@needs_transformers
def test_the_unfused_loss_runs_its_torch_ops_in_the_forward_and_backward(tmp_path):
    """Megatron-LM 1e057005's loss: a float32 softmax of the logits (on the meta device a cast and the softmax),
    their sum over the tokens, the product with the tokens an expert, its sum and scale, the tracker's division and
    in-place add (an add_ and a copy_); the backward: the scaler's ones and scale, the two products' gradients, the
    softmax's and its cast's, and the add into the logits' gradient. No FLOPs move, and transformers' count (none,
    the default) has none of it."""
    none, unfused = _moe_layer(tmp_path, "none"), _moe_layer(tmp_path, "unfused")
    assert _kernels(unfused)["fwd"] - _kernels(none)["fwd"] == 9
    assert _kernels(unfused)["igrad"] - _kernels(none)["igrad"] == 7
    assert _kernels(unfused)["wgrad"] == _kernels(none)["wgrad"]
    assert _kernels(unfused, ("div", "add_", "copy_"))["fwd"] - _kernels(none, ("div", "add_", "copy_"))["fwd"] == 3
    assert (unfused.fwd_flops, unfused.igrad_flops) == (none.fwd_flops, none.igrad_flops)


@needs_transformers
def test_the_fused_loss_is_transformer_engines_two_kernels_each_way(tmp_path):
    """moe_router_fusion: TransformerEngine's fused score and loss kernels (one each way each), the routing map's
    column sums, the tracker's three ops; the backward the scaler's two, the two fused kernels' and the add into the
    logits' gradient. The scores kernel reads the logits and writes float32 scores and a boolean map."""
    none, fused = _moe_layer(tmp_path, "none"), _moe_layer(tmp_path, "fused")
    names = {op.op for op in fused.ops["fwd"]} - {op.op for op in none.ops["fwd"]}
    assert names == {"fused_aux_loss_scores", "fused_aux_loss", "sum", "div", "add_", "copy_"}
    assert {op.op for op in fused.ops["igrad"]} >= {"fused_aux_loss_scores_backward", "fused_aux_loss_backward"}
    assert (_kernels(fused)["fwd"] - _kernels(none)["fwd"], _kernels(fused)["igrad"] - _kernels(none)["igrad"]) == (
        6, 5)
    (scores,) = [op for op in fused.ops["fwd"] if op.op == "fused_aux_loss_scores"]
    tokens = B * S
    assert scores.moved_bytes == tokens * 8 * (2 + 4 + 1)


@needs_transformers
def test_the_loss_slows_a_step_and_a_bad_setting_is_one_line(tmp_path):
    """Priced as the count's other kernels: each setting's step is slower than none's; an unknown one is refused
    in one line naming the flag and its choices."""
    run = ("--gpu", "h100-sxm", "--model", f"hf:{write_config(tmp_path / 'qwen3-moe', CONFIG)}", "--seq-len", S,
           "-b", B, "-p", 1, "-m", 1, "-s", "1f1b")
    steps = {kind: simulate_json(*run, "--router-aux-loss", kind)[0]["time_per_minibatch_ms"]
             for kind in ("none", "unfused", "fused")}
    assert steps["unfused"] > steps["none"] and steps["fused"] > steps["none"]
    code, out, err = pipesim("simulate", *run, "--router-aux-loss", "aux")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--router-aux-loss" in err, err


def test_the_built_in_gpts_experts_take_the_loss_too():
    """The built-in gpt's router is a routed experts' router as a Hugging Face MoE's is: each setting's step is
    slower than none's (df492f2 counted the loss on Hugging Face routers only, the flag changing nothing here)."""
    run = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 128,
           "--vocab", 1000, "--gated", "--experts", 4, "--top-k", 2, "--expert-ffn", 256, "-p", 1, "-m", 2,
           "-s", "1f1b")
    steps = {kind: simulate_json(*run, "--router-aux-loss", kind)[0]["time_per_minibatch_ms"]
             for kind in ("none", "unfused", "fused")}
    assert steps["unfused"] > steps["none"] and steps["fused"] > steps["none"], steps


def test_a_model_without_routed_experts_refuses_the_loss_in_one_line():
    """The loss is the routed experts' router's: on a dense model the flag would change nothing, so it is refused
    (as --capacity-factor and --rope-kernel fused are where they apply to nothing)."""
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256,
                             "--heads", 4, "--seq-len", 128, "--vocab", 1000, "-p", 1, "-m", 2, "-s", "1f1b",
                             "--router-aux-loss", "fused")
    assert (code, out, err) == (2, "", "error: --router-aux-loss fused: this model routes no tokens to experts: leave "
                                       "it out or pass none\n")


@pytest.mark.parametrize("name, kind", [
    ("26.02 Qwen3_30B_a3B", "fused"), ("GPT OSS 120B", "none"), ("DeepSeekV3", "fused"),
    ("Model Zoo 235B DeepEP t4", "fused"), ("Model Zoo 235B A2A t2 p32", "unfused"),
    ("Model Zoo 235B DeepEP t2 p8 v4 E32", "fused"), ("DGXC DeepSeek-V3", "unfused"),
    ("Bridge card Qwen3-30B-A3B", "fused"),
])
def test_each_published_row_runs_its_recipes_loss(name, kind):
    """The published MoE rows (benchmarks/published_moe.json) pass the loss their recipe or command sets
    (published_moe.py `BRIDGE_AUX_LOSS` and `DGXC_AUX_LOSS`, the Model Zoo CSV's `router_aux_loss`)."""
    commands = [shlex.split(row["command"]) for row in RECORDED if name in row["run"]]
    assert commands and {args[args.index("--router-aux-loss") + 1] if "--router-aux-loss" in args else "none"
                         for args in commands} == {kind}
