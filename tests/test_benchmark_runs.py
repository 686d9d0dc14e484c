"""A small run of each benchmark that no other test runs and that a test can run for a few CPU seconds, in this
process through its main(argv) or the function its ranks run: a benchmark no test ran broke unnoticed
(bench_executor's torch side called torch_steps with an argument torch_steps had dropped, so every torch run failed
with a TypeError; e511b60d). The others' smallest runs cost more than about 5 CPU s each and are left out."""

import json
import re

import numpy as np
import torch
import torch.distributed as dist

from pipesim.workload.transport import served_rendezvous
from tests.conftest import script_module


def _table_rows(out: str) -> list[list[str]]:
    """A table's header and rows, each a list of cells: rich's (cells between ┃ in the header, │ below) or a
    markdown table's (between |, its --- line left out)."""
    return [[cell.strip() for cell in re.split("[│┃|]", line.strip().strip("|"))] for line in out.splitlines()
            if re.search("[│┃]", line) or (line.startswith("|") and "---" not in line)]


def test_bench_executors_torch_side_trains_a_rank_and_records_when_each_mini_batch_finished(tmp_path):
    """One rank's body (_torch_rank: the rendezvous, torch_steps on pipesim's stages, each mini-batch's finish
    written) on a one-stage pipeline: spawning the benchmark's two ranks costs some 12 CPU s (each imports torch)."""
    threads = torch.get_num_threads()  # the rank sets one intra-op thread, as each benchmark rank runs
    with script_module("bench_executor") as bench, served_rendezvous() as rendezvous:
        config = bench.Config("1f1b", ranks=1, microbatches=2, microbatch_size=4, layers=2, width=16, warmup=1,
                              steps=2)
        try:
            bench._torch_rank(0, config, rendezvous, str(tmp_path))
        finally:
            torch.set_num_threads(threads)
            if dist.is_initialized():
                dist.destroy_process_group()
        finished_ns = json.loads((tmp_path / "rank0.json").read_text())
        step_ms = bench._step_ms(np.array(finished_ns), config.warmup)
    assert len(finished_ns) == config.warmup + config.steps and finished_ns == sorted(finished_ns)
    assert len(step_ms) == config.steps and min(step_ms) > 0


def test_bench_auto_times_autos_search_at_both_activation_limits(capsys):
    with script_module("bench_auto") as bench:
        bench.main(["time", "--sizes", "3x4", "--repeats", "1"])
    header, *rows = _table_rows(capsys.readouterr().out)
    assert header[:3] == ["p", "m", "R"] and [row[:3] for row in rows] == [["3", "4", "1"], ["3", "4", "2"]]
    assert all(float(row[-1]) > 0 for row in rows)  # the search's CPU seconds


def test_bench_sweep_times_a_sweep_and_counts_its_configurations(capsys):
    with script_module("bench_sweep") as bench:
        bench.main(["--workers", "1", "--stages", "2", "--microbatches", "4", "--chunks", "1", "--pipelines", "1",
                    "--cost-scale", "1"])
    header, (workers, configs, simulated, skipped, *_) = _table_rows(capsys.readouterr().out)
    assert header[:4] == ["workers", "configs", "simulated", "skipped"]
    assert workers == "1" and int(configs) == int(simulated) + int(skipped) and int(simulated) > 0


def test_cold_after_wait_times_each_stages_passes_after_each_wait(capsys):
    threads = torch.get_num_threads()  # the benchmark times one intra-op thread
    try:
        with script_module("cold_after_wait") as bench:
            bench.main(["--layers", "2", "--width", "16", "--microbatch-size", "1500", "--rounds", "2", "--repeats",
                        "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "mlp 2x16, b=1,500, stages" in " ".join(out.split())  # b grouped as every label writes it
    rows = _table_rows(out)[1:]
    contexts = ["back to back", "0.2 ms asleep", "1 ms asleep", "5 ms asleep"]
    assert [(row[0], row[1]) for row in rows] == [(k, context) for k in "01" for context in contexts]
    assert [row[4:6] for row in rows if row[1] == "back to back"] == [["1.000", "1.000"]] * 2
