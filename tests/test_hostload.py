"""The host's load while something was measured (traces/hostload.py): a cached host term taken under another
load is measured again, the profile and a run's trace record their load and ranks, and `compare` names what
differs between them (tests/test_contention.py calibrates under two loads). The load is read through
`read_load_1min`, set here: no test reads the machine's."""

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pipesim.traces import hostload
from pipesim.traces.hostload import HostLoad, loads_differ, ranks_per_host
from tests.conftest import pipesim

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "traces" / "measured" / "fidelity-cpu2-day3-runs"  # recorded before loads were


def load_is(monkeypatch, load: float | None) -> None:
    monkeypatch.setattr(hostload, "read_load_1min", lambda: load)
    monkeypatch.setattr(hostload, "usable_cpus", lambda: 2)


def test_others_load_leaves_out_what_the_measurement_itself_added():
    # 2 busy tasks for 60 s add at most 2 (1 - 1/e) = 1.26 to the 1-minute average
    load = HostLoad(before=0.5, after=2.0, seconds=60.0, cpus=2, own_tasks=2, began_at="2026-11-29T03:00:00+00:00")
    assert load.others == pytest.approx((0.5 + 2.0 - 2 * (1 - 2.718281828 ** -1)) / 2, abs=1e-6)
    assert load.per_core == pytest.approx(load.others / 2)
    assert "on 2 cores" in load.describe()
    assert HostLoad.from_dict(load.to_dict()) == load
    assert HostLoad.from_dict(None) is None and HostLoad.from_dict({"cpus": 2}) is None
    assert HostLoad.from_dict({**load.to_dict(), "before": "4.6"}) is None  # a hand-edited file: not recorded
    assert HostLoad.from_dict({**load.to_dict(), "cpus": 0}) is None
    unknown = HostLoad(None, None, 1.0, 2, 0, load.began_at)
    assert unknown.others is None and "unknown" in unknown.describe()
    assert not loads_differ(unknown, load) and not loads_differ(None, load)
    busy = HostLoad(4.6, 4.6, 0.0, 2, 0, load.began_at)
    quiet = HostLoad(0.2, 0.2, 0.0, 2, 0, load.began_at)
    assert loads_differ(busy, quiet) and not loads_differ(quiet, HostLoad(0.6, 0.6, 0.0, 2, 0, load.began_at))
    assert ranks_per_host({"ranks": 4, "compute": ["a/cpu", "b/cpu", "a/cpu", "a/cpu"]}) == 3
    assert ranks_per_host({"ranks": 4}) == 4 and ranks_per_host(None) is None


def test_a_term_cached_under_high_load_is_measured_again_when_the_load_is_low(tmp_path, monkeypatch):
    from pipesim.calibrate.cache import MAX_AGE_S, HostCache

    measured = []

    def measure():
        measured.append(len(measured) + 1)
        return {"ms": measured[-1]}

    def get():
        return HostCache(tmp_path).get("links", {"sizes": [4096]}, measure, 2)

    load_is(monkeypatch, 4.6)  # busy: 2.3 per core
    busy = get()
    assert busy.fresh and busy.load.per_core == pytest.approx(2.3, abs=0.01)
    assert busy.meta()["load"]["before"] == 4.6 and busy.meta()["measured_because"] == "none was cached"
    again = get()  # the same load: reused, and it says under what load it was measured
    assert not again.fresh and again.value == {"ms": 1} and "at load 4.60 on 2 cores" in again.describe()
    load_is(monkeypatch, 0.2)  # quiet
    quiet = get()
    assert quiet.fresh and quiet.value == {"ms": 2} and quiet.load.per_core == pytest.approx(0.1)
    assert "the cached one was measured at load 4.60 on 2 cores (2.30 per core), the host's is 0.10 per core now" \
        in quiet.describe()
    assert not get().fresh  # the quiet one kept
    # an entry older than MAX_AGE_S is measured again, whatever its load
    (entry,) = tmp_path.glob("links-*.json")
    doc = json.loads(entry.read_text())
    doc["measured_at"] = (datetime.now(timezone.utc) - timedelta(seconds=MAX_AGE_S + 60)).isoformat()
    entry.write_text(json.dumps(doc))
    old = get()
    assert old.fresh and "old, kept 1 d at most" in old.describe()
    # an entry from before loads were recorded is measured again
    doc = json.loads(entry.read_text())
    del doc["load"]
    entry.write_text(json.dumps(doc))
    unrecorded = get()
    assert unrecorded.fresh and "does not say the host's load" in unrecorded.describe()
    # where the platform keeps no load average nothing tells two loads apart: reused, the load said unknown
    load_is(monkeypatch, None)
    entry.unlink()
    assert get().fresh
    unknown = get()
    assert not unknown.fresh and "at load unknown (this platform keeps no load average)" in unknown.describe()


def test_a_run_records_its_load_and_ranks(tmp_path, monkeypatch):
    from pipesim.traces import read_trace

    load_is(monkeypatch, 1.5)
    trace = tmp_path / "run.json"
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--layers", 2, "--width", 16, "-b", 2, "-m", 2,
                           "-n", 2, "--trace", trace)
    assert code == 0, err
    meta = read_trace(trace).meta
    load = HostLoad.from_dict(meta.extra["host_load"])
    assert (load.before, load.after, load.own_tasks, load.cpus) == (1.5, 1.5, 2, 2) and meta.hardware["ranks"] == 2
    assert time.time() - datetime.fromisoformat(load.began_at).timestamp() < 600


def _recorded(tmp_path: Path, name: str, run_load: float | None, calibrated_load: float | None,
              contention_load: float | None = None) -> Path:
    """The committed 1F1B run with its profile (recorded before loads were), the loads given written in."""
    doc = json.loads((RUNS / "1f1b.json").read_text())
    profile = json.loads((RUNS / "mlp-profile.json").read_text())
    began = "2026-11-25T20:30:00+00:00"

    def load(value: float) -> dict:
        return HostLoad(value, value, 5.0, 2, 0, began).to_dict()

    if calibrated_load is not None:
        profile["environment"].update(load=load(calibrated_load), ranks=2)
    if contention_load is not None:
        profile["link"]["meta"]["host_cache"] = {"measured_at": "2026-11-25T19:30:00+00:00", "age_s": 2760.0,
                                                 "reused": True, "load": load(contention_load)}
    extra = doc["pipesim"]["meta"]["extra"]
    extra["profile"] = profile
    if run_load is not None:
        extra["host_load"] = HostLoad(run_load, run_load, 10.0, 2, 0, began).to_dict()
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_compare_names_the_conditions_that_differ_beside_the_error(tmp_path):
    code, out, err = pipesim("compare", _recorded(tmp_path, "busy.json", run_load=4.6, calibrated_load=0.2,
                                                  contention_load=4.4))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "conditions: calibrated 14 min before the run" in flat
    assert ("host load: load 0.20 on 2 cores (0.10 per core) while calibrating; load 4.60 on 2 cores (2.30 per "
            "core) while running (differs)") in flat
    assert "ranks: calibrated for 2 computing at once; ran 2 on one host link" in flat  # not marked: the next line
    assert "link and all-reduce: from the host cache, measured 1 h before the run at load 4.40 on 2 cores" in flat
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "the host's load differed: 0.10 per core while calibrating, 2.30 while running" \
        in warnings[0]
    assert "the host was busy (2.30 per core while running: at least 1 per core" in warnings[1]
    code, out, err = pipesim("compare", _recorded(tmp_path, "same.json", run_load=0.3, calibrated_load=0.2,
                                                  contention_load=4.4), "--json")
    assert code == 0, err
    found = json.loads(out)["conditions"]
    assert not found["load_differs"] and found["host_terms"][0]["load_differs"] and found["run_ranks"] == 2
    assert err.count("warning:") == 1 and "link and all-reduce came from the host cache, measured at 2.20" in err


def test_compare_says_more_ranks_than_calibrated_for(tmp_path):
    from dataclasses import replace

    from pipesim.planning.replay import predict_measured
    from pipesim.traces import read_trace
    from pipesim.traces.compare import compare

    measured = read_trace(_recorded(tmp_path, "dp.json", run_load=0.2, calibrated_load=0.2))
    predicted = predict_measured(measured.meta)

    def ran_on(*places: str):
        hardware = {**measured.meta.hardware, "ranks": len(places), "compute": list(places)}
        return compare(predicted, replace(measured, meta=replace(measured.meta, hardware=hardware)))

    found = ran_on(*["vm/cpu"] * 4)  # say, two data-parallel replicas of the 2-stage pipeline on one host
    assert found.conditions.ranks_differ and (found.conditions.calibrated_ranks, found.conditions.run_ranks) == (2, 4)
    assert any("the run had 4 ranks" in w and "--ranks 4" in w for w in found.warnings)
    spread = ran_on("a/cpu", "a/cpu", "b/cpu", "b/cpu")  # two per host: as calibrated
    assert spread.conditions.run_ranks == 2 and not spread.conditions.ranks_differ
    assert not any("ranks" in w for w in spread.warnings)


def test_files_from_before_loads_were_recorded_still_compare_and_say_so(tmp_path):
    code, out, err = pipesim("compare", _recorded(tmp_path, "old.json", run_load=None, calibrated_load=None))
    assert code == 0, err
    assert "conditions: calibrated when not recorded" in out
    assert "host load: not recorded while calibrating; not recorded while running" in out
    assert "ranks: calibrated for not recorded computing at once; ran 2 on one host" in out
    assert "warning" not in err
    from pipesim.profiles.schema import load_profile

    for path in (*(ROOT / "traces" / "profiles").glob("*.json"), RUNS / "mlp-profile.json"):
        assert load_profile(path).environment.load is None
