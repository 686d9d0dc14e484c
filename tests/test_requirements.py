"""Every torch command checks the optional modules it needs before any work (sweep's pyarrow and ray:
test_sweep): a missing one is one line naming what
needs it and how to install it, exit code 2, no traceback, nothing written. The modules are hidden here by
a None entry in sys.modules, which makes their import fail as an uninstalled module's does."""

from __future__ import annotations

import sys

import pytest
import torch

from pipesim.workload import data
from pipesim.workload.models import DIGITS_MODELS, MODELS, build_model
from tests.conftest import pipesim


@pytest.mark.parametrize("hidden,args,message", [
    ("torch", ("calibrate", "--model", "gpt", "--out", "{tmp}/p.json"),
     "pipesim calibrate needs PyTorch, which is not installed: pip install 'pipesim[torch]'"),
    ("torch", ("run", "-s", "1f1b", "--model", "gpt", "--trace", "{tmp}/t.json"),
     "pipesim run needs PyTorch, which is not installed: pip install 'pipesim[torch]'"),
    ("torch", ("study", "--results", "{tmp}/p.json", "--html", "{tmp}/s.html"),
     "pipesim study needs PyTorch, which is not installed: pip install 'pipesim[torch]'"),
    ("sklearn", ("calibrate", "--model", "gpt", "--out", "{tmp}/p.json"),
     "pipesim calibrate's runtime probe (--no-runtime skips it) needs scikit-learn"),
    ("sklearn", ("calibrate", "--model", "mlp", "--no-runtime", "--out", "{tmp}/p.json"),
     "pipesim calibrate --model mlp (it trains on scikit-learn's digits) needs scikit-learn, which is not "
     "installed: pip install 'pipesim[torch]' (or pip install scikit-learn)"),
    ("sklearn", ("run", "-s", "graphpipe", "-p", 4, "--model", "two-branch", "--trace", "{tmp}/t.json"),
     "pipesim run --model two-branch (it trains on scikit-learn's digits) needs scikit-learn"),
    ("sklearn", ("study", "--results", "{tmp}/p.json", "--html", "{tmp}/s.html"),
     "pipesim study --model mlp (it trains on scikit-learn's digits) needs scikit-learn"),
])
def test_a_missing_optional_module_is_one_line_with_the_install_before_any_work(tmp_path, monkeypatch, hidden, args,
                                                                               message):
    monkeypatch.setitem(sys.modules, hidden, None)
    code, out, err = pipesim(*(str(a).format(tmp=tmp_path) for a in args))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert message.format(tmp=tmp_path) in " ".join(err.split())
    assert list(tmp_path.iterdir()) == []


def test_the_models_that_need_scikit_learn_are_the_ones_that_draw_the_digits(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))  # a host that has not kept the digits split yet
    for module in [name for name in sys.modules if name.split(".")[0] == "sklearn"] + ["sklearn"]:
        monkeypatch.setitem(sys.modules, module, None)
    data.digits.cache_clear()
    needs = set()
    try:
        for name in MODELS:
            try:  # what a run does with it: build it, draw a batch, score it on its held-out set
                model = build_model(name, layers=1, width=4)
                model.make_batch(2, torch.Generator().manual_seed(0))
                if model.heldout is not None:
                    model.heldout()
            except ModuleNotFoundError as exc:
                assert exc.name.split(".")[0] == "sklearn"
                needs.add(name)
    finally:
        data.digits.cache_clear()  # loaded again, with scikit-learn back, by the next test that draws them
    assert needs == DIGITS_MODELS
