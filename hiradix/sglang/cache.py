"""``HiRadixCache`` for SGLang: hiradix's three-tier cache behind SGLang's prefix-cache API.

A thin layer over :class:`hiradix.cache.HiRadixCache` (the "core"): it translates
SGLang's parameter and result types, requests and node objects, and nothing else. The core
runs on SGLang's own objects:

- device slots come from and go back to the scheduler's ``TokenToKVPoolAllocator`` (or
  ``PagedTokenToKVPoolAllocator``), so the scheduler's slot accounting stays true;
- loads and backups read and write the model's MHA / MLA KV buffers in place
  (:func:`~hiradix.sglang.pools.device_pool_from_sglang`);
- the host pool is sized from ``--hicache-ratio`` / ``--hicache-size`` in
  ``--hicache-mem-layout``;
- the layer-done counter has SGLang's contract, so the attention backends wait on it
  unchanged;
- every count and allocation outcome is agreed over SGLang's TP / attention-CP / PP
  groups (:class:`~hiradix.sglang.distributed.SGLangAgreement`);
- with ``enable_kv_cache_events`` it emits SGLang's ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared`` events with SGLang's block ids (:mod:`hiradix.sglang.events`);
- a speculative decoding draft's KV pools (0.5.18's ``set_draft_kv_pool``; 0.5.20's and
  0.5.23's ``CacheInitParams.mtp_draft_device_pools``) are moved with the target's KV at
  the same slots on every backup and load (:meth:`SGLangCacheController.add_draft`);
- with ``is_eagle`` keys are EAGLE bigrams, as SGLang's: bigram ``i`` of a key is
  ``(t[i], t[i+1])``, so ``n + 1`` tokens make ``n`` bigrams and ``n`` device slots. The
  tree stores bigram ``i`` as its second token ``t[i+1]`` in a namespace of the key's first
  token: two keys share ``k`` bigrams exactly when they share ``t[0]`` and ``t[1..k]``, so
  prefix lengths, splits, pages and device slots are SGLang's, on the tree's int32 tokens.

L3 page format (``"l3_format"`` in ``--hicache-storage-backend-extra-config``):

``"hiradix"`` (default)
    Namespaced keys: every hash chain is seeded from the model (``--served-model-name``),
    ``--weight-version``, KV dtype, page byte layout, KV shape and TP/PP/CP shape, and a
    request's ``extra_key`` / ``cache_salt`` seed its own chain on top, so no other
    model's, version's or tenant's pages are ever served; MHA ranks under TP add
    ``_r{rank}``. Pages are hiradix's byte order (zero copy for page-first layouts).
``"sglang"``
    SGLang 0.5.18's keys and pages exactly: the token-only ``get_hash_str`` chain in every
    namespace (as SGLang, requests with other ``extra_key`` / ``cache_salt`` share L3
    pages of equal tokens, though never tree nodes), ``HiCacheFile``'s model and rank
    suffix (:func:`~hiradix.storage.keys.sglang_key_suffix`) and SGLang's flat host page
    for the layout, so this node and stock SGLang nodes of the same model, layout and
    parallel shape read each other's pages from one L3 (stock SGLang loads hiradix's
    backends through :mod:`hiradix.sglang.storage`).

Backup copies on CPU pools (``"backup_copy"`` in the extra config): ``"inline"`` (default)
copies a step's backups on the scheduler thread when they start, as SGLang does;
``"thread"`` hands them to a copy thread, which only pays off for a lot of KV per step.
Refused for GPU pools, whose copies run on a CUDA stream.

Options this adapter does not support are refused at start-up with the option named
(:func:`check_supported`), never silently ignored.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

import hiradix
from hiradix import envvars
from hiradix._native import load
from hiradix.cache import HiRadixCache as CoreCache
from hiradix.cache import StorageOptions, TierOptions, TreeOptions
from hiradix.cache.controller import HiCacheController
from hiradix.cache.l3 import PREFETCH_POLICIES, PrefetchConfig
from hiradix.memory.pools import DeviceKVPool, HostKVPool
from hiradix.sglang.distributed import SGLangAgreement
from hiradix.sglang.foreign import SGLangBackend, is_sglang_backend
from hiradix.sglang.metrics import MetricsReporter
from hiradix.sglang.nodes import TreeNode
from hiradix.sglang.pools import device_pool_from_sglang, host_pool_for
from hiradix.sglang.storage import native_backend
from hiradix.storage.base import StorageBackend, StorageConfig
from hiradix.storage.keys import KeyNamespace, sglang_key_suffix
from hiradix.storage.registry import StorageConfigError, create_backend
from hiradix.tree import NO_NODE
from hiradix.tree.policy import WRITE_POLICIES, policy_names

if TYPE_CHECKING:
    from hiradix.sglang.events import KVEventLog

__all__ = ["L3_FORMATS", "HiRadixCacheBase", "SGLangCacheController", "check_supported", "parse_extra_config"]

logger = logging.getLogger(__name__)

L3_FORMATS = ("hiradix", "sglang")
_EMPTY = torch.empty(0, dtype=torch.int64)
_EMPTY_NP = np.empty(0, dtype=np.int64)


class DraftLayerWait:
    """The layer counter a draft model's KV pool waits on: any draft layer is usable once
    the target's first layer is, because the draft's copies are submitted before the
    target's on the same engine (:meth:`HiCacheController.add_companion`). A draft's layer
    ids need not lie in the target's range (EAGLE-3 and MTP drafts number theirs after the
    target's), so the wait is for layer 0, whatever layer the pool asks for."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    @property
    def consumer_index(self) -> int:
        return int(self._counter.consumer_index)

    def wait_until(self, threshold: int, timeout: float | None = None) -> None:
        self._counter.wait_until(0, timeout)


def register_layer_wait(sglang_pool: Any, counter: Any) -> None:
    """Make SGLang's KV pool wait on ``counter`` before its attention reads a layer, as
    SGLang's own ``HiCacheController`` does at start-up
    (``mem_pool_device.register_layer_transfer_counter``): the pool's ``get_key_buffer`` /
    ``get_value_buffer`` wait for the layer only when a counter is registered, and without
    it the forward pass reads slots a load is still filling (wrong outputs). ``TypeError``
    for a pool without the hook, rather than a cache that serves unloaded KV."""
    register = getattr(sglang_pool, "register_layer_transfer_counter", None)
    if register is None:
        raise TypeError(
            f"hiradix.sglang: {type(sglang_pool).__name__} has no register_layer_transfer_counter; "
            "its attention could read KV before a load from host finishes"
        )
    register(counter)


class SGLangCacheController(HiCacheController):
    """The core's controller with the names SGLang's scheduler and metrics read from
    ``tree_cache.cache_controller``: ``mem_pool_host``, ``mem_pool_device``,
    ``write_policy``, ``io_backend``, ``page_size``, ``storage_backend``,
    ``storage_backend_type``, ``layer_done_counter`` and ``reset``.

    ``sglang_pool`` is SGLang's device KV pool that ``device_pool`` wraps: the layer-done
    counter is registered with it here (:func:`register_layer_wait`), as SGLang's
    controller registers its own, so every way of building the cache (the plugin's factory,
    a fork's ``HiRadixCache(params, server_args)``) makes attention wait for loads."""

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        write_policy: str,
        io_backend: str,
        sglang_pool: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device_pool, host_pool, **kwargs)
        self.write_policy = write_policy
        self.io_backend = io_backend
        self.page_size = device_pool.page_size
        self.storage_backend_type: str | None = None
        #: The attached L3 backend (SGLang reads its class name for metrics and the
        #: ``cached_tokens_details`` of a request, and 0.5.23's scheduler its layout).
        self.storage_backend: Any = None
        if sglang_pool is not None:
            register_layer_wait(sglang_pool, self.layer_done_counter)

    @property
    def mem_pool_host(self) -> HostKVPool:
        return self.host_pool

    @property
    def mem_pool_device(self) -> DeviceKVPool:
        return self.device_pool

    # SGLang's scheduler sets both to the model runner's forward stream at start-up (0.5.20
    # and 0.5.23): the copy engines then also wait for that stream before each operation.
    @property
    def load_fence_stream(self) -> Any:
        return self.load_engine.fence_stream

    @load_fence_stream.setter
    def load_fence_stream(self, stream: Any) -> None:
        self.load_engine.fence_stream = stream

    @property
    def write_fence_stream(self) -> Any:
        return self.write_engine.fence_stream

    @write_fence_stream.setter
    def write_fence_stream(self, stream: Any) -> None:
        self.write_engine.fence_stream = stream

    @property
    def has_draft(self) -> bool:
        """Whether a draft model's KV pool follows the target's (:meth:`set_draft_kv_pool`)."""
        return bool(self.companions)

    def set_draft_kv_pool(self, draft_device_pool: Any, draft_host_pool: Any = None) -> None:
        """SGLang 0.5.18's hook for speculative decoding with a separate draft model, whose
        KV pool is indexed by the target's token slots: from now on every backup and load
        also moves the draft's KV at the same slots (:meth:`add_draft`).

        SGLang's own ``draft_host_pool`` is not kept (hiradix's engines copy between
        hiradix pools; it is freed when SGLang drops it). ``ValueError`` for a draft pool
        kind hiradix cannot wrap. ``O(draft host pool)`` to allocate.
        """
        self.add_draft(device_pool_from_sglang(draft_device_pool), type(draft_device_pool).__name__, draft_device_pool)

    def add_draft(self, device: DeviceKVPool, name: str, sglang_pool: Any = None) -> None:
        """Make ``device`` (a draft model's KV, indexed by the target's token slots) follow
        the target's KV: a hiradix host pool with the target host pool's slots and layout
        is its L2 copy, and every later backup and load moves it at the same slots,
        submitted before the target's on the same engine, so the layer-done counter never
        reports a target layer before the draft's KV is in place (:meth:`add_companion`).
        L3 carries the target's KV only (:meth:`warn_draft_l3`). ``ValueError`` when the
        draft's page size or slot count differs from the target's. ``name`` is for the
        log; ``sglang_pool``, SGLang's pool that ``device`` wraps, gets a layer wait
        (:class:`DraftLayerWait`). ``O(draft host pool)`` to allocate."""
        host = HostKVPool(
            device.shape,
            self.host_pool.size,
            device.page_size,
            device.dtype,  # type: ignore[arg-type]
            self.host_pool.layout,
        )
        self.add_companion(device, host)
        if sglang_pool is not None:  # SGLang's pool ``device`` wraps: its attention waits too
            register_layer_wait(sglang_pool, DraftLayerWait(self.layer_done_counter))
        logger.info("hiradix: draft KV pool registered (%s, %d host slots)", name, host.size)
        self.warn_draft_l3()

    def warn_draft_l3(self) -> None:
        """Log, when there is both a draft pool and an L3, that L3 stores the target's KV
        only (as SGLang 0.5.18 for every storage backend but Mooncake; SGLang 0.5.20's and
        0.5.23's packed MTP pages carry the draft layers): a page loaded from L3 leaves
        the draft's KV of its slots stale, which can lower the draft's acceptance rate but
        never changes the target's output (it verifies every drafted token). ``O(1)``."""
        if self.has_draft and self.storage_backend_type is not None:
            logger.warning(
                "hiradix: L3 (%s) stores the target's KV only; the draft's KV of pages loaded from L3 "
                "is stale (draft acceptance may drop, outputs do not change)",
                self.storage_backend_type,
            )

    def reset(self) -> None:
        """Forget the layer-done indices (the cache's reset has already drained copies)."""
        self.layer_done_counter.reset()


def parse_extra_config(source: str | None) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` to a JSON,
    TOML or YAML file, as SGLang 0.5.18 reads it. Raises ``ValueError`` naming the option."""
    if not source:
        return {}
    opt = "--hicache-storage-backend-extra-config"
    try:
        if source.startswith("@"):
            path = source[1:]
            ext = os.path.splitext(path)[1].lower()
            if ext == ".json":
                with open(path) as f:
                    data = json.load(f)
            elif ext == ".toml":
                if sys.version_info >= (3, 11):
                    import tomllib
                else:  # pragma: no cover - Python 3.10 (pyproject.toml installs tomli there)
                    import tomli as tomllib

                with open(path, "rb") as f:
                    data = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml

                with open(path) as f:
                    data = yaml.safe_load(f)
            else:
                raise ValueError(f"unsupported config file type {ext!r} (use .json, .toml or .yaml)")
        else:
            data = json.loads(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"{opt}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{opt} must be an object, got {type(data).__name__}")
    return data


def _prefetch_config(extra: dict[str, Any], policy: str) -> tuple[PrefetchConfig, bool]:
    """Pop SGLang's prefetch keys from ``extra`` (threshold in tokens, linear timeout, and
    whether prefix keys are passed to the backend) into a :class:`PrefetchConfig`."""
    defaults = PrefetchConfig()  # SGLang's defaults: 256 tokens, 2 s + 0.1 s per Ki token, at most 30 s
    threshold = extra.pop("prefetch_threshold", defaults.threshold_tokens)
    base = extra.pop("prefetch_timeout_base", defaults.timeout_base_s)
    per_ki = extra.pop("prefetch_timeout_per_ki_token", defaults.timeout_per_ki_token_s)
    tmax = extra.pop("prefetch_timeout_max", defaults.timeout_max_s)
    pass_keys = extra.pop("hicache_storage_pass_prefix_keys", False)
    if not isinstance(threshold, int) or isinstance(threshold, bool):
        raise ValueError(f"prefetch_threshold must be an int, got {threshold!r}")
    for name, v in (
        ("prefetch_timeout_base", base),
        ("prefetch_timeout_per_ki_token", per_ki),
        ("prefetch_timeout_max", tmax),
    ):
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ValueError(f"{name} must be a number, got {v!r}")
    if not isinstance(pass_keys, bool):
        raise ValueError(f"hicache_storage_pass_prefix_keys must be a bool, got {pass_keys!r}")
    cfg = PrefetchConfig(
        policy=policy,
        threshold_tokens=threshold,
        timeout_base_s=float(base),
        timeout_per_ki_token_s=float(per_ki),
        timeout_max_s=float(tmax),
    )
    return cfg, pass_keys


def _l3_format(extra: dict[str, Any]) -> str:
    """Pop ``l3_format`` from the extra config (default ``"hiradix"``)."""
    fmt = extra.pop("l3_format", "hiradix")
    if fmt not in L3_FORMATS:
        raise ValueError(f"l3_format must be one of {L3_FORMATS}, got {fmt!r}")
    return str(fmt)


BACKUP_COPIES = ("inline", "thread")


def _backup_copy(extra: dict[str, Any], device: torch.device) -> str | None:
    """Pop ``backup_copy`` from the extra config: how backups are copied between CPU pools.
    ``"inline"`` (the default there) copies on the scheduler thread when a step's backups
    start, as SGLang copies; ``"thread"`` hands them to a copy thread. ``None`` for device
    pools on a GPU, whose copies are kernels on a stream; naming the key there is refused."""
    mode = extra.pop("backup_copy", None)
    if device.type != "cpu":
        if mode is not None:
            raise ValueError(f"backup_copy applies to CPU device pools only; these are on {device}")
        return None
    mode = "inline" if mode is None else mode
    if mode not in BACKUP_COPIES:
        raise ValueError(f"backup_copy must be one of {BACKUP_COPIES}, got {mode!r}")
    return str(mode)


def _group_rank(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (``(0, 1)`` without one)."""
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return int(dist.get_rank(group=group)), int(dist.get_world_size(group=group))


def _attention_dp_rank() -> int:
    """This rank's attention-DP rank, as SGLang's controller labels its storage metrics
    (0 without DP attention)."""
    from sglang.srt.layers import dp_attention

    if not dp_attention.is_dp_attention_enabled():
        return 0
    if hasattr(dp_attention, "get_attention_dp_rank"):  # SGLang 0.5.18 and 0.5.20
        return int(dp_attention.get_attention_dp_rank())
    from sglang.srt.runtime_context import get_parallel  # 0.5.23

    return int(get_parallel().attn_dp_rank)


def check_supported(params: Any, server_args: Any) -> None:
    """Refuse, naming the option, what this adapter does not do (yet), instead of
    falling back silently."""

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"hiradix.sglang: {option} is not supported: {why}")

    if getattr(params, "cache_ttl_seconds", None):
        refuse("cache TTL", "hiradix evicts by policy only")
    if getattr(params, "enable_session_radix_cache", False):
        refuse("--enable-session-radix-cache", "it needs UnifiedRadixCache")
    if getattr(params, "sliding_window_size", None):
        refuse("sliding-window (SWA) models", "hiradix caches full-attention KV only")
    write = getattr(server_args, "hicache_write_policy", "write_through")
    if write not in WRITE_POLICIES:
        refuse(f"--hicache-write-policy {write!r}", f"use one of {WRITE_POLICIES}")
    policy = str(params.eviction_policy).lower()
    if policy not in policy_names():  # the registry: a policy added with register_policy is taken
        refuse(f"--radix-eviction-policy {policy!r}", f"use one of {tuple(policy_names())}")
    prefetch = getattr(server_args, "hicache_storage_prefetch_policy", "best_effort")
    if prefetch not in PREFETCH_POLICIES:
        refuse(f"--hicache-storage-prefetch-policy {prefetch!r}", f"use one of {PREFETCH_POLICIES}")
    io = getattr(server_args, "hicache_io_backend", "direct")
    if io not in ("direct", "kernel"):
        refuse(f"--hicache-io-backend {io!r}", "hiradix copies with its own engines (direct or kernel)")


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


def _as_tokens(token_ids: Any) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_ids
    if isinstance(token_ids, array) and token_ids.typecode in ("q", "l") and token_ids.itemsize == 8:
        return np.frombuffer(token_ids, np.int64)
    if isinstance(token_ids, torch.Tensor):
        return token_ids.cpu().numpy()
    return np.asarray(token_ids, dtype=np.int64)


def _raw_tokens(key: Any) -> np.ndarray:
    """A ``RadixKey``'s tokens (its ``limit`` applied) as an int64 array, a view where it
    can be: ``raw_token_ids()`` copies a capped key and costs a few calls per match."""
    tokens = _as_tokens(key.token_ids)
    limit = key.limit
    return tokens if limit is None or limit >= len(tokens) else tokens[:limit]


def _key_tokens(key: Any) -> np.ndarray | array:
    """The tokens of a plain key (:func:`_raw_tokens`), or the scheduler's ``array('q')``
    itself when no ``limit`` cuts it (the tree reads it in place; it is not to be
    modified). A bigram key reaching a cache built without ``is_eagle`` is an error, not
    a silent mismatch."""
    if key.is_bigram:
        raise ValueError("a bigram (EAGLE) key reached a cache built without is_eagle")
    ids = key.token_ids
    if type(ids) is array and ids.typecode == "q":  # the scheduler's keys: no call chain
        limit = key.limit
        if limit is None or limit >= len(ids):
            return ids
        return np.frombuffer(ids, np.int64)[:limit]
    return _raw_tokens(key)


def namedtuple_tail(cls: type, head: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The defaults of the fields after ``head`` of SGLang's ``MatchResult`` (a
    ``NamedTuple``), when its first fields are ``head`` and all the others have defaults;
    else ``None``. Its generated ``__new__`` fills those defaults with a Python-level call
    on every match: with the tail at hand, a match builds the tuple directly,
    ``tuple.__new__(cls, head_values + tail)``."""
    fields = getattr(cls, "_fields", ())
    defaults = getattr(cls, "_field_defaults", {})
    if not issubclass(cls, tuple) or tuple(fields[: len(head)]) != head:
        return None
    if not all(f in defaults for f in fields[len(head) :]):
        return None
    return tuple(defaults[f] for f in fields[len(head) :])


def _head(tokens: np.ndarray | array, n: int) -> np.ndarray:
    """The first ``n`` tokens, as a view (an ``array('q')`` slice would copy)."""
    if isinstance(tokens, array):
        return np.frombuffer(tokens, np.int64)[:n]
    return tokens[:n]


class HiRadixCacheBase(BasePrefixCache):
    """SGLang's ``HiRadixCache``, on hiradix's compiled tree and tiers: everything but the
    request API, which changed between SGLang releases. The class to build is
    :data:`hiradix.sglang.HiRadixCache`, this base's subclass for the installed SGLang
    (:mod:`hiradix.sglang.api`): ``cache_finished_req`` / ``cache_unfinished_req`` up to
    0.5.18 (:mod:`hiradix.sglang.api_v18`), ``checkpoint`` / ``lock`` /
    ``path_device_indices`` on 0.5.23 (:mod:`hiradix.sglang.api_v23`).

    Built as SGLang's scheduler builds its own: ``HiRadixCache(params, server_args)`` with
    ``CacheInitParams`` and ``ServerArgs``. Reads the same options as SGLang 0.5.18:
    ``--hicache-ratio`` / ``--hicache-size``, ``--hicache-mem-layout``,
    ``--hicache-write-policy``, ``--hicache-io-backend``, ``--hicache-storage-backend``
    (hiradix's ``memory``, ``file``, ``peer``, ``mooncake``; SGLang's own by name or as
    ``sglang:NAME``, see :mod:`hiradix.sglang.foreign`; or ``dynamic``) with
    ``--hicache-storage-backend-extra-config`` (JSON or ``@file``; ``prefetch_threshold``,
    ``prefetch_timeout_*``, ``hicache_storage_pass_prefix_keys``, and hiradix's
    ``l3_format``: the module docstring), ``--hicache-storage-prefetch-policy`` and
    ``--radix-eviction-policy``.

    Single-threaded, like the scheduler that calls it.
    """

    def __init__(self, params: Any, server_args: Any) -> None:
        check_supported(params, server_args)
        self._read_params(params)
        self._init_metrics(params, server_args)
        extra, prefetch = self._read_options(params, server_args)
        device_pool, drafts, self.token_to_kv_pool_host = self._build_pools(params, server_args)
        chain_seed = self._init_l3_keys(params, server_args)
        agreement, controller = self._build_controller(params, server_args, device_pool, drafts)
        backend = getattr(server_args, "hicache_storage_backend", None)
        self.core = self._build_core(
            device_pool, controller, agreement, chain_seed, backend, params.token_to_kv_pool_allocator
        )
        self._init_tree(device_pool, controller)
        self.enable_storage = False
        if backend is not None:
            self._attach(backend, extra, prefetch)
        self._init_kv_events(params)
        self._install_matcher()
        self._install_inserter()
        atexit.register(self.shutdown)

    def _read_params(self, params: Any) -> None:
        """The ``CacheInitParams`` fields this cache keeps as SGLang's own does."""
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.is_eagle = params.is_eagle
        self.enable_kv_cache_events = params.enable_kv_cache_events
        # SGLang 0.5.23 has dropped the option (and with it the field).
        self.disable_finished_insert = bool(getattr(params, "disable_finished_insert", False))
        self.eviction_policy = str(params.eviction_policy).lower()
        self._bigram = 1 if self.is_eagle else 0  # tokens a key has beyond its slots
        self.pp_rank, self.pp_size = params.pp_rank, params.pp_size

    def _init_metrics(self, params: Any, server_args: Any) -> None:
        """SGLang's metrics collector and hiradix's reporter into it, with ``--enable-metrics``,
        and the labels (attention-DP rank, ``extra_metric_labels``) of an L3's metrics (:meth:`_attach`)."""
        self.metrics_collector = None
        self.metrics: MetricsReporter | None = None
        self._dp_rank = _attention_dp_rank()
        self._extra_metric_labels = getattr(server_args, "extra_metric_labels", None)
        if params.enable_metrics:
            self.init_metrics_collector()
            self.metrics = MetricsReporter(self.metrics_collector)

    def _read_options(self, params: Any, server_args: Any) -> tuple[dict[str, Any], PrefetchConfig]:
        """The KV pools' device, and ``--hicache-storage-backend-extra-config`` with
        ``--hicache-storage-prefetch-policy``: sets the options hiradix reads from them and
        returns what is left of the extra config (for the backend) and the prefetch config."""
        allocator = params.token_to_kv_pool_allocator
        self.kv_cache = allocator.get_kvcache()
        self.device = torch.device(allocator.device)
        self._on_cpu = self.device.type == "cpu"
        extra = parse_extra_config(getattr(server_args, "hicache_storage_backend_extra_config", None))
        prefetch, self.hicache_storage_pass_prefix_keys = _prefetch_config(
            extra, getattr(server_args, "hicache_storage_prefetch_policy", "best_effort")
        )
        self.l3_format = _l3_format(extra)
        self.backup_copy = _backup_copy(extra, self.device)
        if self.l3_format == "sglang" and self.is_eagle:
            # The tree keeps an EAGLE key's bigrams as their second tokens: token-only chains
            # of those would name another request's pages in a shared L3 (a plain key of the
            # same tokens without the first), so that pairing is refused, never served.
            raise ValueError(
                "--hicache-storage-backend-extra-config l3_format 'sglang' is not supported with EAGLE "
                "(bigram keys); use the default l3_format 'hiradix'"
            )
        return extra, prefetch

    def _build_pools(
        self, params: Any, server_args: Any
    ) -> tuple[DeviceKVPool, list[tuple[DeviceKVPool, str]], HostKVPool]:
        """The device pool over SGLang's KV buffers, the MTP draft pools
        (:func:`_mtp_draft_pools`) and the host pool (allocated here) sized from
        ``--hicache-ratio`` / ``--hicache-size`` in ``--hicache-mem-layout``."""
        device_pool = device_pool_from_sglang(self.kv_cache, self.page_size)  # checked against params.page_size
        drafts = _mtp_draft_pools(params)
        host_pool = host_pool_for(
            device_pool,
            # SGLang 0.5.20 and 0.5.23 pack MTP draft layers into the target's host pages, so a
            # --hicache-size budget holds fewer slots with drafts; hiradix's draft host pools
            # (the target's slots each) are counted against it the same way.
            extra_bytes_per_token=sum(d.bytes_per_token for d, _ in drafts),
            ratio=float(getattr(server_args, "hicache_ratio", None) or 2.0),  # SGLang's default when unset
            size_gb=float(getattr(server_args, "hicache_size", 0) or 0),
            layout=server_args.hicache_mem_layout,
            page_order="sglang" if self.l3_format == "sglang" else "hiradix",
        )
        return device_pool, drafts, host_pool

    def _init_l3_keys(self, params: Any, server_args: Any) -> Callable[[str | None], str | None]:
        """:attr:`storage_config`, the key suffix of hiradix's own backends and the
        attention-CP shape (:meth:`_l3_keys`); returns the tree's chain seeds."""
        self.storage_config, chain_seed, key_suffix = self._l3_keys(params, server_args, self.token_to_kv_pool_host)
        self._key_suffix = key_suffix  # what hiradix's own backends get appended to each key
        self._cp = (int(getattr(params, "attn_cp_rank", 0) or 0), int(getattr(params, "attn_cp_size", 1) or 1))
        return chain_seed

    def _build_controller(
        self, params: Any, server_args: Any, device_pool: DeviceKVPool, drafts: list[tuple[DeviceKVPool, str]]
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
            self.token_to_kv_pool_host,
            write_policy=server_args.hicache_write_policy,
            io_backend=server_args.hicache_io_backend,
            agreement=agreement,
            # On CPU pools a thread hand-off per step cost the scheduler more than the copy
            # itself (bench/RESULTS_sglang_api.md, run 9); loads keep their thread either way.
            inline_writes=self.backup_copy == "inline",
            sglang_pool=self.kv_cache,
        )
        for i, (draft, name) in enumerate(drafts):
            try:
                controller.add_draft(draft, name, params.mtp_draft_device_pools[i])
            except ValueError as e:
                raise ValueError(
                    f"hiradix.sglang: mtp_draft_device_pools[{i}] ({name}) cannot follow the target's KV: {e}"
                ) from e
        return agreement, controller

    def _build_core(
        self,
        device_pool: DeviceKVPool,
        controller: SGLangCacheController,
        agreement: SGLangAgreement,
        chain_seed: Callable[[str | None], str | None],
        backend: str | None,
        allocator: Any,
    ) -> CoreCache:
        """The core cache on the pools and ``controller``, with slots from SGLang's ``allocator``."""
        return CoreCache(
            device_pool,
            self.token_to_kv_pool_host,
            tree=TreeOptions(
                eviction_policy=self.eviction_policy,
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
                namespace=self.storage_config.namespace,
                tp_rank=self.storage_config.tp_rank,
                key_suffix=self._key_suffix,
                prefetch_agreement=agreement if agreement.single_rank else agreement.for_background_thread(),
            ),
            controller=controller,
            allocator=allocator,
        )

    def _init_tree(self, device_pool: DeviceKVPool, controller: SGLangCacheController) -> None:
        """The core's tree and root as SGLang names them, and the request namespaces' maps."""
        self.tree = self.core.tree
        # The tree's token and slot buffers (12 bytes a token) are sized and touched now
        # for the device pool's tokens, the least a full cache holds: the scheduler's
        # inserts then fill a new cache without taking the kernel's first-touch faults
        # (huge pages zeroed, sometimes compacted first), which made a fresh cache's
        # insert 0.70x of 9cc467d's, where the reserve covered device and host
        # (bench/RESULTS_sglang_api.md, issue 47). Past the device pool's tokens (host-only
        # ones) they grow as tokens are cached, doubling a mapping and touching only what
        # is written: not the 20 bytes for every device and host slot of 9cc467d's reserve
        # (bench/RESULTS_memory.md). Evict's device indices go into a reused buffer (made
        # at the first evict, grown to the largest eviction), whose faults an evict-all of
        # a million tokens would otherwise take every time (3-40 ms, against 2 ms to evict).
        self.tree.reserve_tokens(device_pool.size, evict_tokens=device_pool.size)
        self.cache_controller = controller
        self.root_handle = int(self.tree.root)
        self.root_node = TreeNode(self, self.root_handle)
        self._namespaces: dict[str, int] = {}  # namespace -> its root's handle
        self._ns_by_root: dict[int, str] = {}  # and back
        # root handle -> (extra_key, cache_salt, first token of a bigram namespace)
        self._ns_parts: dict[int, tuple[str | None, str | None, int | None]] = {}
        self.load_back_threshold = self.core.load_back_threshold

    def _init_kv_events(self, params: Any) -> None:
        """With ``enable_kv_cache_events``, the log of SGLang's KV events
        (:mod:`hiradix.sglang.events`)."""
        # KV events come from the tree's change log, which is on only with them. Imported
        # here: the module loads SGLang's event classes, needed only with events on.
        self._events: KVEventLog | None = None
        if self.enable_kv_cache_events:
            from hiradix.sglang.events import KVEventLog

            self._events = KVEventLog(self, params)

    def _install_matcher(self) -> None:
        """Put the compiled ``match_prefix`` (:mod:`hiradix.sglang._match`) in front of the
        method, on this instance, where it applies: built (not ``HIRADIX_PUREPYTHON``), no
        EAGLE bigrams, the subclass keeps this class's method, and the installed SGLang's
        ``MatchResult`` is as :meth:`_compiled_match_spec` expects. It serves plain keys
        and hands every other to the method; the results are the same."""
        compiled = load("hiradix.sglang._match")
        spec = self._compiled_match_spec()
        if compiled is None or spec is None or self.is_eagle or not compiled.applies_to(self.tree):
            return
        if type(self).match_prefix is not HiRadixCacheBase.match_prefix:
            return  # a subclass's own match_prefix is the one to call
        wrap, result, tail = spec
        # An instance attribute, looked up before the class's method (which mypy does not
        # let one assign to): the scheduler's call then goes straight to C.
        self.__dict__["match_prefix"] = compiled.Matcher(
            self, HiRadixCacheBase.match_prefix, TreeNode, wrap, result, tail
        )

    def _install_inserter(self) -> None:
        """Put the compiled ``insert`` (:mod:`hiradix.sglang._insert`) in front of the
        method, on this instance, where it applies: built (not ``HIRADIX_PUREPYTHON``), no
        EAGLE bigrams, and the subclass keeps this class's method. It serves the
        scheduler's calls (plain tokens, CPU slots, no KV events) and hands every other to
        the method; the cache ends in the same state either way."""
        self._inserter: Any = None  # also serves 0.5.23's checkpoint (api_v23.py)
        compiled = load("hiradix.sglang._insert")
        if compiled is None or self.is_eagle or not compiled.applies_to(self.tree):
            return
        if type(self).insert is not HiRadixCacheBase.insert:
            return  # a subclass's own insert is the one to call
        self._inserter = self.__dict__["insert"] = compiled.Inserter(
            self, HiRadixCacheBase.insert, InsertResult, torch.Tensor, torch.int64, torch.int32
        )

    def _compiled_match_spec(self) -> tuple[Callable[[np.ndarray], Any], type, tuple[Any, ...]] | None:
        """``(wrap, MatchResult, tail)`` for the compiled matcher: the result's first field
        from the matched device slots, SGLang's result type and the defaults of its fields
        after the first five (:func:`namedtuple_tail`); ``None`` where only the Python
        method may serve. The subclass for the installed SGLang knows which."""
        return None

    def _l3_keys(
        self, params: Any, server_args: Any, host_pool: HostKVPool
    ) -> tuple[StorageConfig, Callable[[str | None], str | None], str]:
        """The storage config, the tree's chain seeds and the storage-key suffix of
        :attr:`l3_format` (module docstring), from the same ranks and model name SGLang's
        controller gives its storage backend: the rank in ``tp_cache_group`` (the TP
        group, or the attention-TP group under DP attention), ``--served-model-name``."""
        tp_rank, tp_size = _group_rank(params.tp_cache_group)
        pp_rank, pp_size = int(params.pp_rank), int(params.pp_size)
        cp_rank, cp_size = int(getattr(params, "attn_cp_rank", 0) or 0), int(getattr(params, "attn_cp_size", 1) or 1)
        model = getattr(server_args, "served_model_name", None)
        config = StorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            model_name=model,
            is_mla_model=host_pool.is_mla,
        )
        if self.l3_format == "sglang":
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
            model or getattr(server_args, "model_path", None) or "unnamed-model",
            host_pool,
            tp_size=tp_size,
            weight_version=str(getattr(server_args, "weight_version", "") or ""),
            extra=split,
        )
        root_seed, prefix = namespace.seed(), namespace.extra_key() + "\x00"

        def chain_seed(extra_key: str | None) -> str:
            # The default root's chain starts at the namespace's seed; a request
            # namespace's (extra_key, cache_salt) at a seed of both.
            return root_seed if extra_key is None else str(hiradix.namespace_seed(prefix + extra_key))

        return replace(config, namespace=namespace), chain_seed, ""

    # ------------------------------------------------------------------ nodes and keys
    def node_view(self, handle: int) -> TreeNode:
        """The SGLang-facing view (:class:`~hiradix.sglang.nodes.TreeNode`) of tree node ``handle``."""
        return TreeNode(self, handle)

    def _handle(self, node: Any) -> int:
        if not isinstance(node, TreeNode) or not node.belongs_to(self):
            raise TypeError(f"expected a node of this cache, got {node!r}")
        return node.id

    @staticmethod
    def _namespace(extra_key: str | None, cache_salt: str | None, first: int | None = None) -> str | None:
        """The tree namespace of a request: SGLang keeps entries with different
        ``extra_key`` or ``cache_salt`` disjoint, and so does this (one name for the pair).
        Bigram keys add their first token (see the module docstring)."""
        if first is not None:
            return json.dumps([extra_key, cache_salt, first])
        if extra_key is None and cache_salt is None:
            return None
        return json.dumps([extra_key, cache_salt])

    def _ns(self, extra_key: str | None, cache_salt: str | None, first: int | None = None) -> str | None:
        ns = self._namespace(extra_key, cache_salt, first)
        if ns is not None and ns not in self._namespaces:
            root = int(self.tree.namespace_root(ns))
            self._namespaces[ns] = root
            self._ns_by_root[root] = ns
            self._ns_parts[root] = (extra_key, cache_salt, first)
        return ns

    def namespace_parts(self, root: int) -> tuple[str | None, str | None, int | None]:
        """``(extra_key, cache_salt, first token)`` of the namespace whose root is
        ``root`` (the first token only for bigram keys; all ``None`` for the global
        root). ``O(1)``."""
        return self._ns_parts.get(root, (None, None, None))

    def _bigram_key(self, key: Any) -> tuple[str | None, np.ndarray, np.ndarray]:
        """A key read as EAGLE bigrams: its tree namespace, the tree's tokens (bigram
        ``i`` as ``t[i+1]``, not page aligned) and the raw tokens. A key of fewer than two
        tokens has no bigram. ``O(1)`` (views) plus a namespace's creation."""
        raw = _raw_tokens(key)
        if len(raw) < 2:
            return self._ns(key.extra_key, key.cache_salt), raw[:0], raw
        return self._ns(key.extra_key, key.cache_salt, int(raw[0])), raw[1:], raw

    def namespace_roots(self) -> dict[str, int]:
        """``{namespace: root handle}`` of the namespaces in use. ``O(namespaces)``."""
        return dict(self._namespaces)

    def _namespace_of(self, handle: int) -> str | None:
        """The namespace whose tree holds ``handle``. ``O(depth)``."""
        tree = self.tree
        root = handle
        while (parent := tree.parent(root)) != NO_NODE:
            root = parent
        return self._ns_by_root.get(root)

    def node_tokens(self, handle: int) -> np.ndarray:
        """A node's key tokens as SGLang holds them: with bigram keys, the token before
        the node (its parent's last, or the namespace's first) comes first."""
        tree = self.tree
        key = tree.key(handle).astype(np.int64)
        parent = tree.parent(handle)
        if not self.is_eagle or parent == NO_NODE:
            return key
        prev = self.namespace_parts(parent)[2] if tree.parent(parent) == NO_NODE else int(tree.key(parent)[-1])
        return np.concatenate((np.array([prev], dtype=np.int64), key))

    def node_radix_key(self, handle: int) -> Any:
        """Node ``handle``'s key as SGLang's ``RadixKey`` (its tokens, namespace and bigram flag)."""
        ns = self._namespace_of(handle)
        extra_key, cache_salt = (None, None) if ns is None else json.loads(ns)[:2]
        tokens = array("q", self.node_tokens(handle).tobytes())
        return RadixKey(tokens, extra_key, is_bigram=self.is_eagle and len(tokens) > 0, cache_salt=cache_salt)

    def is_root(self, node: Any) -> bool:
        return self.tree.parent(self._handle(node)) == NO_NODE

    def is_evicted(self, handle: int) -> bool:
        return bool(self.tree.is_evicted(handle))

    def is_backed_up(self, handle: int) -> bool:
        """Whether the node's KV is on the host; a root counts as backed up (SGLang's root
        has an empty host value), so walks up to a backed-up node end there."""
        tree = self.tree
        return bool(tree.is_root(handle) or tree.is_backed_up(handle))

    def is_backuped(self, node: Any) -> bool:
        return self.is_backed_up(self._handle(node))

    def get_last_hash_value(self, node: Any) -> str | None:
        return node.get_last_hash_value()

    def get_prefix_hash_values(self, node: Any) -> list[str]:
        """Page hashes from the root down to ``node``'s parent (SGLang 0.5.18 base's
        definition; 0.5.23's scheduler calls it without the base defining it). ``O(depth)``."""
        return node.get_prefix_hash_values(node.parent)

    # SGLang's scheduler reads these to tell whether the cache is idle (before a flush or
    # a storage attach / detach): the core's in-flight operations.
    @property
    def ongoing_write_through(self) -> dict[int, Any]:
        return self.core.ongoing_write_through

    @property
    def ongoing_load_back(self) -> dict[int, Any]:
        return self.core.ongoing_load_back

    @property
    def ongoing_prefetch(self) -> dict[Any, Any]:
        return self.core.storage.ongoing_prefetch

    @property
    def ongoing_backup(self) -> list[Any]:
        return self.core.storage.ongoing_backup

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return int(self.tree.evictable_size())

    def protected_size(self) -> int:
        return int(self.tree.protected_size())

    def total_size(self) -> int:
        """Tokens cached on the device. ``O(1)``."""
        return int(self.tree.device_size())

    # ------------------------------------------------------------------ match / insert
    def _empty(self, root: int) -> MatchResult:
        r = self.node_view(root)
        return self._match_result(_EMPTY_NP, r, r, 0)

    def _match_result(
        self, device_indices: np.ndarray, last_device_node: TreeNode, host_node: TreeNode, host_hit_length: int
    ) -> MatchResult:
        """SGLang's ``MatchResult`` of a match (its first field changed between
        releases): the subclass for the installed SGLang builds it."""
        raise NotImplementedError

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached page-aligned prefix of ``params.key`` (its ``limit``
        honoured, its namespace kept apart). ``last_host_node`` / ``best_match_node``
        are the deepest backed-up matched node, from which ``init_load_back`` loads the
        host-only tail. ``O(len(key))``."""
        key = params.key
        ns, tokens = self._key_parts(key)
        n = len(tokens) // self.page_size * self.page_size
        if self.disable or n == 0:
            return self._empty(self.root_handle if ns is None else self._namespaces[ns])
        # The compiled tree directly, not the core cache's wrapper: every Python layer
        # costs microseconds here. It matches whole pages only, so the tokens go as they are.
        m = self.tree.match_prefix(tokens, ns)
        last = m.last_device_node
        hit = m.host_hit_length
        # The deepest backed-up matched node: the end of an evicted tail (host-only nodes
        # are backed up), else the tree's anchor at or above the device part.
        host = m.last_node if hit else m.last_host_node
        node = TreeNode(self, last)  # views are immutable: one serves both when they agree
        return self._match_result(m.device_indices, node, node if host == last else TreeNode(self, host), hit)

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` with device slots ``params.value``; the backups the write
        policy asks for start (at the step, batched). Returns the length that was already
        cached (its slots are the caller's to free), in slots (bigrams with ``is_eagle``).
        The scheduler's calls are served in C (:mod:`hiradix.sglang._insert`, installed
        on the instance), every other by this method, with the same effect. ``O(len(key))``."""
        if self.disable:
            return InsertResult(prefix_len=0)
        key = params.key
        tokens: np.ndarray | array
        raw: np.ndarray | array
        if self.is_eagle:
            ns, tokens, raw = self._bigram_key(key)
        else:
            ek, salt = key.extra_key, key.cache_salt
            ns = None if ek is None and salt is None else self._ns(ek, salt)
            tokens = raw = _key_tokens(key)
        n = len(tokens) // self.page_size * self.page_size
        if n == 0:
            return InsertResult(prefix_len=0)
        value = params.value
        if value is None:  # SGLang's debug fallback: the (raw) tokens themselves as values
            value = _head(raw, n)
        elif type(value) is torch.Tensor and value.is_cpu:
            value = value.numpy()  # the tree's input type: a torch slice and conversion cost ~4 us
        events = self._events
        if events is not None:  # the earlier changes are not this insert's (its session's)
            events.sync()
        if n < len(tokens):
            tokens = _head(tokens, n)
        if n < len(value):
            value = value[:n]
        # ``chunked`` is 0.5.18's (a chunk of a running request); 0.5.23 has no such flag.
        prefix = self.core.insert(
            tokens, value, ns, priority=int(params.priority or 0), chunked=bool(getattr(params, "chunked", False))
        )
        if events is not None:  # before anything can delete the new node
            # 0.5.23's stores name the inserting request's session (0.5.18 has none)
            events.sync(getattr(params, "session_id", None))
        return InsertResult(prefix_len=prefix, total_len=n)

    def _key_parts(self, key: Any) -> tuple[str | None, np.ndarray | array]:
        """``key``'s namespace (``None``: the default one) and the tokens the tree keys on
        (with ``is_eagle``, its bigrams). A key without a namespace skips ``_ns``: this
        runs in the scheduler's hottest calls."""
        if self.is_eagle:
            ns, tokens, _ = self._bigram_key(key)
            return ns, tokens
        ek, salt = key.extra_key, key.cache_salt
        return (None if ek is None and salt is None else self._ns(ek, salt)), _key_tokens(key)

    def _aligned_len(self, n_tokens: int) -> int:
        """Slots of a request's ``n_tokens`` tokens that the tree caches: whole pages of
        tokens, or with ``is_eagle`` of the ``n_tokens - 1`` bigrams."""
        slots = max(n_tokens - self._bigram, 0)
        return slots // self.page_size * self.page_size

    def _device_path(self, key: Any) -> tuple[int, np.ndarray]:
        """The deepest device node on ``key``'s cached path and the device slots from the
        root down to it, in one walk of the compiled tree (a match's, the eviction order
        refreshed along it): what a 0.5.23 ``checkpoint`` reads back after its insert, where
        ``match_prefix`` and ``path_device_indices`` walk twice and build node views.
        ``O(len(key))``."""
        ns, tokens = self._key_parts(key)
        if len(tokens) < self.page_size:
            return (self.root_handle if ns is None else self._namespaces[ns]), _EMPTY_NP
        m = self.tree.match_prefix(tokens, ns)
        return int(m.last_device_node), m.device_indices

    def _free(self, indices: torch.Tensor) -> None:
        if indices.shape[0]:  # not len(): a tensor's __len__ is Python-level, several us
            self.token_to_kv_pool_allocator.free(indices)

    def _insert_continuing(
        self, last_node: Any, protected: int, key: Any, aligned: int, row: torch.Tensor, priority: int, chunked: bool
    ) -> tuple[int, int, np.ndarray] | None:
        """A running request's next insert (a chunked prefill's next chunk), from where
        its last one ended: ``last_node`` is the node the request holds locked, whose
        path holds the first ``protected`` slots of ``key`` (what the scheduler's
        ``cache_protected_len`` says), so only slots ``[protected, aligned)`` of the key
        are inserted (the tree's ``insert(start=)``), with ``row[protected:aligned]``.
        Returns ``(prefix length, last node, the tail's slots in the tree)``; ``None``
        (nothing done: the caller inserts the whole key) when the node is not that: not
        this cache's, not on the device, or not ``protected`` slots deep in the key's
        namespace; also with KV events on (their log follows whole-key inserts).
        ``O(aligned - protected)`` plus ``O(depth)`` nodes, where the whole key costs
        ``O(aligned)``: a 1M-token prefill's chunks cost the same at 8K and at 1M
        (``bench/long_context.py``)."""
        if (
            protected <= 0
            or aligned < protected
            or self._events is not None
            or type(last_node) is not TreeNode
            or not last_node.belongs_to(self)
        ):
            return None
        tree = self.tree
        start = last_node.id
        ns, tokens = self._key_parts(key)
        if len(tokens) < aligned or not tree.is_alive(start) or tree.is_evicted(start):
            return None
        depth, top = tree.path_extent(start)
        if depth != protected or top != (self.root_handle if ns is None else self._namespaces[ns]):
            return None
        parent = tree.parent
        tail = _head(tokens, aligned)[protected:]
        values = row[protected:aligned]
        result = self.core.insert_below(
            tail, values.numpy() if values.is_cpu else values, priority=priority, chunked=chunked, start=start
        )
        last = int(result.last_node)
        parts: list[np.ndarray] = []
        node = last
        while node != start:  # the tail's nodes, on the device after the insert
            v = tree.value(node)
            if v is None:
                raise RuntimeError(f"insert: node {node} below a continued insert is not on the device")
            parts.append(v)
            node = parent(node)
        if not parts:
            return protected + int(result.prefix_len), last, _EMPTY_NP
        parts.reverse()
        return protected + int(result.prefix_len), last, parts[0] if len(parts) == 1 else np.concatenate(parts)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=int(self.tree.inc_lock_ref(self._handle(node))))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=int(self.tree.dec_lock_ref(self._handle(node))))

    # ------------------------------------------------------------------ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens if possible (demote backed-up
        leaves, drop the rest; write-back backs up first). ``O(k log n)``."""
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        freed = self.core.evict(int(params.num_tokens))
        self._sync_events()
        if self.metrics is not None:
            self.update_eviction_metrics(freed, start)
            self.metrics.note_evicted(freed)
        return EvictResult(num_tokens_evicted=freed)

    def write_backup(self, node: Any, write_back: bool = False) -> int:
        """SGLang 0.5.18's ``HiRadixCache.write_backup``: start copying a device node's KV
        to host (evicting host KV for room once if needed) and return the tokens whose copy
        started; 0 when the node's parent is neither backed up nor being backed up (no gap
        in the backed-up chain), the node is on host already or in flight, or the host has
        no room. The copy completes, and the node counts as backed up, at a later
        ``writing_check`` / ``check_hicache_events``. ``write_back`` is accepted for
        SGLang's signature; unlike SGLang, hiradix keeps the parent rule under it too
        (its write-back evictions back a chain up parents first). ``O(tokens)``."""
        if self.disable:
            return 0
        started = self.core.write_backup(self._handle(node))
        self._sync_events()
        return started

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host-only tokens if possible. ``O(k log n)``."""
        freed = self.core.evict_host(num_tokens)
        self._sync_events()
        return freed

    # ------------------------------------------------------------------ load back
    def ready_to_load_host_cache(self) -> int:
        """Start the queued loads as one layer-wise load; the layer-done counter's slot
        index for the batch (``-1``: nothing to load)."""
        return self.core.ready_to_load_host_cache()

    def is_load_back_event_done(self, consumer_index: int) -> bool:
        if consumer_index < 0:
            return True
        if not self.cache_controller.layer_done_counter.events[consumer_index].finish_event.query():
            return False
        self.core.loading_check()
        return True

    def loading_check(self) -> None:
        self.core.loading_check()
        self._report_transfers()

    def writing_check(self, write_back: bool = False) -> None:
        self.core.writing_check(write_back=write_back)
        self._sync_events()
        self._report_transfers()

    def check_hicache_events(self) -> None:
        self.core.check_hicache_events()
        self._sync_events()
        self._report_transfers()

    def _report_transfers(self) -> None:
        """With ``--enable-metrics``, what the cache did since the last report, in
        SGLang's own metrics (:mod:`hiradix.sglang.metrics`). ``O(acks)``."""
        if self.metrics is not None:
            self.metrics.report(self.core)

    # ------------------------------------------------------------------ storage (L3)
    def _attach(self, backend: str, extra: dict[str, Any], prefetch: PrefetchConfig) -> None:
        """Build ``backend`` (hiradix's, or SGLang's through :mod:`hiradix.sglang.foreign`)
        and attach it. SGLang's backends append their own key suffix, so they get bare
        page keys; hiradix's get :attr:`_key_suffix`."""
        storage: StorageBackend
        requested = backend  # the --hicache-storage-backend name, which labels the metrics
        backend, extra = native_backend(backend, extra)
        try:
            if is_sglang_backend(backend, extra):
                storage = SGLangBackend.create(
                    backend, self.storage_config, extra, self.token_to_kv_pool_host, cp=self._cp
                )
                suffix = ""
            else:
                storage = create_backend(
                    backend, self.storage_config, extra_config=extra, mem_pool_host=self.token_to_kv_pool_host
                )
                suffix = self._key_suffix
        except StorageConfigError as e:
            raise ValueError(f"--hicache-storage-backend {backend!r}: {e}") from e
        ok, msg = self.core.storage.attach_storage_backend(
            storage, prefetch=prefetch, key_suffix=suffix, pass_prefix_keys=self.hicache_storage_pass_prefix_keys
        )
        if not ok:
            raise ValueError(f"--hicache-storage-backend {backend!r}: {msg}")
        self.cache_controller.storage_backend_type = backend
        # SGLang names the backend by its object's class (stock: HiCacheFile, MooncakeStore):
        # SGLang's own backend where one serves, else hiradix's.
        self.cache_controller.storage_backend = storage.inner if isinstance(storage, SGLangBackend) else storage
        self.cache_controller.warn_draft_l3()
        self.enable_storage = True
        if self.metrics is not None:
            cfg = self.storage_config
            self.metrics.attach_storage(
                requested,
                {
                    "tp_rank": cfg.tp_rank,
                    "dp_rank": self._dp_rank,
                    "pp_rank": cfg.pp_rank,
                    "pp_size": cfg.pp_size,
                    "attn_cp_rank": self._cp[0],
                    "attn_cp_size": self._cp[1],
                    **(self._extra_metric_labels or {}),
                },
            )
        logger.info("hiradix: %s", msg)

    def attach_storage_backend(
        self,
        storage_backend: str,
        storage_backend_extra_config_json: str | None = None,
        served_model_name: str | None = None,
        hicache_storage_prefetch_policy: str | None = None,
        hicache_write_policy: str | None = None,
    ) -> tuple[bool, str]:
        """Attach an L3 backend at runtime (SGLang's admin API); ``(ok, message)``. Its
        ``l3_format`` must be the one the cache started with (the tree's hash chains
        are that format's), and keys keep the start-up ``--served-model-name``."""
        if hicache_write_policy is not None and hicache_write_policy != self.cache_controller.write_policy:
            return False, "hiradix cannot change the write policy at runtime"
        try:
            extra = parse_extra_config(storage_backend_extra_config_json)
            prefetch, self.hicache_storage_pass_prefix_keys = _prefetch_config(
                extra, hicache_storage_prefetch_policy or "best_effort"
            )
            fmt = _l3_format(extra)
            if fmt != self.l3_format:
                return False, f"l3_format {fmt!r}: this cache started with {self.l3_format!r} keys and pages"
            if self.enable_storage:
                return False, f"storage backend {self.cache_controller.storage_backend_type!r} is attached"
            self._attach(storage_backend, extra, prefetch)
        except ValueError as e:
            return False, str(e)
        return True, f"attached storage backend {storage_backend!r}"

    def detach_storage_backend(self) -> tuple[bool, str]:
        """Detach the L3 backend (draining its I/O, as the core does) and close it: this
        cache built it, and a file backend holds its directory's lock until closed (as
        SGLang's detach closes its backend). ``(ok, message)``."""
        l3 = self.core.storage.l3
        ok, msg = self.core.storage.detach_storage_backend()
        if ok:
            self.enable_storage = False
            self.cache_controller.storage_backend_type = None
            self.cache_controller.storage_backend = None
            assert l3 is not None
            l3.backend.close()
        return ok, msg

    def clear_storage_backend(self) -> bool:
        l3 = self.core.storage.l3
        if l3 is None:
            return False
        clear = getattr(l3.backend, "clear", None)
        if clear is None:
            return False
        clear()
        return True

    def prefetch_from_storage(
        self,
        req_id: str,
        last_host_node: Any,
        new_input_tokens: Sequence[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
    ) -> bool:
        """Start fetching from L3 the pages that follow ``last_host_node``. With
        ``hicache_storage_pass_prefix_keys`` the backend gets the tree's own prefix keys
        (``prefix_keys`` from the scheduler are the same hashes, recomputed)."""
        if not self.enable_storage:
            return False
        handle = self._handle(last_host_node)
        tokens = self._storage_tokens(handle, new_input_tokens)
        if tokens is None:
            return False
        return self.core.storage.prefetch_from_storage(req_id, handle, tokens, last_hash)

    def _storage_tokens(self, mount: int, new_input_tokens: Sequence[int]) -> np.ndarray | None:
        """The tree tokens of what follows ``mount``: the tokens themselves, or with
        ``is_eagle`` the bigrams that start at the first of them (their second tokens),
        whose first token must be the one the mount ends with (the scheduler passes the
        tokens from the end of the match on). ``None`` where bigrams cannot continue the
        mount: another first token, or no namespace to go to (the global root)."""
        tokens = _as_tokens(new_input_tokens)
        if not self.is_eagle:
            return tokens
        tree = self.tree
        if mount == self.root_handle or not len(tokens):
            return None
        parent = tree.parent(mount)
        boundary = self.namespace_parts(mount)[2] if parent == NO_NODE else int(tree.key(mount)[-1])
        return tokens[1:] if int(tokens[0]) == boundary else None

    def check_prefetch_progress(self, req_id: str) -> bool:
        done = self.core.storage.check_prefetch_progress(req_id)
        self._sync_events()  # the pages that landed are new nodes
        return done

    def pop_prefetch_loaded_tokens(self, req_id: str) -> int:
        return self.core.storage.pop_prefetch_loaded_tokens(req_id)

    def terminate_prefetch(self, req_id: str) -> None:
        """Stop fetching more pages for ``req_id``; what has landed is kept."""
        storage = self.core.storage
        entry = storage.ongoing_prefetch.get(req_id)
        if entry is not None and storage.l3 is not None:
            storage.l3.terminate(entry.op)

    def release_aborted_request(self, rid: str) -> None:
        self.core.storage.release_aborted_request(rid)

    def query_storage_hit_length(
        self,
        last_host_node: Any,
        new_input_tokens: Sequence[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
    ) -> int:
        """Page-aligned tokens of ``new_input_tokens`` that L3 holds after
        ``last_host_node`` (agreed by MIN); 0 without storage."""
        if not self.enable_storage:
            return 0
        handle = self._handle(last_host_node)
        tokens = self._storage_tokens(handle, new_input_tokens)
        if tokens is None:
            return 0
        return self.core.storage.query_hit_tokens(handle, tokens, last_hash)

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Empty the tree and both pools (the scheduler's flush): waits for copies first.
        The events of what happened before stay queued; the copies acknowledged while
        waiting make none (SGLang drops them unacknowledged), then ``AllBlocksCleared``."""
        self._sync_events()
        self.core.reset()
        self.cache_controller.reset()
        self.root_handle = int(self.tree.root)
        self.root_node = TreeNode(self, self.root_handle)
        self._namespaces.clear()
        self._ns_by_root.clear()
        self._ns_parts.clear()
        if self._events is not None:
            self._events.cleared()

    def shutdown(self) -> None:
        """Detach the storage backend at exit (best effort, as SGLang)."""
        try:
            if self.enable_storage:
                self.detach_storage_backend()
        except Exception:  # at interpreter exit: report, never raise
            logger.exception("hiradix: detaching the storage backend at shutdown failed")

    def release_host_resources(self) -> None:
        """Nothing to unpin by hand: the host pool is released with the cache."""

    # ------------------------------------------------------------------ introspection
    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree holds, depth first. ``O(n)``."""
        out: list[np.ndarray] = []
        stack = [self.root_handle, *self._namespaces.values()]
        while stack:
            h = stack.pop()
            v = self.tree.value(h)
            if v is not None and self.tree.parent(h) != NO_NODE:
                out.append(v)
            stack.extend(self.tree.children(h))
        if not out:
            return _EMPTY.to(self.device)
        return torch.from_numpy(np.concatenate(out)).to(self.device)

    def pretty_print(self) -> None:
        """Print the tree, one node per line (tokens, device/host state, lock count)."""
        tree = self.tree

        def walk(h: int, depth: int) -> None:
            key = tree.key(h)[:10].tolist()
            print(
                " " * depth + f"{tree.key_len(h)} {key} evicted={tree.is_evicted(h)} "
                f"backuped={tree.is_backed_up(h)} lock_ref={tree.lock_ref(h)}"
            )
            for c in self.tree.children(h):
                walk(c, depth + 2)

        for root in (self.root_handle, *self._namespaces.values()):
            walk(root, 0)
        print(f"#tokens: {self.total_size()}")

    # ------------------------------------------------------------------ KV events
    def _sync_events(self) -> None:
        if self._events is not None:
            self._events.sync()

    @property
    def kv_event_queue(self) -> list[Any]:
        """The KV events not yet taken (SGLang's attribute; empty without events)."""
        if self._events is None:
            return []
        self._events.sync()
        return self._events.queue

    def take_events(self) -> list[Any]:
        """The KV events since the last call, oldest first (``[]`` unless
        ``enable_kv_cache_events``). ``O(events)``."""
        if self._events is None:
            return []
        return self._events.take()

    def check_invariants(self, outstanding_device: int = 0) -> None:
        """The core's invariants and slot conservation on SGLang's allocator."""
        self.core.check_invariants(outstanding_device)
