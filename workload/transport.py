"""Point-to-point transports: how pipeline ranks pass activations and gradients, behind one interface.

The executor runs one process per device. Each rank walks its action list, posts every receive as soon as the
schedule says it will come (in schedule order) and waits on it when the data is needed, and issues sends
without waiting on them (over gloo, a thread per link waits on them, so each frees its tensor once sent).
Sends and receives on each channel match first in, first out, so no tags are needed: the k-th receive a rank
posts from `src` on channel c gets the k-th tensor `src` sends to it on channel c. A channel (default 0) is a
FIFO of its own between an ordered pair of ranks: the executor opens one per direction of each stage-graph
edge, since a V schedule sends two edges' tensors from one rank to another in an order its peer consumes them
in another.
Calibration measures links through these same classes, so a profile prices the transport the executor uses.

- GlooTransport: CPU tensors over gloo.
- NcclTransport: one GPU per rank, over NCCL.
- HostStagedTransport: ranks that share a GPU. NCCL refuses two ranks on one device and gloo does not send
  CUDA tensors, so tensors go device -> host, over gloo, host -> device.
- InProcessTransport: ranks that are threads of one process, for tests.

The distributed ones open one process group per directed edge src -> dst and channel: a receive posted from a
peer never queues in front of a send to that peer, and on NCCL each direction gets its own communicator and
stream.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ..choices import BACKENDS, choose_from

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_TIMEOUT_S = 120.0  # a receive may wait for several stages' compute upstream; gloo's own default is 30 min
LOCALHOST = "127.0.0.1"  # where a job's ranks on this host meet


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of a job on this host meet: the store (a TCPStore) that the process starting them serves
    (`served_rendezvous`) on a port it has held since the OS chose it. Every rank joins it as a client, as
    torchrun's workers join their agent's store (torch 2.13, torch/distributed/rendezvous.py
    `_create_c10d_store`): a port chosen, released and bound later by rank 0 could be taken in between by
    another process, failing the job (EADDRINUSE) or joining its ranks to another job's store."""

    port: int
    host: str = LOCALHOST

    def join(self, backend: str, rank: int, world_size: int, timeout_s: float | None = None) -> None:
        """Create this rank's default process group in the job's store; `timeout_s` bounds its collectives
        (None: torch's default)."""
        timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        store = dist.TCPStore(self.host, self.port, world_size, is_master=False, **timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **timeout)


@contextlib.contextmanager
def served_rendezvous() -> Iterator[Rendezvous]:
    """A job's rendezvous, served by this process until the block ends: start the ranks and wait for them inside
    it (a rank's groups meet in the store after it joined too)."""
    store = dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False)
    try:
        yield Rendezvous(store.port)
    finally:
        del store  # the server stops with its last reference


KINDS = ("gloo", "nccl", "host-staged")

Edge = tuple[int, int]  # (src, dst) ranks
Link = tuple[int, int, int]  # (src, dst, channel): one FIFO
_TIMED_OUT = re.compile(r"timed out|timeout|timing out", re.IGNORECASE)  # how gloo and NCCL word a passed timeout


def _link(edge: Edge | Link) -> Link:
    """(src, dst) -> (src, dst, 0); (src, dst, channel) as ints."""
    if len(edge) not in (2, 3):
        raise ValueError(f"an edge is (src, dst) or (src, dst, channel), got {edge!r}")
    src, dst, *rest = edge
    return int(src), int(dst), int(rest[0]) if rest else 0


def _on(channel: int) -> str:
    """How an error names a channel (nothing for the default one)."""
    return f" on channel {channel}" if channel else ""


class PeerWait:
    """The wait on a peer this process's main thread (a rank's compute) is inside, if any, and since when
    (time.monotonic_ns): CPU it uses there is not progress, since a host waiting on gloo or on a CUDA
    event can spin. The rank's heartbeat reads it."""

    what: ClassVar[str] = ""
    since_ns: ClassVar[int] = 0

    @classmethod
    @contextlib.contextmanager
    def inside(cls, what: str) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or cls.what:
            yield
            return
        cls.what, cls.since_ns = what, time.monotonic_ns()
        try:
            yield
        finally:
            cls.what = ""


class TransportError(RuntimeError):
    """A transfer that failed or a transport that cannot be opened; one line, naming the rank and its peer."""


class TransportTimeout(TransportError):
    """A wait that passed its timeout: the peer stalled or died."""


class Handle(Protocol):
    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """Block until the transfer is done (None: the transport's timeout) and return the received tensor,
        on the transport's compute device, or None for a send. Raises TransportTimeout naming the peer."""

    def done(self) -> bool:
        """Whether the transfer has completed, without waiting (a finished send's tensor is free again)."""


class Transport(ABC):
    """One rank's end of the point-to-point links between `world_size` ranks.

    A sent tensor must not be modified until its handle's wait returns (sends are not copied, except to
    stage them through the host). Use as a context manager or call close()."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str, timeout_s: float) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) (got {rank})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, channel: int = 0) -> Handle:
        """Start sending `tensor` to rank `dst` on `channel`; returns at once."""

    @abstractmethod
    def recv(self, shape: Iterable[int], dtype: torch.dtype, src: int, channel: int = 0) -> Handle:
        """Post a receive of the next tensor rank `src` sends to this rank on `channel`; returns at once."""

    @abstractmethod
    def close(self) -> None:
        """Release the transport's resources (pending transfers are abandoned)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: peer must be another rank in [0, {self.world_size}) (got {peer})")
        return peer


@dataclass
class _Done:
    """A transfer complete when issued (an in-process send)."""

    result: torch.Tensor | None = None

    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        return self.result

    def done(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------- in-process


@dataclass
class _Mailbox:
    """Tensors sent along one directed edge, by sequence number, so the k-th posted receive gets the k-th send
    whichever order receives are waited on."""

    ready: threading.Condition = field(default_factory=threading.Condition)
    sent: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: int = 0
    receives: int = 0


@dataclass
class _PostOffice:
    """The mailboxes of one in-process group, and why the group was abandoned (a rank failed), so a receive
    that could never be served stops at once instead of waiting out its timeout."""

    boxes: dict[Link, _Mailbox] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards creating a mailbox on first use
    abandoned: str | None = None


@dataclass
class _MailHandle:
    transport: InProcessTransport
    box: _Mailbox
    seq: int
    src: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    channel: int = 0
    result: torch.Tensor | None = None

    def done(self) -> bool:
        return self.result is not None or self.seq in self.box.sent

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        if self.result is not None:
            return self.result
        me = f"rank {self.transport.rank}: receive #{self.seq} from rank {self.src}{_on(self.channel)}"
        timeout_s = self.transport.timeout_s if timeout_s is None else timeout_s
        office = self.transport.office
        with self.box.ready:
            if not self.box.ready.wait_for(lambda: self.seq in self.box.sent or office.abandoned, timeout_s):
                raise TransportTimeout(f"{me} timed out after {timeout_s:g} s")
            if self.seq not in self.box.sent:
                raise TransportError(f"{me} abandoned: {office.abandoned}")
            tensor = self.box.sent.pop(self.seq)
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise TransportError(f"{me}: posted for {list(self.shape)} {self.dtype}, "
                                 f"got {list(tensor.shape)} {tensor.dtype}")
        self.result = tensor.to(self.transport.device)
        return self.result


class InProcessTransport(Transport):
    """Ranks that are threads of one process, talking through a mailbox per directed edge and channel (made on
    first use). A send copies its tensor, as a real transport's data leaves the sender; a receive checks shape
    and dtype against the post."""

    def __init__(self, rank: int, world_size: int, office: _PostOffice, *,
                 device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(rank, world_size, device, timeout_s)
        self.office = office

    @classmethod
    def connected(cls, world_size: int, *, device: torch.device | str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> list[InProcessTransport]:
        """One transport per rank, all connected; hand transports[r] to the thread running rank r."""
        office = _PostOffice()
        return [cls(rank, world_size, office, device=device, timeout_s=timeout_s) for rank in range(world_size)]

    def _box(self, src: int, dst: int, channel: int) -> _Mailbox:
        if not isinstance(channel, int) or channel < 0:
            raise ValueError(f"rank {self.rank}: channel must be a whole number >= 0 (got {channel!r})")
        with self.office.lock:
            return self.office.boxes.setdefault((src, dst, channel), _Mailbox())

    def send(self, tensor: torch.Tensor, dst: int, channel: int = 0) -> Handle:
        box = self._box(self.rank, self._peer(dst), channel)
        with box.ready:
            box.sent[box.sends] = tensor.detach().clone()
            box.sends += 1
            box.ready.notify_all()
        return _Done()

    def recv(self, shape: Iterable[int], dtype: torch.dtype, src: int, channel: int = 0) -> Handle:
        box = self._box(self._peer(src), self.rank, channel)
        with box.ready:
            seq = box.receives
            box.receives += 1
        return _MailHandle(self, box, seq, src, tuple(shape), dtype, channel)

    def abandon(self, reason: str) -> bool:
        """Fail every receive of the group, waiting or yet to wait, with `reason`: a rank failed and nothing
        more will be sent. True for the first rank to abandon the group (its failure is the cause)."""
        with self.office.lock:
            if self.office.abandoned is not None:
                return False
            self.office.abandoned = reason
            boxes = list(self.office.boxes.values())
        for box in boxes:
            with box.ready:
                box.ready.notify_all()
        return True

    def close(self) -> None:
        """Nothing to release: the mailboxes go with the last transport that holds them."""


# --------------------------------------------------------------------------------------- torch.distributed


@dataclass
class _WorkHandle:
    """A torch.distributed transfer in flight; `finish` turns its buffer into the result once it is done."""

    work: Any  # torch.distributed.Work
    what: str  # "rank 1: receive from rank 0", for errors
    timeout_s: float
    finish: Callable[[], torch.Tensor | None]
    finished: bool = False
    result: torch.Tensor | None = None

    def done(self) -> bool:
        return self.finished or self.work.is_completed()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        if self.finished:
            return self.result
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            with PeerWait.inside(self.what):
                completed = self.work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            message = (str(exc).splitlines() or ["?"])[0]
            if _TIMED_OUT.search(message):
                raise TransportTimeout(f"{self.what} timed out after {timeout_s:g} s") from None
            raise TransportError(f"{self.what} failed: {message}") from None
        if completed is False:
            raise TransportTimeout(f"{self.what} timed out after {timeout_s:g} s")
        self.result, self.finished = self.finish(), True
        self.work = None  # the work holds the sent tensor: let it go
        return self.result


@dataclass
class _ReapedHandle:
    """A gloo send, waited on by its link's `_Reaper`: gloo's work reports completion only to a wait, so a
    send nobody waits on keeps its tensor (the work holds it) until the run ends."""

    handle: _WorkHandle
    settled: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None

    def done(self) -> bool:
        return self.settled.is_set()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        timeout_s = self.handle.timeout_s if timeout_s is None else timeout_s
        with PeerWait.inside(self.handle.what):
            settled = self.settled.wait(timeout_s)
        if not settled:
            raise TransportTimeout(f"{self.handle.what} timed out after {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return None

    def settle(self) -> None:
        try:
            self.handle.wait()
        except Exception as exc:  # noqa: BLE001 - kept for the rank's own wait to raise
            self.error = exc
        finally:
            self.settled.set()


class _Reaper:
    """One link's sends waited on in order by a daemon thread (a link completes its sends first in, first
    out), so each lets go of its tensor as soon as it is sent. Work.wait releases the GIL while it blocks."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_ReapedHandle | None] = queue.SimpleQueue()
        self._last: _ReapedHandle | None = None  # they settle in order: all are settled once the last is
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, handle: _WorkHandle) -> _ReapedHandle:
        self._last = _ReapedHandle(handle)
        self._queue.put(self._last)
        return self._last

    def _run(self) -> None:
        while (reaped := self._queue.get()) is not None:
            reaped.settle()

    def stop(self) -> bool:
        """Stop the thread; False, at once, while a send is unsettled (a run that failed: its peer may never
        take it, and a rank that failed must not wait before it reports), the thread abandoned as a daemon."""
        self._queue.put(None)
        if self._last is not None and not self._last.done():
            return False
        self._thread.join(timeout=1.0)
        return not self._thread.is_alive()


class _DistTransport(Transport):
    """A transport over torch.distributed, one process group per directed edge and channel.

    Joins the job (creates the default process group, at `rendezvous` or else where torchrun's environment says,
    unless one is up, and then destroys it at close) with an explicit timeout. Every rank must construct it with
    the same `edges` (default: every ordered pair), since creating a group is collective. An edge is (src, dst),
    channel 0, or (src, dst, channel)."""

    backend: ClassVar[str]

    def __init__(self, rank: int, world_size: int, device: torch.device | str, *,
                 rendezvous: Rendezvous | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 edges: Iterable[Edge | Link] | None = None) -> None:
        super().__init__(rank, world_size, device, timeout_s)
        if edges is None:
            edges = [(s, d) for s in range(world_size) for d in range(world_size) if s != d]
        links = sorted({_link(edge) for edge in edges})
        bad = [(s, d) for s, d, _ in links if s == d or not (0 <= s < world_size and 0 <= d < world_size)]
        if bad:
            raise ValueError(f"edge {bad[0][0]} -> {bad[0][1]} is not between two of {world_size} ranks")
        if any(c < 0 for *_, c in links):
            raise ValueError("channels must be whole numbers >= 0")
        timeout = timedelta(seconds=timeout_s)
        self._owns_default = not dist.is_initialized()
        if self._owns_default and rendezvous is not None:
            rendezvous.join(self.backend, rank, world_size, timeout_s)
        elif self._owns_default:
            dist.init_process_group(self.backend, init_method="env://", rank=rank, world_size=world_size,
                                    timeout=timeout)
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"the process group is up as rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"not rank {rank} of {world_size}")
        self._groups: dict[Link, Any] = {}
        self._transfers: dict[Link, int] = {}  # issued per link, to number them in errors
        self._reapers: dict[Link, _Reaper] = {}  # per outgoing link, where the backend needs one (gloo)
        try:
            for src, dst, channel in links:
                group = dist.new_group([src, dst], timeout=timeout, backend=self.backend)
                if rank in (src, dst):
                    self._groups[(src, dst, channel)] = group
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Anything a backend must do before the first transfer (collective over the edges)."""

    def _issue(self, src: int, dst: int, channel: int) -> tuple[Any, int]:
        """The link's process group, and this transfer's number on the link (from 0)."""
        link = (src, dst, channel)
        if link not in self._groups:
            raise TransportError(f"rank {self.rank}: no link {src} -> {dst}{_on(channel)} was opened")
        count = self._transfers.get(link, 0)
        self._transfers[link] = count + 1
        return self._groups[link], count

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """What goes on the wire for `tensor`."""
        return tensor.detach().contiguous()

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where a receive lands."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _incoming(self, buffer: torch.Tensor) -> torch.Tensor:
        """A landed receive, on the compute device."""
        return buffer

    def send(self, tensor: torch.Tensor, dst: int, channel: int = 0) -> Handle:
        group, n = self._issue(self.rank, self._peer(dst), channel)
        work = dist.isend(self._outgoing(tensor), dst, group=group)
        handle = _WorkHandle(work, f"rank {self.rank}: send #{n} to rank {dst}{_on(channel)}", self.timeout_s,
                             lambda: None)
        if self.backend != "gloo":  # NCCL's work answers is_completed from its CUDA event
            return handle
        link = (self.rank, dst, channel)
        if link not in self._reapers:
            self._reapers[link] = _Reaper(f"pipesim-sends-{dst}-{channel}")
        return self._reapers[link].watch(handle)

    def recv(self, shape: Iterable[int], dtype: torch.dtype, src: int, channel: int = 0) -> Handle:
        group, n = self._issue(self._peer(src), self.rank, channel)
        buffer = self._buffer(tuple(shape), dtype)
        work = dist.irecv(buffer, src, group=group)
        return _WorkHandle(work, f"rank {self.rank}: receive #{n} from rank {src}{_on(channel)}", self.timeout_s,
                           lambda: self._incoming(buffer))

    def close(self) -> None:
        stuck = {link for link, reaper in self._reapers.items() if not reaper.stop()}
        self._reapers = {}
        for link, group in self._groups.items():
            if link not in stuck:  # a group whose waiter is still inside gloo is left to the process's exit
                dist.destroy_process_group(group)
        self._groups = {}
        if self._owns_default and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_default = False


class GlooTransport(_DistTransport):
    """CPU tensors over gloo."""

    backend = "gloo"

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu", **options: Any) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"GlooTransport sends CPU tensors (got device {device}); use HostStagedTransport")
        super().__init__(rank, world_size, device, **options)


class NcclTransport(_DistTransport):
    """One GPU per rank, over NCCL; `device` is this rank's GPU."""

    backend = "nccl"

    def __init__(self, rank: int, world_size: int, device: torch.device | str, **options: Any) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NcclTransport needs a CUDA device (got {device})")
        torch.cuda.set_device(device)
        super().__init__(rank, world_size, device, **options)

    def _connect(self) -> None:
        """Create every edge's communicator now, edge by edge in one order on all ranks. NCCL creates one at
        its first transfer and blocks the host until the peer joins: a receive posted early would otherwise
        wait for a peer that is itself blocked creating another edge's communicator."""
        token = torch.zeros(1, device=self.device)
        timeout = timedelta(seconds=self.timeout_s)
        for (src, dst, _), group in sorted(self._groups.items()):
            if self.rank == src:
                dist.isend(token, dst, group=group).wait(timeout)
            else:
                dist.irecv(token, src, group=group).wait(timeout)


class HostStagedTransport(_DistTransport):
    """Ranks that share a GPU: device -> host copy, gloo, host -> device when the receive is waited on.

    On a CPU `device` the staging is a plain copy, which lets tests run this path without a GPU."""

    backend = "gloo"

    def __init__(self, rank: int, world_size: int, device: torch.device | str, **options: Any) -> None:
        device = torch.device(device)
        self._pinned = device.type == "cuda"  # page-locked host buffers copy faster and asynchronously
        if self._pinned:
            torch.cuda.set_device(device)
        super().__init__(rank, world_size, device, **options)

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
        host.copy_(tensor.detach(), non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()  # gloo reads the buffer from another thread
        return host

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._pinned)

    def _incoming(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.to(self.device, non_blocking=self._pinned)


# ------------------------------------------------------------------------------------------------ choosing


@dataclass(frozen=True)
class TransportChoice:
    """Which transport ranks use and on what: `kind` one of KINDS; `device` the compute device type;
    `gpus` the GPUs the ranks spread over (rank r on GPU r mod gpus; 0 on CPU)."""

    kind: str
    device: str
    gpus: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"transport kind must be one of {', '.join(KINDS)} (got {self.kind!r})")

    @property
    def backend(self) -> str:
        """The torch.distributed backend of the default process group (collectives run on it)."""
        return "nccl" if self.kind == "nccl" else "gloo"

    @property
    def host_staged(self) -> bool:
        return self.kind == "host-staged"

    @property
    def timer(self) -> str:
        """How ranks time their work: CUDA events on a GPU, the monotonic clock on CPU."""
        return "cuda-events" if self.device == "cuda" else "monotonic"

    def device_for(self, local_rank: int) -> torch.device:
        """The compute device of the rank with this index on its machine."""
        return torch.device("cuda", local_rank % self.gpus) if self.device == "cuda" else torch.device("cpu")

    def meta(self) -> dict[str, Any]:
        """What a link measurement records about its transport."""
        return {"transport": self.kind, "backend": self.backend, "device": self.device,
                "host_staged": self.host_staged, "timer": self.timer, "gpus": self.gpus}


def choose_transport(device: str, world_size: int, *, backend: str = "auto",
                     gpus: int | None = None) -> TransportChoice:
    """The transport for `world_size` ranks on this machine (under torchrun, its local world size) on `device`
    ("cpu" or "cuda"): gloo on CPU; on CUDA, NCCL when every rank has a GPU of its own, else host-staged gloo.
    `backend` "gloo" or "nccl" forces one; `gpus` defaults to the GPUs torch sees. Impossible requests raise
    one line saying why in `pipesim run`'s flags, which checks them before any rank starts."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (got {device!r})")
    if backend not in BACKENDS:
        raise ValueError(choose_from("backend", BACKENDS, backend))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    if device == "cpu":
        if backend == "nccl":
            raise TransportError("--backend nccl sends GPU tensors only: with --device cpu use --backend gloo or "
                                 "auto; on a GPU, --device cuda")
        return TransportChoice("gloo", "cpu", 0)
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus == 0:
        raise TransportError("device 'cuda' asked for, but torch sees no GPU")
    if backend == "nccl" and gpus < world_size:
        raise TransportError(f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) "
                             "(NCCL refuses two ranks on one GPU); --backend gloo stages through the host")
    if backend == "nccl" or (backend == "auto" and gpus >= world_size):
        return TransportChoice("nccl", "cuda", gpus)
    return TransportChoice("host-staged", "cuda", gpus)


def connect(choice: TransportChoice, rank: int, world_size: int, *, local_rank: int | None = None,
            rendezvous: Rendezvous | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            edges: Iterable[Edge | Link] | None = None) -> Transport:
    """Open `choice`'s transport for `rank`: on its device (`local_rank`, default `rank`, picks the GPU), in a
    default process group (created at `rendezvous`, or where torchrun's environment says, unless one is up) with
    one group per edge in `edges` ((src, dst) for channel 0 or (src, dst, channel); default: every ordered pair).
    Every rank calls it with the same arguments but its rank."""
    classes: dict[str, type[_DistTransport]] = {"gloo": GlooTransport, "nccl": NcclTransport,
                                                "host-staged": HostStagedTransport}
    device = choice.device_for(rank if local_rank is None else local_rank)
    return classes[choice.kind](rank, world_size, device, rendezvous=rendezvous, timeout_s=timeout_s, edges=edges)
