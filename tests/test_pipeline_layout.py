"""--stage-cut layout:STRING: Megatron-core's --pipeline-model-parallel-layout (profiles/partition.py
`megatron_layout`, `layout_blocks`), parsed as megatron/core/transformer/pipeline_parallel_layer_layout.py parses it,
refused as its TransformerConfig refuses it, and cut onto the model's layers."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.profiles.partition import PartitionError, equal_blocks, layout_blocks, megatron_layout
from pipesim.traces.trace import read_trace
from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import HEAVY_HEAD_GPT_FLAGS as GPT
from tests.helpers import TINY_DEEPSEEK, write_config

MTP = "MultiTokenPrediction"
HF = ["Embedding", *["DecoderLayer"] * 4, "Norm", "Linear"]  # workload/hf.py's cut: embedding, blocks, norm, head
HF_MTP = [*HF[:-1], MTP, "Linear"]  # with --mtp-layers: the module between the norm and the head


def test_the_string_parses_as_megatron_cores_docstring_and_patterns_say():
    """parse_str_to_list's own examples: "Ettt|(tt|)*29,m|L"; a group then a letter unrolled, commas dropped, an
    empty stage kept (Megatron-core allows one)."""
    assert megatron_layout("Ettt|(tt|)*29,m|L") == ["Ettt", *["tt"] * 29, "m", "L"]
    assert megatron_layout("Et(tt|t|)*2,L") == ["Ettt", "t", "tt", "t", "L"]
    assert megatron_layout("(|tt)*2,tL") == ["", "tt", "tttL"]
    assert megatron_layout("E,t*3|(t*2|)*2L") == ["Ettt", "tt", "tt", "L"]
    assert megatron_layout("E||L") == ["E", "", "L"]


def _rendered(stages: list[str]) -> str:
    """`stages` written with Megatron-core's repeats: a run of one letter as x*n, a run of n equal stages as
    (S|)*n and a comma (the last run as (S|)*(n-1) then S)."""
    def stage_text(stage: str) -> str:
        return "".join(letter if n == 1 else f"{letter}*{n}"
                       for letter, n in ((letter, len(list(run))) for letter, run in itertools.groupby(stage)))

    runs = [(stage_text(stage), len(list(run))) for stage, run in itertools.groupby(stages)]
    *before, (last, n) = runs
    return "".join(f"({text}|)*{k}," if k > 1 else f"{text}|" for text, k in before) + (
        f"({last}|)*{n - 1},{last}" if n > 1 else last)


@given(st.lists(st.text("EtmL", max_size=5), min_size=1, max_size=8))
def test_a_layout_written_with_repeats_parses_back_to_its_stages(stages):
    text = _rendered(stages)
    assert megatron_layout(text) == stages, text


@pytest.mark.parametrize(("layout", "letter"), [("Et|tx|L", "'x'"), ("Et|(tt|tL", "'('"), ("Et|tt)*2|L", "')'"),
                                                ("((t)*2)*2", "'('"), ("Et|tt L", "' '")])
def test_a_character_megatron_core_does_not_know_is_refused(layout, letter):
    with pytest.raises(PartitionError, match=re.escape(f"holds {letter}")):
        megatron_layout(layout)


def test_the_layers_before_the_blocks_go_with_e_and_those_after_with_l_but_the_norm_with_the_last_t_under_mtp():
    """Without MTP the final norm is the post-process stage's, L's; with it, the stage of the last decoder layer's
    (Megatron-core's TransformerBlock.has_final_layernorm_in_this_stage), the MTP layer with the m."""
    assert layout_blocks(HF, 2, megatron_layout("Ett|ttL")) == [0, 3, 7]
    assert layout_blocks(HF, 3, megatron_layout("Ettt|t|L")) == [0, 4, 5, 7]
    assert layout_blocks(HF_MTP, 3, megatron_layout("Ett|tt|mL"), 1, MTP) == [0, 3, 6, 8]
    assert layout_blocks(HF_MTP, 3, megatron_layout("Ett|ttm|L"), 1, MTP) == [0, 3, 7, 8]
    gpt = ["_Embed", *["_Block"] * 8, "Sequential"]
    assert layout_blocks(gpt, 4, megatron_layout("E(tt|)*3ttL")) == equal_blocks(gpt, 4)


def test_a_model_of_one_block_cuts_its_block_not_its_embedding():
    """One block is as common as the embedding: the block is the t (the embedding was, so "E|t|L" left stage 0
    without a layer)."""
    assert layout_blocks(["_Embed", "_Block", "Sequential"], 3, megatron_layout("E|t|L")) == [0, 1, 2, 3]
    one = [*HF[:2], *HF[-2:]]  # the embedding, one decoder layer, the norm and the head
    assert layout_blocks(one, 3, megatron_layout("E|t|L")) == [0, 1, 2, 4]
    assert layout_blocks(one, 2, megatron_layout("E|tL")) == [0, 1, 4]


def test_deepseek_v3s_recipe_layout_gives_two_blocks_a_stage_and_the_mtp_layer_with_the_loss():
    """Megatron-Bridge's DeepSeek-V3 layout, 61 blocks on 32 stages: E and one block, 30 stages of two, then the
    MTP layer with the head."""
    deepseek = ["Embedding", *["DecoderLayer"] * 61, "Norm", MTP, "Linear"]
    assert layout_blocks(deepseek, 32, megatron_layout("Et|(tt|)*30mL"), 1, MTP) == [0, *range(2, 61, 2), 63, 65]


@pytest.mark.parametrize(("stages", "layout", "mtp", "devices", "message"), [
    (3, "Ett|ttL", 0, None, "its 2 stages are not the schedule's 3 model stages (a model copy's): give a layout of 3 "
                            "stages, or the --stages (and --chunks) that make 2"),
    (2, "Ettt|ttL", 0, None, "a layout needs a t for each of the model's 4 blocks (DecoderLayer); it has 5"),
    (2, "tE|tttL", 0, None, "a layout needs E first and L last"),
    (2, "EEtt|ttL", 0, None, "a layout needs E and L once each"),
    (2, "Ett|ttmL", 0, None, "a layout needs an m for each multi-token prediction layer (--mtp-layers 0); it has 1: "
                             "leave the m out, or count an hf: model's with --mtp-layers 1"),
    (2, "Ett|tmtL", 1, None, "a layout needs every t before the first m"),
    (3, "Ett|ttm|mL", 2, None, "a layout needs every m in one stage"),
    (4, "Ett|ttm||L", 1, ((0, 2), (1, 3)), "a layout needs its m in the last stage its device runs"),
    (3, "Ett|ttL|", 0, None, "a layout needs E in the first stage and L in the last"),
    (3, "|Ett|ttL", 0, None, "a layout needs E in the first stage and L in the last"),
])
def test_a_layout_megatron_core_or_pipesim_refuses_names_why(stages, layout, mtp, devices, message):
    with pytest.raises(PartitionError, match=re.escape(message)):
        layout_blocks(HF_MTP if mtp else HF, stages, megatron_layout(layout), mtp, MTP, devices)


def test_a_stage_may_hold_no_layer_as_megatron_core_allows():
    """Megatron-core's own example `E||t|L` (docs/user-guide/features/pipeline_parallel_layout.md), more stages
    than the model has layers, and an empty stage between two of blocks: each empty stage's bound repeats the
    next one's."""
    one = ["_Embed", "_Block", "Sequential"]
    assert layout_blocks(one, 4, megatron_layout("E||t|L")) == [0, 1, 1, 2, 3]
    assert layout_blocks(HF, 4, megatron_layout("Ett||tt|L")) == [0, 3, 3, 5, 7]


def _gpt_profile(data: int = 1):
    """GPT's model (4 blocks between an embedding and a heavy head) estimated on its part, over `data` replicas
    (ZeRO-1 where more than one)."""
    import torch

    from pipesim.hardware.catalogue import load_catalogue
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=4, width=64, heads=2, seq_len=32, vocab=32768), 1, torch.bfloat16)
    return estimate_profile(count, load_catalogue().find("a100-sxm-80gb"),
                            Parallelism(data=data, sharded_optimizer=data > 1))


def test_an_empty_stage_costs_no_compute_and_holds_the_input_it_passes_on():
    """Interleaved 1F1B on 2 x 2 with stage 2 empty: its device still runs the stage's forward and backward for
    every micro-batch, each taking no time, and holds the activation it receives until the backward (its
    `held_bytes`, what stage 1 sends), while stage 3 receives it as before."""
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import Kind, ScheduleParams
    from pipesim.sim.engine import simulate
    from pipesim.traces.metrics import summarize

    scenario = profile_scenario(_gpt_profile(), "adam")
    scenario = replace(scenario, stage_cut="layout:Ett|t||tL")
    sched = scenario.build("interleaved-1f1b", ScheduleParams(2, 4, chunks=2))
    stages = scenario.costs(sched).stages
    empty = stages[2]
    assert (empty.fwd_ms, empty.bwd_ms, empty.param_bytes, empty.activation_bytes) == (0.0, 0.0, 0, 0)
    assert empty.held_bytes == stages[1].output_bytes == empty.output_bytes > 0
    assert [row.microbatch for row in sched.orders[0] if row.stage == 2 and row.kind is Kind.F] == [0, 1, 2, 3]
    costs = scenario.costs(sched)
    unheld = replace(costs, stages=[replace(c, held_bytes=None) if k == 2 else c for k, c in enumerate(stages)])
    peak, peak_unheld = (summarize(simulate(sched, c, scenario.links(sched))).devices[0].peak_memory_mb
                         for c in (costs, unheld))
    assert peak > peak_unheld  # device 0 holds stage 2's inputs in flight
    (cut,) = simulate_json(*GPT, "-p", 2, "-m", 4, "-s", "interleaved-1f1b", "--stage-cut", "layout:Ett|t||tL")
    assert cut["stage_bounds"] == [0, 3, 4, 4, 6]
    code, out, err = pipesim("simulate", *GPT, "-p", 2, "-m", 4, "-s", "interleaved-1f1b", "--stage-cut",
                             "layout:Ett|t||tL")
    assert code == 0 and "model stage 2 holds no layer (--stage-cut)" in " ".join(out.split()), err


def test_an_empty_stage_reduces_and_updates_nothing():
    """Over 4 replicas under ZeRO-1 a stage without weights issues no reduce-scatter nor all-gather (Megatron-core's
    DDP has no bucket for it) and its update waits on none, where a stage with weights pays its collectives."""
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams

    scenario = replace(profile_scenario(_gpt_profile(data=4), "adam"), stage_cut="layout:Ett|t||tL")
    sched = scenario.build("interleaved-1f1b", ScheduleParams(2, 4, chunks=2, data_parallel=4, zero=1))
    stages = scenario.costs(sched).stages
    assert (stages[2].reduce_ms, stages[2].gather_ms, stages[2].opt_ms, stages[2].collective_delay_ms) == (0, 0, 0, 0)
    assert min(stages[1].reduce_ms, stages[1].gather_ms) > 0


def test_a_layout_may_cut_more_stages_than_the_model_has_layers():
    """Megatron-core's `E||t|L` on a gpt of one block (3 layers) into p·v = 4 stages: only a layout may."""
    one = ("--model", "gpt", "--layers", 1, "--width", 64, "--heads", 2, "--seq-len", 32, "--gpu", "a100-sxm-80gb",
           "-p", 2, "-m", 4, "-s", "interleaved-1f1b")
    (cut,) = simulate_json(*one, "--stage-cut", "layout:E||t|L")
    assert cut["stage_bounds"] == [0, 1, 1, 2, 3]
    code, _, err = pipesim("simulate", *one, "--stage-cut", "balanced")
    assert code == 2 and "give at most 3 stages" in err, err


def test_simulate_cuts_as_the_layout_says_and_interleaved_stages_in_megatrons_virtual_order():
    """1F1B on 2 stages and interleaved 1F1B on 2 x 2: the layout giving equal blocks runs as equal-blocks does
    (stage i on device i mod p); an uneven one records its own bounds."""
    for flags, layout in ((("-p", 2, "-m", 4, "-s", "1f1b"), "Ett|ttL"),
                          (("-p", 2, "-m", 4, "-s", "interleaved-1f1b", "--chunks", 2), "Et|t|t|tL")):
        (blocks,) = simulate_json(*GPT, *flags, "--stage-cut", "equal-blocks")
        (cut,) = simulate_json(*GPT, *flags, "--stage-cut", f"layout:{layout}")
        assert cut["stage_bounds"] == blocks["stage_bounds"]
        assert cut["time_per_minibatch_ms"] == blocks["time_per_minibatch_ms"]
    (uneven,) = simulate_json(*GPT, "-p", 2, "-m", 4, "-s", "1f1b", "--stage-cut", "layout:Et|tttL")
    assert uneven["stage_bounds"] == [0, 2, 6]


@pytest.mark.parametrize(("layout", "message"), [
    ("Et|tq|L", "--stage-cut layout:Et|tq|L: stage 1 holds 'q'; a layout has letters E (the embedding)"),
    ("Et|(tt|L", "stage 1 holds '(' (a parenthesis unbalanced, nested or without *n)"),
    ("Et|t|tL", "--stage-cut layout:Et|t|tL: its 3 stages are not the schedule's 2 model stages"),
    ("Et|tL", "a layout needs a t for each of the model's 4 blocks (_Block); it has 2"),
    ("Ett|tmtL", "a layout needs an m for each multi-token prediction layer (--mtp-layers 0); it has 1: leave the m "
                 "out, or count an hf: model's with --mtp-layers 1"),
    # a repeat of 10**11, 10**12 nested, or of 5,000 digits: a MemoryError, minutes, int()'s ValueError, unrolled
    ("Et*99999999999|L", "its repeats unroll to more than 1,000,000 characters"),
    ("E(t*1000000)*1000000|L", "its repeats unroll to more than 1,000,000 characters"),
    (f"Et*{'9' * 5000}|L", "its repeats unroll to more than 1,000,000 characters"),
    (f"E(tt)*{'0' * 5000}3|L", "a layout needs a t for each of the model's 4 blocks (_Block); it has 6"),
])
def test_a_bad_layout_is_one_line_exit_2(layout, message):
    code, out, err = pipesim("simulate", *GPT, "-p", 2, "-s", "1f1b", "--stage-cut", f"layout:{layout}")
    assert code == 2 and not out and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert "--stage-cut balanced" not in err, "a layout's refusal names its own fix, not a cut that drops the layout"


@needs_transformers
def test_an_mtp_layout_runs_the_module_with_the_m(tmp_path):
    """A tiny DeepSeek-V3 with --mtp-layers 1: the layout's m puts the module, and the norm with the last t, on
    the last stage; without --mtp-layers the same layout is refused."""
    config = write_config(tmp_path / "deepseek", TINY_DEEPSEEK)
    args = ("--model", f"hf:{config}", "--seq-len", 64, "--gpu", "h100-sxm", "-p", 2, "-m", 2, "-s", "1f1b")
    (cut,) = simulate_json(*args, "--mtp-layers", 1, "--stage-cut", "layout:Et|tmL")
    assert cut["stage_bounds"] == [0, 2, 6]
    code, _, err = pipesim("simulate", *args, "--stage-cut", "layout:Et|tmL")
    assert code == 2 and ("a layout needs an m for each multi-token prediction layer (--mtp-layers 0); it has 1: "
                          "leave the m out, or count an hf: model's with --mtp-layers 1") in err


GPT_RUN = {"layers": 4, "width": 64, "heads": 2, "seq_len": 32, "vocab": 512}


def test_run_cuts_a_profile_as_a_layout_with_an_empty_stage_and_trains_as_one_process(tmp_path):
    """`run --stage-cut layout:...` on a profile made for two stages: interleaved 1F1B on 2 x 2, stage 2 empty (its
    device clones the activation and passes it on), trains to the losses one process gives; the trace records the
    cut, whose empty stage ran a forward and a backward for every micro-batch."""
    from pipesim.executor import RunSpec
    from pipesim.schedules import Kind
    from pipesim.schedules.table import KIND_CODE
    from tests.conftest import build
    from tests.reference import single_process

    sizes = [str(flag) for name, value in GPT_RUN.items() for flag in (f"--{name.replace('_', '-')}", value)]
    profile, trace = tmp_path / "profile.json", tmp_path / "run.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", *sizes, "-b", 2, "-p", 2, "--dtype", "fp32",
                   "--out", profile).code == 0
    code, out, err = pipesim("run", "--profile", profile, "-s", "interleaved-1f1b", "-p", 2, "-v", 2, "-m", 4, "-n", 2,
                             "--stage-cut", "layout:Ett|t||tL", "--json", "--no-heldout", "--trace", trace)
    assert code == 0, err
    losses: list[float] = []
    single_process(RunSpec(build("gpipe", 1, 4, 2), "gpt", GPT_RUN, microbatch_size=2, lr=0.05), losses)
    np.testing.assert_allclose(json.loads(out)["losses"][0], losses, rtol=1e-5)
    ran = read_trace(trace)
    assert ran.meta.extra["bounds"] == [0, 3, 4, 4, 6]
    for kind in (Kind.F, Kind.B):
        rows = (ran.ops.stage == 2) & (ran.ops.kind == KIND_CODE[kind])
        assert sorted(zip(ran.ops.minibatch[rows], ran.ops.microbatch[rows])) == [(b, j) for b in range(2)
                                                                                  for j in range(4)]


@pytest.mark.parametrize(("flags", "message"), [
    (("--model", "mlp", "--stage-cut", "layout:Et|tL"), "--stage-cut layout:Et|tL: it cuts a profile's layers: give "
                                                        "--profile"),
    (("--profile", PROFILE_PLACEHOLDER := "PROFILE", "--stage-cut", "fit"), "--stage-cut fit: a cut simulate "
                                                                           "searches within each device's memory"),
    (("--profile", PROFILE_PLACEHOLDER, "--stage-cut", "halves"), "--stage-cut: choose from balanced, fit,"),
    (("--profile", PROFILE_PLACEHOLDER, "--stage-cut", "layout:Et|tttL"), "--stage-cut layout:Et|tttL: its 2 stages "
                                                                          "are not the schedule's 4 model stages"),
])
def test_a_stage_cut_run_cannot_take_is_one_line(tmp_path, flags, message):
    profile = tmp_path / "profile.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 64, "--heads", 2,
                   "--seq-len", 32, "--vocab", 512, "-b", 2, "-p", 2, "--dtype", "fp32", "--out", profile).code == 0
    flags = [profile if flag == PROFILE_PLACEHOLDER else flag for flag in flags]
    code, out, err = pipesim("run", *flags, "-s", "interleaved-1f1b", "-p", 2, "-v", 2, "-m", 4, "--no-heldout")
    assert (code, out) == (2, "") and err.count("\n") == 1 and message in err, err


def test_run_searches_auto_for_the_cut_it_runs(tmp_path):
    """`run -s auto --stage-cut layers:1,5` runs the order simulate searches for that cut (it ran the order of the
    profile's own cut, whose second stage split its backward where this one's does not)."""
    from pipesim.schedules.table import KIND_CODE

    profile, ran, predicted = tmp_path / "profile.json", tmp_path / "run.json", tmp_path / "simulated.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 64, "--heads", 2,
                   "--seq-len", 32, "--vocab", 512, "-b", 2, "-p", 2, "--dtype", "fp32", "--out", profile).code == 0
    shape = ("-s", "auto", "-p", 2, "-m", 4, "-n", 2, "--stage-cut", "layers:1,5")
    code, _, err = pipesim("run", "--profile", profile, *shape, "--no-heldout", "--trace", ran)
    assert code == 0, err
    code, _, err = pipesim("simulate", "--profile", profile, *shape, "--optimizer", "sgd", "--trace", predicted)
    assert code == 0, err
    compute = [KIND_CODE[kind] for kind in KIND_CODE if kind.value in ("F", "B", "I", "W")]

    def orders(path):
        ops = read_trace(path).ops
        rows = np.isin(ops.kind, compute)
        return [list(zip(ops.kind[rows & (ops.device == d)], ops.stage[rows & (ops.device == d)],
                         ops.microbatch[rows & (ops.device == d)], ops.minibatch[rows & (ops.device == d)]))
                for d in range(2)]

    assert orders(ran) == orders(predicted)


def test_auto_is_refused_for_its_shape_before_a_layout_for_its_count():
    """auto places one stage a device: at --chunks 2 it says so, not that the layout's 4 stages are not its 2."""
    one = ("--model", "gpt", "--layers", 1, "--width", 64, "--heads", 2, "--seq-len", 32, "--gpu", "a100-sxm-80gb")
    code, _, err = pipesim("simulate", *one, "-p", 2, "-m", 8, "-s", "auto", "--chunks", 2, "--stage-cut",
                           "layout:E||t|L")
    assert code == 2 and "auto places one model stage per device in one pipeline" in err, err


def test_typed_costs_of_no_weights_still_pay_the_all_reduces_latency():
    """Only a cut's empty stage issues no collective: stages the flags give no weights (--param-mb 0, the default)
    still all-reduce, at their ring's latency."""
    flags = ("-s", "1f1b", "--fwd", 1, "--bwd", 2, "--comm", 0.5, "--network-gb-s", 10, "--data-parallel", 4)
    (none,) = simulate_json(*flags, "--param-mb", 0)
    (some,) = simulate_json(*flags, "--param-mb", "1e-6")
    (alone,) = simulate_json(*flags[:-4], "--param-mb", 0)
    assert none["time_per_minibatch_ms"] == pytest.approx(some["time_per_minibatch_ms"], rel=1e-6)
    assert none["time_per_minibatch_ms"] > alone["time_per_minibatch_ms"]


def test_graphpipe_refuses_an_empty_stage_naming_the_cut():
    code, _, err = pipesim("simulate", *GPT, "-p", 3, "-m", 4, "-s", "graphpipe", "--stage-cut", "layout:Ett||ttL")
    assert code == 2 and "--stage-cut layout:Ett||ttL: it leaves model stage 1 without a layer" in err, err


def test_run_takes_a_cut_of_more_stages_than_layers_and_dualpipes_one_copy(tmp_path):
    """`run --stage-cut layout:E||t|L` on a profile of 3 layers (4 stages), `layers:` with an empty stage, and
    DualPipe's cut of one model copy, which a profile's partition of p stages is (refused before as 2p)."""
    one, six = tmp_path / "one.json", tmp_path / "six.json"
    for path, layers in ((one, 1), (six, 4)):
        assert pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", layers, "--width", 64, "--heads",
                       2, "--seq-len", 32, "--vocab", 512, "-b", 2, "-p", 2, "--dtype", "fp32", "--out", path).code == 0
    runs = ((one, ("-s", "interleaved-1f1b", "-v", 2, "--stage-cut", "layout:E||t|L"), [0, 1, 1, 2, 3]),
            (six, ("-s", "interleaved-1f1b", "-v", 2, "--stage-cut", "layers:2,0,2,2"), [0, 2, 2, 4, 6]),
            (six, ("-s", "dualpipe",), [0, 3, 6]),
            (six, ("-s", "dualpipe", "--stage-cut", "layers:2,4"), [0, 2, 6]))
    for profile, flags, bounds in runs:
        trace = tmp_path / "run.json"
        code, _, err = pipesim("run", "--profile", profile, *flags, "-p", 2, "-m", 4, "-n", 1, "--no-heldout",
                               "--trace", trace)
        assert code == 0, (flags, err)
        assert read_trace(trace).meta.extra["bounds"] == bounds, flags
