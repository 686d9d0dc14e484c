"""pipesim's own per-flag value refusals read as the option parser's do since 9b4e6eed: "FLAG: give WHAT IS
ALLOWED (got VALUE)", the value as typed with whole numbers grouped in thousands, any advice after it."""
from pathlib import Path

import pytest

from tests.conftest import pipesim
from tests.helpers import GPT_CPU

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NANOSECOND = "give 0 or at least 1e-06 ms, a nanosecond, as the simulator counts picoseconds"


@pytest.mark.parametrize(("args", "refusal"), [
    (["--bwd", "fast"], "--bwd: give a number or comma-separated numbers (got 'fast')"),
    (["--fwd", "1,-1"], "--fwd: give a finite number from 0 to 1,000,000,000 (got -1)"),
    (["--comm", "inf"], "--comm: give a finite number from 0 to 1,000,000,000 (got inf)"),
    (["--comm", "2000000000"], "--comm: give a finite number from 0 to 1,000,000,000 (got 2,000,000,000)"),
    (["--comm", "1,2"], "--comm: give one number of milliseconds (got '1,2')"),
    (["--fwd", "1e-9"], f"--fwd: {NANOSECOND} (got 1e-9)"),
    (["--activation-mb", "-5"], "--activation-mb: give a finite number from 0 to 1,073,741,824 (got -5)"),
    (["--param-mb", "600000000"], "--param-mb: give a finite number from 0 to 536,870,912 (got 600,000,000): MiB "
                                  "of weights, whose gradients and adam state under --precision fp32 take up to 2 "
                                  "times their bytes, and a size is at most 1,073,741,824 MiB"),
    (["-s", "avgpipe", "--opt", "1e-12"], f"--opt: {NANOSECOND} (got 1e-12)"),
])
def test_a_value_refusal_reads_as_the_parsers(args, refusal):
    code, out, err = pipesim("simulate", *(args if "-s" in args else ["-s", "1f1b", *args]))
    assert (code, out) == (2, "")
    assert err == f"error: {refusal}\n"


@pytest.mark.parametrize(("args", "refusal"), [
    (["study", "--optimizer", "lion"], "--optimizer: choose from sgd, momentum, adam, adamw (got 'lion'); "
                                       "each optionally as NAME=LR"),
    (["study", "--optimizer", "adam=x"], "--optimizer: give NAME=LR with a finite learning rate above 0 (got "
                                         "'adam=x')"),
    (["study", "--optimizer", "sgd", "--optimizer", "sgd=0.1"], "--optimizer: give each optimizer once (got 'sgd' "
                                                                "twice)"),
    (["tune", "--profile", GPT_CPU, "--devices", "4", "--batch-size", "12"],
     "--batch-size: give a multiple of the profile's micro-batch size 8, at which its times were measured (got 12)"),
    (["tune", "--gpu", "h100-sxm", "--model", "gpt", "--devices", "4", "--microbatch-size", "4", "--batch-size",
      "10"], "--batch-size: give a multiple of --microbatch-size 4 (got 10)"),
    (["tune", "--gpu", "h100-sxm", "--model", "gpt", "--devices", "6", "--tensor-parallel", "4"],
     "--devices: give p stages x d replicas x t GPUs per stage, a multiple of --tensor-parallel 4 (got 6); give "
     "--devices 4 or 8, or --tensor-parallel 2"),  # 3 and 6 divide 6 but not the gpt's 4 heads
    (["tune", "--profile", GPT_CPU, "--devices", "4", "--data-parallel", "3"],
     "--devices: give p x d, a multiple of 3 at --data-parallel 3 (got 4)"),
    (["simulate", "-s", "1f1b", "--data-parallel", "2", "--network-gb-s", "0"],
     "--network-gb-s: give a finite number above 0 (got 0)"),
    (["simulate", "-s", "1f1b", "--data-parallel", "2", "--network-gb-s", "inf"],
     "--network-gb-s: give a finite number above 0 (got inf)"),
    (["run", "-s", "auto", "--model", "mlp", "--fwd", "1", "--bwd", "2", "--search-seconds", "86401"],
     "--search-seconds: give a finite number above 0 and at most 86,400 (got 86,401)"),
    (["calibrate", "--model", "mlp", "--link-max-mb", "0", "-o", "never.json"],
     "--link-max-mb: give from 8 KiB (0.0078125 MiB: two sizes to fit a line) to 4,096 MiB (got 0)"),
    (["study", "--layers", "2", "--stages", "4", "-m", "8"],
     "--stages 4: mlp of 2 blocks (--layers) has 3 layers in all; give at most 3 stages (each needs at least one "
     "layer)"),
    (["sweep", "--ray", "127.0.0.1:99999"], "--ray: give auto, local, HOST:PORT or ray://HOST:PORT, with a port "
                                            "from 0 to 65,535 (got '127.0.0.1:99999')"),
    (["tune", "--profile", GPT_CPU, "--devices", "4", "--max-pipelines", "17"],
     "--max-pipelines: give a whole number from 1 to 16 (got 17): each pipeline takes at least one of the step's 16 "
     "micro-batches (128 samples, --batch-size, of 8 each)"),
    (["simulate", "-s", "graphpipe", "--graph", EXAMPLES / "dag.json", "-p", "3"],
     "--stages: give 6, the --graph file's stages (graphpipe's p), or leave it out (got 3)"),
    (["tune", "--profile", GPT_CPU, "--devices", "64", "--data-parallel", "2"],
     "--data-parallel: give at least 4, so that p = 64/d devices a pipeline is at most the profile's 16 layers "
     "(got 2)"),
    (["run", "-s", "1f1b", "-p", "2", "-m", "2", "--model", "gpt", "--stall-timeout", "0"],
     "--stall-timeout: give a finite number from 1 to 86,400 (got 0)"),
    # the parent hears of progress at the ranks' heartbeats (0.2 s): a run at 0.03 s was stopped as stalled after
    # it had run every row
    (["run", "-s", "1f1b", "-p", "2", "-m", "2", "--model", "gpt", "--stall-timeout", "0.03"],
     "--stall-timeout: give a finite number from 1 to 86,400 (got 0.03)"),
])
def test_a_commands_own_refusal_reads_as_the_parsers(args, refusal):
    code, out, err = pipesim(*args)
    assert (code, out) == (2, "")
    assert err == f"error: {refusal}\n"


def test_tune_refuses_more_devices_than_a_catalogue_cluster_has_as_the_parser_would(tmp_path):
    catalogue = tmp_path / "mine.toml"
    catalogue.write_text('[cluster.mine]\ngpu = "a100-sxm-80gb"\nnodes = 2\ngpus_per_node = 4\n')
    code, out, err = pipesim("tune", "--gpu", "mine", "--gpus", catalogue, "--model", "gpt", "--devices", "16")
    assert (code, out) == (2, "")
    assert err == "error: --devices: give at most 8, the GPUs of the cluster --gpu mine (got 16)\n"
