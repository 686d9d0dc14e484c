"""What calibration records an input-gradient pass leaving for its weight pass (calibrate/measure.py
`measure_wgrad_held`): the executor's I keeps, for its W, the graph below the topmost node where a weight's gradient
branches off, with the gradients arriving at those nodes; what lies above goes as I ends. A calibrated profile held
none of it (None: half the activations, no gradients), so a CPU ZB-H1 stage ending in a gpt's head, whose I keeps
the logits' gradient, was priced 7 % over its measured peak in bfloat16 while the executor's books left that
gradient out (tests/test_run.py `test_a_split_backward_holds_until_its_weight_pass_what_calibration_measured`)."""

import torch
from torch import nn

from pipesim.calibrate.measure import Settings, measure_bytes, measure_wgrad_held
from pipesim.profiles.schema import layer_costs, stage_activation_bytes, stage_wgrad_held
from pipesim.workload.models import Model

B, WIDTH, F32 = 2, 8, 4  # samples, features, bytes an element
ROW = B * WIDTH * F32  # one (B, WIDTH) float32 tensor


def _model() -> Model:
    """A linear on the batch; a layer whose last ReLU saves its output above its last linear's weights; a head whose
    loss saves (y - target) above its linear's."""
    middle = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
    return Model("held", [nn.Linear(4, WIDTH), middle, nn.Linear(WIDTH, 1)],
                 lambda b, g: (torch.randn(b, 4, generator=g), torch.randn(b, 1, generator=g)),
                 lambda y, target: ((y - target) ** 2).mean())


def test_calibration_records_what_the_input_gradient_pass_leaves_for_the_weight_pass():
    """The middle layer keeps its input and its first ReLU's output (what its linears read) and the two linears'
    output gradients, not its last ReLU's output, above both linears; the head keeps its input and its output's
    gradient, not its loss's (y - target); the first layer, which reads the batch alone (its I walks none of it),
    all it saved and no gradient. A stage sums its layers', a stage fed by the batch alone all its activations."""
    model = _model()
    recording, layers = measure_bytes(model, Settings(torch.device("cpu"), torch.float32, B, warmup=0, repeats=1))
    assert [layer.activation_bytes for layer in layers] == [B * 4 * F32, 3 * ROW, ROW + B * F32]
    assert all(layer.wgrad_kept_bytes is None for layer in layers)
    held = measure_wgrad_held(model, recording, layers)
    assert [(layer.wgrad_kept_bytes, layer.wgrad_gradient_bytes) for layer in held] == [
        (B * 4 * F32, 0), (2 * ROW, 2 * ROW), (ROW, B * F32)]
    assert [layer.model_copy(update={"wgrad_kept_bytes": None, "wgrad_gradient_bytes": 0}) for layer in held] == layers
    costs = layer_costs(held, "sgd")
    assert stage_wgrad_held(held[1:], 1, stage_activation_bytes(costs, 1, 3)) == (3 * ROW, 2 * ROW + B * F32)
    assert stage_wgrad_held(held[:2], 0, stage_activation_bytes(costs, 0, 2)) == (
        stage_activation_bytes(costs, 0, 2), 0)
