"""How much longer a stage's forward and backward take right after the process slept, against back to back.

A rank that waits for a message idles, and on a shared machine its caches are not its own while it does: the
fidelity report finds ops right after a wait of 0.5 ms or more 5-6 % longer than the rest of their run. This
times the calibrated model's stages as the executor computes them (`calibrate.passes.stage_runs`), one thread,
in rounds that interleave every context (so a slow spell of the machine spreads over all of them): an F, and
a B, right after the same stage's work (back to back), and right after sleeping each of WAITS_MS. Printed per
stage and context: the median F and B over `--repeats` repeats, their ratio to back to back, and the spread of
that ratio over the repeats (max - min: the noise floor). No assertion: the figures are the result.

    python benchmarks/cold_after_wait.py                  # mlp 8x512, b=32, cut in 2 stages, 3 x 100 rounds
    python benchmarks/cold_after_wait.py --rounds 200 --repeats 5
"""

from __future__ import annotations

import time

import numpy as np
import torch
from one_line_parser import OneLineParser, positive_int  # this folder's
from rich.table import Table

from pipesim.calibrate.measure import DTYPES, Settings, measure_bytes
from pipesim.calibrate.passes import StageRun, stage_runs
from pipesim.commands.tables import print_table
from pipesim.units import degree_text
from pipesim.workload.models import build_model

WAITS_MS = (0.2, 1.0, 5.0)
WARMUP_ROUNDS = 10


def _ms(fn, *args):
    began = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - began) * 1e3, out


def _sleep(seconds: float) -> None:
    """Sleep, or for none, not even the system call that may hand the core to another process."""
    if seconds:
        time.sleep(seconds)


def one_repeat(runs: list[StageRun], rounds: int) -> dict[tuple[int, str], tuple[float, float]]:
    """Per (stage, context): the median F and B (ms) over `rounds` interleaved rounds."""
    contexts = ["back to back", *(f"{wait:g} ms asleep" for wait in WAITS_MS)]
    samples = {(k, c): ([], []) for k in range(len(runs)) for c in contexts}
    for round_index in range(WARMUP_ROUNDS + rounds):
        for k, run in enumerate(runs):
            for context, wait_s in zip(contexts, (0.0, *(wait / 1e3 for wait in WAITS_MS))):
                run.backward(run.forward())  # the same stage just ran: its weights are as hot as they get
                _sleep(wait_s)
                fwd_ms, saved = _ms(run.forward)  # F right after the wait
                run.backward(saved)
                saved = run.forward()
                _sleep(wait_s)
                bwd_ms, _ = _ms(run.backward, saved)  # B right after the wait, as a first stage's B after its RECV
                if round_index >= WARMUP_ROUNDS:
                    samples[(k, context)][0].append(fwd_ms)
                    samples[(k, context)][1].append(bwd_ms)
    return {key: (float(np.median(f)), float(np.median(b))) for key, (f, b) in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--width", type=positive_int, default=512)
    parser.add_argument("--microbatch-size", type=positive_int, default=32)
    parser.add_argument("--stages", type=positive_int, default=2)
    parser.add_argument("--rounds", type=positive_int, default=100)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("mlp", layers=args.layers, width=args.width)
    measure_bytes(model, Settings(torch.device("cpu"), DTYPES["float32"], args.microbatch_size, warmup=0, repeats=1,
                                  threads=1))
    layers = len(model.layers)
    bounds = [round(k * layers / args.stages) for k in range(args.stages + 1)]
    runs = stage_runs(model, bounds, "float32", args.microbatch_size)
    repeats = [one_repeat(runs, args.rounds) for _ in range(args.repeats)]
    table = Table(title=f"mlp {args.layers}x{args.width}, {degree_text('b', args.microbatch_size)}, stages {bounds}, "
                        f"one thread: median of {args.repeats:,} repeats of {args.rounds:,} rounds")
    for column in ("stage", "right after", "F ms", "B ms", "F / back to back", "B / back to back",
                   "spread over repeats (F, B)"):
        table.add_column(column, justify="left" if column == "right after" else "right")
    for (k, context) in repeats[0]:
        fwd = np.array([r[(k, context)][0] for r in repeats])
        bwd = np.array([r[(k, context)][1] for r in repeats])
        hot_f = np.array([r[(k, "back to back")][0] for r in repeats])
        hot_b = np.array([r[(k, "back to back")][1] for r in repeats])
        table.add_row(str(k), context, f"{np.median(fwd):.3f}", f"{np.median(bwd):.3f}",
                      f"{np.median(fwd / hot_f):.3f}", f"{np.median(bwd / hot_b):.3f}",
                      f"{np.ptp(fwd / hot_f):.3f}, {np.ptp(bwd / hot_b):.3f}")
    print_table(table, keys=2)  # a row: its stage and context


if __name__ == "__main__":
    main()
