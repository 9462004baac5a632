"""SGLang's own ``UnifiedRadixCache`` (0.5.20 and 0.5.23) on CPU, built as its scheduler
builds it: ``tests/sglang/v23`` (0.5.23) and the 0.5.20 tests of ``tests/sglang``.

From 0.5.20 on, with ``--enable-hierarchical-cache`` SGLang's
``create_tree_cache`` (the default factory, no ``--radix-cache-backend``) builds a
``UnifiedRadixCache`` and calls its ``init_hicache``, which assembles a host pool group
and a ``HybridCacheController`` and attaches the ``--hicache-storage-backend`` through
``StorageBackendFactory``. :func:`build` does exactly that, on SGLang's own CPU
``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``PagedTokenToKVPoolAllocator`` and
``ReqToTokenPool``, with the server flags published the way a launched scheduler reads
them (``get_memory()`` / ``get_serving()``, SGLang's runtime context).

:func:`build_hiradix` builds hiradix's cache through the same ``create_tree_cache``, as
the scheduler does with ``--radix-cache-backend hiradix`` (the plugin registered), on the
same pools (:mod:`tests.sglang.pools`, shared with ``tests/sglang/v18``).

That needs the stand-ins of :func:`patch_sglang_for_cpu`, each for one thing SGLang only
does on an accelerator or in a launched server; they are test support and touch none of
hiradix's code. :func:`write` and :func:`read` drive a prefix through L3 as the
scheduler does, waiting on real completion signals with bounded waits.

The module skips its importer, saying why, without an SGLang whose hierarchical cache is
the ``UnifiedRadixCache`` (0.5.18 and older build ``HiRadixCache``: ``tests/sglang/v18``).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import logging
import threading
import warnings
from array import array
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (CI installs sglang==0.5.23 into .venv-sglang23)", allow_module_level=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

# 0.5.18 ships a unified_radix_cache.py too (its create_tree_cache builds HiRadixCache),
# and 0.5.20 still a hiradix_cache.py (unused): told apart as hiradix.sglang.api does, by
# the request API that came with the UnifiedRadixCache hierarchical cache.
if not (hasattr(BasePrefixCache, "checkpoint") or hasattr(BasePrefixCache, "free_kv_row")):
    pytest.skip(
        "this SGLang builds HiRadixCache (<= 0.5.18): tests/sglang/v18 covers it; these tests need the "
        "UnifiedRadixCache hierarchical cache of SGLang >= 0.5.20 (CI: 0.5.20, 0.5.23)",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.sampling.sampling_params import SamplingParams

    import hiradix.sglang as hs
    from hiradix.sglang import storage as hss

from hiradix.peer.node import InProcessCluster
from hiradix.peer.store import PeerCacheStore
from hiradix.storage import MemoryStorage, StorageBackend, StorageConfig
from tests.sglang import args as sglang_args
from tests.sglang.pools import LAYERS, KVBuffers, Worker, sglang_pools, transfer_kv_direct, wait_queue

logging.getLogger("sglang").setLevel(logging.ERROR)
hs.register()  # what SGLang's plugin loader does at start-up (--radix-cache-backend hiradix)

PAGE = 4
N = 32  # tokens per test: 8 pages
TIMEOUT = 60.0  # seconds; each wait ends on its signal in milliseconds
MODEL = "org/model-7b"


@dataclass
class Env(KVBuffers):
    """One SGLang cache and the SGLang objects it runs on."""

    cache: Any
    kv: Any
    allocator: Any
    req_to_token: Any
    mla: bool
    page_size: int = PAGE
    worker: Any = None
    reqs: int = 0

    def new_req(
        self, tokens: list[int], *, extra_key: str | None = None, cache_salt: str | None = None, max_new_tokens: int = 8
    ) -> Any:
        """A real SGLang ``Req`` (no ``req_to_token`` row yet: the scheduler gives it one
        when it allocates the request's KV)."""
        self.reqs += 1
        return Req(
            f"r{self.reqs}",
            "",
            array("q", tokens),
            SamplingParams(max_new_tokens=max_new_tokens),
            extra_key=extra_key,
            cache_salt=cache_salt,
        )


def build(
    *,
    mla: bool = False,
    layout: str = "layer_first",
    storage: str | None = None,
    extra_config: str | None = None,
    size: int = 512,
    page_size: int = PAGE,
    params: dict[str, Any] | None = None,
    pools: tuple[Any, Any, Any] | None = None,
    **flags: Any,
) -> Env:
    """SGLang's own hierarchical cache on SGLang's CPU pools, through ``create_tree_cache``
    (the default factory), with the server flags installed by :func:`patch_sglang_for_cpu`
    under the ``hicache_*`` names a server takes: ``layout`` is ``--hicache-mem-layout``,
    ``storage`` / ``extra_config`` are ``--hicache-storage-backend`` and its extra config;
    ``flags`` are more server flags, ``params`` more ``CacheInitParams`` fields;
    ``pools`` is ``(kv, allocator, req_to_token)`` to build on instead of
    :func:`sglang_pools`'s (``size`` and ``mla`` then unused; ``bench/long_context.py``).
    Needs :func:`patch_sglang_for_cpu` active (the ``sglang_cpu`` fixture)."""
    if _ACTIVE is None:
        raise RuntimeError("build() needs patch_sglang_for_cpu() (the sglang_cpu fixture)")
    _ACTIVE.publish(layout=layout, storage=storage, extra_config=extra_config, page_size=page_size, **flags)
    kv, alloc, req_to_token = pools or sglang_pools(page_size, size, mla)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        **(params or {}),
    )
    cache = create_tree_cache(_context(params))
    _ACTIVE.caches.append(cache)
    assert type(cache) is UnifiedRadixCache, f"create_tree_cache built {type(cache).__name__}"
    # SGLang's host pool asks for pinned memory (its default); on CPU nothing is pinned,
    # and SGLang's generic L3 get allocates its dummy pages with pin_memory=True, which
    # fails without an accelerator: say what is true here.
    cache.cache_controller.storage_host_pool.pin_memory = False
    return Env(cache, kv, alloc, req_to_token, mla, page_size)


def _context(params: Any, *, hierarchical: bool = True, worker: Worker | None = None) -> Any:
    """The scheduler's ``TreeCacheBuildContext`` for one rank of a plain (not hybrid) model."""
    assert _ACTIVE is not None
    # 0.5.20's context also has the chunked prefill size (no default); 0.5.23's dropped it
    more = (
        {"effective_chunked_prefill_size": None}
        if "effective_chunked_prefill_size" in {f.name for f in dataclasses.fields(TreeCacheBuildContext)}
        else {}
    )
    return TreeCacheBuildContext(
        server_args=_ACTIVE.server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=hierarchical,
        disable_radix_cache=False,
        tp_worker=worker or Worker(),
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        **more,
    )


def build_hiradix(
    page_size: int = PAGE,
    *,
    size: int = 512,
    mla: bool = False,
    layout: str = "layer_first",
    write_policy: str = "write_through",
    storage: str | None = None,
    extra_config: str | None = None,
    eviction_policy: str = "lru",
    eagle: bool = False,
    hierarchical: bool = True,
    params: dict[str, Any] | None = None,
    pools: tuple[Any, Any, Any] | None = None,
    **flags: Any,
) -> Env:
    """hiradix's cache as SGLang 0.5.23's scheduler builds it with ``--radix-cache-backend
    hiradix``: the flags published (``get_memory()`` is what ``create_tree_cache`` reads the
    backend's name from), SGLang's CPU pools (``pools``, as :func:`build` takes them),
    ``create_tree_cache``. ``flags`` are more server flags, ``params`` more
    ``CacheInitParams`` fields. Needs
    :func:`patch_sglang_for_cpu` (the ``sglang_cpu`` fixture), whose exit shuts it down."""
    if _ACTIVE is None:
        raise RuntimeError("build_hiradix() needs patch_sglang_for_cpu() (the sglang_cpu fixture)")
    _ACTIVE.publish(
        layout=layout,
        storage=storage,
        extra_config=extra_config,
        page_size=page_size,
        radix_cache_backend=hs.BACKEND_NAME,
        hicache_write_policy=write_policy,
        radix_eviction_policy=eviction_policy,
        enable_hierarchical_cache=hierarchical,
        **flags,
    )
    kv, alloc, req_to_token = pools or sglang_pools(page_size, size, mla)
    init = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        eviction_policy=eviction_policy,
        is_eagle=eagle,
        **(params or {}),
    )
    worker = Worker()
    cache = create_tree_cache(_context(init, hierarchical=hierarchical, worker=worker))
    atexit.unregister(cache.shutdown)
    _ACTIVE.caches.append(cache)
    assert type(cache) is hs.HiRadixCache, f"create_tree_cache built {type(cache).__name__}"
    return Env(cache, kv, alloc, req_to_token, mla, page_size, worker)


# ---------------------------------------------------------------------------- SGLang's cache on CPU
def _page_slot(indices: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = indices.long()
    return idx // page_size, idx % page_size


def _transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    # host page_first_direct [pages, layers, page_size, ...] -> device layer [slots, ...]
    pages, offs = _page_slot(src_indices, page_size)
    for host, dev in zip(src_ptrs, dst_ptrs, strict=True):
        dev.index_copy_(0, dst_indices.long(), host[pages, layer_id, offs])


def _transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    # device layers (K layers then V layers for MHA) -> host page_first_direct
    pages, offs = _page_slot(dst_indices, page_size)
    layers = dst_ptrs[0].shape[1]
    for j, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[pages, layer, offs] = src_ptrs[j * layers + layer].index_select(0, src_indices.long())


class _Published:
    """The server flags :func:`build` publishes, as a launched scheduler would."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.server_args: Any = None
        self.caches: list[Any] = []

    def publish(self, *, layout: str, storage: str | None, extra_config: str | None, **more: Any) -> None:
        from sglang.srt.runtime_context import get_context

        flags: dict[str, Any] = dict(
            device="cpu",
            enable_hierarchical_cache=True,
            page_size=PAGE,
            served_model_name=MODEL,
            hicache_mem_layout=layout,
            hicache_io_backend="direct",
            hicache_write_policy="write_through",
            hicache_ratio=2.0,
            hicache_storage_backend=storage,
            hicache_storage_backend_extra_config=extra_config,
            hicache_storage_prefetch_policy="wait_complete",
        )
        flags.update(more)
        # SGLang's own command line accepts them (a refused flag fails here), then they
        # are published as SGLang's tests publish theirs.
        sglang_args.parse(sglang_args.command_line({"model_path": "dummy", **flags})[0])
        override = get_context().override_server_args(**flags)
        self.server_args = override.install()
        self.stack.callback(override.restore)  # LIFO: every publish undone, the last first


_ACTIVE: _Published | None = None


@contextmanager
def patch_sglang_for_cpu() -> Iterator[None]:
    """What SGLang 0.5.23's own hierarchical cache (with L3 storage) needs on CPU, each
    undone on exit; caches built meanwhile are shut down (storage threads stopped,
    backends closed) first. Nothing here touches hiradix:

    - ``pool_host.common._cuda_host_register`` / ``_cuda_host_unregister``: SGLang pins
      every host pool with ``cudaHostRegister``; without CUDA that raises. No-ops here.
    - ``pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`` = 0: SGLang refuses a host
      pool unless 10 GiB more than it are free (a production server's reserve); the
      test pools are kilobytes.
    - ``transfer_kv_direct`` and, for ``page_first_direct``,
      ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf`` in
      ``pool_host.mha`` and ``.mla``: ``sgl_kernel`` ops, imported only on CUDA/HIP/XPU.
      Here the same gathers and scatters with ``index_select`` / ``index_copy_``.
    - ``get_parallel().override(tp/pp ranks and sizes, attn_dcp)``: the controller names
      storage keys from the ranks a launched server records; one rank, no DCP.
    - server flags: :func:`build` publishes its ``ServerArgs`` through SGLang's
      ``override_server_args`` (what a launched scheduler publishes at start-up).
    """
    global _ACTIVE
    import sglang.srt.mem_cache.pool_host.base as phb
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.srt.mem_cache.pool_host.mha as phm
    import sglang.srt.mem_cache.pool_host.mla as phmla
    from sglang.srt.runtime_context import get_parallel

    patches: list[tuple[Any, str, Any]] = [
        (phc, "_cuda_host_register", lambda *a, **k: None),
        (phc, "_cuda_host_unregister", lambda *a, **k: None),
        (phb, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0),
    ]
    for mod in (phm, phmla):
        patches += [
            (mod, "transfer_kv_direct", transfer_kv_direct),
            (mod, "transfer_kv_per_layer_direct_pf_lf", _transfer_kv_per_layer_direct_pf_lf),
            (mod, "transfer_kv_all_layer_direct_lf_pf", _transfer_kv_all_layer_direct_lf_pf),
        ]
    missing = object()
    saved = [(mod, name, getattr(mod, name, missing)) for mod, name, _ in patches]
    with ExitStack() as stack:
        for mod, name, fn in patches:
            setattr(mod, name, fn)

        @stack.callback
        def _restore() -> None:
            for mod, name, old in saved:
                if old is missing:
                    delattr(mod, name)
                else:
                    setattr(mod, name, old)

        stack.enter_context(
            get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
        )
        published = _ACTIVE = _Published(stack)
        try:
            yield
        finally:
            _ACTIVE = None
            for cache in published.caches:  # while their flags are still published
                cache.shutdown()  # stops the storage threads, closes the backend
                cache.release_host_resources()
                if isinstance(cache, hs.HiRadixCache):
                    cache.core.close()  # and hiradix's copy engines


# ---------------------------------------------------------------------------- the round trip
def tokens_of(seed: int) -> list[int]:
    return [1000 + 37 * seed + 11 * i for i in range(N)]


def _key(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


class PrefetchIO:
    """Completion signals of SGLang's L3 prefetch I/O: its controller has none to wait on
    (the I/O thread puts one ack per batch, plus the hybrid controller's sidecar ack, on
    ``prefetch_sync_queue``; a sync thread moves them to ``ack_prefetch_queue``). On this
    one controller, ``_page_transfer`` is wrapped to set an event once it returned and
    the sync queue's ``put`` to count the acks it carried. Behaviour is unchanged."""

    def __init__(self, cache: Any) -> None:
        self.controller = controller = cache.cache_controller
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.acks = 0
        sync = controller.prefetch_sync_queue
        put = sync.put

        def counting_put(item: Any, *args: Any, **kwargs: Any) -> None:
            if item is not None:  # None is the stop sentinel
                with self._lock:
                    self.acks += 1
            put(item, *args, **kwargs)

        sync.put = counting_put
        inner = controller._page_transfer

        def page_transfer(operation: Any) -> Any:
            try:
                return inner(operation)
            finally:
                self.done.set()

        controller._page_transfer = page_transfer

    def wait(self, timeout: float) -> None:
        """Until the I/O thread finished and every one of its acks reached the scheduler's
        queue."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"prefetch I/O not done after {timeout} s")
        with self._lock:
            acks = self.acks
        wait_queue(self.controller.ack_prefetch_queue, acks, timeout)


def write(env: Env, tokens: list[int]) -> None:
    """Prefill ``tokens`` (fresh KV) into ``env``'s cache, wait until write-through put
    every page in L3, then evict them from L1 and L2."""
    cache = env.cache
    slots = env.allocator.alloc(N)
    for buf, val in zip(env.layers(), env.expected_kv(torch.tensor(tokens), torch.arange(N)), strict=True):
        buf[slots] = val
    assert cache.insert(InsertParams(key=_key(tokens), value=slots)).prefix_len == 0
    cache.check_hicache_events()  # acks the (synchronous on CPU) L1 -> L2 copy, queues the L3 write
    assert cache.ongoing_backup, "write-through queued no L3 backup"
    wait_queue(cache.cache_controller.ack_backup_queue, 1, TIMEOUT)
    cache.check_hicache_events()
    assert not cache.ongoing_backup and not cache.ongoing_write_through
    assert cache.evict(EvictParams(num_tokens=N)).num_tokens_evicted == N
    assert cache.evict_host(N) == N
    m = cache.match_prefix(MatchPrefixParams(key=_key(tokens)))
    assert m.device_prefix_len == 0 and m.host_hit_length == 0, "still cached in L1 or L2"


def read(env: Env, tokens: list[int], rid: str = "r") -> None:
    """Prefetch ``tokens`` from L3 into ``env``'s (fresh) cache as SGLang's scheduler does
    (``_prefetch_kvcache``, then ``check_prefetch_progress`` / ``pop_prefetch_loaded_span``
    and the PrefillAdder's ``init_load_back``), load them to the device and compare every
    layer, component, token and element with the KV that was written."""
    cache = env.cache
    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))
    assert env.req_to_token.alloc([req]) is not None
    handle = req.cache_request_handle
    m = cache.match_prefix(MatchPrefixParams(key=_key(tokens), req=req))
    assert m.device_prefix_len == 0 and m.host_hit_length == 0
    io = PrefetchIO(cache)
    anchor = m.last_host_node
    cache.prefetch_from_storage(
        handle,
        anchor,
        array("q", tokens),
        cache.get_last_hash_value(anchor),
        None,
        matched_prefix_tokens=[],
        extra_key=None,
    )
    assert handle in cache.ongoing_prefetch, "no prefetch was issued"
    wait_queue(cache.cache_controller.prefetch_hit_queue, 1, TIMEOUT)  # L3 answered batch_exists
    cache.check_hicache_events()  # host slots for the hits; the I/O thread starts reading
    io.wait(TIMEOUT)
    cache.check_hicache_events()  # the acks: completed tokens
    assert cache.check_prefetch_progress(handle)
    loaded_tokens, _ = cache.pop_prefetch_loaded_span(handle)
    assert loaded_tokens == N, f"L3 gave {loaded_tokens} of {N} tokens"
    m = cache.match_prefix(MatchPrefixParams(key=_key(tokens), req=req))
    assert m.device_prefix_len == 0 and m.host_hit_length == N
    for buf in env.layers():  # the device must get its bytes from the load
        buf.zero_()
    req.last_node, req.prefix_len = m.last_device_node, m.device_prefix_len
    req.last_host_node, req.best_match_node, req.host_hit_length = m.last_host_node, m.best_match_node, N
    req.swa_host_hit_length, req.mamba_host_hit_length = m.swa_host_hit_length, m.mamba_host_hit_length
    loaded, node = cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=N, req=req)
    )
    assert loaded == N
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(cache.ready_to_load_host_cache())
    for layer in range(LAYERS):
        counter.wait_until(layer)
    slots = cache.path_device_indices(node)
    assert len(slots) == N
    want = env.expected_kv(torch.tensor(tokens), torch.arange(N))
    for i, (buf, w) in enumerate(zip(env.layers(), want, strict=True)):
        assert torch.equal(buf[slots], w), f"buffer {i} (layer {i % LAYERS}) differs"


# ---------------------------------------------------------------------------- shared L3
SHARED: dict[str, Any] = {}
"""Storage the caches of one test share, by name: a hiradix ``MemoryStorage`` or an
``InProcessCluster`` (the extra config names it, ``"shared"``, and for a cluster the
``"node"`` a cache attaches to). The file backend needs none: one directory is shared."""


class SharedStorage(hss.MemoryStorage):
    """hiradix.sglang.storage's wrapper (the class SGLang's dynamic loader builds) over
    the test's shared backend instead of a new one."""

    @staticmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        target = SHARED[config.extra_config["shared"]]
        if isinstance(target, InProcessCluster):
            return PeerCacheStore(node=target.nodes[int(config.extra_config["node"])])
        assert isinstance(target, MemoryStorage)
        return target
