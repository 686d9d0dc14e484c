"""Where each parallel group's ranks sit, numbered as the runtime numbers them, and so which of its members share
a node: what the links of an estimate's placement follow from (planning/estimate.py's `links_of`,
planning/experts.py's `expert_group`), and how `pipesim run` numbers its processes (executor/replicas.py `Layout`):
a vocabulary both sides share, so it lives beside the schedules.

The ranks are numbered along an order of the parallel dimensions, the first varying fastest, as Megatron-core's
`RankGenerator` does (megatron/core/parallel_state.py, `generate_masked_orthogonal_rank_groups`): with sizes
n_0, n_1, ... in that order a rank is i_0 + n_0·(i_1 + n_1·(i_2 + ...)), and a group of some dimensions is the ranks
that differ in those only. Two orders (`RANK_ORDERS`):

- "pipesim" (the default, as every estimate has been priced): tp, cp, pp, dp: t inside a node first, then the C
  context-parallel ranks, then the p stages, then the d replicas; the E expert-parallel ranks are drawn from the
  replicas (ep between pp and dp), so E divides d.
- "megatron": Megatron-core's default order "tp-cp-ep-dp-pp", the stages outermost. Its dense layers number
  tp, cp, dp, pp (ep is 1 there); its expert layers number the same ranks on a grid of their own, tp = the
  expert-tensor-parallel size ETP, ep = E, dp = t·C·d / (ETP·E), pp (cp is 1 there): Megatron-core's "parallel
  folding" (Liu et al. 2025, arXiv 2504.14960), the experts' groups folded over the t·C·d ranks that hold one
  stage, so E·ETP divides t·C·d. ETP defaults to t, as `expert_tensor_parallel_size` does.

A group's ranks on each node: of each of its dimensions, as many steps as fit in a node (at most all of them),
multiplied; a group is within one node when the block of consecutive ranks its dimensions run over is.
Pure arithmetic: no torch."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..choices import choose_from

RANK_ORDERS = ("pipesim", "megatron")
# per order, the dense layers' grid and the expert layers' (innermost first)
_DENSE = {"pipesim": ("tp", "cp", "pp", "dp"), "megatron": ("tp", "cp", "dp", "pp")}
_EXPERT = {"pipesim": ("tp", "cp", "pp", "ep", "dp"), "megatron": ("tp", "ep", "dp", "pp")}


class SettingsError(ValueError):
    """A layout the planner refuses: one line naming what is wrong, each setting in it written {setting} (a
    `Parallelism` field, or the count's `attention` or `dtype`), so that the one rule reads in its reader's terms:
    `said` names each as the commands' flag for it, str() as the setting itself."""

    def __str__(self) -> str:
        return self.said(str)

    def said(self, name: Callable[[str], str]) -> str:
        """The line with each {setting} in it as `name(setting)`."""
        return re.sub(r"\{([a-z_0-9]+)\}", lambda setting: name(setting[1]), str(self.args[0]) if self.args else "")


class RankOrderError(SettingsError):
    """A rank order, or an expert grid, the order cannot number."""


@dataclass(frozen=True)
class RankGrid:
    """Ranks numbered along `order` (innermost first), each dimension of the size `sizes` gives."""

    order: tuple[str, ...]
    sizes: tuple[int, ...]

    def size(self, dim: str) -> int:
        return self.sizes[self.order.index(dim)]

    def stride(self, dim: str) -> int:
        """The rank distance between neighbours along `dim`."""
        return math.prod(self.sizes[:self.order.index(dim)])

    def group(self, dims: Sequence[str], rank: int = 0) -> list[int]:
        """The ranks, ascending, of the group of `dims` that holds `rank`: those that differ from it in `dims`
        only."""
        base = rank - sum((rank // self.stride(dim)) % self.size(dim) * self.stride(dim) for dim in dims)
        ranks = [base]
        for dim in dims:
            ranks = [r + i * self.stride(dim) for i in range(self.size(dim)) for r in ranks]
        return sorted(ranks)

    def per_node(self, dims: Sequence[str], gpus_per_node: int) -> int:
        """How many of a group's ranks share each node: of each dimension, as many steps as fit in a node."""
        return math.prod(min(self.size(dim), max(gpus_per_node // self.stride(dim), 1)) for dim in dims)

    def within_node(self, dims: Sequence[str], gpus_per_node: int) -> bool:
        """Whether the block of consecutive ranks the group's dimensions run over fits in one node; a dimension of
        one rank runs over none (Megatron-core's p = 1 pipeline: its stride is every rank, its group one of them)."""
        spans = [self.stride(dim) * self.size(dim) for dim in dims if self.size(dim) > 1]
        return max(spans, default=1) <= gpus_per_node


def dense_grid(order: str, t: int, c: int, p: int, d: int) -> RankGrid:
    """The dense layers' ranks: tensor (tp), context (cp), pipeline (pp) and data (dp) parallel, as `order` numbers
    them."""
    _check(order)
    sizes = {"tp": t, "cp": c, "pp": p, "dp": d}
    return RankGrid(_DENSE[order], tuple(sizes[dim] for dim in _DENSE[order]))


def expert_grid(order: str, t: int, c: int, p: int, d: int, e: int, etp: int | None = None) -> RankGrid:
    """The expert layers' ranks for E expert-parallel ranks of expert-tensor-parallel size `etp` (None: t): under
    "pipesim" E of the d replicas (etp must be t); under "megatron" Megatron-core's folded grid (module docstring).
    A grid the order cannot number is `RankOrderError`."""
    _check(order)
    named = "{expert_tensor} " + (f"{t} (t, its default)" if etp is None else f"{etp}")
    etp = t if etp is None else etp
    if order == "pipesim":
        if etp != t:
            raise RankOrderError(f"expert_tensor: {etp} folds the experts over the tensor-parallel ranks, which "
                                 "pipesim's rank order keeps for the dense layers: give rank order megatron")
        check_expert_replicas(e, d)
        return RankGrid(_EXPERT[order], (t, c, p, e, d // e))
    if (t * c * d) % (etp * e):
        # the widest expert-tensor group within t that folds (an estimate's flag, so said as what would fold)
        fit = [k for k in range(1, t + 1) if t % k == 0 and (t * c * d) % (k * e) == 0]
        fix = f"; {{expert_tensor}} {fit[-1]} would fold them" if fit else ""
        raise RankOrderError(f"expert: {e} x {named} = {e * etp} must divide the t·C·d = {t * c * d} ranks of a "
                             f"stage, which Megatron-core folds the experts over{fix}")
    return RankGrid(_EXPERT[order], (etp, e, t * c * d // (etp * e), p))


def check_expert_replicas(e: int, d: int) -> None:
    """E expert-parallel ranks drawn from the d data-parallel replicas, as pipesim's rank order numbers them and
    `pipesim run` runs them (executor/experts.py): E divides d."""
    if d % e:
        raise RankOrderError(f"expert: {e} must divide the data-parallel degree, {d}: give {{data}} a multiple of {e} "
                             "(pipesim's rank order and `pipesim run` draw its ranks from the data-parallel replicas; "
                             "Megatron-core's order folds them over t·C·d)")


def estimated_experts_refusal(parallelism: Mapping[str, Any], stages: int, data: int) -> RankOrderError | None:
    """Why a profile estimated with E > 1 expert-parallel ranks (its `parallelism`) cannot run them at d = `data`
    replicas of `stages`, its t, C and ETP kept, as its rank order places them (`expert_grid`); None where it can,
    or at E = 1. Its schedules run the estimate's E wherever they are planned (`Scenario.order_params`)."""
    experts = int(parallelism.get("expert", 1))
    if experts == 1:
        return None
    return expert_grid_refusal(parallelism.get("rank_order", "pipesim"), int(parallelism.get("tensor", 1)),
                               int(parallelism.get("context", 1)), stages, data, experts,
                               parallelism.get("expert_tensor"))


def estimated_experts_per_node(parallelism: Mapping[str, Any], stages: int, data: int, gpus_per_node: int) -> int:
    """How many of an estimate's E expert-parallel ranks (its `parallelism`, E > 1) share a node at p = `stages`,
    d = `data` replicas, its t, C and ETP kept, as its rank order places them (`expert_grid`; a grid it cannot number
    is `RankOrderError`): what its all-to-alls' price follows (planning/experts.py `ExpertGroup.per_node`), which a
    profile keeps from the p and d it was estimated at."""
    grid = expert_grid(parallelism.get("rank_order", "pipesim"), int(parallelism.get("tensor", 1)),
                       int(parallelism.get("context", 1)), stages, data, int(parallelism["expert"]),
                       parallelism.get("expert_tensor"))
    return grid.per_node(("ep",), gpus_per_node)


def expert_grid_refusal(order: str, t: int, c: int, p: int, d: int, e: int, etp: int | None = None
                        ) -> RankOrderError | None:
    """Why `order` cannot place E = `e` expert-parallel ranks over t x C x d ranks a stage (`expert_grid`), None
    where it can: the one rule of where E fits, for a profile's estimate (`estimated_experts_refusal`) and for the E
    that tune searches (commands/tune.py)."""
    try:
        expert_grid(order, t, c, p, d, e, etp)
    except RankOrderError as exc:
        return exc
    return None


def _check(order: str) -> None:
    if order not in RANK_ORDERS:
        raise RankOrderError(choose_from("rank_order", RANK_ORDERS, order))
