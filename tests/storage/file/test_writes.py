"""The write path (hiradix/storage/file/writes.py): records, reservation, one pwritev a
run, resumed short writes, failed writes, and who wins a race."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from hiradix.storage.base import StorageError
from hiradix.storage.file.records import HDR_SIZE, parse_header
from hiradix.storage.file.writes import skip
from tests.storage.file.parts import make, page


def test_a_batch_is_one_pwritev_of_back_to_back_records(tmp_path: Path) -> None:
    calls: list[int] = []

    def pwritev(fd: int, iov: list[Any], offset: int) -> int:
        calls.append(len(iov))
        return os.pwritev(fd, iov, offset)

    p = make(tmp_path, pwritev=pwritev)
    assert p.put(*[(f"k{i}", page(i)) for i in range(4)]) == [True] * 4
    assert calls == [12]  # header, key, payload for each
    locs = [p.table.index[f"k{i}"] for i in range(4)]
    assert [loc.offset for loc in locs] == [i * (HDR_SIZE + 2 + 256) for i in range(4)]
    assert [loc.gen for loc in locs] == [1, 2, 3, 4]
    head = os.pread(locs[1].seg.fd, HDR_SIZE, locs[1].offset)
    assert parse_header(head) == (0, 2, 256, 256, 2, locs[1].payload_crc)


def test_a_full_segment_is_sealed_and_a_new_one_takes_the_rest(tmp_path: Path) -> None:
    rec = HDR_SIZE + 2 + 256
    p = make(tmp_path, segment_bytes=2 * rec)
    first = p.table.active
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(3)]))
    assert first.sealed and p.table.active is not first and p.table.index["k2"].seg is p.table.active


def test_a_page_larger_than_the_capacity_is_refused(tmp_path: Path) -> None:
    p = make(tmp_path, capacity_bytes=100)
    assert p.writer.record("k", memoryview(page(0))) is None
    assert p.put(("k", page(0))) == [False]


def test_short_writes_are_resumed(tmp_path: Path) -> None:
    def one_byte(fd: int, iov: list[Any], offset: int) -> int:
        return os.pwrite(fd, bytes(memoryview(iov[0]).cast("B")[:1]), offset)

    p = make(tmp_path, pwritev=one_byte)
    assert p.put(("k", page(1, 16))) == [True] and p.get("k", 16) == page(1, 16)
    assert [bytes(b) for b in skip([b"ab", b"cd"], 1)] == [b"b", b"cd"] and skip([b"ab"], 2) == []


def test_a_failed_write_stores_only_the_records_that_landed(tmp_path: Path) -> None:
    rec = HDR_SIZE + 2 + 256

    def half(fd: int, iov: list[Any], offset: int) -> int:
        data = b"".join(bytes(b) for b in iov)
        if offset == 0:
            return os.pwrite(fd, data[: rec + 10], offset)  # the first record and a bit
        raise OSError(errno.ENOSPC, "No space left on device")

    p = make(tmp_path, pwritev=half)
    assert p.put(("k0", page(0)), ("k1", page(1))) == [True, False]
    assert list(p.table.index) == ["k0"] and p.calls.failed[0][0] == "set"
    assert p.table.active.pending == 0 and p.table.disk_bytes == 2 * rec  # the dead bytes stay reserved


def test_a_write_that_lost_to_a_newer_one_is_stored_but_not_indexed(tmp_path: Path) -> None:
    p = make(tmp_path)
    old = p.writer.record("k", memoryview(page(1)))
    plan = p.writer.reserve([old])  # generation 1, written later than...
    assert p.put(("k", page(2))) == [True]  # ... generation 2
    p.writer._write_run([old], plan, written := [False])  # the race: the older write lands last
    assert p.writer.publish([old], plan, written)[0] == [True]
    assert p.get("k", 256) == page(2)


def test_publication_counts_what_a_sync_round_must_cover(tmp_path: Path) -> None:
    p = make(tmp_path, fsync="batch", fsync_bytes=1)
    result = p.writer.append_many([p.writer.record("k", memoryview(page(0)))])
    assert result.stored == [True] and result.seq == 1 and not result.compaction_due
    assert p.table.unsynced.segments == {p.table.active.id} and p.table.unsynced.bytes == HDR_SIZE + 1 + 256


def test_eviction_to_capacity_is_counted(tmp_path: Path) -> None:
    rec = HDR_SIZE + 2 + 256
    p = make(tmp_path, capacity_bytes=2 * rec)
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(3)]))
    assert list(p.table.index) == ["k1", "k2"] and p.calls.counts == {"evictions": 1}


def test_a_closed_table_refuses_writes(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.close()
    with pytest.raises(StorageError, match="closed"):
        p.put(("k", page(0)))
