"""--mtp-layers D (workload/hf.py `MultiTokenPrediction`): DeepSeek-V3's multi-token prediction (its report, 2.2)
counted as one more layer after the final norm, the main model's embedding and head read and given gradients there
but held, and counted, once (the report's 3.2.3), the head's product in its own precision (3.3.1)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from pipesim.planning.estimate import Regions
from pipesim.planning.fp8 import FP8_RECIPES, float8_weight_bytes
from pipesim.workload.count import WorkloadCount, count_built
from tests.conftest import needs_transformers, pipesim
from tests.helpers import TINY_DEEPSEEK, B, S, write_config
from tests.helpers import priced_recomputing as priced

H, VOCAB = TINY_DEEPSEEK["hidden_size"], TINY_DEEPSEEK["vocab_size"]
TOKENS = B * S


@cache
def counted(mtp_layers: int, cross_entropy: str = "torch") -> WorkloadCount:
    import tempfile
    from pathlib import Path

    config = write_config(Path(tempfile.mkdtemp()) / "deepseek", TINY_DEEPSEEK)
    return count_built(f"hf:{config}", {"seq_len": S, "mtp_layers": mtp_layers}, B, torch.bfloat16, "flash",
                       cross_entropy=cross_entropy)


def _product_flops(n: int, k: int) -> int:
    return 2 * TOKENS * n * k


@needs_transformers
def test_one_module_is_one_more_layer_after_the_norm_with_a_block_a_projection_and_three_norms_of_its_own():
    """Between the final norm and the head, reading the norm and the batch's tokens; its weights are a decoder
    layer like the model's last (a mixture of experts), the 2h -> h projection and three RMSNorms: not the
    embedding's nor the head's, whose bytes and gradients stay with their own layers."""
    plain, mtp = counted(0), counted(1)
    names = [layer.name.split(":")[1] for layer in mtp.layers]
    assert names == [layer.name.split(":")[1] for layer in plain.layers][:-1] + ["MultiTokenPrediction", "Linear"]
    module, block = mtp.layers[-2], plain.layers[-3]
    assert module.inputs == (len(mtp.layers) - 3, -1) and mtp.layers[-1].inputs == (len(mtp.layers) - 2,)
    assert module.param_bytes == block.param_bytes + 2 * H * H * 2 + 3 * H * 2
    assert module.grad_bytes == module.param_bytes
    assert module.expert_param_bytes == block.expert_param_bytes
    assert [layer.param_bytes for layer in mtp.layers if layer is not module] == [
        layer.param_bytes for layer in plain.layers]
    assert mtp.options["mtp_layers"] == 1 and "mtp_layers" not in plain.options


@needs_transformers
def test_its_work_is_the_blocks_the_projections_and_a_head_pass_with_the_shared_heads_weight_gradient():
    """Forward: the block, the projection and the head's product; the weight pass adds the head's weight gradient,
    which the shared head accumulates (the embedding's gradient is a scatter, no product)."""
    plain, mtp = counted(0), counted(1)
    module, block = mtp.layers[-2], plain.layers[-3]
    head = _product_flops(VOCAB, H)
    assert module.fwd_flops == block.fwd_flops + _product_flops(H, 2 * H) + head
    assert module.wgrad_flops == block.wgrad_flops + _product_flops(H, 2 * H) + head
    assert module.igrad_flops == block.igrad_flops + _product_flops(2 * H, H) + head
    logits = [(shape, n) for shape, n in module.saved_tensors if shape == (TOKENS, VOCAB)]
    assert logits == [((TOKENS, VOCAB), TOKENS * VOCAB * 4)]  # its cross entropy's float32 log-softmax, as the head's


@needs_transformers
def test_a_float8_recipe_leaves_the_shared_heads_product_in_its_precision():
    """The report keeps the output head in BF16 (3.3.1): the module's held float8 weights are its block's and its
    projection's, not the head's."""
    plain, mtp = counted(0), counted(1)
    deepseek = FP8_RECIPES["deepseek"]
    assert float8_weight_bytes(mtp.layers[-2], deepseek) == (float8_weight_bytes(plain.layers[-3], deepseek)
                                                             + 2 * H * H * deepseek.weight_copy_bytes)
    assert not any(op.float8 for op in mtp.layers[-2].ops["fwd"] if op.shape[1:] == (TOKENS, VOCAB, H))


@needs_transformers
def test_its_loss_is_the_one_the_model_is_counted_with():
    """--cross-entropy megatron (Megatron-core's, its gradient written into the saved softmax) runs in the module's
    loss as in the head's: aten's NLL loss backward in neither."""
    for cross_entropy in ("torch", "megatron"):
        module, head = counted(1, cross_entropy).layers[-2:]
        aten = ["nll_loss_backward" in {op.op for op in layer.ops["bwd"]} for layer in (module, head)]
        assert aten == [cross_entropy == "torch"] * 2


@needs_transformers
def test_its_blocks_recomputed_regions_are_made_again_after_its_cross_entropys_backward():
    """Megatron-core makes a recomputed region again at a hook on the gradient of a later output of the submodule it
    runs in (CheckpointWithoutOutput), so no earlier than the backward's entry into that submodule: the module's
    decoder layer's up-projections and experts' activation after its cross entropy's backward, whose float32
    log-softmax's node has ended by then. The input-gradient pass holds them from there only, not beside its peak
    for the whole pass (their sum on top of it, before)."""
    module = counted(1).layers[-2]
    reads = module.saved_reads["igrad"]
    (logits,) = (i for i, (shape, _) in enumerate(module.saved_tensors) if shape == (TOKENS, VOCAB))
    entries = module.saved_region_entries["igrad"]  # where recomputing each region makes its tensors again
    block = [entries[i][name] for name in ("mla_up_proj", "moe_act") for i in module.region_saves[name]]
    assert block and all(at >= reads[logits][1] > reads[logits][0] >= 0 for at in block)
    modules = ("layernorm", "mla_up_proj", "moe_act")
    plain, recomputed = priced(module).transient_bytes, priced(module, *modules).transient_bytes
    dropped = sum(module.saved_tensors[i][1] for i in Regions.of(module, modules).dropped)
    assert plain["igrad"] < recomputed["igrad"] < plain["igrad"] + dropped


@pytest.mark.parametrize(("flags", "message"), [
    (("--model", "gpt", "--mtp-layers", "1"), "--mtp-layers does not apply to gpt"),
    (("--model", "hf:examples/deepseek-v3", "--seq-len", "64", "--mtp-layers", "-1"),
     "--mtp-layers: give a whole number from 0 to 10,000 (got -1)"),
])
def test_a_bad_depth_or_model_is_refused_in_one_line(flags, message):
    code, out, err = pipesim("simulate", *flags, "--gpu", "h100-sxm", "-p", "1", "-m", "1", "-s", "gpipe")
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1
