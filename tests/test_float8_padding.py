"""TransformerEngine's float8 padding of a rank's routed tokens (planning/experts.py `ExpertGroup.float8_padded`):
under its float8 recipes Megatron-core's TEGroupedMLP pads each local expert's split to 16 rows before the grouped
products and unpads their output (Fp8Padding, Fp8Unpadding), and the backward runs both the other way; a split
already aligned is left as it is (a capacity of whole 16-row blocks), and HybridEP pads in its dispatch, not here,
where DeepEP's experts pad as the all-to-all's do."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.planning.estimate import Parallelism, estimate_profile
from pipesim.planning.experts import FLOAT8_PADDING_ROWS, ExpertGroup, expert_group
from tests.helpers import EP_H as H
from tests.helpers import EP_S as S
from tests.helpers import EXPERTS, H100, TOP_K
from tests.helpers import H100_BF16 as DEVICE
from tests.helpers import H100_PLACEMENT as PLACEMENT
from tests.helpers import ep_gpt_count as counted


def _added(group: ExpertGroup, dropless: bool = True, rows: int | None = None) -> dict[str, list]:
    """Per pass, the ops `float8_padded` adds to the rank's layer (its first routed product `rows` tokens an
    expert where given)."""
    local = group.local(counted().layers[1])
    if rows is not None:
        ops = local.ops["fwd"]
        first = next(i for i, op in enumerate(ops) if op.routed and op.kind == "matmul")
        local = replace(local, ops={**local.ops, "fwd": (*ops[:first], replace(ops[first], shape=(
            ops[first].shape[0], rows, *ops[first].shape[2:])), *ops[first + 1:])})
    padded = group.float8_padded(local, dropless)
    return {name: list(ops[len(local.ops[name]):]) for name, ops in padded.ops.items()}


def test_a_dropless_rank_copies_what_it_received_into_the_padded_buffer_and_back_each_way():
    """8 experts at top 2 over E = 4 ranks: a 512-token micro-batch's 1,024 copies of 256 bf16 are copied into
    the padded buffer before the products and out of it after them (a read and a write of every copy each), the
    router's weights padded beside them (one kernel, their bytes left out); the backward's input pass unpads and
    pads the gradients alike, the weight pass nothing. The busiest rank (the hot expert's, 1.6 times the copies)
    copies 1.6 times as many."""
    dispatched = S * TOP_K * H * 2
    for share, load in ((None, 1.0), (0.3, 1.6)):
        added = _added(expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=share))
        tokens, weights = added["fwd"]
        assert (tokens.op, tokens.kind, tokens.count, tokens.routed) == ("fp8_padding", "memory", 2, True)
        assert tokens.moved_bytes == round(2 * dispatched * load)
        assert tokens.shape == (round(S * TOP_K * load), H)
        assert (weights.op, weights.count, weights.moved_bytes, weights.shape) == (
            "fp8_padding_router_weights", 1, 0, (tokens.shape[0], 1))
        backward = [replace(op, op=f"{op.op}_backward") for op in added["fwd"]]
        assert added["bwd"] == added["igrad"] == backward and added["wgrad"] == []


def test_aligned_capacity_rows_and_hybrideps_path_pad_nothing():
    """A capacity-padded layer pads only where a local expert's capacity rows are not whole 16-row blocks
    (Fp8Padding returns an aligned input untouched); HybridEP's splits arrive aligned from its dispatch
    (`pad_multiple`), DeepEP's do not (its dispatch pads nothing), so DeepEP's experts copy what the all-to-all's
    do."""
    group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8)
    rows = group.local(counted().layers[1]).ops["fwd"]
    assert next(op.shape[1] for op in rows if op.routed and op.kind == "matmul") % FLOAT8_PADDING_ROWS == 0
    assert all(not ops for ops in _added(group, dropless=False).values())
    assert _added(group, dropless=False, rows=564)["fwd"][0].op == "fp8_padding"  # 141 capacity rows x 4 sources
    hybridep = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, dispatcher="hybridep")
    assert all(not ops for ops in _added(hybridep).values())
    deepep = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, dispatcher="deepep")
    assert _added(deepep) == _added(group)


def test_transformer_engines_float8_recipes_price_the_padding_on_every_moe_layer(monkeypatch):
    """Each MoE layer's forward, backward and input pass take the two copies' bytes and three kernels longer under
    te-current than with the padding left out; torchao's recipe (no TransformerEngine) pads nothing."""
    def profile(fp8: str):
        return estimate_profile(counted(), H100, Parallelism(pipeline=2, data=8, expert=4, fp8=fp8,
                                                             host_kernel_us=0, host_module_us=0))

    padded, torchao = profile("te-current"), profile("torchao")
    monkeypatch.setattr(ExpertGroup, "float8_padded", lambda self, layer, dropless: layer)
    unpadded, torchao_unpadded = profile("te-current"), profile("torchao")
    dispatched = S * TOP_K * H * 2
    pad_ms = 3 * H100.curve.kernel_overhead_ms + 2 * 2 * dispatched / DEVICE.memory_bytes_per_ms
    for one, other, layer in zip(padded.layers, unpadded.layers, counted().layers, strict=True):
        extra = pad_ms if layer.dispatched_bytes else 0.0
        for name in ("fwd", "bwd", "igrad"):
            assert getattr(one, name).median_ms - getattr(other, name).median_ms == pytest.approx(extra)
        assert one.wgrad == other.wgrad
    assert [layer.fwd for layer in torchao.layers] == [layer.fwd for layer in torchao_unpadded.layers]
