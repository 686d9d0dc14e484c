"""How a backward's weight gradients join the accumulated ones (`--grad-accumulation`, planning/estimate.py
`GRAD_ACCUMULATIONS`): separate, torch's autograd, a pass over the held gradients per backward after a stage's
first; fused, inside the weight-gradient product (TransformerEngine's under Megatron's gradient_accumulation_fusion),
and a pass over the weights no product reads only (`unfused_weight_share`). Unless given, as the runtime the
--precision names runs it (`PRECISION_ACCUMULATION`), and every published benchmark's command says what its runs
ran."""

from __future__ import annotations

import json
import shlex
from functools import cache
from pathlib import Path

import pytest
import torch

from pipesim.planning.estimate import (
    PRECISION_ACCUMULATION,
    EstimateError,
    Parallelism,
    estimate_profile,
    unfused_weight_share,
)
from pipesim.planning.scenario import profile_costs
from pipesim.sim.costs import PRECISIONS
from pipesim.workload.count import WorkloadCount, count_built
from tests.conftest import pipesim, simulate_json
from tests.helpers import H100

GPT = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256,
       "--vocab", 1000, "--stages", 2, "-m", 8, "-s", "1f1b")


@cache
def counted() -> WorkloadCount:
    return count_built("gpt", dict(layers=4, width=256, heads=4, seq_len=256, vocab=1000), 1, torch.bfloat16,
                       "flash")


def test_a_separate_accumulation_passes_over_the_held_gradients_and_a_fused_one_over_what_no_product_holds():
    separate = estimate_profile(counted(), H100, Parallelism(pipeline=2, grad_accumulation="separate"))
    fused = estimate_profile(counted(), H100, Parallelism(pipeline=2, grad_accumulation="fused"))
    curve = separate.estimate.curve
    bytes_per_ms = H100.memory_bandwidth_gb_s * 1e6 * curve["memory_efficiency"]
    bounds, unfused_bytes = fused.partition.bounds, []
    for apart, inside, start, stop in zip(separate.stages, fused.stages, bounds, bounds[1:]):
        assert apart.accumulate.median_ms == pytest.approx(
            curve["kernel_overhead_ms"] + 3 * apart.param_bytes / bytes_per_ms, rel=1e-12)
        unfused = sum(layer.param_bytes * unfused_weight_share(count, 2)
                      for layer, count in zip(fused.layers[start:stop], counted().layers[start:stop], strict=True))
        assert 0 < unfused < apart.param_bytes
        unfused_bytes.append(unfused)
        assert inside.accumulate.median_ms == pytest.approx(
            curve["kernel_overhead_ms"] + 3 * unfused / bytes_per_ms, rel=1e-12)
        assert (inside.fwd_ms, inside.bwd_ms, inside.weight_copy) == (apart.fwd_ms, apart.bwd_ms, apart.weight_copy)
    # the first stage's is mostly its embedding table's (1,000 tokens and 256 positions, 256 wide)
    assert unfused_bytes[0] > 10 * unfused_bytes[1]


def test_a_fused_runtime_adds_what_no_product_holds_in_every_backward_and_a_separate_one_after_the_first():
    """Megatron-core's DDP hook adds the gradients no product accumulates into its buffer, which it zeroes at each
    step's start, in every backward (planning/scenario.py `_stage_costs`): the fused pass is each backward's own, B
    and W, the span's first too; torch's autograd writes the first backward's gradient and adds the later ones in
    a pass of their own (the engine's accumulation after a span's first)."""
    for how in ("fused", "separate"):
        measured = estimate_profile(counted(), H100, Parallelism(pipeline=2, grad_accumulation=how))
        priced = profile_costs(measured, "adam", measured.partition.bounds).stages
        for stage, costs in zip(measured.stages, priced, strict=True):
            pass_ms = stage.accumulate.median_ms
            every_ms, after_first_ms = (pass_ms, 0.0) if how == "fused" else (0.0, pass_ms)
            assert pass_ms > 0 and costs.accumulate_ms == after_first_ms
            assert (costs.bwd_ms, costs.wgrad_ms) == (stage.bwd_ms + every_ms, stage.wgrad_ms + every_ms)
            assert costs.igrad_ms == stage.igrad_ms


def test_no_product_accumulates_an_embedding_nor_a_norms_scales_and_shifts_nor_a_bias():
    """Under fused accumulation a product adds its weights' (n, k) gradient into the held one; the embedding's
    table, the LayerNorms' two vectors and the linear layers' biases come out of autograd whole and are added by a
    pass of their own (Megatron-core's DDP hook, Apex's DistributedFusedAdam `_grad_copy`)."""
    embed, block, head = counted().layers[0], counted().layers[1], counted().layers[-1]
    assert unfused_weight_share(embed, 2) == 1.0
    # two LayerNorms (2 x 256 each), the biases of qkv (768), the projection (256) and the MLP (1,024 and 256)
    assert block.param_bytes * unfused_weight_share(block, 2) == pytest.approx(2 * (4 * 256 + 768 + 256 + 1024 + 256))
    # the final LayerNorm (the head has no bias, as Megatron-LM's output layer)
    assert head.param_bytes * unfused_weight_share(head, 2) == pytest.approx(2 * 2 * 256)


def test_the_default_is_the_named_precisions_runtimes_and_anything_else_is_refused():
    """Megatron-LM, Megatron-core and NeMo fuse it (gradient_accumulation_fusion, default True); torch's FSDP2 and
    plain float32 training run autograd's pass; with no precision named, no runtime is: the pass."""
    assert set(PRECISION_ACCUMULATION) == set(PRECISIONS)
    fused = {name for name in PRECISIONS if Parallelism(precision=name).accumulation == "fused"}
    assert fused == {"megatron", "megatron-16bit-grads", "megatron-bf16-moments", "nemo-bf16-adam"}
    assert Parallelism().accumulation == "separate"
    assert Parallelism(precision="megatron", grad_accumulation="separate").accumulation == "separate"
    assert Parallelism(precision="fsdp2", grad_accumulation="fused").accumulation == "fused"
    with pytest.raises(EstimateError, match="grad_accumulation: choose from fused, separate"):
        Parallelism(grad_accumulation="both")


def test_the_simulated_step_charges_each_backward_after_the_first_its_whole_pass_only_when_separate():
    """1F1B over 2 stages, m = 8: each stage's 7 backwards after its first add all their gradients in a pass of
    their own under separate (the default); under fused every backward adds only those no product accumulates."""
    separate, default = simulate_json(*GPT, "--grad-accumulation", "separate")[0], simulate_json(*GPT)[0]
    fused = simulate_json(*GPT, "--grad-accumulation", "fused")[0]
    assert fused["makespan_ms"] < separate["makespan_ms"] == default["makespan_ms"]
    busy = [s["busy_ms"] - f["busy_ms"] for s, f in zip(separate["devices"], fused["devices"])]
    assert all(extra > 0 for extra in busy)


def test_a_bad_value_or_one_without_gpu_is_one_line_exit_2():
    code, out, err = pipesim("simulate", *GPT, "--grad-accumulation", "later")
    assert (code, out) == (2, "") and err.strip() == "error: --grad-accumulation: choose from fused, separate (got " \
                                                      "'later')"
    code, _, err = pipesim("simulate", "--stages", 2, "--grad-accumulation", "fused")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--grad-accumulation" in err


def test_the_costs_line_names_the_accumulation_only_where_it_is_fused():
    """The default (separate) goes unsaid, as the other defaults do; fused is named."""
    code, out, _ = pipesim("simulate", *GPT)
    assert code == 0 and "costs: " in out and "grad accumulation" not in out
    code, out, _ = pipesim("simulate", *GPT, "--grad-accumulation", "fused")
    assert code == 0 and "grad accumulation fused" in " ".join(out.split())
    code, out, _ = pipesim("simulate", *GPT, "--precision", "megatron")  # fused by the precision's default
    assert code == 0 and "grad accumulation fused" in " ".join(out.split())


def test_a_megatron_precision_accumulates_fused_unless_told_otherwise():
    megatron = ("--precision", "megatron")
    default = simulate_json(*GPT, *megatron)[0]
    fused, separate = (simulate_json(*GPT, *megatron, "--grad-accumulation", how)[0] for how in ("fused", "separate"))
    assert default["makespan_ms"] == fused["makespan_ms"] < separate["makespan_ms"]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


# the recorded rows whose runs accumulated otherwise than their benchmark's others: NeMo AutoModel's PyTorch backend
# (FSDP2, autograd's adds: tests/test_published_automodel.py)
OTHER_RUNTIMES = {"nemo-automodel-moe-h100.csv"}


def _commands(name: str) -> list[list[str]]:
    recorded = json.loads((BENCHMARKS / f"{name}.json").read_text())
    return [shlex.split(row["command"]) for row in recorded.get("rows", [recorded])
            if row.get("source") not in OTHER_RUNTIMES]


def _accumulation(args: list[str]) -> str:
    """What a recorded command's step accumulates by: its flag, else its precision's default."""
    given = {flag: args[args.index(flag) + 1] for flag in ("--grad-accumulation", "--precision") if flag in args}
    parallel = Parallelism(precision=given.get("--precision"), grad_accumulation=given.get("--grad-accumulation"))
    return parallel.accumulation


@pytest.mark.parametrize(("benchmark", "ran"), [
    ("published_h100", "fused"),  # NeMo: every dgxc yaml sets gradient_accumulation_fusion true
    ("published_moe", "fused"),  # Megatron-Bridge: wherever the fused kernels are present
    ("published_deepseek", "separate"),  # DeepSeek's framework does not say: the pass it was priced with
    ("published_runs", "separate")])  # Megatron-LM 2021-22: no fusion yet, or off for 16-bit gradients
def test_each_benchmark_command_accumulates_as_its_runs_did(benchmark, ran):
    commands = _commands(benchmark)
    assert commands and {_accumulation(args) for args in commands} == {ran}
    if benchmark != "published_runs":  # the A100 rows by their default: the README quotes one as it is
        assert all(args[args.index("--grad-accumulation") + 1] == ran for args in commands)


def test_tunes_bound_counts_a_fused_accumulations_pass_once_a_backward(tmp_path):
    """Under fused accumulation `_stage_costs` prices the pass in every backward's own B (and W), so tune's bound
    (planning/tune.py `_splitter`'s `stage_ms`, the layers' B summed) holds it already; `_cut_accumulates_ms` added
    it again after each backward but the first, and the bound of a GPU-bound model exceeded the stage's cost by
    m - 1 of them (0.29 ms at m = 8). Cuts off the calibrated one, where each stage's pass is the total shared out
    by its weights' bytes, as the layers' are."""
    import numpy as np

    from pipesim.planning.tune import _cut_accumulates_ms, _splitter
    from pipesim.profiles.schema import load_profile
    from pipesim.schedules import KIND_CODE, Kind

    out = tmp_path / "fused.json"
    code, _, err = pipesim("estimate", "--model", "gpt", "--layers", 4, "--width", 4096, "--heads", 32, "--seq-len",
                           2048, "--gpu", "h100-sxm", "--grad-accumulation", "fused", "-p", 2, "-o", out)
    assert code == 0, err
    measured = load_profile(out)
    split, layers, microbatches = _splitter(measured, "adam"), len(measured.layers), 8
    for cut in set(range(1, layers)) - {measured.partition.bounds[1]}:
        bounds = [0, cut, layers]
        costs = profile_costs(measured, "adam", bounds).stages
        assert all(c.accumulate_ms == 0 for c in costs)
        bound = (microbatches * split.stage_ms(bounds, 1)[:, KIND_CODE[Kind.B]]
                 + (microbatches - 1) * _cut_accumulates_ms(measured, bounds))
        real = np.array([microbatches * c.bwd_ms + (microbatches - 1) * c.accumulate_ms for c in costs])
        assert (bound <= real * (1 + 1e-12)).all(), (cut, bound - real)
