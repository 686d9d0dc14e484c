"""Expert-tensor-parallel 1 beside t > 1 (the Megatron MoE Model Zoo's Qwen3-235B-A22B rows: t 2 and 4, ETP 1):
Megatron-core's dispatchers take the expert-tensor group as their `tp_group` (token_dispatcher.py at Megatron-LM
1e057005, `MoETokenDispatcher.__init__`), so at ETP 1 no gather over the t ranks runs and each rank dispatches its
own sequence-parallel tokens to whole experts; the expert ranks are numbered ETP-E-dp-pp (parallel_state.py), so E
of them sit together on a node. docs/hardware.md, "The E8 rows' layout, read at the pins"."""

from __future__ import annotations

import torch

from pipesim.planning.experts import expert_group
from pipesim.workload.count import count_built
from tests.helpers import H100_PLACEMENT as PLACEMENT


def test_at_expert_tensor_parallel_1_the_group_is_e_consecutive_ranks_on_one_node():
    """The zoo's t4 p8 E8 d8 row on 256 GPUs: its 8 expert-parallel ranks are one node's 8, two tensor groups."""
    group = expert_group(PLACEMENT, 8, 128, 4, 1, 8, 8, order="megatron", expert_tensor=1)
    assert (group.per_node, group.tensor, group.dense_tensor) == (8, 1, 4)
    spread = expert_group(PLACEMENT, 8, 128, 4, 1, 8, 8, order="megatron", expert_tensor=4)
    assert spread.per_node == 2  # ETP = t puts the E ranks t apart: 2 of them a node


def test_at_expert_tensor_parallel_1_a_local_expert_runs_whole_on_what_the_e_ranks_send_it():
    """8 experts of f = 128 (gated: fc1 256 wide) at top 2 over a 2,048-token micro-batch, t = 2 under sequence
    parallelism (1,024 tokens a rank, 2,048 copies, 256 an expert), E = 2, ETP = 1: 4 local experts, each on the
    2 ranks' 256 = 512 rows, at its whole width, where ETP = 2 would gather the t ranks' copies first (1,024 rows)
    and split each expert's width in two."""
    moe = count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=2048, vocab=1000, gated=True, experts=8,
                                  top_k=2, expert_ffn=128), 1, torch.bfloat16, "flash")
    folded = expert_group(PLACEMENT, 2, 8, 2, 1, 1, 4, order="megatron", expert_tensor=1)
    grouped = [op.shape for op in folded.local(moe.layers[1]).ops["fwd"] if op.routed and op.kind == "matmul"]
    assert grouped == [(4, 512, 256, 256), (4, 512, 256, 128)]
    split = expert_group(PLACEMENT, 2, 8, 2, 1, 1, 4, order="megatron", expert_tensor=2)
    assert [op.shape for op in split.local(moe.layers[1]).ops["fwd"] if op.routed and op.kind == "matmul"] \
        == [(4, 1024, 128, 256), (4, 1024, 256, 64)]
