"""The GPU catalogue shipped as data: its schema, every figure sourced, users' own parts and clusters, and
`pipesim gpus`."""

from __future__ import annotations

import json

import pytest

from pipesim.hardware.catalogue import BUILT_IN, CatalogueError, load_catalogue
from tests.conftest import pipesim

REQUIRED = {"a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm", "h100-pcie", "h200", "h800", "b200", "l40s", "mi300x"}
PART = """
[gpu.{name}]
name = "Test GPU"
memory_gib = 24
memory_bandwidth_gb_s = 1000
source = "https://example.com/datasheet"
dense_tflops = {{ fp32 = 10, bf16 = 100, fp16 = 100 }}
intra_node = {{ link = "pcie", gb_s_per_direction = 32, gpus_per_node = 4, source = "https://example.com/board" }}
network = {{ kind = "ethernet", gbit_s = 100, source = "https://example.com/nic" }}
"""
CURVE = """[gpu.x.curve]
matmul_efficiency = 0.8
attention_efficiency = 0.35
memory_efficiency = 0.88
kernel_overhead_ms = 0.004
multiprocessors = 132
tiles = [[128, 128]]
source = "https://example.com/curve"
"""  # part x's


def test_the_catalogue_holds_the_required_parts_each_figure_with_a_source():
    catalogue = load_catalogue()
    assert REQUIRED <= set(catalogue.gpu)
    for name, part in catalogue.gpu.items():
        sources = [part.source, part.intra_node.source, part.network.source]
        assert all(s.startswith("https://") or s.startswith("assumed: ") for s in sources), name
        peak = part.dense_tflops
        assert peak.bf16 == peak.fp16 > peak.fp32, name  # the tensor cores' half precision beats fp32 everywhere
        assert peak.fp8 is None or peak.fp8 == pytest.approx(2 * peak.bf16, rel=0.02), name  # L40S: 733 vs 362.05
    assert catalogue.gpu["a100-sxm-80gb"].dense_tflops.bf16 == 312  # published runs' "% of peak" uses 312
    assert catalogue.gpu["a100-sxm-80gb"].dense_tflops.fp8 is None  # Ampere has no fp8
    assert catalogue.gpu["mi300x"].intra_node.peer_gb_s_per_direction == 64  # a mesh: one link per peer


def test_a_users_file_adds_and_replaces_parts_and_describes_clusters(tmp_path):
    own = tmp_path / "mine.toml"
    own.write_text(PART.format(name="rtx-test") + PART.format(name="l40s").replace("Test GPU", "My L40S")
                   + '[cluster.lab]\ngpu = "rtx-test"\nnodes = 2\n'
                   + '[cluster.lab.network]\nkind = "roce"\ngbit_s = 50\nsource = "https://example.com/lab"\n')
    catalogue = load_catalogue(own)
    assert REQUIRED <= set(catalogue.gpu) and catalogue.gpu["rtx-test"].memory_gib == 24
    assert catalogue.gpu["l40s"].name == "My L40S"
    assert catalogue.cluster["lab"].nodes == 2 and catalogue.cluster["lab"].network.gbit_s == 50


@pytest.mark.parametrize("text, fragment", [
    (PART.format(name="x").replace("memory_gib = 24\n", ""), "gpu.x.memory_gib: missing: give a number"),
    (PART.format(name="x").replace("bf16 = 100", "bf16 = -1"), "gpu.x.dense_tflops.bf16: Input should be greater"),
    (PART.format(name="x").replace("memory_gib = 24", "memory_gib = 1e30"),  # read as 1e30 GiB
     "gpu.x.memory_gib: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e30)"),
    (PART.format(name="x").replace("memory_gib = 24", "memory_gib = 1e-300"),  # held as 0 bytes: nothing fits
     "gpu.x.memory_gib: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e-300)"),
    # figures past what a part could have: each ended in a traceback from the estimate (a time not finite, a
    # division by a tile of 0 rows) or was blamed on the micro-batch (1e18 multiprocessors)
    (PART.format(name="x").replace("bf16 = 100", "bf16 = 1e-300"),
     "gpu.x.dense_tflops.bf16: Input should be greater than or equal to 0.001 (got 1e-300)"),
    (PART.format(name="x").replace("memory_bandwidth_gb_s = 1000", "memory_bandwidth_gb_s = 1e-300"),
     "gpu.x.memory_bandwidth_gb_s: Input should be greater than or equal to 0.001 (got 1e-300)"),
    (PART.format(name="x").replace("gbit_s = 100", "gbit_s = 1e300"),
     "gpu.x.network.gbit_s: Input should be less than or equal to 8,000,000 (got 1e+300)"),
    (PART.format(name="x") + CURVE.replace("tiles = [[128, 128]]", "tiles = [[0, 128]]"),
     "gpu.x.curve.tiles.0.0: Input should be greater than or equal to 1 (got 0)"),
    (PART.format(name="x") + CURVE.replace("kernel_overhead_ms = 0.004", "kernel_overhead_ms = 1e300"),
     "gpu.x.curve.kernel_overhead_ms: Input should be less than or equal to 1,000 (got 1e+300)"),
    (PART.format(name="x") + CURVE.replace("multiprocessors = 132", "multiprocessors = 1000000000000000000"),
     "gpu.x.curve.multiprocessors: Input should be less than or equal to 100,000 (got 1,000,000,000,000,000,000)"),
    (PART.format(name="x").replace('"pcie"', '"usb"'), "gpu.x.intra_node.link: Input should be 'nvlink', 'xgmi'"),
    (PART.format(name="x") + "speed = 3\n", "gpu.x.speed: unknown field; allowed: name, memory_gib, "
                                     "memory_bandwidth_gb_s, source, dense_tflops, intra_node, network, curve, "
                                     "device_memory"),
    (PART.format(name='"Big GPU"'), "gpu.Big GPU: name with lower-case letters"),
    ('[cluster.c]\ngpu = "nope"\nnodes = 1\n', "cluster.c.gpu: unknown 'nope'; known: a100-sxm-40gb"),
    ('[cluster.c]\ngpu = "h100_sxm"\nnodes = 1\n',
     "cluster.c.gpu: unknown 'h100_sxm' (did you mean 'h100-sxm'?); known: a100-sxm-40gb"),
    ("gpu = 3\n", "gpu: a table of parts"),
    ("[gpus.x]\nmemory_gib = 24\n",  # not "gives no part"
     "gpus: unknown field (did you mean 'gpu'?); allowed: gpu, cluster"),
    (PART.format(name="x").replace("memory_gib = 24", "memory_gb = 24"),  # said misspelt, not "memory_gib: missing"
     "gpu.x.memory_gb: unknown field (did you mean 'memory_gib'?); allowed: name, memory_gib, "),
    ("[gpu.x\n", "is not valid TOML"),
    (PART.format(name="x") + 'device_memory = { gib = 25, source = "https://example.com/oom" }\n',
     "gpu.x.device_memory: gib 25 is more than memory_gib 24: give what torch reports (total_memory)"),
    (PART.format(name="x") + "device_memory = { gib = 23.5 }\n",
     "gpu.x.device_memory.source: missing: give text in quotes"),
    # a string or a boolean is no number: pydantic's lax mode read "23" as 23 and true as 1 GiB
    (PART.format(name="x") + 'device_memory = { gib = "23", source = "s" }\n',
     "gpu.x.device_memory.gib: give a number, without quotes (got '23')"),
    (PART.format(name="x").replace("memory_gib = 24", "memory_gib = true"),
     "gpu.x.memory_gib: give a number (got true)"),
    # a count is a whole number as TOML writes one: 8.0 GPUs a node is refused, not read as 8
    (PART.format(name="x").replace("gpus_per_node = 4", "gpus_per_node = 4.0"),
     "gpu.x.intra_node.gpus_per_node: give a whole number (got 4.0)"),
])
def test_a_bad_file_names_the_field_and_what_is_allowed(tmp_path, text, fragment):
    own = tmp_path / "bad.toml"
    own.write_text(text)
    with pytest.raises(CatalogueError) as caught:
        load_catalogue(own)
    assert fragment in str(caught.value) and str(own) in str(caught.value)
    code, out, err = pipesim("gpus", "--gpus", own)
    assert code == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1


def test_a_part_at_the_bounds_of_its_figures_is_simulated_or_refused_in_one_line(tmp_path):
    """The slowest figures a file may give run a small gpt past the simulator's times: refused in one line naming
    the micro-batch and the part, not a traceback; the fastest run it."""
    def part(memory_gb_s: str, tflops: str, link_gb_s: str, gbit_s: str) -> str:
        return (PART.format(name="x").replace("memory_bandwidth_gb_s = 1000", f"memory_bandwidth_gb_s = {memory_gb_s}")
                .replace("fp32 = 10, bf16 = 100, fp16 = 100", f"fp32 = {tflops}, bf16 = {tflops}, fp16 = {tflops}")
                .replace("gb_s_per_direction = 32", f"gb_s_per_direction = {link_gb_s}")
                .replace("gbit_s = 100", f"gbit_s = {gbit_s}"))

    slowest = part("0.001", "0.001", "0.001", "0.008") + (
        CURVE.replace("kernel_overhead_ms = 0.004", "kernel_overhead_ms = 1000")
        .replace("multiprocessors = 132", "multiprocessors = 100000").replace("[[128, 128]]", "[[4096, 4096]]"))
    fastest = part("1e6", "1e6", "1e6", "8e6") + (
        CURVE.replace("kernel_overhead_ms = 0.004", "kernel_overhead_ms = 0").replace("[[128, 128]]", "[[1, 1]]"))
    answers = []
    for text in (slowest, fastest):
        own = tmp_path / "part.toml"
        own.write_text(text)
        answers.append(pipesim("simulate", "-s", "1f1b", "--gpus", own, "--gpu", "x", "--model", "gpt", "--layers", 2,
                               "--width", 64, "--heads", 2, "--seq-len", 32, "--vocab", 100, "-p", 2,
                               "--tensor-parallel", 2))
    (code, out, err), fast = answers
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: the estimate at micro-batch size 1 (--microbatch-size): layers' ")
    assert err.endswith("; give a smaller micro-batch or model, or a faster part\n")
    assert fast.code == 0 and fast.err == "" and "1f1b" in fast.out


def test_a_misspelt_part_is_answered_with_the_nearest_known_one():
    """The commands that find a --gpu part by name (fit-curve, the probes) answered a misspelt one with the list
    alone, where simulate's --gpu suggested the nearest: one rule for both (choices.py nearest_text)."""
    with pytest.raises(CatalogueError) as caught:
        load_catalogue().find("h10-sxm")
    assert str(caught.value).startswith("unknown GPU 'h10-sxm' (did you mean 'h100-sxm'?); known: a100-sxm-40gb, ")


def test_gpus_lists_the_catalogue_as_a_table_and_as_json(tmp_path):
    code, out, err = pipesim("gpus")
    assert code == 0 and all(name in out for name in REQUIRED)
    code, out, err = pipesim("gpus", "--json")
    document = json.loads(out)
    assert code == 0 and REQUIRED <= set(document["gpu"]) and document["cluster"] == {}
    assert document["gpu"]["h100-sxm"]["dense_tflops"]["fp8"] == 1978.9
    code, out, err = pipesim("gpus", "--gpus", tmp_path / "missing.toml")
    assert code == 2 and "--gpus: cannot read" in err


def test_gpus_writes_its_figures_with_thousands_separated_as_the_other_tables_do():
    """`pipesim gpus` wrote the H100's fp8 peak "1978.9" and its memory bandwidth "3350", where every other table
    writes "1,978.9"; the catalogue's own digits stay (the L40S's 362.05, the A100's 19.5)."""
    code, out, err = pipesim("gpus")
    h100, l40s = ([line.split() for line in out.splitlines() if line.split()[:1] == [name]][0]
                  for name in ("h100-sxm", "l40s"))
    assert code == 0 and h100[1:7] == ["79.11", "3,350", "67", "494.7", "989.4", "1,978.9"], h100
    assert l40s[5] == "362.05" and "1978.9" not in out, l40s


def test_the_catalogue_file_ships_inside_the_package():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((BUILT_IN.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert BUILT_IN.name in project["package-data"]["pipesim.hardware"]


def test_the_docs_efficiency_table_holds_the_catalogues_curves():
    """docs/hardware.md's table of each part's matmul, attention, memory, link and network efficiencies says what the
    catalogue prices, to the digits it prints (the H200's matmul row kept the GH200's 0.830 after dc68a21 moved the
    part to the H100's 0.801)."""
    rows = {"A100 SXM 80 GB": ["a100-sxm-80gb"], "A100 SXM 40 GB": ["a100-sxm-40gb"], "H100 SXM": ["h100-sxm"],
            "H200": ["h200"], "MI300X": ["mi300x"],
            "H800, B200": ["h800", "b200"], "H100 PCIe, L40S": ["h100-pcie", "l40s"]}
    fields = ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "link_efficiency", "network_efficiency")
    table = {}
    for line in (BUILT_IN.parents[1] / "docs" / "hardware.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in rows:
            table[cells[0]] = cells[1:6]
    assert set(table) == set(rows)
    catalogue = load_catalogue()
    for row, parts in rows.items():
        for part in parts:
            curve = catalogue.gpu[part].curve
            for field, printed in zip(fields, table[row]):
                digits = len(printed.partition(".")[2])
                assert round(getattr(curve, field), digits) == float(printed), (row, part, field)


def test_a_parts_memory_is_what_torch_is_given_where_known_and_the_datasheets_marked_where_not(tmp_path):
    """The cap a --gpu estimate holds its peak to, and `pipesim gpus` shows, is the memory the driver gives torch
    (`device_memory`: an H200's 139.8 GiB of the datasheet's 141, measured by this project), as calibrate records a
    measured device's (its total_memory); where a part gives none, the datasheet's, marked."""
    catalogue = load_catalogue()
    assert catalogue.gpu["h200"].device_memory_bytes == 150_109_880_320 < 141 * (1 << 30)
    own = tmp_path / "mine.toml"
    own.write_text(PART.format(name="rtx-test"))
    assert load_catalogue(own).gpu["rtx-test"].device_memory_bytes == 24 * (1 << 30)
    code, out, err = pipesim("gpus", "--gpus", own)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert code == 0 and rows["h200"][1] == "139.8" and rows["rtx-test"][1] == "24*", out
    assert "*: the datasheet's, torch's not known" in " ".join(out.split())
    code, out, err = pipesim("estimate", "--gpu", "h200", "--model", "gpt", "--layers", 2, "--width", 256,
                             "--heads", 4, "-p", 2, "-o", tmp_path / "h200.json")
    assert code == 0, err
    assert json.loads((tmp_path / "h200.json").read_text())["environment"]["device_memory_bytes"] == 150_109_880_320


def test_a_part_of_ones_own_without_a_curve_is_refused_before_the_count_naming_its_file(tmp_path):
    """A --gpus part without `curve` was refused by every estimate after its count (tune: 6.4 s), as "gpu 'X3' has
    no efficiency curve", neither the flag nor the file named."""
    own = tmp_path / "own.toml"
    own.write_text(PART.format(name="x3"))
    for command in (["simulate", "-s", "1f1b"], ["estimate", "-o", tmp_path / "e.json"], ["tune", "-D", 8]):
        code, out, err = pipesim(*command, "--gpu", "x3", "--model", "gpt", "--gpus", own)
        assert code == 2 and out == "" and not (tmp_path / "e.json").exists(), err
        assert err == (f"error: --gpu x3: {own}'s x3 gives no curve = {{...}}, the efficiencies every estimate prices "
                       "a part with (examples/h100-hbm2e-96gb.toml has one); add one to it\n"), err
