"""DeepSeek-V3's multi-token prediction (--mtp-layers D) puts D MoE blocks in one layer: each routes every token to
its own top-k experts and dispatches and combines apart (`LayerCount.routed_blocks`), so the layer runs D
dispatches of k copies a token, not one of D·k."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import torch

from pipesim.calibrate.measure import Settings, all_to_all_sizes, measure_bytes
from pipesim.planning.estimate import Parallelism, _all_to_alls_ms
from pipesim.planning.experts import ALL_TO_ALLS, MULTIHOT_OPS, expert_group
from pipesim.profiles.workload import RoutedBlock
from pipesim.workload.count import WorkloadCount, count_built
from pipesim.workload.hf import hf_model
from tests.conftest import needs_transformers, pipesim
from tests.helpers import H100_PLACEMENT as PLACEMENT
from tests.helpers import write_config

EXPERTS, TOP_K, S, H = 8, 2, 64, 64
MIXTRAL = {"model_type": "mixtral", "hidden_size": H, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "num_local_experts": EXPERTS,
           "num_experts_per_tok": TOP_K, "vocab_size": 100, "max_position_embeddings": 256,
           "tie_word_embeddings": False}


@cache
def counted(folder: str, mtp_layers: int) -> WorkloadCount:
    """The tiny Mixtral with `mtp_layers` prediction modules, counted once."""
    spec = f"hf:{write_config(Path(folder) / 'mixtral', MIXTRAL)}"
    return count_built(spec, {"seq_len": S, "mtp_layers": mtp_layers}, 1, torch.bfloat16, "flash")


@needs_transformers
def test_two_prediction_modules_dispatch_twice_k_copies_a_token(tmp_path_factory):
    """D = 2 at top 2 of 8 experts over E = 4 ranks of a node (DeepEP): each module's block sends its 64 tokens'
    copies once to each other rank holding any of its 2 experts, which it reaches with chance 1 - C(6, 2)/C(8, 2)
    = 13/28 (not the 1 - C(6, 4)/C(8, 4) of 4 copies), after the link's latency; the layer's forward runs that
    dispatch and its combine twice, and converts each block's 4·64·13/28 received tokens apart."""
    layer = counted(str(tmp_path_factory.mktemp("mtp")), 2).layers[-2]
    sent = EXPERTS * math.ceil(TOP_K * S / EXPERTS) * H * 2  # bytes a block's dispatch sends
    assert layer.routed_blocks == (RoutedBlock(S, TOP_K, sent),) * 2 and layer.dispatched_bytes == 2 * sent
    group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 4, dispatcher="deepep")
    reached = 1 - math.comb(6, 2) / math.comb(8, 2)
    one_ms = PLACEMENT.node_link.latency_ms + sent / TOP_K * 3 * reached / PLACEMENT.node_link.bytes_per_ms
    forward_ms, backward_ms = _all_to_alls_ms(layer, group, Parallelism(pipeline=2, data=4, expert=4,
                                                                       token_dispatcher="deepep"))
    assert math.isclose(forward_ms, ALL_TO_ALLS["fwd"] * 2 * one_ms)
    assert math.isclose(backward_ms, ALL_TO_ALLS["bwd"] * 2 * one_ms)
    received = round(4 * S * reached)
    converted = [op for op in group.local(layer).ops["fwd"] if op.routed and op.shape[1:] == (2,)]
    assert [op.op for op in converted] == list(MULTIHOT_OPS["fwd"])
    assert {(op.shape, op.count) for op in converted} == {((received, 2), 2)}


@needs_transformers
def test_a_calibration_records_each_prediction_modules_dispatch(tmp_path):
    """Calibrated at D = 2, the layer records its two blocks' dispatches apart, so that a measured all-to-all prices
    each (planning/scenario.py `measured_all_to_alls`), and the all-to-all is measured at a block's bytes."""
    model = hf_model(str(write_config(tmp_path / "mixtral", MIXTRAL)), S, 2)
    _, layers = measure_bytes(model, Settings(torch.device("cpu"), torch.float32, microbatch_size=1, warmup=0,
                                              repeats=1))
    sent = EXPERTS * math.ceil(TOP_K * S / EXPERTS) * H * 4  # float32 copies
    assert [layer.dispatched_block_bytes for layer in layers[1:4]] == [[sent], [], [sent, sent]]
    assert layers[3].dispatched_bytes == 2 * sent and max(all_to_all_sizes(layers, 2)) == sent


@needs_transformers
def test_more_prediction_modules_than_experts_over_the_top_k_estimate(tmp_path):
    """D = 5 at top 2 of 8 experts: 10 copies a token in the layer, more than the experts, each block's 2 of 8."""
    config = write_config(tmp_path / "mixtral", MIXTRAL)
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", f"hf:{config}", "--seq-len", S, "-s",
                             "1f1b", "-p", 2, "-m", 4, "--attention", "flash", "--data-parallel", 4,
                             "--expert-parallel", 4, "--token-dispatcher", "deepep", "--mtp-layers", 5)
    assert code == 0, err
    assert "step" in out
