"""SGLang's own storage backends under hiradix's cache.

``--hicache-storage-backend NAME`` on a ``hiradix.sglang`` cache picks its L3 by name:

==================================  ===================================================
name                                backend
==================================  ===================================================
``memory``, ``file``, ``peer``,     hiradix's own (:mod:`hiradix.storage`), as before
``mooncake`` and every name in
hiradix's registry
``sglang:NAME``                     SGLang's backend ``NAME`` (``sglang:file`` is
                                    SGLang's ``HiCacheFile``, ``sglang:mooncake`` its
                                    ``MooncakeStore``), built by SGLang's
                                    ``StorageBackendFactory`` exactly as stock SGLang
                                    builds it
any other name (``hf3fs``, ``nixl``,  SGLang's backend of that name
``aibrix``, ``eic``, ``simm``,
``mori``, ``shm``, plugins)
``dynamic``                         the extra config's class: a hiradix
                                    ``StorageBackend`` runs as is, a SGLang
                                    ``HiCacheStorage`` through this adapter
==================================  ===================================================

The adapter, :class:`SGLangBackend`, is a hiradix :class:`~hiradix.storage.StorageBackend`
over a SGLang ``HiCacheStorage``, so hiradix's L3 pipeline (prefetch, backup, rank
agreement, the guards that turn failures into misses) drives it unchanged. Pages cross
through SGLang's page interface (``batch_get`` into given targets, ``batch_set`` of flat
pages), which every SGLang backend implements. hiradix's v1 path hands the adapter the
pool's own pages where they are contiguous (page-first layouts in the pool's page order),
so a backend that reads into its targets, as ``HiCacheFile`` does, fills the host pool with
no copy of ours; elsewhere pages go through a per-thread staging buffer, one memcpy each.
SGLang's zero-copy ``batch_get_v1`` / ``batch_set_v1`` of the backend is not called: it
takes host indices into SGLang's own host pool class, which hiradix does not have.

Keys and bytes: the backend appends its own key suffix (model, ranks), as under stock
SGLang, so the cache hands it bare page hashes. With ``"l3_format": "sglang"`` those
hashes and the page bytes are SGLang's, and a hiradix node and a stock SGLang node on one
SGLang backend read each other's pages; with hiradix's default format the keys are
hiradix's namespaced ones (the backend still works; stock SGLang nodes just miss them).

The backend's host pool (``register_mem_pool_host``, and the constructor argument of those
SGLang builds with one) is :class:`SGLangHostPoolView`: the names of SGLang's
``HostKVCache`` that the generic page path uses, over hiradix's pool.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hiradix.memory.pools import HostKVPool
from hiradix.storage.base import (
    Capabilities,
    StorageBackend,
    StorageConfig,
    StorageExtraInfo,
)
from hiradix.storage.registry import StorageConfigError, backend_names, import_class

__all__ = ["SGLANG_PREFIX", "SGLangBackend", "SGLangHostPoolView", "is_sglang_backend", "sglang_backend_names"]

logger = logging.getLogger(__name__)

#: The prefix that names SGLang's backend where hiradix has one of the same name.
SGLANG_PREFIX = "sglang:"


def sglang_backend_names() -> list[str]:
    """The names SGLang's ``StorageBackendFactory`` has registered (sorted). ``O(names)``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return sorted(StorageBackendFactory._registry)


def is_sglang_backend(name: str, extra: Mapping[str, Any]) -> bool:
    """Whether ``--hicache-storage-backend name`` (with its extra config) names one of
    SGLang's backends rather than hiradix's (table in the module docstring). A ``dynamic``
    class that is neither kind raises ``ValueError``. ``O(names)``."""
    if name.startswith(SGLANG_PREFIX):
        return True
    if name == "dynamic":
        cls = _dynamic_class(extra)
        return issubclass(cls, HiCacheStorage)
    return name not in backend_names() and name in sglang_backend_names()


def _dynamic_class(extra: Mapping[str, Any]) -> type:
    try:
        cls = import_class(extra.get("module_path"), extra.get("class_name"))  # type: ignore[arg-type]
    except StorageConfigError as e:
        raise ValueError(str(e)) from e
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend | HiCacheStorage)):
        raise ValueError(
            f"dynamic backend {extra.get('module_path')}.{extra.get('class_name')} is neither a hiradix "
            f"StorageBackend nor a SGLang HiCacheStorage"
        )
    return cls


class SGLangHostPoolView:
    """hiradix's host pool with the names a SGLang backend reads of SGLang's
    ``HostKVCache`` on the generic page path: ``page_size``, ``size``, ``dtype``,
    ``layout``, ``get_size_per_token``, ``get_ksize_per_token``,
    ``get_dummy_flat_data_page``, ``get_data_page`` and ``set_from_flat_data_page``.
    A flat data page is the pool's page bytes (:meth:`HostKVPool.get_page_bytes`, in
    its page order) viewed as the pool's dtype."""

    def __init__(self, pool: HostKVPool) -> None:
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"pool must be a HostKVPool, got {type(pool).__name__}")
        self.pool = pool
        self.page_size = pool.page_size
        self.size = pool.size
        self.dtype = pool.dtype
        self.layout = pool.layout
        self.is_mla = pool.is_mla
        self.page_num = pool.size // pool.page_size

    def get_size_per_token(self) -> int:
        """Bytes of one token's KV over every layer. ``O(1)``."""
        return self.pool.page_bytes // self.page_size

    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K (MHA) or latent (MLA) over every layer. ``O(1)``."""
        whole = self.get_size_per_token()
        return whole if self.is_mla else whole // 2

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed page-sized buffer of the pool's dtype. ``O(page)``."""
        return torch.zeros(self.pool.page_bytes // self.dtype.itemsize, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """A copy of the page starting at slot ``index``, flat, of the pool's dtype.
        ``O(page)``."""
        return self.pool.get_page_bytes(index).clone().view(self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (as :meth:`get_data_page` returns) at slot ``index``. ``O(page)``."""
        self.pool.set_page_bytes(index, data_page)


def _sglang_config(
    config: StorageConfig, extra: Mapping[str, Any], layout: str, cp: tuple[int, int]
) -> HiCacheStorageConfig:
    """SGLang's storage config with the ranks, model and extra config of ``config``."""
    return HiCacheStorageConfig(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        attn_cp_rank=cp[0],
        attn_cp_size=cp[1],
        is_mla_model=config.is_mla_model,
        enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first",
        model_name=config.model_name,
        extra_config=dict(extra),
    )


class SGLangBackend(StorageBackend):
    """A SGLang ``HiCacheStorage`` as a hiradix L3 backend (module docstring).

    Build it with :meth:`create`; the constructor takes a backend already built.
    Thread-safe as far as the wrapped backend is (SGLang's controller calls its backends
    from its prefetch and backup threads concurrently, as hiradix's L3 does).
    """

    name = "sglang"
    # v1 against hiradix's pool (module docstring); whether pages persist or are shared is
    # the SGLang backend's business, which its interface does not say.
    capabilities = Capabilities()

    def __init__(self, inner: HiCacheStorage, label: str, config: StorageConfig | None = None) -> None:
        super().__init__(config)
        if not isinstance(inner, HiCacheStorage):
            raise TypeError(f"inner must be a SGLang HiCacheStorage, got {type(inner).__name__}")
        self.inner = inner
        self.label = label
        self.name = f"sglang:{label}"  # type: ignore[misc]  # per instance: which SGLang backend
        self.view: SGLangHostPoolView | None = None
        self._page_bytes: int | None = None
        self._lock = threading.Lock()  # page size, learnt from the first page stored

    @classmethod
    def create(
        cls,
        name: str,
        config: StorageConfig,
        extra: Mapping[str, Any],
        host_pool: HostKVPool,
        *,
        cp: tuple[int, int] = (0, 1),
    ) -> SGLangBackend:
        """Build SGLang's backend ``name`` (``sglang:`` prefix optional; ``dynamic`` with a
        ``HiCacheStorage`` class in ``extra``) through SGLang's ``StorageBackendFactory``,
        on a view of ``host_pool``, with the ranks of ``config`` and the attention-CP
        ``(rank, size)`` ``cp``. ``ValueError`` naming the backend when it cannot be
        built. ``O(backend start-up)``."""
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        label = name.removeprefix(SGLANG_PREFIX)
        view = SGLangHostPoolView(host_pool)
        sg_config = _sglang_config(config, extra, host_pool.layout, cp)
        if label != "dynamic" and label not in sglang_backend_names():
            raise ValueError(
                f"SGLang has no storage backend {label!r}; SGLang's: {', '.join(sglang_backend_names())}; "
                f"hiradix's: {', '.join(backend_names())}"
            )
        try:
            inner = StorageBackendFactory.create_backend(label, sg_config, view)
            inner.register_mem_pool_host(view)
        except Exception as e:  # its import or start-up: a start-up error naming it
            raise ValueError(f"SGLang's storage backend {label!r} could not be built: {e!r}") from e
        if label == "dynamic":
            label = str(extra.get("backend_name") or extra.get("class_name"))
        backend = cls(inner, label, config)
        backend.view = view
        backend._page_bytes = host_pool.page_bytes
        logger.info(
            "hiradix: SGLang's storage backend %r (%s) under hiradix's L3 pipeline", label, type(inner).__qualname__
        )
        return backend

    # ------------------------------------------------------------------ pages as tensors
    def _typed(self, view: memoryview) -> torch.Tensor:
        # The backend's flat page: the bytes as the pool's dtype (SGLang hands its
        # backends typed pages; a page's byte length is a multiple of the itemsize).
        t = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
        return t.view(self.view.dtype) if self.view is not None else t

    @staticmethod
    def _info(extra_info: StorageExtraInfo | None) -> HiCacheStorageExtraInfo | None:
        if extra_info is None:
            return None
        prefix = list(extra_info.prefix_keys) if extra_info.prefix_keys is not None else None
        return HiCacheStorageExtraInfo(prefix_keys=prefix, extra_info=dict(extra_info.extra_info or {}) or None)

    # ------------------------------------------------------------------ primitives
    def _exists(self, key: str) -> bool:
        return bool(self.inner.exists(key))

    def _exists_many_with(self, keys: list[str], extra_info: StorageExtraInfo | None) -> int:
        # SGLang's batch_exists answers the longest stored prefix, with the prefix keys passed on.
        return int(self.inner.batch_exists(keys, self._info(extra_info)))

    def _exists_many(self, keys: list[str]) -> int:
        return self._exists_many_with(keys, None)

    def _size(self, key: str) -> int | None:
        # SGLang's interface has no size query: a stored page is a whole page of this pool.
        return self._page_bytes if self.inner.exists(key) else None

    def _get_into(self, key: str, out: memoryview) -> bool:
        return self._get_many_into([key], [out])[0]

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        targets = [self._typed(o) for o in outs]
        got = self.inner.batch_get(keys, targets)
        if not isinstance(got, list | tuple) or len(got) != len(keys):
            raise TypeError(f"{self.name}.batch_get returned {type(got).__name__}, not one entry per key")
        results = []
        for target, page in zip(targets, got, strict=True):
            if page is None:
                results.append(False)
                continue
            page = page if isinstance(page, torch.Tensor) else torch.as_tensor(page)
            if page.data_ptr() != target.data_ptr():  # the backend returned its own copy
                src = page.reshape(-1).view(torch.uint8)
                if src.numel() != target.numel() * target.element_size():
                    results.append(False)
                    continue
                target.view(torch.uint8).copy_(src)
            results.append(True)
        return results

    def _put(self, key: str, data: memoryview) -> bool:
        return self._put_many([key], [data])[0]

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        if self.inner.batch_set(keys, [self._typed(v) for v in views]):
            return [True] * len(keys)
        # SGLang's batch_set answers for the batch; ask which pages did land.
        return [bool(self.inner.exists(k)) for k in keys]

    def _clear(self) -> None:
        self.inner.clear()

    def _usage(self) -> tuple[int, int, int | None]:
        return 0, 0, None  # SGLang's interface does not report usage

    def _extra_stats(self) -> dict[str, Any]:
        return {"sglang_backend": self.label, "class": type(self.inner).__qualname__}

    def close(self) -> None:
        """Close the SGLang backend (those with a ``close``). ``O(backend)``."""
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def register_mem_pool_host(self, mem_pool_host: HostKVPool) -> None:
        """Register hiradix's pool for the v1 path and hand SGLang's backend its view. ``O(1)``."""
        super().register_mem_pool_host(mem_pool_host)
        if self.view is None or self.view.pool is not mem_pool_host:
            self.view = SGLangHostPoolView(mem_pool_host)
            self._page_bytes = mem_pool_host.page_bytes
            self.inner.register_mem_pool_host(self.view)
