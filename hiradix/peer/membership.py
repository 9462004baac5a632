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

The heartbeats of one tick go out side by side, one thread per master, and the tick waits
for their answers ``heartbeat_timeout`` seconds at most (a quarter of the TTL by default). So
a master that accepts connections and never answers (a stopped process) delays the
heartbeats to the others by nothing, and the tick by that bound: it cannot make this node
miss its TTL at the masters that still run. Until its call ends (by the RPC timeout), such a
master is skipped, so a hung master holds at most one thread.

When a tick reaches no master at all the table is frozen (nothing expires): a master outage
never shrinks the ring under established readers and writers; they keep the cached view.

A member expires when no master has heard from it for ``ttl`` seconds. Time is an injected
``clock`` (tests drive it by hand; only the multi-process tests use real time).

Incarnations. Every process run of a node has its own ``incarnation`` (its start time in
microseconds). A record of a newer run replaces the older one like any fresher record, and
the change is reported (``on_change`` sees the member's record change; the log says
"restarted"), so the node's earlier directory entries can be dropped and its share of the
directory sent to it again.

Remembered peers (the local membership cache). Every RPC address a member has been seen at,
and every seed, is remembered. :meth:`Membership.probe` re-announces this node (a
``disc_join``) to each remembered address that is not a live member's now, with a bounded
exponential backoff per address. So a node restarted without seeds (the head, started with
the command it was first started with) is found again by the members that remember it, a
lone node keeps trying its seeds, and two halves of a healed partition merge again. An
address failing for ``forget_after`` seconds in a row is forgotten (seeds never are).

Every change of the live set is logged at INFO, one line per member (joined, left, expired,
restarted); a peer refusing this node's cluster token is logged as a WARNING.

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
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from hiradix.net.auth import AuthError

__all__ = ["DISC_METHODS", "JoinError", "Membership", "NodeInfo", "compute_masters", "describe_failure"]

log = logging.getLogger(__name__)

DISC_METHODS = ("disc_join", "disc_heartbeat", "disc_view", "disc_leave")


@dataclass(frozen=True)
class NodeInfo:
    """How to reach one node.

    ``node_id`` names it on the ring (and in directory entries); ``rpc`` is its control-plane
    address (discovery, directory, promote); ``data`` the address its transport reads are
    sent to; ``metrics`` the URL of its metrics server, if any; ``incarnation`` tells this
    run of the node from earlier ones (:func:`hiradix.peer.directory.new_incarnation`).
    """

    node_id: str
    rpc: str
    data: str
    metrics: str | None = None
    incarnation: int = 0

    def to_wire(self) -> list[Any]:
        """As a msgpack-friendly list. Runtime complexity: ``O(1)``."""
        return [self.node_id, self.rpc, self.data, self.metrics, self.incarnation]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> NodeInfo:
        """Inverse of :meth:`to_wire`; ``ValueError`` on a malformed record.

        >>> NodeInfo.from_wire(NodeInfo("a", "h:1", "h:2", incarnation=7).to_wire())
        NodeInfo(node_id='a', rpc='h:1', data='h:2', metrics=None, incarnation=7)
        """
        if not isinstance(wire, (list, tuple)) or len(wire) != 5:
            raise ValueError(f"malformed node record {wire!r}")
        node_id, rpc, data, metrics, incarnation = wire
        if not all(isinstance(v, str) and v for v in (node_id, rpc, data)):
            raise ValueError(f"malformed node record {wire!r}")
        if metrics is not None and not isinstance(metrics, str):
            raise ValueError(f"malformed node record {wire!r}")
        if type(incarnation) is not int or incarnation < 0:
            raise ValueError(f"malformed node record {wire!r}")
        return cls(node_id, rpc, data, metrics, incarnation)


class JoinError(ConnectionError):
    """No seed could be reached and authenticated with: this node is in no cluster."""


def describe_failure(exc: BaseException) -> tuple[str, bool]:
    """A one-line reason for a failed call to a peer, and whether the peer refused this
    node's cluster token (the RPC client wraps the handshake's :class:`AuthError`, which
    stays in the exception's context). A timeout is never a refusal, not even one in the
    handshake (:class:`~hiradix.net.auth.HandshakeTimeout` is an ``AuthError``): a
    peer that accepts connections and then says nothing (a stopped process) is
    unreachable, and joining keeps retrying it. Runtime complexity: ``O(chain length)``.

    >>> describe_failure(ConnectionRefusedError("refused"))
    ('ConnectionRefusedError: refused', False)
    >>> describe_failure(AuthError("server refused the cluster token"))[1]
    True
    >>> from hiradix.net.auth import HandshakeTimeout
    >>> describe_failure(HandshakeTimeout("handshake timed out"))
    ('HandshakeTimeout: handshake timed out', False)
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, TimeoutError):  # checked first: HandshakeTimeout is both
            break
        if isinstance(e, AuthError):
            return f"the cluster token was refused ({exc})", True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return f"{type(exc).__name__}: {exc}", False


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


@dataclass
class _Remembered:
    """A remembered peer address and the state of the probes sent to it."""

    node_id: str | None  # the member last seen there (None: a seed never reached yet)
    due: float  # clock time of the next probe
    backoff: float  # seconds from the next failure to the probe after it
    failing_since: float | None = None  # first failure of the current streak


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
        ``on_change(old, new)`` with the live member dicts, called from :meth:`tick`,
        :meth:`join`, :meth:`probe` or :meth:`handle` (never under the lock) whenever the
        live set changes; a member's record changing (a restart) counts. It runs on the
        caller's thread, a heartbeat round's included: slow work belongs on a thread of its
        own (a :class:`~hiradix.peer.node.PeerNode` only wakes its sync thread).
    probe_call:
        The ``call`` of :meth:`probe` (a shorter timeout suits it); default ``call``.
    backoff:
        ``(first, most)`` seconds between probes of one remembered address: doubling from
        ``first`` with each failure, never more than ``most``.
    forget_after:
        Seconds of continuous failure after which a remembered address (not a seed) is
        forgotten.
    heartbeat_timeout:
        Real seconds a :meth:`tick` waits for the masters' answers (default ``ttl / 4``);
        a heartbeat still in flight then counts as not answered this round.
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
        probe_call: CallFn | None = None,
        backoff: tuple[float, float] = (1.0, 5.0),
        forget_after: float = 3600.0,
        heartbeat_timeout: float | None = None,
    ) -> None:
        if max_masters < 1:
            raise ValueError(f"max_masters must be >= 1, got {max_masters}")
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if heartbeat_timeout is not None and not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {heartbeat_timeout}")
        if not 0 < backoff[0] <= backoff[1]:
            raise ValueError(f"backoff must be (first, most) with 0 < first <= most, got {backoff}")
        self.me = me
        self._call = call
        self._probe_call = probe_call if probe_call is not None else call
        self.head = head
        self.seeds = [s for s in dict.fromkeys([*([head] if head else []), *seeds]) if s != me.rpc]
        self.max_masters = max_masters
        self.ttl = float(ttl)
        self.clock = clock
        self.on_change = on_change
        self.backoff = (float(backoff[0]), float(backoff[1]))
        self.forget_after = float(forget_after)
        self.heartbeat_timeout = float(heartbeat_timeout) if heartbeat_timeout is not None else self.ttl / 4
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        now = clock()
        self._table: dict[str, tuple[NodeInfo, float]] = {me.node_id: (me, now)}
        self._live: dict[str, NodeInfo] = {me.node_id: me}
        self._remembered: dict[str, _Remembered] = {s: _Remembered(None, now, self.backoff[0]) for s in self.seeds}
        self._departed: dict[str, str] = {}  # node id -> why it left the table, until logged
        self.version = 0  # bumped on every change of the live set
        self.frozen = False  # the last tick reached no master: table kept as cached
        self.heartbeat_failures = 0  # heartbeats that raised (late ones included)
        self._in_flight: set[str] = set()  # masters whose last heartbeat has not ended yet
        #: Answers to this node's ``disc_join`` and ``disc_heartbeat`` calls: each one is a
        #: peer that recorded this node and sent it the members it knows (a view).
        self.acknowledgements = 0
        #: RPC address -> why the last ``disc_join`` sent there failed (cleared on success).
        self.join_failures: dict[str, tuple[str, bool]] = {}

    # ------------------------------------------------------------------ queries
    def members(self) -> dict[str, NodeInfo]:
        """Live members by node id (this node included). Runtime complexity: ``O(n)``."""
        with self._lock:
            return dict(self._live)

    def masters(self) -> tuple[str, ...]:
        """Active masters' node ids, head first. Runtime complexity: ``O(n log n)``."""
        with self._lock:
            return compute_masters(self._live.values(), self.head, self.max_masters)

    def info(self, node_id: str) -> NodeInfo | None:
        """A live member's record, or ``None``. Runtime complexity: ``O(1)``."""
        return self._live.get(node_id)

    def remembered(self) -> dict[str, str | None]:
        """Remembered peer addresses (seeds included) and the node last seen at each.
        Runtime complexity: ``O(r)``."""
        with self._lock:
            return {addr: r.node_id for addr, r in self._remembered.items()}

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
                if not isinstance(rec, list) or len(rec) != 6 or not isinstance(rec[5], (int, float)):
                    raise ValueError(f"malformed view record {rec!r}")
                info = NodeInfo.from_wire(rec[:5])
                if info.node_id == self.me.node_id:
                    continue
                seen = now - max(float(rec[5]), 0.0)
                cur = self._table.get(info.node_id)
                if cur is None or seen > cur[1]:
                    self._table[info.node_id] = (info, seen)
                    self._remember_locked(info, now)

    def _touch(self, info: NodeInfo) -> None:
        now = self.clock()
        with self._lock:
            self._table[info.node_id] = (info, now)
            self._remember_locked(info, now)

    def _remember_locked(self, info: NodeInfo, now: float) -> None:
        """Remember where ``info`` was seen alive; that address's probes start afresh."""
        if info.rpc != self.me.rpc:
            self._remembered[info.rpc] = _Remembered(info.node_id, now + self.backoff[0], self.backoff[0])

    def _recompute(self, expire: bool) -> tuple[dict[str, NodeInfo], dict[str, NodeInfo]] | None:
        now = self.clock()
        with self._lock:
            self._table[self.me.node_id] = (self.me, now)
            if expire:
                for nid in [n for n, (_, seen) in self._table.items() if now - seen > self.ttl]:
                    del self._table[nid]
                    self._departed[nid] = "expired"
            live = {nid: info for nid, (info, _) in self._table.items()}
            if live.keys() == self._live.keys() and all(live[k] == self._live[k] for k in live):
                return None
            old, self._live = self._live, live
            self.version += 1
            return old, live

    def _changed(self, change: tuple[dict[str, NodeInfo], dict[str, NodeInfo]] | None) -> None:
        if change is None:
            return
        old, new = change
        with self._lock:
            why = {nid: self._departed.pop(nid, "left") for nid in old.keys() - new.keys()}
        me = self.me.node_id
        for nid in sorted(new.keys() - old.keys()):
            log.info("%s: member joined: %s (rpc %s, incarnation %d)", me, nid, new[nid].rpc, new[nid].incarnation)
        for nid, reason in sorted(why.items()):
            if reason == "expired":
                log.info("%s: member expired: %s (nothing heard for %.1fs)", me, nid, self.ttl)
            else:
                log.info("%s: member left: %s", me, nid)
        for nid in sorted(old.keys() & new.keys()):
            a, b = old[nid].incarnation, new[nid].incarnation
            if a != b:
                log.info("%s: member restarted: %s (incarnation %d -> %d)", me, nid, a, b)
        if self.on_change is not None:
            self.on_change(old, new)

    # ------------------------------------------------------------------ service (server side)
    def handle(self, method: str, args: list[Any]) -> Any:
        """Serve one of :data:`DISC_METHODS` (the RPC server routes them here).

        ``disc_join``/``disc_heartbeat``: ``[node_wire]`` -> view; ``disc_view``: ``[]`` ->
        view; ``disc_leave``: ``[node_id]`` -> bool. A view is a list of
        ``[node_id, rpc, data, metrics, incarnation, age_seconds]``. ``ValueError`` on bad
        arguments.
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
                elif gone:
                    self._departed[args[0]] = "left"
            self._changed(self._recompute(expire=False))
            return gone
        raise ValueError(f"unknown discovery method {method!r}; expected one of {DISC_METHODS}")

    # ------------------------------------------------------------------ client side
    def join(self) -> bool:
        """Announce this node to the first live peer among the head, the seeds, the masters
        already known and then the other members known; merge its view. ``True`` when one
        answered, or when there is nobody to ask (a head started alone). Why each address
        failed is kept in :attr:`join_failures`. Runtime complexity: one RPC per address
        tried.
        """
        with self._lock:
            order = compute_masters(self._live.values(), self.head, len(self._live))  # masters first
            known = [self._live[m].rpc for m in order if m != self.me.node_id]
        targets = list(dict.fromkeys([*self.seeds, *known]))
        if not targets:
            return True
        return any(self._announce(addr, self._call) for addr in targets)  # stops at the first

    def _announce(self, addr: str, call: CallFn) -> bool:
        """``disc_join`` at ``addr`` and merge the view it answers; whether it answered.
        A failure backs that address's probes off and is recorded in :attr:`join_failures`;
        a refused cluster token is logged as a WARNING once per failure streak."""
        try:
            self._merge(call(addr, "disc_join", [self.me.to_wire()]))
        except Exception as exc:  # a dead or foreign peer: the caller tries the next one
            reason, auth = describe_failure(exc)
            now = self.clock()
            with self._lock:
                first = self.join_failures.get(addr) != (reason, auth)
                self.join_failures[addr] = (reason, auth)
                r = self._remembered.get(addr)
                if r is not None:
                    if r.failing_since is None:
                        r.failing_since = now
                    r.due = now + r.backoff
                    r.backoff = min(2 * r.backoff, self.backoff[1])
            level = logging.WARNING if auth and first else logging.DEBUG
            log.log(level, "%s: joining through %s failed: %s", self.me.node_id, addr, reason)
            return False
        with self._lock:
            self.join_failures.pop(addr, None)
            r = self._remembered.get(addr)
            if r is not None:
                r.failing_since, r.backoff = None, self.backoff[0]
        self._changed(self._recompute(expire=False))
        with self._lock:  # after on_change: the answer acknowledges the merge it brought
            self.acknowledgements += 1
        return True

    def probe(self) -> int:
        """Re-announce this node to every remembered address that is due and is not a live
        member's; forget the addresses (not seeds) failing for ``forget_after`` seconds.
        Returns how many answered. Runtime complexity: one RPC per address due, ``O(r)``
        besides.
        """
        with self._probe_lock:
            now = self.clock()
            with self._lock:
                live = {info.rpc for info in self._live.values()}
                stale = [
                    a
                    for a, r in self._remembered.items()
                    if r.failing_since is not None and now - r.failing_since > self.forget_after and a not in self.seeds
                ]
                for addr in stale:
                    del self._remembered[addr]
                    self.join_failures.pop(addr, None)
                due = [a for a, r in self._remembered.items() if a not in live and r.due <= now]
            for addr in stale:
                log.info("%s: forgetting %s (unreachable for %.0fs)", self.me.node_id, addr, self.forget_after)
            return sum(self._announce(addr, self._probe_call) for addr in due)

    def tick(self) -> bool:
        """One heartbeat round: heartbeat every active master side by side (merging each
        answer's view), wait ``heartbeat_timeout`` seconds at most for them, expire members
        unheard of for ``ttl`` unless no master answered, recompute the live set. A master
        whose previous heartbeat is still in flight is not sent another. Returns whether
        the live set changed. Runtime complexity: one RPC and one thread per master; the
        round takes ``heartbeat_timeout`` at most (plus ``on_change``).
        """
        with self._tick_lock:
            masters = self.masters()
            others = [m for m in masters if m != self.me.node_id]
            pending: list[Future[bool]] = []
            for nid in others:
                info = self.info(nid)
                if info is None:
                    continue
                with self._lock:
                    if nid in self._in_flight:
                        log.debug("%s: heartbeat to %s still in flight, skipped", self.me.node_id, nid)
                        continue
                    self._in_flight.add(nid)
                pending.append(self._heartbeat_async(nid, info))
            done, _ = wait(pending, timeout=self.heartbeat_timeout)
            # A master's own table is fresh (it is heartbeated), and so is a lone node's.
            reached = self.me.node_id in masters or not others or any(f.result() for f in done)
            self.frozen = not reached
            change = self._recompute(expire=reached)
        self._changed(change)
        return change is not None

    def _heartbeat_async(self, nid: str, info: NodeInfo) -> Future[bool]:
        """Heartbeat master ``nid`` on a thread of its own; the future says whether it
        answered. Its in-flight mark is cleared before the future is done."""
        fut: Future[bool] = Future()

        def run() -> None:
            ok = False
            try:
                self._merge(self._call(info.rpc, "disc_heartbeat", [self.me.to_wire()]))
                with self._lock:
                    self.acknowledgements += 1
                ok = True
            except Exception as exc:  # a dead master expires like any member
                reason, auth = describe_failure(exc)
                with self._lock:
                    self.heartbeat_failures += 1
                level = logging.WARNING if auth else logging.DEBUG
                log.log(level, "%s: heartbeat to %s failed: %s", self.me.node_id, nid, reason)
            finally:
                with self._lock:
                    self._in_flight.discard(nid)
                fut.set_result(ok)

        threading.Thread(target=run, name=f"heartbeat-{self.me.node_id}-{nid}", daemon=True).start()
        return fut

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
