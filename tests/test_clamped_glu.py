"""gpt-oss's clamped GLU as Megatron-core runs it (workload/moe.py `routed_experts`' `clamp`): its
`weighted_bias_quick_geglu_impl` clamps the fc1 output's halves and joins them with eager ops before its fused
kernel, and makes its offset a device tensor by a synchronous copy, so the host waits for the GPU before that kernel
(`OpCount.host_waits`, planning/host.py), in the forward and where the backward reruns it ("moe_act", which
Megatron-core reruns at the experts' down product: planning/estimate.py `RERUN_AT_EXPERTS`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipesim.planning.estimate import Regions, _rerun_at_experts
from pipesim.planning.host import pass_kernels, synchronises, waited_ms
from pipesim.workload.count import count_built
from pipesim.workload.hf import _quick_geglu_limit
from tests.conftest import needs_transformers
from tests.helpers import EXPERT_FFN as FFN
from tests.helpers import GPT_OSS, H100, MIXTRAL, B, S, count_config, write_config


def _moe_layer(tmp_path, name: str, fields: dict):
    return count_config(tmp_path / name, fields).layers[1]


@needs_transformers
def test_the_clamped_glu_clamps_its_halves_and_joins_them_before_a_fused_kernel_the_host_waits_for(tmp_path):
    """Between gpt-oss's up product and its fused activation: two clamps of the halves and the cat that joins them,
    the experts' own; the fused kernel the one op of the layer the host waits before (its synchronous copy), in the
    forward and in the "moe_act" region the backward reruns; backward, the clamps' gradients (ge, le and where) and
    the chunk's cat. Mixtral's SwiGLU clamps nothing and its fused kernel waits for nothing."""
    oss, mixtral = _moe_layer(tmp_path, "oss", GPT_OSS), _moe_layer(tmp_path, "mixtral", MIXTRAL)
    names = [op.op for op in oss.ops["fwd"]]
    up, fused = names.index("baddbmm"), names.index("fused_swiglu")
    between = oss.ops["fwd"][up + 1:fused]
    assert [(op.op, op.count, op.routed) for op in between] == [("clamp", 2, True), ("cat", 1, True)]
    assert between[0].shape[-1] == FFN and between[1].shape[-1] == 2 * FFN  # a half each, the whole joined
    assert [op.op for op in oss.ops["fwd"] if op.host_waits] == ["fused_swiglu"]
    assert [op.op for op in oss.region_ops["moe_act"] if op.host_waits] == ["fused_swiglu"]
    assert not any(op.host_waits for name in ("bwd", "igrad", "wgrad") for op in oss.ops[name])
    assert {"ge", "le", "where"} <= {op.op for op in oss.ops["bwd"]}
    assert not any(op.host_waits or op.op == "clamp" for op in mixtral.ops["fwd"])


@needs_transformers
def test_the_moe_act_rerun_runs_where_the_backward_reaches_the_experts_down_product(tmp_path):
    """Megatron-core hangs the "moe_act" checkpoint on linear_fc2's output, so the backward reruns the clamps and
    the fused kernel (with its wait) after the combine's and the down bias's gradients, right before the down
    product's; a "layernorm" rerun stays at the layer backward's start."""
    layer = _moe_layer(tmp_path, "oss", GPT_OSS)
    regions = Regions.of(layer, ("layernorm", "moe_act"))
    assert [op.op for op in regions.at_experts if op.host_waits] == ["fused_swiglu"]
    assert regions.first and not any(op.host_waits for op in regions.first)
    backward = tuple((op, 1.0) for op in layer.ops["bwd"])
    placed = _rerun_at_experts(backward, tuple((op, 1.0) for op in regions.at_experts))
    down = next(i for i, (op, _) in enumerate(backward) if op.routed and op.kind == "matmul")
    assert placed[down:down + len(regions.at_experts)] == tuple((op, 1.0) for op in regions.at_experts)
    assert placed[:down] == backward[:down] and any(op.per_expert for op, _ in placed[:down])


@needs_transformers
def test_the_host_waits_for_the_gpu_before_the_clamped_glus_fused_kernel(tmp_path):
    """With every op 1 ms of GPU and 10 us of issue the host runs ahead, and the GPU waits only for the first
    kernel's issue; the clamped GLU's wait drains the queue, so the GPU waits once more for one kernel's issue. A
    layer holding such an op synchronises even where its experts are padded to their capacity."""
    layer = _moe_layer(tmp_path, "oss", GPT_OSS)
    forward = tuple((op, float(op.count)) for op in layer.ops["fwd"])
    plain = tuple((replace(op, host_waits=False), ms) for op, ms in forward)
    idle = [waited_ms(pass_kernels(ops, [op for op, _ in ops], False, 10.0))[0] for ops in (forward, plain)]
    assert idle == pytest.approx([0.02, 0.01])
    assert synchronises(layer, {"capacity_factor": 1.0})


@needs_transformers
def test_padded_experts_wait_at_the_clamped_glu_and_not_before_their_dispatch(tmp_path, monkeypatch):
    """Experts padded to their capacity dispatch without the host's wait for the tokens each receives; gpt-oss's
    clamped GLU still makes the host wait before its fused kernel (`synchronises`), there alone: the forward's
    kernels are issued with no wait before the dispatch (`pass_kernels`' `synchronised`), dropless ones with it."""
    from pipesim.planning import estimate

    issue = estimate.pass_kernels
    for capacity_factor, dispatch_waits in ((1.0, False), (None, True)):
        count = count_built(f"hf:{write_config(tmp_path / 'oss', GPT_OSS)}",
                            {"seq_len": S, "capacity_factor": capacity_factor}, B, torch.bfloat16)
        waits = []
        monkeypatch.setattr(estimate, "pass_kernels", lambda *args, **kwargs: waits.append(
            (args[4], args[7])) or issue(*args, **kwargs))
        estimate.estimate_profile(count, H100, estimate.Parallelism())
        assert synchronises(count.layers[1], count.options)
        assert {synchronised for name, synchronised in waits if name == "fwd"} == {False, dispatch_waits}, waits


@pytest.mark.parametrize(("fields", "limit"), [({"alpha": 1.702, "limit": 7.0}, 7.0), ({"limit": 10.0}, None),
                                               ({"alpha": 1.702, "limit": float("inf")}, None),
                                               ({"alpha": 1.702, "limit": None}, None)])
def test_only_a_bounded_quick_geglu_is_run_as_megatron_cores_clamped_one(fields, limit):
    """gpt-oss's experts (the gate's sigmoid scaled by `alpha`, clamped at `limit`) are Megatron-core's clamped
    quick-GEGLU; a SwiGLU clamped at a limit (DeepSeek-V4's and MiniMax's experts hold `limit` without `alpha`) is
    not, nor a limit that bounds nothing (Step-3.7's infinite one) or none."""
    experts = torch.nn.Module()
    experts.has_gate = True
    for name, value in fields.items():
        setattr(experts, name, value)
    assert _quick_geglu_limit(experts) == limit
