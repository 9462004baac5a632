"""hiradix.sglang caches built exactly as SGLang's scheduler builds them: ``ServerArgs`` from
SGLang's own command line (:mod:`tests.sglang.args`) with ``--radix-cache-backend hiradix``,
SGLang's own CPU ``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator`` and
``ReqToTokenPool``, and SGLang's ``create_tree_cache``. Skips, saying why, without a
supported SGLang (the import itself skips the importing test module).

``build(impl="sglang")`` builds SGLang 0.5.18's *own* HiRadixCache the same way, on CPU.
That needs the stand-ins of :func:`patch_sglang_for_cpu` (the ``sglang_cpu`` fixture),
each for one thing SGLang only does on an accelerator or in a launched server; they are
test support, and none of them touches hiradix's code paths. Shared-storage backends for
the interop tests (:data:`SHARED`) are at the end."""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import logging
import os
import tempfile
import threading
import time
import types
import warnings
from array import array
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (CI installs sglang==0.5.18, see requirements/)", allow_module_level=True)

from hiradix._sglang_versions import UnsupportedSGLang, check_sglang_version

try:
    check_sglang_version()
except UnsupportedSGLang as e:
    pytest.skip(str(e), allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    import hiradix.sglang as hs
    from hiradix.sglang import storage as hss

from hiradix.peer.node import InProcessCluster
from hiradix.peer.store import PeerCacheStore
from hiradix.storage import MemoryStorage, StorageBackend, StorageConfig
from hiradix.storage.registry import register_backend
from tests.sglang import args as sglang_args
from tests.sglang.pools import KVBuffers, Worker, copy_rows, sglang_pools, transfer_kv_direct

logging.getLogger("sglang").setLevel(logging.WARNING)
hs.register()

#: SGLang 0.5.20 (CI: ``.venv-sglang20``), told apart as :mod:`hiradix.sglang.api` does:
#: a request's ``req_to_token`` row and ``cache_protected_len`` live on its KV record
#: ``req.kv`` (:func:`record`), ``create_tree_cache`` reads the backend's name from the
#: server flags SGLang publishes (``get_memory()``), and SGLang's default hierarchical
#: cache is the ``UnifiedRadixCache``. The tests that need what 0.5.20 no longer has skip
#: through :func:`needs_sglang_018`.
SGLANG_020 = hasattr(BasePrefixCache, "free_kv_row") and not hasattr(BasePrefixCache, "checkpoint")


def record(req: Any) -> Any:
    """The object holding ``req_pool_idx`` and ``cache_protected_len``: ``req.kv`` on
    SGLang 0.5.20, the ``Req`` itself on 0.5.18."""
    return req.kv if SGLANG_020 else req


def needs_sglang_018(what: str) -> None:
    """Skip, naming the difference, a test of ``what`` that needs SGLang 0.5.18."""
    if SGLANG_020:
        pytest.skip(f"SGLang 0.5.20: {what}")


def needs_sglang_020(what: str) -> None:
    """Skip, naming the difference, a test of ``what`` that needs SGLang 0.5.20."""
    if not SGLANG_020:
        pytest.skip(f"SGLang 0.5.18: {what}")


#: Why the tests beside SGLang's own HiRadixCache skip on 0.5.20.
NO_STOCK_HIRADIX = (
    "its create_tree_cache builds UnifiedRadixCache for --enable-hierarchical-cache, so there is "
    "no stock HiRadixCache to run beside hiradix's (tests/sglang/v23 covers UnifiedRadixCache on 0.5.23)"
)
#: Why 0.5.18's KV-event tests skip on 0.5.20 (``test_sglang20_kv_events.py`` has 0.5.20's).
NO_KV_EVENTS = (
    "they compare with SGLang 0.5.18's own HiRadixCache and its event classes; 0.5.20's events are "
    "compared with its own UnifiedRadixCache in test_sglang20_kv_events.py"
)


@dataclass
class Env(KVBuffers):
    """One cache and the SGLang objects it runs on."""

    cache: Any
    kv: Any
    allocator: Any
    req_to_token: Any
    worker: Worker
    page_size: int
    mla: bool
    impl: str = "hiradix"
    reqs: list[Any] = field(default_factory=list)

    def new_req(
        self, tokens: list[int], *, rid: str | None = None, extra_key: str | None = None, cache_salt: str | None = None
    ) -> Any:
        """A real SGLang ``Req`` with a ``req_to_token`` row."""
        rid = rid or f"r{len(self.reqs)}"
        req = Req(
            rid, "", array("q", tokens), SamplingParams(max_new_tokens=8), extra_key=extra_key, cache_salt=cache_salt
        )
        assert self.req_to_token.alloc([req]) is not None
        self.reqs.append(req)
        return req


def build(
    page_size: int = 1,
    *,
    size: int = 512,
    layout: str = "layer_first",
    write_policy: str = "write_through",
    mla: bool = False,
    storage: str | None = None,
    extra_config: str | None = None,
    eviction_policy: str = "lru",
    hicache_ratio: float = 2.0,
    prefetch_policy: str = "best_effort",
    tp_group: Any = None,
    impl: str = "hiradix",
    model: str | None = None,
    kv_events: bool = False,
    eagle: bool = False,
    params: dict[str, Any] | None = None,
    **more_flags: Any,
) -> Env:
    """A cache built through SGLang's registry and ``create_tree_cache``, on SGLang's pools:
    hiradix.sglang's (``--radix-cache-backend hiradix``) or, with ``impl="sglang"``,
    SGLang's own HiRadixCache (the default backend; needs :func:`patch_sglang_for_cpu`).
    ``model`` is ``--served-model-name``, part of the L3 keys; ``params`` are more
    ``CacheInitParams`` fields, ``more_flags`` more server flags."""
    if impl not in ("hiradix", "sglang"):
        raise ValueError(f"impl must be 'hiradix' or 'sglang', got {impl!r}")
    kv, alloc, req_to_token = sglang_pools(page_size, size, mla)
    flags = dict(
        model_path="dummy",
        device="cpu",
        enable_hierarchical_cache=True,
        radix_cache_backend="hiradix" if impl == "hiradix" else None,
        served_model_name=model,
        # SGLang moves page_first pages with its (CUDA) kernels only; direct does the rest.
        page_size=page_size,
        hicache_mem_layout=layout,
        hicache_io_backend="kernel" if layout == "page_first" else "direct",
        hicache_write_policy=write_policy,
        hicache_ratio=hicache_ratio,
        hicache_storage_backend=storage,
        hicache_storage_backend_extra_config=extra_config,
        radix_eviction_policy=eviction_policy,
        hicache_storage_prefetch_policy=prefetch_policy,
        **more_flags,
    )
    published = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if SGLANG_020:
            # As a launched 0.5.20 scheduler: the flags published (create_tree_cache reads
            # them through get_memory()), the cache built from that ServerArgs; undone
            # once it is built (the cache keeps the object).
            from sglang.srt.runtime_context import get_context

            sglang_args.parse(sglang_args.command_line(flags)[0])  # SGLang's command line accepts them
            published = get_context().override_server_args(**flags)
            server_args = published.install()
        else:
            server_args = sglang_args.server_args(flags)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        eviction_policy=eviction_policy,
        tp_cache_group=tp_group,
        enable_kv_cache_events=kv_events,
        is_eagle=eagle,
        **(params or {}),
    )
    worker = Worker()
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=True,
        disable_radix_cache=False,
        effective_chunked_prefill_size=None,
        tp_worker=worker,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    if impl == "sglang":
        if not _PATCHED:
            raise RuntimeError("SGLang's own HiRadixCache needs patch_sglang_for_cpu() (the sglang_cpu fixture)")
        for buf in kv.kv_buffer if mla else [*kv.k_buffer, *kv.v_buffer]:
            _DEVICE_BUFFERS[buf.data_ptr()] = buf
    try:
        cache = create_tree_cache(ctx)
    finally:
        if published is not None:
            published.restore()
    atexit.unregister(cache.shutdown)
    want = hs.HiRadixCache if impl == "hiradix" else HiRadixCache
    assert type(cache) is want, f"create_tree_cache built {type(cache).__name__}, not {want.__name__}"
    if impl == "sglang":
        # SGLang's host pool is built with pin_memory=True (its default); on CPU nothing is
        # pinned (cudaHostRegister is a no-op below), and SGLang's generic (non-v1) L3 get
        # asks get_dummy_flat_data_page() for torch.zeros(..., pin_memory=True) pages,
        # which fails without an accelerator: say what is true on CPU.
        cache.token_to_kv_pool_host.pin_memory = False
    return Env(cache, kv, alloc, req_to_token, worker, page_size, mla, impl)


# ---------------------------------------------------------------------------- SGLang's own cache on CPU
_DEVICE_BUFFERS: dict[int, torch.Tensor] = {}  # data_ptr -> device KV buffer of an impl="sglang" Env
_PATCHED = False


def _by_ptr(ptrs: torch.Tensor) -> list[torch.Tensor]:
    return [_DEVICE_BUFFERS[int(p)] for p in ptrs.tolist()]


def _transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    **_: Any,
) -> None:
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):  # host [slots, layers, heads, dim]
        copy_rows(dst, dst_indices, src[:, layer_id], src_indices)


def _transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    num_layers: int,
    **_: Any,
) -> None:
    for ptrs, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, src in enumerate(_by_ptr(ptrs)[:num_layers]):
            copy_rows(dst[:, layer], dst_indices, src, src_indices)


def _transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int, **_: Any
) -> None:
    copy_rows(dst, dst_indices, src[:, layer_id], src_indices)  # host [slots, layers, 1, width]


def _transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    num_layers: int,
    **_: Any,
) -> None:
    for layer, src in enumerate(_by_ptr(src_layers)[:num_layers]):
        copy_rows(dst[:, layer], dst_indices, src, src_indices)


@contextmanager
def patch_sglang_for_cpu(tmp_dir: Path, hicache_ratio: float = 2.0) -> Iterator[None]:
    """What SGLang 0.5.18's own HiRadixCache needs to run (with L3 storage) on CPU, each
    undone on exit. Nothing here touches hiradix:

    - ``pool_host.common._cuda_host_register`` / ``_unregister``: SGLang pins every host
      pool with ``cudaHostRegister`` (``pin_memory=True`` is its default); without CUDA
      that raises. No-ops here: CPU memory needs no pinning.
    - ``pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`` = 0: SGLang refuses any host
      pool, however small, unless 10 GiB more than it are available (a production
      server's reserve); a CI machine running the suite in parallel often has less. The
      test pools are kilobytes.
    - ``transfer_kv_direct`` and, for ``page_first`` (kernel I/O), ``transfer_kv_per_layer_pf_lf``,
      ``transfer_kv_all_layer_lf_pf`` and their MLA twins in ``pool_host.mha`` / ``.mla``:
      ``sgl_kernel`` ops, imported only on CUDA/HIP. Here the same gathers and scatters
      with ``index_select`` / ``index_copy_``; the all-layer ones get device buffers as
      ``data_ptr`` tables, resolved through the buffers ``build(impl="sglang")`` recorded.
    - ``get_parallel().override(tp/pp ranks and sizes, attn_dcp)``: SGLang's controller
      asks its parallel state for the ranks that name storage keys
      (``_generate_storage_config``) and the MLA host pool for its DCP shape; a launched
      server initializes that state, a test does not. One rank, no DCP.
    - ``override_server_args(hicache_ratio=...)``: HiRadixCache reads the host/device
      ratio from the runtime config a launched server publishes (``get_memory()``).
    - a one-rank gloo process group (a file store, ``GLOO_SOCKET_IFNAME=lo``):
      HiRadixCache asks ``torch.distributed`` the TP group's world size.
    """
    global _PATCHED
    needs_sglang_018(NO_STOCK_HIRADIX)
    import sglang.srt.mem_cache.pool_host.base as phb
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.srt.mem_cache.pool_host.mha as phm
    import sglang.srt.mem_cache.pool_host.mla as phmla
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_context, get_parallel

    patches = [
        (phc, "_cuda_host_register", lambda buffer: None),
        (phc, "_cuda_host_unregister", lambda buffer: None),
        (phb, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0),
        (phm, "transfer_kv_direct", transfer_kv_direct),
        (phm, "transfer_kv_per_layer_pf_lf", _transfer_kv_per_layer_pf_lf),
        (phm, "transfer_kv_all_layer_lf_pf", _transfer_kv_all_layer_lf_pf),
        (phmla, "transfer_kv_direct", transfer_kv_direct),
        (phmla, "transfer_kv_per_layer_mla_pf_lf", _transfer_kv_per_layer_mla_pf_lf),
        (phmla, "transfer_kv_all_layer_mla_lf_pf", _transfer_kv_all_layer_mla_lf_pf),
    ]
    missing = object()
    saved = [(mod, name, getattr(mod, name, missing)) for mod, name, _ in patches]
    own_group = not dist.is_initialized()
    old_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    with ExitStack() as stack:
        for mod, name, fn in patches:
            setattr(mod, name, fn)
        stack.enter_context(
            get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
        )
        server_args = get_context().override_server_args(hicache_ratio=hicache_ratio)
        server_args.install()
        stack.callback(server_args.restore)
        if own_group:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            dist.init_process_group("gloo", init_method=f"file://{tmp_dir / 'pg'}", rank=0, world_size=1)
        _PATCHED = True
        try:
            yield
        finally:
            _PATCHED = False
            _DEVICE_BUFFERS.clear()
            if own_group:
                dist.destroy_process_group()
                if old_ifname is None:
                    os.environ.pop("GLOO_SOCKET_IFNAME", None)
                else:
                    os.environ["GLOO_SOCKET_IFNAME"] = old_ifname
            for mod, name, old in saved:
                if old is missing:
                    delattr(mod, name)
                else:
                    setattr(mod, name, old)


class PageTransfers:
    """Completion signals of SGLang's L3 prefetch I/O, per request: SGLang's controller
    has none to wait on (its I/O thread bumps ``completed_tokens`` and moves on), so its
    ``_page_transfer`` is wrapped, on this one controller, to set an event once it
    returned for an operation. Behaviour is unchanged."""

    def __init__(self, cache: Any) -> None:
        self.done: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        controller = cache.cache_controller
        inner = controller._page_transfer

        def page_transfer(operation: Any) -> None:
            try:
                inner(operation)
            finally:
                self.done[operation.request_id].set()

        controller._page_transfer = page_transfer


# ---------------------------------------------------------------------------- shared L3 for interop tests
SHARED: dict[str, Any] = {}
"""Storage shared by several caches of one test, by name: a hiradix ``MemoryStorage`` or an
``InProcessCluster`` (the extra config names it, ``"shared"``, and for a cluster the
``"node"`` a cache attaches to). The file backend needs none: one directory is shared."""


def _shared_backend(config: StorageConfig) -> StorageBackend:
    target = SHARED[config.extra_config["shared"]]
    if isinstance(target, InProcessCluster):
        return PeerCacheStore(node=target.nodes[int(config.extra_config["node"])])
    assert isinstance(target, MemoryStorage)
    return target


# hiradix.sglang: --hicache-storage-backend shared (hiradix's registry)
register_backend("shared", lambda config, **kw: _shared_backend(config), replace=True)


class SharedStorage(hss.MemoryStorage):
    """Stock SGLang's side of :data:`SHARED`: hiradix.sglang.storage's wrapper (the class
    SGLang's dynamic loader builds) over the shared backend instead of a new one."""

    @staticmethod
    def open_backend(config: StorageConfig) -> StorageBackend:
        return _shared_backend(config)


# ---------------------------------------------------------------------------- parity with SGLang's own cache
# SGLang's HiRadixCache beside hiradix.sglang's on MHA layer_first pools, io backend direct,
# with a deterministic clock (tests/sglang/v18/twin.py: KV events, EAGLE).
def parity_pools_and_args(
    page_size: int,
    size: int,
    layout: str = "layer_first",
    write_policy: str = "write_through",
    mla: bool = False,
    storage: str | None = None,
    extra_config: str | None = None,
    eviction_policy: str = "lru",
    hicache_ratio: float = 2.0,
    prefetch_policy: str = "best_effort",
) -> tuple[Any, Any, Any, Any]:
    """SGLang's CPU pools and a ``ServerArgs`` for a cache built by hand, as a fork's
    scheduler builds ``HiRadixCache(params, server_args)``: ``(kv, allocator,
    req_to_token, server_args)``."""
    kv, alloc, req_to_token = sglang_pools(page_size, size, mla)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server_args = sglang_args.server_args(
            dict(
                model_path="dummy",
                device="cpu",
                enable_hierarchical_cache=True,
                radix_cache_backend="hiradix",
                page_size=page_size,
                hicache_mem_layout=layout,
                hicache_io_backend="direct",
                hicache_write_policy=write_policy,
                hicache_ratio=hicache_ratio,
                hicache_storage_backend=storage,
                hicache_storage_backend_extra_config=extra_config,
                radix_eviction_policy=eviction_policy,
                hicache_storage_prefetch_policy=prefetch_policy,
            )
        )
    return kv, alloc, req_to_token, server_args


class TickClock:
    """A ``time`` module stand-in for SGLang's cache modules whose ``monotonic`` ticks by
    one per call: node access times are then distinct and ordered by call, so SGLang's
    LRU order (ties broken by set iteration otherwise) is deterministic."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)

    def monotonic(self) -> float:
        return float(next(self._ticks))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def patch_sglang_for_parity(monkeypatch: pytest.MonkeyPatch, hicache_ratio: float = 2.0) -> None:
    """What SGLang 0.5.18's own ``HiRadixCache`` needs to run on the CPU, as
    ``bench/sglang_baselines.py`` does it: host pinning is a no-op, ``transfer_kv_direct`` is
    torch, the host/device ratio comes from here (SGLang reads the server's published
    runtime config), one-rank gloo for its TP group; plus no host-memory headroom check and
    the :class:`TickClock`."""
    needs_sglang_018(NO_STOCK_HIRADIX)
    import sglang.srt.mem_cache.hiradix_cache as hrc
    import sglang.srt.mem_cache.pool_host.base as phb
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.srt.mem_cache.pool_host.mha as phm
    import sglang.srt.mem_cache.radix_cache as rc
    import torch.distributed as dist

    # The pools are a few KiB: SGLang's 10 GB host-memory headroom check would only make
    # the tests depend on what else the machine is running.
    monkeypatch.setattr(phb, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)
    monkeypatch.setattr(phc, "_cuda_host_register", lambda buffer: None)
    monkeypatch.setattr(phc, "_cuda_host_unregister", lambda buffer: None)
    monkeypatch.setattr(phm, "transfer_kv_direct", transfer_kv_direct, raising=False)
    monkeypatch.setattr(hrc, "get_memory", lambda: types.SimpleNamespace(hicache_ratio=hicache_ratio))
    clock = TickClock()
    monkeypatch.setattr(hrc, "time", clock)
    monkeypatch.setattr(rc, "time", clock)
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="hiradix_sglang_pg_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def build_sglang(
    page_size: int = 1,
    *,
    size: int = 512,
    write_policy: str = "write_through",
    eviction_policy: str = "lru",
    hicache_ratio: float = 2.0,
    kv_events: bool = False,
    eagle: bool = False,
) -> Env:
    """SGLang's own ``HiRadixCache`` on SGLang's CPU pools (MHA, ``layer_first``, io backend
    ``direct``): the reference of the parity tests. Needs :func:`patch_sglang_for_parity`."""
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    kv, alloc, req_to_token, server_args = parity_pools_and_args(
        page_size, size, "layer_first", write_policy, False, None, None, eviction_policy, hicache_ratio, "best_effort"
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        eviction_policy=eviction_policy,
        enable_kv_cache_events=kv_events,
        is_eagle=eagle,
    )
    cache = HiRadixCache(params, server_args)
    atexit.unregister(cache.shutdown)
    return Env(cache, kv, alloc, req_to_token, Worker(), page_size, False, "sglang")
