"""Consistent-hash ring that places directory entries on nodes.

Every node owns ``vnodes`` points on a 64-bit circle; a key belongs to the first point at or
after its own hash (wrapping at the top), and its replica owners are the next *distinct* nodes
met walking clockwise from there. Writers and readers build the same ring from the same
membership list, so they agree on a key's owners without asking anyone.

Hashes are the first 8 bytes (big-endian) of the key's SHA-256, the same digest slot headers
carry (:mod:`hiradix.peer.keyhash`), never Python's ``hash()``, which is salted per process:
two processes (or two runs) must place every key identically. :meth:`HashRing.owners_many`
hashes a whole batch in one compiled call and places it with one :func:`numpy.searchsorted`.

With ``N`` nodes and ``V`` virtual nodes each, adding a node moves about ``1 / (N + 1)`` of
the keys' primary owners, all of them to the new node, and removing one moves only the keys
it owned; :func:`moved_keys` lists which keys' owner sets change.

>>> ring = HashRing(["a", "b", "c"])
>>> ring.owners("some-key", 2) == HashRing(["c", "b", "a"]).owners("some-key", 2)
True
>>> len(set(ring.owners("some-key", 5)))
3
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hiradix.peer.keyhash import hash64, hash64_many

__all__ = ["DEFAULT_VNODES", "HashRing", "Move", "hash64", "moved_keys", "owner_counts"]

DEFAULT_VNODES = 160  # virtual nodes per node (the seed's default)

Key = str | bytes


@dataclass(frozen=True)
class Move:
    """How one key's owner list changes between two rings.

    ``old`` and ``new`` are the owner tuples (primary first). ``gained`` are owners in ``new``
    but not in ``old`` (they must receive the entry); ``lost`` are owners in ``old`` but not
    in ``new`` (they may drop it).
    """

    old: tuple[str, ...]
    new: tuple[str, ...]

    @property
    def gained(self) -> tuple[str, ...]:
        return tuple(n for n in self.new if n not in self.old)

    @property
    def lost(self) -> tuple[str, ...]:
        return tuple(n for n in self.old if n not in self.new)


class HashRing:
    """A consistent-hash ring over node ids.

    Parameters
    ----------
    nodes:
        Initial node ids (strings; order does not matter).
    vnodes:
        Points per node on the circle (``>= 1``, default 160). More points give better
        balance and cost ``O(N * V)`` memory.

    The ring is not thread-safe for mutation; callers that change membership while other
    threads read should build a new ring (:meth:`copy` then :meth:`add_node`) and swap the
    reference, which is atomic in Python.
    """

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be an int >= 1, got {vnodes!r}")
        self.vnodes = vnodes
        self._nodes: set[str] = set()
        self._points: list[int] = []  # sorted vnode hashes
        self._owners: list[str] = []  # node of each point, parallel to _points
        self._succ: dict[int, list[tuple[str, ...]]] = {}  # n -> owners(point i, n), built lazily
        self._array: np.ndarray | None = None  # _points as uint64, built lazily for owners_many
        # n -> (node names, owners of point i as indices into them: int32 (points, n')),
        # built lazily for owner_table
        self._table: dict[int, tuple[tuple[str, ...], np.ndarray]] = {}
        for node in nodes:
            self.add_node(node)

    # ------------------------------------------------------------------ membership
    @property
    def nodes(self) -> frozenset[str]:
        """The member node ids."""
        return frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __repr__(self) -> str:
        return f"HashRing(nodes={sorted(self._nodes)!r}, vnodes={self.vnodes})"

    def _vnode_points(self, node: str) -> list[int]:
        return [int(h) for h in hash64_many([f"{node}#{i}" for i in range(self.vnodes)])]

    def add_node(self, node: str) -> None:
        """Add ``node`` (``ValueError`` if already a member).

        Runtime complexity: ``O(N * V)`` (the parallel arrays are rebuilt by merge).
        """
        if not isinstance(node, str) or not node:
            raise ValueError(f"node id must be a non-empty str, got {node!r}")
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        self._nodes.add(node)
        merged = sorted([*zip(self._points, self._owners, strict=True), *((p, node) for p in self._vnode_points(node))])
        # Ties between two nodes' points (a 2^-64 event) are broken by node id, so the
        # result does not depend on insertion order.
        self._points = [p for p, _ in merged]
        self._owners = [n for _, n in merged]
        self._succ = {}
        self._table = {}
        self._array = None

    def remove_node(self, node: str) -> None:
        """Remove ``node`` (``KeyError`` if not a member).

        Runtime complexity: ``O(N * V)``.
        """
        if node not in self._nodes:
            raise KeyError(f"node {node!r} is not on the ring")
        self._nodes.remove(node)
        kept = [(p, n) for p, n in zip(self._points, self._owners, strict=True) if n != node]
        self._points = [p for p, _ in kept]
        self._owners = [n for _, n in kept]
        self._succ = {}
        self._table = {}
        self._array = None

    def copy(self) -> HashRing:
        """An independent ring with the same members.

        Runtime complexity: ``O(N * V)``.
        """
        other = HashRing(vnodes=self.vnodes)
        other._nodes = set(self._nodes)
        other._points = list(self._points)
        other._owners = list(self._owners)
        return other

    # ------------------------------------------------------------------ lookup
    def owners(self, key: Key, n: int = 1) -> tuple[str, ...]:
        """The primary owner of ``key`` followed by the next distinct owners, ``n`` at most.

        Returns fewer than ``n`` when the ring has fewer nodes, and ``()`` when it is empty.

        Runtime complexity: ``O(log(N * V))`` to find the primary, plus the clockwise walk,
        ``O(n)`` expected and ``O(N * V)`` at worst.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not self._points:
            return ()
        i = bisect.bisect_left(self._points, hash64(key))
        return self._walk(i % len(self._points), min(n, len(self._nodes)))

    def owners_many(self, keys: Sequence[Key], n: int = 1) -> list[tuple[str, ...]]:
        """:meth:`owners` of each key. The owner tuple of every ring point is computed once
        per ring and ``n`` (``O(N * V)``); the keys are hashed in one batch
        (:func:`~hiradix.peer.keyhash.hash64_many`) and placed by one
        :func:`numpy.searchsorted` over the points, so no per-key Python call remains.

        Runtime complexity: ``O(K * log(N * V))``.

        >>> ring = HashRing(["a", "b", "c"])
        >>> ring.owners_many(["x", "y"], 2) == [ring.owners("x", 2), ring.owners("y", 2)]
        True
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        points = self._points
        if not points:
            return [()] * len(keys)
        succ = self._succ.get(n)
        if succ is None:
            succ = [self._walk(i, min(n, len(self._nodes))) for i in range(len(points))]
            self._succ[n] = succ
        return [succ[i] for i in self._slots(keys).tolist()]

    def _slots(self, keys: Sequence[Key]) -> np.ndarray:
        """The index of each key's point: one batch hash, one searchsorted."""
        array = self._array
        if array is None:
            array = self._array = np.array(self._points, dtype=np.uint64)
        # Both operands uint64: mixing in an int64 array would compare as float64.
        idx = np.searchsorted(array, hash64_many(keys), side="left")
        idx[idx == len(array)] = 0  # past the last point: wrap to the first
        return idx

    def owner_table(self, keys: Sequence[Key], n: int = 1) -> tuple[tuple[str, ...], np.ndarray]:
        """:meth:`owners_many` as arrays: ``(names, table)`` where ``table[i, r]`` indexes
        ``names`` with the ``r``-th owner of ``keys[i]``. ``table`` is ``int32`` of shape
        ``(len(keys), min(n, len(self)))``: every key has that many owners. The batch read
        path groups keys by owner on it without a Python loop per key.

        Runtime complexity: ``O(K * log(N * V))`` (``O(N * V)`` once per ring and ``n``).

        >>> ring = HashRing(["a", "b", "c"])
        >>> names, table = ring.owner_table(["x", "y"], 2)
        >>> [tuple(names[j] for j in row) for row in table] == ring.owners_many(["x", "y"], 2)
        True
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        found = self._table.get(n)
        if found is None:
            names = tuple(sorted(self._nodes))
            pos = {name: j for j, name in enumerate(names)}
            want = min(n, len(names))
            rows = [[pos[o] for o in self._walk(i, want)] for i in range(len(self._points))]
            found = self._table[n] = (names, np.array(rows, dtype=np.int32).reshape(len(rows), want))
        names, succ = found
        if not self._points:
            return names, np.empty((len(keys), 0), dtype=np.int32)
        return names, succ[self._slots(keys)]

    def _walk(self, i: int, want: int) -> tuple[str, ...]:
        """The first ``want`` distinct owners clockwise from point ``i``."""
        out: list[str] = []
        total = len(self._points)
        for step in range(total):
            node = self._owners[(i + step) % total]
            if node not in out:
                out.append(node)
                if len(out) == want:
                    break
        return tuple(out)

    def owner(self, key: Key) -> str:
        """The primary owner of ``key`` (``LookupError`` on an empty ring).

        Runtime complexity: ``O(log(N * V))``.
        """
        if not self._points:
            raise LookupError("the ring has no nodes")
        i = bisect.bisect_left(self._points, hash64(key))
        return self._owners[i % len(self._points)]


def moved_keys(keys: Iterable[Key], old: HashRing, new: HashRing, n: int = 1) -> dict[Key, Move]:
    """Keys whose ``n``-owner list differs between ``old`` and ``new``, with the change.

    Use ``n = directory_replicas``. A key whose owner *set* is unchanged but reordered (e.g. a
    replica became primary) is reported too, since its ``gained``/``lost`` are empty the
    caller can skip it cheaply.

    Runtime complexity: ``O(K * log(N * V))`` for ``K`` keys.

    >>> old = HashRing(["a", "b"]); new = old.copy(); new.add_node("c")
    >>> all(m.new[0] == "c" for m in moved_keys([str(i) for i in range(100)], old, new).values())
    True
    """
    out: dict[Key, Move] = {}
    for key in keys:
        before = old.owners(key, n) if len(old) else ()
        after = new.owners(key, n) if len(new) else ()
        if before != after:
            out[key] = Move(before, after)
    return out


def owner_counts(keys: Iterable[Key], ring: HashRing) -> Mapping[str, int]:
    """How many of ``keys`` each node owns as primary (every member appears, maybe with 0).

    Runtime complexity: ``O(K * log(N * V))``.
    """
    counts = dict.fromkeys(ring.nodes, 0)
    for key in keys:
        counts[ring.owner(key)] += 1
    return counts
