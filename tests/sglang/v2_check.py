"""The per-pool (v2) storage calls of ``hiradix.sglang.storage`` on one of SGLang's real
host pools, shared by the SGLang 0.5.18 (``tests/sglang``) and 0.5.23 (``tests/sglang/v23``)
tests: a KV pool and a Mamba-style sidecar pool (the same host pool registered under a
second name, as SGLang's own draft-pool tests stage one) written, looked up under both hit
policies and read back into other slots, byte for byte."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def key(i: int) -> str:
    return hashlib.sha256(f"v2-page{i}".encode()).hexdigest()


def check_pool_pages_round_trip(storage: Any, pool: Any, *, mla: bool) -> None:
    """``storage``: a fresh hiradix.sglang.storage wrapper for model ``org/model``, TP rank
    0 of 1; ``pool``: SGLang's host pool, at least 8 pages, filled with distinct bytes."""
    # Imported here: the suite imports this module (doctests) where SGLang may be missing.
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    ps = int(pool.page_size)

    def slots(pages: list[int]) -> torch.Tensor:
        return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)

    def page(p: int) -> bytes:
        return pool.get_data_page(p * ps, flat=True).view(torch.uint8).numpy().tobytes()

    storage.register_mem_pool_host(pool)
    storage.register_mem_host_pool_v2(pool, PoolName.KV)
    storage.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    keys = [key(i) for i in range(4)]
    before = [page(p) for p in range(4)]
    written = storage.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=slots([0, 1, 2, 3]), keys=keys),
            # the sidecar holds the last two pages' state only (a Mamba/SWA window)
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=slots([2, 3]), keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
        ]
    )
    assert written == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}

    # SGLang's HiCacheFile names: the KV page under its key, the sidecar's under
    # "{key}.mamba"; Mamba state is TP-sharded, so its suffix keeps the TP rank even for MLA.
    kv_suffix = "_org-model" if mla else "_org-model_0_1"
    assert storage.backend.batch_exists([k + kv_suffix for k in keys]) == 4
    assert storage.backend.batch_exists([f"{k}.mamba_org-model_0_1" for k in keys[2:]]) == 2

    trailing = PoolTransfer(name=PoolName.MAMBA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = storage.batch_exists_v2(keys, [trailing])
    assert hit.kv_hit_pages == 4 and dict(hit.extra_pool_hit_pages) == {PoolName.KV: 4, PoolName.MAMBA: 4}
    if hasattr(hit, "restorable_prefix_pages"):  # SGLang 0.5.23: every restorable length
        assert hit.restorable_prefix_pages == [4]  # 3 pages would need page 1's state
    every = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    hit = storage.batch_exists_v2(keys, [every])
    assert hit.kv_hit_pages == 0 and dict(hit.extra_pool_hit_pages) == {PoolName.KV: 4}
    assert storage.batch_exists_v2([key(9), *keys], [trailing]).kv_hit_pages == 0

    read = storage.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=slots([4, 5, 6, 7]), keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=slots([7]), keys=keys[3:]),
        ]
    )
    assert read == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
    assert [page(p) for p in range(4, 8)] == before
    never = storage.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots([6]), keys=[key(9)])])
    assert never == {PoolName.MAMBA: [False]} and page(6) == before[2]
    # a transfer whose indices do not cover its keys: misses, the pool untouched
    short = storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=slots([4]), keys=keys[:2])])
    assert short == {PoolName.KV: [False, False]}
