"""Per-peer pools of channels (connections, queue pairs...), at most ``cap`` per peer:
the RPC client's connections and every transport's channels."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ChannelPool", "PoolClosedError"]


class PoolClosedError(ConnectionError):
    """A lease on a pool that was closed."""


C = TypeVar("C")


class ChannelPool(Generic[C]):
    """Per-peer pools of channels, at most ``cap`` channels per peer.

    A channel is leased for one operation and given back with ``ok=True`` (reused) or
    ``ok=False`` (closed and discarded; the next lease opens a new one). Channels are
    opened lazily by ``connect(peer, timeout)``; a lease beyond the cap waits for a give-back.
    """

    def __init__(
        self,
        connect: Callable[[Any, float | None], C],
        close: Callable[[C], None],
        cap: int,
        closed_error: Callable[[str], Exception] = PoolClosedError,
    ) -> None:
        """``closed_error(message)`` is what a lease on a closed pool raises (a transport
        passes its own error class)."""
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"max channels per peer must be a positive int, got {cap!r}")
        self._connect = connect
        self._close = close
        self._closed_error = closed_error
        self.cap = cap
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._free: dict[Any, list[C]] = {}
        self._open: dict[Any, int] = {}
        self._closed = False
        self.opened = 0
        self.discarded = 0

    def open_count(self, peer: Any) -> int:
        """Channels currently open to ``peer`` (leased or idle)."""
        with self._lock:
            return self._open.get(peer, 0)

    def lease(self, peer: Any, timeout: float | None) -> C:
        """A channel to ``peer``: an idle one, a new one under the cap, or the next one
        given back. Raises ``TimeoutError`` when ``timeout`` passes first, and whatever
        ``connect`` raises (the slot is then released).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise self._closed_error("channel pool is closed")
                free = self._free.get(peer)
                if free:
                    return free.pop()
                if self._open.get(peer, 0) < self.cap:
                    self._open[peer] = self._open.get(peer, 0) + 1
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no free channel to {peer!r}")
                self._cond.wait(remaining)
        try:
            ch = self._connect(peer, None if deadline is None else max(deadline - time.monotonic(), 0.001))
        except BaseException:
            with self._lock:
                self._open[peer] -= 1
                self._cond.notify()
            raise
        with self._lock:
            self.opened += 1
        return ch

    def give_back(self, peer: Any, ch: C, ok: bool) -> None:
        """Return a leased channel; ``ok=False`` closes and discards it."""
        with self._lock:
            keep = ok and not self._closed
            if keep:
                self._free.setdefault(peer, []).append(ch)
            else:
                self._open[peer] -= 1
                if not ok:
                    self.discarded += 1
            self._cond.notify()
        if not keep:
            with contextlib.suppress(OSError):
                self._close(ch)

    def close(self) -> None:
        """Close every idle channel; leased ones are closed when given back."""
        with self._lock:
            self._closed = True
            idle = [ch for chans in self._free.values() for ch in chans]
            for peer, chans in self._free.items():
                self._open[peer] -= len(chans)
            self._free.clear()
            self._cond.notify_all()
        for ch in idle:
            with contextlib.suppress(OSError):
                self._close(ch)
