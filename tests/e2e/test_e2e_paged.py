"""Page sizes above 1 in a real server: SGLang's paged KV pool (``--page-size`` 16 and 64),
hiradix's tree holding whole pages, prefixes sent to host and loaded back page by page, and
greedy outputs equal to ground truth.

The 300-token prefixes are not page multiples (18 pages of 16 and 12 tokens; 4 pages of 64
and 44 tokens), so a request can only hit whole pages: every host hit a multiple of the
page size, below the prefix's length, shows the paged path ran. Loads are slowed as in
``test_e2e_outputs.py``, so a forward pass that does not wait for a page's layer reads it
unfilled. On SGLang 0.5.18 and 0.5.20 the allocator's Triton kernels have no CPU driver; the
harness puts SGLang's naive CPU path in their place (``inject/sitecustomize.py``).
"""

from __future__ import annotations

import pytest

from tests.e2e.test_e2e_outputs import HIRADIX, SLOW_LOADS
from tests.e2e.workload import serve_all, shared_prefixes, tier_hits

HARNESS = {**SLOW_LOADS, "HIRADIX_E2E_NAIVE_PAGED_ALLOC": "1"}


@pytest.fixture(scope="module", params=[16, 64], ids=lambda ps: f"page{ps}")
def page_size(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def paged_server(module_servers, page_size):
    server = module_servers.start(
        (*HIRADIX, "--page-size", str(page_size)), name=f"hiradix-page{page_size}", env=HARNESS
    )
    yield server
    server.stop()


def _check_pages(ps: int, answers, prefix_len: int = 300) -> int:
    """Every request's host hit is whole pages of the prefix; returns the tokens hit."""
    whole = prefix_len // ps * ps
    for a in answers:
        host = tier_hits([a])["host"]
        assert host % ps == 0 and host <= whole, (ps, host, a["meta_info"].get("cached_tokens_details"))
    return tier_hits(answers)["host"]


def test_paged_outputs_exact_as_pages_load_back(paged_server, page_size, judge) -> None:
    log = paged_server.log_text()
    assert "hiradix: hierarchical radix cache on the" in log, "the plugin's cache was not built"
    assert "hiradix e2e fault: every load slowed by 0.1 s a layer" in log, "the slow-load fault is not in place"
    w = shared_prefixes(seed=10)
    answers = serve_all(paged_server, w.prompts, w.max_new_tokens)
    judge(paged_server, w.prompts, answers, w.max_new_tokens)
    host = _check_pages(page_size, answers)
    # From the second cycle on, each request loads its prefix's whole pages from host.
    assert host >= (len(w.prompts) - 8) * (300 // page_size * page_size), host
    assert paged_server.metric("sglang:load_back_tokens_total") >= host


def test_paged_outputs_exact_with_requests_in_flight(paged_server, page_size, judge) -> None:
    w = shared_prefixes(seed=11, n_requests=32)
    answers = serve_all(paged_server, w.prompts, w.max_new_tokens, concurrency=4)
    judge(paged_server, w.prompts, answers, w.max_new_tokens)
    assert _check_pages(page_size, answers) > 0
