"""Host-bound execution (planning/host.py): after a dropless MoE dispatcher's device-to-host synchronisation a MoE
layer's passes run their kernels no sooner than the host issues them, from the queue the synchronisation emptied
(`waited_ms`, its recursion tested in test_host_order.py); a dense layer and experts padded to their capacity wait
for nothing but their stage's issue (test_host_floor.py); bad values are one line."""

from __future__ import annotations

import pytest

from tests.conftest import needs_transformers, pipesim
from tests.helpers import GPT_OSS, MIXTRAL, write_config
from tests.helpers import MOE_GPT_FLAGS as MOE
from tests.helpers import estimated_layers as layers


def own_times(tmp_path, *args) -> list[dict]:
    """The layers' times and the rest, without their issue (`host_issue`), which their stages are floored by."""
    return [{key: value for key, value in layer.items() if key != "host_issue"} for layer in layers(tmp_path, *args)]


def test_a_moe_layers_passes_wait_for_the_host_to_issue_their_kernels(tmp_path):
    """At 1 ms and 2 ms a kernel the host outlasts the GPU: each pass of a MoE block ends once the host has issued
    its kernels and the GPU run the last, so the two differ by its kernel count, and it lies below its issue plus its
    GPU time; each pass of the model, started with the host not ahead (a backward's last layer first), takes at
    least its layers' issue less their all-to-alls (held apart in the profile, hidden under the host's issue). The
    dense layers (embedding, head) are issued in the model's segments too, so they wait for the host as well."""
    free, slow, slower = (layers(tmp_path, *MOE, "--host-kernel-us", us) for us in (0, 1000, 2000))
    moe = [i for i, layer in enumerate(free) if layer["all_to_all_fwd_ms"] > 0]
    assert moe == [1, 2]
    for name in ("fwd", "bwd", "igrad", "wgrad"):
        issued = [host2[name]["median_ms"] - host[name]["median_ms"] for host, host2 in zip(slow, slower)]
        assert issued == pytest.approx([round(kernels) for kernels in issued])
        assert all(issued[i] > 5 for i in moe)
        assert all(gpu[name]["median_ms"] + 0.1 * kernels <= host[name]["median_ms"] <= kernels + gpu[name]["median_ms"]
                   for gpu, host, kernels in zip(free, slow, issued))
        hidden_ms = sum({"fwd": layer["all_to_all_fwd_ms"], "wgrad": 0.0}.get(name, layer["all_to_all_bwd_ms"])
                        for layer in slow)
        assert sum(host[name]["median_ms"] for host in slow) >= sum(issued) - hidden_ms - 1e-9


def test_a_host_faster_than_the_gpu_and_layers_that_never_wait_are_the_gpus(tmp_path):
    """At 0.1 us a kernel the model's passes wait for their first kernel's issue alone, the embedding's (the forward)
    and the head's (each backward pass, from the queue the forward emptied), the host ahead after them; a dense
    model's layers and experts padded to their capacity (the sizes known on the host: no synchronisation) are the
    GPU's at 1 ms a kernel (their stages take their issue: test_host_floor.py)."""
    fast, free = layers(tmp_path, *MOE, "--host-kernel-us", 0.1), layers(tmp_path, *MOE, "--host-kernel-us", 0)
    first = {"fwd": 0, "bwd": 3, "igrad": 3, "wgrad": 3, "fwd_sharing_ms": 0, "bwd_sharing_ms": 3}
    for i, (quick, gpu) in enumerate(zip(fast, free, strict=True)):
        for name in ("fwd", "bwd", "igrad", "wgrad"):
            waited_ms = 1e-4 if i == first[name] else 0.0
            assert quick.pop(name)["median_ms"] == pytest.approx(gpu.pop(name)["median_ms"] + waited_ms, abs=1e-12)
        for name in ("fwd_sharing_ms", "bwd_sharing_ms"):
            waited_ms = 1e-4 if i == first[name] else 0.0
            assert quick.pop(name) == pytest.approx(gpu.pop(name) + waited_ms, abs=1e-12)
        assert quick.pop("all_to_all_paired_ms") == pytest.approx(gpu.pop("all_to_all_paired_ms"), abs=2e-4)
        assert quick.pop("host_issue")["fwd"]["idle_ms"] >= gpu.pop("host_issue")["fwd"]["idle_ms"]
    assert fast == free
    dense = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--gpu", "h100-sxm")
    assert own_times(tmp_path, *dense, "--host-kernel-us", 1000) == own_times(tmp_path, *dense, "--host-kernel-us", 0)
    padded = (*MOE, "--capacity-factor", 1.5)
    assert own_times(tmp_path, *padded, "--host-kernel-us", 1000) == own_times(tmp_path, *padded, "--host-kernel-us",
                                                                                0)


def test_the_default_host_cost_binds_a_small_moe_layer_and_is_named_only_when_changed(tmp_path):
    """31.9 us a kernel (eager PyTorch's, planning/host.py) outlasts this small block's GPU forward."""
    default, free = layers(tmp_path, *MOE), layers(tmp_path, *MOE, "--host-kernel-us", 0)
    assert default[1]["fwd"]["median_ms"] > free[1]["fwd"]["median_ms"]
    code, out, err = pipesim("simulate", *MOE, "-p", 1, "-m", 2, "-s", "1f1b", "--host-kernel-us", 30)
    assert code == 0, err
    assert "host kernel 30 us" in " ".join(out.split())


def test_a_negative_host_cost_is_one_line(tmp_path):
    code, out, err = pipesim("estimate", *MOE, "--host-kernel-us", -1, "-o", tmp_path / "x.json")
    assert code == 2 and not out and err.count("\n") == 1 and "--host-kernel-us" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["estimate", "simulate"])
def test_an_infinite_host_cost_is_one_line(tmp_path, command):
    """inf (and nan, and past 10,000 us) refused before any layer is priced (an infinite forward was a traceback),
    nothing written."""
    where = ("-o", tmp_path / "x.json") if command == "estimate" else ("-p", 1, "-m", 2, "-s", "1f1b")
    code, out, err = pipesim(command, *MOE, "--host-kernel-us", "inf", *where)
    assert (code, out) == (2, "") and "Traceback" not in err
    assert err == ("error: --host-kernel-us: the host's microseconds to issue a kernel, a finite number from 0 to "
                   "10,000 (got inf)\n")
    assert not list(tmp_path.iterdir())


def test_under_fsdp_float8_all_gather_the_host_issues_no_weight_casts(tmp_path):
    """torchao's float8 casts each weight in every pass, which the host issues; under FSDP2's float8 all-gather the
    shard is cast before the all-gather instead, so a MoE forward issues fewer kernels (its experts' and
    projections' weight casts)."""
    float8 = (*MOE, "--dtype", "fp8", "--fp8-recipe", "torchao", "--zero", 3, "--precision", "fsdp2")
    kernels = []
    for gather in ((), ("--fsdp-float8-all-gather",)):
        slow, slower = (layers(tmp_path, *float8, *gather, "--host-kernel-us", us) for us in (1000, 2000))
        kernels.append(round(slower[1]["fwd"]["median_ms"] - slow[1]["fwd"]["median_ms"]))
    assert kernels[1] < kernels[0]


def _issued_per_ms(tmp_path, *args) -> dict[str, float]:
    """A MoE block's pass times at 1 ms and 2 ms a module call (kernels free, the host outlasting the GPU): their
    difference, per pass, is the module calls the host pays, weighted as `pass_kernels` weights them."""
    slow, slower = (layers(tmp_path, *args, "--host-kernel-us", 0, "--host-module-us", us) for us in (1000, 2000))
    return {name: round(slower[1][name]["median_ms"] - slow[1][name]["median_ms"], 6)
            for name in ("fwd", "bwd", "igrad", "wgrad")}


def test_each_transformer_engine_module_call_costs_the_host_twice_in_float8(tmp_path):
    """The gpt MoE block under Megatron-core's TransformerEngine spec calls linear_qkv, linear_proj, the two
    GroupedLinear products of its experts (one call each over the rank's four local experts) and
    DotProductAttention: in BF16 five calls, in float8 the four linear modules twice (TransformerEngine issue 761)
    and the attention once, 9; forward, backward and input-gradient passes alike, none in the weight-gradient pass
    (its GEMMs alone). Its router is no module (TopKRouter's gating product: `router_gating_linear`), nor are the
    attention's batched products under math attention."""
    flash = (*MOE, "--attention", "flash")
    assert _issued_per_ms(tmp_path, *flash) == {"fwd": 5.0, "bwd": 5.0, "igrad": 5.0, "wgrad": 0.0}
    float8 = _issued_per_ms(tmp_path, *flash, "--dtype", "fp8", "--fp8-recipe", "te-current")
    assert float8 == {"fwd": 9.0, "bwd": 9.0, "igrad": 9.0, "wgrad": 0.0}
    grouped = _issued_per_ms(tmp_path, *flash, "--dtype", "fp8", "--fp8-recipe", "te-current",
                             "--expert-gemm", "per-expert")
    assert grouped == float8  # a GroupedLinear is one call, whatever GEMMs it issues per local expert
    assert _issued_per_ms(tmp_path, *MOE)["fwd"] == 4.0  # qkv, proj, fc1, fc2: no attention module


def test_the_module_cost_defaults_by_the_runtime(tmp_path):
    """TransformerEngine's recipes default to 83.1 us a call (PR 1191's 115 us less its GEMM's issue), named only
    when given; eager PyTorch (no recipe, torchao's) to none. A dense model's layers never wait, at any module
    cost."""
    te = (*MOE, "--attention", "flash", "--dtype", "fp8", "--fp8-recipe", "te-current", "--host-kernel-us", 0)
    assert layers(tmp_path, *te) == layers(tmp_path, *te, "--host-module-us", 115 - 31.9)
    assert layers(tmp_path, *te) != layers(tmp_path, *te, "--host-module-us", 0)
    eager = (*MOE, "--host-kernel-us", 0)
    assert layers(tmp_path, *eager) == layers(tmp_path, *eager, "--host-module-us", 0)
    dense = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--gpu", "h100-sxm",
             "--dtype", "fp8", "--fp8-recipe", "te")
    assert own_times(tmp_path, *dense, "--host-module-us", 10000) == own_times(tmp_path, *dense, "--host-module-us", 0)
    code, out, err = pipesim("simulate", *te, "-p", 1, "-m", 2, "-s", "1f1b", "--host-module-us", 50)
    assert code == 0, err
    assert "host module 50 us" in " ".join(out.split())
    code, out, err = pipesim("simulate", *te, "-p", 1, "-m", 2, "-s", "1f1b")
    assert code == 0, err
    assert "host module" not in " ".join(out.split())


def test_the_help_gives_the_host_costs_the_planner_defaults_to():
    """--help states both defaults as numbers: each the planner's constant (planning/host.py), the module call's the
    115 us of TransformerEngine PR 1191 less the default kernel's issue."""
    from typing import get_args

    from pipesim.commands.common import HostKernelUs, HostModuleUs
    from pipesim.planning.host import HOST_KERNEL_US, TE_MODULE_US

    assert TE_MODULE_US == pytest.approx(115 - HOST_KERNEL_US)
    assert f"Default: {HOST_KERNEL_US:g}," in get_args(HostKernelUs)[1].help
    assert f"Default: {TE_MODULE_US:g} under --fp8-recipe te" in get_args(HostModuleUs)[1].help


@pytest.mark.parametrize("value", ["inf", "-1"])
def test_a_bad_module_cost_is_one_line(tmp_path, value):
    code, out, err = pipesim("estimate", *MOE, "--host-module-us", value, "-o", tmp_path / "x.json")
    assert code == 2 and not out and err.count("\n") == 1 and "--host-module-us" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_repeated_blocks_passes_are_mapped_once_and_each_keeps_its_carried_wait(tmp_path, monkeypatch):
    """The blocks after the first repeat its kernels: `pass_issue` runs once per pass of each distinct layer (the
    embedding, the first block, the head), where it ran once per layer (a third of tune's estimates on
    Qwen3-30B-A3B), and each layer's map keeps the wait carried to it, which differs along the model."""
    from pipesim.planning import estimate, host

    mapped = []
    monkeypatch.setattr(estimate, "pass_issue", lambda kernels, carried_ms: mapped.append(carried_ms)
                        or host.pass_issue(kernels, carried_ms))
    deep = (*MOE[:2], "--layers", 4, *MOE[4:])
    free, slow = (layers(tmp_path, *deep, "--host-kernel-us", us) for us in (0, 1000))
    # both runs: 3 distinct layers, each pass and the forward and backward beside the dispatcher's multiprocessors
    assert len(slow) == 6 and len(mapped) == 2 * 3 * (len(estimate.PASSES) + 2)
    for name in estimate.PASSES:
        carried = [layer["host_issue"][name]["carried_ms"] for layer in slow]
        assert carried == pytest.approx([host[name]["median_ms"] - gpu[name]["median_ms"]
                                         for host, gpu in zip(slow, free)])
        assert len({round(ms, 9) for ms in carried[1:5]}) > 1, carried  # the repeated blocks' waits differ


@needs_transformers
def test_megatron_ddps_hook_adds_each_local_experts_bias_gradient_in_a_kernel_the_host_issues(tmp_path):
    """gpt-oss's experts hold a bias each for their up and down products (TransformerEngine's GroupedLinear `bias{i}`),
    whose gradients no product accumulates: with the products accumulating the weights' (`--grad-accumulation
    fused`, Megatron-core's gradient accumulation fusion) its DDP hook adds each into main_grad, one kernel a bias
    after each pass that takes the weights' gradients: 2 a local expert (8 experts over 2 ranks: 8 kernels), none
    in the forward or input-gradient pass, none where autograd accumulates (`separate`), none for Mixtral's."""
    oss, mixtral = (f"hf:{write_config(tmp_path / name, fields)}" for name, fields in (("oss", GPT_OSS),
                                                                                        ("mixtral", MIXTRAL)))

    def kernels(model: str, accumulation: str) -> dict[str, float]:
        """The MoE layer's kernels a pass: its time at 2 ms a kernel less at 1 ms."""
        slow, slower = (layers(tmp_path, "--model", model, "--seq-len", 32, "-b", 2, "--gpu", "h100-sxm",
                               "--data-parallel", 2, "--expert-parallel", 2, "--dtype", "bf16",
                               "--grad-accumulation", accumulation, "--host-kernel-us", us)[1]
                        for us in (1000, 2000))
        return {name: slower[name]["median_ms"] - slow[name]["median_ms"] for name in ("fwd", "bwd", "igrad", "wgrad")}

    fused, separate = kernels(oss, "fused"), kernels(oss, "separate")
    assert {name: round(fused[name] - separate[name]) for name in fused} == {"fwd": 0, "bwd": 8, "igrad": 0, "wgrad": 8}
    plain = kernels(mixtral, "fused")
    assert {name: round(plain[name] - kernels(mixtral, "separate")[name]) for name in plain} == dict.fromkeys(plain, 0)


def test_only_transformer_layers_call_transformer_engines_modules(tmp_path):
    """Megatron-core's embedding and output layer are its own modules (VocabParallelEmbedding, ColumnParallelLinear),
    not TransformerEngine's: the head's product paid a float8 module call (twice 83.1 us) each pass under its float8
    recipes. The blocks' issue grows with the module cost; the embedding's and the head's do not."""
    dense = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--gpu", "h100-sxm",
             "--attention", "flash", "--dtype", "fp8", "--fp8-recipe", "te", "--host-kernel-us", 0)
    slow, slower = (layers(tmp_path, *dense, "--host-module-us", us) for us in (1000, 2000))
    assert [layer["name"] for layer in slow] == ["0:_Embed", "1:_Block", "2:_Block", "3:Sequential"]
    slack = [[layer["host_issue"][name]["slack_ms"] for name in ("fwd", "bwd", "igrad")] for layer in (*slow, *slower)]
    assert slack[:4:3] == slack[4::3] and all(0 < ms < 0.1 for ms in slack[3])  # the head: its GEMMs' issue alone
    assert all(many < few < 0 for many, few in zip(slack[5] + slack[6], slack[1] + slack[2]))


def test_the_caption_says_how_long_a_host_bound_stage_waits_for_its_host(tmp_path):
    """A small dense gpt on an H100 waits for its host to issue its kernels: each stage's share of waiting is its
    forward and backward's time less their GPU time (the same passes priced with the host free) over that time, and
    the caption gives the most a stage waits; with the host free it says nothing."""
    from pipesim.profiles.schema import load_profile, stage_host_share

    small = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256,
             "-b", 1, "-p", 2)
    profiles = {}
    for name, host in (("issued", ()), ("gpu", ("--host-kernel-us", 0))):
        assert pipesim("estimate", *small, *host, "--out", tmp_path / f"{name}.json").code == 0
        profiles[name] = load_profile(tmp_path / f"{name}.json")
    issued, gpu = profiles["issued"], profiles["gpu"]
    bounds = issued.partition.bounds
    assert gpu.partition.bounds == bounds
    shares = {name: [stage_host_share(profile.layers, a, b) for a, b in zip(bounds, bounds[1:])]
              for name, profile in profiles.items()}
    assert shares["gpu"] == [0.0, 0.0]
    assert shares["issued"] == pytest.approx([1 - (free.fwd_ms + free.bwd_ms) / (held.fwd_ms + held.bwd_ms)
                                              for held, free in zip(issued.stages, gpu.stages)], rel=1e-9)
    assert min(shares["issued"]) > 0.5
    code, out, err = pipesim("simulate", *small, "-m", 4, "-s", "1f1b")
    assert code == 0, err
    said = " ".join(out.split())
    assert f"host-bound: a stage's forward and backward wait up to {100 * max(shares['issued']):.1f}% of their time" \
        in said
    code, out, err = pipesim("simulate", *small, "-m", 4, "-s", "1f1b", "--host-kernel-us", 0)
    assert code == 0 and "host-bound" not in out, err
