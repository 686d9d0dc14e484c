"""`pipesim tune --gpu` searches the rank order (schedules/ranks.py) where --rank-order is not given: pipesim's, then
Megatron-core's at each layout whose groups it places otherwise. On one node both place every group alike, so the
second adds nothing; across nodes it competes in the one search, whose answer is the better fixed order's."""

from __future__ import annotations

import json
import shlex

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning import tune as tuning
from pipesim.planning.estimate import links_of, node_placement
from pipesim.schedules.ranks import dense_grid
from tests.conftest import pipesim
from tests.helpers import differences, exhaustive, searched_settings
from tests.test_tune_experts import MOE

# two nodes of 8 A100s
ACROSS = ("-D", 16, "-B", 32, "-b", 2, "--recompute", "none", "--tensor-parallel", 1)
CAP_GIB = 0.08  # the p = 1 choice (0.106 GiB at E = 8) over it


def layouts(settings) -> set[tuple[int, int, int, str]]:
    """(t, p, E, rank order) of each setting."""
    return {(setting.tensor, *setting.depths, setting.expert, setting.rank_order) for setting in settings}


def test_on_one_node_the_orders_place_alike_and_only_pipesims_is_estimated():
    searched = searched_settings("-D", 8, "-B", 32, "-b", 2, "--recompute", "none", model=MOE)
    given = searched_settings("-D", 8, "-B", 32, "-b", 2, "--recompute", "none", "--rank-order", "pipesim",
                              model=MOE)
    assert {setting.rank_order for setting in searched} == {"pipesim"}
    assert layouts(searched) == layouts(given)


def test_across_nodes_megatrons_order_adds_the_layouts_it_places_otherwise():
    """At p = 1 both orders number the 16 replicas first, so their groups (and E's, drawn from them) sit alike and
    Megatron-core's adds nothing; at p = 2 and 4 pipesim's order keeps a replica's stages on a node and spreads E over
    replicas on both nodes, Megatron's keeps a stage's 16/p replicas, and so its E, together."""
    settings = searched_settings(*ACROSS, model=MOE)
    pipesims = searched_settings(*ACROSS, "--rank-order", "pipesim", model=MOE)
    megatrons = searched_settings(*ACROSS, "--rank-order", "megatron", model=MOE)
    assert layouts(settings) == layouts(pipesims) | {layout for layout in layouts(megatrons) if layout[1] != 1}
    assert {layout[1] for layout in layouts(megatrons)} == {1, 2, 4}
    assert (1, 2, 8, "megatron") in layouts(settings) and (1, 2, 8, "pipesim") in layouts(settings)
    # pipesim's estimate stands for both where they place alike: its row says "either"
    assert {(*setting.depths, setting.orders_alike) for setting in settings} == {(1, True), (2, False), (4, False)}


def test_orders_that_place_alike_estimate_alike():
    """The premise of leaving the second order out (planning/estimate.py `placed`): at p = 1 each E's profile is
    the same to the byte in either order, but for the order it records (and the minute it was made)."""
    def profiles(order: str) -> dict:
        chosen = {}
        for setting in searched_settings(*ACROSS, "--rank-order", order, model=MOE):
            if setting.depths == (1,):
                document = setting.scenario.measured.model_dump(mode="json")
                assert document["estimate"]["parallelism"].pop("rank_order") == order
                del document["environment"]["date"]  # when it was made: to the minute, which the runs may straddle
                chosen[setting.expert] = document
        return chosen

    def apart(a: object, b: object, path: str = "") -> list[str]:
        """The paths at which two documents differ."""
        if isinstance(a, dict) and isinstance(b, dict):
            return [found for key in a.keys() | b.keys() for found in apart(a.get(key), b.get(key), f"{path}.{key}")]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [found for i, pair in enumerate(zip(a, b)) for found in apart(*pair, f"{path}[{i}]")]
        return [] if a == b else [f"{path}: {a!r} != {b!r}"]

    pipesims, megatrons = profiles("pipesim"), profiles("megatron")
    assert pipesims.keys() == megatrons.keys() == {1, 2, 4, 8}
    assert apart(pipesims, megatrons) == []


def test_the_search_over_both_orders_equals_the_exhaustive_search():
    """Under a cap that leaves p = 1 out (there the orders place alike), where Megatron-core's order wins."""
    settings = searched_settings(*ACROSS, model=MOE)
    prob = tuning.Problem(16, int(CAP_GIB * tuning.GIB), 32, ("1f1b", "zb-h1"))
    found = tuning.tune(settings, prob)
    best, faster, staler, results = exhaustive(settings, prob)
    assert differences(found, best, faster, staler) == []
    assert {result.config.rank_order for result in results} == {"pipesim", "megatron"}
    assert found.choice.result.config.rank_order == "megatron"


def test_tune_chooses_the_better_order_and_its_command_gives_it():
    """The searched choice is the faster of the two fixed orders' (each tuned alone), and its simulate line, which
    gives --rank-order megatron (pipesim's is simulate's default), simulates its figures; the table names each row's
    order where they differ."""
    flags = ("tune", *MOE, *ACROSS, "-s", "1f1b", "-s", "zb-h1", "--memory-gb", CAP_GIB)
    rates = {}
    for order in ("pipesim", "megatron"):
        code, out, err = pipesim(*flags, "--rank-order", order, "--json")
        assert code == 0, err
        rates[order] = json.loads(out)["choice"]["samples_per_s"]
    assert rates["megatron"] > rates["pipesim"]  # p = 2, E = 8: 1,891.6 against 1,881.7
    code, out, err = pipesim(*flags, "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["choice"]["samples_per_s"] == rates["megatron"]
    assert document["choice"]["rank_order"] == "megatron" and "--rank-order megatron" in document["simulate_command"]
    _, *line = shlex.split(document["simulate_command"])  # pipesim simulate ...
    code, out, err = pipesim(*line, "--json")
    assert code == 0, err
    assert json.loads(out)["results"][0]["samples_per_s"] == pytest.approx(rates["megatron"], rel=1e-9)
    code, out, err = pipesim(*flags)
    assert code == 0, err
    header = next(line.split() for line in out.splitlines() if "schedule" in line.split())
    best = next(line.split() for line in out.splitlines() if line.split()[:1] == ["best"])[1:]  # the mark column's
    assert header[header.index("ranks") - 1] == "E" and best[header.index("ranks")] == "megatron", out
    code, given, err = pipesim(*flags, "--rank-order", "megatron")
    assert code == 0, err
    assert "ranks" not in next(line.split() for line in given.splitlines() if "schedule" in line.split())


def test_a_dimension_of_one_rank_runs_within_a_node():
    """Megatron-core numbers the stages outermost: at p = 1 the pipeline's stride is every rank, yet its group is the
    one rank, and no stage boundary crosses a node (the estimate priced it on the network, where pipesim's order at
    the same layout put it on the node's link, and the two orders' estimates differed for nothing)."""
    assert dense_grid("megatron", 1, 1, 1, 16).within_node(("pp",), 8)
    assert not dense_grid("megatron", 1, 1, 2, 16).within_node(("pp",), 8)
    # one replica of 4 context-parallel ranks a stage, 4 stages on two nodes: the gradient group is the stage's 4
    # ranks, on one node, where its d = 1 dimension's stride of 16 ranks had put it on the network
    assert dense_grid("pipesim", 1, 4, 4, 1).within_node(("cp", "dp"), 8)
    links = links_of(node_placement(load_catalogue().find("h100-sxm")), 1, 4, 1, c=4)
    assert links.data.kind == links.context.kind == "nvlink" and links.stage.kind == "infiniband"


def test_tp_overlap_leaves_t_1_searched_without_it():
    """--tp-overlap needs sequence parallelism, which t = 1 has none of: placing t = 1 in Megatron-core's order
    built that refused layout outside the comparison's guard, a traceback; then tune searched t = 2 and up alone,
    though t = 1 has nothing to overlap (gpt-oss-20b on 8 H100s: t = 2 at 18.7 samples/s where t = 1 gives 21.7). It
    searches t = 1 without it, and the simulate line it prints for a t = 1 choice leaves it out, as simulate refuses
    it there, and what else acts at t > 1 alone (--tp-runtime, --loss-parallel: the line was refused)."""
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads",
                             4, "--seq-len", 256, "--vocab", 1000, "-D", 16, "-B", 32, "-b", 2, "--recompute", "none",
                             "--tp-overlap", "--sequence-parallel", "--tp-runtime", "torch", "--loss-parallel", "-s",
                             "1f1b", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {row["tensor_parallel"] for row in (doc["choice"], *doc["runners_up"])} == {1, 2}
    assert doc["choice"]["tensor_parallel"] == 1
    line = shlex.split(doc["simulate_command"])
    assert not {"--tp-overlap", "--sequence-parallel", "--tp-runtime", "--loss-parallel"} & set(line)
    code, out, err = pipesim(*line[1:], "--json")
    assert code == 0, err
    assert json.loads(out)["results"][0]["samples_per_s"] == pytest.approx(doc["choice"]["samples_per_s"], rel=1e-12)
