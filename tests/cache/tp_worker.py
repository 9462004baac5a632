"""One rank of the multi-rank cache test (run in a spawned process by test_cache_tp)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import torch

import hiradix
from hiradix.cache import HiRadixCache, StorageOptions, TierOptions, TreeOptions
from hiradix.cache.distributed import LocalAgreement, RankAgreement, TorchDistAgreement
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape
from hiradix.storage import MemoryStorage
from tests.support.kvdata import fill, prefix_seeds
from tests.support.scheduler_loop import prefetch_back, run_loop, tree_fingerprint


class FaultyHostPool(HostKVPool):
    """Host pool whose allocations fail at random on this rank only."""

    fail_rate = 0.0
    rng: np.random.Generator | None = None
    failures = 0

    def alloc_array(self, n_tokens: int) -> np.ndarray | None:
        if self.rng is not None and self.rng.random() < self.fail_rate:
            self.failures += 1
            return None
        return super().alloc_array(n_tokens)


def rank_main(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    """Run the scheduler loop on one rank and write what the test compares to a JSON file."""
    torch.set_num_threads(1)
    agreement: RankAgreement
    if config["agree"]:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group(
            "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        agreement = TorchDistAgreement()
    else:
        agreement = LocalAgreement()
    page = config["page"]
    shape = MHAShape(2, 2, 4)
    dev = DeviceKVPool(shape, size=config["device"], page_size=page, dtype=torch.float32)
    host = FaultyHostPool(shape, config["host"], page, torch.float32, "page_first", reserve_bytes=0)
    if rank == config["faulty_rank"]:  # asymmetric faults: this rank's host allocations fail at times
        host.fail_rate = config["fail_rate"]
        host.rng = np.random.default_rng(1000 + rank)
    copy_faults = 0
    lock = threading.Lock()

    def hook(kind: str, op_id: int, layer: int) -> None:
        nonlocal copy_faults
        # the other rank's backups fail now and then: outcomes must be agreed too
        if rank != config["faulty_rank"] and kind == "backup" and layer == 0 and op_id % 7 == 3:
            with lock:
                copy_faults += 1
            raise OSError("injected backup failure")

    cache = HiRadixCache(
        dev,
        host,
        tree=TreeOptions(eviction_policy=config["policy"], write_policy=config["write_policy"]),
        tiers=TierOptions(load_back_threshold=page),
        agreement=agreement,
        layer_hook=hook,
    )
    with cache:
        stats = run_loop(cache, config["steps"], config["seed"])
        fingerprint = json.dumps(tree_fingerprint(cache))
    result = {
        "rank": rank,
        "fingerprint": hashlib.sha256(fingerprint.encode()).hexdigest(),
        "nodes": cache.tree.num_nodes(),
        "host_size": cache.tree.host_size(),
        "device_size": cache.tree.device_size(),
        "stats": stats.__dict__,
        "cache_stats": cache.stats,
        "host_alloc_faults": host.failures,
        "copy_faults": copy_faults,
        "agreement_calls": getattr(agreement, "calls", 0),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if config["agree"]:
        torch.distributed.destroy_process_group()


class PartialStorage(MemoryStorage):
    """A rank's L3 that lacks some pages the other rank has (evicted there, say)."""

    missing: frozenset[str] = frozenset()

    def _exists_many(self, keys: list[str]) -> int:
        n = super()._exists_many(keys)
        return next((i for i, k in enumerate(keys[:n]) if k in self.missing), n)


def l3_rank_main(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    """Prefetch from L3 on two ranks whose storage differs: the hit length is agreed by
    MIN on the prefetch thread's own process group, so both trees end up the same."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    prefetch_group = torch.distributed.new_group(backend="gloo")
    page = 16
    shape = MHAShape(2, 2, 4)
    dev = DeviceKVPool(shape, size=1024, page_size=page, dtype=torch.float32)
    host = HostKVPool(shape, 1024, page, torch.float32, "page_first", reserve_bytes=0)
    storage = PartialStorage()
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
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 9999, 160) for _ in range(4)]
    with cache:
        for s in seqs:
            slots = cache.alloc_device(len(s))
            assert slots is not None
            fill(dev, slots, prefix_seeds(s))
            cache.insert(s, slots)
        cache.flush()
        while cache.storage.ongoing_backup:
            cache.storage.ongoing_backup[-1].done.wait(30)
            cache.check_hicache_events()
        if rank == 1:  # this rank's L3 lost the tail of sequence 1 and all of sequence 3
            keys = [str(h) for h in hiradix.page_hashes(seqs[1], page)][5:]
            keys += [str(h) for h in hiradix.page_hashes(seqs[3], page)]
            storage.missing = frozenset(keys)
        loaded = prefetch_back(cache, seqs)
        fingerprint = json.dumps(tree_fingerprint(cache))
    result = {
        "rank": rank,
        "fingerprint": hashlib.sha256(fingerprint.encode()).hexdigest(),
        "loaded": loaded,
        "host_size": cache.tree.host_size(),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
