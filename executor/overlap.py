"""An overlapped F&B pair's two parts on two CUDA streams, as DeepSeek's DualPipe overlaps them.

DualPipe (deepseek-ai/DualPipe, dualpipe.py `_forward_backward_chunk`) receives both parts' inputs, runs the
forward of one micro-batch together with the backward of another (`overlapped_forward_backward`, which the model
implements), then sends both parts' outputs. On a GPU the executor runs a pair's forward part on one side stream
and its backward part on the other: each side stream first waits for the device's own stream (where the receives
before the pair landed and every earlier row ran), and after the backward part the device's stream waits for
both (the sends after the pair, and every later row, see both results). Every pair thus starts and ends in step
with the rows around it, so a tensor one stream made and another freed is never reused before that stream is
done with it.

Autograd runs each backward kernel on the stream its forward kernel ran on (torch's "stream semantics of backward
passes"), so the stream a backward part's kernels use is the one its micro-batch's forward used: the device's
stream, or a side stream if that forward was itself a pair's part. The pair's forward part takes the side stream
that is not that one, so the two parts' kernels really run side by side. On CPU, or where ranks take turns on one
GPU (each row waits for its kernels there), the parts run one after the other, as the IR orders them. A loss a
forward part computes is read on the host (which waits for it) only after the pair (`DeviceLoop.read_losses`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..schedules import KINDS, Kind, Lowered

Unit = tuple[int, int, int, int]  # (stage, micro-batch, mini-batch, pipeline)


class PairStreams:
    """Where device `device`'s pair parts run: `side[row]`, the side stream (0 or 1) of each part's row, planned
    from the rows alone; on a GPU `around(row)` wraps a compute row's work (its timing events too) in that
    stream, and is no context at all for other rows or off a GPU."""

    def __init__(self, lowered: Lowered, device: int, torch_device: torch.device) -> None:
        t = lowered.table
        forward, backward, input_grad = (KINDS.index(k) for k in (Kind.F, Kind.B, Kind.I))

        def unit(row: int) -> Unit:
            return int(t.stage[row]), int(t.microbatch[row]), int(t.minibatch[row]), int(t.pipeline[row])

        self.side: dict[int, int] = {}
        self.seconds: set[int] = set()  # the backward parts' rows: the pair ends with them
        forward_side: dict[Unit, int] = {}  # a pair's forward part's unit -> its side stream, until its backward
        rows = lowered.rows(device)
        for i in rows[:-1]:
            if t.kind[i] == forward and t.peer[i] >= 0 and t.kind[i + 1] == backward and t.peer[i + 1] >= 0:
                # the side its partner's kernels do not use (they run where that micro-batch's forward ran)
                self.side[i] = 1 - forward_side.pop(unit(i + 1), 1)
                self.side[i + 1] = 1 - self.side[i]
                self.seconds.add(i + 1)
                forward_side[unit(i)] = self.side[i]
            elif t.kind[i] in (backward, input_grad) and i not in self.seconds:
                forward_side.pop(unit(i), None)
        self.forward_parts = {i - 1 for i in self.seconds}
        self.on_gpu = torch_device.type == "cuda" and bool(self.side)
        self.device_stream = torch.cuda.current_stream(torch_device) if self.on_gpu else None
        self.sides = (torch.cuda.Stream(torch_device), torch.cuda.Stream(torch_device)) if self.on_gpu else ()

    @contextlib.contextmanager
    def around(self, row: int) -> Iterator[None]:
        side = self.side.get(row)
        if not self.on_gpu or side is None:
            yield
            return
        stream = self.sides[side]
        stream.wait_stream(self.device_stream)
        with torch.cuda.stream(stream):
            yield
        if row in self.seconds:
            for each in self.sides:
                self.device_stream.wait_stream(each)
