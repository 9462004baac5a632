"""Disk tier: async write-through, LRU bound, corruption as a miss, promote/warm, disabling."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest

from hiradix.peer.directory import DirectoryShard, DirEntry
from hiradix.peer.disk import DiskTier, decode_page_file, encode_page_file
from hiradix.peer.pool import SLOT_HEADER_SIZE, EvictedPage, PublishedPool

PAGE = 256
FILE = 32 + len("k0") + PAGE  # header + key + data


def data(i: int) -> bytes:
    return bytes([i % 256]) * PAGE


@pytest.fixture
def tier(tmp_path: Path):  # type: ignore[no-untyped-def]
    evicted: list[str] = []
    t = DiskTier(tmp_path / "disk", 10 * FILE, on_evict=evicted.append)
    t.evicted = evicted  # type: ignore[attr-defined]
    yield t
    t.close()


class Blocker:
    """A warm sink that parks the tier's thread until released (orders events, no sleeps)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, key: str, blob: bytes) -> None:
        self.entered.set()
        assert self.release.wait(timeout=30)


def test_write_through_and_read(tier: DiskTier) -> None:
    assert tier.enabled
    assert tier.write_async("k0", data(0))
    assert tier.exists("k0")  # queued counts as present
    assert tier.flush(timeout=30)
    assert tier.read("k0") == data(0)
    assert tier.used_bytes == FILE and len(tier) == 1 and tier.writes == 1
    assert tier.read("nope") is None
    files = list((tier.path).glob("*/*.page"))
    assert len(files) == 1 and decode_page_file(files[0].read_bytes(), "k0") == data(0)


def test_lru_bound_and_on_evict(tmp_path: Path) -> None:
    evicted: list[str] = []
    with DiskTier(tmp_path, 3 * FILE, on_evict=evicted.append) as t:
        for i in range(3):
            t.write_async(f"k{i}", data(i))
        assert t.flush(30)
        assert t.read("k0") == data(0)  # touch: k1 is now the LRU page
        t.write_async("k3", data(3))
        t.write_async("k4", data(4))
        assert t.flush(30)
        assert evicted == ["k1", "k2"]
        assert set(t.keys()) == {"k0", "k3", "k4"} and t.used_bytes == 3 * FILE
        assert not t.exists("k1") and t.read("k1") is None
        assert len(list(tmp_path.glob("*/*.page"))) == 3


def test_corrupt_and_torn_files_are_misses(tier: DiskTier) -> None:
    tier.write_async("k0", data(0))
    tier.write_async("k1", data(1))
    assert tier.flush(30)
    f0, f1 = tier._file("k0"), tier._file("k1")
    raw = bytearray(f0.read_bytes())
    raw[-5] ^= 0xFF
    f0.write_bytes(bytes(raw))
    f1.write_bytes(f1.read_bytes()[:40])  # torn
    assert tier.read("k0") is None and tier.read("k1") is None
    assert tier.corrupt == 2 and tier.evicted == ["k0", "k1"]  # type: ignore[attr-defined]
    assert not tier.exists("k0") and tier.used_bytes == 0 and not f0.exists()


def test_page_file_codec_rejects_wrong_key_and_garbage() -> None:
    blob = encode_page_file("k", b"abc")
    assert decode_page_file(blob, "other") is None
    assert decode_page_file(b"garbage" * 10) is None
    assert decode_page_file(blob + b"x") is None


def test_delete_cancels_queued_write(tier: DiskTier) -> None:
    tier.write_async("k0", data(0))
    assert tier.flush(30)
    blocker = Blocker()
    assert tier.warm("k0", blocker)
    assert blocker.entered.wait(30)  # the thread is parked; the next write waits in the queue
    tier.write_async("k1", data(1))
    assert tier.delete("k1") and tier.delete("k0")
    assert not tier.exists("k1")
    blocker.release.set()
    assert tier.flush(30)
    assert len(tier) == 0 and not tier._file("k1").exists() and not tier._file("k0").exists()
    assert not tier.delete("k0")


def test_full_queue_drops_writes(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 10 * FILE, queue_depth=1) as t:
        t.write_async("k0", data(0))
        assert t.flush(30)
        blocker = Blocker()
        assert t.warm("k0", blocker)
        assert blocker.entered.wait(30)
        assert t.write_async("k1", data(1))  # fills the queue
        assert not t.write_async("k2", data(2))  # dropped, never blocks
        assert not t.warm("k0", blocker)
        assert t.dropped_writes == 1
        blocker.release.set()
        assert t.flush(30)
        assert t.exists("k1") and not t.exists("k2")


def test_promote_and_warm_into_pool(tier: DiskTier) -> None:
    pool = PublishedPool(4 * (SLOT_HEADER_SIZE + PAGE), PAGE)
    tier.write_async("k0", data(0))
    tier.write_async("k1", data(1))
    assert tier.flush(30)
    loc = tier.promote("k0", pool.set)
    assert loc is not None and pool.get("k0") == data(0) and tier.promotes == 1
    assert tier.promote("missing", pool.set) is None
    assert tier.warm("k1", pool.set) and tier.flush(30)
    assert pool.get("k1") == data(1)
    assert not tier.warm("missing", pool.set)


def test_failing_warm_sink_does_not_kill_the_thread(tier: DiskTier) -> None:
    tier.write_async("k0", data(0))
    assert tier.flush(30)

    def bad(key: str, blob: bytes) -> None:
        raise RuntimeError("sink broke")

    assert tier.warm("k0", bad) and tier.flush(30)
    assert tier.write_async("k1", data(1)) and tier.flush(30)
    assert tier.read("k1") == data(1)


def test_restart_reindexes_files(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 10 * FILE) as t:
        for i in range(3):
            t.write_async(f"k{i}", data(i))
        assert t.flush(30)
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "junk.page.tmp").write_bytes(b"partial")
    (tmp_path / "ab" / "bad.page").write_bytes(b"not a page file at all, no magic")
    with DiskTier(tmp_path, 2 * FILE) as t2:  # smaller: the oldest page is dropped
        assert len(t2) == 2 and t2.used_bytes == 2 * FILE
        on_disk = t2.keys()
        for k in on_disk:
            assert t2.read(k) == data(int(k[1:]))
    assert not (tmp_path / "ab" / "junk.page.tmp").exists()
    assert not (tmp_path / "ab" / "bad.page").exists()


def test_unusable_path_disables_with_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match="disk tier disabled"):
        t = DiskTier(blocker / "sub", 10 * FILE)
    assert not t.enabled and t.disabled_reason
    assert not t.write_async("k", b"x") and not t.exists("k") and t.read("k") is None
    assert not t.warm("k", lambda k, b: None)
    assert t.flush(1) and len(t) == 0
    t.close()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path, 0)
    with pytest.raises(ValueError, match="queue_depth"):
        DiskTier(tmp_path, 10, queue_depth=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with DiskTier(tmp_path, 10) as t:  # a page bigger than the whole tier is dropped
            evicted: list[str] = []
            t._on_evict = evicted.append
            t.write_async("big", data(0))
            assert t.flush(30)
            assert not t.exists("big") and evicted == ["big"] and t.dropped_writes == 1


def test_pool_eviction_leaves_entry_non_resident(tmp_path: Path) -> None:
    """The store-side wiring the seed describes, with the real pieces: pool eviction marks the
    directory entry non-resident while the disk holds the page, and deletes it once the disk
    evicts it too; a promote re-publishes it resident."""
    shard = DirectoryShard()
    node = "me"
    pool: PublishedPool

    def publish(key: str, blob: bytes) -> None:
        loc = pool.set(key, blob)
        assert loc is not None
        shard.put(key, DirEntry(node, loc.addr, loc.rkey, loc.length, loc.generation, True))

    def pool_evicted(page: EvictedPage) -> None:
        if disk.exists(page.key):
            shard.set_resident(page.key, False, node=node, generation=page.generation)
        else:
            shard.delete(page.key, node=node, generation=page.generation)

    def disk_evicted(key: str) -> None:
        if key not in pool:
            shard.delete(key, node=node)

    disk = DiskTier(tmp_path, 2 * FILE, on_evict=disk_evicted)
    pool = PublishedPool(2 * (SLOT_HEADER_SIZE + PAGE), PAGE, on_evict=pool_evicted)
    try:
        for i in range(2):
            publish(f"k{i}", data(i))
            disk.write_async(f"k{i}", data(i))
        assert disk.flush(30)
        publish("k2", data(2))  # pool evicts k0, which is on disk
        entry = shard.get("k0")
        assert entry is not None and not entry.resident
        disk.promote("k0", publish)  # a reader asked: back in the pool, resident again
        entry = shard.get("k0")
        assert entry is not None and entry.resident and pool.get("k0") == data(0)
        # k1 was evicted from the pool by the promote; now the disk evicts it too
        assert "k1" not in pool and not shard.get("k1").resident  # type: ignore[union-attr]
        disk.write_async("k2", data(2))
        disk.write_async("k3", data(3))
        assert disk.flush(30)
        assert shard.get("k1") is None  # gone from both tiers: the entry is deleted
    finally:
        disk.close()


def test_a_failed_write_is_counted_dropped_and_leaves_no_file(tier: DiskTier) -> None:
    """A write that fails (here: its directory cannot be made, a file sits in its place) is
    logged, counted in ``write_errors`` (which the node's ``status()["disk"]`` reports), and
    the key is a miss, not a half-written page."""
    folder = tier._file("k9").parent
    if folder.is_dir():
        folder.rmdir()  # empty: nothing was written yet
    folder.write_bytes(b"not a directory")
    assert tier.write_async("k9", data(9))
    assert tier.flush(timeout=30)
    assert tier.write_errors == 1 and tier.writes == 0
    assert not tier.exists("k9") and tier.read("k9") is None
    assert tier.evicted == ["k9"]  # type: ignore[attr-defined]
