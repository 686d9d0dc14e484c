"""The built-in models' default sizes, apart from their torch code (workload/models.py builds with them), so
that the command line's help can show them without importing torch."""

DEFAULT_SIZES: dict[str, dict[str, int]] = {
    "mlp": {"layers": 8, "width": 512},
    "cnn": {"layers": 6, "width": 32},
    "gpt": {"layers": 4, "width": 256, "heads": 4, "seq_len": 128, "vocab": 2048},
    "two-branch": {"layers": 2, "width": 32},
}
