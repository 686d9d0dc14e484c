"""Lines a new user reads: counts of one thing read in the singular, refusals read as sentences."""

import pytest

from pipesim.commands.common import InputError
from pipesim.commands.tune import _check_degrees
from pipesim.units import count_text
from tests.conftest import pipesim


def test_count_text_is_singular_for_one():
    assert count_text(1, "mini-batch") == "1 mini-batch"
    assert count_text(4, "mini-batch") == "4 mini-batches"
    assert count_text(1, "profile") == "1 profile"
    assert count_text(1200, "profile") == "1,200 profiles"
    assert count_text(1, "weight copy") == "1 weight copy"
    assert count_text(2, "weight copy") == "2 weight copies"
    assert count_text(2, "day") == "2 days"


def test_simulate_header_counts_one_in_the_singular():
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", "1", "-m", "1", "-n", "1")
    assert code == 0, err
    assert out.splitlines()[0] == "p=1 device per pipeline, m=1 micro-batch, N=1 mini-batch"


def _splits_any(tensor: int) -> bool:
    """A model every t splits."""
    return True


def test_a_degree_that_does_not_divide_the_devices_is_named_with_what_would():
    """The refusal says how the devices are split, which degree fails (their product where none alone does) and
    the nearest --devices and degree that would do: a t among them only where it splits the model."""
    with pytest.raises(InputError) as one:
        _check_degrees(7, 2, None, 1, None, _splits_any)
    assert str(one.value) == ("--devices: give p stages x d replicas x t GPUs per stage, a multiple of "
                              "--tensor-parallel 2 (got 7); give --devices 6 or 8, or --tensor-parallel 1 or 7")
    with pytest.raises(InputError) as unsplit:  # the model's heads take no 7
        _check_degrees(7, 2, None, 1, None, lambda tensor: tensor != 7)
    assert str(unsplit.value).endswith("give --devices 6 or 8, or --tensor-parallel 1")
    with pytest.raises(InputError) as two:
        _check_degrees(8, 3, 2, 1, None, _splits_any)
    assert str(two.value).endswith("a multiple of --tensor-parallel 3 x --data-parallel 2 = 6 (got 8): "
                                   "--tensor-parallel 3 does not divide 8; give --devices 6 or 12, or "
                                   "--tensor-parallel 2 or 4")
    with pytest.raises(InputError) as context:
        _check_degrees(8, 2, 4, 2, None, _splits_any)
    assert str(context.value) == ("--devices: give p stages x d replicas x t GPUs per stage x C context-parallel "
                                  "ranks, a multiple of --tensor-parallel 2 x --data-parallel 4 x --context-parallel "
                                  "2 = 16 (got 8); give --devices 16")
    # one degree fails alone, but the others' product does not divide D either: their product is named (it was
    # "--tensor-parallel 1", which 1 x 4 x 2 = 8 refuses too, and with C = 6 a traceback: no divisor of 12 // 24)
    for context, product in ((2, 40), (6, 120)):
        with pytest.raises(InputError) as others:
            _check_degrees(12, 5, 4, context, None, _splits_any)
        assert str(others.value).endswith(f"--tensor-parallel 5 x --data-parallel 4 x --context-parallel {context} = "
                                          f"{product} (got 12); give --devices {product}")


def test_a_context_degree_that_does_not_split_the_sequence_is_refused_for_that_before_any_devices_are_suggested():
    """New-user pass: C = 3 of 16 devices at 8,192 tokens was told "give --devices 15 or 18", then at 18 that C = 3
    does not split the sequence into 2C chunks. The sequence's refusal comes first, naming the Cs that split both."""
    with pytest.raises(InputError) as both:
        _check_degrees(16, None, None, 3, 8192, _splits_any)
    assert str(both.value).endswith("give --context-parallel 2 or 4 (C must divide --seq-len / 2 = 4,096 and "
                                    "--devices 16)")
    with pytest.raises(InputError) as devices:  # a review: 4 or 8 were named, and 8 does not divide 12
        _check_degrees(12, None, None, 5, 8192, _splits_any)
    assert "give --context-parallel 4 (C must divide" in str(devices.value)
    _check_degrees(12, 3, 4, 5, 8192, _splits_any)  # no C of 2 or more divides 12 / (3 x 4): left to check_context
    with pytest.raises(InputError):
        _check_degrees(16, None, None, 3, 6144, _splits_any)  # 3 splits 6,144 into 6 chunks: the devices refuse it
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                             "--seq-len", 8192, "--attention", "flash", "--devices", 16, "--context-parallel", 3)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--context-parallel 3 does not split the sequence of 8,192 tokens" in err and "give --devices" not in err


@pytest.mark.parametrize(("experts", "searched"), [((), "t, b, recomputation and p"),
                                                   (("--experts", 8, "--top-k", 2), "t, b, recomputation, E and p")])
def test_tune_says_it_searches_e_for_a_mixture_of_experts(monkeypatch, experts, searched):
    """tune's progress line names what the estimates vary: E too where a mixture of experts' E is searched."""
    pytest.importorskip("torch")
    from pipesim.commands import tune

    said = []

    def working(what):
        said.append(what)
        raise InputError("stopped after the first progress line")

    monkeypatch.setattr(tune, "_working", working)
    code, _, _ = pipesim("tune", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                         "--seq-len", 32, "--vocab", 100, "-D", 8, *experts)
    assert code == 2 and said == [f"estimating the model's profile for each {searched}"]


def test_estimate_names_its_curve_and_prints_the_sources_on_asking(tmp_path):
    """estimate's caption gives the curve's fractions and points to --sources, which prints every source in full
    (about 25 lines at 80 columns that a user who does not ask need not scroll past)."""
    pytest.importorskip("torch")
    from pipesim.profiles.schema import load_profile

    args = ("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
            "--seq-len", 32, "--vocab", 100, "--attention", "flash", "-o", tmp_path / "p.json")
    code, out, err = pipesim(*args)
    assert code == 0, err
    assert "attention kernel flash2), per GPU" in " ".join(out.split())
    curve = load_profile(tmp_path / "p.json").estimate.curve
    source = curve["source"]
    said = " ".join(out.split())
    assert (f"efficiency curve: products {curve['matmul_efficiency']:.3g}, attention (flash2) "
            f"{curve['attention_efficiency']:.3g}, memory {curve['memory_efficiency']:.3g}, link "
            f"{curve['link_efficiency']:.3g}, network {curve['network_efficiency']:.3g} of the datasheet's") in said
    assert "--sources says where each comes from" in said and "https://" not in said
    code, out, err = pipesim(*args, "--sources")
    # one line the terminal wraps, not folded at the table's width: each address stays whole to open
    assert code == 0 and f"efficiency curve's sources: {source}" in out.splitlines(), err
    assert "its sources at the end" in " ".join(out.split()) and "https://" in source


def test_an_unfused_attention_names_no_attention_kernel(tmp_path):
    """A gpt counted with its default math attention (the scores materialised, as --dropout's Megatron-LM runs)
    runs no fused attention kernel: neither estimate's title and curve nor simulate's caption name one, where they
    said "attention kernel flash2" and gave FlashAttention-2's efficiency."""
    pytest.importorskip("torch")
    shape = ("--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4, "--seq-len", 32, "--vocab", 100,
             "--dropout", 0.1)
    code, out, err = pipesim("estimate", "--gpu", "h100-sxm", *shape, "-o", tmp_path / "p.json")
    assert code == 0, err
    said = " ".join(out.split())
    assert "(bfloat16, micro-batch 1, t=1 p=1 d=1), per GPU" in said and "efficiency curve: products " in said
    assert "attention kernel" not in said and "attention (" not in said
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", *shape, "-s", "1f1b", "-p", 2, "-m", 2)
    assert code == 0, err
    assert "costs: estimated on NVIDIA H100 SXM5 80GB (t=1) from the model" in " ".join(out.split())


def test_sweeps_group_of_one_micro_batch_reads_in_the_singular():
    from pipesim.planning.sweep import _group_name

    assert _group_name((4, 1.0, 1)) == "p=4, cost×1, mini-batch of 1 micro-batch"
    assert _group_name((4, 2.0, 8)) == "p=4, cost×2, mini-batch of 8 micro-batches"


def test_no_function_hides_a_units_helper_it_imports_under_a_local_of_its_name():
    """A function that binds a name its module imports from units.py (as `counted`, the name pipesim gives a
    model's count, once was) makes every call of that helper in it an UnboundLocalError, on that path only."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hidden = []
    for path in sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts):
        text = path.read_text()
        if "units" not in text:  # imports nothing from units.py: nothing to hide (parsing every module takes seconds)
            continue
        tree = ast.parse(text)
        imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[-1] == "units" for alias in node.names}
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            bound = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            bound |= {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
            hidden += [f"{path.relative_to(root)}:{function.lineno} {name}" for name in sorted(imported & bound)]
    assert not hidden, hidden
