"""hiradix.sglang.storage against SGLang 0.5.23's storage interface itself: the per-pool
(v2) calls its ``HybridCacheController`` makes for hybrid models' sidecar pools, on the
host pools 0.5.23's own ``init_hicache`` builds (every layout it builds on CPU), and its
``StorageMetrics``. (Its whole cache on these backends: ``test_sglang23_l3_interop.py``.)"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang.unified_env import build

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.observability.metrics_collector import StorageMetrics

from hiradix.peer.node import InProcessCluster
from hiradix.peer.store import PeerCacheStore
from hiradix.sglang import storage as hss

LAYOUTS = [(mla, layout) for mla in (False, True) for layout in ("layer_first", "page_first_direct")]


def sgl_config(extra: dict[str, Any] | None, *, mla: bool, metrics: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name="org/model",
        extra_config=extra,
    )


@pytest.fixture(params=["memory", "file", "peer"])
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    made: list[Any] = []
    clusters: list[InProcessCluster] = []

    def make(*, mla: bool, metrics: bool = False) -> Any:
        if request.param == "memory":
            s = hss.MemoryStorage(sgl_config({}, mla=mla, metrics=metrics), {})
        elif request.param == "file":
            s = hss.FileStorage(sgl_config({"path": str(tmp_path / f"l3-{len(made)}")}, mla=mla, metrics=metrics), {})
        else:
            c = InProcessCluster(2, transport="fake", pool_size=1 << 20, read_timeout_s=2.0)
            clusters.append(c)
            s = hss.PeerStorage(sgl_config(None, mla=mla, metrics=metrics), {}, backend=PeerCacheStore(node=c.nodes[0]))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    for c in clusters:
        c.close()


def host_pool(mla: bool, layout: str) -> Any:
    """The KV host pool SGLang 0.5.23's init_hicache builds, filled with distinct bytes."""
    pool = build(mla=mla, layout=layout).cache.cache_controller.storage_host_pool
    flat = pool.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7)).to(flat.dtype))
    return pool


@pytest.mark.parametrize(("mla", "layout"), LAYOUTS)
def test_per_pool_v2_calls_on_sglang23s_host_pool(sglang_cpu, make_storage: Any, mla: bool, layout: str) -> None:
    from tests.sglang.v2_check import check_pool_pages_round_trip

    check_pool_pages_round_trip(make_storage(mla=mla), host_pool(mla, layout), mla=mla)


def test_get_stats_is_sglang23s_storage_metrics(sglang_cpu, make_storage: Any) -> None:
    storage = make_storage(mla=False, metrics=True)
    pool = host_pool(False, "layer_first")
    storage.register_mem_pool_host(pool)
    ps = pool.page_size
    assert storage.batch_set_v1(["a" * 64, "b" * 64], torch.arange(2 * ps)) == [True, True]
    assert storage.batch_get_v1(["a" * 64], torch.arange(2 * ps, 3 * ps)) == [True]
    stats = storage.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [1]
    assert storage.get_stats().backup_pgs == []  # drained per call


def test_the_storage_module_and_the_cache_both_import_on_0_5_23() -> None:
    """hiradix.sglang.storage needs only SGLang's storage interface; the cache needs the
    request API, which on 0.5.23 is the ``checkpoint`` one (:mod:`hiradix.sglang.api`)."""
    import hiradix.sglang as hs
    from hiradix.sglang.api import REQUEST_API

    assert issubclass(hss.PeerStorage, hss.HiCacheStorage) and "0.5.23" in hss.TESTED_SGLANG_VERSIONS
    assert "0.5.23" in hs.SUPPORTED_VERSIONS and "0.5.23" in hs.TESTED_VERSIONS
    assert REQUEST_API == "checkpoint" and hs.HiRadixCache.__module__ == "hiradix.sglang.api_v23"
    with pytest.raises(AttributeError):
        _ = hs.no_such_name
