"""DeepSeek-V3's Table 2, reproduced exactly by simulating the schedules.

Source: DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv:2412.19437v2), section 3.2.1, Table 2 (rows 1F1B, ZB1P,
DualPipe), which the deepseek-ai/DualPipe README repeats "based on the same number of PP stages", adding DualPipeV:

| Method    | Bubble                  | Parameter Per Device | Activation Per Device | #Devices |
| 1F1B      | (PP-1)(F+B)             | 1x                   | PP                    | PP       |
| ZB1P      | (PP-1)(F+B-2W)          | 1x                   | PP                    | PP       |
| DualPipe  | (PP/2-1)(F&B+B-3W)      | 2x                   | PP+1                  | PP       |
| DualPipeV | (PP/2-1)(F&B+B-3W)      | 2x                   | PP+1                  | PP/2     |

Table 2's caption: "F denotes the execution time of a forward chunk, B denotes the execution time of a full
backward chunk, W denotes the execution time of a "backward for weights" chunk, and F&B denotes the execution time
of two mutually overlapped forward and backward chunks"; the README adds "PP denotes the number of pp stages
(even)". The report's text says DualPipe increases "the peak activation memory by 1/PP times" and that "neither
the bubbles nor activation memory will increase as the number of micro-batches grows" (m is drawn here).

Neither says how the bubble is counted. Here it is a device's idle time in one training step: the step's makespan
minus the time the device computes, with no communication time (the figures draw none), and the table's bubble is
the largest over the devices (1F1B and ZB1P idle alike on every device; on DualPipeV each device overlaps one pair
more than the one before it, up to the last two, which compute the least and idle the most). Parameters are counted
in one stage's weights, activations in micro-batches of one stage's activations held at once (peak_activations).
The DualPipe row is checked on DualPipe itself (PP devices, two model copies fed from both ends) and on DualPipeV,
to which the README gives the same bubble and memory.

Each formula holds where its own figure's costs do, and only there: every cell of those figures is one unit wide
(F = B - W = W, and a full backward two). ZB1P's holds on ZB-H1 wherever W is no longer than F and than B - W
(beyond, (PP-1)(F+B-2W) even falls below zero: F = 1, B = 4, W = 3); DualPipeV's wherever F = B - W and W <= F
(with F = 2, B = 2, W = 1, F&B = 3 on 4 devices it gives 6, and the order, simulated, idles 9 on its last
device). pipesim simulates the orders for any costs; the formulas are the closed forms of their figures. Costs are
whole milliseconds, so the picosecond clock adds them exactly and the bubbles compare with ==.
"""

from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.engine import static_parts
from pipesim.traces.metrics import summarize

STAGE_PARAM_MB = 1.0


def simulated(name: str, devices: int, m: int, fwd: int, bwd: int, wgrad: int, overlapped: int | None = None,
              chunks: int = 1):
    """(bubble ms, parameters per device in stages' weights, peak activations per device) of `name`'s one step."""
    schedule = build_schedule(name, ScheduleParams(devices, m, chunks=chunks))
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=fwd, bwd_ms=bwd, wgrad_fraction=wgrad / bwd,
                            param_mb=STAGE_PARAM_MB, activation_mb=1.0)
    if overlapped is not None:  # F&B = F + B - fraction x min(F, B)
        costs = replace(costs, overlap_hidden_fraction=(fwd + bwd - overlapped) / min(fwd, bwd))
    summary = summarize(simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.0)))
    bubble = max(summary.makespan_ms - d.busy_ms for d in summary.devices)
    params = {mib / (STAGE_PARAM_MB * 2**20) for mib in static_parts(schedule, costs)["parameters"]}
    return bubble, params, [d.peak_activations for d in summary.devices]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(1, 24), st.integers(1, 20), st.integers(1, 20))
def test_1f1b_row(pp, m, fwd, bwd):
    bubble, params, activations = simulated("1f1b", pp, m, fwd, bwd, 0)
    assert bubble == (pp - 1) * (fwd + bwd)
    assert params == {1}
    assert max(activations) == min(pp, m)  # PP once there are as many micro-batches


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 16), st.integers(1, 10), st.integers(0, 10), st.integers(0, 10))
@example(pp=4, extra=0, wgrad=1, longer_fwd=0, longer_igrad=0)  # the paper's figure: F = I = W
def test_zb1p_row(pp, extra, wgrad, longer_fwd, longer_igrad):
    """ZB1P's bubble as ZB-H1 reaches it (W <= F, W <= I = B - W, m >= PP); its memory is 1F1B's."""
    fwd, bwd = wgrad + longer_fwd, 2 * wgrad + longer_igrad
    bubble, params, activations = simulated("zb-h1", pp, pp + extra, fwd, bwd, wgrad)
    assert bubble == (pp - 1) * (fwd + bwd - 2 * wgrad)
    assert params == {1}
    assert max(activations) == pp


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12), st.integers(1, 10), st.integers(0, 10), st.data())
@example(half=4, extra=2, wgrad=1, longer_fwd=0, data=None)  # the README's figure: PP = 8 stages, 10 micro-batches
def test_dualpipe_row_on_dualpipev(half, extra, wgrad, longer_fwd, data):
    """PP = 2·half stages on half devices, m >= PP, F = B - W >= W; any F&B from the longer part alone (B) to both
    back to back (F + B)."""
    fwd = wgrad + longer_fwd
    bwd = fwd + wgrad
    overlapped = fwd + bwd if data is None else data.draw(st.integers(bwd, fwd + bwd), label="F&B")
    pp = 2 * half
    bubble, params, activations = simulated("dualpipev", half, pp + extra, fwd, bwd, wgrad, overlapped, chunks=2)
    assert bubble == (pp // 2 - 1) * (overlapped + bwd - 3 * wgrad)
    assert params == {2}
    assert activations == [pp + 1] * half


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 6), st.integers(1, 10), st.integers(0, 10), st.data())
@example(half=4, extra=2, wgrad=1, longer_fwd=0, data=None)  # the README's figure: 8 devices, 20 micro-batches
def test_dualpipe_row(half, extra, wgrad, longer_fwd, data):
    """PP = 2·half devices, each holding a stage of each of the two model copies; m even and >= 2·PP, as DualPipe
    asserts; F = B - W >= W; any F&B from the longer part alone (B) to both back to back (F + B)."""
    fwd = wgrad + longer_fwd
    bwd = fwd + wgrad
    overlapped = fwd + bwd if data is None else data.draw(st.integers(bwd, fwd + bwd), label="F&B")
    pp = 2 * half
    bubble, params, activations = simulated("dualpipe", pp, 2 * (pp + extra), fwd, bwd, wgrad, overlapped, chunks=2)
    assert bubble == (pp // 2 - 1) * (overlapped + bwd - 3 * wgrad)
    assert params == {2}
    assert activations == [pp + 1] * pp
