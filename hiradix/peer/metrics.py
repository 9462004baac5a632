"""Peer-cache metrics: Prometheus exposition and a small HTML dashboard.

Everything lives on a private :class:`~prometheus_client.CollectorRegistry` owned by the
:class:`PeerMetrics` instance, never the process-global one, so several caches (or tests) in
one process do not collide and importing hiradix registers nothing globally.

Exposed (prefix ``hiradix_peer_``):

- ``pool_used_bytes``, ``pool_capacity_bytes``, ``pool_keys``, ``disk_used_bytes``,
  ``disk_capacity_bytes``, ``disk_keys``: gauges read at scrape time from bound callables;
- ``read_requests_total``, ``read_hits_total``, ``read_bytes_total``,
  ``write_requests_total``, ``write_bytes_total``, ``evictions_total{tier}``,
  ``promotes_total``: counters (use ``rate()`` for windows);
- ``read_hit_rate``: hits / requests since start;
- ``op_latency_seconds{op, quantile}``: a summary with ``p50/p90/p99`` over a bounded
  reservoir of the most recent observations, plus ``_sum`` and ``_count`` over all of them.

:class:`MetricsServer` serves ``/metrics`` (text exposition) and ``/`` (an auto-refreshing,
dependency-free HTML page of the same numbers) from a stdlib ``ThreadingHTTPServer`` thread,
bound to ``127.0.0.1`` by default.
"""

from __future__ import annotations

import html
import logging
import math
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

__all__ = ["QUANTILES", "LatencyReservoir", "MetricsServer", "PeerMetrics"]

log = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
PREFIX = "hiradix_peer"
TierStats = Callable[[], tuple[int, int, int]]  # (used_bytes, capacity_bytes, keys)


class LatencyReservoir:
    """The last ``size`` observations in a ring buffer, plus all-time count and sum.

    Quantiles are computed at scrape time by sorting a copy: ``O(size log size)`` per
    scrape, ``O(1)`` per observation. A sliding window rather than a random reservoir, so
    the quantiles follow the current load.

    >>> r = LatencyReservoir(4)
    >>> for v in (1.0, 2.0, 3.0, 4.0, 5.0): r.observe(v)
    >>> r.quantiles((0.5,)), r.count, r.total
    ([3.5], 5, 15.0)
    """

    def __init__(self, size: int = 4096) -> None:
        if size < 1:
            raise ValueError(f"reservoir size must be >= 1, got {size}")
        self.size = size
        self._buf: list[float] = []
        self._next = 0
        self._lock = threading.Lock()
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Record one observation. Runtime complexity: ``O(1)``."""
        with self._lock:
            if len(self._buf) < self.size:
                self._buf.append(value)
            else:
                self._buf[self._next] = value
            self._next = (self._next + 1) % self.size
            self.count += 1
            self.total += value

    def quantiles(self, qs: tuple[float, ...] = QUANTILES) -> list[float]:
        """Linear-interpolated quantiles of the window (``nan`` when empty).

        Runtime complexity: ``O(size log size)``.
        """
        with self._lock:
            data = sorted(self._buf)
        if not data:
            return [math.nan] * len(qs)
        out = []
        for q in qs:
            pos = q * (len(data) - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, len(data) - 1)
            out.append(data[lo] + (data[hi] - data[lo]) * (pos - lo))
        return out


class _LatencyCollector(Collector):
    def __init__(self, reservoirs: dict[str, LatencyReservoir]) -> None:
        self._reservoirs = reservoirs

    def collect(self) -> Iterator[Metric]:
        name = f"{PREFIX}_op_latency_seconds"
        m = Metric(name, "Operation latency: quantiles over the recent window, sum/count over all.", "summary")
        for op, res in self._reservoirs.items():
            for q, v in zip(QUANTILES, res.quantiles(QUANTILES), strict=True):
                m.add_sample(name, {"op": op, "quantile": str(q)}, v)
            m.add_sample(f"{name}_sum", {"op": op}, res.total)
            m.add_sample(f"{name}_count", {"op": op}, float(res.count))
        yield m


class PeerMetrics:
    """Counters, gauges and latency summaries of one peer cache, on a private registry.

    Parameters
    ----------
    reservoir_size:
        Observations kept per operation for the latency quantiles.
    """

    def __init__(self, reservoir_size: int = 4096) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lock = threading.Lock()
        self._requests = self._hits = 0

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        self.read_requests = counter("read_requests", "Pages asked for by get/batch_get.")
        self.read_hits = counter("read_hits", "Pages found and verified.")
        self.read_bytes = counter("read_bytes", "Bytes of pages read.")
        self.write_requests = counter("write_requests", "Pages written by set/batch_set.")
        self.write_bytes = counter("write_bytes", "Bytes of pages written.")
        self.evictions = counter("evictions", "Pages evicted, by tier.", ("tier",))
        self.promotes = counter("promotes", "Pages promoted from disk into the pool.")
        self._tiers: dict[str, TierStats] = {}
        for tier in ("pool", "disk"):
            for i, (what, doc) in enumerate(
                (("used_bytes", "Bytes held"), ("capacity_bytes", "Capacity in bytes"), ("keys", "Pages held"))
            ):
                g = Gauge(f"{PREFIX}_{tier}_{what}", f"{doc} by the {tier} tier.", registry=r)
                g.set_function(self._tier_reader(tier, i))
        hit_rate = Gauge(f"{PREFIX}_read_hit_rate", "Read hits / read requests since start.", registry=r)
        hit_rate.set_function(self.hit_rate)
        self.latency = {"read": LatencyReservoir(reservoir_size), "write": LatencyReservoir(reservoir_size)}
        r.register(_LatencyCollector(self.latency))

    def _tier_reader(self, tier: str, index: int) -> Callable[[], float]:
        def read() -> float:
            fn = self._tiers.get(tier)
            return float(fn()[index]) if fn is not None else 0.0

        return read

    # ------------------------------------------------------------------ binding
    def track(self, tier: str, stats: TierStats) -> None:
        """Read ``tier``'s (``"pool"`` or ``"disk"``) ``(used_bytes, capacity_bytes, keys)``
        from ``stats()`` at every scrape, e.g.
        ``m.track("pool", lambda: (pool.used_bytes, pool.capacity_bytes, len(pool)))``.
        """
        if tier not in ("pool", "disk"):
            raise ValueError(f"tier must be 'pool' or 'disk', got {tier!r}")
        self._tiers[tier] = stats

    # ------------------------------------------------------------------ recording
    def record_read(self, requested: int, hits: int, nbytes: int, seconds: float) -> None:
        """One (batch) read: pages asked for, pages served, bytes served, latency.

        Runtime complexity: ``O(1)``.
        """
        if hits > requested or min(requested, hits, nbytes) < 0:
            raise ValueError(f"bad read record: requested={requested} hits={hits} nbytes={nbytes}")
        with self._lock:  # our own pair, so the ratio is never torn between two counters
            self._requests += requested
            self._hits += hits
        self.read_requests.inc(requested)
        self.read_hits.inc(hits)
        self.read_bytes.inc(nbytes)
        self.latency["read"].observe(seconds)

    def record_write(self, pages: int, nbytes: int, seconds: float) -> None:
        """One (batch) write. Runtime complexity: ``O(1)``."""
        self.write_requests.inc(pages)
        self.write_bytes.inc(nbytes)
        self.latency["write"].observe(seconds)

    def record_eviction(self, tier: str, n: int = 1) -> None:
        """``n`` pages evicted from ``tier``. Runtime complexity: ``O(1)``."""
        self.evictions.labels(tier=tier).inc(n)

    def record_promote(self, n: int = 1) -> None:
        """``n`` pages promoted from disk. Runtime complexity: ``O(1)``."""
        self.promotes.inc(n)

    def hit_rate(self) -> float:
        """Read hits over read requests since start (0 before the first read)."""
        with self._lock:
            return self._hits / self._requests if self._requests else 0.0

    def exposition(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ dashboard
    def dashboard_html(self, refresh_s: int = 2) -> str:
        """A self-contained HTML page of the current values (no scripts, no external files)."""

        def fmt(v: float) -> str:
            if math.isnan(v):
                return "–"
            return f"{v:.6g}"

        def lat(op: str) -> str:
            res = self.latency[op]
            qs = res.quantiles(QUANTILES)
            avg = res.total / res.count if res.count else math.nan
            cells = "".join(f"<td>{fmt(v * 1e3)}</td>" for v in [*qs, avg])
            return f"<tr><th>{op}</th>{cells}<td>{res.count}</td></tr>"

        rows = []
        for fam in self.registry.collect():
            for s in fam.samples:
                labels = ", ".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                rows.append(
                    f"<tr><td>{html.escape(s.name)}</td><td>{html.escape(labels)}</td><td>{fmt(s.value)}</td></tr>"
                )
        return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{int(refresh_s)}">
<title>hiradix peer cache</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child,th:first-child{{text-align:left}}</style>
</head><body><h1>hiradix peer cache</h1>
<table><tr><th>read hit rate</th><td>{fmt(self.hit_rate())}</td></tr></table>
<h2>Latency (ms)</h2>
<table><tr><th>op</th><th>p50</th><th>p90</th><th>p99</th><th>avg</th><th>count</th></tr>
{lat("read")}
{lat("write")}</table>
<h2>All metrics</h2>
<table><tr><th>name</th><th>labels</th><th>value</th></tr>
{"".join(rows)}</table>
<p>Prometheus: <a href="/metrics">/metrics</a></p></body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a slow client may hold a handler thread

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        metrics = self.server.metrics
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, metrics.exposition())
        elif path in ("/", "/index.html") and self.server.dashboard:
            self._send(200, "text/html; charset=utf-8", metrics.dashboard_html().encode("utf-8"))
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], metrics: PeerMetrics, dashboard: bool) -> None:
        self.metrics = metrics
        self.dashboard = dashboard
        super().__init__(addr, _Handler)


class MetricsServer:
    """Serves ``/metrics`` and the dashboard at ``/`` from a background thread.

    Parameters
    ----------
    metrics:
        What to serve.
    host:
        Bind address, loopback by default.
    port:
        TCP port; ``0`` picks a free one (see :attr:`port` after :meth:`start`).
    dashboard:
        Serve the HTML page at ``/`` (``metrics_dashboard``); otherwise ``/`` is a 404.
    """

    def __init__(
        self, metrics: PeerMetrics, host: str = "127.0.0.1", port: int = 31997, dashboard: bool = True
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.dashboard = dashboard
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and start serving; returns the bound port. ``OSError`` if the port is taken."""
        if self._server is not None:
            return self.port
        self._server = _Server((self.host, self.port), self.metrics, self.dashboard)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="hiradix-metrics", daemon=True
        )
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = None
        self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
