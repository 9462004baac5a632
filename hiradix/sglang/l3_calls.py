"""The adapter's L3 calls: SGLang's storage API (attach, detach and clear a backend at
runtime, prefetch from and query L3) on the core's storage
(:class:`hiradix.cache.HiRadixCache`'s ``storage``) and SGLang's metrics. hiradix's
backends, or SGLang's own through :mod:`hiradix.sglang.foreign` (:class:`L3Calls`, a part
of the adapter).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hiradix.cache.l3 import PrefetchConfig
from hiradix.sglang.foreign import SGLangBackend, is_sglang_backend
from hiradix.sglang.options import Server, parse_extra_config, read_l3_format, read_prefetch
from hiradix.sglang.paths import TreePaths, as_tokens
from hiradix.sglang.storage import native_backend
from hiradix.storage.base import StorageBackend, StorageConfig
from hiradix.storage.registry import StorageConfigError, create_backend
from hiradix.tree import NO_NODE

if TYPE_CHECKING:
    from hiradix.memory.pools import HostKVPool
    from hiradix.sglang.controller import SGLangCacheController
    from hiradix.sglang.metrics import MetricsReporter

__all__ = ["L3Calls"]

logger = logging.getLogger(__name__)


class L3Calls(TreePaths):
    """SGLang's storage (L3) calls on the core's storage: a base of
    :class:`~hiradix.sglang.cache.HiRadixCacheBase`, which sets the fields below."""

    server: Server  # the generation's (options.Server): whether prefetches pass keyword arguments
    cache_controller: SGLangCacheController
    token_to_kv_pool_host: HostKVPool
    storage_config: StorageConfig
    metrics: MetricsReporter | None
    enable_storage: bool
    l3_format: str
    hicache_storage_pass_prefix_keys: bool
    _key_suffix: str
    _cp: tuple[int, int]
    _dp_rank: int
    _extra_metric_labels: dict[str, str] | None

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
            prefetch, self.hicache_storage_pass_prefix_keys = read_prefetch(
                extra, hicache_storage_prefetch_policy or "best_effort"
            )
            fmt = read_l3_format(extra)
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
        req_id: Any,
        last_host_node: Any,
        new_input_tokens: Sequence[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
        **kwargs: Any,
    ) -> bool:
        """Start fetching from L3 the pages that follow ``last_host_node``. With
        ``hicache_storage_pass_prefix_keys`` the backend gets the tree's own prefix keys
        (``prefix_keys`` from the scheduler are the same hashes, recomputed).

        SGLang 0.5.20 on (``Server.prefetch_kwargs``) names the request by its
        ``CacheRequestHandle`` and passes ``matched_prefix_tokens``, ``extra_key`` and
        ``cache_salt``: what the tree already knows from ``last_host_node``. A
        ``storage_hit_end`` comes only with SGLang's re-issues, which hiradix never asks
        for (its ``storage_prefetch_retries`` is ``None``). 0.5.18 passes none."""
        if kwargs:
            if not self.server.prefetch_kwargs:
                raise TypeError(f"prefetch_from_storage() got an unexpected keyword argument {next(iter(kwargs))!r}")
            if kwargs.get("storage_hit_end") is not None:
                raise ValueError("hiradix.sglang: storage_hit_end (an L3 re-issue) is not supported")
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
        tokens = as_tokens(new_input_tokens)
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
