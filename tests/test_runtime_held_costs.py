"""The tensors passed between stages as a runtime holds them are costs (sim/costs.py `held_as_runtime`): each
stage's receive buffers, the inputs its forward computes on in place and what its passes keep until the update,
which the engine reads as it reads any cost, with no runtime named."""

from dataclasses import replace

from pipesim.sim import Costs, simulate
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import held_as_runtime
from pipesim.units import MIB
from tests.conftest import build

COSTS = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=2)


def test_torchs_stage_is_each_stages_buffers_and_kept_bytes():
    """1F1B over 4 devices: an inner stage receives its input and its output's gradient (2 MiB each a
    micro-batch), computes on the input's buffer, keeps its output from each forward and its input's gradient from
    each backward; the first stage has no input, the last no output; pipesim's runtime: none of it."""
    schedule = build("1f1b", 4, 8)
    assert held_as_runtime(COSTS, schedule) == COSTS
    held = held_as_runtime(replace(COSTS, pp_runtime="torch"), schedule)
    assert held.kept_until_update
    assert [(c.receive_buffer_bytes, c.buffered_input_bytes, c.forward_kept_bytes, c.backward_kept_bytes)
            for c in held.stages] == [(2 * MIB, 0, 2 * MIB, 0), *[(4 * MIB, 2 * MIB, 2 * MIB, 2 * MIB)] * 2,
                                      (2 * MIB, 2 * MIB, 0, 2 * MIB)]
    assert held_as_runtime(held, schedule) == held


def test_the_engine_reads_the_fields_not_the_runtimes_name():
    """Costs that carry torch's holding as fields under pipesim's name peak as torch's runtime does."""
    schedule, cluster = build("1f1b", 4, 8, 2), Cluster.uniform(4, 0.0)
    torch = replace(COSTS, pp_runtime="torch")
    as_fields = replace(held_as_runtime(torch, schedule), pp_runtime="pipesim")
    parts = [simulate(schedule, costs, cluster).meta.peak_memory_parts for costs in (torch, as_fields, COSTS)]
    assert parts[0] == parts[1] != parts[2]
