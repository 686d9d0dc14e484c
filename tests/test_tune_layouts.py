"""`pipesim tune` plans with the layout a run fixes beyond t, p and d: an estimated --profile's expert-parallel E and
context-parallel C, whose schedules run with them, are the plan's (its rows, labels, devices); with --gpu a given
--context-parallel C is a fixed factor, d = D/(t·p·C), and the pruned search still gives the exhaustive one."""

from __future__ import annotations

import json

import pytest

from pipesim.planning import tune as tuning
from tests.conftest import at_columns, pipesim, refused, tune_rows
from tests.helpers import H100_GPU as GPU
from tests.helpers import SMALL_GPT_FLAGS as SMALL_GPT
from tests.helpers import exactly_searched
from tests.helpers import small_gpt_estimated as _estimated
from tests.helpers import small_gpt_searched as _searched

CONTEXT = ("--context-parallel", 2, "--attention", "flash")
FLAGS = ("-D", 8, "-B", 16, "-b", 1, "--recompute", "none")


def test_a_profile_estimated_over_2_expert_ranks_is_planned_at_e_2(tmp_path):
    """`estimate --expert-parallel 2` writes a profile whose schedules run their all-to-alls over E = 2 ranks: tune
    plans every row at E = 2 and its table says so."""
    path = _estimated(tmp_path, "--experts", 4, "--top-k", 2, "-p", 2, "--data-parallel", 2, "--expert-parallel", 2)
    code, out, err = pipesim("tune", "--profile", path, "-D", 4, "-B", 16, "-s", "1f1b,gpipe", "--json")
    assert code == 0, err
    assert {row["expert_parallel"] for row in tune_rows(json.loads(out))} == {2}
    code, out, err = pipesim("tune", "--profile", path, "-D", 4, "-B", 16, "-s", "1f1b,gpipe")
    assert code == 0, err
    assert "routed experts over E = 2 ranks" in " ".join(out.split())


def test_a_profile_estimated_over_2_context_ranks_plans_d_over_d_divided_by_c(tmp_path, monkeypatch):
    """Each device of a C = 2 estimate's schedules stands for 2 GPUs: on -D 8 GPUs, p·t·d = 4 (not 8 such devices,
    16 GPUs); a D that C does not divide is refused."""
    path = _estimated(tmp_path, *CONTEXT, "-p", 2, "--data-parallel", 2)
    code, out, err = pipesim("tune", "--profile", path, "-D", 8, "-B", 16, "-s", "1f1b,gpipe", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["problem"]["devices"] == 8
    assert {(row["stages"] * row["replicas"], row["context_parallel"]) for row in tune_rows(document)} == {(4, 2)}
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    assert refused("tune", "--profile", path, "-D", 3, "-s", "1f1b") == (
        "error: --devices: give a multiple of 2, as the profile was estimated for t=1 GPUs per stage and C=2 "
        "context-parallel ranks (got 3)\n")


def test_a_given_c_is_a_fixed_factor_and_the_search_equals_the_exhaustive_one():
    """--context-parallel 2 on 8 GPUs: t·p·d = 4 searched, every schedule's device 2 context-parallel ranks whose
    gradients reduce with the d replicas; under a cap only the deeper pipelines fit, the pruned search's answer is the
    exhaustive one's and every bound it prunes by holds."""
    settings, problem = _searched(*FLAGS, *CONTEXT, "-s", "1f1b,gpipe,zb-h1,interleaved-1f1b")
    assert problem.devices == 4 and {s.scenario.measured.estimate.parallelism["context"] for s in settings} == {2}
    assert {(s.tensor, *s.depths) for s in settings} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    capped = tuning.Problem(4, int(0.07 * tuning.GIB), problem.batch_size, problem.schedules, max_chunks=2)
    for result in exactly_searched(settings, capped):
        schedule, config = result.candidate.schedule, result.config
        assert schedule.context_parallel == 2 and schedule.gradient_ranks == 2 * config.replicas, config.label()
        assert config.stages * config.tensor * config.replicas == 4, config.label()


def test_a_searchs_document_counts_the_gpus_as_given_whoever_writes_it():
    """On 8 GPUs at C = 2 the search's devices are 4, each 2 GPUs (`Problem.devices_of`); the search's own document
    names the 8 GPUs --devices gave, as `tune --json` does (it named the 4 devices, which only the command wrote
    over)."""
    settings, problem = _searched(*FLAGS, *CONTEXT, "-s", "1f1b")
    assert tuning.tune(settings, problem).to_dict()["problem"]["devices"] == 8
    assert (problem.devices, problem.gpus) == (4, 8) == (tuning.Problem.devices_of(8, 2), 8)


def test_a_given_c_is_refused_where_it_does_not_divide_the_gpus_or_the_sequence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refused("tune", *GPU, *SMALL_GPT, *CONTEXT[2:], "-D", 6, "--context-parallel", 4, "-s", "1f1b") == (
        "error: --devices: give p stages x d replicas x t GPUs per stage x C context-parallel ranks, a multiple of "
        "--context-parallel 4 (got 6); give --devices 4 or 8, or --context-parallel 2\n")  # 3, 6: not 256's
    assert refused("tune", *GPU, *SMALL_GPT, *CONTEXT, "-D", 8, "--tensor-parallel", 2, "--data-parallel", 4) == (
        "error: --devices: give p stages x d replicas x t GPUs per stage x C context-parallel ranks, a multiple of "
        "--tensor-parallel 2 x --data-parallel 4 x --context-parallel 2 = 16 (got 8); give --devices 16\n")
    assert refused("tune", *GPU, *SMALL_GPT[:-4], "--seq-len", 250, "--vocab", 1000, *CONTEXT, "-D", 8) == (
        "error: --context-parallel 2 does not split the sequence of 250 tokens into 2 x 2 equal chunks (the causal "
        "load balance); give --context-parallel 5 (C must divide --seq-len / 2 = 125)\n")


def test_the_table_and_json_show_c_and_count_every_gpu(monkeypatch):
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, *CONTEXT, "-s", "1f1b,gpipe", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["problem"]["devices"] == 8
    rows = tune_rows(document)
    assert {row["context_parallel"] for row in rows} == {2}
    assert {row["stages"] * row["tensor_parallel"] * row["replicas"] for row in rows} == {4}
    for width in (80, 100):
        at_columns(monkeypatch, width)
        code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, *CONTEXT, "-s", "1f1b,gpipe")
        assert code == 0, err
        assert max(map(len, out.splitlines())) <= width
        words = " ".join(out.split())
        assert words.startswith("gpt on 8 x NVIDIA H100") and "C = 2 context-parallel ranks" in words
        assert "over the 8 GPUs' dense peak" in words


@pytest.mark.parametrize("name, value", [("expert", "x"), ("expert", 0), ("tensor", True), ("data", 2.5),
                                         ("expert_tensor", -1)])
def test_an_estimates_ranks_edited_to_no_whole_number_are_refused_naming_the_field(tmp_path, monkeypatch, name,
                                                                                  value):
    """The commands read an estimate's ranks as int (`Estimate.degrees`, schedules/ranks.py
    `estimated_experts_refusal`): an expert of 'x' or 0 edited into a profile was a traceback."""
    path = _estimated(tmp_path, "--experts", 4, "--top-k", 2, "-p", 2, "--data-parallel", 4, "--expert-parallel", 4)
    document = json.loads(path.read_text())
    document["estimate"]["parallelism"][name] = value
    path.write_text(json.dumps(document))
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    assert refused("simulate", "--profile", path, "-s", "1f1b", "-m", 4, "--data-parallel", 8) == (
        f"error: --profile: profile {path}: estimate: parallelism.{name}: give a whole number of at least 1 (got "
        f"{json.dumps(value)})\n")


def test_a_profile_read_where_its_expert_group_sits_otherwise_says_so_and_tune_plans_where_it_sits_alike(tmp_path):
    """An estimate's all-to-alls are in its layers' times, priced as it placed the E ranks: at p = 2, d = 8 on two
    nodes of 8 H100s, pipesim's order puts 4 of the 8 on a node; at p = 1, d = 16 all 8 share one. simulate read it
    there under "links priced for this run's p and d", with the all-to-alls still crossing the network, sweep too,
    and tune planned p = 1 on that price. simulate's and sweep's captions say which are not priced again; tune plans
    only the depths that place the group alike."""
    from pipesim.planning.scenario import experts_moved
    from pipesim.profiles.schema import load_profile

    path = _estimated(tmp_path, "--experts", 8, "--top-k", 2, "-p", 2, "--data-parallel", 8, "--expert-parallel", 8)
    estimate = load_profile(path).estimate
    assert experts_moved(estimate, 2, 8) is None and experts_moved(estimate, 1, 16) == (4, 8)
    code, out, err = pipesim("simulate", "--profile", path, "-s", "1f1b", "-p", 1, "-m", 4, "--data-parallel", 16)
    assert code == 0, err
    assert ("links priced for this run's p and d, but not the all-to-alls: priced with 4 of the expert-parallel "
            "group's ranks a node, where p=1 d=16 places 8 (estimate at that p and d to price them there)"
            ) in " ".join(out.split()), out
    code, out, err = pipesim("sweep", "--profile", path, "-s", "1f1b", "--stages", "1,2", "--microbatches", 4)
    assert code == 0, err  # at the estimate's d = 8: p = 1 places all 8 on a node
    assert ("the all-to-alls are the profile's, priced with 4 of the expert-parallel group's ranks a node, where p=1 "
            "d=8 places 8") in " ".join(out.split()), out
    code, out, err = pipesim("simulate", "--profile", path, "-s", "1f1b", "-p", 2, "-m", 4, "--data-parallel", 8)
    assert code == 0 and "not the all-to-alls" not in " ".join(out.split()), err
    code, out, err = pipesim("tune", "--profile", path, "-D", 16, "-B", 32, "-s", "1f1b", "--json")
    assert code == 0, err
    assert {row["stages"] for row in tune_rows(json.loads(out))} == {2}


def test_a_profile_estimated_over_4_expert_ranks_runs_where_the_replicas_hold_them(tmp_path, monkeypatch):
    """An estimate's E = 4 expert-parallel ranks are drawn from the replicas (pipesim's rank order): simulate and
    sweep at d = 2, run's searched order at d = 2, and tune at p·d = 8 with p = 4 priced the experts' gradients over
    2 // 4 = 0 ranks, a traceback, and export (one replica) wrote all-to-alls over 4 ranks inside it. simulate, sweep,
    run and export refuse such a d in one line, tune plans only the depths whose d holds them, and says so where none
    does."""
    path = _estimated(tmp_path, "--experts", 4, "--top-k", 2, "-p", 2, "--data-parallel", 4, "--expert-parallel", 4)
    code, out, err = pipesim("tune", "--profile", path, "-D", 8, "-B", 16, "-s", "1f1b", "--json")
    assert code == 0, err
    assert {(row["replicas"], row["expert_parallel"]) for row in tune_rows(json.loads(out))} <= {(4, 4), (8, 4)}
    code, out, err = pipesim("simulate", "--profile", path, "-s", "1f1b", "-m", 4, "--data-parallel", 8)
    assert code == 0, err
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    assert refused("simulate", "--profile", path, "-s", "1f1b", "-m", 4, "--data-parallel", 2).startswith(
        "error: --data-parallel 2: the profile was estimated with --expert-parallel 4, and --expert-parallel 4 must "
        "divide the data-parallel degree, 2: give --data-parallel a multiple of 4")
    assert refused("sweep", "--profile", path, "-s", "1f1b", "--stages", 2, "--microbatches", 4, "--data-parallel",
                   1).startswith("error: --data-parallel 1: the profile was estimated with --expert-parallel 4")
    code, _, err = pipesim("sweep", "--profile", path, "-s", "1f1b", "--stages", 2, "--microbatches", 4)
    assert code == 0, err  # at the estimate's d = 4 (`estimates_replicas`)
    assert refused("run", "--profile", path, "-s", "auto", "--model", "gpt", "--stages", 2, "--data-parallel",
                   2).startswith("error: --data-parallel 2: the profile was estimated with --expert-parallel 4, and "
                                 "--expert-parallel 4 must divide")  # run's searched order: the same traceback
    assert refused("export", "-s", "auto", "--profile", path, "--format", "torch-csv", "-o", "o.csv") == (
        "error: --profile: export writes one replica (d = 1), and the profile was estimated with --expert-parallel 4, "
        "whose ranks its rank order cannot place in one replica: give a profile estimated with --expert-parallel 1\n")
    assert not (tmp_path / "run" / "o.csv").exists()  # it wrote all-to-alls over E = 4 inside one replica
    assert refused("tune", "--profile", path, "-D", 2, "-s", "1f1b") == (
        "error: no pipeline depth p: p must divide --devices 2, be at most the model's 6 layers and leave d = "
        "D/(p·t) replicas over which the profile's rank order places the E = 4 expert-parallel ranks it was "
        "estimated with, as many on a node as its all-to-alls were priced at (p = 2, d = 4)\n")
