"""What a simulation needs besides its schedule's shape: costs, links and a stage DAG, from what-if numbers,
a cluster file, a stage-graph file or a calibration profile.

`pipesim simulate`, the sweep's worker processes and the tuner all build their schedules, costs and links
here, so they agree by construction. Torch-free and typer-free: a sweep worker that unpickles a Scenario
imports the simulator and nothing of the command line. The profile schema is imported only by the functions
that read a profile: building its models is a noticeable share of `simulate`'s start-up, which a run without
a profile skips.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import Counter
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..profiles.linkfit import piecewise_ms
from ..profiles.partition import (
    LAYOUT_MOST_CHARACTERS,
    LayerCost,
    PairBytes,
    PartitionError,
    activation_ranges,
    empty_stages,
    equal_blocks,
    first_last_blocks,
    layout_blocks,
    megatron_layout,
    mirrored_partition,
    padded_blocks,
    partition,
    range_sums,
    searched_partition,
    starts_refusal,
    tied_pairs,
)
from ..profiles.partition import StageCosts as RangeCosts
from ..profiles.workload import follows_flags, too_many_stages
from ..schedules import (
    COLLECTIVE_KINDS,
    KIND_CODE,
    KINDS,
    NUM_COMPUTE_KINDS,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    kind_mask,
    peak_per_stage,
    version_reads,
)
from ..schedules.catalogue import METHODS, method_named
from ..sim import Cluster, CostError, Costs, Link, StageCosts
from ..sim.caching_allocator import LayerAllocations, add_reserve, device_reserves
from ..sim.costs import (
    RowOverhead,
    held_as_runtime,
    keeps_saved_until_weights,
    merges_outputs,
    runtime_refusal,
    wgrad_held,
)
from ..sim.engine import held_static_parts, keep_fullest_parts
from ..traces.trace import Trace
from ..units import MAX_MS, MIB, whole_number
from .fp8 import FP8_RECIPES
from .te import AMAX_UPDATE_KERNELS

if TYPE_CHECKING:
    from ..profiles.schema import Estimate, LayerProfile, Profile, RuntimeProfile, StageProfile
    from ..sim.cluster import MemoryCheck
    from ..traces.metrics import Summary
    from .estimate import PlacementLinks

# How a profile's layers are cut into model stages: balanced for time (PipeDream's planner, `partition`), balanced
# for time within each device's memory (`Scenario.cut`), the same number of the model's blocks per stage
# (Megatron-LM's cut, `equal_blocks`), or as many padded, one fewer at the ends (the zero-bubble paper's fork,
# `padded_blocks`)
BLOCK_CUTS = {"equal-blocks": equal_blocks, "padded-blocks": padded_blocks}
FIT = "fit"
FIT_ROUNDS = 4  # --stage-cut fit's searches at most, each with the reserves of the last cut found (`Scenario._fitted`)
STAGE_CUTS = ("balanced", FIT, *BLOCK_CUTS)
FIRST_LAST = "first-last:"  # first-last:F,L: F blocks on the first stage, L on the last (`first_last_blocks`)
LAYOUT = "layout:"  # layout:STRING: Megatron-core's --pipeline-model-parallel-layout (`layout_blocks`)
LAYERS = "layers:"  # layers:N,N,...: each model stage's count of the profile's layers, in order (`layer_counts`)
MTP_KIND = "MultiTokenPrediction"  # the layer kind --mtp-layers adds (workload/hf.py), a layout's m


def first_last(stage_cut: str) -> tuple[int, int] | None:
    """The first and last stages' block counts `stage_cut` gives (first-last:F,L), None for a named cut
    (`STAGE_CUTS`), a layout (`layout_of`, its letters checked here) or a cut by layers (`layer_counts`, its numbers
    checked here); any other cut is refused in one line."""
    if stage_cut in STAGE_CUTS or layout_of(stage_cut) is not None or layer_counts(stage_cut) is not None:
        return None
    counts = _counts(stage_cut, FIRST_LAST)
    first, last = counts if len(counts) == 2 else (None, None)
    if first is None or last is None:
        raise CostError(f"--stage-cut: choose from {', '.join(STAGE_CUTS)}, {FIRST_LAST}F,L (the first and last "
                        f"stages' blocks, whole numbers to {LAYOUT_MOST_CHARACTERS:,}) or {LAYOUT}STRING "
                        f"(Megatron-core's pipeline layout) or {LAYERS}N,N,... (each stage's layers); got "
                        f"{stage_cut!r}")
    return first, last


def layer_counts(stage_cut: str) -> list[int] | None:
    """Each model stage's count of the profile's layers a layers:N,N,... cut gives (the cut tune chose, which it
    prints so that simulate can reproduce it; a --json's stage_bounds, differenced), None for any other cut; a count
    that is not a whole number is refused in one line, as is a first or last stage of none (one between may hold
    none, as a layout's empty stage does)."""
    if not stage_cut.startswith(LAYERS):
        return None
    counts = _counts(stage_cut, LAYERS)
    if not counts or None in counts or not (counts[0] and counts[-1]):
        raise CostError(f"--stage-cut {stage_cut}: give each model stage's layers after {LAYERS!r}, whole numbers "
                        f"to {LAYOUT_MOST_CHARACTERS:,} separated by commas, the first and last stages' from 1 (a "
                        "stage between them may hold none)")
    return counts


def _counts(stage_cut: str, form: str) -> list[int | None]:
    """The comma-separated whole numbers after `form` in `stage_cut` (None for one that is not), [] where it does not
    start with `form`: as many at most as a layout may unroll to, far past any model's."""
    return ([whole_number(count, LAYOUT_MOST_CHARACTERS) for count in stage_cut.removeprefix(form).split(",")]
            if stage_cut.startswith(form) else [])


def gives_layers(stage_cut: str) -> bool:
    """Whether `stage_cut` gives each stage's layers itself (`layout_of`, `layer_counts`), so that a stage between
    the first and the last may hold none."""
    return stage_cut.startswith((LAYOUT, LAYERS))


def layout_of(stage_cut: str) -> list[str] | None:
    """Each stage's letters of a layout:STRING cut (`megatron_layout`), None for any other; a string Megatron-core
    would not parse is refused in one line."""
    if not stage_cut.startswith(LAYOUT):
        return None
    try:
        return megatron_layout(stage_cut.removeprefix(LAYOUT))
    except PartitionError as exc:
        raise CostError(f"--stage-cut {stage_cut}: {exc}") from None


SEARCHES_WITHIN_RESERVE = 3  # a searched order's searches again, each within the reserve its last overran by


@dataclass(frozen=True)
class Scenario:
    """What the cost flags, --cluster, --profile and --graph describe, apart from the schedule's shape: one
    picklable value, so `sweep`'s worker processes build exactly the schedules, costs and links `simulate`
    builds."""

    per_stage: dict[str, list[float]]  # by flag: --fwd, --bwd, --param-mb, --activation-mb, --output-mb
    wgrad_fraction: float
    opt_ms: float
    pred_ms: float | None
    avg_ms: float | None  # one pipeline's replica
    optimizer: str
    microbatch_size: int
    comm_ms: float
    overlap_comm: bool
    topology: Cluster | None = None  # --cluster
    measured: Profile | None = None  # --profile
    dag: tuple | None = None  # --graph: (StageGraph, placement)
    per: str = "stage"  # what --fwd, --bwd, --param-mb, --activation-mb describe: see `costs`
    source: Path | None = None  # the schedule file, named in errors
    cost_scale: float = 1.0  # `sweep --cost-scale`: every compute time x this (a faster or slower accelerator)
    memory_bytes: int | None = None  # --memory-gb (tune's, simulate's): every device's memory, whatever the cluster
    # or profile say
    network_gb_s: float | None = None  # typed costs: each GPU's network for the data-parallel all-reduce (GB/s)
    stage_cut: str = "balanced"  # how a profile's layers are cut into model stages: STAGE_CUTS, FIRST_LAST, LAYOUT
    precision: str = "fp32"  # typed costs: how --param-mb's weights, their gradients and state are held (PRECISIONS)
    overlap_hidden_fraction: float = 0.0  # `simulate --fb-hidden-fraction`: Costs.overlap_hidden_fraction
    overlap_expert_comm: bool = False  # `--overlap-expert-comm`: ScheduleParams.overlap_expert_comm of every build
    pp_runtime: str = "pipesim"  # `--pp-runtime`: whose runtime holds the boundary tensors (`held_as_runtime`)
    optimizer_buckets: str = "megatron"  # `--optimizer-buckets`: of OPTIMIZER_BUCKETS (planning/buckets.py)
    # `--allocator caching` with --gpu: every layer's allocations on a rank in the model's order
    # (`layer_allocations`), which `add_reserve` replays; None: the tensors alone
    allocations: tuple[LayerAllocations, ...] | None = None
    expandable_segments: bool = False  # `--allocator expandable`: `allocations` replayed with expandable segments
    # per device, the bytes a searched order (auto) leaves free beside its tensors: the caching allocator's reserve
    # past the memory at the order searched before (`within_reserve`); (): none
    search_held_bytes: tuple[int, ...] = ()
    # `measured` is an estimate this command's own flags sized (--gpu, --model, --layers), which an error about its
    # model then names; False: a --profile file's, or no estimate
    sized_by_flags: bool = False

    @property
    def _estimate(self) -> Estimate | None:
        """The profile's estimate; None for a measured profile, or without one (--comm's costs)."""
        return self.measured.estimate if self.measured is not None else None

    def order_params(self, params: ScheduleParams) -> ScheduleParams:
        """`params` as this scenario's orders are built with them (`build`): an estimate's context-parallel ranks C
        and expert-parallel ranks E (whose all-to-all rows the order holds), and the expert overlap if asked for; so
        that a search building a fixed order without `build` (planning/tune.py `_Orders`) builds the same one;
        `params` themselves where they say so already (the search asks for tens of thousands)."""
        wanted = {"overlap_expert_comm": True} if self.overlap_expert_comm else {}
        estimate = self._estimate
        if estimate is not None:
            wanted.update(context_parallel=int(estimate.parallelism.get("context", 1)),
                          expert_parallel=int(estimate.parallelism.get("expert", 1)))
        if all(getattr(params, name) == value for name, value in wanted.items()):
            return params
        return replace(params, **wanted)

    def build(self, name: str, params: ScheduleParams, bounds: Sequence[int] | None = None,
              progress: Callable[[float], None] | None = None) -> Schedule:
        """The named method's schedule; a method that runs any stage DAG (graphpipe) gets the --graph DAG, or
        the profile's model cut into p stages (at `bounds` if given); a method searched from the costs (auto)
        gets this scenario's costs, links and device memory, and tells `progress` how far its search is. An
        estimate's context-parallel ranks C are the schedule's: its devices stand for them; its expert-parallel
        ranks E put the all-to-all rows in it."""
        method = method_named(name)
        if self.stage_cut == FIT and bounds is None and self.measured is not None and (
                method.needs_costs or method.on_graph is not None):
            raise CostError(f"--stage-cut {FIT} cuts for the memory a schedule holds, and {name} builds its schedule "
                            "for the cut: use --stage-cut balanced")
        params = self.order_params(params)
        if params.rounds > 1 and (method.needs_costs or method.on_graph is not None):
            does = "searches its order for one flush, not several" if method.needs_costs else \
                "runs its graph of stages in one flush a mini-batch"
            raise ScheduleError(f"--rounds: {name} {does}: leave --rounds out, or give gpipe, 1f1b, "
                                "interleaved-1f1b, zb-h1, ...")
        if method.needs_costs:
            from .auto import check_shape, schedule_frame, search_schedule

            check_shape(params)  # before the cut: a layout of p·v stages is refused for auto's shape, not its count
            frame = schedule_frame(params)
            costs, links = self.costs(frame, bounds), self.links(frame)  # links built once: the limits read it too
            limits = [None if limit is None else limit - held for limit, held in itertools.zip_longest(
                self.memory_limits(frame, links), self.search_held_bytes[:frame.num_devices], fillvalue=0)]
            return search_schedule(params, costs, links, limits, progress)
        if method.on_graph is None or not (self.dag or self.measured):
            return method.build(params)
        if self.dag:
            return method.on_graph(replace(params, stages=self.dag[0].num_stages), *self.dag)
        return method.on_graph(params, profile_graph(self.measured, params.stages, bounds, self.stage_cut,
                                                     self.sized_by_flags))

    def fsdp2_refusal(self, sched: Schedule) -> str | None:
        """Why FSDP2 cannot run `sched`'s order (`interleaved_minibatches`), where the stages run under it
        (`--precision fsdp2`: typed costs' precision, or the estimate's), whether or not its allocations are
        replayed; else None."""
        estimate = self._estimate
        precision = self.precision if self.measured is None else estimate and estimate.parallelism.get("precision")
        interleaved = interleaved_minibatches(sched) if precision == "fsdp2" else None
        if interleaved is None:
            return None
        return (f"{sched.method}: device {interleaved} starts a mini-batch before its last one's backwards are done, "
                "and FSDP2 (--precision fsdp2) gathers a stage's weights at a step's first forward and reshards them "
                "after its last backward: give a method that flushes each mini-batch (gpipe, 1f1b, "
                "interleaved-1f1b, zb-h1, zb-v, ...)")

    def order_refusal(self, sched: Schedule) -> str | None:
        """Why this scenario's runtimes cannot run `sched` (None: they can), asked of the order alone, as tune
        refuses shapes: its pipeline runtime's (`runtime_refusal`), or FSDP2's (`fsdp2_refusal`)."""
        return runtime_refusal(sched, self.pp_runtime) or self.fsdp2_refusal(sched)

    @property
    def transfers_hold_products(self) -> bool:
        """Whether NCCL's pipeline transfers hold the compute beside them (`Costs.transfers_hold_products`): beside
        an estimate's persistent products (Hopper's)."""
        estimate = self._estimate
        return estimate is not None and bool(estimate.curve.get("persistent_products"))

    def costs(self, sched: Schedule, bounds: Sequence[int] | None = None) -> Costs:
        """Per-model-stage costs from the flags' values (--output-mb, per transfer, is always one number or one
        per model stage; --opt, --pred and --avg are always one number), read as `per` says:

        - "device" (`simulate`): one number is one device's share of the model, split evenly over the model
          stages (chunks) it holds, so methods compared side by side train the same model; a list of p values
          gives each device's share, split likewise; a list of p·v values gives each model stage's cost.
        - "stage": one number, or one per model stage, as given.
        - "model" (`sweep`, where the stage count varies too): the whole model's, split over all stages.

        Compute times are then scaled by `cost_scale`; an overlapped pair hides `overlap_hidden_fraction` of its
        shorter part, and runs its layers' nodes side by side where the schedule pairs as Megatron-core's
        expert-parallel overlap does (`Costs.pairs_by_node`); the boundary tensors are held as `pp_runtime`'s
        runtime holds them (`held_as_runtime`, here alone: the simulator reads the fields it writes). An estimate's
        context ring runs on its own link where the data-parallel group's is another (`Costs.collective_links`).
        With d > 1 data-parallel replicas (`sched.data_parallel`) or C > 1 context-parallel ranks, each stage's
        REDUCE (and GATHER) is priced over their `gradient_ranks` on `data_parallel_link` (`collective_costs`).
        """
        refused = self.fsdp2_refusal(sched)
        if refused is not None:  # the order cannot run so: refused as a schedule, a candidate of tune's alone
            raise ScheduleError(refused)
        costs = scaled(self._sharded_for(self._costs(sched, bounds), sched), self.cost_scale)
        estimate = self._estimate
        ring = estimate.context_link if estimate is not None else None
        if ring is not None and sched.context_parallel > 1 and ring.kind != self.estimate_links(sched).data.kind:
            costs = replace(costs, collective_links=dict.fromkeys(("RING_F", "RING_B"), ring.kind))
        if self.overlap_hidden_fraction:
            costs = replace(costs, overlap_hidden_fraction=self.overlap_hidden_fraction)
        if self.transfers_hold_products:
            costs = replace(costs, transfers_hold_products=True)
        if sched.params.get("overlap_expert_comm", False):  # schedules/passes.py `overlap_expert_communication`
            costs = replace(costs, pairs_by_node=True)
        costs = held_as_runtime(costs, sched, self.pp_runtime)
        costs = self._amax_reductions(costs, sched)
        if sched.gradient_ranks == 1:
            return costs
        link = self.data_parallel_link(sched)
        or_faster = (", smaller weights (--param-mb) or a faster network (--network-gb-s)" if self.measured is None
                     else " or a part with a faster network (--gpu)" if self._estimate is not None
                     else " or a profile calibrated on a faster link")
        return self._collectives_beside_products(self._distributed_optimizer_collectives(
            collective_costs(costs, sched, link, self.expert_replicas(sched), self._empty_stages(sched, bounds),
                             or_faster), sched, link, bounds), sched)

    def _empty_stages(self, sched: Schedule, bounds: Sequence[int] | None) -> frozenset[int]:
        """The model stages of `sched` (every copy's) that hold none of the profile's layers, as a layout may leave
        them (`layout_blocks`); none for typed costs, whose stages are what the flags give."""
        if self.measured is None:
            return frozenset()
        cut = list(bounds) if bounds is not None else self.cut(sched)
        per_copy = len(cut) - 1
        return frozenset(copy * per_copy + k for k in empty_stages(cut) for copy in range(sched.num_stages // per_copy))

    def _distributed_optimizer_collectives(self, costs: Costs, sched: Schedule, link: CollectiveLink,
                                           bounds: Sequence[int] | None) -> Costs:
        """An estimate's run under a distributed optimizer (ZeRO-1, each stage reduced after its last backward)
        reduce-scatters and all-gathers its first model stage in groups (planning/buckets.py): Megatron-core's
        buckets, or under `optimizer_buckets` nemo NeMo's distributed Adam's groups (a chunk's, or a layer's each
        without a virtual pipeline), one collective each. Its REDUCE is what of the groups' reduce-scatters runs
        past its last backward, its GATHER what its first forward waits for their all-gathers (on a part with
        persistent products, Hopper, every group's whole time: what runs beside a product delays it). Every other
        stage is one collective, as its rows are (what those delay beside the products:
        `_collectives_beside_products`), but NeMo's a layer each without a virtual pipeline: their sum. A first stage
        holding routed experts (their own bucket groups) or a schedule of several model copies: as it is."""
        from .buckets import bucket_params, buckets, exposed_gather_ms, exposed_reduce_ms, nemo_groups

        measured = self.measured
        first = costs.stages[0]
        if (measured is None or measured.estimate is None or sched.zero != 1 or sched.reduce_after_flush
                or sched.graph.copies != 1 or first.expert_param_bytes or not first.param_bytes):
            return costs
        cut = list(bounds) if bounds is not None else self.cut(sched)
        element = 4 if measured.environment.dtype == "float32" else 2
        nemo, chunked = self.optimizer_buckets == "nemo", len(costs.stages) > sched.num_devices

        def groups(layers: list) -> list[list[int]]:
            if nemo:
                return nemo_groups(len(layers), chunked)
            return buckets([layer.param_bytes // element for layer in layers], bucket_params(sched.data_parallel))

        def traffic(layers: list, stage_bytes: int, nbytes: Callable[[object], int]) -> Callable[[list[int]], float]:
            """A group's time to reduce-scatter its gradients as accumulated (`grad_bytes`) or all-gather its
            weights as they are gathered (`gathered_weight_bytes`: TransformerEngine's float8 weights at 1 byte),
            the same traffic: its layers' share (by `nbytes`) of the stage's `stage_bytes`."""
            total = sum(nbytes(layer) for layer in layers)
            return lambda group: link.reduce_scatter_ms(
                stage_bytes * (sum(nbytes(layers[i]) for i in group) / total), sched.gradient_ranks)

        def reduced(layers: list, stage: StageCosts) -> Callable[[list[int]], float]:
            return traffic(layers, stage.gradient_bytes, attrgetter("grad_bytes"))

        def gathered(layers: list, stage: StageCosts) -> Callable[[list[int]], float]:
            return traffic(layers, stage.gathered_weight_bytes, attrgetter("gathered_weight_bytes"))

        def shares(times: list[float], stage_ms: float) -> list[float]:  # the stage's pass, split as its layers'
            total = sum(times)
            return [stage_ms * ms / total if total else stage_ms / len(times) for ms in times]

        persistent = bool(measured.estimate.curve.get("persistent_products"))
        layers = measured.layers[cut[0]:cut[1]]
        planned = groups(layers)
        stages = [replace(
            first, reduce_ms=exposed_reduce_ms(shares([layer.bwd.median_ms for layer in layers], first.bwd_ms),
                                               planned, reduced(layers, first), persistent),
            gather_ms=exposed_gather_ms(shares([layer.fwd.median_ms for layer in layers], first.fwd_ms), planned,
                                        gathered(layers, first), persistent))]
        for index, c in enumerate(costs.stages[1:], start=1):
            layers = measured.layers[cut[index]:cut[index + 1]]
            if not nemo or chunked or not layers or not c.param_bytes or c.expert_param_bytes:
                stages.append(c)
                continue
            planned = groups(layers)
            reduce_ms, gather_ms = reduced(layers, c), gathered(layers, c)
            stages.append(replace(c, reduce_ms=sum(map(reduce_ms, planned)),
                                  gather_ms=sum(map(gather_ms, planned)) + c.gather_cast_ms))
        return replace(costs, stages=tuple(stages))

    def _collectives_beside_products(self, costs: Costs, sched: Schedule) -> Costs:
        """On a part with persistent products (an estimate's `persistent_products`, Hopper) a stage's once-a-step
        REDUCE and GATHER that run while its device computes its other stages delay their products by their whole
        time: NCCL's kernels hold multiprocessors the products' persistent CTAs wait for (the rule the bulk
        overlaps and stage 0's buckets follow; docs/hardware.md, "Every chunk's collectives beside the products").
        Paid in the stage's OPT row (`StageCosts.collective_delay_ms`). Where they run is the schedule's: the
        REDUCE, issued after the stage's last backward (Megatron-core's `overlap_grad_reduce`; DDP's all-reduce
        and ZeRO's reduce-scatter alike), runs beside products where the device computes after it (an interleaved
        chunk after its device's first, beside the backwards of the chunks before it; none after the flush under
        `reduce_after_flush`); the GATHER, issued at the step's start (`overlap_param_gather`, which Megatron-LM
        allows only with `overlap_grad_reduce`, arguments.py), where the device runs another stage's forward
        before the stage's first. Within a mini-batch: the next one waits for its updates. What a stage holds
        (routed experts or not) and stage 0's own bucket conditions do not enter. ZeRO-3's gathers before every
        pass (FSDP's, not once a step): as they are; so is a schedule not yet ordered (a search's, priced before
        its rows exist)."""
        estimate = self._estimate
        if (estimate is None or not estimate.curve.get("persistent_products") or sched.zero >= 3
                or not len(sched.table.kind)):
            return costs
        t, stages, devices = sched.table, len(costs.stages), sched.num_devices
        row, steps = np.arange(len(t.kind)), int(t.minibatch.max()) + 1
        on_device = t.device.astype(np.int64) * steps + t.minibatch  # a device's rows of one mini-batch
        of_stage = t.stage.astype(np.int64) * steps + t.minibatch  # a stage's
        compute = kind_mask(t.kind, Kind.F, Kind.B, Kind.I, Kind.W)
        forward = t.kind == KIND_CODE[Kind.F]
        last_compute = _grouped(np.maximum, on_device[compute], row[compute], devices * steps, -1)
        reduces = np.flatnonzero(t.kind == KIND_CODE[Kind.REDUCE])
        reduce_beside = np.isin(np.arange(stages), t.stage[reduces[reduces < last_compute[on_device[reduces]]]])
        device_first = _grouped(np.minimum, on_device[forward], row[forward], devices * steps, len(row))
        stage_first = _grouped(np.minimum, of_stage[forward], row[forward], stages * steps, len(row))
        stage_step = np.arange(stages * steps)
        its_device = np.asarray(sched.placement)[stage_step // steps] * steps + stage_step % steps
        gather_beside = ((stage_first > device_first[its_device]) & (stage_first < len(row))).reshape(
            stages, steps).any(axis=1) & (not sched.reduce_after_flush)
        delay_ms = (np.array([c.reduce_ms for c in costs.stages]) * reduce_beside
                    + np.array([c.gather_ms for c in costs.stages]) * gather_beside)
        return replace(costs, stages=tuple(c if c.collective_delay_ms == ms else  # most stages: unchanged, unchecked
                                           replace(c, collective_delay_ms=float(ms))
                                           for c, ms in zip(costs.stages, delay_ms, strict=True)))

    def _reduces_and_updates_amaxes(self) -> bool:
        """Whether the estimate's float8 recipe keeps delayed scaling's amax history
        (planning/fp8.py `Fp8Recipe.reduces_and_updates_amaxes`)."""
        recipe = FP8_RECIPES.get(self._estimate.parallelism.get("fp8")) if self._estimate is not None else None
        return recipe is not None and recipe.reduces_and_updates_amaxes

    def amax_reduction_ms(self, sched: Schedule) -> float:
        """TransformerEngine's delayed scaling (an estimate's recipe that `reduces_and_updates_amaxes`: te)
        all-reduces the amaxes of a chunk's float8 tensors when its forward ends (fp8_autocast's exit) and when its
        backward does (its first module's), blocking the compute stream, over Megatron-core's amax reduction group:
        the t·C·d ranks of the tensor-, context- and data-parallel groups
        (parallel_state.get_amax_reduction_group(with_context_parallel=True), the group TransformerBlock's
        fp8_autocast is given). A few float32 a product, which NCCL sends on its LL protocol: the all-reduce's latency
        (`nccl_ll_all_reduce_ms`; the bytes' nanoseconds left out), which grows with log2 of the nodes the group
        spans. 0 without such a recipe or an estimate's placement."""
        from ..hardware.collectives import nccl_ll_all_reduce_ms

        estimate = self._estimate
        if estimate is None or not self._reduces_and_updates_amaxes() or estimate.placement is None:
            return 0.0
        t, link = estimate.degrees[0], self.data_parallel_link(sched)
        per_node = min(t * link.per_node, estimate.placement.gpus_per_node)
        return nccl_ll_all_reduce_ms(0, t * sched.gradient_ranks, per_node, link.bytes_per_ms, link.node_link)

    def amax_update_ms(self) -> float:
        """The kernels TransformerEngine's delayed scaling runs around each amax all-reduce
        (`reduce_and_update_fp8_tensors`: fp8.py at v1.7, v1.10 and v1.12, quantization.py at v2.9): `torch.cat` of
        the chunk's amaxes and `fused_amax_and_scale_update_after_reduction`, `AMAX_UPDATE_KERNELS` small kernels at
        the curve's cost of a kernel (a few float32 a module: their bytes left out), with or without the all-reduce.
        0 without an estimate's recipe that `reduces_and_updates_amaxes` (te)."""
        estimate = self._estimate
        if estimate is None or not self._reduces_and_updates_amaxes():
            return 0.0
        return AMAX_UPDATE_KERNELS * float(estimate.curve.get("kernel_overhead_ms", 0.0))

    def _amax_reductions(self, costs: Costs, sched: Schedule) -> Costs:
        """Every stage that runs float8 products (holds float8 weights: one block's fp8_autocast, a chunk) pays
        `amax_reduction_ms` and `amax_update_ms` in each forward and backward (and input-gradient pass, where the
        backward's amaxes are taken)."""
        amax_ms = self.amax_reduction_ms(sched) + self.amax_update_ms()
        if not amax_ms:
            return costs
        return replace(costs, stages=tuple(replace(
            c, fwd_ms=c.fwd_ms + amax_ms, bwd_ms=c.bwd_ms + amax_ms,
            igrad_ms=None if c.igrad_ms is None else c.igrad_ms + amax_ms) if c.float8_weight_bytes else c
            for c in costs.stages))

    def expert_replicas(self, sched: Schedule) -> int:
        """The ranks that hold the same routed experts, over which their gradients reduce (`collective_costs`): the
        d·C gradient ranks over E, or where an estimate folds them over t·C·d with an expert-tensor-parallel size
        ETP (schedules/ranks.py), times t/(E·ETP)."""
        estimate = self._estimate
        etp = estimate.parallelism.get("expert_tensor") if estimate is not None else None
        if etp is None:
            return sched.gradient_ranks // sched.expert_parallel
        return sched.gradient_ranks * estimate.degrees[0] // (sched.expert_parallel * etp)

    def _sharded_for(self, costs: Costs, sched: Schedule) -> Costs:
        """An estimate for a sharded optimizer holds one shard of its d·C and steps over it: here an unsharded
        rank's state (the simulator shards it over the schedule's d·C where the schedule shards), and the step over
        what one of them updates (its bytes at the memory's rate, the kernel's overhead aside), whether the estimate
        or only the schedule shards. Unsharded, a rank holds the weights and state of its own 1/(E·ETP/t) of the
        routed experts (W = E·ETP/t, `weight_shards`); sharded, its d·C share of every expert's, as Megatron-core
        shards the experts' over their own d·C·t/(E·ETP) ranks (`StageCosts.expert_shards`, so that ZeRO-2's and
        3's gradient and weight shards are the experts' too): a shard is k = 1 - f + f·W of the unsharded rank's
        over d·C, f the rank's weights' routed share (`StageCosts.shard_scale`). Scaled by d·C alone, DeepSeek-V3
        estimated at E = 64 unsharded read 110 MiB of optimizer state a rank under --zero 1, where the estimate
        made sharded holds 3,087."""
        estimate = self._estimate
        if estimate is None:
            return costs
        sharded = bool(estimate.parallelism.get("sharded_optimizer"))
        if not (sharded or sched.sharded_optimizer):
            return costs
        from .experts import weight_shards  # an estimate's: the cost flags' runs import no profile schema

        shards = estimate.degrees[2] * int(estimate.parallelism.get("context", 1))
        spread = float(weight_shards(int(estimate.parallelism.get("expert", 1)),
                                     estimate.parallelism.get("expert_tensor"), estimate.degrees[0]))
        overhead_ms = float(estimate.curve.get("kernel_overhead_ms", 0.0))

        def resharded(c: StageCosts) -> StageCosts:
            c = replace(c, expert_shards=spread)
            held = c.shard_scale / shards if sharded else 1.0  # what the estimate's rank holds, in its unsharded rank's
            holds = c.shard_scale / sched.gradient_ranks if sched.sharded_optimizer else 1.0  # the schedule's, alike
            return replace(c, optimizer_state_bytes=round(c.optimizer_state_bytes / held),
                           opt_ms=overhead_ms + (c.opt_ms - overhead_ms) * holds / held)

        return replace(costs, stages=tuple(resharded(c) for c in costs.stages))

    def estimate_links(self, sched: Schedule) -> PlacementLinks:
        """An estimated profile's links for the schedule's placement: its own t, p = the schedule's devices and
        d = its replicas, priced from the placement it records where they are not the estimate's own. An
        estimate that does not record it (an older pipesim's) is refused where a link it would use differs."""
        from .estimate import EstimateError, PlacementLinks, links_of

        estimate = self.measured.estimate
        t, p, d = estimate.degrees
        if (sched.num_devices, sched.data_parallel) == (p, d):
            return PlacementLinks(estimate.tensor_link, estimate.stage_link, estimate.data_parallel_link)
        if estimate.placement is None:
            refusal = placement_refusal(estimate, sched.num_devices, sched.data_parallel)
            if refusal:
                raise CostError(refusal)
            return PlacementLinks(estimate.tensor_link, estimate.stage_link, estimate.data_parallel_link)
        try:
            return links_of(estimate.placement, t, sched.num_devices, sched.data_parallel,
                            int(estimate.parallelism.get("context", 1)),
                            estimate.parallelism.get("rank_order", "pipesim"),
                            bool(estimate.parallelism.get("sequence_parallel", False)))
        except EstimateError as exc:
            raise CostError(f"--profile: {exc}") from None

    def data_parallel_link(self, sched: Schedule) -> CollectiveLink:
        """The link a stage's d replicas synchronise over: an estimated profile's (the data-parallel group of the
        schedule's placement), else the α–β fit of a calibrated profile's measured all-reduce, else --comm's time
        per ring step with `network_gb_s` (unlimited where not given)."""
        measured = self.measured
        if measured is not None and measured.estimate is not None:
            return self._estimated_collective_link(sched)
        if measured is not None and measured.allreduce is not None:
            return fitted_link(measured.allreduce.world_size, [(p.nbytes, p.ms) for p in measured.allreduce.points])
        rate = self.network_gb_s * 1e6 if self.network_gb_s is not None else math.inf
        return CollectiveLink(self.comm_ms, rate, "--comm per ring step" + (
            f" at {self.network_gb_s:g} GB/s" if self.network_gb_s is not None else ""))

    def _estimated_collective_link(self, sched: Schedule) -> CollectiveLink:
        """An estimate's data-parallel link for the schedule's placement; where the estimate records its placement,
        with the gradient group's ranks on each node and the node link's latency, which NCCL's tuner prices by."""
        from .estimate import gradient_ranks_per_node

        estimate = self.measured.estimate
        link = self.estimate_links(sched).data
        placement = estimate.placement
        if placement is None:
            return CollectiveLink(link.latency_ms, link.bytes_per_ms, f"the estimate's {link.kind}")
        t, c, node = estimate.degrees[0], int(estimate.parallelism.get("context", 1)), placement.gpus_per_node
        p, ranks = sched.num_devices, sched.gradient_ranks
        per_node = gradient_ranks_per_node(node, t, p, c, sched.data_parallel,
                                           estimate.parallelism.get("rank_order", "pipesim"))
        return CollectiveLink(link.latency_ms, link.bytes_per_ms, f"the estimate's {link.kind}",
                              min(per_node, ranks), placement.node_link.latency_ms, placement.node_link.kind)

    def _costs(self, sched: Schedule, bounds: Sequence[int] | None) -> Costs:
        n, copies = sched.num_stages, sched.graph.copies  # several model copies: each copy's stage s is stage s
        if self.measured is not None:
            cut = list(bounds) if bounds is not None else self.cut(sched)
            costs = profile_costs(self.measured, self.optimizer, cut,
                                  dag=sched.graph.edges != StageGraph.chain(n, copies).edges,
                                  shared_gpu=self._shares_gpu(sched))
            if sched.expert_parallel > 1 and self.measured.estimate is None:
                costs = measured_all_to_alls(costs, self.measured, cut, sched.expert_parallel)
            return replace(costs, stages=costs.stages * copies)
        held = Counter(sched.placement)  # model stages per device
        share = {"stage": [1.0] * n, "device": [copies / held[d] for d in sched.placement],
                 "model": [copies / n] * n}[self.per]
        values = {flag: self._per_stage(flag, given, sched, share) for flag, given in self.per_stage.items()}

        def shared(ms: float | None) -> list[float] | None:  # an update's work scales with the stage's weights
            return None if ms is None else [ms * f for f in share]

        opt, pred, avg = shared(self.opt_ms), shared(self.pred_ms), shared(self.avg_ms)
        costs = Costs.per_stage(
            n, fwd_ms=values["--fwd"], bwd_ms=values["--bwd"], wgrad_fraction=self.wgrad_fraction,
            param_mb=values["--param-mb"], activation_mb=values["--activation-mb"], output_mb=values["--output-mb"],
            optimizer=self.optimizer, microbatch_size=self.microbatch_size, precision=self.precision)
        return replace(costs, stages=tuple(
            replace(c, opt_ms=opt[k], pred_ms=(pred or opt)[k], avg_ms=(avg or opt)[k])
            for k, c in enumerate(costs.stages)))

    def _shares_gpu(self, sched: Schedule) -> bool:
        """Whether the schedule's ranks share GPUs on this scenario's cluster, which picks the timing of the
        profile's passes (`StagePasses.issued`). Only a topology (`--cluster`'s compute resources, or a measured
        run's placement, planning/replay.py) puts two ranks on one GPU; the clusters `links` builds from a profile's
        link or --comm give each rank its own, so none is built here, once for each of a search's costings."""
        return (self.topology is not None
                and any(stage.passes is not None and stage.passes.idle is not None for stage in self.measured.stages)
                and self.topology.shares_compute(sched.num_devices))

    def _per_stage(self, flag: str, given: list[float], sched: Schedule, share: list[float]) -> list[float]:
        """One flag's values, one per model stage; CostError names the flag and the lengths allowed."""
        n, p, k = sched.num_stages, sched.num_devices, len(given)
        if flag == "--output-mb":  # per transfer: never split
            if k in (1, n):
                return given * n if k == 1 else list(given)
        elif self.per == "device" and k in (1, p):  # a device's share (each device's, for p values), split
            return [given[d if k > 1 else 0] * share[s] for s, d in enumerate(sched.placement)]
        elif self.per == "device" and k == n:  # each model stage's
            return list(given)
        elif k in (1, n):
            return [given[s if k > 1 else 0] * share[s] for s in range(n)]
        where = f"in {self.source}" if self.source else f"for {sched.method}"
        raise CostError(f"{flag}: {k} values given; {allowed_lengths(flag, self.per, p, n)} {where}")

    def stage_flags(self, sched: Schedule) -> list[str]:
        """The cost flags whose lists `sched` reads as one value per model stage (p·v values) rather than one
        per device: `simulate` says which in its table."""
        if self.measured is not None or self.per != "device":
            return []
        n, p = sched.num_stages, sched.num_devices
        return [flag for flag, given in self.per_stage.items() if flag != "--output-mb" and len(given) == n != p]

    def add_reserve(self, sched: Schedule, trace: Trace, bounds: Sequence[int] | None = None,
                    links: Cluster | None = None, reserves: Sequence[int] | None = None) -> None:
        """With `allocations`, each device's caching-allocator reserve in the trace's memory (sim/caching_allocator.py
        `device_reserves`, `add_reserve`): each model stage's layers cut as its costs are (at `bounds`, default
        `cut`), each device bounded by its memory (`memory_limits`, read off `links`); `reserves`, where given, are
        those found already (`reserves`). Then the parts' curves of the device whose peak that makes highest only
        (`keep_fullest_parts`)."""
        if self.allocations is not None:
            add_reserve(trace, self.reserves(sched, trace, bounds, links) if reserves is None else reserves)
        keep_fullest_parts(trace)

    def reserves(self, sched: Schedule, trace: Trace, bounds: Sequence[int] | None = None,
                 links: Cluster | None = None, devices: Sequence[int] | None = None) -> list[int]:
        """`add_reserve`'s reserves, without adding them: of `devices` alone where given (a device's replay is its
        own: tune replays a trace's devices in several processes), in their order."""
        return self._reserves(sched, trace, list(bounds) if bounds is not None else self.cut(sched),
                              self.memory_limits(sched, links), devices)

    def _reserves(self, sched: Schedule, trace: Trace, cut: list[int], limits: Sequence[int | None],
                  devices: Sequence[int] | None = None) -> list[int]:
        """Each device's caching-allocator reserve in `trace` within its memory (`limits`, `memory_limits`), run with
        `sched`'s stages cut at `cut`, the model outputs a stage keeps concatenated after its device's last backward
        of a mini-batch where `pp_runtime`'s runtime does (`merges_outputs`), and what a split backward keeps from I
        until W as the runtime keeps it, as the costs do (`held_as_runtime`): torch's every saved tensor
        (`LayerAllocations.wgrad_kept` None); each stage's backward passes running its layers' as its costs do
        (`stage_passes`)."""
        from ..profiles.schema import stage_passes

        per_copy = sched.graph.stages_per_copy
        bounds = {stage: (cut[stage % per_copy], cut[stage % per_copy + 1]) for stage in range(sched.num_stages)}
        allocations = (tuple(replace(layer, wgrad_kept=None) for layer in self.allocations)
                       if keeps_saved_until_weights(self.pp_runtime) else self.allocations)
        layers = {stage: allocations[start:stop] for stage, (start, stop) in bounds.items()}
        merged = ({stage: costs["model_output_bytes"] for stage, costs in enumerate(trace.meta.costs)}
                  if trace.meta.costs and merges_outputs(self.pp_runtime) else None)  # as the trace's costs held them
        runs = ({stage: {name: run and run[0] for name, run in
                         stage_passes(self.measured.layers[start:stop], start).items()}
                 for stage, (start, stop) in bounds.items()} if self.measured is not None else None)
        return device_reserves(trace, layers, limits, self.expandable_segments,
                               adam=self.optimizer in ("adam", "adamw"), merged_bytes=merged, runs=runs,
                               devices=devices)

    def cut(self, sched: Schedule) -> list[int]:
        """The profile's layers cut into one copy's model stages of `sched` as `stage_cut` says (`profile_bounds`).
        fit: the balanced cut where every device holds it within its memory (`stage_memory`), else the cut whose
        slowest stage is the fastest of those every device holds within its memory (`fitted_cut`), searched once
        a scenario and schedule (`_FITTED`): their costs, buckets, reserve and simulate's JSON all ask for it."""
        per_copy = sched.graph.stages_per_copy
        balanced = profile_bounds(self.measured, per_copy, self.stage_cut, device_stages(sched, per_copy),
                                  self.sized_by_flags)
        if self.stage_cut != FIT:
            return balanced
        key = (id(self), id(sched))
        if key not in _FITTED:
            _FITTED[key] = self._fitted(sched, balanced)
            for owner in (self, sched):
                weakref.finalize(owner, _FITTED.pop, key, None)
        return list(_FITTED[key])

    def _fitted(self, sched: Schedule, balanced: list[int]) -> list[int]:
        """`cut` under --stage-cut fit, searched. With `allocations`, the caching allocator's reserve is known only
        once a cut runs (`_reserves`), so the cut found is simulated: where a device's bound and its reserve there
        pass its memory, its memory less that reserve bounds the next search, until the cut found fits as
        simulated (`FIT_ROUNDS` searches at most: a device's bound falls each round, or the cut fits)."""
        check_stage_cut(self.stage_cut, self.pp_runtime)
        links = self.links(sched)  # built once: the limits and each round's simulation read it
        limits = self.memory_limits(sched, links)
        if None in limits:
            raise CostError(f"--stage-cut {FIT} cuts for each device's memory, which is not known here: give --gpu, "
                            "a profile of a device with its memory, or a --cluster with memory_gib")
        from ..profiles.schema import layer_costs, profile_stage_time
        from ..sim import simulate

        memory, layers, bounds = self.stage_memory(sched), layer_costs(self.measured.layers, self.optimizer), limits
        stage_time = profile_stage_time(self.measured)
        try:
            for _ in range(FIT_ROUNDS):
                cut = fitted_cut(sched, memory, bounds, balanced, layers, stage_time)
                if self.allocations is None:
                    return cut
                trace = simulate(sched, self.costs(sched, cut), links, part_curves=False)  # for its reserves
                reserves = self._reserves(sched, trace, cut, limits)
                if all(memory.device(sched, d, cut) + reserve <= limit
                       for d, (reserve, limit) in enumerate(zip(reserves, limits))):
                    return cut
                bounds = [min(bound, limit - reserve) for bound, limit, reserve in zip(bounds, limits, reserves)]
            raise PartitionError(f"no cut of {len(layers)} layers found in {FIT_ROUNDS} searches that fits every "
                                 "device's memory beside its caching allocator's reserve")
        except PartitionError as exc:
            raise CostError(f"{sched.method}: --stage-cut {FIT}: {exc} (--stage-cut balanced with --memory shows "
                            "each device's peak)") from None  # the method first: a skip names it once

    def stage_memory(self, sched: Schedule) -> StageMemory:
        """What each model stage of `sched` holds on its device for every range of the profile's layers
        (`StageMemory`): their weights, gradients and optimizer state as the simulator holds them
        (`held_static_parts`, the weight versions its order keeps besides), an activation and a gradient in transfer
        at each end, the most any of its layers' passes creates and frees within itself, and its micro-batches'
        activations, each held from its forward until its backward or input-gradient pass, and after the latter
        what its weight pass reads until that ends, as the simulator holds them (sim/costs.py `wgrad_held`). The
        caching allocator's reserve is not counted."""
        from ..profiles.schema import layer_costs, wgrad_held_ranges

        layers, t = self.measured.layers, sched.table
        n = len(layers)
        costs = self._sharded_for(profile_costs(self.measured, self.optimizer, range(n + 1)), sched)
        held = [held_static_parts(sched, [c]) for c in costs.stages]
        # the runtime's buffer is one a process, its layers' largest (`held_static_parts`): a range's most, not sum;
        # a tied layer's weights and what they hold once where the range holds its tie too (`tied_pairs`)
        tied = tied_pairs(layers)
        static = (range_sums(sum(parts.values()) - parts["runtime_buffers"] - _weights_held(parts) for parts in held)
                  + range_sums(map(_weights_held, held), tied)
                  + _range_maxima([parts["runtime_buffers"] for parts in held]))
        weights = range_sums((c.param_bytes for c in costs.stages), tied)
        transient = _range_maxima([max(layer.transient_bytes.values(), default=0) for layer in layers])
        received = 2 * np.array([0, *(layer.output_bytes for layer in layers[:-1]), 0])  # into layer i, and back
        versions = peak_per_stage(t, np.zeros(len(t.kind), dtype=np.int64), version_reads(sched)[1], sched.num_stages)
        activations = activation_ranges(layer_costs(layers, self.optimizer))
        held_until_w = wgrad_held(activations, *wgrad_held_ranges(layers, activations), costs.wgrad_activation_fraction)
        return StageMemory([static + received[:, None] + received[None, :] + kept * weights for kept in versions],
                           transient, activations=activations, held_until_w=np.add(*held_until_w),
                           together=_held_together(sched))

    def within_reserve(self, sched: Schedule, trace: Trace, links: Cluster, rebuild: Callable[[Scenario], Schedule],
                       rerun: Callable[[Schedule, Cluster], Trace]) -> tuple[Schedule, Trace, Summary,
                                                                             list[MemoryCheck], SearchedAgain | None]:
        """A searched order (auto's) and its run (`trace`, its reserve added), searched again where the caching
        allocator's reserve took a device past its memory: the search caps each device's tensors at its memory,
        and the reserve comes on top (Llama 3.1 8B at p = 8, R = 2: 82,806 MiB of 81,920, the tensors 80,931). Each
        search leaves each device what the order before overran it by (`search_held_bytes`), up to
        SEARCHES_WITHIN_RESERVE times, until one fits, else the last is kept; `rebuild` builds the order for a
        scenario and `rerun` runs it on its links. Returns the order, its run with its reserve, the run's summary
        and memory checks, and what the searches again left (None: none ran)."""
        from .. import traces  # looked up when called, as simulate looked it up before this moved here

        summarize = traces.summarize
        summary = summarize(trace)
        checks = self.memory_checks(sched, summary, links)
        method = METHODS.get(sched.method)  # none for a schedule file's order
        if not (method is not None and method.needs_costs and self.allocations is not None):
            return sched, trace, summary, checks, None
        first_peak_bytes, held = max(check.used_bytes for check in checks), [0] * sched.num_devices
        for _ in range(SEARCHES_WITHIN_RESERVE):
            over = [math.ceil(check.used_bytes - check.limit_bytes) if check.out_of_memory else 0 for check in checks]
            if not any(over):
                break
            held = [before + more for before, more in zip(held, over)]
            try:
                again = rebuild(replace(self, search_held_bytes=tuple(held)))
            except ScheduleError:  # no order fits in what is left
                break
            links = self.links(again)
            trace = rerun(again, links)
            self.add_reserve(again, trace, links=links)
            sched, summary = again, summarize(trace)
            checks = self.memory_checks(sched, summary, links)
        return sched, trace, summary, checks, SearchedAgain(first_peak_bytes, max(held)) if any(held) else None

    def memory_limits(self, sched: Schedule, links: Cluster | None = None) -> tuple[int | None, ...]:
        """Each device's memory in bytes (None: not known): `memory_bytes`, the cluster file's `memory_gib`, or the
        profiled device's memory (or the calibration's cap). `links`: `links(sched)` where the caller holds it, not
        built again."""
        if self.memory_bytes is not None:
            return (self.memory_bytes,) * sched.num_devices
        links = links if links is not None else self.links(sched)
        if links.memory_bytes:
            return tuple(links.memory_bytes[:sched.num_devices])
        if self.measured is not None:
            env = self.measured.environment
            return (env.memory_cap_bytes or env.device_memory_bytes or None,) * sched.num_devices
        return (None,) * sched.num_devices

    def memory_checks(self, sched: Schedule, summary: Summary, links: Cluster | None = None) -> list[MemoryCheck]:
        """Each device's simulated peak (`summary`'s, of `sched`'s run) against its memory (`memory_limits`), as
        simulate and sweep mark a run out of memory; `links` as `memory_limits` takes it."""
        links = links if links is not None else self.links(sched)
        return links.memory_checks([device.peak_memory_mb * MIB for device in summary.devices],
                                   self.memory_limits(sched, links))

    def links(self, sched: Schedule) -> Cluster:
        if self.topology is not None:
            return self.topology
        if self.measured is not None and self.measured.estimate is not None:
            link = self.estimate_links(sched).stage
            return profile_cluster(self.measured, sched.num_devices, self.overlap_comm,
                                   ((0, link.latency_ms, link.bytes_per_ms),))
        if self.measured is not None and self.measured.link:
            return profile_cluster(self.measured, sched.num_devices, self.overlap_comm)
        return Cluster.uniform(sched.num_devices, self.comm_ms, overlap_comm=self.overlap_comm)


@dataclass(frozen=True)
class SearchedAgain:
    """`Scenario.within_reserve`'s searches again: the first order's peak (the most a device's memory held) and
    the most a device was left free for the reserve."""

    first_peak_bytes: float
    held_bytes: int


@dataclass(frozen=True)
class CollectiveLink:
    """The link data-parallel replicas synchronise over, as `hardware.collectives` prices collectives on it:
    the latency of one ring step (ms) and the bytes per ms per GPU and direction; `source` says where it comes
    from. Where the group's ranks on each node are known (`per_node`, an estimate's placement), its collectives
    are priced as NCCL's tuner prices them (`nccl_all_reduce_ms`): the steps between nodes at `latency_ms`, those
    inside one at `node_latency_ms` over the node's `node_link` (whose kind sets its LL protocol's hops); else as a
    plain ring (or tree) of `latency_ms` steps."""

    latency_ms: float
    bytes_per_ms: float
    source: str
    per_node: int | None = None
    node_latency_ms: float = 0.0
    node_link: str = "nvlink"

    def all_reduce_ms(self, nbytes: float, ranks: int, tree_correction: bool = True) -> float:
        """An all-reduce; without `tree_correction`, NCCL's tree at its full rate: a bound from below that is
        concave in the bytes (`nccl_all_reduce_ms`)."""
        from ..hardware.collectives import all_reduce_ms, nccl_all_reduce_ms

        if self.per_node is None:
            return all_reduce_ms(nbytes, ranks, self.latency_ms, self.bytes_per_ms)
        return nccl_all_reduce_ms(nbytes, ranks, self.per_node, self.node_latency_ms, self.latency_ms,
                                  self.bytes_per_ms, tree_correction, self.node_link)

    def reduce_scatter_ms(self, nbytes: float, ranks: int) -> float:
        """A reduce-scatter, or an all-gather (the same traffic reversed)."""
        from ..hardware.collectives import nccl_reduce_scatter_ms, reduce_scatter_ms

        if self.per_node is None:
            return reduce_scatter_ms(nbytes, ranks, self.latency_ms, self.bytes_per_ms)
        return nccl_reduce_scatter_ms(nbytes, ranks, self.per_node, self.node_latency_ms, self.latency_ms,
                                      self.bytes_per_ms)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise CostError(f"data-parallel link: latency must be a finite number of ms >= 0 (got {self.latency_ms})")
        if not self.bytes_per_ms > 0:
            raise CostError(f"data-parallel link: bandwidth must be > 0 (got {self.bytes_per_ms} bytes/ms)")


def fitted_link(ranks: int, points: Sequence[tuple[int, float]]) -> CollectiveLink:
    """The α–β link whose ring all-reduce over `ranks` fits measured (bytes, ms) points best (least squares):
    a ring all-reduce takes 2(n-1) steps of α, moving 2(n-1)/n of the buffer through each rank's link."""
    nbytes, ms = (np.asarray(column, dtype=float) for column in zip(*points))
    slope, intercept = np.polyfit(nbytes, ms, 1) if len(points) > 1 else (ms[0] / nbytes[0], 0.0)
    steps = 2 * (ranks - 1)
    return CollectiveLink(max(intercept, 0.0) / steps, steps / ranks / max(slope, 1e-300),
                          f"the profile's all-reduce over {ranks} ranks, fitted")


def _grouped(ufunc: np.ufunc, groups: np.ndarray, values: np.ndarray, size: int, empty: int) -> np.ndarray:
    """`ufunc` (np.minimum, np.maximum) over the `values` of each of `size` groups; `empty` where a group has none."""
    out = np.full(size, empty)
    ufunc.at(out, groups, values)
    return out


def collective_costs(costs: Costs, sched: Schedule, link: CollectiveLink, expert_replicas: int | None = None,
                     empty: Set[int] = frozenset(), or_faster: str = " or a faster link") -> Costs:
    """Each stage's REDUCE and GATHER priced for the schedule's d·C `gradient_ranks` on `link`: the gradients as
    accumulated (`StageCosts.gradient_bytes`, the precision's: Megatron-LM reduces float32 main gradients under
    --bf16 unless --grad-reduce-in-bf16, megatron/training/arguments.py `validate_args` at d98e8a64dd, and FSDP2
    in its reduce dtype) all-reduced, or with a sharded optimizer reduce-scattered, and the updated weights then
    all-gathered; NCCL's faster of ring and tree for an all-reduce. Under E-way expert parallelism the routed
    experts' share (`expert_param_bytes`) goes over the `expert_replicas` ranks that hold the same experts (None:
    d·C/E; folded over t·C·d, schedules/ranks.py: t·C·d/(E·ETP)), after the rest. The `empty` stages, which hold no
    layer (a layout's), issue none: Megatron-core's DDP has no bucket for them, nor torch's. `or_faster`: what the
    costs' source takes for a faster collective, which a refusal of one longer than an op may take names after
    fewer ranks."""
    d, sharded = sched.gradient_ranks, sched.sharded_optimizer
    expert_replicas = expert_replicas or d // sched.expert_parallel
    reduce = link.reduce_scatter_ms if sharded else link.all_reduce_ms

    def over_groups(collective: Callable[[float, int], float], nbytes: float, c: StageCosts) -> float:
        experts = c.expert_param_bytes / c.param_bytes if sched.expert_parallel > 1 and c.param_bytes else 0.0
        return over_expert_groups(collective, nbytes, experts, d, expert_replicas)

    stages = []
    for k, c in enumerate(costs.stages):
        if k in empty:
            stages.append(replace(c, reduce_ms=0.0, gather_ms=0.0))
            continue
        reduce_ms = over_groups(reduce, c.gradient_bytes, c)
        gather_ms = (over_groups(link.reduce_scatter_ms, c.gathered_weight_bytes, c) + c.gather_cast_ms if sharded
                     else 0.0)
        if (longest_ms := max(reduce_ms, gather_ms)) > MAX_MS:  # said by what sets it, not as StageCosts' field
            raise CostError(f"stage {k}'s data-parallel collectives over {d:,} ranks take {longest_ms:.3g} ms on "
                            f"their link, more than the {MAX_MS:g} ms an op may take: give fewer ranks "
                            f"(--data-parallel){or_faster}")
        stages.append(replace(c, reduce_ms=reduce_ms, gather_ms=gather_ms))
    return replace(costs, stages=tuple(stages))


def over_expert_groups(collective: Callable[[float, int], float], nbytes: float, expert_share: float, ranks: int,
                       expert_ranks: int) -> float:
    """A stage's `collective` of `nbytes` over `ranks`, the routed experts' `expert_share` of them over the
    `expert_ranks` that hold the same experts, after the rest (`collective_costs`; tune's least REDUCE)."""
    return collective(nbytes * (1 - expert_share), ranks) + (
        collective(nbytes * expert_share, expert_ranks) if expert_share else 0.0)


def scaled(costs: Costs, factor: float) -> Costs:
    """Every compute time (the stages' `*_ms` costs but their collectives' and all-to-alls') x factor, transfers,
    collectives and memory as they are: the same model on a faster or slower accelerator over the same network."""
    if factor == 1.0:
        return costs
    network = ("reduce_ms", "gather_ms", "all_to_all_fwd_ms", "all_to_all_bwd_ms", "ring_fwd_ms", "ring_bwd_ms")
    times = [{f.name: getattr(c, f.name) * factor for f in fields(c) if f.name.endswith("_ms")
              and f.name not in network and getattr(c, f.name) is not None} for c in costs.stages]
    for k, stage in enumerate(times):  # said of the factor that made it: StageCosts named the field alone
        if (longest := max(stage, key=stage.get, default=None)) is not None and not stage[longest] <= MAX_MS:
            raise CostError(f"--cost-scale {factor:g} makes stage {k}'s {longest} {stage[longest]:.3g}, more than "
                            f"the simulator takes (at most {MAX_MS:.3g} ms): give a smaller factor")
    return replace(costs, stages=tuple(replace(c, **stage) for c, stage in zip(costs.stages, times, strict=True)))


def allowed_lengths(flag: str, per: str, devices: int, stages: int) -> str:
    """The lengths a cost flag's list may have, in words."""
    if flag != "--output-mb" and per == "device":
        if devices == stages:
            return f"give one number, or one per device ({devices})"
        return f"give one number, one per device ({devices}) or one per model stage ({stages})"
    return f"give one number, or one per model stage ({stages})"


def profile_scenario(measured: Profile, optimizer: str, pp_runtime: str = "pipesim",
                     sized_by_flags: bool = False) -> Scenario:
    """The Scenario of a profile alone: its layers give every cost and size, its link (if measured) the
    transfers, `pp_runtime` whose pipeline runtime holds the boundary tensors (`sized_by_flags`:
    Scenario.sized_by_flags); the what-if fields are unused."""
    return Scenario(per_stage={}, wgrad_fraction=0.5, opt_ms=0.0, pred_ms=None, avg_ms=None, optimizer=optimizer,
                    microbatch_size=measured.environment.microbatch_size, comm_ms=0.0, overlap_comm=True,
                    measured=measured, pp_runtime=pp_runtime, sized_by_flags=sized_by_flags)


@dataclass(frozen=True)
class StageMemory:
    """What a schedule's model stages hold on their devices, each for every range [i, j) of a profile's layers
    (entry [i, j]): `held[s]`, model stage s's bytes held whatever runs (weights, gradients, optimizer state,
    transfers); `transient`, the most a pass of one of the layers creates and frees within itself; `activations`,
    what one micro-batch saves, held from its forward until its backward or input-gradient pass; `held_until_w`,
    what a split backward holds after its input-gradient pass until its weight pass ends (`wgrad_held`: under
    recomputation more than the activations); `together[d]`, every distinct count of micro-batches device d's
    stages hold at once (a row each: a column for each of its stages in their order, of the micro-batches from
    their forward, then a column for each of the micro-batches from their input-gradient pass; only those that no
    other row, nor a mix of two, holds as many of in every column, `_outermost`: the bytes each column weighs are
    never negative, so the most any row weighs is theirs)."""

    held: list[np.ndarray]
    transient: np.ndarray
    activations: np.ndarray
    held_until_w: np.ndarray
    together: list[np.ndarray]

    def stage(self, sched: Schedule, s: int) -> np.ndarray:
        """Model stage s alone at its most: its device's peak is at most its stages' sum (their peaks need not
        coincide, and one pass's transient runs at a time where pairs do not overlap), what the cut is found by."""
        counts = _stage_counts(self.together, sched, s)
        most = np.max([forward * self.activations + until_w * self.held_until_w for forward, until_w in counts],
                      axis=0, initial=0)
        return self.held[s] + self.transient + most

    def device(self, sched: Schedule, device: int, bounds: Sequence[int]) -> float:
        """Device `device`'s peak with its stages cut at one copy's `bounds`: their held bytes, the largest transient
        and the activations of the micro-batches its stages hold together at the most. Given the bounds of a copy's
        first stages only, what its stages among them hold: no more than once the rest are cut too."""
        per_copy, stages = sched.graph.stages_per_copy, sched.stages_on(device)
        cut = [(bounds[s % per_copy], bounds[s % per_copy + 1]) if s % per_copy + 1 < len(bounds) else None
               for s in stages]
        if not any(cut):
            return 0.0
        saved = np.array([table[r] if r else 0.0 for table in (self.activations, self.held_until_w) for r in cut])
        return (sum(self.held[s][r] for s, r in zip(stages, cut) if r) + max(self.transient[r] for r in cut if r)
                + float(np.max(self.together[device] @ saved)))

    def pair(self, sched: Schedule, device: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Device `device`'s peak (`device`'s rule) where it holds one copy's stage k (the front) and stages-1-k (the
        back), as bounds that each add a front range's bytes to a back range's, as `mirrored_partition` takes them:
        one a row of `together` and the side whose transient is held, so the device holds its stages within its
        memory exactly where every one is within it (their peaks held where they coincide, not each stage's own
        summed)."""
        per_copy, stages = sched.graph.stages_per_copy, sched.stages_on(device)
        front = np.array([s % per_copy == k for s in stages])
        none = np.zeros_like(self.transient)

        def side(mine: np.ndarray, counts: np.ndarray) -> np.ndarray:  # one side's stages with their counts held
            return sum((self.held[s] + forward * self.activations + until_w * self.held_until_w
                        for s, forward, until_w, on in zip(stages, counts, counts[len(stages):], mine) if on), none)

        bounds = []
        for counts in self.together[device]:
            in_front, in_back = side(front, counts), side(~front, counts)
            bounds += [(in_front + self.transient, in_back)] * bool(front.any())
            bounds += [(in_front, in_back + self.transient)] * bool(not front.all())
        return bounds


def _range_maxima(values: Sequence[int]) -> np.ndarray:
    """Entry [i, j] (i < j): the most of items i .. j-1 of `values`; 0 elsewhere (`range_sums`' for a maximum)."""
    maxima = np.zeros((len(values) + 1, len(values) + 1))
    for i in range(len(values)):
        maxima[i, i + 1:] = np.maximum.accumulate(values[i:])
    return maxima


def stage_held_counts(sched: Schedule) -> list[np.ndarray]:
    """Per model stage, every distinct (micro-batches it holds from their forward, those it holds from their
    input-gradient pass until their weight pass) at once, as `StageMemory.stage` weighs them (tune's partition)."""
    t = sched.table
    adds, takes, until_w = _held_steps(t.kind)
    counts = []
    for s in range(sched.num_stages):  # its own columns of `_held_together`'s rows: its device's other stages add 0
        rows = np.flatnonzero((t.device == sched.placement[s]) & (t.stage == s))
        steps = np.zeros((2 * len(rows), 2), dtype=np.int64)
        steps[0::2, 0], steps[1::2, 0], steps[1::2, 1] = adds[rows], takes[rows], until_w[rows]
        counts.append(np.unique(np.cumsum(steps, axis=0), axis=0))
    return counts


def _stage_counts(together: list[np.ndarray], sched: Schedule, s: int) -> np.ndarray:
    """Model stage s's columns of its device's `_held_together` rows, each distinct pair once."""
    stages = sched.stages_on(sched.placement[s])
    column = stages.index(s)
    return np.unique(together[sched.placement[s]][:, [column, column + len(stages)]], axis=0)


def _held_steps(kind: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of an order's table: the micro-batches from their forward it adds at its start and takes at its end (a
    forward adds one, a backward or input-gradient pass takes one), and those it adds at its end until their weight
    pass (an I adds one, a W takes one): sim/engine.py `_memory_tables`' rules."""
    return ((kind == KIND_CODE[Kind.F]).astype(np.int64), -kind_mask(kind, Kind.B, Kind.I).astype(np.int64),
            kind_mask(kind, Kind.I).astype(np.int64) - kind_mask(kind, Kind.W))


def _held_together(sched: Schedule) -> list[np.ndarray]:
    """Per device, every distinct count of micro-batches each of its stages holds at once (`StageMemory.together`),
    in its order: a forward adds one at its start, a backward or input-gradient pass takes one at its end, which
    the latter adds to what its stage holds until its weight pass, whose end takes one (sim/engine.py
    `_memory_tables`)."""
    t = sched.table
    adds, takes, until_w = _held_steps(t.kind)
    together = []
    for device in range(sched.num_devices):
        stages, rows = sched.stages_on(device), np.flatnonzero(t.device == device)
        column = np.minimum(np.searchsorted(stages, t.stage[rows]), len(stages) - 1)  # other rows add nothing
        steps = np.zeros((2 * len(rows), 2 * len(stages)), dtype=np.int64)
        starts, ends = 2 * np.arange(len(rows)), 2 * np.arange(len(rows)) + 1
        steps[starts, column] = adds[rows]
        steps[ends, column] = takes[rows]
        steps[ends, column + len(stages)] = until_w[rows]
        counts = np.unique(np.cumsum(steps, axis=0), axis=0)
        covered = (counts[:, None, :] >= counts[None, :, :]).all(axis=2)  # [i, j]: row i holds row j's at least
        together.append(_outermost(counts[covered.sum(axis=0) == 1]))  # held by no other row (each covers itself)
    return together


def _outermost(counts: np.ndarray) -> np.ndarray:
    """The rows of `counts` (distinct, none held by another at every column) less each, one at a time, that a mix of
    two rows left holds at every column (t·one + (1 - t)·other, 0 <= t <= 1): weighed by bytes that are never
    negative, such a row is never above both, so the most any row weighs is the rows left's."""
    kept = np.ones(len(counts), dtype=bool)
    for row in range(len(counts)):
        others = counts[kept & (np.arange(len(counts)) != row)]
        slope = others[:, None, :] - others[None, :, :]  # [i, j, column]: t·slope >= need, where t weighs row i
        need = counts[row] - others[None, :, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = need / slope
        low = np.max(np.where(slope > 0, ratio, 0.0), axis=2, initial=0.0)
        high = np.min(np.where(slope < 0, ratio, 1.0), axis=2, initial=1.0)
        held = np.all((slope != 0) | (need <= 0), axis=2) & (low <= high)
        kept[row] = not held.any()
    return counts[kept]


def fitted_cut(sched: Schedule, memory: StageMemory, limits: Sequence[int], balanced: list[int],
               layers: Sequence[LayerCost], stage_time: RangeCosts) -> list[int]:
    """`balanced` where every device holds its stages within its limit (`StageMemory.device`); else the cut whose
    slowest stage is fastest among those where every device holds its stages within it: exactly where each device
    holds one stage of a copy or a mirrored pair (k and p-1-k: DualPipe, the V-shapes; `mirrored_partition`), by
    the device's peak where its stages' counts coincide (`StageMemory.pair`); where a device holds more
    (interleaved chunks), searched by what each device holds (`searched_partition`), and where that search is too
    long, the fastest cut with each stage within its device's memory (`StageMemory.stage`) where every device then
    holds its stages together (as tune's `_splitter` takes it: the fastest of all that fit, since every stage of
    one fits its device), else each stage within a share of its device's memory, the faster of two splits: as
    the stages hold it at `balanced`, and equal (1/v of a device of v stages). A stage's time: `stage_time`'s
    (profiles/schema.py `stage_time`). PartitionError where none fits."""
    per_copy = sched.graph.stages_per_copy
    if all(memory.device(sched, device, balanced) <= limit for device, limit in enumerate(limits)):
        return balanced
    held = [{s % per_copy for s in sched.stages_on(device)} for device in range(sched.num_devices)]
    if all(ks <= {min(ks), per_copy - 1 - min(ks)} for ks in held):
        def pair_bytes(k: int) -> list[PairBytes]:
            return [(front, back, limits[d]) for d, ks in enumerate(held) if k in ks or per_copy - 1 - k in ks
                    for front, back in memory.pair(sched, d, k)]

        return mirrored_partition(layers, per_copy, pair_bytes, stage_time)

    def fits(prefix: list[int]) -> bool:  # the devices holding the stage just cut, by what their stages cut hold
        return all(memory.device(sched, d, prefix) <= limits[d] for d, ks in enumerate(held) if len(prefix) - 2 in ks)

    searched = searched_partition(layers, per_copy, fits, stage_time=stage_time)
    if searched is not None:
        return searched
    stage_bytes = [memory.stage(sched, s) for s in range(sched.num_stages)]
    whole = _within_shares(sched, stage_bytes, _shares(sched, limits, None), layers, stage_time)
    if whole is not None and all(memory.device(sched, d, whole) <= limit for d, limit in enumerate(limits)):
        return whole
    at_balanced = [stage_bytes[s][balanced[s % per_copy], balanced[s % per_copy + 1]] for s in range(len(stage_bytes))]
    cuts = [cut for cut in (_within_shares(sched, stage_bytes, _shares(sched, limits, weights), layers, stage_time)
                            for weights in (at_balanced, [1] * len(stage_bytes))) if cut is not None]
    if not cuts:
        raise PartitionError(f"no cut of {len(layers)} layers into {per_copy} stages found that fits every device's "
                             "memory")
    ms = stage_time(0)
    return min(cuts, key=lambda cut: max(ms[start, stop] for start, stop in itertools.pairwise(cut)))


def _shares(sched: Schedule, limits: Sequence[int], weights: Sequence[float] | None) -> dict[int, float]:
    """Per model stage s, its device's memory times weights[s] over its device's stages' weights (so that the shares
    add up to the device's memory); None: the device's whole memory, each."""
    return {s: limits[d] * (1.0 if weights is None else weights[s] / sum(weights[t] for t in sched.stages_on(d)))
            for d in range(sched.num_devices) for s in sched.stages_on(d)}


def _within_shares(sched: Schedule, stage_bytes: Sequence[np.ndarray], budget: dict[int, float],
                   layers: Sequence[LayerCost], stage_time: RangeCosts) -> list[int] | None:
    """The cut whose slowest stage is fastest where each model stage s holds at most budget[s] bytes, None where
    none does."""
    per_copy = sched.graph.stages_per_copy

    def share(k: int) -> np.ndarray:  # the fullest of one copy's stage k's model stages, in shares of its budget
        return np.max([stage_bytes[s] / budget[s] for s in budget if s % per_copy == k], axis=0)

    try:
        return partition(layers, per_copy, 1, share, stage_time)
    except PartitionError:
        return None


def check_stage_cut(stage_cut: str, pp_runtime: str) -> None:
    """Refuse fit beside a runtime whose boundary tensors `StageMemory` does not count (CostError): refused once
    for the flags, not skipped by every configuration of a sweep."""
    if stage_cut == FIT and pp_runtime != "pipesim":
        raise CostError(f"--stage-cut {FIT} counts the transfers pipesim's runtime holds; the receive buffers "
                        f"--pp-runtime {pp_runtime} keeps are not counted: use --stage-cut balanced")


def device_stages(sched: Schedule, stages: int) -> tuple[tuple[int, ...], ...]:
    """Per device of `sched`, the stages of a cut into `stages` (one copy's) it runs: its model stages, each copy's
    stage k as k (`partition`'s `devices`)."""
    return tuple(tuple(s % stages for s in held) for held in sched.stages_by_device)


# The cuts that may leave a stage between the first and the last empty (`gives_layers`), which a refusal of more
# stages than a model has layers a stage may start at names as the other fix (GLM-5.2's p·v = 26 of 25 starts)
EMPTYING_CUTS = f"--stage-cut {LAYOUT}STRING or {LAYERS}N,N,..."


def profile_bounds(measured: Profile, num_stages: int, stage_cut: str = "balanced",
                   devices: Sequence[Sequence[int]] | None = None, sized_by_flags: bool = False) -> list[int]:
    """The profile's layers cut into `num_stages` as `stage_cut` says (STAGE_CUTS, `first_last`, `layer_counts`,
    `layout_of`: a layout's m is the --mtp-layers layer, and its last-stage rule is checked where `devices` is
    given). Balanced: the profile's own partition for its stage count; other counts re-partition its layers for time
    alone (the calibration's memory cap planned for its own stage count, so it is not applied here), the busiest
    device least busy among the cuts of the least slowest stage where `devices` run several stages each
    (`partition`). `sized_by_flags`: Scenario.sized_by_flags."""
    from ..profiles.schema import layer_costs, profile_stage_time

    refused = None if gives_layers(stage_cut) else too_many_stages(
        f"the schedule's {num_stages:,} model stages (--stages x --chunks)", num_stages, measured.model.name,
        measured.model.options, measured.layers, profiled=not sized_by_flags, emptied_by=EMPTYING_CUTS)
    if refused is not None:
        raise CostError(refused)
    bounds = _given_bounds(measured, num_stages, stage_cut, devices)
    if bounds is None:
        if num_stages == measured.partition.stages:
            return measured.partition.bounds
        return partition(layer_costs(measured.layers, measured.partition.optimizer), num_stages,
                         stage_time=profile_stage_time(measured), devices=devices)
    refused = starts_refusal(follows_flags(measured.layers), bounds)
    if refused is not None:
        raise CostError(f"--stage-cut {stage_cut}: {refused}")
    return bounds


def _given_bounds(measured: Profile, num_stages: int, stage_cut: str,
                  devices: Sequence[Sequence[int]] | None) -> list[int] | None:
    """The bounds `stage_cut` gives in so many layers a stage, by blocks or as a layout (`profile_bounds`); None
    for a balanced cut."""
    counts = layer_counts(stage_cut)  # each form read once, by its prefix: first_last would read the others again
    if counts is not None:
        if len(counts) != num_stages or sum(counts) != len(measured.layers):
            raise CostError(f"--stage-cut {stage_cut}: give the schedule's p·v = {num_stages} model stages' layers, "
                            f"{len(measured.layers)} in all (got {len(counts)} stages, {sum(counts)} layers)")
        return [0, *itertools.accumulate(counts)]
    layout = layout_of(stage_cut)
    ends = first_last(stage_cut) if layout is None else None
    if stage_cut in BLOCK_CUTS or ends is not None or layout is not None:
        # a hybrid's blocks are one kind whatever their mixers (workload/models.py `MIXERS_ATTRIBUTE`)
        kinds = [(layer.name.partition(":")[2] or layer.name).partition("[")[0] for layer in measured.layers]
        try:
            if layout is not None:
                return layout_blocks(kinds, num_stages, layout, int(measured.model.options.get("mtp_layers", 0)),
                                     MTP_KIND, devices)
            if ends is not None:
                return first_last_blocks(kinds, num_stages, *ends)
            return BLOCK_CUTS[stage_cut](kinds, num_stages)
        except PartitionError as exc:
            # a layout's refusal names its own fix; a block cut's, balanced where that can cut so many stages
            balanced = layout is None and not too_many_stages("", num_stages, measured.model.name,
                                                              measured.model.options, measured.layers)
            raise CostError(f"--stage-cut {stage_cut}: {exc}" + ("; use --stage-cut balanced" if balanced else "")
                            ) from None
    return None


def profile_graph(measured: Profile, num_stages: int, bounds: Sequence[int] | None = None,
                  stage_cut: str = "balanced", sized_by_flags: bool = False) -> StageGraph:
    """The stage DAG of the profile's model cut into `num_stages` (at `bounds`, default `profile_bounds` by
    `stage_cut`; a chain unless its layers branch). A stage of no layer is refused: the graph is the layers' own
    edges, which pass through no empty stage."""
    from ..profiles.schema import stage_edges

    cut = list(bounds) if bounds is not None else profile_bounds(measured, num_stages, stage_cut,
                                                                 sized_by_flags=sized_by_flags)
    empty = empty_stages(cut)
    if empty:
        raise CostError(f"--stage-cut {stage_cut}: it leaves model stage {empty[0]} without a layer, and a method that "
                        "runs the model's own graph of stages (graphpipe) links stages by the layers they hold: give "
                        "a cut whose every stage holds one")
    return StageGraph(num_stages, tuple(stage_edges(measured.layers, cut)))


def profile_costs(measured: Profile, optimizer: str, bounds: Sequence[int], dag: bool = False,
                  shared_gpu: bool = False) -> Costs:
    """Costs of the profile's layers cut into stages at `bounds` (linked as a chain, or by their own edges
    when `dag`), with `optimizer`'s update and prediction, the gradient accumulation and the runtime's own
    cost per row where the profile measured them. The stages' passes are as issued where the ranks share GPUs
    (`shared_gpu`, `Scenario._shares_gpu`) or each has a GPU of its own (`StagePasses.issued`). A stage's passes,
    where measured, add into the gradient buffer as they run, so their accumulation is not added again. The
    passes are priced at their mean where the contention probe measured how far it lies above their median
    (`ContentionProfile.tail`). Each stage's costs are priced once for the profile (`_priced_stages`): a search
    prices the same stages for many schedules."""
    from ..profiles.schema import boundary_bytes, boundary_held_bytes, stages_for

    cut = list(bounds)
    calibrated = cut == measured.partition.bounds  # its stages' steps and passes were measured, not shared out
    keys = [(optimizer, start, stop, calibrated, sent, held, shared_gpu) for (start, stop), sent, held in zip(
        itertools.pairwise(cut), boundary_bytes(measured.layers, cut, dag), boundary_held_bytes(measured.layers,
                                                                                                cut, dag))]
    priced = _priced_stages(measured)
    if any(key not in priced for key in keys):
        for key, stage in zip(keys, stages_for(measured, cut, dag=dag, optimizers=(optimizer,),
                                               shared_gpu=shared_gpu)):
            if key not in priced:
                priced[key] = _stage_costs(measured, optimizer, stage)
    return Costs(tuple(priced[key] for key in keys),
                 microbatch_size=measured.environment.microbatch_size,
                 overhead=profile_overhead(measured.runtime) if measured.runtime is not None else RowOverhead(),
                 kept_gradients=measured.runtime.kept_gradients if measured.runtime is not None else 0.0,
                 recv_window=measured.runtime.recv_window if measured.runtime is not None else 0,
                 calibration={**measured.describe(), "optimizer": optimizer})


_PRICED: dict[int, dict[tuple, StageCosts]] = {}  # `_priced_stages`, by the profile's identity
# `Scenario.cut`'s fitted cuts, by the scenario's and the schedule's identity (both immutable), each kept while both
# live: a module's, not the scenario's, so that a scenario pickles for sweep's workers as it is
_FITTED: dict[tuple[int, int], list[int]] = {}


def _priced_stages(measured: Profile) -> dict[tuple, StageCosts]:
    """The profile's stages priced so far (`_stage_costs`), by all a stage's costs read of its cut: the optimizer,
    its layers [start, stop), whether the cut is the calibrated one, what it sends (`boundary_bytes`), the
    boundary tensors it holds (`boundary_held_bytes`) and whether its ranks share GPUs (`StagePasses.issued`).
    Kept while the profile lives, which is immutable: tune's 70B search prices 15,104 stages, 5,715 of them
    different."""
    key = id(measured)
    if key not in _PRICED:
        _PRICED[key] = {}
        weakref.finalize(measured, _PRICED.pop, key, None)
    return _PRICED[key]


def _stage_costs(measured: Profile, optimizer: str, s: StageProfile) -> StageCosts:
    """One stage of the profile's (`stages_for`) priced for `optimizer` (`profile_costs`)."""
    from ..profiles.schema import fused_accumulation

    tail = measured.contention_tail
    master_bytes, stored_bytes = held_weights(measured, *s.layers, s.param_bytes)
    accumulate_ms = s.accumulate.median_ms if s.accumulate is not None and s.passes is None else 0.0
    # Under fused accumulation the pass is the runtime's hook adding the gradients no product accumulates into the
    # buffer it zeroes at each step's start (planning/estimate.py `unfused_weight_share`): in every backward, the
    # span's first too, so the backward's (B, W) own, sharing a dispatcher's multiprocessors as the rest of it does;
    # a separate pass skips the first backward, which writes the gradient
    every_ms, accumulate_ms = (accumulate_ms, 0.0) if fused_accumulation(measured) else (0.0, accumulate_ms)
    bwd_ms = s.bwd_ms * tail
    grown = (bwd_ms + every_ms) / bwd_ms if bwd_ms > 0 else 1.0
    return StageCosts(
        fwd_ms=s.fwd_ms * tail, bwd_ms=bwd_ms + every_ms, igrad_ms=s.igrad_ms * tail,
        wgrad_ms=s.wgrad_ms * tail + every_ms,
        wgrad_fraction=s.wgrad_fraction,
        opt_ms=s.steps[optimizer].step.median_ms, pred_ms=s.steps[optimizer].predict.median_ms,
        avg_ms=s.average.median_ms, param_bytes=s.param_bytes, activation_bytes=s.activation_bytes,
        wgrad_kept_bytes=s.wgrad_kept_bytes, wgrad_gradient_bytes=s.wgrad_gradient_bytes,
        output_bytes=s.output_bytes, optimizer_state_bytes=s.optimizer_state_bytes[optimizer],
        accumulate_ms=accumulate_ms, copy_ms=s.weight_copy.median_ms if s.weight_copy is not None else 0.0,
        held_bytes=s.held_bytes,
        grad_bytes=s.grad_bytes, activation_parts=s.activation_parts,
        gathered_bytes=gathered_bytes(measured.layers[s.layers[0]:s.layers[1]]),
        stored_bytes=stored_bytes,
        float8_weight_bytes=s.float8_weight_bytes, model_output_bytes=s.model_output_bytes,
        runtime_buffer_bytes=s.runtime_buffer_bytes,
        all_gather_bytes=s.all_gather_bytes, gather_cast_ms=s.gather_cast_ms,
        transient_bytes=s.transient_bytes,
        all_to_all_fwd_ms=s.all_to_all_fwd_ms, all_to_all_bwd_ms=s.all_to_all_bwd_ms,
        all_to_all_paired_ms=s.all_to_all_paired_ms, all_to_all_paired_by_node=s.all_to_all_paired_by_node,
        pair_layer_bytes=max((layer.activation_bytes for layer in measured.layers[s.layers[0]:s.layers[1]]),
                             default=None),
        fwd_sharing_ms=s.fwd_sharing_ms * tail, bwd_sharing_ms=s.bwd_sharing_ms * tail * grown,
        expert_param_bytes=s.expert_param_bytes, ring_fwd_ms=s.ring_fwd_ms, ring_bwd_ms=s.ring_bwd_ms,
        ring_fwd_hidden_ms=s.ring_fwd_hidden_ms, ring_bwd_hidden_ms=s.ring_bwd_hidden_ms,
        ring_buffer_bytes=s.ring_buffer_bytes, product_ms=s.product_ms * tail,
        master_bytes=master_bytes)


def held_weights(measured: Profile, start: int, stop: int, param_bytes: int) -> tuple[int, int | None]:
    """Of the profile's layers [start, stop), whose weights the passes read as `param_bytes`: the optimizer's master
    copy of them (0: none, it updates the weights themselves) and the weights as stored between passes (None: as the
    passes read them). A calibration's as it recorded them (`Profile.master_bytes`); an estimate's as its precision
    holds them (planning/estimate.py `held_precision`: its --precision, else Megatron-LM's for its count's dtype;
    FSDP2's float32 shards), which its profile records as the estimate's parallelism and environment. CostError
    where those name no precision or dtype known (a profile edited by hand)."""
    estimate = measured.estimate
    if estimate is None:
        return measured.master_bytes(start, stop), None
    from .estimate import EstimateError, held_precision

    try:
        held = held_precision(estimate.parallelism.get("precision"), measured.environment.dtype,
                              bool(estimate.parallelism.get("fp8_param_gather")))
    except EstimateError as exc:
        raise CostError(f"--profile: the estimate's {exc}") from None
    return held.master_weight_bytes(param_bytes), held.stored_weight_bytes(param_bytes)


def all_to_all_refusal(measured: Profile, ranks: int) -> str | None:
    """Why a calibrated profile cannot price the all-to-alls of an expert-parallel group of `ranks` ranks (it
    measured none, or over another number of ranks: a collective's time depends on its ranks; or `ranks` does not
    divide its model's routed experts), in one line with the command that measures it; None where it can. Not
    measured here: that would start ranks and import torch, which `simulate` never does."""
    term = measured.all_to_all
    if term is not None and term.world_size == ranks:
        routed = next(layer.routed_experts for layer in measured.layers if layer.dispatched_bytes)
        return None if routed % ranks == 0 else (f"--expert-parallel {ranks} does not divide the profile's model's "
                                                 f"{routed} routed experts: each rank holds an equal share")
    measured_over = f"measured it over {term.world_size} ranks" if term is not None else "measured no all-to-all"
    return (f"--profile: expert parallelism over {ranks} ranks prices its all-to-alls on the profile's, and it "
            f"{measured_over}: calibrate the mixture of experts again with --expert-parallel {ranks} (links "
            "measured)")


def interleaved_minibatches(sched: Schedule) -> int | None:
    """The first device whose order starts a mini-batch (of a pipeline) and then returns to one it left, else
    None. FSDP2 beside a pipeline, as torchtitan runs it under torch.distributed.pipelining's schedules (each step
    one mini-batch, flushed, then the optimizer's), gathers a stage's weights at its first forward of the step
    and reshards and reduce-scatters them after its last backward; the allocator's replay runs it so
    (sim/caching_allocator.py `step_events`). PipeDream's and its successors' orders never flush, and AvgPipe's
    pipelines take turns on a device: neither runs so."""
    for device, order in enumerate(sched.orders):
        left: set[tuple[int, int]] = set()
        current = None
        for action in order:
            if action.microbatch < 0:
                continue
            key = (action.pipeline, action.minibatch)
            if key != current:
                if key in left:
                    return device
                if current is not None:
                    left.add(current)
                current = key
    return None


def measured_all_to_alls(costs: Costs, measured: Profile, bounds: Sequence[int], ranks: int) -> Costs:
    """Each stage's A2A_F and A2A_B priced on the calibrated profile's all-to-all over the `ranks` ranks of an
    expert-parallel group (`Profile.all_to_all`, its fit at each rank's buffer): per mixture-of-experts block (a
    layer's one, or DeepSeek's multi-token-prediction layer's one a module: `LayerProfile.dispatches_bytes`, as the
    estimate prices each of `LayerCount.routed_blocks`), a forward exchanges the counts (one int64 per routed
    expert), dispatches its token copies and combines as many back; its backward sends their gradients both ways
    (workload/moe.py `exchanged_experts`; `ALL_TO_ALLS`), each exchange paying its own latency.
    The fit is of collectives started together after a barrier: the group's wait for its last rank to arrive is
    not in it. CostError where the profile cannot price them (`all_to_all_refusal`)."""
    from ..profiles.schema import COUNT_BYTES
    from .experts import ALL_TO_ALLS

    refusal = all_to_all_refusal(measured, ranks)
    if refusal is not None:
        raise CostError(refusal)
    segments = tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in measured.all_to_all.segments)

    def exchanges_ms(start: int, stop: int, counts: bool, each: int) -> float:
        return math.fsum((piecewise_ms(segments, COUNT_BYTES * layer.routed_experts) if counts else 0.0)
                         + each * piecewise_ms(segments, sent)
                         for layer in measured.layers[start:stop] for sent in layer.dispatches_bytes)

    return replace(costs, stages=tuple(
        replace(c, all_to_all_fwd_ms=exchanges_ms(start, stop, True, ALL_TO_ALLS["fwd"]),
                all_to_all_bwd_ms=exchanges_ms(start, stop, False, ALL_TO_ALLS["bwd"]))
        for c, (start, stop) in zip(costs.stages, itertools.pairwise(bounds))))


def _weights_held(parts: dict[str, int]) -> int:
    """Of a layer's `held_static_parts`, what its weights hold: themselves, their gradients and optimizer state."""
    return parts["parameters"] + parts["gradients"] + parts["optimizer_state"]


def gathered_bytes(layers: Sequence[LayerProfile]) -> int:
    """The whole weights FSDP2 holds at once while a pass runs over `layers`, each a module of its own (as
    torchtitan wraps each transformer block): the layer computing and the next, whose all-gather FSDP2's implicit
    prefetching issues meanwhile; the largest two neighbours' sum."""
    sizes = [layer.param_bytes for layer in layers]
    return max((a + b for a, b in itertools.pairwise(sizes)), default=sum(sizes))


def profile_overhead(runtime: RuntimeProfile) -> RowOverhead:
    """The simulator's per-row overhead from a profile's measured runtime costs. PRED and AVG rows are priced
    as OPT rows (the same bookkeeping around an elementwise pass over a stage's weights); a REDUCE or GATHER,
    which the runtime probe does not time, adds nothing to its network time; a kind whose gap was
    not seen in the probe gets the median gap of those that were; a fresh rank's first rows cost what the probe's
    fresh ranks paid beyond their steady time (`RuntimeProfile.warmup_ms`)."""
    seen = {kind: t.median_ms for kind, t in runtime.gap_ms.items()}
    stand_in = {Kind.PRED: Kind.OPT, Kind.AVG: Kind.OPT}
    compute = [0.0 if kind in COLLECTIVE_KINDS else runtime.compute_ms[stand_in.get(kind, kind).value].median_ms
               for kind in KINDS[:NUM_COMPUTE_KINDS]]
    typical = float(np.median(list(seen.values()))) if seen else 0.0
    gaps = [seen.get(kind.value, seen.get(stand_in.get(kind, kind).value, typical)) for kind in KINDS]
    return RowOverhead(tuple(compute), runtime.send_ms.median_ms, runtime.recv_ms.median_ms, tuple(gaps),
                       tuple(runtime.warmup_ms), runtime.warmup_rows)


def placement_refusal(estimate: Estimate, stages: int, data: int) -> str | None:
    """Why an estimate that does not record its placement cannot be read at p = `stages`, d = `data` (a link
    the run uses may differ from the one it recorded: the stages' where p > 1, the replicas' where d > 1), in
    one line with the command that re-estimates it; None where it can."""
    t, p, d = estimate.degrees
    if not ((stages > 1 and stages != p) or (data > 1 and (stages, data) != (p, d))):
        return None
    return (f"--profile: estimated for t={t} p={p} d={d} by an older pipesim that did not record the placement, "
            f"so the links of p={stages} d={data} cannot be priced; re-estimate it: `pipesim estimate` as it was "
            f"run, with --stages {stages} --data-parallel {data}")


def experts_moved(estimate: Estimate, stages: int, data: int) -> tuple[int, int] | None:
    """Where an estimate's expert-parallel group sits otherwise at p = `stages`, d = `data` than at its own p and d:
    (its ranks on a node as estimated, at this p and d). Its all-to-alls' times are in the profile's layers, priced
    as it placed them (planning/experts.py `ExpertGroup.per_node`), and cannot be priced again without the count;
    None where the group sits alike, at E = 1, where the estimate recorded no placement (`placement_refusal` says
    why it cannot be read elsewhere), or where the rank order cannot place E there (`estimated_experts_refusal`)."""
    from ..schedules.ranks import RankOrderError, estimated_experts_per_node

    parallelism = estimate.parallelism
    if int(parallelism.get("expert", 1)) == 1 or estimate.placement is None:
        return None
    _, p, d = estimate.degrees
    node = estimate.placement.gpus_per_node
    try:
        placed = (estimated_experts_per_node(parallelism, p, d, node),
                  estimated_experts_per_node(parallelism, stages, data, node))
    except RankOrderError:
        return None
    return placed if placed[0] != placed[1] else None


def profile_cluster(measured: Profile, num_devices: int, overlap_comm: bool,
                    segments: tuple[tuple[int, float, float], ...] | None = None) -> Cluster:
    """Every device pair gets the measured p2p link (or `segments`: an estimate's, priced for the placement), a
    resource of its own (transfers on one link queue); the devices are named, with their memory (or the
    calibration's cap), in the trace's metadata. Where the profile measured how ranks computing at once slow
    each other, the devices are ranks on its host's cores, and their collectives share those cores as far as
    the all-reduce beside computing ranks measured (`AllReduceProfile.beside_compute`).

    Where the profile measured the runtime, the fit is moved (every segment's latency by the same amount, never
    below zero) to pass through the delivery time the runtime probe saw at its message size: a ping-pong pays
    for waking a blocked rank on every message, a pipeline's pre-posted receive mostly does not."""
    env = measured.environment
    if segments is None:
        segments = tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in measured.link.segments)
    if measured.runtime is not None:
        runtime = measured.runtime
        shift = runtime.delivery_ms.median_ms - piecewise_ms(segments, runtime.delivery_bytes)
        segments = tuple((start, max(latency + shift, 0.0), rate) for start, latency, rate in segments)
    pairs = {(a, b): Link(resource=f"link {a}->{b}", segments=segments)
             for a in range(num_devices) for b in range(num_devices) if a != b}
    memory = env.memory_cap_bytes or env.device_memory_bytes
    contention = measured.contention  # ranks on the calibrating host's cores, as `pipesim run` starts them
    beside = measured.allreduce.beside_compute if contention and measured.allreduce else None
    return Cluster(num_devices, Link(segments=segments), pairs, (env.device_name,) * num_devices,
                   (memory,) * num_devices, overlap_comm, hosts=(env.host,) * num_devices if contention else (),
                   contention=tuple(contention.slowdown) if contention else (),
                   collective_contention=tuple(beside) if beside else ())
