"""hiradix's L3 backends as SGLang storage backends, for stock SGLang's own HiCache.

=============== ===================================================================
class           wraps
=============== ===================================================================
MemoryStorage   :class:`hiradix.storage.MemoryStorage` (in-process, LRU byte bound)
FileStorage     :class:`hiradix.storage.FileStorage` (checksummed segment files)
PeerStorage     :class:`hiradix.peer.store.PeerCacheStore` (the peer cache)
=============== ===================================================================

Each is a :class:`~sglang.srt.mem_cache.hicache_storage.HiCacheStorage` that SGLang's
``--hicache-storage-backend dynamic`` loader builds as ``cls(storage_config, kwargs)``::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "hiradix-file", "module_path": "hiradix.sglang.storage",
        "class_name": "FileStorage", "interface_v1": 1, "path": "/data/kv"}'

The extra config, less the loader's keys, configures the wrapped backend exactly as
hiradix's own ``--hicache-storage-backend-extra-config`` does; ``"l3_format"``, if
given, must be ``"sglang"`` (what stock SGLang stores), so one extra config serves every
node of a cluster that mixes stock SGLang and ``hiradix.sglang`` nodes. ``"interface_v1": 1``
makes SGLang call :meth:`~_SGLangStorage.batch_get_v1` / ``batch_set_v1``, which move
pages between the backend and SGLang's host pool without SGLang's per-page copies;
without it SGLang uses ``batch_get``/``batch_set`` on its own page copies. Both work.

What crosses the boundary, and how:

- **Page bytes** are SGLang's flat page (``get_data_page(i, flat=True)`` of the host pool),
  the bytes SGLang's own generic path stores, so both paths and both SGLang's and these
  classes read each other's pages (same layout). Where a page is one contiguous run of
  the host pool (MLA, ``page_first`` / ``page_first_direct``) v1 reads and writes it in
  place; elsewhere (every MHA layout: a page's K and V are apart; MLA ``layer_first``) it
  goes through a per-thread staging buffer, one memcpy per page.
- **Keys** get SGLang ``HiCacheFile``'s rank suffix (model, TP rank unless MLA, PP and CP
  ranks when split), so that TP ranks of an MHA model, which hold different heads, never
  share a key in a shared store (peer), while MLA ranks, which hold the same bytes, do.
- **Failures**: any backend failure is a miss or ``False`` (the wrapped backend turns it
  into one, counts it and logs it); nothing but a caller bug (v1 before
  ``register_mem_pool_host``, host indices that are not whole pages) raises.
- **Metrics**: :meth:`~_SGLangStorage.get_stats` returns SGLang's ``StorageMetrics``
  (pages and GB/s per get/set batch since the last call), as SGLang's metrics collector
  asserts; hiradix's own counters are ``storage.backend.get_stats()``.
- **Per-pool (v2) calls**: hybrid models (SWA, Mamba, DSA, draft pools) add host pools
  beside the KV one (``register_mem_host_pool_v2``) and move them with
  :meth:`~_SGLangStorage.batch_exists_v2` / ``batch_get_v2`` / ``batch_set_v2``. Each pool's
  pages are its flat pages under ``{key}.{pool}`` (``{key}`` for the KV pool) and the rank
  suffix, the names SGLang's ``HiCacheFile`` gives them (Mamba state is TP-sharded, so it
  keeps the TP rank in its suffix even for MLA models); hit policies ``all_pages`` and
  ``trailing_pages``.

SGLang versions: tested with 0.5.18 (``HiRadixCache``) and 0.5.23 (``UnifiedRadixCache``
with its ``HybridCacheController``), :data:`TESTED_SGLANG_VERSIONS`. The interface is the
same in both; where 0.5.23 adds to it (``PoolTransferResult.restorable_prefix_pages``)
this module uses what the installed SGLang has.

Known limit: :class:`FileStorage` gives each TP rank its own directory, so with an MLA
model and ``tp_size > 1`` (where SGLang backs up from rank 0 only) only rank 0 hits; use
:class:`PeerStorage`, which all ranks share, there.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host import HostKVCache
from sglang.srt.observability.metrics_collector import StorageMetrics

from hiradix.storage.base import MAX_KEY_BYTES, SGLANG_LOADER_KEYS, StorageBackend, StorageConfig
from hiradix.storage.keys import sglang_key_suffix

__all__ = ["LOADER_KEYS", "TESTED_SGLANG_VERSIONS", "FileStorage", "MemoryStorage", "PeerStorage", "key_suffix"]

#: SGLang versions whose own HiCache CI runs on these classes end to end
#: (``tests/sglang/v18/test_l3_interop.py``, ``tests/sglang/v23/``).
TESTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.18", "0.5.23")

#: Keys of the extra config that SGLang's loader reads; not passed to the backend.
LOADER_KEYS = SGLANG_LOADER_KEYS
_SGLANG_KEY_BYTES = 64  # SGLang's page keys are SHA-256 hex digests
_METRIC_BATCHES = 4096  # per-batch samples kept between two get_stats() calls
# SGLang 0.5.23's batch_exists_v2 result also lists every restorable prefix length.
_RESTORABLE = "restorable_prefix_pages" in getattr(PoolTransferResult, "__dataclass_fields__", {})


def key_suffix(config: HiCacheStorageConfig | None, *, rank_sharded: bool = False) -> str:
    """The suffix appended to SGLang's page keys, as SGLang's ``HiCacheFile`` names its
    files (:func:`hiradix.storage.keys.sglang_key_suffix` of the config's model, ranks
    and MLA flag); ``""`` without a config. ``rank_sharded``: a pool every TP rank holds
    its own part of even in an MLA model (Mamba state), so the TP rank stays in. ``O(1)``."""
    if config is None:
        return ""
    return sglang_key_suffix(
        config.model_name,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        is_mla=config.is_mla_model and not rank_sharded,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        cp_rank=getattr(config, "attn_cp_rank", 0) or 0,
        cp_size=getattr(config, "attn_cp_size", 1) or 1,
    )


class _SGLangStorage(HiCacheStorage):
    """A hiradix :class:`StorageBackend` behind SGLang's ``HiCacheStorage`` (module docstring).

    Parameters
    ----------
    storage_config:
        SGLang's ``HiCacheStorageConfig`` (``None``: one rank, no extra config).
    kwargs:
        The mapping SGLang's dynamic loader passes second; merged over the extra config.
    backend:
        Wrap this hiradix backend instead of building one (closed by :meth:`close`).
    clock:
        Seconds, for the bandwidth metrics (injectable for tests).
    """

    #: The backend's name in hiradix's registry (:func:`native_backend`).
    native_name: str = ""

    @staticmethod
    @abstractmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        """The wrapped backend, built from hiradix's config (the extra config in it)."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        backend: StorageBackend | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.storage_config = storage_config
        self.suffix = key_suffix(storage_config)
        self._sharded_suffix = key_suffix(storage_config, rank_sharded=True)
        if _SGLANG_KEY_BYTES + len(self.suffix.encode()) > MAX_KEY_BYTES:
            raise ValueError(
                f"model name too long for storage keys: the key suffix {self.suffix!r} leaves fewer than "
                f"{_SGLANG_KEY_BYTES} of {MAX_KEY_BYTES} bytes"
            )
        if backend is not None and not isinstance(backend, StorageBackend):
            raise TypeError(f"backend must be a hiradix StorageBackend, got {type(backend).__name__}")
        config = StorageConfig.from_sglang(storage_config, kwargs)
        # The extra config may be the one a hiradix.sglang node of a mixed cluster uses;
        # stock SGLang only ever has SGLang's keys and pages.
        fmt = config.extra_config.get("l3_format", "sglang")
        if fmt != "sglang":
            raise ValueError(f"l3_format {fmt!r}: stock SGLang stores SGLang's keys and pages; use 'sglang' or omit it")
        config = replace(config, extra_config={k: v for k, v in config.extra_config.items() if k != "l3_format"})
        self.backend: StorageBackend = backend if backend is not None else type(self).open_backend(config)
        self.mem_pool_host: HostKVCache | None = None
        self._page_dtype = torch.uint8
        self._page_numel = 0
        self._in_place = False  # a page is one contiguous run of the host pool
        self._staging = threading.local()
        self._clock = clock
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: deque[int] = deque(maxlen=_METRIC_BATCHES)
        self._backup_pgs: deque[int] = deque(maxlen=_METRIC_BATCHES)
        self._prefetch_bw: deque[float] = deque(maxlen=_METRIC_BATCHES)
        self._backup_bw: deque[float] = deque(maxlen=_METRIC_BATCHES)

    # ------------------------------------------------------------------ helpers
    def _keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of str, got a single str")
        s = self.suffix
        return [k + s for k in keys] if s else list(keys)

    def _record(self, pages: deque[int], bws: deque[float], n: int, nbytes: int, t0: float) -> None:
        if not self._metrics_on or n == 0:
            return
        dt = self._clock() - t0
        with self._metrics_lock:
            pages.append(n)
            if dt > 0:
                bws.append(nbytes / dt / 1e9)

    def _staging_pages(self, n: int) -> torch.Tensor:
        # One [n, page] buffer per thread (SGLang's prefetch and backup threads run at once).
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.shape[0] < n or buf.shape[1] != self._page_numel or buf.dtype != self._page_dtype:
            buf = self._staging.buf = torch.empty((n, self._page_numel), dtype=self._page_dtype)
        return buf[:n]

    def _page_starts(self, keys: list[str], host_indices: Any) -> list[int]:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError(f"{type(self).__name__}: call register_mem_pool_host() before the v1 calls")
        idx = torch.as_tensor(host_indices).reshape(-1)
        ps = int(pool.page_size)
        if idx.numel() == len(keys) * ps:  # as SGLang passes them: page_size slots per key
            starts = idx[::ps]
        elif idx.numel() == len(keys):
            starts = idx
        else:
            raise ValueError(f"{idx.numel()} host indices for {len(keys)} keys with page_size {ps}")
        if starts.numel() and bool((starts % ps != 0).any()):
            raise ValueError("host_indices must start each key's page on a page boundary")
        return [int(s) for s in starts.tolist()]

    # ------------------------------------------------------------------ SGLang calls
    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Attach SGLang's host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``,
        any layout) for the v1 calls; the page geometry is read from it once. ``O(1)``."""
        if not isinstance(mem_pool_host, HostKVCache):
            raise TypeError(f"mem_pool_host must be SGLang's HostKVCache, got {type(mem_pool_host).__name__}")
        # A view of page 0, not get_dummy_flat_data_page(): that one allocates pinned
        # memory, which fails where no accelerator is present.
        page = mem_pool_host.get_data_page(0, flat=False)
        self._page_dtype, self._page_numel = page.dtype, int(page.numel())
        # In place only where a page view is contiguous and its row-major order is the
        # flat page's (always so for a contiguous view: flat = view.flatten()).
        self._in_place = bool(page.is_contiguous()) and page.device.type == "cpu"
        self.mem_pool_host = mem_pool_host

    def exists(self, key: str) -> bool:
        """Whether ``key``'s page is stored. ``O(1)`` backend lookups."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Consecutive stored pages from ``keys[0]`` (longest prefix); a failure is the
        first miss. ``O(hits + 1)`` lookups (one batch for the peer cache)."""
        return self.backend.batch_exists(self._keys(keys))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page (see :meth:`batch_get`)."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page read into its target (SGLang passes ``get_dummy_flat_data_page()``
        tensors), which is returned, or ``None`` for a miss. Without targets a hit is a
        new flat tensor of the host pool's dtype (``uint8`` before one is registered).
        ``target_sizes`` is not used. ``O(total bytes)``."""
        t0 = self._clock()
        targets = None if target_locations is None else list(target_locations)
        out: list[Any] = self.backend.batch_get(self._keys(keys), targets)
        if targets is None and self.mem_pool_host is not None:
            size = self._page_dtype.itemsize
            out = [o.view(self._page_dtype) if o is not None and o.numel() % size == 0 else o for o in out]
        hits = [o for o in out if o is not None]
        self._record(self._prefetch_pgs, self._prefetch_bw, len(hits), sum(o.nbytes for o in hits), t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page (see :meth:`batch_set`)."""
        return self.batch_set([key], None if value is None else [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store ``values`` (SGLang passes ``get_data_page`` tensors; their raw bytes are
        stored); ``True`` when every page was. ``target_locations`` / ``target_sizes``
        (raw addresses) are not supported: pass ``values``. ``O(total bytes)``."""
        if values is None:
            raise ValueError(f"{type(self).__name__}.batch_set needs values (raw target locations are not supported)")
        t0 = self._clock()
        values = list(values)
        oks = self.backend.batch_set_each(self._keys(keys), values)
        nbytes = sum(_nbytes(v) for v, ok in zip(values, oks, strict=True) if ok)
        self._record(self._backup_pgs, self._backup_bw, sum(oks), nbytes, t0)
        return all(oks)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read the pages of ``keys`` into the registered host pool at ``host_indices``
        (``page_size`` slots per key, as SGLang passes them, or one page start per key).
        One bool per key; where ``False`` the page's slots are unspecified (in-place
        layouts) or untouched. ``O(total bytes)``."""
        starts = self._page_starts(list(keys), host_indices)
        pool = self.mem_pool_host
        assert pool is not None
        skeys = self._keys(keys)
        t0 = self._clock()
        if self._in_place:
            targets = [pool.get_data_page(s, flat=False) for s in starts]
            oks = [o is not None for o in self.backend.batch_get(skeys, targets)]
        else:
            staging = self._staging_pages(len(starts))
            oks = [o is not None for o in self.backend.batch_get(skeys, list(staging))]
            for s, page, ok in zip(starts, staging, oks, strict=True):
                if ok:
                    pool.set_from_flat_data_page(s, page)
        n = sum(oks)
        self._record(self._prefetch_pgs, self._prefetch_bw, n, n * self._page_numel * self._page_dtype.itemsize, t0)
        return oks

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` (as in :meth:`batch_get_v1`)
        under ``keys``; one bool per key. ``O(total bytes)``."""
        starts = self._page_starts(list(keys), host_indices)
        pool = self.mem_pool_host
        assert pool is not None
        t0 = self._clock()
        if self._in_place:
            values: list[torch.Tensor] = [pool.get_data_page(s, flat=False) for s in starts]
        else:
            staging = self._staging_pages(len(starts))
            for s, row in zip(starts, staging, strict=True):
                page = pool.get_data_page(s, flat=False)
                row.view(page.shape).copy_(page)  # one copy, in the flat page's order
            values = list(staging)
        oks = self.backend.batch_set_each(self._keys(keys), values)
        n = sum(oks)
        self._record(self._backup_pgs, self._backup_bw, n, n * self._page_numel * self._page_dtype.itemsize, t0)
        return oks

    # ------------------------------------------------------------------ per-pool (v2) calls
    def _pool_keys(self, keys: Sequence[str], pool: Any) -> list[str]:
        name = str(getattr(pool, "value", pool))
        if name == PoolName.KV.value:
            return self._keys(keys)
        suffix = self._sharded_suffix if name == PoolName.MAMBA.value else self.suffix
        return [f"{k}.{name}{suffix}" for k in keys]

    def _host_pool(self, name: Any) -> Any:
        pools = getattr(self, "registered_pools", {})
        if name in pools:
            return pools[name]
        if name == PoolName.KV and self.mem_pool_host is not None:
            return self.mem_pool_host
        raise KeyError(f"{type(self).__name__}: no host pool registered as {name!r} (register_mem_host_pool_v2)")

    def _transfer_starts(self, transfer: PoolTransfer) -> tuple[Any, list[int]] | None:
        pool = self._host_pool(transfer.name)
        keys = transfer.keys or []
        ps = int(getattr(pool, "page_size", 1) or 1)
        idx = transfer.host_indices
        if idx is None or idx.numel() != len(keys) * ps:
            return None  # SGLang's own backends answer a short transfer with misses too
        return pool, [int(s) for s in idx.reshape(-1)[::ps].tolist()]

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages and every transfer's pool pages
        are stored, each pool by its hit policy (``all_pages``: every page of the prefix;
        ``trailing_pages``: the last ``len(transfer.keys)`` pages before its end); per-pool
        hit pages in ``extra_pool_hit_pages``. A lookup failure is a miss.
        ``O(pages x pools)`` lookups."""
        kv_pages = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            pkeys = self._pool_keys(keys[:kv_pages], transfer.name)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self.backend.batch_exists(pkeys)
                ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                present = [self.backend.batch_exists([k]) == 1 for k in pkeys]
                window = max(1, len(transfer.keys or ()))
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"{type(self).__name__}: hit policy {transfer.hit_policy!r} is not supported")
            if boundary:
                hits[transfer.name] = boundary
            restorable &= ok
        final = max(restorable, default=0)
        if _RESTORABLE:
            return PoolTransferResult(final, hits, sorted(restorable))  # type: ignore[call-arg]
        return PoolTransferResult(final, hits)

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Read each transfer's pages (its ``keys``) into its pool at ``host_indices``
        (``page_size`` slots per key); one bool per key, per pool name. A transfer whose
        indices do not cover its keys gets all ``False``. ``O(total bytes)``."""
        out: dict[str, list[bool]] = {}
        t0 = self._clock()
        nbytes = 0
        for transfer in transfers:
            keys = list(transfer.keys or [])
            found = self._transfer_starts(transfer)
            if found is None:
                out[transfer.name] = [False] * len(keys)
                continue
            pool, starts = found
            targets = [torch.empty_like(pool.get_data_page(s, flat=True)) for s in starts]
            got = self.backend.batch_get(self._pool_keys(keys, transfer.name), targets)
            oks = []
            for s, page in zip(starts, got, strict=True):
                if page is not None:
                    pool.set_from_flat_data_page(s, page)
                    nbytes += int(page.nbytes)
                oks.append(page is not None)
            out[transfer.name] = oks
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(sum(v) for v in out.values()), nbytes, t0)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        """Store each transfer's pool pages at ``host_indices`` under its ``keys``; one
        bool per key, per pool name (as :meth:`batch_get_v2`). ``O(total bytes)``."""
        out: dict[str, list[bool]] = {}
        t0 = self._clock()
        nbytes = 0
        for transfer in transfers:
            keys = list(transfer.keys or [])
            found = self._transfer_starts(transfer)
            if found is None:
                out[transfer.name] = [False] * len(keys)
                continue
            pool, starts = found
            values = [pool.get_data_page(s, flat=True).contiguous() for s in starts]
            oks = self.backend.batch_set_each(self._pool_keys(keys, transfer.name), values)
            nbytes += sum(int(v.nbytes) for v, ok in zip(values, oks, strict=True) if ok)
            out[transfer.name] = list(oks)
        self._record(self._backup_pgs, self._backup_bw, sum(sum(v) for v in out.values()), nbytes, t0)
        return out

    def clear(self) -> bool:
        """Drop every page; ``False`` (logged by the caller's check) if the backend could
        not. ``O(pages)``."""
        try:
            self.backend.clear()
        except OSError:
            return False
        return True

    def get_stats(self) -> StorageMetrics:
        """SGLang's ``StorageMetrics``: pages and GB/s of each get and set batch since
        the last call (recorded only when ``enable_storage_metrics``). ``O(batches)``."""
        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for q in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                q.clear()
        return m

    def close(self) -> None:
        """Close the wrapped backend. Idempotent."""
        self.backend.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, suffix={self.suffix!r})"


def _nbytes(v: Any) -> int:
    return int(v.nbytes) if isinstance(v, torch.Tensor | np.ndarray) else memoryview(v).nbytes


def native_backend(name: str, extra: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, extra)`` of hiradix's own backend for ``--hicache-storage-backend name``
    with its extra config, as hiradix's cache builds it: ``dynamic`` naming one of this
    module's classes (the form stock SGLang loads them in, which its argument parser
    accepts) is that class's backend by its hiradix name (``memory``, ``file``, ``peer``),
    without SGLang's loader keys; any other choice is returned as given. So one extra
    config serves stock SGLang nodes and hiradix nodes, and hiradix's nodes run the backend
    natively rather than through SGLang's page interface. ``O(keys)``."""
    if name != "dynamic" or extra.get("module_path") != __name__:
        return name, dict(extra)
    cls = globals().get(str(extra.get("class_name")))
    if not (isinstance(cls, type) and issubclass(cls, _SGLangStorage)) or cls is _SGLangStorage:
        return name, dict(extra)
    return cls.native_name, {k: v for k, v in extra.items() if k not in SGLANG_LOADER_KEYS}


class MemoryStorage(_SGLangStorage):
    """:class:`hiradix.storage.MemoryStorage` for SGLang (extra config: ``capacity_bytes``)."""

    native_name = "memory"

    @staticmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        """An in-process :class:`hiradix.storage.MemoryStorage`."""
        from hiradix.storage.memory import MemoryStorage as Inner

        return Inner(config)


class FileStorage(_SGLangStorage):
    """:class:`hiradix.storage.FileStorage` for SGLang (extra config: ``path``,
    ``capacity_bytes``, ``compression``, ``fsync``, ... as for hiradix's ``file``)."""

    native_name = "file"

    @staticmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        """A :class:`hiradix.storage.FileStorage` (one subdirectory per TP rank)."""
        from hiradix.storage.file import FileStorage as Inner

        return Inner(config)


class PeerStorage(_SGLangStorage):
    """:class:`hiradix.peer.store.PeerCacheStore` for SGLang (extra config: the peer
    node's settings, e.g. ``discovery_addr``, ``pool_size``, ``seeds``)."""

    native_name = "peer"

    @staticmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        """A :class:`hiradix.peer.store.PeerCacheStore`: starts this process's peer node."""
        from hiradix.peer.store import PeerCacheStore

        return PeerCacheStore(config)
