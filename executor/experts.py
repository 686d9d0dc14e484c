"""Expert parallelism: which ranks exchange a mixture of experts' tokens, and which average its experts' gradients.

As Megatron-core draws them (and the simulator, planning/experts.py), the E expert-parallel ranks of a device are
E of its d data-parallel replicas (E divides d): replicas gE .. gE+E-1 form expert-parallel group g, replica q
being rank q mod E of its group, which holds routed experts (q mod E)·n/E .. of each of the device's
mixture-of-experts layers. For the dense weights the replicas are data parallel as ever (the REDUCE row averages
their gradients over all d); an expert's gradient, which the tokens of its whole group's micro-batches made, is
averaged over the d/E replicas that hold the same expert (none where E = d) and divided by E, so that every
update applies the mean over the whole mini-batch's d x M micro-batches, as one process training the whole model
does.

Two implementations, as for the replicas' all-reduces (replicas.py): threads of one process (the in-process runner)
exchange in a shared room; processes through torch.distributed groups (`workload.moe.DistExchange`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..workload.moe import DistExchange, ExpertExchange
from .replicas import DistReplicas, Layout, Pending, ReplicaGroup, Room, Round, ThreadReplicas
from .stages import ExecutorError


@dataclass(frozen=True)
class ExpertLayout:
    """E expert-parallel ranks drawn from the `layout`'s data-parallel replicas, as the module docstring says."""

    layout: Layout
    ranks: int

    def group(self, device: int, replica: int) -> list[int]:
        """The ranks `replica` of `device` exchanges tokens with, itself included, in group order."""
        first = replica - replica % self.ranks
        return [self.layout.rank(device, q) for q in range(first, first + self.ranks)]

    def holders(self, device: int, replica: int) -> list[int]:
        """The ranks that hold the same experts as `replica` of `device`: of the ranks that hold its weights
        (`Layout.group`), those of the same rank in their expert-parallel group."""
        return [rank for rank in self.layout.group(device) if self.layout.place(rank)[1] % self.ranks
                == replica % self.ranks]


@dataclass
class Joined:
    """All-reduces a REDUCE row started together (a stage's dense gradients, its experts'): done when all are."""

    parts: list[Pending]

    def wait(self) -> int:
        return max(part.wait() for part in self.parts)


@dataclass
class ExpertRanks:
    """This rank's expert parallelism: its `exchange` with its group, and `holders`, its device's replicas that
    hold the same experts (None: this rank alone holds them); `ranks` is E."""

    exchange: ExpertExchange
    holders: ReplicaGroup | None

    @property
    def ranks(self) -> int:
        return self.exchange.ranks


def dist_experts(layout: Layout, expert_parallel: int, rank: int, backend: str, timeout_s: float) -> ExpertRanks | None:
    """This rank's `ExpertRanks` (its ranks compute on CPUs), once every rank has created every device's groups
    (collective over the job: all ranks call this together, after `replicas.dist_replicas`) and its group has run
    one collective (NCCL creates its communicator then); None without expert parallelism."""
    if expert_parallel == 1:
        return None
    experts = ExpertLayout(layout, expert_parallel)
    timeout = timedelta(seconds=timeout_s)
    places = [(device, replica) for device in range(layout.devices) for replica in range(layout.replicas)]
    exchange = holders = None
    for ranks in sorted({tuple(experts.group(*place)) for place in places}):
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            exchange = DistExchange(group, ranks.index(rank), expert_parallel)
    for ranks in sorted({tuple(experts.holders(*place)) for place in places}):
        if len(ranks) > 1:  # one holder has no one to average with
            group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                holders = DistReplicas(group, list(ranks), rank, False, timeout_s)
    dist.all_reduce(torch.zeros(1), group=exchange.group)
    return ExpertRanks(exchange, holders)


class ThreadExchange(ExpertExchange):
    """A member of an expert-parallel group's room: each exchange is a round (numbered in the order each member
    calls them) in which it leaves each member its rows and takes, in member order, what each left for it."""

    def __init__(self, room: Room, rank: int, label: str, timeout_s: float) -> None:
        super().__init__(rank, room.replicas)
        self.room, self.label, self.timeout_s = room, label, timeout_s
        self.calls = 0

    def _swap(self, wire: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        room, number = self.room, self.calls
        self.calls += 1
        with room.ready:
            this = room.rounds.setdefault(number, Round())
            this.parts[self.rank] = [part.clone() for part in wire.split(send)]
            room.ready.notify_all()
            if not room.ready.wait_for(lambda: len(this.parts) == room.replicas or room.abandoned, self.timeout_s):
                missing = sorted(set(range(room.replicas)) - set(this.parts))
                raise ExecutorError(f"{self.label}: all-to-all #{number} timed out after {self.timeout_s:g} s "
                                    f"waiting for group members {missing}")
            if len(this.parts) < room.replicas:
                raise ExecutorError(f"{self.label}: all-to-all #{number} abandoned: {room.abandoned}")
            out = torch.cat([this.parts[sender][self.rank] for sender in range(room.replicas)])
            this.taken += 1
            if this.taken == room.replicas:
                del room.rounds[number]
        return out


def thread_experts(layout: Layout, expert_parallel: int, timeout_s: float
                   ) -> tuple[list[Room], list[ExpertRanks | None]]:
    """The rooms of every expert-parallel group and of every expert's holders, and each rank's `ExpertRanks` in
    them (by rank); none without expert parallelism."""
    if expert_parallel == 1:
        return [], [None] * layout.ranks
    experts = ExpertLayout(layout, expert_parallel)
    places = [layout.place(rank) for rank in range(layout.ranks)]
    groups = [tuple(experts.group(*place)) for place in places]
    held = [tuple(experts.holders(*place)) for place in places]
    exchanges = {group: Room(expert_parallel) for group in set(groups)}
    holders = {group: Room(len(group)) for group in set(held) if len(group) > 1}
    members = [ExpertRanks(ThreadExchange(exchanges[groups[rank]], groups[rank].index(rank), layout.name(rank),
                                          timeout_s),
                           ThreadReplicas(holders[held[rank]], held[rank].index(rank), layout.name(rank), timeout_s)
                           if held[rank] in holders else None) for rank in range(layout.ranks)]
    return [*exchanges.values(), *holders.values()], members
