"""hiradix.sglang against SGLang's own hierarchical cache, all driven through SGLang's request
API on SGLang's CPU pools, in one process (same machine, same minute).

The installed SGLang picks the comparison (``hiradix.sglang.api.REQUEST_API``):

- **SGLang 0.5.18** (``.venv``): hiradix.sglang against SGLang's ``HiRadixCache``
  (``sglang``), through ``insert`` / ``cache_finished_req`` / ``match_prefix``, whose
  result carries the device indices.
- **SGLang 0.5.23** (``.venv-sglang23``): hiradix.sglang against SGLang's hierarchical
  ``UnifiedRadixCache`` on each of its two tree cores, the pure-Python ``UnifiedTreeCore``
  (``python``) and the Rust ``RustUnifiedTreeCore`` (``rust``, the ``mem_cache`` extension
  bundled in SGLang's wheel), chosen as a server chooses it, by
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` at build time; the class of ``cache.tree_core``
  is checked, so a silent fallback to Python fails the run. Through 0.5.23's request API as
  its scheduler calls it: ``checkpoint_kv_cache`` / ``release_kv_cache`` (SGLang's own
  functions, on real ``Req`` objects) and a ``match_prefix`` that returns the prefix
  *length*. The ratio rows divide hiradix's figure by the faster core's, column by column.

Every cache is built as SGLang's scheduler builds it, by SGLang's ``create_tree_cache``:
``--enable-hierarchical-cache``, write_through, ``layer_first`` host layout, io backend
``direct``, host/device ratio 2 (``--radix-cache-backend hiradix`` selects hiradix's; the
default chain selects SGLang's); SGLang's ``MHATokenToKVPool`` on CPU (1 layer, 1 head,
head_dim 1, bf16: the copies are real but tiny, so the figures are the cache's, not the
memcpy's), ``TokenToKVPoolAllocator`` (page 1) / ``PagedTokenToKVPoolAllocator`` (page 16)
and a ``ReqToTokenPool``. SGLang's caches need, on CPU: pinning the host pool is a no-op,
``transfer_kv_direct`` (CUDA-only) is a per-layer ``index_select``/``index_copy_``, and
SGLang's 10 GiB host-memory reserve is 0 (see ``bench/sglang_baselines.py``). 0.5.18's reads
the host/device ratio from the server's runtime config (patched to 2) and a one-rank gloo
group stands in for the TP group; 0.5.23 reads its flags from its runtime context, where they
are published as a launched server publishes them (``override_server_args``), one rank.

Workload: ``bench/workload.py``, as ``bench/tree_ops.py`` (200 system prompts x 100
continuations, 256-2048 tokens, shuffled; ``--scale`` takes that fraction of the prompts).
Sequence ``i`` owns device slots laid out as a fresh allocator hands them out (page-aligned
runs from slot ``page_size`` on), written into its ``ReqToTokenPool`` row before timing.
The device pool holds every sequence's slots, so nothing is evicted before evict-all; the
host pool (ratio 2) holds every backup.

Figures per repeat (fresh caches, untimed builds), each phase timed as a whole; a *step* is
``--step`` requests (default 1), after which the scheduler's once-per-step bookkeeping runs
(0.5.18: ``check_hicache_events()``, which acknowledges finished backups and in which
hiradix.sglang starts the step's backups; 0.5.23: ``flush_pending_backups()`` then
``check_hicache_events()``, as its scheduler calls them after a batch and at the next step):

``insert/s``  0.5.18: ``insert(InsertParams(RadixKey(key), value))`` of every page-aligned
              key in workload order. 0.5.23: ``checkpoint_kv_cache(req, cache)`` of the same
              sequences as running requests (``extend_end`` = their length; their
              ``ReqToTokenPool`` rows hold their slots): the insert of the page-aligned part,
              the free of the duplicate prefix, the row pointed at the tree's slots, the
              request's ``TreeLock`` moved. Untimed afterwards, each is released as an abort
              (``release_kv_cache(checkpoint=False)``: its unaligned tail freed, its lock
              dropped), so the tree is all evictable for the next phases.
``finish/s``  the same requests ended, on a second fresh cache: 0.5.18
              ``cache_finished_req(req, kv_len_to_handle=len)``; 0.5.23
              ``release_kv_cache(req, cache, checkpoint=True)`` on finished requests (its
              checkpoint, then the tail freed, the lock dropped, the row returned). Full,
              unaligned sequences.
``match/s``   ``match_prefix(MatchPrefixParams(RadixKey(key)))`` of every key on the insert/s
              cache (all full hits), reading what the scheduler reads: 0.5.18 the
              ``device_indices``, 0.5.23 the ``device_prefix_len`` (0.5.23's scheduler reads
              the slots with ``prefix_device_indices`` only for a request it admits; the
              checks below call it).
``evict_all`` on the insert/s cache, once every backup has been acknowledged
              (``check_hicache_events`` until none is in flight; every cache is then checked
              to have nothing protected), one ``evict(EvictParams(evictable_size()))`` call:
              every node is demoted to host.
``load/s``    then, on that cache (everything on the host, the device free), every key
              matched again in workload order and its host hit loaded back,
              ``init_load_back(InitLoadBackParams(best_match_node, host_hit_length))``, with
              the step's ``ready_to_load_host_cache()`` and ``check_hicache_events()`` (which
              acknowledges the loads that landed); keys per second, and ``init_load_back``
              calls per second of the thread CPU time in them alone. Checked: what was loaded
              is then on the device, unlocked. hiradix only, on 0.5.18 (the ``load_back``
              phase).

Each figure is reported three ways: over wall time (the headline), over the calling
(scheduler) thread's CPU time (``time.thread_time``: what the scheduler pays when the copy
threads have cores of their own; hardly moved by being descheduled on a shared machine) and
over the process's CPU time (all threads; every cache copies backups in the calling thread:
hiradix.sglang's default ``backup_copy`` "inline" on CPU pools, ``--backup-copy thread``
hands them to hiradix's copy thread instead). ``cpu/wall`` is process CPU over wall time of
the timed phases: well below 1 for a single-threaded cache means it was descheduled.

Device slots handed back to the allocator go to an O(1) counter instead of SGLang's free
list, for every cache (SGLang's ``free`` concatenates onto the free list per call, which is
the allocator's cost, not the cache's; see ``bench/sglang_baselines.py``). Before each timed
phase ``gc.collect(); gc.freeze()``; torch runs one intra-op thread (as in
``sglang_baselines.py``).

Checked in every repeat (untimed), so a fast but wrong cache fails the run: every key is
a full hit on a sample; matched lengths *and* device indices (0.5.23: ``path_device_indices``
of the match node) agree between all caches on that sample and on partial-hit keys (a cached
prefix plus fresh tokens); the tokens cached after the inserts agree, and equal those cached
after the finishes; the slots the requests freed plus the slots cached equal the slots the
requests held (0.5.18's ``insert`` frees nothing; 0.5.23's checkpoint frees the duplicates);
after a 0.5.23 checkpoint, a sample of request rows holds exactly the tree's slots and the
protected length is the aligned length; evict-all evicts everything evictable and hands
exactly that many slots back; hiradix's tree invariants hold.

Usage::

    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.1 --repeats 1 --warmup 0   # ~1 min
    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.25 --json out.json   # the table, ~4 min
    PYTHONPATH=tests/stubs .venv/bin/python bench/sglang_api.py --scale 0.1 --impls hiradix --profile hiradix
    PYTHONPATH=tests/stubs .venv-sglang23/bin/python bench/sglang_api.py --scale 0.1 --step 8   # 0.5.23, 3 caches
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import dataclasses
import gc
import importlib.metadata
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
from typing import Any, ClassVar

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import describe, make_workload  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    import hiradix.sglang as hs
    from hiradix.sglang.api import REQUEST_API

logger = logging.getLogger(__name__)

PHASES = frozenset(("insert", "finish", "match", "evict_all", "load_back"))  # insert and match always run
BACKUP_COPY = "inline"  # hiradix.sglang's backup_copy (--backup-copy)
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
# Load-back (after evict-all; hiradix on 0.5.18 only), over wall, process-CPU and thread-CPU time.
LOAD_METRICS = (
    ("load_back_per_s", True),
    ("load_back_per_cpu_s", True),
    ("load_back_per_thread_s", True),
    ("init_load_back_per_thread_s", True),  # the init_load_back calls alone
)
HICACHE_RATIO = 2.0
MAX_LEN = 2048  # the workload's longest sequence


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- SGLang on CPU
def patch_host_pools_for_cpu(transfer_modules: tuple[Any, ...]) -> None:
    """What SGLang's host pools need on CPU (0.5.18 and 0.5.23 alike)."""
    import sglang.srt.mem_cache.pool_host.base as phb
    import sglang.srt.mem_cache.pool_host.common as phc

    phc._cuda_host_register = lambda *args, **kwargs: None  # no CUDA: pinning is a no-op
    phc._cuda_host_unregister = lambda *args, **kwargs: None

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        # sgl_kernel's op is CUDA/HIP only: the same per-layer gather/scatter with torch.
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    for module in transfer_modules:
        module.transfer_kv_direct = transfer_kv_direct
    # SGLang refuses a host pool unless 10 GiB stay available beside it, a server's margin.
    # These pools are tens of MB, and on a shared 24 GB machine running test suites the
    # margin alone made the build fail ("only have -1.15 GB free").
    phb.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0


class FreeCounter:
    """Counts the device slots handed back to the allocator (O(1) per call), for every cache."""

    def __init__(self) -> None:
        self.tokens = 0

    # shape[0], not len(): a tensor's __len__ is Python-level, several µs
    def free(self, indices: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.tokens += indices.shape[0]

    def free_segment(self, indices: torch.Tensor, *, start_pos: int = 0) -> None:
        self.tokens += indices.shape[0]

    def free_segments(self, segments: list) -> None:
        for indices, _ in segments:
            self.tokens += indices.shape[0]

    def install(self, allocator: Any) -> None:
        allocator.free = allocator.free_full = self.free
        allocator.free_segment = allocator.free_full_segment = self.free_segment
        allocator.free_segments = allocator.free_full_segments = self.free_segments


class _Worker:
    """The part of SGLang's TP worker the cache factory calls."""

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


def cpu_pools(page_size: int, pool_size: int) -> tuple[Any, FreeCounter]:
    """SGLang's CPU KV pool (with content, so the backups copy real data) and its allocator,
    whose frees go to a :class:`FreeCounter`."""
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
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf.copy_((torch.arange(buf.shape[0]) % 1024).to(buf.dtype).view(-1, 1, 1))
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=pool_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=pool_size, page_size=page_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
    freed = FreeCounter()
    freed.install(alloc)
    return alloc, freed


def build_cache(
    impl: str, page_size: int, pool_size: int, req_to_token: Any, params: dict[str, Any] | None = None
) -> tuple[Any, FreeCounter]:
    """SGLang 0.5.18: a cache (``impl`` "hiradix" or "sglang") built through SGLang's
    ``create_tree_cache`` on :func:`cpu_pools`, as the scheduler builds it; ``params`` are
    more ``CacheInitParams`` fields (``is_eagle``: ``bench/long_context.py``). Also used by
    ``bench/long_context.py`` and ``bench/memory.py``."""
    alloc, freed = cpu_pools(page_size, pool_size)
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
            hicache_storage_backend_extra_config=hiradix_extra_config() if impl == "hiradix" else None,
        )
    init = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        **(params or {}),
    )
    cache = create_tree_cache(build_context(server_args, init))
    want = (
        hs.HiRadixCache
        if impl == "hiradix"
        else __import__("sglang.srt.mem_cache.hiradix_cache", fromlist=["HiRadixCache"]).HiRadixCache
    )
    if type(cache) is not want:
        raise RuntimeError(f"{impl}: create_tree_cache built {type(cache).__name__}, expected {want}")
    atexit.unregister(cache.shutdown)  # else atexit keeps every cache (and its pools) alive
    return cache, freed


def build_context(server_args: Any, params: Any) -> Any:
    """The scheduler's ``TreeCacheBuildContext`` for one rank of a plain (not hybrid) model."""
    # 0.5.18's context has the chunked prefill size (no default); 0.5.23's dropped it
    more = (
        {"effective_chunked_prefill_size": None}
        if "effective_chunked_prefill_size" in {f.name for f in dataclasses.fields(TreeCacheBuildContext)}
        else {}
    )
    return TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=True,
        disable_radix_cache=False,
        tp_worker=_Worker(),
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        **more,
    )


def hiradix_extra_config() -> str:
    return json.dumps({"backup_copy": BACKUP_COPY})


# ----------------------------------------------------------------------------- workload
class Workload:
    """Keys, slots and check samples for one page size, shared by every cache; requests
    are the API's (:meth:`Api18.prepare`, :meth:`Api23.requests`)."""

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
        # each request's ReqToTokenPool row: its slots, all of them (unaligned tail included)
        self.rows = [base[s : s + n].to(torch.int32) for s, n in zip(starts, self.lens, strict=True)]
        self.req_to_token = ReqToTokenPool(
            size=len(seqs), max_context_len=MAX_LEN, device="cpu", enable_memory_saver=False
        )
        self.reqs: list[Any] = []
        # Check samples: every ~100th key in full, and partial hits (a cached prefix + fresh tokens).
        rng = np.random.default_rng(seed + 99)
        step = max(1, len(seqs) // 100)
        self.sample = list(range(0, len(seqs), step))
        self.partial = []
        for i in self.sample:
            cut = int(rng.integers(1, self.lens[i]))
            fresh = rng.integers(32000, 64000, int(rng.integers(1, 300)), dtype=np.int64)  # never in the workload
            self.partial.append(self.tokens[i][:cut] + array("q", fresh.tobytes()))

    def new_req(self, i: int) -> Any:
        """A real SGLang ``Req`` for sequence ``i`` holding a ``ReqToTokenPool`` row with
        its slots."""
        req = Req(f"r{i}", "", self.tokens[i], SamplingParams(max_new_tokens=1))
        if self.req_to_token.alloc([req]) is None:
            raise RuntimeError("ReqToTokenPool is full")
        row = req.req_pool_idx if REQUEST_API == "cache_req" else req.kv.req_pool_idx
        self.req_to_token.write((row, slice(0, self.lens[i])), self.rows[i])
        return req


# ----------------------------------------------------------------------------- request APIs
class Api18:
    """SGLang 0.5.18: its ``HiRadixCache``; ``insert`` and ``cache_finished_req``, and a
    match whose result carries the device indices."""

    version = "0.5.18"
    impls: tuple[str, ...] = ("hiradix", "sglang")
    labels: ClassVar[dict[str, str]] = {
        "hiradix": "hiradix.sglang.HiRadixCache",
        "sglang": "sglang 0.5.18 HiRadixCache",
    }

    def setup(self) -> None:
        """What SGLang 0.5.18's HiRadixCache needs to run on CPU (from bench/sglang_baselines.py)."""
        import sglang.srt.mem_cache.hiradix_cache as hrc
        import sglang.srt.mem_cache.pool_host.mha as phm
        import torch.distributed as dist

        patch_host_pools_for_cpu((phm,))
        # SGLang reads the host/device ratio from the server's published runtime config.
        hrc.get_memory = lambda: types.SimpleNamespace(hicache_ratio=HICACHE_RATIO)
        if not dist.is_initialized():  # HiRadixCache asks the (default) TP group its size
            fd, path = tempfile.mkstemp(prefix="sglang_api_pg_")
            os.close(fd)
            os.unlink(path)
            dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)

    def prepare(self, w: Workload) -> None:
        # Requests once: cache_finished_req reads their rows and leaves them as they are.
        w.reqs = [w.new_req(i) for i in range(len(w.lens))]

    def build(self, impl: str, w: Workload) -> tuple[Any, FreeCounter]:
        """A cache built through SGLang's ``create_tree_cache``, as the scheduler builds it."""
        return build_cache(impl, w.page_size, w.pool_size, w.req_to_token)

    def close(self, impl: str, cache: Any) -> None:
        if impl == "hiradix":
            cache.core.close()  # stops its copy threads
        else:
            cache.release_host_resources()

    def in_flight(self, impl: str, cache: Any) -> int:
        """Backups not yet acknowledged."""
        return len(cache.core.ongoing_write_through) if impl == "hiradix" else len(cache.ongoing_write_through)

    def insert_inputs(self, cache: Any, w: Workload) -> Any:
        return None

    def insert_phase(self, cache: Any, w: Workload, inputs: Any, step: int) -> None:
        insert, events = cache.insert, cache.check_hicache_events
        for i, (k, v) in enumerate(zip(w.keys, w.values, strict=True), 1):
            insert(InsertParams(key=RadixKey(k), value=v))
            if i % step == 0:
                events()
        events()

    def after_insert(self, impl: str, cache: Any, w: Workload, inputs: Any, freed: FreeCounter) -> None:
        if freed.tokens:
            raise AssertionError(f"{impl}: insert freed {freed.tokens} slots (0.5.18's insert frees none)")

    def check_cached(self, impl: str, cache: Any, w: Workload, freed: FreeCounter, cached: int) -> None:
        if freed.tokens:
            raise AssertionError(f"{impl}: {freed.tokens} slots freed before evict-all")

    def finish_inputs(self, cache: Any, w: Workload) -> Any:
        return w.reqs

    def finish_phase(self, cache: Any, w: Workload, reqs: Any, step: int) -> None:
        finish, events = cache.cache_finished_req, cache.check_hicache_events
        for i, (req, n) in enumerate(zip(reqs, w.lens, strict=True), 1):
            finish(req, kv_len_to_handle=n)
            if i % step == 0:
                events()
        events()

    def after_finish(self, impl: str, cache: Any, reqs: Any) -> None:
        pass

    def match_phase(self, cache: Any, keys: list[array]) -> None:
        match = cache.match_prefix
        for k in keys:
            idx = match(MatchPrefixParams(key=RadixKey(k))).device_indices  # what the scheduler reads
        del idx

    def signature(self, cache: Any, keys: list[array]) -> list[tuple[int, int]]:
        """(matched length, hash of the matched device indices) per key."""
        out = []
        for k in keys:
            idx = cache.match_prefix(MatchPrefixParams(key=RadixKey(k))).device_indices
            out.append((len(idx), hash(idx.numpy().tobytes())))
        return out

    def loads_back(self, impl: str) -> bool:
        """Whether the load-back phase runs for ``impl`` (hiradix's alone so far)."""
        return impl == "hiradix"

    def load_back_phase(self, cache: Any, keys: list[array], step: int) -> tuple[int, int, float]:
        """Every key as the scheduler admits a request whose prefix is on the host: match,
        ``init_load_back`` of the host hit, and per step the loads submitted
        (``ready_to_load_host_cache``) and those landed acknowledged
        (``check_hicache_events``). Returns the tokens loaded, the ``init_load_back``
        calls and the calling thread's CPU time in them alone."""
        match, init = cache.match_prefix, cache.init_load_back
        ready, events = cache.ready_to_load_host_cache, cache.check_hicache_events
        clock = time.thread_time
        loaded = calls = 0
        in_init = 0.0
        for i, k in enumerate(keys, 1):
            m = match(MatchPrefixParams(key=RadixKey(k)))
            if m.host_hit_length:
                params = InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
                t = clock()
                got, _node = init(params)
                in_init += clock() - t
                calls += 1
                loaded += len(got)
            if i % step == 0:
                ready()
                events()
        ready()
        events()
        return loaded, calls, in_init


CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


def patch_sglang_for_cpu() -> None:
    """What SGLang 0.5.18's HiRadixCache needs to run on CPU (:meth:`Api18.setup`), for the
    scripts that build caches with :func:`build_cache`: ``bench/long_context.py`` and
    ``bench/memory.py``."""
    Api18().setup()


class Api23(Api18):
    """SGLang 0.5.23: its hierarchical ``UnifiedRadixCache`` on the Python and the Rust tree
    core; ``checkpoint_kv_cache`` / ``release_kv_cache`` on requests, and a match that
    returns the device prefix's length."""

    version = "0.5.23"
    impls = ("hiradix", "python", "rust")
    labels: ClassVar[dict[str, str]] = {
        "hiradix": "hiradix.sglang.HiRadixCache",
        "python": "sglang 0.5.23 UnifiedRadixCache, Python core",
        "rust": "sglang 0.5.23 UnifiedRadixCache, Rust core",
    }
    cores: ClassVar[dict[str, str]] = {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}

    def __init__(self) -> None:
        self._published: Any = None  # the live cache's published server flags

    def setup(self) -> None:
        import sglang.srt.mem_cache.pool_host.mha as phm
        from sglang.srt.runtime_context import get_parallel

        patch_host_pools_for_cpu((phm,))
        # the controller names ranks from the parallel config a launched server records
        get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
        ).__enter__()

    def prepare(self, w: Workload) -> None:
        pass  # fresh requests per phase (requests()): 0.5.23's calls change them

    def loads_back(self, impl: str) -> bool:
        return False  # not written for 0.5.23's request API yet

    def requests(self, w: Workload, *, finished: bool) -> list[Any]:
        """Every sequence as a running request (``finished``: a finished one) whose row
        holds its slots, all computed (``kv_committed_len``, ``extend_end``)."""
        reqs = []
        for i, n in enumerate(w.lens):
            req = w.new_req(i)
            req.refresh_fill_ids()  # the scheduler's init_next_round_input
            req.kv.kv_allocated_len = req.kv.kv_committed_len = n
            req.extend_end = n
            if finished:
                req.finished_reason = FINISH_LENGTH(length=0)
            reqs.append(req)
        return reqs

    def build(self, impl: str, w: Workload) -> tuple[Any, FreeCounter]:
        """A cache built through SGLang's ``create_tree_cache`` with the server's flags
        published, as the scheduler builds it; SGLang's on the core ``impl`` names."""
        from sglang.srt.runtime_context import get_context

        if self._published is not None:
            raise RuntimeError("one cache at a time: close the last one first")
        alloc, freed = cpu_pools(w.page_size, w.pool_size)
        flags: dict[str, Any] = dict(
            device="cpu",
            enable_hierarchical_cache=True,
            page_size=w.page_size,
            hicache_mem_layout="layer_first",
            hicache_io_backend="direct",
            hicache_write_policy="write_through",
            hicache_ratio=HICACHE_RATIO,
        )
        if impl == "hiradix":
            flags.update(
                radix_cache_backend=hs.BACKEND_NAME, hicache_storage_backend_extra_config=hiradix_extra_config()
            )
        else:
            os.environ[CORE_ENV] = impl  # read when the cache builds its tree core
        self._published = get_context().override_server_args(**flags)
        server_args = self._published.install()
        params = CacheInitParams(
            disable=False, req_to_token_pool=w.req_to_token, token_to_kv_pool_allocator=alloc, page_size=w.page_size
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.cpu.Event does not support timing"
            cache = create_tree_cache(build_context(server_args, params))
        if impl == "hiradix":
            if type(cache) is not hs.HiRadixCache:
                raise RuntimeError(f"hiradix: create_tree_cache built {type(cache).__name__}")
        else:
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            core = type(getattr(cache, "tree_core", None)).__name__
            if type(cache) is not UnifiedRadixCache or core != self.cores[impl] or cache.cache_controller is None:
                raise RuntimeError(
                    f"{impl}: create_tree_cache built {type(cache).__name__} on {core}, expected a "
                    f"hierarchical UnifiedRadixCache on {self.cores[impl]}"
                )
        atexit.unregister(cache.shutdown)
        return cache, freed

    def close(self, impl: str, cache: Any) -> None:
        cache.shutdown()
        cache.release_host_resources()
        if impl == "hiradix":
            cache.core.close()  # stops its copy threads
        self._published.restore()
        self._published = None

    def in_flight(self, impl: str, cache: Any) -> int:
        return len(cache.ongoing_write_through)

    def insert_inputs(self, cache: Any, w: Workload) -> list[Any]:
        return self.requests(w, finished=False)

    def insert_phase(self, cache: Any, w: Workload, reqs: Any, step: int) -> None:
        checkpoint, flush, events = checkpoint_kv_cache, cache.flush_pending_backups, cache.check_hicache_events
        for i, req in enumerate(reqs, 1):
            checkpoint(req, cache)
            if i % step == 0:
                flush()
                events()
        flush()
        events()

    def after_insert(self, impl: str, cache: Any, w: Workload, reqs: Any, freed: FreeCounter) -> None:
        """The checkpoint's effects on a sample (the row holds the tree's slots, the protected
        length is the aligned length, the lock is on the match node); then every request
        released as an abort after a chunk (its tail freed, its lock and row given back)."""
        rows = w.req_to_token.req_to_token
        for i in w.sample:
            req, n = reqs[i], w.aligned[i]
            if req.kv.cache_protected_len != n or req.lock is None or req.lock.node != req.last_node:
                raise AssertionError(
                    f"{impl}: request {i} protects {req.kv.cache_protected_len} of {n} tokens "
                    f"after its checkpoint, lock {req.lock}"
                )
            path = cache.path_device_indices(req.last_node).long()
            if not torch.equal(rows[req.kv.req_pool_idx, :n].long(), path):
                raise AssertionError(f"{impl}: request {i}'s row does not hold the tree's slots after its checkpoint")
        for req in reqs:
            release_kv_cache(req, cache, checkpoint=False)

    def check_cached(self, impl: str, cache: Any, w: Workload, freed: FreeCounter, cached: int) -> None:
        # checkpoint freed the duplicates, the release the unaligned tails
        if freed.tokens + cached != sum(w.lens):
            raise AssertionError(f"{impl}: requests held {sum(w.lens)} slots; {freed.tokens} freed + {cached} cached")

    def finish_inputs(self, cache: Any, w: Workload) -> list[Any]:
        return self.requests(w, finished=True)

    def finish_phase(self, cache: Any, w: Workload, reqs: Any, step: int) -> None:
        release, flush, events = release_kv_cache, cache.flush_pending_backups, cache.check_hicache_events
        for i, req in enumerate(reqs, 1):
            release(req, cache, checkpoint=True)
            if i % step == 0:
                flush()
                events()
        flush()
        events()

    def after_finish(self, impl: str, cache: Any, reqs: Any) -> None:
        held = sum(1 for req in reqs if req.kv.holds_kv or req.lock is not None)
        if held:
            raise AssertionError(f"{impl}: {held} requests still hold a row or a lock after release_kv_cache")

    def match_phase(self, cache: Any, keys: list[array]) -> None:
        match = cache.match_prefix
        for k in keys:
            n = match(MatchPrefixParams(key=RadixKey(k))).device_prefix_len  # what the scheduler reads
        del n

    def signature(self, cache: Any, keys: list[array]) -> list[tuple[int, int]]:
        """(matched length, hash of the match node's path of device indices) per key."""
        out = []
        for k in keys:
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(k)))
            idx = cache.path_device_indices(m.last_device_node).to(torch.int64)
            if len(idx) != m.device_prefix_len:
                raise AssertionError(f"path of {len(idx)} slots for a {m.device_prefix_len}-token match")
            out.append((m.device_prefix_len, hash(idx.numpy().tobytes())))
        return out


if REQUEST_API == "checkpoint":
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache


def _api() -> Api18:
    if REQUEST_API == "cache_req_kv":
        raise SystemExit("bench/sglang_api.py runs on SGLang 0.5.18 (.venv) or 0.5.23 (.venv-sglang23), not 0.5.20")
    return Api23() if REQUEST_API == "checkpoint" else Api18()


API = _api()


def drain_loads(impl: str, cache: Any, timeout_s: float = 120.0) -> None:
    """Acknowledge every load back (hiradix), as :func:`drain_backups` the backups."""
    deadline = time.monotonic() + timeout_s
    while cache.core.ongoing_load_back:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{impl}: {len(cache.core.ongoing_load_back)} loads still in flight after {timeout_s} s")
        cache.check_hicache_events()
        time.sleep(0.001)  # a benchmark, not a test: let the copy thread run


def drain_backups(impl: str, cache: Any, timeout_s: float = 120.0) -> None:
    """Acknowledge every backup, as the scheduler's later steps would: ``check_hicache_events``
    until none is in flight (bounded)."""
    deadline = time.monotonic() + timeout_s
    while API.in_flight(impl, cache):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{impl}: {API.in_flight(impl, cache)} backups still in flight after {timeout_s} s")
        cache.check_hicache_events()
        time.sleep(0.001)  # a benchmark, not a test: let the copy thread run
    if cache.protected_size() != 0:
        raise AssertionError(f"{impl}: {cache.protected_size()} tokens still protected after the acks")


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

    def rates(self, out: dict, name: str, n: int) -> None:
        """``name`` per second of the last phase's wall, process-CPU and thread-CPU time."""
        out[f"{name}_per_s"] = n / self.last
        out[f"{name}_per_cpu_s"] = n / self.last_cpu
        out[f"{name}_per_thread_s"] = n / self.last_thread


def one_repeat(
    impl: str,
    w: Workload,
    profiles: dict[str, cProfile.Profile] | None = None,
    step: int = 1,
    phases: frozenset[str] = PHASES,
) -> dict:
    out: dict[str, Any] = dict.fromkeys(
        m for group in (METRICS, CPU_METRICS, THREAD_METRICS, LOAD_METRICS) for m, _ in group
    )
    for m in out:  # a phase not run (--phases) reports NaN
        out[m] = float("nan")
    clock = Clock(profiles)
    api = API

    # insert/s, then match/s and evict-all on the same cache
    cache, freed = api.build(impl, w)
    inputs = api.insert_inputs(cache, w)
    with clock.phase("insert"):
        api.insert_phase(cache, w, inputs, step)
    clock.rates(out, "insert", len(w.keys))
    api.after_insert(impl, cache, w, inputs, freed)
    del inputs
    with clock.phase("match"):
        api.match_phase(cache, w.keys)
    clock.rates(out, "match", len(w.keys))
    sig = api.signature(cache, [w.keys[i] for i in w.sample])
    for i, (n, _) in zip(w.sample, sig, strict=True):
        if n != w.aligned[i]:
            raise AssertionError(f"{impl}: key {i} matched {n} of {w.aligned[i]} tokens")
    out["signature"] = sig + api.signature(cache, w.partial)
    drain_backups(impl, cache)
    cached = out["cached_tokens"] = cache.evictable_size()
    api.check_cached(impl, cache, w, freed, cached)
    before = freed.tokens
    if "evict_all" not in phases and "finish" not in phases:  # --phases insert,match
        api.close(impl, cache)
        out["cpu_share"] = clock.cpu / clock.wall
        return out
    with clock.phase("evict_all"):
        evicted = cache.evict(EvictParams(num_tokens=cached)).num_tokens_evicted
    out["evict_all_s"] = clock.last
    out["evict_all_cpu_s"] = clock.last_cpu
    out["evict_all_thread_s"] = clock.last_thread
    if evicted != cached or cache.evictable_size() != 0 or freed.tokens - before != cached:
        raise AssertionError(
            f"{impl}: evict-all evicted {evicted} of {cached}, {cache.evictable_size()} left "
            f"evictable, {freed.tokens - before} slots handed back"
        )
    if "load_back" in phases and api.loads_back(impl):
        # load/s: every key matched again, its host hit loaded back to the device
        with clock.phase("load_back"):
            loaded, calls, in_init = api.load_back_phase(cache, w.keys, step)
        clock.rates(out, "load_back", len(w.keys))
        out["init_load_back_per_thread_s"] = calls / in_init if in_init else float("nan")
        drain_loads(impl, cache)
        if not 0 < loaded <= cached or cache.evictable_size() != loaded or cache.protected_size():
            raise AssertionError(
                f"{impl}: loaded {loaded} of {cached} tokens back; {cache.evictable_size()} evictable, "
                f"{cache.protected_size()} protected after the acks"
            )
        cache.core.tree.check_invariants()
    api.close(impl, cache)
    del cache
    gc.collect()
    if "finish" not in phases:
        out["cpu_share"] = clock.cpu / clock.wall
        return out

    # finish/s: the same requests ended, on a fresh cache
    cache, freed = api.build(impl, w)
    reqs = api.finish_inputs(cache, w)
    with clock.phase("finish"):
        api.finish_phase(cache, w, reqs, step)
    clock.rates(out, "finish", len(w.lens))
    api.after_finish(impl, cache, reqs)
    del reqs
    drain_backups(impl, cache)
    if cache.evictable_size() != cached:
        raise AssertionError(f"{impl}: the finishes cached {cache.evictable_size()} tokens, the inserts {cached}")
    if freed.tokens + cached != sum(w.lens):
        raise AssertionError(f"{impl}: requests held {sum(w.lens)} slots; {freed.tokens} freed + {cached} cached")
    if impl == "hiradix":
        cache.core.tree.check_invariants()
    api.close(impl, cache)
    del cache
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
        "sglang": importlib.metadata.version("sglang"),
        "load": os.getloadavg(),
        "hiradix": hiradix_source(),
    }


def check_agree(impls: list[str], results: dict[str, dict], tag: str) -> None:
    """Every cache of one repeat cached the same tokens and matched the samples to the same
    lengths and device indices as the first."""
    a = results[impls[0]]
    for impl in impls[1:]:
        b = results[impl]
        if a["cached_tokens"] != b["cached_tokens"]:
            raise AssertionError(
                f"{tag}: cached tokens differ: {impls[0]} {a['cached_tokens']}, {impl} {b['cached_tokens']}"
            )
        diff = [j for j, (x, y) in enumerate(zip(a["signature"], b["signature"], strict=True)) if x != y]
        if diff:
            j = diff[0]
            raise AssertionError(
                f"{tag}: {len(diff)} sample matches differ between {impls[0]} and {impl}, first #{j}: "
                f"{a['signature'][j]} vs {b['signature'][j]}"
            )


def bench_page(ps: int, seqs: list[np.ndarray], args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    w = Workload(seqs, ps, args.seed)
    API.prepare(w)
    log(
        f"page {ps}: {len(w.keys)} keys, {sum(w.aligned):,} aligned tokens, pool {w.pool_size:,} slots "
        f"(prepared in {time.perf_counter() - t0:.1f} s)"
    )
    impls = [i for i in API.impls if i in args.impls]
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    for r in range(-args.warmup, args.repeats):
        order = impls if r % 2 == 0 else impls[::-1]  # alternate, so drift hits every cache alike
        tag = "warm-up" if r < 0 else f"repeat {r + 1}/{args.repeats}"
        this: dict[str, dict] = {}
        for impl in order:
            res = this[impl] = one_repeat(impl, w, step=args.step, phases=args.phases)
            log(
                f"  {tag} {impl:8s}: "
                + ", ".join(f"{m}={res[m]:.4g}" for m, _ in METRICS)
                + ", thread: "
                + ", ".join(f"{res[m]:.4g}" for m, _ in THREAD_METRICS)
                + f", load_back/s thread={res['load_back_per_thread_s']:.4g}"
                + f", cpu/wall={res['cpu_share']:.2f}"
            )
            if r >= 0:
                runs[impl].append(res)
        # the caches must agree, every repeat: same tokens cached, same matched lengths and device indices
        check_agree(impls, this, tag)
    if len(impls) > 1:
        a = runs[impls[0]][0]
        log(
            f"  check: all {len(impls)} caches cache {a['cached_tokens']:,} tokens; {len(a['signature'])} sample "
            f"matches agree (lengths and device indices), every repeat"
        )
    result: dict = {"keys": len(w.keys), "tokens": sum(w.aligned), "cached_tokens": runs[impls[0]][0]["cached_tokens"]}
    for impl in impls:
        result[impl] = {}
        for m, higher in (*METRICS, *CPU_METRICS, *THREAD_METRICS, *LOAD_METRICS, ("cpu_share", True)):
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


def better(a: float, b: float, higher_is_better: bool) -> bool:
    return a > b if higher_is_better else a < b


def ratio(ours: float, theirs: float, higher_is_better: bool) -> float:
    """hiradix's figure over SGLang's, inverted for a time (lower is better)."""
    return ours / theirs if higher_is_better else theirs / ours


def ratio_rows(ps: int, res: dict, metrics: tuple[tuple[str, bool], ...]) -> list[str]:
    """hiradix over SGLang: with one SGLang cache as today's rows; with several (0.5.23's two
    tree cores), over the faster one in each column, named in the cell."""
    baselines = [i for i in API.impls if i != "hiradix" and i in res]
    if "hiradix" not in res or not baselines:
        return []
    a = res["hiradix"]
    if len(baselines) == 1:
        b = res[baselines[0]]
        ratios = [ratio(a[m]["median"], b[m]["median"], hi) for m, hi in metrics]
        return [
            f"| {ps} | **hiradix / SGLang** | " + " | ".join(f"**{x:.1f}×**" for x in ratios) + " | |",
            f"| {ps} | hiradix / SGLang, paired | "
            + " | ".join(f"{paired_ratio(a[m]['runs'], b[m]['runs'], hi):.1f}×" for m, hi in metrics)
            + " | |",
        ]
    cells, paired = [], []
    for m, hi in metrics:
        best = baselines[0]
        for impl in baselines[1:]:
            if better(res[impl][m]["median"], res[best][m]["median"], hi):
                best = impl
        cells.append(f"**{ratio(a[m]['median'], res[best][m]['median'], hi):.1f}×** ({best})")
        # per repeat, against that repeat's faster core
        per_repeat = [
            max(res[i][m]["runs"][r] for i in baselines) if hi else min(res[i][m]["runs"][r] for i in baselines)
            for r in range(len(a[m]["runs"]))
        ]
        paired.append(f"{paired_ratio(a[m]['runs'], per_repeat, hi):.1f}×")
    return [
        f"| {ps} | **hiradix / faster SGLang core** | " + " | ".join(cells) + " | |",
        f"| {ps} | hiradix / faster core, paired | " + " | ".join(paired) + " | |",
    ]


def report(results: dict, meta: dict) -> str:
    lines = [
        f"Workload: {meta['workload']['count']} sequences, {meta['workload']['total_tokens']:,} tokens "
        f"(scale {meta['scale']}); {meta['step']} request(s) per step; hiradix's backup copies "
        f"{meta.get('backup_copy', 'inline')}; warm-up {meta['warmup']}, "
        f"{meta['repeats']} repeats, medians (best in parentheses).",
    ]
    insert, finish = ("checkpoint", "release") if API.version == "0.5.23" else ("insert", "finish")
    for title, metrics in (
        ("wall time", METRICS),
        ("the calling thread's CPU time", THREAD_METRICS),
        ("process CPU time (all threads)", CPU_METRICS),
    ):
        lines += [
            "",
            f"Over {title}:",
            "",
            f"| page | implementation | {insert}/s | {finish}/s | match/s | evict-all | cpu/wall |",
            "|---|---|---|---|---|---|---|",
        ]
        for ps, res in results.items():
            for impl in API.impls:
                if impl not in res:
                    continue
                r = res[impl]
                lines.append(
                    f"| {ps} | {API.labels[impl]} | "
                    + " | ".join(f"{fmt(m, r[m]['median'])} ({fmt(m, r[m]['best'])})" for m, _ in metrics)
                    + f" | {r['cpu_share']['median']:.2f} |"
                )
            lines += ratio_rows(ps, res, metrics)
    lines += ["", "Load-back (match, init_load_back, the step's loads; hiradix only):", ""]
    lines += [
        "| page | implementation | over wall | over thread CPU | over process CPU | init_load_back/s (thread CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for ps, res in results.items():
        if "hiradix" in res:
            r = res["hiradix"]
            lines.append(
                f"| {ps} | {API.labels['hiradix']} | "
                + " | ".join(
                    f"{fmt(m, r[m]['median'])} ({fmt(m, r[m]['best'])})"
                    for m in (
                        "load_back_per_s",
                        "load_back_per_thread_s",
                        "load_back_per_cpu_s",
                        "init_load_back_per_thread_s",
                    )
                )
                + " |"
            )
    lines += [
        "",
        "*paired*: the median over repeats of that repeat's ratio. The caches run back to "
        "back within a repeat (in alternating order), so a load change between repeats moves "
        "them all; the ratio of medians above pairs figures from different repeats.",
    ]
    return "\n".join(lines)


def paired_ratio(ours: list[float], theirs: list[float], higher_is_better: bool) -> float:
    """The median of per-repeat ratios of hiradix's figure to SGLang's (inverted for a
    time, where lower is better).

    >>> paired_ratio([10.0, 2.0, 9.0], [2.0, 1.0, 3.0], True)
    3.0
    """
    return statistics.median(ratio(a, b, higher_is_better) for a, b in zip(ours, theirs, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the 200 system prompts (default 0.1)")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed full repeats of each cache first (default 1)")
    ap.add_argument(
        "--impls",
        default=",".join(API.impls),
        help=f"caches to run, of {', '.join(API.impls)} (SGLang {API.version}; default all)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        action="append",
        choices=API.impls,
        help="after the repeats, cProfile one more repeat of this cache, per phase (repeatable)",
    )
    ap.add_argument(
        "--step",
        type=int,
        default=1,
        help="requests per scheduler step: the step's bookkeeping (check_hicache_events) after every STEP "
        "inserts/finishes (default 1: after each; SGLang's scheduler runs it once per step, whatever the "
        "batch finished)",
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
    unknown = set(args.impls) - set(API.impls)
    if unknown:
        ap.error(f"--impls: {', '.join(sorted(unknown))} not among SGLang {API.version}'s {', '.join(API.impls)}")
    args.phases = frozenset(args.phases.split(",")) | {"insert", "match"}
    if not args.phases <= PHASES:
        ap.error(f"--phases: unknown {sorted(args.phases - PHASES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    logging.getLogger("sglang").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    API.setup()
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
        "request_api": API.version,
        "workload": describe(seqs),
        "command": "python bench/sglang_api.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    log(
        f"{meta['machine']['cpu']}, load {meta['machine']['load']}; SGLang {meta['machine']['sglang']}; "
        f"hiradix {meta['machine']['hiradix']}; workload {meta['workload']}"
    )
    t0 = time.perf_counter()
    results = {ps: bench_page(ps, seqs, args) for ps in (int(p) for p in args.page_sizes.split(","))}
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    meta["load_after"] = os.getloadavg()
    print(report(results, meta))
    log(f"elapsed {meta['elapsed_s']} s, load after {meta['load_after']}")
    if args.json:
        for res in results.values():
            for impl in API.impls:
                res.get(impl, {}).pop("signature", None)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip tearing down millions of tree objects one by one
