"""The tensors passed between stages as a runtime holds them are costs (sim/costs.py `held_as_runtime`, run where
the Scenario builds the costs, and only there): each stage's receive buffers, the inputs its forward computes on
in place and what its passes keep until the update, which the engine reads as it reads any cost, with no runtime
named."""

from dataclasses import replace

from pipesim.planning.scenario import Scenario
from pipesim.sim import Costs, simulate
from pipesim.sim import costs as sim_costs
from pipesim.sim.cluster import Cluster
from pipesim.units import MIB
from tests.conftest import build, simulate_json

COSTS = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=2)


def _scenario(pp_runtime: str) -> Scenario:
    """COSTS' numbers as a Scenario's flags, held as `pp_runtime`'s runtime holds them."""
    per_stage = {"--fwd": [1.0], "--bwd": [2.0], "--param-mb": [100.0], "--activation-mb": [10.0],
                 "--output-mb": [2.0]}
    return Scenario(per_stage=per_stage, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None, avg_ms=None,
                    optimizer="adam", microbatch_size=1, comm_ms=0.0, overlap_comm=True, pp_runtime=pp_runtime)


def test_torchs_stage_is_each_stages_buffers_and_kept_bytes():
    """1F1B over 4 devices: an inner stage receives its input and its output's gradient (2 MiB each a
    micro-batch), computes on the input's buffer, keeps its output from each forward and its input's gradient from
    each backward; the first stage has no input, the last no output; pipesim's runtime: none of it."""
    schedule = build("1f1b", 4, 8)
    assert _scenario("pipesim").costs(schedule) == COSTS
    held = _scenario("torch").costs(schedule)
    assert held.kept_until_update
    assert [(c.receive_buffer_bytes, c.buffered_input_bytes, c.forward_kept_bytes, c.backward_kept_bytes)
            for c in held.stages] == [(2 * MIB, 0, 2 * MIB, 0), *[(4 * MIB, 2 * MIB, 2 * MIB, 2 * MIB)] * 2,
                                      (2 * MIB, 2 * MIB, 0, 2 * MIB)]


def test_the_engine_reads_the_fields_the_scenario_writes():
    """The engine peaks as torch's runtime holds the tensors from the fields alone: the same costs without them
    peak as pipesim's runtime."""
    schedule, cluster = build("1f1b", 4, 8, 2), Cluster.uniform(4, 0.0)
    torch = _scenario("torch").costs(schedule)
    without = replace(torch, kept_until_update=False, stages=tuple(
        replace(c, receive_buffer_bytes=0, buffered_input_bytes=0, forward_kept_bytes=0, backward_kept_bytes=0)
        for c in torch.stages))
    parts = [simulate(schedule, costs, cluster).meta.peak_memory_parts for costs in (torch, without, COSTS)]
    assert parts[0] != parts[1] == parts[2]


def test_a_torch_runtime_simulation_holds_its_tensors_once(monkeypatch):
    """`simulate --pp-runtime torch` writes each method's held tensors once, as its scenario builds the costs
    (the engine no longer writes them again as it starts): one check of the stage graph per method."""
    checked = []
    refusal = sim_costs._torch_graph_refusal
    monkeypatch.setattr(sim_costs, "_torch_graph_refusal", lambda schedule: checked.append(schedule) or
                        refusal(schedule))
    simulate_json("--schedule", "1f1b", "--schedule", "gpipe", "--param-mb", "96", "--activation-mb", "12",
                  "--output-mb", "3", "--pp-runtime", "torch")
    assert [schedule.method for schedule in checked] == ["1f1b", "gpipe"]
