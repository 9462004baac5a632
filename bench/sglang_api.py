"""hiradix.sglang against SGLang 0.5.18's own HiRadixCache, both driven through SGLang's API
on SGLang's CPU pools, in one process (same machine, same minute).

Both caches are built as SGLang's scheduler builds them: ``ServerArgs`` with
``--enable-hierarchical-cache``, write_through, ``layer_first`` host layout, io backend
``direct``, host/device ratio 2; SGLang's ``MHATokenToKVPool`` on CPU (1 layer, 1 head,
head_dim 1, bf16: the copies are real but tiny, so the figures are the cache's, not the
memcpy's), ``TokenToKVPoolAllocator`` (page 1) / ``PagedTokenToKVPoolAllocator`` (page 16),
a ``ReqToTokenPool`` and ``create_tree_cache`` (``--radix-cache-backend hiradix`` selects
hiradix's; the default chain selects ``sglang.srt.mem_cache.hiradix_cache.HiRadixCache``).
SGLang's cache needs, on CPU, the three patches of ``bench/sglang_baselines.py``: pinning
the host pool is a no-op, ``transfer_kv_direct`` (CUDA-only) is a per-layer
``index_select``/``index_copy_``, and the host/device ratio that it reads from the server's
runtime config is 2 (hiradix reads it from ``ServerArgs``); a one-rank gloo group stands in
for the TP group.

Workload: ``bench/workload.py``, as ``bench/tree_ops.py`` (200 system prompts x 100
continuations, 256-2048 tokens, shuffled; ``--scale`` takes that fraction of the prompts).
Sequence ``i`` owns device slots laid out as a fresh allocator hands them out (page-aligned
runs from slot ``page_size`` on), written into its ``ReqToTokenPool`` row before timing.
The device pool holds every sequence's slots, so nothing is evicted before evict-all; the
host pool (ratio 2) holds every backup.

Figures per repeat (fresh caches, untimed builds), each phase timed as a whole:

``insert/s``  ``insert(InsertParams(RadixKey(key), value))`` of every page-aligned key in
              workload order, every ``--step`` of them (default 1) followed by
              ``check_hicache_events()`` (the scheduler's once-per-step bookkeeping, which
              acknowledges finished backups; hiradix.sglang starts a step's backups there).
``finish/s``  the same requests ended through ``cache_finished_req(req,
              kv_len_to_handle=len)`` on real SGLang ``Req`` objects (full, unaligned
              sequences; their ``ReqToTokenPool`` rows), every ``--step`` of them followed
              by ``check_hicache_events()``, on a second fresh cache: insert, free of the
              duplicate prefix and the unaligned tail, lock release.
``match/s``   ``match_prefix(MatchPrefixParams(RadixKey(key))).device_indices`` of every
              key on the insert/s cache (all full hits).
``evict_all`` on the insert/s cache, once every backup has been acknowledged
              (``check_hicache_events`` / ``writing_check`` until none is in flight; both
              caches are then checked to have nothing protected), one
              ``evict(EvictParams(evictable_size()))`` call: every node is demoted to host.

Each figure is reported three ways: over wall time (the headline), over the calling
(scheduler) thread's CPU time (``time.thread_time``: what the scheduler pays when the copy
threads have cores of their own; hardly moved by being descheduled on a shared machine) and
over the process's CPU time (all threads; both caches copy backups in the calling thread:
hiradix.sglang's default ``backup_copy`` "inline" on CPU pools, ``--backup-copy thread``
hands them to hiradix's copy thread instead). ``cpu/wall`` is process CPU over wall time of
the timed phases: well below 1 for a single-threaded cache means it was descheduled.

Device slots handed back to the allocator go to an O(1) counter instead of SGLang's free
list, for both caches (SGLang's ``free`` concatenates onto the free list per call, which is
the allocator's cost, not the cache's; see ``bench/sglang_baselines.py``). Before each timed
phase ``gc.collect(); gc.freeze()``; torch runs one intra-op thread (as in
``sglang_baselines.py``).

Checked in every repeat (untimed), so a fast but wrong cache fails the run: every key is
a full hit on a sample; matched lengths *and* device indices agree between the two caches on
that sample and on partial-hit keys (a cached prefix plus fresh tokens); the tokens cached
after the inserts agree, and equal those cached after ``cache_finished_req``; the slots the
requests freed plus the slots cached equal the slots the requests held; evict-all evicts
everything evictable and hands exactly that many slots back.

Usage::

    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.1 --repeats 1 --warmup 0   # ~1 min
    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.25 --json out.json   # the table, ~4 min
    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.1 --impls hiradix --profile hiradix
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import gc
import json
import logging
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import describe, make_workload  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    import hiradix.sglang as hs

logger = logging.getLogger(__name__)

IMPLS = ("hiradix", "sglang")
PHASES = frozenset(("insert", "finish", "match", "evict_all"))  # insert and match always run
BACKUP_COPY = "inline"  # hiradix.sglang's backup_copy (--backup-copy)
LABELS = {"hiradix": "hiradix.sglang.HiRadixCache", "sglang": "sglang 0.5.18 HiRadixCache"}
METRICS = (("insert_per_s", True), ("finish_per_s", True), ("match_per_s", True), ("evict_all_s", False))
# The same figures over process CPU time instead of wall time (hiradix's includes its copy threads):
# less sensitive to being descheduled on a shared machine.
CPU_METRICS = (
    ("insert_per_cpu_s", True),
    ("finish_per_cpu_s", True),
    ("match_per_cpu_s", True),
    ("evict_all_cpu_s", False),
)
# ... and over the CPU time of the calling (scheduler) thread alone: what the scheduler pays
# when the copy threads have cores of their own.
THREAD_METRICS = (
    ("insert_per_thread_s", True),
    ("finish_per_thread_s", True),
    ("match_per_thread_s", True),
    ("evict_all_thread_s", False),
)
HICACHE_RATIO = 2.0
MAX_LEN = 2048  # the workload's longest sequence


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- SGLang on CPU
def patch_sglang_for_cpu() -> None:
    """What SGLang 0.5.18's HiRadixCache needs to run on CPU (from bench/sglang_baselines.py)."""
    import sglang.srt.mem_cache.hiradix_cache as hrc
    import sglang.srt.mem_cache.pool_host.base as phb
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.srt.mem_cache.pool_host.mha as phm
    import torch.distributed as dist

    phc._cuda_host_register = lambda buffer: None  # no CUDA: pinning is a no-op
    phc._cuda_host_unregister = lambda buffer: None

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        # sgl_kernel's op is CUDA/HIP only: the same per-layer gather/scatter with torch.
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    phm.transfer_kv_direct = transfer_kv_direct
    # SGLang refuses a host pool unless 10 GiB stay available beside it, a server's margin.
    # These pools are tens of MB, and on a shared 24 GB machine running test suites the
    # margin alone made the build fail ("only have -1.15 GB free").
    phb.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    # SGLang reads the host/device ratio from the server's published runtime config.
    hrc.get_memory = lambda: types.SimpleNamespace(hicache_ratio=HICACHE_RATIO)
    if not dist.is_initialized():  # HiRadixCache asks the (default) TP group its size
        fd, path = tempfile.mkstemp(prefix="sglang_api_pg_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


class FreeCounter:
    """Counts the device slots handed back to the allocator (O(1) per call), for both caches."""

    def __init__(self) -> None:
        self.tokens = 0

    def free(self, indices: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.tokens += len(indices)

    def free_segment(self, indices: torch.Tensor, *, start_pos: int = 0) -> None:
        self.tokens += len(indices)

    def free_segments(self, segments: list) -> None:
        for indices, _ in segments:
            self.tokens += len(indices)

    def install(self, allocator: Any) -> None:
        allocator.free = self.free
        allocator.free_segment = self.free_segment
        allocator.free_segments = self.free_segments


class _Worker:
    """The part of SGLang's TP worker the cache factory calls."""

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


def build_cache(impl: str, page_size: int, pool_size: int, req_to_token: Any) -> tuple[Any, FreeCounter]:
    """A cache built through SGLang's ``create_tree_cache``, as the scheduler builds it."""
    kv = MHATokenToKVPool(
        size=pool_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=1,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    for buf in (*kv.k_buffer, *kv.v_buffer):  # content, so the backups copy real data
        buf.copy_((torch.arange(buf.shape[0]) % 1024).to(buf.dtype).view(-1, 1, 1))
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=pool_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=pool_size, page_size=page_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
    freed = FreeCounter()
    freed.install(alloc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server_args = ServerArgs(
            model_path="dummy",
            device="cpu",
            enable_hierarchical_cache=True,
            radix_cache_backend="hiradix" if impl == "hiradix" else None,
            page_size=page_size,
            hicache_mem_layout="layer_first",
            hicache_io_backend="direct",
            hicache_write_policy="write_through",
            hicache_ratio=HICACHE_RATIO,
            hicache_storage_backend_extra_config=(
                json.dumps({"backup_copy": BACKUP_COPY}) if impl == "hiradix" else None
            ),
        )
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=alloc, page_size=page_size
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=True,
        disable_radix_cache=False,
        effective_chunked_prefill_size=None,
        tp_worker=_Worker(),
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    want = (
        hs.HiRadixCache
        if impl == "hiradix"
        else __import__("sglang.srt.mem_cache.hiradix_cache", fromlist=["HiRadixCache"]).HiRadixCache
    )
    if type(cache) is not want:
        raise RuntimeError(f"{impl}: create_tree_cache built {type(cache).__name__}, expected {want}")
    atexit.unregister(cache.shutdown)  # else atexit keeps every cache (and its pools) alive
    return cache, freed


def close_cache(impl: str, cache: Any) -> None:
    if impl == "hiradix":
        cache.core.close()  # stops its copy threads
    else:
        cache.release_host_resources()


def in_flight(impl: str, cache: Any) -> int:
    """Backups not yet acknowledged."""
    return len(cache.core.ongoing_write_through) if impl == "hiradix" else len(cache.ongoing_write_through)


def drain_backups(impl: str, cache: Any, timeout_s: float = 120.0) -> None:
    """Acknowledge every backup, as the scheduler's later steps would: ``check_hicache_events``
    until none is in flight (bounded)."""
    deadline = time.monotonic() + timeout_s
    while in_flight(impl, cache):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{impl}: {in_flight(impl, cache)} backups still in flight after {timeout_s} s")
        cache.check_hicache_events()
        time.sleep(0.001)  # a benchmark, not a test: let the copy thread run
    if cache.protected_size() != 0:
        raise AssertionError(f"{impl}: {cache.protected_size()} tokens still protected after the acks")


# ----------------------------------------------------------------------------- workload
class Workload:
    """Keys, slots, requests and check samples for one page size, shared by both caches."""

    def __init__(self, seqs: list[np.ndarray], page_size: int, seed: int = 0) -> None:
        ps = self.page_size = page_size
        self.lens = [len(s) for s in seqs]
        self.aligned = [n // ps * ps for n in self.lens]
        self.tokens = [array("q", s.astype(np.int64).tobytes()) for s in seqs]
        self.keys = [t[:n] for t, n in zip(self.tokens, self.aligned, strict=True)]
        # Slots as a fresh allocator hands them out: page-aligned runs from slot page_size on.
        starts, off = [], ps
        for n in self.lens:
            starts.append(off)
            off += -(-n // ps) * ps
        self.pool_size = off
        base = torch.arange(off, dtype=torch.int64)
        self.values = [base[s : s + n] for s, n in zip(starts, self.aligned, strict=True)]
        # Requests: one ReqToTokenPool row each, holding its slots (cache_finished_req reads it).
        self.req_to_token = ReqToTokenPool(
            size=len(seqs), max_context_len=MAX_LEN, device="cpu", enable_memory_saver=False
        )
        self.reqs = []
        for i, (t, s, n) in enumerate(zip(self.tokens, starts, self.lens, strict=True)):
            req = Req(f"r{i}", "", t, SamplingParams(max_new_tokens=1))
            if self.req_to_token.alloc([req]) is None:
                raise RuntimeError("ReqToTokenPool is full")
            self.req_to_token.write((req.req_pool_idx, slice(0, n)), base[s : s + n].to(torch.int32))
            self.reqs.append(req)
        # Check samples: every ~100th key in full, and partial hits (a cached prefix + fresh tokens).
        rng = np.random.default_rng(seed + 99)
        step = max(1, len(seqs) // 100)
        self.sample = list(range(0, len(seqs), step))
        self.partial = []
        for i in self.sample:
            cut = int(rng.integers(1, self.lens[i]))
            fresh = rng.integers(32000, 64000, int(rng.integers(1, 300)), dtype=np.int64)  # never in the workload
            self.partial.append(self.tokens[i][:cut] + array("q", fresh.tobytes()))


# ----------------------------------------------------------------------------- one repeat
class Clock:
    """Wall and process-CPU time of the timed phases (cpu/wall well below 1: descheduled),
    optionally profiling each phase into its own ``cProfile.Profile``."""

    def __init__(self, profiles: dict[str, cProfile.Profile] | None = None) -> None:
        self.wall = self.cpu = 0.0
        self.profiles = profiles

    def phase(self, name: str) -> Clock:
        self._prof = None if self.profiles is None else self.profiles.setdefault(name, cProfile.Profile())
        return self

    def __enter__(self) -> Clock:
        gc.collect()
        gc.freeze()  # collections scan what the phase creates, not the prepared inputs
        self._w, self._c, self._t = time.perf_counter(), time.process_time(), time.thread_time()
        if self._prof is not None:
            self._prof.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._prof.disable()
        self.last = time.perf_counter() - self._w
        self.last_cpu = time.process_time() - self._c
        self.last_thread = time.thread_time() - self._t
        self.wall += self.last
        self.cpu += self.last_cpu
        gc.unfreeze()


def match_signature(cache: Any, keys: list[array]) -> list[tuple[int, int]]:
    """(matched length, hash of the matched device indices) per key."""
    out = []
    for k in keys:
        idx = cache.match_prefix(MatchPrefixParams(key=RadixKey(k))).device_indices
        out.append((len(idx), hash(idx.numpy().tobytes())))
    return out


def one_repeat(impl: str, w: Workload, profiles: dict[str, cProfile.Profile] | None = None, step: int = 1,
               phases: frozenset[str] = PHASES) -> dict:
    out: dict[str, Any] = dict.fromkeys(m for group in (METRICS, CPU_METRICS, THREAD_METRICS) for m, _ in group)
    for m in out:  # a phase not run (--phases) reports NaN
        out[m] = float("nan")
    clock = Clock(profiles)

    # insert/s, then match/s and evict-all on the same cache
    cache, freed = build_cache(impl, w.page_size, w.pool_size, w.req_to_token)
    insert, events = cache.insert, cache.check_hicache_events
    with clock.phase("insert"):
        for i, (k, v) in enumerate(zip(w.keys, w.values, strict=True), 1):
            insert(InsertParams(key=RadixKey(k), value=v))
            if i % step == 0:
                events()
        events()
    out["insert_per_s"] = len(w.keys) / clock.last
    out["insert_per_cpu_s"] = len(w.keys) / clock.last_cpu
    out["insert_per_thread_s"] = len(w.keys) / clock.last_thread
    match = cache.match_prefix
    with clock.phase("match"):
        for k in w.keys:
            idx = match(MatchPrefixParams(key=RadixKey(k))).device_indices  # what the scheduler reads
    out["match_per_s"] = len(w.keys) / clock.last
    del idx
    out["match_per_cpu_s"] = len(w.keys) / clock.last_cpu
    out["match_per_thread_s"] = len(w.keys) / clock.last_thread
    sig = match_signature(cache, [w.keys[i] for i in w.sample])
    for i, (n, _) in zip(w.sample, sig, strict=True):
        if n != w.aligned[i]:
            raise AssertionError(f"{impl}: key {i} matched {n} of {w.aligned[i]} tokens")
    out["signature"] = sig + match_signature(cache, w.partial)
    drain_backups(impl, cache)
    cached = out["cached_tokens"] = cache.evictable_size()
    assert freed.tokens == 0, freed.tokens
    if "evict_all" not in phases and "finish" not in phases:  # --phases insert,match
        close_cache(impl, cache)
        out["cpu_share"] = clock.cpu / clock.wall
        return out
    with clock.phase("evict_all"):
        evicted = cache.evict(EvictParams(num_tokens=cached)).num_tokens_evicted
    out["evict_all_s"] = clock.last
    out["evict_all_cpu_s"] = clock.last_cpu
    out["evict_all_thread_s"] = clock.last_thread
    if evicted != cached or cache.evictable_size() != 0 or freed.tokens != cached:
        raise AssertionError(
            f"{impl}: evict-all evicted {evicted} of {cached}, {cache.evictable_size()} left "
            f"evictable, {freed.tokens} slots handed back"
        )
    close_cache(impl, cache)
    del cache, insert, events, match
    gc.collect()
    if "finish" not in phases:
        out["cpu_share"] = clock.cpu / clock.wall
        return out

    # finish/s: the same requests through cache_finished_req, on a fresh cache
    cache, freed = build_cache(impl, w.page_size, w.pool_size, w.req_to_token)
    finish, events = cache.cache_finished_req, cache.check_hicache_events
    with clock.phase("finish"):
        for i, (req, n) in enumerate(zip(w.reqs, w.lens, strict=True), 1):
            finish(req, kv_len_to_handle=n)
            if i % step == 0:
                events()
        events()
    out["finish_per_s"] = len(w.reqs) / clock.last
    out["finish_per_cpu_s"] = len(w.reqs) / clock.last_cpu
    out["finish_per_thread_s"] = len(w.reqs) / clock.last_thread
    drain_backups(impl, cache)
    if cache.evictable_size() != cached:
        raise AssertionError(f"{impl}: cache_finished_req cached {cache.evictable_size()} tokens, insert {cached}")
    if freed.tokens + cached != sum(w.lens):
        raise AssertionError(f"{impl}: requests held {sum(w.lens)} slots; {freed.tokens} freed + {cached} cached")
    if impl == "hiradix":
        cache.core.tree.check_invariants()
    close_cache(impl, cache)
    del cache, finish, events
    gc.collect()
    out["cpu_share"] = clock.cpu / clock.wall
    return out


# ----------------------------------------------------------------------------- driver
def hiradix_source() -> str:
    """The hiradix checkout measured (an editable install may live outside this tree)."""
    import hiradix

    root = Path(hiradix.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return f"{root} @ {rev or '?'}"


def machine() -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load": os.getloadavg(),
        "hiradix": hiradix_source(),
    }


def bench_page(ps: int, seqs: list[np.ndarray], args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    w = Workload(seqs, ps, args.seed)
    log(
        f"page {ps}: {len(w.keys)} keys, {sum(w.aligned):,} aligned tokens, pool {w.pool_size:,} slots "
        f"(prepared in {time.perf_counter() - t0:.1f} s)"
    )
    impls = [i for i in IMPLS if i in args.impls]
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    for r in range(-args.warmup, args.repeats):
        order = impls if r % 2 == 0 else impls[::-1]  # alternate, so drift hits both alike
        for impl in order:
            res = one_repeat(impl, w, step=args.step, phases=args.phases)
            tag = "warm-up" if r < 0 else f"repeat {r + 1}/{args.repeats}"
            log(
                f"  {tag} {impl:8s}: "
                + ", ".join(f"{m}={res[m]:.4g}" for m, _ in METRICS)
                + f", cpu/wall={res['cpu_share']:.2f}"
            )
            if r >= 0:
                runs[impl].append(res)
    # the two caches must agree: same tokens cached, same matched lengths and device indices
    if len(impls) == 2:
        a, b = (runs[i][0] for i in impls)
        if a["cached_tokens"] != b["cached_tokens"]:
            raise AssertionError(f"cached tokens differ: {a['cached_tokens']} vs {b['cached_tokens']}")
        diff = [j for j, (x, y) in enumerate(zip(a["signature"], b["signature"], strict=True)) if x != y]
        if diff:
            j = diff[0]
            raise AssertionError(
                f"{len(diff)} sample matches differ, first #{j}: {a['signature'][j]} vs {b['signature'][j]}"
            )
        log(
            f"  check: both cache {a['cached_tokens']:,} tokens; {len(a['signature'])} sample matches agree "
            "(lengths and device indices)"
        )
    result: dict = {"keys": len(w.keys), "tokens": sum(w.aligned), "cached_tokens": runs[impls[0]][0]["cached_tokens"]}
    for impl in impls:
        result[impl] = {}
        for m, higher in (*METRICS, *CPU_METRICS, *THREAD_METRICS, ("cpu_share", True)):
            vals = [x[m] for x in runs[impl]]
            result[impl][m] = {
                "median": statistics.median(vals),
                "best": max(vals) if higher else min(vals),
                "runs": vals,
            }
    for impl in args.profile or ():
        profiles: dict[str, cProfile.Profile] = {}
        one_repeat(impl, w, profiles, step=args.step, phases=args.phases)
        for phase, prof in profiles.items():
            log(f"  cProfile of {impl} {phase}, page {ps} (an extra untimed repeat):")
            log(profile_table(prof))
    return result


def profile_table(prof: cProfile.Profile, top: int = 14) -> str:
    """The ``top`` functions by own time, each with its share of the phase."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = ["    own%   cum%   calls  function"]
    for (path, line, func), (_, calls, tt, ct, _) in rows:
        where = f"{Path(path).name}:{line}" if path != "~" else ""
        lines.append(f"    {100 * tt / total:5.1f}  {100 * ct / total:5.1f} {calls:7d}  {func} {where}")
    return "\n".join(lines)


def fmt(metric: str, v: float) -> str:
    return f"{v / 1e3:,.2f}k" if "_per_" in metric else f"{v * 1e3:,.1f} ms"


def report(results: dict, meta: dict) -> str:
    lines = [
        f"Workload: {meta['workload']['count']} sequences, {meta['workload']['total_tokens']:,} tokens "
        f"(scale {meta['scale']}); {meta['step']} request(s) per step; hiradix's backup copies "
        f"{meta.get('backup_copy', 'inline')}; warm-up {meta['warmup']}, "
        f"{meta['repeats']} repeats, medians (best in parentheses).",
    ]
    for title, metrics in (
        ("wall time", METRICS),
        ("the calling thread's CPU time", THREAD_METRICS),
        ("process CPU time (all threads)", CPU_METRICS),
    ):
        lines += [
            "",
            f"Over {title}:",
            "",
            "| page | implementation | insert/s | finish/s | match/s | evict-all | cpu/wall |",
            "|---|---|---|---|---|---|---|",
        ]
        for ps, res in results.items():
            for impl in IMPLS:
                if impl not in res:
                    continue
                r = res[impl]
                lines.append(
                    f"| {ps} | {LABELS[impl]} | "
                    + " | ".join(f"{fmt(m, r[m]['median'])} ({fmt(m, r[m]['best'])})" for m, _ in metrics)
                    + f" | {r['cpu_share']['median']:.2f} |"
                )
            if all(i in res for i in IMPLS):
                a, b = res["hiradix"], res["sglang"]
                ratios = [
                    a[m]["median"] / b[m]["median"] if hi else b[m]["median"] / a[m]["median"] for m, hi in metrics
                ]
                lines.append(f"| {ps} | **hiradix / SGLang** | " + " | ".join(f"**{x:.1f}×**" for x in ratios) + " | |")
                lines.append(f"| {ps} | hiradix / SGLang, paired | " + " | ".join(
                    f"{paired_ratio(a[m]['runs'], b[m]['runs'], hi):.1f}×" for m, hi in metrics) + " | |")
    lines += [
        "",
        "*paired*: the median over repeats of that repeat's ratio. The two caches run back to "
        "back within a repeat (in alternating order), so a load change between repeats moves "
        "both; the ratio of medians above pairs figures from different repeats.",
    ]
    return "\n".join(lines)


def paired_ratio(ours: list[float], theirs: list[float], higher_is_better: bool) -> float:
    """The median of per-repeat ratios of hiradix's figure to SGLang's (inverted for a
    time, where lower is better).

    >>> paired_ratio([10.0, 2.0, 9.0], [2.0, 1.0, 3.0], True)
    3.0
    """
    ratios = [(a / b if higher_is_better else b / a) for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the 200 system prompts (default 0.1)")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed full repeats of each cache first (default 1)")
    ap.add_argument("--impls", default="hiradix,sglang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        action="append",
        choices=IMPLS,
        help="after the repeats, cProfile one more repeat of this cache, per phase (repeatable)",
    )
    ap.add_argument(
        "--step",
        type=int,
        default=1,
        help="requests per scheduler step: check_hicache_events() after every STEP inserts/finishes "
        "(default 1: after each; SGLang's scheduler calls it once per step, whatever the batch finished)",
    )
    ap.add_argument(
        "--backup-copy",
        choices=("inline", "thread"),
        default="inline",
        help="hiradix.sglang's backup_copy: copy a step's backups on the calling thread (default, as SGLang "
        "does) or hand them to its copy thread",
    )
    ap.add_argument(
        "--phases",
        default=",".join(sorted(PHASES)),
        help="comma-separated phases to run: insert and match always run (match needs the inserts); "
        "'insert,match' skips finish and evict-all (NaN in the table) for a fast match loop",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    global BACKUP_COPY
    BACKUP_COPY = args.backup_copy
    if args.step < 1:
        ap.error("--step must be >= 1")
    args.impls = args.impls.split(",")
    args.phases = frozenset(args.phases.split(",")) | {"insert", "match"}
    if not args.phases <= PHASES:
        ap.error(f"--phases: unknown {sorted(args.phases - PHASES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    logging.getLogger("sglang").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    patch_sglang_for_cpu()
    hs.register()
    seqs = make_workload(seed=args.seed, n_prompts=max(1, round(200 * args.scale)))
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "scale": args.scale,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "step": args.step,
        "backup_copy": args.backup_copy,
        "workload": describe(seqs),
        "command": "python bench/sglang_api.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    log(
        f"{meta['machine']['cpu']}, load {meta['machine']['load']}; hiradix {meta['machine']['hiradix']}; "
        f"workload {meta['workload']}"
    )
    t0 = time.perf_counter()
    results = {ps: bench_page(ps, seqs, args) for ps in (int(p) for p in args.page_sizes.split(","))}
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    meta["load_after"] = os.getloadavg()
    print(report(results, meta))
    log(f"elapsed {meta['elapsed_s']} s, load after {meta['load_after']}")
    if args.json:
        for res in results.values():
            for impl in IMPLS:
                res.get(impl, {}).pop("signature", None)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip tearing down millions of tree objects one by one
