"""A profile's stages are priced once (planning/scenario.py `profile_costs`, `_priced_stages`): a stage priced
again for another cut, optimizer or stage graph must be what pricing it afresh gives, so the memo's key must
hold everything a stage's costs read."""

import gc
import random

import pytest

from pipesim.planning import scenario, tune
from pipesim.planning.scenario import profile_costs
from pipesim.profiles.schema import ContentionProfile, load_profile, stages_for
from tests.helpers import GPT_CPU, with_passes


def _skipping(profile):
    """`profile` with every layer from the third on reading the one two before it too (a skip connection), so that
    a cut's stages form a DAG other than a chain and what a stage sends depends on the cut; every other layer
    saves its first input, none its output, so that the boundary tensors a stage holds depend on it too."""
    def inputs(i: int) -> list[int]:
        return [-1] if i == 0 else [i - 1] if i == 1 else [i - 1, i - 2]

    layers = [layer.model_copy(update={"inputs": inputs(i), "output_saved": False,
                                       "saved_input_bytes": [(i % 2) * layer.activation_bytes] + [0] * (i > 1)})
              for i, layer in enumerate(profile.layers)]
    return profile.model_copy(update={"layers": layers})


def _cuts(profile, count: int) -> list[list[int]]:
    """The calibrated cut, one that shares its first stage only, every layer a stage, and random cuts."""
    n, bounds = len(profile.layers), profile.partition.bounds
    rng = random.Random(0)
    cuts = [bounds, [0, bounds[1], n], list(range(n + 1)), bounds]
    for _ in range(count):
        cuts.append([0, *sorted(rng.sample(range(1, n), rng.randint(1, n - 2))), n])
    return cuts


PLAIN = load_profile(GPT_CPU)  # 16 layers in 4 stages


@pytest.mark.parametrize("profile", [PLAIN, with_passes(PLAIN, [1.5, 1.2, 1.1, 1.3], [2.0, 1.4, 1.6, 1.25]),
                                     _skipping(PLAIN)], ids=["layers", "passes", "skips"])
def test_a_stage_priced_before_is_what_pricing_it_afresh_gives(profile):
    for cut in _cuts(profile, 12):
        for optimizer in ("sgd", "adam"):
            for dag in (False, True):
                fresh = profile.model_copy(deep=True)  # no stage of it priced yet
                assert profile_costs(profile, optimizer, cut, dag) == profile_costs(fresh, optimizer, cut, dag)


def test_the_priced_stages_go_with_their_profile():
    profile = PLAIN.model_copy(deep=True)
    profile_costs(profile, "adam", profile.partition.bounds)
    key = id(profile)
    assert scenario._PRICED[key]
    del profile
    gc.collect()
    assert key not in scenario._PRICED


def test_a_cut_shares_out_only_the_optimizers_asked_for():
    """Pricing one optimizer's steps shares out its steps alone, the same as when every optimizer's are."""
    every = stages_for(PLAIN, _cuts(PLAIN, 0)[1])
    adam = stages_for(PLAIN, _cuts(PLAIN, 0)[1], optimizers=("adam",))
    assert [set(stage.steps) for stage in adam] == [{"adam"}] * len(every)
    assert [stage.steps["adam"] for stage in adam] == [stage.steps["adam"] for stage in every]
    assert [stage.model_copy(update={"steps": {}}) for stage in adam] == [
        stage.model_copy(update={"steps": {}}) for stage in every]


TAILED = PLAIN.model_copy(update={"contention": ContentionProfile(slowdown=[1.0], spread=[0.0], tail=1.37, meta={})})


@pytest.mark.parametrize("profile", [PLAIN, _skipping(PLAIN), TAILED, with_passes(PLAIN, [1.5, 1.2, 1.1, 1.3],
                                                                                 [2.0, 1.4, 1.6, 1.25])],
                         ids=["layers", "skips", "tail", "passes"])
def test_every_layer_as_a_stage_read_off_the_layers_is_what_pricing_each_gives(profile):
    """tune's splitter reads each layer's costs as a stage of its own off the layers at once (planning/tune.py
    `_each_layer_op_ms`): to the bit what `profile_costs` gives at every cut, for each number of pipelines."""
    every = range(len(profile.layers) + 1)
    for optimizer in ("sgd", "adam"):
        read, priced = tune._each_layer_op_ms(profile, optimizer), profile_costs(profile, optimizer, every)
        for pipelines in (1, 3):
            assert read(pipelines).tobytes() == priced.op_ms_table(pipelines).tobytes()
