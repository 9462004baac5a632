"""The segment table (hiradix/storage/file/segments.py): segment files, the index and its
byte counts, eviction, dropping and what a sync round must cover."""

from __future__ import annotations

from pathlib import Path

from hiradix.storage.file.records import HDR_SIZE
from hiradix.storage.file.segments import Loc, Segment, SegmentTable


def table(root: Path, fsync: str = "none", capacity: int | None = None) -> SegmentTable:
    t = SegmentTable(root, segment_bytes=1000, capacity_bytes=capacity, fsync=fsync)
    t.active = t.new_segment()
    return t


def loc(seg: Segment, offset: int, payload: int = 100, gen: int = 1) -> Loc:
    seg.size = max(seg.size, offset + HDR_SIZE + 1 + payload)
    return Loc(seg, offset, 1, payload, payload, 0, gen, 0)


def test_segments_are_numbered_files(tmp_path: Path) -> None:
    t = table(tmp_path)
    second = t.new_segment()
    assert [s.id for s in t.segments.values()] == [1, 2] and second.path == tmp_path / "seg-00000002.hrx"
    assert second.path.exists() and not t.unsynced.directory
    (tmp_path / "d").mkdir()
    assert table(tmp_path / "d", fsync="batch").unsynced.directory  # synced with its first pages
    t.close_fds()
    assert all(s.fd == -1 for s in t.segments.values())


def test_linking_counts_live_bytes_and_a_relink_keeps_the_lru_place(tmp_path: Path) -> None:
    t = table(tmp_path)
    seg = t.active
    a, b = loc(seg, 0), loc(seg, 200)
    t.link_loc("a", a)
    t.link_loc("b", b)
    assert t.live_bytes == a.rec_len + b.rec_len and seg.live_records == 2
    newer = loc(seg, 400, payload=50, gen=2)
    t.link_loc("a", newer)  # the old record is unlinked, "a" stays least recently used
    assert list(t.index) == ["a", "b"] and t.index["a"] is newer
    assert t.live_bytes == newer.rec_len + b.rec_len and seg.live_records == 2


def test_eviction_takes_the_least_recently_used(tmp_path: Path) -> None:
    t = table(tmp_path)
    for i in range(4):
        t.link_loc(f"k{i}", loc(t.active, i * 200))
    t.index.move_to_end("k0")
    t.capacity_bytes = 2 * t.index["k0"].rec_len
    assert t.evict_to_capacity() == 2 and list(t.index) == ["k3", "k0"]


def test_a_sealed_empty_segment_is_dropped_once_nobody_uses_it(tmp_path: Path) -> None:
    t = table(tmp_path)
    seg = t.active
    t.link_loc("a", loc(seg, 0))
    seg.sealed = True
    seg.readers = 1
    assert t.forget("a", t.index["a"]) and seg.id in t.segments  # a reader still holds it
    seg.readers = 0
    t.disk_bytes = seg.size
    t.maybe_drop(seg)
    assert seg.id not in t.segments and not seg.path.exists() and t.disk_bytes == 0 and seg.fd == -1


def test_with_fsync_a_dropped_segment_waits_for_a_sync_round(tmp_path: Path) -> None:
    t = table(tmp_path, fsync="always")
    seg = t.active
    seg.sealed = True
    t.unsynced.segments.add(seg.id)
    t.maybe_drop(seg)
    assert seg.path.exists() and t.unsynced.unlink == [seg.path] and not t.unsynced.segments


def test_forget_only_the_record_the_key_points_at(tmp_path: Path) -> None:
    t = table(tmp_path)
    old, new = loc(t.active, 0), loc(t.active, 200, gen=2)
    t.link_loc("a", new)
    assert not t.forget("a", old) and t.index["a"] is new
    assert t.forget("a", new) and not t.index and t.live_bytes == 0


def test_compaction_is_due_when_dead_bytes_pass_the_bound(tmp_path: Path) -> None:
    t = table(tmp_path)
    t.link_loc("a", loc(t.active, 0))
    t.disk_bytes = t.live_bytes + t.segment_bytes
    assert not t.compaction_due()
    t.disk_bytes += 1
    assert t.compaction_due()


def test_clear_deletes_the_segments_and_starts_an_empty_one(tmp_path: Path) -> None:
    t = table(tmp_path, fsync="batch")
    first = t.active
    t.link_loc("a", loc(first, 0))
    t.unsynced.unlink.append(tmp_path / "seg-00000099.hrx")
    t.clear()
    assert not t.index and t.live_bytes == 0 and not t.unsynced.unlink
    assert t.active is not first and list(t.segments) == [t.active.id]
