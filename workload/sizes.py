"""The built-in models' default sizes and the choices their count takes, apart from their torch code
(workload/models.py builds with them, workload/count.py counts with them), so that the command line can show and
check them without importing torch."""

DEFAULT_SIZES: dict[str, dict[str, int]] = {
    "mlp": {"layers": 8, "width": 512},
    "cnn": {"layers": 6, "width": 32},
    "gpt": {"layers": 4, "width": 256, "heads": 4, "seq_len": 128, "vocab": 2048},
    "two-branch": {"layers": 2, "width": 32},
}

CROSS_ENTROPY = ("torch", "megatron")  # whose cross entropy a model's loss runs (workload/count.py `count_model`)
NORM_KERNELS = ("eager", "fused")  # how a Hugging Face model's RMSNorms run (workload/norms.py)
ROPE_KERNELS = ("eager", "fused")  # how a Hugging Face model's rotary position embedding runs (workload/rope.py)
