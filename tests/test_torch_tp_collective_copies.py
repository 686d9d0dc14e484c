"""torch's tensor parallelism without async TP copies each sequence-parallel collective's whole tensor once more
(planning/estimate.py `Parallelism.collective_copies`, `_with_collective_copies`, `_reduce_scattered`): DTensor's
Shard(1) gathers and scatters go through torch/distributed/_functional_collectives.py, which concatenates the
all-gather's chunks on the sequence (`all_gather_tensor`) and the partial sums' chunks on the first dimension before
the reduce-scatter (`reduce_scatter_tensor`). Async TP's fused ops gather into one whole tensor and write the partial
sums once, so `--tp-overlap` under `--tp-runtime torch` makes none."""

import pytest

from pipesim.planning.estimate import Parallelism, _reduce_scattered, _with_collective_copies
from pipesim.units import MIB
from tests.conftest import needs_transformers
from tests.helpers import small_gpt_count

WHOLE, SHARD = 64 * MIB, 8 * MIB


def test_a_gathered_tensor_has_the_all_gathers_output_beside_it_only_while_it_is_made():
    """The all-gather's output (5, the pass's next number) is made before the concatenation (1) and freed once it
    is: both whole at once, then the gathered tensor alone."""
    events = ((0, SHARD), (1, WHOLE), (0, -SHARD), (2, SHARD), (1, -WHOLE))
    assert _with_collective_copies(events, 8, {1}) == (
        (0, SHARD), (3, WHOLE), (1, WHOLE), (3, -WHOLE), (0, -SHARD), (2, SHARD), (1, -WHOLE))


def test_partial_sums_have_their_concatenation_and_the_reduce_scatters_output_beside_them():
    """A row-parallel product's output (1) whole, then the concatenation its reduce-scatter reads (4) and the
    reduce-scatter's output, 1/t (5), made while the concatenation lives, then both freed; each numbered after the
    pass's storages, in order."""
    events = ((0, SHARD), (1, WHOLE), (2, SHARD), (1, -WHOLE))
    assert _with_collective_copies(events, 8, {0}, {1}, {1}) == (
        (3, SHARD), (0, SHARD), (3, -SHARD), (1, WHOLE), (4, WHOLE), (5, SHARD), (4, -WHOLE), (5, -SHARD),
        (2, SHARD), (1, -WHOLE))


def test_a_sums_concatenation_waits_for_autograd_to_free_the_gradients_it_summed():
    """Two Partial gradients (0, 1) summed (2) and freed as autograd's InputBuffer drops them: the sum's
    concatenation (4) and the reduce-scatter's output (5) come after those frees, before the next allocation (3),
    so the moment holds the sum, its copy and the output, not the summed gradients."""
    events = ((0, WHOLE), (1, WHOLE), (2, WHOLE), (0, -WHOLE), (1, -WHOLE), (3, SHARD), (2, -WHOLE))
    copied = _with_collective_copies(events, 8, (), {2}, {2}, {2})
    assert copied == ((0, WHOLE), (1, WHOLE), (2, WHOLE), (0, -WHOLE), (1, -WHOLE), (4, WHOLE), (5, SHARD),
                      (4, -WHOLE), (5, -SHARD), (3, SHARD), (2, -WHOLE))
    assert _with_collective_copies(events[:5], 8, (), {2}, {2}, {2})[-4:] == ((3, WHOLE), (4, SHARD), (3, -WHOLE),
                                                                         (4, -SHARD))


def test_a_reduce_scatter_without_a_concatenation_makes_its_output_beside_its_partial_sums():
    """Megatron-core's `_reduce_scatter_along_first_dim` and async TP's `_fused_matmul_reduce_scatter_impl` read
    the partial sums (1) where they are: the output, 1/t (3), made while they live and freed at once."""
    events = ((0, SHARD), (1, WHOLE), (2, SHARD), (1, -WHOLE))
    assert _with_collective_copies(events, 8, (), {1}) == (
        (0, SHARD), (1, WHOLE), (3, SHARD), (3, -SHARD), (2, SHARD), (1, -WHOLE))


def test_megatrons_input_gradient_keeps_its_reduce_scatters_output_through_the_weight_gradient():
    """`LinearWithGradAccumulationAndAsyncCommunication.backward` (core_v0.9.0): `grad_input` (0) whole, then
    `sub_grad_input` (3), 1/t, made before the reduce-scatter and live through the weight-gradient product (1),
    freed after it; the next allocation (2) comes without it."""
    events = ((0, WHOLE), (1, SHARD), (2, SHARD), (0, -WHOLE))
    assert _with_collective_copies(events, 8, (), {0}, held={0: 1}) == (
        (0, WHOLE), (3, SHARD), (1, SHARD), (3, -SHARD), (2, SHARD), (0, -WHOLE))


def test_only_the_last_sum_of_partial_gradients_is_reduce_scattered():
    """q's and k's input gradients (0, 1: Partial) summed (2), v's (3) added (4): DTensor reduce-scatters 4 alone;
    an input gradient no other product shares (5) and a row-parallel output (6) are reduce-scattered too."""
    events = ((0, WHOLE), (1, WHOLE), (2, WHOLE), (0, -WHOLE), (1, -WHOLE), (3, WHOLE), (4, WHOLE), (2, -WHOLE),
              (3, -WHOLE), (5, WHOLE), (6, WHOLE))
    assert _reduce_scattered(events, {0, 1, 2, 3, 4, 5, 6}, {0, 1, 3}, {2, 4}) == {4, 5, 6}


@pytest.mark.parametrize(("tp_overlap", "torch_compile", "copied"), [
    (False, False, {"gather", "product", "sum"}), (False, True, {"gather", "product"}), (True, False, {"sum"}),
    (True, True, set())])
def test_which_collectives_copy_under_torchs_tp(tp_overlap, torch_compile, copied):
    parallel = Parallelism(tensor=8, sequence_parallel=True, tp_runtime="torch", tp_overlap=tp_overlap,
                           recompute="full", torch_compile=torch_compile)
    assert parallel.collective_copies == copied


@pytest.mark.parametrize("parallel", [Parallelism(tensor=8, sequence_parallel=True), Parallelism(
    tensor=8, tp_runtime="torch"), Parallelism(sequence_parallel=True, tp_runtime="torch")])
def test_megatrons_collectives_and_torchs_without_sequence_parallelism_copy_none(parallel):
    assert parallel.collective_copies == frozenset()


def _block_allocations(tp_overlap: bool, torch_compile: bool = False):
    from pipesim.planning.estimate import layer_allocations

    counted = small_gpt_count("flash")
    parallel = Parallelism(tensor=2, sequence_parallel=True, tp_runtime="torch", tp_overlap=tp_overlap,
                           recompute="full", torch_compile=torch_compile)
    return counted.layers[1], layer_allocations(counted, parallel)[1]


def _added(layer, allocations, name: str, events, whole: int) -> list[tuple[int, int]]:
    """`events` of pass `name` that are not the rank's own storages: the count's (`layer`'s) and the gathered
    gradients, whole, that `allocations` (async TP's, compiled: no copies) makes of its own."""
    own = {number for number, *_ in layer.allocations.get(name, ())}
    own |= {number for number, nbytes in allocations.passes[name] if number not in own and nbytes == whole}
    return [(number, nbytes) for number, nbytes in events if number not in own]


def test_a_plain_tp_block_copies_each_collectives_whole_tensor_and_its_rerun_does_too():
    """A GPT block at t = 2: its forward gathers its two norms' outputs (whole, 32 KiB each) and reduce-scatters its
    two row-parallel outputs; its backward gathers its two row-parallel output gradients and reduce-scatters its two
    column-parallel input gradients: eight copies of 32 KiB, each made and freed beside its tensor, and beside each
    reduce-scatter's its output, 16 KiB; the full recomputation reruns the forward's. Under async TP (`tp_overlap`)
    the reduce-scatters' outputs alone, the passes otherwise the same."""
    block, plain = _block_allocations(False)
    _, fused = _block_allocations(True)
    whole = 2 * 128 * 64 * 2
    for name in ("fwd", "bwd"):
        copies = _added(block, fused, name, plain.passes[name], whole)
        made = {number: nbytes for number, nbytes in copies if nbytes > 0}
        assert sorted(made.values()) == [whole // 2] * 2 + [whole] * 4
        assert sorted(copies) == sorted([*made.items(), *((n, -nbytes) for n, nbytes in made.items())])
        outputs = _added(block, fused, name, fused.passes[name], whole)
        assert sorted(nbytes for _, nbytes in outputs) == [-whole // 2] * 2 + [whole // 2] * 2
        assert [event for event in plain.passes[name] if event not in copies] == [
            event for event in fused.passes[name] if event not in outputs]
        if name == "fwd":
            assert set(made) <= plain.rerun and not set(made) & plain.saved
    assert plain.rerun - fused.rerun == {number for number, nbytes in plain.passes["fwd"] if nbytes > 0} - {
        number for number, _ in fused.passes["fwd"]}


def test_a_compiled_blocks_first_forward_makes_the_copies_as_its_rerun_does():
    """Compiled inside its checkpoint (the torchtitan rows' blocks), the first forward frees the saved storages
    early (`_compiled_checkpoint_forward`) but makes the collectives' copies and outputs as the rerun does, each
    freed as made."""
    block, plain = _block_allocations(False, torch_compile=True)
    _, fused = _block_allocations(True, torch_compile=True)
    whole = 2 * 128 * 64 * 2
    copies = _added(block, fused, "fwd", plain.first_forward, whole)
    outputs = _added(block, fused, "fwd", fused.first_forward, whole)
    assert len(copies) == 12 and len(outputs) == 4
    assert [event for event in plain.first_forward if event not in copies] == [
        event for event in fused.first_forward if event not in outputs]


@needs_transformers
@pytest.mark.parametrize(("tp_overlap", "torch_compile", "copies"), [
    (False, False, (4, 4)), (False, True, (4, 2)), (True, False, (0, 2)), (True, True, (0, 0))])
def test_a_llamas_summed_input_gradients_are_copied_eager_only(tmp_path, tp_overlap, torch_compile, copies):
    """A Llama's separate q, k and v (gate and up) sum their Partial input gradients before the one reduce-scatter:
    its forward copies its two gathered inputs and its two row-parallel outputs, its backward its two gathered output
    gradients and its two sums, eager; compiled, not the sums; under async TP the sums alone, eager. Each pass's two
    reduce-scatters make their output (half) in every case."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import layer_allocations
    from pipesim.workload.count import count_built
    from tests.helpers import TP_LLAMA_JSON as LLAMA

    (tmp_path / "config.json").write_text(LLAMA)
    counted = count_built(f"hf:{tmp_path}", {"seq_len": 32}, 2, torch.bfloat16, "flash")

    def block(tp_overlap: bool, torch_compile: bool):
        return layer_allocations(counted, Parallelism(tensor=2, sequence_parallel=True, tp_runtime="torch",
                                                      tp_overlap=tp_overlap, recompute="full",
                                                      torch_compile=torch_compile))[1]

    made, none = block(tp_overlap, torch_compile), block(True, True)
    whole = 2 * 32 * 64 * 2
    for name, count in zip(("fwd", "bwd"), copies, strict=True):
        added = [nbytes for _, nbytes in _added(counted.layers[1], none, name, made.passes[name], whole)]
        assert sorted(added) == [-whole] * count + [-whole // 2] * 2 + [whole // 2] * 2 + [whole] * count
