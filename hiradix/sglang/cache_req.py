"""The request API of SGLang 0.5.15 to 0.5.20 on :class:`~hiradix.sglang.cache.HiRadixCacheBase`.

In those releases the scheduler hands a request to the cache twice: ``cache_unfinished_req``
after each chunk of a chunked prefill (insert what is computed, move the request's lock,
point its row at the tree's slots) and ``cache_finished_req`` at the end (insert, free the
duplicates and the unaligned tail, release the lock). A match returns the prefix's device
slots, and ``init_load_back`` the slots it loads into. Where a release keeps the request's
row and what its inserts name is its :class:`RequestRecord` (:mod:`hiradix.sglang.api_v18`,
:mod:`hiradix.sglang.api_v20`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix.sglang.cache import HiRadixCacheBase, namedtuple_tail
from hiradix.sglang.nodes import TreeNode

__all__ = ["CacheReqAPI", "PrefixBuffers", "RequestRecord"]

# SGLang's field order; the fields after these have defaults (namedtuple_tail).
_HEAD = ("device_indices", "last_device_node", "last_host_node", "best_match_node", "host_hit_length")
_TAIL = namedtuple_tail(MatchResult, _HEAD)


def _fill_ids(req: Any) -> tuple[Any, int]:
    """The request's tokens so far and how many: ``get_fill_ids()`` is
    ``full_untruncated_fill_ids[:extend_range.end]`` (0.5.18, 0.5.20), a copy of the whole
    prompt per call (8 MB at 1M tokens); the array and the count are read instead."""
    ids = getattr(req, "full_untruncated_fill_ids", None)
    extend = getattr(req, "extend_range", None)
    if type(ids) is array and extend is not None:
        return ids, min(int(extend.end), len(ids))
    tokens = req.get_fill_ids() if hasattr(req, "get_fill_ids") else req.fill_ids
    return tokens, len(tokens)


class PrefixBuffers:
    """The ``prefix_indices`` of running requests, each a view of a buffer of the
    request's whole length, so that a chunk's :meth:`extend` copies the slots that
    changed, not the prefix (SGLang's ``torch.cat`` of the prefix and the tail copies
    8 MB per chunk at 1M tokens). They are int64 tensors, as SGLang's: its Triton row
    writer reads them through their data pointers. Keyed by ``rid``; a request's buffer
    is dropped when it finishes (:meth:`forget`), and all of them if more than
    ``limit`` (the ``ReqToTokenPool``'s rows, the most requests that can run) are held."""

    def __init__(self, limit: int) -> None:
        self._bufs: dict[Any, torch.Tensor] = {}
        self._limit = max(int(limit), 1)

    def extend(self, req: Any, row: torch.Tensor, unchanged: int, head: torch.Tensor | None = None) -> torch.Tensor:
        """The request's new ``prefix_indices``, as SGLang's ``cache_unfinished_req``
        makes them: ``head`` (the matched prefix's slots), then ``row`` (the request's
        ``req_to_token`` row so far) after it, int64, in a view of the request's buffer.
        Without ``head``, ``row`` from the start, whose first ``unchanged`` slots are
        copied only when the request's ``prefix_indices`` is not that buffer's view
        already (a first chunk, or SGLang replaced it): ``O(len(row) - unchanged)`` then,
        ``O(len(row))`` else."""
        n = row.shape[0]
        buf = self._bufs.get(req.rid)
        old = req.prefix_indices
        if (
            head is not None
            or buf is None
            or buf.shape[0] < n
            or type(old) is not torch.Tensor
            or old.shape[0] < unchanged
            or old.data_ptr() != buf.data_ptr()
        ):
            if buf is None or buf.shape[0] < n:
                if len(self._bufs) >= self._limit:
                    self._bufs.clear()
                full = getattr(req, "full_untruncated_fill_ids", None)
                buf = torch.empty(max(n, len(full) if full is not None else n), dtype=torch.int64)
                self._bufs[req.rid] = buf
            unchanged = 0
            if head is not None:
                unchanged = head.shape[0]
                buf[:unchanged].copy_(head)
        buf[unchanged:n].copy_(row[unchanged:])
        return buf[:n]

    def forget(self, req: Any) -> None:
        self._bufs.pop(req.rid, None)


@dataclass(frozen=True)
class RequestRecord:
    """Where one SGLang release keeps a request's KV record, and what its inserts name."""

    #: The object that holds the request's ``req_to_token`` row (``req_pool_idx``) and
    #: ``cache_protected_len``: the ``Req`` itself up to 0.5.18, ``req.kv`` in 0.5.20.
    kv: Callable[[Any], Any]
    #: More ``InsertParams`` fields of a request's insert: 0.5.20's name the request's
    #: ``session_id``, which its KV events carry.
    insert_extras: Callable[[Any], dict[str, Any]]


class CacheReqAPI(HiRadixCacheBase):
    """``cache_finished_req`` / ``cache_unfinished_req`` (module docstring) on the
    release's :attr:`record`, which the release's class sets."""

    record: RequestRecord

    @cached_property
    def _prefix_indices(self) -> PrefixBuffers:
        return PrefixBuffers(getattr(self.req_to_token_pool, "size", 1))

    def _compiled_match_spec(self) -> tuple[Callable[[np.ndarray], Any], type, tuple[Any, ...]] | None:
        # A CPU tensor of the slots; on an accelerator the Python method moves them there.
        if _TAIL is None or not self._on_cpu:
            return None
        return torch.from_numpy, MatchResult, _TAIL

    def _match_result(
        self, device_indices: np.ndarray, last_device_node: TreeNode, host_node: TreeNode, host_hit_length: int
    ) -> MatchResult:
        indices = torch.from_numpy(device_indices)
        if not self._on_cpu:
            indices = indices.to(self.device)
        # Positional: (device_indices, last_device_node, last_host_node, best_match_node,
        # host_hit_length), SGLang's field order.
        if _TAIL is not None:
            return tuple.__new__(
                MatchResult, (indices, last_device_node, host_node, host_node, host_hit_length) + _TAIL
            )
        return MatchResult(indices, last_device_node, host_node, host_node, host_hit_length)

    def cache_finished_req(
        self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int | None = None, **kwargs: Any
    ) -> None:
        """Insert a finished request's KV (unless ``is_insert`` is false), free its
        duplicate and unaligned slots and release its lock. ``O(len)``."""
        if self.disable_finished_insert:
            is_insert = False
        token_ids = req.origin_input_ids + req.output_ids
        if kv_len_to_handle is not None:
            token_ids = token_ids[:kv_len_to_handle]
        record = self.record.kv(req)
        kv = self.req_to_token_pool.req_to_token[record.req_pool_idx, : len(token_ids)]
        protected = int(record.cache_protected_len)
        if self.disable:
            self._free(kv[protected:])
            return
        aligned = self._aligned_len(len(token_ids))
        if is_insert:
            key = RadixKey(
                token_ids[: aligned + self._bigram], req.extra_key, cache_salt=getattr(req, "cache_salt", None)
            )
            values = kv[:aligned]  # a view: the tree copies (and widens) the slots it keeps
            end = self.insert(
                InsertParams(
                    key=key, value=values, priority=getattr(req, "priority", 0) or 0, **self.record.insert_extras(req)
                )
            ).prefix_len
        else:
            end = aligned
        self._free(kv[protected : max(protected, end)])
        self._free(kv[aligned:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self._prefix_indices.forget(req)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Insert a running request's KV so far and move its lock to the new prefix: the
        request's ``req_to_token`` row takes the tree's slots for the page-aligned part,
        ``cache_protected_len`` becomes that part's length and ``prefix_indices`` the
        row's slots so far (int64). A chunked prefill's next chunk continues from the
        request's locked node (:meth:`_insert_continuing`) and reads and writes no more
        than the chunk: ``O(chunk)`` plus ``O(depth)`` nodes, amortized; other calls
        ``O(len)``."""
        if self.disable:
            return
        ids, n = _fill_ids(req)
        record = self.record.kv(req)
        kv = self.req_to_token_pool.req_to_token[record.req_pool_idx, :n]
        aligned = self._aligned_len(n)
        # limit, not a slice: an array('q') slice copies the whole prefix
        key = RadixKey(ids, req.extra_key, cache_salt=getattr(req, "cache_salt", None), limit=aligned + self._bigram)
        protected = int(record.cache_protected_len)
        priority = getattr(req, "priority", 0) or 0
        done = self._insert_continuing(req.last_node, protected, key, aligned, kv, priority, chunked)
        if done is not None:
            end, last, tail = done
            self._free(kv[protected : max(protected, end)])
            if aligned > protected:
                self.req_to_token_pool.write((record.req_pool_idx, slice(protected, aligned)), torch.from_numpy(tail))
            record.cache_protected_len = aligned
            node = self.node_view(last)
            self.inc_lock_ref(node)
            if req.last_node is not None:
                self.dec_lock_ref(req.last_node)
            req.prefix_indices = self._prefix_indices.extend(req, kv, protected)
            req.last_node = node
            return
        values = kv[:aligned]  # a view: the tree copies (and widens) the slots it keeps
        result = self.insert(
            InsertParams(key=key, value=values, chunked=chunked, priority=priority, **self.record.insert_extras(req))
        )
        self._free(kv[protected : max(protected, result.prefix_len)])
        m = self.match_prefix(MatchPrefixParams(key=key))
        new_indices = m.device_indices
        if len(new_indices) != aligned:
            raise RuntimeError(f"request {req.rid!r}: {len(new_indices)} of {aligned} tokens cached after insert")
        self.req_to_token_pool.write((record.req_pool_idx, slice(protected, len(new_indices))), new_indices[protected:])
        record.cache_protected_len = len(new_indices)
        self.inc_lock_ref(m.last_device_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices = self._prefix_indices.extend(req, kv, 0, new_indices)
        req.last_node = m.last_device_node

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Start loading the host-only tail of a match into fresh device slots: returns
        them and the node the request should lock (the deepest device node when nothing
        is loaded: too short, over ``mem_quota`` or no room)."""
        handle = self._handle(params.best_match_node)
        loaded, node = self.core.init_load_back(handle, int(params.host_hit_length), params.mem_quota)
        self._sync_events()
        return loaded.to(self.device), self.node_view(node)
