"""HiRadixCache and HiCacheController: tier round trips with the bytes checked, the three
eviction paths, failure handling (host allocation, copies) and layer-wise ordering."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import torch

from hiradix.cache import HiRadixCache, Req, StorageOptions, TierOptions, TreeOptions
from hiradix.cache.controller import HiCacheController
from hiradix.cache.distributed import LocalAgreement
from hiradix.memory import HOST_LAYOUTS, DeviceKVPool, HostKVPool, MHAShape, MLAShape
from hiradix.memory.copy import CopyError
from hiradix.storage import MemoryStorage
from hiradix.tree import Change, LockError
from tests.support import tree_snapshot
from tests.support.kvdata import fill, mismatches, prefix_seeds, scribble

SHAPES = {"mha": MHAShape(3, 2, 4), "mla": MLAShape(3, 8, 4)}


def make_cache(
    *,
    shape: str = "mha",
    page_size: int = 4,
    device_tokens: int = 256,
    host_tokens: int = 512,
    layout: str = "layer_first",
    dtype: torch.dtype = torch.float32,
    host_pool_cls: type[HostKVPool] = HostKVPool,
    write_policy: str = "write_through",
    load_back_threshold: int = 0,
    batch_backups: bool = False,
    **kwargs: Any,
) -> HiRadixCache:
    dev = DeviceKVPool(SHAPES[shape], size=device_tokens, page_size=page_size, dtype=dtype)
    host = host_pool_cls(SHAPES[shape], host_tokens, page_size, dtype, layout, reserve_bytes=0)
    tree = TreeOptions(write_policy=write_policy)
    tiers = TierOptions(load_back_threshold=load_back_threshold, batch_backups=batch_backups)
    return HiRadixCache(dev, host, tree=tree, tiers=tiers, **kwargs)


def compute(cache: HiRadixCache, tokens: np.ndarray, extra_key: str | None = None) -> tuple[Any, int]:
    """Serve one prompt: match, load back the host tail, allocate the rest, "compute" its
    KV, check every reused byte, then cache the finished request. Returns the match and
    the number of tokens whose KV came from the cache."""
    m = cache.match_prefix(tokens, extra_key)
    loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
    cache.inc_lock_ref(node)
    prefix = torch.cat((m.device_indices, loaded))
    new = cache.alloc_device(len(tokens) - len(prefix))
    assert new is not None, "test pools are sized so that a request always fits"
    fill(cache.device_pool, new, prefix_seeds(tokens)[len(prefix) :])
    pid = cache.ready_to_load_host_cache()
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(pid)
    seeds = prefix_seeds(tokens)
    for layer in range(cache.device_pool.layer_num):
        counter.wait_until(layer)
        assert mismatches(cache.device_pool, prefix, seeds[: len(prefix)], [layer]) == 0, f"layer {layer}"
    req = Req("r", np.asarray(tokens), torch.cat((prefix, new)), prefix, node, extra_key)
    cache.cache_finished_req(req)
    cache.check_hicache_events()
    return m, len(prefix)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", ["mha", "mla"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bytes_identical(page_size: int, shape: str, layout: str, dtype: torch.dtype) -> None:
    """Device -> host -> device: every byte of every layer comes back, for each layout."""
    with make_cache(
        shape=shape, page_size=page_size, layout=layout, dtype=dtype, device_tokens=256, host_tokens=512
    ) as cache:
        rng = np.random.default_rng(page_size)
        prompts = [rng.integers(0, 1000, 48) for _ in range(3)]
        prompts.append(np.concatenate((prompts[0][:32], rng.integers(0, 1000, 32))))  # shares a prefix
        for p in prompts:
            compute(cache, p)
        cache.flush()
        assert cache.tree.host_size() == cache.tree.device_size()  # write_through: everything backed up
        held = cache.tree.device_size()
        freed = cache.evict(10**6)
        assert freed == held and cache.tree.device_size() == 0
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))  # reused slots
        for p in prompts:
            _m, reused = compute(cache, p)
            aligned = len(p) // page_size * page_size
            assert reused == aligned, "the whole prompt came back from the host"
        cache.flush()
        cache.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_round_trip_on_cuda(layout: str) -> None:
    """The same round trip with the device pool on the GPU and a pinned host pool."""
    dev = DeviceKVPool(SHAPES["mha"], size=256, page_size=16, dtype=torch.bfloat16, device="cuda")
    host = HostKVPool.for_device(dev, ratio=2.0, layout=layout)
    assert host.pin_memory
    with HiRadixCache(dev, host, tiers=TierOptions(load_back_threshold=0)) as cache:
        tokens = np.arange(128)
        slots = cache.alloc_device(128)
        data = [torch.randn(dev.total_slots, 2, 4, device="cuda").to(torch.bfloat16) for _ in range(3)]
        for layer in range(3):
            dev.k_buffer(layer)[slots] = data[layer][slots]
        cache.insert(tokens, slots)
        cache.flush()
        cache.evict(128)
        m = cache.match_prefix(tokens)
        loaded, _ = cache.init_load_back(m.last_node, m.host_hit_length)
        counter = cache.cache_controller.layer_done_counter
        counter.set_consumer(cache.ready_to_load_host_cache())
        for layer in range(3):
            counter.wait_until(layer)
            torch.cuda.current_stream().synchronize()
            assert torch.equal(dev.k_buffer(layer)[loaded], data[layer][slots])
        cache.flush()
        cache.check_invariants()


def test_write_back_eviction_backs_up_then_demotes() -> None:
    with make_cache(write_policy="write_back") as cache:
        p = np.arange(64)
        compute(cache, p)
        cache.flush()
        assert cache.tree.host_size() == 0, "write_back backs up nothing before eviction"
        freed = cache.evict(64)
        assert freed == 64 and cache.tree.device_size() == 0
        assert cache.tree.host_size() == 64
        assert cache.stats["write_back_dropped_tokens"] == 0
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))
        _, reused = compute(cache, p)
        assert reused == 64
        cache.check_invariants()


def test_write_back_without_host_room_deletes_the_victim() -> None:
    with make_cache(write_policy="write_back", device_tokens=64, host_tokens=16) as cache:
        compute(cache, np.arange(32))
        before = cache.tree.num_nodes()
        assert cache.evict(32) == 32
        assert cache.stats["write_back_dropped_tokens"] == 32
        assert cache.tree.num_nodes() == before - 1 and cache.tree.host_size() == 0
        assert cache.host_pool.available_size() == 16
        cache.check_invariants()


def test_write_through_selective_backs_up_on_second_hit() -> None:
    with make_cache(write_policy="write_through_selective") as cache:
        p = np.arange(32)
        compute(cache, p)
        cache.flush()
        assert cache.tree.host_size() == 0
        compute(cache, p)
        cache.flush()
        assert cache.tree.host_size() == 32


def test_batched_backups_start_at_the_step_parents_first() -> None:
    """With ``batch_backups`` the inserts only note their backups; the step's
    ``check_hicache_events`` starts them together. The second insert splits the first
    node and asks for the new parent after the child: the parent still goes first (a
    child is backed up only below a parent that is), so everything is backed up, and the
    bytes come back from the host."""
    with make_cache(batch_backups=True) as cache:
        tree, rng = cache.tree, np.random.default_rng(7)
        a = rng.integers(0, 1000, 32)
        b = np.concatenate((a[:16], rng.integers(1000, 2000, 16)))
        for p in (a, b):
            m = cache.match_prefix(p)
            new = cache.alloc_device(len(p) - len(m.device_indices))
            fill(cache.device_pool, new, prefix_seeds(p)[len(m.device_indices) :])
            prefix = cache.insert(p, torch.cat((m.device_indices, new)))
            cache._free_device(new[: prefix - len(m.device_indices)])
        assert len(cache._pending_backups) == 3  # a; then the split parent and b's leaf
        assert tree.host_size() == 0 and not cache.ongoing_write_through, "nothing started before the step"
        child, parent = cache._pending_backups[:2]
        assert tree.parent(child) == parent
        cache.check_hicache_events()  # starts all three (it may also acknowledge copies already done)
        assert not cache._pending_backups and cache.stats["backup_started_tokens"] == 48
        cache.flush()
        assert tree.host_size() == tree.device_size() == 48
        assert cache.evict(10**6) == 48
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))
        for p in (a, b):
            _, reused = compute(cache, p)
            assert reused == 32
        cache.check_invariants()


def test_batched_backups_start_before_an_eviction_and_are_protected_while_waiting() -> None:
    """An eviction before the step starts the waiting backups first, so it keeps those
    nodes as an unbatched cache would (a node being backed up is not a victim). Waiting,
    they are protected already, as a backup in flight is: the deepest node the insert
    asks to back up is locked (the scheduler admits requests by evictable_size()),
    nothing can drop them, and the step's backups release that lock."""
    for batch in (False, True):
        with make_cache(batch_backups=batch) as cache:
            p = np.arange(32)
            slots = cache.alloc_device(32)
            fill(cache.device_pool, slots, prefix_seeds(p))
            cache.insert(p, slots)
            assert cache.evict(32) == 0, batch  # in flight: kept
            cache.flush()
            assert cache.tree.host_size() == 32 and cache.evict(32) == 32
            cache.check_invariants()
    with make_cache(batch_backups=True) as cache:
        slots = cache.alloc_device(32)
        cache.insert(np.arange(32), slots)
        (node,) = cache._pending_backups
        tree = cache.tree
        assert (tree.evictable_size(), tree.protected_size()) == (0, 32)
        with pytest.raises(LockError):
            tree.drop(node)
        cache.check_invariants()
        cache.check_hicache_events()  # started: the backup in flight holds its own lock
        assert not cache._held and cache.ongoing_write_through
        cache.flush()
        assert tree.host_size() == 32 and tree.lock_ref(node) == 0
        assert (tree.evictable_size(), tree.protected_size()) == (32, 0)
        cache.check_invariants()


def test_a_match_that_splits_a_waiting_node_loses_no_backup() -> None:
    """A match that splits a node whose batched backup has not started makes a parent no
    insert asked for: the step backs it up too (its child's backup needs it), and every
    byte comes back from the host."""
    with make_cache(batch_backups=True) as cache:
        p = np.arange(32)
        slots = cache.alloc_device(32)
        fill(cache.device_pool, slots, prefix_seeds(p))
        cache.insert(p, slots)
        assert len(cache.match_prefix(p[:16]).device_indices) == 16  # splits the waiting node
        assert cache.tree.num_nodes() == 2 and len(cache._pending_backups) == 1
        cache.check_hicache_events()
        cache.flush()
        assert cache.tree.host_size() == 32 and cache.stats["host_alloc_failed_tokens"] == 0
        assert cache.evict(32) == 32
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))
        assert compute(cache, p)[1] == 32  # every byte back from the host
        cache.check_invariants()


class FlakyHostPool(HostKVPool):
    """A host pool whose ``alloc_array`` (every host allocation) fails while ``fail`` says so (injected fault)."""

    fail: Any = None

    def alloc_array(self, n_tokens: int) -> np.ndarray | None:
        if self.fail is not None and self.fail(n_tokens):
            return None
        return super().alloc_array(n_tokens)


def test_host_alloc_failure_evicts_host_and_retries() -> None:
    with make_cache(device_tokens=64, host_tokens=64) as cache:
        compute(cache, np.arange(64))
        cache.flush()
        cache.evict(64)  # all 64 host slots now hold host-only KV
        assert cache.host_pool.available_size() == 0
        compute(cache, np.arange(1000, 1032))  # its backup needs 32 host slots
        cache.flush()
        assert cache.stats["host_evicted_tokens"] == 64  # the old node, whole
        assert cache.stats["host_alloc_failed_tokens"] == 0
        assert cache.tree.host_size() == 32
        cache.check_invariants()


def test_backup_that_cannot_get_host_slots_leaves_the_tree_untouched() -> None:
    cache = make_cache(host_pool_cls=FlakyHostPool)
    with cache:
        host = cache.host_pool
        assert isinstance(host, FlakyHostPool)
        compute(cache, np.arange(32))
        cache.flush()
        host.fail = lambda n: True
        tree = cache.tree
        p = np.concatenate((np.arange(32), np.arange(500, 532)))
        m = cache.match_prefix(p)
        slots = cache.alloc_device(32)
        fill(cache.device_pool, slots, prefix_seeds(p)[32:])
        insert_snapshot = None
        # insert itself changes the tree (the new node); the failed backup must change nothing more
        result = tree.insert(p, torch.cat((m.device_indices, slots)))
        insert_snapshot = tree_snapshot(tree)
        free_before = host.available_size()
        assert cache._write_backup_nodes(result.backup_nodes) == 0
        assert tree_snapshot(tree) == insert_snapshot
        assert host.available_size() == free_before
        assert cache.protected_size() == 0 and cache.pending_protections() == (0, 0)
        assert cache.stats["host_alloc_failed_tokens"] == 32
        cache.check_invariants()


def test_failed_backup_copy_leaves_the_tree_untouched() -> None:
    fail_backups = threading.Event()

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "backup" and layer == 1 and fail_backups.is_set():
            raise OSError("injected DMA error")

    with make_cache(layer_hook=hook) as cache:
        compute(cache, np.arange(32))
        cache.flush()
        fail_backups.set()
        p = np.concatenate((np.arange(32), np.arange(500, 532)))
        m = cache.match_prefix(p)
        slots = cache.alloc_device(32)
        result = cache.tree.insert(p, torch.cat((m.device_indices, slots)))
        snapshot = tree_snapshot(cache.tree)
        host_free = cache.host_pool.available_size()
        assert cache._write_backup_nodes(result.backup_nodes) == 32
        assert cache.protected_size() == 64  # the node and its ancestor, locked while in flight
        cache.flush()
        assert tree_snapshot(cache.tree) == snapshot
        assert cache.host_pool.available_size() == host_free
        assert cache.stats["backup_failed_tokens"] == 32
        assert cache.protected_size() == 0 and cache.pending_protections() == (0, 0)
        cache.check_invariants()


def _without_locks(snapshot: list[Any]) -> list[Any]:
    """A tree snapshot without the nodes' lock counts."""
    return [({k: v for k, v in row[0].items() if k not in ("lock_ref", "own_lock_ref")}, *row[1:]) for row in snapshot]


@pytest.mark.parametrize("fail", [False, True])
def test_a_steps_backups_on_an_inline_write_engine_commit_in_the_step(fail: bool) -> None:
    """With an inline write engine a step's batch is copied and committed inside
    ``check_hicache_events`` (HiCacheController.write_now), nothing left in flight; a
    failed copy leaves the nodes as they were, frees their host slots and counts them."""

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "backup" and layer == 1 and fail:
            raise OSError("injected copy error")

    dev = DeviceKVPool(SHAPES["mha"], size=256, page_size=4, dtype=torch.float32)
    host = HostKVPool(SHAPES["mha"], 512, 4, torch.float32, "layer_first", reserve_bytes=0)
    ctrl = HiCacheController(dev, host, layer_hook=hook, inline_writes=True)
    copies: list[int] = []
    write_now = ctrl.write_now
    ctrl.write_now = lambda d, h: copies.append(len(d)) or write_now(d, h)  # type: ignore[method-assign]
    tiers = TierOptions(load_back_threshold=0, batch_backups=True)
    with HiRadixCache(dev, host, tiers=tiers, controller=ctrl) as cache:
        a = np.arange(32)
        b = np.concatenate((a[:16], np.arange(1000, 1016)))
        for p in (a, b):
            m = cache.match_prefix(p)
            new = cache.alloc_device(len(p) - len(m.device_indices))
            fill(dev, new, prefix_seeds(p)[len(m.device_indices) :])
            prefix = cache.insert(p, torch.cat((m.device_indices, new)))
            cache._free_device(new[: prefix - len(m.device_indices)])
        # (but for the locks the inserts took until the step: protected_size() below)
        snapshot = _without_locks(tree_snapshot(cache.tree))
        host_free = host.available_size()
        cache.check_hicache_events()
        assert copies == [48], "the step's batch is one synchronous copy"
        assert not cache.ongoing_write_through and not ctrl._writes.acks, "nothing in flight after the step"
        assert cache.protected_size() == 0 and cache.stats["backup_started_tokens"] == 48
        if fail:
            assert _without_locks(tree_snapshot(cache.tree)) == snapshot and host.available_size() == host_free
            assert cache.stats["backup_failed_tokens"] == 48 and cache.tree.host_size() == 0
        else:
            assert cache.stats["backup_done_tokens"] == 48 and cache.tree.host_size() == 48
            assert cache.evict(10**6) == 48
            scribble(dev, torch.arange(dev.total_slots))
            for p in (a, b):
                assert compute(cache, p)[1] == 32  # every byte back from the host
        cache.check_invariants()


def test_an_eviction_before_the_step_keeps_the_batch_on_an_inline_write_engine_too() -> None:
    """The batch an eviction starts stays in flight, kept on the device, until the step
    acknowledges it, even where the copy itself ran inline at once."""
    dev = DeviceKVPool(SHAPES["mha"], size=256, page_size=4, dtype=torch.float32)
    host = HostKVPool(SHAPES["mha"], 512, 4, torch.float32, "layer_first", reserve_bytes=0)
    ctrl = HiCacheController(dev, host, inline_writes=True)
    tiers = TierOptions(load_back_threshold=0, batch_backups=True)
    with HiRadixCache(dev, host, tiers=tiers, controller=ctrl) as cache:
        cache.insert(np.arange(32), cache.alloc_device(32))
        assert cache.evict(32) == 0 and cache.protected_size() == 32  # in flight: kept
        cache.check_hicache_events()
        assert cache.tree.host_size() == 32 and cache.evict(32) == 32
        cache.check_invariants()


@pytest.mark.parametrize("step", ["check_hicache_events", "flush"])
def test_a_steps_backups_commit_after_those_already_in_flight(step: str) -> None:
    """A batch an eviction started is still in flight at the step: the step's own batch,
    copied inline at once, commits after it, in the order the inserts asked (SGLang's
    KV events, made from these commits, come in that order)."""
    dev = DeviceKVPool(SHAPES["mha"], size=256, page_size=4, dtype=torch.float32)
    host = HostKVPool(SHAPES["mha"], 512, 4, torch.float32, "layer_first", reserve_bytes=0)
    ctrl = HiCacheController(dev, host, inline_writes=True)
    tiers = TierOptions(load_back_threshold=0, batch_backups=True)
    with HiRadixCache(dev, host, tiers=tiers, controller=ctrl) as cache:
        tree = cache.tree
        tree.track_changes = True
        cache.insert(np.arange(32), cache.alloc_device(32))
        (first,) = cache._pending_backups
        assert cache.evict(8) == 0 and cache.ongoing_write_through  # started, in flight
        cache.insert(np.arange(100, 116), cache.alloc_device(16))
        cache.insert(np.arange(200, 208), cache.alloc_device(8))
        later = list(cache._pending_backups)
        tree.take_changes()
        getattr(cache, step)()
        backed = [int(node) for kind, node, _, _ in tree.take_changes().tolist() if kind == Change.BACKED_UP]
        assert backed == [first, *later]
        assert tree.host_size() == 56 and cache.protected_size() == 0
        cache.check_invariants()


def test_failed_load_is_repaired_before_the_chain_is_unlocked() -> None:
    failures = []

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "load" and layer == 2 and not failures:
            failures.append(op_id)
            raise OSError("injected load error")

    with make_cache(layer_hook=hook) as cache:
        p = np.arange(64)
        compute(cache, p)
        cache.flush()
        cache.evict(64)
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))
        m = cache.match_prefix(p)
        loaded, _node = cache.init_load_back(m.last_node, m.host_hit_length)
        pid = cache.ready_to_load_host_cache()
        counter = cache.cache_controller.layer_done_counter
        counter.set_consumer(pid)
        counter.wait_until(1)  # layers 0 and 1 landed
        with pytest.raises(CopyError):
            counter.wait_until(2)
        cache.loading_check()
        assert cache.stats["load_retries"] == 1
        assert mismatches(cache.device_pool, loaded, prefix_seeds(p)) == 0
        assert cache.pending_protections() == (0, 0) and cache.protected_size() == 0
        cache.check_invariants()


def test_layer_i_is_never_read_before_it_lands() -> None:
    """A consumer thread runs the forward pass layer by layer while the test releases the
    load one layer at a time: after release ``k`` the consumer has read exactly layers
    ``0..k`` and each of them held the right bytes when read."""
    layer_num = SHAPES["mha"].layer_num
    gates = [threading.Event() for _ in range(layer_num)]
    active = threading.Event()

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "load" and active.is_set():
            assert gates[layer].wait(30), "test did not release the layer"

    with make_cache(layer_hook=hook) as cache:
        p = np.arange(64)
        compute(cache, p)
        cache.flush()
        cache.evict(64)
        scribble(cache.device_pool, torch.arange(cache.device_pool.total_slots))
        active.set()
        m = cache.match_prefix(p)
        loaded, _ = cache.init_load_back(m.last_node, m.host_hit_length)
        seeds = prefix_seeds(p)
        counter = cache.cache_controller.layer_done_counter
        counter.set_consumer(cache.ready_to_load_host_cache())
        read: list[tuple[int, int]] = []
        progress = threading.Condition()

        def forward() -> None:
            for layer in range(layer_num):
                counter.wait_until(layer, timeout=30)
                bad = mismatches(cache.device_pool, loaded, seeds, [layer])
                with progress:
                    read.append((layer, bad))
                    progress.notify_all()

        t = threading.Thread(target=forward)
        t.start()
        for k in range(layer_num):
            with progress:
                assert len(read) == k, f"consumer read {read} before layer {k} was released"
            gates[k].set()
            with progress:
                assert progress.wait_for(lambda k=k: len(read) > k, 30)
        t.join(30)
        assert read == [(layer, 0) for layer in range(layer_num)]
        cache.loading_check()
        active.clear()
        cache.check_invariants()


def test_load_back_threshold_and_quota() -> None:
    with make_cache(load_back_threshold=40) as cache:
        compute(cache, np.arange(32))
        cache.flush()
        cache.evict(32)
        m = cache.match_prefix(np.arange(32))
        assert m.host_hit_length == 32
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        assert len(loaded) == 0 and node == cache.tree.root  # below the threshold: recompute
        cache.load_back_threshold = 0
        assert cache.load_back(m.last_node, mem_quota=16) is None
        assert cache.load_back(m.last_node, mem_quota=32) is not None
        cache.flush()
        cache.check_invariants()


class _CountingTree:
    """The cache's tree, counting the calls made through it by name."""

    def __init__(self, tree: Any) -> None:
        self._tree = tree
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tree, name)
        if callable(attr):
            self.calls.append(name)
        return attr


def _evicted_prompt(cache: HiRadixCache, n: int) -> tuple[np.ndarray, Any]:
    """A prompt of ``n`` tokens computed, backed up and evicted to host; with its match."""
    p = np.arange(n)
    compute(cache, p)
    cache.flush()
    cache.evict(n)
    m = cache.match_prefix(p)
    assert m.host_hit_length == n
    return p, m


def test_load_back_asks_the_tree_twice() -> None:
    """The tree plans (and protects the chain), the cache allocates, the tree begins: two
    calls on the load path, one where nothing is loaded."""
    with make_cache() as cache:
        _p, m = _evicted_prompt(cache, 32)
        counting = _CountingTree(cache.tree)
        cache.tree = counting
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        assert len(loaded) == 32 and node == m.last_node
        assert counting.calls == ["plan_load_back", "begin_load_back"]
        counting.calls.clear()
        loaded, node = cache.init_load_back(m.last_node, 0)  # no host hit: the anchor
        assert len(loaded) == 0 and node == m.last_node
        assert counting.calls == ["plan_load_back"]
        cache.tree = counting._tree
        cache.flush()
        cache.check_invariants()


def test_a_load_back_without_device_room_gives_the_plan_back() -> None:
    """Every device slot held by a request: the allocation fails, the chain is not
    loaded, and the protection the plan took while evicting is released."""
    with make_cache(device_tokens=64) as cache:
        _p, m = _evicted_prompt(cache, 32)
        other = np.arange(1000, 1064)
        slots = cache.alloc_device(64)
        assert slots is not None
        cache.insert(other, slots)
        held = cache.match_prefix(other).last_device_node
        cache.inc_lock_ref(held)  # nothing evictable is left
        protected = cache.protected_size()
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        assert len(loaded) == 0 and node == cache.tree.root
        assert cache.protected_size() == protected
        assert not cache.tree.node_info(m.last_node)["load_back_planned"]
        assert cache.tree.lock_ref(m.last_node) == 0
        cache.check_invariants()
        cache.dec_lock_ref(held)
        cache.flush()  # its backup landed: evictable now
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        assert len(loaded) == 32 and node == m.last_node
        cache.flush()
        cache.check_invariants()


def test_a_load_back_whose_allocation_raises_gives_the_plan_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with make_cache() as cache:
        _p, m = _evicted_prompt(cache, 32)

        def broken(n: int) -> None:
            raise RuntimeError("allocator failed")

        monkeypatch.setattr(cache, "alloc_device", broken)
        with pytest.raises(RuntimeError, match="allocator failed"):
            cache.init_load_back(m.last_node, m.host_hit_length)
        assert cache.tree.lock_ref(m.last_node) == 0 and cache.protected_size() == 0
        cache.check_invariants()


def test_unfinished_request_moves_its_lock() -> None:
    with make_cache() as cache:
        p = np.arange(40)
        slots = cache.alloc_device(40)
        fill(cache.device_pool, slots, prefix_seeds(p))
        req = Req("a", p[:30], slots[:30].clone())
        cache.cache_unfinished_req(req, chunked=True)
        assert req.last_node != -1 and len(req.prefix_indices) == 28 and len(req.kv_indices) == 30
        assert cache.protected_size() == 28  # page-aligned part, locked for the request
        req.token_ids = p
        req.kv_indices = torch.cat((req.kv_indices, slots[30:]))
        cache.cache_finished_req(req)
        cache.flush()  # the write-through backups hold their own locks until acknowledged
        assert cache.protected_size() == 0
        cache.check_invariants()


def test_reset_empties_everything() -> None:
    cache = make_cache()
    with cache:
        compute(cache, np.arange(64))
        cache.reset()
        assert cache.tree.device_size() == 0 and cache.tree.host_size() == 0
        assert cache.available_device_size() == cache.device_allocator.size
        assert cache.host_pool.available_size() == cache.host_pool.size
        compute(cache, np.arange(64))
        cache.check_invariants()


def test_controller_rejects_mismatched_pools() -> None:
    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool(SHAPES["mla"], 32, 4, torch.float32, reserve_bytes=0)
    with pytest.raises(ValueError, match="differ"):
        HiCacheController(dev, host)


# The companion tests' slots, their host slots and the seeds their KV is filled from.
_COMPANION_SLOTS, _COMPANION_HOST = np.arange(4, 16), np.arange(20, 32)


def _companion_setup() -> tuple[HiCacheController, DeviceKVPool, DeviceKVPool, np.ndarray]:
    """A controller with a companion pair (a draft model's pool: another shape, the same
    token slots), both device pools filled at the companion slots; and the fill's seeds."""
    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool.for_device(dev, ratio=2.0, reserve_bytes=0)
    draft = DeviceKVPool(MLAShape(1, 8, 4), size=32, page_size=4, dtype=torch.float32)
    ctrl = HiCacheController(dev, host)
    ctrl.add_companion(draft, HostKVPool(draft.shape, host.size, 4, torch.float32, "page_first", reserve_bytes=0))
    seeds = prefix_seeds(np.arange(100, 112))
    for pool in (dev, draft):
        fill(pool, _COMPANION_SLOTS, seeds)
    return ctrl, dev, draft, seeds


def test_companion_pools_follow_every_backup_and_load() -> None:
    """A companion pair (SGLang's draft model KV) is backed up and loaded at the same
    indices as the main pair, bytes intact in both, and one ack covers both."""
    ctrl, dev, draft, seeds = _companion_setup()
    slots, host_slots = _COMPANION_SLOTS, _COMPANION_HOST
    try:
        ctrl.write(slots, host_slots)
        ack = ctrl.start_writing()
        assert ack is not None and len(ack.companions) == 1
        ((got, ok),) = ctrl.ack_writes(wait_all=True)
        assert got is ack and ok and ack.done()
        for pool in (dev, draft):
            scribble(pool, slots)
        ctrl.load(host_slots, slots)
        ctrl.start_loading()
        ((_, ok),) = ctrl.ack_loads(wait_all=True)
        assert ok and mismatches(dev, slots, seeds) == 0 and mismatches(draft, slots, seeds) == 0
    finally:
        ctrl.close()


def test_a_load_copied_again_refills_every_pool() -> None:
    """``load_again`` (the retry of a failed load) copies the batch from the host again into
    the companion pools as well as the main one, and returns once it has landed."""
    ctrl, dev, draft, seeds = _companion_setup()
    slots, host_slots = _COMPANION_SLOTS, _COMPANION_HOST
    try:
        ctrl.write(slots, host_slots)
        ctrl.start_writing()
        ctrl.ack_writes(wait_all=True)
        ctrl.load(host_slots, slots)
        ctrl.start_loading()
        ((ack, ok),) = ctrl.ack_loads(wait_all=True)
        assert ok
        for pool in (dev, draft):
            scribble(pool, slots)  # as a failed load may leave them
        ctrl.load_again(ack)
        assert mismatches(dev, slots, seeds) == 0 and mismatches(draft, slots, seeds) == 0
    finally:
        ctrl.close()


class _FirstStagesCount(LocalAgreement):
    """A later pipeline stage's agreement: counts come from the first stage, whose copies
    finished while this stage's (held at their first layer by ``gate``) have not."""

    def __init__(self, count: int, gate: threading.Event) -> None:
        self.count, self.gate = count, gate

    def min_int(self, value: int) -> int:
        self.gate.set()  # this stage's copy may go on: _ack must wait for it
        return self.count


def test_a_later_stage_waits_for_its_own_copies_to_reach_the_first_stages_count() -> None:
    gate = threading.Event()

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "backup" and layer == 0:
            assert gate.wait(60), "the ack never asked for the count"

    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool.for_device(dev, ratio=2.0, reserve_bytes=0)
    ctrl = HiCacheController(dev, host, layer_hook=hook, agreement=_FirstStagesCount(1, gate))
    slots, host_slots = np.arange(4, 16), np.arange(20, 32)
    seeds = prefix_seeds(np.arange(100, 112))
    try:
        fill(dev, slots, seeds)
        ctrl.write(slots, host_slots)
        ack = ctrl.start_writing()
        assert ack is not None and not ack.done()  # held at its first layer
        ((got, ok),) = ctrl.ack_writes()  # the first stage's count: 1, this stage's own: 0
        assert got is ack and ok and ack.done()
        scribble(dev, slots)
        ctrl.load(host_slots, slots)
        ctrl.start_loading()
        ((_, ok),) = ctrl.ack_loads(wait_all=True)
        assert ok and mismatches(dev, slots, seeds) == 0  # the host copy was whole when acknowledged
        with pytest.raises(RuntimeError, match="agreed on 1 backup acks; this rank has 0"):
            ctrl.ack_writes()  # a count past the queue: the stages diverged
    finally:
        ctrl.close()


def test_companion_loads_finish_before_the_main_loads_first_layer() -> None:
    """The forward pass waits on the main load's layer events only, so the companion's
    load is submitted first on the same FIFO engine: once layer 0 is usable, it is done."""
    ctrl, _, _, _ = _companion_setup()
    try:
        ctrl.write(np.arange(8), np.arange(8))
        ctrl.start_writing()
        ctrl.ack_writes(wait_all=True)
        ctrl.load(np.arange(8), np.arange(8, 16))
        producer = ctrl.start_loading()
        ctrl.layer_done_counter.set_consumer(producer)
        ctrl.layer_done_counter.wait_until(0, timeout=30.0)
        (ack,) = ctrl._loads.acks
        assert all(h.done() for h in ack.companions)
    finally:
        ctrl.close()


@pytest.mark.parametrize(
    ("draft", "host_slots", "match"),
    [
        (dict(size=32, page_size=8), None, "page size"),
        (dict(size=16, page_size=4), None, "fewer"),
        (dict(size=32, page_size=4), 8, "fewer"),
    ],
    ids=["page-size", "device-slots", "host-slots"],
)
def test_companion_pools_must_share_the_main_pools_slots(
    draft: dict[str, int], host_slots: int | None, match: str
) -> None:
    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool.for_device(dev, ratio=2.0, reserve_bytes=0)
    ctrl = HiCacheController(dev, host)
    try:
        cdev = DeviceKVPool(SHAPES["mha"], dtype=torch.float32, **draft)
        chost = HostKVPool(cdev.shape, host_slots or host.size, cdev.page_size, torch.float32, reserve_bytes=0)
        with pytest.raises(ValueError, match=match):
            ctrl.add_companion(cdev, chost)
        assert ctrl.companions == ()
    finally:
        ctrl.close()


def test_alloc_host_all_or_nothing_across_ranks() -> None:
    """The controller keeps a host allocation only where every rank got one."""

    class HalfAgreement(LocalAgreement):
        def all_true(self, flags: Any) -> list[bool]:  # another rank failed the odd ones
            return [bool(f) and i % 2 == 0 for i, f in enumerate(flags)]

    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool.for_device(dev, ratio=2.0, reserve_bytes=0)
    ctrl = HiCacheController(dev, host, agreement=HalfAgreement())
    try:
        got = ctrl.alloc_host([4, 4, 4, 4])
        assert [g is not None for g in got] == [True, False, True, False]
        assert host.available_size() == host.size - 8
    finally:
        ctrl.close()


def test_option_objects_refuse_bad_fields_when_built() -> None:
    """The cache's option objects check their fields themselves, before any pool or thread
    exists, and the cache refuses anything but them where they go."""
    with pytest.raises(ValueError, match="unknown write policy"):
        TreeOptions(write_policy="write_sometimes")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        TreeOptions(eviction_policy="random")
    with pytest.raises(TypeError, match="clock must be callable"):
        TreeOptions(clock=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_back_threshold"):
        TierOptions(load_back_threshold=-1)
    with pytest.raises(TypeError, match="key_suffix must be a str"):
        StorageOptions(key_suffix=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend must be a StorageBackend"):
        StorageOptions(backend="memory")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_rank without a namespace"):
        StorageOptions(tp_rank=1)
    with pytest.raises(ValueError, match="storage key"):
        StorageOptions(key_suffix="x" * 4096)
    dev = DeviceKVPool(SHAPES["mha"], size=32, page_size=4, dtype=torch.float32)
    host = HostKVPool.for_device(dev, ratio=2.0, reserve_bytes=0)
    with pytest.raises(TypeError, match="storage must be StorageOptions"):
        HiRadixCache(dev, host, storage=MemoryStorage())  # type: ignore[arg-type]
    options = TreeOptions(write_policy="write_back")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.write_policy = "write_through"  # type: ignore[misc]
    with HiRadixCache(dev, host, tree=options) as cache:
        assert cache.tree.write_policy == "write_back" and not cache.storage.enable_storage
