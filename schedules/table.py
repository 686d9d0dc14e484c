"""A columnar view of a schedule's actions, for checks and lowering that must scale to millions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from .ir import Action, Kind, Schedule, ScheduleError

KINDS = tuple(Kind)
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
NUM_COMPUTE_KINDS = 13  # a stage's own rows (F, B, I, W, OPT, PRED, AVG, REDUCE, GATHER, A2A_F, A2A_B, RING_F,
# RING_B) come first, then transfers
assert all(k.value.startswith(("SEND", "RECV")) for k in KINDS[NUM_COMPUTE_KINDS:])
# A table's columns: a kind code is a byte, every other field (and a row index into a table) 32 bits. A lowered
# table has millions of rows and a dozen columns, so each byte per row counts (`simulate -p 128 -m 4096` lowers
# 6.3M rows). A schedule whose units, rows or transfer ids would pass 2^31 is refused (`require_field_fits`): its
# table would fill hundreds of GiB first.
KIND_DTYPE = np.int8
FIELD_DTYPE = np.int32
FIELD_MAX = np.iinfo(FIELD_DTYPE).max


def require_field_fits(schedule: Schedule, count: int, what: str) -> None:
    """Raise ScheduleError where `count` (of `what`, which a table indexes or holds) would pass a field's 32 bits."""
    if count > FIELD_MAX:
        raise ScheduleError(f"{schedule.method}: {count:,} {what}; a table holds at most {FIELD_MAX:,} (fewer "
                            "micro-batches or mini-batches)")


def kind_mask(kind: np.ndarray, *kinds: Kind) -> np.ndarray:
    """Rows whose kind code is one of `kinds`: one comparison per kind (np.isin sorts; a lookup in a table by
    kind widens the byte codes to 64 bits first, which costs ten such comparisons)."""
    mask = np.zeros(np.shape(kind), dtype=bool)
    for k in kinds:
        mask |= kind == KIND_CODE[k]
    return mask


@dataclass(frozen=True)
class ActionTable:
    """Every action of a schedule, row i = the i-th action in device order (device 0's first)."""

    device: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    minibatch: np.ndarray
    pipeline: np.ndarray
    peer: np.ndarray
    _indices: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, schedule: Schedule) -> ActionTable:
        if isinstance(schedule.orders, OrderView):
            return schedule.orders.table
        return cls.from_orders(schedule.orders, schedule.method)

    @classmethod
    def from_device_rows(cls, kind: np.ndarray, stage, microbatch, minibatch=0, pipeline=0) -> ActionTable:
        """A table from (devices, actions per device) arrays, row d device d's actions in order: their kind codes
        and their stages, micro-batches, mini-batches and pipelines (each broadcast to the kinds'); no peers."""
        devices, length = kind.shape
        return cls(np.repeat(np.arange(devices, dtype=FIELD_DTYPE), length), kind.astype(KIND_DTYPE).ravel(),
                   *(np.broadcast_to(column, kind.shape).astype(FIELD_DTYPE).ravel()
                     for column in (stage, microbatch, minibatch, pipeline)),
                   np.full(kind.size, -1, dtype=FIELD_DTYPE))

    @classmethod
    def from_orders(cls, orders: Sequence[Sequence[Action]], method: str) -> ActionTable:
        """The table of per-device action lists (device 0's first); a field beyond 32 bits raises ScheduleError
        naming `method`."""
        device = np.repeat(np.arange(len(orders), dtype=FIELD_DTYPE), [len(o) for o in orders])
        kinds, numbers = [np.zeros(0, dtype=KIND_DTYPE)], [np.zeros((5, 0), dtype=np.int64)]
        for order in filter(None, orders):  # per device: one 2-D conversion is cheapest
            kind, *fields = zip(*order)
            kinds.append(np.fromiter(map(KIND_CODE.__getitem__, kind), dtype=KIND_DTYPE, count=len(order)))
            numbers.append(np.array(fields, dtype=np.int64))
        numbers = np.concatenate(numbers, axis=1)
        outside = (numbers > FIELD_MAX) | (numbers < -FIELD_MAX)
        if outside.any():
            column, row = divmod(int(np.argmax(outside)), numbers.shape[1])
            raise ScheduleError(f"{method}: action {row} in device order has {_FIELDS[column + 2]} "
                                f"{numbers[column, row]}, beyond what a field holds (|value| <= {FIELD_MAX})")
        return cls(device, np.concatenate(kinds), *numbers.astype(FIELD_DTYPE))

    def unit_index(self, schedule: Schedule) -> np.ndarray:
        """Row -> index of its (stage, micro-batch, mini-batch, pipeline); meaningful where microbatch >= 0.
        Read-only, and kept (as `step_index`): the checks and the lowering each read it over millions of rows."""
        m, n, r = schedule.microbatches, schedule.minibatches, schedule.pipelines
        require_field_fits(schedule, schedule.num_stages * m * n * r, "units (stage, micro-batch, mini-batch, "
                                                                       "pipeline)")
        return self._kept(("unit", m, n, r), lambda: ((self.stage * m + self.microbatch) * n + self.minibatch) * r
                          + self.pipeline)

    def step_index(self, schedule: Schedule) -> np.ndarray:
        """Row -> index of its (stage, mini-batch, pipeline)."""
        n, r = schedule.minibatches, schedule.pipelines
        require_field_fits(schedule, schedule.num_stages * n * r, "steps (stage, mini-batch, pipeline)")
        return self._kept(("step", n, r), lambda: (self.stage * n + self.minibatch) * r + self.pipeline)

    def _kept(self, key: tuple, compute) -> np.ndarray:
        if key not in self._indices:
            index = compute()
            index.flags.writeable = False
            self._indices[key] = index
        return self._indices[key]

    def per_minibatch(self, minibatches: int) -> ActionTable:
        """This table's rows (one mini-batch's, grouped by device) repeated for each of `minibatches` mini-batches,
        device by device, each repeat's mini-batch numbers raised by its index: a flushing method's whole order
        from one mini-batch's, with no action made per repeat."""
        lengths = np.bincount(self.device)  # rows per device
        # every device's rows once per mini-batch, device by device: a run per (device, mini-batch)
        run_length = np.repeat(lengths, minibatches)
        run_first = np.repeat(np.cumsum(lengths) - lengths, minibatches)  # the run's first row in this table
        ends = np.cumsum(run_length)
        table = self.select(np.arange(ends[-1] if len(ends) else 0) + np.repeat(run_first - (ends - run_length),
                                                                                 run_length))
        raised = np.repeat(np.tile(np.arange(minibatches, dtype=FIELD_DTYPE), len(lengths)), run_length)
        return replace(table, minibatch=table.minibatch + raised)

    def select(self, rows: np.ndarray) -> ActionTable:
        """The rows `rows` (indices, in the order given)."""
        return ActionTable(*(getattr(self, f)[rows] for f in _FIELDS))

    def with_rows(self, before: np.ndarray, copied: np.ndarray, **values) -> ActionTable:
        """This table with a row inserted before each row index in `before` (rows inserted at one index in the
        order given, as np.insert places them), each a copy of the row `copied` names but for the columns `values`
        names (one value, or one per inserted row). The rows' places are found once for every column, where
        np.insert finds them again per column (the passes insert into tables of up to millions of rows)."""
        rows, added = len(self.kind), len(before)
        by_place = np.argsort(before, kind="stable")
        at = np.empty(added, dtype=np.intp)
        at[by_place] = before[by_place] + np.arange(added)
        source = np.empty(rows + added, dtype=np.intp)  # each row's row in this table
        kept = np.ones(rows + added, dtype=bool)
        kept[at] = False
        source[kept], source[at] = np.arange(rows), copied
        columns = {name: getattr(self, name).take(source) for name in _FIELDS}
        for name, value in values.items():
            columns[name][at] = value
        return ActionTable(**columns)

    def to_orders(self, num_devices: int) -> tuple[tuple[Action, ...], ...]:
        """The per-device action lists (rows must be grouped by device, in order)."""
        kinds = [KINDS[k] for k in self.kind.tolist()]
        actions = list(map(Action, kinds, *(getattr(self, f).tolist() for f in _FIELDS[2:])))
        bounds = np.searchsorted(self.device, np.arange(num_devices + 1)).tolist()
        return tuple(tuple(actions[bounds[d]:bounds[d + 1]]) for d in range(num_devices))


_FIELDS = ("device", "kind", "stage", "microbatch", "minibatch", "pipeline", "peer")


def stacked(parts: Sequence[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> ActionTable:
    """A table from per-device columns, devices in order: (device, kind codes, stage, micro-batch,
    mini-batch, pipeline)."""
    columns = list(zip(*parts)) if parts else [[np.zeros(0, FIELD_DTYPE)]] * 6
    device = np.concatenate([np.full(len(kind), d, dtype=FIELD_DTYPE) for d, kind in zip(columns[0], columns[1])])
    kind, *rest = (np.concatenate([np.asarray(c, dtype=dtype) for c in column])
                   for column, dtype in zip(columns[1:], (KIND_DTYPE,) + (FIELD_DTYPE,) * 4))
    return ActionTable(device, kind, *rest, np.full(len(device), -1, dtype=FIELD_DTYPE))


class OrderView(Sequence):
    """A schedule's per-device orders backed by its table: methods that build columns directly (so a
    million-op schedule costs no per-op objects) still offer `Schedule.orders`, made on first use."""

    def __init__(self, table: ActionTable, num_devices: int) -> None:
        self.table = table
        self.num_devices = num_devices

    @cached_property
    def _orders(self) -> tuple[tuple[Action, ...], ...]:
        return self.table.to_orders(self.num_devices)

    def __len__(self) -> int:
        return self.num_devices

    def __getitem__(self, device):
        return self._orders[device]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))
