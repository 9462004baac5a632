"""Compaction of a :class:`~hiradix.storage.file.FileStorage` (*Capacity and space* in
:mod:`hiradix.storage.file`).

When the dead bytes exceed ``max(segment_bytes, live_bytes / 2)``
(:meth:`SegmentTable.compaction_due <hiradix.storage.file.segments.SegmentTable.compaction_due>`),
the sealed segment with the most dead bytes, if at least half of it is dead, has its live
records verified and appended anew, keeping their generations; it is deleted once empty. A
move is published only if its key still points at the record moved, so a write that
races it wins. Disk use therefore stays below about ``2 x capacity + 2 segments``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from hiradix.storage.file.records import HDR_SIZE, crc32, header_ok
from hiradix.storage.file.segments import SegmentTable
from hiradix.storage.file.writes import Rec, Writer

__all__ = ["Compactor"]


class Compactor:
    """Compacts ``table``'s segments through ``writer``. ``failed(op, key, exc)`` is told of
    a compaction that fails (housekeeping: it never fails the write that asked for it),
    ``count(corrupt=n)`` of records that no longer verify. One compaction at a time."""

    def __init__(
        self,
        table: SegmentTable,
        writer: Writer,
        *,
        failed: Callable[[str, str, BaseException], None],
        count: Callable[..., None],
    ) -> None:
        self.table = table
        self.writer = writer
        self.failed = failed
        self.count = count
        self.lock = threading.Lock()
        self.compactions = 0

    def compact_one(self) -> None:
        """Move the live records of the sealed segment with the most dead bytes to the
        active one; the emptied segment is then deleted. Returns at once if another thread
        is compacting. ``O(live bytes of that segment)``."""
        if not self.lock.acquire(blocking=False):
            return
        table = self.table
        try:
            with table.lock:
                sealed = [s for s in table.segments.values() if s.sealed and s.fd >= 0]
                if not sealed:
                    return
                seg = max(sealed, key=lambda s: s.size - s.live_bytes)
                if seg.size - seg.live_bytes < seg.size // 2:
                    return  # moving a mostly live segment would cost more than it frees
                moves = [(k, loc) for k, loc in table.index.items() if loc.seg is seg]
                seg.readers += 1
            try:
                for key, loc in moves:
                    buf = bytearray(loc.stored_len)
                    head = bytearray(HDR_SIZE + loc.key_len)
                    n = os.preadv(seg.fd, [head, buf], loc.offset)
                    if n != loc.rec_len or crc32(buf) != loc.payload_crc or not header_ok(head, head[HDR_SIZE:]):
                        with table.lock:
                            table.forget(key, loc)
                        self.count(corrupt=1)
                        continue
                    self.writer.append_many(
                        [Rec(key, key.encode(), buf, loc.flags, loc.raw_len, loc.payload_crc, loc.gen, loc)]
                    )
            finally:
                with table.lock:
                    seg.readers -= 1
                    table.maybe_drop(seg)
            self.compactions += 1
        except Exception as exc:  # compaction is housekeeping: a failure must not fail the put
            self.failed("compact", "", exc)
        finally:
            self.lock.release()
