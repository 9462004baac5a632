"""How SGLang's keys and nodes map onto the tree: request namespaces (``extra_key`` /
``cache_salt``, and EAGLE's bigram namespaces, the :mod:`hiradix.sglang.cache` docstring),
node views (:class:`~hiradix.sglang.nodes.TreeNode`) and their keys, and the paths the
request APIs walk and continue (:class:`TreePaths`, a part of the adapter).
"""

from __future__ import annotations

import json
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix.sglang.nodes import TreeNode
from hiradix.tree import NO_NODE

if TYPE_CHECKING:
    from hiradix.cache import HiRadixCache as CoreCache
    from hiradix.sglang.events import KVEventLog

__all__ = ["EMPTY_SLOTS", "TreePaths", "as_tokens", "head", "key_tokens", "raw_tokens"]

EMPTY_SLOTS = np.empty(0, dtype=np.int64)


def as_tokens(token_ids: Any) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_ids
    if isinstance(token_ids, array) and token_ids.typecode in ("q", "l") and token_ids.itemsize == 8:
        return np.frombuffer(token_ids, np.int64)
    if isinstance(token_ids, torch.Tensor):
        return token_ids.cpu().numpy()
    return np.asarray(token_ids, dtype=np.int64)


def raw_tokens(key: Any) -> np.ndarray:
    """A ``RadixKey``'s tokens (its ``limit`` applied) as an int64 array, a view where it
    can be: ``raw_token_ids()`` copies a capped key and costs a few calls per match."""
    tokens = as_tokens(key.token_ids)
    limit = key.limit
    return tokens if limit is None or limit >= len(tokens) else tokens[:limit]


def key_tokens(key: Any) -> np.ndarray | array:
    """The tokens of a plain key (:func:`raw_tokens`), or the scheduler's ``array('q')``
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
    return raw_tokens(key)


def head(tokens: np.ndarray | array, n: int) -> np.ndarray:
    """The first ``n`` tokens, as a view (an ``array('q')`` slice would copy)."""
    if isinstance(tokens, array):
        return np.frombuffer(tokens, np.int64)[:n]
    return tokens[:n]


class TreePaths:
    """The adapter's part that maps SGLang's keys and nodes onto the tree: node views and
    handles, request namespaces, node keys as SGLang holds them, and the device paths the
    request APIs read back or continue from. A base of
    :class:`~hiradix.sglang.cache.HiRadixCacheBase`, which sets the fields below."""

    tree: Any  # the core's compiled tree (or its twin)
    core: CoreCache
    page_size: int
    is_eagle: bool
    device: torch.device
    root_handle: int
    root_node: TreeNode
    token_to_kv_pool_allocator: Any
    _bigram: int  # tokens a key has beyond its slots (1 with is_eagle)
    _events: KVEventLog | None
    _namespaces: dict[str, int]  # namespace -> its root's handle
    _ns_by_root: dict[int, str]  # and back
    # root handle -> (extra_key, cache_salt, first token of a bigram namespace)
    _ns_parts: dict[int, tuple[str | None, str | None, int | None]]

    def _sync_events(self) -> None:
        """Turn the tree's changes so far into KV events (with ``enable_kv_cache_events``)."""
        if self._events is not None:
            self._events.sync()

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
        Bigram keys add their first token (the :mod:`hiradix.sglang.cache` docstring)."""
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
        raw = raw_tokens(key)
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

    def _key_parts(self, key: Any) -> tuple[str | None, np.ndarray | array]:
        """``key``'s namespace (``None``: the default one) and the tokens the tree keys on
        (with ``is_eagle``, its bigrams). A key without a namespace skips ``_ns``: this
        runs in the scheduler's hottest calls."""
        if self.is_eagle:
            ns, tokens, _ = self._bigram_key(key)
            return ns, tokens
        ek, salt = key.extra_key, key.cache_salt
        return (None if ek is None and salt is None else self._ns(ek, salt)), key_tokens(key)

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
            return (self.root_handle if ns is None else self._namespaces[ns]), EMPTY_SLOTS
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
        tail = head(tokens, aligned)[protected:]
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
            return protected + int(result.prefix_len), last, EMPTY_SLOTS
        parts.reverse()
        return protected + int(result.prefix_len), last, parts[0] if len(parts) == 1 else np.concatenate(parts)
