"""The transport seam: registered regions, one-sided batched READ, per-peer channel pools.

A node *registers* host buffers and gets back a :class:`Region` ``(addr, rkey, length)``
that it can publish. Another node reads bytes out of that region with
:meth:`Transport.read_batch`, which moves every item straight into a local destination
that must itself lie inside a region registered on the reader (the receive buffer), the
way an RDMA READ needs both an ``rkey`` on the remote side and an ``lkey`` on the local one.

Every transport (TCP, the fake NIC, later libibverbs) implements the same contract and
runs the same conformance suite (``tests/test_transport_conformance.py``). What a
transport can do is declared in :attr:`Transport.capabilities`; callers never probe with
``hasattr``.

Contract, shared by every implementation:

- ``read_batch`` never raises for a per-item failure; it returns one :class:`Status` per
  item, in order. It raises only for malformed arguments (``ValueError``/``TypeError``).
- A remote item is checked against the remote region table: unknown or deregistered rkey
  gives :attr:`Status.BAD_RKEY`; ``[addr, addr + length)`` not inside the region gives
  :attr:`Status.OUT_OF_BOUNDS` (no integer overflow: the check is done on offsets).
- A destination outside every locally registered region gives :attr:`Status.BAD_LOCAL`
  and no byte is written.
- A read whose peer is this transport itself is a ``memcpy`` (no channel, no socket).
- A channel that saw an error is closed and discarded; the next read opens a new one.
- At most ``max_channels_per_peer`` channels exist per peer; extra readers wait.
- ``deregister`` refuses new reads on the region at once and then waits until the reads
  in flight on it (served from it or landing in it) have finished.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import enum
import operator
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

__all__ = [
    "MAX_ITEM_BYTES",
    "Capabilities",
    "ChannelPool",
    "InjectedFault",
    "ReadOp",
    "Region",
    "RegionBusyError",
    "RegionTable",
    "Status",
    "Transport",
    "TransportError",
    "TransportStats",
    "buffer_span",
    "parse_peer",
]

#: Largest single read item, in bytes. Bigger reads must be split by the caller.
MAX_ITEM_BYTES = 1 << 30

_U64 = (1 << 64) - 1


class Status(enum.IntEnum):
    """Per-item outcome of :meth:`Transport.read_batch` (fits in one byte on the wire)."""

    OK = 0
    BAD_RKEY = 1  #: rkey unknown to the peer, or deregistered
    OUT_OF_BOUNDS = 2  #: ``[addr, addr+length)`` not inside the remote region
    PEER_UNREACHABLE = 3  #: could not connect / authenticate, or the peer is gone
    TIMEOUT = 4  #: the batch deadline passed before this item completed
    CHANNEL_ERROR = 5  #: the channel broke (connection reset, QP in error, protocol error)
    BAD_LOCAL = 6  #: the destination is not inside a locally registered region
    INVALID = 7  #: malformed item (negative or oversized length)


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory region, as published to other nodes.

    ``addr`` is the virtual address of the first byte in the registering process,
    ``rkey`` the key a reader must present, ``length`` the size in bytes.
    """

    addr: int
    rkey: int
    length: int


class ReadOp(NamedTuple):
    """One item of a batched READ: copy ``length`` bytes from ``remote_addr`` (inside the
    peer's region ``rkey``) to ``local_addr`` (inside a local registered region)."""

    remote_addr: int
    rkey: int
    length: int
    local_addr: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport declares about itself (no ``hasattr`` probing).

    Attributes
    ----------
    kind:
        Short name: ``"tcp"``, ``"fake"``, ``"rdma"``.
    one_sided:
        The remote CPU does not run user code per read (true only for RDMA).
    releases_gil:
        Bytes move without holding the GIL on the reading side.
    zero_copy_receive:
        Payload lands directly in the destination (no bounce buffer).
    local_memcpy:
        A read from this very transport is served by ``memcpy``.
    fault_injection:
        The transport accepts fault and delay hooks (test transports).
    """

    kind: str
    one_sided: bool
    releases_gil: bool
    zero_copy_receive: bool
    local_memcpy: bool = True
    fault_injection: bool = False


@dataclass
class TransportStats:
    """Counters, for tests and metrics. Updated under the transport's locks; read freely."""

    local_items: int = 0  #: items served by local memcpy
    remote_items: int = 0  #: items sent to a peer
    channels_opened: int = 0
    channels_discarded: int = 0  #: channels closed after an error
    served_items: int = 0  #: items this node served as a responder


class TransportError(Exception):
    """Base class of transport errors raised to callers (not per-item statuses)."""


class RegionBusyError(TransportError):
    """``deregister`` timed out while reads were still in flight on the region."""


class InjectedFault(TransportError):
    """Raised by a test's responder hook to make the responder fail its channel."""


def parse_peer(peer: str | tuple[str, int]) -> tuple[str, int]:
    """Split ``"host:port"`` (or pass a ``(host, port)`` tuple through), checking the port.

    >>> parse_peer("127.0.0.1:9000")
    ('127.0.0.1', 9000)
    """
    if isinstance(peer, tuple):
        host, port = peer
    elif isinstance(peer, str):
        host, sep, port_s = peer.rpartition(":")
        if not sep or not host:
            raise ValueError(f"peer must be 'host:port', got {peer!r}")
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"peer port is not an integer: {peer!r}") from None
    else:
        raise TypeError(f"peer must be 'host:port' or (host, port), got {type(peer).__name__}")
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bad peer address {peer!r}")
    return host, port


def buffer_span(buffer: Any) -> tuple[int, memoryview]:
    """Address and a flat writable byte view of a host buffer.

    Accepts a CPU ``torch.Tensor``, a numpy array, or any object exporting a writable,
    C-contiguous buffer (``bytearray``, ``mmap``, ``memoryview``...). The returned view keeps
    the memory alive.

    Raises
    ------
    TypeError
        Not a buffer, or a tensor on a non-CPU device.
    ValueError
        Read-only, non-contiguous, or empty.
    """
    obj = buffer
    mod = type(buffer).__module__
    if mod.startswith("torch"):
        if getattr(buffer, "device", None) is None or buffer.device.type != "cpu":
            raise TypeError(f"only CPU tensors can be registered, got device {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous to be registered")
        # A CPU tensor's numpy view shares its storage; bool/bfloat16 have no numpy dtype.
        import torch

        obj = buffer.view(torch.uint8).numpy() if buffer.numel() else buffer.numpy()
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{type(buffer).__name__} does not export a buffer") from None
    if mv.readonly:
        raise ValueError("buffer is read-only; register a writable buffer")
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if mv.nbytes == 0:
        raise ValueError("cannot register an empty buffer")
    flat = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    addr = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return addr, flat


@dataclass(eq=False)
class _Entry:
    region: Region
    view: memoryview
    inflight: int = 0
    dying: bool = False
    remote: bool = True  # False: a local receive region, never served to a peer


class RegionTable:
    """The regions one transport has registered: rkey lookup for the responder, address
    lookup for local destinations, and in-flight counts for ``deregister``.

    All methods are thread-safe; each takes the table lock once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._by_rkey: dict[int, _Entry] = {}
        self._starts: list[int] = []  # sorted region start addresses
        self._by_start: dict[int, _Entry] = {}

    def add(self, addr: int, view: memoryview, remote: bool = True) -> Region:
        """Register ``view`` (which starts at ``addr``) under a fresh random 32-bit rkey.
        ``remote=False`` makes it a local receive region: a destination for reads only,
        whose rkey (a handle for :meth:`remove`) the responder never serves.

        Runtime complexity: ``O(n)`` in the number of regions (sorted insert).
        """
        n = view.nbytes
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            if i > 0:
                prev = self._by_start[self._starts[i - 1]]
                if prev.region.addr + prev.region.length > addr:
                    raise ValueError("buffer overlaps a region that is already registered")
            if i < len(self._starts) and addr + n > self._starts[i]:
                raise ValueError("buffer overlaps a region that is already registered")
            rkey = 0
            while rkey == 0 or rkey in self._by_rkey:
                rkey = secrets.randbits(32)
            entry = _Entry(Region(addr, rkey, n), view)
            entry.remote = remote
            self._by_rkey[rkey] = entry
            self._starts.insert(i, addr)
            self._by_start[addr] = entry
            return entry.region

    def remove(self, rkey: int, timeout: float | None = None) -> None:
        """Unpublish ``rkey`` now, then wait until no read is in flight on it.

        Raises ``KeyError`` for an unknown rkey and :class:`RegionBusyError` when
        ``timeout`` (seconds) passes first; the region then stays unpublished and a later
        call finishes the job.
        """
        with self._lock:
            entry = self._by_rkey.get(rkey)
            if entry is None:
                raise KeyError(f"rkey {rkey:#x} is not registered")
            entry.dying = True
            if not self._idle.wait_for(lambda: entry.inflight == 0, timeout):
                raise RegionBusyError(f"{entry.inflight} reads still in flight on rkey {rkey:#x}")
            del self._by_rkey[rkey]
            start = entry.region.addr
            del self._by_start[start]
            self._starts.pop(bisect.bisect_left(self._starts, start))

    def acquire_remote(self, items: Iterable[tuple[int, int, int]]) -> list[tuple[Status, memoryview | None, Any]]:
        """For each ``(addr, length, rkey)``: a status, the source view, and a token for
        :meth:`release`. Items that are OK count as in flight until released.

        Runtime complexity: ``O(1)`` per item.
        """
        out: list[tuple[Status, memoryview | None, Any]] = []
        with self._lock:
            for addr, length, rkey in items:
                entry = self._by_rkey.get(rkey)
                if entry is None or entry.dying or not entry.remote:
                    out.append((Status.BAD_RKEY, None, None))
                    continue
                off = addr - entry.region.addr
                if length < 0 or length > MAX_ITEM_BYTES:
                    out.append((Status.INVALID, None, None))
                elif off < 0 or off > entry.region.length - length:
                    out.append((Status.OUT_OF_BOUNDS, None, None))
                else:
                    entry.inflight += 1
                    out.append((Status.OK, entry.view[off : off + length], entry))
        return out

    def acquire_local(self, addr: int, length: int) -> tuple[memoryview, _Entry] | None:
        """The view of ``[addr, addr+length)`` inside a live local region, marked in flight;
        ``None`` when no region covers it.

        Runtime complexity: ``O(log n)``.
        """
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            entry = self._by_start[self._starts[i]]
            off = addr - entry.region.addr
            if entry.dying or length < 0 or off > entry.region.length - length:
                return None
            entry.inflight += 1
            return entry.view[off : off + length], entry

    def release(self, entries: Iterable[Any]) -> None:
        """End the reads started by ``acquire_*`` (``None`` tokens are skipped)."""
        with self._lock:
            wake = False
            for e in entries:
                if e is not None:
                    e.inflight -= 1
                    wake = wake or (e.dying and e.inflight == 0)
            if wake:
                self._idle.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rkey)


C = TypeVar("C")


class ChannelPool(Generic[C]):
    """Per-peer pools of channels, at most ``cap`` channels per peer.

    A channel is leased for one operation and given back with ``ok=True`` (reused) or
    ``ok=False`` (closed and discarded; the next lease opens a new one). Channels are
    opened lazily by ``connect(peer, timeout)``; a lease beyond the cap waits for a give-back.
    """

    def __init__(self, connect: Callable[[Any, float | None], C], close: Callable[[C], None], cap: int) -> None:
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"max channels per peer must be a positive int, got {cap!r}")
        self._connect = connect
        self._close = close
        self.cap = cap
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._free: dict[Any, list[C]] = {}
        self._open: dict[Any, int] = {}
        self._closed = False
        self.opened = 0
        self.discarded = 0

    def open_count(self, peer: Any) -> int:
        """Channels currently open to ``peer`` (leased or idle)."""
        with self._lock:
            return self._open.get(peer, 0)

    def lease(self, peer: Any, timeout: float | None) -> C:
        """A channel to ``peer``: an idle one, a new one under the cap, or the next one
        given back. Raises ``TimeoutError`` when ``timeout`` passes first, and whatever
        ``connect`` raises (the slot is then released).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise TransportError("channel pool is closed")
                free = self._free.get(peer)
                if free:
                    return free.pop()
                if self._open.get(peer, 0) < self.cap:
                    self._open[peer] = self._open.get(peer, 0) + 1
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no free channel to {peer!r}")
                self._cond.wait(remaining)
        try:
            ch = self._connect(peer, None if deadline is None else max(deadline - time.monotonic(), 0.001))
        except BaseException:
            with self._lock:
                self._open[peer] -= 1
                self._cond.notify()
            raise
        with self._lock:
            self.opened += 1
        return ch

    def give_back(self, peer: Any, ch: C, ok: bool) -> None:
        """Return a leased channel; ``ok=False`` closes and discards it."""
        with self._lock:
            keep = ok and not self._closed
            if keep:
                self._free.setdefault(peer, []).append(ch)
            else:
                self._open[peer] -= 1
                if not ok:
                    self.discarded += 1
            self._cond.notify()
        if not keep:
            with contextlib.suppress(OSError):
                self._close(ch)

    def close(self) -> None:
        """Close every idle channel; leased ones are closed when given back."""
        with self._lock:
            self._closed = True
            idle = [ch for chans in self._free.values() for ch in chans]
            for peer, chans in self._free.items():
                self._open[peer] -= len(chans)
            self._free.clear()
            self._cond.notify_all()
        for ch in idle:
            with contextlib.suppress(OSError):
                self._close(ch)


ResponderHook = Callable[[Sequence[int]], None]


@dataclass
class _BatchPlan:
    """The remote part of a batch, after local checks: indices into the caller's ops."""

    index: list[int] = field(default_factory=list)
    ops: list[ReadOp] = field(default_factory=list)
    views: list[memoryview] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)


class Transport(ABC):
    """A node's endpoint: registers its regions, serves reads of them, reads from peers.

    Parameters
    ----------
    max_channels_per_peer:
        Cap on channels (connections / queue pairs) open to one peer.
    timeout:
        Default deadline of one ``read_batch``, in seconds.
    clock:
        Monotonic time source for deadlines, in seconds.
    """

    capabilities: ClassVar[Capabilities]

    def __init__(
        self, *, max_channels_per_peer: int = 16, timeout: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(max_channels_per_peer, int) or max_channels_per_peer < 1:
            raise ValueError(f"max_channels_per_peer must be a positive int, got {max_channels_per_peer!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.max_channels_per_peer = max_channels_per_peer
        self.timeout = float(timeout)
        if not callable(clock):
            raise TypeError("clock must be a callable returning seconds")
        #: Time source for deadlines (injectable, as cachetools injects its timer).
        self.clock = clock
        self.regions = RegionTable()
        self.stats = TransportStats()
        self._stats_lock = threading.Lock()
        #: Test hook run by the responder with the rkeys of the items it is about to serve,
        #: after they are marked in flight and before bytes move. It may block (a gate) or
        #: raise :class:`InjectedFault` to fail the channel.
        self.responder_hook: ResponderHook | None = None

    # -- identity -------------------------------------------------------------------------
    @property
    @abstractmethod
    def address(self) -> str:
        """This node's peer address, as other nodes name it in ``read_batch``."""

    # -- regions --------------------------------------------------------------------------
    def register(self, buffer: Any, *, remote: bool = True) -> Region:
        """Register a writable host buffer (numpy array, CPU tensor, ``bytearray``...) and
        return its :class:`Region`. The transport keeps the buffer alive until
        :meth:`deregister`.

        ``remote=False`` registers a *local receive* region (an ``lkey`` without an
        ``rkey``): reads may land in it, but no peer can read from it; a peer presenting
        its key gets :attr:`Status.BAD_RKEY`. Its ``rkey`` only names it for
        :meth:`deregister` and must not be published.

        Runtime complexity: ``O(n)`` in the number of registered regions.
        """
        addr, view = buffer_span(buffer)
        return self.regions.add(addr, view, remote)

    def deregister(self, rkey: int, timeout: float | None = None) -> None:
        """Unpublish ``rkey``: new reads of it fail with ``BAD_RKEY`` at once; then wait for
        the reads in flight on it to finish (``timeout`` seconds at most, ``None`` = no
        limit; :class:`RegionBusyError` if it passes)."""
        self.regions.remove(rkey, timeout)

    # -- reads ----------------------------------------------------------------------------
    def read_batch(
        self, peer: str, ops: Sequence[ReadOp | tuple[int, int, int, int]], timeout: float | None = None
    ) -> list[Status]:
        """Copy every item's bytes from ``peer``'s registered memory into local registered
        memory, and return one :class:`Status` per item, in order.

        ``ops`` items are ``(remote_addr, rkey, length, local_addr)``. Bytes move without
        the GIL. ``peer == self.address`` degrades to ``memcpy``. Items after a channel
        failure report ``CHANNEL_ERROR`` (or ``TIMEOUT``); no item is half-reported as OK.

        Runtime complexity: ``O(items + bytes)``.
        """
        timeout = self.timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        deadline = self.clock() + timeout
        statuses: list[Status] = [Status.OK] * len(ops)
        plan = _BatchPlan()
        try:
            for i, op in enumerate(ops):
                if len(op) != 4:
                    raise ValueError(f"read item {i} must be (remote_addr, rkey, length, local_addr), got {op!r}")
                try:
                    raddr, rkey, length, laddr = (operator.index(v) for v in op)
                except TypeError:
                    raise TypeError(f"read item {i} must hold integers, got {op!r}") from None
                if length < 0 or length > MAX_ITEM_BYTES or not 0 <= raddr <= _U64 or not 0 <= rkey < 1 << 32:
                    statuses[i] = Status.INVALID
                    continue
                got = self.regions.acquire_local(laddr, length)
                if got is None:
                    statuses[i] = Status.BAD_LOCAL
                    continue
                plan.index.append(i)
                plan.ops.append(ReadOp(raddr, rkey, length, laddr))
                plan.views.append(got[0])
                plan.entries.append(got[1])
            if plan.ops:
                if peer == self.address:
                    self._read_local(plan, statuses)
                else:
                    self._read_remote(peer, plan, statuses, deadline)
        finally:
            self.regions.release(plan.entries)
        return statuses

    def _read_local(self, plan: _BatchPlan, statuses: list[Status]) -> None:
        got = self.regions.acquire_remote((op.remote_addr, op.length, op.rkey) for op in plan.ops)
        try:
            for i, op, (st, src, _entry) in zip(plan.index, plan.ops, got, strict=True):
                statuses[i] = st
                if st == Status.OK and src is not None:
                    # ctypes foreign calls release the GIL while memmove runs.
                    ctypes.memmove(op.local_addr, op.remote_addr, op.length)
        finally:
            self.regions.release(e for _, _, e in got)
        with self._stats_lock:
            self.stats.local_items += len(plan.ops)

    @abstractmethod
    def _read_remote(self, peer: str, plan: _BatchPlan, statuses: list[Status], deadline: float) -> None:
        """Move ``plan``'s items from ``peer``; set ``statuses[plan.index[k]]`` for each."""

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    # -- lifetime -------------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Stop serving and close every channel. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
