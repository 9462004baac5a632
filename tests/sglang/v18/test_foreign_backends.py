"""SGLang's own storage backends under hiradix.sglang's cache (issue 12, part 2).

The backend is built by SGLang's ``StorageBackendFactory`` exactly as stock SGLang builds it
(``sglang:file`` is SGLang's ``HiCacheFile``), wrapped by :mod:`hiradix.sglang.foreign`, and
driven by hiradix's L3 pipeline. End to end on CPU: a hiradix.sglang node and a stock
SGLang node on one ``HiCacheFile`` directory read each other's pages, bytes equal, both
ways, MHA and MLA, ``layer_first`` and ``page_first``; SGLang backends attach, clear and
detach at runtime through the admin calls; ``dynamic`` takes SGLang ``HiCacheStorage``
classes; a failing SGLang backend gives misses, never an exception into the scheduler.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage
from sglang.srt.mem_cache.utils import get_hash_str

from hiradix.memory.pools import HostKVPool, MHAShape
from hiradix.sglang.foreign import SGLangBackend, SGLangHostPoolView, is_sglang_backend
from hiradix.storage import FileStorage, StorageConfig
from tests.sglang.v18.l3_roundtrip import MODEL, PAGE, N, radix_key, read, tokens_of, write

pytestmark = pytest.mark.slow  # stock SGLang's storage backends, built per case

SHAPES = [(mla, layout) for mla in (False, True) for layout in ("layer_first", "page_first")]
SHAPE_IDS = [f"{'mla' if mla else 'mha'}-{layout}" for mla, layout in SHAPES]


@pytest.fixture
def hicache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory SGLang's HiCacheFile uses (its environment variable, as operators set it)."""
    d = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(d))
    return d


def flags(impl: str, fmt: str = "sglang") -> dict[str, Any]:
    """One SGLang ``file`` L3 for both kinds of node: stock SGLang names it ``file``;
    hiradix.sglang, whose ``file`` is its own backend, names SGLang's ``sglang:file``."""
    extra = {"prefetch_threshold": PAGE, "l3_format": fmt}
    return {"storage": "sglang:file" if impl == "hiradix" else "file", "extra_config": json.dumps(extra)}


@pytest.mark.parametrize(("mla", "layout"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("writer_impl", ["hiradix", "sglang"])
def test_hiradix_on_sglangs_file_backend_reads_stock_sglangs_pages_and_back(
    make_env, make_sglang, hicache_dir: Path, mla: bool, layout: str, writer_impl: str
) -> None:
    reader_impl = "sglang" if writer_impl == "hiradix" else "hiradix"
    builders = {"hiradix": make_env, "sglang": make_sglang}
    opts = {"layout": layout, "mla": mla, "model": MODEL, "prefetch_policy": "wait_complete"}
    writer = builders[writer_impl](PAGE, **opts, **flags(writer_impl))
    if writer_impl == "hiradix":
        backend = writer.cache.core.storage.l3.backend
        assert isinstance(backend, SGLangBackend) and isinstance(backend.inner, HiCacheFile)
    write(writer, tokens_of(11))
    assert len(list(hicache_dir.glob("*.bin"))) == N // PAGE, "SGLang's HiCacheFile holds one file per page"
    reader = builders[reader_impl](PAGE, **opts, **flags(reader_impl))
    read(reader, tokens_of(11))


def test_hiradix_keys_on_a_sglang_backend_round_trip_and_stay_apart_from_stock_sglang(
    make_env, make_sglang, hicache_dir: Path
) -> None:
    """hiradix's default (namespaced) keys work on a SGLang backend too; a stock SGLang
    node, whose keys are SGLang's, does not see those pages."""
    writer = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags("hiradix", "hiradix"))
    write(writer, tokens_of(12))
    reader = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags("hiradix", "hiradix"))
    read(reader, tokens_of(12))
    stock = make_sglang(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags("sglang"))
    assert stock.cache.query_storage_hit_length(stock.cache.root_node, array("q", tokens_of(12))) == 0


def test_sglang_backends_attach_clear_and_detach_at_runtime(make_env, make_sglang, hicache_dir: Path) -> None:
    env = make_env(
        PAGE,
        model=MODEL,
        prefetch_policy="wait_complete",
        storage="memory",
        extra_config=json.dumps({"prefetch_threshold": PAGE, "l3_format": "sglang"}),
    )
    cache = env.cache
    ok, msg = cache.attach_storage_backend("sglang:file", json.dumps({"l3_format": "sglang"}))
    assert not ok and "is attached" in msg
    assert cache.detach_storage_backend()[0]
    ok, msg = cache.attach_storage_backend(
        "sglang:file", json.dumps({"prefetch_threshold": PAGE, "l3_format": "sglang"}), MODEL, "wait_complete"
    )
    assert ok, msg
    assert cache.cache_controller.storage_backend_type == "sglang:file"
    write(env, tokens_of(13))
    # A stock SGLang node on the same directory reads what the runtime-attached backend wrote.
    stock = make_sglang(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags("sglang"))
    read(stock, tokens_of(13))
    root = cache.match_prefix(MatchPrefixParams(key=radix_key(tokens_of(13), None))).last_host_node
    assert cache.query_storage_hit_length(root, array("q", tokens_of(13))) == N
    assert cache.clear_storage_backend()
    assert cache.query_storage_hit_length(root, array("q", tokens_of(13))) == 0
    ok, msg = cache.detach_storage_backend()
    assert ok, msg
    assert not cache.enable_storage and cache.cache_controller.storage_backend_type is None


def test_a_backend_attached_to_a_cache_started_without_one_keys_what_it_holds_by_sglangs_chain(
    make_env, make_sglang, hicache_dir: Path
) -> None:
    """Stock SGLang accepts an L3 attached at runtime to a cache started without one; so
    does hiradix: the tree, built without page hashes (as SGLang's, they cost only with an
    L3), hashes what it holds when the backend attaches, by SGLang's own chain, and the
    pages go to L3 under those keys."""
    env = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", extra_config=json.dumps({"l3_format": "sglang"}))
    cache = env.cache
    assert not cache.enable_storage and not cache.core.tree.enable_hash
    held = tokens_of(15)
    slots = env.allocator.alloc(N)
    env.write_kv(slots, torch.tensor(held), torch.arange(N))
    cache.insert(InsertParams(key=radix_key(held, None), value=slots))
    ok, msg = cache.attach_storage_backend(
        "sglang:file", json.dumps({"prefetch_threshold": PAGE, "l3_format": "sglang"}), MODEL, "wait_complete"
    )
    assert ok, msg
    node = cache.match_prefix(MatchPrefixParams(key=radix_key(held, None))).last_device_node
    chain, prior = [], None
    for start in range(0, N, PAGE):
        prior = get_hash_str(held[start : start + PAGE], prior)
        chain.append(prior)
    assert cache.core.storage.prefix_hashes(node.id) == chain
    cache.core.tree.check_invariants()
    # The held pages' backup (started at the step, after the attach) goes on to L3 under
    # those keys, where stock SGLang reads them.
    cache.core.flush()
    cache.check_hicache_events()
    assert all(op.done.wait(60) for op in list(cache.core.storage.ongoing_backup))
    cache.check_hicache_events()
    assert cache.core.storage.l3.stats["backup_pages"] == N // PAGE
    read(make_sglang(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags("sglang")), held)


def test_dynamic_takes_sglang_storage_classes(make_env, make_sglang, hicache_dir: Path) -> None:
    """``dynamic`` with a SGLang ``HiCacheStorage`` class (SGLang's HiCacheFile, loaded by
    module path) runs it through the adapter; stock SGLang loads the same class."""
    loader = {
        "backend_name": "files",
        "module_path": "sglang.srt.mem_cache.hicache_storage",
        "class_name": "HiCacheFile",
        "prefetch_threshold": PAGE,
        "l3_format": "sglang",
    }
    writer = make_env(
        PAGE, model=MODEL, prefetch_policy="wait_complete", storage="dynamic", extra_config=json.dumps(loader)
    )
    backend = writer.cache.core.storage.l3.backend
    assert isinstance(backend, SGLangBackend) and backend.label == "files" and isinstance(backend.inner, HiCacheFile)
    write(writer, tokens_of(14))
    reader = make_sglang(
        PAGE, model=MODEL, prefetch_policy="wait_complete", storage="dynamic", extra_config=json.dumps(loader)
    )
    read(reader, tokens_of(14))


def test_names_resolve_to_hiradix_first_then_sglang(make_env, hicache_dir: Path) -> None:
    assert not is_sglang_backend("file", {}) and not is_sglang_backend("memory", {})
    assert is_sglang_backend("sglang:file", {}) and is_sglang_backend("sglang:mooncake", {})
    assert is_sglang_backend("hf3fs", {}) and is_sglang_backend("nixl", {}) and is_sglang_backend("shm", {})
    assert not is_sglang_backend("dynamic", {"module_path": "hiradix.storage", "class_name": "MemoryStorage"})
    assert is_sglang_backend("dynamic", {"module_path": "hiradix.sglang.storage", "class_name": "MemoryStorage"})
    with pytest.raises(ValueError, match="neither a hiradix StorageBackend nor a SGLang HiCacheStorage"):
        is_sglang_backend("dynamic", {"module_path": "json", "class_name": "JSONDecoder"})
    env = make_env(PAGE, storage="file", extra_config=json.dumps({"path": str(hicache_dir / "own")}))
    assert isinstance(env.cache.core.storage.l3.backend, FileStorage)
    with pytest.raises(ValueError, match=r"SGLang has no storage backend 'nope'.*hiradix's: .*peer"):
        make_env(PAGE, storage="sglang:nope")


# ---------------------------------------------------------------------------- the adapter alone
class _Broken(HiCacheStorage):
    """A SGLang backend whose every call fails, as a dead remote store's client would."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise ConnectionError("store unreachable")

    get = batch_get = set = batch_set = exists = batch_exists = _fail


def _pool(layout: str = "page_first") -> HostKVPool:
    return HostKVPool(MHAShape(2, 2, 4), size=32, page_size=4, dtype=torch.float32, layout=layout)


def test_a_failing_sglang_backend_is_misses_and_false_never_an_exception() -> None:
    pool = _pool()
    inner = _Broken()
    b = SGLangBackend(inner, "broken", StorageConfig())
    b.register_mem_pool_host(pool)
    idx = torch.arange(0, 16, dtype=torch.int64)
    assert b.batch_exists(["a" * 64, "b" * 64]) == 0
    assert b.batch_get_v1(["a" * 64, "b" * 64], idx[:8]) == [False, False]
    assert b.batch_set_v1(["a" * 64], idx[:4]) == [False]
    assert b.batch_get(["a" * 64]) == [None]
    assert inner.calls >= 4 and b.get_stats().errors >= 4


class _Dict(HiCacheStorage):
    """A minimal SGLang backend that returns its own copies (not the targets) from batch_get
    and answers batch_set for the whole batch, as some SGLang clients do."""

    def __init__(self, refuse: str | None = None) -> None:
        self.pages: dict[str, torch.Tensor] = {}
        self.refuse = refuse

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        page = self.pages.get(key)
        return None if page is None else page.clone()

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        return [self.get(k) for k in keys]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if key == self.refuse:
            return False
        self.pages[key] = value.clone()
        return True

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values, strict=True)])

    def exists(self, key: str) -> bool:
        return key in self.pages


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_round_trip_through_a_backend_that_returns_copies(layout: str) -> None:
    pool = _pool(layout)
    gen = torch.Generator().manual_seed(7)
    for i in range(0, pool.size, pool.page_size):
        pool.set_page_bytes(i, torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8, generator=gen))
    want = [pool.get_page_bytes(i).clone() for i in range(0, 16, 4)]
    keys = [f"{i:064x}" for i in range(4)]
    inner = _Dict(refuse=keys[2])
    b = SGLangBackend(inner, "dict", StorageConfig())
    b.register_mem_pool_host(pool)
    assert inner.mem_pool_host.pool is pool and isinstance(inner.mem_pool_host, SGLangHostPoolView)
    idx = torch.arange(0, 16, dtype=torch.int64)
    assert b.batch_set_v1(keys, idx) == [True, True, False, True]  # per page, though SGLang answers per batch
    for i in range(0, pool.size, pool.page_size):
        pool.set_page_bytes(i, torch.zeros(pool.page_bytes, dtype=torch.uint8))
    dst = torch.arange(16, 32, dtype=torch.int64)
    assert b.batch_get_v1(keys, dst) == [True, True, False, True]
    for j in (0, 1, 3):
        assert torch.equal(pool.get_page_bytes(16 + 4 * j), want[j]), f"page {j} differs"
    assert b.batch_exists(keys) == 2


def test_the_host_pool_view_speaks_sglangs_page_names() -> None:
    pool = _pool("layer_first")
    view = SGLangHostPoolView(pool)
    page = torch.arange(pool.page_bytes // 4, dtype=torch.float32)
    view.set_from_flat_data_page(8, page)
    got = view.get_data_page(8)
    assert got.dtype == torch.float32 and torch.equal(got, page)
    got += 1  # a copy: the pool does not change
    assert torch.equal(view.get_data_page(8), page)
    assert view.get_dummy_flat_data_page().shape == page.shape
    assert view.get_size_per_token() == pool.page_bytes // pool.page_size == 2 * view.get_ksize_per_token()
    with pytest.raises(TypeError, match="HostKVPool"):
        SGLangHostPoolView(object())  # type: ignore[arg-type]
