"""tune reads what its bounds need of an order's rows once per order (`_StepRows`, kept on the `_Order`), then prices
each partition from a table of per-(stage, kind) costs: the same floats summed in the same order as pricing every row
of the table on each call, as `_planned_bound_ms` did. Held here to that row-by-row form, written out as it was, to
the bit, over every fixed method's small orders and random costs."""

import itertools
import pickle

import numpy as np

from pipesim.planning import tune as tuning
from pipesim.schedules import KIND_CODE, METHODS, NUM_COMPUTE_KINDS, Kind, flushes, kind_mask, warmup_minibatches


def _row_by_row_ms(order, short, stage_ms, reduces_ms, hops_ms, sends_ms, accumulate_ms) -> float:
    """`_planned_bound_ms` as it was written: every row of the table priced on each call, device by device."""
    schedule = order.schedule
    p, t = schedule.num_devices, schedule.table
    table = stage_ms.copy()
    table[:, KIND_CODE[Kind.REDUCE]] = reduces_ms
    stage_busy_ms = ((order.per_step * table) * tuning.COMPUTE).sum(axis=1)
    busy_ms = np.array([stage_busy_ms[schedule.stages_on(d)].sum() for d in range(p)])
    accumulated_ms = tuning._accumulated_ms(schedule, accumulate_ms)
    steady = t.minibatch == short
    busy_ms += np.bincount(t.device[steady], accumulated_ms[steady], minlength=p)
    own = np.minimum(t.kind, NUM_COMPUTE_KINDS - 1)
    compute_ms = np.where((t.kind < NUM_COMPUTE_KINDS) & tuning.COMPUTE[own], table[t.stage, own] + accumulated_ms,
                          0.0)
    exposed = np.zeros(p)
    if schedule.pipelines == 1:
        reduces = np.flatnonzero(steady & (t.kind == KIND_CODE[Kind.REDUCE]))
        updates = np.flatnonzero(steady & (t.kind == KIND_CODE[Kind.OPT]))
        update_of = np.zeros(schedule.num_stages, dtype=np.int64)
        update_of[t.stage[updates]] = updates
        done_ms = np.concatenate([[0.0], np.cumsum(compute_ms)])
        for device in np.unique(t.device[reduces]):
            mine = reduces[t.device[reduces] == device]
            reduce_ms = table[t.stage[mine], KIND_CODE[Kind.REDUCE]]
            through_ms = np.cumsum(reduce_ms)
            since_ms = np.maximum.accumulate(done_ms[mine + 1] - (through_ms - reduce_ms))
            waited_ms = through_ms - done_ms[update_of[t.stage[mine]]] + since_ms
            exposed[device] = max(0.0, float(waited_ms.max()))
    return max(float((busy_ms + np.maximum(exposed, sends_ms)).max()), _fill_and_drain_ms(schedule, table, hops_ms,
                                                                                          compute_ms))


def _fill_and_drain_ms(schedule, op_ms, hops_ms, compute_ms) -> float:
    """`_flush_bound_ms` as it was written, on every row's compute `compute_ms`."""
    p = schedule.num_devices
    if not (schedule.placement[:p] == tuple(range(p)) and flushes(schedule)
            and schedule.graph == tuning.StageGraph.chain(schedule.num_stages)):
        return 0.0
    t = schedule.table
    runs = {kind: np.bincount(t.stage[t.kind == KIND_CODE[kind]], minlength=schedule.num_stages) > 0
            for kind in (Kind.B, Kind.I)}
    input_grad_ms = np.minimum(*(np.where(runs[kind], op_ms[:, KIND_CODE[kind]], np.inf) for kind in runs))
    input_grad_ms[np.isinf(input_grad_ms)] = 0.0
    steady = t.minibatch == 1
    reduces = steady & (t.kind == KIND_CODE[Kind.REDUCE]) & (t.stage == 0)
    tail_ms = (op_ms[0, KIND_CODE[Kind.REDUCE]] if reduces.any() else 0.0) + op_ms[0, KIND_CODE[Kind.OPT]]
    rows = np.flatnonzero(steady)
    device = t.device[rows]
    done_ms = np.concatenate([[0.0], np.cumsum(compute_ms[rows])])
    first = np.full(p, len(rows))
    np.minimum.at(first, device, np.arange(len(rows)))
    last = np.full(p, -1)
    backward = np.flatnonzero(kind_mask(t.kind[rows], Kind.B, Kind.I))
    np.maximum.at(last, device[backward], backward)
    before_ms = np.concatenate([[0.0], np.cumsum(op_ms[:p - 1, KIND_CODE[Kind.F]] + input_grad_ms[:p - 1] + hops_ms)])
    ran = last >= 0
    work_ms = done_ms[last[ran] + 1] - done_ms[first[ran]]
    return float((before_ms[ran] + work_ms + tail_ms).max(initial=0.0))


def _orders():
    """Every fixed method's long runs of small shapes, as tune builds them (`_plan`), with their warm-ups."""
    for name, p, m, v, pipelines in itertools.product(METHODS, range(1, 5), range(1, 7), (1, 2), (1, 2)):
        method = METHODS[name]
        if method.needs_costs or method.on_graph is not None:
            continue
        try:
            probe = tuning._Order.of(method.build(tuning.ScheduleParams(p, m, 2, v, pipelines, data_parallel=2)))
            flushing = flushes(probe.schedule)
            short = warmup_minibatches(flushing, probe.schedule.num_stages, m)
            params = tuning.ScheduleParams(p, m, short + (1 if flushing else tuning.STEADY_STEPS), v, pipelines,
                                           data_parallel=2)
            yield tuning._Order.of(method.build(params)), short
        except tuning.ScheduleError:
            continue


def test_the_bound_read_once_per_order_is_the_bound_priced_row_by_row():
    """Random costs with ties and zeros (the cumulative sums' rounding depends on every row before), accumulations,
    REDUCEs, hops and send holds: every figure equal to the bit, where the REDUCEs bind and where a flushing chain's
    fill and drain does (both reached)."""
    rng = np.random.default_rng(7)
    reached = set()
    for order, short in _orders():
        n, p = order.schedule.num_stages, order.schedule.num_devices
        for _ in range(3):
            stage_ms = rng.choice([0.0, 0.1, 1.0 / 3, 2.5, 7.0, 1e-3], size=(n, NUM_COMPUTE_KINDS))
            args = (stage_ms, rng.random(n) * rng.choice([0.0, 5.0]), rng.random(max(p - 1, 0)), rng.random(p) * 2,
                    rng.random(n) * rng.choice([0.0, 1.0]))
            bound = tuning._planned_bound_ms(order, short, *args)
            assert repr(bound) == repr(_row_by_row_ms(order, short, *args)), (order.schedule.method, n, p)
            table = stage_ms.copy()
            table[:, KIND_CODE[Kind.REDUCE]] = args[1]
            rows = order.step_rows(short)
            reached.add(("flush", bound == tuning._flush_bound_ms(rows.flush, table, args[2],
                                                                  tuning._row_costs_ms(table, args[4])) > 0))
            reached.add(("exposed", bool(rows.exposed_ms(table, tuning._row_costs_ms(table, args[4])).any())))
    assert reached == {("flush", True), ("flush", False), ("exposed", True), ("exposed", False)}


def test_an_orders_rows_are_read_once_shared_with_its_replicas_and_not_pickled():
    """The rows read off an order are kept on it, its copies for other replica counts (`_with_replicas`: the same
    table) share them, and a worker is sent the order without them (it reads its own)."""
    order = tuning._Order.of(METHODS["1f1b"].build(tuning.ScheduleParams(4, 8, 2, data_parallel=2)))
    rows = order.step_rows(1)
    assert order.step_rows(1) is rows
    assert tuning._with_replicas(order, 8).step_rows(1) is rows
    sent = pickle.loads(pickle.dumps(order))
    assert sent.steps == {} and order.steps == {1: rows}
    assert repr(tuning._planned_bound_ms(sent, 1, np.ones((4, NUM_COMPUTE_KINDS)), np.ones(4), np.ones(3),
                                         np.zeros(4), np.ones(4))) == repr(tuning._planned_bound_ms(
        order, 1, np.ones((4, NUM_COMPUTE_KINDS)), np.ones(4), np.ones(3), np.zeros(4), np.ones(4)))


def test_a_stages_least_reduce_is_priced_once_per_size_and_frame(monkeypatch):
    """The bound on a fixed order's partition prices each stage's least REDUCE by its gradients' bytes (float32 main
    gradients of the bf16 weights: twice theirs): stages of like bytes (a model of like layers cut many ways) are
    priced once per setting, p and d, each as priced alone."""
    from pipesim.planning.scenario import CollectiveLink
    from tests.helpers import searched_settings

    setting = next(s for s in searched_settings("-D", 8, "-B", 32, "-b", 2, "--tensor-parallel", 1, "--recompute",
                                                "none", model=("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers",
                                                               12, "--width", 512, "--heads", 8))
                   if s.depths == (2,))
    config = tuning.Config("1f1b", 2, 1, 1, 4, 4, 1, 2, "none")
    built = tuning._Built(tuning.Problem(8, 80 * tuning.GIB, 32, ("1f1b",)), tuning._Orders())
    link = tuning._data_link(setting.scenario, 2, 4)
    layers = setting.scenario.measured.layers
    assert all(layer.grad_bytes == 2 * layer.param_bytes for layer in layers)
    held = np.cumsum([0, *(layer.grad_bytes for layer in layers)])
    priced, alone = [], CollectiveLink.all_reduce_ms
    monkeypatch.setattr(CollectiveLink, "all_reduce_ms", lambda self, nbytes, ranks, tree_correction=True: (
        priced.append(nbytes) or alone(self, nbytes, ranks, tree_correction)))
    cuts = [[0, 7, 14], [0, 6, 14], [0, 7, 14], [0, 8, 14]]
    found = [built._layer_reduces_ms(setting, config, bounds) for bounds in cuts]
    sizes = {int(held[b] - held[a]) for bounds in cuts for a, b in zip(bounds, bounds[1:])}
    assert sorted(priced) == sorted(float(n) for n in sizes)  # each size once
    monkeypatch.undo()
    for bounds, reduces in zip(cuts, found):
        assert reduces.tolist() == [link.all_reduce_ms(float(held[b] - held[a]), 4, tree_correction=False)
                                    for a, b in zip(bounds, bounds[1:])]
