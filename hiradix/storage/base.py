"""The L3 storage interface: SGLang's ``HiCacheStorage`` calls over a small set of
backend primitives.

A backend subclasses :class:`StorageBackend` and implements six primitives (``_exists``,
``_size``, ``_get_into``, ``_put``, ``_clear``, ``_usage``), and may override their batch
forms (``_exists_many``, ``_get_many_into``, ``_put_many``, and ``_get_many_at`` /
``_put_many_at`` for raw page addresses of a page-first host pool). The public SGLang-shaped calls
(``batch_exists``, ``batch_get``, ``batch_set``, ``batch_get_v1``, ``batch_set_v1``, ...)
are written once here, on top of them, so that every backend has the same semantics:

* ``batch_exists`` is longest-prefix: it counts consecutive hits from ``keys[0]`` and
  stops at the first miss (page hashes are chained, so a page after a gap is useless).
* Any error *inside* a backend (``OSError``, a corrupt record, a broken connection, a bug
  in a third-party backend) is a miss or ``False``, counted in :meth:`get_stats`, never
  an exception in the serving path and never wrong bytes. Caller bugs (a key that is not
  a string, host indices that are not page starts, v1 without a registered host pool)
  raise, because recomputing would only hide them.
* What a backend can do is declared in :class:`Capabilities`, a class attribute; callers
  read it instead of probing methods with ``hasattr``.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from hiradix.memory.pools import HostKVPool
    from hiradix.storage.keys import KeyNamespace

__all__ = [
    "MAX_KEY_BYTES",
    "Capabilities",
    "StorageBackend",
    "StorageConfig",
    "StorageError",
    "StorageExtraInfo",
    "StorageStats",
    "as_byte_view",
    "check_keys",
    "memoryview_of",
    "option_value",
]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 255  # keys are stored in record headers with a one-byte-wide length budget


class StorageError(RuntimeError):
    """A storage backend cannot be built or opened (bad directory, directory in use, ...).

    Raised at construction only: once a backend serves, its I/O errors are misses.
    """


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, declared once per class (and narrowed per instance where an
    option such as compression changes it).

    >>> Capabilities(persistent=True).supports_v1
    True
    """

    supports_v1: bool = True  # batch_get_v1 / batch_set_v1 against a registered HostKVPool
    zero_copy: bool = False  # v1 moves page bytes with no intermediate buffer (page-first layouts)
    persistent: bool = False  # pages survive the process (a new instance serves them)
    shared: bool = False  # other processes or nodes see the same pages
    compression: bool = False  # pages are stored compressed


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """How a backend is asked to run (SGLang's ``HiCacheStorageConfig``).

    ``extra_config`` holds backend options (``path``, ``capacity_bytes``, ``compression``
    ...) as parsed from ``--hicache-storage-backend-extra-config``; it is copied into a
    read-only mapping. ``namespace`` is the key namespace the pages belong to (see
    :mod:`hiradix.storage.keys`); backends do not interpret it, it is carried so that
    whoever builds keys and whoever stores them agree.

    >>> StorageConfig(tp_rank=1, tp_size=2, extra_config={"capacity_bytes": 1024}).extra_config["capacity_bytes"]
    1024
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    model_name: str | None = None
    is_mla_model: bool = False
    namespace: KeyNamespace | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < size:
                raise ValueError(f"{name} must be an int in [0, {size}), got {v!r}")
        if not isinstance(self.extra_config, Mapping):
            raise TypeError(f"extra_config must be a mapping, got {type(self.extra_config).__name__}")
        object.__setattr__(self, "extra_config", MappingProxyType(dict(self.extra_config)))

    @classmethod
    def from_sglang(cls, config: Any, overrides: Mapping[str, Any] | None = None) -> StorageConfig:
        """Ours, from SGLang's ``HiCacheStorageConfig`` (read by attribute, so SGLang need not
        be installed): ranks, model, MLA, and the extra config less the keys SGLang's
        ``dynamic`` loader reads (:data:`SGLANG_LOADER_KEYS`), ``overrides`` (the keyword
        arguments the loader forwards) winning. ``None`` gives the defaults. ``O(keys)``.

        >>> from types import SimpleNamespace as NS
        >>> c = StorageConfig.from_sglang(NS(tp_rank=1, tp_size=2, extra_config={"class_name": "X", "path": "/d"}))
        >>> c.tp_rank, dict(c.extra_config)
        (1, {'path': '/d'})
        """
        extra = {**dict(getattr(config, "extra_config", None) or {}), **dict(overrides or {})}
        for k in SGLANG_LOADER_KEYS:
            extra.pop(k, None)
        if config is None:
            return cls(extra_config=extra)
        return cls(
            tp_rank=int(getattr(config, "tp_rank", 0)),
            tp_size=int(getattr(config, "tp_size", 1)),
            pp_rank=int(getattr(config, "pp_rank", 0)),
            pp_size=int(getattr(config, "pp_size", 1)),
            model_name=getattr(config, "model_name", None),
            is_mla_model=bool(getattr(config, "is_mla_model", False)),
            extra_config=extra,
        )


SGLANG_LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
"""Keys of SGLang's ``--hicache-storage-backend-extra-config`` that its ``dynamic`` loader
reads itself; they are not backend options."""


@dataclass(frozen=True, slots=True)
class StorageExtraInfo:
    """Per-call hints (SGLang's ``HiCacheStorageExtraInfo``): the hashes of the pages
    before ``keys`` and free-form backend data. The built-in backends ignore it."""

    prefix_keys: tuple[str, ...] | None = None
    extra_info: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StorageStats:
    """A snapshot of a backend's counters (:meth:`StorageBackend.get_stats`).

    ``errors`` counts backend failures turned into misses; ``corrupt`` counts pages that
    failed verification (and were dropped); ``extra`` is backend specific.
    """

    backend: str
    pages: int
    bytes_used: int
    capacity_bytes: int | None
    exists_queries: int
    hits: int
    misses: int
    sets: int
    set_failures: int
    evictions: int
    errors: int
    corrupt: int
    extra: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- helpers
def check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each a non-empty ``str`` of at most :data:`MAX_KEY_BYTES` UTF-8
    bytes; ``TypeError`` / ``ValueError`` otherwise. ``O(len(keys))``.

    >>> check_keys(("a", "b"))
    ['a', 'b']
    """
    if isinstance(keys, str):
        raise TypeError("keys must be a sequence of str, got a single str")
    out = list(keys)
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"storage keys must be str, got {type(k).__name__}")
        if not k or (len(k) if k.isascii() else len(k.encode())) > MAX_KEY_BYTES:
            raise ValueError(f"storage key must be 1..{MAX_KEY_BYTES} UTF-8 bytes, got {k!r:.80}")
    return out


def memoryview_of(obj: Any) -> memoryview:
    """``memoryview(obj)``, typed: numpy arrays and tensors' ``.numpy()`` export the buffer
    protocol, which numpy's stubs do not say."""
    return memoryview(obj)


def _row_views(rows: np.ndarray, pages: Any) -> list[memoryview]:
    """Views of rows ``pages`` of a C-contiguous 2-D uint8 array: slices of one flat
    memoryview, several times cheaper than indexing numpy row by row."""
    flat = memoryview_of(rows.reshape(-1))
    width = rows.shape[1]
    return [flat[p * width : p * width + width] for p in pages]


def as_byte_view(data: Any, *, writable: bool = False) -> memoryview:
    """A flat ``uint8`` memoryview over ``data`` (bytes-like, numpy array or CPU tensor),
    without copying when ``data`` is contiguous. CUDA and non-contiguous tensors are
    copied to a contiguous CPU tensor first (only allowed when not ``writable``).
    ``O(1)`` for contiguous input.
    """
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            if writable:
                raise ValueError("a target tensor must be a contiguous CPU tensor")
            t = t.to("cpu").contiguous()
        t = t.reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return memoryview_of(t.numpy()).cast("B")
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            if writable:
                raise ValueError("a target array must be C-contiguous")
            data = np.ascontiguousarray(data)
        mv = memoryview_of(data.reshape(-1).view(np.uint8))
    elif isinstance(data, bytes | bytearray | memoryview):
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("page data must be contiguous")
    else:
        raise TypeError(f"page data must be bytes-like, a numpy array or a tensor, got {type(data).__name__}")
    if writable and mv.readonly:
        raise ValueError("a target buffer must be writable")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class _Counters:
    __slots__ = ("corrupt", "errors", "evictions", "exists_queries", "hits", "misses", "set_failures", "sets")

    def __init__(self) -> None:
        self.exists_queries = self.hits = self.misses = self.sets = 0
        self.set_failures = self.evictions = self.errors = self.corrupt = 0


# ----------------------------------------------------------------------------- the ABC
class StorageBackend(ABC):
    """Base class of every L3 backend: SGLang's ``HiCacheStorage`` calls, written once.

    Subclasses implement the primitives below; each must be thread-safe, because the
    controller's prefetch, IO and backup threads call one backend concurrently. A
    primitive may raise any exception on a backend failure: the public calls turn it
    into a miss / ``False`` and count it.
    """

    name: ClassVar[str] = "abstract"
    capabilities: Capabilities = Capabilities()

    def __init__(self, config: StorageConfig | None = None) -> None:
        if config is not None and not isinstance(config, StorageConfig):
            raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
        self.config = config if config is not None else StorageConfig()
        self.mem_pool_host: HostKVPool | None = None
        self._counters = _Counters()
        self._counter_lock = threading.Lock()
        self._scratch = threading.local()  # per-thread page buffer for v1 of gathered pages

    # ------------------------------------------------------------------ primitives
    @abstractmethod
    def _exists(self, key: str) -> bool:
        """Whether ``key`` is stored (cheap; need not verify the payload)."""

    @abstractmethod
    def _size(self, key: str) -> int | None:
        """The byte length of ``key``'s page, or ``None`` if absent."""

    @abstractmethod
    def _get_into(self, key: str, out: memoryview) -> bool:
        """Fill ``out`` (writable, flat bytes) with ``key``'s page. ``False`` when absent,
        of another length, or failing verification; ``out``'s content is then unspecified."""

    @abstractmethod
    def _put(self, key: str, data: memoryview) -> bool:
        """Store ``data`` (flat bytes) under ``key``, replacing any older page. ``False``
        when refused (e.g. larger than the capacity)."""

    @abstractmethod
    def _clear(self) -> None:
        """Drop every page."""

    @abstractmethod
    def _usage(self) -> tuple[int, int, int | None]:
        """``(pages, bytes_used, capacity_bytes)``."""

    def _extra_stats(self) -> dict[str, Any]:
        """Backend-specific numbers for :attr:`StorageStats.extra`."""
        return {}

    # ------------------------------------------------------------------ bookkeeping
    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            c = self._counters
            for k, v in deltas.items():
                setattr(c, k, getattr(c, k) + v)

    def _failed(self, op: str, key: str, exc: BaseException) -> None:
        # Storage failures must not crash serving (a miss is recomputed), but they must
        # not vanish either: counted in get_stats() and logged with the cause.
        self._count(errors=1)
        log.warning("%s: %s(%r) failed, treated as a miss: %r", self.name, op, key, exc)

    # ------------------------------------------------------------------ SGLang calls
    def register_mem_pool_host(self, mem_pool_host: HostKVPool) -> None:
        """Attach the host (L2) pool that the v1 calls read from and write into. ``O(1)``."""
        from hiradix.memory.pools import HostKVPool

        if not isinstance(mem_pool_host, HostKVPool):
            raise TypeError(f"mem_pool_host must be a HostKVPool, got {type(mem_pool_host).__name__}")
        self.mem_pool_host = mem_pool_host

    def exists(self, key: str) -> bool:
        """Whether one page is stored. ``O(1)`` backend calls."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str], extra_info: StorageExtraInfo | None = None) -> int:
        """The number of consecutive stored pages from ``keys[0]`` (longest prefix); a
        failing lookup counts as the first miss. Runtime complexity: ``O(hits + 1)``
        backend lookups.

        >>> from hiradix.storage.memory import MemoryStorage
        >>> s = MemoryStorage()
        >>> s.batch_set(["a", "c"], [b"1", b"3"])
        True
        >>> s.batch_exists(["a", "b", "c"])
        1
        """
        keys = check_keys(keys)
        n = 0
        if keys:
            try:
                n = max(0, min(int(self._exists_many_with(keys, extra_info)), len(keys)))
            except Exception as exc:  # a failing batch override: the first key misses
                self._failed("exists", keys[0], exc)
                n = 0
        self._count(exists_queries=len(keys))
        return n

    def _exists_many_with(self, keys: list[str], extra_info: StorageExtraInfo | None) -> int:
        """:meth:`_exists_many` for a backend that reads the call's ``extra_info`` (prefix
        keys); the default ignores it."""
        return self._exists_many(keys)

    def _exists_many(self, keys: list[str]) -> int:
        """How many leading ``keys`` are stored (see :meth:`batch_exists`). The default
        asks ``_exists`` key by key and stops at the first miss (a failing key is that
        miss); backends override it to answer a batch in one round trip."""
        n = 0
        for key in keys:
            try:
                if not self._exists(key):
                    break
            except Exception as exc:  # any backend failure is a miss (module docstring)
                self._failed("exists", key, exc)
                break
            n += 1
        return n

    def get(self, key: str, target_location: Any = None) -> torch.Tensor | None:
        """One page (see :meth:`batch_get`)."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[Any] | None = None) -> list[Any]:
        """Copies of the pages of ``keys``: ``None`` for each miss.

        Without ``target_locations`` each hit is a new 1-D ``uint8`` tensor. With them,
        each hit is read into its target (a contiguous CPU tensor, numpy array or writable
        buffer of exactly the page's length), which is returned; a target of another
        length is a miss. Runtime complexity: ``O(total bytes)``.
        """
        keys = check_keys(keys)
        if target_locations is not None and len(target_locations) != len(keys):
            raise ValueError(f"{len(target_locations)} target locations for {len(keys)} keys")
        # Targets are checked before any I/O: a bad target is the caller's bug and raises.
        if target_locations is not None:
            targets = list(target_locations)
            views = [as_byte_view(t, writable=True) for t in targets]
            oks = self._get_many_safe(keys, views)
            out: list[Any] = [t if ok else None for t, ok in zip(targets, oks, strict=True)]
        else:
            out = [None] * len(keys)
            todo: list[int] = []
            bufs: list[torch.Tensor] = []
            for i, key in enumerate(keys):
                try:
                    size = self._size(key)
                    # In the try: a size no buffer can have (huge, negative, not an int) is
                    # a bad record of this key, so this key's miss, not the whole batch's.
                    buf = None if size is None else torch.empty(size, dtype=torch.uint8)
                except Exception as exc:  # any backend failure is a miss (module docstring)
                    self._failed("get", key, exc)
                    buf = None
                if buf is not None:
                    todo.append(i)
                    bufs.append(buf)
            oks = self._get_many_safe([keys[i] for i in todo], [memoryview_of(b.numpy()) for b in bufs])
            for i, buf, ok in zip(todo, bufs, oks, strict=True):
                out[i] = buf if ok else None
        hits = sum(o is not None for o in out)
        self._count(hits=hits, misses=len(keys) - hits)
        return out

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """Fill each of ``outs`` with its key's page (see :meth:`_get_into`). The default
        calls ``_get_into`` key by key, so that one failing key is one miss; backends
        override it to batch their I/O."""
        return self._per_key("get", self._get_into, keys, outs)

    def _per_key(
        self, op: str, fn: Callable[[str, memoryview], Any], keys: list[str], bufs: list[memoryview]
    ) -> list[bool]:
        """``fn(key, buf)`` key by key: a key whose call raises is one miss or ``False``
        (counted and logged), never the whole batch's."""
        results = []
        for key, buf in zip(keys, bufs, strict=True):
            try:
                ok = bool(fn(key, buf))
            except Exception as exc:  # any backend failure is a miss / False (module docstring)
                self._failed(op, key, exc)
                ok = False
            results.append(ok)
        return results

    def _get_many_at(self, keys: list[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any) -> list[bool] | None:
        """Optional batch primitive of the page-first v1 get: fill page ``i`` at the raw
        address ``addrs[i]`` (``lengths[i]`` bytes, kept alive by ``hold``). ``None`` (the
        default) means "not supported": the caller builds one view per page and uses
        :meth:`_get_many_into`. Backends whose get path is per batch override it to skip
        the per-page views."""
        return None

    def _get_many_at_safe(self, keys: list[str], rows: np.ndarray, pages: np.ndarray) -> list[bool] | None:
        if not keys:
            return []
        page_bytes = rows.shape[1]
        addrs = rows.ctypes.data + pages.astype(np.uint64) * np.uint64(page_bytes)
        try:
            return self._get_many_at(keys, addrs, np.full(len(keys), page_bytes, dtype=np.int64), rows)
        except Exception as exc:  # a failing batch override: every key of it is a miss
            self._failed("get", keys[0], exc)
            return [False] * len(keys)

    def _get_many_safe(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        if not keys:
            return []
        try:
            return self._get_many_into(keys, outs)
        except Exception as exc:  # a failing batch override: every key of it is a miss
            self._failed("get", keys[0], exc)
            return [False] * len(keys)

    def set(self, key: str, value: Any) -> bool:
        """Store one page (see :meth:`batch_set`)."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: Sequence[str], values: Sequence[Any]) -> bool:
        """Store copies of ``values`` (bytes-like, numpy arrays or tensors of any dtype;
        their raw bytes are stored) under ``keys``. Returns whether *every* page was
        stored (SGLang's convention); pages stored before a failure stay stored.
        Runtime complexity: ``O(total bytes)``.
        """
        return all(self.batch_set_each(keys, values))

    def batch_set_each(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        """:meth:`batch_set` with one bool per key: whether that page was stored.
        Runtime complexity: ``O(total bytes)``.

        >>> from hiradix.storage.memory import MemoryStorage
        >>> MemoryStorage(capacity_bytes=2).batch_set_each(["a", "b"], [b"1", b"333"])
        [True, False]
        """
        keys = check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"{len(values)} values for {len(keys)} keys")
        views = [as_byte_view(v) for v in values]
        return self._put_many_safe(keys, views)

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """Store each of ``views`` under its key (see :meth:`_put`). The default calls
        ``_put`` key by key, so that one failing key is one ``False``; backends override
        it to batch their I/O."""
        return self._per_key("set", self._put, keys, views)

    def _put_many_safe(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        if not keys:
            return []
        try:
            results = [bool(r) for r in self._put_many(keys, views)]
        except Exception as exc:  # a failing batch override: every key of it is a False
            self._failed("set", keys[0], exc)
            results = [False] * len(keys)
        return self._count_sets(results)

    def _count_sets(self, results: list[bool]) -> list[bool]:
        n_ok = sum(results)
        self._count(sets=n_ok, set_failures=len(results) - n_ok)
        return results

    def _put_many_at(self, keys: list[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any) -> list[bool] | None:
        """Optional batch primitive of the page-first v1 set, the twin of
        :meth:`_get_many_at`: store ``lengths[i]`` bytes at the raw address ``addrs[i]``
        (kept alive by ``hold``) under ``keys[i]``. ``None`` (the default) means "not
        supported": the caller builds one view per page and uses :meth:`_put_many`."""
        return None

    def _put_many_at_safe(self, keys: list[str], rows: np.ndarray, pages: np.ndarray) -> list[bool] | None:
        if not keys:
            return []
        page_bytes = rows.shape[1]
        addrs = rows.ctypes.data + pages.astype(np.uint64) * np.uint64(page_bytes)
        try:
            results = self._put_many_at(keys, addrs, np.full(len(keys), page_bytes, dtype=np.int64), rows)
        except Exception as exc:  # a failing batch override: every key of it is a False
            self._failed("set", keys[0], exc)
            results = [False] * len(keys)
        return None if results is None else self._count_sets([bool(r) for r in results])

    # ------------------------------------------------------------------ v1 (host pool)
    def _page_starts(self, keys: list[str], host_indices: Any) -> np.ndarray:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError(f"{self.name}: call register_mem_pool_host() before the v1 calls")
        if not self.capabilities.supports_v1:
            raise NotImplementedError(f"{self.name} does not support batch_get_v1/batch_set_v1")
        idx = host_indices.detach().cpu().numpy() if isinstance(host_indices, torch.Tensor) else host_indices
        idx = np.asarray(idx)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ValueError(f"host_indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        ps = pool.page_size
        if len(idx) == len(keys):
            return idx  # one page start per key
        if len(idx) == len(keys) * ps:
            # SGLang passes token indices (page_size per key): each page must be one run.
            pages = idx.reshape(len(keys), ps)
            if not np.array_equal(pages - pages[:, :1], np.broadcast_to(np.arange(ps), pages.shape)):
                raise ValueError("host_indices of each page must be consecutive slots")
            return pages[:, 0].copy()
        raise ValueError(
            f"{len(idx)} host indices for {len(keys)} keys: give one page start per key "
            f"or page_size ({ps}) slots per key"
        )

    def _scratch_pages(self, n: int, nbytes: int) -> torch.Tensor:
        # One per-thread [n, nbytes] buffer, grown as needed (never shared between threads).
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.shape[1] != nbytes or buf.shape[0] < n:
            buf = self._scratch.buf = torch.empty((n, nbytes), dtype=torch.uint8)
        return buf[:n]

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: Any, extra_info: StorageExtraInfo | None = None
    ) -> list[bool]:
        """Read the pages of ``keys`` straight into the registered host pool.

        ``host_indices`` gives one page-start slot per key, or, as SGLang passes them,
        ``page_size`` consecutive slots per key. Pages that are one run of the pool
        (:attr:`HostKVPool.pages_in_place`) are filled in place (zero copy); others go
        through a per-thread buffer. Returns one
        bool per key; where it is ``False`` the page's slots hold unspecified bytes and
        must not be used. Runtime complexity: ``O(total bytes)``.
        """
        keys = check_keys(keys)
        starts = self._page_starts(keys, host_indices)
        pool = self.mem_pool_host
        assert pool is not None
        if pool.pages_in_place:  # each page is one row of the pool: read in place
            rows = pool.pages_array()
            pages = pool.page_ids(starts)
            results = self._get_many_at_safe(keys, rows, pages)
            if results is None:
                results = self._get_many_safe(keys, _row_views(rows, pages.tolist()))
        else:  # gathered pages: read into a per-thread buffer, then scatter the good pages
            scratch = self._scratch_pages(len(keys), pool.page_bytes)
            results = self._get_many_safe(keys, _row_views(scratch.numpy(), range(len(keys))))
            good = [i for i, ok in enumerate(results) if ok]
            if good:
                pool.write_pages(starts[good], scratch[good] if len(good) < len(keys) else scratch)
        hits = sum(results)
        self._count(hits=hits, misses=len(keys) - hits)
        return results

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: Any, extra_info: StorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` (as in :meth:`batch_get_v1`)
        under ``keys``; one bool per key. Pages that are one run of the pool are written
        from it without a copy. Runtime complexity: ``O(total bytes)``.
        """
        keys = check_keys(keys)
        starts = self._page_starts(keys, host_indices)
        pool = self.mem_pool_host
        assert pool is not None
        if pool.pages_in_place:  # written straight from the pool
            rows = pool.pages_array()
            pages = pool.page_ids(starts)
            results = self._put_many_at_safe(keys, rows, pages)
            if results is not None:
                return results
            views = _row_views(rows, pages.tolist())
        else:  # gathered into a per-thread buffer first
            scratch = self._scratch_pages(len(keys), pool.page_bytes)
            pool.read_pages(starts, scratch)
            views = _row_views(scratch.numpy(), range(len(keys)))
        return self._put_many_safe(keys, views)

    # ------------------------------------------------------------------ management
    def clear(self) -> None:
        """Drop every page (counters are kept). Errors propagate: a clear that silently
        left pages behind would be worse than a crash at an operator's request."""
        self._clear()

    def get_stats(self) -> StorageStats:
        """A snapshot of the counters and usage. ``O(1)`` plus the backend's extras."""
        try:
            pages, used, cap = self._usage()
            extra = self._extra_stats()
        except Exception as exc:  # stats must never take serving down
            self._failed("stats", "", exc)
            pages, used, cap, extra = 0, 0, None, {}
        with self._counter_lock:
            c = self._counters
            return StorageStats(
                backend=self.name,
                pages=pages,
                bytes_used=used,
                capacity_bytes=cap,
                exists_queries=c.exists_queries,
                hits=c.hits,
                misses=c.misses,
                sets=c.sets,
                set_failures=c.set_failures,
                evictions=c.evictions,
                errors=c.errors,
                corrupt=c.corrupt,
                extra=MappingProxyType(dict(extra)),
            )

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release files, sockets and locks. Idempotent; the default does nothing."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp_rank={self.config.tp_rank}, tp_size={self.config.tp_size})"


def option_value(config: StorageConfig, explicit: Any, name: str, default: Any) -> Any:
    """An option given as a keyword argument, else in ``config.extra_config``, else the default."""
    if explicit is not None:
        return explicit
    return config.extra_config.get(name, default)
