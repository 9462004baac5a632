"""``HiRadixCache`` for SGLang: hiradix's three-tier cache behind SGLang's prefix-cache API.

A thin layer over :class:`hiradix.cache.HiRadixCache` (the "core"): it translates
SGLang's parameter and result types, requests and node objects, and nothing else. Its parts:
:mod:`hiradix.sglang.builder` builds the core from SGLang's params and server args (every
refusal included, :mod:`hiradix.sglang.options`); :class:`HiRadixCacheBase` here translates
SGLang's calls, with :class:`~hiradix.sglang.paths.TreePaths` (keys, namespaces, nodes),
:class:`~hiradix.sglang.tiers.TierCalls` (eviction, backup, load back) and
:class:`~hiradix.sglang.l3_calls.L3Calls` (storage); one module per SGLang generation adds
its request API (:mod:`hiradix.sglang.api`). The core runs on SGLang's own objects:

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
  the same slots on every backup and load (:meth:`~hiradix.sglang.controller.SGLangCacheController.add_draft`);
- with ``is_eagle`` keys are EAGLE bigrams, as SGLang's: bigram ``i`` of a key is
  ``(t[i], t[i+1])``, so ``n + 1`` tokens make ``n`` bigrams and ``n`` device slots. The
  tree stores bigram ``i`` as its second token ``t[i+1]`` in a namespace of the key's first
  token: two keys share ``k`` bigrams exactly when they share ``t[0]`` and ``t[1..k]``, so
  prefix lengths, splits, pages and device slots are SGLang's, on the tree's int32 tokens.

L3 page formats (``l3_format``) and CPU backup copies (``backup_copy``) in
``--hicache-storage-backend-extra-config``: :mod:`hiradix.sglang.options`.

Options this adapter does not support are refused at start-up with the option named
(:mod:`hiradix.sglang.options`), never silently ignored.
"""

from __future__ import annotations

import atexit
import logging
from array import array
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)

from hiradix._native import load
from hiradix.sglang.builder import Built, attention_dp_rank, build
from hiradix.sglang.l3_calls import L3Calls
from hiradix.sglang.metrics import MetricsReporter
from hiradix.sglang.nodes import TreeNode
from hiradix.sglang.options import parse_extra_config
from hiradix.sglang.paths import EMPTY_SLOTS, head, key_tokens
from hiradix.sglang.tiers import TierCalls

__all__ = ["HiRadixCacheBase", "compiled_first", "namedtuple_tail", "parse_extra_config"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_DISPATCH = load("hiradix.sglang._match")  # CompiledMethod's module; None without the build


def compiled_first(attr: str) -> Callable[[_F], _F]:
    """Decorate a method that an instance may serve with a compiled callable it keeps
    under ``attr`` (``None``: the method serves): the scheduler's calls then reach C with
    no Python frame between (:class:`hiradix.sglang._match.CompiledMethod`). Without the
    compiled modules the method is left as it is. On the class, the method is the Python
    one, the compiled one's twin."""

    def decorate(method: _F) -> _F:
        return method if _DISPATCH is None else cast(_F, _DISPATCH.CompiledMethod(method, attr))

    return decorate


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


class HiRadixCacheBase(TierCalls, L3Calls, BasePrefixCache):
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
    ``l3_format``: :mod:`hiradix.sglang.options`), ``--hicache-storage-prefetch-policy`` and
    ``--radix-eviction-policy``.

    Single-threaded, like the scheduler that calls it.
    """

    # The compiled match_prefix / insert of this cache (None: the Python method serves),
    # fields at a fixed place, where the methods' CompiledMethod reads them on every call.
    __slots__ = ("_compiled_insert", "_compiled_match")

    def __init__(self, params: Any, server_args: Any) -> None:
        self._read_params(params)
        built = build(params, server_args, self.server, self.eviction_policy)
        self._init_metrics(params, built.args)
        self._adopt(built)
        self._init_tree(built)
        self.enable_storage = False
        if built.backend is not None:
            self._attach(built.backend, built.extra, built.prefetch)
        self._init_kv_events(params)
        self._install_compiled()
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
        self._dp_rank = attention_dp_rank()
        self._extra_metric_labels = getattr(server_args, "extra_metric_labels", None)
        if params.enable_metrics:
            self.init_metrics_collector()
            self.metrics = MetricsReporter(self.metrics_collector)

    def _adopt(self, built: Built) -> None:
        """The builder's options and objects, under the names SGLang's own cache uses."""
        self.kv_cache = built.kv_cache
        self.device = built.device
        self._on_cpu = self.device.type == "cpu"
        self.hicache_storage_pass_prefix_keys = built.pass_prefix_keys
        self.l3_format = built.l3_format
        self.backup_copy = built.backup_copy
        self.token_to_kv_pool_host = built.host_pool
        self.storage_config = built.storage_config
        self._key_suffix = built.key_suffix  # what hiradix's own backends get appended to each key
        self._cp = built.cp
        self.core = built.core

    def _init_tree(self, built: Built) -> None:
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
        device_slots = built.controller.device_pool.size
        self.tree.reserve_tokens(device_slots, evict_tokens=device_slots)
        self.cache_controller = built.controller
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

    def _install_compiled(self) -> None:
        """Make the compiled ``match_prefix`` (:mod:`hiradix.sglang._match`) and ``insert``
        (:mod:`hiradix.sglang._insert`) of this cache where they apply: built (not
        ``HIRADIX_PUREPYTHON``), no EAGLE bigrams, the subclass keeps this class's method
        and, for the matcher, the installed SGLang's ``MatchResult`` is as
        :meth:`_compiled_match_spec` expects. The class's methods hand calls to them
        (:func:`compiled_first`); they serve the scheduler's calls (plain keys, CPU slots,
        no KV events) and hand every other to the Python method, with the same results."""
        self._compiled_match: Any = None
        self._compiled_insert: Any = None
        self._inserter: Any = None  # also serves 0.5.23's checkpoint (api_v23.py)
        cls = type(self)  # a subclass's own method, where it has one, is the one to call
        match = load("hiradix.sglang._match")
        spec = self._compiled_match_spec()
        if (
            match is not None
            and spec is not None
            and not self.is_eagle
            and match.applies_to(self.tree)
            and cls.match_prefix is HiRadixCacheBase.match_prefix
        ):
            wrap, result, tail = spec
            self._compiled_match = match.Matcher(self, HiRadixCacheBase.match_prefix, TreeNode, wrap, result, tail)
        insert = load("hiradix.sglang._insert")
        if (
            insert is not None
            and not self.is_eagle
            and insert.applies_to(self.tree)
            and cls.insert is HiRadixCacheBase.insert
        ):
            self._inserter = self._compiled_insert = insert.Inserter(
                self, HiRadixCacheBase.insert, InsertResult, torch.Tensor, torch.int64, torch.int32
            )

    def _compiled_match_spec(self) -> tuple[Callable[[np.ndarray], Any], type, tuple[Any, ...]] | None:
        """``(wrap, MatchResult, tail)`` for the compiled matcher: the result's first field
        from the matched device slots, SGLang's result type and the defaults of its fields
        after the first five (:func:`namedtuple_tail`); ``None`` where only the Python
        method may serve. The subclass for the installed SGLang knows which."""
        return None

    # ------------------------------------------------------------------ match / insert
    def _empty(self, root: int) -> MatchResult:
        r = self.node_view(root)
        return self._match_result(EMPTY_SLOTS, r, r, 0)

    def _match_result(
        self, device_indices: np.ndarray, last_device_node: TreeNode, host_node: TreeNode, host_hit_length: int
    ) -> MatchResult:
        """SGLang's ``MatchResult`` of a match (its first field changed between
        releases): the subclass for the installed SGLang builds it."""
        raise NotImplementedError

    @compiled_first("_compiled_match")
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

    @compiled_first("_compiled_insert")
    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` with device slots ``params.value``; the backups the write
        policy asks for start (at the step, batched). Returns the length that was already
        cached (its slots are the caller's to free), in slots (bigrams with ``is_eagle``).
        The scheduler's calls are served in C (:mod:`hiradix.sglang._insert`, the
        cache's own: :func:`compiled_first`), every other by this method, with the same effect. ``O(len(key))``."""
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
            tokens = raw = key_tokens(key)
        n = len(tokens) // self.page_size * self.page_size
        if n == 0:
            return InsertResult(prefix_len=0)
        value = params.value
        if value is None:  # SGLang's debug fallback: the (raw) tokens themselves as values
            value = head(raw, n)
        elif type(value) is torch.Tensor and value.is_cpu:
            value = value.numpy()  # the tree's input type: a torch slice and conversion cost ~4 us
        events = self._events
        if events is not None:  # the earlier changes are not this insert's (its session's)
            events.sync()
        if n < len(tokens):
            tokens = head(tokens, n)
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

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=int(self.tree.inc_lock_ref(self._handle(node))))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=int(self.tree.dec_lock_ref(self._handle(node))))

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

    # ------------------------------------------------------------------ KV events
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
