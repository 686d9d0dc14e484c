"""DeepSeek-V3's own pre-training run (benchmarks/published/deepseek-v3-2024.csv, from its technical report, arXiv
2412.19437) predicted by one pipesim command line, nothing fitted.

The command is built from the row's columns and the model's Hugging Face config (examples/deepseek-v3), each
setting as the report gives it: 2,048 H800s (`--gpu h800`), no tensor parallelism, 16 pipeline stages run by the
bidirectional DualPipe of its section 3.2.1 and figure 5 (`-s dualpipe`: two copies of the model fed from both
ends; not DualPipeV, which came later in deepseek-ai/DualPipe), the routed experts of each layer over 64 GPUs of 8
nodes (`--expert-parallel 64 --rank-order megatron`: an expert group is 64 consecutive ranks, 8 a node), DeepEP's
dispatch (`--token-dispatcher deepep`: once over IB to each node, forwarded over NVLink, section 3.2.2; each token
to at most 4 of the 8 nodes, M = 4, read from the config's n_group 8 and topk_group 4, a group a node), ZeRO-1 over
the 128 replicas (`--zero 1`), FP8 products with FP8 inputs cached for the backward and weights quantized once a
step, the attention's output cached once in E5M6 and the MoE SwiGLU inputs in FP8 (`--dtype fp8 --fp8-recipe
deepseek`, sections 3.3.2 and 3.3.3), every RMSNorm and MLA's up-projections recomputed in the backward (section
3.2.3) and the SwiGLU's output too (3.3.3: "cache the inputs of the SwiGLU operator and recompute its output";
`--recompute-modules layernorm,mla_up_proj,moe_act`), the EMA of the weights on the host (`--ema cpu`, section
3.2.3), 16-bit weights with FP32 gradients and master weights and
AdamW's moments in BF16 (`--precision megatron-bf16-moments`, section 3.3.3), each backward's weight gradients
added to the FP32 ones in a pass of their own (`--grad-accumulation separate`: the report says the gradients are
accumulated in FP32, not whether its framework fuses that into the weight-gradient products as Megatron's
gradient_accumulation_fusion does, so the row keeps the pass it was priced with; docs/hardware.md gives both),
the multi-token-prediction module at depth 1 on the last stage (`--mtp-layers 1`: section 2.2's module, one more
MoE decoder layer and a 2h -> h projection reading the main model's embedding and head, which 3.2.3 shares on the
rank holding both; 4.2: "The multi-token prediction depth D is set to 1"),
4,096-token sequences and 15,360 of them a step (the batch after its ramp over the first 469B of 14.8T tokens).
The report states no micro-batch size: one sequence (`MICROBATCH_SIZE`), so a pipeline runs 120 micro-batches a
step. Nor does it give the layers each stage holds: the run ran within the H800's 80 GB, so the row is cut as a
planner would cut it, the slowest stage as fast as it can be with every device holding its two stages (DualPipe's
stage i of one copy and 15 - i of the other) within its memory (`--stage-cut fit`; the time-balanced cut alone
gives stage 0 five layers, 94,531 MiB at device 0's peak). What no flag expresses is in
`NOT_MODELLED`.

Published: 180K H800 GPU hours per trillion tokens, so 10^12 tokens / (180,000 GPU h x 3,600 s/h) = 1,543 tokens/s
per GPU (the report's own "3.7 days on our cluster with 2048 H800 GPUs" gives 1,527). It is the whole pre-training's
average (the batch ramp, checkpoints and anything else the run spent included), so the steady step it is held
against can only be as fast or faster. Predicted: the global batch's tokens over the simulated step and the GPUs.

    python benchmarks/published_deepseek.py                 # the row, what is not modelled, its command
    python benchmarks/published_deepseek.py --json out.json # and the row as JSON
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from one_line_parser import OneLineParser  # this folder's
from published_memory import fullest
from published_runs import _rows, command_text, iteration_ms
from rich.console import Console
from rich.table import Table

from pipesim.commands.common import refuse_unwritable, stdout, write_json
from pipesim.commands.tables import print_message, print_table

SOURCE = "deepseek-v3-2024.csv"  # benchmarks/published/README.md: its source and the report's sentences
GPUS = {"H800": "h800"}  # the row's GPU -> the catalogue's (hardware/gpus.toml, with its sources)
SCHEDULES = {"DualPipe": "dualpipe"}  # the row's pipeline schedule -> pipesim's
MICROBATCH_SIZE = 1  # not in the report
RECOMPUTED = "layernorm,mla_up_proj,moe_act"  # sections 3.2.3 and 3.3.3 (the module docstring)
MTP_DEPTH = 1  # section 4.2: "The multi-token prediction depth D is set to 1"
NOT_MODELLED = {
    "stage cut": "the layers each of the 16 stages holds are not published: --stage-cut fit is pipesim's "
                 "planner's, the time-balanced cut within each device's 80 GB as the simulator holds it, a split "
                 "backward's weight-pass inputs and gradients from I until W included, a device's two stages by "
                 "their coincident peak (docs/hardware.md: 4 layers on stages 0 to 14, 5 on stage 15, 4 MoE layers "
                 "a middle stage as DeepSeek's profile-data gives a chunk; 80,080 MiB on devices 7 and 8)",
    "DeepEP's buffers": "its Buffer's NVLink and RDMA buffers, held for the run, are not counted: 681 MiB a rank "
                        "at 64 ranks, 20 SMs and 7,168 16-bit hidden values, by deepseek-ai/DeepEP's size hints "
                        "(csrc/legacy/config.hpp) at its 64-rank dispatch and combine configs "
                        "(deep_ep/buffers/legacy.py); device 7 would hold 80,761 MiB",
    "DeepSeek's dispatcher": "its own framework's handling of what DeepEP delivers is not published: priced as "
                             "Megatron-core's DeepEP path runs it, the received top-k indices converted into each "
                             "local expert's routing map (planning/experts.py `ExpertGroup.multihot_conversion`, 12 "
                             "kernels a MoE layer's forward, 3 a backward pass): 21 ms of the step its run may not "
                             "have",
    "fine-grained FP8": "1x128 activation tiles and 128x128 weight blocks with FP32 promotion every 128 products "
                        "(section 3.3.2), the dispatch sent in FP8 (3.3.3): their casts priced as TransformerEngine's "
                        "per-tensor recipe's, the dispatch in 16 bits (what it keeps is modelled: --fp8-recipe "
                        "deepseek)",
}


@dataclass(frozen=True)
class DeepSeekRun:
    """The row's layout and published throughput."""

    gpus: int
    gpu: str  # the catalogue's name
    global_batch: int
    seq_len: int
    tensor: int
    pipeline: int
    expert: int
    schedule: str  # pipesim's name
    gpu_hours_per_trillion_tokens: float

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def published_tokens_per_s_per_gpu(self) -> float:
        return 1e12 / (self.gpu_hours_per_trillion_tokens * 3600)

    def simulate_command(self) -> list[str]:
        """One step as the module docstring says, run from the repository root (the config is examples/)."""
        return ["simulate", "--model", "hf:examples/deepseek-v3", "--seq-len", str(self.seq_len), "--dtype", "fp8",
                "--fp8-recipe", "deepseek", "--attention", "flash", "-b", str(MICROBATCH_SIZE), "--gpu", self.gpu,
                "--tensor-parallel", str(self.tensor), "-p", str(self.pipeline),
                "-m", str(self.global_batch // (self.data * MICROBATCH_SIZE)), "--data-parallel", str(self.data),
                "--expert-parallel", str(self.expert), "--zero", "1", "--precision", "megatron-bf16-moments",
                "--grad-accumulation", "separate", "--recompute", "none", "--recompute-modules", RECOMPUTED,
                "--ema", "cpu", "--mtp-layers", str(MTP_DEPTH), "-s", self.schedule,
                "--stage-cut", "fit", "--rank-order", "megatron", "--expert-tensor-parallel", "1",
                "--token-dispatcher", "deepep"]


def run() -> DeepSeekRun:
    """The CSV's row as a run; a setting the command does not build as the row gives it is an error."""
    (row,) = _rows(SOURCE)
    if (row["data_parallel"], row["precision"], row["routed_nodes_per_token"]) != ("ZeRO-1", "FP8", "4"):
        raise ValueError(f"{SOURCE}: the command builds ZeRO-1, FP8 and (not modelled) M = 4, not {row}")
    gpus, expert, nodes = int(row["gpus"]), int(row["expert_parallel"]), int(row["expert_nodes"])
    if expert // nodes != 8:
        raise ValueError(f"{SOURCE}: {expert} expert ranks over {nodes} nodes is not 8 a node, as the H800's")
    return DeepSeekRun(gpus, GPUS[row["gpu"]], int(row["global_batch"]), int(row["sequence_length"]),
                       int(row["tensor_parallel"]), int(row["pipeline_parallel"]), expert,
                       SCHEDULES[row["schedule"]], float(row["gpu_hours_per_trillion_tokens"]))


def compared() -> dict:
    """The row: its command, predicted and published tokens/s per GPU, the error and its fullest device."""
    deepseek = run()
    args = deepseek.simulate_command()
    ms = iteration_ms(args)
    predicted = deepseek.global_batch * deepseek.seq_len / (ms / 1e3 * deepseek.gpus)
    published = deepseek.published_tokens_per_s_per_gpu
    return {"run": f"DeepSeek-V3 p{deepseek.pipeline} E{deepseek.expert} d{deepseek.data} {deepseek.schedule}",
            "predicted_tokens_per_s_per_gpu": predicted, "published_tokens_per_s_per_gpu": published,
            "error": predicted / published - 1, "command": command_text(args), "command_ms": ms,
            "memory": fullest(args)}


def print_row(row: dict, console: Console = stdout) -> None:
    """The row as a table (commands/tables.py), what is not modelled, and its command with its step and memory,
    every line whole piped and on a terminal wrapped between words (`print_message`), where a terminal of 80
    columns broke the command inside a flag. `row`: `compared`'s, as benchmarks/published_deepseek.json holds it."""
    table = Table(title="Tokens/s per GPU on h800: predicted against DeepSeek-V3's report")
    for name, justify in (("run", "left"), ("predicted", "right"), ("published", "right"), ("error", "right")):
        table.add_column(name, justify=justify)
    table.add_row(row["run"], f"{row['predicted_tokens_per_s_per_gpu']:,.0f}",
                  f"{row['published_tokens_per_s_per_gpu']:,.0f}", f"{row['error']:+.1%}")
    print_table(table, console)
    memory = row["memory"]
    fits = "out of memory" if memory["out_of_memory"] else "fits"
    print_message("\n".join(("\nNot modelled:", *(f"{what}: {why}" for what, why in NOT_MODELLED.items()),
                             "\nThe command (tokens/s per GPU: global batch x sequence over its ms/step x GPUs):",
                             f"  {row['command']}", f"  {row['command_ms']:,.1f} ms/step; peak "
                             f"{memory['peak_mib']:,.0f} MiB of {memory['limit_mib']:,.0f} on device "
                             f"{memory['device']}: {fits}")), console)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the row as JSON here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    row = compared()
    print_row(row)
    write_json(args.json, row)


if __name__ == "__main__":
    main()
