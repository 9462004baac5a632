"""The public seam the simulator stands on: the copy engine's inline mode, the
controller's ``inline_copies`` and the cache's observer events. The simulator uses only
these (no patched methods, no private attributes), so these tests pin what it relies on.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from hiradix.cache import CacheObserver, HiRadixCache, Req, TierOptions, TreeOptions
from hiradix.cache.controller import HiCacheController
from hiradix.memory.copy import CopyError, ThreadCopyEngine
from hiradix.memory.pools import DeviceKVPool, HostKVPool, MLAShape
from hiradix.sim import Replayer
from hiradix.sim.generators import ChatWorkload

SHAPE = MLAShape(2, 3, 1)


def pools(device_tokens: int = 64, host_tokens: int = 128, page_size: int = 4) -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(SHAPE, size=device_tokens, page_size=page_size, dtype=torch.float32)
    host = HostKVPool(SHAPE, host_tokens, page_size, torch.float32, "page_first", reserve_bytes=0)
    return dev, host


# ------------------------------------------------------------------ the inline copy engine
def test_inline_engine_copies_on_the_callers_thread_before_returning() -> None:
    dev, host = pools()
    dev.kv_buffer(1)[4:8] = 7.0
    threads = threading.active_count()
    seen: list[tuple[str, int, int, str]] = []

    def hook(kind: str, op_id: int, layer: int) -> None:
        seen.append((kind, op_id, layer, threading.current_thread().name))

    with ThreadCopyEngine(inline=True, layer_hook=hook) as engine:
        assert threading.active_count() == threads  # no worker thread
        backup = engine.backup(dev, host, [4, 5, 6, 7], [0, 1, 2, 3])
        assert backup.done() and backup.error is None
        dev.kv_buffer(1).zero_()
        load = engine.load(host, dev, [0, 1, 2, 3], [8, 9, 10, 11])
        assert load.done()
        load.wait_until(1)
        load.wait()
    assert dev.kv_buffer(1)[8:12].sum().item() == 4 * 4 * 7.0  # 4 slots x (rank 3 + rope 1)
    me = threading.current_thread().name
    assert seen == [("backup", 0, 0, me), ("backup", 0, 1, me), ("load", 1, 0, me), ("load", 1, 1, me)]


def test_inline_engine_failure_goes_to_the_handle_and_the_next_operation_runs() -> None:
    """Same handle semantics as the threaded engine: the submitting call returns, the
    handle carries the error, ``wait`` raises ``CopyError``, layers before it stay good."""
    dev, host = pools()

    def hook(kind: str, op_id: int, layer: int) -> None:
        if op_id == 0 and layer == 1:
            raise OSError("injected")

    with ThreadCopyEngine(inline=True, layer_hook=hook) as engine:
        failed = engine.load(host, dev, [0, 1], [4, 5])
        assert failed.done() and isinstance(failed.error, OSError)
        failed.wait_until(0)  # layer 0 landed before the failure
        with pytest.raises(CopyError, match="injected"):
            failed.wait_until(1)
        with pytest.raises(CopyError):
            failed.wait()
        after = engine.backup(dev, host, [4, 5], [0, 1])
        assert after.done() and after.error is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.backup(dev, host, [4, 5], [0, 1])
    engine.close()  # idempotent


def test_inline_engine_lets_keyboard_interrupt_through() -> None:
    """Only ``Exception`` is handed to the handle; an interrupt still stops the caller,
    and the engine goes on with the next operation."""
    dev, host = pools()
    interrupt = [True]

    def hook(kind: str, op_id: int, layer: int) -> None:
        if interrupt.pop(0) if interrupt else False:
            raise KeyboardInterrupt

    with ThreadCopyEngine(inline=True, layer_hook=hook) as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.backup(dev, host, [4], [0])
        assert engine.backup(dev, host, [4], [0]).error is None


def test_controller_inline_copies_owns_inline_engines() -> None:
    dev, host = pools()
    controller = HiCacheController(dev, host, inline_copies=True)
    engines = (controller.write_engine, controller.load_engine)
    assert all(isinstance(e, ThreadCopyEngine) and e.inline for e in engines)
    controller.write([4, 5], [0, 1])
    ack = controller.start_writing()
    assert ack is not None and ack.done() and ack.ok
    controller.close()
    for engine in engines:
        with pytest.raises(RuntimeError, match="closed"):
            engine.backup(dev, host, [4], [0])


def test_controller_inline_copies_refuses_a_cuda_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    dev, host = pools()
    monkeypatch.setattr(dev, "device", torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU device pools only"):
        HiCacheController(dev, host, inline_copies=True)


# ------------------------------------------------------------------ cache observers
class Recorder(CacheObserver):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_backup_started(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        self.events.append(("backup_started", node, device_indices.tolist(), host_indices.tolist()))

    def on_backup_finished(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor, ok: bool) -> None:
        self.events.append(("backup_finished", node, device_indices.tolist(), host_indices.tolist(), ok))

    def on_load_started(self, node: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self.events.append(("load_started", node, host_indices.tolist(), device_indices.tolist()))

    def on_load_finished(self, node: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self.events.append(("load_finished", node, host_indices.tolist(), device_indices.tolist()))

    def on_device_freed(self, indices: torch.Tensor, evicted: bool) -> None:
        self.events.append(("device_freed", sorted(indices.tolist()), evicted))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


def inline_cache(tree_cls: Any, device_tokens: int = 16, host_tokens: int = 64, **kwargs: Any) -> HiRadixCache:
    dev, host = pools(device_tokens, host_tokens)
    controller = HiCacheController(dev, host, inline_copies=True)
    tree = TreeOptions(tree_cls=tree_cls)
    return HiRadixCache(dev, host, tree=tree, tiers=TierOptions(load_back_threshold=0), controller=controller, **kwargs)


def serve(cache: HiRadixCache, tokens: list[int]) -> Any:
    key = np.asarray(tokens, dtype=np.int32)
    m = cache.match_prefix(key)
    loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
    cache.inc_lock_ref(node)
    prefix = torch.cat((m.device_indices, loaded))
    new = cache.alloc_device(len(key) - len(prefix))
    assert new is not None
    cache.ready_to_load_host_cache()
    cache.cache_finished_req(Req(len(tokens), key, torch.cat((prefix, new)), prefix, node))
    cache.check_hicache_events()
    return m


def test_observer_sees_backups_evictions_and_loads_with_their_slots(tree_cls: Any) -> None:
    """A write-through backup, the eviction that demotes it (evicted=True) and the load
    back, each with the slots the cache used; a request's duplicate slots are freed with
    evicted=False. Removing the observer stops the events."""
    cache = inline_cache(tree_cls)
    rec = Recorder()
    cache.add_observer(rec)
    with cache:
        serve(cache, [1, 2, 3, 4, 5, 6, 7, 8])
        started, finished = rec.events
        assert started[0] == "backup_started" and finished[:4] == ("backup_finished", *started[1:])
        assert finished[4] is True and len(started[2]) == 8
        first_slots = sorted(started[2])
        rec.events.clear()
        serve(cache, [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])  # 12 more: 4 must go
        freed = [e for e in rec.events if e[0] == "device_freed"]
        assert freed and all(e[2] is True for e in freed)  # evictions only
        assert {s for e in freed for s in e[1]} <= set(first_slots)
        rec.events.clear()
        m = serve(cache, [1, 2, 3, 4, 5, 6, 7, 8])
        assert m.host_hit_length > 0
        loads = [e for e in rec.events if e[0].startswith("load")]
        assert [e[0] for e in loads] == ["load_started", "load_finished"]
        assert loads[0][1:] == loads[1][1:] and len(loads[0][3]) == m.host_hit_length
        # the prompt was fully matched: the request's (empty) new part is all it frees
        assert not [e for e in rec.events if e[0] == "device_freed" and e[2] is False and e[1]]
        rec.events.clear()
        key = np.asarray([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
        duplicate = cache.alloc_device(8)  # the same prompt computed again: duplicate KV
        assert duplicate is not None
        cache.cache_finished_req(Req("dup", key, duplicate))
        assert ("device_freed", sorted(duplicate.tolist()), False) in rec.events
        cache.remove_observer(rec)
        rec.events.clear()
        serve(cache, [21, 22, 23, 24])
        assert rec.events == []
    with pytest.raises(ValueError):
        cache.remove_observer(rec)


def test_observer_sees_failed_backups_as_not_ok(tree_cls: Any) -> None:
    """A copy that fails is acknowledged with ok=False (its host slots freed)."""
    dev, host = pools(16, 64)

    def hook(kind: str, op_id: int, layer: int) -> None:
        if kind == "backup":
            raise OSError("injected")

    controller = HiCacheController(dev, host, inline_copies=True, layer_hook=hook)
    rec = Recorder()
    with HiRadixCache(dev, host, tree=TreeOptions(tree_cls=tree_cls), controller=controller) as cache:
        cache.add_observer(rec)
        serve(cache, [1, 2, 3, 4])
        finished = [e for e in rec.events if e[0] == "backup_finished"]
        assert len(finished) == 1 and finished[0][4] is False
        assert cache.stats["backup_failed_tokens"] == 4


def test_add_observer_takes_only_observers() -> None:
    cache = inline_cache(None)
    with cache, pytest.raises(TypeError, match="CacheObserver"):
        cache.add_observer(lambda *a: None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ what the replayer counts
@pytest.mark.parametrize(
    ("options", "demoted", "deleted"),
    [
        ({"host_tokens": 40_000}, True, False),  # write_through: every evicted node has a host copy
        ({"host_tokens": 0}, False, True),  # no host tier: every eviction loses the KV
        ({"host_tokens": 40_000, "write_policy": "write_through_selective"}, True, True),
    ],
)
def test_replayer_eviction_split_adds_up_to_the_caches_evictions(
    tree_cls: Any, options: dict[str, Any], demoted: bool, deleted: bool
) -> None:
    with Replayer(tree_cls, device_tokens=20_000, **options) as r:
        stats = r.replay(ChatWorkload(requests=150, seed=4))
        evicted = r.cache.stats["device_evicted_tokens"]
    assert stats.device_demoted_tokens + stats.device_deleted_tokens == evicted > 0
    assert (stats.device_demoted_tokens > 0, stats.device_deleted_tokens > 0) == (demoted, deleted)
    assert (stats.backup_nodes > 0) == (options["host_tokens"] > 0)
