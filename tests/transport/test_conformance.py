"""One conformance suite for every transport (the cachetools ``CacheTestMixin`` idea, as a
parametrized fixture): TCP over loopback, the in-process fake NIC, the RDMA transport on
fake verbs (``rdma-fake``: its whole Python logic and the TCP bootstrap, fake HCAs) and on
real verbs (``rdma``: only where ``/sys/class/infiniband`` has an ACTIVE port; it skips
saying why elsewhere, and ``REQUIRE_RDMA=1`` turns that skip into a failure).

Nothing here sleeps to order events: in-flight reads are held at a gate (the responder
hook waits on an event) and released by the test; timeouts against the fake use its
manual clock.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hiradix.transport import (
    Capabilities,
    FakeClock,
    FakeFabric,
    FakeTransport,
    InjectedFault,
    RegionBusyError,
    Status,
    TcpTransport,
    Transport,
)
from hiradix.transport.fake import FakeVerbs
from hiradix.transport.rdma import RdmaTransport, rdma_unavailable_reason

pytestmark = pytest.mark.timeout(60)

TOKEN = b"conformance-token-0123456789abcdef"
WAIT = 10.0  # bound on every event wait; never reached when the code is right


class Harness:
    """Builds transports of one kind and tears them down."""

    kind = ""
    transport_kind = ""  #: what the transport declares in ``capabilities.kind``
    #: The responder runs ``responder_hook`` per read (false for one-sided READ on a
    #: real NIC, where no responder code runs).
    hooks = True

    def __init__(self) -> None:
        self.made: list[Transport] = []

    def make(self, **kw: object) -> Transport:
        raise NotImplementedError

    def silent_peer(self) -> str:
        """An address that accepts but never answers."""
        raise NotImplementedError

    def close(self) -> None:
        for t in self.made:
            t.close()


class TcpHarness(Harness):
    kind = transport_kind = "tcp"

    def __init__(self) -> None:
        super().__init__()
        self.socks: list[socket.socket] = []

    def make(self, **kw: object) -> Transport:
        t = TcpTransport(TOKEN, **kw)  # type: ignore[arg-type]
        self.made.append(t)
        return t

    def silent_peer(self) -> str:
        s = socket.create_server(("127.0.0.1", 0))
        self.socks.append(s)
        return f"127.0.0.1:{s.getsockname()[1]}"

    def close(self) -> None:
        super().close()
        for s in self.socks:
            s.close()


class TcpPythonHarness(TcpHarness):
    """TCP through the Python loops (``native=False``): the twin of the compiled data
    plane, speaking the same wire format."""

    kind = "tcp-py"
    transport_kind = "tcp"

    def make(self, **kw: object) -> Transport:
        kw.setdefault("native", False)
        return super().make(**kw)


class FakeHarness(Harness):
    kind = transport_kind = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.fabric = FakeFabric(self.clock)

    def make(self, **kw: object) -> Transport:
        t = FakeTransport(self.fabric, **kw)  # type: ignore[arg-type]
        self.made.append(t)
        return t

    def silent_peer(self) -> str:
        t = self.make()
        clock = self.clock

        def stall(rkeys: Sequence[int]) -> None:
            clock.advance(3600.0)  # the peer answers an hour later

        t.responder_hook = stall
        t.register(bytearray(64))
        return t.address


class RdmaFakeHarness(TcpHarness):
    """The RDMA transport on fake verbs: its bootstrap over loopback TCP, its state
    machine, flow control and status mapping over fake HCAs."""

    kind = "rdma-fake"
    transport_kind = "rdma"

    def __init__(self) -> None:
        super().__init__()
        self.verbs = FakeVerbs(FakeFabric())

    def make(self, **kw: object) -> Transport:
        t = RdmaTransport(TOKEN, provider=self.verbs, **kw)  # type: ignore[arg-type]
        self.made.append(t)
        return t


class RdmaHarness(TcpHarness):
    """The RDMA transport on the NIC (libibverbs)."""

    kind = transport_kind = "rdma"
    hooks = False

    def __init__(self) -> None:
        reason = rdma_unavailable_reason()
        if reason is not None:
            if os.environ.get("REQUIRE_RDMA", "") not in ("", "0"):
                pytest.fail(f"REQUIRE_RDMA is set but RDMA is unavailable: {reason}")
            pytest.skip(f"rdma: {reason}")
        super().__init__()

    def make(self, **kw: object) -> Transport:
        t = RdmaTransport(TOKEN, **kw)  # type: ignore[arg-type]
        self.made.append(t)
        return t


HARNESSES: dict[str, Callable[[], Harness]] = {
    "tcp": TcpHarness,
    "tcp-py": TcpPythonHarness,
    "fake": FakeHarness,
    "rdma-fake": RdmaFakeHarness,
    "rdma": RdmaHarness,
}


def needs_hooks(h: Harness) -> None:
    if not h.hooks:
        pytest.skip(f"{h.kind}: a one-sided READ on a real NIC runs no responder code, so no hook can gate or fail it")


@pytest.fixture(params=sorted(HARNESSES))
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    harness = HARNESSES[request.param]()
    yield harness
    harness.close()


def _pair(h: Harness, **reader_kw: object) -> tuple[Transport, Transport]:
    return h.make(**reader_kw), h.make()


def _pages(n: int, page: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n * page, dtype=np.uint8)


class Gate:
    """A responder hook that holds the first ``hold`` reads until :meth:`open`."""

    def __init__(self, hold: int = 1) -> None:
        self.hold = hold
        self.entered = 0
        self.cond = threading.Condition()
        self.released = threading.Event()

    def __call__(self, rkeys: Sequence[int]) -> None:
        with self.cond:
            if self.entered >= self.hold:
                return
            self.entered += 1
            self.cond.notify_all()
        assert self.released.wait(WAIT), "gate never opened"

    def wait_entered(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered >= n, WAIT), f"only {self.entered} reads entered"

    def open(self) -> None:
        self.released.set()


class Runner(threading.Thread):
    """Runs ``fn`` in a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: object = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:
            self.error = e

    def value(self) -> object:
        self.join(WAIT)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


# -- basics ---------------------------------------------------------------------------------


def test_capabilities_are_declared(h: Harness) -> None:
    t = h.make()
    caps = type(t).capabilities
    assert isinstance(caps, Capabilities)
    assert caps.kind == h.transport_kind and caps.releases_gil and caps.local_memcpy


def test_round_trip_gathers_pages_in_any_order(h: Harness) -> None:
    reader, server = _pair(h)
    page, n = 4096, 600  # > one TCP frame of 256 items: several frames and channels
    src = _pages(n, page, seed=1)
    dst = np.zeros_like(src)
    r = server.register(src)
    lr = reader.register(dst)
    order = np.random.default_rng(2).permutation(n)
    ops = [(r.addr + int(p) * page, r.rkey, page, lr.addr + i * page) for i, p in enumerate(order)]
    assert reader.read_batch(server.address, ops) == [Status.OK] * n
    assert np.array_equal(dst.reshape(n, page), src.reshape(n, page)[order])


def test_on_landed_reports_every_item_once_with_its_final_status(h: Harness) -> None:
    reader, server = _pair(h, frame_bytes=64 << 10) if h.transport_kind == "tcp" else _pair(h)
    page, n = 4096, 600  # several frames and channels on TCP
    src = _pages(n, page, seed=3)
    dst = np.zeros_like(src)
    r = server.register(src)
    lr = reader.register(dst)
    raddr = r.addr + np.arange(n, dtype=np.uint64) * page
    laddr = lr.addr + np.arange(n, dtype=np.uint64) * page
    rkey = np.full(n, r.rkey, dtype=np.uint32)
    rkey[7] ^= 1  # one bad rkey, one destination outside every region, one oversized item
    laddr[9] = 8
    length = np.full(n, page, dtype=np.uint64)
    length[11] = (1 << 30) + 1
    seen = np.zeros(n, dtype=np.int64)
    reported = np.zeros(n, dtype=np.uint8)
    lock = threading.Lock()

    def on_landed(items: np.ndarray, statuses: np.ndarray) -> None:
        # Whatever a call reports as OK has landed already.
        for i in items[statuses == Status.OK].tolist():
            assert np.array_equal(dst[i * page : (i + 1) * page], src[i * page : (i + 1) * page])
        with lock:
            np.add.at(seen, items, 1)
            reported[items] = statuses

    st = reader.read_batch_arrays(server.address, raddr, rkey, length, laddr, on_landed=on_landed)
    assert (seen == 1).all()
    assert np.array_equal(reported, st)
    assert st[7] == Status.BAD_RKEY and st[9] == Status.BAD_LOCAL and st[11] == Status.INVALID
    assert (np.delete(st, [7, 9, 11]) == Status.OK).all()


def test_on_landed_exception_propagates_and_the_transport_recovers(h: Harness) -> None:
    reader, server = _pair(h)
    src = _pages(64, 4096, seed=4)
    dst = np.zeros_like(src)
    r, lr = server.register(src), reader.register(dst)
    cols = (
        r.addr + np.arange(64, dtype=np.uint64) * 4096,
        np.full(64, r.rkey, dtype=np.uint32),
        np.full(64, 4096, dtype=np.uint64),
        lr.addr + np.arange(64, dtype=np.uint64) * 4096,
    )

    def boom(items: np.ndarray, statuses: np.ndarray) -> None:
        raise KeyError("caller bug")

    with pytest.raises(KeyError, match="caller bug"):
        reader.read_batch_arrays(server.address, *cols, on_landed=boom)
    dst[:] = 0
    assert (reader.read_batch_arrays(server.address, *cols) == Status.OK).all()
    assert np.array_equal(dst, src)


def test_register_accepts_buffers_and_rejects_bad_ones(h: Harness) -> None:
    torch = pytest.importorskip("torch")
    reader, server = _pair(h)
    tensor = torch.arange(1024, dtype=torch.float16)
    r = server.register(tensor)
    assert r.length == 2048 and r.addr == tensor.data_ptr()
    ba = bytearray(2048)
    lr = reader.register(ba)
    assert lr.length == 2048
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 2048, lr.addr)]) == [Status.OK]
    assert bytes(ba) == tensor.numpy().tobytes()
    assert reader.register(memoryview(bytearray(8))).length == 8
    with pytest.raises(ValueError, match="read-only"):
        server.register(b"immutable")
    with pytest.raises(ValueError, match="empty"):
        server.register(bytearray())
    with pytest.raises(ValueError, match="contiguous"):
        server.register(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        server.register(torch.zeros(8, 8).t())
    with pytest.raises(TypeError):
        server.register(12345)
    with pytest.raises(ValueError, match="overlaps"):
        reader.register(memoryview(ba)[10:20])


def test_bad_arguments_raise(h: Harness) -> None:
    reader, server = _pair(h)
    with pytest.raises(ValueError):
        reader.read_batch(server.address, [(1, 2, 3)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        reader.read_batch(server.address, [(1.0, 2, 3, 4)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        reader.read_batch(server.address, [], timeout=0)
    with pytest.raises(KeyError):
        server.deregister(12345)
    assert reader.read_batch(server.address, []) == []
    # numpy integers are integers too (offsets often come from index arrays).
    r = server.register(bytearray(b"n" * 64))
    lr = reader.register(bytearray(64))
    op = (np.uint64(r.addr), np.int64(r.rkey), np.int32(8), np.uint64(lr.addr))
    assert reader.read_batch(server.address, [op]) == [Status.OK]  # type: ignore[list-item]


# -- per-item errors --------------------------------------------------------------------------


def test_mixed_batch_reports_per_item_and_server_keeps_serving(h: Harness) -> None:
    reader, server = _pair(h)
    page = 1024
    src = _pages(8, page, seed=3)
    dst = np.zeros(16 * page, dtype=np.uint8)
    r = server.register(src)
    lr = reader.register(dst)
    end = r.addr + r.length
    ops = [
        (r.addr, r.rkey, page, lr.addr),  # OK
        (r.addr, r.rkey ^ 0x5A5A5A5A, page, lr.addr + page),  # wrong rkey
        (end - 10, r.rkey, page, lr.addr + 2 * page),  # runs past the end
        (r.addr - 1, r.rkey, page, lr.addr + 3 * page),  # starts before the region
        ((1 << 64) - 16, r.rkey, 32, lr.addr + 4 * page),  # addr + len overflows u64
        (end + page, r.rkey, page, lr.addr + 5 * page),  # starts after the end
        (r.addr + page, r.rkey, page, lr.addr + 6 * page),  # OK
        (r.addr, r.rkey, page, lr.addr + 16 * page),  # destination outside the receive region
        (r.addr, r.rkey, (1 << 30) + 1, lr.addr),  # longer than any item may be
        (r.addr + 7 * page, r.rkey, page, lr.addr + 7 * page),  # OK, last page exactly
        (end, r.rkey, 0, lr.addr + 8 * page),  # empty read at the very end: OK
    ]
    got = reader.read_batch(server.address, ops)
    assert got == [
        Status.OK,
        Status.BAD_RKEY,
        Status.OUT_OF_BOUNDS,
        Status.OUT_OF_BOUNDS,
        Status.OUT_OF_BOUNDS,
        Status.OUT_OF_BOUNDS,
        Status.OK,
        Status.BAD_LOCAL,
        Status.INVALID,
        Status.OK,
        Status.OK,
    ]
    view = dst.reshape(16, page)
    assert np.array_equal(view[0], src[:page])
    assert np.array_equal(view[6], src[page : 2 * page])
    assert np.array_equal(view[7], src[7 * page :])
    assert not view[1:6].any()  # nothing was written for the rejected items
    # The responder is still serving.
    assert reader.read_batch(server.address, ops[:1]) == [Status.OK]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.tuples(st.integers(-300, 1300), st.integers(0, 1300)), min_size=1, max_size=12))
def test_bounds_match_a_model(h: Harness, items: list[tuple[int, int]]) -> None:
    if not h.made:
        h.made += [h.make(), h.make()]
    reader, server = h.made[0], h.made[1]
    src = np.arange(1024, dtype=np.uint32).view(np.uint8)[:1024].copy()
    dst = np.zeros(1300 * 12, dtype=np.uint8)
    r = server.register(src)
    lr = reader.register(dst)
    try:
        ops = [(r.addr + off, r.rkey, n, lr.addr + 1300 * i) for i, (off, n) in enumerate(items)]
        got = reader.read_batch(server.address, ops)
        for i, ((off, n), status) in enumerate(zip(items, got, strict=True)):
            fits = off >= 0 and off + n <= 1024
            assert status == (Status.OK if fits else Status.OUT_OF_BOUNDS), (off, n, status)
            if fits:
                assert np.array_equal(dst[1300 * i : 1300 * i + n], src[off : off + n])
    finally:
        server.deregister(r.rkey)
        reader.deregister(lr.rkey)


def test_deregistered_rkey_is_rejected(h: Harness) -> None:
    reader, server = _pair(h)
    r = server.register(bytearray(4096))
    lr = reader.register(bytearray(4096))
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 10, lr.addr)]) == [Status.OK]
    server.deregister(r.rkey)
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 10, lr.addr)]) == [Status.BAD_RKEY]
    reader.deregister(lr.rkey)
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 10, lr.addr)]) == [Status.BAD_LOCAL]


# -- deregister vs in-flight reads --------------------------------------------------------------


def test_deregister_waits_for_reads_in_flight(h: Harness) -> None:
    needs_hooks(h)
    reader, server = _pair(h)
    src = _pages(4, 4096, seed=4)
    dst = np.zeros_like(src)
    r = server.register(src)
    lr = reader.register(dst)
    gate = Gate()
    server.responder_hook = gate
    ops = [(r.addr + i * 4096, r.rkey, 4096, lr.addr + i * 4096) for i in range(4)]
    read = Runner(lambda: reader.read_batch(server.address, ops))
    gate.wait_entered(1)
    # Both the source region (remote side) and the destination (local side) are busy.
    with pytest.raises(RegionBusyError):
        server.deregister(r.rkey, timeout=0)
    with pytest.raises(RegionBusyError):
        reader.deregister(lr.rkey, timeout=0)
    # A blocking deregister returns only after the gate opened and the read drained.
    opened = threading.Event()
    seen_open: list[bool] = []
    dereg = Runner(lambda: (server.deregister(r.rkey), seen_open.append(opened.is_set())))
    opened.set()
    gate.open()
    assert read.value() == [Status.OK] * 4
    dereg.value()
    assert seen_open == [True]
    assert np.array_equal(src, dst)
    reader.deregister(lr.rkey)
    lr2 = reader.register(dst)
    assert reader.read_batch(server.address, [(r.addr, r.rkey, 1, lr2.addr)]) == [Status.BAD_RKEY]


# -- local reads ------------------------------------------------------------------------------


def test_local_read_is_a_memcpy(h: Harness) -> None:
    t = h.make()
    src = _pages(3, 1000, seed=5)
    dst = np.zeros_like(src)
    r = t.register(src)
    lr = t.register(dst)
    ops = [(r.addr + 1000 * i, r.rkey, 1000, lr.addr + 1000 * (2 - i)) for i in range(3)]
    ops.append((r.addr, r.rkey + 1, 10, lr.addr))
    assert t.read_batch(t.address, ops) == [Status.OK] * 3 + [Status.BAD_RKEY]
    assert np.array_equal(dst.reshape(3, 1000), src.reshape(3, 1000)[::-1])
    assert t.stats.local_items == 4 and t.stats.remote_items == 0
    assert t.stats.channels_opened == 0


# -- channels ---------------------------------------------------------------------------------


def test_channel_error_discards_and_reconnects(h: Harness) -> None:
    needs_hooks(h)
    reader, server = _pair(h)
    src = _pages(4, 4096, seed=6)
    dst = np.zeros_like(src)
    r = server.register(src)
    lr = reader.register(dst)
    ops = [(r.addr + i * 4096, r.rkey, 4096, lr.addr + i * 4096) for i in range(4)]
    assert reader.read_batch(server.address, ops) == [Status.OK] * 4
    opened = reader.stats.channels_opened
    fired: list[bool] = []

    def fault(rkeys: Sequence[int]) -> None:
        if not fired:
            fired.append(True)
            raise InjectedFault("injected")

    server.responder_hook = fault
    dst[:] = 0
    got = reader.read_batch(server.address, ops)
    assert Status.CHANNEL_ERROR in got and fired
    for i, s in enumerate(got):  # an OK item has its bytes, whatever else failed
        assert s in (Status.OK, Status.CHANNEL_ERROR)
        if s == Status.OK:
            assert np.array_equal(dst[i * 4096 : (i + 1) * 4096], src[i * 4096 : (i + 1) * 4096])
    assert reader.stats.channels_discarded >= 1
    dst[:] = 0
    assert reader.read_batch(server.address, ops) == [Status.OK] * 4
    assert np.array_equal(src, dst)
    assert reader.stats.channels_opened > opened


def test_channel_cap_is_respected(h: Harness) -> None:
    needs_hooks(h)
    reader = h.make(max_channels_per_peer=2)
    server = h.make()
    src = _pages(4, 256, seed=7)
    dst = np.zeros_like(src)
    r = server.register(src)
    lr = reader.register(dst)
    gate = Gate(hold=2)
    server.responder_hook = gate
    runners = [
        Runner(lambda i=i: reader.read_batch(server.address, [(r.addr + 256 * i, r.rkey, 256, lr.addr + 256 * i)]))
        for i in range(4)
    ]
    gate.wait_entered(2)
    assert reader.open_channels(server.address) == 2  # type: ignore[attr-defined]
    gate.open()
    assert [x.value() for x in runners] == [[Status.OK]] * 4
    assert np.array_equal(src, dst)
    assert reader.stats.channels_opened == 2
    assert reader.open_channels(server.address) <= 2  # type: ignore[attr-defined]


def test_concurrent_readers_get_their_own_bytes(h: Harness) -> None:
    reader, server = _pair(h, max_channels_per_peer=3)
    page, n = 2048, 64
    src = _pages(n, page, seed=8)
    r = server.register(src)
    dsts = [np.zeros_like(src) for _ in range(6)]
    lrs = [reader.register(d) for d in dsts]

    def work(k: int) -> list[Status]:
        order = np.random.default_rng(k).permutation(n)
        ops = [(r.addr + int(p) * page, r.rkey, page, lrs[k].addr + int(p) * page) for p in order]
        return reader.read_batch(server.address, ops)

    runners = [Runner(lambda k=k: work(k)) for k in range(6)]
    assert all(x.value() == [Status.OK] * n for x in runners)
    assert all(np.array_equal(d, src) for d in dsts)
    assert reader.open_channels(server.address) <= 3  # type: ignore[attr-defined]


# -- peers that go away or go silent -------------------------------------------------------------


def test_peer_gone_reports_an_error_without_hanging(h: Harness) -> None:
    reader, server = _pair(h)
    r = server.register(bytearray(4096))
    lr = reader.register(bytearray(4096))
    op = [(r.addr, r.rkey, 100, lr.addr)]
    assert reader.read_batch(server.address, op) == [Status.OK]
    server.close()
    t0 = time.monotonic()
    # A pooled channel to the dead peer may report the break first; then the peer is gone.
    assert reader.read_batch(server.address, op, timeout=2.0)[0] in (Status.PEER_UNREACHABLE, Status.CHANNEL_ERROR)
    assert reader.read_batch(server.address, op, timeout=2.0) == [Status.PEER_UNREACHABLE]
    assert time.monotonic() - t0 < 4.0


def test_unknown_peer_is_unreachable(h: Harness) -> None:
    reader = h.make()
    lr = reader.register(bytearray(64))
    peer = "127.0.0.1:1" if h.transport_kind == "tcp" else "nobody"
    assert reader.read_batch(peer, [(0, 1, 8, lr.addr)], timeout=2.0) == [Status.PEER_UNREACHABLE]


def test_silent_peer_times_out_within_the_deadline(h: Harness) -> None:
    reader = h.make()
    lr = reader.register(bytearray(64))
    peer = h.silent_peer()
    t0 = time.monotonic()
    assert reader.read_batch(peer, [(0, 1, 8, lr.addr)], timeout=0.3) == [Status.TIMEOUT]
    assert time.monotonic() - t0 < 2.3
