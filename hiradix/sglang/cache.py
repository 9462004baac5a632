"""``HiRadixCache`` for SGLang: hiradix's three-tier cache behind SGLang's prefix-cache API.

A thin layer over :class:`hiradix.cache.HiRadixCache` (the "core"): it translates
SGLang's parameter and result types, requests and node objects, and nothing else. Its parts:
:mod:`hiradix.sglang.builder` builds the core from SGLang's params and server args (every
refusal included, :mod:`hiradix.sglang.options`); :class:`HiRadixCacheBase` here translates
SGLang's calls, with :class:`~hiradix.sglang.paths.TreePaths` (keys, namespaces, nodes) and
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
(:mod:`hiradix.sglang.options`), never silently ignored.
"""

from __future__ import annotations

import atexit
import logging
import time
from array import array
from collections.abc import Callable
from typing import Any

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

from hiradix._native import load
from hiradix.sglang.builder import Built, attention_dp_rank, build
from hiradix.sglang.l3_calls import L3Calls
from hiradix.sglang.metrics import MetricsReporter
from hiradix.sglang.nodes import TreeNode
from hiradix.sglang.options import parse_extra_config
from hiradix.sglang.paths import EMPTY_SLOTS, head, key_tokens
from hiradix.tree import NO_NODE

__all__ = ["HiRadixCacheBase", "namedtuple_tail", "parse_extra_config"]

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


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


class HiRadixCacheBase(L3Calls, BasePrefixCache):
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
        self._read_params(params)
        built = build(params, server_args, self.server, self.eviction_policy)
        self._init_metrics(params, built.args)
        self._adopt(built)
        self._init_tree(built)
        self.enable_storage = False
        if built.backend is not None:
            self._attach(built.backend, built.extra, built.prefetch)
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
        device_slots = self.core.device_pool.size
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
        return self._match_result(EMPTY_SLOTS, r, r, 0)

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
