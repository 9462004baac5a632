"""hiradix's tree as SGLang 0.5.23's tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix``)
in a real server: SGLang's own ``UnifiedRadixCache``, controller and pools, hiradix's tree
deciding (issue 48; the FULL component on the device tier so far).

The device pool holds 2,048 tokens and the workloads cycle over 300-token prefixes, 4 that
fit together and 8 that do not, so the tree hits prefixes, splits nodes where a request's
prompt leaves them, locks the paths of requests in flight, and evicts leaves to make room,
sequentially and with four requests in flight. Greedy outputs equal ground truth (``judge``); SGLang's strict idle
memory check stops the server on a leaked slot or lock. (HiCache with this core is refused
by name when SGLang wires the host tier: ``tests/sglang/v23/test_tree_core_parity.py``.)
"""

from __future__ import annotations

import pytest

from tests.e2e.server import only_on_mark
from tests.e2e.workload import serve_all, shared_prefixes

pytestmark = only_on_mark(("0.5.23",), "the tree-core seam hiradix implements (UnifiedTreeCoreInterface) is 0.5.23's")

CORE = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "hiradix", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
ARGS = ("--max-total-tokens", "2048", "--enable-cache-report")
SERVING = "hiradix: tree core 'hiradix' serving SGLang's UnifiedRadixCache"


@pytest.fixture(scope="module")
def core_server(module_servers):
    return module_servers.start(ARGS, name="tree-core", env=CORE)


def _device_hits(answers) -> int:
    return sum(int(a["meta_info"].get("cached_tokens", 0)) for a in answers)


def test_the_tree_core_serves_exact_outputs_as_prefixes_hit_and_are_evicted(core_server, judge) -> None:
    assert SERVING in core_server.log_text(), "SGLang did not build hiradix's tree core"
    # 4 prefixes fit the pool together: from the second cycle on each request hits its prefix
    hot = shared_prefixes(n_prefixes=4, n_requests=16, seed=0)
    answers = serve_all(core_server, hot.prompts, hot.max_new_tokens)
    judge(core_server, hot.prompts, answers, hot.max_new_tokens)
    assert _device_hits(answers[4:]) >= 12 * 300, _device_hits(answers[4:])
    # 8 others do not fit together: least-recently-used eviction thrashes them, and the first 4
    cold = shared_prefixes(n_prefixes=8, n_requests=16, seed=2)
    judge(core_server, cold.prompts, serve_all(core_server, cold.prompts, cold.max_new_tokens), cold.max_new_tokens)
    again = serve_all(core_server, hot.prompts[:1], hot.max_new_tokens)
    judge(core_server, hot.prompts[:1], again, hot.max_new_tokens)
    assert _device_hits(again) < 300, "the first prefix survived 16 others on a 2,048-token pool"


def test_the_tree_core_with_requests_in_flight(core_server, judge) -> None:
    w = shared_prefixes(seed=1)
    answers = serve_all(core_server, w.prompts, w.max_new_tokens, concurrency=4)
    judge(core_server, w.prompts, answers, w.max_new_tokens)
    core_server.flush_cache()
    # after the flush, the strict idle check has run with every lock released and every slot back
    judge(core_server, w.prompts[:2], serve_all(core_server, w.prompts[:2], w.max_new_tokens), w.max_new_tokens)
    assert core_server.alive()
