"""The data the built-in models train on: scikit-learn's digits, and a synthetic next-token task.

Digits (1,797 8x8 grey images, 10 classes) ship inside scikit-learn, so runs stay offline. The split is
fixed (20 % held out, stratified, seed 0) and inputs are standardised with the training split's
statistics, so every run, rank and reference sees the same samples. Loading happens once per process.

The token task: each sequence starts at a uniform token and each next token is `SUCCESSOR[previous]` (a
fixed permutation of the vocabulary) with probability 1 - `TOKEN_NOISE`, else uniform. A model that
learns the permutation reaches the floor `token_loss_floor(vocab)`, the next token's entropy in nats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
DIGIT_CLASSES = 10
DIGIT_SIDE = 8
TOKEN_NOISE = 0.1
TOKEN_RULE_SEED = 0
HELDOUT_SEQUENCES = 256
HELDOUT_TOKEN_SEED = 1
HOST = torch.device("cpu")  # data is made here even under a meta default device (`pipesim count`'s models)


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
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        images, labels, test_size=HELDOUT_FRACTION, stratify=labels, random_state=SPLIT_SEED)
    train = torch.tensor(train_x, dtype=torch.float32, device=HOST)
    # A border pixel that is almost always 0 has a tiny spread; dividing by it would blow up the rare held-out
    # sample that lights it, so spreads below one intensity level (of 16) count as one.
    mean, std = train.mean(0), train.std(0).clamp_min(1.0)
    return Split((train - mean) / std, torch.tensor(train_y, device=HOST),
                 (torch.tensor(heldout_x, dtype=torch.float32, device=HOST) - mean) / std,
                 torch.tensor(heldout_y, device=HOST))


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
