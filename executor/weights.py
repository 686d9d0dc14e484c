"""A stage's weights as explicit versions, per pipeline replica, and the predicted weights computed from them.

Version v is a list of leaf tensors; forwards run on the version their row names through
`torch.func.functional_call`, so autograd's graph holds exactly those tensors. The newest version is the one
the optimizer owns (a 16-bit stage's: the one its float32 masters are cast into, below). An update is
copy-on-write: when a later row still reads the version being superseded (the lowering says so), the update
goes to fresh copies and the old tensors stay untouched for the graphs that hold them; otherwise it updates in
place. A superseded version is dropped after its last read. Gradients of a mini-batch's micro-batches accumulate
in one buffer that the update consumes, so the optimizer sees what a single-process run's `.grad` would hold;
the update leaves that gradient on the weights it owns, since plain SGD's prediction extrapolates the last
gradient.

Predicted weights live in buffers keyed by (version, distance, side): `predict` fills one from the newest
version and the optimizer's state (`workload.optim.predict_weights`); ops on predicted weights read it; the
loop frees it after its last reader. Forward and backward buffers are separate sides even when equal.

A freed version or prediction goes to the replica's `spares` (on CPU; workload/optim.py `Spares`), whence the
next copy-on-write update's copies, prediction, elastic average and Adam step take their tensors, as PipeDream's
and SpecTrain's runtimes rotate a queue of weight copies made once: these ops then run without the allocator,
here as where calibration times them (calibrate/measure.py `measure_steps`).

A 16-bit stage trains in mixed precision as Megatron-LM does (`Float16OptimizerWithFloat16Params`, and
`accumulate_allreduce_grads_in_fp32`, which its arguments.py forces on for --bf16; sim/costs.py's "megatron"
precision): the optimizer owns float32 master weights and keeps its state in float32; the versions the passes
read are 16-bit copies, made from the masters after each update (in place, or fresh copies where a later row
still reads the old version); each micro-batch's 16-bit weight gradients are added into float32 main gradients
as autograd makes them (`main_dtype`), which the replicas all-reduce and the update consumes. Predictions
and elastic averaging work on the masters too. Updating 16-bit weights in place instead lost every step whose
lr x gradient fell below bfloat16's resolution: a GPT's loss did not move in 40 steps. No loss scaling: a
float16 gradient that underflows is lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..workload.optim import Spares, elastic_average, make_optimizer, predict_weights
from .replicas import bucket, flat_buffer
from .stages import DTYPES, ExecutorError

BufferKey = tuple[int, int, str]  # (version predicted from, distance s, "F" or "B")
HALF_DTYPES = (torch.bfloat16, torch.float16)  # weights trained in mixed precision
MAIN_DTYPE = torch.float32  # mixed precision's master weights, main gradients and optimizer state


def main_dtype(weights: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype mixed precision keeps the master copies, main gradients and optimizer state of `weights` in;
    None where none is 16-bit: the optimizer updates them and their gradients accumulate, in their own."""
    return MAIN_DTYPE if any(w.dtype in HALF_DTYPES for w in weights) else None


def trained_in(dtype: str) -> str:
    """What a run whose model is in `dtype` (a RunSpec's name of it) trains in, as its table says it."""
    return f"{dtype} with float32 master weights and gradients" if DTYPES.get(dtype) in HALF_DTYPES else dtype


@dataclass
class Weights:
    """Tensors an op runs on, and what they are: `version` (the version read, or predicted from) and
    `distance` (how many updates ahead they are predicted; -1 when not)."""

    tensors: list[torch.Tensor]
    version: int
    distance: int = -1


class StageWeights:
    """The versions of one stage's weights in one pipeline replica, its prediction buffers and its optimizer."""

    def __init__(self, module: nn.Module, optimizer: str, lr: float, *, label: str,
                 device: torch.device | str = "cpu") -> None:
        self.label = label  # "stage 2 (pipeline 0)", for errors
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.buffers = {name: b.to(device) for name, b in module.named_buffers()}
        current = [p.detach().to(device, copy=True).requires_grad_(True) for _, p in named]
        self.grad_dtype = main_dtype(current)
        # float32 masters of 16-bit weights (None: the optimizer updates the newest version itself)
        self.masters = None if self.grad_dtype is None else [w.detach().to(self.grad_dtype) for w in current]
        # what the replica lets go of, for its next versions, predictions and averages (kept on CPU); the optimizer
        # keeps its own for Adam's denominators, which a copy-on-write update takes beside the version's copies
        self.spares = Spares(keep=torch.device(device).type == "cpu")
        self.optimizer = make_optimizer(optimizer, current if self.masters is None else self.masters, lr,
                                        spares=Spares(keep=self.spares.keep))
        self.version = 0
        self.versions: dict[int, list[torch.Tensor]] = {0: current}
        self.predicted: dict[BufferKey, Weights] = {}
        self.grads: list[torch.Tensor | None] = [None] * len(current)  # the mini-batch's; None: nothing added yet
        # the flat gradient buffer the last update let go of, for the next mini-batch (`start_bucket`); on CPU only,
        # and, as `spares`, not in the books
        self.spare_bucket: torch.Tensor | None = None

    @property
    def current(self) -> list[torch.Tensor]:
        return self.versions[self.version]

    @property
    def owned(self) -> list[torch.Tensor]:
        """The weights the optimizer updates: the masters, or the newest version."""
        return self.current if self.masters is None else self.masters

    def filled_grads(self) -> list[torch.Tensor]:
        """The mini-batch's gradients, zeros (in the optimizer's dtype) where nothing was added."""
        return [torch.zeros_like(w) if g is None else g for w, g in zip(self.owned, self.grads)]

    def start_bucket(self) -> None:
        """Start the mini-batch's gradients, before its first backward, as zeroed views of one flat buffer
        (`replicas.bucket`), which a REDUCE's all-reduce sums in place. Buckets are made once, as torch DDP's are
        (torch 2.13 nn/parallel/distributed.py `gradient_as_bucket_view`; `Optimizer.zero_grad` zeroes their views
        in place): the one the update before last filled, which the last update let go of (`step`), is zeroed in
        place, where a new one each mini-batch took 0.44-0.82 ms on the CPUs here (fresh pages faulted;
        docs/fidelity.md). Two in all, not one: the last update's stays on the weights' `.grad` until the next
        update, which plain SGD's prediction extrapolates and the books count (`kept_gradients`). On a GPU none is
        kept, as `Spares` keeps none: the caching allocator keeps the freed block."""
        if any(g is not None for g in self.grads):  # started, or a backward added where no bucket could be made
            return
        flat, self.spare_bucket = self.spare_bucket, None
        self.grads = bucket(self.owned, flat) or self.grads

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters, after something changed them in place, into the newest version."""
        if self.masters is not None:
            torch._foreach_copy_(self.current, self.masters)

    def fresh_copies(self) -> list[torch.Tensor]:
        """What a copy-on-write update adds over one in place: other tensors (spares) for the version it makes, so
        the one it supersedes stays as it is for the rows that still read it. Where the optimizer owns the newest
        version, a copy of it, which the optimizer moves on to; where it owns float32 masters, the tensors alone,
        which the update's cast of the masters fills instead of the newest version. Calibration times this as the
        profile's `weight_copy`, which the simulator adds to the update in place (its `step`, in 16 bits the cast
        included)."""
        copies = self.spares.take(self.current)
        if self.masters is None:
            torch._foreach_copy_(copies, [w.detach() for w in self.current])
        return [w.requires_grad_(True) for w in copies]

    def read(self, version: int) -> Weights:
        if version not in self.versions:
            raise ExecutorError(f"{self.label}: weight version {version} is not held (holding "
                                f"{sorted(self.versions)}; newest {self.version})")
        return Weights(self.versions[version], version)

    def parameters(self, weights: Weights) -> dict[str, torch.Tensor]:
        """Name -> tensor of `weights`, with the module's buffers, for functional_call."""
        return {**dict(zip(self.names, weights.tensors)), **self.buffers}

    def predict(self, key: BufferKey) -> Weights:
        """Fill the buffer `key`: the newest version predicted `key[1]` updates ahead."""
        version, distance, _ = key
        if version != self.version:
            raise ExecutorError(f"{self.label}: a prediction from version {version} needs it to be the newest, "
                                f"whose optimizer state it extrapolates (newest {self.version})")
        if self.masters is None:
            tensors = predict_weights(self.optimizer, self.current, distance, self.spares)
        else:  # the masters' prediction, cast tensor by tensor: the float32 held beside the 16-bit is one tensor's
            tensors = self.spares.take(self.current)
            for master, cast in zip(self.masters, tensors):
                (predicted,) = predict_weights(self.optimizer, [master], distance, self.spares)
                cast.copy_(predicted)
                self.spares.give([predicted])
        tensors = [w.requires_grad_(True) for w in tensors]
        self.predicted[key] = Weights(tensors, version, distance)
        return self.predicted[key]

    def read_predicted(self, key: BufferKey) -> Weights:
        if key not in self.predicted:
            version, distance, side = key
            raise ExecutorError(f"{self.label}: no {side} prediction of version {version} over {distance} updates "
                                "was computed (a PRED row must come first)")
        return self.predicted[key]

    def free_predicted(self, key: BufferKey) -> int:
        """Drop buffer `key` after its last reader, into the spares; the bytes given back."""
        buffer = self.predicted.pop(key, None)
        return 0 if buffer is None else self.spares.give(buffer.tensors)

    @torch.no_grad()
    def step(self, keep_old: bool) -> None:
        """Apply the optimizer to the accumulated gradients: version v -> v + 1. `keep_old`: a later row still
        reads version v, so the update goes to copies and v stays as it is."""
        old = self.current
        grads = self.filled_grads()
        last = [w.grad for w in self.owned]  # the last update's gradients, which this one's replace
        last_bucket = flat_buffer(last) if self.spares.keep and None not in last else None
        if keep_old:
            new = self.fresh_copies()
            if self.masters is None:  # the optimizer moves on to the copies, its state with it
                self.optimizer.param_groups[0]["params"] = new
                for before, after in zip(old, new):
                    before.grad = None
                    if before in self.optimizer.state:
                        self.optimizer.state[after] = self.optimizer.state.pop(before)
        else:
            new = self.versions.pop(self.version)
        self.version += 1
        self.versions[self.version] = new
        self.grads = [None] * len(new)
        for weight, grad in zip(self.owned, grads):
            weight.grad = grad
        # the bucket the last update's gradients lay in, off .grad now, is the next mini-batch's to zero
        # (`start_bucket`): this update's stay on .grad until the next, as plain SGD's prediction reads them
        # (workload/optim.py `predict_weights`), so a replica keeps two buckets
        if last_bucket is not None:
            self.spare_bucket = last_bucket
        self.optimizer.step()
        self.refresh()  # the passes' 16-bit copies of the updated masters

    def release(self, version: int) -> int:
        """Drop `version` after its last read (never the newest: the optimizer owns it, or casts its masters into
        it), into the spares; the bytes given back."""
        if version == self.version or version not in self.versions:
            return 0
        return self.spares.give(self.versions.pop(version))

    def held(self) -> int:
        """Weight copies held: versions and prediction buffers."""
        return len(self.versions) + len(self.predicted)

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor this replica holds: versions, their last gradients, the gradient being accumulated,
        prediction buffers, masters and optimizer state."""
        for weights in (*self.versions.values(), *([self.masters] if self.masters is not None else ())):
            yield from weights
            yield from (w.grad for w in weights if w.grad is not None)
        yield from (g for g in self.grads if g is not None)
        for buffer in self.predicted.values():
            yield from buffer.tensors
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def average_replicas(replicas: Sequence[StageWeights], reference: list[torch.Tensor], alpha: float) -> None:
    """AVG: a stage's pipeline `replicas` and its `reference` model pulled together by elastic averaging
    (`workload.optim.elastic_average`) on the weights their optimizers own, the 16-bit versions copied from the
    masters after (calibration times it, with one replica, as the profile's `average`)."""
    elastic_average([replica.owned for replica in replicas], reference, alpha, replicas[0].spares)
    for replica in replicas:
        replica.refresh()
