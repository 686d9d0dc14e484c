"""One device's loop over its lowered rows: the executor's core.

A device walks its rows in order. RECV waits for a receive posted ahead of time (in row order, which per
channel is the order its peer sends in) and is timed as the wait; F, B, I and W run on the weight version the
row names; SEND is issued and not waited on until the end; OPT applies the optimizer, copy-on-write when the
lowering says a later row still reads the old version; a version is dropped after its last read. Nothing here
knows a method by name: every decision comes from the lowered rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call

from ..schedules import KINDS, Kind, Lowered
from ..workload.transport import Handle, Transport
from .backward import PendingWeightGrad, backward_input, backward_weight, full_backward
from .stages import ExecutorError, RunSpec, Stages, microbatch_data
from .weights import StageWeights

Unit = tuple[int, int, int, int]  # (stage, micro-batch, mini-batch, pipeline)


@dataclass
class _Saved:
    """What a forward leaves for its backward."""

    x: torch.Tensor | None  # the stage's input (a leaf), None on the first stage
    output: torch.Tensor | None  # the stage's output, or the last stage's loss
    version: int
    weights: list[torch.Tensor]
    pending: PendingWeightGrad | None = None  # after I, until W


@dataclass
class DeviceResult:
    """What a device reports: per row (its rows in order) start and end on the monotonic clock (ns), the
    weight copies its fullest stage held after each row, the loss per (pipeline, mini-batch) when it holds a
    last stage, and every stage replica's final weights (numpy, in the stage module's parameter order)."""

    device: int
    start_ns: np.ndarray
    end_ns: np.ndarray
    held: np.ndarray
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    weights: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    rows_done: int = 0
    error: str | None = None


class DeviceLoop:
    """Runs device `device`'s rows of `lowered` on `stages` over `transport` (rank = device)."""

    def __init__(self, spec: RunSpec, lowered: Lowered, stages: Stages, device: int, transport: Transport) -> None:
        self.spec, self.lowered, self.stages, self.device = spec, lowered, stages, device
        self.transport = transport
        schedule = lowered.schedule
        self.m = schedule.microbatches
        self.graph = schedule.graph
        self.placement = schedule.placement
        self.weights = {(k, r): StageWeights(stages.modules[k], spec.optimizer, spec.lr,
                                             label=f"stage {k} (pipeline {r}) on device {device}")
                        for k in schedule.stages_on(device) for r in range(schedule.pipelines)}
        self.saved: dict[Unit, _Saved] = {}
        self.acts: dict[Unit, torch.Tensor] = {}  # a stage's output, until sent or taken by a local successor
        self.grads_out: dict[Unit, torch.Tensor] = {}  # gradient of a stage's output, received or local
        self.grads_in: dict[Unit, torch.Tensor] = {}  # gradient of a stage's input, until sent or taken locally
        self.received: dict[Unit, torch.Tensor] = {}  # forward activations received, by receiving stage
        self.sends: list[tuple[Handle, torch.Tensor]] = []
        self.losses: dict[tuple[int, int], float] = {}

    # ------------------------------------------------------------------------------------------- helpers

    def _first(self, stage: int) -> bool:
        return not self.graph.preds[stage]

    def _last(self, stage: int) -> bool:
        return not self.graph.succs[stage]

    def _local(self, stage: int) -> bool:
        return self.placement[stage] == self.device

    def _input(self, unit: Unit) -> torch.Tensor | None:
        stage, j, b, r = unit
        if self._first(stage):
            return None
        prev = (stage - 1, j, b, r)
        source = self.acts if self._local(stage - 1) else self.received
        key = prev if self._local(stage - 1) else unit
        if key not in source:
            raise ExecutorError(f"device {self.device}: forward of stage {stage} micro-batch {j} mini-batch {b} "
                                "has no input (received or local)")
        return source.pop(key)

    def _post(self, row: int) -> Handle:
        t, lowered = self.lowered.table, self.lowered
        kind = KINDS[t.kind[row]]
        stage, peer = int(t.stage[row]), int(t.peer[row])
        producer = peer if kind is Kind.RECV_F else stage  # a gradient has the shape of the output it belongs to
        channel = int(lowered.channel_of(lowered.transfer[row]))
        return self.transport.recv(self.stages.out_shapes[producer], self.stages.out_dtypes[producer],
                                   self.placement[peer], channel=channel)

    # ----------------------------------------------------------------------------------------- the ops

    def forward(self, unit: Unit, version: int) -> None:
        stage, j, b, r = unit
        state = self.weights[(stage, r)]
        received = self._input(unit)
        target = None
        if received is None or self._last(stage):
            data, target = microbatch_data(self.spec, self.stages.model, b, j, r)
        if received is None:
            x, kept = data, None  # the batch: no gradient flows into it
        else:
            x = kept = received.detach().requires_grad_(received.is_floating_point())
        weights = state.read(version)
        out = functional_call(self.stages.modules[stage], state.parameters(version), (x,))
        if self._last(stage):
            loss = self.stages.model.loss(out, target) / self.m
            self.losses[(r, b)] = self.losses.get((r, b), 0.0) + float(loss.detach())
            out_or_loss = loss
        else:
            out_or_loss = out
            self.acts[unit] = out.detach()
        self.saved[unit] = _Saved(kept, out_or_loss, version, weights)

    def _grad_output(self, unit: Unit) -> torch.Tensor | None:
        stage, j, b, r = unit
        if self._last(stage):
            return None
        if unit not in self.grads_out:
            raise ExecutorError(f"device {self.device}: backward of stage {stage} micro-batch {j} mini-batch {b} "
                                "has no output gradient (received or local)")
        return self.grads_out.pop(unit)

    def _hand_back(self, unit: Unit, dx: torch.Tensor | None) -> None:
        stage, j, b, r = unit
        if self._first(stage) or dx is None:
            return
        if self._local(stage - 1):
            self.grads_out[(stage - 1, j, b, r)] = dx
        else:
            self.grads_in[unit] = dx

    def _saved(self, unit: Unit, version: int, what: str) -> _Saved:
        saved = self.saved.get(unit)
        if saved is None:
            raise ExecutorError(f"device {self.device}: {what} of {unit} before its forward")
        if saved.version != version:
            raise ExecutorError(f"device {self.device}: {what} of stage {unit[0]} micro-batch {unit[1]} reads "
                                f"weight version {version} but its forward ran on version {saved.version}; a "
                                "backward on other weights than its forward's is not supported yet")
        return saved

    def backward(self, unit: Unit, version: int) -> None:
        saved = self._saved(unit, version, "backward")
        del self.saved[unit]
        dx, dw = full_backward(saved.output, self._grad_output(unit), saved.x, saved.weights)
        self.weights[(unit[0], unit[3])].accumulate(dw)
        self._hand_back(unit, dx)

    def backward_input(self, unit: Unit, version: int) -> None:
        saved = self._saved(unit, version, "input gradient")
        dx, saved.pending = backward_input(saved.output, self._grad_output(unit), saved.x, saved.weights)
        saved.output = saved.x = None  # W starts from what I recorded; the rest of the graph can go
        self._hand_back(unit, dx)

    def backward_weight(self, unit: Unit, version: int) -> None:
        saved = self._saved(unit, version, "weight gradient")
        if saved.pending is None:
            raise ExecutorError(f"device {self.device}: weight gradient of {unit} before its input gradient")
        del self.saved[unit]
        self.weights[(unit[0], unit[3])].accumulate(backward_weight(saved.pending, saved.weights))

    # -------------------------------------------------------------------------------------------- loop

    def run(self) -> DeviceResult:
        lowered = self.lowered
        t = lowered.table
        rows = lowered.rows(self.device)
        lo, n = rows.start, len(rows)
        start = np.zeros(n, dtype=np.int64)
        end = np.zeros(n, dtype=np.int64)
        held = np.zeros(n, dtype=np.int64)
        receives = [i for i in rows if KINDS[t.kind[i]] in (Kind.RECV_F, Kind.RECV_B)]
        posted: dict[int, Handle] = {}
        next_post = 0
        window = max(1, self.spec.recv_window)
        level = max(state.held() for state in self.weights.values()) if self.weights else 0
        done = 0
        result = DeviceResult(self.device, start, end, held)
        try:
            for i in rows:
                while next_post < len(receives) and (len(posted) < window or receives[next_post] <= i):
                    posted[receives[next_post]] = self._post(receives[next_post])
                    next_post += 1
                kind = KINDS[t.kind[i]]
                stage, j, b, r = int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]), int(t.pipeline[i])
                unit = (stage, j, b, r)
                version = int(lowered.version[i])
                if int(lowered.prediction[i]) >= 0:
                    raise ExecutorError(f"device {self.device}: row {i} runs on predicted weights; weight "
                                        "prediction (PRED) is not implemented in the executor yet")
                start[i - lo] = time.perf_counter_ns()
                if kind is Kind.F:
                    self.forward(unit, version)
                elif kind is Kind.B:
                    self.backward(unit, version)
                elif kind is Kind.I:
                    self.backward_input(unit, version)
                elif kind is Kind.W:
                    self.backward_weight(unit, version)
                elif kind is Kind.OPT:
                    self.weights[(stage, r)].step(keep_old=int(lowered.copies_delta[i]) > 0)
                elif kind is Kind.SEND_F or kind is Kind.SEND_B:
                    tensor = (self.acts if kind is Kind.SEND_F else self.grads_in).pop(unit)
                    dst = self.placement[int(t.peer[i])]
                    channel = int(lowered.channel_of(lowered.transfer[i]))
                    self.sends.append((self.transport.send(tensor, dst, channel=channel), tensor))
                elif kind is Kind.RECV_F or kind is Kind.RECV_B:
                    tensor = posted.pop(i).wait(self.spec.timeout_s)
                    (self.received if kind is Kind.RECV_F else self.grads_out)[unit] = tensor
                else:
                    raise ExecutorError(f"device {self.device}: {kind.value} rows are not implemented in the "
                                        "executor yet")
                if int(lowered.copies_delta[i]) < 0 and version >= 0:
                    self.weights[(stage, r)].release(version)
                end[i - lo] = time.perf_counter_ns()
                if kind not in _TRANSFERS:
                    level = max(state.held() for state in self.weights.values())
                held[i - lo] = level
                done += 1
            for handle, _ in self.sends:
                handle.wait(self.spec.timeout_s)
        except Exception as exc:
            last = f"row {lo + done}" if done < n else "the final sends"
            result.error = f"device {self.device} failed at {last}: {type(exc).__name__}: {exc}"
            raise
        finally:
            result.rows_done = done
            result.losses = dict(self.losses)
        self.sends.clear()
        result.weights = {key: [w.detach().cpu().numpy().copy() for w in state.current]
                          for key, state in self.weights.items()}
        return result


_TRANSFERS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B})

