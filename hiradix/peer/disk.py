"""Optional L4 disk tier under the published pool.

Pages are written through to local disk by one background thread as they are published, so
when the pool evicts a page the producer can keep its directory entry (marked non-resident)
instead of deleting it, and bring the page back on demand (:meth:`DiskTier.promote`: one
file read plus the pool's one memcpy). The tier is LRU-bounded by ``capacity_bytes``; a page
leaving the disk is reported through ``on_evict`` so the store can delete the directory entry
if the pool no longer holds the page either.

Page file (``<disk_path>/<2 hex>/<32 hex>.page``, named by a BLAKE2b-128 digest of the key)::

    offset  size  field
    0       4     magic b"HRXD"
    4       2     format version (1)
    6       2     flags (0)
    8       4     key length K
    12      8     data length D
    20      4     CRC-32 (zlib) of bytes 0..19, the key and the data
    24      8     reserved (0)
    32      K     key (UTF-8)
    32+K    D     data

Files are written to a temporary name and renamed into place, so a crash leaves either the
old file, the new file or a stray ``.tmp`` (removed at start-up); a torn or corrupt file
fails the CRC and reads as a miss (and is removed). ``fsync`` is off by default: this is a
cache, and the CRC turns any loss into a miss.

If ``disk_path`` cannot be created or written, the tier is disabled with a ``RuntimeWarning``
and every operation is a cheap no-op (the store then deletes directory entries on pool
eviction, as without a disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["DISK_MAGIC", "DiskTier", "decode_page_file", "encode_page_file"]

log = logging.getLogger(__name__)

DISK_MAGIC = b"HRXD"
DISK_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")  # 20 bytes, covered by the CRC
_HEADER = struct.Struct("<20sI8x")  # prefix, crc, reserved -> 32 bytes
_SUFFIX = ".page"

T = TypeVar("T")


def encode_page_file(key: str, data: Any) -> bytes:
    """Header + key + data as stored on disk. Runtime complexity: ``O(len(data))``.

    >>> decode_page_file(encode_page_file("k", b"abc"), "k")
    b'abc'
    """
    kb = key.encode("utf-8")
    view = memoryview(data).cast("B")
    prefix = _PREFIX.pack(DISK_MAGIC, DISK_VERSION, 0, len(kb), view.nbytes)
    crc = zlib.crc32(view, zlib.crc32(kb, zlib.crc32(prefix)))
    return b"".join((_HEADER.pack(prefix, crc), kb, view))


def _parse_header(head: bytes) -> tuple[int, int, int] | None:
    if len(head) < _HEADER.size:
        return None
    prefix, crc = _HEADER.unpack_from(head)
    magic, version, _flags, klen, dlen = _PREFIX.unpack(prefix)
    if magic != DISK_MAGIC or version != DISK_VERSION:
        return None
    return klen, dlen, crc


def decode_page_file(blob: bytes, key: str | None = None) -> bytes | None:
    """The data of a page file, or ``None`` if torn, corrupt, or (when given) not ``key``'s.

    Runtime complexity: ``O(len(blob))``.
    """
    parsed = _parse_header(blob)
    if parsed is None:
        return None
    klen, dlen, crc = parsed
    h = _HEADER.size
    if len(blob) != h + klen + dlen:
        return None
    kb = blob[h : h + klen]
    if key is not None and kb != key.encode("utf-8"):
        return None
    data = blob[h + klen :]
    if zlib.crc32(data, zlib.crc32(kb, zlib.crc32(blob[:20]))) != crc:
        return None
    return data


class DiskTier:
    """LRU-bounded page files with an asynchronous write-through queue.

    Parameters
    ----------
    path:
        Directory for page files (created if missing). Unusable: tier disabled, warning.
    capacity_bytes:
        Total size of page files (headers included) kept on disk.
    queue_depth:
        Bound of the background queue. When it is full, ``write_async`` drops the write and
        counts it in :attr:`dropped_writes` rather than stall the producer's ``set``.
    on_evict:
        ``on_evict(key)``, called from the tier's thread or the caller of :meth:`read` when a
        page leaves the disk (LRU, corruption, or a failed write). Not called for
        :meth:`delete`.
    fsync:
        ``fsync`` each file before renaming it into place.

    All public methods are thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        queue_depth: int = 256,
        on_evict: Callable[[str], None] | None = None,
        fsync: bool = False,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self._on_evict = on_evict
        self._fsync = fsync
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._pending: dict[str, int] = {}  # key -> token of its queued write
        self._token = 0
        self._inflight = 0  # jobs queued or running
        self._used = 0
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=queue_depth)
        # counters (read freely; updated under the lock)
        self.writes = self.write_bytes = self.dropped_writes = self.write_errors = 0
        self.reads = self.read_bytes = self.corrupt = self.evictions = self.promotes = 0
        self.disabled_reason: str | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}-{id(self)}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            self.disabled_reason = f"disk_path {str(self.path)!r} is unusable: {exc}"
            warnings.warn(f"disk tier disabled: {self.disabled_reason}", RuntimeWarning, stacklevel=2)
            self._thread: threading.Thread | None = None
            return
        self._scan()
        self._thread = threading.Thread(target=self._run, name=f"hiradix-disk-{self.path.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state
    @property
    def enabled(self) -> bool:
        """Whether the tier is usable (``disk_path`` worked and :meth:`close` not called)."""
        return self._thread is not None

    @property
    def used_bytes(self) -> int:
        """Bytes of page files on disk (headers included)."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        """Keys on disk, least recently used first. Runtime complexity: ``O(n)``."""
        with self._lock:
            return list(self._index)

    def _file(self, key: str) -> Path:
        h = hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()
        return self.path / h[:2] / f"{h}{_SUFFIX}"

    def _scan(self) -> None:
        """Index page files left by a previous run (oldest first by mtime), drop ``.tmp``."""
        found: list[tuple[float, str, int]] = []
        for sub in self.path.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    if f.name.endswith(".tmp"):
                        f.unlink()
                        continue
                    if not f.name.endswith(_SUFFIX):
                        continue
                    with f.open("rb") as fh:
                        head = fh.read(_HEADER.size)
                        parsed = _parse_header(head)
                        if parsed is None:
                            f.unlink()
                            continue
                        klen, dlen, _ = parsed
                        key = fh.read(klen).decode("utf-8")
                    st = f.stat()
                    if st.st_size != _HEADER.size + klen + dlen or self._file(key) != f:
                        f.unlink()
                        continue
                    found.append((st.st_mtime, key, st.st_size))
                except (OSError, UnicodeDecodeError) as exc:
                    log.warning("disk tier: skipping %s: %r", f, exc)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        for key in self._evict_over_capacity_locked():
            log.debug("disk tier: dropped %s at start-up (over capacity)", key)

    # ------------------------------------------------------------------ writes
    def write_async(self, key: str, data: Any) -> bool:
        """Queue a copy of ``data`` to be written as ``key``'s page; never blocks.

        Returns ``False`` when disabled, or when the queue is full (the write is dropped and
        counted). The copy is taken now because the caller's buffer (a pool slot) may be
        reused before the write runs. Runtime complexity: ``O(len(data))`` (the copy).
        """
        if not self.enabled:
            return False
        blob = bytes(memoryview(data).cast("B"))
        with self._lock:
            self._token += 1
            token = self._token
            try:
                self._queue.put_nowait(("write", key, blob, token))
            except queue.Full:
                self.dropped_writes += 1
                return False
            self._pending[key] = token
            self._inflight += 1
        return True

    def _do_write(self, key: str, blob: bytes, token: int) -> None:
        with self._lock:
            if self._pending.get(key) != token:
                return  # deleted, or superseded by a later write of the same key
        path = self._file(key)
        tmp = path.with_name(path.name + ".tmp")
        payload = encode_page_file(key, blob)
        if len(payload) > self.capacity_bytes:
            with self._lock:
                if self._pending.get(key) == token:
                    del self._pending[key]
                self.dropped_writes += 1
            self._notify_evicted([key])
            return
        try:
            path.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as fh:
                fh.write(payload)
                if self._fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk tier: writing %s failed: %r", key, exc)
            with self._lock:
                self.write_errors += 1
                if self._pending.get(key) == token:
                    del self._pending[key]
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._notify_evicted([key])
            return
        with self._lock:
            if self._pending.get(key) != token:
                # Deleted while we wrote. A newer write of the key is queued behind us on this
                # same thread, so removing the file cannot lose it.
                if key not in self._pending:
                    path.unlink(missing_ok=True)
                return
            del self._pending[key]
            self._used += len(payload) - self._index.pop(key, 0)
            self._index[key] = len(payload)
            self.writes += 1
            self.write_bytes += len(blob)
            gone = self._evict_over_capacity_locked()
        self._notify_evicted(gone)

    def _evict_over_capacity_locked(self) -> list[str]:
        gone: list[str] = []
        while self._used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self.evictions += 1
            try:
                self._file(key).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("disk tier: removing %s failed: %r", key, exc)
            gone.append(key)
        return gone

    def _notify_evicted(self, keys: list[str]) -> None:
        if self._on_evict is not None:
            for key in keys:
                self._on_evict(key)

    def delete(self, key: str) -> bool:
        """Remove ``key``'s page (and cancel a queued write). No ``on_evict`` call.

        Runtime complexity: ``O(1)`` plus one unlink.
        """
        with self._lock:
            pending = self._pending.pop(key, None) is not None
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        if size is not None:
            try:
                self._file(key).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("disk tier: removing %s failed: %r", key, exc)
        return pending or size is not None

    # ------------------------------------------------------------------ reads
    def exists(self, key: str) -> bool:
        """Whether ``key`` is on disk or queued to be written. Runtime complexity: ``O(1)``."""
        return key in self._index or key in self._pending

    def read(self, key: str) -> bytes | None:
        """``key``'s page from disk (synchronous), or ``None``; touches it in the LRU.

        A torn or corrupt file is removed, counted in :attr:`corrupt`, reported through
        ``on_evict`` and read as a miss. Runtime complexity: ``O(page)`` I/O.
        """
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._file(key)
        try:
            blob = path.read_bytes()
        except OSError:
            blob = b""
        data = decode_page_file(blob, key)
        if data is None:
            with self._lock:
                size = self._index.pop(key, None)
                if size is None:
                    return None  # deleted or evicted while we read: a plain miss
                self._used -= size
                self.corrupt += 1
            log.warning("disk tier: page file for %s is torn or corrupt; dropped", key)
            path.unlink(missing_ok=True)
            self._notify_evicted([key])
            return None
        with self._lock:
            self.reads += 1
            self.read_bytes += len(data)
        return data

    def promote(self, key: str, sink: Callable[[str, bytes], T]) -> T | None:
        """Read ``key`` and hand it to ``sink(key, data)`` (e.g. ``pool.set``); its result,
        or ``None`` on a miss. Synchronous. Runtime complexity: one :meth:`read` + ``sink``.
        """
        data = self.read(key)
        if data is None:
            return None
        result = sink(key, data)
        with self._lock:
            self.promotes += 1
        return result

    def warm(self, key: str, sink: Callable[[str, bytes], Any]) -> bool:
        """Schedule a best-effort :meth:`promote` on the tier's thread (``exists`` warming).

        Returns whether it was queued (``False``: disabled, not on disk, or queue full).
        Runtime complexity: ``O(1)``.
        """
        if not self.enabled or not self.exists(key):
            return False
        with self._lock:
            try:
                self._queue.put_nowait(("warm", key, sink))
            except queue.Full:
                return False
            self._inflight += 1
        return True

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job[0] == "write":
                    self._do_write(job[1], job[2], job[3])
                else:
                    self.promote(job[1], job[2])
            except Exception:
                # The worker must outlive a failing callback (a store's on_evict or a warm's
                # sink); the failure is logged with its traceback, not swallowed silently.
                log.exception("disk tier: background %s of %s failed", job[0], job[1])
            finally:
                with self._lock:
                    self._inflight -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and warm has run; ``False`` on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish queued work, stop the thread. Files stay on disk for the next run."""
        thread = self._thread
        if thread is None:
            return
        self._queue.put(None)  # after everything already queued
        thread.join(timeout)
        self._thread = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
