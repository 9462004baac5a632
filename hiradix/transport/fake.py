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
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from hiradix.transport.base import (
    Capabilities,
    ChannelPool,
    InjectedFault,
    ReadOp,
    Status,
    Transport,
    _BatchPlan,
)

__all__ = ["FakeClock", "FakeFabric", "FakeTransport"]


class FakeClock:
    """A manual monotonic clock: ``clock()`` reads it, ``advance(dt)`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

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
        self._pool: ChannelPool[_QP] = ChannelPool(self._connect, lambda qp: None, max_channels_per_peer)
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

    def _read_remote(self, peer: str, plan: _BatchPlan, status: np.ndarray, deadline: float) -> None:
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

    def _run_qp(self, qp: _QP, plan: _BatchPlan, status: np.ndarray, start: int, deadline: float) -> int:
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
