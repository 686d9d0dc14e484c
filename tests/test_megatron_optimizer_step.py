"""Megatron-LM's 16-bit optimizer's step as the caching allocator sees it (sim/caching_allocator.py MAIN_GRADS,
`LayerAllocations.stepped`): each step makes every parameter's float32 main gradient (`main_grad.float()` of a
16-bit gradient buffer), Apex's FusedAdam makes the moments at its first step, and the next step's zero_grad frees
the main gradients, so their segments stay cached; the master weights are a block from the start."""

from __future__ import annotations

import json

import pytest

import pipesim.sim.caching_allocator as caching_allocator
from pipesim.sim.caching_allocator import LayerAllocations, minibatch_events, replay_device, stage_program
from pipesim.units import MIB

# saves 40 MiB, makes a 20 MiB gradient; its step's float32 main gradient 50 MiB, each moment 15
LAYER = LayerAllocations({"fwd": [(0, 40 * MIB)], "bwd": [(0, 20 * MIB)]}, stepped=((50 * MIB, 15 * MIB),))


def test_the_main_gradients_segment_stays_cached_and_the_moments_split_the_first_steps_blocks():
    """One layer, one micro-batch a step, two steps. The first reserves the activation's 40 MiB and the gradient's
    20 and frees both; the step's 50 MiB main gradient finds no cached block that holds it (a segment, 110 MiB
    reserved), the moments take the fronts of the 20 and the 40 MiB blocks, and zero_grad frees the main gradient.
    The second step's activation takes the main gradient's block, its gradient the rest of the 40: 90 MiB
    allocated, 110 reserved. The moments held as a block from the start instead, and no main gradients: 90 and 90."""
    rows = minibatch_events([(name, 0, (0, step, 0)) for step in range(2) for name in ("fwd", "bwd")])
    assert [name for name, _, _ in rows] == ["fwd:zero", "bwd"] * 2
    programs = {0: stage_program([LAYER])}
    made = replay_device([], [(name, 0, 0) for name, _, _ in rows], programs, adam_at_first_step=True)
    held = replay_device([30 * MIB], [(name, 0, 0) for name, _, _ in rows], programs)
    assert (made.peak_reserved_bytes, made.peak_allocated_bytes) == (110 * MIB, 90 * MIB)
    assert (held.peak_reserved_bytes, held.peak_allocated_bytes) == (90 * MIB, 90 * MIB)


def test_one_optimizer_steps_a_device_whatever_pipelines_its_stages_are_of():
    """A mini-batch's first row is the zero_grad's, once a mini-batch on a device that runs two pipelines."""
    rows = [("fwd", 0, (0, 0, 0)), ("fwd", 1, (1, 0, 0)), ("bwd", 1, (1, 0, 0)), ("bwd", 0, (0, 0, 0)),
            ("fwd", 0, (0, 1, 0)), ("bwd", 0, (0, 1, 0))]
    assert [name for name, _, _ in minibatch_events(rows)] == ["fwd:zero", "fwd", "bwd", "bwd", "fwd:zero", "bwd"]


@pytest.fixture(scope="module")
def counted():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=128, vocab=1000), 2, torch.float16)


def test_a_parameters_main_gradient_is_made_only_of_16_bit_gradients_and_its_moments_follow_the_precision(counted):
    """Per parameter (a storage the weight-gradient pass leaves live, g bytes of float16): a float32 main gradient
    (2g) where the gradients are accumulated in 16 bits, none where in float32, and a moment of 2g (float32) or g
    (16-bit moments); nothing unless asked for (`megatron_step`)."""
    from pipesim.planning.estimate import Parallelism, layer_allocations

    def stepped(megatron_step: bool = True, **parallel) -> list[tuple[int, int]]:
        return [each for layer in layer_allocations(counted, Parallelism(**parallel), megatron_step)
                for each in layer.stepped]

    grads = [nbytes for layer in layer_allocations(counted, Parallelism()) for nbytes in
             caching_allocator.left_live(layer.passes["wgrad"]).values()]
    assert len(grads) > 10 and sorted(stepped()) == sorted((2 * g, 2 * g) for g in grads)
    assert stepped(precision="megatron-16bit-grads") == stepped()  # float16's default
    assert sorted(stepped(precision="megatron")) == sorted((0, 2 * g) for g in grads)
    assert sorted(stepped(precision="megatron-bf16-moments")) == sorted((0, g) for g in grads)
    assert stepped(False) == []


def test_context_parallel_ranks_hold_the_weight_gradients_and_their_step_whole(counted):
    """Context parallelism splits the tokens, not the weights: each of the C ranks makes every parameter's gradient
    whole, and its step's main gradients and moments (`stepped`), while it makes 1/C of each activation and of the
    input gradient the full backward leaves beside the weights' (a block of width 256: moments 3,159,040 bytes on
    a rank at C = 2 as at C = 1, not 1,579,520)."""
    from pipesim.planning.estimate import Parallelism, layer_allocations

    whole, split = (layer_allocations(counted, Parallelism(context=c), True) for c in (1, 2))
    block, halved = whole[1], split[1]
    assert sum(moment for _, moment in block.stepped) == 3_159_040
    assert [layer.stepped for layer in split] == [layer.stepped for layer in whole]
    grads = caching_allocator.left_live(block.passes["wgrad"])
    assert caching_allocator.left_live(halved.passes["wgrad"]) == grads
    bwd, bwd_split = (sum(caching_allocator.left_live(layer.passes["bwd"]).values()) for layer in (block, halved))
    input_gradient = bwd - sum(grads.values())
    assert input_gradient > 0 and bwd_split == bwd - input_gradient // 2
    assert [nbytes * 2 for _, nbytes in halved.passes["fwd"]] == [nbytes for _, nbytes in block.passes["fwd"]]


GPT = ["--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "4", "--seq-len",
       "256", "--vocab", "8192", "-p", "2", "-m", "4", "-s", "1f1b"]
SMALL_GPT = [*GPT, "--dtype", "fp16"]


@pytest.mark.parametrize("flags,made", [(("--optimizer-step", "megatron"), True), ((), False),
                                        (("--optimizer-step", "megatron", "-n", "1"), True)])
def test_simulate_replays_megatrons_step_under_its_flag(monkeypatch, flags, made):
    """--optimizer-step megatron: the optimizer state's block is the master weights alone, the moments made at the
    first step, over one mini-batch too (its step replayed again as the steps after it run, `steady_rows`); by
    default the state one block as before."""
    from tests.conftest import simulate_json, spy_reserves

    seen = spy_reserves(monkeypatch)
    (out,) = simulate_json(*SMALL_GPT, *flags)
    state = [device["peak_memory_parts_mb"]["optimizer_state"] * MIB for device in out["devices"]]
    assert [call["adam_at_first_step"] for call in seen] == [made] * 2
    for static, held in zip((call["static_bytes"] for call in seen), state, strict=True):
        assert len(static) == 3 and (static[-1] < held / 2 if made else static[-1] == pytest.approx(held, abs=1))


@pytest.mark.parametrize("flags,said", [
    (("--optimizer-step", "bogus"), "--optimizer-step: choose from held, megatron (got 'bogus')"),
    (("--optimizer-step", "megatron", "--allocator", "none"), "give --gpu NAME, --model and --allocator caching"),
    (("--optimizer-step", "megatron", "--optimizer", "sgd"), "give --optimizer adam or adamw"),
    (("--optimizer-step", "megatron", "--dtype", "fp32"), "master weights --precision fp32 does not keep"),
    (("--optimizer-step", "megatron", "--data-parallel", "2", "--sharded-optimizer"),
     "its distributed optimizer (--sharded-optimizer) allocates otherwise")])
def test_optimizer_step_megatron_is_refused_where_it_cannot_run_in_one_line(flags, said):
    from tests.conftest import pipesim

    code, out, err = pipesim("simulate", *(GPT if "--dtype" in flags else SMALL_GPT), *flags)
    assert (code, out) == (2, "") and said in err and len(err.strip().splitlines()) == 1


# tune's one configuration of SMALL_GPT: 1F1B, p = 2 over 2 GPUs, b = 1, m = 4, t = 1, no recomputation
TUNE_ONE = ["tune", *GPT[:-6], "--dtype", "fp16", "-D", "2", "-B", "4", "-s", "1f1b", "--tensor-parallel", "1",
            "--data-parallel", "1", "-b", "1", "--recompute", "none", "--json"]


def test_tune_replays_megatrons_step_under_its_flag_as_simulate_does():
    """tune's peak is simulate's under each --optimizer-step, and the flag moves it (the main gradients' segments
    cached beside the activations)."""
    from tests.conftest import pipesim, simulate_json

    peaks = {}
    for step in ("held", "megatron"):
        code, out, err = pipesim(*TUNE_ONE, "--optimizer-step", step)
        assert code == 0, err
        choice = json.loads(out)["choice"]
        assert (choice["schedule"], choice["stages"], choice["microbatches"]) == ("1f1b", 2, 4)
        peaks[step] = choice["peak_memory_gib"] * 1024
        (simulated,) = simulate_json(*SMALL_GPT, "-b", "1", "--optimizer-step", step)
        assert peaks[step] == pytest.approx(max(d["peak_memory_mb"] for d in simulated["devices"]))
    assert peaks["megatron"] != pytest.approx(peaks["held"])


def test_tune_refuses_optimizer_step_megatron_where_it_cannot_run_in_one_line():
    from tests.conftest import pipesim

    code, out, err = pipesim(*TUNE_ONE, "--optimizer-step", "megatron", "--allocator", "none")
    assert (code, out) == (2, "") and "give --gpu NAME, --model and --allocator caching" in err
    assert len(err.strip().splitlines()) == 1


MOE = ["--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "4", "--seq-len",
       "256", "--vocab", "1000", "--gated", "--experts", "8", "--dtype", "fp16", "--optimizer-step", "megatron"]


@pytest.mark.parametrize("command", [["simulate", *MOE, "-p", "2", "--data-parallel", "8", "-m", "4", "-s", "1f1b"],
                                     ["tune", *MOE, *TUNE_ONE[TUNE_ONE.index("-D"):-1]]])
def test_optimizer_step_megatron_is_refused_for_a_mixture_of_experts_which_no_replay_runs(command):
    """A mixture of experts' allocations are not replayed (commands/common.py `allocator_fields`), so the flag
    would change nothing: one line saying so, not the held step's figures."""
    from tests.conftest import pipesim

    code, out, err = pipesim(*command)
    assert (code, out) == (2, "") and "replays no mixture of experts' steps" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["simulate", *MOE[:-2], "-p", "2", "--data-parallel", "8", "-m", "4", "-s",
                                      "1f1b"], ["tune", *MOE[:-2], *TUNE_ONE[TUNE_ONE.index("-D"):-1]]])
def test_expandable_segments_are_refused_for_a_mixture_of_experts_which_no_replay_runs(command):
    """--allocator expandable gave a mixture of experts the caching allocator's figures, the tensors alone."""
    from tests.conftest import pipesim

    code, out, err = pipesim(*command, "--allocator", "expandable")
    assert (code, out) == (2, "") and err.strip().splitlines()[-1] == (
        "error: --allocator expandable: the caching allocator replays no mixture of experts' steps (its count is "
        "every expert's, not a rank's), so its peak is the tensors alone; leave --allocator out")
