"""benchmarks/probe_attention.py: the GPU probe's Llama 3.1 8B attention (traces/measured/gpu-probe-h200.json, an
H200) replayed against pipesim's prices of the same parts, no GPU needed. The parts the probe times as the device's
work hold the model: C = 1's causal forward (one 1 ms kernel), and a C = 2 rank's backward (its causal block on the
rank's 1,024 query tiles with the tail, its unmasked block, their joins), each block outlasting the host's issue of
the next. The forward's C = 2 spans start on an idle device and carry the host's issue (docs/hardware.md, "Llama 3.1
8B's C = 2 step"): the model must price none of them above what was measured around it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import script_module


@pytest.fixture(scope="module")
def replay():
    with script_module("probe_attention") as module:
        yield module


@pytest.fixture(scope="module")
def rows(replay):
    table = replay.rows(json.loads(replay.PROBE.read_text()), "h200")
    return {(row.kernel, row.part, row.pass_name): row for row in table}


def test_the_whole_causal_forward_is_priced_as_measured(rows):
    assert rows["cudnn", "C = 1", "forward"].ratio == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_c2_ranks_backward_blocks_and_their_joins_are_priced_as_measured(rows, rank):
    """Step 0 causal (the tail of the rank's own tiles) and step 1 unmasked, together within 6 % of what the probe
    measured of each alone; with the joins, the rank's backward within 10 %. Either block priced at the other's
    rate, or without its tail, moves the sum out of the bound."""
    step0, step1 = rows["cudnn", "C = 2 step 0, causal", "backward"], rows["cudnn", f"C = 2 step 1, rank {rank}",
                                                                         "backward"]
    blocks = (step0.predicted_ms + step1.predicted_ms) / (step0.measured_ms + step1.measured_ms)
    assert blocks == pytest.approx(1.0, abs=0.06)
    assert rows["cudnn", f"C = 2 rank {rank}", "backward"].ratio == pytest.approx(1.0, abs=0.10)


def test_no_forward_span_is_priced_above_what_the_probe_measured_around_it(rows):
    forward = [row for row in rows.values() if row.pass_name == "forward" and row.measured_ms]
    assert len(forward) == 20
    assert [row.part for row in forward if row.ratio > 1.05] == []


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
    (["--gpu", "h300"], "--gpu: unknown GPU 'h300'; known: "),
])
def test_bad_input_is_one_line_and_exit_2(replay, capsys, flags, message):
    assert replay.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_a_probe_without_the_attentions_whole_shape_is_one_line_and_exit_2(replay, tmp_path, capsys):
    """A shape short of a field the count reads (here the heads alone) is refused before any pricing."""
    bad = tmp_path / "probe.json"
    bad.write_text(json.dumps({"attention": {"kernels": {"flash": {}}, "shape": {"heads": 32}}}))
    assert replay.main(["--probe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "attention.shape not heads, kv_heads, head_dim, tokens" in err and err.count("\n") == 1
