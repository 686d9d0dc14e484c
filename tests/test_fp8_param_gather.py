"""`--fp8-param-gather`: the weights kept as TransformerEngine's float8 tensors (NeMo's `fp8_params`, Megatron-core's
`--fp8-param-gather`), so the distributed optimizer all-gathers the float8 linears' weights at 1 byte an element
and casts only its float32 shard before the gather, then transposes the gathered weights (NeMo's distributed
Adam, nemo/core/optim/distributed_adam.py; planning/estimate.py `gathered_weight_bytes`, planning/fp8.py
`step_cast_ops`)."""

from dataclasses import replace

import pytest

from pipesim.planning.estimate import EstimateError, Parallelism
from tests.conftest import refused, simulate_json
from tests.helpers import H100

WIDTH, D = 256, 4
SMALL = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "512", "--heads", "4", "--seq-len", "128",
         "--vocab", "128", "--attention", "flash", "-p", "1", "-m", "2", "-s", "1f1b", "--data-parallel", "2")


@pytest.fixture(scope="module")
def estimates():
    """A small gpt's estimates over d = 4 under ZeRO-1 with TransformerEngine's delayed scaling, its weights
    gathered in 16 bits and in float8."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import estimate_profile
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=2, width=WIDTH, heads=4, seq_len=128, vocab=1000), 2, torch.bfloat16,
                          "flash")
    parallel = Parallelism(data=D, sharded_optimizer=True, fp8="te")
    return counted, [estimate_profile(counted, H100, replace(parallel, fp8_param_gather=on), bounds=[0, 4])
                     for on in (False, True)]


def _linear_weights(layer) -> list[int]:
    return [op.count * op.shape[2] * op.shape[3] for op in layer.ops["fwd"] if op.kind == "matmul"
            and op.shape[0] == 1]


def _block(layer) -> bool:
    return any(op.kind in ("attention", "matmul") and op.shape[0] > 1 for op in layer.ops["fwd"])


def test_a_blocks_linear_weights_are_gathered_at_one_byte_with_no_scale(estimates):
    """Each block's float8 linears' n x k weights at 1 byte where bf16 has 2 (the scale-inverses come from the
    reduced amaxes, not the gather); the embedding and head as they are; no pass changes."""
    counted, (plain, gathered) = estimates
    for layer, before, after in zip(counted.layers, plain.layers, gathered.layers):
        assert before.all_gather_bytes is None
        float8 = sum(_linear_weights(layer)) if _block(layer) else 0
        assert after.all_gather_bytes == after.param_bytes - float8
        assert (after.fwd, after.bwd, after.param_bytes) == (before.fwd, before.bwd, before.param_bytes)
    assert any(_block(layer) for layer in counted.layers)


def test_the_step_casts_the_float32_shard_and_transposes_the_gathered_weights(estimates):
    """In place of the cast-transpose of every 16-bit weight (2 bytes read, 2 written an element) the step casts
    its 1/d shard from float32 (4 read, 1 written) and transposes the whole float8 weight (1 read, 1 written)."""
    counted, (plain, gathered) = estimates
    bandwidth = H100.memory_bandwidth_gb_s * 1e6 * H100.curve.memory_efficiency
    weights = [w for layer in counted.layers if _block(layer) for w in _linear_weights(layer)]
    overhead = H100.curve.kernel_overhead_ms

    def casts_ms(per_weight) -> float:
        return sum(kernels * overhead + w * nbytes / bandwidth for w in weights for kernels, nbytes in per_weight)

    def step_ms(profile) -> float:
        return sum(stage.steps["adam"].step.median_ms for stage in profile.stages)

    expected = casts_ms([(1, 5 / D), (1, 2)]) - casts_ms([(1, 4)])
    assert step_ms(gathered) - step_ms(plain) == pytest.approx(expected, rel=1e-6)


def test_the_zero_gather_of_a_float8_run_moves_fewer_bytes_and_the_step_is_shorter():
    """Under ZeRO-1 with p = 1 the stage's buckets' all-gathers before the forward are exposed (planning/buckets.py):
    gathering the float8 weights (2,048 wide, d = 8) exposes less and shortens the step."""
    pytest.importorskip("torch")
    wide = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "2048", "--heads", "16", "--seq-len",
            "128", "--vocab", "128", "--attention", "flash", "-p", "1", "-m", "2", "-s", "1f1b", "--data-parallel", "8")

    def step(*args) -> tuple[float, float]:
        result = simulate_json(*wide, "--zero", "1", "--dtype", "fp8", *args)[0]
        return result["exposed_comm_ms"], result["makespan_ms"]

    gathered, plain = step("--fp8-param-gather"), step()
    assert gathered[0] < plain[0] and gathered[1] < plain[1]


@pytest.mark.parametrize("args, fragment", [
    (("--zero", "1", "--fp8-param-gather"), "--fp8-param-gather says how --dtype fp8 runs the linear products"),
    (("--zero", "1", "--dtype", "fp8", "--fp8-recipe", "torchao", "--fp8-param-gather"),
     "--fp8-param-gather: TransformerEngine's float8 weights all-gathered by the distributed optimizer; give "
     "--fp8-recipe te or te-current, a --precision other than fsdp2 and --expert-parallel 1"),
    (("--dtype", "fp8", "--fp8-param-gather"), "give --zero 1 or 2 (got --zero 0)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, args, fragment):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    assert fragment in refused("simulate", *SMALL, *args, "--html", "s.html")


@pytest.mark.parametrize("given", [dict(fp8="torchao"), dict(fp8="te", precision="fsdp2"), dict(fp8=None),
                                   dict(fp8="te", expert=2)])
def test_parallelism_refuses_it_where_no_transformer_engine_weight_is_gathered_by_zero(given):
    with pytest.raises(EstimateError, match="fp8_param_gather: TransformerEngine's float8 weights"):
        Parallelism(fp8_param_gather=True, **given)


def _memory_parts(*args) -> dict[str, float]:
    """The small gpt's device's memory parts at its peak (MiB) under ZeRO-1 over d = 2, as simulate reports them."""
    return simulate_json(*SMALL, "--zero", "1", *args)[0]["devices"][0]["peak_memory_parts_mb"]


def test_the_float8_weights_are_held_as_their_data_and_transpose_in_place_of_the_16_bit_weight_and_two_casts():
    """A gpt block's linears hold 12·h² weights (qkv 3h², projection h², the MLP's 8h²). TransformerEngine's
    delayed scaling holds each as its 16-bit weight and two float8 casts (the workspace's `weight_fp8` and
    `weight_t_fp8`): 2 bytes an element more than bf16. With the weights kept as float8 tensors the 16-bit weight
    is gone: the float8 data (1 byte, a view into the optimizer's uint8 buffer) and its transpose cache (1 byte),
    as many bytes as bf16's weight. Gradients and optimizer state (the float32 shard) do not move."""
    pytest.importorskip("torch")
    layers, width = 2, 512
    float8_mib = layers * 12 * width ** 2 * 2 / 2**20
    bf16, cast = _memory_parts(), _memory_parts("--dtype", "fp8")
    kept = _memory_parts("--dtype", "fp8", "--fp8-param-gather")
    assert cast["parameters"] - bf16["parameters"] == pytest.approx(float8_mib, abs=1e-6)
    assert kept["parameters"] == pytest.approx(bf16["parameters"], abs=1e-6)
    assert (kept["gradients"], kept["optimizer_state"]) == (cast["gradients"], cast["optimizer_state"])


def test_a_16_bit_optimizer_keeps_a_master_copy_of_float8_weights():
    """NeMo's distributed Adam with `optim.dtype: bf16` keeps no master copy of 16-bit weights (`store_params`
    False: 2 + 2 bytes of moments a parameter) but does of float8 ones (`store_params` True under `fp8_params`,
    in the optimizer's dtype): 2 + 2 + 2, half as much state again; the gradients' part as without."""
    pytest.importorskip("torch")
    sixteen_bit_adam = ("--dtype", "fp8", "--precision", "nemo-bf16-adam")
    cast, kept = _memory_parts(*sixteen_bit_adam), _memory_parts(*sixteen_bit_adam, "--fp8-param-gather")
    assert kept["optimizer_state"] == pytest.approx(1.5 * cast["optimizer_state"], rel=1e-4)
    assert kept["gradients"] == cast["gradients"]
