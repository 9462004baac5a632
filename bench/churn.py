"""Fresh fill against steady state: hiradix's tree core, and hiradix.sglang through SGLang
0.5.18's request API, inserting while a capacity forces eviction, as a server does.

A server's cache fills once and then lives under churn: every new request's tokens go in
and the least recently used leave. Both are measured here, on one cache:

``fresh``   a new cache (its buffers growing, their first-touch page faults taken) inserts
            workload A (``bench/workload.py``, seed 0) until its capacity, then keeps
            inserting while evicting.
``steady``  the same cache then inserts workload B (seed 1, no shared prefix with A):
            every insert evicts about as many tokens as it adds; the buffers are already
            touched, deleted spans leave garbage and compaction runs.

Before each insert whose tokens would pass the capacity, ``evict`` frees the difference
(the scheduler's evict before alloc). Figures: ``insert/s`` over the inserts' time
alone, ``churn/s`` over inserts and evictions together, both over the calling thread's
CPU time (``time.thread_time``: page faults included, time spent descheduled on a shared
machine not).

Caches:

``core plain``  ``HiRadixTree`` with nothing backed up: evict deletes (RadixCache's work).
``core hi``     write_through: every node insert reports is backed up at once
                (``begin_backup`` + ``commit_backup``), evict demotes to host, and the
                host (twice the device capacity) drops its least recently used with
                ``evict_host``: HiRadixCache's tree.
``sglang``      hiradix.sglang's ``HiRadixCache`` built by SGLang's ``create_tree_cache``
                (as ``bench/sglang_api.py``, write_through, host ratio 2),
                ``insert(InsertParams)`` then ``check_hicache_events`` every ``--step``
                requests, ``evict(EvictParams)`` before an insert that passes the device
                capacity. Needs SGLang 0.5.18 (``.venv``); left out elsewhere.

Device slots are handed out from a ring over the capacity (page-aligned runs), so a slot
may be cached twice: the tree does not care and the copies are tiny.

Usage::

    PYTHONPATH=tests/stubs .venv/bin/python bench/churn.py --scale 0.05 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import describe, make_workload  # noqa: E402

PHASES = ("fresh", "steady")
METRICS = ("insert_per_s", "churn_per_s")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Slots:
    """Device (or host) slots from a ring of ``size``: page-aligned runs, wrapping."""

    def __init__(self, size: int, page_size: int) -> None:
        self.page_size = page_size
        self.size = -(-size // page_size) * page_size
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        if self.next + n > self.size:
            self.next = 0
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += -(-n // self.page_size) * self.page_size
        return out


# ----------------------------------------------------------------------------- the core
class CoreDriver:
    def __init__(self, page_size: int, capacity: int, hi: bool) -> None:
        from hiradix.tree import HiRadixTree

        self.tree = HiRadixTree(page_size, write_policy="write_through")
        self.capacity = capacity
        self.hi = hi
        self.dev = Slots(capacity + 4096, page_size)
        self.host = Slots(2 * capacity + 4096, page_size)

    def run(self, keys: list[np.ndarray]) -> tuple[float, float]:
        """Seconds inserting, seconds evicting."""
        tree, cap, perf = self.tree, self.capacity, time.thread_time
        insert, evict, evict_host = tree.insert, tree.evict, tree.evict_host
        size = tree.device_size
        begin, commit, key_len = tree.begin_backup, tree.commit_backup, tree.key_len
        t_ins = t_ev = 0.0
        for k in keys:
            n = len(k)
            v = self.dev.take(n)
            t0 = perf()
            need = size() + n - cap
            if need > 0:
                evict(need)
                if self.hi:
                    extra = tree.host_size() + n - 2 * cap
                    if extra > 0:
                        evict_host(extra)
            t1 = perf()
            r = insert(k, v)
            if self.hi:
                for node in r.backup_nodes:
                    begin(node, self.host.take(key_len(node)))
                    commit(node)
            t_ev += t1 - t0
            t_ins += perf() - t1
        return t_ins, t_ev

    def close(self) -> None:
        self.tree.check_invariants()


# ----------------------------------------------------------------------------- SGLang
class SGLangDriver:
    def __init__(self, page_size: int, capacity: int, step: int) -> None:
        import sglang_api as sa  # SGLang 0.5.18's builders and CPU patches

        self.sa = sa
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.EvictParams, self.InsertParams, self.RadixKey = EvictParams, InsertParams, RadixKey
        pool = -(-(capacity + 4096) // page_size) * page_size + page_size
        req_to_token = ReqToTokenPool(size=1, max_context_len=8, device="cpu", enable_memory_saver=False)
        self.cache, _ = sa.build_cache("hiradix", page_size, pool, req_to_token)
        self.capacity = capacity
        self.step = step
        self.page_size = page_size
        self.dev = Slots(capacity + 4096, page_size)

    def run(self, keys: list) -> tuple[float, float]:
        import torch

        cache, cap, perf, step = self.cache, self.capacity, time.thread_time, self.step
        insert, evict, events = cache.insert, cache.evict, cache.check_hicache_events
        evictable, protected = cache.evictable_size, cache.protected_size
        ip, ep, rk = self.InsertParams, self.EvictParams, self.RadixKey
        base = torch.arange(self.page_size, self.page_size + self.dev.size, dtype=torch.int64)
        t_ins = t_ev = 0.0
        for i, k in enumerate(keys, 1):
            n = len(k)
            s = self.dev.take(n)
            v = base[int(s[0]) : int(s[0]) + n] if n else base[:0]
            t0 = perf()
            need = evictable() + protected() + n - cap
            if need > 0:
                evict(ep(num_tokens=need))
            t1 = perf()
            insert(ip(key=rk(k), value=v))
            if i % step == 0:
                events()
            t_ev += t1 - t0
            t_ins += perf() - t1
        t1 = perf()
        events()
        t_ins += perf() - t1
        return t_ins, t_ev

    def close(self) -> None:
        self.cache.core.tree.check_invariants()
        self.cache.core.close()


def one_repeat(impl: str, page_size: int, capacity: int, a: list, b: list, step: int) -> dict:
    if impl == "sglang":
        drv: CoreDriver | SGLangDriver = SGLangDriver(page_size, capacity, step)
    else:
        drv = CoreDriver(page_size, capacity, hi=impl == "core hi")
    out = {}
    for phase, keys in zip(PHASES, (a, b), strict=True):
        gc.collect()
        gc.disable()
        t_ins, t_ev = drv.run(keys)
        gc.enable()
        out[f"{phase}_insert_per_s"] = len(keys) / t_ins
        out[f"{phase}_churn_per_s"] = len(keys) / (t_ins + t_ev)
    drv.close()
    return out


def sglang_available() -> bool:
    try:
        from hiradix.sglang.api import REQUEST_API
    except ImportError:
        return False
    return REQUEST_API == "cache_req"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of the 200 system prompts (default 0.05)")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--capacity", type=float, default=0.5, help="device capacity, a fraction of A's distinct tokens")
    ap.add_argument("--impls", default="core plain,core hi,sglang")
    ap.add_argument("--step", type=int, default=8, help="sglang: requests per check_hicache_events (default 8)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",")]
    if "sglang" in impls:
        if sglang_available():
            import torch

            torch.set_num_threads(1)
            import sglang_api as sa

            sa.API.setup()
            import hiradix.sglang as hs

            hs.register()
        else:
            log("sglang: left out (needs SGLang 0.5.18's request API)")
            impls.remove("sglang")
    import hiradix

    n_prompts = max(1, round(200 * args.scale))
    seqs_a = make_workload(seed=0, n_prompts=n_prompts)
    seqs_b = make_workload(seed=1, n_prompts=n_prompts)
    meta = {
        "hiradix": hiradix.__file__,
        "load": os.getloadavg(),
        "scale": args.scale,
        "capacity": args.capacity,
        "workload": describe(seqs_a),
        "command": "python bench/churn.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    log(f"hiradix {hiradix.__file__}; load {meta['load']}; workload {meta['workload']}")
    results: dict = {}
    for ps in (int(p) for p in args.page_sizes.split(",")):
        a = [s[: len(s) // ps * ps] for s in seqs_a]
        b = [s[: len(s) // ps * ps] for s in seqs_b]
        if "sglang" in impls:
            from array import array

            a_q = [array("q", k.astype(np.int64).tobytes()) for k in a]
            b_q = [array("q", k.astype(np.int64).tobytes()) for k in b]
        # distinct tokens of A: the tree's size once A is in
        probe = CoreDriver(ps, 1 << 40, hi=False)
        probe.run(a)
        capacity = int(probe.tree.device_size() * args.capacity) // ps * ps
        del probe
        results[ps] = {"capacity": capacity}
        for impl in impls:
            runs = []
            for r in range(-1, args.repeats):  # one warm-up
                keys = (a_q, b_q) if impl == "sglang" else (a, b)
                res = one_repeat(impl, ps, capacity, *keys, args.step)
                if r >= 0:
                    runs.append(res)
                log(
                    f"  page {ps} {impl} {'warm-up' if r < 0 else r + 1}: "
                    + ", ".join(f"{m}={v:.4g}" for m, v in res.items())
                )
            results[ps][impl] = {
                m: {"median": statistics.median(x[m] for x in runs), "runs": [x[m] for x in runs]} for m in runs[0]
            }
    lines = [
        "| page | cache | fresh insert/s | fresh churn/s | steady insert/s | steady churn/s |",
        "|---|---|---|---|---|---|",
    ]
    for ps, res in results.items():
        for impl in impls:
            r = res[impl]
            lines.append(
                f"| {ps} | {impl} | "
                + " | ".join(f"{r[f'{p}_{m}']['median'] / 1e3:,.1f}k" for p in PHASES for m in METRICS)
                + " |"
            )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
