"""Peer-cache metrics: Prometheus exposition and a small HTML dashboard.

Everything lives on a private :class:`~prometheus_client.CollectorRegistry` owned by the
:class:`PeerMetrics` instance, never the process-global one, so several caches (or tests) in
one process do not collide and importing hiradix registers nothing globally.

Exposed (prefix ``hiradix_peer_``):

- ``pool_used_bytes``, ``pool_capacity_bytes``, ``pool_keys``, ``disk_used_bytes``,
  ``disk_capacity_bytes``, ``disk_keys``: gauges read at scrape time from bound callables;
- ``read_requests_total``, ``read_hits_total``, ``read_bytes_total``,
  ``write_requests_total``, ``write_bytes_total``, ``evictions_total{tier}``,
  ``promotes_total``, ``background_errors_total{kind}`` (background work that raised:
  heartbeat, probe or sync rounds, re-publishes, hand-offs, warm-ups, disk callbacks; the
  node's ``status()["background_errors"]``): counters (use ``rate()`` for windows);
- ``read_hit_rate``: hits / requests since start;
- ``op_latency_seconds{op, quantile}``: a summary with ``p50/p90/p99`` over a bounded
  reservoir of the most recent observations, plus ``_sum`` and ``_count`` over all of them;
- once a node is bound (:meth:`PeerMetrics.bind_node`): ``info{node_id}`` (always 1),
  ``ready`` (1 or 0) and ``members`` (live members in this node's view).

:class:`MetricsServer` serves, from a stdlib ``ThreadingHTTPServer`` thread bound to
``127.0.0.1`` by default:

- ``/metrics``: the text exposition, for Prometheus (``examples/prometheus.yml``) and
  Grafana (``examples/grafana-dashboard.json``);
- ``/ready``: ``200 ready`` when the bound node is ready, ``503 not ready`` otherwise (and
  before a node is bound), for load balancers and orchestrators;
- ``/``: the operator's page, self-contained (no scripts, no external files) and refreshed
  every few seconds: node id, readiness, members, pool and disk usage in GiB, read and
  write totals, latency quantiles, and the hit rate over time as an inline SVG chart drawn
  from a ring buffer of samples (:class:`HitRateHistory`, one sample every
  ``sample_s`` seconds, taken by the server thread).

The metrics port is fixed by default (31997, the seed's), so that scrape configs can name
it; a second node on one host passes another port or ``0`` (any free port).
"""

from __future__ import annotations

import html
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

__all__ = ["QUANTILES", "HitRateHistory", "LatencyReservoir", "MetricsServer", "PeerMetrics"]

log = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
PREFIX = "hiradix_peer"
TierStats = Callable[[], tuple[int, int, int]]  # (used_bytes, capacity_bytes, keys)
GiB = float(1 << 30)


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


class HitRateHistory:
    """The last ``size`` samples of the cumulative ``(requests, hits)`` counters, and the
    hit rate of each interval between two samples (a ring buffer: ``O(size)`` memory).

    >>> h = HitRateHistory(3)
    >>> for t, req, hit in ((0, 0, 0), (5, 10, 5), (10, 10, 5), (15, 30, 25)): h.add(t, req, hit)
    >>> h.rates()
    [(10.0, None), (15.0, 1.0)]
    """

    def __init__(self, size: int = 360) -> None:
        if size < 2:
            raise ValueError(f"history size must be >= 2, got {size}")
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, t: float, requests: int, hits: int) -> None:
        """Record the cumulative counters at time ``t`` (seconds). Runtime: ``O(1)``."""
        with self._lock:
            self._samples.append((float(t), int(requests), int(hits)))

    def last_time(self) -> float | None:
        """Time of the newest sample, or ``None``."""
        with self._lock:
            return self._samples[-1][0] if self._samples else None

    def rates(self) -> list[tuple[float, float | None]]:
        """``(end time, hits / requests)`` of every interval, oldest first; ``None`` for an
        interval without reads (or across a counter reset). Runtime: ``O(size)``."""
        with self._lock:
            samples = list(self._samples)
        out: list[tuple[float, float | None]] = []
        for (_, r0, h0), (t1, r1, h1) in itertools.pairwise(samples):
            dr, dh = r1 - r0, h1 - h0
            out.append((t1, dh / dr if dr > 0 and 0 <= dh <= dr else None))
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
    history_size:
        Hit-rate samples kept for the dashboard's chart (:meth:`sample`).
    """

    def __init__(self, reservoir_size: int = 4096, history_size: int = 360) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lock = threading.Lock()
        self._requests = self._hits = 0
        self.history = HitRateHistory(history_size)
        self.node_id: str | None = None
        self._ready: Callable[[], bool] | None = None
        self._members: Callable[[], Sequence[str]] | None = None

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        self.read_requests = counter("read_requests", "Pages asked for by get/batch_get.")
        self.read_hits = counter("read_hits", "Pages found and verified.")
        self.read_bytes = counter("read_bytes", "Bytes of pages read.")
        self.write_requests = counter("write_requests", "Pages written by set/batch_set.")
        self.write_bytes = counter("write_bytes", "Bytes of pages written.")
        self.evictions = counter("evictions", "Pages evicted, by tier.", ("tier",))
        self.promotes = counter("promotes", "Pages promoted from disk into the pool.")
        self.background_errors = counter(
            "background_errors", "Background work that raised (it is logged and goes on), by kind.", ("kind",)
        )
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
        self._info = Gauge(f"{PREFIX}_info", "This node (always 1; the node id is a label).", ("node_id",), registry=r)
        ready = Gauge(f"{PREFIX}_ready", "1 when the node is ready to serve (see /ready), else 0.", registry=r)
        ready.set_function(lambda: float(self.is_ready()))
        members = Gauge(f"{PREFIX}_members", "Live members in this node's view (itself included).", registry=r)
        members.set_function(lambda: float(len(self.members())))

    def _tier_reader(self, tier: str, index: int) -> Callable[[], float]:
        def read() -> float:
            fn = self._tiers.get(tier)
            return float(fn()[index]) if fn is not None else 0.0

        return read

    # ------------------------------------------------------------------ binding
    def bind_node(self, node_id: str, ready: Callable[[], bool], members: Callable[[], Sequence[str]]) -> None:
        """Name the node these metrics belong to and how to ask it whether it is ready and
        who its live members are (both called at scrape and page time; an exception there
        reads as not ready / no members, never a failed scrape)."""
        self.node_id = node_id
        self._info.labels(node_id=node_id).set(1)
        self._ready = ready
        self._members = members

    def is_ready(self) -> bool:
        """The bound node's readiness; ``False`` before :meth:`bind_node`."""
        if self._ready is None:
            return False
        try:
            return bool(self._ready())
        except Exception:  # a scrape must not fail on it: not ready
            log.debug("readiness check failed", exc_info=True)
            return False

    def members(self) -> list[str]:
        """The bound node's live members (empty before :meth:`bind_node`)."""
        if self._members is None:
            return []
        try:
            return list(self._members())
        except Exception:  # a scrape must not fail on it
            log.debug("members query failed", exc_info=True)
            return []

    def tier(self, tier: str) -> tuple[int, int, int] | None:
        """``(used_bytes, capacity_bytes, keys)`` of a tracked tier, or ``None``."""
        fn = self._tiers.get(tier)
        return None if fn is None else fn()

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

    def record_background_error(self, kind: str) -> None:
        """One failure of background work of ``kind`` (``"heartbeat"``, ``"republish"``,
        ...). Runtime complexity: ``O(1)``."""
        self.background_errors.labels(kind=kind).inc()

    def hit_rate(self) -> float:
        """Read hits over read requests since start (0 before the first read)."""
        with self._lock:
            return self._hits / self._requests if self._requests else 0.0

    def sample(self, now: float) -> None:
        """Add the current read counters to :attr:`history` at time ``now`` (seconds; the
        metrics server calls this every ``sample_s``). Runtime complexity: ``O(1)``."""
        with self._lock:
            requests, hits = self._requests, self._hits
        self.history.add(now, requests, hits)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ dashboard
    def dashboard_html(self, refresh_s: int = 5) -> str:
        """The operator's page (module docstring): self-contained HTML, no scripts, no
        external files. Runtime complexity: ``O(history + members)``."""
        return _render_dashboard(self, refresh_s)


def _fmt(v: float, digits: int = 3) -> str:
    return "–" if math.isnan(v) else f"{v:.{digits}g}"


def _usage_row(name: str, stats: tuple[int, int, int] | None) -> str:
    if stats is None:
        return f"<tr><th>{name}</th><td colspan=3 class=dim>disabled</td></tr>"
    used, cap, keys = stats
    frac = used / cap if cap else 0.0
    bar = f'<div class=bar><div style="width:{min(frac, 1.0) * 100:.1f}%"></div></div>'
    return (
        f"<tr><th>{name}</th><td>{used / GiB:.2f} / {cap / GiB:.2f} GiB</td>"
        f"<td>{bar} {frac * 100:.0f}%</td><td>{keys:,} pages</td></tr>"
    )


def _hit_rate_svg(points: list[tuple[float, float | None]], width: int = 640, height: int = 180) -> str:
    """The hit rate per interval as an inline SVG line chart, 0..100 %, time to the right.
    Intervals without reads break the line (a gap, not a fake zero)."""
    left, right, top, bottom = 44, 10, 10, 24
    w, h = width - left - right, height - top - bottom
    parts = [
        f'<svg id="hit-rate-chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="read hit rate over time">',
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for pct in (0, 25, 50, 75, 100):
        y = top + h * (1 - pct / 100)
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{pct}%</text>')
    if points:
        t0, t1 = points[0][0], points[-1][0]
        span = max(t1 - t0, 1e-9)
        for frac, label in ((0.0, f"-{(t1 - t0) / 60:.1f} min"), (1.0, "now")):
            x = left + w * frac
            anchor = "start" if frac == 0 else "end"
            parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="{anchor}">{label}</text>')
        runs: list[list[str]] = [[]]
        for t, rate in points:
            if rate is None:
                if runs[-1]:
                    runs.append([])
                continue
            x = left + (w * (t - t0) / span if len(points) > 1 else w)
            runs[-1].append(f"{x:.1f},{top + h * (1 - rate):.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="#1f77b4"/>')
            elif run:
                pts = " ".join(run)
                parts.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    else:
        parts.append(
            f'<text x="{left + w / 2}" y="{top + h / 2}" text-anchor="middle" class="dim">no samples yet</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _render_dashboard(m: PeerMetrics, refresh_s: int) -> str:
    node = html.escape(m.node_id or "(not started)")
    ready = m.is_ready()
    members = m.members()
    badge = '<span class="badge ok">ready</span>' if ready else '<span class="badge no">not ready</span>'
    member_items = "".join(
        f"<li>{html.escape(x)}{' <b>(this node)</b>' if x == m.node_id else ''}</li>" for x in members
    )

    def lat(op: str) -> str:
        res = m.latency[op]
        qs = res.quantiles(QUANTILES)
        avg = res.total / res.count if res.count else math.nan
        cells = "".join(f"<td>{_fmt(v * 1e3)}</td>" for v in [*qs, avg])
        return f"<tr><th>{op}</th>{cells}<td>{res.count:,}</td></tr>"

    def total(name: str) -> float:
        return m.registry.get_sample_value(f"{PREFIX}_{name}_total") or 0.0

    rates = m.history.rates()
    recent = [r for _, r in rates if r is not None]
    last = f"{recent[-1] * 100:.1f}%" if recent else "–"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{int(refresh_s)}">
<title>hiradix peer {node}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:60em}}
h1{{font-size:1.4em;margin:0 0 .2em}} h2{{font-size:1.1em;margin:1.4em 0 .4em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ddd;padding:3px 10px;text-align:right}}
th:first-child{{text-align:left}} .dim{{color:#888}} text{{font:11px system-ui,sans-serif;fill:#555}}
.badge{{padding:2px 8px;border-radius:4px;color:#fff;font-weight:600}} .ok{{background:#2a9d4b}}
.no{{background:#c0392b}} .bar{{display:inline-block;width:8em;height:.7em;background:#eee;vertical-align:middle}}
.bar div{{height:100%;background:#1f77b4}} ul{{margin:.2em 0;padding-left:1.4em}}
</style></head><body>
<h1>hiradix peer cache</h1>
<p>node <code id="node-id">{node}</code> {badge}</p>
<h2>Members ({len(members)})</h2>
<ul id="members">{member_items or '<li class="dim">none known</li>'}</ul>
<h2>Usage</h2>
<table id="usage"><tr><th>tier</th><th>used / capacity</th><th>fill</th><th>pages</th></tr>
{_usage_row("pool", m.tier("pool"))}
{_usage_row("disk", m.tier("disk"))}</table>
<h2>Read hit rate</h2>
<p>since start <b id="hit-rate">{m.hit_rate() * 100:.1f}%</b> · last interval <b>{last}</b>
· {total("read_requests"):,.0f} pages read, {total("read_hits"):,.0f} hits</p>
{_hit_rate_svg(rates)}
<h2>Traffic</h2>
<table><tr><th></th><th>pages</th><th>GiB</th></tr>
<tr><th>read (hits)</th><td>{total("read_hits"):,.0f}</td><td>{total("read_bytes") / GiB:.3f}</td></tr>
<tr><th>written</th><td>{total("write_requests"):,.0f}</td><td>{total("write_bytes") / GiB:.3f}</td></tr>
<tr><th>promoted from disk</th><td>{total("promotes"):,.0f}</td><td></td></tr></table>
<h2>Latency (ms)</h2>
<table><tr><th>op</th><th>p50</th><th>p90</th><th>p99</th><th>avg</th><th>count</th></tr>
{lat("read")}
{lat("write")}</table>
<p class="dim">Prometheus: <a href="/metrics">/metrics</a> · readiness: <a href="/ready">/ready</a></p>
</body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a slow client may hold a handler thread

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        metrics = self.server.metrics
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, metrics.exposition())
        elif path == "/ready":
            ok = metrics.is_ready()
            self._send(200 if ok else 503, "text/plain; charset=utf-8", b"ready\n" if ok else b"not ready\n")
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

    def __init__(
        self,
        addr: tuple[str, int],
        metrics: PeerMetrics,
        dashboard: bool,
        sample_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.metrics = metrics
        self.dashboard = dashboard
        self.sample_s = sample_s
        self.clock = clock
        super().__init__(addr, _Handler)

    def service_actions(self) -> None:
        # Called by serve_forever between polls: the hit-rate history needs no thread of its own.
        now = self.clock()
        last = self.metrics.history.last_time()
        if last is None or now - last >= self.sample_s:
            self.metrics.sample(now)


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
    sample_s, clock:
        Seconds between two hit-rate samples for the page's chart, and the clock they are
        taken by (``time.monotonic``; injected in tests).
    """

    def __init__(
        self,
        metrics: PeerMetrics,
        host: str = "127.0.0.1",
        port: int = 31997,
        dashboard: bool = True,
        *,
        sample_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.dashboard = dashboard
        self.sample_s = float(sample_s)
        self.clock = clock
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and start serving; returns the bound port. ``OSError`` if the port is taken."""
        if self._server is not None:
            return self.port
        self._server = _Server((self.host, self.port), self.metrics, self.dashboard, self.sample_s, self.clock)
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
