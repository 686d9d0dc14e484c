"""Each rule of the parallel layout lives once, in planning/estimate.py's `Parallelism` (and `check_ring_attention`,
`fp8_peak_tflops`; the experts' in planning/experts.py `check_expert_ranks` and schedules/ranks.py
`check_expert_replicas`): the library says its settings by name, the commands say the same refusal with their flags
(commands/common.py `flag_line`), one line and exit 2, before the model is counted or a rank starts. So are the
optimizer's and the precision's names, once in profiles/schema.py `optimizer_refusal` and sim/costs.py
`precision_refusal`; a schedule parameter's bounds, once in schedules/methods.py (`ScheduleParams`'s); and the
count's kernels, once in workload/sizes.py `kernels_refusal`."""

from __future__ import annotations

import pytest

from pipesim.commands.common import flag_line
from pipesim.planning.estimate import EstimateError, Parallelism, check_ring_attention
from pipesim.planning.experts import ExpertParallelError, check_expert_ranks
from pipesim.profiles.schema import optimizer_refusal
from pipesim.schedules import ScheduleError
from pipesim.schedules.methods import (
    MAX_SEARCH_SECONDS,
    ScheduleParams,
    above_zero_refusal,
    elastic_alpha_refusal,
    prediction_refusal,
    zero_refusal,
)
from pipesim.schedules.ranks import RankOrderError, check_expert_replicas
from pipesim.sim.costs import precision_refusal
from pipesim.workload.sizes import kernels_refusal
from tests.conftest import pipesim

GPT = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "4", "--seq-len", "32")


def test_a_refusal_names_each_setting_as_its_reader_does():
    with pytest.raises(EstimateError) as refused:
        Parallelism(tensor=2, tp_overlap=True)
    assert str(refused.value).endswith(": give sequence_parallel too")
    assert str(refused.value).startswith("tp_overlap overlaps sequence parallelism's all-gathers")
    assert flag_line(refused.value).endswith(": give --sequence-parallel too")
    assert flag_line(refused.value).startswith("--tp-overlap overlaps sequence parallelism's all-gathers")
    with pytest.raises(EstimateError) as refused:
        Parallelism(fp8="te", tp_overlap_fp8_buf=True, tensor=2, sequence_parallel=True, tp_overlap=True,
                    tp_runtime="torch")
    assert flag_line(refused.value) == ("--tp-overlap-fp8-buf sets the buffer of TransformerEngine's pipelined "
                                        "reduce-scatters: give --tp-overlap under --tp-runtime megatron")


# Each line written out (the rule's own words, `flag_line` alone could not tell a line that lost its choices)
@pytest.mark.parametrize("flags, layout, says", [
    (("--ema", "disk"), dict(ema="disk"), "--ema: choose from gpu, cpu (got 'disk')"),
    (("--tensor-parallel", "2", "--tp-overlap"), dict(tensor=2, tp_overlap=True),
     "--tp-overlap overlaps sequence parallelism's all-gathers and reduce-scatters with the products (Megatron's "
     "and torch's): give --sequence-parallel too"),
    (("--recompute", "full", "--recompute-modules", "layernorm"),
     dict(recompute="full", recompute_modules=("layernorm",)),
     "--recompute-modules reruns parts of a layer beside --recompute none or selective; --recompute full already "
     "decides what every layer keeps"),
    (("--torch-compile",), dict(torch_compile=True),
     "--torch-compile models what AOTAutograd's partitioner saves of a block compiled inside torch's checkpoint, "
     "as torchtitan runs it: give --recompute op or full (got none)"),
    (("--cp-rotate", "ring", "--context-parallel", "2", "--attention", "flash"), dict(context=2, cp_rotate="ring"),
     "--cp-rotate: choose from alltoall, allgather, p2p (got 'ring')"),
    (("--dispatcher-sms", "20"), dict(dispatcher_sms=20),
     "--dispatcher-sms: the multiprocessors DeepEP's or HybridEP's kernels hold; give --token-dispatcher deepep or "
     "hybridep"),
    (("--token-dispatcher", "nccl"), dict(token_dispatcher="nccl"),
     "--token-dispatcher: choose from alltoall, deepep, hybridep (got 'nccl')"),
    (("--routing", "even"), dict(routing="even"), "--routing: choose from balanced, random (got 'even')"),
    (("--recompute", "op", "--tensor-parallel", "2"), dict(recompute="op", tensor=2),
     "--recompute op (torchtitan's selective op policy) is modelled for --tensor-parallel 1 only (got "
     "--tensor-parallel 2)"),
    (("--dtype", "fp8", "--fp8-recipe", "mxfp8"), dict(fp8="mxfp8"),
     "--fp8-recipe: choose from te, torchao, te-current, deepseek, torchao-2024 (got 'mxfp8')"),
    (("--dtype", "fp8", "--fp8-recipe", "te", "--zero", "3", "--precision", "fsdp2", "--data-parallel", "2",
      "--fsdp-float8-all-gather"), dict(fp8="te", precision="fsdp2", fsdp_float8_all_gather=True),
     "--fsdp-float8-all-gather: FSDP2 casting torchao's float8 weights before it all-gathers them; give "
     "--fp8-recipe torchao or torchao-2024 and --precision fsdp2 (got --fp8-recipe te, --precision fsdp2)"),
])
def test_the_commands_refuse_a_layout_with_the_parallelisms_own_rule(flags, layout, says, tmp_path):
    with pytest.raises(EstimateError) as rule:
        Parallelism(**layout)
    code, out, err = pipesim("estimate", *GPT, *flags, "--out", tmp_path / "p.json")
    assert (code, out, err) == (2, "", f"error: {flag_line(rule.value)}\n")
    assert err == f"error: {says}\n"
    assert "_" not in flag_line(rule.value).split()[0] and not (tmp_path / "p.json").exists()


def test_ring_attention_is_refused_without_a_fused_kernel_in_the_flags_terms(tmp_path):
    with pytest.raises(EstimateError) as rule:
        check_ring_attention(2, "math")
    assert str(rule.value).endswith("give attention flash")
    code, _, err = pipesim("estimate", *GPT, "--attention", "math", "--context-parallel", "2",
                           "--out", tmp_path / "p.json")
    assert code == 2 and err == f"error: {flag_line(rule.value)}\n"
    assert flag_line(rule.value).startswith("--context-parallel: ring attention") and "give --attention flash" in err


@pytest.mark.parametrize("flags, rule, refusal", [
    (("--model", "mlp", "--data-parallel", "2"), lambda: check_expert_ranks(2, None), ExpertParallelError),
    (("--model", "gpt", "--experts", "3", "--data-parallel", "2"), lambda: check_expert_ranks(2, 3),
     ExpertParallelError),
    (("--model", "gpt", "--experts", "4", "--data-parallel", "3"), lambda: check_expert_replicas(2, 3),
     RankOrderError),
    # simulate's rule: E ranks are drawn from the replicas --data-parallel gives (run took d = E where not given)
    (("--model", "gpt", "--experts", "4"), lambda: check_expert_replicas(2, 1), RankOrderError),
])
def test_run_refuses_experts_with_the_planners_own_rule(flags, rule, refusal, tmp_path):
    pytest.importorskip("torch")
    with pytest.raises(refusal) as said:
        rule()
    code, out, err = pipesim("run", "-s", "1f1b", "--expert-parallel", "2", *flags, "--trace", tmp_path / "t.json")
    assert (code, out, err) == (2, "", f"error: {flag_line(said.value)}\n")
    assert err.startswith("error: --expert-parallel 2") and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("command", [("simulate",), ("tune", "-D", "2"),
                                     ("calibrate", "--model", "mlp", "--no-runtime", "--no-contention",
                                      "--no-links", "--out", "p.json"), ("run", "-s", "1f1b", "--model", "mlp")])
def test_every_command_refuses_an_unknown_optimizer_with_the_one_line(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if command[0] in ("calibrate", "run"):
        pytest.importorskip("torch")
    code, out, err = pipesim(*command, "--optimizer", "lamb")
    assert (code, out, err) == (2, "", f"error: {optimizer_refusal('lamb', '--optimizer')}\n")
    assert err == "error: --optimizer: choose from sgd, momentum, adam, adamw (got 'lamb')\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("costs", [(), GPT])
def test_typed_and_estimated_costs_refuse_an_unknown_precision_with_the_one_line(costs):
    with pytest.raises(EstimateError) as rule:
        Parallelism(precision="bf16")
    code, out, err = pipesim("simulate", *costs, "--precision", "bf16")
    assert (code, out, err) == (2, "", f"error: {precision_refusal('bf16', '--precision')}\n")
    assert err == f"error: {flag_line(rule.value)}\n" and err.startswith("error: --precision: choose from fp32, ")


@pytest.mark.parametrize("flags, line, params, says", [
    (("-s", "xpipe", "--prediction", "bogus"), lambda name: prediction_refusal("bogus", name),
     dict(prediction="bogus"), "--prediction: choose from paper, code, counted (got 'bogus')"),
    (("--data-parallel", "2", "--zero", "4"), lambda name: zero_refusal(4, name), dict(zero=4),
     "--zero: choose from 0, 1, 2, 3 (got 4)"),
    (("-s", "avgpipe", "--elastic-alpha", "2"), lambda name: elastic_alpha_refusal(2.0, name),
     dict(elastic_alpha=2.0), "--elastic-alpha: give a finite number above 0 and at most 1 (got 2)"),
    (("-s", "auto", "--fwd", "1", "--bwd", "2", "--search-seconds", "0"),
     lambda name: above_zero_refusal(0.0, name, None if name == "search_seconds" else "0", MAX_SEARCH_SECONDS),
     dict(search_seconds=0.0), "--search-seconds: give a finite number above 0 and at most 86,400 (got 0)"),
    (("-s", "auto", "--fwd", "1", "--bwd", "2", "--search-seconds", "1e12"),  # searched on past 2 minutes, unrefused
     lambda name: above_zero_refusal(1e12, name, None if name == "search_seconds" else "1e12", MAX_SEARCH_SECONDS),
     dict(search_seconds=1e12), "--search-seconds: give a finite number above 0 and at most 86,400 (got 1e12)"),
])
def test_simulate_refuses_schedule_parameters_with_the_schedules_own_rule(flags, line, params, says):
    with pytest.raises(ScheduleError) as rule:
        ScheduleParams(stages=2, microbatches=2, **params)
    field = next(iter(params))
    assert str(rule.value) == line(field)
    code, out, err = pipesim("simulate", *flags)
    assert (code, out, err) == (2, "", f"error: {line('--' + field.replace('_', '-'))}\n")
    assert err == f"error: {says}\n"


@pytest.mark.parametrize("flags, kernels, says", [
    (("--norm-kernel", "apex"), ("torch", "apex", "eager", False),
     "--norm-kernel: choose from eager, fused (got 'apex')"),
    (("--rope-kernel", "apex"), ("torch", "eager", "apex", False),
     "--rope-kernel: choose from eager, fused (got 'apex')"),
    (("--cross-entropy", "apex"), ("apex", "eager", "eager", False),
     "--cross-entropy: choose from torch, megatron (got 'apex')"),
    (("--cross-entropy", "megatron", "--loss-parallel"), ("megatron", "eager", "eager", True),
     "--loss-parallel is torch's cross entropy: leave out --cross-entropy megatron"),
])
def test_the_commands_refuse_the_counts_kernels_with_its_own_line_before_counting(flags, kernels, says, tmp_path):
    code, out, err = pipesim("estimate", *GPT, *flags, "--out", tmp_path / "p.json")
    assert (code, out, err) == (2, "", f"error: {kernels_refusal(*kernels)}\n")
    assert err == f"error: {says}\n" and not (tmp_path / "p.json").exists()


def test_the_count_refuses_its_kernels_with_the_same_line():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built
    from pipesim.workload.models import ModelError

    with pytest.raises(ModelError) as refused:
        count_built("mlp", {"layers": 2, "width": 8}, 1, torch.float32, norm_kernel="apex")
    assert str(refused.value) == kernels_refusal("torch", "apex", "eager", False)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_context_parallelism_of_a_model_without_a_sequence_says_so_before_asking_for_a_fused_kernel(tmp_path, model):
    """mlp and cnn have no sequence to split: the refusal said to give --attention flash first, which could never
    help, then that they have none."""
    code, out, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", model, "--context-parallel", 2,
                             "--out", tmp_path / "p.json")
    assert (code, out, err) == (2, "", f"error: --context-parallel 2 splits the sequence, and {model} has none\n")
    assert not (tmp_path / "p.json").exists()
