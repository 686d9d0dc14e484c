"""A model's repeated blocks are priced once per setting, those of a few kinds in turn once a kind: its estimated
profile (`estimate_profile`) and what the caching allocator replays of each layer (`layer_allocations`) are, field
for field, what pricing every layer on its own gives, on a dense GPT, a mixture of experts, a Hugging Face model and
gpt-oss's sliding and full attention in turn, under each recomputation and tensor, pipeline and expert parallelism."""

from dataclasses import replace
from pathlib import Path

import pytest

from pipesim.planning.estimate import Parallelism, allocations_key, estimate_profile, layer_allocations
from pipesim.profiles.workload import LayerCount
from tests.helpers import GPT_OSS, H100, count_config

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


def _unrepeated(counted, monkeypatch):
    """`counted` as a count of its own in which no layer repeats another, each made and priced anew (a count finds
    its repeats once, `WorkloadCount.same_as`): compare only what was made from `counted` before this."""
    monkeypatch.setattr(LayerCount, "__eq__", lambda a, b: a is b)
    anew = replace(counted, layers=list(counted.layers))
    assert set(anew.same_as) == {None} and sum(same is not None for same in counted.same_as) >= 2
    return anew


def test_blocks_of_two_kinds_in_turn_are_each_priced_once_and_as_alone(tmp_path, monkeypatch):
    """gpt-oss's layers alternate sliding-window and full attention, so no block is the one before it: each is the
    first of its kind (`WorkloadCount.same_as`), and the estimate, priced once a kind, is every layer's own (it took
    a tune of gpt-oss-20b on 8 H100s from 19 s to 6 s, the same answer)."""
    kinds = ["sliding_attention", "full_attention"] * 2
    counted = count_config(tmp_path / "oss", {**GPT_OSS, "num_hidden_layers": 4, "layer_types": kinds}, "flash")
    assert counted.same_as == (None, None, None, 1, 2, None, None)  # embedding, 4 blocks, norm, head
    assert counted.layers[1] != replace(counted.layers[2], name=counted.layers[1].name,
                                        inputs=counted.layers[1].inputs)  # the window tells them apart
    settings = [Parallelism(pipeline=2, data=2, expert=2), Parallelism(tensor=2, sequence_parallel=True),
                Parallelism(recompute="full")]
    shared = [(estimate_profile(counted, H100, parallel), layer_allocations(counted, parallel))
              for parallel in settings]
    anew = _unrepeated(counted, monkeypatch)
    for (profile, allocations), parallel in zip(shared, settings, strict=True):
        alone = estimate_profile(anew, H100, parallel)
        assert profile.model_dump(exclude={"environment"}) == alone.model_dump(exclude={"environment"}), parallel
        assert allocations == layer_allocations(anew, parallel), parallel


@pytest.mark.parametrize("model", sorted(MODELS))
def test_repeated_blocks_allocations_are_each_layers_own(model, monkeypatch):
    name, options = MODELS[model]
    counted = count_built(name, options, 2, torch.bfloat16)
    shared_by_setting = [layer_allocations(counted, parallel) for parallel in SETTINGS]
    anew = _unrepeated(counted, monkeypatch)
    for parallel, shared in zip(SETTINGS, shared_by_setting, strict=True):
        assert shared == layer_allocations(anew, parallel), parallel  # field for field, the replay's too (2c6bd6a)
        blocks = [made for layer, made in zip(counted.layers, shared, strict=True) if "Block" in layer.name
                  or "DecoderLayer" in layer.name]
        assert len(blocks) >= 3 and all(block is blocks[0] for block in blocks)  # made once, shared


@pytest.mark.parametrize("model", sorted(MODELS))
def test_repeated_blocks_estimate_is_each_layers_own(model, monkeypatch):
    name, options = MODELS[model]
    counted = count_built(name, options, 2, torch.bfloat16)
    settings = [Parallelism(pipeline=2, data=2), Parallelism(tensor=2, pipeline=2, sequence_parallel=True),
                Parallelism(pipeline=2, recompute="full", data=2, expert=2 if model == "moe" else 1)]
    shared = [estimate_profile(counted, H100, parallel) for parallel in settings]
    blocks = [layer for layer in shared[0].layers if "Block" in layer.name or "DecoderLayer" in layer.name]
    assert len(blocks) >= 3 and len({layer.name for layer in blocks}) == len(blocks)
    anew = _unrepeated(counted, monkeypatch)
    for profile, parallel in zip(shared, settings, strict=True):
        alone = estimate_profile(anew, H100, parallel)
        assert profile.model_dump(exclude={"environment"}) == alone.model_dump(exclude={"environment"}), parallel
        assert profile.layers == alone.layers


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_allocations_read_neither_depth_nor_replicas_but_fsdp2s(model):
    """tune replays one allocation list per `allocations_key` (commands/tune.py `_estimated_settings`): at each p and
    d it is the list made there; under FSDP2 the replicas shard the gradients, so d stays in the key."""
    name, options = MODELS[model]
    counted = count_built(name, options, 2, torch.bfloat16)
    expert = 2 if model == "moe" else 1
    for parallel in (Parallelism(pipeline=2, data=4, expert=expert), Parallelism(pipeline=3, data=2, recompute="full"),
                     Parallelism(tensor=2, pipeline=2, data=2, sequence_parallel=True, sharded_optimizer=True),
                     Parallelism(pipeline=2, data=4, precision="fsdp2", expert=expert)):
        assert layer_allocations(counted, parallel) == layer_allocations(counted, allocations_key(parallel)), parallel
    fsdp2 = Parallelism(data=4, precision="fsdp2")
    assert allocations_key(fsdp2).data == 4
    assert layer_allocations(counted, fsdp2) != layer_allocations(counted, replace(fsdp2, data=2))


def test_the_version_is_read_once_a_process(monkeypatch):
    import importlib.metadata

    from pipesim.planning import estimate

    reads = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or "0.1.0")
    estimate._version.cache_clear()
    counted = count_built("gpt", GPT, 2, torch.bfloat16)
    for p in (1, 2):
        assert estimate_profile(counted, H100, Parallelism(pipeline=p)).environment.pipesim_version == "0.1.0"
    estimate._version.cache_clear()  # the monkeypatched figure goes with the patch
    assert reads == ["pipesim"]
