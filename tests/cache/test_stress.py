"""A long randomized scheduler-like loop over HiRadixCache with real KV pools: match,
load back, allocate, insert, lock, evict and finish, with ``check_invariants()`` and
slot conservation after every step and every reused byte verified."""

from __future__ import annotations

import threading

import pytest
import torch

from hiradix.cache import HiRadixCache, TierOptions, TreeOptions
from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape, MLAShape
from tests.support import OPS
from tests.support.scheduler_loop import run_loop

pytestmark = pytest.mark.slow  # long randomized cache runs with faults

STEPS = 1500

CASES = [
    # (seed, page, policy, write policy, layout, device, host, shape, batch_backups)
    (1, 1, "lru", "write_through", "layer_first", 96, 192, "mha", False),
    (2, 4, "lfu", "write_through_selective", "page_first", 128, 256, "mha", False),
    (3, 16, "slru", "write_back", "page_first_direct", 512, 768, "mla", False),
    (4, 4, "sieve", "write_back", "layer_first", 96, 128, "mla", False),
    (5, 16, "priority", "write_through", "page_first", 384, 512, "mha", False),
    (6, 1, "fifo", "write_through_selective", "page_first_direct", 80, 320, "mla", False),
    # the backups of a step's inserts started together (as hiradix.sglang runs)
    (7, 4, "lru", "write_through", "page_first", 128, 256, "mha", True),
    (8, 1, "lfu", "write_through_selective", "layer_first", 96, 192, "mla", True),
]


@pytest.mark.parametrize(("seed", "page", "policy", "write", "layout", "device", "host", "shape", "batch"), CASES)
def test_scheduler_loop(
    seed: int, page: int, policy: str, write: str, layout: str, device: int, host: int, shape: str, batch: bool
) -> None:
    kv_shape = MHAShape(2, 2, 4) if shape == "mha" else MLAShape(2, 6, 2)
    dev = DeviceKVPool(kv_shape, size=device, page_size=page, dtype=torch.float16)
    hpool = HostKVPool(kv_shape, host, page, torch.float16, layout, reserve_bytes=0)
    fail = threading.Event()
    injected = {"backup": 0, "load": 0}

    def hook(kind: str, op_id: int, layer: int) -> None:
        # a copy failure now and then, on both directions
        if fail.is_set() and layer == 1 and op_id % 11 == 5:
            injected[kind] += 1
            raise OSError(f"injected {kind} failure")

    cache = HiRadixCache(
        dev,
        hpool,
        tree=TreeOptions(eviction_policy=policy, write_policy=write),
        tiers=TierOptions(load_back_threshold=page, batch_backups=batch),
        layer_hook=hook,
    )
    with cache:
        fail.set()
        stats = run_loop(cache, STEPS, seed)
        fail.clear()
        OPS["cache_loop_steps"] += stats.steps
        assert stats.invariant_checks == stats.steps == STEPS
        assert stats.finished == stats.admitted > 100
        assert stats.reused_tokens > 0 and stats.verified_tokens > 0
        # nothing leaks: every slot is free or cached, no lock or pending protection is left
        assert cache.protected_size() == 0 and cache.pending_protections() == (0, 0)
        assert cache.available_device_size() + cache.tree.device_size() == cache.device_allocator.size
        assert hpool.available_size() + cache.tree.host_size() == hpool.size
        cache.evict(10**9)
        cache.evict_host(10**9)
        assert cache.available_device_size() == cache.device_allocator.size
        assert hpool.available_size() == hpool.size
        cache.check_invariants()
    assert injected["backup"] > 0, "no backup fault was injected"
    assert stats.loaded_tokens > 0, "the loop never loaded anything back: pools too large"
    assert stats.forward_errors == injected["load"]
