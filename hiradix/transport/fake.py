"""An in-process fake NIC: memcpy-based one-sided READ with rkeys, queue-pair error states,
and fault/delay injection. The RDMA logic is tested against it.

Nodes attach to a :class:`FakeFabric` under a name (their peer address). A reader leases
a queue pair (a channel) per peer from the same capped pool the real transports use; a
read checks the remote region table exactly like a responder would and ``memmove``\\ s the
bytes (the GIL is released during the copy).

Queue-pair semantics follow RC verbs: the first failing work request moves the QP to the
error state and a QP in error is never reused, the pool opens a fresh one. After a remote
access error (bad rkey, out of bounds) the reader reports that item and re-posts the
flushed rest of the batch on a fresh QP, so statuses stay per item as the contract says;
after a channel fault (an injected failure, a timeout) the rest of the batch reports
``CHANNEL_ERROR`` / ``TIMEOUT``.

Fault and delay injection (no sleeping anywhere):

- ``fail_nth_read(n)``: the ``n``-th item this NIC posts (1-based, counted across batches)
  completes with an error instead of moving bytes; no byte is written for it.
- :attr:`Transport.responder_hook` on the *remote* NIC runs before its bytes are copied;
  a test makes it wait on an event (a gate) or raise :class:`InjectedFault`.
- ``delay``: a callable ``op -> seconds`` of *virtual* time each item takes; with a
  :class:`FakeClock` as the fabric clock, items finishing after the deadline time out.

The same fabric also carries *fake verbs* (:class:`FakeVerbs`): fake HCAs with an MR table,
RC queue pairs (RESET -> INIT -> RTR -> RTS -> ERR), a send queue bounded by its depth
(a post beyond it fails with ``ENOMEM`` as on hardware), chained READ work requests that
complete in order, one completion per signalled WR or error, and the RC error rule: the
first failing WR moves the QP to ERR and every WR after it completes with
``WR_FLUSH_ERR``. The RDMA transport's Python logic runs on it
(:class:`hiradix.transport.rdma.RdmaTransport` with ``provider=FakeVerbs(fabric)``).
A chain can complete partially: ``wrs_per_poll`` bounds the WRs a poll executes,
``stall_after(n)`` stops the HCA after ``n`` more WRs (a link gone quiet), and ``delay``
spends virtual time per WR.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from hiradix.net.pool import ChannelPool
from hiradix.transport.base import (
    BatchPlan,
    Capabilities,
    InjectedFault,
    Pins,
    ReadOp,
    RegionTable,
    ResponderHook,
    Status,
    Transport,
    TransportError,
)

__all__ = ["FakeClock", "FakeFabric", "FakeHca", "FakeMr", "FakeQp", "FakeTransport", "FakeVerbs"]


class FakeClock:
    """A manual monotonic clock (cachetools' fake ``Timer``), for anything that takes an
    injected clock (the fabric, peer membership, the tree, the cache's L3 prefetches):
    ``clock()`` reads it, ``advance(dt)`` moves it, :attr:`now` is the time without a
    read and :attr:`calls` counts the reads.

    >>> clock = FakeClock(5.0)
    >>> clock(), clock.calls
    (5.0, 1)
    >>> clock.advance(2.5)
    >>> clock.now, clock.calls
    (7.5, 1)
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self._calls += 1
            return self._now

    @property
    def now(self) -> float:
        """The time, read without counting as a call."""
        with self._lock:
            return self._now

    @property
    def calls(self) -> int:
        """How many times the clock was read (called)."""
        with self._lock:
            return self._calls

    def advance(self, dt: float) -> None:
        """Move time forward by ``dt`` seconds (``dt >= 0``)."""
        if dt < 0:
            raise ValueError("time does not go backwards")
        with self._lock:
            self._now += dt


class FakeFabric:
    """The switch: finds a NIC by name. ``clock`` is shared by every attached NIC."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self._nics: dict[str, FakeTransport] = {}
        self._hcas: dict[bytes, FakeHca] = {}
        self._lock = threading.Lock()
        self._names = itertools.count()

    def _attach(self, nic: FakeTransport, name: str | None) -> str:
        with self._lock:
            if name is None:
                name = f"fake{next(self._names)}"
                while name in self._nics:
                    name = f"fake{next(self._names)}"
            if name in self._nics:
                raise ValueError(f"a NIC named {name!r} is already attached")
            self._nics[name] = nic
            return name

    def detach(self, name: str) -> None:
        """Unplug a NIC: reads to it report ``PEER_UNREACHABLE`` from now on."""
        with self._lock:
            self._nics.pop(name, None)

    def lookup(self, name: str) -> FakeTransport | None:
        """The NIC attached as ``name``, or ``None``."""
        with self._lock:
            return self._nics.get(name)

    def _attach_hca(self, hca: FakeHca) -> bytes:
        with self._lock:
            gid = b"\xfe\x80" + bytes(6) + next(self._names).to_bytes(8, "big")
            self._hcas[gid] = hca
            return gid

    def hca(self, gid: bytes) -> FakeHca | None:
        """The fake HCA whose GID is ``gid``, or ``None`` (closed, or never there)."""
        with self._lock:
            return self._hcas.get(gid)

    def detach_hca(self, gid: bytes) -> None:
        """Unplug a fake HCA: queue pairs towards it fail with ``RETRY_EXC_ERR``."""
        with self._lock:
            self._hcas.pop(gid, None)


class _QP:
    """A fake reliable-connected queue pair to one peer."""

    __slots__ = ("error", "peer", "qpn")

    def __init__(self, peer: str, qpn: int) -> None:
        self.peer = peer
        self.qpn = qpn
        self.error = False


class FakeTransport(Transport):
    """A node on a :class:`FakeFabric`; its address is its name on the fabric.

    Parameters
    ----------
    fabric:
        The fabric to attach to.
    name:
        Address on the fabric (generated when ``None``).
    delay:
        ``op -> seconds`` of virtual time per item, advanced on the fabric's clock when
        it is a :class:`FakeClock`.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="fake", one_sided=True, releases_gil=True, zero_copy_receive=True, fault_injection=True
    )

    def __init__(
        self,
        fabric: FakeFabric,
        name: str | None = None,
        *,
        max_channels_per_peer: int = 16,
        timeout: float = 5.0,
        delay: Callable[[ReadOp], float] | None = None,
    ) -> None:
        super().__init__(max_channels_per_peer=max_channels_per_peer, timeout=timeout, clock=fabric.clock)
        self.fabric = fabric
        self.delay = delay
        self._qpns = itertools.count(1)
        self._posted = 0
        self._fail_at: set[int] = set()
        self._fault_lock = threading.Lock()
        self._pool: ChannelPool[_QP] = ChannelPool(
            self._connect, lambda qp: None, max_channels_per_peer, TransportError
        )
        self._closed = False
        self._name = fabric._attach(self, name)

    @property
    def address(self) -> str:
        return self._name

    def advertised_address(self, host: str) -> str:
        """Its name on the fabric, wherever the node's listeners are: no socket."""
        return self._name

    def fail_nth_read(self, n: int) -> None:
        """Make the ``n``-th item posted from now on (1-based) fail with a channel error."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        with self._fault_lock:
            self._fail_at.add(self._posted + n)

    def open_channels(self, peer: str) -> int:
        """Queue pairs currently open from this NIC to ``peer``."""
        return self._pool.open_count(peer)

    def _connect(self, peer: str, timeout: float | None) -> _QP:
        if self._closed:
            raise ConnectionError("NIC is closed")
        if self.fabric.lookup(peer) is None:
            raise ConnectionRefusedError(f"no NIC named {peer!r} on the fabric")
        return _QP(peer, next(self._qpns))

    def _post(self) -> bool:
        """Count one posted item; ``True`` when an injected fault fires on it."""
        with self._fault_lock:
            self._posted += 1
            if self._posted in self._fail_at:
                self._fail_at.discard(self._posted)
                return True
            return False

    def _read_remote(self, peer: str, plan: BatchPlan, status: np.ndarray, deadline: float) -> None:
        start = 0
        try:
            while start < len(plan):
                try:
                    qp = self._pool.lease(peer, max(deadline - self.clock(), 0.0))
                except TimeoutError:
                    status[plan.index[start:]] = Status.TIMEOUT
                    return
                except (ConnectionError, OSError):
                    status[plan.index[start:]] = Status.PEER_UNREACHABLE
                    return
                try:
                    start = self._run_qp(qp, plan, status, start, deadline)
                finally:
                    self._pool.give_back(peer, qp, not qp.error)
        finally:
            with self._stats_lock:
                self.stats.channels_opened = self._pool.opened
                self.stats.channels_discarded = self._pool.discarded
                self.stats.remote_items += len(plan)

    def _run_qp(self, qp: _QP, plan: BatchPlan, status: np.ndarray, start: int, deadline: float) -> int:
        """Post ``plan.ops[start:]`` on ``qp``; the index to resume from on a fresh QP
        (``len(plan)`` when the batch is finished)."""
        end = len(plan)
        remote = self.fabric.lookup(qp.peer)
        if remote is None or remote._closed:
            qp.error = True
            status[plan.index[start:]] = Status.PEER_UNREACHABLE
            return end
        ops = plan.ops[start:]
        got, pins = remote.regions.acquire_remote(plan.raddr[start:], plan.length[start:], plan.rkey[start:])
        try:
            hook = remote.responder_hook
            if hook is not None:
                try:
                    hook([op.rkey for op in ops])
                except InjectedFault:
                    qp.error = True
                    status[plan.index[start:]] = Status.CHANNEL_ERROR
                    return end
            clock = self.clock
            for k, (op, st) in enumerate(zip(ops, got.tolist(), strict=True), start):
                if self._post():
                    # The QP goes to error and flushes every later work request.
                    qp.error = True
                    status[plan.index[k:]] = Status.CHANNEL_ERROR
                    return end
                if self.delay is not None:
                    dt = self.delay(op)
                    if isinstance(clock, FakeClock):
                        clock.advance(dt)
                if clock() > deadline:
                    # Retry budget exhausted: the WR completes in error and the QP with it.
                    qp.error = True
                    status[plan.index[k:]] = Status.TIMEOUT
                    return end
                status[plan.index[k]] = st
                if st != Status.OK:
                    # A remote access error is fatal to an RC QP; the reader reports this
                    # item and re-posts the flushed rest on a fresh QP.
                    qp.error = True
                    with remote._stats_lock:
                        remote.stats.served_items += k + 1 - start
                    return k + 1
                ctypes.memmove(op.local_addr, op.remote_addr, op.length)
            with remote._stats_lock:
                remote.stats.served_items += len(ops)
            return end
        finally:
            remote.regions.release(pins)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fabric.detach(self._name)
        self._pool.close()


# -- fake verbs -----------------------------------------------------------------------------
# libibverbs' values (enum ibv_qp_state, enum ibv_wc_status), so statuses read the same.
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_ERR = 0, 1, 2, 3, 6
WC_SUCCESS, WC_LOC_PROT_ERR, WC_WR_FLUSH_ERR, WC_REM_ACCESS_ERR, WC_REM_OP_ERR, WC_RETRY_EXC_ERR = 0, 4, 5, 10, 11, 12
# Why read_batch stopped early, as hiradix.transport._verbs reports it.
CAUSE_NONE, CAUSE_REMOTE_ACCESS, CAUSE_CHANNEL, CAUSE_TIMEOUT = 0, 1, 2, 3

_WC_STATUS = {
    WC_REM_ACCESS_ERR: Status.BAD_RKEY,
    WC_LOC_PROT_ERR: Status.BAD_LOCAL,
    WC_RETRY_EXC_ERR: Status.PEER_UNREACHABLE,
}


class FakeMr:
    """A fake memory region: ``lkey == rkey``, an entry of its HCA's MR table."""

    __slots__ = ("_hca", "lkey", "rkey")

    def __init__(self, hca: FakeHca, key: int) -> None:
        self._hca = hca
        self.lkey = self.rkey = key

    def dereg(self, timeout: float | None = None) -> None:
        """Refuse new READs of it at once, then wait for the READs in flight on it (as
        ``ibv_dereg_mr`` returns only once the HCA no longer touches the memory);
        :class:`~hiradix.transport.base.RegionBusyError` after ``timeout``. Idempotent."""
        with contextlib.suppress(KeyError):  # already deregistered
            self._hca.mrs.remove(self.rkey, timeout)


class FakeHca:
    """A fake HCA on a :class:`FakeFabric` (context + protection domain + one port).

    ``responder_hook()`` returns the hook a READ served from this HCA runs first (the
    owning transport's :attr:`~hiradix.transport.base.Transport.responder_hook`), so the
    conformance suite's gates and injected faults reach the fake one-sided path.
    """

    name = "fake_hca0"
    lid = 0
    mtu = 5  # IBV_MTU_4096
    max_qp_wr = 4096

    def __init__(self, fabric: FakeFabric, responder_hook: Callable[[], ResponderHook | None] = lambda: None) -> None:
        self.fabric = fabric
        self.responder_hook = responder_hook
        #: The MR table: rkey checks and in-flight counts, as the HCA enforces them.
        self.mrs = RegionTable()
        #: ``rkey -> seconds`` of virtual time each WR this HCA executes takes (a
        #: :class:`FakeClock` fabric clock advances by it).
        self.delay: Callable[[int], float] | None = None
        #: Most WRs one poll executes (``None``: all posted): chains complete partially.
        self.wrs_per_poll: int | None = None
        self._stall_at: int | None = None
        self.executed = 0
        self._qpns = itertools.count(0x100)
        self._qps: dict[int, FakeQp] = {}
        self._lock = threading.Lock()
        self.closed = False
        self.gid = fabric._attach_hca(self)

    def stall_after(self, n: int) -> None:
        """Execute ``n`` more WRs, then none (a link gone quiet: polls come back empty)."""
        self._stall_at = self.executed + n

    def reg_mr(self, owner: memoryview, addr: int, length: int, remote: bool) -> FakeMr:
        """Register ``owner`` (``length`` bytes at ``addr``); ``remote`` allows READs."""
        if self.closed:
            raise OSError(errno.ENODEV, "fake HCA is closed")
        if owner.nbytes != length:
            raise ValueError("owner must span exactly the registered bytes")
        return FakeMr(self, self.mrs.add(addr, owner, remote).rkey)

    def create_qp(self, depth: int, psn: int) -> FakeQp:
        """A new RC queue pair in INIT with ``depth`` send WRs at most outstanding."""
        if self.closed:
            raise OSError(errno.ENODEV, "fake HCA is closed")
        qp = FakeQp(self, next(self._qpns), min(depth, self.max_qp_wr), psn)
        with self._lock:
            self._qps[qp.qp_num] = qp
        return qp

    def qp(self, qp_num: int) -> FakeQp | None:
        with self._lock:
            return self._qps.get(qp_num)

    def _forget(self, qp_num: int) -> None:
        with self._lock:
            self._qps.pop(qp_num, None)

    def close(self) -> None:
        """Unplug: every queue pair goes to ERR, peers' READs find nobody. Idempotent."""
        self.closed = True
        self.fabric.detach_hca(self.gid)
        with self._lock:
            qps = list(self._qps.values())
        for qp in qps:
            qp.state = QPS_ERR


class _Chain:
    """One posted chain: the pins that keep its regions in flight until its last WR is
    done (executed or flushed), as a responder pins a frame before serving it."""

    __slots__ = ("left", "lpins", "peer", "rpins")

    def __init__(self, peer: FakeHca | None, rpins: Pins, lpins: Pins, left: int) -> None:
        self.peer = peer
        self.rpins = rpins
        self.lpins = lpins
        self.left = left


# A posted WR: wr_id, laddr, raddr, length, rkey, signalled, remote check, local check, chain.
_Wr = tuple[int, int, int, int, int, bool, int, bool, _Chain]


class FakeQp:
    """A fake RC queue pair with a send queue of ``depth`` WRs and its own CQ.

    A posted WR counts as a read in flight at once: its remote and local regions are
    checked and pinned when it is posted (so ``dereg`` waits for it), and it moves its
    bytes when a poll lets the HCA execute it.
    """

    def __init__(self, hca: FakeHca, qp_num: int, depth: int, psn: int) -> None:
        self.hca = hca
        self.qp_num = qp_num
        self.depth = depth
        self.psn = psn & 0xFFFFFF
        self.state = QPS_INIT
        self.remote: tuple[bytes, int] | None = None
        self._sq: deque[_Wr] = deque()
        self._cq: deque[tuple[int, int]] = deque()
        #: Most WRs ever outstanding at once (flow-control tests read it).
        self.max_outstanding = 0
        self.posts = 0  # ibv_post_send calls that posted

    def desc(self) -> tuple[int, int, int, bytes, int]:
        """``(qp_num, psn, lid, gid, mtu)`` for the peer."""
        return (self.qp_num, self.psn, self.hca.lid, self.hca.gid, self.hca.mtu)

    def reset(self, psn: int) -> None:
        """Any state -> RESET -> INIT; posted WRs and completions are dropped."""
        self._flush(record=False)
        self._cq.clear()
        self.remote = None
        self.psn = psn & 0xFFFFFF
        self.state = QPS_INIT

    def connect(self, qp_num: int, psn: int, lid: int, gid: bytes, mtu: int) -> None:
        """INIT -> RTR -> RTS towards ``(gid, qp_num)``."""
        if self.state != QPS_INIT:
            raise OSError(errno.EINVAL, f"queue pair {self.qp_num} is not in INIT (state {self.state})")
        if len(gid) != 16:
            raise ValueError("gid must be 16 bytes")
        self.remote = (gid, qp_num)
        self.state = QPS_RTS

    def _peer(self) -> tuple[FakeHca | None, FakeQp | None]:
        peer = None if self.remote is None else self.hca.fabric.hca(self.remote[0])
        rqp = None if peer is None or self.remote is None else peer.qp(self.remote[1])
        return peer, rqp

    def post_send(self, wrs: list[tuple[int, int, int, int, int, bool]]) -> int:
        """Post a chain of ``(wr_id, laddr, raddr, length, rkey, signalled)`` READs; 0 or
        an errno (nothing posted): ``EINVAL`` before RTS, ``ENOMEM`` past the depth."""
        if self.state not in (QPS_RTS, QPS_ERR):
            return errno.EINVAL
        if len(self._sq) + len(wrs) > self.depth:
            return errno.ENOMEM
        self.posts += 1
        if self.state == QPS_ERR:
            self._cq.extend((wr[0], WC_WR_FLUSH_ERR) for wr in wrs)
            return 0
        u64 = np.uint64
        cols = np.array([wr[1:5] for wr in wrs], dtype=u64).reshape(-1, 4)
        lok, lpins = self.hca.mrs.acquire_local(cols[:, 0].copy(), cols[:, 2].copy())
        peer, _ = self._peer()
        if peer is not None:
            rst, rpins = peer.mrs.acquire_remote(cols[:, 1].copy(), cols[:, 2].copy(), cols[:, 3].astype(np.uint32))
        else:
            rst, rpins = np.full(len(wrs), Status.PEER_UNREACHABLE, dtype=np.uint8), Pins()
        chain = _Chain(peer, rpins, lpins, len(wrs))
        for wr, r, lo in zip(wrs, rst.tolist(), lok.tolist(), strict=True):
            self._sq.append((*wr, r, lo, chain))
        self.max_outstanding = max(self.max_outstanding, len(self._sq))
        return 0

    def _done(self, wr: _Wr) -> None:
        chain = wr[8]
        chain.left -= 1
        if chain.left == 0:
            if chain.peer is not None:
                chain.peer.mrs.release(chain.rpins)
            self.hca.mrs.release(chain.lpins)

    def _flush(self, record: bool = True) -> None:
        """Every WR still queued completes with ``WR_FLUSH_ERR`` (signalled or not)."""
        while self._sq:
            wr = self._sq.popleft()
            if record:
                self._cq.append((wr[0], WC_WR_FLUSH_ERR))
            self._done(wr)

    def poll_cq(self, max_entries: int) -> list[tuple[int, int]]:
        """Let the HCA execute posted WRs (``wrs_per_poll`` at most), then take up to
        ``max_entries`` completions ``(wr_id, wc_status)``, oldest first."""
        hca = self.hca
        budget = hca.wrs_per_poll if hca.wrs_per_poll is not None else len(self._sq)
        while self._sq and budget > 0 and (hca._stall_at is None or hca.executed < hca._stall_at):
            budget -= 1
            hca.executed += 1
            wr = self._sq.popleft()
            try:
                wc = self._execute(wr)
            finally:
                self._done(wr)
            if wc != WC_SUCCESS:
                # RC: the QP goes to ERR, the failing WR completes with its error
                # (signalled or not) and every WR after it is flushed.
                self.state = QPS_ERR
                self._cq.append((wr[0], wc))
                self._flush()
            elif wr[5]:
                self._cq.append((wr[0], WC_SUCCESS))
        out: list[tuple[int, int]] = []
        while self._cq and len(out) < max_entries:
            out.append(self._cq.popleft())
        return out

    def _execute(self, wr: _Wr) -> int:
        """One posted READ; its work-completion status."""
        _, laddr, raddr, length, rkey, _, rst, lok, _ = wr
        peer, rqp = self._peer()
        if peer is None or rqp is None or rqp.state not in (QPS_RTR, QPS_RTS):
            return WC_RETRY_EXC_ERR  # nobody ACKs: the retry budget runs out
        if not lok:
            return WC_LOC_PROT_ERR
        if rst != Status.OK:
            return WC_REM_ACCESS_ERR
        hook = peer.responder_hook()
        if hook is not None:
            try:
                hook([rkey])
            except InjectedFault:
                rqp.state = QPS_ERR
                return WC_REM_OP_ERR
        fabric = self.hca.fabric
        if self.hca.delay is not None and isinstance(fabric.clock, FakeClock):
            fabric.clock.advance(self.hca.delay(rkey))
        ctypes.memmove(laddr, raddr, length)
        return WC_SUCCESS

    def read_batch(
        self,
        laddr: np.ndarray,
        raddr: np.ndarray,
        length: np.ndarray,
        rkey: np.ndarray,
        lkey: np.ndarray,
        status: np.ndarray,
        signal_every: int,
        timeout: float,
    ) -> tuple[int, int]:
        """The Python twin of ``hiradix.transport._verbs.QueuePair.read_batch``: the same
        window (at most :attr:`depth` outstanding), signalling, wr_id matching, statuses
        and ``(first_bad, cause)``, on the fabric's clock.

        Runtime complexity: ``O(n)`` work requests.
        """
        n = len(laddr)
        if self.state != QPS_RTS:
            raise OSError(errno.EINVAL, f"queue pair is not ready to send (state {self.state})")
        if n == 0:
            return 0, CAUSE_NONE
        clock = self.hca.fabric.clock
        deadline = clock() + timeout
        cols = (laddr.tolist(), raddr.tolist(), length.tolist(), rkey.tolist())
        status[:] = Status.CHANNEL_ERROR  # what a flushed or never-posted item reports
        posted = done = 0
        first_bad, cause, stopped = n, CAUSE_NONE, False
        while done < posted or (not stopped and posted < n):
            if not stopped and posted < n and posted - done < self.depth:
                m = min(self.depth - (posted - done), n - posted)
                last = posted + m - 1
                chain = [
                    (i, cols[0][i], cols[1][i], cols[2][i], cols[3][i], (i + 1) % signal_every == 0 or i == last)
                    for i in range(posted, posted + m)
                ]
                if self.post_send(chain):
                    stopped, first_bad, cause = True, min(first_bad, posted), CAUSE_CHANNEL
                else:
                    posted += m
            got = self.poll_cq(32)
            for idx, wc in got:
                if idx < done or idx >= posted:
                    continue
                if wc == WC_SUCCESS:
                    status[done : min(idx + 1, first_bad)] = Status.OK
                elif wc != WC_WR_FLUSH_ERR and idx < first_bad:
                    status[done:idx] = Status.OK
                    status[idx] = _WC_STATUS.get(wc, Status.CHANNEL_ERROR)
                    first_bad = idx
                    cause = CAUSE_REMOTE_ACCESS if wc == WC_REM_ACCESS_ERR else CAUSE_CHANNEL
                    stopped = True
                elif first_bad == n:
                    first_bad, cause, stopped = done, CAUSE_CHANNEL, True
                done = idx + 1
            if not got:
                os.sched_yield()  # a stalled fake HCA: give the core away while waiting
            if (done < posted or (posted < n and not stopped)) and clock() > deadline:
                if cause != CAUSE_NONE and stopped:
                    break
                # Move to ERR so nothing lands after we return; the rest comes back flushed.
                self.state = QPS_ERR
                self._flush()
                status[done:] = Status.TIMEOUT
                first_bad, cause, stopped = min(first_bad, done), CAUSE_TIMEOUT, True
                deadline = clock() + 2.0
        if cause != CAUSE_NONE:
            self.state = QPS_ERR
        return first_bad, cause

    def close(self) -> None:
        """Destroy the queue pair (peers' READs on it find nobody). Idempotent."""
        self.state = QPS_ERR
        self._flush(record=False)
        self.hca._forget(self.qp_num)


class FakeVerbs:
    """The fake verbs provider: opens :class:`FakeHca`\\ s on ``fabric``."""

    kind = "fake"

    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        self.hcas: list[FakeHca] = []

    def unavailable_reason(self) -> str | None:
        """Always available."""
        return None

    def open(
        self, name: str | None, ib_port: int, gid_index: int, responder_hook: Callable[[], ResponderHook | None]
    ) -> FakeHca:
        """A new fake HCA (``name``, port and GID index are accepted and ignored)."""
        hca = FakeHca(self.fabric, responder_hook)
        self.hcas.append(hca)
        return hca
