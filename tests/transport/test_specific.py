"""Tests that belong to one transport: the TCP responder's wire checks and handshake, the
fake NIC's fault and delay injection. The shared contract is in
``test_transport_conformance.py``."""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hiradix.transport.tcp as tcpmod
from hiradix.net.auth import AuthError, client_handshake, load_token, server_handshake
from hiradix.transport import FakeClock, FakeFabric, FakeTransport, ReadOp, Status, TcpTransport
from hiradix.transport.tcp import MAGIC, OP_READ
from tests.support import send_then_drain

pytestmark = pytest.mark.timeout(60)

TOKEN = b"specific-token-0123456789abcdef!"


@pytest.fixture
def tcp_pair():
    a, b = TcpTransport(TOKEN), TcpTransport(TOKEN)
    yield a, b
    a.close()
    b.close()


def _raw_client(t: TcpTransport, token: bytes = TOKEN) -> socket.socket:
    host, port = t.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    client_handshake(s, token, b"transport", 5.0)
    return s


def _still_serves(reader: TcpTransport, server: TcpTransport) -> None:
    r = server.register(bytearray(b"x" * 64))
    lr = reader.register(bytearray(64))
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 64, lr.addr)]) == [Status.OK]


def test_tcp_binds_loopback_by_default(tcp_pair) -> None:
    a, _ = tcp_pair
    assert a.address.startswith("127.0.0.1:")


def test_wrong_token_is_refused(tcp_pair) -> None:
    reader, server = tcp_pair
    r = server.register(bytearray(64))
    intruder = TcpTransport(b"not-the-cluster-token-at-all!!!!")
    try:
        lr = intruder.register(bytearray(64))
        assert intruder.read_batch(server.address, [(r.addr, r.rkey, 8, lr.addr)], timeout=2) == [
            Status.PEER_UNREACHABLE
        ]
        with pytest.raises(AuthError):
            _raw_client(server, b"not-the-cluster-token-at-all!!!!")
    finally:
        intruder.close()
    assert server.stats.served_items == 0
    _still_serves(reader, server)


def test_unauthenticated_frame_is_refused(tcp_pair) -> None:
    reader, server = tcp_pair
    r = server.register(bytearray(b"s" * 64))
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.recv(64)  # the challenge
        frame = struct.pack("<IHHII", MAGIC, OP_READ, 1, 1, 0) + struct.pack("<QQII", r.addr, 8, r.rkey, 0) * 3
        data = send_then_drain(s, frame, half_close=False)  # a reset is a refusal too
        assert b"s" not in data  # closed without serving a byte
    _still_serves(reader, server)


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<IHHII", 0xDEADBEEF, OP_READ, 1, 1, 0),  # bad magic
        struct.pack("<IHHII", MAGIC, 7, 1, 1, 0),  # unknown op
        struct.pack("<IHHII", MAGIC, OP_READ, 0, 1, 0),  # empty frame
        struct.pack("<IHHII", MAGIC, OP_READ, 257, 1, 0),  # too many items
        struct.pack("<IHHII", MAGIC, OP_READ, 2, 1, 0) + b"\0" * 30,  # truncated, then EOF
    ],
)
def test_malformed_frames_close_that_connection_only(tcp_pair, frame: bytes) -> None:
    reader, server = tcp_pair
    with _raw_client(server) as s:
        assert send_then_drain(s, frame) == b""  # the responder hung up without a reply
    _still_serves(reader, server)


def test_raw_client_gets_per_item_statuses(tcp_pair) -> None:
    _, server = tcp_pair
    r = server.register(bytearray(range(256)))
    s = _raw_client(server)
    items = [(r.addr + 10, 5, r.rkey), ((1 << 64) - 1, 2, r.rkey), (r.addr, 1, r.rkey ^ 1)]
    req = struct.pack("<IHHII", MAGIC, OP_READ, 3, 42, 0) + b"".join(
        struct.pack("<QQII", a, n, k, 0) for a, n, k in items
    )
    s.sendall(req)
    s.settimeout(5)
    want = 24 + 3 + 5
    data = b""
    while len(data) < want:
        data += s.recv(want - len(data))
    magic, op, count, seq, _, total = struct.unpack_from("<IHHIIQ", data)
    assert (magic, op, count, seq, total) == (MAGIC, OP_READ, 3, 42, 5)
    assert list(data[24:27]) == [Status.OK, Status.OUT_OF_BOUNDS, Status.BAD_RKEY]
    assert data[27:] == bytes(range(10, 15))
    s.close()


def test_handshake_is_mutual() -> None:
    a, b = socket.socketpair()
    token = load_token(TOKEN)
    with a, b:
        err: list[BaseException] = []

        def serve() -> None:
            try:
                server_handshake(a, token, b"ctx", 5.0)
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=serve)
        t.start()
        client_handshake(b, token, b"ctx", 5.0)
        t.join(5)
        assert not err
    # A different context (another service) does not authenticate.
    a, b = socket.socketpair()
    with a, b:
        server_err: list[BaseException] = []

        def refuse() -> None:
            try:
                server_handshake(a, token, b"rpc", 5.0)
            except AuthError as e:
                server_err.append(e)
            a.close()  # as the server does after a failed handshake

        t = threading.Thread(target=refuse)
        t.start()
        with pytest.raises(AuthError):
            client_handshake(b, token, b"transport", 5.0)
        t.join(5)
        assert server_err


def test_token_checks(monkeypatch) -> None:
    monkeypatch.delenv("HIRADIX_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no cluster token"):
        load_token()
    with pytest.raises(ValueError, match="at least 16"):
        load_token("short")
    monkeypatch.setenv("HIRADIX_CLUSTER_TOKEN", "from-the-environment-123")
    assert load_token() == b"from-the-environment-123"


# -- fake NIC --------------------------------------------------------------------------------


@pytest.fixture
def fake_pair():
    fabric = FakeFabric(FakeClock())
    a, b = FakeTransport(fabric, "reader"), FakeTransport(fabric, "server")
    yield fabric, a, b
    a.close()
    b.close()


def _ops(r, lr, n: int, page: int) -> list[ReadOp]:
    return [ReadOp(r.addr + i * page, r.rkey, page, lr.addr + i * page) for i in range(n)]


def test_fake_fail_nth_flushes_the_rest_and_reconnects(fake_pair) -> None:
    _, reader, server = fake_pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    r, lr = server.register(src), reader.register(dst)
    reader.fail_nth_read(2)
    got = reader.read_batch("server", _ops(r, lr, 4, 1024))
    assert got == [Status.OK] + [Status.CHANNEL_ERROR] * 3
    assert np.array_equal(dst[:1024], src[:1024]) and not dst[1024:].any()
    assert reader.stats.channels_discarded == 1
    assert reader.read_batch("server", _ops(r, lr, 4, 1024)) == [Status.OK] * 4
    assert reader.stats.channels_opened == 2
    assert np.array_equal(dst, src)


def test_fake_remote_access_error_reposts_on_a_fresh_qp(fake_pair) -> None:
    _, reader, server = fake_pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    r, lr = server.register(src), reader.register(dst)
    ops = _ops(r, lr, 4, 1024)
    ops[1] = ops[1]._replace(rkey=r.rkey ^ 1)
    assert reader.read_batch("server", ops) == [Status.OK, Status.BAD_RKEY, Status.OK, Status.OK]
    assert reader.stats.channels_discarded == 1 and reader.stats.channels_opened == 2


def test_fake_delay_times_out_on_the_virtual_clock(fake_pair) -> None:
    fabric, _, server = fake_pair
    slow = FakeTransport(fabric, "slow", delay=lambda op: 0.4)
    try:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros_like(src)
        r, lr = server.register(src), slow.register(dst)
        got = slow.read_batch("server", _ops(r, lr, 4, 1024), timeout=1.0)
        assert got == [Status.OK, Status.OK, Status.TIMEOUT, Status.TIMEOUT]
        assert slow.stats.channels_discarded == 1
    finally:
        slow.close()


def test_fake_detached_peer_is_unreachable(fake_pair) -> None:
    fabric, reader, server = fake_pair
    r, lr = server.register(bytearray(64)), reader.register(bytearray(64))
    fabric.detach("server")
    assert reader.read_batch("server", [(r.addr, r.rkey, 8, lr.addr)]) == [Status.PEER_UNREACHABLE]
    with pytest.raises(ValueError, match="already attached"):
        FakeTransport(fabric, "reader")
    with pytest.raises(ValueError):
        reader.fail_nth_read(0)


# ---------------------------------------------------------------------- hostile responder
_RESP = struct.Struct("<IHHIIQ")


def _hostile(reply: Callable[[int, int], bytes]) -> TcpTransport:
    """A responder whose frames are answered with ``reply(count, seq)`` instead of data."""
    t = TcpTransport(TOKEN)

    def serve_frame(conn: socket.socket, count: int, seq: int, body: memoryview) -> None:
        conn.sendall(reply(count, seq))
        conn.shutdown(socket.SHUT_WR)  # then EOF: a reader waiting for more sees the channel end

    t._serve_frame = serve_frame  # type: ignore[method-assign]
    return t


_reply_parts = st.tuples(
    st.sampled_from(["valid-header", "random"]),
    st.integers(0, 2**32 - 1),  # magic when random
    st.lists(st.integers(0, 255), max_size=6),  # statuses (may be the wrong count)
    st.integers(0, 2**64 - 1),  # total
    st.binary(max_size=96),  # payload bytes that follow
    st.booleans(),  # right sequence number
)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@given(parts=_reply_parts)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reader_survives_any_response(native: bool, parts) -> None:  # type: ignore[no-untyped-def]
    """Whatever a responder sends back, the reader reports per-item statuses, writes no byte
    outside the destinations it asked for, and never reports OK for bytes that did not come."""
    if native and tcpmod._tcpio is None:
        pytest.skip("the compiled TCP data plane is not built (pure-Python run)")
    kind, magic, codes, total, payload, right_seq = parts

    def reply(count: int, seq: int) -> bytes:
        if kind == "random":
            return struct.pack("<I", magic) + bytes(codes) + payload
        head = _RESP.pack(MAGIC, OP_READ, count, seq if right_seq else seq ^ 1, 0, total)
        return head + bytes(codes) + payload

    server = _hostile(reply)
    reader = TcpTransport(TOKEN, native=native, timeout=2.0)
    try:
        buf = np.full(3 * 64, 0xAB, dtype=np.uint8)  # 64 guard bytes on each side
        reader.register(buf)
        dst = buf.ctypes.data + 64
        ops = [(4096, 7, 16, dst), (8192, 7, 48, dst + 16)]
        st_ = reader.read_batch(server.address, ops)
        assert len(st_) == 2 and all(isinstance(s, Status) for s in st_)
        assert (buf[:64] == 0xAB).all() and (buf[128:] == 0xAB).all()
        if Status.OK in st_:
            # Only a well-formed frame whose statuses and total match its payload counts.
            assert kind == "valid-header" and right_seq and len(codes) == 2
    finally:
        reader.close()
        server.close()


_item = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))


@given(
    count=st.integers(0, 300),
    items=st.lists(_item, max_size=5),
    aim=st.lists(st.tuples(st.integers(-8, 300), st.integers(0, 300)), max_size=4),
    tail=st.binary(max_size=40),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_responder_survives_any_request(tcp_pair, count: int, items, aim, tail: bytes) -> None:  # type: ignore[no-untyped-def]
    """Request frames with any count, any (addr, length, rkey) items, near misses of a real
    region and trailing garbage: the responder answers per-item statuses or hangs up, serves
    only bytes of the region, and keeps serving everyone else."""
    reader, server = tcp_pair
    region = bytes(range(256))
    r = server.register(bytearray(region))
    near = [(r.addr + off, n, r.rkey) for off, n in aim if r.addr + off >= 0]
    body = [*items, *near]
    frame = struct.pack("<IHHII", MAGIC, OP_READ, count, 7, 0)
    frame += b"".join(struct.pack("<QQII", a, n, k, 0) for a, n, k in body) + tail
    # It may hang up at any moment (with our garbage unread: a reset, not a FIN), even
    # before we half-close; whatever it sent before that is still checked.
    with _raw_client(server) as s:
        data = send_then_drain(s, frame)
    if data:  # answered: a well-formed reply whose payload is exactly the OK items' bytes
        magic, op, n, seq, _, total = struct.unpack_from("<IHHIIQ", data)
        assert (magic, op, seq) == (MAGIC, OP_READ, 7) and 0 < n <= 256 and n == count
        codes = data[24 : 24 + n]
        sent = (body + [(0, 0, 0)] * n)[:n]  # items the frame held (zero-padded by tail bytes)
        want = b""
        for code, (a, ln, k) in zip(codes, sent, strict=True):
            assert code <= Status.INVALID
            if code == Status.OK and k == r.rkey:
                want += region[a - r.addr : a - r.addr + ln]
        assert total == len(data) - 24 - n and (not want or data[24 + n : 24 + n + len(want)] == want)
    _still_serves(reader, server)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_channel_the_responder_closed_while_pooled_is_replaced(native: bool) -> None:
    """The responder closes channels idle for its idle_timeout (and a restart closes them
    all): the reader's next batch must not come back as CHANNEL_ERROR misses."""
    if native and tcpmod._tcpio is None:
        pytest.skip("the compiled TCP data plane is not built (pure-Python run)")
    server = TcpTransport(TOKEN, idle_timeout=0.2)
    reader = TcpTransport(TOKEN, native=native, timeout=10.0)
    try:
        r = server.register(bytearray(b"z" * 64))
        buf = bytearray(64)
        lr = reader.register(buf)
        assert reader.read_batch(server.address, [(r.addr, r.rkey, 64, lr.addr)]) == [Status.OK]
        (ch,) = reader._pool._free[server.address]
        assert select.select([ch.sock], [], [], 10.0)[0], "the responder never closed the idle channel"
        buf[:] = bytes(64)
        assert reader.read_batch(server.address, [(r.addr, r.rkey, 64, lr.addr)]) == [Status.OK]
        assert bytes(buf) == b"z" * 64
        assert server.listener_stats.timed_out >= 1 and reader.stats.channels_opened == 2
    finally:
        reader.close()
        server.close()
