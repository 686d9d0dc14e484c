"""Pipeline x expert parallelism in the executor: the E expert-parallel ranks of a device are E of its data-parallel
replicas, each holding 1/E of every mixture-of-experts layer's routed experts and sending each token copy to its
expert's rank and back by all-to-alls (executor/experts.py, workload/moe.py `exchanged_experts`). Trained on 4 gloo
ranks (p = 2 x E = 2), it ends with the weights, and reports the losses, of one process training the whole model on
the whole mini-batch (tests/reference.py, float64); the time each pass spent in its exchanges is recorded as the
schedule's A2A_F and A2A_B rows (`AllToAllRows`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.executor import ExecutorError, run_in_process, run_multiprocess
from pipesim.executor.experts import ExpertLayout
from pipesim.executor.replicas import Layout
from pipesim.executor.runtime import AllToAllRows
from pipesim.schedules import KINDS, Kind, lower
from pipesim.schedules.ranks import RANK_ORDERS, dense_grid, expert_grid
from pipesim.traces import read_trace
from tests.conftest import build, pipesim, pipesim_fresh
from tests.helpers import TIGHT, ep_spec
from tests.reference import single_process

# TIGHT: float64 throughout, where an expert's product over the tokens of both replicas' micro-batches at once, and
# its gradient summed over them in one product, round differently from one process's product per micro-batch


@pytest.mark.parametrize("method, m, optimizer, shape, options, order", [
    ("1f1b", 2, "sgd", {}, {}, "pipesim"),
    ("zb-h1", 4, "momentum", {}, {"capacity_factor": 0.75}, "pipesim"),  # each expert drops past 6 of 32 copies
    ("dualpipev", 4, "sgd", {}, {"layers": 4}, "pipesim"),  # overlapped F&B pairs, run part after part
    ("dualpipe", 4, "sgd", {}, {}, "pipesim"),  # two model copies: an expert's holders are both copies' ranks
    ("1f1b", 2, "sgd", {"stages": 1, "replicas": 4}, {}, "pipesim"),  # two groups: each expert averaged over 2
    # Megatron-core's numbering: a stage's replicas on ranks 0-1 and 2-3, the pipeline's transfers between the pairs
    ("dualpipe", 4, "sgd", {}, {}, "megatron"),
])
def test_pipeline_by_expert_parallel_on_four_gloo_ranks_trains_as_one_process(method, m, optimizer, shape, options,
                                                                              order):
    spec = replace(ep_spec(method, m, optimizer, **shape, **options), rank_order=order)
    replicas = spec.schedule.data_parallel
    result = run_multiprocess(spec, timeout_s=120)
    layout = Layout(spec.schedule.num_devices, replicas, order=order)
    assert result.trace.meta.extra["device_ranks"] == sorted(range(layout.ranks), key=layout.position)
    losses: list[float] = []
    want = single_process(replace(spec, schedule=build("gpipe", 2, replicas * m, 2)), losses)
    np.testing.assert_allclose(result.losses[0], losses, **TIGHT)
    graph = spec.schedule.graph
    for q, copy in itertools.product(range(replicas), range(graph.copies)):  # experts whole again: the group's
        got = [w for k in range(copy * graph.stages_per_copy, (copy + 1) * graph.stages_per_copy)  # two halves
               for w in result.replica_weights[q][(k, 0)]]
        assert [w.shape for w in got] == [w.shape for w in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TIGHT)
    ops, kinds, bounds = result.trace.ops, result.trace.kinds, result.trace.meta.extra["bounds"]
    code = {name: kinds.index(name) for name in ("F", "B", "I", "A2A_F", "A2A_B")}
    forward, backward = ops.kind == code["A2A_F"], ops.kind == code["A2A_B"]
    assert forward.sum() == (ops.kind == code["F"]).sum()
    assert backward.sum() == np.isin(ops.kind, [code["B"], code["I"]]).sum()
    blocks = range(1, spec.model_options["layers"] + 1)  # the gpt's layers: embedding, blocks, head
    moe = [k for k in range(len(bounds) - 1) if any(i in blocks for i in range(bounds[k], bounds[k + 1]))]
    # each all-to-all row of a stage with experts holds its pass's exchanges; but the first stage's input (token
    # ids) takes no gradient, so where its backward is split its I has nothing to do and its W runs the whole
    # backward, exchanges included (`AllToAllRows`)
    assert (ops.dur_us[forward & np.isin(ops.stage, moe)] > 0).all()
    assert (ops.dur_us[backward & np.isin(ops.stage, moe) & (ops.stage > 0)] > 0).all()


@dataclass
class _Clock:
    """An exchange as `AllToAllRows` reads it: the ns spent in all-to-alls so far."""

    spent_ns: int = 0


@pytest.mark.parametrize("method, chunks", [("1f1b", 1), ("dualpipev", 2)])
def test_a_pass_gives_its_exchanges_time_to_its_all_to_all_rows_and_keeps_its_span(method, chunks):
    """Each pass exchanges 10 ns of its 100; its all-to-all rows, right after it (after an overlapped pair's both
    parts), take those 10 ns each, and the rows from the pass to its last all-to-all row fill the same span."""
    lowered = lower(build(method, 2, 4, 1, chunks=chunks, data_parallel=2, expert_parallel=2))
    clock = _Clock()
    rows = AllToAllRows(lowered, 0, clock)
    now, placed = 0, {}
    for i in lowered.rows(0):
        kind = KINDS[lowered.table.kind[i]]
        took = 100 if kind in (Kind.F, Kind.B, Kind.I, Kind.W) else 0
        clock.spent_ns += 10 if kind in (Kind.F, Kind.B, Kind.I) else 0
        placed[i] = (kind, rows.place(i, now, now + took))
        now += took
    spans = sorted(span for _, span in placed.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == now  # in order, no overlap
    for kind, (start, end) in placed.values():
        assert end - start == {Kind.A2A_F: 10, Kind.A2A_B: 10, Kind.F: 90, Kind.B: 90, Kind.I: 90, Kind.W: 100}.get(
            kind, 0)
    assert sum(kind in (Kind.A2A_F, Kind.A2A_B) for kind, _ in placed.values()) == sum(
        kind in (Kind.F, Kind.B, Kind.I) for kind, _ in placed.values())


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(RANK_ORDERS), st.integers(1, 4), st.integers(0, 2), st.integers(0, 2))
def test_the_executor_numbers_its_ranks_as_the_planner_prices_them(order, p, e_power, more_power):
    """Every rank's stage and replica, its replicas' group, its pipeline's ranks and its expert-parallel group in
    the executor (`Layout`, `ExpertLayout`) are those of schedules/ranks.py's grids for the same order at t = C = 1,
    which `simulate --rank-order` prices the links of."""
    assert Layout(3, 2, order="megatron").rank(1, 1) == 3 and Layout(3, 2).rank(1, 1) == 4  # strides apart
    e = 2 ** e_power
    d = e * 2 ** more_power
    layout, dense, experts = Layout(p, d, order=order), dense_grid(order, 1, 1, p, d), expert_grid(order, 1, 1, p, d, e)
    assert sorted(map(layout.position, range(layout.ranks))) == list(range(p * d))
    for device, replica in itertools.product(range(p), range(d)):
        rank = layout.rank(device, replica)
        assert layout.place(rank) == (device, replica)
        assert layout.group(device) == dense.group(("dp",), rank)
        assert sorted(layout.rank(k, replica) for k in range(p)) == dense.group(("pp",), rank)
        assert sorted(ExpertLayout(layout, e).group(device, replica)) == experts.group(("ep",), rank)


def test_a_device_exchanges_within_groups_of_e_replicas_and_averages_experts_over_their_holders():
    experts = ExpertLayout(Layout(devices=2, replicas=4), ranks=2)
    assert experts.group(device=1, replica=2) == [5, 7] and experts.group(device=1, replica=3) == [5, 7]
    assert experts.holders(device=0, replica=1) == [2, 6] and experts.holders(device=0, replica=2) == [0, 4]


@pytest.mark.parametrize("method, m", [("gpipe", 2), ("zb-v", 4)])
def test_threads_of_one_process_exchange_in_rooms_and_train_as_one_process(method, m):
    spec = ep_spec(method, m, "momentum")
    result = run_in_process(spec)
    losses: list[float] = []
    want = single_process(replace(spec, schedule=build("gpipe", 2, 2 * m, 2)), losses)
    np.testing.assert_allclose(result.losses[0], losses, **TIGHT)
    for q in range(2):
        got = [w for k in range(spec.schedule.num_stages) for w in result.replica_weights[q][(k, 0)]]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TIGHT)


def test_a_rank_that_fails_stops_its_groups_exchanges_and_names_itself():
    with pytest.raises(ExecutorError, match=r"rank \d \(device 1, replica \d\): DivergedError"):
        run_in_process(replace(ep_spec("1f1b", 2, "sgd"), lr=1e30))


def test_the_expert_parallel_degree_must_divide_the_data_parallel_one():
    spec = replace(ep_spec("1f1b", 2, "sgd"), schedule=build("1f1b", 2, 2, 1, data_parallel=3, expert_parallel=2))
    with pytest.raises(ExecutorError, match="E must divide d"):
        run_multiprocess(spec, timeout_s=30)


@pytest.mark.parametrize("flags, says", [
    (("--model", "gpt", "--experts", 3, "--data-parallel", 2),
     "--expert-parallel 2 does not divide the model's 3 routed experts"),
    (("--model", "mlp", "--data-parallel", 2), "--expert-parallel 2, but the model has no routed experts"),
    (("--model", "gpt", "--experts", 4), "--expert-parallel 2 must divide the data-parallel degree, 1: give "
                                         "--data-parallel a multiple of 2"),
    (("--model", "gpt", "--experts", 4, "--data-parallel", 3), "--expert-parallel 2 must divide the data-parallel "
                                                               "degree, 3: give --data-parallel a multiple of 2"),
    (("--model", "gpt", "--experts", 4, "--device", "cuda"), "runs on CPU ranks (gloo) only"),
])
def test_run_refuses_experts_it_cannot_place_in_one_line(tmp_path, flags, says):
    code, out, err = pipesim("run", "-s", "1f1b", "--expert-parallel", 2, *flags, "--trace", tmp_path / "t.json")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err + out
    assert not (tmp_path / "t.json").exists()


def test_expert_parallel_of_a_dense_model_is_refused_before_torch_is_imported(tmp_path):
    """A built-in model's routed experts are its flags': `run --expert-parallel 2` of a dense mlp was refused once
    torch was imported and the model built, 26 s (4.4 CPU s), after a first refusal asking for --data-parallel 2,
    which it could not use; calibrate's, 24 s."""
    dense = "--expert-parallel 2, but the model has no routed experts to place"
    run = ("run", "-s", "1f1b", "--expert-parallel", 2, "--model")
    runs, imported = pipesim_fresh((*run, "mlp"), (*run, "gpt", "--data-parallel", 2),
                                   (*run, "gpt", "--experts", 3, "--data-parallel", 2),
                                   ("calibrate", "--model", "mlp", "--expert-parallel", 2, "--out", "p.json"),
                                   cwd=tmp_path)
    assert [(code, out, err.startswith(f"error: {dense} ")) for code, out, err in runs] == \
        [(2, "", True)] * 2 + [(2, "", False), (2, "", True)]
    assert runs[2].err == "error: --expert-parallel 2 does not divide the model's 3 routed experts; give one of 1, 3\n"
    assert "torch" not in imported and not list(tmp_path.iterdir())


def test_run_takes_the_gpts_mlp_size():
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--ffn", 8)
    assert code == 2 and "--ffn does not apply to mlp" in err


def test_a_calibrated_mixture_of_experts_runs_over_e_replicas_and_compares_row_by_row(tmp_path):
    """calibrate takes the gpt's expert flags and measures the all-to-all (its links at two sizes); `run --profile
    --expert-parallel 2` runs that model over 2 replicas of its 2-device pipeline (4 ranks); compare predicts it
    from the profile, pricing every all-to-all row on the profile's all-to-all, and matches them."""
    profile, trace = tmp_path / "p.json", tmp_path / "t.json"
    code, _, err = pipesim("calibrate", "--model", "gpt", "--layers", 2, "--width", 16, "--heads", 2, "--seq-len", 8,
                           "--vocab", 32, "--experts", 4, "--top-k", 1, "--shared-experts", 1, "--expert-ffn", 8,
                           "-b", 1, "--link-max-mb", 1 / 128, "--no-runtime", "--no-contention", "--repeats", 1,
                           "--warmup", 0,
                           "--out", profile)
    assert code == 0, err
    run = ("run", "-s", "1f1b", "--model", "gpt", "--profile", profile, "--expert-parallel", 2, "--data-parallel", 2,
           "-m", 2, "-n", 2, "--no-heldout")
    code, out, err = pipesim(*run, "--json")
    assert code == 0, err
    document = json.loads(out)
    assert (document["expert_parallel"], document["data_parallel"], document["hardware"]["ranks"]) == (2, 2, 4)
    code, out, err = pipesim(*run, "--trace", trace)
    assert code == 0 and "4 ranks (p=2, d=2, E=2)" in " ".join(out.split()), err
    assert read_trace(trace).meta.extra["model_options"]["experts"] == 4
    code, out, err = pipesim("compare", trace, "--json")
    assert code == 0, err
    compared = json.loads(out)
    ops = {kind["kind"]: kind["ops"] for kind in compared["kinds"]}
    assert ops["A2A_F"] == ops["A2A_B"] == 2 * 2 * 2  # replica 0's devices x micro-batches x mini-batches
    assert compared["missing_in_measured"] == compared["missing_in_predicted"] == 0
    predicted = {kind["kind"]: kind["predicted_ms"] for kind in compared["kinds"]}
    assert predicted["A2A_F"] > predicted["A2A_B"] > 0  # the forward's count exchange besides the same two
