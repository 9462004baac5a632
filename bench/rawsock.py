"""The same-run raw socket baseline shared by ``bench/peer.py``, ``bench/peer_others.py`` and
``bench/transport.py``, and the alternating measurement loop around it.

Standard library and numpy only: ``peer_others.py`` imports it from venvs that have PeerCache
or Mooncake installed but not hiradix. ``bench/`` is not a package; the scripts put their own
folder on ``sys.path`` and ``import rawsock``.

The wire protocol is one 16-byte header ``<QQ`` (total, page) per request; the server answers
with ``total`` bytes, one ``sendall`` per page, and the client ``recv_into``\\ s them page by
page, so the baseline moves the same bytes in the same page-sized pieces as the system.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

HEADER = struct.Struct("<QQ")  # total bytes, page bytes


class RawServer:
    """A thread on 127.0.0.1 that answers ``<QQ`` (total, page) requests with the first
    ``total`` bytes of ``pages(page)`` (or ``pages[page]``), one ``sendall`` per page.

    One connection at a time. :meth:`close` (or leaving the ``with`` block) stops it: it
    shuts down a connection still open, joins the thread and closes the listening socket.
    """

    def __init__(self, pages: Mapping[int, Any] | Callable[[int], Any]) -> None:
        self._pages = pages.__getitem__ if isinstance(pages, Mapping) else pages
        self._stop = threading.Event()
        self._conn: socket.socket | None = None
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.5)  # so the accept loop sees _stop
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="rawsock-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # listening socket closed
                return
            with conn:
                self._conn = conn
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    while True:
                        head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                        if len(head) < HEADER.size:
                            break
                        total, page = HEADER.unpack(head)
                        view = memoryview(self._pages(page))
                        for off in range(0, total, page):
                            conn.sendall(view[off : off + page])
                except OSError:  # shut down by close(), or the client went away mid-answer
                    pass
                finally:
                    self._conn = None

    def close(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):  # already gone
                conn.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked on an idle client
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(port: int, timeout: float = 60.0) -> socket.socket:
    """A client socket to a :class:`RawServer` on 127.0.0.1 (``TCP_NODELAY``)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_get(sock: socket.socket, dst: Any, total: int, page: int) -> float:
    """Fetch ``total`` bytes in ``page``-sized pieces into ``dst[:total]`` (``recv_into`` page
    by page); return the seconds taken, header included."""
    view = memoryview(dst)
    t0 = time.perf_counter()
    sock.sendall(HEADER.pack(total, page))
    for off in range(0, total, page):
        v = view[off : off + page]
        got = 0
        while got < page:
            k = sock.recv_into(v[got:])
            if not k:
                raise RuntimeError("raw server closed")
            got += k
    return time.perf_counter() - t0


def measure(
    get: Callable[[], Sequence[Any]],
    sock: socket.socket,
    dst: np.ndarray,
    ref: np.ndarray,
    *,
    page: int,
    n: int,
    warmup: int,
    repeats: int,
    name: str,
    prefix: str = "",
    ok: Any = True,
    clear: slice = slice(None),
    sample: slice = slice(None, None, 4099),
) -> dict[str, Any]:
    """Time the system's ``get()`` of ``n`` pages of ``page`` bytes into ``dst`` against
    :func:`raw_get` of the same bytes over ``sock``, alternating repeat by repeat.

    Before each get ``dst[clear]`` is zeroed (untimed); after it ``dst[sample]`` must equal
    ``ref[sample]`` and every item ``get()`` returns must equal ``ok``. The first ``warmup``
    rounds are not counted. Returns ``page_kib``, ``{prefix}gbps_median``,
    ``{prefix}gbps_best``, ``raw_gbps_median``, ``raw_gbps_best``, ``ratio`` (system
    median over raw median) and ``ratio_paired`` (the median over rounds of system over raw
    within the round: a get and its raw twin run back to back, so a slow minute of the
    shared machine slows both and cancels out, where the ratio of medians can pair a
    fast get with a slow raw transfer).
    """
    nbytes = n * page
    t_sys: list[float] = []
    t_raw: list[float] = []
    for rep in range(warmup + repeats):
        dst[clear] = 0
        t0 = time.perf_counter()
        res = get()
        dt = time.perf_counter() - t0
        hits = list(res).count(ok)
        if hits != n or not np.array_equal(dst[sample], ref[sample]):
            raise RuntimeError(f"{name} get failed at page {page}: {n - hits} misses")
        dst[clear] = 0
        dt_raw = raw_get(sock, dst, nbytes, page)
        if not np.array_equal(dst[sample], ref[sample]):
            raise RuntimeError("raw transfer mismatch")
        if rep >= warmup:
            t_sys.append(dt)
            t_raw.append(dt_raw)
    gb = nbytes / 1e9
    row = {
        "page_kib": page >> 10,
        f"{prefix}gbps_median": gb / statistics.median(t_sys),
        f"{prefix}gbps_best": gb / min(t_sys),
        "raw_gbps_median": gb / statistics.median(t_raw),
        "raw_gbps_best": gb / min(t_raw),
    }
    row["ratio"] = row[f"{prefix}gbps_median"] / row["raw_gbps_median"]
    row["ratio_paired"] = statistics.median(r / s for s, r in zip(t_sys, t_raw, strict=True))
    return row


def exists_latency(fn: Callable[[list[str]], int], keys: list[str], reps: int, warmup: int = 50) -> dict[str, Any]:
    """p50 / p99 of ``fn`` over windows of 128 of ``keys`` (all must hit), ``reps`` calls
    after ``warmup``."""
    lat: list[float] = []
    for i in range(warmup + reps):
        s = (i * 128) % max(1, len(keys) - 128)
        t0 = time.perf_counter()
        hit = fn(keys[s : s + 128])
        dt = time.perf_counter() - t0
        if hit != 128:
            raise RuntimeError(f"exists returned {hit}")
        if i >= warmup:
            lat.append(dt)
    lat.sort()
    return {
        "keys": 128,
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        "reps": len(lat),
    }
