"""hiradix.sglang caches built exactly as SGLang's scheduler builds them: ``ServerArgs`` with
``radix_cache_backend="hiradix"``, SGLang's own CPU ``MHATokenToKVPool`` /
``MLATokenToKVPool``, ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` and
``ReqToTokenPool``, and SGLang's ``create_tree_cache``; and, for parity tests, SGLang's own
``HiRadixCache`` on the same kind of pools (:func:`build_sglang`). Skips, saying why, without
a supported SGLang (the import itself skips the importing test module)."""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import logging
import os
import tempfile
import time
import types
import warnings
from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (CI installs sglang==0.5.18, see requirements/)", allow_module_level=True)

from hiradix._sglang_plugin import UnsupportedSGLang, check_sglang_version

try:
    check_sglang_version()
except UnsupportedSGLang as e:
    pytest.skip(str(e), allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    import hiradix.sglang as hs

logging.getLogger("sglang").setLevel(logging.WARNING)
hs.register()

LAYERS = 3
HEADS = 2
HEAD_DIM = 4


class _Worker:
    """The part of SGLang's TP worker the cache factory calls."""

    def __init__(self) -> None:
        self.counter: Any = None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


@dataclass
class Env:
    """One cache and the SGLang objects it runs on."""

    cache: Any
    kv: Any
    allocator: Any
    req_to_token: Any
    worker: _Worker
    page_size: int
    mla: bool
    reqs: list[Any] = field(default_factory=list)

    def new_req(self, tokens: list[int], *, rid: str | None = None, extra_key: str | None = None,
                cache_salt: str | None = None) -> Any:
        """A real SGLang ``Req`` with a ``req_to_token`` row."""
        rid = rid or f"r{len(self.reqs)}"
        req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=8), extra_key=extra_key,
                  cache_salt=cache_salt)
        assert self.req_to_token.alloc([req]) is not None
        self.reqs.append(req)
        return req

    def layers(self) -> list[torch.Tensor]:
        """Every device KV buffer, per layer and component."""
        if self.mla:
            return list(self.kv.kv_buffer)
        return [*self.kv.k_buffer, *self.kv.v_buffer]

    def write_kv(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """"Compute" KV: every slot gets bytes derived from (token, position) only, so a
        reused prefix must read back identical bytes wherever it was cached."""
        for i, buf in enumerate(self.layers()):
            val = (tokens.to(torch.float32) * 7 + positions.to(torch.float32) * 13 + i).remainder(997)
            buf[slots] = val.view(-1, *([1] * (buf.dim() - 1))).expand(-1, *buf.shape[1:]).to(buf.dtype)

    def expected_kv(self, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for i, buf in enumerate(self.layers()):
            val = (tokens.to(torch.float32) * 7 + positions.to(torch.float32) * 13 + i).remainder(997)
            out.append(val.view(-1, *([1] * (buf.dim() - 1))).expand(-1, *buf.shape[1:]).to(buf.dtype))
        return out


def build(page_size: int = 1, *, size: int = 512, layout: str = "layer_first", write_policy: str = "write_through",
          mla: bool = False, storage: str | None = None, extra_config: str | None = None,
          eviction_policy: str = "lru", hicache_ratio: float = 2.0, prefetch_policy: str = "best_effort",
          tp_group: Any = None, kv_events: bool = False, eagle: bool = False) -> Env:
    """A cache built through SGLang's registry and ``create_tree_cache``, on SGLang's pools."""
    kv, alloc, req_to_token, server_args = _pools_and_args(
        page_size, size, layout, write_policy, mla, storage, extra_config, eviction_policy, hicache_ratio,
        prefetch_policy)
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=alloc,
                             page_size=page_size, eviction_policy=eviction_policy, tp_cache_group=tp_group,
                             enable_kv_cache_events=kv_events, is_eagle=eagle)
    worker = _Worker()
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
        enable_hierarchical_cache=True, disable_radix_cache=False, effective_chunked_prefill_size=None,
        tp_worker=worker, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )
    cache = create_tree_cache(ctx)
    atexit.unregister(cache.shutdown)
    return Env(cache, kv, alloc, req_to_token, worker, page_size, mla)


def _pools_and_args(page_size: int, size: int, layout: str, write_policy: str, mla: bool, storage: str | None,
                    extra_config: str | None, eviction_policy: str, hicache_ratio: float,
                    prefetch_policy: str) -> tuple[Any, Any, Any, Any]:
    size = size // page_size * page_size
    if mla:
        kv = MLATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, kv_lora_rank=8,
                              qk_rope_head_dim=4, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    else:
        kv = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size=size, page_size=page_size, dtype=torch.float32, device="cpu",
                                            kvcache=kv, need_sort=False)
    req_to_token = ReqToTokenPool(size=64, max_context_len=4096, device="cpu", enable_memory_saver=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server_args = ServerArgs(
            model_path="dummy", device="cpu", enable_hierarchical_cache=True, radix_cache_backend="hiradix",
            page_size=page_size, hicache_mem_layout=layout, hicache_io_backend="direct",
            hicache_write_policy=write_policy, hicache_ratio=hicache_ratio, hicache_storage_backend=storage,
            hicache_storage_backend_extra_config=extra_config, radix_eviction_policy=eviction_policy,
            hicache_storage_prefetch_policy=prefetch_policy,
        )
    return kv, alloc, req_to_token, server_args


# ---------------------------------------------------------------------------- SGLang's own cache
def _transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, page_size: int) -> None:
    """sgl_kernel's CUDA-only per-layer copy, in torch on the CPU."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))


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


def patch_sglang_for_cpu(monkeypatch: pytest.MonkeyPatch, hicache_ratio: float = 2.0) -> None:
    """What SGLang 0.5.18's own ``HiRadixCache`` needs to run on the CPU, as
    ``bench/sglang_baselines.py`` does it: host pinning is a no-op, ``transfer_kv_direct`` is
    torch, the host/device ratio comes from here (SGLang reads the server's published
    runtime config), one-rank gloo for its TP group; plus no host-memory headroom check and
    the :class:`TickClock`."""
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
    monkeypatch.setattr(phm, "transfer_kv_direct", _transfer_kv_direct, raising=False)
    monkeypatch.setattr(hrc, "get_memory", lambda: types.SimpleNamespace(hicache_ratio=hicache_ratio))
    clock = TickClock()
    monkeypatch.setattr(hrc, "time", clock)
    monkeypatch.setattr(rc, "time", clock)
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="hiradix_sglang_pg_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def build_sglang(page_size: int = 1, *, size: int = 512, write_policy: str = "write_through",
                 eviction_policy: str = "lru", hicache_ratio: float = 2.0, kv_events: bool = False,
                 eagle: bool = False) -> Env:
    """SGLang's own ``HiRadixCache`` on SGLang's CPU pools (MHA, ``layer_first``, io backend
    ``direct``): the reference of the parity tests. Needs :func:`patch_sglang_for_cpu`."""
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    kv, alloc, req_to_token, server_args = _pools_and_args(
        page_size, size, "layer_first", write_policy, False, None, None, eviction_policy, hicache_ratio,
        "best_effort")
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=alloc,
                             page_size=page_size, eviction_policy=eviction_policy,
                             enable_kv_cache_events=kv_events, is_eagle=eagle)
    cache = HiRadixCache(params, server_args)
    atexit.unregister(cache.shutdown)
    return Env(cache, kv, alloc, req_to_token, _Worker(), page_size, False)


