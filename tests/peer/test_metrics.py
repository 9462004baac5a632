"""Peer metrics: private registry, counters, latency quantiles, HTTP /metrics and dashboard."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hiradix.peer.metrics import LatencyReservoir, MetricsServer, PeerMetrics
from hiradix.peer.pool import SLOT_HEADER_SIZE, PublishedPool


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_reservoir_quantiles_and_window() -> None:
    r = LatencyReservoir(100)
    assert all(math.isnan(v) for v in r.quantiles())
    for v in range(1, 101):
        r.observe(float(v))
    p50, p90, p99 = r.quantiles()
    assert p50 == pytest.approx(50.5) and p90 == pytest.approx(90.1) and p99 == pytest.approx(99.01)
    for _ in range(100):
        r.observe(1000.0)  # the window slides: old values are gone
    assert r.quantiles() == [1000.0] * 3
    assert r.count == 200 and r.total == pytest.approx(5050 + 100_000)
    with pytest.raises(ValueError):
        LatencyReservoir(0)


def test_private_registries_do_not_collide() -> None:
    a, b = PeerMetrics(), PeerMetrics()
    a.record_write(1, 10, 0.001)
    assert b"hiradix_peer_write_requests_total 0.0" in b.exposition()
    assert "hiradix_peer_write_requests" not in {m.name for m in prometheus_client.REGISTRY.collect()}


def test_record_validation() -> None:
    m = PeerMetrics()
    with pytest.raises(ValueError):
        m.record_read(1, 2, 0, 0.1)
    with pytest.raises(ValueError, match="tier"):
        m.track("gpu", lambda: (0, 0, 0))
    assert m.hit_rate() == 0.0


def test_scrape_over_http_and_dashboard() -> None:
    m = PeerMetrics()
    pool = PublishedPool(4 * (SLOT_HEADER_SIZE + 128), 128)
    pool.set("a", b"x" * 100)
    m.track("pool", lambda: (pool.used_bytes, pool.capacity_bytes, len(pool)))
    m.record_read(4, 3, 300, 0.002)
    m.record_read(4, 1, 100, 0.004)
    for i in range(10):
        m.record_write(1, 128, 0.001 * (i + 1))
    m.record_eviction("pool", 2)
    m.record_eviction("disk")
    m.record_promote()
    with MetricsServer(m, port=0) as srv:
        assert srv.port > 0 and srv.url.startswith("http://127.0.0.1:")
        code, ctype, text = fetch(srv.url + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        s = samples(text)
        assert s[("hiradix_peer_read_requests_total", ())] == 8
        assert s[("hiradix_peer_read_hits_total", ())] == 4
        assert s[("hiradix_peer_read_bytes_total", ())] == 400
        assert s[("hiradix_peer_read_hit_rate", ())] == 0.5
        assert s[("hiradix_peer_write_bytes_total", ())] == 1280
        assert s[("hiradix_peer_evictions_total", (("tier", "pool"),))] == 2
        assert s[("hiradix_peer_evictions_total", (("tier", "disk"),))] == 1
        assert s[("hiradix_peer_promotes_total", ())] == 1
        assert s[("hiradix_peer_pool_used_bytes", ())] == 100
        assert s[("hiradix_peer_pool_capacity_bytes", ())] == 4 * 128
        assert s[("hiradix_peer_pool_keys", ())] == 1
        assert s[("hiradix_peer_disk_keys", ())] == 0  # untracked tier reads as 0
        assert s[("hiradix_peer_op_latency_seconds_count", (("op", "write"),))] == 10
        assert s[("hiradix_peer_op_latency_seconds_sum", (("op", "read"),))] == pytest.approx(0.006)
        p50 = s[("hiradix_peer_op_latency_seconds", (("op", "write"), ("quantile", "0.5")))]
        assert p50 == pytest.approx(0.0055)
        families = {f.name: f.type for f in text_string_to_metric_families(text)}
        assert families["hiradix_peer_op_latency_seconds"] == "summary"

        # gauges follow the pool at scrape time
        pool.set("b", b"y" * 28)
        assert samples(fetch(srv.url + "/metrics")[2])[("hiradix_peer_pool_used_bytes", ())] == 128

        code, ctype, page = fetch(srv.url + "/")
        assert code == 200 and ctype.startswith("text/html")
        assert 'http-equiv="refresh"' in page and '<b id="hit-rate">50.0%</b>' in page
        assert "_created" not in page  # the page is a summary, not a dump of every sample
        assert "<script" not in page and "http://" not in page.replace(srv.url, "")
        assert fetch(srv.url + "/nope")[0] == 404
    srv.stop()  # idempotent


def test_dashboard_can_be_disabled() -> None:
    with MetricsServer(PeerMetrics(), port=0, dashboard=False) as srv:
        assert fetch(srv.url + "/")[0] == 404
        assert fetch(srv.url + "/metrics")[0] == 200
