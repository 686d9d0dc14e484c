"""The data the built-in models train on: scikit-learn's digits, and a synthetic next-token task.

Digits (1,797 8x8 grey images, 10 classes) ship inside scikit-learn, so runs stay offline. The split is
fixed (20 % held out, stratified, seed 0) and inputs are standardised with the training split's
statistics, so every run, rank and reference sees the same samples. Loading happens once per process, and
scikit-learn makes the split once per host and version: it is kept in the host cache (workload/cachedir.py)
as a small array file, since importing scikit-learn takes 1.2-1.5 s in every rank of every run.

The token task: each sequence starts at a uniform token and each next token is `SUCCESSOR[previous]` (a
fixed permutation of the vocabulary) with probability 1 - `TOKEN_NOISE`, else uniform. A model that
learns the permutation reaches the floor `token_loss_floor(vocab)`, the next token's entropy in nats.
"""

from __future__ import annotations

import io
import math
import zipfile
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from ..traces import write_atomic
from .cachedir import cache_dir

HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
DIGIT_CLASSES = 10
DIGIT_SIDE = 8
TOKEN_NOISE = 0.1
TOKEN_RULE_SEED = 0
HELDOUT_SEQUENCES = 256
HELDOUT_TOKEN_SEED = 1
HOST = torch.device("cpu")  # data is made here even under a meta default device (`pipesim count`'s models)
SPLIT_ARRAYS = {"train_x": (1437, 64), "train_y": (1437,), "heldout_x": (360, 64), "heldout_y": (360,)}
SPLIT_FORMAT = 1  # raised when what the kept split file holds changes


@dataclass(frozen=True)
class Split:
    """Standardised digits: `train_x`/`heldout_x` are (n, 64) float32, the labels int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    heldout_x: torch.Tensor
    heldout_y: torch.Tensor


@lru_cache(maxsize=1)
def digits() -> Split:
    """The digits split; cached because every micro-batch draws from it."""
    raw = digits_split()
    train = torch.tensor(raw["train_x"], dtype=torch.float32, device=HOST)
    # A border pixel that is almost always 0 has a tiny spread; dividing by it would blow up the rare held-out
    # sample that lights it, so spreads below one intensity level (of 16) count as one.
    mean, std = train.mean(0), train.std(0).clamp_min(1.0)
    return Split((train - mean) / std, torch.tensor(raw["train_y"], dtype=torch.int64, device=HOST),
                 (torch.tensor(raw["heldout_x"], dtype=torch.float32, device=HOST) - mean) / std,
                 torch.tensor(raw["heldout_y"], dtype=torch.int64, device=HOST))


def digits_split() -> dict[str, np.ndarray]:
    """scikit-learn's split of the digits as uint8 arrays (SPLIT_ARRAYS: pixels 0-16, labels 0-9): from the
    host cache where it holds the split of the installed scikit-learn, else made by it and kept there (a cache
    that cannot be written only loses the reuse). Without scikit-learn installed, its import fails as before."""
    try:
        path = cache_dir() / f"digits-split-{SPLIT_FORMAT}-scikit-learn-{metadata.version('scikit-learn')}.npz"
    except metadata.PackageNotFoundError:
        path = None
    kept = _read_split(path) if path is not None else None
    if kept is not None:
        return kept
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    parts = train_test_split(images, labels, test_size=HELDOUT_FRACTION, stratify=labels, random_state=SPLIT_SEED)
    split = {name: part.astype(np.uint8) for name, part in zip(("train_x", "heldout_x", "train_y", "heldout_y"),
                                                                parts)}
    if path is not None:
        with io.BytesIO() as packed, suppress(OSError):
            np.savez_compressed(packed, **split)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, packed.getvalue())
    return split


def _read_split(path: Path) -> dict[str, np.ndarray] | None:
    """The split kept at `path`, if it is there, readable and whole."""
    try:
        with np.load(path, allow_pickle=False) as kept:
            split = {name: kept[name] for name in SPLIT_ARRAYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    whole = all(a.shape == SPLIT_ARRAYS[name] and a.dtype == np.uint8 for name, a in split.items())
    return split if whole else None


def digit_batch(b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """b training samples drawn with replacement: (b, 64) features and their labels."""
    split = digits()
    picks = torch.randint(0, len(split.train_y), (b,), generator=gen)
    return split.train_x[picks], split.train_y[picks]


def as_images(features: torch.Tensor, side: int = 32) -> torch.Tensor:
    """(n, 64) digits as (n, 3, side, side) images, upsampled and repeated to 3 channels for the conv models."""
    grey = features.reshape(-1, 1, DIGIT_SIDE, DIGIT_SIDE)
    return torch.nn.functional.interpolate(grey, size=(side, side), mode="nearest").expand(-1, 3, -1, -1).contiguous()


@lru_cache(maxsize=8)
def successor(vocab: int) -> torch.Tensor:
    """The token task's rule: a fixed permutation of the vocabulary."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(TOKEN_RULE_SEED), device=HOST)


def token_batch(b: int, seq_len: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """b sequences of the token task: (input ids, next-token targets), each (b, seq_len)."""
    rule = successor(vocab).numpy()
    noisy = (torch.rand(b, seq_len, generator=gen, device=gen.device) < TOKEN_NOISE).numpy()
    tokens = torch.randint(0, vocab, (b, seq_len + 1), generator=gen, device=gen.device)
    steps = tokens.numpy()  # the same memory: numpy's step is microseconds where torch's is tens of them
    for t in range(seq_len):
        steps[:, t + 1] = np.where(noisy[:, t], steps[:, t + 1], rule[steps[:, t]])
    return tokens[:, :-1], tokens[:, 1:]


@lru_cache(maxsize=8)
def token_heldout(seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed held-out set of the token task, from its own seed."""
    return token_batch(HELDOUT_SEQUENCES, seq_len, vocab, torch.Generator().manual_seed(HELDOUT_TOKEN_SEED))


def token_loss_floor(vocab: int) -> float:
    """The lowest expected next-token cross entropy (nats): the rule's token has probability
    1 - noise + noise / vocab, every other noise / vocab."""
    hit, miss = 1 - TOKEN_NOISE + TOKEN_NOISE / vocab, TOKEN_NOISE / vocab
    return -(hit * math.log(hit) + (vocab - 1) * miss * math.log(miss))
