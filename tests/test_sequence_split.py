"""Sequence parallelism splits each rank's tokens over its t tensor-parallel ranks, which Megatron-core asserts
divide them (tensor_parallel/mappings.py `_reduce_scatter_along_first_dim`): a sequence they do not divide was
priced as if they did."""

import pytest

from tests.conftest import pipesim

GPT = ("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--vocab",
       1000, "--attention", "flash", "-p", 2, "-m", 2, "-s", "1f1b", "--tensor-parallel", 4)


@pytest.mark.parametrize("flags, share", [
    (("--seq-len", 130), "its 130 tokens"),
    (("--seq-len", 132, "--context-parallel", 2), "a rank's 66 of its 132 tokens"),
])
def test_a_sequence_the_tensor_parallel_ranks_do_not_divide_is_refused_with_sequence_parallelism(flags, share,
                                                                                                tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*GPT, *flags, "--sequence-parallel")
    assert (code, out) == (2, "")
    multiple = 4 * (2 if len(flags) > 2 else 1)
    assert err == (f"error: --sequence-parallel splits {share} over the 4 tensor-parallel ranks, which do not divide "
                   f"them (Megatron-core asserts they do): give --seq-len a multiple of {multiple}, or leave "
                   "--sequence-parallel out\n")
    assert not list(tmp_path.iterdir())
    code, _, err = pipesim(*GPT, *flags)  # without it, each rank holds the whole sequence
    assert code == 0, err
