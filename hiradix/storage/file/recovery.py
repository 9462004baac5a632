"""Restart of a :class:`~hiradix.storage.file.FileStorage` directory (*Restart* in
:mod:`hiradix.storage.file`): the index rebuilt from the segments' headers.

:func:`recover` scans every segment's headers (not payloads: restart cost stays
proportional to the number of pages; payloads are verified on every read anyway) and keeps
the newest record of each key. Where a header does not verify, the scan resyncs at the
next ``MAGIC`` whose header and key verify, so damage costs the records it touches; the
tail after the last valid record is truncated. A key found more than once has its newest
copy's payload verified before it wins, so a torn newer write falls back to the older
acknowledged page.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hiradix.storage.base import MAX_KEY_BYTES
from hiradix.storage.file.records import HDR_SIZE, MAGIC, crc32, header_ok, parse_header
from hiradix.storage.file.segments import Loc, Segment, SegmentTable

__all__ = ["RESYNC_CHUNK", "SEGMENT_NAME", "Recovered", "next_magic", "payload_ok", "record_at", "recover"]

SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.hrx$")
RESYNC_CHUNK = 1 << 20  # bytes read at a time when looking for the next record


@dataclass
class Recovered:
    """What a restart found: the pages indexed, the torn tails cut off, the bytes skipped
    between valid records."""

    pages: int = 0
    truncated_bytes: int = 0
    skipped_bytes: int = 0


def recover(table: SegmentTable) -> Recovered:
    """Index the segments found under ``table.path`` into ``table`` (empty, not yet
    opened): each key's newest record whose header verifies (and, for a key found more than
    once, whose payload verifies too); then evict to capacity and drop the segments left
    with nothing live. ``OSError`` if a segment cannot be read. ``O(records)`` reads, plus
    ``O(bytes skipped)`` after damage."""
    report = Recovered()
    seg_files = []
    for entry in os.scandir(table.path):
        m = SEGMENT_NAME.match(entry.name)
        if m and entry.is_file():
            seg_files.append((int(m.group(1)), Path(entry.path)))
    found: dict[str, Loc] = {}
    dups: dict[str, list[Loc]] = {}  # every copy of the keys found more than once
    for seg_id, path in sorted(seg_files):
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        seg = Segment(seg_id, path, fd, size)
        seg.sealed = True
        table.segments[seg_id] = seg
        table.next_id = seg_id + 1
        off = _scan(table, seg, found, dups, report)
        if off < size:  # torn or corrupt tail: remove it, it can never be served
            os.ftruncate(fd, off)
            report.truncated_bytes += size - off
            seg.size = off
        table.disk_bytes += seg.size
    for key, copies in dups.items():
        # The newest copy may be a write that never finished (a crash, a full disk):
        # its header verified, its payload need not. Take the newest that verifies.
        copies.sort(key=lambda c: (c.gen, c.seg.id, c.offset), reverse=True)
        best = next((c for c in copies if payload_ok(c)), None)
        if best is None:
            del found[key]
        else:
            found[key] = best
    for key, loc in sorted(found.items(), key=lambda kv: kv[1].gen):
        table.link_loc(key, loc)
    report.pages = len(table.index)
    table.evict_to_capacity()
    for seg in list(table.segments.values()):
        table.maybe_drop(seg)
    return report


def _scan(
    table: SegmentTable, seg: Segment, found: dict[str, Loc], dups: dict[str, list[Loc]], report: Recovered
) -> int:
    """Index the valid records of ``seg`` into ``found`` (the newest of each key) and
    ``dups``; resync past anything else. The offset where the last valid record ends."""
    off = end = valid = 0
    while off + HDR_SIZE <= seg.size:
        rec = record_at(seg, off)
        if rec is None:
            off = next_magic(seg, off + 1)
            continue
        key, loc = rec
        table.gen = max(table.gen, loc.gen)  # even a copy that loses: new writes must win
        old = found.get(key)
        if old is not None:
            dups.setdefault(key, [old]).append(loc)
        if old is None or loc.gen >= old.gen:
            found[key] = loc
        off = end = off + loc.rec_len
        valid += loc.rec_len
    report.skipped_bytes += end - valid
    return end


def record_at(seg: Segment, off: int) -> tuple[str, Loc] | None:
    """The record whose header and key verify at ``off``, if any (payload unread). ``O(1)``
    reads."""
    head = os.pread(seg.fd, HDR_SIZE + MAX_KEY_BYTES, off)
    parsed = parse_header(head)
    if parsed is None:
        return None
    flags, key_len, stored_len, raw_len, gen, crc = parsed
    kb = head[HDR_SIZE : HDR_SIZE + key_len]
    if len(kb) != key_len or off + HDR_SIZE + key_len + stored_len > seg.size or not header_ok(head, kb):
        return None
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        return None
    return key, Loc(seg, off, key_len, stored_len, raw_len, flags, gen, crc)


def next_magic(seg: Segment, off: int) -> int:
    """The offset of the next ``MAGIC`` at or after ``off``, else ``seg.size``.
    ``O(bytes skipped)``."""
    while off + len(MAGIC) <= seg.size:
        buf = os.pread(seg.fd, min(RESYNC_CHUNK, seg.size - off), off)
        if len(buf) < len(MAGIC):
            break
        hit = buf.find(MAGIC)
        if hit >= 0:
            return off + hit
        off += len(buf) - len(MAGIC) + 1  # a magic may straddle the chunk boundary
    return seg.size


def payload_ok(loc: Loc) -> bool:
    """Whether the stored payload at ``loc`` is whole and matches its checksum.
    ``O(payload bytes)``."""
    buf = os.pread(loc.seg.fd, loc.stored_len, loc.offset + HDR_SIZE + loc.key_len)
    return len(buf) == loc.stored_len and crc32(buf) == loc.payload_crc
