"""Reading pages back from a :class:`~hiradix.storage.file.FileStorage`'s segments.

:class:`Reader` looks a batch of keys up under one lock round (pinning their segments
against reclaim), reads each run of records that lie back to back in a segment with one
``os.preadv`` of ``[header, payload, ...]`` straight into the callers' buffers, and checks
every record's header and payload checksums. A record that fails is unindexed and counted
as corrupt: a miss, never wrong bytes. An I/O error is a miss for its run, not corruption.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hiradix.storage.base import StorageError
from hiradix.storage.file.records import FLAG_LZ4, HDR_SIZE, IOV_RUN, crc32, header_ok, parse_header
from hiradix.storage.file.segments import Loc, SegmentTable

__all__ = ["Reader", "lz4_block", "run_end", "verify"]


def lz4_block() -> Any:
    """``lz4.block``, imported on first use: records are flagged one by one, so an instance
    without compression still reads lz4 records an earlier instance wrote."""
    import lz4.block

    return lz4.block


def run_end(locs: list[Loc | None], i: int) -> int:
    """The end of the run of uncompressed records from ``locs[i]`` on that lie back to back
    in its segment (``IOV_RUN`` records at most: one ``preadv``). ``O(run)``."""
    loc = locs[i]
    assert loc is not None
    j, end = i + 1, loc.offset + loc.rec_len
    while j < len(locs) and j - i < IOV_RUN:
        nxt = locs[j]
        if nxt is None or nxt.seg is not loc.seg or nxt.offset != end or nxt.flags & FLAG_LZ4:
            break
        end += nxt.rec_len
        j += 1
    return j


def verify(key: str, loc: Loc, head: bytes | bytearray, payload: Any) -> bool:
    """Whether a record read back is the one the index has for ``key``: its header as
    indexed and self-consistent, its key, and its payload's checksum. ``O(payload bytes)``."""
    kb = memoryview(head)[HDR_SIZE:]
    return (
        parse_header(head) == (loc.flags, loc.key_len, loc.stored_len, loc.raw_len, loc.gen, loc.payload_crc)
        and header_ok(head, kb)
        and kb == key.encode()
        and crc32(payload) == loc.payload_crc
    )


class Reader:
    """Batched, verified reads of ``table``'s records. ``failed(op, key, exc)`` is told of
    an I/O error, ``count(corrupt=n)`` of records that failed verification. Thread-safe."""

    def __init__(
        self, table: SegmentTable, *, failed: Callable[[str, str, BaseException], None], count: Callable[..., None]
    ) -> None:
        self.table = table
        self.failed = failed
        self.count = count

    def read_many(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``'s page; whether each was served (absent,
        of another length or failing verification: ``False``). ``StorageError`` once the
        storage is closed. ``O(total bytes)``."""
        locs = self.pin(keys, outs)
        results = [False] * len(keys)
        bad: list[int] = []
        try:
            i = 0
            while i < len(keys):
                i = self._read_run(keys, outs, locs, i, results, bad)
        finally:
            self.unpin(locs)
        for k in bad:
            rec = locs[k]
            assert rec is not None
            with self.table.lock:
                self.table.forget(keys[k], rec)
            self.count(corrupt=1)
        return results

    def pin(self, keys: list[str], outs: list[memoryview]) -> list[Loc | None]:
        """Look ``keys`` up under one lock round: the record of each key whose page has the
        length of its ``out`` (touched, and its segment pinned against reclaim), else
        ``None``. ``O(len(keys))``."""
        locs: list[Loc | None] = [None] * len(keys)
        table = self.table
        with table.lock:
            if table.closed:
                raise StorageError("storage is closed")
            index = table.index
            for i, key in enumerate(keys):
                loc = index.get(key)
                if loc is not None and loc.raw_len == len(outs[i]):
                    index.move_to_end(key)
                    loc.seg.readers += 1
                    locs[i] = loc
        return locs

    def unpin(self, locs: list[Loc | None]) -> None:
        """Undo :meth:`pin`: release the segments (one dropped meanwhile goes now)."""
        with self.table.lock:
            segs = {}
            for loc in locs:
                if loc is not None:
                    loc.seg.readers -= 1
                    segs[loc.seg.id] = loc.seg
            for seg in segs.values():
                self.table.maybe_drop(seg)

    def _read_run(
        self,
        keys: list[str],
        outs: list[memoryview],
        locs: list[Loc | None],
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
        j = run_end(locs, i)
        heads = [bytearray(HDR_SIZE + locs[k].key_len) for k in range(i, j)]  # type: ignore[union-attr]
        iov: list[Any] = []
        for k in range(i, j):
            iov += (heads[k - i], outs[k])
        try:
            got = os.preadv(loc.seg.fd, iov, loc.offset)
        except OSError as exc:  # an I/O error is a miss for the run, not corruption
            self.failed("get", keys[i], exc)
            return j
        for k in range(i, j):
            rec = locs[k]
            assert rec is not None
            ok = rec.offset + rec.rec_len - loc.offset <= got and verify(keys[k], rec, heads[k - i], outs[k])
            results[k] = ok
            if not ok:
                bad.append(k)
        return j

    @staticmethod
    def _read_compressed(key: str, loc: Loc, out: memoryview) -> bool:
        head = bytearray(HDR_SIZE + loc.key_len)
        payload = bytearray(loc.stored_len)
        if os.preadv(loc.seg.fd, [head, payload], loc.offset) != loc.rec_len or not verify(key, loc, head, payload):
            return False
        raw = lz4_block().decompress(payload, uncompressed_size=loc.raw_len)
        if len(raw) != loc.raw_len:
            return False
        out[:] = raw
        return True
