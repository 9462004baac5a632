"""Both ends of an authenticated TCP connection, shared by the TCP transport and the RPC
layer: :class:`AuthListener` (accept, cap, authenticate, serve one connection per thread)
and :func:`dial` / :func:`hang_up` for the client side.

Every connection is authenticated with the cluster-token handshake
(:func:`hiradix.net.auth.server_handshake`, in the listener's ``context``) before a
single byte of its payload is read; a connection that fails it, or that arrives while
``max_connections`` are open, is closed. The socket binds to loopback unless told
otherwise.

A failing ``accept`` never ends the listener: running out of file descriptors
(``EMFILE``/``ENFILE``), of buffers or memory (``ENOBUFS``/``ENOMEM``), a connection reset
before it was taken (``ECONNABORTED``) or any other error backs off (:class:`Backoff`) and
tries again, so the port serves again as soon as the cause goes away.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hiradix.net.auth import AuthError, client_handshake, server_handshake

__all__ = [
    "AuthListener",
    "Backoff",
    "ListenerStats",
    "dial",
    "hang_up",
    "set_recv_timeout",
    "set_send_timeout",
    "still_open",
]

logger = logging.getLogger(__name__)


def dial(host: str, port: int, token: bytes, context: bytes, timeout: float) -> socket.socket:
    """Connect to ``(host, port)`` with TCP_NODELAY and complete the client side of the
    handshake within ``timeout`` seconds each; the socket is closed if anything fails.
    Raises ``OSError`` (``TimeoutError`` included) or ``AuthError``."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, token, context, timeout)
    except BaseException:
        sock.close()
        raise
    return sock


def still_open(sock: socket.socket) -> bool:
    """Whether the other end is still there on idle ``sock``: ``False`` once it closed or
    reset the connection (or sent bytes nobody asked for), as a pooled connection finds
    after the server restarted or timed it out. One non-blocking peek, no wait."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"" (EOF) or stray bytes
    except BlockingIOError:
        return True  # nothing to read: the connection is idle and open
    except OSError:
        return False
    return False


def hang_up(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking any thread blocked on it) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class Backoff:
    """Exponential back-off over one episode of consecutive failures: the ``k``-th failure
    waits ``min(first * 2**(k-1), cap)`` seconds; :meth:`reset` ends the episode.

    >>> b = Backoff(first=0.25, cap=1.0)
    >>> [b.failure() for _ in range(4)], b.reset(), b.failure()
    ([0.25, 0.5, 1.0, 1.0], 4, 0.25)
    """

    __slots__ = ("cap", "failures", "first")

    def __init__(self, first: float = 0.01, cap: float = 1.0) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"need 0 < first <= cap, got first={first!r}, cap={cap!r}")
        self.first = first
        self.cap = cap
        self.failures = 0  # in the current episode

    def failure(self) -> float:
        """Count one failure; the seconds to wait before the next try. ``O(1)``."""
        self.failures += 1
        return min(self.first * 2.0 ** min(self.failures - 1, 64), self.cap)

    def reset(self) -> int:
        """End the episode (a try worked); how many failures it had. ``O(1)``."""
        n, self.failures = self.failures, 0
        return n


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a peer that already left"
    return f"{host}:{port}"


@dataclass
class ListenerStats:
    """Counters of one :class:`AuthListener`, for tests and metrics (updated under its
    lock; read freely)."""

    accepted: int = 0  #: connections taken on and handed to a serving thread
    refused: int = 0  #: connections closed at accept because ``max_connections`` were open
    accept_errors: int = 0  #: failed accepts (and thread starts), each followed by a back-off
    accept_stalls: int = 0  #: episodes of consecutive accept errors (each logged once)
    timed_out: int = 0  #: connections closed by a timeout: handshake, idle, stalled frame or send
    refused_handshakes: int = 0  #: connections that failed the cluster-token challenge (each logged)


class AuthListener:
    """Accepts connections on ``(host, port)`` and runs ``serve(conn)`` for each one that
    authenticates, on a thread of its own.

    ``serve`` returns (or raises ``OSError``/``AuthError`` or one of ``quiet``) when it is
    done with the connection, which is then closed. ``closed`` is set by :meth:`close`;
    ``serve`` loops should check it. ``serve`` owns the connection's idle timeout (it knows
    where frames begin); a kernel timeout it lets escape is counted in
    :attr:`stats` ``.timed_out``.

    A connection beyond ``max_connections`` open ones is closed at once (counted in
    ``refused``). When ``accept`` fails the loop waits ``backoff.failure()`` seconds through
    ``wait`` (``closed.wait`` by default, so :meth:`close` cuts it short), logs the first
    failure of each episode and its end, and goes on; ``clock`` only times the episode
    for that log line.
    """

    def __init__(
        self,
        serve: Callable[[socket.socket], None],
        token: bytes,
        context: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 1024,
        handshake_timeout: float = 5.0,
        name: str = "listener",
        quiet: tuple[type[BaseException], ...] = (),
        backoff: Backoff | None = None,
        wait: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be a positive int, got {max_connections!r}")
        self._serve = serve
        self._token = token
        self._context = context
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self._name = name
        self._quiet: tuple[type[BaseException], ...] = (OSError, AuthError, *quiet)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.stats = ListenerStats()
        self.closed = threading.Event()
        self._backoff = backoff if backoff is not None else Backoff()
        self._wait = wait if wait is not None else self.closed.wait
        self._clock = clock
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.settimeout(0.25)  # the accept loop re-checks the close flag this often
        h, p = self._sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept-{p}", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        """Connections taken on and not yet closed."""
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        stalled_since = 0.0
        while not self.closed.is_set():
            try:
                conn, _ = self._sock.accept()
                if self._backoff.failures:
                    n = self._backoff.reset()
                    logger.info(
                        "%s listener %s: accepting again after %d failed accepts over %.1fs",
                        self._name,
                        self.address,
                        n,
                        self._clock() - stalled_since,
                    )
                self._take(conn)
            except TimeoutError:
                continue
            except (OSError, RuntimeError) as e:  # RuntimeError: "can't start new thread"
                if self.closed.is_set():
                    break  # close() closed the socket under us
                delay = self._backoff.failure()
                first = self._backoff.failures == 1
                with self._lock:
                    self.stats.accept_errors += 1
                    self.stats.accept_stalls += first
                if first:
                    stalled_since = self._clock()
                    logger.warning(
                        "%s listener %s: accept failed (%s); backing off (up to %gs) and retrying until it works",
                        self._name,
                        self.address,
                        e,
                        self._backoff.cap,
                    )
                self._wait(delay)

    def _take(self, conn: socket.socket) -> None:
        """Hand ``conn`` to a serving thread, or close it (cap reached, or closing)."""
        with self._lock:
            if len(self._conns) >= self.max_connections or self.closed.is_set():
                self.stats.refused += 1
                conn.close()
                return
            self._conns.add(conn)
            self.stats.accepted += 1
        try:
            threading.Thread(target=self._run, args=(conn,), name=f"{self._name}-conn", daemon=True).start()
        except BaseException:
            with self._lock:
                self._conns.discard(conn)
                self.stats.accepted -= 1
            conn.close()
            raise

    def _run(self, conn: socket.socket) -> None:
        timed_out = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_handshake(conn, self._token, self._context, self.handshake_timeout)
            self._serve(conn)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: a kernel SO_RCVTIMEO/SO_SNDTIMEO
            timed_out = True
        except AuthError as exc:  # a wrong token or a broken handshake: the operator should know
            with self._lock:
                self.stats.refused_handshakes += 1
            logger.warning("%s %s: refused a connection from %s: %s", self._name, self.address, _peer(conn), exc)
        except self._quiet:
            pass  # the peer sees the connection close
        finally:
            with self._lock:
                self._conns.discard(conn)
                self.stats.timed_out += timed_out
            conn.close()

    def close(self) -> None:
        """Stop accepting and shut every open connection down. Idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)  # the serving thread closes it
        self._thread.join(timeout=2.0)


def _timeval(seconds: float) -> bytes:
    # A zero timeval means "wait forever" to the kernel: never round down to it.
    us = max(1, round(seconds * 1e6))
    return struct.pack("ll", us // 1_000_000, us % 1_000_000)


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """A ``recv`` on blocking ``sock`` that waits longer than ``seconds`` fails with
    ``EAGAIN`` (:class:`BlockingIOError`). One syscall, and none per ``recv`` after it:
    ``settimeout`` would add a ``poll()`` before every call."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """As :func:`set_recv_timeout`, for ``send``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
