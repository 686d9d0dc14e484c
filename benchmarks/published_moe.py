"""NVIDIA's published MoE pre-training throughput on H100 (benchmarks/published/: Megatron-Bridge's performance
summaries, the Megatron MoE Model Zoo's Qwen3-235B-A22B table, DGX Cloud's recipes, Megatron-Bridge's skill and model
card runs, NeMo AutoModel's table) predicted by a pipesim command line each, nothing fitted.

Megatron-Bridge's rows (nemo-megatron-bridge-moe-h100.csv; Qwen3-30B-A3B, gpt-oss-120b and DeepSeek-V3 among them)
first.

Each expressible row's `pipesim simulate` command is built from the row's own columns and the model's Hugging Face
config in examples/, as Megatron-Bridge's H100 recipes run it: TransformerEngine's float8 products (`--dtype fp8`)
with the row's scaling (`FP8_RECIPES`), cuDNN's fused attention (`ATTENTION_KERNEL`), no recomputation (the
Qwen3 recipes set none; gpt-oss's and DeepSeek-V3's modules: `RECOMPUTE_MODULES`), the distributed optimizer
(`--zero 1`) with 16-bit gradients (`--precision megatron-16bit-grads`: every Qwen3 and gpt-oss recipe sets
grad_reduce_in_fp32 False, perf_recipes/_common.py's _perf_precision and _benchmark_common at 067f987df0,
scripts/performance/configs/qwen*/qwen3_llm_pretrain.py and gpt_oss/gpt_oss_llm_pretrain.py before, and
Megatron-core's gradient buffer takes the parameters' dtype then, param_and_grad_buffer.py
group_params_for_buffers), each backward's weight gradients
accumulated inside TransformerEngine's weight-gradient products (`--grad-accumulation fused`: Megatron-Bridge's GPT
provider sets gradient_accumulation_fusion wherever APEX's fused_weight_gradient_mlp_cuda is present,
utils/fusions.py can_enable_gradient_accumulation_fusion, which NeMo's containers ship) and the routed experts'
SwiGLU fused (`--swiglu-fusion`, the default: the recipes' bias_activation_fusion True), the loss Megatron-core's
cross entropy (`--cross-entropy megatron`: the GPT provider's cross_entropy_loss_fusion True; Megatron-core's function
turns the kept softmax into the gradient in place), every RMSNorm TransformerEngine's
(`--norm-kernel fused`: Megatron-core's TENorm and LayerNormLinear keep the 16-bit input and one float32 a token,
where transformers' eager module keeps a float32 copy too, and run one kernel each way), RoPE as TransformerEngine's
fused kernel (`--rope-kernel fused`: every release's performance script sets apply_rope_fusion True,
scripts/performance/run_script.py:178 at v0.1.0rc4 for 25.09, utils/helpers.py:107 at v0.2.1 for 25.11,
utils/overrides.py:64 at v0.3.1 and :82 at 067f987df0 with perf_recipes/_common.py's _benchmark_common for 26.x,
so Megatron-core rotates q and k with one kernel each way), each rank's routed experts' products one GEMM per
local expert with each expert's float8 casts on their own under current scaling (`--expert-gemm per-expert`:
every recipe sets moe_grouped_gemm, so Megatron-core runs TEGroupedMLP, TransformerEngine's GroupedLinear, which
issues a cuBLAS GEMM per expert and quantises each expert's split separately unless the scaling is delayed;
planning/experts.py `per_expert_products`), the ranks in Megatron-core's
order (`--rank-order megatron`: tp-cp-ep-dp-pp, megatron/core/parallel_state.py's default, which Megatron-Bridge
keeps unless `use_tp_pp_dp_mapping`, default False in its DistributedInitConfig), the routed experts over E ranks
folded over the t·d of a stage with the recipe's expert-tensor-parallel size (`EXPERT_TENSOR`), interleaved 1F1B
where the row has virtual stages, the layers cut into equal blocks where they divide into p·v stages (Megatron's
cut), else balanced, and the tokens dispatched as the layout's recipe did (`DISPATCHERS`), with Megatron-core's
expert-parallel overlap where the recipe sets moe_a2a_overlap (`--overlap-expert-comm`, `A2A_OVERLAP`). Routing is
random where the run forces balance, which the summary's footnote says its MoE runs do (`--routing random`:
Megatron-core draws each token's router logits from a normal distribution, moe_utils.py RandomSTE, so the shares are
even on average and the busiest rank is waited for), and balanced where the row drops tokens at capacity 1 (25.09's
"(tokendrop)", `TOKEN_DROP`: each expert padded to its even share, `--capacity-factor 1`, so its dispatcher never
synchronises with the host: planning/host.py, workload/hf.py). gpt-oss-120b's rows run in BF16 (`--dtype bf16`,
the recipes' `_perf_precision("bf16")`) with the parts its recipe recomputes (`RECOMPUTE_MODULES`). Nemotron 3
Nano's rows run its recipe (`NANO_RECIPE`): its Mamba-2 layers in CUDA graphs (`--cuda-graphs mamba`), each MoE
layer recomputed whole with its norms and experts' activation beside the core attention. The predicted
tokens/s per GPU is the global batch's tokens over the predicted step and the row's GPUs. A row pipesim cannot express
is listed with why; a row whose release's recipe ran another layout or micro-batch than the row prints runs that
(`RELEASE_LAYOUTS`, each with its source), listed too. Each command's fullest device's peak memory is printed with it:
the summaries publish no memory figure, but every row ran, so none should be marked out of memory.

25.09's DeepSeek-V3 row (t2 p8 v4 E64 on 1,024 GPUs) runs as Megatron-Bridge v0.1.0rc4's run_script.py ran its H100
recipe (scripts/performance/run_script.py lines 56-102 and 178; deepseek_v3_llm_pretrain.yaml, also at 7623546):
Megatron-core's layout "Et|(tt|)*30mL" (`--stage-cut layout:...`: the embedding and a block, 30 stages of two, then
the multi-token-prediction layer, `--mtp-layers 1`, deepseek_v3.py's mtp_num_layers, with the loss), DeepEP with
forced balance (enable_deepep on H100: the flex dispatcher), the expert overlap (A2A_1F1B:
overlap_moe_expert_parallel_comm, delay_wgrad_compute), MLA's up-projections and the 3 dense layers' MLPs
recomputed (recompute_modules ["mla_up_proj", "mlp"] under selective granularity; "mlp" reruns no MoELayer:
megatron/core/transformer/transformer_layer.py at core_v0.14.0), the gradients reduced after the backward
(overlap_grad_reduce False on H100: `--reduce-after-flush`) in 16 bits (grad_reduce_in_fp32 False), in FP8 with
delayed scaling as the other 25.09 rows (`FP8_RECIPES`). Not modelled (`RECIPE_NOT_MODELLED`): the precision-aware
optimizer's bfloat16 moments (deepseek_v3.py exp_avg_dtype, exp_avg_sq_dtype), held as float32 here (the same step,
a peak about 2.7 GB higher); fp8_param_gather (bf16_with_fp8_delayed_scaling_mixed), which pipesim does not model
beside expert parallelism.

The Megatron MoE Model Zoo's H100 table (benchmarks/published/megatron-moe-modelzoo-h100.csv: Qwen3-235B-A22B in
BF16 on 256 H100s, each row's step time with its whole layout) runs through the same command, as Megatron-LM's
pretrain_gpt.py ran it with the zoo's model config (model_configs/benchmarking/Qwen3-235B-A22B.yaml at b0b92ff):
bf16 with Megatron-LM's float32 gradients (`--precision megatron`: arguments.py sets
accumulate_allreduce_grads_in_fp32 under --bf16) added inside the weight-gradient products (Megatron-LM's default
gradient_accumulation_fusion, with the APEX kernel NGC's PyTorch containers ship), the row's recomputed modules
(`--recompute-modules`; "norm, act" is the H100 command's `--recompute-modules moe_act layernorm`), its dispatcher
(DeepEP's, or NCCL's all-to-all for "A2A"), Megatron-core's expert overlap on the "+1f1b overlap" row
(A2A_OVERLAP=1), cuDNN's fused attention (`ATTENTION_KERNEL`), and the layers cut with the embedding and the loss
counted as a layer each (the yaml's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split: Megatron-core's get_transformer_layer_offset,
megatron/core/transformer/transformer_layer.py, splits the 94 layers and those two evenly over the p·v chunks:
`MODELZOO_SPLIT_LAYERS`). Routing is forced balance (`--routing random`), as the
table's H100 command runs it (best_practice/Qwen3/run_235b.sh at b0b92ff); the other rows give no command of their
own and are run so too. A row's published tokens/s per GPU is its global batch's tokens over its step time and GPUs.

NVIDIA's DGX Cloud recipes' MoE rows on H100 (benchmarks/published/nvidia-dgxc-moe-h100.csv, dgxc-benchmarking at
1f6d9f4): DeepSeek-V3 in BF16 on 512 and 1,024 H100s runs as NeMo's
scripts/performance/llm/pretrain_deepseek_v3.py ran it at the NeMo commit its setup.sh checks out (7a8f1cc7bc):
the recipe's multi-token-prediction layer (`--mtp-layers 1`: deepseek_v3.py's pretrain_recipe, use_mtp True),
64 // p - 1 layers in the first stage and 64 // p - 2 in the last (`dgxc_first_last`), the launch's recomputed
`mla_up_proj` under selective recomputation, Megatron-core's all-to-all dispatcher with MegatronTokenDropCallback's
capacity 1 padded to capacity (`--capacity-factor 1`, balanced: USE_TOKEN_DROP), float32 gradient reduction
(bf16_mixed's and the recipe's DDP config's grad_reduce_in_fp32: `--precision megatron`), gradients accumulated
inside the products (DeepSeekConfig's gradient_accumulation_fusion), TransformerEngine's cross entropy and norms,
cuDNN's fused attention (`ATTENTION_KERNEL`), and RoPE unfused (DeepSeekConfig's apply_rope_fusion False:
`--rope-kernel eager`). Each flag read against the launch and the code it ran (launch.sh and setup.sh at 1f6d9f4;
NeMo's pretrain_deepseek_v3.py, utils.py set_primary_perf_configs and get_user_configs, recipes/deepseek.py trainer
and deepseek_v3.py pretrain_recipe, MegatronCommOverlapCallback, MegatronTokenDropCallback and PerfEnvPlugin at
7a8f1cc7bc; Megatron-core at 7094270c6f), each as the command runs it: t2 with sequence parallelism (sequence_parallel
= t > 1), p8 or p16 at VP 1 (the launch's VP=1: plain 1F1B), EP 64 at ETP 1 in Megatron-core's order (_strategy_lib.py:
tp-cp-ep-dp-pp without use_tp_pp_dp_mapping, so a stage's 64 ranks, 8 nodes, are its expert group), MBS 1 and GBS 8 a
GPU (128 and 256 micro-batches), the selective `mla_up_proj` (the csv's h100 row and the launch's RM; no
recompute_layers, no activation offload, no CUDA graphs, no FSDP), the MTP layer, the all-to-all dispatcher with
MegatronTokenDropCallback's capacity 1 padded, the router's product in float32 (moe_router_dtype 'fp32', as the count
runs DeepSeek-V3's router), gradients reduced in float32 and overlapped with the backward (the trainer's DDP config
and the callback's overlap_grad_reduce and overlap_param_gather where d > 1), the batched exchanges between stages
(the callback's batch_p2p_comm at VP 1: `--p2p-sync`), the distributed optimizer (Megatron-core's, adam.py
distributed_fused_adam_with_cosine_annealing's OptimizerConfig), NeMo 25.04.01's container. What it sets and pipesim
does not model is printed with the rows (`RECIPE_NOT_MODELLED`). v25.08.01's H100 row (1,024 GPUs at t1 p8 v2, NeMo
25.07.01) runs as its release ran it (`DGXC_RELEASE_RUNS`): over DeepEP with forced balance, dropless, its layout
and MTP layer, the MLA RoPE fused, gradients reduced in 16 bits, and whole MoE layers recomputed ("moe") beside
MLA's up-projections and the dense MLPs;
Llama 4 Maverick's rows run as NeMo's pretrain_llama4_e128.py ran them (`LLAMA4_RUN`): t4 with sequence
parallelism and userbuffers, E128 at expert t 4, VP 1 as launch.sh set it, the all-to-all dispatcher with the
token-drop callback's capacity 1 padded, the router's weights on the experts' input; the FP8 row in delayed
scaling with every transformer layer in CUDA graphs (`LLAMA4_FP8_RUN`, `--cuda-graphs full`).

Megatron-Bridge's measured runs outside its summaries (benchmarks/published/megatron-bridge-cards-moe-h100.csv: a
skill's and the model cards', each with its whole layout and step time) run as the summaries' rows in BF16:
Qwen3-30B-A3B at t1 p1 E16 over HybridEP, and DeepSeek-V3 on 1,024 H100s as 25.09's row's recipe runs it
(`RECIPE_RUNS`) over HybridEP without the expert overlap. The Qwen3 runs with the
overlap kept delay_wgrad_compute off, which pipesim's pair does not model, the cards' functional pretraining runs
(Qwen3-30B-A3B, gpt-oss-120b) routed naturally, by an imbalance not published, the all-to-all run gives no
layout, and Qwen3.6-35B-A3B's card trains its vision encoder too (`CARDS_VISION_LANGUAGE`): all listed with why
(`CARDS_NOT_EXPRESSIBLE`).

NeMo AutoModel's H100 pre-training table (benchmarks/published/nemo-automodel-moe-h100.csv: its PyTorch backend,
FSDP2 with expert parallelism, BF16) runs its Qwen3-30B-A3B row as qwen3_moe_30b_te_deepep.yaml at 8d9bfb90e, the
commit that published its 21.773 s, ran it with nemo_automodel/components/moe there: `--zero 2` (FSDP2 over the 8
ranks, each block's weights gathered once a step and kept: reshard_after_forward False, fsdp_mixin.py's
reshard_after_backward and requires_gradient_sync False until the last micro-batch; the yaml spells the switch
enable_fsdp_optimization, which BackendConfig would refuse, and the published step moved from 22.14 to 21.773 s
hours after 2c236e081 added these optimizations, so they are taken as on), `--precision nemo-bf16-adam`
(bfloat16 weights, torch Adam's moments in their dtype, no master copy), `--recompute full` (every block checkpointed,
activation_checkpointing), `--grad-accumulation separate` (autograd's adds), TransformerEngine's attention, linears
and RMSNorm, RoPE in torch ops (`--rope-kernel eager`), the experts' grouped_gemm (`--expert-gemm grouped`), DeepEP
with FakeBalancedGate's even spread (`--routing balanced`, no auxiliary loss) and torch's cross entropy in bfloat16
(`--cross-entropy torch`); what the commands price otherwise is printed with the rows (`AUTOMODEL_NOT_MODELLED`).
Its 256-GPU DeepSeek-V3 row runs so as deepseek_v3_te_deepep.yaml at 89e3a9fdd (the table's commit) ran it under
torch.distributed.pipelining: interleaved 1F1B over AutoPipeline's 32 stages (`autopipeline_stages`,
`autopipeline_layout`: layers_per_stage 2, the embedding with the first and the head with the last; no MTP layer in
AutoModel's model), `--pp-runtime torch`, and `--zero 3`, the pipeline stage keeping FSDP2's gathered weights to the
step's last backward, each of the table's gradient-accumulation steps a `schedule.step` of local_batch_size
micro-batches (`--rounds`: the DeepSeek-V3 row's 1, Kimi K2's 2). Its Kimi K2 row runs so too: kimi_k2_te_deepep.yaml
there is that config but for p 8, EP 32 and the model (moonshotai/Kimi-K2-Base, AutoModel's DeepseekV3ForCausalLM;
examples/kimi-k2). Its Nemotron V3 Nano row runs as nemotron_nano_v3_te_deepep.yaml at bb0c0bfb0, the commit that
published it, ran it (examples/nemotron-3-nano-30b-a3b): as the Qwen3 row but for its own model's kernels
(`AUTOMODEL_KERNELS`), torch's nn.Linear for the attention's and Mamba-2 mixers' projections and torch's scaled dot
product attention (nemotron_v3/layers.py). The 1,024-GPU row prints v 8 where its config cuts 16 stages (v 4), and the
rest are listed with why (`AUTOMODEL_NOT_EXPRESSIBLE`).

Every source's run built its layers from TransformerEngine's modules (`--linear-kernel te`, planning/te.py; in
BF16 it moves the rows whose attention's input projection has a bias, gpt-oss-120b's): Megatron-Bridge's
summaries and cards through its GPT provider's default_layer_spec, transformer_engine_layer_spec (gpt_provider.py at
v0.1.0rc4, v0.2.1 and 067f987df0), which the Qwen3 and gpt-oss providers keep and the DeepSeek ones replace by
get_gpt_decoder_block_spec with use_transformer_engine=HAVE_TE (deepseek_provider.py, deepseek_v3_bridge.py), the
26.x recipes setting transformer_impl "transformer_engine" too (recipes/gpt_oss/h100/gpt_oss.py,
recipes/qwen/h100/qwen3_moe.py, recipes/deepseek/h100/deepseek_v3.py at 067f987df0); the Model Zoo's runs by the
yaml's `--transformer-impl transformer_engine` (Qwen3-235B-A22B.yaml at b0b92ff; Megatron-LM's default, arguments.py
at 1e057005); DGX Cloud's by NeMo's DeepSeekConfig, get_gpt_decoder_block_spec with use_transformer_engine=HAVE_TE
(nemo/collections/llm/gpt/model/deepseek.py at 7a8f1cc7bc).

    python benchmarks/published_moe.py                 # the table, the rows left out, then each row's command
    python benchmarks/published_moe.py --json out.json # and the rows as JSON
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from one_line_parser import OneLineParser  # this folder's
from published_h100 import summary
from published_memory import fullest
from published_runs import _rows, command_text, megatron_schedule, p2p_sync, run_cli
from rich.console import Console
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_message, print_table
from pipesim.workload.sizes import ROUTER_AUX_LOSSES

SOURCE = "nemo-megatron-bridge-moe-h100.csv"  # benchmarks/published/README.md: its source and how to read it
MODELZOO = "megatron-moe-modelzoo-h100.csv"  # the Megatron MoE Model Zoo's H100 table, README.md there too
GPU = "h100-sxm"
EXAMPLES = "examples"  # the Hugging Face configs, relative to the repository root the commands run in


def config_blocks(root: Path, preset: str) -> int:
    """The transformer blocks of `preset`'s Hugging Face config, under `root`'s `EXAMPLES`."""
    return json.loads((root / EXAMPLES / preset / "config.json").read_text())["num_hidden_layers"]


PRESETS = {"Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b",  # the table's model: its examples/
           "GPT OSS 120B": "gpt-oss-120b", "DeepSeekV3": "deepseek-v3", "Nemotron_3_Nano": "nemotron-3-nano-30b-a3b"}
# the model -> --expert-tensor-parallel: Megatron-Bridge's scripts/performance/configs/qwen/
# qwen3_workload_base_configs.py (01b2977), BASE_QWEN3_235B_A22B_CONFIG and BASE_QWEN3_30B_A3B_CONFIG:
# expert_tensor_parallel_size=1, which every H100 preset of both keeps
# gpt-oss-120b's: BASE_GPT_OSS_120B_CONFIG's expert_tensor_parallel_size=1 (scripts/performance/configs/gpt_oss/
# workload_base_configs.py at v0.2.1, gpt_oss_workload_base_configs.py at v0.3.0 to v0.4.1), which the 26.x
# perf recipe keeps (perf_recipes/gpt_oss/h100/gpt_oss.py at 067f987df0 on recipes/gpt_oss/h100/gpt_oss.py's
# gpt_oss_120b_pretrain_64gpu_h100_bf16_config)
# DeepSeek-V3's: its H100 perf_matrix's etp 1 (deepseek_v3_llm_pretrain.yaml at v0.1.0rc4)
# Nemotron 3 Nano's: its H100 FP8-CS preset's expert_tensor_parallel_size 1 (below, `NANO_RECIPE`)
EXPERT_TENSOR = {"Qwen3_30B_a3B": 1, "Qwen3_235B_a22B": 1, "GPT OSS 120B": 1, "DeepSeekV3": 1, "Nemotron_3_Nano": 1}
# the row's precision -> --fp8-recipe: FP8-CS is TransformerEngine's current scaling, and so is the 26.x rows' FP8:
# their recipes are the fp8cs configs (perf_recipes/qwen/h100/qwen3_moe.py at 067f987df0, e.g.
# qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config; benchmarks/published/README.md); 25.09 states none: delayed
# scaling, TransformerEngine's default recipe (run_script.py's --fp8_recipe default "ds", argument_parser.py line 106
# at v0.1.0rc4); FP8 all the same: the 25.09 H100 table's footnote gives its DeepSeek-V3 row's parenthesised TFLOP/s
# as another quantization granularity, 128x128 weights and 1x128 activations (docs/performance-summary.md there)
FP8_RECIPES = {"FP8-CS": "te-current", "FP8": "te-current", "": "te", "BF16": None}
# the model -> --recompute-modules its H100 recipe sets: gpt-oss-120b's recompute_modules ["layernorm", "moe_act"]
# under selective granularity (GPT_OSS_120B_H100_BF16_BASE_CONFIG in workload_base_configs.py at v0.2.1,
# GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1 and _V2 in gpt_oss_workload_base_configs.py at v0.3.0 to v0.4.1,
# gpt_oss_120b_pretrain_64gpu_h100_bf16_config in perf_recipes/gpt_oss/h100/gpt_oss.py at 067f987df0); the Qwen3
# recipes recompute nothing
# DeepSeek-V3's 25.09 H100 run: ["mla_up_proj", "mlp"] (run_script.py line 91 at v0.1.0rc4), "mlp" its 3 dense
# layers' MLPs
# Nemotron 3 Nano's: ["moe", "layernorm", "core_attn", "moe_act"] (`NANO_RECIPE`), core_attn `--recompute selective`
RECOMPUTE_MODULES = {"GPT OSS 120B": ("layernorm", "moe_act"), "DeepSeekV3": ("mla_up_proj", "mlp"),
                     "Nemotron_3_Nano": ("moe", "layernorm", "moe_act")}
# the model -> --router-aux-loss, its load-balancing loss as Megatron-core computes it (workload/moe.py
# `with_aux_loss`): Megatron-Bridge's Qwen3 providers set aux_loss 1e-3 (qwen_provider.py at v0.1.0rc4, v0.2.1,
# r0.3.0; qwen3_moe_bridge.py at 067f987df0), DeepSeek-V3's seq_aux_loss (deepseek_provider.py,
# deepseek_v3_bridge.py: the same kernels and a division by the batch), the performance configs moe_router_fusion
# True (scripts/performance/configs/qwen3, deepseek at v0.1.0rc4 to r0.3.0; the cards' recipes: recipes/qwen/h100/
# qwen3_moe.py's 16-GPU config, perf_recipes/deepseek/common.py at 067f987df0), which Megatron-core's router runs as
# TransformerEngine's fused kernels (router.py at core_v0.14.0 to b0cc2706); gpt-oss's provider sets none
# Nemotron 3 Nano's seq_aux_loss without moe_router_fusion (`NANO_RECIPE`): unfused
BRIDGE_AUX_LOSS = {"Qwen3_30B_a3B": "fused", "Qwen3_235B_a22B": "fused", "GPT OSS 120B": "none", "DeepSeekV3": "fused",
                   "Nemotron_3_Nano": "unfused"}
# --attention-kernel: every source's row ran TransformerEngine's FusedAttention, cuDNN's kernel. TransformerEngine
# enables FlashAttention and FusedAttention unless NVTE_FLASH_ATTN or NVTE_FUSED_ATTN is 0 (both read as 1 unset),
# and where both take the shape on Hopper it drops FlashAttention ("Disabling FlashAttention to give FusedAttention
# preference on Hopper+": get_attention_backend in transformer_engine/pytorch/attention/dot_product_attention/utils.py
# from v2.2 to v2.16, in pytorch/dot_product_attention/utils.py at v2.2). Every source leaves both on:
# Megatron-Bridge v0.1.0rc4's scripts/performance/utils/executors.py (25.09) sets both to 1 (PERF_ENV_VARS, lines
# 43-44), its later scripts set neither (cf457d8d3 took them out), and Megatron-core's attention_backend auto, the
# default (the recipes' None sets nothing), sets both to 1 (language_module.py _set_attention_backend); the Model Zoo's
# Qwen3-235B-A22B.yaml at b0b92ff sets neither, nor --attention-backend (its --use-flash-attn reaches only
# Megatron-LM's legacy model, megatron/legacy/model/transformer.py at 1e057005); NeMo's scripts/performance/utils.py at
# 7a8f1cc7bc, DGX Cloud's launcher, sets both to 1; NeMo AutoModel's Qwen3 config runs TransformerEngine's
# DotProductAttention (backend attn "te") with neither set. Their TransformerEngine: 2.7 (25.09) to 2.16 (26.06), as
# Megatron-Bridge's docs/releases/software-versions.md lists them; the Model Zoo's dockers/Dockerfile at b0b92ff builds
# 07afda98 (2.6.0.dev0) with cuDNN 9.11.0.92; NeMo 25.04.01's is not in these sources, a release before NeMo
# r2.3.0's 7a8f1cc7bc (2 June 2025), so 2.4 at the latest. The shapes: Qwen3's head dim 128 (its QK-norm runs before
# the kernel) is in cuDNN's range; DeepSeek-V3's MLA, q and k 192 against v 128, leaves FlashAttention out ("does not
# support MLA") and cuDNN takes it in training on sm90 (transformer_engine/common/fused_attn/fused_attn.cpp
# nvte_get_fused_attn_backend: head dims up to 256 from cuDNN 9.0 to v2.4, from 9.5 at v2.5 on; v2.7's exclusion of
# unequal dims under cuDNN 9.11-9.13 spares 192 with 128); gpt-oss's learned sinks (gpt_oss_bridge.py: softmax_type
# "learnable") leave FlashAttention out whatever the environment ("Disabling FlashAttention for softmax_type")
ATTENTION_KERNEL = "cudnn"
# (model, t, p, v, E) -> (--token-dispatcher, the containers whose H100 recipe for that layout ran it) in
# Megatron-Bridge's history (README.md there); the rest ran the model provider's default, NCCL's all-to-all
# (qwen_provider.py: moe_token_dispatcher_type), as 25.11's p2 v12 recipe did (its base config names no flex backend)
DISPATCHERS = {("Qwen3_30B_a3B", 1, 1, 1, 16): ("hybridep", ("26.",)),  # the layout's only recipe (4a64507)
               # DeepEP with GBS 1024 (90bdd9f, c4cc63b): in r0.3.0 (26.02) qwen3_llm_pretrain.py hands the base
               # config's deepep to the library recipe, whose apply_flex_dispatcher_backend picks flex on Hopper
               ("Qwen3_30B_a3B", 1, 2, 12, 8): ("deepep", ("26.02",)),
               # run_script.py lines 56 and 78 at v0.1.0rc4: DeepEP on H100 (deepseek_v3.py's flex dispatcher)
               ("DeepSeekV3", 2, 8, 4, 64): ("deepep", ("25.09",)),
               ("Nemotron_3_Nano", 1, 1, 1, 8): ("hybridep", ("26.",))}  # `NANO_RECIPE`
# (model, t, p, v, E) -> the containers whose recipe for that layout sets moe_a2a_overlap (Megatron-core's
# overlap_moe_expert_parallel_comm: `--overlap-expert-comm`), each with its line in Megatron-Bridge. 25.09 ran
# v0.1.0's recipe, which sets no overlap (scripts/performance/configs/qwen3/qwen3_235b_a22b_llm_pretrain.yaml and
# qwen3_30b_a3b_llm_pretrain.yaml at v0.1.0rc4).
A2A_OVERLAP = {
    # 25.11 (Megatron-Bridge v0.2.0, whose docs/performance-summary.md has the 25.11 rows from v0.2.1):
    # scripts/performance/configs/qwen3/workload_base_configs.py line 143, QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG
    # (GBS 2048): moe_a2a_overlap=True. 26.x: perf_recipes/qwen/h100/qwen3_moe.py at 067f987df0,
    # qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config, lines 213-219: cfg.model.moe_a2a_overlap = True,
    # overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
    ("Qwen3_235B_a22B", 2, 8, 4, 32): ("25.11", "26."),
    # 25.09's DeepSeek-V3 H100 run: run_script.py lines 62 and 83 at v0.1.0rc4 (A2A_1F1B on H100):
    # overlap_moe_expert_parallel_comm and delay_wgrad_compute True
    ("DeepSeekV3", 2, 8, 4, 64): ("25.09",),
    # 25.11: scripts/performance/configs/qwen3/workload_base_configs.py at v0.2.0 and v0.2.1, line 233,
    # QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG (p 2, v 12, GBS 512): moe_a2a_overlap=True. 26.02: scripts/performance/
    # configs/qwen/qwen3_workload_base_configs.py at c4cc63b, line 429, QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1
    # (p 2, v 12, DeepEP, GBS 1024): moe_a2a_overlap=True
    ("Qwen3_30B_a3B", 1, 2, 12, 8): ("25.11", "26."),
}
# (container, model) -> the layout (t, p, v, E, micro-batch) its release's recipe ran where the row prints another,
# with why. 25.09's and 25.11's Qwen3-30B-A3B rows print the same layout (MBS 2, VP 24, GA 32), which neither
# release's H100 recipe runs: 25.09's (scripts/performance/configs/qwen3/qwen3_30b_a3b_llm_pretrain.yaml at
# v0.1.0rc4, perf_matrix h100 num_gpus_16: vp 12, mbs 2 under fp8_cs and the recipe's default 2) runs 2 layers a
# chunk, and 25.11's (workload_base_configs.py at v0.2.0 and v0.2.1, QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG: p 2,
# v 12, EP 8, GBS 512, WorkloadBaseConfig's micro_batch_size 1, moe_a2a_overlap) is the overlapped MBS-1 recipe that
# 26.02 ran over DeepEP, whose row measures within 3 % of it per GPU (5,113 against 5,275); 25.11's summary prints
# 25.09's H100 columns (and MBS 4 on GB300, whose v0.2.1 config runs 8).
# 26.02.01 is Megatron-Bridge r0.3.1 (its docs/releases/known-issues.md at v0.4.0: "Fixed in 26.02.01 (r0.3.1)"),
# whose only H100 FP8-CS Qwen3-30B-A3B recipe is t1 p1 E16 over HybridEP without moe_a2a_overlap
# (scripts/performance/configs/qwen/qwen3_workload_base_configs.py at v0.3.1, QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_
# FP8_CS_V1: f29a269f8, the cherry-pick of 4a6450755, "Update Qwen3 30B H100 Base Configs with HybridEP"); the row
# prints 26.02's p2 v12 E8 (r0.3.0's recipe) and measures within 1-3 % of the E16 recipe's 26.04 to 26.06 rows.
RELEASE_LAYOUTS = {
    ("26.02.01", "Qwen3_30B_a3B"): ((1, 1, 1, 16, 1), "Megatron-Bridge r0.3.1's only H100 FP8-CS recipe for it is "
                                   "t1 p1 E16 over HybridEP, no expert overlap (qwen3_workload_base_configs.py at "
                                   "v0.3.1; the row prints r0.3.0's p2 v12 E8)"),
    ("25.11", "Qwen3_30B_a3B"): ((1, 2, 12, 8, 1), "Megatron-Bridge v0.2.x's H100 FP8-CS recipe for it is t1 p2 v12 "
                                "E8 at MBS 1 with moe_a2a_overlap over NCCL's all-to-all (workload_base_configs.py "
                                "at v0.2.1, QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG; the row prints 25.09's MBS 2 v24)"),
    ("25.09", "Qwen3_30B_a3B"): ((1, 2, 12, 8, 2), "Megatron-Bridge v0.1.0rc4's H100 recipe for it runs VP 12 "
                                "(qwen3_30b_a3b_llm_pretrain.yaml's perf_matrix; the row prints VP 24)"),
    ("25.11", "GPT OSS 120B"): ((1, 4, 1, 8, 1), "Megatron-Bridge v0.2.x's H100 BF16 recipe for it runs MBS 1 "
                               "(workload_base_configs.py at v0.2.0 and v0.2.1, GPT_OSS_120B_H100_BF16_BASE_CONFIG "
                               "on BASE_GPT_OSS_120B_CONFIG); the row prints the B200 row's MBS 4 and GA 2, which "
                               "GBS 512 over its 16 data-parallel ranks does not give"),
}
# The runs that force balance (--routing random) and those that do not: the dropless Qwen3 runs set
# moe_router_force_load_balancing (scripts/performance/configs/qwen3/qwen3_llm_pretrain.py at v0.2.1,
# set_qwen3_common_configs: "required for token dropless"; perf_recipes/qwen/h100/qwen3_moe.py at 067f987df0), and so
# do gpt-oss-120b's (set_gpt_oss_common_configs in gpt_oss_llm_pretrain.py at v0.2.1 to v0.4.1;
# perf_recipes/gpt_oss/h100/gpt_oss.py at 067f987df0: moe_router_force_load_balancing = True);
# 25.09's "(tokendrop)" runs route by the model's
# router and drop at capacity 1 (scripts/performance/run_script.py at v0.1.0rc4: apply_moe_token_drop, no forced
# balance), each expert padded to its even share
TOKEN_DROP = "(tokendrop)"  # the row's model label of the runs that do not
# their --capacity-factor: apply_moe_token_drop's defaults, which run_script.py (lines 109 and 116 at v0.1.0rc4) keeps
# for both Qwen3 models: moe_expert_capacity_factor 1.0 with moe_pad_expert_input_to_capacity True
# (src/megatron/bridge/training/utils/moe_token_drop.py there)
TOKEN_DROP_CAPACITY = 1.0
# the Model Zoo table's model -> its examples/ config
MODELZOO_PRESETS = {"235B": "qwen3-235b-a22b", "Next-80B-A3B": "qwen3-next-80b-a3b"}
DGXC = "nvidia-dgxc-moe-h100.csv"  # DGX Cloud's MoE recipes on H100, README.md there too
# the recipe (dgxc-benchmarking's folder) -> the model's name and its examples/ config
DGXC_MODELS = {"deepseek_v3": ("DeepSeek-V3", "deepseek-v3"),
               "llama4": ("Llama 4 Maverick", "llama4-maverick-17b-128e")}
# NeMo's DeepSeekConfig (nemo/collections/llm/gpt/model/deepseek.py at 7a8f1cc7bc): seq_aux_loss, coefficient 1e-4,
# no moe_router_fusion: the loss's torch ops
DGXC_AUX_LOSS = "unfused"
# Llama 4 Maverick's BF16 H100 row as NeMo's scripts/performance/llm/pretrain_llama4_e128.py at 7a8f1cc7bc ran it
# (launch.sh and setup.sh at 1f6d9f4): VP 1 (launch.sh line 101; the README, and so the csv here, prints the GB200
# rows' 12), no CUDA graphs in BF16 (lines 105-109, 117-126); Llama4Config and Llama4Experts128Config (llama.py lines
# 374-434: the all-to-all dispatcher, moe_apply_probs_on_input, the router's sigmoid top 1, moe_aux_loss_coeff 0 by
# default, so no load-balancing loss), the script's apply_rope_fusion and TransformerEngine's cross entropy (lines
# 96-99), the recipe's MegatronTokenDropCallback (capacity 1 padded: moe_token_drop.py lines 38-39, so no host
# synchronisation), MegatronCommOverlapCallback with tp_comm_overlap (llama4_e128.py lines 236-239: userbuffers at
# t4 with sequence parallelism) and gradients reduced in 16 bits (line 251, over the DDP config's float32)
LLAMA4_RUN = dict(dispatcher=None, routing="balanced", capacity_factor=TOKEN_DROP_CAPACITY,
                  precision="megatron-16bit-grads", rope_kernel="fused", stage_cut=None, mtp_layers=0,
                  router_aux_loss="none", tp_overlap=True, recompute_modules=())
# its FP8 row: the same run in NeMo's bf16_with_fp8_mixed (TransformerEngine's delayed scaling: mixed_precision.py
# lines 64-71 at 7a8f1cc7bc) with every transformer layer in CUDA graphs (launch.sh lines 105-109: CUDA_GRAPH true
# for FP8 on H100; utils.py lines 380-381: enable_cuda_graph, Megatron-core's TransformerLayer graphs)
LLAMA4_FP8_RUN = dict(LLAMA4_RUN, fp8_recipe="te", cuda_graphs=("full",))
# the DGX Cloud runs' model -> what its run does otherwise, which pipesim counts as the model's config has it
DGXC_OTHERWISE = {"Llama 4 Maverick": "transformers' attention temperature tuning on its 12 layers without RoPE (the "
                                      "config's default attn_temperature_tuning: each query scaled by a factor of "
                                      "its position), which NeMo's Llama4SelfAttention does not run"}
# v25.08.01's DeepSeek-V3 H100 row (dgxc-benchmarking 2fc17d4: deepseek_v3/pretrain/launch.sh lines 102-155, RM
# "mla_up_proj mlp moe"; its README's 1,024-GPU example, 36.189 s), as NeMo's scripts/performance/llm/
# pretrain_deepseek_v3.py at 9244b1ec89 (metadata.yaml's pin) runs it: its layout for p8 v2 (line 105: the embedding
# and 4 blocks, 14 chunks of 4, then a block and the loss; account_for_* and the first and last stage counts off,
# lines 121-125), the recipe's MTP layer on the last chunk (recipes/deepseek_v3.py use_mtp, Megatron-core's
# multi_token_prediction.py: the last virtual stage); DeepEP with forced balance, no shared-expert overlap (lines
# 80-85), dropless (the token-drop callback only off H100, lines 86-91); the MLA RoPE fused (line 95); gradients
# reduced in 16 bits (recipes/deepseek_v3.py lines 117 and 187, helpers.py line 229); the aux loss unfused (Megatron-
# core ac198fc0d6 has no router fusion); overlap_p2p_comm at v > 1 (megatron_comm_overlap.py lines 154-160)
DGXC_RELEASE_RUNS = {"2fc17d4": dict(dispatcher="deepep", routing="random", capacity_factor=None,
                                     precision="megatron-16bit-grads", rope_kernel="fused",
                                     stage_cut="layout:Etttt|(tttt|)*14tmL")}


def dgxc_first_last(pipeline: int) -> str:
    """--stage-cut as NeMo's pretrain_deepseek_v3.py at 7a8f1cc7bc cuts DeepSeek-V3's 61 layers: 64 / p a middle
    stage, one fewer in the first (the embedding's place) and two fewer in the last (the MTP layer's and the loss's)."""
    if 64 % pipeline:
        raise ValueError(f"{DGXC}: pretrain_deepseek_v3.py takes p dividing 64, not {pipeline}")
    return f"first-last:{64 // pipeline - 1},{64 // pipeline - 2}"


# the table's model -> the layers Megatron-core splits over the p·v chunks: runtime_configs/benchmarking/runtime.conf at
# b0b92ff gives Qwen3-235B-A22B 96 ("Account loss and embedding for number of layers": its 94, the embedding and the
# loss, as the yaml's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split count them)
# and Qwen3-Next-80B-A3B its 48 blocks (its yaml sets neither flag: the embedding and the loss beside the first and
# last chunks' blocks, Megatron-LM's even cut); each with whether the split counts the embedding and the loss
MODELZOO_SPLIT_LAYERS = {"235B": (96, True), "Next-80B-A3B": (48, False)}
# the model -> what else its config and script set (`MoeRun` fields): Qwen3-Next-80B-A3B's model_configs/benchmarking/
# Qwen3-Next-80B-A3B.yaml at b0b92ff (unchanged since 3a2d8b5) sets --mtp-num-layers 1 and neither
# --overlap-grad-reduce nor --overlap-param-gather (Megatron-LM's default: the gradients reduced after the flush)
MODELZOO_RUNS = {"Next-80B-A3B": dict(mtp_layers=1, reduce_after_flush=True)}
# the table's dispatcher -> --token-dispatcher (sbatch_benchmarking.sh at b0b92ff: DISPATCHER deepep runs the flex
# dispatcher over DeepEP, alltoall Megatron-core's all-to-all one)
MODELZOO_DISPATCHERS = {"DeepEP": "deepep", "A2A": None}
# the table's recompute column's parts -> --recompute-modules (the H100 command's `--recompute-modules moe_act
# layernorm` for "norm, act"; best_practice/Qwen3/run_next_80b.sh's `moe_act shared_experts layernorm` for "norm, act,
# shared_expert")
MODELZOO_RECOMPUTE = {"norm": "layernorm", "act": "moe_act", "shared_expert": "shared_experts"}
MODELZOO_NOT_EXPRESSIBLE = {
    "FSDP On": "Megatron-FSDP, whose sharding (--data-parallel-sharding-strategy) the table does not give, and no "
               "command of the row's (its code column names only Megatron-LM's main at 1e057005)",
}
# the model -> what else its recipe sets (`MoeRun` fields): DeepSeek-V3's 25.09 H100 run (run_script.py at
# v0.1.0rc4, lines 66 and 102): its layout, deepseek_v3.py's mtp_num_layers 1, overlap_grad_reduce False
# Megatron-Bridge's Nemotron 3 Nano H100 FP8-CS recipe, the same at v0.3.1 (26.02.01), v0.4.0 and v0.5.0 (26.06):
# scripts/performance/configs/nemotronh/nemotron_3_workload_base_configs.py at v0.4.0 (nemotron_3_nano_workload_
# base_configs.py at v0.3.1) lines 31-40 (flex over HybridEP, ETP 1, EP 8), 70-76 (16 GPUs, GBS 1024, MBS 1) and
# 83-87 (cuda_graph_scope ["mamba"] under cuda_graph_impl "transformer_engine", recompute_modules ["moe",
# "layernorm", "core_attn", "moe_act"], which overrides.py `_set_recompute_overrides` runs selective); its builder
# (nemotron_3_llm_pretrain.py lines 249-270 at v0.4.0) sets fp8_cs precision, forced balance and 16-bit gradient
# reduction (`set_nemotron_3_nano_common_configs`), and the library recipe (recipes/nemotronh/nemotron_3_nano.py)
# no router fusion, no expert overlap, no shared-expert overlap, HybridEP's 16 SMs; the model has no RoPE
NANO_RECIPE = {"recompute": "selective", "cuda_graphs": ("mamba",), "rope_kernel": "eager"}
RECIPE_RUNS = {"DeepSeekV3": {"stage_cut": "layout:Et|(tt|)*30mL", "mtp_layers": 1, "reduce_after_flush": True},
               "Nemotron_3_Nano": NANO_RECIPE}
# what NeMo's DeepSeek-V3 runs on DGX Cloud set in both releases that pipesim does not model
DGXC_SHARED_NOT_MODELLED = ("the DDP buckets of 128M parameters MegatronCommOverlapCallback sets (cut on pipeline "
                            "rank 0 only, not the slowest device), the MTP layer's copy of the embedding on the last "
                            "stage and its gradient all-reduced with the first stage's after the flush, "
                            "TransformerEngine's norms leaving 16 SMs")
# the model -> what its recipe sets that pipesim does not model (the module docstring)
RECIPE_NOT_MODELLED = {"DeepSeekV3": "the optimizer's bfloat16 moments, fp8_param_gather beside expert "
                                     "parallelism",
                       # `NANO_RECIPE`
                       "Nemotron_3_Nano": "fp8_param_gather beside expert parallelism; the graphs' memory pool and "
                                          "static buffers",
                       # NeMo 7a8f1cc7bc's DeepSeekConfig (deepseek.py), MegatronCommOverlapCallback
                       # (megatron_comm_overlap.py lines 179-188: bucket_size 128 * 1024 * 1024 where d > 1),
                       # PerfEnvPlugin (nemo/lightning/run/plugins.py: NVTE_FWD/BWD_LAYERNORM_SM_MARGIN 16,
                       # CUDA_DEVICE_MAX_CONNECTIONS 1 at t > 1 on Hopper), Megatron-core 7094270c6f's
                       # finalize_model_grads.py (line 145: the MTP stage's embedding copy)
                       "DGXC DeepSeek-V3 t2": "moe_shared_expert_overlap (the shared expert beside the dispatch), "
                                              f"{DGXC_SHARED_NOT_MODELLED}",
                       # v25.08.01's run (`DGXC_RELEASE_RUNS`): pretrain_deepseek_v3.py line 96 at 9244b1ec89,
                       # MegatronEnableExperimentalCallback, whose flag Megatron-core ac198fc0d6's DeepEP path reads
                       # for the fused indices_to_multihot (token_dispatcher.py lines 1095-1099)
                       # `LLAMA4_RUN`: Llama4Config's moe_shared_expert_overlap (llama.py), the callback's
                       # buckets and PerfEnvPlugin's margin as above
                       "DGXC Llama 4 Maverick": "moe_shared_expert_overlap (the shared expert beside the dispatch), "
                                                "the DDP buckets of 128M parameters MegatronCommOverlapCallback sets, "
                                                "TransformerEngine's norms leaving 16 SMs; in FP8, fp8_param_gather "
                                                "beside expert parallelism and the graphs' memory pool",
                       "DGXC DeepSeek-V3 t1 p8 v2": "DeepEP's received indices made each local expert's map by the "
                                                    "fused kernel its experimental flag turns on (where "
                                                    "--token-dispatcher deepep prices Megatron-core's unfused 12), "
                                                    f"{DGXC_SHARED_NOT_MODELLED}"}
CARDS = "megatron-bridge-cards-moe-h100.csv"  # Megatron-Bridge's skill and model card runs, README.md there too
# the card's model -> the summaries' name of it (for `RECOMPUTE_MODULES`, `RECIPE_RUNS`) and its examples/ config
CARD_MODELS = {"Qwen3-30B-A3B": "Qwen3_30B_a3B", "DeepSeek-V3": "DeepSeekV3", "gpt-oss-120b": "GPT OSS 120B"}
CARDS_NOT_EXPRESSIBLE = {
    "natural routing": "natural routing (the card's command sets moe_router_force_load_balancing false, on "
                       "RedPajama-2 text, 100 steps from initialisation): how unevenly its router spread the tokens "
                       "over the experts, the busiest rank's share --hot-expert-share would take, is not published",
    "delay_wgrad off": "the expert overlap with delay_wgrad_compute off (SKILL.md: \"delayed wgrad stayed disabled\"; "
                       "the model card: \"delayed weight-gradient compute disabled\"), "
                       "where pipesim's pair runs each part's weight gradients after its input gradients, as every "
                       "recipe setting moe_a2a_overlap sets delay_wgrad_compute with it (planning/experts.py "
                       "`paired_exposed_ms`)",
}
# runs a source prints without their layout: (name, why)
# the cards' vision-language runs -> why: pipesim counts a multimodal config's language model alone
CARDS_VISION_LANGUAGE = {
    "Qwen3.6-35B-A3B": "a vision-language run (Qwen3_5MoeForConditionalGeneration): its vision encoder of 27 layers "
                       "trained beside the language model on DataComp's image-caption samples (max_pixels 200,704), "
                       "which pipesim does not count (it takes the text_config), routed naturally "
                       "(moe_router_force_load_balancing false) by an imbalance not published"}
CARDS_WITHOUT_LAYOUT = [
    ("Bridge card Qwen3-30B-A3B BF16 all-to-all eager", "docs/training/cuda-graphs.md at 067f987df0 gives its "
     "41.36 s (42.00 s graphed) with the model, H100, BF16 and the all-to-all dispatcher only: no t, p, E, batch, "
     "micro-batch or sequence"),
]

AUTOMODEL = "nemo-automodel-moe-h100.csv"  # NeMo AutoModel's H100 pre-training table, README.md there too
# AutoModel's model -> its examples/ config, for the rows run
AUTOMODEL_PRESETS = {"Qwen3 MoE 30B": "qwen3-30b-a3b", "DeepSeek V3 671B": "deepseek-v3", "Kimi K2": "kimi-k2",
                     "Nemotron V3 Nano 30B (26.02)": "nemotron-3-nano-30b-a3b"}
# AutoModel's model -> the kernels its own model runs where they are not TransformerEngine's: Nemotron V3 Nano's
# (nemo_automodel/components/models/nemotron_v3/layers.py at bb0c0bfb0: the attention's q, k, v and o and the
# Mamba-2 mixers' in_proj and out_proj are torch's nn.Linear, its attention F.scaled_dot_product_attention with
# enable_gqa, whose FlashAttention-2 backend takes grouped queries; TransformerEngine's only for its norms, head and
# shared expert)
AUTOMODEL_KERNELS = {"Nemotron V3 Nano 30B (26.02)": {"attention_kernel": "flash2", "linear_kernel": "eager"}}
# AutoModel's model (or the prefix of its name) -> why its rows are not run
AUTOMODEL_NOT_EXPRESSIBLE = {
    **{f"Nemotron V3 {size}": "its Hugging Face config is not among examples/: pipesim holds no sourced copy of its "
                              "figures" for size in ("Super", "Ultra")},
    **{f"GPT-OSS {size}": f"FlexAttention (its config's backend attn: flex, for the sinks: gptoss_{size.lower()}_te_"
                          "deepep.yaml at 89e3a9fdd), which --attention-kernel does not price (flash2, cudnn, flash3)"
       for size in ("20B", "120B")},
}


def autopipeline_stages(layers: int, layers_per_stage: int, pipeline: int) -> int:
    """The model stages AutoPipeline cuts `layers` blocks into (nemo_automodel/components/distributed/pipelining/
    functional.py `calculate_virtual_stages` at 89e3a9fdd): ⌈layers / layers_per_stage⌉ + 1, rounded down to a
    multiple of p (the configs' round_virtual_stages_to_pp_multiple "down")."""
    stages = math.ceil(layers / layers_per_stage) + 1
    return stages - stages % pipeline


def autopipeline_layout(layers: int, stages: int) -> str:
    """--stage-cut as AutoPipeline splits the blocks (functional.py `generate_hf_model_fqn_per_model_part`):
    layers // stages a stage, one more in each of the first layers % stages, the embedding with the first and the
    final norm and head with the last."""
    each, extra = divmod(layers, stages)
    cut = "|".join("t" * (each + (i < extra)) for i in range(stages))
    return f"layout:E{cut}L"


# what the rows' commands price differently from the runs (the configs and nemo_automodel/components/moe at their
# commits: layers.py FakeBalancedGate and GroupedExpertsDeepEP's moe_permute_fusion=True, parallelizer.py apply_fsdp's
# MixedPrecisionPolicy)
AUTOMODEL_NOT_MODELLED = {
    model: "FakeBalancedGate's experts by token index without the router's product (the count's router prices it), "
           "DeepEP's received indices made each local expert's map by the fused Triton kernel (where "
           "--token-dispatcher deepep prices Megatron-core's unfused 12), FSDP2's gradients reduce-scattered in "
           "float32 (reduce_dtype) where nemo-bf16-adam reduces 16 bits"
           + ("; its Mamba-2 mixers' gated norm and out_proj inside mamba_ssm's scan function, whose backward "
              "recomputes the norm's output (the count runs them apart, as Megatron-core does); its shared expert on "
              "a stream of its own beside the dispatch; its head and shared expert TransformerEngine's linears, "
              "which --linear-kernel eager prices as torch's, alike in BF16 without biases"
              if preset.startswith("nemotron") else "")
    for model, preset in AUTOMODEL_PRESETS.items()}


@dataclass(frozen=True)
class MoeRun:
    """One row's model and layout."""

    name: str
    preset: str  # examples/<preset>: the model's Hugging Face config
    gpus: int
    global_batch: int
    microbatch_size: int
    seq_len: int
    tensor: int
    pipeline: int
    chunks: int  # VP: model chunks per device (1: plain 1F1B)
    expert: int
    dispatcher: str | None  # --token-dispatcher (None: NCCL's all-to-all)
    expert_tensor: int  # --expert-tensor-parallel: each routed expert's tensor split
    a2a_overlap: bool  # --overlap-expert-comm: the recipe sets moe_a2a_overlap (`A2A_OVERLAP`)
    fp8_recipe: str | None  # --fp8-recipe: the row's float8 scaling (`FP8_RECIPES`); None: BF16
    routing: str  # --routing: random where the run forces balance, balanced where it drops (`TOKEN_DROP`)
    capacity_factor: float | None  # --capacity-factor where it drops (`TOKEN_DROP_CAPACITY`; None: dropless)
    source: str = SOURCE  # the CSV under benchmarks/published/ the row is from
    precision: str = "megatron-16bit-grads"  # --precision: how the run holds its gradients
    recompute_modules: tuple[str, ...] = ()  # --recompute-modules: the parts recomputed in the backward
    stage_cut: str | None = None  # --stage-cut where the run set its own (None: Megatron's cut of the blocks)
    rope_kernel: str = "fused"  # --rope-kernel: fused where the run sets apply_rope_fusion
    mtp_layers: int = 0  # --mtp-layers: the run's multi-token-prediction depth
    reduce_after_flush: bool = False  # --reduce-after-flush: the recipe sets overlap_grad_reduce False
    router_aux_loss: str = "none"  # --router-aux-loss: how the run computes its load-balancing loss
    zero: int = 1  # --zero: what the data-parallel ranks shard (Megatron-core's distributed optimizer: 1)
    grad_accumulation: str = "fused"  # --grad-accumulation: inside the weight-gradient products, or autograd's adds
    recompute: str = "none"  # --recompute: whole layers (full) where the run checkpoints each block
    cross_entropy: str = "megatron"  # --cross-entropy: Megatron-core's, or torch's
    expert_gemm: str = "per-expert"  # --expert-gemm: TEGroupedMLP's GEMM a local expert, or one grouped kernel
    pp_runtime: str | None = None  # --pp-runtime: torch where torch.distributed.pipelining runs the stages
    rounds: int = 1  # --rounds: the pipeline's flushes a step (torch's pipelining's gradient accumulation)
    attention_kernel: str = ATTENTION_KERNEL  # --attention-kernel: the fused attention the run's model calls
    linear_kernel: str = "te"  # --linear-kernel: TransformerEngine's linear layers, or torch's (eager)
    cuda_graphs: tuple[str, ...] = ()  # --cuda-graphs: the layers the run captures in CUDA graphs
    tp_overlap: bool = False  # --tp-overlap: the run overlaps tensor parallelism's exchanges (userbuffers)

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    def simulate_command(self, root: Path) -> list[str]:
        """One step as the module docstring says; `root`: the repository root, where the config is read. Its
        exchanges synchronise the device (`p2p_sync`) without virtual stages only: NeMo's MegatronCommOverlapCallback
        and Megatron-Bridge's CommOverlapConfig set batch_p2p_comm (whose batch_p2p_sync is True by default in
        ModelParallelConfig) where v = 1, overlap_p2p_comm, which needs it False, where v > 1, and Megatron-LM's
        arguments.py sets it to `not overlap_p2p_comm` (docs/hardware.md, "Host-bound execution")."""
        schedule = megatron_schedule(self.chunks)
        blocks = config_blocks(root, self.preset)
        cut = self.stage_cut or ("equal-blocks" if blocks % (self.pipeline * self.chunks) == 0 else "balanced")
        dtype = ["fp8", "--fp8-recipe", self.fp8_recipe] if self.fp8_recipe else ["bf16"]
        return ["simulate", "--model", f"hf:{EXAMPLES}/{self.preset}", "--seq-len", str(self.seq_len), "--dtype",
                *dtype, "--linear-kernel", self.linear_kernel, "--attention", "flash", "--attention-kernel",
                self.attention_kernel,
                "-b", str(self.microbatch_size),
                "--gpu", GPU,
                "--tensor-parallel", str(self.tensor), *(["--sequence-parallel"] if self.tensor > 1 else []),
                *(["--tp-overlap"] if self.tp_overlap else []),
                "-p", str(self.pipeline), "-m", str(self.global_batch // (self.data * self.microbatch_size)),
                "--data-parallel", str(self.data), "--expert-parallel", str(self.expert), "--zero", str(self.zero),
                "--precision", self.precision, "--grad-accumulation", self.grad_accumulation,
                "--recompute", self.recompute,
                *(["--recompute-modules", ",".join(self.recompute_modules)] if self.recompute_modules else []),
                *(["--mtp-layers", str(self.mtp_layers)] if self.mtp_layers else []),
                *schedule, "--stage-cut", cut,
                "--rank-order", "megatron", "--expert-tensor-parallel", str(self.expert_tensor),
                "--cross-entropy", self.cross_entropy, "--norm-kernel", "fused", "--rope-kernel", self.rope_kernel,
                "--expert-gemm", self.expert_gemm, "--routing", self.routing,
                *(["--capacity-factor", f"{self.capacity_factor:g}"] if self.capacity_factor is not None else []),
                *(["--token-dispatcher", self.dispatcher] if self.dispatcher else []),
                *(["--overlap-expert-comm"] if self.a2a_overlap else []),
                *(["--reduce-after-flush"] if self.reduce_after_flush else []),
                *(["--pp-runtime", self.pp_runtime] if self.pp_runtime else []),
                *(["--rounds", str(self.rounds)] if self.rounds > 1 else []),
                *(["--router-aux-loss", self.router_aux_loss] if self.router_aux_loss != "none" else []),
                *(["--cuda-graphs", ",".join(self.cuda_graphs)] if self.cuda_graphs else []),
                *p2p_sync(schedule, self.pipeline)]


def bridge_runs() -> list[tuple[MoeRun, float]]:
    """Megatron-Bridge's rows as runs, each with its published tokens/s per GPU: every row is expressible."""
    expressible = []
    for row in _rows(SOURCE):
        model = row["model"].split(" (")[0]  # "(dropless)", "(tokendrop)": forced balance drops no token either way
        t, p, gpus, batch, b, seq, e = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "gpus",
                                                               "global_batch", "microbatch_size", "sequence_length",
                                                               "expert_parallel"))
        chunks = 1 if row["virtual_pipeline"] == "n/a" else int(row["virtual_pipeline"])
        if (row["container"], model) in RELEASE_LAYOUTS:
            t, p, chunks, e, b = RELEASE_LAYOUTS[row["container"], model][0]
        layout = (model, t, p, chunks, e)
        drops = TOKEN_DROP in row["model"]
        dispatcher, flex_containers = DISPATCHERS.get(layout, (None, ()))
        expressible.append((MoeRun(f"{row['container']} {row['model']} t{t} p{p} v{chunks} E{e}", PRESETS[model],
                                   gpus, batch, b, seq, t, p, chunks, e,
                                   dispatcher if row["container"].startswith(flex_containers) else None,
                                   EXPERT_TENSOR[model], row["container"].startswith(A2A_OVERLAP.get(layout, ())),
                                   FP8_RECIPES[row["precision"]],
                                   "balanced" if drops else "random", TOKEN_DROP_CAPACITY if drops else None,
                                   recompute_modules=RECOMPUTE_MODULES.get(model, ()),
                                   router_aux_loss=BRIDGE_AUX_LOSS[model], **RECIPE_RUNS.get(model, {})),
                            float(row["tokens_per_s_per_gpu"])))
    return expressible


# the layout columns of the tables published as a step time (the Model Zoo's and DGX Cloud's), in `_step_layout`'s order
STEP_LAYOUT = ("tensor_parallel", "pipeline_parallel", "virtual_pipeline", "expert_parallel", "expert_tensor_parallel",
               "gpus", "global_batch", "microbatch_size", "seq_len")


def _step_layout(row: dict[str, str]) -> tuple[int, ...]:
    """A step-time row's t, p, v, E, expert t, GPUs, global batch, micro-batch size and sequence length."""
    return tuple(int(row[column]) for column in STEP_LAYOUT)


def _tokens_per_s_per_gpu(row: dict[str, str]) -> float:
    """A step-time row's published throughput: its global batch's tokens over its step time and GPUs."""
    return int(row["global_batch"]) * int(row["seq_len"]) / (float(row["step_time_s"]) * int(row["gpus"]))


def _modelzoo_aux_loss(row: dict[str, str], line: int) -> str:
    """The row's --router-aux-loss, its `router_aux_loss` column (benchmarks/published/README.md gives each value's
    source), refused in one line naming the file, line and column where it is none of ROUTER_AUX_LOSSES."""
    setting = row["router_aux_loss"]
    if setting not in ROUTER_AUX_LOSSES:
        raise ValueError(f"{MODELZOO} line {line}, column router_aux_loss: {setting!r}, not one of "
                         f"{', '.join(ROUTER_AUX_LOSSES)}")
    return setting


def modelzoo_runs() -> tuple[list[tuple[MoeRun, float]], list[tuple[str, str]]]:
    """The Model Zoo's H100 rows as runs (the module docstring), each with its published tokens/s per GPU (the
    global batch's tokens over its step time and GPUs), and the rows pipesim cannot express, each named with why."""
    expressible, left_out = [], []
    for line, row in enumerate(_rows(MODELZOO), start=2):
        t, p, chunks, e, etp, gpus, batch, b, seq = _step_layout(row)
        overlap = row["notes"] == "+1f1b overlap"
        name = f"Model Zoo {row['model']} {row['dispatcher']} t{t} p{p} v{chunks} E{e}{' overlap' if overlap else ''}"
        why = MODELZOO_NOT_EXPRESSIBLE.get(row["model"]) or MODELZOO_NOT_EXPRESSIBLE.get(f"FSDP {row['fsdp']}")
        if why:
            left_out.append((name, why))
            continue
        modules = tuple(MODELZOO_RECOMPUTE[part.strip()] for part in row["recompute"].split(",") if part.strip())
        # every chunk holds as many of the split's layers; where those count the embedding and the loss, the first
        # chunk's one is the embedding, the last's one the loss (Megatron-core's get_transformer_layer_offset,
        # megatron/core/transformer/transformer_layer.py), else each holds as many blocks (`MoeRun`'s even cut)
        split, accounted = MODELZOO_SPLIT_LAYERS[row["model"]]
        per_chunk, rest = divmod(split, p * chunks)
        if rest:
            raise ValueError(f"{MODELZOO}: {name}'s layers do not divide into its {p * chunks} chunks")
        run = MoeRun(name, MODELZOO_PRESETS[row["model"]], gpus, batch, b, seq, t, p, chunks, e,
                     MODELZOO_DISPATCHERS[row["dispatcher"]], etp, overlap, None, "random", None, source=MODELZOO,
                     precision="megatron", recompute_modules=modules,
                     stage_cut=f"first-last:{per_chunk - 1},{per_chunk - 1}" if accounted else None,
                     router_aux_loss=_modelzoo_aux_loss(row, line), **MODELZOO_RUNS.get(row["model"], {}))
        expressible.append((run, _tokens_per_s_per_gpu(row)))
    return expressible, left_out


def dgxc_runs() -> tuple[list[tuple[MoeRun, float]], list[tuple[str, str]]]:
    """DGX Cloud's rows as runs (the module docstring: DeepSeek-V3's as NeMo's pretrain_deepseek_v3.py ran them), each
    with its published tokens/s per GPU, and the rows pipesim cannot express, each named with why."""
    expressible, left_out = [], []
    for row in _rows(DGXC):
        t, p, chunks, e, etp, gpus, batch, b, seq = _step_layout(row)
        model, preset = DGXC_MODELS[row["workload"]]
        if row["workload"] == "llama4":
            chunks = 1  # as launch.sh ran it (`LLAMA4_RUN`)
            settings = LLAMA4_FP8_RUN if row["precision"] == "FP8" else LLAMA4_RUN
        else:
            settings = {**dict(dispatcher=None, routing="balanced", capacity_factor=TOKEN_DROP_CAPACITY,
                               precision="megatron", rope_kernel="eager", stage_cut=dgxc_first_last(p), mtp_layers=1,
                               router_aux_loss=DGXC_AUX_LOSS,
                               recompute_modules=tuple(row["recompute_modules"].split(","))),
                        **DGXC_RELEASE_RUNS.get(row["release"], {})}
        name = f"DGXC {model} {row['precision']} t{t} p{p} v{chunks} E{e}"
        run = MoeRun(name, preset, gpus, batch, b, seq, t, p, chunks, e, expert_tensor=etp, a2a_overlap=False,
                     source=DGXC, **{"fp8_recipe": None, **settings})
        expressible.append((run, _tokens_per_s_per_gpu(row)))
    return expressible, left_out


def card_runs() -> tuple[list[tuple[MoeRun, float]], list[tuple[str, str]]]:
    """Megatron-Bridge's skill and model card runs (the module docstring), each with its published tokens/s per GPU,
    and those pipesim cannot express, each named with why."""
    expressible, left_out = [], list(CARDS_WITHOUT_LAYOUT)
    for row in _rows(CARDS):
        t, p, chunks, e, etp, gpus, batch, b, seq = _step_layout(row)
        overlap = row["expert_overlap"] == "on"
        name = (f"Bridge card {row['model']} {row['precision']} t{t} p{p} v{chunks} E{e}{' overlap' if overlap else ''}"
                f"{f' ({label})' if (label := row['label']) else ''}")
        if row["model"] in CARDS_VISION_LANGUAGE or row["routing"] == "natural":
            left_out.append((name, CARDS_VISION_LANGUAGE.get(row["model"], CARDS_NOT_EXPRESSIBLE["natural routing"])))
            continue
        if overlap and row["delay_wgrad"] == "off":
            left_out.append((name, CARDS_NOT_EXPRESSIBLE["delay_wgrad off"]))
            continue
        model = CARD_MODELS[row["model"]]
        run = MoeRun(name, PRESETS[model], gpus, batch, b, seq, t, p, chunks, e, row["dispatcher"] or None,
                     etp, overlap, FP8_RECIPES[row["precision"]], "random", None, source=CARDS,
                     recompute_modules=RECOMPUTE_MODULES.get(model, ()), router_aux_loss=BRIDGE_AUX_LOSS[model],
                     **RECIPE_RUNS.get(model, {}))
        expressible.append((run, _tokens_per_s_per_gpu(row)))
    return expressible, left_out


def _automodel_reason(model: str, table: dict[str, str]) -> str | None:
    """Why an AutoModel row is not run, from `table` keyed by its model's name or a prefix of it; None if none."""
    return next((why for key, why in table.items() if model.startswith(key)), None)


def automodel_runs() -> tuple[list[tuple[MoeRun, float]], list[tuple[str, str]]]:
    """NeMo AutoModel's H100 rows (the module docstring), each with its published tokens/s per GPU, and those not run,
    each named with why (`AUTOMODEL_NOT_EXPRESSIBLE`, or a pipeline cut its config does not give as printed)."""
    expressible, left_out = [], []
    for row in _rows(AUTOMODEL):
        t, p, gpus, batch, b, seq = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "gpus",
                                                           "global_batch", "microbatch_size", "seq_len"))
        chunks = 1 if row["virtual_pipeline"] == "-" else int(row["virtual_pipeline"])
        e = row["expert_parallel"]
        name = f"AutoModel {row['model']} {gpus} GPUs t{t} p{p} v{chunks} E{e}"
        why = _automodel_reason(row["model"], AUTOMODEL_NOT_EXPRESSIBLE)
        if why:
            left_out.append((name, why))
            continue
        preset = AUTOMODEL_PRESETS[row["model"]]
        pipelined: dict[str, int | str] = {}
        if p > 1:
            blocks = config_blocks(Path(__file__).resolve().parents[1], preset)  # wherever it runs
            stages = autopipeline_stages(blocks, int(row["layers_per_stage"]), p)
            if stages != p * chunks:
                left_out.append((name, f"the table prints v {chunks} where its config ({row['config']}) cuts "
                                       f"{stages} stages, v {stages // p} at p {p} (layers_per_stage "
                                       f"{row['layers_per_stage']}: functional.py calculate_virtual_stages): which "
                                       "cut ran is not known"))
                continue
            # torch.distributed.pipelining's stages keep FSDP2's weights gathered from a step's first forward to its
            # last backward (stage.py `backward_maybe_with_nosync`: set_reshard_after_backward and
            # set_requires_gradient_sync False until the last; reshard_after_forward False under pipelining,
            # parallelizer.py): ZeRO-3 as pipesim holds it in a pipeline. A step's local batch of
            # local_batch_size / microbatch_size micro-batches is one schedule.step, called gradient_accumulation
            # times before the optimizer's (train_ft.py: the step scheduler's local_batch_size batches,
            # functional.py's n_microbatches = local_batch_size // microbatch_size): `--rounds`
            pipelined = {"zero": 3, "pp_runtime": "torch", "stage_cut": autopipeline_layout(blocks, stages),
                         "rounds": int(row["gradient_accumulation"])}
        # FSDP2 over the t·C·d ranks with the experts sharded E ways, bfloat16 weights and torch Adam's bfloat16
        # moments, no master copy; without a pipeline each block's weights gathered once a step and kept
        # (reshard_after_forward False, fsdp_mixin.py's reshard_after_backward and requires_gradient_sync False
        # until the last micro-batch): ZeRO-2's timing; every block checkpointed whole (activation_checkpointing);
        # torch's autograd accumulating the gradients; TransformerEngine's attention, linears and RMSNorm; RoPE in
        # torch ops; the experts' grouped_gemm (ops.gmm, one kernel); DeepEP with FakeBalancedGate's even spread;
        # the loss torch's cross entropy in bfloat16 (MaskedCrossEntropy, fp32_upcast false)
        settings = {"zero": 2, **pipelined}
        run = MoeRun(name, preset, gpus, batch, b, seq, t, p, chunks, int(e), "deepep", 1, False, None, "balanced",
                     None, source=AUTOMODEL, precision="nemo-bf16-adam", rope_kernel="eager",
                     grad_accumulation="separate", recompute="full", cross_entropy="torch", expert_gemm="grouped",
                     **AUTOMODEL_KERNELS.get(row["model"], {}), **settings)
        expressible.append((run, float(row["tokens_per_s_per_gpu"])))
    return expressible, left_out


def runs() -> tuple[list[tuple[MoeRun, float]], list[tuple[str, str]]]:
    """Every source's rows as runs, each with its published tokens/s per GPU, and the rows pipesim cannot express,
    each named with why."""
    (zoo, zoo_left), (dgxc, dgxc_left), (cards, cards_left), (auto, auto_left) = (
        modelzoo_runs(), dgxc_runs(), card_runs(), automodel_runs())
    return bridge_runs() + zoo + dgxc + cards + auto, zoo_left + dgxc_left + cards_left + auto_left


def step_parts(result: dict) -> dict[str, float | int]:
    """A simulated step (`simulate --json`'s result) on its slowest device, ms a mini-batch: what it computes,
    what it waits on communication nothing hides (the all-to-alls, the gradients' collectives, stage transfers)
    and the rest idle (the pipeline's bubble): where a row's miss lies."""
    step, batches = result["time_per_minibatch_ms"], result["minibatches"]
    device = max(result["devices"], key=lambda d: d["busy_ms"] + d["exposed_comm_ms"])
    compute, exposed = device["busy_ms"] / batches, device["exposed_comm_ms"] / batches
    return {"device": device["device"], "compute_ms": compute, "exposed_comm_ms": exposed,
            "idle_ms": step - compute - exposed}


def rows(root: Path) -> list[dict]:
    """Every expressible row: its command, the predicted and published tokens/s per GPU, the error, its step's
    parts (`step_parts`) and its fullest device's memory (`fullest`), each once per command."""
    out, simulated, memory = [], {}, {}
    for run, published in runs()[0]:
        args = run.simulate_command(root)
        command = command_text(args)
        if command not in simulated:
            (simulated[command],) = json.loads(run_cli([*args, "--json"]))["results"]
            memory[command] = fullest(args)
        ms = simulated[command]["time_per_minibatch_ms"]
        predicted = run.global_batch * run.seq_len / (ms / 1e3 * run.gpus)
        out.append({"run": run.name, "source": run.source, "predicted_tokens_per_s_per_gpu": predicted,
                    "published_tokens_per_s_per_gpu": published, "error": predicted / published - 1,
                    "command": command, "command_ms": ms, "parts": step_parts(simulated[command]),
                    "memory": memory[command]})
    return out


def print_rows(compared: list[dict], console: Console = stdout) -> None:
    """The rows as a table (commands/tables.py: at the terminal's width nothing cut, piped one line a row), the
    |error| per source, what is not expressible or modelled, then each command with its rows, memory and step, each
    line whole piped and on a terminal wrapped between words (`print_message`), where a terminal of 80 columns broke
    a command inside a flag. `compared`: `rows`, as benchmarks/published_moe.json holds them."""
    table = Table(title=f"Tokens/s per GPU on {GPU}: predicted against NVIDIA's published")
    for name, justify in (("run", "left"), ("predicted", "right"), ("published", "right"), ("error", "right")):
        table.add_column(name, justify=justify)
    for r in compared:
        table.add_row(r["run"], f"{r['predicted_tokens_per_s_per_gpu']:,.0f}",
                      f"{r['published_tokens_per_s_per_gpu']:,.0f}", f"{r['error']:+.1%}")
    print_table(table, console)
    lines = [f"|error|: {summary(compared)}"]
    lines += [f"  {source}: {summary([r for r in compared if r['source'] == source])}"
              for source in (SOURCE, MODELZOO, DGXC, CARDS, AUTOMODEL)]
    lines += ["\nNot expressible:", *(f"{name}: {why}" for name, why in runs()[1])]
    lines += ["\nRun without what their recipe sets and pipesim does not model:",
              *(f"{model}: {what}" for model, what in RECIPE_NOT_MODELLED.items())]
    lines += ["\nRun with what their run does otherwise:",
              *(f"AutoModel {model}: {what}" for model, what in AUTOMODEL_NOT_MODELLED.items()),
              *(f"DGXC {model}: {what}" for model, what in DGXC_OTHERWISE.items())]
    lines += ["\nRun as their release's recipe ran them, not as printed:",
              *(f"{container} {model}: {why}" for (container, model), (_, why) in RELEASE_LAYOUTS.items())]
    lines.append("\nThe commands, each with its rows (tokens/s per GPU: global batch x sequence over its ms/step x "
                 "GPUs):")
    for command in dict.fromkeys(r["command"] for r in compared):
        ran = [r for r in compared if r["command"] == command]
        fullest_device, parts = ran[0]["memory"], ran[0]["parts"]
        fits = "out of memory" if fullest_device["out_of_memory"] else "fits"
        published_ms = ran[0]["command_ms"] * (1 + ran[0]["error"])  # the first row's, from its tokens/s
        lines += [f"{', '.join(r['run'] for r in ran)}:", f"  {command}",
                  f"  peak {fullest_device['peak_mib']:,.0f} MiB of {fullest_device['limit_mib']:,.0f} on device "
                  f"{fullest_device['device']}: {fits}",
                  f"  step {ran[0]['command_ms'] / 1e3:,.2f} s (the first row published {published_ms / 1e3:,.2f} s) "
                  f"on device {parts['device']}: compute {parts['compute_ms'] / 1e3:,.2f} s, exposed communication "
                  f"{parts['exposed_comm_ms'] / 1e3:,.2f} s, idle {parts['idle_ms'] / 1e3:,.2f} s"]
    print_message("\n".join(lines), console)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    compared = rows(Path.cwd())
    print_rows(compared)
    write_json(args.json, {"gpu": GPU, "rows": compared})


if __name__ == "__main__":
    main()
