"""L3 prefetch latency: from ``prefetch_from_storage`` until the pages are usable.

A :class:`~hiradix.cache.HiRadixCache` with a ``memory`` L3 holds a sequence of ``--pages``
pages in storage only (L1 and L2 evicted). Each repeat times the scheduler's path:
``prefetch_from_storage`` (host allocation, queueing) -> prefetch thread (chained page
hashes, ``batch_exists`` in batches of 128) -> IO thread (``batch_get_v1`` into the host
pool) -> ``check_prefetch_progress`` (host-only nodes inserted in the tree), after which
``match_prefix`` reports the whole sequence as a host hit. The pages are then evicted from
L2 again for the next repeat.

The baseline, measured in the same run, is the raw copy of the same bytes: one
``torch.Tensor.copy_`` of a contiguous block of ``pages x page_bytes`` bytes from a buffer
that is not in cache. The issue's target is a ratio of at most 2x.

Usage: ``python bench/prefetch.py [--repeats 9] [--quick]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np
import torch

from hiradix.cache import HiRadixCache, Req, StorageOptions
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape
from hiradix.storage import MemoryStorage


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def run_case(page_kib: int, pages: int, layout: str, repeats: int) -> tuple[float, float]:
    """Median seconds for (prefetch until usable, raw copy of the same bytes)."""
    page_size = 16
    token_bytes = page_kib * 1024 // page_size
    # fp16 MHA: layers x 2 (K, V) x heads x dim x 2 bytes = token_bytes
    heads, dim = 4, 32
    layers = token_bytes // (2 * heads * dim * 2)
    shape = MHAShape(layers, heads, dim)
    n = pages * page_size
    dev = DeviceKVPool(shape, size=n, page_size=page_size, dtype=torch.float16)
    host = HostKVPool(shape, n, page_size, torch.float16, layout, reserve_bytes=0)
    assert host.page_bytes == page_kib * 1024
    cache = HiRadixCache(
        dev,
        host,
        storage=StorageOptions(
            backend=MemoryStorage(),
            prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=page_size, capacity_tokens=n),
        ),
    )
    tokens = np.arange(n, dtype=np.int64)
    with cache:
        slots = cache.alloc_device(n)
        assert slots is not None
        for layer in range(layers):
            for buf in dev.layer_buffers(layer):
                buf[slots] = torch.randn(n, *buf.shape[1:]).to(buf.dtype)
        cache.cache_finished_req(Req("w", tokens, slots))
        cache.flush()
        while cache.storage.ongoing_backup:
            cache.storage.ongoing_backup[0].done.wait(60)
            cache.check_hicache_events()
        cache.evict(n)
        src = torch.empty(pages * host.page_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)
        times, raw = [], []
        for i in range(repeats + 1):
            cache.evict_host(n)
            assert cache.tree.host_size() == 0
            t0 = time.perf_counter()
            m = cache.match_prefix(tokens)
            mount, mlen = cache.storage.prefetch_mount(m)
            assert cache.storage.prefetch_from_storage(i, mount, tokens[mlen:])
            cache.storage.wait_prefetch(i)
            assert cache.storage.check_prefetch_progress(i)
            t1 = time.perf_counter()
            assert cache.storage.pop_prefetch_loaded_tokens(i) == n
            assert cache.match_prefix(tokens).host_hit_length == n
            t2 = time.perf_counter()
            dst.copy_(src)
            t3 = time.perf_counter()
            if i:  # the first round is the warm-up
                times.append(t1 - t0)
                raw.append(t3 - t2)
        cache.evict_host(n)
    return statistics.median(times), statistics.median(raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="fewer pages and repeats (a smoke run)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    LAYOUTS[:] = args.layouts.split(",")
    repeats = 3 if args.quick else args.repeats
    total_mib = 16 if args.quick else 128
    torch.set_num_threads(1)
    print(f"machine: {_cpu_name()}, {torch.get_num_threads()} torch thread(s); {repeats} repeats, medians\n")
    print("| page | pages | layout | prefetch until usable | raw copy | ratio (target <= 2x) | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for page_kib in (64, 256, 1024):
        pages = total_mib * 1024 // page_kib
        for layout in LAYOUTS:
            t, r = run_case(page_kib, pages, layout, repeats)
            gbps = pages * page_kib * 1024 / t / 1e9
            print(
                f"| {page_kib} KiB | {pages} | {layout} | {t * 1e3:.2f} ms | {r * 1e3:.2f} ms | "
                f"{t / r:.2f}x | {gbps:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
