"""What a split backward keeps from its input-gradient part (I) until its weight-gradient part (W), from the count:
the zero-bubble fork's `WeightGradStore` holds each product's input and output gradient (Megatron-LM's runtime),
torch's pipelining the whole graph; the simulator holds them from I until W where a stage knows them."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pipesim.planning.estimate import Parallelism, estimate_layer, placement_links  # noqa: E402
from pipesim.profiles.workload import LayerCount  # noqa: E402
from pipesim.sim import Cluster, Costs, simulate  # noqa: E402
from pipesim.sim.costs import held_as_runtime  # noqa: E402
from pipesim.traces import summarize  # noqa: E402
from pipesim.units import MIB  # noqa: E402
from pipesim.workload.count import count_built, count_model  # noqa: E402
from pipesim.workload.models import Model  # noqa: E402
from tests.conftest import build  # noqa: E402
from tests.helpers import A100  # noqa: E402
from tests.helpers import A100_FP16 as DEVICE  # noqa: E402

B, S, H, A = 2, 32, 64, 4  # micro-batch, sequence, hidden, heads of the small gpt
SBH = B * S * H


@cache
def gpt_block(attention: str) -> LayerCount:
    return count_built("gpt", dict(layers=2, width=H, heads=A, seq_len=S, vocab=128), B, torch.float16,
                       attention).layers[1]


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_a_gpt_block_keeps_for_its_deferred_weight_pass_the_forks_32_sbh(attention):
    """The fork's W reads the four products' inputs (2, 2, 2 and 8·sbh bytes in fp16) and output gradients (6, 2, 8
    and 2·sbh): 32·sbh, whatever else the block saves (34·sbh + 5·as²b under math)."""
    block = gpt_block(attention)
    gradients = sum(nbytes for _, nbytes, _ in block.weight_grad_outputs)
    inputs = sum(nbytes for (_, nbytes), how in zip(block.saved_tensors, block.linear_input_saves) if how)
    assert (inputs, gradients) == (14 * SBH, 18 * SBH)
    assert block.saved_bytes > inputs + gradients


def _on_rank(t: int, **parallel):
    links = placement_links(A100, Parallelism(tensor=t)).tensor
    return estimate_layer(gpt_block("math"), DEVICE, Parallelism(tensor=t, **parallel), links, 2)


def test_an_estimate_keeps_each_products_input_as_saved_and_its_output_gradient_as_the_product_runs_on_a_rank():
    """t = 1: the inputs 14·sbh and the gradients 18·sbh. t = 2 with sequence parallelism: the inputs split as the
    activations are (1/t), a column-parallel product's output gradient 1/t (QKV's 6 → 3, fc1's 8 → 4), a
    row-parallel one's whole (the projection's and fc2's 2 each, reduced after the product). Full recomputation
    keeps the layer's input alone from F, but its B recomputes the products and stores them for W all the same."""
    whole = _on_rank(1)
    assert (whole.wgrad_kept_bytes, whole.wgrad_gradient_bytes) == (14 * SBH, 18 * SBH)
    split = _on_rank(2, sequence_parallel=True)
    assert (split.wgrad_kept_bytes, split.wgrad_gradient_bytes) == (7 * SBH, 11 * SBH)
    full = _on_rank(1, recompute="full")
    assert full.activation_bytes == 2 * SBH
    assert (full.wgrad_kept_bytes, full.wgrad_gradient_bytes) == (14 * SBH, 18 * SBH)


class _SeparateProjections(torch.nn.Module):
    """q, k and v as three width × width products of one normed input (Hugging Face Llama's q_proj, k_proj and
    v_proj), then an output projection of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(H, H) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.o(self.q(y) * self.k(y) + self.v(y))


def test_products_that_read_one_input_are_column_parallel_whatever_their_shape():
    """Four width × width products: q, k and v read one input, so a rank of t = 2 keeps half of each one's output
    gradient, as of Megatron-core's fused linear_qkv; the output projection's whole, as of a row-parallel product
    (`_Split.matmul`'s rule for a width × width weight)."""
    with torch.device("meta"):
        layers = [_SeparateProjections(), torch.nn.Linear(H, H)]
    model = Model("projections", layers, lambda b, gen: (torch.randn(b, S, H, generator=gen), None),
                  lambda out, target: out.float().square().mean())
    layer = count_model(model, B, torch.float16).layers[0]
    assert [shares for _, _, shares in layer.weight_grad_outputs] == [True, True, True, False]
    each = 2 * SBH  # one product's output in fp16
    links = placement_links(A100, Parallelism(tensor=2)).tensor
    on_rank = estimate_layer(layer, DEVICE, Parallelism(tensor=2, sequence_parallel=True), links, 2)
    assert on_rank.wgrad_gradient_bytes == 3 * each // 2 + each


def _peaks_mib(costs: Costs, p: int = 4, m: int = 8) -> list[float]:
    schedule = build("zb-h1", p, m)
    return [d.peak_memory_mb for d in summarize(simulate(schedule, costs, Cluster.uniform(p, 0.0))).devices]


def _with_kept(costs: Costs, kept_mb: float, gradient_mb: float) -> Costs:
    return replace(costs, stages=tuple(replace(c, wgrad_kept_bytes=round(kept_mb * MIB),
                                               wgrad_gradient_bytes=round(gradient_mb * MIB))
                                       for c in costs.stages))


def test_the_simulators_split_backward_holds_what_each_stage_keeps_from_i_until_w():
    """ZB-H1 with 64 MiB of activations a micro-batch (stage k: p − k forwards in flight at most, k W's deferred): a
    stage that keeps 12 MiB of them and 16 MiB of gradients peaks as the fraction 28/64 of its activations does, not
    as the default half, on every stage that defers a W (stage 0 defers none); where it keeps more than its
    activations (full recomputation's products rerun in B), the I raises what the stage holds."""
    typed = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=64.0)
    default, kept = _peaks_mib(typed), _peaks_mib(_with_kept(typed, 12.0, 16.0))
    assert kept == pytest.approx(_peaks_mib(replace(typed, wgrad_activation_fraction=28 / 64)))
    assert kept[0] == default[0] and all(mine < half for mine, half in zip(kept[1:], default[1:]))
    assert _peaks_mib(_with_kept(typed, 48.0, 32.0)) == pytest.approx(
        _peaks_mib(replace(typed, wgrad_activation_fraction=80 / 64)))


def test_what_a_recomputing_split_backward_keeps_beyond_its_activations_is_held_whole():
    """Full recomputation's I saves its products' inputs again: 96 MiB kept until W of a stage whose forward saved
    64 MiB. The simulator holds all of it with the 16 MiB of gradients, as the fraction 112/64 does, and so do
    auto's limit and --stage-cut fit (`wgrad_held`, unbounded by the activations): bounding it by them, as the
    simulator's split of it into the forward's part is (sim/engine.py `_memory_tables`), would hold 32 MiB less."""
    typed = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=64.0)
    recomputing = _with_kept(typed, 96.0, 16.0)
    assert _peaks_mib(recomputing) == pytest.approx(_peaks_mib(replace(typed, wgrad_activation_fraction=112 / 64)))
    assert [int(sum(held)) for held in zip(*recomputing.wgrad_held_bytes())] == [112 * MIB] * 4


def test_torchs_pipelining_keeps_every_saved_tensor_until_w_and_unknown_stays_unknown():
    """torch's stage_backward_input keeps the graph for stage_backward_weight: all of a stage's activations but the
    received input it computes on (its receive buffer, held the whole step), beside the output gradients."""
    costs = _with_kept(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, activation_mb=64.0, output_mb=1.0), 12.0, 16.0)
    schedule = build("zb-h1", 2, 4)
    torch_held = held_as_runtime(costs, schedule, "torch")
    assert [c.wgrad_kept_bytes for c in torch_held.stages] == [64 * MIB, 63 * MIB]  # 1: on its input's buffer
    assert [c.wgrad_gradient_bytes for c in torch_held.stages] == [16 * MIB] * 2
    unknown = held_as_runtime(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, activation_mb=64.0), schedule, "torch")
    assert [c.wgrad_kept_bytes for c in unknown.stages] == [None, None]


def test_a_first_stage_keeps_its_whole_forward_until_w_and_no_output_gradients():
    """The first stage computes no input gradient (pipesim's executor finds no input wanting one, torch's stage skips
    stage_backward_input where `is_first`): its I runs none of its layers, frees nothing and makes none of the output
    gradients the fork's store would hold, its W the whole backward. So it keeps its whole forward from I until W and
    no gradients (18·sbh a block before, held beside it), under either runtime; the next stage keeps its layers'."""
    from pipesim.planning.estimate import estimate_profile
    from pipesim.planning.scenario import profile_scenario

    counted = count_built("gpt", dict(layers=2, width=H, heads=A, seq_len=S, vocab=128), B, torch.float16)
    profile = estimate_profile(counted, A100, Parallelism(pipeline=2), bounds=[0, 2, len(counted.layers)])
    first, second = profile.stages
    assert (first.wgrad_kept_bytes, first.wgrad_gradient_bytes) == (first.activation_bytes, 0)
    later = profile.layers[second.layers[0]:second.layers[1]]
    assert (second.wgrad_kept_bytes, second.wgrad_gradient_bytes) == (
        sum(layer.wgrad_kept_bytes for layer in later), sum(layer.wgrad_gradient_bytes for layer in later))
    assert profile.layers[1].wgrad_gradient_bytes == 18 * SBH and second.wgrad_gradient_bytes > 18 * SBH
    schedule = build("zb-h1", 2, 4)
    held = {runtime: np.add(*profile_scenario(profile, "adam", runtime).costs(schedule).wgrad_held_bytes())
            for runtime in ("torch", "pipesim")}
    assert held["torch"][0] == held["pipesim"][0] == first.activation_bytes
    # --stage-cut fit's every range holds so too: the simulator's bytes for both stages of this cut
    memory = profile_scenario(profile, "adam").stage_memory(schedule)
    n = len(profile.layers)
    assert [memory.held_until_w[0, stop] for stop in range(1, n + 1)] == [memory.activations[0, stop]
                                                                          for stop in range(1, n + 1)]
    assert [memory.held_until_w[0, 2], memory.held_until_w[2, n]] == list(held["pipesim"])


def test_every_ranges_feeding_is_each_stages():
    """`fed_ranges` (--stage-cut fit's every range at once) is `fed_by_the_batch` of each range, on random graphs of
    layers each reading the batch (-1) or earlier layers: a range is fed by the batch alone where none of its layers
    reads a layer before it."""
    from types import SimpleNamespace

    from pipesim.profiles.schema import fed_by_the_batch, fed_ranges

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 9))
        layers = [SimpleNamespace(inputs=sorted({int(rng.integers(-1, i)) for _ in range(int(rng.integers(1, 3)))}))
                  if i else SimpleNamespace(inputs=[-1]) for i in range(n)]
        fed = fed_ranges(layers)
        assert fed.shape == (n + 1, n + 1)
        assert all(fed[i, j] == fed_by_the_batch(layers[i:j], i) for i in range(n) for j in range(i + 1, n + 1))
        assert fed[0, 1:].all()


def test_a_stage_keeps_what_each_layer_keeps_where_it_lies():
    """`wgrad_held_ranges`: a layer no later layer of its range reads (the range's last, a branch's last) keeps its
    `wgrad_kept_bytes`, one read within it its `wgrad_kept_below_bytes` (None: the same, an estimate's), a storage
    two layers save counted once as the activations count it. A DAG: 0 reads the batch, 1 and 2 read 0, 3 reads
    both; each saves 10 and keeps 4 as the last; calibrated, all 10 below another, 3 sharing 2 with 2."""
    from types import SimpleNamespace

    from pipesim.profiles.partition import LayerCost, activation_ranges
    from pipesim.profiles.schema import wgrad_held_ranges

    def ranges(below, shared):
        layers = [SimpleNamespace(inputs=inputs, activation_bytes=10, wgrad_kept_bytes=4, wgrad_kept_below_bytes=below,
                                  wgrad_gradient_bytes=1, shared_with_previous_bytes=shared * (i == 3))
                  for i, inputs in enumerate([[-1], [0], [0], [1, 2]])]
        activations = activation_ranges([LayerCost(0.0, 0, x.activation_bytes, x.shared_with_previous_bytes)
                                         for x in layers])
        return activations, *wgrad_held_ranges(layers, activations)

    activations, kept, gradients, known = ranges(below=10, shared=2)
    assert known.all()
    assert [kept[1, 2], kept[1, 3], kept[1, 4], kept[2, 4]] == [4, 4 + 4, 10 + 10 + 4 - 2, 10 + 4 - 2]
    assert kept[0, 3] == activations[0, 3] == 30  # fed by the batch alone: all it saved
    assert [gradients[1, 4], gradients[0, 3]] == [3, 0]  # and no gradients
    _, kept, _, _ = ranges(below=None, shared=0)  # an estimate's: each keeps its 4 wherever it lies
    assert [kept[1, 3], kept[1, 4], kept[2, 4]] == [8, 12, 8]
