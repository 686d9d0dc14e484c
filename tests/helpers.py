"""What several test modules build alike, built once here: the part they price on, and the lowered schedule's
rows as they read them."""

from __future__ import annotations

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device
from pipesim.schedules.lowering import Lowered
from pipesim.schedules.table import KINDS

H100 = load_catalogue().find("h100-sxm")
H100_BF16 = Device.of(H100, "bf16")


def kind_stage_microbatch(lowered: Lowered) -> list[tuple[str, int, int]]:
    """Each lowered row as (its kind's name, stage, micro-batch), in row order."""
    table = lowered.table
    return [(str(KINDS[k]), int(s), int(m)) for k, s, m in zip(table.kind, table.stage, table.microbatch)]
