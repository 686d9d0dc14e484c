"""A pass's all-to-alls and its context ring: the device's next row waits for the whole run (schedules/lowering.py
`Lowered.awaits_first`..`awaits`), on whatever lanes its rows run (sim/engine.py `_joins`). The ring runs on a lane
of its own where an estimate puts it on NVLink (`Costs.collective_links`), beside the all-to-alls on the device's
network; when the next row waited for the run's last row alone, the ring, the run's last, ended first and the next
pass ran under the all-to-alls: Qwen3-30B-A3B at C = 2, E = 4 stepped in 2,465 ms against 6,659 at C = 1 on half the
GPUs."""

import json

import pytest

from pipesim.schedules import Kind, ScheduleParams, build_schedule, lower
from pipesim.schedules.table import KIND_CODE
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import Costs, StageCosts
from pipesim.sim.engine import simulate
from tests.conftest import pipesim

MOE_CP = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 1024,
          "--vocab", 1000, "--experts", 4, "--attention", "flash", "--context-parallel", 2, "--expert-parallel", 2,
          "--data-parallel", 4, "-p", 2, "-m", 4, "-s", "1f1b")


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("trace") / "t.json"
    code, _, err = pipesim("simulate", *MOE_CP, "--trace", path)
    assert code == 0, err
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_the_pass_after_an_all_to_all_waits_for_it_beside_a_context_ring(events):
    kinds = {e.get("cat") for e in events}
    assert {"A2A_F", "A2A_B", "RING_F", "RING_B"} <= kinds  # both runs are rows of the order
    for device in {e["pid"] for e in events}:
        passes = sorted(e["ts"] for e in events if e["pid"] == device and e.get("cat") in ("F", "B", "I", "W"))
        for a2a in (e for e in events if e["pid"] == device and e.get("cat", "").startswith("A2A")):
            following = [start for start in passes if start >= a2a["ts"]]
            assert not following or following[0] >= a2a["ts"] + a2a["dur"] - 1e-6, (device, a2a["name"])


def test_the_ring_runs_on_its_own_link_beside_the_passs_all_to_alls(events):
    """Its replicas' collectives cross nodes, the ring fits one: it begins with its pass's all-to-all, not after."""
    a2a = {(e["pid"], e["name"].replace("A2A", "")): e["ts"] for e in events if e.get("cat", "").startswith("A2A")}
    rings = [e for e in events if e.get("cat", "").startswith("RING")]
    assert rings and all(a2a[e["pid"], e["name"].replace("RING", "")] == e["ts"] for e in rings)


def test_the_row_after_a_pass_awaits_its_all_to_all_and_its_ring():
    lowered = lower(build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2, context_parallel=2,
                                                          expert_parallel=2)))
    kind = lowered.table.kind
    a2a = int(kind.tolist().index(KIND_CODE[Kind.A2A_F]))
    assert kind[a2a + 1] == KIND_CODE[Kind.RING_F] and kind[a2a + 2] == KIND_CODE[Kind.SEND_F]
    assert (lowered.awaits_first[a2a + 2], lowered.awaits[a2a + 2]) == (a2a, a2a + 1)


@pytest.mark.parametrize(("ring_ms", "links", "backward_at"), [
    (0.75, {}, 2.25),  # one lane: the ring after the all-to-all
    (0.75, dict.fromkeys(("RING_F", "RING_B"), "nvlink"), 1.75),  # side by side, the ring ends last
    (0.25, dict.fromkeys(("RING_F", "RING_B"), "nvlink"), 1.5),  # the all-to-all ends last
])
def test_the_next_row_waits_for_the_last_to_end_of_a_runs_lanes(ring_ms, links, backward_at):
    """One stage, one micro-batch: F 1 ms, its all-to-all 0.5 on the device's network, its ring on the same or on a
    link of its own; the backward begins when both have ended."""
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, ring_fwd_ms=ring_ms),),
                  collective_links=links)
    schedule = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=1, context_parallel=2, expert_parallel=2))
    trace = simulate(schedule, costs, Cluster(1))
    starts = {trace.kinds[k]: start / 1e3 for k, start in zip(trace.ops.kind, trace.ops.start_us)}
    assert starts["B"] == pytest.approx(backward_at)
