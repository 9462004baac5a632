"""The request API of SGLang 0.5.23 on :class:`~hiradix.sglang.cache.HiRadixCacheBase`.

SGLang 0.5.23 ships no ``HiRadixCache``, and its scheduler talks to a registered cache
differently from 0.5.18's:

- a match returns the *length* of the device prefix (``MatchResult.device_prefix_len``);
  the scheduler reads the slots off the locked match node when it fills the request's row
  (``prefix_device_indices`` -> :meth:`HiRadixCache.path_device_indices`);
- a request holds its lock as a ``TreeLock`` (``req.lock``, from :meth:`lock`);
- ``checkpoint(req, up_to=)`` inserts a running or finished request's KV, points its row at
  the tree's slots, moves its lock and advances ``req.kv.cache_protected_len``; it frees
  only the duplicates the insert exposed: SGLang's ``release_kv_cache`` frees the rest of
  the row and drops the lock (``free_kv_row``, ``unlock``, ``on_release``);
- ``init_load_back`` returns the number of tokens it loads (all of the host hit or none)
  and the node to lock; the loaded slots belong to the tree (``load_back_is_cache_owned``);
- L3 prefetches are named by ``CacheRequestHandle`` (rid and attempt), and an aborted
  attempt ends with ``finish(handle, ABORT)`` -> :meth:`release_aborted_request`.

Options added since 0.5.18 that this cache does not honour are refused at start-up, naming the
option (:data:`~hiradix.sglang.options.SERVER_SINCE_020`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from sglang.srt.mem_cache import base_prefix_cache
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix.sglang.cache import HiRadixCacheBase, namedtuple_tail
from hiradix.sglang.nodes import TreeNode
from hiradix.sglang.options import SERVER_SINCE_020
from hiradix.tree import NO_NODE

__all__ = ["HiRadixCache"]

_EMPTY = torch.empty(0, dtype=torch.int64)
# SGLang's field order; the fields after these have defaults (namedtuple_tail).
_HEAD = ("device_prefix_len", "last_device_node", "last_host_node", "best_match_node", "host_hit_length")
_TAIL = namedtuple_tail(MatchResult, _HEAD)


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ascending disjoint half-open ranges with the adjacent ones merged, so that a page
    split between two is freed once (as SGLang 0.5.23's ``free_kv_row`` merges them).

    >>> _coalesce([(0, 4), (4, 6), (8, 9)])
    [(0, 6), (8, 9)]
    """
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class _Insert:
    """The ``InsertParams`` fields a checkpoint's insert reads (SGLang's dataclass has
    twenty, which cost a few µs to build per call)."""

    __slots__ = ("key", "priority", "session_id", "value")

    def __init__(self, key: Any, value: torch.Tensor, priority: int, session_id: str | None) -> None:
        self.key, self.value, self.priority, self.session_id = key, value, priority, session_id


# SGLang 0.5.23's lock record (``req.lock``).
_TREE_LOCK: Any = base_prefix_cache.TreeLock


class HiRadixCache(HiRadixCacheBase):
    """hiradix's ``HiRadixCache`` for SGLang 0.5.23 (module docstring): a
    registered, non-unified ``BasePrefixCache`` with SGLang's ``checkpoint`` request API."""

    server = SERVER_SINCE_020
    _rows_of: torch.Tensor | None = None  # the req_to_token table _rows are views of
    _rows: tuple[torch.Tensor, ...] = ()

    def _compiled_match_spec(self) -> tuple[Callable[[np.ndarray], Any], type, tuple[Any, ...]] | None:
        # The result names the device prefix by its length, wherever the slots live.
        if _TAIL is None:
            return None
        return len, MatchResult, _TAIL

    def _match_result(
        self, device_indices: np.ndarray, last_device_node: TreeNode, host_node: TreeNode, host_hit_length: int
    ) -> MatchResult:
        # Positional: (device_prefix_len, last_device_node, last_host_node, best_match_node,
        # host_hit_length), SGLang's field order.
        return MatchResult(len(device_indices), last_device_node, host_node, host_node, host_hit_length)

    # ------------------------------------------------------------------ prefixes
    def path_device_indices(self, node: Any) -> torch.Tensor:
        """The device slots from the root down to ``node`` (a device node), in key order:
        the request's prefix after a match on ``node``. ``O(depth + tokens)``."""
        tree = self.tree
        h = self._handle(node)
        parts: list[np.ndarray] = []
        while tree.parent(h) != NO_NODE:
            v = tree.value(h)
            if v is None:
                raise ValueError(f"path_device_indices: node {h} is not on the device")
            parts.append(v)
            h = tree.parent(h)
        if not parts:
            return _EMPTY.to(self.device)
        parts.reverse()
        out = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
        return out if self._on_cpu else out.to(self.device)

    def touch_prefix(self, key: Any) -> None:
        """Refresh the eviction order along ``key``'s cached path, as a match does (it
        loads nothing and starts no L3 work). ``O(len(key))``."""
        self.match_prefix(MatchPrefixParams(key=key))

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    # ------------------------------------------------------------------ requests
    def _req_row(self, idx: int) -> torch.Tensor:
        """Row ``idx`` of the ``req_to_token`` table: a view kept per row, taken once (a
        two-dimensional index costs a few µs a call). ``O(1)``."""
        table = self.req_to_token_pool.req_to_token
        if table is not self._rows_of:  # the first call (or a table SGLang replaced)
            self._rows = table.unbind(0)
            self._rows_of = table
        return self._rows[idx]

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert the request's KV up to row position ``up_to`` (its page-aligned part),
        free the row's copies of what the tree already held, point the row at the tree's
        slots, move ``req.lock`` / ``req.last_node`` to the new prefix and advance
        ``req.kv.cache_protected_len``. The rest of the row stays the request's (SGLang's
        ``release_kv_cache`` frees it). ``O(up_to)``; a chunked prefill's next chunk
        ``O(chunk)`` plus ``O(depth)`` nodes."""
        if self.disable:
            return
        kv = req.kv
        fill = req.full_untruncated_fill_ids
        aligned = self._aligned_len(min(up_to, len(fill)))
        protected = int(kv.cache_protected_len)
        row = self._req_row(kv.req_pool_idx)
        # A first checkpoint (nothing protected yet, so no chunk to continue) in C where it
        # can be; the same, below, once a later one is known not to continue.
        if protected <= 0 and self._compiled_checkpoint(req, fill, row, aligned, protected):
            return
        # the tokens as a limit, not a slice: the tree reads them in place
        key = RadixKey(fill, req.extra_key, limit=aligned + self._bigram, cache_salt=req.cache_salt)
        # A chunked prefill's next chunk continues from the request's locked node and
        # reads and writes no more than the chunk (HiRadixCacheBase._insert_continuing).
        done = self._insert_continuing(req.last_node, protected, key, aligned, row, req.priority or 0, False)
        if done is None and protected > 0 and self._compiled_checkpoint(req, fill, row, aligned, protected):
            return
        if done is not None:
            end, last, tail = done
            kv.cache_inserted_len = max(int(kv.cache_inserted_len), aligned)
            if end > protected:
                self.token_to_kv_pool_allocator.free_segment(row[protected:end], start_pos=protected)
            if aligned > protected:
                tail_slots = torch.from_numpy(tail)
                # SGLang's ReqToTokenPool.write, into the row's view
                row[protected:aligned] = tail_slots if self._on_cpu else tail_slots.to(self.device)
            kv.cache_protected_len = aligned
            node = self.node_view(last)
            self.unlock(req.lock)
            req.lock = self.lock(node)
            req.last_node = node
            return
        # the row's slots as a view: the tree copies (and widens) the slots it keeps
        params = _Insert(key, row[:aligned], req.priority or 0, getattr(req, "session_id", None))
        end = self.insert(cast(InsertParams, params)).prefix_len
        kv.cache_inserted_len = max(int(kv.cache_inserted_len), aligned)
        # One walk for the new prefix's node and slots (a match's, as SGLang's checkpoint
        # refreshes the path). [protected, end): the tree held these before the insert, the
        # row's copies are duplicates (page-aligned both ends, so whole pages), freed and
        # replaced by the tree's slots; from `end` on the tree took the row's own slots, so
        # that part of the row holds them already.
        handle, path = self._device_path(key)
        if path.shape[0] != aligned:
            raise RuntimeError(f"request {req.rid!r}: {path.shape[0]} of {aligned} tokens cached after insert")
        if end > protected:
            self.token_to_kv_pool_allocator.free_segment(row[protected:end], start_pos=protected)
            tree_slots = torch.from_numpy(path[protected:end])
            # SGLang's ReqToTokenPool.write, into the row's view
            row[protected:end] = tree_slots if self._on_cpu else tree_slots.to(self.device)
        kv.cache_protected_len = aligned
        node = self.node_view(handle)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    def _compiled_checkpoint(self, req: Any, fill: Any, row: torch.Tensor, aligned: int, protected: int) -> bool:
        """The rest of :meth:`checkpoint` for a whole-key insert in C
        (:meth:`hiradix.sglang._insert.Inserter.checkpoint`: the insert, the match's walk
        and the row's rewrite, without the key, params and result objects, the second
        walk's slot gather or the torch indexing), where it applies: the compiled inserter
        installed, the row on the CPU, a plain request (no namespace, no KV events to
        record, an int priority, the tokens an ``array('q')`` or a list; the inserter checks
        the row). Returns whether it served; the cache, the row and the allocator end as the
        Python path leaves them (``tests/sglang/v23/test_checkpoint_compiled.py``)."""
        inserter = self._inserter
        priority = req.priority or 0
        if (
            inserter is None
            or not self._on_cpu
            or aligned == 0
            or self._events is not None
            or req.extra_key is not None
            or req.cache_salt is not None
            or type(priority) is not int
            or (type(fill) is not array and type(fill) is not list)
        ):
            return False
        served = inserter.checkpoint(fill, row, aligned, protected, priority)
        if served is None:
            return False
        _, handle, duplicates = served
        kv = req.kv
        kv.cache_inserted_len = max(int(kv.cache_inserted_len), aligned)
        if duplicates is not None:  # the row's copies of what the tree held: whole pages
            self.token_to_kv_pool_allocator.free_segment(torch.from_numpy(duplicates), start_pos=protected)
        kv.cache_protected_len = aligned
        node = self.node_view(handle)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node
        return True

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        """Give back half-open ranges of ``kv``'s row (ascending, disjoint; adjacent ones
        merged, so a page split between two is freed once). SGLang's base method, less its
        SWA split: this cache has no SWA component, so no position of a row is SWA-dead
        and every range goes back whole. ``O(ranges)`` calls."""
        row = self._req_row(kv.req_pool_idx)
        segments = [(row[start:end], start) for start, end in _coalesce(ranges)]
        if segments:
            self.token_to_kv_pool_allocator.free_segments(segments)

    # ------------------------------------------------------------------ locks
    def lock(self, node: Any) -> Any:
        """A tree lock on ``node`` and the path above it, as SGLang's ``TreeLock``; its
        receipt is empty (hiradix's tree keeps no per-lock record). ``O(depth)``."""
        if not self.disable:
            self.tree.inc_lock_ref(self._handle(node))
        return _TREE_LOCK(node, DecLockRefParams())

    def unlock(self, lock: Any) -> None:
        """Release a lock :meth:`lock` took. ``O(depth)``."""
        if lock is not None and not self.disable:
            self.tree.dec_lock_ref(self._handle(lock.node))

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        """Start loading the host-only tail of a match into fresh device slots, all of it
        or none (too short, or no room): ``(tokens loaded, node to lock)``, the node the
        deepest device node when nothing is loaded. ``O(tokens)``."""
        handle = self._handle(params.best_match_node)
        loaded, node = self.core.init_load_back(handle, int(params.host_hit_length), params.mem_quota)
        self._sync_events()
        return len(loaded), self.node_view(node)

    def load_back_is_cache_owned(self) -> bool:
        return True
