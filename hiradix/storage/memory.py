"""In-process L3 backend: a dict of bytes with an optional byte capacity and LRU
eviction. For tests, the simulator, and as the reference the other backends are checked
against by the contract suite."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, ClassVar

from hiradix.storage.base import Capabilities, StorageBackend, StorageConfig, option_value

__all__ = ["MemoryStorage"]


class MemoryStorage(StorageBackend):
    """Pages held as ``bytes`` in an ordered dict, least recently used first.

    ``capacity_bytes`` (keyword, or ``extra_config["capacity_bytes"]``; ``None`` for
    unbounded) bounds the sum of page lengths; storing past it evicts least recently
    *read or written* pages, and a single page larger than the capacity is refused
    (``False``). One lock guards the dict; copies happen under it, which is fine for
    an in-process test backend.

    >>> s = MemoryStorage(capacity_bytes=4)
    >>> s.batch_set(["a", "b"], [b"12", b"34"]), s.get("a") is not None
    (True, True)
    >>> s.set("c", b"56"), s.batch_exists(["b"])
    (True, 0)
    """

    name: ClassVar[str] = "memory"
    capabilities = Capabilities(supports_v1=True, zero_copy=True, persistent=False)

    def __init__(self, config: StorageConfig | None = None, *, capacity_bytes: int | None = None) -> None:
        super().__init__(config)
        cap = option_value(self.config, capacity_bytes, "capacity_bytes", None)
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"capacity_bytes must be a positive int or None, got {cap!r}")
        self.capacity_bytes: int | None = cap
        self._pages: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _exists(self, key: str) -> bool:
        """``O(1)``."""
        with self._lock:
            return key in self._pages

    def _size(self, key: str) -> int | None:
        """``O(1)``."""
        with self._lock:
            page = self._pages.get(key)
            return None if page is None else len(page)

    def _get_into(self, key: str, out: memoryview) -> bool:
        """``O(page bytes)``; refreshes the page's recency."""
        with self._lock:
            page = self._pages.get(key)
            if page is None or len(page) != len(out):
                return False
            self._pages.move_to_end(key)
            out[:] = page
            return True

    def _put(self, key: str, data: memoryview) -> bool:
        """``O(page bytes + evicted pages)``."""
        n = len(data)
        if self.capacity_bytes is not None and n > self.capacity_bytes:
            return False
        page = bytes(data)
        evicted = 0
        with self._lock:
            old = self._pages.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            if self.capacity_bytes is not None:
                while self._pages and self._bytes + n > self.capacity_bytes:
                    _, victim = self._pages.popitem(last=False)
                    self._bytes -= len(victim)
                    evicted += 1
            self._pages[key] = page
            self._bytes += n
        if evicted:
            self._count(evictions=evicted)
        return True

    # Batched versions of the primitives: one lock round per batch instead of per page
    # (the simulator moves millions of tiny pages through here).
    def _exists_many(self, keys: list[str]) -> int:
        """``O(hits + 1)`` under one lock."""
        with self._lock:
            pages = self._pages
            for n, key in enumerate(keys):
                if key not in pages:
                    return n
            return len(keys)

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """``O(total bytes)`` under one lock; refreshes each hit's recency."""
        results = []
        with self._lock:
            pages = self._pages
            for key, out in zip(keys, outs, strict=True):
                page = pages.get(key)
                if page is None or len(page) != len(out):
                    results.append(False)
                    continue
                pages.move_to_end(key)
                out[:] = page
                results.append(True)
        return results

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """``O(total bytes + evicted pages)``: copies made before, the index updated in
        one lock round."""
        cap = self.capacity_bytes
        copies = [bytes(v) for v in views]
        results = []
        evicted = 0
        with self._lock:
            pages = self._pages
            for key, page in zip(keys, copies, strict=True):
                n = len(page)
                if cap is not None and n > cap:
                    results.append(False)
                    continue
                old = pages.get(key)  # a plain lookup: most keys are new, and pop(key, None) is slow on a miss
                if old is not None:
                    self._bytes -= len(old)
                    del pages[key]
                if cap is not None:
                    while pages and self._bytes + n > cap:
                        _, victim = pages.popitem(last=False)
                        self._bytes -= len(victim)
                        evicted += 1
                pages[key] = page
                self._bytes += n
                results.append(True)
        if evicted:
            self._count(evictions=evicted)
        return results

    def _clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._bytes = 0

    def _usage(self) -> tuple[int, int, int | None]:
        with self._lock:
            return len(self._pages), self._bytes, self.capacity_bytes

    def _extra_stats(self) -> dict[str, Any]:
        return {}
