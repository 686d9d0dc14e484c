"""`--p2p-sync`: Megatron-core's batched point-to-point synchronises the device after each exchange between stages
(p2p_communication.py `_communicate` under batch_p2p_comm and batch_p2p_sync), so a pass whose input a stage
receives starts with its host not ahead, whether or not its layers synchronise (profiles/schema.py
`stage_host_waits_ms`, the same max-plus composition as a synchronising layer's stage)."""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import pytest

from benchmarks.published_runs import korthikanti_runs, megatron_runs
from pipesim.planning.host import carried_waits_ms, pass_issue
from pipesim.profiles.schema import LayerProfile, stage_host_waits_ms
from pipesim.schedules import METHODS
from tests.conftest import estimate_json, pipesim, simulate_json
from tests.helpers import DEEPEP_GPT_FLAGS as MOE
from tests.helpers import host_floor_ms as floor_ms
from tests.helpers import random_pass as _random_pass

REPO = Path(__file__).resolve().parents[1]
DENSE = ("--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 512, "--gpu", "h100-sxm",
         "--stages", 2, "--host-kernel-us", 1000)


def test_a_received_pass_starts_from_an_empty_queue_without_a_synchronising_layer():
    """Layers that never synchronise: under p2p_sync a stage's forward (but the first stage's) and backward (but the
    last stage's) compose their layers from the host not ahead, `carried_waits_ms` over its own layers; a pass it
    receives nothing for, or any pass without p2p_sync, only for its issue beyond its GPU time (`floor_ms`), less
    what its layers' times hold."""
    rng = random.Random(41)
    for _ in range(40):
        count = rng.randint(2, 7)
        forward, backward = ([_random_pass(rng, False) for _ in range(count)] for _ in range(2))
        carried = {"fwd": carried_waits_ms(forward, False), "bwd": carried_waits_ms(backward, True)}
        layers = [LayerProfile.model_construct(host_issue={
            "fwd": pass_issue(forward[i], carried["fwd"][i]), "bwd": pass_issue(backward[i], carried["bwd"][i])})
            for i in range(count)]
        start = rng.randrange(count)
        stop = rng.randint(start + 1, count)
        for name, passes, received in (("fwd", forward, start > 0), ("bwd", backward, stop < count)):
            held_ms = sum(carried[name][start:stop])
            own_ms = sum(carried_waits_ms(passes[start:stop], name == "bwd"))
            assert stage_host_waits_ms(layers, start, stop, name) == pytest.approx(
                floor_ms(passes[start:stop]) - held_ms, abs=1e-9)
            assert stage_host_waits_ms(layers, start, stop, name, p2p_sync=True) == pytest.approx(
                (own_ms if received else floor_ms(passes[start:stop])) - held_ms, abs=1e-9)


def _stages(tmp_path: Path, *args, host_kernel_us: float = 1000) -> list[dict]:
    return estimate_json(tmp_path, *DENSE[:-2], "--host-kernel-us", host_kernel_us, *args)["stages"]


def test_a_dense_pipeline_waits_for_its_host_where_a_stage_receives(tmp_path):
    """A dense model at 5 us a kernel, near the GPU's pace: without --p2p-sync each stage's pass takes the longer of
    its GPU time and its issue; with it the second stage's forward (after receiving the activations) and the first's
    backward (after receiving the gradient) start from an empty queue, their host-heavy kernels before GPU-heavy
    ones adding their times, and the first's forward and the last's backward do not. At 1 ms a kernel every pass
    is its issue either way, the synchronisation adding its last kernel's GPU time at most."""
    queued, synced = (_stages(tmp_path, *args, host_kernel_us=5) for args in ((), ("--p2p-sync",)))
    assert synced[0]["fwd_ms"] == pytest.approx(queued[0]["fwd_ms"], abs=1e-12)
    assert synced[1]["bwd_ms"] == pytest.approx(queued[1]["bwd_ms"], abs=1e-12)
    assert synced[1]["fwd_ms"] > 1.03 * queued[1]["fwd_ms"] and synced[0]["bwd_ms"] > 1.01 * queued[0]["bwd_ms"]
    queued, synced = _stages(tmp_path), _stages(tmp_path, "--p2p-sync")
    for quiet, waited in zip(queued, synced, strict=True):
        for name in ("fwd_ms", "bwd_ms"):
            assert quiet[name] == pytest.approx(round(quiet[name])) and 0 <= waited[name] - quiet[name] < 0.01
    code, out, err = pipesim("simulate", *DENSE[:-4], "-p", 2, "-m", 4, "-s", "1f1b", "--host-kernel-us", 1000,
                             "--p2p-sync")
    assert code == 0, err
    assert "p2p sync" in " ".join(out.split())


def test_p2p_sync_without_an_estimate_is_one_line():
    code, out, err = pipesim("simulate", "--fwd", "1,1", "--bwd", "2,2", "-m", 4, "--p2p-sync")
    assert code == 2 and not out and err.count("\n") == 1 and "--p2p-sync" in err and "Traceback" not in err


def test_the_moe_rows_synchronise_exactly_where_their_pipeline_has_no_virtual_stages():
    """NeMo's and Megatron-Bridge's comm-overlap configs set batch_p2p_comm where p > 1 and v = 1 and overlap the
    exchanges unbatched with virtual stages; Megatron-LM's arguments.py the same (published_moe.py
    `MoeRun.simulate_command`)."""
    rows = json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
    for row in rows:
        args = shlex.split(row["command"])
        plain = args[args.index("-s") + 1] == "1f1b" and int(args[args.index("-p") + 1]) > 1
        assert ("--p2p-sync" in args) == plain, row["run"]
    synced = [row["run"] for row in rows if "--p2p-sync" in row["command"]]
    assert len(synced) == 7 and sum("DeepSeek-V3" in run for run in synced) == 2, synced  # and gpt-oss's five, p4 v1


SYNCED = [name for name, method in METHODS.items() if method.p2p_sync]
UNMODELLED = [name for name in METHODS if name not in SYNCED]


@pytest.mark.parametrize("command", [("simulate", "-m", 4, "-p", 2, *(arg for name in UNMODELLED
                                                                     for arg in ("-s", name))),
                                     ("sweep", "-m", 4, "-p", 2, "-s", ",".join(UNMODELLED)),
                                     ("tune", "-D", 2, "-s", ",".join(UNMODELLED))])
def test_p2p_sync_with_a_schedule_it_does_not_model_is_one_line(command):
    """Megatron-core runs 1F1B with a synchronisation before each pass a stage receives the input of; it runs no
    zero-bubble, V-shaped, DualPipe or asynchronous order, and synchronises its interleaved one after each
    forward-backward pair: each such method given is refused, naming those the catalogue marks (`Method.p2p_sync`),
    which run."""
    assert SYNCED == ["1f1b"]
    code, out, err = pipesim(*command, *DENSE[:-4], "--p2p-sync")
    assert code == 2 and not out and err.count("\n") == 1 and "Traceback" not in err
    assert (f"--p2p-sync: Megatron-core's synchronising exchange is modelled for 1f1b only, not "
            f"{', '.join(UNMODELLED)}: give --schedule 1f1b") in err
    (synced,) = simulate_json(*DENSE, "-m", 4, "-s", ",".join(SYNCED), "--p2p-sync")
    assert synced["schedule"] == "1f1b"


def test_a_profile_estimated_with_p2p_sync_is_refused_for_a_schedule_it_does_not_model(tmp_path):
    out = tmp_path / "synced.json"
    assert pipesim("estimate", *DENSE, "--p2p-sync", "-o", out)[0] == 0
    for command in (("simulate", "-m", 4, "-s", "1f1b", "-s", "zb-h1"), ("sweep", "-m", 4, "-s", "zb-h1"),
                    ("tune", "-D", 2, "-s", "zb-h1")):
        code, printed, err = pipesim(*command, "--profile", out)
        assert code == 2 and not printed and err.count("\n") == 1, command
        assert ("--profile (estimated with --p2p-sync): Megatron-core's synchronising exchange is modelled for 1f1b "
                "only, not zb-h1") in err, command


def test_the_overlapped_pair_meets_p2p_sync_on_one_stage_only_which_exchanges_nothing():
    """Megatron-core pairs a forward with a backward (--overlap-expert-comm) over a pipeline only with virtual
    stages (transformer_config.py at 0d8e0714cd), whose synchronisations --p2p-sync does not model (refused above,
    and pipesim refuses the pair in 1F1B over two stages or more): on one stage, host-bound, nothing changes."""
    host_bound = (*MOE[:-1], 1000)
    (paired,), (synced,) = (simulate_json(*host_bound, "--overlap-expert-comm", *flag)
                            for flag in ((), ("--p2p-sync",)))
    assert paired["time_per_minibatch_ms"] == synced["time_per_minibatch_ms"]
    two_stages = [2 if i and host_bound[i - 1] == "-p" else arg for i, arg in enumerate(host_bound)]
    code, _, err = pipesim("simulate", *two_stages, "--overlap-expert-comm", "--p2p-sync")
    assert code == 2 and "only with virtual stages" in err


def test_the_published_megatron_lm_runs_synchronise_where_pipesim_models_it():
    """Megatron-LM of 2021-2022 synchronised the device after every exchange between stages (p2p_communication.py
    `_communicate`): the published runs pass --p2p-sync in 1F1B over two stages or more, and not interleaved,
    whose synchronisations pipesim does not model."""
    runs = [run for run, _ in (*korthikanti_runs(), *megatron_runs())]
    for run in runs:
        args = run.simulate_command(False, "full")
        assert ("--p2p-sync" in args) == (args[args.index("-s") + 1] == "1f1b" and run.pipeline > 1), run.name
    assert sum("--p2p-sync" in run.simulate_command(False, "full") for run in runs) == 3


@pytest.mark.parametrize("command", [("simulate", "-m", 4, "-p", 2), ("sweep", "-m", 4, "-p", 2), ("tune", "-D", 2)])
def test_p2p_sync_with_torchs_pipelining_is_one_line(command):
    """torch.distributed.pipelining waits for its exchanges on the stream, never the host (schedules.py
    `_wait_batch_p2p`): --p2p-sync, Megatron-core's synchronising exchange, means nothing under --pp-runtime torch."""
    code, out, err = pipesim(*command, *DENSE[:-4], "--pp-runtime", "torch", "--p2p-sync")
    assert code == 2 and not out and err.count("\n") == 1 and "--p2p-sync" in err and "--pp-runtime torch" in err


def test_a_profile_estimated_with_p2p_sync_under_torchs_pipelining_is_one_line(tmp_path):
    """An estimate records --p2p-sync in its costs (`stages_for` reads it back): simulating it under --pp-runtime
    torch is the same contradiction, refused alike by each command that takes both."""
    out = tmp_path / "synced.json"
    code, _, err = pipesim("estimate", *DENSE, "--p2p-sync", "-o", out)
    assert code == 0, err
    for command in (("simulate", "-m", 4), ("sweep", "-m", 4), ("tune", "-D", 2)):
        code, printed, err = pipesim(*command, "--profile", out, "--pp-runtime", "torch")
        assert code == 2 and not printed and err.count("\n") == 1 and "--p2p-sync" in err, command
    assert pipesim("simulate", "-m", 4, "-s", "1f1b", "--profile", out)[0] == 0


def test_a_schedule_file_is_refused_with_p2p_sync_whatever_it_is_named(tmp_path):
    """A schedule file's order is torch's CSV as written, not the catalogue's 1F1B, even in a file named 1f1b.csv
    (its method is the file's name): --p2p-sync is refused, naming the file."""
    order = (REPO / "examples" / "order.csv").read_text()
    for name in ("1f1b", "mine"):
        path = tmp_path / f"{name}.csv"
        path.write_text(order)
        code, out, err = pipesim("simulate", *DENSE[:-4], "--schedule-file", path, "--p2p-sync")
        assert code == 2 and not out and err.count("\n") == 1, err
        assert f"modelled for 1f1b only, not --schedule-file {path}: give --schedule 1f1b" in err


def test_simulate_refuses_p2p_sync_for_a_method_it_does_not_model_before_counting_the_model():
    """The flag's refusal needs no estimate: it comes before the model is counted, whose own refusal (heads that do
    not divide the width) would otherwise be the line printed, after the count's seconds."""
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 3, "--gpu",
                             "h100-sxm", "-p", 2, "-s", "gpipe", "--p2p-sync")
    assert code == 2 and not out and err.count("\n") == 1
    assert "--p2p-sync: Megatron-core's synchronising exchange is modelled for 1f1b only, not gpipe" in err
