"""File backend throughput against plain file I/O of the same bytes, in the same run.

For each page size, ``--mib`` MiB of random pages (fixed seed) are

``raw``        written with ``os.write`` page by page into one new file, and read back
               with ``os.preadv`` into preallocated page buffers: the disk's sequential
               speed through Python, the bound the backend is measured against;
``file``       stored with ``FileStorage.batch_set`` (``--batch`` pages a call) into a
               new directory and read back with ``batch_get`` into the same
               preallocated buffers (checksums verified on every read);
``per-file``   (writes, for information) one new file per page, SGLang ``HiCacheFile``
               style, on at most 256 pages: why the backend packs pages into segments.

Fairness: neither side fsyncs unless ``--fsync`` is given, and then both do, once per
batch (``fdatasync``). Reads are timed twice on both sides: *warm* (the data is in the
page cache, just written) and *cold-ish* (every file of both sides ``fdatasync``-ed
first, then ``posix_fadvise(DONTNEED)`` on that side's files just before its read: the
guest's page cache is dropped, the hypervisor's may not be). Raw and backend runs alternate within each
repeat so that noise from other tenants hits both. Each figure is the median of
``--repeats`` after one warm-up round. Ratio = file / raw (target: >= 0.70).

Usage: ``python bench/storage.py [--quick] [--mib 256] [--repeats 5] [--fsync] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hiradix.storage import FileStorage

KIB = 1024


def drop_cache(paths: list[Path], *, sync_only: bool = False) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            if not sync_only:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Case:
    """One page size: the pages, their keys and the read targets."""

    def __init__(self, page: int, total: int, batch: int, fsync: bool, workdir: Path) -> None:
        self.page, self.batch, self.fsync, self.workdir = page, batch, fsync, workdir
        self.n = max(total // page, batch)
        src = np.random.default_rng(page).integers(0, 256, self.n * page, dtype=np.uint8)
        self.src = memoryview(src)
        self.pages = [self.src[i * page : (i + 1) * page] for i in range(self.n)]
        self.keys = [hashlib.sha256(f"{page}:{i}".encode()).hexdigest() for i in range(self.n)]
        self.dst = bytearray(self.n * page)
        dmv = memoryview(self.dst)
        self.targets = [dmv[i * page : (i + 1) * page] for i in range(self.n)]

    def check(self) -> None:
        if self.dst != self.src:
            raise AssertionError("read back bytes differ from the written ones")
        self.dst[:] = bytes(len(self.dst))

    # ---------------------------------------------------------------- raw
    def raw_write(self, path: Path) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for start in range(0, self.n, self.batch):
            for view in self.pages[start : start + self.batch]:
                os.write(fd, view)
            if self.fsync:
                os.fdatasync(fd)
        os.close(fd)
        return time.perf_counter() - t0

    def raw_read(self, path: Path) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        off = 0
        for target in self.targets:
            if os.preadv(fd, [target], off) != self.page:
                raise AssertionError("short read")
            off += self.page
        os.close(fd)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- backend
    def file_write(self, store: FileStorage) -> float:
        t0 = time.perf_counter()
        for start in range(0, self.n, self.batch):
            end = start + self.batch
            if not store.batch_set(self.keys[start:end], self.pages[start:end]):
                raise AssertionError("batch_set failed")
        return time.perf_counter() - t0

    def file_read(self, store: FileStorage) -> float:
        t0 = time.perf_counter()
        for start in range(0, self.n, self.batch):
            end = start + self.batch
            got = store.batch_get(self.keys[start:end], self.targets[start:end])
            if any(g is None for g in got):
                raise AssertionError("batch_get missed")
        return time.perf_counter() - t0

    def perfile_write(self, root: Path, limit: int = 256) -> tuple[float, int]:
        n = min(self.n, limit)
        root.mkdir()
        t0 = time.perf_counter()
        for i in range(n):
            fd = os.open(root / f"{self.keys[i]}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, self.pages[i])
            if self.fsync:
                os.fdatasync(fd)
            os.close(fd)
        return time.perf_counter() - t0, n

    # ---------------------------------------------------------------- one round
    def round(self, times: dict[str, list[float]], tag: int) -> None:
        raw_path = self.workdir / f"raw-{tag}.bin"
        store_dir = self.workdir / f"store-{tag}"
        try:
            times["raw write"].append(self.raw_write(raw_path))
            with FileStorage(path=store_dir, fsync="always" if self.fsync else "none") as store:
                times["file write"].append(self.file_write(store))
                times["raw read warm"].append(self.raw_read(raw_path))
                self.check()
                times["file read warm"].append(self.file_read(store))
                self.check()
                segs = sorted(store_dir.glob("seg-*.hrx"))
                # Both sides' dirty pages reach the disk before either cold read, so that
                # neither read competes with the other's write-back.
                drop_cache([raw_path, *segs], sync_only=True)
                drop_cache([raw_path])
                times["raw read cold"].append(self.raw_read(raw_path))
                self.check()
                drop_cache(segs)
                times["file read cold"].append(self.file_read(store))
                self.check()
            dt, n = self.perfile_write(self.workdir / f"perfile-{tag}")
            times["per-file write"].append(dt * self.n / n)  # scaled to the same bytes
        finally:
            raw_path.unlink(missing_ok=True)
            shutil.rmtree(store_dir, ignore_errors=True)
            shutil.rmtree(self.workdir / f"perfile-{tag}", ignore_errors=True)


def run(page: int, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    case = Case(page, args.mib << 20, args.batch, args.fsync, workdir)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "raw write",
            "file write",
            "raw read warm",
            "file read warm",
            "raw read cold",
            "file read cold",
            "per-file write",
        )
    }
    case.round({k: [] for k in times}, -1)  # warm-up
    for r in range(args.repeats):
        case.round(times, r)
    nbytes = case.n * page
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB written per page size and round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="pages per batch_set/batch_get call")
    ap.add_argument("--page-kib", default="16,64,256,1024")
    ap.add_argument("--fsync", action="store_true", help="fdatasync once per batch on both sides")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="32 MiB, 3 repeats: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.repeats = 32, 3
    workdir = Path(tempfile.mkdtemp(prefix="hiradix-bench-", dir=args.dir))
    print(
        f"{args.mib} MiB per page size, batches of {args.batch} pages, {args.repeats} repeats (median), "
        f"fsync={'per batch, both sides' if args.fsync else 'off, both sides'}, dir={workdir}\n"
    )
    print("| page | op | raw GB/s | file backend GB/s | file / raw | per-file write GB/s |")
    print("|---|---|---|---|---|---|")
    try:
        for kib in (int(p) for p in args.page_kib.split(",")):
            res = run(kib * KIB, args, workdir)
            size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
            note = " (info)" if kib < 64 else ""
            for op, extra in (("write", f"{res['per-file write']:.2f}"), ("read warm", ""), ("read cold", "")):
                raw, mine = res[f"raw {op}"], res[f"file {op}"]
                print(f"| {size}{note} | {op} | {raw:.2f} | {mine:.2f} | {mine / raw:.0%} | {extra} |")
            sys.stdout.flush()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
