"""One device's loop over its lowered rows: the executor's core.

A device walks its rows in order. RECV waits for a receive posted ahead of time (in row order, which per
channel is the order its peer sends in) and is timed as the wait; F, B, I and W run on the weights the row
names (a forward's micro-batch drawn just before its row); SEND is issued and not waited on until the end; OPT
applies the optimizer, copy-on-write when the lowering says a later row still reads the old version; a version is
dropped after its last read. Nothing here knows a method by name: every decision comes from the lowered rows. An
overlapped pair's parts are its two rows, run one after the other on CPU and on two CUDA streams on a GPU
(overlap.py).

Weights an op runs on: the version the row names, or, when the row has a prediction distance s >= 0, the
prediction buffer (stage, pipeline, version, s, side) that a PRED row filled before it. A PRED row fills the
buffer its next op on the same micro-batch reads (side F for a forward, B for B, I and W); later ops with
the same key reuse it (a bellwether's buffer serves its mini-batch), and it is freed after its last reader.

A backward on other weights than its forward's (predicted forward, current or re-predicted backward): as
the original codes swapped `param.data` between the passes, the backward combines the forward's activations
with the backward row's weights. During F, saved-tensor hooks store a saved tensor that is one of the
forward's weights, or a view of one (addmm saves `weight.t()`), as a reference (index and view geometry);
the backward unpacks it from the weights its own row names. Every other saved tensor is kept as saved.
Weight gradients are taken with respect to the forward's leaves and accumulate in the stage's one gradient
buffer, whichever weights produced them. The forward is never recomputed.

AVG pulls the P pipeline replicas of a stage on this device and a reference model (the initial weights)
together by elastic averaging, with the schedule's coefficient alpha (in mixed precision the replicas' float32
masters and a float32 reference: weights.py). REDUCE starts averaging a stage's accumulated gradients over its
data-parallel replicas (the same device of the other d - 1 pipelines, on other ranks: see replicas.py) and is not
waited on: the stage's OPT waits for it before it starts, outside the compute lock (the replicas it waits for may
share this rank's GPU). A REDUCE row runs from its start until the all-reduce completed, as the simulator's network
stream has it.

Measured per row: the version and prediction distance the op used (from the weights it ran on), and memory: on
CUDA the allocator's count; on CPU the bytes of the tensors autograd saved for backward (each storage once,
until its graph is freed), a forward's inputs and outputs until its backward (the backward's roots), weights
(every version, their gradients, prediction buffers, master weights, optimizer state, reference models) and
activations or gradients waiting for their consumer or their send, or in a send that has not completed (the
in-process transport copies a sent tensor and completes at once). A row's peak is that at its end before it frees the
version or prediction it was the last to read (weights nothing reads again go to their replica's spares, which the
books leave out as the allocator's free memory, even while a forward's graph holds them as leaves: see weights.py).
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call

from ..schedules import KINDS, Kind, Lowered, ScheduleParams
from ..schedules.ir import ALL_TO_ALL_KINDS
from ..workload.models import place_experts, routed_parameters
from ..workload.moe import ExpertExchange
from ..workload.transport import Handle, Transport
from .backward import PendingWeightGrad, backward_input, backward_weight, full_backward
from .experts import ExpertRanks, Joined
from .overlap import PairStreams
from .replicas import Layout, Pending, ReplicaGroup
from .stages import DivergedError, ExecutorError, RunSpec, StageModule, Stages, microbatch_data
from .weights import BufferKey, StageWeights, Weights, average_replicas

Unit = tuple[int, int, int, int]  # (stage, micro-batch, mini-batch, pipeline)
EdgeUnit = tuple[int, int, int, int, int]  # (from stage, to stage, micro-batch, mini-batch, pipeline)
_BACKWARD = frozenset({Kind.B, Kind.I, Kind.W})
_PASSES = frozenset({Kind.F, *_BACKWARD})
_FILLING = frozenset({Kind.B, Kind.W})  # the backwards that add into the gradient buffer
_TRANSFERS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B})


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def bytes_by_storage(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """The bytes of the storages `tensors` view, by storage: each counted once, whole."""
    return dict(_storage(t) for t in tensors)


class Ledger:
    """Bytes of the tensors autograd saved for backward on this device, each storage counted once while any
    graph still holds it."""

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}  # storage address -> [holders, bytes]
        self.total = 0

    def hold(self, ptr: int, nbytes: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            entry = self.refs[ptr] = [0, nbytes]
            self.total += nbytes
        entry[0] += 1

    def drop(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if not entry[0]:
            del self.refs[ptr]
            self.total -= entry[1]

    def by_storage(self) -> dict[int, int]:
        return {ptr: nbytes for ptr, (_, nbytes) in self.refs.items()}


class _Held:
    """A saved activation as autograd stores it; its bytes leave the ledger when its graph lets it go."""

    __slots__ = ("tensor", "ledger", "ptr")

    def __init__(self, tensor: torch.Tensor, ledger: Ledger) -> None:
        self.tensor, self.ledger = tensor, ledger
        self.ptr, nbytes = _storage(tensor)
        ledger.hold(self.ptr, nbytes)

    def __del__(self) -> None:
        self.ledger.drop(self.ptr)


@dataclass
class _WeightRef:
    """A saved tensor that was (a view of) the forward's weight `index`, by geometry."""

    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the weight's own


class Tape:
    """One forward's saved-tensor hooks: weights out by reference, the rest kept and counted. `backward`
    holds the tensors the next backward row runs on; unpacking resolves references against them."""

    def __init__(self, forward: Weights, ledger: Ledger) -> None:
        self.weight_at = {w.untyped_storage().data_ptr(): (i, w.storage_offset())
                          for i, w in enumerate(forward.tensors)}
        self.ledger = ledger
        self.backward: list[torch.Tensor] = forward.tensors

    def pack(self, t: torch.Tensor) -> Any:
        found = self.weight_at.get(t.untyped_storage().data_ptr())
        if found is not None:
            index, base = found
            return _WeightRef(index, tuple(t.shape), tuple(t.stride()), t.storage_offset() - base)
        return _Held(t.detach(), self.ledger)  # detached: a tensor holding its own saver would be a cycle

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _WeightRef):
            w = self.backward[packed.index].detach()
            return w.as_strided(packed.size, packed.stride, w.storage_offset() + packed.offset)
        return packed.tensor


def stage_forward(module: StageModule, parameters: dict[str, torch.Tensor], args: list[torch.Tensor], tape: Tape,
                  loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """A stage's forward as every F row runs it, which calibration times too (calibrate/passes.py): the stage
    module through functional_call on `parameters` (a tied tensor's further names given it, `StageModule.aliases`),
    its saved tensors through `tape`; the outputs per outgoing edge, or, given `loss`, [the loss of the output]."""
    tied = {alias: parameters[name] for alias, name in module.aliases.items()}
    with saved_tensors_hooks(tape.pack, tape.unpack):
        out = functional_call(module, parameters | tied if tied else parameters, tuple(args), tie_weights=False)
        return [loss(out)] if loss is not None else list(out)


@dataclass
class _Saved:
    """What a forward leaves for its backward."""

    inputs: list[torch.Tensor]  # one leaf per incoming stage edge
    outputs: list[torch.Tensor]  # one per outgoing edge, or the last stage's loss
    weights: Weights  # the forward's: gradients are taken with respect to these leaves
    tape: Tape
    pending: PendingWeightGrad | None = None  # after I, until W


def _int_array(n: int, fill: int = 0) -> np.ndarray:
    return np.full(n, fill, dtype=np.int64)


class AllToAllRows:
    """Where the time a pass spends in its experts' all-to-alls goes in the trace. The exchanges run inside the
    pass (a layer dispatches its tokens, its experts compute, it combines them, the next layer runs), so they
    cannot run as rows of their own; the schedule's A2A_F row after a forward and its A2A_B row after a B or I
    (an overlapped pair's after both parts: `schedules.passes.add_expert_parallel`) stand for them. So each such
    pass is recorded for its time less its exchanges', the rows up to its all-to-all rows move earlier by that
    much, and each all-to-all row lasts what its pass exchanged: the timeline keeps the pass's span, in the
    schedule's order. A pass that exchanged with no all-to-all row after it (a first stage's W, whose I had no
    input gradient to take and left the whole backward to it) keeps that time."""

    def __init__(self, lowered: Lowered, device: int, exchange: ExpertExchange) -> None:
        t = lowered.table
        latest: dict[tuple[bool, Unit], int] = {}  # (forward?, unit) -> its latest pass row
        self.all_to_all_of: dict[int, int] = {}  # pass row -> its all-to-all row
        for i in lowered.rows(device):
            kind = KINDS[t.kind[i]]
            unit = (int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]), int(t.pipeline[i]))
            if kind in (Kind.F, Kind.B, Kind.I):
                latest[(kind is Kind.F, unit)] = i
            elif kind in ALL_TO_ALL_KINDS:
                self.all_to_all_of[latest.pop((kind is Kind.A2A_F, unit))] = i
        self.exchange = exchange
        self.seen_ns = exchange.spent_ns
        self.owed: dict[int, int] = {}  # all-to-all row -> ns its pass exchanged
        self.shift_ns = 0  # how much earlier the rows now run are recorded

    def place(self, row: int, start_ns: int, end_ns: int) -> tuple[int, int]:
        """Row `row`, measured from `start_ns` to `end_ns`, as the trace records it."""
        spent, self.seen_ns = self.exchange.spent_ns - self.seen_ns, self.exchange.spent_ns
        start_ns -= self.shift_ns
        if row in self.owed:
            taken = self.owed.pop(row)
            self.shift_ns -= taken
            return start_ns, start_ns + taken
        if row in self.all_to_all_of:
            self.owed[self.all_to_all_of[row]] = spent
            self.shift_ns += spent
        return start_ns, end_ns - self.shift_ns


@dataclass
class DeviceResult:
    """What a device reports, per row (its rows in order): start and end on the monotonic clock (ns); a SEND
    row's CPU time on the loop's thread (ns, -1 for other rows: its own cost, without what the rank waited or
    was descheduled for meanwhile); a compute row's wait for its turn on a GPU shared with other ranks (ns, -1 where
    the GPU is its own or on CPU: the host time before the row holds it); the weight copies of its fullest stage
    held after the row (each pipeline's replica of it, with versions and prediction buffers, and its reference);
    the weight version and prediction distance the row's op used (-1: none); memory after the row (bytes: all, and
    saved activations alone) and its
    peak (at its end, before it let go of what it used last), and of the memory after it the bytes only sends still
    in flight hold (CPU; 0 on CUDA: when those complete is up to the transport's threads, so that part varies with
    the host's load). Also the loss per (pipeline, mini-batch) when it
    holds a last stage, every stage replica's final weights (numpy, in the stage module's parameter order; a
    16-bit run's float32 masters), and where it computed (`host/device`: ranks that name the same one shared a
    GPU)."""

    device: int
    start_ns: np.ndarray
    end_ns: np.ndarray
    held: np.ndarray
    version: np.ndarray
    prediction: np.ndarray
    memory_bytes: np.ndarray
    peak_bytes: np.ndarray
    activation_bytes: np.ndarray
    send_cpu_ns: np.ndarray
    wait_ns: np.ndarray
    sending_bytes: np.ndarray
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    weights: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    rows_done: int = 0
    error: str | None = None
    compute: str = ""
    bounds: list[int] = field(default_factory=list)  # the stage bounds the model was cut at
    routed: dict[int, list[int]] = field(default_factory=dict)  # stage -> its weights that are slices of experts


class DeviceLoop:
    """Runs device `device`'s rows of `lowered` on `stages` over `transport`, in data-parallel replica `replica`
    (its rank as `spec.rank_order` numbers it), whose REDUCE rows average over `replicas`; with `experts`, its stages'
    mixture-of-experts layers keep this rank's experts and exchange tokens with its expert-parallel group.

    `on_row(i)` is called after each row finishes with its global index (progress, heartbeats; `losses`,
    (pipeline, mini-batch) -> loss, is readable then). `compute_lock` is held around each compute row, so
    ranks that share one GPU take turns. `result` is the run's DeviceResult from its start, so a caller still
    has the rows done (`rows_done`) when `run` raises."""

    def __init__(self, spec: RunSpec, lowered: Lowered, stages: Stages, device: int, transport: Transport, *,
                 replica: int = 0, replicas: ReplicaGroup | None = None, experts: ExpertRanks | None = None,
                 on_row: Callable[[int], None] | None = None,
                 compute_lock: contextlib.AbstractContextManager | None = None) -> None:
        self.spec, self.lowered, self.stages, self.device = spec, lowered, stages, device
        self.transport = transport
        self.replica, self.replicas, self.experts = replica, replicas, experts
        self.layout = Layout(lowered.schedule.num_devices, lowered.schedule.data_parallel, order=spec.rank_order)
        self.on_row = on_row
        self.compute_lock = compute_lock if compute_lock is not None else contextlib.nullcontext()
        self.shares_gpu = compute_lock is not None
        self.torch_device = transport.device
        self.on_cuda = self.torch_device.type == "cuda"  # the allocator counts memory; nothing to add up
        schedule = lowered.schedule
        # the micro-batches each stage runs (a model copy runs its share; its REDUCE rows average the copies' means)
        self.m = schedule.microbatches // schedule.graph.copies
        self.placement = schedule.placement
        self.pipelines = schedule.pipelines
        if (experts.ranks if experts else 1) != schedule.expert_parallel:
            raise ExecutorError(f"device {device}: the schedule places its experts over E={schedule.expert_parallel} "
                                f"ranks, but this rank exchanges tokens with {experts.ranks if experts else 1}")
        self.routed: dict[int, list[int]] = {}  # stage -> the indices of its routed experts' weights
        for k in schedule.stages_on(device) if experts else ():
            place_experts(stages.modules[k], experts.exchange)
            names = [name for name, _ in stages.modules[k].named_parameters()]
            self.routed[k] = [names.index(name) for name in routed_parameters(stages.modules[k])]
        self.weights = {(k, r): StageWeights(stages.modules[k], spec.optimizer, spec.lr,
                                             label=f"stage {k} (pipeline {r}) on device {device}",
                                             device=self.torch_device)
                        for k in schedule.stages_on(device) for r in range(schedule.pipelines)}
        self.saved: dict[Unit, _Saved] = {}
        self.acts: dict[EdgeUnit, torch.Tensor] = {}  # an edge's activation: produced or received, not yet taken
        self.grads: dict[EdgeUnit, torch.Tensor] = {}  # an edge's gradient: computed or received, not yet taken
        self.sends: list[tuple[Handle, torch.Tensor | None]] = []  # sends in flight, with the tensor each holds
        self.losses: dict[tuple[int, int], float] = {}
        self.loss_parts: dict[tuple[int, int], int] = {}  # micro-batches whose loss `losses` holds
        self.unread_losses: list[tuple[Unit, torch.Tensor]] = []  # the last stage's losses not yet read
        self.reducing: dict[tuple[int, int], tuple[Pending, int]] = {}  # (stage, pipeline) -> all-reduce, row
        self.ledger = Ledger()
        self.taken: dict[int, int] = {}  # storages of the tensors the current row took: they may die with it
        self.drawn: dict[Unit, tuple[torch.Tensor, Any]] = {}  # a forward's micro-batch, drawn before its row
        self._passes = {Kind.F: self.forward, Kind.B: self.backward, Kind.I: self.backward_input,
                        Kind.W: self.backward_weight}
        self._plan_buffers()
        self._plan_averaging()
        self.pairs = PairStreams(lowered, device, self.torch_device)  # a pair's parts on two streams on a GPU

    # ------------------------------------------------------------------------------------------ planning

    def _buffer_key(self, i: int) -> BufferKey:
        t, lowered = self.lowered.table, self.lowered
        side = "B" if KINDS[t.kind[i]] in _BACKWARD else "F"
        return int(lowered.version[i]), int(lowered.prediction[i]), side

    def _plan_buffers(self) -> None:
        """From this device's rows: which buffer each PRED fills (its next op on the same micro-batch reads
        it), which buffer each predicted op reads, and after which row each buffer has had its last reader."""
        t, lowered = self.lowered.table, self.lowered
        rows = lowered.rows(self.device)
        self.fills: dict[int, tuple[int, int, BufferKey]] = {}  # PRED row -> (stage, pipeline, key)
        self.reads: dict[int, BufferKey] = {}
        self.frees: dict[int, list[tuple[int, int, BufferKey]]] = {}
        last_reader: dict[tuple[int, int, BufferKey], int] = {}

        def close(buffer: tuple[int, int, BufferKey]) -> None:  # free it after its last reader
            self.frees.setdefault(last_reader.pop(buffer), []).append(buffer)

        pending: dict[Unit, int] = {}  # unit -> its PRED row waiting for the op it predicts for
        for i in rows:
            kind = KINDS[t.kind[i]]
            unit = (int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]), int(t.pipeline[i]))
            if kind is Kind.PRED:
                pending[unit] = i
            elif kind in (Kind.F, *_BACKWARD) and int(lowered.prediction[i]) >= 0:
                key = self._buffer_key(i)
                buffer = (unit[0], unit[3], key)
                pred = pending.pop(unit, None)
                if pred is not None:
                    if int(lowered.version[pred]) != key[0]:
                        raise ExecutorError(f"device {self.device}: PRED row {pred} reads version "
                                            f"{int(lowered.version[pred])} but the op it predicts for, row {i}, "
                                            f"names version {key[0]}")
                    if buffer in last_reader:  # refilled: the previous fill's readers are done
                        close(buffer)
                    self.fills[pred] = buffer
                self.reads[i] = key
                last_reader[buffer] = i
        if pending:
            raise ExecutorError(f"device {self.device}: PRED row {min(pending.values())} is followed by no op on "
                                "predicted weights of its micro-batch")
        for buffer in list(last_reader):
            close(buffer)

    def _plan_averaging(self) -> None:
        """A reference model per stage this device averages (the initial weights), and the coefficient."""
        t, rows = self.lowered.table, self.lowered.rows(self.device)
        averaged = {int(t.stage[i]) for i in rows if KINDS[t.kind[i]] is Kind.AVG}
        self.references = {k: [w.detach().clone() for w in self.weights[(k, 0)].owned] for k in sorted(averaged)}
        self.alpha = 0.0
        if averaged:
            try:
                self.alpha = ScheduleParams(**self.lowered.schedule.params).alpha
            except (TypeError, ValueError) as exc:
                raise ExecutorError(f"{self.lowered.schedule.method}: AVG rows need the schedule's parameters "
                                    f"to give the elastic coefficient alpha ({exc})") from None

    # ------------------------------------------------------------------------------------------- helpers

    def _edge(self, row: int) -> tuple[int, int]:
        """The stage edge receive `row` carries (a gradient has its activation's shape)."""
        t = self.lowered.table
        stage, peer = int(t.stage[row]), int(t.peer[row])
        return (peer, stage) if KINDS[t.kind[row]] is Kind.RECV_F else (stage, peer)

    def _post(self, row: int) -> Handle:
        edge = self._edge(row)
        channel = int(self.lowered.channel_of(self.lowered.transfer[row]))
        return self.transport.recv(self.stages.edge_shapes[edge], self.stages.edge_dtypes[edge],
                                   self._rank(int(self.lowered.table.peer[row])), channel=channel)

    def _rank(self, stage: int) -> int:
        """The rank that holds `stage` in this replica."""
        return self.layout.rank(self.placement[stage], self.replica)

    def _posted_bytes(self, row: int) -> int:
        """The buffer a posted receive holds until its RECV row takes it."""
        edge = self._edge(row)
        return math.prod(self.stages.edge_shapes[edge]) * self.stages.edge_dtypes[edge].itemsize

    def _weights(self, i: int, unit: Unit) -> Weights:
        """The weights row i's op runs on: its prediction buffer, or the version it names."""
        state = self.weights[(unit[0], unit[3])]
        key = self.reads.get(i)
        return state.read(int(self.lowered.version[i])) if key is None else state.read_predicted(key)

    # ----------------------------------------------------------------------------------------- the ops

    def draw(self, unit: Unit) -> None:
        """Draw the micro-batch the forward of `unit` reads, where its stage reads the batch or computes the loss,
        onto the device, before the forward's row starts: host time between rows, as a training loop's data loader
        takes it, not the forward's (a GPT micro-batch of 4 x 1,024 tokens takes 2.8 ms to draw on the CPUs here,
        which on a GPU, whose rows are timed by events, held the device idle inside the row)."""
        stage, j, b, r = unit
        if self.stages.reads_batch[stage] or not self.stages.out_edges[stage]:
            data, target = microbatch_data(self.spec, self.stages.model, b, j, r, self.replica)
            self.drawn[unit] = (data.to(self.torch_device),
                                target.to(self.torch_device) if torch.is_tensor(target) else target)

    def forward(self, unit: Unit, weights: Weights) -> None:
        stage, j, b, r = unit
        state = self.weights[(stage, r)]
        inputs = []
        for src, dst in self.stages.in_edges[stage]:
            act = self._take(self.acts, (src, dst, j, b, r), f"forward of stage {stage} micro-batch {j} "
                             f"mini-batch {b} has no input from stage {src}")
            inputs.append(act.detach().requires_grad_(act.is_floating_point()))
        last = not self.stages.out_edges[stage]
        args = list(inputs)
        data, target = self.drawn.pop(unit, (None, None))
        if self.stages.reads_batch[stage]:
            args.insert(0, data)  # the batch: no gradient flows into it
        tape = Tape(weights, self.ledger)
        loss = (lambda out: self.stages.model.loss(out, target) / self.m) if last else None
        outputs = stage_forward(self.stages.modules[stage], state.parameters(weights), args, tape, loss)
        if last:  # read on the host after the row (`read_losses`)
            self.unread_losses.append((unit, outputs[0].detach()))
        else:
            for (src, dst), o in zip(self.stages.out_edges[stage], outputs):
                self.acts[(src, dst, j, b, r)] = o.detach()
        self.saved[unit] = _Saved(inputs, outputs, weights, tape)

    def _grad_outputs(self, unit: Unit) -> list[torch.Tensor | None]:
        stage, j, b, r = unit
        if not self.stages.out_edges[stage]:
            return [None]
        return [self._take(self.grads, (src, dst, j, b, r), f"backward of stage {stage} micro-batch {j} "
                           f"mini-batch {b} has no output gradient from stage {dst}")
                for src, dst in self.stages.out_edges[stage]]

    def _take(self, store: dict, key: tuple, missing: str) -> torch.Tensor:
        """Pop a tensor another op left (received, or handed over on this device); `missing` says which."""
        if key not in store:
            raise ExecutorError(f"device {self.device}: {missing} (received or local)")
        tensor = store.pop(key)
        self.taken.update([_storage(tensor)])
        return tensor

    def _hand_back(self, unit: Unit, dxs: list[torch.Tensor | None]) -> None:
        stage, j, b, r = unit
        for (src, dst), dx in zip(self.stages.in_edges[stage], dxs):
            if dx is not None:
                self.grads[(src, dst, j, b, r)] = dx

    def _saved_for(self, unit: Unit, what: str, weights: Weights) -> _Saved:
        saved = self.saved.get(unit)
        if saved is None:
            raise ExecutorError(f"device {self.device}: {what} of {unit} before its forward")
        saved.tape.backward = weights.tensors
        return saved

    def backward(self, unit: Unit, weights: Weights) -> None:
        saved = self._saved_for(unit, "backward", weights)
        del self.saved[unit]
        state = self.weights[(unit[0], unit[3])]
        dxs = full_backward(saved.outputs, self._grad_outputs(unit), saved.inputs, saved.weights.tensors,
                            state.grads, state.grad_dtype)
        self._hand_back(unit, dxs)

    def backward_input(self, unit: Unit, weights: Weights) -> None:
        saved = self._saved_for(unit, "input gradient", weights)
        dxs, saved.pending = backward_input(saved.outputs, self._grad_outputs(unit), saved.inputs,
                                            saved.weights.tensors)
        saved.outputs, saved.inputs = [], []  # W starts from what I recorded; the rest of the graph can go
        self._hand_back(unit, dxs)

    def backward_weight(self, unit: Unit, weights: Weights) -> None:
        saved = self._saved_for(unit, "weight gradient", weights)
        if saved.pending is None:
            raise ExecutorError(f"device {self.device}: weight gradient of {unit} before its input gradient")
        del self.saved[unit]
        state = self.weights[(unit[0], unit[3])]
        backward_weight(saved.pending, saved.weights.tensors, state.grads, state.grad_dtype)

    def average(self, stage: int) -> None:
        average_replicas([self.weights[(stage, r)] for r in range(self.pipelines)], self.references[stage], self.alpha)

    def reduce(self, row: int, stage: int, r: int) -> None:
        """Start averaging the stage replica's accumulated gradients over its data-parallel replicas (its routed
        experts' over the replicas that hold the same experts: executor/experts.py); its OPT waits (`reduced`)."""
        if self.replicas is None:
            raise ExecutorError(f"device {self.device}: a REDUCE row, but the run has no data-parallel replicas")
        state = self.weights[(stage, r)]
        state.grads = state.filled_grads()
        routed = self.routed.get(stage, [])
        if not routed:
            self.reducing[(stage, r)] = (self.replicas.start(state.grads), row)
            return
        experts = [state.grads[i].div_(self.experts.ranks) for i in routed]  # made by its group's E micro-batches
        started = [self.replicas.start([g for i, g in enumerate(state.grads) if i not in routed])]
        if self.experts.holders is not None:
            started.append(self.experts.holders.start(experts))
        self.reducing[(stage, r)] = (Joined(started), row)

    def reduced(self, stage: int, r: int) -> tuple[int, int] | None:
        """Wait for the stage replica's all-reduce, if one is under way: (its row, when it completed, ns)."""
        started = self.reducing.pop((stage, r), None)
        if started is None:
            return None
        pending, row = started
        return row, pending.wait()

    def _compute(self, i: int, kind: Kind, unit: Unit) -> tuple[int, int]:
        """Run compute row i; return the (version, prediction distance) its op used."""
        stage, r = unit[0], unit[3]
        state = self.weights[(stage, r)]
        if kind is Kind.F or kind in _BACKWARD:
            weights = self._weights(i, unit)
            self._passes[kind](unit, weights)
            return weights.version, weights.distance
        if kind is Kind.OPT:
            state.step(keep_old=int(self.lowered.copies_delta[i]) > 0)
            return -1, -1
        if kind is Kind.PRED:
            if i not in self.fills:
                raise ExecutorError(f"device {self.device}: PRED row {i} fills no buffer an op reads")
            state.predict(self.fills[i][2])
            return self.fills[i][2][0], -1
        if kind is Kind.AVG:
            self.average(stage)
            return state.version, -1
        raise ExecutorError(f"device {self.device}: {kind.value} rows are not implemented in the executor")

    # ---------------------------------------------------------------------------------------- measuring

    def _held(self) -> int:
        """Weight copies of the fullest stage: every pipeline's replica of it (versions, prediction buffers) and
        the stage's reference model."""
        per_stage: dict[int, int] = {}
        for (k, _), state in self.weights.items():
            per_stage[k] = per_stage.get(k, int(k in self.references)) + state.held()
        return max(per_stage.values(), default=0)

    def _weight_storage(self) -> dict[int, int]:
        tensors = [t for state in self.weights.values() for t in state.tensors()]
        tensors += [t for reference in self.references.values() for t in reference]
        return bytes_by_storage(tensors)

    def _memory(self, weight_storage: dict[int, int], freed: int, posted_bytes: int) -> tuple[int, int, int]:
        """Bytes held after the current row, and at its end before it let go of `freed` bytes of weights and
        of the tensors it took (received or handed over) that nothing holds any more: its peak; and of the first,
        those only sends in flight hold. A posted receive's buffer (`posted_bytes` in all) is held from its
        posting, as the transport allocated it."""
        if self.on_cuda:  # one read of the allocator's counters: memory_allocated and max_memory_allocated each
            # flatten and sort every one of them in Python (torch.cuda.memory_stats: 61 us a call on the CPUs here)
            allocated = torch.cuda.memory_stats_as_nested_dict(self.torch_device)["allocated_bytes"]["all"]
            return int(allocated["current"]), int(allocated["peak"]), 0
        waiting = bytes_by_storage([*self.acts.values(), *self.grads.values()])
        sending = bytes_by_storage([t for _, t in self.sends if t is not None])
        # a forward's inputs and outputs (the backward's roots) stay in its graph until its backward, or its
        # input-gradient half, runs, and the gradients that half recorded for its weight half until that runs
        # (`PendingWeightGrad.gradients`); its weights count while their replica holds them (`weight_storage`):
        # let go of, they are spares, the allocator's free memory, or have no storage left (weights.py)
        graphs = bytes_by_storage([*(t for saved in self.saved.values() for t in (*saved.inputs, *saved.outputs)),
                                   *(t for saved in self.saved.values() if saved.pending
                                     for t in saved.pending.gradients())])
        held = {**weight_storage, **graphs, **self.ledger.by_storage(), **waiting}
        sending_only = sum(nbytes for ptr, nbytes in sending.items() if ptr not in held)
        held.update(sending)
        dropped = sum(nbytes for ptr, nbytes in self.taken.items() if ptr not in held)
        total = sum(held.values()) + posted_bytes
        return total, total + freed + dropped, sending_only

    def read_losses(self) -> None:
        """Add the losses the last stage's forwards computed to their mini-batches'; a non-finite one stops the run.
        Reading one waits for it on a GPU, so a pair's forward part leaves its loss to be read after the pair."""
        for (stage, j, b, r), loss in self.unread_losses:
            value = float(loss)
            if not math.isfinite(value):
                raise DivergedError(f"loss is {value} at mini-batch {b} (pipeline {r}) on stage {stage} "
                                    f"(micro-batch {j}): training diverged; lower the learning rate")
            self.losses[(r, b)] = self.losses.get((r, b), 0.0) + value
            self.loss_parts[(r, b)] = self.loss_parts.get((r, b), 0) + 1
        self.unread_losses.clear()

    def finished_losses(self) -> dict[tuple[int, int], float]:
        """Per (pipeline, mini-batch), the loss of those whose every micro-batch this device's last stage ran."""
        return {key: value for key, value in self.losses.items() if self.loss_parts[key] == self.m}

    # -------------------------------------------------------------------------------------------- loop

    def run(self) -> DeviceResult:
        lowered = self.lowered
        t = lowered.table
        rows = lowered.rows(self.device)
        lo, n = rows.start, len(rows)
        result = self.result = DeviceResult(self.device, _int_array(n), _int_array(n), _int_array(n),
                                            _int_array(n, -1), _int_array(n, -1), *(_int_array(n) for _ in range(3)),
                                            send_cpu_ns=_int_array(n, -1), wait_ns=_int_array(n, -1),
                                            sending_bytes=_int_array(n),
                                            compute=f"{socket.gethostname()}/{self.torch_device}",
                                            bounds=list(self.stages.bounds), routed=self.routed)
        receives = [i for i in rows if KINDS[t.kind[i]] in (Kind.RECV_F, Kind.RECV_B)]
        posted: dict[int, Handle] = {}
        buffer_bytes = {i: self._posted_bytes(i) for i in receives}
        next_post = 0
        window = max(1, self.spec.recv_window)
        level = self._held()
        weight_storage = {} if self.on_cuda else self._weight_storage()
        gpu_clock = _GpuClock(self.torch_device) if self.on_cuda else None
        all_to_alls = AllToAllRows(lowered, self.device, self.experts.exchange) if self.experts else None
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.torch_device)  # each row's peak is its own
        done = 0
        try:
            held_before = 0  # bytes held after the previous row (CPU): a row holds at least that at its start
            for i in rows:
                while next_post < len(receives) and (len(posted) < window or receives[next_post] <= i):
                    posted[receives[next_post]] = self._post(receives[next_post])
                    held_before += buffer_bytes[receives[next_post]]
                    next_post += 1
                kind = KINDS[t.kind[i]]
                stage, j, b, r = int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]), int(t.pipeline[i])
                peer = int(t.peer[i])
                freed = 0  # bytes of weights the row let go of at its end
                # a B or W adds into the mini-batch's gradient buffer, creating it only where it is still empty
                starts_buffer = kind in _FILLING and any(g is None for g in self.weights[(stage, r)].grads)
                if starts_buffer and self.replicas is not None and not self.routed.get(stage):
                    self.weights[(stage, r)].start_bucket()
                if kind is Kind.OPT and (reduced := self.reduced(stage, r)) is not None:
                    result.end_ns[reduced[0] - lo] = reduced[1]
                if kind is Kind.F:
                    self.draw((stage, j, b, r))
                result.start_ns[i - lo] = time.perf_counter_ns()
                if kind is Kind.SEND_F or kind is Kind.SEND_B:
                    tensor = (self.acts.pop((stage, peer, j, b, r)) if kind is Kind.SEND_F
                              else self.grads.pop((peer, stage, j, b, r)))
                    cpu_ns = time.thread_time_ns()
                    handle = self.transport.send(tensor, self._rank(peer), channel=self._channel(i))
                    # on CPU the books count a sent tensor until its send completes; on CUDA the allocator
                    # does, and the transport holds what it needs (a host-staged send, only its host copy)
                    self.sends.append((handle, None if self.on_cuda else tensor))
                    result.send_cpu_ns[i - lo] = time.thread_time_ns() - cpu_ns
                elif kind is Kind.RECV_F:
                    self.acts[(peer, stage, j, b, r)] = posted.pop(i).wait(self.spec.timeout_s)
                elif kind is Kind.RECV_B:
                    self.grads[(stage, peer, j, b, r)] = posted.pop(i).wait(self.spec.timeout_s)
                elif kind is Kind.REDUCE:
                    self.reduce(i, stage, r)
                elif kind in ALL_TO_ALL_KINDS:
                    pass  # its pass ran its exchanges (`AllToAllRows`)
                else:
                    asked_ns = time.perf_counter_ns()
                    with self.compute_lock, self.pairs.around(i):
                        if self.shares_gpu:  # the other ranks' compute, which the simulator runs on the GPU too
                            result.wait_ns[i - lo] = time.perf_counter_ns() - asked_ns
                        began = gpu_clock.mark() if gpu_clock else None
                        used = self._compute(i, kind, (stage, j, b, r))
                        if gpu_clock:  # ranks that take turns on one GPU hold it until their kernels finish
                            gpu_clock.time(i - lo, began, wait=self.shares_gpu)
                        result.version[i - lo], result.prediction[i - lo] = used
                        version = int(lowered.version[i])
                        if int(lowered.copies_delta[i]) < 0 and version >= 0:
                            freed += self.weights[(stage, r)].release(version)
                        for k, q, key in self.frees.get(i, ()):
                            freed += self.weights[(k, q)].free_predicted(key)
                    if i not in self.pairs.forward_parts:  # a pair's loss once both parts are issued
                        self.read_losses()
                result.end_ns[i - lo] = time.perf_counter_ns()  # a REDUCE's: when it completed, once its OPT knows
                if all_to_alls is not None:
                    result.start_ns[i - lo], result.end_ns[i - lo] = all_to_alls.place(
                        i, int(result.start_ns[i - lo]), int(result.end_ns[i - lo]))
                if kind not in _TRANSFERS:
                    level = self._held()
                    # The tensors weights, gradients and buffers hold change only where an update, prediction or
                    # averaging runs, a gradient buffer starts, or a row is the last to read a version or buffer;
                    # the walk over them is left out elsewhere (after a large compute row it runs on cold caches:
                    # 70 us after a B of a 9-layer, 1 MiB-per-layer stage on the CPUs here, half its gap).
                    touched = (kind not in _PASSES or starts_buffer or i in self.frees
                               or int(lowered.copies_delta[i]) < 0)
                    if touched and not self.on_cuda:
                        weight_storage = self._weight_storage()
                result.held[i - lo] = level
                self.sends = self._in_flight()
                # a taken receive's buffer is counted among the received tensors from its row on
                posted_bytes = sum(buffer_bytes[k] for k in posted)
                held_after, peak, result.sending_bytes[i - lo] = self._memory(weight_storage, freed, posted_bytes)
                # a backward frees its micro-batch's activations as it runs: its peak is at its start
                result.memory_bytes[i - lo] = held_after
                result.peak_bytes[i - lo] = peak if self.on_cuda else max(peak, held_before)
                held_before = held_after
                self.taken.clear()
                if self.on_cuda:
                    torch.cuda.reset_peak_memory_stats(self.torch_device)
                result.activation_bytes[i - lo] = self.ledger.total
                done += 1
                if self.on_row is not None:
                    self.on_row(i)
            for handle, _ in self.sends:
                handle.wait(self.spec.timeout_s)
            if gpu_clock:
                gpu_clock.resolve(result.start_ns, result.end_ns)
        except Exception as exc:
            last = f"row {lo + done}" if done < n else "the final sends"
            result.error = f"device {self.device} failed at {last}: {type(exc).__name__}: {exc}"
            raise
        finally:
            result.rows_done = done
            result.losses = dict(self.losses)
        self.sends.clear()
        result.weights = {key: [_host_copy(w) for w in state.owned] for key, state in self.weights.items()}
        return result

    def _in_flight(self) -> list[tuple[Handle, torch.Tensor | None]]:
        """The sends not yet complete; a completed one is waited on as it goes, so a failed send fails its
        rank here."""
        flying = []
        for handle, tensor in self.sends:
            if handle.done():
                handle.wait(self.spec.timeout_s)
            else:
                flying.append((handle, tensor))
        return flying

    def _channel(self, row: int) -> int:
        return int(self.lowered.channel_of(self.lowered.transfer[row]))


class _GpuClock:
    """Compute rows on a GPU timed by CUDA events, on the host's monotonic clock: one anchor event whose host
    time is read as soon as it completes converts every event (GPU and host clocks drift apart by parts per
    million; re-anchoring each mini-batch would take a synchronisation that changes the timeline it measures).
    Transfers keep their host times: a receive's wait is the host's."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.anchor = self.mark()
        self.anchor.synchronize()
        self.anchor_ns = time.perf_counter_ns()
        self.rows: list[tuple[int, Any, Any]] = []

    @staticmethod
    def mark() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def time(self, row: int, began: Any, wait: bool) -> None:
        """Row `row` ran from event `began` to now; `wait`: block until its kernels are done."""
        ended = self.mark()
        self.rows.append((row, began, ended))
        if wait:
            ended.synchronize()

    def resolve(self, start_ns: np.ndarray, end_ns: np.ndarray) -> None:
        """Overwrite the host times of the timed rows with their events' (waits for the last kernels)."""
        torch.cuda.synchronize()
        for row, began, ended in self.rows:
            start_ns[row] = self.anchor_ns + round(self.anchor.elapsed_time(began) * 1e6)
            end_ns[row] = self.anchor_ns + round(self.anchor.elapsed_time(ended) * 1e6)


def _host_copy(weight: torch.Tensor) -> np.ndarray:
    """A weight as a numpy array of its own; numpy has no bfloat16, so that one is widened to float32 (exactly)."""
    weight = weight.detach()
    return (weight.float() if weight.dtype == torch.bfloat16 else weight).cpu().numpy().copy()
