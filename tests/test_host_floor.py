"""A host that issues slower than the GPU runs makes it wait, synchronisation or none (planning/host.py): where
nothing makes a stage's host wait for the GPU, each of its passes takes the longer of its GPU time and its kernels'
issue (profiles/schema.py `stage_host_waits_ms`), in estimate's profile and so in simulate's step."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from tests.conftest import estimate_json, pipesim

SMALL = ("--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 128, "-b", 1,
         "--gpu", "h100-sxm")
WIDER = ("--model", "gpt", "--layers", 4, "--width", 1024, "--heads", 8, "--seq-len", 1024, "-b", 1,
         "--gpu", "h100-sxm")  # SMALL four times as wide and eight times as long
BIG = ("--model", "gpt", "--layers", 2, "--width", 8192, "--heads", 64, "--seq-len", 4096, "-b", 1,
       "--gpu", "h100-sxm")
PASS_NAMES = ("fwd", "bwd", "igrad", "wgrad")


def profile(tmp_path, *args) -> dict:
    return estimate_json(tmp_path, *args, "-p", 2)


def step_ms(*args) -> float:
    code, out, err = pipesim("simulate", *args, "-p", 2, "-m", 8, "-s", "1f1b", "--json")
    assert code == 0, err
    return json.loads(out)["results"][0]["time_per_minibatch_ms"]


def test_a_small_dense_models_passes_take_their_kernels_issue(tmp_path):
    """At 1 ms and 2 ms a kernel the host outlasts this small model's GPU by far: each stage's pass is its kernel
    count times the host's cost (the same count at both: the GPU's time hidden under the issue), where at 0 it is
    its layers' GPU time. Its backward issues more kernels than its forward."""
    free, slow, slower = (profile(tmp_path, *SMALL, "--host-kernel-us", us) for us in (0, 1000, 2000))
    layers, free, slow, slower = free["layers"], free["stages"], slow["stages"], slower["stages"]
    for stage in free:
        start, stop = stage["layers"]
        for name in ("fwd", "bwd"):
            assert stage[f"{name}_ms"] == pytest.approx(sum(layer[name]["median_ms"] for layer in layers[start:stop]))
    for gpu, host, host2 in zip(free, slow, slower, strict=True):
        for name in PASS_NAMES:
            kernels = host2[f"{name}_ms"] - host[f"{name}_ms"]
            if not gpu[f"{name}_ms"]:  # the first stage's empty input-gradient pass
                assert host[f"{name}_ms"] == host2[f"{name}_ms"] == 0.0
                continue
            assert kernels == pytest.approx(round(kernels)) and kernels >= 10
            assert host[f"{name}_ms"] == pytest.approx(kernels)
            assert gpu[f"{name}_ms"] < 0.05 * kernels
        assert host["bwd_ms"] > host["fwd_ms"]


def test_a_slow_host_slows_a_small_dense_models_step_by_its_issue(tmp_path):
    """1F1B over 2 stages and 8 micro-batches: at 1 ms a kernel the busier device runs 8 forwards and backwards, each
    its issue, so the step is at least that and grows by about it; the GPU's own step is a small part."""
    stages = profile(tmp_path, *SMALL, "--host-kernel-us", 1000)["stages"]
    busiest_ms = 8 * max(stage["fwd_ms"] + stage["bwd_ms"] for stage in stages)
    free_ms, slow_ms = step_ms(*SMALL, "--host-kernel-us", 0), step_ms(*SMALL, "--host-kernel-us", 1000)
    assert busiest_ms <= slow_ms <= 1.25 * busiest_ms + free_ms
    assert free_ms < 0.01 * slow_ms
    assert step_ms(*SMALL) > free_ms  # eager PyTorch's default 31.9 us binds this small model too


def test_a_big_models_step_is_the_gpus_at_the_default_host_cost(tmp_path):
    """Its passes outlast their kernels' issue at the default 31.9 us a kernel (planning/host.py): the same
    profile times as with the host free, and the same step."""
    free, default = (profile(tmp_path, *BIG, *flags)["stages"] for flags in (("--host-kernel-us", 0), ()))
    assert [{name: stage[f"{name}_ms"] for name in PASS_NAMES} for stage in default] == \
        [{name: stage[f"{name}_ms"] for name in PASS_NAMES} for stage in free]
    assert step_ms(*BIG) == step_ms(*BIG, "--host-kernel-us", 0)


def two_stage_costs(tmp_path, *args):
    """The estimated profile, and per cut of it into two stages their F, B, I and W: tune's bound before costing
    them (planning/tune.py `_splitter`'s `stage_ms`), held at or below the stages' own costs, and those costs."""
    from pipesim.planning.scenario import profile_costs
    from pipesim.planning.tune import _splitter
    from pipesim.profiles.schema import load_profile
    from pipesim.schedules import KIND_CODE, Kind

    out = tmp_path / "tuned.json"
    code, _, err = pipesim("estimate", *args, "-o", out)
    assert code == 0, err
    measured = load_profile(out)
    layers = len(measured.layers)
    split = _splitter(measured, "adam")
    passes = [KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W)]
    cuts = {}
    for cut in range(1, layers):
        bounds = [0, cut, layers]
        cuts[cut] = profile_costs(measured, "adam", bounds).op_ms_table(1)[:, passes]
        assert (split.stage_ms(bounds, 1)[:, passes] <= cuts[cut] + 1e-12).all()
    return measured, cuts


def test_tunes_layer_sums_stay_below_every_stage_of_a_partly_host_bound_model(tmp_path):
    """tune bounds a stage before costing it by its layers' passes summed (planning/tune.py `_splitter`'s
    `stage_ms`), each layer at its own times (`_own_times`): as stages of their own, the small blocks would each be
    floored by their issue, where beside the large head (GPU-bound) a stage's floor is the totals': the sums of
    those floors exceed the stages, which the bound must not."""
    from pipesim.planning.scenario import profile_costs
    from pipesim.schedules import KIND_CODE, Kind

    measured, cuts = two_stage_costs(tmp_path, *SMALL, "--vocab", 200000, "--host-kernel-us", 30)
    alone = profile_costs(measured, "adam", range(len(measured.layers) + 1)).op_ms_table(1)
    alone = alone[:, [KIND_CODE[kind] for kind in (Kind.F, Kind.B)]]
    assert any((alone[cut:].sum(axis=0) > costs[1, :2] + 1e-6).any() for cut, costs in cuts.items())


def test_tunes_layer_sums_stay_below_every_stage_where_a_stage_takes_its_floor_beside_carried_waits(tmp_path):
    """Under --p2p-sync a dense model's layers carry their waits from the model's start (the host not ahead at the
    embedding), but the first stage's forward and the last stage's backward receive nothing and take only the
    floor of their totals, which the carried waits can exceed: the bound (`_own_times`' `least`) leaves them out
    for every layer that never synchronises, so it stays at or below each stage of every cut."""
    measured, cuts = two_stage_costs(tmp_path, *WIDER, "--p2p-sync")
    assert any(math.fsum(layer.fwd.median_ms for layer in measured.layers[:cut]) > costs[0, 0] + 1e-6
               for cut, costs in cuts.items())


def test_tunes_shape_sums_stay_below_every_cut_where_a_stage_takes_its_floor_beside_carried_waits(tmp_path):
    """tune's bound before any cut (planning/tune.py `_work`, which `_shape_bound` reads) sums the layers' least
    times too: under --p2p-sync the model as one stage, and the first stage's forward, take the floor of their
    totals, which their layers' own times summed exceed (by 0.007 ms in F and 0.015 ms in the slowest stage here,
    before). Every sum stays at or below every cut's, one stage to three."""
    from pipesim.planning.scenario import profile_costs
    from pipesim.planning.tune import _work
    from pipesim.schedules import KIND_CODE, Kind

    measured, _ = two_stage_costs(tmp_path, *WIDER, "--p2p-sync")
    work, n = _work(measured, "adam"), len(measured.layers)
    f, b, i, w = (KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
    for stages in (1, 2, 3):
        for cut in itertools.combinations(range(1, n), stages - 1):
            table = profile_costs(measured, "adam", [0, *cut, n]).op_ms_table(1)
            least_bwd = np.minimum(table[:, b], table[:, i] + table[:, w])
            assert work.fwd_ms <= math.fsum(table[:, f]) + 1e-12
            assert work.bwd_ms <= math.fsum(table[:, b]) + 1e-12
            assert work.least_bwd_ms <= math.fsum(least_bwd) + 1e-12
            assert work.slowest_ms[stages] <= (table[:, f] + least_bwd).max() + 1e-12


@pytest.mark.parametrize("rotate, forward_kernels, backward_kernels", [("alltoall", 10, 10), ("p2p", 11, 10)])
def test_the_host_issues_every_kernel_of_the_context_ring(tmp_path, rotate, forward_kernels, backward_kernels):
    """At C = 2 a layer's attention call runs the ring's 2 blocks, their merges (TransformerEngine 1.10's
    `AttnFuncWithCPAndKVP2P`: 4 + 2C forward, 2 + 3C backward) and under p2p v's copy (planning/estimate.py
    `ContextRing.kernels`), which the GPU side prices: the host issues each, so where it binds this small model a
    stage's pass rises over C = 1 by those kernels less the one kernel of C = 1's attention, per layer."""
    ring = ("--context-parallel", 2, "--cp-rotate", rotate)
    kernels = {}
    for context in ((), ring):
        slow, slower = (profile(tmp_path, *SMALL, "--attention", "flash", *context, "--host-kernel-us", us)
                        for us in (1000, 2000))
        kernels[bool(context)] = [{name: host2[f"{name}_ms"] - host[f"{name}_ms"] for name in PASS_NAMES}
                                  for host, host2 in zip(slow["stages"], slower["stages"], strict=True)]
    for stage, one, two in zip(slow["stages"], kernels[False], kernels[True], strict=True):
        attending = sum(layer["name"].endswith("_Block") for layer in slow["layers"][slice(*stage["layers"])])
        assert attending == 2
        first = not one["igrad"]  # the first stage: no input-gradient pass, its weight pass the whole backward
        added = {"fwd": forward_kernels - 1, "bwd": backward_kernels - 1, "igrad": 0 if first else backward_kernels - 1,
                 "wgrad": backward_kernels - 1 if first else 0}
        assert {name: two[name] - one[name] for name in PASS_NAMES} == pytest.approx(
            {name: count * attending for name, count in added.items()})
