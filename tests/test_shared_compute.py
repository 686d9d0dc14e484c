"""Ranks that share one GPU: devices naming one compute resource run their compute rows one at a time,
first come first served, and share its memory."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, ClusterError, Costs, load_cluster, simulate
from pipesim.traces import Stream, read_trace, summarize, write_trace
from pipesim.traces.metrics import mib_text
from pipesim.units import GIB, MIB
from tests.conftest import build, pipesim


def shared(cluster: Cluster, *compute: str | None) -> Cluster:
    return replace(cluster, compute=compute)


def compute_rows(trace, devices):
    """The compute rows of `devices` in the order they took the compute resource: (start, end, ready) in µs,
    ready being when their device could have started them: its previous compute row ended and every
    transfer it received since had arrived (sends do not hold the stream)."""
    ops = trace.ops
    rows = []
    for d in devices:
        ready = 0.0
        for i in np.flatnonzero(ops.device == d):  # a simulated trace keeps each device's rows in program order
            if ops.stream[i] == Stream.RECV:
                ready = max(ready, ops.end_us[i])
            elif ops.stream[i] == Stream.COMPUTE:
                rows.append((ops.start_us[i], ops.end_us[i], ready))
                ready = ops.end_us[i]
    return sorted(rows)


@pytest.mark.parametrize("name,p,m,chunks", [
    ("gpipe", 4, 6, None), ("1f1b", 4, 8, None), ("zb-h1", 4, 8, None), ("interleaved-1f1b", 4, 8, 2),
    ("pipedream", 4, 1, None), ("avgpipe", 4, 4, None),
])
def test_ranks_on_one_compute_take_turns_first_come_first_served(name, p, m, chunks):
    schedule = build(name, p, m, 3, **({"chunks": chunks} if chunks else {}))
    rng = np.random.default_rng(7)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=rng.uniform(0.5, 2, schedule.num_stages).round(2).tolist(),
                            bwd_ms=rng.uniform(1, 3, schedule.num_stages).round(2).tolist(), opt_ms=0.25)
    trace = simulate(schedule, costs, shared(Cluster.uniform(p, 0.4), "gpu0", "gpu0", "gpu1", "gpu1"))
    for gpu in ((0, 1), (2, 3)):
        rows = compute_rows(trace, gpu)
        resource_free = 0.0
        for start, end, ready in rows:
            assert start >= resource_free - 1e-6  # one row at a time
            assert start == pytest.approx(max(ready, resource_free), abs=1e-6)  # it never idles with work waiting
            resource_free = end
        readies = [ready for _, _, ready in rows]
        assert readies == sorted(readies)  # served in the order the rows became ready
    one, two = compute_rows(trace, (1,)), compute_rows(trace, (2,))  # on different GPUs: they overlap somewhere
    assert any(b[0] < a[1] - 1e-6 and a[0] < b[1] - 1e-6 for a in one for b in two)


F, B = 1.0, 2.0


@pytest.mark.parametrize("m,f,b,comm,makespan", [
    # One micro-batch: nothing overlaps anyway. F0 on rank 0, the activation crosses, F0 B0 on rank 1, the
    # gradient crosses, B0 on rank 0: all compute plus both transfers.
    (1, F, B, 0.5, 2 * (F + B) + 2 * 0.5),
    # Two micro-batches, transfers longer than any row (f = b = 1, c = 1.5): rank 0 runs F0 F1 [0, 2f); rank 1's
    # F0 input lands at f + c (the GPU idles c − f), rank 1 runs F0 F1 B0 B1 back to back until
    # f + c + 2f + 2b; rank 0's B0 gradient lands at (f + c + 2f + b) + c (the GPU idles c − b), then B0 B1:
    # 3f + 3b + 2c.
    (2, 1.0, 1.0, 1.5, 3 * 1.0 + 3 * 1.0 + 2 * 1.5),
    # Same, backward longer than the transfer (f = 1, b = 2, c = 1.5): rank 0's B0 gradient lands while rank 1
    # runs B1, so the GPU idles only c − f once: all compute, 2m(f + b), plus c − f.
    (2, F, B, 1.5, 2 * 2 * (F + B) + 1.5 - F),
    # Transfers shorter than a row (c = 0.5 < f): one rank always has a row ready while the other's data is in
    # flight, so the GPU never idles: exactly all compute.
    (4, F, B, 0.5, 2 * 4 * (F + B)),
])
def test_gpipe_on_one_gpu_takes_all_compute_plus_the_exposed_transfers(m, f, b, comm, makespan):
    schedule = build_schedule("gpipe", ScheduleParams(2, m))
    costs = Costs.per_stage(2, fwd_ms=f, bwd_ms=b)
    summary = summarize(simulate(schedule, costs, shared(Cluster.uniform(2, comm), "gpu0", "gpu0")))
    assert summary.makespan_ms == pytest.approx(makespan)
    assert sum(d.busy_ms for d in summary.devices) == pytest.approx(2 * m * (f + b))  # waiting is not busy
    assert summary.bubble_fraction == pytest.approx(1 - 2 * m * (f + b) / (2 * makespan))


@pytest.mark.parametrize("compute", [("gpu0", "gpu1", "gpu2", "gpu3"), ("gpu0", None, None, None),
                                     ("gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu4")])
@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "xpipe"])
def test_a_cluster_without_shared_compute_gives_the_same_trace(name, compute):
    """Distinct resources, one named resource, or sharing only among devices the schedule does not use."""
    schedule = build(name, 4, 8, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=[1, 1.3, 0.8, 1.1], bwd_ms=2, opt_ms=0.2, param_mb=10,
                            activation_mb=5, output_mb=1)
    alone = Cluster.uniform(6, 0.3)
    before, after = simulate(schedule, costs, alone), simulate(schedule, costs, shared(alone, *compute))
    assert after.ops == before.ops
    assert after.counters == before.counters
    assert summarize(after) == summarize(before)


def write(tmp_path, document) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_cluster_file_names_shared_compute_and_its_memory(tmp_path):
    """The file's devices name their compute resource; a trace records it and reads back unchanged."""
    cluster = load_cluster(write(tmp_path, {"devices": [
        {"name": "r0", "compute": "gpu0", "memory_gib": 80}, {"name": "r1", "compute": "gpu0"},
        {"name": "r2"}]}))
    assert cluster.compute == ("gpu0", "gpu0", None)
    assert cluster.memory_bytes == (80 * GIB, 80 * GIB, None)  # one GPU's memory, given once
    assert cluster.compute_peers(3) == [(0, 1), (0, 1), (2,)]
    assert [d["compute"] for d in cluster.describe()["devices"]] == ["gpu0", "gpu0", None]
    assert "compute" not in load_cluster(write(tmp_path, {"devices": [{"name": "a"}]})).describe()["devices"][0]
    trace = simulate(build_schedule("1f1b", ScheduleParams(3, 4)), Costs.per_stage(3, fwd_ms=1, bwd_ms=2), cluster)
    write_trace(trace, tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json") == trace


def test_memory_of_ranks_on_one_gpu_is_checked_with_the_sum_of_their_peaks(tmp_path):
    cluster = load_cluster(write(tmp_path, {"devices": [
        {"name": "r0", "compute": "gpu0", "memory_gib": 1}, {"name": "r1", "compute": "gpu0", "memory_gib": 1},
        {"name": "r2", "memory_gib": 1}]}))
    checks = cluster.memory_checks([600 * MIB, 500 * MIB, 900 * MIB], cluster.memory_bytes)
    assert [c.used_bytes / MIB for c in checks] == [1100, 1100, 900]  # each alone fits in 1 GiB
    assert [c.out_of_memory for c in checks] == [True, True, False]
    assert checks[0].reason() == ("devices 0 and 1 share compute gpu0 and its memory: their peaks add up to "
                                  "1,100 MiB, more than its 1,024 MiB")
    assert checks[2].reason() == "device 2 peaks at 900 MiB, within its 1,024 MiB"
    unknown = Cluster.uniform(2, 0).memory_checks([600 * MIB, 500 * MIB], [None, None])
    assert not any(c.out_of_memory for c in unknown)
    assert unknown[1].reason() == "device 1 peaks at 500 MiB, its memory not known"
    small = Cluster.uniform(2, 0).memory_checks([4096, int(14.11 * MIB)], [MIB, 14 * MIB])
    assert [c.reason() for c in small] == [  # MiB as the tables write them (mib_text), where both read "0" and "14"
        "device 0 peaks at <0.01 MiB, within its 1.00 MiB", "device 1 peaks at 14.1 MiB, more than its 14.0 MiB"]


@pytest.mark.parametrize("devices,fragment", [
    ([{"name": "r0", "compute": "gpu0", "colour": "red"}],
     "devices.0.colour: unknown field; allowed: name, memory_gib, compute, host"),
    ([{"name": "r0", "compute": 0}], "devices.0.compute: Input should be a valid string"),
    ([{"name": "r0", "compute": ""}], "devices.0.compute: String should have at least 1 character"),
    ([{"name": "r0", "compute": "gpu0", "memory_gib": 80}, {"name": "r1", "compute": "gpu0", "memory_gib": 40}],
     "json: devices: r0 and r1 share compute 'gpu0', so they share its memory, but give memory_gib 80 and 40"),
])
def test_bad_shared_compute_exits_2_with_one_line(tmp_path, devices, fragment):
    path = write(tmp_path, {"devices": devices})
    with pytest.raises(ClusterError, match=fragment):
        load_cluster(path)
    code, out, err = pipesim("simulate", "-s", "gpipe", "-p", str(len(devices)), "--cluster", path)
    assert code == 2 and out == "" and fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_ranks_on_one_gpu_are_checked_against_its_memory_together(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"devices": [{"name": "r0", "compute": "gpu0", "memory_gib": 1},
                                            {"name": "r1", "compute": "gpu0"}, {"name": "r2", "memory_gib": 1}]}))
    args = ("simulate", "-s", "gpipe", "-p", 3, "-m", 2, "--param-mb", 100, "--activation-mb", 100, "--cluster", path)
    code, out, err = pipesim(*args, "--json")
    assert code == 0
    devices = json.loads(out)["results"][0]["devices"]
    peaks = [d["peak_memory_mb"] for d in devices]
    assert all(peak < 1024 for peak in peaks) and peaks[0] + peaks[1] > 1024  # each fits alone, not together
    assert [d["out_of_memory"] for d in devices] == [True, True, False]
    assert [d["memory_shared_with"] for d in devices] == [[1], [0], []]
    assert (f"devices 0 and 1 share compute gpu0 and its memory: their peaks add up to {mib_text(peaks[0] + peaks[1])} "
            "MiB, more than its 1,024 MiB") in err
    code, out, _ = pipesim(*args)
    assert code == 0 and "OOM on devices 0, 1" in out
    # --memory's limit is what each may hold beside the others on its GPU, so its red rows' peaks are over it
    code, out, _ = pipesim(*args, "--memory")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if re.match(r" (gpipe)? +[0-2] +[\d,]+ ", line)]
    limits = [float(row[-1].replace(",", "")) for row in rows]
    assert limits == [round(1024 - peaks[1]), round(1024 - peaks[0]), 1024]
    assert [peak > limit for peak, limit in zip(peaks, limits)] == [True, True, False]
    assert "less the peaks of the other ranks on it" in " ".join(out.split())
