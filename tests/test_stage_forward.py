"""A stage's forward (executor/runtime.py `stage_forward`) runs its module on the row's weights through
functional_call without torch's per-call search for tied tensors: the stage finds them once
(`StageModule.aliases`) and hands each further name its weight."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesim.executor.runtime import Ledger, Tape, stage_forward
from pipesim.executor.stages import ExecutorError, StageModule
from pipesim.executor.weights import Weights
from pipesim.workload.models import Model


def test_a_tied_weight_is_the_rows_leaf_under_each_of_its_names():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight  # tied, as a head sharing its embedding's weights
    model = Model("tied", [first, second], lambda b, gen: (torch.randn(b, 4, generator=gen), None),
                  lambda out, target: out.square().sum())
    module = StageModule(model, 0, 2, True, [], [])
    assert module.aliases == {"layers.1.weight": "layers.0.weight"}
    names = [name for name, _ in module.named_parameters()]
    weights = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    x = torch.randn(3, 4)
    loss, = stage_forward(module, dict(zip(names, weights)), [x], Tape(Weights(weights, 0), Ledger()),
                          lambda out: model.loss(out, None))
    shared, first_bias, second_bias = (dict(zip(names, weights))[name]
                                       for name in ("layers.0.weight", "layers.0.bias", "layers.1.bias"))
    expected = F.linear(F.linear(x, shared, first_bias), shared, second_bias).square().sum()
    assert torch.allclose(loss, expected)
    got = torch.autograd.grad(loss, weights)
    want = torch.autograd.grad(expected, weights)
    assert all(torch.allclose(g, w) for g, w in zip(got, want))  # the shared weight's gradient from both layers


def test_a_write_in_place_to_a_stages_output_before_its_backward_is_refused():
    """A stage's lone contiguous output goes over its edge as the layer's output's own memory (`_flat`), not an
    autograd view of it, so autograd's version check on the layer's saved output (tanh keeps its result) missed a
    write through what was sent: the backward gave a wrong gradient, silently. Now it is refused."""
    torch.manual_seed(0)
    model = Model("tanh", [nn.Linear(4, 4), nn.Tanh()], lambda b, gen: (torch.randn(b, 4, generator=gen), None),
                  lambda out, target: out.sum())
    module = StageModule(model, 0, 2, True, [], [[(1, (3, 4))]])
    x, grad = torch.randn(3, 4), torch.randn(12)
    sent, = module(x)
    sent.detach().mul_(2)  # through what the runtime keeps to send: the output's detach()
    with pytest.raises(ExecutorError, match="written in place"):
        torch.autograd.backward(sent, grad)
