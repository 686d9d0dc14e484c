"""The built-in models' data: the digits split, micro-batch draws, and that both tasks can be learned."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from pipesim.workload import data  # noqa: E402
from pipesim.workload.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_digits_split_is_fixed_disjoint_and_stratified():
    split = data.digits()
    assert (len(split.train_y), len(split.heldout_y)) == (1437, 360)
    data.digits.cache_clear()
    again = data.digits()
    assert torch.equal(split.train_x, again.train_x) and torch.equal(split.heldout_y, again.heldout_y)
    train_rows = {tuple(row.tolist()) for row in split.train_x}
    assert not any(tuple(row.tolist()) in train_rows for row in split.heldout_x)
    train_share = torch.bincount(split.train_y, minlength=10) / len(split.train_y)
    heldout_share = torch.bincount(split.heldout_y, minlength=10) / len(split.heldout_y)
    assert (train_share - heldout_share).abs().max() < 0.01
    assert split.train_x.mean(0).abs().max() < 1e-5 and split.heldout_x.abs().max() < 20  # train statistics


def test_the_split_kept_in_the_host_cache_is_read_back_whole_and_a_damaged_one_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))
    made = data.digits_split()
    (kept,) = tmp_path.iterdir()
    assert all((data.digits_split()[name] == made[name]).all() for name in data.SPLIT_ARRAYS)
    kept.write_bytes(kept.read_bytes()[:100])
    assert all((data.digits_split()[name] == made[name]).all() for name in data.SPLIT_ARRAYS)
    assert kept.stat().st_size > 100  # written again, whole


def test_a_rank_draws_the_digits_and_steps_without_importing_scikit_learn_or_dynamo():
    """What each rank of a run does first, in a fresh interpreter: scikit-learn (1.2-1.5 s) is not imported once
    the host cache holds the split, nor torch._dynamo (1.5-1.9 s), which torch.optim's step would import."""
    data.digits_split()  # kept in the session's host cache, which the child inherits
    child = """
import sys, torch
from pipesim.workload.models import build_model
from pipesim.workload.optim import make_optimizer
model = build_model("mlp", layers=1, width=8)
net = torch.nn.Sequential(*model.layers)
optimizer = make_optimizer("adam", net.parameters(), 0.1)
x, y = model.make_batch(4, torch.Generator().manual_seed(0))
model.loss(net(x), y).backward()
optimizer.step()
print(sorted(m for m in ("sklearn", "torch._dynamo") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "two-branch"])
def test_same_seed_same_microbatch(name):
    model = build_model(name, layers=1, width=8)
    first = model.make_batch(6, torch.Generator().manual_seed(7))
    second = model.make_batch(6, torch.Generator().manual_seed(7))
    other = model.make_batch(6, torch.Generator().manual_seed(8))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


def _train(model, steps: int, b: int, lr: float) -> None:
    net = torch.nn.Sequential(*model.layers)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = model.make_batch(b, gen)
        optimizer.zero_grad()
        model.loss(net(x), y).backward()
        optimizer.step()


def test_mlp_learns_digits():
    torch.manual_seed(0)
    model = build_model("mlp", layers=2, width=64)
    x, y = model.heldout()
    before = model.score(torch.nn.Sequential(*model.layers)(x), y)
    _train(model, steps=300, b=32, lr=0.05)
    with torch.no_grad():
        after = model.score(torch.nn.Sequential(*model.layers)(x), y)
    assert before["accuracy"] < 0.3 and after["accuracy"] > 0.8
    assert after["loss"] < before["loss"]


def test_gpt_token_task_loss_falls_towards_its_floor():
    torch.manual_seed(0)
    model = build_model("gpt", layers=1, width=32, heads=2, seq_len=16, vocab=16)
    x, y = model.heldout()
    net = torch.nn.Sequential(*model.layers)
    before = model.score(net(x), y)["loss"]
    _train(model, steps=150, b=16, lr=0.05)
    with torch.no_grad():
        after = model.score(net(x), y)
    floor = data.token_loss_floor(16)
    assert after["loss"] < before - 0.5 and after["loss"] > floor - 0.1
    assert after["accuracy"] > 0.5


def test_token_task_follows_its_rule():
    ids, targets = data.token_batch(64, 32, 50, torch.Generator().manual_seed(0))
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    follows = (data.successor(50)[ids] == targets).float().mean()
    assert 1 - data.TOKEN_NOISE - 0.05 < follows < 1 - data.TOKEN_NOISE + 0.05


def test_a_model_makes_its_held_out_set_only_when_a_run_scores_it():
    """Building a model, as counting it does, leaves its held-out set unmade: the token task's 256 sequences at
    Llama 3.1 405B's 131,072 tokens took 3.8 of its first count's 16 CPU-s. A run's score makes it, the same set."""
    calls = data.token_heldout.cache_info()
    model = build_model("gpt", layers=1, width=32, heads=2, seq_len=23, vocab=16)
    assert data.token_heldout.cache_info() == calls  # not asked for, cached or not
    x, y = model.heldout()
    assert x.shape == (data.HELDOUT_SEQUENCES, 23) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, data.token_heldout(23, 16)[0])
