"""The operator's view: the page at ``/`` (node id, members, readiness, usage in GiB, hit
rate chart), ``/ready``, the hit-rate history, and the shipped Grafana dashboard and
Prometheus config naming only metrics that exist. Loopback only; injected clocks."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hiradix.peer.config import PeerConfig
from hiradix.peer.metrics import HitRateHistory, MetricsServer, PeerMetrics
from hiradix.peer.node import InProcessCluster, PeerNode
from tests.support import REPO

EXAMPLES = REPO / "examples"
GiB = 1 << 30


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def bound_metrics(ready: list[bool]) -> PeerMetrics:
    m = PeerMetrics()
    m.bind_node("node-a:7000", lambda: ready[0], lambda: ["node-a:7000", "node-b:7000", "node-c:7000"])
    m.track("pool", lambda: (3 * GiB, 8 * GiB, 1234))
    m.track("disk", lambda: (GiB // 2, 100 * GiB, 99))
    return m


# ---------------------------------------------------------------------- history
def test_history_rates_gaps_and_ring() -> None:
    h = HitRateHistory(4)
    for t, req, hit in ((0, 0, 0), (5, 10, 5), (10, 10, 5), (15, 30, 25), (20, 40, 35)):
        h.add(t, req, hit)
    assert len(h) == 4 and h.last_time() == 20.0  # the oldest sample left the ring
    assert h.rates() == [(10.0, None), (15.0, 1.0), (20.0, 1.0)]
    h.add(25, 5, 1)  # counters went backwards (a reset): no rate, no negative
    assert h.rates()[-1] == (25.0, None)
    with pytest.raises(ValueError):
        HitRateHistory(1)


def test_server_samples_on_its_own_clock() -> None:
    now = [100.0]
    m = PeerMetrics()
    with MetricsServer(m, port=0, sample_s=5.0, clock=lambda: now[0]) as srv:
        server: Any = srv._server
        server.service_actions()  # what serve_forever runs between polls
        first = len(m.history)
        assert first >= 1 and m.history.last_time() == 100.0
        m.record_read(10, 7, 0, 0.001)
        now[0] = 103.0
        server.service_actions()
        assert len(m.history) == first  # not due yet
        now[0] = 105.0
        server.service_actions()
        assert m.history.last_time() == 105.0 and m.history.rates()[-1] == (105.0, 0.7)


# ---------------------------------------------------------------------- the page
def test_page_shows_node_members_usage_and_hit_rate_chart() -> None:
    ready = [True]
    m = bound_metrics(ready)
    for t, (req, hit) in enumerate([(0, 0), (100, 50), (200, 150), (200, 150), (300, 200)]):
        m.history.add(10.0 * t, req, hit)
    m.record_read(300, 200, 300 * 4096, 0.002)
    with MetricsServer(m, port=0, sample_s=float("inf")) as srv:
        code, page = fetch(srv.url + "/")
    assert code == 200
    assert '<code id="node-id">node-a:7000</code>' in page
    assert all(f"<li>node-{x}:7000" in page for x in "abc") and "Members (3)" in page
    assert "ready</span>" in page and "not ready" not in page
    assert "3.00 / 8.00 GiB" in page and "1,234 pages" in page  # pool
    assert "0.50 / 100.00 GiB" in page  # disk
    assert '<b id="hit-rate">66.7%</b>' in page
    # The chart: intervals 50%, 100%, (no reads: a gap), 50% -> a line of two points and a dot.
    svg = page[page.index('<svg id="hit-rate-chart"') : page.index("</svg>")]
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert "_created" not in page and "<script" not in page
    assert 'http-equiv="refresh"' in page


def test_ready_endpoint_follows_the_node() -> None:
    ready = [False]
    m = PeerMetrics()
    with MetricsServer(m, port=0) as srv:
        assert fetch(srv.url + "/ready") == (503, "not ready\n")  # no node bound yet
        m.bind_node("n", lambda: ready[0], lambda: ["n"])
        assert fetch(srv.url + "/ready")[0] == 503
        ready[0] = True
        assert fetch(srv.url + "/ready") == (200, "ready\n")

        def broken() -> bool:
            raise RuntimeError("membership not there")

        m.bind_node("n", broken, lambda: ["n"])
        assert fetch(srv.url + "/ready")[0] == 503  # a failing check is "not ready", not a 500
        assert fetch(srv.url + "/metrics")[0] == 200


def test_node_serves_its_page_and_readiness() -> None:
    with InProcessCluster(2, transport="fake", pool_size=1 << 20) as c:
        node = c.add_node(metrics_enabled=True, metrics_port=0)
        assert node.metrics_server is not None
        url = node.metrics_server.url
        assert fetch(url + "/ready") == (200, "ready\n")
        code, page = fetch(url + "/")
        assert code == 200 and node.node_id in page and "Members (3)" in page
        assert all(n.node_id in page for n in c.nodes)
        assert "GiB" in page and '<svg id="hit-rate-chart"' in page and "_created" not in page
        text = fetch(url + "/metrics")[1]
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["hiradix_peer_ready"].samples[0].value == 1
        assert fams["hiradix_peer_members"].samples[0].value == 3
        assert fams["hiradix_peer_info"].samples[0].labels == {"node_id": node.node_id}


def test_node_that_has_not_joined_is_not_ready() -> None:
    with socket.create_server(("127.0.0.1", 0)) as dead:  # a head that never answers RPC
        head = f"127.0.0.1:{dead.getsockname()[1]}"
        cfg = PeerConfig(
            metrics_port=0, discovery_addr=head, cluster_token="t" * 32, rpc_timeout_s=0.5, connect_timeout_s=0.5
        )
        node = PeerNode(cfg, start=False)
        try:
            assert node.metrics_server is not None
            assert fetch(node.metrics_server.url + "/ready")[0] == 503
            assert "not ready" in fetch(node.metrics_server.url + "/")[1]
        finally:
            node.close(leave=False)


# ---------------------------------------------------------------------- shipped examples
def exported_names() -> set[str]:
    m = bound_metrics([True])
    m.record_read(2, 1, 10, 0.001)
    m.record_write(1, 10, 0.001)
    m.record_eviction("pool")
    m.record_promote()
    names = set()
    for fam in text_string_to_metric_families(m.exposition().decode()):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def expressions(obj: Any) -> list[str]:
    """Every PromQL string in a Grafana dashboard: targets' ``expr`` and variable queries."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("expr", "definition", "query") and isinstance(v, str):
                out.append(v)
            else:
                out.extend(expressions(v))
    elif isinstance(obj, list):
        for v in obj:
            out.extend(expressions(v))
    return out


def test_grafana_dashboard_names_only_exported_metrics() -> None:
    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = expressions(dash)
    assert len(exprs) >= 10
    exported = exported_names()
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bhiradix_peer_[a-z_]+\b", expr))
        assert names, f"expression names no hiradix metric: {expr}"
        assert names <= exported, f"{sorted(names - exported)} not exported (in {expr})"
        used |= names
    # The operator's signals are all on the dashboard.
    for name in ("ready", "members", "read_hits_total", "pool_used_bytes", "disk_used_bytes", "op_latency_seconds"):
        assert f"hiradix_peer_{name}" in used
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])


def test_prometheus_example_scrapes_the_metrics_port() -> None:
    text = (EXAMPLES / "prometheus.yml").read_text()
    cfg = yaml.safe_load(text)
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    targets = job["static_configs"][0]["targets"]
    assert targets and all(t.endswith(f":{PeerConfig().metrics_port}") for t in targets)
    exported = exported_names()
    assert set(re.findall(r"\bhiradix_peer_[a-z_]+\b", text)) <= exported
