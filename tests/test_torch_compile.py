"""--torch-compile: what AOTAutograd's min-cut partitioner saves of a block compiled inside torch's checkpoint, as
torchtitan compiles its Llama blocks (planning/estimate.py `_unread_kept`), held against torch itself: a small
Llama block compiled on the CPU under torchtitan's op policy saves the products' outputs pipesim keeps for it."""

from __future__ import annotations

import json
import operator
from collections import defaultdict

import pytest

from tests.conftest import compiling_checkpointed_hf, needs_transformers, pipesim, simulate_json

torch = pytest.importorskip("torch")
pytestmark = needs_transformers

LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                    "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                    "attention_bias": False, "mlp_bias": False})
SEQ, BATCH = 32, 2
# torchtitan's save list for its op policy (parallelize_llama.py at 9dec370, `_save_list`), with the CPU's flash
# attention beside CUDA's, so that the block compiles and runs here
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _op_policy_context():
    """torchtitan's `_get_custom_policy`: every op of the save list kept but each second aten.mm, the rest rerun."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        kept = func in SAVED_OPS and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@pytest.fixture
def llama(tmp_path):
    (tmp_path / "config.json").write_text(LLAMA)
    return f"hf:{tmp_path}"


def _rng_state(node) -> bool:
    """Whether a saved node is the generator's state the compiled forward keeps to replay a kernel it takes as random
    (the CPU's flash attention, run by `run_and_save_rng_state`): the CPU generator's 5,056 bytes whatever the
    shapes, a CUDA kernel's seed and offset on a GPU."""
    return node.target is operator.getitem and getattr(node.args[0], "target", None) is \
        torch.ops.higher_order.run_and_save_rng_state


def _compiled_saves(llama: str, context_fn=None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each tensor the compiled forward of `llama`'s first decoder layer, checkpointed (with
    `context_fn`'s policy, else plain), saves for its backward but its weights and buffers (the rotary module's
    frequencies), as AOTAutograd's default training partitioner chooses them."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import checkpoint

    from pipesim.workload.hf import hf_model

    block = hf_model(llama, SEQ).layers[1].float()
    weights = {tuple(t.shape) for t in (*block.parameters(), *block.buffers())}  # none a (B, S, h) activation
    saved: list[tuple[str, tuple[int, ...]]] = []

    def forward_graph(graph, _):
        outputs = next(node for node in graph.graph.nodes if node.op == "output").args[0]
        saved.extend((node.name, tuple(node.meta["val"].shape)) for node in outputs[1:]
                     if isinstance(node.meta.get("val"), torch.Tensor) and not _rng_state(node)
                     and not (node.op == "placeholder" and tuple(node.meta["val"].shape) in weights))
        return graph.forward

    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda graph, _: graph.forward,
                           partition_fn=min_cut_rematerialization_partition)
    options = {"context_fn": context_fn} if context_fn else {}
    compiled = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False, preserve_rng_state=False,
                                                  **options),  # as torchtitan's ptd_checkpoint_wrapper runs it
                             backend=backend, fullgraph=True, dynamic=False)
    with compiling_checkpointed_hf():
        compiled(torch.randn(BATCH, SEQ, 64, requires_grad=True)).sum().backward()
    return saved


def test_a_compiled_llama_block_saves_the_products_pipesim_keeps_under_torch_compile(llama):
    """AOTAutograd's default training partitioner, as Inductor runs it, on one decoder layer checkpointed under the
    op policy: of the four products the policy keeps (q, v, the gate and the down projection), the compiled forward
    saves three, not the down projection's output, which only the residual add reads; pipesim's count drops
    exactly that one under --torch-compile, and keeps all four without it, as eager checkpointing does."""
    from pipesim.planning.estimate import _op_kept, _unread_kept
    from pipesim.workload.count import count_built

    saved = [shape for name, shape in _compiled_saves(llama, _op_policy_context) if name.startswith("mm")]
    layer = count_built(llama, {"seq_len": SEQ}, BATCH, torch.bfloat16, "flash", swiglu_fusion=False).layers[1]
    made = {number: (shape, op) for number, shape, nbytes, op in layer.allocations["fwd"] if nbytes >= 0}
    products = {number for number, (_, op) in made.items() if op == "mm"}
    kept = _op_kept(layer) & products
    assert sorted(made[n][0] for n in kept) == [(64, 64), (64, 64), (64, 128), (64, 160)]  # v, down, q, gate
    assert sorted(made[n][0] for n in kept - _unread_kept(layer)) == sorted(saved) == [(64, 64), (64, 128),
                                                                                        (64, 160)]


def test_a_compiled_llama_block_under_full_checkpointing_saves_its_input_alone(llama):
    """A plain checkpoint around the compiled layer (torchtitan's full recomputation): the forward saves the layer's
    input and nothing it made, as pipesim keeps it with or without --torch-compile."""
    assert [shape for _, shape in _compiled_saves(llama)] == [(BATCH, SEQ, 64)]


def _activations_mib(llama: str, *flags: str) -> float:
    result = simulate_json("--model", llama, "--seq-len", str(SEQ), "-b", str(BATCH), "--dtype", "bf16",
                           "--attention", "flash", "--gpu", "h100-sxm", "-p", "1", "-m", "1", "-s", "gpipe",
                           "--no-swiglu-fusion", "--allocator", "none", *flags)[0]
    return result["devices"][0]["peak_memory_parts_mb"]["activations"]


def test_torch_compile_drops_each_blocks_last_product_under_op_and_nothing_under_full(llama):
    """Under op each of the 2 layers keeps BATCH x SEQ x 64 bf16 of the down projection's output less; full keeps
    each layer's input alone, compiled or not."""
    eager = _activations_mib(llama, "--recompute", "op")
    assert eager - _activations_mib(llama, "--recompute", "op", "--torch-compile") == pytest.approx(
        2 * BATCH * SEQ * 64 * 2 / 2**20)
    assert _activations_mib(llama, "--recompute", "full", "--torch-compile") == _activations_mib(
        llama, "--recompute", "full")


@pytest.mark.parametrize("recompute", [(), ("--recompute", "selective")])
def test_torch_compile_without_a_checkpoint_is_refused_in_one_line(llama, tmp_path, recompute):
    code, out, err = pipesim("simulate", "--model", llama, "--seq-len", str(SEQ), "--gpu", "h100-sxm", "-p", "1",
                             "-m", "1", "-s", "gpipe", "--torch-compile", *recompute, "--html",
                             str(tmp_path / "t.html"))
    assert code == 2 and err.strip().count("\n") == 0 and "Traceback" not in err
    assert "--torch-compile" in err and "--recompute op or full" in err
    assert not (tmp_path / "t.html").exists()
