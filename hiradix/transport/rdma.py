"""The RDMA transport: one-sided RDMA READ over RC queue pairs, behind the transport seam.

Every node runs the same authenticated TCP bootstrap as the TCP transport
(:class:`~hiradix.net.listener.AuthListener`, cluster-token handshake in the context
``b"rdma"``). A reader opens a *channel* to a peer by dialing it, creating an RC queue pair,
and trading queue-pair descriptions ``(qp_num, psn, lid, gid, mtu)`` with the responder, which
creates and connects its own queue pair and answers with the table of regions it publishes.
From then on bytes move by RDMA READ: the responder's CPU runs no code per read; the TCP
connection stays open as the channel's control line (region-table refreshes, queue-pair
resets) and its end tells the responder to destroy its queue pair.

Control messages (little-endian; ``kind u32, length u32`` then the body)::

    HELLO     reader -> responder  DESC                          open a channel
    WELCOME   responder -> reader  DESC + TABLE
    TABLE_REQ reader -> responder  (empty)                       refresh the region table
    TABLE     responder -> reader  TABLE
    RESET     reader -> responder  DESC                          both QPs back to RTS
    RESET_OK  responder -> reader  DESC
    DESC  = qp_num u32, psn u32, lid u16, gid 16 bytes, mtu u8    27 bytes
    TABLE = count u32 + count * (addr u64, rkey u32, length u64)

Semantics the conformance suite checks, mapped onto verbs:

- The reader checks every item against the peer's published table before posting (so a
  wrong rkey is ``BAD_RKEY`` and a range outside its region ``OUT_OF_BOUNDS``, one batch
  refresh of the table first when an rkey is unknown); an item the peer's NIC still refuses
  (``REM_ACCESS_ERR``: the region was deregistered since) is ``BAD_RKEY``.
- Only the regions :meth:`register` is given are registered with the NIC: the published
  pool (remote READ allowed) and the receive region (``remote=False``: local write only,
  so the NIC itself refuses peers).
- Flow control: at most ``qp_depth`` READs are outstanding on a queue pair (the send
  queue's size), and a queue pair is leased by one reader at a time; at most
  ``max_channels_per_peer`` exist per peer (:class:`~hiradix.transport.base.ChannelPool`).
- Errors: a remote access error leaves the rest of the chain flushed; the queue pair is
  reset (RESET -> INIT -> RTR -> RTS on both ends, over the control line) and the rest is
  posted again. Any other error (retry budget exhausted, a fault, a timeout) discards the
  channel; the next read opens a new one.
- ``deregister`` deregisters the NIC region, which returns once the NIC no longer touches
  it, after the reads landing in it locally have finished.

The verbs calls go through a *provider*: :class:`NativeVerbs` (the compiled libibverbs
binding, :mod:`hiradix.transport._verbs`) or :class:`~hiradix.transport.fake.FakeVerbs`
(fake HCAs on a :class:`~hiradix.transport.fake.FakeFabric`), so the logic here is tested
on machines with no RDMA device.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from hiradix._native import load, pure_python
from hiradix.net.address import parse_peer
from hiradix.net.auth import AuthError, load_token
from hiradix.net.listener import AuthListener, ListenerStats, dial, hang_up, set_recv_timeout, still_open
from hiradix.net.pool import ChannelPool
from hiradix.transport.base import (
    BatchPlan,
    Capabilities,
    Region,
    RegionBusyError,
    ResponderHook,
    Status,
    Transport,
    TransportError,
    buffer_span,
    check_remote,
)

__all__ = [
    "CAUSE_CHANNEL",
    "CAUSE_NONE",
    "CAUSE_REMOTE_ACCESS",
    "CAUSE_TIMEOUT",
    "NativeVerbs",
    "QpDesc",
    "RdmaTransport",
    "RdmaUnavailableError",
    "VerbsProvider",
    "rdma_unavailable_reason",
]

_AUTH_CONTEXT = b"rdma"
SYSFS_IB = Path("/sys/class/infiniband")

#: Why a provider's ``read_batch`` stopped early (the values of ``_verbs.CAUSE_*``).
CAUSE_NONE, CAUSE_REMOTE_ACCESS, CAUSE_CHANNEL, CAUSE_TIMEOUT = 0, 1, 2, 3

_HDR = struct.Struct("<II")
_DESC = struct.Struct("<IIH16sB")
_TABLE_ITEM = np.dtype([("addr", "<u8"), ("rkey", "<u4"), ("length", "<u8")])
HELLO, WELCOME, TABLE_REQ, TABLE, RESET, RESET_OK = 1, 2, 3, 4, 5, 6
_MAX_BODY = 64 << 20  # a control message larger than this is a protocol error
_IDLE_CHECK = 0.01  # as in the TCP transport: peek at a pooled channel idle this long


class RdmaUnavailableError(TransportError):
    """No usable RDMA device (or no verbs binding); the message says which."""


def rdma_unavailable_reason(sysfs: str | Path = SYSFS_IB) -> str | None:
    """``None`` when RDMA can be used here: the verbs binding is built and ``sysfs`` lists
    a device with an ACTIVE port; otherwise why not, in words.

    Runtime complexity: ``O(devices * ports)`` small file reads.
    """
    if pure_python():
        return "HIRADIX_PUREPYTHON is set: the compiled verbs binding is not used"
    try:
        import hiradix.transport._verbs  # noqa: F401
    except ImportError as exc:
        if "No module named" in str(exc):
            return "hiradix was built without libibverbs headers (apt-get install libibverbs-dev, then rebuild)"
        return f"the verbs binding does not load: {exc}"
    root = Path(sysfs)
    if not root.is_dir():
        return f"no RDMA device: {root} does not exist (no RDMA support in this kernel)"
    devices = sorted(p.name for p in root.iterdir())
    if not devices:
        return f"no RDMA device: {root} is empty"
    states = []
    for dev in devices:
        for port in sorted((root / dev / "ports").glob("*")):
            try:
                state = (port / "state").read_text().strip()
            except OSError:
                continue
            if "ACTIVE" in state.upper():
                return None
            states.append(f"{dev}/{port.name}: {state}")
    return f"no ACTIVE RDMA port ({', '.join(states) or 'no ports listed'})"


@dataclass(frozen=True, slots=True)
class QpDesc:
    """What one end tells the other to connect an RC queue pair to it."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes
    mtu: int

    def pack(self) -> bytes:
        return _DESC.pack(self.qp_num, self.psn, self.lid, self.gid, self.mtu)

    @classmethod
    def unpack(cls, body: bytes) -> QpDesc:
        if len(body) != _DESC.size:
            raise ConnectionError(f"bad queue-pair description ({len(body)} bytes)")
        return cls(*_DESC.unpack(body))


class VerbsQp(Protocol):
    """An RC queue pair with its own completion queue (``_verbs.QueuePair`` or
    :class:`~hiradix.transport.fake.FakeQp`)."""

    depth: int
    state: int

    def desc(self) -> tuple[int, int, int, bytes, int]: ...
    def connect(self, qp_num: int, psn: int, lid: int, gid: bytes, mtu: int) -> None: ...
    def reset(self, psn: int) -> None: ...
    def read_batch(
        self,
        laddr: np.ndarray,
        raddr: np.ndarray,
        length: np.ndarray,
        rkey: np.ndarray,
        lkey: np.ndarray,
        status: np.ndarray,
        signal_every: int,
        timeout: float,
    ) -> tuple[int, int]: ...
    def close(self) -> None: ...


class VerbsMr(Protocol):
    lkey: int
    rkey: int

    def dereg(self, timeout: float | None = None) -> None: ...


class VerbsDevice(Protocol):
    name: str

    def reg_mr(self, owner: memoryview, addr: int, length: int, remote: bool) -> VerbsMr: ...
    def create_qp(self, depth: int, psn: int) -> VerbsQp: ...
    def close(self) -> None: ...


class VerbsProvider(Protocol):
    """Opens devices: :class:`NativeVerbs` or :class:`~hiradix.transport.fake.FakeVerbs`."""

    kind: str

    def unavailable_reason(self) -> str | None: ...
    def open(
        self, name: str | None, ib_port: int, gid_index: int, responder_hook: Callable[[], ResponderHook | None]
    ) -> VerbsDevice: ...


class NativeVerbs:
    """The real provider: libibverbs through :mod:`hiradix.transport._verbs`."""

    kind = "native"

    def __init__(self, sysfs: str | Path = SYSFS_IB) -> None:
        self.sysfs = Path(sysfs)

    def unavailable_reason(self) -> str | None:
        return rdma_unavailable_reason(self.sysfs)

    def open(
        self, name: str | None, ib_port: int, gid_index: int, responder_hook: Callable[[], ResponderHook | None]
    ) -> VerbsDevice:
        """Open device ``name`` (the first when ``None``) on ``ib_port``; the responder
        hook is not used (a one-sided READ runs no responder code)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise RdmaUnavailableError(reason)
        verbs: Any = load("hiradix.transport._verbs")
        try:
            dev = verbs.Device(name, ib_port, gid_index)
        except OSError as exc:
            raise RdmaUnavailableError(f"cannot open RDMA device {name or '(first)'}: {exc}") from exc
        if not dev.port_active:
            dev.close()
            raise RdmaUnavailableError(f"RDMA device {dev.name} port {ib_port} is not ACTIVE")
        return dev  # type: ignore[no-any-return]


class _PeerTable:
    """A peer's published regions as the reader last saw them (sorted by rkey)."""

    __slots__ = ("bases", "lengths", "rkeys")

    def __init__(self, items: np.ndarray) -> None:
        order = np.argsort(items["rkey"], kind="stable")
        self.rkeys = np.ascontiguousarray(items["rkey"][order], dtype=np.uint32)
        self.bases = np.ascontiguousarray(items["addr"][order], dtype=np.uint64)
        self.lengths = np.ascontiguousarray(items["length"][order], dtype=np.uint64)

    def check(self, addr: np.ndarray, length: np.ndarray, rkey: np.ndarray) -> np.ndarray:
        if not self.rkeys.size:
            return np.full(len(addr), Status.BAD_RKEY, dtype=np.uint8)
        return check_remote(self.rkeys, self.bases, self.lengths, addr, length, rkey)[0]


def _send(sock: socket.socket, kind: int, body: bytes = b"") -> None:
    sock.sendall(_HDR.pack(kind, len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the control line")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket, expect: int | None = None) -> tuple[int, bytes]:
    kind, n = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if n > _MAX_BODY or (expect is not None and kind != expect):
        raise ConnectionError(f"unexpected control message {kind} ({n} bytes)")
    return kind, _recv_exact(sock, n) if n else b""


def _unpack_table(body: bytes) -> np.ndarray:
    if len(body) < 4:
        raise ConnectionError("truncated region table")
    (count,) = struct.unpack_from("<I", body)
    if len(body) != 4 + count * _TABLE_ITEM.itemsize:
        raise ConnectionError("region table size does not match its count")
    return np.frombuffer(body, dtype=_TABLE_ITEM, count=count, offset=4)


class _Channel:
    """One reader queue pair to a peer and its control line."""

    __slots__ = ("idle_since", "qp", "sock", "used")

    def __init__(self, sock: socket.socket, qp: VerbsQp) -> None:
        self.sock = sock
        self.qp = qp
        self.used = False
        self.idle_since = 0.0


@dataclass(eq=False)
class _Mr:
    mr: VerbsMr
    start: int
    end: int
    remote: bool
    in_table: bool = True  # still in the transport's RegionTable


class RdmaTransport(Transport):
    """One-sided RDMA READ over RC queue pairs; see the module docstring.

    Parameters
    ----------
    token, host, port, max_channels_per_peer, channels_per_read, timeout,
    handshake_timeout, idle_timeout, send_timeout, max_connections:
        As :class:`~hiradix.transport.tcp.TcpTransport` (the bootstrap listener and the
        channel pool); ``channels_per_read`` queue pairs share one batch.
    device:
        RDMA device name (``None``: the first one).
    ib_port, gid_index:
        Port and GID table index used for addressing (RoCE needs the right GID index).
    qp_depth:
        Send-queue depth: READs outstanding per queue pair at most (capped by the device).
    signal_every:
        Request a completion every this many READs (and for the last of each post).
    provider:
        :class:`NativeVerbs` (default) or :class:`~hiradix.transport.fake.FakeVerbs`.
    clock:
        Deadline clock (the fake fabric's clock with the fake provider).

    Raises :class:`RdmaUnavailableError` when the provider has no usable device.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="rdma", one_sided=True, releases_gil=True, zero_copy_receive=True
    )

    def __init__(
        self,
        token: bytes | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_channels_per_peer: int = 16,
        channels_per_read: int = 2,
        timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        send_timeout: float = 30.0,
        max_connections: int = 1024,
        device: str | None = None,
        ib_port: int = 1,
        gid_index: int = 0,
        qp_depth: int = 256,
        signal_every: int = 16,
        provider: VerbsProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_channels_per_peer=max_channels_per_peer, timeout=timeout, clock=clock)
        for name, v in (
            ("channels_per_read", channels_per_read),
            ("qp_depth", qp_depth),
            ("signal_every", signal_every),
            ("max_connections", max_connections),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self._provider: VerbsProvider = provider if provider is not None else NativeVerbs()
        reason = self._provider.unavailable_reason()
        if reason is not None:
            raise RdmaUnavailableError(f"RDMA transport unavailable: {reason}")
        self._token = load_token(token)
        self.channels_per_read = min(channels_per_read, max_channels_per_peer)
        self.qp_depth = qp_depth
        self.signal_every = signal_every
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        #: Queue pairs reset in place after a remote access error.
        self.qp_resets = 0
        self._device = self._provider.open(device, ib_port, gid_index, lambda: self.responder_hook)
        self._mr_lock = threading.Lock()
        self._mrs: dict[int, _Mr] = {}
        self._lkey_index: tuple[np.ndarray, np.ndarray] | None = None
        self._tables: dict[str, _PeerTable] = {}
        self._tables_lock = threading.Lock()
        self._serving: set[VerbsQp] = set()
        self._serving_lock = threading.Lock()
        self._pool: ChannelPool[_Channel] = ChannelPool(
            self._connect, self._close_channel, max_channels_per_peer, TransportError
        )
        self._executor: ThreadPoolExecutor | None = None
        self._exec_lock = threading.Lock()
        try:
            self._listener = AuthListener(
                self._serve,
                self._token,
                _AUTH_CONTEXT,
                host=host,
                port=port,
                max_connections=max_connections,
                handshake_timeout=handshake_timeout,
                name="rdma",
            )
        except BaseException:
            self._device.close()
            raise
        self._closed = self._listener.closed
        self._address = self._listener.address

    @property
    def address(self) -> str:
        return self._address

    @property
    def listener_stats(self) -> ListenerStats:
        """The bootstrap listener's counters."""
        return self._listener.stats

    # -- regions --------------------------------------------------------------------------
    def register(self, buffer: Any, *, remote: bool = True) -> Region:
        """Register ``buffer`` with the NIC (remote READ allowed only when ``remote``) and
        in the region table under the NIC's rkey. ``O(pages)`` in the kernel plus the
        table's ``O(n log n)``."""
        addr, view = buffer_span(buffer)
        mr = self._device.reg_mr(view, addr, view.nbytes, remote)
        try:
            region = self.regions.add(addr, view, remote, rkey=mr.rkey)
        except BaseException:
            mr.dereg(None)
            raise
        with self._mr_lock:
            self._mrs[region.rkey] = _Mr(mr, addr, addr + view.nbytes, remote)
            self._lkey_index = None
        return region

    def deregister(self, rkey: int, timeout: float | None = None) -> None:
        """Unpublish ``rkey``; wait for reads landing in it here, then deregister it with
        the NIC (which returns once no READ touches it). :class:`RegionBusyError` when
        ``timeout`` passes first; a later call finishes the job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mr_lock:
            entry = self._mrs.get(rkey)
        if entry is None:
            raise KeyError(f"rkey {rkey:#x} is not registered")
        if entry.in_table:
            self.regions.remove(rkey, timeout)
            entry.in_table = False  # no longer in the published table either
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        entry.mr.dereg(left)  # RegionBusyError from a fake HCA with READs in flight
        with self._mr_lock:
            self._mrs.pop(rkey, None)
            self._lkey_index = None

    def _published(self) -> bytes:
        """The TABLE body: the regions peers may read."""
        with self._mr_lock:
            rows = [(e.start, rkey, e.end - e.start) for rkey, e in self._mrs.items() if e.in_table and e.remote]
        items = np.array(rows, dtype=_TABLE_ITEM)
        return struct.pack("<I", len(rows)) + items.tobytes()

    def _lkeys(self, laddr: np.ndarray) -> np.ndarray:
        """The lkey of the region each destination lies in (destinations are checked
        and pinned already by the base class)."""
        with self._mr_lock:
            if self._lkey_index is None:
                rows = sorted((e.start, e.mr.lkey) for e in self._mrs.values())
                starts = np.array([r[0] for r in rows], dtype=np.uint64)
                keys = np.array([r[1] for r in rows], dtype=np.uint32)
                self._lkey_index = (starts, keys)
            starts, keys = self._lkey_index
        i = np.maximum(np.searchsorted(starts, laddr, side="right").astype(np.int64) - 1, 0)
        return np.ascontiguousarray(keys[i])

    # -- responder ------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One reader's control line: connect a queue pair to it, then answer table
        requests and resets until it hangs up; the queue pair dies with the line."""
        conn.settimeout(self.handshake_timeout)
        _, body = _recv(conn, HELLO)
        peer = QpDesc.unpack(body)
        qp = self._device.create_qp(self.qp_depth, secrets.randbits(24))
        with self._serving_lock:
            self._serving.add(qp)
        try:
            qp.connect(peer.qp_num, peer.psn, peer.lid, peer.gid, peer.mtu)
            _send(conn, WELCOME, QpDesc(*qp.desc()).pack() + self._published())
            conn.settimeout(None)
            set_recv_timeout(conn, self.idle_timeout)
            while not self._closed.is_set():
                try:
                    kind, body = _recv(conn)
                except ConnectionError:
                    return
                if kind == TABLE_REQ:
                    _send(conn, TABLE, self._published())
                elif kind == RESET:
                    peer = QpDesc.unpack(body)
                    qp.reset(secrets.randbits(24))
                    qp.connect(peer.qp_num, peer.psn, peer.lid, peer.gid, peer.mtu)
                    _send(conn, RESET_OK, QpDesc(*qp.desc()).pack())
                else:
                    return  # protocol error: the line cannot be trusted
        finally:
            with self._serving_lock:
                self._serving.discard(qp)
            qp.close()

    # -- reader ---------------------------------------------------------------------------
    def _connect(self, peer: str, timeout: float | None) -> _Channel:
        host, port = parse_peer(peer)
        limit = self.handshake_timeout if timeout is None else min(timeout, self.handshake_timeout)
        sock = dial(host, port, self._token, _AUTH_CONTEXT, limit)
        qp: VerbsQp | None = None
        try:
            qp = self._device.create_qp(self.qp_depth, secrets.randbits(24))
            _send(sock, HELLO, QpDesc(*qp.desc()).pack())
            _, body = _recv(sock, WELCOME)
            remote = QpDesc.unpack(body[: _DESC.size])
            self._set_table(peer, _unpack_table(body[_DESC.size :]))
            qp.connect(remote.qp_num, remote.psn, remote.lid, remote.gid, remote.mtu)
            sock.settimeout(None)
        except BaseException:
            if qp is not None:
                qp.close()
            hang_up(sock)
            raise
        return _Channel(sock, qp)

    @staticmethod
    def _close_channel(ch: _Channel) -> None:
        ch.qp.close()
        hang_up(ch.sock)

    def _set_table(self, peer: str, items: np.ndarray) -> _PeerTable:
        table = _PeerTable(items)
        with self._tables_lock:
            self._tables[peer] = table
        return table

    def _refresh(self, peer: str, ch: _Channel, deadline: float) -> _PeerTable:
        ch.sock.settimeout(max(deadline - self.clock(), 0.001))
        try:
            _send(ch.sock, TABLE_REQ)
            _, body = _recv(ch.sock, TABLE)
        finally:
            ch.sock.settimeout(None)
        return self._set_table(peer, _unpack_table(body))

    def _reset_qp(self, ch: _Channel, deadline: float) -> None:
        """Both ends back to RTS after an error (RESET -> INIT -> RTR -> RTS)."""
        ch.qp.reset(secrets.randbits(24))
        ch.sock.settimeout(max(deadline - self.clock(), 0.001))
        try:
            _send(ch.sock, RESET, QpDesc(*ch.qp.desc()).pack())
            _, body = _recv(ch.sock, RESET_OK)
        finally:
            ch.sock.settimeout(None)
        remote = QpDesc.unpack(body)
        ch.qp.connect(remote.qp_num, remote.psn, remote.lid, remote.gid, remote.mtu)
        self.qp_resets += 1

    def _lease_live(self, peer: str, deadline: float) -> _Channel:
        while True:
            ch = self._pool.lease(peer, max(deadline - self.clock(), 0.0))
            if not ch.used or time.monotonic() - ch.idle_since < _IDLE_CHECK or still_open(ch.sock):
                return ch
            self._pool.give_back(peer, ch, False)

    def _read_remote(self, peer: str, plan: BatchPlan, status: np.ndarray, deadline: float) -> None:
        n = len(plan)
        n_ch = min(self.channels_per_read, max(1, n // self.qp_depth))
        cuts = [i * n // n_ch for i in range(n_ch)] + [n]
        if n_ch == 1:
            self._run_channel(peer, plan, 0, n, status, deadline)
        else:
            ex = self._get_executor()
            futs = [
                ex.submit(self._run_channel, peer, plan, cuts[i], cuts[i + 1], status, deadline) for i in range(1, n_ch)
            ]
            try:
                self._run_channel(peer, plan, cuts[0], cuts[1], status, deadline)
            finally:
                wait(futs)  # no queue pair may still write into the destinations
            for f in futs:
                f.result()
        self._count(remote_items=n)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._exec_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=4 * self.max_channels_per_peer, thread_name_prefix="rdma-read"
                )
            return self._executor

    def _run_channel(self, peer: str, plan: BatchPlan, a: int, b: int, status: np.ndarray, deadline: float) -> None:
        """Items ``a..b-1`` of ``plan`` over one leased queue pair."""
        index = plan.index[a:b]
        try:
            ch = self._lease_live(peer, deadline)
        except TimeoutError:
            status[index] = Status.TIMEOUT
            return
        except (OSError, AuthError, ValueError):
            status[index] = Status.PEER_UNREACHABLE
            return
        ok = False
        try:
            ok = self._post(peer, ch, plan, a, b, status, deadline)
        except (OSError, ValueError):
            pass  # the control line broke (a refresh, a reset): the rest stays CHANNEL_ERROR
        finally:
            if ok:
                ch.used = True
                ch.idle_since = time.monotonic()
            self._pool.give_back(peer, ch, ok)
            with self._stats_lock:
                self.stats.channels_opened = self._pool.opened
                self.stats.channels_discarded = self._pool.discarded

    def _post(
        self, peer: str, ch: _Channel, plan: BatchPlan, a: int, b: int, status: np.ndarray, deadline: float
    ) -> bool:
        """The state machine of one share: check against the peer's table, post, map the
        outcome, reset the QP and go on after a remote access error. Whether the channel
        may be reused."""
        index = plan.index[a:b]
        raddr, rkey, length, laddr = plan.raddr[a:b], plan.rkey[a:b], plan.length[a:b], plan.laddr[a:b]
        status[index] = Status.CHANNEL_ERROR  # until proven otherwise
        with self._tables_lock:
            table = self._tables.get(peer)
        pre = table.check(raddr, length, rkey) if table is not None else None
        if pre is None or (pre == Status.BAD_RKEY).any():
            table = self._refresh(peer, ch, deadline)  # a region published since we looked
            pre = table.check(raddr, length, rkey)
        refused = pre != Status.OK
        status[index[refused]] = pre[refused]
        sel = np.flatnonzero(~refused)
        if not sel.size:
            return True
        cols = (laddr[sel], raddr[sel], length[sel], rkey[sel])
        lkey = self._lkeys(cols[0])
        got = np.empty(sel.size, dtype=np.uint8)
        start = 0
        while start < sel.size:
            remaining = deadline - self.clock()
            if remaining <= 0:
                status[index[sel[start:]]] = Status.TIMEOUT
                return False
            part = got[start:]
            first_bad, cause = ch.qp.read_batch(
                cols[0][start:],
                cols[1][start:],
                cols[2][start:],
                cols[3][start:],
                lkey[start:],
                part,
                self.signal_every,
                remaining,
            )
            status[index[sel[start:]]] = part
            if cause == CAUSE_NONE:
                return True
            if cause != CAUSE_REMOTE_ACCESS:
                return False  # retry budget, fault or timeout: the channel is discarded
            # The peer's NIC refused one item (its region went away): the rest was
            # flushed. Reset both queue pairs and post the rest again.
            with self._tables_lock:
                self._tables.pop(peer, None)
            self._reset_qp(ch, deadline)
            start += first_bad + 1
        return True

    def open_channels(self, peer: str) -> int:
        """Queue pairs currently open from this node to ``peer``."""
        return self._pool.open_count(peer)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving, destroy every queue pair, deregister every region, close the
        device. Idempotent."""
        if self._closed.is_set():
            return
        self._listener.close()
        self._pool.close()
        with self._exec_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
        with self._serving_lock:
            serving = list(self._serving)
        for qp in serving:
            qp.close()
        with self._mr_lock:
            mrs = list(self._mrs.values())
            self._mrs.clear()
        for e in mrs:
            with contextlib.suppress(OSError, RegionBusyError):
                e.mr.dereg(0.0)
        self._device.close()
