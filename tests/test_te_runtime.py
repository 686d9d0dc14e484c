"""TransformerEngine's modules beside their products (planning/te.py, issue 42): the bias gradients Megatron-core's
linear_qkv takes from its products (`--linear-kernel te`), and delayed scaling's small kernels, the scale-inverse
clones of TransformerEngine 1.x and the amax update around each amax all-reduce."""

import pytest

from pipesim.planning.estimate import EstimateError, Parallelism
from tests.conftest import pipesim, simulate_json
from tests.helpers import H100

WIDTH, FFN, HEADS = 256, 1024, 4
QKV = 3 * WIDTH  # the attention's input projection's outputs, its bias's elements
SMALL = dict(layers=2, width=WIDTH, ffn=FFN, heads=HEADS, seq_len=128, vocab=1000)
GPT = ["--model", "gpt", "--layers", 2, "--width", WIDTH, "--ffn", FFN, "--heads", HEADS, "--seq-len", 128,
       "--vocab", 1000, "-b", 2, "--gpu", "h100-sxm", "-p", 1, "-m", 4, "-s", "1f1b", "--attention", "flash"]


@pytest.fixture(scope="module")
def block():
    """A GPT block with biases (q, k and v one product, as GPT-3's), counted under a fused attention kernel."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", SMALL, 2, torch.bfloat16, attention="flash").layers[1]


def _bias_sums(layer, name: str) -> dict[int, int]:
    """Pass `name`'s `sum` ops by the elements they write (a bias's gradient: its n), with their calls."""
    import math

    return {math.prod(op.shape): op.count for op in layer.ops[name] if op.op == "sum"}


def test_only_the_attentions_input_projection_takes_its_bias_gradient_from_its_product(block):
    """Megatron-core's linear_qkv adds its own bias (TransformerEngine fuses its gradient: the wgrad GEMM's epilogue
    in 16 bits, the cast-transpose under delayed scaling); linear_proj, linear_fc1 and linear_fc2 hand theirs on to a
    fused kernel (skip_bias_add), whose autograd sums them: the count's two sums to the width and one to the FFN's
    stay, the one to q, k and v goes, in each pass that computes gradients and in none else."""
    from pipesim.planning.te import fused_bias_products

    counted = {name: _bias_sums(block, name) for name in ("bwd", "wgrad")}
    assert counted["wgrad"] == {WIDTH: 2, FFN: 1, QKV: 1}
    assert fused_bias_products(block) == (0,)  # the first product with weights, q, k and v's
    for runtime, fp8, fused in (("te", None, True), ("eager", None, False), (None, "te", True),
                                (None, "te-current", False), (None, "torchao", False)):
        layer = Parallelism(linear_kernel=runtime, fp8=fp8).float8_forms(2).of(block)
        for name, sums in counted.items():
            expected = {n: calls for n, calls in sums.items() if not (fused and n == QKV)}
            assert _bias_sums(layer, name) == expected, (runtime, fp8, name)
        assert _bias_sums(layer, "igrad") == _bias_sums(block, "igrad")


def test_te_runs_a_gpt_with_biases_faster_and_one_without_the_same():
    """The dropped sums price what they moved, and nothing moves where there is no bias (`--no-linear-bias`)."""
    pytest.importorskip("torch")

    def step_ms(*flags) -> float:
        (result,) = simulate_json(*GPT, *flags)
        return result["time_per_minibatch_ms"]

    assert step_ms("--linear-kernel", "te") < step_ms()
    assert step_ms("--linear-kernel", "te", "--no-linear-bias") == step_ms("--no-linear-bias")


@pytest.mark.parametrize("flags, message", [
    (("--dtype", "fp8", "--linear-kernel", "eager"),
     "--linear-kernel eager: --fp8-recipe te runs TransformerEngine's modules; leave --linear-kernel out"),
    (("--dtype", "fp8", "--fp8-recipe", "torchao", "--linear-kernel", "te"),
     "--linear-kernel te: --fp8-recipe torchao runs linear layers of its own; leave --linear-kernel out"),
    (("--linear-kernel", "apex"), "--linear-kernel: choose from eager, te (got 'apex')")])
def test_a_linear_kernel_the_recipe_does_not_run_is_refused_in_one_line(flags, message):
    code, out, err = pipesim("simulate", *GPT, *flags)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_parallelism_refuses_eager_layers_under_transformer_engines_recipe():
    with pytest.raises(EstimateError, match="TransformerEngine's modules"):
        Parallelism(linear_kernel="eager", fp8="te-current")


def test_delayed_scaling_clones_each_modules_scale_inverses_once_a_forward(block):
    """TransformerEngine 1.x's four modules of a block (linear_qkv, linear_proj, linear_fc1, linear_fc2) each clone
    their scale-inverses a forward: 4 small kernels, none under current scaling (2.x) or in the backward."""
    from pipesim.planning.fp8 import FP8_RECIPES, in_float8

    for recipe, calls in (("te", 4), ("te-current", 0)):
        layer = in_float8(block, FP8_RECIPES[recipe], 2)
        clones = {name: sum(op.count for op in ops if op.op == "fp8_scale_inv_clone")
                  for name, ops in layer.ops.items()}
        assert clones == {"fwd": calls, "bwd": 0, "igrad": 0, "wgrad": 0}, recipe


def test_modules_that_read_one_input_are_one():
    """q, k and v as a Hugging Face model's three products read one input, as gate and up: Megatron-core's
    linear_qkv and linear_fc1, one module each; with o and down, 4."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.te import te_modules
    from pipesim.workload.count import count_built

    count = count_built("hf:examples/llama3.1-8b", {"seq_len": 128}, 1, torch.bfloat16,
                        attention="flash")
    decoders = [layer for layer in count.layers if len(layer.weight_grad_outputs) == 7]
    assert len(decoders) == 32 and {te_modules(layer, routed=True) for layer in decoders} == {4}


def test_delayed_scaling_pays_two_small_kernels_around_each_amax_all_reduce():
    """`torch.cat` of the amaxes and the fused amax-and-scale update, at the curve's cost of a kernel, in each
    forward and backward of a chunk under te, with or without an all-reduce (d = 1, t = 1: none); none under
    current scaling or DeepSeek-V3's tile scales, recipes derived from te that keep no amax history."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams
    from pipesim.workload.count import count_built

    count = count_built("gpt", SMALL, 1, torch.bfloat16, attention="flash")
    for fp8, kernels in (("te", 2), ("te-current", 0), ("deepseek", 0)):
        profile = estimate_profile(count, H100, Parallelism(fp8=fp8))
        scenario = profile_scenario(profile, "adam")
        scenario.build("1f1b", ScheduleParams(1, 4))
        overhead_ms = profile.estimate.curve["kernel_overhead_ms"]
        assert scenario.amax_update_ms() == pytest.approx(kernels * overhead_ms, rel=1e-12)
