"""Appending pages to a :class:`~hiradix.storage.file.FileStorage`'s segments.

:class:`Writer` builds each record (compressed and checksummed outside the lock), reserves
space for a whole batch under one lock round, writes each run of records that landed back
to back in one segment with one ``pwritev`` of ``[header, key, payload, ...]`` straight from
the callers' buffers (resumed after short writes), then publishes them under one more lock
round: a record is indexed unless a newer write of its key won meanwhile (or, for a
compaction move, its key changed at all). A record counts as stored only once all its bytes
are in the file; a run that fails part-way keeps the records it completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from hiradix.storage.base import StorageError
from hiradix.storage.file.records import FLAG_LZ4, HDR_SIZE, IOV_RUN, crc32, header
from hiradix.storage.file.segments import Loc, Placed, Segment, SegmentTable

__all__ = ["Appended", "Rec", "Writer", "skip"]


class Rec:
    """A record to append: built outside the lock (:meth:`Writer.record`)."""

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
        expect: Loc | None,
    ) -> None:
        self.key, self.kb, self.payload, self.flags = key, kb, payload, flags
        self.raw_len, self.crc = raw_len, crc
        self.gen = gen  # None: a new write; set: a compaction move keeping its generation
        self.expect = expect  # compaction: publish only if the key still points here

    @property
    def rec_len(self) -> int:
        return HDR_SIZE + len(self.kb) + len(self.payload)


class Appended(NamedTuple):
    """What :meth:`Writer.append_many` did: whether each record is stored, the
    publication's sequence number for a sync round (0: nothing to sync), and whether the
    dead bytes now call for a compaction."""

    stored: list[bool]
    seq: int
    compaction_due: bool


def skip(iov: list[Any], n: int) -> list[Any]:
    """``iov`` without its first ``n`` bytes (after a short ``pwritev``). ``O(len(iov))``.

    >>> [bytes(b) for b in skip([b"ab", b"cde"], 3)]
    [b'de']
    """
    for i, buf in enumerate(iov):
        size = memoryview(buf).nbytes
        if n < size:
            return [memoryview(buf).cast("B")[n:], *iov[i + 1 :]]
        n -= size
    return []


class Writer:
    """Batched appends into ``table``. ``pwritev`` is the system call (a test's stand-in
    injects a full disk or a torn write); ``lz4`` is ``lz4.block`` to compress with, or
    ``None``; ``failed(op, key, exc)`` is told of a write that fails, ``count(evictions=n)``
    of pages evicted to make room. Thread-safe."""

    def __init__(
        self,
        table: SegmentTable,
        *,
        pwritev: Callable[[int, list[Any], int], int],
        lz4: Any,
        failed: Callable[[str, str, BaseException], None],
        count: Callable[..., None],
    ) -> None:
        self.table = table
        self.pwritev = pwritev
        self.lz4 = lz4
        self.failed = failed
        self.count = count

    def record(self, key: str, data: memoryview) -> Rec | None:
        """The record of ``data`` under ``key`` (compressed where that makes it smaller,
        checksummed); ``None`` if it could never fit the capacity. ``O(page bytes)``."""
        raw_len = len(data)
        payload: Any = data
        flags = 0
        if self.lz4 is not None:
            packed = self.lz4.compress(data, store_size=False)
            if len(packed) < raw_len:
                payload, flags = packed, FLAG_LZ4
        kb = key.encode()
        cap = self.table.capacity_bytes
        if cap is not None and HDR_SIZE + len(kb) + len(payload) > cap:
            return None
        return Rec(key, kb, payload, flags, raw_len, crc32(payload), None, None)

    def append_many(self, recs: list[Rec | None]) -> Appended:
        """Append records (``None``: not stored): reserve, write, publish (module
        docstring). ``StorageError`` once the storage is closed. ``O(total bytes)``."""
        plan = self.reserve(recs)
        written = [False] * len(recs)
        try:
            p = 0
            while p < len(plan):
                q = p + 1
                while q < len(plan) and q - p < IOV_RUN and plan[q][1] is plan[p][1]:
                    q += 1
                self._write_run(recs, plan[p:q], written)
                p = q
        finally:
            published, seq, evicted, need_compact = self.publish(recs, plan, written)
        if evicted:
            self.count(evictions=evicted)
        return Appended(published, seq, need_compact)

    def reserve(self, recs: list[Rec | None]) -> list[Placed]:
        """Place each record (under one lock round): its segment (a full active one is
        sealed and a fresh one opened), offset and generation; the segments are pinned
        (``pending``) until :meth:`publish`."""
        plan: list[Placed] = []
        table = self.table
        with table.lock:
            if table.closed:
                raise StorageError("storage is closed")
            for i, rec in enumerate(recs):
                if rec is None:
                    continue
                if rec.gen is None:
                    table.gen += 1
                gen = table.gen if rec.gen is None else rec.gen
                seg = table.active
                if seg.size and seg.size + rec.rec_len > table.segment_bytes:
                    seg.sealed = True
                    seg = table.active = table.new_segment()
                plan.append((i, seg, seg.size, gen))
                seg.size += rec.rec_len
                table.disk_bytes += rec.rec_len
                seg.pending += 1
        return plan

    def _write_run(self, recs: list[Rec | None], run: list[Placed], written: list[bool]) -> None:
        """Write a run of records placed back to back in one segment with one ``pwritev``
        (resumed after short writes); mark in ``written`` those whose bytes all landed."""
        iov: list[Any] = []
        total = 0
        for i, _, _, gen in run:
            rec = recs[i]
            assert rec is not None
            iov += (header(rec.kb, rec.flags, len(rec.payload), rec.raw_len, gen, rec.crc), rec.kb, rec.payload)
            total += rec.rec_len
        first, seg, start, _ = run[0]
        done = self.write_all(seg.fd, iov, start, total, recs[first].key)  # type: ignore[union-attr]
        for i, _, offset, _ in run:
            rec = recs[i]
            assert rec is not None
            written[i] = offset + rec.rec_len - start <= done

    def write_all(self, fd: int, iov: list[Any], offset: int, total: int, key: str) -> int:
        """``pwritev`` the ``total`` bytes of ``iov`` at ``offset``, resuming after short
        writes; the bytes written in a row from ``offset`` (fewer if the disk fails:
        counted and logged as a failed set)."""
        done = 0
        while done < total:
            try:
                n = self.pwritev(fd, iov, offset + done)
            except OSError as exc:  # a full disk, an I/O error: these records are not stored
                self.failed("set", key, exc)
                return done
            if n <= 0:
                self.failed("set", key, OSError(f"short write: {done} of {total} bytes"))
                return done
            done += n
            iov = skip(iov, n)
        return done

    def publish(
        self, recs: list[Rec | None], plan: list[Placed], written: list[bool]
    ) -> tuple[list[bool], int, int, bool]:
        """Under one lock round: unpin the segments, index each written record unless a
        newer write of its key (or, for a compaction move, any change) won, account the
        bytes to sync, evict to capacity and drop emptied segments. Returns whether each
        record is stored, the publication's sequence number (0: nothing to sync), the
        pages evicted, and whether a compaction is due."""
        published = [False] * len(recs)
        seq = 0
        table = self.table
        with table.lock:
            wrote = 0
            unsynced = table.unsynced
            for i, seg, offset, gen in plan:
                seg.pending -= 1
                rec = recs[i]
                assert rec is not None
                if not written[i]:
                    continue
                self._link_newest(rec, seg, offset, gen)
                # A write that lost to a newer one still succeeded: the key holds newer data.
                published[i] = True
                if table.durable:
                    unsynced.segments.add(seg.id)
                    wrote += rec.rec_len
            if wrote:
                unsynced.write_seq += 1
                seq = unsynced.write_seq
                unsynced.bytes += wrote
                if unsynced.bytes >= table.fsync_bytes:
                    table.wake.notify()
            evicted = table.evict_to_capacity()
            for seg in {id(s): s for _, s, _, _ in plan}.values():
                table.maybe_drop(seg)
            need_compact = table.compaction_due()
        return published, seq, evicted, need_compact

    def _link_newest(self, rec: Rec, seg: Segment, offset: int, gen: int) -> None:
        """Index ``rec`` (written at ``offset`` of ``seg``) unless it lost. Caller holds the lock."""
        index = self.table.index
        cur = index.get(rec.key)
        # A new write loses only to a newer one; a compaction move only to any change.
        publish = (cur is rec.expect) if rec.expect is not None else (cur is None or cur.gen <= gen)
        if publish:
            loc = Loc(seg, offset, len(rec.kb), len(rec.payload), rec.raw_len, rec.flags, gen, rec.crc)
            self.table.link_loc(rec.key, loc)
            if rec.expect is None:
                index.move_to_end(rec.key)
