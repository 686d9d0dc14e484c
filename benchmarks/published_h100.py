"""NVIDIA's published dense H100 step times (benchmarks/published/nvidia-dgxc-h100.csv: GPT-3 175B, Nemotron-4 15B
and 340B, Llama 3.1 8B, 70B and 405B, BF16 and FP8, 8 to 2,304 GPUs) predicted by a pipesim command line each,
nothing fitted.

Each row's `pipesim simulate` command is built from the row's own columns as NeMo ran it (its launcher's config,
benchmarks/published/README.md): Megatron-core's GPT with TransformerEngine (its linear layers, `--linear-kernel
te`; flash attention, sequence parallelism and the tensor-parallel collectives overlapped with the products,
`--tp-overlap`, where t > 1, the
forward's pipelined reduce-scatters without TransformerEngine's SM margin, `--tp-overlap-no-margin`, where the
run's config left it at TransformerEngine 1.x's default, and with float8 outputs, `--tp-overlap-fp8-buf`, where the
run's config sets `fp8_buf` for them; context parallelism where the row has it, its ring
TransformerEngine's, `--cp-rotate p2p`: Megatron-core's default cp_comm_type; the fused attention kernel its
environment picks, `--attention-kernel`; the rotary position embedding of the rows that have it, `--rotary-percent`,
run as TransformerEngine's fused kernel, `--rope-kernel fused`: every such yaml sets `apply_rope_fusion: true`; no
linear biases where the config sets `bias: false`, `--no-linear-bias`, and RMSNorm where it sets `normalization:
rmsnorm`, `--norm rmsnorm`: the CSV's `linear_bias` and `normalization`), the
recomputation the row's config runs (`--recompute selective` for Nemotron-4 340B), the pipeline's exchanges beside
the compute (`overlap_p2p_comm`) or, where the row's config batches them instead (the CSV's `p2p_overlap` false),
each waited on before the compute goes on (`--blocking-comm`: Megatron-core's `_communicate` with `batch_p2p_comm`
waits every request of the step's one batched exchange), the distributed optimizer
(`--zero 1`; its gradients held and reduced as the row's optimizer holds them, `precision`) with its gradient
reduce-scatter overlapped with the
backward (each stage's right after its last backward) and its collectives grouped as the row's optimizer groups
them (`--optimizer-buckets`, the CSV's `optimizer_buckets`: nemo for NeMo's distributed Adam, megatron for
Megatron-core's), interleaved 1F1B where the row has virtual stages, the
vocabulary padded as Megatron pads it and its loss Megatron-core's cross entropy (`--cross-entropy megatron`: NeMo's
GPTConfig sets cross_entropy_loss_fusion; fused or not, its backward turns the kept softmax into the gradient in
place), FP8 as TransformerEngine's delayed scaling (`--dtype fp8`, the `te` recipe) with the weights kept as
TransformerEngine's float8 tensors and all-gathered so by NeMo's distributed Adam (`--fp8-param-gather`: every FP8
run sets `fp8_params`, benchmarks/published/README.md), each backward's weight gradients accumulated inside
TransformerEngine's weight-gradient products (`--grad-accumulation fused`: every row's yaml sets
`gradient_accumulation_fusion: true`, benchmarks/published/README.md). The command is printed and run as written
(in-process, with --json added to read its ms/step).

A second source, benchmarks/published/nemo-perf-summary-h100.csv (NeMo's performance summary, NeMo 24.07 on
DGX-H100, FP8, in tokens/s per GPU), is run the same way and printed as its own table: its columns say where a
row's settings depart from those above (`tp_overlap`, `fp8_params`, `rope_fusion`, `grad_sync_dtype`, `p2p_overlap`),
read from the launcher's config and H100 FP8 example command for its model or, where their layout is not the table's,
from the nearest source that has it (`settings_source`; benchmarks/published/README.md); the published step is its
tokens a step over the row's GPUs at the printed rate. Its three tables print the same 12 configurations
re-measured (each table a row set): the median is printed over all 36 rows and over the latest table's 12 alone.

    python benchmarks/published_h100.py                 # the tables, then each row's command
    python benchmarks/published_h100.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from one_line_parser import OneLineParser  # this folder's
from published_runs import _rows, command_text, iteration_ms
from rich.console import Console
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_message, print_table

SOURCE = "nvidia-dgxc-h100.csv"
NEMO_SUMMARY = "nemo-perf-summary-h100.csv"
NEMO_SUMMARY_LATEST = "8e3d65dcfe"  # the summary's last table on NeMo's main (2024-09-09, "24.07 perf numbers")
GPU = "h100-sxm"
VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by, as NeMo's configs set it


def padded_vocab(vocab: int, tensor: int) -> int:
    """The vocabulary Megatron builds: padded to a multiple of 128·t (megatron/training/tokenizer's
    `_vocab_size_with_padding`), so the output layer splits evenly over the t ranks."""
    multiple = VOCAB_MULTIPLE * tensor
    return math.ceil(vocab / multiple) * multiple


def precision(row: dict[str, str]) -> list[str]:
    """The row's --precision. NeMo's distributed Adam (`optimizer_buckets` nemo: `distributed_fused_adam`), with
    `grad_sync_dtype: bf16` in every dgxc yaml that runs it (gpt3_175b_hydra.yaml, llama3.1_*.yaml,
    nemotron4-340b-synth.yaml at 143b90dd91, 0b71cfda51 and 35a9aecc8d), accumulates and reduce-scatters the
    gradients in bf16: Apex's contiguous grad buffers are of grad_sync_dtype
    (apex/contrib/optimizers/distributed_fused_adam.py `_init_grad_buffer` at 6424da3b) and NeMo hands their views
    out as the weights' main_grad (nemo/core/optim/distributed_adam.py `MegatronDistributedFusedAdam.zero_grad` at
    v2.0.0): with its float32 state and master copy megatron-16bit-grads, with `dtype: bf16` nemo-bf16-adam.
    Megatron-core's distributed optimizer (`optimizer_buckets` megatron, `mcore_distributed_optim` with no
    grad_sync_dtype) reduces float32 main gradients (NeMo's `setup_mcore_distributed_parallel`: grad_reduce_in_fp32
    unless grad_sync_dtype says otherwise, megatron_gpt_model.py at v2.1.0): the default, megatron."""
    if row["optimizer_state"] == "bf16":
        return ["--precision", "nemo-bf16-adam"]
    if row.get("grad_sync_dtype") == "fp32":  # none named: Apex's default, its `dtype`, float32
        return []
    return ["--precision", "megatron-16bit-grads"] if row["optimizer_buckets"] == "nemo" else []


def simulate_command(row: dict[str, str]) -> list[str]:
    """The row's step as NeMo ran it (see the module docstring), from the row's columns alone."""
    t, p, v, c, gpus, batch, b = (int(row[k]) for k in (
        "tensor_parallel", "pipeline_parallel", "virtual_pipeline", "context_parallel", "gpus", "global_batch",
        "microbatch_size"))
    d = gpus // (t * p * c)
    schedule = ["-s", "interleaved-1f1b", "--chunks", str(v)] if v > 1 else ["-s", "1f1b"]
    if p > 1 and row["p2p_overlap"] == "false":
        schedule.append("--blocking-comm")
    overlap = ["--tp-overlap", *(["--tp-overlap-no-margin"] if row["tp_overlap_sm_margin"] == "false" else []),
               *(["--tp-overlap-fp8-buf"] if row["tp_overlap_fp8_buf"] == "true" else [])]
    tensor = ["--tensor-parallel", str(t), "--sequence-parallel",
              *(overlap if row.get("tp_overlap", "true") == "true" else [])] if t > 1 else []
    rope = "fused" if row.get("rope_fusion", "true") == "true" else "eager"
    fp8_params = row["precision"] == "fp8" and row.get("fp8_params", "true") == "true"
    return ["simulate", "--model", "gpt", "--layers", row["layers"], "--width", row["hidden"], "--ffn",
            row["ffn_hidden"], "--heads", row["heads"], "--kv-heads", row["kv_heads"],
            *(["--gated"] if row["gated"] == "true" else []),
            *(["--no-linear-bias"] if row["linear_bias"] == "false" else []),
            *(["--norm", "rmsnorm"] if row["normalization"] == "rmsnorm" else []),
            *(["--rotary-percent", row["rotary_percent"], "--rope-kernel", rope] if row["rotary_percent"] else []),
            "--seq-len", row["seq_len"],
            "--vocab", str(padded_vocab(int(row["vocab"]), t)),
            *(["--dropout", row["dropout"]] if float(row["dropout"]) else []),
            "--dtype", row["precision"], *(["--fp8-param-gather"] if fp8_params else []),
            "--linear-kernel", "te",
            "--attention", "flash", "--attention-kernel", row["attention_kernel"],
            "-b", str(b), "--gpu", GPU, *tensor,
            *(["--context-parallel", str(c), "--cp-rotate", "p2p"] if c > 1 else []), "-p", str(p),
            "-m", str(batch // (d * b)),
            *schedule, "--data-parallel", str(d), "--zero", "1", "--optimizer-buckets", row["optimizer_buckets"],
            "--grad-accumulation", "fused",
            *precision(row),
            *(["--recompute", row["recompute"]] if row["recompute"] != "none" else []),
            "--stage-cut", "equal-blocks", "--cross-entropy", "megatron"]


def published_step_s(row: dict[str, str]) -> float:
    """The row's published step: as printed, or its global batch's tokens over its GPUs at the printed rate."""
    if "step_s" in row:
        return float(row["step_s"])
    tokens = int(row["global_batch"]) * int(row["seq_len"])
    return tokens / (int(row["gpus"]) * float(row["tokens_per_s_gpu"]))


def rows(source: str = SOURCE) -> list[dict]:
    """Every row of `source`: its command, the predicted and the published step in seconds, and the error."""
    out = []
    for row in _rows(source):
        args = simulate_command(row)
        predicted_s = iteration_ms(args) / 1e3
        published_s = published_step_s(row)
        layout = tuple(v for k, v in row.items() if k not in ("gpus", "global_batch", "step_s"))
        release = f" ({row['commit'][:7]})" if "commit" in row else ""
        run = f"{row['model']} {row['precision'].upper()} {row['gpus']} GPUs{release}"
        out.append({"run": run, "model": row["model"],
                    "precision": row["precision"], "gpus": int(row["gpus"]), "layout": layout,
                    "predicted_s": predicted_s,
                    "published_s": published_s, "error": predicted_s / published_s - 1,
                    "command": command_text(args)})
    return out


def scaling(compared: list[dict]) -> list[str]:
    """Per run that only its data-parallel degree varies in (the same model, precision and layout per replica):
    the step's rise from its fewest GPUs to its most, measured against predicted, one line each."""
    families: dict[tuple, list[dict]] = {}
    for r in compared:
        families.setdefault(r["layout"], []).append(r)
    lines = []
    for runs in families.values():
        if len(runs) > 1:
            first, last = min(runs, key=lambda r: r["gpus"]), max(runs, key=lambda r: r["gpus"])
            lines.append(f"{first['model']} {first['precision'].upper()} {first['gpus']}->{last['gpus']} GPUs: "
                         f"measured {last['published_s'] / first['published_s'] - 1:+.1%}, "
                         f"predicted {last['predicted_s'] / first['predicted_s'] - 1:+.1%}")
    return lines


def summary(compared: list[dict]) -> str:
    """|error|'s median and worst over the rows, one line."""
    errors = [abs(r["error"]) for r in compared]
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} rows"


def print_step_table(title: str, compared: list[dict], console: Console = stdout) -> None:
    """The rows' predicted and published step (s) and error as one table (`main` prints one a source)."""
    table = Table(title=title)
    for name, justify in (("run", "left"), ("predicted s", "right"), ("published s", "right"), ("error", "right")):
        table.add_column(name, justify=justify)
    for r in compared:
        table.add_row(r["run"], f"{r['predicted_s']:.3f}", f"{r['published_s']:.3f}", f"{r['error']:+.1%}")
    print_table(table, console)


def print_rows(compared: list[dict], summary_rows: list[dict], console: Console = stdout) -> None:
    """DGX Cloud's rows and NeMo's summary's, each as a table (`print_step_table`) with its |error|, the steps' rise
    and each row's command, every line whole piped and on a terminal wrapped between words (`print_message`), where
    a terminal of 80 columns broke a command inside a flag. The rows as `rows` gives them (their `layout` for
    `scaling`)."""
    print_step_table(f"Step time on {GPU}: predicted against NVIDIA's published (s)", compared, console)
    lines = [f"{precision.upper()} |error|: {summary([r for r in compared if r['precision'] == precision])}"
             for precision in dict.fromkeys(r["precision"] for r in compared)]
    lines += [f"all |error|: {summary(compared)}",
              "\nThe step from the fewest GPUs to the most (the data-parallel degree alone grows):", *scaling(compared),
              "\nEach row's command (its ms/step / 1000 is the predicted s):"]
    print_message("\n".join(lines + [f"{r['run']}:\n  {r['command']}" for r in compared]), console)
    console.print()
    print_step_table(f"Step time on {GPU}: predicted against NeMo 24.07's performance summary (s, from tokens/s)",
                     summary_rows, console)
    latest = [r for r in summary_rows if r["run"].endswith(f"({NEMO_SUMMARY_LATEST[:7]})")]
    lines = [f"NeMo performance summary |error|: {summary(summary_rows)} (3 tables, the same 12 configurations)",
             f"NeMo performance summary, latest table ({NEMO_SUMMARY_LATEST}) |error|: {summary(latest)}",
             "\nEach row's command (its ms/step / 1000 is the predicted s):"]
    print_message("\n".join(lines + [f"{r['run']}:\n  {r['command']}" for r in summary_rows]), console)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    compared, summary_rows = rows(), rows(NEMO_SUMMARY)
    print_rows(compared, summary_rows)
    write_json(args.json, {"gpu": GPU, "rows": [{k: v for k, v in r.items() if k != "layout"} for r in compared],
                           "nemo_summary_rows": [{k: v for k, v in r.items() if k != "layout"} for r in summary_rows]})


if __name__ == "__main__":
    main()
