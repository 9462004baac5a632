"""Control-plane RPC: length-prefixed msgpack frames over authenticated TCP.

Every connection starts with the cluster-token handshake of :mod:`hiradix.net.auth`
(context ``b"rpc"``). After it, each message is one frame::

    frame    = length u32 (big-endian) || msgpack body            length <= max_frame
    request  = [0, req_id, method, args (array), kwargs (map with str keys)]
    response = [1, req_id, error, result]        error = nil | [code (str), message (str)]

Nothing is ever pickled: a body is plain msgpack data, checked for shape before use, and
errors travel as ``(code, message)`` pairs. Both sides enforce ``max_frame``.

The client leases one pooled connection per call (at most ``max_connections_per_peer``
per peer), so concurrent calls to one owner run concurrently on separate connections and
separate server threads. A connection that saw a timeout, a socket error or a protocol
error is closed, never reused; a remote error reply leaves it usable. A call can be split
in two (:meth:`RpcClient.begin`, then :meth:`PendingCall.result`) so the caller works
while the request is in flight.

A pooled connection may have died while it sat idle: the server restarted, or closed it
after its idle timeout. Before a request goes out on one, a non-blocking peek finds a
server that has already hung up, and the request takes another (or a new) connection
instead: nothing was sent, so this is safe for every call. When the hang-up shows only
after the send (EOF or a reset before any byte of the reply), the server may or may not
have run the call, so it is sent again, once, on a live connection only for methods the
client was told are idempotent.

Sockets are blocking with kernel-side timeouts (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``), set
once per connection and changed only when a call's remaining time calls for it:
``settimeout`` would make every ``send`` and ``recv`` a ``poll`` plus the call itself.

Server error codes: ``no_such_method``, ``bad_params``, ``malformed``,
``frame_too_large``, ``internal``, or whatever code a handler raises with
:class:`RpcError`.
"""

from __future__ import annotations

import errno
import inspect
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from hiradix.net.address import parse_peer
from hiradix.net.auth import AuthError, HandshakeTimeout, load_token
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

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FrameError",
    "PendingCall",
    "Request",
    "Response",
    "RpcClient",
    "RpcConnectionError",
    "RpcError",
    "RpcServer",
    "RpcTimeout",
    "decode_request",
    "decode_response",
    "encode_frame",
    "split_frames",
]

#: Default cap on one frame's body, in bytes (both directions).
DEFAULT_MAX_FRAME = 16 << 20
_MAX_METHOD = 256
_MAX_ID = (1 << 63) - 1
_LEN = struct.Struct(">I")
_REQUEST, _RESPONSE = 0, 1
_AUTH_CONTEXT = b"rpc"
#: A client re-arms its socket's kernel timeout only when the call's remaining time falls
#: more than this below it (seconds): a call overruns its deadline by at most this much.
_ARM_SLACK = 1e-3


class FrameError(ValueError):
    """A frame or message that does not follow the protocol."""


class RpcError(Exception):
    """A structured error: raised by handlers to reply with a code, raised by
    :meth:`RpcClient.call` when the server replied with one."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class RpcTimeout(TimeoutError):
    """The call's deadline passed (the connection is closed)."""


class RpcConnectionError(ConnectionError):
    """Could not connect or authenticate, or the connection broke mid-call."""


#: Errnos of a socket whose other end has hung up (reset, broken pipe, torn down).
_HUNG_UP = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN})
#: A pooled connection idle at least this long (seconds) is peeked at before a request
#: goes out on it. The peek costs a syscall (~1-4 us, 3-8% of a loopback call); in a burst
#: of calls the server cannot have restarted between two of them, and should it have
#: died just then, an idempotent call is still sent again.
_IDLE_CHECK = 0.01


class _HungUp(ConnectionError):
    """The server closed or reset the connection before any byte of the reply."""


def _hung_up(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in _HUNG_UP


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request."""

    req_id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response; ``error`` is ``(code, message)`` or ``None``."""

    req_id: int | None
    error: tuple[str, str] | None
    result: Any


def encode_frame(message: Any, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Length-prefix the msgpack encoding of ``message``; ``FrameError`` if it is too big,
    ``TypeError`` / ``OverflowError`` if it holds something msgpack cannot encode.

    >>> encode_frame([1, 2])[:4]
    b'\\x00\\x00\\x00\\x03'
    """
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameError(f"frame of {len(body)} bytes exceeds max_frame={max_frame}")
    return _LEN.pack(len(body)) + body


def split_frames(buf: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[list[bytes], int]:
    """Cut the complete frames out of ``buf``: their bodies, and how many bytes they used
    (the rest is an incomplete frame). ``FrameError`` when a length exceeds ``max_frame``.

    Runtime complexity: ``O(len(buf))``.

    >>> split_frames(encode_frame("a") + b"\\x00\\x00")
    ([b'\\xa1a'], 6)
    """
    view = memoryview(buf)
    out: list[bytes] = []
    pos = 0
    while len(view) - pos >= _LEN.size:
        (n,) = _LEN.unpack_from(view, pos)
        if n > max_frame:
            raise FrameError(f"frame length {n} exceeds max_frame={max_frame}")
        if len(view) - pos - _LEN.size < n:
            break
        out.append(bytes(view[pos + _LEN.size : pos + _LEN.size + n]))
        pos += _LEN.size + n
    return out, pos


def _unpack(body: bytes) -> list[Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise FrameError(f"body is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, list) or not msg:
        raise FrameError("message must be a non-empty array")
    return msg


def _check_id(req_id: Any) -> int:
    if type(req_id) is not int or not 0 <= req_id <= _MAX_ID:
        raise FrameError("request id must be an int in [0, 2**63)")
    return req_id


def _parse_request(body: bytes) -> list[Any]:
    """:func:`decode_request` without building the :class:`Request`: the checked message
    ``[0, req_id, method, args, kwargs]`` (the server's hot path)."""
    msg = _unpack(body)
    if len(msg) != 5 or msg[0] != _REQUEST:
        raise FrameError("request must be [0, id, method, args, kwargs]")
    _, req_id, method, args, kwargs = msg
    _check_id(req_id)
    if not isinstance(method, str) or not 0 < len(method) <= _MAX_METHOD:
        raise FrameError("method must be a non-empty str")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise FrameError("args must be an array and kwargs a map")
    if kwargs and not all(isinstance(k, str) for k in kwargs):
        raise FrameError("kwargs keys must be str")
    return msg


def decode_request(body: bytes) -> Request:
    """Parse and shape-check a request body; ``FrameError`` on anything else.

    Runtime complexity: ``O(len(body))``.
    """
    _, req_id, method, args, kwargs = _parse_request(body)
    return Request(req_id, method, args, kwargs)


def _parse_response(body: bytes) -> tuple[int | None, tuple[str, str] | None, Any]:
    """:func:`decode_response` as a plain ``(req_id, error, result)`` tuple."""
    msg = _unpack(body)
    if len(msg) != 4 or msg[0] != _RESPONSE:
        raise FrameError("response must be [1, id, error, result]")
    _, req_id, error, result = msg
    if req_id is not None:
        _check_id(req_id)
    if error is not None:
        if (
            not isinstance(error, list)
            or len(error) != 2
            or not isinstance(error[0], str)
            or not isinstance(error[1], str)
        ):
            raise FrameError("error must be nil or [code, message]")
        return req_id, (error[0], error[1]), None
    return req_id, None, result


def decode_response(body: bytes) -> Response:
    """Parse and shape-check a response body; ``FrameError`` on anything else.

    Runtime complexity: ``O(len(body))``.
    """
    return Response(*_parse_response(body))


class _FrameReader:
    """Buffered frame input over one socket: a small frame (header and body) usually
    arrives in one ``recv``, where reading the header and then the body exactly took two
    receives, each with its own poll. Bytes past the current frame stay buffered for the
    next one. Bodies larger than the buffer are read into their own allocation.

    ``rearm``, when set, runs before every ``recv`` but the first of :meth:`head`: the
    client re-checks its deadline there and shortens the socket's kernel timeout.
    """

    __slots__ = ("buf", "end", "rearm", "sock", "start", "view")

    def __init__(self, sock: socket.socket, size: int = 64 << 10) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0  # first buffered byte not yet consumed
        self.end = 0  # one past the last buffered byte
        self.rearm: Callable[[], None] | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned."""
        return self.end - self.start

    def _fill(self, need: int) -> None:
        """Receive until ``need`` bytes (``need <= len(buf)``) are buffered;
        ``ConnectionError`` on EOF."""
        if self.start + need > len(self.buf):  # compact: move the partial frame to the front
            n = self.end - self.start
            self.buf[:n] = self.view[self.start : self.end]
            self.start, self.end = 0, n
        while self.end - self.start < need:
            if self.rearm is not None:
                self.rearm()
            k = self.sock.recv_into(self.view[self.end :])
            if k == 0:
                raise ConnectionError("connection closed mid-frame")
            self.end += k

    def head(self) -> int | None:
        """The next frame's body length, or ``None`` on EOF before its first byte. The
        caller sets the socket's timeout (an idle one) before calling."""
        if self.start == self.end:
            self.start = self.end = 0
            k = self.sock.recv_into(self.view)
            if k == 0:
                return None
            self.end = k
        if self.end - self.start < _LEN.size:
            self._fill(_LEN.size)
        (n,) = _LEN.unpack_from(self.buf, self.start)
        self.start += _LEN.size
        return int(n)

    def body(self, n: int) -> bytes:
        """The ``n`` body bytes after :meth:`head`; ``ConnectionError`` on EOF."""
        have = self.end - self.start
        if n <= len(self.buf):
            if have < n:
                self._fill(n)
            out = bytes(self.view[self.start : self.start + n])
            self.start += n
            return out
        big = bytearray(n)  # larger than the buffer: take what is buffered, then the rest
        big[:have] = self.view[self.start : self.end]
        self.start = self.end = 0
        view = memoryview(big)
        got = have
        while got < n:
            if self.rearm is not None:
                self.rearm()
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("connection closed mid-frame")
            got += k
        return bytes(big)


def _positional_arity(sig: inspect.Signature | None) -> tuple[int, int]:
    """``(lo, hi)``: a call with ``lo <= len(args) <= hi`` positional arguments and no
    keywords binds to ``sig``, and one with any other count does not. ``(0, -1)`` (no count
    binds) when ``sig`` has a required keyword-only parameter or is ``None``.

    >>> _positional_arity(inspect.signature(lambda a, b=1, *, c=2: None))
    (1, 2)
    """
    if sig is None:
        return 0, -1
    lo = hi = 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            hi += 1
            lo += p.default is p.empty
        elif p.kind is p.VAR_POSITIONAL:
            hi = _MAX_ID
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            return 0, -1
    return lo, hi


class RpcServer:
    """A threaded RPC server: one thread per authenticated connection.

    Parameters
    ----------
    token:
        Cluster token; ``None`` reads ``$HIRADIX_CLUSTER_TOKEN``.
    host, port:
        Bind address; loopback and an ephemeral port by default.
    max_frame:
        Largest frame body accepted or sent.
    max_connections:
        Connections served at once; one more is closed at accept (counted in
        :attr:`listener_stats` ``.refused``).
    handshake_timeout:
        Seconds a new connection has to authenticate.
    frame_timeout:
        Seconds a started frame may take to arrive completely.
    idle_timeout:
        Seconds an idle connection is kept (counted in ``.timed_out`` when it is closed).
    """

    def __init__(
        self,
        token: bytes | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_connections: int = 1024,
        handshake_timeout: float = 5.0,
        frame_timeout: float = 10.0,
        idle_timeout: float = 300.0,
    ) -> None:
        if not isinstance(max_frame, int) or max_frame < 16:
            raise ValueError(f"max_frame must be an int >= 16, got {max_frame!r}")
        for name, t in (
            ("handshake_timeout", handshake_timeout),
            ("frame_timeout", frame_timeout),
            ("idle_timeout", idle_timeout),
        ):
            if not t > 0:
                raise ValueError(f"{name} must be positive, got {t!r}")
        self._token = load_token(token)
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.frame_timeout = frame_timeout
        self.idle_timeout = idle_timeout
        # name -> (handler, its signature or None for builtins without one, fewest and most
        # positional arguments a call without keywords may pass, -1 when it may pass none).
        # All computed once here: inspect.signature costs ~10 us and Signature.bind ~10 us,
        # as much as the rest of a small call.
        self._methods: dict[str, tuple[Callable[..., Any], inspect.Signature | None, int, int]] = {}
        self._lock = threading.Lock()
        self._listener = AuthListener(
            self._serve,
            self._token,
            _AUTH_CONTEXT,
            host=host,
            port=port,
            max_connections=max_connections,
            handshake_timeout=handshake_timeout,
            name="rpc",
        )
        self._closed = self._listener.closed
        self.address = self._listener.address

    @property
    def listener_stats(self) -> ListenerStats:
        """The accept loop's counters: accepted, refused at the cap, accept errors, timeouts."""
        return self._listener.stats

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        """Serve ``fn`` as ``name``; its arguments and result must be msgpack data."""
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_METHOD:
            raise ValueError(f"method name must be a str of 1..{_MAX_METHOD} chars, got {name!r}")
        if not callable(fn):
            raise TypeError(f"handler for {name!r} is not callable")
        try:
            sig: inspect.Signature | None = inspect.signature(fn)
        except ValueError:  # builtins without a signature: let the call decide
            sig = None
        lo, hi = _positional_arity(sig)
        with self._lock:
            self._methods[name] = (fn, sig, lo, hi)

    def _serve(self, conn: socket.socket) -> None:
        """One authenticated connection: frames in, replies out, until it closes.

        The socket is blocking with kernel timeouts: ``idle_timeout`` for the first bytes
        of a frame, ``frame_timeout`` for the rest of a started one and for each send. A
        timeout raises ``OSError``, which ends the connection."""
        frames = _FrameReader(conn)
        idle = True
        conn.settimeout(None)  # blocking: no poll() before each recv and send
        set_recv_timeout(conn, self.idle_timeout)
        set_send_timeout(conn, self.frame_timeout)
        while not self._closed.is_set():
            if not idle and not frames.buffered:
                set_recv_timeout(conn, self.idle_timeout)  # only between frames
                idle = True
            n = frames.head()
            if n is None:
                return
            if n > self.max_frame:
                # The stream is no longer trustworthy: say why, then hang up.
                self._reply(conn, None, ("frame_too_large", f"{n} > {self.max_frame}"), None)
                return
            if frames.buffered < n and idle:
                set_recv_timeout(conn, self.frame_timeout)  # a started frame must arrive in time
                idle = False
            body = frames.body(n)
            try:
                _, req_id, method, args, kwargs = _parse_request(body)
            except FrameError as e:
                self._reply(conn, None, ("malformed", str(e)), None)
                continue
            error, result = self._call(method, args, kwargs)
            self._reply(conn, req_id, error, result)

    def _call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[tuple[str, str] | None, Any]:
        found = self._methods.get(method)  # one dict read: atomic, no lock needed
        if found is None:
            return ("no_such_method", method), None
        fn, sig, lo, hi = found
        # Positional-only calls are checked by counting; anything else (keywords, or a
        # count out of range, to get bind's message) goes through Signature.bind.
        if sig is not None and (kwargs or not lo <= len(args) <= hi):
            try:
                sig.bind(*args, **kwargs)
            except TypeError as e:
                return ("bad_params", str(e)), None
        try:
            return None, fn(*args, **kwargs)
        except RpcError as e:
            return (e.code, e.message), None
        except Exception as e:  # a handler bug becomes a structured reply, not a dead server
            return ("internal", f"{type(e).__name__}: {e}"), None

    def _reply(self, conn: socket.socket, req_id: int | None, error: tuple[str, str] | None, result: Any) -> None:
        try:
            frame = encode_frame([_RESPONSE, req_id, list(error) if error else None, result], self.max_frame)
        except (TypeError, ValueError, OverflowError) as e:
            frame = encode_frame([_RESPONSE, req_id, ["internal", f"unencodable result: {e}"], None])
        conn.sendall(frame)

    def close(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        self._listener.close()

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Conn:
    """One pooled client connection: the socket, its frame reader, the kernel timeout
    currently armed on it and the deadline of the call using it."""

    __slots__ = ("deadline", "frames", "idle_since", "io_timeout", "sock", "used")

    def __init__(self, sock: socket.socket, io_timeout: float) -> None:
        self.sock = sock
        self.frames = _FrameReader(sock, 16 << 10)
        self.frames.rearm = self.arm
        self.io_timeout = io_timeout  # SO_RCVTIMEO and SO_SNDTIMEO, seconds
        self.deadline = 0.0  # time.monotonic() by which the current call must be done
        self.used = False  # a call completed on it: it comes from the pool, and may have died there
        self.idle_since = 0.0  # time.monotonic() when its last call completed

    def arm(self) -> None:
        """Before a send or receive: ``TimeoutError`` when the deadline has passed; else
        make sure the kernel timeout ends within ``_ARM_SLACK`` of it. That takes two
        syscalls only when it moves: once per connection for calls with the default
        timeout."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if left > self.io_timeout or left < self.io_timeout - _ARM_SLACK:
            set_recv_timeout(self.sock, left)
            set_send_timeout(self.sock, left)
            self.io_timeout = left


class PendingCall:
    """A request sent by :meth:`RpcClient.begin`. :meth:`result` receives its answer, and
    must be called (or :meth:`cancel`) exactly once: the call holds a pooled connection
    until then."""

    __slots__ = ("_client", "_conn", "_deadline", "_frame", "method", "peer", "req_id", "timeout")

    def __init__(
        self,
        client: RpcClient,
        peer: str,
        method: str,
        conn: _Conn,
        req_id: int,
        timeout: float,
        frame: bytes,
        deadline: float,
    ) -> None:
        self._client = client
        self._conn: _Conn | None = conn
        self.peer = peer
        self.method = method
        self.req_id = req_id
        self.timeout = timeout
        self._frame = frame  # kept to send again if an idempotent call's connection died
        self._deadline = deadline

    def result(self) -> Any:
        """Wait for the answer and return it; raises as :meth:`RpcClient.call` does.

        Runtime complexity: ``O(len(answer))`` after the wait.
        """
        conn: _Conn | None = self._conn
        if conn is None:
            raise RuntimeError("the result of this call was already taken")
        self._conn = None
        client = self._client
        ok = False
        try:
            try:
                req_id, error, result = client._receive(conn)
            except _HungUp:
                # A pooled connection died under the request (the server restarted or
                # timed it out just then). Send it once more, on a live connection, only
                # if running it twice is harmless: the server may have run it already.
                if not (conn.used and self.method in client.idempotent):
                    raise
                client._pool.give_back(self.peer, conn, False)
                conn = None
                client._count_retry()
                conn = client._send(self.peer, self.method, self._frame, self._deadline, self.timeout)
                req_id, error, result = client._receive(conn)
            if req_id != self.req_id:
                raise RpcConnectionError(f"{self.peer} answered request {req_id}, expected {self.req_id}")
            ok = conn.used = True
            conn.idle_since = time.monotonic()
        except (OSError, FrameError) as e:
            raise client._failure(e, self.peer, self.method, self.timeout) from None
        finally:
            if conn is not None:
                client._pool.give_back(self.peer, conn, ok)
        if error is not None:
            raise RpcError(*error)
        return result

    def cancel(self) -> None:
        """Give up on the answer: the connection is closed (its reply can never be misread
        as another call's). A no-op once :meth:`result` ran. Runtime complexity: ``O(1)``."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._pool.give_back(self.peer, conn, False)


class RpcClient:
    """Calls methods on :class:`RpcServer` peers over pooled, authenticated connections.

    Parameters
    ----------
    token:
        Cluster token; ``None`` reads ``$HIRADIX_CLUSTER_TOKEN``.
    max_connections_per_peer:
        Concurrent calls to one peer beyond this wait for a free connection.
    timeout:
        Default per-call deadline in seconds (connect, send, wait, receive).
    idempotent:
        Methods that may run twice for one call. When a pooled connection dies after
        the request went out but before any byte of the reply, a call to one of these is
        sent again, once, on a live connection (counted in :attr:`retries`); any other
        call raises :class:`RpcConnectionError`. A pooled connection found dead before
        the send is replaced for every method (counted in :attr:`stale_connections`).
    """

    def __init__(
        self,
        token: bytes | str | None = None,
        *,
        max_connections_per_peer: int = 16,
        timeout: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        idempotent: Iterable[str] = (),
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._token = load_token(token)
        self.timeout = float(timeout)
        self.max_frame = max_frame
        self.idempotent = frozenset(idempotent)
        self._stats_lock = threading.Lock()
        self.retries = 0  #: requests sent again after their pooled connection died mid-call
        self.stale_connections = 0  #: pooled connections found dead before a send, and replaced
        self._pool: ChannelPool[_Conn] = ChannelPool(self._connect, self._close_conn, max_connections_per_peer)
        # An id only pairs a reply with its request on one connection, which carries one
        # call at a time, so ids need not be unique across threads: no lock.
        self._ids = itertools.count(1)

    def open_connections(self, peer: str) -> int:
        """Connections currently open to ``peer``."""
        return self._pool.open_count(peer)

    def _connect(self, peer: str, timeout: float | None) -> _Conn:
        host, port = parse_peer(peer)
        limit = self.timeout if timeout is None else timeout
        try:
            sock = dial(host, port, self._token, _AUTH_CONTEXT, limit)
        except HandshakeTimeout:  # before AuthError: silence is not a refusal
            raise RpcTimeout(
                f"{peer} accepted the connection but did not complete the handshake within {limit}s"
            ) from None
        except TimeoutError:
            raise RpcTimeout(f"cannot connect to {peer} within {limit}s") from None
        except AuthError:
            raise
        except OSError as e:
            raise RpcConnectionError(f"cannot connect to {peer}: {e}") from None
        try:
            sock.settimeout(None)  # blocking, with the kernel timeouts below
            set_recv_timeout(sock, self.timeout)
            set_send_timeout(sock, self.timeout)
        except OSError as e:
            hang_up(sock)
            raise RpcConnectionError(f"cannot set up the connection to {peer}: {e}") from None
        return _Conn(sock, self.timeout)

    @staticmethod
    def _close_conn(c: _Conn) -> None:
        hang_up(c.sock)

    def call(self, peer: str, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call ``method(*args, **kwargs)`` on ``peer`` (``"host:port"``) and return its result.

        Runtime complexity: ``O(len(request) + len(answer))`` plus the round trip.

        Raises
        ------
        RpcError
            The server replied with a structured error (``.code``, ``.message``).
        RpcTimeout
            ``timeout`` (default: the client's) passed.
        RpcConnectionError
            Connecting, authenticating or the connection failed.
        FrameError
            The request is larger than ``max_frame``.
        """
        return self.begin(peer, method, *args, timeout=timeout, **kwargs).result()

    def begin(self, peer: str, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any) -> PendingCall:
        """Send the request of :meth:`call` and return without waiting for the answer:
        :meth:`PendingCall.result` receives it. ``timeout`` covers both halves. Raises as
        :meth:`call` for what goes wrong while connecting and sending.

        Runtime complexity: ``O(len(request))``.

        >>> c = RpcClient(b"0" * 32)
        >>> s = RpcServer(b"0" * 32); s.register("add", lambda a, b: a + b)
        >>> pending = c.begin(s.address, "add", 2, 3)   # in flight: do other work here
        >>> pending.result()
        5
        >>> c.close(); s.close()
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        req_id = next(self._ids)
        frame = encode_frame([_REQUEST, req_id, method, list(args), kwargs], self.max_frame)
        conn = self._send(peer, method, frame, deadline, timeout)
        return PendingCall(self, peer, method, conn, req_id, timeout, frame, deadline)

    def _lease(self, peer: str, deadline: float, timeout: float) -> _Conn:
        """A connection to ``peer`` whose server is still there: a pooled one that passes
        :func:`~hiradix.net.listener.still_open` (when it sat idle for
        ``_IDLE_CHECK`` or more), else a new one. Each dead one is closed (at most one
        per pooled connection, then the pool dials). Runtime complexity: ``O(1)``
        syscalls per pooled connection tried."""
        while True:
            try:
                conn = self._pool.lease(peer, max(deadline - time.monotonic(), 0.0))
            except RpcTimeout:  # connecting or the handshake timed out (see _connect)
                raise
            except TimeoutError:
                raise RpcTimeout(f"no free connection to {peer} within {timeout}s") from None
            except AuthError as e:
                raise RpcConnectionError(f"{peer}: {e}") from None
            except RpcConnectionError:
                raise
            except OSError as e:
                raise RpcConnectionError(f"cannot connect to {peer}: {e}") from None
            if not conn.used or time.monotonic() - conn.idle_since < _IDLE_CHECK or still_open(conn.sock):
                return conn
            self._pool.give_back(peer, conn, False)
            with self._stats_lock:
                self.stale_connections += 1

    def _send(self, peer: str, method: str, frame: bytes, deadline: float, timeout: float) -> _Conn:
        """Lease a live connection to ``peer`` and send ``frame`` on it by ``deadline``;
        raises as :meth:`call` does (the connection is closed on failure). A pooled
        connection whose send fails because the server hung up (after the peek) is
        replaced once: a send that fails never delivered a whole frame, so the server
        cannot have run it."""
        may_replace = True
        while True:
            conn = self._lease(peer, deadline, timeout)
            try:
                if conn.frames.buffered:  # a reply nobody asked for: the stream is out of step
                    raise FrameError(f"{conn.frames.buffered} unexpected bytes before the request")
                conn.deadline = deadline
                conn.arm()
                conn.sock.sendall(frame)  # header and body: one send
                return conn
            except (OSError, FrameError) as e:
                self._pool.give_back(peer, conn, False)
                if may_replace and conn.used and _hung_up(e):
                    may_replace = False
                    with self._stats_lock:
                        self.stale_connections += 1
                    continue
                raise self._failure(e, peer, method, timeout) from None
            except BaseException:
                self._pool.give_back(peer, conn, False)
                raise

    def _count_retry(self) -> None:
        with self._stats_lock:
            self.retries += 1

    def _receive(self, conn: _Conn) -> tuple[int | None, tuple[str, str] | None, Any]:
        """The answer on ``conn`` by its deadline: ``(req_id, error, result)``."""
        frames = conn.frames
        conn.arm()  # the caller may have worked since the send
        try:
            n = frames.head()
        except OSError as e:
            if frames.end == 0 and e.errno in _HUNG_UP:  # reset before any byte of the reply
                raise _HungUp(f"server reset the connection ({e})") from None
            raise
        if n is None:
            raise _HungUp("server closed the connection")
        if n > self.max_frame:
            raise FrameError(f"response of {n} bytes exceeds max_frame={self.max_frame}")
        body = frames.body(n)
        if frames.buffered:
            raise FrameError(f"{frames.buffered} unexpected bytes after the response")
        return _parse_response(body)

    @staticmethod
    def _failure(e: BaseException, peer: str, method: str, timeout: float) -> Exception:
        """The exception a failed send or receive raises; the connection is closed."""
        if isinstance(e, (TimeoutError, BlockingIOError)):  # BlockingIOError: a kernel timeout
            return RpcTimeout(f"{method} on {peer} timed out after {timeout}s")
        if isinstance(e, FrameError):
            return RpcConnectionError(f"{peer} sent a bad frame: {e}")
        if isinstance(e, RpcConnectionError):
            return e
        return RpcConnectionError(f"connection to {peer} broke: {e}")

    def close(self) -> None:
        """Close idle connections; calls in flight close theirs when they finish."""
        self._pool.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
