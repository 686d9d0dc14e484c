"""A --model that names no model (a Hugging Face example without hf:, a typo) is refused before torch is imported:
simulate --gpu, count, calibrate and run imported it first, 4 s of a 4.2 s refusal."""

from pathlib import Path

import pytest

from tests.conftest import pipesim, pipesim_fresh

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = [("simulate", "--gpu", "h100-sxm", "-p", 2, "-s", "1f1b"), ("count",),
            ("calibrate", "--stages", 2, "--out", "p.json"), ("run", "-s", "1f1b")]


@pytest.mark.parametrize("command", COMMANDS, ids=[command[0] for command in COMMANDS])
def test_an_unknown_model_is_refused_before_torch_is_imported(command, tmp_path):
    (done,), imported = pipesim_fresh((command[0], "--model", "llama3.1-8b", *command[1:]), cwd=tmp_path)
    assert done == (2, "", "error: --model: unknown 'llama3.1-8b'; choose from mlp, cnn, gpt, two-branch, or give "
                           "package.module:attribute or hf:PATH (a Hugging Face config.json); "
                           f"hf:{ROOT / 'examples' / 'llama3.1-8b'} is the nearest name that holds a config.json\n")
    assert "torch" not in imported
    assert not list(tmp_path.iterdir())


def test_the_names_refused_before_torch_are_the_built_in_models():
    """`model_name_refusal` knows the built-ins by workload/sizes.py's torch-free DEFAULT_SIZES; `build_model` builds
    them from workload/models.py's MODELS: a model added to one alone would be refused, or fail after torch."""
    from pipesim.workload.models import MODELS
    from pipesim.workload.sizes import DEFAULT_SIZES, model_name_refusal

    assert set(MODELS) == set(DEFAULT_SIZES)
    assert [model_name_refusal(name) for name in MODELS] == [None] * len(MODELS)


@pytest.mark.parametrize("model, hint", [
    ("hf:llama3.1-8b", "; hf:examples/llama3.1-8b is the nearest name that holds a config.json"),
    ("hf:examples/mixtral", "; hf:examples/mixtral-8x7b is the nearest name that holds a config.json"),
    ("hf:examples/Qwen3-30B-A3B", "; hf:examples/qwen3-30b-a3b is the nearest name that holds a config.json"),
    ("hf:examples/nothing-like-it", ""),
])
def test_a_config_that_is_not_there_names_the_nearest_that_is(model, hint, monkeypatch):
    """An example named without examples/, or misspelt: the refusal names the folder holding a config.json whose
    name is nearest, among the path's siblings and pipesim's examples, as the working folder reaches it."""
    monkeypatch.chdir(ROOT)
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "-p", 2, "-s", "1f1b")
    path = model.removeprefix("hf:")
    assert (code, out, err) == (2, "", f"error: --model {model}: no {path}; give hf:PATH, a config.json or a folder "
                                       f"holding one{hint}\n")


@pytest.mark.parametrize("model, folders", [
    ("hf:examples", "examples holds no config.json; its folders that do: deepseek-v3, deepseek-v3.2, glm-5, glm-5.2, "
                    "gpt-oss-120b, gpt-oss-20b, kimi-k2, llama3.1-405b, llama3.1-70b, llama3.1-8b, "
                    "llama4-maverick-17b-128e, mixtral-8x22b, mixtral-8x7b, nemotron-3-nano-30b-a3b, qwen3-235b-a22b, "
                    "qwen3-30b-a3b, qwen3-next-80b-a3b (give hf:examples/NAME)"),
    ("hf:docs", "docs holds no config.json, nor do its folders; give hf:PATH, a config.json or a folder holding one"),
])
def test_a_folder_of_configs_names_the_configs_it_holds(model, folders, monkeypatch):
    """hf:examples, a folder of configs with no config.json of its own: the refusal names its folders that hold one,
    where it said only that examples/config.json is not there."""
    monkeypatch.chdir(ROOT)
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "-p", 2, "-s", "1f1b")
    assert (code, out, err) == (2, "", f"error: --model {model}: {folders}\n")


@pytest.mark.parametrize("flags, refusal", [
    (("--seq-len", 0), "--seq-len: give a whole number from 1 to 1,048,576 (got 0)"),
    (("--seq-len", 512, "--mtp-layers", -1), "--mtp-layers: give a whole number from 0 to 10,000 (got -1)"),
    (("--seq-len", 512, "--capacity-factor", "inf"), "--capacity-factor: give a finite number above 0 (got inf)"),
    (("--seq-len", 512, "--layers", 2), "--layers does not apply to {model}: its config gives its sizes (--seq-len, "
                                        "--mtp-layers and --capacity-factor are the ones it takes)"),
])
@pytest.mark.parametrize("command", [("count",), ("simulate", "--gpu", "h100-sxm", "-p", 2, "-s", "1f1b")],
                         ids=["count", "simulate"])
def test_an_hf_configs_flag_sizes_out_of_bounds_are_refused_before_torch_is_imported(command, flags, refusal):
    """--seq-len 0 of hf:examples/mixtral-8x7b (docs/hardware.md: "refused in one line before torch is imported")
    was refused once torch and transformers had read the config, 11 s; --capacity-factor 0 or inf, 16 s; --layers,
    which its config gives, 17 s."""
    model = f"hf:{ROOT / 'examples' / 'mixtral-8x7b'}"
    (done,), imported = pipesim_fresh((command[0], "--model", model, *command[1:], *flags))
    assert done == (2, "", f"error: {refusal.format(model=model)}\n")
    assert "torch" not in imported


@pytest.mark.parametrize("model, flags, refusal", [
    ("mlp", ("--seq-len", 0), "--seq-len does not apply to mlp (it takes --layers, --width)"),
    ("mlp", ("--capacity-factor", 0), "--capacity-factor does not apply to mlp (it takes --layers, --width)"),
    ("mine.models:net", ("--mtp-layers", -1), "--mtp-layers applies to the built-in models only; mine.models:net is "
                                              "built by its own code"),
])
def test_a_size_flag_a_model_does_not_take_is_refused_as_such_whatever_its_value(model, flags, refusal):
    """The bounds an hf: config's flags are checked against before torch's import (workload/sizes.py
    `flag_sizes_refusal`) are not another model's: `count --model mlp --seq-len 0` was told "--seq-len must be >=
    1", and given 1, that --seq-len does not apply to mlp."""
    assert pipesim("count", "--model", model, *flags) == (2, "", f"error: {refusal}\n")


HF_COMMANDS = [("simulate", "--gpu", "h100-sxm", "-p", 2, "-s", "1f1b"), ("tune", "--gpu", "h100-sxm", "--devices", 8),
               ("sweep", "--gpu", "h100-sxm"), ("estimate", "--gpu", "h100-sxm", "--out", "p.json"), ("count",),
               ("calibrate", "--out", "p.json")]


def test_an_hf_config_without_seq_len_is_refused_before_torch_is_imported(tmp_path):
    """Every command that builds an hf: model refuses a missing --seq-len, or one past the config's
    max_position_embeddings, from the config itself: it was refused once torch and transformers had built the model,
    10-14 s (`simulate --gpu h100-sxm --model hf:examples/llama3.1-70b`), and calibrate read no size flag before."""
    model = f"hf:{ROOT / 'examples' / 'llama3.1-70b'}"
    runs, imported = pipesim_fresh(*((command[0], "--model", model, *command[1:]) for command in HF_COMMANDS),
                                   ("count", "--model", model, "--seq-len", 999_999), cwd=tmp_path)
    missing = (f"error: --seq-len: give the tokens a sample of {model} holds (up to its max_position_embeddings, "
               "131,072)\n")
    assert [tuple(done) for done in runs] == [(2, "", missing)] * len(HF_COMMANDS) + [
        (2, "", f"error: --seq-len 999,999: {model} takes at most its max_position_embeddings, 131,072\n")]
    assert not {"torch", "transformers"} & imported and not list(tmp_path.iterdir())


def test_a_built_in_models_size_out_of_bounds_is_refused_before_torch_is_imported(tmp_path):
    """`run --model mlp --layers 0` was refused by the model's build, after torch's import and the ranks' server,
    12 s; calibrate's and the others' likewise: a built-in's own sizes are checked from the flags first."""
    runs, imported = pipesim_fresh(("run", "-s", "1f1b", "--model", "mlp", "--layers", 0),
                                   ("calibrate", "--model", "gpt", "--width", 2**30, "--out", "p.json"), cwd=tmp_path)
    assert [tuple(done) for done in runs] == [
        (2, "", "error: --layers: give a whole number from 1 to 10,000 (got 0)\n"),
        (2, "", "error: --width: give a whole number from 1 to 1,048,576 (got 1,073,741,824)\n")]
    assert "torch" not in imported and not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", [("calibrate", "--out", "p.json"), ("run", "-s", "1f1b"),
                                     ("study", "-s", "1f1b", "--no-timing")], ids=["calibrate", "run", "study"])
def test_more_stages_than_a_built_in_models_layers_are_refused_before_torch_is_imported(command, tmp_path):
    """A built-in model's layers follow from its --layers (workload/sizes.py `built_in_layers`): `calibrate --model
    mlp --stages 20` was refused after torch's import and the processes' server (8.8 s), run's and study's likewise;
    study in words of its own."""
    (done,), imported = pipesim_fresh((*command, "--model", "mlp", "--layers", 3, "--stages", 20), cwd=tmp_path)
    layers = "error: --stages 20: mlp of 3 blocks (--layers) has 4 layers in all; give at most 4 stages"
    emptying = ", or a cut that may leave stages between the first and the last empty (--stage-cut layout:STRING or " \
               "layers:N,N,...)\n"  # run takes a layout's cut
    assert done == (2, "", layers + (emptying if command[0] == "run" else " (each needs at least one layer)\n"))
    assert "torch" not in imported and "multiprocessing.forkserver" not in imported
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("blocks", [1, 3])
def test_a_built_in_models_layers_are_known_before_it_is_built(blocks):
    """`built_in_layers`, which refuses stages before torch is imported, counts the layers `build_model` makes."""
    from pipesim.workload.models import MODELS, build_model
    from pipesim.workload.sizes import built_in_layers

    assert {name: built_in_layers(name, blocks) for name in MODELS} == {
        name: len(build_model(name, layers=blocks).layers) for name in MODELS}
