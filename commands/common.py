"""What the commands share: the consoles, the one-line error exit, checks of flag values and output paths,
progress bars, the options several commands declare word for word, and the Scenario their cost flags
describe. Imports only typer and rich at start-up, so every command starts fast."""

from __future__ import annotations

import copy
import errno
import functools
import gc
import importlib.util
import inspect
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, NoReturn, get_args

import typer
from rich.console import Console

from ..choices import choose_from, optimizer_refusal
from ..files import PAGE_HEALTH, is_profile_bytes, is_trace_bytes, without_bom
from ..units import (
    GIB,
    MAX_BYTES,
    MAX_MS,
    MIB,
    bytes_text,
    count_text,
    float_text,
    given_text,
    memory_gib_refusal,
    number_allowed,
)
from ..workload.sizes import DEFAULT_SIZES

if TYPE_CHECKING:
    from ..planning.scenario import Scenario
    from ..profiles.schema import Profile
    from ..schedules import Schedule
    from ..schedules.methods import Method, ScheduleParams
    from ..sim.cluster import Cluster

# Text wraps at the terminal's width, else at $COLUMNS, else at 120 (pipes and CI logs); tables: commands/tables.py.
stdout = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
stderr = Console(stderr=True, width=None if sys.stderr.isatty() or os.environ.get("COLUMNS") else 120)


def finite_from(low: float, high: float, least: float = 0.0) -> Callable[[float | None], float | None]:
    """A float flag's typer callback refusing nan, inf and what is outside low to high, in one line naming the
    flag and its range (typer's min= read nan as "should be >= 0" and took inf, which a cost far downstream then
    refused without naming the flag); a time flag's `least` (LEAST_MS) refuses what lies between 0 and it, as
    parse_numbers does for --fwd, --bwd and --comm."""
    def check(value: float | None) -> float | None:
        if value is not None and not low <= value <= high:
            raise typer.BadParameter(f"{finite_number_allowed(low, high)} (got {float_text(value)})")
        if value is not None and 0 < value < least:
            raise typer.BadParameter(f"{least_ms_allowed(least)} (got {float_text(value)})")
        return value
    return check


def output_path(value: str | Path) -> Path:
    """An output flag's typer parser: the path it names, where a trailing slash, which Path drops, names a folder
    (`--html newdir/` wrote a file named newdir). A default is a Path already."""
    if isinstance(value, str) and value.endswith(("/", os.sep)):
        raise typer.BadParameter(f"{value} names a folder; give a file path")
    return Path(value)


def finite_number_allowed(low: float, high: float) -> str:
    """What a finite number flag from `low` to `high` (inf: no upper bound) takes, in the parser's words."""
    return number_allowed(low, high if high < math.inf else None, whole=False, finite=True)


def least_ms_allowed(least: float) -> str:
    """What a time flag takes at its low end (`least`, LEAST_MS), and why: the simulator's clock ticks in
    picoseconds, so a shorter time would round to none."""
    return f"give 0 or at least {least:g} ms, a nanosecond, as the simulator counts picoseconds"


# The schedule's shape and the method options, as `simulate` and `run` declare them (each with its defaults).
Stages = Annotated[int, typer.Option(
    "--stages", "-p", metavar="P", min=1, help="Pipeline depth p: devices in one pipeline.")]
Chunks = Annotated[int | None, typer.Option(
    "--chunks", "-v", min=1, metavar="V", help="Model chunks per device v (interleaved / V schedules; p·v model "
                                               "stages). Default: the method's (2 for V schedules, else 1).")]
Microbatches = Annotated[int, typer.Option(
    "--microbatches", "-m", metavar="M", min=1, help="Micro-batches per mini-batch m.")]
Rounds = Annotated[int, typer.Option(
    "--rounds", metavar="R", min=1, help="A mini-batch's m micro-batches run as R flushes of m / R each, one update "
                                         "after the last: gradient accumulation as torch's pipelining runs it "
                                         "(torchtitan and NeMo AutoModel call schedule.step once per accumulation "
                                         "step); a synchronous method's, the replicas' gradients reduced once, after "
                                         "the last round. Default: 1.")]
Minibatches = Annotated[int, typer.Option(
    "--minibatches", "-n", metavar="N", min=1, help="Mini-batches (optimizer steps) N.")]
Pipelines = Annotated[int | None, typer.Option(
    "--pipelines", "-P", min=1, metavar="P", show_default=False, help="Parallel pipelines P sharing the devices "
                                                                      "(avgpipe; default 2).")]
Advance = Annotated[int | None, typer.Option(
    "--advance", min=0, metavar="A", help="avgpipe: forwards beyond 1F1B's warm-up before the first backward (0: "
                                          "1F1B, >= m: all forwards first). Default: AvgPipe's 2(p-k)-1 forwards "
                                          "first.")]
MicrobatchGroup = Annotated[int | None, typer.Option(
    "--microbatch-group", min=1, metavar="G", show_default=False,
    help="interleaved-1f1b: micro-batches each chunk takes in turn, from p to m, the remainder m mod G 0 or at least "
         "p (Megatron-core's microbatch_group_size_per_vp_stage; default p, so m a multiple of p).")]
AverageEvery = Annotated[int, typer.Option(
    "--average-every", metavar="N", min=1, help="avgpipe: elastic averaging period in mini-batches.")]
ElasticAlpha = Annotated[float | None, typer.Option(
    "--elastic-alpha", metavar="ALPHA", help="avgpipe: elastic averaging coefficient (default 0.9/P).")]

# Options `simulate` and `sweep` share word for word.
WgradFraction = Annotated[float, typer.Option(
    "--wgrad-fraction", help="Share of the backward that is the weight gradient (split-backward schedules).",
    metavar="F", callback=finite_from(0, 1))]
HeldOptimizer = Annotated[str, typer.Option(
    "--optimizer", metavar="NAME", help="Optimizer whose state is held: sgd, momentum, adam, adamw.")]
MicrobatchSize = Annotated[int, typer.Option(
    "--microbatch-size", "-b", metavar="B", min=1, help="Samples per micro-batch (for samples/s; with --gpu, what the "
                                                        "model is counted at).")]
BlockingComm = Annotated[bool, typer.Option(
    "--blocking-comm", help="Exchanges block: a device posts the sends and receives between two passes together and "
                            "waits for all of them; a send moves once its receiver has posted.")]
ShardedOptimizer = Annotated[bool, typer.Option(
    "--sharded-optimizer", help="The same as --zero 1.")]
Zero = Annotated[int | None, typer.Option(
    "--zero", metavar="STAGE", help="With --data-parallel: what the d replicas shard (ZeRO's stages): 1 the "
                                    "optimizer state, 2 the gradients too (each kept whole from a stage's first "
                                    "backward of a mini-batch until its last), 3 the weights too (FSDP: whole from "
                                    "the first forward until the last backward in a pipeline; one pass's at a time "
                                    "with one stage); the all-reduce becomes a reduce-scatter before the update and "
                                    "an all-gather after it. Default 0: none.")]
HeldPrecision = Annotated[str | None, typer.Option(
    "--precision", metavar="MODE", help="How weights, gradients and optimizer state are held: fp32 (all float32), "
                                        "megatron (Megatron-LM's mixed precision: 16-bit weights, float32 main "
                                        "gradients, master weights and moments), megatron-16bit-grads (its "
                                        "gradients kept in 16 bits), megatron-bf16-moments (its AdamW moments in "
                                        "bf16, as DeepSeek-V3 trained), nemo-bf16-adam (NeMo's distributed Adam with "
                                        "optim.dtype and grad_sync_dtype bf16: 16-bit gradients and moments, no "
                                        "master copy) or fsdp2 (torch FSDP2's as torchtitan sets "
                                        "it, with --zero 3: float32 sharded weights, 16-bit gathered copies, "
                                        "float32 gradients and moments, no master copy). Default: as "
                                        "Megatron-LM keeps the model's --dtype (bf16: megatron, fp16: "
                                        "megatron-16bit-grads); typed costs: "
                                        "fp32, their parameter MiB being the weights as the passes read them.")]
ReduceAfterFlush = Annotated[bool, typer.Option(
    "--reduce-after-flush", help="With --data-parallel: a device all-reduces its stages' gradients once its last "
                                 "backward of the mini-batch is done (Megatron-LM's DDP), instead of each stage's "
                                 "right after that stage's last backward, overlapping the rest (torch DDP).")]
OptimizerBuckets = Annotated[str, typer.Option(
    "--optimizer-buckets", metavar="WHOSE", help="With --gpu or --profile and --zero 1: how the distributed "
                                                 "optimizer groups its reduce-scatters and all-gathers: megatron "
                                                 "(Megatron-core's buckets of max(40M, 1M x d) parameters on the "
                                                 "first chunk; the default) or nemo (NeMo's distributed Adam: a "
                                                 "group a chunk, a layer without --chunks, one collective each).",
    show_default=False)]
PpRuntime = Annotated[str, typer.Option(
    "--pp-runtime", metavar="RUNTIME", help="Whose pipeline runtime holds the tensors passed between stages: "
                                            "pipesim (a received one from its arrival until its forward or "
                                            "backward ends, a sent one until sent; the default) or torch "
                                            "(torch.distributed.pipelining's stage: a receive buffer per "
                                            "micro-batch for every input and output gradient, kept, and every "
                                            "forward's output and input gradient kept until the update).",
    show_default=False)]
StageCut = Annotated[str, typer.Option(
    "--stage-cut", metavar="HOW", help="How --gpu's or --profile's layers are cut into the p·v model stages: "
                                       "balanced (the slowest stage as fast as can be, PipeDream's planner) or "
                                       "fit (balanced where every device holds its stages in its memory, else "
                                       "the fastest cut that does, by each stage's weights, gradients, optimizer "
                                       "state and the micro-batches the schedule holds there) or "
                                       "equal-blocks (as many of the model's blocks in each, the layers before "
                                       "them in the first, after them in the last: Megatron-LM's cut) or "
                                       "padded-blocks (as many padded to a multiple of the stages, one fewer in "
                                       "the last, first, ... stage per padded block: the zero-bubble paper's) or "
                                       "first-last:F,L (F blocks in the first stage, L in the last, the others an "
                                       "equal share: Megatron-core's decoder_first/last_pipeline_num_layers) or "
                                       "layout:STRING (Megatron-core's pipeline_model_parallel_layout, e.g. "
                                       "'Et|(tt|)*30mL': E the embedding, t a block, m the --mtp-layers layer, L "
                                       "the norm and head, | between the p·v stages, (..)*n and x*n repeats) or "
                                       "layers:N,N,... (each stage's count of the layers, in order: the cut tune "
                                       "prints).")]
NetworkGbS = Annotated[float | None, typer.Option(
    "--network-gb-s", metavar="GB/S", help="With --data-parallel and typed costs: each GPU's network bandwidth for "
                                           "the gradient all-reduce (--comm: the latency of each ring step). "
                                           "Default: unlimited.")]
# `simulate` and `run`: one source of the prediction distance s, checked by `check_prediction`.
PredictionSource = Annotated[str | None, typer.Option(
    "--prediction", metavar="SOURCE", help="Where predicting methods (spectrain, pipeoptim, xpipe) take the prediction "
                                           "distance s from: paper, code (the authors' code) or counted (from the "
                                           "order). Default: each method's primary source, as `pipesim schedules` "
                                           "lists.")]


def _default_sizes(size: str) -> str:
    """Each built-in model's default `size` (of those that take it): "mlp 8, cnn 6, gpt 4, two-branch 2"."""
    return ", ".join(f"{model} {sizes[size]}" for model, sizes in DEFAULT_SIZES.items() if size in sizes)


# The built-in models' size options, as `calibrate`, `count` and `run` declare them (None: the model's default).
Layers = Annotated[int | None, typer.Option(
    "--layers", metavar="N", help="Built-in models: layers (blocks; per branch for two-branch). Default: "
                                  f"{_default_sizes('layers')}.")]
Width = Annotated[int | None, typer.Option(
    "--width", metavar="N", help="Built-in models: hidden width (channels for cnn and two-branch). Default: "
                                 f"{_default_sizes('width')}.")]
Heads = Annotated[int | None, typer.Option(
    "--heads", metavar="N", help=f"gpt: attention heads (default {DEFAULT_SIZES['gpt']['heads']}).")]
SeqLen = Annotated[int | None, typer.Option(
    "--seq-len", metavar="N", help=f"gpt: sequence length (default {DEFAULT_SIZES['gpt']['seq_len']}); hf:PATH: the "
                                   "tokens a sample holds, which it needs (its config gives the other sizes).")]
Vocab = Annotated[int | None, typer.Option(
    "--vocab", metavar="N", help=f"gpt: vocabulary size (default {DEFAULT_SIZES['gpt']['vocab']}).")]
Ffn = Annotated[int | None, typer.Option("--ffn", metavar="N", help="gpt: MLP hidden size (default 4 x width).")]
KvHeads = Annotated[int | None, typer.Option(
    "--kv-heads", metavar="N", help="gpt: key/value heads (default --heads; fewer is grouped-query attention).")]
Gated = Annotated[bool | None, typer.Option("--gated/--no-gated", help="gpt: SwiGLU MLP (Llama's) instead of GELU.")]
LinearBias = Annotated[bool | None, typer.Option(
    "--linear-bias/--no-linear-bias", help="gpt: biases on its blocks' linear layers (GPT-3's, the "
                                           "default; the head has none, as Megatron-LM's); "
                                           "--no-linear-bias drops them (Llama's, Nemotron-4's: Megatron-LM's "
                                           "`--disable-bias-linear`).")]
Norm = Annotated[str | None, typer.Option(
    "--norm", metavar="KIND", help="gpt: its norms, layernorm (GPT-3's, the default) or rmsnorm (Llama's; "
                                   "Megatron-LM's `--normalization RMSNorm`), as torch runs them on a GPU (RMSNorm: "
                                   "one kernel each way, keeping its input and one float32 a token).")]
Dropout = Annotated[float | None, typer.Option(
    "--dropout", metavar="P", help="gpt: dropout on the attention probabilities and each residual branch "
                                   "(Megatron-LM's default is 0.1; none by default), counted as the one fused kernel a "
                                   "GPU runs.")]
RotaryPercent = Annotated[float | None, typer.Option(
    "--rotary-percent", metavar="SHARE", help="gpt: rotary position embedding (RoPE: Llama's 1.0, Nemotron-4's 0.5) "
                                              "on this share of each head's features instead of learned positions "
                                              "(Megatron-LM's --rotary-percent).")]
Experts = Annotated[int | None, typer.Option(
    "--experts", metavar="E", help="gpt: a mixture of experts, E routed experts in each block's MLP (counted at "
                                   "balanced routing: each expert computes k/E of the tokens).")]
TopK = Annotated[int | None, typer.Option(
    "--top-k", metavar="K", help="gpt with --experts: the routed experts each token goes to (default 2).")]
SharedExperts = Annotated[int | None, typer.Option(
    "--shared-experts", metavar="S", help="gpt with --experts: experts every token passes (DeepSeekMoE's; default 0).")]
ExpertFfn = Annotated[int | None, typer.Option(
    "--expert-ffn", metavar="N", help="gpt with --experts: each expert's MLP hidden size (default --ffn).")]
CapacityFactor = Annotated[float | None, typer.Option(
    "--capacity-factor", metavar="C", help="A mixture of experts (gpt with --experts, or an hf: MoE config): an "
                                           "expert drops the tokens past C·k·T/E of a micro-batch's T and is padded "
                                           "to that many, which it computes and the dispatch sends (GShard's, "
                                           "Switch's; Megatron-core's moe_expert_capacity_factor with "
                                           "moe_pad_expert_input_to_capacity); default: drops none.")]
MtpLayers = Annotated[int | None, typer.Option(
    "--mtp-layers", metavar="D", help="hf:PATH: DeepSeek-V3's multi-token prediction at depth D (its report's 2.2; "
                                      "Megatron-core's `--mtp-num-layers`): D more modules after the final norm, each "
                                      "a 2h -> h projection, one more decoder layer and a pass through the shared "
                                      "head, the embedding and head counted once; default none.")]
ModelName = Annotated[str | None, typer.Option(
    "--model", metavar="NAME", help="mlp, cnn, gpt, two-branch, package.module:attribute (as calibrate takes), or "
                                    "hf:PATH, a Hugging Face config.json or its folder (e.g. hf:examples/llama3.1-70b; "
                                    "with --seq-len).")]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype's names -> torch's
DTYPES.update({name: name for name in list(DTYPES.values())})  # calibrate's names too


FP8 = "fp8"  # --dtype's float8: counted in bfloat16, its linear products run in float8 (planning/fp8.py)
FP8_TAKERS = "estimate, simulate --gpu, sweep --gpu or tune --gpu"  # the what-if estimates, which alone take it


def check_dtype(dtype: str, *more: str) -> None:
    """Refuse a --dtype that is none of `DTYPES`' names (nor of `more`: the what-if estimate's fp8) in choose_from's
    one line, whose list holds the short names and torch's alike, since count, estimate, run and calibrate take both;
    fp8 where it is not taken, saying where it is (`count --help` says a what-if estimate takes it, and count's
    refusal listed the others alone)."""
    if dtype not in (*DTYPES, *more):
        where = f"; fp8 prices a what-if GPU: give it to {FP8_TAKERS}" if dtype == FP8 else ""
        raise InputError(choose_from("--dtype", (*DTYPES, *more), dtype) + where)


ModelDtype = Annotated[str, typer.Option(
    "--dtype", metavar="DTYPE", help="fp32, bf16 or fp16 (or float32, bfloat16, float16, as calibrate names them); a "
                                     f"what-if estimate ({FP8_TAKERS}) also takes fp8: bf16 with the transformer "
                                     "layers' linear products in float8 at the part's FP8 peak.")]
Fp8Recipe = Annotated[str | None, typer.Option(
    "--fp8-recipe", metavar="RECIPE", help="With --dtype fp8: te (TransformerEngine's delayed scaling as Megatron-LM "
                                           "runs it: float8 copies of the products' inputs saved, weights cast once "
                                           "a step; the default), te-current (TransformerEngine's current "
                                           "scaling, Megatron-core's tensorwise: te's, each cast after its "
                                           "tensor's amax) or torchao (torchao.float8's tensorwise dynamic "
                                           "scaling as torchtitan runs it since 2025: 16-bit inputs saved, each cast "
                                           "again in the backward), torchao-2024 (torchao as at eab345c, December "
                                           "2024: float8 inputs and weight copies saved, only the gradient cast in "
                                           "the backward) or deepseek (DeepSeek-V3's, its report's 3.3: "
                                           "te's, with the attention's output kept once in E5M6 and the experts' "
                                           "SwiGLU inputs in float8).")]
FsdpFloat8AllGather = Annotated[bool, typer.Option(
    "--fsdp-float8-all-gather", help="With --dtype fp8, torchao's recipe and FSDP2's mixed precision (ZeRO-3): "
                                     "torchtitan's enable_fsdp_float8_all_gather with its scales precomputed after "
                                     "the step (off by default, as in torchtitan): FSDP2 casts each float8 "
                                     "linear's weight shard to float8 and all-gathers that, 1 byte a weight, held "
                                     "whole so; no pass casts a weight.")]
Fp8ParamGather = Annotated[bool, typer.Option(
    "--fp8-param-gather", help="With --dtype fp8, a TransformerEngine recipe and --zero 1 or 2: the weights kept as "
                               "TransformerEngine's float8 tensors (NeMo's fp8_params, Megatron-core's "
                               "--fp8-param-gather), so the distributed optimizer all-gathers the float8 linears' "
                               "weights at 1 byte each (off by default).")]
Attention = Annotated[str, typer.Option(
    "--attention", metavar="KIND", help="math (the s x s scores materialised, as Megatron-LM 2021 ran) or flash "
                                        "(torch's fused kernel: no scores saved). Default: the model's own "
                                        "runtime's, flash for an hf: model (transformers' sdpa) or your own "
                                        "module, math for the built-in models (gpt: Megatron-LM 2021's).")]
AttentionKernel = Annotated[str | None, typer.Option(
    "--attention-kernel", metavar="KERNEL", help="With --attention flash: which fused kernel runs it, at its "
                                                 "published rate on the part (`pipesim gpus`' curves): flash2 "
                                                 "(FlashAttention-2; the default), cudnn (cuDNN's, TransformerEngine "
                                                 "with NVTE_FUSED_ATTN=1) or flash3 (FlashAttention-3).")]
MODEL_SHAPE = (("layers", Layers, None), ("width", Width, None), ("heads", Heads, None), ("seq_len", SeqLen, None),
               ("vocab", Vocab, None), ("ffn", Ffn, None), ("kv_heads", KvHeads, None), ("gated", Gated, None),
               ("linear_bias", LinearBias, None), ("norm", Norm, None), ("dropout", Dropout, None),
               ("rotary_percent", RotaryPercent, None), ("experts", Experts, None), ("top_k", TopK, None),
               ("shared_experts", SharedExperts, None), ("expert_ffn", ExpertFfn, None),
               ("capacity_factor", CapacityFactor, None), ("mtp_layers", MtpLayers, None),
               ("dtype", ModelDtype, "bf16"), ("attention", Attention, None))
MODEL_SIZES = tuple(name for name, _, _ in MODEL_SHAPE[:-2])  # what the model is built with (dtype and attention
                                                                # are how it is counted)


def shared_options(*options: tuple[str, Any, Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command flags declared here once, as (name, annotated type, default): they join its signature for
    typer, and the command reads them from `ctx.params` rather than as arguments of its own."""
    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)  # typer reads a given __signature__ as it stands
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
                  for name, annotation, default in options]

        @functools.wraps(command)
        def with_options(*args, **kwargs) -> None:
            for name, _, _ in options:
                kwargs.pop(name, None)
            command(*args, **kwargs)

        with_options.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *shared])
        with_options.__annotations__ = {p.name: p.annotation for p in with_options.__signature__.parameters.values()}
        return with_options
    return decorate


def with_help(option: Any, words: str) -> Any:
    """Shared option `option` (an Annotated typer option) with `words` after its help: what holds for some of the
    commands that declare it (tune searches what the others default) said in theirs only."""
    kind, info = get_args(option)
    told = copy.copy(info)
    told.help = f"{info.help} {words}"
    return Annotated[kind, told]


# Every command's --seed: numpy's and torch's generators both take it, and run's data seeds (seed x 1,000,003 + index,
# executor/stages.py) stay within torch's 64 bits.
Seed = Annotated[int, typer.Option("--seed", metavar="N", min=0, max=2**32 - 1, help="Seed")]


CurveFrom = Annotated[Path | None, typer.Option(
    "--curve-from", metavar="PROFILE", help="With --gpu: a calibration made on that GPU (`pipesim calibrate --device "
                                            "cuda`): the efficiency curve calibrate stored in it (else fitted to its "
                                            "measured layers) replaces the catalogue's, so one measured GPU "
                                            "predicts other models.")]

# The what-if GPU (`simulate`, `sweep`, `tune`, `estimate`): the model above, counted by torch on the meta device,
# priced on a catalogue part and parallelised as these say (commands/estimate.py reads them).
GpuName = Annotated[str | None, typer.Option(
    "--gpu", metavar="NAME", help="A GPU of the catalogue (`pipesim gpus`): count --model on torch's meta device and "
                                  "estimate its profile on NAME's figures.")]
GpusFile = Annotated[Path | None, typer.Option(
    "--gpus", metavar="FILE", help="TOML file of further GPUs ([gpu.NAME], replacing a built-in one of the same "
                                   "name) and clusters ([cluster.NAME]), in the schema of the built-in catalogue.")]
TensorParallel = Annotated[int | None, typer.Option(
    "--tensor-parallel", metavar="T", min=1, help="With --gpu: tensor-parallel degree t, Megatron's split of every "
                                                  "block over t GPUs of a node; a t above a node's GPUs fills whole "
                                                  "nodes and crosses them on their NICs (simulated only).")]
MAX_DEVICES = 1_000_000  # a tenfold margin over the largest GPU clusters built (about 100,000): a plan's own bound
DataParallel = Annotated[int | None, typer.Option(
    "--data-parallel", metavar="D", min=1, max=MAX_DEVICES,
    help="Data-parallel degree d: replicas of the pipeline, each stage's gradients all-reduced over them before its "
         "update.")]
ContextParallel = Annotated[int, typer.Option(
    "--context-parallel", metavar="C", min=1, help="With --gpu: context-parallel degree C, the sequence split over C "
                                                   "GPUs (2C chunks, causal load balance) whose attention passes keys "
                                                   "and values round a ring (torch's and Megatron's context "
                                                   "parallel); gradients reduced over C x d.")]
CpRotate = Annotated[str | None, typer.Option(
    "--cp-rotate", metavar="HOW", help="With --context-parallel: how the ring passes keys and values: alltoall "
                                       "(torch's point-to-point ring, C - 1 transfers each under a block, the "
                                       "backward's key/value gradients in float32, the last after the last block; "
                                       "the default), p2p (TransformerEngine's, Megatron's and NeMo's cp_comm_type "
                                       "p2p: the same ring, its gradients in the keys' dtype, the last under the "
                                       "last block) or allgather (torch's and torchtitan's default: one all-gather "
                                       "of every rank's keys and values under the first block, held whole).")]
ExpertParallel = Annotated[int, typer.Option(
    "--expert-parallel", metavar="E", min=1, help="With --gpu and a mixture of experts: its routed experts placed over "
                                                  "E of the d data-parallel replicas (E divides d and the experts), "
                                                  "each holding 1/E of their weights and optimizer state; the tokens' "
                                                  "dispatch and combine are all-to-alls over them.")]
HotExpertShare = Annotated[float | None, typer.Option(
    "--hot-expert-share", metavar="S", help="With --expert-parallel: the busiest expert's share of a micro-batch's "
                                            "routed tokens (balanced: 1/experts); its rank computes and receives "
                                            "that much more, and the others wait for it (its time: the memory is "
                                            "priced at balanced routing). Default: balanced.")]
Routing = Annotated[str | None, typer.Option(
    "--routing", metavar="HOW", help="With --expert-parallel: how the router spreads a micro-batch's token copies, "
                                     "balanced (each expert its even share; the default) or random (each token's "
                                     "experts drawn alike, as Megatron-core's moe_router_force_load_balancing "
                                     "draws them: even on average, the busiest expert-parallel rank, which every "
                                     "rank waits for, holding more; its time: the memory is priced at balanced "
                                     "routing).")]
TokenDispatcher = Annotated[str | None, typer.Option(
    "--token-dispatcher", metavar="HOW", help="With --expert-parallel: how tokens reach their experts, alltoall "
                                              "(NCCL's all-to-all: every routed copy sent; the default), deepep or "
                                              "hybridep (DeepEP's or HybridEP's: a token sent once to each rank, and "
                                              "across nodes once to each node, holding any of its experts, forwarded "
                                              "there over the node's link; under TransformerEngine's float8 the "
                                              "experts pad their tokens after DeepEP's, HybridEP pads in its "
                                              "dispatch; DeepEP's received indices made each local expert's map by "
                                              "Megatron-core's unfused conversion, 12 kernels a forward).")]
DispatcherSms = Annotated[int | None, typer.Option(
    "--dispatcher-sms", metavar="N", min=1, help="With --token-dispatcher deepep or hybridep: the multiprocessors "
                                                 "its dispatch and combine kernels hold, which the compute "
                                                 "overlapped with them (an overlapped pair's other part) goes "
                                                 "without. Default: Megatron-core's, 20 for DeepEP "
                                                 "(moe_deepep_num_sms), 16 for HybridEP (moe_hybridep_num_sms).")]
ExpertGemm = Annotated[str | None, typer.Option(
    "--expert-gemm", metavar="HOW", help="With a mixture of experts: how a rank runs its local routed experts' "
                                         "products, grouped (one kernel over them all; the default) or per-expert "
                                         "(one GEMM per local expert, each expert's float8 casts on their own under "
                                         "te-current, as TransformerEngine's GroupedLinear runs them in "
                                         "Megatron-core's TEGroupedMLP).")]
P2pSync = Annotated[bool, typer.Option(
    "--p2p-sync", help="With --gpu: the pipeline runtime synchronises the device after each exchange between "
                       "stages (Megatron-core's batched point-to-point: batch_p2p_comm and batch_p2p_sync, which "
                       "Megatron-LM, NeMo and Megatron-Bridge set without virtual stages), so each pass a stage "
                       "receives the input of starts with its host not ahead of the GPU; for the 1f1b schedule only "
                       "(docs/hardware.md, \"Host-bound execution\").")]
CudaGraphs = Annotated[str | None, typer.Option(
    "--cuda-graphs", metavar="SCOPES", help="With --gpu: layers whose forward and backward each replay a CUDA graph: "
                                            "mamba (each Mamba-2 layer whole, its norm and residual add included, "
                                            "Megatron-core's cuda_graph_modules under TransformerEngine's "
                                            "make_graphed_callables); full, alone (each transformer layer whole, "
                                            "Megatron-core's enable_cuda_graph: no recomputation, no dropless "
                                            "dispatcher). The host issues a replay at one kernel's cost "
                                            "(--host-kernel-us) instead of each kernel and module call; the GPU's "
                                            "time and the memory are as without graphs. Not under --precision "
                                            "fsdp2. Default: none.")]
HostKernelUs = Annotated[float | None, typer.Option(
    "--host-kernel-us", metavar="US", help="With --gpu: the host's microseconds to issue one kernel (eager "
                                           "PyTorch's Python, dispatcher, autograd and CUDA launch): every pass "
                                           "takes at least its kernels' issue (a small layer split over many "
                                           "ranks is host-bound), and a MoE layer's forward waits for them "
                                           "after its dropless dispatcher synchronises with the host; 0: never. "
                                           "Default: 31.9, measured on an H200's host (docs/hardware.md, "
                                           "\"Host-bound execution\").")]
HostModuleUs = Annotated[float | None, typer.Option(
    "--host-module-us", metavar="US", help="With --gpu: the host's microseconds a TransformerEngine module "
                                           "call (a linear, grouped linear or attention module) spends beyond "
                                           "issuing its kernels, forward and backward, twice for a module in "
                                           "float8, which a synchronising MoE layer waits for like its "
                                           "kernels; 0: none. Default: 83.1 under --fp8-recipe te or "
                                           "te-current, 0 otherwise (docs/hardware.md, \"Host-bound "
                                           "execution\").")]
ExpertTensorParallel = Annotated[int | None, typer.Option(
    "--expert-tensor-parallel", metavar="ETP", min=1, help="With --expert-parallel and --rank-order megatron: the "
                                                           "ranks each routed expert is split over (Megatron-core's "
                                                           "expert_tensor_parallel_size; default t), the E·ETP ranks "
                                                           "folded over the t·C·d of a stage (E·ETP divides t·C·d); "
                                                           "each holds 1/(E·ETP) of the experts' weights.")]
RankOrder = Annotated[str | None, typer.Option(
    "--rank-order", metavar="ORDER", help="With --gpu: how the ranks are numbered onto nodes, which sets every "
                                          "group's links: pipesim (t, C, p, then d, the experts' E of the d "
                                          "replicas; the default) or megatron (Megatron-core's tp-cp-ep-dp-pp: t, "
                                          "C, d, then p, the experts folded over t·C·d); tune searches both where "
                                          "it is not given.")]
SequenceParallel = Annotated[bool, typer.Option(
    "--sequence-parallel", help="With --gpu and t > 1: Megatron's sequence parallelism (norms and dropouts split over "
                                "the t GPUs; reduce-scatter and all-gather instead of all-reduces).")]
TpOverlap = Annotated[bool, typer.Option(
    "--tp-overlap", help="With --sequence-parallel: its all-gathers and reduce-scatters overlapped with the "
                         "products as --tp-runtime runs them: megatron's forward as TransformerEngine's userbuffers "
                         "(4 splits on the SMs its kernels leave, the last reduce-scatter exposed; the backward's "
                         "reduce-scatter under the weight gradient), torch's async TP in t chunks and a sum of the "
                         "partials; only what outlasts a chunk's product is exposed. Within a node.")]
TpOverlapNoMargin = Annotated[bool, typer.Option(
    "--tp-overlap-no-margin", help="With --tp-overlap under --tp-runtime megatron: the forward's pipelined "
                                   "reduce-scatters without TransformerEngine's set_sm_margin (its 1.x default, "
                                   "which a run without a userbuffers config gets; NeMo's configs set it): each "
                                   "split's product on every SM, which on Hopper waits out the reduce-scatter "
                                   "beside it.")]
TpOverlapFp8Buf = Annotated[bool, typer.Option(
    "--tp-overlap-fp8-buf", help="With --tp-overlap under --tp-runtime megatron and --dtype fp8 (a TransformerEngine "
                                 "recipe): the forward's pipelined reduce-scatters with fp8_buf, as a userbuffers "
                                 "config may set for proj_fprop and fc2_fprop: each row-parallel product writes "
                                 "float8 and its reduce-scatter moves 1 byte an element.")]
TpRuntime = Annotated[str | None, typer.Option(
    "--tp-runtime", metavar="RUNTIME", help="With --sequence-parallel: whose tensor-parallel layers run: megatron "
                                            "(Megatron-core and TransformerEngine, NeMo's; the default: each "
                                            "column-parallel product keeps its 1/t of the input and gathers it again "
                                            "for its weight gradient; MLA's down-projections column-parallel) or "
                                            "torch (DTensor's, torchtitan's: keeps the gathered input; MLA's "
                                            "down-projections whole on every GPU).")]
LossParallel = Annotated[bool, typer.Option(
    "--loss-parallel", help="With --gpu: the loss computed as torch's loss_parallel computes it (torchtitan's with "
                            "t > 1): logits split by vocabulary over the t GPUs, its fused backward holding one "
                            "more float32 tokens x vocabulary/t tensor than aten's cross entropy.")]
CrossEntropy = Annotated[str, typer.Option(
    "--cross-entropy", metavar="RUNTIME", help="With --gpu: whose cross entropy the loss runs: torch (aten's "
                                               "log-softmax and NLL loss, whose backward holds two float32 tokens x "
                                               "vocabulary tensors; the default) or megatron (Megatron-core's "
                                               "vocabulary-parallel one, fused or not: its backward writes the "
                                               "gradient into the saved float32 softmax in place).",
    show_default=False)]
LinearKernel = Annotated[str | None, typer.Option(
    "--linear-kernel", metavar="KERNEL", help="With --gpu: whose linear layers run: eager (torch's nn.Linear: "
                                              "autograd sums each bias's gradient in a kernel of its own) or te "
                                              "(Megatron-core's TransformerEngine layers: the attention's input "
                                              "projection takes its bias's gradient from its weight-gradient "
                                              "product, under --fp8-recipe te from its output gradient's cast, "
                                              "under te-current summed apart; the others' biases, which "
                                              "Megatron-core adds in the next fused kernel, summed apart). "
                                              "Default: te under --fp8-recipe te or "
                                              "te-current, eager otherwise.",
    show_default=False)]
NormKernel = Annotated[str, typer.Option(
    "--norm-kernel", metavar="KERNEL", help="With --gpu: how a Hugging Face model's RMSNorms run: eager "
                                            "(transformers' module, keeping a float32 copy of its input and the "
                                            "normalised 16-bit tensor, each op its own kernel; the default) or "
                                            "fused (TransformerEngine's kernel, Megatron-core's: one kernel each "
                                            "way, keeping its 16-bit input and one float32 a token).",
    show_default=False)]
RopeKernel = Annotated[str, typer.Option(
    "--rope-kernel", metavar="KERNEL", help="With --gpu: how a Hugging Face model's rotary position embedding runs: "
                                            "eager (transformers' slices, negation, concatenation, products and "
                                            "sum, each its own kernel; the default) or fused (TransformerEngine's "
                                            "kernel, Megatron-core's apply_rope_fusion: one kernel for q and one "
                                            "for k each way). Both keep only the angles.",
    show_default=False)]
RepeatKv = Annotated[bool, typer.Option(
    "--repeat-kv", help="With --gpu: grouped-query attention's keys and values copied to every query head before "
                        "the attention kernel, as torchtitan's Llama does (its `repeat_kv`), so the kernel saves and "
                        "a context-parallel ring passes them repeated; by default the kernel takes the fewer "
                        "key/value heads (enable_gqa). Needs --attention flash: under math, torch's attention "
                        "copies them itself.",
    show_default=False)]
RouterAuxLoss = Annotated[str | None, typer.Option(
    "--router-aux-loss", metavar="HOW", help="With --gpu: a mixture of experts' load-balancing loss in every MoE "
                                             "layer, as Megatron-core computes it under "
                                             "moe_router_load_balancing_type aux_loss and a nonzero "
                                             "moe_aux_loss_coeff: none (transformers' count without "
                                             "output_router_logits; the default), unfused (its torch ops, as "
                                             "Megatron-LM 1e057005 runs them) or fused (TransformerEngine's "
                                             "kernels, under moe_router_fusion).",
    show_default=False)]
ALLOCATORS = ("caching", "expandable", "none")  # --allocator
Allocator = Annotated[str, typer.Option(
    "--allocator", metavar="MODEL", help="With --gpu: what a device's memory counts, caching (its tensors and the "
                                         "segments torch's CUDA caching allocator keeps cached beside them, its "
                                         "step replayed by the allocator's rules: max reserved, as torchtitan "
                                         "logs it; the default), expandable (the same with expandable_segments:True "
                                         "in PYTORCH_CUDA_ALLOC_CONF, as torchtitan's one-host launcher sets it: "
                                         "one segment a stream, grown in 2 MiB pages for small "
                                         "requests and 20 MiB for large) or none (its tensors alone: max "
                                         "allocated).",
    show_default=False)]
OPTIMIZER_STEPS = ("held", "megatron")  # --optimizer-step
OptimizerStep = Annotated[str, typer.Option(
    "--optimizer-step", metavar="MODE", help="With --gpu and --allocator caching or expandable: how the optimizer's "
                                             "step allocates as the allocator replays it, held (its state one block "
                                             "held from the step's start; the default) or megatron (Megatron-LM's "
                                             "16-bit optimizer over Apex's FusedAdam, unsharded: each step makes "
                                             "the float32 main gradients, the next step's zero_grad frees them, and "
                                             "the first step makes Adam's moments).",
    show_default=False)]
SwigluFusion = Annotated[bool, typer.Option(
    "--swiglu-fusion/--no-swiglu-fusion",
    help="With --gpu: a gated MLP's SwiGLU (a routed expert's, with the router's weights; the dense and "
         "shared-expert MLPs of a Hugging Face model and of the gpt --gated) as one fused kernel keeping only its "
         "input (and the weights) for the backward (Megatron-core's, under bias_activation_fusion: Megatron-LM's "
         "default); --no-swiglu-fusion: as the ops that compute it, each keeping what it saves.")]
Recompute = Annotated[str | None, typer.Option(
    "--recompute", metavar="WHAT", help="With --gpu: activation recomputation, none, selective (the attention core), "
                                        "full (each layer's forward again in its backward) or op (torchtitan's "
                                        "selective op policy: keeps every other matrix product's output and the "
                                        "attention's, reruns the rest; t = 1).")]
TorchCompile = Annotated[bool, typer.Option(
    "--torch-compile", help="With --gpu and --recompute op or full: each transformer layer compiled by "
                            "torch.compile inside its checkpoint, as torchtitan compiles its blocks: AOTAutograd's "
                            "min-cut partitioner saves only what the backward reads, so op no longer keeps a product "
                            "output only the residual add reads (a Llama block's last); full keeps its input, as "
                            "eager.")]
RecomputeModules = Annotated[str | None, typer.Option(
    "--recompute-modules", metavar="PARTS", help="With --gpu and --recompute none or selective: parts of every layer "
                                                 "whose saved tensors are dropped after the forward and made again "
                                                 "in the backward from what they read (Megatron-core's "
                                                 "--recompute-modules): a comma list of layernorm (each layer's "
                                                 "input and pre-MLP norms, under --linear-kernel te only those it "
                                                 "keeps apart: a mixture of experts', MLA's), "
                                                 "mla_up_proj (MLA's up-projections and RoPE), moe_act (the experts' "
                                                 "activation), mlp (a dense layer's MLP), moe (a mixture of "
                                                 "experts whole, its dispatch and combine run again, which "
                                                 "Megatron-core refuses beside its expert-parallel overlap), "
                                                 "shared_experts (a mixture of experts' shared expert) and "
                                                 "gdn_norm_out (a Gated DeltaNet's gated norm and its output); "
                                                 "DeepSeek-V3's report (3.2.3) recomputes the first two.")]
Ema = Annotated[str | None, typer.Option(
    "--ema", metavar="WHERE", help="With --gpu: an exponential moving average of the weights kept on the gpu (a "
                                   "float32 copy sharded as the master weights, updated after each step) or the "
                                   "cpu (DeepSeek-V3's, its report's 3.2.3: on the host, updated asynchronously, "
                                   "nothing on the GPUs). Default: none.")]
ScoresBuffer = Annotated[bool, typer.Option(
    "--scores-buffer", help="With --gpu and --attention math: the attention as Megatron-LM's CoreAttention runs it "
                            "since 2022, beside a tensor of its scores' size (batch x heads/t x s x s) that its "
                            "global memory buffer keeps for the whole run: the runtime_buffers part, one a process. "
                            "Default: none (Megatron-LM 2021, torch).")]

GradAccumulation = Annotated[str | None, typer.Option(
    "--grad-accumulation", metavar="HOW", help="With --gpu: how each backward after a stage's first adds its weight "
                                              "gradients into the accumulated ones: fused (inside the "
                                              "weight-gradient product, TransformerEngine's and Megatron-LM's "
                                              "gradient_accumulation_fusion: no pass of its own) or separate "
                                              "(torch's autograd: a pass over the held gradients). Default: "
                                              "fused where the precision is Megatron's or NeMo's (megatron, "
                                              "megatron-16bit-grads, megatron-bf16-moments, nemo-bf16-adam), "
                                              "separate otherwise.")]

OverlapExpertComm = Annotated[bool, typer.Option(
    "--overlap-expert-comm", help="With --expert-parallel: Megatron-core's expert-parallel overlap "
                                  "(overlap_moe_expert_parallel_comm; the recipes' moe_a2a_overlap): one more warm-up "
                                  "forward, then each steady-state forward runs with the backward after it as one "
                                  "F&B pair, each one's all-to-alls under the other's compute. 1f1b with one stage, "
                                  "interleaved-1f1b with 2 chunks or more.")]
# The commands that build schedules from a Scenario (simulate, sweep): `scenario_from_flags` reads it.
expert_overlap_options = shared_options(("overlap_expert_comm", OverlapExpertComm, False))

model_shape_options = shared_options(*MODEL_SHAPE)  # count: the model's shape
# estimate: the shape and what only the estimate reads (the commands read them from ctx.params, in `what_if`)
WHAT_IF_ONLY = (*MODEL_SHAPE, ("fp8_recipe", Fp8Recipe, None), ("fsdp_float8_all_gather", FsdpFloat8AllGather, False),
                ("fp8_param_gather", Fp8ParamGather, False), ("curve_from", CurveFrom, None),
                ("gpus", GpusFile, None),
                ("sequence_parallel", SequenceParallel, False), ("tp_overlap", TpOverlap, False),
                ("tp_overlap_no_margin", TpOverlapNoMargin, False), ("tp_overlap_fp8_buf", TpOverlapFp8Buf, False),
                ("attention_kernel", AttentionKernel, None),
                ("tp_runtime", TpRuntime, None), ("loss_parallel", LossParallel, False),
                ("swiglu_fusion", SwigluFusion, True), ("cross_entropy", CrossEntropy, "torch"),
                ("norm_kernel", NormKernel, "eager"), ("rope_kernel", RopeKernel, "eager"),
                ("repeat_kv", RepeatKv, False), ("router_aux_loss", RouterAuxLoss, None),
                ("linear_kernel", LinearKernel, None),
                ("context_parallel", ContextParallel, 1), ("cp_rotate", CpRotate, None),
                ("expert_parallel", ExpertParallel, 1), ("hot_expert_share", HotExpertShare, None),
                ("routing", Routing, None), ("token_dispatcher", TokenDispatcher, None),
                ("dispatcher_sms", DispatcherSms, None), ("host_kernel_us", HostKernelUs, None),
                ("host_module_us", HostModuleUs, None), ("p2p_sync", P2pSync, False),
                ("cuda_graphs", CudaGraphs, None),
                ("expert_gemm", ExpertGemm, None),
                ("expert_tensor_parallel", ExpertTensorParallel, None),
                ("rank_order", RankOrder, None), ("recompute_modules", RecomputeModules, None),
                ("torch_compile", TorchCompile, False), ("ema", Ema, None), ("scores_buffer", ScoresBuffer, False),
                ("grad_accumulation", GradAccumulation, None))
what_if_options = shared_options(*WHAT_IF_ONLY)
# simulate, sweep: the same, with --gpu and --model optional (estimate requires both)
OPTIONAL_MODEL = (("gpu", with_help(GpuName, "Instead of --profile or the cost flags."), None),
                  ("model", ModelName, None))
optional_what_if_options = shared_options(*WHAT_IF_ONLY, *OPTIONAL_MODEL)
# tune: the same but FSDP2's float8 all-gather, which needs --zero 3 --precision fsdp2, and the float8 weights'
# gather, which needs --zero 1 or 2, flags tune does not take, and --torch-compile, which needs the recomputation
# tune searches
TuneSequenceParallel = Annotated[bool | None, typer.Option(
    "--sequence-parallel/--no-sequence-parallel", help="With --gpu: Megatron's sequence parallelism at t > 1 (norms "
                                                       "and dropouts split over the t GPUs), on or off; searched where "
                                                       "not given.")]
# tune: the what-if flags it takes, sequence parallelism searched where not given
tune_what_if_options = shared_options(*(("sequence_parallel", TuneSequenceParallel, None)
                                        if option[0] == "sequence_parallel" else option for option in WHAT_IF_ONLY
                                        if option[0] not in ("fsdp_float8_all_gather", "fp8_param_gather",
                                                             "torch_compile")),
                                      *OPTIONAL_MODEL)


# The searched method's knobs (auto), as numbers by `search_options`: text, so that a bad value gets our one line.
ActivationLimit = Annotated[str | None, typer.Option(
    "--activation-limit", metavar="R", help="auto: the peak activation memory any device may hold, as a multiple of "
                                            "1F1B's peak for the same costs, on its fullest device (default 1, "
                                            "which always admits 1F1B's own order; 2: twice). Where device memory "
                                            "is known, also what fits in it.")]
DeviceMemoryGb = Annotated[float | None, typer.Option(
    "--memory-gb", metavar="GIB", help="Each device's memory in GiB, in place of the part's, the cluster file's or the "
                                       "profile's: a device whose peak passes it is out of memory, and auto searches "
                                       "its order within it (tune's cap).")]
SearchSeconds = Annotated[str | None, typer.Option(
    "--search-seconds", metavar="S", help="auto: the search's budget in seconds (default 0.3; at most 86,400, a "
                                          "day), counted in ops at a fixed rate, so the same inputs give the same "
                                          "schedule anywhere.")]

# What-if costs for the commands that search auto but simulate nothing (export, run); with no defaults, so that auto
# is never searched for costs nobody gave (`searched_scenario`).
SearchFwd = Annotated[str | None, typer.Option(
    "--fwd", metavar="MS[,MS...]", help="auto: forward ms per micro-batch, one number or one per device; with --bwd, "
                                        "the costs auto's order is searched for (or --profile's).")]
SearchBwd = Annotated[str | None, typer.Option(
    "--bwd", metavar="MS[,MS...]", help="auto: full backward ms per micro-batch, as --fwd.")]
SearchComm = Annotated[str | None, typer.Option(
    "--comm", metavar="MS", help="auto: ms per activation or gradient transfer between devices (default 0).")]
SearchActivationMb = Annotated[str | None, typer.Option(
    "--activation-mb", metavar="MIB[,MIB...]", help="auto: activation MiB a micro-batch saves, as --fwd (default: "
                                                    "none, so --activation-limit counts micro-batches).")]
SearchWgradFraction = Annotated[float, typer.Option(
    "--wgrad-fraction", metavar="F", callback=finite_from(0, 1),
    help="auto: share of the backward (--bwd) that is the weight gradient, which its order may run apart.")]
SEARCH_COSTS = ("fwd", "bwd", "wgrad_fraction", "comm", "activation_mb")  # by parameter name
# What `scenario_from_flags` reads that these commands do not declare (or the user left unset).
SEARCH_DEFAULTS = {"comm": "0", "activation_mb": "0", "param_mb": "0", "output_mb": "0", "opt": 0.0, "pred": None,
                   "avg": None, "optimizer": "adam", "microbatch_size": 1, "blocking_comm": False, "cluster": None,
                   "profile": None}

# Options only some methods read, by flag (a command's parameter of the flag's name): the option each stands for,
# which `Method.reads` says who reads (tune's --max-chunks bounds the chunks it searches).
METHOD_OPTIONS = {"--chunks": "chunks", "--pipelines": "pipelines", "--advance": "advance",
                  "--microbatch-group": "microbatch_group",
                  "--average-every": "average_every", "--elastic-alpha": "elastic_alpha", "--graph": "graph",
                  "--prediction": "prediction", "--activation-limit": "activation_limit",
                  "--search-seconds": "search_seconds", "--max-chunks": "chunks", "--max-pipelines": "pipelines"}


class InputError(Exception):
    """Bad input found by the CLI itself; reported as one line with exit code 2. `every_rank`: a refusal a torchrun
    rank may meet alone (what it measured of its host), which each rank that meets it says (`fail`)."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def refuse(refusal: str | None, every_rank: bool = False) -> None:
    """A rule's refusal (its one line, or None where it allows the value: the `*_refusal` functions) as an
    `InputError` (`every_rank`: as its)."""
    if refusal is not None:
        raise InputError(refusal, every_rank)


def host_memory_refusal(command: str, model: str, options: dict, microbatch_size: int | None = None,
                        dtype: str = "float32") -> str | None:
    """The line refusing a model whose weights, built in float32 on the host (calibrate builds them there before
    moving them to the device and dtype, calibrate/measure.py `place`; run before its ranks start, and each rank its
    own), outgrow the memory this host has available, counted on the meta device first; where the kernel
    overcommits, building it ran until its OOM killer ended the process (hf:examples/llama3.1-8b, 32 GB of weights,
    on a 23 GB host). With `microbatch_size` (a forward run on the host in `dtype`), the micro-batch too
    (`_forward_bytes_per_sample`): `run --model mlp -b 100000000` allocated 25.6 GB before torch refused it. None
    where they fit, the platform does not say what is available, or the model is the user's own code, which may
    build anywhere. `command`: the pipesim command the line tells to take a smaller config."""
    from ..profiles.workload import is_hf
    from ..traces.hostload import available_memory_bytes

    available = available_memory_bytes()
    if available is None or (":" in model and not is_hf(model)):
        return None
    import torch

    from ..workload.models import build_model

    with torch.device("meta"):
        built = build_model(model, **options)
    weights = sum({id(w): w.numel() for layer in built.layers for w in layer.parameters()}.values())
    if weights * 4 > available:
        smaller = (f"{command} a smaller config of it (fewer layers, a narrower width)" if is_hf(model) else
                   "make it smaller (--layers, --width)")
        return (f"{model} does not fit in memory: its {count_text(weights, 'weight')} take {bytes_text(weights * 4)} "
                f"in float32 as it is built on this host, which has {bytes_text(available)} available; {smaller}, or "
                "price it without building it: `pipesim estimate --gpu NAME`")
    if microbatch_size is None:
        return None
    bytes_per_sample = _forward_bytes_per_sample(model, built, getattr(torch, dtype))
    if weights * 4 + microbatch_size * bytes_per_sample <= available:
        return None
    most = (available - weights * 4) // bytes_per_sample
    smaller = (f"give a smaller --microbatch-size (past {most:,} this alone outgrows it)" if most else
               "make the model smaller (--layers, --width)")
    return (f"{model} does not fit in memory at micro-batch size {microbatch_size:,} (--microbatch-size): the "
            f"micro-batch and its layers' outputs take {bytes_text(microbatch_size * bytes_per_sample)} in {dtype} as "
            f"{command} runs its forward on this host, beside {bytes_text(weights * 4)} of weights, and the host has "
            f"{bytes_text(available)} available; {smaller}")


def _forward_bytes_per_sample(model: str, built, dtype) -> int:
    """The bytes a sample of the input and of every layer's output take, `built` (model `model`, on the meta device)
    run forward on it there in `dtype` (integer inputs, tokens, in their own; `Model.outputs`, the walk run's first
    forward takes too): what that forward, which finds the outputs' shapes (executor/stages.py `layer_outputs`), and
    calibrate's, which measures them (calibrate/measure.py `measure_bytes`), hold at once b times over for a
    micro-batch of b, at the least. What the model's own code raises there is one line (`runs_on_meta`)."""
    import torch

    from ..workload.count import runs_on_meta

    sample, _ = built.make_batch(1, torch.Generator().manual_seed(0))
    for layer in built.layers:
        layer.to(dtype)
    with torch.no_grad(), runs_on_meta(model, "its forward"):
        outputs = built.outputs(torch.empty_like(sample, device="meta",
                                                 dtype=dtype if sample.is_floating_point() else sample.dtype))
    return sum(output.nbytes for output in outputs.values())


# The estimate's settings whose flags are not their names spelled as flags (`flag_of` spells the rest).
ESTIMATE_FLAGS = {"tensor": "--tensor-parallel", "pipeline": "--stages", "data": "--data-parallel",
                  "context": "--context-parallel", "expert": "--expert-parallel",
                  "expert_tensor": "--expert-tensor-parallel", "fp8": "--fp8-recipe"}


def flag_of(name: str) -> str:
    """The flag that sets parameter `name` (typer's spelling of it)."""
    return f"--{name.replace('_', '-')}"


def option_of(ctx: typer.Context, name: str) -> Any:
    """The command's click parameter `name` (None where it has none)."""
    return next((param for param in ctx.command.params if param.name == name), None)


def given_flag(ctx: typer.Context, name: str) -> str:
    """The flag the user gave for parameter `name`: a switch's off side (--no-...) where they turned it off."""
    off = getattr(option_of(ctx, name), "secondary_opts", None)
    return off[0] if off and ctx.params.get(name) is False else flag_of(name)


def setting_flag(name: str) -> str:
    """The flag that sets the estimate's setting `name` (a `Parallelism` field, --gpu, --optimizer)."""
    return ESTIMATE_FLAGS.get(name, flag_of(name))


def flag_line(refusal: ValueError) -> str:
    """A planning refusal as the user's one line: each setting it names as the flag that sets it (`EstimateError`'s
    {setting}; a `Parallelism` field it leads with as "setting: ", as the flag and the rest: `ExpertParallelError`'s
    and `RankOrderError`'s too)."""
    from ..planning.estimate import Parallelism

    said = getattr(refusal, "said", None)
    text = str(refusal) if said is None else said(setting_flag)
    field, _, rest = text.partition(": ")
    if field not in Parallelism.__dataclass_fields__ or not rest:
        return text
    # the setting's value, planning's "expert: 99999999999, but ...", grouped in thousands as the other lines' are
    grouped = re.sub(r"^\d+", lambda value: f"{int(value[0]):,}", rest)
    return f"{setting_flag(field)} {grouped}"


@contextmanager
def refused_with_flags() -> Iterator[None]:
    """Runs planning's rules: a refusal raised inside (`SettingsError`) is the user's one line (`flag_line`)."""
    from ..schedules.ranks import SettingsError

    try:
        yield
    except SettingsError as exc:
        raise InputError(flag_line(exc)) from None


def check_estimate_experts(measured, stages: int, data_parallel: int, *, one_replica: str | None = None) -> None:
    """A --profile estimated with E expert-parallel ranks runs them (`Scenario.order_params`), drawn from this run's
    replicas as its rank order draws them (schedules/ranks.py `estimated_experts_refusal`), in simulate, sweep, run
    and export (their searched orders'): a d they do not divide was a traceback, no ranks left to reduce the experts'
    gradients over, and at d = 1 all-to-alls over E ranks inside one replica. `one_replica`: the command, where it
    writes one replica and has no --data-parallel to give (export)."""
    from ..schedules.ranks import estimated_experts_refusal

    if measured is None or measured.estimate is None:
        return
    parallelism = measured.estimate.parallelism
    refusal = estimated_experts_refusal(parallelism, stages, data_parallel)
    if refusal is None:
        return
    estimated = f"the profile was estimated with --expert-parallel {parallelism['expert']}"
    if one_replica is None:
        raise InputError(f"--data-parallel {data_parallel:,}: {estimated}, and {flag_line(refusal)}")
    raise InputError(f"--profile: {one_replica} writes one replica (d = 1), and {estimated}, whose ranks its rank "
                     f"order cannot place in one replica: give a profile estimated with --expert-parallel 1")


def check_estimate_overlap(measured, overlap_expert_comm: bool) -> None:
    """--overlap-expert-comm beside a --profile estimated with what it cannot run beside (commands/estimate.py
    `expert_overlap_refusal`): refused as the same flags given with --gpu are."""
    from .estimate import expert_overlap_refusal

    if not overlap_expert_comm or measured is None or measured.estimate is None:
        return
    parallelism = measured.estimate.parallelism
    refusal = expert_overlap_refusal(tuple(parallelism.get("recompute_modules", ())),
                                     tuple(parallelism.get("cuda_graphs", ())), " (the profile's estimate)")
    if refusal is not None:
        raise InputError(refusal)


def check_expert_parallel(expert_parallel: int, net, *, placed: bool = False) -> None:
    """--expert-parallel E needs a mixture of experts (`net`) whose routed experts E divides
    (planning/experts.py `check_expert_ranks`): its `experts` option, as calibrate records them (a Hugging Face
    config's too), or where run `placed` them on its ranks, the built-in gpt's that `place_experts` places."""
    from ..planning.experts import check_expert_ranks
    from ..workload.models import routed_experts_of

    placeable = next((n for layer in net.layers if (n := routed_experts_of(layer)) is not None), None)
    if placed and placeable is None and net.options.get("experts"):
        raise InputError(_unplaced_experts(expert_parallel))
    with refused_with_flags():
        check_expert_ranks(expert_parallel, placeable if placed else net.options.get("experts") or placeable)


def check_expert_parallel_unbuilt(expert_parallel: int, model: str, options: dict[str, Any], *,
                                  placed: bool = False) -> None:
    """`check_expert_parallel`'s rule before torch's import and the model's build, where `options` (a built-in
    model's flags, or the options a profile recorded of a built-in or Hugging Face model) say its routed experts:
    `--expert-parallel 2` of a dense mlp was refused after 24 s, 4.4 CPU s (calibrate) and 26 s (run). The user's
    own module is checked once built (`check_expert_parallel`): what it holds only its code says."""
    from ..planning.experts import check_expert_ranks
    from ..profiles.workload import is_hf
    from ..workload.sizes import DEFAULT_SIZES

    if model not in DEFAULT_SIZES and not is_hf(model):
        return
    if placed and is_hf(model) and options.get("experts"):
        raise InputError(_unplaced_experts(expert_parallel))
    with refused_with_flags():
        check_expert_ranks(expert_parallel, options.get("experts"))


def _unplaced_experts(expert_parallel: int) -> str:
    """The line refusing run's --expert-parallel of a Hugging Face mixture, whose experts run does not place."""
    return (f"--expert-parallel {expert_parallel:,}: run places the built-in gpt's routed experts on its ranks, not a "
            "Hugging Face model's; simulate its calibrated profile (pipesim calibrate --expert-parallel "
            f"{expert_parallel}) with --expert-parallel {expert_parallel}")


def out_of_memory(checks) -> tuple[str, str] | None:
    """None if every device fits in its memory (`MemoryCheck`s, sim/cluster.py); else, in words, the devices that
    do not (for a table) and the memory over by the most (for the warning: ranks sharing one GPU's memory are
    over it together)."""
    over = [check for check in checks if check.out_of_memory]
    if not over:
        return None
    devices = _device_runs([check.device for check in over])
    listed = ", ".join(devices[:3]) + (", …" if len(devices) > 3 else "")
    short = f"OOM on device{'s' if len(over) > 1 else ''} {listed}"
    memories = {check.sharers: check for check in over}
    worst = max(memories.values(), key=lambda check: check.used_bytes / check.limit_bytes)
    more = len(memories) - 1
    return short, worst.reason() + (f" (and {more} more out of memory)" if more else "")


def _device_runs(devices: list[int]) -> list[str]:
    """The devices in ascending runs, three or more in a row as "first-last": the table's memory column lists three
    entries, which read "10, 11, 12, …" for DeepSeek-V3's ZB-V out of memory on devices 10 to 15 ("10-15")."""
    runs: list[list[int]] = []
    for device in sorted(devices):
        if runs and device == runs[-1][-1] + 1:
            runs[-1].append(device)
        else:
            runs.append([device])
    return [entry for run in runs for entry in ([f"{run[0]}-{run[-1]}"] if len(run) > 2 else map(str, run))]


def out_of_memory_line(subject: str, checks) -> str | None:
    """The warning simulate and estimate give where `subject`'s devices run out of memory (None: they fit)."""
    oom = out_of_memory(checks)
    return None if oom is None else f"{subject} runs out of memory: {oom[1]}"


def fail(message: str, every_rank: bool = False) -> NoReturn:
    """`message` as one line and exit code 2. Bad input is said once per host under torchrun (`speaks_for_host`);
    `every_rank`: a failure a torchrun rank may meet alone (the executor's), which each rank that meets it says."""
    from ..launch import speaks_for_host
    from .tables import print_message  # tables imports this module

    if every_rank or speaks_for_host():
        print_message(message, stderr, "error: ", "bold red")  # as written: [..] text, and :x: in hf:x:
    raise SystemExit(2)


# The shortest time above 0 a cost flag takes (--fwd, --bwd, --comm, --opt, --pred, --avg), a nanosecond: the
# simulator's clock ticks in picoseconds, and rounded a shorter time to none (`--fwd 1e-12 --bwd 1e-12` printed a 0 ms
# step at 0.0 samples/s); a thousand ticks leave sweep's whole-model times whole ticks when split over its stages.
LEAST_MS = 1e-6


def parse_numbers(flag: str, text: str, most: float = math.inf, most_why: str = "", least: float = 0.0) -> list[float]:
    """One number or a comma-separated list of them, each finite, 0 or at least `least` (`LEAST_MS` for a time), and
    at most `most` (a cost's range, units.py `MAX_MS` or `MAX_BYTES`, in the flag's unit; `most_why`, ": ..." after
    the value refused, says why where not plain)."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InputError(f"{flag}: give a number or comma-separated numbers (got {given_text(text)})") from None
        typed = given_text(part.strip())  # as typed, "1e10" or "600,000,000", as the parser's refusals quote one
        if not (math.isfinite(value) and 0 <= value <= most):
            raise InputError(f"{flag}: {finite_number_allowed(0, math.floor(most) if most < math.inf else most)} "
                             f"(got {typed}){most_why}")
        if 0 < value < least:
            raise InputError(f"{flag}: {least_ms_allowed(least)} (got {typed})")
        values.append(value)
    return values


def check_method_options(ctx: typer.Context, names: Iterable[str], flags: Iterable[str],
                         given: Iterable[str] = ()) -> None:
    """Refuse each of `flags` (METHOD_OPTIONS keys) given on the command line, or among the options `given` (sweep's
    --grid axes), that none of the methods `names` reads (a name that is no method, as simulate's "--schedule-file
    PATH", reads none), naming the methods that do; and an elastic coefficient outside (0, 1]."""
    from ..schedules import METHODS
    from ..schedules.methods import elastic_alpha_refusal

    names, given = list(names), set(given)
    for flag in flags:
        option = METHOD_OPTIONS[flag]
        readers = [m.name for m in METHODS.values() if m.reads(option)]
        if (is_given(ctx, flag[2:].replace("-", "_")) or option in given) and not set(readers) & set(names):
            raise InputError(f"{flag} applies to {', '.join(readers)} only, not {', '.join(names)}")
    refuse(elastic_alpha_refusal(ctx.params.get("elastic_alpha"), "--elastic-alpha"))


class RowCost(NamedTuple):
    """A cost flag that prices one kind of row alone: the kind (schedules/ir.py `Kind`), what the row is, and what a
    method whose order runs it does (`Method.runs`)."""

    kind: str
    what: str
    does: str


ROW_COSTS = {"wgrad_fraction": RowCost("W", "the weight gradient a split backward runs apart (W)", "splits it"),
             "pred": RowCost("PRED", "the weight prediction (PRED)", "predicts weights"),
             "avg": RowCost("AVG", "the elastic averaging of pipelines (AVG)", "averages pipelines")}  # by parameter


def prices_rows_of(method, param: str) -> bool:
    """Whether `param`, a cost flag's parameter, prices rows `method` runs (any flag not of `ROW_COSTS` does)."""
    from ..schedules.ir import Kind

    return param not in ROW_COSTS or method.runs(Kind(ROW_COSTS[param].kind))


def check_row_costs(ctx: typer.Context, names: Iterable[str], loaded=None) -> None:
    """Refuse a flag of `ROW_COSTS` where none of the methods `names` runs its rows, nor `loaded` (a --schedule-file's
    order) holds one: taken, it would change nothing (`simulate -s 1f1b --pred 3 --avg 3` ran as without them). By
    method, as sweep's rows' lines leave them out: a shape of one that runs them in others passes (avgpipe at -P 1
    averages nothing)."""
    from ..schedules import METHODS
    from ..schedules.analysis import rows_of
    from ..schedules.ir import Kind

    names = list(names)
    for param, cost in ROW_COSTS.items():
        if not is_given(ctx, param) or (loaded is not None and rows_of(loaded, Kind(cost.kind))) or any(
                prices_rows_of(METHODS[n], param) for n in names if n in METHODS):
            continue
        runners = [m.name for m in METHODS.values() if prices_rows_of(m, param)]
        raise InputError(f"--{param.replace('_', '-')} prices {cost.what}, and none of {', '.join(names)} {cost.does} "
                         f"({', '.join(runners)} {'does' if len(runners) == 1 else 'do'}): leave it out")


def check_allocator(ctx: typer.Context, what) -> None:
    """--allocator: one of ALLOCATORS, and with --gpu only (what `what_if` returned: None without it);
    --optimizer-step (where the command takes it): one of OPTIMIZER_STEPS, megatron with --gpu, a replay and Adam."""
    allocator = ctx.params["allocator"]
    if allocator not in ALLOCATORS:
        raise InputError(choose_from("--allocator", ALLOCATORS, allocator))
    if what is None and is_given(ctx, "allocator"):
        raise InputError("--allocator: only --gpu's estimate counts each pass's allocations, which the allocator "
                         "replays; give --gpu NAME and --model")
    step = ctx.params.get("optimizer_step", "held")
    if step not in OPTIMIZER_STEPS:
        raise InputError(choose_from("--optimizer-step", OPTIMIZER_STEPS, step))
    if step == "megatron" and (what is None or allocator == "none"):
        raise InputError("--optimizer-step megatron: what the caching allocator replays of a step; give --gpu NAME, "
                         "--model and --allocator caching or expandable")
    if step == "megatron" and ctx.params.get("optimizer") not in ("adam", "adamw"):
        raise InputError("--optimizer-step megatron steps Adam (Apex's FusedAdam): give --optimizer adam or adamw")


def allocator_fields(allocator: str, counted, parallel, optimizer_step: str = "held") -> dict:
    """`Scenario`'s fields under --allocator, for simulate, sweep and tune alike: `expandable_segments` (expandable)
    and `allocations`, what caching or expandable replays (`layer_allocations`, with Megatron-LM's optimizer step
    under --optimizer-step megatron): none without --gpu (`counted` None), with --allocator none, or for a
    mixture of experts, whose count is a whole layer's, every expert's, which the estimate divides by t·C but not
    by the E ranks sharing them (so --optimizer-step megatron, which only a replay runs, and --allocator expandable,
    which only a replay reads, are refused there)."""
    fields = {"expandable_segments": allocator == "expandable", "allocations": None}
    experts = counted is not None and any(layer.dispatched_bytes for layer in counted.layers)
    if experts and optimizer_step == "megatron":  # no replay to put the step in: refused, not ignored
        raise InputError("--optimizer-step megatron: the caching allocator replays no mixture of experts' steps (its "
                         "count is every expert's, not a rank's); leave --optimizer-step held")
    if experts and allocator == "expandable":  # nor segments to expand: taken, it changed nothing
        raise InputError("--allocator expandable: the caching allocator replays no mixture of experts' steps (its "
                         "count is every expert's, not a rank's), so its peak is the tensors alone; leave --allocator "
                         "out")
    if counted is not None and allocator != "none" and not experts:
        from ..planning.estimate import EstimateError, layer_allocations

        try:
            fields["allocations"] = tuple(layer_allocations(counted, parallel, optimizer_step == "megatron"))
        except EstimateError as exc:
            raise InputError(f"--optimizer-step {flag_line(exc)}") from None
    return fields


def check_prediction(source: str | None) -> None:
    """--prediction's value: one of the sources of s (a method that records no form from it is refused when
    its schedule is built, naming the sources it does record)."""
    from ..schedules.methods import prediction_refusal

    refuse(prediction_refusal(source, "--prediction"))


def search_options(activation_limit: str | None, search_seconds: str | None) -> dict[str, float | None]:
    """--activation-limit and --search-seconds as `ScheduleParams` fields: each, where given, one finite number
    above 0, the budget at most a day. (A limit below one micro-batch's activations is refused when the costs are
    known.)"""
    from ..schedules.methods import MAX_SEARCH_SECONDS, above_zero_refusal

    values: dict[str, float | None] = {}
    for flag, text, most in (("--activation-limit", activation_limit, math.inf),
                             ("--search-seconds", search_seconds, MAX_SEARCH_SECONDS)):
        value = None
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            refuse(above_zero_refusal(value, flag, text, most))
        values[flag[2:].replace("-", "_")] = value
    return values


def is_given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set option `name` (rather than it taking its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def given_simulate_flags(ctx: typer.Context, leave_out: Collection[str] = ()) -> list[list[str]]:
    """The options the user gave that `pipesim simulate` takes alike (by parameter name), as given and in their
    order (click fills `ctx.params` so), a flag and its value a piece (a switch alone, each value of a repeated
    option a piece of its own), but those named in `leave_out`: what the `pipesim simulate` line a command prints or
    writes repeats of the user's own (tune's choice, sweep's rows)."""
    import inspect

    from .simulate import simulate

    takes = inspect.signature(simulate).parameters
    options = {param.name: param for param in ctx.command.params}
    pieces = []
    for name, value in ctx.params.items():
        if name not in takes or name in leave_out or not is_given(ctx, name):
            continue
        param = options[name]
        if isinstance(value, bool):
            pieces.append([param.opts[0] if value else param.secondary_opts[0]])
        else:
            pieces += [[param.opts[0], str(given)] for given in (value if param.multiple else [value])]
    return pieces


@dataclass(frozen=True)
class Output:
    """What an output flag writes, told from a file's bytes: a file already at its path that is not one is
    refused, not replaced (`run --trace mlp.json` wrote a trace over a calibrated profile, without a word)."""

    name: str  # "pipesim trace", as the refusal says it
    is_one: Callable[[bytes], bool]


def is_sweep_results_bytes(data: bytes) -> bool:
    """Whether a file's bytes are `sweep --out`'s: Parquet's, or its CSV's header, after the byte-order mark a
    spreadsheet adds when it re-saves the CSV as UTF-8 (as `is_profile_bytes` allows one before a profile)."""
    return without_bom(data).startswith((b"schedule,stages,", b"PAR1"))


TRACE = Output("pipesim trace", is_trace_bytes)
PAGE = Output("pipesim page", lambda data: PAGE_HEALTH.encode() in data)
PROFILE = Output("pipesim profile", is_profile_bytes)
SWEEP_RESULTS = Output("pipesim sweep results file", is_sweep_results_bytes)
TORCH_CSV = Output("torch.distributed.pipelining schedule CSV",
                   lambda data: re.fullmatch(rb"(\d+[A-Z_]+\d*|,|\r?\n)*", data) is not None)
OUTPUTS = {"--trace": TRACE, "--html": PAGE}  # each command's --out says its own


def check_replaceable(flag: str, path: Path, output: Output) -> None:
    """Refuse to replace a file that is not what `flag` writes (`output`): a profile, a model's config, a page
    pipesim did not draw. An empty file is replaced."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{flag}: cannot read {path} to see what it is: {_reason(exc)}") from None
    if not output.is_one(data):
        raise InputError(f"{flag}: {path} exists and is not a {output.name}; remove it or give {flag} another path")


def check_writable(flag: str, path: Path | None) -> None:
    """Refuse an output path before any work is done, so nothing is half-written later. As `write_atomic`
    writes: a FIFO, a device or /dev/stdout in place, anything else by replacing the file a symlink points
    to from a temporary file in that file's folder, which is made and removed here (`check_stageable`): a
    permission check says yes to root where the file system refuses (/proc, /sys), and `--html /sys/t.html`
    was refused only once the simulation had run."""
    if path is None:
        return
    from ..traces.trace import check_stageable, writes_in_place

    if str(path) == "-":  # many tools' standard output: here it was a file named "-"
        raise InputError(f"{flag}: - names no file here; give a file path, or /dev/stdout for the standard output")
    with writing(flag):  # a name too long, a folder that cannot be searched: the path cannot even be looked at
        if path == Path("."):  # an empty path ("") reads as the current folder
            raise InputError(f"{flag}: give a file path (got the current folder)")
        if path.is_dir():
            raise InputError(f"{flag}: {path} is a directory; give a file path")
        if writes_in_place(path):
            if not os.access(path, os.W_OK):
                raise InputError(f"{flag}: cannot write {path}: permission denied")
            return
        folder = Path(os.path.realpath(path)).parent if path.is_symlink() else path.parent  # where it is made
        if not folder.is_dir():
            why = f"{folder} is a file, not a folder" if folder.exists() else f"folder {folder} does not exist"
            raise InputError(f"{flag}: cannot write {path}: {why}")
        try:
            check_stageable(path)
        except OSError as exc:
            why = "is not writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) \
                else f"takes no new files ({_reason(exc)})"
            raise InputError(f"{flag}: cannot write {path}: folder {folder} {why}") from None


def check_outputs(outputs: Sequence[tuple[str, Path | None] | tuple[str, Path | None, Output]],
                  reads: Sequence[tuple[str, Path | None]] = (), as_json: bool = False) -> None:
    """Refuse, before any work is done, an output that cannot be written (`check_writable`, in the order given) or
    that names the file of another output, or of a file the command reads: the later write replaced the earlier
    (`simulate --trace t.json --html t.json` kept the page, not the trace) or the input (`view t.json --html t.json`
    wrote the page over its trace). Outputs written in place (a FIFO, a device) may be shared, but for the standard
    output, which holds one (`_to_standard_output`). Each (flag, path)
    pair names its flag as the user gave it, or a read argument by what it is ("trace": "the trace it reads", where
    its metavar read "is also TRACE"); a third, the `Output` the flag writes where `OUTPUTS` has none for it.
    `as_json`: the command prints --json's document (`_to_standard_output`)."""
    from ..traces.trace import writes_in_place

    for flag, path, *_ in outputs:
        check_writable(flag, path)
    _to_standard_output(outputs, as_json)
    seen: dict[str, str] = {}
    for k, (flag, path, *_) in enumerate([*reads, *outputs]):
        if path is None:
            continue
        where, written = os.path.realpath(path), k >= len(reads)
        if written and where in seen and not writes_in_place(path):
            raise InputError(f"{flag}: {path} is also {seen[where]}; give {flag} a file of its own")
        seen.setdefault(where, f"{flag}'s output" if written
                        else f"{flag}, which it reads" if flag.startswith("-") else f"the {flag} it reads")
    for flag, path, *output in outputs:
        if path is not None and (output or flag in OUTPUTS) and not writes_in_place(path):
            check_replaceable(flag, path, output[0] if output else OUTPUTS[flag])


STANDARD_OUTPUT_PATHS = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def _is_standard_output(path: Path) -> bool:
    """Whether `path` names this process's standard output: /dev/stdout (or its fd's other names), or the file or
    pipe it writes to, but not a device both merely name (`--trace /dev/null > /dev/null` discards both)."""
    if os.path.abspath(path) in STANDARD_OUTPUT_PATHS:
        return True
    try:
        named = os.stat(path)
        return not stat.S_ISCHR(named.st_mode) and os.path.samestat(named, os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # no such file, or a standard output with no file behind it (a test's capture)
        return False


def _to_standard_output(outputs: Sequence[tuple], as_json: bool) -> None:
    """An output written to the standard output (`--trace /dev/stdout | jq`) is all it holds: what the command prints
    goes to stderr instead (the table and "wrote" followed the trace, and nothing piped from it parsed), and one
    that --json's document (`as_json`) or another output would share it with is refused."""
    written = [(flag, path) for flag, path, *_ in outputs if path is not None and _is_standard_output(path)]
    if not written:
        return
    (flag, path), *others = written
    if as_json:
        raise InputError(f"{flag}: {path} is the standard output, which --json prints to: give {flag} a file, or "
                         "leave --json out")
    if others:
        raise InputError(f"{others[0][0]}: {others[0][1]} is the standard output, which {flag} writes to: give one "
                         "a file")
    stdout.file = sys.stderr  # for this command: the command line sets it back as the command ends (cli.main)


def refuse_unwritable(*outputs: tuple[str, Path | None]) -> None:
    """For a script of benchmarks/: its outputs refused as the command line refuses them (`check_outputs`), before
    it computes anything: one line, exit 2."""
    try:
        check_outputs(outputs)
    except InputError as exc:
        fail(str(exc))


def write_json(path: Path | None, document: Any) -> None:
    """For a script of benchmarks/: its --json, `document` indented one space a level, written whole or not at all
    (`write_atomic`), nothing where --json was not given (None); a write that fails all the same (a full disk) is
    one line naming --json, exit 2."""
    import json

    from ..traces.trace import write_atomic

    if path is None:
        return
    try:
        with writing("--json"):
            write_atomic(path, json.dumps(document, indent=1) + "\n")
    except InputError as exc:
        fail(str(exc))


def model_reads(params: dict[str, Any]) -> list[tuple[str, Path | None]]:
    """The files a model's flags name, for check_outputs: --model hf:PATH's config.json, --curve-from and --gpus
    (where the command takes them)."""
    from ..profiles.workload import is_hf
    from ..workload.hfconfig import hf_config_path

    model = params.get("model")
    return [("--model", hf_config_path(model) if model and is_hf(model) else None),
            ("--curve-from", params.get("curve_from")), ("--gpus", params.get("gpus"))]


@contextmanager
def writing(flag: str) -> Iterator[None]:
    """Around the write of `flag`'s output: a write that fails once the work is done (a full disk, a folder that
    takes no files, which `check_writable` cannot foresee) is one line naming the flag, the path and why."""
    try:
        yield
    except OSError as exc:
        path = exc.filename if exc.filename else "its output"
        raise InputError(f"{flag}: cannot write {path}: {_reason(exc)}") from None


def wrote_text(path: Path, replaced: bool) -> str:
    """The line that names a page written, and whether a file was there before: a page replaced without a word
    looked as if it were the first."""
    return f"wrote {path}" + (" (replaced the file that was there)" if replaced else "")


def read_error(exc: OSError) -> str:
    """The line for an OSError that reaches a command's last handler. Every output's write is inside `writing`,
    which names its flag, and the files the flags name are read through pipesim.files, which names the flag too:
    what is left is a file the command reads for itself (a source of pipesim's, a cache) or no file at all (a
    socket), never an output, so it is never called one."""
    return f"cannot read {exc.filename}: {_reason(exc)}" if exc.filename else str(exc)


def _reason(exc: OSError) -> str:
    """What went wrong in an OSError's own words: its strerror, else what it was raised with (a message alone;
    its str would read "[Errno None] None: PATH" once a file name is set), else its type."""
    return exc.strerror or ", ".join(map(str, exc.args)) or type(exc).__name__


# What the optional modules are and how to install them: import name -> (pip package, pipesim's extra with it).
EXTRAS = {"torch": ("torch", "torch"), "sklearn": ("scikit-learn", "torch"), "pyarrow": ("pyarrow", "parquet"),
          "ray": ("ray", "ray"), "transformers": ("transformers", "hf")}


def require(needer: str, *modules: str) -> None:
    """Before any work, each of `modules` (EXTRAS keys) that `needer` (what the user asked for, as they wrote
    it) needs is installed; else one line saying how to install it. torch is imported, so a broken build (a
    missing CUDA library, a mismatched wheel) stops here too; the others are only looked up."""
    for module in modules:
        package, extra = EXTRAS[module]
        hint = f"pip install 'pipesim[{extra}]'" + (" (or your CUDA build of torch)" if module == "torch" else
                                                    f" (or pip install {package})")
        if module == "torch":
            from ..workload.processes import sigint_held

            try:
                with sigint_held():
                    import torch  # noqa: F401
            except ImportError as exc:
                if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
                    raise InputError(f"{needer} needs PyTorch, which is not installed: {hint}") from None
                raise InputError(f"{needer}: PyTorch does not import ({exc}); reinstall it: {hint}") from None
        elif importlib.util.find_spec(module) is None:
            raise InputError(f"{needer} needs {package}, which is not installed: {hint}")


def say_part_counted(model: str) -> None:
    """Where `model` is a multimodal model's Hugging Face config, say on stderr which of its parts a command takes
    (workload/hfconfig.py `HfConfig.note`): once the command has counted (or built) it, so that a model it then
    refuses is refused in one line. Nothing for any other model, nor for an unreadable config (its refusal is the
    count's)."""
    from ..profiles.workload import is_hf
    from ..workload.hfconfig import HfConfigError, read_hf_config
    from .tables import print_message

    if not is_hf(model):
        return
    try:
        note = read_hf_config(model).note
    except HfConfigError:
        return
    if note is not None:
        print_message(f"note: {note}", stderr)


def say_what_if_counted(what) -> None:
    """`say_part_counted` for a what-if (commands/estimate.py `WhatIf`), and where its part's curve is fitted to a
    calibration made off a GPU (--curve-from a CPU's: how the fit is checked without one), that the part is priced
    at that device's own rates (a CPU's put an H100's products at 0.000843 of its datasheet): said once it is
    counted, so that a refusal stays one line."""
    from .tables import print_message

    say_part_counted(what.model)
    if what.calibrated is not None and (env := what.calibrated.environment).device != "cuda":
        print_message(f"note: --curve-from {what.calibrated_path} was calibrated on the {env.device} "
                      f"({env.device_name}): {what.gpu.name} is priced at that device's own rates, not a GPU's "
                      "(calibrate on the part: --device cuda)", stderr)


def require_model(needer: str, model: str, torch_needer: str | None = None) -> None:
    """Before any work, for --model `model`: a name of a model (workload/sizes.py `model_name_refusal`: a misspelt
    one was refused only after torch's import, 4 s); torch (needed by `torch_needer`, default `needer`); scikit-learn
    for a built-in model that trains on its digits data; transformers for a Hugging Face config."""
    from ..profiles.workload import is_hf
    from ..workload.sizes import model_name_refusal

    if (refusal := model_name_refusal(model)) is not None:
        raise InputError(refusal)
    require(torch_needer or needer, "torch")
    from ..workload.models import DIGITS_MODELS

    if model in DIGITS_MODELS:
        require(f"{needer} --model {model} (it trains on scikit-learn's digits)", "sklearn")
    if is_hf(model):
        require(f"{needer} --model {model} (transformers builds it from its config)", "transformers")


def memory_gb_bytes(memory_gb: float | None) -> int | None:
    """--memory-gb as the whole bytes pipesim holds it in (None: not given), from one byte, where a cap below it
    read as "fits in 0 GiB", to a PiB."""
    if memory_gb is None:
        return None
    if refusal := memory_gib_refusal(memory_gb):
        raise InputError(f"--memory-gb: {refusal}")
    return int(memory_gb * GIB)


def check_memory_cap(cap_bytes: int | None, device_bytes: int | None, part: str | None,
                     holder: str | None = None) -> None:
    """--memory-gb (`cap_bytes`, `memory_gb_bytes`') at most the device's own memory, `device_bytes` (None: not
    known), of catalogue part `part` (None: the profiled device, or `holder` where given: the device of a cluster
    file that gives it): a cap above it holds the layouts to memory the device lacks (tune chose one of 183,986 MiB
    at 200 GiB on an 80 GB H100, which simulate without the cap marks out of memory)."""
    if cap_bytes is None or not device_bytes or cap_bytes <= device_bytes:
        return
    from ..planning.tune import digits_apart, memory_text

    held = memory_text(device_bytes, digits_apart(device_bytes, cap_bytes, memory_text))  # reads under the cap
    device = (f"{part}'s {held} (`pipesim gpus`)" if part else f"the {held} of {holder}" if holder
              else f"the profiled device's {held}")
    most = math.floor(device_bytes / GIB * 100 + 1e-6) / 100  # a catalogue's 79.11 GiB read back as 79.10999...
    if memory_gb_bytes(most) > device_bytes:  # rounded down: what it says is taken
        most -= 0.01
    raise InputError(f"--memory-gb {cap_bytes / GIB:g}: more than {device}, so a layout that fits the cap would run "
                     f"out of memory there: give at most {most:g}")


def check_cluster_memory(memory_bytes: int | None, topology: Cluster | None, path: Path | None, devices: int) -> None:
    """--memory-gb at most the least memory a --cluster file gives the first `devices`, those a run uses (those past
    them hold none of it: `Scenario.memory_limits`)."""
    held = [] if topology is None else [(memory, name) for memory, name in zip(
        topology.memory_bytes[:devices], topology.device_names[:devices]) if memory]
    if held:
        least, name = min(held)
        check_memory_cap(memory_bytes, least, None, f"--cluster {path}'s {name}")


def check_threads(flag: str, threads: int) -> None:
    """Torch threads per process, at most the cores this process may run on. Torch takes more (10**12 overflowed: a
    traceback in calibrate, a dead rank in run), but they take turns on the cores: a profile's T threads would be
    timed at fewer cores' speed, their own contention, and say nothing of T threads on a host that has them. The
    refusal says where the count comes from: a container's or taskset's CPU affinity may leave fewer than the host's."""
    from ..traces.hostload import usable_cpus

    if threads <= (cores := usable_cpus()):
        return
    allowed = "1" if cores == 1 else f"1 to {cores:,}"
    host_cores = os.cpu_count() or cores
    usable = (f"{cores:,} of this host's {count_text(host_cores, 'core')} (its CPU affinity)" if host_cores > cores
              else f"this host's {count_text(cores, 'core')}")
    raise InputError(f"{flag}: give {allowed} (got {threads:,}): pipesim may run on {usable}, and more threads than "
                     "cores take turns on them, timed at fewer cores' speed")


def out_of_host_memory(exc: BaseException, model: str, microbatch_size: int) -> InputError | None:
    """A MemoryError, or torch's error for an allocation that failed, as the line saying the model or its
    micro-batch does not fit in this host's memory (`calibrate`, `run` and `study` make real batches); None for any
    other error, which is a bug's and keeps its traceback."""
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
    if not isinstance(exc, MemoryError) and not any(word in first_line.lower() for word in ("alloc", "memory")):
        return None
    # torch's allocator says what it tried ("[enforce fail at alloc_cpu.cpp:127] ... you tried to allocate N
    # bytes. Error code 12 ..."): the size, in the units the other refusals use, without its source lines
    tried = re.search(r"tried to allocate (\d+) bytes", str(exc))
    failed = f"an allocation of {bytes_text(int(tried[1]))} failed" if tried else "the host ran out of memory"
    return InputError(f"{model} does not fit in memory at micro-batch size {microbatch_size:,} (--microbatch-size): "
                      f"{failed}; make it smaller (--width, --layers, --microbatch-size)")


def refuse_out_of_host_memory(exc: BaseException, model: str, microbatch_size: int, every_rank: bool = False
                              ) -> NoReturn:
    """`exc`, caught where a command makes its real batches (`calibrate`, `run`, `study`), as `out_of_host_memory`'s
    one line and exit 2 where it is a failed allocation (`every_rank`: as `fail`); any other error raised again, a
    bug's, with its traceback."""
    if (refusal := out_of_host_memory(exc, model, microbatch_size)) is None:
        raise exc
    fail(str(refusal), every_rank)


def description_column():
    """A transient bar's description, as the column that takes the width its figures leave and wraps between words:
    rich cut the figures instead, at 80 columns calibrate's elapsed time to "0:0…" and study's description to
    "(4.135 M…" with its bar, count and time dropped."""
    from rich.progress import TextColumn
    from rich.table import Column

    return TextColumn("{task.description}", table_column=Column(ratio=1))


def counted_bar_columns() -> tuple:
    """A transient bar of counted work (run's mini-batches, study's runs): its description (`description_column`),
    a bar of 20 characters, the count done and the elapsed time. rich's bar of 40 left a description 23 characters
    at 80 columns: study's "training pipedream, momentum, seed 0" wrapped after "seed"."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    return description_column(), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn()


def progress(items: Iterable, quiet: bool, total: int | None = None, doing: str = "simulating"):
    """Iterate with a transient progress bar on an interactive terminal (simulations can take seconds, one alone
    too: its spinner and elapsed time say it is working); `total` counts the items of an iterator, `doing` names
    the work."""
    total = len(items) if total is None else total
    if quiet or not stderr.is_terminal or not total:
        yield from items
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn(doing), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as bar:
        yield from bar.track(items, total=total)


# what a terminal shows while a first count of a model imports torch, and while a command that trains imports it and
# builds its model: seconds with nothing else on the screen
COUNTING_MODEL = "counting the model on torch's meta device"
STARTING_STATUS = "importing torch and building the model"
READING_STATUS = "reading the traces"  # compare's and view's: a large run's take tens of seconds to read and draw


@contextmanager
def transient_status(what: str, quiet: bool) -> Iterator[None]:
    """What a step that may take seconds is doing, as a transient status on an interactive terminal (a model's
    first count on torch's meta device imports torch: seconds with nothing else on the screen)."""
    if quiet or not stderr.is_terminal:
        yield
        return
    with stderr.status(what):
        yield


@contextmanager
def search_progress(search_seconds: float | None, quiet: bool) -> Iterator[Callable[[float], None] | None]:
    """For a search given --search-seconds of a second or more, on an interactive terminal: a transient progress
    bar, and the callback the search reports the share of its budget spent to (else None: no bar)."""
    if quiet or search_seconds is None or search_seconds < 1 or not stderr.is_terminal:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=stderr, transient=True) as bar:
        task = bar.add_task("searching auto", total=1.0)
        yield lambda share: bar.update(task, completed=share)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while what runs inside makes objects that stay alive, as it was
    after: every full collection walks all made so far and frees little. tune's estimates and search (a few
    million objects, the counts and profiles the search reads, its shapes, candidates and results: 40 % of the 70B
    problem's estimation, and 2.5 of its search's 14 CPU s, 8 full collections, 2.1 s; a collection after its
    answer finds nothing unreachable, the 70B's and the 1.3B's alike, at the same peak memory), and a first count
    (torch's and transformers' modules as they are imported, the model built and counted on the meta device: 0.9-1.1
    of each README what-if's 9-12 CPU s; a collection after finds 10-20 thousand objects unreachable, the 8B's
    first count's and DeepSeek-V3's). Objects are still freed as their references go; cycles wait for the next
    collection. What it made joins the oldest generation as it ends (frozen, then unfrozen), as if it had survived a
    collection: left in the youngest, the first allocation after would scan all of them (0.5 of the 70B's 12.6 CPU
    s in one process). Inside another, it leaves the collector to the outer one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()
            gc.unfreeze()


def zero_stage(flags: dict) -> int:
    """ZeRO's stage from --zero and --sharded-optimizer (the same as --zero 1), checked against --data-parallel
    and --precision."""
    from ..schedules.methods import zero_refusal

    zero, sharded = flags.get("zero"), flags.get("sharded_optimizer", False)
    if zero is not None:
        refuse(zero_refusal(zero, "--zero"))
    if sharded and zero not in (None, 1):
        raise InputError(f"--sharded-optimizer is --zero 1, but --zero {zero} was given: give one of them")
    stage = 1 if sharded else zero or 0
    replicas = flags.get("data_parallel", 1)  # None: tune's search, which plans d·C = 1 unsharded
    if stage and replicas is not None and replicas * flags.get("context_parallel", 1) == 1:
        flag = "--sharded-optimizer" if sharded else f"--zero {stage}"
        raise InputError(f"{flag} shards over data-parallel replicas: give --data-parallel 2 or more (or with "
                         "--gpu, --context-parallel 2 or more, whose ranks shard alike)")
    if flags.get("precision") == "fsdp2" and stage != 3:
        raise InputError("--precision fsdp2 is FSDP2's mixed precision, whose float32 weights are sharded: give "
                         "--zero 3 (with --data-parallel 2 or more)")
    return stage


def given_precision(flags: dict) -> str | None:
    """--precision (None: not given), checked: one of the precisions, and not beside a --profile, whose weights,
    gradients and state are held as it was made."""
    from ..sim.costs import precision_refusal

    precision = flags.get("precision")
    if precision is None:
        return None
    refuse(precision_refusal(precision, "--precision"))
    if flags.get("profile") is not None:
        raise InputError("--precision: a profile holds its weights, gradients and optimizer state as it was "
                         "calibrated or estimated with; drop --precision (`pipesim estimate --precision` sets an "
                         "estimate's)")
    return precision


def check_optimizer_held(optimizer: str, precision: str | None, measured: Profile | None) -> None:
    """Refuse `optimizer` where the precision holds state it does not keep (`precision_optimizer_refusal`): the
    --precision given, else the one the profile `measured` was estimated with."""
    from ..sim.costs import precision_optimizer_refusal

    if precision is None and measured is not None:
        refuse(precision_optimizer_refusal(measured.estimated_parallelism.get("precision"), optimizer, profile=True))
    else:
        refuse(precision_optimizer_refusal(precision, optimizer))


def check_pp_runtime(pp_runtime: str, p2p_sync: str | None = None) -> str:
    """--pp-runtime's value, one of `PP_RUNTIMES` (simulate, sweep and tune take it); costs priced under
    `p2p_sync` (what says so: --p2p-sync, or a --profile estimated with it) are refused with torch's, whose
    pipelining waits for its exchanges on the stream, never the host (docs/hardware.md, "Host-bound execution")."""
    from ..sim.costs import PP_RUNTIMES

    if pp_runtime not in PP_RUNTIMES:
        raise InputError(choose_from("--pp-runtime", PP_RUNTIMES, pp_runtime))
    if p2p_sync and pp_runtime == "torch":
        raise InputError(f"{p2p_sync}: Megatron-core's batched exchange, which synchronises the device; "
                         "--pp-runtime torch's pipelining waits on the stream, not the host: drop one")
    return pp_runtime


def p2p_synced(ctx: typer.Context, measured: Profile | None = None) -> str | None:
    """What prices the costs with Megatron-core's synchronising exchange between stages: --p2p-sync, or `measured`
    (a --profile) estimated with it (profiles/schema.py `p2p_synced`, imported only then); None: neither."""
    if ctx.params.get("p2p_sync"):
        return "--p2p-sync"
    if measured is None:
        return None
    from ..profiles.schema import p2p_synced as estimated_synced

    return "--profile (estimated with --p2p-sync)" if estimated_synced(measured) else None


def check_p2p_sync(ctx: typer.Context, methods: Iterable[str], measured: Profile | None = None) -> None:
    """Refuse costs priced with Megatron-core's synchronising exchange (`p2p_synced`: --p2p-sync, or `measured`, a
    --profile estimated with it) under --pp-runtime torch (`check_pp_runtime`), or for any of `methods` whose
    exchanges it does not model (`Method.p2p_sync`; a --schedule-file's order is torch's), naming those it does:
    Megatron-core runs the rest not at all, or, interleaved, synchronises after each forward-backward pair of its
    steady state, so that a backward runs after its stage's forward with no wait and a forward after a wait whether
    or not it receives (docs/hardware.md, "Host-bound execution")."""
    from ..schedules import METHODS

    synced = p2p_synced(ctx, measured)
    check_pp_runtime(ctx.params.get("pp_runtime", "pipesim"), synced)
    others = [name for name in methods if not (name in METHODS and METHODS[name].p2p_sync)]
    if synced and others:
        takers = [method.name for method in METHODS.values() if method.p2p_sync]
        raise InputError(f"{synced}: Megatron-core's synchronising exchange is modelled for {', '.join(takers)} "
                         f"only, not {', '.join(others)}: give --schedule {','.join(takers)}")


def scenario_from_flags(ctx: typer.Context, per: str, source: Path | None = None, estimated: Profile | None = None,
                        **overrides) -> Scenario:
    """The Scenario the command's cost flags describe (read by parameter name, which `simulate` and `sweep`
    share; `overrides` replace their values), checked before any work; `estimated` (--gpu's) stands for
    --profile's."""
    from ..planning.buckets import OPTIMIZER_BUCKETS
    from ..planning.scenario import Scenario, check_stage_cut, first_last
    from ..schedules.methods import above_zero_refusal
    from ..sim import ClusterError, CostError, load_cluster

    measured = estimated or (load_profile_flag(ctx, ctx.params["profile"]) if ctx.params.get("profile") is not None
                             else None)
    if estimated is None and source is None:
        _estimates_replicas(ctx, measured)
    flags = {**ctx.params, **overrides}
    refuse(optimizer_refusal(flags["optimizer"], "--optimizer"))
    precision = given_precision(flags)
    check_optimizer_held(flags["optimizer"], precision, measured)
    most = {"--fwd": (MAX_MS, ""), "--bwd": (MAX_MS, ""),
            "--param-mb": _param_mb_most(flags["optimizer"], precision or "fp32"),
            "--activation-mb": (MAX_BYTES / MIB, ""), "--output-mb": (MAX_BYTES / MIB, "")}
    per_stage = {flag: parse_numbers(flag, flags[flag[2:].replace("-", "_")], *most[flag],
                                     least=LEAST_MS if flag in ("--fwd", "--bwd") else 0.0) for flag in most}
    comm_ms = parse_numbers("--comm", flags["comm"], MAX_MS, least=LEAST_MS)
    if len(comm_ms) != 1:
        raise InputError(f"--comm: give one number of milliseconds (got {flags['comm']!r})")
    network = flags.get("network_gb_s")
    refuse(above_zero_refusal(network, "--network-gb-s"))
    zero = zero_stage(flags)
    if flags.get("reduce_after_flush") and (flags.get("data_parallel") or 1) * flags.get("context_parallel", 1) == 1:
        raise InputError("--reduce-after-flush times the gradient all-reduce of data-parallel replicas: give "
                         "--data-parallel 2 or more")
    pp_runtime = check_pp_runtime(flags.get("pp_runtime", "pipesim"), p2p_synced(ctx))
    optimizer_buckets = flags.get("optimizer_buckets", "megatron")
    if optimizer_buckets not in OPTIMIZER_BUCKETS:
        raise InputError(choose_from("--optimizer-buckets", OPTIMIZER_BUCKETS, optimizer_buckets))
    missing = [flag for flag, given in (("--gpu NAME or --profile PATH", flags["profile"] is not None
                                         or flags.get("gpu") is not None), ("--zero 1", zero == 1)) if not given]
    if optimizer_buckets != "megatron" and missing:
        raise InputError(f"--optimizer-buckets {optimizer_buckets} groups the distributed optimizer's collectives of "
                         f"--gpu's or --profile's layers: give {' and '.join(missing)}")
    stage_cut = flags.get("stage_cut") or "balanced"  # run's None: the profile's partition, balanced as a scenario
    try:
        first_last(stage_cut)
        check_stage_cut(stage_cut, pp_runtime)
    except CostError as exc:
        raise InputError(str(exc)) from None
    if measured is None and not any(per_stage["--fwd"] + per_stage["--bwd"]):  # 0.0 samples/s, a 0 ms step
        raise InputError("--fwd, --bwd: every forward and backward takes 0 ms, so a step has no compute to time; "
                         "give one of them above 0")
    if measured is not None and zero != 3 and measured.estimated_parallelism.get("precision") == "fsdp2":
        raise InputError("--profile: estimated with --precision fsdp2, whose float32 weights are sharded: give "
                         "--zero 3 (with --data-parallel 2 or more)")
    if is_given(ctx, "stage_cut") and measured is None and flags.get("gpu") is None:
        raise InputError("--stage-cut cuts --gpu's or --profile's layers into stages; the cost flags give each "
                         "stage's costs already")
    if network is not None and (flags.get("data_parallel") or 1) == 1:
        raise InputError("--network-gb-s prices the gradient all-reduce of data-parallel replicas: give "
                         "--data-parallel 2 or more")
    topology = None
    if flags["cluster"] is not None:
        if is_given(ctx, "comm"):
            raise InputError("--comm and --cluster both describe links: give one")
        try:
            topology = load_cluster(flags["cluster"])
        except ClusterError as exc:
            raise InputError(f"--cluster: {exc}") from None
        if flags["blocking_comm"]:
            topology = replace(topology, overlap_comm=False)
    graph = flags.get("graph")
    return Scenario(
        per_stage, flags["wgrad_fraction"], flags["opt"], flags["pred"], flags["avg"], flags["optimizer"],
        flags["microbatch_size"], comm_ms[0], not flags["blocking_comm"], topology, measured,
        _load_graph(graph) if graph is not None else None, per, source, network_gb_s=network, stage_cut=stage_cut,
        precision=precision or "fp32", overlap_expert_comm=bool(flags.get("overlap_expert_comm")),
        pp_runtime=pp_runtime, optimizer_buckets=optimizer_buckets, sized_by_flags=estimated is not None)


def _param_mb_most(optimizer: str, precision: str) -> tuple[float, str]:
    """--param-mb's largest value and why: the weights' gradients and optimizer state (adam's two moments, a
    master copy) are sizes as well, each at most units.py's MAX_BYTES; a larger value was refused as the
    simulator's "optimizer_state_bytes must be ...", no flag named."""
    from ..sim.costs import PRECISIONS

    held = PRECISIONS[precision]
    state_bytes = held.optimizer_state_bytes(held.weight_bytes, optimizer)
    largest = max(held.weight_bytes, held.grad_bytes, held.stored_bytes or 0, state_bytes)
    why = (f": MiB of weights, whose gradients and {optimizer} state under --precision {precision} take up to "
           f"{largest / held.weight_bytes:g} times their bytes, and a size is at most {MAX_BYTES / MIB:,.0f} MiB"
           if largest > held.weight_bytes else "")
    return MAX_BYTES / MIB * held.weight_bytes / largest, why


def searched_scenario(ctx: typer.Context, method, measured: Profile | None = None) -> Scenario | None:
    """Where a command that simulates nothing (export, run) builds a method searched from the costs (auto): the
    profile's costs (with the command's --optimizer, else Adam's state), else the what-if flags' (--fwd and --bwd
    at least). None for a method with a fixed order, which reads no costs: the flags are refused for it."""
    from ..planning.scenario import profile_scenario

    given = [flag_of(name) for name in SEARCH_COSTS if is_given(ctx, name)]
    if not method.needs_costs:
        if given:
            raise InputError(f"{given[0]}: only a schedule searched from the costs (auto) reads it, not {method.name}")
        return None
    if measured is not None:
        if given:
            raise InputError(f"{', '.join(given)}: the profile gives {method.name}'s costs; drop "
                             f"{'these flags' if len(given) > 1 else given[0]}")
        return replace(profile_scenario(measured, ctx.params.get("optimizer") or SEARCH_DEFAULTS["optimizer"]),
                       stage_cut=ctx.params.get("stage_cut") or "balanced")  # run's cut, where it takes one
    if not (is_given(ctx, "fwd") and is_given(ctx, "bwd")):
        raise InputError(f"--fwd and --bwd, or --profile: {method.name} searches its order from the stage costs, so "
                         "give them")
    return scenario_from_flags(ctx, "device", **{name: value for name, value in SEARCH_DEFAULTS.items()
                                                 if ctx.params.get(name) is None})


def built_schedule(method: Method, params: ScheduleParams, scenario: Scenario | None, quiet: bool,
                   bounds: Sequence[int] | None = None) -> Schedule:
    """`method`'s schedule for `params`: its fixed order where `scenario` is None (`searched_scenario`'s answer
    for such a method), else built by the scenario, under the progress bar of a long search (`search_progress`,
    none when `quiet`), cut at `bounds` (a profile's partition) where they are the schedule's p·v stages, else
    where the scenario cuts."""
    if scenario is None:
        return method.build(params)
    fits = bounds is not None and len(bounds) - 1 == params.stages * params.chunks
    with search_progress(params.search_seconds, quiet) as report:
        return scenario.build(method.name, params, bounds if fits else None, progress=report)


PROFILE_COSTS = ("fwd", "bwd", "wgrad_fraction", "opt", "pred", "avg", "param_mb", "activation_mb", "output_mb",
                 "microbatch_size", "graph", "network_gb_s")


def read_profile(path: Path, flag: str = "--profile") -> Profile:
    """The profile file `flag` names, refused in one line naming the flag where the profile's checks fail."""
    from ..profiles.schema import ProfileError, load_profile

    try:
        return load_profile(path)
    except ProfileError as exc:
        raise InputError(f"{flag}: {exc}") from None


def _estimates_replicas(ctx: typer.Context, measured: Profile | None) -> None:
    """A --profile estimate runs at its own d unless --data-parallel says otherwise, and over d > 1 replicas sharded
    as it was (ZeRO-3 under --precision fsdp2, else ZeRO-1 where it sharded the optimizer) unless --zero or
    --sharded-optimizer does: as the estimate counted its memory and as its own check runs it (commands/estimate.py
    `one_f_one_b_peaks_bytes`), set in `ctx.params` before the flags that need replicas are checked. One replica's
    unsharded optimizer had read Llama 3.1 8B at p = 4, d = 8 as out of memory (83,101 MiB) where the estimate fits
    (60,368); and so it read again where --data-parallel restated the estimate's own d."""
    estimate = measured.estimate if measured is not None else None
    if estimate is None:
        return
    parallelism = estimate.parallelism
    if not is_given(ctx, "data_parallel"):
        ctx.params["data_parallel"] = int(parallelism.get("data", 1))
    if ctx.params["data_parallel"] > 1 and parallelism.get("sharded_optimizer") and not (
            is_given(ctx, "zero") or is_given(ctx, "sharded_optimizer")):
        ctx.params["zero"] = 3 if parallelism.get("precision") == "fsdp2" else 1


def load_profile_flag(ctx: typer.Context, path: Path) -> Profile:
    """The --profile file. It fixes the costs, sizes and (when it measured them) links, so flags that set
    those would be silently ignored: refuse them instead."""
    measured = read_profile(path)
    fixed = [*PROFILE_COSTS, *(("comm", "cluster") if measured.link else ())]
    clash = [flag_of(name) for name in fixed if is_given(ctx, name)]
    if clash:
        raise InputError(f"{', '.join(clash)}: the profile {path} gives the costs, sizes, stage graph"
                         f"{' and links' if measured.link else ''}; drop "
                         f"{'these flags' if len(clash) > 1 else clash[0]}")
    check_pp_runtime(ctx.params.get("pp_runtime", "pipesim"), p2p_synced(ctx, measured))
    warn_of_wall_time_tail(measured, f"--profile {path}")
    return measured


# A calibrated contention tail taken in wall time (`ContentionProfile.tail_in_wall_time`) above this is
# warned of: in CPU time a rank's windows gave 0.89-1.12 at others' load 0.8-0.9 per core (calibrate/contention.py),
# in wall time 3.2-7.5x, so a wall-time tail above it priced the host's busy moment into every pass.
WALL_TAIL_WARNING = 1.2


def warn_of_wall_time_tail(profile: Profile, whose: str) -> None:
    """One line on stderr where `whose` profile, which prices every pass at its contention tail, took that tail in
    wall time (calibrated before it was taken in CPU time) and above WALL_TAIL_WARNING: the answer stands."""
    contention = profile.contention
    if contention is None or not contention.tail_in_wall_time or contention.tail <= WALL_TAIL_WARNING:
        return
    from .tables import print_message  # tables imports this module

    print_message(f"warning: {whose}: its contention tail, {contention.tail:.2f}x on every pass, was taken in wall "
                  "time, which held the host's load while it was calibrated; `pipesim calibrate` now takes it in CPU "
                  "time", stderr)


def _load_graph(path: Path):
    from ..schedules import ScheduleError
    from ..schedules.graph import load_graph

    try:
        return load_graph(path)
    except ScheduleError as exc:
        raise InputError(f"--graph: {exc}") from None
