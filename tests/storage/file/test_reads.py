"""The read path (hiradix/storage/file/reads.py): one preadv a run, verification, and a
corrupt record dropped and counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hiradix.storage.base import StorageError
from hiradix.storage.file.reads import run_end
from hiradix.storage.file.records import HDR_SIZE
from tests.storage.file.parts import make, page


def test_pages_written_together_are_read_in_one_run(tmp_path: Path) -> None:
    p = make(tmp_path)
    assert all(p.put(*[(f"k{i}", page(i)) for i in range(5)]))
    locs = [p.table.index[f"k{i}"] for i in (0, 1, 2, 4)]
    assert run_end(locs, 0) == 3  # k4 does not follow k2
    outs = [bytearray(256) for _ in range(5)]
    assert p.reader.read_many([f"k{i}" for i in range(5)], [memoryview(o) for o in outs]) == [True] * 5
    assert [bytes(o) for o in outs] == [page(i) for i in range(5)]
    assert all(s.readers == 0 for s in p.table.segments.values())  # unpinned


def test_reading_touches_the_lru_order(tmp_path: Path) -> None:
    p = make(tmp_path)
    assert all(p.put(("a", page(0)), ("b", page(1))))
    assert p.get("a", 256) == page(0) and list(p.table.index) == ["b", "a"]


def test_a_missing_key_or_another_length_is_a_miss(tmp_path: Path) -> None:
    p = make(tmp_path)
    assert p.put(("a", page(0))) == [True]
    assert p.get("b", 256) is None and p.get("a", 255) is None
    assert "a" in p.table.index and not p.calls.counts


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_corrupt_record_is_dropped_and_counted(tmp_path: Path, where: str) -> None:
    p = make(tmp_path)
    assert all(p.put(("a", page(0)), ("b", page(1))))
    loc = p.table.index["a"]
    at = loc.offset + (8 if where == "header" else HDR_SIZE + 1 + 10)
    os.pwrite(loc.seg.fd, bytes([os.pread(loc.seg.fd, 1, at)[0] ^ 1]), at)
    assert p.get("a", 256) is None and p.get("b", 256) == page(1)
    assert "a" not in p.table.index and p.calls.counts == {"corrupt": 1}


def test_an_lz4_record_is_decompressed(tmp_path: Path) -> None:
    lz4 = pytest.importorskip("lz4.block")
    p = make(tmp_path, lz4=lz4)
    data = bytes(4096)
    assert p.put(("z", data)) == [True] and p.table.index["z"].stored_len < 4096
    assert p.get("z", 4096) == data


def test_a_closed_table_refuses_reads(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.close()
    with pytest.raises(StorageError, match="closed"):
        p.get("a", 256)
