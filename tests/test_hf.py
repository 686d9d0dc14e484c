"""Any model from its Hugging Face config (`--model hf:PATH`, workload/hf.py): a Llama-shaped config counted
against pipesim's own `gpt --gated --kv-heads --ffn` of the same shape, every difference a named mechanism; the
Llama 3.1 configs of examples/; bad configs refused in one line; any torch module with an example input counted.
transformers is in the test extra, so CI runs all of these; without it only those that need it skip."""

from __future__ import annotations

import json
import shutil
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from pipesim.workload.count import WorkloadCount, count_built
from tests.conftest import help_records, needs_transformers, pipesim, pipesim_fresh, simulate_json
from tests.helpers import (
    EXPERTS,
    FFN,
    H100,
    H100_BF16,
    HEAD,
    KV,
    LLAMA,
    MIXTRAL,
    QWEN3_MOE,
    TINY_DEEPSEEK,
    A,
    B,
    H,
    L,
    S,
    V,
    assert_trains_as_one_process,
    write_config,
)
from tests.helpers import LLAMA_GPT as GPT

ROOT = Path(__file__).resolve().parents[1]

E = 2  # bytes per bf16 element


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("llama"), LLAMA)


@cache
def counts(folder: str, attention: str, swiglu_fusion: bool = True) -> tuple[WorkloadCount, WorkloadCount]:
    """The config's count and the gpt's of the same shape, in bf16, their SwiGLUs fused or not alike."""
    return (count_built(f"hf:{folder}", {"seq_len": S}, B, torch.bfloat16, attention, swiglu_fusion=swiglu_fusion),
            count_built("gpt", GPT, B, torch.bfloat16, attention, swiglu_fusion=swiglu_fusion))


@needs_transformers
@pytest.mark.parametrize("attention", ["math", "flash"])
def test_a_llama_config_is_cut_as_pipesims_gpt_and_does_its_flops_exactly(llama, attention):
    """The products are the same: q, k, v and o as the gpt's fused qkv and proj, gate and up as its fused gate_up,
    the head; RoPE's rotations and the RMSNorms are elementwise (no FLOPs). With flash, transformers asks for
    grouped-query attention (enable_gqa), which torch's flash kernel takes as it is."""
    hf, gpt = counts(str(llama), attention)
    assert [layer.name for layer in hf.layers] == ["0:Embedding", "1:DecoderLayer", "2:DecoderLayer",
                                                     "3:LlamaRMSNorm", "4:Linear"]
    assert hf.options == {"layers": L, "width": H, "heads": A, "ffn": FFN, "vocab": V, "kv_heads": KV, "seq_len": S}
    assert hf.attention == attention
    for name in ("fwd_flops", "igrad_flops", "wgrad_flops"):
        assert hf.layers[1].__getattribute__(name) == gpt.layers[1].__getattribute__(name)
        assert hf.total(name) == gpt.total(name)


@needs_transformers
def test_its_fused_swiglu_keeps_its_input_only(llama):
    """With --swiglu-fusion (the default) a dense MLP's SwiGLU keeps the gate and up products' outputs, as
    Megatron-core's bias_swiglu_impl keeps fc1's, not silu's output too (b·s·ffn 16-bit values a block less), and
    runs as that one kernel: reading gate and up, writing its output (3·b·s·ffn values), where silu and the product
    move 5 (silu reads 1 and writes 1, the product reads 2 and writes 1)."""
    (fused, _), (unfused, _) = counts(str(llama), "flash"), counts(str(llama), "flash", swiglu_fusion=False)
    assert unfused.layers[1].saved_bytes - fused.layers[1].saved_bytes == B * S * FFN * E
    assert unfused.layers[1].fwd_moved_bytes - fused.layers[1].fwd_moved_bytes == 2 * B * S * FFN * E
    for name in ("fwd_flops", "igrad_flops", "wgrad_flops"):
        assert getattr(fused.layers[1], name) == getattr(unfused.layers[1], name)


@needs_transformers
def test_its_parameters_are_the_gpts_less_learned_positions_and_layernorm_biases(llama):
    """Llama has RoPE (no s x h position table) and RMSNorm (a weight, no bias: 2 per block and the final one); its
    head has no bias, as the gpt's has none (Megatron-LM's output layer); every product's weights and biases are the
    gpt's."""
    hf, gpt = counts(str(llama), "math")
    positions, norm_biases = S * H, (2 * L + 1) * H
    assert hf.total("param_bytes") == gpt.total("param_bytes") - E * (positions + norm_biases)
    assert hf.layers[1].param_bytes == gpt.layers[1].param_bytes - E * 2 * H


@needs_transformers
@pytest.mark.parametrize("attention", ["math", "flash"])
def test_its_activations_are_the_gpts_plus_eager_rmsnorm_and_rope(llama, attention):
    """Per norm, transformers' RMSNorm (float32 elementwise ops) saves x in float32 (4·bsh), its 1/rms (4·bs)
    and the normalised x (2·bsh) where a LayerNorm saves x (2·bsh), a mean and a 1/std (8·bs); RoPE saves its
    cos and sin (s x head size each); both hand the attention grouped keys and values (enable_gqa), which flash
    keeps with their kv heads; the gpt's embedding also keeps its positions' ids (8·s). Its SwiGLU unfused, as the
    gpt's ops run it."""
    hf, gpt = counts(str(llama), attention, swiglu_fusion=False)
    rms_norm = 4 * B * S * H - 4 * B * S
    rope = 2 * S * HEAD * E
    block = 2 * rms_norm + rope
    assert hf.layers[1].saved_bytes == gpt.layers[1].saved_bytes + block
    assert hf.total("saved_bytes") == gpt.total("saved_bytes") + L * block + rms_norm - 8 * S
    norms = sum(nbytes for (_, nbytes), part in zip(hf.layers[1].saved_tensors, hf.layers[1].saved_parts)
                if part == "norms")
    assert norms == 2 * (6 * B * S * H + 4 * B * S)  # post_attention_layernorm is a norm, not attention


def tensor_links(parallel):
    """An H100's tensor-parallel link under `parallel`, without latency, and the same at 1,000 times its rate."""
    from pipesim.planning.estimate import placement_links

    link = placement_links(H100, parallel).tensor.model_copy(update={"latency_ms": 0.0})
    return link, link.model_copy(update={"bytes_per_ms": link.bytes_per_ms * 1000})


def communication_ms(layer, parallel) -> tuple[float, float]:
    """The layer's tensor-parallel communication under `parallel` on an H100, forward and backward: its time at the
    link's rate less at 1,000 times it (`tensor_links`)."""
    from pipesim.planning.estimate import estimate_layer

    slow, fast = (estimate_layer(layer, H100_BF16, parallel, link, E) for link in tensor_links(parallel))
    return slow.fwd_ms - fast.fwd_ms, slow.bwd_ms - fast.bwd_ms


@needs_transformers
@pytest.mark.parametrize("tensor", [2, 8])
@pytest.mark.parametrize("sequence_parallel, runtime", [(False, "megatron"), (True, "megatron"), (True, "torch")])
def test_its_separate_projections_reduce_their_input_gradient_once_per_shared_input(llama, tensor, sequence_parallel,
                                                                                   runtime):
    """Under tensor parallelism q, k and v (gate and up) are column-parallel on one input, whose gradient is reduced
    once, summed (planning/estimate.py `_Reduction`): the backward's tensor-parallel communication (the layer's
    backward at the link's rate less at 1,000 times it, no latency) is two reductions' worth, the attention's input
    and the MLP's, as the gpt's with its fused qkv and gate_up, not five. The forward's, o's and down's, alike."""
    from pipesim.planning.estimate import Parallelism

    hf, gpt = counts(str(llama), "flash")
    parallel = Parallelism(tensor=tensor, sequence_parallel=sequence_parallel, tp_runtime=runtime)
    hf_fwd_ms, hf_bwd_ms = communication_ms(hf.layers[1], parallel)
    gpt_fwd_ms, gpt_bwd_ms = communication_ms(gpt.layers[1], parallel)
    assert gpt_bwd_ms > 0 and hf_bwd_ms == pytest.approx(gpt_bwd_ms, rel=1e-9)
    assert hf_fwd_ms == pytest.approx(gpt_fwd_ms, rel=1e-9)


@needs_transformers
@pytest.mark.parametrize("tensor", [2, 8])
def test_torchs_async_tp_leaves_the_reduce_scatter_of_a_summed_input_gradient_exposed(llama, tensor):
    """Inductor's micro-pipeline TP fuses a reduce-scatter with the matmul that writes its input (torch 2.13,
    micro_pipeline_tp.py `fuse_matmul_reduce_scatter`, `_find_producer_matmul`); separate q, k and v (gate and up)
    write three (two) gradients whose sum, an add's, it reduce-scatters: not fused, exposed after them. The gpt's
    fused qkv and gate_up write theirs, so theirs hide under the chunks of the tiny block's products (no time at
    the link's rate beyond at 1,000 times it, no latency), as every all-gather does, fused with the matmuls that
    read it (`fuse_all_gather_matmul`); the Llama's backward pays its two reduce-scatters whole."""
    from pipesim.planning.estimate import Parallelism, reduce_scatter_ms

    hf, gpt = counts(str(llama), "flash")
    parallel = Parallelism(tensor=tensor, sequence_parallel=True, tp_runtime="torch", tp_overlap=True)
    scattered_ms = [reduce_scatter_ms(B * S * H * E, tensor, 0.0, link.bytes_per_ms) for link in tensor_links(parallel)]
    assert communication_ms(gpt.layers[1], parallel) == (0.0, 0.0)
    assert communication_ms(hf.layers[1], parallel) == pytest.approx((0.0, 2 * (scattered_ms[0] - scattered_ms[1])),
                                                                     rel=1e-9, abs=1e-12)


@needs_transformers
def test_alike_decoder_layers_are_counted_once_though_transformers_numbers_them(tmp_path, monkeypatch):
    from pipesim.workload import count as counting

    calls = []
    real = counting._count_layer
    monkeypatch.setattr(counting, "_count_layer", lambda *args: calls.append(1) or real(*args))
    folder = write_config(tmp_path / "deep", {**LLAMA, "num_hidden_layers": 6})
    counted = count_built(f"hf:{folder}", {"seq_len": 8}, 1, torch.bfloat16)
    assert len(counted.layers) == 9 and len(calls) == 4  # embedding, one block, norm, head


@needs_transformers
def test_the_llama_3_1_examples_have_their_published_parameter_counts():
    """Embedding and untied head V·h each, per block q and o h², k and v h·kv·head, the SwiGLU MLP 3·h·ffn, two
    RMSNorms; and the final norm: 8.03 B, 70.6 B and 405.9 B (Meta's model cards: 8B, 70B, 405B)."""
    for name, billions in (("8b", 8.03), ("70b", 70.55)):
        counted = count_built(f"hf:{ROOT / 'examples' / f'llama3.1-{name}'}", {"seq_len": 16}, 1, torch.bfloat16)
        o = counted.options
        block = 2 * o["width"] ** 2 + 2 * o["width"] * o["kv_heads"] * (o["width"] // o["heads"]) \
            + 3 * o["width"] * o["ffn"] + 2 * o["width"]
        assert counted.total("param_bytes") // E == 2 * o["vocab"] * o["width"] + o["layers"] * block + o["width"]
        assert round(counted.total("param_bytes") / E / 1e9, 2) == billions
    fields = json.loads((ROOT / "examples" / "llama3.1-405b" / "config.json").read_text())
    assert (fields["num_hidden_layers"], fields["hidden_size"], fields["intermediate_size"],
            fields["num_attention_heads"], fields["num_key_value_heads"]) == (126, 16384, 53248, 128, 8)
    assert "llama3.1-405b/config.json" in (ROOT / "examples" / "README.md").read_text()


@needs_transformers
def test_a_tied_heads_weights_are_the_embeddings_held_once_where_a_stage_holds_both(tmp_path):
    """New-user pass: a Llama 3.2 1B-shaped config (tie_word_embeddings) counted 1.50 B parameters, its head counted as
    weights of its own, and at p = 1 held them twice (4.5 GiB of weights, gradients and Adam's state too many). The
    head's weights are the embedding's (`tied_layer`): the total counts them once, a stage holding both holds them
    once, and stages apart each keep a copy, as Megatron-LM's last stage does."""
    tied = write_config(tmp_path / "tied", {**LLAMA, "tie_word_embeddings": True})
    untied = write_config(tmp_path / "untied", LLAMA)
    counted = {name: count_built(f"hf:{folder}", {"seq_len": S}, B, torch.bfloat16)
               for name, folder in (("tied", tied), ("untied", untied))}
    embedding = counted["untied"].layers[0].param_bytes
    assert [layer.tied_layer for layer in counted["tied"].layers] == [-1] * (L + 2) + [0]
    assert counted["tied"].total("param_bytes") == counted["untied"].total("param_bytes") - V * H * E == \
        counted["untied"].total("param_bytes") - embedding
    assert counted["tied"].total("grad_bytes") == counted["untied"].total("grad_bytes") - embedding
    code, _, err = pipesim("count", "--model", f"hf:{tied}", "--seq-len", S)
    assert code == 0 and "tied weights: " in " ".join(err.split()), err

    def parts(folder: Path, stages: int) -> list[dict[str, float]]:
        [result] = simulate_json("--gpu", "h100-sxm", "--model", f"hf:{folder}", "--seq-len", S, "-p", stages, "-m", 2,
                                 "-s", "1f1b", "--allocator", "none")
        return [device["peak_memory_parts_mb"] for device in result["devices"]]

    (one,), (whole,), apart, untied_apart = parts(tied, 1), parts(untied, 1), parts(tied, 2), parts(untied, 2)
    for part in ("parameters", "gradients", "optimizer_state"):
        # the head's share of the model's weights (its optimizer state within Adam's step counts a tensor)
        assert whole[part] - one[part] == pytest.approx(whole[part] * embedding / counted["untied"].total(
            "param_bytes"), rel=1e-3), part
        assert [device[part] for device in apart] == [device[part] for device in untied_apart], part


@needs_transformers
def test_a_tied_model_trains_as_one_process_on_one_stage_and_is_refused_across_two(tmp_path):
    """On one stage the tied head and embedding are one tensor (torch.func's tie_weights), stepped once with both
    gradients, as one process steps it (whose optimizer had been given it twice); across two stages each would train a
    copy on its own gradients (a second step's loss 6.2370 against 6.2306), which `run` refuses in one line."""
    tied = f"hf:{write_config(tmp_path / 'tied', {**LLAMA, 'tie_word_embeddings': True})}"
    assert_trains_as_one_process(tmp_path, tied, stages=1)
    profile = tmp_path / "two.json"
    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", tied, "--seq-len", 24, "-p", 2, "--out", profile)
    assert code == 0, err
    code, out, err = pipesim("run", "--model", tied, "--profile", profile, "-s", "1f1b", "-p", 2, "-m", 2, "-n", 1,
                             "--trace", tmp_path / "t.json")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert "weights are layer 0:Embedding's (tied" in err and "1f1b's stages 0 and 1" in err, err
    assert not (tmp_path / "t.json").exists()
    from pipesim.executor import ExecutorError, RunSpec
    from pipesim.executor.stages import cut, training_cut
    from tests.conftest import build

    spec = RunSpec(build("1f1b", 2, 2, 1), tied, {"seq_len": 24}, microbatch_size=1)
    assert cut(spec).bounds == [0, 3, 5]  # calibrate times each stage's passes (a review: it had been refused)
    with pytest.raises(ExecutorError, match="would each train a copy"):
        training_cut(spec)


@needs_transformers
def test_a_what_if_of_a_config_is_kept_by_its_content_and_read_back_without_counting(tmp_path, monkeypatch):
    from pipesim.workload import count as counting

    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path / "cache"))
    args = ("--gpu", "h100-sxm", "--model", f"hf:{ROOT / 'examples' / 'llama3.1-8b'}", "--seq-len", 256, "-p", 4,
            "-m", 8, "-s", "1f1b")
    [first] = simulate_json(*args)
    assert first["mfu"] > 0 and first["tokens_per_s"] == pytest.approx(first["samples_per_s"] * 256)

    def refuse(*args, **kwargs):
        raise AssertionError("counted again although the count was kept")

    (kept,), imported = pipesim_fresh(["simulate", *args, "--json"])  # read back: neither torch nor transformers
    assert kept.code == 0 and not {"torch", "transformers"} & imported, kept.err
    assert json.loads(kept.out)["results"] == [first]
    monkeypatch.setattr(counting, "count_built", refuse)
    moved = shutil.copytree(ROOT / "examples" / "llama3.1-8b", tmp_path / "elsewhere")
    assert simulate_json(*args[:3], f"hf:{moved}", *args[4:]) == [first]  # the same config, at another path
    (moved / "config.json").write_text(json.dumps({**json.loads((moved / "config.json").read_text()),
                                                   "num_hidden_layers": 31}))
    with pytest.raises(AssertionError, match="counted again"):
        simulate_json(*args[:3], f"hf:{moved}", *args[4:])


# Configs read_hf_config refuses by their fields' own names, before torch is imported
UNREADABLE = [
    (lambda folder: folder / "absent", "no {folder}/absent; give hf:PATH, a config.json or a folder holding one"),
    (lambda folder: folder, "{folder} holds no config.json, nor do its folders"),
    (lambda folder: (folder / "c.json").write_text("{not json") and folder / "c.json", "is not valid JSON"),
    (lambda folder: (folder / "c.json").write_text('{"model_type": "lla') and folder / "c.json",
     "is not valid JSON: Unterminated string starting at: line 1 column 16"),
    (lambda folder: (folder / "c.json").write_bytes(b"\xab\xcd") and folder / "c.json",  # 'utf-8' codec's words
     "--model hf:{folder}/c.json: Hugging Face config {folder}/c.json is not a text (UTF-8) file"),
    (lambda folder: (folder / "c.json").write_text('{"hidden_size": 8}') and folder / "c.json", "has no model_type"),
    # it said "has no model_type" of one that has, not a string
    (lambda folder: write_config(folder, {**LLAMA, "model_type": 5}),
     "{folder}/config.json: model_type: give the name transformers knows the model by, a string (got 5)"),
    *((lambda folder, text=text: (folder / "c.json").write_text(text) and folder / "c.json",
       "{folder}/c.json is not a JSON object; give a Hugging Face config.json") for text in ("[]", "[1]", "7", '"x"')),
    (lambda folder: write_config(folder, {**LLAMA, "num_hidden_layers": 0}),
     "{folder}/config.json: num_hidden_layers: give a whole number from 1 to 10,000 (got 0)"),
    (lambda folder: write_config(folder, {**LLAMA, "vocab_size": -1}),
     "config.json: vocab_size: give a whole number from 1 to 16,777,216 (got -1)"),
    (lambda folder: write_config(folder, {**LLAMA, "hidden_size": 64.0}),
     "config.json: hidden_size: give a whole number from 1 to 1,048,576 (got 64.0)"),
    (lambda folder: write_config(folder, {**LLAMA, "num_key_value_heads": True}),
     "config.json: num_key_value_heads: give a whole number from 1 to 65,536 (got true)"),
    # a count that grew past the host's memory for hours, and torch's randperm of the vocabulary's 8 TB
    (lambda folder: write_config(folder, {**LLAMA, "num_hidden_layers": 10 ** 9}),
     "{folder}/config.json: num_hidden_layers: give a whole number from 1 to 10,000 (got 1,000,000,000)"),
    (lambda folder: write_config(folder, {**LLAMA, "vocab_size": 10 ** 12}),
     "config.json: vocab_size: give a whole number from 1 to 16,777,216 (got 1,000,000,000,000)"),
    (lambda folder: write_config(folder, {**LLAMA, "model_type": "mistral", "sliding_window": -4}),
     # its windowed kernels were priced at negative FLOPs
     "config.json: sliding_window: give a whole number from 1 to 1,048,576 (got -4)"),
    # each a traceback deep in the count: top-k of no experts, a division by no experts a token
    (lambda folder: write_config(folder, {**LLAMA, "model_type": "mixtral", "num_local_experts": -1}),
     "config.json: num_local_experts: give a whole number from 0 to 16,384 (got -1)"),  # 0: see test_moe's Qwen3-MoE
    (lambda folder: write_config(folder, {**LLAMA, "model_type": "mixtral", "num_experts_per_tok": 0}),
     "config.json: num_experts_per_tok: give a whole number from 1 to 16,384 (got 0)"),
]
NO_KV_HEADS = {name: value for name, value in LLAMA.items() if name != "num_key_value_heads"}
NO_LONGEST = {name: value for name, value in LLAMA.items() if name != "max_position_embeddings"}


def estimate_refusal(model: Path, out: Path) -> str:
    """`pipesim estimate` of `model`'s config refused: exit 2, one line (returned), nothing written to `out`."""
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", f"hf:{model}", "--seq-len", 64,
                                "--out", out)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    return err


def test_an_unreadable_config_is_one_line_before_torch_is_imported(tmp_path):
    """Each of `UNREADABLE` exits 2 with its one line, nothing written, in a process that imports neither torch nor
    transformers."""
    paths, fragments, out = [], [], tmp_path / "profile.json"
    for i, (make, fragment) in enumerate(UNREADABLE):
        (tmp_path / str(i)).mkdir()
        paths.append(str(make(tmp_path / str(i))))
        fragments.append(fragment.format(folder=tmp_path / str(i)))
    runs, imported = pipesim_fresh(*(("estimate", "--gpu", "h100-sxm", "--model", f"hf:{path}", "--seq-len", 64,
                                      "--out", out) for path in paths))
    assert [(run.code, run.out) for run in runs] == [(2, "")] * len(UNREADABLE)
    assert all(run.err.count("\n") == 1 and "--model hf:" in run.err for run in runs), [run.err for run in runs]
    missing = [(fragment, run.err) for fragment, run in zip(fragments, runs) if fragment not in run.err]
    assert not missing, missing
    assert not {"torch", "transformers"} & imported and not out.exists()


@needs_transformers
@pytest.mark.parametrize("fields, fragment", [
    ({**LLAMA, "num_key_value_heads": 3},  # torch's shapes, deep in the count
     "{folder}/config.json gives num_key_value_heads 3, which does not divide its num_attention_heads 4; give a "
     "divisor of 4"),
    # Step-3.5's key/value heads by their alias alone (Step3p7TextConfig's attribute_map), which read_hf_config
    # does not know
    ({**NO_KV_HEADS, "model_type": "step3p5", "num_attention_groups": 3},
     "{folder}/config.json gives num_attention_groups 3, which does not divide its num_attention_heads 4"),
    ({**NO_KV_HEADS, "model_type": "step3p5", "num_attention_groups": 0},
     "{folder}/config.json: num_attention_groups: give a whole number from 1 to 65,536 (got 0)"),
    # none given: Step3p7TextConfig's default, 8
    ({**NO_KV_HEADS, "model_type": "step3p5", "hidden_size": 96, "num_attention_heads": 12},
     "{folder}/config.json leaves num_key_value_heads at Step3p7TextConfig's 8, which does not divide its "
     "num_attention_heads 12; give a divisor of 12"),
    # GPT-2's layers by its own name, n_layer: 10,001 layers built before its layout was refused
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 10_001, "n_head": 4, "vocab_size": 100, "intermediate_size": 256},
     "{folder}/config.json: n_layer: give a whole number from 1 to 10,000 (got 10,001)"),
    # the router's top-k of fewer experts: torch's "k not in range"; which field gives them, transformers tells
    ({**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
     "{folder}/config.json sends a token to num_experts_per_tok 5 experts, more than its 4 routed experts "
     "(num_local_experts); give 1 to 4"),
    ({**LLAMA, "model_type": "qwen2_moe", "num_local_experts": 8, "num_experts": 4, "num_experts_per_tok": 5},
     "more than its 4 routed experts (num_experts); give 1 to 4"),
])
def test_a_config_transformers_reads_as_unfit_is_one_line_and_nothing_is_written(tmp_path, fields, fragment):
    """Refused once transformers' config class has read it, before the model is built (workload/hf.py `hf_model`)."""
    folder = write_config(tmp_path / "model", fields)
    err = estimate_refusal(folder, tmp_path / "profile.json")
    assert fragment.format(folder=folder) in err, err


SEQ = ("--seq-len", 16)


@needs_transformers
@pytest.mark.parametrize("fields, args, fragment", [
    ({**LLAMA, "model_type": "nosuch"}, SEQ, "does not know model_type 'nosuch'; it builds"),
    ({"model_type": "llama", "hidden_size": 64}, SEQ, "{folder}/config.json gives no num_hidden_layers, "
     "num_attention_heads, intermediate_size, vocab_size; a decoder's config needs each of them (transformers would "
     "fill in its class's default, another model's size)"),
    ({"model_type": "llama"}, SEQ, "{folder}/config.json gives no num_hidden_layers, hidden_size, num_attention_heads, "
     "intermediate_size, vocab_size; a decoder's config needs each of them"),
    ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, SEQ, "config.json gives no vocab_size; a decoder's "
     "config needs it"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "intermediate_size": 256},
     SEQ, "GPT2LMHeadModel is not laid out as pipesim cuts a decoder"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_inner": None}, SEQ,
     "model_type 'gpt2' (GPT2Config has no intermediate_size) is not laid out as pipesim cuts a decoder"),
    ({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_inner": None}, SEQ,  # n_embd omitted
     "model_type 'gpt2' (GPT2Config has no intermediate_size) is not laid out as pipesim cuts a decoder"),
    ({"model_type": "t5", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
      "intermediate_size": 128}, SEQ, "model_type 't5' is not a causal language model transformers builds"),
    ({**LLAMA, "rope_scaling": {"rope_type": "nosuch", "factor": 2.0}}, SEQ, "transformers cannot build it: "
                                                                            "KeyError: 'nosuch'"),
    ({**LLAMA, "model_type": "phi3", "pad_token_id": 10 ** 6}, SEQ, "transformers cannot build it: AssertionError: "
                                                                   "Padding_idx must be within num_embeddings"),
    ({**LLAMA, "num_attention_heads": A + 1, "num_key_value_heads": 1}, SEQ,
     f"transformers refuses {{folder}}/config.json: StrictDataclassClassValidationError: Class validation error "
     "for validator 'validate_architecture': "
     f"ValueError: The hidden size ({H}) is not a multiple of the number of attention heads ({A + 1})"),
    (LLAMA, (), "--seq-len: give the tokens a sample of"),
    (LLAMA, ("--seq-len", 512), "--seq-len 512: hf:"),
    (LLAMA, ("--seq-len", 512), "takes at most its max_position_embeddings, 256"),
    # none given: the figure is the class's, not the config's
    (NO_LONGEST, ("--seq-len", 4096), "takes at most transformers' LlamaConfig default for a config without "
                                      "max_position_embeddings, 2,048"),
    (NO_LONGEST, (), "(its config gives no max_position_embeddings: transformers' default for model_type 'llama' "
                     "bounds it)"),
    # said to give none, or (with --seq-len) refused by transformers once torch was imported, 10.8 s
    *(({**LLAMA, "max_position_embeddings": given}, args, f"{{folder}}/config.json: max_position_embeddings: give a "
       f"whole number of at least 1 (got {json.dumps(given)})") for given, args in ((4096.0, ()),
                                                                                        ("4096", SEQ), (True, SEQ))),
    ({**LLAMA, "max_position_embeddings": 0}, (),
     "{folder}/config.json: max_position_embeddings: give a whole number of at least 1 (got 0)"),
    # torch's "Attempting to broadcast a dimension of length ..." from the layer's reshape, the fields unnamed
    # (Llama's config class refuses it itself, Mixtral's does not)
    ({**MIXTRAL, "hidden_size": 66}, SEQ, "{folder}/config.json's hidden_size 66 is not a whole number of its 4 "
     "attention heads (transformers takes a head as hidden_size / num_attention_heads where head_dim is not given): "
     "give a multiple of 4, or a head_dim"),
    # transformers' ACT2FN lookup, a bare KeyError: 'nosuch' where the field went unnamed
    ({**LLAMA, "hidden_act": "nosuch"}, SEQ, "{folder}/config.json gives hidden_act 'nosuch', an activation "
                                             "transformers does not know; give one of gelu, "),
    (LLAMA, ("--seq-len", 0), "--seq-len: give a whole number from 1 to 1,048,576 (got 0)"),
    (LLAMA, (*SEQ, "--width", 8), "--width does not apply to hf:"),
    # every layer dense: "its 4 experts are not held as transformers' experts modules"
    ({**TINY_DEEPSEEK, "first_k_dense_replace": 5}, SEQ, f"its {EXPERTS} routed experts (n_routed_experts) are "
     "placed in none of its layers (first_k_dense_replace 5), so transformers builds a dense model: place them in a "
     "layer, or give no routed experts"),
    # the experts its class's default, a long list of placements shown in part
    ({**QWEN3_MOE, "mlp_only_layers": list(range(0, 40, 2))}, SEQ, "its 128 routed experts (num_local_experts, its "
     "class's default) are placed in none of its layers (mlp_only_layers [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, ...), so "
     "transformers builds a dense model"),
])
def test_a_config_transformers_cannot_build_as_a_decoder_is_one_line(tmp_path, fields, args, fragment):
    folder = write_config(tmp_path / "model", fields)
    code, out, err = pipesim("count", "--model", f"hf:{folder}", *args)
    assert code == 2 and out == "" and fragment.format(folder=folder) in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_experts_with_a_norm_after_each_are_refused_in_one_line():
    """transformers' experts interface marks a norm after each expert (has_post_expert_norm), which pipesim's
    experts do not run; biases and interleaved gate/up weights (gpt-oss's) it runs."""
    from pipesim.workload.hf import _check_experts
    from pipesim.workload.hfconfig import HfConfig
    from pipesim.workload.models import ModelError

    config = HfConfig("hf:x", Path("x/config.json"), {})
    experts = torch.nn.Module()
    experts.has_bias, experts.is_concatenated, experts.has_post_expert_norm = True, False, False
    _check_experts(torch.nn.Sequential(experts), "--model hf:x", config, ("num_experts", 4))
    experts.has_post_expert_norm = True
    with pytest.raises(ModelError, match=r"^--model hf:x: its experts \(Module\) have a norm after each expert;"):
        _check_experts(torch.nn.Sequential(experts), "--model hf:x", config, ("num_experts", 4))


def test_run_takes_a_configs_sequence_length_from_its_profile_and_says_so(tmp_path):
    """run has no --seq-len, yet without a profile it asked for one ("--seq-len: give the tokens a sample of ...")."""
    folder = write_config(tmp_path / "model", LLAMA)
    code, out, err = pipesim("run", "-s", "1f1b", "--model", f"hf:{folder}", "-m", 2, "-n", 1)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--model hf:{folder}: run builds a Hugging Face model at the sequence length it was calibrated at: give " \
           "--profile" in err and "--seq-len N" in err


def test_without_transformers_a_config_says_how_to_install_it(llama, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # its import fails as an uninstalled module's does
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", f"hf:{llama}", "--seq-len", 16,
                                "--out", out)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and not out.exists(), err
    assert (f"--model hf:{llama} (transformers builds it from its config) needs transformers, which is not "
            "installed: pip install 'pipesim[hf]' (or pip install transformers)") in " ".join(err.split())


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A module of the test's own name in the current folder, importable as --model NAME:attribute."""
    name = f"user_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    monkeypatch.chdir(tmp_path)

    def write(source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return name
    return write


def test_count_takes_any_module_with_an_example_input_as_one_layer(user_module):
    name = user_module(
        "import torch\nfrom torch import nn\n\n"
        "class Residual(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)\n\n"
        "    def forward(self, x):\n"
        "        return x + self.b(torch.relu(self.a(x)))\n\n"
        "def build():\n"
        "    return Residual(), torch.randn(3, 32)\n")
    code, out, err = pipesim("count", "--model", f"{name}:build", "-b", 8, "--dtype", "fp32", "--json")
    assert code == 0, err
    [layer] = json.loads(out)["layers"]
    product = 2 * 8 * 32 * 64  # each Linear layer's 2·b·i·o
    assert layer["name"] == "0:WholeModule" and layer["fwd_flops"] == 2 * product
    # its input is the data, so no input gradient; the backward is both weights' gradients and the one between
    assert layer["igrad_flops"] == 0 and layer["wgrad_flops"] == 3 * product
    assert layer["param_bytes"] == 4 * (32 * 64 + 64 + 64 * 32 + 32)


def test_a_sequential_with_an_example_input_is_cut_into_its_layers(user_module):
    name = user_module("import torch\nfrom torch import nn\n\n"
                       "def build():\n"
                       "    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)), torch.randn(1, 5, 16)\n")
    code, out, err = pipesim("count", "--model", f"{name}:build", "-b", 4, "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert [layer["name"] for layer in layers] == ["0:LayerNorm", "1:Linear"]
    assert layers[0]["output_shape"] == [4, 5, 16] and layers[1]["fwd_flops"] == 2 * 4 * 5 * 16 * 8


@needs_transformers
def test_a_transformers_model_given_as_a_module_is_cut_as_its_config_is(user_module, llama):
    name = user_module("import json, torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n\n"
                       "def build():\n"
                       f"    fields = json.loads(open({str(llama / 'config.json')!r}).read())\n"
                       "    config = AutoConfig.for_model(**fields)\n"
                       f"    return AutoModelForCausalLM.from_config(config), torch.zeros(1, {S}, dtype=torch.long)\n")
    code, out, err = pipesim("count", "--model", f"{name}:build", "-b", B, "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    hf, _ = counts(str(llama), "flash")  # a module's attention, as an hf: model's, is the fused kernel by default
    assert [layer["name"] for layer in layers] == [layer.name for layer in hf.layers]
    assert layers[1]["fwd_flops"] == hf.layers[1].fwd_flops and layers[1]["saved_bytes"] == hf.layers[1].saved_bytes


def test_a_module_without_an_example_input_says_how_to_give_one(user_module):
    name = user_module("from torch import nn\n\nbuild = nn.Sequential(nn.ReLU(), nn.Linear(4, 4))\n")
    code, out, err = pipesim("count", "--model", f"{name}:build")
    assert code == 2 and "give (the module, an example input)" in err


def test_a_bare_module_is_refused_naming_what_to_give(user_module):
    name = user_module("from torch import nn\n\nclass Odd(nn.Module):\n    pass\n\nbuild = Odd()\n")
    code, out, err = pipesim("count", "--model", f"{name}:build")
    assert code == 2 and "(a torch.nn.Module, an example input)" in err


def test_every_command_whose_model_may_be_a_config_says_so_in_its_help():
    """calibrate builds hf:PATH (docs/hardware.md), yet its --model help named only the built-in models and a
    module: every --model but study's (mlp or cnn) names hf:PATH."""
    helps = {name: record[1] for name, param, record in help_records() if param.name == "model"}
    assert {"calibrate", "run", "simulate", "estimate", "count"} <= set(helps)
    assert [name for name, text in helps.items() if "hf:PATH" not in text] == ["study"]


@needs_transformers
def test_a_window_the_config_switches_off_is_not_read_as_it_transformers_saves_it(tmp_path):
    """Qwen2-MoE's config class saves sliding_window 0 where use_sliding_window is false (transformers 5.25): a
    Qwen1.5-MoE config that transformers saved itself was refused for a size it never reads. Switched on, the
    window is held to 1 or more as before; switched off yet named by a layer's type, it is refused as its layer
    reads it."""
    qwen2_moe = {**QWEN3_MOE, "model_type": "qwen2_moe", "num_experts": 8, "shared_expert_intermediate_size": 64,
                 "sliding_window": 0}
    off = write_config(tmp_path / "off", {**qwen2_moe, "use_sliding_window": False})
    assert pipesim("count", "--model", f"hf:{off}", "--seq-len", 32).code == 0
    on = write_config(tmp_path / "on", {**qwen2_moe, "use_sliding_window": True})
    assert "sliding_window: give a whole number from 1 to 1,048,576 (got 0)" in estimate_refusal(on, tmp_path / "o")
    typed = write_config(tmp_path / "typed", {**qwen2_moe, "use_sliding_window": False,
                                              "layer_types": ["sliding_attention"]})
    assert estimate_refusal(typed, tmp_path / "t").endswith(
        "Qwen2MoeAttention attends within a sliding window of 0 keys: give the config's sliding_window a whole "
        "number from 1, or switch it off for every layer\n")
