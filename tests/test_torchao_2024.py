"""`--fp8-recipe torchao-2024`: torchao.float8's tensorwise Float8Linear as it was at eab345c, the commit
torchtitan's December 2024 benchmarks ran (planning/fp8.py): the input and the weight cast once in the forward and
their float8 copies saved, the output's gradient cast once in the backward; against `torchao`, the later torchao
that saves the 16-bit tensors and casts them again per use."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.planning.estimate import Parallelism, estimate_layer
from pipesim.planning.fp8 import FP8_RECIPES, gathered_in_float8, in_float8
from tests.conftest import pipesim
from tests.helpers import H100_FP8 as DEVICE
from tests.helpers import H100_TENSOR_LINK as LINK
from tests.helpers import SMALL_FLASH_GPT_FLAGS as SMALL
from tests.helpers import product_attention_layer as _layer

TOKENS, WIDTH = 4096, 1024
WEIGHT_BYTES = WIDTH * WIDTH + 4  # the layer's one width x width product: its float8 weight and float32 scale


def _estimate(recipe: str, **parallel):
    return estimate_layer(_layer(TOKENS, WIDTH), DEVICE, Parallelism(fp8=recipe, **parallel), LINK, 2)


def _casts(recipe, name: str) -> list[str]:
    return [op.op for op in in_float8(_layer(TOKENS, WIDTH), recipe, 2).ops[name] if op.op.startswith("fp8_")]


def test_the_backward_casts_only_the_gradient_once_and_the_forward_as_the_later_torchao():
    recipe = FP8_RECIPES["torchao-2024"]
    later = FP8_RECIPES["torchao"]
    assert _casts(recipe, "fwd") == _casts(later, "fwd") == [
        "fp8_amax_input", "fp8_cast_input", "fp8_amax_weight", "fp8_cast_weight"]
    for name in ("bwd", "igrad"):
        assert _casts(recipe, name) == ["fp8_amax_grad", "fp8_cast_grad"]
    assert _casts(recipe, "wgrad") == []
    assert _estimate("torchao-2024").fwd_ms == pytest.approx(_estimate("torchao").fwd_ms)
    assert _estimate("torchao-2024").bwd_ms < _estimate("torchao").bwd_ms


def test_it_saves_the_float8_input_as_te_and_a_float8_weight_copy_per_micro_batch():
    """The inputs' float8 copies as te keeps them, plus the weight's float8 copy and scale (split by t, not by
    the tokens); the later torchao saves the 16-bit tensors, the weight being the parameter itself."""
    te, later = _estimate("te").activation_bytes, _estimate("torchao").activation_bytes
    assert _estimate("torchao-2024").activation_bytes == te + WEIGHT_BYTES
    assert later == _estimate(None).activation_bytes
    assert _estimate("torchao-2024", tensor=2, sequence_parallel=True).activation_bytes == \
        _estimate("te", tensor=2, sequence_parallel=True).activation_bytes + WIDTH * WIDTH // 2 + 4


@pytest.mark.parametrize("recompute", ["full", "op"])
def test_a_recomputed_forward_makes_the_weight_copy_again_rather_than_keep_it(recompute):
    """torchtitan's activation checkpointing (full, or its op policy, which keeps no cast's output) reruns the
    casts in the backward: the weight copies are not kept between the passes."""
    assert _estimate("torchao-2024", recompute=recompute).activation_bytes == \
        _estimate("torchao", recompute=recompute).activation_bytes


def test_under_fsdp2s_float8_all_gather_no_pass_casts_a_weight_and_no_copy_is_saved():
    gathered = gathered_in_float8(FP8_RECIPES["torchao-2024"])
    assert not gathered.saves_float8_weights
    assert "fp8_cast_weight" not in _casts(gathered, "fwd")


def test_its_sequence_parallel_gathers_stay_16_bit(monkeypatch):
    """Its all-gathers are priced as torchao's, in bf16 (`gathers_float8` is TransformerEngine's cast before the
    gather): saving float8 inputs does not make them float8."""
    parallel = {"tensor": 2, "sequence_parallel": True}
    float8_gathers = _estimate("torchao-2024", **parallel).fwd_ms
    monkeypatch.setitem(FP8_RECIPES, "torchao-2024", replace(FP8_RECIPES["torchao-2024"], gathers_float8=True))
    assert _estimate("torchao-2024", **parallel).fwd_ms < float8_gathers


def test_the_cli_takes_it_and_lists_it_among_the_recipes(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    outputs = {}
    for recipe in ("torchao", "torchao-2024"):
        code, out, err = pipesim("simulate", "--gpu", "h100-sxm", *SMALL, "-p", "2", "-m", "4", "-s", "1f1b",
                                 "--dtype", "fp8", "--fp8-recipe", recipe)
        assert code == 0, err
        outputs[recipe] = out
    assert "fp8 torchao-2024" in outputs["torchao-2024"] and "fp8 torchao," in outputs["torchao"]
    code, _, err = pipesim("simulate", "--gpu", "h100-sxm", *SMALL, "--dtype", "fp8", "--fp8-recipe", "torchao-2023")
    assert code == 2 and err.strip() == ("error: --fp8-recipe: choose from te, torchao, te-current, deepseek, "
                                         "torchao-2024 (got 'torchao-2023')")
    assert not list(tmp_path.iterdir())


def test_fsdp2s_float8_all_gather_takes_it_and_names_both_torchao_recipes_when_refused(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    fsdp = ("--data-parallel", "2", "--zero", "3", "--precision", "fsdp2", "-p", "1", "-m", "2", "-s", "1f1b")
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", *SMALL, *fsdp, "--dtype", "fp8", "--fp8-recipe",
                             "torchao-2024", "--fsdp-float8-all-gather")
    assert code == 0 and "fp8 torchao-2024, fsdp float8 all" in " ".join(out.split()), err
    code, _, err = pipesim("simulate", "--gpu", "h100-sxm", *SMALL, *fsdp, "--dtype", "fp8", "--fsdp-float8-all-gather")
    assert code == 2 and err.count("\n") == 1 and "give --fp8-recipe torchao or torchao-2024 and" in err, err
    assert not list(tmp_path.iterdir())
