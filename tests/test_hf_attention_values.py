"""Off the meta device (run trains it, calibrate times it) a Hugging Face model's layers compute what transformers'
own model computes (workload/hf.py `counted_attention`): the sliding windows of gpt-oss, Mistral and Gemma 2, gpt-oss's
attention sinks and Gemma 2's capped scores, against the model run with transformers' eager attention on the same
weights and tokens; and a config's profile builds the model again (run, the fitted curve's count)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipesim.executor import RunSpec
from pipesim.workload.hf import _base_model, hf_model
from tests.conftest import build, compiling_checkpointed_hf, needs_transformers, pipesim
from tests.helpers import write_config
from tests.reference import single_process

pytestmark = needs_transformers

SEQ, WINDOW = 12, 4  # the window shorter than the sequence
SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 64,
         "sliding_window": WINDOW, "initializer_range": 0.2, "tie_word_embeddings": False}
# a windowed layer, then a global one where the model alternates them; gpt-oss with sinks and 4 experts, 2 a token
MODELS = {"gpt_oss": {"layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
                      "num_local_experts": 4, "num_experts_per_tok": 2},
          "gemma2": {"layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 5.0},
          "mistral": {},
          # Llama 4's layout (transformers' Llama4ForCausalLM, whose decoder is its `model`): a dense layer with RoPE
          # attending within chunks of 5 tokens (12 = 5 + 5 + 2), then a mixture of 4 experts, top 1, without RoPE,
          # attending to every earlier token, its queries scaled by position (temperature tuning)
          "llama4_text": {"intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1,
                          "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 5,
                          "floor_scale": 4}}


def _pipesim_and_eager(tmp_path, model_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of pipesim's layers run one after another and of transformers' model (eager attention) holding
    the same weights, for the same tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_config(tmp_path / model_type, {**SMALL, "model_type": model_type, **MODELS[model_type]})
    torch.manual_seed(0)
    layers = hf_model(f"hf:{folder}", SEQ).layers
    with torch.no_grad():  # each head's sink logit (gpt-oss's) far from the others': dropping it moves every output
        for sinks in (module.sinks for layer in layers for module in layer.modules() if hasattr(module, "sinks")):
            sinks.copy_(torch.linspace(-2.0, 3.0, sinks.numel()))
    eager = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation="eager")
    base = _base_model(eager)
    for theirs, ours in zip([base.embed_tokens, *base.layers, base.norm], layers):
        theirs.load_state_dict(getattr(ours, "layer", ours).state_dict())
    eager.get_output_embeddings().load_state_dict(getattr(layers[-1], "head", layers[-1]).state_dict())
    tokens = torch.randint(SMALL["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    hidden = tokens
    with torch.no_grad():
        for layer in layers:
            hidden = layer(hidden)
        return hidden, eager(tokens, use_cache=False).logits


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_models_layers_compute_its_windows_sinks_and_capping_as_transformers_eager_model_does(tmp_path,
                                                                                                model_type):
    ours, theirs = _pipesim_and_eager(tmp_path, model_type)
    assert ours.shape == (2, SEQ, SMALL["vocab_size"])
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_a_windowed_layer_compiles_whole_and_computes_as_it_runs(tmp_path, model_type):
    """torch.compile traces a windowed layer, checkpointed as torchtitan runs it, in one graph (the count's recording
    context, which checkpointing's trace cannot take, is entered on the meta device alone), its masked sdpa
    (Mistral's) or eager attention (Gemma 2's), to the values it computes uncompiled."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint

    folder = write_config(tmp_path / model_type, {**SMALL, "model_type": model_type, **MODELS[model_type]})
    layer = hf_model(f"hf:{folder}", SEQ).layers[1]
    hidden = torch.randn(2, SEQ, SMALL["hidden_size"], generator=torch.Generator().manual_seed(0))
    backend = aot_autograd(fw_compiler=lambda graph, _: graph.forward, bw_compiler=lambda graph, _: graph.forward)
    compiled = torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False), backend=backend, fullgraph=True,
                             dynamic=False)
    with compiling_checkpointed_hf():
        torch.testing.assert_close(compiled(hidden), layer(hidden))


def _estimated(tmp_path) -> tuple[str, object]:
    """A tiny gpt-oss config (`hf:PATH`) and the profile `estimate` writes of it, in float32 over 2 stages."""
    model = f"hf:{write_config(tmp_path / 'oss', {**SMALL, 'model_type': 'gpt_oss', **MODELS['gpt_oss']})}"
    profile = tmp_path / "profile.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", model, "--seq-len", SEQ, "-b", 1, "-p", 2, "--dtype",
                   "fp32", "--out", profile).code == 0
    return model, profile


def test_a_configs_profile_is_counted_again_for_its_fitted_curve(tmp_path):
    """A profile records a config's sizes (layers, width, ...) to describe it; counted again with them, as the fit
    of calibrate's efficiency curve and --curve-from count it, the config refused them ("--layers does not apply"),
    so calibrate stored no curve for any Hugging Face model."""
    from pipesim.commands.estimate import fit_count
    from pipesim.profiles.schema import load_profile

    model, profile = _estimated(tmp_path)
    recorded = load_profile(profile)
    assert recorded.model.options["layers"] == 2
    assert [layer.name for layer in fit_count(recorded, "the test").layers] == [
        "0:Embedding", "1:DecoderLayer", "2:DecoderLayer", "3:GptOssRMSNorm", "4:Linear"]


@pytest.mark.slow
def test_run_trains_a_gpt_oss_config_from_its_profile_on_two_gloo_ranks_as_one_process(tmp_path):
    """`run --model hf:PATH --profile P` built the model with the profile's described sizes too, which a config
    refuses, so no Hugging Face model ran: a gpt-oss config, its windowed layer and sinks included, trains on two
    gloo ranks to one process's losses."""
    model, profile = _estimated(tmp_path)
    code, out, err = pipesim("run", "--model", model, "--profile", profile, "-s", "1f1b", "-p", 2, "-m", 2, "-n", 2,
                             "--json", "--no-heldout")
    assert code == 0, err
    ran = json.loads(out)
    assert ran["hardware"]["ranks"] == 2 and ran["hardware"]["backend"] == "gloo"
    losses: list[float] = []
    single_process(RunSpec(build("gpipe", 1, 2, 2), model, {"seq_len": SEQ}, microbatch_size=1, lr=0.05),
                   losses)  # run's defaults: sgd, seed 0
    np.testing.assert_allclose(ran["losses"][0], losses, rtol=1e-5)
