"""The multiprocessors DeepEP's kernels hold (`--dispatcher-sms`, planning/estimate.py `sharing_dispatcher`): while
an overlapped pair's all-to-alls run, the other part computes on the multiprocessors they leave
(`Costs.sharing_dispatcher_ms`); without the overlap nothing computes beside them; bad values are one line."""

from __future__ import annotations

import numpy as np
import pytest

from pipesim.planning.estimate import Parallelism, sharing_dispatcher
from pipesim.sim.costs import Costs, StageCosts
from tests.conftest import pipesim, simulate_json
from tests.helpers import ANY_DISPATCHER, GPU_ALONE
from tests.helpers import DEEPEP_GPT_FLAGS as GPT
from tests.helpers import H100_BF16 as DEVICE


def test_a_part_computes_slower_only_while_the_other_parts_all_to_alls_run_beside_it():
    """A 10 ms forward that takes 12.5 ms on what the kernels leave (0.8 of its speed): 4 ms beside them lose
    4 x 0.2 ms; all-to-alls outlasting it slow the whole of it; no multiprocessors held, no change."""
    costs = Costs((StageCosts(fwd_ms=10.0, bwd_ms=20.0, fwd_sharing_ms=12.5), StageCosts(fwd_ms=10.0, bwd_ms=20.0)))
    stage, part_ms = np.array([0, 0, 1]), np.array([10.0, 10.0, 10.0])
    assert costs.sharing_dispatcher_ms(stage, True, part_ms, np.array([4.0, 100.0, 4.0])) == pytest.approx(
        [10.8, 12.5, 10.0])
    assert costs.sharing_dispatcher_ms(stage, False, part_ms, np.array([4.0, 4.0, 4.0])) == pytest.approx(part_ms)


def test_the_multiprocessors_held_lengthen_only_an_overlapped_step():
    """Under --overlap-expert-comm the pair's compute shares an A100 with DeepEP's kernels, its products in waves:
    holding more of its 108 multiprocessors lengthens the step where the nodes it slows beside the all-to-alls lie on
    the pair's path (2,048 tokens a sequence; at 512 they end within what the pair waits for anyway, its all-to-alls
    and its combine node, and the step is the same: planning/experts.py `paired_exposed_ms`); without the overlap
    the dispatch is a row the next pass waits for, so the step is the same. (An H100's persistent products are held
    whatever the count: tests/test_expert_pair_order.py.)"""
    gpt = tuple("a100-sxm-80gb" if arg == "h100-sxm" else arg for arg in GPT)
    (few,), (many,) = (simulate_json(*gpt, "--overlap-expert-comm", "--dispatcher-sms", sms) for sms in (20, 90))
    assert many["time_per_minibatch_ms"] == few["time_per_minibatch_ms"]
    gpt = tuple(2048 if before == "--seq-len" else arg for before, arg in zip(("",) + gpt, gpt))
    (few,), (many,) = (simulate_json(*gpt, "--overlap-expert-comm", "--dispatcher-sms", sms) for sms in (20, 90))
    assert many["time_per_minibatch_ms"] > few["time_per_minibatch_ms"]
    (alone_few,), (alone_many,) = (simulate_json(*gpt, "--dispatcher-sms", sms) for sms in (20, 90))
    assert alone_many["time_per_minibatch_ms"] == alone_few["time_per_minibatch_ms"]


def test_hybridep_holds_megatron_cores_16_multiprocessors_where_deepep_holds_20():
    """HybridEP's kernels hold `moe_hybridep_num_sms`, 16 by default, DeepEP's `moe_deepep_num_sms`, 20, each unless
    --dispatcher-sms says otherwise; NCCL's all-to-all its 16 channels'."""
    def left(**given) -> int:
        return sharing_dispatcher(DEVICE, Parallelism(data=8, expert=8, **given)).curve.multiprocessors

    assert [left(token_dispatcher=d) for d in ("hybridep", "deepep", "alltoall")] == [132 - 16, 132 - 20, 132 - 16]
    assert left(token_dispatcher="hybridep", dispatcher_sms=32) == 132 - 32


@pytest.mark.parametrize(("args", "message"), [
    ((*ANY_DISPATCHER, "--token-dispatcher", "alltoall", *GPU_ALONE, "--dispatcher-sms", 20),
     "--dispatcher-sms: the multiprocessors DeepEP's or HybridEP's kernels hold; give --token-dispatcher deepep or "
     "hybridep"),
    ((*GPT, "--dispatcher-sms", 132),
     "--dispatcher-sms 132 of the part's 132 multiprocessors leaves none to compute on"),
])
def test_bad_dispatcher_sms_is_one_line(args, message):
    code, out, err = pipesim("simulate", *args)
    assert code == 2 and not out and err.count("\n") == 1 and message in err and "Traceback" not in err
