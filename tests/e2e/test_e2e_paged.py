"""Page sizes above 1 in a real server, each with a host-side option the default servers do
not take: SGLang's paged KV pool (``--page-size`` 16 with the ``page_first`` host layout,
64 with the ``write_back`` policy), hiradix's tree holding whole pages, prefixes sent to
host and loaded back page by page, and greedy outputs equal to ground truth.

The 300-token prefixes are not page multiples (18 pages of 16 and 12 tokens; 4 pages of 64
and 44 tokens), so a request can only hit whole pages: every host hit a multiple of the
page size, below the prefix's length, shows the paged path ran. ``write_back`` backs up
nothing while the device pool has room (the first four prompts fit), then evicted prefixes
reach host at eviction and load back from there. Loads are slowed as in
``test_e2e_outputs.py``. On SGLang 0.5.18 and 0.5.20 the allocator's Triton kernels have no
CPU driver; the harness puts SGLang's naive CPU path in their place
(``inject/sitecustomize.py``).
"""

from __future__ import annotations

import pytest

from tests.e2e.server import NOT_ON_020
from tests.e2e.test_e2e_outputs import HIRADIX, SLOW_LOADS
from tests.e2e.workload import serve_all, shared_prefixes, tier_hits

pytestmark = NOT_ON_020

HARNESS = {**SLOW_LOADS, "HIRADIX_E2E_NAIVE_PAGED_ALLOC": "1"}
CONFIGS = {
    "page16-page_first": (16, ("--hicache-mem-layout", "page_first")),
    "page64-write_back": (64, ("--hicache-write-policy", "write_back")),
}
PREFIXES, PREFIX_LEN = 8, 300


@pytest.fixture(scope="module", params=list(CONFIGS))
def config(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def paged_server(module_servers, config):
    ps, extra = CONFIGS[config]
    server = module_servers.start((*HIRADIX, "--page-size", str(ps), *extra), name=f"hiradix-{config}", env=HARNESS)
    yield server
    server.stop()


def _check_pages(ps: int, answers) -> int:
    """Every request's host hit is whole pages of the prefix; returns the tokens hit."""
    for a in answers:
        host = tier_hits([a])["host"]
        assert host % ps == 0 and host <= PREFIX_LEN // ps * ps, (ps, host, a["meta_info"].get("cached_tokens_details"))
    return tier_hits(answers)["host"]


def test_paged_outputs_exact_as_pages_load_back(paged_server, config, judge) -> None:
    ps = CONFIGS[config][0]
    log = paged_server.log_text()
    assert "hiradix: hierarchical radix cache on the" in log, "the plugin's cache was not built"
    assert "hiradix e2e fault: every load slowed by 0.1 s a layer" in log, "the slow-load fault is not in place"
    w = shared_prefixes(n_prefixes=PREFIXES, prefix_len=PREFIX_LEN, seed=10)
    answers = []
    if config.endswith("write_back"):
        answers = serve_all(paged_server, w.prompts[:4], w.max_new_tokens)
        backed_up = paged_server.metric("sglang:hicache_backup_tokens_total")
        assert backed_up == 0, f"write_back backed up {backed_up} tokens while the device pool had room"
    answers += serve_all(paged_server, w.prompts[len(answers) :], w.max_new_tokens)
    judge(paged_server, w.prompts, answers, w.max_new_tokens)
    host = _check_pages(ps, answers)
    # From the second cycle on, each request loads its prefix's whole pages from host.
    assert host >= (len(w.prompts) - PREFIXES) * (PREFIX_LEN // ps * ps), host
    assert paged_server.metric("sglang:load_back_tokens_total") >= host
    assert paged_server.metric("sglang:hicache_backup_tokens_total") > 0


def test_paged_outputs_exact_with_requests_in_flight(paged_server, config, judge) -> None:
    w = shared_prefixes(seed=11, n_requests=32)
    answers = serve_all(paged_server, w.prompts, w.max_new_tokens, concurrency=4)
    judge(paged_server, w.prompts, answers, w.max_new_tokens)
    assert _check_pages(CONFIGS[config][0], answers) > 0
