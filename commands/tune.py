"""`pipesim tune`: the fastest schedule, shape and partition for a profiled model under a memory cap."""

from __future__ import annotations

import itertools
import json
import math
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from ..choices import unknown_names
from ..schedules.ranks import RANK_ORDERS
from ..traces.hostload import usable_cpus
from ..traces.metrics import STALENESS_HEADER, percent_text, rate_text
from ..units import count_text, degree_text
from .common import (
    COUNTING_MODEL,
    MAX_DEVICES,
    Allocator,
    DataParallel,
    HeldPrecision,
    InputError,
    OptimizerStep,
    PpRuntime,
    Recompute,
    SearchSeconds,
    ShardedOptimizer,
    TensorParallel,
    Zero,
    allocator_fields,
    check_allocator,
    check_memory_cap,
    check_method_options,
    check_optimizer_held,
    check_p2p_sync,
    collector_paused,
    fail,
    given_precision,
    given_simulate_flags,
    is_given,
    load_profile_flag,
    memory_gb_bytes,
    refuse,
    refused_with_flags,
    say_what_if_counted,
    search_options,
    stderr,
    stdout,
    transient_status,
    tune_what_if_options,
    with_help,
    zero_stage,
)
from .estimate import MFU_PAST_PEAK_TEXT, ModelWork, WhatIf, count_what_if, estimated_profile, peak_text, what_if
from .tables import available_width, piped_lines, print_message, print_paragraph, print_table_last_below, said_once

if TYPE_CHECKING:
    from ..planning.tune import Workers
    from ..profiles.workload import WorkloadCount

MICROBATCH_SIZES = (1, 2, 4, 8)  # b searched with --gpu
SEARCHED = "Default: searched."  # what tune does with these where simulate and sweep take one value
NOTE_AFTER_S = 1.0  # a step piped to a file that takes longer says what it does, one line: it must not look hung
SearchedTensorParallel = with_help(TensorParallel, SEARCHED)
SearchedDataParallel = with_help(DataParallel, SEARCHED)
SearchedRecompute = with_help(Recompute, SEARCHED)
SearchedZero = with_help(Zero, "With --gpu, d searched: a layout of one replica (d·C = 1) shards nothing, as its "
                               "estimate; under --precision fsdp2 it is not searched.")


@tune_what_if_options
@collector_paused()
def tune(
    ctx: typer.Context,
    devices: Annotated[int, typer.Option(
        "--devices", "-D", metavar="D", min=1, help="Devices D: d = D/(p·t) data-parallel replicas of a p-deep "
                                                    "pipeline of t-way tensor-parallel stages (p·t divides D; t = 1 "
                                                    "without --gpu). At most 1,000,000.")],
    profile: Annotated[Path | None, typer.Option(
        "--profile", metavar="JSON", help="Profile from `pipesim calibrate` (or `pipesim estimate`): the model's "
                                          "layers, link and all-reduce, measured at its micro-batch size b. "
                                          "Or --gpu.")] = None,
    memory_gb: Annotated[float | None, typer.Option(
        "--memory-gb", metavar="GIB", help="Memory cap per device, GiB. Default: the profiled device's memory (or the "
                                           "calibration's cap); with --gpu, what torch is given of the part's "
                                           "memory (`pipesim gpus`).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", "-B", metavar="B", min=1, help="Samples per optimizer step over all devices, a multiple of b. "
                                                       "Default: 4·(D/C)·b, C the context-parallel degree (1 "
                                                       "without one), so a p-deep pipeline of one GPU a stage runs m "
                                                       "= 4p micro-batches (GPipe's rule for a small bubble).")] = None,
    schedule: Annotated[list[str] | None, typer.Option(
        "--schedule", "-s", metavar="NAME", help="Candidate method (repeat; see `pipesim schedules`). "
                                                 "Default: all.")] = None,
    max_staleness: Annotated[int, typer.Option(
        "--max-staleness", metavar="S", min=0, show_default=False, help="Largest staleness allowed, in optimizer "
                                                                        "steps. Default 0: synchronous methods only, "
                                                                        "which train as one device would; a note names "
                                                                        "a staler method that would be faster. 1 "
                                                                        "admits PipeDream-2BW's one-step delay.")] = 0,
    max_chunks: Annotated[int, typer.Option(
        "--max-chunks", metavar="V", min=1, help="Largest v tried: model chunks per device (interleaved and V "
                                                 "schedules).")] = 4,
    max_pipelines: Annotated[int, typer.Option(
        "--max-pipelines", metavar="P", min=1, help="Largest P tried: pipelines sharing the devices (avgpipe).")] = 4,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", metavar="NAME", help="Optimizer whose state is held and whose step is timed: sgd, momentum, "
                                            "adam, adamw.")] = "adam",
    search_seconds: SearchSeconds = None,
    tensor_parallel: SearchedTensorParallel = None,
    data_parallel: SearchedDataParallel = None,
    recompute: SearchedRecompute = None,
    zero: SearchedZero = None,
    sharded_optimizer: ShardedOptimizer = False,
    precision: HeldPrecision = None,
    allocator: Allocator = "caching",
    optimizer_step: OptimizerStep = "held",
    pp_runtime: PpRuntime = "pipesim",
    microbatch_size: Annotated[int | None, typer.Option(
        "--microbatch-size", "-b", metavar="B", min=1, help="With --gpu: samples per micro-batch b (default: "
                                                            f"searched over {', '.join(map(str, MICROBATCH_SIZES))})."
                                                            )] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")] = False,
) -> None:
    """Pick the fastest schedule and shape under a memory cap. The shape: depth p, micro-batches m, chunks v,
    pipelines P and layer partition, for a profiled model on D devices under a per-device cap.

    The problem: B samples per optimizer step (--batch-size) on D devices of G GiB (--memory-gb); the
    profile's micro-batch size b stays fixed (its times hold at b). The devices run r = D/p data-parallel
    replicas of a p-deep pipeline, whose P pipelines each run m = B/(r·P·b) micro-batches per step (whole).
    Maximise samples/s with every device's peak memory <= G and staleness <= --max-staleness; ties go to
    less memory, then less staleness. Each stage all-reduces its gradients over the r replicas before its
    update, right after its own last backward, on the network beside the backward work still to come (NCCL's
    faster of ring and tree, on the link fitted to the profile's all-reduce; an estimate's data-parallel link
    with --gpu). The layers are split into p·v stages by the memory-capped partitioner with the schedule's own
    memory model.

    auto, the order searched from the costs, is searched for each candidate's partition with the device's whole
    memory to hold activations; the R column is the activation limit its order then holds (1: 1F1B's), and the
    simulate line printed gives the cap and an R no order reaches, as the search held them.

    The search bounds before it simulates: staleness and a memory floor from the schedule alone, a
    throughput bound from each device's compute, its waits for the all-reduce and the pipeline's fill and
    drain; the choice and its five runners-up are exact. Configurations over a limit that beat the choice by
    more than 0.5% are listed from those whose memory floor fits the cap; those that might beat it by less, by
    their bounds, are counted in a note, not simulated.

    With --gpu instead of --profile, the model (--model and its size flags) is counted on the meta device and
    estimated on the catalogue GPU for every tensor-parallel degree t (powers of two within a node), micro-batch
    size b and recomputation the flags leave open, and every p those allow: all compete in one search, under the
    GPU's memory (or --memory-gb).
    """
    from ..planning.estimate import check_context, tensor_split_refusal
    from ..planning.scenario import profile_scenario
    from ..planning.tune import Problem, Setting, TuneError, start_workers
    from ..planning.tune import tune as search
    from ..profiles.schema import optimizer_refusal
    from ..profiles.workload import layers_text, most_stages
    from ..schedules import METHODS, ScheduleError
    from ..sim import CostError, SimulationError

    workers, pool = usable_cpus(), None  # the cores this process may run on, not the host's (a container's share)
    estimates_s = None  # --gpu's estimates' seconds, before the search's own
    try:
        if devices > MAX_DEVICES:  # a refusal's nearest divisors are searched up to D
            raise InputError(f"--devices: give at most {MAX_DEVICES:,}, ten times the largest GPU clusters built "
                             f"(got {devices:,})")
        schedule = [name.strip() for given in schedule or () for name in given.split(",")]  # as sweep takes them
        unknown = [name for name in schedule if name not in METHODS]
        if unknown:
            raise InputError(unknown_names("--schedule", unknown, METHODS))
        # as simulate and sweep refuse them; a bound of 1 holds every method at its own (1F1B's v = 1, P = 1)
        check_method_options(ctx, schedule or METHODS, ("--search-seconds", *(flag for flag, most in (
            ("--max-chunks", max_chunks), ("--max-pipelines", max_pipelines)) if most > 1)))
        refuse(optimizer_refusal(optimizer, "--optimizer"))
        memory_cap_bytes = memory_gb_bytes(memory_gb)  # None: the device's own memory
        check_p2p_sync(ctx, schedule or METHODS)
        budget = search_options(None, search_seconds)["search_seconds"]
        what = what_if(ctx)
        check_allocator(ctx, what)
        given_precision(ctx.params)
        zero = zero_stage(ctx.params)
        zero_flag = "--sharded-optimizer" if sharded_optimizer else f"--zero {zero}"  # as the user gave it
        work: dict[int, ModelWork] = {}  # by b, with --gpu
        capped_by = None  # the catalogue part whose own memory is the cap (--gpu's, or its cluster's)
        if what is None:
            if zero:
                raise InputError(f"{zero_flag}: tune shards --gpu's estimates; give --gpu NAME and --model in place "
                                 "of --profile")
            if profile is None:
                raise InputError("--profile or --gpu: give the model's profile, or a GPU and --model to estimate it on")
            measured = load_profile_flag(ctx, profile)
            check_optimizer_held(optimizer, None, measured)
            check_memory_cap(memory_cap_bytes, measured.environment.device_memory_bytes,
                             measured.estimate and measured.estimate.gpu)
            check_p2p_sync(ctx, schedule or METHODS, measured)
            env = measured.environment
            tensor, context, expert = measured.estimated_degrees
            if devices % (tensor * context):
                each = (f"{degree_text('t', tensor)} GPUs per stage"
                        + f" and {degree_text('C', context)} context-parallel ranks" * (context > 1))
                raise InputError(f"--devices: give a multiple of {tensor * context}, as the profile was estimated for "
                                 f"{each} (got {devices:,})")
            schedule_devices = Problem.devices_of(devices, context)
            b = env.microbatch_size
            batch = batch_size if batch_size is not None else 4 * schedule_devices * b
            if batch % b:
                raise InputError(f"--batch-size: give a multiple of the profile's micro-batch size {b:,}, at which "
                                 f"its times were measured (got {batch:,})")
            _check_max_pipelines(ctx, max_pipelines, batch, b)
            depths = None  # a given d: the one p = D/(t·C·d)
            if data_parallel is not None:
                per_stage = f" x {tensor * context} (the profile's GPUs per stage)" * (tensor * context > 1)
                if devices % (tensor * context * data_parallel):
                    raise InputError(f"--devices: give p x d{per_stage}, a multiple of "
                                     f"{tensor * context * data_parallel:,} at --data-parallel {data_parallel:,} "
                                     f"(got {devices:,})")
                depths = (devices // (tensor * context * data_parallel),)
                most = most_stages(measured.layers)
                if depths[0] > most:
                    room = devices // (tensor * context)  # p x d
                    least = min(d for d in range(1, room + 1) if not room % d and room // d <= most)
                    raise InputError(f"--data-parallel: give at least {least:,}, so that p = {room:,}/d devices a "
                                     f"pipeline is at most the profile's {layers_text(measured.layers)} (got "
                                     f"{data_parallel:,})")
            settings = [Setting(profile_scenario(measured, optimizer, pp_runtime), tensor, depths=depths,
                                expert=expert,
                                rank_order=measured.estimated_parallelism.get("rank_order", "pipesim"))]
        else:
            if what.cluster_gpus is not None and devices > what.cluster_gpus:
                raise InputError(f"--devices: give at most {what.cluster_gpus:,}, the GPUs of the cluster --gpu "
                                 f"{ctx.params['gpu']} (got {devices:,})")
            context = what.context
            _check_degrees(devices, tensor_parallel, data_parallel, context, what.options.get("seq_len"),
                           lambda t: tensor_split_refusal(count_what_if(what, microbatch_size or MICROBATCH_SIZES[0])
                                                          .options, t, what.expert_tensor) is None)
            schedule_devices = Problem.devices_of(devices, context)  # (C divides D: checked)
            if zero and devices == (tensor_parallel or 1):  # D = t: every d·C = D/(t·p) is 1, nothing shards
                given = f" at --tensor-parallel {tensor_parallel:,}" if tensor_parallel else ""
                sharding = ("--precision fsdp2 shards the weights" if what.precision == "fsdp2" else
                            f"{zero_flag} shards")
                raise InputError(f"{sharding} over d·C ranks: --devices {devices:,}{given} leaves one replica; give "
                                 "more devices")
            sizes = (microbatch_size,) if microbatch_size is not None else MICROBATCH_SIZES
            batch = batch_size if batch_size is not None else 4 * schedule_devices * sizes[0]
            sizes = tuple(b for b in sizes if batch % b == 0)
            if not sizes:
                raise InputError(f"--batch-size: give a multiple of --microbatch-size {microbatch_size:,} "
                                 f"(got {batch:,})")
            _check_max_pipelines(ctx, max_pipelines, batch, min(sizes))
            part = what.cluster.gpu if what.cluster is not None else ctx.params["gpu"]  # a cluster's: its part's
            check_memory_cap(memory_cap_bytes, what.gpu.device_memory_bytes, part)
            with transient_status(COUNTING_MODEL, quiet=False):  # a first count imports torch: seconds
                counts = {sizes[0]: count_what_if(what, sizes[0])}  # its refusals before the note, the only line
            if counts[sizes[0]].options.get("sparse_attention_keys"):  # the sizes whose scores the fused path takes
                from ..workload.dsa import scored_at_once

                sizes = tuple(b for b in sizes if scored_at_once(b, what.options["seq_len"]))
            say_what_if_counted(what)
            if memory_cap_bytes is None:  # the part's own memory, as its estimates record it (device_memory_bytes)
                memory_cap_bytes, capped_by = what.gpu.device_memory_bytes, part
            _check_weights_fit(counts[sizes[0]], devices, memory_cap_bytes, capped_by)
            if context > 1:
                with refused_with_flags():  # C must split the sequence: said before the note too
                    check_context(counts[sizes[0]], context, tensor_parallel or 1, what.cp_rotate)
            pool = start_workers(workers)  # the search's, started on the cores the estimates leave idle
            expert_given = is_given(ctx, "expert_parallel")
            orders = _rank_orders(what, is_given(ctx, "rank_order"), devices)
            estimating_from = time.perf_counter()
            with _working(_estimating_text(_expert_degrees(what, counts[sizes[0]], expert_given), orders)) as report:
                settings = _estimated_settings(what, schedule_devices, tensor_parallel, data_parallel, recompute,
                                               sizes, optimizer, allocator, optimizer_step, pp_runtime, counts,
                                               expert_given, ctx.params["sequence_parallel"], report, pool, orders)
            estimates_s = time.perf_counter() - estimating_from
            work = {setting.microbatch_size: ModelWork.of(setting.scenario.measured) for setting in settings}
            measured = settings[0].scenario.measured
            env = measured.environment
        if memory_cap_bytes is None:
            memory_cap_bytes = env.memory_cap_bytes or env.device_memory_bytes
            if not memory_cap_bytes:
                raise InputError(f"--memory-gb: the profile {profile} does not record its device's memory; "
                                 "give the cap")
            if not env.memory_cap_bytes and measured.estimate is not None:  # its part's memory, as --gpu's
                capped_by = measured.estimate.gpu
        problem = Problem(schedule_devices, memory_cap_bytes, batch,
                          # catalogue order, whatever -s's: twins tie to the plainer (1f1b, not interleaved at v = 1)
                          tuple(name for name in METHODS if not schedule or name in schedule), max_staleness,
                          max_chunks, max_pipelines, budget, zero, memory_part=capped_by, context=context)
        searching = f"searching the configurations of {count_text(len(settings), 'profile')}, best bound first"
        if pool is None:  # forked, before _working's thread: spawned in the search, each imported the simulator again
            pool = start_workers(workers)
        with _working(searching) as report:
            tuning = search(settings, problem, report, workers, pool)
    except (InputError, TuneError, ScheduleError, CostError, SimulationError) as exc:
        fail(str(exc))
    except BrokenProcessPool:  # killed (the host's memory?) mid-task: a traceback before, now a line, not input's code
        print_message("a worker process of the search ended abruptly (killed, or out of the host's memory): run it "
                      "again", stderr, "error: ", "bold red")
        raise SystemExit(1) from None
    finally:  # the search stopped them as it ended: they are left here after an error or Ctrl-C before it
        if pool is not None:
            pool.stop(at_once=True)
    command = _simulate_command(ctx, tuning.choice.result)
    if as_json:
        document = tuning.to_dict()
        document["simulate_command"] = " ".join(map(shlex.join, command))
        document["search"]["estimates_seconds"] = estimates_s  # --gpu's, before the search's own (None: a profile's)
        document["problem"]["precision"] = _held_as(measured)
        for row in (document["choice"], *document["runners_up"], *document["excluded"],
                    *filter(None, [document["staler_winner"]])):
            row["context_parallel"] = context
            if work:
                row.update(work[row["microbatch_size"]].metrics(row["samples_per_s"], devices))
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    _print_tuning(tuning, measured, work, data_parallel is not None, command,
                  peak_text(measured, what, tuning.choice.result.candidate.setting.scenario), estimates_s,
                  len({setting.rank_order for setting in settings}) > 1)


def _choice_flags(c, candidate) -> list[tuple[str, str, object]]:
    """The choice's schedule, shape, degrees and cut as simulate's flags: (simulate's parameter name, the flag, its
    value), the value None where the flag is left out (simulate's default, or a --profile's own), True for a switch
    given alone. Tune searches these (or takes them as given), so its command gives the choice's, not the user's."""
    from ..planning.scenario import LAYERS

    estimated = c.recompute is not None  # with --gpu: the degrees and b searched
    return [("schedule", "-s", c.schedule), ("stages", "-p", c.stages), ("chunks", "-v", c.chunks),
            ("microbatch_group", "--microbatch-group", c.microbatch_group),
            ("pipelines", "-P", c.pipelines if c.pipelines > 1 else None), ("microbatches", "-m", c.microbatches),
            ("data_parallel", "--data-parallel", c.replicas),
            ("tensor_parallel", "--tensor-parallel", c.tensor if estimated else None),
            ("microbatch_size", "-b", c.microbatch_size if estimated else None),
            ("recompute", "--recompute", c.recompute),
            ("expert_parallel", "--expert-parallel", c.expert if estimated and c.expert > 1 else None),
            ("sequence_parallel", "--sequence-parallel", True if estimated and c.sequence_parallel else None),
            ("rank_order", "--rank-order", c.rank_order if estimated and c.rank_order != "pipesim" else None),
            ("zero", "--zero", c.zero or None),
            ("stage_cut", "--stage-cut", LAYERS + ",".join(str(b - a) for a, b in pairwise(candidate.bounds))),
            # a searched order's R as its search held it (one no order reaches: the cap bound it), not the R it
            # reached, under which simulate's search, each device allowed that share of 1F1B's fullest, differs
            ("activation_limit", "--activation-limit",
             None if candidate.activation_limit is None else f"{candidate.params.activation_limit:.0f}")]


def _simulate_command(ctx: typer.Context, result) -> list[list[str]]:
    """The `pipesim simulate` command that gives the chosen `result`'s step, samples/s and peak, a flag and its value
    a piece: the flags the user gave that simulate shares, as given and in their order, and the choice's schedule,
    shape, degrees and cut (layers:N,N,..., the layers of each model stage), so a planner's answer can be checked."""
    c = result.config
    chosen = _choice_flags(c, result.candidate)
    # the choice's own (but pipesim's rank order, the default, as the user gave it), --json (the line prints
    # simulate's table), auto's budget beside another method (it shapes auto's order; simulate refuses it for
    # another), and the recomputed modules beside a whole layer's recomputation (which keeps what it keeps: tune
    # tries it without them, and simulate refuses them with it)
    own = {*(name for name, _, value in chosen if name != "rank_order" or value is not None), "as_json",
           *(("search_seconds",) if c.schedule != "auto" else ()),
           *(("recompute_modules",) if c.recompute in ("full", "op") else ()),
           # what changes nothing at the choice's t = 1 or E = 1, which tune estimated without it (simulate refuses)
           *((*TP_OVERLAP_SETTINGS, "tp_runtime", "loss_parallel") if c.tensor == 1 else ()),
           *(ROUTING_SETTINGS if c.expert == 1 else ())}
    return [["pipesim", "simulate"], *given_simulate_flags(ctx, own),
            *([flag] if value is True else [flag, str(value)] for _, flag, value in chosen if value is not None)]


def _shell_lines(command: list[list[str]], width: int | None) -> str:
    """`command` indented, in lines of at most `width` columns (one line where None), each but the last ended with
    ` \\` so that it pastes as one command; a flag keeps its value on its line, and no number is cut."""
    lines = [""]
    for piece in map(shlex.join, command):
        if lines[-1].strip() and width is not None and len(lines[-1]) + 1 + len(piece) + len(" \\") > width:
            lines.append("   ")
        lines[-1] += (" " if lines[-1] else "  ") + piece
    return " \\\n".join(lines)


def _split_text(config) -> str:
    """A row's sequence parallelism: on or off at t > 1, "-" at t = 1 (nothing to split over)."""
    return "-" if config.tensor == 1 else "on" if config.sequence_parallel else "off"


def _held_as(measured) -> str | None:
    """The --precision an estimate was made with (None: as the count's dtype, or a calibration)."""
    return measured.estimated_parallelism.get("precision")


def _check_max_pipelines(ctx: typer.Context, max_pipelines: int, batch: int, microbatch_size: int) -> None:
    """--max-pipelines, where given, at most the micro-batches of b samples a step's batch holds, each pipeline's at
    least one: the search tried every P up to it, and 10**12 searched for hours. Its default, 4, is not refused
    under a --batch-size of fewer micro-batches: the search skips the P that cannot run."""
    most = batch // microbatch_size
    if max_pipelines > most and is_given(ctx, "max_pipelines"):
        raise InputError(f"--max-pipelines: give a whole number from 1 to {most:,} (got {max_pipelines:,}): each "
                         f"pipeline takes at least one of the step's {most:,} micro-batches ({batch:,} samples, "
                         f"--batch-size, of {microbatch_size:,} each)")


def _check_weights_fit(counted: WorkloadCount, devices: int, memory_cap_bytes: int, part: str | None) -> None:
    """The model's weights alone, spread evenly over all D devices, within the cap: each parameter is held at least
    once at the count's precision however t, p, d, C and E shard it, so no configuration fits where they are not.
    Said before the estimates, which for Llama 3.1 405B on 8 H100s took a minute to find the same, and for a model
    thousands of times too large filled the host's memory first. `part`: the catalogue part (--gpu's, or its
    cluster's) whose own memory is the cap, None where --memory-gb gave it; the refusal names the flag the user
    gave (`nothing_fits_text`)."""
    from ..planning.tune import digits_apart, memory_text, nothing_fits_text

    weight_bytes = counted.total("param_bytes")
    if weight_bytes <= devices * memory_cap_bytes:
        return
    over = f" over --devices {devices:,}" if part is None else ""  # else the refusal's start names --devices
    more = "more memory each" if part is None else "a --gpu with more memory"
    share = weight_bytes / devices
    apart = digits_apart(share, memory_cap_bytes, memory_text)  # the share reads over the cap
    least = math.ceil(weight_bytes / memory_cap_bytes)
    instead = f"give at least {least:,} devices, or {more}" if least <= MAX_DEVICES else (
        f"no --devices up to {MAX_DEVICES:,} holds them: give {more}")  # (1,981,584 devices were suggested)
    raise InputError(f"{nothing_fits_text(memory_cap_bytes, devices, part, apart)}; the model's weights alone "
                     f"({memory_text(weight_bytes)} in {counted.dtype}) need {memory_text(share, apart)} per "
                     f"device{over}: {instead}")


def _check_degrees(devices: int, tensor: int | None, data: int | None, context: int, seq_len: int | None,
                   splits_model: Callable[[int], bool]) -> None:
    """D must be p x d x t x C for some p: the degrees given must divide it. A refusal names their product, the
    degree that does not divide D where one alone is to blame, and what would: the nearest multiples of the
    product for --devices, and the nearest degrees that divide D with the others kept, a C among them only where it
    also splits `seq_len` tokens into 2C equal chunks, as `check_context` asks next (seq_len None: not given), a t
    only where it splits the model (`splits_model`, asked of such a t alone: it counts the model), as the estimate
    asks next. A C that does not split the sequence so is refused first, naming the nearest Cs that split both the
    sequence and D with the other degrees kept (a --devices suggested for it was refused in turn); where none does,
    `check_context` refuses it next."""
    if context > 1 and seq_len and seq_len % (2 * context):
        others = math.prod(value for value in (tensor, data) if value)
        room = 0 if devices % others else devices // others  # what C may divide, the other degrees kept
        fitting = [n for n in range(2, room + 1) if not room % n and not seq_len % (2 * n)]
        nearest = [n for n in fitting if n < context][-1:] + [n for n in fitting if n > context][:1]
        if nearest:
            raise InputError(f"--context-parallel {context:,} does not split the sequence of {seq_len:,} tokens into "
                             f"2 x {context:,} equal chunks (the causal load balance); give --context-parallel "
                             f"{' or '.join(f'{n:,}' for n in nearest)} (C must divide --seq-len / 2 = "
                             f"{seq_len // 2:,} and --devices {devices:,}" + (" with the other degrees" if others > 1
                                                                               else "") + ")")
        return
    given = [(flag, value) for flag, value in (("--tensor-parallel", tensor), ("--data-parallel", data),
                                               ("--context-parallel", context if context > 1 else None)) if value]
    product = math.prod(value for _, value in given)
    if not devices % product:
        return
    failing = [(flag, value) for flag, value in given if devices % value]
    named = " x ".join(f"{flag} {value:,}" for flag, value in given) + (f" = {product:,}" if len(given) > 1 else "")
    split = "p stages x d replicas x t GPUs per stage" + " x C context-parallel ranks" * (context > 1)
    refusal = f"--devices: give {split}, a multiple of {named} (got {devices:,})"
    below = devices - devices % product
    instead = [f"--devices {' or '.join(f'{n:,}' for n in (below, below + product) if n)}"]
    if len(failing) == 1 and not devices % (product // failing[0][1]):  # the others kept divide D: this one fails
        flag, value = failing[0]
        room = devices // (product // value)  # what the degree may divide, the others kept
        divisors = [n for n in range(1, room + 1) if not room % n and (
            flag != "--context-parallel" or n == 1 or not seq_len or not seq_len % (2 * n)) and (
            flag != "--tensor-parallel" or splits_model(n))]
        below_value = [n for n in divisors if n < value]  # a t of 1 splits every model: one is there unless t is 1
        nearest = [*below_value[-1:], *(n for n in divisors if n > value)][:2]
        if nearest:
            instead.append(f"{flag} {' or '.join(f'{n:,}' for n in nearest)}")
        if len(given) > 1:
            refusal += f": {flag} {value:,} does not divide {devices:,}"
    raise InputError(f"{refusal}; give " + ", or ".join(instead))


@contextmanager
def _working(what: str) -> Iterator[Callable[[str], None]]:
    """What a step that may take seconds is doing, on stderr: a transient status on an interactive terminal,
    kept up to date by the callback yielded; else, if it takes over NOTE_AFTER_S, one line, and how far it is at
    most every PIPED_EVERY_S after (`piped_lines`: a piped 70B search over 64 GPUs said nothing for 50 s)."""
    if stderr.is_terminal:
        with stderr.status(what) as status:
            yield status.update
        return
    note = threading.Timer(NOTE_AFTER_S, lambda: stderr.print(f"tune: {what} ...", highlight=False, soft_wrap=True))
    note.start()
    try:
        yield piped_lines("tune", stderr)
    finally:
        note.cancel()
        note.join()  # a line begun as the step ended is out before what follows (Ctrl-C's "interrupted")


def _estimating_text(expert_degrees: list[int], orders: tuple[str, ...]) -> str:
    """What the estimates vary, for the progress line: E too where they try more than one expert-parallel degree
    (`_expert_degrees`), the rank order where they try both (`_rank_orders`)."""
    return (f"estimating the model's profile for each t, b, recomputation{', E' * (len(expert_degrees) > 1)}"
            f"{', rank order' * (len(orders) > 1)} and p")


def _ranks_text(experts: bool, context: int) -> str:
    """What the rank orders place on consecutive GPUs, in the terms of the table: E only for a mixture of experts, C
    only where there is context parallelism."""
    c = "·C" * (context > 1)
    return (f"the rank order: pipesim's puts a replica's t{c}·p ranks on consecutive GPUs"
            + " and draws E from the replicas" * experts + ", megatron's (Megatron-core's "
            + ("tp-cp-ep-dp-pp" if experts else "tp-cp-dp-pp") + f") a stage's t{c}·d"
            + ", the experts folded over them" * experts + ", either where both place the layout alike")


def _ranks_cell(config) -> str:
    """A row's rank order as its column shows it: "either" where both orders searched place it alike."""
    return "either" if config.orders_alike else config.rank_order


def _recompute_text(config) -> str:
    """A row's recomputation as its column shows it (sel: selective)."""
    return {"selective": "sel"}.get(config.recompute, config.recompute)


def _rank_orders(what: WhatIf, given: bool, gpus: int) -> tuple[str, ...]:
    """The rank orders the estimates try: the one given (--rank-order), or that --expert-tensor-parallel needs
    (Megatron-core's, which simulate's check asks for by name), or the default where the `gpus` fit in one node
    (every group within it in either order); else both, pipesim's first. Where the ranks sit decides which groups
    cross nodes: Qwen3-235B-A22B on 64 H200s tuned under pipesim's order alone chose E = 1 at 24.6 samples/s, under
    Megatron-core's, which keeps an expert group of 8 on a node, E = 8 at 28.2."""
    from ..planning.estimate import node_placement

    one_node = gpus <= node_placement(what.gpu, what.cluster).gpus_per_node
    return (what.rank_order,) if given or what.expert_tensor is not None or one_node else RANK_ORDERS


def _placed_apart(what: WhatIf, counted: WorkloadCount, degrees: tuple[int, int, int, str, int], order: str,
                  splits: tuple[bool, ...]) -> bool:
    """Whether `order` places the groups of `degrees` (p, t, d, recomputation, E) otherwise than the what-if's own
    order does at any of `splits` (sequence parallelism, which the stage link reads): where they place alike, their
    estimates are one (planning/estimate.py `placed`), and the search would only meet each configuration twice. A
    layout both orders refuse is not apart (the first order's estimate says why, once); one only the first refuses
    is."""
    from ..planning.estimate import EstimateError, node_placement, placed

    curve = what.curve or what.gpu.curve
    if curve is None:  # the estimate refuses the part: said by the first order's
        return False
    placement = node_placement(what.gpu, what.cluster, curve)

    def where(split: bool, rank_order: str) -> object:
        try:
            parallel = replace(what, sequence_parallel=split, rank_order=rank_order).parallelism(*degrees)
            return placed(placement, counted, parallel, curve)
        except EstimateError as exc:
            return str(exc)

    return any(where(split, what.rank_order) != where(split, order) for split in splits)


def _expert_degrees(what: WhatIf, counted: WorkloadCount, expert_given: bool) -> list[int]:
    """The expert-parallel degrees E the estimates try: the one given (--expert-parallel; 1 by default), else, for a
    mixture of experts, each divisor of its routed experts (`_estimated_settings` keeps those the rank order can
    place at each t and d, schedules/ranks.py `expert_grid_refusal`)."""
    experts = counted.options.get("experts")
    return [what.expert] if expert_given or not experts else [e for e in range(1, experts + 1) if experts % e == 0]


def _check_routing(what: WhatIf, counted: WorkloadCount) -> None:
    """Refuse, in one line, a value of routing's or dispatch's flags that no E makes sense of (a busiest expert's
    share no share of the experts' tokens, random routing beside one, a dispatcher holding every multiprocessor):
    E = 1 is estimated without them (`_as_estimated`), so it would answer where every E > 1 refuses them."""
    from ..planning.estimate import check_dispatcher_sms
    from ..planning.experts import check_routing

    with refused_with_flags():
        check_routing(counted.options["experts"], counted.top_k, what.hot_expert_share, what.routing)
        if what.dispatcher_sms is not None:
            check_dispatcher_sms(what.dispatcher_sms, (what.curve or what.gpu.curve).multiprocessors)


# What a layout of t = 1 or of E = 1 has no use for (`_as_estimated`): WhatIf's fields, named as simulate's parameters
# (`_simulate_command`)
TP_OVERLAP_SETTINGS = ("tp_overlap", "tp_overlap_no_margin", "tp_overlap_fp8_buf")
ROUTING_SETTINGS = ("hot_expert_share", "routing", "token_dispatcher", "dispatcher_sms")


def _as_estimated(what: WhatIf, tensor: int, expert: int, expert_fixed: bool) -> WhatIf:
    """`what` as a layout of t = `tensor` and E = `expert` is estimated: at t = 1 without --tp-overlap and its
    settings, which have nothing to overlap there; at E = 1 searched among others (not `expert_fixed`: given, or a
    dense model's), every routed expert on the rank, without how tokens are routed and dispatched between
    expert-parallel ranks (--hot-expert-share, --routing, --token-dispatcher and its SMs), which changes nothing
    there (`_check_routing` checks their values; a fixed E = 1 is refused with them, in one line)."""
    unset = (*(TP_OVERLAP_SETTINGS if tensor == 1 else ()), *(ROUTING_SETTINGS if expert == 1 and not expert_fixed
                                                                else ()))
    return replace(what, **{field.name: field.default for field in fields(WhatIf) if field.name in unset}) \
        if unset else what


def _estimated_settings(what: WhatIf, devices: int, tensor: int | None, data: int | None, recompute: str | None,
                        sizes: tuple[int, ...], optimizer: str, allocator: str, optimizer_step: str,
                        pp_runtime: str,
                        counts: dict[int, WorkloadCount], expert_given: bool, sequence_parallel: bool | None,
                        report: Callable[[str], None] | None = None, pool: Workers | None = None,
                        orders: tuple[str, ...] | None = None):
    """One setting per micro-batch size b, tensor-parallel degree t (given, or each power of two within a node that
    divides `devices`, D/C, and the model), expert-parallel degree E (of `_expert_degrees`, those the rank order can
    place at that t and d, `expert_grid_refusal`), sequence parallelism at t > 1 (`sequence_parallel`, or off and
    on where None: it splits the norms' work and activations over t, and Megatron's backward gathers each product's
    input again), pipeline depth p (D/(t·C·d) for a given d, else each divisor of D/(t·C) up
    to the layers), recomputation (given, or each) and rank order (each of `orders`, default what's: a second one
    at the (t, E, p) it can place and places otherwise than the first, `_placed_apart`), its allocations replayed
    under `allocator` as simulate's
    (`allocator_fields`), so tune's peaks and memory check are simulate's, the boundary tensors held as
    `pp_runtime`'s runtime holds them; `counts` holds the model counted at the b's counted already (the rest are
    counted here); `report` is told how many are done. Where no t suits, the estimates' refusal if every t tried got
    the same one (it is not about t), else which t's were tried and each refused t's reason (one rule said for all of
    them would send the user after the wrong flag). A searched E = 1 is estimated without the flags of routing and
    dispatch between expert-parallel ranks (`_as_estimated`), and t = 1 without --tp-overlap, which change nothing
    there (a layout they leave out may be the fastest; the printed simulate line leaves them out too). A searched E
    the estimate refuses is left out where another suits the t (a dispatcher or routing that needs more ranks), as is
    a searched t the estimate refuses (--recompute op, modelled at t = 1 only); a given t it
    refuses is its one line. Under --precision fsdp2, a layout of one replica (d·C = 1) is left out: FSDP2's weights
    are sharded over the replicas, and simulate refuses --zero over one. A searched t = 1 under --loss-parallel is
    counted with aten's loss, which torchtitan runs there (simulate refuses the flag at a given t = 1). Each (b, t, E)'s
    estimates are made together (`_estimate_group`), in `pool`'s workers where given: the search's, idle until it
    starts (Qwen3-30B-A3B's E searched on 64 GPUs: 128 groups, 1,188 profiles, 13.8 CPU s)."""
    from ..planning.estimate import SEARCHED_RECOMPUTE, LayerMemo, node_placement
    from ..profiles.workload import most_stages
    from ..schedules.ranks import expert_grid_refusal

    orders = orders or (what.rank_order,)
    per_node = node_placement(what.gpu, what.cluster).gpus_per_node
    tensors = [tensor] if tensor else [1 << k for k in range(per_node.bit_length())
                                       if devices % ((1 << k) * (data or 1)) == 0]
    # whole-layer graphs beside no recomputation only (Megatron-core refuses the rest: `Parallelism`)
    kinds = (recompute,) if recompute else ("none",) if "full" in what.cuda_graphs else SEARCHED_RECOMPUTE
    groups, blocks = [], []  # each (b, t): its groups' indices, one per rank order and E it tries
    for b in sizes:
        counted = counts.get(b) or count_what_if(what, b)
        # its layers made for one p and its replays for one p and d, kept for the rest (`_estimate_group`)
        made_for_b = (counted, LayerMemo(counted, what.gpu, what.curve), {})
        degrees = _expert_degrees(what, counted, expert_given)
        fixed_expert = expert_given or len(degrees) == 1  # E = 1 is searched without routing's flags where not
        if not fixed_expert:
            _check_routing(what, counted)
        most = most_stages(counted.layers)  # the deepest pipeline its layers cut into
        for t in tensors:
            at_t, made = what, made_for_b
            if what.loss_parallel and t == 1:  # torchtitan's loss parallelism is on at t > 1 only
                at_t = replace(what, loss_parallel=False)  # (ParallelDims.loss_parallel_enabled): aten's loss
                counted_t = count_what_if(at_t, b)
                made = (counted_t, LayerMemo(counted_t, what.gpu, what.curve), {})
            # off at t = 1, given or not: nothing to split over (the row's "-"; simulate refuses it there), nor to
            # overlap (--tp-overlap, which needs sequence parallelism, and its settings)
            splits = (False,) if t == 1 else (False, True) if sequence_parallel is None else (sequence_parallel,)
            block, apart = [], {}  # apart: by (E, p), whether the second order places it otherwise
            for order, e in itertools.product(orders, degrees):
                at_e = _as_estimated(at_t, t, e, fixed_expert)
                depths = [devices // (t * data)] if data else [p for p in range(1, most + 1) if devices % (t * p) == 0]
                # a given d and E: the estimate says why they do not fit (in the first order: a second adds)
                if len(degrees) > 1 or not data or order != orders[0]:
                    depths = [p for p in depths if expert_grid_refusal(
                        order, t, what.context, p, devices // (t * p), e, what.expert_tensor) is None]
                if what.precision == "fsdp2":  # its weights sharded: over d·C >= 2 ranks only
                    depths = [p for p in depths if devices // (t * p) * what.context > 1]
                for p in depths if len(orders) > 1 else ():
                    if (e, p) not in apart:
                        apart[e, p] = _placed_apart(at_e, made[0], (p, t, devices // (t * p), kinds[0], e), orders[1],
                                                    splits)
                alike = tuple(p for p in depths if order == orders[0] and len(orders) > 1 and not apart[e, p])
                if order != orders[0]:
                    depths = [p for p in depths if apart[e, p]]
                    if not depths:
                        continue
                block.append(len(groups))
                groups.append((at_t, made, _EstimateGroup(t, e, tuple(depths), kinds, splits, order, fixed_expert,
                                                          alike)))
            blocks.append((t, block))
    done = _estimate_groups(groups, (devices, optimizer, pp_runtime, allocator, optimizer_step), pool,
                            lambda count: report(f"{_estimating_text(degrees, orders)}: {count} done")
                            if report else None)
    settings, refusals = [], {}  # each refusal: the t's that got it
    for t, block in blocks:
        made, refused = len(settings), []
        for index in block:
            settings += done[index][0]
            if done[index][1] is not None:
                refused.append((groups[index][2].rank_order, done[index][1]))
        # a searched E or order refused: another may suit; said, the first order's last refusal (the user's order)
        if refused and (len(block) == 1 or len(settings) == made):
            why = next((text for order, text in reversed(refused) if order == orders[0]), refused[-1][1])
            if tensor:  # the user's t: say why it cannot be
                raise InputError(why)
            refusals.setdefault(why, set()).add(t)
    if not settings and len(refusals) == 1:  # the same refusal for every t tried: not about t, so say it
        raise InputError(next(iter(refusals)))
    if not settings:
        rules = {"pipesim": f"the replicas d = D/(t·C·p) must be a multiple of --expert-parallel {what.expert:,}",
                 "megatron": f"--expert-parallel {what.expert:,} times --expert-tensor-parallel (default t) must "
                             "divide t·C·d"}
        named = {"pipesim": "in pipesim's rank order ", "megatron": "in Megatron-core's "}
        replicas = "" if what.expert == 1 else "; " + "; ".join(
            named[order] * (len(orders) > 1) + rules[order] for order in orders)
        reasons = "".join(f"; at t = {', '.join(f'{t:,}' for t in sorted(ts))}: {why}" for why, ts in refusals.items())
        # where no t was refused for its own sake, the replicas' rule is what no t meets
        fix = ("give more --devices or a smaller --expert-parallel" if what.expert > 1 and not refusals else
               "give another --tensor-parallel" if tensor else "give --tensor-parallel")
        raise InputError(f"--devices {devices * what.context:,}: no tensor-parallel degree t of "
                         f"{', '.join(f'{t:,}' for t in tensors)} suits the model (t must divide its heads and MLP "
                         f"width{replicas}){reasons}; {fix}")
    return settings


@dataclass(frozen=True)
class _EstimateGroup:
    """The estimates of one (b, t, E) in one rank order, made in one process: every depth p, recomputation and
    sequence-parallel split of theirs, which share the layers `LayerMemo` keeps across p (and across the orders: the
    what-if is shipped once, its order replaced here)."""

    tensor: int
    expert: int
    depths: tuple[int, ...]
    kinds: tuple[str, ...]
    splits: tuple[bool, ...]
    rank_order: str
    expert_fixed: bool  # E given, or a dense model's 1: not searched (`_as_estimated`)
    alike: tuple[int, ...] = ()  # the depths p the other order searched places alike (its estimate would be this one)


def _estimate_groups(groups: list, fixed: tuple, pool: Workers | None, report: Callable[[int], None]
                     ) -> list[tuple[list, str | None]]:
    """Each group's settings and refusal (`_estimate_group`), in order: made here, or in `pool`'s workers, each
    count and what-if pickled once (`shipped`), unpickled once a worker; `report` is told how many settings are made
    so far."""
    from ..planning.tune import shipped, submit

    made, count = [], 0
    if pool is None:
        for what, (counted, memo, replays), group in groups:
            made.append(_estimate_group(what, counted, group, *fixed, memo, replays))
            count += len(made[-1][0])
            report(count)
        return made
    sent = {}  # by id of what is shipped, which `groups` keeps alive
    for what, (counted, _, _), _ in groups:
        for value in (what, counted):
            if id(value) not in sent:
                sent[id(value)] = shipped(value)
    futures = [submit(pool, _estimate_group_in_worker, sent[id(what)], sent[id(counted)], group, *fixed)
               for what, (counted, _, _), group in groups]
    for future in as_completed(futures):
        if future.exception() is None:
            count += len(future.result()[0])
            report(count)
    return [future.result() for future in futures]  # the first error in the groups' order, as made here


_WORKER_MEMOS: dict[int, tuple] = {}  # in a worker: each count's LayerMemo and replays, by the count's id there


def _estimate_group_in_worker(what: WhatIf, counted: WorkloadCount, group: _EstimateGroup, *fixed):
    """`_estimate_group` in a worker, where a count shipped stays alive (planning/tune.py `_RECEIVED`): its layers and
    replays are kept for the next group of it."""
    from ..planning.estimate import LayerMemo

    if id(counted) not in _WORKER_MEMOS:
        _WORKER_MEMOS[id(counted)] = LayerMemo(counted, what.gpu, what.curve), {}
    return _estimate_group(what, counted, group, *fixed, *_WORKER_MEMOS[id(counted)])


def _estimate_group(what: WhatIf, counted: WorkloadCount, group: _EstimateGroup, devices: int, optimizer: str,
                    pp_runtime: str, allocator: str, optimizer_step: str, memo, replays: dict
                    ) -> tuple[list, str | None]:
    """The settings of `group`'s estimates, its allocations replayed under `allocator` (`allocator_fields`, by what
    the replay reads: `replays`), and the estimate's refusal of a layout (--recompute op at t > 1), at which the
    group stops (None: none)."""
    from ..planning.estimate import allocations_key
    from ..planning.scenario import profile_scenario
    from ..planning.tune import Setting

    settings, t, e = [], group.tensor, group.expert
    what = _as_estimated(what, t, e, group.expert_fixed)  # here, not shipped: the layers' memo is the what-if's part's
    try:
        with refused_with_flags():
            for p, kind, split in itertools.product(group.depths, group.kinds, group.splits):
                at_split = replace(what, sequence_parallel=split, rank_order=group.rank_order)
                parallel = at_split.parallelism(p, t, devices // (t * p), kind, e)
                scenario = profile_scenario(estimated_profile(at_split, counted, parallel, optimizer, memo),
                                            optimizer, pp_runtime, sized_by_flags=True)
                replayed = allocations_key(parallel)
                if replayed not in replays:
                    replays[replayed] = allocator_fields(allocator, counted, parallel, optimizer_step)
                settings.append(Setting(replace(scenario, **replays[replayed]), t, kind, (p,), e, split,
                                        group.rank_order, p in group.alike))
    except InputError as exc:
        return settings, str(exc)
    return settings, None


def search_summary(stats, estimates_s: float | None = None) -> str:
    """The search's counts, each configuration in one of them, and its seconds, after those of the estimates it
    searched (`estimates_s`, --gpu's; None: a profile's), which the line left out (15 of a 70B tune's 40 s). It
    counts the configurations the progress line counted ("searching 73 configurations"), those refused once built
    among them: it said "searched 72"."""
    searched = stats.configurations + stats.refused_built
    return (f"searched {count_text(searched, 'configuration')} ({stats.refused - stats.refused_built:,} more shapes "
            f"refused by their method): "
            + (f"{stats.refused_built:,} refused once built, " if stats.refused_built else "")
            + f"{stats.stale:,} too stale and {stats.over_memory_floor:,} over the cap by their memory floor "
            f"({stats.simulated_over_limits:,} of them simulated to show what the limits cost), {stats.pruned:,} "
            f"pruned by the throughput bound, {stats.simulated:,} simulated"
            + (f", and {count_text(stats.simulated_leanest, 'leaner cut')} simulated where no cut for time fits"
               if stats.simulated_leanest else "") + f"; {stats.seconds:.2f} s"
            + (f" after {estimates_s:.2f} s of estimates" if estimates_s is not None else ""))


def _print_tuning(tuning, measured, work: dict, replicas_given: bool, command: list[list[str]], peak: str,
                  estimates_s: float | None, orders_searched: bool) -> None:
    """The choice and its runners-up, then what breaks a limit but would be faster, each with why it lost; the
    choice's cut and the `command` that simulates it; `peak`: what the peak column is (`peak_text`); `estimates_s`:
    --gpu's estimates' seconds, which the search's summary gives after its own (None: a profile's);
    `orders_searched`: whether the settings were estimated in both rank orders (a "ranks" column, or its one value
    in the caption)."""
    from ..planning.tune import cut_text, memory_text, significant_ms_text

    problem, env, stats = tuning.problem, measured.environment, tuning.stats
    tensor, context, expert = measured.estimated_degrees  # with --gpu, t and E are each row's
    rows = [tuning.choice, *tuning.runners_up, *tuning.excluded]
    # Columns that would hold one value on every row are left out: R (no searched order), P (one pipeline).
    searched = any(row.result.candidate.activation_limit is not None for row in rows)
    shared = any(row.result.config.pipelines > 1 for row in rows)
    experts = bool(work) and bool(measured.model.options.get("experts"))  # E searched unless given
    split = bool(work) and any(row.result.config.tensor > 1 for row in rows)  # sp: on or off at t > 1
    marked = [("best", tuning.choice), *((str(rank), row) for rank, row in enumerate(tuning.runners_up, 2)),
              *(("over", row) for row in tuning.excluded)]
    configs = [row.result.config for _, row in marked]
    grouped = any(c.microbatch_group is not None for c in configs)  # interleaved 1F1B's groups where m is no multiple
    # a column every row agrees on said once under the table (`said_once`): the --gpu tunes' "stale", all 0,
    # printed alone in a second part at 80 columns; b, recomp and E where the flags fix them, the rank order where
    # one wins every row. A row over the staleness limit says its own in its why not ("staleness 1 > 0"), so the
    # column is said once where the rows within the limit agree (gpt-oss-20b's tune on 8 H100s, whose stale
    # pipedream rows printed it alone in a second part at 80 columns)
    stale_over = any(row.result.staleness > problem.max_staleness for _, row in marked)
    said = said_once({STALENESS_HEADER: [f"{row.result.staleness:,}" for _, row in marked
                                         if row.result.staleness <= problem.max_staleness],
                      **({"b": [f"{c.microbatch_size:,}" for c in configs],
                          "recomp": [_recompute_text(c) for c in configs]} if work else {}),
                      **({"E": [f"{c.expert:,}" for c in configs]} if experts else {}),
                      **({"ranks": [_ranks_cell(c) for c in configs]} if orders_searched else {})},
                     (STALENESS_HEADER, "b", "recomp", "E", "ranks"))
    shown = {header for header in ("b", "recomp", *("E",) * experts) if work and header not in said}
    ranks = orders_searched and "ranks" not in said  # a column where the rows' rank orders differ
    estimated = (f"estimated, t, {'sequence parallelism (sp), ' * split}{'E, ' * experts}"
                 f"{'rank order (ranks), ' * orders_searched}b and recomputation "
                 f"(recomp; sel: selective) searched where not given; "
                 + ("E: ranks the routed experts are placed over"
                    + (f", {said.pop('E')} in every row" if "E" in said else "") + "; " if experts else "")
                 + (f"ranks: {_ranks_text(experts, context)}"
                    + (f", {said.pop('ranks')} in every row" if "ranks" in said else "") + "; "
                    if orders_searched else "") +
                 f"{next(iter(work.values())).mfu_text(problem.gpus)}; ") if work else ""
    read = (f"{peak}; " if peak else "") + ("MFU: the simulate command below gives the choice's; " if (
        measured.estimate is not None and not work) else "")
    per_stage = f"·{context:,}" * (context > 1)
    precision = _held_as(measured)
    # at C > 1 no layout's d·C is 1, nor where d is given (--zero refuses --data-parallel 1)
    one = f" (d = 1 {'not searched' if precision == 'fsdp2' else 'shards nothing'})" * (
        context == 1 and not replicas_given)
    held = (f"ZeRO-{problem.zero} over the d{per_stage} replicas{one}, " * bool(problem.zero)
            + f"precision {precision}, " * (precision is not None))
    replicas = (f"d = D/(p·t{per_stage}) replicas, t{per_stage} GPUs per stage" if work else
                f"D/(p·{tensor * context:,}) replicas, {tensor * context:,} GPUs per stage" if tensor * context > 1
                else "D/p replicas") + f", C = {context:,} context-parallel ranks" * (context > 1) + (
                f", routed experts over E = {expert:,} ranks" if expert > 1 and not work else "")
    mfus = {id(row): work[row.result.config.microbatch_size].metrics(row.result.samples_per_s, problem.gpus)["mfu"]
            for _, row in marked} if work else {}
    table = Table(title=f"{measured.model.name} on {problem.gpus:,} x {env.device_name} ({env.device}), "
                        f"{memory_text(problem.memory_cap_bytes)} each; "
                        f"batch {count_text(problem.batch_size, 'sample')}"
                        + ("" if work else f" (micro-batch {env.microbatch_size:,})")
                        + f", staleness <= {problem.max_staleness:,}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                  caption=f"{estimated}{read}p: devices per pipeline ({replicas}), {held}v: chunks per device, "
                          + ("g: the micro-batches each chunk takes in turn where m is no multiple of p "
                             "(Megatron-core's group, --microbatch-group; -: p), " if grouped else "")
                          + ("P: pipelines, " if shared else "") + "m: micro-batches per pipeline and step; "
                          + ("R: the activation memory a searched order (auto) holds, in 1F1B's, searched with no "
                             "limit but the memory's (simulate's --activation-limit p·m); " if searched else "")
                          + "bubble: 1 - mean compute / step time (exposed communication's waits included)"
                          + (f"; {MFU_PAST_PEAK_TEXT}" if any(share > 1 for share in mfus.values()) else "")
                          + "".join(f"; {header}: {value} in every row" + (
                                       " within the staleness limit (one over it says its own under why not)"
                                       if header == STALENESS_HEADER and stale_over else "")
                                    for header, value in said.items()))
    estimate_columns = (("t", *("sp",) * split, "d", *("E",) * ("E" in shown), *("ranks",) * ranks,
                         *("b",) * ("b" in shown), *("recomp",) * ("recomp" in shown)) if work else ())
    for header in ("", "schedule", "p", "v", *("g",) * grouped, *("P",) * shared, *estimate_columns, "m",
                   *("R",) * searched, "samples/s",
                   *("MFU",) * bool(work), "bubble", "peak",
                   *(STALENESS_HEADER,) * (STALENESS_HEADER not in said), "why not"):
        table.add_column(header, justify="left" if header in ("schedule", "ranks", "recomp", "why not") else "right",
                         no_wrap=header != "why not", min_width=20 if header == "why not" else None)

    def add(mark: str, row, style: str | None = None) -> None:
        c, result = row.result.config, row.result
        same = f"same as {', '.join(twin.label() for twin in row.twins)}" if row.twins else ""
        ratio = result.candidate.activation_limit
        mfu = [percent_text(mfus[id(row)])] if work else []
        group = ["-" if c.microbatch_group is None else f"{c.microbatch_group:,}"] * grouped
        table.add_row(mark, c.schedule, f"{c.stages:,}", f"{c.chunks:,}", *group, *[f"{c.pipelines:,}"] * shared,
                      *([f"{c.tensor:,}", *[_split_text(c)] * split, f"{c.replicas:,}",
                         *[f"{c.expert:,}"] * ("E" in shown), *[_ranks_cell(c)] * ranks,
                         *[f"{c.microbatch_size:,}"] * ("b" in shown),
                         *[_recompute_text(c)] * ("recomp" in shown)] if work else []),
                      f"{c.microbatches:,}", *(["-" if ratio is None else f"{ratio:.2g}"] * searched),
                      rate_text(result.samples_per_s),
                      *mfu, percent_text(result.bubble_fraction), memory_text(result.peak_memory_bytes, zeros=True),
                      *[f"{result.staleness:,}"] * (STALENESS_HEADER not in said),
                      "; ".join(filter(None, (row.why, same))), style=style)

    for mark, row in marked:
        if mark == "over" and row is tuning.excluded[0]:
            table.add_section()
        add(mark, row, style={"best": "bold", "over": "dim"}.get(mark))
    print_table_last_below(table, [f"{mark} {row.result.config.label()}" for mark, row in marked])
    bounds = tuning.choice.result.candidate.bounds
    config = tuning.choice.result.config
    collectives = ("one replica: no data-parallel collective" if config.replicas == 1 else
                   f"{'reduce-scatter and all-gather' if config.zero else 'all-reduce'} "
                   f"{significant_ms_text(tuning.choice.result.candidate.allreduce_ms)} ms per step")
    print_paragraph(f"partition (layers per model stage): {cut_text(bounds)}; {collectives}")
    stdout.print("the choice, as simulate gives it:\n" + _shell_lines(command, available_width(stdout)),
                 highlight=False, soft_wrap=True)
    print_paragraph(search_summary(stats, estimates_s))
    for note in tuning.notes:
        print_paragraph(f"note: {note}")
