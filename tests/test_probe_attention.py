"""benchmarks/probe_attention.py: the GPU probe's Llama 3.1 8B attention (traces/measured/gpu-probe-h200-day9.json,
an H200 with cuDNN 9.19, every span behind a held device, so each is the device's work) replayed against pipesim's
prices of the same parts, no GPU needed. What it holds for the published Llama 3.1 rows, which ran cuDNN's kernel in
TransformerEngine 1.10's ring with its compiled passes (docs/hardware.md, "What the H200 probe settled"): pipesim
prices none of that path faster than the device ran it, so the rows' missing time is not in their attention."""

from __future__ import annotations

import json

import pytest

from pipesim.hardware.catalogue import Curve
from tests.conftest import script_module

CUDNN_BLOCKS = ["C = 1", "C = 2 step 0, causal", "C = 2 step 1, rank 0", "C = 2 step 1, rank 1"]


@pytest.fixture(scope="module")
def replay():
    with script_module("probe_attention") as module:
        yield module


@pytest.fixture(scope="module")
def rows(replay):
    table = replay.rows(json.loads(replay.PROBE.read_text()), "h200")
    return {(row.kernel, row.part, row.pass_name): row for row in table}


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
@pytest.mark.parametrize("part", CUDNN_BLOCKS)
def test_no_cudnn_block_is_priced_faster_than_the_held_device_ran_it(rows, part, pass_name):
    """The catalogue's cuDNN rates (the FlashAttention-3 paper's, cuDNN 9.1's benchmark) against cuDNN 9.19: at most
    25 % slow, never fast. A causal kernel priced over its whole square (twice its work), or the rank's causal
    block at the unmasked kernel's rate, leaves the bound."""
    assert 1.0 <= rows["cudnn", part, pass_name].ratio <= 1.30


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_the_ranks_causal_block_pays_its_tail_as_measured(replay, rows, monkeypatch, pass_name):
    """Step 0 is a quarter of C = 1's causal work on half its query tiles (1,024 against 2,048), and measured it
    takes more than a quarter of C = 1's time: the tail (`Curve.attention_fraction`'s `tiles`) moves the priced
    share towards the measured one and not past it."""
    def share(table: dict) -> float:
        return table["cudnn", "C = 2 step 0, causal", pass_name] / table["cudnn", "C = 1", pass_name]

    measured = share({key: row.measured_ms for key, row in rows.items()})
    tailed = share({key: row.predicted_ms for key, row in rows.items()})
    original = Curve.attention_fraction
    monkeypatch.setattr(Curve, "attention_fraction",
                        lambda curve, backward, causal, tiles=None: original(curve, backward, causal))
    untailed = share({(row.kernel, row.part, row.pass_name): row.predicted_ms
                      for row in replay.rows(json.loads(replay.PROBE.read_text()), "h200")})
    assert untailed < tailed <= measured


@pytest.mark.parametrize("rank", [0, 1])
def test_the_forward_passes_are_priced_as_te_compiles_them(rows, rank):
    """TransformerEngine 1.10's corrections are torch.compile'd: priced between the compiled passes (fused, fewer
    trips over the output) and the probe's eager ones (over 3x dearer), and the rank's forward with the compiled
    passes priced within 15 % above what it took."""
    compiled = rows["cudnn", f"C = 2 passes compiled, rank {rank}", "forward"]
    eager = rows["cudnn", f"C = 2 passes, rank {rank}", "forward"]
    assert compiled.measured_ms <= compiled.predicted_ms < eager.measured_ms
    assert 1.0 <= rows["cudnn", f"C = 2 rank {rank} as TE runs it", "forward"].ratio <= 1.15


@pytest.mark.parametrize("rank", [0, 1])
def test_a_c2_ranks_backward_with_its_joins_is_priced_no_faster_than_measured(rows, rank):
    """The backward's joins are eager in TransformerEngine as in the probe: they and the rank's whole backward
    within 25 % and 15 % above what was measured."""
    assert 1.0 <= rows["cudnn", f"C = 2 passes, rank {rank}", "backward"].ratio <= 1.25
    assert 1.0 <= rows["cudnn", f"C = 2 rank {rank}", "backward"].ratio <= 1.15


def test_the_blocks_transfer_from_the_h200_to_the_h100_and_the_passes_go_at_its_memory(rows):
    """The same multiprocessors and clocks: a block is priced alike on both; a memory-bound pass at the part's
    bandwidth (4.8 against 3.35 TB/s), its kernels' overheads aside."""
    for key, row in rows.items():
        if key[1] == "C = 1" or "step" in key[1]:
            assert row.rows_gpu_ms == pytest.approx(row.predicted_ms)
    passes = rows["cudnn", "C = 2 passes, rank 0", "backward"]
    assert 1.30 < passes.rows_gpu_ms / passes.predicted_ms < 4800 / 3350


@pytest.mark.parametrize("flags,message", [
    (["--probe", "/nonexistent/probe.json"], "--probe: /nonexistent/probe.json is not a gpu_probe.py JSON"),
    (["--gpu", "h300"], "--gpu: unknown GPU 'h300' (did you mean "),
    (["--gpu", "a100-sxm-80gb"], "--gpu: a100-sxm-80gb cannot price gpu-probe-h200-day9.json's attention: "),
])
def test_bad_input_is_one_line_and_exit_2(replay, capsys, flags, message):
    assert replay.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_probe_without_the_attentions_whole_shape_is_one_line_and_exit_2(replay, tmp_path, capsys):
    """A shape short of a field the count reads (here the heads alone) is refused before any pricing."""
    bad = tmp_path / "probe.json"
    bad.write_text(json.dumps({"attention": {"kernels": {"flash": {}}, "shape": {"heads": 32}}}))
    assert replay.main(["--probe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "attention.shape not heads, kv_heads, head_dim, tokens" in err and err.count("\n") == 1


def test_a_probe_whose_kernel_is_no_table_is_one_line_and_exit_2(replay, tmp_path, capsys):
    """A kernel's timings that are no table are refused in pricing, before a row is printed."""
    probe = json.loads(replay.PROBE.read_text())
    probe["attention"]["kernels"]["cudnn"] = 5
    bad = tmp_path / "probe.json"
    bad.write_text(json.dumps(probe))
    assert replay.main(["--probe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "attention part (AttributeError: 'int' object" in err and err.count("\n") == 1
