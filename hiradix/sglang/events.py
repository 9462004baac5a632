"""SGLang's KV cache events (``--kv-events-config``) for hiradix.sglang.

SGLang's hierarchical cache tells KV-aware routers where blocks live through
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, handed out by
``take_events()``. :class:`KVEventLog` produces the same events, in the same order and
with the same block ids, from the tree's change log (``HiRadixTree.track_changes``), in
the format of the installed SGLang (0.5.18's ``HiRadixCache``, 0.5.20's or 0.5.23's
``UnifiedRadixCache``; the differences are in one per-version builder, see below):

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
``REFILLED``           0.5.18: nothing (its tree sets the value and moves on);
                       0.5.20, 0.5.23: ``BlockStored`` (GPU), as their
                       ``_unevict_node_on_insert``
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

What 0.5.20 changed, in :class:`_Format20` (chosen when the installed SGLang has
neither ``BlockStoredWithMetadata``, 0.5.18's :class:`_Format18`, nor
``namespaced_block_hash``):

- ``BlockStored`` carries ``cache_salt`` and ``session_id`` (the inserting request's, on
  stores made by an insert) as optional fields, where 0.5.18 had
  ``BlockStoredWithMetadata``; stores coalesce only when both agree;
- an insert that recomputes an evicted node stores it again (GPU).

What 0.5.23 added, in :class:`_Format23` (chosen when the installed SGLang has
``namespaced_block_hash``):

- ``BlockStored`` also carries ``lora_name``; stores coalesce only when it agrees too;
- the published ids (and parents) of a namespace's blocks are namespaced:
  ``namespaced_block_hash(id, seed)``, the seed ``kv_event_namespace_seed`` of
  ``(extra_key, cache_salt)`` with ``--kv-events-config``'s ``format: dynamo``, else of
  ``extra_key`` alone when it names a LoRA adapter (the scheduler's
  ``kv_event_lora_names``), else none (the id unchanged);
- under SGLang's default (Rust) tree core, removals coalesce only within one ``extra_key``
  (its Python tree core coalesces them across namespaces, as 0.5.18 and 0.5.20).
"""

from __future__ import annotations

import hashlib
from itertools import pairwise
from typing import Any

import numpy as np
from sglang.srt.disaggregation import kv_events as sglang_events
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
)

import hiradix
from hiradix.tree._results import NO_NODE, Change

__all__ = ["KVEventLog", "block_ids", "event_format", "salt_seed"]

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

    __slots__ = ("digests", "extra_key", "ids", "parent_id", "salt", "tokens")

    def __init__(
        self,
        digests: np.ndarray,
        ids: np.ndarray,
        tokens: np.ndarray,
        parent_id: int | None,
        extra_key: str | None,
        salt: str | None,
    ) -> None:
        self.digests = digests  # (pages, 32) uint8: the chain, to hash the children from
        self.ids = ids  # (pages,) int64 block ids
        # The node's tokens (int64); with bigram keys the token before the node comes first.
        self.tokens = tokens
        self.parent_id = parent_id  # id of the page before the node; None under a root
        self.extra_key = extra_key  # the namespace's extra_key (0.5.23 namespaces ids by it)
        self.salt = salt  # the namespace's cache_salt (the events' metadata)


class _Format18:
    """SGLang 0.5.18's events: ids as hashed; a salted store is a
    ``BlockStoredWithMetadata``; a recomputed evicted node is stored silently."""

    refill_medium: StorageMedium | None = None
    removals_by_extra_key = False  # removals of one medium coalesce across namespaces

    def __init__(self, params: Any) -> None:
        self._with_metadata = sglang_events.BlockStoredWithMetadata
        self._metadata = sglang_events.BlockStoredMetadata

    def ids(self, blocks: _Blocks) -> list[int]:
        return blocks.ids.tolist()

    def parent_id(self, blocks: _Blocks) -> int | None:
        return blocks.parent_id

    def extras(self, blocks: _Blocks, session_id: str | None) -> Any:
        return None if blocks.salt is None else self._metadata(cache_salt=blocks.salt)

    def extras_of(self, event: Any) -> Any:
        return event.metadata if isinstance(event, self._with_metadata) else None

    def stored(self, fields: dict[str, Any], extras: Any) -> Any:
        return BlockStored(**fields) if extras is None else self._with_metadata(**fields, metadata=extras)


class _Format20:
    """SGLang 0.5.20's events: ids as hashed (no namespaces), ``cache_salt`` and
    ``session_id`` (the inserting request's, on stores made by an insert) as optional
    fields of ``BlockStored`` (stores coalesce only when both agree); a recomputed
    evicted node is stored again (GPU), as its ``_unevict_node_on_insert``."""

    refill_medium: StorageMedium | None = StorageMedium.GPU
    # Both of 0.5.20's tree cores coalesce removals of one medium across namespaces: its
    # Rust core's removals carry no extra_key (0.5.23's do, to namespace LoRA ids).
    removals_by_extra_key = False

    def __init__(self, params: Any) -> None:
        del params  # 0.5.20's events take no options (no namespaces, no LoRA names)

    def ids(self, blocks: _Blocks) -> list[int]:
        return blocks.ids.tolist()

    def parent_id(self, blocks: _Blocks) -> int | None:
        return blocks.parent_id

    def extras(self, blocks: _Blocks, session_id: str | None) -> Any:
        return blocks.salt, session_id

    def extras_of(self, event: Any) -> Any:
        return event.cache_salt, event.session_id

    def stored(self, fields: dict[str, Any], extras: Any) -> Any:
        salt, session_id = extras
        return BlockStored(**fields, cache_salt=salt, session_id=session_id)


class _Format23(_Format20):
    """SGLang 0.5.23's events (module docstring): 0.5.20's, plus namespaced ids and
    ``lora_name`` on ``BlockStored``."""

    def __init__(self, params: Any) -> None:
        # SGLang's default (Rust) tree core coalesces removals only within one extra_key
        # (it tags each with it, to namespace LoRA ids afterwards); its Python tree core,
        # picked by SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python or where the Rust one
        # cannot run, across them, as 0.5.18. The choice is SGLang's own, for these params.
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import select_tree_core_backend

        self.removals_by_extra_key = select_tree_core_backend(params) == "rust"
        self._dynamo = bool(getattr(params, "dynamo_kv_event_format", False))
        # The scheduler's table, shared: it names a request's extra_key at admission,
        # before the request's insert, so a namespace's name is known at its first store.
        self._lora_names = getattr(params, "kv_event_lora_names", None)
        self._seeds: dict[tuple[str | None, str | None], bytes | None] = {}

    def _lora_name(self, extra_key: str | None) -> str | None:
        names = self._lora_names
        if names is None or extra_key is None:
            return None
        # SGLang's dynamo format also resolves an adapter id at extra_key's end
        return names.resolve(extra_key) if self._dynamo else names.get(extra_key)

    def _seed(self, blocks: _Blocks) -> bytes | None:
        if blocks.extra_key is None and blocks.salt is None:
            return None
        if self._dynamo:
            ns = (blocks.extra_key, blocks.salt)
        else:  # only an extra_key naming a LoRA adapter namespaces the ids
            ns = (blocks.extra_key if self._lora_name(blocks.extra_key) is not None else None, None)
        if ns not in self._seeds:  # one SHA-256 per namespace, not per event
            self._seeds[ns] = sglang_events.kv_event_namespace_seed(extra_key=ns[0], cache_salt=ns[1])
        return self._seeds[ns]

    def ids(self, blocks: _Blocks) -> list[int]:
        ids = blocks.ids.tolist()
        seed = self._seed(blocks)
        if seed is None:
            return ids
        namespaced = sglang_events.namespaced_block_hash  # SGLang's own: its ids by definition
        return [namespaced(i, namespace_seed=seed) for i in ids]

    def parent_id(self, blocks: _Blocks) -> int | None:
        seed = self._seed(blocks)
        if seed is None or blocks.parent_id is None:
            return blocks.parent_id
        return sglang_events.namespaced_block_hash(blocks.parent_id, namespace_seed=seed)

    def extras(self, blocks: _Blocks, session_id: str | None) -> Any:
        return blocks.salt, session_id, self._lora_name(blocks.extra_key)

    def extras_of(self, event: Any) -> Any:
        return event.cache_salt, event.session_id, event.lora_name

    def stored(self, fields: dict[str, Any], extras: Any) -> Any:
        salt, session_id, lora_name = extras
        return BlockStored(**fields, cache_salt=salt, session_id=session_id, lora_name=lora_name)


def event_format(params: Any) -> _Format18 | _Format20:
    """The builder of the installed SGLang's events: 0.5.23's where SGLang namespaces
    event ids (``namespaced_block_hash``), 0.5.18's where it has
    ``BlockStoredWithMetadata``, else 0.5.20's. ``params`` is SGLang's
    ``CacheInitParams``. ``O(1)``."""
    if hasattr(sglang_events, "namespaced_block_hash"):
        return _Format23(params)
    if hasattr(sglang_events, "BlockStoredWithMetadata"):
        return _Format18(params)
    return _Format20(params)


class KVEventLog:
    """The KV cache events of one hiradix.sglang cache (see the module docstring).

    ``cache`` gives the tree (whose change log this turns on), ``page_size``,
    ``is_eagle`` and ``namespace_parts(root) -> (extra_key, cache_salt, first_token)``;
    ``params`` (SGLang's ``CacheInitParams``) the event format's options.
    Call :meth:`sync` after each operation that can make nodes (insert, an L3 prefetch's
    insert) before anything can delete them, and :meth:`take` to hand the events out.
    """

    def __init__(self, cache: Any, params: Any) -> None:
        self._cache = cache
        self._tree = cache.tree
        self._tree.track_changes = True
        self._format = event_format(params)
        self._blocks: dict[int, _Blocks] = {}
        self.queue: list[Any] = []
        # the extra_key of the last BlockRemoved's blocks, where it limits coalescing
        self._removed_space: str | None = None
        self.cleared()

    # ------------------------------------------------------------------ public
    def sync(self, session_id: str | None = None) -> None:
        """Turn the tree's changes since the last call into events; ``session_id`` is
        the inserting request's session, for the stores an insert made (0.5.23).
        ``O(records + pages of the nodes made)``."""
        rows = self._tree.take_changes()
        if not len(rows):
            return
        blocks = self._blocks
        for kind, node, other, tokens in rows.tolist():
            if kind == Change.INSERTED:
                self._stored(self._new_blocks(node), GPU, session_id)
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
            elif kind == Change.REFILLED and self._format.refill_medium is not None:
                self._stored(blocks[node], self._format.refill_medium, session_id)

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
        if tree.parent(parent) == NO_NODE:  # below a (namespace) root: the chain starts here
            extra_key, salt, first = cache.namespace_parts(parent)
            prior = salt_seed(salt) if salt is not None else None
            parent_id = None
            prev = first
        else:
            up = self._blocks[parent]
            prior = up.digests[-1].tobytes().hex()
            parent_id = int(up.ids[-1])
            extra_key, salt = up.extra_key, up.salt
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
        blocks = _Blocks(digests, block_ids(digests), tokens, parent_id, extra_key, salt)
        self._blocks[node] = blocks
        return blocks

    def _split(self, new: int, suffix: int, split_len: int) -> None:
        old = self._blocks[suffix]
        pages = split_len // self._cache.page_size
        # bigram tokens carry the token before the node: the suffix's starts at the cut
        cut = split_len + 1 if self._cache.is_eagle else split_len
        self._blocks[new] = _Blocks(
            old.digests[:pages], old.ids[:pages], old.tokens[:cut], old.parent_id, old.extra_key, old.salt
        )
        self._blocks[suffix] = _Blocks(
            old.digests[pages:],
            old.ids[pages:],
            old.tokens[split_len:],
            int(old.ids[pages - 1]),
            old.extra_key,
            old.salt,
        )

    # ------------------------------------------------------------------ events
    def _token_ids(self, blocks: _Blocks) -> list[Any]:
        t = blocks.tokens.tolist()
        if self._cache.is_eagle:
            return list(pairwise(t))
        return t

    def _stored(self, blocks: _Blocks, medium: StorageMedium, session_id: str | None = None) -> None:
        if not len(blocks.ids):
            return
        fmt = self._format
        ids = fmt.ids(blocks)
        parent_id = fmt.parent_id(blocks)
        ps = self._cache.page_size
        extras = fmt.extras(blocks, session_id)
        tail = self.queue[-1] if self.queue else None
        if (
            isinstance(tail, BlockStored)
            and tail.medium == medium
            and tail.lora_id is None
            and tail.block_size == ps
            and fmt.extras_of(tail) == extras
            and tail.block_hashes
            and tail.block_hashes[-1] == parent_id
        ):
            # this node continues the chain the last event stored: one event, as SGLang
            tail.block_hashes.extend(ids)
            tail.token_ids.extend(self._token_ids(blocks))
            return
        fields = dict(
            block_hashes=ids,
            parent_block_hash=parent_id,
            token_ids=self._token_ids(blocks),
            block_size=ps,
            lora_id=None,
            medium=medium,
        )
        self.queue.append(fmt.stored(fields, extras))

    def _removed(self, blocks: _Blocks, medium: StorageMedium) -> None:
        if not len(blocks.ids):
            return
        ids = self._format.ids(blocks)
        tail = self.queue[-1] if self.queue else None
        space = blocks.extra_key if self._format.removals_by_extra_key else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium and self._removed_space == space:
            tail.block_hashes.extend(ids)
        else:
            self.queue.append(BlockRemoved(block_hashes=ids, medium=medium))
            self._removed_space = space
