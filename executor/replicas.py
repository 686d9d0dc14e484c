"""Data parallelism: the ranks that hold the same device of the d pipeline replicas, and the REDUCE row's
all-reduce of a stage's gradients over them.

With d replicas of a p-device pipeline, the processes' ranks are numbered in a rank order (schedules/ranks.py, as
the planner prices the links): pipesim's (the default), rank = replica * p + device, replica 0 holding ranks 0 .. p-1
as a run without data parallelism does; Megatron-core's, the stages outermost, rank = device * d + replica, a
stage's d replicas on consecutive ranks (so on one node, where a pipeline spans nodes). Either way each replica's
pipeline transfers stay among its own ranks, and a trace names each rank by its place, replica * p + device, so
that two orders' traces read alike. Device i's replicas form one group; a REDUCE row of a stage on device i
starts averaging the stage's accumulated weight gradients over that group, and the stage's update (OPT) waits for
it, so the rows between them overlap with it, and the update applies the mean over the whole mini-batch's d x m
micro-batches on every replica, which keeps the replicas' weights equal.

A schedule of several model copies (DualPipe's two, `StageGraph.copies`) holds each model stage on several
devices of one pipeline too: the devices that hold the same model stages (DualPipe's i and p-1-i) are peers, and
their ranks in every replica form one group, whose mean over the copies' gradients (each the mean over its own
micro-batches) is the whole mini-batch's.

Two implementations behind one interface: threads of one process (the in-process runner) meet in a shared
room; processes use a torch.distributed group per group of ranks (gloo on CPU and for ranks that share a GPU,
staged through the host; NCCL when each rank has its own GPU).

A stage whose gradients a REDUCE averages accumulates them in one flat buffer (`bucket`), as torch DDP's
`gradient_as_bucket_view` does: each gradient is a view of it, so the all-reduce sums the buffer in place, where
flattening them into a copy on the rank's compute thread first (`torch.cat`, a fresh 4 MB on the CPUs here:
1.2 ms a REDUCE row) and copying the mean back after held up the rows after it.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..schedules import Kind, Schedule
from ..schedules.ranks import dense_grid
from .stages import ExecutorError


@dataclass(frozen=True)
class Layout:
    """Where the ranks of `replicas` pipelines of `devices` devices each sit, numbered in `order` (a rank order of
    schedules/ranks.py, whose dense grid with t = C = 1 gives each rank its stage and replica). `peers[d]`: the
    devices whose ranks hold device d's weights too, d among them (none given: d alone)."""

    devices: int
    replicas: int = 1
    peers: tuple[tuple[int, ...], ...] = ()
    order: str = "pipesim"

    @classmethod
    def of(cls, schedule: Schedule, order: str = "pipesim") -> Layout:
        """The schedule's devices in each of its d replicas; with several model copies, each device's peers hold
        the same model stages. ExecutorError where peers would reduce different model stages' gradients with
        each other: each reduces its stages in its own order, and a group pairs its members' all-reduces in
        the order they start them."""
        graph, devices = schedule.graph, schedule.num_devices
        if graph.copies == 1:
            return cls(devices, schedule.data_parallel, order=order)
        n = graph.stages_per_copy
        held = [sorted({s % n for s in schedule.stages_on(d)}) for d in range(devices)]
        reduced = [[a.stage % n for a in order if a.kind is Kind.REDUCE] for order in schedule.orders]
        peers = tuple(tuple(e for e in range(devices) if held[e] == held[d]) for d in range(devices))
        for d, group in enumerate(peers):
            other = next((e for e in group if reduced[e] != reduced[d]), None)
            if other is not None:
                raise ExecutorError(f"{schedule.method}: devices {d} and {other} hold the same model stages "
                                    f"{held[d]} but reduce their gradients in different orders ({reduced[d]} and "
                                    f"{reduced[other]}), so their all-reduces would pair different stages")
        return cls(devices, schedule.data_parallel, peers, order)

    @property
    def synchronised(self) -> bool:
        """Whether any device's weights are held by more than one rank, whose gradients REDUCE rows average."""
        return self.replicas > 1 or any(len(group) > 1 for group in self.peers)

    @property
    def ranks(self) -> int:
        return self.devices * self.replicas

    @cached_property
    def _strides(self) -> tuple[int, int]:
        """The rank distance between neighbouring devices of a replica, and between a device's replicas."""
        grid = dense_grid(self.order, 1, 1, self.devices, self.replicas)
        return grid.stride("pp"), grid.stride("dp")

    def rank(self, device: int, replica: int) -> int:
        device_stride, replica_stride = self._strides
        return device * device_stride + replica * replica_stride

    def place(self, rank: int) -> tuple[int, int]:
        """(device, replica) of `rank`."""
        device_stride, replica_stride = self._strides
        return rank // device_stride % self.devices, rank // replica_stride % self.replicas

    def position(self, rank: int) -> int:
        """Where a trace puts `rank`: replica * devices + device, whatever the order (pipesim's, its rank)."""
        device, replica = self.place(rank)
        return replica * self.devices + device

    def where(self, rank: int) -> str:
        """What errors add to a rank's number: its device and replica, where there are several replicas."""
        device, replica = self.place(rank)
        return "" if self.replicas == 1 else f" (device {device}, replica {replica})"

    def name(self, rank: int) -> str:
        """How errors name a rank of threads: its device, or its rank, device and replica."""
        return f"device {rank}" if self.replicas == 1 else f"rank {rank}{self.where(rank)}"

    def group(self, device: int) -> list[int]:
        """The ranks that hold `device`'s weights: its own and its peers' in every replica, lowest first."""
        devices = self.peers[device] if self.peers else (device,)
        return sorted(self.rank(d, q) for q in range(self.replicas) for d in devices)

    def links(self, edges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The pipeline links (src device, dst device, channel) of one replica, for every replica, in ranks."""
        return [(self.rank(src, q), self.rank(dst, q), channel) for q in range(self.replicas)
                for src, dst, channel in edges]


def bucket(weights: list[torch.Tensor], flat: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """Zeroed gradients for `weights`, each a view of one flat buffer, in their order (what `flat_buffer` finds
    again): `flat`, an earlier bucket's buffer, zeroed in place where given, else a new one; None where their dtypes
    or devices differ, which one buffer cannot hold."""
    if not weights or len({(w.dtype, w.device) for w in weights}) > 1:
        return None
    if flat is None:
        flat = torch.zeros(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    else:
        flat.zero_()
    return [view.view_as(w) for view, w in zip(flat.split([w.numel() for w in weights]), weights)]


def flat_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat buffer `tensors` are views of, end to end in their order (`bucket`'s), else None (none for no
    tensors: a stage without weights, a layout's empty one)."""
    if not tensors:
        return None
    base = tensors[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    offset = base.storage_offset()
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return base if offset == base.storage_offset() + base.numel() else None


class Pending(Protocol):
    def wait(self) -> int:
        """Block until the all-reduce is done and its mean is in the tensors it was started on; returns when it
        completed (the monotonic clock, ns)."""


@dataclass
class _Done:
    """An all-reduce of nothing (a stage without weights, alike on every replica): done when started."""

    done_ns: int

    def wait(self) -> int:
        return self.done_ns


class ReplicaGroup(ABC):
    """One device's replicas, from one member's side."""

    def __init__(self, replicas: int, timeout_s: float) -> None:
        self.replicas, self.timeout_s = replicas, timeout_s
        self.calls = 0  # all-reduces started, to number them in errors

    def start(self, tensors: list[torch.Tensor]) -> Pending:
        """Start replacing `tensors` by their mean over the group; returns at once. Every member starts the
        same all-reduces (tensors of the same shapes) in the same order; `tensors` must not change until the
        wait returns."""
        if not tensors:
            return _Done(time.perf_counter_ns())
        self.calls += 1
        return self._start(self.calls - 1, tensors)

    @abstractmethod
    def _start(self, number: int, tensors: list[torch.Tensor]) -> Pending:
        """Start all-reduce number `number` (from 0) of `tensors`, one or more."""


# ---------------------------------------------------------------------------------------------- in-process


@dataclass
class Round:
    """One all-reduce in a room: each member's tensors by replica, then their mean and when it was ready (an
    expert-parallel exchange's: each member's rows for each other member, executor/experts.py)."""

    parts: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    mean: list[torch.Tensor] | None = None
    done_ns: int = 0
    taken: int = 0


@dataclass
class Room:
    """Where the threads holding one device's replicas meet (or those of an expert-parallel group: `replicas` is
    then its E ranks); `abandon` fails every wait (a thread failed)."""

    replicas: int
    ready: threading.Condition = field(default_factory=threading.Condition)
    rounds: dict[int, Round] = field(default_factory=dict)
    abandoned: str | None = None

    def abandon(self, reason: str) -> None:
        with self.ready:
            if self.abandoned is None:
                self.abandoned = reason
            self.ready.notify_all()


@dataclass
class _RoomPending:
    member: ThreadReplicas
    number: int
    this: Round
    tensors: list[torch.Tensor]

    def wait(self) -> int:
        member, room, this = self.member, self.member.room, self.this
        with room.ready:
            if not room.ready.wait_for(lambda: this.mean is not None or room.abandoned, member.timeout_s):
                missing = sorted(set(range(room.replicas)) - set(this.parts))
                raise ExecutorError(f"{member.label}: all-reduce #{self.number} timed out after "
                                    f"{member.timeout_s:g} s waiting for replicas {missing}")
            if this.mean is None:
                raise ExecutorError(f"{member.label}: all-reduce #{self.number} abandoned: {room.abandoned}")
            this.taken += 1
            if this.taken == room.replicas:
                del room.rounds[self.number]
        with torch.no_grad():
            for t, mean in zip(self.tensors, this.mean):
                t.copy_(mean)
        return this.done_ns


class ThreadReplicas(ReplicaGroup):
    """A member of a room: the mean is summed in replica order (for two, the sum a ring of gloo ranks takes)."""

    def __init__(self, room: Room, replica: int, label: str, timeout_s: float) -> None:
        super().__init__(room.replicas, timeout_s)
        self.room, self.replica, self.label = room, replica, label

    def _start(self, n: int, tensors: list[torch.Tensor]) -> Pending:
        room = self.room
        with room.ready:
            this = room.rounds.setdefault(n, Round())
            this.parts[self.replica] = [t.detach().clone() for t in tensors]
            if len(this.parts) == room.replicas:
                ordered = [this.parts[q] for q in range(room.replicas)]
                this.mean = [torch.stack(column).sum(0) / room.replicas for column in zip(*ordered)]
                this.done_ns = time.perf_counter_ns()
                room.ready.notify_all()
        return _RoomPending(self, n, this, tensors)


def thread_replicas(layout: Layout, timeout_s: float) -> tuple[list[Room], list[ReplicaGroup | None]]:
    """A room per group of ranks (`Layout.group`) and every rank's member of its group's room (by rank); none
    where every device's weights are one rank's."""
    if not layout.synchronised:
        return [], [None] * layout.ranks
    groups = [tuple(layout.group(layout.place(rank)[0])) for rank in range(layout.ranks)]
    rooms = {group: Room(len(group)) for group in sorted(set(groups))}
    members: list[ReplicaGroup | None] = [ThreadReplicas(rooms[group], group.index(rank), layout.name(rank),
                                                         timeout_s) for rank, group in enumerate(groups)]
    return list(rooms.values()), members


# --------------------------------------------------------------------------------------- torch.distributed


@dataclass
class _WorkPending:
    member: DistReplicas
    number: int
    work: Any  # torch.distributed.Work
    stamp: Any  # a torch Future of the completion time, set by a callback as the work completes
    wire: torch.Tensor  # the flat buffer the all-reduce sums into
    tensors: list[torch.Tensor]  # empty where they are views of `wire` (`bucket`)

    def wait(self) -> int:
        member = self.member
        try:
            self.work.wait(timedelta(seconds=member.timeout_s))
            done_ns = int(self.stamp.wait())
        except RuntimeError as exc:
            raise ExecutorError(f"{member.label} #{self.number} failed: "
                                f"{(str(exc).splitlines() or ['?'])[0]}") from None
        self.wire.div_(member.replicas)
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                t.copy_(self.wire[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return done_ns


class DistReplicas(ReplicaGroup):
    """A member of a torch.distributed group: the gradients' flat buffer (`bucket`; else a flattened copy),
    summed by one all-reduce and divided by d. `staged`: the ranks share a GPU, so the buffer goes through the
    host (gloo takes CPU tensors only). The completion time is the work's future's callback: gloo runs it as the
    all-reduce completes, but ProcessGroupNCCL completes the future as it enqueues the all-reduce, so on NCCL
    ranks (a GPU each) a REDUCE row ends as it starts, its time not measured."""

    def __init__(self, group: Any, ranks: list[int], rank: int, staged: bool, timeout_s: float) -> None:
        super().__init__(len(ranks), timeout_s)
        self.group, self.staged = group, staged
        self.label = f"rank {rank}: all-reduce over ranks {ranks}"

    def _start(self, n: int, tensors: list[torch.Tensor]) -> Pending:
        flat = flat_buffer(tensors)
        wire = torch.cat([t.detach().reshape(-1) for t in tensors]) if flat is None else flat
        wire = wire.cpu() if self.staged else wire
        if wire is flat:  # the all-reduce sums the gradients themselves: nothing to copy back
            tensors = []
        try:
            work = dist.all_reduce(wire, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise ExecutorError(f"{self.label} #{n} failed: {(str(exc).splitlines() or ['?'])[0]}") from None
        return _WorkPending(self, n, work, work.get_future().then(lambda _: time.perf_counter_ns()), wire, tensors)


def dist_replicas(layout: Layout, rank: int, backend: str, compute: torch.device, staged: bool,
                  timeout_s: float) -> ReplicaGroup | None:
    """This rank's member of its device's group (the rank computes on `compute`), once every rank has created
    every group (creating a group is collective over the job: all ranks call this together; peers share one) and
    each group has run one all-reduce of one element (NCCL creates its communicator then, blocking until every
    member joins; and the first REDUCE row times the all-reduce alone). None where every device's weights are
    one rank's."""
    if not layout.synchronised:
        return None
    timeout = timedelta(seconds=timeout_s)
    groups = {members: dist.new_group(list(members), timeout=timeout, backend=backend)
              for members in sorted({tuple(layout.group(device)) for device in range(layout.devices)})}
    mine = tuple(layout.group(layout.place(rank)[0]))
    dist.all_reduce(torch.zeros(1, device="cpu" if staged else compute), group=groups[mine])
    return DistReplicas(groups[mine], list(mine), rank, staged, timeout_s)
