"""A model's repeated blocks are priced once per setting: what the caching allocator replays of each layer
(`layer_allocations`) is, field for field, what pricing every layer on its own gives, on a dense GPT, a mixture of
experts and a Hugging Face model, under each recomputation and tensor parallelism."""

from pathlib import Path

import pytest

from pipesim.planning.estimate import Parallelism, _rank_allocations, _Split, layer_allocations

torch = pytest.importorskip("torch")
from pipesim.workload.count import count_built  # noqa: E402  (counting needs torch)

ROOT = Path(__file__).resolve().parents[1]
GPT = {"layers": 3, "width": 64, "heads": 4, "seq_len": 32, "vocab": 1000}
MODELS = {
    "gpt": ("gpt", GPT),
    "moe": ("gpt", {**GPT, "experts": 4, "top_k": 2, "expert_ffn": 128}),
    "hf": (f"hf:{ROOT / 'examples' / 'llama3.1-8b'}", {"seq_len": 16}),
}
SETTINGS = [Parallelism(), Parallelism(tensor=2, sequence_parallel=True), Parallelism(recompute="selective"),
            Parallelism(recompute="full"), Parallelism(recompute="op"),
            Parallelism(recompute_modules=("layernorm", "moe_act"))]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_repeated_blocks_allocations_are_each_layers_own(model):
    name, options = MODELS[model]
    counted = count_built(name, options, 2, torch.bfloat16)
    for parallel in SETTINGS:
        shared = layer_allocations(counted, parallel)
        assert shared == [_rank_allocations(layer, _Split.of(layer, parallel), parallel.recompute,
                                            parallel.recompute_modules) for layer in counted.layers], parallel
        blocks = [made for layer, made in zip(counted.layers, shared, strict=True) if "Block" in layer.name
                  or "DecoderLayer" in layer.name]
        assert len(blocks) >= 3 and all(block is blocks[0] for block in blocks)  # made once, shared
