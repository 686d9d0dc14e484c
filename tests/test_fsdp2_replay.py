"""FSDP2's whole weights and gradients under a pipeline, replayed through the caching allocator as FSDP2 makes and
frees them (sim/caching_allocator.py `LayerAllocations.unsharded`, `step_events`): gathered as a layer's first
forward of a step begins, accumulated in float32 as its first backward ends, resharded and reduce-scattered after
its last (torch's pipelining, stage.py `backward_maybe_with_nosync`), the shards on the reduce-scatter stream until
the next step's zero_grad; not held as blocks from the step's start."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.sim.caching_allocator import LayerAllocations, replay_device, stage_program, step_events
from pipesim.units import MIB
from tests.conftest import pipesim
from tests.helpers import H100


def _rows(passes: list[str], steps: int = 2) -> list[tuple[str, int, tuple[int, int, int]]]:
    """One stage's rows over `steps` mini-batches, each pass "fwd0" (pass, micro-batch) as `device_rows` gives."""
    return [(name[:-1], 0, (0, step, int(name[-1]))) for step in range(steps) for name in passes]


def test_each_stages_first_forward_and_backward_and_last_backward_of_a_mini_batch_are_named():
    """The device's first row follows zero_grad, a stage's first forward gathers, its first full or weight
    backward accumulates, its last one releases; an input pass does neither, and each mini-batch begins again."""
    named = [name for name, _, _ in step_events(_rows(["fwd0", "fwd1", "bwd0", "bwd1"]))]
    assert named == ["fwd:zero:first", "fwd", "bwd:first", "bwd:last"] * 2
    split = [name for name, _, _ in step_events(_rows(["fwd0", "igrad0", "fwd1", "wgrad0", "igrad1", "wgrad1"], 1))]
    assert split == ["fwd:zero:first", "igrad", "fwd", "wgrad:first", "igrad", "wgrad:last"]
    assert [name for name, _, _ in step_events(_rows(["fwd0", "bwd0"], 1))] == ["fwd:zero:first", "bwd:first:last"]
    two = step_events([("fwd", 0, (0, 0, 0)), ("fwd", 1, (0, 0, 0)), ("bwd", 1, (0, 0, 0)), ("bwd", 0, (0, 0, 0))])
    assert [name for name, _, _ in two] == ["fwd:zero:first", "fwd:first", "bwd:first:last", "bwd:first:last"]


LAYER = LayerAllocations({"fwd": [(0, 40 * MIB)], "bwd": [(0, 20 * MIB)]})  # saves 40 MiB, makes a 20 MiB gradient


def _replayed(layer: LayerAllocations, static: list[int]):
    """Two such layers on one stage, one micro-batch a step, two steps."""
    rows = _rows(["fwd0", "bwd0"])
    if layer.unsharded:
        rows = step_events(rows)
    return replay_device(static, [(name, stage, mb[1:]) for name, stage, mb in rows],
                         {0: stage_program([layer, layer])})


def test_whole_weights_and_gradients_are_made_when_fsdp2_makes_them_and_freed_after_the_last_backward():
    """Each layer's 10 MiB of whole weights before its forward, copied out of a 10 MiB all-gather output on the
    all-gather stream (the previous layer's freed once it is made, the last layer's kept to the next step), its
    30 MiB of float32 gradients once its backward made its own 20: the most allocated is the second layer's
    backward, 2 x (10 + 40) + 20 + 30 = 150 MiB on the compute stream and the last all-gather output's 10, where
    the same bytes held as blocks from the start read 2 x (10 + 30) + 2 x 40 + 20 = 180. The 10 MiB shards the step
    before left are freed at zero_grad, but their segments stay cached on the reduce-scatter stream, and two
    all-gather outputs' on theirs, which no other stream's requests take: 150 + 20 + 20 MiB reserved. After the
    last backward the shards and the last all-gather output are left (the reduce-scatter input took a freed
    activation's cached block)."""
    timed = _replayed(replace(LAYER, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),)), [])
    held = _replayed(LAYER, [20 * MIB, 60 * MIB])
    assert timed.peak_allocated_bytes == 160 * MIB and held.peak_allocated_bytes == 180 * MIB
    assert timed.peak_reserved_bytes == 190 * MIB and held.peak_reserved_bytes == 180 * MIB
    assert timed.allocated_bytes == 30 * MIB


@pytest.fixture(scope="module")
def counted():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=128, vocab=1000), 2, torch.bfloat16)


def test_a_layers_whole_tensors_are_its_gathered_weights_and_float32_gradients_one_a_parameter(counted):
    """Per parameter (a storage the weight-gradient pass leaves live), the layer's weights as FSDP2 gathers them
    (a block's float8 linears at 1 byte under the float8 all-gather, as the estimate's all_gather_bytes), its
    float32 gradients (the estimate's grad_bytes) and their shard over d = 4, on one of t = 2 ranks; nothing under
    another precision."""
    from pipesim.planning.estimate import Parallelism, estimate_profile, layer_allocations

    parallel = Parallelism(tensor=2, data=4, sharded_optimizer=True, precision="fsdp2", fp8="torchao",
                           fsdp_float8_all_gather=True)
    profile = estimate_profile(counted, H100, parallel, bounds=[0, len(counted.layers)])
    for made, layer in zip(layer_allocations(counted, parallel), profile.layers, strict=True):
        grads: dict[int, int] = {}
        for number, nbytes in made.passes["wgrad"]:
            grads[number] = nbytes
        grads = {number: nbytes for number, nbytes in grads.items() if nbytes > 0}  # what the pass leaves live
        assert len(made.unsharded) == len(grads) > 0
        gathered, accumulated, shard = (sum(part) for part in zip(*made.unsharded, strict=True))
        assert gathered == pytest.approx(layer.all_gather_bytes, abs=len(grads))
        assert accumulated == pytest.approx(layer.grad_bytes, abs=len(grads))
        assert shard == pytest.approx(layer.grad_bytes / 4, abs=len(grads))
    assert any(layer.all_gather_bytes < layer.param_bytes for layer in profile.layers)  # a block's float8 linears
    bf16 = replace(parallel, precision=None, sharded_optimizer=False, fp8=None, fsdp_float8_all_gather=False)
    assert all(made.unsharded == () for made in layer_allocations(counted, bf16))


@pytest.mark.parametrize("tensor", [1, 2])
def test_under_expert_parallelism_a_rank_gathers_its_local_experts_alone(tensor):
    """8 routed experts over E = 4 ranks of d = 4 (torchtitan's fully_shard of the experts over `dp_mod_ep`, the d·C/E
    ranks left once they are placed): a rank gathers its 2 local experts whole, 1/4 of each routed storage it gathered
    at E = 1, and accumulates their gradients so, sharded over d/E = 1 rank, the same bytes a rank as before; the
    dense parameters' storages as they were. The block's whole weights and gradients are the estimate's param_bytes
    and grad_bytes on the rank, as at E = 1 (where all 8 experts, 4 times the rank's, were gathered)."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile, layer_allocations
    from pipesim.workload.count import count_built

    moe = count_built("gpt", dict(layers=1, width=64, heads=4, seq_len=32, vocab=128, gated=True, experts=8, top_k=2),
                      2, torch.bfloat16)
    block = moe.layers[1]
    placed, whole = (Parallelism(tensor=tensor, data=4, expert=e, precision="fsdp2") for e in (4, 1))
    profile = estimate_profile(moe, H100, placed, bounds=[0, len(moe.layers)])
    local, every = (layer_allocations(moe, parallel)[1].unsharded for parallel in (placed, whole))
    gathered, accumulated, _ = (sum(part) for part in zip(*local, strict=True))
    assert gathered == pytest.approx(profile.layers[1].param_bytes, abs=len(local))
    assert accumulated == pytest.approx(profile.layers[1].grad_bytes, abs=len(local))
    routed = [index for index, (mine, all_of_them) in enumerate(zip(local, every)) if mine[0] < all_of_them[0] / 2]
    assert len(routed) == 2 and sum(every[i][0] for i in routed) == pytest.approx(block.expert_param_bytes / tensor,
                                                                                   rel=0.01)
    for i, (mine, all_of_them) in enumerate(zip(local, every, strict=True)):
        # within 1 %: the replicated weights' excess over their 1/t storages is spread over all (the rank's total)
        if i in routed:
            assert mine == pytest.approx((all_of_them[0] / 4, all_of_them[1] / 4, all_of_them[2]), rel=0.01)
        else:
            assert mine == pytest.approx(all_of_them, rel=0.01)


def test_each_model_part_of_a_device_has_its_own_all_gather_and_reduce_scatter_streams():
    """torchtitan shards each model part as an FSDP2 root of its own, whose communication context makes its own
    streams: a device's second stage leaves its shard and all-gather output in pools the first's never serve."""
    from pipesim.sim.caching_allocator import ALL_GATHER_STREAM, LEFT, REDUCE_SCATTER_STREAM, pool_of, round_request

    layer = replace(LAYER, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),))
    for part in (0, 1):
        left = stage_program([layer], part).passes[LEFT]
        request = round_request(10 * MIB)
        assert [pool for _, _, pool in left] == [pool_of(request, REDUCE_SCATTER_STREAM + 2 * part),
                                                 pool_of(request, ALL_GATHER_STREAM + 2 * part)]


def _by_stream_mib(allocator, blocks: dict[int, int]) -> dict[int, int]:
    """`blocks` (address -> size, in the allocator's units) summed in MiB by the stream its pool belongs to."""
    from pipesim.sim.caching_allocator import POOL_SHIFT

    held: dict[int, int] = {}
    for address, size in blocks.items():
        stream = address << allocator.unit_shift >> POOL_SHIFT >> 1
        held[stream] = held.get(stream, 0) + (size << allocator.unit_shift) // MIB
    return held


def _pools_allocated(allocator) -> dict[int, int]:
    """The bytes handed out, in MiB, by stream."""
    return _by_stream_mib(allocator, allocator._allocated)


def _pools_reserved(allocator) -> dict[int, int]:
    """The segments' bytes, in MiB, by stream."""
    return _by_stream_mib(allocator, allocator._segments)


def test_without_a_pipeline_fsdp2_gathers_reshards_and_reduce_scatters_block_by_block():
    """A model of an embedding and a head (the root's, gathered as one group before the forward and kept whole)
    around two blocks, each 10 MiB of weights, 30 MiB of float32 gradients and a 10 MiB shard, one micro-batch a
    step: the first block resharded after its forward, the last kept whole (torchtitan), each block gathered
    again for its backward and reduce-scattered after it. The most allocated is the head's backward: the root's
    20 MiB of weights, the last block's 10, four layers' 40 MiB saved, the head's 20 MiB gradient and the last
    block's all-gather output, 220 MiB, where FIRST's pipeline timing holds every layer's weights whole and
    gradients to the end. After the step, the shards on the reduce-scatter stream (10 + 10 + the root's 20) and
    the last block's all-gather output alone are left; their streams hold what no compute request takes: the
    shards' 40 MiB (freed at zero_grad, before the peak) and the all-gather outputs' 50 (the root's 20 MiB made
    again where the last block's output splits the first one's segment)."""
    from pipesim.sim.caching_allocator import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, unpipelined_events

    block = replace(LAYER, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),))
    root = replace(block, fsdp_root=True)
    rows = [(name, stage, mb[1:]) for name, stage, mb in unpipelined_events(_rows(["fwd0", "bwd0"]))]
    assert [name for name, _, _ in rows] == ["fwd:zero:each", "bwd:each:first"] * 2
    replayed = replay_device([], rows, {0: stage_program([root, block, block, root])})
    assert replayed.peak_allocated_bytes == 220 * MIB
    assert _pools_allocated(replayed) == {REDUCE_SCATTER_STREAM: 40, ALL_GATHER_STREAM: 10}
    assert {stream: _pools_reserved(replayed)[stream] for stream in (REDUCE_SCATTER_STREAM, ALL_GATHER_STREAM)} == {
        REDUCE_SCATTER_STREAM: 40, ALL_GATHER_STREAM: 50}
    pipelined = replay_device([], [(name, stage, mb[1:]) for name, stage, mb in step_events(_rows(["fwd0", "bwd0"]))],
                              {0: stage_program([root, block, block, root])})
    assert pipelined.peak_allocated_bytes > replayed.peak_allocated_bytes


def test_a_later_backward_of_the_mini_batch_adds_its_shards_to_those_held():
    """Two micro-batches a step without a pipeline: the second backward's reduce-scatter outputs are added to
    the first's shards and freed, so the step ends holding one set of shards."""
    from pipesim.sim.caching_allocator import REDUCE_SCATTER_STREAM, unpipelined_events

    block = replace(LAYER, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),))
    rows = unpipelined_events(_rows(["fwd0", "bwd0", "fwd1", "bwd1"]))
    assert [name for name, _, _ in rows] == ["fwd:zero:each", "bwd:each:first", "fwd:each", "bwd:each"] * 2
    replayed = replay_device([], [(name, stage, mb[1:]) for name, stage, mb in rows],
                             {0: stage_program([block, block])})
    assert _pools_allocated(replayed)[REDUCE_SCATTER_STREAM] == 20


def test_the_layers_other_than_transformer_layers_are_the_fsdp2_roots(counted):
    """torchtitan shards each transformer block as a group of its own and the rest (embedding, final norm, head)
    with the model's root: the estimate marks the latter, under FSDP2 alone."""
    from pipesim.planning.estimate import Parallelism, layer_allocations

    parallel = Parallelism(data=4, sharded_optimizer=True, precision="fsdp2")
    made = layer_allocations(counted, parallel)
    assert [layer.fsdp_root for layer in made] == [True] + [False] * (len(made) - 2) + [True]
    assert not any(layer.fsdp_root for layer in layer_allocations(counted, replace(parallel, precision=None)))


@pytest.mark.parametrize("costs", [("--gpu", "h100-sxm", "--model", "gpt"),
                                   ("--gpu", "h100-sxm", "--model", "gpt", "--allocator", "none"), ()],
                         ids=["replayed", "tensors-alone", "typed-costs"])
def test_a_method_that_interleaves_mini_batches_is_skipped_under_fsdp2_in_one_line(costs):
    """The replay gathers and reshards a stage's weights once a mini-batch; PipeDream's next mini-batch (and
    AvgPipe's other pipeline) began before, and the replay freed a tensor twice: a KeyError's traceback. FSDP2
    runs so whether or not its allocations are replayed: with the tensors alone, or typed costs, both ran."""
    code, out, err = pipesim("simulate", *costs, "-p", "2", "-m", "4", "--data-parallel", "2", "--zero", "3",
                             "--precision", "fsdp2", "-s", "1f1b", "-s", "pipedream", "-s", "avgpipe")
    why = ": device 0 starts a mini-batch before its last one's backwards are done, and FSDP2 (--precision fsdp2)"
    lines = err.splitlines()
    assert code == 0 and ("fits" in out or not costs) and len(lines) == 2, err  # typed costs: no device's memory
    assert lines[0].startswith("skipped: pipedream" + why) and lines[1].startswith("skipped: avgpipe" + why), err


def test_gpipes_forwards_in_a_row_find_the_root_and_last_block_whole_and_its_second_backward_regathers_them():
    """GPipe's order without a pipeline (two forwards, then two backwards): the second forward finds the root and the
    last block whole (FSDP2's `unshard` is a no-op for them) and gathers the first block alone; the first backward
    finds them whole, the second resharded by the first (`post_backward`), so the root's pre_backward gathers it
    again and prefetches the last block. The most allocated is the first backward's head: two micro-batches' 4 x 40
    MiB saved, the root's 20 MiB and the last block's 10 MiB of weights, the head's 20 MiB gradient and the held
    all-gather output's 10, 380 MiB; each step ends holding the shards (40 MiB) and that output, as it began (where
    each forward gathered everything, the root's and the last block's weights were made twice and freed twice)."""
    from pipesim.sim.caching_allocator import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, unpipelined_events

    block = replace(LAYER, unsharded=((10 * MIB, 30 * MIB, 10 * MIB),))
    root = replace(block, fsdp_root=True)
    rows = unpipelined_events(_rows(["fwd0", "fwd1", "bwd0", "bwd1"]))
    assert [name for name, _, _ in rows] == ["fwd:zero:each", "fwd:each:again", "bwd:each:first", "bwd:each:again"] * 2
    replayed = replay_device([], [(name, stage, mb[1:]) for name, stage, mb in rows],
                             {0: stage_program([root, block, block, root])})
    assert replayed.peak_allocated_bytes == 380 * MIB
    assert _pools_allocated(replayed) == {REDUCE_SCATTER_STREAM: 40, ALL_GATHER_STREAM: 10}


SMALL_GPT = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256,
             "--vocab", 1000, "-b", 1, "--data-parallel", 8, "--recompute", "none", "-n", 3)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("zero", [2, 3])
def test_every_method_replays_its_rows_and_each_mini_batch_gives_back_what_it_takes(monkeypatch, p, zero):
    """Every method the command line offers (one simulate comparing them all) at m = 2 and 3, three mini-batches,
    under ZeRO-2 and FSDP2: each device's replay runs (GPipe's forwards in a row without a pipeline gathered the
    root's and last block's weights again and freed them twice: a KeyError's traceback) and leaks nothing. With
    FSDP2's events, the last mini-batch replayed ends holding what the second did and allocates no more at its most;
    without, the rows end holding the state's blocks alone."""
    from pipesim.sim.caching_allocator import AGAIN, STEADY_STEPS, ZERO
    from tests.conftest import spy_reserves

    seen = spy_reserves(monkeypatch)
    for m in (2, 3):
        code, out, err = pipesim("simulate", *SMALL_GPT, "-p", p, "-m", m, "--zero", zero,
                                 *(["--precision", "fsdp2"] if zero == 3 else []))
        assert code == 0 and "fits" in out, err
    assert seen and ((p, zero) != (1, 3) or any(AGAIN in name for call in seen for name, _, _ in call["rows"]))
    for call in seen:
        rows = call["rows"]

        def replayed(rows_run: int):
            return replay_device(call["static_bytes"], rows[:rows_run], dict(enumerate(call["programs"])), None,
                                 call["expandable"], call["adam_at_first_step"], call["merged_bytes"])

        starts = [at for at, (name, _, _) in enumerate(rows) if ZERO in name]
        if starts:
            # the steps simulated, and where a device runs them one after another their steady repetition
            assert len(starts) in (3, 3 + STEADY_STEPS)
            second, last = replayed(starts[2]), replayed(len(rows))
            assert (last.allocated_bytes, last.peak_allocated_bytes) == (
                second.allocated_bytes, second.peak_allocated_bytes), rows
        else:
            assert replayed(len(rows)).allocated_bytes == replayed(0).allocated_bytes, rows
