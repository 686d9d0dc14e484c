"""The GPU and cluster catalogue: figures from vendors' datasheets, as data (gpus.toml beside this file), read
into a validated schema. Users add or replace parts, and describe whole clusters, in a TOML file of the same
schema. Pure data: no torch, no simulator."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..choices import nearest_text
from ..files import first_error, read_toml
from ..units import GIB, checked_memory_gib

BUILT_IN = Path(__file__).with_name("gpus.toml")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# The fused attention kernels a curve can price (`Curve.attention_kernel_efficiency`): FlashAttention-2 (flash-attn
# 2.x, TransformerEngine with NVTE_FUSED_ATTN=0), cuDNN's fused attention (TransformerEngine's FusedAttention, which
# it prefers on Hopper when NVTE_FUSED_ATTN=1) and FlashAttention-3 (flash-attn's hopper/ kernels).
ATTENTION_KERNELS = ("flash2", "cudnn", "flash3")
NAME = r"^[a-z0-9][a-z0-9.-]*$"  # how parts and clusters are named on the command line (--gpu a100-sxm-80gb)
# A part's rates and sizes within fixed limits far past any part's (the built-in parts run 19.5 to 4,500 TFLOP/s, 864
# to 8,000 GB/s), so that every time the estimate makes of them is finite: a --gpus file's 1e-300 TFLOP/s or GB/s, a
# kernel overhead of 1e300 ms or tiles of 0 rows ended in a traceback, and 1e18 multiprocessors were blamed on the
# micro-batch
TFLOP_S = Annotated[float, Field(ge=1e-3, le=1e6)]
GB_S = Annotated[float, Field(ge=1e-3, le=1e6)]
TILE_SIDE = Annotated[int, Field(ge=1, le=4096)]


class CatalogueError(ValueError):
    """A catalogue file that cannot be used; the message is one line naming the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class DenseTflops(_Strict):
    """Dense (no 2:4 sparsity) peak TFLOP/s per dtype; a dtype the part has no tensor-core path for is absent."""

    fp32: TFLOP_S
    tf32: TFLOP_S | None = None
    bf16: TFLOP_S
    fp16: TFLOP_S
    fp8: TFLOP_S | None = None


class IntraNode(_Strict):
    """The link from one GPU to the others of its node. `gb_s_per_direction` is the GPU's total (through a
    switch, all of it reaches any peer); a mesh (`peer_gb_s_per_direction`) reaches each peer at that rate."""

    link: Literal["nvlink", "xgmi", "pcie"]
    gb_s_per_direction: GB_S
    peer_gb_s_per_direction: GB_S | None = None
    gpus_per_node: int = Field(ge=1)
    source: str = Field(min_length=1)
    note: str = ""


class Network(_Strict):
    """The inter-node network per GPU (its own NIC, or its share of the node's), in Gb/s (10^9 bits)."""

    kind: Literal["infiniband", "roce", "ethernet"]
    gbit_s: Annotated[float, Field(ge=8e-3, le=8e6)]  # GB_S's, in bits
    source: str = Field(min_length=1)
    note: str = ""


class AttentionPasses(_Strict):
    """A fused attention kernel's fractions of the peak by pass and mask, where its benchmarks publish them apart:
    a causal kernel skips the blocks past the diagonal and runs its diagonal blocks masked, so it runs below the
    unmasked one, its backward the most (cuDNN at 4k tokens, head dim 128: causal 0.86 of unmasked backward,
    NVIDIA/cudnn-frontend benchmark/benchmark_results.csv). Each is the kernel's FLOPs as its benchmark counts
    them (a causal kernel half the square: `kernel_flops`) over its time, at `measured_tiles` query tiles (batch x
    heads x 128-query blocks: 4k tokens at batch 4 x 16 heads, 2,048). `causal_tail`: what a causal kernel's
    tail costs, in waves of the part's multiprocessors (`Curve.attention_fraction`); 0: none priced."""

    forward: float = Field(gt=0, le=1)
    causal_forward: float = Field(gt=0, le=1)
    backward: float = Field(gt=0, le=1)
    causal_backward: float = Field(gt=0, le=1)
    causal_tail: float = Field(0.0, ge=0, le=1000)
    measured_tiles: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _tail_measured(self) -> AttentionPasses:
        if self.causal_tail and self.measured_tiles is None:
            raise ValueError("causal_tail: give measured_tiles, the query tiles the fractions were measured at")
        return self


class DispatcherRates(_Strict):
    """A token dispatcher's published algorithm bandwidth by the expert-parallel group's rank count, across nodes:
    the bytes of every token over the nodes it reaches, its own included where its experts lie there, over the time of
    one dispatch or one combine (planning/experts.py `ExpertGroup.all_to_all_ms`), at the `source`'s
    `gpus_per_node` ranks a node. Between two measured counts the rate is linear in log2 of the ranks; outside them,
    the nearest's."""

    ranks: list[int] = Field(min_length=1)
    dispatch_gb_s: list[GB_S]
    combine_gb_s: list[GB_S]
    gpus_per_node: int = Field(ge=1)
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _one_rate_a_count(self) -> DispatcherRates:
        if len(self.dispatch_gb_s) != len(self.ranks) or len(self.combine_gb_s) != len(self.ranks):
            raise ValueError("dispatch_gb_s, combine_gb_s: one rate for each of ranks")
        if any(low >= high for low, high in zip(self.ranks, self.ranks[1:])) or self.ranks[0] < 2:
            raise ValueError("ranks: rising rank counts, 2 or more")
        return self

    def gb_s(self, ranks: int) -> tuple[float, float]:
        """The (dispatch, combine) algorithm bandwidth at `ranks` ranks (the class docstring)."""
        rates = (self.dispatch_gb_s, self.combine_gb_s)
        if ranks <= self.ranks[0] or ranks >= self.ranks[-1]:
            end = 0 if ranks <= self.ranks[0] else -1
            return rates[0][end], rates[1][end]
        high = next(i for i, count in enumerate(self.ranks) if count >= ranks)
        share = math.log2(ranks / self.ranks[high - 1]) / math.log2(self.ranks[high] / self.ranks[high - 1])
        return tuple(rate[high - 1] + (rate[high] - rate[high - 1]) * share for rate in rates)


class Curve(_Strict):
    """How far below its datasheet a part runs, from published measurements (`source`), for the time model of
    planning/estimate.py: the large matrix products' fraction of peak (`matmul_efficiency`: at shapes that fill
    every multiprocessor with whole tiles), a fused attention kernel's (`attention_efficiency`: FlashAttention-2's;
    `attention_kernels`: another of `ATTENTION_KERNELS`' where its rate on the part is published;
    `attention_passes` and `attention_kernel_passes`: theirs by pass and mask where published so, which then price
    the kernel in place of the one figure), the memory
    bandwidth's (`memory_efficiency`), the intra-node link's (`link_efficiency`: a GPU-to-GPU copy over the
    datasheet's bandwidth per direction), the network's (`network_efficiency`: what NCCL moves through one NIC over
    its line rate, the part's reference NIC's as NCCL's maintainers give it; 1: the line rate), what each kernel costs
    beyond its work (`kernel_overhead_ms`: launch, ramp and tail), and the shape of the machine the products'
    tiles are spread over: `multiprocessors` and the output tiles (m × n) its matrix-product kernels pick from;
    `persistent_products`: its products run persistent CTAs, one per multiprocessor, each with a fixed share of the
    tiles (Hopper's cuBLAS and CUTLASS), so that a collective kernel holding some multiprocessors delays the whole
    product (planning/estimate.py `bulk_exposed_ms`); `fp8_split_accumulation_efficiency`: a float8 product's
    fraction of the float8 peak where it adds its partial sums into float32 every few steps (cuBLASLt's FAST_ACCUM
    off, torch._scaled_mm's default; the backward's products under TransformerEngine and torchao: planning/fp8.py),
    where published; None: at `matmul_efficiency`, as a product with fast accumulation is priced; `hybridep`:
    HybridEP's algorithm bandwidth across nodes where published for the part (None: its dispatch priced on the
    links, as NCCL's)."""

    matmul_efficiency: float = Field(gt=0, le=1)
    attention_efficiency: float = Field(gt=0, le=1)
    attention_kernels: dict[Literal["cudnn", "flash3"], Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict)
    attention_passes: AttentionPasses | None = None
    attention_kernel_passes: dict[Literal["cudnn", "flash3"], AttentionPasses] = Field(default_factory=dict)
    memory_efficiency: float = Field(gt=0, le=1)
    link_efficiency: float = Field(1.0, gt=0, le=1)
    network_efficiency: float = Field(1.0, gt=0, le=1)
    kernel_overhead_ms: float = Field(ge=0, le=1000)
    multiprocessors: int = Field(ge=1, le=100_000)
    tiles: list[Annotated[tuple[TILE_SIDE, TILE_SIDE], Strict(False)]] = Field(min_length=1)  # TOML: a pair a list
    persistent_products: StrictBool = False  # not "yes", which pydantic would read as true
    fp8_split_accumulation_efficiency: float | None = Field(default=None, gt=0, le=1)
    hybridep: DispatcherRates | None = None
    source: str = Field(min_length=1)

    def attention_kernel_efficiency(self, kernel: str) -> float | None:
        """`kernel`'s fraction of the peak on this part (of `ATTENTION_KERNELS`): FlashAttention-2's is
        `attention_efficiency`; None where no figure is published for it here."""
        return self.attention_efficiency if kernel == "flash2" else self.attention_kernels.get(kernel)

    def attention_passes_of(self, kernel: str) -> AttentionPasses | None:
        """`kernel`'s fractions by pass and mask on this part: FlashAttention-2's are `attention_passes`; None
        where only its one figure is published."""
        return self.attention_passes if kernel == "flash2" else self.attention_kernel_passes.get(kernel)

    def attention_fraction(self, backward: bool, causal: bool, tiles: int | None = None) -> float:
        """The fused attention kernel's fraction of the peak for a pass (`backward` or the forward) under its mask
        (`causal` or none): from `attention_passes` where published so, else `attention_efficiency`. A causal
        kernel of `tiles` query tiles (None: as measured) pays its tail: a CTA a tile, its work from one key block
        to all of them, so the kernel ends on its longest, whatever the tiles; its time is its work at the full rate
        plus `causal_tail` waves' worth of tiles, and the fraction falls as 1 / (1 + tail / tiles) from the
        measured one (cuDNN's causal forward at 4,096 tokens and head dim 128 on an H200, batch 1, Llama 3.1's
        grouped-query heads: 599, 545, 474 and 378 TFLOP/s at 64, 32, 16 and 8 heads, 2,048 to 256 tiles, each
        within 1 % of a tail of 185 tiles, 1.40 x 132 multiprocessors: NVIDIA/cudnn-frontend
        benchmark/attention_inference/results/prefill_sweep/h200/prefill_sweep_20260928_142443.csv, cuDNN 9.27)."""
        passes = self.attention_passes
        if passes is None:
            return self.attention_efficiency
        if backward:
            fraction = passes.causal_backward if causal else passes.backward
        else:
            fraction = passes.causal_forward if causal else passes.forward
        if not (causal and tiles and passes.causal_tail and passes.measured_tiles):
            return fraction
        tail = passes.causal_tail * self.multiprocessors
        return fraction * (1 + tail / passes.measured_tiles) / (1 + tail / tiles)

    def product_efficiency(self, split_accumulation: bool) -> float:
        """A matrix product's fraction of its dtype's peak at whole tiles: a float8 one accumulating split at
        `fp8_split_accumulation_efficiency` where the part has one, any other at `matmul_efficiency`."""
        if split_accumulation and self.fp8_split_accumulation_efficiency is not None:
            return self.fp8_split_accumulation_efficiency
        return self.matmul_efficiency


class DeviceMemory(_Strict):
    """The memory the driver gives a process on the part, as torch reads it (`torch.cuda.get_device_properties
    (i).total_memory`, which its out-of-memory message prints as the GPU's "total capacity"): less than the
    datasheet's, what ECC and the driver keep. What calibrate records of a measured device
    (`Environment.device_memory_bytes`), so an estimate holds its peak to the same figure."""

    gib: Annotated[float, AfterValidator(checked_memory_gib)]
    source: str = Field(min_length=1)


class Gpu(_Strict):
    """One part: compute and memory from `source`; link and network each name their own; `curve` (None: no
    published measurement known) how far below those figures it runs; `device_memory` (None: not known) the
    memory torch is given of the datasheet's `memory_gib`."""

    name: str = Field(min_length=1)
    memory_gib: Annotated[float, AfterValidator(checked_memory_gib)]
    memory_bandwidth_gb_s: GB_S
    source: str = Field(min_length=1)
    dense_tflops: DenseTflops
    intra_node: IntraNode
    network: Network
    curve: Curve | None = None
    device_memory: DeviceMemory | None = None

    @property
    def device_memory_bytes(self) -> int:
        """What a process may hold on the part, in bytes: `device_memory` where known, else the datasheet's."""
        return int((self.device_memory.gib if self.device_memory is not None else self.memory_gib) * GIB)

    @field_validator("device_memory")
    @classmethod
    def _device_memory_within(cls, device_memory: DeviceMemory | None, info: ValidationInfo) -> DeviceMemory | None:
        datasheet_gib = info.data.get("memory_gib")  # absent where it was itself refused
        if device_memory is not None and datasheet_gib is not None and device_memory.gib > datasheet_gib:
            raise ValueError(f"gib {device_memory.gib:g} is more than memory_gib {datasheet_gib:g}: give what torch "
                             "reports (total_memory), at most the datasheet's")
        return device_memory


class Cluster(_Strict):
    """A cluster: `nodes` of the catalogue part `gpu`; `gpus_per_node`, `network` and `intra_node` replace the
    part's defaults where given."""

    gpu: str
    nodes: int = Field(ge=1)
    gpus_per_node: int | None = Field(default=None, ge=1)
    network: Network | None = None
    intra_node: IntraNode | None = None
    source: str = ""


class Catalogue(_Strict):
    gpu: dict[str, Gpu] = Field(default_factory=dict)
    cluster: dict[str, Cluster] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _named_and_known(self) -> Catalogue:
        for table, names in (("gpu", self.gpu), ("cluster", self.cluster)):
            bad = [name for name in names if not re.match(NAME, name)]
            if bad:
                raise ValueError(f"{table}.{bad[0]}: name with lower-case letters, digits, '.' and '-' only")
        for name, cluster in self.cluster.items():
            if cluster.gpu not in self.gpu:
                raise ValueError(f"cluster.{name}.gpu: unknown {cluster.gpu!r}{nearest_text(cluster.gpu, self.gpu)}; "
                                 f"known: {', '.join(self.gpu)}")
        return self

    def find(self, name: str) -> Gpu:
        """The part `name`, or a CatalogueError listing the known ones."""
        if name not in self.gpu:
            raise CatalogueError(f"unknown GPU {name!r}{nearest_text(name, self.gpu)}; known: {', '.join(self.gpu)}")
        return self.gpu[name]


def _validated(path: Path, doc: dict) -> Catalogue:
    try:
        return Catalogue.model_validate(doc)
    except ValidationError as exc:
        raise CatalogueError(f"{path}: {first_error(exc, Catalogue)}") from None


def load_catalogue(extra: Path | None = None) -> Catalogue:
    """The built-in catalogue, with `extra`'s parts added (or replacing those of the same name) and its clusters."""
    built_in = read_toml(BUILT_IN, CatalogueError)
    if extra is None:
        return _validated(BUILT_IN, built_in)
    own = read_toml(extra, CatalogueError)
    if not isinstance(own.get("gpu", {}), dict):
        raise CatalogueError(f"{extra}: gpu: a table of parts ([gpu.NAME])")
    # an empty file listed the built-in parts alone, exit 0; a misspelt table ([gpus.x]) is named by the validation
    if not own.get("gpu") and not own.get("cluster") and own.keys() <= {"gpu", "cluster"}:
        raise CatalogueError(f"{extra}: gives no part ([gpu.NAME]) and no cluster ([cluster.NAME])")
    return _validated(extra, {**own, "gpu": {**built_in["gpu"], **own.get("gpu", {})}})
