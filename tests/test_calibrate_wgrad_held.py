"""What calibration records an input-gradient pass leaving for its weight pass (calibrate/measure.py
`measure_wgrad_held`): the executor's I keeps, for its W, the graph below the topmost node where a weight's gradient
branches off, with the gradients arriving at those nodes; what lies above goes as I ends. A calibrated profile held
none of it (None: half the activations, no gradients), so a CPU ZB-H1 stage ending in a gpt's head, whose I keeps
the logits' gradient, was priced 7 % over its measured peak in bfloat16 while the executor's books left that
gradient out (tests/test_run.py `test_a_split_backward_holds_until_its_weight_pass_what_calibration_measured`)."""

import torch
from torch import nn

from pipesim.calibrate.measure import Settings, measure_bytes, measure_wgrad_held
from pipesim.profiles.partition import activation_ranges
from pipesim.profiles.schema import layer_costs, wgrad_held_ranges
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
    assert [layer.wgrad_kept_below_bytes for layer in held] == [layer.activation_bytes for layer in layers]
    assert [layer.model_copy(update={"wgrad_kept_bytes": None, "wgrad_gradient_bytes": 0,
                                     "wgrad_kept_below_bytes": None}) for layer in held] == layers
    activations = activation_ranges(layer_costs(held, "sgd"))
    kept, gradients, known = wgrad_held_ranges(held, activations)
    assert known.all()
    assert (kept[1, 3], gradients[1, 3]) == (3 * ROW, 2 * ROW + B * F32)
    assert (kept[0, 2], gradients[0, 2]) == (activations[0, 2], 0)


def test_a_layer_below_another_of_its_stage_keeps_all_it_saved():
    """A layer whose dropout saves its ReLU's output and its mask above its linear: as its stage's last its I frees
    them, below the head they stay until W (the head's nodes hold its graph), so the stage keeps its activations less
    the head's loss's (y - target). Before, a stage summed its layers' kept as if each were last: 2 rows, not 3 and
    the mask."""
    dropped = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.5))
    model = Model("dropped", [nn.Linear(4, WIDTH), dropped, nn.Linear(WIDTH, 1)],
                  lambda b, g: (torch.randn(b, 4, generator=g), torch.randn(b, 1, generator=g)),
                  lambda y, target: ((y - target) ** 2).mean())
    recording, layers = measure_bytes(model, Settings(torch.device("cpu"), torch.float32, B, warmup=0, repeats=1))
    held = measure_wgrad_held(model, recording, layers)
    saved = held[1].activation_bytes  # its input, its ReLU's output, its dropout's mask
    assert saved > 2 * ROW
    assert [(layer.wgrad_kept_bytes, layer.shared_with_previous_bytes) for layer in held[1:]] == [(ROW, 0), (ROW, 0)]
    activations = activation_ranges(layer_costs(held, "sgd"))
    kept, _, _ = wgrad_held_ranges(held, activations)
    assert kept[1, 2] == ROW  # the dropout's layer last: its input alone
    assert kept[1, 3] == activations[1, 3] - B * F32 == saved + ROW
