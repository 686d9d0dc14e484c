"""Calibration's transient bytes per pass (calibrate/measure.py `measure_transients`): on a GPU, what the caching
allocator holds at a pass's peak above the most it holds before and after the pass; on a CPU none. No GPU here: a
layer's autograd function moves a fake allocator counter, as a GPU's kernels would move the real one."""

import torch
from torch import nn

from pipesim.calibrate.measure import Settings, measure_bytes, measure_transients
from pipesim.workload.models import Model

KEPT, FORWARD, BACKWARD = 1000, 300, 500  # bytes a forward saves, and what each pass makes and frees within itself


class _Allocator:
    """torch.cuda's allocated-bytes counters, driven by hand."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)


ALLOCATOR = _Allocator()


class _Scratch(torch.autograd.Function):
    """Saves KEPT bytes and uses FORWARD more for a moment; its backward uses BACKWARD for a moment, then frees what
    the forward saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ALLOCATOR.add(KEPT)
        ALLOCATOR.add(FORWARD)
        ALLOCATOR.add(-FORWARD)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        ALLOCATOR.add(BACKWARD)
        ALLOCATOR.add(-BACKWARD)
        ALLOCATOR.add(-KEPT)
        return grad.clone()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scratch.apply(self.linear(x))


def _model() -> Model:
    return Model("scratch", [nn.Linear(4, 4), _Layer(), nn.Linear(4, 1)],
                 lambda b, g: (torch.randn(b, 4, generator=g), torch.randn(b, 1, generator=g)),
                 lambda y, target: ((y - target) ** 2).mean())


def test_a_gpu_calibration_records_what_each_pass_makes_and_frees_within_itself(monkeypatch):
    """The peak less the most held before and after: a forward's scratch above what it saves, a backward's above
    the activations it frees at its end (held until then, as the simulator holds them), in both halves of the split
    backward as this layer runs them (its scratch in the input-gradient half); nothing for a layer that makes
    none. A CPU records none: its runs count the tensors their rows hold, no allocator's peak."""
    model = _model()
    cpu = Settings(torch.device("cpu"), torch.float32, 2, warmup=0, repeats=1)
    recording, layers = measure_bytes(model, cpu)
    assert measure_transients(model, cpu, recording, layers) == layers
    assert all(layer.transient_bytes == {} for layer in layers)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: ALLOCATOR.current)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: ALLOCATOR.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(ALLOCATOR, "peak", ALLOCATOR.current))
    gpu = Settings(torch.device("cuda"), torch.float32, 2, warmup=0, repeats=1)
    measured = measure_transients(model, gpu, recording, layers)
    assert [layer.transient_bytes for layer in measured] == [
        {"fwd": 0, "bwd": 0, "igrad": 0, "wgrad": 0},
        {"fwd": FORWARD, "bwd": BACKWARD, "igrad": BACKWARD, "wgrad": 0},
        {"fwd": 0, "bwd": 0, "igrad": 0, "wgrad": 0}]
    assert [layer.model_copy(update={"transient_bytes": {}}) for layer in measured] == layers
