"""A new user's bad input, as a walk through the README's commands met it: each refusal is one line naming the
flag and what it takes, exit 2, before any work and with nothing written."""

import csv
import re
import shlex
from types import SimpleNamespace

import pytest

from pipesim.commands import tune
from pipesim.units import GIB
from tests.conftest import pipesim, simulate_json
from tests.helpers import GPT_CPU

# about 7e9 parameters: 13 GiB of weights in bfloat16
SEVEN_B = ("--model", "gpt", "--layers", 8, "--width", 8192, "--heads", 64, "--seq-len", 128, "--vocab", 32000)


def test_tune_refuses_a_model_whose_weights_alone_overfill_the_devices_before_estimating():
    """Llama 3.1 405B on 8 H100s took a minute of estimates to say that nothing fits, and a model far larger filled
    the host's memory (17 GiB) before the search ended; the weights, which every configuration holds at least once,
    say it at once."""
    pytest.importorskip("torch")
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", *SEVEN_B, "-D", 2, "--memory-gb", 4)
    assert code == 2 and out == ""
    assert err.splitlines() == [  # nothing before it: no estimate ran
        "error: --memory-gb: no configuration fits in 4 GiB; the model's weights alone (13 GiB in bfloat16) need "
        "6.49 GiB per device over --devices 2: give at least 4 devices, or more memory each"]


def test_the_weights_refusal_suggests_no_more_devices_than_tune_takes():
    """A cap so small that the weights need more devices than --devices allows (1,000,000) suggested "give at least
    1,981,584 devices", which tune then refused: it says that no count does, and what would."""
    pytest.importorskip("torch")
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", *SEVEN_B, "-D", 2, "--memory-gb", 0.00001)
    assert code == 2 and out == ""
    assert err.rstrip().endswith("need 6.49 GiB per device over --devices 2: no --devices up to 1,000,000 holds "
                                 "them: give more memory each"), err


def test_the_weights_refusal_writes_their_share_over_the_cap():
    """A cap under the weights' share by less than its third significant digit read "no configuration fits in 6.49
    GiB; ... need 6.49 GiB per device": the cap and the share are written to the digits at which they differ."""
    pytest.importorskip("torch")
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", *SEVEN_B, "-D", 2, "--memory-gb", 6.489)
    assert code == 2 and out == ""
    assert err.startswith("error: --memory-gb: no configuration fits in 6.489 GiB; the model's weights alone (13 GiB "
                          "in bfloat16) need 6.49 GiB per device over --devices 2"), err


def test_the_weights_refusal_names_devices_where_the_cap_is_the_parts_own_memory():
    """Without --memory-gb the cap is the --gpu part's own memory: the refusal names --devices, the flag given,
    not --memory-gb."""
    pytest.importorskip("torch")
    code, out, err = pipesim("tune", "--gpu", "a100-sxm-40gb", *SEVEN_B[:2], "--layers", 28, *SEVEN_B[4:], "-D", 1)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "error: --devices 1: no configuration fits on 1 a100-sxm-40gb of 39.4 GiB; the model's weights alone (43 GiB "
        "in bfloat16) need 43 GiB per device: give at least 2 devices, or a --gpu with more memory"]


def test_the_weights_refusal_names_a_clusters_part_not_the_cluster(tmp_path):
    pytest.importorskip("torch")
    catalogue = tmp_path / "mine.toml"
    catalogue.write_text('[cluster.mine]\ngpu = "a100-sxm-40gb"\nnodes = 1\ngpus_per_node = 2\n')
    code, out, err = pipesim("tune", "--gpu", "mine", "--gpus", catalogue, *SEVEN_B[:2], "--layers", 28,
                             *SEVEN_B[4:], "-D", 1)
    assert code == 2 and out == ""
    assert err.startswith("error: --devices 1: no configuration fits on 1 a100-sxm-40gb of 39.4 GiB;"), err


def test_the_weights_floor_refuses_only_past_the_devices_whole_memory():
    counted = SimpleNamespace(total=lambda name: {"param_bytes": 8 * GIB}[name], dtype="bfloat16")
    tune._check_weights_fit(counted, 4, 2 * GIB, None)  # exactly full: some configuration may still fit
    with pytest.raises(tune.InputError, match="give at least 5 devices"):
        tune._check_weights_fit(counted, 4, 2 * GIB - 1, None)


@pytest.mark.parametrize("given, nearest", [("h10-sxm", "h100-sxm"), ("H100_SXM", "h100-sxm"),
                                            ("a100-80gb", "a100-sxm-80gb"), ("nope", None)])
def test_a_misspelt_gpu_is_answered_with_the_nearest_known_one(given, nearest):
    code, _, err = pipesim("simulate", "--gpu", given, "--model", "gpt")
    hint = f" (did you mean {nearest!r}?)" if nearest else ""
    assert code == 2 and err.startswith(f"error: --gpu: unknown {given!r}{hint}; known GPUs: a100-sxm-40gb, "), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("text", ["", "# axes to come\n"])
def test_sweep_refuses_a_grid_file_that_gives_no_axis(tmp_path, text):
    """An empty --grid swept the default grid and wrote its results, exit 0, as if the file had been read."""
    grid, out = tmp_path / "grid.toml", tmp_path / "results.csv"
    grid.write_text(text)
    code, _, err = pipesim("sweep", "--grid", grid, "--out", out)
    assert code == 2 and err == (f"error: --grid: {grid} gives no axis; give one or more of schedule, stages, "
                                 "microbatches, chunks, pipelines, cost-scale, prediction, activation-limit\n")
    assert not out.exists()


def test_gpus_refuses_a_file_that_gives_no_part(tmp_path):
    """An empty --gpus listed the built-in parts, exit 0: a file that adds nothing is the wrong file."""
    empty = tmp_path / "gpus.toml"
    empty.write_text("# parts to come\n")
    code, out, err = pipesim("gpus", "--gpus", empty)
    assert code == 2 and out == ""
    assert err == f"error: --gpus: {empty}: gives no part ([gpu.NAME]) and no cluster ([cluster.NAME])\n"


def test_sweep_marks_the_configurations_whose_peak_passes_the_gpus_memory(tmp_path):
    """A sweep on a catalogue GPU put a 1F1B at p = 2 peaking at 108 GiB on the front of an 80 GiB A100 as if it ran
    (simulate says OOM): its results file and its table now say so, as simulate's check has it."""
    pytest.importorskip("torch")
    out = tmp_path / "results.csv"
    huge = ("--model", "gpt", "--layers", 4, "--width", 16384, "--heads", 16, "--seq-len", 64, "--vocab", 128)
    code, table, err = pipesim("sweep", "--gpu", "a100-sxm-80gb", *huge, "-p", "2,4", "-s", "1f1b", "-j", 1, "--out",
                               out)  # -j 1: two configurations, in this process (a pool costs two fresh interpreters)
    assert code == 0, err
    rows = {row["stages"]: row for row in csv.DictReader(out.open())}
    assert (rows["2"]["out_of_memory"], rows["4"]["out_of_memory"]) == ("True", "False")
    assert [line.split()[-1] for line in table.splitlines() if line.startswith(" 1f1b")] == ["OOM", "fits"]
    for p in (2, 4):
        simulated = simulate_json("--gpu", "a100-sxm-80gb", *huge, "-p", p, "-s", "1f1b")[0]
        assert any(device["out_of_memory"] for device in simulated["devices"]) == (p == 2)


def test_sweep_without_a_known_memory_shows_no_memory_column():
    code, table, err = pipesim("sweep", "-s", "1f1b", "-p", "2,4", "-j", 1)  # two configurations: in this process
    assert code == 0, err
    header = next(line for line in table.splitlines() if line.lstrip().startswith("schedule"))
    assert header.split()[-1] == "stale" and "OOM" not in table


# the repository, where the docs' paths (examples/, traces/) lead
REPO = GPT_CPU.parents[2]


class _Checked(Exception):
    """Raised where sweep's checks of its options end: what follows estimates and simulates."""


def _documented_sweeps() -> list[list[str]]:
    """The arguments of each `pipesim sweep` line of a ```bash block in README.md and docs/*.md (continuations
    joined, comments dropped)."""
    sweeps = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"^```bash\n(.*?)^```", doc.read_text(), flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:2] == ["pipesim", "sweep"]:
                    sweeps.append(words[1:])
    return sweeps


def test_every_sweep_the_docs_show_passes_its_checks(monkeypatch):
    """docs/sweep-and-tune.md's first sweep gave `--pipelines 1,2` with no AvgPipe among its methods, refused since
    e1842f5 (`--pipelines applies to avgpipe only`): parsing it (test_docs_commands.py) did not tell. Each sweep the
    docs show runs here through its checks, up to its estimates and simulations."""
    from pipesim.commands import sweep

    def checked(ctx):
        raise _Checked

    monkeypatch.setattr(sweep, "what_if", checked)
    monkeypatch.chdir(REPO)
    sweeps = _documented_sweeps()
    assert len(sweeps) >= 3
    refused = []
    for args in sweeps:
        try:
            code, _, err = pipesim(*args)
        except _Checked:
            continue
        refused.append(f"pipesim {shlex.join(args)}: exit {code}: {err.strip()}")
    assert refused == []


@pytest.mark.parametrize(("command", "flag", "given"), [
    ("simulate", "--fwd", "1e-12"), ("simulate", "--bwd", "0.0000005"), ("simulate", "--comm", "1e-9"),
    ("sweep", "--fwd", "1e-12")])
def test_a_time_under_a_nanosecond_is_refused_not_rounded_to_none(tmp_path, command, flag, given):
    """The simulator counts whole picoseconds: `--fwd 1e-12 --bwd 1e-12` rounded every op to none and printed a
    0 ms step at 0.0 samples/s, exit 0. A time is 0 or at least a nanosecond, and nothing is written."""
    html = tmp_path / "t.html"
    code, out, err = pipesim(command, "-s", "1f1b", flag, given, "--html", html)
    assert (code, out) == (2, "")
    assert err == (f"error: {flag}: give 0 or at least 1e-06 ms, a nanosecond, as the simulator counts "
                   f"picoseconds (got {given})\n")
    assert not html.exists()


@pytest.mark.parametrize(("command", "flag"), [("simulate", "--opt"), ("simulate", "--pred"), ("simulate", "--avg"),
                                             ("sweep", "--opt")])
def test_an_optimizer_time_under_a_nanosecond_is_refused_as_the_cost_flags_are(tmp_path, command, flag):
    """--opt, --pred and --avg took 1e-12, which rounds to no picosecond, where --fwd, --bwd and --comm refuse it."""
    html = tmp_path / "t.html"
    code, out, err = pipesim(command, "-s", "avgpipe", flag, "1e-12", "--html", html)
    assert (code, out) == (2, "")
    assert err == (f"error: {flag}: give 0 or at least 1e-06 ms, a nanosecond, as the simulator "
                   f"counts picoseconds (got 1e-12)\n")
    assert not html.exists()


@pytest.mark.parametrize(("flag", "given"), [("--routing", "random"), ("--hot-expert-share", "0.5"),
                                             ("--token-dispatcher", "deepep")])
def test_a_routing_option_on_a_dense_model_is_refused_for_the_model(tmp_path, flag, given):
    """On a model without routed experts these said "give --expert-parallel above 1", which that model then
    refuses ("the model has no routed experts"): the user was sent round in a circle. The model is named now."""
    pytest.importorskip("torch")
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64,
                                "--heads", 4, "--seq-len", 32, "--vocab", 100, flag, given, "--out", out)
    named = f"{flag} {given}" if flag == "--routing" else flag
    assert (code, stdout) == (2, "")
    assert err == (f"error: {named} applies to a mixture of experts' routing, and the model has no routed experts "
                   "(gpt --experts, or a Hugging Face MoE config); leave it out\n")
    assert not out.exists()


def test_export_refuses_avgpipe_which_trains_several_pipelines(tmp_path):
    """A torch schedule CSV is one pipeline. Export built every method at P = 1, meaning AvgPipe to be refused for its
    averaging, but at one pipeline AvgPipe averages nothing: it wrote a synchronous order that is not AvgPipe's,
    exit 0. Built at its own P (2), it is refused, and nothing is written."""
    out = tmp_path / "avgpipe.csv"
    code, stdout, err = pipesim("export", "-s", "avgpipe", "--format", "torch-csv", "--out", out)
    assert (code, stdout) == (2, "")
    assert err == "error: avgpipe: a torch schedule CSV is one pipeline; this schedule has 2\n"
    assert not out.exists()


def test_sweep_names_the_kind_of_out_file_before_the_file_there(tmp_path):
    """`sweep --out notes.json` over a file of the user's said "exists and is not a pipesim sweep results file;
    remove it or give --out another path", and once removed, that a .json is no results file at all: the kind of
    file it takes comes first, and the file is left as it was."""
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    code, out, err = pipesim("sweep", "-s", "1f1b", "--out", notes)
    assert (code, out) == (2, "")
    assert err == f"error: --out: give a .csv or .parquet file (got {notes})\n"
    assert notes.read_text() == '{"mine": 1}\n'
