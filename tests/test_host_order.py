"""A pass after a synchronisation priced in its kernels' order (planning/host.py `waited_ms`): the host issues kernel
k at its cumulative cost and the GPU starts it no sooner, nor before it ends kernel k-1, so host-heavy kernels before
GPU-heavy ones add their times where interleaved ones overlap; a synchronising MoE layer's passes are at least the
bound the totals give (the longer of the GPU's time and the host's issue less the all-to-alls) and the GPU's time
where the host is free."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipesim.planning.estimate import Parallelism, estimate_layer, estimate_profile, links_of, node_placement
from pipesim.planning.experts import expert_group
from pipesim.planning.host import (
    Kernels,
    carried_waits_ms,
    issued_ms,
    pass_issue,
    pass_kernels,
    waited_ms,
)
from pipesim.profiles.schema import PASSES, LayerProfile, stage_host_waits_ms
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE
from tests.helpers import host_floor_ms as floor_ms
from tests.helpers import lean_experts_count as counted
from tests.helpers import random_pass as _random_pass

HOST_HEAVY = Kernels(10, 1.0, 0.1)  # ten kernels the host takes 1 ms each to issue and the GPU runs in 0.1 ms
GPU_HEAVY = Kernels(10, 0.1, 1.0)


def end_ms(kernels: list[Kernels], lead_ms: float = 0.0) -> float:
    """When the GPU ends the last of `kernels` past its queue at the start: their GPU time and its wait."""
    return sum(run.count * run.gpu_ms for run in kernels) + waited_ms(kernels, lead_ms)[0]


def one_by_one(kernels: list[Kernels]) -> list[Kernels]:
    return [Kernels(1, run.host_ms, run.gpu_ms, run.call_ms if i == 0 else 0.0, run.waits and i == 0)
            for run in kernels for i in range(run.count)]


def test_host_heavy_kernels_before_gpu_heavy_ones_add_their_times():
    """The GPU idles while the host issues the first ten (10 ms, the last run 0.1 ms after), then runs the next ten
    back to back: 20.1 ms where the totals give 11 each; the other way round the host issues under the GPU's work."""
    assert end_ms([HOST_HEAVY, GPU_HEAVY]) == pytest.approx(20.1)
    assert end_ms([GPU_HEAVY, HOST_HEAVY]) == pytest.approx(11.1)


def test_interleaved_kernels_overlap_and_a_gpu_bound_pass_is_the_gpus():
    """Alternating, each side hides the other's: the longer total plus one kernel. Where the GPU outlasts the host
    every kernel the pass is the GPU's time plus the first kernel's issue, and none with that much queued."""
    alternating = [Kernels(1, 1.0, 0.1), Kernels(1, 0.1, 1.0)] * 10
    assert 11.0 < end_ms(alternating) <= 11.0 + 1.1
    assert end_ms([GPU_HEAVY]) == pytest.approx(10.1)
    assert end_ms([GPU_HEAVY], lead_ms=0.1) == pytest.approx(10.0)
    assert waited_ms([GPU_HEAVY]) == pytest.approx((0.1, 10.1 - 1.0))  # the GPU's queue ahead of the host at its end


def test_a_run_in_closed_form_is_its_kernels_one_by_one():
    runs = [Kernels(3, 0.2, 0.5, call_ms=1.0), Kernels(4, 0.7, 0.1), Kernels(1, 0.0, 2.0, waits=True),
            Kernels(5, 0.3, 0.3, call_ms=0.4), Kernels(2, 0.05, 0.9)]
    for lead_ms in (0.0, 0.5, 20.0):
        assert waited_ms(runs, lead_ms) == pytest.approx(waited_ms(one_by_one(runs), lead_ms))


def test_a_wait_for_the_gpu_makes_what_follows_it_add():
    """The synchronisation empties the queue: a host-heavy run after a GPU-heavy one waits for it whole."""
    assert end_ms([GPU_HEAVY, Kernels(10, 1.0, 0.1, waits=True)]) == pytest.approx(10.1 + 10.1)
    assert end_ms([GPU_HEAVY, Kernels(10, 1.0, 0.1)]) == pytest.approx(11.1)


def test_a_models_passes_carry_the_queue_from_layer_to_layer():
    """A dense layer, then two MoE layers of a host-heavy part before their dispatch and a GPU-heavy part after it.
    The forward starts with the host not ahead: the dense layer waits for its issue (9.1, 0.1 queued after it), the
    first MoE layer for its host-heavy part (9.0 with that 0.1) and its GPU-heavy part's first issue after the
    dispatch; each segment runs from one dispatch to the next, so the second layer's host-heavy part is issued under
    the first's GPU-heavy tail (9.1 ms queued) and waits for nothing. The backward starts from the queue the
    forward's last synchronisation emptied, the last layer first, the dense layer issued under the queue the MoE
    layer before it left."""
    dense = [HOST_HEAVY]
    moe = [HOST_HEAVY, Kernels(1, 0.0, 0.0, waits=True), GPU_HEAVY]
    assert carried_waits_ms([dense, moe, moe], backward=False) == pytest.approx([9.1, 9.1, 0.1])
    assert carried_waits_ms([dense, moe, moe], backward=True) == pytest.approx([0.0, 0.1, 9.2])
    assert carried_waits_ms([moe, dense, dense], backward=False) == pytest.approx([9.2, 0.0, 9.0])  # 9.1 queued


def test_a_stage_composes_its_layers_issue_from_its_own_start():
    """profiles/schema.py `stage_host_waits_ms` from each layer's `pass_issue`: a stage of the model's layers is the
    recursion over its own layers from the host not ahead (the layers' times hold the model's, from the first
    layer), whatever the lead each starts with; a stage with no synchronising layer (a process of its own that
    never waits) only for its issue beyond its GPU time (none here: the dense layer's GPU outlasts its host)."""
    dense = [Kernels(4, 0.3, 0.2), Kernels(2, 0.1, 1.5, call_ms=0.4)]
    moe = [Kernels(3, 0.2, 0.6, call_ms=1.0), Kernels(1, 0.0, 0.8, waits=True), Kernels(6, 0.9, 0.2),
           Kernels(1, 0.0, 0.8), Kernels(2, 0.1, 1.2)]
    model = [dense, moe, dense, moe, moe, dense]
    for backward in (False, True):
        name = "bwd" if backward else "fwd"
        carried = carried_waits_ms(model, backward)
        layers = [LayerProfile.model_construct(host_issue={
            "fwd": pass_issue(kernels, carried[i]) if not backward else pass_issue(model[i], 0.0),
            "bwd": pass_issue(kernels, carried[i])}) for i, kernels in enumerate(model)]
        for start, stop in ((0, 6), (0, 2), (2, 5), (3, 6), (5, 6), (2, 3)):
            stage = carried_waits_ms(model[start:stop], backward)
            synced = any(run.waits for kernels in model[start:stop] for run in kernels)
            expected_ms = (sum(stage) if synced else floor_ms(model[start:stop])) - sum(carried[start:stop])
            assert stage_host_waits_ms(layers, start, stop, name) == pytest.approx(expected_ms, abs=1e-12)


@pytest.mark.parametrize("host_kernel_us", [0.0, 12.0, 300.0])
def test_a_synchronising_moe_layer_is_at_least_the_bound_its_totals_give(host_kernel_us):
    """E = 8 from d = 8 replicas (test_expert_pair_order's small MoE): each pass of a MoE block issued from an empty
    queue is at least the longer of its GPU time and the host's issue less its all-to-alls, and the GPU's time
    exactly where the host is free; so is each whole pass of the model, its layers carrying the queue from its first
    layer with the host not ahead (`carried_waits_ms`), its dense layers' issue included."""
    parallel = Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=host_kernel_us)
    profile = estimate_profile(counted(), H100, parallel)
    links = links_of(node_placement(H100), 1, 4, 8)
    group = expert_group(node_placement(H100), 8, 8, 1, 1, 4, 8)
    gpu_ms, hidden_ms, issued_total_ms, alone_ms = ({name: 0.0 for name in PASSES} for _ in range(4))
    for layer, priced in zip(map(group.local, counted().layers), profile.layers, strict=True):
        gpu = estimate_layer(layer, DEVICE, parallel, links.tensor, 2)
        forward_ops = [op for op, _ in gpu.timed_ops["fwd"]]
        for name in PASSES:
            all_to_all_ms = {"fwd": priced.all_to_all_fwd_ms, "wgrad": 0.0}.get(name, priced.all_to_all_bwd_ms)
            kernels = pass_kernels(gpu.timed_ops[name], forward_ops, False, host_kernel_us, name, 0.0,
                                   all_to_all_ms, name == "fwd" and bool(layer.dispatched_bytes))
            alone_ms[name] = getattr(gpu, f"{name}_ms") + waited_ms(kernels)[0]
            issued = issued_ms(kernels)
            if layer.dispatched_bytes:
                assert alone_ms[name] >= max(getattr(gpu, f"{name}_ms"), issued - all_to_all_ms) - 1e-12
            gpu_ms[name] += getattr(gpu, f"{name}_ms")
            hidden_ms[name] += all_to_all_ms
            issued_total_ms[name] += issued
            if host_kernel_us == 0.0:
                assert getattr(priced, name).median_ms == alone_ms[name] == getattr(gpu, f"{name}_ms")
    for name in PASSES:
        whole_ms = sum(getattr(priced, name).median_ms for priced in profile.layers)
        assert whole_ms >= max(gpu_ms[name], issued_total_ms[name] - hidden_ms[name]) - 1e-9
        assert (whole_ms > gpu_ms[name] + 1e-9) == (host_kernel_us > 0.0)


def test_each_stage_starts_its_passes_with_its_host_not_ahead():
    """Stages of the small MoE at 300 us a kernel: the embedding's stage, whose host never waits, takes its kernels'
    issue, which outlasts their GPU time (the backward's the weight pass's too: a first stage's, `_summed`); a
    stage of two blocks starts each pass from an empty queue, where its layers' times hold the queue the model's
    layers before them left, so it takes at least their sum; one stage of the whole model takes the sum."""
    parallel = Parallelism(pipeline=3, data=8, expert=8, host_kernel_us=300.0)
    free = estimate_profile(counted(), H100, replace(parallel, host_kernel_us=0.0), bounds=[0, 1, 3, 6])
    profile = estimate_profile(counted(), H100, parallel, bounds=[0, 1, 3, 6])
    whole = estimate_profile(counted(), H100, replace(parallel, pipeline=1), bounds=[0, 6])
    for name in ("fwd", "bwd", "igrad", "wgrad"):
        embedding_ms, gpu_ms = getattr(profile.stages[0], f"{name}_ms"), getattr(free.stages[0], f"{name}_ms")
        assert embedding_ms == pytest.approx(0.3 * round(embedding_ms / 0.3)) and (embedding_ms > gpu_ms or not gpu_ms)
        assert getattr(profile.layers[0], name).median_ms > getattr(free.layers[0], name).median_ms or name == "igrad"
        summed_ms = sum(getattr(layer, name).median_ms for layer in profile.layers[1:3])
        assert getattr(profile.stages[1], f"{name}_ms") >= summed_ms - 1e-9
        if name in ("fwd", "bwd"):  # a first stage runs no input-gradient pass (`_summed`)
            total_ms = sum(getattr(layer, name).median_ms for layer in whole.layers)
            assert getattr(whole.stages[0], f"{name}_ms") == pytest.approx(total_ms, rel=1e-12)
    assert profile.stages[1].fwd_ms > sum(layer.fwd.median_ms for layer in profile.layers[1:3]) + 1e-6


def test_random_passes_keep_the_floor_the_ceiling_and_their_map_of_the_lead():
    """Random passes (seeded): from an empty queue each ends no sooner than the longer of its GPU time and its
    host's issue (the all-to-alls' GPU time among the GPU's, so issue - all-to-alls against the rest) and no later
    than their sum; from any lead, `pass_issue`'s max-plus map gives `waited_ms`'s wait and the queue it leaves."""
    rng = random.Random(20261130)
    for _ in range(400):
        kernels, lead_ms = _random_pass(rng, rng.random() < 0.5), rng.choice((0.0, rng.uniform(0.0, 10.0)))
        gpu_ms = sum(run.count * run.gpu_ms for run in kernels)
        host_ms = sum(run.call_ms + run.count * run.host_ms for run in kernels)
        assert max(gpu_ms, host_ms) - 1e-9 <= end_ms(kernels) <= gpu_ms + host_ms + 1e-9
        issue = pass_issue(kernels, 0.0)
        waited = max(0.0, issue.idle_ms - lead_ms) + issue.after_idle_ms
        left = issue.after_lead_ms if issue.synchronises else max(lead_ms, issue.idle_ms) + issue.slack_ms
        assert (waited, left) == pytest.approx(waited_ms(kernels, lead_ms), abs=1e-9)


def test_random_stages_compose_their_layers_issue_as_the_recursion_over_them_does():
    """Random models of dense and synchronising layers cut at random (seeded): a stage's forward and backward as
    `stage_host_waits_ms` composes them from each layer's `pass_issue` are `carried_waits_ms` over its own layers
    from the host not ahead (where no layer of its own waits, its issue beyond its GPU time), less what the layers'
    times hold."""
    rng = random.Random(1454218)
    for _ in range(60):
        synced = [rng.random() < 0.5 for _ in range(rng.randint(1, 7))]
        forward = [_random_pass(rng, waits) for waits in synced]
        backward = [_random_pass(rng, False) for _ in synced]
        carried = {"fwd": carried_waits_ms(forward, False), "bwd": carried_waits_ms(backward, True)}
        layers = [LayerProfile.model_construct(host_issue={
            "fwd": pass_issue(forward[i], carried["fwd"][i]), "bwd": pass_issue(backward[i], carried["bwd"][i])})
            for i in range(len(synced))]
        start = rng.randrange(len(synced))
        stop = rng.randint(start + 1, len(synced))
        for name, passes in (("fwd", forward), ("bwd", backward)):
            own_ms = (sum(carried_waits_ms(passes[start:stop], name == "bwd")) if any(synced[start:stop])
                      else floor_ms(passes[start:stop]))
            assert stage_host_waits_ms(layers, start, stop, name) == pytest.approx(
                own_ms - sum(carried[name][start:stop]), abs=1e-9)
