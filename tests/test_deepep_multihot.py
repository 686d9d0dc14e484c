"""DeepEP's path of Megatron-core's flex dispatcher converts the received tokens' top-k indices into each local
expert's routing map and weights (`_DeepepManager._indices_to_multihot`, token_dispatcher.py at Megatron-LM
1e057005 to d98e8a64dd, unless the experimental flag selects the fused converter): planning/experts.py
`ExpertGroup.multihot_conversion`, its kernels after the dispatch's wait, where the host issues them one by one."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

from pipesim.planning.estimate import Parallelism, estimate_profile
from pipesim.planning.experts import MULTIHOT_OPS, expert_group
from pipesim.planning.host import HOST_KERNEL_US
from pipesim.workload.count import WorkloadCount, count_built
from tests.helpers import H100, H100_BF16
from tests.helpers import H100_PLACEMENT as PLACEMENT

EXPERTS, TOP_K, S = 8, 2, 512
GPT = dict(layers=4, width=256, heads=4, seq_len=S, vocab=1000, gated=True, experts=EXPERTS, top_k=TOP_K,
           expert_ffn=512)


@cache
def counted() -> WorkloadCount:
    return count_built("gpt", GPT, 1, torch.bfloat16, "flash")


def test_deepep_converts_what_a_rank_received_after_the_dispatch_and_before_the_permutation():
    """8 experts at top 2 over E = 4 ranks (2 local experts each), 512 tokens a rank: the 4 ranks' 2,048 tokens
    reach a rank with chance 1 - C(6, 2)/C(8, 2) = 13/28, 951 of them, and the conversion's 12 forward ops run on
    their 951 x 2 int64 map right before the count's first routed op (the permutation), its 3 backward ops after
    the backward's and the input pass's; the busiest rank (a hot expert's, 1.6 times the work) converts 1.6 times
    as many. The all-to-all dispatcher and HybridEP convert nothing."""
    layer = counted().layers[1]
    for share, load in ((None, 1.0), (0.3, 1.6)):
        group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=share, dispatcher="deepep")
        local = group.local(layer)
        received = round(4 * S * (1 - math.comb(6, 2) / math.comb(8, 2)) * load)
        forward = local.ops["fwd"]
        at = next(i for i, op in enumerate(forward) if op.routed)
        converted = forward[at:at + len(MULTIHOT_OPS["fwd"])]
        assert [op.op for op in converted] == list(MULTIHOT_OPS["fwd"])
        assert {(op.shape, op.moved_bytes, op.count, op.routed) for op in converted} \
            == {((received, 2), received * 2 * 8, 1, True)}
        assert [op.op for op in forward[at + len(converted):]] == \
            [op.op for op in expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=share,
                                          dispatcher="hybridep").local(layer).ops["fwd"][at:]]
        for name in ("bwd", "igrad"):
            assert [op.op for op in local.ops[name][-3:]] == list(MULTIHOT_OPS["bwd"])
        assert not any(op.op in MULTIHOT_OPS["fwd"] and op.shape[-1] == 2 for op in local.ops["wgrad"])
    for dispatcher in (None, "hybridep"):
        other = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, dispatcher=dispatcher).local(layer)
        assert not any(op.shape == (951, 2) for ops in other.ops.values() for op in ops)


def test_the_conversion_costs_its_kernels_and_after_the_wait_the_hosts_issue_of_each():
    """Against HybridEP, which converts nothing and is priced alike inside a node: with no host cost a MoE layer's
    forward takes the 12 kernels' GPU time more (each a kernel's overhead over a few kilobytes), its backward
    passes the 3's; at the host's 31.9 us a kernel the forward, issued from the queue the dispatch's wait emptied,
    takes 12 issues more, the GPU idle behind the host."""
    device = H100_BF16
    kernel_ms = H100.curve.kernel_overhead_ms + 951 * 2 * 8 / device.memory_bytes_per_ms
    for host_us, forward_ms, backward_ms in ((0.0, 12 * kernel_ms, 3 * kernel_ms),
                                            (HOST_KERNEL_US, 12 * HOST_KERNEL_US / 1e3, 3 * HOST_KERNEL_US / 1e3)):
        deepep, hybridep = (estimate_profile(counted(), H100, Parallelism(pipeline=2, data=8, expert=4,
                                                                            token_dispatcher=dispatcher,
                                                                            host_kernel_us=host_us))
                            for dispatcher in ("deepep", "hybridep"))
        for one, other, layer in zip(deepep.layers[1:4], hybridep.layers[1:4], counted().layers[1:4], strict=True):
            assert layer.dispatched_bytes
            assert one.fwd.median_ms - other.fwd.median_ms == pytest.approx(forward_ms, rel=1e-3)
            assert one.igrad.median_ms - other.igrad.median_ms == pytest.approx(backward_ms, rel=1e-3)
            assert one.wgrad == other.wgrad
