"""The builder: SGLang's ``CacheInitParams`` and ``ServerArgs`` to the core cache
(:class:`hiradix.cache.HiRadixCache`) on SGLang's own pools, allocator and process
groups, with the options the adapter keeps (:class:`Built`).

Every refusal happens here, before anything is built: the generation's (:mod:`hiradix.sglang.options`),
then the extra config's, then the pools' and the draft pools'. The adapter
(:class:`hiradix.sglang.cache.HiRadixCacheBase`) only keeps what :func:`build` returns.

- the device pool wraps the model's MHA / MLA KV buffers in place
  (:func:`~hiradix.sglang.pools.device_pool_from_sglang`); the host pool is sized from
  ``--hicache-ratio`` / ``--hicache-size`` in ``--hicache-mem-layout``;
- the controller (:class:`~hiradix.sglang.controller.SGLangCacheController`) registers its
  layer-done counter with SGLang's KV pool, and the MTP draft pools follow the target's KV;
- every count and allocation outcome is agreed over SGLang's TP / attention-CP / PP
  groups (:class:`~hiradix.sglang.distributed.SGLangAgreement`);
- L3 keys are :attr:`~hiradix.sglang.cache.HiRadixCacheBase.l3_format`'s (the
  :mod:`hiradix.sglang.cache` docstring): namespaced chains, or SGLang's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

import hiradix
from hiradix import envvars
from hiradix.cache import HiRadixCache as CoreCache
from hiradix.cache import StorageOptions, TierOptions, TreeOptions
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory.pools import DeviceKVPool, HostKVPool
from hiradix.sglang.controller import SGLangCacheController
from hiradix.sglang.distributed import SGLangAgreement
from hiradix.sglang.options import Server, parse_extra_config, read_backup_copy, read_l3_format, read_prefetch
from hiradix.sglang.pools import device_pool_from_sglang, host_pool_for
from hiradix.storage.base import StorageConfig
from hiradix.storage.keys import KeyNamespace, sglang_key_suffix

__all__ = ["Built", "attention_dp_rank", "build"]

ChainSeed = Callable[[str | None], str | None]


@dataclass(frozen=True)
class Built:
    """What :func:`build` makes of SGLang's params and server args: the core cache and
    the options the adapter keeps (``extra``: what the extra config has left for the
    storage backend, which the adapter attaches once it exists)."""

    core: CoreCache
    controller: SGLangCacheController
    args: Any  # the ServerArgs as the generation reads them (options.Server.read)
    kv_cache: Any  # SGLang's device KV pool
    device: torch.device
    host_pool: HostKVPool
    storage_config: StorageConfig
    key_suffix: str  # what hiradix's own backends get appended to each key
    cp: tuple[int, int]  # attention-CP (rank, size)
    l3_format: str
    backup_copy: str | None
    backend: str | None  # --hicache-storage-backend
    extra: dict[str, Any]
    prefetch: PrefetchConfig
    pass_prefix_keys: bool


def build(params: Any, server_args: Any, server: Server, eviction_policy: str) -> Built:
    """Refuse what this adapter does not do, then build the core cache on SGLang's pools
    (module docstring). ``ValueError`` naming the option for every refusal. ``O(pools)``
    to allocate the host pool."""
    args = server.options(params, server_args)
    allocator = params.token_to_kv_pool_allocator
    kv_cache = allocator.get_kvcache()
    device = torch.device(allocator.device)
    extra = parse_extra_config(getattr(args, "hicache_storage_backend_extra_config", None))
    prefetch, pass_keys = read_prefetch(extra, getattr(args, "hicache_storage_prefetch_policy", "best_effort"))
    fmt = read_l3_format(extra)
    copy = read_backup_copy(extra, device)
    if fmt == "sglang" and params.is_eagle:
        # The tree keeps an EAGLE key's bigrams as their second tokens: token-only chains
        # of those would name another request's pages in a shared L3 (a plain key of the
        # same tokens without the first), so that pairing is refused, never served.
        raise ValueError(
            "--hicache-storage-backend-extra-config l3_format 'sglang' is not supported with EAGLE "
            "(bigram keys); use the default l3_format 'hiradix'"
        )
    device_pool = device_pool_from_sglang(kv_cache, params.page_size)  # checked against params.page_size
    drafts = _mtp_draft_pools(params)
    host_pool = host_pool_for(
        device_pool,
        # SGLang 0.5.20 and 0.5.23 pack MTP draft layers into the target's host pages, so a
        # --hicache-size budget holds fewer slots with drafts; hiradix's draft host pools
        # (the target's slots each) are counted against it the same way.
        extra_bytes_per_token=sum(d.bytes_per_token for d, _ in drafts),
        ratio=float(getattr(args, "hicache_ratio", None) or 2.0),  # SGLang's default when unset
        size_gb=float(getattr(args, "hicache_size", 0) or 0),
        layout=args.hicache_mem_layout,
        page_order="sglang" if fmt == "sglang" else "hiradix",
    )
    config, chain_seed, key_suffix = _l3_keys(params, args, host_pool, fmt)
    agreement, controller = _controller(params, args, device_pool, host_pool, drafts, kv_cache, copy)
    backend = getattr(args, "hicache_storage_backend", None)
    core = CoreCache(
        device_pool,
        host_pool,
        tree=TreeOptions(
            eviction_policy=eviction_policy,
            write_policy=controller.write_policy,
            # Page hashes are the L3 keys; as SGLang, they are computed only when there is
            # an L3 (one attached at runtime hashes what the tree holds then, once).
            enable_hash=backend is not None,
            chain_seed=chain_seed,
        ),
        # The backups a step's inserts ask for start at the step's check_hicache_events
        # (the scheduler calls it at the top of every loop iteration, before its idle
        # checks), as one submission; until then the tree holds those nodes locked,
        # protected from the insert on as SGLang's write-through has them, and they
        # complete, with their KV events, in SGLang's order. One difference: a full host
        # pool evicts for them at the step, where SGLang evicts inside the insert.
        # HIRADIX_BATCH_BACKUPS=0 starts each insert's backups in the insert instead.
        tiers=TierOptions(batch_backups=envvars.flag("HIRADIX_BATCH_BACKUPS")),
        storage=StorageOptions(
            namespace=config.namespace,
            tp_rank=config.tp_rank,
            key_suffix=key_suffix,
            prefetch_agreement=agreement if agreement.single_rank else agreement.for_background_thread(),
        ),
        controller=controller,
        allocator=allocator,
    )
    return Built(
        core=core,
        controller=controller,
        args=args,
        kv_cache=kv_cache,
        device=device,
        host_pool=host_pool,
        storage_config=config,
        key_suffix=key_suffix,
        cp=_cp_shape(params),
        l3_format=fmt,
        backup_copy=copy,
        backend=backend,
        extra=extra,
        prefetch=prefetch,
        pass_prefix_keys=pass_keys,
    )


def _mtp_draft_pools(params: Any) -> list[tuple[DeviceKVPool, str]]:
    """``CacheInitParams.mtp_draft_device_pools`` (SGLang 0.5.20 and 0.5.23: the KV pools
    of the draft's MTP / NextN layers, which the cache itself must move with the target's
    KV; absent before 0.5.20) as hiradix pools used in place, with their SGLang class names.
    ``ValueError`` naming the field and index for a pool hiradix cannot wrap. ``O(layers)``."""
    out: list[tuple[DeviceKVPool, str]] = []
    for i, pool in enumerate(getattr(params, "mtp_draft_device_pools", None) or ()):
        name = type(pool).__name__
        try:
            out.append((device_pool_from_sglang(pool), name))
        except ValueError as e:
            raise ValueError(f"hiradix.sglang: mtp_draft_device_pools[{i}] ({name}) is not supported: {e}") from e
    return out


def _controller(
    params: Any,
    args: Any,
    device_pool: DeviceKVPool,
    host_pool: HostKVPool,
    drafts: list[tuple[DeviceKVPool, str]],
    kv_cache: Any,
    backup_copy: str | None,
) -> tuple[SGLangAgreement, SGLangCacheController]:
    """The agreement over SGLang's TP / attention-CP / PP groups and the controller
    moving KV between the pools, with the MTP draft pools following the target's KV."""
    agreement = SGLangAgreement(
        params.tp_cache_group,
        params.attn_cp_cache_group,
        params.attn_tp_cache_group,
        params.pp_cache_group,
        params.pp_rank,
        params.pp_size,
    )
    controller = SGLangCacheController(
        device_pool,
        host_pool,
        write_policy=args.hicache_write_policy,
        io_backend=args.hicache_io_backend,
        agreement=agreement,
        # On CPU pools a thread hand-off per step cost the scheduler more than the copy
        # itself (bench/RESULTS_sglang_api.md, run 9); loads keep their thread either way.
        inline_writes=backup_copy == "inline",
        sglang_pool=kv_cache,
    )
    for i, (draft, name) in enumerate(drafts):
        try:
            controller.add_draft(draft, name, params.mtp_draft_device_pools[i])
        except ValueError as e:
            raise ValueError(
                f"hiradix.sglang: mtp_draft_device_pools[{i}] ({name}) cannot follow the target's KV: {e}"
            ) from e
    return agreement, controller


def _cp_shape(params: Any) -> tuple[int, int]:
    return int(getattr(params, "attn_cp_rank", 0) or 0), int(getattr(params, "attn_cp_size", 1) or 1)


def _group_rank(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (``(0, 1)`` without one)."""
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return int(dist.get_rank(group=group)), int(dist.get_world_size(group=group))


def attention_dp_rank() -> int:
    """This rank's attention-DP rank, as SGLang's controller labels its storage metrics
    (0 without DP attention)."""
    from sglang.srt.layers import dp_attention

    if not dp_attention.is_dp_attention_enabled():
        return 0
    if hasattr(dp_attention, "get_attention_dp_rank"):  # SGLang 0.5.18 and 0.5.20
        return int(dp_attention.get_attention_dp_rank())
    from sglang.srt.runtime_context import get_parallel  # 0.5.23

    return int(get_parallel().attn_dp_rank)


def _l3_keys(params: Any, args: Any, host_pool: HostKVPool, fmt: str) -> tuple[StorageConfig, ChainSeed, str]:
    """The storage config, the tree's chain seeds and the storage-key suffix of the L3
    format ``fmt`` (the :mod:`hiradix.sglang.cache` docstring), from the same ranks and
    model name SGLang's controller gives its storage backend: the rank in
    ``tp_cache_group`` (the TP group, or the attention-TP group under DP attention),
    ``--served-model-name``."""
    tp_rank, tp_size = _group_rank(params.tp_cache_group)
    pp_rank, pp_size = int(params.pp_rank), int(params.pp_size)
    cp_rank, cp_size = _cp_shape(params)
    model = getattr(args, "served_model_name", None)
    config = StorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        model_name=model,
        is_mla_model=host_pool.is_mla,
    )
    if fmt == "sglang":
        suffix = sglang_key_suffix(
            model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            is_mla=host_pool.is_mla,
            pp_rank=pp_rank,
            pp_size=pp_size,
            cp_rank=cp_rank,
            cp_size=cp_size,
        )
        return config, lambda extra_key: None, suffix
    split = tuple(
        (name, f"{rank}/{size}")
        for name, rank, size in (("pp", pp_rank, pp_size), ("cp", cp_rank, cp_size))
        if size > 1
    )
    namespace = KeyNamespace.for_pool(
        model or getattr(args, "model_path", None) or "unnamed-model",
        host_pool,
        tp_size=tp_size,
        weight_version=str(getattr(args, "weight_version", "") or ""),
        extra=split,
    )
    root_seed, prefix = namespace.seed(), namespace.extra_key() + "\x00"

    def chain_seed(extra_key: str | None) -> str:
        # The default root's chain starts at the namespace's seed; a request
        # namespace's (extra_key, cache_salt) at a seed of both.
        return root_seed if extra_key is None else str(hiradix.namespace_seed(prefix + extra_key))

    return replace(config, namespace=namespace), chain_seed, ""
