"""What several test modules build alike, built once here: the profiles calibrated in the repository, the parts they
price on (as a device, on an attention kernel, and an H100 node's placement), a small GPT's count, a hand-written
two-stage schedule, the lowered schedule's rows as they read them, a flag's value in a printed command, tune's
JSON as two runs share it, and the executor tests' device threads and weight comparison. Each part is frozen: the
tests share it safely."""

from __future__ import annotations

import json
import threading
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, Parallelism, estimate_layer, kernel_curve, node_placement
from pipesim.profiles.workload import WorkloadCount
from pipesim.schedules import SYNCHRONOUS, Schedule, StageGraph
from pipesim.schedules.lowering import Lowered
from pipesim.schedules.table import KINDS
from tests.conftest import estimate_json

if TYPE_CHECKING:
    import torch

    from pipesim.executor import DeviceLoop

PROFILES = Path(__file__).resolve().parents[1] / "traces" / "profiles"
GPT_CPU, CNN_CPU = PROFILES / "gpt-cpu.json", PROFILES / "cnn-cpu.json"  # the calibrated small gpt, cnn
CATALOGUE = load_catalogue()
H100 = CATALOGUE.find("h100-sxm")
H100_BF16 = Device.of(H100, "bf16")
H100_FP8 = Device.of(H100, "bf16", fp8=True)  # bf16, its float8 products at the float8 peak
H100_PLACEMENT = node_placement(H100)  # 8 GPUs a node on NVLink, a NIC each
A100 = CATALOGUE.find("a100-sxm-80gb")
A100_FP16 = Device.of(A100, "fp16")
H200 = CATALOGUE.find("h200")
TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64 runs that train like one process: all but rounding alike


def h100_bf16_on(kernel: str) -> Device:
    """The H100 in bf16 pricing attention on `kernel`'s curve (planning/estimate.py `kernel_curve`)."""
    return Device.of(H100, "bf16", kernel_curve(H100.curve, kernel, "h100-sxm"))


def small_gpt_count(attention: str) -> WorkloadCount:
    """A GPT of 2 layers, width 64, 2 heads and 128 tokens counted at micro-batch 2 in bfloat16 with `attention`;
    the test is skipped without torch."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 128, "vocab": 1000}, 2,
                       torch.bfloat16, attention)


def two_stage_schedule(device0: str, device1: str) -> Schedule:
    """Stages 0 and 1 on devices 0 and 1, two micro-batches, synchronous: each device's order as text."""
    orders = Schedule.orders_from_text(f"0: {device0}\n1: {device1}")
    return Schedule("hand", StageGraph.chain(2), (0, 1), orders, SYNCHRONOUS, 2)


def kind_stage_microbatch(lowered: Lowered) -> list[tuple[str, int, int]]:
    """Each lowered row as (its kind's name, stage, micro-batch), in row order."""
    table = lowered.table
    return [(str(KINDS[k]), int(s), int(m)) for k, s, m in zip(table.kind, table.stage, table.microbatch)]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a command's arguments (`shlex.split` of a printed command); None where not given."""
    return args[args.index(flag) + 1] if flag in args else None


def tune_document(out: str) -> dict:
    """`pipesim tune --json`'s document less the search's seconds, which no two runs share."""
    document = json.loads(out)
    del document["search"]["seconds"]
    return document


def run_loops(loops: list[DeviceLoop]) -> list:
    """Every device's DeviceResult (what the loops measured), each device a thread over the in-process
    transport."""
    results, errors = [None] * len(loops), []

    def work(d: int) -> None:
        try:
            results[d] = loops[d].run()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,)) for d in range(len(loops))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], **tol) -> None:
    """Each tensor of `got` close to its own of `want`, within `tol` (torch.testing.assert_close's) or TIGHT;
    torch is imported here so that the modules without it import this file alike."""
    import torch

    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **(tol or TIGHT))


# The tiny Hugging Face models' shape: micro-batch, sequence, hidden, heads, kv heads, MLP, vocabulary, layers; the
# MoEs' experts, top-k and expert MLP
B, S, H, A, KV, FFN, V, L = 2, 32, 64, 4, 2, 176, 512, 2
HEAD = H // A
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 96
# Llama's config, with the biases pipesim's gpt has (attention_bias, mlp_bias) so that its products match the gpt's,
# and that gpt
LLAMA = {"model_type": "llama", "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": L,
         "num_attention_heads": A, "num_key_value_heads": KV, "vocab_size": V, "max_position_embeddings": 256,
         "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False, "rope_theta": 10000.0}
LLAMA_GPT = dict(layers=L, width=H, heads=A, kv_heads=KV, ffn=FFN, gated=True, vocab=V, seq_len=S)
# Mixtral's config as a one-layer Llama's (MOE_LLAMA) with the MLP replaced by E experts of the same products
MOE_LLAMA = {"model_type": "llama", "hidden_size": H, "intermediate_size": TOP_K * EXPERT_FFN, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256,
             "tie_word_embeddings": False}
MIXTRAL = {**MOE_LLAMA, "model_type": "mixtral", "intermediate_size": EXPERT_FFN, "num_local_experts": EXPERTS,
           "num_experts_per_tok": TOP_K}
# Qwen3's config of MOE_LLAMA's sizes (its head size given: its default is 128), and Qwen3-MoE's of the same
QWEN3 = {**MOE_LLAMA, "model_type": "qwen3", "head_dim": H // 4}
QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_FFN}
# gpt-oss's layout on Mixtral's sizes: biases on every product (attention, router, experts), attention sinks, gate
# and up interleaved, one sliding-window layer
GPT_OSS = {**MIXTRAL, "model_type": "gpt_oss", "attention_bias": True, "head_dim": H // 4, "sliding_window": 8,
           "layer_types": ["sliding_attention"]}
# DeepSeek-V3's layout, tiny: MLA (queries and keys of 16 + 8 RoPE, values of 16), one dense layer, then experts
TINY_DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": H, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
                 "num_experts_per_tok": TOP_K, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 100,
                 "max_position_embeddings": 256, "tie_word_embeddings": False}
# A Llama config.json as torchtitan's tensor-parallel runs read it (its architecture named), as text
TP_LLAMA_JSON = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                            "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
                            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                            "attention_bias": False, "mlp_bias": False})
# A MoE gpt of 16 experts on H100s, 4 data-parallel replicas in expert-parallel groups of 4: `estimate`'s flags
MOE_GPT_FLAGS = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000,
                 "--gated", "--experts", 16, "--top-k", 2, "--expert-ffn", 512, "--gpu", "h100-sxm",
                 "--data-parallel", 4, "--expert-parallel", 4)


def write_config(folder: Path, fields: dict) -> Path:
    """A Hugging Face config.json of `fields` in `folder` (made): the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def count_config(folder: Path, fields: dict, *args, **kwargs) -> WorkloadCount:
    """A Hugging Face config of `fields`, written in `folder`, counted at S tokens a sequence, B sequences, in
    bfloat16 (count_built's further arguments, `args` and `kwargs`, as given)."""
    import torch

    from pipesim.workload.count import count_built

    return count_built(f"hf:{write_config(folder, fields)}", {"seq_len": S}, B, torch.bfloat16, *args, **kwargs)


@cache
def tiny_deepseek_count() -> WorkloadCount:
    """TINY_DEEPSEEK (MLA, a dense layer, then routed experts) counted at S tokens, B sequences, in bfloat16, flash."""
    import tempfile

    import torch

    from pipesim.workload.count import count_built

    config = write_config(Path(tempfile.mkdtemp()) / "deepseek", TINY_DEEPSEEK)
    return count_built(f"hf:{config}", {"seq_len": S}, B, torch.bfloat16, "flash")


def priced_recomputing(layer, *modules: str, recompute: str = "none"):
    """`layer` priced on the H100 in bf16 at micro-batch 2, recomputing `modules` under `recompute`."""
    parallel = Parallelism(recompute=recompute, recompute_modules=modules)
    return estimate_layer(layer, H100_BF16, parallel, None, 2)


def estimated_layers(tmp_path: Path, *args) -> list[dict]:
    """`pipesim estimate ARGS`'s layers (conftest's `estimate_json`)."""
    return estimate_json(tmp_path, *args)["layers"]
