"""SGLang's KV cache events (``--kv-events-config``) for hiradix.sglang.

SGLang 0.5.18's ``HiRadixCache`` tells KV-aware routers where blocks live through
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, handed out by
``take_events()``. :class:`KVEventLog` produces the same events, in the same order and
with the same block ids, from the tree's change log (``HiRadixTree.track_changes``):

=====================  ==============================================================
tree change            event (medium)
=====================  ==============================================================
``INSERTED``           ``BlockStored`` (GPU): insert made a node
``HOST_INSERTED``      ``BlockStored`` (CPU_PINNED): an L3 prefetch landed
``BACKED_UP``          ``BlockStored`` (CPU_PINNED): a backup was acknowledged
``LOADED``             ``BlockStored`` (GPU): a load back was started
``DEMOTED``            ``BlockRemoved`` (GPU): evicted to the host copy
``DELETED``            ``BlockRemoved`` (GPU): evicted, no host copy
``HOST_DELETED``       ``BlockRemoved`` (CPU_PINNED): host eviction
``REFILLED``           nothing: SGLang 0.5.18 records no event when an insert recomputes
                       an evicted node (its tree sets the value and moves on)
``SPLIT``              nothing (the blocks' ids do not change)
reset                  ``AllBlocksCleared`` (also the first event after construction)
=====================  ==============================================================

A block is one page. Its id is the first 8 bytes, big-endian and signed, of the page's
chained SHA-256 (SGLang's ``hash_str_to_int64`` of ``get_hash_str``), chained from the
first page under a root: no seed without a ``cache_salt``, else
``SHA-256(b"sglang-cache-salt-v1\\0" + salt)``; ``extra_key`` does not enter the id (as in
SGLang). With EAGLE bigram keys a page hashes its bigrams as interleaved pairs and
``token_ids`` lists them as ``(a, b)`` tuples. Consecutive events are coalesced as SGLang
coalesces them: removals of one medium, and stores that continue the previous store's
chain with the same medium, block size and metadata.

The log keeps, per live node, its page digests, block ids, tokens and the id of the page
before it (a node's blocks are computed once, when it is made, and cut at splits), so
removals never read the tree and cost ``O(pages)``.
"""

from __future__ import annotations

import hashlib
from itertools import pairwise
from typing import Any

import numpy as np
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoredMetadata,
    BlockStoredWithMetadata,
    StorageMedium,
)

import hiradix
from hiradix.tree._results import Change

__all__ = ["KVEventLog", "block_ids", "salt_seed"]

GPU = StorageMedium.GPU
CPU = StorageMedium.CPU


def salt_seed(cache_salt: str) -> str:
    """The digest (hex) that SGLang chains a ``cache_salt`` namespace's event ids from."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).hexdigest()


def block_ids(digests: np.ndarray) -> np.ndarray:
    """Event block ids of page digests (``(pages, 32)`` uint8): their first 8 bytes as a
    big-endian signed int64, SGLang's ``hash_str_to_int64``. ``O(pages)``."""
    return np.ascontiguousarray(digests[:, :8]).view(">i8").ravel().astype(np.int64)


class _Blocks:
    """One node's blocks: what its events need, kept while the node lives."""

    __slots__ = ("digests", "ids", "parent_id", "salt", "tokens")

    def __init__(self, digests: np.ndarray, ids: np.ndarray, tokens: np.ndarray, parent_id: int | None,
                 salt: str | None) -> None:
        self.digests = digests  # (pages, 32) uint8: the chain, to hash the children from
        self.ids = ids  # (pages,) int64 block ids
        # The node's tokens (int64); with bigram keys the token before the node comes first.
        self.tokens = tokens
        self.parent_id = parent_id  # id of the page before the node; None under a root
        self.salt = salt  # the namespace's cache_salt (the events' metadata)


class KVEventLog:
    """The KV cache events of one hiradix.sglang cache (see the module docstring).

    ``cache`` gives the tree (whose change log this turns on), ``page_size``,
    ``is_eagle`` and ``namespace_parts(root) -> (extra_key, cache_salt, first_token)``.
    Call :meth:`sync` after each operation that can make nodes (insert, an L3 prefetch's
    insert) before anything can delete them, and :meth:`take` to hand the events out.
    """

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._tree = cache.tree
        self._tree.track_changes = True
        self._blocks: dict[int, _Blocks] = {}
        self.queue: list[Any] = []
        self.cleared()

    # ------------------------------------------------------------------ public
    def sync(self) -> None:
        """Turn the tree's changes since the last call into events. ``O(records + pages
        of the nodes made)``."""
        rows = self._tree.take_changes()
        if not len(rows):
            return
        blocks = self._blocks
        for kind, node, other, tokens in rows.tolist():
            if kind == Change.INSERTED:
                self._stored(self._new_blocks(node), GPU)
            elif kind == Change.HOST_INSERTED:
                self._stored(self._new_blocks(node), CPU)
            elif kind == Change.SPLIT:
                self._split(node, other, tokens)
            elif kind == Change.LOADED:
                self._stored(blocks[node], GPU)
            elif kind == Change.BACKED_UP:
                self._stored(blocks[node], CPU)
            elif kind == Change.DEMOTED:
                self._removed(blocks[node], GPU)
            elif kind == Change.DELETED:
                self._removed(blocks.pop(node), GPU)
            elif kind == Change.HOST_DELETED:
                self._removed(blocks.pop(node), CPU)
            # Change.REFILLED: nothing, as SGLang 0.5.18 (see the module docstring)

    def take(self) -> list[Any]:
        """The events since the last call, oldest first; empties the queue."""
        self.sync()
        events, self.queue = self.queue, []
        return events

    def cleared(self) -> None:
        """The tree was emptied: forget every node (the tree drops its pending records)
        and queue ``AllBlocksCleared``."""
        self._blocks.clear()
        self._tree.take_changes()
        self.queue.append(AllBlocksCleared())

    # ------------------------------------------------------------------ nodes
    def _new_blocks(self, node: int) -> _Blocks:
        cache, tree = self._cache, self._tree
        if not tree.is_alive(node):  # a sync was missed between making and deleting it
            raise RuntimeError(f"hiradix.sglang events: node {node} was deleted before its events were made")
        parent = tree.parent(node)
        key = tree.key(node).astype(np.int64)
        if tree.parent(parent) == -1:  # below a (namespace) root: the chain starts here
            _, salt, first = cache.namespace_parts(parent)
            prior = salt_seed(salt) if salt is not None else None
            parent_id = None
            prev = first
        else:
            up = self._blocks[parent]
            prior = up.digests[-1].tobytes().hex()
            parent_id = int(up.ids[-1])
            salt = up.salt
            prev = int(up.tokens[-1])
        ps = cache.page_size
        if cache.is_eagle:
            tokens = np.concatenate((np.array([prev], dtype=np.int64), key))
            pairs = np.empty(2 * len(key), dtype=np.int64)
            pairs[0::2] = tokens[:-1]
            pairs[1::2] = tokens[1:]
            digests = hiradix.page_digests(pairs, 2 * ps, prior)
        else:
            tokens = key
            digests = hiradix.page_digests(key, ps, prior)
        blocks = _Blocks(digests, block_ids(digests), tokens, parent_id, salt)
        self._blocks[node] = blocks
        return blocks

    def _split(self, new: int, suffix: int, split_len: int) -> None:
        old = self._blocks[suffix]
        pages = split_len // self._cache.page_size
        # bigram tokens carry the token before the node: the suffix's starts at the cut
        cut = split_len + 1 if self._cache.is_eagle else split_len
        self._blocks[new] = _Blocks(old.digests[:pages], old.ids[:pages], old.tokens[:cut], old.parent_id, old.salt)
        self._blocks[suffix] = _Blocks(old.digests[pages:], old.ids[pages:], old.tokens[split_len:],
                                       int(old.ids[pages - 1]), old.salt)

    # ------------------------------------------------------------------ events
    def _token_ids(self, blocks: _Blocks) -> list[Any]:
        t = blocks.tokens.tolist()
        if self._cache.is_eagle:
            return list(pairwise(t))
        return t

    def _stored(self, blocks: _Blocks, medium: StorageMedium) -> None:
        ids = blocks.ids.tolist()
        if not ids:
            return
        ps = self._cache.page_size
        meta = None if blocks.salt is None else BlockStoredMetadata(cache_salt=blocks.salt)
        tail = self.queue[-1] if self.queue else None
        if (
            isinstance(tail, BlockStored)
            and tail.medium == medium
            and tail.lora_id is None
            and tail.block_size == ps
            and (tail.metadata if isinstance(tail, BlockStoredWithMetadata) else None) == meta
            and tail.block_hashes
            and tail.block_hashes[-1] == blocks.parent_id
        ):
            # this node continues the chain the last event stored: one event, as SGLang
            tail.block_hashes.extend(ids)
            tail.token_ids.extend(self._token_ids(blocks))
            return
        fields = dict(block_hashes=ids, parent_block_hash=blocks.parent_id, token_ids=self._token_ids(blocks),
                      block_size=ps, lora_id=None, medium=medium)
        self.queue.append(BlockStored(**fields) if meta is None else BlockStoredWithMetadata(**fields, metadata=meta))

    def _removed(self, blocks: _Blocks, medium: StorageMedium) -> None:
        ids = blocks.ids.tolist()
        if not ids:
            return
        tail = self.queue[-1] if self.queue else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium:
            tail.block_hashes.extend(ids)
        else:
            self.queue.append(BlockRemoved(block_hashes=ids, medium=medium))
