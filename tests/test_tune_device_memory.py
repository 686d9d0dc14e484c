"""tune cuts a device's stages to fit its memory together, as `simulate` holds them: a V's first stage (the most
micro-batches in flight) may take more than half a device whose last stage is light. Held to an even share a
stage, Llama 3.1 8B's DualPipeV at p = 2 lost 4.6 % a step to a cut that simulate's balanced one beats and fits."""

import json
from pathlib import Path

import pytest

from tests.conftest import needs_transformers, pipesim, simulate_json

LLAMA_8B = Path(__file__).resolve().parents[1] / "examples" / "llama3.1-8b"
LAYOUT = ("--gpu", "h100-sxm", "--model", f"hf:{LLAMA_8B}", "--seq-len", 8192, "--tensor-parallel", 2,
          "--sequence-parallel", "-b", 1, "--recompute", "none", "--data-parallel", 2)


@needs_transformers
def test_a_v_shapes_stages_share_their_devices_memory():
    code, out, err = pipesim("tune", *LAYOUT, "-D", 8, "-s", "dualpipev", "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    simulated = simulate_json(*LAYOUT, "-p", choice["stages"], "-m", choice["microbatches"], "-s", "dualpipev")[0]
    assert simulated["peak_memory_mb"] <= 80 * 1024  # simulate's balanced cut fits the device
    assert choice["partition"] == simulated["stage_bounds"]
    assert choice["step_ms"] <= simulated["time_per_minibatch_ms"]


GPT_16K = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--width", 1024, "--heads", 8, "--seq-len", 16384,
           "--vocab", 32000, "--attention", "flash", "-s", "dualpipev", "-b", 1, "--recompute", "none",
           "--tensor-parallel", 1)


def test_where_no_cut_for_time_fits_the_leanest_cut_that_fits_is_the_answer():
    """The partitioner holds a cut to the cap by the tensors it counts; the caching allocator's reserve then takes
    DualPipeV's cut for time to 14.4 GiB, over 13, where its leanest cut peaks at 11.4. tune refused, saying that the
    least any configuration needs is 11.4 GiB, under the cap it refused; it answers with that cut, the time cut
    the 'over' row beside it."""
    code, out, err = pipesim("tune", *GPT_16K, "-D", 2, "--memory-gb", 13, "--json")
    assert code == 0, err
    document = json.loads(out)
    choice, over = document["choice"], document["excluded"]
    assert choice["peak_memory_gib"] <= 13 < over[0]["peak_memory_gib"]
    assert choice["samples_per_s"] < over[0]["samples_per_s"]
    assert any("the fastest configuration that fits on its leanest cut" in note for note in document["notes"])
    # the choice's configuration on its cut for time reads as the choice but for its cut, which its row names
    assert over[0]["why"] == "over memory: 14.4 GiB > 13 GiB on layers 0-2 | 3-5 | 6-7 | 8-9 (0.9% faster)"
    code, out, err = pipesim("tune", *GPT_16K, "-D", 2, "--memory-gb", 10)
    # the last line: a search over a second says so on the line before (commands/tune.py `_working`)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: --memory-gb: no configuration fits in 10 GiB; the least memory any needs is 11.4 GiB per device"), err


def test_where_nothing_fits_the_parts_own_memory_the_refusal_names_devices_not_memory_gb():
    """Without --memory-gb the cap is the --gpu part's own memory: the refusal names --devices and the part, as the
    weights' refusal does (commands/tune.py `_check_weights_fit`), where it named --memory-gb, which was not given."""
    long_on_a100 = ("--gpu", "a100-sxm-40gb", *GPT_16K[2:10], "--seq-len", 131072, *GPT_16K[12:])
    code, out, err = pipesim("tune", *long_on_a100, "-D", 2)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(
        "error: --devices 2: no configuration fits on 2 a100-sxm-40gb of 39.4 GiB; the least memory any needs is "), err


def test_where_no_cut_for_time_fits_the_fastest_leanest_cut_that_fits_is_the_answer():
    """On 4 devices DualPipeV's leanest cuts peak at 9.0 GiB (p = 4, 37.4 samples/s) and 11.4 (p = 2, d = 2, 46.0),
    and neither cut for time fits 12 GiB: the answer there is p = 2, where tune took the configuration of least
    memory, p = 4, not looking at the faster one that fits too. Under 11.4 GiB p = 4 is the answer. The leanest cuts
    simulated are counted, where the search's count said only the cuts for time: at 11 GiB both (p = 2's over the
    cap, then p = 4's), at 12 p = 2's alone (p = 4's bound cannot beat it)."""
    choices, searches = {}, {}
    for cap in (11, 12):
        code, out, err = pipesim("tune", *GPT_16K, "-D", 4, "--memory-gb", cap, "--json")
        assert code == 0, err
        document = json.loads(out)
        choices[cap], searches[cap] = document["choice"], document["search"]
    assert (choices[11]["stages"], choices[12]["stages"]) == (4, 2)
    assert choices[11]["peak_memory_gib"] < choices[12]["peak_memory_gib"] <= 12
    assert choices[12]["samples_per_s"] > choices[11]["samples_per_s"]
    assert (searches[11]["simulated_leanest"], searches[12]["simulated_leanest"]) == (2, 1)
    code, out, err = pipesim("tune", *GPT_16K, "-D", 4, "--memory-gb", 12)
    assert code == 0, err
    assert (f"{searches[12]['simulated']} simulated, and 1 leaner cut simulated where no cut for time fits; "
            in " ".join(out.split())), out


def test_a_choice_within_two_percent_of_the_parts_memory_is_noted_and_one_under_a_given_cap_is_not():
    """A choice at 79.2 of an H100's 80 GiB was printed as fitting, where the CUDA context and NCCL's buffers take
    some of what the driver gives torch (the cap: `Gpu.device_memory`, which the note names `pipesim gpus` for)."""
    from types import SimpleNamespace

    from pipesim.hardware.catalogue import load_catalogue
    from pipesim.planning.tune import _headroom_note
    from pipesim.units import GIB

    def note(peak_gib, part="h100-sxm"):
        return _headroom_note(SimpleNamespace(peak_memory_bytes=peak_gib * GIB),
                              SimpleNamespace(memory_part=part, memory_cap_bytes=load_catalogue().gpu[
                                  "h100-sxm"].device_memory_bytes))

    [said] = note(78)
    assert said.startswith("the choice peaks at 78 GiB, 1.4% under the h100-sxm's 79.1 GiB (`pipesim gpus`); the "
                           "CUDA context and NCCL's buffers, which pipesim does not count, take some of it"), said
    assert said.endswith("give --memory-gb to keep headroom")
    assert note(77.5) == [] and note(78, part=None) == []  # 2.0 % under; or --memory-gb's cap, the user's own


def test_tune_of_an_estimate_takes_its_parts_own_memory_as_tune_gpu_does(tmp_path):
    """`tune --profile` of an estimate without --memory-gb caps each device at the part's memory that the
    estimate records, as `tune --gpu` does: it refused in --memory-gb's name, which was not given, and its choice
    within 2 % of that memory had no note (the note's part: `Problem.memory_part`)."""
    profile = tmp_path / "long.json"
    long_on_a100 = ("--gpu", "a100-sxm-40gb", *GPT_16K[2:10], "--seq-len", 131072, *GPT_16K[12:14])
    code, _, err = pipesim("estimate", *long_on_a100, "-b", 1, "--recompute", "none", "-o", profile)
    assert code == 0, err
    code, out, err = pipesim("tune", "--profile", profile, "-D", 2, "-s", "1f1b")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(
        "error: --devices 2: no configuration fits on 2 NVIDIA A100 SXM4 40GB of 39.4 GiB; the least memory any "
        "needs is "), err


@needs_transformers
def test_where_no_cut_for_time_fits_one_cut_again_for_the_cap_less_its_overrun_may():
    """At 41 GiB 1F1B's cut for time (18 | 17) is over the cap once the caching allocator's reserve is added, and tune
    answered with its leanest cut, 15 | 20 at 13.1 samples/s, where 40 GiB gave 17 | 18 at 14.4: a cap raised chose
    slower. Cut again for the cap less what its cut for time overran it by, 41 GiB gives 17 | 18 too, its simulate
    line the same figures."""
    flags = ("--gpu", "h100-sxm", "--model", f"hf:{LLAMA_8B}", "--seq-len", 8192, "-D", 16, "-b", 1,
             "--tensor-parallel", 2, "--recompute", "selective", "--sequence-parallel", "-s", "1f1b", "--data-parallel",
             4, "--rank-order", "megatron", "--zero", 1)
    documents = {}
    for cap in (40, 41):
        code, out, err = pipesim("tune", *flags, "--memory-gb", cap, "--json")
        assert code == 0, err
        documents[cap] = json.loads(out)
    choices = {cap: document["choice"] for cap, document in documents.items()}
    assert choices[41]["partition"] == choices[40]["partition"] == [0, 17, 35]
    assert choices[41]["samples_per_s"] == choices[40]["samples_per_s"]
    assert any("cut again for the cap less what its cut for time overran it by" in note
               for note in documents[41]["notes"])
    assert documents[41]["search"]["simulated_leanest"] > 1
    line = documents[41]["simulate_command"].split()[2:]
    simulated = simulate_json(*line)[0]
    assert simulated["samples_per_s"] == pytest.approx(choices[41]["samples_per_s"], rel=1e-12)
    assert simulated["peak_memory_mb"] / 1024 == pytest.approx(choices[41]["peak_memory_gib"], rel=1e-12)
    assert choices[41]["peak_memory_gib"] <= 41


def test_a_split_backwards_partition_weighs_what_its_weight_passes_hold():
    """ZB-H1 holds what each deferred W reads from its I until the W, most on its last stages (the simulator and
    simulate's fit weigh it); tune's partition weighed 1F1B's micro-batches alone, so it packed the last stages and
    said the least any cut needs is 30.5 GiB, where a cut of 23.1 fits (a new user's pass: a Llama 3.1 70B layout
    refused at 60 GiB, needing "88.2", fits in 58.7). The choice is what its simulate line gives."""
    zb_h1 = ("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 24, "--width", 4096, "--heads", 32,
             "--seq-len", 4096, "--attention", "flash", "-D", 8, "-s", "zb-h1", "--tensor-parallel", 1,
             "--data-parallel", 1, "--recompute", "none", "-b", 1, "-B", 64)
    code, _, err = pipesim(*zb_h1, "--memory-gb", 22)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: --memory-gb: no configuration fits in 22 GiB; the least memory any needs is 23.1 GiB per device"), err
    code, out, err = pipesim(*zb_h1, "--memory-gb", 25, "--json")
    assert code == 0, err
    document = json.loads(out)
    choice = document["choice"]
    assert choice["peak_memory_gib"] <= 25
    [simulated] = simulate_json(*document["simulate_command"].split()[2:])
    code, out, err = pipesim(*zb_h1, "--memory-gb", 25)  # d = 1 said "all-reduce 0 ms per step"
    assert code == 0 and "; one replica: no data-parallel collective" in " ".join(out.split()), err
    assert max(device["peak_memory_mb"] for device in simulated["devices"]) / 1024 == pytest.approx(
        choice["peak_memory_gib"], rel=1e-6)
