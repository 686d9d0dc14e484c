"""Megatron-core's overlapped pair node by node (planning/experts.py `paired_exposed_ms`): a forward beside a backward
of the same layer runs its attention, dispatch, experts and combine on two streams in TransformerLayerSchedulePlan's
order, so each all-to-all hides only under the one node beside it; what that leaves exposed is a stage's
`all_to_all_paired_ms`, which the simulator charges each pair of a schedule run with the expert overlap."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import (
    Device,
    Parallelism,
    _routed_part,
    estimate_layer,
    estimate_profile,
    links_of,
    node_placement,
    on_multiprocessors,
    op_ms,
    persistent_product_ms,
    sharing_dispatcher,
)
from pipesim.planning.experts import MoePass, expert_group, paired_exposed_ms
from pipesim.planning.scenario import Scenario
from pipesim.profiles.workload import OpCount
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim.cluster import Cluster, Link
from pipesim.sim.costs import Costs, StageCosts, held_compute
from pipesim.sim.engine import simulate
from pipesim.traces.metrics import summarize
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE
from tests.helpers import lean_experts_count as counted


def test_an_all_to_all_hides_only_under_the_node_beside_it():
    """Forward: attention 3, experts 1, dispatch 1, combine 1; backward: attention 6, experts 2, dispatch and
    combine 1.5 each. Hidden whole-pass (2 ms under the backward's 8, 3 under the forward's 4) nothing shows; in
    Megatron-core's order the backward's dispatch starts after its experts (at 5) and runs to 6.5 beside the
    forward's experts (5 to 6), so the backward's attention starts 0.5 late: 12.5 ms for 12 of compute."""
    forward, backward = MoePass(3.0, 1.0, 1.0, 1.0), MoePass(6.0, 2.0, 1.5, 1.5)
    assert paired_exposed_ms(forward, backward) == pytest.approx(0.5)


def test_a_node_beside_an_all_to_all_runs_slower_only_while_it_runs_and_only_on_the_path_it_lengthens():
    """Every node 1 ms, each part's compute twice as slow beside the all-to-alls' kernels (a persistent product
    held). Each compute node starts with an all-to-all beside it (the backward's combine beside the forward's
    attention, the forward's dispatch beside the backward's experts, the backward's dispatch beside the forward's
    experts, the forward's combine beside the backward's attention): half its work in that 1 ms, the other half
    after, 1.5 ms, and the next node waits for it: 6 ms a layer for 4 of compute, 2 exposed where none was.
    With 0.5 ms nodes beside 2 ms all-to-alls each node ends within its all-to-all, which the chain waits for
    anyway: 8 ms a layer, 6 exposed, held or not (the simulator's stretch of each part, 2 ms more, would not know)."""
    even = (MoePass(1.0, 1.0, 1.0, 1.0), MoePass(1.0, 1.0, 1.0, 1.0))
    assert paired_exposed_ms(*even) == 0.0
    assert paired_exposed_ms(*even, slower=(2.0, 2.0)) == pytest.approx(2.0)
    bound = (MoePass(0.5, 0.5, 2.0, 2.0), MoePass(0.5, 0.5, 2.0, 2.0))
    assert paired_exposed_ms(*bound) == pytest.approx(6.0)
    assert paired_exposed_ms(*bound, slower=(2.0, 2.0)) == pytest.approx(6.0)


def test_an_all_to_all_launched_beside_a_running_product_starts_when_it_ends():
    """The backward's dispatch (1 ms) waits for the forward's (1.5 ms, from the attention's end at 1 to 2.5) and is
    launched at 2.5, while the backward's experts' weight gradients run (2 to 3): with products of 0.2 ms on every
    multiprocessor it starts 0.1 ms later, half of one, and the backward's attention waiting for it starts so, 0.3
    ms exposed a layer -> 0.4, 0.5 at 0.4 ms products, and 0.8 at 2 ms ones, the wait no longer than the node runs
    on (0.5). The forward's products change nothing: every all-to-all beside its nodes is launched as they start,
    on the event the node before recorded (the dispatch as the backward's experts start, the combine as the
    attention does)."""
    def exposed_ms(forward_product_ms: float, backward_product_ms: float) -> float:
        return paired_exposed_ms(MoePass(1.0, 0.2, 1.5, 0.0, product_ms=forward_product_ms),
                                 MoePass(1.0, 2.0, 1.0, 0.5, experts_wgrad_ms=1.0, product_ms=backward_product_ms))

    assert exposed_ms(0.0, 0.0) == pytest.approx(0.3)
    assert exposed_ms(0.0, 0.2) == pytest.approx(0.4)
    assert exposed_ms(0.0, 0.4) == pytest.approx(0.5)
    assert exposed_ms(0.0, 2.0) == pytest.approx(0.8)
    assert exposed_ms(2.0, 0.0) == pytest.approx(0.3)


def test_a_pairs_node_is_held_by_the_engines_rule_for_compute_beside_a_kernel():
    """The pair's compute node beside an all-to-all's kernels and the engine's compute beside a transfer's are held
    by one function (sim/costs.py `held_compute`): products of 2 ms, twice as slow beside a kernel, end 0.5 ms later
    for a 0.5 ms kernel (the product it ends in held for all of it), not 0.25 ms (half its time, the rate: a kernel
    shorter than two products). Without persistent products (in waves) the node runs at half speed beside it; the
    engine's device whose products' time is not known makes no progress while it runs."""
    kernels = [(1.0, 1.5)]
    assert held_compute(kernels, 0.0, 10.0, 2.0, 2.0)[0] == pytest.approx(10.5)
    assert held_compute(kernels, 0.0, 10.0, 0.0, 2.0)[0] == pytest.approx(10.25)
    assert held_compute(kernels, 0.0, 10.0, None, 2.0)[0] == pytest.approx(10.5)
    assert held_compute(kernels, 0.0, 1.2, 0.0, 2.0)[0] == pytest.approx(1.4)  # its 0.2 ms left, twice as slow
    assert held_compute(kernels, 0.0, 1.2, None, 2.0)[0] == pytest.approx(1.7)  # the kernel's whole time


def _paired_calls(monkeypatch) -> list[tuple[MoePass, MoePass, dict]]:
    """Each pair an estimate prices from here on (planning/estimate.py's `paired_exposed_ms`): its two passes and
    the rest of what it was given, in call order."""
    import pipesim.planning.estimate as estimate

    real, calls = estimate.paired_exposed_ms, []

    def seen(forward: MoePass, backward: MoePass, **priced) -> float:
        calls.append((forward, backward, priced))
        return real(forward, backward, **priced)

    monkeypatch.setattr(estimate, "paired_exposed_ms", seen)
    return calls


def test_the_pairs_all_to_alls_wait_for_products_only_where_products_hold_every_multiprocessor(monkeypatch):
    """An estimate's pair carries each pass's mean product where its products run on every multiprocessor beside
    the dispatcher's kernels (an H100's, held: `sharing_dispatcher`), none where they run in waves (an A100's) or
    are given a target (DeepSeek's recipe)."""
    calls = _paired_calls(monkeypatch)
    for gpu, fp8, held in (("h100-sxm", None, True), ("h100-sxm", "deepseek", False), ("a100-sxm-80gb", None, False)):
        calls.clear()
        estimate_profile(counted(), load_catalogue().find(gpu),
                         Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=0, fp8=fp8))
        pairs = [(forward, backward) for forward, backward, _ in calls]
        assert pairs and all((min(part.product_ms for part in pair) > 0) == held for pair in pairs)


def test_how_much_slower_the_pairs_nodes_run_beside_the_all_to_alls_is_the_gpus_whatever_the_host(monkeypatch):
    """The pair's nodes are the GPU's times, the host's issue apart (`MoePass`): each part runs beside the
    all-to-alls at its GPU time on what they leave over its own, whatever the host's cost a kernel. Read with the
    waits each series carries from layer to layer (the slower kernels beside them let the host run further ahead),
    12 us a kernel gave this MoE 1.0-1.13 where its GPU's is 1.25 and 1.49, and 26.02's 30B row's last layers 0.55:
    faster beside the kernels than alone."""
    calls = _paired_calls(monkeypatch)
    by_host = {}
    for host_kernel_us in (0.0, 12.0):
        calls.clear()
        estimate_profile(counted(), H100, Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=host_kernel_us))
        by_host[host_kernel_us] = [priced["slower"] for _, _, priced in calls]
    assert by_host[0.0] and all(min(slower) > 1 for slower in by_host[0.0])
    flat = {us: [ratio for slower in pairs for ratio in slower] for us, pairs in by_host.items()}
    assert flat[12.0] == pytest.approx(flat[0.0], rel=1e-12)


def test_all_to_alls_no_longer_than_their_nodes_are_hidden_and_longer_ones_show_their_excess():
    compute = (MoePass(2.0, 2.0, 0.0, 0.0), MoePass(4.0, 4.0, 0.0, 0.0))
    assert paired_exposed_ms(*compute) == 0.0
    assert paired_exposed_ms(MoePass(2.0, 2.0, 1.0, 1.0), MoePass(4.0, 4.0, 1.0, 1.0)) == 0.0
    # the backward's combine (3) runs first beside the forward's attention (2): its experts wait 1 ms
    assert paired_exposed_ms(MoePass(2.0, 2.0, 0.0, 0.0), MoePass(4.0, 4.0, 0.0, 3.0)) == pytest.approx(1.0)


def test_the_combine_nodes_unpermutation_and_residual_add_run_on_the_communication_stream():
    """Megatron-core's combine node unpermutes the combined tokens and adds the residual after its all-to-all (its
    backward their gradients before it), on the communication stream. A pair bound by that stream (each pass's
    attention 1, experts 1, dispatch and combine 2: 8 ms of all-to-alls a layer beside 4 of compute) exposes 4 ms;
    where 0.5 ms of each pass's attention node is that work, the same compute exposes 5."""
    assert paired_exposed_ms(MoePass(1.0, 1.0, 2.0, 2.0), MoePass(1.0, 1.0, 2.0, 2.0)) == pytest.approx(4.0)
    moved = MoePass(0.5, 1.0, 2.0, 2.0, combine_compute_ms=0.5)
    assert paired_exposed_ms(moved, moved) == pytest.approx(5.0)


def test_the_next_layers_combine_runs_beside_the_attentions_delayed_weight_gradients():
    """Under `delay_wgrad_compute` the attention's weight gradients (1 of its 4 ms) run after its node, so the next
    layer's backward combine (3 ms), which waits for that node's event, runs beside them and the forward's attention
    (2): hidden whole, where running them inside the node left 1 ms a layer exposed. The experts' weight gradients
    likewise leave the backward's dispatch to start after their input gradients."""
    forward = MoePass(2.0, 2.0, 0.0, 0.0)
    assert paired_exposed_ms(forward, MoePass(4.0, 4.0, 0.0, 3.0)) == pytest.approx(1.0)
    assert paired_exposed_ms(forward, MoePass(4.0, 4.0, 0.0, 3.0, attention_wgrad_ms=1.0)) == 0.0
    # the backward's dispatch (2) beside the experts' 1 ms of weight gradients and the forward's experts (2)
    assert paired_exposed_ms(forward, MoePass(4.0, 4.0, 3.0, 0.0)) == pytest.approx(1.0)
    assert paired_exposed_ms(forward, MoePass(4.0, 4.0, 3.0, 0.0, experts_wgrad_ms=1.0)) == 0.0


def test_a_pair_takes_at_least_its_hosts_issue_and_waits_out_the_dispatch_where_its_experts_wait():
    """One host issues both passes, node by node: 2 + 3 ms of the forward's and 4 + 5 of the backward's beside 3 ms
    of GPU work make the pair 14 ms, 11 beyond its compute, 1 beyond its rows where they already charge 13. Where the
    host also waits for the forward's dispatched tokens before issuing its experts (DeepEP's path in Megatron-core),
    it waits out the 2 ms dispatch it would have issued beside: 1 + 1 ms of the forward's issue and 2 + 1 of the
    backward's (4 ms on the GPU) take 5 ms a pair without that wait, 7 with it."""
    forward, backward = (MoePass(0.5, 0.5, 0.0, 0.0, attention_issue_ms=2.0, experts_issue_ms=3.0),
                         MoePass(1.0, 1.0, 0.0, 0.0, attention_issue_ms=4.0, experts_issue_ms=5.0))
    assert paired_exposed_ms(forward, backward) == pytest.approx(11.0)
    assert paired_exposed_ms(forward, backward, charged_ms=13.0) == pytest.approx(1.0)
    forward, backward = (MoePass(1.0, 1.0, 2.0, 0.0, attention_issue_ms=1.0, experts_issue_ms=1.0),
                         MoePass(1.0, 1.0, 0.0, 0.0, attention_issue_ms=2.0, experts_issue_ms=1.0))
    assert paired_exposed_ms(forward, backward) == pytest.approx(1.0)
    assert paired_exposed_ms(forward, backward, experts_wait=True) == pytest.approx(3.0)


def test_each_moe_layer_carries_what_its_own_pair_leaves_exposed():
    """E = 8 from d = 8 replicas of p = 4 stages (2 of the group a node, 3/4 of each all-to-all on the NIC), the
    busiest expert taking half the copies, so that the busiest rank's all-to-alls outlast what they hide under: a
    block's field is `paired_exposed_ms` of its passes split at the routed experts' ops and the combine node's (the
    scatter back, `index_put`, and the residual add after it; in the backward the scatter's gradient, `index`),
    half of each pass's all-to-alls its dispatch, each part slowed beside them as its sharing times say, each
    all-to-all launched beside a running product waiting for half its pass's mean product (an H100's products
    hold every multiprocessor); the embedding and the head route nothing, and with E = 1 there is nothing to
    expose."""
    parallel = Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=0,  # the GPU's pricing (planning/host.py)
                           hot_expert_share=0.5)
    profile = estimate_profile(counted(), H100, parallel)
    links = links_of(node_placement(H100), 1, 4, 8)
    group = expert_group(node_placement(H100), 8, 8, 1, 1, 4, 8, hot_share=0.5)
    for layer, priced in zip(map(group.local, counted().layers), profile.layers):
        if not layer.dispatched_bytes:
            assert priced.all_to_all_paired_ms == 0.0 and not priced.all_to_all_paired_by_node
            continue
        routed = replace(layer, ops={name: tuple(op for op in ops if op.routed) for name, ops in layer.ops.items()})
        experts = estimate_layer(routed, DEVICE, parallel, links.tensor, 2)
        residual_add = next(op for op in layer.ops["fwd"] if op.op == "add" and op.shape == layer.output_shape)
        combine = replace(layer, ops={"fwd": (replace(residual_add, count=1),
                                              *(op for op in layer.ops["fwd"] if op.op == "index_put")),
                                      "bwd": tuple(op for op in layer.ops["bwd"] if op.op == "index")}, region_ops={})
        combined = estimate_layer(combine, DEVICE, parallel, links.tensor, 2)
        assert combined.fwd_ms > 0 and combined.bwd_ms > 0
        products = [persistent_product_ms(layer, DEVICE, parallel, 2, passes=(name,)) for name in ("fwd", "bwd")]
        assert min(products) > 0
        forward = MoePass(priced.fwd.median_ms - experts.fwd_ms - combined.fwd_ms, experts.fwd_ms,
                          *(priced.all_to_all_fwd_ms / 2,) * 2, combine_compute_ms=combined.fwd_ms,
                          product_ms=products[0])
        backward = MoePass(priced.bwd.median_ms - experts.bwd_ms - combined.bwd_ms, experts.bwd_ms,
                           *(priced.all_to_all_bwd_ms / 2,) * 2, priced.wgrad.median_ms - experts.wgrad_ms,
                           experts.wgrad_ms, combine_compute_ms=combined.bwd_ms,  # the GPU's: no host wait
                           product_ms=products[1])
        slower = (priced.fwd_sharing_ms / priced.fwd.median_ms, priced.bwd_sharing_ms / priced.bwd.median_ms)
        assert min(slower) > 1
        assert priced.all_to_all_paired_ms == pytest.approx(paired_exposed_ms(forward, backward, slower=slower),
                                                            rel=1e-12)
        assert priced.all_to_all_paired_ms > 0 and priced.all_to_all_paired_by_node
    single = estimate_profile(counted(), H100, Parallelism(pipeline=4, data=8))
    assert all(layer.all_to_all_paired_ms == 0.0 and not layer.all_to_all_paired_by_node for layer in single.layers)


def test_a_host_bound_pair_exposes_the_forwards_all_to_alls_it_issued_under_alone():
    """A host at 1 ms a kernel: alone, each pass of a MoE layer takes its kernels' issue and its last kernel's run
    less its all-to-alls (the host issues while the GPU moves tokens); paired, the host issues both passes between
    two waits whatever hides beside what, so the pair takes both issues whole: both passes' all-to-alls show, less
    the last kernels the lone passes end on."""
    parallel = Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=1000)
    profile = estimate_profile(counted(), H100, parallel)
    moe = [layer for layer in profile.layers if layer.all_to_all_fwd_ms]
    assert moe and all(layer.all_to_all_fwd_ms < layer.all_to_all_paired_ms
                       <= layer.all_to_all_fwd_ms + layer.all_to_all_bwd_ms for layer in moe)


def test_a_host_bound_pair_issues_the_recomputed_regions_rerun_its_backward_waits_for():
    """A host at 1 ms a kernel: with the norms and the experts' activation recomputed (`--recompute-modules`), each
    MoE layer's backward waits for the host to issue the rerun's kernels first, and so does its overlapped pair,
    which issues the same kernels (planning/host.py `issued_ms` of `pass_kernels`): what the pair exposes beyond the
    layer's passes stays as without the rerun, where pricing the pair's issue without it hid the rerun's issue."""
    parallel = Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=1000)
    kept, rerun = (estimate_profile(counted(), H100, replace(parallel, recompute_modules=modules))
                   for modules in ((), ("layernorm", "moe_act")))
    moe = [(one, other) for one, other in zip(kept.layers, rerun.layers) if one.all_to_all_fwd_ms]
    assert moe
    for one, other in moe:
        assert other.bwd.median_ms - one.bwd.median_ms == pytest.approx(3.0, abs=0.05)  # two norms and a SwiGLU
        assert other.all_to_all_paired_ms == pytest.approx(one.all_to_all_paired_ms, rel=1e-6)


def test_the_experts_node_reruns_only_the_recomputed_regions_within_the_experts():
    """Megatron-core's `mlp` node runs the routed experts between the dispatch and the combine: of the recomputed
    regions it reruns the experts' activation (moe_act), not the norms outside them (layernorm), whose rerun is
    the other node's."""
    links = links_of(node_placement(H100), 1, 4, 8)
    layer = expert_group(node_placement(H100), 8, 8, 1, 1, 4, 8).local(counted().layers[1])
    experts = {modules: estimate_layer(_routed_part(layer), DEVICE, Parallelism(pipeline=4, data=8, expert=8,
                                                                                 recompute_modules=modules),
                                       links.tensor, 2).bwd_ms
               for modules in ((), ("layernorm",), ("moe_act",))}
    assert experts[("layernorm",)] == experts[()] < experts[("moe_act",)]


@pytest.mark.parametrize("gpu, beside", [
    ("a100-sxm-80gb", lambda device: on_multiprocessors(device, 92)),
    ("h100-sxm", lambda device: replace(on_multiprocessors(device, 116), products_held_on=device))])
def test_nccls_all_to_all_holds_sixteen_multiprocessors_beside_the_pair(gpu, beside):
    """NCCL's all-to-all (the default dispatcher) runs a CTA a channel on multiprocessors no compute kernel shares,
    16 on a DGX (NCCL issue 689): a layer's passes beside it run on the others, an A100's products in waves over
    the 92 of 108 left; an H100's persistent products are launched on all 132 and held (each twice its time
    there), its other kernels on the 116 left. An overlapped pair's part runs so while the other part's
    all-to-alls run; without expert parallelism none."""
    part = load_catalogue().find(gpu)
    parallel = Parallelism(pipeline=4, data=8, expert=8, host_kernel_us=0)  # the GPU's pricing (planning/host.py)
    links = links_of(node_placement(part), 1, 4, 8)
    device = Device.of(part, "bf16")
    group = expert_group(node_placement(part), 8, 8, 1, 1, 4, 8)
    for layer, priced in zip(map(group.local, counted().layers), estimate_profile(counted(), part, parallel).layers):
        shared = estimate_layer(layer, beside(device), parallel, links.tensor, 2)
        assert (priced.fwd_sharing_ms, priced.bwd_sharing_ms) == pytest.approx((shared.fwd_ms, shared.bwd_ms))
        if layer.dispatched_bytes:  # its products take the multiprocessors' share (the embedding is memory-bound)
            assert priced.bwd_sharing_ms > priced.bwd.median_ms
    single = estimate_profile(counted(), part, Parallelism(pipeline=4, data=8))
    assert all(layer.fwd_sharing_ms == layer.bwd_sharing_ms == 0.0 for layer in single.layers)


def test_a_persistent_product_beside_the_dispatcher_is_held_its_own_time():
    """Beside NCCL's 16 multiprocessors a product of 4,096 x 4,096 x 4,096 on an H100 (persistent CTAs, no SM
    target) is launched on all 132 and held its own time: 512 tiles of 128 x 256, 4 waves of 132 (fill 0.9697), at
    0.801 of 989.4 TFLOP/s, 0.1788 ms + 4 us alone, twice that beside (the share rule would give 0.2052 on the 116
    left). An A100's products run in waves on the 92 of 108 left: 1,024 tiles of 128 x 128, 10 waves of 108 (fill
    0.9481) at 0.859 of 312, 0.5449 ms alone; 12 waves of 92 (0.9275) at 92/108 of the peak, 0.6530 beside. A
    memory-bound kernel keeps its time. DeepSeek's recipe sets its GEMMs' multiprocessors: the share rule."""
    product = OpCount(op="mm", kind="matmul", shape=(1, 4096, 4096, 4096), flops=2 * 4096**3,
                      moved_bytes=3 * 4096 * 4096 * 2, count=1)
    copy = OpCount(op="copy", kind="memory", shape=(2**29,), flops=0, moved_bytes=2**30, count=1)
    parallel = Parallelism(data=8, expert=8)
    for gpu, alone_ms, beside_ms in (("h100-sxm", 0.1828, 2 * 0.1828), ("a100-sxm-80gb", 0.5449, 0.6530)):
        device = Device.of(load_catalogue().find(gpu), "bf16")
        beside = sharing_dispatcher(device, parallel)
        assert op_ms(product, device) == pytest.approx(alone_ms, abs=1e-4)
        assert op_ms(product, beside) == pytest.approx(beside_ms, abs=1e-4)
        assert op_ms(copy, beside) == op_ms(copy, device)
    # DeepSeek's framework gives its GEMMs the multiprocessors the kernels leave
    assert op_ms(product, sharing_dispatcher(DEVICE, Parallelism(data=8, expert=8, fp8="deepseek"))) == pytest.approx(
        0.2052, abs=1e-4)


def step_ms(method: str, paired_ms: float, overlap: bool, microbatches: int = 8, stages: int = 1, chunks: int = 1,
            backward_all_to_all_ms: float = 0.5, sharing_ms: tuple[float, float] = (0.0, 0.0),
            by_node: bool = False) -> float:
    schedule = build_schedule(method, ScheduleParams(stages=stages, microbatches=microbatches, chunks=chunks,
                                                     minibatches=2, expert_parallel=2, overlap_expert_comm=overlap))
    costs = StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=backward_all_to_all_ms,
                       all_to_all_paired_ms=paired_ms, all_to_all_paired_by_node=by_node,
                       fwd_sharing_ms=sharing_ms[0], bwd_sharing_ms=sharing_ms[1])
    trace = simulate(schedule, Costs((costs,) * (stages * chunks), pairs_by_node=overlap),
                     Cluster(stages, default_link=Link(latency_ms=0)))
    return summarize(trace).time_per_minibatch_ms


@pytest.mark.parametrize("microbatches", [4, 8])
def test_each_megatron_pair_holds_its_device_for_what_its_layers_leave_exposed(microbatches):
    """One stage, combined 1F1B (m - 1 pairs): the whole-pass model hides both 0.5 ms all-to-alls under the other
    part; a stage whose layers leave 2 ms exposed adds 2 ms to each pair, 0 (not known) nothing. Where the whole
    pass already leaves more (a 3 ms backward all-to-all, 2 ms past the forward's 1 ms), that stands."""
    pairs = microbatches - 1
    hidden = step_ms("1f1b", 0.0, True, microbatches)
    assert step_ms("1f1b", 2.0, True, microbatches) == pytest.approx(hidden + 2.0 * pairs)
    longer = step_ms("1f1b", 0.0, True, microbatches, backward_all_to_all_ms=3.0)
    assert step_ms("1f1b", 1.5, True, microbatches, backward_all_to_all_ms=3.0) == pytest.approx(longer)
    assert step_ms("1f1b", 3.0, True, microbatches, backward_all_to_all_ms=3.0) == pytest.approx(longer + pairs)


def test_a_megatron_pair_is_slowed_beside_its_all_to_alls_in_what_it_leaves_exposed_not_again():
    """Parts twice as slow beside the dispatcher's kernels (forward 2 ms of 1, backward 4 of 2): where the stage's
    layers priced the pair node by node the rows keep their own times, the exposure holding the slowing, also
    where it is 0 (every all-to-all hidden, slowed as it is: no step between 0 and a hair above it); where it was
    not priced so, each part is stretched for the other's 0.5 ms all-to-all, 0.25 ms."""
    pairs = 7
    slowed = (2.0, 4.0)
    for paired_ms in (2.0, 1e-9, 0.0):
        assert step_ms("1f1b", paired_ms, True, sharing_ms=slowed, by_node=True) == pytest.approx(
            step_ms("1f1b", paired_ms, True, by_node=True))
    assert step_ms("1f1b", 0.0, True, sharing_ms=slowed) == pytest.approx(step_ms("1f1b", 0.0, True) + 0.5 * pairs)


def test_the_engine_pairs_by_node_where_the_costs_say_so_which_the_scenario_sets_for_the_expert_overlap():
    """The simulator reads Megatron-core's pairing from the costs (`Costs.pairs_by_node`), not from a schedule
    parameter: the same overlapped combined 1F1B (7 pairs) adds each pair its stage's 2 ms exposure where the costs
    say its pairs run node by node, nothing where they do not; the scenario's costs say so for a schedule built
    with the expert overlap, and not without it."""
    schedule = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=8, minibatches=2, expert_parallel=2,
                                                     overlap_expert_comm=True))
    stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=0.5,
                       all_to_all_paired_ms=2.0, all_to_all_paired_by_node=True)
    by_node, whole = (summarize(simulate(schedule, Costs((stage,), pairs_by_node=paired),
                                         Cluster(1, default_link=Link(latency_ms=0)))).time_per_minibatch_ms
                      for paired in (True, False))
    assert by_node == pytest.approx(whole + 2.0 * 7)
    scenario = Scenario(per_stage={"--fwd": [1.0], "--bwd": [2.0], "--param-mb": [1.0], "--activation-mb": [1.0],
                                   "--output-mb": [1.0]}, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None,
                        avg_ms=None, optimizer="sgd", microbatch_size=1, comm_ms=0.0, overlap_comm=True)
    alone = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=8, minibatches=2, expert_parallel=2))
    assert scenario.costs(schedule).pairs_by_node and not scenario.costs(alone).pairs_by_node


def test_dualpipes_pairs_keep_hiding_each_part_under_the_other():
    """DualPipe's pairs are its own order (DeepSeek-V3's report), not Megatron-core's: the field changes nothing."""
    assert step_ms("dualpipev", 2.0, False, 8, 2, 2) == pytest.approx(step_ms("dualpipev", 0.0, False, 8, 2, 2))
