"""Estimated profiles and their layers' allocations for a grid of models and parallelisms, held against digests
recorded from the estimate before it was made faster for tune (tests/estimate_digests.json), so a faster estimate
that changes one figure of one profile fails here. Recorded with
`python -c "import json, tests.test_estimate_digests as t; json.dump(t.digests(), open(t.RECORDED, 'w'), indent=0)"`.
"""

import hashlib
import json
from dataclasses import fields
from pathlib import Path

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import EstimateError, Parallelism, estimate_profile, layer_allocations

torch = pytest.importorskip("torch")
from pipesim.workload.count import count_built  # noqa: E402  (counting needs torch)

RECORDED = Path(__file__).with_name("estimate_digests.json")
GPT = {"layers": 4, "width": 128, "heads": 16, "seq_len": 32, "vocab": 1000}
MODELS = {"gpt": ("gpt", GPT, "flash"), "moe": ("gpt", {**GPT, "experts": 4, "top_k": 2, "expert_ffn": 128}, "math")}
PARALLELISMS = [
    Parallelism(), Parallelism(pipeline=2, data=2), Parallelism(pipeline=3, data=4),
    Parallelism(tensor=2, pipeline=2, data=2, sequence_parallel=True),
    Parallelism(tensor=4, pipeline=4, data=2, recompute="selective"),
    Parallelism(pipeline=2, data=8, recompute="full", sharded_optimizer=True),
    Parallelism(tensor=2, pipeline=6, data=4, recompute="full", sharded_optimizer=True, ema="gpu"),
    Parallelism(pipeline=3, data=2, recompute="op", precision="fsdp2"),
    Parallelism(tensor=2, pipeline=2, data=2, sequence_parallel=True, tp_overlap=True, fp8="te"),
    Parallelism(tensor=2, pipeline=2, data=4, sequence_parallel=True, tp_overlap=True, tp_runtime="torch"),
    Parallelism(tensor=16, pipeline=2, data=2, rank_order="megatron", grad_accumulation="fused"),
    Parallelism(pipeline=2, data=2, context=2), Parallelism(tensor=2, pipeline=2, data=2, context=4),
    Parallelism(pipeline=2, data=4, expert=4), Parallelism(tensor=2, pipeline=3, data=4, expert=4, expert_tensor=1,
                rank_order="megatron"),
    Parallelism(pipeline=2, data=4, expert=2, token_dispatcher="deepep", recompute="full"),
    Parallelism(pipeline=2, data=2, recompute_modules=("layernorm", "moe_act")),
]
BATCHES = (1, 2)
VARYING = {"date", "python_version", "pipesim_version"}  # of the environment: when and where, not what


def digests() -> dict[str, str]:
    """Per model, micro-batch size and parallelism: the hash of each optimizer's profile (its JSON, the
    environment's `VARYING` fields aside) and of the layers' allocations; the refusal's message where refused."""
    h100 = load_catalogue().find("h100-sxm")
    found = {}
    for model, (name, options, attention) in MODELS.items():
        for b in BATCHES:
            counted = count_built(name, options, b, torch.bfloat16, attention)
            for parallel in PARALLELISMS:
                digest = hashlib.sha256()
                for optimizer in ("adam", "sgd"):
                    try:
                        profile = estimate_profile(counted, h100, parallel, optimizer=optimizer)
                    except EstimateError as exc:
                        digest.update(f"refused: {exc}".encode())
                        continue
                    dumped = profile.model_dump(mode="json")
                    for field in VARYING:
                        del dumped["environment"][field]
                    digest.update(json.dumps(dumped, sort_keys=True).encode())
                for made in layer_allocations(counted, parallel):
                    digest.update(repr((sorted(made.passes.items()), sorted(made.saved), made.rerun and sorted(
                        made.rerun), sorted(made.kept))).encode())
                given = " ".join(f"{field.name}={getattr(parallel, field.name)}" for field in fields(parallel)
                                 if getattr(parallel, field.name) != field.default)
                found[f"{model} b={b} {given}"] = digest.hexdigest()
    return found


def test_estimates_are_the_recorded_ones():
    recorded = json.loads(RECORDED.read_text())
    now = digests()
    assert now.keys() == recorded.keys()
    assert [key for key in recorded if now[key] != recorded[key]] == []
