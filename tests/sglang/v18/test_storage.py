"""hiradix's backends as SGLang storage backends (``hiradix.sglang.storage``), through SGLang
0.5.18's own interface: its host pools in every layout they build in on CPU, its dynamic
loader (``StorageBackendFactory``) and its ``StorageMetrics``; and hiradix's host pages in
SGLang's page order, byte for byte SGLang's flat host pages. (SGLang's own HiRadixCache on
these backends: ``test_sglang_l3_interop.py``.)"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang.v18 import env as sglang_env  # noqa: F401 - skips this module without a supported SGLang

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics

from hiradix.memory.pools import HostKVPool
from hiradix.peer.node import InProcessCluster
from hiradix.peer.store import PeerCacheStore
from hiradix.sglang import storage as hss
from hiradix.sglang.pools import device_pool_from_sglang
from hiradix.storage import MemoryStorage as InnerMemory

PAGE = 4
LAYOUTS = {
    False: ("layer_first", "page_first", "page_first_direct", "page_head"),
    True: ("layer_first", "page_first", "page_first_direct"),
}
CASES = [(mla, layout) for mla in (False, True) for layout in LAYOUTS[mla]]


@pytest.fixture(autouse=True)
def _small_host_pools_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang refuses any host pool unless 10 GiB beyond it are available (a production
    server's reserve); these pools are kilobytes, and a CI machine running the suite in
    parallel often has less free."""
    import sglang.srt.mem_cache.pool_host.base as phb

    monkeypatch.setattr(phb, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)


def sgl_config(
    extra: dict[str, Any] | None = None,
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    metrics: bool = False,
    model: str | None = "org/model",
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra,
    )


def host_pool(mla: bool, layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's own CPU host pool, filled with distinct bytes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mla:
            dev = MLATokenToKVPool(
                size=32,
                page_size=PAGE,
                dtype=dtype,
                kv_lora_rank=8,
                qk_rope_head_dim=4,
                layer_num=3,
                device="cpu",
                enable_memory_saver=False,
            )
            pool = MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
        else:
            dev = MHATokenToKVPool(
                size=32,
                page_size=PAGE,
                dtype=dtype,
                head_num=2,
                head_dim=4,
                layer_num=3,
                device="cpu",
                enable_memory_saver=False,
            )
            pool = MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
    flat = pool.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7)).to(dtype))
    return pool


def key(i: int) -> str:
    return hashlib.sha256(f"page{i}".encode()).hexdigest()


def slots(pages: list[int]) -> torch.Tensor:
    """Host indices as SGLang passes them: page_size slots per page."""
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    return pool.get_data_page(page * PAGE, flat=True).view(torch.uint8).numpy().tobytes()


class _Failing(InnerMemory):
    """A backend whose every read, write and lookup fails inside (a broken disk or network)."""

    def _fail(self, *args: Any) -> Any:
        raise OSError("injected backend failure")

    _get_into = _put = _exists = _size = _fail
    _get_many_into = _put_many = _exists_many = _fail


@pytest.fixture(params=["memory", "file", "peer"])
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    made: list[Any] = []
    clusters: list[InProcessCluster] = []

    def make(**cfg: Any) -> Any:
        if request.param == "memory":
            s = hss.MemoryStorage(sgl_config({}, **cfg), {})
        elif request.param == "file":
            s = hss.FileStorage(sgl_config({"path": str(tmp_path / f"l3-{len(made)}")}, **cfg), {})
        else:
            c = InProcessCluster(2, transport="fake", pool_size=1 << 20, read_timeout_s=2.0)
            clusters.append(c)
            s = hss.PeerStorage(sgl_config(None, **cfg), {}, backend=PeerCacheStore(node=c.nodes[0]))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    for c in clusters:
        c.close()


# ---------------------------------------------------------------------- contract
@pytest.mark.parametrize(("mla", "layout"), CASES)
def test_v1_pages_round_trip_into_other_slots(make_storage: Any, mla: bool, layout: str) -> None:
    pool = host_pool(mla, layout)
    s = make_storage(mla=mla)
    assert isinstance(s, HiCacheStorage)
    s.register_mem_pool_host(pool)
    src, dst = [1, 2, 3], [6, 5, 7]
    want = [page_bytes(pool, p) for p in src]
    assert all(w != page_bytes(pool, d) for w, d in zip(want, dst, strict=True))
    assert s.batch_set_v1([key(i) for i in range(3)], slots(src)) == [True] * 3
    assert s.batch_exists([key(0), key(1), key(2), key(9)]) == 3
    assert s.batch_get_v1([key(i) for i in range(3)], slots(dst)) == [True] * 3
    assert [page_bytes(pool, d) for d in dst] == want
    # The generic path reads the same bytes: SGLang's flat page.
    got = s.batch_get([key(1)], [pool.get_dummy_flat_data_page()])[0]
    assert got.view(torch.uint8).numpy().tobytes() == want[1]


@pytest.mark.parametrize(("mla", "layout"), [(False, "layer_first"), (True, "page_first")])
def test_generic_set_get_as_sglang_calls_them(make_storage: Any, mla: bool, layout: str) -> None:
    pool = host_pool(mla, layout)
    s = make_storage(mla=mla)
    s.register_mem_pool_host(pool)
    # SGLang's _generic_page_set / _generic_page_get, step by step.
    assert s.batch_set([key(0), key(1)], [pool.get_data_page(p * PAGE) for p in (1, 2)])
    assert s.set(key(2), pool.get_data_page(3 * PAGE))
    assert s.exists(key(2)) and not s.exists(key(3))
    data = s.batch_get([key(0), key(3), key(2)], [pool.get_dummy_flat_data_page() for _ in range(3)])
    assert data[1] is None
    pool.set_from_flat_data_page(5 * PAGE, data[0])
    assert page_bytes(pool, 5) == page_bytes(pool, 1)
    one = s.get(key(2))  # no target: a new tensor of the pool's dtype
    assert one is not None and one.dtype == pool.dtype
    assert one.view(torch.uint8).numpy().tobytes() == page_bytes(pool, 3)


def test_missing_keys_are_misses(make_storage: Any) -> None:
    pool = host_pool(False, "layer_first")
    s = make_storage()
    s.register_mem_pool_host(pool)
    before = page_bytes(pool, 4)
    assert s.batch_get_v1([key(40), key(41)], slots([4, 5])) == [False, False]
    assert page_bytes(pool, 4) == before  # a staged miss never touches the host pool
    assert s.batch_exists([key(40)]) == 0 and s.get(key(40)) is None
    assert s.batch_get([key(40)], [pool.get_dummy_flat_data_page()]) == [None]


def test_tp_ranks_of_mha_never_share_a_key_mla_ranks_do() -> None:
    pool = host_pool(False, "page_first")
    inner = InnerMemory()
    r0 = hss.MemoryStorage(sgl_config(tp_rank=0, tp_size=2), backend=inner)
    r1 = hss.MemoryStorage(sgl_config(tp_rank=1, tp_size=2), backend=inner)
    for s in (r0, r1):
        s.register_mem_pool_host(pool)
    assert r0.batch_set_v1([key(0)], slots([1])) == [True]
    assert r1.batch_exists([key(0)]) == 0 and r0.batch_exists([key(0)]) == 1
    m0 = hss.MemoryStorage(sgl_config(mla=True, tp_rank=0, tp_size=2), backend=inner)
    m1 = hss.MemoryStorage(sgl_config(mla=True, tp_rank=1, tp_size=2), backend=inner)
    assert m0.set(key(1), b"x" * 8) and m1.exists(key(1))
    assert r0.suffix == "_org-model_0_2" and m1.suffix == "_org-model"


@pytest.mark.parametrize(("mla", "layout"), [(False, "layer_first"), (True, "page_first")])
def test_a_failing_backend_is_a_miss(mla: bool, layout: str) -> None:
    pool = host_pool(mla, layout)
    before = [page_bytes(pool, p) for p in range(8)]
    s = hss.MemoryStorage(sgl_config(mla=mla), backend=_Failing())
    s.register_mem_pool_host(pool)
    assert s.batch_set_v1([key(0), key(1)], slots([1, 2])) == [False, False]
    assert not s.batch_set([key(0)], [pool.get_data_page(PAGE)]) and not s.set(key(0), b"abc")
    assert s.batch_exists([key(0), key(1)]) == 0 and not s.exists(key(0))
    assert s.batch_get_v1([key(0), key(1)], slots([5, 6])) == [False, False]
    assert s.batch_get([key(0)], [pool.get_dummy_flat_data_page()]) == [None] and s.get(key(0)) is None
    if not mla:  # staged layouts leave the host pool untouched on a miss
        assert [page_bytes(pool, p) for p in range(8)] == before
    assert s.backend.get_stats().errors > 0


def test_caller_bugs_raise() -> None:
    s = hss.MemoryStorage(sgl_config())
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        s.batch_get_v1([key(0)], slots([1]))
    with pytest.raises(TypeError, match="HostKVCache"):
        s.register_mem_pool_host(object())  # type: ignore[arg-type]
    s.register_mem_pool_host(host_pool(False, "layer_first"))
    with pytest.raises(ValueError, match="host indices"):
        s.batch_set_v1([key(0)], torch.arange(3))
    with pytest.raises(ValueError, match="page boundary"):
        s.batch_set_v1([key(0)], torch.tensor([1]))
    with pytest.raises(ValueError, match="model name too long"):
        hss.MemoryStorage(sgl_config(model="m" * 200))


def test_get_stats_is_sglangs_storage_metrics_drained_per_call() -> None:
    ticks = iter(float(i) for i in range(100))
    pool = host_pool(True, "page_first")
    s = hss.MemoryStorage(sgl_config(metrics=True, mla=True), clock=lambda: next(ticks))
    s.register_mem_pool_host(pool)
    assert s.batch_set_v1([key(0), key(1)], slots([1, 2])) == [True, True]
    assert s.batch_get_v1([key(0), key(1), key(2)], slots([5, 6, 7])) == [True, True, False]
    m = s.get_stats()
    assert isinstance(m, StorageMetrics)
    page = pool.get_dummy_flat_data_page().nbytes
    assert m.backup_pgs == [2] and m.prefetch_pgs == [2]
    assert m.backup_bandwidth == [2 * page / 1e9] and m.prefetch_bandwidth == [2 * page / 1e9]  # 1 s per call
    assert s.get_stats() == StorageMetrics()
    off = hss.MemoryStorage(sgl_config(metrics=False))
    off.set(key(0), b"abcd")
    assert off.get_stats() == StorageMetrics()


# ---------------------------------------------------------------------- SGLang's loader
@pytest.mark.parametrize("cls", ["MemoryStorage", "FileStorage", "PeerStorage"])
def test_sglang_dynamic_loader_builds_each(cls: str, tmp_path: Path) -> None:
    extra = {
        "backend_name": f"hiradix-{cls}",
        "module_path": "hiradix.sglang.storage",
        "class_name": cls,
        "interface_v1": 1,
    }
    extra.update(
        {
            "FileStorage": {"path": str(tmp_path)},
            "MemoryStorage": {"capacity_bytes": 1 << 20},
            "PeerStorage": {"inprocess_nodes": 1, "transport": "fake", "pool_size": 1 << 20},
        }[cls]
    )
    pool = host_pool(False, "page_first_direct")
    # As SGLang's --hicache-storage-backend-extra-config arrives: parsed JSON.
    s = StorageBackendFactory.create_backend("dynamic", sgl_config(json.loads(json.dumps(extra))), pool)
    try:
        assert type(s) is getattr(hss, cls)
        s.register_mem_pool_host(pool)
        assert s.batch_set_v1([key(0)], slots([2])) == [True]
        assert s.batch_get_v1([key(0)], slots([3])) == [True]
        assert page_bytes(pool, 3) == page_bytes(pool, 2)
        if cls == "MemoryStorage":
            assert s.backend.capacity_bytes == 1 << 20
    finally:
        s.close()


# ---------------------------------------------------------------------- one page format
def sglang_token_kv(pool: Any, mla: bool, layer: int, comp: int, page: int, t: int) -> torch.Tensor:
    """Token ``t`` of page ``page``, one layer and component, as SGLang's host pool holds it."""
    slot = page * PAGE + t
    buf = pool.kv_buffer if mla else pool.kv_buffer[comp]
    if pool.layout == "layer_first":
        return buf[layer, slot]
    if pool.layout == "page_first":
        return buf[slot, layer]
    return buf[page, layer, t]  # page_first_direct


@pytest.mark.parametrize(("mla", "layout"), [c for c in CASES if c[1] != "page_head"])
def test_hiradix_pages_in_sglang_order_are_sglangs_flat_pages(mla: bool, layout: str) -> None:
    """A hiradix host pool with ``page_order="sglang"`` (hiradix.sglang's ``l3_format``
    ``"sglang"``) reads SGLang's flat page (``get_data_page(flat=True)``) into the right
    layer, component, token and element, and hands out exactly SGLang's bytes."""
    sgl = host_pool(mla, layout, torch.float32)
    dev = device_pool_from_sglang(sgl.device_pool)
    ours = HostKVPool(
        dev.shape,
        8 * PAGE,
        PAGE,
        torch.float32,
        layout,
        page_order="sglang",  # type: ignore[arg-type]
        reserve_bytes=0,
    )
    native = HostKVPool(dev.shape, 8 * PAGE, PAGE, torch.float32, layout, reserve_bytes=0)  # type: ignore[arg-type]
    for page in range(8):
        flat = sgl.get_data_page(page * PAGE, flat=True)
        ours.set_page_bytes(page * PAGE, flat)
        native.set_page_bytes(page * PAGE, flat)
        for layer in range(dev.layer_num):
            for comp, view in enumerate(ours.get_page_layer_view(layer)):
                for t in range(PAGE):
                    assert torch.equal(view[page, t], sglang_token_kv(sgl, mla, layer, comp, page, t))
        assert ours.get_page_bytes(page * PAGE).numpy().tobytes() == page_bytes(sgl, page)
        # hiradix's own order is another one for MHA (K and V inside each layer), the same for MLA
        same = all(
            torch.equal(native.get_page_layer_view(0)[c][page], ours.get_page_layer_view(0)[c][page])
            for c in range(len(dev.shape.components))
        )
        assert same == mla


def test_the_wrapper_takes_one_extra_config_for_a_mixed_cluster() -> None:
    """``"l3_format": "sglang"`` is what a hiradix.sglang node of a mixed cluster sets; the
    wrapper accepts it (stock SGLang only has that format) and refuses any other."""
    s = hss.MemoryStorage(sgl_config({"l3_format": "sglang", "capacity_bytes": 1 << 20}))
    assert s.backend.capacity_bytes == 1 << 20 and "l3_format" not in s.backend.config.extra_config
    with pytest.raises(ValueError, match="stock SGLang stores SGLang's keys and pages"):
        hss.MemoryStorage(sgl_config({"l3_format": "hiradix"}))


@pytest.mark.parametrize(("mla", "layout"), [(False, "layer_first"), (True, "page_first"), (False, "page_head")])
def test_per_pool_v2_calls_on_sglangs_host_pool(make_storage: Any, mla: bool, layout: str) -> None:
    """SGLang's v2 calls (hybrid models' sidecar pools): tests/sglang/v2_check.py."""
    from tests.sglang.v2_check import check_pool_pages_round_trip

    check_pool_pages_round_trip(make_storage(mla=mla), host_pool(mla, layout), mla=mla)


@pytest.mark.parametrize(("class_name", "native"), [("MemoryStorage", "memory"), ("FileStorage", "file")])
def test_dynamic_naming_a_hiradix_class_runs_hiradix_backend_natively(
    make_env, tmp_path: Path, class_name: str, native: str
) -> None:
    """``--hicache-storage-backend dynamic`` (the form SGLang's parser accepts) with one of
    ``hiradix.sglang.storage``'s classes: hiradix's cache builds hiradix's own backend,
    not the SGLang-interface wrapper (which wants SGLang's host pool, and failed the
    server's start-up), and pages go through L3 into a second cache and back (file)."""
    from hiradix.storage.base import StorageBackend
    from tests.sglang.v18.l3_roundtrip import PAGE, read, tokens_of, write

    extra = json.dumps(
        {
            "backend_name": f"hiradix-{native}",
            "module_path": "hiradix.sglang.storage",
            "class_name": class_name,
            "interface_v1": 1,
            "path": str(tmp_path / "l3"),
            "prefetch_threshold": 0,
        }
    )
    env = make_env(PAGE, storage="dynamic", extra_config=extra)
    controller = env.cache.cache_controller
    assert controller.storage_backend_type == native
    assert isinstance(controller.storage_backend, StorageBackend)  # SGLang names it in metrics
    if native == "memory":
        return  # one process's memory: nothing for a second cache to read
    write(env, tokens_of(1))
    env.cache.shutdown()  # the file backend locks its directory: one cache at a time
    read(make_env(PAGE, storage="dynamic", extra_config=extra), tokens_of(1))


@pytest.mark.parametrize("ext", [".json", ".toml"])
def test_extra_config_from_a_file(tmp_path: Path, ext: str) -> None:
    """``--hicache-storage-backend-extra-config @path``, JSON or TOML (tomllib, or tomli on
    Python 3.10), as SGLang reads it; a file of another type is a clear error."""
    from hiradix.sglang.cache import parse_extra_config

    path = tmp_path / f"extra{ext}"
    path.write_text(
        '{"prefetch_threshold": 64, "l3_format": "hiradix"}'
        if ext == ".json"
        else 'prefetch_threshold = 64\nl3_format = "hiradix"\n'
    )
    assert parse_extra_config(f"@{path}") == {"prefetch_threshold": 64, "l3_format": "hiradix"}
    bad = tmp_path / "extra.ini"
    bad.write_text("x = 1")
    with pytest.raises(ValueError, match="unsupported config file type"):
        parse_extra_config(f"@{bad}")
