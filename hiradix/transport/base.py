"""The transport seam: registered regions, one-sided batched READ, per-peer channel pools.

A node *registers* host buffers and gets back a :class:`Region` ``(addr, rkey, length)``
that it can publish. Another node reads bytes out of that region with
:meth:`Transport.read_batch`, which moves every item straight into a local destination
that must itself lie inside a region registered on the reader (the receive buffer), the
way an RDMA READ needs both an ``rkey`` on the remote side and an ``lkey`` on the local one.

Every transport (TCP, the fake NIC, later libibverbs) implements the same contract and
runs the same conformance suite (``tests/transport/test_conformance.py``). What a
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
import ctypes
import enum
import operator
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from hiradix.net.address import with_host

__all__ = [
    "MAX_ITEM_BYTES",
    "BatchPlan",
    "Capabilities",
    "InjectedFault",
    "Pins",
    "ReadOp",
    "Region",
    "RegionBusyError",
    "RegionTable",
    "Status",
    "Transport",
    "TransportError",
    "TransportSettings",
    "TransportStats",
    "TransportUnavailable",
    "buffer_span",
    "check_remote",
    "view_at",
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


@dataclass(frozen=True)
class TransportSettings:
    """The settings a peer node gives its socket transport (:class:`~hiradix.transport.tcp.TcpTransport`,
    or ``RdmaTransport``, whose bootstrap is the same authenticated listener); the defaults
    are the transports' own. The in-process fake NIC takes only the channel cap and the
    read timeout (:meth:`channel_kwargs`).

    >>> TransportSettings(port=7000).socket_kwargs()["port"], TransportSettings().channel_kwargs()
    (7000, {'max_channels_per_peer': 16, 'timeout': 5.0})
    """

    #: Where the responder (or the RDMA bootstrap) listens.
    host: str = "127.0.0.1"
    port: int = 0
    #: Channels this node opens to one peer at most, and seconds a batch READ waits.
    max_channels_per_peer: int = 16
    timeout: float = 5.0
    #: Seconds a connection's handshake may take; connections served at once; seconds an
    #: idle connection is kept.
    handshake_timeout: float = 5.0
    max_connections: int = 1024
    idle_timeout: float = 300.0

    def channel_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every transport takes (:class:`Transport`)."""
        return {"max_channels_per_peer": self.max_channels_per_peer, "timeout": self.timeout}

    def socket_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a socket transport (TCP, RDMA), all of these settings."""
        return {
            "host": self.host,
            "port": self.port,
            "max_channels_per_peer": self.max_channels_per_peer,
            "timeout": self.timeout,
            "handshake_timeout": self.handshake_timeout,
            "max_connections": self.max_connections,
            "idle_timeout": self.idle_timeout,
        }


class TransportError(Exception):
    """Base class of transport errors raised to callers (not per-item statuses)."""


class TransportUnavailable(TransportError, ValueError):
    """The configured transport cannot run here (no RDMA port, no fake fabric...); the
    message names the transport and the reason. A ``ValueError`` too: it is a setting
    that does not fit this machine, reported as one."""


class RegionBusyError(TransportError):
    """``deregister`` timed out while reads were still in flight on the region."""


class InjectedFault(TransportError):
    """Raised by a test's responder hook to make the responder fail its channel."""


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


class Pins:
    """Reads marked in flight by :meth:`RegionTable.acquire_local` /
    :meth:`~RegionTable.acquire_remote`: ``(entry, count)`` pairs, one per region touched,
    handed back once to :meth:`RegionTable.release`."""

    __slots__ = ("_held",)

    def __init__(self, held: list[tuple[_Entry, int]] | None = None) -> None:
        self._held = held or []

    def __len__(self) -> int:
        return sum(c for _, c in self._held)


@dataclass
class _Index:
    """Sorted numpy columns over the live regions, rebuilt after each table change (rare);
    lookups of whole batches are then a few vectorized operations under the lock."""

    starts: np.ndarray  # uint64 region start addresses, ascending
    ends: np.ndarray  # uint64 region ends (exclusive), same order
    by_addr: list[_Entry]  # entries in address order
    rkeys: np.ndarray  # uint32 rkeys of the servable (remote, not dying) regions, ascending
    bases: np.ndarray  # uint64 their start addresses
    lengths: np.ndarray  # uint64 their lengths
    by_rkey: list[_Entry]  # entries in rkey order


def view_at(addr: int, n: int) -> memoryview:
    """A writable flat view of ``n`` bytes at the raw address ``addr``; the caller keeps
    the memory alive (a registered region marked in flight)."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


def _pin(entries: list[_Entry], which: np.ndarray) -> Pins:
    """Count one read in flight per position of ``which`` (indices into ``entries``)."""
    held: list[tuple[_Entry, int]] = []
    if which.size:
        counts = np.bincount(which, minlength=len(entries))
        for j in np.flatnonzero(counts).tolist():
            e = entries[j]
            c = int(counts[j])
            e.inflight += c
            held.append((e, c))
    return Pins(held)


def check_remote(
    rkeys: np.ndarray, bases: np.ndarray, lengths: np.ndarray, addr: np.ndarray, length: np.ndarray, rkey: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Check a batch against a table of servable regions (``rkeys`` ascending ``uint32``,
    their ``bases`` and ``lengths`` as ``uint64``, at least one): a ``uint8``
    :class:`Status` per item and the table position each item's rkey maps to. Used by the
    responder's table and by RDMA readers against a peer's published table.

    Runtime complexity: ``O(k log n)`` for ``k`` items and ``n`` regions, vectorized.
    """
    j = np.minimum(np.searchsorted(rkeys, rkey), rkeys.size - 1)
    found = rkeys[j] == rkey
    base = bases[j]
    size = lengths[j]
    with np.errstate(over="ignore"):
        inside = (addr >= base) & (length <= size) & (addr - base <= size - length)
    status = np.where(
        found,
        np.where(length > MAX_ITEM_BYTES, Status.INVALID, np.where(inside, Status.OK, Status.OUT_OF_BOUNDS)),
        Status.BAD_RKEY,
    ).astype(np.uint8)
    return status, j


class RegionTable:
    """The regions one transport has registered: rkey lookup for the responder, address
    lookup for local destinations, and in-flight counts for ``deregister``.

    All methods are thread-safe; each takes the table lock once, and the batch lookups
    run as vectorized numpy over a sorted index of the regions (no per-item Python).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._by_rkey: dict[int, _Entry] = {}
        self._starts: list[int] = []  # sorted region start addresses
        self._by_start: dict[int, _Entry] = {}
        self._index: _Index | None = None

    def add(self, addr: int, view: memoryview, remote: bool = True, rkey: int | None = None) -> Region:
        """Register ``view`` (which starts at ``addr``) under a fresh random 32-bit rkey, or
        under ``rkey`` when given (a NIC's memory region key; ``ValueError`` if taken).
        ``remote=False`` makes it a local receive region: a destination for reads only,
        whose rkey (a handle for :meth:`remove`) the responder never serves.

        Runtime complexity: ``O(n log n)`` in the number of regions (index rebuild).
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
            if rkey is not None:
                if not 0 <= rkey < 1 << 32 or rkey in self._by_rkey:
                    raise ValueError(f"rkey {rkey!r} is out of range or already registered")
            else:
                rkey = 0
                while rkey == 0 or rkey in self._by_rkey:
                    rkey = secrets.randbits(32)
            entry = _Entry(Region(addr, rkey, n), view)
            entry.remote = remote
            self._by_rkey[rkey] = entry
            self._starts.insert(i, addr)
            self._by_start[addr] = entry
            self._index = None
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
            self._index = None
            if not self._idle.wait_for(lambda: entry.inflight == 0, timeout):
                raise RegionBusyError(f"{entry.inflight} reads still in flight on rkey {rkey:#x}")
            del self._by_rkey[rkey]
            start = entry.region.addr
            del self._by_start[start]
            self._starts.pop(bisect.bisect_left(self._starts, start))

    def _current(self) -> _Index:
        """The index of the live regions (caller holds the lock)."""
        if self._index is None:
            live = [self._by_start[a] for a in self._starts if not self._by_start[a].dying]
            served = sorted((e for e in live if e.remote), key=lambda e: e.region.rkey)
            u64 = np.uint64
            self._index = _Index(
                starts=np.array([e.region.addr for e in live], dtype=u64),
                ends=np.array([e.region.addr + e.region.length for e in live], dtype=u64),
                by_addr=live,
                rkeys=np.array([e.region.rkey for e in served], dtype=np.uint32),
                bases=np.array([e.region.addr for e in served], dtype=u64),
                lengths=np.array([e.region.length for e in served], dtype=u64),
                by_rkey=served,
            )
        return self._index

    def acquire_remote(self, addr: np.ndarray, length: np.ndarray, rkey: np.ndarray) -> tuple[np.ndarray, Pins]:
        """The responder's check of a batch (``uint64``, ``uint64``, ``uint32`` arrays):
        a ``uint8`` :class:`Status` per item and the :class:`Pins` of the OK ones, which
        count as in flight until released. An unknown, dying or receive-only rkey is
        ``BAD_RKEY``; a length over :data:`MAX_ITEM_BYTES` is ``INVALID``;
        ``[addr, addr + length)`` not inside the region is ``OUT_OF_BOUNDS`` (checked on
        offsets, so no sum can overflow).

        Runtime complexity: ``O(k log n)`` for ``k`` items and ``n`` regions, vectorized.
        """
        with self._lock:
            ix = self._current()
            n = len(addr)
            if not ix.rkeys.size:
                return np.full(n, Status.BAD_RKEY, dtype=np.uint8), Pins()
            status, j = check_remote(ix.rkeys, ix.bases, ix.lengths, addr, length, rkey)
            return status, _pin(ix.by_rkey, j[status == Status.OK])

    def acquire_local(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, Pins]:
        """Which destinations ``[addr, addr + length)`` (``uint64`` arrays) lie inside one
        live local region: a boolean mask, and the :class:`Pins` of those that do.

        Runtime complexity: ``O(k log n)`` for ``k`` items and ``n`` regions, vectorized.
        """
        with self._lock:
            ix = self._current()
            if not ix.starts.size:
                return np.zeros(len(addr), dtype=bool), Pins()
            i = np.searchsorted(ix.starts, addr, side="right").astype(np.int64) - 1
            ic = np.maximum(i, 0)
            end = ix.ends[ic]
            with np.errstate(over="ignore"):
                ok = (i >= 0) & (addr <= end) & (length <= end - addr)
            return ok, _pin(ix.by_addr, ic[ok])

    def release(self, pins: Pins) -> None:
        """End the reads started by ``acquire_*``. Each :class:`Pins` is released once."""
        held, pins._held = pins._held, []
        if not held:
            return
        with self._lock:
            wake = False
            for e, c in held:
                e.inflight -= c
                wake = wake or (e.dying and e.inflight == 0)
            if wake:
                self._idle.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rkey)


ResponderHook = Callable[[Sequence[int]], None]


@dataclass
class BatchPlan:
    """The remote part of a batch, after the local checks: column arrays of its items and,
    in ``index``, each item's position in the caller's batch. Destinations are pinned."""

    index: np.ndarray  # int64 positions in the caller's batch
    raddr: np.ndarray  # uint64
    rkey: np.ndarray  # uint32
    length: np.ndarray  # uint64
    laddr: np.ndarray  # uint64
    #: ``on_landed(indices, statuses)`` for items whose bytes have landed (see
    #: :meth:`Transport.read_batch_arrays`); ``None`` when the caller did not ask.
    on_landed: Callable[[np.ndarray, np.ndarray], None] | None = None
    _ops: list[ReadOp] | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def ops(self) -> list[ReadOp]:
        """The items as :class:`ReadOp` tuples, for transports that post them one by one."""
        if self._ops is None:
            cols = (self.raddr.tolist(), self.rkey.tolist(), self.length.tolist(), self.laddr.tolist())
            self._ops = [ReadOp(*item) for item in zip(*cols, strict=True)]
        return self._ops


def _column(values: Any, dtype: type, name: str, n: int | None) -> np.ndarray:
    """``values`` as a contiguous 1-D array of ``dtype``; integers out of its range raise."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (n is not None and len(arr) != n):
        raise ValueError(f"{name} must be a 1-D array{'' if n is None else f' of {n} items'}")
    if arr.size and arr.dtype != dtype:
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        info = np.iinfo(dtype)
        if int(arr.min()) < 0 or int(arr.max()) > info.max:
            raise ValueError(f"{name} values must lie in [0, {info.max}]")
    return np.ascontiguousarray(arr, dtype=dtype)


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

    def advertised_address(self, host: str) -> str:
        """:attr:`address` as other nodes dial it when this node is reached at ``host``
        (a listener bound to a wildcard is never dialled at it): the same port at
        ``host``. Runtime complexity: ``O(1)``."""
        return with_host(self.address, host)

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

        ``ops`` items are ``(remote_addr, rkey, length, local_addr)``; an item whose values
        are out of range (negative, rkey over 32 bits, length over :data:`MAX_ITEM_BYTES`)
        is ``INVALID``. Same contract as :meth:`read_batch_arrays`, which this unpacks to.

        Runtime complexity: ``O(items + bytes)``.
        """
        n = len(ops)
        cols = np.zeros((4, n), dtype=np.uint64)
        bad = np.zeros(n, dtype=bool)
        for i, op in enumerate(ops):
            if len(op) != 4:
                raise ValueError(f"read item {i} must be (remote_addr, rkey, length, local_addr), got {op!r}")
            try:
                raddr, rkey, length, laddr = (operator.index(v) for v in op)
            except TypeError:
                raise TypeError(f"read item {i} must hold integers, got {op!r}") from None
            if not (
                0 <= length <= MAX_ITEM_BYTES and 0 <= raddr <= _U64 and 0 <= rkey < 1 << 32 and 0 <= laddr <= _U64
            ):
                bad[i] = True
                continue
            cols[0, i], cols[1, i], cols[2, i], cols[3, i] = raddr, rkey, length, laddr
        status = self.read_batch_arrays(peer, cols[0], cols[1].astype(np.uint32), cols[2], cols[3], timeout, _skip=bad)
        status[bad] = Status.INVALID
        return [Status(v) for v in status.tolist()]

    def read_batch_arrays(
        self,
        peer: str,
        raddr: Any,
        rkey: Any,
        length: Any,
        laddr: Any,
        timeout: float | None = None,
        *,
        on_landed: Callable[[np.ndarray, np.ndarray], None] | None = None,
        _skip: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`read_batch` over columns: item ``k`` copies ``length[k]`` bytes from
        ``raddr[k]`` in ``peer``'s region ``rkey[k]`` to the local address ``laddr[k]``.
        Returns a ``uint8`` array of :class:`Status` values, one per item.

        The batch path of the peer cache: no per-item Python anywhere (vectorized local
        checks, and on TCP one GIL-free call per channel). Bytes move without the GIL.
        ``peer == self.address`` degrades to ``memcpy``. Items after a channel failure
        report ``CHANNEL_ERROR`` (or ``TIMEOUT``); no item is half-reported as OK. A length
        over :data:`MAX_ITEM_BYTES` is ``INVALID``; a destination outside every local
        region is ``BAD_LOCAL`` and no byte is written.

        ``on_landed(indices, statuses)``, when given, is called once for every item, with
        the item's final status: as soon as a group of items has landed (on TCP one frame,
        from the channel's reader thread, while later frames are still on the wire, so the
        caller can check the bytes while they are in cache), and for the items not
        reported that way (failures, other transports) before this method returns. Calls
        may come from several threads at once, for disjoint items. An exception from it
        propagates out of this call.

        Raises ``ValueError`` for columns of different lengths or values out of their
        type's range (negative, rkey over 32 bits), ``TypeError`` for non-integer columns.

        Runtime complexity: ``O(items + bytes)``.
        """
        timeout = self.timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        deadline = self.clock() + timeout
        raddr = _column(raddr, np.uint64, "raddr", None)
        n = len(raddr)
        rkey = _column(rkey, np.uint32, "rkey", n)
        length = _column(length, np.uint64, "length", n)
        laddr = _column(laddr, np.uint64, "laddr", n)
        status = np.zeros(n, dtype=np.uint8)
        status[length > MAX_ITEM_BYTES] = Status.INVALID
        if _skip is not None:
            status[_skip] = Status.INVALID
        live = np.flatnonzero(status == Status.OK)
        landing, pins = self.regions.acquire_local(laddr[live], length[live])
        notify = None
        if on_landed is not None:
            reported = np.zeros(n, dtype=bool)

            def notify(idx: np.ndarray, st: np.ndarray) -> None:
                reported[idx] = True
                on_landed(idx, st)

        try:
            status[live[~landing]] = Status.BAD_LOCAL
            sel = live[landing]
            if sel.size:
                plan = BatchPlan(sel, raddr[sel], rkey[sel], length[sel], laddr[sel], on_landed=notify)
                if peer == self.address:
                    self._read_local(plan, status)
                else:
                    self._read_remote(peer, plan, status, deadline)
            if on_landed is not None:
                rest = np.flatnonzero(~reported)
                if rest.size:
                    on_landed(rest, status[rest])
        finally:
            self.regions.release(pins)
        return status

    def _read_local(self, plan: BatchPlan, status: np.ndarray) -> None:
        got, pins = self.regions.acquire_remote(plan.raddr, plan.length, plan.rkey)
        try:
            status[plan.index] = got
            for k in np.flatnonzero(got == Status.OK).tolist():
                # ctypes foreign calls release the GIL while memmove runs.
                ctypes.memmove(int(plan.laddr[k]), int(plan.raddr[k]), int(plan.length[k]))
        finally:
            self.regions.release(pins)
        self._count(local_items=len(plan))

    @abstractmethod
    def _read_remote(self, peer: str, plan: BatchPlan, status: np.ndarray, deadline: float) -> None:
        """Move ``plan``'s items from ``peer``; set ``status[plan.index[k]]`` for each."""

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
