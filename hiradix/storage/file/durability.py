"""Sync rounds of a :class:`~hiradix.storage.file.FileStorage` (*Durability* in
:mod:`hiradix.storage.file`).

A round ``fdatasync``-s every segment written since the last one (and the directory if a
segment was created), then unlinks the segments dropped before it, so that the copies
that replaced their records are durable first. ``"always"`` callers wait for a round that
covers their publication (group commit: concurrent callers share one); in ``"batch"`` mode
a thread runs one every ``interval`` seconds, or sooner once the table's ``fsync_bytes``
are waiting. A round that fails reports its publications not durable and moves appends to
a fresh segment, with no lost writes behind them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from hiradix.storage.file.segments import SegmentTable

__all__ = ["Durability"]


class Durability:
    """Sync rounds over ``table``. ``fdatasync`` is the system call (a test's stand-in logs
    or fails it); ``failed(op, key, exc)`` is told of a round or a rotation that fails.
    Thread-safe; one round at a time."""

    def __init__(
        self,
        table: SegmentTable,
        *,
        interval: float,
        fdatasync: Callable[[int], None],
        failed: Callable[[str, str, BaseException], None],
    ) -> None:
        self.table = table
        self.interval = interval
        self.fdatasync = fdatasync
        self.failed = failed
        self.lock = threading.Lock()  # one sync round at a time; guards the three below
        self.synced_seq = 0  # every publication up to this one has been fdatasync-ed (or failed)
        self.failed_seq = 0  # the newest publication whose round failed
        self.rounds = 0
        self.flusher: threading.Thread | None = None  # the "batch" mode's thread

    def start_flusher(self, name: str) -> None:
        """Start the ``"batch"`` mode's thread (:meth:`flush_loop`)."""
        self.flusher = threading.Thread(target=self.flush_loop, name=name, daemon=True)
        self.flusher.start()

    def join_flusher(self) -> None:
        """Wait for the flusher to see the table closed (not from the flusher itself)."""
        if self.flusher is not None and self.flusher is not threading.current_thread():
            self.flusher.join()

    def sync(self, seq: int | None = None) -> bool:
        """One sync round (module docstring). With ``seq``, skip the round if one that
        started after publication ``seq`` has already finished (group commit). Whether
        publication ``seq`` (without one: this round) is durable. ``O(segments written)``
        system calls, outside the storage lock."""
        table = self.table
        with self.lock:
            if seq is not None and self.synced_seq >= seq:
                return seq > self.failed_seq
            with table.lock:
                unsynced = table.unsynced
                target = unsynced.write_seq
                segs = [table.segments[i] for i in unsynced.segments if i in table.segments]
                for seg in segs:
                    seg.readers += 1  # keeps the fd open while we sync it
                unsynced.segments.clear()
                dir_dirty, unsynced.directory = unsynced.directory, False
                unlink, unsynced.unlink = unsynced.unlink, []
                unsynced.bytes = 0
            ok = True
            try:
                for seg in segs:
                    self.fdatasync(seg.fd)
                if dir_dirty:
                    dfd = os.open(table.path, os.O_RDONLY)
                    try:
                        self.fdatasync(dfd)
                    finally:
                        os.close(dfd)
            except OSError as exc:
                # After a failed fdatasync the kernel may have dropped the dirty pages
                # (and a retry would "succeed"): the round's pages are not durable.
                ok = False
                self.failed("fsync", "", exc)
                self.failed_seq = target
            finally:
                with table.lock:
                    for seg in segs:
                        seg.readers -= 1
                        table.maybe_drop(seg)
                    if not ok:
                        table.unsynced.unlink[:0] = unlink
                        table.unsynced.directory = table.unsynced.directory or dir_dirty
                        self._rotate()  # later pages go to a segment with no lost writes behind them
            if ok:
                for path in unlink:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            self.synced_seq = target
            self.rounds += 1
            return ok if seq is None else seq > self.failed_seq

    def _rotate(self) -> None:
        # Caller holds the table's lock. A failure leaves the current active segment in use.
        table = self.table
        if table.closed or not table.active.size:
            return
        try:
            seg = table.new_segment()
        except OSError as exc:
            self.failed("rotate", "", exc)
            return
        table.active.sealed = True
        old, table.active = table.active, seg
        table.maybe_drop(old)

    def flush_loop(self) -> None:
        """``"batch"`` mode: a sync round every ``interval`` seconds, or as soon as the
        table's ``fsync_bytes`` are waiting; returns once the table is closed."""
        table = self.table
        while True:
            with table.lock:
                table.wake.wait_for(
                    lambda: table.closed or table.unsynced.bytes >= table.fsync_bytes, timeout=self.interval
                )
                if table.closed:
                    return
                u = table.unsynced
                idle = not u.segments and not u.directory and not u.unlink
            if not idle:
                self.sync()

    def flush(self) -> bool:
        """A sync round covering every segment with bytes in it, in any mode; whether it
        succeeded (``False`` once the table is closed). ``O(segments)``."""
        table = self.table
        with table.lock:
            if table.closed:
                return False
            for seg in table.segments.values():
                if seg.size:
                    table.unsynced.segments.add(seg.id)
        return self.sync(None)
