"""Both ends of an authenticated TCP connection, shared by the TCP transport and the RPC
layer: :class:`AuthListener` (accept, cap, authenticate, serve one connection per thread)
and :func:`dial` / :func:`hang_up` for the client side.

Every connection is authenticated with the cluster-token handshake
(:func:`hiradix.transport.auth.server_handshake`, in the listener's ``context``) before a
single byte of its payload is read; a connection that fails it, or that arrives while
``max_connections`` are open, is closed. The socket binds to loopback unless told
otherwise.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

from hiradix.transport.auth import AuthError, client_handshake, server_handshake

__all__ = ["AuthListener", "dial", "hang_up", "set_recv_timeout", "set_send_timeout"]


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


def hang_up(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking any thread blocked on it) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class AuthListener:
    """Accepts connections on ``(host, port)`` and runs ``serve(conn)`` for each one that
    authenticates, on a thread of its own.

    ``serve`` returns (or raises ``OSError``/``AuthError`` or one of ``quiet``) when it is
    done with the connection, which is then closed. ``closed`` is set by :meth:`close`;
    ``serve`` loops should check it.
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
    ) -> None:
        self._serve = serve
        self._token = token
        self._context = context
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self._name = name
        self._quiet: tuple[type[BaseException], ...] = (OSError, AuthError, *quiet)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.settimeout(0.25)  # the accept loop re-checks the close flag this often
        h, p = self._sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept-{p}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with self._lock:
                if len(self._conns) >= self.max_connections or self.closed.is_set():
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._run, args=(conn,), name=f"{self._name}-conn", daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_handshake(conn, self._token, self._context, self.handshake_timeout)
            self._serve(conn)
        except self._quiet:
            pass  # the peer sees the connection close
        finally:
            with self._lock:
                self._conns.discard(conn)
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
