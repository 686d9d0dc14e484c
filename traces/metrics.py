"""Metrics of one trace, computed the same way for predicted and measured runs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from decimal import ROUND_HALF_UP, Decimal

import numpy as np

from ..units import MIB
from .trace import Stream, Trace


def rate_text(per_s: float) -> str:
    """A rate (samples/s) to three significant digits, at least one decimal: a 405B model's 0.176 and 0.233
    samples/s, one method a third faster than the other, would both read 0.2 to one decimal, and a 70B's tune rows
    at 32k tokens, 2 % apart, all read 1.3. Here, beside the summary that holds the rate, so that the commands'
    tables and the pages' summary bars (traces/view.py) write it alike."""
    shown = float(f"{per_s:.3g}")  # its three digits first: 9.996 reads 10.0, not 10.00
    decimals = 1 if not 0 < shown < 10 else 2 - math.floor(math.log10(shown))
    return f"{per_s:,.{decimals}f}"


# The staleness column's header in every table (simulate, sweep, tune, study, and the sweep page's fronts), as tune's
# said it: its values are a digit or two, and "staleness" took 4 more characters of an 80-column terminal (the
# README's first `pipesim simulate` needs 81 with it so, 85 with "staleness").
STALENESS_HEADER = "stale"

# The pages' units, each written one way (traces/view.py's figures and, in its script, its hovers), beside rate_text.
MIB_SHOWN = 0.01  # the least the pages write in MiB (two decimals): under it, "<0.01"
MS_DECIMALS = 3  # ms to the microsecond, a trace's resolution (the script's msText too)
LOSS_WHOLE, LOSS_EXPONENT = 1e3, 1e6  # a diverging run's loss, whole from here, in powers of ten from there


def _decimal_text(value: float, decimals: int, sign: str = "") -> str:
    """`value` to `decimals` places, thousands separated, as the pages' script writes it (toLocaleString): the
    shortest decimal that reads back as the float, a tie rounded away from zero, so that a figure reads alike in a
    table and hovered: 0.0625 ms, a tie in binary too, read "0.062" here (format's tie to even) and "0.063" there,
    and 2.675 MiB (2.67499... in binary) "2.67" and "2.68". NaN reads "NaN", an infinity "∞", as there. `sign`:
    "+" writes a positive value's sign too. A figure that rounds to zero has none: an error of -3.7e-9 read
    "-0.0%", a zero one "+0.0%"."""
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("-" if value < 0 else sign) + "∞"
    rounded = _rounded(value, decimals)
    return f"{abs(rounded):,f}" if rounded.is_zero() else f"{rounded:{sign},f}"


def _rounded(value: float, decimals: int) -> Decimal:
    """A finite `value` to `decimals` places as `_decimal_text` writes it."""
    return Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals), ROUND_HALF_UP)


def figure_text(value: float) -> str:
    """A figure to the digits it was given with (the shortest decimal that reads back as the float), thousands
    separated as every table writes them: the catalogue's 1,978.9 TFLOP/s and 362.05, where `pipesim gpus` wrote
    "1978.9" beside the other tables' "1,978.9"; 80.0 reads "80"."""
    digits = Decimal(repr(float(value))).normalize().as_tuple().exponent if math.isfinite(value) else 0
    return _decimal_text(value, max(0, -digits))


def signed_text(value: float, decimals: int) -> str:
    """A signed figure (an error in ms, a drift in percent) to `decimals` places, thousands separated, its sign
    written where it does not round to zero (`_decimal_text`): a worst start error of none read "+0.00"."""
    return _decimal_text(value, decimals, "+")


def ms_text(ms: float) -> str:
    """ms as the pages write them: to the microsecond, a trace's resolution, as `pipesim simulate`'s table does (the
    summary's bars wrote two decimals, the title's mini-batch three and its makespan two)."""
    return _decimal_text(ms, MS_DECIMALS)


def mib_text(mib: float) -> str:
    """MiB as the pages and the commands' tables write them: whole from 100 up, else to three significant digits (at
    most two decimals): a measured CPU run's 14.11 MiB peak read "14 MiB" on the page, beside run's 14.11. Under
    MIB_SHOWN, "<0.01": a 4 KiB peak read "0.00" (compare's "0.0"), as if nothing were held. A tie rounds away
    from zero (`_decimal_text`): 1.125 MiB read 1.12 in the title, 1.13 hovered. The digits are those of what
    it rounds to: 99.996 MiB reads "100", not "100.0", and 9.996 "10.0", not "10.00"."""
    if 0 < mib < MIB_SHOWN:
        return f"<{MIB_SHOWN}"
    if not 0 < mib < 100:
        return _decimal_text(mib, 0)
    magnitude = math.floor(math.log10(mib))
    decimals = min(2, 2 - magnitude)
    if _rounded(mib, decimals) >= Decimal(10) ** (magnitude + 1):  # rounded up into the next decade
        decimals = min(2, 1 - magnitude)
    return _decimal_text(mib, decimals)


def loss_text(loss: float) -> str:
    """A loss as every table and page writes it: to a thousandth, as a loss is compared across methods and seeds in
    absolute terms (0.459 beside 0.052 and "0.614 ± 0.012": `run` wrote four significant digits, "0.4590" beside
    "0.05200", the study three decimals, its diverged seeds' hover three significant digits). A diverging run's
    loss from LOSS_WHOLE up is whole ("2,469"), from LOSS_EXPONENT up in powers of ten ("2.47e+08"). One that
    would read "0.000" reads "<0.001", as `mib_text`'s "<0.01": a loss trained near zero is not none."""
    if 0 < loss < 0.001 and _rounded(loss, 3) == 0:
        return "<0.001"
    if math.isfinite(loss) and abs(loss) >= LOSS_EXPONENT:
        return f"{loss:.3g}"
    whole = math.isfinite(loss) and abs(_rounded(loss, 3)) >= LOSS_WHOLE  # 999.9996 reads "1,000"
    return _decimal_text(loss, 0 if whole else 3)


def percent_text(fraction: float, signed: bool = False) -> str:
    """A share as the pages write it: to a tenth of a percent, whole from 100 % up ("7.3%", "1,328%"): an error bar's
    "1,327.8%" was shrunk to fit it. A share short of 100 % takes up to four decimals rather than read as whole: a
    bubble of 99.96 % read "100%" (and "100.0%" before). `signed`: an error's sign too ("+36.7%", "+1,500%", where it
    read "+1500.0%")."""
    percent = 100 * fraction
    decimals = 0
    if abs(percent) < 100:  # the page's percentText alike
        decimals = next((d for d in range(1, 5) if abs(_rounded(percent, d)) < 100), 0)
    return _decimal_text(percent, decimals, "+" if signed else "") + "%"


@dataclass(frozen=True)
class DeviceMetrics:
    device: int
    busy_ms: float
    exposed_comm_ms: float  # point-to-point transfers and collectives under way while the device computes nothing
    exposed_collective_ms: float  # of that, the data-parallel collectives' (REDUCE, GATHER on the network stream)
    # None: the trace records no memory for the device (torch profiler traces; a rank of an incomplete run that
    # failed before it reported a row): unknown, not zero
    peak_memory_mb: float | None
    peak_activations: int
    peak_weight_versions: int
    # At the peak's moment, MiB per part (`MEMORY_PARTS`), which sum to `peak_memory_mb`; None: not broken down
    peak_memory_parts_mb: dict[str, float] | None = None
    # Of the activations part, MiB by what saves them (attention, mlp, norms, dropout, other); None: not known
    peak_activation_parts_mb: dict[str, float] | None = None


@dataclass(frozen=True)
class StageMetrics:
    stage: int
    forward_staleness: int
    backward_staleness: int
    prediction_distance: int | None
    backward_prediction_distance: int | None


@dataclass(frozen=True)
class Summary:
    schedule: str
    makespan_ms: float
    time_per_minibatch_ms: float
    samples_per_s: float
    bubble_fraction: float
    exposed_comm_ms: float
    peak_memory_mb: float | None
    max_staleness: int
    devices: list[DeviceMetrics]
    stages: list[StageMetrics]

    def to_dict(self) -> dict:
        return asdict(self)


def merged_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals [starts[i], ends[i]) merged where they overlap: the runs during which any is under way.
    No interval ends before it starts (an op's duration is not negative)."""
    if len(starts) == 0:
        return np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    # Starts and ends sorted apart (no sort of one by the other, nor a running maximum): the k intervals that start
    # first have all ended before the next start exactly where the k smallest ends come before it, since any other
    # interval ends after its own start, which is later; the run's end is then the largest of those k ends.
    starts, ends = np.sort(starts, kind="stable"), np.sort(ends, kind="stable")
    # A new run begins where an interval starts after everything before it has ended.
    new_run = np.r_[True, starts[1:] > ends[:-1]]
    last_of_run = np.r_[np.flatnonzero(new_run)[1:] - 1, len(starts) - 1]
    return starts[new_run], ends[last_of_run]


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by the intervals [starts[i], ends[i])."""
    run_starts, run_ends = merged_intervals(starts, ends)
    return float(np.sum(run_ends - run_starts))


def _exposed(comm_s: np.ndarray, comm_e: np.ndarray, busy_runs: tuple[np.ndarray, np.ndarray], busy_us: float
             ) -> float:
    """Time communication is under way while the compute stream is idle: |comm ∪ busy| − |busy|, where busy is
    given merged (`merged_intervals`) with its length: the union is the same over the runs as over the
    intervals, down to the bit (the same runs, with the same ends), and this way costs the length of the runs,
    not of the rows. None: 0."""
    if len(comm_s) == 0:
        return 0.0
    both = _union_length(np.concatenate([comm_s, busy_runs[0]]), np.concatenate([comm_e, busy_runs[1]]))
    return both - busy_us


def _peak(trace: Trace, name: str, device: int) -> float:
    per_device = trace.counters.get(name)
    if not per_device or len(per_device[device].values) == 0:
        return 0
    return per_device[device].values.max()


def steady_compute_ms(trace: Trace) -> float:
    """A step's compute, summed over the devices: that of mini-batches 2 to N over N - 1 (the first, which a measured
    run's warm-up slows, left out, as the time per mini-batch leaves out its span); one mini-batch's whole. A
    device's compute is the time its rows run, each moment once (`_computing_us`)."""
    ops = trace.ops
    computing = ops.stream == Stream.COMPUTE
    return _steady_compute_ms(ops.device[computing], ops.start_us[computing], ops.end_us[computing],
                              ops.minibatch[computing], trace.num_devices)


def _steady_compute_ms(device: np.ndarray, starts_us: np.ndarray, ends_us: np.ndarray, minibatch: np.ndarray,
                       devices: int, last: int | None = None) -> float:
    """`steady_compute_ms` of the compute rows' devices, times and mini-batches; of mini-batches 2 to `last` + 1
    where given, those the step is timed over (`summarize`)."""
    last = (int(minibatch.max()) if len(minibatch) else -1) if last is None else last
    steady = (minibatch > 0) & (minibatch <= last) if last > 0 else np.ones(len(minibatch), dtype=bool)
    computing_us = _computing_us(device[steady], starts_us[steady], ends_us[steady], devices)
    return float(computing_us.sum()) / max(last, 1) / 1e3


def _computing_us(device: np.ndarray, starts_us: np.ndarray, ends_us: np.ndarray, devices: int) -> np.ndarray:
    """Per device, how long its compute rows run: their union, not their sum, since a measured overlapped pair's
    two parts run at once on two CUDA streams (executor/overlap.py) and each row spans the pair; summed, the pair's
    time counted twice, a bubble under its share (none at all where the parts take as long as the step). The
    simulator's rows on a device never overlap, so there the two are one."""
    bounds, (starts_us, ends_us) = _by_device(device, devices, starts_us, ends_us)
    return np.array([_union_length(starts_us[lo:hi], ends_us[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])])


def _by_device(device: np.ndarray, devices: int, *columns: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """`columns` grouped by device, each row's order within its device kept, and where device d's rows lie in them
    (bounds[d]:bounds[d + 1]); a simulated trace's rows come grouped already and are not copied."""
    if np.any(device[1:] < device[:-1]):
        order = np.argsort(device, kind="stable")
        device, columns = device[order], tuple(column[order] for column in columns)
    return np.searchsorted(device, np.arange(devices + 1)), columns


def steady_bubble(busy_per_minibatch_ms: float, devices: int, step_ms: float) -> float:
    """The idle share of the step the time per mini-batch is: 1 - the devices' mean compute per mini-batch over it
    (0 for no step, and not below 0), as tune's and as the zero-bubble paper's bubble rate (its table 5, 1 -
    m(F + B + W) / the steady step: docs/auto.md). Of the step, not of the whole run, whose fill and drain an order
    that never flushes pays once: PipeDream at p = 4, m = 8, --comm 0.1 idles 4.8 % of its step and 12.9 % of its 4
    mini-batches' run. One mini-batch's step is its makespan: the whole run's share."""
    if step_ms <= 0:
        return 0.0
    return max(1.0 - busy_per_minibatch_ms / (devices * step_ms), 0.0)


def summarize(trace: Trace) -> Summary:
    """Makespan, steady-state time per mini-batch, throughput, bubble, communication, memory and staleness."""
    ops = trace.ops
    ends_us = ops.end_us
    has_memory = "memory_bytes" in trace.counters
    parts = trace.meta.peak_memory_parts if has_memory else None
    savers = trace.meta.peak_activation_parts if parts is not None else None
    makespan_us = float(ends_us.max() - ops.start_us.min()) if len(ops) else 0.0
    compute = ops.stream == Stream.COMPUTE

    bounds, (starts_us, grouped_ends_us, on_compute, on_network) = _by_device(
        ops.device, trace.num_devices, ops.start_us, ends_us, compute, ops.stream == Stream.NETWORK)
    collectives = bool(on_network.any())
    devices = []
    exposed_total_us = 0.0
    for d in range(trace.num_devices):
        mine = slice(bounds[d], bounds[d + 1])
        busy = on_compute[mine]
        start_us, end_us = starts_us[mine], grouped_ends_us[mine]
        busy_runs = merged_intervals(start_us[busy], end_us[busy])
        busy_run_us = float(np.sum(busy_runs[1] - busy_runs[0]))  # each moment once: `_computing_us`
        # Communication under way while the compute stream is idle: |comm ∪ busy| − |busy| (as `_exposed`), where
        # comm ∪ busy is all the device's rows: one merge of them, with no column of its communication taken.
        exposed_us = 0.0 if busy.all() else _union_length(start_us, end_us) - busy_run_us
        network = on_network[mine] if collectives else slice(0)
        collective_us = _exposed(start_us[network], end_us[network], busy_runs, busy_run_us)
        exposed_total_us += exposed_us
        devices.append(DeviceMetrics(
            device=d,
            busy_ms=busy_run_us / 1e3,
            exposed_comm_ms=exposed_us / 1e3,
            exposed_collective_ms=collective_us / 1e3,
            peak_memory_mb=(float(_peak(trace, "memory_bytes", d)) / MIB
                            if has_memory and len(trace.counters["memory_bytes"][d].values) else None),
            peak_activations=int(_peak(trace, "activations", d)),
            peak_weight_versions=int(_peak(trace, "weight_versions", d)),
            peak_memory_parts_mb=({part: held / MIB for part, held in parts[d].items()} if parts is not None
                                  else None),
            peak_activation_parts_mb=({saver: held / MIB for saver, held in savers[d].items()}
                                      if savers is not None else None),
        ))

    # A mini-batch is done when its last op ends; after the first, they complete once per step. (Compute rows
    # are taken once, and the rows that read weights from them: the columns below are read on those alone.) Where a
    # mini-batch starts before the one before it is done (an order that never flushes), the last is left out: no
    # next one runs beside it, so its step is short of the others' (XPipe's predictions of the next mini-batch,
    # priced at 5 ms: 39 ms of work a device and step, and a step of 37.33 ms counting the last)
    computing = np.flatnonzero(compute)
    minibatch = ops.minibatch[computing]
    minibatches = int(minibatch.max()) + 1 if len(computing) else 0
    done_us, begun_us = np.full(minibatches, -np.inf), np.full(minibatches, np.inf)
    np.maximum.at(done_us, minibatch, ends_us[computing])
    np.minimum.at(begun_us, minibatch, ops.start_us[computing])
    last = minibatches - 1 - (minibatches > 2 and bool((begun_us[1:] < done_us[:-1]).any()))
    per_minibatch_us = (done_us[last] - done_us[0]) / last if last > 0 else makespan_us
    samples = trace.meta.samples_per_minibatch

    num_stages = int(ops.stage[computing].max()) + 1 if len(computing) else 0
    version = ops.version[computing]
    read = computing[version >= 0]
    kind, stage = ops.kind[read], ops.stage[read]
    staleness = ops.minibatch[read] - ops.version[read]
    # Per row that reads weights, its slot: its stage's forward, backward (B, I, W) or other reads.
    group = np.array([0 if k == "F" else 1 if k in ("B", "I", "W") else 2 for k in trace.kinds], dtype=np.int64)
    slot = group[kind] * num_stages + stage

    def per_stage_max(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Largest value per stage over its forwards and over its backwards, -1 for a stage with none."""
        out = np.full(3 * num_stages, -1, dtype=values.dtype)  # of the values' own type: ufunc.at's fast path
        np.maximum.at(out, slot, values)
        return out[:num_stages], out[num_stages:2 * num_stages]

    lag_f, lag_b = per_stage_max(staleness)
    s_f, s_b = per_stage_max(ops.prediction[read])
    stages = [
        StageMetrics(
            stage=k,
            forward_staleness=max(int(lag_f[k]), 0),
            backward_staleness=max(int(lag_b[k]), 0),
            prediction_distance=int(s_f[k]) if s_f[k] >= 0 else None,
            backward_prediction_distance=int(s_b[k]) if s_b[k] >= 0 else None,
        )
        for k in range(num_stages)
    ]

    return Summary(
        schedule=trace.meta.schedule,
        makespan_ms=makespan_us / 1e3,
        time_per_minibatch_ms=per_minibatch_us / 1e3,
        samples_per_s=samples / (per_minibatch_us / 1e6) if per_minibatch_us > 0 else 0.0,
        # the compute of the mini-batches the step is timed over: with the last one left out of the step and in
        # the compute, a torch GPipe run's measured bubble read -14 %, shown as 0 (its device 1 idles 70 ms a step)
        bubble_fraction=steady_bubble(_steady_compute_ms(ops.device[computing], ops.start_us[computing],
                                                         ends_us[computing], minibatch, trace.num_devices, last),
                                      trace.num_devices, per_minibatch_us / 1e3),
        exposed_comm_ms=exposed_total_us / 1e3,
        peak_memory_mb=max((dm.peak_memory_mb for dm in devices if dm.peak_memory_mb is not None), default=None),
        max_staleness=max((max(s.forward_staleness, s.backward_staleness) for s in stages), default=0),
        devices=devices,
        stages=stages,
    )
