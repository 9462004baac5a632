"""The RDMA transport's own tests: the compiled verbs binding (loads, reports "no device"
cleanly, builds chains right), the fake verbs' RC semantics (ERR + flush, ordering, depth,
partial chains), and RdmaTransport's logic on them (flow control, QP reset and re-post,
status mapping, table refreshes, what is registered). The shared contract is in
``test_transport_conformance.py``.
"""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from hiradix._native import load
from hiradix.transport import FakeClock, FakeFabric, Status, TransportError
from hiradix.transport.fake import (
    CAUSE_NONE,
    CAUSE_REMOTE_ACCESS,
    CAUSE_TIMEOUT,
    QPS_ERR,
    QPS_RTS,
    WC_REM_ACCESS_ERR,
    WC_SUCCESS,
    WC_WR_FLUSH_ERR,
    FakeHca,
    FakeQp,
    FakeVerbs,
)
from hiradix.transport.rdma import RdmaTransport, RdmaUnavailableError, rdma_unavailable_reason

pytestmark = pytest.mark.timeout(60)

TOKEN = b"rdma-tests-token-0123456789abcdef"
_verbs = load("hiradix.transport._verbs")
needs_binding = pytest.mark.skipif(
    _verbs is None, reason="hiradix.transport._verbs is not built (no libibverbs headers, or HIRADIX_PUREPYTHON=1)"
)


# -- the compiled binding -----------------------------------------------------------------------


@needs_binding
def test_binding_loads_and_reports_no_device_cleanly() -> None:
    if rdma_unavailable_reason() is None:
        pytest.skip("this machine has an ACTIVE RDMA port; the no-device path cannot be shown here")
    assert _verbs is not None
    names = _verbs.device_names()
    assert isinstance(names, list)
    if not names:
        with pytest.raises(_verbs.VerbsError, match="no RDMA device"):
            _verbs.Device()
    with pytest.raises(RdmaUnavailableError, match="RDMA transport unavailable: no"):
        RdmaTransport(TOKEN)


@needs_binding
def test_binding_statuses_are_the_transport_statuses() -> None:
    assert _verbs is not None
    assert _verbs.STATUS_OK == Status.OK
    assert (_verbs.CAUSE_NONE, _verbs.CAUSE_REMOTE_ACCESS, _verbs.CAUSE_TIMEOUT) == (0, 1, 3)
    assert _verbs.wc_status_str(WC_REM_ACCESS_ERR) == "remote access error"
    assert (_verbs.QPS_RTS, _verbs.QPS_ERR) == (QPS_RTS, QPS_ERR)  # the fake uses verbs' numbers


@needs_binding
def test_wr_chain_builds_linked_reads_signalling_every_kth_and_the_last() -> None:
    assert _verbs is not None
    n = 10
    chain = _verbs.WrChain(16)
    i = np.arange(n, dtype=np.uint64)
    laddr, raddr = 1000 + i * 64, 5000 + i * 128
    length = np.full(n, 64, dtype=np.uint64)
    rkey = np.arange(n, dtype=np.uint32) + 7
    lkey = np.full(n, 3, dtype=np.uint32)
    assert chain.fill(laddr, raddr, length, rkey, lkey, 4, 2) == 2 * n
    got = [chain.describe(k) for k in range(n)]
    assert [g[0] for g in got] == list(range(n))  # wr_id = item index
    assert [(g[1], g[2], g[3], g[4], g[5]) for g in got] == [
        (5000 + 128 * k, 7 + k, 1000 + 64 * k, 64, 3) for k in range(n)
    ]
    assert [k for k, g in enumerate(got) if g[6]] == [3, 7, 9]  # every 4th, and the last
    assert [g[7] for g in got] == [True] * (n - 1) + [False]  # linked, last ends the chain
    with pytest.raises(ValueError, match="do not fit"):
        chain.fill(*(np.zeros(17, dtype=d) for d in (np.uint64,) * 3 + (np.uint32,) * 2))


# -- availability ---------------------------------------------------------------------------------


def test_unavailable_reason_reads_sysfs(tmp_path: Path) -> None:
    missing = rdma_unavailable_reason(tmp_path / "nothing")
    assert missing is not None
    if _verbs is None:
        assert "libibverbs" in missing or "HIRADIX_PUREPYTHON" in missing
        return
    assert "does not exist" in missing
    assert rdma_unavailable_reason(tmp_path) == f"no RDMA device: {tmp_path} is empty"
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    assert rdma_unavailable_reason(tmp_path) == "no ACTIVE RDMA port (mlx5_0/1: 1: DOWN)"
    (port / "state").write_text("4: ACTIVE\n")
    assert rdma_unavailable_reason(tmp_path) is None


# -- fake verbs: RC semantics ---------------------------------------------------------------------


class Pair:
    """Two fake HCAs with a connected queue pair each way and registered buffers."""

    def __init__(self, depth: int = 16, clock: FakeClock | None = None) -> None:
        self.fabric = FakeFabric(clock)
        self.a, self.b = FakeHca(self.fabric), FakeHca(self.fabric)
        self.qa, self.qb = self.a.create_qp(depth, 1), self.b.create_qp(depth, 2)
        self.qa.connect(*self.qb.desc())
        self.qb.connect(*self.qa.desc())
        self.src = np.arange(4096, dtype=np.uint8) % 251
        self.dst = np.zeros(4096, dtype=np.uint8)
        self.rmr = self.b.reg_mr(memoryview(self.src), self.src.ctypes.data, 4096, True)
        self.lmr = self.a.reg_mr(memoryview(self.dst), self.dst.ctypes.data, 4096, False)

    def wr(self, k: int, rkey: int | None = None, signalled: bool = True) -> tuple[int, int, int, int, int, bool]:
        off = 256 * k
        rk = self.rmr.rkey if rkey is None else rkey
        return (k, self.dst.ctypes.data + off, self.src.ctypes.data + off, 256, rk, signalled)


def test_error_moves_the_qp_to_err_and_flushes_the_rest_of_the_chain() -> None:
    p = Pair()
    chain = [p.wr(0), p.wr(1, signalled=False), p.wr(2, rkey=p.rmr.rkey ^ 1, signalled=False), p.wr(3), p.wr(4)]
    assert p.qa.post_send(chain) == 0
    # The failing WR completes though unsignalled; every WR after it is flushed.
    assert p.qa.poll_cq(32) == [(0, WC_SUCCESS), (2, WC_REM_ACCESS_ERR), (3, WC_WR_FLUSH_ERR), (4, WC_WR_FLUSH_ERR)]
    assert p.qa.state == QPS_ERR
    assert np.array_equal(p.dst[:512], p.src[:512]) and not p.dst[512:].any()
    # A QP in ERR takes posts and flushes them at once.
    assert p.qa.post_send([p.wr(5)]) == 0
    assert p.qa.poll_cq(32) == [(5, WC_WR_FLUSH_ERR)]
    # Back through RESET it serves again.
    p.qa.reset(9)
    assert p.qa.post_send([p.wr(0)]) == errno.EINVAL  # INIT: not ready to send
    p.qa.connect(*p.qb.desc())
    assert p.qa.post_send([p.wr(6)]) == 0 and p.qa.poll_cq(32) == [(6, WC_SUCCESS)]


def test_completions_come_in_order_and_chains_complete_partially() -> None:
    p = Pair()
    p.a.wrs_per_poll = 2
    assert p.qa.post_send([p.wr(k, signalled=k % 2 == 1) for k in range(6)]) == 0
    assert p.qa.poll_cq(32) == [(1, WC_SUCCESS)]
    assert np.array_equal(p.dst[:512], p.src[:512]) and not p.dst[512:].any()  # a partial chain
    p.a.stall_after(1)
    assert p.qa.poll_cq(32) == []  # item 2 ran, unsignalled; then the link went quiet
    assert not p.dst[768:].any()
    p.a.stall_after(10)
    assert p.qa.poll_cq(32) == [(3, WC_SUCCESS)]
    assert p.qa.poll_cq(1) == [(5, WC_SUCCESS)]
    assert np.array_equal(p.dst[:1536], p.src[:1536])


def test_send_queue_depth_is_enforced_as_on_hardware() -> None:
    p = Pair(depth=4)
    assert p.qa.post_send([p.wr(k) for k in range(5)]) == errno.ENOMEM
    assert p.qa.post_send([p.wr(k) for k in range(4)]) == 0
    assert p.qa.post_send([p.wr(4)]) == errno.ENOMEM
    assert len(p.qa.poll_cq(32)) == 4
    assert p.qa.post_send([p.wr(4)]) == 0


def test_posted_reads_hold_the_region_until_they_are_done() -> None:
    from hiradix.transport import RegionBusyError

    p = Pair()
    p.a.stall_after(0)
    assert p.qa.post_send([p.wr(0), p.wr(1)]) == 0
    with pytest.raises(RegionBusyError):
        p.rmr.dereg(0)
    p.a.stall_after(10)
    assert p.qa.poll_cq(32) == [(0, WC_SUCCESS), (1, WC_SUCCESS)]
    p.rmr.dereg(0)  # the reads were done: no wait
    # The READs posted before the dereg finished; new ones find no region.
    p.qa.reset(3)
    p.qa.connect(*p.qb.desc())
    assert p.qa.post_send([p.wr(2)]) == 0
    assert p.qa.poll_cq(32) == [(2, WC_REM_ACCESS_ERR)]


def _cols(p: Pair, n: int, size: int = 16) -> tuple[np.ndarray, ...]:
    i = np.arange(n, dtype=np.uint64)
    return (
        p.dst.ctypes.data + i * size,
        p.src.ctypes.data + i * size,
        np.full(n, size, dtype=np.uint64),
        np.full(n, p.rmr.rkey, dtype=np.uint32),
        np.full(n, p.lmr.lkey, dtype=np.uint32),
    )


def test_read_batch_keeps_at_most_depth_reads_outstanding() -> None:
    p = Pair(depth=4)
    status = np.zeros(200, dtype=np.uint8)
    assert p.qa.read_batch(*_cols(p, 200), status, 3, 5.0) == (200, CAUSE_NONE)
    assert (status == Status.OK).all() and np.array_equal(p.dst[:3200], p.src[:3200])
    assert p.qa.max_outstanding == 4 and p.qa.posts >= 200 // 4


def test_read_batch_times_out_mid_chain_and_nothing_lands_after() -> None:
    clock = FakeClock()
    p = Pair(depth=8, clock=clock)
    p.a.wrs_per_poll = 1
    p.a.delay = lambda rkey: 1.0  # one virtual second per READ
    status = np.zeros(20, dtype=np.uint8)
    first_bad, cause = p.qa.read_batch(*_cols(p, 20), status, 1, 4.5)
    assert cause == CAUSE_TIMEOUT and p.qa.state == QPS_ERR
    assert first_bad == 5
    assert (status[:5] == Status.OK).all() and (status[5:] == Status.TIMEOUT).all()
    assert np.array_equal(p.dst[:80], p.src[:80]) and not p.dst[80:].any()
    p.rmr.dereg(0)  # every posted READ was flushed: nothing is left in flight


def test_read_batch_reports_a_remote_access_error_and_flushes_the_rest() -> None:
    p = Pair(depth=4)
    cols = list(_cols(p, 10))
    cols[3] = cols[3].copy()
    cols[3][6] ^= 1
    status = np.zeros(10, dtype=np.uint8)
    assert p.qa.read_batch(*cols, status, 4, 5.0) == (6, CAUSE_REMOTE_ACCESS)
    assert status.tolist() == [Status.OK] * 6 + [Status.BAD_RKEY] + [Status.CHANNEL_ERROR] * 3
    assert not p.dst[96:].any()


# -- RdmaTransport on fake verbs ------------------------------------------------------------------


@pytest.fixture
def verbs() -> FakeVerbs:
    return FakeVerbs(FakeFabric())


def _transports(verbs: FakeVerbs, **kw: object) -> tuple[RdmaTransport, RdmaTransport]:
    return RdmaTransport(TOKEN, provider=verbs, **kw), RdmaTransport(TOKEN, provider=verbs)  # type: ignore[arg-type]


def _reader_qps(reader: RdmaTransport) -> list[FakeQp]:
    hca = reader._device
    assert isinstance(hca, FakeHca)
    return list(hca._qps.values())


def test_transport_flow_control_bounds_reads_by_the_qp_depth(verbs: FakeVerbs) -> None:
    reader, server = _transports(verbs, qp_depth=8, channels_per_read=1)
    try:
        src = np.random.default_rng(1).integers(0, 256, 300 * 64, dtype=np.uint8)
        dst = np.zeros_like(src)
        r, lr = server.register(src), reader.register(dst, remote=False)
        ops = [(r.addr + 64 * k, r.rkey, 64, lr.addr + 64 * k) for k in range(300)]
        assert reader.read_batch(server.address, ops) == [Status.OK] * 300
        assert np.array_equal(src, dst)
        qps = _reader_qps(reader)
        assert len(qps) == 1 and qps[0].max_outstanding == 8
    finally:
        reader.close()
        server.close()


def test_remote_access_error_resets_the_qp_and_reposts_the_rest(verbs: FakeVerbs) -> None:
    reader, server = _transports(verbs)
    try:
        a = np.arange(4096, dtype=np.uint8) % 13
        b = np.ones(4096, dtype=np.uint8)
        ra, rb = server.register(a), server.register(b)
        dst = np.zeros(4 * 1024, dtype=np.uint8)
        lr = reader.register(dst, remote=False)
        assert reader.read_batch(server.address, [(rb.addr, rb.rkey, 8, lr.addr)]) == [Status.OK]  # table cached
        server.deregister(rb.rkey)  # the reader's table still lists it: its NIC refuses it
        ops = [(ra.addr + 1024 * k, ra.rkey, 1024, lr.addr + 1024 * k) for k in range(4)]
        ops[1] = (rb.addr, rb.rkey, 1024, lr.addr + 1024)
        dst[:] = 0
        assert reader.read_batch(server.address, ops) == [Status.OK, Status.BAD_RKEY, Status.OK, Status.OK]
        assert reader.qp_resets == 1 and reader.stats.channels_discarded == 0
        assert reader.stats.channels_opened == 1  # the same channel, reset in place
        assert np.array_equal(dst[2048:], a[2048:]) and not dst[1024:2048].any()
        # Its table was refreshed: the stale rkey is refused before posting now.
        assert reader.read_batch(server.address, ops[1:2]) == [Status.BAD_RKEY]
        assert reader.qp_resets == 1
    finally:
        reader.close()
        server.close()


def test_a_region_published_later_is_found_by_a_refresh(verbs: FakeVerbs) -> None:
    reader, server = _transports(verbs)
    try:
        lr = reader.register(bytearray(64), remote=False)
        r1 = server.register(bytearray(b"x" * 64))
        assert reader.read_batch(server.address, [(r1.addr, r1.rkey, 8, lr.addr)]) == [Status.OK]
        r2 = server.register(bytearray(b"y" * 64))
        assert reader.read_batch(server.address, [(r2.addr, r2.rkey, 8, lr.addr)]) == [Status.OK]
        assert reader.stats.channels_opened == 1
    finally:
        reader.close()
        server.close()


def test_receive_regions_are_never_published_nor_readable(verbs: FakeVerbs) -> None:
    reader, server = _transports(verbs)
    try:
        recv = reader.register(bytearray(b"secret" * 10), remote=False)
        pool = reader.register(bytearray(b"public" * 10))
        table = np.frombuffer(reader._published()[4:], dtype=[("addr", "<u8"), ("rkey", "<u4"), ("length", "<u8")])
        assert table["rkey"].tolist() == [pool.rkey]
        dst = server.register(bytearray(60), remote=False)
        got = server.read_batch(
            reader.address, [(recv.addr, recv.rkey, 6, dst.addr), (pool.addr, pool.rkey, 6, dst.addr)]
        )
        assert got == [Status.BAD_RKEY, Status.OK]
        # The HCA refuses it too, whatever a reader believes.
        hca = reader._device
        assert isinstance(hca, FakeHca)
        u64 = np.uint64
        st, _ = hca.mrs.acquire_remote(np.array([recv.addr], u64), np.array([6], u64), np.array([recv.rkey], np.uint32))
        assert st.tolist() == [Status.BAD_RKEY]
    finally:
        reader.close()
        server.close()


def test_a_broken_link_discards_the_channel_and_reports_every_item(verbs: FakeVerbs) -> None:
    # Signalling every READ, the three that landed are confirmed; unconfirmed ones would
    # report TIMEOUT too (bytes that may have landed are never reported OK unconfirmed).
    reader, server = _transports(verbs, timeout=0.5, signal_every=1)
    try:
        src = np.arange(4096, dtype=np.uint8)
        r = server.register(src)
        lr = reader.register(np.zeros(4096, dtype=np.uint8), remote=False)
        ops = [(r.addr + 256 * k, r.rkey, 256, lr.addr + 256 * k) for k in range(16)]
        assert reader.read_batch(server.address, ops) == [Status.OK] * 16
        hca = reader._device
        assert isinstance(hca, FakeHca)
        hca.wrs_per_poll = 1
        hca.stall_after(3)  # three READs land, then the link goes quiet
        got = reader.read_batch(server.address, ops, timeout=0.2)
        assert got[:3] == [Status.OK] * 3 and got[3:] == [Status.TIMEOUT] * 13
        assert reader.stats.channels_discarded == 1
        hca.stall_after(1000)
        assert reader.read_batch(server.address, ops) == [Status.OK] * 16
        assert reader.stats.channels_opened == 2
    finally:
        reader.close()
        server.close()


def test_constructor_checks_its_arguments(verbs: FakeVerbs) -> None:
    with pytest.raises(ValueError, match="qp_depth"):
        RdmaTransport(TOKEN, provider=verbs, qp_depth=0)
    with pytest.raises(ValueError, match="signal_every"):
        RdmaTransport(TOKEN, provider=verbs, signal_every=True)
    assert issubclass(RdmaUnavailableError, TransportError)
