"""Replay a trace through the tiered radix tree and count what each tier served.

The :class:`Replayer` drives a :class:`hiradix.HiRadixTree` the way a serving engine
would, one request at a time and with transfers that complete at once: match, lock,
load the host hit back to the device, allocate device slots (evicting as needed),
insert, and back up what the write policy asks for (evicting the host as needed). KV
slots are plain integers handed out by two :class:`SlotPool` free lists, one per tier;
no KV data exists, so copies cost nothing and only the bookkeeping is simulated.

All of the tier policy lives in :meth:`Replayer.serve`; :meth:`Replayer.replay` only
feeds it requests and does the accounting, so a cache object can later take the place
of ``serve`` without touching the accounting.

Hit-rate definitions
--------------------
A request's *prompt* is its token ids cut to a multiple of ``page_size`` (the tree
caches whole pages only; the unaligned tail is always recomputed).

* Token hit rates are hit tokens over prompt tokens, summed over requests. The *device
  hit* is the matched prefix that is still on the device; the *host hit* is the matched
  tail after it that is only on the host (and is loaded back).
* Block hit rates count 512-token trace blocks over *all* blocks of the trace. A block is
  hit when every token of it that the prompt holds was hit, and the prompt holds at least
  one; a block that straddles the device/host boundary is a host hit.
* The *ideal* is the hit under infinite capacity, computed from the trace's block ids
  without the tree: a request's blocks count only up to its first never-seen block, and
  those blocks are turned into page-aligned prompt tokens and blocks as above. At
  ``page_size=1`` the block ideal is the trace README's (0.3664 on the conversation
  trace); at larger pages it counts only what whole pages can hold (not, for example,
  a seen tail block shorter than a page). With unbounded capacities the tree reaches
  the ideal exactly, at any page size.
* Hits are counted at match time, so a request too large for the device still counts
  what the tree held for it; it is then not inserted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import hiradix
from hiradix.sim.trace import BLOCK_TOKENS, TraceRequest

_UNBOUNDED = 1 << 62  # capacity of an unbounded pool: far beyond any addressable slot


class SlotPool:
    """Free list of integer KV slots ``0 .. capacity - 1`` with one mark bit per slot.

    Slots are handed out LIFO from the free stack, then from the never-used range, so an
    unbounded pool (``capacity=None``) costs memory only for slots actually used. The
    mark bit is cleared when a slot is freed; the replayer uses it to remember which
    device slots also have a host copy. ``alloc`` and ``free`` are ``O(n)`` for ``n``
    slots (amortized: the arrays grow by doubling).
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self.capacity = capacity
        self._limit = _UNBOUNDED if capacity is None else capacity
        self._free = np.empty(1024, dtype=np.int64)  # stack of freed slots
        self._top = 0  # entries of _free in use
        self._fresh = 0  # slots >= _fresh were never handed out
        self._marked = np.zeros(1024, dtype=bool)

    @property
    def free_count(self) -> int:
        """Slots that :meth:`alloc` can hand out now."""
        return self._limit - self._fresh + self._top

    @property
    def used(self) -> int:
        """Slots handed out and not freed."""
        return self._fresh - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` free slots (``int64``), or ``None``, taking nothing, if fewer are free."""
        if n > self.free_count:
            return None
        out = np.empty(n, dtype=np.int64)
        k = min(n, self._top)
        out[:k] = self._free[self._top - k : self._top]
        self._top -= k
        out[k:] = np.arange(self._fresh, self._fresh + n - k)
        self._fresh += n - k
        if self._fresh > len(self._marked):
            self._marked = np.concatenate((self._marked, np.zeros(self._fresh, dtype=bool)))
        return out

    def mark(self, slots: np.ndarray) -> None:
        """Set the mark bit of ``slots`` (which must be allocated)."""
        self._marked[slots] = True

    def free(self, slots: np.ndarray) -> int:
        """Return ``slots`` to the pool; returns how many of them were marked."""
        n = len(slots)
        if self._top + n > len(self._free):
            grown = np.empty(max(2 * len(self._free), self._top + n), dtype=np.int64)
            grown[: self._top] = self._free[: self._top]
            self._free = grown
        self._free[self._top : self._top + n] = slots
        self._top += n
        marked = int(np.count_nonzero(self._marked[slots]))
        self._marked[slots] = False
        return marked

    def check_ownership(self, owned: list[np.ndarray], name: str) -> None:
        """Assert that every slot ever handed out is either free or in exactly one of
        ``owned`` (the slot arrays of the tree's nodes). ``O(slots)`` time, one byte of
        memory per slot."""
        holders = [*owned, self._free[: self._top]]
        counts = np.zeros(self._fresh, dtype=np.uint8)
        for slots in holders:
            if len(slots) and (slots.min() < 0 or slots.max() >= self._fresh):
                raise AssertionError(f"{name} pool: a node owns a slot the pool never handed out")
            # A repeat inside one array increments once, and a count may wrap: both show
            # up as a total that differs from the number of slots.
            counts[slots] += 1
        bad = np.flatnonzero(counts != 1)
        if len(bad):
            raise AssertionError(
                f"{name} pool: {len(bad)} slots are not held exactly once by a node or the free "
                f"list; e.g. slot {bad[0]} is held {counts[bad[0]]} times"
            )
        held = sum(len(slots) for slots in holders)
        if held != self._fresh:
            raise AssertionError(f"{name} pool: {held} slots held for {self._fresh} handed out (a repeat)")


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


class Replayer:
    """Replays requests through one tree with a device pool and a host pool.

    Parameters
    ----------
    tree_cls:
        The tree class (default :class:`hiradix.HiRadixTree`, the compiled core unless
        ``HIRADIX_PUREPYTHON=1``).
    page_size:
        Tokens per page of the tree.
    device_tokens, host_tokens:
        Slots of each tier (``None``: unbounded).
    eviction_policy, write_policy:
        Passed to the tree (``hiradix.policy_names()``, ``hiradix.policy.WRITE_POLICIES``).
    check_every:
        Every this many requests, run ``tree.check_invariants()`` and
        :meth:`check_slots` (0: never; :meth:`replay` always checks slots at the end).

    Runtime complexity per request is ``O(prompt tokens)`` plus the tree's eviction costs.
    """

    def __init__(
        self,
        tree_cls: Any = None,
        *,
        page_size: int = 16,
        device_tokens: int | None = None,
        host_tokens: int | None = None,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
        check_every: int = 0,
    ) -> None:
        if check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {check_every}")
        tree_cls = tree_cls or hiradix.HiRadixTree
        self.tree = tree_cls(page_size, eviction_policy=eviction_policy, write_policy=write_policy)
        self.page_size = page_size
        self.device = SlotPool(device_tokens)
        self.host = SlotPool(host_tokens)
        self.check_every = check_every
        self.stats = ReplayStats()
        self._seen_blocks: set[int] = set()

    # ------------------------------------------------------------------ tier policy
    def serve(self, prompt: np.ndarray) -> Served:
        """Serve one page-aligned prompt: match, load back, allocate, insert, back up.

        The matched device prefix stays locked until the end, so no eviction on the way
        can take it; the host tail is pinned until it is loaded back.
        """
        tree = self.tree
        match = tree.match_prefix(prompt)
        device_hit, host_hit = len(match.device_indices), match.host_hit_length
        tree.inc_lock_ref(match.last_device_node)
        if host_hit:
            # Under write_back, evicting the device backs nodes up, which may evict the
            # host: keep the tail we are about to load from being chosen.
            tree.inc_host_ref(match.last_node)
        slots = self._alloc_device(len(prompt) - device_hit)
        if host_hit:
            if slots is not None:
                self._load_back(match.last_node, slots[:host_hit])
            tree.dec_host_ref(match.last_node)
        if slots is None:
            tree.dec_lock_ref(match.last_device_node)
            return Served(device_hit, host_hit, fitted=False)
        inserted = tree.insert(prompt, np.concatenate((match.device_indices, slots)))
        # Tokens between our match and insert's prefix_len were cached meanwhile by
        # someone else (never, when requests run one at a time): ours are duplicates.
        matched = device_hit + host_hit
        self.device.free(slots[host_hit : host_hit + inserted.prefix_len - matched])
        self._back_up(inserted.backup_nodes)
        tree.dec_lock_ref(match.last_device_node)
        return Served(device_hit, host_hit, fitted=True)

    def _load_back(self, node: int, slots: np.ndarray) -> None:
        """Make the evicted chain ending at ``node`` device-resident in ``slots``."""
        source = self.tree.evicted_host_indices(node)  # what a real copy would read
        if len(source) != len(slots):
            raise RuntimeError(f"load back of {len(source)} host tokens into {len(slots)} device slots")
        self.tree.begin_load_back(node, slots)
        self.device.mark(slots)  # the loaded KV also stays on the host
        self.tree.finish_load_back(node)
        self.stats.load_back_tokens += len(slots)

    def _alloc_device(self, n: int) -> np.ndarray | None:
        """``n`` device slots, evicting unlocked device KV as needed; ``None`` if the
        device cannot hold them even then (nothing is taken, nothing is evicted)."""
        if n > self.device.free_count + self.tree.evictable_size():
            return None  # hopeless: keep the cache as it is
        short = n - self.device.free_count
        while short > 0:
            freed = self._evict_device(short)
            if not freed:
                break
            short -= freed
        return self.device.alloc(n)

    def _evict_device(self, n: int) -> int:
        """Evict at least ``n`` device tokens if possible; returns the tokens freed."""
        tree = self.tree
        result = tree.evict(n)
        freed = len(result.device_indices)
        self._free_device(result.device_indices)
        if result.write_back_nodes:
            backed = self._back_up(result.backup_nodes)
            for node in result.write_back_nodes:
                if node in backed:
                    slots = tree.demote(node)
                    freed += len(slots)
                    self._free_device(slots)
                else:
                    self.stats.write_back_failed_tokens += len(tree.key(node))
        return freed

    def _free_device(self, slots: np.ndarray) -> None:
        """Free device slots, counting them as demoted (a host copy exists) or deleted."""
        demoted = self.device.free(slots)
        self.stats.device_demoted_tokens += demoted
        self.stats.device_deleted_tokens += len(slots) - demoted

    def _back_up(self, nodes: Iterable[int]) -> set[int]:
        """Back up ``nodes`` (parents first), evicting the host as needed; returns the
        nodes backed up. A node that finds no host room is skipped, and so is every
        later node below it, since a backup may not leave a gap above itself."""
        tree = self.tree
        done: set[int] = set()
        skipped: set[int] = set()
        for node in nodes:
            size = len(tree.key(node))
            slots = None if tree.parent(node) in skipped else self._alloc_host(size)
            if slots is None:
                skipped.add(node)
                self.stats.backup_skipped_tokens += size
                continue
            self.device.mark(tree.begin_backup(node, slots))
            if tree.commit_backup(node, True):
                done.add(node)
                self.stats.backup_nodes += 1
                self.stats.backup_tokens += size
            else:  # its parent's backup failed (not with synchronous copies, but cheap to honour)
                self.host.free(slots)
                skipped.add(node)
        return done

    def _alloc_host(self, n: int) -> np.ndarray | None:
        """``n`` host slots, evicting host-only KV as needed; ``None`` if there is no room."""
        short = n - self.host.free_count
        if short > 0:
            result = self.tree.evict_host(short)
            self.host.free(result.host_indices)
            self.stats.host_evicted_tokens += result.num_evicted
        return self.host.alloc(n)

    # ------------------------------------------------------------------ replay loop
    def replay(
        self, requests: Iterable[TraceRequest], observer: Callable[[RequestRecord], None] | None = None
    ) -> ReplayStats:
        """Serve ``requests`` in order, accumulate :attr:`stats` and return them.

        ``observer``, when given, is called with a :class:`RequestRecord` after each
        request (the per-request input of :mod:`hiradix.sim.timing` and
        :mod:`hiradix.sim.report`). Ends with :meth:`check_slots`. Can be called again to
        continue the replay.
        """
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
                observer(RequestRecord(request, n, ideal, served, **self.occupancy()))
            if self.check_every and stats.requests % self.check_every == 0:
                self.tree.check_invariants()
                self.check_slots()
        self.check_slots()
        return stats

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
        """Tokens held by each tier now: ``device_used``, ``host_used``, ``l3_used``
        (always 0 here: this replayer has no L3). ``O(1)``."""
        return {"device_used": self.device.used, "host_used": self.host.used, "l3_used": 0}

    # ------------------------------------------------------------------ checks
    def check_slots(self) -> None:
        """Assert index conservation: every slot of each pool is free or owned by exactly
        one node, and the pools agree with the tree's sizes. ``O(nodes + slots)``."""
        tree = self.tree
        device: list[np.ndarray] = []
        host: list[np.ndarray] = []
        stack = list(tree.children(tree.root))
        while stack:
            node = stack.pop()
            stack.extend(tree.children(node))
            for owned, slots in ((device, tree.value(node)), (host, tree.host_value(node))):
                if slots is not None:
                    owned.append(slots)
        self.device.check_ownership(device, "device")
        self.host.check_ownership(host, "host")
        if (self.device.used, self.host.used) != (tree.device_size(), tree.host_size()):
            raise AssertionError(
                f"pools hold (device, host) = {(self.device.used, self.host.used)} slots, "
                f"the tree {(tree.device_size(), tree.host_size())} tokens"
            )

    def config(self) -> dict[str, Any]:
        """The settings of this replay, for reports."""
        return {
            "page_size": self.page_size,
            "device_tokens": self.device.capacity,
            "host_tokens": self.host.capacity,
            "eviction_policy": self.tree.policy.name,
            "write_policy": self.tree.write_policy,
            "tree": f"{type(self.tree).__module__}.{type(self.tree).__qualname__}",
        }
