"""``MooncakeStorage``: Mooncake Store as an L3 backend, over the
``mooncake-transfer-engine`` wheel (``mooncake-transfer-engine-non-cuda`` without CUDA;
pinned in ``requirements/mooncake.txt``; the wheel's libraries need ``libibverbs1`` from
apt even when no RDMA is used).

Registered as ``"mooncake"``::

    create_backend("mooncake", StorageConfig(extra_config={
        "master_server_addr": "10.0.0.1:50051", "global_segment_size": "4GiB"}))

Options (keyword arguments or ``extra_config``):

======================== ==============================================================
``master_server_addr``   ``host:port`` of the ``mooncake_master`` RPC service (required)
``metadata_server``      ``"P2PHANDSHAKE"`` (default: clients exchange segment metadata
                         among themselves) or a metadata server URL (``http://...``)
``local_hostname``       the address other clients reach this one at (default:
                         ``127.0.0.1`` for a loopback master, else the address of the
                         default route's interface)
``protocol``             ``"tcp"`` (default) or ``"rdma"`` (with ``rdma_devices``)
``global_segment_size``  bytes of memory this client lends to the store (default: 1 GiB,
                         or ``capacity_bytes`` with room above the master's eviction mark)
``local_buffer_size``    Mooncake's own client buffer (default 16 MiB; unused by the
                         calls made here, which move bytes from registered memory)
``capacity_bytes``       a bound on the bytes *this backend* keeps in the store: past it,
                         its least recently read or written pages are removed (LRU)
``max_batch_keys``       keys per Mooncake batch call (default 512: larger TCP batches
                         were seen to miss pages that are stored)
``connect_timeout_s``    how long to wait for the master's port before giving up (5 s)
``force_remove``         replace and evict pages even under a reader's lease (default
                         False; only safe where no read can be in flight meanwhile, as
                         in the simulator's single-threaded replay)
======================== ==============================================================

Semantics, on top of :class:`~hiradix.storage.base.StorageBackend`:

- **Zero copy against the host pool.** :meth:`register_mem_pool_host` registers a
  page-first pool with the Mooncake client, and the v1 calls hand Mooncake raw page
  addresses: ``batch_put_from`` writes straight from the pool's pages and
  ``batch_get_into`` reads straight into them. Other buffers (``batch_set`` of bytes,
  ``layer_first`` pools) go through a registered staging buffer, one copy each way.
- **Full-width keys.** Keys are Mooncake object keys as given (up to 255 bytes), never
  cut or hashed again; ``batch_is_exist`` answers ``batch_exists`` in one call.
- **Writes replace, readers never see freed memory.** Mooncake's put keeps the first
  version of a key, and its upsert frees the old version under readers in flight (a
  read racing an upsert here returned another key's page). So a stored key is first
  removed *without* force, which Mooncake refuses while a reader's lease (10 s by default)
  holds it (``batch_is_exist`` and reads take one): that write is then ``False``. LRU
  removals are unforced the same way (``force_remove`` forces both). A key
  repeated within one batch is sent once (Mooncake's batch calls mix up repeats).
- **Every failure is a miss.** A negative Mooncake status, a page of another length
  (Mooncake reports the stored length), a master that went away: ``False`` / a miss,
  counted in :meth:`get_stats` when it is an error rather than an absent key.
- **Empty pages.** Mooncake stores no zero-length object, so an empty page is stored as a
  one-byte object, and a one-byte page is refused (``False``): no KV page is one byte, and
  the two would otherwise be told apart by nothing.
- **Usage** counts the pages this backend instance wrote and has not seen disappear
  (other clients' pages are not counted; Mooncake may evict pages on its own, which then
  read as misses and leave the count). :meth:`clear` empties the whole store, every
  client's pages, as SGLang's clear does.

:class:`MooncakeMaster` starts a private ``mooncake_master`` bound to 127.0.0.1 on free
ports (tests, the simulator, benchmarks).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hiradix.net.address import default_advertise_host, is_loopback
from hiradix.settings import ConfigError, parse_size
from hiradix.storage.base import Capabilities, StorageBackend, StorageConfig, StorageError, memoryview_of, option_value

__all__ = ["MOONCAKE_INSTALL_HINT", "MooncakeMaster", "MooncakeStorage", "mooncake_available"]

log = logging.getLogger(__name__)

MOONCAKE_INSTALL_HINT = (
    "install it with `pip install -r requirements/mooncake.txt` (and `apt-get install -y libibverbs1`, "
    "which the wheel's libraries link against even without RDMA)"
)

# Mooncake's status codes that are answers rather than failures.
_OBJECT_NOT_FOUND = -704
_OBJECT_HAS_LEASE = -706  # a reader holds the page: it cannot be removed yet
_REPLICA_NOT_READY = -703  # a write of the key is in flight: not readable yet
_INVALID_PARAMS = -600  # batch_get_into: the stored object is larger than the buffer
_NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the segments are full (the master evicts later)
_ABSENT = {_OBJECT_NOT_FOUND, _REPLICA_NOT_READY}
_QUIET = _ABSENT | {_INVALID_PARAMS}
# Removal answers: gone already, held by a reader's lease, or being written by another
# writer right now (the write that meets one of the last two is refused, not an error).
_BUSY = {_OBJECT_NOT_FOUND, _OBJECT_HAS_LEASE, _REPLICA_NOT_READY}

_EMPTY_MARK = 1  # stored length of an empty page (module docstring)
_SEGMENT_SLACK = 1.25  # segment over capacity_bytes: the master starts evicting at 90%


def mooncake_available() -> str | None:
    """``None`` when ``mooncake.store`` imports, else why it does not (the import error)."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing shared library
        return f"{type(exc).__name__}: {exc}"
    return None


def _address(view: memoryview) -> int:
    """The address of a flat byte view's first byte (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _host_port(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StorageError(f"{what} must be 'host:port', got {addr!r}")
    return host.strip("[]"), int(port)


class _Staging:
    """Registered buffers for pages that live in unregistered memory. Each caller takes
    one for the duration of a batch, so threads never share one; at most ``keep`` idle
    buffers stay registered."""

    def __init__(self, client: Any, keep: int = 4) -> None:
        self._client = client
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._all: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        """A registered buffer of at least ``nbytes``: an idle one, else a new one (a power
        of two, at least 1 MiB). ``O(idle buffers)`` plus a registration when new."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        size = max(1 << 20, 1 << max(0, nbytes - 1).bit_length())
        buf = np.empty(size, dtype=np.uint8)
        rc = self._client.register_buffer(int(buf.ctypes.data), size)
        if rc != 0:
            raise OSError(f"mooncake register_buffer of {size} staging bytes returned {rc}")
        with self._lock:
            self._all.append(buf)
        return buf

    def release(self, buf: np.ndarray) -> None:
        """Give ``buf`` back; the smallest idle buffer is unregistered past ``keep``."""
        drop = None
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.sort(key=lambda b: b.nbytes)
                drop = self._free.pop(0)
                self._all = [b for b in self._all if b is not drop]
        if drop is not None:
            self._client.unregister_buffer(int(drop.ctypes.data))

    def close(self) -> None:
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for buf in bufs:
            with contextlib.suppress(Exception):  # closing: the client may be gone already
                self._client.unregister_buffer(int(buf.ctypes.data))


class MooncakeStorage(StorageBackend):
    """Mooncake Store as a :class:`StorageBackend` (module docstring).

    Raises :class:`StorageError` when the wheel is not installed, the master does not
    answer within ``connect_timeout_s``, or Mooncake's ``setup`` fails.
    """

    name: ClassVar[str] = "mooncake"
    capabilities = Capabilities(supports_v1=True, zero_copy=True, persistent=False, shared=True)

    def __init__(
        self,
        config: StorageConfig | None = None,
        *,
        master_server_addr: str | None = None,
        metadata_server: str | None = None,
        local_hostname: str | None = None,
        protocol: str | None = None,
        rdma_devices: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        capacity_bytes: int | None = None,
        max_batch_keys: int | None = None,
        connect_timeout_s: float | None = None,
        force_remove: bool | None = None,
    ) -> None:
        super().__init__(config)
        c = self.config
        master = option_value(c, master_server_addr, "master_server_addr", None)
        if not master:
            raise StorageError("the mooncake backend needs master_server_addr ('host:port' of mooncake_master)")
        host, port = _host_port(master, "master_server_addr")
        cap = option_value(c, capacity_bytes, "capacity_bytes", None)
        try:
            cap = None if cap is None else parse_size(cap, "capacity_bytes")
            seg = option_value(c, global_segment_size, "global_segment_size", None)
            if seg is None:
                seg = 1 << 30 if cap is None else int(cap * _SEGMENT_SLACK) + (16 << 20)
            seg = parse_size(seg, "global_segment_size")
            local_buf = parse_size(
                option_value(c, local_buffer_size, "local_buffer_size", 16 << 20), "local_buffer_size"
            )
        except ConfigError as exc:
            raise StorageError(str(exc)) from None
        if cap is not None and cap < 1:
            raise StorageError(f"capacity_bytes must be a positive size or None, got {cap!r}")
        batch = int(option_value(c, max_batch_keys, "max_batch_keys", 512))
        if batch < 1:
            raise StorageError(f"max_batch_keys must be >= 1, got {batch}")
        timeout = float(option_value(c, connect_timeout_s, "connect_timeout_s", 5.0))
        proto = str(option_value(c, protocol, "protocol", "tcp"))
        if proto not in ("tcp", "rdma"):
            raise StorageError(f"protocol must be 'tcp' or 'rdma', got {proto!r}")
        hostname = option_value(c, local_hostname, "local_hostname", None)
        if hostname is None:
            hostname = "127.0.0.1" if is_loopback(host) else default_advertise_host("0.0.0.0")
        why = mooncake_available()
        if why is not None:
            raise StorageError(f"the mooncake backend needs the Mooncake wheel ({why}); {MOONCAKE_INSTALL_HINT}")
        # Mooncake's setup retries an absent master for about a minute and a half: find out
        # first, within the timeout, whether anything listens there.
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as exc:
            raise StorageError(f"mooncake master {master} does not answer: {exc}") from None
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        client = MooncakeDistributedStore()
        rc = client.setup(
            str(hostname),
            str(option_value(c, metadata_server, "metadata_server", "P2PHANDSHAKE")),
            seg,
            local_buf,
            proto,
            str(option_value(c, rdma_devices, "rdma_devices", "")),
            f"{host}:{port}",
        )
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise StorageError(f"mooncake setup against master {master} returned {rc}")
        self.client: Any = client
        self.master_server_addr = f"{host}:{port}"
        self.capacity_bytes: int | None = cap
        self.global_segment_size = seg
        self.max_batch_keys = batch
        self.force_remove = bool(option_value(c, force_remove, "force_remove", False))
        self._replicate = ReplicateConfig()
        self._staging = _Staging(client)
        self._pool_region: tuple[int, int] | None = None  # [lo, hi) of the registered host pool
        self._index: OrderedDict[str, int] = OrderedDict()  # pages this instance stored, LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ host pool
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach the host pool; a pool whose pages are runs of it (page-first in
        hiradix's byte order: :attr:`HostKVPool.pages_in_place`) is registered with the
        Mooncake client (the previous pool unregistered) so the v1 calls move its pages
        without a copy. ``O(1)`` plus Mooncake's registration."""
        super().register_mem_pool_host(mem_pool_host)
        if self._pool_region is not None:
            self.client.unregister_buffer(self._pool_region[0])
            self._pool_region = None
        if getattr(mem_pool_host, "pages_in_place", False):
            rows = mem_pool_host.pages_array()
            lo = int(rows.ctypes.data)
            rc = self.client.register_buffer(lo, int(rows.nbytes))
            if rc == 0:
                self._pool_region = (lo, lo + int(rows.nbytes))
            else:  # still correct through the staging buffers, one copy more
                log.warning("mooncake: registering the host pool returned %d: v1 goes through staging", rc)

    def _registered(self, addr: int, n: int) -> bool:
        r = self._pool_region
        return r is not None and r[0] <= addr and addr + n <= r[1]

    # ------------------------------------------------------------------ Mooncake calls
    def _batched(self, fn: Any, keys: list[str], addrs: list[int], sizes: list[int], *extra: Any) -> list[int]:
        """``fn`` over ``max_batch_keys`` keys at a time; one status per key."""
        out: list[int] = []
        step = self.max_batch_keys
        for s in range(0, len(keys), step):
            rc = fn(keys[s : s + step], addrs[s : s + step], sizes[s : s + step], *extra)
            if len(rc) != len(keys[s : s + step]):
                raise OSError(f"mooncake returned {len(rc)} statuses for {len(keys[s : s + step])} keys")
            out += rc
        return out

    def _note_errors(self, op: str, keys: Sequence[str], codes: Sequence[int], quiet: set[int]) -> None:
        # Absent keys and length mismatches are answers; anything else is a failure worth a
        # count and one log line per batch.
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0 and c not in quiet]
        if bad:
            self._count(errors=len(bad))
            log.warning(
                "%s: %s of %d key(s) failed, treated as misses: first %r -> %d", self.name, op, len(bad), *bad[0]
            )

    def _touch(self, keys: Sequence[str], hits: Sequence[bool], gone: Sequence[bool]) -> None:
        """Refresh the recency of hit pages this instance stored; forget ones Mooncake no
        longer has."""
        with self._lock:
            idx = self._index
            for key, hit, absent in zip(keys, hits, gone, strict=True):
                if key not in idx:
                    continue
                if hit:
                    idx.move_to_end(key)
                elif absent:
                    self._bytes -= idx.pop(key)

    # ------------------------------------------------------------------ primitives
    def _exists(self, key: str) -> bool:
        """One ``batch_is_exist`` round trip."""
        return self._exists_many([key]) == 1

    def _exists_many(self, keys: list[str]) -> int:
        """Leading present keys, from ``batch_is_exist`` (``max_batch_keys`` a call, stopping
        at the first batch with a miss). A failing lookup (-1) is the first miss."""
        n = 0
        step = self.max_batch_keys
        for s in range(0, len(keys), step):
            part = keys[s : s + step]
            codes = self.client.batch_is_exist(part)
            for key, code in zip(part, codes, strict=True):
                if code != 1:
                    if code < 0:
                        self._failed("exists", key, OSError(f"mooncake batch_is_exist status {code}"))
                    return n
                n += 1
        return n

    def _size(self, key: str) -> int | None:
        """``get_size``, the empty-page mark read as 0. One round trip."""
        size = int(self.client.get_size(key))
        if size in _ABSENT:
            return None
        if size < 0:
            raise OSError(f"mooncake get_size status {size}")
        return 0 if size == _EMPTY_MARK else size

    def _get_into(self, key: str, out: memoryview) -> bool:
        return self._get_many_into([key], [out])[0]

    def _get_many_at(self, keys: list[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any) -> list[bool] | None:
        """The page-first v1 get: ``batch_get_into`` straight into the registered pool
        (``None``, the view path, when the pool is not registered). ``O(pages)`` Python."""
        if not keys:
            return []
        lo, hi = int(addrs.min()), int(addrs.max()) + int(lengths.max())
        if not self._registered(lo, hi - lo) or int(lengths.min()) <= _EMPTY_MARK:
            return None
        return self._fetch(keys, addrs.tolist(), lengths.tolist())

    def _fetch(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[bool]:
        """``batch_get_into`` of pages of ``sizes[i] > 1`` bytes into registered memory at
        ``addrs``. A key asked twice is fetched once and copied (Mooncake's batch calls
        mix up repeated keys). ``O(pages)`` Python plus the transfer."""
        first: dict[str, int] = {}
        repeats: list[tuple[int, int]] = []
        for i, k in enumerate(keys):
            j = first.setdefault(k, i)
            if j != i:
                repeats.append((i, j))
        todo = list(first.values()) if repeats else list(range(len(keys)))
        ks = [keys[i] for i in todo]
        ns = [sizes[i] for i in todo]
        codes = self._batched(self.client.batch_get_into, ks, [addrs[i] for i in todo], ns)
        got = [c == n for c, n in zip(codes, ns, strict=True)]
        self._note_errors("get", ks, codes, _QUIET)
        self._touch(ks, got, [c == _OBJECT_NOT_FOUND for c in codes])
        if not repeats:
            return got
        hits = [False] * len(keys)
        for i, hit in zip(todo, got, strict=True):
            hits[i] = hit
        for i, j in repeats:
            if hits[j] and sizes[i] == sizes[j]:
                ctypes.memmove(addrs[i], addrs[j], sizes[i])
                hits[i] = True
        return hits

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """Reads into the host pool's registered memory go straight there; others land in
        a staging buffer and are copied out on a hit. ``O(total bytes)``."""
        results = [False] * len(keys)
        todo: list[int] = []
        staged: list[int] = []
        addrs = [0] * len(keys)
        for i, out in enumerate(outs):
            n = len(out)
            if n == 0:  # an empty page is the one-byte mark (module docstring)
                try:
                    results[i] = self._size(keys[i]) == 0
                except Exception as exc:  # this key's miss, not the batch's
                    self._failed("get", keys[i], exc)
            elif n != _EMPTY_MARK:  # no one-byte page is ever stored
                addrs[i] = _address(out)
                todo.append(i)
                if not self._registered(addrs[i], n):
                    staged.append(i)
        if not todo:
            return results
        buf = self._staging.acquire(sum(len(outs[i]) for i in staged)) if staged else None
        try:
            offsets: dict[int, int] = {}
            if buf is not None:
                base, off = int(buf.ctypes.data), 0
                for i in staged:
                    offsets[i] = off
                    addrs[i], off = base + off, off + len(outs[i])
            hits = self._fetch([keys[i] for i in todo], [addrs[i] for i in todo], [len(outs[i]) for i in todo])
            for i, hit in zip(todo, hits, strict=True):
                results[i] = hit
                if hit and buf is not None and i in offsets:
                    start = offsets[i]
                    outs[i][:] = memoryview_of(buf)[start : start + len(outs[i])]
        finally:
            if buf is not None:
                self._staging.release(buf)
        return results

    def _put(self, key: str, data: memoryview) -> bool:
        return self._put_many([key], [data])[0]

    def _put_many_at(self, keys: list[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any) -> list[bool] | None:
        """The page-first v1 set: ``batch_put_from`` straight from the registered pool
        (``None``, the view path, when it is not registered)."""
        if not keys:
            return []
        lo, hi = int(addrs.min()), int(addrs.max()) + int(lengths.max())
        if not self._registered(lo, hi - lo) or int(lengths.min()) <= _EMPTY_MARK:
            return None
        return self._store(keys, addrs.tolist(), lengths.tolist())

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """Pages in the registered host pool are written from where they are; the rest are
        copied into a staging buffer first. ``O(total bytes)``."""
        results = [False] * len(keys)
        addrs = [0] * len(keys)
        sizes = [len(v) for v in views]
        todo: list[int] = []
        staged: list[int] = []
        for i, view in enumerate(views):
            n = sizes[i]
            if n == _EMPTY_MARK:
                continue  # refused: indistinguishable from an empty page's mark
            if n == 0:
                sizes[i] = _EMPTY_MARK
                staged.append(i)
            else:
                addrs[i] = _address(view)
                if not self._registered(addrs[i], n):
                    staged.append(i)
            todo.append(i)
        buf = self._staging.acquire(sum(sizes[i] for i in staged)) if staged else None
        try:
            if buf is not None:
                mv, base, off = memoryview_of(buf), int(buf.ctypes.data), 0
                for i in staged:
                    n = sizes[i]
                    if len(views[i]) == 0:
                        mv[off] = 0
                    else:
                        mv[off : off + n] = views[i]
                    addrs[i], off = base + off, off + n
            oks = self._store([keys[i] for i in todo], [addrs[i] for i in todo], [sizes[i] for i in todo])
        finally:
            if buf is not None:
                self._staging.release(buf)
        for i, ok in zip(todo, oks, strict=True):
            results[i] = ok
        return results

    def _store(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[bool]:
        """Store pages from registered memory, replacing older versions, then keep the LRU
        bound. ``O(pages + evicted)`` Python and up to three Mooncake round trips.

        Mooncake's put keeps the first version of a key and its upsert frees the old
        version under readers (a read racing it was seen to return another key's page),
        so each key is first removed, *without* force unless ``force_remove``: a page read
        or found by ``batch_is_exist`` within Mooncake's lease (10 s by default) refuses,
        and that write is ``False`` rather than a reader's wrong bytes. (Removing a key
        that is not stored is one cheap "not found" in the same round trip.) A key given
        twice is stored once, from its last page.
        """
        cap = self.capacity_bytes
        last = {k: i for i, k in enumerate(keys) if cap is None or sizes[i] <= cap}
        if not last:
            return [False] * len(keys)
        ks = self._remove_old(list(last))
        codes = self._batched(
            self.client.batch_put_from, ks, [addrs[last[k]] for k in ks], [sizes[last[k]] for k in ks], self._replicate
        )
        self._note_errors("set", ks, codes, {_NO_SPACE})
        stored = [k for k, c in zip(ks, codes, strict=True) if c == 0]
        victims = self._index_stored([(k, sizes[last[k]]) for k in stored])
        if victims:
            self._evict(victims)
        done = set(stored)
        return [k in done for k in keys]

    def _remove_old(self, ks: list[str]) -> list[str]:
        """Remove the stored versions of ``ks`` (see :meth:`_store`); the keys that may be
        written, those whose removal was not refused."""
        # Unforced unless configured: a page under a reader's lease refuses, and is kept.
        rm = self._batched_keys(lambda part: self.client.batch_remove(part, self.force_remove), ks)
        self._note_errors("replace", ks, rm, _BUSY)
        refused = {k for k, c in zip(ks, rm, strict=True) if c not in (0, _OBJECT_NOT_FOUND)}
        self._forget(k for k, c in zip(ks, rm, strict=True) if c == 0)
        return [k for k in ks if k not in refused]

    def _index_stored(self, stored: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Index the pages just stored, ``(key, bytes)`` in write order (the LRU order),
        then take the least recently used off the index until the bytes fit the capacity;
        those victims, for :meth:`_evict`."""
        cap = self.capacity_bytes
        victims: list[tuple[str, int]] = []
        with self._lock:
            idx = self._index
            for k, n in stored:
                old = idx.pop(k, None)
                self._bytes += n - (old or 0)
                idx[k] = n
            if cap is not None:
                while idx and self._bytes > cap:
                    victims.append(idx.popitem(last=False))
                    self._bytes -= victims[-1][1]
        return victims

    def _batched_keys(self, fn: Any, keys: list[str]) -> list[int]:
        out: list[int] = []
        step = self.max_batch_keys
        for s in range(0, len(keys), step):
            rc = list(fn(keys[s : s + step]))
            if len(rc) != len(keys[s : s + step]):
                raise OSError(f"mooncake returned {len(rc)} statuses for {len(keys[s : s + step])} keys")
            out += rc
        return out

    def _forget(self, keys: Any) -> None:
        with self._lock:
            for k in keys:
                n = self._index.pop(k, None)
                if n is not None:
                    self._bytes -= n

    def _evict(self, victims: list[tuple[str, int]]) -> None:
        """Remove LRU victims ``(key, bytes)`` from the store, unforced unless
        ``force_remove`` (see :meth:`_store`): one a reader holds a lease on goes back to the LRU end of the
        index, still counted, and is tried again at the next write's eviction."""
        keys = [k for k, _ in victims]
        codes = self._batched_keys(lambda part: self.client.batch_remove(part, self.force_remove), keys)
        self._note_errors("evict", keys, codes, _BUSY)
        kept = [v for v, c in zip(victims, codes, strict=True) if c not in (0, _OBJECT_NOT_FOUND)]
        self._count(evictions=len(victims) - len(kept))
        if kept:
            with self._lock:
                for k, n in reversed(kept):
                    if k not in self._index:  # not written again meanwhile
                        self._index[k] = n
                        self._index.move_to_end(k, last=False)
                        self._bytes += n

    def _clear(self) -> None:
        rc = self.client.remove_all(True)
        if rc < 0:
            raise StorageError(f"mooncake remove_all returned {rc}")
        with self._lock:
            self._index.clear()
            self._bytes = 0

    def _usage(self) -> tuple[int, int, int | None]:
        with self._lock:
            return len(self._index), self._bytes, self.capacity_bytes

    def _extra_stats(self) -> dict[str, Any]:
        return {"master": self.master_server_addr, "global_segment_size": self.global_segment_size}

    def close(self) -> None:
        """Unregister the buffers and close the Mooncake client (its segment leaves the
        store with it). Idempotent. ``O(staging buffers)`` plus Mooncake's teardown."""
        if self._closed:
            return
        self._closed = True
        self._staging.close()
        if self._pool_region is not None:
            with contextlib.suppress(Exception):
                self.client.unregister_buffer(self._pool_region[0])
            self._pool_region = None
        rc = self.client.close()
        if rc != 0:
            log.warning("mooncake: close returned %s", rc)

    def __repr__(self) -> str:
        return f"MooncakeStorage(master={self.master_server_addr!r}, capacity_bytes={self.capacity_bytes})"


# ----------------------------------------------------------------------------- master
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def master_binary() -> Path:
    """The ``mooncake_master`` executable shipped in the wheel (``StorageError`` without
    the wheel)."""
    why = mooncake_available()
    if why is not None:
        raise StorageError(f"mooncake_master needs the Mooncake wheel ({why}); {MOONCAKE_INSTALL_HINT}")
    import mooncake

    exe = Path(mooncake.__file__).resolve().parent / "mooncake_master"
    if not exe.is_file():
        raise StorageError(f"the Mooncake wheel has no mooncake_master at {exe}")
    if not os.access(exe, os.X_OK):
        exe.chmod(exe.stat().st_mode | 0o111)
    return exe


class MooncakeMaster:
    """A ``mooncake_master`` of this process's own, bound to 127.0.0.1 on free ports (RPC
    and metrics; no HTTP metadata server, clients use the P2P handshake), torn down by
    :meth:`close` with bounded waits. ``addr`` is its ``host:port``.

    ``log_path`` receives its output (default: discarded). ``start_timeout_s`` bounds the
    wait for its RPC port; a port taken in the meantime is retried with new ports, at most
    ``attempts`` times.
    """

    def __init__(
        self,
        *,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 30.0,
        attempts: int = 3,
        extra_args: Sequence[str] = (),
    ) -> None:
        exe = master_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - closed in close()
        last = ""
        for _ in range(max(1, attempts)):
            rpc, metrics = _free_port(), _free_port()
            cmd = [
                str(exe),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
                "--enable_http_metadata_server=false",
                "--rpc_thread_num=2",
                *extra_args,
            ]
            out = self._log if self._log is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_listening(rpc, start_timeout_s):
                self.addr = f"127.0.0.1:{rpc}"
                self.metrics_port = metrics
                return
            last = f"exited with {self.proc.poll()}" if self.proc.poll() is not None else "did not listen in time"
            self._stop()
        self.close()
        raise StorageError(f"mooncake_master did not start on 127.0.0.1: {last}")

    def _wait_listening(self, port: int, timeout_s: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded by the deadline
            if self.proc.poll() is not None:
                return False
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return True
            except OSError:
                time.sleep(0.05)  # polling a child's startup; nothing to wait on instead
        return False

    def _stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)

    def close(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after 10 s; at most 20 s). Idempotent."""
        self._stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
