"""`--tp-overlap-fp8-buf`: the forward's pipelined reduce-scatters with a userbuffers config's `fp8_buf`
(proj_fprop, fc2_fprop): each row-parallel product writes float8 into the userbuffer and the reduce-scatter moves 1
byte an element (TransformerEngine 1.10's `is_fp8_ubuf`, `reducescatter2_userbuff_stridedoutput_fp8`), as
NVIDIA's Llama 3.1 405B FP8 run sets it."""

from dataclasses import replace

import pytest

from pipesim.planning.estimate import EstimateError, Parallelism
from tests.conftest import refused
from tests.helpers import H100

SMALL = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "512", "--heads", "4", "--seq-len", "128",
         "--vocab", "128", "--attention", "flash", "-p", "1", "-m", "2", "-s", "1f1b", "--tensor-parallel", "2",
         "--sequence-parallel")


def test_only_a_blocks_forward_gets_faster_by_its_reduce_scatters_bytes():
    """A 4,096-wide block at t = 8 (its reduce-scatters on NVLink beside 4 splits): the forward is faster with
    float8 outputs scattered, the backward passes and the embedding and head are not."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import estimate_profile
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=1, width=4096, heads=32, seq_len=4096, vocab=1024), 1, torch.bfloat16,
                          "flash")
    parallel = Parallelism(tensor=8, sequence_parallel=True, tp_overlap=True, fp8="te")
    plain, float8 = (estimate_profile(counted, H100, replace(parallel, tp_overlap_fp8_buf=on)) for on in (False, True))
    for layer, before, after in zip(counted.layers, plain.layers, float8.layers):
        block = any(op.kind == "attention" for op in layer.ops["fwd"])
        assert (after.fwd.median_ms < before.fwd.median_ms) == block, layer.name
        assert (after.bwd, after.igrad, after.wgrad) == (before.bwd, before.igrad, before.wgrad)


@pytest.mark.parametrize("args, fragment", [
    (("--tp-overlap", "--tp-overlap-fp8-buf"), "--tp-overlap-fp8-buf says how --dtype fp8 runs the linear products"),
    (("--dtype", "fp8", "--tp-overlap-fp8-buf"),
     "--tp-overlap-fp8-buf sets the buffer of TransformerEngine's pipelined reduce-scatters: give --tp-overlap"),
    (("--dtype", "fp8", "--fp8-recipe", "torchao", "--tp-overlap", "--tp-overlap-fp8-buf"),
     "--tp-overlap-fp8-buf: TransformerEngine's float8 userbuffers; give --fp8-recipe te or te-current"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, args, fragment):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    assert fragment in refused("simulate", *SMALL, *args, "--html", "s.html")


@pytest.mark.parametrize("given", [dict(fp8="te"), dict(fp8="torchao", tp_overlap=True),
                                   dict(fp8="te", tp_overlap=True, tp_runtime="torch")])
def test_parallelism_refuses_it_without_transformer_engine_userbuffers(given):
    with pytest.raises(EstimateError, match="tp_overlap_fp8_buf(: TransformerEngine's float8 userbuffers| sets the "
                                            "buffer of TransformerEngine's)"):
        Parallelism(tensor=2, sequence_parallel=True, tp_overlap_fp8_buf=True, **given)
