"""torch's tensor parallelism without async TP copies each sequence-parallel collective's whole tensor once more
(planning/estimate.py `Parallelism.collective_copies`, `_with_collective_copies`, `_reduce_scattered`): DTensor's
Shard(1) gathers and scatters go through torch/distributed/_functional_collectives.py, which concatenates the
all-gather's chunks on the sequence (`all_gather_tensor`) and the partial sums' chunks on the first dimension before
the reduce-scatter (`reduce_scatter_tensor`). Async TP's fused ops gather into one whole tensor and write the partial
sums once, so `--tp-overlap` under `--tp-runtime torch` makes none."""

import pytest

from pipesim.planning.estimate import Parallelism, _reduce_scattered, _with_collective_copies
from pipesim.units import MIB

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
    assert _with_collective_copies(events, 8, {0}, {1}) == (
        (3, SHARD), (0, SHARD), (3, -SHARD), (1, WHOLE), (4, WHOLE), (5, SHARD), (4, -WHOLE), (5, -SHARD),
        (2, SHARD), (1, -WHOLE))


def test_a_sums_concatenation_waits_for_autograd_to_free_the_gradients_it_summed():
    """Two Partial gradients (0, 1) summed (2) and freed as autograd's InputBuffer drops them: the sum's
    concatenation (4) and the reduce-scatter's output (5) come after those frees, before the next allocation (3),
    so the moment holds the sum, its copy and the output, not the summed gradients."""
    events = ((0, WHOLE), (1, WHOLE), (2, WHOLE), (0, -WHOLE), (1, -WHOLE), (3, SHARD), (2, -WHOLE))
    copied = _with_collective_copies(events, 8, (), {2}, {2})
    assert copied == ((0, WHOLE), (1, WHOLE), (2, WHOLE), (0, -WHOLE), (1, -WHOLE), (4, WHOLE), (5, SHARD),
                      (4, -WHOLE), (5, -SHARD), (3, SHARD), (2, -WHOLE))
    assert _with_collective_copies(events[:5], 8, (), {2}, {2})[-4:] == ((3, WHOLE), (4, SHARD), (3, -WHOLE),
                                                                         (4, -SHARD))


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
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import layer_allocations
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 128, "vocab": 1000}, 2,
                          torch.bfloat16, "flash")
    parallel = Parallelism(tensor=2, sequence_parallel=True, tp_runtime="torch", tp_overlap=tp_overlap,
                           recompute="full", torch_compile=torch_compile)
    return counted.layers[1], layer_allocations(counted, parallel)[1]


def test_a_plain_tp_block_copies_each_collectives_whole_tensor_and_its_rerun_does_too():
    """A GPT block at t = 2: its forward gathers its two norms' outputs (whole, 32 KiB each) and reduce-scatters its
    two row-parallel outputs; its backward gathers its two row-parallel output gradients and reduce-scatters its two
    column-parallel input gradients: eight copies of 32 KiB, each made and freed beside its tensor, and beside each
    reduce-scatter's its output, 16 KiB; the full recomputation reruns the forward's. Under async TP (`tp_overlap`)
    none, the passes otherwise the same."""
    block, plain = _block_allocations(False)
    _, fused = _block_allocations(True)
    whole = 2 * 128 * 64 * 2
    for name in ("fwd", "bwd"):
        counted = {number for number, nbytes in fused.passes[name]}
        copies = [(number, nbytes) for number, nbytes in plain.passes[name] if number not in counted]
        made = {number: nbytes for number, nbytes in copies if nbytes > 0}
        assert sorted(made.values()) == [whole // 2] * 2 + [whole] * 4
        assert sorted(copies) == sorted([*made.items(), *((n, -nbytes) for n, nbytes in made.items())])
        assert [event for event in plain.passes[name] if event[0] in counted] == list(fused.passes[name])
        if name == "fwd":
            assert set(made) <= plain.rerun and not set(made) & plain.saved
    assert plain.rerun - fused.rerun == {number for number, nbytes in plain.passes["fwd"] if nbytes > 0} - {
        number for number, _ in fused.passes["fwd"]}


def test_a_compiled_blocks_first_forward_makes_the_copies_as_its_rerun_does():
    """Compiled inside its checkpoint (the torchtitan rows' blocks), the first forward frees the saved storages
    early (`_compiled_checkpoint_forward`) but makes the collectives' copies as the rerun does, each freed as made."""
    _, plain = _block_allocations(False, torch_compile=True)
    _, fused = _block_allocations(True, torch_compile=True)
    counted = {number for number, _ in fused.passes["fwd"]}
    copies = [event for event in plain.first_forward if event[0] not in counted]
    assert len(copies) == 12 and [event for event in plain.first_forward if event[0] in counted] == list(
        fused.first_forward)


@pytest.mark.parametrize(("tp_overlap", "torch_compile", "copies", "scatters"), [
    (False, False, (4, 4), (2, 2)), (False, True, (4, 2), (2, 0)), (True, False, (0, 2), (0, 2)),
    (True, True, (0, 0), (0, 0))])
def test_a_llamas_summed_input_gradients_are_copied_eager_only(tmp_path, tp_overlap, torch_compile, copies, scatters):
    """A Llama's separate q, k and v (gate and up) sum their Partial input gradients before the one reduce-scatter:
    its forward copies its two gathered inputs and its two row-parallel outputs, its backward its two gathered output
    gradients and its two sums, eager, each reduce-scatter's output (half) beside its copy; compiled, not the sums;
    under async TP the sums alone, eager."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import layer_allocations
    from pipesim.workload.count import count_built
    from tests.test_tensor_parallel_scale import LLAMA

    (tmp_path / "config.json").write_text(LLAMA)
    counted = count_built(f"hf:{tmp_path}", {"seq_len": 32}, 2, torch.bfloat16, "flash")

    def block(tp_overlap: bool, torch_compile: bool):
        return layer_allocations(counted, Parallelism(tensor=2, sequence_parallel=True, tp_runtime="torch",
                                                      tp_overlap=tp_overlap, recompute="full",
                                                      torch_compile=torch_compile))[1]

    made, none = block(tp_overlap, torch_compile), block(True, True)
    whole = 2 * 32 * 64 * 2
    for name, count, scattered in zip(("fwd", "bwd"), copies, scatters, strict=True):
        counted_numbers = {number for number, _ in none.passes[name]}
        added = [nbytes for number, nbytes in made.passes[name] if number not in counted_numbers]
        assert sorted(added) == [-whole] * count + [-whole // 2] * scattered + [whole // 2] * scattered + [
            whole] * count
