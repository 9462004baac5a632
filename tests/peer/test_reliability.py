"""Peer-node reliability (issue 16): republish never makes a reader miss, the receive region
is not remotely readable, one bad directory entry is one miss, and a node that fails to
start says which port and leaves nothing open. Loopback only; no test sleeps."""

from __future__ import annotations

import errno
import hashlib
import queue
import socket
import threading
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hiradix._ports import reusable_port
from hiradix.peer.config import PeerConfig
from hiradix.peer.node import InProcessCluster, PeerNode, PortInUseError
from hiradix.peer.store import PeerCacheStore
from hiradix.transport.base import Status
from hiradix.transport.fake import FakeFabric

pytestmark = pytest.mark.slow  # peer clusters under concurrent readers, writers and failures

PAGE = 4096


def key(i: int, tag: str = "") -> str:
    return hashlib.sha256(f"rel{tag}{i}".encode()).hexdigest()


def page(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=["fake", "tcp"])
def cluster(request: pytest.FixtureRequest) -> Any:
    c = InProcessCluster(2, transport=request.param, pool_size=512 * (PAGE + 64), page_size=PAGE, read_timeout_s=5.0)
    yield c
    c.close()


# ---------------------------------------------------------------------- receive region
def test_receive_region_is_not_remotely_readable(cluster: InProcessCluster) -> None:
    """A peer presenting the receive region's rkey (at its exact address) gets BAD_RKEY;
    the published pool of the same node stays readable."""
    a, b = cluster.nodes
    assert a.publish_many([key(0)], [page(0)]) == [True]
    sink = np.zeros(PAGE, dtype=np.uint8)
    b.transport.register(sink, remote=False)
    recv = a.recv.region
    ops = [(recv.addr, recv.rkey, 64, sink.ctypes.data)]
    assert b.transport.read_batch(a.transport.address, ops) == [Status.BAD_RKEY]
    entry = b.lookup([key(0)])[0]
    assert entry is not None
    ok = [(entry.addr, entry.rkey, 64, sink.ctypes.data)]
    assert b.transport.read_batch(a.transport.address, ok) == [Status.OK]


def test_closing_a_node_releases_its_receive_region_at_once() -> None:
    """The node object graph is a web of bound-method cycles, so the receive region (touched
    on purpose, 64 MiB by default) used to live on after ``close`` until the cyclic
    collector ran: a test suite opening many nodes reached 9 GB. ``close`` now deregisters
    it and drops its memory; a read after that misses."""
    c = InProcessCluster(1, transport="fake", pool_size=64 * (PAGE + 64), page_size=PAGE)
    node = c.nodes[0]
    region = node.recv
    assert region.buf.nbytes >= 1 << 16
    c.close()
    assert region.buf.nbytes == 0
    with pytest.raises(queue.Empty), region.lease(timeout=0.0):
        pass


# ---------------------------------------------------------------------- republish
@pytest.mark.parametrize("new_bytes", [False, True], ids=["identical", "new-bytes"])
def test_republish_never_makes_a_reader_miss(cluster: InProcessCluster, new_bytes: bool) -> None:
    """Readers on both nodes read a batch over and over while the producer republishes it
    (identical bytes, or a new version each round): every read is a hit with the bytes of
    some version of its key. The pool has room for every version, so no slot is reused
    during the test: a miss could only come from a live page taken away before its
    replacement was in the directory."""
    a, b = cluster.nodes
    nkeys, rounds = 8, 40
    keys = [key(i, "rep") for i in range(nkeys)]

    def version(i: int, r: int) -> bytes:
        return page(1000 * r + i) if new_bytes else page(i)

    allowed = [{version(i, r) for r in range(rounds + 1)} for i in range(nkeys)]
    assert all(a.publish_many(keys, [version(i, 0) for i in range(nkeys)]))
    started = threading.Barrier(3, timeout=30)
    done = threading.Event()
    progress = threading.Condition()
    reads = [0, 0]
    misses: list[tuple[str, int]] = []
    wrong: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def reader(node: PeerNode, slot: int) -> None:
        try:
            outs = [bytearray(PAGE) for _ in keys]
            started.wait()
            while True:
                last = done.is_set()  # one more full pass after the writer finished
                ok = node.read_into(keys, [memoryview(o) for o in outs])
                with progress:
                    reads[slot] += 1
                    progress.notify_all()
                for i, (hit, out) in enumerate(zip(ok, outs, strict=True)):
                    if not hit:
                        misses.append((node.node_id, i))
                    elif bytes(out) not in allowed[i]:
                        wrong.append((node.node_id, i))
                if last or reads[slot] > 100_000:
                    return
        except BaseException as exc:  # surfaced below, never swallowed
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(n, j)) for j, n in enumerate((a, b))]
    for t in threads:
        t.start()
    try:
        started.wait()
        for r in range(1, rounds + 1):
            assert all(a.publish_many(keys, [version(i, r) for i in range(nkeys)]))
            if r == rounds // 2:  # both readers are reading while the republishing goes on
                with progress:
                    assert progress.wait_for(lambda: min(reads) >= 1 or bool(errors), timeout=30)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert misses == [] and wrong == []
    assert min(reads) >= 2
    # Every version went to a fresh slot (new bytes) or none did (identical bytes).
    pool = a._pool_for(PAGE)
    assert len(pool) == nkeys and pool.used_bytes == nkeys * PAGE
    assert pool.held_slots() == []
    if new_bytes:
        assert len(pool.free_slots()) == pool.num_slots - nkeys
    pool.check_invariants()
    # After the last round every key reads its newest version.
    outs = [bytearray(PAGE) for _ in keys]
    assert b.read_into(keys, [memoryview(o) for o in outs]) == [True] * nkeys
    assert [bytes(o) for o in outs] == [version(i, rounds) for i in range(nkeys)]


def test_republish_in_another_size_class(cluster: InProcessCluster) -> None:
    """A key republished with a page of another size goes to another pool; the directory
    takes the new entry (one generation order across pools) and the old page is dropped."""
    a, b = cluster.nodes
    k = key(0, "class")
    for _ in range(2):  # the first pool's counter must not outrun the second's
        assert a.publish_many([k], [page(1)]) == [True]
        assert a.publish_many([key(1, "class")], [page(2)]) == [True]
    assert a.publish_many([k], [page(3, 2 * PAGE)]) == [True]
    out = bytearray(2 * PAGE)
    assert b.read_into([k], [memoryview(out)]) == [True] and bytes(out) == page(3, 2 * PAGE)
    assert k not in a._pool_for(PAGE) and k in a._pool_for(2 * PAGE)
    assert b.read_into([k], [memoryview(bytearray(PAGE))]) == [False]


# ---------------------------------------------------------------------- bad directory entries
def test_one_bad_entry_is_one_miss(cluster: InProcessCluster) -> None:
    """Entries with an address outside the producer's region, a length that is not the
    page's, a huge length, or an unknown rkey: each is that key's miss, and the rest of the
    batch (local and remote pages, staged and v1 paths) is served."""
    a, b = cluster.nodes
    n = 8
    keys = [key(i, "bad") for i in range(n)]
    assert all(a.publish_many(keys, [page(i) for i in range(n)]))
    good = {k: b.lookup([k])[0] for k in keys}
    forged = {
        keys[1]: lambda e: replace(e, addr=e.addr + (1 << 40)),  # outside the region
        keys[3]: lambda e: replace(e, length=PAGE // 2),  # not the page's length
        keys[5]: lambda e: replace(e, length=1 << 40),  # no READ could fetch it
        keys[6]: lambda e: replace(e, rkey=e.rkey ^ 0x5A5A),  # no such region
    }
    for k, f in forged.items():
        for node in cluster.nodes:
            node.shard.put(k, f(good[k]))
    store_b, store_a = PeerCacheStore(node=b), PeerCacheStore(node=a)
    # The producer's own reads are a memcpy from its pool, which ignores addr and rkey.
    local_misses = {keys[3], keys[5]}
    for reader, misses in ((store_b, set(forged)), (store_a, local_misses)):
        got = reader.batch_get(keys)
        assert [g is not None for g in got] == [k not in misses for k in keys]
        assert all(bytes(g.numpy()) == page(i) for i, g in enumerate(got) if g is not None)
        outs = [bytearray(PAGE // 2 if k == keys[3] else PAGE) for k in keys]
        ok = reader.node.read_into(keys, [memoryview(o) for o in outs])
        # keys[3] asks for exactly the forged length: the remote READ fails verification
        # (the header says PAGE) and the local copy refuses a page of another length.
        assert ok == [k not in misses for k in keys]
        assert all(bytes(o) == page(i) for i, (o, hit) in enumerate(zip(outs, ok, strict=True)) if hit)


# ---------------------------------------------------------------------- start-up


def _bindable(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("taken", ["metrics", "data"])
def test_failed_start_names_the_port_and_closes_everything(tmp_path: Path, taken: str) -> None:
    """Occupy one port: the start fails with an error naming that listener and port, and
    every listener and thread the node had opened is gone (its ports bind again)."""
    for _attempt in range(5):  # another process may grab a port we just saw free: retry
        ports = {"rpc": reusable_port(), "data": reusable_port(), "metrics": reusable_port()}
        blocker = socket.create_server(("127.0.0.1", ports[taken]))
        try:
            cfg = PeerConfig(
                rpc_port=ports["rpc"],
                data_port=ports["data"],
                metrics_port=ports["metrics"],
                disk_enabled=True,
                disk_path=str(tmp_path / "disk"),
                cluster_token="t" * 32,
            )
            with pytest.raises(PortInUseError) as info:
                PeerNode(cfg)
        finally:
            blocker.close()
        if info.value.listener == taken:
            break
    err = info.value
    assert (err.listener, err.port, err.host) == (taken, ports[taken], "127.0.0.1")
    assert f"{taken} port {ports[taken]} on 127.0.0.1 is in use" in str(err)
    assert f"--{taken}-port 0" in str(err)
    assert err.errno == errno.EADDRINUSE and isinstance(err, OSError)
    for name, port in ports.items():
        assert _bindable(port), f"{name} port {port} still open after the failed start"
    alive = [t.name for t in threading.enumerate() if any(str(p) in t.name for p in ports.values())]
    assert alive == []


# ---------------------------------------------------------------------- hand-off
def test_a_malformed_handoff_entry_does_not_block_readiness() -> None:
    """A member whose ``dir_handoff`` answer holds one entry too wide for the packed
    fields: the joining node refuses that entry, stores the others and becomes ready
    (the whole pull used to fail, every round, so the node never became ready)."""
    with InProcessCluster(1, transport="fake", pool_size=1 << 20) as c:
        a = c.nodes[0]
        keys = [key(i, "handoff") for i in range(64)]
        assert all(a.publish_many(keys, [page(i, 64) for i in range(64)]))
        real = a.sync.handle_handoff

        def forged(requester: str, members: list[Any], after: str | None) -> list[Any]:
            items, more = real(requester, members, after)
            if items:
                items[0][1][2] = 1 << 32  # rkey: wider than its packed column
            return [items, more]

        a.rpc.register("dir_handoff", forged)
        b = c.add_node()
        assert b.is_ready()
        held = [k for k in keys if k in b.shard]
        assert held and all(b.shard.get(k) == a.published()[k] for k in held)
        assert all(e is None or e.rkey < 1 << 32 for e in b.shard.snapshot().values())


# ---------------------------------------------------------------------- background work
def _tracebacks(caplog: pytest.LogCaptureFixture, kind: str) -> int:
    return sum(1 for r in caplog.records if r.exc_info and f"background {kind} failed" in r.getMessage())


def test_a_failing_heartbeat_round_is_counted_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Heartbeat rounds that raise: each is counted, the first logs its traceback, the
    later ones do not, and the thread keeps running rounds (a good one follows)."""
    cfg = PeerConfig(metrics_enabled=False, pool_size=1 << 20, cluster_token="t" * 32)
    node = PeerNode(cfg, fabric=FakeFabric(), heartbeat_s=0.01)
    try:
        real, calls, recovered = node.membership.tick, [0], threading.Event()

        def flaky() -> bool:
            calls[0] += 1
            if calls[0] <= 5:
                raise RuntimeError(f"injected heartbeat failure {calls[0]}")
            recovered.set()
            return real()

        node.membership.tick = flaky  # type: ignore[method-assign]
        assert recovered.wait(20), "the heartbeat loop stopped after a failing round"
        assert node.status()["background_errors"] == {"heartbeat": 5}
        assert _tracebacks(caplog, "heartbeat") == 1
    finally:
        node.close()


def test_a_failing_republish_is_counted_and_retried_and_the_join_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    """A re-publish that raises while a peer joins: the peer's join still succeeds (the
    failure is the head's, not its RPC's), the head keeps its old ring, and its next
    heartbeat round applies the change; the joiner then reads the head's pages."""
    with InProcessCluster(2, transport="fake", pool_size=1 << 20) as c:
        a = c.nodes[0]
        keys = [key(i, "repub") for i in range(32)]
        assert all(a.publish_many(keys, [page(i, 64) for i in range(32)]))
        real = a.directory.republish
        fail = [True]

        def flaky(*args: Any, **kw: Any) -> Any:
            if fail[0]:
                fail[0] = False
                raise RuntimeError("injected republish failure")
            return real(*args, **kw)

        a.directory.republish = flaky  # type: ignore[method-assign]
        new = c.add_node()  # joins through a: a's membership change runs in the join RPC
        assert len(new.membership.members()) == 3 and not fail[0]
        assert set(a.directory.ring.nodes) == set(new.membership.members())
        assert a.status()["background_errors"] == {"republish": 1} and _tracebacks(caplog, "republish") == 1
        outs = [bytearray(64) for _ in keys]
        assert new.read_into(keys, [memoryview(o) for o in outs]) == [True] * len(keys)
        assert [bytes(o) for o in outs] == [page(i, 64) for i in range(32)]


def test_failing_background_tasks_are_counted_and_the_executor_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Executor work that raises (a warm-up) is counted and logged, not kept unseen in its
    future, and the executor runs the work submitted after it."""
    with InProcessCluster(1, transport="fake", pool_size=1 << 20) as c:
        node, ran = c.nodes[0], threading.Event()

        def boom() -> None:
            raise ValueError("injected background failure")

        for _ in range(3):
            node._background("promote", boom)
        node._background("promote", ran.set)
        assert node.drain_background(20) and ran.is_set()
        assert node.status()["background_errors"] == {"promote": 3}
        assert _tracebacks(caplog, "promote") == 1


def test_background_errors_are_a_prometheus_counter() -> None:
    """Every background failure counted in ``status()["background_errors"]`` is also
    ``hiradix_peer_background_errors_total{kind}`` on the node's metrics endpoint."""
    with InProcessCluster(1, transport="fake", pool_size=1 << 20, metrics_enabled=True, metrics_port=0) as c:
        node = c.nodes[0]
        assert node.metrics_server is not None
        url = node.metrics_server.url + "/metrics"

        def boom() -> None:
            raise ValueError("injected background failure")

        def scrape() -> dict[str, float]:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            return {
                s.labels["kind"]: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "hiradix_peer_background_errors_total"
            }

        assert scrape() == {}
        for _ in range(3):
            node._background("promote", boom)
        assert node.drain_background(20)
        node._guard("heartbeat", boom)
        assert node.status()["background_errors"] == {"promote": 3, "heartbeat": 1}
        assert scrape() == {"promote": 3.0, "heartbeat": 1.0}


def test_a_member_back_after_its_expiry_is_readable_again() -> None:
    """A member the others dropped (expired during a pause: here it is made to leave their
    views) comes back with the same incarnation, never having seen its expiry, so it
    re-publishes nothing: the others pull its entries, and its pages read again."""
    with InProcessCluster(3, transport="fake", pool_size=1 << 20) as c:
        a, b, gone = c.nodes
        keys = [key(i, "pause") for i in range(64)]
        assert all(gone.publish_many(keys, [page(i, 64) for i in range(64)]))
        for node in (a, b):  # no heartbeat rounds: they would bring it back at once
            node.membership.handle("disc_leave", [gone.node_id])
            assert gone.node_id not in node.membership.members()
        outs = [bytearray(64) for _ in keys]
        assert b.read_into(keys, [memoryview(o) for o in outs]) == [False] * len(keys)
        c.settle(3)  # its heartbeats bring it back
        assert all(gone.node_id in n.membership.members() for n in (a, b))
        assert a.drain_background(20) and b.drain_background(20)
        assert b.read_into(keys, [memoryview(o) for o in outs]) == [True] * len(keys)
        assert [bytes(o) for o in outs] == [page(i, 64) for i in range(64)]
        assert a.status()["background_errors"] == {} == b.status()["background_errors"]
