"""The reader's one fetch routine in both of its plans, across rounds: a batch larger than
one receive lane is READ in several rounds (staged: by bytes; in place: by header places),
and every page lands whole, with a torn slot in a later round a miss of its own; and the
receive region's release on close."""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from hiradix.peer.config import PeerConfig
from hiradix.peer.node import PeerNode
from hiradix.peer.pool import SLOT_HEADER_SIZE
from hiradix.peer.reader import ReceiveRegion
from hiradix.transport import FakeFabric
from hiradix.transport.fake import FakeTransport

LANE = 1 << 16  # the smallest lane a receive region has


@pytest.fixture
def pair() -> Iterator[tuple[PeerNode, PeerNode]]:
    """A producer and a reader on one fake fabric; the reader has one 64 KiB lane."""
    token = secrets.token_hex(16)
    fabric = FakeFabric()

    def cfg(**kw: object) -> PeerConfig:
        return PeerConfig(cluster_token=token, metrics_enabled=False, pool_size=4 << 20, **kw)  # type: ignore[arg-type]

    with (
        PeerNode(cfg(), fabric=fabric, start=False) as a,
        PeerNode(cfg(discovery_addr=a.address), fabric=fabric, start=False, recv_bytes=LANE, recv_lanes=1) as b,
    ):
        a.join()
        b.join()
        for node in (a, b, a, b):
            node.tick()
        assert b.recv.lane_bytes == LANE
        yield a, b


def pages(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def tear(node: PeerNode, key: str, size: int) -> None:
    """Flip one payload byte of ``key``'s slot under its intact header."""
    pool = node._pool_for(size)
    loc = pool.location(key)
    assert loc is not None
    pool.slot_view(loc.slot)[SLOT_HEADER_SIZE + 5] ^= 0xFF


def test_staged_reads_span_rounds_and_a_slot_larger_than_the_lane_misses(pair: tuple[PeerNode, PeerNode]) -> None:
    a, b = pair
    size = 4096
    n = 40  # 40 slots of 4160 bytes: three rounds of a 64 KiB lane
    keys = [f"staged-{i}" for i in range(n)]
    data = pages(n, size, 1)
    big = pages(1, LANE, 2)[0]  # with its header, one slot more than the lane
    assert all(a.publish_many([*keys, "big"], [*data, big]))
    tear(a, keys[33], size)  # in the third round
    outs = [bytearray(size) for _ in keys] + [bytearray(len(big))]
    got = b.read_into([*keys, "big"], [memoryview(o) for o in outs])
    assert got == [i != 33 for i in range(n)] + [False]
    assert all(bytes(outs[i]) == data[i] for i in range(n) if i != 33)
    assert b.stale_reads == 1


def test_in_place_reads_span_rounds_next_to_staged_ones(pair: tuple[PeerNode, PeerNode]) -> None:
    a, b = pair
    size = 64
    n = LANE // SLOT_HEADER_SIZE + 300  # more headers than the lane has places: two rounds
    keys = [f"inplace-{i}" for i in range(n)]
    data = pages(n, size, 3)
    assert all(a.publish_many(keys, data))
    tear(a, keys[n - 20], size)  # in the second round of the in-place plan
    host = np.zeros(n * size, dtype=np.uint8)
    handle = b.register_receive(host)
    try:
        # the last 10 pages go to memory outside the registered region: the staged plan
        outside = np.zeros(10 * size, dtype=np.uint8)
        addrs = np.array(
            [host.ctypes.data + i * size for i in range(n - 10)] + [outside.ctypes.data + i * size for i in range(10)],
            dtype=np.uint64,
        )
        ok = b.read_pages(keys, addrs, np.full(n, size, dtype=np.int64), hold=(host, outside))
    finally:
        b.deregister_receive(handle)
    assert ok.tolist() == [i != n - 20 for i in range(n)]
    got = [host[i * size : (i + 1) * size].tobytes() for i in range(n - 10)]
    got += [outside[i * size : (i + 1) * size].tobytes() for i in range(10)]
    assert all(got[i] == data[i] for i in range(n) if i != n - 20)
    assert b.stale_reads == 1


def test_a_receive_region_closes_only_once_its_leased_lanes_are_back() -> None:
    """``close`` waits for a read still writing into a lane, and leases no new lane
    meanwhile; with the lane back, the memory goes."""
    transport = FakeTransport(FakeFabric(), "a")
    try:
        region = ReceiveRegion(transport, 4 << 16, 4)
        leased, release, closed = threading.Event(), threading.Event(), threading.Event()

        def reader() -> None:
            with region.lease(timeout=1.0) as (_addr, view):
                leased.set()
                release.wait(10.0)
                view[:4] = b"done"  # the lane's memory is still there

        t = threading.Thread(target=reader)
        t.start()
        assert leased.wait(10.0)
        closer = threading.Thread(target=lambda: (region.close(timeout=10.0), closed.set()))
        closer.start()
        with region._cond:  # close() has begun (it notifies as it starts refusing leases)
            assert region._cond.wait_for(lambda: region._closed, 10.0)
        with pytest.raises(queue.Empty), region.lease(timeout=0.0):
            pass
        assert not closed.is_set() and region.buf.nbytes == 4 << 16
        release.set()
        t.join(10.0)
        closer.join(10.0)
        assert closed.is_set() and region.buf.nbytes == 0
    finally:
        transport.close()
