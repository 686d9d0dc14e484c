"""Megatron-core's gradient buckets (issue 42, item 4): the first model stage's reduce-scatter and all-gather run
bucket by bucket, max(40M, 1M x d) parameters each (distributed_data_parallel.py), so only the buckets the
backward's end and the forward's start wait for are exposed."""

from dataclasses import replace

import pytest

from pipesim.planning import buckets
from tests.helpers import interleaved_gpt as _interleaved


def test_the_bucket_size_is_megatron_cores_default():
    assert buckets.bucket_params(8) == 40_000_000
    assert buckets.bucket_params(256) == 256_000_000


def test_a_bucket_closes_once_it_holds_the_size_taking_the_layers_last_to_first():
    assert buckets.buckets([5, 30, 30, 30, 10], 40) == [[4, 3], [2, 1], [0]]


def test_a_reduce_scatter_starts_when_its_bucket_is_ready_and_the_stream_is_free():
    # backward 4, 4, 1 ms (layers 2, 1, 0), 3 ms a bucket: done at 4 + 3 = 7, max(7, 8) + 3 = 11, max(11, 9) + 3 = 14
    exposed = buckets.exposed_reduce_ms([1.0, 4.0, 4.0], [[2], [1], [0]], lambda bucket: 3.0)
    assert exposed == pytest.approx(14.0 - 9.0)


def test_a_layers_forward_waits_for_its_buckets_all_gather_the_gathers_back_to_back():
    # gathers done at 3, 6, 9 (layers 0, 1, 2); forwards 1, 4, 4 ms: 3 + 1 = 4, max(4, 6) + 4 = 10, max(10, 9) + 4 = 14
    exposed = buckets.exposed_gather_ms([1.0, 4.0, 4.0], [[2], [1], [0]], lambda bucket: 3.0)
    assert exposed == pytest.approx(14.0 - 9.0)


def _first_stage(gpu: str, d: int):
    """One stage (1F1B, m = 2, ZeRO-1 over d replicas) of a model of an embedding (285M parameters), two blocks
    (201M each) and a head (268M), estimated on `gpu`: its profile, its costs and a collective's time over the
    d ranks (a reduce-scatter of the layers' bytes `of`, as an all-gather: their weights', or `grad_bytes`, their
    float32 main gradients', twice those, which Megatron-LM reduces under --bf16)."""
    torch = pytest.importorskip("torch")
    from pipesim.hardware.catalogue import load_catalogue
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=2, width=4096, ffn=16384, heads=32, seq_len=4096, vocab=65536), 1,
                        torch.bfloat16)
    profile = estimate_profile(count, load_catalogue().find(gpu), Parallelism(data=d, sharded_optimizer=True))
    scenario = profile_scenario(profile, "adam")
    sched = scenario.build("1f1b", ScheduleParams(1, 2, data_parallel=d, zero=1))
    assert [layer.param_bytes // 2 for layer in profile.layers] == [285_212_672, 201_379_840, 201_379_840,
                                                                    268_443_648]
    assert all(layer.grad_bytes == 2 * layer.param_bytes for layer in profile.layers)
    link = scenario.data_parallel_link(sched)
    return profile, scenario.costs(sched).stages[0], lambda *layers, of="param_bytes": link.reduce_scatter_ms(
        sum(getattr(layer, of) for layer in layers), d)


@pytest.mark.parametrize("d, last_blocks", [(8, (1,)), (256, (1, 2))])
def test_the_first_stage_exposes_the_buckets_the_backward_ends_and_the_forward_starts_with(d, last_blocks):
    """On an A100 (products in waves: a collective beside them hides). At d = 8 (40M) every layer is a bucket; at
    d = 256 (256M) the head is one and the two blocks another. The backward ends with the bucket of block 1 and
    then the embedding's: the first's reduce-scatter starts as the embedding's backward does and the embedding's
    follows it; the forward waits for the embedding's all-gather, and after the embedding's forward for its
    blocks' bucket's."""
    profile, stage, collective_ms = _first_stage("a100-sxm-80gb", d)
    embed, *blocks, head = profile.layers

    def share(pass_ms: float, layer, of: str) -> float:
        return pass_ms * getattr(layer, of).median_ms / sum(getattr(x, of).median_ms for x in profile.layers)

    bwd_ms = {layer.name: share(stage.bwd_ms, layer, "bwd") for layer in profile.layers}
    fwd_ms = {layer.name: share(stage.fwd_ms, layer, "fwd") for layer in profile.layers}
    last = [blocks[i - 1] for i in last_blocks]

    def reduce_ms(*layers) -> float:
        return collective_ms(*layers, of="grad_bytes")

    # the premises: the buckets before the last blocks' are reduced while the backward reaches it and gathered
    # while the forward runs the blocks before theirs; the last blocks' outlast the embedding's passes
    earlier = [[head]] + ([[blocks[1]]] if d == 8 else [])
    assert sum(reduce_ms(*b) for b in earlier) < sum(bwd_ms[x.name] for x in (head, *blocks) if x not in last)
    if d == 8:  # block 2's all-gather under block 1's forward
        assert collective_ms(blocks[1]) < fwd_ms[blocks[0].name]
    assert sum(collective_ms(*b) for b in earlier) < fwd_ms[blocks[0].name] + fwd_ms[blocks[1].name]
    assert reduce_ms(*last) > bwd_ms[embed.name] and collective_ms(*last) > fwd_ms[embed.name]
    assert stage.reduce_ms == pytest.approx(reduce_ms(*last) - bwd_ms[embed.name] + reduce_ms(embed), rel=1e-9)
    assert stage.gather_ms == pytest.approx(collective_ms(embed) + collective_ms(*last) - fwd_ms[embed.name],
                                            rel=1e-9)
    assert stage.reduce_ms < reduce_ms(*profile.layers)  # the stage's whole reduce-scatter, as one bucket


def test_beside_persistent_products_every_buckets_collective_costs_its_whole_time():
    """On an H100 (persistent products: a collective beside one delays it by its whole time) at d = 256: the
    buckets' reduce-scatters and all-gathers each whole, the head's, the blocks' and the embedding's."""
    profile, stage, collective_ms = _first_stage("h100-sxm", 256)
    embed, *blocks, head = profile.layers
    for of, priced_ms in (("grad_bytes", stage.reduce_ms), ("param_bytes", stage.gather_ms)):
        whole_ms = collective_ms(head, of=of) + collective_ms(*blocks, of=of) + collective_ms(embed, of=of)
        assert priced_ms == pytest.approx(whole_ms, rel=1e-9)
        assert whole_ms > collective_ms(*profile.layers, of=of)  # three latencies, not one


def test_beside_persistent_products_a_stage_after_its_devices_first_pays_its_collectives_whole():
    """On an H100 the second chunk of each device (model stages 2 and 3) reduce-scatters its gradients beside
    the backward of its device's first chunk and all-gathers its weights beside that chunk's forwards, and the
    persistent products wait out both whole, paid in its update; the devices' first chunks' collectives run
    alone and are not charged again. On an A100 (products in waves) nothing is."""
    from pipesim.schedules import KINDS, Kind

    sched, costs, step_ms = _interleaved("h100-sxm")
    assert sched.placement == (0, 1, 0, 1)
    delays = [c.collective_delay_ms for c in costs.stages]
    assert delays[:2] == [0.0, 0.0]
    assert delays[2:] == [pytest.approx(c.reduce_ms + c.gather_ms) for c in costs.stages[2:]]
    assert min(delays[2:]) > 0
    opt_ms = costs.op_ms_table(1)[:, KINDS.index(Kind.OPT)]
    assert list(opt_ms) == [pytest.approx(c.opt_ms + c.collective_delay_ms) for c in costs.stages]
    undelayed = replace(costs, stages=tuple(replace(c, collective_delay_ms=0.0) for c in costs.stages))
    assert step_ms(costs) > step_ms(undelayed)
    _, a100, _ = _interleaved("a100-sxm-80gb")
    assert [c.collective_delay_ms for c in a100.stages] == [0.0] * 4


def test_beside_persistent_products_the_delay_does_not_wait_on_the_first_stages_bucket_conditions():
    """The later chunks' collectives run beside their devices' products whatever stage 0 holds: a first stage of
    routed experts (left as it is, no buckets) or plain DDP (an all-reduce, nothing gathered) still charges them;
    under --reduce-after-flush every REDUCE runs after the device's last backward and the all-gathers are not
    overlapped (Megatron-LM allows `overlap_param_gather` only with `overlap_grad_reduce`): nothing. Nor with one
    stage a device: the first mini-batch's collectives are followed by the second's compute, which waits for them."""
    _, moe, _ = _interleaved("h100-sxm", gated=True, experts=8, top_k=2, expert_ffn=1024)
    assert moe.stages[0].expert_param_bytes > 0
    assert [c.collective_delay_ms for c in moe.stages[:2]] == [0.0, 0.0]
    assert [c.collective_delay_ms for c in moe.stages[2:]] == [pytest.approx(c.reduce_ms + c.gather_ms)
                                                                for c in moe.stages[2:]]
    assert min(c.collective_delay_ms for c in moe.stages[2:]) > 0
    _, ddp, _ = _interleaved("h100-sxm", zero=0)
    assert [c.gather_ms for c in ddp.stages] == [0.0] * 4
    assert [c.collective_delay_ms for c in ddp.stages] == [0.0, 0.0, *(pytest.approx(c.reduce_ms) for c in
                                                                        ddp.stages[2:])]
    assert min(c.reduce_ms for c in ddp.stages[2:]) > 0
    _, flushed, _ = _interleaved("h100-sxm", reduce_after_flush=True)
    assert [c.collective_delay_ms for c in flushed.stages] == [0.0] * 4
    sched, plain, _ = _interleaved("h100-sxm", method="1f1b", chunks=1)
    assert sched.minibatches == 2
    assert [c.collective_delay_ms for c in plain.stages] == [0.0] * 2


def test_beside_persistent_products_the_schedules_order_says_which_collectives_run_beside_them():
    """DualPipe (two model copies, device 0 holding stages 0 and 3, device 1 stages 1 and 2) feeds copy 1 from
    device 1: stage 2's forward is that device's first, so stage 1's all-gather runs beside it, and stage 1's
    reduce-scatter is issued while stage 2's backwards still run; device 0's stage 3 likewise. The stage whose
    collectives the device issues last and whose forward it runs first pays nothing."""
    sched, costs, _ = _interleaved("h100-sxm", method="dualpipe")
    assert sched.placement == (0, 1, 1, 0)
    assert [c.collective_delay_ms for c in costs.stages] == [
        0.0, pytest.approx(costs.stages[1].reduce_ms + costs.stages[1].gather_ms),
        0.0, pytest.approx(costs.stages[3].reduce_ms + costs.stages[3].gather_ms)]
    assert min(costs.stages[1].reduce_ms, costs.stages[3].gather_ms) > 0
