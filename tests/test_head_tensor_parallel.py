"""The vocabulary head under tensor parallelism, as Megatron-LM's column-parallel output layer runs it: its input
gradient is a partial sum over the vocabulary's shards, tokens x width whole on each rank until its all-reduce (or
reduce-scatter under sequence parallelism), so it is held and reduced whole, over the rank's 1/C of the tokens
(planning/estimate.py `_read_stream`, `_transient_bytes`)."""

import pytest

from pipesim.planning.estimate import Parallelism, estimate_layer, placement_links
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE

B, S, W, V, E = 2, 64, 256, 192, 2  # micro-batch, sequence, width, vocabulary; bytes per bf16 element
TOKENS, T = B * S, 4  # no dimension equals another: the vocabulary's share per rank, 48, is below the width


@pytest.fixture(scope="module")
def head():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=1, width=W, heads=4, seq_len=S, vocab=V), B, torch.bfloat16,
                       "flash").layers[-1]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_heads_backward_holds_its_input_gradient_whole(head, sequence_parallel):
    """The backward's peak on one of t = 4 ranks, by hand: the cross entropy's float32 gradients of the rank's
    logits (TOKENS x V/t, 24,576 bytes each, two live at once: 49,152) are freed before the head's products run;
    then the logits' gradient cast to bf16 (TOKENS x V/t: 12,288) is live beside the input gradient, which the
    product writes whole before its reduction (TOKENS x W: 65,536): 77,824. Taken 1/t as the vocabulary's share,
    the input gradient (16,384) left the logits' pair the peak. Under sequence parallelism the reduce-scatter's
    output, 1/t of the input gradient (16,384), is allocated beside it first (Megatron-core's `sub_grad_input`):
    94,208."""
    parallel = Parallelism(tensor=T, sequence_parallel=sequence_parallel)
    estimated = estimate_layer(head, DEVICE, parallel, placement_links(H100, parallel).tensor, E)
    scattered = TOKENS * W * E // T if sequence_parallel else 0
    for name in ("bwd", "igrad"):
        assert estimated.transient_bytes[name] == TOKENS * V * E // T + TOKENS * W * E + scattered


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("context", [1, 2])
def test_the_heads_input_gradient_is_reduced_whole_over_the_ranks_tokens(head, tensor_reductions, sequence_parallel,
                                                                         context):
    """The full backward's and the input-gradient pass's one reduction each, over the t ranks: the input gradient
    whole, tokens x width, of the rank's 1/C of the tokens; the forward (its output split by the vocabulary)
    reduces nothing."""
    parallel = Parallelism(tensor=T, sequence_parallel=sequence_parallel, context=context)
    links = placement_links(H100, parallel)
    estimate_layer(head, DEVICE, parallel, links.tensor, E, context_link=links.context)
    assert tensor_reductions == [(TOKENS * W * E // context, T)] * 2
