"""A file that cannot be used is one line that says whether it was read or written, which path, and the flag
that named it; never "cannot write" for a file only read, never a traceback."""

import codecs
import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from pipesim import traces
from pipesim.commands.common import InputError, read_error, write_json, writing
from pipesim.files import grouped
from pipesim.study import results
from pipesim.traces import trace
from tests.conftest import pipesim
from tests.helpers import GPT_CPU, PROFILES

ROOT = Path(__file__).resolve().parents[1]
TOO_LONG = "a" * 300  # past any file system's 255-byte name: even looking at the path fails (ENAMETOOLONG)


@pytest.mark.parametrize(("args", "line"), [
    (["simulate", "-s", "1f1b", "--trace", f"{TOO_LONG}.json"], f"error: --trace: cannot write {TOO_LONG}.json"),
    (["view", f"{TOO_LONG}.json"], f"error: cannot read trace {TOO_LONG}.json"),  # the page its name with .html
    (["view", "t.json", "--html", f"{TOO_LONG}.html"], f"error: --html: cannot write {TOO_LONG}.html"),
    (["compare", f"{TOO_LONG}.json"], f"error: cannot read trace {TOO_LONG}.json"),
    (["simulate", "--gpu", "h100-sxm", "--model", f"hf:{TOO_LONG}", "--seq-len", "128"],
     f"error: --model hf:{TOO_LONG}: cannot read Hugging Face config {TOO_LONG}"),
    (["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out", TOO_LONG], f"error: --out: cannot write {TOO_LONG}"),
])
def test_a_path_that_cannot_be_looked_at_is_named_with_its_flag(tmp_path, monkeypatch, args, line):
    monkeypatch.chdir(tmp_path)
    code, _, err = pipesim(*args)
    assert (code, err) == (2, f"{line}: File name too long\n")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_trace_is_named_before_the_page_its_name_would_give(tmp_path, monkeypatch):
    """view's default page is the first trace's name with .html: a trace that is not there is what is wrong (it was
    "--html: cannot write missing/t.html: folder missing does not exist", a flag the user did not give)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = pipesim("view", "missing/t.json")
    assert (code, err) == (2, "error: cannot read trace missing/t.json: No such file or directory\n")
    assert list(tmp_path.iterdir()) == []


def test_an_output_under_a_file_says_it_is_a_file_not_a_missing_folder(tmp_path):
    (tmp_path / "notes").write_text("")
    out = tmp_path / "notes" / "p.json"
    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out", out)
    assert (code, err) == (2, f"error: --out: cannot write {out}: {tmp_path / 'notes'} is a file, not a folder\n")


# A file of each kind pipesim reads, named as `kind_files` writes it, and what a refusal says of one given in another
# kind's place: the command that reads it, and what to give instead
KIND_FILES = {"trace": "t.json", "profile": "p.json", "study results file": "study.json",
              "cluster file": "cluster.json", "graph file": "dag.json", "simulate report": "report.json"}
READ_BY = {"trace": "`pipesim view t.json` draws it", "profile": "`pipesim simulate --profile p.json` reads it",
           "study results file": "`pipesim study --plot-only --results study.json` draws it",
           "cluster file": "`pipesim simulate --cluster cluster.json` reads it",
           "graph file": "`pipesim simulate -s graphpipe --graph dag.json` reads it",
           # `view report.json` said "not a Chrome trace: expected an object with a 'traceEvents' list"
           "simulate report": "`pipesim simulate --json` printed it, and no command reads it back"}
GIVE = {"trace": "a trace that `pipesim run --trace` or `pipesim simulate --trace` wrote",
        "profile": "a profile that `pipesim calibrate --out` or `pipesim estimate --out` wrote",
        "study results file": "the --results file `pipesim study` wrote",
        "cluster file": "a JSON file of devices and links (docs/simulate.md)",
        "graph file": 'a JSON file of "stages", "edges" and "placement" (docs/simulate.md)'}
# each command reading one of the kinds: its arguments ({} the file) and the flag its errors lead with
READERS = [(("view", "{}"), "", "trace"), (("compare", "{}", "{}"), "", "trace"),
           (("simulate", "-s", "1f1b", "--profile", "{}"), "--profile: ", "profile"),
           (("simulate", "-s", "1f1b", "--cluster", "{}"), "--cluster: ", "cluster file"),
           (("study", "--plot-only", "--results", "{}"), "--results: ", "study results file"),
           (("simulate", "-s", "graphpipe", "--graph", "{}"), "--graph: ", "graph file")]


@pytest.fixture(scope="module")
def kind_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kinds")
    assert pipesim("simulate", "-s", "1f1b", "--trace", folder / KIND_FILES["trace"])[0] == 0
    shutil.copy(GPT_CPU, folder / KIND_FILES["profile"])
    (folder / KIND_FILES["study results file"]).write_text('{"format_version": 1, "setting": {}, "runs": []}')
    shutil.copy(ROOT / "examples" / "cluster.json", folder / KIND_FILES["cluster file"])
    shutil.copy(ROOT / "examples" / "dag.json", folder / KIND_FILES["graph file"])
    code, report, _ = pipesim("simulate", "-s", "1f1b", "--json")
    assert code == 0
    (folder / KIND_FILES["simulate report"]).write_text(report)
    return folder


@pytest.mark.parametrize(("args", "flag", "wanted", "kind"), [
    pytest.param(args, flag, wanted, kind, id=f"{args[0]} {flag}{kind}")
    for args, flag, wanted in READERS for kind in KIND_FILES if kind != wanted])
def test_a_file_of_another_kind_is_named_with_the_command_that_reads_it(kind_files, monkeypatch, args, flag, wanted,
                                                                        kind):
    """Each reader refuses each other kind in one line, not by the first field it lacks ("not a Chrome trace",
    "schema_version: missing", "devices: Field required", "format_version: Field required"), and writes nothing."""
    monkeypatch.chdir(kind_files)
    name = KIND_FILES[kind]
    code, out, err = pipesim(*(arg.format(name) for arg in args))
    assert (code, out, err) == (2, "", f"error: {flag}{name} is a pipesim {kind}, not a {wanted}: {READ_BY[kind]}; "
                                       f"give {GIVE[wanted]}\n")
    assert sorted(path.name for path in kind_files.iterdir()) == sorted(KIND_FILES.values())


def test_a_compare_report_is_no_cluster_file():
    """`pipesim compare --json` writes a "devices" list as a cluster file has one; view and --profile called the
    report a cluster file and sent the user to `simulate --cluster`, which refuses it."""
    report = ROOT / "traces" / "measured" / "gpu-check-h200-day9" / "compare-1f1b.json"
    for args in (("view", report), ("simulate", "-s", "1f1b", "--profile", report)):
        code, out, err = pipesim(*args)
        assert (code, out) == (2, "") and "cluster" not in err, err


def test_a_page_or_a_table_given_for_a_json_file_is_named_as_what_it_is(tmp_path, monkeypatch):
    """A pipesim page, a sweep's .csv or an empty file given to view, compare or --profile read only "not valid
    JSON: Expecting value: line 1 column 1 (char 0)": it is named as what it is, then what to give, as a file of
    another kind is."""
    monkeypatch.chdir(tmp_path)
    assert pipesim("simulate", "-s", "1f1b", "--trace", "t.json")[0] == 0
    assert pipesim("view", "t.json", "--html", "page.html")[0] == 0
    Path("grid.csv").write_text("schedule,stages,microbatches,samples_per_s\n1f1b,2,4,10.0\n")
    Path("empty.json").write_text("\n")
    page = "is a pipesim page (HTML), which a browser opens, not JSON; give "
    table = "is a CSV table (its first line: schedule,stages,microbatches,samples_per_s), not JSON; give "
    for args, line in ((("compare", "page.html", "t.json"), f"trace page.html {page}{GIVE['trace']}"),
                       (("view", "page.html"), f"trace page.html {page}{GIVE['trace']}"),  # was "--html: ... also"
                       (("view", "grid.csv"), f"trace grid.csv {table}{GIVE['trace']}"),
                       (("view", "empty.json"), f"trace empty.json is an empty file, not JSON; give {GIVE['trace']}"),
                       (("simulate", "--profile", "grid.csv"),
                        f"--profile: profile grid.csv {table}{GIVE['profile']}")):
        assert pipesim(*args) == (2, "", f"error: {line}\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty.json", "grid.csv", "page.html", "t.json"]


@pytest.mark.parametrize("text", ["# a sweep grid: each key a flag, each value a list\nschedule = [\"1f1b\"]\n",
                                  "// written by hand, then pasted\n{\"devices\": [1, 2]}\n",
                                  "1f1b, zb-h1\n"])
def test_a_text_with_a_comma_is_no_csv_table_unless_its_lines_split_alike(tmp_path, text):
    """A TOML grid whose comment holds a comma, JSON after a comment line, or one line of words are no CSV table:
    each keeps the parser's own message rather than being named a table it is not."""
    path = tmp_path / "given.json"
    path.write_text(text)
    code, out, err = pipesim("view", str(path))
    assert (code, out) == (2, "")
    assert "is not valid JSON: " in err and "CSV" not in err, err


def test_a_cluster_file_using_every_field_its_reader_allows_is_named_a_cluster_file(tmp_path):
    """files.py, a leaf that may not import the simulator, tells a cluster file by CLUSTER_KEYS: they are
    sim/cluster.py ClusterSpec's fields, so a field added to the reader is a key of the kind too."""
    from pipesim.files import CLUSTER, CLUSTER_KEYS, document_kind
    from pipesim.sim.cluster import ClusterSpec, load_cluster

    every_field = ClusterSpec.model_validate({"devices": 2}).model_dump(mode="json")
    (tmp_path / "cluster.json").write_text(json.dumps(every_field))
    assert load_cluster(tmp_path / "cluster.json").num_devices == 2
    assert (document_kind(every_field), CLUSTER_KEYS) == (CLUSTER, every_field.keys())


def test_a_studys_results_named_in_a_refusal_is_shell_quoted_and_study_still_reads_it(tmp_path, monkeypatch):
    """The command a refusal names pastes as one argument ('my study.json' gave two); study reads the file past
    its kind and says what is wrong with it."""
    monkeypatch.chdir(tmp_path)
    Path("my study.json").write_text('{"format_version": 1, "setting": {}, "runs": []}')
    assert "`pipesim study --plot-only --results 'my study.json'` draws it" in pipesim("view", "my study.json").err
    code, _, err = pipesim("study", "--plot-only", "--results", "my study.json")
    assert (code, err) == (2, "error: --plot-only: my study.json holds no finished run yet\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["my study.json"]


def test_a_file_of_its_kind_with_a_field_wrong_is_named_as_its_kind_then_the_field(tmp_path, monkeypatch):
    """Every reader names the file as the kind it reads, then the first field that is wrong (files.py `validated`):
    the study's said "study.json is not a pipesim study results file: runs: ..." where the others name the kind."""
    monkeypatch.chdir(tmp_path)
    Path("study.json").write_text('{"format_version": 1, "setting": {}, "runs": 3}')
    Path("cluster.json").write_text('{"devices": 2, "link": {"latency_us": -1}}')
    code, out, err = pipesim("study", "--plot-only", "--results", "study.json")
    assert (code, out, err) == (2, "", "error: --results: study results file study.json: runs: Input should be a "
                                       "valid list (got 3)\n")
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cluster", "cluster.json")
    assert (code, out, err) == (2, "", "error: --cluster: cluster file cluster.json: link.latency_us: Input should "
                                       "be greater than or equal to 0 (got -1)\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cluster.json", "study.json"]


@pytest.mark.parametrize(("document", "field"), [('[1]', ""), ('{"devices": 2, "link": [1]}', "link: "),
                                               ('{"devices": [[1]]}', "devices.0: ")])
def test_a_cluster_files_list_where_an_object_goes_is_said_in_the_files_terms(tmp_path, monkeypatch, document, field):
    """A list given for the cluster file or one of its objects was "Input should be a valid dictionary or instance
    of LinkSpec": the reader's class, which no user wrote; said as a trace's header says it."""
    monkeypatch.chdir(tmp_path)
    Path("cluster.json").write_text(document)
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cluster", "cluster.json")
    assert (code, out, err) == (2, "", f"error: --cluster: cluster file cluster.json: {field}Input should be an "
                                       "object\n")


def test_a_files_bound_is_grouped_in_thousands_as_pipesims_own_refusals_are(tmp_path, monkeypatch):
    """pydantic writes a field's bound as it is held: "Input should be less than or equal to 1000000000000"."""
    monkeypatch.chdir(tmp_path)
    Path("cluster.json").write_text('{"devices": 4, "link": {"latency_us": 1e300, "bandwidth_gb_per_s": 1}}')
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cluster", "cluster.json")
    assert (code, out, err) == (2, "", "error: --cluster: cluster file cluster.json: link.latency_us: Input should "
                                       "be less than or equal to 1,000,000,000,000 (got 1e+300)\n")


@pytest.mark.parametrize("message, said", [
    ("Input should be less than or equal to 1000000000000", "Input should be less than or equal to 1,000,000,000,000"),
    ("give at most 4096, the trace's events (got -1200)", "give at most 4,096, the trace's events (got -1,200)"),
    ("'1234,5678' is not a valid integer.", "'1234,5678' is not a valid integer."),
    ("unknown name '2024' in \"20240101\"", "unknown name '2024' in \"20240101\""),
    ("file runs/2024/x.json, model gpt2048", "file runs/2024/x.json, model gpt2048"),
])
def test_only_a_bound_or_a_value_of_pipesims_is_grouped_not_what_the_user_typed(message, said):
    """files.grouped groups a bound in click's and pydantic's lines; a value quoted as typed ("'2024'" read "'2,024'",
    "'1234,5678'" read "'1,234,5,678'") or a path's or a name's digits are left as they were written."""
    assert grouped(message) == said


def test_a_hugging_face_config_given_for_a_profile_is_named_one_with_the_flag_that_reads_it(tmp_path, monkeypatch):
    """A config.json given as --profile was "schema_version: missing (is this a pipesim calibrate profile?)"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    code, _, err = pipesim("simulate", "--profile", "config.json", "-s", "1f1b")
    assert (code, err) == (2, "error: --profile: profile config.json: a Hugging Face model config (model_type "
                              "'llama'), not a profile: give it as --model hf:config.json (with --gpu NAME to "
                              "estimate its costs)\n")


def test_a_failed_read_the_command_makes_for_itself_is_not_called_a_write(tmp_path, monkeypatch):
    def unreadable(*_):
        raise PermissionError(13, "Permission denied", "/some/source.py")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(traces, "summarize", unreadable)
    code, _, err = pipesim("simulate", "-s", "1f1b", "--trace", "t.json")
    assert (code, err) == (2, "error: cannot read /some/source.py: Permission denied\n")
    assert list(tmp_path.iterdir()) == []


def test_a_study_whose_results_cannot_be_saved_names_results(tmp_path, monkeypatch):
    def full(path, _):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(results, "write_atomic", full)
    path = tmp_path / "r.json"
    code, _, err = pipesim("study", "-s", "gpipe", "--seeds", "1", "-n", "1", "--no-timing", "--results", path,
                           "--html", tmp_path / "s.html")
    assert (code, err) == (2, f"error: --results: cannot write {path}: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


def test_an_os_error_without_strerror_still_says_why_on_a_read_and_on_a_write():
    exc = OSError("the cache is locked")
    exc.filename = "/some/cache"
    assert read_error(exc) == "cannot read /some/cache: the cache is locked"
    with pytest.raises(InputError) as raised, writing("--out"):
        raise exc
    assert str(raised.value) == "--out: cannot write /some/cache: the cache is locked"


@pytest.mark.parametrize("script", ["published_moe", "published_runs"])
def test_a_benchmarks_json_that_cannot_be_written_is_refused_before_it_computes(tmp_path, script):
    """Refused as the command line refuses it, before the minutes its rows take (it wrote them, then a traceback)."""
    missing = tmp_path / "missing" / "x.json"
    done = subprocess.run([sys.executable, ROOT / "benchmarks" / f"{script}.py", "--json", missing], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"error: --json: cannot write {missing}: folder {missing.parent} does not exist\n")
    assert list(tmp_path.iterdir()) == []


def test_a_benchmarks_json_is_its_document_indented_and_nothing_without_the_flag(tmp_path):
    path = tmp_path / "x.json"
    write_json(None, {"rows": [1]})
    assert list(tmp_path.iterdir()) == []
    write_json(path, {"rows": [1]})
    assert path.read_text() == '{\n "rows": [\n  1\n ]\n}\n'


def test_a_benchmarks_output_whose_write_fails_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    def full(path, _):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(trace, "write_atomic", full)
    path = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exited:
        write_json(path, {})
    assert (exited.value.code, capsys.readouterr().err) == (
        2, f"error: --json: cannot write {path}: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


PROFILE_TEXT = '{\n "schema_version": 2,\n "environment": {}\n}\n'
MODEL_CONFIG = '{"model_type": "llama", "hidden_size": 64}'


WRITERS = [  # each command's output flag last, with the kind of file it writes
    (["run", "-s", "1f1b", "--model", "mlp", "--trace"], "pipesim trace"),
    (["simulate", "-s", "1f1b", "--trace"], "pipesim trace"),
    (["simulate", "-s", "1f1b", "--html"], "pipesim page"),
    (["sweep", "-s", "1f1b", "-j", "1", "--html"], "pipesim page"),
    (["export", "-s", "1f1b", "--format", "torch-csv", "--out"], "torch.distributed.pipelining schedule CSV"),
    (["view", "t.json", "--html"], "pipesim page"),
]


@pytest.mark.parametrize("args,kind,there", [
    *((args, kind, there) for args, kind in WRITERS for there in (PROFILE_TEXT, MODEL_CONFIG)),
    # a profile is what estimate writes: the other kind there is a model's config
    (["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out"], "pipesim profile", MODEL_CONFIG),
])
def test_an_output_refuses_to_replace_a_file_of_another_kind(tmp_path, monkeypatch, args, kind, there):
    """`run --trace mlp.json` wrote its trace over a calibrated profile without a word: a writer replaces only
    a file of what it writes (view's page rule, for every --trace, --out and --html)."""
    monkeypatch.chdir(tmp_path)
    assert pipesim("simulate", "-s", "1f1b", "--trace", "t.json")[0] == 0
    (tmp_path / "mine").write_text(there)
    code, out, err = pipesim(*args, "mine")
    assert (code, out) == (2, ""), err
    assert err.startswith(f"error: {args[-1]}: mine exists and is not a {kind}; ") and err.count("\n") == 1, err
    assert (tmp_path / "mine").read_text() == there and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "t.json"]


def test_a_trace_laid_out_anew_is_replaced_and_a_profile_is_not(tmp_path, monkeypatch):
    """A trace re-indented with its keys sorted (`python -m json.tool --sort-keys`) was "not a pipesim trace", which
    --trace refused to replace: the check wanted `{"traceEvents"` first."""
    monkeypatch.chdir(tmp_path)
    assert pipesim("simulate", "-s", "1f1b", "--trace", "t.json")[0] == 0
    written = (tmp_path / "t.json").read_text()
    (tmp_path / "t.json").write_text(json.dumps(json.loads(written), indent=2, sort_keys=True))
    code, _, err = pipesim("simulate", "-s", "1f1b", "--trace", "t.json")
    assert code == 0 and (tmp_path / "t.json").read_text() == written, err
    profile = json.dumps(json.loads(PROFILE_TEXT), indent=4)
    (tmp_path / "p.json").write_text(profile)
    code, _, err = pipesim("simulate", "-s", "1f1b", "--trace", "p.json")
    assert code == 2 and err.startswith("error: --trace: p.json exists and is not a pipesim trace; "), err
    assert (tmp_path / "p.json").read_text() == profile


def test_a_profile_laid_out_anew_is_replaced_and_a_trace_is_not(tmp_path, monkeypatch):
    """A profile re-laid out by a JSON tool (`jq -S .`: keys sorted, indented) was "not a pipesim profile", which
    --out refused to replace: the check wanted "schema_version" in the first 200 bytes. A trace with its header
    first has the header's schema_version there, and is still refused (it was replaced)."""
    monkeypatch.chdir(tmp_path)
    estimate = ["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out"]
    assert pipesim(*estimate, "p.json")[0] == 0
    written = (tmp_path / "p.json").read_text()
    undated = partial(re.sub, r'"date": "[^"]*"', "")  # the estimate's time, in seconds
    sorted_text = json.dumps(json.loads(written), indent=4, sort_keys=True)
    assert sorted_text.find('"schema_version"') > 200
    for layout in (sorted_text, "\ufeff" + written):  # and with a byte-order mark, as Windows editors save it
        (tmp_path / "p.json").write_text(layout)
        code, _, err = pipesim(*estimate, "p.json")
        assert code == 0 and undated((tmp_path / "p.json").read_text()) == undated(written), err
    assert pipesim("simulate", "-s", "1f1b", "--trace", "t.json")[0] == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    header = trace.pop("pipesim")
    trace_text = json.dumps({"pipesim": {"schema_version": header.pop("schema_version"), **header}, **trace})
    assert trace_text.find('"schema_version"') < 200
    (tmp_path / "t.json").write_text(trace_text)
    code, _, err = pipesim(*estimate, "t.json")
    assert code == 2 and err.startswith("error: --out: t.json exists and is not a pipesim profile; "), err
    assert (tmp_path / "t.json").read_text() == trace_text


def test_sweep_replaces_its_own_results_and_no_other_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pipesim("sweep", "-s", "1f1b", "-j", "1", "--out", "r.csv")[0] == 0
    assert pipesim("sweep", "-s", "1f1b", "-j", "1", "--out", "r.csv")[0] == 0  # its own: replaced
    written = (tmp_path / "r.csv").read_bytes()
    (tmp_path / "r.csv").write_bytes(codecs.BOM_UTF8 + written)  # re-saved by a spreadsheet as UTF-8: still its own
    code, _, err = pipesim("sweep", "-s", "1f1b", "-j", "1", "--out", "r.csv")
    assert code == 0 and (tmp_path / "r.csv").read_bytes() == written, err
    (tmp_path / "r.csv").write_text(PROFILE_TEXT)
    code, _, err = pipesim("sweep", "-s", "1f1b", "-j", "1", "--out", "r.csv")
    assert code == 2 and err.startswith("error: --out: r.csv exists and is not a pipesim sweep results file"), err


def test_an_unknown_field_is_named_with_the_one_meant_and_the_fields_allowed_there(tmp_path, monkeypatch):
    """pydantic's "Extra inputs are not permitted" named the field but not what the file may hold there: a profile's
    misspelt layer field is said with the one meant (its layer allows 40, not listed), an unknown top-level one
    with the fields a profile holds."""
    monkeypatch.chdir(tmp_path)
    profile = json.loads((PROFILES / "gpt-cpu.json").read_text())
    profile["layers"][0]["inputsx"] = profile["layers"][0].pop("inputs")
    Path("layer.json").write_text(json.dumps(profile))
    code, out, err = pipesim("simulate", "--profile", "layer.json", "-s", "1f1b")
    assert (code, out, err) == (2, "", "error: --profile: profile layer.json: layers.0.inputsx: unknown field (did "
                                       "you mean 'inputs'?)\n")
    profile["layers"][0]["inputs"] = profile["layers"][0].pop("inputsx")
    profile["bogus"] = 1
    Path("top.json").write_text(json.dumps(profile))
    code, out, err = pipesim("simulate", "--profile", "top.json", "-s", "1f1b")
    assert (code, out) == (2, "") and err.startswith("error: --profile: profile top.json: bogus: unknown field; "
                                                     "allowed: schema_version, environment, model, layers, ")


@pytest.mark.parametrize("strict, doc, said", [
    (True, {"gib": "96", "n": 1}, "gib: give a number, without quotes (got '96')"),
    (True, {"gib": 1.0, "n": "3"}, "n: give a whole number, without quotes (got '3')"),
    (True, {"gib": "nan", "n": 1}, "gib: give a number (got 'nan')"),
    *[(strict, {"gib": "80GB", "n": 1}, "gib: give a number (got '80GB')") for strict in (True, False)],
    *[(strict, {"gib": 1.0, "n": "1.5"}, "n: give a whole number (got '1.5')") for strict in (True, False)],
])
def test_a_number_given_as_text_is_told_to_drop_its_quotes_only_where_that_mends_it(strict, doc, said):
    """Review: "80GB" was told "give a number, without quotes", which would leave the file as wrong; a lax model
    (a cluster file's) reads "96" as 96, and meets only text that is no number."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    from pipesim.files import first_error

    class Part(BaseModel):
        model_config = ConfigDict(strict=strict)
        gib: float
        n: int

    with pytest.raises(ValidationError) as refused:
        Part.model_validate(doc)
    assert first_error(refused.value, Part) == said


@pytest.mark.parametrize("field, said", [("kind", 'kind: missing: give one of "nvlink", "pcie"'),
                                         ("size", "size: missing: give a number"),
                                         ("tags", "tags: missing: give an object")])
def test_a_missing_field_says_what_kind_of_value_to_give(field, said):
    """pydantic's "Field required" said nothing of what to give; a choice, a number that may be whole and a table
    said nothing either (review)."""
    from typing import Literal

    from pydantic import BaseModel, ValidationError

    from pipesim.files import first_error

    class Link(BaseModel):
        kind: Literal["nvlink", "pcie"]
        size: int | float
        tags: dict[str, int]

    given = {"kind": "pcie", "size": 1, "tags": {}}
    given.pop(field)
    with pytest.raises(ValidationError) as refused:
        Link.model_validate(given)
    assert first_error(refused.value, Link) == said


@pytest.mark.parametrize("body, why", [
    ("[" * 100_000 + "]" * 100_000, "its values nest more than 1,000 deep"),
    ('{"a": ' + "9" * 5_001 + "}", "it holds a whole number of more than 4,300 digits"),
])
@pytest.mark.parametrize("args, named", [
    (["compare", "bad.json"], "trace bad.json"),
    (["view", "bad.json"], "trace bad.json"),
    (["simulate", "--profile", "bad.json"], "--profile: profile bad.json"),
    (["simulate", "--cluster", "bad.json"], "--cluster: cluster file bad.json"),
    (["count", "--model", "hf:bad.json"], "--model hf:bad.json: Hugging Face config bad.json"),
])
def test_json_past_pythons_limits_is_one_line(tmp_path, monkeypatch, body, why, args, named):
    """Valid JSON that Python's limits refuse (a RecursionError, a ValueError for an integer of too many digits)
    was a traceback and exit 1."""
    monkeypatch.chdir(tmp_path)
    Path("bad.json").write_text(body)
    code, _, err = pipesim(*args)
    assert (code, err) == (2, f"error: {named} is not JSON pipesim reads: {why}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


@pytest.mark.parametrize("args, flag", [
    (["simulate", "-s", "1f1b", "--html", "new/"], "--html"),
    (["simulate", "-s", "1f1b", "-s", "zb-h1", "--trace", "new/"], "--trace"),
    (["view", "t.json", "--html", "new/"], "--html"),
    (["compare", "t.json", "--html", "new/"], "--html"),
    (["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out", "new/"], "--out"),
    (["sweep", "-s", "1f1b", "-p", "2", "--out", "new/"], "--out"),
    (["run", "-s", "1f1b", "--model", "mlp", "--trace", "new/"], "--trace"),
    (["calibrate", "--model", "mlp", "--out", "new/"], "--out"),
    (["study", "--html", "new/"], "--html"),
])
def test_an_output_ending_in_a_slash_names_a_folder(tmp_path, monkeypatch, args, flag):
    """Path drops a trailing slash: `--html new/` wrote a file named new (and --trace new/ files new-1f1b, ...)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*args)
    assert (code, out, err) == (2, "", f"error: {flag}: new/ names a folder; give a file path\n")
    assert list(tmp_path.iterdir()) == []


def test_an_output_to_the_standard_output_is_all_it_holds(tmp_path):
    """`--trace /dev/stdout | jq`: the table and "wrote" followed the trace there, and --json's document too, so
    nothing piped from it parsed. The table goes to stderr; --json, or a second output there, is refused."""
    def simulate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipesim.cli", "simulate", "-s", "1f1b", *flags], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    done = simulate("--trace", "/dev/stdout")
    assert done.returncode == 0 and json.loads(done.stdout)["pipesim"]["meta"]["schedule"] == "1f1b"
    assert " 1f1b " in done.stderr and "wrote /dev/stdout" in done.stderr
    done = simulate("--trace", "/dev/stdout", "--json")
    assert (done.returncode, done.stdout) == (2, "") and done.stderr == (
        "error: --trace: /dev/stdout is the standard output, which --json prints to: give --trace a file, or leave "
        "--json out\n")
    done = simulate("--trace", "/dev/stdout", "--html", "/dev/stdout")
    assert (done.returncode, done.stdout) == (2, "") and "--html: /dev/stdout is the standard output, which --trace " \
                                                         "writes to: give one a file" in done.stderr
    # a device both merely name is no standard output: `--json --trace /dev/null > /dev/null` discards both
    done = subprocess.run([sys.executable, "-m", "pipesim.cli", "simulate", "-s", "1f1b", "--json", "--trace",
                           "/dev/null", "--html", "/dev/null"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_command_after_one_that_wrote_to_the_standard_output_prints_there_again(tmp_path, monkeypatch):
    """The table of a command whose output is /dev/stdout goes to stderr; the next command in the same process
    (a library's caller, a test) printed its table to stderr too."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("simulate", "-s", "1f1b", "--html", "/dev/stdout")
    assert code == 0 and " 1f1b " in err and " 1f1b " not in out
    code, out, err = pipesim("simulate", "-s", "1f1b")
    assert code == 0 and " 1f1b " in out and err == ""


@pytest.mark.parametrize("body, line", [
    (b"garbage", "cannot read trace t.json.gz: Not a gzipped file (b'ga')"),
    (None, "trace t.json.gz is not a whole gzip file (Compressed file ended before the end-of-stream marker was "
           "reached)"),
])
def test_a_gzip_file_that_is_not_one_or_is_cut_short_is_one_line(tmp_path, monkeypatch, body, line):
    """A file named .gz is read through gzip (torch.profiler's tensorboard_trace_handler writes .json.gz)."""
    import gzip

    monkeypatch.chdir(tmp_path)
    Path("t.json.gz").write_bytes(body if body is not None else gzip.compress(b'{"traceEvents": []}' * 100)[:40])
    code, _, err = pipesim("view", "t.json.gz", "--html", "t.html")
    assert (code, err) == (2, f"error: {line}\n")
    assert not Path("t.html").exists()


@pytest.mark.parametrize("tied", [1, 5])
def test_a_profile_whose_layer_ties_itself_or_a_later_layer_is_refused_naming_the_field(tmp_path, monkeypatch, tied):
    """A layer's `tied_layer` names the earlier layer whose weights are its own (a tied head's, the embedding's)."""
    monkeypatch.chdir(tmp_path)
    document = json.loads((ROOT / "traces" / "profiles" / "gpt-cpu.json").read_text())
    document["layers"][1]["tied_layer"] = tied
    Path("p.json").write_text(json.dumps(document))
    code, out, err = pipesim("simulate", "-s", "1f1b", "--profile", "p.json")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert f"layers.1.tied_layer must name an earlier layer or -1 (its own weights), got {tied}" in err, err
