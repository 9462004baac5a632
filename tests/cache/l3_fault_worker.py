"""One rank of the two-rank L3 fault test (run in a spawned process by test_l3_guards):
rank 1's backend raises in ``batch_set``, ``batch_exists`` and ``batch_get``, each for one
sequence, where a dead L3 thread would leave rank 0 waiting in its MIN agreement."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch

import hiradix
from hiradix.cache import HiRadixCache, StorageOptions, TierOptions
from hiradix.cache.distributed import TorchDistAgreement
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape
from hiradix.storage import Capabilities, MemoryStorage
from tests.support.kvdata import fill, prefix_seeds
from tests.support.scheduler_loop import prefetch_back, tree_fingerprint

PAGE = 16


class KeyedFaultStorage(MemoryStorage):
    """A generic backend (``batch_get`` / ``batch_set``) whose public calls raise for a
    batch holding any of the keys in ``fail[call]``, bypassing the base class's own
    error handling."""

    capabilities = Capabilities(supports_v1=False)

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[str, frozenset[str]] = {}

    def _check(self, call: str, keys: Sequence[str]) -> None:
        if not self.fail.get(call, frozenset()).isdisjoint(keys):
            raise RuntimeError(f"{call} exploded")

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        self._check("exists", keys)
        return super().batch_exists(keys, extra_info)

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[Any] | None = None) -> list[Any]:
        self._check("get", keys)
        return super().batch_get(keys, target_locations)

    def batch_set(self, keys: Sequence[str], values: Sequence[Any]) -> bool:
        self._check("set", keys)
        return super().batch_set(keys, values)


def rank_main(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=config["collective_timeout_s"])
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timeout)
    prefetch_group = torch.distributed.new_group(backend="gloo", timeout=timeout)
    shape = MHAShape(2, 2, 4)
    dev = DeviceKVPool(shape, size=1024, page_size=PAGE, dtype=torch.float32)
    host = HostKVPool(shape, 1024, PAGE, torch.float32, "page_first", reserve_bytes=0)
    storage = KeyedFaultStorage()
    rng = np.random.default_rng(11)
    seqs = [rng.integers(0, 9999, 160) for _ in range(4)]
    keys = [[str(h) for h in hiradix.page_hashes(s, PAGE)] for s in seqs]
    if rank == 1:  # sequence 0 never reaches L3, 1 cannot be looked up, 2 cannot be read
        storage.fail = {"set": frozenset(keys[0]), "exists": frozenset(keys[1]), "get": frozenset(keys[2])}
    cache = HiRadixCache(
        dev,
        host,
        tiers=TierOptions(load_back_threshold=0),
        storage=StorageOptions(
            backend=storage,
            prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=32, batch_pages=2),
            prefetch_agreement=TorchDistAgreement(prefetch_group),
        ),
        agreement=TorchDistAgreement(),
    )
    with cache:
        for s in seqs:
            slots = cache.alloc_device(len(s))
            assert slots is not None
            fill(dev, slots, prefix_seeds(s))
            cache.insert(s, slots)
        cache.flush()
        while cache.storage.ongoing_backup:
            assert cache.storage.ongoing_backup[-1].done.wait(30), "a backup never reached done"
            cache.check_hicache_events()
        loaded = prefetch_back(cache, seqs)
        assert cache.storage.l3 is not None
        l3_stats = dict(cache.storage.l3.stats)
        fingerprint = json.dumps(tree_fingerprint(cache))
    result = {
        "rank": rank,
        "fingerprint": hashlib.sha256(fingerprint.encode()).hexdigest(),
        "loaded": loaded,
        "l3": l3_stats,
        "pending": len(cache.storage.ongoing_prefetch),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
