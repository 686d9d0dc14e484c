"""Every published run of benchmarks/published/ (the papers' tables) predicted on a100-sxm-80gb by a pipesim command
line, nothing fitted.

Each row's command is built as text, printed, and run as written (in-process, with --json added to read its
figure). Per row: the GPT counted by torch on the meta device at the run's micro-batch size (fp16, the scores
materialised as Megatron-LM ran them, its 0.1 dropouts), estimated per GPU for its t, p, d and recomputation,
cut into p (or p·v, interleaved) stages of equal blocks (`--stage-cut equal-blocks`: the embedding with the
first, the head with the last, as Megatron-LM places them), then simulated (1F1B or interleaved 1F1B; sends
blocking as Megatron-LM's p2p waits, `--blocking-comm`, and the device synchronised after each exchange as its
`_communicate` did, `--p2p-sync`, where pipesim models it: 1F1B over two stages or more; the data-parallel
all-reduce a REDUCE row on the
network, every chunk's after the pipeline has flushed as Megatron-LM's DDP runs it, `--reduce-after-flush`)
and compared:

- Korthikanti et al. 2022, Table 5: iteration seconds (`simulate`'s ms/step), full recomputation, and
  sequence parallelism with selective recomputation;
- Korthikanti et al. 2022, Table 4: one layer of the 22B model (t = 8), forward and backward ms (`estimate
  --out`'s profile, its layers[1]);
- Narayanan et al. 2021 (Megatron-LM), Table 1: TFLOP/s per GPU by the paper's Eq. 3 (which counts the
  recomputed forward) from the predicted iteration time.

    python benchmarks/published_runs.py                 # the table, then each row's command
    python benchmarks/published_runs.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shlex
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.table import Table

from pipesim.cli import main as pipesim
from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_message, print_table
from pipesim.schedules import METHODS

try:  # the tests import this file as benchmarks.published_runs; run as a script, this folder is on sys.path
    from .one_line_parser import OneLineParser
except ImportError:
    from one_line_parser import OneLineParser

PUBLISHED = Path(__file__).resolve().parent / "published"  # the papers' tables; README.md there says how to read them
SEQ, VOCAB = 2048, 51200
DROPOUT = 0.1  # Megatron-LM's GPT default (--attention-dropout, --hidden-dropout), as both papers ran
GPU = "a100-sxm-80gb"
LAYER_PROFILE = "layer.json"  # where a layer row's `estimate` writes its profile


@dataclass(frozen=True)
class Run:
    """One published configuration: the model, its parallelism and schedule."""

    name: str
    layers: int
    hidden: int
    heads: int
    tensor: int
    pipeline: int
    data: int
    microbatch_size: int
    microbatches: int
    chunks: int  # v: model chunks per device (1: plain 1F1B)

    def estimate_flags(self, sequence_parallel: bool, recompute: str) -> list[str]:
        """The model as both papers ran it, on the part, parallelised: what `estimate` and `simulate` share."""
        return ["--model", "gpt", "--layers", str(self.layers), "--width", str(self.hidden), "--heads",
                str(self.heads), "--seq-len", str(SEQ), "--vocab", str(VOCAB), "--dropout", str(DROPOUT),
                "-b", str(self.microbatch_size), "--dtype", "fp16", "--gpu", GPU,
                "--tensor-parallel", str(self.tensor), *(["--sequence-parallel"] if sequence_parallel else []),
                "--recompute", recompute]

    def simulate_command(self, sequence_parallel: bool, recompute: str) -> list[str]:
        """One iteration of the run as Megatron-LM trains it (see the module docstring). Megatron-LM of 2021-2022
        called torch.cuda.synchronize() after every exchange between stages, unconditionally ("to protect against
        race condition when using batch_isend_irecv()": megatron/p2p_communication.py `_communicate` from
        78cf869fc2, March 2021, on; at cbad126a84 and cfd2e21607, April 2022), interleaved too; pipesim models it
        for 1F1B only (`Method.p2p_sync`: the interleaved schedule synchronises after each forward-backward pair)."""
        schedule = megatron_schedule(self.chunks)
        data = ["--data-parallel", str(self.data), "--reduce-after-flush"] if self.data > 1 else []
        return ["simulate", *self.estimate_flags(sequence_parallel, recompute), "-p", str(self.pipeline),
                "-m", str(self.microbatches), *data, *schedule, "--blocking-comm",
                *p2p_sync(schedule, self.pipeline), "--stage-cut", "equal-blocks"]


def megatron_schedule(chunks: int) -> list[str]:
    """Megatron's schedule for `chunks` model chunks per device: 1F1B, or its interleaved schedule past one."""
    return ["-s", "interleaved-1f1b", "--chunks", str(chunks)] if chunks > 1 else ["-s", "1f1b"]


def p2p_sync(schedule: list[str], pipeline: int) -> list[str]:
    """`--p2p-sync` for a Megatron run of `schedule` (`megatron_schedule`) whose device synchronises after each
    exchange, where pipesim models that for the schedule's method (`Method.p2p_sync`) and there are stages to
    exchange between (`pipeline` > 1)."""
    return ["--p2p-sync"] if pipeline > 1 and METHODS[schedule[1]].p2p_sync else []


def command_text(args: list[str]) -> str:
    return shlex.join(["pipesim", *args])


def run_cli(args: list[str]) -> str:
    """`pipesim ARGS`, in-process: its stdout; a failure raises with its error line."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            pipesim(args)
        except SystemExit as exc:
            if exc.code:
                raise RuntimeError(f"{command_text(args)} exited {exc.code}: {err.getvalue().strip()}") from None
    return out.getvalue()


def iteration_ms(args: list[str]) -> float:
    """The simulated iteration (a mini-batch's m micro-batches, its all-reduce and the optimizer step, in steady
    state) of `pipesim simulate ARGS`: its ms/step."""
    (result,) = json.loads(run_cli([*args, "--json"]))["results"]
    return result["time_per_minibatch_ms"]


def _rows(name: str) -> list[dict[str, str]]:
    with (PUBLISHED / name).open() as f:
        return list(csv.DictReader(f))


def korthikanti_runs() -> list[tuple[Run, dict[str, str]]]:
    """Korthikanti et al.'s Table 3 runs, each with its row."""
    out = []
    for row in _rows("korthikanti-2022.csv"):
        t, p, gpus, batch, b = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "gpus", "global_batch",
                                                        "microbatch_size"))
        out.append((Run(row["model"], int(row["layers"]), int(row["hidden"]), int(row["heads"]), t, p, gpus // (t * p),
                        b, batch // (gpus // (t * p) * b), int(row["interleaved_stages"] or 1)), row))
    return out


KORTHIKANTI_SETTINGS = (("iteration_s_full_recompute", False, "full"),  # Table 5's columns: SP, recompute
                        ("iteration_s_sequence_parallel_selective_recompute", True, "selective"))


def korthikanti() -> list[dict]:
    out = []
    for run, row in korthikanti_runs():
        for column, sp, recompute in KORTHIKANTI_SETTINGS:
            args = run.simulate_command(sp, recompute)
            ms = iteration_ms(args)
            out.append(_row(f"Korthikanti {run.name} {'SP + selective' if sp else 'full recompute'}", "s", ms / 1e3,
                            float(row[column]), args, ms))
    return out


def korthikanti_layer() -> list[dict]:
    run = Run("22B", 48, 6144, 64, 8, 1, 1, 4, 1, 1)
    settings = {"baseline no recompute": (False, "none"), "sequence parallelism": (True, "none"),
                "baseline with full recompute": (False, "full"), "selective recompute": (False, "selective"),
                "selective recompute + sequence parallelism": (True, "selective")}
    out = []
    for row in _rows("korthikanti-2022-layer.csv"):
        args = ["estimate", *run.estimate_flags(*settings[row["experiment"]]), "--out", LAYER_PROFILE]
        with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
            run_cli(args)
            layer = json.loads(Path(LAYER_PROFILE).read_text())["layers"][1]  # the first block
        for name, key in (("forward", "fwd"), ("backward", "bwd")):
            ms = layer[key]["median_ms"]
            out.append(_row(f"Korthikanti layer {row['experiment']}: {name}", "ms", ms, float(row[f"{name}_ms"]),
                            args, ms))
    return out


def megatron_runs() -> list[tuple[Run, dict[str, str]]]:
    """Narayanan et al.'s Table 1 runs (full recomputation), each with its row."""
    out = []
    for row in _rows("megatron-2021-table1.csv"):
        t, p, gpus, batch, b, layers, hidden = (int(row[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "gpus", "global_batch", "microbatch_size", "layers", "hidden"))
        d = gpus // (t * p)
        per_virtual = row["layers_per_virtual_stage"]
        chunks = layers // p // int(per_virtual) if per_virtual else 1
        out.append((Run(f"{row['params_billion']}B", layers, hidden, int(row["heads"]), t, p, d, b, batch // (d * b),
                        chunks), row))
    return out


def megatron() -> list[dict]:
    out = []
    for run, row in megatron_runs():
        t, p, d, gpus, batch = run.tensor, run.pipeline, run.data, int(row["gpus"]), int(row["global_batch"])
        layers, hidden, chunks = run.layers, run.hidden, run.chunks
        args = run.simulate_command(False, "full")
        ms = iteration_ms(args)
        flops = 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
        out.append(_row(f"Megatron {run.name} (t{t} p{p} d{d} v{chunks})", "TFLOP/s/GPU",
                        flops / (ms / 1e3 * gpus) / 1e12, float(row["tflops_per_gpu"]), args, ms))
    return out


def _row(name: str, unit: str, predicted: float, published: float, args: list[str], command_ms: float) -> dict:
    """A compared row; `command_ms`: the figure its command printed (ms/step, or the layer's ms)."""
    return {"run": name, "unit": unit, "predicted": predicted, "published": published,
            "error": predicted / published - 1, "command": command_text(args), "command_ms": command_ms}


def print_rows(rows: list[dict]) -> None:
    """The compared rows as a table (commands/tables.py: at the terminal's width nothing cut, piped whole rows), then
    each row's command, one line piped, on a terminal wrapped between words (it printed 114-column rows and
    commands that a terminal broke inside a flag)."""
    errors = [abs(r["error"]) for r in rows]
    table = Table(box=box.SIMPLE_HEAD, caption_justify="left",
                  caption=f"|error|: median {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)} "
                          f"rows (within 10 %: {sum(e <= 0.10 for e in errors)})")
    for header in ("run", "unit", "predicted", "published", "error"):
        table.add_column(header, justify="left" if header in ("run", "unit") else "right")
    for r in rows:
        table.add_row(r["run"], r["unit"], f"{r['predicted']:.2f}", f"{r['published']:.2f}", f"{r['error']:+.1%}")
    print_table(table)
    print_message("\nEach row's command (s: its ms/step; layer rows: the profile's layers[1]; TFLOP/s: Eq. 3 of "
                  "ms/step):", stdout)
    for command in dict.fromkeys(r["command"] for r in rows):
        print_message(f"{', '.join(r['run'] for r in rows if r['command'] == command)}:", stdout)
        print_message(f"  {command}", stdout)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    rows = korthikanti() + korthikanti_layer() + megatron()
    print_rows(rows)
    write_json(args.json, {"gpu": GPU, "rows": rows})


if __name__ == "__main__":
    main()
