"""Restart (hiradix/storage/file/recovery.py): the index rebuilt from headers, newest
generation first, damage skipped, torn tails cut, a torn newer copy falling back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hiradix.storage.file.recovery as recovery
from hiradix.storage.file.records import HDR_SIZE, MAGIC
from hiradix.storage.file.recovery import next_magic, record_at, recover
from hiradix.storage.file.segments import SegmentTable
from tests.storage.file.parts import make, page

REC = HDR_SIZE + 2 + 256


def reopen(root: Path, capacity: int | None = None) -> tuple[SegmentTable, recovery.Recovered]:
    table = SegmentTable(root, segment_bytes=1 << 20, capacity_bytes=capacity, fsync="none")
    return table, recover(table)


def test_the_newest_generation_of_each_key_wins(tmp_path: Path) -> None:
    p = make(tmp_path, segment_bytes=2 * REC)
    assert all(p.put(("k0", page(0)), ("k1", page(1))))
    assert all(p.put(("k0", page(5))))  # a newer k0, in the next segment
    p.close()
    table, found = reopen(tmp_path)
    assert found.pages == 2 and table.gen == 3 and table.index["k0"].gen == 3
    assert list(table.index) == ["k1", "k0"]  # recency from generations
    table.close_fds()


def test_a_torn_tail_is_cut_and_garbage_between_records_skipped(tmp_path: Path) -> None:
    p = make(tmp_path)
    assert all(p.put(("k0", page(0)), ("k1", page(1))))
    seg = p.table.active
    p.close()
    data = seg.path.read_bytes()
    garbage = b"junk" + MAGIC + bytes(10)
    seg.path.write_bytes(data[:REC] + garbage + data[REC:] + data[: REC // 2])
    table, found = reopen(tmp_path)
    assert sorted(table.index) == ["k0", "k1"]
    assert found.skipped_bytes == len(garbage) and found.truncated_bytes == REC // 2
    assert seg.path.stat().st_size == 2 * REC + len(garbage)
    table.close_fds()


def test_a_newer_copy_whose_payload_is_torn_falls_back_to_the_older(tmp_path: Path) -> None:
    p = make(tmp_path)
    assert all(p.put(("k", page(0))))
    assert all(p.put(("k", page(1))))
    newer = p.table.index["k"]
    os.pwrite(newer.seg.fd, b"\xff" * 8, newer.offset + HDR_SIZE + 1 + 100)
    p.close()
    table, found = reopen(tmp_path)
    assert found.pages == 1 and table.index["k"].gen == 1 and table.gen == 2  # new writes still win
    table.close_fds()


def test_capacity_applies_and_empty_segments_go(tmp_path: Path) -> None:
    p = make(tmp_path, segment_bytes=REC)
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(3)]))
    p.close()
    assert len(list(tmp_path.glob("seg-*.hrx"))) == 3  # one record each
    table, _ = reopen(tmp_path, capacity=REC)
    assert list(table.index) == ["k2"] and len(table.segments) == 1
    assert len(list(tmp_path.glob("seg-*.hrx"))) == 1
    table.close_fds()


def test_record_at_and_next_magic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = make(tmp_path)
    assert all(p.put(("k0", page(0)), ("k1", page(1))))
    seg = p.table.active
    key, loc = record_at(seg, REC)  # type: ignore[misc]
    assert key == "k1" and loc.gen == 2 and record_at(seg, 1) is None
    monkeypatch.setattr(recovery, "RESYNC_CHUNK", 7)  # a magic straddles the chunks
    assert next_magic(seg, 1) == REC and next_magic(seg, REC + 1) == seg.size
    p.close()
