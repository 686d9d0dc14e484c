"""tune --gpu estimates hundreds of profiles before it searches (commands/tune.py `_estimated_settings`); what makes
that fast gives the figures it gave before: each stage's optimizer step against the sum it was taken as, stage by
stage, the partitioner's range table against its own sums, a stage's transient peak against its sum over later
layers, and the cyclic garbage collector held off while the estimates are made and searched and restored after."""

import gc
import itertools
import json
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.planning.estimate import (
    EMA_BYTES,
    Parallelism,
    _element_bytes,
    estimate_layer,
    estimate_profile,
    state_share,
)
from pipesim.profiles import partition as partitioning
from pipesim.profiles.schema import OPTIMIZERS, LayerProfile, Timing, layer_costs, stage_transient_bytes
from tests.conftest import at_columns, pipesim
from tests.helpers import H100, SMALL_GPT_FLAGS

torch = pytest.importorskip("torch")
from pipesim.workload.count import count_built  # noqa: E402  (counting needs torch)

GPT = {"layers": 4, "width": 128, "heads": 16, "seq_len": 32, "vocab": 1000}


@pytest.mark.parametrize(("model", "parallel"), [
    ("gpt", Parallelism(pipeline=3, data=2)),
    ("gpt", Parallelism(tensor=2, pipeline=2, data=4, sharded_optimizer=True, ema="gpu")),
    ("moe", Parallelism(pipeline=2, data=4, expert=4)),
    ("moe", Parallelism(pipeline=3, data=4, expert=4, recompute="full", precision="fsdp2")),
])
def test_each_stage_step_is_its_layers_bytes_summed_in_order(model, parallel):
    """Each layer's step bytes are found once a profile and a stage's summed from them: the same float, to the bit,
    as summing the stage's layers one by one (the reference below, as the estimate summed them before)."""
    options = GPT if model == "gpt" else {**GPT, "experts": 4, "top_k": 2, "expert_ffn": 128}
    counted = count_built("gpt", options, 2, torch.bfloat16)
    profile = estimate_profile(counted, H100, parallel)
    held, element = parallel.held(counted.dtype), _element_bytes(counted.dtype)
    widen, ema = held.state_bytes // element, EMA_BYTES if parallel.ema == "gpu" else 0
    shards = parallel.tensor * (parallel.data * parallel.context if parallel.sharded_optimizer else 1)
    group_shards = parallel.expert  # E·ETP/t with ETP = t
    device_bytes_per_ms = H100.memory_bandwidth_gb_s * 1e6 * H100.curve.memory_efficiency
    bounds = profile.partition.bounds
    assert len(bounds) - 1 == parallel.pipeline
    for stage, (start, stop) in zip(profile.stages, itertools.pairwise(bounds), strict=True):
        for name in OPTIMIZERS:
            moved = sum((layer.optimizer_step_moved_bytes[name] * widen + 3 * ema * layer.param_bytes // element)
                        * state_share(layer, parallel, group_shards, element)
                        for layer in counted.layers[start:stop])
            assert stage.steps[name].step.median_ms == H100.curve.kernel_overhead_ms + moved / shards \
                / device_bytes_per_ms, (stage.layers, name)
            assert stage.steps[name].predict == stage.average


def test_the_partitioner_builds_one_range_table_for_the_same_times():
    """tune partitions one estimate's layers for every depth p: the table of every range's ms is built once for
    the same times (read-only, shared) and gives the splits it gives built anew."""
    costs = [partitioning.LayerCost(ms, 0, 0) for ms in (0.1, 0.2, 0.3, 0.7, 0.1, 0.2, 1e-9, 3.0)]
    partitioning._range_ms.cache_clear()
    splits = [partitioning.partition(costs, p) for p in (2, 3, 5)]
    assert partitioning._range_ms.cache_info().misses == 1 and partitioning._range_ms.cache_info().hits == 2
    table = partitioning._forward_backward_ms(costs)(0)
    assert not table.flags.writeable
    for p, bounds in zip((2, 3, 5), splits, strict=True):
        assert bounds == partitioning._min_max_split(len(costs), p, partitioning._stage_blocks(
            len(costs), p, lambda k: partitioning._range_ms.__wrapped__(tuple(cost.ms for cost in costs))))[1]


def _layer(saved: int, transient: dict[str, int]) -> LayerProfile:
    timing = Timing(median_ms=1.0, spread_ms=0.0, repeats=1)
    return LayerProfile(name="l", inputs=[-1], fwd=timing, bwd=timing, igrad=timing, wgrad=timing,
                        activation_bytes=saved, shared_with_previous_bytes=0, output_bytes=0, param_bytes=0,
                        grad_bytes=0, optimizer_state_bytes=dict.fromkeys(OPTIMIZERS, 0), transient_bytes=transient)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40)), min_size=1, max_size=9), st.data())
def test_a_stages_transient_peak_is_each_layers_less_what_the_layers_after_it_save(layers, data):
    profiles = [_layer(saved, dict.fromkeys(("fwd", "bwd", "igrad", "wgrad"), transient))
                for saved, transient in layers]
    start = data.draw(st.integers(0, len(layers) - 1))
    stop = data.draw(st.integers(start + 1, len(layers)))
    mine = profiles[start:stop]
    peak = max([0, *(layer.transient_bytes["fwd"] - sum(later.activation_bytes for later in mine[i + 1:])
                     for i, layer in enumerate(mine))])
    assert stage_transient_bytes(profiles, start, stop)["fwd"] == peak


def test_costs_given_to_the_stages_are_the_layers_own():
    from pipesim.profiles.schema import aggregate_stages, boundary_bytes

    counted = count_built("gpt", GPT, 2, torch.bfloat16)
    profile = estimate_profile(counted, H100, Parallelism(pipeline=3))
    layers, bounds = profile.layers, profile.partition.bounds
    steps = [(stage.steps, stage.average, stage.accumulate, stage.weight_copy) for stage in profile.stages]
    given_costs = aggregate_stages(layers, bounds, "adam", boundary_bytes(layers, bounds, dag=False), steps,
                                   costs=layer_costs(layers, "adam"))
    assert given_costs == aggregate_stages(layers, bounds, "adam", boundary_bytes(layers, bounds, dag=False), steps)
    assert given_costs == profile.stages


def test_tune_estimates_and_searches_with_the_cycle_collector_held_off_and_restores_it(monkeypatch):
    """And what the command made joins the oldest generation as it ends (a collection of the youngest would scan it
    all): an object made in its search is there once it returns."""
    from pipesim.commands import tune
    from pipesim.planning import tune as planning

    seen, made = [], []

    def spied(function):
        def spy(*args, **kwargs):
            seen.append(gc.isenabled())
            made.append([])
            return function(*args, **kwargs)
        return spy

    monkeypatch.setattr(tune, "_estimated_settings", spied(tune._estimated_settings))
    monkeypatch.setattr(planning, "tune", spied(planning.tune))
    assert gc.isenabled()
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                             "--seq-len", 32, "--vocab", 1000, "-D", 2, "-b", 1, "--tensor-parallel", 1,
                             "--recompute", "none", "-s", "1f1b", "--json")
    assert code == 0, err
    assert json.loads(out)["choice"] and seen == [False, False] and gc.isenabled()
    assert any(held is made[-1] for held in gc.get_objects(generation=2))



def test_what_the_paused_collector_made_joins_the_oldest_generation():
    """Made after a full collection, an object reaches generation 2 by the freeze alone: no young collection could
    carry it there before the check (the command's run above may collect on the way)."""
    from pipesim.commands.common import collector_paused

    assert gc.isenabled()
    gc.collect()
    with collector_paused():
        made = []
    assert any(held is made for held in gc.get_objects(generation=2)) and gc.isenabled()


def test_a_first_count_runs_no_cyclic_collection(tmp_path, monkeypatch):
    """A what-if's first count (torch's imports, and transformers' for a Hugging Face config, the model built and
    counted on the meta device) makes objects that stay alive: its collections walked them all and freed little, a
    CPU second of each README what-if's first run. The collector runs again after."""
    from pipesim.commands.estimate import count_model_of

    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))  # counted here, not read back
    collected = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collected.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        counted = count_model_of("gpt", {"layers": 2, "width": 64, "heads": 4, "seq_len": 32, "vocab": 1000}, 1,
                                 "float32", "flash", "--gpu")
    finally:
        gc.callbacks.remove(seen)
    assert counted.layers and collected == [] and gc.isenabled()


def _reference_split(n: int, p: int, table) -> tuple[float, list[int]]:
    """The least slowest stage over the first j items in k + 1 parts, by recursion over the last cut, ties to the
    earliest cut: the partitioner's rule in plain Python."""
    from functools import cache

    @cache
    def best(k: int, j: int) -> tuple[float, tuple[int, ...]]:
        if k == 0:
            return float(table[0, j]), ()
        options = [(max(best(k - 1, i)[0], float(table[i, j])), i) for i in range(k, j)]
        least = min(value for value, _ in options)
        cut = next(i for value, i in options if value == least)
        return least, (*best(k - 1, cut)[1], cut)

    slowest, cuts = best(p - 1, n)
    return slowest, [0, *cuts, n]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12), st.data())
def test_the_split_takes_only_the_ranges_that_can_end_each_stage_and_finds_the_same(ms, data):
    """Ties abound (small whole times): the earliest cut wins as it did over the whole table."""
    p = data.draw(st.integers(1, len(ms)))
    table = partitioning._range_ms(tuple(map(float, ms)))
    blocks = partitioning._stage_blocks(len(ms), p, lambda k: table)
    assert partitioning._min_max_split(len(ms), p, blocks) == _reference_split(len(ms), p, table)


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_estimates_at_other_depths_take_the_layers_made_and_equal_estimates_made_alone(model, monkeypatch):
    """A layer is priced on one of its stage's ranks whatever p and d: estimates sharing a LayerMemo price each
    t, recomputation, sharding and expert group once, and every profile is the one estimated alone."""
    from pipesim.planning import estimate

    options = GPT if model == "gpt" else {**GPT, "experts": 4, "top_k": 2, "expert_ffn": 128}
    counted = count_built("gpt", options, 2, torch.bfloat16)
    settings = [Parallelism(tensor=t, pipeline=p, data=d, recompute=kind, sharded_optimizer=sharded,
                            expert=4 if model == "moe" and d % 4 == 0 else 1)
                for t, kind, sharded in itertools.product((1, 2), ("none", "full"), (False, True))
                for p, d in ((1, 8), (2, 4), (3, 4), (4, 2))]
    priced = []
    monkeypatch.setattr(estimate, "estimate_layer", lambda *args: priced.append(args) or estimate_layer(*args))
    alone = [estimate_profile(counted, H100, parallel) for parallel in settings]
    priced_alone, priced[:] = len(priced), []
    memo = estimate.LayerMemo(counted, H100)
    shared = [estimate_profile(counted, H100, parallel, memo=memo) for parallel in settings]
    for one, other, parallel in zip(alone, shared, settings, strict=True):
        assert one.model_dump(exclude={"environment": {"date"}}) == other.model_dump(
            exclude={"environment": {"date"}}), parallel
    assert 0 < len(memo.layers) < len(settings) and len(priced) < priced_alone
    with pytest.raises(ValueError, match="memo"):
        estimate_profile(replace(counted), H100, settings[0], memo=memo)
    # ZeRO shards the optimizer's state over the d replicas, which differ by p, and a layout at d = 1 shards nothing:
    # the layers are priced no more often than unsharded (they were priced again at each d before
    # LayerMemo.priced, and again at d = 1 while its key held the sharding) and come out as estimated alone
    at_one_replica = [replace(parallel, data=1, expert=1, sharded_optimizer=False) for parallel in settings
                       if parallel.sharded_optimizer and parallel.pipeline == 2]

    def priced_with_one_memo(settings: list[Parallelism]) -> int:
        priced[:], memo = [], estimate.LayerMemo(counted, H100)
        profiles = [estimate_profile(counted, H100, parallel, memo=memo) for parallel in settings]
        layers_priced = len(priced)
        for profile, parallel in zip(profiles, settings, strict=True):
            assert profile.model_dump(exclude={"environment": {"date"}}) == estimate_profile(
                counted, H100, parallel).model_dump(exclude={"environment": {"date"}}), parallel
        return layers_priced

    unsharded = [parallel for parallel in settings if not parallel.sharded_optimizer]
    assert priced_with_one_memo(settings + at_one_replica) == priced_with_one_memo(unsharded) > 0


def test_a_refusal_every_t_gets_is_the_estimates_own_not_a_t_problem():
    """DeepEP holding every multiprocessor is refused by each t's estimate alike: tune says that refusal, not that
    no tensor-parallel degree suits the model (which would send the user after --tensor-parallel)."""
    sms = H100.curve.multiprocessors
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", *itertools.chain(*(
        (f"--{name.replace('_', '-')}", value) for name, value in GPT.items())), "--experts", 8, "--expert-parallel", 2,
        "--token-dispatcher", "deepep", "--dispatcher-sms", sms, "--devices", 8, "--batch-size", 4)
    assert code == 2 and out == "", err
    assert err.strip().splitlines()[-1] == (f"error: --dispatcher-sms {sms} of the part's {sms} multiprocessors leaves "
                                            "none to compute on; give fewer")


def test_recompute_op_leaves_out_the_searched_t_it_refuses_and_refuses_a_given_one_naming_both_flags():
    """torchtitan's op policy is modelled at t = 1 only (planning/estimate.py): tune's t search keeps t = 1 and leaves
    the rest out, as it does beside selective recomputation, where it searches them; a given t = 2 is that refusal
    in one line, in the flags' names."""
    from tests.helpers import searched_settings

    model = ("--gpu", "h100-sxm", "--model", "gpt", *itertools.chain(*(
        (f"--{name.replace('_', '-')}", value) for name, value in GPT.items())))
    flags = ("--devices", 4, "--batch-size", 8, "-b", 1)
    assert {s.tensor for s in searched_settings(*flags, "--recompute", "selective", model=model)} == {1, 2, 4}
    assert {(s.tensor, s.recompute) for s in searched_settings(*flags, "--recompute", "op", model=model)} == {(1, "op")}
    code, out, err = pipesim("tune", *model, *flags, "--recompute", "op", "--tensor-parallel", 2)
    assert code == 2 and out == "", err
    assert err.strip() == ("error: --recompute op (torchtitan's selective op policy) is modelled for "
                           "--tensor-parallel 1 only (got --tensor-parallel 2)")


def test_tunes_table_writes_every_whole_number_with_thousands_separators(monkeypatch):
    """A million H100s: the title read "gpt on 1000000 x ...; batch 4000000 samples", the d column "1000000" and
    the caption "the 1000000 GPUs'", beside the samples/s column's "140,937,316.3" and the why-not lines'
    "d=1,000,000". The command to paste is left as the shell reads it ("--data-parallel 1000000")."""
    at_columns(monkeypatch, 80)
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", *SMALL_GPT_FLAGS, "-D", 10**6, "-s", "1f1b", "-b", 1,
                             "--recompute", "none", "--tensor-parallel", 1)
    assert code == 0, err
    shown = re.sub(r"^the choice, as simulate gives it:\n.*?^(?=searched )", "", out, flags=re.M | re.S)
    assert "--data-parallel" not in shown and "--data-parallel 1000000" in out
    words = " ".join(shown.split())
    assert words.startswith("gpt on 1,000,000 x NVIDIA H100") and "batch 4,000,000 samples" in words, words
    assert " 1,000,000 either 4 140,937,316.3 " in words and "over the 1,000,000 GPUs' dense peak" in words, words
    assert not re.findall(r"(?<![\w,.])\d{5,}", shown), shown
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", *SMALL_GPT_FLAGS, "-D", 10**6, "-s", "1f1b", "-b", 3,
                             "-B", 30_000, "--recompute", "none", "--tensor-parallel", 1)
    assert code == 2, out
    assert ("the batch of 30,000 samples must split into whole micro-batches of 3 over r = D/p replicas and P "
            "pipelines for some pipeline depth p dividing 1,000,000 (p <= 6 layers)") in err, err


def test_tunes_search_summary_writes_every_count_with_thousands_separators():
    """4 H100s of a small gpt search 1,596 configurations, refuse 4,116 more shapes and prune 1,310 (16 H100s,
    which searched 1,614, refused 4,386 and pruned 1,441 when the bug was found, now search 4,302 in twice the
    time): the summary line wrote "4386" and "1441" beside "1,614"."""
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                             "--seq-len", 32, "--vocab", 1000, "-D", 4, "--memory-gb", 79)
    assert code == 0, err
    summary = " ".join(re.search(r"^searched \d.*?(?=^note:|\Z)", out, re.M | re.S).group().split())
    counts = re.findall(r"\d[\d,]*", summary)
    # searched, refused and pruned each past a thousand: a count written without its separator is caught
    assert sum(int(n.replace(",", "")) >= 1000 for n in counts) >= 3, summary
    assert not [n for n in counts if len(n) > 3 and "," not in n], summary


def test_the_estimates_made_in_the_search_workers_are_those_one_process_makes(monkeypatch):
    """tune hands each (b, t, E)'s estimates to the search's workers, idle until it starts (commands/tune.py
    `_estimate_groups`): the settings and their order are the ones made in one process, where the estimates share
    one memo of their layers (an 8-expert GPT, E searched, on 8 H100s: 3 b, 4 t, 4 E)."""
    from pipesim.commands import tune as tune_command
    from tests.helpers import searched_settings

    flags = ("--devices", 8, "--batch-size", 16, "--experts", 8, "--top-k", 2)
    model = ("--gpu", "h100-sxm", "--model", "gpt", *itertools.chain(*(
        (f"--{name.replace('_', '-')}", value) for name, value in GPT.items())))
    monkeypatch.setattr(tune_command, "usable_cpus", lambda: 2)
    pooled = searched_settings(*flags, model=model)
    monkeypatch.setattr(tune_command, "usable_cpus", lambda: 1)
    here = searched_settings(*flags, model=model)

    def described(settings):
        return [(s.microbatch_size, s.tensor, s.expert, s.depths, s.recompute, s.sequence_parallel,
                 s.scenario.measured.model_dump(exclude={"environment": {"date"}}), s.scenario.allocations,
                 s.scenario.expandable_segments) for s in settings]

    assert len({(s.microbatch_size, s.tensor, s.expert) for s in here}) > 12
    assert described(pooled) == described(here)
