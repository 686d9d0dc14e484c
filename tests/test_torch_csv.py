"""Interop with torch.distributed.pipelining's schedule CSV: our schedules pass torch's own checks, torch's
schedules simulate to the closed forms. No process group: torch's schedules are built on fake stages."""

import csv
import io

import pytest
import torch.distributed.pipelining.schedules as ts
from torch.distributed.pipelining.stage import _PipelineStageBase

from pipesim.schedules import METHODS, Kind, Read, ScheduleError, ScheduleParams, StageGraph, build_schedule
from pipesim.schedules.torch_csv import from_torch_csv, to_torch_csv
from tests.conftest import build, pipesim, simulate_json, simulated

TORCH_KINDS = {Kind.F, Kind.B, Kind.I, Kind.W}
# (stages, micro-batches, chunks) tried in turn until the method accepts one.
CONFIGS = [(4, 8, 1), (4, 8, 2), (3, 6, 1), (3, 6, 2), (2, 4, 1)]


class FakeStage(_PipelineStageBase):
    """Just what torch's schedules read to plan their order (as MockPipelineStage in torch's tests)."""

    def __init__(self, num_stages, group_size):
        self.submod = None
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.group = None

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, n_microbatches):
        pass

    def _prepare_backward_infra(self, n_microbatches):
        pass


def torch_schedule(cls, ranks, per_rank, microbatches):
    stages = [FakeStage(ranks * per_rank, ranks) for _ in range(per_rank)]
    return cls(stages[0] if issubclass(cls, ts.PipelineScheduleSingle) else stages, microbatches)


def dump(order):
    """A pipeline order as torch's `_dump_csv` writes it (None, an idle step, becomes an empty cell)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    for rank in order:
        writer.writerow(order[rank])
    return buffer.getvalue()


def load(text):
    """A CSV as torch's `_load_csv` reads it."""
    return {rank: [ts._Action.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(io.StringIO(text)))}


def compute_orders(schedule):
    return [[str(a) for a in order if a.kind in TORCH_KINDS] for order in schedule.orders]


def is_synchronous(schedule):
    """Every op on the latest weights, with no averaging or prediction (the weights of plain training)."""
    policy = schedule.policy
    return (policy.forward is Read.LATEST and policy.backward is Read.LATEST and not policy.predict_forward
            and not policy.predict_backward and schedule.pipelines == 1
            and not any(a.kind in (Kind.AVG, Kind.PRED) for order in schedule.orders for a in order))


def buildable(name):
    """The method's schedules for CONFIGS (one pipeline); one searched from the costs (auto) for conftest's."""
    built = []
    for p, m, v in CONFIGS:
        try:
            built.append(build(name, p, m, 1, chunks=v, pipelines=1) if METHODS[name].needs_costs
                         else build_schedule(name, ScheduleParams(p, m, 1, v)))
        except ScheduleError:
            continue
    return built


@pytest.mark.parametrize("name", list(METHODS))
def test_method_exports_csv_torch_accepts_and_reads_back(name, tmp_path):
    schedules = buildable(name)
    assert schedules, f"{name} accepts none of {CONFIGS}"
    for schedule in schedules:
        if not is_synchronous(schedule):
            with pytest.raises(ScheduleError, match="synchronous"):
                to_torch_csv(schedule)
            continue
        if schedule.graph != StageGraph.chain(schedule.num_stages):
            with pytest.raises(ScheduleError, match="chain"):
                to_torch_csv(schedule)
            continue
        text = to_torch_csv(schedule)
        p, m, stages = schedule.num_devices, schedule.microbatches, schedule.num_stages
        path = tmp_path / f"{name}-{p}-{stages}.csv"
        path.write_text(text)
        runtime = ts._PipelineScheduleRuntime([FakeStage(stages, p)], m)
        runtime._load_csv(path)  # torch's loader: `_validate_schedule`, then its lowering passes
        assert runtime.stage_index_to_group_rank == dict(enumerate(schedule.placement))
        # torch's SEND/RECV lowering of the compute order dry-runs without hanging (torch 2.13's dry run looks an
        # OVERLAP_F_B up by its stage, -1, and fails: it gets the pair's parts in turn)
        rank_of = runtime.stage_index_to_group_rank.__getitem__
        parts = {rank: [part for a in row for part in (a.sub_actions or (a,))] for rank, row in load(text).items()}
        ts._simulate_comms_compute(ts._add_send_recv(parts, rank_of, stages), rank_of, stages)
        back = from_torch_csv(text, name)
        assert compute_orders(back) == compute_orders(schedule)
        assert (back.placement, back.microbatches) == (schedule.placement, m)
        runtime._dump_csv(path, "compute_comms")  # transfers, UNSHARD/RESHARD, REDUCE_GRAD: ignored on reading
        assert from_torch_csv(path.read_text(), name).orders == back.orders


def test_export_refuses_what_torch_cannot_run():
    with pytest.raises(ScheduleError, match="one training step"):
        to_torch_csv(build_schedule("gpipe", ScheduleParams(2, 2, 3)))
    with pytest.raises(ScheduleError, match="synchronous"):
        to_torch_csv(build_schedule("pipedream", ScheduleParams(2, 2, 1)))


@pytest.mark.parametrize("cls", [ts.ScheduleGPipe, ts.ScheduleInterleaved1F1B])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 9), (8, 16)])
def test_torch_one_stage_per_rank_simulates_to_1f1b_closed_form(cls, p, m):
    F, B = 1.5, 2.5
    schedule = from_torch_csv(dump(torch_schedule(cls, p, 1, m).pipeline_order), cls.__name__)
    assert schedule.placement == tuple(range(p))
    summary = simulated(schedule, F, B).summary
    assert summary.makespan_ms == pytest.approx((m + p - 1) * (F + B))
    # torch's interleaved order warms up 2(p-1-k) forwards even with one stage per rank (1F1B: p-1-k)
    held = [m] * p if cls is ts.ScheduleGPipe else [min(2 * (p - 1 - k) + 1, m) for k in range(p)]
    assert [d.peak_activations for d in summary.devices] == held


@pytest.mark.parametrize("name,cls,v", [
    ("gpipe", ts.ScheduleGPipe, 1), ("1f1b", ts.ScheduleInterleaved1F1B, 1),
    ("interleaved-1f1b", ts.ScheduleInterleaved1F1B, 2), ("zb-h1", ts.ScheduleInterleavedZeroBubble, 1),
    ("zb-v", ts.ScheduleZBVZeroBubble, 2), ("dualpipev", ts.ScheduleDualPipeV, 2),
])
def test_catalogue_and_torch_take_the_same_time(name, cls, v):
    """Each of our methods against torch's implementation of it: same placement, same simulated makespan."""
    p, m, F, B = 4, 16, 1.5, 2.5
    ours = build_schedule(name, ScheduleParams(p, m, 1, v))
    theirs = from_torch_csv(dump(torch_schedule(cls, p, v, m).pipeline_order), cls.__name__)
    assert ours.placement == theirs.placement
    assert simulated(ours, F / v, B / v).summary.makespan_ms == pytest.approx(
        simulated(theirs, F / v, B / v).summary.makespan_ms)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 2, 12), (3, 3, 9), (2, 2, 6), (8, 2, 16)])
def test_torch_interleaved_simulates_to_closed_form(p, v, m, tmp_path):
    F, B = 1.0, 2.0  # per device: each of its v stages takes F/v and B/v
    torch_sched = torch_schedule(ts.ScheduleInterleaved1F1B, p, v, m)
    torch_sched._dump_csv(tmp_path / "order.csv", "compute_only")  # torch's own writer
    schedule = from_torch_csv((tmp_path / "order.csv").read_text(), "interleaved")
    assert schedule.placement == tuple(s % p for s in range(p * v))
    makespan = simulated(schedule, F / v, B / v).summary.makespan_ms
    assert makespan == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)
    # torch's lowered dump (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD) reads back to the same orders
    torch_sched._dump_csv(tmp_path / "lowered.csv", "compute_comms")
    assert from_torch_csv((tmp_path / "lowered.csv").read_text(), "interleaved").orders == schedule.orders


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("p,m", [(4, 8), (3, 9), (8, 16)])
@pytest.mark.parametrize("wgrad_fraction", [0.5, 0.3])
def test_torch_interleaved_zero_bubble_simulates_to_zb_h1_closed_form(v, p, m, wgrad_fraction):
    """m >= 2p and W <= I: bubble (p-1)(F + I - W)/v with F, I, W per device (ZB-H1)."""
    F, B = 1.0, 2.0
    input_ms, weight_ms = B * (1 - wgrad_fraction), B * wgrad_fraction
    order = torch_schedule(ts.ScheduleInterleavedZeroBubble, p, v, m).pipeline_order
    schedule = from_torch_csv(dump(order), "zb")
    assert any(a.kind is Kind.W for a in schedule.orders[0])
    assert simulated(schedule, F / v, B / v, wgrad_fraction=wgrad_fraction).summary.makespan_ms == pytest.approx(
        m * (F + B) + (p - 1) * (F + input_ms - weight_ms) / v)


@pytest.mark.parametrize("cls", [ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV])
@pytest.mark.parametrize("p,m", [(4, 8), (3, 9), (8, 16)])
def test_torch_v_schedules_simulate_between_the_work_and_interleaved(cls, p, m, tmp_path):
    """V placement (rank i holds stages i and 2p-1-i); DualPipeV's OVERLAP_F_B cells are overlapped pairs."""
    F, B = 1.0, 2.0
    torch_sched = torch_schedule(cls, p, 2, m)
    torch_sched._dump_csv(tmp_path / "order.csv", "compute_only")
    schedule = from_torch_csv((tmp_path / "order.csv").read_text(), cls.__name__)
    assert schedule.placement == tuple(min(s, 2 * p - 1 - s) for s in range(2 * p))
    makespan = simulated(schedule, F / 2, B / 2).summary.makespan_ms
    assert m * (F + B) <= makespan < m * (F + B) + (p - 1) * (F + B) / 2
    torch_sched._dump_csv(tmp_path / "lowered.csv", "compute_comms")
    assert from_torch_csv((tmp_path / "lowered.csv").read_text(), cls.__name__).orders == schedule.orders


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 10), (4, 16)])
def test_torch_dualpipev_overlaps_the_same_pairs_as_ours(p, m):
    """torch 2.13's ScheduleDualPipeV, written from deepseek-ai/DualPipe independently of pipesim: the same order
    on every rank, and the same F and B in each OVERLAP_F_B (its last rank's first F and B apart, as ours)."""
    theirs = from_torch_csv(dump(torch_schedule(ts.ScheduleDualPipeV, p, 2, m).pipeline_order), "torch-dualpipev")
    ours = build_schedule("dualpipev", ScheduleParams(p, m, 1, 2))
    assert theirs.to_text() == ours.to_text() and "OVERLAP_F_B" in ours.to_text()


def test_torch_1f1b_pipeline_order_is_rejected_naming_what_is_wrong():
    """torch 2.13's Schedule1F1B.pipeline_order starts the last rank at F1 and runs to F<m>: not ground truth."""
    order = torch_schedule(ts.Schedule1F1B, 4, 1, 8).pipeline_order
    assert [str(a) for a in order[3][:2]] == ["3F1", "3B0"]
    with pytest.raises(ScheduleError) as exc:
        from_torch_csv(dump(order), "torch-1f1b")
    message = str(exc.value)
    assert "largest micro-batch index, 8, is at rank 3 (row 4)" in message and "'3F8'" in message
    assert "stage 3 (rank 3) lacks F for micro-batches 0" in message


@pytest.mark.parametrize("text,fragment", [
    ("", "empty schedule file"),
    ("0F0,0Q0\n", "rank 0 (row 1), cell 2 '0Q0': not a torch pipelining action"),
    ("0F0\n1F0,1X\n", "rank 1 (row 2), cell 2 '1X'"),
    ("0F0,0B\n", "rank 0 (row 1), cell 2 '0B': B names no micro-batch"),
    ("0F0,(0F1;0SEND_F1)OVERLAP_F_B\n", "not a torch pipelining action"),
    ("(0F0;0B0)OVERLAP_F_B\n", "rank 0 (row 1), cell 1 '(0F0;0B0)OVERLAP_F_B': an overlapped pair is a forward and "
                               "a full backward of one mini-batch and pipeline, each of its own unit"),
    ('0F0,"0B0\n', "line 1: not CSV"),
    ("0F0,0B0,0F0\n", "rank 0 (row 1), cell 3 '0F0': repeats rank 0 (row 1), cell 1 '0F0'"),
    ("0F0,1F0,0B0\n1B0\n", "rank 1 (row 2), cell 1 '1B0': stage 1 already runs on rank 0"),
    ("0UNSHARD,0RESHARD\n", "no compute actions"),
    ("0F0,0B0,2SEND_F0\n", "stage 2 has no compute action"),
    ("0F0,0F1,0B0\n", "stage 0 (rank 0) lacks one B, or one I and one W, for micro-batches 1"),
    ("0F0,0I0,0B0\n", "stage 0 (rank 0) lacks one B, or one I and one W, for micro-batches 0"),
    ("0F0,0B0\n2F0,2B0\n", "stage 1 appears on no rank"),
    ("\n0F0,0B0\n", "rank 0 (row 1) runs no stage"),
    # rank 0 puts 0B0 before the 0F0 it needs; rank 1 waits for that 0F0 too
    ("0B0,0F0\n1F0,1B0\n", ("the order deadlocks: device 0: 0B0 can never start (waits for 0F0); "
                            "device 1: 1F0 can never start (waits for 0F0)")),
])
def test_bad_csv_names_row_and_cell(text, fragment):
    with pytest.raises(ScheduleError) as exc:
        from_torch_csv(text, "bad")
    assert fragment in str(exc.value)


def test_idle_cells_and_comm_actions_are_skipped_and_opt_appended():
    schedule = from_torch_csv("0F0,,0SEND_F0, ,0RECV_B0,0B0,0REDUCE_GRAD\n1RECV_F0,1F0,1I0,1SEND_B0,1W0\n", "tiny")
    assert schedule.to_text() == "0: 0F0 0B0 0OPT\n1: 1F0 1I0 1W0 1OPT"


@pytest.mark.parametrize("name,args", [
    ("1f1b", ["-p", "4", "-m", "8"]),
    ("gpipe", ["-p", "3", "-m", "5"]),
    ("interleaved-1f1b", ["-p", "2", "-m", "5", "-v", "2", "--microbatch-group", "3"]),
])
def test_cli_export_then_simulate_file_matches_schedule(tmp_path, name, args):
    out = tmp_path / f"{name}.csv"
    code, stdout, _ = pipesim("export", "--schedule", name, *args, "--format", "torch-csv", "--out", str(out))
    assert code == 0 and f"wrote {out}" in stdout
    costs = ["--fwd", "1,1.5,1" if args[1] == "3" else "1", "--bwd", "2", "--comm", "0.1"]
    (expected,) = simulate_json("--schedule", name, *args, "-n", "1", *costs)  # the file holds one mini-batch
    (got,) = simulate_json("--schedule-file", out, *costs)
    assert got["schedule"] == name and got["minibatches"] == 1 and got["steady_state"] is False
    assert got["makespan_ms"] == pytest.approx(expected["makespan_ms"])
    assert got["bubble_fraction"] == pytest.approx(expected["bubble_fraction"])
    assert [d["peak_activations"] for d in got["devices"]] == [d["peak_activations"] for d in expected["devices"]]


def test_cli_simulates_a_schedule_file_for_the_mini_batches_given_as_torch_repeats_its_step(tmp_path):
    """torch's runtime runs the CSV every step(): --minibatches N repeats the file's step N times, each after the
    last's OPT, so a file reaches the steady state its method does (and the caching allocator's reserve from the
    second step on)."""
    out = tmp_path / "zb-h1.csv"
    code, _, err = pipesim("export", "--schedule", "zb-h1", "-p", 4, "-m", 8, "--format", "torch-csv", "--out", out)
    assert code == 0, err
    costs = ["--fwd", "1", "--bwd", "2", "--comm", "0.1"]
    (expected,) = simulate_json("--schedule", "zb-h1", "-p", 4, "-m", 8, "-n", 3, *costs)
    (got,) = simulate_json("--schedule-file", out, "-n", 3, *costs)
    assert got["minibatches"] == 3 and got["steady_state"] is True
    assert got["makespan_ms"] == pytest.approx(expected["makespan_ms"])
    assert got["time_per_minibatch_ms"] == pytest.approx(expected["time_per_minibatch_ms"])
    schedule = from_torch_csv(out.read_text(), "zb-h1", 3)
    assert [a.minibatch for a in schedule.orders[0] if a.kind is Kind.OPT] == [0, 1, 2]
    code, text, err = pipesim("simulate", "--schedule-file", out, *costs)  # one step: its note says how to repeat
    assert code == 0 and "give --minibatches 2 or more, which repeat the file's step" in " ".join(text.split()), err


def test_cli_exports_auto_searched_for_uneven_costs_as_torch_accepts_it(tmp_path):
    """`export -s auto` searches the order for the costs given (a slow last stage, twice 1F1B's activations) and
    writes what torch's loader validates; read back, it simulates as the searched schedule does."""
    out = tmp_path / "auto.csv"
    costs = ["--fwd", "1,1,1,3", "--bwd", "2,2,2,6", "--comm", "0.1"]
    code, stdout, err = pipesim("export", "-s", "auto", "-p", 4, "-m", 8, *costs, "--activation-limit", 2,
                                "--format", "torch-csv", "--out", out)
    assert code == 0 and f"wrote {out}" in stdout, err
    runtime = ts._PipelineScheduleRuntime([FakeStage(4, 4)], 8)
    runtime._load_csv(out)  # torch's own `_validate_schedule`
    assert any("W" in str(action) for action in runtime.pipeline_order[3])  # split backward where it helps
    (expected,) = simulate_json("-s", "auto", "-p", 4, "-m", 8, "-n", 1, *costs, "--activation-limit", 2)
    (got,) = simulate_json("--schedule-file", out, *costs)
    assert got["makespan_ms"] == pytest.approx(expected["makespan_ms"])
    assert [d["peak_activations"] for d in got["devices"]] == [d["peak_activations"] for d in expected["devices"]]


@pytest.fixture
def csv_file(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    return path


@pytest.mark.parametrize("make_args,fragment", [
    (lambda f, d: ["export", "-s", "1f1b", "--format", "json", "--out", f"{d}/x"], "--format: unknown 'json'"),
    (lambda f, d: ["export", "-s", "pipedream", "--format", "torch-csv", "--out", f"{d}/x"], "synchronous"),
    (lambda f, d: ["export", "-s", "nope", "--format", "torch-csv", "--out", f"{d}/x"], "--schedule: unknown 'nope'"),
    (lambda f, d: ["export", "-s", "1f1b", "--format", "torch-csv", "--out", f"{d}/no/x"], "--out: cannot write"),
    (lambda f, d: ["export", "-s", "1f1b", "--format", "torch-csv"], "--out FILE is required: File to write"),
    (lambda f, d: ["export", "-s", "auto", "--format", "torch-csv", "--out", f"{d}/x"],
     "--fwd and --bwd, or --profile: auto searches its order from the stage costs"),
    (lambda f, d: ["export", "-s", "auto", "--fwd", "1", "--bwd", "2", "--activation-limit", "0.1", "--format",
                   "torch-csv", "--out", f"{d}/x"], "--activation-limit: R = 0.1 lets a device hold"),
    (lambda f, d: ["export", "-s", "auto", "--fwd", "1", "--bwd", "2", "--activation-limit", "x", "--format",
                   "torch-csv", "--out", f"{d}/x"], "--activation-limit: give a finite number above 0 (got 'x')"),
    (lambda f, d: ["export", "-s", "1f1b", "--fwd", "1", "--format", "torch-csv", "--out", f"{d}/x"],
     "--fwd: only a schedule searched from the costs (auto) reads it, not 1f1b"),
    (lambda f, d: ["simulate", "--schedule-file", f, "-s", "1f1b"], "--schedule and --schedule-file"),
    (lambda f, d: ["simulate", "--schedule-file", f, "-m", "4"], "--microbatches: the schedule file fixes"),
    (lambda f, d: ["simulate", "--schedule-file", f, "--fwd", "1,2,3"], "one per device (2) in"),
    (lambda f, d: ["simulate", "--schedule-file", f"{d}/missing.csv"], "--schedule-file: cannot read"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, csv_file, make_args, fragment):
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = pipesim(*make_args(str(csv_file), str(tmp_path)))
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_bad_schedule_file_is_refused_naming_the_flag(tmp_path):
    """The refusal named the file's stem alone ("s: rank 0 ..."), not the flag that gave it."""
    path, page = tmp_path / "s.csv", tmp_path / "s.html"
    path.write_text("0F0,0Q0\n")
    code, _, err = pipesim("simulate", "--schedule-file", path, "--html", page)
    assert code == 2 and not page.exists()
    assert err.startswith("error: --schedule-file: s: rank 0 (row 1), cell 2 '0Q0': not a torch pipelining action"), err


@pytest.mark.parametrize("content,fragment", [
    ("0F0,0Q1\n", "cell 2 '0Q1': not a torch pipelining action; expected [stage][F|B|I|W][micro-batch]"),
    ('0F0,"0B0\n', "not CSV"),
    ("", "empty schedule file"),
    ("0F0,0B0\n1B0,1F0\n", "the order deadlocks"),
    # indices far past the actions written: the check walked every stage and micro-batch they imply, for ever;
    # their counts grouped in thousands (they read "100000000000000 stages x 1 micro-batches")
    ("0F99999999999999999999,0B0\n", "incomplete schedule of 1 stage x 100,000,000,000,000,000,000 micro-batches "
                                     "(the largest micro-batch index, 99,999,999,999,999,999,999, is at rank 0 (row "
                                     "1), cell 1 '0F99999999999999999999'): stage 0 (rank 0) lacks F for micro-batches "
                                     "0, 1, 2, 3 and 99,999,999,999,999,999,995 more and one B, or one I and one W, "
                                     "for micro-batches 1, 2, 3, 4 and 99,999,999,999,999,999,995 more"),
    ("99999999999999F0,0F0,0B0\n", "incomplete schedule of 100,000,000,000,000 stages x 1 micro-batch (the largest "
                                   "micro-batch index, 0, is at rank 0 (row 1), cell 1 '99999999999999F0'): stage 1 "
                                   "appears on no rank; stage 2"),
])
def test_cli_bad_schedule_file(tmp_path, content, fragment):
    path = tmp_path / "s.csv"
    path.write_text(content)
    code, _, err = pipesim("simulate", "--schedule-file", str(path))
    assert code == 2 and fragment in err
    assert err.strip().count("\n") == 0


def test_a_schedule_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors begin a UTF-8 file with one: the first cell read '\\ufeff0F0', not a torch action."""
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert simulate_json("--schedule-file", marked)[0]["makespan_ms"] == simulate_json("--schedule-file", plain)[0][
        "makespan_ms"]


def test_blank_lines_after_the_last_rank_are_not_ranks():
    schedule = from_torch_csv("0F0,0B0\n1F0,1B0\n\n\n", "two")
    assert schedule.num_devices == 2 and schedule.placement == (0, 1)


@pytest.mark.parametrize("name", ["xpipe", "mine"])
def test_a_schedule_file_reads_no_methods_option_whatever_it_is_named(tmp_path, name):
    """A file runs its order as written, and its method is its file's name: xpipe.csv took --prediction as XPipe
    reads it, then ignored it. Each method's option is refused naming the file, as for any other name."""
    out = tmp_path / f"{name}.csv"
    assert pipesim("export", "-s", "1f1b", "-p", 2, "-m", 4, "--format", "torch-csv", "--out", out).code == 0
    code, text, err = pipesim("simulate", "--schedule-file", out, "--fwd", 1, "--bwd", 2, "--prediction", "code")
    assert code == 2 and not text and err.count("\n") == 1, err
    assert f"--prediction applies to spectrain, pipeoptim, xpipe only, not --schedule-file {out}" in err
