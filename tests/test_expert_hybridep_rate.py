"""HybridEP across nodes at its own published H100 rate (hardware/gpus.toml `hybridep`, DeepEP's
docs/README_Hybrid-EP.md at 41cad944): the bytes a token carries to each node its experts lie on, its own included,
over the table's algorithm bandwidth at the group's rank count; inside a node, or on a part without the table, as
before."""

from __future__ import annotations

import math

import pytest

from pipesim.hardware.catalogue import DispatcherRates
from pipesim.planning.experts import expert_group
from tests.conftest import simulate_json
from tests.helpers import H100, H200
from tests.helpers import H100_PLACEMENT as PLACEMENT

GPT = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000,
       "--gated", "--experts", 16, "--top-k", 2, "--expert-ffn", 512, "-p", 1, "-m", 4, "-s", "1f1b",
       "--data-parallel", 16, "--expert-parallel", 16, "--rank-order", "megatron", "--host-kernel-us", 0)


def test_the_h100_table_by_rank_count_linear_in_log2_between_and_held_outside():
    rates = H100.curve.hybridep
    assert rates.gb_s(16) == (54.47, 53.35) and rates.gb_s(32) == (47.36, 52.53) and rates.gb_s(64) == (41.24, 46.57)
    assert rates.gb_s(8) == rates.gb_s(16) and rates.gb_s(256) == rates.gb_s(64)
    share = math.log2(24 / 16)  # 24 ranks: 0.58 of the way from 16 to 32 in log2
    assert rates.gb_s(24) == pytest.approx((54.47 + (47.36 - 54.47) * share, 53.35 + (52.53 - 53.35) * share))
    assert H200.curve.hybridep is None  # no published table: priced on the links


def test_hybridep_across_two_nodes_is_the_bytes_to_every_node_reached_over_the_tables_rate():
    """E16 over 2 nodes of 8, 128 experts top 8 (Qwen3-30B-A3B's): a node holds 64 of them and receives a token
    with chance 1 - C(64, 8)/C(128, 8); the token's bytes go to each node reached, its own included, half the time
    at the dispatch's 54.47 GB/s and half at the combine's 53.35, where NCCL's rate on the NIC took the other node's
    share alone."""
    group = expert_group(PLACEMENT, 16, 128, 1, 1, 1, 16, dispatcher="hybridep", order="megatron",
                         expert_tensor=1, hybridep=H100.curve.hybridep)
    assert group.per_node == 8
    token_bytes, reached = 4096 * 2048 * 2, 2 * (1 - math.comb(64, 8) / math.comb(128, 8))
    expected = PLACEMENT.network_link.latency_ms + token_bytes * reached * (1 / 54.47 + 1 / 53.35) / 2 / 1e6
    assert group.all_to_all_ms(8 * token_bytes, copies=8) == pytest.approx(expected)
    on_links = expert_group(PLACEMENT, 16, 128, 1, 1, 1, 16, dispatcher="hybridep", order="megatron",
                            expert_tensor=1)
    assert on_links.all_to_all_ms(8 * token_bytes, copies=8) < 0.6 * expected  # 47 GB/s on the other node's half


def test_hybridep_inside_one_node_stays_on_the_nodes_link():
    within = expert_group(PLACEMENT, 8, 128, 1, 1, 1, 8, dispatcher="hybridep", order="megatron", expert_tensor=1,
                          hybridep=H100.curve.hybridep)
    on_links = expert_group(PLACEMENT, 8, 128, 1, 1, 1, 8, dispatcher="hybridep", order="megatron", expert_tensor=1)
    assert within.all_to_all_ms(8e7, copies=8) == on_links.all_to_all_ms(8e7, copies=8) > 0


def test_simulate_prices_hybridep_at_the_table_on_an_h100_and_on_the_links_elsewhere():
    (hybridep,) = simulate_json(*GPT, "--gpu", "h100-sxm", "--token-dispatcher", "hybridep")
    (deepep,) = simulate_json(*GPT, "--gpu", "h100-sxm", "--token-dispatcher", "deepep")
    assert hybridep["exposed_comm_ms"] > deepep["exposed_comm_ms"]  # 27 GB/s a node against 47 on the NIC
    (hybridep_h200,) = simulate_json(*GPT, "--gpu", "h200", "--token-dispatcher", "hybridep")
    (deepep_h200,) = simulate_json(*GPT, "--gpu", "h200", "--token-dispatcher", "deepep")
    assert hybridep_h200["exposed_comm_ms"] == pytest.approx(deepep_h200["exposed_comm_ms"])


@pytest.mark.parametrize(("table", "field"), [
    ({"ranks": [16, 32], "dispatch_gb_s": [54.47], "combine_gb_s": [53.35, 52.53]}, "dispatch_gb_s"),
    ({"ranks": [32, 16], "dispatch_gb_s": [1.0, 2.0], "combine_gb_s": [1.0, 2.0]}, "ranks"),
])
def test_a_table_without_one_rate_a_rising_count_is_refused(table, field):
    with pytest.raises(ValueError, match=field):
        DispatcherRates(**table, gpus_per_node=8, source="x")


def test_hybridep_on_nodes_of_another_size_than_the_tables_stays_on_the_links():
    """The table was measured at 8 expert-parallel ranks a node; on nodes of 4 a token's bytes split otherwise
    between the NIC and the node's link, so the group is priced on the links as on a part without the table."""
    quads = PLACEMENT.model_copy(update={"gpus_per_node": 4})
    group = expert_group(quads, 16, 128, 1, 1, 1, 16, dispatcher="hybridep", order="megatron",
                         expert_tensor=1, hybridep=H100.curve.hybridep)
    on_links = expert_group(quads, 16, 128, 1, 1, 1, 16, dispatcher="hybridep", order="megatron", expert_tensor=1)
    assert group.per_node == 4 < H100.curve.hybridep.gpus_per_node and group.hybridep_gb_s is None
    assert group.all_to_all_ms(8e7, copies=8) == on_links.all_to_all_ms(8e7, copies=8) > 0
