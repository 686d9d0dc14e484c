"""What several test modules build alike, built once here, so that no test module imports another: the profiles
calibrated in the repository, the parts they price on (as a device, on an attention kernel, and an H100 node's
placement), a small GPT's count, a hand-written two-stage schedule, the lowered schedule's rows as they read them, a
flag's value in a printed command, tune's JSON as two runs share it, and the executor tests' device threads and
weight comparison; then, by theme, the tiny Hugging Face models and their counts, the expert-parallel and float8
tests' models and layers, the README's sections, the host's passes, the executor tests' runs, the tune tests'
models, searches and bounds, a measured-looking probe run, an estimated gpt's interleaved run and torch.profiler
traces written by hand. Each part is frozen (or cached and not changed): the tests share it safely."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import reject
from hypothesis import strategies as st

from pipesim.calibrate.runtime import WARMUP_ROWS
from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning import tune as tuning
from pipesim.planning.estimate import (
    Device,
    Parallelism,
    estimate_layer,
    kernel_curve,
    node_placement,
    placement_links,
)
from pipesim.planning.host import Kernels, issued_ms
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.schema import COMPUTE_KINDS, StagePasses, Timing, load_profile
from pipesim.profiles.workload import LayerCount, OpCount, WorkloadCount
from pipesim.schedules import (
    KIND_CODE,
    METHODS,
    SYNCHRONOUS,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    build_schedule,
    flushes,
)
from pipesim.schedules.analysis import warmup_minibatches
from pipesim.schedules.lowering import Lowered
from pipesim.schedules.table import KINDS
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.cluster import Link
from pipesim.study.plan import Setting
from pipesim.traces import Trace, summarize
from pipesim.traces.trace import Counter, Ops, Stream, TraceMeta
from tests.conftest import build, estimate_json, pipesim

if TYPE_CHECKING:
    import torch

    from pipesim.executor import DeviceLoop, RunSpec

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


def around_first(lowered: Lowered, kind: str) -> tuple[list[tuple[str, int, int]], bool]:
    """The rows before, at and after stage 0's first `kind` row (micro-batch 0), as `kind_stage_microbatch`'s, and
    whether the row after it waits for it."""
    rows = kind_stage_microbatch(lowered)
    first = rows.index((kind, 0, 0))
    return rows[first - 1:first + 2], lowered.awaits[first + 1] == first


def stream_rows(trace: Trace) -> list[tuple[str, int, float, float]]:
    """Each row of `trace` as (its kind's name, its stream, its start and its duration in ms), in row order."""
    ops = trace.ops
    return [(trace.kinds[k], int(s), start / 1e3, dur / 1e3)
            for k, s, start, dur in zip(ops.kind, ops.stream, ops.start_us, ops.dur_us)]


def without(schedule: Schedule, token: str) -> Schedule:
    """`schedule` with its orders' `token` dropped (an action it must have)."""
    return schedule.with_orders(Schedule.orders_from_text(schedule.to_text().replace(f" {token}", "")))


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a command's arguments (`shlex.split` of a printed command); None where not given."""
    return args[args.index(flag) + 1] if flag in args else None


def tune_document(out: str) -> dict:
    """`pipesim tune --json`'s document less the search's and the estimates' seconds, which no two runs share."""
    document = json.loads(out)
    del document["search"]["seconds"], document["search"]["estimates_seconds"]
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


def what_if_refused(tmp_path: Path, model: str, *flags: Any) -> str:
    """`simulate --gpu h100-sxm` of `model` at 64 tokens on 2 stages with `flags` and an --html page, which must
    refuse in one line (exit 2, nothing on stdout, no page): the line."""
    page = tmp_path / "t.html"
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 1, "-p", 2,
                             *flags, "--html", page)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, (code, out, err)
    assert not page.exists()
    return err


_CONFIG_COUNTS: dict[tuple, WorkloadCount] = {}  # count_config's, by config and arguments


def count_config(folder: Path, fields: dict, *args, **kwargs) -> WorkloadCount:
    """A Hugging Face config of `fields`, written in `folder`, counted at S tokens a sequence, B sequences, in
    bfloat16 (count_built's further arguments, `args` and `kwargs`, as given). A count reads the config alone, so
    each config is counted once with the same arguments in a session (its name: the folder it was first written
    in), as a session fixture would: the tiny configs' counts are most of their modules' time."""
    import torch

    from pipesim.workload.count import count_built

    spec = f"hf:{write_config(folder, fields)}"
    key = (json.dumps(fields, sort_keys=True), args, tuple(sorted(kwargs.items())))
    if key not in _CONFIG_COUNTS:
        _CONFIG_COUNTS[key] = count_built(spec, {"seq_len": S}, B, torch.bfloat16, *args, **kwargs)
    return _CONFIG_COUNTS[key]


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


# The expert-parallel tests' MoE gpt: its sequence, width and expert MLP (EXPERTS experts, top-TOP_K)
EP_S, EP_H, EP_FFN = 512, 256, 512
EP_GPT = dict(layers=4, width=EP_H, heads=4, seq_len=EP_S, vocab=1000, gated=True, experts=EXPERTS, top_k=TOP_K,
              expert_ffn=EP_FFN)
# A MoE gpt over 16 H100s, each its own expert-parallel rank, run 1F1B on one stage, any token dispatcher; the GPU's
# pricing alone (a layer this small waits on the host, planning/host.py); both with DeepEP's dispatcher
ANY_DISPATCHER = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000,
                  "--gated", "--experts", 16, "--top-k", 2, "--expert-ffn", 512, "--gpu", "h100-sxm", "-p", 1, "-m", 4,
                  "-s", "1f1b", "--data-parallel", 16, "--expert-parallel", 16)
GPU_ALONE = ("--host-kernel-us", 0)
DEEPEP_GPT_FLAGS = (*ANY_DISPATCHER, "--token-dispatcher", "deepep", *GPU_ALONE)
H100_TENSOR_LINK = placement_links(H100, Parallelism()).tensor  # a tensor-parallel group's link in an H100 node
# A small flash-attention gpt's flags, as the float8 tests give them
SMALL_FLASH_GPT_FLAGS = ("--model", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len", "64",
                         "--vocab", "128", "--attention", "flash")
# A gpt whose head is as heavy as several blocks (a cut balanced for time gives it fewer) on A100s: its flags
HEAVY_HEAD_GPT_FLAGS = ("--model", "gpt", "--layers", 4, "--width", 64, "--heads", 2, "--seq-len", 32, "--vocab", 32768,
                        "--gpu", "a100-sxm-80gb")
TINY_SETTING = Setting("mlp", {"layers": 2, "width": 16}, stages=2, microbatches=2, microbatch_size=4, minibatches=4)
README = Path(__file__).resolve().parents[1] / "README.md"
INSTALL_STEPS = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")


@cache
def ep_gpt_count() -> WorkloadCount:
    """EP_GPT counted at micro-batch 1 in bfloat16 with flash attention."""
    import torch

    from pipesim.workload.count import count_built

    return count_built("gpt", EP_GPT, 1, torch.bfloat16, "flash")


@cache
def lean_experts_count() -> WorkloadCount:
    """A small MoE whose experts compute little beside what they exchange (f = 128, 2,048 tokens)."""
    import torch

    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=4, width=256, heads=4, seq_len=2048, vocab=1000, gated=True, experts=8,
                                   top_k=2, expert_ffn=128), 1, torch.bfloat16, "flash")


@cache
def ring_gpt_count() -> WorkloadCount:
    """A 2-layer GPT of 256 tokens, 8 heads, counted at micro-batch 2 in bfloat16 with flash attention: the context
    rings' model (test_context_ring, test_cp_rotate)."""
    import torch

    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=192, heads=8, seq_len=256, vocab=512), 2, torch.bfloat16, "flash")


def matmul_count(m: int, n: int, k: int) -> OpCount:
    """An (m x k) @ (k x n) product with a bias, as counted."""
    return OpCount("addmm", "matmul", (1, m, n, k), 2 * m * n * k, 2 * (m * k + k * n + m * n), 1)


def product_attention_layer(tokens: int, width: int) -> LayerCount:
    """A transformer layer of one width x width linear product and a small fused attention kernel (8 heads, 256
    tokens), its input saved by the product alone and the attention's output by the kernel and the product."""
    heads, seq = 8, 256
    product = matmul_count(tokens, width, width)
    attention = OpCount("flash", "attention", (heads, seq, seq, 64), 4 * heads * seq * seq * 64, 0, 1)
    ops = {"fwd": (product, attention), "igrad": (matmul_count(tokens, width, width),),
           "wgrad": (matmul_count(width, width, tokens),)}
    ops["bwd"] = ops["igrad"] + ops["wgrad"]
    saved = (((tokens, width), 2 * tokens * width), ((tokens, width), 2 * tokens * width))
    return LayerCount("1:block", 0, 0, 0, 0, 0, 0, 4 * tokens * width, 0, 0, {}, {}, (1, tokens, width),
                      2 * tokens * width, (0,), saved, ops, ("mlp", "attention"), ("only", "also"))


def page_data(text: str) -> dict:
    """The data a page (traces/view.py's) carries in its JSON script."""
    payload = re.search(r'<script type="application/json" id="pipesim-data">(.*?)</script>', text, re.S).group(1)
    return json.loads(payload.replace("<\\/", "</"))


def bash_commands(block: str) -> list[str]:
    """The commands of one bash block: continuations joined, comments and install steps dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        steps = [step.strip() for step in line.split("&&")]
        kept = [step for step in steps if not step.startswith(INSTALL_STEPS)]
        if kept:
            commands.append(" && ".join(kept))
    return commands


def readme_section(title: str) -> str:
    """The README's `## title` section."""
    return README.read_text().split(f"\n## {title}\n")[1].split("\n## ")[0]


def readme_prose(title: str) -> str:
    """The README's `## title` section as one line of words: a sentence quoted across its lines reads as one."""
    return " ".join(readme_section(title).split())


def shown_after(text: str, command_start: str) -> tuple[str, list[str]]:
    """The command in `text` that starts with `command_start` and the lines of the first output block after it."""
    command = next(line.split("  #")[0].strip() for line in text.splitlines()
                   if line.startswith(command_start))
    after = text.split(command, 1)[1].split("```", 1)[1]  # past the end of the command's block
    return command, re.search(r"```\n(.*?)```", after, flags=re.S).group(1).splitlines()


NUMBER_WORDS = {2: "two", 3: "three", 8: "eight", 16: "sixteen"}  # as the README writes counts


def host_floor_ms(passes: list[list[Kernels]]) -> float:
    """What a stage's pass none of whose layers synchronises waits for its host: its issue beyond its GPU time."""
    return max(0.0, sum(issued_ms(kernels) - sum(run.count * run.gpu_ms for run in kernels) for kernels in passes))


def random_pass(rng: random.Random, waits: bool) -> list[Kernels]:
    """A pass of 1-6 runs of random sizes and costs, an all-to-all's GPU time the host issues under among them (one
    that waits first where `waits`, as `pass_kernels` places a dropless dispatch)."""
    runs = [Kernels(rng.randint(1, 5), rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0),
                    rng.choice((0.0, rng.uniform(0.0, 2.0)))) for _ in range(rng.randint(1, 6))]
    if waits or rng.random() < 0.5:
        runs.insert(rng.randint(0, len(runs) - 1), Kernels(1, 0.0, rng.uniform(0.0, 3.0), waits=waits))
    return runs


def pair_parts(trace) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a trace's overlapped pairs: their forward parts, and their backward parts."""
    ops, kinds = trace.ops, list(trace.kinds)
    forward = np.flatnonzero((ops.kind == kinds.index("F")) & (ops.peer >= 0))
    backward = np.flatnonzero((ops.kind == kinds.index("B")) & (ops.peer >= 0))
    return forward, backward


# The executor tests' runs: torch and pipesim.executor are imported where they run, so that the modules without
# them import this file alike
# The gpt of 4 routed experts and a shared one in each of its 2 blocks that the expert-parallel executor tests train
DP_REPLICAS = 2  # the data-parallel executor tests' replicas
EXECUTOR_MOE = {"layers": 2, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32, "experts": 4, "top_k": 2,
                "shared_experts": 1, "expert_ffn": 8}


def spec_for(method: str, *, stages: int = 2, chunks: int = 1, m: int = 4, n: int = 3, optimizer: str = "sgd",
             dtype: str = "float64", layers: int = 7, lr: float = 0.05) -> RunSpec:
    """`method`'s run of an mlp of `layers` + 1 Linear layers, width 16, micro-batches of 4, seed 3, not scored on
    the held-out set (the tests read the weights, losses and rows; a test of the score asks for it)."""
    from pipesim.executor import RunSpec

    schedule = build_schedule(method, ScheduleParams(stages=stages, microbatches=m, minibatches=n, chunks=chunks))
    return RunSpec(schedule, "mlp", {"layers": layers, "width": 16}, microbatch_size=4, optimizer=optimizer,
                   lr=lr, seed=3, dtype=dtype, heldout=False)


def pipeline_weights(result, stages: int) -> list[torch.Tensor]:
    """A run's weights, stage by stage, of its first replica."""
    return [w for k in range(stages) for w in result.weights[(k, 0)]]


def plain_training(spec: RunSpec) -> tuple[list[torch.Tensor], list[float]]:
    """Plain training: per mini-batch, m micro-batches' gradients accumulated (loss / m), one optimizer step."""
    from torch import nn

    from pipesim.executor import microbatch_data
    from pipesim.workload.optim import make_optimizer

    model = spec.build_model()
    net = nn.Sequential(*model.layers)
    optimizer = make_optimizer(spec.optimizer, net.parameters(), spec.lr)
    m, losses = spec.schedule.microbatches, []
    for b in range(spec.schedule.minibatches):
        total = 0.0
        for j in range(m):
            x, target = microbatch_data(spec, model, b, j)
            loss = model.loss(net(x), target) / m
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return [p.detach() for p in net.parameters()], losses


def dp_spec(method: str, m: int, *, stages: int = 2, n: int = 2, optimizer: str = "sgd",
            d: int = DP_REPLICAS) -> RunSpec:
    """The mlp's 5 Linear layers over `stages` stages, float64, d replicas, not scored on the held-out set."""
    from pipesim.executor import RunSpec

    return RunSpec(build(method, stages, m, n, data_parallel=d), "mlp", {"layers": 4, "width": 12},
                   microbatch_size=4, optimizer=optimizer, lr=0.05, seed=5, dtype="float64", heldout=False)


def in_one_process(spec: RunSpec) -> RunSpec:
    """The same training in one process: one pipeline's mini-batch of d x m micro-batches."""
    schedule = spec.schedule
    return replace(spec, schedule=build("gpipe", 2, schedule.data_parallel * schedule.microbatches,
                                        schedule.minibatches))


def ep_spec(method: str, m: int, optimizer: str, stages: int = 2, replicas: int = 2, **options: float) -> RunSpec:
    """EXECUTOR_MOE over `stages` stages and `replicas` data-parallel replicas, E = 2 of them in each
    expert-parallel group."""
    from pipesim.executor import RunSpec

    return RunSpec(build(method, stages, m, 2, data_parallel=replicas, expert_parallel=2), "gpt",
                   {**EXECUTOR_MOE, **options}, microbatch_size=2, optimizer=optimizer, lr=0.05, seed=3,
                   dtype="float64", heldout=False)


def device_loops(spec: RunSpec, loop: type[DeviceLoop] | None = None, **loop_options) -> list[DeviceLoop]:
    """A loop per device (`loop`, DeviceLoop unless given), over the in-process transport; the devices that hold a
    model copy's same stages (DualPipe) average their gradients in a room."""
    from pipesim.executor import DeviceLoop, cut
    from pipesim.executor.replicas import Layout, thread_replicas
    from pipesim.schedules import lower
    from pipesim.workload.transport import InProcessTransport

    lowered = lower(spec.schedule)
    devices = spec.schedule.num_devices
    transports = InProcessTransport.connected(devices, timeout_s=60)
    _, replicas = thread_replicas(Layout.of(spec.schedule), 60)
    return [(loop or DeviceLoop)(spec, lowered, cut(spec), d, transports[d], replicas=replicas[d], **loop_options)
            for d in range(devices)]


# The tune tests' models, searches and bounds
# A 4-layer GPT on A100s (tune's reserve), and a 12-layer one at t = 1 and 2, b = 1 and 2, each recomputation and
# every depth p on 8 of them: 48 settings (tests/tune_digests.json)
A100_GPT4 = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
             "--vocab", 1000)
A100_GPT12 = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 12, "--width", 512, "--heads", 8, "--seq-len",
              512, "--vocab", 1000)


# One configuration open to the search: 1F1B, p = 2 over the 2 GPUs, b = 1, m = 8, no recomputation.
ONE_CONFIGURATION = ("-D", 2, "-B", 8, "-s", "1f1b", "--tensor-parallel", 1, "--data-parallel", 1, "-b", 1,
                     "--recompute", "none")


def tuned_peak_mib(*flags) -> float:
    """ONE_CONFIGURATION's peak as `tune --json` reads it for A100_GPT4 under `flags`, in MiB."""
    code, out, err = pipesim("tune", *A100_GPT4, *ONE_CONFIGURATION, *flags, "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    assert (choice["schedule"], choice["stages"], choice["microbatches"]) == ("1f1b", 2, 8)
    return choice["peak_memory_gib"] * 1024


def simulated_peak_mib(*flags) -> float:
    """ONE_CONFIGURATION's busiest device's peak as `simulate --json` reads for A100_GPT4 under `flags`, in MiB."""
    code, out, err = pipesim("simulate", *A100_GPT4, "-p", 2, "-m", 8, "-s", "1f1b", "-b", 1, "--recompute", "none",
                             *flags, "--json")
    assert code == 0, err
    return max(device["peak_memory_mb"] for device in json.loads(out)["results"][0]["devices"])


class _Captured(Exception):
    """Raised in place of the search: the settings and problem the command line built are all a test wants."""


def searched(*flags, model: tuple = A100_GPT4) -> tuple[list, Any]:
    """The profiles `tune --gpu` searches for `model` under `flags`, and its problem (the search itself not run)."""
    captured = []

    def capture(settings, problem, *_):
        captured.append((list(settings), problem))
        raise _Captured

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "tune", capture)
        with pytest.raises(_Captured):
            pipesim("tune", *model, *flags)
    return captured[0]


def searched_settings(*flags, model: tuple = A100_GPT4) -> list:
    """The profiles `tune --gpu` searches for `model` under `flags` (`searched`'s, without its problem)."""
    return searched(*flags, model=model)[0]


# The 48 settings' flags: sequence parallelism off, as recorded before tune searched it
# (tests/test_default_attention.py holds the search)
DIGEST_FLAGS = ("-D", 8, "-B", 32, "-b", 2, "--recompute", "selective", "--no-sequence-parallel")


def searched_shapes() -> tuple:
    """The 48 settings' search as `digests` runs it: its problem (every method but auto), the orders it builds
    and its shapes (`_shapes`)."""
    problem = tuning.Problem(8, 80 * tuning.GIB, 32, tuple(name for name in METHODS if name != "auto"), 8)
    orders = tuning._Orders()
    shapes, _, _ = tuning._shapes(searched_settings(*DIGEST_FLAGS, model=A100_GPT12), problem, orders)
    return problem, orders, shapes


# The engine times each row in whole picoseconds (sim/engine.py `_PS_PER_MS`): a step read from its runs can sit up
# to half a picosecond a row from the same costs summed in floats, so the bounds are held to it that far.
ROUNDING_MS = 1e-7

_times = st.floats(0.0, 5.0, allow_nan=False)

PRODUCT_MS = (0.05, 0.3, 1.0)  # a product's time, which a transfer's kernel delays it at most (0: its whole time)


@st.composite
def chains(draw):
    """Random costs of a chain of 1-4 stages, with 1-6 micro-batches, each stage's F, I, W (B no more than both, as
    it saves the second walk), update, REDUCE over two replicas, accumulation and output size; a link's latency and
    bandwidth; whether transfers hold the compute beside them, and each product's time, by which they hold it at
    most (or their whole time)."""
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    stages = []
    for _ in range(p):
        f, i, w = draw(_times), draw(_times), draw(_times)
        stages.append(dict(fwd_ms=f, bwd_ms=i + w - draw(st.floats(0.0, 1.0)) * min(i, w), igrad_ms=i, wgrad_ms=w,
                           opt_ms=draw(_times), reduce_ms=draw(_times), accumulate_ms=draw(st.floats(0.0, 1.0)),
                           output_bytes=draw(st.integers(0, 4000)),
                           product_ms=draw(st.sampled_from((0.0, *PRODUCT_MS)))))
    costs = Costs.per_stage(p, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(costs, stages=tuple(replace(stage, **given) for stage, given in zip(costs.stages, stages)),
                    transfers_hold_products=draw(st.booleans()))
    links = Cluster(p, Link(latency_ms=draw(st.floats(0.0, 2.0)), bandwidth_bytes_per_ms=draw(st.floats(500, 1e4))))
    return costs, links, m


def method_shape(name: str, draw, most_devices: int = 16, most_microbatches: int = 64) -> tuple[int, int, int]:
    """A (p, m, N) for method `name`, p in 2..most_devices (8 for the methods of two chunks, 4 at least for
    graphpipe) and m in 1..most_microbatches, leaving out only the shapes each method refuses (and says so:
    tests/test_rivals.py, test_pipedream_2bw_rejects_too_few_microbatches): every one drawn must build."""
    p = draw(st.integers(2, most_devices if name not in ("zb-v", "dualpipev", "dualpipe", "interleaved-1f1b")
                         else min(most_devices, 8)))
    low = {"zb-h2": 2 * p - 1, "dualpipev": 2 * p, "pipedream-2bw": max(p - 1, 1)}.get(name, 1)
    m = draw(st.integers(low, max(low, most_microbatches)))
    if name == "interleaved-1f1b":
        m = p * draw(st.integers(1, max(1, most_microbatches // p)))
    if name == "dualpipe":  # p and m even, m >= 2p
        p -= p % 2
        m = 2 * draw(st.integers(p, max(p, most_microbatches // 2)))
    if name == "graphpipe":
        p = max(p, 4)
    n = draw(st.integers(1, 3))
    return p, m, n


# The methods of a fixed order
FIXED_ORDERS = ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipedream", "pipedream-2bw")


def tune_runs(schedule_of) -> tuple[int, int]:
    """The mini-batches of tune's short and long runs of an order (`_plan`'s)."""
    probe = schedule_of(2)
    flushing = flushes(probe)
    short = warmup_minibatches(flushing, probe.num_stages, probe.microbatches)
    return short, short + (1 if flushing else tuning.STEADY_STEPS)


def measured_step_ms(schedule_of, costs, links, growth: tuple[float, Trace] | None = None) -> float:
    """The step as tune measures it (`_measured`), short of the busiest device's compute: the makespan's growth
    from its warm-up's mini-batches to the long run's, per mini-batch, or for an order that never flushes the
    step of the periodic regime its rows reach (`_periodic_step_ms`). `growth`: `makespan_growth_ms`'s answer for
    the same order, costs and links where the caller has it (the simulation is deterministic: its two runs are
    not simulated again)."""
    short, long = tune_runs(schedule_of)
    growth_ms, long_trace = growth or makespan_growth_ms(schedule_of, costs, links)
    if flushes(schedule_of(long)):
        return growth_ms
    return tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms)


def makespan_growth_ms(schedule_of, costs, links) -> tuple[float, Trace]:
    """The makespan's growth from tune's short run to its long one, per mini-batch, and the long run's trace: its
    rows alone (`memory=False`, as tune's longer runs: the same rows, tests/test_engine_rows.py)."""
    short, long = tune_runs(schedule_of)
    long_trace = simulate(schedule_of(long), costs, links, memory=False)
    return (summarize(long_trace).makespan_ms - makespan_ms(schedule_of(short), costs, links)) / (long - short), \
        long_trace


def makespan_ms(schedule: Schedule, costs: Costs, links: Cluster) -> float:
    """`schedule`'s simulated makespan, its rows alone simulated (`memory=False`: no counters a makespan never
    reads, about 70 % of a trace's making; the same rows, tests/test_engine_rows.py)."""
    return summarize(simulate(schedule, costs, links, memory=False)).makespan_ms


def costed_step_ms(schedule_of, costs, links) -> tuple[float, float]:
    """`_costed`'s least step (from its samples/s bound) for the long run of `schedule_of`, as `_plan` sets it, and
    its busiest device's compute per step, which `_measured` takes as the step where the growth is less."""
    short, long = tune_runs(schedule_of)
    schedule = schedule_of(long)
    scenario = SimpleNamespace(costs=lambda built, bounds: costs)
    config = SimpleNamespace(stages=schedule.num_devices, pipelines=schedule.pipelines)
    problem = tuning.Problem(schedule.num_devices, 0, 1000, (), 8)
    costed = tuning._costed(scenario, problem, config, tuning._Order.of(schedule), None, short, links)
    return problem.batch_size / costed[-1] * 1e3, tuning._steady_busiest_ms(schedule, costs, costed[2], short)


def fixed_order(name: str, stages: int, microbatches: int, after_flush: bool) -> Callable[[int], Schedule]:
    """`name`'s order of a random chain by its mini-batches (two replicas, REDUCEs after the flush or not); the
    example is rejected where the method refuses the shape."""
    def schedule_of(minibatches: int) -> Schedule:
        return build_schedule(name, ScheduleParams(stages, microbatches, minibatches, data_parallel=2,
                                                   reduce_after_flush=after_flush))

    try:
        schedule_of(2)
    except ScheduleError:
        reject()
    return schedule_of


def adam_settings(profile) -> list[tuning.Setting]:
    """The one setting of `profile`, updated by Adam."""
    return [tuning.Setting(profile_scenario(profile, "adam"))]


def tune_problem(profile, devices, cap_gib, **kw) -> tuning.Problem:
    """`devices` of `cap_gib` each, a batch of 4 micro-batches a device, every method unless `schedules` says."""
    batch = 4 * devices * profile.environment.microbatch_size
    return tuning.Problem(devices, int(cap_gib * tuning.GIB), batch, kw.pop("schedules", tuple(METHODS)), **kw)


def gpt_on_8(cap_gib: float) -> tuple[list[tuning.Setting], tuning.Problem]:
    """The calibrated small GPT's setting and its problem on 8 devices of `cap_gib` each, every method."""
    profile = load_profile(GPT_CPU)
    return adam_settings(profile), tune_problem(profile, 8, cap_gib)


def exhaustive(source, prob):
    """Every candidate simulated: the groups of twins in rank order, allowed ones, those faster than the
    best allowed one by more than OVER_MARGIN but over a limit (whose memory floor fits: one over it is never
    simulated; the fastest over the cap alone among the rows shown), and those as fast over the staleness limit
    alone, as `tune` defines them (the search is what is under test), each device's memory the cap, as `tune` holds
    it (`capped_settings`)."""
    candidates, _, _ = tuning.prepare(tuning.capped_settings(source, prob), prob)
    results = [tuning.evaluate(prob, c) for c in candidates]

    def grouped(chosen):
        groups = []
        for result in sorted(chosen, key=tuning.rank_key):
            group = next((g for g in groups if tuning.twins(g[0], result)), None)
            group.append(result) if group else groups.append([result])
        return groups

    best = grouped([r for r in results if tuning.allowed(r, prob)])
    top = tuning.speed_key(best[0][0].samples_per_s * (1 + tuning.OVER_MARGIN)) if best else float("-inf")
    faster = grouped([r for r in results if not tuning.allowed(r, prob) and tuning.speed_key(r.samples_per_s) > top
                      and r.candidate.memory_floor_bytes <= prob.memory_cap_bytes])
    staler = [g for g in faster if g[0].peak_memory_bytes <= prob.memory_cap_bytes]  # every one, fastest first
    heavier = [g for g in faster if g[0].peak_memory_bytes > prob.memory_cap_bytes
               and g[0].staleness <= prob.max_staleness]  # over the cap alone: the fastest keeps a row
    shown = faster[:tuning.RUNNERS_UP]
    if heavier and heavier[0] not in shown:
        shown = shown[:-1] + heavier[:1]
    return best[:tuning.RUNNERS_UP + 1], shown, staler, results


def differences(found, best, faster, staler) -> list[str]:
    """Where the pruned search's answer differs from the exhaustive one: configurations, scores, twins."""
    def rows(row_list):
        return [(r.result.config, r.result.samples_per_s, r.result.peak_memory_bytes, r.twins) for r in row_list]

    def groups(group_list):
        return [(g[0].config, g[0].samples_per_s, g[0].peak_memory_bytes, [t.config for t in g[1:]])
                for g in group_list]

    def noted():
        """The staler winner as the exhaustive search has it: the fastest group where the note is exact, else the
        group the configuration named heads, if the bound is no lower than the fastest's speed; with the twins the
        note lists of that group (those simulated)."""
        if found.staler is None or not staler:
            return groups(staler[:1])
        bound = found.staler_bound
        group = staler[0] if bound is None else next((g for g in staler if g[0].config == found.staler.result.config),
                                                     None)
        if group is None or (bound is not None and bound.max_samples_per_s < staler[0][0].samples_per_s):
            return ["a stale configuration faster than the choice, whose bound is no lower than the fastest's"]
        return [(group[0].config, group[0].samples_per_s, group[0].peak_memory_bytes,
                 [twin.config for twin in group[1:] if twin.config in found.staler.twins])]

    wrong = []
    for what, got, want in (("choice and runners-up", rows([found.choice, *found.runners_up]), groups(best)),
                            ("excluded", rows(found.excluded), groups(faster)),
                            ("staler winner", rows([found.staler] if found.staler else []), noted())):
        if got != want:
            wrong.append(f"{what}: search {got} != exhaustive {want}")
    return wrong


def accumulating(profile, fraction=0.5):
    """The same model with a gradient accumulation into the buffer timed on every stage (`fraction` of its
    backward), as an estimate has: every B or W but a span's first takes that much longer."""
    def timed(stage):
        ms = fraction * sum(profile.layers[i].bwd.median_ms for i in range(*stage.layers))
        return stage.model_copy(update={"accumulate": Timing(median_ms=ms, spread_ms=0.0, repeats=1)})

    return profile.model_copy(update={"stages": [timed(stage) for stage in profile.stages]})


def jittered(profile, seed):
    """The profile with every layer's passes scaled at random (x0.2 to x5, each pass on its own): other costs,
    other balances, other winners."""
    rng = np.random.default_rng(seed)

    def scaled(timing):
        return timing.model_copy(update={"median_ms": timing.median_ms * float(rng.uniform(0.2, 5.0))})

    layers = [layer.model_copy(update={kind: scaled(getattr(layer, kind)) for kind in ("fwd", "bwd", "igrad", "wgrad")})
              for layer in profile.layers]
    return profile.model_copy(update={"layers": layers})


def bounds_over_random_costs(which, devices, cap_gib, seed) -> dict[str, int]:
    """Checks every bound of every configuration of `which` at random costs against its simulation, and counts
    the configurations checked, those held (their transfers holding the products beside them), and those where
    each bound bit: below the busiest device's compute (bubbles), the shape's below its plain bound, a cut or a
    partition tightening the shape's."""
    profile = jittered(load_profile(which), seed)
    source, prob = adam_settings(profile), tune_problem(profile, devices, cap_gib, search_seconds=0.02)
    orders = tuning._Orders()
    shapes, _, _ = tuning._shapes(source, prob, orders)
    built = tuning._Built(prob, orders)
    work = tuning._work(profile, "adam")
    bubbles = shape_bubbles = 0
    cut = planned = checked = held = 0
    for shape in shapes:
        partitioned = built.advance(shape)  # auto's shape on its partition, a chain's over its best cut, else built
        candidate = built.candidate(shape)
        if candidate is None:
            continue
        result = built.result(candidate)
        label = candidate.config.label()
        checked, held = checked + 1, held + candidate.costs.transfers_hold_products
        assert result.samples_per_s <= candidate.max_samples_per_s <= shape.max_samples_per_s, label
        assert result.samples_per_s <= built.tighten(candidate).max_samples_per_s, label
        assert result.samples_per_s <= partitioned.max_samples_per_s <= shape.max_samples_per_s, label
        if isinstance(partitioned, tuning.Shape) and partitioned.cut_bounded:  # no cut beats it, so neither this one
            assert candidate.max_samples_per_s <= partitioned.max_samples_per_s * (1 + 1e-9), label
            cut += partitioned.max_samples_per_s < shape.max_samples_per_s
            partitioned = built.advance(partitioned)
        if isinstance(partitioned, tuning.Shape) and not METHODS[shape.config.schedule].needs_costs:
            # on its partition before it is costed: its own costs are no less than its layers'
            assert partitioned.partitioned, label
            assert result.samples_per_s <= partitioned.max_samples_per_s <= shape.max_samples_per_s, label
            assert candidate.max_samples_per_s <= partitioned.max_samples_per_s * (1 + 1e-9), label
            planned += partitioned.max_samples_per_s < shape.max_samples_per_s
        assert shape.memory_floor_bytes <= candidate.memory_floor_bytes, label
        assert shape.staleness in (None, candidate.staleness), label
        bubbles += candidate.max_samples_per_s < prob.batch_size / candidate.busiest_ms * 1e3
        if shape.staleness is not None:  # a fixed order: the bound without its fill and drain
            sketch = orders.sketch(source[0].scenario, shape.config.schedule, candidate.params)
            plain = tuning._shape_bound(prob, shape.config, work, sketch, 1.0, chain=False)
            shape_bubbles += shape.max_samples_per_s < plain
    return dict(checked=checked, held=held, bubbles=bubbles, shape_bubbles=shape_bubbles, cut=cut, planned=planned)


def _batch_ms(problem: tuning.Problem, samples_per_s: float) -> float:
    return problem.batch_size / samples_per_s * 1e3


def bound_excesses(settings_: list[tuning.Setting], problem: tuning.Problem) -> list[str]:
    """Every bound the search computes for each candidate it builds (each shape walked as `top_groups` walks it:
    `_Built.advance` until it is a candidate, then `_Built.tighten`) against the candidate's simulated step, with
    the stage sums the bounds read against the candidate's own costs: what exceeds them, in words."""
    orders = tuning._Orders()
    shapes, _, _ = tuning._shapes(settings_, problem, orders)
    built = tuning._Built(problem, orders)
    wrong = []
    for shape in shapes:
        bounds, item = [("shape", shape.max_samples_per_s)], shape
        while isinstance(item, tuning.Shape):
            item = built.advance(item)
            if isinstance(item, tuning.Shape):
                bounds.append(("partitioned" if item.partitioned else "best cut", item.max_samples_per_s))
        if item is None:
            continue
        bounds += [("candidate", item.max_samples_per_s), ("critical path", built.tighten(item).max_samples_per_s)]
        result = built.result(item)
        label = f"{item.config.label()} m={item.config.microbatches} {item.bounds}"
        wrong += [f"{label}: {what} bound {_batch_ms(problem, bound):.6f} ms > step {result.step_ms:.6f} ms"
                  for what, bound in bounds if result.samples_per_s > bound * (1 + 1e-9)]
        wrong += stage_excesses(item.setting, item.bounds, item.config.pipelines, item.costs, label)
        wrong += link_excesses(built, item, label)
    return wrong


def link_excesses(built: tuning._Built, candidate: tuning.Candidate, label: str) -> list[str]:
    """What the pre-costing bound reads of a candidate's cut beside its layers' times: each stage's least REDUCE
    (`_layer_reduces_ms`) against its costed one, and, one stage a device, its transfers there and back
    (`_layer_hops_ms`) against the costed stages' (`_hops_ms`)."""
    setting, config, bounds = candidate.setting, candidate.config, list(candidate.bounds)
    pairs = [("REDUCE", built._layer_reduces_ms(setting, config, bounds),
              candidate.costs.op_ms_table(config.pipelines)[:, KIND_CODE[Kind.REDUCE]])]
    if config.chunks == 1:
        pairs.append(("hops", built._layer_hops_ms(setting, config, bounds),
                      tuning._hops_ms(candidate.links, candidate.costs, config.stages)))
    return [f"{label}: stage {k} least {what} {least[k]:.6f} ms > its cost {own[k]:.6f} ms"
            for what, least, own in pairs for k in np.flatnonzero(least > own * (1 + 1e-9) + 1e-12)]


def stage_excesses(setting: tuning.Setting, bounds: list[int], pipelines: int, costs, label: str) -> list[str]:
    """`_splitter`'s `stage_ms` (each stage's F, B, I, W from its layers' least times) and `_cut_accumulates_ms`
    (its accumulation), scaled as `_Built.advance` scales them, against the stage's own costs at that cut."""
    scenario_ = setting.scenario
    passes = [KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W)]
    summed = tuning._split_for(setting).stage_ms(list(bounds), pipelines)[:, passes] * scenario_.cost_scale
    own = costs.op_ms_table(pipelines)[:, passes]
    accumulated = tuning._cut_accumulates_ms(scenario_.measured, list(bounds)) * scenario_.cost_scale
    wrong = [f"{label}: stage {k} {'FBIW'[j]} sum {summed[k, j]:.6f} ms > its cost {own[k, j]:.6f} ms"
             for k, j in zip(*np.nonzero(summed > own * (1 + 1e-9) + 1e-12))]
    chain = tuning._ChainWork.of(scenario_.measured)
    if chain is not None:  # `_best_cut_ms`'s X: F, F + B and F + min(B, I) of each stage, its layers' sums
        f, b, i = own[:, 0], own[:, 1], own[:, 2]
        for name, prefix, cost in (("F", chain.forward, f), ("F + B", chain.whole, f + b),
                                   ("F + min(B, I)", chain.least, f + np.minimum(b, i))):
            layers_ms = scenario_.cost_scale * np.diff(np.array(prefix)[list(bounds)])
            over = np.flatnonzero(layers_ms > cost * (1 + 1e-9) + 1e-12)
            wrong += [f"{label}: stage {k} {name} of its layers {layers_ms[k]:.6f} ms > its cost {cost[k]:.6f} ms"
                      for k in over if k > 0 or name != "F + min(B, I)"]  # stage 0's input pass: none when split
    return wrong + [f"{label}: stage {k} accumulation {accumulated[k]:.6f} ms > its cost {c.accumulate_ms:.6f} ms"
                    for k, c in enumerate(costs.stages) if accumulated[k] > c.accumulate_ms * (1 + 1e-9) + 1e-12]


# An H100's flag, and a small GPT's
H100_GPU = ("--gpu", "h100-sxm")

SMALL_GPT_FLAGS = ("--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256, "--vocab", 1000)


def small_gpt_estimated(folder: Path, *flags) -> Path:
    """`estimate`'s profile of the small GPT on an H100 under `flags`, written in `folder`: its path."""
    path = folder / "profile.json"
    code, _, err = pipesim("estimate", *H100_GPU, *SMALL_GPT_FLAGS, "-b", 1, "--recompute", "none", *flags, "-o", path)
    assert code == 0, err
    return path


def small_gpt_searched(*flags) -> tuple[list[tuning.Setting], tuning.Problem]:
    """The settings and problem `tune --gpu` searches for the small GPT (the search itself not run)."""
    return searched(*flags, model=(*H100_GPU, *SMALL_GPT_FLAGS))


def exactly_searched(settings: list[tuning.Setting], capped: tuning.Problem) -> list[tuning.Result]:
    """Every candidate simulated, once the pruned search's answer under `capped` (whose cap some break) is found to be
    the exhaustive one's, simulating fewer, and every bound it prunes by to hold."""
    found = tuning.tune(settings, capped)
    best, faster, staler, results = exhaustive(settings, capped)
    assert differences(found, best, faster, staler) == []
    assert found.stats.simulated < len(results)
    assert any(not tuning.allowed(result, capped) for result in results)
    assert bound_excesses(settings, capped) == []
    return results



# A measured-looking probe run, a profile's stages' passes, an estimated gpt's interleaved run
def probe_trace(probe, extra: dict[str, float], gap_ms: float, send_ms: float, recv_ms: float, kept: float,
                window: int = 2, warmup_ms: tuple[float, ...] = (), send_cpu_ms: float | None = None,
                turn_ms: float | None = None, beyond_bytes: int = 0, in_flight_bytes: int = 0) -> Trace:
    """A measured-looking 1F1B-like probe run: two devices, three mini-batches of two micro-batches, rows timed as
    the executor times them: compute rows last their stage's own time plus `extra`, a SEND `send_ms` of which
    `send_cpu_ms` (default: all) its thread's CPU time, a RECV
    waits for its message and then takes `recv_ms`, and `gap_ms` passes between rows, each of the rows but a RECV
    and each gap `warmup_ms[j]` longer after j·WARMUP_ROWS compute rows of its device; before an update a device
    holds its weights, the mini-batch's gradient and the `kept` gradients an earlier update left, after it those
    copies, each time with the buffers of its next `window` receives, posted ahead, and throughout `beyond_bytes`
    its allocator holds beyond the books (a GPU's cuBLAS workspaces); before the first update, `in_flight_bytes`
    of sends not yet complete too (the executor's `sending_bytes`). With `turn_ms`,
    the two ranks shared a GPU over the host-staged transport: each compute row first waited that long for its turn
    (its `wait_us`), and the receives were posted in host memory."""
    own = {"F": "fwd_ms", "B": "bwd_ms", "I": "igrad_ms", "W": "wgrad_ms"}
    programs = {d: [(kind, d, j, b) for b in range(3) for kind, j in order] for d, order in (
        (0, [("F", 0), ("SEND_F", 0), ("F", 1), ("SEND_F", 1), ("RECV_B", 0), ("B", 0), ("RECV_B", 1), ("I", 1),
             ("W", 1), ("OPT", -1)]),
        (1, [("RECV_F", 0), ("F", 0), ("B", 0), ("SEND_B", 0), ("RECV_F", 1), ("F", 1), ("I", 1), ("W", 1),
             ("SEND_B", 1), ("OPT", -1)]))}
    rows, memory, sent, waits, sending = [], {0: [], 1: []}, {}, [], {0: [], 1: []}
    clock, at, computed = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}, {0: 0, 1: 0}
    while any(at[d] < len(programs[d]) for d in programs):
        for d, program in programs.items():
            while at[d] < len(program):
                kind, stage, j, b = program[at[d]]
                s = probe.stages[stage]
                if kind.startswith("RECV"):
                    arrival = sent.get((kind[-1], j, b))
                    if arrival is None:
                        break  # not sent yet: let the other device run
                    ms = max(arrival - clock[d], 0.0) + recv_ms
                elif kind.startswith("SEND"):
                    ms = send_ms
                    sent[(kind[-1], j, b)] = clock[d] + ms
                elif kind == "OPT":
                    ms = s.steps["sgd"].step.median_ms + extra[kind]
                else:
                    ms = getattr(s, own[kind]) + extra[kind]
                step = computed[d] // WARMUP_ROWS
                cold = warmup_ms[step] if step < len(warmup_ms) else 0.0
                computed[d] += kind in COMPUTE_KINDS
                ms, gap = (ms, gap_ms + cold) if kind.startswith("RECV") else (ms + cold, gap_ms + cold)
                waits.append(turn_ms if turn_ms is not None and kind in COMPUTE_KINDS else -1.0)
                clock[d] += max(waits[-1], 0.0)
                rows.append((d, kind, stage, j, b, 1 - d if "_" in kind else -1, clock[d] * 1e3, ms * 1e3))
                # around an update: weights, gradients and the next `window` receives (2 a mini-batch) posted
                posted = min(window, 2 * (2 - b)) * probe.stages[0].output_bytes * (turn_ms is None)
                updates = at[d] + 1 < len(program) and program[at[d] + 1][0] == "OPT"
                gradients = kept * (b > 0) + 1 if updates else kept if kind == "OPT" else None
                held = 10 * s.param_bytes if gradients is None else s.param_bytes + gradients * s.grad_bytes + posted
                flying = in_flight_bytes * (updates and b == 0)
                memory[d].append(((clock[d] + ms) * 1e3, held + beyond_bytes + flying))
                sending[d].append(((clock[d] + ms) * 1e3, flying))
                clock[d] += ms + gap
                at[d] += 1
    kinds = tuple(k.value for k in KINDS)
    table = list(zip(*rows))
    kind = np.array([kinds.index(k) for k in table[1]])
    stream = Stream.of_kinds(kinds)[kind]
    cpu_us = np.where(stream == Stream.SEND, (send_ms if send_cpu_ms is None else send_cpu_ms) * 1e3, -1.0)
    ops = Ops(device=table[0], stream=stream, kind=kind, stage=table[2], microbatch=table[3],
              minibatch=table[4], pipeline=np.zeros(len(rows)), peer=table[5], version=np.zeros(len(rows)),
              prediction=np.full(len(rows), -1), start_us=table[6], dur_us=table[7], cpu_us=cpu_us,
              wait_us=np.where(np.array(waits) >= 0, np.array(waits) * 1e3, -1.0))
    meta = TraceMeta(source="measured", schedule="probe", params={}, microbatches=2, minibatches=3, pipelines=1,
                     microbatch_size=1, placement=[0, 1], stage_edges=[[0, 1]], policy={}, tool="test",
                     hardware=None if turn_ms is None else {"device": "cuda", "host_staged": True},
                     extra={"recv_window": window})
    counters = {name: [Counter(*map(np.array, zip((0.0, 0), *samples[d]))) for d in (0, 1)]
                for name, samples in (("memory_bytes", memory), ("sending_bytes", sending))}
    return Trace(kinds, 2, ops, meta, counters)


def with_passes(profile, fwd_ratio, bwd_ratio):
    """`profile` as if its stages' passes had measured its layers' sums times these ratios (one per stage)."""
    def timing(ms):
        return Timing(median_ms=ms, spread_ms=0.0, repeats=5)

    stages = [stage.model_copy(update={"passes": StagePasses(
        fwd=timing(stage.fwd_ms * f), bwd=timing(stage.bwd_ms * b), igrad=timing(stage.igrad_ms * b),
        wgrad=timing(stage.wgrad_ms * b))}) for stage, f, b in zip(profile.stages, fwd_ratio, bwd_ratio)]
    return profile.model_copy(update={"stages": stages})


def interleaved_gpt(gpu: str, method: str = "interleaved-1f1b", chunks: int = 2, zero: int = 1,
                 reduce_after_flush: bool = False, **model: int):
    """A gpt of an embedding, six blocks (`model`: more of the gpt's options, experts) and a head estimated on
    `gpu` and cut into 2·`chunks` model stages, run as `method` (p = 2, m = 4, two mini-batches as `simulate` runs
    them) under `zero` over 8 replicas: its schedule, its costs, and the step of costs on its links in ms."""
    torch = pytest.importorskip("torch")
    from pipesim.hardware.catalogue import load_catalogue
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams
    from pipesim.sim.engine import simulate
    from pipesim.traces.metrics import summarize
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=6, width=2048, ffn=8192, heads=16, seq_len=2048, vocab=32768, **model),
                        1, torch.bfloat16)
    profile = estimate_profile(count, load_catalogue().find(gpu), Parallelism(data=8, sharded_optimizer=zero > 0))
    scenario = profile_scenario(profile, "adam")
    sched = scenario.build(method, ScheduleParams(2, 4, minibatches=2, chunks=chunks, data_parallel=8, zero=zero,
                                                  reduce_after_flush=reduce_after_flush))
    return sched, scenario.costs(sched), lambda costs: summarize(
        simulate(sched, costs, scenario.links(sched))).makespan_ms


def profiler_event(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    """One complete event of a torch.profiler Chrome trace (a `PP:<action>` range or an op inside it)."""
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}


def profiler_ranks(folder: Path, ranks: list[list[dict]]) -> list[Path]:
    """A torch run's profiler traces, `rank<r>.json` in `folder` with rank r's events, each naming its rank."""
    paths = []
    for rank, events in enumerate(ranks):
        paths.append(folder / f"rank{rank}.json")
        paths[-1].write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank}}))
    return paths


def datasheet_part(directory: Path, name: str) -> tuple:
    """--gpus/--gpu flags for the catalogue part `name` as its datasheet gives it: its table without
    `device_memory`, so the cap is the datasheet's memory (a test of a mechanism found at that cap)."""
    from pipesim.files import read_toml
    from pipesim.hardware.catalogue import BUILT_IN
    from pipesim.planning.sweep import toml_text

    table = read_toml(BUILT_IN, RuntimeError)["gpu"][name]
    path = directory / f"{name}-datasheet.toml"
    path.write_text(f"[gpu.{name}-datasheet]\n" + "".join(
        f"{json.dumps(key)} = {toml_text(value)}\n" for key, value in table.items() if key != "device_memory"))
    return "--gpus", path, "--gpu", f"{name}-datasheet"


def assert_computes_transformers_model(folder: Path, parts: Callable[[Any, Any], list], vocab: int) -> None:
    """pipesim's layers of the Hugging Face config in `folder`, their weights loaded into transformers' own model
    (`parts(model, base)`: its embedding, blocks, final norm and head, in pipesim's order), give its logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipesim.workload.hf import hf_model

    torch.manual_seed(0)
    layers = hf_model(f"hf:{folder}", 24).layers
    theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation="eager")
    for module, ours in zip(parts(theirs, theirs.get_decoder()), layers, strict=True):
        module.load_state_dict(getattr(ours, "layer", ours).state_dict())
    tokens = torch.randint(vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    hidden = tokens
    with torch.no_grad():
        for layer in layers:
            hidden = layer(hidden)
        torch.testing.assert_close(hidden, theirs(tokens, use_cache=False).logits)


def assert_trains_as_one_process(tmp_path: Path, model: str, stages: int = 2) -> None:
    """`run` trains `model` (hf:PATH, 24 tokens a sample) from its estimated profile on `stages` gloo ranks, a stage
    each, to the losses one process gives."""
    from pipesim.executor import RunSpec
    from tests.reference import single_process

    profile = tmp_path / "profile.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 24, "-b", 1, "-p", stages,
                   "--dtype", "fp32", "--out", profile).code == 0
    code, out, err = pipesim("run", "--model", model, "--profile", profile, "-s", "1f1b", "-p", stages, "-m", 2,
                             "-n", 2, "--json", "--no-heldout")
    assert code == 0, err
    ran = json.loads(out)
    assert ran["hardware"]["ranks"] == stages
    losses: list[float] = []
    single_process(RunSpec(build("gpipe", 1, 2, 2), model, {"seq_len": 24}, microbatch_size=1, lr=0.05), losses)
    np.testing.assert_allclose(ran["losses"][0], losses, rtol=1e-5)
