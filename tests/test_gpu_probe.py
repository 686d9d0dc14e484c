"""benchmarks/gpu_probe.py, the probe for the questions only a GPU settles, run as a CPU smoke test: its JSON's
fields, its refusals, and that what it times computes what it stands for (the MoE layer a dense sum over each
token's experts, TransformerEngine's C = 2 ring one causal attention, forward and backward)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import pipesim, script_module

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    with script_module("gpu_probe") as module:
        yield module


def test_a_quick_cpu_run_writes_every_part_with_its_spread_and_says_why_gpu_parts_skip(probe, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert probe.main(["--device", "cpu", "--quick", "--repeats", "2", "--warmup", "0", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["environment"]["device"] == "cpu" and result["environment"]["torch"] == torch.__version__
    assert result["budget"] == {"warmup": 0, "repeats": 2}
    assert set(result["seconds"]) == {"moe", "attention", "gemm", "combine", "dense", "weights", "pair", "link"}
    assert "CUDA" in result["pair"]["skipped"] and "CUDA" in result["link"]["skipped"]  # (g), (h): on a GPU only

    layers = result["moe"]["layers"]
    assert [layer["local_experts"] for layer in layers] == [4, 8, 16]
    for layer in layers:
        for timing in layer["timings"].values():
            assert len(timing["samples_ms"]) == 2
            assert timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]
        assert sum(layer["tokens_per_expert_seen"]) == 64 * 4  # every token's 4 choices, dropless
        assert layer["counts"]["after_sync"]["kernels"] is None  # no CUDA kernels on a CPU
    after_sync_ops = [layer["counts"]["after_sync"]["ops"] for layer in layers]
    assert after_sync_ops[0] < after_sync_ops[1] < after_sync_ops[2]  # a GEMM pair and SwiGLU a local expert
    derived = result["moe"]["derived"]
    assert [entry["after_sync_host_us_per_op"] > 0 for entry in derived["per_layer"]] == [True] * 3
    assert derived["per_layer"][0]["after_sync_host_us_per_kernel"] is None
    assert "after_sync_host_ms" in derived["ms_per_added_local_expert"]
    for layer in layers:  # the device's time alone after the sync and in the backward; nothing to hold on a CPU
        assert {"after_sync_held_device_ms", "backward_held_device_ms"} <= set(layer["timings"])
        assert layer["hold"] == {"cycles": 0, "outlasted_issue": {"after_sync": None, "backward": None}}
    spans = ("before_sync", "after_sync", "backward")
    assert [entry["local_experts"] for entry in result["moe"]["kernels"]] == [4, 8, 16]
    for entry in result["moe"]["kernels"]:
        for span in spans:
            rows, ops = entry[span]["by_kernel"], entry[span]["by_op"]
            assert 0 < len(rows) <= probe.TOP_KERNELS + 1
            assert all(set(row) == {"kernel", "short", "op", "caller", "count", "device_us"} for row in rows)
            assert sum(row["count"] for row in rows) == sum(op["count"] for op in ops.values())
    assert any(row["op"] == "aten::mm" and row["caller"] == "aten::matmul"  # the experts' GEMMs, from Python
               for row in result["moe"]["kernels"][0]["after_sync"]["by_kernel"])
    combine = result["combine"]  # part (d): 256 rows of 64 into 64 tokens, BF16 and float32
    assert list(combine) == ["bfloat16", "float32"] and list(combine["bfloat16"]) == list(combine["float32"])
    assert {"index_add_", "scatter_add_", "index_put_ accumulate", "mul broadcast", "mul strided"} <= set(
        combine["bfloat16"])
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        assert combine[dtype]["index_add_"]["moved_bytes"] == (256 + 2 * 64) * 64 * size  # rows read, tokens summed
        assert combine[dtype]["mul strided"]["moved_bytes"] == 3 * 256 * 64 * size
        assert all(len(op["device_ms"]["samples_ms"]) == 2 for op in combine[dtype].values())

    kernels = result["attention"]["kernels"]
    assert list(kernels) == ["flash"]  # cuDNN's attention is timed on a GPU only
    assert set(kernels["flash"]) == {"c1", "c2_step0", "c2_step1_rank0", "c2_step1_rank1", "c2_rank0", "c2_rank1"}
    assert kernels["flash"]["c1"]["forward_ms"]["median_ms"] > 0
    for rank in ("c2_rank0", "c2_rank1"):
        assert {"forward_ms", "backward_ms", "forward_passes_ms", "backward_passes_ms"} <= set(kernels["flash"][rank])
        assert "CUDA" in kernels["flash"][rank]["forward_passes_compiled"]["skipped"]
        assert "CUDA" in kernels["flash"][rank]["forward_two_streams_ms"]["skipped"]
    assert result["attention"]["held_cycles"] == 0  # a CPU's spans start as they are: nothing to hold
    assert set(result["attention"]["c2_rank_over_half_c1"]["flash"]) == {
        "rank0_forward", "rank0_backward", "rank1_forward", "rank1_backward"}

    bf16 = result["gemm"]["bf16"]
    assert [(row["local_experts"], row["name"]) for row in bf16][:3] == [
        (4, "fc1 forward"), (4, "fc1 input grad"), (4, "fc1 weight grad")]
    assert len(bf16) == 12 and all(row["loop_tflops"] > 0 and row["one_gemm_tflops"] > 0 for row in bf16)
    for row in bf16:  # the device's time a GEMM behind a held device; kernels counted on a GPU only
        assert row["loop_held_us_per_gemm"] > 0 and len(row["loop"]["held_device_ms"]["samples_ms"]) == 2
        assert row["loop_kernels_per_gemm"] is None
        assert row["loop_profile"]["ops"] == row["local_experts"] and row["one_gemm_profile"]["ops"] == 1
        assert row["loop_profile"]["by_op"]["aten::mm"]["count"] == row["local_experts"]
    assert "compute capability 8.9" in result["gemm"]["fp8"]["skipped"]

    runs = result["weights"]["runs"]  # part (f): each path at 4 and 16 local experts, two weights an expert
    assert [(run["path"], run["local_experts"]) for run in runs] == [
        (path, n) for path in probe.WEIGHT_PATHS for n in (4, 16)]
    for run in runs:
        assert run["weights"] == 2 * run["local_experts"]
        assert run["hooks"] == (run["weights"] if run["hooked"] else 0)
        assert {"forward_host_ms", "backward_host_ms", "backward_device_ms", "backward_held_device_ms"} == set(
            run["timings"])
    ops = {(run["path"], run["local_experts"]): run["counts"]["ops"] for run in runs}
    assert ops["no products", 16] == ops["no products", 4]  # no weight gets a gradient: nothing a weight
    assert ops["dummies", 16] - ops["dummies", 4] == ops["dummies + hooks", 16] - ops["dummies + hooks", 4] > 0
    assert set(result["weights"]["derived"]) == set(probe.WEIGHT_PATHS)


def test_the_dense_part_alone_times_each_ranks_product_in_each_kind_that_runs_its_orientation(probe, tmp_path):
    """`--parts dense` runs part (e) alone: the quick shape's rank at t = 2 (its 12 products and the forward's and
    input gradient's chunks of half the rows), BF16 everywhere, its weight gradients also into float32 where torch
    can (a CPU's torch has no kernel for addmm's out_dtype), and the float8 kinds, which a CPU cannot run, skipped
    with why."""
    out = tmp_path / "probe.json"
    assert probe.main(["--device", "cpu", "--quick", "--parts", "dense", "--repeats", "2", "--warmup", "0",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"dense"} and "moe" not in result
    dense = result["dense"]
    assert all("compute capability 8.9" in dense["kinds"][name]["skipped"]
               for name in ("fp8 fast accum", "fp8", "fp8 e5m2 grad", "fp8 e5m2 grad into fp32"))
    assert dense["kinds"]["bf16 into fp32"] == {"orientations": ["weight grad"]}
    bf16 = [row for row in dense["products"] if row["kind"] == "bf16"]
    assert len(bf16) == 20 and all(row["tflops"] > 0 and len(row["timings"]["held_device_ms"]["samples_ms"]) == 2
                                   for row in bf16)
    shapes = {row["name"]: (row["m"], row["k"], row["n"]) for row in bf16}
    assert shapes["qkv forward"] == (32, 64, (4 + 2 * 2) * 16 // 2) and shapes["fc2 weight grad"] == (64, 32, 48)
    assert shapes["fc1 forward, a 1/2 chunk"] == (16, 64, 96) and shapes["proj input grad, a 1/2 chunk"] == (16, 64, 32)
    into_fp32 = [row for row in dense["products"] if row["kind"] == "bf16 into fp32"]
    assert [row["name"] for row in into_fp32] == [f"{layer} weight grad" for layer in ("qkv", "proj", "fc1", "fc2")]
    assert all(("tflops" in row) != ("skipped" in row) for row in into_fp32)  # timed, or why not
    assert {row["kind"] for row in dense["products"]} == {"bf16", "bf16 into fp32"}
    assert [(row["model"], row["recipe"]) for row in dense["sustained"]] == [("quick", "bf16"),
                                                                             ("quick", "fp8 (TE hybrid)")]
    assert "compute capability 8.9" in dense["sustained"][1]["skipped"]  # a recipe runs only if its kinds all run


def test_a_sustained_span_runs_the_layers_products_back_to_back_and_reads_no_clock_on_a_cpu(probe):
    cpu = torch.device("cpu")
    layer = [(probe.plain_kind(cpu, torch.float32), product)
             for product in probe.linear_products("fc1", 8, 16, 32)]
    calls = []
    counting = [(probe.GemmKind(kind.name, kind.operands, lambda *a, run=kind.multiply: calls.append(1) or run(*a)),
                 product) for kind, product in layer]
    measured = probe.time_sustained(counting, probe.Clock(False), probe.Budget(warmup=1, repeats=2))
    assert len(calls) == 3 * probe.SUSTAINED_LAYERS * 3  # a warm-up and two repeats of every layer's 3 products
    assert measured["layers"] == probe.SUSTAINED_LAYERS and measured["clocks"] == []
    assert len(measured["layer_ms"].samples_ms) == 2 and measured["layer_ms"].median_ms > 0


def test_the_llama_rows_products_are_a_ranks_share_of_each_layer_at_c2s_tokens(probe):
    eight, seventy = ({product.name: (product.m, product.k, product.n) for product in probe.dense_products(shape)}
                      for shape in probe.LLAMA31_DENSE)
    assert len(eight) == 12 and len(seventy) == 20  # at t = 4 the forward and input gradient in chunks too
    assert eight["qkv forward"] == (4096, 4096, 6144) and eight["fc2 input grad"] == (4096, 4096, 14336)
    assert seventy["qkv forward"] == (4096, 8192, (16 + 2 * 2) * 128) and seventy["proj forward"] == (4096, 2048, 8192)
    assert seventy["fc1 weight grad"] == (2 * 28672 // 4, 4096, 8192)
    assert seventy["fc2 forward, a 1/4 chunk"] == (1024, 7168, 8192)


def test_a_plain_kind_multiplies_its_operands_and_adds_into_its_accumulator(probe):
    cpu = torch.device("cpu")
    kind = probe.plain_kind(cpu, torch.float32)
    a, b = kind.operands(3, 5, 4)
    assert b.shape == (5, 4) and not b.is_contiguous()  # the weight stored n x k, read transposed
    torch.testing.assert_close(kind.multiply(a, b), a @ b)
    accumulating = probe.plain_kind(cpu, torch.bfloat16, torch.float32)
    assert accumulating.name == "bf16 into fp32" and accumulating.operands(3, 5, 4)[0].dtype == torch.float32
    # a CPU's torch runs no addmm into another dtype: its call (accumulator, then the operands) on the meta device
    meta = probe.plain_kind(torch.device("meta"), torch.bfloat16, torch.float32)
    added = meta.multiply(*meta.operands(3, 5, 4))
    assert added.shape == (3, 4) and added.dtype == torch.float32


@pytest.mark.parametrize("flags,message", [
    (["--repeats", "0"], "--repeats: 0 is not allowed"),
    (["--parts", "dense,moes"],
     "--parts: 'moes' is no part; give some of moe, attention, gemm, combine, dense, weights, pair, link"),
    (["--parts", "gemms,dense,moes"], "--parts: 'gemms', 'moes' are no parts; give some of moe, attention, "),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from "),  # quoted or not by version
    (["--device", "cpu", "--out", "/nonexistent-folder/probe.json"], "--out: the folder /nonexistent-folder"),
    *([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: torch sees no CUDA GPU")]),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(probe, tmp_path, capsys, flags, message):
    out = tmp_path / "probe.json"
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(probe.main([*(["--out", str(out)] if "--out" not in flags else []), *flags]))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_weights_paths_compute_autograds_gradients_and_megatrons_leave_them_in_main_grad(probe):
    """Part (f)'s products are the experts' (fc1, SwiGLU, fc2 on each expert's rows), and Megatron-core's path adds
    each weight's gradient into its main_grad, where autograd's leaves it in .grad, its hooks leaving .grad None."""
    torch.manual_seed(2)
    shape = probe.MoeShape(hidden=8, ffn=4, experts=4, top_k=2, tokens=6)
    splits = [5, 7]
    x = torch.randn(sum(splits), shape.hidden, dtype=torch.float64)
    grad_out = torch.randn(sum(splits), shape.hidden, dtype=torch.float64)
    fc1, fc2 = probe.expert_weights(shape, 2, torch.device("cpu"), torch.float64)
    weights = [*fc1, *fc2]
    expected = []
    for rows, up, down in zip(x.split(splits), fc1, fc2):
        gate, lin = (rows @ up.t()).chunk(2, dim=-1)
        expected.append((torch.nn.functional.silu(gate) * lin) @ down.t())
    grads = torch.autograd.grad(torch.cat(expected), weights, grad_out)

    out = probe.routed_experts(x, splits, fc1, fc2, probe.WEIGHT_PATHS["autograd"])
    assert torch.allclose(out, torch.cat(expected))
    out.backward(grad_out)
    assert all(torch.allclose(w.grad, g) for w, g in zip(weights, grads))
    assert all(not w.main_grad.any() for w in weights)

    for w in weights:
        w.grad = None
    kept = probe.ddp_post_hooks(weights)
    assert len(kept) == len(weights)
    probe.routed_experts(x, splits, fc1, fc2, probe.WEIGHT_PATHS["megatron"]).backward(grad_out)
    assert all(w.grad is None and w.grad_added_to_main_grad for w in weights)
    assert all(torch.allclose(w.main_grad, g) for w, g in zip(weights, grads))


def test_the_moe_layer_is_each_tokens_experts_weighted_by_their_renormalised_probabilities(probe):
    torch.manual_seed(1)
    shape = probe.MoeShape(hidden=16, ffn=8, experts=8, top_k=2, tokens=12)
    layer = probe.MoeLayer(shape, local_experts=4, device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(shape.tokens, shape.hidden)
    out = layer.combine(layer.route(x))

    probabilities, chosen = (x @ layer.router.t()).softmax(dim=-1).topk(shape.top_k, dim=-1)
    probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
    expected = torch.zeros_like(x)
    for token in range(shape.tokens):
        for p, expert in zip(probabilities[token], chosen[token] % 4):
            gate, up = (layer.fc1[expert] @ x[token]).chunk(2)
            expected[token] += p * (layer.fc2[expert] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _attention(q, k, v, causal):
    """Attention and its log-sum-exp by the definition, sbhd, grouped keys repeated to every head."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(dim=-1), v), scores.logsumexp(dim=-1)


CHUNK = 8  # tokens: a sequence of four chunks, rank r holding chunks r and 3 - r


def held(tensor, rank):
    """A rank's two chunks of a whole sequence's sbhd tensor: [2, chunk, ...]."""
    chunks = tensor.view(4, CHUNK, *tensor.shape[1:])
    return torch.stack((chunks[rank], chunks[3 - rank]))


def kv_of(k, v, rank):
    """The key-value buffer a rank's ring sends: [2, chunk, b, k or v, kv heads, dim]."""
    return torch.cat((held(k, rank).unsqueeze(-3), held(v, rank).unsqueeze(-3)), dim=-3)


def held_lse(lse, rank):
    """A rank's rows of a whole sequence's log-sum-exp ([b, h, tokens])."""
    chunks = lse.view(*lse.shape[:-1], 4, CHUNK)
    return torch.cat((chunks[..., rank, :], chunks[..., 3 - rank, :]), dim=-1)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_c2_rings_steps_and_passes_rebuild_the_ranks_rows_of_causal_attention(probe, rank):
    """Rank r holds chunks r and 3 - r of four; its two steps' blocks, joined by TE's corrections, are the whole
    sequence's causal attention at its rows."""
    torch.manual_seed(2)
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(4 * CHUNK, 1, heads, dim)
    k, v = (torch.randn(4 * CHUNK, 1, kv_heads, dim) for _ in range(2))
    blocks = [probe.rank_blocks(rank, probe.RankInputs(held(q, rank), kv_of(k, v, rank)), 0),
              probe.rank_blocks(rank, probe.RankInputs(held(q, rank), kv_of(k, v, 1 - rank)), 1)]
    outs, lses = zip(*(_attention(*block) for block in blocks))
    joined = probe.forward_passes(rank, held(q, rank), list(outs), list(lses), probe.lse_correction,
                                  probe.out_correction)
    whole, _ = _attention(q, k, v, causal=True)
    torch.testing.assert_close(joined, held(whole, rank), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probe.attend(*blocks[0]), outs[0], rtol=1e-5, atol=1e-5)  # SDPA as the definition


def _block_grads(q, k, v, causal, out, dout, lse):
    """A block's gradients as FlashAttention's backward computes them inside TE's ring: from the whole rows' output
    and log-sum-exp, so that the steps' gradients sum to the whole attention's."""
    group = q.shape[2] // k.shape[2]
    k_all, v_all = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k_all) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(scores - lse[..., None])
    dp = torch.einsum("qbhd,kbhd->bhqk", dout, v_all)
    ds = p * (dp - (dout * out).sum(dim=-1).permute(1, 2, 0)[..., None])

    def per_kv_head(grad):
        return grad.view(*grad.shape[:2], k.shape[2], group, grad.shape[-1]).sum(dim=3)

    return (torch.einsum("bhqk,kbhd->qbhd", ds, k_all) * scale,
            per_kv_head(torch.einsum("bhqk,qbhd->kbhd", ds, q) * scale),
            per_kv_head(torch.einsum("bhqk,qbhd->kbhd", p, dout)))


def test_the_c2_rings_backward_joins_give_each_rank_the_whole_attentions_gradients(probe):
    """Both ranks' backward, the off-diagonal step first: each writes its step-0 key and value gradients into the
    sum it sends, joins its causal step into the one it receives, and ends with its own keys' gradients; its
    query gradients are its rows of the whole sequence's."""
    torch.manual_seed(3)
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(4 * CHUNK, 1, heads, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(4 * CHUNK, 1, kv_heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    whole, lse = _attention(q, k, v, causal=True)
    dout = torch.randn_like(whole)
    whole.backward(dout)
    steps, dqs, sums = {}, {}, {}
    with torch.no_grad():
        for rank in (0, 1):
            own = probe.RankInputs(held(q, rank), kv_of(k, v, rank))
            out, grad_out = held(whole, rank).flatten(0, 1), held(dout, rank).flatten(0, 1)
            rows_lse = held_lse(lse, rank)
            blocks = [probe.rank_blocks(rank, probe.RankInputs(own.q, kv_of(k, v, 1 - rank)), 1),
                      probe.rank_blocks(rank, own, 0)]  # the backward's order: the forward's step 1, then 0
            steps[rank] = [_block_grads(*block, out[-block[0].shape[0]:], grad_out[-block[0].shape[0]:],
                                        rows_lse[..., -block[0].shape[0]:]) for block in blocks]
            dqs[rank], sums[rank] = torch.empty_like(own.q), probe.gradient_sum(own.kv)
            probe.backward_join(rank, 0, dqs[rank], sums[rank], steps[rank][0])
        for rank in (0, 1):
            probe.backward_join(rank, 1, dqs[rank], sums[1 - rank], steps[rank][1])
    for rank in (0, 1):
        torch.testing.assert_close(dqs[rank], held(q.grad, rank))
        torch.testing.assert_close(sums[1 - rank][0], held(k.grad, rank))
        torch.testing.assert_close(sums[1 - rank][1], held(v.grad, rank))


def test_device_busy_time_is_the_union_of_its_activities(probe):
    assert probe._busy_ms([(20.0, 25.0), (0.0, 10.0), (5.0, 15.0), (12.0, 14.0)]) == pytest.approx(0.020)


def _event(name, parent=None, kernels=(), device=torch.autograd.DeviceType.CPU, us=0.0):
    """A stand-in for one of torch.profiler's FunctionEvents: its name, parent, kernels and device."""
    return SimpleNamespace(name=name, cpu_parent=parent, kernels=list(kernels), device_type=device,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def _kernel(name, us):
    """A stand-in for the profiler's record of a kernel an op launched (torch.autograd.profiler_util.Kernel)."""
    return SimpleNamespace(name=name, duration=us)


def test_each_kernel_is_named_by_the_op_that_launched_it_and_who_asked_for_that(probe):
    """A kernel counts under its innermost aten op, asked for by the autograd node above it (a backward) or the
    top-level op, once though the profiler links it to its buffer request too; kernels the profiler linked to no op
    keep their time in rows with none, so the rows sum to all."""
    node = _event("autograd::engine::evaluate_function: IndexSelectBackward0")
    backward = _event("aten::index_select_backward", _event("IndexSelectBackward0", node))
    fill = _event("aten::fill_", _event("aten::zero_", _event("aten::new_zeros", backward)),
                  [_kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >", 3.0)])
    add = _event("aten::index_add_", backward, [_kernel("void at::native::indexFuncLargeIndex<float>(int)", 40.0)])
    matmul = _event("aten::matmul")
    mm = _event("aten::mm", matmul, [_kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 100.0)])
    buffer = _event(probe.BUFFER_REQUEST, matmul, mm.kernels)  # the same GEMM linked a second time
    on_device = [_event(name, device=torch.autograd.DeviceType.CUDA, us=us)
                 for name, us in (("fill", 3.0), ("index", 40.0), ("gemm", 100.0), ("unlinked", 7.0))]
    launched = probe.launches([node, backward, fill, add, matmul, mm, buffer, *on_device], on_device)
    assert [(launch.op, launch.caller, launch.device_us) for launch in launched] == [
        ("aten::fill_", "IndexSelectBackward0", 3.0), ("aten::index_add_", "IndexSelectBackward0", 40.0),
        ("aten::mm", "aten::matmul", 100.0), (None, None, 7.0)]
    kernels = probe.by_kernel(launched, top=2)
    assert [(row["short"], row["count"], row["device_us"]) for row in kernels["by_kernel"]] == [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 1, 100.0), ("indexFuncLargeIndex", 1, 40.0),
        ("(2 more)", 2, 10.0)]
    assert kernels["by_op"] == {"aten::mm": {"count": 1, "device_us": 100.0},
                                "aten::index_add_": {"count": 1, "device_us": 40.0},
                                "None": {"count": 1, "device_us": 7.0},
                                "aten::fill_": {"count": 1, "device_us": 3.0}}


@pytest.mark.parametrize("name,short", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, std::array<char*, "
     "1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)", "elementwise Fill"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
     "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::"
     "TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::"
     "binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, ...)", "elementwise Mul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}"
     "::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)", "elementwise silu"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native"
     "::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, "
     "float, 4, 4> >(at::native::ReduceOp<...>)", "reduce sum"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 2, 128, 1>(...)", "CatArrayBatchedCopy"),
    ("Memcpy DtoH (Device -> Pageable)", "Memcpy DtoH (Device -> Pageable)"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "nvjet_tst_64x8_64x16_4x1_v_bz_TNN"),
])
def test_a_kernels_printed_name_is_its_function_and_what_an_elementwise_one_applies(probe, name, short):
    assert probe.short_kernel(name) == short


def test_the_device_session_script_parses_and_runs_the_two_benchmarks_there_are(capsys):
    """benchmarks/gpu_session.sh is the one call a GPU session makes (docs/benchmarks.md): bash reads it, and the
    scripts it runs exist with the flags it gives them (each script's --help from its main in this process, its
    folder on the path as a script's is: two fresh interpreters cost 2.2 CPU s more)."""
    script = REPO / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for name, flags in (("gpu_check", ["--out"]), ("gpu_probe", ["--out"])):
        assert f"benchmarks/{name}.py" in text
        with script_module(name) as benchmark, pytest.raises(SystemExit) as exited:
            benchmark.main(["--help"])
        usage = capsys.readouterr().out
        assert exited.value.code == 0 and all(flag in usage for flag in flags), usage


def test_the_checks_optional_step_that_fails_is_kept_and_a_required_one_stops_it(tmp_path):
    """benchmarks/gpu_check.py's estimates are optional: one that fails (on the H200 day9-masters check, the fitted
    curve's, exit 2) is kept under its log's name with why, and the check goes on to print the rest; any other
    step's failure stops it."""
    failed = {}
    refused = ("estimate", "--gpu", "no-such-part", "--model", "gpt", "--layers", "1", "--width", "64", "--heads",
               "2", "--seq-len", "16", "--vocab", "32", "-b", "1", "--out", str(tmp_path / "estimate.json"))
    with script_module("gpu_check") as check:
        assert check.pipesim(*refused, log=tmp_path / "estimate-fitted.log", failed=failed) is None
        assert list(failed) == ["estimate-fitted"]
        assert failed["estimate-fitted"].startswith(f"pipesim estimate failed (exit 2); see {tmp_path}")
        assert "--gpu" in failed["estimate-fitted"] and "no-such-part" in failed["estimate-fitted"]
        with pytest.raises(SystemExit, match=r"pipesim estimate failed \(exit 2\)"):
            check.pipesim(*refused, log=tmp_path / "required.log")
    assert (tmp_path / "estimate-fitted.log").read_text().startswith("$ pipesim estimate --gpu no-such-part")


def test_the_check_refuses_an_unknown_part_before_it_runs_anything(tmp_path, monkeypatch, capsys):
    """A --gpu the catalogue lacks would fail the check's estimates only after its calibration and runs had spent the
    GPU's time: it is refused first, in one line (exit 2), nothing written."""
    out = tmp_path / "check"
    with script_module("gpu_check") as check:
        monkeypatch.setattr("sys.argv", ["gpu_check.py", "--device", "cpu", "--gpu", "h300", "--out", str(out)])
        with pytest.raises(SystemExit) as exited:
            check.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: --gpu: unknown GPU 'h300' (did you mean ")
    assert err.count("\n") == 1 and not out.exists()


@pytest.mark.slow
def test_the_checks_cpu_dry_run_runs_every_step(tmp_path, monkeypatch, capsys):
    """`gpu_check.py --device cpu --quick --gpu PART` is the dry run of what a GPU session runs first: every step
    runs, the estimates' "as run" figures included, where the CPU run refused the part's estimate as another
    device's (TraceError). --quick is its smallest shape; it still runs 9 pipesim commands (a calibration, two
    2-rank torch runs, each estimate simulated once for both methods) and times the passes. The script runs each
    as `python -m pipesim.cli ARGS`; here each runs in this process, its exit code and output handed back as the
    process's: the steps and what the script makes of them are what this checks, not each command's own process
    start, torch import and rank server (52 s against 110 s at load 6; test_faults.py and test_run.py start
    `python -m pipesim.cli run`). The calibration measures its links up to 1 MiB, not 64 (about a third of its
    time): the script reads the profile's links as it reads any (`as_run_ms`), whatever sizes they were measured at."""
    def pipesim_in_process(argv: list[str], **_: object) -> subprocess.CompletedProcess:
        assert argv[:3] == [sys.executable, "-m", "pipesim.cli"], argv
        code, out, err = pipesim(*argv[3:], *(["--link-max-mb", "1"] if argv[3] == "calibrate" else []))
        return subprocess.CompletedProcess(argv, code or 0, out, err)

    out = tmp_path / "check"
    with script_module("gpu_check") as check:
        monkeypatch.setattr(check, "subprocess", SimpleNamespace(run=pipesim_in_process))
        check.main(["--device", "cpu", "--quick", "--gpu", "h100-sxm", "--out", str(out)])  # a failed step: SystemExit
    printed = capsys.readouterr().out
    written = json.loads((out / "check.json").read_text())
    assert written["failed"] == {} and set(written["steps"]) == {"1f1b", "zb-h1"}
    for found in written["steps"].values():
        assert all(found[f"estimated_{source}_{way}"] > 0 for source in ("catalogue", "fitted")
                   for way in ("ms", "as_run_ms"))
    assert "zb-h1 per mini-batch: estimated (catalogue curve)" in printed


@pytest.mark.parametrize("args, refusal", [
    ([], "the following arguments are required: --out"),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from "),  # quoted or not by version
    (["--device", "cpu", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--device", "cpu", "--again", "1f1"], "argument --again: invalid choice: '1f1'"),
    (["--device", "cpu", "--quick", "--bogus"], "unrecognized arguments: --bogus"),
    (["--device", "cpu", "--out", "FILE"], "--out FILE: cannot make a folder there (File exists); give a folder"),
    pytest.param(["--device", "cuda"], "--device cuda: torch sees no CUDA GPU here; --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")),
])
def test_the_check_refuses_a_bad_flag_in_one_line_before_it_runs_anything(tmp_path, monkeypatch, capsys, args,
                                                                            refusal):
    """Each of gpu_check.py's flags: a bad value is one line naming the flag and what it allows, exit 2, nothing
    written, as pipesim's own refusals read ("error: ..."; argparse's usage block left out:
    benchmarks/one_line_parser.py)."""
    out, file = tmp_path / "check", tmp_path / "file"
    file.write_text("")
    given = [str(file) if arg == "FILE" else arg for arg in args]
    if args and "--out" not in args:
        given += ["--out", str(out)]
    with script_module("gpu_check") as check:
        monkeypatch.setattr("sys.argv", ["gpu_check.py", *given])
        with pytest.raises(SystemExit) as exited:
            check.main()
    err = capsys.readouterr().err
    assert (exited.value.code, err.count("\n")) == (2, 1), err
    assert err.startswith("error: " + refusal.replace("FILE", str(file))) and not out.exists()


def test_a_copy_launched_inside_the_products_meets_what_is_left_of_the_one_running(probe):
    """Part (g)'s wait under the persistent rule: the rest of the product running at the launch, none after them."""
    ends = [1.0, 2.0, 3.0]
    assert [probe.pair_running_left_ms(ready, ends) for ready in (0.25, 1.5, 2.0, 3.5)] == [0.75, 0.5, 1.0, 0.0]


def test_the_copy_on_a_collectives_ctas_copies_every_element_whatever_its_ctas(monkeypatch):
    """benchmarks/sm_copy.py, part (g)'s stand-in for a collective's kernel, in Triton's interpreter on a CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    with script_module("sm_copy") as sm_copy:
        for elements, ctas in ((100_000, 3), (8192 * 5, 2), (17, 4)):
            source = torch.randn(elements, dtype=torch.bfloat16)
            target = torch.zeros_like(source)
            sm_copy.copy_on_ctas(source, target, ctas)
            assert torch.equal(source, target)


def test_the_pairs_figures_are_each_copys_end_what_it_met_and_its_run_over_its_own(probe):
    """Part (g)'s derived figures on made-up samples: a copy of 0.1 ms alone (0.15 from an idle device, the host's
    launch 0.05), launched by the host and ending 0.45 ms after its mark, having met 0.1 ms of a product, ends 0.4
    after its launch and ran 3 times its own time past that product; one queued at a product's end meets all of the
    next and, ending 0.4 after, ran 2 times its own."""
    def timing(ms):
        return probe.Timing.of([ms])

    timings = {"alone_copy_ms": timing(0.1), "alone_copy_unheld_ms": timing(0.15), "alone_products_ms": timing(8.0),
               "copy_first_copy_ms": timing(0.12), "copy_first_products_ms": timing(8.05)}
    row = {"running_left_ms": 0.1, "next_ends_ms": [0.1, 0.3, 0.5], "products_ms": 8.1}
    host = probe.pair_derived(timings, [{**row, "copy_ms": 0.45}], "host")
    assert host["inside_copy_ends_ms"] == pytest.approx(0.4) and host["inside_run_over_own"] == pytest.approx(3.0)
    assert host["inside_products_over_alone_ms"] == pytest.approx(0.1)
    boundary = probe.pair_derived(timings, [{**row, "running_left_ms": 0.2, "copy_ms": 0.4}], "boundary")
    assert boundary["inside_copy_ends_ms"] == pytest.approx(0.4) and boundary["inside_run_over_own"] == pytest.approx(2)
    assert boundary["copy_first_products_over_alone_ms"] == pytest.approx(0.05)


def test_the_committed_h200_pair_run_gives_the_figures_docs_hardware_quotes(probe):
    """traces/measured/gpu-probe-h200-pair.json (an H200, session 40), derived again from its samples: the copy
    queued at a product's end runs 1.8 to 3.5 times its own time past the product it met, median 2.7 over the 8
    shapes (the host's launches, less sure, 1.5 to 4.0), and the 4096^3 one ends 0.470 ms after, having met 0.171 of
    the next product (docs/hardware.md, *Measured here*)."""
    record = json.loads((REPO / "traces" / "measured" / "gpu-probe-h200-pair.json").read_text())
    over = [(derived["boundary"]["inside_run_over_own"], derived["host"]["inside_run_over_own"])
            for _, derived in _pair_derived_again(probe, record)]
    queued, launched = (sorted(column) for column in zip(*over))
    assert len(queued) == 8 and 1.8 < queued[0] and queued[-1] < 3.52 and 1.5 < launched[0] and launched[-1] < 4.1
    assert round(queued[3] / 2 + queued[4] / 2, 1) == 2.7
    first = record["pair"]["runs"][0]
    assert first["shape"]["name"] == "4096^3, 24 CTAs"
    assert round(first["derived"]["boundary"]["inside_copy_ends_ms"], 3) == 0.470
    assert round(first["derived"]["boundary"]["inside_running_left_ms"], 3) == 0.171


def test_the_h200_pair_run_again_repeats_the_queued_figures(probe):
    """traces/measured/gpu-probe-h200-pair-again.json (the same part on a fresh H200, session 41), derived again
    from its samples: the queued copies 1.89 to 3.54 times their own, median 2.90, each shape within 0.43 of the
    first run's and six of the eight within 0.09; the host's launches 1.57 to 3.72, median 3.04 (docs/hardware.md,
    *Measured here*)."""
    runs = {}
    for name in ("gpu-probe-h200-pair.json", "gpu-probe-h200-pair-again.json"):
        record = json.loads((REPO / "traces" / "measured" / name).read_text())
        for shape, derived in _pair_derived_again(probe, record):
            runs.setdefault(shape, []).append(derived)
    assert len(runs) == 8 and all(len(pair) == 2 for pair in runs.values())
    queued = sorted(again["boundary"]["inside_run_over_own"] for _, again in runs.values())
    launched = sorted(again["host"]["inside_run_over_own"] for _, again in runs.values())
    assert (round(queued[0], 2), round(queued[-1], 2), round(queued[3] / 2 + queued[4] / 2, 2)) == (1.89, 3.54, 2.90)
    assert (round(launched[0], 2), round(launched[-1], 2), round(launched[3] / 2 + launched[4] / 2, 2)) == (
        1.57, 3.72, 3.04)
    apart = sorted(abs(first["boundary"]["inside_run_over_own"] - again["boundary"]["inside_run_over_own"])
                   for first, again in runs.values())
    assert apart[-1] < 0.43 and apart[5] < 0.09 < apart[6]


def test_the_h200_link_runs_give_the_figures_docs_hardware_quotes(probe):
    """traces/measured/gpu-probe-h200-link.json, -link-again.json and -link-first.json (part (h), session 42: the copy
    into pinned host memory, across PCIe), derived again from their samples: about 52 GB/s alone; queued at a
    product's end it ends -0.15 to 0.79 of its own time past the product it met, each shape's three runs within
    0.07, where part (g)'s copy through HBM ran 1.8 to 3.5 times it; issued before the next product it runs as
    issued after (within 0.02); the products lose 0.63 to 1.53 of its time, 0.46 to 0.83 where it is issued first
    and then runs 0.5 to 2.3 % over its own (docs/hardware.md, *Measured here, session 42*). The same from the
    launches whose products the host had all issued before the device reached them (`hold_outlasted_issue`): one
    shape's figures move, by 0.018 ms at most."""
    runs: dict[str, list[tuple[dict, float]]] = {}
    held_runs: dict[str, list[tuple[dict, float]]] = {}
    for name in ("link", "link-again", "link-first"):
        record = json.loads((REPO / "traces" / "measured" / f"gpu-probe-h200-{name}.json").read_text())
        for (shape, derived), run in zip(_pair_derived_again(probe, record, "link"), record["link"]["runs"]):
            assert run["shape"]["target"] == "host"
            own_ms = run["timings"]["alone_copy_ms"]["median_ms"]
            runs.setdefault(shape, []).append((derived, own_ms))
            held = probe.pair_derived_by_launch({key: probe.Timing(**value) for key, value in run["timings"].items()},
                                                [row for row in run["inside"] if row["hold_outlasted_issue"]])
            held_runs.setdefault(shape, []).append((held, own_ms))
    moved = {(shape, launch, key): abs(figures[key] - held[launch][key])
             for shape in runs for (derived, _), (held, _) in zip(runs[shape], held_runs[shape])
             for launch, figures in derived.items() for key in figures if figures[key] != held[launch][key]}
    assert {shape for shape, _, _ in moved} == {"30B fc2 at 16 local experts, 24 CTAs"}
    assert round(max(moved.values()), 3) == 0.018  # the products' loss at its ends, 0.4229 -> 0.4044 ms
    for found in (runs, held_runs):
        _check_the_link_figures(found)


def _check_the_link_figures(runs: dict[str, list[tuple[dict, float]]]) -> None:
    """The figures docs/hardware.md quotes of part (h)'s three runs: `runs` holds each shape's derived figures and
    the copy's own ms, a run each."""
    assert len(runs) == 8 and all(len(three) == 3 for three in runs.values())
    copies = [(derived, own) for three in runs.values() for derived, own in three]
    rates = [16 * 2**20 / own / 1e6 for shape, three in runs.items() if "4x" not in shape for _, own in three]
    assert 51 < min(rates) and max(rates) < 53  # GB/s

    def spread(launch: str, key: str, per_own: bool = False, digits: int = 2) -> tuple[float, float]:
        values = [derived[launch][key] / (own if per_own else 1) for derived, own in copies if launch in derived]
        return round(min(values), digits), round(max(values), digits)

    assert spread("boundary", "inside_run_over_own") == (-0.15, 0.79)
    assert max(max(d["boundary"]["inside_run_over_own"] for d, _ in three)
               - min(d["boundary"]["inside_run_over_own"] for d, _ in three) for three in runs.values()) < 0.07
    assert spread("boundary", "inside_products_over_alone_ms", per_own=True) == (0.63, 1.53)
    # the copy issued first is timed once a run: each launch's figures carry the same
    assert spread("host", "copy_first_products_over_alone_ms", per_own=True) == (0.46, 0.83)
    assert spread("host", "copy_first_copy_over_alone_ms", per_own=True, digits=3) == (0.005, 0.023)
    first = [(d["boundary-first"], d["boundary"]) for d, _ in copies if "boundary-first" in d]
    assert len(first) == 8
    assert max(abs(issued_first["inside_run_over_own"] - after["inside_run_over_own"])
               for issued_first, after in first) < 0.021
    assert max(abs(issued_first["inside_products_over_alone_ms"] - after["inside_products_over_alone_ms"]) / own
               for (issued_first, after), own in zip(first, [own for d, own in copies if "boundary-first" in d])) < 0.04


def _pair_derived_again(probe, record: dict, part: str = "pair") -> list[tuple[str, dict]]:
    """Per run of a committed part (g) or (h) record, its shape's name and its figures derived again from its
    samples, which must be the ones it recorded."""
    found = []
    for run in record[part]["runs"]:
        derived = probe.pair_derived_by_launch({key: probe.Timing(**value) for key, value in run["timings"].items()},
                                               run["inside"])
        assert derived == run["derived"]
        found.append((run["shape"]["name"], derived))
    return found
