"""The what-if GPU: the model counted by torch on the meta device (workload/count.py), priced on a catalogue
part (planning/estimate.py) into a Profile that every command reads as it reads a calibrated one. `simulate`,
`sweep` and `tune` read the flags here; `pipesim estimate` writes the profile for reuse. torch is imported only
once --gpu is given, so the commands start fast without it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..choices import choose_from, nearest_text
from ..planning.host import HOST_KERNEL_US
from ..profiles.workload import RECOMPUTED_PARTS, module_regions, too_many_stages
from ..units import MIB, degree_text
from .common import (
    COUNTING_MODEL,
    DTYPES,
    FP8,
    MODEL_SIZES,
    PROFILE,
    DataParallel,
    GpuName,
    HeldOptimizer,
    HeldPrecision,
    InputError,
    MicrobatchSize,
    ModelName,
    Recompute,
    ShardedOptimizer,
    Stages,
    TensorParallel,
    Zero,
    check_dtype,
    check_optimizer_held,
    check_outputs,
    collector_paused,
    fail,
    flag_line,
    flag_of,
    given_flag,
    is_given,
    model_reads,
    option_of,
    out_of_memory_line,
    output_path,
    read_error,
    read_profile,
    refuse,
    refused_with_flags,
    require_model,
    say_what_if_counted,
    stderr,
    stdout,
    transient_status,
    what_if_options,
    writing,
    zero_stage,
)
from .tables import print_message, print_table

if TYPE_CHECKING:
    from ..hardware.catalogue import Cluster, Curve, Gpu
    from ..planning.estimate import LayerMemo, Parallelism
    from ..profiles.schema import Estimate, FittedCurve, Profile
    from ..profiles.workload import WorkloadCount

# What only the estimate reads (by parameter name), so without --gpu it would be silently ignored.
ESTIMATE_ONLY = ("model", *MODEL_SIZES, "dtype", "attention", "gpus", "tensor_parallel", "sequence_parallel",
                 "tp_overlap", "context_parallel", "expert_parallel", "hot_expert_share", "routing", "recompute",
                 "curve_from", "fsdp_float8_all_gather", "fp8_param_gather",
                 "fp8_recipe", "token_dispatcher", "dispatcher_sms", "host_kernel_us", "host_module_us", "p2p_sync",
                 "cuda_graphs",
                 "expert_gemm", "expert_tensor_parallel",
                 "rank_order",
                 "loss_parallel", "tp_runtime", "cp_rotate", "swiglu_fusion", "cross_entropy", "norm_kernel",
                 "rope_kernel", "repeat_kv", "recompute_modules", "torch_compile",
                 "ema", "scores_buffer", "tp_overlap_no_margin", "tp_overlap_fp8_buf", "attention_kernel",
                 "grad_accumulation", "linear_kernel", "router_aux_loss")
# What the estimate gives, so that beside --gpu it would be silently ignored (the commands declare some of them).
ESTIMATED = ("profile", "fwd", "bwd", "wgrad_fraction", "opt", "pred", "avg", "param_mb", "activation_mb",
             "output_mb", "comm", "cluster", "graph", "network_gb_s")
# The count's kernels (workload/count.py) and their defaults: recorded beside an estimate's parallelism, so that a
# profile says what it priced and the costs line names what is not the default.
KERNEL_DEFAULTS = {"swiglu_fusion": True, "cross_entropy": "torch", "norm_kernel": "eager", "rope_kernel": "eager",
                   "repeat_kv": False,
                   "router_aux_loss": "none"}
# Settings named in an estimate's parallelism text only when they are not these (a bool not listed: when set).
SETTING_DEFAULTS = {"rank_order": "pipesim", "tp_runtime": "megatron", "grad_accumulation": "separate",
                    "routing": "balanced", "host_kernel_us": HOST_KERNEL_US, "host_module_us": None,
                    "expert_gemm": "grouped",
                    **KERNEL_DEFAULTS}
# Settings whose name ends in their unit, said as "name value unit" in an estimate's parallelism text.
SETTING_UNITS = {"host_kernel_us": ("host kernel", "us"), "host_module_us": ("host module", "us")}
@dataclass(frozen=True)
class WhatIf:
    """The what-if flags' values, checked: a catalogue part (or cluster), the model to count and how."""

    gpu: Gpu
    cluster: Cluster | None  # a catalogue cluster named by --gpu: its part, node size and network
    model: str
    options: dict[str, Any]  # the model's size flags (None: its default)
    dtype: str  # torch's name, as the model is counted (--dtype fp8: bfloat16)
    attention: str
    sequence_parallel: bool
    context: int  # --context-parallel C
    sharded_optimizer: bool
    precision: str | None  # --precision (None: by --dtype)
    calibrated: Profile | None = None  # --curve-from: a calibration on the part, whose layers fit its curve
    calibrated_path: Path | None = None
    fp8: str | None = None  # --dtype fp8's recipe (planning/fp8.py), None: no float8
    expert: int = 1  # --expert-parallel E
    hot_expert_share: float | None = None  # --hot-expert-share S (None: balanced)
    tp_overlap: bool = False  # --tp-overlap
    token_dispatcher: str | None = None  # --token-dispatcher (None: alltoall)
    expert_tensor: int | None = None  # --expert-tensor-parallel ETP (None: t)
    rank_order: str = "pipesim"  # --rank-order
    loss_parallel: bool = False  # --loss-parallel (workload/loss.py)
    tp_runtime: str = "megatron"  # --tp-runtime, of planning/estimate.py's TP_RUNTIMES
    cp_rotate: str = "alltoall"  # --cp-rotate, of planning/estimate.py's CP_ROTATES
    fsdp_float8_all_gather: bool = False  # --fsdp-float8-all-gather (planning/fp8.py)
    fp8_param_gather: bool = False  # --fp8-param-gather (planning/estimate.py `gathered_weight_bytes`)
    swiglu_fusion: bool = True  # --swiglu-fusion (workload/moe.py)
    cross_entropy: str = "torch"  # --cross-entropy, of workload/sizes.py's CROSS_ENTROPY
    norm_kernel: str = "eager"  # --norm-kernel, of workload/sizes.py's NORM_KERNELS
    rope_kernel: str = "eager"  # --rope-kernel, of workload/sizes.py's ROPE_KERNELS
    repeat_kv: bool = False  # --repeat-kv (workload/count.py `_GpuKernels`)
    router_aux_loss: str = "none"  # --router-aux-loss, of workload/moe.py's ROUTER_AUX_LOSSES
    dispatcher_sms: int | None = None  # --dispatcher-sms (None: the flex dispatcher backend's default)
    recompute_modules: tuple[str, ...] = ()  # --recompute-modules (planning/estimate.py `Regions`)
    torch_compile: bool = False  # --torch-compile (planning/estimate.py `_unread_kept`)
    ema: str | None = None  # --ema (planning/estimate.py `EMA_PLACES`; None: none)
    scores_buffer: bool = False  # --scores-buffer (planning/estimate.py `scores_buffer_bytes`)
    grad_accumulation: str | None = None  # --grad-accumulation (None: --precision's, planning/estimate.py)
    linear_kernel: str | None = None  # --linear-kernel, of planning/te.py's LINEAR_KERNELS (None: by the recipe)
    tp_overlap_no_margin: bool = False  # --tp-overlap-no-margin
    tp_overlap_fp8_buf: bool = False  # --tp-overlap-fp8-buf
    attention_kernel: str = "flash2"  # --attention-kernel, of hardware/catalogue.py's ATTENTION_KERNELS
    routing: str = "balanced"  # --routing, of planning/experts.py's ROUTINGS
    host_kernel_us: float | None = None  # --host-kernel-us (None: planning/host.py's HOST_KERNEL_US)
    host_module_us: float | None = None  # --host-module-us (None: by the runtime, planning/host.py's module_us)
    expert_gemm: str = "grouped"  # --expert-gemm, of planning/experts.py's EXPERT_GEMMS
    p2p_sync: bool = False  # --p2p-sync (profiles/schema.py `stage_host_waits_ms`)
    cuda_graphs: tuple[str, ...] = ()  # --cuda-graphs (planning/estimate.py `CUDA_GRAPH_SCOPES`)

    @cached_property
    def curve(self) -> Curve | None:
        """The part's efficiency curve from the --curve-from calibration: the one `pipesim calibrate` stored in it
        where that was fitted on the tiles this part's products are priced on and the attention the fit counts
        (`FIT_ATTENTION`: a curve stored before was fitted on the math path's scores) with a kernel overhead timed
        on the device's clock, else fitted here to its measured layers on the same model's count (imports torch;
        once per command), less the overhead calibrate timed on the device, or the part's where calibrate timed
        its host's issue (a CUDA calibration from before: `FittedCurve.kernel_overhead_on_device`); either curve
        refitted with the attention held at the part's where it puts a rate above the datasheet (`separated_fit`);
        None: the catalogue's curve."""
        if self.calibrated is None:
            return None
        from ..planning.estimate import FIT_ATTENTION, PEAK_DTYPE, EstimateError, curve_for, fit_rates, separated_fit

        env = self.calibrated.environment
        peak = getattr(self.gpu.dense_tflops, PEAK_DTYPE[env.dtype])
        if peak is None or self.gpu.curve is None:
            raise InputError(f"--curve-from: {self.gpu.name} has no {env.dtype} peak or curve in the catalogue to fit")
        # A CPU has no tile or wave quantisation: one "multiprocessor" of 1 x 1 tiles, so that a CPU calibration
        # fits the CPU (how the fit is tested without a GPU)
        shape = (self.gpu.curve.multiprocessors, self.gpu.curve.tiles) if env.device == "cuda" else (1, [(1, 1)])
        stored = self.calibrated.fitted_curve
        where = f"{self.calibrated_path} ({env.device_name}, {env.date})"
        overhead_ms = timed_overhead_ms(self.calibrated, self.gpu.curve.kernel_overhead_ms)  # None: the fit finds one
        # why a stored curve is not the one this part is priced on, said in the curve's source
        passed_over = [] if stored is None else [why for why, holds in (
            ("fitted on other tiles", (stored.multiprocessors, stored.tiles) != shape),
            (f"attention counted as {stored.attention}", stored.attention not in (None, FIT_ATTENTION)),
            (f"its kernel overhead timed on the host's clock: the part's "
             f"{self.gpu.curve.kernel_overhead_ms * 1e3:.1f} us a kernel taken", host_timed_overhead(self.calibrated)))
            if holds]
        datasheet = (peak * 1e9, self.gpu.memory_bandwidth_gb_s * 1e6)

        def refit(attention_flops_per_ms: float | None = None) -> FittedCurve:
            return fit_rates(self.calibrated, fit_count(self.calibrated, "--curve-from"), *shape, overhead_ms,
                             attention_flops_per_ms)
        try:
            if stored is not None and not passed_over:
                fitted, source = stored, f"stored by pipesim calibrate in {where}"
            else:
                fitted = refit()
                source = f"fitted to {where}" + (f", not its stored curve ({', '.join(passed_over)})"
                                                  if passed_over else "")
            fitted, held = separated_fit(fitted, refit, *datasheet, self.gpu.curve)
            return curve_for(fitted, *datasheet, self.gpu.curve, f"{source}{held}; {fit_errors(fitted)}")
        except EstimateError as exc:
            raise InputError(f"--curve-from: {exc}") from None

    @property
    def cluster_gpus(self) -> int | None:
        """The GPUs of the catalogue cluster (None: a part alone, as many as asked for)."""
        if self.cluster is None:
            return None
        return self.cluster.nodes * (self.cluster.gpus_per_node or self.gpu.intra_node.gpus_per_node)

    def parallelism(self, stages: int, tensor: int = 1, data: int = 1, recompute: str = "none",
                    expert: int | None = None) -> Parallelism:
        """t x C x p x d GPUs as the estimate takes them, the routed experts over `expert` of them (None:
        --expert-parallel's; tune searches it); more than a catalogue cluster has is refused."""
        from ..planning.estimate import Parallelism

        size, used = self.cluster_gpus, tensor * self.context * stages * data
        if size is not None and used > size:
            degrees = {"t": tensor, "C": self.context, "p": stages, "d": data}
            shown = {name: value for name, value in degrees.items() if name != "C" or value > 1}
            raise InputError(f"--gpu: the cluster has {size} GPUs, fewer than {' x '.join(shown)} = "
                             f"{' x '.join(map(str, shown.values()))} = {used}")
        return Parallelism(tensor=tensor, pipeline=stages, data=data, context=self.context,
                           sequence_parallel=self.sequence_parallel,
                           recompute=recompute, sharded_optimizer=self.sharded_optimizer and data * self.context > 1,
                           precision=self.precision, fp8=self.fp8, expert=self.expert if expert is None else expert,
                           fsdp_float8_all_gather=self.fsdp_float8_all_gather,
                           fp8_param_gather=self.fp8_param_gather,
                           hot_expert_share=self.hot_expert_share, routing=self.routing, tp_overlap=self.tp_overlap,
                           token_dispatcher=self.token_dispatcher, dispatcher_sms=self.dispatcher_sms,
                           expert_tensor=self.expert_tensor,
                           rank_order=self.rank_order, loss_parallel=self.loss_parallel, tp_runtime=self.tp_runtime,
                           tp_overlap_no_margin=self.tp_overlap_no_margin, tp_overlap_fp8_buf=self.tp_overlap_fp8_buf,
                           attention_kernel=self.attention_kernel,
                           cp_rotate=self.cp_rotate,  # full and op keep what they keep: tune tries them too
                           recompute_modules=self.recompute_modules if recompute in ("none", "selective") else (),
                           torch_compile=self.torch_compile,
                           ema=self.ema, scores_buffer=self.scores_buffer, grad_accumulation=self.grad_accumulation,
                           linear_kernel=self.linear_kernel,
                           host_kernel_us=HOST_KERNEL_US if self.host_kernel_us is None else self.host_kernel_us,
                           host_module_us=self.host_module_us, expert_gemm=self.expert_gemm,
                           p2p_sync=self.p2p_sync, cuda_graphs=self.cuda_graphs)


def _calibrated_refusal(names: list[str], given: list[str]) -> str:
    """The one line for estimate's flags beside a calibrated --profile: its costs were measured, so the way to
    other settings is calibrate's flags, where it takes them, or --gpu; not `pipesim estimate`."""
    import inspect

    from .calibrate import calibrate

    takes = [flag for name, flag in zip(names, given) if name in inspect.signature(calibrate).parameters]
    again = f"calibrate again with `pipesim calibrate ... {' '.join(takes)}`, or give" if takes else "give"
    return (f"{', '.join(given)}: --profile's costs were measured by `pipesim calibrate` with its own model and "
            f"settings; {again} --gpu NAME and --model in place of --profile")


def what_if(ctx: typer.Context, profile_reads: tuple[str, ...] = ()) -> WhatIf | None:
    """The --gpu flags, checked before any work (no torch yet); None without --gpu, whose flags are then refused
    (they would be silently ignored) but for `profile_reads` beside --profile (the command reads those itself),
    as are, beside it, the flags whose costs it estimates."""
    params = ctx.params
    if params.get("gpu") is None:
        read = profile_reads if params.get("profile") is not None else ()
        names = [name for name in ESTIMATE_ONLY if name in params and is_given(ctx, name) and name not in read]
        given = [given_flag(ctx, name) for name in names]
        if given and params.get("profile") is not None:
            # read here on the way to a refusal only: a profile the command goes on with is read after
            if read_profile(params["profile"]).estimate is None:
                raise InputError(_calibrated_refusal(names, given))
            # estimate's flags for them: a switch that tune searches where not given (its default None), turned off,
            # is estimate's default, which has no off side
            again = [flag for name, flag in zip(names, given) if not (params[name] is False and _searched(ctx, name))]
            raise InputError(f"{', '.join(given)}: --profile's costs are priced already (an estimate records its "
                             "settings, which the costs line names); write another with "
                             f"`{' '.join(['pipesim estimate ...', *again])}`, or give --gpu NAME and --model in "
                             "place of --profile")
        if given:
            raise InputError(f"{', '.join(given)}: only --gpu's estimate reads {'it' if len(given) == 1 else 'them'}; "
                             "give --gpu NAME (`pipesim gpus` lists the GPUs) and --model")
        return None
    from ..hardware.catalogue import CatalogueError, load_catalogue  # pydantic: only for --gpu
    from ..planning.estimate import EstimateError, check_ring_attention, kernel_curve, no_sequence_refusal
    from ..workload.sizes import (
        DEFAULT_SIZES,
        REPEAT_KV_UNDER_MATH,
        attention_of,
        flag_sizes_refusal,
        kernels_refusal,
    )

    clash = [flag_of(name) for name in ESTIMATED if name in params and is_given(ctx, name)]
    if clash:
        raise InputError(f"{', '.join(clash)}: --gpu estimates the costs, sizes and links from the model; drop "
                         f"{'these flags' if len(clash) > 1 else clash[0]}")
    if params.get("model") is None:
        raise InputError("--gpu: give the model to estimate: --model gpt with its size flags (--layers, --width, "
                         "--heads, --seq-len, ...), --model hf:PATH (a Hugging Face config.json) with --seq-len, or "
                         "--model package.module:attribute")
    check_dtype(params["dtype"], FP8)
    check_optimizer_held(params.get("optimizer", "adam"), params.get("precision"), None)  # before the count
    if params.get("tp_overlap") and params.get("tensor_parallel") == 1:  # before its own want of sequence parallelism
        raise InputError("--tp-overlap overlaps a tensor-parallel group's sequence-parallel all-gathers and "
                         "reduce-scatters with its products: give --tensor-parallel 2 or more"
                         + ("" if params.get("sequence_parallel") else " and --sequence-parallel"))
    if params.get("sequence_parallel") and params.get("tensor_parallel") == 1:
        raise InputError("--sequence-parallel splits a tensor-parallel group's norms and dropouts: give "
                         "--tensor-parallel 2 or more")
    # the count's kernels, read once: refused here, before the count's torch, and held by the WhatIf
    cross_entropy, norm_kernel = params.get("cross_entropy", "torch"), params.get("norm_kernel", "eager")
    rope_kernel, loss_parallel = params.get("rope_kernel", "eager"), params.get("loss_parallel", False)
    router_aux_loss = _or_default(params, "router_aux_loss", "none")
    refuse(kernels_refusal(cross_entropy, norm_kernel, rope_kernel, loss_parallel, router_aux_loss))
    if (params.get("repeat_kv") and params["model"] not in DEFAULT_SIZES  # a built-in one counts in a second, and
            and attention_of(params["attention"], params["model"]) != "flash"):  # says first if it has none to copy
        raise InputError(REPEAT_KV_UNDER_MATH)
    refuse(flag_sizes_refusal(params["model"], {key: params.get(key) for key in MODEL_SIZES}))
    if loss_parallel and params.get("tensor_parallel") == 1:  # torchtitan's at t > 1 only
        raise InputError("--loss-parallel splits the logits by vocabulary over a tensor-parallel group (torchtitan's "
                         "with t > 1): give --tensor-parallel 2 or more")
    try:
        catalogue = load_catalogue(params.get("gpus"))
    except CatalogueError as exc:
        raise InputError(f"--gpus: {exc}") from None
    name, cluster = params["gpu"], None
    if name in catalogue.cluster:
        cluster = catalogue.cluster[name]
        name = cluster.gpu
    elif name not in catalogue.gpu:
        clusters = f"; clusters: {', '.join(catalogue.cluster)}" if catalogue.cluster else ""
        raise InputError(f"--gpu: unknown {name!r}{nearest_text(name, [*catalogue.gpu, *catalogue.cluster])}; known "
                         f"GPUs: {', '.join(catalogue.gpu)}{clusters}")
    if catalogue.gpu[name].curve is None:  # every built-in part has one: the --gpus file's part lacks it
        raise InputError(f"--gpu {params['gpu']}: {params.get('gpus')}'s {name} gives no curve = {{...}}, the "
                         "efficiencies every estimate prices a part with (examples/h100-hbm2e-96gb.toml has one); add "
                         "one to it")
    fp8 = _fp8_recipe(params, name, catalogue.gpu)
    dispatcher, routing = params.get("token_dispatcher"), _or_default(params, "routing", "balanced")
    if routing == "random" and params.get("capacity_factor") is not None:
        raise InputError("--routing random: a model that drops tokens (--capacity-factor) computes each expert's "
                         "capacity however they are routed; give balanced")
    if dispatcher == "deepep" and params.get("capacity_factor") is not None:  # transformer_config.py asserts it
        raise InputError("--token-dispatcher deepep: Megatron-core's flex dispatcher does not pad experts to their "
                         "capacity (--capacity-factor); give alltoall")  # (core_v0.14.0; DeepEP's alone at 55ac708)
    if dispatcher == "hybridep" and params.get("capacity_factor") is not None:
        raise InputError("--token-dispatcher hybridep: its padding to capacity (--capacity-factor), inside HybridEP's "
                         "dispatch, is not modelled; give alltoall")
    if params.get("hot_expert_share") is not None and params.get("capacity_factor") is not None:
        raise InputError("--hot-expert-share: a model that drops tokens (--capacity-factor) pads every expert to its "
                         "capacity however they are routed; give one of them")
    calibrated = None
    if params.get("curve_from") is not None:
        calibrated = read_profile(params["curve_from"], "--curve-from")
    modules, zero = params.get("recompute_modules"), zero_stage(params)
    what = WhatIf(catalogue.gpu[name], cluster, params["model"], {key: params.get(key) for key in MODEL_SIZES},
                  DTYPES.get(params["dtype"], "bfloat16"), attention_of(params["attention"], params["model"]),
                  bool(params.get("sequence_parallel")),
                  params.get("context_parallel", 1), zero >= 1, params.get("precision"), calibrated,
                  params.get("curve_from"), fp8, params.get("expert_parallel", 1), params.get("hot_expert_share"),
                  params.get("tp_overlap", False), dispatcher, params.get("expert_tensor_parallel"),
                  _or_default(params, "rank_order", "pipesim"), loss_parallel,
                  _or_default(params, "tp_runtime", "megatron"), _or_default(params, "cp_rotate", "alltoall"),
                  swiglu_fusion=params.get("swiglu_fusion", True), cross_entropy=cross_entropy,
                  norm_kernel=norm_kernel, rope_kernel=rope_kernel, router_aux_loss=router_aux_loss,
                  repeat_kv=params.get("repeat_kv", False),
                  fsdp_float8_all_gather=params.get("fsdp_float8_all_gather", False),
                  fp8_param_gather=params.get("fp8_param_gather", False),
                  dispatcher_sms=params.get("dispatcher_sms"),
                  recompute_modules=_comma_list(modules),
                  torch_compile=params.get("torch_compile", False),
                  ema=params.get("ema"), scores_buffer=params.get("scores_buffer", False),
                  tp_overlap_no_margin=params.get("tp_overlap_no_margin", False),
                  tp_overlap_fp8_buf=params.get("tp_overlap_fp8_buf", False),
                  attention_kernel=_or_default(params, "attention_kernel", "flash2"),
                  grad_accumulation=params.get("grad_accumulation"), linear_kernel=params.get("linear_kernel"),
                  routing=routing,
                  host_kernel_us=params.get("host_kernel_us"), host_module_us=params.get("host_module_us"),
                  expert_gemm=_or_default(params, "expert_gemm", "grouped"), p2p_sync=params.get("p2p_sync", False),
                  cuda_graphs=_comma_list(params.get("cuda_graphs")))
    with refused_with_flags():  # the layout's rules, before the model is counted (which takes seconds)
        built_in = DEFAULT_SIZES.get(what.model)  # None: a Hugging Face config or the user's module, counted first
        if what.context > 1 and built_in is not None and "seq_len" not in built_in:
            raise EstimateError(no_sequence_refusal(what.context, what.model))  # before its attention's kernel
        check_ring_attention(what.context, what.attention)
        recompute = _or_default(params, "recompute", "none")
        # with the modules as given: `parallelism` drops them under full and op, which tune tries too; at the t
        # given (tune's search, none given, tries 1 too)
        replace(what.parallelism(1, params.get("tensor_parallel") or 1, recompute=recompute),
                recompute_modules=what.recompute_modules)
    if params.get("overlap_expert_comm") and (refusal := expert_overlap_refusal(what.recompute_modules,
                                                                                what.cuda_graphs)):
        raise InputError(refusal)
    if params.get("tp_runtime") is not None and not params.get("sequence_parallel"):
        raise InputError("--tp-runtime sets how sequence-parallel layers keep their inputs: give --sequence-parallel "
                         "too")
    if params.get("cp_rotate") is not None and params.get("context_parallel", 1) == 1:
        raise InputError("--cp-rotate sets how the context ring passes keys and values: give --context-parallel 2 "
                         "or more")
    if params.get("scores_buffer") and what.attention != "math":
        raise InputError("--scores-buffer keeps the buffer Megatron-LM's unfused attention computes its scores "
                         "beside: give --attention math")
    if params.get("attention_kernel") is not None and what.attention != "flash":
        raise InputError("--attention-kernel names the fused kernel that runs --attention flash: give --attention "
                         "flash")
    if params.get("attention_kernel") is not None and params.get("curve_from") is not None:
        raise InputError("--attention-kernel prices attention at a kernel's published rate; --curve-from's "
                         "calibration measured its own: give one of them")
    if what.gpu.curve is not None:
        with refused_with_flags():
            kernel_curve(what.gpu.curve, what.attention_kernel, name)
    _check_fp8_param_gather(params, zero)
    if what.expert_tensor is not None and what.rank_order != "megatron":
        raise InputError("--expert-tensor-parallel folds the experts over the tensor-, context- and data-parallel "
                         "ranks as Megatron-core numbers them: give --rank-order megatron")
    return what


def _comma_list(text: str | None) -> tuple[str, ...]:
    """A flag's comma list, each part stripped (None: none)."""
    return () if text is None else tuple(part.strip() for part in text.split(","))


def _searched(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` defaults to None, searched where not given (tune's --sequence-parallel)."""
    option = option_of(ctx, name)
    return option is not None and option.default is None


def _or_default(params: dict[str, Any], key: str, default: str) -> str:
    """Flag `key`'s value, or `default` where it is None (not given): an empty value given is checked as any other
    (`params.get(key) or default` read it as not given, and ran the default)."""
    value = params.get(key)
    return default if value is None else value


def _fp8_recipe(params: dict[str, Any], name: str, gpus: dict[str, Gpu]) -> str | None:
    """--dtype fp8's recipe (--fp8-recipe, default te), on a part with a float8 peak; None for another --dtype,
    with which --fp8-recipe is refused."""
    recipe = params.get("fp8_recipe")
    if params["dtype"] != FP8:
        given = [flag for flag, value in (("--fp8-recipe", recipe is not None),
                                          ("--fsdp-float8-all-gather", params.get("fsdp_float8_all_gather")),
                                          ("--fp8-param-gather", params.get("fp8_param_gather")),
                                          ("--tp-overlap-fp8-buf", params.get("tp_overlap_fp8_buf"))) if value]
        if given:
            raise InputError(f"{given[0]} says how --dtype fp8 runs the linear products: give --dtype fp8")
        return None
    from ..planning.estimate import EstimateError, fp8_peak_tflops

    try:
        fp8_peak_tflops(gpus[name], name)
    except EstimateError as exc:
        having = [part for part, gpu in gpus.items() if gpu.dense_tflops.fp8 is not None]
        raise InputError(f"{flag_line(exc)}; parts with one: {', '.join(having)}") from None
    return "te" if recipe is None else recipe


def _check_fp8_param_gather(params: dict[str, Any], zero: int) -> None:
    """--fp8-param-gather beside --zero 1 or 2 (`zero`), whose distributed optimizer all-gathers the float8 weights:
    ZeRO's stage is the command's to check (simulate applies it to the estimate's profile; `Parallelism` holds whether
    the optimizer is sharded, and checks the recipe, the precision and the expert parallelism)."""
    if params.get("fp8_param_gather") and zero not in (1, 2):
        raise InputError("--fp8-param-gather: TransformerEngine's float8 weights all-gathered by the distributed "
                         f"optimizer; give --zero 1 or 2 (got --zero {zero})")


def fit_errors(fitted: FittedCurve) -> str:
    """A fitted curve's error on its own calibration: per pass, median (worst) |error| over the layers; the
    passes it was not fitted to (the weight pass, predicted as the full backward's work) said apart."""
    from ..profiles.schema import PASSES

    def errors(names: list[str]) -> str:
        found = [(name, fitted.error(name)) for name in names]
        return ", ".join(f"{name} {error[0]:.0%} ({error[1]:.0%})" for name, error in found if error is not None)

    others = errors([name for name in PASSES if name not in fitted.passes])
    return (f"fit error, median (worst) over the layers: {errors(fitted.passes)}"
            + (f"; predicted: {others}" if others else ""))


def fit_count(profile: Profile, needer: str) -> WorkloadCount:
    """A calibration's model counted as the fit of its device's curve reads it (calibrate's, --curve-from's,
    benchmarks/fit_curve.py's): its attention as the fused kernel torch ran there (`FIT_ATTENTION`), its SwiGLU as
    the torch ops it ran, unfused; from the host cache once counted."""
    from ..planning.estimate import FIT_ATTENTION
    from ..workload.models import rebuilt_options

    env = profile.environment
    return count_model_of(profile.model.name, rebuilt_options(profile.model.name, profile.model.options),
                          env.microbatch_size, env.dtype, FIT_ATTENTION, needer, swiglu_fusion=False)


def host_timed_overhead(profile: Profile) -> bool:
    """Whether the kernel overhead calibrate stored in `profile` is its host's issue of the timed chain, not the
    device's time for it: a CUDA chain timed on the host's clock (`FittedCurve.kernel_overhead_on_device` false, a
    calibration from before calibrate/kernel.py timed it on the GPU's), which the layers it is taken off hide."""
    stored = profile.fitted_curve
    return (stored is not None and stored.kernel_overhead_measured and profile.environment.device == "cuda"
            and not stored.kernel_overhead_on_device)


def timed_overhead_ms(profile: Profile, part_overhead_ms: float) -> float | None:
    """The kernel overhead a fit to `profile`'s layers takes as measured (--curve-from's, benchmarks/fit_curve.py's):
    the one calibrate timed on the device, or the part's (`part_overhead_ms`) where it timed its host's issue
    (`host_timed_overhead`); None where it timed none (the fit finds one)."""
    stored = profile.fitted_curve
    if stored is None or not stored.kernel_overhead_measured:
        return None
    return part_overhead_ms if host_timed_overhead(profile) else stored.kernel_overhead_ms


def fit_device_curve(profile: Profile, phase: Callable[[str], AbstractContextManager]) -> Profile:
    """`profile` (just calibrated) with its device's efficiency curve stored: the kernel overhead timed on the
    device (calibrate/kernel.py), the rates fitted to the measured layers on the same model's count
    (`fit_rates`), inside `phase`, so that `--curve-from` reads it without counting; unchanged, with a note on
    stderr, where the model cannot be counted (the meta device included) or its times do not fit the count."""
    import torch

    from ..calibrate.kernel import kernel_overhead_ms
    from ..planning.estimate import CUDA_TILES, EstimateError, fit_rates

    env = profile.environment
    device = torch.device(env.device)
    if device.type == "cuda":
        shape = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count, CUDA_TILES)
    else:
        shape = (1, [(1, 1)])  # a CPU: no tile or wave quantisation
    with phase("fitting the device's efficiency curve to the layers"):
        try:
            counted = fit_count(profile, "the fitted curve")
            overhead_ms = kernel_overhead_ms(device, getattr(torch, env.dtype))
            fitted = fit_rates(profile, counted, *shape, overhead_ms)
            return profile.model_copy(update={"fitted_curve": fitted.model_copy(
                update={"kernel_overhead_on_device": True})})
        except (InputError, EstimateError, RuntimeError, NotImplementedError) as exc:  # the meta device's too
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            print_message(f"note: no efficiency curve stored in the profile: {first_line}", stderr)
            return profile


def print_fitted_curve(profile: Profile) -> None:
    """One line: the stored curve's rates and its fit error (nothing where the profile has none)."""
    fitted = profile.fitted_curve
    if fitted is None:
        return
    rates = [f"products {fitted.matmul_flops_per_ms / 1e9:.3g} TFLOP/s"]
    if fitted.attention_flops_per_ms is not None:
        rates.append(f"attention {fitted.attention_flops_per_ms / 1e9:.3g} TFLOP/s")
    rates.append("memory-bound ops free" if fitted.memory_bytes_per_ms is None else
                 f"memory-bound {fitted.memory_bytes_per_ms / 1e6:.3g} GB/s")
    stdout.print(f"efficiency curve (stored; --curve-from reads it): {', '.join(rates)}, "
                 f"{fitted.kernel_overhead_ms * 1e3:.1f} us a kernel"
                 f"{' (measured)' if fitted.kernel_overhead_measured else ''}; {fit_errors(fitted)}", highlight=False)


# what a terminal shows while count_what_if and estimated_profile run: a first count imports torch (seconds)
COUNTING_STATUS = f"{COUNTING_MODEL}, then pricing it for --gpu"


def expert_overlap_refusal(recompute_modules: tuple[str, ...], cuda_graphs: tuple[str, ...],
                           estimated: str = "") -> str | None:
    """Why --overlap-expert-comm cannot run beside these settings (as given, or `estimated`: the --profile's words
    for them), or None: a mixture of experts recomputed whole, or each layer a CUDA graph's replay."""
    if "moe" in recompute_modules:
        return (f"--recompute-modules moe{estimated} reruns each mixture of experts whole, which Megatron-core's "
                "expert-parallel overlap does not take (transformer_config.py: \"disable moe in recompute_modules "
                "when enabling overlap_moe_expert_parallel_comm\"): drop one of them")
    if "full" in cuda_graphs:
        return (f"--cuda-graphs full{estimated} prices each layer's forward and backward as one replay, and "
                "--overlap-expert-comm pairs one micro-batch's forward with another's backward node by node: drop "
                "one of them")
    return None


def count_what_if(what: WhatIf, microbatch_size: int) -> WorkloadCount:
    """The model counted on the meta device at `microbatch_size` samples. A built-in model's count is kept in the
    host cache, keyed by everything it depends on (see `_count_cache`), so that only the first what-if of a shape
    pays for importing torch (about 4 s, most of it torch's own compiler, which its meta kernels import). The rules
    that need the count are refused here, once for every command (tune would take a refusal from each estimate for
    its t's, after its progress note): --expert-gemm per-expert, --expert-parallel and the routing's options on a
    model without routed experts, and E not dividing them."""
    from ..planning.estimate import captured, runs_te_layers
    from ..planning.experts import check_expert_ranks
    from ..planning.host import synchronises

    counted = count_model_of(what.model, what.options, microbatch_size, what.dtype, what.attention,
                             "--gpu (the model is counted by torch on the meta device)", what.loss_parallel,
                             what.swiglu_fusion, what.cross_entropy, what.norm_kernel, what.rope_kernel,
                             what.router_aux_loss, what.repeat_kv)
    if what.expert_gemm != "grouped" and not counted.options.get("experts"):
        raise InputError(f"--expert-gemm {what.expert_gemm} runs a mixture of experts' routed products, and the "
                         "model has none (gpt --experts, or a Hugging Face MoE config); give grouped")
    # refused here, not by the expert group's "give --expert-parallel above 1", which a dense model then refuses
    routed_only = [flag for flag, given in (("--hot-expert-share", what.hot_expert_share is not None),
                                            ("--token-dispatcher", what.token_dispatcher is not None),
                                            ("--routing random", what.routing == "random")) if given]
    if routed_only and not counted.options.get("experts"):
        raise InputError(f"{routed_only[0]} applies to a mixture of experts' routing, and the model has no routed "
                         "experts (gpt --experts, or a Hugging Face MoE config); leave it out")
    with refused_with_flags():
        check_expert_ranks(what.expert, counted.options.get("experts"))
    te_layers = runs_te_layers(what.linear_kernel, what.fp8)
    for name in what.recompute_modules:
        # the part as the model holds it, and as this run's linears leave it a module of its own
        held, kept = (any(module_regions(name, te)[0] in layer.region_ops for layer in counted.layers)
                      for te in (False, te_layers))
        if not held:
            raise InputError(f"--recompute-modules {name}: no layer of the model has {RECOMPUTED_PARTS[name]} to "
                             "recompute; leave it out")
        if not kept:  # Megatron-core's layernorm under TransformerEngine's layers: an IdentityOp in every layer
            why, way = (("--linear-kernel te", "give --linear-kernel eager or leave it out") if what.linear_kernel
                        else (f"those --fp8-recipe {what.fp8} runs", "leave it out"))
            raise InputError(f"--recompute-modules {name}: under TransformerEngine's layers ({why}) no layer of the "
                             "model has a norm of its own to recompute: each is fused into the linear after it "
                             f"(TELayerNormColumnParallelLinear), as Megatron-core runs it; {way}")
    if what.attention == "math" and (chunk := counted.options.get("attention_chunk")):
        raise InputError(f"--attention math: the model's chunked attention layers attend within chunks of {chunk:,} "
                         "tokens, whose unfused scores the estimate does not split by tensor parallelism or drop "
                         "under selective recomputation (it knows a sequence's s x s alone); give --attention flash")
    if "mamba" in what.cuda_graphs and not any(layer.mamba_layer for layer in counted.layers):
        raise InputError("--cuda-graphs mamba: no layer of the model is a Mamba-2 layer to capture; leave it out")
    if "full" in what.cuda_graphs and counted.options.get("mtp_layers"):
        raise InputError("--cuda-graphs full beside --mtp-layers: Megatron-core graphs the multi-token-prediction "
                         "module's inner transformer layer alone, and pipesim counts the module as one layer with "
                         "its norms, projection, head and loss; leave one out")
    waiting = next((layer for layer in counted.layers
                    if captured(layer, what.cuda_graphs) and synchronises(layer, counted.options)), None)
    if waiting is not None:
        raise InputError(f"--cuda-graphs full: layer {waiting.name} makes the host wait for the GPU in its forward "
                         "(a dropless dispatcher's copy of the tokens each expert receives, or a synchronous copy to "
                         "the device), which a CUDA graph cannot capture; give --capacity-factor (each expert padded "
                         "to its capacity) or leave full out")
    return counted


@collector_paused()  # torch and transformers imported, the model and its count: all stay alive
def count_model_of(model: str, options: dict[str, Any], microbatch_size: int, dtype: str, attention: str,
                   needer: str, loss_parallel: bool = False, swiglu_fusion: bool = True,
                   cross_entropy: str = "torch", norm_kernel: str = "eager",
                   rope_kernel: str = "eager", router_aux_loss: str = "none",
                   repeat_kv: bool = False) -> WorkloadCount:
    """`model` counted on the meta device, from the host cache where a built-in model's or a Hugging Face config's
    count is kept. `swiglu_fusion`: gated MLPs' SwiGLU as one fused kernel; a calibrated model ran its own torch
    ops, unfused. The cyclic collector is held off meanwhile (`collector_paused`)."""
    from dataclasses import replace

    cache = _count_cache(model, options, microbatch_size, dtype, attention, loss_parallel, swiglu_fusion,
                         cross_entropy, norm_kernel, rope_kernel, router_aux_loss, repeat_kv)
    if cache is not None:
        counted = _read_count(cache)
        if counted is not None:
            return replace(counted, model=model)  # a config is kept by its content, whatever path named it
    require_model(needer.split()[0], model, needer)
    import torch

    from ..workload.count import ATTENTION, count_built
    from ..workload.models import ModelError

    if attention not in ATTENTION:
        raise InputError(choose_from("--attention", ATTENTION, attention))
    try:
        counted = count_built(model, options, microbatch_size, getattr(torch, dtype), attention, loss_parallel,
                              swiglu_fusion, cross_entropy, norm_kernel, rope_kernel, router_aux_loss, repeat_kv)
    except ModelError as exc:
        raise InputError(str(exc)) from None
    if cache is not None:
        _write_count(cache, counted)
    return counted


def _count_cache(model: str, options: dict[str, Any], microbatch_size: int, dtype: str, attention: str,
                 loss_parallel: bool, swiglu_fusion: bool, cross_entropy: str, norm_kernel: str,
                 rope_kernel: str, router_aux_loss: str, repeat_kv: bool) -> Path | None:
    """Where a built-in model's count is kept: a file named by the digest of the model, its options, b, dtype,
    attention and loss, the installed torch's version and the source of the code that builds and counts it (so that a
    change to either counts again); a Hugging Face config's by its content (`HfConfig.digest`) and transformers'
    version too. None for a user's own model, whose code pipesim cannot watch. An unreadable config is refused
    here, before torch is imported."""
    import hashlib
    import json
    from importlib import metadata

    from ..profiles.workload import is_hf
    from ..workload.cachedir import cache_dir
    from ..workload.hfconfig import HfConfigError, read_hf_config

    described: list[str] = [model]
    if is_hf(model):
        try:
            described = [read_hf_config(model).digest]
        except HfConfigError as exc:
            raise InputError(str(exc)) from None
    elif ":" in model:
        return None
    try:
        versions = [metadata.version(name) for name in ("torch", *(("transformers",) if is_hf(model) else ()))]
    except metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256(json.dumps([*described, options, microbatch_size, dtype, attention, loss_parallel,
                                     swiglu_fusion, cross_entropy, norm_kernel, rope_kernel, router_aux_loss,
                                     repeat_kv,
                                     *versions],
                                    sort_keys=True).encode())
    for source in count_sources():
        key.update(source.read_bytes())
    return cache_dir() / "counts" / f"{key.hexdigest()[:32]}.json"


def count_sources() -> list[Path]:
    """The code a count is made by, whose every change counts again: all of workload/ (the models, the count, the
    optimizer step it takes, the sizes and data; a list by hand left out optim.py, whose change moved a GPT's
    estimate while its kept count was read back) and the two modules outside it whose rules the count applies
    (profiles/workload.py, choices.py)."""
    package = Path(__file__).resolve().parent.parent
    return [*sorted((package / "workload").glob("*.py")), package / "profiles" / "workload.py",
            package / "choices.py"]


def _read_count(path: Path) -> WorkloadCount | None:
    """The kept count, or None where there is none or it cannot be read (it is then counted again)."""
    from pydantic import TypeAdapter, ValidationError

    from ..profiles.workload import WorkloadCount

    try:
        return TypeAdapter(WorkloadCount).validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def _write_count(path: Path, counted: WorkloadCount) -> None:
    """Keep the count (`write_atomic`: no temporary file is left where it fails); a cache that cannot be written
    is skipped (the count is still returned)."""
    import contextlib

    from pydantic import TypeAdapter

    from ..profiles.workload import WorkloadCount
    from ..traces import write_atomic

    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, TypeAdapter(WorkloadCount).dump_json(counted))


def estimated_profile(what: WhatIf, counted: WorkloadCount, parallel: Parallelism, optimizer: str,
                      memo: LayerMemo | None = None) -> Profile:
    """The profile of `counted` on the what-if part, parallelised as `parallel` says, with the kernels it was
    counted with (`KERNEL_DEFAULTS`) in its parallelism; a parallelism the model cannot take (t not dividing its
    heads) is one line naming the flag. `memo` (`LayerMemo`, of `counted` on the what-if part and curve) keeps
    its layers for the next."""
    from ..planning.estimate import PastLimitsError, estimate_profile

    refuse(too_many_stages(f"--stages {parallel.pipeline:,}", parallel.pipeline, counted.model, counted.options,
                           counted.layers))
    with refused_with_flags():
        try:
            profile = estimate_profile(counted, what.gpu, parallel, optimizer=optimizer, cluster=what.cluster,
                                       curve=what.curve, memo=memo)
        except PastLimitsError as exc:
            raise InputError(_past_limits_line(counted.microbatch_size, str(exc))) from None
    kernels = {name: getattr(what, name) for name in KERNEL_DEFAULTS}
    estimate = profile.estimate.model_copy(update={"parallelism": {**profile.estimate.parallelism, **kernels}})
    return profile.model_copy(update={"estimate": estimate})


def check_estimate_limits(profile: Profile) -> None:
    """An estimate past the sizes and times the simulator takes, refused naming the micro-batch (and for a time the
    part: `_past_limits_line`): `estimate -b 10**12` wrote a profile that `--profile` refused, and `simulate --gpu`
    said "fwd_ms must be a finite number". Not for each of tune's candidates (3,636 for DeepSeek-V3, 15 ms each), whose
    simulation refuses one all the same; their layers' summed sizes are checked as they are estimated (planning/
    estimate.py `PastLimitsError`)."""
    from ..profiles.schema import past_limits

    if (past := past_limits(profile)) is not None:
        raise InputError(_past_limits_line(profile.environment.microbatch_size, past))


def _past_limits_line(microbatch_size: int, past: str) -> str:
    """An estimate past the simulator's limits (`past`, the figure past them), said of the micro-batch and, for a
    time (its limit in ms), the part."""
    faster = ", or a faster part" if past.endswith(" ms)") else ""
    return (f"the estimate at micro-batch size {microbatch_size:,} (--microbatch-size): {past}; give a smaller "
            f"micro-batch or model{faster}")


def peak_text(measured: Profile | None, what: WhatIf | None, scenario) -> str:
    """For a caption, what the peak column is, so that it is not read as another figure: under --gpu (`what`), max
    reserved where `scenario` replays the caching allocator (its `allocations`), else the tensors alone (max
    allocated: --allocator none, or a mixture of experts, whose step is not replayed); an estimate read from
    --profile holds no allocations to replay, so its peaks are the tensors alone, below --gpu's of the same model
    and flags; "" for a calibration or typed costs. The --gpu captions had said neither, so `--allocator none`'s
    table read as the caching one's."""
    experts = measured is not None and _routes_experts(measured)
    if what is not None:
        if scenario.allocations is not None:
            return ("peak: max reserved, the tensors and the segments torch's caching allocator keeps cached (its "
                    "step replayed" + (", with expandable segments" if scenario.expandable_segments else "") + ")")
        return ("peak: the tensors alone (max allocated: " + ("a mixture of experts' step is not replayed through "
                "the caching allocator)" if experts else "--allocator none)"))
    if measured is None or measured.estimate is None or experts:
        return ""
    return ("peak: the tensors alone (max allocated): a profile holds no allocations to replay through the caching "
            "allocator, as simulate --gpu does (max reserved)")


def _routes_experts(profile: Profile) -> bool:
    """A mixture of experts: simulate --gpu does not replay its step through the caching allocator."""
    return bool(profile.model.options.get("experts")) or any(layer.dispatched_bytes for layer in profile.layers)


# What an MFU above 100 % means: a float8 model's is over bfloat16's peak (`ModelWork.mfu_text`), which its
# products can pass
MFU_PAST_PEAK_TEXT = "an MFU above 100%: float8 products outrun the bfloat16 peak it is over"


@dataclass(frozen=True)
class ModelWork:
    """What MFU and tokens/s need of an estimated model: its FLOPs per sample without recomputation (forward
    and both halves of the backward), the tokens a sample holds (None: not a sequence model), the part's dense
    peak FLOP/s in the model's dtype (`peak_dtype`: bfloat16 under --dtype fp8, `float8`, whose linear products run
    in float8), and the GPUs t x C each of a schedule's devices stands for (its tensor- and context-parallel ranks,
    which run one micro-batch together)."""

    flops_per_sample: float
    tokens_per_sample: int | None
    peak_flops_per_s: float
    peak_dtype: str
    float8: bool
    tensor: int
    context: int

    @property
    def gpus_per_device(self) -> int:
        return self.tensor * self.context

    def per_device_text(self) -> str:
        """The GPUs a schedule's device stands for, as a table's title says them ("" for one)."""
        if self.context > 1:
            return f"t x C = {self.tensor:,} x {self.context:,} GPUs per device"
        return f"{degree_text('t', self.tensor)} GPUs per device" if self.tensor > 1 else ""

    @classmethod
    def of(cls, profile: Profile | None) -> ModelWork | None:
        """The estimate's (None: a measured profile, or an estimate from before these were recorded)."""
        estimate = profile.estimate if profile is not None else None
        if estimate is None or estimate.model_flops_per_sample is None or estimate.peak_flops_per_s is None:
            return None
        return cls(estimate.model_flops_per_sample, profile.model.options.get("seq_len"), estimate.peak_flops_per_s,
                   profile.environment.dtype, estimate.parallelism.get("fp8") is not None,
                   int(estimate.parallelism.get("tensor", 1)), int(estimate.parallelism.get("context", 1)))

    def mfu_text(self, gpus: int | None = None) -> str:
        """What MFU is over, as simulate's and tune's captions say it: the peak in its dtype, bfloat16's under --dtype
        fp8 too, as torchtitan reports it (docs/hardware.md), where simulate's said "the GPUs' dense peak" and the
        docs "in the model's dtype" of a model given as fp8; `gpus`: how many (None: each row's own)."""
        whose = "the GPUs'" if gpus is None else f"the {gpus:,} GPUs'"
        return (f"MFU: model FLOPs (no recomputation; attention's every query-key pair within a layer's window, "
                f"those the causal mask skips too, as torchtitan counts) per second over {whose} dense peak in "
                f"{self.peak_dtype}"
                + " (under fp8 too)" * self.float8)

    def metrics(self, samples_per_s: float, gpus: int) -> dict[str, float | None]:
        """tokens/s and MFU (model FLOPs over the `gpus`' dense peak) at `samples_per_s` over all replicas."""
        return {"tokens_per_s": None if self.tokens_per_sample is None else samples_per_s * self.tokens_per_sample,
                "mfu": samples_per_s * self.flops_per_sample / (gpus * self.peak_flops_per_s)}


@what_if_options
def estimate(
    ctx: typer.Context,
    gpu: GpuName,
    model: ModelName,
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="JSON", parser=output_path, help="Profile JSON to write (replaced atomically).")],
    stages: Stages = 1,
    tensor_parallel: TensorParallel = 1,
    data_parallel: DataParallel = 1,
    sharded_optimizer: ShardedOptimizer = False,
    zero: Zero = None,
    precision: HeldPrecision = None,
    recompute: Recompute = "none",
    microbatch_size: MicrobatchSize = 1,
    optimizer: HeldOptimizer = "adam",
    sources: Annotated[bool, typer.Option(
        "--sources", help="Print the efficiency curve's sources in full: each figure's measurement and its address "
                          "(the profile keeps them in estimate.curve.source).")] = False,
) -> None:
    """Estimate a model's profile on a catalogue GPU, without the GPU. The model counted by torch on the meta
    device, priced on the part's figures, parallelised as given, and partitioned into p stages. simulate, sweep,
    tune and export read it with --profile as they read a calibrated one; it and every trace made from it say
    it is an estimate and from what."""
    from ..profiles.schema import profile_json
    from ..traces import write_atomic

    try:
        check_outputs([("--out", out, PROFILE)], model_reads(ctx.params))
        zero = zero_stage(ctx.params)
        what = what_if(ctx)
        with transient_status(COUNTING_STATUS, quiet=False):
            counted = count_what_if(what, microbatch_size)
            profile = estimated_profile(what, counted, what.parallelism(stages, tensor_parallel, data_parallel,
                                                                        recompute), optimizer)
            check_estimate_limits(profile)
        say_what_if_counted(what)
        with writing("--out"):
            write_atomic(out, profile_json(profile))
    except InputError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(read_error(exc))
    _print_estimate(profile, optimizer, sources)
    if zero >= 2:
        stdout.print(f"ZeRO-{zero}: the profile holds each GPU's whole {'weights and ' if zero == 3 else ''}"
                     f"gradients, the peak above counts them whole; `pipesim simulate --profile {out} --zero {zero}` "
                     "shards them", highlight=False)
    stdout.print(f"wrote {out}", highlight=False)


def parallelism_text(parallelism: dict[str, Any], attention: str | None, shape: bool = True) -> str:
    """An estimate's parallelism in the flags' terms: t (and with `shape` p and d, which a simulation may change),
    and what else is not the default (`SETTING_DEFAULTS`; a setting on by default is named when off); the context
    ring's rotation only where there is a ring, the attention kernel only where the count's `attention` is fused
    (a gpt's default math attention runs none)."""
    context, expert = int(parallelism.get("context", 1)), int(parallelism.get("expert", 1))
    flags = [(key.replace("_", " ") if value else f"no {key.replace('_', ' ')}") if isinstance(value, bool)
             else f"{SETTING_UNITS[key][0]} {value:g} {SETTING_UNITS[key][1]}" if key in SETTING_UNITS
             else f"{key.replace('_', ' ')} {','.join(value) if isinstance(value, (list, tuple)) else value}"
             for key, value in parallelism.items() if key not in ("tensor", "pipeline", "data", "context", "expert")
             and value not in ("none", None, (), []) and value != SETTING_DEFAULTS.get(key, False)
             and (key != "cp_rotate" or context > 1) and (key != "attention_kernel" or attention == "flash")]
    degrees = [("t", parallelism["tensor"])] + [("C", context)] * (context > 1)
    degrees += [("p", parallelism["pipeline"]), ("d", parallelism["data"])] * shape + [("E", expert)] * (expert > 1)
    return ", ".join([" ".join(degree_text(*degree) for degree in degrees), *flags])


def tensor_span_text(estimate: Estimate) -> str:
    """' across k nodes' where an estimate's tensor-parallel group leaves its node (priced on the network), else
    nothing."""
    node = estimate.placement.gpus_per_node if estimate.placement is not None else None
    t = estimate.degrees[0]
    return f" across {t // node} nodes" if node and t > node else ""


def expert_span_text(profile: Profile) -> str:
    """', the expert-parallel group across k nodes (n on each)' where an estimate's expert-parallel group lies on
    more than one node at the estimate's own p and d, at which its all-to-alls are priced (a profile read at another
    p keeps them), so that they cross the network (`ExpertGroup.per_node`); where Megatron-core's rank order would
    keep more of it on a node than pipesim's (which puts a replica's stages on a node and draws E from the
    replicas), that order's count too. simulate's caption says it: the time it costs shows only as idle."""
    from ..schedules.ranks import estimated_experts_per_node

    estimate = profile.estimate
    parallelism = estimate.parallelism
    expert = int(parallelism.get("expert", 1))
    if expert == 1 or estimate.placement is None:
        return ""
    _, p, d = estimate.degrees
    node = estimate.placement.gpus_per_node
    per_node = estimated_experts_per_node(parallelism, p, d, node)
    if per_node >= expert:
        return ""
    # E | d and ETP = t under pipesim's order, so Megatron-core's folds it too
    megatron = (estimated_experts_per_node({**parallelism, "rank_order": "megatron"}, p, d, node)
                if parallelism.get("rank_order", "pipesim") == "pipesim" else per_node)
    return (f", the expert-parallel group across {-(-expert // per_node):,} nodes ({per_node:,} on each"
            + (f"; --rank-order megatron places {'it on one node' if megatron >= expert else f'{megatron:,} on each'}"
               if megatron > per_node else "") + ")")


def experts_moved_text(estimate: Estimate, layouts: Iterable[tuple[int, int]]) -> str:
    """Where the first of `layouts` (p, d) places an estimate's expert-parallel group otherwise than the estimate
    did (planning/scenario.py `experts_moved`): how its all-to-alls are priced and where that layout puts the group,
    for simulate's and sweep's captions (a profile's layers keep the all-to-alls' times it was estimated with); ""
    where every layout places it alike."""
    from ..planning.scenario import experts_moved

    for stages, data in layouts:
        if (moved := experts_moved(estimate, stages, data)) is not None:
            return (f"priced with {moved[0]:,} of the expert-parallel group's ranks a node, where p={stages} d={data} "
                    f"places {moved[1]:,} (estimate at that p and d to price them there)")
    return ""


def _expert_group_text(profile: Profile, expert: int) -> str:
    """Where an expert-parallel group's all-to-alls go (planning/experts.py): its ranks on each node, the shares of
    a rank's token copies that cross the node's link and its NIC."""
    from ..planning.experts import FLEX_DISPATCHERS, expert_group

    estimate = profile.estimate
    t, p, d = estimate.degrees
    group = expert_group(estimate.placement, expert, profile.model.options.get("experts"), t,
                         int(estimate.parallelism.get("context", 1)), p, d,
                         dispatcher=estimate.parallelism.get("token_dispatcher"),
                         order=estimate.parallelism.get("rank_order", "pipesim"),
                         expert_tensor=estimate.parallelism.get("expert_tensor"))
    node, network = group.node_link, group.network_link
    nic = f"its NIC ({network.kind} {network.bytes_per_ms / 1e6:.3g} GB/s)"
    if group.dispatcher in FLEX_DISPATCHERS:
        backend = "DeepEP" if group.dispatcher == "deepep" else "HybridEP"
        # the links the group has: no other rank on a rank's node, or no other node
        sends = [*([f"to each other rank holding any of its experts over {node.kind}"] if group.per_node > 1 else []),
                 *([f"to each other node over {nic}"] if expert > group.per_node else [])]
        return (f"expert-parallel group: {expert} ranks, {group.per_node} on each node; {backend}'s dispatch sends a "
                f"token once {', once '.join(sends)}")
    return (f"expert-parallel group: {expert} ranks, {group.per_node} on each node; an all-to-all sends "
            f"{group.per_node - 1}/{expert} of a rank's token copies over {node.kind} and {expert - group.per_node}/"
            f"{expert} over {nic}")


def _curve_text(read, attention_kernel: str | None, sources: bool) -> str:
    """The efficiency curve the estimate priced with (a `Curve`): its fractions of the datasheet (the attention
    kernel's only where one runs: `attention_kernel` None where the attention is not fused), then where its sources
    are: printed after the table (`sources`, --sources: about 25 lines at 80 columns), or how to ask."""
    attention = read.attention_kernel_efficiency(attention_kernel) if attention_kernel else None
    fractions = ", ".join([f"products {read.matmul_efficiency:.3g}",
                           *([f"attention ({attention_kernel}) {attention:.3g}"] if attention else []),
                           f"memory {read.memory_efficiency:.3g}", f"link {read.link_efficiency:.3g}",
                           f"network {read.network_efficiency:.3g}"])
    return (f"efficiency curve: {fractions} of the datasheet's, {read.kernel_overhead_ms * 1e3:.1f} us a kernel; "
            + ("its sources at the end" if sources else "--sources says where each comes from"))


def one_f_one_b_peaks_bytes(profile: Profile, optimizer: str) -> list[int]:
    """Each stage's peak of the tensors alone (max allocated) under 1F1B, as `simulate --profile` gives it with the
    estimate's d and its optimizer sharded where it was (ZeRO-1; ZeRO-2's and 3's gradients and weights whole, as
    the profile holds them): its weights, gradients and optimizer state, p - k micro-batches' activations, the
    transfer buffers and the running pass's transient tensors, simulated at m = 2p, past which a stage holds no
    more. The profile's own `memory_bytes` (static plus activations, the partitioner's model) leaves the buffers
    and the transient out: it read a Llama 3.1 8B's last stage on an L40S as fitting (48,444 MiB of 49,152) where
    1F1B peaks at 52,484."""
    from ..planning.scenario import profile_scenario
    from ..schedules import ScheduleParams
    from ..sim import simulate
    from ..traces.metrics import summarize

    scenario = profile_scenario(profile, optimizer, sized_by_flags=True)
    stages, parallelism = len(profile.stages), profile.estimate.parallelism
    sched = scenario.build("1f1b", ScheduleParams(stages, 2 * stages, 1, data_parallel=int(parallelism["data"]),
                                                  zero=int(bool(parallelism.get("sharded_optimizer")))))
    summary = summarize(simulate(sched, scenario.costs(sched), scenario.links(sched)))
    return [round(device.peak_memory_mb * MIB) for device in summary.devices]


def _print_estimate(profile: Profile, optimizer: str, sources: bool) -> None:
    """Per stage: its layers, times and memory on one GPU (its peak named as allocated, so that it is not read as
    simulate --gpu's max reserved: `one_f_one_b_peaks_bytes`); then the placement's links."""
    from rich import box
    from rich.table import Table

    from ..hardware.catalogue import Curve
    from ..traces.metrics import mib_text

    env, estimate = profile.environment, profile.estimate
    peaks = one_f_one_b_peaks_bytes(profile, optimizer)
    curve = Curve.model_validate(estimate.curve)
    kernel = estimate.parallelism.get("attention_kernel", "flash2") if estimate.attention == "flash" else None
    table = Table(title=f"{profile.model.name} estimated on {env.device_name} ({env.dtype}, micro-batch "
                        f"{env.microbatch_size}, {parallelism_text(estimate.parallelism, estimate.attention)}), "
                        "per GPU",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                  caption="per micro-batch; I/W: the split backward's input- and weight-gradient passes; alloc: "
                          "the peak of the tensors alone (max allocated) under 1F1B, as simulate --profile "
                          "gives it (the transfer buffers and a pass's transient tensors included); "
                          + ("simulate --gpu's peak is the tensors alone too (a mixture of experts' step is not "
                             "replayed through the caching allocator); " if _routes_experts(profile) else
                             "simulate --gpu's peak adds the segments torch's caching allocator keeps cached beside "
                             "them (max reserved, --allocator caching); ")
                          + _curve_text(curve, kernel, sources))
    for header in ("stage", "layers", "fwd ms", "bwd ms", "I/W ms", "act MiB", "params MiB", "alloc MiB"):
        table.add_column(header, justify="left" if header in ("stage", "layers") else "right", no_wrap=True)
    for k, stage in enumerate(profile.stages):
        first, stop = stage.layers
        table.add_row(str(k), f"{first}-{stop - 1}" if stop - first > 1 else str(first), f"{stage.fwd_ms:,.3f}",
                      f"{stage.bwd_ms:,.3f}", f"{stage.igrad_ms:,.3f}/{stage.wgrad_ms:,.3f}",
                      mib_text(stage.activation_bytes / MIB), mib_text(stage.param_bytes / MIB),
                      mib_text(peaks[k] / MIB))
    print_table(table)
    from ..sim.cluster import Cluster  # each stage on a GPU of its own, checked as simulate checks its devices

    limit = env.memory_cap_bytes or env.device_memory_bytes or None
    checks = Cluster(len(profile.stages)).memory_checks(peaks, [limit] * len(profile.stages))
    if (line := out_of_memory_line("the 1F1B estimate", checks)) is not None:
        print_message(f"warning: {line}", stderr)
    links = [(what, link) for what, link in (("tensor-parallel group" + tensor_span_text(estimate),
                                                estimate.tensor_link if estimate.degrees[0] > 1 else None),
                                               ("between stages", estimate.stage_link),
                                               ("data-parallel group" + (" (its C x d ranks)" if
                                                estimate.context_link else ""), estimate.data_parallel_link),
                                               ("context-parallel ring", estimate.context_link)) if link is not None]
    stdout.print("links: " + "; ".join(f"{what} {link.kind} {link.bytes_per_ms / 1e6:.3g} GB/s, "
                                       f"{link.latency_ms * 1e3:.1f} us a step" for what, link in links),
                 highlight=False)
    expert = int(estimate.parallelism.get("expert", 1))
    if expert > 1 and estimate.placement is not None:
        stdout.print(_expert_group_text(profile, expert), highlight=False)
    if sources:  # one line, wrapped by the terminal: an address folded at the table's width opened nothing
        stdout.print(f"efficiency curve's sources: {curve.source}", highlight=False, soft_wrap=True)
