"""The stage cut balances what a stage takes, its passes floored by their kernels' issue (planning/host.py): a
range's time is its layers' forward + backward and what its stage's passes wait for their host beyond them
(profiles/schema.py `stage_time`, of `stage_host_waits_ms`, the function the simulator's stage costs use)."""

from __future__ import annotations

import itertools

import pytest

from pipesim.profiles.partition import partition, with_range_ms
from pipesim.profiles.schema import Profile, layer_costs, stage_host_waits_ms, stage_time, stage_waits_ms
from tests.conftest import estimate_json, simulate_json
from tests.helpers import HEAVY_HEAD_GPT_FLAGS as GPT
from tests.helpers import MOE_GPT_FLAGS as MOE

# eight samples a micro-batch: at the default 31.9 us a kernel the embedding's stage of one sample of 2,048 tokens is
# its issue (its GPU time 0.06 ms a forward)
BIG = ("--model", "gpt", "--layers", 4, "--width", 4096, "--heads", 32, "--seq-len", 2048, "-b", 8, "--gpu",
       "h100-sxm")


def estimated(tmp_path, *args) -> Profile:
    return Profile.model_validate(estimate_json(tmp_path, *args))


# MOE at 3 layers: the command line refuses an option given twice
MOE_3_LAYERS = tuple(3 if before == "--layers" else arg for before, arg in zip((None, *MOE), MOE))


@pytest.mark.parametrize("args", [(*GPT, "-p", 2), (*MOE_3_LAYERS, "-p", 3), (*MOE, "-p", 2, "--p2p-sync")],
                         ids=["dense", "dropless-moe", "p2p-sync"])
def test_every_ranges_waits_are_the_stages_own_to_the_bit(tmp_path, args):
    """`stage_waits_ms`' table is `stage_host_waits_ms` of each range, where nothing synchronises (a dense model),
    where a MoE layer's dispatcher does, and where every received pass starts from an emptied queue."""
    layers = estimated(tmp_path, *args).layers
    p2p_sync = "--p2p-sync" in args
    for name in ("fwd", "bwd", "igrad", "wgrad"):
        table = stage_waits_ms(layers, name, p2p_sync)
        assert table.any()  # these small models' passes wait for their host
        for start, stop in itertools.combinations(range(len(layers) + 1), 2):
            assert table[start, stop] == stage_host_waits_ms(layers, start, stop, name, p2p_sync), (name, start, stop)


def test_a_host_bound_models_balanced_cut_is_no_slower_than_equal_blocks():
    """At eager PyTorch's default 31.9 us a kernel this small GPT's passes are their kernels' issue: a cut of the
    layers' GPU times alone gave the head's stage fewer blocks and ran slower than equal blocks (7.496 against
    6.570 ms a step at 12 us); balancing what each stage takes, it is no slower."""
    args = (*GPT, "-p", 2, "-m", 4, "-s", "1f1b")
    (balanced,) = simulate_json(*args)
    (blocks,) = simulate_json(*args, "--stage-cut", "equal-blocks")
    assert balanced["time_per_minibatch_ms"] <= blocks["time_per_minibatch_ms"] * (1 + 1e-9)
    (free,) = simulate_json(*args, "--host-kernel-us", 0)
    assert free["time_per_minibatch_ms"] < balanced["time_per_minibatch_ms"]  # the host binds it


def test_a_gpu_bound_models_cut_is_its_layers_times_cut(tmp_path):
    """Where no stage's issue outlasts its GPU time the stage time is the layers' forward + backward to the bit,
    so the cut is as before at any depth."""
    layers = estimated(tmp_path, *BIG, "-p", 2).layers
    assert not stage_waits_ms(layers, "fwd").any() and not stage_waits_ms(layers, "bwd").any()
    assert (stage_time(layers)(0) == with_range_ms(layer_costs(layers, "sgd"), 0.0)(0)).all()
    for stages in range(1, len(layers) + 1):
        assert partition(layer_costs(layers, "sgd"), stages, stage_time=stage_time(layers)) == partition(
            layer_costs(layers, "sgd"), stages)


def test_a_kept_waits_table_is_the_one_its_layers_issues_give(tmp_path):
    """`stage_waits_ms` keeps its tables by what it reads: layers whose issue of the pass differs get their own
    table, alike layers the same values, and a caller's change to its table changes no later caller's."""
    layers = estimated(tmp_path, *GPT, "-p", 2).layers
    kept = stage_waits_ms(layers, "fwd")
    first = kept.copy()
    kept += 1.0
    assert (stage_waits_ms(layers, "fwd") == first).all()
    slower = [layer.model_copy(update={"host_issue": {**layer.host_issue, "fwd": layer.host_issue["fwd"].model_copy(
        update={"slack_ms": layer.host_issue["fwd"].slack_ms - 1.0})}}) for layer in layers]
    table = stage_waits_ms(slower, "fwd")
    assert (table != first).any()
    for start, stop in itertools.combinations(range(len(layers) + 1), 2):
        assert table[start, stop] == stage_host_waits_ms(slower, start, stop, "fwd"), (start, stop)
