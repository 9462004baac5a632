"""PeerCacheStore: the storage contract over an in-process cluster, plus what is specific to
the peer cache: remote reads between nodes, verification turning stale slots into misses,
eviction to disk and promote, exists warming, membership (injected clock), and the node's
RPC surface. Everything runs in one process on loopback; no test sleeps."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from hiradix.peer.config import PeerConfig
from hiradix.peer.directory import DirEntry
from hiradix.peer.membership import Membership, NodeInfo, compute_masters
from hiradix.peer.node import InProcessCluster, PeerNode, size_class
from hiradix.peer.store import PeerCacheStore
from hiradix.storage import StorageConfig, create_backend
from hiradix.transport.base import Status
from hiradix.transport.fake import FakeClock
from tests.storage.test_contract import StorageContract, make_pool

pytestmark = pytest.mark.slow  # the store's contract suite: a peer cluster set up and torn down per case

PAGE = 4096


def key(i: int, tag: str = "") -> str:
    return hashlib.sha256(f"peer{tag}{i}".encode()).hexdigest()


def page(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class TestPeerContractFake(StorageContract):
    backend, options = "peer", {"inprocess_nodes": 3, "transport": "fake"}


class TestPeerContractTcp(StorageContract):
    backend, options = "peer", {"inprocess_nodes": 2, "transport": "tcp"}


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(params=["fake", "tcp"])
def cluster(request: pytest.FixtureRequest) -> Any:
    c = InProcessCluster(3, transport=request.param, pool_size=64 * (PAGE + 64), read_timeout_s=2.0)
    yield c
    c.close()


def stores(c: InProcessCluster) -> list[PeerCacheStore]:
    return [PeerCacheStore(node=n) for n in c.nodes]


# ---------------------------------------------------------------------- remote reads
def test_set_on_one_node_get_on_the_others(cluster: InProcessCluster) -> None:
    a, b, c = stores(cluster)
    keys = [key(i) for i in range(40)]
    assert a.batch_set(keys, [page(i) for i in range(40)])
    for s in (b, c):
        assert s.batch_exists(keys) == 40
        got = s.batch_get(keys)
        assert [bytes(g.numpy()) for g in got] == [page(i) for i in range(40)]
    # the bytes crossed the transport: the readers' nodes hold none of these pages
    assert b.node.pool_pages == 0 and c.node.pool_pages == 0
    assert b.node.transport.stats.remote_items >= 40


def test_v1_remote_into_host_pool(cluster: InProcessCluster) -> None:
    a, b, _ = stores(cluster)
    src, dst = make_pool("page_first", False), make_pool("page_first", False)
    dst.backing_tensor.zero_()
    a.register_mem_pool_host(src)
    b.register_mem_pool_host(dst)
    ps = src.page_size
    keys = [key(i, "v1") for i in range(3)]
    assert a.batch_set_v1(keys, [0, ps, 2 * ps]) == [True] * 3
    assert b.batch_get_v1(keys + [key(99)], [3 * ps, 4 * ps, 5 * ps, 6 * ps]) == [True, True, True, False]
    for s, d in ((0, 3), (1, 4), (2, 5)):
        assert torch.equal(dst.get_page_bytes(d * ps), src.get_page_bytes(s * ps))
    # Payloads were READ straight into the host pool: header + payload = two items a page.
    assert b.node.transport.stats.remote_items == 6
    # The host (L2) pool is a local receive region of b only, and never published: a
    # peer presenting its handle is refused, and no directory entry names it.
    lo = dst.backing_tensor.data_ptr()
    hi = lo + dst.backing_tensor.numel() * dst.backing_tensor.element_size()
    handle = b._receive_handle
    assert handle is not None
    for node in cluster.nodes:
        if node is not b.node:
            landing, pins = node.transport.regions.acquire_local(np.array([lo], np.uint64), np.array([1], np.uint64))
            assert not landing.any() and len(pins) == 0
    sink = bytearray(64)
    c_node = cluster.nodes[2]
    c_node.transport.register(sink)
    sink_addr = np.frombuffer(sink, dtype=np.uint8).ctypes.data
    assert c_node.transport.read_batch(b.node.transport.address, [(lo, handle, 64, sink_addr)]) == [Status.BAD_RKEY]
    for node in cluster.nodes:
        for k in keys:
            e = node.shard.get(k)
            assert e is None or not (lo <= e.addr < hi)
    assert all(not (lo <= e.addr < hi) for e in b.node.lookup(keys) if e is not None)


def test_v1_direct_stale_is_a_miss(cluster: InProcessCluster) -> None:
    """Reused slot, wrong generation and torn payload, on the direct (in-place) path."""
    a, b, _ = stores(cluster)
    src, dst = make_pool("page_first", False), make_pool("page_first", False)
    a.register_mem_pool_host(src)
    b.register_mem_pool_host(dst)
    ps = src.page_size
    keys = [key(i, "st") for i in range(3)]
    assert a.batch_set_v1(keys, [0, ps, 2 * ps]) == [True] * 3
    pool = a.node._pool_for(src.page_bytes)
    entry = b.node.lookup([keys[0]])[0]
    assert entry is not None
    # reused slot: the directory still names it for keys[0]
    pool.delete(keys[0])
    pool.set(key(9, "st"), page(9, src.page_bytes))
    for dir_node in cluster.nodes:
        dir_node.shard.put(keys[0], entry)
    # wrong generation for keys[1]
    loc = pool.location(keys[1])
    assert loc is not None
    forged = replace(entry, addr=loc.addr, rkey=loc.rkey, length=src.page_bytes, generation=loc.generation + 1)
    for dir_node in cluster.nodes:
        dir_node.shard.put(keys[1], forged)
    # torn payload for keys[2]: one payload byte changes under an intact header
    loc2 = pool.location(keys[2])
    assert loc2 is not None
    view = pool.slot_view(loc2.slot)
    view[70] ^= 0xFF
    before = b.node.stale_reads
    assert b.batch_get_v1(keys, [3 * ps, 4 * ps, 5 * ps]) == [False, False, False]
    assert b.node.stale_reads == before + 3


def test_stale_slot_is_a_miss_never_wrong_bytes(cluster: InProcessCluster) -> None:
    a, b, _ = stores(cluster)
    k = key(1)
    assert a.set(k, page(1))
    entry = b.node.lookup([k])[0]
    assert entry is not None
    # The producer reuses the slot for another key; the old entry is still in the directory.
    a.node._pool_for(PAGE).delete(k)
    a.node._pool_for(PAGE).set(key(2), page(2))
    for dir_node in cluster.nodes:
        dir_node.shard.put(k, entry)
    assert b.get(k) is None
    assert b.node.stale_reads == 1
    # A forged entry with the right slot but another generation is rejected too.
    loc = a.node._pool_for(PAGE).location(key(2))
    assert loc is not None
    forged = DirEntry(a.node.node_id, loc.addr, loc.rkey, PAGE, loc.generation + 1, incarnation=a.node.incarnation)
    for dir_node in cluster.nodes:
        dir_node.shard.put(key(3), forged)
    assert b.get(key(3), bytearray(PAGE)) is None


def test_local_pages_are_memcpy(cluster: InProcessCluster) -> None:
    a = stores(cluster)[0]
    assert a.set(key(0), page(0))
    before = a.node.transport.stats.remote_items
    assert bytes(a.get(key(0)).numpy()) == page(0)
    assert a.node.transport.stats.remote_items == before


def test_eviction_deletes_directory_entries(cluster: InProcessCluster) -> None:
    a, b, _ = stores(cluster)
    n = a.node._pool_for(PAGE).num_slots
    keys = [key(i, "ev") for i in range(n + 5)]
    assert a.batch_set(keys, [page(i) for i in range(n + 5)])
    assert b.batch_exists(keys[:5]) == 0  # the five oldest left the pool and the directory
    assert b.batch_exists(keys[5:]) == n
    assert a.get_stats().evictions == 5


def test_dead_producer_reads_are_misses(cluster: InProcessCluster) -> None:
    a, b, c = stores(cluster)
    assert a.batch_set([key(0)], [page(0)]) and c.batch_set([key(1)], [page(1)])
    cluster.nodes[0].close(leave=False)
    assert b.get(key(0), bytearray(PAGE)) is None
    assert bytes(b.get(key(1)).numpy()) == page(1)


# ---------------------------------------------------------------------- disk tier
def test_disk_tier_promote_and_exists_warming(tmp_path: Path) -> None:
    with InProcessCluster(
        2, transport="fake", pool_size=4 * (PAGE + 64), disk_enabled=True, disk_path=str(tmp_path / "d0")
    ) as c:
        a, b = stores(c)
        keys = [key(i, "disk") for i in range(8)]
        assert a.batch_set(keys, [page(i) for i in range(8)])
        assert a.node.disk is not None and a.node.disk.flush(10)
        # Four pages were pushed out of the pool but stay in the directory, non-resident.
        cold = [e for e in b.node.lookup(keys) if e is not None and not e.resident]
        assert len(cold) == 4
        assert b.batch_exists(keys) == 8
        # The warm-up that exists started moves pages between pool and disk; let it finish.
        assert b.node.drain_background(10) and a.node.disk.flush(10)
        # Remote read of a disk-resident page: data_promote on the producer, then READ.
        got = b.batch_get(keys[:2])
        assert [bytes(g.numpy()) for g in got] == [page(0), page(1)]
        assert a.node.metrics.promotes._value.get() >= 2
        # Local read of a disk-resident page promotes it locally.
        a.node.disk.flush(10)
        for k in keys:
            if not a.node.published()[k].resident:
                assert a.get(k) is not None
                break


def test_exists_prefix_fetches_entries_only_for_disk_pages(tmp_path: Path) -> None:
    with InProcessCluster(
        2, transport="fake", pool_size=4 * (PAGE + 64), disk_enabled=True, disk_path=str(tmp_path / "d0")
    ) as c:
        a, b = stores(c)
        keys = [key(i, "warm") for i in range(8)]
        assert a.batch_set(keys, [page(i) for i in range(8)])
        assert a.node.disk is not None and a.node.disk.flush(10)
        node = b.node
        cold = {k for k, e in zip(keys, node.lookup(keys), strict=True) if e is not None and not e.resident}
        hot = [k for k in keys if k not in cold]
        assert len(cold) == 4
        fetched: list[list[str]] = []
        warmed: list[list[str]] = []
        get_entries = node.directory.batch_get
        node.directory.batch_get = lambda ks: fetched.append(list(ks)) or get_entries(ks)  # type: ignore[method-assign]
        node._warm = lambda entries: warmed.append([k for k, _ in entries])  # type: ignore[method-assign]
        # All resident: the one-byte answers suffice, no full entry is fetched.
        assert node.exists_prefix(hot) == 4 and fetched == [] and warmed == []
        # The disk-resident keys of the prefix, and only they, are fetched and warmed.
        missing = key(99, "warm")
        order = [*hot[:2], *sorted(cold)[:2], missing, *sorted(cold)[2:]]
        assert node.exists_prefix(order) == 4
        assert fetched == [sorted(cold)[:2]] and warmed == [sorted(cold)[:2]]
        assert b.batch_exists(keys) == 8 and warmed[-1] == [k for k in keys if k in cold]


# ---------------------------------------------------------------------- store config
def test_registry_dynamic_and_sglang_style_config() -> None:
    s = create_backend(
        "dynamic",
        StorageConfig(),
        extra_config=json.dumps(
            {
                "backend_name": "peer",
                "module_path": "hiradix.peer.store",
                "class_name": "PeerCacheStore",
                "inprocess_nodes": 1,
                "transport": "fake",
                "pool_size": "1MiB",
            }
        ),
    )
    try:
        assert isinstance(s, PeerCacheStore) and s.node.config.pool_size == 1 << 20
        assert s.set(key(0), page(0)) and s.exists(key(0))
    finally:
        s.close()

    class SGLangConfig:  # the attributes SGLang's HiCacheStorageConfig carries
        tp_rank, tp_size, model_name, is_mla_model = 0, 1, "m", False
        extra_config: ClassVar[dict[str, Any]] = {"inprocess_nodes": 1, "transport": "fake", "pool_size": 1 << 20}

    s2 = PeerCacheStore(SGLangConfig(), {})
    try:
        assert s2.config.model_name == "m" and s2.set(key(1), b"x")
    finally:
        s2.close()


def test_size_classes() -> None:
    assert size_class(4096, None) == 4096
    assert size_class(1, None) == 64
    assert size_class(4097, 4096) == 8192
    assert size_class(4000, 4096) == 4096


def test_node_status_over_rpc(cluster: InProcessCluster) -> None:
    a = stores(cluster)[0]
    a.batch_set([key(0), key(1)], [page(0), page(1)])
    b = cluster.nodes[1]
    st = b.client.call(cluster.nodes[0].address, "node_status")
    assert st["pool"]["pages"] == 2 and len(st["members"]) == 3
    assert st["masters"][0] == cluster.nodes[0].node_id


def test_membership_change_republishes(cluster: InProcessCluster) -> None:
    a = stores(cluster)[0]
    keys = [key(i, "rp") for i in range(60)]
    assert a.batch_set(keys, [page(i, 64) for i in range(60)])
    d = PeerCacheStore(node=cluster.add_node())
    # The new node owns some keys now; it got their entries from the producer's re-publish.
    assert d.node.shard and d.batch_exists(keys) == 60
    assert [bytes(g.numpy()) for g in d.batch_get(keys[:5])] == [page(i, 64) for i in range(5)]


# ---------------------------------------------------------------------- membership
class _Net:
    """In-process discovery wiring: call(addr, method, args) -> the target's handler."""

    def __init__(self) -> None:
        self.nodes: dict[str, Membership] = {}
        self.down: set[str] = set()

    def call(self, addr: str, method: str, args: list[Any]) -> Any:
        if addr in self.down or addr not in self.nodes:
            raise ConnectionError(f"{addr} is down")
        return self.nodes[addr].handle(method, args)

    def add(self, name: str, clock: FakeClock, head: str | None, seeds: tuple[str, ...] = ()) -> Membership:
        m = Membership(NodeInfo(name, name, f"data-{name}"), self.call, head=head, seeds=seeds, ttl=3.0, clock=clock)
        self.nodes[name] = m
        return m


def tick_all(net: _Net, clock: FakeClock, rounds: int = 2) -> None:
    for _ in range(rounds):
        clock.advance(1.0)
        for name, m in net.nodes.items():
            if name not in net.down:
                m.tick()


def test_masters_head_first_then_node_order() -> None:
    ms = [NodeInfo(n, n, n) for n in ("n5", "n1", "n3", "n2")]
    assert compute_masters(ms, "n5", 3) == ("n5", "n1", "n2")
    assert compute_masters(ms, "dead", 3) == ("n1", "n2", "n3")
    assert compute_masters(ms, None, 1) == ("n1",)


def test_membership_join_heartbeat_expire_and_replace_master() -> None:
    clock, net = FakeClock(), _Net()
    head = net.add("h", clock, head="h")
    nodes = [net.add(n, clock, head="h") for n in ("n1", "n2", "n3", "n4")]
    changes: list[tuple[int, int]] = []
    nodes[3].on_change = lambda old, new: changes.append((len(old), len(new)))
    for m in nodes:
        assert m.join()
    tick_all(net, clock)
    for m in (head, *nodes):
        assert set(m.members()) == {"h", "n1", "n2", "n3", "n4"}
        assert m.masters() == ("h", "n1", "n2")
    assert changes and changes[-1][1] == 5
    # A non-head master dies: it expires everywhere and n3 is promoted.
    net.down.add("n1")
    tick_all(net, clock, rounds=5)
    for m in (head, nodes[1], nodes[2], nodes[3]):
        assert "n1" not in m.members()
        assert m.masters() == ("h", "n2", "n3")
    # The head dies: the others keep serving each other and a new node joins via n2.
    net.down.add("h")
    tick_all(net, clock, rounds=5)
    assert set(nodes[3].members()) == {"n2", "n3", "n4"}
    late = net.add("n9", clock, head="h", seeds=("n2",))
    assert late.join()
    tick_all(net, clock)
    assert set(nodes[3].members()) == {"n2", "n3", "n4", "n9"} == set(late.members())


def test_membership_cached_when_no_master_answers() -> None:
    clock, net = FakeClock(), _Net()
    head = net.add("h", clock, head="h")
    a, b = net.add("a", clock, head="h"), net.add("z", clock, head="h")
    for m in (a, b):
        m.join()
    tick_all(net, clock)
    net.nodes["h"].max_masters = a.max_masters = b.max_masters = 2  # masters: h, a
    tick_all(net, clock)
    assert b.masters() == ("h", "a")
    net.down.update({"h", "a"})
    for _ in range(10):  # far past the ttl: z reaches no master and keeps its cached view
        clock.advance(1.0)
        b.tick()
    assert b.frozen and set(b.members()) == {"h", "a", "z"}
    assert head is not None


def test_dead_views_do_not_resurrect_members() -> None:
    clock, net = FakeClock(), _Net()
    ms = [net.add("h", clock, head="h"), net.add("a", clock, head="h"), net.add("b", clock, head="h")]
    for m in ms[1:]:
        m.join()
    net.add("x", clock, head="h").join()
    tick_all(net, clock)
    net.down.add("x")  # x is not a master; masters h, a, b gossip views among themselves
    tick_all(net, clock, rounds=6)
    for m in ms:
        assert "x" not in m.members()


def test_discovery_rejects_malformed_records() -> None:
    clock, net = FakeClock(), _Net()
    m = net.add("h", clock, head="h")
    with pytest.raises(ValueError):
        m.handle("disc_join", [["only", "two"]])
    with pytest.raises(ValueError):
        m.handle("disc_nope", [])
    with pytest.raises(ValueError):
        m._merge([["a", "a", "a", None, "old"]])


def test_node_rejects_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIRADIX_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ValueError, match="cluster token"):
        PeerNode(PeerConfig(metrics_enabled=False), start=False)


# ---------------------------------------------------------------------- chunk verify + copy
def _chunk(pages: list[bytes], keys: list[str], gens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    from hiradix.peer.pool import pack_header

    blobs = [pack_header(k, g, p) + p for k, g, p in zip(keys, gens, pages, strict=True)]
    offs = np.cumsum([0] + [len(b) for b in blobs[:-1]]).astype(np.int64)
    return np.frombuffer(b"".join(blobs) + b"\0" * 8, dtype=np.uint8).copy(), offs


@pytest.mark.parametrize("compiled", [True, False])
def test_verify_copy_accepts_good_and_rejects_stale_torn_and_foreign(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hiradix.peer.reader as node_mod
    from hiradix.peer.pool import key_digest

    if compiled:
        if node_mod._verify is None:
            pytest.skip("hiradix.peer._verify not built (pure-Python run)")
    else:
        monkeypatch.setattr(node_mod, "_verify", None)
    rng = np.random.default_rng(5)
    sizes = [100, 4096, 16384, 63, 70000, 4096]
    pages = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    keys = [f"key-{i}" for i in range(len(pages))]
    gens = [10, 11, 12, 13, 14, 15]
    written = [*keys[:2], "someone-else", *keys[3:]]  # slot 2 holds another key's page
    chunk, offs = _chunk(pages, written, gens)
    want_gens = np.array(gens, dtype=np.uint64)
    want_gens[1] = 99  # the slot was reused: another generation
    digests = np.frombuffer(b"".join(key_digest(k) for k in keys), dtype=np.uint8).reshape(-1, 32)
    chunk[offs[3] + 64 + 5] ^= 0xFF  # torn payload: CRC mismatch
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    dsts = np.array([o.ctypes.data for o in outs], dtype=np.uint64)
    good = np.array([1, 1, 1, 1, 1, 0], dtype=np.uint8)  # the last READ failed
    lens = np.array(sizes, dtype=np.int64)
    stale = node_mod._verify_copy(chunk, offs, lens, want_gens, digests, dsts, good, keys)
    assert stale == 3
    assert good.tolist() == [1, 0, 0, 0, 1, 0]
    assert outs[0].tobytes() == pages[0] and outs[4].tobytes() == pages[4]
    assert not outs[1].any() and not outs[2].any() and not outs[3].any() and not outs[5].any()


@pytest.mark.parametrize("compiled", [True, False])
def test_verify_inplace_accepts_good_and_rejects_stale_torn_and_foreign(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hiradix.peer.reader as node_mod
    from hiradix.peer.pool import key_digest, pack_header

    if compiled:
        if node_mod._verify is None:
            pytest.skip("hiradix.peer._verify not built (pure-Python run)")
    else:
        monkeypatch.setattr(node_mod, "_verify", None)
    rng = np.random.default_rng(6)
    sizes = [100, 4096, 16384, 63, 70000, 4096]
    pages = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    keys = [f"key-{i}" for i in range(len(pages))]
    gens = [10, 11, 12, 13, 14, 15]
    written = [*keys[:2], "someone-else", *keys[3:]]  # slot 2 holds another key's page
    heads = np.frombuffer(
        b"".join(pack_header(k, g, p) for k, g, p in zip(written, gens, pages, strict=True)), dtype=np.uint8
    ).copy()
    want_gens = np.array(gens, dtype=np.uint64)
    want_gens[1] = 99  # the slot was reused: another generation
    digests = np.frombuffer(b"".join(key_digest(k) for k in keys), dtype=np.uint8).reshape(-1, 32)
    outs = [p.copy() for p in pages]  # the payloads already landed in their pages
    outs[3][5] ^= 0xFF  # torn payload: CRC mismatch
    dsts = np.array([o.ctypes.data for o in outs], dtype=np.uint64)
    good = np.array([1, 1, 1, 1, 1, 0], dtype=np.uint8)  # the last READ failed
    lens = np.array(sizes, dtype=np.int64)
    stale = node_mod._verify_inplace(heads, lens, want_gens, digests, dsts, good, keys)
    assert stale == 3
    assert good.tolist() == [1, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("wide", [True, False], ids=["avx2-vpclmulqdq", "pclmul-or-tables"])
def test_compiled_crc_matches_zlib(wide: bool) -> None:
    import zlib

    v = pytest.importorskip("hiradix.peer._verify")
    if wide and not v.have_wide_clmul():
        pytest.skip("this CPU has no AVX2 + VPCLMULQDQ: only the narrow path exists here")
    before = v._test_set_wide_clmul(wide)
    try:
        rng = np.random.default_rng(1)
        # Every length around the 64/128/256-byte block edges, then long ones.
        for n in [*range(0, 700), 4095, 16384 + 13, 65536 + 129, 1 << 20]:
            b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            assert v.crc32(b) == zlib.crc32(b), n
            assert v.crc32(b, 0xDEADBEEF) == zlib.crc32(b, 0xDEADBEEF), n
    finally:
        v._test_set_wide_clmul(before)


def test_verify_copy_rejects_slots_outside_the_chunk() -> None:
    v = pytest.importorskip("hiradix.peer._verify")
    chunk = np.zeros(256, dtype=np.uint8)
    one = np.ones(1, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        v.verify_copy(
            chunk,
            np.array([100], dtype=np.int64),
            np.array([200], dtype=np.int64),
            np.array([1], dtype=np.uint64),
            np.zeros((1, 32), dtype=np.uint8),
            np.array([0], dtype=np.uint64),
            one,
        )
