"""Which fused attention kernel runs a model's attention (`--attention-kernel`): each priced at its published rate
on the part (the catalogue curve's `attention_kernels`; FlashAttention-2's is `attention_efficiency`, the
default), refused where the part has no published figure for it (planning/estimate.py `kernel_curve`)."""

import pytest

from pipesim.planning.estimate import Device, EstimateError, Parallelism, kernel_curve, op_ms
from pipesim.profiles.workload import OpCount
from tests.conftest import flags_with, pipesim, simulate_json
from tests.helpers import A100, H100
from tests.helpers import h100_bf16_on as _on

SEQ, HEADS, HEAD_DIM = 8192, 32, 128
ATTENTION = OpCount("sdpa", "attention", (HEADS, SEQ, SEQ, HEAD_DIM), 4 * HEADS * SEQ * SEQ * HEAD_DIM,
                    4 * HEADS * SEQ * HEAD_DIM * 2, 1, causal=True)
MODEL = ["--model", "gpt", "--layers", 2, "--width", 1024, "--heads", 8, "--seq-len", 4096, "--vocab", 512,
         "--attention", "flash", "--gpu", "h100-sxm"]
# 4 x 8 heads x 4,096 tokens: 1,024 query tiles, where cuDNN's causal tail (measured; FlashAttention-2's is not
# published, so not priced) leaves it faster than FlashAttention-2 (hardware/catalogue.py `attention_fraction`)
RUN = [*MODEL, "-b", 4, "-p", 1, "-m", 2, "-s", "1f1b"]


def test_each_kernel_prices_attention_at_its_published_fraction_of_the_peak():
    """FlashAttention-3's paper measures on H100 SXM5 cuDNN's fused attention at 499-539 TFLOP/s and its own at
    542-616 against FlashAttention-2's 310-335 (head dim 128, 4k-16k tokens): a compute-bound kernel's time is its
    FLOPs over that rate."""
    assert H100.curve.attention_kernels == {"cudnn": 0.52, "flash3": 0.58}
    times = {kernel: op_ms(ATTENTION, _on(kernel)) - H100.curve.kernel_overhead_ms
             for kernel in ("flash2", "cudnn", "flash3")}
    assert times["flash2"] == op_ms(ATTENTION, Device(H100.dense_tflops.bf16 * 1e9, 1e12, H100.curve)) \
        - H100.curve.kernel_overhead_ms
    assert times["flash2"] / times["cudnn"] == pytest.approx(0.52 / 0.35)
    assert times["flash2"] / times["flash3"] == pytest.approx(0.58 / 0.35)


def test_a_kernel_without_a_published_rate_on_the_part_is_refused():
    with pytest.raises(EstimateError, match="attention_kernel: no published cudnn rate for a100-sxm-80gb in its curve"):
        kernel_curve(A100.curve, "cudnn", "a100-sxm-80gb")
    with pytest.raises(EstimateError, match="attention_kernel: choose from flash2, cudnn, flash3"):
        Parallelism(attention_kernel="flash4")


def test_the_simulated_step_runs_faster_on_cudnns_kernel_and_the_default_is_flash2():
    (default,) = simulate_json(*RUN)
    (flash2,) = simulate_json(*RUN, "--attention-kernel", "flash2")
    (cudnn,) = simulate_json(*RUN, "--attention-kernel", "cudnn")
    assert default["time_per_minibatch_ms"] == flash2["time_per_minibatch_ms"]
    assert cudnn["time_per_minibatch_ms"] < flash2["time_per_minibatch_ms"]


@pytest.mark.parametrize("extra, message", [
    (["--attention-kernel", "flash4"], "--attention-kernel: choose from flash2, cudnn, flash3 (got 'flash4')"),
    (["--attention-kernel", "cudnn", "--gpu", "a100-sxm-80gb"],
     "--attention-kernel: no published cudnn rate for a100-sxm-80gb in its curve (published: flash2; a --gpus file "
     "can add attention_kernels)"),
    (["--attention-kernel", "cudnn", "--attention", "math"],
     "--attention-kernel names the fused kernel that runs --attention flash: give --attention flash"),
])
def test_bad_kernels_are_one_line_and_write_nothing(tmp_path, extra, message):
    out = tmp_path / "profile.json"
    code, _, err = pipesim("estimate", *flags_with(MODEL, *extra), "--out", out)
    assert code == 2 and err.strip() == f"error: {message}"
    assert not out.exists()
