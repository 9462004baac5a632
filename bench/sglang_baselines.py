"""Side-by-side baselines: SGLang's own radix trees on the hiradix workload.

Run with the python of an SGLang virtual environment (see
``bench/setup_sglang.sh`` and ``bench/README_sglang.md``), one impl at a time::

    PYTHONPATH=.bench-venvs/stubs .bench-venvs/sglang-0.5.18/bin/python \\
        bench/sglang_baselines.py --impl radix --page-size 1 --repeats 3 --json out.json

Implementations (``--impl``):

* ``radix``   -- ``sglang.srt.mem_cache.radix_cache.RadixCache`` (0.5.18),
  built with ``RadixCache.create_simulated(mock_allocator=...)``.
* ``hiradix`` -- ``sglang.srt.mem_cache.hiradix_cache.HiRadixCache`` (0.5.18),
  ``write_through`` policy, on CPU: a CPU ``MHATokenToKVPool`` (1 layer, 1 head,
  head_dim 1, bf16), ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``,
  host pool ``layer_first`` with ``io_backend="direct"``, host/device ratio 1.0,
  no L3 storage.  ``cudaHostRegister`` is patched to a no-op and
  ``transfer_kv_direct`` (absent on CPU) to a per-layer ``index_copy_``, so the
  write-through backups really copy KV into the host pool.  A single-process
  gloo group stands in for the TP group.
* ``unified`` -- ``sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache``
  (0.5.23) with ``tree_components=(FULL,)`` and the Rust tree core (the
  ``mem_cache`` PyO3 extension bundled in the sglang wheel, linked only against
  libtorch_cpu/libc10/libtorch_python), on a CPU ``MHATokenToKVPool`` and
  allocator, no HiCache.  ``--tree-core python`` selects SGLang's pure-Python
  ``UnifiedTreeCore`` instead, for reference.

Workload: ``bench/workload.py`` (imported from this file's directory), the
same list of 20,000 sequences (~26.4M tokens) the hiradix benchmark uses;
``--scale`` takes that fraction of the 200 prompts (each keeps its 100
continuations).  Keys are ``array('q')`` token lists (what SGLang's scheduler
passes) wrapped in ``RadixKey``.  SGLang requires page-aligned keys, so for
``--page-size 16`` every key is truncated to a multiple of 16 before insert and
match (the hiradix benchmark does the same); ``tokens`` in the output counts the
truncated keys.  Values are unique device indices: consecutive slices of one
``torch.arange`` (starting at ``page_size``, since slot 0 is SGLang's padding
slot), prepared before timing.

Per repeat (fresh tree objects each time; setup, key/value preparation and
tree rebuilding are not timed):

* ``insert_per_s``: ``insert(InsertParams(key, value))`` for every sequence in
  workload order.  For ``hiradix`` each insert is followed by
  ``check_hicache_events()``, which the scheduler runs once per event-loop
  iteration: the write-through backup (host alloc + D->H copy) is issued inside
  ``insert`` itself, and ``check_hicache_events`` -> ``writing_check`` acks it
  and releases the backup lock.  For ``unified`` the insert also frees
  (hands back to the allocator) the value slots that duplicate an
  already-cached prefix, as that class does; 0.5.18 leaves that to its caller.
* ``match_per_s``: the matched device indices of every sequence after all
  inserts (all full hits).  ``radix``/``hiradix``: ``match_prefix`` (it returns
  ``device_indices``).  ``unified``: ``match_prefix`` (it returns only lengths
  and node ids in 0.5.23) followed by ``path_device_indices(last_device_node)``
  -- what the scheduler's ``prefix_device_indices`` does.  For ``unified`` the
  ``match_prefix`` call alone is also reported as ``match_prefix_only_per_s``.
* ``evict_all_s``: one ``evict(EvictParams(num_tokens=evictable_size()))``.
  For ``hiradix`` every node is backed up first (the acks are drained and the
  benchmark checks nothing is locked), so eviction demotes everything to host.
* ``evict_chunks_s``: on a freshly rebuilt tree (untimed rebuild), 1000 calls
  of ``evict(total_evictable // 1000)`` plus one call for any remainder still
  evictable.
* ``match_128k_us``: on a fresh tree holding a single 131,072-token key, the
  median latency of matching that key (same calls as ``match_per_s``), over
  ``--long-iters`` iterations.

Allocator frees: so that all three trees are charged the same, tensors handed
to the device allocator's ``free``/``free_segment`` are appended to a list
(O(1)) instead of being merged into the allocator's free list (SGLang's own
``TokenToKVPoolAllocator.free`` concatenates onto the free list per call, which
is quadratic when evicting millions of tokens outside a ``free_group``).
``radix`` gets the same through its mock allocator.  The host pool of
``hiradix`` is SGLang's own.  ``--alloc-frees free-group`` instead times the
evict phases of ``hiradix``/``unified`` with SGLang's allocator frees: the free
list is emptied first (a full pool, which is when a server evicts) and every
evict call is wrapped in ``free_group_begin()``/``free_group_end()`` (each freed
tensor is cloned into the group, then concatenated into the free list once per
call), after which the returned slots are taken off the free list again (O(1)),
as the allocation that triggered the eviction would; the benchmark checks that
the allocator gets every slot back.

Garbage collection stays enabled while timing, but before each timed phase the
benchmark runs ``gc.collect(); gc.freeze()`` so that collections scan only
objects created during that phase, not the prepared inputs (``--gc on`` skips
the freeze, ``--gc off`` disables the collector while timing).

torch runs with one intra-op thread (``--torch-threads 1``): on the 2-core
benchmark machines, copies of 32K+ elements that torch splits over two OpenMP
threads intermittently stall for ~8 ms waiting for the second thread (seen
with the 1 MiB ``torch.cat`` of the 128K-key match), which would measure the
VM rather than the tree.  The trees themselves are single-threaded.

Output: a table on stdout and, with ``--json``, min/median/max/values of every
figure over the repeats plus the sglang version, impl, page size, token counts
and the machine.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from array import array
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workload import describe, make_long_key, make_workload  # noqa: E402

IMPLS = {
    "radix": "SGLang RadixCache (Python)",
    "hiradix": "SGLang HiRadixCache (Python, write_through, CPU host pool)",
    "unified": "SGLang UnifiedRadixCache (FULL component)",
}
EXPECTED_VERSION = {"radix": "0.5.18", "hiradix": "0.5.18", "unified": "0.5.23"}
N_CHUNKS = 1000

# Filled by _import_sglang().
torch = None
RadixKey = InsertParams = MatchPrefixParams = EvictParams = None


def _import_sglang():
    global torch, RadixKey, InsertParams, MatchPrefixParams, EvictParams
    import warnings

    # sglang warns at import about CUDA-only quantization kernels on CPU.
    warnings.filterwarnings("ignore", category=UserWarning)
    import sglang.srt.mem_cache.base_prefix_cache as bpc
    import sglang.srt.mem_cache.radix_cache as rc
    import torch as _torch

    torch = _torch
    RadixKey = rc.RadixKey
    InsertParams, MatchPrefixParams, EvictParams = bpc.InsertParams, bpc.MatchPrefixParams, bpc.EvictParams


class FreeSink:
    """Collects tensors handed back to the allocator (O(1) per call)."""

    def __init__(self):
        self.freed = []

    def free(self, indices, *args, **kwargs):
        self.freed.append(indices)

    def free_segment(self, indices, *, start_pos=0):
        self.freed.append(indices)

    def free_segments(self, segments):
        for indices, _ in segments:
            self.freed.append(indices)

    def install(self, allocator):
        allocator.free = self.free
        allocator.free_segment = self.free_segment
        allocator.free_segments = self.free_segments
        return allocator

    @staticmethod
    def uninstall(allocator):
        for name in ("free", "free_segment", "free_segments"):
            allocator.__dict__.pop(name, None)


class MockAllocator(FreeSink):
    """Mock allocator for RadixCache.create_simulated: only frees are called."""

    device = "cpu"


# --------------------------------------------------------------------------
# Adapters: build a tree; insert / match / evict with the calls SGLang uses.
# --------------------------------------------------------------------------


class RadixAdapter:
    name = "radix"

    def __init__(self, page_size, args):
        self.page_size = page_size

    def build(self, capacity):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.sink = MockAllocator()
        self.tree = RadixCache.create_simulated(mock_allocator=self.sink, page_size=self.page_size)
        return self

    def insert(self, key, value):
        self.tree.insert(InsertParams(key=RadixKey(key), value=value))

    def match(self, key):
        return self.tree.match_prefix(MatchPrefixParams(key=RadixKey(key))).device_indices

    def match_prefix_only(self, key):
        return None

    def evictable_size(self):
        return self.tree.evictable_size()

    def prepare_evict(self):
        pass

    def allocator_frees(self):
        """Switch to the real allocator's frees (``--alloc-frees free-group``)."""
        return False  # RadixCache.create_simulated has only the mock allocator

    def evict(self, n):
        return self.tree.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def evict_grouped(self, n):
        """One evict call; with real allocator frees, inside one free group.

        With real frees the slots that came back are then taken off the free
        list again (an O(1) slice), as the allocation that made the server
        evict would: otherwise every later call would concatenate onto an
        ever longer free list, which is quadratic in the allocator, not the
        tree.  ``self.returned`` counts the slots the allocator got back.
        """
        alloc = getattr(self, "real_alloc", None)
        if alloc is None:
            return self.evict(n)
        alloc.free_group_begin()
        evicted = self.evict(n)
        alloc.free_group_end()
        self.returned += alloc.available_size()
        _empty_free_list(alloc)
        return evicted

    def close(self):
        self.tree = None
        self.sink = None
        self.real_alloc = None


def _kv_pool_and_allocator(capacity, page_size):
    """Tiny CPU KV pool (1 layer, 1 head, head_dim 1) and a real allocator."""
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    size = (capacity // page_size + 2) * page_size
    kv = MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=1,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=size,
            page_size=page_size,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv,
            need_sort=False,
        )
    # Give the KV some content so the write-through copies move real data.
    rows = kv.k_buffer[0].shape[0]
    kv.k_buffer[0].copy_((torch.arange(rows) % 1024).to(torch.bfloat16).view(-1, 1, 1))
    kv.v_buffer[0].copy_(kv.k_buffer[0])
    return kv, alloc


_HIRADIX_PATCHED = False


def _patch_hiradix_for_cpu():
    """Make SGLang 0.5.18's HiCache host pool and D->H copy work on CPU."""
    global _HIRADIX_PATCHED
    if _HIRADIX_PATCHED:
        return
    import sglang.srt.mem_cache.hiradix_cache as hrc
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.srt.mem_cache.pool_host.mha as phm
    import torch.distributed as dist

    # No CUDA: pinning the host buffer is a no-op.
    phc._cuda_host_register = lambda buffer: None
    phc._cuda_host_unregister = lambda buffer: None

    # sgl_kernel's transfer_kv_direct is only imported on CUDA/HIP; this is the
    # same per-layer gather/scatter with torch on CPU.
    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    phm.transfer_kv_direct = transfer_kv_direct
    # HiRadixCache reads the host/device size ratio from the published runtime
    # config; the benchmark has no server, so give it a fixed ratio of 1.0.
    hrc.get_memory = lambda: types.SimpleNamespace(hicache_ratio=1.0)

    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="sglang_bench_pg_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    _HIRADIX_PATCHED = True


class HiRadixAdapter(RadixAdapter):
    name = "hiradix"

    def __init__(self, page_size, args):
        super().__init__(page_size, args)
        _patch_hiradix_for_cpu()

    def build(self, capacity):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

        self.kv, alloc = _kv_pool_and_allocator(capacity, self.page_size)
        self.sink = FreeSink().install(alloc)
        server_args = types.SimpleNamespace(
            hicache_size=0,
            hicache_mem_layout="layer_first",
            hicache_storage_backend=None,
            hicache_storage_backend_extra_config=None,
            hicache_storage_prefetch_policy="best_effort",
            hicache_write_policy="write_through",
            hicache_io_backend="direct",
            served_model_name="bench",
            extra_metric_labels=None,
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=self.page_size,
        )
        self.tree = HiRadixCache(params, server_args)
        # HiRadixCache registers its shutdown with atexit, which would keep
        # every tree (and its host pool) alive until exit.
        atexit.unregister(self.tree.shutdown)
        return self

    def insert(self, key, value):
        self.tree.insert(InsertParams(key=RadixKey(key), value=value))
        self.tree.check_hicache_events()

    def prepare_evict(self):
        # Everything is backed up (write_through) once the acks are drained.
        while self.tree.ongoing_write_through:
            self.tree.writing_check()
        assert self.tree.protected_size() == 0, self.tree.protected_size()
        stack = list(self.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.backuped and node.lock_ref == 0, "node not backed up"
            stack.extend(node.children.values())

    def close(self):
        if self.tree is not None:
            self.tree.release_host_resources()
        self.tree = None
        self.sink = None
        self.kv = None
        self.real_alloc = None


class UnifiedAdapter(RadixAdapter):
    name = "unified"

    def __init__(self, page_size, args):
        super().__init__(page_size, args)
        self.core = args.tree_core

    def build(self, capacity):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.kv, alloc = _kv_pool_and_allocator(capacity, self.page_size)
        self.sink = FreeSink().install(alloc)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=self.page_size,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=self.core,
        )
        self.tree = UnifiedRadixCache(params)
        core = type(self.tree.tree_core).__name__
        want = "RustUnifiedTreeCore" if self.core == "rust" else "UnifiedTreeCore"
        if core != want:
            raise RuntimeError(f"asked for the {self.core} tree core, got {core}")
        self.core_class = core
        return self

    def match(self, key):
        r = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(key)))
        return self.tree.path_device_indices(r.last_device_node)[: r.device_prefix_len]

    def match_prefix_only(self, key):
        return self.tree.match_prefix(MatchPrefixParams(key=RadixKey(key)))

    def close(self):
        self.tree = None
        self.sink = None
        self.real_alloc = None
        self.kv = None


def _use_allocator_frees(adapter):
    """Restore the allocator's own free path, with an empty free list.

    The empty free list stands for a full pool, which is when a server evicts;
    each timed evict call is then wrapped in ``free_group_begin/_end`` (see
    ``evict_grouped``), so the freed indices are cloned into the group and
    concatenated into the free list once per call.
    """
    alloc = adapter.tree.token_to_kv_pool_allocator
    FreeSink.uninstall(alloc)
    _empty_free_list(alloc)
    adapter.real_alloc = alloc
    adapter.returned = 0
    return True


def _empty_free_list(alloc):
    for name in ("free_pages", "release_pages"):
        pages = getattr(alloc, name, None)
        if isinstance(pages, torch.Tensor):
            setattr(alloc, name, pages[:0])


HiRadixAdapter.allocator_frees = _use_allocator_frees
UnifiedAdapter.allocator_frees = _use_allocator_frees

ADAPTERS = {"radix": RadixAdapter, "hiradix": HiRadixAdapter, "unified": UnifiedAdapter}


# --------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------


class PhaseClock:
    """Sums wall and process-CPU time over the timed phases of one repeat.

    cpu/wall well below 1.0 means the benchmark was descheduled (another
    process competed for the 2 cores), i.e. the figures are contaminated.
    """

    def __init__(self):
        self.wall = 0.0
        self.cpu = 0.0

    def start(self):
        self._w = time.perf_counter()
        self._c = time.process_time()

    def stop(self):
        w = time.perf_counter() - self._w
        self.wall += w
        self.cpu += time.process_time() - self._c
        return w

    def share(self):
        return self.cpu / self.wall if self.wall > 0 else float("nan")


class GcMode:
    def __init__(self, mode):
        self.mode = mode

    def before_phase(self):
        if self.mode == "freeze":
            gc.collect()
            gc.freeze()
        elif self.mode == "off":
            gc.collect()
            gc.disable()

    def after_phase(self):
        if self.mode == "off":
            gc.enable()

    def release(self):
        if self.mode == "freeze":
            gc.unfreeze()
        gc.collect()


def prepare_inputs(seqs, page_size):
    keys, lens = [], []
    for s in seqs:
        n = len(s) // page_size * page_size
        keys.append(array("q", s[:n].astype(np.int64).tobytes()))
        lens.append(n)
    total = int(sum(lens))
    base = torch.arange(page_size, total + page_size, dtype=torch.int64)
    values, off = [], 0
    for n in lens:
        values.append(base[off : off + n])
        off += n
    return keys, values, total


def build_and_fill(adapter, keys, values, capacity):
    adapter.build(capacity)
    for k, v in zip(keys, values, strict=True):
        adapter.insert(k, v)
    return adapter


def one_repeat(adapter, keys, values, total, long_key, long_value, args, gcm):
    out = {}
    clock = PhaseClock()
    # insert
    adapter.build(total)
    gcm.before_phase()
    clock.start()
    for k, v in zip(keys, values, strict=True):
        adapter.insert(k, v)
    dt = clock.stop()
    gcm.after_phase()
    out["insert_per_s"] = len(keys) / dt
    tree_tokens = adapter.evictable_size()
    out["tree_tokens"] = tree_tokens

    # match (all full hits)
    gcm.before_phase()
    clock.start()
    for k in keys:
        adapter.match(k)
    dt = clock.stop()
    gcm.after_phase()
    out["match_per_s"] = len(keys) / dt
    if adapter.name == "unified":
        gcm.before_phase()
        clock.start()
        for k in keys:
            adapter.match_prefix_only(k)
        dt = clock.stop()
        gcm.after_phase()
        out["match_prefix_only_per_s"] = len(keys) / dt
    # spot-check full hits (untimed)
    step = max(1, len(keys) // 50)
    for k in keys[::step]:
        got = len(adapter.match(k))
        assert got == len(k), f"expected a full hit ({len(k)}), got {got}"

    # evict everything in one call
    adapter.prepare_evict()
    if args.alloc_frees == "free-group":
        adapter.allocator_frees()
    n = adapter.evictable_size()
    gcm.before_phase()
    clock.start()
    evicted = adapter.evict_grouped(n)
    dt = clock.stop()
    gcm.after_phase()
    assert evicted >= n and adapter.evictable_size() == 0, (evicted, n)
    if getattr(adapter, "real_alloc", None) is not None:
        assert adapter.returned == n, f"allocator got {adapter.returned} slots back, expected {n}"
    out["evict_all_s"] = dt
    adapter.close()
    gcm.release()

    # evict in 1000 chunks on a freshly rebuilt tree
    build_and_fill(adapter, keys, values, total)
    adapter.prepare_evict()
    if args.alloc_frees == "free-group":
        adapter.allocator_frees()
    n = adapter.evictable_size()
    chunk = n // N_CHUNKS
    gcm.before_phase()
    clock.start()
    evicted = 0
    for _ in range(N_CHUNKS):
        evicted += adapter.evict_grouped(chunk)
    rest = adapter.evictable_size()
    if rest > 0:
        evicted += adapter.evict_grouped(rest)
    dt = clock.stop()
    gcm.after_phase()
    assert adapter.evictable_size() == 0 and evicted >= n, (evicted, n)
    if getattr(adapter, "real_alloc", None) is not None:
        assert adapter.returned == n, f"allocator got {adapter.returned} slots back, expected {n}"
    out["evict_chunks_s"] = dt
    adapter.close()
    gcm.release()

    # 128K-token key: median match latency
    adapter.build(len(long_key))
    adapter.insert(long_key, long_value)
    for _ in range(10):
        adapter.match(long_key)
    assert len(adapter.match(long_key)) == len(long_key)
    lat = []
    gcm.before_phase()
    clock.start()
    for _ in range(args.long_iters):
        t0 = time.perf_counter()
        adapter.match(long_key)
        lat.append(time.perf_counter() - t0)
    clock.stop()
    gcm.after_phase()
    out["match_128k_us"] = statistics.median(lat) * 1e6
    if adapter.name == "unified":
        lat = []
        gcm.before_phase()
        clock.start()
        for _ in range(args.long_iters):
            t0 = time.perf_counter()
            adapter.match_prefix_only(long_key)
            lat.append(time.perf_counter() - t0)
        clock.stop()
        gcm.after_phase()
        out["match_prefix_only_128k_us"] = statistics.median(lat) * 1e6
    adapter.close()
    gcm.release()
    out["cpu_share"] = clock.share()
    return out


def machine_info():
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count()
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = round(int(line.split()[1]) / 1024**2, 1)
                    break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu,
        "nproc": nproc,
        "mem_gib": mem,
        "python": platform.python_version(),
    }


def summarize(values):
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "values": values,
    }


METRICS = [
    # key, label, unit, higher_is_better
    ("insert_per_s", "insert/s", "", True),
    ("match_per_s", "match/s", "", True),
    ("match_prefix_only_per_s", "match_prefix only/s", "", True),
    ("evict_all_s", "evict all", "s", False),
    ("evict_chunks_s", "evict 1000 chunks", "s", False),
    ("match_128k_us", "match 128K", "us", False),
    ("match_prefix_only_128k_us", "match_prefix only 128K", "us", False),
    ("cpu_share", "cpu/wall (timed)", "x", True),
]


def fmt(v, unit):
    if unit == "":
        return f"{v / 1000:.1f}k"
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "x":
        return f"{v:.2f}"
    return f"{v:.0f} us"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=sorted(IMPLS), required=True)
    p.add_argument("--page-size", type=int, choices=(1, 16), default=1)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the 200 prompts to use (default 1.0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed full repeats run first (default 1: the first "
        "pass pays first-touch page faults for the tree's memory)",
    )
    p.add_argument(
        "--long-iters", type=int, default=1000, help="iterations for the 128K-key match latency (default 1000)"
    )
    p.add_argument("--gc", choices=("freeze", "on", "off"), default="freeze")
    p.add_argument(
        "--alloc-frees",
        choices=("sink", "free-group"),
        default="sink",
        help="evict phases of hiradix/unified: frees go to an O(1) list (sink, "
        "default) or through SGLang's allocator inside one free_group per evict call",
    )
    p.add_argument(
        "--tree-core",
        choices=("rust", "python"),
        default="rust",
        help="UnifiedRadixCache tree core (unified only; default rust)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads before measuring (default 1; 0 = leave torch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write results here")
    args = p.parse_args(argv)

    _import_sglang()
    from importlib.metadata import version

    sglang_version = version("sglang")
    if sglang_version != EXPECTED_VERSION[args.impl]:
        print(
            f"warning: --impl {args.impl} is meant for sglang "
            f"{EXPECTED_VERSION[args.impl]}, this venv has {sglang_version}",
            file=sys.stderr,
        )
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    n_prompts = max(1, round(200 * args.scale))
    t0 = time.perf_counter()
    seqs = make_workload(seed=args.seed, n_prompts=n_prompts)
    info = describe(seqs)
    keys, values, total = prepare_inputs(seqs, args.page_size)
    del seqs
    long_np = make_long_key()
    long_key = array("q", long_np.astype(np.int64).tobytes())
    long_value = torch.arange(args.page_size, len(long_key) + args.page_size, dtype=torch.int64)
    setup_s = time.perf_counter() - t0

    adapter = ADAPTERS[args.impl](args.page_size, args)
    gcm = GcMode(args.gc)
    label = IMPLS[args.impl]
    if args.impl == "unified":
        label += f", {args.tree_core} tree core"
    print(
        f"{label} | sglang {sglang_version} | page {args.page_size} | "
        f"{len(keys)} seqs, {total:,} tokens | setup {setup_s:.1f}s",
        flush=True,
    )

    for i in range(args.warmup):
        r = one_repeat(adapter, keys, values, total, long_key, long_value, args, gcm)
        print(f"  warmup {i + 1}: " + ", ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True)
    results = []
    for i in range(args.repeats):
        r = one_repeat(adapter, keys, values, total, long_key, long_value, args, gcm)
        results.append(r)
        print(f"  repeat {i + 1}: " + ", ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True)

    metrics = {}
    for key, _, _, _ in METRICS:
        vals = [r[key] for r in results if key in r]
        if vals:
            metrics[key] = summarize(vals)

    print()
    print(f"{'figure':<26}{'median':>12}{'best':>12}{'worst':>12}")
    for key, lab, unit, hib in METRICS:
        if key not in metrics:
            continue
        m = metrics[key]
        best, worst = (m["max"], m["min"]) if hib else (m["min"], m["max"])
        print(f"{lab:<26}{fmt(m['median'], unit):>12}{fmt(best, unit):>12}{fmt(worst, unit):>12}")

    tree_tokens = results[0]["tree_tokens"] if results else None
    doc = {
        "impl": args.impl,
        "impl_desc": label,
        "sglang_version": sglang_version,
        "torch_version": torch.__version__,
        "tree_core": (getattr(adapter, "core_class", None) if args.impl == "unified" else None),
        "page_size": args.page_size,
        "scale": args.scale,
        "seed": args.seed,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "long_iters": args.long_iters,
        "gc_mode": args.gc,
        "alloc_frees": "mock" if args.impl == "radix" else args.alloc_frees,
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "sequences": info["count"],
            "raw_tokens": info["total_tokens"],
            "min_len": info["min_len"],
            "max_len": info["max_len"],
            "tokens": total,
            "tree_tokens": tree_tokens,
            "long_key_tokens": len(long_key),
        },
        "metrics": metrics,
        "machine": machine_info(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return doc


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it would free millions of tree objects one by
    # one, and triton's nanobind bindings print spurious leak reports at exit.
    os._exit(0)
