"""Every write policy and host layout in a real server: ``write_back``,
``write_through_selective`` and the ``page_first`` host layout (``write_through`` and
``layer_first`` run in ``test_e2e_outputs.py``). Prefixes go to host and load back, loads
slowed as there, and greedy outputs equal ground truth (``judge``).

What each asserts ran, from SGLang's own metrics:

- ``write_back``: nothing is backed up while the device pool has room (the first four
  prompts fit), then evicted prefixes reach host at eviction and load back from there.
- ``write_through_selective``: a node is backed up on its second hit, so each prefix is
  asked twice in a row first; the prompts' own tails, hit once, never reach host: the
  backups stay within the prefixes' tokens (twice over at most).
- ``page_first``: the host pool in page-major order; every prefix loads back from it as in
  ``layer_first``.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_e2e_outputs import HIRADIX, SLOW_LOADS
from tests.e2e.workload import Workload, serve_all, shared_prefixes, tier_hits

POLICIES = {
    "write_back": ("--hicache-write-policy", "write_back"),
    "write_through_selective": ("--hicache-write-policy", "write_through_selective"),
    "page_first": ("--hicache-mem-layout", "page_first"),
}
PREFIXES, PREFIX_LEN = 8, 300


@pytest.fixture(scope="module", params=list(POLICIES))
def policy_server(module_servers, request):
    name = request.param
    server = module_servers.start((*HIRADIX, *POLICIES[name]), name=f"hiradix-{name}", env=SLOW_LOADS)
    yield name, server
    server.stop()


def _asked_twice_first(w: Workload) -> tuple[tuple[int, ...], ...]:
    """``w``'s prompts, each prefix's first two prompts moved to the front, in pairs."""
    pairs = [i for p in range(PREFIXES) for i in [j for j, q in enumerate(w.prefix_of) if q == p][:2]]
    return tuple(w.prompts[i] for i in pairs) + tuple(w.prompts[i] for i in range(len(w.prompts)) if i not in pairs)


def _backed_up(server) -> float:
    return server.metric("sglang:hicache_backup_tokens_total")


def test_policy_outputs_exact_as_prefixes_load_back(policy_server, judge) -> None:
    policy, server = policy_server
    assert "hiradix: hierarchical radix cache on the" in server.log_text(), "the plugin's cache was not built"
    w = shared_prefixes(n_prefixes=PREFIXES, prefix_len=PREFIX_LEN, seed=30)
    prompts = _asked_twice_first(w) if policy == "write_through_selective" else w.prompts
    answers = []
    if policy == "write_back":
        answers = serve_all(server, prompts[:4], w.max_new_tokens)
        assert _backed_up(server) == 0, "write_back backed up while the device pool had room"
    answers += serve_all(server, prompts[len(answers) :], w.max_new_tokens)
    judge(server, prompts, answers, w.max_new_tokens)

    hits = tier_hits(answers)
    assert hits["host"] > 0 and server.metric("sglang:load_back_tokens_total") >= hits["host"], hits
    backed_up = _backed_up(server)
    assert backed_up > 0
    if policy == "write_through_selective":
        assert backed_up <= 2 * PREFIXES * PREFIX_LEN, f"{backed_up} tokens backed up: tails hit once went to host"
    else:
        # every request after the first cycle finds its whole prefix on host
        assert hits["host"] >= (len(prompts) - PREFIXES) * PREFIX_LEN, hits
