"""Every bound tune prunes by is a lower bound of the step of each candidate it then simulates, on every kind of
profile it takes: what makes the pruned search return what the exhaustive one does (issue 40). A shape's bound
(`_shape_bound`), a flushing chain's over its best cut (`_best_cut_ms`), a partitioned order's before it is costed
or searched (`_planned_bound_ms`, `_searched_bound_ms`, `_searched_device_bound_ms`), the candidate's own
(`_costed`) and its critical path's (`_with_critical_path`), each against the simulated step; and what those read
of a stage before it is costed (`_splitter`'s `stage_ms`, `_cut_accumulates_ms`, `_ChainWork`'s layer sums, the
least REDUCE and transfers) against the stage's own costs, where a slack hidden by the step's other terms shows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.planning import tune as tuning
from pipesim.planning.scenario import profile_costs
from pipesim.profiles.schema import load_profile
from pipesim.schedules import METHODS
from tests.conftest import pipesim
from tests.helpers import CNN_CPU as CNN
from tests.helpers import GPT_CPU as GPT
from tests.helpers import (
    accumulating,
    bound_excesses,
    differences,
    exhaustive,
    searched_settings,
    stage_excesses,
)
from tests.helpers import adam_settings as scenario

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "traces" / "measured" / "fidelity-cpu2-day3-runs"
DEVICES, MICROBATCH = 4, 1
GPU = ("--gpu", "h100-sxm")
SMALL_GPT = ("--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256, "--vocab", 32000)
ESTIMATED = ("-D", DEVICES, "-B", 16, "-b", MICROBATCH, "--recompute", "none")
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Estimated:
    """The flags of `pipesim estimate` after the small GPT's on the GPU: a profile laid out with C > 1 or ZeRO,
    which `tune --profile` takes as it takes a calibrated one, its layout read from the profile
    (test_tune_layouts.py and test_tune_zero.py check the bounds of `tune --gpu` given those flags)."""

    flags: tuple


TINY_LLAMA = {**json.loads((EXAMPLES / "llama3.1-8b" / "config.json").read_text()),
              "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "vocab_size": 1000}
TINY_QWEN3_MOE = {**json.loads((EXAMPLES / "qwen3-30b-a3b" / "config.json").read_text()),
                  "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "head_dim": 64,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 1000,
                  "num_experts": 4, "num_experts_per_tok": 2}
EXPERTS = ("--experts", 4, "--top-k", 2)
KINDS = {  # name: the flags of `tune --gpu` after the model's (a large vocabulary: the embedding's stage holds most
    # weights), a Hugging Face config and the flags after it, a calibrated profile, or `pipesim estimate`'s flags for
    # a profile tune takes as calibrated (`Estimated`: C > 1, ZeRO)
    "estimate": (),
    "estimate, tensor-parallel": ("--tensor-parallel", 2),
    "estimate, fused accumulation": ("--grad-accumulation", "fused"),
    "estimate, separate accumulation": ("--grad-accumulation", "separate"),
    "estimate, host-bound": ("--host-kernel-us", 400),
    "estimate, host-bound under --p2p-sync": ("--host-kernel-us", 400, "--p2p-sync", "-s", "1f1b"),
    "estimate, experts": EXPERTS,
    "estimate, experts over 2 ranks in float8": (*EXPERTS, "--expert-parallel", 2, "--dtype", "fp8"),
    "estimate, tensor-parallel overlapped": ("--tensor-parallel", 2, "--sequence-parallel", "--tp-overlap"),
    "estimate, torch's tensor-parallel overlapped": ("--tensor-parallel", 2, "--sequence-parallel", "--tp-runtime",
                                                     "torch", "--tp-overlap"),
    "hf config": (TINY_LLAMA,),
    "hf config, tied head": ({**TINY_LLAMA, "tie_word_embeddings": True},),
    "hf config, experts over 2 ranks": (TINY_QWEN3_MOE, "--expert-parallel", 2),
    "estimated, context-parallel experts": Estimated(("-p", 2, "--data-parallel", 2, "--context-parallel", 2,
                                                      *EXPERTS, "--expert-parallel", 2, "--attention", "flash")),
    "estimated, ZeRO-3 pipelined": Estimated(("-p", 2, "--data-parallel", 2, "--zero", 3, "--precision", "fsdp2")),
    "calibrated, accumulation timed": lambda: accumulating(load_profile(GPT)),
    "calibrated, convolutions": lambda: load_profile(CNN),
    "calibrated, passes measured": lambda: load_profile(MEASURED / "mlp-profile.json"),
    "calibrated, branching layers": lambda: load_profile(MEASURED / "two-branch-profile.json"),
}

LAYOUTS = {  # what a kind's name says its estimates hold (their parallelism's fields), beyond a dense model's
    "estimate, experts over 2 ranks in float8": {"expert": 2, "fp8": "te"},
    "estimate, tensor-parallel overlapped": {"tensor": 2, "tp_overlap": True, "tp_runtime": "megatron"},
    "estimate, torch's tensor-parallel overlapped": {"tensor": 2, "tp_overlap": True, "tp_runtime": "torch"},
    "hf config, experts over 2 ranks": {"expert": 2},
    "estimated, context-parallel experts": {"context": 2, "expert": 2},
    "estimated, ZeRO-3 pipelined": {"pipeline": 2, "sharded_optimizer": True, "precision": "fsdp2"},
}


@cache
def settings_of(kind: str, folder: Path) -> tuple[tuple[tuple[int, ...], ...], tuple[tuning.Setting, ...]]:
    """The kind's settings (a Hugging Face config or an estimated profile written in `folder`), and the profiles'
    own cuts (where a calibrated profile's stages' own times, and an estimate's own accumulation, replace its layers'
    sums), which each is checked on beyond the candidates' cuts."""
    flags, place = KINDS[kind], folder / kind
    if callable(flags):
        found = scenario(flags())
    elif isinstance(flags, Estimated):
        place.mkdir()
        code, _, err = pipesim("estimate", *GPU, *SMALL_GPT, "--recompute", "none", "-b", MICROBATCH, *flags.flags,
                               "-o", place / "profile.json")
        assert code == 0, err
        found = scenario(load_profile(place / "profile.json"))
    elif flags and isinstance(flags[0], dict):
        place.mkdir()
        (place / "config.json").write_text(json.dumps(flags[0]))
        found = searched_settings(*ESTIMATED, "--tensor-parallel", 1, *flags[1:],
                                  model=(*GPU, "--model", f"hf:{place}", "--seq-len", 128))
    else:
        tensor = () if "--tensor-parallel" in flags else ("--tensor-parallel", 1)
        found = searched_settings(*ESTIMATED, *tensor, *flags, model=(*GPU, *SMALL_GPT))
    return tuple({tuple(s.scenario.measured.partition.bounds) for s in found}), tuple(found)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kinds")


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_each_kind_is_estimated_as_named(folder, kind):
    """A flag its estimates dropped would leave the bounds unchecked where the kind points them."""
    _, found = settings_of(kind, folder)
    assert found
    for setting in found:
        parallelism = setting.scenario.measured.estimate.parallelism
        assert {name: parallelism[name] for name in LAYOUTS[kind]} == LAYOUTS[kind]


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([name for name in METHODS if name != "auto"]), min_size=1, max_size=3, unique=True),
       st.booleans(), st.sampled_from([1, 2, 4]), st.integers(0, 1), st.integers(1, 2))
def test_every_bound_is_at_most_the_simulated_step(folder, kind, schedules, searched, per_device, staleness,
                                                   pipelines):
    """On small problems of each kind of profile tune takes, with fixed orders (interleaved and zero-bubble among
    them) and auto's searched one: every bound at or below the step simulated, every stage sum at or below the
    stage's cost, on each candidate's cut and the profile's own."""
    cuts, found = settings_of(kind, folder)
    if kind.endswith("--p2p-sync"):  # modelled for 1F1B alone
        schedules, searched = ["1f1b"], False
    microbatch = found[0].microbatch_size
    problem = tuning.Problem(DEVICES, 64 * tuning.GIB, per_device * DEVICES * microbatch,
                             (*schedules, *(["auto"] * searched)), staleness, max_chunks=2, max_pipelines=pipelines,
                             search_seconds=0.02)
    wrong = bound_excesses(list(found), problem)
    for setting in found:
        layers = len(setting.scenario.measured.layers)
        for cut in cuts:
            if cut[-1] == layers:
                costs = profile_costs(setting.scenario.measured, setting.scenario.optimizer, list(cut))
                wrong += stage_excesses(setting, list(cut), 1, costs, f"{kind}'s own cut {list(cut)}")
    assert wrong == []


@pytest.mark.parametrize("kind", sorted(set(KINDS) - {"estimate, experts"}))  # E searched: test_tune_experts
def test_search_equals_exhaustive_search_on_every_kind(folder, kind):
    """What the bounds are for: the pruned search's choice, runners-up, rows over the staleness limit and staler
    winner are the exhaustive search's, on every kind of profile, every method (auto's searched order too)."""
    _, found = settings_of(kind, folder)
    schedules = ("1f1b",) if kind.endswith("--p2p-sync") else tuple(METHODS)
    problem = tuning.Problem(DEVICES, 64 * tuning.GIB, 4 * DEVICES * found[0].microbatch_size, schedules,
                             max_chunks=2, max_pipelines=2, search_seconds=0.02)
    answer = tuning.tune(list(found), problem)
    best, faster, staler, results = exhaustive(list(found), problem)
    assert differences(answer, best, faster, staler) == []
    assert answer.stats.simulated < len(results) or kind.endswith("--p2p-sync")  # it pruned
