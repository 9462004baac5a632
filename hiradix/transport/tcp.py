"""TCP transport with one-sided-READ semantics: every node runs a responder that serves
READ frames against its registered regions; readers pull into their own registered memory.

Wire format (little-endian, fixed-size ``struct`` headers, after the HMAC handshake of
:mod:`hiradix.net.auth` with context ``b"transport"``)::

    request   = REQ(magic u32, op u16, count u16, seq u32, reserved u32)        16 bytes
                + count * ITEM(addr u64, length u64, rkey u32, reserved u32)     24 bytes each
    response  = RESP(magic u32, op u16, count u16, seq u32, reserved u32, total u64)  24 bytes
                + count * status u8
                + the payloads of the items whose status is OK, in order (total bytes)

``count`` is at most :data:`MAX_ITEMS` and every length at most
:data:`~hiradix.transport.base.MAX_ITEM_BYTES`; anything else is a protocol error and the
connection is closed. The responder serves one frame at a time per connection, so a
connection has at most ``max_inflight_frames`` frames queued (the reader's window) plus
what TCP buffers.

The data plane is C (:mod:`hiradix.transport._tcpio`): a reader hands a channel's whole
share of a batch to one GIL-free call that sends its frames with a window in flight and
receives every payload straight into its destination (``recvmsg`` with an iovec per
item, no copy in user space); the responder checks a frame's items against its regions
in a few vectorized operations and answers with one GIL-free ``sendmsg`` loop whose iovec
points at the region's memory. Per frame the GIL is held for a few microseconds, per
item never. With ``HIRADIX_PUREPYTHON=1`` (or ``native=False``) the same bytes go through
``recvmsg_into``/``sendmsg`` from Python; the conformance suite runs over both.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, ClassVar

import numpy as np

from hiradix._native import load
from hiradix.net.address import parse_peer
from hiradix.net.auth import AuthError, load_token
from hiradix.net.listener import (
    AuthListener,
    ListenerStats,
    dial,
    hang_up,
    set_recv_timeout,
    set_send_timeout,
    still_open,
)
from hiradix.net.pool import ChannelPool
from hiradix.transport.base import (
    BatchPlan,
    Capabilities,
    InjectedFault,
    Status,
    Transport,
    TransportError,
    view_at,
)

__all__ = ["MAX_ITEMS", "TcpTransport"]

MAGIC = 0x58445248  # "HRDX"
OP_READ = 1
#: Most items in one frame (keeps an iovec under IOV_MAX = 1024).
MAX_ITEMS = 256
_AUTH_CONTEXT = b"transport"

_REQ = struct.Struct("<IHHII")
_ITEM = struct.Struct("<QQII")
_RESP = struct.Struct("<IHHIIQ")
_OK = int(Status.OK)
_IOV_BATCH = 512
_ITEM_DTYPE = np.dtype([("addr", "<u8"), ("length", "<u8"), ("rkey", "<u4"), ("reserved", "<u4")])
# Error codes of a channel run, as the compiled data plane reports them.
E_OK, E_TIMEOUT, E_CHANNEL = 0, 1, 2

_tcpio: Any = load("hiradix.transport._tcpio")


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; ``False`` on a clean EOF before the first byte, raise on a torn one."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-frame")
        got += k
    return True


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-receive into ``views`` (all non-empty) with ``recvmsg_into``."""
    i = 0
    n_views = len(views)
    while i < n_views:
        n = sock.recvmsg_into(views[i : i + _IOV_BATCH])[0]
        if n == 0:
            raise ConnectionError("peer closed mid-payload")
        while n:
            v = views[i]
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                views[i] = v[n:]
                n = 0


def _send_views(sock: socket.socket, views: list[memoryview | bytes]) -> None:
    """Gather-send all of ``views`` with ``sendmsg`` (handles partial sends)."""
    bufs = [memoryview(v) for v in views if len(v)]
    i = 0
    while i < len(bufs):
        n = sock.sendmsg(bufs[i : i + _IOV_BATCH])
        while n:
            v = bufs[i]
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                bufs[i] = v[n:]
                n = 0


def plan_frames(length: np.ndarray, max_items: int, frame_bytes: int) -> np.ndarray:
    """Frame boundaries: start index of each frame of at most ``max_items`` items and
    ``frame_bytes`` payload bytes, then ``len(length)`` (the Python twin of
    ``_tcpio.plan_frames``). Runtime complexity: ``O(n)``.

    >>> plan_frames(np.array([4, 4, 4, 9, 1], dtype=np.uint64), 2, 8).tolist()
    [0, 2, 3, 4, 5]
    """
    starts = []
    count = size = 0
    for k, n in enumerate(length.tolist()):
        if count and (count == max_items or size + n > frame_bytes):
            count = size = 0
        if count == 0:
            starts.append(k)
        count += 1
        size += n
    starts.append(len(length))
    return np.array(starts, dtype=np.int64)


def _send_requests_py(
    sock: socket.socket,
    raddr: np.ndarray,
    rkey: np.ndarray,
    length: np.ndarray,
    bounds: list[int],
    first: int,
    last: int,
    seq: int,
) -> None:
    """Frames ``first..last-1`` as one send; frame ``f`` carries sequence ``seq + f - first``
    (the twin of ``_tcpio._send_requests``)."""
    reqs = []
    for f in range(first, last):
        fa, fb = bounds[f], bounds[f + 1]
        reqs.append(_REQ.pack(MAGIC, OP_READ, fb - fa, (seq + f - first) & 0xFFFFFFFF, 0))
        items = np.zeros(fb - fa, dtype=_ITEM_DTYPE)
        items["addr"], items["length"], items["rkey"] = raddr[fa:fb], length[fa:fb], rkey[fa:fb]
        reqs.append(items.tobytes())
    sock.sendall(b"".join(reqs))


def _receive_frame_py(
    sock: socket.socket, hview: memoryview, lens: list[int], laddr: np.ndarray, a: int, b: int, seq: int
) -> bytes | None:
    """Receive the response to items ``a..b-1`` (sequence ``seq``) into their destinations;
    its status codes, or ``None`` when the stream is out of step with the requests (the
    twin of ``_tcpio._receive_frame``; socket errors propagate)."""
    view = hview[: _RESP.size + b - a]
    if not _recv_exact(sock, view):
        return None
    magic, op, r_count, r_seq, _, total = _RESP.unpack_from(view)
    if magic != MAGIC or op != OP_READ or r_count != b - a or r_seq != seq & 0xFFFFFFFF:
        return None
    codes = bytes(view[_RESP.size :])
    if max(codes) > int(Status.INVALID):
        return None
    ok = [k for k, c in zip(range(a, b), codes, strict=True) if c == _OK and lens[k]]
    if sum(lens[k] for k in ok) != total:
        return None
    _recv_views(sock, [view_at(int(laddr[k]), lens[k]) for k in ok])
    return codes


def read_frames_py(
    sock: socket.socket,
    raddr: np.ndarray,
    rkey: np.ndarray,
    length: np.ndarray,
    laddr: np.ndarray,
    starts: np.ndarray,
    window: int,
    seq: int,
    timeout: float,
    status: np.ndarray,
    on_frame: Callable[[int, int], None] | None = None,
) -> tuple[int, int, int]:
    """The Python twin of ``_tcpio.read_frames`` (same arguments, a socket for the fd,
    same wire bytes, same ``(frames_done, error, last_seq)``, same ``on_frame`` calls)."""
    stop = time.monotonic() + timeout
    n_frames = len(starts) - 1
    bounds = starts.tolist()
    lens = length.tolist()
    hview = memoryview(bytearray(_RESP.size + MAX_ITEMS))
    done = sent = 0
    while done < n_frames:
        a, b = bounds[done], bounds[done + 1]
        try:
            if sent < n_frames and sent - done < window:
                upto = min(n_frames, done + window)
                _send_requests_py(sock, raddr, rkey, length, bounds, sent, upto, seq + 1 + sent)
                sent = upto
            codes = _receive_frame_py(sock, hview, lens, laddr, a, b, seq + 1 + done)
        except (TimeoutError, BlockingIOError):
            return done, E_TIMEOUT, seq + done
        except (OSError, ValueError):
            return done, E_CHANNEL, seq + done
        if codes is None:
            return done, E_CHANNEL, seq + done
        # Only now, with every byte of the frame landed, do its items count.
        status[a:b] = np.frombuffer(codes, dtype=np.uint8)
        done += 1
        if on_frame is not None:
            on_frame(a, b)
        if done < n_frames and time.monotonic() > stop:
            return done, E_TIMEOUT, seq + done
    return done, E_OK, (seq + done) & 0xFFFFFFFF


#: A pooled channel idle at least this long (seconds) is peeked at before a batch goes
#: out on it (one syscall): the responder closes channels idle for its ``idle_timeout``
#: and a restart closes them all, and a batch sent on such a channel would come back as
#: CHANNEL_ERROR misses.
_IDLE_CHECK = 0.01


class _Channel:
    """One authenticated connection to a peer, used by one reader at a time."""

    __slots__ = ("idle_since", "seq", "sock", "used")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seq = 0
        self.used = False  # a batch completed on it: it comes from the pool, and may have died there
        self.idle_since = 0.0  # time.monotonic() when that batch completed


class TcpTransport(Transport):
    """The TCP transport: a responder on ``host:port`` plus pooled reader channels.

    Parameters
    ----------
    token:
        Cluster token (bytes/str); ``None`` reads ``$HIRADIX_CLUSTER_TOKEN``.
    host, port:
        Where the responder listens; loopback and an ephemeral port by default.
    max_channels_per_peer:
        Cap on connections this node opens to one peer.
    channels_per_read:
        Channels one ``read_batch`` spreads its frames over (at most the cap).
    max_inflight_frames:
        Frames a reader keeps queued on one channel.
    frame_bytes:
        Target payload bytes per frame (items are never split). 4 MiB: on loopback,
        1 MiB frames measured 25-30% slower (more responder round trips per byte).
    timeout:
        Default ``read_batch`` deadline (seconds); also bounds connect + handshake.
    handshake_timeout:
        Bound on connect + authentication, either side.
    idle_timeout:
        The responder closes a connection idle this long (counted in
        :attr:`listener_stats` ``.timed_out``).
    send_timeout:
        The responder drops a reader that accepts no bytes for this long.
    max_connections:
        Responder connections accepted at once; more are closed at accept (counted in
        :attr:`listener_stats` ``.refused``).
    native:
        Move bytes through the compiled data plane (the default when it is built);
        ``False`` uses the Python loops (same wire format; for tests and parity).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="tcp", one_sided=False, releases_gil=True, zero_copy_receive=True
    )

    def __init__(
        self,
        token: bytes | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_channels_per_peer: int = 16,
        channels_per_read: int = 2,
        max_inflight_frames: int = 4,
        frame_bytes: int = 4 << 20,
        timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        send_timeout: float = 30.0,
        max_connections: int = 1024,
        native: bool | None = None,
    ) -> None:
        super().__init__(max_channels_per_peer=max_channels_per_peer, timeout=timeout)
        for name, v in (
            ("channels_per_read", channels_per_read),
            ("max_inflight_frames", max_inflight_frames),
            ("frame_bytes", frame_bytes),
            ("max_connections", max_connections),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if native and _tcpio is None:
            raise RuntimeError("the compiled TCP data plane is not built (hiradix.transport._tcpio)")
        self._io = _tcpio if native is None else (_tcpio if native else None)
        self._token = load_token(token)
        self.channels_per_read = min(channels_per_read, max_channels_per_peer)
        self.max_inflight_frames = max_inflight_frames
        self.frame_bytes = frame_bytes
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        self.max_connections = max_connections
        self._pool: ChannelPool[_Channel] = ChannelPool(
            self._connect, self._close_channel, max_channels_per_peer, TransportError
        )
        self._executor: ThreadPoolExecutor | None = None
        self._exec_lock = threading.Lock()
        self._listener = AuthListener(
            self._serve,
            self._token,
            _AUTH_CONTEXT,
            host=host,
            port=port,
            max_connections=max_connections,
            handshake_timeout=handshake_timeout,
            name="tcp",
            quiet=(InjectedFault,),
        )
        self._closed = self._listener.closed
        self._address = self._listener.address

    @property
    def address(self) -> str:
        return self._address

    @property
    def listener_stats(self) -> ListenerStats:
        """The responder's accept loop counters: accepted, refused at the cap, accept
        errors, timeouts (idle channels included)."""
        return self._listener.stats

    # -- responder ------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One authenticated reader connection: READ frames in, payloads out. Any error
        closes it; the reader reports CHANNEL_ERROR."""
        conn.settimeout(None)
        # Idle channels may wait long for the next frame; a reader that stops draining
        # may hold a region in flight (and a deregister) only for send_timeout.
        set_recv_timeout(conn, self.idle_timeout)
        set_send_timeout(conn, self.send_timeout)
        hdr = bytearray(_REQ.size)
        hview = memoryview(hdr)
        body = bytearray(MAX_ITEMS * _ITEM.size)
        bview = memoryview(body)
        while not self._closed.is_set():
            if not _recv_exact(conn, hview):
                return
            magic, op, count, seq, _ = _REQ.unpack(hdr)
            if magic != MAGIC or op != OP_READ or not 0 < count <= MAX_ITEMS:
                return  # the stream cannot be trusted any more
            n = count * _ITEM.size
            if not _recv_exact(conn, bview[:n]):
                return
            self._serve_frame(conn, count, seq, bview[:n])

    def _serve_frame(self, conn: socket.socket, count: int, seq: int, body: memoryview) -> None:
        items = np.frombuffer(body, dtype=_ITEM_DTYPE, count=count)
        addr = np.ascontiguousarray(items["addr"])
        length = np.ascontiguousarray(items["length"])
        rkey = np.ascontiguousarray(items["rkey"])
        status, pins = self.regions.acquire_remote(addr, length, rkey)
        try:
            if self.responder_hook is not None:
                self.responder_hook(rkey.tolist())
            ok = status == _OK
            src, lens = addr[ok], length[ok]
            head = _RESP.pack(MAGIC, OP_READ, count, seq, 0, int(lens.sum())) + status.tobytes()
            if self._io is not None:
                rc = self._io.send_response(conn.fileno(), head, src, lens)
                if rc == E_TIMEOUT:
                    raise TimeoutError("reader stopped draining its channel")
                if rc != E_OK:
                    raise ConnectionError("reader channel broke")
            else:
                _send_views(
                    conn, [head, *(view_at(a, n) for a, n in zip(src.tolist(), lens.tolist(), strict=True) if n)]
                )
        finally:
            self.regions.release(pins)
        self._count(served_items=count)

    # -- reader ---------------------------------------------------------------------------
    def _connect(self, peer: str, timeout: float | None) -> _Channel:
        host, port = parse_peer(peer)
        limit = self.handshake_timeout if timeout is None else min(timeout, self.handshake_timeout)
        sock = dial(host, port, self._token, _AUTH_CONTEXT, limit)
        sock.settimeout(None)
        return _Channel(sock)

    @staticmethod
    def _close_channel(ch: _Channel) -> None:
        hang_up(ch.sock)

    def _read_remote(self, peer: str, plan: BatchPlan, status: np.ndarray, deadline: float) -> None:
        if self._io is not None:
            starts = self._io.plan_frames(plan.length, MAX_ITEMS, self.frame_bytes)
        else:
            starts = plan_frames(plan.length, MAX_ITEMS, self.frame_bytes)
        n_frames = len(starts) - 1
        n_ch = min(self.channels_per_read, n_frames)
        # Contiguous shares of frames keep each channel's items in address order.
        cuts = [starts[i * n_frames // n_ch] for i in range(n_ch)] + [len(plan)]
        shares = [(int(cuts[i]), int(cuts[i + 1])) for i in range(n_ch)]
        if n_ch == 1:
            self._run_channel(peer, plan, starts, 0, len(plan), status, deadline)
        else:
            ex = self._get_executor()
            futs = [ex.submit(self._run_channel, peer, plan, starts, a, b, status, deadline) for a, b in shares[1:]]
            try:
                self._run_channel(peer, plan, starts, *shares[0], status, deadline)
            finally:
                wait(futs)  # no channel may still write into the destinations once we return
            for f in futs:
                f.result()
        self._count(remote_items=len(plan))

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._exec_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=4 * self.max_channels_per_peer, thread_name_prefix="tcp-read"
                )
            return self._executor

    def _run_channel(
        self, peer: str, plan: BatchPlan, starts: np.ndarray, a: int, b: int, status: np.ndarray, deadline: float
    ) -> None:
        """Items ``a..b-1`` of ``plan`` (whole frames of ``starts``) over one leased channel."""
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
            remaining = deadline - self.clock()
            if remaining <= 0:
                status[index] = Status.TIMEOUT
                return
            set_recv_timeout(ch.sock, remaining)
            set_send_timeout(ch.sock, remaining)
            frames = starts[(starts >= a) & (starts <= b)] - a
            got = np.zeros(b - a, dtype=np.uint8)
            cols = (plan.raddr[a:b], plan.rkey[a:b], plan.length[a:b], plan.laddr[a:b])
            on_frame = None
            if plan.on_landed is not None:
                report = plan.on_landed

                def on_frame(x: int, y: int) -> None:
                    report(index[x:y], got[x:y])

            if self._io is not None:
                done, err, ch.seq = self._io.read_frames(
                    ch.sock.fileno(), *cols, frames, self.max_inflight_frames, ch.seq, remaining, got, on_frame
                )
            else:
                done, err, ch.seq = read_frames_py(
                    ch.sock, *cols, frames, self.max_inflight_frames, ch.seq, remaining, got, on_frame
                )
            landed = int(frames[done])
            status[index[:landed]] = got[:landed]
            if err != E_OK:
                status[index[landed:]] = Status.TIMEOUT if err == E_TIMEOUT else Status.CHANNEL_ERROR
            ok = err == E_OK
            if ok:
                ch.used = True
                ch.idle_since = time.monotonic()
        finally:
            self._pool.give_back(peer, ch, ok)
            self._sync_pool_stats()

    def _lease_live(self, peer: str, deadline: float) -> _Channel:
        """A channel to ``peer`` whose responder is still there: a pooled one that passes
        :func:`~hiradix.net.listener.still_open` (when idle ``_IDLE_CHECK`` or
        more), else a new one; each dead one is closed. Raises as ``ChannelPool.lease``."""
        while True:
            ch = self._pool.lease(peer, max(deadline - self.clock(), 0.0))
            if not ch.used or time.monotonic() - ch.idle_since < _IDLE_CHECK or still_open(ch.sock):
                return ch
            self._pool.give_back(peer, ch, False)

    def _sync_pool_stats(self) -> None:
        with self._stats_lock:
            self.stats.channels_opened = self._pool.opened
            self.stats.channels_discarded = self._pool.discarded

    def open_channels(self, peer: str) -> int:
        """Channels currently open from this node to ``peer``."""
        return self._pool.open_count(peer)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        self._listener.close()
        self._pool.close()
        with self._exec_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
