"""The segments of a :class:`~hiradix.storage.file.FileStorage` directory and the index of
their live records (*Capacity and space* in :mod:`hiradix.storage.file`).

:class:`SegmentTable` holds, under its one lock, the segment files (:class:`Segment`), the
index from each key to its newest record (:class:`Loc`), least recently used first, and
the byte counts: live bytes (what the index points to, bounded by ``capacity_bytes``) and
disk bytes. It links and unlinks records, evicts to capacity, and drops a sealed segment
once nothing reads, writes or points into it. What the next sync round must cover
(:class:`Unsynced`) is noted here as segments come and go and read by
:mod:`~hiradix.storage.file.durability`.

>>> import tempfile
>>> from pathlib import Path
>>> table = SegmentTable(Path(tempfile.mkdtemp()), segment_bytes=1 << 20, capacity_bytes=None, fsync="none")
>>> seg = table.new_segment()
>>> seg.size = 100
>>> table.link_loc("k", Loc(seg, 0, 1, 100 - HDR_SIZE - 1, 100 - HDR_SIZE - 1, 0, 1, 0))
>>> table.live_bytes, seg.live_records
(100, 1)
>>> table.close_fds()
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from hiradix.storage.file.records import HDR_SIZE

__all__ = ["Loc", "Placed", "Segment", "SegmentTable", "Unsynced"]


class Segment:
    """One segment file and its bookkeeping (all fields guarded by the table's lock)."""

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


class Loc:
    """Where a key's newest record is."""

    __slots__ = ("flags", "gen", "key_len", "offset", "payload_crc", "raw_len", "seg", "stored_len")

    def __init__(
        self, seg: Segment, offset: int, key_len: int, stored_len: int, raw_len: int, flags: int, gen: int, crc: int
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
        return HDR_SIZE + self.key_len + self.stored_len


#: Where a write placed a record: (its index in the batch, segment, offset, generation).
Placed = tuple[int, Segment, int, int]


@dataclass
class Unsynced:
    """What the next sync round must cover (``"batch"``/``"always"`` modes; guarded by the
    table's lock)."""

    write_seq: int = 0  # publications that wrote bytes, numbered
    segments: set[int] = field(default_factory=set)  # segment ids written since the last round
    directory: bool = False  # a segment was created since the last round
    unlink: list[Path] = field(default_factory=list)  # dropped segments, unlinked once the copies are durable
    bytes: int = 0


class SegmentTable:
    """The segments under ``path``, the index of their live records and the byte counts.

    Every method but :meth:`new_segment` at start-up expects the caller to hold
    :attr:`lock`; each is ``O(1)`` unless it says otherwise.
    """

    def __init__(
        self, path: Path, *, segment_bytes: int, capacity_bytes: int | None, fsync: str, fsync_bytes: int = 0
    ) -> None:
        self.path = path
        self.segment_bytes = segment_bytes
        self.capacity_bytes = capacity_bytes
        self.durable = fsync != "none"  # a dropped segment waits for a sync round
        self.fsync_bytes = fsync_bytes  # unsynced bytes that wake the "batch" flusher
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)  # the "batch" flusher waits on it
        self.index: OrderedDict[str, Loc] = OrderedDict()  # least recently used first
        self.segments: dict[int, Segment] = {}
        self.next_id = 1  # never reused by this instance (a dropped one may await its unlink)
        self.live_bytes = 0
        self.disk_bytes = 0
        self.gen = 0  # the newest generation written or found
        self.closed = False
        self.unsynced = Unsynced()
        self.active: Segment  # the append target, set by whoever opens the table

    # segments
    def new_segment(self) -> Segment:
        """Create the next segment file (``OSError`` if it cannot be)."""
        seg_id = self.next_id
        self.next_id += 1
        path = self.path / f"seg-{seg_id:08d}.hrx"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.unsynced.directory = self.durable  # its directory entry is synced with its first pages
        seg = Segment(seg_id, path, fd, 0)
        self.segments[seg_id] = seg
        return seg

    def maybe_drop(self, seg: Segment) -> None:
        """Close and delete ``seg`` if it is sealed and nobody reads, writes or points to it."""
        if seg.sealed and seg.live_records == 0 and seg.pending == 0 and seg.readers == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            self.segments.pop(seg.id, None)
            self.disk_bytes -= seg.size
            self.unsynced.segments.discard(seg.id)
            if self.durable:
                # Its records were overwritten, evicted or moved by writes that may not be
                # durable yet: keep the file until a sync round has made them so.
                self.unsynced.unlink.append(seg.path)
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)

    # the index
    def unlink_loc(self, loc: Loc) -> None:
        """Account that the record at ``loc`` is no longer indexed."""
        seg = loc.seg
        seg.live_records -= 1
        seg.live_bytes -= loc.rec_len
        self.live_bytes -= loc.rec_len
        self.maybe_drop(seg)

    def link_loc(self, key: str, loc: Loc) -> None:
        """Index ``key`` at ``loc``, keeping its LRU position if it was indexed."""
        old = self.index.get(key)
        self.index[key] = loc
        loc.seg.live_records += 1
        loc.seg.live_bytes += loc.rec_len
        self.live_bytes += loc.rec_len
        if old is not None:
            self.unlink_loc(old)

    def forget(self, key: str, loc: Loc) -> bool:
        """Unindex ``key`` if it still points at ``loc`` (a record that failed
        verification: its bytes stay dead on disk until the segment is reclaimed; a restart
        re-finds it only if its header still verifies, and the next read drops it again)."""
        if self.index.get(key) is not loc:
            return False
        del self.index[key]
        self.unlink_loc(loc)
        return True

    def evict_to_capacity(self) -> int:
        """Unindex least recently used records until the live bytes fit; how many.
        ``O(evicted)``."""
        evicted = 0
        cap = self.capacity_bytes
        while cap is not None and self.live_bytes > cap and self.index:
            _, victim = self.index.popitem(last=False)
            self.unlink_loc(victim)
            evicted += 1
        return evicted

    def compaction_due(self) -> bool:
        """Whether the dead bytes exceed ``max(segment_bytes, live bytes / 2)``."""
        return self.disk_bytes - self.live_bytes > max(self.segment_bytes, self.live_bytes // 2)

    def clear(self) -> None:
        """Unindex every record, delete every segment nobody is using (the others go when
        their reader or writer is done) and start an empty one. ``O(segments)``."""
        self.index.clear()
        self.live_bytes = 0
        for seg in list(self.segments.values()):
            seg.sealed = True
            seg.live_records = seg.live_bytes = 0
            if seg.pending or seg.readers:
                continue  # dropped by whoever finishes with it
            self.maybe_drop(seg)
        # Nothing needs these kept for a sync round: the pages are meant to be gone.
        for path in self.unsynced.unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.unsynced.unlink.clear()
        self.active = self.new_segment()

    def close_fds(self) -> None:
        """Close every segment file. ``O(segments)``."""
        for seg in self.segments.values():
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
