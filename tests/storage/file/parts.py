"""The file backend's parts assembled over a temporary directory, with their callbacks
recorded: what each part's tests drive (tests/storage/file/test_*.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hiradix.storage.file.reads import Reader
from hiradix.storage.file.segments import SegmentTable
from hiradix.storage.file.writes import Writer


@dataclass
class Calls:
    """What the parts told their owner: failures ``(op, key, exc)`` and counter deltas."""

    failed: list[tuple[str, str, BaseException]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def fail(self, op: str, key: str, exc: BaseException) -> None:
        self.failed.append((op, key, exc))

    def count(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self.counts[k] = self.counts.get(k, 0) + v


@dataclass
class Parts:
    table: SegmentTable
    writer: Writer
    reader: Reader
    calls: Calls

    def put(self, *pairs: tuple[str, bytes]) -> list[bool]:
        recs = [self.writer.record(k, memoryview(v)) for k, v in pairs]
        return self.writer.append_many(recs).stored

    def get(self, key: str, n: int) -> bytes | None:
        out = bytearray(n)
        return bytes(out) if self.reader.read_many([key], [memoryview(out)])[0] else None

    def close(self) -> None:
        with self.table.lock:
            self.table.closed = True
            self.table.close_fds()


def make(root: Path, *, segment_bytes: int = 1 << 20, capacity_bytes: int | None = None, fsync: str = "none",
         pwritev: Any = os.pwritev, lz4: Any = None, fsync_bytes: int = 1 << 30) -> Parts:  # fmt: skip
    """A table (with its active segment) and the writer and reader over it."""
    calls = Calls()
    table = SegmentTable(
        root, segment_bytes=segment_bytes, capacity_bytes=capacity_bytes, fsync=fsync, fsync_bytes=fsync_bytes
    )
    table.active = table.new_segment()
    writer = Writer(table, pwritev=pwritev, lz4=lz4, failed=calls.fail, count=calls.count)
    reader = Reader(table, failed=calls.fail, count=calls.count)
    return Parts(table, writer, reader, calls)


def page(i: int, n: int = 256) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))
