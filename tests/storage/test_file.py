"""FileStorage specifics: what the disk can do to a page (bit flips, truncation, torn
appends), restart, lz4, compaction and the errors of a bad directory. The shared
contract runs in ``test_storage_contract.py``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hiradix.storage import FileStorage, StorageConfig, StorageError, create_backend
from hiradix.storage.file import _HDR_SIZE, MAGIC, default_path
from tests.storage.test_contract import PAGE, key, payload

REC = _HDR_SIZE + 64 + PAGE  # one uncompressed record of a PAGE-byte page under a 64-char key


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("seg-*.hrx"))


def fill(root: Path, n: int, **opts: object) -> None:
    with FileStorage(path=root, **opts) as s:  # type: ignore[arg-type]
        assert s.batch_set([key(i) for i in range(n)], [payload(i) for i in range(n)])


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_records_are_packed_in_one_segment(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    (seg,) = segments(tmp_path)
    assert seg.stat().st_size == 3 * REC
    assert seg.read_bytes()[:4] == MAGIC


def test_restart_rebuilds_the_index(tmp_path: Path) -> None:
    fill(tmp_path, 5)
    with FileStorage(path=tmp_path) as s:
        assert s.batch_exists([key(i) for i in range(6)]) == 5
        assert [bytes(g.numpy()) for g in s.batch_get([key(i) for i in range(5)])] == [payload(i) for i in range(5)]
        st = s.get_stats()
        assert st.extra["recovered_pages"] == 5 and st.pages == 5 and st.extra["truncated_bytes"] == 0
        s.set(key(1), payload(1, version=7))  # overwrite: the newer generation wins after restart
    with FileStorage(path=tmp_path) as s:
        assert bytes(s.get(key(1)).numpy()) == payload(1, version=7)
        assert s.get_stats().pages == 5


def test_flipped_payload_byte_is_a_miss_and_removed(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    (seg,) = segments(tmp_path)
    flip(seg, REC + _HDR_SIZE + 64 + 100)  # inside page 1's payload
    with FileStorage(path=tmp_path) as s:
        assert s.batch_exists([key(0), key(1), key(2)]) == 3  # headers are fine
        assert s.get(key(1)) is None
        st = s.get_stats()
        assert st.corrupt == 1 and st.pages == 2
        assert not s.exists(key(1))
        assert bytes(s.get(key(2)).numpy()) == payload(2)
        assert s.set(key(1), payload(1)) and bytes(s.get(key(1)).numpy()) == payload(1)


def test_flipped_payload_byte_in_a_live_instance(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path) as s:
        s.set(key(0), payload(0))
        flip(segments(tmp_path)[-1], _HDR_SIZE + 64 + PAGE - 1)
        assert s.get(key(0)) is None and s.get_stats().corrupt == 1


@pytest.mark.parametrize("where", [0, 6, 20, _HDR_SIZE - 1, _HDR_SIZE + 3], ids=["magic", "flags", "len", "crc", "key"])
def test_flipped_header_byte_costs_only_that_record(tmp_path: Path, where: int) -> None:
    fill(tmp_path, 3)
    (seg,) = segments(tmp_path)
    flip(seg, REC + where)  # page 1's header
    with FileStorage(path=tmp_path) as s:
        assert s.get(key(1)) is None  # never wrong bytes
        assert [bytes(s.get(key(i)).numpy()) for i in (0, 2)] == [payload(0), payload(2)]
        st = s.get_stats()
        assert st.pages == 2 and st.extra["skipped_bytes"] == REC and st.extra["truncated_bytes"] == 0
    assert seg.stat().st_size == 3 * REC  # the damaged record stays as dead bytes, reclaimed by compaction


@pytest.mark.parametrize("cut", [1, PAGE // 2, REC - _HDR_SIZE, REC - 10])
def test_truncated_segment(tmp_path: Path, cut: int) -> None:
    fill(tmp_path, 3)
    (seg,) = segments(tmp_path)
    os.truncate(seg, 3 * REC - cut)
    with FileStorage(path=tmp_path) as s:
        assert s.batch_exists([key(0), key(1), key(2)]) == 2
        assert s.get(key(2)) is None
    assert seg.stat().st_size == 2 * REC


def test_truncated_under_a_live_instance(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path) as s:
        s.batch_set([key(0), key(1)], [payload(0), payload(1)])
        os.truncate(segments(tmp_path)[-1], REC + 100)
        assert s.get(key(1)) is None and s.get_stats().corrupt == 1
        assert bytes(s.get(key(0)).numpy()) == payload(0)


def test_torn_append_is_removed(tmp_path: Path) -> None:
    # A crash in the middle of a pwritev: the header and half the payload made it.
    fill(tmp_path, 2)
    (seg,) = segments(tmp_path)
    whole = seg.read_bytes()
    with open(seg, "ab") as f:
        f.write(whole[: REC // 2])  # a copy of record 0's first half, as a torn third record
    (tmp_path / "seg-00000001.hrx.tmp").write_bytes(b"stray")  # not ours: ignored, kept
    (tmp_path / "notes.txt").write_text("x")
    with FileStorage(path=tmp_path) as s:
        assert s.get_stats().pages == 2
        assert [bytes(g.numpy()) for g in s.batch_get([key(0), key(1)])] == [payload(0), payload(1)]
    assert seg.stat().st_size == 2 * REC
    assert (tmp_path / "notes.txt").exists()


def test_zero_filled_tail_is_removed(tmp_path: Path) -> None:
    # Preallocated or never-written blocks after a crash read back as zeros.
    fill(tmp_path, 1)
    (seg,) = segments(tmp_path)
    with open(seg, "ab") as f:
        f.write(bytes(3 * PAGE))
    with FileStorage(path=tmp_path) as s:
        assert s.get_stats().pages == 1 and s.get(key(0)) is not None


def test_restart_keeps_capacity_and_recency_by_generation(tmp_path: Path) -> None:
    fill(tmp_path, 4)
    with FileStorage(path=tmp_path, capacity_bytes=2 * REC) as s:
        assert [s.exists(key(i)) for i in range(4)] == [False, False, True, True]  # newest kept
        assert s.get_stats().bytes_used <= 2 * REC


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_lz4(tmp_path: Path, compression: str) -> None:
    zeros = bytes(16 * PAGE)
    with FileStorage(path=tmp_path, compression=compression) as s:
        assert s.capabilities.compression == (compression == "lz4")
        assert s.capabilities.zero_copy == (compression == "none")
        s.batch_set([key(0), key(1)], [zeros, payload(1)])  # compressible, incompressible
        disk = s.get_stats().extra["disk_bytes"]
        assert (disk < 16 * PAGE) == (compression == "lz4")
        assert bytes(s.get(key(0)).numpy()) == zeros
        assert bytes(s.get(key(1)).numpy()) == payload(1)
    # The flag is per record: any instance reads either kind.
    other = "none" if compression == "lz4" else "lz4"
    with FileStorage(path=tmp_path, compression=other) as s:
        assert bytes(s.get(key(0)).numpy()) == zeros and bytes(s.get(key(1)).numpy()) == payload(1)


def test_lz4_corrupt_payload_is_a_miss(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path, compression="lz4") as s:
        s.set(key(0), bytes(8 * PAGE))
        flip(segments(tmp_path)[-1], _HDR_SIZE + 64 + 5)
        assert s.get(key(0)) is None and s.get_stats().corrupt == 1


def test_rotation_and_compaction_bound_the_disk(tmp_path: Path) -> None:
    expected = {i: payload(i) for i in range(6)}
    with FileStorage(path=tmp_path, segment_bytes=4 * REC) as s:
        assert s.batch_set([key(i) for i in range(6)], list(expected.values()))
        for version in range(1, 12):  # rewrite pages 0-2 only: page 3 pins segment 1, mostly dead
            expected.update({i: payload(i, version=version) for i in range(3)})
            assert s.batch_set([key(i) for i in range(3)], [expected[i] for i in range(3)])
            st = s.get_stats()
            assert st.extra["disk_bytes"] <= 2 * st.bytes_used + 2 * 4 * REC
        assert st.pages == 6 and st.extra["compactions"] >= 1
        assert sum(p.stat().st_size for p in segments(tmp_path)) == st.extra["disk_bytes"]
        got = s.batch_get([key(i) for i in range(6)])
        assert [bytes(g.numpy()) for g in got] == list(expected.values())
    with FileStorage(path=tmp_path) as s:
        got = s.batch_get([key(i) for i in range(6)])
        assert [bytes(g.numpy()) for g in got] == list(expected.values())


def test_evicted_segments_are_deleted(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path, segment_bytes=2 * REC, capacity_bytes=4 * REC) as s:
        for i in range(20):
            s.set(key(i), payload(i))
        st = s.get_stats()
        assert st.pages == 4 and st.evictions == 16
        assert st.extra["segments"] <= 4 and len(segments(tmp_path)) == st.extra["segments"]


def test_concurrent_writers_rotation_and_readers(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with FileStorage(path=tmp_path, segment_bytes=5 * REC, capacity_bytes=20 * REC) as s:

        def worker(t: int) -> None:
            try:
                for r in range(25):
                    i = (t * 7 + r) % 30
                    s.set(key(i), payload(i))
                    got = s.get(key((i + 3) % 30))
                    assert got is None or bytes(got.numpy()) == payload((i + 3) % 30)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        st = s.get_stats()
        assert st.errors == 0 and st.corrupt == 0 and st.bytes_used <= 20 * REC
    with FileStorage(path=tmp_path) as s:
        for k, g in zip(range(30), s.batch_get([key(i) for i in range(30)]), strict=True):
            assert g is None or bytes(g.numpy()) == payload(k)


def test_directory_in_use(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path), pytest.raises(StorageError, match="in use"):
        FileStorage(path=tmp_path)
    FileStorage(path=tmp_path).close()  # released on close


def test_unusable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot use"):
        FileStorage(path=blocker / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StorageError):
            FileStorage(path=ro)
    finally:
        ro.chmod(0o700)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="compression"):
        FileStorage(path="/tmp/unused-hiradix", compression="zstd")
    with pytest.raises(ValueError, match="capacity_bytes"):
        FileStorage(path="/tmp/unused-hiradix", capacity_bytes=0)
    with pytest.raises(ValueError, match="segment_bytes"):
        FileStorage(path="/tmp/unused-hiradix", segment_bytes=-1)


def test_closed_instance_misses(tmp_path: Path) -> None:
    s = FileStorage(path=tmp_path)
    s.set(key(0), payload(0))
    s.close()
    s.close()
    assert s.get(key(0)) is None and s.set(key(1), payload(1)) is False
    assert s.get_stats().errors == 2


def test_tp_ranks_get_their_own_directory(tmp_path: Path) -> None:
    cfgs = [StorageConfig(tp_rank=r, tp_size=2, extra_config={"path": str(tmp_path)}) for r in range(2)]
    stores = [create_backend("file", c) for c in cfgs]
    try:
        assert [s.path.name for s in stores] == ["tp0of2", "tp1of2"]  # type: ignore[attr-defined]
        stores[0].set(key(0), payload(0))
        assert not stores[1].exists(key(0))
    finally:
        for s in stores:
            s.close()


def test_fsync_mode(tmp_path: Path) -> None:
    with FileStorage(path=tmp_path, fsync=True) as s:
        assert s.batch_set([key(0)], [payload(0)]) and s.fsync == "always"
    with FileStorage(path=tmp_path) as s:
        assert bytes(s.get(key(0)).numpy()) == payload(0) and s.fsync == "none"


def test_batch_read_of_a_run_with_a_corrupt_middle_record(tmp_path: Path) -> None:
    # One preadv covers the whole run; each record is still verified on its own.
    with FileStorage(path=tmp_path) as s:
        s.batch_set([key(i) for i in range(4)], [payload(i) for i in range(4)])
        flip(segments(tmp_path)[-1], 2 * REC + _HDR_SIZE + 64 + 7)
        got = s.batch_get([key(i) for i in range(4)], [bytearray(PAGE) for _ in range(4)])
        assert [g is not None for g in got] == [True, True, False, True]
        assert [bytes(got[i]) for i in (0, 1, 3)] == [payload(i) for i in (0, 1, 3)]
        os.truncate(segments(tmp_path)[-1], 3 * REC + 10)  # the last one now short-reads
        got = s.batch_get([key(0), key(1), key(3)])
        assert [g is not None for g in got] == [True, True, False]
        assert s.get_stats().corrupt == 2 and s.get_stats().pages == 2


def test_the_default_directory_is_the_users_cache_not_a_shared_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "hiradix" / "l3"
    store = FileStorage()
    try:
        assert store.path == tmp_path / "cache" / "hiradix" / "l3" and store.path.is_dir()
    finally:
        store.close()
