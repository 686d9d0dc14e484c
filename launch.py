"""How this process was started: by torchrun as one rank of its job, or as a command of its own. A leaf module
(it imports only the standard library), so that the executor, the commands and the host's load record
(traces/hostload.py) ask one place."""

import os

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")  # what torchrun sets for each rank it starts


def under_torchrun() -> bool:
    """Whether torchrun started this process as one rank of its job (which then starts no ranks itself)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def speaks_for_host() -> bool:
    """Whether this process prints a refusal of bad input: any process torchrun did not start, and of those it
    started the first on each host (LOCAL_RANK 0); the others run the same command line on the same files, and
    each printed the same line again."""
    return not under_torchrun() or os.environ.get("LOCAL_RANK") == "0"
