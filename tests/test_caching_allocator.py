"""The caching allocator's rules, each case written out by hand from c10/cuda/CUDACachingAllocator.cpp, and held
against a plain allocator written here (every cached block searched, segments as lists of blocks)."""

import random
from dataclasses import fields, replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipesim.sim.caching_allocator import (
    POOL_SHIFT,
    AllocatorOutOfMemory,
    CachingAllocator,
    LayerAllocations,
    Program,
    replay_device,
    round_request,
    segment_bytes,
    stage_program,
    steady_rows,
)
from pipesim.units import KIB, MIB
from tests.conftest import needs_transformers
from tests.helpers import H100, small_gpt_count


def replay(static_bytes, rows, layers, capacity_bytes=None) -> CachingAllocator:
    """`replay_device` on each stage's layers (`layers[stage]`) written down as the simulator writes them."""
    return replay_device(static_bytes, rows, {stage: stage_program(mine) for stage, mine in layers.items()},
                         capacity_bytes)


def test_requests_round_to_512_bytes():
    assert [round_request(n) for n in (0, 1, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]


def test_segment_sizes_by_request():
    assert segment_bytes(512) == 2 * MIB
    assert segment_bytes(1 * MIB) == 2 * MIB  # at most 1 MiB: the small pool
    assert segment_bytes(1 * MIB + 512) == 20 * MIB
    assert segment_bytes(10 * MIB - 512) == 20 * MIB
    assert segment_bytes(10 * MIB) == 10 * MIB  # from 10 MiB up: its own size, rounded to 2 MiB
    assert segment_bytes(11 * MIB) == 12 * MIB


def test_small_requests_pack_into_2_mib_segments():
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(512 * KIB)
    assert allocator.reserved_bytes == 2 * MIB
    allocator.malloc(1)
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (4 * MIB, 2 * MIB + 512)


def test_a_middle_request_splits_a_20_mib_segment():
    allocator = CachingAllocator()
    allocator.malloc(3 * MIB)
    allocator.malloc(3 * MIB)  # from the first segment's remaining 17 MiB
    assert allocator.reserved_bytes == 20 * MIB


def test_a_large_segment_is_split_only_when_over_1_mib_remains():
    allocator = CachingAllocator()
    allocator.malloc(11 * MIB)  # 12 MiB segment, 1 MiB left: not split, the block is the whole segment
    assert allocator.allocated_bytes == 12 * MIB
    allocator.malloc(10 * MIB + 512)  # 12 MiB segment, 2 MiB - 512 left: split
    assert allocator.allocated_bytes == 22 * MIB + 512
    allocator.malloc(3 * MIB // 2)  # served by the remainder: no 20 MiB segment
    assert allocator.reserved_bytes == 24 * MIB


def _cached(allocator: CachingAllocator, *sizes_mib: int) -> list[int]:
    """Allocate a block of each size in MiB, then free them all: they stay cached. Their addresses."""
    addresses = [allocator.malloc(size * MIB) for size in sizes_mib]
    for address in addresses:
        allocator.free(address)
    return addresses


def test_best_fit_among_cached_blocks():
    allocator = CachingAllocator()
    first, second = _cached(allocator, 50, 30)
    assert allocator.malloc(25 * MIB) == second  # the smallest that holds it, at its front
    assert allocator.malloc(40 * MIB) == first
    assert allocator.reserved_bytes == 80 * MIB


def test_equal_cached_blocks_serve_lowest_address_first_whatever_order_they_were_freed_in():
    """The cached blocks kept by size, each size's addresses in a list of its own: best fit's tie is the lowest
    address, a size whose blocks are all taken is no longer offered, and a size cached again is."""
    allocator = CachingAllocator()
    first, second, third, small = (allocator.malloc(size * MIB) for size in (16, 16, 16, 14))
    for address in (third, small, first, second):
        allocator.free(address)
    assert [allocator.malloc(15 * MIB) for _ in range(3)] == [first, second, third]
    assert allocator.malloc(13 * MIB) == small
    allocator.free(second)
    assert allocator.malloc(11 * MIB) == second  # no 14 MiB block left: the 16 MiB one, not a new segment
    assert allocator.reserved_bytes == 62 * MIB


def test_blocks_of_different_segments_never_merge():
    allocator = CachingAllocator()
    _cached(allocator, 20, 20)
    allocator.malloc(40 * MIB)
    assert (allocator.reserved_bytes, allocator.peak_reserved_bytes) == (80 * MIB, 80 * MIB)


def test_freed_neighbours_merge_within_a_segment():
    allocator = CachingAllocator()
    first, second = allocator.malloc(3 * MIB), allocator.malloc(3 * MIB)
    allocator.free(second)
    allocator.free(first)  # first, second and the rest are one 20 MiB block again
    assert allocator.malloc(18 * MIB) == first
    assert allocator.reserved_bytes == 20 * MIB


def test_a_block_freed_on_one_stream_never_serves_another():
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(100 * MIB, stream=0))
    allocator.malloc(100 * MIB, stream=1)
    assert allocator.reserved_bytes == 200 * MIB


def test_a_pool_reserving_past_2_48_bytes_keeps_its_blocks_apart_from_the_next_pools():
    """An unbounded replay's large pool past 2^48 bytes (gpt at -b 60,000,000): its second block, freed, is cached
    in its own pool and serves it again, and the small pool's block its own."""
    allocator = CachingAllocator()
    small = allocator.malloc(KIB)
    allocator.malloc(1 << 48)
    second = allocator.malloc(1 << 48)
    allocator.free(second)
    assert allocator.malloc(1 << 48) == second
    allocator.free(small)
    assert allocator.malloc(KIB) == small
    assert allocator.reserved_bytes == 2 * (1 << 48) + 2 * MIB


def test_a_freed_tensor_keeps_its_segment_beside_a_larger_one():
    """The 8B's loss: the 16-bit logits (4,008 MiB) freed before a float32 tensor twice their size."""
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(4008 * MIB))
    allocator.malloc(8016 * MIB)
    assert (allocator.allocated_bytes, allocator.peak_reserved_bytes) == (8016 * MIB, 12024 * MIB)


def test_max_split_size_keeps_oversize_blocks_whole():
    allocator = CachingAllocator(max_split_bytes=200 * MIB)
    allocator.free(allocator.malloc(300 * MIB))
    allocator.malloc(100 * MIB)  # under max_split_size: never an oversize cached block
    assert allocator.reserved_bytes == 400 * MIB
    allocator.free(allocator.malloc(260 * MIB))  # its own 260 MiB segment
    taken = allocator.malloc(250 * MIB)  # within 20 MiB of the 260 MiB block: taken whole, not split
    assert allocator.allocated_bytes == 100 * MIB + 260 * MIB and allocator.reserved_bytes == 660 * MIB
    allocator.free(taken)
    allocator.malloc(230 * MIB)  # 30 MiB under both cached blocks: a segment of its own
    assert allocator.reserved_bytes == 890 * MIB


def test_a_failed_cuda_malloc_releases_whole_cached_segments_then_gives_up():
    allocator = CachingAllocator(capacity_bytes=100 * MIB)
    kept = allocator.malloc(3 * MIB)  # a 20 MiB segment, split: not released while part of it is held
    allocator.free(allocator.malloc(40 * MIB))
    allocator.malloc(60 * MIB)  # 20 + 40 + 60 > 100: the cached 40 MiB segment is released
    assert (allocator.reserved_bytes, allocator.peak_reserved_bytes) == (80 * MIB, 80 * MIB)
    allocator.free(kept)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(90 * MIB)  # even with the 20 MiB segment released, 60 + 90 > 100


def test_the_counts_allocations_are_each_passs_creations_and_frees_in_order():
    """Per pass, every storage freed was created before in the same pass, with the same bytes, and the freed ones
    live at once at their most are the pass's transient tensors."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 32, "vocab": 1000}, 2,
                          torch.bfloat16)
    for layer in counted.layers[1:]:
        assert set(layer.allocations) == {"fwd", "bwd", "igrad", "wgrad"}
        for name in ("bwd", "igrad", "wgrad"):
            created = {number: nbytes for number, _, nbytes, _ in layer.allocations[name] if nbytes >= 0}
            freed = [(number, -nbytes) for number, _, nbytes, _ in layer.allocations[name] if nbytes < 0]
            assert all(created[number] == nbytes for number, nbytes in freed)
            live, most = 0, 0
            for number, _, nbytes, _ in layer.allocations[name]:
                if number in dict(freed):
                    live += nbytes
                    most = max(most, live)
            assert most == sum(nbytes for _, nbytes in layer.transient_tensors[name])


def test_the_losss_16_bit_logits_stay_reserved_beside_its_backwards_float32_tensors():
    """The loss layer (final norm, head, cross entropy upcast to float32) over 2,048 tokens of an 8,192-word
    vocabulary, its forward then its backward replayed: the forward reserves 2 MiB for its small tensors, 32 MiB
    for the bf16 logits, 64 for their float32 copy and 64 for the log-softmax it saves, and frees the first two
    large ones; the backward's two float32 gradients take the copy's cached block and one new 64 MiB segment
    (the logits' 32 MiB block holds neither), and its bf16 gradient the logits' block. Reserved: 226 MiB, of
    which the logits' segment is not held at the peak."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 1024, "vocab": 8192}, 2,
                          torch.bfloat16)
    loss = counted.layers[-1]
    allocator, forward, backward = CachingAllocator(), Program(), Program()
    kept = forward.replay((number, nbytes) for number, _, nbytes, _ in loss.allocations["fwd"])
    allocator.run(forward.ops, [0] * forward.slots)
    assert allocator.reserved_bytes == (2 + 32 + 2 * 64) * MIB and len(kept) == 6  # the log-softmax among them
    backward.replay((number, nbytes) for number, _, nbytes, _ in loss.allocations["bwd"])
    allocator.run(backward.ops, [0] * backward.slots)
    assert allocator.peak_reserved_bytes == (2 + 32 + 3 * 64) * MIB
    assert allocator.peak_reserved_bytes - allocator.peak_allocated_bytes > 32 * MIB


def test_a_devices_state_is_allocated_first_and_held():
    """3 MiB: a 20 MiB segment; 100 and 300 KiB: one 2 MiB small segment between them."""
    allocator = replay([3 * MIB, 100 * KIB, 300 * KIB], [], {})
    assert (allocator.reserved_bytes, allocator.allocated_bytes) == (22 * MIB, 3 * MIB + 400 * KIB)


def test_a_devices_rows_keep_each_forwards_tensors_until_its_backward():
    """One layer keeping 30 MiB with a 12 MiB transient in its forward; its backward a 20 MiB transient and a 4 MiB
    gradient. F0 reserves 30 + 12; F1 30 more (the cached 12 MiB block holds its transient, not its 30); B0's 20
    MiB a new segment (the 12 MiB block is too small, F0's 30 is still held), its gradient split from the 12 MiB
    block; B1 reuses the cached 20. Allocated at most 30 + 30 + 20 (in B0), reserved 92."""
    layers = {0: [LayerAllocations({"fwd": [(0, 30 * MIB), (1, 12 * MIB), (1, -12 * MIB)],
                                    "bwd": [(0, 20 * MIB), (0, -20 * MIB), (1, 4 * MIB)]})]}
    rows = [("fwd", 0, 0), ("fwd", 0, 1), ("bwd", 0, 0), ("bwd", 0, 1)]
    allocator = replay([], rows, layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes) == (92 * MIB, 80 * MIB)
    assert allocator.allocated_bytes == 0


def test_a_split_backward_frees_the_forwards_tensors_after_the_weight_pass():
    """The input pass's 10 MiB gradient goes as it ends; the forward's 30 MiB stay through the weight pass, whose
    20 MiB then need a segment of their own: 30 + 10 + 20 reserved (40, were the 30 freed after the input pass)."""
    layers = {0: [LayerAllocations({"fwd": [(0, 30 * MIB)], "igrad": [(0, 10 * MIB)], "wgrad": [(0, 20 * MIB)]})]}
    allocator = replay([], [("fwd", 0, 0), ("igrad", 0, 0), ("wgrad", 0, 0)], layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes) == (
        60 * MIB, 50 * MIB, 0)


def test_a_device_runs_its_stages_layers_in_order_and_reversed():
    """Two stages on a device (interleaved), of two layers each: `first` keeps 30 MiB and its backward makes and
    frees 12, `second` keeps 16 and its backward 14. Stage 1's backward runs its layers reversed: `first` while
    all four forwards' tensors are held (92 + 12 MiB), then `second`, whose 14 MiB take the 30 MiB block `first`
    freed. Run in forward order it would be 92 + 14."""
    first = LayerAllocations({"fwd": [(0, 30 * MIB)], "bwd": [(0, 12 * MIB), (0, -12 * MIB)]})
    second = LayerAllocations({"fwd": [(0, 16 * MIB)], "bwd": [(0, 14 * MIB), (0, -14 * MIB)]})
    layers = {0: [first, second], 1: [second, first]}
    allocator = replay([], [("fwd", 0, 0), ("fwd", 1, 0), ("bwd", 1, 0), ("bwd", 0, 0)], layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes) == (
        104 * MIB, 104 * MIB, 0)


# A forward that saves 30 MiB (0), makes and frees 12 (1) and outputs 16 (2); its backward makes and frees 20.
RECOMPUTED = {"fwd": [(0, 30 * MIB), (1, 12 * MIB), (1, -12 * MIB), (2, 16 * MIB)],
              "bwd": [(0, 20 * MIB), (0, -20 * MIB)]}


def test_a_full_recomputation_drops_what_the_forward_saves_and_remakes_it_in_the_backward():
    """Nothing kept: each forward holds only its 16 MiB output, its 30 MiB going as it ends (F1 reuses F0's 30 and
    12 MiB blocks, its output a new 16). B0 reruns the forward (30 and 12 from the cache, its output again a new
    16, freed at once), then its 20 MiB need a segment of their own: 30 + 12 + 3 x 16 + 20 reserved, at most
    16 + 16 + 30 + 20 allocated."""
    layers = {0: [LayerAllocations(RECOMPUTED, saved=frozenset({0}), rerun=frozenset({0, 1, 2}))]}
    allocator = replay([], [("fwd", 0, 0), ("fwd", 0, 1), ("bwd", 0, 0), ("bwd", 0, 1)], layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes) == (
        110 * MIB, 82 * MIB, 0)


def test_a_policy_keeps_what_it_saves_even_where_the_forward_freed_it():
    """Keeping the 12 MiB (an op's output the policy saves though autograd does not): the forward holds it and
    its output, its 30 MiB go; the backward's rerun makes only the 30 and the output again (a new 16, freed), then
    its 20: reserved 30 + 12 + 16 + 16 + 20, at most 12 + 16 + 30 + 20 allocated."""
    layers = {0: [LayerAllocations(RECOMPUTED, saved=frozenset({0}), rerun=frozenset({0, 2}), kept=frozenset({1}))]}
    allocator = replay([], [("fwd", 0, 0), ("bwd", 0, 0)], layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes) == (
        94 * MIB, 78 * MIB, 0)


def test_a_selective_recomputation_reruns_only_its_part_of_the_forward():
    """Megatron-LM's selective recomputation as a rerun of the 12 MiB its forward also saves (the attention core):
    each forward holds 30 + 16, F1 takes F0's freed 12 MiB block for its own; each backward makes the 12 again
    beside its 20: 2 x (30 + 16) + 12 + 20 at most, where keeping the 12 would hold 2 x 58 + 20."""
    passes = {"fwd": [(0, 30 * MIB), (1, 12 * MIB), (2, 16 * MIB)], "bwd": [(0, 20 * MIB), (0, -20 * MIB)]}
    layers = {0: [LayerAllocations(passes, saved=frozenset({0, 1}), rerun=frozenset({1}))]}
    allocator = replay([], [("fwd", 0, 0), ("fwd", 0, 1), ("bwd", 0, 0), ("bwd", 0, 1)], layers)
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, allocator.allocated_bytes) == (
        124 * MIB, 124 * MIB, 0)


def test_a_device_that_does_not_fit_even_with_its_cache_released():
    with pytest.raises(AllocatorOutOfMemory):
        replay([50 * MIB], [("fwd", 0, 0)], {0: [LayerAllocations({"fwd": [(0, 20 * MIB)]})]},
                      capacity_bytes=60 * MIB)


def test_an_estimate_replays_the_counts_allocations_as_one_tensor_parallel_rank_makes_them():
    """A GPT block (width 64, MLP 256) over 2 x 32 tokens in bf16 on one of 2 tensor-parallel ranks, no sequence
    parallelism: its residual-stream tensors whole (2 x 32 x 64 x 2 bytes), its MLP's hidden ones halved (2 x 32 x
    256 x 2 / 2), each freed as many bytes as it was made with."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, layer_allocations
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 32, "vocab": 1000}, 2,
                          torch.bfloat16)
    block = counted.layers[1]
    ranked = layer_allocations(counted, Parallelism(tensor=2))[1].passes
    for name, events in block.allocations.items():
        on_rank = dict(zip(((number, nbytes > 0) for number, _, nbytes, _ in events), ranked[name], strict=True))
        by_shape = {shape: abs(on_rank[number, nbytes > 0][1]) for number, shape, nbytes, _ in events}
        assert by_shape.get((2, 32, 64), 8192) == 8192 and by_shape.get((2, 32, 256), 16384) == 16384
        assert all(-on_rank[number, True][1] == freed for (number, made), (_, freed) in on_rank.items() if not made)
    assert any((2, 32, 256) in {shape for _, shape, _, _ in events} for events in block.allocations.values())


@pytest.mark.parametrize("model", [dict(), dict(norm="rmsnorm", gated=True, linear_bias=False),
                                   dict(gated=True, experts=8, top_k=2)])
def test_a_ranks_replayed_gradients_hold_the_replicated_weights_whole_as_the_estimate_does(model):
    """On one of t = 2 ranks, each layer's parameters' gradients as the replay makes them (what its weight-gradient
    pass leaves live) add up to the estimate's gradient bytes (bf16 here, float32 there): the weights tensor
    parallelism keeps whole (`replicated_share`: the norms' scales and shifts, the row-parallel biases, the learned
    position embedding, a router) whole, the rest 1/t. Halved too, they fell short by the replicated half: a GPT's
    embedding 10,240 bytes against 12,288, its block 49,984 against 50,368."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile, layer_allocations
    from pipesim.sim.caching_allocator import left_live
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=1, width=64, heads=4, seq_len=32, vocab=128, **model), 2,
                          torch.bfloat16)
    for sequence_parallel in (False, True):
        parallel = Parallelism(tensor=2, sequence_parallel=sequence_parallel)
        profile = estimate_profile(counted, H100, parallel, bounds=[0, 3])
        made = layer_allocations(counted, parallel)
        assert [sum(left_live(layer.passes["wgrad"]).values()) for layer in made] == [
            layer.grad_bytes // 2 for layer in profile.layers]
    assert counted.layers[0].position_embedding_bytes and counted.layers[1].norm_param_bytes


def test_the_count_says_which_of_a_forwards_storages_autograd_saves_and_what_made_each():
    """A GPT block's and the loss layer's forwards leave live what autograd saves and their output, nothing else;
    the saved ones and what it saves of its inputs (the loss's targets too) are its saved bytes; the loss saves
    the log-softmax (_log_softmax's), not the logits it frees. What a recomputation policy needs to replay."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    b, s, width = 2, 1024, 64
    counted = count_built("gpt", {"layers": 2, "width": width, "heads": 2, "seq_len": s, "vocab": 8192}, b,
                          torch.bfloat16)
    for layer, output_bytes, saved_input_bytes in ((counted.layers[1], b * s * width * 2, b * s * width * 2),
                                             (counted.layers[-1], 4, b * s * (width * 2 + 8))):  # int64 targets
        events = layer.allocations["fwd"]
        freed = {number for number, _, nbytes, _ in events if nbytes < 0}
        left = {number: nbytes for number, _, nbytes, _ in events if number not in freed}
        unsaved = [nbytes for number, nbytes in left.items() if number not in layer.saved_allocations]
        assert unsaved == [output_bytes]
        assert sum(left[number] for number in layer.saved_allocations) + saved_input_bytes == layer.saved_bytes
    made_by = {op for number, shape, _, op in counted.layers[-1].allocations["fwd"]
               if number in counted.layers[-1].saved_allocations and shape == (b * s, 8192)}
    assert made_by == {"_log_softmax"}


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_what_each_recomputation_has_a_blocks_backward_make_again(attention):
    """A GPT block's forward under each policy: none reruns nothing; full reruns every storage it made; torchtitan's
    op policy keeps the 1st, 3rd, ... product's output and the fused attention's, rerunning the rest; Megatron-LM's
    selective reruns the s x s tensors of the attention core (math attention; flash has none). Replayed over two
    micro-batches, each recomputation holds less at its peak than none. The loss layer (no attention) reruns
    nothing under full."""
    from pipesim.planning.estimate import Parallelism, layer_allocations

    counted = small_gpt_count(attention)
    block = counted.layers[1]
    made = [(number, shape, op) for number, shape, nbytes, op in block.allocations["fwd"] if nbytes >= 0]
    policy = {name: layer_allocations(counted, Parallelism(recompute=name))[1]
              for name in ("none", "full", "op", "selective")}
    assert policy["none"].rerun is None and policy["full"].rerun == {number for number, _, _ in made}
    products = [number for number, _, op in made if op in ("mm", "addmm", "bmm")]
    fused = {number for number, _, op in made if "attention" in op}
    assert policy["op"].kept == set(products[::2]) | fused and policy["op"].rerun == policy["full"].rerun - \
        policy["op"].kept
    assert policy["selective"].rerun == {number for number, shape, _ in made if shape[-2:] == (128, 128)}
    assert bool(policy["selective"].rerun) == (attention == "math") and bool(fused) == (attention == "flash")
    rows = [("fwd", 0, 0), ("fwd", 0, 1), ("bwd", 0, 0), ("bwd", 0, 1)]
    peaks = {name: replay([], rows, {0: [layer] * 2}).peak_allocated_bytes for name, layer in policy.items()}
    assert all(peaks[name] < peaks["none"] for name in ("full", "op")) and peaks["full"] < peaks["op"]
    assert peaks["selective"] < peaks["none"] if attention == "math" else peaks["selective"] == peaks["none"]
    assert layer_allocations(counted, Parallelism(recompute="full"))[-1].rerun is None


def test_a_devices_rows_are_its_passes_in_the_order_they_start():
    """1F1B on 4 devices, 8 micro-batches, as Megatron-LM runs it: device 1 warms up with 4 - 1 - 1 = 2 forwards,
    then alternates a forward and a backward, then drains its last 2 backwards; each micro-batch of each
    mini-batch named apart."""
    from pipesim.sim import Costs, simulate
    from pipesim.sim.caching_allocator import device_rows
    from pipesim.sim.cluster import Cluster
    from tests.conftest import build

    schedule = build("1f1b", 4, 8, 2)
    trace = simulate(schedule, Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0), Cluster.uniform(4, 0.0))
    rows = device_rows(trace, 1)
    first = [(name, microbatch) for name, stage, (_, minibatch, microbatch) in rows if minibatch == 0]
    assert first == [("fwd", 0), ("fwd", 1), *[row for i in range(6) for row in (("fwd", i + 2), ("bwd", i))],
                     ("bwd", 6), ("bwd", 7)]
    assert {stage for _, stage, _ in rows} == {1} and len(rows) == 2 * 2 * 8


def test_an_empty_storage_takes_no_block():
    """torch hands out nothing for 0 bytes; the count records its free as 0 bytes too, which must not allocate."""
    allocator, program = CachingAllocator(), Program()
    assert program.replay([(0, 0), (1, 3 * MIB), (0, 0), (0, 0)]) == {1: 0}
    allocator.run(program.ops, [0] * program.slots)
    assert (allocator.allocated_bytes, allocator.reserved_bytes, len(program.ops)) == (3 * MIB, 20 * MIB, 1)


def _one_f_one_b(warm_up: int, microbatches: int) -> list[tuple[str, int, tuple[int, int]]]:
    """One device's 1F1B rows over two mini-batches: `warm_up` forwards, a forward and a backward each, the drain."""
    rows = []
    for minibatch in range(2):
        order = [*range(warm_up), *[i for j in range(microbatches - warm_up) for i in (warm_up + j, -j - 1)],
                 *range(-(microbatches - warm_up) - 1, -microbatches - 1, -1)]
        rows += [("fwd" if i >= 0 else "bwd", 0, (minibatch, i if i >= 0 else -i - 1)) for i in order]
    return rows


def test_a_steady_state_is_replayed_once_with_the_full_replays_peaks(monkeypatch):
    """Two layers, one keeping 30 MiB and making a 12 MiB transient, the other keeping 16 and its backward making
    20: every forward-backward pair of 1F1B's steady state after the first brings back the same state, so the
    replay runs a few of the 2 x 32 rows' pairs and reads the peaks the whole replay reads."""
    from pipesim.sim import caching_allocator

    layers = {0: [LayerAllocations({"fwd": [(0, 30 * MIB), (1, 12 * MIB), (1, -12 * MIB)],
                                    "bwd": [(0, 20 * MIB), (0, -20 * MIB), (1, 4 * MIB)]}),
                  LayerAllocations(RECOMPUTED)]}
    rows = _one_f_one_b(4, 32)
    run = caching_allocator._Replay.run
    whole = caching_allocator._Replay(CachingAllocator(), rows, {0: caching_allocator.stage_program(layers[0])})
    for at in range(len(rows)):
        run(whole, at)
    ran = []
    monkeypatch.setattr(caching_allocator._Replay, "run", lambda *args: ran.append(run(*args)))
    skipped = replay([], rows, layers)
    assert (skipped.peak_reserved_bytes, skipped.peak_allocated_bytes, skipped.allocated_bytes) == (
        whole.allocator.peak_reserved_bytes, whole.allocator.peak_allocated_bytes, 0)
    assert len(ran) < len(rows) / 3


def test_a_device_whose_step_does_not_fit_reserves_what_it_takes_unbounded():
    """torch releases its cached segments when a cudaMalloc fails; a step that still does not fit is out of
    memory, and its reserve is read without the bound (its peak then over the GPU's), not left out."""
    from pipesim.sim import Costs, simulate
    from pipesim.sim.caching_allocator import device_reserves
    from pipesim.sim.cluster import Cluster
    from tests.conftest import build

    trace = simulate(build("1f1b", 2, 4, 1), Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0), Cluster.uniform(2, 0.0))
    layer = LayerAllocations({"fwd": [(0, 30 * MIB), (1, 12 * MIB), (1, -12 * MIB)],
                              "bwd": [(0, 20 * MIB), (0, -20 * MIB), (1, 4 * MIB)]})
    unbounded = device_reserves(trace, {0: [layer], 1: [layer]}, [None, None])
    assert all(unbounded) and device_reserves(trace, {0: [layer], 1: [layer]}, [10 * MIB] * 2) == unbounded


# A GPT whose loss's logits (256 tokens x 8,192 x 2 bytes: 4 MiB) and their float32 gradients are large-pool blocks
SMALL_GPT = ["--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "4",
             "--seq-len", "256", "--vocab", "8192", "-p", "2", "-m", "4", "-s", "1f1b"]


def test_the_allocators_reserve_is_a_part_of_each_devices_peak(tmp_path):
    """--gpu replays each device's step (--allocator caching, the default): its reserve is a part of the peak, on
    the memory curve and in the page's stacked parts; --allocator none leaves every other part and the tensors'
    peak as they were."""
    from pipesim.traces import read_trace
    from pipesim.traces.view import stacked_memory
    from tests.conftest import simulate_json

    (caching,), (none,) = (simulate_json(*SMALL_GPT, *flags)
                           for flags in (["--trace", tmp_path / "t.json"], ["--allocator", "none"]))
    for device, tensors in zip(caching["devices"], none["devices"]):
        parts = device["peak_memory_parts_mb"]
        assert parts["reserve"] > 0 and tensors["peak_memory_parts_mb"]["reserve"] == 0
        assert sum(parts.values()) == pytest.approx(device["peak_memory_mb"], rel=1e-12)
        assert device["peak_memory_mb"] == pytest.approx(tensors["peak_memory_mb"] + parts["reserve"], rel=1e-12)
        assert {**parts, "reserve": 0} == pytest.approx(tensors["peak_memory_parts_mb"], rel=1e-12)
    trace = read_trace(tmp_path / "t.json")
    assert [counter.values.max() / MIB for counter in trace.counters["memory_bytes"]] == pytest.approx(
        [device["peak_memory_mb"] for device in caching["devices"]], rel=1e-12)
    stacked = stacked_memory(trace, 1e9)
    assert stacked["names"][-1] == "allocator's reserve"


def test_a_mixture_of_experts_is_not_replayed():
    """The count's allocations are a whole layer's on one device, every expert's; a rank of E holds 1/E of them,
    which the estimate's allocations do not divide (t and C alone): no reserve rather than a wrong one."""
    from tests.conftest import simulate_json

    (result,) = simulate_json(*SMALL_GPT, "--gated", "--experts", "4", "--top-k", "2")
    assert all(device["peak_memory_parts_mb"]["reserve"] == 0 for device in result["devices"])


@pytest.mark.parametrize("flags,message", [
    (["--allocator", "slab", *SMALL_GPT], "error: --allocator: choose from caching, expandable, none (got 'slab')"),
    (["--allocator", "none", "-s", "1f1b"], "error: --allocator: only --gpu's estimate counts"),
])
def test_a_bad_allocator_is_one_line(flags, message):
    from tests.conftest import pipesim

    code, _, err = pipesim("simulate", *flags)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_a_sweep_reads_each_configurations_peak_as_simulate_does(tmp_path):
    """sweep --gpu replays each configuration's devices as simulate does: its peak is simulate's, the reserve in;
    --allocator none leaves the tensors' peak."""
    import csv

    from tests.conftest import pipesim, simulate_json

    flags = SMALL_GPT[:-6]  # the model and GPU: a sweep takes -p, -m and -s as lists
    peaks = {}
    for allocator in ("caching", "none"):
        out = tmp_path / f"{allocator}.csv"
        code, _, err = pipesim("sweep", *flags, "-s", "1f1b", "-p", "2", "-m", "4", "--allocator", allocator,
                               "--workers", "1", "--out", out)
        assert code == 0, err
        (row,) = csv.DictReader(out.open())
        peaks[allocator] = float(row["peak_memory_mb"])
    (simulated,) = simulate_json(*SMALL_GPT)
    assert peaks["caching"] == pytest.approx(max(d["peak_memory_mb"] for d in simulated["devices"]), rel=1e-9)
    assert peaks["caching"] > peaks["none"]


class _PlainAllocator:
    """torch's rules as the module's docstring states them, the plain way: each segment a list of [bytes,
    allocated] blocks in address order, segments in the order made (their addresses' order), every cached block
    of the pool searched for the best fit. A block is named by its segment's number and its offset in it; its
    `address` as the module lays segments out (a pool's each 512 bytes past the end of the one made before)."""

    def __init__(self, capacity_bytes: int | None, max_split_bytes: int | None):
        self.capacity_bytes, self.max_split_bytes = capacity_bytes, max_split_bytes
        self.segments: dict[int, tuple[tuple[int, bool], list[list]]] = {}  # number: (pool, blocks)
        self.starts: dict[int, int] = {}  # number: the segment's address
        self.next_start: dict[tuple[int, bool], int] = {}  # pool: where its next segment starts
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def malloc(self, nbytes: int, stream: int) -> tuple[int, int]:
        request = max(512, -(-nbytes // 512) * 512)
        pool = (stream, request <= MIB)
        fits = [(size, number, offset) for number, (of, blocks) in self.segments.items() if of == pool
                for offset, (size, allocated) in _offsets(blocks) if not allocated and size >= request]
        best = min(fits, default=None)
        if best is not None and self.max_split_bytes is not None and (
                request < self.max_split_bytes <= best[0] or
                request >= self.max_split_bytes and best[0] >= request + 20 * MIB):
            best = None
        if best is None:
            size = 2 * MIB if request <= MIB else 20 * MIB if request < 10 * MIB else -(-request // (2 * MIB)) * 2 * MIB
            if self.capacity_bytes is not None and self.reserved + size > self.capacity_bytes:
                for number, (_, blocks) in list(self.segments.items()):
                    if len(blocks) == 1 and not blocks[0][1]:
                        self.reserved -= blocks[0][0]
                        del self.segments[number]
                if self.reserved + size > self.capacity_bytes:
                    raise AllocatorOutOfMemory
            number = max(self.segments, default=-1) + 1
            self.segments[number] = (pool, [[size, False]])
            self.starts[number] = self.next_start.get(pool, (pool[0] << 1 | pool[1]) << POOL_SHIFT)
            self.next_start[pool] = self.starts[number] + size + 512
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            best = (size, number, 0)
        size, number, offset = best
        blocks = self.segments[number][1]
        index = [at for at, _ in _offsets(blocks)].index(offset)
        remaining = size - request
        if remaining >= 512 if pool[1] else remaining > MIB and (self.max_split_bytes is None or
                                                                 request < self.max_split_bytes):
            blocks[index:index + 1] = [[request, False], [remaining, False]]
        blocks[index][1] = True
        self.allocated += blocks[index][0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return number, offset

    def address(self, block: tuple[int, int]) -> int:
        number, offset = block
        return self.starts[number] + offset

    def free(self, block: tuple[int, int]) -> None:
        number, offset = block
        blocks = self.segments[number][1]
        index = [at for at, _ in _offsets(blocks)].index(offset)
        blocks[index][1] = False
        self.allocated -= blocks[index][0]
        for at in (index, index - 1):  # with the block after it, then the one before with both
            if 0 <= at < len(blocks) - 1 and not blocks[at][1] and not blocks[at + 1][1]:
                blocks[at:at + 2] = [[blocks[at][0] + blocks[at + 1][0], False]]


def _offsets(blocks: list[list]) -> list[tuple[int, list]]:
    at, placed = 0, []
    for block in blocks:
        placed.append((at, block))
        at += block[0]
    return placed


# requests around each rule's bounds half of the time: 1 MiB (the pools), 1 MiB left (a large block split), 10 MiB
# (a segment of the request's own size), 20 MiB (a large-pool segment), and any bytes up to 60 MiB
BOUNDS = [512, 1024, MIB - 512, MIB, MIB + 1, 2 * MIB, 9 * MIB, 10 * MIB - 512, 10 * MIB, 19 * MIB, 20 * MIB, 21 * MIB]
REQUEST_BYTES = st.one_of(st.sampled_from(BOUNDS), st.sampled_from(BOUNDS), st.sampled_from(BOUNDS),
                          st.integers(0, 2 * MIB), st.integers(MIB, 12 * MIB), st.integers(10 * MIB, 60 * MIB))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), REQUEST_BYTES, st.integers(0, 1), st.integers(0, 1000)), max_size=60),
       capacity_mib=st.one_of(st.none(), st.integers(20, 200)),
       max_split_mib=st.one_of(st.none(), st.sampled_from([4, 16, 40])))
@example(ops=[(False, 3 * MIB, 0, 0), (False, 3 * MIB, 0, 0), (True, 0, 0, 0), (False, 45 * MIB, 0, 0)],
         capacity_mib=64, max_split_mib=None)  # a cached block at a segment's start is not the whole segment
@example(ops=[(False, 40 * MIB, 0, 0), (True, 0, 0, 0), (False, 20 * MIB, 0, 0)], capacity_mib=None,
         max_split_mib=16)  # a cached block exactly 20 MiB larger than a request over max_split_size is not taken
@example(ops=[(False, 20 * MIB, 0, 0), (False, 20 * MIB, 0, 0), (True, 0, 0, 0), (True, 0, 0, 0),
              (False, 20 * MIB, 0, 0)], capacity_mib=None, max_split_mib=None)  # of two blocks of its size, the first
def test_any_mallocs_and_frees_read_as_a_plain_allocator_reads_them(ops, capacity_mib, max_split_mib):
    """Random requests on two streams, some freed as they go (`free`: the live block at `pick` mod their count),
    with and without a capacity and max_split_size: after every call the same bytes allocated and reserved and
    the same peaks, each request given the same block (its address), and out of memory at the same call."""
    capacity, max_split = (None if mib is None else mib * MIB for mib in (capacity_mib, max_split_mib))
    fast, plain = CachingAllocator(capacity, max_split), _PlainAllocator(capacity, max_split)
    live: list[tuple[int, tuple[int, int]]] = []
    for free, nbytes, stream, pick in ops:
        if free and live:
            address, block = live.pop(pick % len(live))
            fast.free(address)
            plain.free(block)
        else:
            try:
                address = fast.malloc(nbytes, stream)
            except AllocatorOutOfMemory:
                with pytest.raises(AllocatorOutOfMemory):
                    plain.malloc(nbytes, stream)
                return
            live.append((address, plain.malloc(nbytes, stream)))
            assert address == plain.address(live[-1][1])
        assert (fast.allocated_bytes, fast.reserved_bytes, fast.peak_allocated_bytes, fast.peak_reserved_bytes) == (
            plain.allocated, plain.reserved, plain.peak_allocated, plain.peak_reserved)


def _synthetic_layer(seed: int, recompute: str) -> LayerAllocations:
    """A layer whose passes make storages of the small pool, of the 20 MiB segments' range and of their own
    segments (and empty ones), each pass freeing some as it goes, the forward leaving the rest live, half of them
    saved; `recompute`: none, full, or a policy that keeps a third and reruns the rest."""
    rng = random.Random(seed)

    def events(first: int) -> tuple[tuple[int, int], ...]:
        made, live = [], {}
        for number in range(first, first + rng.randrange(6, 14)):
            if live and rng.random() < 0.35:
                freed = rng.choice(sorted(live))
                made.append((freed, -live.pop(freed)))
            nbytes = rng.choice([rng.randrange(1, MIB), rng.randrange(MIB, 10 * MIB),
                                 rng.randrange(10 * MIB, 48 * MIB), 0])
            made.append((number, nbytes))
            live[number] = nbytes
        return tuple(made)

    passes = {name: events(first) for name, first in (("fwd", 0), ("bwd", 100), ("igrad", 200), ("wgrad", 300))}
    made = sorted({number for number, nbytes in passes["fwd"] if nbytes > 0})
    saved = frozenset(rng.sample(made, len(made) // 2))
    if recompute == "none":
        return LayerAllocations(passes, saved)
    kept = frozenset(rng.sample(made, len(made) // 3)) if recompute == "policy" else frozenset()
    return LayerAllocations(passes, saved, frozenset(made) - kept, kept)


def _pipeline(method: str, p: int, m: int, chunks: int | None, recompute: str, seed: int = 0, minibatches: int = 2):
    """`method`'s rows per device over `minibatches` (v = `chunks`) and two synthetic layers a stage: the first and
    last stages' their own, the middle ones' alike (`seed` draws others)."""
    from pipesim.sim.caching_allocator import device_rows
    from tests.conftest import build, simulated

    schedule = build(method, p, m, minibatches, **({"chunks": chunks} if chunks else {}))
    trace = simulated(schedule).trace
    last = schedule.num_stages - 1
    layers = {stage: [_synthetic_layer(100 * seed + min(stage, 1) + 2 * (stage == last) + 10 * k, recompute)
                      for k in range(2)] for stage in range(last + 1)}
    return trace, [device_rows(trace, device) for device in range(schedule.num_devices)], layers


STATIC_BYTES = [30 * MIB, 5 * MIB, 700_000]


@pytest.mark.parametrize("case,recorded", [
    (("1f1b", 4, 8, None, "none"), [((505413632, 400545792), None), ((184549376, 155476480), None),
                                    ((180355072, 142728704), None), ((358612992, 229173760), (281018368, 229193216))]),
    (("interleaved-1f1b", 2, 4, 2, "full"), [((578813952, 452464128), (536870912, 453389824)),
                                             ((448790528, 252186624), (398458880, 252287488))]),
    (("zb-h1", 3, 6, None, "policy"), [((515899392, 428424192), (473956352, 428424192)),
                                       ((354418688, 220729856), (306184192, 220729856)),
                                       ((520093696, 450801664), None)]),
    (("zb-h1", 3, 6, None, "none"), [((459276288, 384649728), (417333248, 385280000)),
                                     ((354418688, 219280896), (306184192, 219280896)),
                                     ((513802240, 448696832), None)]),
])
def test_a_pipelines_devices_replay_to_the_peaks_recorded_before_the_replay_was_compiled(case, recorded):
    """Each device's peak reserved and allocated bytes, unbounded and within its unbounded peak less 40 MiB (its
    cached whole segments released when a segment does not fit; None: out of memory even then), as the replay
    read them at 6b5b0b7, block by block with Block objects, before its passes were written down once
    (`stage_program`) and replayed on addresses alone."""
    _, rows, layers = _pipeline(*case)
    read = []
    for device_rows in rows:
        unbounded = replay(STATIC_BYTES, device_rows, layers)
        try:
            bounded = replay(STATIC_BYTES, device_rows, layers, unbounded.peak_reserved_bytes - 40 * MIB)
            within = (bounded.peak_reserved_bytes, bounded.peak_allocated_bytes)
        except AllocatorOutOfMemory:
            within = None
        read.append(((unbounded.peak_reserved_bytes, unbounded.peak_allocated_bytes), within))
    assert read == recorded


def test_a_stages_program_and_a_devices_reserve_are_read_once_for_the_same_content(monkeypatch):
    """Layers of the same content (other objects) give the same program; device_reserves replays a device whose
    static bytes, rows and stages' content it has read before not again, and reads the same reserves."""
    from pipesim.sim import caching_allocator

    trace, rows, layers = _pipeline("1f1b", 4, 8, None, "full")
    twin = {stage: [LayerAllocations(dict(layer.passes), layer.saved, layer.rerun, layer.kept) for layer in each]
            for stage, each in layers.items()}
    assert caching_allocator.stage_program(twin[1]) is caching_allocator.stage_program(layers[1])
    assert caching_allocator.stage_program(layers[1]) is caching_allocator.stage_program(layers[2])
    static = [[held[part] for part in ("parameters", "gradients", "optimizer_state")]
              for held in trace.meta.peak_memory_parts]
    each = [replay(bytes_held, device_rows, layers) for bytes_held, device_rows in zip(static, rows)]
    caching_allocator._reserve.cache_clear()
    replayed = []
    run = caching_allocator.replay_device
    monkeypatch.setattr(caching_allocator, "replay_device", lambda *args: replayed.append(args) or run(*args))
    first = caching_allocator.device_reserves(trace, layers, [None] * 4)
    assert first == [device.peak_reserved_bytes - device.peak_allocated_bytes for device in each]
    assert len(replayed) == 4
    assert caching_allocator.device_reserves(trace, twin, [None] * 4) == first and len(replayed) == 4


def test_layers_differing_in_any_field_get_programs_of_their_own():
    """`stage_program` caches a program by its layers' content: each of `LayerAllocations`' fields is in the key
    (0d33a30's first_forward had to be added by hand), so a field added later without a case here fails."""
    base = LayerAllocations({"fwd": ((0, 4 * MIB), (1, 2 * MIB)), "bwd": ((2, MIB), (2, -MIB))}, saved=frozenset({0}))
    changed = {"passes": {"fwd": ((0, 4 * MIB),), "bwd": ()}, "saved": frozenset({0, 1}), "rerun": frozenset({0}),
               "kept": frozenset({1}), "unsharded": ((MIB, MIB, MIB // 2),), "fsdp_root": True,
               "first_forward": ((0, 4 * MIB), (1, 2 * MIB), (0, -4 * MIB)), "stepped": ((2 * MIB, 2 * MIB),),
               "wgrad_kept": frozenset({0}), "wgrad_inputs": (MIB,), "wgrad_gradients": (2 * MIB,)}
    assert [field.name for field in fields(LayerAllocations)] == list(changed)
    programs = [stage_program([base]), *(stage_program([replace(base, **{name: value})])
                                         for name, value in changed.items())]
    assert len({id(program) for program in programs}) == len(programs)


@pytest.mark.parametrize("case", [("gpipe", 3, 4, None, "full", 27), ("zb-h2", 3, 6, None, "policy", 3)])
def test_a_flushing_orders_reserve_is_its_steady_steps_whatever_the_steps_simulated(case):
    """The cache each step leaves carries into the next, and these layers' steps take a segment more from their
    third on: two mini-batches' rows replayed as they are reserve less than eight's on a device (so the case holds
    what it tests); `device_reserves`, which repeats the last mini-batch (`steady_rows`), reads the same reserves
    from two mini-batches as from eight."""
    from pipesim.sim.caching_allocator import device_reserves

    (two, two_rows, layers), (eight, eight_rows, _) = (_pipeline(*case, minibatches=n) for n in (2, 8))
    assert ([replay(STATIC_BYTES, rows, layers).peak_reserved_bytes for rows in two_rows]
            != [replay(STATIC_BYTES, rows, layers).peak_reserved_bytes for rows in eight_rows])
    limits = [None] * len(two_rows)
    assert device_reserves(two, layers, limits) == device_reserves(eight, layers, limits)


def test_only_a_device_running_its_minibatches_alike_one_after_another_is_repeated():
    """An order whose mini-batches interleave on a device (PipeDream's) repeats within its rows, and one whose last
    two mini-batches run other rows is no repetition: both are replayed as they are; a flushing order's last
    mini-batch is repeated `STEADY_STEPS` times, numbered after it."""
    from pipesim.sim.caching_allocator import STEADY_STEPS

    _, async_rows, _ = _pipeline("pipedream", 3, 6, None, "none")
    interleaved = [rows for rows in async_rows if sorted(rows, key=lambda row: row[2][1]) != list(rows)]
    assert interleaved and all(steady_rows(rows) == list(rows) for rows in interleaved)
    _, flushed, _ = _pipeline("1f1b", 3, 6, None, "none")
    rows = flushed[0]
    steady = steady_rows(rows)
    last = [row for row in rows if row[2][1] == 1]
    assert steady[:len(rows)] == rows and len(steady) == len(rows) + STEADY_STEPS * len(last)
    assert steady[-len(last):] == [(name, stage, (pipeline, 1 + STEADY_STEPS, micro))
                                   for name, stage, (pipeline, _, micro) in last]
    unlike = [*rows[:-1], ("fwd", *rows[-1][1:])]
    assert steady_rows(unlike) == unlike


@needs_transformers
def test_auto_is_searched_again_within_the_reserve_the_caching_allocator_adds(monkeypatch, tmp_path):
    """auto's search caps each device's tensors at its memory, and the caching allocator's reserve on top took Llama
    3.1 8B's device 2 past it at p = 8, R = 2 (82,806 MiB of an 80 GiB datasheet H100's 81,920; the tensors 80,931):
    it is searched again leaving each device what it overran by, and fits, at the same step; the caption says so;
    sweep's row too. (The catalogue's H100 gives torch 79.11 GiB, where device 7's 81,892 is out of memory whatever
    the order: the part here is its table without `device_memory`.)"""
    import csv
    import json

    from pipesim.planning import scenario as scenario_module
    from tests.conftest import pipesim
    from tests.helpers import datasheet_part

    flags = ("simulate", *datasheet_part(tmp_path, "h100-sxm"), "--model", "hf:examples/llama3.1-8b",
             "--seq-len", 8192, "-s", "auto", "--activation-limit", 2, "-p", 8, "-m", 32)
    code, out, err = pipesim(*flags, "--json")
    assert code == 0, err
    fitted = json.loads(out)["results"][0]
    assert not any(device["out_of_memory"] for device in fitted["devices"])
    code, out, err = pipesim(*flags)
    assert code == 0 and "auto searched again leaving up to " in " ".join(out.split()), err
    monkeypatch.setattr(scenario_module, "SEARCHES_WITHIN_RESERVE", 0)  # the first search's order, as it ran
    code, out, err = pipesim(*flags, "--json")
    first = json.loads(out)["results"][0]
    assert any(device["out_of_memory"] for device in first["devices"]) and "runs out of memory" in err
    assert fitted["time_per_minibatch_ms"] <= first["time_per_minibatch_ms"] * 1.01
    monkeypatch.undo()
    table = tmp_path / "sweep.csv"  # sweep's row is simulate's
    code, _, err = pipesim("sweep", *flags[1:11], "-p", 8, "-m", 32, "--activation-limit", 2, "-j", 1, "--out", table)
    assert code == 0, err
    (row,) = csv.DictReader(table.open())
    assert row["out_of_memory"] == "False" and float(row["peak_memory_mb"]) == pytest.approx(
        max(device["peak_memory_mb"] for device in fitted["devices"]))
