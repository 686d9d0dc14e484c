"""The torch workload layer on its own: models, optimizers with their weight prediction and elastic averaging,
and the point-to-point transports (in-process, and real gloo ranks)."""

from __future__ import annotations

import errno
import math
import random
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from pipesim.profiles import schema
from pipesim.workload.models import ModelError, build_model
from pipesim.workload.optim import OPTIMIZERS, elastic_average, make_optimizer, predict_weights
from pipesim.workload.processes import rank_context
from pipesim.workload.sizes import size_refusal
from pipesim.workload.transport import (
    GlooTransport,
    HostStagedTransport,
    InProcessTransport,
    TransportError,
    TransportTimeout,
    choose_transport,
    served_rendezvous,
)
from tests.conftest import pipesim

LR = 0.1
DISTANCES = [0, 1, 3]


# ------------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize(("name", "options"), [
    ("mlp", {"layers": 2, "width": 16}),
    ("cnn", {"layers": 2, "width": 4}),
    ("gpt", {"layers": 1, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32}),
    ("gpt", {"layers": 1, "width": 16, "heads": 4, "seq_len": 8, "vocab": 32, "kv_heads": 2, "ffn": 24,
             "gated": True}),
    ("two-branch", {"layers": 1, "width": 4}),
])
def test_each_built_in_model_runs_forward_and_loss_and_backward(name, options):
    model = build_model(name, **options)
    batch, target = model.make_batch(3, torch.Generator().manual_seed(0))
    loss = model.loss(model.forward(batch), target)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    params = [p for layer in model.layers for p in layer.parameters()]
    assert params and all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def test_grouped_query_attention_is_attention_with_each_key_value_head_repeated_over_its_group():
    """A gpt block with one key/value head computes what the full-head block computes when that head's key and
    value weights are copied to every head."""
    width, heads, head = 16, 4, 4
    torch.manual_seed(0)
    grouped = build_model("gpt", layers=1, width=width, heads=heads, seq_len=8, vocab=32, kv_heads=1).layers[1]
    full = build_model("gpt", layers=1, width=width, heads=heads, seq_len=8, vocab=32).layers[1]
    assert grouped.qkv.weight.shape == (width + 2 * head, width) and full.qkv.weight.shape == (3 * width, width)
    state = grouped.state_dict()
    for name in ("weight", "bias"):
        q, k, v = state[f"qkv.{name}"].split([width, head, head])
        rest = [1] * (q.dim() - 1)
        state[f"qkv.{name}"] = torch.cat([q, k.repeat(heads, *rest), v.repeat(heads, *rest)])
    full.load_state_dict(state)
    x = torch.randn(2, 8, width)
    assert torch.allclose(grouped(x), full(x), atol=1e-6)


def test_gpt_defaults_are_a_4x_gelu_mlp_and_full_heads_and_bad_shapes_name_the_flag():
    model = build_model("gpt", layers=1, width=16, heads=2, seq_len=8, vocab=32)
    block = model.layers[1]
    assert [type(m).__name__ for m in block.mlp] == ["Linear", "GELU", "Linear"] and block.mlp[0].out_features == 64
    assert model.options == {"layers": 1, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32, "gated": False}
    gated = build_model("gpt", layers=1, width=16, heads=2, seq_len=8, vocab=32, ffn=40, gated=True).layers[1]
    assert gated.mlp.gate_up.out_features == 80 and gated.mlp.down.in_features == 40
    with pytest.raises(ModelError, match=r"^--heads: give a multiple of --kv-heads 3 \(got 4\)$"):
        build_model("gpt", width=16, heads=4, kv_heads=3)
    with pytest.raises(ModelError, match=r"--ffn: give a whole number from 1 to 4,194,304 \(got 0\)"):
        build_model("gpt", ffn=0)
    with pytest.raises(ModelError, match=r"--kv-heads does not apply to mlp"):
        build_model("mlp", kv_heads=2)


def test_a_size_without_a_bound_of_pipesims_is_refused_below_its_least_alone():
    """A config's max_position_embeddings bounds --seq-len and has no MAX_SIZES bound: hfconfig worded its own
    "must be >= 1 (got 0)" line for it, beside size_refusal's for every other size; with no bound it says "of at
    least 1", as the command line says for an option with no upper bound."""
    assert size_refusal("max_position_embeddings", None, 0) == ("max_position_embeddings: give a whole number of at "
                                                                 "least 1 (got 0)")
    assert size_refusal("max_position_embeddings", None, 10_485_760) is None  # Llama 4 Scout's 10M context


@pytest.mark.parametrize("args, fragment", [
    (("--layers", 10 ** 9), "--layers: give a whole number from 1 to 10,000 (got 1,000,000,000)"),
    (("--vocab", 10 ** 12), "--vocab: give a whole number from 1 to 16,777,216 (got 1,000,000,000,000)"),
    (("--width", 10 ** 9, "--heads", 1), "--width: give a whole number from 1 to 1,048,576 (got 1,000,000,000)"),
    (("--seq-len", 10 ** 9), "--seq-len: give a whole number from 1 to"),
    (("--experts", 4, "--shared-experts", 10 ** 9), "--shared-experts: give a whole number from 0 to 16,384 (got "
                                                    "1,000,000,000)"),
])
def test_a_model_size_past_its_bound_is_refused_in_one_line_and_no_profile_is_written(tmp_path, args, fragment):
    """--layers 1e9 grew the host's memory past 12 GB, silently; --vocab 1e12 was torch's traceback from the token
    task's randperm of the vocabulary, and --width and --seq-len 1e9 others from the storages."""
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", *args, "--out", out)
    assert code == 2 and stdout == "" and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_long_context_and_a_window_over_it_are_inside_what_the_count_holds(tmp_path):
    """Phi-3.5-mini's and Phi-4-mini's config.json give sliding_window 262,144, and context-parallel runs train on
    262,144 tokens and more: held to 131,072, such a config was refused at any --seq-len, and a 262,144-token run at
    C = 8 that simulated in 10 s was refused too (at 1,048,576 tokens it ran in 18 s and 2.7 GB)."""
    from pipesim.workload.hfconfig import read_hf_config
    from pipesim.workload.models import check_positive

    (tmp_path / "config.json").write_text('{"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, '
                                          '"num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": '
                                          '8, "vocab_size": 200064, "sliding_window": 262144}')
    assert read_hf_config(f"hf:{tmp_path}").fields["sliding_window"] == 262144
    check_positive(seq_len=1 << 20)
    with pytest.raises(ModelError, match=r"--seq-len: give a whole number from 1 to 1,048,576 \(got 1,048,577\)"):
        check_positive(seq_len=(1 << 20) + 1)


# ------------------------------------------------------------------------------------------------ optimizers


def test_optimizer_names_match_the_profiles():
    assert OPTIMIZERS == schema.OPTIMIZERS == ("sgd", "momentum", "adam", "adamw")


def test_make_optimizer_builds_each_name_with_its_hyperparameters():
    def group(name, **kw):
        optimizer = make_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], LR, **kw)
        return optimizer.name, optimizer.param_groups[0]

    name, g = group("sgd")
    assert name == "sgd" and g["momentum"] == 0 and g["lr"] == LR
    name, g = group("momentum")
    assert name == "momentum" and g["momentum"] == 0.9
    assert group("momentum", momentum=0.5)[1]["momentum"] == 0.5
    name, g = group("adam")
    assert name == "adam" and g["weight_decay"] == 0 and g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8
    name, g = group("adamw", weight_decay=0.05)
    assert name == "adamw" and g["weight_decay"] == 0.05
    with pytest.raises(ValueError, match=r"choose from sgd, momentum, adam, adamw \(got 'lamb'\)"):
        make_optimizer("lamb", [torch.nn.Parameter(torch.zeros(2))], LR)


TORCH_OPTIMIZERS = {"sgd": lambda ws: torch.optim.SGD(ws, lr=LR), "momentum": lambda ws: torch.optim.SGD(
    ws, lr=LR, momentum=0.9), "adam": lambda ws: torch.optim.Adam(ws, lr=LR), "adamw": lambda ws: torch.optim.AdamW(
    ws, lr=LR, weight_decay=0.01)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_steps_bit_for_bit_as_torch_optim(name, dtype):
    """Weights and state after four steps, one tensor without a gradient at the first (it starts late)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(True) for shape in ((5, 7), (3,), (2,))]
    theirs = [w.detach().clone().requires_grad_(True) for w in ours]
    stepped, reference = make_optimizer(name, ours, LR), TORCH_OPTIMIZERS[name](theirs)
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            grad = None if step == 0 and i == 2 else torch.randn(a.shape, generator=gen, dtype=dtype)
            a.grad, b.grad = grad, None if grad is None else grad.clone()
        stepped.step()
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert [sorted(stepped.state.get(a, {})) for a in ours] == [sorted(reference.state.get(b, {})) for b in theirs]
    for a, b in zip(ours, theirs):
        for key, value in stepped.state.get(a, {}).items():
            assert value.dtype == reference.state[b][key].dtype and torch.equal(value, reference.state[b][key])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_steps_meta_weights_under_a_meta_default_device(name):
    """`pipesim count` steps optimizers on meta weights: the step count stays on the host, as torch.optim's."""
    with torch.device("meta"):
        w = torch.empty(3, requires_grad=True)
        w.grad = torch.empty(3)
        optimizer = make_optimizer(name, [w], LR)
        optimizer.step()
    assert optimizer.state[w]["step"].item() == 1 and optimizer.state[w]["exp_avg"].is_meta


def _param(*values):
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def _train(name, weights, grads, **kw):
    """`name`'s optimizer over `weights`, stepped once per entry of `grads` (one gradient list per step)."""
    optimizer = make_optimizer(name, weights, LR, **kw)
    for step in grads:
        for w, g in zip(weights, step):
            w.grad = None if g is None else torch.tensor(g, dtype=torch.float64)
        optimizer.step()
    return optimizer


def _check(predicted, expected):
    assert len(predicted) == len(expected)
    for p, e in zip(predicted, expected):
        assert p.tolist() == pytest.approx(e, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("s", DISTANCES)
def test_sgd_predicts_along_the_last_gradient(s):
    w = _param(1.0, 2.0)
    optimizer = _train("sgd", [w], [[[0.5, -1.0]]])  # w = [0.95, 2.1], grad still held
    _check(predict_weights(optimizer, [w], s), [[0.95 - s * 0.1 * 0.5, 2.1 + s * 0.1 * 1.0]])
    assert w.tolist() == pytest.approx([0.95, 2.1])  # the weights are not touched


@pytest.mark.parametrize("s", DISTANCES)
def test_momentum_predicts_along_the_momentum_buffer(s):
    w = _param(1.0)
    optimizer = _train("momentum", [w], [[[0.5]], [[1.0]]])
    # buffer 0.5, then 0.9 * 0.5 + 1.0 = 1.45; w = 1 - 0.1 * 0.5 - 0.1 * 1.45 = 0.805
    assert w.item() == pytest.approx(0.805)
    _check(predict_weights(optimizer, [w], s), [[0.805 - s * 0.1 * 1.45]])


def _adam_by_hand(w, grads, decoupled_decay=0.0, betas=(0.9, 0.999), eps=1e-8):
    """Adam (AdamW with decoupled_decay > 0) on plain floats: the weights after the steps and the last step's
    direction m_hat / (sqrt(v_hat) + eps) per element."""
    w, m, v = list(w), [0.0] * len(w), [0.0] * len(w)
    direction = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            w[i] *= 1 - LR * decoupled_decay
            m[i] = betas[0] * m[i] + (1 - betas[0]) * gi
            v[i] = betas[1] * v[i] + (1 - betas[1]) * gi * gi
            direction[i] = (m[i] / (1 - betas[0] ** t)) / (math.sqrt(v[i] / (1 - betas[1] ** t)) + eps)
            w[i] -= LR * direction[i]
    return w, direction


@pytest.mark.parametrize("s", DISTANCES)
@pytest.mark.parametrize(("name", "decay"), [("adam", 0.0), ("adamw", 0.01)])
def test_adam_and_adamw_predict_with_bias_corrected_moments(name, decay, s):
    grads = [[0.5, -2.0], [-1.0, 0.25], [0.3, 0.0]]
    w = _param(1.0, -0.5)
    optimizer = _train(name, [w], [[g] for g in grads])
    by_hand, direction = _adam_by_hand([1.0, -0.5], grads, decoupled_decay=decay)
    assert w.tolist() == pytest.approx(by_hand, rel=1e-12)
    expected = [wi - s * LR * (d + decay * wi) for wi, d in zip(by_hand, direction)]
    _check(predict_weights(optimizer, [w], s), [expected])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_weight_with_nothing_to_extrapolate_is_predicted_as_itself(name):
    fresh, stepped = _param(3.0, 4.0), _param(1.0)
    optimizer = _train(name, [fresh, stepped], [[None, [1.0]]])  # only `stepped` has a direction
    predicted = predict_weights(optimizer, [fresh, stepped], 3)
    assert predicted[0].tolist() == [3.0, 4.0] and predicted[1].item() != stepped.item()
    before = _train(name, [_param(2.0)], [])  # no step at all
    assert predict_weights(before, before.param_groups[0]["params"], 3)[0].tolist() == [2.0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_distance_zero_gives_independent_copies(name):
    w = _param(1.0, 2.0)
    optimizer = _train(name, [w], [[[0.5, 0.5]]])
    (copy,) = predict_weights(optimizer, [w], 0)
    assert copy.tolist() == w.tolist() and not copy.requires_grad
    copy.add_(1.0)
    assert copy.tolist() != w.tolist()


def test_prediction_refuses_a_negative_distance():
    w = _param(1.0)
    with pytest.raises(ValueError, match=">= 0"):
        predict_weights(make_optimizer("sgd", [w], LR), [w], -1)


def test_elastic_averaging_follows_the_easgd_equations():
    replicas = [[_param(1.0), _param(0.0, 4.0)], [_param(3.0), _param(2.0, 0.0)]]
    reference = [_param(0.0), _param(1.0, 1.0)]
    elastic_average(replicas, reference, 0.25)
    # X_i -= 0.25 (X_i - R); R += 0.25 * sum_i (X_i - R), differences before anything moves
    assert [[t.tolist() for t in r] for r in replicas] == [[[0.75], [0.25, 3.25]], [[2.25], [1.75, 0.25]]]
    assert [t.tolist() for t in reference] == [[1.0], [1.0, 1.5]]


def test_elastic_averaging_keeps_the_total_and_checks_its_arguments():
    gen = torch.Generator().manual_seed(0)
    replicas = [[torch.randn(5, generator=gen, dtype=torch.float64)] for _ in range(3)]
    reference = [torch.randn(5, generator=gen, dtype=torch.float64)]
    total = sum(r[0] for r in replicas) + reference[0]  # what the replicas give up, the reference takes
    elastic_average(replicas, reference, 0.2)
    assert torch.allclose(sum(r[0] for r in replicas) + reference[0], total)
    one, centre = [torch.ones(1)], [torch.zeros(1)]
    elastic_average([one], centre, 1.0)  # alpha 1 with one replica: the two swap
    assert (one[0].item(), centre[0].item()) == (0.0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        elastic_average(replicas, reference, 1.5)
    with pytest.raises(ValueError, match="hold 1 tensors"):
        elastic_average([[torch.ones(1), torch.ones(1)]], reference, 0.5)


# ------------------------------------------------------------------------------------------------ transports


def test_in_process_receives_match_sends_in_order_whatever_order_they_are_waited_on():
    t0, t1 = InProcessTransport.connected(2)
    posted = [t1.recv((2,), torch.float32, src=0) for _ in range(4)]
    sent = [torch.full((2,), float(k)) for k in range(4)]
    for tensor in sent:
        assert t0.send(tensor, 1).wait() is None
    sent[0].fill_(99.0)  # the data left with the send
    assert [posted[k].wait()[0].item() for k in (3, 1, 0, 2)] == [3.0, 1.0, 0.0, 2.0]
    assert posted[3].wait()[0].item() == 3.0  # waiting again returns the same tensor


def test_in_process_pairs_run_concurrently_and_keep_each_pair_in_order():
    world, messages = 4, 25
    transports = InProcessTransport.connected(world, timeout_s=30)
    got: dict[int, dict[int, list[float]]] = {}

    def rank(r):
        t = transports[r]
        peers = [p for p in range(world) if p != r]
        order = [p for _ in range(messages) for p in peers]  # interleave the peers' receives
        handles = [t.recv((1,), torch.float64, p) for p in order]
        for k in range(messages):
            for p in peers:
                t.send(torch.tensor([1000.0 * r + k], dtype=torch.float64), p)
        values = {}
        for i in random.Random(r).sample(range(len(handles)), len(handles)):  # wait in any order
            values[i] = handles[i].wait().item()
        got[r] = {p: [values[i] for i, q in enumerate(order) if q == p] for p in peers}

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(got) == world
    for r in range(world):
        for p in range(world):
            if p != r:
                assert got[r][p] == [1000.0 * p + k for k in range(messages)]


def test_in_process_wait_times_out_naming_the_peer():
    t0, t1 = InProcessTransport.connected(2, timeout_s=0.05)
    with pytest.raises(TransportTimeout, match=r"rank 1: receive #0 from rank 0 timed out after 0.05 s"):
        t1.recv((1,), torch.float32, 0).wait()
    with pytest.raises(TransportTimeout, match=r"rank 0: receive #0 from rank 1 timed out after 0.01 s"):
        t0.recv((1,), torch.float32, 1).wait(timeout_s=0.01)


def test_an_abandoned_in_process_group_fails_every_receive_at_once():
    """A rank that failed abandons the group: a receive already waiting, and any later one, stop with the
    reason instead of waiting out their timeouts; what was sent before is still delivered."""
    import threading

    t0, t1, t2 = InProcessTransport.connected(3, timeout_s=600)
    t0.send(torch.ones(1), 1)
    delivered = t1.recv((1,), torch.float32, 0)
    waiting = t1.recv((1,), torch.float32, 2)
    errors: list[Exception] = []

    def wait() -> None:
        try:
            waiting.wait()
        except TransportError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert t2.abandon("device 2 failed") and not t0.abandon("device 0 failed")  # the first one is the cause
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert [str(e) for e in errors] == ["rank 1: receive #0 from rank 2 abandoned: device 2 failed"]
    assert delivered.wait().item() == 1.0
    with pytest.raises(TransportError, match="abandoned: device 2 failed"):
        t0.recv((1,), torch.float32, 1).wait()


def test_in_process_refuses_a_mismatched_tensor_and_bad_peers():
    t0, t1 = InProcessTransport.connected(2)
    t0.send(torch.zeros(3), 1)
    with pytest.raises(TransportError, match=r"posted for \[2\] torch.float32, got \[3\] torch.float32"):
        t1.recv((2,), torch.float32, 0).wait()
    with pytest.raises(ValueError, match="another rank"):
        t0.send(torch.zeros(1), 0)
    with pytest.raises(ValueError, match="another rank"):
        t0.recv((1,), torch.float32, 2)


def test_in_process_channels_are_separate_fifos_between_one_pair():
    """Two channels from rank 0 to rank 1: each keeps its own order, whatever order the two are consumed in
    (a V schedule sends one edge's activations and another edge's gradients between the same two ranks)."""
    t0, t1 = InProcessTransport.connected(2, timeout_s=5)
    a = [t1.recv((1,), torch.float32, 0, channel=1) for _ in range(3)]
    b = [t1.recv((1,), torch.float32, 0, channel=2) for _ in range(3)]
    default = t1.recv((1,), torch.float32, 0)
    for k in range(3):  # interleaved on the wire, the other way round from the posts
        t0.send(torch.tensor([20.0 + k]), 1, channel=2)
        t0.send(torch.tensor([10.0 + k]), 1, channel=1)
    t0.send(torch.tensor([0.0]), 1)
    assert [h.wait().item() for h in b] == [20.0, 21.0, 22.0]
    assert [h.wait().item() for h in a] == [10.0, 11.0, 12.0]
    assert default.wait().item() == 0.0
    with pytest.raises(TransportTimeout, match="receive #3 from rank 0 on channel 1 timed out"):
        t1.recv((1,), torch.float32, 0, channel=1).wait(timeout_s=0.01)
    with pytest.raises(ValueError, match="channel must be"):
        t0.send(torch.zeros(1), 1, channel=-1)


def test_choose_transport_follows_device_world_size_and_gpus():
    cpu = choose_transport("cpu", 4)
    assert (cpu.kind, cpu.backend, cpu.timer, cpu.device_for(3)) == ("gloo", "gloo", "monotonic", torch.device("cpu"))
    nccl = choose_transport("cuda", 2, gpus=2)
    assert (nccl.kind, nccl.backend, nccl.device_for(1)) == ("nccl", "nccl", torch.device("cuda", 1))
    shared = choose_transport("cuda", 3, gpus=1)
    assert (shared.kind, shared.backend, shared.host_staged) == ("host-staged", "gloo", True)
    assert shared.device_for(2) == torch.device("cuda", 0)
    assert choose_transport("cuda", 2, backend="gloo", gpus=8).kind == "host-staged"
    with pytest.raises(TransportError, match="sees no GPU"):
        choose_transport("cuda", 2, gpus=0)
    with pytest.raises(TransportError, match="one GPU per rank: 4 ranks, 2 GPU"):
        choose_transport("cuda", 4, backend="nccl", gpus=2)
    with pytest.raises(TransportError, match="nccl"):
        choose_transport("cpu", 2, backend="nccl")
    with pytest.raises(ValueError, match="device must be"):
        choose_transport("tpu", 2)




def test_a_send_that_fails_is_raised_by_its_ranks_wait_and_a_waiter_thread_stops():
    """A gloo send's waiter keeps the failure for the rank (whose books take the send as done), and stops."""
    from pipesim.workload.transport import TransportError, _Reaper

    class Failing:  # a send whose transfer failed
        timeout_s, what = 1.0, "rank 0: send #0 to rank 1"

        def wait(self, timeout_s=None):
            raise TransportError("rank 0: send #0 to rank 1 failed: connection reset")

    reaper = _Reaper("test-sends")
    handle = reaper.watch(Failing())
    assert handle.settled.wait(5.0) and handle.done()
    with pytest.raises(TransportError, match="connection reset"):
        handle.wait()
    assert reaper.stop()

    class Hanging:  # a send to a peer that died: its transfer never completes
        timeout_s, what, release = 1.0, "rank 0: send #1 to rank 1", threading.Event()

        def wait(self, timeout_s=None):
            self.release.wait()

    stuck = _Reaper("test-sends-stuck")
    stuck.watch(Hanging())
    started = time.monotonic()
    assert not stuck.stop() and time.monotonic() - started < 0.5  # a failed rank reports at once
    Hanging.release.set()


def _exchange(rank: int, kind: str, rendezvous, results) -> None:
    """One of two real ranks: pre-post receives, send tensors of several shapes and dtypes both ways, then
    let rank 1 wait on a receive nothing answers."""
    try:
        torch.set_num_threads(1)
        cls = GlooTransport if kind == "gloo" else HostStagedTransport
        with cls(rank, 2, "cpu", rendezvous=rendezvous, timeout_s=30) as transport:
            peer = 1 - rank
            shapes = [((3,), torch.float32), ((2, 4), torch.float64), ((5,), torch.int64)]
            posted = [transport.recv(shape, dtype, peer) for shape, dtype in shapes]
            sends = [transport.send(torch.full(shape, 10.0 * rank + k).to(dtype), peer)
                     for k, (shape, dtype) in enumerate(shapes)]
            received = [h.wait() for h in reversed(posted)][::-1]
            transport.send(torch.zeros(1), peer)  # sent after the peer took every tensor: ours have arrived too
            transport.recv((1,), torch.float32, peer).wait()
            deadline = time.monotonic() + 10.0
            while not all(h.done() for h in sends) and time.monotonic() < deadline:
                time.sleep(0.01)
            released = all(h.done() and h.handle.work is None for h in sends)  # nobody waited; the work is gone
            for h in sends:
                h.wait()
            timeout = None
            if rank == 1:
                try:
                    transport.recv((1,), torch.float32, 0).wait(timeout_s=0.5)
                except TransportTimeout as exc:
                    timeout = str(exc)
                transport.send(torch.zeros(1), 0).wait()  # now rank 0 may leave
            else:
                transport.recv((1,), torch.float32, 1).wait()
        results.put((rank, [(list(t.shape), str(t.dtype), t.flatten().tolist()) for t in received], timeout,
                     released))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", None, None))


def _channels(rank: int, rendezvous, results) -> None:
    """One of two gloo ranks with two channels 0 -> 1: rank 1 posts channel 2's receives before channel 1's,
    rank 0 sends channel 1's first; each channel delivers in its own order."""
    try:
        torch.set_num_threads(1)
        with GlooTransport(rank, 2, "cpu", rendezvous=rendezvous, timeout_s=30,
                           edges=[(0, 1, 1), (0, 1, 2)]) as transport:
            if rank == 0:
                sends = [transport.send(torch.tensor([10.0 * c + k]), 1, channel=c) for c in (1, 2) for k in range(3)]
                for h in sends:
                    h.wait()
                got = None
            else:
                posted = {c: [transport.recv((1,), torch.float32, 0, channel=c) for _ in range(3)] for c in (2, 1)}
                got = {c: [h.wait().item() for h in posted[c]] for c in (2, 1)}
                try:
                    transport.send(torch.zeros(1), 0, channel=1)
                except TransportError as exc:
                    got["error"] = str(exc)
        results.put((rank, got))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _on_two_ranks(monkeypatch, target, *args) -> tuple[list, list[int | None], OSError | None]:
    """What `target(rank, *args, rendezvous, results)` puts on `results` in each of two rank processes, in the
    order they put it, the ranks' exit codes, and what another socket got binding the port they meet on right after
    its choice (None: it took the port, and holds it until the ranks are done). They start as a run's ranks do
    (workload/processes.py: forked from the server that imported torch once, where a spawned interpreter imports
    it again for each)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the ranks import this module
    ctx = rank_context()
    results = ctx.Queue()
    with served_rendezvous() as rendezvous, socket.socket() as intruder:
        try:
            intruder.bind((rendezvous.host, rendezvous.port))
            intruder.listen()
            refused = None
        except OSError as exc:
            refused = exc
        procs = [ctx.Process(target=target, args=(rank, *args, rendezvous, results), daemon=True) for rank in range(2)]
        for p in procs:
            p.start()
        try:
            put = [results.get(timeout=120) for _ in procs]
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return put, [p.exitcode for p in procs], refused


@pytest.mark.slow
def test_no_socket_can_take_the_port_the_ranks_meet_on_between_its_choice_and_their_joining(monkeypatch):
    """The port a job's ranks meet on is held from the moment the OS chose it (workload/transport.py Rendezvous):
    another socket binding it before the ranks join is refused, and the ranks join and exchange. A port chosen,
    released, then bound by rank 0 (374442dc's free_port) went to that socket, and the ranks never joined."""
    put, exit_codes, refused = _on_two_ranks(monkeypatch, _channels)
    assert refused is not None and refused.errno == errno.EADDRINUSE
    assert dict(put)[1][1] == [10.0, 11.0, 12.0] and exit_codes == [0, 0]


@pytest.mark.slow
def test_gloo_channels_are_separate_fifos(monkeypatch):
    got = dict(_on_two_ranks(monkeypatch, _channels)[0])
    assert got[1] == {2: [20.0, 21.0, 22.0], 1: [10.0, 11.0, 12.0],
                      "error": "rank 1: no link 1 -> 0 on channel 1 was opened"}, got
    assert got[0] is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gloo", "host-staged"])
def test_two_real_ranks_exchange_tensors_with_pre_posted_receives(kind, monkeypatch):
    put, exit_codes, _ = _on_two_ranks(monkeypatch, _exchange, kind)
    got = {rank: rest for rank, *rest in put}
    for rank in (0, 1):
        values, timeout, released = got[rank]
        # gloo tells a send's completion only to a wait: the transport's waiter lets each go once sent
        assert released is True, f"rank {rank}: sends nobody waited on still hold their tensors"
        peer = 1 - rank
        assert values == [([3], "torch.float32", [10.0 * peer] * 3),
                          ([2, 4], "torch.float64", [10.0 * peer + 1] * 8),
                          ([5], "torch.int64", [10 * peer + 2] * 5)], values
    assert got[1][1] == "rank 1: receive #4 from rank 0 timed out after 0.5 s"
    assert exit_codes == [0, 0]


@pytest.mark.parametrize(("name", "passes"), [("sgd", 3), ("momentum", 3), ("adam", 10), ("adamw", 13)])
def test_prediction_and_averaging_without_kept_spares_move_one_pass_a_op(name, passes):
    """Where the spares keep nothing (a GPU's run and calibration), a prediction and an average write new tensors in
    one pass, as torch's out-of-place ops and PipeOptim's in-place prediction do: no copy into a taken tensor first
    (d403e19's: SGD's prediction 7 weights' bytes, one replica's average 13). Bytes moved as the count tallies them."""
    from pipesim.workload.count import _MovedBytes, _Tally

    def moved(op):
        tally = _Tally()
        with _MovedBytes(tally):
            op()
        return tally.moved_bytes / (1024 * 1024 * 4)

    w = torch.empty(1024, 1024, device="meta", requires_grad=True)
    w.grad = torch.empty_like(w)
    optimizer = make_optimizer(name, [w], LR)
    optimizer.step()
    # SGD: read W and d, write; Adam: sqrt, div, add over v, then read W, m and the denominator, write (AdamW: + decay)
    assert moved(lambda: predict_weights(optimizer, [w], 2)) == passes
    replica, reference = [torch.empty(1024, 1024, device="meta")], [torch.empty(1024, 1024, device="meta")]
    assert moved(lambda: elastic_average([replica], reference, 0.5)) == 9  # D = X - R, X -= aD, R += aD: 3 each
