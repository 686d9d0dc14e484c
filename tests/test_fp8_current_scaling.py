"""--fp8-recipe te-current: TransformerEngine's current scaling (Megatron-core's tensorwise, the FP8-CS of NVIDIA's
performance summaries) casts each tensor after its own amax: four kernels where delayed scaling runs one
(planning/fp8.py), everything else as te; published_moe runs it where a row's recipe did."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from pipesim.planning.estimate import Parallelism, estimate_layer
from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from tests.conftest import pipesim, simulate_json
from tests.helpers import H100_FP8 as DEVICE
from tests.helpers import H100_TENSOR_LINK as LINK
from tests.helpers import product_attention_layer as _layer

REPO = Path(__file__).resolve().parents[1]


def test_each_cast_reads_its_tensor_for_the_amax_then_casts_it_as_te_does():
    """Per cast of te's cast-transpose (reads 2 bytes an element, writes 2), te-current first zeroes the amax (a
    one-thread kernel: TransformerEngine's `zero_amax_kernel`, v2.9 to v2.14), runs an amax kernel reading the same
    2 bytes and a scale kernel of one value; the products and what the forward saves are te's."""
    layer = _layer(4096, 2048)
    te, current = (in_float8(layer, FP8_RECIPES[name], 2) for name in ("te", "te-current"))
    for name in ("fwd", "bwd"):
        te_casts = [op for op in te.ops[name] if op.op.startswith("fp8_")]
        casts = [op for op in current.ops[name] if op.op.startswith("fp8_")]
        assert te_casts and len(casts) == 4 * len(te_casts)
        for cast, (zero, amax, scale, again) in zip(te_casts, zip(*(casts[i::4] for i in range(4)))):
            assert again == cast and zero.moved_bytes == scale.moved_bytes == 0
            assert zero.op.startswith("fp8_zero_amax") and zero.count == cast.count
            assert amax.op.startswith("fp8_amax") and amax.moved_bytes * 2 == cast.moved_bytes
        assert [op for op in current.ops[name] if not op.op.startswith("fp8_")] == \
            [op for op in te.ops[name] if not op.op.startswith("fp8_")]
    assert current.saved_tensors == te.saved_tensors
    delayed, current = (estimate_layer(layer, DEVICE, Parallelism(fp8=name), LINK, 2) for name in ("te", "te-current"))
    assert current.fwd_ms > delayed.fwd_ms and current.activation_bytes == delayed.activation_bytes


GPT = ("--model", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len", "128", "--vocab", "1000",
       "--gpu", "h100-sxm", "--dtype", "fp8", "-s", "1f1b", "-p", "1", "-m", "2")


def test_the_cli_takes_it_and_names_it_when_refusing_another():
    (delayed,), (current,) = (simulate_json(*GPT, "--fp8-recipe", name) for name in ("te", "te-current"))
    assert current["time_per_minibatch_ms"] > delayed["time_per_minibatch_ms"]
    code, _, err = pipesim("simulate", *GPT, "--fp8-recipe", "nope")
    assert code == 2 and "te-current" in err and len(err.strip().splitlines()) == 1


def test_the_published_moe_rows_scale_as_their_recipes_did():
    """FP8-CS (25.11) and the 26.x rows' fp8cs recipes run current scaling; 25.09 states no precision: delayed.
    gpt-oss's rows are BF16 (their recipe's `_perf_precision("bf16")`) and scale nothing."""
    rows = json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
    scaled = 0
    for row in (row for row in rows if row["source"] == "nemo-megatron-bridge-moe-h100.csv"):
        args = shlex.split(row["command"])
        if args[args.index("--dtype") + 1] == "bf16":
            assert "--fp8-recipe" not in args and "GPT OSS" in row["run"], row["run"]
            continue
        scaled += 1
        want = "te" if row["run"].startswith("25.09") else "te-current"
        assert args[args.index("--fp8-recipe") + 1] == want, row["run"]
    assert scaled >= 14
