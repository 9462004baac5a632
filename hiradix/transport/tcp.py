"""TCP transport with one-sided-READ semantics: every node runs a responder that serves
READ frames against its registered regions; readers pull into their own registered memory.

Wire format (little-endian, fixed-size ``struct`` headers, after the HMAC handshake of
:mod:`hiradix.transport.auth` with context ``b"transport"``)::

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

Why it is fast without C: the reader sends a window of frames ahead (pipelining) over
several channels; the responder answers a frame with a *single* ``sendmsg`` whose iovec
points straight at the region's memory, and the reader receives a frame's payloads with
``recvmsg_into`` whose iovec points straight at the destinations. Both calls release the
GIL for the whole syscall and there is no intermediate copy in user space; per frame the
GIL is held only to parse up to 256 item headers.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

from hiradix.transport.auth import AuthError, load_token
from hiradix.transport.base import (
    MAX_ITEM_BYTES,
    Capabilities,
    ChannelPool,
    InjectedFault,
    Status,
    Transport,
    _BatchPlan,
    parse_peer,
)
from hiradix.transport.listener import AuthListener, dial, hang_up

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


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    # Kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket: one syscall per
    # recv/send. ``settimeout`` would add a poll() before each of them.
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


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


class _Channel:
    """One authenticated connection to a peer, used by one reader at a time."""

    __slots__ = ("seq", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seq = 0


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
        Target payload bytes per frame (items are never split).
    timeout:
        Default ``read_batch`` deadline (seconds); also bounds connect + handshake.
    handshake_timeout:
        Bound on connect + authentication, either side.
    idle_timeout:
        The responder closes a connection idle this long.
    send_timeout:
        The responder drops a reader that accepts no bytes for this long.
    max_connections:
        Responder connections accepted at once; more are closed at accept.
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
        frame_bytes: int = 1 << 20,
        timeout: float = 5.0,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        send_timeout: float = 30.0,
        max_connections: int = 1024,
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
        self._token = load_token(token)
        self.channels_per_read = min(channels_per_read, max_channels_per_peer)
        self.max_inflight_frames = max_inflight_frames
        self.frame_bytes = frame_bytes
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        self.max_connections = max_connections
        self._pool: ChannelPool[_Channel] = ChannelPool(self._connect, self._close_channel, max_channels_per_peer)
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

    # -- responder ------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One authenticated reader connection: READ frames in, payloads out. Any error
        closes it; the reader reports CHANNEL_ERROR."""
        conn.settimeout(None)
        # Idle channels may wait long for the next frame; a reader that stops draining
        # may hold a region in flight (and a deregister) only for send_timeout.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.idle_timeout))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.send_timeout))
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
        got = self.regions.acquire_remote((a, n, k) for a, n, k, _ in _ITEM.iter_unpack(body))
        try:
            if self.responder_hook is not None:
                self.responder_hook([k for _, _, k, _ in _ITEM.iter_unpack(body)])
            statuses = bytes([st for st, _, _ in got])
            views = [v for st, v, _ in got if st == _OK and v is not None]
            total = sum(len(v) for v in views)
            head = _RESP.pack(MAGIC, OP_READ, count, seq, 0, total) + statuses
            _send_views(conn, [head, *views])
        finally:
            self.regions.release(e for _, _, e in got)
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

    def _frames(self, plan: _BatchPlan) -> list[list[int]]:
        frames: list[list[int]] = []
        cur: list[int] = []
        size = 0
        for k, op in enumerate(plan.ops):
            if cur and (len(cur) == MAX_ITEMS or size + op.length > self.frame_bytes):
                frames.append(cur)
                cur, size = [], 0
            cur.append(k)
            size += op.length
        if cur:
            frames.append(cur)
        return frames

    def _read_remote(self, peer: str, plan: _BatchPlan, statuses: list[Status], deadline: float) -> None:
        frames = self._frames(plan)
        n_ch = min(self.channels_per_read, len(frames))
        # Contiguous shares keep each channel's frames in address order.
        shares = [frames[i * len(frames) // n_ch : (i + 1) * len(frames) // n_ch] for i in range(n_ch)]
        if n_ch == 1:
            self._run_channel(peer, plan, shares[0], statuses, deadline)
        else:
            ex = self._get_executor()
            futs = [ex.submit(self._run_channel, peer, plan, s, statuses, deadline) for s in shares[1:]]
            self._run_channel(peer, plan, shares[0], statuses, deadline)
            for f in futs:
                f.result()
        self._count(remote_items=len(plan.ops))

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._exec_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=4 * self.max_channels_per_peer, thread_name_prefix="tcp-read"
                )
            return self._executor

    def _run_channel(
        self, peer: str, plan: _BatchPlan, frames: list[list[int]], statuses: list[Status], deadline: float
    ) -> None:
        def fail(from_frame: int, st: Status) -> None:
            for fr in frames[from_frame:]:
                for k in fr:
                    statuses[plan.index[k]] = st

        try:
            ch = self._pool.lease(peer, max(deadline - self.clock(), 0.0))
        except TimeoutError:
            fail(0, Status.TIMEOUT)
            return
        except (OSError, AuthError, ValueError):
            fail(0, Status.PEER_UNREACHABLE)
            return
        done = 0
        ok = False
        try:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TimeoutError
            _set_io_timeout(ch.sock, remaining)
            sent = 0
            window: deque[int] = deque()
            head = bytearray(_RESP.size + MAX_ITEMS)
            hview = memoryview(head)
            while done < len(frames):
                if sent < len(frames) and len(window) < self.max_inflight_frames:
                    reqs = []
                    while sent < len(frames) and len(window) < self.max_inflight_frames:
                        ch.seq = (ch.seq + 1) & 0xFFFFFFFF
                        window.append(ch.seq)
                        reqs.append(self._request(plan, frames[sent], ch.seq))
                        sent += 1
                    ch.sock.sendall(b"".join(reqs))
                self._receive(ch, plan, frames[done], window.popleft(), hview, statuses)
                done += 1
                if done < len(frames) and self.clock() > deadline:
                    raise TimeoutError
            ok = True
        except (TimeoutError, BlockingIOError):
            fail(done, Status.TIMEOUT)
        except (OSError, ValueError):
            fail(done, Status.CHANNEL_ERROR)
        finally:
            self._pool.give_back(peer, ch, ok)
            self._sync_pool_stats()

    @staticmethod
    def _request(plan: _BatchPlan, frame: list[int], seq: int) -> bytes:
        parts = [_REQ.pack(MAGIC, OP_READ, len(frame), seq, 0)]
        ops = plan.ops
        for k in frame:
            op = ops[k]
            parts.append(_ITEM.pack(op.remote_addr, op.length, op.rkey, 0))
        return b"".join(parts)

    @staticmethod
    def _receive(
        ch: _Channel, plan: _BatchPlan, frame: list[int], seq: int, hview: memoryview, statuses: list[Status]
    ) -> None:
        count = len(frame)
        view = hview[: _RESP.size + count]
        if not _recv_exact(ch.sock, view):
            raise ConnectionError("peer closed the channel")
        magic, op, r_count, r_seq, _, total = _RESP.unpack_from(view)
        if magic != MAGIC or op != OP_READ or r_count != count or r_seq != seq:
            raise ConnectionError("response frame does not match the request")
        codes = bytes(view[_RESP.size :])
        dests = []
        expect = 0
        for k, code in zip(frame, codes, strict=True):
            if code == _OK:
                n = plan.ops[k].length
                expect += n
                if n:
                    dests.append(plan.views[k])
            elif code > int(Status.INVALID):
                raise ConnectionError(f"unknown status code {code}")
        if expect != total or total > MAX_ITEM_BYTES * count:
            raise ConnectionError("response payload size does not match its statuses")
        _recv_views(ch.sock, dests)
        # Only now, with every byte of the frame landed, do its items count.
        for k, code in zip(frame, codes, strict=True):
            statuses[plan.index[k]] = Status(code)

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
