"""The command line as users and scripts call it."""

import json
import os
import subprocess
import sys

import pytest

from pipesim.schedules import METHODS
from tests.conftest import pipesim, simulate_json


def test_issue_example_json():
    code, out, _ = pipesim("simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8",
                           "--fwd", "1", "--bwd", "2", "--json")
    assert code == 0
    (result,) = json.loads(out)["results"]
    assert result["makespan_ms"] == 33
    assert result["bubble_fraction"] == pytest.approx(3 / 11)
    device = result["devices"][0]
    assert {"device", "busy_ms", "peak_memory_mb", "peak_activations", "peak_weight_versions"} <= set(device)
    stage = result["stages"][0]
    assert {"stage", "forward_staleness", "backward_staleness", "prediction_distance",
            "backward_prediction_distance"} <= set(stage)


def test_several_schedules_table_and_outputs(tmp_path):
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "pipedream", "-p", "3", "-m", "6", "-n", "4",
                           "--fwd", "1,1.5,1", "--comm", "0.1", "--trace", str(tmp_path / "t.json"),
                           "--html", str(tmp_path / "t.html"))
    assert code == 0
    assert "1f1b" in out and "pipedream" in out
    assert (tmp_path / "t-1f1b.json").exists() and (tmp_path / "t-pipedream.json").exists()
    assert (tmp_path / "t.html").stat().st_size > 1_000_000  # plotly.js is embedded: works offline


def test_no_arguments_runs_the_built_in_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = pipesim("simulate")
    assert code == 0
    for name in METHODS:  # the seeds' methods and their rivals in one table
        assert f"\n {name} " in out
    assert (tmp_path / "pipesim-example.html").exists()


def test_schedules_lists_methods():
    code, out, _ = pipesim("schedules")
    assert code == 0
    assert "gpipe" in out and "pipedream" in out and "1f1b" in out


@pytest.mark.parametrize("args,fragment", [
    (["--schedule", "nope"], "unknown 'nope'"),
    (["--stages", "0"], "--stages"),
    (["--microbatches", "0"], "--microbatches"),
    (["--stages", "four"], "--stages"),
    (["--fwd", "1,2,3"], "--fwd: 3 values given"),
    (["--bwd", "fast"], "--bwd: expected a number"),
    (["--fwd", "-1"], "--fwd: values must be finite and >= 0"),
    (["--comm", "nan"], "--comm: values must be finite"),
    (["--param-mb", "1,2"], "--param-mb"),
    (["--optimizer", "lion"], "--optimizer: choose from"),
    (["--wgrad-fraction", "2"], "--wgrad-fraction"),
    (["--chunks", "2", "-s", "gpipe"], "gpipe places one model stage per device"),
    (["--cluster", "/no/such/cluster.json"], "cannot read cluster file"),
    (["--html", "/no/such/dir/x.html"], "--html: cannot write"),
    (["--trace", "/no/such/dir/x.json"], "--trace: cannot write"),
    (["--frobnicate"], "No such option"),
    (["-s", "interleaved-1f1b", "-m", "6"], "multiple of stages"),
    (["-s", "zb-v", "--chunks", "3"], "chunks must be 2"),
    (["-s", "1f1b", "--pipelines", "2"], "pipelines must be 1"),
    (["-s", "1f1b", "--advance", "2"], "--advance applies to avgpipe only"),
    (["-s", "avgpipe", "--elastic-alpha", "0"], "--elastic-alpha"),
    (["-s", "graphpipe", "--graph", "/no/such/graph.json"], "--graph: graph file /no/such/graph.json: cannot read"),
    (["-s", "pipedream-2bw", "-p", "8", "-m", "4"], "m >= p-1"),
    (["-s", "1f1b", "-p", "64", "-m", "100000"], "pipesim simulates up to 10,000,000"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    code, out, err = pipesim("simulate", *args)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err and err.strip().count("\n") == 0


def test_malformed_cluster_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"devices": 2}')
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and "needs 4 devices, the cluster has 2" in err
    path.write_text("[1, 2")
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and "not valid JSON" in err


def test_nothing_half_written_when_one_output_is_bad(tmp_path):
    code, _, _ = pipesim("simulate", "-s", "1f1b", "--trace", str(tmp_path / "t.json"),
                         "--html", str(tmp_path / "missing" / "t.html"))
    assert code == 2
    assert os.listdir(tmp_path) == []


def test_console_script_starts_without_torch():
    probe = ("import sys; from pipesim.cli import main\n"
             "try:\n    main(['simulate', '-s', '1f1b', '--json'])\n"
             "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
             "assert 'torch' not in sys.modules and 'plotly' not in sys.modules, 'heavy import at start-up'")
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)


def test_method_defaults_and_avgpipe_options():
    zbv, avg, plain = simulate_json("-s", "zb-v", "-s", "avgpipe", "-s", "1f1b")
    assert len(zbv["stages"]) == 8  # two chunks per device by default
    assert max(d["peak_weight_versions"] for d in avg["devices"]) == 2  # the reference model
    (three,) = simulate_json("-s", "avgpipe", "--pipelines", "3", "--advance", "0")
    assert three["peak_memory_mb"] > avg["peak_memory_mb"]
    assert three["time_per_minibatch_ms"] > avg["time_per_minibatch_ms"]  # three pipelines share the devices


def test_graph_file(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"stages": 5, "edges": [[0, 1], [0, 2], [0, 3], [1, 4], [2, 4], [3, 4]]}))
    (result,) = simulate_json("-s", "graphpipe", "--graph", path, "--fwd", "1", "--bwd", "2", "-m", "8")
    assert result["makespan_ms"] == pytest.approx((8 + 3 - 1) * 3)  # three branches side by side: depth 3
    path.write_text(json.dumps({"stages": 2, "edges": [[0, 1], [1, 0]]}))
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", str(path))
    assert code == 2 and "cycle" in err
