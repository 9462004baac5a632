"""Pure-Python twin of the Cython tree: the same API, written to be plainly correct.

It is the oracle of the parity tests and the fallback when the extension is not built
(``HIRADIX_PUREPYTHON=1``). Every state change ends in :meth:`HiRadixTree._refresh`,
which recomputes a node's membership of both victim sets from scratch; the core keeps
the same sets incrementally and must agree with this one victim for victim.

Node handles are opaque integers ``index | generation << 32``: the index of an arena
slot and how many times that slot has been freed, so a stale handle is detected
instead of silently naming a newer node. Both implementations hand out slots from the
same LIFO free list, so they agree on handles too.

Errors (the same types from both implementations; a refused call changes nothing):

``KeyError``       a handle that names no live node: unknown, negative, beyond int64,
                   freed, or from before :meth:`HiRadixTree.reset`
``TypeError``      an argument of the wrong type: a handle or count that is not an
                   integer (floats are never truncated), token ids or indices of a
                   non-integer dtype, an ``extra_key`` that is not a ``str``
``OverflowError``  an integer outside what the tree stores: a token id or a KV slot
                   index outside int32 (the compiled tree keeps slots in 4 bytes), a
                   count or priority outside int64, ``page_size`` beyond int64
``ValueError``     a bad value: arrays that are not 1-D, lengths that disagree, a node
                   in a state where the operation means nothing (not on the device, not
                   evicted, not backed up, children in the way, a parent not backed up)
``LockError``      (a ``RuntimeError``) the locking or transfer protocol is broken; see
                   :class:`hiradix.LockError`

Locks are owned: ``inc_lock_ref(node)`` adds a lock *of node's own* (and protects its
ancestors), and ``dec_lock_ref`` must name a node that holds one. A transfer's lock is
owned by the node the transfer was begun on and is released only by its commit or
finish; a held load-back plan's lock (``plan_load_back``) only by ``begin_load_back``,
which makes it the copy's, or ``cancel_load_back``. So a release can never take a lock
that a copy in flight, or one about to start, still relies on.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from hiradix.tree._results import (
    NO_NODE,
    Change,
    EvictHostResult,
    EvictResult,
    IndexArray,
    InsertHostResult,
    InsertResult,
    IOStatus,
    LoadBackPlan,
    LockError,
    MatchResult,
)
from hiradix.tree.policy import EvictionPolicy, check_tree_args, get_policy, seed_digest, write_through_threshold

ROOT = 0
IO_IDLE, IO_WRITING, IO_LOADING = 0, 1, 2
_IO_NAMES = {IO_IDLE: "idle", IO_WRITING: "writing", IO_LOADING: "loading"}
_EMPTY = np.empty(0, dtype=np.int64)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------------- inputs
def reject_dtype(arr: np.ndarray, name: str, lo: int, hi: int) -> None:
    """Raise for an array of a dtype that is not an integer one: ``OverflowError`` for an
    object array of Python ints with one outside ``[lo, hi]`` (what numpy makes of a list
    holding an int beyond 64 bits), ``TypeError`` for anything else (floats, bools,
    strings, other objects)."""
    if arr.dtype.kind == "O" and all(type(x) is int for x in arr.flat):
        small, large = min(arr.flat), max(arr.flat)
        if small < lo or large > hi:
            raise OverflowError(f"{name} out of range: min {small}, max {large}")
    raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")


def as_tokens(key: Any) -> np.ndarray:
    """Token ids as a 1-D int32 array (numpy, list, ``array('q')``, CPU torch tensor).
    ``ValueError`` if not 1-D, ``TypeError`` for a non-integer dtype, ``OverflowError``
    for an id outside int32."""
    arr = np.asarray(key)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.empty(0, dtype=np.int32)
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        reject_dtype(arr, "token ids", _INT32_MIN, _INT32_MAX)
    if arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise OverflowError(f"token id out of int32 range: min {lo}, max {hi}")
        arr = arr.astype(np.int32)
    return arr


def as_indices(value: Any, name: str = "value", *, fit: bool = True) -> IndexArray:
    """KV slot indices as a 1-D int64 array. ``ValueError`` if not 1-D, ``TypeError`` for a
    non-integer dtype, ``OverflowError`` for an index outside int32 (never wrapped): the
    compiled tree stores slots as int32, and the twin refuses what it refuses. Without
    ``fit`` the caller checks the slots it stores itself (:func:`check_slots`)."""
    arr = np.asarray(value)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        reject_dtype(arr, name, _INT64_MIN, _INT64_MAX)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        raise OverflowError(f"{name} out of int64 range: max {int(arr.max())}")
    out = arr.astype(np.int64, copy=False)
    if fit:
        check_slots(out, name)
    return out


def check_slots(slots: IndexArray, name: str = "value") -> None:
    """``OverflowError`` unless every slot fits int32, the span buffers' type."""
    if len(slots) == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    if lo < _INT32_MIN or hi > _INT32_MAX:
        raise OverflowError(f"{name} out of the tree's slot range (int32): min {lo}, max {hi}")


def as_int64(x: Any, name: str) -> int:
    """An integer argument (``operator.index``: ``TypeError`` for floats and other
    non-integers) that must fit in int64 (``OverflowError``)."""
    v = operator.index(x)
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise OverflowError(f"{name} = {v} does not fit in int64")
    return v


# ----------------------------------------------------------------------------- hashing
def get_hash_str(token_ids: Iterable[int], prior_hash: str | None = None) -> str:
    """SHA-256 of one page, chained on ``prior_hash`` (SGLang's ``get_hash_str``).

    >>> get_hash_str([1, 2, 3, 4])
    'cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72'
    """
    h = hashlib.sha256()
    if prior_hash:
        h.update(bytes.fromhex(prior_hash))
    h.update(np.asarray(list(token_ids), dtype=np.int64).astype("<u4").tobytes())
    return h.hexdigest()


def _page_digests(tokens: np.ndarray, page_size: int, prev: bytes | None) -> list[bytes]:
    out = []
    data = tokens.astype("<u4")
    for start in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(data[start : start + page_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


def page_digests(tokens: Any, page_size: int, prior_hash: str | None = None) -> np.ndarray:
    """Chained digests of every full page of ``tokens`` as an ``(n_pages, 32)`` uint8 array."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    arr = as_tokens(tokens)
    arr = arr[: len(arr) // page_size * page_size]
    prev = bytes.fromhex(prior_hash) if prior_hash else None
    if prev is not None and len(prev) != 32:
        raise ValueError("prior_hash must be 64 hex digits")
    digests = _page_digests(arr, page_size, prev)
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 32)


def page_hashes(tokens: Any, page_size: int, prior_hash: str | None = None) -> list[str]:
    """Chained hashes (lowercase hex) of every full page of ``tokens``."""
    return [row.tobytes().hex() for row in page_digests(tokens, page_size, prior_hash)]


def namespace_seed(extra_key: str) -> str:
    """Digest that seeds the hash chain of a namespace (hex)."""
    return hashlib.sha256(b"hiradix-namespace\x00" + extra_key.encode()).hexdigest()


# ----------------------------------------------------------------------------- nodes
class _Node:
    __slots__ = (
        "children",
        "creation_time",
        "dkey",
        "gen",
        "hashes",
        "hit_count",
        "hkey",
        "host_ref_counter",
        "host_value",
        "index",
        "io_owner",
        "io_status",
        "io_ticket",
        "is_root",
        "key",
        "last_access_time",
        "lock_ref",
        "own_locks",
        "parent",
        "pending_host",
        "priority",
        "seed",
        "sieve_lap",
        "uid",
        "value",
        "visited",
    )  # fmt: skip

    def __init__(self, index: int, gen: int, uid: int) -> None:
        self.index, self.gen, self.uid = index, gen, uid
        self.parent: _Node | None = None
        self.children: dict[tuple[int, ...], _Node] = {}
        self.key = np.empty(0, dtype=np.int32)
        self.value: IndexArray | None = None  # device indices; None = evicted from L1
        self.host_value: IndexArray | None = None  # host indices; None = not backed up
        self.pending_host: IndexArray | None = None  # host indices of a backup in flight
        self.hashes: list[bytes] | None = None  # one chained digest per page
        self.lock_ref = 0  # locks of this node and of its descendants (and transfers')
        self.own_locks = 0  # inc_lock_ref calls on this very node not yet undone
        self.host_ref_counter = 0
        self.hit_count = 0
        self.priority = 0
        self.last_access_time = 0.0
        self.creation_time = 0.0
        self.io_status = IO_IDLE
        self.io_ticket = 0
        self.io_owner = False  # the transfer in flight was begun on this node (holds its lock)
        self.visited = False
        self.sieve_lap = 0
        self.is_root = False
        self.seed: bytes | None = None  # roots only: digest the namespace chain starts from
        self.dkey: tuple[float, float, int] | None = None  # key in the device victim set
        self.hkey: tuple[float, float, int] | None = None  # key in the host victim set

    @property
    def handle(self) -> int:
        return self.index | (self.gen << 32)

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.is_root or self.host_value is not None


class HiRadixTree:
    """Triple-state radix tree over token ids (pure Python).

    Parameters
    ----------
    page_size:
        Tokens per KV page; keys are matched and split on page boundaries only.
    eviction_policy:
        Name from :mod:`hiradix.tree.policy` or an :class:`~hiradix.tree.policy.EvictionPolicy`.
    write_policy:
        ``write_through``, ``write_through_selective`` or ``write_back``.
    enable_hash:
        Keep one chained SHA-256 per page (``hash_value``), needed for an L3.
    clock:
        Callable returning the time stamped on accessed nodes, called once per
        operation. By default a logical counter (1, 2, 3, ...), never wall time.
    chain_seed:
        Where each root's hash chain starts: called once per root with its
        ``extra_key`` (``None`` for the default root, at construction), it returns 64
        hex digits or ``None`` (unseeded: SGLang's chain). By default the default root
        is unseeded and a namespace root is seeded with :func:`namespace_seed` of its
        ``extra_key``. ``lambda extra_key: None`` hashes every namespace's pages as
        SGLang does (tokens only; the namespaces still never share nodes).
    """

    _root: _Node
    _namespaces: dict[str, _Node]

    def __init__(
        self,
        page_size: int = 1,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        write_policy: str = "write_through",
        enable_hash: bool = False,
        clock: Callable[[], float] | None = None,
        chain_seed: Callable[[str | None], str | None] | None = None,
    ) -> None:
        check_tree_args(page_size, clock, chain_seed)
        self.page_size = page_size
        self.policy = get_policy(eviction_policy)
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold(write_policy)
        self.enable_hash = bool(enable_hash)
        self._clock = clock
        self._chain_seed = chain_seed
        # Change log (track_changes): None while off, so recording costs one test.
        self._changes: list[tuple[int, int, int, int]] | None = None
        self._init_state()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        """Drop every node but the root (the caller frees all KV first). Handles of the
        dropped nodes go stale; the logical clock restarts, node counters and uids run
        on. ``O(n)``."""
        self._time = 0
        self._dev_set.clear()
        self._host_set.clear()
        for node in self._slots:
            if node is not None and node is not self._root:
                node.dkey = node.hkey = None
                self._release(node)
        self._root.children = {}
        self._root.host_ref_counter = 0
        self._root.last_access_time = 0.0
        self._namespaces = {}
        self._plans.clear()
        self._sieve_hand = [0, 0]
        self._evictable = self._protected = self._host_size = 0
        if self._changes is not None:
            self._changes.clear()  # records of the dropped nodes name stale handles

    def _init_state(self) -> None:
        self._slots: list[_Node | None] = []
        self._gens: list[int] = []
        self._free: list[int] = []
        self._uid = 0
        self._time = 0
        self._ticket = 0
        self._sieve_hand = [0, 0]  # SIEVE: lap of the hand of the device / host set
        self._namespaces = {}
        self._dev_set: SortedList = SortedList()
        self._host_set: SortedList = SortedList()
        # Nodes holding a load-back plan (plan_load_back), each owning one lock.
        self._plans: set[int] = set()
        self._evictable = 0
        self._protected = 0
        self._host_size = 0
        self.nodes_allocated = 0
        self.nodes_freed = 0
        self._root = self._new_root(None)

    def _alloc(self) -> _Node:
        if self._free:
            index = self._free.pop()
        else:
            index = len(self._slots)
            self._slots.append(None)
            self._gens.append(0)
        self._uid += 1
        node = _Node(index, self._gens[index], self._uid)
        self._slots[index] = node
        self.nodes_allocated += 1
        return node

    def _release(self, node: _Node) -> None:
        self._set_membership(node, None, None)
        self._slots[node.index] = None
        self._gens[node.index] = (self._gens[node.index] + 1) & 0x7FFFFFFF
        self._free.append(node.index)
        self.nodes_freed += 1

    def _new_root(self, extra_key: str | None) -> _Node:
        root = self._alloc()
        root.is_root = True
        root.value = _EMPTY
        root.lock_ref = 1  # a root is never evicted
        if self._chain_seed is not None:
            seed = self._chain_seed(extra_key)
        else:
            seed = None if extra_key is None else namespace_seed(extra_key)
        root.seed = seed_digest(seed, extra_key)
        return root

    def _namespace_root(self, extra_key: str | None) -> _Node:
        if extra_key is None:
            return self._root
        if not isinstance(extra_key, str):
            raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        root = self._namespaces.get(extra_key)
        if root is None:
            root = self._namespaces[extra_key] = self._new_root(extra_key)
        return root

    def _node(self, handle: int) -> _Node:
        handle = operator.index(handle)  # TypeError for floats: a handle is never truncated
        index = handle & 0xFFFFFFFF
        if handle < 0 or handle > _INT64_MAX or index >= len(self._slots):
            raise KeyError(f"no node with handle {handle}")
        node = self._slots[index]
        if node is None or node.gen != handle >> 32:
            raise KeyError(f"node handle {handle} is stale (its node was freed)")
        return node

    def _tick(self) -> float:
        if self._clock is not None:
            return float(self._clock())
        self._time += 1
        return float(self._time)

    # ------------------------------------------------------------------ change log
    @property
    def track_changes(self) -> bool:
        """Whether the tree logs its changes for :meth:`take_changes` (off by default;
        turning it off drops the records not yet taken)."""
        return self._changes is not None

    @track_changes.setter
    def track_changes(self, on: bool) -> None:
        if not on:
            self._changes = None
        elif self._changes is None:
            self._changes = []

    def take_changes(self) -> np.ndarray:
        """The change records since the last call, oldest first, as an ``(n, 4)`` int64
        array of ``(kind, node, other, tokens)`` rows (kinds: :class:`hiradix.Change`);
        empties the log. Records name a node by its handle at the time; a deleted
        node's handle is stale by the time it is read. ``O(n)``.

        >>> t = HiRadixTree()
        >>> t.track_changes = True
        >>> r = t.insert([1, 2, 3], [7, 8, 9])
        >>> [Change(k).name for k in t.take_changes()[:, 0]]
        ['INSERTED']
        """
        rows = self._changes or []
        out = np.array(rows, dtype=np.int64).reshape(len(rows), 4)
        if self._changes is not None:
            self._changes = []
        return out

    def _record(self, kind: Change, node: _Node, other: int, tokens: int) -> None:
        assert self._changes is not None
        self._changes.append((int(kind), node.handle, other, tokens))

    def _touch(self, node: _Node, now: float) -> None:
        node.last_access_time = now
        node.visited = True

    # ------------------------------------------------------------------ victim sets
    def _set_membership(
        self, node: _Node, dkey: tuple[float, float, int] | None, hkey: tuple[float, float, int] | None
    ) -> None:
        if node.dkey != dkey:
            if node.dkey is not None:
                self._dev_set.remove(node.dkey + (node.index,))
            if dkey is not None:
                self._dev_set.add(dkey + (node.index,))
            node.dkey = dkey
        if node.hkey != hkey:
            if node.hkey is not None:
                self._host_set.remove(node.hkey + (node.index,))
            if hkey is not None:
                self._host_set.add(hkey + (node.index,))
            node.hkey = hkey

    def _is_device_leaf(self, node: _Node) -> bool:
        return (
            not node.is_root
            and node.value is not None
            and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def _is_host_leaf(self, node: _Node) -> bool:
        return (
            not node.is_root
            and node.value is None
            and node.host_value is not None
            and node.lock_ref == 0
            and node.host_ref_counter == 0
            and not node.children
        )

    def _refresh(self, node: _Node) -> None:
        dev, host = self._is_device_leaf(node), self._is_host_leaf(node)
        if self.policy.second_chance:  # a node entering a victim set joins its hand's lap
            if dev and node.dkey is None:
                node.sieve_lap = self._sieve_hand[0]
            elif host and node.hkey is None:
                node.sieve_lap = self._sieve_hand[1]
        key = self.policy.sort_key(node)
        self._set_membership(node, key if dev else None, key if host else None)

    def _pop_victim(self, s: int, skip: set[int]) -> _Node | None:
        """Smallest entry of victim set ``s`` (0: device, 1: host) not in ``skip``; SIEVE
        gives visited nodes another lap."""
        victims = self._dev_set if s == 0 else self._host_set
        pos = 0
        while pos < len(victims):
            entry = victims[pos]
            node = self._slots[entry[-1]]
            assert node is not None
            if node.index in skip:
                pos += 1
                continue
            if self.policy.second_chance:
                self._sieve_hand[s] = node.sieve_lap
                if node.visited:
                    node.visited = False
                    node.sieve_lap += 1
                    self._refresh(node)
                    continue
            return node
        return None

    # ------------------------------------------------------------------ structure
    def _page_key(self, tokens: np.ndarray, start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size].tolist())

    def _common_prefix(self, a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        common = int(diff[0]) if len(diff) else n
        return common // self.page_size * self.page_size

    def _size_delta(self, node: _Node, tokens: int) -> None:
        if node.lock_ref > 0:
            self._protected += tokens
        else:
            self._evictable += tokens

    def _split(self, child: _Node, split_len: int) -> _Node:
        """Cut ``child`` after ``split_len`` tokens; the new node takes the prefix.

        The existing node keeps its handle (it is the suffix), so handles held for locks
        and in-flight transfers stay valid. All three states are cut at the same place.
        """
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        new = self._alloc()
        new.parent = parent
        new.key, child.key = child.key[:split_len], child.key[split_len:]
        if child.value is not None:
            new.value, child.value = child.value[:split_len], child.value[split_len:]
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:split_len], child.host_value[split_len:]
        if child.pending_host is not None:
            new.pending_host = child.pending_host[:split_len]
            child.pending_host = child.pending_host[split_len:]
        if child.hashes is not None:
            pages = split_len // self.page_size
            new.hashes, child.hashes = child.hashes[:pages], child.hashes[pages:]
        for attr in (
            "lock_ref", "hit_count", "priority", "last_access_time", "creation_time",
            "io_status", "io_ticket", "visited", "sieve_lap",
        ):  # fmt: skip
            setattr(new, attr, getattr(child, attr))
        parent.children[self._page_key(new.key, 0)] = new
        new.children = {self._page_key(child.key, 0): child}
        child.parent = new
        self._refresh(new)
        self._refresh(child)
        if self._changes is not None:
            self._record(Change.SPLIT, new, child.handle, split_len)
        return new

    def _walk(
        self, root: _Node, tokens: np.ndarray, now: float, on_node: Callable[[_Node, int, int], None] | None = None
    ) -> tuple[_Node, int]:
        """Follow ``tokens`` down from ``root``, splitting where the match ends inside a
        node. Returns the deepest matched node and the matched length."""
        node, pos, n = root, 0, len(tokens)
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            self._touch(child, now)
            plen = self._common_prefix(child.key, tokens[pos:])
            if plen < len(child.key):
                child = self._split(child, plen)
            if on_node is not None:
                on_node(child, pos, plen)
            self._refresh(child)
            # After a split the next page differs from the suffix's first page, so the
            # next lookup misses and the loop ends there.
            node, pos = child, pos + plen
        return node, pos

    def _stored_from(self, node: _Node, tokens: np.ndarray) -> int:
        """Where an insert of ``tokens`` (page-aligned) below ``node`` starts storing
        device slots: the length of the path's prefix already on the device, read-only.
        Insert stores slots only past it: of the evicted spans it re-materializes (the
        walk stops at the first) and of its new node."""
        pos, n = 0, len(tokens)
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None or child.value is None:
                break
            plen = self._common_prefix(child.key, tokens[pos:])
            pos += plen
            if plen < len(child.key):
                break
            node = child
        return pos

    def _new_child(self, parent: _Node, tokens: np.ndarray, now: float) -> _Node:
        node = self._alloc()
        node.parent = parent
        node.key = tokens.copy()
        node.last_access_time = node.creation_time = now
        node.visited = False
        if self.enable_hash:
            prev = parent.seed if parent.is_root else (parent.hashes[-1] if parent.hashes else None)
            node.hashes = _page_digests(node.key, self.page_size, prev)
        parent.children[self._page_key(tokens, 0)] = node
        return node

    def _delete_leaf(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[self._page_key(node.key, 0)]
        self._release(node)
        self._refresh(parent)

    def _aligned(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[: len(tokens) // self.page_size * self.page_size]

    def _backup_chain(self, node: _Node, out: dict[int, None]) -> None:
        """Add ``node`` and its ancestors that are neither backed up nor being backed up,
        parents first, so backup continuity holds whatever order acks arrive in."""
        chain = []
        while not node.is_root and node.host_value is None and node.io_status != IO_WRITING:
            chain.append(node.handle)
            node = node.parent  # type: ignore[assignment]
        for handle in reversed(chain):
            out.setdefault(handle, None)

    # ------------------------------------------------------------------ operations
    def match_prefix(self, key: Any, extra_key: str | None = None) -> MatchResult:
        """Longest cached prefix of ``key``.

        Splits the last matched node if the match ends inside it, and stamps the access
        time of every matched node. Runtime complexity: ``O(len(key))``.
        """
        tokens = self._aligned(as_tokens(key))
        root = self._namespace_root(extra_key)
        now = self._tick()
        node, _ = self._walk(root, tokens, now)
        last_device = node
        host_hit = 0
        while last_device.value is None:
            host_hit += len(last_device.key)
            last_device = last_device.parent  # type: ignore[assignment]
        # The seed's worked example fixes last_host_node at the device-resident end of
        # the match (Node_A), the anchor the evicted tail hangs from; the tail's own end
        # is reported as last_node.
        last_host = last_device
        while not last_host.backuped:
            last_host = last_host.parent  # type: ignore[assignment]
        parts: list[IndexArray] = []
        walk = last_device
        while not walk.is_root:
            assert walk.value is not None
            parts.append(walk.value)
            walk = walk.parent  # type: ignore[assignment]
        device = np.concatenate(parts[::-1]) if parts else _EMPTY.copy()
        return MatchResult(device, last_device.handle, last_host.handle, host_hit, node.handle)

    def insert(
        self,
        key: Any,
        value: Any,
        extra_key: str | None = None,
        *,
        priority: int = 0,
        chunked: bool = False,
        hold: bool = False,
        start: int | None = None,
    ) -> InsertResult:
        """Insert ``key`` with device indices ``value`` (same length).

        Only the page-aligned prefix is inserted. Evicted nodes on the path take the new
        indices (re-materialization) instead of being duplicated. Runtime complexity:
        ``O(len(key))``. ``priority`` is an int64 (``TypeError``/``OverflowError``).
        ``hold``: when the result names nodes to back up, also take a lock owned by the
        last of them, the deepest (as :meth:`inc_lock_ref`), which keeps them all
        protected, and nothing below them (as their backups' own locks will), until the
        caller has started their backups and releases it (:meth:`dec_lock_refs`).
        ``start``: a device node (or a root) whose path ``key`` continues: the caller
        vouches that the key's tokens follow that path's (a running request's locked
        node and the tokens after its cached prefix), so the descent begins there and
        costs ``O(len(key))`` plus ``O(depth(start))`` nodes, whatever the prefix's
        length; ``extra_key`` is then unused (the node's namespace is the key's), the
        ancestors are stamped as a descent through them would be, and ``prefix_len``
        counts the key's tokens only. ``value``'s slots are checked to fit int32
        (``OverflowError``) where the insert stores them: past the prefix already on the
        device, whose slots it never reads.
        """
        start_node = None
        if start is not None:
            start_node = self._node(start)
            if not start_node.is_root and start_node.value is None:
                raise ValueError(f"insert: start node {start} is not on the device")
        priority = as_int64(priority, "priority")
        tokens = as_tokens(key)
        values = as_indices(value, fit=False)
        if len(values) != len(tokens):
            raise ValueError(f"value has {len(values)} indices for {len(tokens)} tokens")
        tokens = self._aligned(tokens)
        n = len(tokens)
        # Only the slots it stores are checked (before anything changes): those of the
        # prefix already on the device are never read.
        if start_node is not None:
            known: _Node | None = start_node
        elif extra_key is None:
            known = self._root
        else:
            known = self._namespaces.get(extra_key) if isinstance(extra_key, str) else None
        check_slots(values[self._stored_from(known, tokens) if known is not None else 0 : n])
        root = self._namespace_root(extra_key) if start_node is None else start_node
        now = self._tick()
        prefix_len = 0
        backup: dict[int, None] = {}
        report = self.write_through_threshold > 0 and not chunked
        if start_node is not None:
            self._stamp_path_above(start_node, now, backup if report else None)

        def visit(node: _Node, pos: int, plen: int) -> None:
            nonlocal prefix_len
            node.priority = max(node.priority, priority)
            if node.value is None:
                node.value = values[pos : pos + plen].copy()
                self._size_delta(node, plen)
                self._refresh(node.parent)  # type: ignore[arg-type]
                if self._changes is not None:
                    self._record(Change.REFILLED, node, -1, plen)
            else:
                prefix_len += plen
                if not chunked:
                    node.hit_count += 1
                    if report and node.hit_count >= self.write_through_threshold:
                        self._backup_chain(node, backup)

        node, pos = self._walk(root, tokens, now, visit)
        if pos < n:
            parent = node
            node = self._new_child(parent, tokens[pos:], now)
            node.value = values[pos:n].copy()
            node.priority = priority
            self._evictable += n - pos
            if not chunked:
                node.hit_count = 1
                if report and node.hit_count >= self.write_through_threshold:
                    self._backup_chain(node, backup)
            self._refresh(node)
            self._refresh(parent)
            if self._changes is not None:
                self._record(Change.INSERTED, node, -1, n - pos)
        if hold and backup:
            self.inc_lock_ref(next(reversed(backup)))  # the deepest: its lock covers them all
        return InsertResult(prefix_len, node.handle, tuple(backup))

    def _stamp_path_above(self, start: _Node, now: float, backup: dict[int, None] | None) -> None:
        # An insert that continues from ``start`` stamps the path above it as a descent
        # through it would. That path is not descended (no hit is counted there), but
        # with ``backup`` (write-through reporting on) its nodes that reached the
        # threshold are backed up as after any insert through them: parents first,
        # before the nodes below.
        above = []
        up = start
        while not up.is_root:
            self._touch(up, now)
            self._refresh(up)
            above.append(up)
            up = up.parent  # type: ignore[assignment]
        if backup is None:
            return
        for node in reversed(above):
            if node.hit_count >= self.write_through_threshold:
                self._backup_chain(node, backup)

    def insert_host(self, node: int, key: Any, host_value: Any) -> InsertHostResult:
        """Attach host-only KV (an L3 prefetch result) below the backed-up ``node``.

        ``key`` continues the prefix that ends at ``node``. Tokens already in the tree are
        matched (split if needed); the rest becomes one tombstone with ``host_value`` and
        its page hashes, unless the match ends at a node that is not backed up, in which
        case nothing is attached (backup continuity). Runtime complexity: ``O(len(key))``.
        """
        mount = self._node(node)
        if not mount.backuped:
            raise ValueError(f"insert_host below node {node}, which is not backed up")
        tokens = as_tokens(key)
        hosts = as_indices(host_value, "host_value")
        if len(hosts) != len(tokens):
            raise ValueError(f"host_value has {len(hosts)} indices for {len(tokens)} tokens")
        tokens = self._aligned(tokens)
        now = self._tick()
        self._touch(mount, now)
        self._refresh(mount)
        last, pos = self._walk(mount, tokens, now)
        if pos == len(tokens) or not last.backuped:
            return InsertHostResult(pos, 0, last.handle)
        child = self._new_child(last, tokens[pos:], now)
        child.host_value = hosts[pos : len(tokens)].copy()
        self._host_size += len(tokens) - pos
        self._refresh(child)
        self._refresh(last)
        if self._changes is not None:
            self._record(Change.HOST_INSERTED, child, -1, len(tokens) - pos)
        return InsertHostResult(pos, len(tokens) - pos, child.handle)

    def _lock(self, walk: _Node, sign: int) -> int:
        """Add ``sign`` to the lock_ref of ``walk`` and its ancestors; returns the change
        of ``evictable_size``."""
        delta = 0
        while not walk.is_root:
            if walk.lock_ref == (0 if sign > 0 else 1) and walk.value is not None:
                self._evictable -= sign * len(walk.key)
                self._protected += sign * len(walk.key)
                delta -= sign * len(walk.key)
            walk.lock_ref += sign
            self._refresh(walk)
            walk = walk.parent  # type: ignore[assignment]
        return delta

    def inc_lock_ref(self, node: int) -> int:
        """Take a lock owned by ``node``, which protects it and its ancestors from
        eviction; returns the change of ``evictable_size``. On a root it does nothing.
        Runtime complexity: ``O(depth)``."""
        target = self._node(node)
        if target.is_root:
            return 0
        target.own_locks += 1
        return self._lock(target, 1)

    def dec_lock_ref(self, node: int) -> int:
        """Release one lock taken by :meth:`inc_lock_ref` on this same node; returns the
        change of ``evictable_size``. On a root it does nothing.

        Raises :class:`LockError` if ``node`` holds no lock of its own: never locked,
        already released, or locked only through a descendant or by a transfer in flight
        (whose lock only its commit/finish releases). Runtime complexity: ``O(depth)``.
        """
        target = self._node(node)
        if target.is_root:
            return 0
        if target.own_locks <= 0:
            raise LockError(
                f"dec_lock_ref on node {node}, which holds no lock of its own "
                f"(lock_ref {target.lock_ref}, io_status {_IO_NAMES[target.io_status]})"
            )
        target.own_locks -= 1
        return self._lock(target, -1)

    def dec_lock_refs(self, nodes: Iterable[int]) -> int:
        """:meth:`dec_lock_ref` of each of ``nodes`` (a node named twice releases two of
        its locks); returns the total change of ``evictable_size``. All or nothing:
        :class:`LockError`, before anything is released, if a node holds fewer locks of
        its own than it is named. Runtime complexity: ``O(sum of depths)``."""
        handles = list(nodes)
        need: dict[int, int] = {}
        for h in handles:
            t = self._node(h)
            if not t.is_root:
                need[h] = need.get(h, 0) + 1
        for h, k in need.items():
            t = self._node(h)
            if t.own_locks < k:
                raise LockError(
                    f"dec_lock_refs on node {h}, named {k} times, which holds {t.own_locks} lock(s) of its own "
                    f"(lock_ref {t.lock_ref}, io_status {_IO_NAMES[t.io_status]})"
                )
        return sum(self.dec_lock_ref(h) for h in handles)

    def inc_host_ref(self, node: int) -> None:
        """Protect a node's host copy (e.g. a prefetch mount point). ``O(1)``."""
        walk = self._node(node)
        walk.host_ref_counter += 1
        self._refresh(walk)

    def dec_host_ref(self, node: int) -> None:
        """Undo one :meth:`inc_host_ref`; :class:`LockError` if the node's
        ``host_ref_counter`` is 0. ``O(1)``."""
        walk = self._node(node)
        if walk.host_ref_counter <= 0:
            raise LockError(f"dec_host_ref on node {node}, whose host_ref_counter is 0")
        walk.host_ref_counter -= 1
        self._refresh(walk)

    def evict(self, num_tokens: int) -> EvictResult:
        """Free at least ``num_tokens`` device tokens if possible, leaves first.

        A backed-up leaf becomes a tombstone; one that is not is deleted (write_through)
        or reported for write-back. ``num_tokens <= 0`` frees nothing; it is an int64
        (``TypeError``/``OverflowError``). Runtime complexity: ``O(k log n)`` for ``k``
        victims.
        """
        num_tokens = as_int64(num_tokens, "num_tokens")
        freed: list[IndexArray] = []
        write_back: list[int] = []
        backup: dict[int, None] = {}
        skip: set[int] = set()
        evicted = 0
        while evicted < num_tokens:
            victim = self._pop_victim(0, skip)
            if victim is None:
                break
            evicted += len(victim.key)
            if victim.host_value is not None:
                freed.append(self._demote(victim))
                if self._changes is not None:
                    self._record(Change.DEMOTED, victim, -1, len(victim.key))
            elif self.write_policy == "write_back":
                skip.add(victim.index)
                write_back.append(victim.handle)
                self._backup_chain(victim, backup)
            else:
                assert victim.value is not None and not victim.children
                if self._changes is not None:
                    self._record(Change.DELETED, victim, -1, len(victim.key))
                freed.append(victim.value)
                self._evictable -= len(victim.key)
                self._delete_leaf(victim)
        device = np.concatenate(freed) if freed else _EMPTY.copy()
        return EvictResult(evicted, device, tuple(write_back), tuple(backup))

    def _demote(self, node: _Node) -> IndexArray:
        value = node.value
        assert value is not None and node.lock_ref == 0
        node.value = None
        self._evictable -= len(node.key)
        self._refresh(node)
        self._refresh(node.parent)  # type: ignore[arg-type]
        return value

    def demote(self, node: int) -> IndexArray:
        """Drop the device copy of a backed-up, unlocked device leaf; returns the device
        indices to free. Completes write-back eviction.

        ``ValueError`` for a root, a node not on the device or not backed up, or one with
        device children; :class:`LockError` for a locked node (a copy in flight locks
        its node). Runtime complexity: ``O(children + log n)``.
        """
        target = self._node(node)
        if target.is_root or target.value is None or target.host_value is None:
            raise ValueError(f"demote: node {node} must be on the device and backed up")
        if any(c.value is not None for c in target.children.values()):
            raise ValueError(f"demote: node {node} has device children")
        self._check_unpinned(target, "demote")
        value = self._demote(target)
        if self._changes is not None:
            self._record(Change.DEMOTED, target, -1, len(target.key))
        return value

    def _check_unpinned(self, target: _Node, op: str) -> None:
        if target.lock_ref or target.io_status != IO_IDLE:
            raise LockError(
                f"{op}: node {target.handle} is locked (lock_ref {target.lock_ref}, "
                f"io_status {_IO_NAMES[target.io_status]}); its slots may still be read"
            )

    def drop(self, node: int) -> IndexArray:
        """Delete an unlocked device leaf that is not backed up; returns its device
        indices to free. The way out of write-back eviction when no host slot can be
        had for the backup.

        ``ValueError`` for a root, a node not on the device, backed up, or with children;
        :class:`LockError` for a locked node (a backup in flight locks its node).
        Runtime complexity: ``O(log n)``.
        """
        target = self._node(node)
        if target.is_root or target.value is None or target.host_value is not None:
            raise ValueError(f"drop: node {node} must be on the device and not backed up")
        if target.children:
            raise ValueError(f"drop: node {node} has children")
        self._check_unpinned(target, "drop")
        if self._changes is not None:
            self._record(Change.DELETED, target, -1, len(target.key))
        value = target.value
        self._evictable -= len(target.key)
        self._delete_leaf(target)
        return value

    def evict_host(self, num_tokens: int) -> EvictHostResult:
        """Delete at least ``num_tokens`` host-only tokens if possible, deepest first.
        ``num_tokens`` as in :meth:`evict`. Runtime complexity: ``O(k log n)`` for ``k``
        victims."""
        num_tokens = as_int64(num_tokens, "num_tokens")
        freed: list[IndexArray] = []
        evicted = 0
        while evicted < num_tokens:
            victim = self._pop_victim(1, set())
            if victim is None:
                break
            assert victim.host_value is not None
            evicted += len(victim.key)
            freed.append(victim.host_value)
            self._host_size -= len(victim.key)
            if self._changes is not None:
                self._record(Change.HOST_DELETED, victim, -1, len(victim.key))
            self._delete_leaf(victim)
        host = np.concatenate(freed) if freed else _EMPTY.copy()
        return EvictHostResult(evicted, host)

    # ------------------------------------------------------------------ tier moves
    def begin_backup(self, node: int, host_indices: Any) -> IndexArray:
        """Start copying ``node`` to host slots ``host_indices``; locks it.

        The parent must be backed up or being backed up. Returns the device indices to
        copy. The node counts as backed up only after :meth:`commit_backup`, which must
        name this same node (its handle survives splits).

        ``ValueError`` for a root, a node not on the device or already backed up (a node
        being loaded is), a parent neither backed up nor being written, or a length that
        is not the node's; :class:`LockError` if a backup of the node is already in
        flight. Runtime complexity: ``O(depth + len)``.
        """
        target = self._backup_target(node, "begin_backup")
        hosts = as_indices(host_indices, "host_indices")
        parent = target.parent
        assert parent is not None
        if not (parent.backuped or parent.io_status == IO_WRITING):
            raise ValueError(f"begin_backup: parent of node {node} is not backed up (continuity)")
        if len(hosts) != len(target.key):
            raise ValueError(f"begin_backup: {len(hosts)} host indices for {len(target.key)} tokens")
        self._ticket += 1
        target.pending_host = hosts.copy()
        target.io_status = IO_WRITING
        target.io_ticket = self._ticket
        target.io_owner = True
        self._lock(target, 1)
        assert target.value is not None  # on the device: _backup_target checked it
        return target.value.copy()

    def _backup_target(self, node: int, op: str) -> _Node:
        """The node a backup may begin on (``op`` names the caller in the errors): on the
        device, not backed up, no backup in flight."""
        target = self._node(node)
        if target.is_root or target.value is None:
            raise ValueError(f"{op}: node {node} is not on the device")
        if target.io_status == IO_WRITING:
            raise LockError(f"{op}: node {node} has a backup in flight already")
        if target.host_value is not None:
            raise ValueError(f"{op}: node {node} is already backed up")
        return target

    def reserve_tokens(self, n_tokens: int, evict_tokens: int = 0) -> None:
        """Capacity hints (the compiled core sizes and touches its buffers for
        ``n_tokens`` tokens, and a reusable buffer for ``evict_tokens`` evicted slots):
        nothing to do for Python objects, but the arguments are checked the same way.
        ``O(1)``."""
        n = as_int64(n_tokens, "n_tokens")
        e = as_int64(evict_tokens, "evict_tokens")
        if n < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n}")
        if e < 0:
            raise ValueError(f"evict_tokens must be >= 0, got {e}")

    def backup_order(self, nodes: Iterable[int]) -> tuple[list[int], list[int]]:
        """Of ``nodes`` (handles in any order; repeats and stale handles allowed), those a
        backup can start on now: alive, on the device, not backed up, no transfer in
        flight; with each one's ancestors that are so too (a match that splits a waiting
        node makes a parent nobody asked for, and a child's backup needs its parent's).
        Each once, every parent before its children among them (a step's inserts ask for
        nodes in insert order, and a split asks for the new parent after its child), with
        their lengths. Decides only: nothing changes.
        Runtime complexity: ``O(sum of the chosen nodes' depths among them)``."""
        waiting: dict[int, _Node] = {}
        for h in nodes:
            try:
                cur: _Node | None = self._node(h)
            except (KeyError, TypeError):
                continue
            while (
                cur is not None
                and not cur.is_root
                and cur.value is not None
                and cur.host_value is None
                and cur.io_status == IO_IDLE
                and cur.handle not in waiting
            ):
                waiting[cur.handle] = cur
                cur = cur.parent
        ordered: dict[int, _Node] = {}
        for n in waiting.values():
            chain: list[_Node] = []
            cur = n
            while cur is not None and cur.handle in waiting and cur.handle not in ordered:
                chain.append(cur)
                cur = cur.parent
            for c in reversed(chain):
                ordered[c.handle] = c
        return list(ordered), [len(n.key) for n in ordered.values()]

    def begin_backups(self, nodes: Sequence[int], host_indices: Any) -> tuple[IndexArray, list[bool]]:
        """:meth:`begin_backup` of each of ``nodes`` in order, node ``i`` taking the next
        ``key_len`` slots of ``host_indices``; a node whose parent is by then neither
        backed up nor being written (an earlier node of the batch counts) is skipped and
        its slots are not taken. Returns the started nodes' device indices, concatenated
        in order, and per node whether it started.

        Checked before anything starts, raising as :meth:`begin_backup` does: each node
        on the device, not backed up, without a transfer in flight and named once, and
        as many host slots as their tokens. Runtime complexity: ``O(sum of (depth + len))``."""
        hosts = as_indices(host_indices, "host_indices")
        targets: list[_Node] = []
        seen: set[int] = set()
        total = 0
        for h in nodes:
            t = self._backup_target(h, "begin_backups")
            if t.handle in seen:
                raise ValueError(f"begin_backups: node {h} is named twice")
            seen.add(t.handle)
            targets.append(t)
            total += len(t.key)
        if len(hosts) != total:
            raise ValueError(f"begin_backups: {len(hosts)} host indices for {total} tokens")
        devices: list[IndexArray] = []
        started: list[bool] = []
        start = 0
        for h, t in zip(nodes, targets, strict=True):
            k = len(t.key)
            parent = t.parent
            assert parent is not None
            go = parent.backuped or parent.io_status == IO_WRITING
            if go:
                devices.append(self.begin_backup(h, hosts[start : start + k]))
            started.append(go)
            start += k
        return (np.concatenate(devices) if devices else _EMPTY.copy()), started

    def _io_group(self, node: _Node, status: int, op: str) -> list[_Node]:
        """``node`` and the ancestors split off it while its transfer was in flight;
        :class:`LockError` unless ``node`` is the node a transfer of kind ``status`` was
        begun on and is still in flight."""
        if node.io_status != status:
            raise LockError(
                f"{op}: node {node.handle} has no {_IO_NAMES[status]} transfer in flight "
                f"(io_status {_IO_NAMES[node.io_status]}; finished already, or never begun)"
            )
        if not node.io_owner:
            raise LockError(
                f"{op}: node {node.handle} was split off the node its transfer was begun on; "
                "name that node (its handle is the split's lower part)"
            )
        group = [node]
        walk = node.parent
        while walk is not None and not walk.is_root and walk.io_ticket == node.io_ticket:
            group.append(walk)
            walk = walk.parent
        return group[::-1]

    def commit_backup(self, node: int, ok: bool = True) -> bool:
        """Finish :meth:`begin_backup`. Returns whether the node is now backed up: a
        failed copy, or a parent whose own backup failed, leaves it as it was before
        ``begin_backup`` (the caller frees the host slots). Commit parents first.

        :class:`LockError` unless a backup begun on this very node is in flight: a second
        commit, a commit without a begin, or one naming a part split off the node.
        Runtime complexity: ``O(depth)``."""
        target = self._node(node)
        group = self._io_group(target, IO_WRITING, "commit_backup")
        top_parent = group[0].parent
        assert top_parent is not None
        success = bool(ok) and top_parent.backuped
        for member in group:
            if success:
                member.host_value = member.pending_host
                self._host_size += len(member.key)
                if self._changes is not None:
                    self._record(Change.BACKED_UP, member, -1, len(member.key))
            member.pending_host = None
            member.io_status = IO_IDLE
            member.io_ticket = 0
        target.io_owner = False
        self._lock(target, -1)
        return success

    def commit_backups(self, nodes: Iterable[int], ok: bool = True) -> list[bool]:
        """:meth:`commit_backup` of each of ``nodes`` in order (parents first), as one
        call: a scheduler step's batch of backups landed together. Returns each one's
        result; raises what the first failing commit raises, the ones before it done.
        Runtime complexity: ``O(sum of depths)``."""
        return [self.commit_backup(node, ok) for node in nodes]

    def _evicted_chain(self, target: _Node) -> tuple[list[_Node], _Node]:
        """The evicted chain that ends at ``target`` (bottom first; empty if ``target``
        is on the device) and the node above it: the deepest one on the device."""
        chain = []
        walk = target
        while walk.value is None:
            chain.append(walk)
            walk = walk.parent  # type: ignore[assignment]
        return chain, walk

    @staticmethod
    def _host_indices_of(chain: list[_Node]) -> IndexArray:
        """The host slots of an evicted ``chain`` (bottom first), parents first."""
        parts: list[IndexArray] = []
        for member in reversed(chain):
            assert member.host_value is not None  # evicted nodes are backed up
            parts.append(member.host_value)
        return np.concatenate(parts) if parts else _EMPTY.copy()

    def evicted_host_indices(self, node: int) -> IndexArray:
        """Host indices of the evicted chain that ends at ``node`` (parents first): what
        :meth:`begin_load_back` will make device-resident. ``O(depth + tokens)``."""
        chain, _ = self._evicted_chain(self._node(node))
        return self._host_indices_of(chain)

    def plan_load_back(self, node: int, min_tokens: int = 0, max_tokens: int | None = None) -> LoadBackPlan:
        """Decide, in one call, whether to load the evicted chain that ends at ``node``: it
        is loaded if it has ``n > 0`` tokens, ``n >= min_tokens`` and, unless
        ``max_tokens`` is ``None``, ``n <= max_tokens``. Returns a :class:`LoadBackPlan`:
        the device anchor above the chain, and the chain's host slots if it is loaded.

        A plan with slots is held until :meth:`begin_load_back` of ``node`` (whose lock
        it becomes) or :meth:`cancel_load_back`: a lock owned by the plan, on ``node``,
        keeps the anchor and its ancestors on the device and the chain on the host, so
        that the caller may evict to find the device slots. Like a transfer's lock,
        ``dec_lock_ref`` cannot release it. A plan without slots changes nothing.

        ``KeyError``/``TypeError`` for a bad handle, ``TypeError``/``OverflowError`` for
        a bound that is not an int64, :class:`LockError` if ``node`` holds a plan already.
        Runtime complexity: ``O(depth + tokens)``."""
        target = self._node(node)
        lo = as_int64(min_tokens, "min_tokens")
        hi = None if max_tokens is None else as_int64(max_tokens, "max_tokens")
        if target.handle in self._plans:
            raise LockError(
                f"plan_load_back: node {node} holds a load-back plan already "
                "(begin_load_back or cancel_load_back ends it)"
            )
        chain, anchor = self._evicted_chain(target)
        n = sum(len(m.key) for m in chain)
        if n == 0 or n < lo or (hi is not None and n > hi):
            return LoadBackPlan(anchor.handle, _EMPTY.copy())
        self._plans.add(target.handle)
        self._lock(target, 1)
        return LoadBackPlan(anchor.handle, self._host_indices_of(chain))

    def cancel_load_back(self, node: int) -> None:
        """Release the plan :meth:`plan_load_back` holds for ``node``, loading nothing (the
        device slots could not be had); :class:`LockError` if it holds none.
        Runtime complexity: ``O(depth)``."""
        target = self._node(node)
        if target.handle not in self._plans:
            raise LockError(f"cancel_load_back: node {node} holds no load-back plan")
        self._plans.remove(target.handle)
        self._lock(target, -1)

    def begin_load_back(self, node: int, device_indices: Any) -> int:
        """Give the evicted chain ending at ``node`` the device slots ``device_indices``
        (one per token of :meth:`evicted_host_indices`) and lock it while the host to
        device copy is in flight. Returns the number of tokens loaded. A plan that
        :meth:`plan_load_back` holds for ``node`` ends here: its lock becomes the copy's.

        ``ValueError`` if the node is not evicted (a root never is) or the length is not
        the chain's. Runtime complexity: ``O(depth + tokens)``."""
        target = self._node(node)
        devs = as_indices(device_indices, "device_indices")
        chain, _ = self._evicted_chain(target)
        total = sum(len(n.key) for n in chain)
        if not chain:
            raise ValueError(f"begin_load_back: node {node} is not evicted")
        if len(devs) != total:
            raise ValueError(f"begin_load_back: {len(devs)} device indices for {total} tokens")
        self._ticket += 1
        offset = 0
        for member in reversed(chain):
            member.value = devs[offset : offset + len(member.key)].copy()
            offset += len(member.key)
            member.io_status = IO_LOADING
            member.io_ticket = self._ticket
            self._size_delta(member, len(member.key))
            self._refresh(member)
            self._refresh(member.parent)  # type: ignore[arg-type]
            if self._changes is not None:
                self._record(Change.LOADED, member, -1, len(member.key))
        target.io_owner = True
        if target.handle in self._plans:
            self._plans.remove(target.handle)  # the plan's lock is the transfer's now
        else:
            self._lock(target, 1)
        return total

    def finish_load_back(self, node: int) -> None:
        """Mark the load started by :meth:`begin_load_back` on this very node as landed
        and unlock; :class:`LockError` otherwise (as :meth:`commit_backup`).
        Runtime complexity: ``O(depth)``."""
        target = self._node(node)
        for member in self._io_group(target, IO_LOADING, "finish_load_back"):
            member.io_status = IO_IDLE
            member.io_ticket = 0
        target.io_owner = False
        self._lock(target, -1)

    # ------------------------------------------------------------------ queries
    @property
    def root(self) -> int:
        return self._root.handle

    def namespace_root(self, extra_key: str | None) -> int:
        """Handle of the root of a namespace (created on first use)."""
        return self._namespace_root(extra_key).handle

    def root_seed(self, node: int) -> str | None:
        """The hex digest the hash chain under root ``node`` starts from (``None``:
        unseeded); ``ValueError`` for a node that is not a root. ``O(1)``."""
        n = self._node(node)
        if not n.is_root:
            raise ValueError(f"node {node} is not a root")
        return None if n.seed is None else n.seed.hex()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def host_size(self) -> int:
        """Tokens backed up on the host (tombstones and device nodes alike)."""
        return self._host_size

    def device_size(self) -> int:
        return self._evictable + self._protected

    def num_nodes(self) -> int:
        """Nodes in the tree, roots excluded."""
        return sum(1 for n in self._slots if n is not None and not n.is_root)

    def evictable_leaves(self) -> list[int]:
        """Device victim set, in eviction order."""
        return [self._slots[e[-1]].handle for e in self._dev_set]  # type: ignore[union-attr]

    def evictable_host_leaves(self) -> list[int]:
        """Host victim set, in eviction order."""
        return [self._slots[e[-1]].handle for e in self._host_set]  # type: ignore[union-attr]

    def is_alive(self, node: int) -> bool:
        try:
            self._node(node)
        except KeyError:
            return False
        return True

    def parent(self, node: int) -> int:
        """Parent handle, or -1 for a root. ``O(1)``."""
        p = self._node(node).parent
        return NO_NODE if p is None else p.handle

    def children(self, node: int) -> list[int]:
        """Child handles, oldest first: the order of SGLang's ``children`` dict (a new
        child goes last; the prefix made by a split takes the place of the node it was
        cut from). ``O(children)``."""
        return [c.handle for c in self._node(node).children.values()]

    def num_children(self, node: int) -> int:
        """Number of children. ``O(1)``."""
        return len(self._node(node).children)

    def key_len(self, node: int) -> int:
        """Tokens in a node's span. ``O(1)``."""
        return len(self._node(node).key)

    def path_extent(self, node: int) -> tuple[int, int]:
        """``(tokens, root)``: the tokens on the path from its root (the global root or a
        namespace's) down to the end of ``node``, and that root's handle; ``(0, node)``
        for a root. Runtime complexity: ``O(depth)`` nodes.

        >>> t = HiRadixTree(1)
        >>> a = t.insert([1, 2, 3], [0, 1, 2]).last_node
        >>> t.path_extent(t.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]).last_node) == (5, t.root)
        True
        """
        n = self._node(node)
        tokens = 0
        while not n.is_root:
            tokens += len(n.key)
            n = n.parent  # type: ignore[assignment]
        return tokens, n.handle

    def key(self, node: int) -> np.ndarray:
        """A copy of the node's token ids (int32; empty for a root). ``O(key_len)``."""
        return self._node(node).key.copy()

    # Typed state of one node, each O(1), for adapters that build lazy node views
    # (node_info builds a dict and is for debugging).
    def is_root(self, node: int) -> bool:
        """Whether the node is the root or a namespace root. ``O(1)``."""
        return self._node(node).is_root

    def is_evicted(self, node: int) -> bool:
        """Whether the node's device copy is gone (it lives on the host only). ``O(1)``."""
        return self._node(node).value is None

    def is_backed_up(self, node: int) -> bool:
        """Whether the node has a committed host copy; a root counts as backed up (the
        anchor of backup continuity). A backup in flight does not count. ``O(1)``."""
        return self._node(node).backuped

    def io_status(self, node: int) -> IOStatus:
        """The node's transfer state. ``O(1)``."""
        return IOStatus(self._node(node).io_status)

    def lock_ref(self, node: int) -> int:
        """Locks protecting the node: its own, its descendants' and a transfer's (a
        root always has 1). ``O(1)``."""
        return self._node(node).lock_ref

    def host_ref_counter(self, node: int) -> int:
        """Protections of the node's host copy (:meth:`inc_host_ref`). ``O(1)``."""
        return self._node(node).host_ref_counter

    def hit_count(self, node: int) -> int:
        """Non-chunked insert hits. ``O(1)``."""
        return self._node(node).hit_count

    def priority(self, node: int) -> int:
        """Highest priority of the inserts through the node. ``O(1)``."""
        return self._node(node).priority

    def last_access_time(self, node: int) -> float:
        """Clock at the last match/insert touching the node. ``O(1)``."""
        return self._node(node).last_access_time

    def creation_time(self, node: int) -> float:
        """Clock at the node's creation (a split keeps the original's). ``O(1)``."""
        return self._node(node).creation_time

    def value(self, node: int) -> IndexArray | None:
        v = self._node(node).value
        return None if v is None else v.copy()

    def host_value(self, node: int) -> IndexArray | None:
        n = self._node(node)
        return None if n.is_root or n.host_value is None else n.host_value.copy()

    def enable_hashing(self) -> None:
        """Turn page hashes on in a tree built without them (an L3 attached at runtime
        keys its pages by them): hash every page the tree holds, each node's chain
        continuing from its parent's. No-op when they are on. ``O(cached tokens)``."""
        if self.enable_hash:
            return
        roots = [self._root, *self._namespaces.values()]
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            node = stack.pop()
            parent = node.parent
            assert parent is not None and (parent.is_root or parent.hashes)
            prev = parent.seed if parent.is_root else parent.hashes[-1]  # type: ignore[index]
            node.hashes = _page_digests(node.key, self.page_size, prev)
            stack.extend(node.children.values())
        self.enable_hash = True

    def hash_value(self, node: int) -> list[str] | None:
        h = self._node(node).hashes
        return None if h is None else [d.hex() for d in h]

    def node_info(self, node: int) -> dict[str, Any]:
        """Every field of a node, for debugging and tests."""
        n = self._node(node)
        return {
            "handle": n.handle,
            "parent": -1 if n.parent is None else n.parent.handle,
            "key_len": len(n.key),
            "evicted": n.evicted,
            "backuped": n.backuped,
            "lock_ref": n.lock_ref,
            "own_lock_ref": n.own_locks,
            "host_ref_counter": n.host_ref_counter,
            "hit_count": n.hit_count,
            "priority": n.priority,
            "last_access_time": n.last_access_time,
            "creation_time": n.creation_time,
            "io_status": _IO_NAMES[n.io_status],
            "io_owner": n.io_owner,
            "load_back_planned": n.handle in self._plans,
            "num_children": len(n.children),
        }

    def debug_counters(self) -> dict[str, int]:
        live = sum(1 for n in self._slots if n is not None)
        return {"nodes_allocated": self.nodes_allocated, "nodes_freed": self.nodes_freed, "nodes_live": live}

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Verify every structural invariant against a full recount; raise
        ``AssertionError`` with a dump of the offending node on failure. ``O(n log n)``."""
        evictable = protected = host = 0
        dev_expected: set[tuple[Any, ...]] = set()
        host_expected: set[tuple[Any, ...]] = set()
        live = 0
        for node in self._slots:
            if node is None:
                continue
            live += 1

            def fail(msg: str, node: _Node = node) -> None:
                raise AssertionError(f"{msg}: {self.node_info(node.handle)}")

            for k, child in node.children.items():
                if child.parent is not node:
                    fail("child's parent link is wrong")
                if k != self._page_key(child.key, 0):
                    fail("child is filed under the wrong key")
            if node.is_root:
                if node.parent is not None or len(node.key) or node.lock_ref != 1:
                    fail("malformed root")
                continue
            parent = node.parent
            if parent is None or self._slots[parent.index] is not parent:
                raise AssertionError(f"dangling parent: {self.node_info(node.handle)}")
            if node not in parent.children.values():
                fail("node missing from its parent's children")
            n = len(node.key)
            if n == 0 or n % self.page_size:
                fail("key length is not a positive multiple of page_size")
            if node.lock_ref < 0 or node.host_ref_counter < 0:
                fail("negative reference count")
            if node.lock_ref > parent.lock_ref and not parent.is_root:
                fail("lock_ref exceeds its parent's")
            if node.value is not None and len(node.value) != n:
                fail("value length differs from key length")
            if node.host_value is not None and len(node.host_value) != n:
                fail("host_value length differs from key length")
            if node.value is None and node.host_value is None:
                fail("node is neither on the device nor backed up")
            if node.value is not None and parent.value is None:
                fail("device node under an evicted parent")
            if node.host_value is not None and not parent.backuped:
                fail("backup continuity broken: backed-up node under a parent that is not")
            if (node.io_status == IO_WRITING) != (node.pending_host is not None):
                fail("pending host indices disagree with io_status")
            if node.io_status != IO_IDLE and node.lock_ref == 0:
                fail("transfer in flight on an unlocked node")
            if node.io_owner and node.io_status == IO_IDLE:
                fail("transfer lock held without a transfer in flight")
            # A member of a transfer group that did not begin it is a prefix split off
            # the node that did, which is below it with the same ticket.
            if (
                node.io_status != IO_IDLE
                and not node.io_owner
                and not any(c.io_ticket == node.io_ticket for c in node.children.values())
            ):
                fail("transfer in flight without its owner below")
            # Every lock is owned by one node (a request's or a transfer's), so lock_ref
            # is exactly the locks owned here and below; a release of a lock not owned
            # would break this sum.
            planned = node.handle in self._plans
            owned = node.own_locks + node.io_owner + planned + sum(c.lock_ref for c in node.children.values())
            if node.own_locks < 0 or node.lock_ref != owned:
                fail(f"lock_ref differs from the locks owned at and below the node ({owned})")
            if self.enable_hash:
                if node.hashes is None or len(node.hashes) != n // self.page_size:
                    fail("not one hash per page")
                    continue
                prev = parent.seed if parent.is_root or parent.hashes is None else parent.hashes[-1]
                if _page_digests(node.key[: self.page_size], self.page_size, prev)[0] != node.hashes[0]:
                    fail("hash chain broken at the first page")
            if node.value is not None:
                if node.lock_ref:
                    protected += n
                else:
                    evictable += n
            if node.host_value is not None:
                host += n
            key = self.policy.sort_key(node)
            if self._is_device_leaf(node):
                dev_expected.add(key + (node.index,))
            if self._is_host_leaf(node):
                host_expected.add(key + (node.index,))
            if node.dkey is not None and node.dkey != key:
                fail("stale key in the device victim set")
            if node.hkey is not None and node.hkey != key:
                fail("stale key in the host victim set")
        if (evictable, protected, host) != (self._evictable, self._protected, self._host_size):
            raise AssertionError(
                f"size counters (evictable, protected, host) = "
                f"{(self._evictable, self._protected, self._host_size)}, recount {(evictable, protected, host)}"
            )
        if set(self._dev_set) != dev_expected:
            raise AssertionError(f"device victim set differs from recount: {set(self._dev_set) ^ dev_expected}")
        if set(self._host_set) != host_expected:
            raise AssertionError(f"host victim set differs from recount: {set(self._host_set) ^ host_expected}")
        if live != self.nodes_allocated - self.nodes_freed:
            raise AssertionError(f"{live} live nodes, but {self.nodes_allocated} allocated - {self.nodes_freed} freed")
        for h in self._plans:
            if not self.is_alive(h):
                raise AssertionError(f"load-back plan held for node {h}, which is not alive")
