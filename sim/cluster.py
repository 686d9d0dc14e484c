"""Devices and the links between them: α–β costs, measured size tables, and shared resources."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..files import CLUSTER, read_document, validated
from ..profiles.linkfit import piecewise_ms
from ..schedules.methods import MAX_ROWS
from ..traces.metrics import mib_text
from ..units import GIB, MAX_MS, MIB, checked_memory_gib, float_text, number_allowed


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Link:
    """Time to move n bytes: `latency_ms + n / bandwidth`, a measured (bytes, ms) table interpolated
    linearly, or piecewise α–β `segments` (min_bytes, latency_ms, bytes_per_ms) as calibration fits them
    (NCCL and gloo change protocol with size). Transfers whose links name the same `resource` queue
    behind one another (first come, first served); a link with no resource never contends."""

    latency_ms: float = 0.0
    bandwidth_bytes_per_ms: float = math.inf
    resource: str | None = None
    table_bytes: tuple[float, ...] = ()
    table_ms: tuple[float, ...] = ()
    segments: tuple[tuple[int, float, float], ...] = ()

    def transfer_ms(self, nbytes: int) -> float:
        if self.segments:
            return piecewise_ms(self.segments, nbytes)
        if self.table_bytes:
            x, y = self.table_bytes, self.table_ms
            if nbytes >= x[-1] and len(x) > 1:  # extrapolate with the last segment's bandwidth
                slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
                return y[-1] + (nbytes - x[-1]) * slope
            return float(np.interp(nbytes, x, y))
        return self.latency_ms + nbytes / self.bandwidth_bytes_per_ms


@dataclass(frozen=True)
class MemoryCheck:
    """One device's simulated peak against the memory it draws on. Ranks on one GPU (devices that share a
    compute resource) draw on its one memory, and each is a process whose caching allocator keeps what it
    reserved at its peak: so their peaks add up, whenever each was reached."""

    device: int
    limit_bytes: int | None  # None: not known
    used_bytes: float  # its peak, or the sum of the peaks of the devices it shares its memory with
    sharers: tuple[int, ...]  # the devices drawing on this memory, itself included
    memory: str | None  # the shared compute resource whose memory it is; None: the device's own
    peak_bytes: float  # its own peak

    @property
    def room_bytes(self) -> float | None:
        """The most this device alone may hold (None: not known): its memory less the peaks of the devices
        sharing it, so its own peak tops this exactly where the check is out of memory (a line drawn at it over
        the device's own curve says what the check says)."""
        return None if self.limit_bytes is None else self.limit_bytes - (self.used_bytes - self.peak_bytes)

    @property
    def out_of_memory(self) -> bool:
        return self.limit_bytes is not None and self.used_bytes > self.limit_bytes

    def record(self) -> dict:
        """As a trace records it (traces/trace.py's RecordedMemoryCheck), for a page drawn from the saved trace."""
        return {**asdict(self), "sharers": list(self.sharers)}

    @classmethod
    def of_record(cls, record: dict) -> MemoryCheck:
        """The check a trace recorded (`record`'s inverse: JSON holds the sharers as a list), for `pipesim view`."""
        return cls(**{**record, "sharers": tuple(record["sharers"])})

    def reason(self) -> str:
        """In words, how the peak compares with the memory (for the out-of-memory warning), MiB as the tables and
        pages write them (`mib_text`: a 4 KiB peak read "0 MiB")."""
        used = f"{mib_text(self.used_bytes / MIB)} MiB"
        verdict = "its memory not known" if self.limit_bytes is None else \
            f"{'more than' if self.out_of_memory else 'within'} its {mib_text(self.limit_bytes / MIB)} MiB"
        if self.memory is None:
            return f"device {self.device} peaks at {used}, {verdict}"
        sharers = ", ".join(map(str, self.sharers[:-1])) + f" and {self.sharers[-1]}"
        return f"devices {sharers} share compute {self.memory} and its memory: their peaks add up to {used}, {verdict}"


# Cluster's slowdown fields -> the devices computing at once that their first, second, ... factor is for
_SLOWDOWNS_COUNT = {"contention": "1, 2", "collective_contention": "0, 1"}


def _slowdowns_problem(name: str, factors: Sequence[float]) -> str | None:
    """Why `factors` are not the slowdowns Cluster's field `name` holds (None: they are), for its checks and the
    cluster file's alike."""
    if factors and (factors[0] != 1.0 or any(not math.isfinite(f) or f <= 0 for f in factors)):
        return (f"give slowdowns with {_SLOWDOWNS_COUNT[name]}, ... devices computing at once, the first 1 and each "
                f"a finite number above 0 (got {json.dumps(list(factors))})")
    return None


@dataclass(frozen=True)
class Cluster:
    """`links[(src, dst)]` overrides `default_link` for transfers from device src to dst.

    `overlap_comm=False` models runtimes whose exchanges block: a device posts the sends and receives between two
    passes together and waits for all of them; a send moves once its receiver has posted.
    `compute[d]` names the compute resource device d runs on (None: one of its own): devices naming the
    same one are ranks on one GPU, which run their compute rows one at a time and share its one memory.
    `hosts[d]` names the host whose cores device d computes on (CPU ranks; None: cores of its own): while k
    devices of one host compute at once, each computes `contention[k - 1]` times slower than alone (shared
    cores, caches and memory bandwidth; beyond the measured k, the last factor holds). `collective_contention[k]`:
    how many times slower than alone a collective of such a device runs while k of its host's devices compute
    (gloo's threads on the same cores; the first 1, beyond the measured k the last; empty: not measured).
    """

    num_devices: int
    default_link: Link = Link()
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    device_names: tuple[str, ...] = ()
    memory_bytes: tuple[int | None, ...] = ()
    overlap_comm: bool = True
    compute: tuple[str | None, ...] = ()
    hosts: tuple[str | None, ...] = ()
    contention: tuple[float, ...] = ()
    collective_contention: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in _SLOWDOWNS_COUNT:
            problem = _slowdowns_problem(name, getattr(self, name))
            if problem:
                raise ClusterError(f"{name}: {problem}")

    def link(self, src: int, dst: int) -> Link:
        return self.links.get((src, dst), self.default_link)

    def compute_peers(self, num_devices: int) -> list[tuple[int, ...]]:
        """Per device of the first `num_devices`: the devices among them on its compute resource, itself
        included (just itself when it has one of its own)."""
        return _peers(self.compute, num_devices)

    def shares_compute(self, num_devices: int) -> bool:
        """Whether any two of the first `num_devices` devices are ranks on one GPU: then the executor runs every
        rank's rows under one lock (the host-staged transport), each issued to an idle GPU."""
        return any(len(peers) > 1 for peers in self.compute_peers(num_devices))

    def host_peers(self, num_devices: int) -> list[tuple[int, ...]]:
        """Per device of the first `num_devices`: the devices among them whose compute contends with its own on
        one host, itself included (just itself where no slowdown was measured or it has a host of its own)."""
        if not any(f != 1.0 for f in self.contention):
            return [(d,) for d in range(num_devices)]
        return _peers(self.hosts, num_devices)

    @classmethod
    def uniform(cls, num_devices: int, comm_ms: float, overlap_comm: bool = True) -> Cluster:
        """Every transfer takes `comm_ms`, whatever its size, and transfers never contend."""
        if not math.isfinite(comm_ms) or comm_ms < 0:
            raise ClusterError(f"comm must be a finite number of milliseconds >= 0 (got {comm_ms})")
        return cls(num_devices, Link(latency_ms=comm_ms), overlap_comm=overlap_comm)

    def memory_checks(self, peak_bytes: Sequence[float], limit_bytes: Sequence[int | None]) -> list[MemoryCheck]:
        """Per device, its simulated peak against its memory (`limit_bytes`, one per device, as the command
        knows them: this cluster's or a profile's); devices sharing a compute resource are checked together,
        with the sum of their peaks."""
        checks = []
        for d, peers in enumerate(self.compute_peers(len(peak_bytes))):
            shared = len(peers) > 1
            used = sum(peak_bytes[e] for e in peers) if shared else peak_bytes[d]
            checks.append(MemoryCheck(d, limit_bytes[d], used, peers, self.compute[d] if shared else None,
                                      peak_bytes[d]))
        return checks

    def describe(self) -> dict[str, Any]:
        devices = [{"name": name, "memory_bytes": memory}
                   for name, memory in zip(self.device_names, self.memory_bytes or (None,) * self.num_devices)]
        for device, compute in zip(devices, self.compute):  # only clusters that name compute resources say so
            device["compute"] = compute
        for device, host in zip(devices, self.hosts):
            device["host"] = host
        contention = {"contention": list(self.contention)} if self.contention else {}
        if self.collective_contention:
            contention["collective_contention"] = list(self.collective_contention)
        return {
            "num_devices": self.num_devices,
            "default_link": _describe_link(self.default_link),
            "links": [{"src": s, "dst": d, **_describe_link(link)} for (s, d), link in sorted(self.links.items())],
            "overlap_comm": self.overlap_comm,
            "devices": devices,
            **contention,
        }


def _peers(names: tuple[str | None, ...], num_devices: int) -> list[tuple[int, ...]]:
    """Per device of the first `num_devices`: those among them with the same name, itself included (just
    itself when its name is None or not given)."""
    named = names[:num_devices]
    return [tuple(e for e, other in enumerate(named) if other == mine) if mine is not None else (d,)
            for d, mine in enumerate(named)] + [(d,) for d in range(len(named), num_devices)]


def _describe_link(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_ms": link.latency_ms, "resource": link.resource}
    if math.isfinite(link.bandwidth_bytes_per_ms):
        out["bandwidth_gb_per_s"] = link.bandwidth_bytes_per_ms * 1e3 / 1e9
    if link.table_bytes:
        out["table"] = [[b, t] for b, t in zip(link.table_bytes, link.table_ms)]
    if link.segments:
        out["segments"] = [list(segment) for segment in link.segments]
    return out


class _Strict(BaseModel):
    """A cluster file's part (`load_cluster`): no key outside its fields, and each of its values of its field's
    type, not converted to it (true read as 1 GiB or device 1, "80" as 80). Each validator is built at the first
    cluster file read (defer_build), not when the simulator is imported."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True, strict=True)


class DeviceSpec(_Strict):
    name: str
    memory_gib: Annotated[float, AfterValidator(checked_memory_gib)] | None = None  # held as int(gib * GIB)
    compute: str | None = Field(default=None, min_length=1)
    host: str | None = Field(default=None, min_length=1)


class LinkSpec(_Strict):
    latency_us: float = Field(default=0.0, ge=0, le=MAX_MS * 1e3)  # past it, no clock holds one transfer
    bandwidth_gb_per_s: float | None = Field(default=None, gt=0)
    table: list[Annotated[tuple[float, float], Strict(False)]] | None = None  # JSON writes a pair as a list

    @field_validator("table")
    @classmethod
    def _increasing(cls, table: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        if table is not None:
            if len(table) < 2:
                raise ValueError(f"give at least two [bytes, ms] points (got {len(table)})")
            for before, (size, ms) in zip([None, *table], table):
                if before is not None and size <= before[0]:
                    raise ValueError(f"give [bytes, ms] points, their bytes increasing (got {float_text(size)} bytes "
                                     f"after {float_text(before[0])})")
                if not 0 <= ms <= MAX_MS:
                    each = number_allowed(0, MAX_MS, whole=False, finite=True).removeprefix("give ")
                    raise ValueError(f"give [bytes, ms] points, each ms {each} (got {float_text(ms)} at "
                                     f"{float_text(size)} bytes)")
        return table


class PairSpec(LinkSpec):
    src: int = Field(ge=0)
    dst: int = Field(ge=0)
    shared: str | None = None


class ClusterSpec(_Strict):
    devices: list[DeviceSpec]
    link: LinkSpec = Field(default_factory=LinkSpec)  # an instance here builds its validator at import
    links: list[PairSpec] = []
    overlap_comm: StrictBool = True  # not "yes", which pydantic would read as true
    contention: list[float] = []
    collective_contention: list[float] = []

    @field_validator("contention", "collective_contention")
    @classmethod
    def _slowdowns(cls, factors: list[float], info: ValidationInfo) -> list[float]:
        problem = _slowdowns_problem(info.field_name, factors)
        if problem:
            raise ValueError(problem)
        return factors

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, raw: Any) -> Any:
        """`"devices": n` is n devices with nothing said about them (one validation path for both forms,
        so an error inside the list names its own field)."""
        if not isinstance(raw, dict) or "devices" not in raw or isinstance(raw["devices"], list):
            return raw
        count = raw["devices"]
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_ROWS // 2:
            # 10**12 ran out of memory listing them: no schedule runs on more (each device runs 2 rows at least)
            got = f"{count:,}" if isinstance(count, int) and not isinstance(count, bool) else json.dumps(count)
            raise ValueError(f"devices: {number_allowed(1, MAX_ROWS // 2)} (the most any schedule pipesim simulates "
                             f"runs on), or a list of devices (got {got})")
        return {**raw, "devices": [{"name": f"device {d}"} for d in range(count)]}

    @model_validator(mode="after")
    def _in_range(self) -> ClusterSpec:
        n = len(self.devices)
        if n < 1:
            raise ValueError("devices: give at least one device (got [])")
        for pair in self.links:
            if pair.src >= n or pair.dst >= n or pair.src == pair.dst:
                raise ValueError(f"links: give src and dst two distinct devices 0..{n - 1} "
                                 f"(got {pair.src}->{pair.dst})")
        sharing: dict[str, DeviceSpec] = {}
        for device in self.devices:
            if device.compute is None or device.memory_gib is None:
                continue
            first = sharing.setdefault(device.compute, device)
            if first.memory_gib != device.memory_gib:
                raise ValueError(f"devices: {first.name} and {device.name} share compute {device.compute!r}, "
                                 f"so they share its memory, but give memory_gib {first.memory_gib:g} and "
                                 f"{device.memory_gib:g}; give the same, or give it on one of them")
        return self


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster JSON file; ClusterError names the first field that is wrong.

    {
      "devices": 4 | [{"name": "gpu0", "memory_gib": 80, "compute": "gpu0", "host": "node0"}, ...],
      "link": {"latency_us": 10, "bandwidth_gb_per_s": 25},              # every pair, unless listed below
      "links": [{"src": 0, "dst": 1, "latency_us": 3, "bandwidth_gb_per_s": 150,
                 "shared": "nic0", "table": [[4096, 0.01], [67108864, 0.5]]}],
      "overlap_comm": true,
      "contention": [1.0, 1.6, 2.4],
      "collective_contention": [1.0, 1.9, 3.5]
    }
    Bandwidths are in GB/s (10^9 bytes). Every link is a first-come-first-served resource of its own
    direction unless `shared` names a resource it shares with other links (a NIC, a bus). Devices naming
    the same `compute` are ranks on one GPU: they take turns for compute and share its memory, so the
    `memory_gib` they give (one of them may give it for all) must agree. Devices naming the same `host` are
    CPU ranks on its cores: while k of them compute at once each is `contention[k - 1]` times slower than
    alone (`pipesim calibrate` measures it; the first factor is 1), and their collectives run on those cores too,
    `collective_contention[k]` times slower than alone while k of them compute (a calibration's
    `allreduce.beside_compute`; the first factor, none computing, is 1).
    """
    raw = read_document(path, CLUSTER, ClusterError)  # another kind is named, not by the devices it lacks
    spec = validated(ClusterSpec, raw, path, CLUSTER, ClusterError)

    def to_link(s: LinkSpec, resource: str | None) -> Link:
        bandwidth = s.bandwidth_gb_per_s * 1e9 / 1e3 if s.bandwidth_gb_per_s else math.inf
        table = s.table or []
        return Link(s.latency_us / 1e3, bandwidth, resource, tuple(b for b, _ in table), tuple(t for _, t in table))

    n = len(spec.devices)
    names = tuple(d.name for d in spec.devices)
    gib_of = {d.compute: d.memory_gib for d in spec.devices if d.compute and d.memory_gib}  # one GPU's memory
    memory = tuple(int(gib * GIB) if (gib := d.memory_gib or gib_of.get(d.compute)) else None for d in spec.devices)
    compute = tuple(d.compute for d in spec.devices) if any(d.compute for d in spec.devices) else ()
    hosts = tuple(d.host for d in spec.devices) if any(d.host for d in spec.devices) else ()
    links = {(p.src, p.dst): to_link(p, p.shared or f"link {p.src}->{p.dst}") for p in spec.links}
    for src in range(n):
        for dst in range(n):
            if src != dst and (src, dst) not in links:
                links[(src, dst)] = to_link(spec.link, f"link {src}->{dst}")
    return Cluster(n, to_link(spec.link, None), links, names, memory, spec.overlap_comm, compute, hosts,
                   tuple(spec.contention), tuple(spec.collective_contention))
