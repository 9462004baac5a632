"""Embedded discovery: who is in the cluster, without a dedicated meta machine.

Every node runs the discovery service on its own RPC server (``disc_join``,
``disc_heartbeat``, ``disc_view``, ``disc_leave``) and keeps a local membership table. Up
to ``max_masters`` of the live nodes are *active masters*: the configured head first (while
it is alive), then the others in node-id order. Every node heartbeats every active master
each :meth:`Membership.tick`; a master answers with the members it knows, so each node's
table is refreshed from the masters it reaches. Masters are computed, not elected: every
node derives the same list from the same live set, so a dead non-head master is replaced
as soon as it expires, and a node promoted to master already has a full table (the one it
cached as a member).

Liveness travels as *ages*, not timestamps: a view lists each member with the seconds since
its last direct heartbeat at the sender, and a receiver keeps ``max(own, now - age)``. Views
therefore never make a member younger than its last real heartbeat, so a dead node cannot be
kept alive by views circulating between masters, and no two clocks are ever compared.

When a tick reaches no master at all the table is frozen (nothing expires): a master outage
never shrinks the ring under established readers and writers; they keep the cached view.

A member expires when no master has heard from it for ``ttl`` seconds. Time is an injected
``clock`` (tests drive it by hand; only the multi-process tests use real time).

>>> from hiradix.peer.membership import NodeInfo, compute_masters
>>> ms = [NodeInfo(n, n, n) for n in ("c:1", "a:1", "b:1", "d:1")]
>>> compute_masters(ms, head="c:1", max_masters=3)
('c:1', 'a:1', 'b:1')
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DISC_METHODS", "Membership", "NodeInfo", "compute_masters"]

log = logging.getLogger(__name__)

DISC_METHODS = ("disc_join", "disc_heartbeat", "disc_view", "disc_leave")


@dataclass(frozen=True)
class NodeInfo:
    """How to reach one node.

    ``node_id`` names it on the ring (and in directory entries); ``rpc`` is its control-plane
    address (discovery, directory, promote); ``data`` the address its transport reads are
    sent to; ``metrics`` the URL of its metrics server, if any.
    """

    node_id: str
    rpc: str
    data: str
    metrics: str | None = None

    def to_wire(self) -> list[Any]:
        """As a msgpack-friendly list. Runtime complexity: ``O(1)``."""
        return [self.node_id, self.rpc, self.data, self.metrics]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> NodeInfo:
        """Inverse of :meth:`to_wire`; ``ValueError`` on a malformed record.

        >>> NodeInfo.from_wire(NodeInfo("a", "h:1", "h:2").to_wire())
        NodeInfo(node_id='a', rpc='h:1', data='h:2', metrics=None)
        """
        if not isinstance(wire, (list, tuple)) or len(wire) != 4:
            raise ValueError(f"malformed node record {wire!r}")
        node_id, rpc, data, metrics = wire
        if not all(isinstance(v, str) and v for v in (node_id, rpc, data)):
            raise ValueError(f"malformed node record {wire!r}")
        if metrics is not None and not isinstance(metrics, str):
            raise ValueError(f"malformed node record {wire!r}")
        return cls(node_id, rpc, data, metrics)


def compute_masters(members: Iterable[NodeInfo], head: str | None, max_masters: int) -> tuple[str, ...]:
    """The active masters (node ids) among live ``members``: the node whose RPC address is
    ``head`` first when it is alive, then the rest in node-id order, ``max_masters`` at most.

    Runtime complexity: ``O(n log n)``.
    """
    ms = sorted(members, key=lambda m: m.node_id)
    first = [m.node_id for m in ms if head is not None and m.rpc == head][:1]
    rest = [m.node_id for m in ms if m.node_id not in first]
    return tuple((first + rest)[:max_masters])


CallFn = Callable[[str, str, list[Any]], Any]  # call(rpc_addr, method, args) -> result


class Membership:
    """This node's view of the cluster, and its share of the discovery service.

    Parameters
    ----------
    me:
        This node.
    call:
        ``call(rpc_addr, method, args)``: one RPC; any exception means that peer failed.
    head:
        RPC address of the configured head master (``discovery_addr``), or ``None``.
    seeds:
        More RPC addresses to try when joining (any live master will do).
    max_masters:
        Active masters kept (head first, then by node id).
    ttl:
        Seconds without a heartbeat after which a member is dead.
    clock:
        Monotonic seconds (injected; a fake clock in tests).
    on_change:
        ``on_change(old, new)`` with the live member dicts, called from :meth:`tick` /
        :meth:`join` (never under the lock) whenever the live set changes.
    """

    def __init__(
        self,
        me: NodeInfo,
        call: CallFn,
        *,
        head: str | None = None,
        seeds: Sequence[str] = (),
        max_masters: int = 3,
        ttl: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[dict[str, NodeInfo], dict[str, NodeInfo]], None] | None = None,
    ) -> None:
        if max_masters < 1:
            raise ValueError(f"max_masters must be >= 1, got {max_masters}")
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self.me = me
        self._call = call
        self.head = head
        self.seeds = [s for s in dict.fromkeys([*([head] if head else []), *seeds]) if s != me.rpc]
        self.max_masters = max_masters
        self.ttl = float(ttl)
        self.clock = clock
        self.on_change = on_change
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._table: dict[str, tuple[NodeInfo, float]] = {me.node_id: (me, clock())}
        self._live: dict[str, NodeInfo] = {me.node_id: me}
        self.version = 0  # bumped on every change of the live set
        self.frozen = False  # the last tick reached no master: table kept as cached
        self.heartbeat_failures = 0

    # ------------------------------------------------------------------ queries
    def members(self) -> dict[str, NodeInfo]:
        """Live members by node id (this node included). Runtime complexity: ``O(n)``."""
        with self._lock:
            return dict(self._live)

    def masters(self) -> tuple[str, ...]:
        """Active masters' node ids, head first. Runtime complexity: ``O(n log n)``."""
        with self._lock:
            return compute_masters(self._live.values(), self.head, self.max_masters)

    def is_master(self) -> bool:
        """Whether this node is an active master."""
        return self.me.node_id in self.masters()

    def info(self, node_id: str) -> NodeInfo | None:
        """A live member's record, or ``None``. Runtime complexity: ``O(1)``."""
        return self._live.get(node_id)

    # ------------------------------------------------------------------ table
    def _view_wire(self) -> list[Any]:
        now = self.clock()
        with self._lock:
            self._table[self.me.node_id] = (self.me, now)
            return [
                [*info.to_wire(), max(now - seen, 0.0)]
                for nid, (info, seen) in self._table.items()
                if nid in self._live or nid == self.me.node_id
            ]

    def _merge(self, view: Any) -> None:
        if not isinstance(view, list):
            raise ValueError("view must be a list")
        now = self.clock()
        with self._lock:
            for rec in view:
                if not isinstance(rec, list) or len(rec) != 5 or not isinstance(rec[4], (int, float)):
                    raise ValueError(f"malformed view record {rec!r}")
                info = NodeInfo.from_wire(rec[:4])
                if info.node_id == self.me.node_id:
                    continue
                seen = now - max(float(rec[4]), 0.0)
                cur = self._table.get(info.node_id)
                if cur is None or seen > cur[1]:
                    self._table[info.node_id] = (info, seen)

    def _touch(self, info: NodeInfo) -> None:
        with self._lock:
            self._table[info.node_id] = (info, self.clock())

    def _recompute(self, expire: bool) -> tuple[dict[str, NodeInfo], dict[str, NodeInfo]] | None:
        now = self.clock()
        with self._lock:
            self._table[self.me.node_id] = (self.me, now)
            if expire:
                for nid in [n for n, (_, seen) in self._table.items() if now - seen > self.ttl]:
                    del self._table[nid]
            live = {nid: info for nid, (info, _) in self._table.items()}
            if live.keys() == self._live.keys() and all(live[k] == self._live[k] for k in live):
                return None
            old, self._live = self._live, live
            self.version += 1
            return old, live

    def _changed(self, change: tuple[dict[str, NodeInfo], dict[str, NodeInfo]] | None) -> None:
        if change is not None and self.on_change is not None:
            self.on_change(*change)

    # ------------------------------------------------------------------ service (server side)
    def handle(self, method: str, args: list[Any]) -> Any:
        """Serve one of :data:`DISC_METHODS` (the RPC server routes them here).

        ``disc_join``/``disc_heartbeat``: ``[node_wire]`` -> view; ``disc_view``: ``[]`` ->
        view; ``disc_leave``: ``[node_id]`` -> bool. A view is a list of
        ``[node_id, rpc, data, metrics, age_seconds]``. ``ValueError`` on bad arguments.
        """
        if method in ("disc_join", "disc_heartbeat"):
            if len(args) != 1:
                raise ValueError(f"{method} takes one node record")
            info = NodeInfo.from_wire(args[0])
            self._touch(info)
            if method == "disc_join":
                self._changed(self._recompute(expire=False))
            return self._view_wire()
        if method == "disc_view":
            return self._view_wire()
        if method == "disc_leave":
            if len(args) != 1 or not isinstance(args[0], str):
                raise ValueError("disc_leave takes a node id")
            with self._lock:
                gone = self._table.pop(args[0], None) is not None and args[0] != self.me.node_id
                if args[0] == self.me.node_id:
                    self._table[self.me.node_id] = (self.me, self.clock())
            self._changed(self._recompute(expire=False))
            return gone
        raise ValueError(f"unknown discovery method {method!r}; expected one of {DISC_METHODS}")

    # ------------------------------------------------------------------ client side
    def join(self) -> bool:
        """Announce this node to the first live master among the head, the seeds and the
        masters already known; merge its view. ``True`` when one answered (or when this
        node is the head / has nobody to ask). Runtime complexity: one RPC per address tried.
        """
        with self._lock:
            known = [
                self._live[m].rpc
                for m in compute_masters(self._live.values(), self.head, self.max_masters)
                if m != self.me.node_id
            ]
        targets = list(dict.fromkeys([*self.seeds, *known]))
        if not targets:
            return True
        for addr in targets:
            try:
                view = self._call(addr, "disc_join", [self.me.to_wire()])
                self._merge(view)
            except Exception as exc:  # a dead seed: try the next one
                log.debug("join via %s failed: %r", addr, exc)
                continue
            self._changed(self._recompute(expire=False))
            return True
        return self.head == self.me.rpc

    def tick(self) -> bool:
        """One heartbeat round: heartbeat every active master (merging its view), expire
        members unheard of for ``ttl`` unless no master answered, recompute the live set.
        Returns whether the live set changed. Runtime complexity: one RPC per master.
        """
        with self._tick_lock:
            masters = self.masters()
            others = [m for m in masters if m != self.me.node_id]
            reached = self.me.node_id in masters
            for nid in others:
                info = self.info(nid)
                if info is None:
                    continue
                try:
                    self._merge(self._call(info.rpc, "disc_heartbeat", [self.me.to_wire()]))
                    reached = True
                except Exception as exc:  # a dead master expires like any member
                    self.heartbeat_failures += 1
                    log.debug("heartbeat to %s failed: %r", nid, exc)
            if not others and not reached:
                reached = True
            if len(self._live) == 1 and self.seeds and not self.is_master_alone():
                reached = self.join() or reached
            self.frozen = not reached
            change = self._recompute(expire=reached)
        self._changed(change)
        return change is not None

    def is_master_alone(self) -> bool:
        """This node is alone and is the configured head (nothing to join)."""
        return self.head == self.me.rpc

    def leave(self) -> None:
        """Tell the active masters this node is going (best effort)."""
        for nid in self.masters():
            info = self.info(nid)
            if info is None or nid == self.me.node_id:
                continue
            try:
                self._call(info.rpc, "disc_leave", [self.me.node_id])
            except Exception as exc:
                log.debug("leave via %s failed: %r", nid, exc)
