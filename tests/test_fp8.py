"""--dtype fp8: a transformer layer's linear products at the part's FP8 peak, the recipes' casts as memory-bound
ops of their own, TransformerEngine's float8 copies of the products' inputs saved, and a part without an FP8
peak refused (planning/fp8.py)."""

from __future__ import annotations

import json

import pytest

from pipesim.planning.estimate import (
    Device,
    EstimateError,
    Parallelism,
    estimate_layer,
    op_ms,
)
from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from pipesim.profiles.workload import LayerCount
from tests.conftest import pipesim
from tests.helpers import A100, H100
from tests.helpers import H100_FP8 as DEVICE
from tests.helpers import H100_TENSOR_LINK as LINK
from tests.helpers import SMALL_FLASH_GPT_FLAGS as SMALL
from tests.helpers import matmul_count as _product
from tests.helpers import product_attention_layer as _layer


def _priced(layer: LayerCount, fp8: str | None):
    return estimate_layer(layer, DEVICE, Parallelism(fp8=fp8), LINK, 2)


def test_the_products_run_at_the_fp8_peak_ratio_at_large_sizes_and_the_casts_eat_it_at_small():
    peak_ratio = H100.dense_tflops.fp8 / H100.dense_tflops.bf16
    large, small = _layer(16384, 16384), _layer(256, 256)
    overhead = H100.curve.kernel_overhead_ms
    for recipe in FP8_RECIPES:
        converted = in_float8(large, FP8_RECIPES[recipe], 2).ops["fwd"]
        product = next(op for op in converted if op.kind == "matmul")
        assert (op_ms(large.ops["fwd"][0], DEVICE) - overhead) / (op_ms(product, DEVICE) - overhead) == \
            pytest.approx(peak_ratio)  # the same curve and tile fill, at the FP8 peak
        assert _priced(large, recipe).fwd_ms == pytest.approx(sum(op_ms(op, DEVICE) for op in converted))
        speedups = [_priced(layer, None).fwd_ms / _priced(layer, recipe).fwd_ms for layer in (small, large)]
        assert speedups[0] < 1.05 < speedups[1] < peak_ratio, recipe  # the casts: most of a small layer's time
    te = _priced(large, None).fwd_ms / _priced(large, "te").fwd_ms
    assert te > 0.9 * peak_ratio  # one cast of the input per product: a few % of a large product


@pytest.mark.parametrize("recipe, kernels, passes", [
    ("te", {"fp8_cast_transpose": 2 + 2}, {"fwd": ["input"], "igrad": ["grad"], "wgrad": [], "bwd": ["grad"]}),
    ("torchao", {"fp8_amax": 2, "fp8_cast": 2 + 1},
     {"fwd": ["input", "weight"], "igrad": ["grad", "weight"], "wgrad": ["grad", "input"],
      "bwd": ["grad", "weight", "grad", "input"]}),
])
def test_the_scaling_work_is_memory_bound_ops_of_its_own(recipe, kernels, passes):
    tokens, width = 4096, 1024
    layer = in_float8(_layer(tokens, width), FP8_RECIPES[recipe], 2)
    elements = {"input": tokens * width, "weight": width * width, "grad": tokens * width}
    for name, roles in passes.items():
        casts = [op for op in layer.ops[name] if op.op.startswith("fp8_")]
        assert all(op.kind == "memory" and op.flops == 0 for op in casts)
        assert [(op.op, op.moved_bytes) for op in casts] == [
            (f"{kernel}_{role}", elements[role] * moved) for role in roles for kernel, moved in kernels.items()]
        assert all(op.float8 for op in layer.ops[name] if op.kind == "matmul")
    assert not any(op.float8 for op in layer.ops["fwd"] if op.kind == "attention")


def test_te_saves_float8_copies_of_the_products_inputs_and_torchao_the_16_bit_ones():
    tokens, width = 4096, 1024
    layer = _layer(tokens, width)
    tensor = 2 * tokens * width  # each saved tensor's 16-bit bytes
    te = in_float8(layer, FP8_RECIPES["te"], 2)
    assert [nbytes for _, nbytes in te.saved_tensors] == [tensor // 2, tensor + tensor // 2]
    assert te.saved_bytes == layer.saved_bytes
    assert _priced(layer, "te").activation_bytes == 2 * tensor
    assert _priced(layer, "torchao").activation_bytes == _priced(layer, None).activation_bytes == 2 * tensor
    parts = _priced(layer, "te").activation_parts
    assert (parts["mlp"], parts["attention"]) == (tensor // 2, tensor + tensor // 2)


def test_a_layer_that_does_not_attend_stays_in_16_bits():
    head = LayerCount("2:head", 0, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, (1, 256, 512), 0, (1,), (),
                      {"fwd": (_product(256, 512, 1024),)})
    assert in_float8(head, FP8_RECIPES["te"], 2) == head


def test_a_recipe_is_one_of_the_known_and_a_part_without_fp8_cannot_price_a_float8_product():
    with pytest.raises(EstimateError, match="fp8: choose from te, torchao"):
        Parallelism(fp8="mxfp8")
    no_fp8 = Device(A100.dense_tflops.bf16 * 1e9, 1e9, A100.curve)
    with pytest.raises(EstimateError, match="fp8: the part has no float8 peak"):
        estimate_layer(_layer(256, 256), no_fp8, Parallelism(fp8="te"), LINK, 2)


@pytest.mark.parametrize("command", ["estimate", "simulate", "sweep", "tune"])
def test_fp8_on_a_part_without_an_fp8_peak_is_refused_by_every_what_if_command(tmp_path, monkeypatch, command):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    more = {"estimate": ("--out", "e.json"), "sweep": ("--out", "r.csv"), "tune": ("-D", "2")}.get(command, ())
    code, _, err = pipesim(command, "--gpu", "a100-sxm-80gb", *SMALL, "--dtype", "fp8", *more)
    assert code == 2 and "--dtype fp8: a100-sxm-80gb has no FP8 peak in the catalogue" in err, err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def _small(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args` after the small gpt's flags (SMALL) that `args` does not give itself; none where it names a model."""
    if "--model" in args:
        return args
    pairs = zip(SMALL[::2], SMALL[1::2], strict=True)
    return (*(part for flag, value in pairs if flag not in args for part in (flag, value)), *args)


@pytest.mark.parametrize("gpu, args, fragment", [
    ("h100-sxm", ("--fp8-recipe", "te"), "--fp8-recipe says how --dtype fp8 runs the linear products"),
    ("h100-sxm", ("--dtype", "fp8", "--fp8-recipe", "mx"), "--fp8-recipe: choose from te, torchao, te-current"),
    # no transformer layer: nothing runs in float8, yet it was priced with TransformerEngine's float8 module calls
    ("h100-sxm", ("--model", "mlp", "--dtype", "fp8"), "--dtype fp8: pipesim prices float8 in a transformer layer's "
                                                       "linear products, and mlp has none: give --dtype bf16"),
    ("h100-sxm", ("--model", "cnn", "--dtype", "fp8"), "and cnn has none: give --dtype bf16"),
    # shapes the runtime's float8 products refuse (`check_float8_shapes`): the rank's, TransformerEngine's multiples
    (("h100-sxm", ("--width", "1000", "--dtype", "fp8"), "--fp8-recipe te: layer 1:_Block has a product of 1,000 to "
      "3,000 features on 64 rows a rank, and the recipe's float8 kernels take input features in multiples of 16: give "
      "--dtype bf16, or sizes and a --tensor-parallel and --context-parallel that keep them so")),
    # TransformerEngine asserts on the rank's rows before sequence parallelism gathers them: 24 / 2
    ("h100-sxm", ("--seq-len", "24", "-b", "1", "--tensor-parallel", "2", "--sequence-parallel", "--dtype", "fp8"),
     "a product of 256 to 384 features on 12 rows a rank, and the recipe's float8 kernels take rows in multiples of "
     "8"),
    ("h100-sxm", ("--ffn", "272", "--tensor-parallel", "2", "--dtype", "fp8"), "a product of 136 to 256 features"),
    ("h100-sxm", ("--seq-len", "8", "--dtype", "fp8", "--fp8-recipe", "torchao"), "on 8 rows a rank, and the recipe's "
                                                                                   "float8 kernels take rows in "
                                                                                   "multiples of 16"),
    ("h100-sxm", ("--experts", "4", "--expert-ffn", "272", "--tensor-parallel", "2", "--dtype", "fp8"),
     "a routed expert's product of 136 to 256 features, and the recipe's float8 kernels take input features in "
     "multiples of 16: give --dtype bf16, or sizes and an --expert-tensor-parallel that keep them so"),
])
def test_bad_fp8_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, gpu, args, fragment):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    code, _, err = pipesim("estimate", "--gpu", gpu, *_small(args), "--out", "e.json")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args", [
    ("--ffn", "272"),  # 272 whole, 136 a rank at t = 2
    ("--seq-len", "8"),  # 8 rows: TransformerEngine's multiple, not torch._scaled_mm's
    ("--seq-len", "24", "-b", "1", "--tensor-parallel", "2"),  # 24 rows a rank, gathered by none
    ("--experts", "4", "--expert-ffn", "272", "--tensor-parallel", "2", "--expert-tensor-parallel", "1",
     "--rank-order", "megatron"),  # each expert whole on its rank
])
def test_float8_shapes_the_runtime_takes_are_priced(args):
    pytest.importorskip("torch")
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", *_small(args), "--dtype", "fp8", "-p", "2", "-m", "2",
                             "-s", "1f1b", "--json")
    assert code == 0 and json.loads(out)["results"][0]["makespan_ms"] > 0, err


def test_simulate_sweep_tune_and_estimate_take_fp8_and_the_estimate_records_its_recipe(tmp_path):
    pytest.importorskip("torch")
    big = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "4096", "--heads", "32", "--seq-len",
           "2048", "--vocab", "1024", "--attention", "flash", "-p", "2", "-m", "4", "-s", "1f1b")

    def makespan(*args) -> float:
        code, out, err = pipesim("simulate", *big, *args, "--json")
        assert code == 0, err
        return json.loads(out)["results"][0]["makespan_ms"]

    bf16, te, torchao = makespan(), makespan("--dtype", "fp8"), makespan("--dtype", "fp8", "--fp8-recipe", "torchao")
    assert te < torchao < bf16
    code, _, err = pipesim("estimate", *big[:-4], "--dtype", "fp8", "--out", tmp_path / "e.json")
    assert code == 0, err
    estimate = json.loads((tmp_path / "e.json").read_text())["estimate"]
    assert estimate["parallelism"]["fp8"] == "te"
    code, _, err = pipesim("sweep", *big, "--dtype", "fp8", "-j", 1, "--out", tmp_path / "r.csv")
    assert code == 0, err
    code, out, err = pipesim("tune", *big[:-6], "-D", 4, "-s", "1f1b", "--dtype", "fp8", "--json")
    assert code == 0 and 0 < json.loads(out)["choice"]["mfu"] < 1, err


@pytest.mark.parametrize("dtype, peak", [("fp8", "dense peak in bfloat16 (under fp8 too)"),
                                         ("fp32", "dense peak in float32")])
def test_simulate_and_tune_name_the_peak_mfu_is_over_alike(dtype, peak):
    """MFU under --dtype fp8 stays over the bfloat16 peak (docs/hardware.md): simulate's caption said "over the GPUs'
    dense peak", tune's "in bfloat16", docs/simulate.md "in the model's dtype"; both captions name it, in words of
    one function (`ModelWork.mfu_text`)."""
    pytest.importorskip("torch")
    captions = []
    for command in (("simulate", "-p", 2, "-m", 4, "-s", "1f1b"), ("tune", "-D", 4, "-s", "1f1b")):
        code, out, err = pipesim(*command, "--gpu", "h100-sxm", *SMALL, "--dtype", dtype)
        assert code == 0, err
        captions.append(" ".join(out.split()))
    simulated, tuned = captions
    assert f"torchtitan counts) per second over the GPUs' {peak}" in simulated, simulated
    assert f"torchtitan counts) per second over the 4 GPUs' {peak}" in tuned, tuned


def test_te_casts_the_weights_once_a_step_with_the_update_and_torchao_in_the_passes():
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import estimate_profile
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=64, vocab=128), 1, torch.bfloat16,
                          "flash")
    plain, te, torchao = (estimate_profile(counted, H100, Parallelism(fp8=fp8)) for fp8 in (None, "te", "torchao"))
    bandwidth = H100.memory_bandwidth_gb_s * 1e6 * H100.curve.memory_efficiency
    products = [op for layer in counted.layers[1:3] for op in layer.ops["fwd"] if op.kind == "matmul"
                and op.shape[0] == 1]  # the two blocks' linear products: each weight n x k cast and transposed
    casts_ms = sum(op.count * (H100.curve.kernel_overhead_ms + op.shape[2] * op.shape[3] * (2 + 2) / bandwidth)
                   for op in products)

    def step_ms(profile) -> float:
        return sum(stage.steps["adam"].step.median_ms for stage in profile.stages)

    assert step_ms(te) - step_ms(plain) == pytest.approx(casts_ms)
    assert step_ms(torchao) == step_ms(plain)


def test_te_holds_its_float8_weight_casts_beside_the_weights_whole_on_every_replica():
    """TransformerEngine keeps each converted weight's cast and its transpose (2 bytes a weight) between steps;
    torchao keeps none. The simulated parameters part grows by exactly that, unsharded by ZeRO-1."""
    pytest.importorskip("torch")
    model = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "512", "--heads", "4", "--seq-len",
             "128", "--vocab", "128", "--attention", "flash", "-p", "1", "-m", "2", "-s", "1f1b",
             "--data-parallel", "2", "--zero", "1")
    block_weights = 512 * 3 * 512 + 512 * 512 + 2 * 512 * 4 * 512  # q/k/v, projection, the MLP's two products

    def parameters_mib(*args) -> float:
        code, out, err = pipesim("simulate", *model, *args, "--json")
        assert code == 0, err
        return json.loads(out)["results"][0]["devices"][0]["peak_memory_parts_mb"]["parameters"]

    bf16 = parameters_mib()
    assert parameters_mib("--dtype", "fp8", "--fp8-recipe", "torchao") == bf16
    assert (parameters_mib("--dtype", "fp8") - bf16) * 2 ** 20 == pytest.approx(2 * 2 * block_weights)
