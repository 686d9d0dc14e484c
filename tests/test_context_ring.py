"""Context parallelism's key/value ring as rows of the schedule (schedules/passes.py `add_context_parallel`): a
RING_F after every forward, a RING_B after every backward that runs the attention's backward (B or I), after the
pass's all-to-alls; lowered so that the pass's outputs are sent after them and the device's next row waits for
them; run by the simulator on the device's network stream for what of their exchanges the attention blocks do not cover
(planning/estimate.py `ContextRing.exchange_ms`), their buffers held by their pass as communication."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.planning.estimate import ContextRing, Parallelism, _Split, estimate_profile, placement_links
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.workload import OpCount, WorkloadCount
from pipesim.schedules import Schedule, ScheduleError, ScheduleParams, build_schedule, lower, validate
from pipesim.schedules.torch_csv import to_torch_csv
from pipesim.sim.cluster import Cluster, Link
from pipesim.sim.costs import Costs, StageCosts
from pipesim.sim.engine import simulate
from pipesim.traces.metrics import summarize
from pipesim.traces.trace import Stream
from tests.conftest import simulate_json
from tests.helpers import H100, H100_BF16, around_first, ring_gpt_count, stream_rows, without


def cp(method: str, stages: int = 2, microbatches: int = 2, chunks: int = 1, **params) -> Schedule:
    return build_schedule(method, ScheduleParams(stages=stages, microbatches=microbatches, chunks=chunks,
                                                 context_parallel=4, **params))


def test_every_forward_and_attention_backward_is_followed_by_its_ring_and_none_without_context_parallelism():
    assert cp("1f1b").to_text() == (
        "0: 0F0 0RING_F0 0F1 0RING_F1 0B0 0RING_B0 0B1 0RING_B1 0REDUCE 0OPT\n"
        "1: 1F0 1RING_F0 1B0 1RING_B0 1F1 1RING_F1 1B1 1RING_B1 1REDUCE 1OPT")
    assert "RING" not in build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2)).to_text()
    order = cp("zb-h1").to_text().splitlines()[1].split()[1:]
    assert order[:4] == ["1F0", "1RING_F0", "1I0", "1RING_B0"] and "1RING_B0" not in order[order.index("1W0"):]


def test_the_ring_comes_after_the_passs_all_to_alls_and_after_both_parts_of_an_overlapped_pair():
    order = cp("1f1b", expert_parallel=2).to_text().splitlines()[0].split()[1:]
    assert order[:6] == ["0F0", "0A2A_F0", "0RING_F0", "0F1", "0A2A_F1", "0RING_F1"]
    tokens = cp("dualpipev", chunks=2, microbatches=4, expert_parallel=2).to_text().split()
    pair = tokens.index("(0F3;3B1)OVERLAP_F_B")
    assert tokens[pair + 1:pair + 5] == ["0A2A_F3", "3A2A_B1", "0RING_F3", "3RING_B1"]


def test_a_missing_ring_is_an_incomplete_schedule():
    with pytest.raises(ScheduleError, match=r"0RING_B1 appears 0 times \(C = 4: 1 per backward\)"):
        validate(without(cp("1f1b"), "0RING_B1"))


def test_a_pass_sends_its_output_after_its_ring_and_the_next_row_waits_for_it():
    assert around_first(lower(cp("1f1b")), "RING_F") == ([("F", 0, 0), ("RING_F", 0, 0), ("SEND_F", 0, 0)], True)


def test_torch_has_no_ring_action_its_context_parallel_runs_the_ring_inside_the_attention():
    assert to_torch_csv(cp("1f1b")) == to_torch_csv(build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2)))


def test_the_simulator_holds_the_network_stream_for_what_the_attention_leaves_of_the_rings_exchanges():
    """One stage, one micro-batch: F 1 ms, its ring's exchanges 0.75, 0.5 of them under its attention: 0.25
    exposed; B 2 ms, its ring's 0.5, all of them covered: none."""
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, ring_fwd_ms=0.75, ring_fwd_hidden_ms=0.5, ring_bwd_ms=0.5,
                              ring_bwd_hidden_ms=0.5),))
    trace = simulate(cp("1f1b", stages=1, microbatches=1), costs, Cluster(1))
    assert stream_rows(trace)[:4] == [("F", Stream.COMPUTE, 0.0, 1.0), ("RING_F", Stream.NETWORK, 1.0, 0.25),
                                      ("B", Stream.COMPUTE, 1.25, 2.0), ("RING_B", Stream.NETWORK, 3.25, 0.0)]


@pytest.mark.parametrize(("links", "ring_at"), [({}, 3.0), (dict.fromkeys(("RING_F", "RING_B"), "nvlink"), 2.5)])
def test_the_ring_waits_for_the_collectives_before_it_on_its_link(links, ring_at):
    """One stage under ZeRO-3 (FSDP2 alone): the forward's GATHER holds the network 0..1.5, the forward computes
    1.5..2.5 while the backward's GATHER, prefetched as it starts, holds it 1.5..3.0: the forward's ring, covered
    by its attention, still goes after that gather on the same link, and right at the forward's end on a link of
    its own (`Costs.collective_links`)."""
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, gather_ms=1.5, reduce_ms=0.0, ring_fwd_ms=0.5,
                              ring_fwd_hidden_ms=0.5),), collective_links=links)
    schedule = cp("1f1b", stages=1, microbatches=1, zero=3)
    trace = simulate(schedule, costs, Cluster(1))
    ring = [(start / 1e3, dur / 1e3) for k, start, dur in zip(trace.ops.kind, trace.ops.start_us, trace.ops.dur_us)
            if trace.kinds[k] == "RING_F"]
    assert ring == [(ring_at, 0.0)]


@pytest.mark.parametrize(("parallel", "own_link"), [(Parallelism(context=2, pipeline=2, data=4), "nvlink"),
                                                     (Parallelism(tensor=4, context=4, pipeline=2, data=2), None)])
def test_an_estimates_ring_runs_on_its_own_link_where_the_data_parallel_group_has_another(flash_gpt, parallel,
                                                                                       own_link):
    """C = 2 fits a node (NVLink) while the d·C = 8 gradient ranks of a tensor rank cross nodes: the ring does not
    queue behind the reduce-scatter; t·C = 16 puts both across nodes, on one stream."""
    scenario = profile_scenario(estimate_profile(flash_gpt, H100, parallel), "adam")
    schedule = scenario.build("1f1b", ScheduleParams(2, 4, data_parallel=parallel.data))
    links = scenario.costs(schedule).collective_links
    assert links == ({} if own_link is None else dict.fromkeys(("RING_F", "RING_B"), own_link))


@pytest.fixture(scope="module")
def flash_gpt() -> WorkloadCount:
    pytest.importorskip("torch")
    return ring_gpt_count()


def _closed_form_ms(counted: WorkloadCount, parallel: Parallelism, pass_name: str, bounds: list[int]) -> list[float]:
    """Per stage, the exposure the estimate priced into the attention before the rings were rows: per step, what
    its transfer outlasts its block by, and the transfer after the last step whole."""
    ring = ContextRing(parallel.context, placement_links(H100, parallel).context)
    exposed = []
    for start, stop in zip(bounds, bounds[1:]):
        total = 0.0
        for layer in counted.layers[start:stop]:
            split = _Split.of(layer, parallel)
            for op in layer.ops.get(pass_name, ()):
                if op.kind != "attention":
                    continue
                mine = split.attention(op)
                steps, after = ring.step_bytes(mine, 2)
                total += op.count * (sum(max(ring.transfer_ms(nbytes) - block_ms, 0.0) for nbytes, block_ms
                                         in zip(steps, ring.blocks_ms(mine, H100_BF16)) if nbytes)
                                     + (ring.transfer_ms(after) if after else 0.0))
        exposed.append(total)
    return exposed


def _makespans(counted: WorkloadCount, parallel: Parallelism, rings: bool = True) -> tuple[float, float]:
    """The 1F1B makespan with the ring as rows, and with the closed form priced into the passes instead (and no
    ring rows' time); the pipeline's transfers holding no compute (`Costs.transfers_hold_products`: a hold costs
    nothing while a device waits for its ring's rows, which the closed form does not)."""
    estimated = estimate_profile(counted, H100, parallel)
    scenario = profile_scenario(estimated, "adam")
    schedule = scenario.build("1f1b", ScheduleParams(2, 4))
    costs, cluster = replace(scenario.costs(schedule), transfers_hold_products=False), scenario.links(schedule)
    if not rings:
        return summarize(simulate(schedule, costs, cluster)).makespan_ms, 0.0
    bounds = [stage.layers[0] for stage in estimated.stages] + [estimated.stages[-1].layers[1]]
    forward, backward = (_closed_form_ms(counted, parallel, name, bounds) for name in ("fwd", "bwd"))
    folded = replace(costs, stages=tuple(
        replace(c, fwd_ms=c.fwd_ms + f, bwd_ms=c.bwd_ms + b, igrad_ms=c.igrad_ms + b, ring_fwd_ms=0.0,
                ring_bwd_ms=0.0, ring_fwd_hidden_ms=0.0, ring_bwd_hidden_ms=0.0)
        for c, f, b in zip(costs.stages, forward, backward)))
    rows, closed = (summarize(simulate(schedule, each, cluster)).makespan_ms for each in (costs, folded))
    return rows, closed


@pytest.mark.parametrize("parallel", [Parallelism(tensor=4, context=4, pipeline=2), Parallelism(context=2, pipeline=2)])
def test_the_rows_give_the_closed_forms_step_time(flash_gpt, parallel):
    """The rows' exchanges less what the blocks cover, run on a free network stream after the pass, take the step
    what the attention priced them at before: C = 4 beside t = 4 spans two nodes of 8 (the ring's steps on the
    network, each outlasting its block in this small model), C = 2 on NVLink (the blocks cover every step; the
    backward's last dK/dV exchange, after the last block, stays exposed)."""
    rows, closed = _makespans(flash_gpt, parallel)
    assert rows == pytest.approx(closed, abs=1e-8)  # whole picoseconds: the rows round each part, a pass their sum
    plain = Parallelism(tensor=parallel.tensor, pipeline=2)
    assert closed > _makespans(flash_gpt, plain, rings=False)[0]  # the rings cost something either way


def test_the_passes_hold_the_rings_buffers_as_communication(flash_gpt):
    estimated = estimate_profile(flash_gpt, H100, Parallelism(context=4))
    block = estimated.layers[1]
    heads, queries, head_size = 2 * 8, 256 // 4, 192 // 8  # batch x heads (no grouped-query), the rank's queries
    keys_values = 2 * heads * queries * head_size
    merged = {"fwd": 4 * heads * queries * head_size * 4, "bwd": 2 * heads * queries * head_size * 4}  # float32
    backward = 3 * keys_values * 2 + 3 * keys_values * 4 + merged["bwd"]
    assert block.ring_buffer_bytes == {"fwd": 3 * keys_values * 2 + merged["fwd"], "bwd": backward, "igrad": backward}
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, ring_buffer_bytes={"fwd": 1000, "bwd": 5000}),))
    trace = simulate(cp("gpipe", stages=1, microbatches=1), costs, Cluster(1))
    assert trace.meta.peak_memory_parts[0]["communication"] == 5000


def test_a_what_if_with_context_parallelism_runs_the_estimated_rings_as_rows():
    args = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len",
            "1024", "--attention", "flash", "-p", "2", "-m", "4", "-s", "1f1b", "--tensor-parallel", "4")
    result = simulate_json(*args, "--context-parallel", "4")[0]
    assert result["exposed_comm_ms"] > simulate_json(*args)[0]["exposed_comm_ms"]


def test_a_grouped_query_kernel_sends_and_buffers_its_fewer_key_value_heads():
    ring = ContextRing(4, placement_links(H100, Parallelism(context=4)).context)
    op = OpCount("_flash_attention_forward", "attention", (16, 64, 256, 32), 1, 1, 1)
    grouped = replace(op, kv_group=4)
    merged = 4 * 16 * 64 * 32 * 4  # the queries' float32 merge: as many queries either way
    keys_values = 3 * (2 * 16 * 64 * 32) * 2
    assert (ring.buffer_bytes(grouped, 2) - merged) * 4 == ring.buffer_bytes(op, 2) - merged == keys_values
    assert ring.step_bytes(grouped, 2)[0][0] * 4 == ring.step_bytes(op, 2)[0][0]


@pytest.mark.parametrize("shared_link", [False, True])
@pytest.mark.parametrize("degree", [dict(context_parallel=2), dict(expert_parallel=2)])
def test_an_output_sent_after_the_passs_collectives_arrives_its_transfer_after_them_and_is_waited_for(shared_link,
                                                                                                      degree):
    """Two stages, 1F1B, 4 micro-batches: each forward 1 ms and its ring (all-to-alls) 0.5 exposed, each transfer
    0.3 ms. Device 0 sends its second forward's output at 3.0, once the ring has ended; it arrives at 3.3. Its
    first backward waits for its gradient, which device 1 sends at 5.8 after its own ring: it starts at 6.1 on a
    link of its own or on one the transfers queue on (a waiting send's clock was set before its arrival was found,
    so a receive read no arrival and its backward started early; with nothing shared, its arrival left out the
    transfer)."""
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, output_bytes=1, ring_fwd_ms=0.5, ring_bwd_ms=0.5,
                              all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=0.5),) * 2)
    cluster = Cluster.uniform(2, 0.3)
    if shared_link:
        cluster = replace(cluster, default_link=Link(0.3, 1e12, "the link"))
    schedule = build_schedule("1f1b", ScheduleParams(stages=2, microbatches=4, **degree))
    trace = simulate(schedule, costs, cluster)
    ops = trace.ops
    device0 = [(trace.kinds[k], round(start / 1e3, 6), round((start + dur) / 1e3, 6))
               for k, d, start, dur in zip(ops.kind, ops.device, ops.start_us, ops.dur_us) if d == 0]
    assert [row for row in device0 if row[0] in ("SEND_F", "RECV_B", "B")][1:4] == [
        ("SEND_F", 3.0, 3.3), ("RECV_B", 5.8, 6.1), ("B", 6.1, 8.1)]


def test_the_blocks_are_merged_by_transformer_engines_elementwise_passes_over_the_ranks_tensors():
    """C = 2, a rank's 4,096 queries of 32 heads of 128 and 8 key/value heads in bf16: the forward's key/value copy
    into the send buffer, the output zeroed and each step's block added in (3 passes of the output), and its softmax
    statistics' 4 kernels (cloned, widened, the second step's joined, narrowed: TransformerEngine 1.10); the
    backward's key/value copy and, each step, the key/value gradients joined and added (5 passes) and the query
    gradient added (3), and the statistics' second half copied; each pass a kernel at the memory's rate, the
    statistics' bytes left out."""
    device = H100_BF16
    ring = ContextRing(2, placement_links(H100, Parallelism(context=2)).context)
    forward = replace(OpCount("_flash_attention_forward", "attention", (32, 4096, 4096, 128), 1, 1, 1), kv_group=4)
    backward = replace(forward, op="_flash_attention_backward")
    queries, keys_values = 32 * 4096 * 128 * 2, 2 * 8 * 4096 * 128 * 2
    overhead_ms, rate = H100.curve.kernel_overhead_ms, device.memory_bytes_per_ms
    assert ring.merge_ms(forward, device, 2) == pytest.approx(
        8 * overhead_ms + (2 * keys_values + queries + 2 * 3 * queries) / rate)
    assert ring.merge_ms(backward, device, 2) == pytest.approx(
        8 * overhead_ms + (2 * keys_values + 2 * (5 * keys_values + 3 * queries)) / rate)


def test_transformer_engines_ring_copies_the_value_and_no_half_its_unmasked_steps_take():
    """p2p, a rank's 4,096 queries of 32 heads of 128 and 8 key/value heads in bf16 (keys and values 16,777,216 B):
    the forward copies v (8,388,608 B read and written), one kernel; the halves its unmasked steps take are sbhd's
    contiguous slices (`q[1]`, `kv[0]`, `out[1]`, `dout[1]`), so neither pass copies them, at C = 2 or 4 (8 of 64
    heads, 1,024 queries: v 1,048,576 B). torch's rings copy nothing."""
    device = H100_BF16
    overhead_ms, rate = H100.curve.kernel_overhead_ms, device.memory_bytes_per_ms
    link = placement_links(H100, Parallelism(context=2)).context
    forward = replace(OpCount("_flash_attention_forward", "attention", (32, 4096, 4096, 128), 1, 1, 1), kv_group=4)
    backward = replace(forward, op="_flash_attention_backward")
    ring = ContextRing(2, link, "p2p")
    assert ring.copies_ms(forward, device, 2) == pytest.approx(overhead_ms + 16_777_216 / rate)
    assert ring.copies_ms(backward, device, 2) == 0.0
    mha = OpCount("_flash_attention_forward", "attention", (8, 1024, 1024, 64), 1, 1, 1)
    assert ContextRing(4, link, "p2p").copies_ms(mha, device, 2) == pytest.approx(overhead_ms + 2_097_152 / rate)
    assert ContextRing(4, link, "p2p").copies_ms(replace(mha, op="_flash_attention_backward"), device, 2) == 0.0
    assert ContextRing(2, link, "alltoall").copies_ms(forward, device, 2) == 0.0
    assert ContextRing(2, link, "allgather").copies_ms(backward, device, 2) == 0.0


@pytest.mark.parametrize("part, rotate", [("merge_ms", "alltoall"), ("copies_ms", "p2p")])
def test_an_estimated_passs_attention_is_its_blocks_their_merges_and_copies(flash_gpt, monkeypatch, part, rotate):
    from pipesim.planning.estimate import estimate_layer

    parallel = Parallelism(context=2, cp_rotate=rotate)
    links = placement_links(H100, parallel)
    layer = flash_gpt.layers[1]
    whole = estimate_layer(layer, H100_BF16, parallel, links.tensor, 2, links.context)
    ring = ContextRing(2, links.context, rotate)
    added = {name: sum(op.count * getattr(ring, part)(_Split.of(layer, parallel).attention(op), H100_BF16, 2)
                       for op in layer.ops[name] if op.kind == "attention") for name in ("fwd", "bwd")}
    assert added["fwd"] > 0 and (added["bwd"] > 0) == (part == "merge_ms")  # the backward copies nothing
    monkeypatch.setattr(ContextRing, part, lambda ring, op, device, element_bytes: 0.0)
    without = estimate_layer(layer, H100_BF16, parallel, links.tensor, 2, links.context)
    assert whole.fwd_ms - without.fwd_ms == pytest.approx(added["fwd"])
    assert whole.bwd_ms - without.bwd_ms == pytest.approx(added["bwd"])


def _ring_layer(transient: int, ring: dict[str, int], inputs: tuple[int, ...] = (-1,), saved: int = 0):
    """A layer profile of `transient` bytes in each pass, its ring's buffers `ring`, fed by `inputs`, saving
    `saved` bytes."""
    from pipesim.profiles.schema import LayerProfile, Timing

    timing = Timing(median_ms=1.0, spread_ms=0.0, repeats=1)
    return LayerProfile(name="l", inputs=list(inputs), fwd=timing, bwd=timing, igrad=timing, wgrad=timing,
                        activation_bytes=saved, shared_with_previous_bytes=0, output_bytes=0, param_bytes=0,
                        grad_bytes=0, optimizer_state_bytes={"adam": 0},
                        transient_bytes=dict.fromkeys(("fwd", "bwd", "igrad", "wgrad"), transient),
                        ring_buffer_bytes=ring)


def test_a_layers_ring_buffers_are_held_beside_its_own_transient_not_another_layers_peak():
    """A stage of an attention layer (transient 30, its ring's buffers 20 in each pass) and a loss (transient
    100, no ring), nothing saved: the ring runs while the attention does, 50 then, under the loss's 100, so it adds
    nothing to the stage's peak (it added its 20 beside the loss's); with the loss's transient 40 it adds 10. The
    stage is fed by the batch alone: its weight pass runs the backward, ring and all, its input pass nothing."""
    from pipesim.profiles.schema import stage_ring_buffer_bytes

    attention = _ring_layer(30, {"fwd": 20, "bwd": 20, "igrad": 20})
    for loss, added in ((100, 0), (40, 10)):
        layers = [attention, _ring_layer(loss, {})]
        assert stage_ring_buffer_bytes(layers, 0, 2) == dict.fromkeys(("fwd", "bwd", "wgrad"), added)


def test_a_stages_ring_is_held_in_the_passes_its_transient_is_and_freed_as_they_free():
    """One rule for a pass's transient and its ring (`stage_passes`): an attention layer (transient 30, ring 20 in
    every pass) before a loss saving 15 (transient 20). Its forward and full backward free as they go, the
    attention's 50 less the loss's 15 over the loss's 20: 15 added; a split backward frees nothing, 50 over 30: 20
    added, in the input pass and in the weight pass alike (before: the weight pass freed as the backward does, 15).
    Fed by the batch alone (stage 0), its empty input pass holds no ring (before: 20) and its weight pass, the whole
    backward, the backward's (before: none)."""
    from pipesim.profiles.schema import stage_ring_buffer_bytes, stage_transient_bytes

    ring = dict.fromkeys(("fwd", "bwd", "igrad", "wgrad"), 20)
    later = [_ring_layer(0, {}), _ring_layer(30, ring, inputs=(0,)), _ring_layer(20, {}, inputs=(1,), saved=15)]
    assert stage_ring_buffer_bytes(later, 1, 3) == {"fwd": 15, "bwd": 15, "igrad": 20, "wgrad": 20}
    assert stage_transient_bytes(later, 1, 3) == {"fwd": 20, "bwd": 20, "igrad": 30, "wgrad": 30}
    first = [_ring_layer(30, {"fwd": 20, "bwd": 20, "igrad": 20}), _ring_layer(20, {}, inputs=(0,), saved=15)]
    assert stage_ring_buffer_bytes(first, 0, 2) == {"fwd": 15, "bwd": 15, "wgrad": 15}
    assert stage_transient_bytes(first, 0, 2) == {"fwd": 20, "bwd": 20, "igrad": 0, "wgrad": 20}
