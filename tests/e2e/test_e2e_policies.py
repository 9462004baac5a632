"""``write_through_selective`` in a real server: a node is backed up to host on its second
hit, not its first. A hit is counted where a request's insert walks a node it did not find
cached (0.5.23's scheduler inserts only what a request added, as SGLang's own 0.5.23 core
counts it), so each prefix is first asked by two requests at once, both computing it; then
the prompts cycle, so the prefixes go to host and load back, loads slowed as in ``test_e2e_outputs.py``; greedy
outputs equal ground truth (``judge``), and the prompts' own tails, hit once, never reach
host: SGLang's backup counter stays within the prefixes' tokens (twice over at most).

The other policies and layouts: ``write_through`` with ``layer_first`` in
``test_e2e_outputs.py``; ``page_first`` and ``write_back`` in ``test_e2e_paged.py``, with
page sizes above 1.
"""

from __future__ import annotations

from tests.e2e.server import NOT_ON_020
from tests.e2e.test_e2e_outputs import HIRADIX, SLOW_LOADS
from tests.e2e.workload import serve_all, shared_prefixes, tier_hits

pytestmark = NOT_ON_020

PREFIXES, PREFIX_LEN = 8, 300


def test_selective_write_through_backs_up_prefixes_hit_twice(servers, judge) -> None:
    server = servers.start(
        (*HIRADIX, "--hicache-write-policy", "write_through_selective"), name="hiradix-selective", env=SLOW_LOADS
    )
    w = shared_prefixes(n_prefixes=PREFIXES, prefix_len=PREFIX_LEN, seed=30)
    pairs = [[j for j, q in enumerate(w.prefix_of) if q == p][:2] for p in range(PREFIXES)]
    paired = {i for pair in pairs for i in pair}
    prompts = tuple(w.prompts[i] for pair in pairs for i in pair)
    answers = []
    for pair in pairs:  # both in flight before either is inserted: each computes the prefix
        answers += serve_all(server, [w.prompts[i] for i in pair], w.max_new_tokens, concurrency=2)
    rest = tuple(w.prompts[i] for i in range(len(w.prompts)) if i not in paired)
    answers += serve_all(server, rest, w.max_new_tokens)
    prompts += rest
    judge(server, prompts, answers, w.max_new_tokens)
    hits = tier_hits(answers)
    assert hits["host"] > 0 and server.metric("sglang:load_back_tokens_total") >= hits["host"], hits
    backed_up = server.metric("sglang:hicache_backup_tokens_total")
    assert 0 < backed_up <= 2 * PREFIXES * PREFIX_LEN, f"{backed_up} tokens backed up: tails hit once went to host"
