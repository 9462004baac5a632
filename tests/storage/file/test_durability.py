"""Sync rounds (hiradix/storage/file/durability.py): what a round syncs and unlinks, group
commit, a failed round, flush, and the "batch" thread."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from hiradix.storage.file.durability import Durability
from tests.storage.file.parts import Parts, make, page


class Log:
    """An ``fdatasync`` that records the paths it synced and can fail."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.fail = False
        self.event = threading.Event()

    def __call__(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        os.fdatasync(fd)
        self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        self.event.set()


def durable(root: Path, mode: str = "always", **opts: int) -> tuple[Parts, Durability, Log]:
    p = make(root, fsync=mode, **opts)
    log = Log()
    return p, Durability(p.table, interval=0.005, fdatasync=log, failed=p.calls.fail), log


def test_a_round_syncs_the_written_segments_and_the_directory(tmp_path: Path) -> None:
    p, d, log = durable(tmp_path)
    seq = p.writer.append_many([p.writer.record("k", memoryview(page(0)))]).seq
    assert d.sync(seq) and d.synced_seq == seq and d.rounds == 1
    assert log.paths == [str(p.table.active.path), str(tmp_path)]
    assert d.sync(seq) and d.rounds == 1  # group commit: already covered, no second round
    assert not p.table.unsynced.segments and p.table.unsynced.bytes == 0


def test_a_dropped_segment_is_unlinked_after_the_round(tmp_path: Path) -> None:
    p, d, _ = durable(tmp_path)
    old = p.table.active
    assert p.put(("k", page(0))) == [True]
    old.sealed = True
    p.table.active = p.table.new_segment()
    assert p.put(("k", page(1))) == [True]  # the old record is dead, its segment dropped
    assert old.path.exists() and p.table.unsynced.unlink == [old.path]
    assert d.sync() and not old.path.exists()


def test_a_failed_round_is_not_durable_and_moves_appends_on(tmp_path: Path) -> None:
    p, d, log = durable(tmp_path)
    seq = p.writer.append_many([p.writer.record("k", memoryview(page(0)))]).seq
    first = p.table.active
    log.fail = True
    assert not d.sync(seq) and d.failed_seq == seq
    assert p.calls.failed[0][0] == "fsync" and first.sealed and p.table.active is not first
    log.fail = False
    assert d.sync() and d.sync(seq) is False  # that publication stays not durable


def test_flush_syncs_every_segment_with_bytes(tmp_path: Path) -> None:
    p, d, log = durable(tmp_path, mode="none")
    assert p.put(("k", page(0))) == [True] and not p.table.unsynced.segments
    assert d.flush() and log.paths == [str(p.table.active.path)]
    p.close()
    assert not d.flush()


def test_the_batch_thread_syncs_once_enough_bytes_wait(tmp_path: Path) -> None:
    p, d, log = durable(tmp_path, mode="batch", fsync_bytes=1)
    d.interval = 60.0  # woken by the bytes, not the clock
    d.start_flusher("test-fsync")
    assert p.put(("k", page(0))) == [True]
    assert log.event.wait(10) and str(p.table.active.path) in log.paths
    with p.table.lock:
        p.table.closed = True
        p.table.wake.notify_all()
    d.join_flusher()
    assert d.flusher is not None and not d.flusher.is_alive()
