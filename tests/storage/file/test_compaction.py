"""Compaction (hiradix/storage/file/compaction.py): the most dead sealed segment's live
records moved and it deleted; corrupt records dropped; a mostly live segment left alone."""

from __future__ import annotations

import os
from pathlib import Path

from hiradix.storage.file.compaction import Compactor
from hiradix.storage.file.records import HDR_SIZE
from tests.storage.file.parts import Parts, make, page

REC = HDR_SIZE + 2 + 256


def filled(root: Path) -> tuple[Parts, Compactor]:
    """Two sealed segments of four records; k0-k2 of the first overwritten (dead)."""
    p = make(root, segment_bytes=4 * REC)
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(8)]))
    assert all(p.put(*[(f"k{i}", page(i + 10)) for i in range(3)]))
    return p, Compactor(p.table, p.writer, failed=p.calls.fail, count=p.calls.count)


def test_the_most_dead_segment_is_moved_and_deleted(tmp_path: Path) -> None:
    p, c = filled(tmp_path)
    first = p.table.index["k3"].seg
    gen = p.table.index["k3"].gen
    c.compact_one()
    assert c.compactions == 1 and first.id not in p.table.segments and not first.path.exists()
    assert p.table.index["k3"].seg is p.table.active and p.table.index["k3"].gen == gen  # generation kept
    assert [p.get(f"k{i}", 256) for i in range(8)] == [page(i + 10) for i in range(3)] + [page(i) for i in range(3, 8)]


def test_a_corrupt_record_is_dropped_not_moved(tmp_path: Path) -> None:
    p, c = filled(tmp_path)
    loc = p.table.index["k3"]
    at = loc.offset + HDR_SIZE + 2 + 5
    os.pwrite(loc.seg.fd, bytes([os.pread(loc.seg.fd, 1, at)[0] ^ 1]), at)
    c.compact_one()
    assert "k3" not in p.table.index and p.calls.counts.get("corrupt") == 1


def test_a_mostly_live_segment_is_left_alone(tmp_path: Path) -> None:
    p = make(tmp_path, segment_bytes=4 * REC)
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(8)]))
    assert all(p.put(("k0", page(9))))  # one dead record of four
    c = Compactor(p.table, p.writer, failed=p.calls.fail, count=p.calls.count)
    segments = set(p.table.segments)
    c.compact_one()
    assert c.compactions == 0 and set(p.table.segments) == segments


def test_one_compaction_at_a_time(tmp_path: Path) -> None:
    _, c = filled(tmp_path)
    with c.lock:  # another thread is compacting
        c.compact_one()
    assert c.compactions == 0
