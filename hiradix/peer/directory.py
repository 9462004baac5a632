"""The location directory: one shard per node, and the client view that spans them.

A producer publishes where a page lives (:class:`DirEntry`: node, address, rkey, length,
generation, resident) to the ``directory_replicas`` owners the ring picks for the key; a
reader asks those owners in ring order and falls through to the next replica when one fails.
Only these small records move; the page bytes stay in the producer's published pool.

The shard (:class:`DirectoryShard`) is a locked dictionary with batch operations and a
:meth:`~DirectoryShard.dispatch` entry point that an RPC server routes the ``dir_*`` methods
to. The client (:class:`DirectoryView`) takes the transport as an injected ``call(owner,
method, args)`` function, so it is tested without sockets; calls to the local node skip the
RPC and go straight to the local shard.

Conditional updates. Deletes and residency changes carry the ``(node, generation)`` of the
copy they are about, so a late eviction callback for an old copy never removes the entry of a
newer one, and a stale re-publish from the same node never replaces a newer entry.

Incarnations. Every entry also carries its producer's *incarnation* (the producer process's
start time in microseconds, :func:`new_incarnation`). Generations restart with every process,
so they only order the entries of one incarnation: a shard that sees a node's newer
incarnation drops everything the earlier one published and takes the new entries whatever
their generations; entries of an earlier incarnation than the newest seen are refused.

Wire format. An entry travels as the list ``[node, addr, rkey, length, generation,
resident, incarnation]`` (msgpack-friendly: no pickled objects). An existence query (``dir_exists``)
answers one byte per key instead (:data:`MISS`, :data:`RESIDENT`, :data:`ON_DISK`), so the
hot ``batch_exists`` path moves and checks no full entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from hiradix.peer.ring import HashRing, moved_keys

__all__ = [
    "DIR_METHODS",
    "MISS",
    "NO_PRODUCER",
    "ON_DISK",
    "PACKED_ENTRY",
    "RESIDENT",
    "BeginFn",
    "CallFn",
    "DirColumns",
    "DirEntry",
    "DirectoryShard",
    "DirectoryView",
    "Republished",
    "new_incarnation",
    "pack_entries",
    "put_items_from_wire",
    "republish_plan",
]

log = logging.getLogger(__name__)

DIR_METHODS = ("dir_put", "dir_get", "dir_exists", "dir_delete", "dir_set_resident")

# One byte per key in a ``dir_exists`` answer.
MISS = 0  # no entry
RESIDENT = 1  # the page is in its producer's published pool
ON_DISK = 2  # the page left the pool for its producer's disk tier (a read must promote it)
_EXISTS_CODES = bytes(range(ON_DISK + 1))


def new_incarnation() -> int:
    """A fresh incarnation id: the wall clock in microseconds (a 64-bit integer).

    Incarnations are only ever compared between runs of the same node id, i.e. of a process
    restarted on the same host and ports, so one host's clock orders them; a restart takes
    far longer than a microsecond.
    """
    return time.time_ns() // 1000


# Exclusive upper bounds of addr, rkey, length, generation and incarnation: the widths of
# their PACKED_ENTRY columns (incarnations travel beside the records, as msgpack uint64).
_FIELD_BOUNDS = (1 << 64, 1 << 32, 1 << 64, 1 << 64, 1 << 64)


@dataclass(frozen=True)
class DirEntry:
    """Where one page lives.

    Attributes
    ----------
    node:
        Node id of the producer holding the page.
    addr, rkey:
        Remote address of the page's slot (header first) in the producer's published pool,
        and the key that lets a peer READ it.
    length:
        Payload bytes (the READ covers the slot header plus ``length``).
    generation:
        The slot generation written with the page; a reader rejects any fetched slot whose
        header carries another generation.
    resident:
        ``False`` when the page left the pool but is on the producer's disk tier, so a reader
        must ask the producer to promote it first.
    incarnation:
        The producer process that wrote it (:func:`new_incarnation`): entries of a newer
        incarnation of ``node`` replace those of an earlier one, whatever their generations.
    """

    node: str
    addr: int
    rkey: int
    length: int
    generation: int
    resident: bool = True
    incarnation: int = 0

    def to_wire(self) -> list[Any]:
        """Entry as a plain list for msgpack. Runtime complexity: ``O(1)``."""
        return [self.node, self.addr, self.rkey, self.length, self.generation, self.resident, self.incarnation]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> DirEntry:
        """Inverse of :meth:`to_wire`; ``ValueError`` on a malformed record.

        Runtime complexity: ``O(1)``.

        >>> e = DirEntry("n1", 4096, 7, 100, 3)
        >>> DirEntry.from_wire(e.to_wire()) == e
        True
        """
        if not isinstance(wire, (list, tuple)) or len(wire) != 7:
            raise ValueError(f"malformed directory entry {wire!r}")
        node, addr, rkey, length, generation, resident, incarnation = wire
        # Every field must fit its column of PACKED_ENTRY (and msgpack's uint64): a shard
        # that stored an oversized value would fail pack_entries for every key of the
        # dir_get batch holding it, not just this one.
        if not isinstance(node, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound
            for v, bound in zip((addr, rkey, length, generation, incarnation), _FIELD_BOUNDS, strict=True)
        ):
            raise ValueError(f"malformed directory entry {wire!r}")
        return cls(node, addr, rkey, length, generation, bool(resident), incarnation)


def _matches(entry: DirEntry, node: str | None, generation: int | None) -> bool:
    return (node is None or entry.node == node) and (generation is None or entry.generation == generation)


#: One entry of a ``dir_get`` answer: fixed-width little-endian columns (32 bytes).
#: ``node`` indexes the answer's node-name list; :data:`NO_PRODUCER` marks a miss.
PACKED_ENTRY = np.dtype(
    [
        ("node", "<u2"),
        ("resident", "u1"),
        ("reserved", "u1"),
        ("rkey", "<u4"),
        ("addr", "<u8"),
        ("length", "<u8"),
        ("generation", "<u8"),
    ]
)
NO_PRODUCER = 0xFFFF


def pack_entries(entries: Sequence[DirEntry | None]) -> list[Any]:
    """The ``dir_get`` answer for ``entries``: ``[node_names, records, incarnations]``
    where ``records`` is ``bytes`` of one :data:`PACKED_ENTRY` per entry (misses are
    :data:`NO_PRODUCER`) and ``incarnations[j]`` is the incarnation of ``node_names[j]`` (a
    shard holds one incarnation per node). A reader decodes a whole batch with one
    ``np.frombuffer``.

    Runtime complexity: ``O(k)``.

    >>> names, body, incs = pack_entries([DirEntry("n1", 64, 7, 100, 3, incarnation=9), None])
    >>> names, incs, len(body), int(np.frombuffer(body, PACKED_ENTRY)["node"][1]) == NO_PRODUCER
    (['n1'], [9], 64, True)
    """
    names: dict[str, int] = {}
    incs: list[int] = []
    miss = (NO_PRODUCER, 0, 0, 0, 0, 0, 0)
    rows = []
    for e in entries:
        if e is None:
            rows.append(miss)
            continue
        j = names.setdefault(e.node, len(names))
        if j == len(incs):
            incs.append(e.incarnation)
        rows.append((j, e.resident, 0, e.rkey, e.addr, e.length, e.generation))
    return [list(names), np.array(rows, dtype=PACKED_ENTRY).tobytes(), incs]


@dataclass(frozen=True)
class DirColumns:
    """Directory entries of a batch as columns (what :meth:`DirectoryView.batch_get_columns`
    returns). ``records`` holds one :data:`PACKED_ENTRY` per key, in order, its ``node``
    field an index into ``nodes`` or :data:`NO_PRODUCER` for a miss; ``incarnations[j]`` is the
    incarnation of ``nodes[j]``."""

    nodes: list[str]
    records: np.ndarray
    incarnations: list[int]

    def node_index(self, node: str) -> int:
        """The index of ``node`` in :attr:`nodes`, or -1. Runtime complexity: ``O(nodes)``."""
        return self.nodes.index(node) if node in self.nodes else -1

    def entry(self, i: int) -> DirEntry | None:
        """Key ``i``'s entry as a :class:`DirEntry`. Runtime complexity: ``O(1)``."""
        r = self.records[i]
        if int(r["node"]) == NO_PRODUCER:
            return None
        return DirEntry(
            self.nodes[int(r["node"])],
            int(r["addr"]),
            int(r["rkey"]),
            int(r["length"]),
            int(r["generation"]),
            bool(r["resident"]),
            self.incarnations[int(r["node"])],
        )

    def entries(self) -> list[DirEntry | None]:
        """Every key's entry. Runtime complexity: ``O(k)``."""
        return [self.entry(i) for i in range(len(self.records))]


class DirectoryShard:
    """This node's share of the directory: ``key -> DirEntry``, thread-safe.

    >>> s = DirectoryShard()
    >>> s.put("k", DirEntry("n1", 0, 1, 10, 5))
    True
    >>> s.delete("k", node="n1", generation=4)   # an older copy: no-op
    False
    >>> s.get("k").generation
    5
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, DirEntry] = {}
        # key -> RESIDENT / ON_DISK, kept with _entries under the lock: batch_exists maps
        # keys to bytes with one C-level dict lookup each, no Python code per key.
        self._codes: dict[str, int] = {}
        # node -> the newest incarnation seen; every entry of that node here is of it.
        self._incarnations: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # ------------------------------------------------------------------ single ops
    def put(self, key: str, entry: DirEntry) -> bool:
        """Store ``entry`` unless the current entry is a newer copy from the same node, or
        ``entry`` comes from an earlier incarnation of its node than one already seen. The
        first entry of a newer incarnation drops every entry of the earlier one.

        Returns whether the entry was stored. Runtime complexity: ``O(1)``; ``O(len(shard))``
        the first time a node's new incarnation is seen.
        """
        with self._lock:
            return self._put_locked(key, entry)

    def _put_locked(self, key: str, entry: DirEntry) -> bool:
        known = self._incarnations.get(entry.node)
        if known != entry.incarnation:
            if known is not None and entry.incarnation < known:
                return False  # a late write of a process that has been replaced
            self._retire_locked(entry.node, entry.incarnation)
        cur = self._entries.get(key)
        if cur is not None and cur.node == entry.node and cur.generation > entry.generation:
            return False
        self._entries[key] = entry
        self._codes[key] = RESIDENT if entry.resident else ON_DISK
        return True

    def get(self, key: str) -> DirEntry | None:
        """The entry for ``key`` or ``None``. Runtime complexity: ``O(1)``."""
        return self._entries.get(key)  # a single dict read is atomic under the GIL

    def delete(self, key: str, node: str | None = None, generation: int | None = None) -> bool:
        """Delete ``key`` if its entry matches ``node``/``generation`` (``None`` matches any).

        Runtime complexity: ``O(1)``.
        """
        with self._lock:
            return self._delete_locked(key, node, generation)

    def _delete_locked(self, key: str, node: str | None, generation: int | None) -> bool:
        cur = self._entries.get(key)
        if cur is None or not _matches(cur, node, generation):
            return False
        del self._entries[key]
        del self._codes[key]
        return True

    def set_resident(self, key: str, resident: bool, node: str | None = None, generation: int | None = None) -> bool:
        """Flip the ``resident`` flag of a matching entry. Runtime complexity: ``O(1)``."""
        with self._lock:
            return self._set_resident_locked(key, resident, node, generation)

    def _set_resident_locked(self, key: str, resident: bool, node: str | None, generation: int | None) -> bool:
        cur = self._entries.get(key)
        if cur is None or not _matches(cur, node, generation):
            return False
        if cur.resident != resident:
            self._entries[key] = replace(cur, resident=resident)
            self._codes[key] = RESIDENT if resident else ON_DISK
        return True

    # ------------------------------------------------------------------ batch ops
    def batch_put(self, items: Iterable[tuple[str, DirEntry]]) -> int:
        """:meth:`put` each item under one lock; returns how many were stored.

        Runtime complexity: ``O(k)``.
        """
        with self._lock:
            return sum(self._put_locked(k, e) for k, e in items)

    def batch_get(self, keys: Iterable[str]) -> list[DirEntry | None]:
        """:meth:`get` for each key, in order. Runtime complexity: ``O(k)``."""
        with self._lock:
            return [self._entries.get(k) for k in keys]

    def batch_exists(self, keys: Iterable[str]) -> bytes:
        """One byte per key, in order: :data:`MISS`, :data:`RESIDENT` or :data:`ON_DISK`.

        Runtime complexity: ``O(k)``.

        >>> s = DirectoryShard()
        >>> _ = s.put("a", DirEntry("n1", 0, 1, 10, 5)); _ = s.put("b", DirEntry("n1", 0, 1, 10, 6, False))
        >>> list(s.batch_exists(["a", "b", "c"]))
        [1, 2, 0]
        """
        with self._lock:
            return bytes(map(self._codes.get, keys, repeat(MISS)))

    def batch_delete(self, items: Iterable[tuple[str, str | None, int | None]]) -> int:
        """Conditional deletes of ``(key, node, generation)``; returns how many happened.

        Runtime complexity: ``O(k)``.
        """
        with self._lock:
            return sum(self._delete_locked(k, n, g) for k, n, g in items)

    def batch_set_resident(self, items: Iterable[tuple[str, str | None, int | None, bool]]) -> int:
        """Conditional residency updates of ``(key, node, generation, resident)``.

        Runtime complexity: ``O(k)``.
        """
        with self._lock:
            return sum(self._set_resident_locked(k, r, n, g) for k, n, g, r in items)

    # ------------------------------------------------------------------ maintenance
    def drop_node(self, node: str) -> int:
        """Delete every entry published by ``node`` (it left the cluster) and forget its
        incarnation. Returns how many were deleted.

        Runtime complexity: ``O(len(shard))``.
        """
        with self._lock:
            self._incarnations.pop(node, None)
            return self._drop_locked(node)

    def retire(self, node: str, incarnation: int) -> int:
        """``node`` runs as ``incarnation`` now (membership saw it restart): unless an even
        newer one was seen, delete the entries of its earlier incarnations and refuse them
        from now on. Returns how many were deleted.

        Runtime complexity: ``O(len(shard))``.

        >>> s = DirectoryShard()
        >>> _ = s.put("k", DirEntry("n1", 0, 1, 10, 5, incarnation=1))
        >>> s.retire("n1", 2), s.put("k", DirEntry("n1", 0, 1, 10, 9, incarnation=1)), len(s)
        (1, False, 0)
        """
        with self._lock:
            known = self._incarnations.get(node)
            if known is not None and incarnation <= known:
                return 0
            return self._retire_locked(node, incarnation)

    def _retire_locked(self, node: str, incarnation: int) -> int:
        had = node in self._incarnations
        self._incarnations[node] = incarnation
        return self._drop_locked(node) if had else 0

    def _drop_locked(self, node: str) -> int:
        gone = [k for k, e in self._entries.items() if e.node == node]
        for k in gone:
            del self._entries[k]
            del self._codes[k]
        return len(gone)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the shard is consistent: the existence codes
        cover exactly the entries, each code says what its entry says (resident or on
        disk), and every entry is of its node's newest incarnation seen (an earlier
        incarnation's entries were dropped when the newer one appeared).
        ``O(len(shard))``: for tests and debugging."""
        with self._lock:
            entries, codes, incarnations = dict(self._entries), dict(self._codes), dict(self._incarnations)
        assert codes.keys() == entries.keys(), (
            f"existence codes for {len(codes)} keys, entries for {len(entries)}: "
            f"{sorted(codes.keys() ^ entries.keys())[:5]}"
        )
        for key, e in entries.items():
            assert codes[key] == (RESIDENT if e.resident else ON_DISK), f"{key!r}: code {codes[key]} but {e}"
            assert incarnations.get(e.node) == e.incarnation, (
                f"{key!r}: entry of {e.node} incarnation {e.incarnation}, newest seen {incarnations.get(e.node)}"
            )

    def snapshot(self) -> dict[str, DirEntry]:
        """A copy of all entries. Runtime complexity: ``O(len(shard))``."""
        with self._lock:
            return dict(self._entries)

    # ------------------------------------------------------------------ RPC entry point
    def dispatch(self, method: str, args: Sequence[Any]) -> Any:
        """Run one of :data:`DIR_METHODS` on wire-format ``args``; the RPC server's hook.

        ``dir_put``: ``[[key, entry_wire], ...]`` -> stored count (a malformed entry is
        refused for its key alone, see :func:`put_items_from_wire`).
        ``dir_get``: ``[key, ...]`` -> ``[nodes, records]`` (:func:`pack_entries`).
        ``dir_exists``: ``[key, ...]`` -> ``bytes``, one :data:`MISS` / :data:`RESIDENT` /
        :data:`ON_DISK` byte per key.
        ``dir_delete``: ``[[key, node|None, generation|None], ...]`` -> deleted count.
        ``dir_set_resident``: ``[[key, node|None, generation|None, resident], ...]`` -> count.

        Raises ``ValueError`` for an unknown method or malformed arguments.
        Runtime complexity: ``O(k)`` for ``k`` items.
        """
        try:
            if method == "dir_put":
                return self.batch_put(put_items_from_wire(args))
            if method == "dir_get":
                return pack_entries(self.batch_get(_keys(args)))
            if method == "dir_exists":
                return self.batch_exists(_keys(args))
            if method == "dir_delete":
                return self.batch_delete([(_key(k), n, g) for k, n, g in args])
            if method == "dir_set_resident":
                return self.batch_set_resident([(_key(k), n, g, bool(r)) for k, n, g, r in args])
        except (TypeError, ValueError) as exc:  # unpacking a malformed item
            raise ValueError(f"malformed arguments for {method}: {exc}") from exc
        raise ValueError(f"unknown directory method {method!r}; expected one of {DIR_METHODS}")


def put_items_from_wire(items: Iterable[Any]) -> list[tuple[str, DirEntry]]:
    """The ``(key, entry)`` pairs of ``dir_put`` or ``dir_handoff`` items ``[[key,
    entry_wire], ...]``, without those whose entry is malformed (:meth:`DirEntry.from_wire`):
    one bad entry is refused for its own key, the batch's other keys are stored. An item
    that is not a ``[str, ...]`` pair raises ``ValueError`` (the batch itself is malformed).

    Runtime complexity: ``O(k)``.

    >>> good = DirEntry("n1", 64, 7, 100, 3).to_wire()
    >>> [k for k, _ in put_items_from_wire([["a", good], ["b", ["n1", 64, 1 << 32, 100, 3, True, 0]]])]
    ['a']
    """
    out: list[tuple[str, DirEntry]] = []
    refused: list[str] = []
    for k, w in items:
        key = _key(k)
        try:
            out.append((key, DirEntry.from_wire(w)))
        except ValueError:
            refused.append(key)
    if refused:
        log.warning("directory: refused %d malformed entries (first: key %r)", len(refused), refused[0])
    return out


def _packed_of(n: int) -> Callable[[Any], bool]:
    """The shape check of a ``dir_get`` answer for ``n`` keys."""

    def check(answer: Any) -> bool:
        if not isinstance(answer, list) or len(answer) != 3:
            return False
        names, body, incs = answer
        return (
            isinstance(names, list)
            and all(type(nm) is str for nm in names)
            and len(names) < NO_PRODUCER
            and isinstance(body, bytes)
            and len(body) == n * PACKED_ENTRY.itemsize
            and isinstance(incs, list)
            and len(incs) == len(names)
            and all(type(i) is int and i >= 0 for i in incs)
        )

    return check


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise ValueError(f"directory keys are str, got {type(k).__name__}")
    return k


def _keys(args: Any) -> list[str]:
    """``args`` checked to be a list of ``str``: ``str.join`` accepts exactly those, in C
    (about 10 ns per key against 40 for a Python-level type test)."""
    if type(args) is not list:
        args = list(args)
    try:
        "".join(args)
    except TypeError:
        for k in args:
            _key(k)  # raises on the first that is not
        raise
    return cast(list[str], args)


def _group(col: np.ndarray, pending: np.ndarray | None) -> list[tuple[int, np.ndarray]]:
    """Split the keys of one round by owner: ``col[p]`` is the owner (an index) of the
    ``p``-th pending key, ``pending[p]`` its index in the batch (``p`` itself when
    ``pending`` is ``None``). Returns ``(owner, batch indices)`` pairs, owners in the order
    their first key appears and each owner's indices in pending order (a stable sort).

    Runtime complexity: ``O(k log k)`` in numpy.

    >>> [(j, idx.tolist()) for j, idx in _group(np.array([1, 0, 1, 2]), None)]
    [(1, [0, 2]), (0, [1]), (2, [3])]
    """
    order = np.argsort(col, kind="stable")
    owners = col[order]
    cuts = np.flatnonzero(owners[1:] != owners[:-1]) + 1
    starts = [0, *cuts.tolist()]
    ends = [*starts[1:], len(order)]
    rows = order if pending is None else pending[order]
    groups = [(int(owners[a]), rows[a:b], int(order[a])) for a, b in zip(starts, ends, strict=True)]
    groups.sort(key=lambda g: g[2])  # owners by first appearance, as a dict would list them
    return [(j, idx) for j, idx, _ in groups]


def _bytes_of(n: int) -> Callable[[Any], bool]:
    def check(result: Any) -> bool:
        return type(result) is bytes and len(result) == n

    return check


class CallFn(Protocol):
    """``call(owner, method, args) -> result``: one RPC to ``owner``; raises on failure."""

    def __call__(self, owner: str, method: str, args: list[Any]) -> Any: ...


class Pending(Protocol):
    """A call in flight: ``result()`` waits for and returns its answer (raises on failure);
    ``cancel()`` abandons it. Exactly one of the two is called."""

    def result(self) -> Any: ...

    def cancel(self) -> None: ...


class BeginFn(Protocol):
    """``begin(owner, method, args) -> Pending``: send one RPC to ``owner`` and return at
    once (raises when it cannot be sent)."""

    def __call__(self, owner: str, method: str, args: list[Any]) -> Pending: ...


class _Answered:
    """A :class:`Pending` whose answer is already here (calls made without ``begin``)."""

    __slots__ = ("_answer",)

    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def result(self) -> Any:
        return self._answer

    def cancel(self) -> None:
        pass


def republish_plan(keys: Iterable[str], old: HashRing | None, new: HashRing, replicas: int) -> dict[str, list[str]]:
    """Which of a producer's ``keys`` it must re-PUT to which owners after a membership change.

    A key goes to every owner it *gained* between ``old`` and ``new`` (all of its owners when
    ``old`` is ``None``, i.e. a fresh start); owners that already held it are skipped.

    Runtime complexity: ``O(K * log(N * V))``.

    >>> old = HashRing(["a", "b"]); new = old.copy(); new.add_node("c")
    >>> plan = republish_plan([str(i) for i in range(50)], old, new, 2)
    >>> sorted(plan)
    ['c']
    """
    plan: dict[str, list[str]] = defaultdict(list)
    if old is None or len(old) == 0:
        for k in keys:
            for owner in new.owners(k, replicas) if len(new) else ():
                plan[owner].append(k)
        return dict(plan)
    for moved, move in moved_keys(keys, old, new, replicas).items():
        for owner in move.gained:
            plan[owner].append(cast(str, moved))
    return dict(plan)


class Republished(NamedTuple):
    """What :meth:`DirectoryView.republish` did: ``puts`` (key, owner) puts answered, and
    the owners that ``failed`` (none answered, or answered malformed data)."""

    puts: int
    failed: tuple[str, ...]


class DirectoryView:
    """Client side of the directory: writes to all replica owners, reads with fallback.

    Parameters
    ----------
    ring:
        The current ring. Replace :attr:`ring` (a plain attribute) on a membership change.
    call:
        ``call(owner, method, args)``, the injected RPC. Any exception in ``call_errors``
        counts as that owner failing.
    replicas:
        Owners per key (``directory_replicas``, default 2).
    local_node, local_shard:
        When the owner is ``local_node``, ``local_shard.dispatch`` is used directly.
    fallback_on_miss:
        Also try the next replica when an owner answers "no entry" (helps right after a
        membership change, before re-publishing finishes; costs ``replicas`` round trips on
        a true miss). Default ``False``: only failures fall through.
    call_errors:
        Exception types that mean "owner failed". The default is ``(Exception,)`` on purpose:
        the directory is advisory and every failure must become a miss (recompute), never a
        crash in serving. Failures are counted in :attr:`failures` and logged at debug level.
    begin:
        Optional split form of ``call`` (:class:`BeginFn`). Batch reads then send every
        remote owner its request first and query the local shard while those are in
        flight; without it they call the remote owners one after another.
    """

    def __init__(
        self,
        ring: HashRing,
        call: CallFn,
        *,
        replicas: int = 2,
        local_node: str | None = None,
        local_shard: DirectoryShard | None = None,
        fallback_on_miss: bool = False,
        call_errors: tuple[type[BaseException], ...] = (Exception,),
        begin: BeginFn | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not callable(call):
            raise TypeError("call must be callable: call(owner, method, args)")
        self.ring = ring
        self._call = call
        self.replicas = replicas
        self.local_node = local_node
        self.local_shard = local_shard
        self.fallback_on_miss = fallback_on_miss
        self._errors = call_errors
        self._begin = begin
        self.failures = 0  # owner calls that raised or answered malformed data

    def _invoke(self, owner: str, method: str, args: list[Any]) -> Any:
        if self.local_shard is not None and owner == self.local_node:
            return self.local_shard.dispatch(method, args)
        return self._call(owner, method, args)

    def _try(self, owner: str, method: str, args: list[Any], check: Callable[[Any], bool]) -> tuple[bool, Any]:
        return self._finish(owner, method, lambda: self._invoke(owner, method, args), check)

    # ------------------------------------------------------------------ writes
    def _fan_out(self, method: str, items: Sequence[tuple[str, list[Any]]]) -> list[int]:
        """Send each ``(key, wire_item)`` to all of the key's owners, one call per owner."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (key, _) in enumerate(items):
            for owner in self.ring.owners(key, self.replicas) if len(self.ring) else ():
                groups[owner].append(i)
        acks = [0] * len(items)
        for owner, idxs in groups.items():
            ok, _ = self._try(owner, method, [items[i][1] for i in idxs], lambda r: isinstance(r, int))
            if ok:
                for i in idxs:
                    acks[i] += 1
        return acks

    def put(self, key: str, entry: DirEntry) -> int:
        """Publish ``entry`` to every owner of ``key``; returns how many owners answered.

        Runtime complexity: ``O(replicas)`` calls.
        """
        return self.batch_put([(key, entry)])[0]

    def batch_put(self, items: Sequence[tuple[str, DirEntry]]) -> list[int]:
        """Publish many entries with one call per owner; per-key count of owners that answered.

        An owner answering means it received the entry (it may still have kept a newer copy
        from the same node). Runtime complexity: ``O(k * replicas)`` plus one call per owner.
        """
        return self._fan_out("dir_put", [(k, [k, e.to_wire()]) for k, e in items])

    def delete(self, key: str, node: str | None = None, generation: int | None = None) -> int:
        """Conditionally delete ``key`` on all of its owners; returns owners that answered."""
        return self.batch_delete([(key, node, generation)])[0]

    def batch_delete(self, items: Sequence[tuple[str, str | None, int | None]]) -> list[int]:
        """Conditional deletes fanned out to every owner. Runtime: one call per owner."""
        return self._fan_out("dir_delete", [(k, [k, n, g]) for k, n, g in items])

    def set_resident(self, key: str, resident: bool, node: str | None = None, generation: int | None = None) -> int:
        """Conditionally mark ``key`` (non-)resident on all of its owners."""
        return self._fan_out("dir_set_resident", [(key, [key, node, generation, resident])])[0]

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> DirEntry | None:
        """The entry for ``key``, or ``None`` on a miss or when every owner failed.

        Runtime complexity: one call, up to ``replicas`` when owners fail.
        """
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[str]) -> list[DirEntry | None]:
        """Entries for ``keys`` in order; misses and all-owners-failed are ``None``.

        Round ``r`` asks every key's ``r``-th owner, grouped into one call per owner; only the
        keys whose owner failed (or missed, with ``fallback_on_miss``) go to round ``r + 1``.
        Runtime complexity: ``O(k * replicas)`` plus at most one call per owner per round.
        """
        return self.batch_get_columns(keys).entries()

    def batch_get_columns(self, keys: Sequence[str]) -> DirColumns:
        """:meth:`batch_get` as columns (:class:`DirColumns`), without a Python object per
        entry: the owners answer packed records and the batch read path uses the arrays as
        they are. A record naming a node the answer does not list counts as that owner
        failing for the key, which then goes to its next owner; an answer of the wrong
        shape fails the owner for all its keys.

        Runtime complexity: ``O(k * replicas)`` plus at most one call per owner per round.
        """
        out = np.zeros(len(keys), dtype=PACKED_ENTRY)
        out["node"] = NO_PRODUCER
        table: dict[str, int] = {}
        incarnations: list[int] = []

        def take(idxs: np.ndarray, answer: list[Any]) -> list[int]:
            names, body, incs = answer
            for nm, inc in zip(names, incs, strict=True):
                j = table.setdefault(nm, len(table))
                if j == len(incarnations):
                    incarnations.append(inc)
                else:  # two owners answered for one node: the newest incarnation names it
                    incarnations[j] = max(incarnations[j], inc)
            recs = np.frombuffer(body, dtype=PACKED_ENTRY).copy()
            node = recs["node"].astype(np.int64)
            miss = node == NO_PRODUCER
            bad = ~miss & (node >= len(names))
            # Owner-local node numbers -> this batch's table.
            remap = np.array([table[nm] for nm in names] + [NO_PRODUCER], dtype=np.int64)
            recs["node"] = remap[np.where(miss | bad, len(names), node)]
            at = np.asarray(idxs, dtype=np.int64)
            out[at] = recs
            n_bad = int(bad.sum())
            if n_bad:
                self.failures += n_bad
                out["node"][at[bad]] = NO_PRODUCER
            return at[bad | (miss & self.fallback_on_miss)].tolist()

        self._read_rounds(keys, "dir_get", _packed_of, take)
        return DirColumns(list(table), out, incarnations)

    def batch_exists(self, keys: Sequence[str]) -> bytes:
        """Whether each key has an entry, as one byte per key: :data:`MISS`,
        :data:`RESIDENT` or :data:`ON_DISK` (misses and all-owners-failed are :data:`MISS`).

        The owners answer ``dir_exists`` (one byte per key) instead of full entries; the
        replica rounds, the fallback and the failure accounting are those of
        :meth:`batch_get_columns`: an owner that fails or answers anything but ``bytes`` of the
        right length fails for all its keys, a byte outside the three codes fails for its
        key alone, and failed keys go to their next owner.

        Runtime complexity: ``O(k * replicas)`` plus at most one call per owner per round.
        """
        results = np.zeros(len(keys), dtype=np.uint8)

        def take(idxs: np.ndarray, codes: bytes) -> np.ndarray | list[int]:
            got = np.frombuffer(codes, dtype=np.uint8)
            if codes.translate(None, _EXISTS_CODES):  # some byte is not a known code
                bad = got > ON_DISK
                self.failures += int(np.count_nonzero(bad))
                good = ~bad
                results[idxs[good]] = got[good]
                return idxs[bad | (got == MISS)] if self.fallback_on_miss else idxs[bad]
            results[idxs] = got
            if self.fallback_on_miss and MISS in codes:
                return idxs[got == MISS]
            return []

        self._read_rounds(keys, "dir_exists", _bytes_of, take)
        return results.tobytes()

    def _read_rounds(
        self,
        keys: Sequence[str],
        method: str,
        check: Callable[[int], Callable[[Any], bool]],
        take: Callable[[np.ndarray, Any], np.ndarray | list[int]],
    ) -> None:
        """The replica rounds of a batch read. Round ``r`` sends every pending key to its
        ``r``-th owner, one ``method`` call per owner (owners in the order their first key
        appears, each owner's keys in pending order). An owner that fails, or whose answer
        fails ``check(len(keys_sent))``, leaves all its keys pending; otherwise
        ``take(indices, answer)`` records the answer and returns the indices to retry.

        Remote owners are sent their requests first (through ``begin`` when given) and the
        local shard answers while they are in flight; the answers are then taken in owner
        order, so results, retries and failure counts do not depend on the overlap."""
        if not keys:
            return
        names, table = self.ring.owner_table(keys, self.replicas)
        pending: np.ndarray | None = None  # None: every key, in order
        for rnd in range(table.shape[1]):
            col = table[:, rnd] if pending is None else table[pending, rnd]
            groups = _group(col, pending)
            outcomes: list[tuple[bool, Any]] = [(False, None)] * len(groups)
            waits: list[tuple[int, str, Pending]] = []
            local: list[int] = []
            try:
                for g, (j, idxs) in enumerate(groups):
                    owner = names[j]
                    if self.local_shard is not None and owner == self.local_node:
                        local.append(g)
                        continue
                    args = [keys[i] for i in idxs.tolist()]
                    try:
                        waits.append((g, owner, self._send(owner, method, args)))
                    except self._errors as exc:
                        self._failed(owner, method, exc)
                for g in local:
                    j, idxs = groups[g]
                    outcomes[g] = self._try(names[j], method, [keys[i] for i in idxs.tolist()], check(len(idxs)))
                while waits:
                    g, owner, call = waits.pop(0)
                    outcomes[g] = self._finish(owner, method, call.result, check(len(groups[g][1])))
            finally:
                for _, _, call in waits:  # only when something above raised past us
                    call.cancel()
            retry: list[np.ndarray | list[int]] = []
            for (_, idxs), (ok, answer) in zip(groups, outcomes, strict=True):
                got = take(idxs, answer) if ok else idxs
                if len(got):
                    retry.append(got)
            if not retry:
                break
            pending = np.concatenate(retry).astype(np.intp, copy=False)

    def _send(self, owner: str, method: str, args: list[Any]) -> Pending:
        """Start ``method`` on a remote ``owner``."""
        if self._begin is not None:
            return self._begin(owner, method, args)
        return _Answered(self._call(owner, method, args))

    def _finish(
        self, owner: str, method: str, finish: Callable[[], Any], check: Callable[[Any], bool]
    ) -> tuple[bool, Any]:
        try:
            result = finish()
        except self._errors as exc:
            self._failed(owner, method, exc)
            return False, None
        if not check(result):
            self.failures += 1
            log.debug("directory %s on %s answered malformed %r", method, owner, result)
            return False, None
        return True, result

    def _failed(self, owner: str, method: str, exc: BaseException) -> None:
        self.failures += 1
        log.debug("directory %s on %s failed: %r", method, owner, exc)

    # ------------------------------------------------------------------ membership
    def republish(
        self,
        entries: Mapping[str, DirEntry],
        old: HashRing | None,
        new: HashRing,
        *,
        call_owners: Callable[[Callable[[str], bool], list[str]], list[bool]] | None = None,
    ) -> Republished:
        """Re-PUT this producer's ``entries`` to the owners they gained from ``old`` to ``new``.

        Also makes ``new`` the current ring. ``call_owners(put, owners)`` runs ``put(owner)``
        for each owner and returns whether each was answered, in order; give one that calls
        them at the same time so an owner that hangs holds up nobody else's entries (the
        default calls them one after another). Returns how many (key, owner) puts were
        answered and which owners failed: the caller retries those (their entries are
        missing a replica until then).
        Runtime complexity: ``O(K * log(N * V))`` plus one call per owner.
        """
        self.ring = new
        plan = republish_plan(entries.keys(), old, new, self.replicas)

        def put(owner: str) -> bool:
            items = [[k, entries[k].to_wire()] for k in plan[owner]]
            return self._try(owner, "dir_put", items, lambda r: isinstance(r, int))[0]

        owners = list(plan)
        answered = call_owners(put, owners) if call_owners is not None else [put(o) for o in owners]
        return Republished(
            sum(len(plan[o]) for o, ok in zip(owners, answered, strict=True) if ok),
            tuple(o for o, ok in zip(owners, answered, strict=True) if not ok),
        )
