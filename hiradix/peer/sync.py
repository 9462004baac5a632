"""Keeping a peer node's directory in step with the live members, and saying when it is ready.

:class:`DirectorySync` is the part of a :class:`~hiradix.peer.node.PeerNode` that reacts to
changes of the live set and pulls the node's share of the directory:

- on a change of the live set (:meth:`DirectorySync.on_membership_change`) the ring is
  rebuilt, entries published by departed nodes (or by a restarted node's earlier
  incarnation) are dropped from the local shard, and this node re-publishes its own pages
  to the owners they gained (:func:`~hiradix.peer.directory.republish_plan`), a restarted
  node counting as having gained all of its keys; a member back after this node expired it
  is asked for the entries it published (a hand-off);
- the node pulls its share of the directory from every member (``dir_handoff``: each
  producer sends the entries of its pages that this node owns, :meth:`handle_handoff`)
  once it is in a cluster, and :meth:`DirectorySync.is_ready` says whether it has.

That work runs on a thread of its own (the *sync* thread, :meth:`DirectorySync.start`),
never on the heartbeat thread: it calls members one after another, and a member that
accepts connections and never answers holds each call for the whole RPC timeout, far longer
than the TTL. The calls of one round run side by side (:meth:`DirectorySync.call_members`),
so such a member delays a round by one heartbeat at most, and never this node's heartbeats:
the healthy masters never expire it for that. A node driven by hand (no thread) does the
same work on the calling thread (:meth:`DirectorySync.apply_members` and
:meth:`DirectorySync.pull`, which :meth:`PeerNode.tick <hiradix.peer.node.PeerNode.tick>`
calls).

Readiness. Once a member has answered the node with the members it knows, the node pulls its
share from every member; it is ready from then on, and not ready again while a node that was
alone merges into a cluster. A node with nobody to join (the head) is not ready alone until
the members' probe period has passed without anyone reaching it: restarted, it cannot tell a
new cluster from one whose members have not found it again yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hiradix.net.rpc import FrameError, RpcClient, RpcError
from hiradix.peer.directory import DirectoryShard, DirectoryView, DirEntry, put_items_from_wire
from hiradix.peer.membership import Membership, NodeInfo, describe_failure
from hiradix.peer.ring import HashRing

__all__ = ["HANDOFF_BATCH", "DirectorySync", "SyncSettings"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
HANDOFF_BATCH = 50_000  # directory entries per dir_handoff answer (a frame stays far below 16 MiB)


@dataclass(frozen=True)
class SyncSettings:
    """What :class:`DirectorySync` needs of the node's settings.

    >>> SyncSettings(heartbeat_s=1.0, rpc_timeout_s=5.0, virtual_nodes=160, directory_replicas=2).round_wait_s
    1.0
    """

    #: Period of the sync rounds (the node's heartbeat period).
    heartbeat_s: float
    #: Seconds an RPC to a member waits for its answer.
    rpc_timeout_s: float
    #: Ring points per node, and the owners of each directory entry.
    virtual_nodes: int
    directory_replicas: int

    @property
    def round_wait_s(self) -> float:
        """How long a round waits for its calls to members (:meth:`DirectorySync.call_members`):
        a heartbeat, within the RPC timeout, and a quarter of a second at least."""
        return max(min(self.heartbeat_s, self.rpc_timeout_s), 0.25)


class DirectorySync:
    """This node's directory kept in step with the live members (module docstring).

    Parameters
    ----------
    me:
        This node as the membership records it.
    membership:
        The live set, its acknowledgements and its clock.
    shard, directory:
        This node's directory shard, and the view of the whole directory (whose ring this
        object replaces on each change of the live set).
    client:
        The RPC client the hand-offs go through.
    published:
        The entries of the pages this node published (re-published and handed off).
    settings:
        Round period, RPC timeout and the ring's parameters.
    guard:
        Runs work of a kind and counts its failures (``guard(kind, fn, *args)``: the node's,
        whose counts are ``PeerNode.status()["background_errors"]``).
    background:
        Runs guarded work of a kind on the node's background executor (the hand-off from a
        member that came back).
    alone_by_design:
        The node has nobody to join (no seeds, or it is the head): it may count itself a
        cluster of one once the members' probe period has passed (see :meth:`is_ready`).
    """

    def __init__(
        self,
        me: NodeInfo,
        membership: Membership,
        shard: DirectoryShard,
        directory: DirectoryView,
        client: RpcClient,
        published: Callable[[], dict[str, DirEntry]],
        settings: SyncSettings,
        *,
        guard: Callable[..., Any],
        background: Callable[..., None],
        alone_by_design: bool,
    ) -> None:
        self.node_id = me.node_id
        self.membership = membership
        self.shard = shard
        self.directory = directory
        self.client = client
        self.settings = settings
        self._published = published
        self._guard = guard
        self._background = background
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted = threading.Event()  # wakes the sync thread early: a membership change
        # ``_sync_epoch`` counts the times the node had to (re)start pulling its share, so a
        # pull that ran across a newer such change does not mark it ready; ``_ack_mark`` is
        # the membership's acknowledgement count at the latest one. A node with nobody to
        # join may count itself a cluster of one only after ``_alone_until`` (its membership
        # clock): by then every member that remembers its address has probed it (the
        # members' probe backoff, plus a round each side). ``_ready_lock`` guards those
        # numbers and ``_pulled`` alone. ``_change_lock`` serializes the changes of the live
        # set and is held across their re-publish, RPCs to members that may hang: is_ready
        # (status, /ready, the metrics) must never wait for it.
        self._change_lock = threading.Lock()
        self._ready_lock = threading.Lock()
        self._ring_members: dict[str, NodeInfo] = {self.node_id: me}
        self._sync_epoch = 1
        self._synced_epoch = 0
        self._ack_mark = 0
        self._pulled: set[str] = set()  # members whose share was pulled in ``_sync_epoch``
        # The sync thread's calls to members still running, as (kind, member): see call_members.
        self._calls_lock = threading.Lock()
        self._member_calls: set[tuple[str, str]] = set()
        self._alone_until: float | None = None
        if alone_by_design:
            self._alone_until = membership.clock() + membership.backoff[1] + 2 * settings.heartbeat_s

    # ------------------------------------------------------------------ the sync thread
    def start(self) -> None:
        """Start the sync thread (idempotent): membership changes applied and the directory
        share pulled, at once on a change and every ``heartbeat_s`` besides (a failed
        re-publish or pull is retried so). From then on a membership change only wakes it."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name=f"peer-sync-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the sync thread to end (it ends with its current call); see :meth:`join`."""
        self._stop.set()
        self._wanted.set()

    def join(self, timeout: float) -> None:
        """Wait ``timeout`` seconds at most for the sync thread to end (after :meth:`stop`)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wanted.wait(self.settings.heartbeat_s)
            # A change reported between the wait and the clear is not lost: it is in the
            # membership already, and the round below reads the membership afresh.
            self._wanted.clear()
            if self._stop.is_set():
                return
            self._guard("republish", self.apply_members)
            self._guard("sync", self.pull)

    def on_membership_change(self, old: dict[str, NodeInfo], new: dict[str, NodeInfo]) -> None:
        """The membership's ``on_change``: wake the sync thread, or without one apply the
        change here (:meth:`apply_members`, guarded as ``republish``).

        Membership calls this on the heartbeat, probe and RPC threads (a peer's join). The
        re-publish calls owners one by one, so it must not hold any of those up (a hung
        owner would stall the heartbeats past the TTL, or fail the peer's call): it is the
        sync thread's once that runs. A node driven by hand applies it here; a failing
        re-publish then neither kills the caller nor fails the peer's call."""
        if self._thread is not None:
            self._wanted.set()
        else:
            self._guard("republish", self.apply_members)

    # ------------------------------------------------------------------ readiness
    def is_ready(self) -> bool:
        """Whether this node's view of the directory is complete: since it last came into
        its cluster (its start, or a merge after it was alone), a member acknowledged it
        (answered its ``disc_join`` or ``disc_heartbeat``: that member recorded it and sent
        it the members it knows), and it holds the entries of the keys it owns, pulled
        (``dir_handoff``) from every member it knew after that answer. A node with nobody
        to join (the head) is ready alone only once no member has reached it within the
        members' probe period (``5 * heartbeat_s`` plus two rounds): a head restarted
        without seeds is not ready before the members that remember it are back in its
        view. Until then reads through it may miss pages the cluster has.
        Runtime complexity: ``O(1)``."""
        with self._ready_lock:
            return self._synced_epoch == self._sync_epoch

    def pull(self) -> bool:
        """Pull this node's directory share from every other member it has not pulled from
        since it came into the cluster, all at once, if it is due; whether the node is
        ready. A member that fails or has not answered within the round leaves the node not
        ready until a later round (by then it answered or expired). Runtime complexity: one
        ``dir_handoff`` RPC per member and ``HANDOFF_BATCH`` entries, in parallel."""
        with self._ready_lock:
            epoch = self._sync_epoch
            if self._synced_epoch == epoch:
                return True
            mark = self._ack_mark
        members = self.membership.members()
        if len(members) == 1:
            return self._ready_alone(epoch)
        if self.membership.acknowledgements <= mark:
            # Nobody answered this node since it came into the cluster: it may know only the
            # members that reached it (a restarted head learns of them one probe at a time).
            # Ask one of them for the members it knows.
            self.membership.join()
            if self.membership.acknowledgements <= mark:
                return False
            members = self.membership.members()
        return self._pull_round(epoch, members)

    def _ready_alone(self, epoch: int) -> bool:
        """A node still alone: ready as a cluster of one once ``_alone_until`` has passed."""
        if self._alone_until is None or self.membership.clock() < self._alone_until:
            return False  # still alone: nothing to pull from yet
        with self._ready_lock:
            if self._sync_epoch == epoch:
                self._synced_epoch = epoch
                log.info("%s: ready: alone, no member came back (a new cluster)", self.node_id)
            return self._synced_epoch == self._sync_epoch

    def _pull_round(self, epoch: int, members: dict[str, NodeInfo]) -> bool:
        """Pull the share from the members of ``members`` not pulled from in ``epoch``;
        ready once every one of them was."""
        ids = sorted(members)

        def pull(nid: str) -> int | None:
            n = self._pull_share(members[nid], ids)
            if n is not None:
                with self._ready_lock:
                    if self._sync_epoch == epoch:
                        self._pulled.add(nid)
            return n

        with self._ready_lock:
            due = [n for n in ids if n != self.node_id and n not in self._pulled]
        got = self.call_members("pull", pull, due)
        with self._ready_lock:
            if self._sync_epoch == epoch and self._pulled.issuperset(n for n in ids if n != self.node_id):
                self._synced_epoch = epoch
                log.info(
                    "%s: ready: directory share pulled from %d members (%d entries this round)",
                    self.node_id,
                    len(ids) - 1,
                    sum(n or 0 for n in got.values()),
                )
            return self._synced_epoch == self._sync_epoch

    # ------------------------------------------------------------------ calls to members
    def call_members(self, kind: str, fn: Callable[[str], _T], members: Sequence[str]) -> dict[str, _T | None]:
        """``fn(member)`` for every member at once, each on a thread of its own, waiting
        :attr:`SyncSettings.round_wait_s` at most; ``fn``'s result for each call that ended
        by then, ``None`` for the others and for those that raised (guarded as background
        work of ``kind``). A call still running goes on alone (its result is dropped; ``fn``
        records what must outlive the round) and the member is skipped until it ends, so a
        member that hangs ties up one thread per kind, and delays nobody else's calls nor
        the next round past the wait. Runtime complexity: one thread per member called."""
        results: dict[str, _T | None] = dict.fromkeys(members)
        calls: dict[Future[_T | None], str] = {}
        for nid in members:
            with self._calls_lock:
                if (kind, nid) in self._member_calls:
                    log.debug("%s: %s from/to %s still in flight, skipped", self.node_id, kind, nid)
                    continue
                self._member_calls.add((kind, nid))
            fut: Future[_T | None] = Future()

            def run(nid: str = nid, fut: Future[_T | None] = fut) -> None:
                try:
                    out = self._guard(kind, fn, nid)
                finally:
                    with self._calls_lock:  # cleared before the future is done: see the skip above
                        self._member_calls.discard((kind, nid))
                fut.set_result(out)

            threading.Thread(target=run, name=f"peer-{kind}-{self.node_id}-{nid}", daemon=True).start()
            calls[fut] = nid
        done, _ = wait(calls, timeout=self.settings.round_wait_s)
        for fut in done:
            results[calls[fut]] = fut.result()
        return results

    def _answered(self, kind: str, fn: Callable[[str], bool], members: list[str]) -> list[bool]:
        """:meth:`call_members` as whether each member answered, in order."""
        got = self.call_members(kind, fn, members)
        return [got[m] is True for m in members]

    # ------------------------------------------------------------------ hand-offs
    def _pull_share(self, info: NodeInfo, ids: list[str]) -> int | None:
        """Store the entries ``info``'s node published for keys this node owns on the ring
        of ``ids``; how many, or ``None`` if it failed (logged: a dead member expires, or
        answers next round). Runtime complexity: one RPC per ``HANDOFF_BATCH`` entries."""
        after: str | None = None
        n = 0
        try:
            while True:
                items, more = self.client.call(info.rpc, "dir_handoff", self.node_id, ids, after)
                self.shard.batch_put(put_items_from_wire(items))
                n += len(items)
                if not more or not items:
                    return n
                after = str(items[-1][0])
        except (OSError, RpcError, FrameError) as exc:
            log.debug("%s: directory hand-off from %s failed: %s", self.node_id, info.node_id, describe_failure(exc)[0])
            return None

    def _pull_from(self, nid: str) -> None:
        """Pull the entries member ``nid`` published for keys this node owns (a hand-off
        after ``nid`` came back); a member that cannot answer is left to its next change."""
        info = self.membership.info(nid)
        if info is None:
            return
        n = self._pull_share(info, sorted(self.membership.members()))
        if n:
            log.info("%s: pulled %d directory entries from %s, back in the cluster", self.node_id, n, nid)

    def handle_handoff(self, requester: str, members: list[Any], after: str | None) -> list[Any]:
        """``dir_handoff``: the entries this node published whose owners, on the ring of
        ``members``, include ``requester``; keys after ``after`` in sorted order,
        ``HANDOFF_BATCH`` at most, as ``[[[key, entry_wire], ...], more]``.
        Runtime complexity: ``O(K log K + K log(N * V))`` for ``K`` published pages."""
        if not isinstance(requester, str) or not isinstance(members, list) or requester not in members:
            raise ValueError("dir_handoff takes a node id, the member ids (it among them) and a key or None")
        if not all(isinstance(m, str) and m for m in members) or not (after is None or isinstance(after, str)):
            raise ValueError("dir_handoff takes a node id, the member ids (it among them) and a key or None")
        entries = self._published()
        keys = sorted(k for k in entries if after is None or k > after)
        if not keys:
            return [[], False]
        names, table = HashRing(members, vnodes=self.settings.virtual_nodes).owner_table(
            keys, self.settings.directory_replicas
        )
        mine = np.flatnonzero((table == names.index(requester)).any(axis=1))
        out = [[keys[i], entries[keys[i]].to_wire()] for i in mine[:HANDOFF_BATCH].tolist()]
        return [out, len(mine) > HANDOFF_BATCH]

    # ------------------------------------------------------------------ changes of the live set
    def apply_members(self) -> None:
        """Bring the ring from what it was built of to the current live set and re-publish
        this node's entries to the owners they gained. Calls come in any order and run one
        at a time. On failure the ring stays the old one, so the next sync round (the sync
        thread's, or :meth:`PeerNode.tick <hiradix.peer.node.PeerNode.tick>`) applies the
        change again; every step of it is idempotent."""
        with self._change_lock:
            new = self.membership.members()
            old = self._ring_members
            if new == old:
                return
            prev_ring = self.directory.ring
            try:
                self._apply_members_locked(old, new)
            except BaseException:
                self._ring_members, self.directory.ring = old, prev_ring
                raise

    def _apply_members_locked(self, old: dict[str, NodeInfo], new: dict[str, NodeInfo]) -> None:
        self._ring_members = new
        if len(old) == 1 and len(new) > 1:
            # Was alone, merged into a cluster: learn its members, then pull the share.
            with self._ready_lock:
                self._sync_epoch += 1
                self._ack_mark = self.membership.acknowledgements
                self._pulled = set()
        # The ring of ``old`` itself, not the current one: after a round whose puts failed,
        # ``old`` is the membership before that round (see below).
        old_ring = HashRing(old, vnodes=self.settings.virtual_nodes)
        new_ring = HashRing(new, vnodes=self.settings.virtual_nodes)
        for gone in old.keys() - new.keys():
            self.shard.drop_node(gone)
        restarted = [n for n in old.keys() & new.keys() if old[n].incarnation != new[n].incarnation]
        for n in restarted:
            # Its earlier run's entries are stale, and its shard died with it: it gains
            # every key it owns, so the plan re-sends it all of them.
            self.shard.retire(n, new[n].incarnation)
            old_ring.remove_node(n)
        done = self.directory.republish(
            self._published(),
            old_ring,
            new_ring,
            call_owners=lambda put, owners: self._answered("republish", put, owners),
        )
        log.info("%s: members %d -> %d, re-published %d entries", self.node_id, len(old), len(new), done.puts)
        if done.failed:
            # Those owners lack a replica of the entries they gained. Serve on the new ring,
            # but remember the old membership as the one applied, so the next round (a
            # heartbeat later, or the next change) plans from it again and re-sends them.
            # The other steps are idempotent; an owner that already has an entry keeps it.
            self._ring_members = old
            log.warning(
                "%s: re-publish to %s failed; retrying next round", self.node_id, ", ".join(sorted(done.failed))
            )
        if len(old) > 1:  # (a node that was alone pulls from everyone: see pull)
            for nid in sorted(new.keys() - old.keys()):
                # A member back after this node expired it (a pause, a partition) still has
                # the pages it published, but this node dropped their entries and the member
                # may never have seen its own expiry, so it re-publishes nothing: pull them.
                # (A new or restarted member has none: one empty answer.)
                self._background("handoff", self._pull_from, nid)
