"""Expert parallelism predicted from a calibration: calibrate records what a mixture of experts' layers exchange
(their routed experts, the token copies a dispatch sends) and measures the all-to-all over E ranks at those sizes
(calibrate/links.py, an α–β fit in the profile); simulate, run and compare price each A2A row on that fit for the
bytes its stage's layers move (planning/scenario.py `measured_all_to_alls`), and refuse in one line a profile that
cannot price them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipesim.calibrate.measure import Settings, all_to_all_sizes, calibrate, measure_bytes
from pipesim.commands.common import InputError, check_expert_parallel
from pipesim.planning.scenario import measured_all_to_alls
from pipesim.profiles.schema import COUNT_BYTES, AllToAllProfile, ProfileError, load_profile, profile_json
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import Costs, StageCosts
from pipesim.sim.engine import simulate
from pipesim.traces import read_trace
from pipesim.traces.trace import Stream
from pipesim.workload.models import build_model, gpt, routed_parameters
from tests.conftest import needs_transformers, pipesim
from tests.helpers import write_config

MOE = {"layers": 2, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32, "experts": 4, "top_k": 2, "expert_ffn": 8}
SETTINGS = Settings(torch.device("cpu"), torch.float32, microbatch_size=2, warmup=0, repeats=1)
TOKEN_COPIES = 2 * 8 * 2  # micro-batch x sequence x top-k, balanced over the 4 experts (8 each)
LATENCY_MS, BYTES_PER_MS = 0.5, 1000.0  # the all-to-all term written into the profile below
MIXTRAL = {"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 32, "max_position_embeddings": 64, "tie_word_embeddings": False}  # a tiny Hugging Face MoE


def test_calibration_records_what_each_mixture_of_experts_layer_exchanges():
    net = build_model("gpt", **MOE)
    _, layers = measure_bytes(net, SETTINGS)
    assert [(layer.routed_experts, layer.dispatched_bytes) for layer in layers] == \
        [(0, 0), *[(4, TOKEN_COPIES * 16 * 4)] * 2, (0, 0)]  # embedding, 2 blocks (float32 copies), head
    experts = [sum(p.numel() * 4 for name, p in module.named_parameters() if name in routed_parameters(module))
               for module in net.layers]
    assert [layer.expert_param_bytes for layer in layers] == experts and experts[1] > 0


@needs_transformers
def test_a_calibrated_hugging_face_mixture_records_the_routed_experts_its_estimate_reads(tmp_path):
    """A Hugging Face MoE's layers record the routed experts of its config (the model's `experts` option, which the
    estimate reads), not 0, so that its count exchange (`COUNT_BYTES` an expert) is measured and priced."""
    net = build_model(f"hf:{write_config(tmp_path / 'mixtral', MIXTRAL)}", seq_len=8)
    _, layers = measure_bytes(net, SETTINGS)
    assert net.options["experts"] == 4
    assert [(layer.routed_experts, layer.dispatched_bytes > 0) for layer in layers] == \
        [(0, False), *[(4, True)] * 2, (0, False), (0, False)]  # embedding, 2 decoder layers, norm, head
    assert all_to_all_sizes(layers, 2)[0] == COUNT_BYTES * 4


@needs_transformers
def test_calibrate_checks_a_hugging_face_mixtures_expert_parallel_ranks_against_its_routed_experts(tmp_path):
    """calibrate --expert-parallel E of a Hugging Face MoE is checked against the experts its layers record: refused
    only where E does not divide them (it refused every E, as though the model had no routed experts)."""
    config = write_config(tmp_path / "mixtral", MIXTRAL)
    profile = tmp_path / "p.json"
    code, out, err = pipesim("calibrate", "--model", f"hf:{config}", "--seq-len", 8, "--expert-parallel", 3,
                             "--no-runtime", "--no-contention", "--out", profile)
    assert code == 2 and "--expert-parallel 3 does not divide the model's 4 routed experts" in err, err
    assert not profile.exists()


@needs_transformers
def test_run_refuses_to_place_a_hugging_face_mixtures_experts_and_says_what_does(tmp_path):
    """run places only the built-in gpt's experts on its ranks (`check_expert_parallel(placed=True)`, run's check
    of a model rebuilt from its profile): a Hugging Face MoE is refused naming the path that prices its expert
    parallelism (calibrate, then simulate), not as a model without routed experts."""
    net = build_model(f"hf:{write_config(tmp_path / 'mixtral', MIXTRAL)}", seq_len=8)
    check_expert_parallel(2, net)  # calibrate's check: its 4 experts over 2 ranks
    with pytest.raises(InputError) as refused:
        check_expert_parallel(2, net, placed=True)
    assert str(refused.value).startswith("--expert-parallel 2: run places the built-in gpt's routed experts on its "
                                         "ranks, not a Hugging Face model's"), refused.value


def test_a_model_built_by_its_own_code_records_its_gpt_blocks_routed_experts():
    """A bring-your-own model (`package.module:attribute`) carries no options: its gpt blocks give the experts."""
    net = gpt(**MOE)
    assert "experts" not in net.options
    assert [layer.routed_experts for layer in measure_bytes(net, SETTINGS)[1]] == [0, 4, 4, 0]


def test_the_all_to_all_is_measured_at_the_sizes_exchanged_and_powers_of_four_between_split_evenly():
    _, layers = measure_bytes(build_model("gpt", **MOE), SETTINGS)
    counts, copies = COUNT_BYTES * 4, TOKEN_COPIES * 16 * 4  # 32 and 2,048 bytes a rank
    assert all_to_all_sizes(layers, 2) == [counts, 64, 256, 1024, copies]
    assert all_to_all_sizes(layers, 3) == [30, 63, 255, 1023, 2046]
    dense = {name: value for name, value in MOE.items() if name not in ("experts", "top_k", "expert_ffn")}
    assert all_to_all_sizes(measure_bytes(build_model("gpt", **dense), SETTINGS)[1], 2) == []  # nothing exchanged


@pytest.fixture(scope="module")
def moe_profile(tmp_path_factory):
    """The small MoE gpt calibrated in process without links (so without an all-to-all), and the same profile with
    an all-to-all over 2 ranks of 0.5 ms + 1,000 bytes/ms written in."""
    measured = calibrate(build_model("gpt", **MOE), SETTINGS, stages=2, optimizer="sgd", memory_cap_bytes=None,
                         link_sizes=[], dtype_name="float32", advance=lambda what: None)
    assert measured.all_to_all is None
    term = AllToAllProfile(world_size=2, segments=[{"min_bytes": 0, "latency_ms": LATENCY_MS,
                                                    "bytes_per_ms": BYTES_PER_MS}],
                           points=[{"nbytes": 32, "ms": 0.532, "spread_ms": 0.0}], meta={"backend": "gloo"})
    folder = tmp_path_factory.mktemp("moe")
    without, priced = folder / "without.json", folder / "priced.json"
    without.write_text(profile_json(measured))
    priced.write_text(profile_json(measured.model_copy(update={"all_to_all": term})))
    return without, priced, measured.partition.bounds


def test_a_profile_with_an_all_to_all_term_prices_each_row_for_the_bytes_its_layers_move(moe_profile, tmp_path):
    _, priced, bounds = moe_profile
    trace_path = tmp_path / "sim.json"
    code, _, err = pipesim("simulate", "--profile", priced, "--expert-parallel", 2, "--data-parallel", 2, "-s",
                           "1f1b", "-m", 2, "--trace", trace_path)
    assert code == 0, err
    trace = read_trace(trace_path)
    ops = trace.ops

    def ms(nbytes: int) -> float:
        return LATENCY_MS + nbytes / BYTES_PER_MS

    copies = TOKEN_COPIES * 16 * 4
    blocks = [sum(1 <= i <= 2 for i in range(start, stop)) for start, stop in zip(bounds, bounds[1:])]
    for kind, each in (("A2A_F", ms(COUNT_BYTES * 4) + 2 * ms(copies)), ("A2A_B", 2 * ms(copies))):
        rows = ops.kind == trace.kinds.index(kind)
        assert rows.any()
        for stage, moe_layers in enumerate(blocks):  # a forward: counts, dispatch, combine; a backward: the two back
            got = ops.dur_us[rows & (ops.stage == stage)] / 1e3
            np.testing.assert_allclose(got, moe_layers * each, rtol=1e-6)


def test_a_layer_of_two_mixture_of_experts_blocks_pays_each_blocks_exchanges_and_latencies(moe_profile):
    """DeepSeek's --mtp-layers 2 layer runs two MoE blocks, each exchanging its counts, dispatching and combining its
    own copies (as the estimate prices `LayerCount.routed_blocks`): six exchanges after its forward, four after its
    backward, each after the fit's 0.5 ms latency; not three and two of the blocks' bytes summed."""
    _, priced, _ = moe_profile
    measured = load_profile(priced)
    copies = TOKEN_COPIES * 16 * 4
    assert [layer.dispatched_block_bytes for layer in measured.layers] == [[], [copies], [copies], []]
    two = measured.layers[1].model_copy(update={"dispatched_bytes": 2 * copies,
                                                "dispatched_block_bytes": [copies, copies]})
    measured = measured.model_copy(update={"layers": [measured.layers[0], two, *measured.layers[2:]]})
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0),) * 2)
    stages = measured_all_to_alls(costs, measured, (0, 2, 4), 2).stages  # the two blocks' layer, then the one's

    def ms(nbytes: int) -> float:
        return LATENCY_MS + nbytes / BYTES_PER_MS

    forward_ms, backward_ms = ms(COUNT_BYTES * 4) + 2 * ms(copies), 2 * ms(copies)  # one block's
    priced_ms = [exchange_ms for c in stages for exchange_ms in (c.all_to_all_fwd_ms, c.all_to_all_bwd_ms)]
    assert priced_ms == pytest.approx([2 * forward_ms, 2 * backward_ms, forward_ms, backward_ms], rel=1e-12)


def test_a_profile_from_before_the_blocks_were_recorded_prices_each_layer_as_one_block(moe_profile, tmp_path):
    """A profile calibrated before `dispatched_block_bytes` (no such key) loads, each MoE layer one block of its
    `dispatched_bytes`, priced as the profile that records them; blocks that do not sum to it are refused."""
    _, priced, _ = moe_profile
    bounds = (0, 2, 4)  # a block a stage, not the calibration's cut: timed, it may put both blocks on one stage
    doc = json.loads(priced.read_text())
    for layer in doc["layers"]:
        del layer["dispatched_block_bytes"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(doc))
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0),) * 2)
    recorded, before = load_profile(priced), load_profile(older)
    copies = TOKEN_COPIES * 16 * 4
    assert [layer.dispatches_bytes for layer in before.layers] == [[], [copies], [copies], []]
    priced_before = measured_all_to_alls(costs, before, bounds, 2)
    assert priced_before == measured_all_to_alls(costs, recorded, bounds, 2)
    assert all(c.all_to_all_fwd_ms > 0 for c in priced_before.stages)
    doc["layers"][1]["dispatched_block_bytes"] = [1, 2]
    older.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="dispatched_block_bytes sum to 3, not dispatched_bytes 2,048"):
        load_profile(older)


@pytest.mark.parametrize("args, fragment", [
    (("--expert-parallel", 2, "--data-parallel", 2), "the profile's, and it measured no all-to-all: calibrate the "
                                                     "mixture of experts again with --expert-parallel 2"),
    (("--expert-parallel", 2), "--expert-parallel 2 must divide the data-parallel degree, 1: give --data-parallel a "
                               "multiple of 2"),
])
def test_simulate_refuses_a_profile_that_cannot_price_the_all_to_alls_in_one_line(moe_profile, args, fragment):
    without, _, _ = moe_profile
    code, out, err = pipesim("simulate", "--profile", without, "-s", "1f1b", *args)
    assert code == 2 and out == "" and fragment in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err


def test_an_all_to_all_over_other_ranks_is_refused_naming_them(moe_profile):
    _, priced, _ = moe_profile
    code, _, err = pipesim("simulate", "--profile", priced, "-s", "1f1b", "--expert-parallel", 4, "--data-parallel", 4)
    assert code == 2 and "measured it over 2 ranks: calibrate the mixture of experts again with --expert-parallel 4" \
        in " ".join(err.split()), err


def test_run_refuses_before_starting_ranks_and_writes_nothing(moe_profile, tmp_path):
    without, _, _ = moe_profile
    trace = tmp_path / "run.json"
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "gpt", "--profile", without, "--expert-parallel", 2,
                           "--trace", trace)
    assert code == 2 and "measured no all-to-all" in err and len(err.strip().splitlines()) == 1, err
    assert not trace.exists()


def test_an_all_to_all_starts_when_its_pass_ends_and_holds_the_next_pass_behind_it():
    """An A2A row is its expert-parallel group's exchange: it starts once every member has reached it. The simulated
    devices stand for every replica of the group (each runs the same rows at the same costs: `pipesim run` starts
    them so), so every member reaches it as its pass ends: the row starts there, lasts its link time, and the
    device's next pass waits for it. Two stages of unequal costs, 1F1B, d = E = 2."""
    schedule = build_schedule("1f1b", ScheduleParams(stages=2, microbatches=4, data_parallel=2, expert_parallel=2))
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.3, all_to_all_bwd_ms=0.2),
                   StageCosts(fwd_ms=1.5, bwd_ms=3.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=0.4)))
    trace = simulate(schedule, costs, Cluster.uniform(2, 0.1))
    ops, kinds = trace.ops, trace.kinds
    end_us = ops.start_us + ops.dur_us
    for exchange, after, priced in (("A2A_F", "F", "all_to_all_fwd_ms"), ("A2A_B", "B", "all_to_all_bwd_ms")):
        for row in np.flatnonzero(ops.kind == kinds.index(exchange)):
            mine = (ops.stage == ops.stage[row]) & (ops.microbatch == ops.microbatch[row])
            (pass_row,) = np.flatnonzero(mine & (ops.kind == kinds.index(after)))
            assert ops.start_us[row] == pytest.approx(end_us[pass_row])
            assert ops.dur_us[row] == pytest.approx(getattr(costs.stages[ops.stage[row]], priced) * 1e3)
            device = (ops.device == ops.device[row]) & (ops.stream == Stream.COMPUTE)
            assert (ops.start_us[device & (ops.start_us > ops.start_us[row])] >= end_us[row] - 1e-6).all()


@pytest.mark.parametrize("args, fragment", [
    (("--model", "mlp", "--expert-parallel", 2), "--expert-parallel 2, but the model has no routed experts to place"),
    (("--model", "gpt", *(f"--{k.replace('_', '-')}={v}" for k, v in MOE.items()), "--expert-parallel", 3),
     "--expert-parallel 3 does not divide the model's 4 routed experts"),
    (("--model", "gpt", "--experts", 4, "--no-links", "--expert-parallel", 2),
     "--expert-parallel sizes the link measurement, which --no-links skips"),
])
def test_calibrate_refuses_an_expert_parallel_degree_it_cannot_measure_in_one_line(tmp_path, args, fragment):
    out = tmp_path / "p.json"
    code, _, err = pipesim("calibrate", *args, "--out", out)
    assert code == 2 and fragment in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_all_to_all_is_a_host_term_whose_conditions_compare_shows(moe_profile):
    _, priced, _ = moe_profile
    measured = load_profile(priced)
    cached = {"measured_at": "2026-01-01T00:00:00+00:00", "age_s": 3.0, "reused": True, "load": None}
    term = measured.all_to_all.model_copy(update={"meta": {"backend": "gloo", "host_cache": cached}})
    assert "all-to-all" not in measured.host_terms()
    assert measured.model_copy(update={"all_to_all": term}).host_terms()["all-to-all"] == cached


def test_an_estimate_keeps_the_expert_parallelism_it_was_estimated_for(tmp_path):
    estimated = tmp_path / "estimate.json"
    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads",
                           4, "--seq-len", 32, "--vocab", 100, "--experts", 4, "--out", estimated)
    assert code == 0, err
    code, out, err = pipesim("simulate", "--profile", estimated, "-s", "1f1b", "--expert-parallel", 2,
                             "--data-parallel", 2)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "the profile is an estimate, made for the expert parallelism it was estimated with (E=1)" in \
        " ".join(err.split())
