"""One peer-cache node: control plane, data plane, pool, disk and metrics wired together.

A :class:`PeerNode` runs

- an :class:`~hiradix.net.rpc.RpcServer` serving its directory shard (``dir_*``), the
  embedded discovery service (``disc_*``), ``data_promote`` (bring disk-resident pages back
  into the pool and return their fresh locations) and ``node_status``;
- a transport (TCP, RDMA, or the fake NIC in-process) whose responder serves only the
  published pools. The receive region and the caller's host KV pool (L2, through
  :meth:`PeerNode.register_receive`) are registered as local receive regions: reads land
  in them, no peer can read them;
- published pools, one per page-size class (SGLang uses one page size, hence one pool),
  an optional :class:`~hiradix.peer.disk.DiskTier`, and :class:`PeerMetrics` with an
  optional :class:`MetricsServer`;
- :class:`~hiradix.peer.membership.Membership`, heartbeating the active masters from a
  background thread and probing remembered peers from another;
- :class:`~hiradix.peer.sync.DirectorySync`, which keeps the directory in step with the live
  set (ring, dropped and re-published entries, hand-offs) on a third thread (the *sync*
  thread, never the heartbeat thread: a member that hangs delays it, never this node's
  heartbeats), and says when the node is ready (:meth:`PeerNode.is_ready`).

Lifecycle. A node started with seeds (``discovery_addr`` or ``seeds``) that is not itself the
head must join: :meth:`PeerNode.start` retries its seeds until ``join_timeout_s`` and raises
:class:`~hiradix.peer.membership.JoinError` if none answered (at once if every seed refused
the cluster token), unless ``allow_alone``, which starts it alone with a WARNING. Once in a
cluster the node pulls its share of the directory from every member and is ready
(:mod:`hiradix.peer.sync` says when exactly). Every node has an incarnation (its start time
in microseconds) carried in its membership record and its directory entries, so a node
restarted on the same address replaces its earlier run everywhere.

Addresses. Listeners bind ``bind_host``; other nodes are told ``advertise_addr`` (by default
the bound address, or for a wildcard bind the address of the default route's interface,
:meth:`~hiradix.peer.config.PeerConfig.advertised_host`), which also names the node.

The node is the wiring: membership, the directory (shard and view; keeping it in step is a
:class:`~hiradix.peer.sync.DirectorySync`'s) and the RPC server and client are its own; the
pages it publishes are a :class:`~hiradix.peer.producer.Producer`'s (pools, evictions, disk
tier, promote), and every read path is a :class:`~hiradix.peer.reader.Reader`'s (local,
promoted and remote pages, READ in place into a local receive region or staged through the
receive region, verified).
Both are described there. The transport is injected (``transport=``, an instance or a
factory), else built by :func:`~hiradix.peer.transports.make_transport` from
:meth:`config.transport_choice() <hiradix.peer.config.PeerConfig.transport_choice>`. Each part
takes the few settings it uses (``config.reader_settings()``, ``producer_settings()``,
``sync_settings()``), not the whole config.

:class:`InProcessCluster` starts several nodes in one process on loopback (TCP transport or
the fake NIC) for tests, examples and the simulator.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Concatenate, ParamSpec

import numpy as np

from hiradix.net.address import WILDCARD_HOSTS, with_host
from hiradix.net.auth import load_token
from hiradix.net.rpc import FrameError, PendingCall, RpcClient, RpcError, RpcServer
from hiradix.peer.config import PeerConfig
from hiradix.peer.directory import (
    DIR_METHODS,
    MISS,
    ON_DISK,
    DirectoryShard,
    DirectoryView,
    DirEntry,
    new_incarnation,
)
from hiradix.peer.disk import DiskTier
from hiradix.peer.membership import DISC_METHODS, JoinError, Membership, NodeInfo
from hiradix.peer.metrics import MetricsServer, PeerMetrics
from hiradix.peer.pool import SLOT_HEADER_SIZE, PublishedPool
from hiradix.peer.producer import Producer, size_class
from hiradix.peer.reader import Reader, ReaderSettings, ReceiveRegion
from hiradix.peer.ring import HashRing
from hiradix.peer.sync import DirectorySync
from hiradix.peer.transports import make_transport
from hiradix.transport.base import MAX_ITEM_BYTES, Transport
from hiradix.transport.fake import FakeFabric

__all__ = ["InProcessCluster", "PeerNode", "PortInUseError", "TransportFactory", "size_class"]

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
#: Builds a node's transport from its node id (known only once its RPC listener is bound).
TransportFactory = Callable[[str], Transport]


class PortInUseError(OSError):
    """A listener of the node could not bind its port; the message names the listener,
    the address and the option that moves it.

    >>> str(PortInUseError("metrics", "127.0.0.1", 31997))
    'metrics port 31997 on 127.0.0.1 is in use; pass --metrics-port 0 (any free port) or another port'
    """

    def __init__(self, listener: str, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"{listener} port {port} on {host} is in use; pass --{listener}-port 0 (any free port) or another port",
        )
        self.listener, self.host, self.port = listener, host, port

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def _binding(listener: str, host: str, port: int) -> Iterator[None]:
    """Re-raise a bind failure of ``listener`` as an error that names it (and its port)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, PortInUseError):
            raise
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(listener, host, port) from exc
        raise OSError(exc.errno, f"{listener} listener on {host}:{port}: {exc.strerror or exc}") from exc


def _check_transport(fabric: FakeFabric | None, transport: object) -> None:
    """Refuse ``fabric`` with ``transport``, and a ``transport`` that is neither a
    :class:`Transport` nor a factory of one."""
    if transport is not None and fabric is not None:
        raise ValueError("PeerNode takes fabric= (the fake NIC) or transport=, not both")
    if transport is not None and not (isinstance(transport, Transport) or callable(transport)):
        raise TypeError(f"transport must be a Transport or a factory of one, got {type(transport).__name__}")


def _closed_on_failure(init: Callable[Concatenate[PeerNode, _P], None]) -> Callable[Concatenate[PeerNode, _P], None]:
    """Wrap ``PeerNode.__init__``: what it opened (listeners, threads, registrations) and
    pushed on ``self._undo`` is closed again, newest first, if it raises."""

    @functools.wraps(init)
    def wrapper(self: PeerNode, *args: _P.args, **kwargs: _P.kwargs) -> None:
        self._undo = contextlib.ExitStack()
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self._undo.close()
            raise
        self._undo.pop_all()  # from now on close() owns them

    return wrapper


class PeerNode:
    """One node of the peer cache (see the module docstring).

    Parameters
    ----------
    config:
        The node's settings (ports, pool, disk, replicas, timeouts...).
    seeds:
        Extra RPC addresses of masters to join through (besides ``config.discovery_addr``;
        without it the first seed is the head).
    fabric:
        Put the node on this in-process fake NIC (``config.transport`` ``"auto"`` or
        ``"fake"``); not with ``transport``.
    transport:
        The data-plane transport, injected: a :class:`Transport` (the node owns it from
        then on and closes it) or a factory called with the node id. ``None``:
        :func:`~hiradix.peer.transports.make_transport` of ``config.transport``.
    heartbeat_s, ttl_s:
        Heartbeat period of the background thread, and how long a silent member lives
        (default ``3 * heartbeat_s``). Remembered peers that are not members are probed
        every ``heartbeat_s`` at first, backing off to ``5 * heartbeat_s``.
    start:
        :meth:`start` now (join, pull the directory share, start the background threads);
        ``False`` leaves it to the caller (:meth:`start`, or :meth:`join` and :meth:`tick`
        by hand, as unit tests with an injected clock do).
    allow_alone:
        When :meth:`start` cannot join through any seed, run alone (a WARNING, not ready,
        seeds retried in the background) instead of raising :class:`JoinError`.
    clock:
        Monotonic seconds for membership (injected in tests).
    recv_bytes, recv_lanes:
        Size of the receive region and how many reads may use it at once.

    A node that fails to start closes everything it opened before raising. A port that is
    taken raises :class:`PortInUseError`, which names the listener (``rpc``, ``data`` or
    ``metrics``). The metrics port stays the seed's fixed 31997 by default, so scrape
    configs can name it; a second node on one host needs ``metrics_port=0`` (any free
    port, advertised in the membership and :meth:`status`) or another port.
    """

    _undo: contextlib.ExitStack  # what a failed start closes (set by _closed_on_failure)

    @_closed_on_failure
    def __init__(
        self,
        config: PeerConfig | None = None,
        *,
        seeds: Sequence[str] = (),
        fabric: FakeFabric | None = None,
        transport: Transport | TransportFactory | None = None,
        heartbeat_s: float = 1.0,
        ttl_s: float | None = None,
        start: bool = True,
        allow_alone: bool = False,
        clock: Callable[[], float] = time.monotonic,
        recv_bytes: int = 64 << 20,
        recv_lanes: int = 4,
    ) -> None:
        self.config = cfg = config if config is not None else PeerConfig(metrics_enabled=False)
        _check_transport(fabric, transport)
        self._token = load_token(cfg.cluster_token)
        self.heartbeat_s = float(heartbeat_s)
        self.allow_alone = allow_alone
        self.incarnation = new_incarnation()
        advertised = cfg.advertised_host()  # before any listener: a ConfigError leaks nothing
        self._open_rpc(advertised)
        self._open_transport(transport, fabric, advertised)
        self._lock = threading.Lock()
        #: Failures of background work (heartbeat, probe and sync rounds, re-publishes,
        #: warm-ups, disk callbacks) by kind; see :meth:`_guard` and :meth:`status`.
        self.background_errors: dict[str, int] = {}
        self.metrics = PeerMetrics()
        self._open_metrics(advertised)
        me = NodeInfo(self.node_id, self.address, self.data_address, self.metrics_url, self.incarnation)
        self._build_membership(me, seeds, ttl_s, clock)
        self._build_parts(me, cfg.reader_settings(recv_bytes, recv_lanes))
        self._register_handlers()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prober: threading.Thread | None = None
        self._closed = False
        self.metrics.bind_node(self.node_id, self.is_ready, lambda: sorted(self.membership.members()))
        if start:
            try:
                self.start()
            except BaseException:
                self.close(leave=False)
                raise

    # ------------------------------------------------------------------ construction
    def _open_rpc(self, advertised: str) -> None:
        """Bind the RPC listener and build the RPC client; name the node."""
        cfg = self.config
        with _binding("rpc", cfg.bind_host, cfg.rpc_port):
            self.rpc = RpcServer(
                self._token,
                host=cfg.bind_host,
                port=cfg.rpc_port,
                max_connections=cfg.max_connections,
                idle_timeout=cfg.idle_timeout_s,
            )
        self._undo.callback(self.rpc.close)
        #: This node's RPC address as other nodes dial it (what ``--join`` names).
        self.address = with_host(self.rpc.address, advertised)
        self.node_id = cfg.node_id or self.address
        # Every method this node calls is safe to run twice: directory writes and deletes
        # carry (node, generation) and apply only if newer, membership calls re-register,
        # the rest read. So a call whose pooled connection died mid-call is sent again.
        self.client = RpcClient(
            self._token,
            timeout=cfg.rpc_timeout_s,
            max_connections_per_peer=cfg.max_channels_per_peer,
            idempotent=(*DIR_METHODS, *DISC_METHODS, "dir_handoff", "node_status", "data_promote"),
        )
        self._undo.callback(self.client.close)

    def _open_transport(
        self, transport: Transport | TransportFactory | None, fabric: FakeFabric | None, advertised: str
    ) -> None:
        """Take the injected transport, or build one (:func:`make_transport`)."""
        self.transport: Transport
        if isinstance(transport, Transport):
            self.transport = transport
        else:
            choice = self.config.transport_choice()
            build = transport or functools.partial(make_transport, choice, fabric=fabric, token=self._token)
            with _binding("data", self.config.bind_host, self.config.data_port):
                self.transport = build(self.node_id)
        self._undo.callback(self.transport.close)
        #: The data-plane address peers READ from (the fake NIC's is the node's name).
        self.data_address = self.transport.advertised_address(advertised)

    def _open_metrics(self, advertised: str) -> None:
        """Start the metrics server (when enabled) and say where it answers."""
        cfg = self.config
        self.metrics_server: MetricsServer | None = None
        self.metrics_url: str | None = None
        if not cfg.metrics_enabled:
            return
        self.metrics_server = MetricsServer(
            self.metrics, cfg.effective_metrics_host, cfg.metrics_port, cfg.metrics_dashboard
        )
        with _binding("metrics", cfg.effective_metrics_host, cfg.metrics_port):
            self.metrics_server.start()
        self._undo.callback(self.metrics_server.stop)
        # Its own bind address unless that is the nodes' one or a wildcard.
        mhost = cfg.metrics_host
        if mhost is None or mhost in WILDCARD_HOSTS:
            mhost = advertised
        self.metrics_url = "http://" + with_host(f"{mhost}:{self.metrics_server.port}", mhost)

    def _build_membership(
        self, me: NodeInfo, seeds: Sequence[str], ttl_s: float | None, clock: Callable[[], float]
    ) -> None:
        """The membership (not joined yet: :meth:`start` or :meth:`join` does that)."""
        seeds = [s for s in seeds if s != self.address]
        head = self.config.discovery_addr or (seeds[0] if seeds else self.address)
        self.membership = Membership(
            me,
            self._rpc_call,
            head=head,
            seeds=seeds,
            max_masters=self.config.max_masters,
            ttl=ttl_s if ttl_s is not None else 3 * self.heartbeat_s,
            clock=clock,
            on_change=self._on_membership_change,
            probe_call=self._probe_rpc,
            backoff=(self.heartbeat_s, 5 * self.heartbeat_s),
        )

    def _build_parts(self, me: NodeInfo, reader_settings: ReaderSettings) -> None:
        """The directory, the producer, the reader, the background executor and the sync."""
        cfg = self.config
        self.shard = DirectoryShard()
        self.directory = DirectoryView(
            HashRing([self.node_id], vnodes=cfg.virtual_nodes),
            self._dir_call,
            replicas=cfg.directory_replicas,
            local_node=self.node_id,
            local_shard=self.shard,
            begin=self._dir_begin,
        )
        #: This node's published pages (pools, evictions, disk tier, promote).
        self.producer = Producer(
            self.node_id,
            self.incarnation,
            cfg.producer_settings(),
            self.transport,
            self.directory,
            self.metrics,
            self._guard,
        )
        self._undo.callback(self.producer.close)
        #: Every read path (local, promoted, remote in place or staged).
        self.reader = Reader(
            self.node_id,
            reader_settings,
            self.transport,
            self.directory,
            self.membership,
            self.client,
            self.producer,
            self.metrics,
        )
        self._bg = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peer-bg")
        self._undo.callback(self._bg.shutdown, wait=False, cancel_futures=True)
        self._bg_pending: set[Future[Any]] = set()  # background work not finished yet
        #: The directory kept in step with the live members; readiness (:meth:`is_ready`).
        self.sync = DirectorySync(
            me,
            self.membership,
            self.shard,
            self.directory,
            self.client,
            self.producer.published,
            cfg.sync_settings(self.heartbeat_s),
            guard=self._guard,
            background=self._background,
            alone_by_design=self._alone_by_design(),
        )

    def _register_handlers(self) -> None:
        for m in DIR_METHODS:
            self.rpc.register(m, self._dir_handler(m))
        for m in DISC_METHODS:
            self.rpc.register(m, self._disc_handler(m))
        self.rpc.register("data_promote", self.producer.handle_promote)
        self.rpc.register("dir_handoff", self.sync.handle_handoff)
        self.rpc.register("node_status", self.status)

    # ------------------------------------------------------------------ wiring
    def _rpc_call(self, addr: str, method: str, args: list[Any]) -> Any:
        return self.client.call(addr, method, *args)

    def _probe_rpc(self, addr: str, method: str, args: list[Any]) -> Any:
        # Probes go to peers that may be gone for good (a blackholed host waits out the whole
        # connect timeout): a short deadline, on the prober thread, never the heartbeat's.
        return self.client.call(addr, method, *args, timeout=min(self.config.connect_timeout_s, 2.0))

    def _dir_call(self, owner: str, method: str, args: list[Any]) -> Any:
        info = self.membership.info(owner)
        if info is None:
            raise LookupError(f"{owner} is not a live member")
        return self.client.call(info.rpc, method, args)

    def _dir_begin(self, owner: str, method: str, args: list[Any]) -> PendingCall:
        info = self.membership.info(owner)
        if info is None:
            raise LookupError(f"{owner} is not a live member")
        return self.client.begin(info.rpc, method, args)

    def _dir_handler(self, method: str) -> Callable[[list[Any]], Any]:
        def handler(items: list[Any]) -> Any:
            return self.shard.dispatch(method, items)

        return handler

    def _disc_handler(self, method: str) -> Callable[..., Any]:
        def handler(*args: Any) -> Any:
            return self.membership.handle(method, list(args))

        return handler

    def _on_membership_change(self, old: dict[str, NodeInfo], new: dict[str, NodeInfo]) -> None:
        # Membership calls this on the heartbeat, probe and RPC threads (a peer's join).
        self.sync.on_membership_change(old, new)

    # ------------------------------------------------------------------ membership
    def _alone_by_design(self) -> bool:
        """Nobody to join: no seeds, or this node is the configured head."""
        return not self.membership.seeds or self.membership.head == self.address

    def start(self) -> None:
        """Join the cluster, pull this node's directory share, start the heartbeat and
        probe threads.

        A node that is not the head and has seeds retries them (backing off from
        ``heartbeat_s`` to 1 s) until one answers or someone joins it, for
        ``config.join_timeout_s`` at most; then, or at once when every seed refused the
        cluster token, it raises :class:`JoinError` naming each seed's failure, or with
        ``allow_alone`` logs a WARNING and runs alone (not ready; the seeds keep being
        probed). Runtime complexity: one RPC per seed per attempt, then one per member.
        """
        if not self._alone_by_design():
            deadline = time.monotonic() + self.config.join_timeout_s
            pause = min(self.heartbeat_s, 1.0)
            seeds = self.membership.seeds
            while not (self.membership.join() or len(self.membership.members()) > 1):
                failures = dict(self.membership.join_failures)
                refused = all(failures.get(s, ("", False))[1] for s in seeds)
                if refused or time.monotonic() >= deadline:
                    why = "; ".join(f"{s}: {failures[s][0]}" for s in seeds if s in failures)
                    if not self.allow_alone:
                        raise JoinError(f"{self.node_id} cannot join the cluster through {', '.join(seeds)}: {why}")
                    log.warning(
                        "%s: running ALONE, NOT part of any cluster: cannot join through %s (%s); "
                        "retrying in the background",
                        self.node_id,
                        ", ".join(seeds),
                        why,
                    )
                    break
                self._stop.wait(min(pause, max(deadline - time.monotonic(), 0.0)))
                pause = min(2 * pause, 1.0)
        self.sync.pull()
        self.start_heartbeat()

    def join(self) -> bool:
        """Join through the head or a seed and pull this node's directory share; ``True``
        if a master answered (or there was nobody to ask). No retries: see :meth:`start`."""
        joined = self.membership.join()
        self.sync.pull()
        return joined

    def tick(self) -> bool:
        """One heartbeat round, then, on the calling thread, what the sync thread does: the
        change of the live set applied (ring, re-publish; one that failed is retried) and
        the pull of this node's directory share if it is due (see :meth:`is_ready`). For
        nodes driven by hand (:class:`InProcessCluster`, tests); the background threads do
        the two halves apart (:meth:`start_heartbeat`). Returns whether the live set
        changed. Runtime complexity: one RPC per master, then as
        :meth:`DirectorySync.apply_members <hiradix.peer.sync.DirectorySync.apply_members>`
        and :meth:`DirectorySync.pull <hiradix.peer.sync.DirectorySync.pull>`."""
        changed = self.membership.tick()
        self._guard("republish", self.sync.apply_members)
        self.sync.pull()
        return changed

    def probe(self) -> int:
        """Probe the remembered peers that are due (the probe thread calls this every
        ``heartbeat_s``); how many answered."""
        return self.membership.probe()

    def start_heartbeat(self) -> None:
        """Start the background threads (idempotent): heartbeat (a membership round every
        ``heartbeat_s``), probe (the remembered peers due), and sync (membership changes
        applied, the directory share pulled; see :meth:`DirectorySync.start
        <hiradix.peer.sync.DirectorySync.start>`). From then on a membership change only
        wakes the sync thread, whichever thread reports it."""
        if self._thread is not None:
            return
        # The sync thread first: a change reported once the heartbeat runs must find it.
        self.sync.start()
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"peer-hb-{self.node_id}", daemon=True)
        self._thread.start()
        self._prober = threading.Thread(target=self._probe_loop, name=f"peer-probe-{self.node_id}", daemon=True)
        self._prober.start()

    def _heartbeat_loop(self) -> None:
        # Heartbeats only: a round takes heartbeat_timeout at most however many members
        # hang (see Membership.tick). Everything that calls members one by one is the sync
        # thread's.
        while not self._stop.wait(self.heartbeat_s):
            self._guard("heartbeat", self.membership.tick)  # the loop must outlive one bad round

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._guard("probe", self.membership.probe)

    def _guard(self, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run as background work of ``kind``: an exception never kills the
        loop or worker that runs it, and never vanishes. It is counted in
        :attr:`background_errors` (``status()["background_errors"]``, and the
        ``hiradix_peer_background_errors_total{kind}`` counter) and logged: with its
        traceback the first time for each kind, in one line when the count reaches a power
        of two (a round failing every heartbeat does not flood the log). Returns ``fn``'s
        result, ``None`` when it raised. Runtime complexity: ``O(1)`` plus ``fn``."""
        try:
            return fn(*args)
        except Exception as exc:
            with self._lock:
                n = self.background_errors[kind] = self.background_errors.get(kind, 0) + 1
            self.metrics.record_background_error(kind)
            if n == 1:
                log.exception("%s: background %s failed (traceback logged once per kind)", self.node_id, kind)
            elif n & (n - 1) == 0:
                log.warning("%s: background %s failed %d times so far, latest: %r", self.node_id, kind, n, exc)
            return None

    def is_ready(self) -> bool:
        """Whether this node's view of the directory is complete
        (:meth:`DirectorySync.is_ready <hiradix.peer.sync.DirectorySync.is_ready>`): since it
        last came into its cluster a member acknowledged it and it pulled its share of the
        directory from every member it knew; the head alone only after the members' probe
        period. Until then reads through it may miss pages the cluster has.
        Runtime complexity: ``O(1)``."""
        return self.sync.is_ready()

    # ------------------------------------------------------------------ published pages
    def _pool_for(self, n: int) -> PublishedPool:
        return self.producer.pool_for(n)

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier under the published pools (``None`` when off or unusable)."""
        return self.producer.disk

    @property
    def evictions(self) -> int:
        """Pages evicted from the published pools so far."""
        return self.producer.evictions

    @property
    def on_evictions(self) -> Callable[[int], None] | None:
        """Called with the count of pages each write evicted from the pools."""
        return self.producer.on_evictions

    @on_evictions.setter
    def on_evictions(self, fn: Callable[[int], None] | None) -> None:
        self.producer.on_evictions = fn

    @property
    def max_page_bytes(self) -> int:
        """The largest page any node can serve: a slot READ is one transport item."""
        return MAX_ITEM_BYTES - SLOT_HEADER_SIZE

    @property
    def pool_used_bytes(self) -> int:
        """Payload bytes held by the published pools."""
        return self.producer.used_bytes

    @property
    def pool_pages(self) -> int:
        """Pages held by the published pools."""
        return self.producer.pages

    def published(self) -> dict[str, DirEntry]:
        """A copy of every entry this node has published (resident or on disk).
        Runtime complexity: ``O(pages)``."""
        return self.producer.published()

    def publish_many(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Store each page in the published pool and PUT its location to the key's owners
        (:meth:`Producer.publish_many <hiradix.peer.producer.Producer.publish_many>`).

        A page counts as stored when it is in the pool and at least one owner took its
        entry. Runtime complexity: ``O(total bytes)`` plus one RPC per owner.
        """
        return self.producer.publish_many(keys, pages)

    def delete_all(self) -> int:
        """Unpublish every page of this node (pools, disk and directory). Returns the count.
        Runtime complexity: ``O(pages)`` plus one RPC per owner."""
        return self.producer.delete_all()

    def _warm(self, entries: list[tuple[str, DirEntry]]) -> None:
        """Best-effort promotes of disk-resident pages an ``exists`` just reported: this
        node's own from its disk tier, the others' by a ``data_promote`` to their producer."""
        by_node: dict[str, list[str]] = defaultdict(list)
        for key, e in entries:
            if e.node == self.node_id:
                self.producer.warm_local(key)
            else:
                by_node[e.node].append(key)
        for node, keys in by_node.items():
            info = self.membership.info(node)
            if info is not None:
                self._background("promote", self._promote_remote_quiet, info.rpc, keys)

    def _background(self, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the background executor, guarded as ``kind`` (:meth:`_guard`):
        a future's exception would otherwise be kept in it, unseen. Nothing once the node
        is closing (its executor is shut down)."""
        try:
            fut = self._bg.submit(self._guard, kind, fn, *args)
        except RuntimeError:  # shut down: the node is closing
            return
        with self._lock:
            self._bg_pending.add(fut)
        fut.add_done_callback(self._bg_done)

    def _bg_done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._bg_pending.discard(fut)

    def drain_background(self, timeout: float | None = None) -> bool:
        """Wait until the background work started so far (the warm-ups of disk-resident
        pages that ``exists`` reported) has finished, ``timeout`` seconds at most; whether
        it has. The disk tier's own writes are waited for by ``disk.flush``.
        Runtime complexity: ``O(pending)``."""
        with self._lock:
            pending = list(self._bg_pending)
        return not wait(pending, timeout).not_done

    def _promote_remote_quiet(self, rpc: str, keys: list[str]) -> None:
        try:
            self.client.call(rpc, "data_promote", keys, timeout=self.config.promote_timeout_s)
        except (OSError, RpcError, FrameError) as exc:  # an unreachable producer: a later miss
            log.debug("%s: warm-up promote on %s failed: %r", self.node_id, rpc, exc)

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[str]) -> list[DirEntry | None]:
        """Directory entries of ``keys`` (one RPC per owner; failures are ``None``)."""
        return self.directory.batch_get(list(keys))

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the directory knows (disk-resident pages count and are
        warmed asynchronously).

        The owners answer one byte per key (:meth:`DirectoryView.batch_exists`); full entries
        are fetched only for the disk-resident keys of the prefix, which the warm-up needs
        (the rare path). Runtime complexity: ``O(k)`` plus one RPC per owner, and one more per
        owner when some page of the prefix is on disk.
        """
        keys = list(keys)
        codes = self.directory.batch_exists(keys)
        n = codes.find(MISS)
        if n < 0:
            n = len(codes)
        if codes.find(ON_DISK, 0, n) >= 0:
            cold = [k for k, c in zip(keys[:n], codes, strict=False) if c == ON_DISK]
            entries = self.directory.batch_get(cold)
            # A page promoted meanwhile is resident again; one gone meanwhile needs nothing.
            self._warm([(k, e) for k, e in zip(cold, entries, strict=True) if e is not None and not e.resident])
        return n

    @property
    def stale_reads(self) -> int:
        """Remote slots fetched that failed verification (each one a miss)."""
        return self.reader.stale_reads

    @property
    def recv(self) -> ReceiveRegion:
        """The receive region remote READs land in (lanes leased one per read)."""
        return self.reader.recv

    def register_receive(self, buffer: Any) -> int:
        """Register ``buffer`` (the host KV pool) as a *local receive* region: remote
        payloads are READ straight into it, then verified in place. It is never published:
        the transport refuses any peer read of it, and no directory entry names it.
        Returns a handle for :meth:`deregister_receive`. Runtime complexity: ``O(regions)``.
        """
        return self.reader.register_receive(buffer)

    def deregister_receive(self, handle: int, timeout: float | None = None) -> None:
        """Undo :meth:`register_receive` (waits for reads landing in it)."""
        self.reader.deregister_receive(handle, timeout)

    def read_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[bool]:
        """Fill each of ``outs`` (writable flat bytes) with its key's verified page
        (:meth:`Reader.read_into <hiradix.peer.reader.Reader.read_into>`); ``False`` for a
        miss. Runtime complexity: ``O(total bytes)`` plus one RPC per owner and one batch
        READ per producer.
        """
        return self.reader.read_into(keys, outs)

    def read_pages(self, keys: Sequence[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any = None) -> np.ndarray:
        """:meth:`read_into` for raw destinations: page ``i`` (exactly ``lengths[i]`` bytes)
        goes to the address ``addrs[i]``, which the caller keeps writable and alive (``hold``
        is kept referenced for the call); one boolean per key
        (:meth:`Reader.read_pages <hiradix.peer.reader.Reader.read_pages>`).
        Runtime complexity: ``O(total bytes)`` plus one RPC per owner and one batch READ
        per producer.
        """
        return self.reader.read_pages(keys, addrs, lengths, hold)

    # ------------------------------------------------------------------ data over RPC
    def enable_data_rpc(self) -> None:
        """Serve ``page_put(keys, blobs)`` and ``page_get(keys)`` over the (authenticated)
        RPC server: page bytes as msgpack ``bin``. For operators and the multi-process
        tests (``hiradix peer serve --data-rpc``); serving engines use the store in-process.
        """

        def page_put(keys: list[Any], blobs: list[Any]) -> list[bool]:
            if not isinstance(keys, list) or not isinstance(blobs, list) or len(keys) != len(blobs):
                raise ValueError("page_put takes two lists of equal length")
            if not all(isinstance(k, str) for k in keys) or not all(isinstance(b, bytes) for b in blobs):
                raise ValueError("page_put takes str keys and bytes pages")
            return self.publish_many(keys, blobs)

        def page_get(keys: list[Any], lengths: list[Any]) -> list[bytes | None]:
            if not isinstance(keys, list) or not isinstance(lengths, list) or len(keys) != len(lengths):
                raise ValueError("page_get takes two lists of equal length")
            bufs = [bytearray(int(n)) for n in lengths]
            ok = self.read_into([str(k) for k in keys], [memoryview(b) for b in bufs])
            return [bytes(b) if r else None for b, r in zip(bufs, ok, strict=True)]

        self.rpc.register("page_put", page_put)
        self.rpc.register("page_get", page_get)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Membership, readiness, pool, disk, directory and hit-rate numbers (the
        ``node_status`` RPC)."""
        members = self.membership.members()
        disk = self.disk
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "rpc": self.address,
            "data": self.data_address,
            "transport": self.transport.capabilities.kind,
            "metrics": self.metrics_url,
            "members": sorted(members),
            "masters": list(self.membership.masters()),
            "frozen": self.membership.frozen,
            "ready": self.is_ready(),
            "pool": {
                "pages": self.pool_pages,
                "used_bytes": self.pool_used_bytes,
                "capacity_bytes": self.config.pool_size,
                "classes": self.producer.size_classes(),
                "evictions": self.evictions,
            },
            "disk": None
            if disk is None
            else {
                "pages": len(disk),
                "used_bytes": disk.used_bytes,
                "capacity_bytes": disk.capacity_bytes,
                "writes": disk.writes,
                "dropped_writes": disk.dropped_writes,
                "write_errors": disk.write_errors,
            },
            "directory_entries": len(self.shard),
            "published": len(self.producer),
            "hit_rate": self.metrics.hit_rate(),
            "stale_reads": self.stale_reads,
            "background_errors": dict(self.background_errors),
        }

    # ------------------------------------------------------------------ lifetime
    def close(self, leave: bool = True) -> None:
        """Stop heartbeats, tell the masters (``leave``), stop every server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.sync.stop()
        # One deadline for all: a thread in a call to a hung member ends with the call (its
        # RPC timeout); close does not wait for that past 5 s (the threads are daemons).
        deadline = time.monotonic() + 5.0
        for t in (self._thread, self._prober):
            if t is not None:
                t.join(timeout=max(deadline - time.monotonic(), 0.0))
        self.sync.join(timeout=max(deadline - time.monotonic(), 0.0))
        if leave:
            with contextlib.suppress(Exception):
                self.membership.leave()
        self._bg.shutdown(wait=False, cancel_futures=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.rpc.close()
        self.client.close()
        self.reader.close()
        self.producer.close()
        self.transport.close()

    def __enter__(self) -> PeerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessCluster:
    """``n`` nodes in this process on loopback: real RPC, and the TCP transport or the fake
    NIC (``transport="fake"``). Heartbeats are driven by :meth:`settle` (no threads, no
    sleeping). The first node is the head.

    >>> with InProcessCluster(2, transport="fake", pool_size=1 << 20) as c:
    ...     c.nodes[0].publish_many(["k"], [b"page"])[0], len(c.nodes[1].membership.members())
    (True, 2)
    """

    def __init__(self, n: int = 3, *, transport: str = "tcp", **config: Any) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if transport not in ("tcp", "fake"):
            raise ValueError(f"transport must be 'tcp' or 'fake', got {transport!r}")
        self.fabric = FakeFabric() if transport == "fake" else None
        config.setdefault("transport", transport)
        config.setdefault("metrics_enabled", False)
        config.setdefault("cluster_token", secrets.token_hex(16))
        self.config = config
        self.nodes: list[PeerNode] = []
        try:
            for _ in range(n):
                self.add_node()
        except BaseException:
            self.close()
            raise

    def add_node(self, **overrides: Any) -> PeerNode:
        """Start one more node (joined through the head) and settle the cluster."""
        cfg = dict(self.config, **overrides)
        if self.nodes:
            cfg.setdefault("discovery_addr", self.nodes[0].address)
        node = PeerNode(PeerConfig(**cfg), fabric=self.fabric, start=False, heartbeat_s=3600.0)
        self.nodes.append(node)
        node.join()
        self.settle()
        return node

    def settle(self, rounds: int = 2) -> None:
        """Run heartbeat rounds on every node until views agree (``rounds`` at least)."""
        for _ in range(rounds):
            for node in self.nodes:
                if not node._closed:
                    node.tick()

    def close(self) -> None:
        """Close every node."""
        # Each close waits for its accept loops to notice; do them side by side.
        threads = [threading.Thread(target=n.close, kwargs={"leave": False}) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30.0)

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
