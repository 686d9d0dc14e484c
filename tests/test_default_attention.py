"""A model's attention where --attention is not given is the one its runtime runs (workload/sizes.py
`attention_of`): a Hugging Face model's the fused kernel (flash), as transformers builds it (sdpa), the built-in
gpt's the scores materialised (math), as the Megatron-LM 2021 runs it reproduces; and tune searches sequence
parallelism at t > 1 where it is not given, and its table says so."""

from __future__ import annotations

import json

import pytest

from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import LLAMA, searched_settings, write_config

ON_GPU = ("--gpu", "h100-sxm", "-b", 1, "-p", 2, "-m", 4, "-s", "1f1b")
GPT = ("--model", "gpt", "--layers", 4, "--width", 64, "--heads", 4, "--seq-len", 256, "--vocab", 512)


def peak_and_step(*args) -> tuple[float, float]:
    (result,) = simulate_json(*args)
    return result["peak_memory_mb"], result["time_per_minibatch_ms"]


@needs_transformers
def test_a_hugging_face_model_runs_the_fused_kernel_unless_math_is_given(tmp_path):
    model = ("--model", f"hf:{write_config(tmp_path / 'llama', LLAMA)}", "--seq-len", 256)
    default, flash, math = (peak_and_step(*model, *ON_GPU, *given) for given in
                            ((), ("--attention", "flash"), ("--attention", "math")))
    assert default == flash
    assert math[0] > flash[0]  # the s x s scores saved


def test_the_built_in_gpt_keeps_the_scores_materialised_as_megatron_lm_2021_ran():
    default, flash, math = (peak_and_step(*GPT, *ON_GPU, *given) for given in
                            ((), ("--attention", "flash"), ("--attention", "math")))
    assert default == math
    assert math[0] > flash[0]


@needs_transformers
def test_a_hugging_face_models_context_ring_needs_no_attention_flag(tmp_path):
    """The ring runs on a fused kernel only (`check_ring_attention`): an hf model has one by default, the gpt not."""
    model = ("--model", f"hf:{write_config(tmp_path / 'llama', LLAMA)}", "--seq-len", 256)
    code, _, err = pipesim("simulate", *model, *ON_GPU, "--context-parallel", 2, "--json")
    assert code == 0, err
    code, _, err = pipesim("simulate", *GPT, *ON_GPU, "--context-parallel", 2)
    assert code == 2 and "give --attention flash" in err


def test_the_attention_help_says_each_models_default():
    code, out, _ = pipesim("simulate", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "flash for an hf: model" in text and "math for the built-in models" in text


TUNED = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
         "--vocab", 1000, "-D", 4, "-B", 16, "-b", 2, "--recompute", "none")


@pytest.mark.parametrize(("flags", "searched"), [((), {False, True}), (("--sequence-parallel",), {True}),
                                                  (("--no-sequence-parallel",), {False})])
def test_tune_searches_sequence_parallelism_at_t_above_one_where_it_is_not_given(flags, searched):
    settings = searched_settings(*flags, model=TUNED)  # TUNED in place of the default model: each flag once
    at = {t: {setting.sequence_parallel for setting in settings if setting.tensor == t} for t in (1, 2, 4)}
    assert at[2] == at[4] == searched
    assert at[1] == {False}  # nothing to split at t = 1, given or not: the JSON and note say the table's "-"
    assert all(setting.scenario.measured.estimate.parallelism.get("sequence_parallel", False)
               == setting.sequence_parallel for setting in settings)  # each priced as it says


def test_tunes_table_shows_sequence_parallelism_and_its_caption_says_it_was_searched():
    code, out, err = pipesim("tune", *TUNED, "-s", "1f1b", "--tensor-parallel", 2, "--json")
    assert code == 0, err
    assert isinstance(json.loads(out)["choice"]["sequence_parallel"], bool)
    code, out, err = pipesim("tune", *TUNED, "-s", "1f1b", "--tensor-parallel", 2)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "schedule" in line.split() and "sp" in line.split()).split()
    assert header[header.index("t") + 1] == "sp"
    assert "sequence parallelism (sp)" in " ".join(out.split())
    best = next(line for line in out.splitlines() if line.split()[:1] == ["best"]).split()
    assert best[header.index("sp") + 1] in ("on", "off")  # the row's mark stands under the header's empty column
