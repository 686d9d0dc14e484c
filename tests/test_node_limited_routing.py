"""DeepSeek-V3's node-limited routing in DeepEP's dispatch (planning/experts.py): a token's k experts lie in M of
G expert groups, so a rank or node receives it less often than under routing over all experts. The chances are
checked against every routing of a small model enumerated, and the limit is read from the Hugging Face config."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import node_placement
from pipesim.planning.experts import ExpertGroup, expert_group
from pipesim.workload.count import count_built

ROOT = Path(__file__).resolve().parents[1]
PLACEMENT = node_placement(load_catalogue().find("h800"))


def _enumerated(experts: int, groups: int, chosen: int, top_k: int, held: range) -> Fraction:
    """The chance that `held` experts receive a token: every choice of `chosen` groups alike, then every choice of
    `top_k` experts among theirs alike."""
    size, hits, total = experts // groups, Fraction(0), 0
    for picked in itertools.combinations(range(groups), chosen):
        pool = [e for g in picked for e in range(g * size, (g + 1) * size)]
        ways = math.comb(len(pool), top_k)
        received = sum(1 for routed in itertools.combinations(pool, top_k) if set(routed) & set(held))
        hits += Fraction(received, ways)
        total += 1
    return hits / total


@pytest.mark.parametrize("held", [range(0, 1), range(0, 2), range(0, 3), range(0, 6), range(3, 9)])
def test_a_ranks_or_nodes_chance_of_a_token_is_every_routing_counted(held):
    """12 experts in 4 groups of 3, a token in 2 groups and to 2 experts: a rank inside one group (1 to 3 experts)
    or a node of whole groups (2 of them), each against the enumeration."""
    group = ExpertGroup(4, 2, PLACEMENT.node_link, PLACEMENT.network_link, 12, dispatcher="deepep", groups=(4, 2))
    assert group._receives(len(held), 2) == pytest.approx(float(_enumerated(12, 4, 2, 2, held)), rel=1e-12)


def test_deepseek_v3_at_ep_64_sends_a_token_over_ib_to_at_most_4_of_its_8_nodes():
    """The report's layout, a group of 32 experts a node: 0.45 of a token to each other node (4.6 other nodes a
    token without the limit, 3.2 with it), and its all-to-all over the NIC about a third shorter."""
    free, limited = (expert_group(PLACEMENT, 64, 256, 1, 1, 16, 128, dispatcher="deepep", order="megatron",
                                  expert_tensor=1, groups=groups) for groups in (None, (8, 4)))
    assert limited.groups == (8, 4) and free.groups is None
    assert 7 * free._receives(32, 8) == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert 7 * limited._receives(32, 8) == pytest.approx(7 * 4 / 8 * (1 - math.comb(96, 8) / math.comb(128, 8)))
    nbytes = 4096 * 8 * 7168 * 2
    assert limited.all_to_all_ms(nbytes, 8) < free.all_to_all_ms(nbytes, 8)


def test_a_placement_that_splits_groups_is_priced_without_the_limit():
    """E = 32 of 256 experts, 8 a rank inside a group of 32 and 64 (two whole groups) a node, keeps the limit; 12
    experts in 4 groups of 3 over E = 6 put 2 a rank across two groups, and 6 groups do not divide 256: neither."""
    assert expert_group(PLACEMENT, 32, 256, 1, 1, 1, 32, dispatcher="deepep", order="megatron", expert_tensor=1,
                        groups=(8, 4)).groups == (8, 4)
    assert expert_group(PLACEMENT, 64, 256, 1, 1, 1, 64, dispatcher="deepep", order="megatron", expert_tensor=1,
                        groups=(6, 3)).groups is None
    assert expert_group(PLACEMENT, 6, 12, 1, 1, 1, 6, dispatcher="deepep", order="megatron", expert_tensor=1,
                        groups=(4, 2)).groups is None


def test_the_limit_is_read_from_the_config_where_the_router_has_one():
    deepseek = count_built(f"hf:{ROOT / 'examples' / 'deepseek-v3'}", {"seq_len": 64}, 1, torch.bfloat16)
    assert (deepseek.options["expert_groups"], deepseek.options["groups_per_token"]) == (8, 4)
    qwen = count_built(f"hf:{ROOT / 'examples' / 'qwen3-30b-a3b'}", {"seq_len": 64}, 1, torch.bfloat16)
    assert "expert_groups" not in qwen.options
