"""IR passes: transform a schedule instead of special-casing the runtimes that interpret it."""

from __future__ import annotations

import numpy as np

from .ir import Kind, Schedule
from .table import KIND_CODE, ActionTable


def communication_table(schedule: Schedule, table: ActionTable | None = None) -> tuple[ActionTable, np.ndarray]:
    """The columnar form of `add_communication`: the lowered actions, and for each lowered row the row of
    `table` it came from (-1 for an inserted SEND or RECV). Vectorised, so it scales to millions of ops."""
    t = table or schedule.table
    rows = np.arange(len(t.kind))
    forward = t.kind == KIND_CODE[Kind.F]
    backward = (t.kind == KIND_CODE[Kind.B]) | (t.kind == KIND_CODE[Kind.I])
    # Each lowered row is sorted by 3·(row it belongs to) + 0 (RECVs before), 1 (the action), 2 (SENDs after).
    keys, sources, kinds, peers = [rows * 3 + 1], [rows], [t.kind], [t.peer]
    by_stage = np.argsort(t.stage, kind="stable")
    bounds = np.searchsorted(t.stage[by_stage], np.arange(schedule.num_stages + 1))
    for src, dst in schedule.graph.edges:
        if schedule.placement[src] == schedule.placement[dst]:
            continue
        for mask, stage, peer, kind, slot in (
            (forward, dst, src, Kind.RECV_F, 0), (forward, src, dst, Kind.SEND_F, 2),
            (backward, src, dst, Kind.RECV_B, 0), (backward, dst, src, Kind.SEND_B, 2),
        ):
            of_stage = by_stage[bounds[stage]:bounds[stage + 1]]
            owners = of_stage[mask[of_stage]]
            keys.append(owners * 3 + slot)
            sources.append(owners)
            kinds.append(np.full(len(owners), KIND_CODE[kind]))
            peers.append(np.full(len(owners), peer))
    key = np.concatenate(keys)
    order = np.argsort(key, kind="stable")
    source = np.concatenate(sources)[order]
    lowered = t.select(source)
    lowered = ActionTable(lowered.device, np.concatenate(kinds)[order], lowered.stage, lowered.microbatch,
                          lowered.minibatch, lowered.pipeline, np.concatenate(peers)[order])
    origin = np.where(key[order] % 3 == 1, source, -1)
    return lowered, origin


def add_communication(schedule: Schedule) -> Schedule:
    """Make every cross-device transfer explicit.

    After each action whose output another device consumes comes a SEND per consuming stage; right
    before each action that consumes another device's output come the matching RECVs. Forward
    activations flow along the stage graph's edges, input gradients against them.
    """
    lowered, _ = communication_table(schedule)
    return schedule.with_orders(lowered.to_orders(schedule.num_devices))
