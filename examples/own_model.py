"""A model of your own, as the docs' `--model examples.own_model:build` names it: `package.module:attribute`,
imported from the current folder. `build` is a zero-argument callable returning a torch.nn.Sequential, which
pipesim cuts into stages between its layers; the input is inferred from the first layer (FEATURES numbers a
sample) and the loss is a mean square, since nothing else is known about it."""

from torch import nn

FEATURES, HIDDEN, CLASSES, BLOCKS = 64, 256, 10, 4


def build() -> nn.Sequential:
    """An MLP of BLOCKS hidden blocks (Linear then GELU, each one layer that a stage boundary may follow) and a
    linear classifier: BLOCKS + 1 layers."""
    widths = [FEATURES, *[HIDDEN] * BLOCKS]
    blocks = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*blocks, nn.Linear(HIDDEN, CLASSES))
