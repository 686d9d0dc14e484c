"""Hugging Face configs of the models of now that are not a plain decoder: a multimodal model's config (Gemma 3's,
Mistral 3's, Llama 4's as published) counted as its language model's part, its text_config, with a note naming
what is left out; linear-attention layers other than the gated delta rule (Kimi Linear's KDA) refused in one line, as
their torch fallback is not what a run computes; and a model whose own code fails on the meta device refused in
one line naming the layer, where it was a traceback."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from tests.conftest import needs_transformers, pipesim
from tests.helpers import LLAMA, S, count_config, write_config

pytestmark = needs_transformers

VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2}
KIMI_LINEAR = {"model_type": "kimi_linear", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
               "num_experts": 0, "linear_num_heads": 4, "linear_head_dim": 16, "pad_token_id": 0,
               "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "dense"]}


def test_a_multimodal_config_is_counted_as_its_text_config_and_says_what_it_leaves_out(tmp_path):
    """The language model's part counts exactly as the same config given alone, the top level's
    tie_word_embeddings over the part's (the composite model ties its head by it), and count says which model it
    is part of and which parts it leaves out: its encoders' configs, not its quantization_config."""
    from pipesim.workload.hfconfig import read_hf_config

    composite = {"model_type": "qwen3_vl", "tie_word_embeddings": False,
                 "text_config": {**LLAMA, "tie_word_embeddings": True}, "vision_config": VISION,
                 "audio_config": VISION, "quantization_config": {"quant_method": "fp8"}}
    alone, part = (count_config(tmp_path / name, fields)
                   for name, fields in (("alone", LLAMA), ("composite", composite)))
    assert [replace(layer, name="") for layer in part.layers] == [replace(layer, name="") for layer in alone.layers]
    read = read_hf_config(f"hf:{tmp_path / 'composite'}")
    assert read.fields["tie_word_embeddings"] is False and read.fields["model_type"] == "llama"
    code, _, err = pipesim("count", "--model", f"hf:{tmp_path / 'composite'}", "--seq-len", S)
    assert code == 0, err
    assert (f"note: hf:{tmp_path / 'composite'} is a qwen3_vl model: pipesim takes its language model, text_config "
            "(model_type llama); its audio_config and vision_config not") in " ".join(err.split()), err


def test_a_size_refused_in_the_language_part_names_the_part(tmp_path):
    folder = write_config(tmp_path / "vl", {"model_type": "gemma3", "vision_config": VISION,
                                            "text_config": {**LLAMA, "num_key_value_heads": 0}})
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --model hf:{folder}: {folder / 'config.json'}'s text_config: "), err


@pytest.mark.parametrize("command", [("simulate", "-p", 1, "-s", "1f1b"), ("tune", "--devices", 2)])
def test_a_what_if_of_a_multimodal_config_says_the_same_note_once(tmp_path, command):
    """tune counts the model once a micro-batch size and more: the note is said once, after the first count."""
    folder = write_config(tmp_path / "vl", {"model_type": "mistral3", "text_config": LLAMA, "vision_config": VISION})
    code, out, err = pipesim(command[0], "--gpu", "h100-sxm", "--model", f"hf:{folder}", "--seq-len", S,
                             *command[1:])
    assert code == 0 and out, err
    assert " ".join(err.split()).count("is a mistral3 model: pipesim takes its language model") == 1, err


def test_a_multimodal_config_refused_once_counted_is_one_line(tmp_path):
    """A part the count refuses is refused in one line, no note before it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_linear" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Kimi Linear")
    folder = write_config(tmp_path / "vl", {"model_type": "qwen3_5", "text_config": KIMI_LINEAR,
                                            "vision_config": VISION})
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", f"hf:{folder}", "--seq-len", S, "-p", 1)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and "linear attention" in err, err


def test_a_language_part_without_a_model_type_is_one_line(tmp_path):
    text = {key: value for key, value in LLAMA.items() if key != "model_type"}
    folder = write_config(tmp_path / "vl", {"model_type": "llava", "text_config": text, "vision_config": VISION})
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert (code, out) == (2, "") and err.strip().splitlines() == [
        f"error: --model hf:{folder}: {folder / 'config.json'}'s text_config (the language model pipesim counts of a "
        "llava model) has no model_type; add the one transformers knows it by"], err


def test_linear_attention_but_the_gated_delta_rule_is_refused_in_one_line(tmp_path):
    """Kimi Linear's KDA runs flash-linear-attention's fused chunk kernels, which pipesim does not count (the gated
    delta rule's it does: tests/test_gdn.py); on the meta device transformers runs its torch fallback (a loop over
    64-token chunks), which was counted and priced as hundreds of small kernels a layer."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_linear" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Kimi Linear")
    folder = write_config(tmp_path / "kimi", KIMI_LINEAR)
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --model hf:{folder}: its linear attention (KimiLinearDeltaAttention, in 1 layer) "
                          "runs fused chunk kernels"), err


@pytest.mark.parametrize("raised, said", [
    ("raise KeyError('a rotary table keyed otherwise')", "KeyError: 'a rotary table keyed otherwise'"),
    # torch refuses the product its code asks for, through the count's modes, which see every op
    ("return x @ torch.ones(3, 3)", "RuntimeError: "),
])
def test_a_models_own_code_failing_on_the_meta_device_is_one_line_naming_the_layer(tmp_path, monkeypatch, raised,
                                                                                  said):
    """A user's module whose forward raises: the count says which layer and what it raised, not a traceback."""
    (tmp_path / "broken_model.py").write_text(
        "import torch\n"
        "from pipesim.workload.models import build_model\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        f"        {raised}\n"
        "def model():\n"
        "    built = build_model('mlp', layers=2, width=8)\n"
        "    return type(built)(**{**built.__dict__, 'layers': [built.layers[0], Broken(), *built.layers[2:]]})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_model", raising=False)  # each case's own module
    code, out, err = pipesim("count", "--model", "broken_model:model")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert f"layer 1:Broken cannot run on torch's meta device to be counted: {said}" in err, err


def test_an_error_raised_in_pipesims_own_counting_code_keeps_its_traceback(monkeypatch):
    """Only the model's own code's errors are said in one line: one raised last in pipesim's own code is a bug of
    pipesim's, not the input's, and keeps its traceback (it read as bad input, exit 2)."""
    import pipesim.workload.count as count_module

    def broken(*args, **kwargs):
        raise IndexError("a bug of pipesim's")

    monkeypatch.setattr(count_module, "_count_layer", broken)
    with pytest.raises(IndexError, match="a bug of pipesim's"):
        pipesim("count", "--model", "gpt", "--layers", 1)


def test_a_config_whose_layers_each_give_their_own_heads_is_one_line(tmp_path):
    """transformers' heterogeneous configs (per_layer_config: dots.llm3's) raise on the global attribute pipesim
    reads one of for the whole model: refused in one line, where it was that error's traceback."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "dots3_note" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no dots3_note")
    # as transformers writes its own: the figures are read before the model is built
    folder = write_config(tmp_path / "dots", AutoConfig.for_model("dots3_note").to_dict())
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert "pipesim reads one num_attention_heads for all its layers, and transformers gives none" in err, err


@pytest.mark.parametrize("model_type", ["deepseek_v4", "hy_v4"])
def test_a_sparse_attentions_indexer_is_refused_in_one_line_before_the_model_is_built(tmp_path, model_type):
    """A sparse attention's indexer keeps index_topk keys a query (2,048 at DeepSeek-V3.2's 128k), where pipesim counts
    every key before each query but in the layers workload/dsa.py counts (DeepSeek-V3.2's, GLM-5's, tests/test_dsa.py):
    another's code may fail on the meta device, or run there and be priced dense."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    folder = write_config(tmp_path / model_type, AutoConfig.for_model(model_type).to_dict())
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --model hf:{folder}: its attention is sparse, an indexer keeping "), err
