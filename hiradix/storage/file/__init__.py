"""Local-disk L3 backend: append-only segment files of self-verifying page records.

Why segments and not one file per page
--------------------------------------
SGLang's ``HiCacheFile`` writes one ``{hash}_{model}_{rank}_{size}.bin`` per page. On
the ext4 disks of our 2-core machines creating a file costs about 0.7 ms, so one file
per page writes 64 KiB pages at about a quarter of the disk's sequential speed
(``bench/RESULTS_storage.md``). Here pages are appended to a few large segment files
(``seg-00000001.hrx`` ..., ``segment_bytes`` each), so a ``batch_set`` is one
``os.pwritev`` of ``[header, key, payload, header, key, payload, ...]`` straight from the
callers' buffers, and a ``batch_get`` of pages that were written together is one
``os.preadv`` of ``[header, payload, ...]`` straight into the targets (host pool pages
for the page-first layouts): no temporary file, no rename, no extra copy. Checksums are
CRC-32 (zlib's polynomial), computed by ISA-L (``isal``, 20+ GB/s) when it is installed
and by ``zlib`` otherwise: the values are the same, so either reads what either wrote.

Record format (little endian)
-----------------------------
``magic "HRXP" | version u16 | flags u16 | key_len u16 | reserved u16 | stored_len u64 |
raw_len u64 | generation u64 | payload_crc32 u32 | header_crc32 u32 | key | payload``.
``header_crc32`` covers the header fields before it and the key; ``payload_crc32``
covers the stored (possibly lz4-compressed, ``flags & 1``) payload. A record is its
own commit record: it exists only if its header checksum verifies, and it is served only
if its payload checksum verifies too, so a torn, truncated or bit-flipped record is a
miss, never wrong bytes. ``generation`` orders writes of the same key: the newest wins,
in memory and when the index is rebuilt.

Restart
-------
A new instance over the same directory scans every segment's headers (not payloads:
restart cost stays proportional to the number of pages, and payloads are verified on
every read anyway) and keeps the newest record of each key. Where a header does not
verify (a bit flip, a torn record, or the hole a failed or unfinished write leaves
between records that concurrent writers appended after it), the scan resyncs: it looks
for the next ``MAGIC`` whose header and key verify and goes on from there, so damage
costs the records it touches, never the rest of the segment. Only the tail after the
last valid record is truncated. A key found more than once (an overwrite, or a
compaction copy) has its newest copy's payload verified before it wins, so a torn newer
write falls back to the older acknowledged page. Segments with no live record are
deleted and appends go to a fresh segment. Recency is rebuilt from generations (the last
*written* is the most recent); reads before a restart are not remembered.

Durability (``fsync`` option)
-----------------------------
``batch_set``/``batch_set_v1`` return ``True`` for a page only once its whole record is
in the file (``pwritev`` returned for all of it), so an acknowledged page survives the
process being killed at any point (``kill -9``: the page cache outlives the process),
whatever other writers were doing. A power loss or kernel crash is another matter:

``"none"`` (default)
    No ``fdatasync``: survives the process, not the machine (the kernel writes dirty
    pages back within about 30 s).
``"batch"``
    Acknowledged as for ``"none"``; a background thread ``fdatasync``-s the written
    segments every ``fsync_interval`` seconds (default 1.0), or sooner once
    ``fsync_bytes`` (default 64 MiB) are waiting: a power loss costs at most that window.
``"always"``
    A call returns only after an ``fdatasync`` covering its pages (group commit:
    concurrent callers share one). If it fails, the pages of that round are reported not
    stored.

In ``"batch"`` and ``"always"`` modes a new segment's directory entry is synced too, and
a segment emptied by overwrites, eviction or compaction is unlinked only after a sync
round, so that the copies that replaced its records are durable first.

Capacity and space
------------------
``capacity_bytes`` bounds the live record bytes; a write past it evicts least recently
read or written pages. Evicted and overwritten records become dead bytes in their
segment: a segment whose records are all dead is deleted, and when dead bytes exceed
``max(segment_bytes, live_bytes / 2)`` the sealed segment with the most dead bytes, if
at least half of it is dead, is compacted (its live records, verified, are appended anew
and it is deleted). Disk use therefore stays below about ``2 x capacity + 2 segments``. An evicted page whose
record has not been reclaimed yet can reappear after a restart; it is still a verified
page of that key.

One process per directory: an ``flock`` on ``LOCK`` enforces it (``StorageError``
otherwise; threads of that process may share the instance). The lock goes with the
process, so a killed process's directory can be reopened at once. With ``tp_size > 1``
each rank uses the subdirectory ``tp{rank}of{size}``.

The parts, one module each (this module composes them into :class:`FileStorage`):
:mod:`~hiradix.storage.file.records` (the record format),
:mod:`~hiradix.storage.file.segments` (segment files, the index, capacity),
:mod:`~hiradix.storage.file.reads` and :mod:`~hiradix.storage.file.writes` (batched
``preadv`` / ``pwritev``), :mod:`~hiradix.storage.file.recovery` (restart),
:mod:`~hiradix.storage.file.durability` (sync rounds) and
:mod:`~hiradix.storage.file.compaction`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import Any, ClassVar

import platformdirs

from hiradix.storage.base import Capabilities, StorageBackend, StorageConfig, StorageError, option_value
from hiradix.storage.file.compaction import Compactor
from hiradix.storage.file.durability import Durability
from hiradix.storage.file.reads import Reader
from hiradix.storage.file.records import CRC32_IMPL, HDR_SIZE, MAGIC
from hiradix.storage.file.recovery import Recovered, recover
from hiradix.storage.file.segments import SegmentTable
from hiradix.storage.file.writes import Writer

__all__ = ["CRC32_IMPL", "DEFAULT_SEGMENT_BYTES", "FSYNC_MODES", "MAGIC", "FileStorage", "default_path"]

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 << 20
FSYNC_MODES = ("none", "batch", "always")
DEFAULT_FSYNC_INTERVAL = 1.0  # seconds, "batch" mode
DEFAULT_FSYNC_BYTES = 64 << 20  # "batch" mode: sync sooner once this much is waiting
_HDR_SIZE = HDR_SIZE  # the record header's size, by the name the file-backend tests use

# The system calls that put bytes on disk, as module attributes: tests replace them to
# inject a full disk, a short write or a failing fsync. The parts call them through the
# two functions below, which look them up here at every call.
_pwritev = os.pwritev
_fdatasync = os.fdatasync


def _write(fd: int, iov: list[Any], offset: int) -> int:
    return _pwritev(fd, iov, offset)


def _sync_fd(fd: int) -> None:
    _fdatasync(fd)


def _positive_int(v: Any, name: str, *, none_ok: bool = False) -> Any:
    """``v`` if it is a positive int (or ``None`` when ``none_ok``), else a ``ValueError``
    naming the option."""
    if v is None and none_ok:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {v!r}")
    return v


def default_path() -> Path:
    """The store's directory when none is given: ``l3`` under the user's cache directory
    (``platformdirs``; ``$XDG_CACHE_HOME/hiradix/l3``, by default ``~/.cache/hiradix/l3``, on
    Linux), not a shared temporary folder that other users can write to."""
    return Path(platformdirs.user_cache_dir("hiradix")) / "l3"


class FileStorage(StorageBackend):
    """Pages in append-only segment files under ``path`` (module docstring).

    Options (keyword, else ``config.extra_config``, else default):

    ``path``
        The directory (created if missing; default :func:`default_path`: ``l3`` in the
        user's cache directory, e.g. ``~/.cache/hiradix/l3`` on Linux).
    ``capacity_bytes``
        Bound on live record bytes, LRU eviction beyond it (default ``None``: unbounded).
    ``compression``
        ``"none"`` (default) or ``"lz4"`` (``lz4.block``; a page that does not shrink is
        stored raw).
    ``fsync``
        ``"none"`` (default), ``"batch"`` or ``"always"`` (module docstring,
        *Durability*); ``True``/``False`` mean ``"always"``/``"none"``.
    ``fsync_interval``, ``fsync_bytes``
        ``"batch"`` mode: the longest a written page waits for its ``fdatasync``
        (seconds, default 1.0), and the waiting bytes that start one sooner (default 64 MiB).
    ``segment_bytes``
        Target size of a segment file (default 256 MiB).

    Thread-safe: one lock guards the index and segment table; reads and writes do their
    I/O outside it. Runtime complexity: ``O(1)`` lookups, ``O(page bytes)`` reads and
    writes, ``O(pages)`` restart.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with FileStorage(path=d) as s:
    ...     s.set("k", b"page")
    True
    >>> with FileStorage(path=d) as s:
    ...     bytes(s.get("k").numpy())
    b'page'
    """

    name: ClassVar[str] = "file"
    capabilities = Capabilities(supports_v1=True, zero_copy=True, persistent=True)

    def __init__(
        self,
        config: StorageConfig | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        capacity_bytes: int | None = None,
        compression: str | None = None,
        fsync: str | bool | None = None,
        fsync_interval: float | None = None,
        fsync_bytes: int | None = None,
        segment_bytes: int | None = None,
    ) -> None:
        super().__init__(config)
        cfg = self.config
        self.capacity_bytes: int | None = _positive_int(
            option_value(cfg, capacity_bytes, "capacity_bytes", None), "capacity_bytes", none_ok=True
        )
        self.segment_bytes: int = _positive_int(
            option_value(cfg, segment_bytes, "segment_bytes", DEFAULT_SEGMENT_BYTES), "segment_bytes"
        )
        self._set_compression(option_value(cfg, compression, "compression", "none") or "none")
        self._set_fsync(
            option_value(cfg, fsync, "fsync", "none"),
            option_value(cfg, fsync_interval, "fsync_interval", DEFAULT_FSYNC_INTERVAL),
            option_value(cfg, fsync_bytes, "fsync_bytes", DEFAULT_FSYNC_BYTES),
        )
        root = Path(option_value(cfg, None if path is None else os.fspath(path), "path", None) or default_path())
        if cfg.tp_size > 1:
            root = root / f"tp{cfg.tp_rank}of{cfg.tp_size}"
        self.path = root
        # The parts, over one segment table and its lock (the module docstring names them).
        self._table = SegmentTable(
            root,
            segment_bytes=self.segment_bytes,
            capacity_bytes=self.capacity_bytes,
            fsync=self.fsync,
            fsync_bytes=self.fsync_bytes,
        )
        self._reader = Reader(self._table, failed=self._failed, count=self._count)
        self._writer = Writer(self._table, pwritev=_write, lz4=self._lz4, failed=self._failed, count=self._count)
        self._durability = Durability(
            self._table, interval=self.fsync_interval, fdatasync=_sync_fd, failed=self._failed
        )
        self._compactor = Compactor(self._table, self._writer, failed=self._failed, count=self._count)
        self._recovered = Recovered()
        self._lock_fd = -1
        self._open_directory(root)
        if self.fsync == "batch":
            self._durability.start_flusher(f"hiradix-fsync-{root.name}")

    def _set_compression(self, comp: Any) -> None:
        """Check the ``compression`` option; load lz4 for ``"lz4"``."""
        if comp not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {comp!r}")
        self._lz4: Any = None
        if comp == "lz4":
            try:
                import lz4.block
            except ImportError as exc:
                raise StorageError("compression='lz4' needs the lz4 package: pip install 'hiradix[lz4]'") from exc
            self._lz4 = lz4.block
            self.capabilities = Capabilities(supports_v1=True, zero_copy=False, persistent=True, compression=True)
        self.compression: str = comp

    def _set_fsync(self, mode: Any, interval: Any, sync_bytes: Any) -> None:
        """Check the ``fsync``, ``fsync_interval`` and ``fsync_bytes`` options."""
        if isinstance(mode, bool):
            mode = "always" if mode else "none"
        if mode not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(map(repr, FSYNC_MODES))} or a bool, got {mode!r}")
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0:
            raise ValueError(f"fsync_interval must be a positive number of seconds, got {interval!r}")
        self.fsync: str = mode
        self.fsync_interval: float = float(interval)
        self.fsync_bytes: int = _positive_int(sync_bytes, "fsync_bytes")

    def _open_directory(self, root: Path) -> None:
        """Create and lock ``root``, recover its segments, open a fresh active segment."""
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot use {str(root)!r} as a storage directory: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = -1  # closed: never closed again (the number may be reused)
            raise StorageError(f"storage directory {str(root)!r} is in use by another FileStorage") from exc
        try:
            self._recovered = recover(self._table)
            self._table.active = self._table.new_segment()
        except OSError as exc:
            self._close_fds()
            raise StorageError(f"cannot open storage directory {str(root)!r}: {exc}") from exc

    # ------------------------------------------------------------------ primitives
    def _exists(self, key: str) -> bool:
        """``O(1)``; the payload is verified by reads, not here."""
        with self._table.lock:
            return key in self._table.index

    def _size(self, key: str) -> int | None:
        """``O(1)``."""
        with self._table.lock:
            loc = self._table.index.get(key)
            return None if loc is None else loc.raw_len

    def _get_into(self, key: str, out: memoryview) -> bool:
        """One ``preadv`` of header and payload into ``out``, then both checksums.
        ``O(page bytes)``."""
        return self._get_many_into([key], [out])[0]

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """Read a batch (:class:`~hiradix.storage.file.reads.Reader`): one lock round to look
        the keys up, one ``preadv`` per run of records that lie back to back in a segment,
        straight into ``outs``; then each record's checksums. ``O(total bytes)``."""
        return self._reader.read_many(keys, outs)

    def _put(self, key: str, data: memoryview) -> bool:
        """Store one page (see :meth:`_put_many`)."""
        return self._put_many([key], [data])[0]

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """Store a batch (:class:`~hiradix.storage.file.writes.Writer`): checksums outside
        the lock, one reservation, one ``pwritev`` per segment touched, one publication; a
        compaction if the dead bytes call for one; with ``fsync="always"``, then one sync
        round (shared with concurrent callers). ``O(total bytes)``."""
        writer = self._writer
        results, seq, compact = writer.append_many([writer.record(k, v) for k, v in zip(keys, views, strict=True)])
        if compact:
            self._compactor.compact_one()
        if self.fsync == "always" and seq and not self._durability.sync(seq):
            # Not durable as promised: report every page of the batch as not stored.
            results = [False] * len(results)
        return results

    def flush(self) -> bool:
        """Make every page stored so far durable now (``fdatasync``), in any ``fsync``
        mode. Whether it succeeded. ``O(segments written since the last sync)``."""
        return self._durability.flush()

    # ------------------------------------------------------------------ management
    def _clear(self) -> None:
        """Delete every segment and start an empty one. ``O(segments)``."""
        with self._table.lock:
            self._table.clear()

    def _usage(self) -> tuple[int, int, int | None]:
        with self._table.lock:
            return len(self._table.index), self._table.live_bytes, self.capacity_bytes

    def _extra_stats(self) -> dict[str, Any]:
        table = self._table
        with table.lock:
            return {
                "path": str(self.path),
                "segments": len(table.segments),
                "disk_bytes": table.disk_bytes,
                "dead_bytes": table.disk_bytes - table.live_bytes,
                "compactions": self._compactor.compactions,
                "recovered_pages": self._recovered.pages,
                "truncated_bytes": self._recovered.truncated_bytes,
                "skipped_bytes": self._recovered.skipped_bytes,
                "fsync": self.fsync,
                "fsyncs": self._durability.rounds,
                "compression": self.compression,
                "crc32": CRC32_IMPL,
            }

    def _close_fds(self) -> None:
        self._table.close_fds()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def close(self) -> None:
        """Refuse further calls, make what was written durable (``"batch"`` and
        ``"always"`` modes: a last sync round), close the segments and release the
        directory. Idempotent; later calls on this instance are misses / ``False``."""
        table = self._table
        with table.lock:
            if table.closed:
                return
            table.closed = True
            table.wake.notify_all()
        self._durability.join_flusher()
        try:
            if self.fsync != "none":
                self._durability.sync()
        finally:
            with table.lock:
                self._close_fds()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible left to do
            self.close()

    def __repr__(self) -> str:
        return (
            f"FileStorage(path={str(self.path)!r}, capacity_bytes={self.capacity_bytes}, "
            f"compression={self.compression!r}, fsync={self.fsync!r})"
        )
