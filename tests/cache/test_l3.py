"""HiRadixCache with an L3 backend: end-to-end round trips through storage with the
bytes checked, prefetch policies (with a gated backend and an injected clock), revocation,
attach/detach with operations in flight, failing backends, and namespace isolation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hiradix.cache import HiRadixCache, Req, StorageOptions, TierOptions, TreeOptions
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory import HOST_LAYOUTS, DeviceKVPool, HostKVPool, MHAShape, MLAShape
from hiradix.storage import Capabilities, FileStorage, KeyNamespace, MemoryStorage, StorageBackend
from hiradix.transport.fake import FakeClock
from tests.support.kvdata import fill, mismatches, prefix_seeds, scribble

SHAPE = MHAShape(2, 2, 4)


class GatedStorage(MemoryStorage):
    """Batch reads block until the test opens ``gate`` (bounded), so a prefetch can be
    caught in flight without sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.reading = threading.Event()

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        self.reading.set()
        assert self.gate.wait(30), "test never opened the gate"
        return super()._get_many_into(keys, outs)


class BrokenStorage(MemoryStorage):
    """Every read and lookup fails inside the backend (a dead disk or network)."""

    broken = False

    def _exists_many(self, keys: list[str]) -> int:
        if self.broken:
            raise OSError("backend down")
        return super()._exists_many(keys)

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        if self.broken:
            raise OSError("backend down")
        return super()._get_many_into(keys, outs)


def make(
    storage: StorageBackend,
    *,
    page: int = 16,
    layout: str = "page_first",
    shape: Any = SHAPE,
    policy: str = "wait_complete",
    threshold: int = 32,
    clock: Any = None,
    namespace: KeyNamespace | None = None,
    device: int = 512,
    host: int = 512,
    inline: bool = False,
) -> HiRadixCache:
    dev = DeviceKVPool(shape, size=device, page_size=page, dtype=torch.bfloat16)
    hpool = HostKVPool(shape, host, page, torch.bfloat16, layout, reserve_bytes=0)
    return HiRadixCache(
        dev,
        hpool,
        tree=TreeOptions(clock=clock),
        tiers=TierOptions(load_back_threshold=0),
        storage=StorageOptions(
            backend=storage,
            prefetch=PrefetchConfig(policy=policy, threshold_tokens=threshold, batch_pages=4),
            namespace=namespace,
            inline=inline,
        ),
    )


def compute(cache: HiRadixCache, tokens: np.ndarray, extra_key: str | None = None) -> int:
    """Prefill ``tokens`` with fresh KV and cache it; returns the slots' count."""
    slots = cache.alloc_device(len(tokens))
    assert slots is not None
    fill(cache.device_pool, slots, prefix_seeds(tokens))
    cache.cache_finished_req(Req("w", tokens, slots, extra_key=extra_key))
    cache.flush()
    cache.check_hicache_events()
    return len(slots)


def evict_l1_l2(cache: HiRadixCache) -> None:
    cache.flush()
    while cache.storage.ongoing_backup:  # L3 writes hold the host copies until they land
        cache.storage.ongoing_backup[0].done.wait(30)
        cache.check_hicache_events()
    cache.evict(10**9)
    cache.evict_host(10**9)
    assert cache.tree.device_size() == cache.tree.host_size() == 0
    scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))


def fetch(cache: HiRadixCache, tokens: np.ndarray, rid: str = "r", extra_key: str | None = None) -> tuple[int, int]:
    """Serve ``tokens`` through L3 -> L2 -> L1 like a scheduler; returns (tokens loaded
    from L3, tokens reused) after checking every reused byte."""
    m = cache.match_prefix(tokens, extra_key)
    mount, mlen = cache.storage.prefetch_mount(m)
    from_l3 = 0
    if cache.storage.prefetch_from_storage(rid, mount, tokens[mlen:]):
        assert cache.storage.wait_prefetch(rid, 30)
        assert cache.storage.check_prefetch_progress(rid)
        from_l3 = cache.storage.pop_prefetch_loaded_tokens(rid)
        m = cache.match_prefix(tokens, extra_key)
    loaded, _node = cache.init_load_back(m.last_node, m.host_hit_length)
    prefix = torch.cat((m.device_indices, loaded))
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(cache.ready_to_load_host_cache())
    for layer in range(cache.device_pool.layer_num):
        counter.wait_until(layer, timeout=30)
    assert mismatches(cache.device_pool, prefix, prefix_seeds(tokens)[: len(prefix)]) == 0
    cache.check_hicache_events()
    cache.check_invariants()
    return from_l3, len(prefix)


def settle(cache: HiRadixCache) -> None:
    """Let the L3 threads finish every operation, then consume the results."""
    for entry in list(cache.storage.ongoing_prefetch.values()):
        assert entry.op.io_done.wait(30)
    for op, _ in list(cache.storage._release_queue):
        assert op.io_done.wait(30)
    cache.flush()
    cache.check_hicache_events()


@pytest.fixture(params=["memory", "file", "file-lz4"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    if request.param == "memory":
        backend: StorageBackend = MemoryStorage()
    else:
        backend = FileStorage(path=tmp_path / "l3", compression="lz4" if request.param == "file-lz4" else None)
    yield backend
    backend.close()


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_round_trip_through_storage(storage: StorageBackend, page: int, layout: str, inline: bool) -> None:
    """Insert, back up to L2 and L3, evict L1 and L2 completely, prefetch back from L3,
    load to L1: identical bytes (L3 operations on their threads, or inline)."""
    with make(storage, page=page, layout=layout, threshold=page, inline=inline) as cache:
        rng = np.random.default_rng(page)
        a = rng.integers(0, 1000, 96)
        b = np.concatenate((a[:48], rng.integers(0, 1000, 48)))
        for t in (a, b):
            compute(cache, t)
        evict_l1_l2(cache)
        assert cache.storage.l3 is not None and cache.storage.l3.stats["backup_pages"] == 144 // page
        for t in (a, b):
            _from_l3, reused = fetch(cache, t)
            assert reused == len(t)
        assert cache.stats["prefetch_loaded_tokens"] == 144  # b's shared half came from L2
    assert cache.storage.pending_storage() == (0, 0, 0)


def test_round_trip_mla_page_first_direct(tmp_path: Path) -> None:
    with make(FileStorage(path=tmp_path), shape=MLAShape(3, 8, 4), layout="page_first_direct") as cache:
        t = np.arange(128)
        compute(cache, t)
        evict_l1_l2(cache)
        assert fetch(cache, t) == (128, 128)


def test_below_threshold_no_prefetch_and_revocation() -> None:
    with make(MemoryStorage(), threshold=64) as cache:
        compute(cache, np.arange(48))
        evict_l1_l2(cache)
        m = cache.match_prefix(np.arange(48))
        mount, _mlen = cache.storage.prefetch_mount(m)
        assert not cache.storage.prefetch_from_storage("short", mount, np.arange(48))  # 48 < 64 tokens
        # enough tokens asked, but storage holds only 48 of them: revoked, slots released
        t = np.arange(96)
        assert cache.storage.prefetch_from_storage("rev", mount, t)
        assert cache.storage.wait_prefetch("rev", 30)
        assert cache.storage.ongoing_prefetch["rev"].op.revoked
        assert cache.storage.check_prefetch_progress("rev") and cache.storage.pop_prefetch_loaded_tokens("rev") == 0
        cache.check_hicache_events()
        assert cache.host_pool.available_size() == cache.host_pool.size
        assert cache.storage.l3 is not None and cache.storage.l3.stats["prefetch_revoked"] == 1
        cache.check_invariants()


def test_a_full_host_pool_makes_room_for_a_prefetch_from_its_least_recent_pages() -> None:
    """As SGLang's cache, a prefetch that finds the host pool full evicts host-only pages
    for its slots (else, in steady state, L3 would never be read again); the node it
    continues from stays (the match has just touched it, and it is protected meanwhile)."""
    with make(MemoryStorage(), host=160, threshold=16) as cache:
        rng = np.random.default_rng(7)
        a = rng.integers(0, 1000, 96)
        compute(cache, a)
        evict_l1_l2(cache)  # a is in L3 only
        compute(cache, a[:48])  # a's first half back on the host: the prefetch's mount
        for _ in range(2):
            compute(cache, rng.integers(1000, 2000, 48))
        cache.flush()
        while cache.storage.ongoing_backup:
            cache.storage.ongoing_backup[0].done.wait(30)
            cache.check_hicache_events()
        cache.evict(10**9)  # everything host-only
        assert cache.host_pool.available_size() < 48
        assert fetch(cache, a) == (48, 96)
        assert cache.stats["host_evicted_tokens"] >= 32 and cache.stats["prefetch_skipped_no_host"] == 0
        cache.check_invariants()


def test_capacity_below_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="no prefetch could ever run"):
        make_cfg = PrefetchConfig(threshold_tokens=256, capacity_tokens=128)
        dev = DeviceKVPool(SHAPE, size=64, page_size=16, dtype=torch.float16)
        host = HostKVPool(SHAPE, 512, 16, torch.float16, reserve_bytes=0)
        HiRadixCache(dev, host, storage=StorageOptions(backend=MemoryStorage(), prefetch=make_cfg))


def test_timeout_formula_defaults() -> None:
    cfg = PrefetchConfig(policy="timeout")
    assert (cfg.timeout_base_s, cfg.timeout_per_ki_token_s, cfg.timeout_max_s) == (2.0, 0.1, 30.0)
    assert cfg.timeout_for(0) == 2.0 and cfg.timeout_for(10_240) == 3.0 and cfg.timeout_for(10**7) == 30.0
    with pytest.raises(ValueError, match="prefetch policy"):
        PrefetchConfig(policy="eventually")


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_with_a_slow_backend(policy: str) -> None:
    storage = GatedStorage()
    clock = FakeClock()
    with make(storage, policy=policy, clock=clock) as cache:
        t = np.arange(128)
        storage.gate.set()
        compute(cache, t)
        evict_l1_l2(cache)
        storage.gate.clear()
        storage.reading.clear()
        m = cache.match_prefix(t)
        mount, _mlen = cache.storage.prefetch_mount(m)
        assert cache.storage.prefetch_from_storage("r", mount, t)
        assert storage.reading.wait(30)  # the IO thread is stuck in the first read
        if policy == "best_effort":
            assert cache.storage.check_prefetch_progress("r")  # ends at once with what landed: nothing
            assert cache.storage.pop_prefetch_loaded_tokens("r") == 0
        elif policy == "wait_complete":
            assert not cache.storage.check_prefetch_progress("r")
            clock.advance(1000)
            assert not cache.storage.check_prefetch_progress("r")
            storage.gate.set()
            assert cache.storage.wait_prefetch("r", 30)
            assert cache.storage.check_prefetch_progress("r")
            assert cache.storage.pop_prefetch_loaded_tokens("r") == 128
        else:
            assert not cache.storage.check_prefetch_progress("r")
            clock.advance(PrefetchConfig().timeout_for(128) - 0.01)
            assert not cache.storage.check_prefetch_progress("r")
            clock.advance(0.02)
            assert cache.storage.check_prefetch_progress("r")  # timed out: what landed (nothing yet)
            assert cache.storage.pop_prefetch_loaded_tokens("r") == 0
        storage.gate.set()
        settle(cache)
        assert cache.storage.pending_storage()[0] == 0
        cache.check_invariants()
        if policy != "wait_complete":  # the terminated prefetch's slots all came back
            assert cache.host_pool.available_size() == cache.host_pool.size
    assert cache.storage.pending_storage() == (0, 0, 0)


def test_detach_with_prefetch_and_backup_in_flight_loses_nothing() -> None:
    storage = GatedStorage()
    with make(storage) as cache:
        t = np.arange(256)
        storage.gate.set()
        compute(cache, t[:128])
        evict_l1_l2(cache)
        storage.gate.clear()
        storage.reading.clear()
        m = cache.match_prefix(t[:128])
        mount, _ = cache.storage.prefetch_mount(m)
        assert cache.storage.prefetch_from_storage("a", mount, t[:128])
        assert storage.reading.wait(30)
        compute(cache, t[128:] + 5000)  # a backup to L3 queued behind nothing: runs now
        held_before = cache.host_pool.available_size()
        storage.gate.set()  # detach waits for the stuck read; it must not hang
        ok, msg = cache.storage.detach_storage_backend()
        assert ok, msg
        assert not cache.storage.enable_storage and cache.storage.pending_storage() == (0, 0, 0)
        assert cache.host_pool.available_size() > held_before  # the prefetch slots came back
        cache.check_invariants()
        assert cache.tree.protected_size() == 0
        # attach again and keep serving: the pages written before are still in L3
        ok, msg = cache.storage.attach_storage_backend(storage, prefetch=PrefetchConfig(threshold_tokens=32))
        assert ok, msg
        assert cache.storage.attach_storage_backend(storage)[0] is False  # already attached
        cache.evict(10**9)
        cache.evict_host(10**9)
        assert fetch(cache, t[:128], rid="b") == (128, 128)
    assert cache.storage.detach_storage_backend() == (False, "no storage backend is attached")


def test_detach_and_attach_under_a_running_loop() -> None:
    """Detach and re-attach between scheduler steps while requests run: nothing leaks."""
    storage = MemoryStorage()
    with make(storage, device=256, host=256) as cache:
        rng = np.random.default_rng(3)
        bases = [rng.integers(0, 9999, 128) for _ in range(6)]
        for step in range(60):
            t = bases[step % 6]
            if cache.storage.enable_storage and step % 7 == 3:
                assert cache.storage.detach_storage_backend()[0]
            elif not cache.storage.enable_storage and step % 7 == 5:
                assert cache.storage.attach_storage_backend(storage, prefetch=PrefetchConfig(threshold_tokens=32))[0]
            _, reused = fetch(cache, t, rid=f"s{step}")
            slots = cache.alloc_device(len(t) - reused)
            if slots is None:
                continue
            m = cache.match_prefix(t)
            fill(cache.device_pool, slots, prefix_seeds(t)[len(m.device_indices) :])
            cache.cache_finished_req(Req("x", t, torch.cat((m.device_indices, slots)), m.device_indices))
            cache.check_hicache_events()
            cache.check_invariants()
            if step % 5 == 0:
                cache.flush()
                cache.evict(200)
                cache.evict_host(100)
        cache.flush()
    assert cache.storage.pending_storage() == (0, 0, 0)


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
def test_storage_failure_is_a_miss(inline: bool) -> None:
    storage = BrokenStorage()
    with make(storage, inline=inline) as cache:
        t = np.arange(128)
        compute(cache, t)
        evict_l1_l2(cache)
        storage.broken = True
        assert fetch(cache, t) == (0, 0)  # a miss: recompute, nothing crashed
        assert storage.get_stats().errors > 0
        storage.broken = False
        assert fetch(cache, t, rid="again") == (128, 128)


def test_tenant_b_never_hits_tenant_a() -> None:
    storage = MemoryStorage()
    ns_a = KeyNamespace(model="m", tenant="a")
    ns_b = KeyNamespace(model="m", tenant="b")
    t = np.arange(128)
    with make(storage, namespace=ns_a) as cache_a:
        compute(cache_a, t, extra_key=ns_a.extra_key())
        evict_l1_l2(cache_a)
    with make(storage, namespace=ns_b) as cache_b:
        assert fetch(cache_b, t, extra_key=ns_b.extra_key()) == (0, 0)
        assert fetch(cache_b, t, rid="no-ns") == (0, 0)  # nor does an un-namespaced request
    with make(storage, namespace=ns_a) as cache_a2:
        assert fetch(cache_a2, t, extra_key=ns_a.extra_key()) == (128, 128)


def test_aborted_request_releases_its_prefetch() -> None:
    storage = GatedStorage()
    with make(storage) as cache:
        t = np.arange(128)
        storage.gate.set()
        compute(cache, t)
        evict_l1_l2(cache)
        storage.gate.clear()
        m = cache.match_prefix(t)
        mount, _ = cache.storage.prefetch_mount(m)
        assert cache.storage.prefetch_from_storage("gone", mount, t)
        cache.storage.release_aborted_request("gone")
        assert cache.storage.pending_storage()[0] == 0
        storage.gate.set()
        settle(cache)
        assert cache.host_pool.available_size() == cache.host_pool.size
        assert cache.tree.parent(mount) == -1 or cache.tree.node_info(mount)["host_ref_counter"] == 0
        cache.check_invariants()


class GenericOnlyStorage(MemoryStorage):
    """A backend without the v1 calls: the L3 threads use batch_get / batch_set."""

    capabilities = Capabilities(supports_v1=False)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_round_trip_through_a_generic_backend(layout: str) -> None:
    with make(GenericOnlyStorage(), layout=layout) as cache:
        assert cache.storage.l3 is not None and not cache.storage.l3.use_v1
        t = np.arange(128)
        compute(cache, t)
        evict_l1_l2(cache)
        assert fetch(cache, t) == (128, 128)


class RecordingStorage(MemoryStorage):
    """Records what each lookup, v1 read and v1 write hands the backend."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[str], Any]] = []

    def batch_exists(self, keys: Any, extra_info: Any = None) -> int:
        self.calls.append(("exists", list(keys), extra_info))
        return super().batch_exists(keys, extra_info)

    def batch_get_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> list[bool]:
        self.calls.append(("get", list(keys), extra_info))
        return super().batch_get_v1(keys, host_indices, extra_info)

    def batch_set_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> list[bool]:
        self.calls.append(("set", list(keys), extra_info))
        return super().batch_set_v1(keys, host_indices, extra_info)


def test_prefix_keys_reach_the_backend_only_when_asked() -> None:
    """SGLang's ``hicache_storage_pass_prefix_keys``: every call gets the storage keys of
    all the pages before its own (a backup its node's ancestors', a batched lookup or
    read the pages before its batch); without it, no extra info at all."""
    rec = RecordingStorage()
    t = np.arange(256)  # 16 pages of 16: a node of 4 pages, then one of 12 below it
    with make(rec) as cache:
        compute(cache, t[:64])
        evict_l1_l2(cache)
        assert rec.calls and all(info is None for _, _, info in rec.calls)
        assert cache.storage.detach_storage_backend()[0]
        ok, msg = cache.storage.attach_storage_backend(
            rec,
            prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=32, batch_pages=4),
            pass_prefix_keys=True,
        )
        assert ok, msg
        rec.calls.clear()
        compute(cache, t[:64])
        compute(cache, t)
        evict_l1_l2(cache)
        sets = [(keys, info) for kind, keys, info in rec.calls if kind == "set"]
        assert [len(keys) for keys, _ in sets] == [4, 12]
        all_keys = sets[0][0] + sets[1][0]
        assert sets[0][1].prefix_keys == () and sets[1][1].prefix_keys == tuple(sets[0][0])
        rec.calls.clear()
        assert fetch(cache, t) == (256, 256)
        reads = [(kind, keys, info) for kind, keys, info in rec.calls if kind in ("exists", "get")]
        assert sum(kind == "get" for kind, _, _ in reads) == 4  # batches of 4 pages
        for kind, keys, info in reads:
            first = all_keys.index(keys[0])
            assert keys == all_keys[first : first + len(keys)]
            assert info.prefix_keys == tuple(all_keys[:first]), f"{kind} at page {first}"


def test_prefix_keys_survive_a_reset() -> None:
    """``reset`` re-attaches the backend it detached as it was attached: with its prefix
    keys still passed (SGLang's flush must not turn ``hicache_storage_pass_prefix_keys``
    off)."""
    rec = RecordingStorage()
    t = np.arange(128)
    with make(MemoryStorage()) as cache:
        assert cache.storage.detach_storage_backend()[0]
        config = PrefetchConfig(policy="wait_complete", threshold_tokens=32, batch_pages=4)
        assert cache.storage.attach_storage_backend(rec, prefetch=config, pass_prefix_keys=True)[0]
        cache.reset()
        assert cache.storage.pass_prefix_keys and cache.storage.l3 is not None
        compute(cache, t[:64])
        compute(cache, t)
        evict_l1_l2(cache)
        sets = [(keys, info) for kind, keys, info in rec.calls if kind == "set"]
        assert [len(keys) for keys, _ in sets] == [4, 4]
        assert sets[1][1] is not None and sets[1][1].prefix_keys == tuple(sets[0][0])


def test_query_hit_tokens_counts_what_l3_holds_after_the_mount() -> None:
    """The hit length a scheduler asks before it prefetches: whole pages from the mount on,
    0 below the threshold, and a backend that fails is a miss, not an error."""
    storage = BrokenStorage()
    t = np.arange(160)
    with make(storage, threshold=32) as cache:
        compute(cache, t[:128])
        evict_l1_l2(cache)
        root = cache.match_prefix(t).last_node
        assert cache.storage.query_hit_tokens(root, t) == 128  # 10 pages asked, the first 8 held
        assert cache.storage.query_hit_tokens(root, t[:31]) == 0  # below the threshold
        assert cache.storage.query_hit_tokens(root, t[1:]) == 0  # another chain
        storage.broken = True
        assert cache.storage.query_hit_tokens(root, t) == 0
        assert cache.storage.pending_storage() == (0, 0, 0)  # asked, nothing started
