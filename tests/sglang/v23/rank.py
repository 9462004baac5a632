"""One rank of hiradix.sglang's multi-rank tests on SGLang 0.5.23 (spawned by
``test_sglang23_tp`` through ``support.run_ranks``): gloo on loopback, SGLang's cache
groups in ``CacheInitParams`` as 0.5.23's ``kv_cache_builder`` fills them, the cache built
by 0.5.23's ``create_tree_cache`` (:func:`sglang_unified_env.build_hiradix`) and driven by the
same seeded scheduler loop on every rank (``test_sglang23_scheduler_loop.Loop``: 0.5.23's
own request API, byte checks after every step), while ranks differ in what they see: host
capacity (``--hicache-ratio`` per rank), host allocations failing on one rank, L3 hits
cut short on another."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _init(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def cache_groups(rank: int, world: int, shape: str) -> dict[str, Any]:
    """``CacheInitParams``' group fields for ``shape``, as 0.5.23's ``kv_cache_builder``
    fills them (``tp_cache_group`` is the TP group of one DP rank, the attention-TP / CP
    groups partition it):

    ``"tp"``
        TP over every rank; no attention TP / CP split.
    ``"attn_tp_cp"``
        Four ranks: attention TP groups ``{0,1}``, ``{2,3}`` and attention CP groups
        ``{0,2}``, ``{1,3}`` inside one TP group of all four.
    ``"pp"``
        Every rank a pipeline stage of its own (``pp_cache_group``, ``pp_rank``,
        ``pp_size``): the first stage decides, the later ones take its decisions.
    ``"none"``
        No group at all (the control: every rank decides alone).

    ``new_group`` is collective: every rank builds every group, in the same order."""
    dist = torch.distributed
    if shape == "none":
        return {}
    if shape == "tp":
        return {"tp_cache_group": dist.group.WORLD}
    if shape == "pp":
        return {"pp_cache_group": dist.group.WORLD, "pp_rank": rank, "pp_size": world}
    if shape == "attn_tp_cp":
        if world != 4:
            raise ValueError(f"shape 'attn_tp_cp' needs 4 ranks, got {world}")
        tp_groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
        cp_groups = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
        return {
            "tp_cache_group": dist.group.WORLD,
            "attn_tp_cache_group": tp_groups[rank // 2],
            "attn_cp_cache_group": cp_groups[rank % 2],
            "attn_cp_rank": rank // 2,
            "attn_cp_size": 2,
        }
    raise ValueError(f"unknown shape {shape!r}")


class L3HitFaults:
    """This rank's L3 misses pages the others hit: the backend's ``batch_exists`` (the
    leading pages of a batch it holds) is cut to a random shorter count with probability
    ``rate`` per call. :attr:`cuts` counts the calls it shortened."""

    def __init__(self, backend: Any, seed: int, rate: float = 0.4) -> None:
        self.cuts = 0
        rng = np.random.default_rng(seed)
        real = backend.batch_exists

        def batch_exists(keys: Any, *args: Any, **kwargs: Any) -> int:
            got = int(real(keys, *args, **kwargs))
            if got and rng.random() < rate:
                self.cuts += 1
                return int(rng.integers(0, got))
            return got

        backend.batch_exists = batch_exists


def loop_main(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    """The scheduler loop on one rank; writes ``rank{rank}.json`` (tree fingerprint,
    loop stats, faults injected, agreement calls)."""
    _init(rank, world, rendezvous)
    from tests.sglang.unified_env import build_hiradix, patch_sglang_for_cpu
    from tests.sglang.v23.test_scheduler_loop import Loop
    from tests.support import HostAllocFaults
    from tests.support.scheduler_loop import tree_fingerprint

    groups = cache_groups(rank, world, config["shape"])
    storage = config["storage"]
    with patch_sglang_for_cpu():
        env = build_hiradix(
            config["page"],
            size=256,
            layout=config["layout"],
            write_policy=config["write_policy"],
            storage=storage,
            extra_config='{"prefetch_threshold": 4}' if storage else None,
            params=groups,
            hicache_ratio=config["host_ratio"][rank],
        )
        core = env.cache.core
        host_faults = HostAllocFaults(core.host_pool, seed=99 + rank) if rank == config["host_faults_rank"] else None
        l3_faults = None
        if storage and rank == config["l3_faults_rank"]:
            assert core.storage.l3 is not None
            l3_faults = L3HitFaults(core.storage.l3.backend, seed=7 + rank)
        loop = Loop(env, seed=config["seed"])
        for _ in range(config["steps"]):
            loop.step()
        loop.drain()
        fingerprint = tree_fingerprint(core, env.cache.namespace_roots())
        result = {
            "fingerprint": hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest(),
            "stats": loop.stats,
            "host_failures": host_faults.failures if host_faults else 0,
            "l3_cuts": l3_faults.cuts if l3_faults else 0,
            "host_size": core.host_pool.size,
            "calls": core.agreement.calls,
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
