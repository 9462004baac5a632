"""FileStorage durability: what survives ``kill -9`` with concurrent writers, a failed or
torn write, a corrupt record header, and the ``fsync`` modes (module docstring of
``hiradix.storage.file``, *Restart* and *Durability*)."""

from __future__ import annotations

import errno
import os
import random
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import hiradix.storage.file as file_mod
from hiradix.storage import FileStorage, StorageConfig, StorageError, create_backend
from hiradix.storage.file import _HDR_SIZE
from tests.storage.test_contract import PAGE, StorageContract, key, payload

pytestmark = pytest.mark.slow  # crash and fsync scenarios in subprocesses

REC = _HDR_SIZE + 64 + PAGE  # one uncompressed record of a PAGE-byte page under a 64-char key


class TestFileFsyncBatch(StorageContract):
    backend, options = "file", {"segment_bytes": 3 * PAGE, "fsync": "batch", "fsync_interval": 0.01}


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("seg-*.hrx"))


def served(s: FileStorage, indices: list[int]) -> list[int]:
    """The indices whose page is served with exactly its bytes (a wrong page fails)."""
    ok = []
    for i, got in zip(indices, s.batch_get([key(i) for i in indices]), strict=True):
        if got is not None:
            assert bytes(got.numpy()) == payload(i), f"wrong bytes for page {i}"
            ok.append(i)
    return ok


# ----------------------------------------------------------------------------- kill -9
SMALL = 1024  # page bytes in the crash trials: many records, several segments, compactions


def _small(i: int) -> bytes:
    return payload(i, SMALL)


def _child(root: Path, seed: int, mode: str, ack_w: int, go_r: int) -> None:
    """Writer threads storing pages until a seeded kill point SIGKILLs this process.

    Each ``batch_set`` that returns ``True`` is reported as one ``os.write`` of
    ``"A i j ...\\n"`` on ``ack_w`` (atomic: shorter than ``PIPE_BUF``). Kill points:
    ``ack`` right after the n-th acknowledgement (other writers mid-flight); ``after``
    right after the n-th ``pwritev`` (written, not acknowledged); ``hole`` / ``torn``: the
    n-th ``pwritev`` writes nothing / a random prefix of its records, then waits until two
    more batches written after it were acknowledged before the kill (the hole a concurrent
    writer leaves behind acknowledged records).
    """
    rng = random.Random(seed)
    kind = rng.choice(["ack", "after", "hole", "torn"])
    kill_at = rng.randint(2, 30)
    cond = threading.Condition()
    acks = [0]
    calls = [0]
    real = file_mod._pwritev

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def pwritev(fd: int, iov: list[Any], offset: int) -> int:
        with cond:
            calls[0] += 1
            n = calls[0]
        if n != kill_at or kind == "ack":
            return real(fd, iov, offset)
        if kind == "after":
            real(fd, iov, offset)
            die()
        with cond:
            seen = acks[0]
        if kind == "torn":
            data = b"".join(bytes(b) for b in iov)
            os.pwrite(fd, data[: rng.randrange(1, len(data))], offset)
        with cond:  # bounded: if nobody else gets through, die anyway
            cond.wait_for(lambda: acks[0] >= seen + 2, timeout=5)
        die()
        raise AssertionError("unreachable")

    file_mod._pwritev = pwritev
    opts: dict[str, Any] = {"segment_bytes": 24 * SMALL, "fsync": mode, "fsync_interval": 0.005}
    store = FileStorage(path=root, **opts)
    os.write(ack_w, b"R\n")
    os.read(go_r, 1)
    written: list[int] = []

    def writer(t: int) -> None:
        wrng = random.Random(seed * 8 + t)
        for j in range(1000):
            if written and wrng.random() < 0.25:  # rewrite a page (same key, same bytes)
                idx = [wrng.choice(written) for _ in range(wrng.randint(1, 3))]
            else:
                idx = [seed * 100_000 + t * 10_000 + j * 8 + m for m in range(wrng.randint(1, 6))]
            if store.batch_set([key(i) for i in idx], [_small(i) for i in idx]):
                written.extend(idx)
                os.write(ack_w, ("A " + " ".join(map(str, idx)) + "\n").encode())
                with cond:
                    acks[0] += 1
                    cond.notify_all()
                    if kind == "ack" and acks[0] == kill_at:
                        die()

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    raise AssertionError(f"no kill point reached ({kind} at {kill_at})")


def _run_child(root: Path, seed: int, mode: str, check_lock: bool) -> set[int]:
    """Fork a writer process, let it be killed, return the acknowledged page indices."""
    ack_r, ack_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        os.close(ack_r)
        os.close(go_w)
        try:
            _child(root, seed, mode, ack_w, go_r)
        except BaseException:
            os.write(ack_w, ("E " + traceback.format_exc().replace("\n", " | ") + "\n").encode())
        finally:
            os._exit(1)
    os.close(ack_w)
    os.close(go_r)
    out = bytearray()
    deadline = time.monotonic() + 15
    try:
        while b"\n" not in out:
            assert select.select([ack_r], [], [], max(0.0, deadline - time.monotonic()))[0], "child did not start"
            chunk = os.read(ack_r, 1 << 16)
            assert chunk, f"child died before starting: {out!r}"
            out += chunk
        if check_lock:  # one process per directory, as documented
            with pytest.raises(StorageError, match="in use"):
                FileStorage(path=root)
        os.write(go_w, b"g")
        while chunk:
            assert select.select([ack_r], [], [], max(0.0, deadline - time.monotonic()))[0], "child did not die"
            chunk = os.read(ack_r, 1 << 16)
            out += chunk
    finally:
        os.close(go_w)
        os.close(ack_r)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:  # only when the test failed: do not leave it running
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    lines = out.decode().splitlines()
    errors = [ln for ln in lines if ln.startswith("E ")]
    assert not errors, errors
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return {int(i) for ln in lines if ln.startswith("A ") for i in ln.split()[1:]}


@pytest.mark.parametrize("mode", ["none", "batch", "always"])
def test_kill9_keeps_every_acknowledged_page_with_concurrent_writers(tmp_path: Path, mode: str) -> None:
    # One directory through all the trials: each restart recovers what the previous
    # kills left (holes, torn records, half-done compactions) and writes on top of it.
    acked: set[int] = set()
    for trial in range(12):
        seed = 1000 * "nba".index(mode[0]) + trial
        acked |= _run_child(tmp_path, seed, mode, check_lock=trial == 0)
        with FileStorage(path=tmp_path) as s:
            misses = []
            for i, got in zip(sorted(acked), s.batch_get([key(i) for i in sorted(acked)]), strict=True):
                if got is None:
                    misses.append(i)
                else:
                    assert bytes(got.numpy()) == _small(i), f"wrong bytes for page {i}"
            assert not misses, f"trial {trial} (seed {seed}): {len(misses)} of {len(acked)} acknowledged pages lost"
            assert s.get_stats().corrupt == 0
    assert len(acked) > 100  # the trials did write something


# ----------------------------------------------------------------------------- failed writes
def _fail_nth(n: int, how: str) -> Callable[..., int]:
    """A ``pwritev`` whose ``n``-th call fails: ``enospc`` writes nothing; ``short`` writes
    half and returns the short count (the retry then hits ENOSPC); ``torn`` writes the
    header, key and a third of the payload, then raises."""
    real = file_mod._pwritev
    calls = [0]

    def pwritev(fd: int, iov: list[Any], offset: int) -> int:
        calls[0] += 1
        if calls[0] < n:
            return real(fd, iov, offset)
        if calls[0] > n:
            if how == "short" and calls[0] == n + 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, iov, offset)
        data = b"".join(bytes(b) for b in iov)
        if how == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        if how == "short":
            return os.pwrite(fd, data[: len(data) // 2], offset)
        os.pwrite(fd, data[: _HDR_SIZE + 64 + PAGE // 3], offset)
        raise OSError(errno.EIO, "Input/output error")

    return pwritev


@pytest.mark.parametrize("how", ["enospc", "short", "torn"])
@pytest.mark.parametrize("kill", [False, True], ids=["clean-close", "no-close"])
def test_failed_write_costs_only_that_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kill: bool
) -> None:
    # Page 4's write fails; the writes after it land beyond its reserved (now dead) bytes.
    # The failing write is an overwrite of page 2, already acknowledged: it must survive too.
    monkeypatch.setattr(file_mod, "_pwritev", _fail_nth(6, how))
    s = FileStorage(path=tmp_path)
    acked = [i for i in range(5) if s.set(key(i), payload(i))]
    assert acked == list(range(5))
    assert s.set(key(2), payload(2)) is False  # call 6: fails
    acked += [i for i in range(5, 20) if s.set(key(i), payload(i))]
    assert acked == list(range(20)) and s.get_stats().errors >= 1
    assert served(s, acked) == acked
    if kill:
        s._close_fds()  # the process dies without closing: nothing more is written
    else:
        s.close()
    monkeypatch.undo()
    with FileStorage(path=tmp_path) as s:
        assert served(s, acked) == acked
        assert s.get_stats().corrupt == 0


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = file_mod._pwritev

    def one_byte_short(fd: int, iov: list[Any], offset: int) -> int:
        data = b"".join(bytes(b) for b in iov)
        return real(fd, [data[: max(1, len(data) - 1)]], offset)

    monkeypatch.setattr(file_mod, "_pwritev", one_byte_short)
    with FileStorage(path=tmp_path) as s:
        assert s.batch_set([key(i) for i in range(3)], [payload(i) for i in range(3)])
        assert served(s, [0, 1, 2]) == [0, 1, 2] and s.get_stats().errors == 0


# ----------------------------------------------------------------------------- header damage
@pytest.mark.parametrize("seed", range(4))
def test_flipped_header_bit_among_1000_records_costs_only_that_record(tmp_path: Path, seed: int) -> None:
    n = 1000
    with FileStorage(path=tmp_path) as s:
        for start in range(0, n, 50):
            batch = range(start, start + 50)
            assert s.batch_set([key(i) for i in batch], [payload(i) for i in batch])
    (seg,) = segments(tmp_path)
    rng = random.Random(seed)
    victim = rng.randrange(n)
    pos = victim * REC + rng.randrange(_HDR_SIZE + 64)  # anywhere in the header or the key it covers
    with open(seg, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << rng.randrange(8))]))
    with FileStorage(path=tmp_path) as s:
        others = [i for i in range(n) if i != victim]
        assert served(s, others) == others
        assert served(s, [victim]) == []
        assert s.get_stats().pages == n - 1


def test_resync_skips_garbage_and_a_fake_magic(tmp_path: Path) -> None:
    # Between two records: garbage that holds the magic but no valid header after it.
    recs = []
    for i in range(2):
        with FileStorage(path=tmp_path / str(i)) as s:
            s.set(key(i), payload(i))
        recs.append(segments(tmp_path / str(i))[0].read_bytes())
    garbage = b"junk" + file_mod.MAGIC + bytes(100) + file_mod.MAGIC[:2]
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "seg-00000001.hrx").write_bytes(recs[0] + garbage + recs[1])
    with FileStorage(path=tmp_path / "both") as s:
        assert served(s, [0, 1]) == [0, 1]
        assert s.get_stats().extra["skipped_bytes"] == len(garbage)


# ----------------------------------------------------------------------------- fsync modes
class SyncLog:
    """Replaces ``fdatasync``: records (path, size) of every call, can fail, can signal."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = False
        self.event = threading.Event()
        self._real = file_mod._fdatasync

    def __call__(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        self._real(fd)
        self.calls.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        self.event.set()

    def synced(self, path: Path) -> int:
        """The largest size at which ``path`` was synced (-1: never)."""
        return max((size for p, size in self.calls if p == str(path)), default=-1)


@pytest.fixture
def sync_log(monkeypatch: pytest.MonkeyPatch) -> SyncLog:
    log = SyncLog()
    monkeypatch.setattr(file_mod, "_fdatasync", log)
    return log


def test_fsync_options_through_the_registry(tmp_path: Path) -> None:
    cfg = StorageConfig(extra_config={"path": str(tmp_path), "fsync": "batch", "fsync_interval": 0.25})
    s = create_backend("file", cfg, extra_config='{"fsync_bytes": 4096}')
    try:
        assert isinstance(s, FileStorage)
        assert (s.fsync, s.fsync_interval, s.fsync_bytes) == ("batch", 0.25, 4096)
        assert s.get_stats().extra["fsync"] == "batch"
    finally:
        s.close()
    with FileStorage(path=tmp_path, fsync=False) as s:
        assert s.fsync == "none" and s.fsync_interval == 1.0
    for bad in ({"fsync": "sometimes"}, {"fsync_interval": 0}, {"fsync_bytes": 0}, {"fsync_interval": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FileStorage(path=tmp_path, **bad)  # type: ignore[arg-type]


def test_fsync_always_syncs_before_acknowledging(tmp_path: Path, sync_log: SyncLog) -> None:
    with FileStorage(path=tmp_path, fsync="always") as s:
        for i in range(3):
            assert s.set(key(i), payload(i))
            (seg,) = segments(tmp_path)
            assert sync_log.synced(seg) == (i + 1) * REC  # this page's bytes were synced
        assert sync_log.synced(tmp_path) >= 0  # and the new segment's directory entry
        sync_log.fail = True
        assert s.set(key(3), payload(3)) is False  # not durable: not acknowledged
        sync_log.fail = False
        assert s.set(key(4), payload(4))
        assert len(segments(tmp_path)) == 2  # after a failed fsync, a fresh segment
        assert s.get_stats().errors == 1


def test_fsync_none_never_syncs_and_batch_syncs_in_the_background(tmp_path: Path, sync_log: SyncLog) -> None:
    with FileStorage(path=tmp_path / "none") as s:
        assert s.batch_set([key(0)], [payload(0)])
    assert sync_log.calls == []
    with FileStorage(path=tmp_path / "batch", fsync="batch", fsync_interval=3600, fsync_bytes=3 * REC) as s:
        assert s.batch_set([key(0), key(1)], [payload(0), payload(1)])
        assert sync_log.calls == []  # acknowledged without waiting for the disk
        assert s.batch_set([key(2)], [payload(2)])  # 3 records waiting: the flusher runs now
        assert sync_log.event.wait(timeout=10)
        (seg,) = segments(tmp_path / "batch")
        assert sync_log.synced(seg) == 3 * REC
        assert s.set(key(3), payload(3))
    assert sync_log.synced(seg) == 4 * REC  # close syncs the rest


def test_flush(tmp_path: Path, sync_log: SyncLog) -> None:
    with FileStorage(path=tmp_path) as s:
        s.set(key(0), payload(0))
        assert s.flush() and sync_log.synced(segments(tmp_path)[0]) == REC
        sync_log.fail = True
        assert s.flush() is False
        sync_log.fail = False
    with FileStorage(path=tmp_path) as s:
        assert s.flush() is True


def test_emptied_segment_outlives_the_sync_that_makes_its_replacement_durable(
    tmp_path: Path, sync_log: SyncLog
) -> None:
    # Overwriting every page of a sealed segment empties it; in a sync mode its file may
    # go only after the overwrites are synced, or a power loss could lose both copies.
    with FileStorage(path=tmp_path, fsync="batch", fsync_interval=3600, segment_bytes=2 * REC) as s:
        s.batch_set([key(0), key(1)], [payload(0), payload(1)])
        s.batch_set([key(0), key(1)], [payload(0), payload(1)])  # a new segment; the first is dead
        first = tmp_path / "seg-00000001.hrx"
        assert first.exists() and s.get_stats().extra["segments"] == 1
        assert s.flush() and not first.exists()
