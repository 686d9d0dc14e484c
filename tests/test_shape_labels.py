"""Every label of a run's shape groups a large degree in thousands, "p=1,024", as units.degree_text writes it: the
table's "avgpipe (P=1,000)" grouped while a view's, tune's, a sweep's and an estimate's labels, each written by
hand, read "p=1024"."""
import dataclasses
from types import SimpleNamespace

import pytest

from pipesim.commands.estimate import ModelWork, parallelism_text
from pipesim.commands.simulate import _label
from pipesim.commands.study import _title
from pipesim.planning import sweep, tune
from pipesim.schedules import ScheduleError, ScheduleParams
from pipesim.schedules.catalogue import build_schedule
from pipesim.schedules.zb_heuristic import fork_orders
from pipesim.study.plan import Setting
from pipesim.traces.view import shape_text
from pipesim.units import degree_text
from tests.conftest import run, script_module


def test_degree_text_groups_thousands():
    assert degree_text("p", 1024) == "p=1,024"
    assert degree_text("v", 2) == "v=2"


def test_view_shape_groups_each_degree():
    trace = run("1f1b", 2, 2, 1, comm=0.1).trace
    meta = dataclasses.replace(trace.meta, microbatches=4096, minibatches=2048, pipelines=1000,
                               params={**trace.meta.params, "data_parallel": 1500, "chunks": 1200})
    assert shape_text(dataclasses.replace(trace, meta=meta)) == (
        "p=2, d=1,500 (one replica drawn), v=1,200, P=1,000, m=4,096, N=2,048")


def test_view_shape_of_a_run_that_stopped_part_way_says_how_many_mini_batches_ran():
    """An interrupted run's line read "N=2,000" where a few hundred ran: the mini-batches every device updated its
    weights for are said beside N."""
    trace = run("1f1b", 2, 2, 3, comm=0.1).trace
    first = trace.ops.minibatch == 0
    ops = dataclasses.replace(trace.ops, **{name: getattr(trace.ops, name)[first] for name in
                                            trace.ops.__dataclass_fields__})
    stopped = dataclasses.replace(trace, ops=ops, meta=dataclasses.replace(trace.meta, complete=False))
    assert shape_text(stopped) == "p=2, m=2, N=3 asked, 1 run"
    assert shape_text(trace) == "p=2, m=2, N=3"


def test_tune_label_groups_each_degree():
    config = tune.Config("1f1b", 1024, 2000, 3000, 4096, 1500, tensor=1100, microbatch_size=1300, recompute="none",
                         expert=1700)
    assert config.label() == "1f1b p=1,024 v=2,000 P=3,000 t=1,100 d=1,500 E=1,700 b=1,300"


def test_sweep_labels_group_each_degree():
    config = sweep.Config("interleaved-1f1b", 1024, 4096, 1, 2000, 3000, 1.0, data_parallel=1500)
    assert config.label == "interleaved-1f1b p=1,024 m=4,096 v=2,000 P=3,000 cost×1 d=1,500"
    assert config.variant == "interleaved-1f1b v=2,000"
    assert sweep._group_name((1024, 1.0, 4096)) == "p=1,024, cost×1, mini-batch of 4,096 micro-batches"


def test_simulate_and_estimate_labels_group_each_degree():
    sched = SimpleNamespace(num_stages=2048 * 1024, num_devices=1024, pipelines=1000, params={})
    assert _label(SimpleNamespace(schedule="avgpipe"), sched) == "avgpipe (v=2,048, P=1,000)"
    parallelism = {"tensor": 1024, "pipeline": 2048, "data": 4096, "context": 1500, "expert": 1200}
    assert parallelism_text(parallelism, None) == "t=1,024 C=1,500 p=2,048 d=4,096 E=1,200"
    assert ModelWork.per_device_text(SimpleNamespace(tensor=1024, context=1)) == "t=1,024 GPUs per device"


def test_run_table_title_groups_each_degree(capsys):
    """`pipesim run`'s table names its ranks' shape as the other labels do: "(p=2, d=1,500, E=1,200)", and its counts
    with them: "1,500 replicas x 4,096 x 1,300 samples, 3,000 ranks" (was "1500 replicas x 4096 x 1300 samples, 3000
    ranks"), each replica's peaks "replica 1,499: ..."."""
    from pipesim.commands.run import _print_table

    trace = run("1f1b", 2, 2, 1, comm=0.1).trace
    meta = dataclasses.replace(trace.meta, microbatches=4096, microbatch_size=1300,
                               params={**trace.meta.params, "data_parallel": 1500, "expert_parallel": 1200},
                               hardware={"ranks": 3000, "transport": "gloo", "device": "cpu"},
                               extra={"optimizer": "sgd", "lr": 0.1, "dtype": "float32"})
    result = SimpleNamespace(trace=dataclasses.replace(trace, meta=meta), losses=[[2.0, 1.0]])
    summary = SimpleNamespace(devices=[SimpleNamespace(peak_memory_mb=1.0)] * 3000, time_per_minibatch_ms=1.0,
                              samples_per_s=1.0)
    _print_table(result, summary, None, None)
    out = " ".join(capsys.readouterr().out.split())
    assert ("1f1b measured: 1 mini-batch of 1,500 replicas x 4,096 x 1,300 samples, 3,000 ranks (p=2, d=1,500, "
            "E=1,200) over gloo (cpu)") in out
    assert "; replica 1,499: 1.00, 1.00 " in out


def test_study_title_groups_each_degree():
    """study's table and page title its setting as the other labels do: "p=1,024, m=4,096, b=1,300" (was written by
    hand, "p=1024, m=4096, b=1300"), its model's options with them ("width 2,048")."""
    setting = Setting("mlp", {"layers": 8, "width": 2048}, 1024, 4096, 1300, 2, 1)
    assert _title(setting) == ("pipesim study: mlp (layers 8, width 2,048), p=1,024, m=4,096, b=1,300, "
                               "10,649,600 samples")


@pytest.mark.parametrize("method, stages, microbatches, chunks, said", [
    ("interleaved-1f1b", 1024, 1500, 2, "got m=1,500, p=1,024"),
    ("zb-h2", 1024, 1000, 1, "2p-1 = 2,047 micro-batches (got m=1,000)"),
    ("dualpipev", 1024, 1000, 2, "got m=1,000, p=1,024"),
    ("dualpipe", 1024, 1000, 2, "got p=1,024, m=1,000"),
    ("pipedream-2bw", 2048, 1000, 1, "(got m=1,000, p=2,048)"),
])
def test_a_methods_refusal_groups_the_degrees_it_quotes(method, stages, microbatches, chunks, said):
    """The methods' refusals quote m and p as the labels write them (units.degree_text), "got m=1,000, p=1,024", not
    by hand, "got m=1000, p=1024"."""
    with pytest.raises(ScheduleError) as refused:
        build_schedule(method, ScheduleParams(stages, microbatches, chunks=chunks))
    assert said in str(refused.value)


def test_the_zero_bubble_forks_refusal_groups_its_figures():
    with pytest.raises(ScheduleError, match=r"\(got p=1, m=1,000, limit 1,500\)$"):
        fork_orders(1, 1000, None, 1500)


def test_the_benchmarks_headers_group_each_degree(capsys, monkeypatch):
    """bench_executor's and fidelity's headers write b, p and m as the labels do, "b=1,500, m=4,096" (by hand they
    read "b=1500, m=4096"), and their counts grouped beside them."""
    with script_module("bench_executor") as bench:
        monkeypatch.setattr(bench, "pipesim_steps", lambda config: [1.0, 2.0])
        monkeypatch.setattr(bench, "torch_run", lambda config: [1.0, 2.0])
        bench.main(["--methods", "1f1b", "--ranks", "1200", "--microbatches", "4096", "--microbatch-size", "1500",
                    "--steps", "1000", "--repeats", "1"])
    assert capsys.readouterr().out.startswith(
        "mlp 8x1024, b=1,500, m=4,096, 1,200 ranks, gloo CPU, 1 thread/rank; 1 run x 1,000 mini-batches after 2 "
        "warm-up\n")
    with script_module("fidelity") as fidelity:
        chain = fidelity.Workload("mlp", {"layers": 8}, 1500, 1024, 4096, 2000, 6000)
        dag = fidelity.Workload("two-branch", {"layers": 2}, 32, 1100, 4, 2, 6)
        assert fidelity.workload_text(chain, dag, 3, "cpu") == (
            "mlp {'layers': 8}, b=1,500, p=1,024, m=4,096, 6,000 timed mini-batches after 2,000; gloo CPU, 1 "
            "thread/rank; 3 repeats (graphpipe: two-branch {'layers': 2}, p=1,100); cpu")
