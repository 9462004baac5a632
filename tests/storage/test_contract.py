"""The storage contract: one mixin, run against every built-in backend (cachetools'
``CacheTestMixin``). A new backend is a one-line subclass naming it and its options;
its own specific tests live in ``test_storage_<name>.py``."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from hiradix.memory.pools import HOST_LAYOUTS, PAGE_ORDERS, HostKVPool, MHAShape, MLAShape
from hiradix.storage import StorageBackend, StorageConfig, create_backend

PAGE = 4096


def key(i: int, tag: str = "") -> str:
    """A full-width page key (what keys.page_keys produces)."""
    return hashlib.sha256(f"{tag}{i}".encode()).hexdigest()


def payload(i: int, n: int = PAGE, version: int = 0) -> bytes:
    """Deterministic page bytes that name their key and version: a wrong page is visible."""
    rng = np.random.default_rng([i, version])
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def make_pool(layout: str, mla: bool, page_size: int = 4, pages: int = 8, order: str = "hiradix") -> HostKVPool:
    shape = MLAShape(2, 8, 4) if mla else MHAShape(2, 2, 4)
    pool = HostKVPool(
        shape,
        pages * page_size,
        page_size,
        torch.float16,
        layout,
        page_order=order,  # type: ignore[arg-type]
        pin_memory=False,
        reserve_bytes=0,
    )
    g = torch.Generator().manual_seed(1)
    pool.backing_tensor.copy_(torch.randn(pool.backing_tensor.numel(), generator=g).to(torch.float16))
    return pool


class StorageContract:
    """Every backend must pass these. Subclasses set ``backend`` and ``options``."""

    backend: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    def make(self, tmp_path: Path, **extra: Any) -> StorageBackend:
        cfg = StorageConfig(extra_config={"path": str(tmp_path / "l3"), **self.options, **extra})
        return create_backend(self.backend, cfg)

    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        s = self.make(tmp_path)
        yield s
        s.close()

    # ------------------------------------------------------------------ exists
    def test_exists_is_longest_prefix(self, store: StorageBackend) -> None:
        assert store.batch_set([key(0), key(1), key(3)], [payload(0), payload(1), payload(3)])
        assert store.batch_exists([key(0), key(1), key(2), key(3)]) == 2
        assert store.batch_exists([key(2), key(3)]) == 0
        assert store.batch_exists([key(3)]) == 1
        assert store.batch_exists([]) == 0
        assert store.exists(key(1)) and not store.exists(key(2))

    # ------------------------------------------------------------------ generic get/set
    def test_round_trip_bytes_and_tensors(self, store: StorageBackend) -> None:
        t = torch.randn(PAGE // 2, generator=torch.Generator().manual_seed(0)).to(torch.float16)
        arr = np.arange(PAGE // 4, dtype=np.int32)
        values: list[Any] = [payload(0), bytearray(payload(1)), memoryview(payload(2)), t, arr]
        keys = [key(i) for i in range(len(values))]
        assert store.batch_set(keys, values)
        got = store.batch_get(keys)
        assert [bytes(g.numpy()) for g in got] == [
            payload(0),
            payload(1),
            payload(2),
            t.numpy().tobytes(),
            arr.tobytes(),
        ]
        assert got[0].dtype == torch.uint8

    def test_get_into_targets(self, store: StorageBackend) -> None:
        store.set(key(0), payload(0))
        target = torch.zeros(PAGE, dtype=torch.uint8)
        buf = bytearray(PAGE)
        res = store.batch_get([key(0), key(0), key(9)], [target, buf, bytearray(PAGE)])
        assert res[0] is target and res[1] is buf and res[2] is None
        assert bytes(target.numpy()) == payload(0) == bytes(buf)
        assert store.get(key(0), bytearray(PAGE - 1)) is None  # wrong length: a miss
        with pytest.raises(ValueError):
            store.get(key(0), b"read-only target")
        with pytest.raises(ValueError):
            store.batch_get([key(0)], [bytearray(PAGE), bytearray(PAGE)])

    def test_missing_keys(self, store: StorageBackend) -> None:
        assert store.batch_get([key(5), key(6)]) == [None, None]
        assert store.get(key(5)) is None
        st = store.get_stats()
        assert st.misses == 3 and st.hits == 0

    def test_overwrite(self, store: StorageBackend) -> None:
        store.set(key(0), payload(0, version=1))
        store.set(key(0), payload(0, n=PAGE * 2, version=2))
        assert bytes(store.get(key(0)).numpy()) == payload(0, n=PAGE * 2, version=2)
        st = store.get_stats()
        assert st.pages == 1 and PAGE * 2 <= st.bytes_used < PAGE * 2 + 512

    def test_bad_input_raises(self, store: StorageBackend) -> None:
        with pytest.raises(TypeError):
            store.batch_exists([1])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            store.batch_exists("abc")
        with pytest.raises(ValueError):
            store.batch_set([""], [b"x"])
        with pytest.raises(ValueError):
            store.batch_set([key(0)], [b"x", b"y"])
        with pytest.raises(TypeError):
            store.set(key(0), 12)

    def test_empty_page(self, store: StorageBackend) -> None:
        assert store.set(key(0), b"")
        got = store.get(key(0))
        assert got is not None and got.numel() == 0

    # ------------------------------------------------------------------ v1 into a host pool
    @pytest.mark.parametrize("order", PAGE_ORDERS)
    @pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
    @pytest.mark.parametrize("layout", HOST_LAYOUTS)
    def test_v1_round_trip(self, store: StorageBackend, layout: str, mla: bool, order: str) -> None:
        pool = make_pool(layout, mla, order=order)
        store.register_mem_pool_host(pool)
        ps = pool.page_size
        src = [0, 2 * ps, 5 * ps]
        expected = [pool.get_page_bytes(s).clone() for s in src]
        keys = [key(i, layout) for i in range(3)]
        assert store.batch_set_v1(keys, torch.tensor(src)) == [True, True, True]
        dst = [ps, 3 * ps, 7 * ps]  # other pages, first filled with junk
        for d in dst:
            pool.set_page_bytes(d, torch.full((pool.page_bytes,), 0xAB, dtype=torch.uint8))
        assert store.batch_get_v1(keys, np.array(dst)) == [True, True, True]
        for d, e in zip(dst, expected, strict=True):
            assert torch.equal(pool.get_page_bytes(d), e)
        # SGLang's form: page_size consecutive slots per key.
        slots = torch.cat([torch.arange(ps) + 4 * ps, torch.arange(ps) + 6 * ps])
        assert store.batch_get_v1(keys[:2], slots) == [True, True]
        assert torch.equal(pool.get_page_bytes(4 * ps), expected[0])
        assert torch.equal(pool.get_page_bytes(6 * ps), expected[1])

    @pytest.mark.parametrize("order", PAGE_ORDERS)
    def test_v1_pages_move_between_layouts_of_one_byte_order(self, store: StorageBackend, order: str) -> None:
        a, b = make_pool("layer_first", False, order=order), make_pool("page_first_direct", False, order=order)
        b.backing_tensor.zero_()
        store.register_mem_pool_host(a)
        assert store.batch_set_v1([key(0)], [4]) == [True]
        store.register_mem_pool_host(b)
        assert store.batch_get_v1([key(0)], [8]) == [True]
        assert torch.equal(b.get_page_bytes(8), a.get_page_bytes(4))

    def test_v1_misses_and_errors(self, store: StorageBackend) -> None:
        pool = make_pool("page_first", False)
        with pytest.raises(RuntimeError, match="register_mem_pool_host"):
            store.batch_get_v1([key(0)], [0])
        store.register_mem_pool_host(pool)
        assert store.batch_set_v1([key(0)], [0]) == [True]
        assert store.batch_get_v1([key(1), key(0)], [4, 8]) == [False, True]
        with pytest.raises(ValueError):
            store.batch_get_v1([key(0)], [1])  # not a page start
        with pytest.raises(ValueError):
            store.batch_get_v1([key(0), key(1)], [0, 4, 8])  # neither form
        with pytest.raises(ValueError):
            store.batch_get_v1([key(0)], [0, 1, 2, 5])  # a page's slots not consecutive
        with pytest.raises(TypeError):
            store.register_mem_pool_host(object())  # type: ignore[arg-type]
        store.set(key(2), b"short")  # stored, but not a page of this pool
        assert store.batch_get_v1([key(2)], [0]) == [False]

    # ------------------------------------------------------------------ management
    def test_clear(self, store: StorageBackend) -> None:
        store.batch_set([key(i) for i in range(5)], [payload(i) for i in range(5)])
        store.clear()
        assert store.batch_exists([key(0)]) == 0
        assert store.get_stats().pages == 0 and store.get_stats().bytes_used == 0
        assert store.set(key(1), payload(1)) and store.exists(key(1))

    def test_stats(self, store: StorageBackend) -> None:
        store.batch_set([key(0), key(1)], [payload(0), payload(1)])
        store.batch_get([key(0), key(2)])
        store.batch_exists([key(0), key(1), key(2)])
        st = store.get_stats()
        assert (st.pages, st.sets, st.hits, st.misses, st.exists_queries) == (2, 2, 1, 1, 3)
        assert st.backend == store.name and st.errors == 0 and st.corrupt == 0
        assert st.bytes_used >= 2 * PAGE
        assert store.capabilities.supports_v1

    def test_capacity_lru_eviction(self, tmp_path: Path) -> None:
        cap = int(3.5 * PAGE)
        s = self.make(tmp_path, capacity_bytes=cap)
        try:
            s.batch_set([key(0), key(1), key(2)], [payload(0), payload(1), payload(2)])
            assert s.get(key(0)) is not None  # 0 is now more recent than 1
            assert s.set(key(3), payload(3))
            assert [s.exists(key(i)) for i in range(4)] == [True, False, True, True]
            st = s.get_stats()
            assert st.evictions == 1 and st.bytes_used <= cap and st.capacity_bytes == cap
            assert not s.set(key(9), payload(9, n=cap + 1))  # can never fit: refused
            assert s.get_stats().set_failures == 1
            assert bytes(s.get(key(3)).numpy()) == payload(3)
        finally:
            s.close()

    def test_concurrent_threads(self, store: StorageBackend) -> None:
        # Every read must be a miss or exactly one of the versions written for that key.
        n_threads, n_keys, rounds = 4, 12, 30
        valid = {key(i): {payload(i, version=v) for v in range(n_threads)} for i in range(n_keys)}
        errors: list[BaseException] = []
        barrier = threading.Barrier(n_threads)

        def worker(t: int) -> None:
            try:
                barrier.wait()
                rng = np.random.default_rng(t)
                for _ in range(rounds):
                    idx = [int(i) for i in rng.integers(0, n_keys, 3)]
                    ks = [key(i) for i in idx]
                    store.batch_set(ks, [payload(i, version=t) for i in idx])
                    for k, got in zip(ks, store.batch_get(ks), strict=True):
                        assert got is None or bytes(got.numpy()) in valid[k]
                    store.batch_exists(ks)
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for k, got in zip(valid, store.batch_get(list(valid)), strict=True):
            assert got is None or bytes(got.numpy()) in valid[k]
        assert store.get_stats().errors == 0

    def test_backend_errors_are_misses(self, store: StorageBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        pool = make_pool("page_first", False)
        store.register_mem_pool_host(pool)
        assert store.batch_set([key(0)], [payload(0)])

        def boom(*args: Any) -> Any:
            raise OSError("injected backend failure")

        prims = (
            "_exists",
            "_exists_many",
            "_size",
            "_get_into",
            "_get_many_into",
            "_get_many_at",
            "_put",
            "_put_many",
            "_put_many_at",
        )
        for prim in prims:
            monkeypatch.setattr(store, prim, boom)
        assert store.batch_exists([key(0), key(1)]) == 0
        assert store.batch_get([key(0)]) == [None]
        assert store.get(key(0), bytearray(PAGE)) is None
        assert store.batch_set([key(1)], [payload(1)]) is False
        assert store.batch_set_v1([key(1)], [0]) == [False]
        assert store.batch_get_v1([key(0)], [0]) == [False]
        assert store.get_stats().errors == 6

    @pytest.mark.parametrize("bad", [1 << 62, -1, 2.5], ids=["huge", "negative", "float"])
    def test_an_impossible_size_is_that_keys_miss(
        self, store: StorageBackend, monkeypatch: pytest.MonkeyPatch, bad: Any
    ) -> None:
        """A backend naming a size no buffer can have for one key (a corrupt record): that
        key misses and counts one error; the batch's other keys are served."""
        keys = [key(i) for i in range(3)]
        assert store.batch_set(keys, [payload(i) for i in range(3)])
        real = store._size
        monkeypatch.setattr(store, "_size", lambda k: bad if k == keys[1] else real(k))
        got = store.batch_get(keys)
        assert got[1] is None
        assert [bytes(g.numpy()) for g in (got[0], got[2])] == [payload(0), payload(2)]
        assert store.get_stats().errors == 1


class TestMemory(StorageContract):
    backend = "memory"


class TestFile(StorageContract):
    backend = "file"


class TestFileLz4(StorageContract):
    backend, options = "file", {"compression": "lz4"}


class TestFileSmallSegmentsFsync(StorageContract):
    backend, options = "file", {"segment_bytes": 3 * PAGE, "fsync": True}
