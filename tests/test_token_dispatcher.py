"""DeepEP's deduplicated token dispatch (`--token-dispatcher deepep`, planning/experts.py): a token crosses to each
other node and rank holding any of its experts once, not once per expert, so an expert-parallel group spanning
nodes sends fewer bytes over the NIC than NCCL's all-to-all of every routed copy; bad values are one line."""

from __future__ import annotations

import math

import pytest

from pipesim.planning.experts import MULTIHOT_OPS, expert_group
from tests.conftest import flags_with, pipesim, simulate_json
from tests.helpers import H100
from tests.helpers import H100_PLACEMENT as PLACEMENT

GPT = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000,
       "--gated", "--experts", 16, "--top-k", 2, "--expert-ffn", 512, "--gpu", "h100-sxm")


def test_deepep_sends_a_token_once_to_each_other_node_and_rank_that_holds_any_of_its_experts():
    """16 experts over E = 4 ranks, 2 on each of 2 nodes, top 2: a rank (4 experts) receives a token with chance
    1 - C(12, 2)/C(16, 2), a node (8 experts) with 1 - C(8, 2)/C(16, 2); one copy a token crosses to the other
    node with the latter, the node's link carries one per other rank receiving it on each node."""
    group = expert_group(PLACEMENT, 4, 16, tensor=1, context=1, pipeline=4, data=4, dispatcher="deepep")
    assert group.per_node == 2
    node, network, token_bytes = PLACEMENT.node_link, PLACEMENT.network_link, 4e6  # one copy of every token
    rank = 1 - math.comb(12, 2) / math.comb(16, 2)
    other_node = 1 - math.comb(8, 2) / math.comb(16, 2)
    inside = node.latency_ms + token_bytes * 2 * 1 * rank / node.bytes_per_ms
    outside = network.latency_ms + token_bytes * 1 * other_node / network.bytes_per_ms
    assert group.all_to_all_ms(2 * token_bytes, copies=2) == pytest.approx(max(inside, outside))
    every_copy = expert_group(PLACEMENT, 4, 16, tensor=1, context=1, pipeline=4, data=4)
    assert every_copy.all_to_all_ms(2 * token_bytes, copies=2) == pytest.approx(
        network.latency_ms + 2 * token_bytes * 2 / 4 / network.bytes_per_ms)  # half the copies leave the node
    assert group.all_to_all_ms(2 * token_bytes, copies=2) < every_copy.all_to_all_ms(2 * token_bytes, copies=2)


def test_hybridep_sends_what_deepep_sends():
    """HybridEP forwards a token to the ranks and nodes holding its experts as DeepEP does: the same bytes on each
    link (the two differ in where a float8 run pads, tests/test_float8_padding.py, and in the multiprocessors they
    hold, tests/test_dispatcher_sms.py)."""
    deepep, hybridep = (expert_group(PLACEMENT, 4, 16, tensor=1, context=1, pipeline=4, data=4, dispatcher=d)
                        for d in ("deepep", "hybridep"))
    every_copy = expert_group(PLACEMENT, 4, 16, tensor=1, context=1, pipeline=4, data=4)
    assert hybridep.all_to_all_ms(8e6, copies=2) == deepep.all_to_all_ms(8e6, copies=2) < every_copy.all_to_all_ms(
        8e6, copies=2)


def test_simulate_with_deepep_spends_less_on_an_all_to_all_across_nodes():
    """E = 16 over two nodes, 2,048 wide: the all-to-alls' exposed time is shorter by what the deduplicated NIC
    bytes save, and the step is shorter by exactly that saving (a minibatch's: the trace's exposed time covers
    all of them) less DeepEP's index conversion (15 kernels a MoE layer's micro-batch, each a kernel's overhead
    and the few KiB it moves: tests/test_deepep_multihot.py), to 1 % of the conversion's time; at this size the
    conversion costs more than the saving (the host free: at its default cost it issues this small model's layers
    slower than the GPU runs them, the all-to-alls hidden under its issue, planning/host.py)."""
    args = flags_with(GPT, "--width", 2048, "-p", 1, "-m", 4, "-s", "1f1b", "--data-parallel", 16,
                      "--expert-parallel", 16, "--host-kernel-us", 0)
    (every_copy,) = simulate_json(*args)
    (deduplicated,) = simulate_json(*args, "--token-dispatcher", "deepep")
    conversion_ms = 2 * 4 * (len(MULTIHOT_OPS["fwd"]) + len(MULTIHOT_OPS["bwd"])) * H100.curve.kernel_overhead_ms
    saved_ms = (every_copy["exposed_comm_ms"] - deduplicated["exposed_comm_ms"]) / every_copy["minibatches"]
    assert every_copy["minibatches"] == deduplicated["minibatches"] and saved_ms > 0.1
    assert every_copy["time_per_minibatch_ms"] - deduplicated["time_per_minibatch_ms"] == pytest.approx(
        saved_ms - conversion_ms, abs=0.01 * conversion_ms)


@pytest.mark.parametrize(("args", "message"), [
    (("--data-parallel", 16, "--expert-parallel", 16, "--token-dispatcher", "nccl"),
     "--token-dispatcher: choose from alltoall, deepep, hybridep (got 'nccl')"),
    (("--data-parallel", 16, "--token-dispatcher", "deepep"),
     "--token-dispatcher dispatches tokens between expert-parallel ranks; give --expert-parallel above 1"),
])
def test_bad_token_dispatcher_is_one_line(args, message):
    code, out, err = pipesim("simulate", *GPT, "-p", 1, "-m", 4, "-s", "1f1b", *args)
    assert code == 2 and not out and err.count("\n") == 1 and message in err and "Traceback" not in err
