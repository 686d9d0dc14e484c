"""`pipesim tune --gpu` on a mixture of experts searches the expert-parallel degree E where --expert-parallel is not
given: every E the rank order can place (schedules/ranks.py) competes in the one search, whose bounds and memory
floors each setting's own estimate prices, so the pruned search still gives what the exhaustive one gives."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from pipesim.planning import tune as tuning
from pipesim.schedules import KIND_CODE, Kind
from tests.conftest import pipesim, tune_rows
from tests.helpers import differences, exhaustive, searched_settings

# A 4-block GPT whose MLPs are 8 routed experts (2 a token), on 8 A100s
MOE = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256,
       "--vocab", 1000, "--experts", 8, "--top-k", 2)
FLAGS = ("-D", 8, "-B", 32, "-b", 2, "--recompute", "none")
SCHEDULES = ("-s", "1f1b", "-s", "gpipe", "-s", "zb-h1")


def layouts(settings) -> set[tuple[int, int, int]]:
    """(t, p, E) of each setting."""
    return {(setting.tensor, *setting.depths, setting.expert) for setting in settings}


@pytest.fixture(scope="module", params=["a100-sxm-80gb", "h100-sxm"])
def moe_settings(request):
    """On an A100, and on an H100, whose pipeline transfers hold the compute beside them (`_send_holds_ms`)."""
    return searched_settings(*FLAGS, "--tensor-parallel", 1, model=(MOE[0], request.param, *MOE[2:]))


def test_e_is_searched_over_the_divisors_of_the_experts_each_layout_places(moe_settings):
    """pipesim's rank order draws E from the d = 8/p replicas; Megatron's folds E·ETP over t·d (at t = 2 and ETP = 1,
    twice as many E); a given --expert-parallel stays fixed; a dense model is searched at E = 1 alone."""
    assert layouts(moe_settings) == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 2, 1), (1, 2, 2), (1, 2, 4),
                                     (1, 4, 1), (1, 4, 2)}
    megatron = searched_settings(*FLAGS, "--tensor-parallel", 2, "--rank-order", "megatron",
                                 "--expert-tensor-parallel", 1, model=MOE)
    assert layouts(megatron) == {(2, 1, 1), (2, 1, 2), (2, 1, 4), (2, 1, 8), (2, 2, 1), (2, 2, 2), (2, 2, 4),
                                 (2, 4, 1), (2, 4, 2)}
    given = searched_settings(*FLAGS, "--tensor-parallel", 1, "--expert-parallel", 2, model=MOE)
    assert layouts(given) == {(1, 1, 2), (1, 2, 2), (1, 4, 2)}
    dense = searched_settings(*FLAGS, "--tensor-parallel", 1, model=MOE[:-4])
    assert {setting.expert for setting in dense} == {1}


def test_a_flag_of_dispatch_between_expert_ranks_is_left_out_at_a_searched_e_1_and_a_given_es_refusal_is_said():
    """--token-dispatcher runs between expert-parallel ranks, which E = 1 has none of: E = 1 is searched without it
    (it left E = 1 out, the fastest layout here: 1,288.6 samples/s, where E = 8 under DeepEP gives 1,163.1), at the
    user's t too, and the simulate line tune prints leaves it out, as simulate refuses it there; where the E given is
    refused (DeepEP holding every multiprocessor), that refusal is the one line."""
    dispatched = searched_settings(*FLAGS, "--tensor-parallel", 1, "--token-dispatcher", "deepep", model=MOE)
    assert layouts(dispatched) == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 2, 1), (1, 2, 2), (1, 2, 4),
                                   (1, 4, 1), (1, 4, 2)}
    code, out, err = pipesim("tune", *MOE, *FLAGS, "-s", "1f1b", "--token-dispatcher", "deepep", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["choice"]["expert_parallel"] == 1, doc["choice"]
    line = shlex.split(doc["simulate_command"])
    assert "--token-dispatcher" not in line
    code, out, err = pipesim(*line[1:], "--json")
    assert code == 0, err
    assert json.loads(out)["results"][0]["samples_per_s"] == pytest.approx(doc["choice"]["samples_per_s"], rel=1e-12)
    code, out, err = pipesim("tune", *MOE, *FLAGS, "--tensor-parallel", 1, "--token-dispatcher", "deepep",
                             "--dispatcher-sms", 108, "--expert-parallel", 2)
    assert code == 2 and out == "", err
    assert err.strip().splitlines()[-1] == ("error: --dispatcher-sms 108 of the part's 108 multiprocessors leaves "
                                            "none to compute on; give fewer")


@pytest.mark.parametrize("flags, line", [
    (("--hot-expert-share", 0.9), "error: --hot-expert-share 0.9 is not a share of 8 experts' tokens: from 1/8 "
                                  "(balanced) to 1/2 (each token's 2 copies go to 2 distinct experts)"),
    (("--hot-expert-share", 0.25, "--routing", "random"), "error: --routing random draws each token's experts alike, "
                                                          "where --hot-expert-share names one busiest expert's share: "
                                                          "give one of them"),
    (("--token-dispatcher", "deepep", "--dispatcher-sms", 108),
     "error: --dispatcher-sms 108 of the part's 108 multiprocessors leaves none to compute on; give fewer")])
def test_a_routing_value_no_e_takes_is_refused_though_e_1_is_searched_without_it(flags, line):
    """E = 1 is estimated without routing's and dispatch's flags: every E > 1 refusing their value left E = 1 to
    answer, the value taken without a word."""
    code, out, err = pipesim("tune", *MOE, *FLAGS, "-s", "1f1b", *flags)
    assert (code, out) == (2, ""), out
    assert err.strip().splitlines()[-1] == line


def test_a_dense_model_refuses_routings_flags():
    """A dense model searches E = 1 alone: the flags are refused, not dropped as at a searched E = 1."""
    code, out, err = pipesim("tune", *MOE[:-4], *FLAGS, "-s", "1f1b", "--hot-expert-share", 0.25)
    assert (code, out) == (2, "")
    assert err.strip().splitlines()[-1].startswith("error: --hot-expert-share applies to a mixture of experts' "
                                                   "routing, and the model has no routed experts")


def test_search_over_e_equals_exhaustive_search_and_its_bounds_hold(moe_settings):
    """Under a cap that only the larger E's fit at p = 1, where the experts' weights are spread the most, and with
    every fixed order holding its setting's all-to-alls (each E's own order, not one shared by every E)."""
    prob = tuning.Problem(8, int(0.12 * tuning.GIB), 32, ("1f1b", "gpipe", "zb-h1"))
    found = tuning.tune(moe_settings, prob)
    best, faster, staler, results = exhaustive(moe_settings, prob)
    assert differences(found, best, faster, staler) == []
    assert found.stats.simulated < len(results)
    assert len({result.config.expert for result in results if tuning.allowed(result, prob)}) > 1
    assert any(not tuning.allowed(result, prob) and result.config.expert > 1 for result in results)
    all_to_all = [KIND_CODE[Kind.A2A_F], KIND_CODE[Kind.A2A_B]]
    reducing = [KIND_CODE[Kind.REDUCE], KIND_CODE[Kind.GATHER]]
    lowered = 0  # E > 1 candidates whose critical path, all-to-alls in it, lowers their bound
    for result in results:
        candidate, label = result.candidate, result.config.label()
        assert candidate.schedule.expert_parallel == candidate.setting.expert == result.config.expert, label
        assert np.isin(candidate.schedule.table.kind, all_to_all).any() == (result.config.expert > 1), label
        critical = tuning._with_critical_path(prob, candidate)
        assert result.samples_per_s <= critical.max_samples_per_s <= candidate.max_samples_per_s, label
        lowered += result.config.expert > 1 and critical.max_samples_per_s < candidate.max_samples_per_s
        assert candidate.memory_floor_bytes <= result.peak_memory_bytes, label
        schedule, table = candidate.schedule, candidate.schedule.table
        rows = np.isin(table.kind, reducing)
        stage_ms = np.bincount(table.stage[rows], candidate.costs.op_ms_table(1)[table.stage[rows], table.kind[rows]],
                               minlength=schedule.num_stages) / schedule.minibatches
        device_ms = [stage_ms[schedule.stages_on(d)].sum() for d in range(schedule.num_devices)]
        assert candidate.allreduce_ms == pytest.approx(max(device_ms)), label  # not the all-to-alls
    assert lowered > 0


def test_table_and_json_show_e_and_the_table_fits_80_columns(monkeypatch):
    from pipesim.commands import common

    code, out, err = pipesim("tune", *MOE, *FLAGS, *SCHEDULES, "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = tune_rows(doc)
    assert {row["expert_parallel"] for row in rows} > {8}  # several E among the rows
    for width in (80, 100):
        monkeypatch.setenv("COLUMNS", str(width))
        monkeypatch.setattr(common.stdout, "width", width)
        code, out, err = pipesim("tune", *MOE, *FLAGS, *SCHEDULES)
        assert code == 0, err
        lines = out.splitlines()
        assert max(map(len, lines)) <= width
        header = next(line for line in lines if "schedule" in line and "samples/s" in line).split()
        assert header[header.index("d") + 1] == "E"
        shown = [line.split() for line in lines if line.split()[:1] == ["best"]]
        assert shown[0][6] == str(doc["choice"]["expert_parallel"])
    # E given: one value in every row, said under the table, not a column; a dense model has neither
    for model, said in ((MOE, "E: ranks the routed experts are placed over, 2 in every row;"), (MOE[:-4], None)):
        code, out, err = pipesim("tune", *model, *FLAGS, *SCHEDULES, *("--expert-parallel", 2) * bool(said))
        assert code == 0, err
        header = next(line for line in out.splitlines() if "schedule" in line and "samples/s" in line).split()
        caption = " ".join(out.split())
        assert "E" not in header and (said in caption if said else "E:" not in caption), out


def test_where_each_t_is_refused_for_its_own_reason_the_line_says_each():
    """One replica (--data-parallel 1) places no E = 2 in pipesim's rank order, so t = 2 and 4 are refused for it,
    t = 1 for its 8 stages and t = 8 for the heads: the line said only that t must divide the heads and MLP width,
    which sent the user after --tensor-parallel. The refusal comes after the estimates, so on a loaded host tune's
    progress note (over `NOTE_AFTER_S`) may come before it."""
    code, out, err = pipesim("tune", *MOE, "-D", 8, "-B", 32, "-b", 2, "--data-parallel", 1, "-s", "1f1b",
                             "--expert-parallel", 2)
    *before, line = err.splitlines()
    assert code == 2 and out == "" and line.startswith("error: ") and all(
        note.startswith("tune: estimating") for note in before), err
    assert "; at t = 1: --stages 8: gpt of 4 blocks" in err, err
    assert "; at t = 2, 4: --expert-parallel 2 must divide the data-parallel degree, 1" in err, err
    assert ("; at t = 8: --tensor-parallel 8 does not divide the model's 4 heads: give --tensor-parallel 4; give "
            "--tensor-parallel\n") in err, err


def test_where_no_t_places_the_experts_on_too_few_devices_the_line_asks_for_devices_not_a_t():
    """E = 8 on 4 devices: no replicas d = D/(t·C·p) are a multiple of 8 at any t, and the line ended "give
    --tensor-parallel", with --tensor-parallel 1 given too, which no t could answer."""
    for given in ((), ("--tensor-parallel", 1)):
        code, out, err = pipesim("tune", *MOE, "-D", 4, "--expert-parallel", 8, "-s", "1f1b", *given)
        assert code == 2 and out == "" and err.splitlines()[-1].endswith(
            "must be a multiple of --expert-parallel 8); give more --devices or a smaller --expert-parallel"), err
