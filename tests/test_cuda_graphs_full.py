"""--cuda-graphs full: every transformer layer captured whole, as Megatron-core's enable_cuda_graph swaps each
TransformerLayer for its graphed one (planning/estimate.py `CUDA_GRAPH_SCOPES`, `captured`): each pass of such a
layer is one replay the host issues, the embedding and the head issue their kernels as before; refused beside
recomputation (Megatron-core refuses it), beside a layer whose forward makes the host wait (a dropless dispatcher),
beside the expert overlap's pairs and under torchtitan's FSDP2; tune searches no recomputation under it."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from pipesim.planning.estimate import Parallelism, estimate_profile
from pipesim.workload.count import count_built
from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import H100

ROOT = Path(__file__).resolve().parents[1]
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
    ((), "error: --cuda-graphs full captures every transformer layer, a Mamba-2 one too: give it alone"),
    (("--data-parallel", 2, "--zero", 3, "--precision", "fsdp2"),
     "error: --cuda-graphs full: the layers Megatron-core graphs under TransformerEngine, and --precision fsdp2 is "
     "torchtitan's FSDP2, which graphs none"),
])
def test_full_graphs_beside_recomputation_a_waiting_layer_the_expert_overlap_or_fsdp2_are_one_line(tmp_path, flags,
                                                                                                   line):
    graphs = "full" if flags else "mamba,full"
    code, out, err = pipesim("simulate", *GPT, "--cuda-graphs", graphs, *flags, "--html", tmp_path / "t.html")
    assert (code, out) == (2, "") and err.startswith(line) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.html").exists()


def test_a_mixture_padded_to_its_capacity_is_captured_its_all_to_alls_inside_the_replay():
    """Its dispatcher knows each expert's tokens on the host (no wait): each pass of a MoE block is one replay, the
    all-to-alls' GPU time inside it."""
    from tests.helpers import ep_gpt_count

    counted = ep_gpt_count()
    moe = next(i for i, layer in enumerate(counted.layers) if any(op.routed for op in layer.ops["fwd"]))
    options = {**counted.options, "capacity_factor": 1.0}
    padded = type(counted)(**{**counted.__dict__, "options": options})
    eager, graphed = (estimate_profile(padded, H100, Parallelism(host_kernel_us=1000.0, expert=2, data=2,
                                                                 cuda_graphs=graphs)).layers[moe]
                      for graphs in ((), ("full",)))
    for name in ("fwd", "bwd"):
        assert graphed.host_issue[name].idle_ms == pytest.approx(1.0)
        assert graphed.host_issue[name].idle_ms < eager.host_issue[name].idle_ms


def test_a_profile_estimated_with_full_graphs_is_refused_the_expert_overlap(tmp_path):
    """As the same flags with --gpu are: simulate and sweep read the profile's estimate."""
    profile = tmp_path / "full.json"
    code, _, err = pipesim("estimate", *GPT[:6], "--experts", 4, "--expert-parallel", 2, "--data-parallel", 2,
                           "--capacity-factor", 1, "--cuda-graphs", "full", "--out", profile)
    assert code == 0, err
    for command in (("simulate", "-s", "1f1b"), ("sweep", "--grid", ROOT / "examples" / "grid.toml")):
        code, out, err = pipesim(*command, "--profile", profile, "--data-parallel", 2, "--overlap-expert-comm")
        assert (code, out) == (2, "") and err.startswith(
            "error: --cuda-graphs full (the profile's estimate) prices each layer's"), err


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


@needs_transformers
def test_full_graphs_beside_a_multi_token_prediction_module_are_one_line(tmp_path):
    """Megatron-core graphs the MTP module's inner transformer layer alone; pipesim counts the module as one layer
    with its norms, projection, head and loss, so it refuses the two together rather than replay all of it."""
    from tests.helpers import TINY_DEEPSEEK, write_config

    model = f"hf:{write_config(tmp_path / 'deepseek', TINY_DEEPSEEK)}"
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 32, "-p", 1, "-s", "1f1b",
                             "--attention", "flash", "--capacity-factor", 1, "--mtp-layers", 1, "--cuda-graphs", "full")
    assert (code, out) == (2, "") and err.startswith("error: --cuda-graphs full beside --mtp-layers"), err
