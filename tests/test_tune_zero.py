"""`pipesim tune --gpu --zero N [--precision P]` plans every candidate with the sharding the run will use: ZeRO's
stage over its d·C replicas (none where d·C = 1, as its estimate shards; under --precision fsdp2, which shards the
weights, such a layout is not searched), in its memory and its collectives, and the pruned search stays exact: its
least REDUCE is a reduce-scatter's, and under ZeRO-1 none for stage 0, whose bucketed reduce-scatters mostly
overlap its backward."""

from __future__ import annotations

import json

import pytest

from pipesim.planning import tune as tuning
from tests.conftest import at_columns, flags_with, pipesim, refused, tune_rows
from tests.helpers import GPT_CPU, differences, exactly_searched, exhaustive, searched
from tests.helpers import H100_GPU as GPU
from tests.helpers import SMALL_GPT_FLAGS as SMALL_GPT
from tests.helpers import small_gpt_estimated as _estimated
from tests.helpers import small_gpt_searched as _searched

FLAGS = ("-D", 8, "-B", 16, "-b", 1, "--recompute", "none")
SCHEDULES = ("-s", "1f1b,gpipe,zb-h1,interleaved-1f1b")
SHARDED = [pytest.param(("--zero", 1), 1, 0.045, id="zero-1"), pytest.param(("--zero", 2), 2, 0.03, id="zero-2"),
           pytest.param(("--zero", 3, "--precision", "fsdp2"), 3, 0.07, id="zero-3-fsdp2")]


@pytest.mark.parametrize(("flags", "stage", "cap_gib"), SHARDED)
def test_the_pruned_search_equals_the_exhaustive_one_and_every_bound_holds(flags, stage, cap_gib):
    """A 4-layer GPT on 8 H100s under a cap some layouts break: the search's answer is the exhaustive one's, and
    every bound it prunes by holds (tune's least REDUCE priced every stage's as an all-reduce: 50 bounds over the
    simulated steps at ZeRO-1, 0.0914 ms against stage 0's 0.0499 ms REDUCE). Each candidate runs the stage given
    over d >= 2 replicas and none over one; FSDP2's layouts all have two or more."""
    settings, problem = _searched(*FLAGS, *SCHEDULES, *flags)
    assert problem.zero == stage
    capped = tuning.Problem(8, int(cap_gib * tuning.GIB), problem.batch_size, problem.schedules, max_chunks=2,
                            zero=stage)
    results = exactly_searched(settings, capped)
    for result in results:
        config = result.config
        assert config.zero == result.candidate.schedule.zero == (stage if config.replicas > 1 else 0), config.label()
    assert (min(result.config.replicas for result in results) > 1) == (stage == 3)


def _choice(*flags) -> tuple[dict, dict]:
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, "-s", "1f1b", "--memory-gb", 0.06, *flags, "--json")
    assert code == 0, err
    document = json.loads(out)
    return document, document["choice"]


def test_zero_makes_the_widest_layout_fit():
    """Under 0.06 GiB one pipeline stage over 8 replicas holds 0.094 GiB unsharded: over the cap, slower layouts
    chosen; its optimizer state sharded (ZeRO-1) it holds 0.051 GiB and is the choice."""
    _, unsharded = _choice()
    assert (unsharded["stages"], unsharded["replicas"], unsharded["zero"]) != (1, 8, 0)
    document, choice = _choice("--zero", 1)
    assert (choice["stages"], choice["replicas"], choice["zero"]) == (1, 8, 1)
    assert choice["peak_memory_gib"] <= 0.06 and choice["samples_per_s"] > unsharded["samples_per_s"]
    assert document["problem"]["zero"] == 1 and document["problem"]["precision"] is None


def test_under_fsdp2_tune_leaves_out_the_orders_it_cannot_run_and_answers():
    """FSDP2 gathers a stage's weights at a step's first forward and reshards them after its last backward, so an
    order that returns to a mini-batch it left cannot run under it (planning/scenario.py `fsdp2_refusal`): tune
    refuses those shapes by their method, as simulate skips them; a PipeDream shape stopped the whole search with
    simulate's refusal, under the default methods too. Every layout it lists runs under FSDP2."""
    from pipesim.planning.scenario import interleaved_minibatches
    from pipesim.schedules import METHODS, ScheduleParams

    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, "-s", "1f1b,pipedream,avgpipe", "--max-staleness", 1,
                             "--zero", 3, "--precision", "fsdp2", "--json")
    assert code == 0, err
    rows = tune_rows(json.loads(out))
    assert "1f1b" in {row["schedule"] for row in rows}
    for row in rows:
        params = ScheduleParams(row["stages"], row["microbatches"], 2, row["chunks"], row["pipelines"])
        assert interleaved_minibatches(METHODS[row["schedule"]].build(params)) is None, row


def test_the_table_and_json_say_the_sharding(monkeypatch):
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, *SCHEDULES, "--zero", 3, "--precision", "fsdp2",
                             "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["problem"]["zero"] == 3 and document["problem"]["precision"] == "fsdp2"
    assert {row["zero"] for row in tune_rows(document)} == {3}
    for width in (80, 100):
        at_columns(monkeypatch, width)
        code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, *SCHEDULES, "--zero", 2)
        assert code == 0, err
        assert max(map(len, out.splitlines())) <= width
        words = " ".join(out.split())
        assert "ZeRO-2 over the d replicas (d = 1 shards nothing)" in words, words
        assert "reduce-scatter and all-gather" in words
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, "-s", "1f1b", "--zero", 1, "--context-parallel", 2,
                             "--attention", "flash")
    assert code == 0, err
    words = " ".join(out.split())  # C = 2: every layout has d·C >= 2 ranks, none that shards nothing
    assert "ZeRO-1 over the d·2 replicas, " in words and "= 1 shards nothing" not in words, words
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, "-s", "1f1b", "--zero", 1, "--data-parallel", 4)
    assert code == 0, err
    words = " ".join(out.split())  # d given (2 or more): no layout shards nothing
    assert "ZeRO-1 over the d replicas, " in words and "= 1 shards nothing" not in words, words


def test_bad_sharding_is_refused_in_one_line(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gpt = (*GPU, *SMALL_GPT, "-D", 8)
    assert refused("tune", *gpt, "--zero", 4) == "error: --zero: choose from 0, 1, 2, 3 (got 4)\n"
    assert refused("tune", *gpt, "--precision", "fsdp2") == (
        "error: --precision fsdp2 is FSDP2's mixed precision, whose float32 weights are sharded: give --zero 3 (with "
        "--data-parallel 2 or more)\n")
    assert refused("tune", *gpt, "--zero", 1, "--data-parallel", 1).startswith(
        "error: --zero 1 shards over data-parallel replicas: give --data-parallel 2 or more")
    assert refused("tune", *GPU, *SMALL_GPT, "-D", 2, "--tensor-parallel", 2, "--zero", 3, "--precision",
                   "fsdp2") == ("error: --precision fsdp2 shards the weights over d·C ranks: --devices 2 at "
                                "--tensor-parallel 2 leaves one replica; give more devices\n")
    for devices, tensor in ((1, ()), (4, ("--tensor-parallel", 4))):  # every layout d·C = 1: --zero did nothing
        assert refused("tune", *GPU, *SMALL_GPT, "-D", devices, *tensor, "--zero", 1) == (
            f"error: --zero 1 shards over d·C ranks: --devices {devices}{' at --tensor-parallel 4' * bool(tensor)} "
            "leaves one replica; give more devices\n")
    code, out, err = pipesim("tune", *GPU, *SMALL_GPT, "-D", 4, "--tensor-parallel", 2, "--context-parallel", 2,
                             "--attention", "flash", "-B", 8, "-b", 1, "--recompute", "none", "-s", "1f1b", "--zero", 3,
                             "--precision", "fsdp2", "--json")  # d = 1, but d·C = 2 ranks shard: searched
    assert code == 0, err
    layouts = {(row["replicas"], row["context_parallel"], row["zero"]) for row in tune_rows(json.loads(out))}
    assert layouts == {(1, 2, 3)}
    assert refused("tune", *gpt, "--precision", "fp16").startswith("error: --precision: choose from")
    profile = _estimated(tmp_path_factory.mktemp("profile"))  # outside the folder refused() finds nothing written in
    assert refused("tune", "--profile", profile, "-D", 8, "--zero", 1) == (
        "error: --zero 1: tune shards --gpu's estimates; give --gpu NAME and --model in place of --profile\n")
    assert refused("tune", "--profile", profile, "-D", 8, "--precision", "megatron").startswith(
        "error: --precision: a profile holds its weights")


WIDE = ("--width", 512, "--seq-len", 16)  # SMALL_GPT's in place: weights heavy, the floor most of the peak


@pytest.mark.parametrize(("flags", "cap_gib"), [
    pytest.param(("-s", "1f1b,zb-h1", "--zero", 2), 0.09, id="zero-2"),
    pytest.param(("-s", "interleaved-1f1b,zb-v", "--zero", 3, "--precision", "fsdp2"), 0.085, id="zero-3-fsdp2")])
def test_a_layout_the_cap_holds_is_not_left_out_by_its_floor(flags, cap_gib):
    """One stage over 8 replicas of a GPT whose weights outweigh its activations: its floor counted the gradients
    whole at ZeRO-2 (102.3 MB against an 89.3 MB peak) and the weights whole at ZeRO-3 (95.6 MB against 85.3 MB),
    so under a cap between them the fastest layout was left out unsimulated, and the search chose a slower one."""
    settings, problem = searched(*FLAGS, *flags, model=(*GPU, *flags_with(SMALL_GPT, *WIDE)))
    capped = tuning.Problem(8, int(cap_gib * tuning.GIB), problem.batch_size, problem.schedules, zero=problem.zero)
    found = tuning.tune(settings, capped)
    best, faster, staler, _ = exhaustive(settings, capped)
    assert differences(found, best, faster, staler) == []
    choice = best[0][0].config
    assert (choice.stages, choice.replicas) == (1, 8), choice.label()


def test_the_sharded_optimizer_flag_is_zero_1_as_simulate_takes_it():
    """simulate, sweep and estimate take --sharded-optimizer (the same as --zero 1); tune said "No such option:
    --sharded-optimizer" to a user who copied simulate's flags."""
    plans = []
    for flags in (("--zero", 1), ("--sharded-optimizer",)):
        code, out, err = pipesim("tune", *GPU, *SMALL_GPT, *FLAGS, "-s", "1f1b", *flags, "--json")
        assert code == 0, err
        plans.append(json.loads(out))
    assert plans[0]["problem"]["zero"] == plans[1]["problem"]["zero"] == 1
    assert tune_rows(plans[1]) == tune_rows(plans[0]) and {row["zero"] for row in tune_rows(plans[1])} == {1}
    assert pipesim("tune", "--profile", GPT_CPU, "-D", 8, "--sharded-optimizer") == (
        2, "", "error: --sharded-optimizer: tune shards --gpu's estimates; give --gpu NAME and --model in place of "
               "--profile\n")  # the flag given, not the --zero 1 it stands for
