"""Every published run of benchmarks/published/ (the papers' tables) predicted on a100-sxm-80gb, nothing fitted.

Per row: the GPT counted by torch on the meta device at the run's micro-batch size (fp16, the scores
materialised as Megatron-LM ran them, its 0.1 dropouts), estimated per GPU for its t, p, d and recomputation
(planning/estimate.py), cut into p (or p·v, interleaved) stages of equal blocks (the embedding with the first,
the head with the last, as Megatron places them), then simulated for one iteration (1F1B or interleaved 1F1B,
the data-parallel all-reduce a REDUCE row on the network, every chunk's after the pipeline has flushed as
Megatron-LM's DDP runs it) and compared:

- Korthikanti et al. 2022, Table 5: iteration seconds, full recomputation, and sequence parallelism with
  selective recomputation;
- Korthikanti et al. 2022, Table 4: one layer of the 22B model (t = 8), forward and backward ms;
- Narayanan et al. 2021 (Megatron-LM), Table 1: TFLOP/s per GPU by the paper's Eq. 3 (which counts the
  recomputed forward) from the predicted iteration time.

    python benchmarks/published_runs.py                 # the table
    python benchmarks/published_runs.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Parallelism, estimate_profile
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.schema import Profile
from pipesim.schedules import ScheduleParams
from pipesim.sim import simulate
from pipesim.traces.metrics import summarize
from pipesim.workload.count import WorkloadCount, count_built

PUBLISHED = Path(__file__).resolve().parent / "published"  # the papers' tables; README.md there says how to read them
SEQ, VOCAB = 2048, 51200
DROPOUT = 0.1  # Megatron-LM's GPT default (--attention-dropout, --hidden-dropout), as both papers ran
GPU = load_catalogue().find("a100-sxm-80gb")


@dataclass(frozen=True)
class Run:
    """One published configuration: the model, its parallelism and schedule."""

    name: str
    layers: int
    hidden: int
    heads: int
    tensor: int
    pipeline: int
    data: int
    microbatch_size: int
    microbatches: int
    chunks: int  # v: model chunks per device (1: plain 1F1B)


@cache
def _counted(layers: int, hidden: int, heads: int, b: int) -> WorkloadCount:
    return count_built("gpt", dict(layers=layers, width=hidden, heads=heads, seq_len=SEQ, vocab=VOCAB,
                                   dropout=DROPOUT), b, torch.float16, "math")


def _bounds(layers: int, stages: int) -> list[int]:
    """Blocks 1..layers split evenly over `stages`, the embedding (layer 0) with the first, the head with the
    last."""
    per = layers // stages
    return [0, *(1 + per * k for k in range(1, stages)), layers + 2]


def estimated(run: Run, parallel: Parallelism) -> Profile:
    counted = _counted(run.layers, run.hidden, run.heads, run.microbatch_size)
    return estimate_profile(counted, GPU, parallel, bounds=_bounds(run.layers, run.pipeline * run.chunks))


def iteration_s(run: Run, sequence_parallel: bool, recompute: str) -> float:
    """One iteration (a mini-batch's m micro-batches, its all-reduce and the optimizer step), simulated."""
    parallel = Parallelism(tensor=run.tensor, pipeline=run.pipeline, data=run.data,
                           sequence_parallel=sequence_parallel, recompute=recompute)
    profile = estimated(run, parallel)
    scenario = replace(profile_scenario(profile, "adam"), overlap_comm=False)  # Megatron-LM waits on its p2p
    bounds = profile.partition.bounds
    method = "interleaved-1f1b" if run.chunks > 1 else "1f1b"
    params = ScheduleParams(run.pipeline, run.microbatches, 1, run.chunks, data_parallel=run.data,
                            reduce_after_flush=True)  # Megatron-LM's DDP all-reduces once the pipeline has flushed
    schedule = scenario.build(method, params, bounds)
    trace = simulate(schedule, scenario.costs(schedule, bounds), scenario.links(schedule))
    return summarize(trace).makespan_ms / 1e3


def _rows(name: str) -> list[dict[str, str]]:
    with (PUBLISHED / name).open() as f:
        return list(csv.DictReader(f))


def korthikanti() -> list[dict]:
    out = []
    for row in _rows("korthikanti-2022.csv"):
        t, p, gpus, batch, b = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "gpus", "global_batch",
                                                        "microbatch_size"))
        run = Run(row["model"], int(row["layers"]), int(row["hidden"]), int(row["heads"]), t, p, gpus // (t * p), b,
                  batch // (gpus // (t * p) * b), int(row["interleaved_stages"] or 1))
        for column, sp, recompute in (("iteration_s_full_recompute", False, "full"),
                                      ("iteration_s_sequence_parallel_selective_recompute", True, "selective")):
            out.append(_row(f"Korthikanti {run.name} {'SP + selective' if sp else 'full recompute'}", "s",
                            iteration_s(run, sp, recompute), float(row[column])))
    return out


def korthikanti_layer() -> list[dict]:
    run = Run("22B", 48, 6144, 64, 8, 1, 1, 4, 1, 1)
    settings = {"baseline no recompute": (False, "none"), "sequence parallelism": (True, "none"),
                "baseline with full recompute": (False, "full"), "selective recompute": (False, "selective"),
                "selective recompute + sequence parallelism": (True, "selective")}
    out = []
    for row in _rows("korthikanti-2022-layer.csv"):
        sp, recompute = settings[row["experiment"]]
        layer = estimated(run, Parallelism(tensor=8, sequence_parallel=sp, recompute=recompute)).layers[1]
        out.append(_row(f"Korthikanti layer {row['experiment']}: forward", "ms", layer.fwd.median_ms,
                        float(row["forward_ms"])))
        out.append(_row(f"Korthikanti layer {row['experiment']}: backward", "ms", layer.bwd.median_ms,
                        float(row["backward_ms"])))
    return out


def megatron() -> list[dict]:
    out = []
    for row in _rows("megatron-2021-table1.csv"):
        t, p, gpus, batch, b, layers, hidden = (int(row[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "gpus", "global_batch", "microbatch_size", "layers", "hidden"))
        d = gpus // (t * p)
        per_virtual = row["layers_per_virtual_stage"]
        chunks = layers // p // int(per_virtual) if per_virtual else 1
        run = Run(f"{row['params_billion']}B", layers, hidden, int(row["heads"]), t, p, d, b, batch // (d * b), chunks)
        seconds = iteration_s(run, False, "full")
        flops = 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
        out.append(_row(f"Megatron {run.name} (t{t} p{p} d{d} v{chunks})", "TFLOP/s/GPU",
                        flops / (seconds * gpus) / 1e12, float(row["tflops_per_gpu"])))
    return out


def _row(name: str, unit: str, predicted: float, published: float) -> dict:
    return {"run": name, "unit": unit, "predicted": predicted, "published": published,
            "error": predicted / published - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = korthikanti() + korthikanti_layer() + megatron()
    width = max(len(r["run"]) for r in rows)
    print(f"{'run':<{width}}  {'unit':<11} {'predicted':>10} {'published':>10} {'error':>8}")
    for r in rows:
        print(f"{r['run']:<{width}}  {r['unit']:<11} {r['predicted']:>10.2f} {r['published']:>10.2f} "
              f"{r['error']:>+8.1%}")
    errors = [abs(r["error"]) for r in rows]
    print(f"|error|: median {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)} rows "
          f"(within 10 %: {sum(e <= 0.10 for e in errors)})")
    if args.json:
        args.json.write_text(json.dumps({"gpu": "a100-sxm-80gb", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
