"""NeMo's distributed Adam's groups (issue 42, item 4; `--optimizer-buckets nemo`): NVIDIA's dgxc H100 runs sync a
virtual-pipeline chunk's gradients (a layer's without one) as one NCCL group launch of their buckets, which NCCL runs
side by side on its channels: one collective a group, where Megatron-core's DDP syncs the first chunk bucket by
bucket."""

from dataclasses import replace

import pytest

from pipesim.planning import buckets
from tests.conftest import refused
from tests.helpers import H100


def test_a_group_is_the_chunk_under_a_virtual_pipeline_else_each_layer_last_to_first():
    assert buckets.nemo_groups(3, chunked=True) == [[2, 1, 0]]
    assert buckets.nemo_groups(3, chunked=False) == [[2], [1], [0]]


def _scenario(method: str, chunks: int, d: int):
    """A gpt of an embedding (67M parameters), six blocks (50M each) and a head (67M) estimated on an H100 (persistent
    products: a collective beside one costs its whole time), run as `method` on p = 2 under ZeRO-1 over d
    replicas: its profile, scenario, schedule and data-parallel link."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams
    from pipesim.workload.count import count_built

    count = count_built("gpt", dict(layers=6, width=2048, ffn=8192, heads=16, seq_len=2048, vocab=32768), 1,
                        torch.bfloat16)
    profile = estimate_profile(count, H100, Parallelism(data=d, sharded_optimizer=True))
    scenario = profile_scenario(profile, "adam")
    sched = scenario.build(method, ScheduleParams(2, 4, chunks=chunks, data_parallel=d, zero=1))
    return profile, scenario, sched, scenario.data_parallel_link(sched)


def test_under_a_virtual_pipeline_the_first_chunk_is_one_collective_not_megatron_cores_buckets():
    """Interleaved 1F1B, two chunks a device, d = 8 (Megatron-core's buckets: 40M parameters): the first model
    stage (the embedding and two blocks) is three Megatron-core buckets, three latencies; NeMo's chunk is one group,
    one collective of its bytes. The other stages were one collective already and stay so."""
    profile, scenario, sched, link = _scenario("interleaved-1f1b", 2, 8)
    megatron = scenario.costs(sched).stages
    nemo = replace(scenario, optimizer_buckets="nemo").costs(sched).stages
    first = nemo[0]
    assert first.gradient_bytes == 2 * first.param_bytes  # float32 main gradients (--precision megatron)
    assert first.reduce_ms == pytest.approx(link.reduce_scatter_ms(first.gradient_bytes, 8), rel=1e-9)
    assert first.gather_ms == pytest.approx(link.reduce_scatter_ms(first.gathered_weight_bytes, 8), rel=1e-9)
    assert megatron[0].reduce_ms == pytest.approx(first.reduce_ms + 2 * link.reduce_scatter_ms(0, 8), rel=1e-9)
    assert nemo[1:] == megatron[1:]


def test_without_a_virtual_pipeline_every_stage_is_a_collective_a_layer():
    """1F1B on p = 2, d = 8: NeMo groups a layer each, so the second stage (two blocks and the head) reduce-scatters
    and all-gathers in three collectives, three latencies, where pipesim's one REDUCE row paid one."""
    profile, scenario, sched, link = _scenario("1f1b", 1, 8)
    megatron = scenario.costs(sched).stages[1]
    nemo = replace(scenario, optimizer_buckets="nemo").costs(sched).stages[1]
    assert scenario.cut(sched)[1:] == [5, 8]  # the second stage: blocks 4 and 5 and the head
    latency_ms = link.reduce_scatter_ms(0, 8)
    assert megatron.reduce_ms == pytest.approx(link.reduce_scatter_ms(megatron.gradient_bytes, 8), rel=1e-9)
    assert nemo.reduce_ms == pytest.approx(megatron.reduce_ms + 2 * latency_ms, rel=1e-9)
    assert nemo.gather_ms == pytest.approx(megatron.gather_ms + 2 * latency_ms, rel=1e-9)


GPT = ("simulate", "--model", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len", "256",
       "--vocab", "1024", "--gpu", "h100-sxm", "-s", "1f1b", "-p", "2", "-m", "4", "--data-parallel", "4")


@pytest.mark.parametrize("args, says", [
    ((*GPT, "--zero", "1", "--optimizer-buckets", "apex"),
     "--optimizer-buckets: choose from megatron, nemo (got 'apex')\n"),
    ((*GPT, "--optimizer-buckets", "nemo"), "layers: give --zero 1\n"),
    (("simulate", "-s", "1f1b", "-p", "2", "--data-parallel", "4", "--zero", "1", "--optimizer-buckets", "nemo"),
     "layers: give --gpu NAME or --profile PATH\n"),
    (("simulate", "-s", "1f1b", "-p", "2", "--data-parallel", "4", "--optimizer-buckets", "nemo"),
     "layers: give --gpu NAME or --profile PATH and --zero 1\n"),
])
def test_bad_optimizer_buckets_are_refused_in_one_line(tmp_path, monkeypatch, args, says):
    """Each refusal names what is missing, and only that (typed costs under --zero 1 lack the layers alone)."""
    monkeypatch.chdir(tmp_path)
    assert refused(*args).endswith(says)
