"""What several test modules build alike, built once here: the profiles calibrated in the repository, the parts they
price on (as a device, on an attention kernel, and an H100 node's placement), a small GPT's count, a hand-written
two-stage schedule, the lowered schedule's rows as they read them, a flag's value in a printed command, tune's
JSON as two runs share it, and the executor tests' device threads and weight comparison. Each part is frozen: the
tests share it safely."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, kernel_curve, node_placement
from pipesim.profiles.workload import WorkloadCount
from pipesim.schedules import SYNCHRONOUS, Schedule, StageGraph
from pipesim.schedules.lowering import Lowered
from pipesim.schedules.table import KINDS

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
