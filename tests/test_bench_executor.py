"""benchmarks/bench_executor.py's torch side, which no run of the benchmark in a test held: it called torch_steps with
an argument torch_steps had dropped, so every torch run failed (TypeError; e511b60d). One rank's body runs here, in
this process, on a one-stage pipeline (spawning ranks costs some 6 CPU s each: each imports torch)."""

import json

import numpy as np
import torch
import torch.distributed as dist

from pipesim.workload.transport import served_rendezvous
from tests.conftest import script_module


def test_the_torch_side_trains_a_rank_and_records_when_each_mini_batch_finished(tmp_path):
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
