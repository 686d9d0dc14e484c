"""Small all-reduces at scale (issue 42, item 4): NCCL's LL protocol for a few bytes, and TransformerEngine's delayed
scaling, which all-reduces each chunk's amaxes over the t·C·d ranks after its forward and its backward."""

import math

import pytest

from pipesim.hardware import collectives
from tests.conftest import simulate_json
from tests.helpers import H100

# NCCL 2.20.3's tuner (src/graph/tuning.cc at b647562), LL protocol, in us: base latency, hop latency on NVLink
# and on the network, per algorithm
TREE_BASE, TREE_NVLINK_HOP, TREE_NETWORK_HOP = 6.8, 0.6, 5.0
NIC_BYTES_PER_MS = 400 / 8 * 1e6  # one NDR 400 Gb/s NIC a GPU (DGX H100)


def _ll_tree_ms(ranks: int, per_node: int) -> float:
    """A few bytes' all-reduce on NCCL's LL tree: its base and 2((n/k - 1) NVLink hops + log2 k network hops)."""
    nodes = ranks // per_node
    hops_us = (per_node - 1) * TREE_NVLINK_HOP + math.log2(nodes) * TREE_NETWORK_HOP
    return (TREE_BASE + 2 * hops_us) / 1e3


@pytest.mark.parametrize("ranks, per_node, expected_us", [(256, 4, 6.8 + 2 * (3 * 0.6 + 6 * 5.0)),
                                                           (16, 8, 6.8 + 2 * (7 * 0.6 + 1 * 5.0))])
def test_a_few_bytes_take_nccls_ll_tree_whose_latency_grows_with_log2_of_the_nodes(ranks, per_node, expected_us):
    ms = collectives.nccl_ll_all_reduce_ms(16, ranks, per_node, NIC_BYTES_PER_MS)
    assert ms == pytest.approx(expected_us / 1e3 + 2 * 16 / (0.92 / 3.8 * NIC_BYTES_PER_MS), rel=1e-9)
    # the all-reduce NCCL's tuner picks: LL for a few bytes (the Simple protocol's tree hops are 28 us each)
    assert collectives.nccl_all_reduce_ms(16, ranks, per_node, 0.0034, 0.014, NIC_BYTES_PER_MS) == ms


def test_within_a_node_the_ll_rings_14_nvlink_steps_beat_the_trees_by_a_hair():
    ring_us = 6.6 + 14 * 0.6  # the tree's: 6.8 + 2 x 7 x 0.6 = 15.2 us
    expected_ms = ring_us / 1e3 + 16 * 14 / 8 / (NIC_BYTES_PER_MS / 4)
    assert collectives.nccl_ll_all_reduce_ms(16, 8, 8, NIC_BYTES_PER_MS) == pytest.approx(expected_ms, rel=1e-9)


def test_a_large_buffer_stays_on_the_simple_protocol():
    nbytes = 64e6
    simple = collectives.nccl_all_reduce_ms(nbytes, 256, 4, 0.0034, 0.014, NIC_BYTES_PER_MS)
    assert simple < collectives.nccl_ll_all_reduce_ms(nbytes, 256, 4, NIC_BYTES_PER_MS)


# Nemotron-style block on H100: one stage, t = 2, te delayed scaling
GPT = ["--model", "gpt", "--layers", 2, "--width", 256, "--heads", 8, "--seq-len", 256, "--vocab", 512, "-b", 1,
       "--gpu", "h100-sxm", "--tensor-parallel", 2, "-p", 1, "-m", 4, "-s", "1f1b", "--zero", 1]


def _step_ms(recipe: str, d: int) -> float:
    (result,) = simulate_json(*GPT, "--dtype", "fp8", "--fp8-recipe", recipe, "--data-parallel", d)
    return result["time_per_minibatch_ms"]


def test_the_te_step_rises_with_d_by_its_amax_all_reduces_over_the_tensor_and_data_parallel_ranks():
    """The same layout under te and torchao (whose tensorwise scaling reduces no amax across ranks): every other
    data-parallel cost (the reduce-scatter, the all-gather, the sharded step) grows alike with d, so te's step
    rises more by its 2 amax all-reduces a micro-batch (the forward's, the backward's) over t·d ranks, 8 a node:
    from 2 nodes at d = 8 to 64 at d = 256, 5 more network hops up and down the tree."""
    pytest.importorskip("torch")
    m, t = 4, 2
    amax_ms = {d: _ll_tree_ms(t * d, 8) for d in (8, 256)}
    assert amax_ms[256] - amax_ms[8] == pytest.approx(2 * 5 * TREE_NETWORK_HOP / 1e3)
    te_rise = _step_ms("te", 256) - _step_ms("te", 8)
    torchao_rise = _step_ms("torchao", 256) - _step_ms("torchao", 8)
    assert te_rise - torchao_rise == pytest.approx(2 * m * (amax_ms[256] - amax_ms[8]), rel=1e-6)


def test_a_16_bit_run_pays_no_amax_all_reduce():
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=2, width=256, heads=8, seq_len=256, vocab=512), 1, torch.bfloat16)
    for fp8, expected_ms in ((None, 0.0), ("te", _ll_tree_ms(2 * 64, 8))):
        parallel = Parallelism(tensor=2, data=64, fp8=fp8)
        scenario = profile_scenario(estimate_profile(count, H100, parallel), "adam")
        sched = scenario.build("1f1b", ScheduleParams(1, 4, data_parallel=64))
        assert scenario.amax_reduction_ms(sched) == pytest.approx(expected_ms, rel=1e-9)
