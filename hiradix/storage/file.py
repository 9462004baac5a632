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
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar

import platformdirs

from hiradix.storage.base import (
    MAX_KEY_BYTES,
    Capabilities,
    StorageBackend,
    StorageConfig,
    StorageError,
    option_value,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "FSYNC_MODES", "FileStorage", "default_path"]

logger = logging.getLogger(__name__)

MAGIC = b"HRXP"
VERSION = 1
FLAG_LZ4 = 1
_BODY = struct.Struct("<4sHHHHQQQI")  # everything before header_crc32
_HDR_SIZE = _BODY.size + 4
_CRC = struct.Struct("<I")
DEFAULT_SEGMENT_BYTES = 256 << 20
FSYNC_MODES = ("none", "batch", "always")
DEFAULT_FSYNC_INTERVAL = 1.0  # seconds, "batch" mode
DEFAULT_FSYNC_BYTES = 64 << 20  # "batch" mode: sync sooner once this much is waiting
_SEG_RE = re.compile(r"^seg-(\d{8})\.hrx$")
_RESYNC_CHUNK = 1 << 20  # bytes read at a time when looking for the next record

# The system calls that put bytes on disk, as module attributes: tests replace them to
# inject a full disk, a short write or a failing fsync.
_pwritev = os.pwritev
_fdatasync = os.fdatasync


class _Segment:
    """One segment file and its bookkeeping (all fields guarded by the storage lock)."""

    __slots__ = ("fd", "id", "live_bytes", "live_records", "path", "pending", "readers", "sealed", "size")

    def __init__(self, seg_id: int, path: Path, fd: int, size: int) -> None:
        self.id = seg_id  # monotonically increasing, never reused by one directory
        self.path = path
        self.fd = fd
        self.size = size  # bytes reserved (written or being written)
        self.live_bytes = 0  # bytes of records the index points to
        self.live_records = 0
        self.pending = 0  # writes in flight into this segment
        self.readers = 0  # reads in flight (the fd must stay open)
        self.sealed = False  # no longer the append target


class _Loc:
    """Where a key's newest record is."""

    __slots__ = ("flags", "gen", "key_len", "offset", "payload_crc", "raw_len", "seg", "stored_len")

    def __init__(
        self, seg: _Segment, offset: int, key_len: int, stored_len: int, raw_len: int, flags: int, gen: int, crc: int
    ) -> None:
        self.seg = seg
        self.offset = offset
        self.key_len = key_len
        self.stored_len = stored_len
        self.raw_len = raw_len
        self.flags = flags
        self.gen = gen
        self.payload_crc = crc

    @property
    def rec_len(self) -> int:
        return _HDR_SIZE + self.key_len + self.stored_len


try:  # ISA-L's crc32 gives zlib's values at 20+ GB/s (zlib: 3-6 GB/s here); same format.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32
CRC32_IMPL = "isal" if _crc32 is not zlib.crc32 else "zlib"
_IOV_RUN = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024) // 3)


class _Rec:
    """A record to append: built outside the lock (:meth:`FileStorage._record`)."""

    __slots__ = ("crc", "expect", "flags", "gen", "kb", "key", "payload", "raw_len")

    def __init__(
        self,
        key: str,
        kb: bytes,
        payload: Any,
        flags: int,
        raw_len: int,
        crc: int,
        gen: int | None,
        expect: _Loc | None,
    ) -> None:
        self.key, self.kb, self.payload, self.flags = key, kb, payload, flags
        self.raw_len, self.crc = raw_len, crc
        self.gen = gen  # None: a new write; set: a compaction move keeping its generation
        self.expect = expect  # compaction: publish only if the key still points here

    @property
    def rec_len(self) -> int:
        return _HDR_SIZE + len(self.kb) + len(self.payload)


def _skip(iov: list[Any], n: int) -> list[Any]:
    """``iov`` without its first ``n`` bytes (after a short ``pwritev``)."""
    for i, buf in enumerate(iov):
        size = memoryview(buf).nbytes
        if n < size:
            return [memoryview(buf).cast("B")[n:], *iov[i + 1 :]]
        n -= size
    return []


#: Where :meth:`FileStorage._append_many` put a record: (its index, segment, offset, generation).
_Placed = tuple[int, _Segment, int, int]


def _run_end(locs: list[_Loc | None], i: int) -> int:
    """The end of the run of uncompressed records from ``locs[i]`` on that lie back to back
    in its segment (``_IOV_RUN`` records at most: one ``preadv``)."""
    loc = locs[i]
    assert loc is not None
    j, end = i + 1, loc.offset + loc.rec_len
    while j < len(locs) and j - i < _IOV_RUN:
        nxt = locs[j]
        if nxt is None or nxt.seg is not loc.seg or nxt.offset != end or nxt.flags & FLAG_LZ4:
            break
        end += nxt.rec_len
        j += 1
    return j


def _lz4_block() -> Any:
    # Imported on first use: records are flagged one by one, so an instance without
    # compression still reads lz4 records an earlier instance wrote.
    import lz4.block

    return lz4.block


def _header(kb: bytes, flags: int, stored_len: int, raw_len: int, gen: int, crc: int) -> bytes:
    body = _BODY.pack(MAGIC, VERSION, flags, len(kb), 0, stored_len, raw_len, gen, crc)
    return body + _CRC.pack(_crc32(kb, _crc32(body)))


def _parse_header(hdr: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int] | None:
    """``(flags, key_len, stored_len, raw_len, gen, payload_crc)``, or ``None`` if the
    fixed part is not a valid header (the key is checked by the caller)."""
    if len(hdr) < _HDR_SIZE:
        return None
    magic, version, flags, key_len, _, stored_len, raw_len, gen, crc = _BODY.unpack_from(hdr)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_LZ4 or not 0 < key_len <= MAX_KEY_BYTES:
        return None
    if not flags & FLAG_LZ4 and stored_len != raw_len:
        return None
    return flags, key_len, stored_len, raw_len, gen, crc


def _header_ok(hdr: bytes | bytearray | memoryview, kb: bytes | bytearray | memoryview) -> bool:
    body = memoryview(hdr)[: _BODY.size]
    return _CRC.unpack_from(hdr, _BODY.size)[0] == _crc32(kb, _crc32(body))


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
    _flusher: threading.Thread | None  # the "batch" mode's fsync thread

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
        self._init_state()
        self._open_directory(root)
        if self.fsync == "batch":
            self._flusher = threading.Thread(target=self._flush_loop, name=f"hiradix-fsync-{root.name}", daemon=True)
            self._flusher.start()

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

    def _init_state(self) -> None:
        """The index, the segments and the bookkeeping of an instance not yet opened."""
        self._lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self._index: OrderedDict[str, _Loc] = OrderedDict()  # least recently used first
        self._segments: dict[int, _Segment] = {}
        self._next_seg_id = 1  # never reused by this instance (a dropped one may await its unlink)
        self._live_bytes = 0
        self._disk_bytes = 0
        self._gen = 0
        # fsync bookkeeping ("batch"/"always"; all under _lock except where noted)
        self._write_seq = 0  # publications that wrote bytes, numbered
        self._dirty: set[int] = set()  # segment ids written since the last sync round
        self._dir_dirty = False  # a segment was created since the last sync round
        self._unlink_after_sync: list[Path] = []  # dropped segments, unlinked once the copies are durable
        self._unsynced_bytes = 0
        self._sync_lock = threading.Lock()  # one sync round at a time; guards the two below
        self._synced_seq = 0  # every publication up to this one has been fdatasync-ed (or failed)
        self._sync_failed_seq = 0  # the newest publication whose round failed
        self._syncs = 0
        self._wake = threading.Condition(self._lock)  # the "batch" flusher waits on it
        self._flusher = None
        self._compactions = 0
        self._recovered = 0
        self._truncated_bytes = 0
        self._skipped_bytes = 0
        self._closed = False
        self._lock_fd = -1

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
            raise StorageError(f"storage directory {str(root)!r} is in use by another FileStorage") from exc
        try:
            self._recover()
            self._active = self._new_segment()
        except OSError as exc:
            self._close_fds()
            raise StorageError(f"cannot open storage directory {str(root)!r}: {exc}") from exc

    # ------------------------------------------------------------------ segments
    def _new_segment(self) -> _Segment:
        # Caller holds the lock (or is the constructor).
        seg_id = self._next_seg_id
        self._next_seg_id += 1
        path = self.path / f"seg-{seg_id:08d}.hrx"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._dir_dirty = self.fsync != "none"  # its directory entry is synced with its first pages
        seg = _Segment(seg_id, path, fd, 0)
        self._segments[seg_id] = seg
        return seg

    def _maybe_drop(self, seg: _Segment) -> None:
        # Caller holds the lock. A sealed segment nobody reads, writes or points to goes.
        if seg.sealed and seg.live_records == 0 and seg.pending == 0 and seg.readers == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            self._segments.pop(seg.id, None)
            self._disk_bytes -= seg.size
            self._dirty.discard(seg.id)
            if self.fsync != "none":
                # Its records were overwritten, evicted or moved by writes that may not be
                # durable yet: keep the file until a sync round has made them so.
                self._unlink_after_sync.append(seg.path)
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)

    def _unlink_loc(self, loc: _Loc) -> None:
        # Caller holds the lock; the record at loc is no longer indexed.
        seg = loc.seg
        seg.live_records -= 1
        seg.live_bytes -= loc.rec_len
        self._live_bytes -= loc.rec_len
        self._maybe_drop(seg)

    def _link_loc(self, key: str, loc: _Loc) -> None:
        # Caller holds the lock. Replaces key's entry keeping its LRU position if present.
        old = self._index.get(key)
        self._index[key] = loc
        loc.seg.live_records += 1
        loc.seg.live_bytes += loc.rec_len
        self._live_bytes += loc.rec_len
        if old is not None:
            self._unlink_loc(old)

    def _evict_to_capacity(self) -> int:
        # Caller holds the lock.
        evicted = 0
        cap = self.capacity_bytes
        while cap is not None and self._live_bytes > cap and self._index:
            _, victim = self._index.popitem(last=False)
            self._unlink_loc(victim)
            evicted += 1
        return evicted

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        seg_files = []
        for entry in os.scandir(self.path):
            m = _SEG_RE.match(entry.name)
            if m and entry.is_file():
                seg_files.append((int(m.group(1)), Path(entry.path)))
        found: dict[str, _Loc] = {}
        dups: dict[str, list[_Loc]] = {}  # every copy of the keys found more than once
        for seg_id, path in sorted(seg_files):
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            seg = _Segment(seg_id, path, fd, size)
            seg.sealed = True
            self._segments[seg_id] = seg
            self._next_seg_id = seg_id + 1
            off = self._scan(seg, found, dups)
            if off < size:  # torn or corrupt tail: remove it, it can never be served
                os.ftruncate(fd, off)
                self._truncated_bytes += size - off
                seg.size = off
            self._disk_bytes += seg.size
        for key, copies in dups.items():
            # The newest copy may be a write that never finished (a crash, a full disk):
            # its header verified, its payload need not. Take the newest that verifies.
            copies.sort(key=lambda c: (c.gen, c.seg.id, c.offset), reverse=True)
            best = next((c for c in copies if self._payload_ok(c)), None)
            if best is None:
                del found[key]
            else:
                found[key] = best
        for key, loc in sorted(found.items(), key=lambda kv: kv[1].gen):
            self._link_loc(key, loc)
        self._recovered = len(self._index)
        self._evict_to_capacity()
        for seg in list(self._segments.values()):
            self._maybe_drop(seg)

    def _scan(self, seg: _Segment, found: dict[str, _Loc], dups: dict[str, list[_Loc]]) -> int:
        """Index the valid records of ``seg`` into ``found`` (the newest of each key) and
        ``dups``; resync past anything else. The offset where the last valid record ends.
        ``O(records)`` reads, plus ``O(bytes skipped)`` after damage."""
        off = end = valid = 0
        while off + _HDR_SIZE <= seg.size:
            rec = self._record_at(seg, off)
            if rec is None:
                off = self._next_magic(seg, off + 1)
                continue
            key, loc = rec
            self._gen = max(self._gen, loc.gen)  # even a copy that loses: new writes must win
            old = found.get(key)
            if old is not None:
                dups.setdefault(key, [old]).append(loc)
            if old is None or loc.gen >= old.gen:
                found[key] = loc
            off = end = off + loc.rec_len
            valid += loc.rec_len
        self._skipped_bytes += end - valid
        return end

    @staticmethod
    def _record_at(seg: _Segment, off: int) -> tuple[str, _Loc] | None:
        """The record whose header and key verify at ``off``, if any (payload unread)."""
        head = os.pread(seg.fd, _HDR_SIZE + MAX_KEY_BYTES, off)
        parsed = _parse_header(head)
        if parsed is None:
            return None
        flags, key_len, stored_len, raw_len, gen, crc = parsed
        kb = head[_HDR_SIZE : _HDR_SIZE + key_len]
        if len(kb) != key_len or off + _HDR_SIZE + key_len + stored_len > seg.size or not _header_ok(head, kb):
            return None
        try:
            key = kb.decode()
        except UnicodeDecodeError:
            return None
        return key, _Loc(seg, off, key_len, stored_len, raw_len, flags, gen, crc)

    @staticmethod
    def _next_magic(seg: _Segment, off: int) -> int:
        """The offset of the next ``MAGIC`` at or after ``off``, else ``seg.size``."""
        while off + len(MAGIC) <= seg.size:
            buf = os.pread(seg.fd, min(_RESYNC_CHUNK, seg.size - off), off)
            if len(buf) < len(MAGIC):
                break
            hit = buf.find(MAGIC)
            if hit >= 0:
                return off + hit
            off += len(buf) - len(MAGIC) + 1  # a magic may straddle the chunk boundary
        return seg.size

    @staticmethod
    def _payload_ok(loc: _Loc) -> bool:
        """Whether the stored payload at ``loc`` is whole and matches its checksum."""
        buf = os.pread(loc.seg.fd, loc.stored_len, loc.offset + _HDR_SIZE + loc.key_len)
        return len(buf) == loc.stored_len and _crc32(buf) == loc.payload_crc

    # ------------------------------------------------------------------ primitives
    def _exists(self, key: str) -> bool:
        """``O(1)``; the payload is verified by reads, not here."""
        with self._lock:
            return key in self._index

    def _size(self, key: str) -> int | None:
        """``O(1)``."""
        with self._lock:
            loc = self._index.get(key)
            return None if loc is None else loc.raw_len

    def _get_into(self, key: str, out: memoryview) -> bool:
        """One ``preadv`` of header and payload into ``out``, then both checksums.
        ``O(page bytes)``."""
        return self._get_many_into([key], [out])[0]

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """Read a batch: one lock round to look the keys up, one ``preadv`` per run of
        records that lie back to back in a segment (pages written by one batch and read
        back in order), straight into ``outs``; then each record's header and payload
        checksums. ``O(total bytes)``."""
        locs = self._pin(keys, outs)
        results = [False] * len(keys)
        bad: list[int] = []
        try:
            i = 0
            while i < len(keys):
                i = self._read_run(keys, outs, locs, i, results, bad)
        finally:
            self._unpin(locs)
        for k in bad:
            rec = locs[k]
            assert rec is not None
            self._drop_corrupt(keys[k], rec)
        return results

    def _pin(self, keys: list[str], outs: list[memoryview]) -> list[_Loc | None]:
        """Look ``keys`` up under one lock round: the record of each key whose page has the
        length of its ``out`` (touched, and its segment pinned against reclaim), else
        ``None``."""
        locs: list[_Loc | None] = [None] * len(keys)
        with self._lock:
            if self._closed:
                raise StorageError("storage is closed")
            index = self._index
            for i, key in enumerate(keys):
                loc = index.get(key)
                if loc is not None and loc.raw_len == len(outs[i]):
                    index.move_to_end(key)
                    loc.seg.readers += 1
                    locs[i] = loc
        return locs

    def _unpin(self, locs: list[_Loc | None]) -> None:
        """Undo :meth:`_pin`: release the segments (one dropped meanwhile goes now)."""
        with self._lock:
            segs = {}
            for loc in locs:
                if loc is not None:
                    loc.seg.readers -= 1
                    segs[loc.seg.id] = loc.seg
            for seg in segs.values():
                self._maybe_drop(seg)

    def _read_run(
        self,
        keys: list[str],
        outs: list[memoryview],
        locs: list[_Loc | None],
        i: int,
        results: list[bool],
        bad: list[int],
    ) -> int:
        """Read the records from ``i`` on that lie back to back in one segment (one
        ``preadv``; a compressed record alone), set their ``results``, note those that
        fail verification in ``bad``; the index after the run."""
        loc = locs[i]
        if loc is None:
            return i + 1
        if loc.flags & FLAG_LZ4:
            results[i] = self._read_compressed(keys[i], loc, outs[i])
            if not results[i]:
                bad.append(i)
            return i + 1
        j = _run_end(locs, i)
        heads = [bytearray(_HDR_SIZE + locs[k].key_len) for k in range(i, j)]  # type: ignore[union-attr]
        iov: list[Any] = []
        for k in range(i, j):
            iov += (heads[k - i], outs[k])
        try:
            got = os.preadv(loc.seg.fd, iov, loc.offset)
        except OSError as exc:  # an I/O error is a miss for the run, not corruption
            self._failed("get", keys[i], exc)
            return j
        for k in range(i, j):
            rec = locs[k]
            assert rec is not None
            ok = rec.offset + rec.rec_len - loc.offset <= got and self._verify(keys[k], rec, heads[k - i], outs[k])
            results[k] = ok
            if not ok:
                bad.append(k)
        return j

    def _verify(self, key: str, loc: _Loc, head: bytearray, payload: Any) -> bool:
        kb = memoryview(head)[_HDR_SIZE:]
        return (
            _parse_header(head) == (loc.flags, loc.key_len, loc.stored_len, loc.raw_len, loc.gen, loc.payload_crc)
            and _header_ok(head, kb)
            and kb == key.encode()
            and _crc32(payload) == loc.payload_crc
        )

    def _read_compressed(self, key: str, loc: _Loc, out: memoryview) -> bool:
        head = bytearray(_HDR_SIZE + loc.key_len)
        payload = bytearray(loc.stored_len)
        if os.preadv(loc.seg.fd, [head, payload], loc.offset) != loc.rec_len or not self._verify(
            key, loc, head, payload
        ):
            return False
        raw = _lz4_block().decompress(payload, uncompressed_size=loc.raw_len)
        if len(raw) != loc.raw_len:
            return False
        out[:] = raw
        return True

    def _drop_corrupt(self, key: str, loc: _Loc) -> None:
        # A record that fails verification is unindexed (the bytes stay dead on disk
        # until the segment is reclaimed; a restart re-finds it only if its header still
        # verifies, and then the next read drops it again).
        with self._lock:
            if self._index.get(key) is loc:
                del self._index[key]
                self._unlink_loc(loc)
        self._count(corrupt=1)

    def _put(self, key: str, data: memoryview) -> bool:
        """Store one page (see :meth:`_put_many`)."""
        return self._put_many([key], [data])[0]

    def _record(self, key: str, data: memoryview) -> _Rec | None:
        # Compress and checksum outside the lock; None if the page can never fit.
        raw_len = len(data)
        payload: Any = data
        flags = 0
        if self._lz4 is not None:
            packed = self._lz4.compress(data, store_size=False)
            if len(packed) < raw_len:
                payload, flags = packed, FLAG_LZ4
        kb = key.encode()
        if self.capacity_bytes is not None and _HDR_SIZE + len(kb) + len(payload) > self.capacity_bytes:
            return None
        return _Rec(key, kb, payload, flags, raw_len, _crc32(payload), None, None)

    def _append_many(self, recs: list[_Rec | None]) -> tuple[list[bool], int]:
        """Append records: reserve space for all under one lock round, write each run of
        records that landed back to back in one segment with one ``pwritev``, then
        publish each, unless a newer write of its key won meanwhile or, for a compaction
        move (``rec.expect`` set), its key no longer points at ``rec.expect``.

        Returns whether each record is stored, and the publication's sequence number for
        :meth:`_sync` (0: nothing to sync). A record counts as stored only once all its
        bytes are in the file; a run that fails part-way keeps the records it completed.
        """
        plan = self._reserve(recs)
        written = [False] * len(recs)
        try:
            p = 0
            while p < len(plan):
                q = p + 1
                while q < len(plan) and q - p < _IOV_RUN and plan[q][1] is plan[p][1]:
                    q += 1
                self._write_run(recs, plan[p:q], written)
                p = q
        finally:
            published, seq, evicted, need_compact = self._publish(recs, plan, written)
        if evicted:
            self._count(evictions=evicted)
        if need_compact and not any(r is not None and r.expect is not None for r in recs):
            self._compact_one()
        return published, seq

    def _reserve(self, recs: list[_Rec | None]) -> list[_Placed]:
        """Place each record (under one lock round): its segment (a full active one is
        sealed and a fresh one opened), offset and generation; the segments are pinned
        (``pending``) until :meth:`_publish`."""
        plan: list[_Placed] = []
        with self._lock:
            if self._closed:
                raise StorageError("storage is closed")
            for i, rec in enumerate(recs):
                if rec is None:
                    continue
                if rec.gen is None:
                    self._gen += 1
                gen = self._gen if rec.gen is None else rec.gen
                seg = self._active
                if seg.size and seg.size + rec.rec_len > self.segment_bytes:
                    seg.sealed = True
                    seg = self._active = self._new_segment()
                plan.append((i, seg, seg.size, gen))
                seg.size += rec.rec_len
                self._disk_bytes += rec.rec_len
                seg.pending += 1
        return plan

    def _write_run(self, recs: list[_Rec | None], run: list[_Placed], written: list[bool]) -> None:
        """Write a run of records placed back to back in one segment with one ``pwritev``
        (resumed after short writes); mark in ``written`` those whose bytes all landed."""
        iov: list[Any] = []
        total = 0
        for i, _, _, gen in run:
            rec = recs[i]
            assert rec is not None
            iov += (_header(rec.kb, rec.flags, len(rec.payload), rec.raw_len, gen, rec.crc), rec.kb, rec.payload)
            total += rec.rec_len
        first, seg, start, _ = run[0]
        done = self._write_all(seg.fd, iov, start, total, recs[first].key)  # type: ignore[union-attr]
        for i, _, offset, _ in run:
            rec = recs[i]
            assert rec is not None
            written[i] = offset + rec.rec_len - start <= done

    def _publish(
        self, recs: list[_Rec | None], plan: list[_Placed], written: list[bool]
    ) -> tuple[list[bool], int, int, bool]:
        """Under one lock round: unpin the segments, index each written record unless a
        newer write of its key (or, for a compaction move, any change) won, account the
        bytes to sync, evict to capacity and drop emptied segments. Returns whether each
        record is stored, the publication's sequence number (0: nothing to sync), the
        pages evicted, and whether a compaction is due."""
        published = [False] * len(recs)
        seq = 0
        with self._lock:
            wrote = 0
            for i, seg, offset, gen in plan:
                seg.pending -= 1
                rec = recs[i]
                assert rec is not None
                if not written[i]:
                    continue
                self._link_newest(rec, seg, offset, gen)
                # A write that lost to a newer one still succeeded: the key holds newer data.
                published[i] = True
                if self.fsync != "none":
                    self._dirty.add(seg.id)
                    wrote += rec.rec_len
            if wrote:
                self._write_seq += 1
                seq = self._write_seq
                self._unsynced_bytes += wrote
                if self._unsynced_bytes >= self.fsync_bytes:
                    self._wake.notify()
            evicted = self._evict_to_capacity()
            for seg in {id(s): s for _, s, _, _ in plan}.values():
                self._maybe_drop(seg)
            need_compact = self._disk_bytes - self._live_bytes > max(self.segment_bytes, self._live_bytes // 2)
        return published, seq, evicted, need_compact

    def _link_newest(self, rec: _Rec, seg: _Segment, offset: int, gen: int) -> None:
        """Index ``rec`` (written at ``offset`` of ``seg``) unless it lost. Caller holds the lock."""
        cur = self._index.get(rec.key)
        # A new write loses only to a newer one; a compaction move only to any change.
        publish = (cur is rec.expect) if rec.expect is not None else (cur is None or cur.gen <= gen)
        if publish:
            loc = _Loc(seg, offset, len(rec.kb), len(rec.payload), rec.raw_len, rec.flags, gen, rec.crc)
            self._link_loc(rec.key, loc)
            if rec.expect is None:
                self._index.move_to_end(rec.key)

    def _write_all(self, fd: int, iov: list[Any], offset: int, total: int, key: str) -> int:
        """``pwritev`` the ``total`` bytes of ``iov`` at ``offset``, resuming after short
        writes; the bytes written in a row from ``offset`` (fewer if the disk fails:
        counted and logged as a failed set)."""
        done = 0
        while done < total:
            try:
                n = _pwritev(fd, iov, offset + done)
            except OSError as exc:  # a full disk, an I/O error: these records are not stored
                self._failed("set", key, exc)
                return done
            if n <= 0:
                self._failed("set", key, OSError(f"short write: {done} of {total} bytes"))
                return done
            done += n
            iov = _skip(iov, n)
        return done

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """Store a batch: checksums outside the lock, one reservation, one ``pwritev``
        per segment touched, one publication; with ``fsync="always"``, then one sync
        round (shared with concurrent callers). ``O(total bytes)``."""
        results, seq = self._append_many([self._record(k, v) for k, v in zip(keys, views, strict=True)])
        if self.fsync == "always" and seq and not self._sync(seq):
            # Not durable as promised: report every page of the batch as not stored.
            results = [False] * len(results)
        return results

    # ------------------------------------------------------------------ durability
    def _sync(self, seq: int | None = None) -> bool:
        """One sync round: ``fdatasync`` every segment written since the last round (and
        the directory if a segment was created), then unlink the segments dropped before
        it. With ``seq``, skip the round if one that started after publication ``seq``
        has already finished (group commit). Whether publication ``seq`` is durable.
        ``O(segments written)`` system calls, outside the storage lock."""
        with self._sync_lock:
            if seq is not None and self._synced_seq >= seq:
                return seq > self._sync_failed_seq
            with self._lock:
                target = self._write_seq
                segs = [self._segments[i] for i in self._dirty if i in self._segments]
                for seg in segs:
                    seg.readers += 1  # keeps the fd open while we sync it
                self._dirty.clear()
                dir_dirty, self._dir_dirty = self._dir_dirty, False
                unlink, self._unlink_after_sync = self._unlink_after_sync, []
                self._unsynced_bytes = 0
            ok = True
            try:
                for seg in segs:
                    _fdatasync(seg.fd)
                if dir_dirty:
                    dfd = os.open(self.path, os.O_RDONLY)
                    try:
                        _fdatasync(dfd)
                    finally:
                        os.close(dfd)
            except OSError as exc:
                # After a failed fdatasync the kernel may have dropped the dirty pages
                # (and a retry would "succeed"): the round's pages are not durable.
                ok = False
                self._failed("fsync", "", exc)
                self._sync_failed_seq = target
            finally:
                with self._lock:
                    for seg in segs:
                        seg.readers -= 1
                        self._maybe_drop(seg)
                    if not ok:
                        self._unlink_after_sync[:0] = unlink
                        self._dir_dirty = self._dir_dirty or dir_dirty
                        self._rotate()  # later pages go to a segment with no lost writes behind them
            if ok:
                for path in unlink:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            self._synced_seq = target
            self._syncs += 1
            return ok if seq is None else seq > self._sync_failed_seq

    def _rotate(self) -> None:
        # Caller holds the lock. A failure leaves the current active segment in use.
        if self._closed or not self._active.size:
            return
        try:
            seg = self._new_segment()
        except OSError as exc:
            self._failed("rotate", "", exc)
            return
        self._active.sealed = True
        old, self._active = self._active, seg
        self._maybe_drop(old)

    def _flush_loop(self) -> None:
        """``"batch"`` mode: a sync round every ``fsync_interval`` seconds, or as soon as
        ``fsync_bytes`` are waiting; returns once the instance is closed."""
        while True:
            with self._lock:
                self._wake.wait_for(
                    lambda: self._closed or self._unsynced_bytes >= self.fsync_bytes, timeout=self.fsync_interval
                )
                if self._closed:
                    return
                idle = not self._dirty and not self._dir_dirty and not self._unlink_after_sync
            if not idle:
                self._sync()

    def flush(self) -> bool:
        """Make every page stored so far durable now (``fdatasync``), in any ``fsync``
        mode. Whether it succeeded. ``O(segments written since the last sync)``."""
        with self._lock:
            if self._closed:
                return False
            for seg in self._segments.values():
                if seg.size:
                    self._dirty.add(seg.id)
        return self._sync(None)

    # ------------------------------------------------------------------ compaction
    def _compact_one(self) -> None:
        """Move the live records of the sealed segment with the most dead bytes to the
        active one; the emptied segment is then deleted. One thread at a time."""
        if not self._compact_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                sealed = [s for s in self._segments.values() if s.sealed and s.fd >= 0]
                if not sealed:
                    return
                seg = max(sealed, key=lambda s: s.size - s.live_bytes)
                if seg.size - seg.live_bytes < seg.size // 2:
                    return  # moving a mostly live segment would cost more than it frees
                moves = [(k, loc) for k, loc in self._index.items() if loc.seg is seg]
                seg.readers += 1
            try:
                for key, loc in moves:
                    buf = bytearray(loc.stored_len)
                    head = bytearray(_HDR_SIZE + loc.key_len)
                    n = os.preadv(seg.fd, [head, buf], loc.offset)
                    if n != loc.rec_len or _crc32(buf) != loc.payload_crc or not _header_ok(head, head[_HDR_SIZE:]):
                        self._drop_corrupt(key, loc)
                        continue
                    self._append_many(
                        [_Rec(key, key.encode(), buf, loc.flags, loc.raw_len, loc.payload_crc, loc.gen, loc)]
                    )
            finally:
                with self._lock:
                    seg.readers -= 1
                    self._maybe_drop(seg)
            self._compactions += 1
        except Exception as exc:  # compaction is housekeeping: a failure must not fail the put
            self._failed("compact", "", exc)
        finally:
            self._compact_lock.release()

    # ------------------------------------------------------------------ management
    def _clear(self) -> None:
        """Delete every segment and start an empty one. ``O(segments)``."""
        with self._lock:
            self._index.clear()
            self._live_bytes = 0
            for seg in list(self._segments.values()):
                seg.sealed = True
                seg.live_records = seg.live_bytes = 0
                if seg.pending or seg.readers:
                    continue  # dropped by whoever finishes with it
                self._maybe_drop(seg)
            # Nothing needs these kept for a sync round: the pages are meant to be gone.
            for path in self._unlink_after_sync:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._unlink_after_sync.clear()
            self._active = self._new_segment()

    def _usage(self) -> tuple[int, int, int | None]:
        with self._lock:
            return len(self._index), self._live_bytes, self.capacity_bytes

    def _extra_stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "path": str(self.path),
                "segments": len(self._segments),
                "disk_bytes": self._disk_bytes,
                "dead_bytes": self._disk_bytes - self._live_bytes,
                "compactions": self._compactions,
                "recovered_pages": self._recovered,
                "truncated_bytes": self._truncated_bytes,
                "skipped_bytes": self._skipped_bytes,
                "fsync": self.fsync,
                "fsyncs": self._syncs,
                "compression": self.compression,
                "crc32": CRC32_IMPL,
            }

    def _close_fds(self) -> None:
        for seg in self._segments.values():
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def close(self) -> None:
        """Refuse further calls, make what was written durable (``"batch"`` and
        ``"always"`` modes: a last sync round), close the segments and release the
        directory. Idempotent; later calls on this instance are misses / ``False``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()
        try:
            if self.fsync != "none":
                self._sync()
        finally:
            with self._lock:
                self._close_fds()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible left to do
            self.close()

    def __repr__(self) -> str:
        return (
            f"FileStorage(path={str(self.path)!r}, capacity_bytes={self.capacity_bytes}, "
            f"compression={self.compression!r}, fsync={self.fsync!r})"
        )
