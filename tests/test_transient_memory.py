"""A pass's transient tensors (created and freed within it): measured by the count on the meta device, carried by
an estimate per layer and stage, and held by the simulator while the pass's row runs, as a part of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.memory_parts import MEMORY_PARTS
from pipesim.schedules import METHODS
from pipesim.sim import Costs, simulate
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import CostError, StageCosts
from pipesim.units import MIB
from tests.conftest import build, pipesim

torch = pytest.importorskip("torch")


def _transient_bytes(tally) -> int:
    return sum(nbytes for _, nbytes in tally.transient)


def test_an_mlps_backward_holds_its_two_hidden_gradients_at_once():
    """Linear(16, 64), GELU, Linear(64, 16) in float32 over 8 rows: the forward saves both hidden tensors (nothing
    transient); the backward holds the GELU output's gradient (mm) and the GELU input's (gelu_backward) at once,
    8 x 64 x 4 bytes each, and frees both before it ends; the weights' and the input's gradients outlive it."""
    from pipesim.workload.count import _counting

    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to("meta")
    x = torch.empty(8, 16, device="meta", requires_grad=True)
    with _counting() as forward:
        y = mlp(x)
    grad = torch.ones_like(y)
    with _counting() as backward:
        grads = torch.autograd.grad(y, [x, *mlp.parameters()], grad)
    assert forward.transient == ()
    assert sorted(backward.transient) == [((8, 64), 8 * 64 * 4)] * 2
    assert len(grads) == 5


def test_the_losss_backward_holds_two_float32_tokens_by_vocabulary_tensors():
    """torch's cross entropy over b·s tokens of a V-word vocabulary, upcast to float32 as the count's GPT computes
    it (`out.float()`): its backward's nll_loss_backward and _log_softmax_backward_data each write a float32
    tokens x V tensor, live together beside the saved log-softmax: 2 x tokens x V x 4 bytes. Its forward frees the
    16-bit logits and their float32 copy (the log-softmax is what it saves)."""
    from pipesim.workload.count import count_built

    b, s, vocab, width = 2, 32, 1000, 64
    counted = count_built("gpt", {"layers": 2, "width": width, "heads": 2, "seq_len": s, "vocab": vocab}, b,
                          torch.bfloat16)
    loss = counted.layers[-1]
    assert _transient_bytes_of(loss, "bwd") == 2 * b * s * vocab * 4
    assert sorted(loss.transient_tensors["bwd"]) == [((b * s, vocab), b * s * vocab * 4)] * 2
    assert _transient_bytes_of(loss, "fwd") == b * s * vocab * (2 + 4)
    block = counted.layers[1]
    assert 0 < _transient_bytes_of(block, "bwd") < _transient_bytes_of(loss, "bwd")
    assert set(block.transient_tensors) == {"fwd", "bwd", "igrad", "wgrad"}


def _transient_bytes_of(layer, name: str) -> int:
    return sum(nbytes for _, nbytes in layer.transient_tensors[name])


def test_a_stage_holds_its_largest_layer_transient_less_what_later_layers_save():
    """A stage's forward and backward hold layer i's transient beside the activations a prediction counts whole,
    less what the layers after i save (not yet saved, or freed already); the split backward frees nothing as it
    goes. A stage fed by the batch runs its whole backward as the weight pass."""
    from pipesim.profiles.schema import LayerProfile, Timing, stage_transient_bytes

    timing = Timing(median_ms=1.0, spread_ms=0.0, repeats=1)

    def layer(inputs: list[int], saved: int, transient: int) -> LayerProfile:
        return LayerProfile(name="l", inputs=inputs, fwd=timing, bwd=timing, igrad=timing, wgrad=timing,
                            activation_bytes=saved, shared_with_previous_bytes=0, output_bytes=0, param_bytes=0,
                            grad_bytes=0, optimizer_state_bytes={"adam": 0},
                            transient_bytes=dict.fromkeys(("fwd", "bwd", "igrad", "wgrad"), transient))

    layers = [layer([-1], 10, 5), layer([0], 10, 30), layer([1], 10, 12)]
    assert stage_transient_bytes(layers, 1, 3) == {"fwd": 20, "bwd": 20, "igrad": 30, "wgrad": 30}
    assert stage_transient_bytes(layers, 0, 3) == {"fwd": 20, "bwd": 20, "igrad": 0, "wgrad": 20}
    assert stage_transient_bytes([layers[0].model_copy(update={"transient_bytes": {}})], 0, 1) == {
        "fwd": 0, "bwd": 0, "igrad": 0, "wgrad": 0}  # a calibrated profile's layers: none known


def _with_transients(costs: Costs, transient: dict[str, int]) -> Costs:
    return replace(costs, stages=[replace(stage, transient_bytes=transient) for stage in costs.stages])


@pytest.mark.parametrize("name", list(METHODS))
def test_parts_sum_to_the_peak_with_transients_in_every_method(name):
    if name == "graphpipe":
        pytest.skip("a DAG's stages are another test's (test_memory_parts)")
    schedule = build(name, 4, 8, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, param_mb=7.3, activation_mb=1.1,
                            output_mb=0.7)
    transient = {"fwd": 3 * MIB, "bwd": 5 * MIB, "igrad": 4 * MIB, "wgrad": 2 * MIB}
    trace = simulate(schedule, _with_transients(costs, transient), Cluster.uniform(schedule.num_devices, 0.3))
    for d, parts in enumerate(trace.meta.peak_memory_parts):
        assert list(parts) == list(MEMORY_PARTS)
        assert sum(parts.values()) == int(trace.counters["memory_bytes"][d].values.max())
        assert parts["transient"] in set(transient.values())


def test_a_transient_is_held_only_while_its_row_runs():
    """1F1B on 2 devices: the backward's transient lifts each device's peak by exactly itself (a B's start is where
    it peaks), and the transient curve is nonzero only inside F and B rows."""
    schedule = build("1f1b", 2, 4, 1)
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, param_mb=10, activation_mb=4, output_mb=0)
    cluster = Cluster.uniform(2, 0.1)
    plain = simulate(schedule, costs, cluster)
    held = simulate(schedule, _with_transients(costs, {"fwd": 1 * MIB, "bwd": 3 * MIB}), cluster)
    for d in range(2):
        before = int(plain.counters["memory_bytes"][d].values.max())
        assert int(held.counters["memory_bytes"][d].values.max()) == before + 3 * MIB
        assert held.meta.peak_memory_parts[d]["transient"] == 3 * MIB
    curve = held.counters["memory_bytes.transient"][0]
    assert set(curve.values.tolist()) == {0, 1 * MIB, 3 * MIB} and curve.values[-1] == 0


def test_auto_leaves_room_for_the_transients_beside_its_activation_limit():
    """auto's search holds the activations it schedules within what a device's memory leaves beside its weights,
    gradients and state: a backward's 10 MiB transient takes that room too, so the simulated peak still fits."""
    from pipesim.planning.auto import search_schedule

    costs = _with_transients(Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=10.0, param_mb=10.0,
                                             output_mb=0.0), {"bwd": 10 * MIB, "igrad": 10 * MIB})
    memory = [(10 + 10 + 20 + 35) * MIB] * 4  # weights, gradients, Adam's two moments, and 35 MiB
    auto = search_schedule(METHODS["auto"].params(4, 8, 2, activation_limit=4.0), costs, Cluster.uniform(4, 0.0),
                           memory)
    trace = simulate(auto, costs, Cluster.uniform(4, 0.0))
    assert max(counter.values.max() for counter in trace.counters["memory_bytes"]) <= memory[0]


def test_bad_transients_are_refused_naming_the_field():
    with pytest.raises(CostError, match="transient_bytes must give whole bytes >= 0"):
        StageCosts(fwd_ms=1.0, bwd_ms=1.0, transient_bytes={"fwd": -1})
    with pytest.raises(CostError, match="transient_bytes"):
        StageCosts(fwd_ms=1.0, bwd_ms=1.0, transient_bytes={"opt": 1})


def test_an_estimate_holds_the_losss_transient_on_the_last_device(tmp_path):
    """A GPT whose head dwarfs its blocks: the last device's peak holds the loss's backward's float32 gradients
    (2 x 64 tokens x 32768 x 4 bytes = 16 MiB at b = 2, s = 32), split over t = 2 (the vocabulary's share)."""
    import json

    args = ["simulate", "--model", "gpt", "--layers", "4", "--width", "64", "--heads", "2", "--seq-len", "32",
            "--vocab", "32768", "-b", "2", "--gpu", "a100-sxm-80gb", "-p", "2", "-m", "4", "-s", "1f1b", "--json"]
    for t in (1, 2):
        code, out, err = pipesim(*args, "--tensor-parallel", str(t))
        assert code == 0, err
        last = json.loads(out)["results"][0]["devices"][-1]["peak_memory_parts_mb"]
        assert last["transient"] == pytest.approx(16 / t, rel=0.01)


def test_a_trace_recorded_before_transients_reads_them_as_none(tmp_path):
    """A trace an older pipesim wrote (its parts without transient, no transient counter) is read with a transient
    of 0 at each peak, and its page still stacks the memory of the parts it has."""
    import json

    from pipesim.traces import read_trace
    from pipesim.traces.view import stacked_memory

    path = tmp_path / "old.json"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--trace", path)
    assert code == 0, err
    written = json.loads(path.read_text())
    header = written["pipesim"]
    for held in header["meta"]["peak_memory_parts"]:
        del held["transient"]
    header["counters"] = [name for name in header["counters"] if name != "memory_bytes.transient"]
    written["traceEvents"] = [e for e in written["traceEvents"] if e.get("name") != "memory_bytes.transient"]
    path.write_text(json.dumps(written))
    trace = read_trace(path)
    assert [held["transient"] for held in trace.meta.peak_memory_parts] == [0, 0]
    stacked = stacked_memory(trace, 1e9)
    assert stacked is not None and "a pass's transient tensors" not in stacked["names"]
