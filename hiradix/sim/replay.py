"""Replay a trace through :class:`hiradix.cache.HiRadixCache` and count what each tier served.

The :class:`Replayer` drives a real three-tier cache (device pool, host pool, L3 storage
backend, the controller and its L3 threads) one request at a time, as a scheduler would:

1. ``match_prefix``; a request that cannot fit on the device even after evicting every
   unlocked token stops here (counted as too large, nothing inserted).
2. With an L3 tier and at least ``threshold_tokens`` missed: ``prefetch_from_storage``
   of the key after :meth:`~hiradix.cache.StorageTier.prefetch_mount` (host room made
   with ``evict_host`` first, as SGLang's ``prefetch_from_storage`` does), then
   ``check_prefetch_progress`` until the policy lets it end, and a second match.
3. ``init_load_back`` of the host tail (host hit plus what L3 brought), ``inc_lock_ref``,
   ``alloc_device`` for the rest (evicting as needed).
4. The forward pass: ``ready_to_load_host_cache`` and ``wait_until`` every layer. The KV
   "compute" is a no-op: the pools are 2 bytes per token (one layer of
   ``MLAShape(1, 1, 1)``, ``uint8``), so a full trace fits in memory. With
   ``verify_bytes`` it writes each new token's KV as a function of the token, its position
   and the token before it, and every reused prefix (device hit, host and L3 load-back) is
   checked against that function first: a page that came back from any tier with another
   page's bytes is counted in ``corrupt_tokens``.
5. ``cache_finished_req`` (insert, backups per the write policy), ``check_hicache_events``.

Nothing here decides what is cached, evicted, backed up or fetched: the hit rates are
those of the library. Two things make a replay deterministic, and both are documented
choices of the simulator, not changes to the cache:

* **Synchronous copies.** The controller's copy engines run inline
  (``HiCacheController(inline_copies=True)``: the CPU engine with each copy run on the
  caller's thread at submission instead of on its worker thread; same validation, same
  copy code). A backup is therefore done by the next ``check_hicache_events``, as if
  copies were much faster than a request.

The replayer uses only the cache's public API; what it counts beyond ``cache.stats``
(device evictions split into demoted and deleted tokens, backups per node) comes from
a :class:`~hiradix.cache.CacheObserver`.
* **Prefetches and L3 writes complete between requests** (``prefetch_wait=True``, the
  default): the replayer waits for the L3 threads to finish a request's prefetch before
  ``check_prefetch_progress``, as if the request waited in the queue long enough, and for
  the L3 backups of a request before the next one, so L3 holds what was written. With
  ``prefetch_wait=False`` it only polls ``check_prefetch_progress``: under
  ``best_effort`` that ends at once with whatever landed (usually nothing), and the
  result depends on thread timing.

Hit-rate definitions
--------------------
A request's *prompt* is its token ids cut to a multiple of ``page_size`` (the tree
caches whole pages only; the unaligned tail is always recomputed).

* Token hit rates are hit tokens over prompt tokens, summed over requests. The *device
  hit* is the matched prefix that is still on the device; the *host hit* is the matched
  tail after it that was only on the host and was loaded back; the *L3 hit* is what the
  request's prefetch added after that (and was loaded back with it). A host tail that is
  not loaded back (shorter than ``load_back_threshold``, or no device room) is a miss.
* Block hit rates count 512-token trace blocks over *all* blocks of the trace. A block is
  hit when every token of it that the prompt holds was hit, and the prompt holds at least
  one; a block that straddles a tier boundary counts for the lower tier.
* The *ideal* is the hit under infinite capacity, computed from the trace's block ids
  without the cache: a request's blocks count only up to its first never-seen block, and
  those blocks are turned into page-aligned prompt tokens and blocks as above. At
  ``page_size=1`` the block ideal is the trace README's (0.3664 on the conversation
  trace); at larger pages it counts only what whole pages can hold. With unbounded
  capacities the cache reaches the ideal exactly, at any page size.
* A request too large for the device counts its device hit only; it is not inserted.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

import hiradix
from hiradix.cache import CacheObserver, HiRadixCache, Req, StorageOptions, TierOptions, TreeFactory, TreeOptions
from hiradix.cache.controller import HiCacheController
from hiradix.cache.l3 import PREFETCH_POLICIES, PrefetchConfig
from hiradix.memory.pools import DeviceKVPool, HostKVPool, MLAShape
from hiradix.sim.trace import BLOCK_TOKENS, TraceRequest
from hiradix.storage.base import StorageBackend
from hiradix.storage.registry import create_backend

KV_SHAPE = MLAShape(layer_num=1, kv_lora_rank=1, qk_rope_head_dim=1)
"""The replay's KV shape: the smallest the pools take (2 elements per token)."""
KV_DTYPE = torch.uint8
KV_BYTES_PER_TOKEN = 2
L3_BACKENDS = ("memory", "file", "peer", "mooncake")
"""L3 backends the replayer builds by name (any registered backend instance also works):
``peer`` is an in-process peer-cache cluster of :data:`PEER_NODES` nodes on loopback TCP,
``mooncake`` a Mooncake Store client (of a private ``mooncake_master`` unless one is named)."""
PEER_NODES = 3
_DEFAULT_UNBOUNDED_TOKENS = 1 << 24  # pool size for an unbounded tier when no workload bounds it
_HOST_RESERVE_BYTES = 256 << 20  # MemAvailable headroom the host pool check keeps


@dataclass
class ReplayStats:
    """Counters of a replay (all in tokens unless named otherwise).

    See the module docstring for the definitions of the hit rates.
    """

    requests: int = 0
    too_large_requests: int = 0  # could not get device slots even after evicting all it could
    input_tokens: int = 0  # prompt tokens as in the trace
    prompt_tokens: int = 0  # page-aligned prompt tokens: the denominator of token rates
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    l3_hit_tokens: int = 0  # served from L3 storage (0 until the replay goes through an L3 cache)
    l3_write_tokens: int = 0  # host -> L3 copies
    ideal_hit_tokens: int = 0
    blocks: int = 0  # 512-token blocks: the denominator of block rates
    device_hit_blocks: int = 0
    host_hit_blocks: int = 0
    l3_hit_blocks: int = 0
    ideal_hit_blocks: int = 0
    load_back_tokens: int = 0  # host -> device copies
    device_demoted_tokens: int = 0  # evicted from the device, kept on the host
    device_deleted_tokens: int = 0  # evicted from the device with no host copy: lost
    host_evicted_tokens: int = 0
    backup_nodes: int = 0  # device -> host copies
    backup_tokens: int = 0
    backup_skipped_tokens: int = 0  # not backed up: the host was full of unevictable KV
    write_back_failed_tokens: int = 0  # write_back victims left on the device (no host room), per try
    # L3 prefetch outcomes, one per request that issued a prefetch (all 0 without an L3).
    prefetch_completed: int = 0  # everything asked for arrived
    prefetch_partial: int = 0  # stopped early (best_effort / timeout): a shorter L3 hit
    prefetch_failed: int = 0  # storage error: the tokens were recomputed
    prefetch_issued: int = 0  # prefetches started (L3 was asked), whatever they found
    # verify_bytes: reused prefix tokens checked, and those whose KV bytes were wrong
    verified_tokens: int = 0
    corrupt_tokens: int = 0

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.device_hit_tokens - self.host_hit_tokens - self.l3_hit_tokens

    def rates(self) -> dict[str, float]:
        """Hit rates (0.0 when the denominator is 0)."""

        def ratio(a: int, b: int) -> float:
            return a / b if b else 0.0

        hit_tokens = self.device_hit_tokens + self.host_hit_tokens + self.l3_hit_tokens
        hit_blocks = self.device_hit_blocks + self.host_hit_blocks + self.l3_hit_blocks
        return {
            "device_token_hit_rate": ratio(self.device_hit_tokens, self.prompt_tokens),
            "host_token_hit_rate": ratio(self.host_hit_tokens, self.prompt_tokens),
            "l3_token_hit_rate": ratio(self.l3_hit_tokens, self.prompt_tokens),
            "token_hit_rate": ratio(hit_tokens, self.prompt_tokens),
            "ideal_token_hit_rate": ratio(self.ideal_hit_tokens, self.prompt_tokens),
            "device_block_hit_rate": ratio(self.device_hit_blocks, self.blocks),
            "host_block_hit_rate": ratio(self.host_hit_blocks, self.blocks),
            "l3_block_hit_rate": ratio(self.l3_hit_blocks, self.blocks),
            "block_hit_rate": ratio(hit_blocks, self.blocks),
            "ideal_block_hit_rate": ratio(self.ideal_hit_blocks, self.blocks),
        }

    def to_dict(self) -> dict[str, Any]:
        """Counters, ``miss_tokens`` and :meth:`rates`, for JSON."""
        return {**asdict(self), "miss_tokens": self.miss_tokens, **self.rates()}


def hit_blocks(hit: int, prompt: int) -> int:
    """Blocks counted as hit when the first ``hit`` of ``prompt`` page-aligned tokens hit.

    Every block whose prompt tokens were all hit counts; when the whole prompt hit, that
    includes a last block that the prompt holds only in part.

    >>> hit_blocks(1024, 1300), hit_blocks(1296, 1296), hit_blocks(0, 0)
    (2, 3, 0)
    """
    return -(-prompt // BLOCK_TOKENS) if hit == prompt else hit // BLOCK_TOKENS


PREFETCH_OUTCOMES = ("completed", "partial", "failed")
"""Values of :attr:`Served.prefetch` other than ``""`` (no prefetch issued)."""


@dataclass(frozen=True, slots=True)
class Served:
    """What :meth:`Replayer.serve` did for one prompt (tokens).

    The prompt splits, in order, into ``device_hit`` tokens already on the device,
    ``host_hit`` tokens loaded back from the host, ``l3_hit`` tokens fetched from L3
    storage, and a recomputed rest. ``l3_hit`` and ``prefetch`` stay at their defaults
    until the replay goes through a cache with an L3 tier; ``prefetch`` is then one of
    :data:`PREFETCH_OUTCOMES` for a request that issued an L3 prefetch.
    """

    device_hit: int
    host_hit: int
    fitted: bool  # False: too large for the device; nothing was inserted
    l3_hit: int = 0
    prefetch: str = ""

    def __post_init__(self) -> None:
        if self.prefetch and self.prefetch not in PREFETCH_OUTCOMES:
            raise ValueError(f"prefetch must be '' or one of {PREFETCH_OUTCOMES}, got {self.prefetch!r}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served request as :meth:`Replayer.replay` reports it to its observer.

    ``prompt`` is the page-aligned prompt length, ``ideal`` the tokens an infinite cache
    would have hit, and ``device_used`` / ``host_used`` / ``l3_used`` the tokens each tier
    holds after the request (see :meth:`Replayer.occupancy`).
    """

    request: TraceRequest
    prompt: int
    ideal: int
    served: Served
    device_used: int
    host_used: int
    l3_used: int = 0


class _EvictionLedger(CacheObserver):
    """Splits device evictions into *demoted* (a host copy stays) and *deleted* tokens,
    from the cache's observer events (:class:`~hiradix.cache.CacheObserver`).

    One bit per device slot says whether the slot's KV has a host copy: set when a backup
    of the slot is acknowledged or a load into it lands, cleared when the slot is freed.
    Evicting frees are counted by that bit; node backups are counted as they are queued.
    Decides nothing. ``O(slots)`` per event.
    """

    def __init__(self, device_slots: int) -> None:
        self.has_host = np.zeros(device_slots, dtype=bool)
        self.demoted = 0
        self.deleted = 0
        self.backup_nodes = 0  # device -> host copies started, one per node

    def on_backup_started(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        self.backup_nodes += 1

    def on_backup_finished(self, node: int, device_indices: torch.Tensor, host_indices: torch.Tensor, ok: bool) -> None:
        if ok:
            self.has_host[device_indices.numpy()] = True

    def on_load_finished(self, node: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self.has_host[device_indices.numpy()] = True

    def on_device_freed(self, indices: torch.Tensor, evicted: bool) -> None:
        idx = indices.cpu().numpy()
        if evicted:
            backed = int(np.count_nonzero(self.has_host[idx]))
            self.demoted += backed
            self.deleted += len(idx) - backed
        self.has_host[idx] = False


def kv_content(tokens: np.ndarray) -> np.ndarray:
    """The replay's KV bytes of a prompt under ``verify_bytes``: ``[len, 2]`` ``uint8``,
    token ``i``'s a mix of the token, its position and the token before it, so that a page
    of another prefix, position or request differs. ``O(len)`` vectorized.

    >>> kv_content(np.array([5, 5, 7])).shape
    (3, 2)
    >>> bool((kv_content(np.array([1, 2]))[1] != kv_content(np.array([3, 2]))[1]).any())
    True
    """
    t = np.asarray(tokens).astype(np.uint64)
    prev = np.concatenate((np.zeros(1, np.uint64), t[:-1])) if len(t) else t
    pos = np.arange(1, len(t) + 1, dtype=np.uint64)
    x = t * np.uint64(0x9E3779B97F4A7C15) ^ pos * np.uint64(0xBF58476D1CE4E5B9) ^ prev * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return np.ascontiguousarray(x.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :KV_BYTES_PER_TOKEN])


def _host_pool(tokens: int, page_size: int) -> HostKVPool:
    """A host pool of ``tokens`` slots; with 0, a one-page pool whose only page is
    withdrawn (the cache needs a pool; this one never hands out a slot)."""
    size = max(tokens, page_size)
    pool = HostKVPool(
        KV_SHAPE, size, page_size, KV_DTYPE, "page_first", pin_memory=False, reserve_bytes=_HOST_RESERVE_BYTES
    )
    if tokens < page_size:
        pool.allocator = type(pool.allocator)(0, page_size, "cpu", reserve_first_page=False)
        pool.size = 0
    return pool


def _check_capacities(
    page_size: int, device_tokens: int | None, host_tokens: int | None, l3_tokens: int | None, check_every: int
) -> None:
    """:class:`Replayer`'s checks of ``check_every`` and the tier sizes (``ValueError``)."""
    if check_every < 0:
        raise ValueError(f"check_every must be >= 0, got {check_every}")
    for name, value in (("device_tokens", device_tokens), ("host_tokens", host_tokens), ("l3_tokens", l3_tokens)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 or None, got {value}")
    if device_tokens is not None and device_tokens < page_size:
        raise ValueError(f"device_tokens {device_tokens} holds no page of {page_size} tokens")


def _check_l3_options(
    l3_backend: str | StorageBackend | None,
    host_tokens: int | None,
    l3_tokens: int | None,
    l3_path: str | None,
    l3_master: str | None,
    prefetch_policy: str,
) -> None:
    """:class:`Replayer`'s checks of the L3 settings against the backend and the host
    tier (``ValueError``)."""
    if l3_backend is not None and host_tokens == 0:
        raise ValueError("an L3 tier needs a host tier (L3 pages are read into host memory): host_tokens is 0")
    if l3_backend is None and (l3_tokens is not None or l3_path is not None):
        raise ValueError("l3_tokens / l3_path without an l3_backend would be ignored")
    if l3_path is not None and l3_backend != "file":
        raise ValueError("l3_path is for the file backend")
    if l3_master is not None and l3_backend != "mooncake":
        raise ValueError("l3_master is for the mooncake backend")
    if prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {prefetch_policy!r}")
    if isinstance(l3_backend, str) and l3_backend not in L3_BACKENDS:
        from hiradix.storage.registry import backend_names

        if l3_backend not in backend_names():
            raise ValueError(f"l3_backend must be one of {L3_BACKENDS} (or a registered backend), got {l3_backend!r}")


class Replayer:
    """Replays requests through one :class:`~hiradix.cache.HiRadixCache` (module docstring).

    Parameters
    ----------
    tree_cls:
        The tree class (default :class:`hiradix.HiRadixTree`, the compiled core unless
        ``HIRADIX_PUREPYTHON=1``; see :class:`~hiradix.cache.TreeFactory`).
    page_size:
        Tokens per page.
    device_tokens, host_tokens:
        Slots of the device and host pools (``None``: unbounded, i.e. as many as the
        workload's prompts hold when :meth:`replay` sees the whole workload first, else
        2**24). Host ``0``: no host tier (an L3 backend is then an error).
    eviction_policy, write_policy:
        Passed to the cache (``hiradix.policy_names()``, ``hiradix.tree.policy.WRITE_POLICIES``).
    check_every:
        Every this many requests, run ``cache.check_invariants()`` (0: never;
        :meth:`replay` always checks at the end).
    l3_backend:
        ``None`` (no L3), ``"memory"`` (:class:`~hiradix.storage.memory.MemoryStorage`),
        ``"file"`` (:class:`~hiradix.storage.file.FileStorage` under ``l3_path``, a
        temporary folder by default), another registered backend name, or a backend
        instance (sized by itself: ``l3_tokens`` is then not used).
    l3_tokens:
        L3 capacity in tokens (``None``: unbounded); pages beyond it are evicted by the
        backend (least recently used; the peer cluster by its own pool's order). The peer
        cluster's writing node and the Mooncake client are sized to hold exactly that many
        pages.
    l3_master:
        ``host:port`` of the ``mooncake_master`` for ``l3_backend="mooncake"`` (default:
        a private one on 127.0.0.1, started for the replay and stopped by :meth:`close`).
    verify_bytes:
        Write token-derived KV at "compute" and check every reused prefix against it
        (module docstring, step 4). ``O(prompt tokens)`` more per request.
    prefetch_policy, prefetch_threshold, prefetch_wait:
        The L3 prefetch policy (:data:`hiradix.cache.l3.PREFETCH_POLICIES`), the fewest tokens
        worth prefetching, and whether to wait for a prefetch's I/O before checking its
        progress (the deterministic default, module docstring).
    load_back_threshold:
        Host tails shorter than this are recomputed (the cache's default: 10).

    Runtime per request: ``O(prompt tokens)`` in vectorized code plus the cache's
    operations; no per-token Python.
    """

    def __init__(
        self,
        tree_cls: TreeFactory | None = None,
        *,
        page_size: int = 16,
        device_tokens: int | None = None,
        host_tokens: int | None = None,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        check_every: int = 0,
        l3_backend: str | StorageBackend | None = None,
        l3_tokens: int | None = None,
        l3_path: str | None = None,
        l3_master: str | None = None,
        verify_bytes: bool = False,
        prefetch_policy: str = "best_effort",
        prefetch_threshold: int = 256,
        prefetch_wait: bool = True,
        load_back_threshold: int = 10,
    ) -> None:
        _check_capacities(page_size, device_tokens, host_tokens, l3_tokens, check_every)
        _check_l3_options(l3_backend, host_tokens, l3_tokens, l3_path, l3_master, prefetch_policy)
        self.tree_cls: TreeFactory = tree_cls or hiradix.HiRadixTree
        self.page_size = page_size
        self.device_tokens = device_tokens
        self.host_tokens = host_tokens
        self.eviction_policy = eviction_policy
        self.write_policy = write_policy
        self.check_every = check_every
        self.l3_backend = l3_backend
        self.l3_tokens = l3_tokens
        self.l3_path = l3_path
        self.l3_master = l3_master
        self.verify_bytes = verify_bytes
        self.prefetch = PrefetchConfig(policy=prefetch_policy, threshold_tokens=prefetch_threshold)
        self.prefetch_wait = prefetch_wait
        self.load_back_threshold = load_back_threshold
        self.stats = ReplayStats()
        self._seen_blocks: set[int] = set()
        self._cache: HiRadixCache | None = None
        self._ledger: _EvictionLedger | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._master: Any = None  # a private mooncake_master (hiradix.storage.mooncake.MooncakeMaster)
        self._owned: StorageBackend | None = None  # the L3 backend built here by name, closed by close()
        self._kv: torch.Tensor | None = None  # the device pool's [slots, 2] bytes (verify_bytes)
        self._rid = 0

    # ------------------------------------------------------------------ the cache
    @property
    def cache(self) -> HiRadixCache:
        """The cache (built on first use; see ``device_tokens``)."""
        if self._cache is None:
            self._build(_DEFAULT_UNBOUNDED_TOKENS)
        assert self._cache is not None
        return self._cache

    @property
    def tree(self) -> Any:
        """The cache's tree."""
        return self.cache.tree

    @property
    def uses_l3(self) -> bool:
        """Whether the replay has an L3 tier (a backend and a host tier to land in)."""
        return self.l3_backend is not None

    def _build(self, unbounded: int) -> None:
        ps = self.page_size
        unbounded = max(unbounded, ps)
        device = DeviceKVPool(KV_SHAPE, self.device_tokens or unbounded, ps, KV_DTYPE)
        host = _host_pool(unbounded if self.host_tokens is None else self.host_tokens, ps)
        controller = HiCacheController(device, host, inline_copies=True)
        storage = None
        if self.uses_l3:
            storage = self._make_backend(host, unbounded)
        cache = HiRadixCache(
            device,
            host,
            tree=TreeOptions(
                eviction_policy=self.eviction_policy,
                write_policy=self.write_policy,
                enable_hash=storage is not None,
                tree_cls=self.tree_cls,
            ),
            tiers=TierOptions(load_back_threshold=self.load_back_threshold),
            storage=StorageOptions(
                backend=storage,
                prefetch=self.prefetch if storage is not None else None,
                # Waiting for every L3 operation anyway: run them inline, without the
                # thread hand-offs (the same L3 code; see hiradix.cache.l3.L3Controller).
                inline=storage is not None and self.prefetch_wait,
            ),
            controller=controller,
        )
        ledger = _EvictionLedger(device.total_slots)
        cache.add_observer(ledger)
        self._cache, self._ledger = cache, ledger
        if self.verify_bytes:
            self._kv = device.kv_buffer(0).view(device.total_slots, KV_BYTES_PER_TOKEN)

    def _make_backend(self, host: HostKVPool, unbounded: int) -> StorageBackend:
        if isinstance(self.l3_backend, StorageBackend):
            return self.l3_backend
        assert self.l3_backend is not None
        self._owned = self._create(host, unbounded)
        return self._owned

    def _create(self, host: HostKVPool, unbounded: int) -> StorageBackend:
        assert isinstance(self.l3_backend, str)
        pages = max(1, (unbounded if self.l3_tokens is None else self.l3_tokens) // self.page_size)
        extra: dict[str, Any] = {}
        if self.l3_tokens is not None:
            extra["capacity_bytes"] = pages * host.page_bytes
        if self.l3_backend == "file":
            if self.l3_path is None:
                self._tmpdir = tempfile.TemporaryDirectory(prefix="hiradix-sim-l3-")
            extra["path"] = self.l3_path or self._tmpdir.name  # type: ignore[union-attr]
        elif self.l3_backend == "peer":
            from hiradix.peer.pool import SLOT_ALIGN, SLOT_HEADER_SIZE

            # Pages are published by the node that writes them: its pool holds the L3, one
            # slot (header + page, aligned) per page; unbounded means every prompt page.
            stride = -(-(SLOT_HEADER_SIZE + host.page_bytes) // SLOT_ALIGN) * SLOT_ALIGN
            extra = {"inprocess_nodes": PEER_NODES, "page_size": host.page_bytes, "capacity_bytes": pages * stride}
        elif self.l3_backend == "mooncake":
            extra.update(self._mooncake_options(pages * host.page_bytes))
        return create_backend(self.l3_backend, extra_config=extra)

    def _mooncake_options(self, nbytes: int) -> dict[str, Any]:
        from hiradix.storage.mooncake import MooncakeMaster

        extra: dict[str, Any] = {"global_segment_size": int(nbytes * 1.25) + (16 << 20)}
        if self.l3_master is not None:
            extra["master_server_addr"] = self.l3_master
            return extra
        self._master = MooncakeMaster()
        extra["master_server_addr"] = self._master.addr
        # A private master and, waiting for every L3 operation, no read in flight while a
        # page is replaced or evicted: Mooncake's reader leases can be overridden, so that
        # the LRU bound holds exactly as in the memory backend.
        extra["force_remove"] = self.prefetch_wait
        return extra

    def close(self) -> None:
        """Stop the cache's threads, close an L3 backend built here by name (not one
        passed in), stop a private ``mooncake_master`` and remove a temporary L3 folder.
        Idempotent."""
        if self._cache is not None:
            self._cache.close()
        if self._owned is not None:  # the peer cluster's nodes, the Mooncake client, files
            self._owned.close()
            self._owned = None
        if self._master is not None:
            self._master.close()
            self._master = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one request
    def serve(self, prompt: np.ndarray) -> Served:
        """Serve one page-aligned prompt through the cache (module docstring, steps 1-5)."""
        cache = self.cache
        self._rid += 1
        rid = self._rid
        n = len(prompt)
        m = cache.match_prefix(prompt)
        device_hit, host_hit = len(m.device_indices), m.host_hit_length
        cache.inc_lock_ref(m.last_device_node)
        if n - device_hit > cache.available_device_size() + cache.evictable_size():
            cache.dec_lock_ref(m.last_device_node)  # hopeless: leave the cache as it is
            return Served(device_hit, 0, fitted=False)
        outcome = ""
        l3_hit = 0
        if cache.storage.l3 is not None and n - device_hit - host_hit >= max(self.prefetch.threshold_tokens, 1):
            outcome, gained = self._prefetch(rid, prompt, m)
            if gained:
                m2 = cache.match_prefix(prompt)
                l3_hit = len(m2.device_indices) + m2.host_hit_length - device_hit - host_hit
                m = m2
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(m.last_device_node)
        served_host = min(len(loaded), m.host_hit_length - l3_hit)
        served_l3 = len(loaded) - served_host
        self.stats.load_back_tokens += len(loaded)
        prefix = torch.cat((m.device_indices, loaded)) if len(loaded) else m.device_indices
        rest = n - len(prefix)
        new = cache.alloc_device(rest) if rest else prefix[:0]
        # The forward pass: wait for this request's load, layer by layer.
        counter = cache.cache_controller.layer_done_counter
        counter.set_consumer(cache.ready_to_load_host_cache())
        for layer in range(counter.layer_num):
            counter.wait_until(layer)
        if self._kv is not None:
            kv = kv_content(prompt)
            self._verify(kv[: len(prefix)], prefix)
            if new is not None and len(new):
                self._kv[new] = torch.from_numpy(kv[len(prefix) :])
        if new is None:
            cache.dec_lock_ref(node)
            self._end_step()
            return Served(device_hit, served_host, fitted=False, l3_hit=served_l3, prefetch=outcome)
        req = Req(rid, prompt, torch.cat((prefix, new)), prefix, node)
        cache.cache_finished_req(req)
        self._end_step()
        return Served(device_hit, served_host, fitted=True, l3_hit=served_l3, prefetch=outcome)

    def _verify(self, expected: np.ndarray, slots: torch.Tensor) -> None:
        """Count the reused tokens whose device KV differs from ``expected`` (verify_bytes)."""
        assert self._kv is not None
        if not len(slots):
            return
        got = self._kv[slots].numpy()
        self.stats.verified_tokens += len(slots)
        self.stats.corrupt_tokens += int(np.count_nonzero((got != expected).any(axis=1)))

    def _prefetch(self, rid: int, prompt: np.ndarray, m: Any) -> tuple[str, int]:
        """Prefetch the key after the match's mount point from L3; returns the outcome
        (``""`` when L3 held too little to start) and the tokens it added to the tree."""
        cache = self.cache
        storage = cache.storage
        mount, mount_len = storage.prefetch_mount(m)
        want = len(prompt) - mount_len
        short = want - cache.host_pool.available_size()
        if short > 0:  # room first, as SGLang's prefetch_from_storage; keep the mount
            cache.tree.inc_host_ref(mount)
            cache.evict_host(short)
            cache.tree.dec_host_ref(mount)
        if not storage.prefetch_from_storage(rid, mount, prompt[mount_len:]):
            return "", 0
        op = storage.ongoing_prefetch[rid].op
        if self.prefetch_wait:
            storage.wait_prefetch(rid)
        while not storage.check_prefetch_progress(rid):
            storage.wait_prefetch(rid, 0.001)
        gained = storage.pop_prefetch_loaded_tokens(rid)
        self.stats.prefetch_issued += 1
        if op.revoked or op.hit_pages == 0:
            return "", gained
        if op.completed_pages >= op.hit_pages:
            return "completed", gained
        return ("failed" if op.io_done.is_set() and not op.terminated else "partial"), gained

    def _end_step(self) -> None:
        cache = self.cache
        cache.check_hicache_events()
        storage = cache.storage
        if storage.l3 is not None and storage.ongoing_backup and self.prefetch_wait:
            for op in storage.ongoing_backup:  # L3 writes land before the next request
                op.done.wait()
            storage.check_backup_progress()

    # ------------------------------------------------------------------ replay loop
    def replay(
        self, requests: Iterable[TraceRequest], observer: Callable[[RequestRecord], None] | None = None
    ) -> ReplayStats:
        """Serve ``requests`` in order, accumulate :attr:`stats` and return them.

        ``observer``, when given, is called with a :class:`RequestRecord` after each
        request (the per-request input of :mod:`hiradix.sim.timing` and
        :mod:`hiradix.sim.report`). With an unbounded device or host tier, the requests
        are read in full first to size its pool. Ends with :meth:`check_slots`. Can be
        called again to continue the replay.
        """
        if self._cache is None:
            if self.device_tokens is None or self.host_tokens is None:
                requests = list(requests)
                ps = self.page_size
                self._build(sum(r.input_length // ps * ps for r in requests) + ps)
            else:
                self._build(_DEFAULT_UNBOUNDED_TOKENS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small index ops: intra-op threads only add sync (10x on 2 cores)
        try:
            self._replay(requests, observer)
        finally:
            torch.set_num_threads(threads)
        self._sync_stats()
        self.check_slots()
        return self.stats

    def _replay(self, requests: Iterable[TraceRequest], observer: Callable[[RequestRecord], None] | None) -> None:
        stats = self.stats
        for request in requests:
            tokens = request.tokens()
            prompt = tokens[: len(tokens) // self.page_size * self.page_size]
            ideal = self._ideal_hit(request.hash_ids, len(prompt))
            served = self.serve(prompt)
            n = len(prompt)
            stats.requests += 1
            stats.too_large_requests += int(not served.fitted)
            stats.input_tokens += request.input_length
            stats.prompt_tokens += n
            stats.blocks += len(request.hash_ids)
            stats.device_hit_tokens += served.device_hit
            stats.host_hit_tokens += served.host_hit
            stats.l3_hit_tokens += served.l3_hit
            stats.ideal_hit_tokens += ideal
            device_blocks = hit_blocks(served.device_hit, n)
            upper_blocks = hit_blocks(served.device_hit + served.host_hit, n)
            stats.device_hit_blocks += device_blocks
            stats.host_hit_blocks += upper_blocks - device_blocks
            stats.l3_hit_blocks += hit_blocks(served.device_hit + served.host_hit + served.l3_hit, n) - upper_blocks
            stats.ideal_hit_blocks += hit_blocks(ideal, n)
            if served.prefetch:
                setattr(stats, f"prefetch_{served.prefetch}", getattr(stats, f"prefetch_{served.prefetch}") + 1)
            if observer is not None:
                self._sync_stats()
                observer(RequestRecord(request, n, ideal, served, **self.occupancy()))
            if self.check_every and stats.requests % self.check_every == 0:
                self.check_slots()

    def _sync_stats(self) -> None:
        """Copy the cache's own counters into :attr:`stats`."""
        cache, ledger, stats = self.cache, self._ledger, self.stats
        assert ledger is not None
        cs = cache.get_stats()
        stats.device_demoted_tokens = ledger.demoted
        stats.device_deleted_tokens = ledger.deleted
        stats.host_evicted_tokens = cs.host_evicted_tokens
        stats.backup_tokens = cs.backup_done_tokens
        stats.backup_nodes = ledger.backup_nodes
        stats.backup_skipped_tokens = cs.host_alloc_failed_tokens + cs.backup_failed_tokens
        stats.write_back_failed_tokens = cs.write_back_dropped_tokens
        stats.l3_write_tokens = cs.storage_backup_tokens

    def _ideal_hit(self, hash_ids: tuple[int, ...], prompt: int) -> int:
        """Prompt tokens an infinite cache would hit: the blocks up to the first one never
        seen before, cut to whole pages of the prompt. ``O(len(hash_ids))``."""
        seen = 0
        for block in hash_ids:
            if block not in self._seen_blocks:
                break
            seen += 1
        self._seen_blocks.update(hash_ids)
        return min(seen * BLOCK_TOKENS, prompt) // self.page_size * self.page_size

    def occupancy(self) -> dict[str, int]:
        """Tokens held by each tier now: ``device_used``, ``host_used`` (slots in use,
        in-flight prefetches included) and ``l3_used`` (pages stored, in tokens). ``O(1)``."""
        cache = self.cache
        l3_used, l3 = 0, cache.storage.l3
        if l3 is not None:
            l3_used = l3.backend.get_stats().pages * self.page_size
        return {
            "device_used": cache.device_allocator.size - cache.available_device_size(),
            "host_used": cache.host_pool.size - cache.host_pool.available_size(),
            "l3_used": l3_used,
        }

    # ------------------------------------------------------------------ checks
    def check_slots(self) -> None:
        """The cache's :meth:`~hiradix.cache.HiRadixCache.check_invariants`: the tree's
        invariants and slot conservation in both pools (between requests no slot is held
        outside the tree). ``O(nodes + slots)``."""
        self.cache.check_invariants()

    def config(self) -> dict[str, Any]:
        """The settings of this replay, for reports."""
        tree = self.tree
        return {
            "page_size": self.page_size,
            "device_tokens": self.device_tokens,
            "host_tokens": self.host_tokens,
            "eviction_policy": self.eviction_policy,
            "write_policy": self.write_policy,
            "l3_backend": None if not self.uses_l3 else getattr(self.l3_backend, "name", self.l3_backend),
            "l3_tokens": self.l3_tokens if self.uses_l3 else 0,
            "l3_master": self.l3_master,
            "verify_bytes": self.verify_bytes,
            "prefetch_policy": self.prefetch.policy if self.uses_l3 else None,
            "prefetch_wait": self.prefetch_wait,
            "load_back_threshold": self.load_back_threshold,
            "tree": f"{type(tree).__module__}.{type(tree).__qualname__}",
            "cache": f"{HiRadixCache.__module__}.{HiRadixCache.__qualname__}",
        }
