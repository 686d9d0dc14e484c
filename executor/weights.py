"""A stage's weights as explicit versions, per pipeline replica.

Version v is a list of leaf tensors; forwards run on the version their row names through
`torch.func.functional_call`, so autograd's graph holds exactly those tensors. The newest version is the one
the optimizer owns. An update is copy-on-write: when a later row still reads the version being superseded
(the lowering says so), the optimizer moves on to fresh copies and the old tensors stay untouched for the
graphs that hold them; otherwise it updates in place. A superseded version is dropped after its last read.
Gradients of a mini-batch's micro-batches accumulate in one buffer that the update consumes, so the optimizer
sees what a single-process run's `.grad` would hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..workload.optim import make_optimizer
from .stages import ExecutorError


class StageWeights:
    """The versions of one stage's weights in one pipeline replica, and its optimizer."""

    def __init__(self, module: nn.Module, optimizer: str, lr: float, *, label: str) -> None:
        self.label = label  # "stage 2 (pipeline 0)", for errors
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.buffers = dict(module.named_buffers())
        current = [p.detach().clone().requires_grad_(True) for _, p in named]
        self.optimizer = make_optimizer(optimizer, current, lr)
        self.version = 0
        self.versions: dict[int, list[torch.Tensor]] = {0: current}
        self.grads: list[torch.Tensor] | None = None

    @property
    def current(self) -> list[torch.Tensor]:
        return self.versions[self.version]

    def read(self, version: int) -> list[torch.Tensor]:
        if version not in self.versions:
            raise ExecutorError(f"{self.label}: weight version {version} is not held (holding "
                                f"{sorted(self.versions)}; newest {self.version})")
        return self.versions[version]

    def parameters(self, version: int) -> dict[str, torch.Tensor]:
        """Name -> tensor of `version`, with the module's buffers, for functional_call."""
        return {**dict(zip(self.names, self.read(version))), **self.buffers}

    def accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        if self.grads is None:
            self.grads = [torch.zeros_like(w) for w in self.current]
        for buffer, grad in zip(self.grads, grads):
            if grad is not None:
                buffer.add_(grad)

    @torch.no_grad()
    def step(self, keep_old: bool) -> None:
        """Apply the optimizer to the accumulated gradients: version v -> v + 1. `keep_old`: a later row still
        reads version v, so the update goes to copies and v stays as it is."""
        old = self.current
        if keep_old:
            new = [w.detach().clone().requires_grad_(True) for w in old]
            group = self.optimizer.param_groups[0]
            group["params"] = new
            for before, after in zip(old, new):
                if before in self.optimizer.state:
                    self.optimizer.state[after] = self.optimizer.state.pop(before)
        else:
            new = old
            del self.versions[self.version]
        grads = self.grads if self.grads is not None else [torch.zeros_like(w) for w in new]
        for weight, grad in zip(new, grads):
            weight.grad = grad
        self.optimizer.step()
        for weight in new:
            weight.grad = None
        self.grads = None
        self.version += 1
        self.versions[self.version] = new

    def release(self, version: int) -> None:
        """Drop `version` after its last read (never the newest: the optimizer owns it)."""
        if version != self.version:
            self.versions.pop(version, None)

    def held(self) -> int:
        return len(self.versions)
