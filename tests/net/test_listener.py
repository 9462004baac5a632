"""The accept loop shared by the RPC server and the TCP responder
(:class:`hiradix.net.listener.AuthListener`): it survives every accept error with a
bounded back-off (out of file descriptors for real, in a subprocess with a lowered
``RLIMIT_NOFILE``; scripted errors with an injected wait and clock), refuses connections
beyond its cap, and closes idle ones.

Nothing sleeps to order events: the injected wait records and returns, and waits on
another thread or process are bounded polls with a deadline."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from hiradix.net.auth import AuthError
from hiradix.net.listener import AuthListener, Backoff, dial
from hiradix.net.rpc import RpcClient, RpcServer
from hiradix.transport import Status, TcpTransport
from hiradix.transport.fake import FakeClock

pytestmark = pytest.mark.timeout(60)

TOKEN = b"listener-token-0123456789abcdef!"
WAIT = 10.0


def _until(cond: Callable[[], bool], what: str, limit: float = WAIT) -> None:
    """Poll ``cond`` (state another thread or process changes) until true, or fail."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _echo_once(conn: socket.socket) -> None:
    conn.sendall(conn.recv(1))


def _ask(listener: AuthListener, context: bytes = b"test") -> bytes:
    host, port = listener.address.rsplit(":", 1)
    with dial(host, int(port), TOKEN, context, WAIT) as s:
        s.settimeout(WAIT)
        s.sendall(b"?")
        return s.recv(1)


class _ScriptedSocket:
    """Stands in for the listening socket: raises the queued errors, then accepts for real."""

    def __init__(self, real: socket.socket, errors: list[BaseException]) -> None:
        self.real = real
        self.errors = errors

    def accept(self) -> tuple[socket.socket, object]:
        if self.errors:
            raise self.errors.pop(0)
        return self.real.accept()

    def close(self) -> None:
        self.real.close()


def test_backoff_doubles_up_to_its_cap_and_restarts_per_episode() -> None:
    b = Backoff(first=0.01, cap=1.0)
    assert [b.failure() for _ in range(9)] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]
    assert b.reset() == 9 and b.failure() == 0.01
    for _ in range(10_000):  # no overflow however long the episode
        assert b.failure() <= 1.0
    with pytest.raises(ValueError):
        Backoff(first=2.0, cap=1.0)


def test_accept_errors_back_off_log_once_per_episode_and_keep_serving(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(100.0)
    delays: list[float] = []
    waited = threading.Condition()

    def wait(seconds: float) -> None:  # simulated time: the wait moves the clock, nobody sleeps
        with waited:
            delays.append(seconds)
            clock.advance(seconds)
            waited.notify_all()

    def waits(n: int) -> None:
        with waited:
            assert waited.wait_for(lambda: len(delays) >= n, WAIT), f"only {len(delays)} back-offs"

    caplog.set_level(logging.INFO, logger="hiradix.net.listener")
    lst = AuthListener(_echo_once, TOKEN, b"test", wait=wait, clock=clock)
    try:
        first = [
            OSError(errno.EMFILE, "Too many open files"),
            OSError(errno.ENFILE, "Too many open files in system"),
            OSError(errno.ENOBUFS, "No buffer space available"),
            OSError(errno.ENOMEM, "Cannot allocate memory"),
            ConnectionAbortedError(errno.ECONNABORTED, "Software caused connection abort"),
            OSError(errno.EPROTO, "Protocol error"),
        ]
        scripted = _ScriptedSocket(lst._sock, first)
        lst._sock = scripted  # type: ignore[assignment]
        waits(6)
        assert _ask(lst) == b"?"  # the port serves again
        assert delays == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32]
        s = lst.stats
        assert (s.accept_errors, s.accept_stalls, s.accepted) == (6, 1, 1)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "Too many open files" in warned[0].getMessage()
        assert any("accepting again after 6 failed accepts over 0.6s" in r.getMessage() for r in caplog.records)

        # A second, longer episode: logged once more, its back-off restarts and stops at 1 s.
        scripted.errors.extend(OSError(errno.EMFILE, "Too many open files") for _ in range(9))
        waits(15)
        assert _ask(lst) == b"?"
        assert delays[6:] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]
        assert (lst.stats.accept_errors, lst.stats.accept_stalls) == (15, 2)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    finally:
        lst.close()


def test_close_cuts_a_back_off_short() -> None:
    lst = AuthListener(_echo_once, TOKEN, b"test", backoff=Backoff(first=1.0, cap=1.0))
    forever = _ScriptedSocket(lst._sock, [])

    def accept() -> tuple[socket.socket, object]:
        raise OSError(errno.EMFILE, "Too many open files")

    forever.accept = accept  # type: ignore[method-assign]
    lst._sock = forever  # type: ignore[assignment]
    _until(lambda: lst.stats.accept_errors > 0, "an accept error")
    t0 = time.monotonic()
    lst.close()
    assert not lst._thread.is_alive()
    assert time.monotonic() - t0 < 2.0


_CHILD = r"""
import dataclasses, logging, os, resource, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from hiradix.net.rpc import RpcServer
from hiradix.transport import TcpTransport

token, victim, spare = sys.argv[1].encode(), sys.argv[2], int(sys.argv[3])
# Flood connections must wait in the handshake, not time out of it, while fds are gone.
rpc = RpcServer(token, handshake_timeout=60.0)
data = TcpTransport(token, handshake_timeout=60.0)
region = data.register(bytearray(b"d" * 64))
rpc.register("stats", lambda: dataclasses.asdict((rpc if victim == "rpc" else data).listener_stats))
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(rpc.address, data.address, region.addr, region.rkey, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.parametrize("victim", ["rpc", "data"])
def test_a_listener_out_of_file_descriptors_serves_again_once_they_are_released(victim: str) -> None:
    """The field report: ~1,018 authenticated connections under the usual 1,024-fd limit
    left the port dead for good. Here the server process gets a few spare descriptors,
    connections use them all up, accept fails with EMFILE; once they close, the same port
    serves a new client."""
    spare = 16
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, TOKEN.decode(), victim, str(spare)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    control = RpcClient(TOKEN, timeout=WAIT)
    flood: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        rpc_addr, data_addr, raddr, rkey = proc.stdout.readline().split()
        # The control connection is opened now, while descriptors are free, and reused.
        assert control.call(rpc_addr, "stats")["accept_errors"] == 0
        host, port = (rpc_addr if victim == "rpc" else data_addr).rsplit(":", 1)
        for _ in range(spare + 24):  # more than the spare fds, fewer than the backlog of 128
            flood.append(socket.create_connection((host, int(port)), timeout=WAIT))
        _until(lambda: control.call(rpc_addr, "stats")["accept_errors"] > 0, "accept to run out of fds")
        for s in flood:
            s.close()
        flood.clear()
        if victim == "rpc":
            with RpcClient(TOKEN, timeout=WAIT) as fresh:  # a new connection to the same port
                assert fresh.call(rpc_addr, "stats")["accept_stalls"] >= 1
        else:
            reader = TcpTransport(TOKEN, timeout=WAIT)
            try:
                buf = bytearray(64)
                lr = reader.register(buf)
                assert reader.read_batch(data_addr, [(int(raddr), int(rkey), 64, lr.addr)]) == [Status.OK]
                assert bytes(buf) == b"d" * 64
            finally:
                reader.close()
        stats = control.call(rpc_addr, "stats")
    finally:
        for s in flood:
            s.close()
        control.close()
        _, err = proc.communicate(input="", timeout=WAIT)
    assert proc.returncode == 0, err
    assert stats["accept_errors"] >= stats["accept_stalls"] >= 1
    warned = [ln for ln in err.splitlines() if "accept failed" in ln]
    assert len(warned) == stats["accept_stalls"], err  # once per episode, not per failure
    assert "Too many open files" in warned[0] and "accepting again" in err


def test_connections_beyond_the_cap_are_refused_and_counted() -> None:
    server = RpcServer(TOKEN, max_connections=2)
    server.register("add", lambda a, b: a + b)
    host, port = server.address.rsplit(":", 1)
    held = [dial(host, int(port), TOKEN, b"rpc", WAIT) for _ in range(2)]
    try:
        _until(lambda: server._listener.open_connections == 2, "two served connections")
        with pytest.raises((AuthError, OSError)):  # closed at accept, before the challenge
            dial(host, int(port), TOKEN, b"rpc", WAIT).close()
        assert server.listener_stats.refused == 1 and server.listener_stats.accepted == 2
        held.pop().close()
        _until(lambda: server._listener.open_connections == 1, "the server to see a close")
        with RpcClient(TOKEN, timeout=WAIT) as c:
            assert c.call(server.address, "add", 1, 2) == 3  # a slot is free again
        assert server.listener_stats.refused == 1
    finally:
        for s in held:
            s.close()
        server.close()


def test_data_port_cap_refuses_a_second_reader() -> None:
    server = TcpTransport(TOKEN, max_connections=1)
    first, second = TcpTransport(TOKEN, timeout=WAIT), TcpTransport(TOKEN, timeout=WAIT)
    try:
        r = server.register(bytearray(b"x" * 64))
        a, b = first.register(bytearray(64)), second.register(bytearray(64))
        assert first.read_batch(server.address, [(r.addr, r.rkey, 64, a.addr)]) == [Status.OK]  # keeps its channel
        assert second.read_batch(server.address, [(r.addr, r.rkey, 64, b.addr)]) == [Status.PEER_UNREACHABLE]
        assert server.listener_stats.refused == 1
    finally:
        for t in (first, second, server):
            t.close()


@pytest.mark.parametrize("kind", ["rpc", "data"])
def test_idle_connections_are_closed_and_counted(kind: str) -> None:
    if kind == "rpc":
        srv = RpcServer(TOKEN, idle_timeout=0.2)
        stats, context, close = (lambda: srv.listener_stats), b"rpc", srv.close
        address = srv.address
    else:
        tsrv = TcpTransport(TOKEN, idle_timeout=0.2)
        stats, context, close = (lambda: tsrv.listener_stats), b"transport", tsrv.close
        address = tsrv.address
    host, port = address.rsplit(":", 1)
    try:
        with dial(host, int(port), TOKEN, context, WAIT) as s:
            s.settimeout(WAIT)  # the server hangs up long before this
            t0 = time.monotonic()
            assert s.recv(16) == b""
            assert time.monotonic() - t0 < WAIT / 2
        assert stats().timed_out == 1 and stats().accepted == 1
    finally:
        close()


def test_peer_config_sets_both_listeners() -> None:
    from hiradix.peer.config import ConfigError, PeerConfig
    from hiradix.peer.node import PeerNode

    node = PeerNode(
        PeerConfig(metrics_enabled=False, cluster_token=TOKEN.decode(), max_connections=3, idle_timeout_s=7.5),
        start=False,
    )
    try:
        assert isinstance(node.transport, TcpTransport)
        assert node.rpc.max_connections == node.transport.max_connections == 3
        assert node.rpc._listener.max_connections == node.transport._listener.max_connections == 3
        assert node.rpc.idle_timeout == node.transport.idle_timeout == 7.5
    finally:
        node.close(leave=False)
    for bad in ({"max_connections": 0}, {"idle_timeout_s": 0}, {"idle_timeout_s": float("nan")}):
        with pytest.raises(ConfigError):
            PeerConfig(metrics_enabled=False, **bad)  # type: ignore[arg-type]


def test_refused_handshakes_are_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """A client with the wrong token is refused, counted, and named in one WARNING line."""
    server = RpcServer(TOKEN, host="127.0.0.1", port=0)
    try:
        with caplog.at_level(logging.WARNING, logger="hiradix.net.listener"):
            with pytest.raises((AuthError, OSError)):
                host, port = server.address.rsplit(":", 1)
                dial(host, int(port), b"another-token-0123456789abcdef!!", b"rpc", 5.0)
            _until(lambda: server.listener_stats.refused_handshakes == 1, "the refusal to be counted")
        lines = [r for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    finally:
        server.close()
