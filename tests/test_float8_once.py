"""An estimate builds a layer's float8 form once (planning/fp8.py `Float8Forms`): its passes on the GPU and beside the
dispatcher's kernels, its routed experts' part, its persistent products and the host's issue of its kernels all read
the one form of each layer (with a context ring, of the layer as the ring keeps it), and a stage's weight casts once
a step are found once a layer, not once per stage and repeated block (`_step_casts_ms`; docs/hardware.md, "The time
model"). The tests record the calls of `in_float8` and of `step_cast_ops` in one estimate, under four settings
(dropless experts with the host's waits and paired passes; current scaling with sequence parallelism and a p2p context
ring; torchao under full recomputation; float8 weight gathers), and fail if a (layer, recipe) is converted twice or
the casts are found for other layers than the count's unrepeated ones."""

import pytest

from pipesim.planning import estimate, fp8, host
from pipesim.planning.estimate import Parallelism, estimate_profile
from tests.helpers import H100

torch = pytest.importorskip("torch")
from pipesim.workload.count import count_built  # noqa: E402  (counting needs torch)

MOE = {"layers": 3, "width": 64, "heads": 4, "seq_len": 64, "vocab": 1000, "experts": 4, "top_k": 2,
       "expert_ffn": 128}
SETTINGS = [Parallelism(fp8="te", pipeline=2, data=2, expert=2),  # dropless experts: the host waits, paired passes
            Parallelism(fp8="te-current", tensor=2, sequence_parallel=True, data=2, context=2, cp_rotate="p2p",
                        expert=2),
            Parallelism(fp8="torchao", recompute="full", pipeline=3),
            Parallelism(fp8="te", fp8_param_gather=True, data=2, pipeline=3)]
NAMES = ["te-paired-experts", "te-current-context-p2p", "torchao-full", "te-param-gather"]


@pytest.fixture(scope="module")
def counted():
    return count_built("gpt", MOE, 2, torch.bfloat16, "flash")


@pytest.mark.parametrize("parallel", SETTINGS, ids=NAMES)
def test_each_layers_float8_form_is_built_once(counted, parallel, monkeypatch):
    built = []

    def recorded(layer, recipe, element_bytes):
        built.append((layer, recipe))
        return convert(layer, recipe, element_bytes)

    convert = fp8.in_float8
    for module in (fp8, estimate, host):  # wherever the planner takes it from
        if hasattr(module, "in_float8"):
            monkeypatch.setattr(module, "in_float8", recorded)
    estimate_profile(counted, H100, parallel)
    assert len(built) >= 2  # the blocks' and their routed parts' at least
    again = [i for i, form in enumerate(built) if form in built[:i]]
    assert not again, [built[i][0].name for i in again]


@pytest.mark.parametrize("parallel", SETTINGS, ids=NAMES)
def test_each_layers_step_casts_are_found_once(counted, parallel, monkeypatch):
    cast = []

    def recorded(layer, *args):
        cast.append(layer)
        return find(layer, *args)

    find = estimate.step_cast_ops
    monkeypatch.setattr(estimate, "step_cast_ops", recorded)
    profile = estimate_profile(counted, H100, parallel)
    assert cast == [layer for layer, same in zip(counted.layers, counted.same_as) if same is None]
    assert sum(same is not None for same in counted.same_as) >= 2 and len(profile.stages) == parallel.pipeline
