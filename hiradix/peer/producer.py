"""The write side of a peer-cache node: the pages it publishes for its peers to READ.

:class:`Producer` owns the published pools (one per page-size class, :func:`size_class`),
the entries this node told the directory about, the evictions out of the pools and the
optional disk tier under them, and the promotes that bring disk-resident pages back.

Writes: :meth:`Producer.publish_many` copies each page into a pool slot (one memcpy) and
PUTs ``(node, addr, rkey, length, generation)`` to the key's owners. Republishing a key
never makes a reader miss: identical bytes are a touch; other bytes are written to a fresh
slot, the directory entry is switched to it, and only then is the old slot freed (its bytes
intact until reuse, so a reader that looked it up earlier still verifies or misses safely).
Generations increase across all of a node's pools, so the directory's "newer wins" holds.

An evicted page whose bytes are on disk stays published as disk-resident
(``resident=False``); any other is deleted from the directory. A page evicted from disk
while not in the pool is unpublished.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hiradix.peer.directory import DirectoryView, DirEntry
from hiradix.peer.disk import DiskTier
from hiradix.peer.metrics import PeerMetrics
from hiradix.peer.pool import EvictedPage, PublishedPool
from hiradix.transport.base import Transport

__all__ = ["MIN_CLASS", "Producer", "ProducerSettings", "size_class"]

log = logging.getLogger(__name__)

MIN_CLASS = 64


def size_class(n: int, page_size: int | None) -> int:
    """The slot payload size a page of ``n`` bytes goes to: the configured page size when
    it fits, else the next power of two (at least 64).

    >>> size_class(4096, None), size_class(5000, None), size_class(100, 4096)
    (4096, 8192, 4096)
    """
    if page_size is not None and n <= page_size:
        return page_size
    return max(MIN_CLASS, 1 << (max(n, 1) - 1).bit_length())


@dataclass(frozen=True)
class ProducerSettings:
    """What a :class:`Producer` needs of the node's settings
    (:meth:`PeerConfig.producer_settings <hiradix.peer.config.PeerConfig.producer_settings>`)."""

    #: Bytes of each published pool, and the page size a pool slot holds (``None``: the
    #: size class of each page, :func:`size_class`).
    pool_size: int
    page_size: int | None = None
    #: The optional disk tier under the pools (:class:`~hiradix.peer.disk.DiskTier`).
    disk_enabled: bool = False
    disk_path: str = "/data/hiradix/peer"
    disk_size: int = 100 << 30
    disk_queue_depth: int = 256


class Producer:
    """This node's published pages (module docstring).

    Parameters
    ----------
    node_id, incarnation:
        Who the directory entries name as the producer.
    settings:
        Pool size, page size and the disk tier's settings.
    transport:
        Registers the pools' memory (the only memory peers may READ).
    directory:
        Where entries are PUT, switched to disk-resident and deleted.
    metrics:
        Records writes, evictions and promotes, and tracks the pools and the disk tier.
    guard:
        Runs background work and counts its failures (``guard(kind, fn, *args)``, the
        node's :meth:`~hiradix.peer.node.PeerNode._guard`): the disk tier's eviction and
        warm-up callbacks go through it.

    The disk tier is opened here when ``settings.disk_enabled``; :attr:`disk` is ``None``
    when it is off or its path is unusable (a disabled tier holds no thread: nothing to
    close). :meth:`close` closes it.
    """

    def __init__(
        self,
        node_id: str,
        incarnation: int,
        settings: ProducerSettings,
        transport: Transport,
        directory: DirectoryView,
        metrics: PeerMetrics,
        guard: Callable[..., Any],
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.settings = settings
        self.transport = transport
        self.directory = directory
        self.metrics = metrics
        self._guard = guard
        self._lock = threading.Lock()
        self._entries: dict[str, DirEntry] = {}  # what this node published, as it told the directory
        self._pools: dict[int, PublishedPool] = {}
        # One increasing generation source for every pool of this node (and empty pages),
        # so the directory's "newer generation wins" holds across size classes.
        self._generation_lock = threading.Lock()
        self._generations = itertools.count(1)
        self._evicted: list[EvictedPage] = []
        self._evict_lock = threading.Lock()
        self.evictions = 0
        self.on_evictions: Callable[[int], None] | None = None
        metrics.track("pool", lambda: (self.used_bytes, settings.pool_size, self.pages))
        self.disk: DiskTier | None = None
        if settings.disk_enabled:
            disk = DiskTier(
                settings.disk_path,
                settings.disk_size,
                queue_depth=settings.disk_queue_depth,
                on_evict=functools.partial(guard, "disk_evict", self._on_disk_evict),
            )
            if disk.enabled:
                self.disk = disk
                metrics.track("disk", lambda: (disk.used_bytes, disk.capacity_bytes, len(disk)))

    # ------------------------------------------------------------------ pools
    def pool_for(self, n: int) -> PublishedPool:
        """The pool that holds pages of ``n`` bytes (created on first use); ``ValueError``
        when one page of ``n`` bytes cannot fit the pool. Runtime complexity: ``O(1)``."""
        c = size_class(n, self.settings.page_size)
        with self._lock:
            pool = self._pools.get(c)
            if pool is None:
                pool = PublishedPool(
                    self.settings.pool_size,
                    c,
                    registrar=self.transport,
                    on_evict=self._on_pool_evict,
                    generations=self._next_generation,
                )
                self._pools[c] = pool
            return pool

    def _next_generation(self) -> int:
        with self._generation_lock:
            return next(self._generations)

    def pool_holding(self, entry: DirEntry) -> PublishedPool | None:
        """The pool ``entry``'s page would be in (``None`` for an empty page or an unused
        class). Runtime complexity: ``O(1)``."""
        return self._pools.get(size_class(entry.length, self.settings.page_size)) if entry.length else None

    def size_classes(self) -> list[int]:
        """The slot sizes of the pools in use, ascending. ``O(classes)``."""
        return sorted(self._pools)

    @property
    def used_bytes(self) -> int:
        """Payload bytes held by the published pools."""
        return sum(p.used_bytes for p in list(self._pools.values()))

    @property
    def pages(self) -> int:
        """Pages held by the published pools."""
        return sum(len(p) for p in list(self._pools.values()))

    def published(self) -> dict[str, DirEntry]:
        """A copy of every entry this node has published (resident or on disk).
        Runtime complexity: ``O(pages)``."""
        with self._lock:
            return dict(self._entries)

    def __len__(self) -> int:
        """Pages this node has published (resident or on disk). ``O(1)``."""
        return len(self._entries)

    def entry(self, key: str) -> DirEntry | None:
        """The entry this node published for ``key``, if any. ``O(1)``."""
        with self._lock:
            return self._entries.get(key)

    # ------------------------------------------------------------------ evictions
    def _on_pool_evict(self, page: EvictedPage) -> None:
        with self._evict_lock:
            self._evicted.append(page)

    def _drain_evictions(self) -> None:
        with self._evict_lock:
            pages, self._evicted = self._evicted, []
        if not pages:
            return
        gone: list[tuple[str, str | None, int | None]] = []
        to_disk: list[tuple[str, int]] = []
        with self._lock:
            for p in pages:
                cur = self._entries.get(p.key)
                if cur is None or cur.generation != p.generation:
                    continue  # already replaced or deleted
                if self.disk is not None and self.disk.exists(p.key):
                    self._entries[p.key] = replace(cur, resident=False)
                    to_disk.append((p.key, p.generation))
                else:
                    del self._entries[p.key]
                    gone.append((p.key, self.node_id, p.generation))
            self.evictions += len(pages)
        self.metrics.record_eviction("pool", len(pages))
        if self.on_evictions is not None:
            self.on_evictions(len(pages))
        if gone:
            self.directory.batch_delete(gone)
        for key, gen in to_disk:
            self.directory.set_resident(key, False, self.node_id, gen)

    def _on_disk_evict(self, key: str) -> None:
        self.metrics.record_eviction("disk")
        with self._lock:
            cur = self._entries.get(key)
            if cur is None or cur.resident:
                return  # still in the pool: the entry stays
            del self._entries[key]
        self.directory.delete(key, self.node_id, cur.generation)

    # ------------------------------------------------------------------ writes
    def _store_local(self, key: str, data: Any, after: list[Callable[[], None]] | None = None) -> DirEntry | None:
        """Copy one page into a pool slot, replacing an older page of ``key``.

        The older page stays readable until the new one is written *and* the directory
        names it: freeing its slot is appended to ``after``, which the caller runs once the
        directory entry has switched (``None``: run at once, for callers that do not PUT).
        Identical bytes are only a touch (same slot, same generation).
        """
        n = memoryview(data).nbytes
        with self._lock:
            old = self._entries.get(key)
        cleanup: list[Callable[[], None]] = []
        try:
            entry = self._write_page(key, data, n, old, cleanup)
        finally:
            if after is None:
                for fn in cleanup:
                    fn()
            else:
                after.extend(cleanup)
        return entry

    def _write_page(
        self, key: str, data: Any, n: int, old: DirEntry | None, cleanup: list[Callable[[], None]]
    ) -> DirEntry | None:
        old_pool = self.pool_holding(old) if old is not None else None
        if n == 0:
            entry = DirEntry(self.node_id, 0, 0, 0, self._next_generation(), incarnation=self.incarnation)
            pool = None
        else:
            try:
                pool = self.pool_for(n)
            except ValueError:
                return None  # larger than the pool can ever hold
            loc = pool.set(key, data, hold_replaced=True)
            if loc is None:
                return None
            if loc.replaced is not None:
                cleanup.append(functools.partial(pool.release, loc.replaced))
            entry = DirEntry(self.node_id, loc.addr, loc.rkey, loc.length, loc.generation, incarnation=self.incarnation)
        if old_pool is not None and old_pool is not pool:
            # The old page lives in another size class: unpublish it after the switch.
            cleanup.append(functools.partial(self._drop_older, old_pool, key, entry.generation))
        with self._lock:
            cur = self._entries.get(key)
            if cur is None or cur.generation <= entry.generation:  # a concurrent newer write wins
                self._entries[key] = entry
        if self.disk is not None and n:
            self.disk.write_async(key, data)
        return entry

    @staticmethod
    def _drop_older(pool: PublishedPool, key: str, generation: int) -> None:
        loc = pool.location(key, touch=False)
        if loc is not None and loc.generation < generation:
            pool.delete(key)

    def publish_many(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Store each page in the published pool and PUT its location to the key's owners.

        A page counts as stored when it is in the pool and at least one owner took its
        entry. Runtime complexity: ``O(total bytes)`` plus one RPC per owner.
        """
        t0 = time.perf_counter()
        stored: list[tuple[int, str, DirEntry]] = []
        ok = [False] * len(keys)
        after: list[Callable[[], None]] = []  # frees replaced slots once the directory switched
        try:
            for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
                entry = self._store_local(key, page, after)
                if entry is not None:
                    stored.append((i, key, entry))
            if stored:
                acks = self.directory.batch_put([(k, e) for _, k, e in stored])
                for (i, _, _), a in zip(stored, acks, strict=True):
                    ok[i] = a > 0
        finally:
            for fn in after:
                fn()
        self._drain_evictions()
        nbytes = sum(e.length for _, _, e in stored)
        self.metrics.record_write(len(stored), nbytes, time.perf_counter() - t0)
        return ok

    def delete_all(self) -> int:
        """Unpublish every page of this node (pools, disk and directory). Returns the count.
        Runtime complexity: ``O(pages * classes)`` plus one RPC per owner."""
        with self._lock:
            entries, self._entries = self._entries, {}
            pools = list(self._pools.values())
        for key in entries:
            for pool in pools:
                pool.delete(key)
            if self.disk is not None:
                self.disk.delete(key)
        self.directory.batch_delete([(k, self.node_id, e.generation) for k, e in entries.items()])
        return len(entries)

    # ------------------------------------------------------------------ promote
    def promote_local(self, key: str) -> DirEntry | None:
        """Bring ``key``'s page from the disk tier back into its pool and PUT the fresh
        entry; the entry, or ``None`` when the page is not on disk (or there is no disk).
        Runtime complexity: ``O(page bytes)`` plus one RPC per owner."""
        if self.disk is None:
            return None
        after: list[Callable[[], None]] = []
        try:
            entry = self.disk.promote(key, lambda k, d: self._store_local(k, d, after))
            if entry is None:
                return None
            self.metrics.record_promote()
            self.directory.put(key, entry)
        finally:
            for fn in after:
                fn()
        self._drain_evictions()
        return entry

    def handle_promote(self, keys: list[Any]) -> list[Any]:
        """``data_promote``: each key's resident entry (promoted from disk if need be) as
        wire lists, ``None`` where the page is gone. Runtime complexity: ``O(keys)`` plus
        a promote per disk-resident key."""
        out: list[Any] = []
        for key in keys:
            if not isinstance(key, str):
                raise ValueError("data_promote takes a list of keys")
            cur = self.entry(key)
            if cur is not None and cur.resident:
                out.append(cur.to_wire())
                continue
            e = self.promote_local(key)
            out.append(None if e is None else e.to_wire())
        return out

    def warm_local(self, key: str) -> None:
        """Start promoting ``key``'s page from the disk tier in the background (best effort,
        failures counted as ``disk_warm``). Runtime complexity: ``O(1)``."""
        if self.disk is not None:
            self.disk.warm(key, functools.partial(self._guard, "disk_warm", self._store_local))

    def close(self) -> None:
        """Close the disk tier. Idempotent."""
        if self.disk is not None:
            self.disk.close()
