"""Memory held against published memory, nothing fitted: each row's pipesim command line is built as text, printed,
and run as written (in-process, --json or --out added to read its figure).

- Korthikanti et al. 2022, Table 2 (benchmarks/published/korthikanti-2022-table2.csv): activation bytes per
  transformer layer, no parallelism, tensor parallel, tensor + sequence parallel, selective and full
  recomputation, for the models of their Table 3 (t = 8, b = 1), against the GPT counted by torch on the meta
  device and estimated (`estimate --out`'s layers[1], the first block);
- runs that were measured running (Korthikanti et al.'s Table 3 runs in both Table 5 settings, Narayanan et al.'s
  Table 1, NVIDIA's Nemotron-4 340B as its benchmark ran it): none may be marked out of memory; the fullest
  device's peak and its parts are printed beside the GPU's memory;
- torchtitan's Llama 3.1 runs (torchtitan-2024-llama3.csv): every row pipesim expresses (16 of 18: Llama 3.1 8B,
  70B and 405B with FSDP, TP, PP, CP and Float8), its command built from the row's columns (`torchtitan_command`),
  the fullest device's peak against the published memory on the page's 96 GB HBM2e H100s
  (examples/h100-hbm2e-96gb.toml; none may be marked out of memory), with what pipesim does not model
  (torch.compile's fusion); the two rows of 262,144 tokens listed (beyond the configs' positions);
- the zero-bubble paper's Table 4 (zero-bubble-2024-table4.csv): peak memory of 1F1B, interleaved 1F1B, ZB-1p and
  ZB-2p for its four GPTs on A100 80GB, each as its fork launched it (`zero_bubble_command`).

    python benchmarks/published_memory.py                 # the tables, then each row's command
    python benchmarks/published_memory.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from one_line_parser import OneLineParser  # this folder's
from published_runs import KORTHIKANTI_SETTINGS, SEQ, Run, _rows, command_text, korthikanti_runs, megatron_runs, run_cli
from rich.console import Console
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_message, print_table, print_table_last_below
from pipesim.schedules.zb_heuristic import ForkCosts, fork_csv
from pipesim.units import GIB, MIB

LAYER_PROFILE = "layer.json"  # where a Table 2 row's `estimate` writes its profile
REPO = Path(__file__).resolve().parents[1]  # where the printed commands run (they name examples/ files)
# NVIDIA's Nemotron-4 340B on 128 H100 80GB as NVIDIA/dgxc-benchmarking ran it (nemotron/README_340b.md: NeMo 24.09,
# bf16, 4.61 s a step; its nemotron4-340b-synth.yaml and configure.sh): t = 8, p = 8, v = 12, micro-batch 1, global
# batch 2 per node (32: m = 16 per pipeline, d = 2), sequence parallelism, selective recomputation, no dropout,
# TransformerEngine's flash attention (NVTE_FUSED_ATTN=0) with 8 query groups, and NeMo's distributed Adam with
# `optim.dtype: bf16` and `grad_sync_dtype: bf16` (`--precision nemo-bf16-adam`). Its squared-ReLU MLP saves what
# the gpt's GELU does (the product's output, 8·sbh/t bytes, and the activation's, 8). Its loss is Megatron-core's
# cross entropy (`--cross-entropy megatron`: NeMo's GPTConfig sets cross_entropy_loss_fusion). Its linear layers have
# no biases (the yaml's `bias: false`, `--no-linear-bias`); its layernorm1p is a LayerNorm (the gpt's default).
NEMOTRON = ["simulate", "--model", "gpt", "--layers", "96", "--width", "18432", "--heads", "96", "--kv-heads", "8",
            "--no-linear-bias",
            "--ffn", "73728", "--seq-len", "4096", "--vocab", "256000", "--dtype", "bf16", "--attention", "flash",
            "-b", "1", "--gpu", "h100-sxm", "--tensor-parallel", "8", "--sequence-parallel", "--recompute",
            "selective", "-p", "8", "-s", "interleaved-1f1b", "--chunks", "12", "-m", "16", "--data-parallel", "2",
            "--sharded-optimizer", "--precision", "nemo-bf16-adam", "--stage-cut", "equal-blocks",
            "--cross-entropy", "megatron"]


# Megatron-LM's 16-bit optimizer, unsharded, over Apex's FusedAdam, replayed by the caching allocator (float32 main
# gradients made each step and freed at the next zero_grad, Adam's moments made at the first step): the optimizer
# every fp16 run of Megatron-LM without a distributed optimizer steps (at de7dc40f88, "scripts for sc21", 2021-08:
# megatron/optimizer/__init__.py wraps Apex's FusedAdam in Float16OptimizerWithFloat16Params under --fp16, whose
# `_copy_model_grads_to_main_grads` makes `grad.float()` and whose zero_grad frees them, optimizer.py).
# Narayanan et al. 2021's Table 1 runs set --fp16 and no distributed optimizer (examples/sc21/CONFIG.sh there;
# Megatron-LM had none in 2021); Korthikanti et al. 2022's ran Megatron-LM in fp16 too (benchmarks/published/
# README.md) without data parallelism (gpus = t·p: nothing to shard the optimizer over); the zero-bubble fork's
# --fp16 (below) likewise. Not NeMo's (Nemotron-4: its distributed Adam, no master copy) nor torchtitan's (FSDP2
# and torch's AdamW).
MEGATRON_OPTIMIZER_STEP = ["--optimizer-step", "megatron"]


def table2() -> list[dict]:
    """Per Table 3 model and Table 2 row: the estimate's bytes per layer against the paper's formula (b = 1)."""
    out = []
    formulas = _rows("korthikanti-2022-table2.csv")
    for run, _ in korthikanti_runs():
        one = Run(run.name, run.layers, run.hidden, run.heads, run.tensor, run.pipeline, 1, 1, 1, 1)
        for formula in formulas:
            t = 1 if formula["tensor_parallel"] == "1" else run.tensor
            sized = Run(one.name, one.layers, one.hidden, one.heads, t, 1, 1, 1, 1, 1)
            args = ["estimate", *sized.estimate_flags(formula["sequence_parallel"] == "true", formula["recompute"]),
                    "--out", LAYER_PROFILE]
            with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
                run_cli(args)
                predicted = json.loads(Path(LAYER_PROFILE).read_text())["layers"][1]["activation_bytes"]
            sbh, scores = SEQ * run.hidden, run.heads * SEQ * SEQ
            published = (sbh * (float(formula["replicated_sbh"]) + float(formula["split_sbh"]) / t)
                         + scores * (float(formula["scores_replicated"]) + float(formula["scores_split"]) / t))
            out.append({"source": "Korthikanti 2022 Table 2", "run": f"{run.name} t={t}: {formula['configuration']}",
                        "unit": "MiB/layer", "predicted": predicted / MIB, "published": published / MIB,
                        "error": predicted / published - 1, "command": command_text(args)})
    return out


def fullest(args: list[str]) -> dict:
    """The fullest device of `pipesim simulate ARGS`: its peak, parts and memory (MiB), and whether any device is
    marked out of memory; and the most any device allocates (MiB), each device's peak less the caching allocator's
    reserve (its replay's max reserved less max allocated): the tensors alone, what the command prints as the peak
    with `--allocator none`, and not always the fullest device's (expandable segments can reserve most on another)."""
    (result,) = json.loads(run_cli([*args, "--json"]))["results"]
    device = max(result["devices"], key=lambda d: d["peak_memory_mb"])
    return {"peak_mib": device["peak_memory_mb"], "parts_mib": device["peak_memory_parts_mb"],
            "limit_mib": device["memory_limit_mb"], "device": device["device"],
            "allocated_mib": max(d["peak_memory_mb"] - d["peak_memory_parts_mb"]["reserve"]
                                 for d in result["devices"]),
            "out_of_memory": any(d["out_of_memory"] for d in result["devices"])}


def error_summary(rows: list[dict], key: str = "error") -> str:
    """The rows' |error| under `key` as the benchmark prints it: median and worst, and over how many rows."""
    errors = [abs(r[key]) for r in rows]
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)} rows"


def measured_runs() -> list[dict]:
    """The configurations published as run: each must fit."""
    runs = [(f"Korthikanti {run.name} {'SP + selective' if sp else 'full recompute'}",
             [*run.simulate_command(sp, how), *MEGATRON_OPTIMIZER_STEP])
            for run, _ in korthikanti_runs() for _, sp, how in KORTHIKANTI_SETTINGS]
    runs += [(f"Megatron {run.name} (t{run.tensor} p{run.pipeline} d{run.data} v{run.chunks})",
              [*run.simulate_command(False, "full"), *MEGATRON_OPTIMIZER_STEP]) for run, _ in megatron_runs()]
    runs.append(("Nemotron-4 340B (NVIDIA, NeMo 24.09)", NEMOTRON))
    return [{"run": name, **fullest(args), "command": command_text(args)} for name, args in runs]


TORCHTITAN_SEQ = 8192  # train_configs/llama3_{8b,70b,405b}.toml at 9dec370, where the page gives no length
TORCHTITAN_MODELS = {"Llama 3.1 8B": "hf:examples/llama3.1-8b", "Llama 3.1 70B": "hf:examples/llama3.1-70b",
                     "Llama 3.1 405B": "hf:examples/llama3.1-405b"}
# The configs whose Float8 runs all-gather the float8 linears' weights in float8 (`--fsdp-float8-all-gather`):
# train_configs/llama3_405b.toml at 9dec370 sets enable_fsdp_float8_all_gather and
# precompute_float8_dynamic_scale_for_fsdp; llama3_8b.toml and llama3_70b.toml set enable_float8_linear = false and
# neither, the page's Float8 runs turning float8 on by flag, and the page does not say they passed the all-gather's:
# torchtitan's default (config_manager.py: store_true, off)
TORCHTITAN_FLOAT8_ALL_GATHER = {"Llama 3.1 405B"}
HF_MAX_POSITIONS = 131072  # the Llama 3.1 configs' max_position_embeddings, which `--model hf:` holds a run to
# The page's GPUs: 96 GB HBM2e H100s at 500 W (docs/performance.md), not the catalogue's 80 GB SXM5; each figure
# and its source in the file.
TORCHTITAN_GPU = ["--gpus", "examples/h100-hbm2e-96gb.toml", "--gpu", "h100-hbm2e-96gb"]
# The page's hosts: 8 H100s each (docs/performance.md), the GPUs one launch of run_llama_train.sh can start
TORCHTITAN_GPUS_PER_HOST = 8


def torchtitan_layout(parallelism: str) -> dict[str, int | str]:
    """A row's parallelism column ("FSDP 4, TP 8, PP 8 (interleaved 1F1B), CP 2") as degrees, the schedule's
    name in its parentheses."""
    layout: dict[str, int | str] = {"FSDP": 1, "TP": 1, "PP": 1, "CP": 1, "schedule": "1F1B"}
    for part in parallelism.split(", "):
        name, _, rest = part.partition(" ")
        degree, _, schedule = rest.partition(" ")
        layout[name] = int(degree)
        if schedule:
            layout["schedule"] = schedule.strip("()")
    return layout


def torchtitan_command(row: dict[str, str]) -> list[str] | None:
    """A torchtitan row as pipesim's command line, built from its columns, nothing fitted; None where pipesim
    cannot express it (a sequence beyond the Hugging Face config's positions). As torchtitan ran them at 9dec370:
    FSDP2 over the C·d ranks (`--zero 3 --precision fsdp2`, its dp_shard_cp mesh), bf16 or Float8 as torchao ran
    it at eab345c, the commit the page names (`--dtype fp8 --fp8-recipe torchao-2024`: float8 copies saved, the
    gradient cast once; the 405B's config all-gathers its float8 linears' weights in
    float8, `--fsdp-float8-all-gather`, `TORCHTITAN_FLOAT8_ALL_GATHER`), TP with its plan's sequence-parallel norms
    as DTensor runs them (`--tp-runtime torch`), its collectives fused with the products where the row ran async
    TP (`--tp-overlap`: torchtitan's `enable_async_tp`, Inductor's micro_pipeline_tp pass; else funcol's, which copy
    each whole tensor once more, planning/estimate.py `Parallelism.collective_copies`) and its loss computed by
    torch's loss_parallel (`--loss-parallel`: ParallelDims.loss_parallel_enabled, TP > 1), the page's local
    batch as micro-batches of the pipeline's default count (pipelining_utils.py `build_pipeline_schedule`:
    `pipeline_parallel_microbatches`, unset, falls back to `pipeline_parallel_degree`, so 8 of 4 samples on 1F1B
    and on interleaved 1F1B alike, whose 2 stages a rank come from `generate_split_points`) or, with no pipeline,
    one micro-batch; selective activation checkpointing is its "op" policy (`--recompute op`), else full; context
    parallelism rotates the keys and values by torch's all-gather (`--cp-rotate allgather`: the page sets no
    rotation, and torchtitan's option, config_manager.py's --experimental.context_parallel_rotate_method, later
    job_config.py's parallelism.context_parallel_rotate_method, defaults to allgather); its grouped keys and values
    copied to every query head before torch's attention (`--repeat-kv`: models/llama/model.py's `repeat_kv`, which
    the flash kernel saves and the context ring gathers so); its MLP's SwiGLU as eager
    ops (`--no-swiglu-fusion`: models/llama3/model.py FeedForward, `w2(F.silu(w1(x)) * w3(x))`, keeps silu's output
    beside the products' outputs; Inductor's fusion is not modelled); a row with torch.compile, its blocks compiled
    inside their checkpoints (`--torch-compile`: what AOTAutograd's partitioner saves); with a pipeline, torch's
    pipelining holds the tensors passed between stages (`--pp-runtime torch`: its stages' receive buffers, outputs
    and input gradients); the caching allocator as the row's launcher set it (`torchtitan_allocator`)."""
    layout = torchtitan_layout(row["parallelism"])
    seq = int(row["sequence_length"] or TORCHTITAN_SEQ)
    if seq > HF_MAX_POSITIONS:
        return None
    t, p, c, d = (int(layout[name]) for name in ("TP", "PP", "CP", "FSDP"))
    chunks = 2 if layout["schedule"] == "interleaved 1F1B" else 1
    microbatches = p
    local_batch = int(row["local_batch_size"])
    float8 = "Float8" in row["techniques"]
    args = ["simulate", "--model", TORCHTITAN_MODELS[row["model"]], "--seq-len", str(seq),
            "--repeat-kv", "--dtype", "fp8" if float8 else "bf16",
            *(["--fp8-recipe", "torchao-2024"] if float8 else []),
            *(["--fsdp-float8-all-gather"] if float8 and row["model"] in TORCHTITAN_FLOAT8_ALL_GATHER else []),
            "--attention", "flash", "-b", str(local_batch // microbatches), *TORCHTITAN_GPU,
            *(["--tensor-parallel", str(t), "--sequence-parallel", "--tp-runtime", "torch", "--loss-parallel",
               *(["--tp-overlap"] if "AsyncTP" in row["techniques"] else [])] if t > 1 else []),
            "-p", str(p), "-m", str(microbatches),
            "-s", "gpipe" if p == 1 else "interleaved-1f1b" if chunks > 1 else "1f1b",
            *(["--chunks", str(chunks)] if chunks > 1 else []), *(["--pp-runtime", "torch"] if p > 1 else []),
            "--data-parallel", str(d),
            *(["--context-parallel", str(c), "--cp-rotate", "allgather"] if c > 1 else []),
            "--zero", "3", "--precision", "fsdp2", "--no-swiglu-fusion",
            "--recompute", "op" if row["activation_checkpointing"] == "selective" else "full",
            *(["--torch-compile"] if "torch.compile" in row["techniques"] else []),
            "--allocator", torchtitan_allocator(int(row["gpus"]))]
    return args


def torchtitan_allocator(gpus: int) -> str:
    """The caching allocator a row of `gpus` ran, as torchtitan's launchers at 9dec370 set it: run_llama_train.sh
    exports PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" (one segment a stream, grown page by page:
    sim/caching_allocator.py `ExpandableSegments`) and starts torchrun on one host, its rendezvous at localhost, so
    only a row of one host's GPUs can have run from it; the multi-host launcher, multinode_trainer.slurm, sets no
    allocator configuration, so a row over several hosts ran the default's rules, as far as the repository says
    (the page does not say how its runs were launched)."""
    return "expandable" if gpus <= TORCHTITAN_GPUS_PER_HOST else "caching"


def torchtitan() -> tuple[list[dict], list[dict]]:
    """torchtitan's rows: every one pipesim expresses, simulated (GiB) with what it does not model (of
    torch.compile, Inductor's fusion of the passes' buffers), and the others with why not; each as max
    reserved, the page's figure, and as max allocated (without the allocator's reserve), to show how much of the
    gap the reserve closes."""
    compared, listed = [], []
    for row in _rows("torchtitan-2024-llama3.csv"):
        run = f"Table {row['table']} {row['model']}, {row['parallelism']}: {row['techniques']}"
        published = float(row["memory_gib"])
        args = torchtitan_command(row)
        if args is None:
            listed.append({"run": run, "published_gib": published,
                           "why_not": f"sequence {row['sequence_length']} beyond the config's {HF_MAX_POSITIONS:,} "
                                      "positions"})
            continue
        with contextlib.chdir(REPO):
            found = fullest(args)
        predicted, allocated = found["peak_mib"] * MIB / GIB, found["allocated_mib"] * MIB / GIB
        unmodelled = ["Inductor's fusion"] if "compile" in row["techniques"] else []
        compared.append({"run": run, "predicted_gib": predicted, "allocated_gib": allocated,
                         "published_gib": published, "error": predicted / published - 1,
                         "allocated_error": allocated / published - 1, "parts_mib": found["parts_mib"],
                         "out_of_memory": found["out_of_memory"], "not_modelled": unmodelled,
                         "command": command_text(args)})
    return compared, listed


# The zero-bubble paper's runs as its Megatron-LM fork launched them when the paper was written
# (sail-sg/zero-bubble-pipeline-parallelism 425b42e5, examples/pretrain_zero_bubble.sh): --fp16 (16-bit gradients,
# float32 master weights and moments, no distributed optimizer), Megatron-LM's default attention (unfused, no
# --use-flash-attn) and dropout (0.1), no tensor or data parallelism, the blocks cut by --allow-padding-num-layers,
# the loss Megatron-LM's vocabulary-parallel cross entropy (`--cross-entropy megatron`), its optimizer Megatron-LM's
# 16-bit one over Apex's FusedAdam (`MEGATRON_OPTIMIZER_STEP`: megatron/optimizer/__init__.py, optimizer.py), its
# attention beside the global memory buffer its CoreAttention keeps (`--scores-buffer`: megatron/model/transformer.py).
# Its SentencePiece tokenizer is not in the repository: Llama's 32,000 pieces are taken, which size only the
# first stage's embedding and the last's head. ZB-1p and ZB-2p run the order the fork's own scheduler builds
# (schedules/zb_heuristic.py: its auto_schedule.py's heuristic under --zero-bubble-max-pending-backward p and 2p),
# from the costs the paper fed it (Table 9, zero_bubble_paper.json), written as torch schedule CSVs to ORDERS and run
# with --schedule-file: pipesim's handcrafted ZB-H2 holds 2(p - k) - 1 forwards and 2k deferred W's on stage k,
# where the fork's order holds as many of both as its limit of 2p micro-batches leaves room for.
ZERO_BUBBLE_VOCAB = 32000
ZERO_BUBBLE_SCHEDULES = {"1F1B": "1f1b", "1F1B-I": "interleaved-1f1b"}
ZERO_BUBBLE_LIMITS = {"ZB-1p": 1, "ZB-2p": 2}  # --zero-bubble-max-pending-backward, in multiples of p
ZERO_BUBBLE_COSTS = Path(__file__).resolve().parent / "zero_bubble_paper.json"  # Table 9: the scheduler's inputs
ORDERS = Path("benchmarks") / "published" / "zero-bubble-2024-orders"  # from REPO, where the commands run


def zero_bubble_csv(row: dict[str, str]) -> str:
    """A ZB-1p or ZB-2p row's order as a torch schedule CSV, as the fork's scheduler builds it from the row's Table 9
    costs (the medians it profiled: F, B, W and the transfer) under the row's memory limit: the one build that the
    benchmark writes and tests/test_published_memory.py holds the committed orders to."""
    stages, microbatches = int(row["gpus"]), int(row["microbatches"])
    (costs,) = [c for c in json.loads(ZERO_BUBBLE_COSTS.read_text())["rows"]
                if (c["model"], c["p"], c["m"]) == (row["model"], stages, microbatches)]
    return fork_csv(stages, microbatches, ForkCosts.from_ms(costs["fwd_ms"], costs["igrad_ms"], costs["wgrad_ms"],
                                                           costs["comm_ms"]),
                    ZERO_BUBBLE_LIMITS[row["schedule"]] * stages)


def zero_bubble_order(row: dict[str, str]) -> Path:
    """Where a ZB-1p or ZB-2p row's order is (from REPO), written there (`zero_bubble_csv`)."""
    path = ORDERS / f"{row['model']}-{row['schedule']}-m{row['microbatches']}.csv"
    (REPO / path).parent.mkdir(parents=True, exist_ok=True)
    (REPO / path).write_text(zero_bubble_csv(row))
    return path


def zero_bubble_command(row: dict[str, str]) -> list[str]:
    """A row of the zero-bubble paper's Table 4 as pipesim's command line; 1F1B-I with one block per chunk, as the
    paper ran it, the blocks padded to chunks of the p stages (the fork's `get_offset`); ZB-1p and ZB-2p as the
    fork's scheduler ordered them (`zero_bubble_order`), its step run twice as `--schedule` runs the other rows'
    flushing methods (simulate's default N), so the caching allocator's reserve is the second step's, as it stands
    for the rest of the run."""
    layers, stages = int(row["layers"]), int(row["gpus"])
    if row["schedule"] in ZERO_BUBBLE_LIMITS:
        order = ["--schedule-file", str(zero_bubble_order(row)), "--minibatches", "2"]
    else:
        schedule = ZERO_BUBBLE_SCHEDULES[row["schedule"]]
        chunks = ["--chunks", str(-(-layers // stages))] if schedule == "interleaved-1f1b" else []
        order = ["-p", str(stages), "-m", row["microbatches"], "-s", schedule, *chunks]
    return ["simulate", "--model", "gpt", "--layers", row["layers"], "--width", row["hidden_size"], "--heads",
            row["attention_heads"], "--seq-len", row["sequence_length"], "--vocab", str(ZERO_BUBBLE_VOCAB),
            "--dropout", "0.1", "--dtype", "fp16", "--attention", "math", "-b", row["microbatch_size"],
            "--scores-buffer", "--gpu", "a100-sxm-80gb", *order, "--stage-cut", "padded-blocks", "--cross-entropy",
            "megatron", *MEGATRON_OPTIMIZER_STEP]


def zero_bubble() -> list[dict]:
    """Table 4's memory per model and schedule (the same at each of its three micro-batch counts, so simulated at
    the fewest), the fullest device's peak in GiB (Megatron-LM's report_memory divides by 1024²) against it, as
    max reserved (the caching allocator's reserve in) and as max allocated (without it): the fork's report_memory
    (megatron/utils.py at 425b42e5, the one memory report it has) prints both, and the paper does not say which
    its column is."""
    out = []
    for row in _rows("zero-bubble-2024-table4.csv"):
        run = f"{row['model']} {row['schedule']}"
        if any(r["run"] == run for r in out):
            continue
        args = zero_bubble_command(row)
        with contextlib.chdir(REPO):
            found = fullest(args)
        predicted, allocated = found["peak_mib"] * MIB / GIB, found["allocated_mib"] * MIB / GIB
        published = float(row["memory_gb"])
        out.append({"run": run, "predicted_gib": predicted, "allocated_gib": allocated, "published_gib": published,
                    "error": predicted / published - 1, "allocated_error": allocated / published - 1,
                    "command": command_text(args)})
    return out


def print_rows(found: dict[str, list[dict]], console: Console = stdout) -> None:
    """Each source's rows as a table (commands/tables.py: at the terminal's width nothing cut, piped one line a row),
    each with its |error|, then each row's command, one line piped, on a terminal wrapped between words, where the
    first two tables were fixed-width rows (120 and 220 columns) that a terminal of 80 wrapped, figures under their
    row's name and a flag split in two. `found`: the rows as benchmarks/published_memory.json holds them."""
    compared, ran, titan, listed, bubble = (found[key] for key in (
        "table2", "measured_running", "torchtitan", "torchtitan_not_modelled", "zero_bubble"))

    def say(text: str) -> None:
        print_message(text, console)

    table = Table(title="Korthikanti 2022 Table 2 (MiB per layer)", caption=f"|error|: {error_summary(compared)}")
    for name, justify in (("run", "left"), ("pipesim", "right"), ("paper", "right"), ("error", "right")):
        table.add_column(name, justify=justify)
    for r in compared:
        table.add_row(r["run"], f"{r['predicted']:.1f}", f"{r['published']:.1f}", f"{r['error']:+.1%}")
    print_table(table, console)
    console.print()
    table = Table(title="Measured running (MiB)",
                  caption=f"marked out of memory: {sum(r['out_of_memory'] for r in ran)} of {len(ran)}")
    for name, justify in (("run", "left"), ("peak", "right"), ("of", "right"), ("fits", "left"),
                          ("parts at the peak", "left")):
        table.add_column(name, justify=justify)
    for r in ran:
        parts = ", ".join(f"{name} {mib:,.0f}" for name, mib in r["parts_mib"].items())
        table.add_row(r["run"], f"{r['peak_mib']:,.0f}", f"{r['limit_mib']:,.0f}",
                      "OOM" if r["out_of_memory"] else "yes", f"device {r['device']}: {parts}")
    print_table_last_below(table, [r["run"] for r in ran], console)
    console.print()
    table = Table(title="torchtitan (pipesim's max reserved against the page's, GiB)")
    for name, justify in (("run", "left"), ("pipesim", "right"), ("page", "right"), ("error", "right"),
                          ("not modelled", "left")):
        table.add_column(name, justify=justify)
    for r in titan:
        table.add_row(r["run"], f"{r['predicted_gib']:.1f}", f"{r['published_gib']:.1f}", f"{r['error']:+.1%}",
                      ", ".join(r["not_modelled"]))
    print_table(table, console)
    eager = ", ".join(f"{r['error']:+.1%}" for r in titan if not r["not_modelled"])
    say(f"|error|: {error_summary(titan)} (the rows without torch.compile: {eager})")
    worst = max(titan, key=lambda r: abs(r["allocated_error"]))
    under = sum(r["allocated_error"] < 0 for r in titan)
    say(f"|error| as max allocated (the tensors alone, each command's peak with --allocator none): "
         f"{error_summary(titan, 'allocated_error')}, {under} of {len(titan)} under the page; the worst "
         f"{worst['run']}: {worst['allocated_gib']:.1f} GiB against {worst['published_gib']:.1f} "
         f"({worst['allocated_error']:+.1%})")
    say("Like with like: the page's memory is torch.cuda.max_memory_reserved (torchtitan's DeviceMemoryMonitor), "
         "pipesim's the tensors at the peak, the running pass's transient ones included, and the caching "
         "allocator's reserve (its replay's max reserved less max allocated). Parts at each row's peak (MiB):")
    for r in titan:
        say(f"  {r['run']}: " + ", ".join(f"{name} {mib:,.0f}" for name, mib in r["parts_mib"].items()))
    over = [r["run"] for r in titan if r["out_of_memory"]]
    say(f"marked out of memory on the page's 96 GB HBM2e H100s (examples/h100-hbm2e-96gb.toml), though each ran: "
         f"{len(over)} of {len(titan)} rows{': ' if over else ''}{'; '.join(over)}")
    for r in listed:
        say(f"  not simulated: {r['run']}: {r['published_gib']} GiB; {r['why_not']}")
    table = Table(title="zero-bubble (Qi et al. 2024) Table 4: peak memory on A100 80GB (GiB), pipesim's max "
                        "reserved and max allocated")
    for name, justify in (("run", "left"), ("reserved", "right"), ("allocated", "right"), ("paper", "right"),
                          ("error", "right"), ("allocated", "right")):
        table.add_column(name, justify=justify)
    for r in bubble:
        table.add_row(r["run"], f"{r['predicted_gib']:.1f}", f"{r['allocated_gib']:.1f}", f"{r['published_gib']:.0f}",
                      f"{r['error']:+.1%}", f"{r['allocated_error']:+.1%}")
    print_table(table, console)
    for name, key in (("max reserved", "error"), ("max allocated", "allocated_error")):
        say(f"|error| as {name}: {error_summary(bubble, key)}")
    say("the fork's report_memory prints max allocated and max reserved alike; the paper does not say which its "
         "column is")
    say("\nEach row's command:")
    for r in compared + ran + titan + bubble:
        say(f"{r['run']}:")
        say(f"  {r['command']}")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    compared, ran, (titan, listed), bubble = table2(), measured_runs(), torchtitan(), zero_bubble()
    found = {"table2": compared, "measured_running": ran, "torchtitan": titan, "torchtitan_not_modelled": listed,
             "zero_bubble": bubble}
    print_rows(found)
    write_json(args.json, found)


if __name__ == "__main__":
    main()
