"""HiRadixCache: the tree, the KV pools and the controller behind SGLang-shaped methods.

The tree (:class:`hiradix.HiRadixTree`) decides: which prefix matches, which nodes to back
up, which leaves to evict. This class acts on those decisions: it allocates and frees
device and host slots, queues copies on the :class:`~hiradix.cache.controller.HiCacheController`,
and completes the tree's two-phase transfers when the copies are acknowledged. Its L3 side
(prefetches from and backups to a storage backend) is its :attr:`HiRadixCache.storage`, a
:class:`~hiradix.cache.storage_tier.StorageTier`. It is built from three frozen option
objects (:class:`TreeOptions`, :class:`TierOptions`,
:class:`~hiradix.cache.storage_tier.StorageOptions`) and its collaborators.

Method names and semantics follow SGLang 0.5.18's ``HiRadixCache`` so that an adapter stays
thin: ``match_prefix``, ``insert``, ``cache_finished_req`` / ``cache_unfinished_req``,
``write_backup``, ``writing_check``, ``loading_check``, ``init_load_back`` / ``load_back``,
``ready_to_load_host_cache``, ``check_hicache_events``, ``evict``, ``evict_host`` and
``reset``. Differences, all deliberate:

- A node is backed up only when its copy has landed on every rank (``commit_backup``);
  until then it is locked on the device, as in SGLang, but not yet usable from the host.
- A host allocation that fails evicts host-only KV and retries once; a backup that still
  cannot get host slots, or whose copy fails, leaves the tree exactly as before (the
  tree's two-phase ``begin_backup``/``commit_backup``): no gap in the backed-up chain and
  no lock left behind.
- With several ranks, every allocation outcome and every completion count goes through
  the controller's :class:`~hiradix.cache.distributed.RankAgreement` before the tree changes,
  so the ranks' trees stay identical and they make the same collectives.
- ``evict`` returns the number of device tokens freed.
- Observers (:class:`CacheObserver`, :meth:`HiRadixCache.add_observer`) are told of every
  backup, load and device free as it happens: a simulator counts them without patching.

Single-threaded, like the scheduler that drives it; the copies run on the controller's
engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

import hiradix

if TYPE_CHECKING:
    from hiradix.tree import HiRadixTree
from hiradix.cache.controller import CacheOperation, HiCacheController
from hiradix.cache.distributed import RankAgreement
from hiradix.cache.results import CacheMatchResult
from hiradix.cache.stats import TIER_COUNTERS, CacheStats, zeros
from hiradix.cache.storage_tier import StorageOptions, StorageTier
from hiradix.memory.copy import LayerHook
from hiradix.memory.pools import DeviceKVPool, HostKVPool
from hiradix.tree._results import NO_NODE, IOStatus
from hiradix.tree.policy import EvictionPolicy, get_policy, write_through_threshold

__all__ = [
    "CacheMatchResult",
    "CacheObserver",
    "DeviceAllocator",
    "HiRadixCache",
    "Req",
    "TierOptions",
    "TreeFactory",
    "TreeOptions",
]

_EMPTY = torch.empty(0, dtype=torch.int64)


def _cpu(indices: Any) -> Any:
    """Indices as the tree takes them: a CUDA tensor is copied to the host (the tree is a
    host data structure; SGLang's tree keeps device tensors and syncs on every use)."""
    if isinstance(indices, torch.Tensor) and indices.device.type != "cpu":
        return indices.cpu()
    return indices


@runtime_checkable
class DeviceAllocator(Protocol):
    """What the cache needs of a device slot allocator: hiradix's
    :class:`~hiradix.memory.allocator.PagedSlotAllocator` and SGLang's
    ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` both are one.

    ``alloc(n)`` returns ``n`` slots (``n`` a page multiple) or ``None``; ``free`` takes
    slots back; ``size`` is the number of usable slots, so that free + cached + held by
    requests always equals ``size`` (the slot-conservation check).
    """

    size: int

    def alloc(self, need_size: int) -> Any: ...

    def free(self, free_index: Any) -> None: ...

    def available_size(self) -> int: ...

    def clear(self) -> None: ...


def _long(indices: Any) -> torch.Tensor:
    """Indices as an int64 CPU tensor (what observers are given)."""
    if isinstance(indices, torch.Tensor):
        return indices.to(dtype=torch.int64, device="cpu")
    return torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))


class CacheObserver:
    """What a :class:`HiRadixCache` does to its tiers, told as it happens.

    Subclass it, override the events you need (the defaults do nothing) and register the
    instance with :meth:`HiRadixCache.add_observer`. Indices are 1-D int64 tensors, on the
    CPU except in :meth:`on_device_freed` (on the device pool's device). Observers run
    inside the cache's operations, on the caller's thread: they must be quick and must
    not call back into the cache. An exception from an observer propagates to the
    cache's caller (it is a bug in the observer, not a cache condition).

    Every device slot the cache frees goes through :meth:`on_device_freed`, except that
    :meth:`HiRadixCache.reset` empties the pools without events. A node's backup is
    :meth:`on_backup_started` when its copy is queued and :meth:`on_backup_finished` when
    every rank acknowledged it; loads likewise. With these a simulator can tell, per
    device slot, whether its KV has a host copy when it is evicted
    (:class:`hiradix.sim.replay.Replayer` does).
    """

    def on_backup_started(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """``node``'s device -> host copy was queued (it is locked on the device until
        :meth:`on_backup_finished`)."""

    def on_backup_finished(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor, ok: bool) -> None:
        """``node``'s backup was acknowledged: ``ok`` means it is now backed up (its device
        slots have a host copy); otherwise its host slots were freed and it is as before."""

    def on_load_started(self, node: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """``node``'s evicted chain is being loaded back into ``device_indices``."""

    def on_load_finished(self, node: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """``node``'s load landed and was acknowledged: its device slots hold the KV of
        its host copy (a failed load is copied again before this is told)."""

    def on_device_freed(self, indices: torch.Tensor, evicted: bool) -> None:
        """Device slots went back to the allocator. ``evicted``: freed by
        :meth:`HiRadixCache.evict` (demoted, with a host copy kept, or deleted); otherwise
        a request's duplicate or unaligned slots, or an allocation given back."""


@dataclass(eq=False)
class Req:
    """The part of a request the cache reads and updates (SGLang's ``Req`` plus its row of
    ``req_to_token``).

    ``token_ids`` are the tokens whose KV has been computed, ``kv_indices`` their device
    slots (one per token). ``prefix_indices`` and ``last_node`` describe the cached prefix
    the request holds a lock on (``last_node`` locked with ``inc_lock_ref``).
    """

    rid: Any
    token_ids: np.ndarray
    kv_indices: torch.Tensor
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    last_node: int = NO_NODE
    extra_key: str | None = None
    priority: int = 0


_Opt = TypeVar("_Opt")


def _options(name: str, value: _Opt | None, cls: type[_Opt]) -> _Opt:
    """``value``, or ``cls()`` for ``None``; ``TypeError`` for anything else (a caller
    still passing the keywords these option objects replaced gets told so)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {cls.__name__} (or None), got {type(value).__name__}")
    return value


class TreeFactory(Protocol):
    """What :class:`TreeOptions` ``tree_cls`` is: :class:`hiradix.HiRadixTree` (either
    implementation) or a callable with its constructor's signature that returns a tree with
    its API (a test's counting wrapper)."""

    def __call__(
        self,
        page_size: int,
        *,
        eviction_policy: str | EvictionPolicy = ...,
        write_policy: str = ...,
        enable_hash: bool = ...,
        clock: Callable[[], float] | None = ...,
        chain_seed: Callable[[str | None], str | None] | None = ...,
    ) -> HiRadixTree: ...


@dataclass(frozen=True, slots=True)
class TreeOptions:
    """How a :class:`HiRadixCache` builds its tree (:class:`hiradix.HiRadixTree`'s options).

    ``eviction_policy`` and ``write_policy`` as the tree's: ``write_through`` (back up on
    first insert), ``write_through_selective`` (on the second hit) or ``write_back`` (on
    eviction). ``enable_hash``: page hashes, on by default (they are the L3 keys; a tree
    without them computes them when a backend is attached). ``clock``: seconds, for the
    eviction policies' timestamps and the L3 prefetch timeouts. ``chain_seed``: where each
    namespace's hash chain starts (see the tree; ``lambda extra_key: None`` gives
    SGLang's token-only chains). ``tree_cls``: the tree implementation (default
    :class:`hiradix.HiRadixTree`; see :class:`TreeFactory`).

    Checked when built: ``ValueError`` for an unknown eviction or write policy,
    ``TypeError`` for a clock, chain seed or tree class that is not callable.

    >>> TreeOptions(write_policy="write_back").eviction_policy
    'lru'
    """

    eviction_policy: str | EvictionPolicy = "lru"
    write_policy: str = "write_through"
    enable_hash: bool = True
    clock: Callable[[], float] | None = None
    chain_seed: Callable[[str | None], str | None] | None = None
    tree_cls: TreeFactory | None = None

    def __post_init__(self) -> None:
        get_policy(self.eviction_policy)
        write_through_threshold(self.write_policy)
        for name in ("clock", "chain_seed", "tree_cls"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable, got {type(getattr(self, name)).__name__}")

    def build(self, page_size: int) -> HiRadixTree:
        """A new tree of ``page_size`` with these options. ``O(1)``."""
        kwargs: dict[str, Any] = {"eviction_policy": self.eviction_policy, "write_policy": self.write_policy}
        if self.enable_hash:
            kwargs["enable_hash"] = True
        if self.clock is not None:
            kwargs["clock"] = self.clock
        if self.chain_seed is not None:
            kwargs["chain_seed"] = self.chain_seed
        return (self.tree_cls or hiradix.HiRadixTree)(page_size, **kwargs)


@dataclass(frozen=True, slots=True)
class TierOptions:
    """How a :class:`HiRadixCache` moves KV between the device and the host.

    ``load_back_threshold``: evicted chains shorter than this many tokens are recomputed
    instead of loaded (SGLang's default: 10; :attr:`HiRadixCache.load_back_threshold`
    may be changed later). ``batch_backups``: start the backups that inserts ask for
    together, once per scheduler step (at the next
    :meth:`~HiRadixCache.check_hicache_events`, or sooner when
    :meth:`~HiRadixCache.evict`, :meth:`~HiRadixCache.flush` or
    :meth:`~HiRadixCache.writing_check` needs them started), rather than one submission
    per insert: one host allocation, one agreement and one copy for all of a step's
    inserts. Until then those nodes are on the device only and protected (the deepest
    node each insert asks to back up is locked until its backups start), as they are
    while a backup is in flight, and they complete in the order the inserts asked for
    them (after the backups already in flight). Default ``False`` (each insert starts its
    own); :mod:`hiradix.sglang` turns it on.

    Checked when built: ``ValueError`` for a negative or non-integer threshold.

    >>> TierOptions(load_back_threshold=0).batch_backups
    False
    """

    load_back_threshold: int = 10
    batch_backups: bool = False

    def __post_init__(self) -> None:
        threshold = self.load_back_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0, got {threshold!r}")


class HiRadixCache:
    """Three-tier (device, host, storage) radix KV cache.

    Parameters
    ----------
    device_pool, host_pool:
        The L1 and L2 KV pools (same shape, dtype and page size).
    tree:
        The tree's options (:class:`TreeOptions`; default its defaults).
    tiers:
        Device <-> host options (:class:`TierOptions`; default its defaults).
    storage:
        L3 options (:class:`~hiradix.cache.storage_tier.StorageOptions`; default none
        attached): the :attr:`storage` tier is built from them.
    agreement:
        Cross-rank agreement (default: one rank).
    controller:
        A ready controller (default: one built from the pools, ``agreement`` and
        ``layer_hook``).
    allocator:
        The device slot allocator (:class:`DeviceAllocator`; default: a fresh one over
        ``device_pool``). Inside SGLang it is the scheduler's own allocator, so the
        scheduler's slot accounting and the cache's are one.

    Attributes
    ----------
    tree:
        The tree (built by :meth:`TreeOptions.build`).
    storage:
        The L3 tier (:class:`~hiradix.cache.storage_tier.StorageTier`): attach or detach
        a backend, prefetch from it, and what it holds in flight.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        tree: TreeOptions | None = None,
        tiers: TierOptions | None = None,
        storage: StorageOptions | None = None,
        agreement: RankAgreement | None = None,
        controller: HiCacheController | None = None,
        layer_hook: LayerHook | None = None,
        allocator: DeviceAllocator | None = None,
    ) -> None:
        tree = _options("tree", tree, TreeOptions)
        tiers = _options("tiers", tiers, TierOptions)
        storage = _options("storage", storage, StorageOptions)
        self.page_size = device_pool.page_size
        self.tree: HiRadixTree = tree.build(self.page_size)
        self.load_back_threshold = tiers.load_back_threshold
        self.batch_backups = tiers.batch_backups
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._on_cpu = device_pool.device.type == "cpu"
        self.device_allocator: DeviceAllocator = allocator if allocator is not None else device_pool.make_allocator()
        self.cache_controller = controller or HiCacheController(
            device_pool, host_pool, agreement=agreement, layer_hook=layer_hook
        )
        self.agreement = self.cache_controller.agreement
        # Pending-transfer protections, each released exactly once (popped on ack).
        self.ongoing_write_through: dict[int, np.ndarray] = {}  # node -> host slots (int64)
        self.ongoing_load_back: dict[int, torch.Tensor] = {}  # node -> device slots
        self._pending_backups: list[int] = []  # nodes inserts asked to back up (batch_backups)
        self._held: list[int] = []  # the node each insert(hold=True) locked, until the backups start
        self._stats = {k: 0 for k in zeros(CacheStats) if k not in TIER_COUNTERS}  # the tier counts the rest
        self._observers: list[CacheObserver] = []
        self.storage = StorageTier(
            storage,
            tree=self.tree,
            host_pool=host_pool,
            controller=self.cache_controller,
            evict_host=self.evict_host,
            clock=tree.clock,
        )

    # ------------------------------------------------------------------ observers
    def get_stats(self) -> CacheStats:
        """A snapshot of the cache's counters (:class:`~hiradix.cache.stats.CacheStats`). ``O(counters)``."""
        return CacheStats(**self._stats, **self.storage.counters())

    @property
    def stats(self) -> dict[str, int]:
        """The same counters as a plain dict by name (a copy; the form they had before
        :meth:`get_stats`, kept for callers that read or serialize them so)."""
        return dataclasses.asdict(self.get_stats())

    def add_observer(self, observer: CacheObserver) -> None:
        """Tell ``observer`` of every later backup, load and device free (see
        :class:`CacheObserver`). ``O(1)``."""
        if not isinstance(observer, CacheObserver):
            raise TypeError(f"observer must be a CacheObserver, got {type(observer).__name__}")
        self._observers.append(observer)

    def remove_observer(self, observer: CacheObserver) -> None:
        """Stop telling ``observer``; ``ValueError`` if it was not added. ``O(observers)``."""
        self._observers.remove(observer)

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Device tokens the tree may evict. ``O(1)``."""
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        """Device tokens locked by requests or in-flight transfers. ``O(1)``."""
        return self.tree.protected_size()

    def available_device_size(self) -> int:
        """Free device slots. ``O(1)``."""
        return self.device_allocator.available_size()

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: Any, extra_key: str | None = None) -> CacheMatchResult:
        """Longest cached prefix of ``key`` (page aligned). Runtime: ``O(len(key))``."""
        m = self.tree.match_prefix(key, extra_key)
        indices = torch.from_numpy(m.device_indices)
        return CacheMatchResult(
            indices if self._on_cpu else indices.to(self.device_pool.device),
            m.last_device_node,
            m.last_host_node,
            m.host_hit_length,
            m.last_node,
        )

    def insert(
        self, key: Any, value: Any, extra_key: str | None = None, *, priority: int = 0, chunked: bool = False
    ) -> int:
        """Insert ``key`` with device slots ``value``; returns the length of the prefix
        that was already cached (the caller frees its own slots for it). Nodes that the
        write policy asks for are backed up. Runtime: ``O(len(key))`` plus the backups."""
        return int(self.insert_below(key, value, extra_key, priority=priority, chunked=chunked).prefix_len)

    def insert_below(
        self,
        key: Any,
        value: Any,
        extra_key: str | None = None,
        *,
        priority: int = 0,
        chunked: bool = False,
        start: int | None = None,
    ) -> Any:
        """:meth:`insert`, continuing the path that ends at the device node ``start``
        when one is given (the tree's ``insert(start=)``: the key's tokens follow that
        path's, and ``prefix_len`` counts the key's only); the tree's ``InsertResult``.
        Runtime: ``O(len(key))`` plus ``O(depth(start))`` nodes, plus the backups."""
        # hold: with nodes to back up, the tree locks the deepest of them, so that they are
        # protected from the insert on, as a backup in flight is (the scheduler admits
        # requests by evictable_size(), and an eviction would start these backups rather
        # than free them); released once their backups have started.
        result = self.tree.insert(
            key, _cpu(value), extra_key, priority=priority, chunked=chunked, hold=self.batch_backups, start=start
        )
        if result.backup_nodes:
            self.backups_asked(result.backup_nodes)
        return result

    def backups_asked(self, nodes: Sequence[int]) -> None:
        """The nodes an insert asked to back up (parents first; with ``batch_backups`` the
        tree's insert locked the last of them, ``hold=True``): noted for the step, or
        started now. Also the entry of :mod:`hiradix.sglang._insert`, which calls the
        tree itself. ``O(len(nodes))`` plus the backups."""
        if self.batch_backups:
            self._pending_backups.extend(nodes)
            self._held.append(nodes[-1])  # the node insert(hold=True) locked
        else:
            self._write_backup_nodes(nodes)

    def cache_finished_req(self, req: Req) -> None:
        """Insert a finished request's KV, free its duplicate and unaligned slots, and
        release its lock. Runtime: ``O(len(req.token_ids))``."""
        kv = req.kv_indices
        n = len(req.token_ids)
        if len(kv) != n:
            raise ValueError(f"request {req.rid!r}: {len(kv)} kv_indices for {n} tokens")
        aligned = n // self.page_size * self.page_size
        new_prefix = self.insert(req.token_ids[:aligned], kv[:aligned], req.extra_key, priority=req.priority)
        self._free_device(kv[len(req.prefix_indices) : new_prefix])
        self._free_device(kv[aligned:])
        if req.last_node != NO_NODE:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = NO_NODE

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Insert a running request's KV so far and move its lock to the new prefix:
        ``req.kv_indices`` takes the tree's slots for the page-aligned part (duplicates are
        freed), ``req.prefix_indices`` becomes that part and ``req.last_node`` its last
        node. The unaligned tail stays in ``req.kv_indices``, owned by the request.
        Runtime: ``O(len(req.token_ids))``."""
        kv = req.kv_indices
        n = len(req.token_ids)
        if len(kv) != n:
            raise ValueError(f"request {req.rid!r}: {len(kv)} kv_indices for {n} tokens")
        aligned = n // self.page_size * self.page_size
        keys = req.token_ids[:aligned]
        new_prefix = self.insert(keys, kv[:aligned], req.extra_key, priority=req.priority, chunked=chunked)
        self._free_device(kv[len(req.prefix_indices) : new_prefix])
        m = self.tree.match_prefix(keys, req.extra_key)
        new_indices = torch.from_numpy(m.device_indices).to(kv.device)
        if len(new_indices) != aligned:
            raise RuntimeError(f"request {req.rid!r}: {len(new_indices)} of {aligned} tokens cached after insert")
        self.tree.inc_lock_ref(m.last_device_node)
        if req.last_node != NO_NODE:
            self.tree.dec_lock_ref(req.last_node)
        req.kv_indices = torch.cat((new_indices, kv[aligned:]))
        req.prefix_indices = new_indices  # the cached, page-aligned part; the tail stays the request's
        req.last_node = m.last_device_node

    # ------------------------------------------------------------------ backup (L1 -> L2)
    def _backed_or_writing(self, node: int) -> bool:
        tree = self.tree
        return tree.is_root(node) or tree.is_backed_up(node) or tree.io_status(node) == IOStatus.WRITING

    def write_backup(self, node: int) -> int:
        """Back up one device node whose parent is backed up (or being backed up);
        returns the tokens whose copy was started (0 if refused). Runtime: ``O(tokens)``."""
        tree = self.tree
        if tree.is_evicted(node) or tree.is_backed_up(node) or tree.io_status(node) != IOStatus.IDLE:
            return 0
        if not self._backed_or_writing(self.tree.parent(node)):
            return 0
        return self._write_backup_nodes([node])

    def start_pending_backups(self, *, now: bool = False) -> int:
        """Start the backups inserts asked for since the last call (``batch_backups``), as
        one submission; returns the tokens whose copy was started. ``now``: the caller
        acknowledges finished backups right after (a step's events, a flush), so an inline
        write engine may copy and commit them at once (:meth:`_write_backup_nodes`), unless
        older backups are still in flight: then these queue behind them, so commits (and
        their KV events) come in start order; an eviction
        leaves them in flight, kept on the device. The waiting nodes were locked
        by their inserts (none was evicted meanwhile) and are released here, once their
        backups hold locks of their own; one backed up or put in flight meanwhile is
        skipped. Parents go before their children, whatever order the inserts came in,
        and a parent no insert asked for (split off a waiting node by a match) goes too:
        the tree's ``backup_order``. Runtime: ``O(sum of the nodes' depths among the waiting ones)``
        plus the backup."""
        pending = self._pending_backups
        if not pending:
            return 0
        held = self._held
        self._pending_backups = []
        self._held = []
        tree = self.tree
        try:
            nodes, sizes = tree.backup_order(pending)
            if not nodes:
                return 0
            return self._write_backup_nodes(nodes, sizes, now=now and not self.ongoing_write_through)
        finally:
            tree.dec_lock_refs(held)  # each backup in flight has its own lock by now

    def _write_backup_nodes(
        self, nodes: Sequence[int], sizes: Sequence[int] | None = None, *, now: bool = False
    ) -> int:
        """Start the backups of ``nodes`` (parents first; ``sizes`` their lengths, read
        from the tree if not given), as one queued batch. Host slots are allocated for
        all, agreed across ranks; those that failed anywhere get one retry after evicting
        that many host tokens. A node without slots, or below one, is left as it was.
        Returns the tokens whose copy was started.

        This runs once per scheduler step for all of the step's write-throughs, so nothing
        here is per node but list work: the host slots are numpy views of one allocation,
        the tree begins every backup in one call (``begin_backups``) and the controller
        gets one batch.

        ``now`` (a batch whose caller acknowledges backups right after it, as a step's
        :meth:`check_hicache_events` does): with an inline write engine and no observer,
        the controller copies at once (:meth:`HiCacheController.write_now`) and the nodes
        are committed here, as :meth:`writing_check` would commit them moments later,
        without a handle, an ack or the in-flight map."""
        tree = self.tree
        ctrl = self.cache_controller
        if sizes is None:
            sizes = [tree.key_len(n) for n in nodes]
        got = self._host_slots_for(nodes, sizes)
        if got is None:
            return 0
        nodes, sizes, hosts, host = got
        device, started = tree.begin_backups(nodes, host)
        if not all(started):  # below a node that got no slots: left as it was
            kept = self._drop_unstarted(nodes, sizes, hosts, started)
            if kept is None:
                return 0
            nodes, sizes, hosts, host = kept
        tokens = sum(sizes)
        if now and not self._observers and ctrl.writes_now:
            self._stats["backup_started_tokens"] += tokens
            self._finish_backups(nodes, hosts, ctrl.write_now(device, host))
            return tokens
        ongoing = self.ongoing_write_through
        for node, s in zip(nodes, hosts, strict=True):
            ongoing[node] = s
        batch = ctrl.write_many(nodes, sizes, device, host)
        for obs in self._observers:
            for op in batch.ops():
                obs.on_backup_started(op.node, op.device_indices, op.host_indices)
        ctrl.start_writing()
        self._stats["backup_started_tokens"] += tokens
        return tokens

    def _host_slots_for(
        self, nodes: Sequence[int], sizes: Sequence[int]
    ) -> tuple[Sequence[int], Sequence[int], list[np.ndarray], np.ndarray] | None:
        """Host slots for the backups of ``nodes`` (``sizes`` tokens each), agreed across
        ranks; those that failed anywhere get one retry after evicting that many host
        tokens, and the nodes still without slots are dropped (counted as failed). Returns
        the nodes, sizes and slots kept and all their slots as one array, or ``None`` if no
        node got slots."""
        ctrl = self.cache_controller
        slots, whole = ctrl.alloc_host_arrays(sizes)
        if whole is None and any(s is None for s in slots):  # agreed: the same on every rank, as the eviction
            failed = [i for i, s in enumerate(slots) if s is None]
            self.evict_host(sum(sizes[i] for i in failed))
            for i, s in zip(failed, ctrl.alloc_host_arrays([sizes[i] for i in failed])[0], strict=True):
                slots[i] = s
            lost = sum(sizes[i] for i, s in enumerate(slots) if s is None)
            if lost:
                self._stats["host_alloc_failed_tokens"] += lost
                keep = [i for i, s in enumerate(slots) if s is not None]
                if not keep:
                    return None
                nodes, sizes, slots = [nodes[i] for i in keep], [sizes[i] for i in keep], [slots[i] for i in keep]
        hosts: list[np.ndarray] = slots  # type: ignore[assignment]  # none is None from here on
        return nodes, sizes, hosts, whole if whole is not None else np.concatenate(hosts)

    def _drop_unstarted(
        self, nodes: Sequence[int], sizes: Sequence[int], hosts: list[np.ndarray], started: Sequence[bool]
    ) -> tuple[Sequence[int], Sequence[int], list[np.ndarray], np.ndarray] | None:
        """After ``begin_backups``: free the host slots of the backups that did not start
        (below a node that got no slots) and count them as failed; the rest as
        :meth:`_host_slots_for` returns them, or ``None`` if none started."""
        for s, go, n in zip(hosts, started, sizes, strict=True):
            if not go:
                self.host_pool.free(s)
                self._stats["host_alloc_failed_tokens"] += n
        keep = [i for i, go in enumerate(started) if go]
        if not keep:
            return None
        hosts = [hosts[i] for i in keep]
        host = hosts[0] if len(hosts) == 1 else np.concatenate(hosts)
        return [nodes[i] for i in keep], [sizes[i] for i in keep], hosts, host

    def writing_check(self, write_back: bool = False) -> None:
        """Complete the backups every rank has finished (all of them with ``write_back``),
        after starting those that batched inserts left waiting (``batch_backups``), so a
        caller sees what it would see without batching: they are acknowledged after the
        backups in flight before them, as they would have been. A failed copy leaves its
        nodes as they were and frees their host slots. Runtime: ``O(nodes acknowledged)``."""
        if self._pending_backups:
            self.start_pending_backups(now=True)  # queued behind any older ones still in flight
        acks = self.cache_controller.ack_writes(wait_all=write_back)
        if not acks:
            return
        ongoing = self.ongoing_write_through
        for ack, ok in acks:
            nodes = ack.nodes
            self._finish_backups(
                nodes, [ongoing.pop(node) for node in nodes], ok, ack.ops if self._observers else ()
            )  # per-node tensors only for observers

    def _finish_backups(
        self, nodes: Sequence[int], hosts: Sequence[np.ndarray], ok: bool, ops: Sequence[CacheOperation] = ()
    ) -> None:
        """Commit the finished backups of ``nodes`` (their host slots ``hosts``), whose
        copy landed on every rank if ``ok``: each becomes backed up (and goes on to L3),
        or, if not committed, is left as it was and its host slots are freed. Observers
        hear of each (``ops``: the nodes' operations). ``O(nodes)``."""
        storage, observers = self.storage, self._observers
        done = failed = 0
        results = self.tree.commit_backups(nodes, ok)
        for i, node in enumerate(nodes):
            host = hosts[i]
            committed = results[i]
            if committed:
                done += host.shape[0]
                storage.backed_up(node)
            else:
                self.host_pool.free(host)
                failed += host.shape[0]
            for obs in observers:
                obs.on_backup_finished(node, ops[i].device_indices, ops[i].host_indices, committed)
        self._stats["backup_done_tokens"] += done
        self._stats["backup_failed_tokens"] += failed

    # ------------------------------------------------------------------ load back (L2 -> L1)
    def load_back(self, node: int, mem_quota: int | None = None) -> torch.Tensor | None:
        """Start loading the evicted chain that ends at ``node`` into fresh device slots;
        returns them, or ``None`` if the chain is shorter than ``load_back_threshold``,
        larger than ``mem_quota`` or does not fit. The chain is locked until
        :meth:`loading_check` sees the copy land. Runtime: ``O(tokens)``."""
        plan = self.tree.plan_load_back(node, self.load_back_threshold, mem_quota)
        return self._load_planned(node, plan.host_indices)

    def _load_planned(self, node: int, host: np.ndarray) -> torch.Tensor | None:
        """Act on the tree's load-back plan for ``node``, whose chain has the host slots
        ``host`` (none: nothing to load): find as many device slots (evicting, while the
        plan keeps the chain and its device anchor) and queue the copy, or give the plan
        back if they cannot be had. One more tree call."""
        n = len(host)
        if n == 0:
            return None
        device = None
        try:
            device = self.alloc_device(n)
        finally:
            if device is None:  # also when allocating raised
                self.tree.cancel_load_back(node)
        if device is None:
            return None
        self.tree.begin_load_back(node, _cpu(device))
        self.cache_controller.load(host, device, node)
        self.ongoing_load_back[node] = device
        self._stats["load_back_tokens"] += n
        for obs in self._observers:
            obs.on_load_started(node, _long(host), _long(device))
        return device

    def init_load_back(
        self, last_node: int, host_hit_length: int, mem_quota: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """Load back the evicted tail of a match (``last_node`` from
        :meth:`match_prefix`): returns the new device slots and the node the request
        should lock. If nothing is loaded, returns no slots and the deepest device node
        above ``last_node``. Runtime: ``O(tokens)``."""
        # One tree call decides; with no host hit it only finds the anchor (quota 0).
        quota = mem_quota if host_hit_length > 0 else 0
        plan = self.tree.plan_load_back(last_node, self.load_back_threshold, quota)
        loaded = self._load_planned(last_node, plan.host_indices)
        if loaded is not None:
            return loaded, last_node
        return _EMPTY, plan.anchor

    def ready_to_load_host_cache(self) -> int:
        """Submit the loads queued since the last call as one layer-wise load; returns the
        producer id for ``cache_controller.layer_done_counter.set_consumer`` (``-1``:
        nothing to load)."""
        return self.cache_controller.start_loading()

    def loading_check(self) -> None:
        """Unlock the loads every rank has finished. A failed load (its forward pass saw a
        :class:`~hiradix.memory.copy.CopyError` in ``wait_until``) is copied again from the
        intact host copy before the chain is unlocked, so no later request reads its
        device slots unfilled; a second failure raises ``CopyError``."""
        for ack, ok in self.cache_controller.ack_loads():
            if not ok:
                self._stats["load_retries"] += 1
                self.cache_controller.load_again(ack)
            for op in ack.ops:
                self.ongoing_load_back.pop(op.node)
                self.tree.finish_load_back(op.node)
                for obs in self._observers:
                    obs.on_load_finished(op.node, op.host_indices, op.device_indices)

    def check_hicache_events(self) -> None:
        """One scheduler step's bookkeeping: acknowledge finished backups (to host and to
        storage) and loads, and free the slots of finished, terminated prefetches. With
        ``batch_backups``, :meth:`writing_check` starts the backups this step's inserts
        asked for."""
        self.writing_check()
        self.loading_check()
        self.storage.check_events()

    # ------------------------------------------------------------------ eviction
    def _free_device(self, indices: Any, evicted: bool = False) -> None:
        if len(indices):
            # The tree hands out numpy arrays; an engine's allocator (SGLang's) takes tensors
            # on its own device.
            if not isinstance(indices, torch.Tensor):
                indices = torch.from_numpy(np.ascontiguousarray(indices)).to(self.device_pool.device)
            self.device_allocator.free(indices)
            for obs in self._observers:
                obs.on_device_freed(indices, evicted)

    def alloc_device(self, n: int) -> torch.Tensor | None:
        """``n`` device slots (a page multiple), evicting as needed; ``None`` if they cannot
        be had. Agreed across ranks: the shortfall by MAX, the outcome by AND (two
        agreement calls), so every rank evicts the same nodes. Runtime: ``O(n)`` plus
        the eviction."""
        short = max(0, n - self.device_allocator.available_size())
        short = -self.agreement.min_int(-short)
        if short:
            self.evict(short)
        slots = self.device_allocator.alloc(n) if n <= self.device_allocator.available_size() else None
        if not self.agreement.all_true([slots is not None])[0]:
            if slots is not None:
                self._free_device(slots)
            return None
        return slots

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns the number freed.

        Three paths, chosen by the tree per victim: a backed-up leaf is demoted (its host
        copy stays), a leaf without a backup is deleted (write-through policies), or,
        under write_back, backed up first (waiting for the copies) and then demoted; a
        write-back victim that cannot be backed up is deleted.
        Runtime: ``O(k log n)`` for ``k`` victims plus any write-back copies.
        """
        if self._pending_backups:  # as without batching: a node being backed up is kept
            self.start_pending_backups()
        freed = 0
        while freed < num_tokens:
            got, more = self._evict_round(num_tokens - freed)
            freed += got
            if not (got and more):
                break
        self._stats["device_evicted_tokens"] += freed
        return freed

    def _evict_round(self, num_tokens: int) -> tuple[int, bool]:
        """One pass of the tree's victim selection. Write-back victims are demoted only
        after their copies land, so their parents become victims in the next round:
        returns the tokens freed and whether another round may free more."""
        tree = self.tree
        result = tree.evict(num_tokens)
        freed = len(result.device_indices)
        self._free_device(result.device_indices, evicted=True)
        if not result.write_back_nodes:
            return freed, False
        if result.backup_nodes:
            self._write_backup_nodes(result.backup_nodes)
        self.writing_check(write_back=True)
        for node in result.write_back_nodes:
            if tree.is_backed_up(node):
                slots = tree.demote(node)
            else:
                slots = tree.drop(node)
                self._stats["write_back_dropped_tokens"] += len(slots)
            freed += len(slots)
            self._free_device(slots, evicted=True)
        return freed, True

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host-only tokens if possible, deepest first;
        returns the number freed. Runtime: ``O(k log n)``."""
        result = self.tree.evict_host(num_tokens)
        if len(result.host_indices):
            self.host_pool.free(result.host_indices)
        self._stats["host_evicted_tokens"] += int(result.num_evicted)
        return int(result.num_evicted)

    # ------------------------------------------------------------------ lifecycle
    def inc_lock_ref(self, node: int) -> int:
        """Protect ``node`` and its ancestors from eviction. ``O(depth)``."""
        return int(self.tree.inc_lock_ref(node))

    def dec_lock_ref(self, node: int) -> int:
        """Undo one :meth:`inc_lock_ref`. ``O(depth)``."""
        return int(self.tree.dec_lock_ref(node))

    def flush(self) -> None:
        """Wait for every submitted copy and acknowledge it (every rank must call it)."""
        self.start_pending_backups(now=True)
        self.cache_controller.start_writing()
        self.cache_controller.start_loading()
        self.cache_controller.drain()
        self.writing_check(write_back=True)
        while self.ongoing_load_back:
            self.loading_check()

    def reset(self) -> None:
        """Wait for in-flight copies and L3 operations, then empty the tree and both
        pools (an attached backend stays attached, its pages untouched)."""
        self.flush()
        storage = self.storage
        l3, pass_prefix_keys = storage.l3, storage.pass_prefix_keys
        if l3 is not None:
            storage.detach_storage_backend()
        self.tree.reset()
        self.device_allocator.clear()
        self.host_pool.clear()
        if l3 is not None:  # as it was attached (its key suffix stays the tier's)
            storage.attach_storage_backend(
                l3.backend, prefetch=l3.config, inline=l3.inline, pass_prefix_keys=pass_prefix_keys
            )

    def close(self) -> None:
        """Flush, detach any L3 backend and stop the controller's engines."""
        self.flush()
        if self.storage.l3 is not None:
            self.storage.detach_storage_backend()
        self.cache_controller.close()

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ checks
    def check_invariants(self, outstanding_device: int = 0) -> None:
        """Check the tree's invariants and slot conservation in both pools:
        free + cached (+ in-flight) + ``outstanding_device`` (slots held by requests and
        not in the tree) equals the pool size. ``O(n)``."""
        self.tree.check_invariants()
        dev_free = self.device_allocator.available_size()
        if dev_free + self.tree.device_size() + outstanding_device != self.device_allocator.size:
            raise AssertionError(
                f"device slots: {dev_free} free + {self.tree.device_size()} cached + {outstanding_device} "
                f"outstanding != {self.device_allocator.size}"
            )
        in_flight = sum(len(h) for h in self.ongoing_write_through.values())
        in_flight += self.storage.host_slots_in_flight()
        host_free = self.host_pool.available_size()
        if host_free + self.tree.host_size() + in_flight != self.host_pool.size:
            raise AssertionError(
                f"host slots: {host_free} free + {self.tree.host_size()} backed up + {in_flight} in flight "
                f"!= {self.host_pool.size}"
            )

    def pending_protections(self) -> tuple[int, int]:
        """Nodes locked by in-flight backups and loads (both 0 once :meth:`flush` ran)."""
        return len(self.ongoing_write_through), len(self.ongoing_load_back)
