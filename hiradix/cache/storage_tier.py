"""The cache's third tier: L3 prefetches and backups between the tree and the L3 threads.

:class:`StorageTier` is what :class:`~hiradix.cache.HiRadixCache` does with an L3
(:class:`~hiradix.storage.base.StorageBackend`): it decides nothing (the tree says which
nodes are backed up and where a prefetch mounts) and moves no bytes (the
:class:`~hiradix.cache.l3.L3Controller`'s threads do). In between it holds what is in
flight and acts on the tree when the threads are done:

- **prefetch** (L3 -> L2): :meth:`StorageTier.prefetch_from_storage` protects the mount
  point (``inc_host_ref``), allocates host slots (evicting host-only KV once for room) and
  queues the operation; :meth:`StorageTier.check_prefetch_progress` ends it when the
  policy allows (agreed across ranks), inserts the pages that landed on every rank as
  host-only nodes and queues the rest of its slots for release;
- **backup** (L2 -> L3): :meth:`StorageTier.write_backup_storage` protects a backed-up
  node's host copy until :meth:`StorageTier.check_backup_progress` sees its write done on
  every rank;
- **release queue**: a prefetch's unfilled slots go back to the host pool only once the
  L3 threads are done with its operation (a terminated one may still have a read in
  flight).

Method names follow SGLang 0.5.18's ``HiRadixCache`` (``prefetch_from_storage``,
``check_prefetch_progress``, ``release_aborted_request``, ``pop_prefetch_loaded_tokens``,
``attach_storage_backend``, ``detach_storage_backend``, ``write_backup_storage``). One
instance belongs to one cache (:attr:`HiRadixCache.storage
<hiradix.cache.HiRadixCache.storage>`), built from a :class:`StorageOptions`;
single-threaded, on the scheduler's thread, like the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hiradix.cache.controller import HiCacheController
from hiradix.cache.distributed import RankAgreement
from hiradix.cache.l3 import BackupOperation, L3Controller, PrefetchConfig, PrefetchOperation
from hiradix.cache.stats import TIER_COUNTERS
from hiradix.memory.pools import HostKVPool
from hiradix.storage.base import StorageBackend, check_keys
from hiradix.storage.keys import KEY_HEX_CHARS, KeyNamespace, storage_keys
from hiradix.tree._results import NO_NODE

if TYPE_CHECKING:
    from hiradix.cache.results import CacheMatchResult
    from hiradix.tree import HiRadixTree

__all__ = ["OngoingPrefetch", "StorageOptions", "StorageTier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """How a cache's :class:`StorageTier` keys and runs L3 operations.

    ``backend``: an L3 backend to attach when the cache is built (default none; one can
    be attached later with :meth:`StorageTier.attach_storage_backend`), with the
    ``prefetch`` policy (:class:`~hiradix.cache.l3.PrefetchConfig`, default its defaults).
    ``namespace``: the key namespace (its ``extra_key()`` is the tree namespace of the
    requests that pass it) and ``tp_rank`` this rank's TP rank (key suffix for sharded
    pages). ``key_suffix``: appended to every storage key (SGLang's model and rank
    suffix, see :func:`hiradix.storage.keys.sglang_key_suffix`). ``prefetch_agreement``:
    the agreement the prefetch thread uses (a process group of its own; default one
    rank). ``inline``: run the L3 operations in the caller's thread (simulators; see
    :class:`~hiradix.cache.l3.L3Controller`).

    Checked when built: ``TypeError`` / ``ValueError`` for a backend that is not a
    :class:`~hiradix.storage.base.StorageBackend`, a prefetch policy that is not a
    :class:`~hiradix.cache.l3.PrefetchConfig`, or a namespace, TP rank and suffix that
    give no valid storage key.

    >>> StorageOptions(key_suffix="_model").tp_rank
    0
    """

    backend: StorageBackend | None = None
    prefetch: PrefetchConfig | None = None
    namespace: KeyNamespace | None = None
    tp_rank: int = 0
    key_suffix: str = ""
    prefetch_agreement: RankAgreement | None = None
    inline: bool = False

    def __post_init__(self) -> None:
        kinds: tuple[tuple[str, type], ...] = (
            ("backend", StorageBackend),
            ("prefetch", PrefetchConfig),
            ("namespace", KeyNamespace),
            ("prefetch_agreement", RankAgreement),
        )
        for name, kind in kinds:
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
        if not isinstance(self.key_suffix, str):
            raise TypeError(f"key_suffix must be a str, got {type(self.key_suffix).__name__}")
        # A key of the longest form these options give: the TP rank fits the namespace and
        # the whole key is a valid storage key.
        check_keys([k + self.key_suffix for k in storage_keys(["0" * KEY_HEX_CHARS], self.namespace, self.tp_rank)])


@dataclass(eq=False)
class OngoingPrefetch:
    """A prefetch the cache is waiting for: the backed-up node its pages will hang from
    (protected with ``inc_host_ref`` meanwhile), the tokens and the host slots."""

    mount: int
    tokens: np.ndarray
    host_indices: torch.Tensor
    op: PrefetchOperation


class StorageTier:
    """A cache's L3 orchestration (module docstring): the attached backend's
    :class:`~hiradix.cache.l3.L3Controller` and the prefetches, backups and slot releases
    in flight.

    Parameters
    ----------
    options:
        Keys and L3 settings (:class:`StorageOptions`); its ``backend``, if any, is
        attached here.
    tree, host_pool, controller:
        The cache's tree, L2 pool and controller (host allocations and the cross-rank
        agreement).
    evict_host:
        The cache's host eviction (``evict_host(tokens)``), which makes room for a
        prefetch.
    clock:
        Seconds, for prefetch timeouts (the L3 controller's default if ``None``).
    """

    def __init__(
        self,
        options: StorageOptions,
        *,
        tree: HiRadixTree,
        host_pool: HostKVPool,
        controller: HiCacheController,
        evict_host: Callable[[int], int],
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(options, StorageOptions):
            raise TypeError(f"options must be StorageOptions, got {type(options).__name__}")
        self.options = options
        self.tree = tree
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.cache_controller = controller
        self.agreement = controller.agreement
        self._evict_host = evict_host
        self._stats = dict.fromkeys(TIER_COUNTERS, 0)  # its own; the cache's get_stats adds them in
        self.clock = clock
        self.key_suffix = options.key_suffix  # replaced per backend (attach_storage_backend)
        self.pass_prefix_keys = False  # set per attached backend (attach_storage_backend)
        self.l3: L3Controller | None = None
        self.ongoing_prefetch: dict[Any, OngoingPrefetch] = {}
        self.ongoing_backup: list[BackupOperation] = []
        self.prefetch_loaded_tokens_by_reqid: dict[Any, int] = {}
        self._release_queue: list[tuple[PrefetchOperation, torch.Tensor]] = []
        if options.backend is not None:
            ok, msg = self.attach_storage_backend(options.backend, prefetch=options.prefetch, inline=options.inline)
            assert ok, msg

    def counters(self) -> dict[str, int]:
        """A copy of the tier's counters (:data:`~hiradix.cache.stats.TIER_COUNTERS`). ``O(1)``."""
        return dict(self._stats)

    # ------------------------------------------------------------------ backend
    @property
    def enable_storage(self) -> bool:
        """Whether an L3 backend is attached."""
        return self.l3 is not None

    def _key_fn(self, hashes: Sequence[str]) -> list[str]:
        keys = storage_keys(hashes, self.options.namespace, self.options.tp_rank)
        suffix = self.key_suffix
        return [k + suffix for k in keys] if suffix else keys

    def attach_storage_backend(
        self,
        backend: StorageBackend,
        *,
        prefetch: PrefetchConfig | None = None,
        inline: bool = False,
        key_suffix: str | None = None,
        pass_prefix_keys: bool = False,
    ) -> tuple[bool, str]:
        """Attach an L3 backend at runtime (every rank together). Returns ``(ok,
        message)``; refuses while another backend is attached. ``inline`` runs the L3
        operations in the caller's thread (see :class:`~hiradix.cache.l3.L3Controller`);
        ``key_suffix``, if given, replaces the storage-key suffix from this backend on
        (one that appends its own, as SGLang's do, takes ``""``); ``pass_prefix_keys``
        hands the backend, with each call, the keys of the pages before those of the
        call (SGLang's ``hicache_storage_pass_prefix_keys``, for backends that place pages
        by prefix). ``O(1)`` plus starting the three L3 threads, and ``O(cached
        tokens)`` once in a tree built without page hashes, which then hashes the pages
        it holds."""
        if self.l3 is not None:
            return False, f"storage backend {self.l3.backend.name!r} is attached; detach it first"
        if key_suffix is not None and not isinstance(key_suffix, str):
            raise TypeError(f"key_suffix must be a str, got {type(key_suffix).__name__}")
        if not self.tree.enable_hash:
            # L3 keys are page hashes: a tree built without them hashes what it holds now.
            self.tree.enable_hashing()
        if key_suffix is not None:
            self.key_suffix = key_suffix
        self.pass_prefix_keys = bool(pass_prefix_keys)
        kwargs: dict[str, Any] = {} if self.clock is None else {"clock": self.clock}
        self.l3 = L3Controller(
            backend,
            self.host_pool,
            config=prefetch,
            key_fn=self._key_fn,
            agreement=self.options.prefetch_agreement,
            inline=inline,
            **kwargs,
        )
        return True, f"attached storage backend {backend.name!r}"

    def detach_storage_backend(self) -> tuple[bool, str]:
        """Detach the L3 backend (every rank together): abort the prefetches in flight,
        let the L3 threads finish what they hold, then release every protection and every
        prefetch slot. The tree and both pools are left consistent; nothing is lost but
        the L3 copies themselves. ``O(in-flight operations)``."""
        l3 = self.l3
        if l3 is None:
            return False, "no storage backend is attached"
        for req_id in list(self.ongoing_prefetch):
            self.release_aborted_request(req_id)
        l3.stop()
        self.check_backup_progress()
        assert not self.ongoing_backup, "backups still pending after the L3 threads stopped"
        self._drain_release_queue()
        assert not self._release_queue, "prefetch slots still held after the L3 threads stopped"
        self.l3 = None
        return True, f"detached storage backend {l3.backend.name!r}"

    # ------------------------------------------------------------------ keys
    def prior_hash(self, node: int) -> str | None:
        """The hash the chain of pages below ``node`` continues from: its last page's,
        or at a (namespace) root the chain's seed (``None``: unseeded). ``O(1)``."""
        if self.tree.parent(node) == NO_NODE:
            return self.tree.root_seed(node)
        hashes = self.tree.hash_value(node)
        assert hashes, f"node {node} has no page hashes"
        return str(hashes[-1])

    def prefix_hashes(self, node: int) -> list[str]:
        """The page hashes from ``node``'s (namespace) root down to ``node`` inclusive,
        in order: the prefix keys of what follows it. ``O(depth + pages)``."""
        parts: list[list[str]] = []
        while self.tree.parent(node) != NO_NODE:
            parts.append(self.tree.hash_value(node) or [])
            node = self.tree.parent(node)
        return [h for part in reversed(parts) for h in part]

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    def prefetch_mount(self, match: CacheMatchResult) -> tuple[int, int]:
        """Where an L3 prefetch for ``match``'s key attaches: the deepest matched node that
        is backed up (a root if none), and the number of key tokens up to it. The tokens
        after those are what :meth:`prefetch_from_storage` should fetch.
        Runtime: ``O(depth)``."""
        tree = self.tree
        node = match.last_node
        while not tree.is_root(node) and not tree.is_backed_up(node):
            node = tree.parent(node)
        length, walk = 0, node
        while tree.parent(walk) != NO_NODE:
            length += tree.key_len(walk)
            walk = tree.parent(walk)
        return node, length

    def prefetch_from_storage(
        self,
        req_id: Any,
        last_host_node: int,
        new_input_tokens: Any,
        last_hash: str | None = None,
    ) -> bool:
        """Start fetching the pages that follow the backed-up ``last_host_node`` from L3
        into freshly allocated host slots; returns whether a prefetch was started.

        Nothing starts without storage, for fewer than ``threshold_tokens`` page-aligned
        tokens, past the prefetch capacity or without host room once host-only pages
        were evicted for it (each counted in the cache's stats). ``last_hash`` defaults
        to :meth:`prior_hash` of the node (the hash of its last page, or its root's seed).
        Every rank must call it alike.
        Runtime: ``O(1)`` here; the work runs on the L3 threads.
        """
        l3 = self.l3
        if l3 is None:
            return False
        if req_id in self.ongoing_prefetch:
            raise ValueError(f"request {req_id!r} already has a prefetch in flight")
        tokens = np.asarray(new_input_tokens)
        n = len(tokens) // self.page_size * self.page_size
        if n < max(l3.config.threshold_tokens, self.page_size):
            return False
        if not self.tree.is_root(last_host_node) and not self.tree.is_backed_up(last_host_node):
            raise ValueError(f"prefetch mount point {last_host_node} is not backed up")
        in_flight = sum(len(p.host_indices) for p in self.ongoing_prefetch.values())
        if in_flight + n > l3.capacity_tokens:
            self._stats["prefetch_skipped_capacity"] += n
            return False
        host = self._host_slots(last_host_node, n)
        if host is None:
            self._stats["prefetch_skipped_no_host"] += n
            return False
        prior = last_hash if last_hash is not None else self.prior_hash(last_host_node)
        prefix = self.prefix_hashes(last_host_node) if self.pass_prefix_keys else None
        op = l3.prefetch(req_id, host, tokens[:n], prior, prefix)
        self.ongoing_prefetch[req_id] = OngoingPrefetch(last_host_node, tokens[:n], host, op)
        self._stats["prefetch_started_tokens"] += n
        return True

    def query_hit_tokens(self, mount: int, tokens: np.ndarray, last_hash: str | None = None) -> int:
        """Page-aligned tokens of ``tokens`` that L3 holds after ``mount`` (the pages that
        would follow it, looked up now, on the caller's thread), agreed across ranks by
        MIN; 0 without a backend or below ``threshold_tokens``. A storage failure counts
        as a miss (logged), never as an error. Every rank must call it alike.
        ``O(pages)`` plus the backend's lookups."""
        l3 = self.l3
        if l3 is None:
            return 0
        n = len(tokens) // self.page_size * self.page_size
        if n < l3.config.threshold_tokens or n == 0:
            return 0
        prior = last_hash if last_hash is not None else self.prior_hash(mount)
        try:
            prefix = l3.prefix_keys_of(self.prefix_hashes(mount)) if self.pass_prefix_keys else None
            _, hit = l3.hit_pages(tokens[:n], prior, prefix)
        except Exception:  # a storage failure is a miss, never an error in the scheduler
            log.warning("hiradix: batch_exists failed on %s; counting a miss", l3.backend.name, exc_info=True)
            hit = 0
        return self.agreement.min_int(hit * self.page_size)

    def _host_slots(self, mount: int, n: int) -> torch.Tensor | None:
        """``n`` host slots for a prefetch under ``mount``, agreed across ranks, or
        ``None``; the mount is left protected (``inc_host_ref``) only when they are had.
        As SGLang's, room is taken from the host's least recently used pages once (every
        rank alike: the same tree evicts the same nodes)."""
        self.tree.inc_host_ref(mount)  # the mount stays while room is made below
        (host,) = self.cache_controller.alloc_host([n])
        if host is None:
            self._evict_host(n)
            (host,) = self.cache_controller.alloc_host([n])
        if host is None:
            self.tree.dec_host_ref(mount)
        return host

    def wait_prefetch(self, req_id: Any, timeout: float | None = None) -> bool:
        """Block until the L3 threads are done with ``req_id``'s prefetch (rank-local, no
        agreement); returns whether they are. For a caller that wants the whole prefetch,
        e.g. a simulator, before :meth:`check_prefetch_progress`."""
        entry = self.ongoing_prefetch.get(req_id)
        return True if entry is None else entry.op.io_done.wait(timeout)

    def check_prefetch_progress(self, req_id: Any) -> bool:
        """If the prefetch policy lets ``req_id``'s prefetch end now (agreed across
        ranks), end it: insert the pages that landed on every rank as host-only nodes
        under the mount point, release the rest, and return ``True``. The tokens newly
        loaded are kept for :meth:`pop_prefetch_loaded_tokens`. Returns ``True`` at once
        for a request with no prefetch. Runtime: ``O(tokens)``."""
        entry = self.ongoing_prefetch.get(req_id)
        if entry is None:
            return True
        l3 = self.l3
        assert l3 is not None, "prefetches are aborted when the backend is detached"
        if not self.agreement.all_true([l3.can_terminate(entry.op)])[0]:
            return False
        pages = self.agreement.min_int(l3.terminate(entry.op))
        n = pages * self.page_size
        loaded = 0
        if n:
            res = self.tree.insert_host(entry.mount, entry.tokens[:n], entry.host_indices[:n])
            lo, hi = int(res.matched_length), int(res.matched_length + res.inserted_length)
            loaded = hi - lo
            unused = torch.cat((entry.host_indices[:lo], entry.host_indices[hi:n]))
            if len(unused):
                self.host_pool.free(unused)
        self._release_queue.append((entry.op, entry.host_indices[n:]))
        self.tree.dec_host_ref(entry.mount)
        del self.ongoing_prefetch[req_id]
        self.prefetch_loaded_tokens_by_reqid[req_id] = loaded
        self._stats["prefetch_loaded_tokens"] += loaded
        self._stats["prefetch_wasted_tokens"] += len(entry.host_indices) - loaded
        return True

    def release_aborted_request(self, req_id: Any) -> None:
        """Forget ``req_id``'s prefetch: stop it, unprotect its mount point and release all
        its slots (once the L3 threads are done with them). ``O(1)``."""
        self.prefetch_loaded_tokens_by_reqid.pop(req_id, None)
        entry = self.ongoing_prefetch.pop(req_id, None)
        if entry is None:
            return
        assert self.l3 is not None
        self.l3.terminate(entry.op)
        self._release_queue.append((entry.op, entry.host_indices))
        self.tree.dec_host_ref(entry.mount)
        self._stats["prefetch_wasted_tokens"] += len(entry.host_indices)

    def pop_prefetch_loaded_tokens(self, req_id: Any) -> int:
        """Tokens ``req_id``'s finished prefetch added to the tree (0 if none). ``O(1)``."""
        return self.prefetch_loaded_tokens_by_reqid.pop(req_id, 0)

    def _drain_release_queue(self) -> None:
        keep = []
        for op, slots in self._release_queue:
            if op.finished():
                if len(slots):
                    self.host_pool.free(slots)
            else:
                keep.append((op, slots))
        self._release_queue = keep

    # ------------------------------------------------------------------ backup (L2 -> L3)
    def write_backup_storage(self, node: int) -> None:
        """Queue an L2 -> L3 write of a backed-up node, protecting its host copy until
        :meth:`check_backup_progress` sees it done. ``O(pages)``."""
        assert self.l3 is not None
        hashes = self.tree.hash_value(node)
        host = self.tree.host_value(node)
        if hashes is None or host is None:
            raise ValueError(f"write_backup_storage: node {node} has no host copy or no page hashes")
        self.tree.inc_host_ref(node)
        prefix = self.prefix_hashes(self.tree.parent(node)) if self.pass_prefix_keys else None
        self.ongoing_backup.append(self.l3.backup(node, hashes, torch.from_numpy(host), prefix))
        self._stats["storage_backup_tokens"] += len(host)

    def check_backup_progress(self) -> None:
        """Unprotect the nodes whose L3 writes every rank has finished (agreed by MIN,
        in queue order). ``O(finished)``."""
        local = 0
        for op in self.ongoing_backup:
            if not op.done.is_set():
                break
            local += 1
        n = self.agreement.min_int(local)
        for op in self.ongoing_backup[:n]:
            self.tree.dec_host_ref(op.node)
        del self.ongoing_backup[:n]

    # ------------------------------------------------------------------ the cache's hooks
    def backed_up(self, node: int) -> None:
        """``node``'s device -> host backup was committed: with a backend attached, its
        host copy goes on to L3 (:meth:`write_backup_storage`). ``O(pages)``."""
        if self.l3 is not None:
            self.write_backup_storage(node)

    def check_events(self) -> None:
        """One scheduler step's L3 bookkeeping (the cache's ``check_hicache_events``):
        acknowledge finished L3 backups and free the slots of finished, terminated
        prefetches. ``O(finished)``."""
        if self.l3 is not None or self.ongoing_backup:
            self.check_backup_progress()
        self._drain_release_queue()

    def host_slots_in_flight(self) -> int:
        """Host slots held by prefetches in flight and by the release queue (neither free
        nor in the tree; the cache's slot-conservation check). ``O(in flight)``."""
        held = sum(len(p.host_indices) for p in self.ongoing_prefetch.values())
        return held + sum(len(slots) for _, slots in self._release_queue)

    def pending_storage(self) -> tuple[int, int, int]:
        """Prefetches in flight, L3 backups unacknowledged and prefetch slot batches not
        yet released (all 0 after a detach)."""
        return len(self.ongoing_prefetch), len(self.ongoing_backup), len(self._release_queue)
