"""The ordering suspected behind SGLang 0.5.20's wrong answers under load (issue 43), forced
on every request rather than hoped for.

Under the overlap scheduler a finished request still has one step in flight (launched before
its finish was seen). Under load the next request can be admitted before that step's result
is processed; that is where the reference no-cache server went wrong in a loaded CI run. The
harness (``HIRADIX_E2E_STALL_AFTER_FINISH_S``, ``inject/sitecustomize.py``) stalls the
scheduler right after a request finishes until the client's next request is in its socket,
so every next turn is admitted in that window. Multi-turn conversations are served one
request at a time (each turn carries the earlier answers, so caches hit on them), by three
servers: no prefix cache, stock SGLang's radix cache, and hiradix's. Their greedy outputs
are judged against ground truth: a wrong answer of the first two is upstream's (the test
xfails, naming the version), one of hiradix's fails it.
"""

from __future__ import annotations

import pytest

from tests.e2e.server import only_on_mark
from tests.e2e.test_e2e_outputs import HIRADIX
from tests.e2e.workload import conversations, serve_conversations

pytestmark = only_on_mark(
    ("0.5.20",),
    "where the wrong answers were seen; 0.5.23 ran it on 2026-11-29 (72 of 72 answers exact, "
    "docs/sglang/versions.md), and CI's real-server minutes are spent on 0.5.20",
)

STALL = {"HIRADIX_E2E_STALL_AFTER_FINISH_S": "5", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
FINISH_STALLED = "hiradix e2e fault: scheduler stalled after a finish"
SERVERS = {
    "no-cache": (("--disable-radix-cache", "--max-total-tokens", "4096", "--enable-cache-report"), "stock"),
    "stock-radix": (("--max-total-tokens", "2048", "--enable-cache-report"), "stock"),
    "hiradix": (HIRADIX, "hiradix"),
}


@pytest.mark.parametrize("kind", list(SERVERS))
def test_next_turn_admitted_before_the_finished_requests_last_step_is_processed(servers, judge, kind) -> None:
    args, side = SERVERS[kind]
    server = servers.start(args, name=f"stalled-{kind}", env=STALL)
    work = conversations(n_prefixes=4, prefix_len=300, n_conversations=8, turns=3, max_new_tokens=12, seed=43)
    prompts, answers = serve_conversations(server, work)
    stalls = server.log_text().count(FINISH_STALLED)
    # the fault took effect: the scheduler stalled after (nearly) every request's finish
    assert stalls >= len(prompts) - 1, (stalls, len(prompts))
    judge(server, prompts, answers, work.max_new_tokens, side=side)
    if side == "hiradix":
        assert sum(a["meta_info"].get("cached_tokens", 0) for a in answers) > 0, "no request hit the cache"
