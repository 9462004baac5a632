"""The node objects SGLang's callers walk, as lazy views over the tree's integer handles.

SGLang's scheduler keeps ``req.last_node`` / ``req.last_host_node`` /
``req.best_match_node``, passes them back to ``inc_lock_ref``, ``dec_lock_ref`` and
``init_load_back``, and its DFS-weight policy walks ``tree_cache.root_node.children``
using nodes as dictionary keys. A :class:`TreeNode` here is two references (the
adapter and a handle): it is made only when a caller asks for a node, every field is read
from the tree when it is touched, and two views of one handle are equal and hash alike.
Nothing here writes to the tree.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Protocol

import numpy as np
import torch

from hiradix.tree import NO_NODE

__all__ = ["NodeSource", "TreeNode"]


class NodeSource(Protocol):
    """What a view reads of the adapter it belongs to
    (:class:`~hiradix.sglang.cache.HiRadixCacheBase` is one): typed here, so that this
    module, which the adapter imports, does not import the adapter back."""

    @property
    def tree(self) -> Any: ...

    @property
    def core(self) -> Any: ...

    @property
    def page_size(self) -> int: ...

    @property
    def is_eagle(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def root_handle(self) -> int: ...

    @property
    def root_node(self) -> TreeNode: ...

    def node_view(self, handle: int) -> TreeNode: ...

    def namespace_roots(self) -> dict[str, int]: ...

    def node_tokens(self, handle: int) -> np.ndarray: ...

    def node_radix_key(self, handle: int) -> Any: ...

    def is_evicted(self, handle: int) -> bool: ...

    def is_backed_up(self, handle: int) -> bool: ...


class TreeNode:
    """A read-only view of one tree node with SGLang's ``TreeNode`` fields.

    ``key`` is a ``RadixKey`` (tokens and namespace), ``value`` the device slots (``None``
    once evicted), ``host_value`` the host slots (``None`` unless backed up),
    ``hash_value`` the page hashes. ``children`` maps each child's first page (a tuple of
    tokens, SGLang's ``child_key``) to its view; the global root's children include the
    roots of the request namespaces (``extra_key`` / ``cache_salt``), so a walk from
    ``root_node`` reaches every node. Each field costs one call into the tree.
    """

    # A view is these two fields and nothing else: the compiled matcher
    # (hiradix.sglang._match) makes its views without __init__.
    __slots__ = ("_cache", "id")

    def __init__(self, cache: NodeSource, handle: int) -> None:
        self._cache = cache
        self.id = int(handle)

    def belongs_to(self, cache: object) -> bool:
        """Whether this is a view of a node of ``cache`` (and not of another cache's tree)."""
        return self._cache is cache

    # identity: views of one handle are interchangeable (dict keys, sets, ``==``)
    def __eq__(self, other: object) -> bool:
        return isinstance(other, TreeNode) and other.id == self.id and other._cache is self._cache

    def __hash__(self) -> int:
        return hash(self.id)

    def __lt__(self, other: TreeNode) -> bool:  # SGLang's nodes order by access time
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key_len={self._cache.tree.key_len(self.id)})"

    @property
    def _tree(self) -> Any:
        return self._cache.tree

    @property
    def parent(self) -> TreeNode | None:
        """The parent view; ``None`` for the global root. A namespace root's parent is the
        global root, as SGLang's per-namespace subtrees hang from its one root."""
        p = self._tree.parent(self.id)
        if p != NO_NODE:
            return self._cache.node_view(p)
        return None if self.id == self._cache.root_handle else self._cache.root_node

    @property
    def children(self) -> dict[Any, TreeNode]:
        """``{child key: child view}``, keyed as SGLang keys children: the first token at
        page size 1, the tuple of the first page's tokens otherwise (with bigram keys, the
        first bigram, or the tuple of the first page's bigrams). ``O(children)``."""
        tree = self._tree
        cache = self._cache
        ps = cache.page_size
        out: dict[Any, TreeNode] = {}
        for c in tree.children(self.id):
            if cache.is_eagle:
                raw = cache.node_tokens(c)[: ps + 1].tolist()
                first: list[Any] = list(pairwise(raw))
            else:
                first = tree.key(c)[:ps].tolist()
            out[first[0] if ps == 1 else tuple(first)] = cache.node_view(c)
        if self.id == self._cache.root_handle:
            for name, handle in self._cache.namespace_roots().items():
                out[("namespace", name)] = self._cache.node_view(handle)
        return out

    @property
    def key(self) -> Any:
        """The node's tokens as SGLang's ``RadixKey`` (with the namespace's extra_key and
        cache_salt). ``O(key length)``."""
        return self._cache.node_radix_key(self.id)

    @property
    def value(self) -> torch.Tensor | None:
        v = self._tree.value(self.id)
        return None if v is None else torch.from_numpy(v).to(self._cache.device)

    @property
    def host_value(self) -> torch.Tensor | None:
        v = self._tree.host_value(self.id)
        return None if v is None else torch.from_numpy(v)

    @property
    def hash_value(self) -> list[str] | None:
        return self._tree.hash_value(self.id)

    @property
    def lock_ref(self) -> int:
        return int(self._tree.lock_ref(self.id))

    @property
    def host_ref_counter(self) -> int:
        return int(self._tree.host_ref_counter(self.id))

    @property
    def hit_count(self) -> int:
        return int(self._tree.hit_count(self.id))

    @property
    def priority(self) -> int:
        return int(self._tree.priority(self.id))

    @property
    def last_access_time(self) -> float:
        return float(self._tree.last_access_time(self.id))

    @property
    def evicted(self) -> bool:
        return self._cache.is_evicted(self.id)

    @property
    def backuped(self) -> bool:
        return self._cache.is_backed_up(self.id)

    def get_last_hash_value(self) -> str | None:
        """The node's last page hash (``None`` if it has none)."""
        hashes = self.hash_value
        return str(hashes[-1]) if hashes else None

    def get_prefix_hash_values(self, node: TreeNode | None) -> list[str]:
        """Page hashes from the root down to ``node`` (inclusive), in root-to-node order."""
        return [] if node is None else self._cache.core.storage.prefix_hashes(node.id)
