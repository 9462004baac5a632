"""Cross-server L3 in real SGLang servers: one server computes a prefix, another reuses it.

Two servers with hiradix's cache, each with the peer cache as L3 (one peer node per server,
one cluster, one cluster token), selected as SGLang's own parser accepts it:
``--hicache-storage-backend dynamic`` with hiradix's ``PeerStorage`` class. Prompts served
by A are then served by B from A's pages (storage hits), with outputs equal to the same
build's with no prefix cache; with A killed (``kill -9``), B keeps serving exact outputs
from misses, never wrong bytes and never a hang. Then the same with hiradix's ``file`` L3
handed from one server to the next (the backend locks its directory: one server at a time).
"""

from __future__ import annotations

import json
import time

from server import free_port, only_on
from workload import serve_all, shared_prefixes, tier_hits, wrong

BASE = ("--enable-hierarchical-cache", "--radix-cache-backend", "hiradix", "--max-total-tokens", "2048",
        "--hicache-ratio", "2", "--enable-cache-report")
TOKEN = {"HIRADIX_CLUSTER_TOKEN": "e2e-cluster-token"}


def _dynamic(class_name: str, **settings: object) -> tuple[str, ...]:
    extra = {"backend_name": f"hiradix-{class_name}", "module_path": "hiradix.sglang.storage",
             "class_name": class_name, "interface_v1": 1, **settings}
    return ("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra))


def _peer(rpc_port: int, seeds: list[str]) -> tuple[str, ...]:
    return _dynamic("PeerStorage", rpc_port=rpc_port, seeds=seeds, pool_size="256MiB", transport="tcp",
                    connect_timeout_s=1.0, rpc_timeout_s=2.0, read_timeout_s=2.0, join_timeout_s=60.0)


L3_VERSIONS = ("0.5.18", "0.5.23")
L3_WHY = "0.5.20 attaches L3 with 0.5.23's storage options and serves with 0.5.18's request calls, both run here"


def test_peer_l3_one_server_computes_another_reuses_then_its_peer_dies(servers, reference) -> None:
    only_on(L3_VERSIONS, L3_WHY)
    port_a = free_port()
    a = servers.start((*BASE, *_peer(port_a, [])), name="peer-a", env=TOKEN)
    b = servers.start((*BASE, *_peer(0, [f"127.0.0.1:{port_a}"])), name="peer-b", env=TOKEN)

    first = shared_prefixes(seed=10, n_requests=8)
    want = reference(first.prompts, first.max_new_tokens)
    assert wrong(serve_all(a, first.prompts, first.max_new_tokens), want) == []
    a.flush_cache()  # returns once A's writes to L3 are done (the flush drains them)
    answers = serve_all(b, first.prompts, first.max_new_tokens)
    assert wrong(answers, want) == []
    hits = tier_hits(answers)
    assert hits["storage"] > 0, f"B read nothing of A's pages: {hits}"

    # A computes more, then dies (kill -9): B's directory still names A's pages.
    second = shared_prefixes(seed=11, n_requests=8)
    want2 = reference(second.prompts, second.max_new_tokens)
    assert wrong(serve_all(a, second.prompts, second.max_new_tokens), want2) == []
    a.flush_cache()
    a.kill9()
    start = time.monotonic()
    answers = serve_all(b, second.prompts, second.max_new_tokens)
    assert wrong(answers, want2) == []
    assert b.alive()
    # Misses cost B at most its peer timeouts, never a hang (each request is bounded too).
    assert time.monotonic() - start < 120


def test_file_l3_handed_from_one_server_to_the_next(servers, reference, tmp_path) -> None:
    only_on(("0.5.18",), "hiradix's file backend runs the same under every version (the peer test covers 0.5.23)")
    store = _dynamic("FileStorage", path=str(tmp_path / "l3"))
    w = shared_prefixes(seed=12, n_requests=8)
    want = reference(w.prompts, w.max_new_tokens)
    a = servers.start((*BASE, *store), name="file-a")
    assert wrong(serve_all(a, w.prompts, w.max_new_tokens), want) == []
    a.flush_cache()
    a.stop()
    b = servers.start((*BASE, *store), name="file-b")
    answers = serve_all(b, w.prompts, w.max_new_tokens)
    assert wrong(answers, want) == []
    assert tier_hits(answers)["storage"] > 0


STOCK = ("--enable-hierarchical-cache", "--max-total-tokens", "2048", "--hicache-ratio", "2", "--enable-cache-report",
         "--enable-metrics",
         # stock's host pool copies on CPU with SGLang's direct I/O in layer_first only
         "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first")
#: Stand-ins for stock SGLang's CUDA-only host-pool steps (inject/sitecustomize.py).
STOCK_ON_CPU = {"HIRADIX_E2E_STOCK_ON_CPU": "1"}


def test_stock_sglang_on_the_peer_l3_one_server_computes_another_reuses(servers, reference) -> None:
    """Stock SGLang's own hierarchical cache (0.5.18's HiRadixCache, 0.5.20's and 0.5.23's
    UnifiedRadixCache) with hiradix's peer cache as L3 through SGLang's ``dynamic`` loader:
    the second server reads the first's pages, outputs exact; then the first is killed
    and the second still serves exact outputs."""
    only_on(L3_VERSIONS, "0.5.20's stock cache is 0.5.23's UnifiedRadixCache, run here on 0.5.23")
    port_a = free_port()
    env = {**TOKEN, **STOCK_ON_CPU}
    a = servers.start((*STOCK, *_peer(port_a, [])), name="stock-peer-a", env=env)
    b = servers.start((*STOCK, *_peer(0, [f"127.0.0.1:{port_a}"])), name="stock-peer-b", env=env)
    assert "hiradix: hierarchical radix cache" not in a.log_text()  # stock's cache, not the plugin's
    w = shared_prefixes(seed=13, n_requests=8)
    want = reference(w.prompts, w.max_new_tokens)
    assert wrong(serve_all(a, w.prompts, w.max_new_tokens), want) == []
    # Stock's flush drops L3 writes still queued; its scheduler counts each one done at a
    # step (sglang:backuped_tokens_total): one-token requests make the steps, bounded.
    deadline = time.monotonic() + 120
    while a.metric("sglang:backuped_tokens_total") < 8 * 300:
        assert time.monotonic() < deadline, "stock's L3 writes never completed"
        a.generate([5], 1)
    answers = serve_all(b, w.prompts, w.max_new_tokens)
    assert wrong(answers, want) == []
    assert tier_hits(answers)["storage"] > 0, tier_hits(answers)
    a.kill9()
    w2 = shared_prefixes(seed=14, n_requests=8)
    assert wrong(serve_all(b, w2.prompts, w2.max_new_tokens), reference(w2.prompts, w2.max_new_tokens)) == []
