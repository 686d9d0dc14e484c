"""Devices and the links between them: α–β costs, measured size tables, and shared resources."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..profiles.linkfit import piecewise_ms
from ..units import GIB


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
class Cluster:
    """`links[(src, dst)]` overrides `default_link` for transfers from device src to dst.

    `overlap_comm=False` models runtimes whose sends block the compute stream until they finish.
    """

    num_devices: int
    default_link: Link = Link()
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    device_names: tuple[str, ...] = ()
    memory_bytes: tuple[int | None, ...] = ()
    overlap_comm: bool = True

    def link(self, src: int, dst: int) -> Link:
        return self.links.get((src, dst), self.default_link)

    @classmethod
    def uniform(cls, num_devices: int, comm_ms: float, overlap_comm: bool = True) -> Cluster:
        """Every transfer takes `comm_ms`, whatever its size, and transfers never contend."""
        if not math.isfinite(comm_ms) or comm_ms < 0:
            raise ClusterError(f"comm must be a finite number of milliseconds >= 0 (got {comm_ms})")
        return cls(num_devices, Link(latency_ms=comm_ms), overlap_comm=overlap_comm)

    def describe(self) -> dict[str, Any]:
        return {
            "num_devices": self.num_devices,
            "default_link": _describe_link(self.default_link),
            "links": [{"src": s, "dst": d, **_describe_link(link)} for (s, d), link in sorted(self.links.items())],
            "overlap_comm": self.overlap_comm,
            "devices": [{"name": name, "memory_bytes": memory}
                        for name, memory in zip(self.device_names, self.memory_bytes or (None,) * self.num_devices)],
        }


def _describe_link(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_ms": link.latency_ms, "resource": link.resource}
    if math.isfinite(link.bandwidth_bytes_per_ms):
        out["bandwidth_gb_per_s"] = link.bandwidth_bytes_per_ms * 1e3 / 1e9
    if link.table_bytes:
        out["table"] = [[b, t] for b, t in zip(link.table_bytes, link.table_ms)]
    if link.segments:
        out["segments"] = [list(segment) for segment in link.segments]
    return out


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster JSON file; ClusterError names the first field that is wrong.

    {
      "devices": 4 | [{"name": "gpu0", "memory_gib": 80}, ...],
      "link": {"latency_us": 10, "bandwidth_gb_per_s": 25},              # every pair, unless listed below
      "links": [{"src": 0, "dst": 1, "latency_us": 3, "bandwidth_gb_per_s": 150,
                 "shared": "nic0", "table": [[4096, 0.01], [67108864, 0.5]]}],
      "overlap_comm": true
    }
    Bandwidths are in GB/s (10^9 bytes). Every link is a first-come-first-served resource of its own
    direction unless `shared` names a resource it shares with other links (a NIC, a bus).
    """
    from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

    class _Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class DeviceSpec(_Strict):
        name: str
        memory_gib: float | None = Field(default=None, gt=0)

    class LinkSpec(_Strict):
        latency_us: float = Field(default=0.0, ge=0)
        bandwidth_gb_per_s: float | None = Field(default=None, gt=0)
        table: list[tuple[float, float]] | None = None

        @field_validator("table")
        @classmethod
        def _increasing(cls, table: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
            if table is not None:
                if len(table) < 2:
                    raise ValueError("a size table needs at least two [bytes, ms] points")
                sizes = [size for size, _ in table]
                if any(b <= a for a, b in zip(sizes, sizes[1:])) or any(ms < 0 for _, ms in table):
                    raise ValueError("sizes must increase and times must be >= 0")
            return table

    class PairSpec(LinkSpec):
        src: int = Field(ge=0)
        dst: int = Field(ge=0)
        shared: str | None = None

    class ClusterSpec(_Strict):
        devices: int | list[DeviceSpec]
        link: LinkSpec = LinkSpec()
        links: list[PairSpec] = []
        overlap_comm: bool = True

        @model_validator(mode="after")
        def _in_range(self) -> ClusterSpec:
            n = self.devices if isinstance(self.devices, int) else len(self.devices)
            if n < 1:
                raise ValueError("devices: at least one device")
            for pair in self.links:
                if pair.src >= n or pair.dst >= n or pair.src == pair.dst:
                    raise ValueError(f"links: {pair.src}->{pair.dst} must join two distinct devices in 0..{n - 1}")
            return self

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ClusterError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ClusterError(f"cluster file {path} is not valid JSON: {exc}") from None
    try:
        spec = ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        raise ClusterError(f"cluster file {path}: {where}: {err['msg']}") from None

    def to_link(s: LinkSpec, resource: str | None) -> Link:
        bandwidth = s.bandwidth_gb_per_s * 1e9 / 1e3 if s.bandwidth_gb_per_s else math.inf
        table = s.table or []
        return Link(s.latency_us / 1e3, bandwidth, resource, tuple(b for b, _ in table), tuple(t for _, t in table))

    n = spec.devices if isinstance(spec.devices, int) else len(spec.devices)
    names = tuple(f"device {d}" for d in range(n)) if isinstance(spec.devices, int) else tuple(
        d.name for d in spec.devices)
    memory = (None,) * n if isinstance(spec.devices, int) else tuple(
        int(d.memory_gib * GIB) if d.memory_gib else None for d in spec.devices)
    links = {(p.src, p.dst): to_link(p, p.shared or f"link {p.src}->{p.dst}") for p in spec.links}
    for src in range(n):
        for dst in range(n):
            if src != dst and (src, dst) not in links:
                links[(src, dst)] = to_link(spec.link, f"link {src}->{dst}")
    return Cluster(n, to_link(spec.link, None), links, names, memory, spec.overlap_comm)
