"""--cuda-graphs full: every transformer layer captured whole, as Megatron-core's enable_cuda_graph swaps each
TransformerLayer for its graphed one (planning/estimate.py `CUDA_GRAPH_SCOPES`, `captured`): each pass of such a
layer is one replay the host issues, the embedding and the head issue their kernels as before; refused beside
recomputation (Megatron-core refuses it), beside a layer whose forward makes the host wait (a dropless dispatcher)
and beside the expert overlap's pairs; tune searches no recomputation under it."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from pipesim.planning.estimate import Parallelism, estimate_profile
from pipesim.workload.count import count_built
from tests.conftest import pipesim, simulate_json
from tests.helpers import H100

GPT = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "-p", 1, "-m", 4, "-s", "1f1b")


@cache
def gpt():
    return count_built("gpt", dict(layers=2, width=128, heads=4, seq_len=64, vocab=100), 1, torch.bfloat16, "flash")


def test_each_transformer_layers_pass_is_one_replay_and_the_embedding_and_head_issue_their_kernels():
    """At 1 ms a kernel the host binds: a graphed block's forward and backward each cost it one kernel's issue from
    an empty queue; the embedding's and the head's passes are issued as without graphs; the step is faster."""
    counted = gpt()
    eager, graphed = (estimate_profile(counted, H100, Parallelism(host_kernel_us=1000.0, cuda_graphs=graphs)).layers
                      for graphs in ((), ("full",)))
    blocks = [layer.transformer_layer for layer in counted.layers]
    assert blocks == [False, True, True, False]  # the embedding, two blocks, the final norm and head
    for before, after, block in zip(eager, graphed, blocks, strict=True):
        for name in ("fwd", "bwd"):
            if block:
                assert after.host_issue[name].idle_ms == pytest.approx(1.0)
                assert after.host_issue[name].idle_ms < before.host_issue[name].idle_ms
            else:
                assert after.host_issue[name] == before.host_issue[name]
    steps = [simulate_json(*GPT, "--host-kernel-us", 1000, *graphs)[0]["time_per_minibatch_ms"]
             for graphs in ((), ("--cuda-graphs", "full"))]
    assert steps[1] < steps[0]


@pytest.mark.parametrize("flags, line", [
    (("--recompute", "selective"), "error: --cuda-graphs full captures each transformer layer whole, which "
                                   "Megatron-core refuses beside recomputation"),
    (("--recompute-modules", "layernorm"), "error: --cuda-graphs full captures each transformer layer whole"),
    (("--experts", 4, "--expert-parallel", 2, "--data-parallel", 2),
     "error: --cuda-graphs full: layer 1:_Block makes the host wait for the GPU in its forward"),
    (("--experts", 4, "--expert-parallel", 2, "--data-parallel", 2, "--capacity-factor", 1, "--overlap-expert-comm"),
     "error: --cuda-graphs full prices each layer's forward and backward as one replay"),
])
def test_full_graphs_beside_recomputation_a_waiting_layer_or_the_expert_overlap_are_one_line(tmp_path, flags, line):
    code, out, err = pipesim("simulate", *GPT, "--cuda-graphs", "full", *flags, "--html", tmp_path / "t.html")
    assert (code, out) == (2, "") and err.startswith(line) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.html").exists()


def test_a_mixture_padded_to_its_capacity_is_captured():
    (result,) = simulate_json(*GPT, "--experts", 4, "--expert-parallel", 2, "--data-parallel", 2,
                              "--capacity-factor", 1, "--cuda-graphs", "full")
    assert result["time_per_minibatch_ms"] > 0


def test_tune_searches_no_recomputation_under_full_graphs(monkeypatch):
    from pipesim.commands import tune

    estimated = set()
    estimate = tune.estimated_profile
    monkeypatch.setattr(tune, "estimated_profile", lambda what, counted, parallel, *args: estimated.add(
        (parallel.recompute, parallel.cuda_graphs)) or estimate(what, counted, parallel, *args))
    monkeypatch.setattr(tune, "usable_cpus", lambda: 1)  # estimated here, where the set is, not in the workers
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--devices", 2,
                             "-s", "1f1b", "--cuda-graphs", "full")
    assert code == 0, err
    assert estimated == {("none", ("full",))}
