"""``write_through_selective`` in a real server: a node is backed up to host on its second
hit, not its first. Each prefix is asked twice in a row first, then the prompts cycle, so
the prefixes go to host and load back, loads slowed as in ``test_e2e_outputs.py``; greedy
outputs equal ground truth (``judge``), and the prompts' own tails, hit once, never reach
host: SGLang's backup counter stays within the prefixes' tokens (twice over at most).

The other policies and layouts: ``write_through`` with ``layer_first`` in
``test_e2e_outputs.py``; ``page_first`` and ``write_back`` in ``test_e2e_paged.py``, with
page sizes above 1.
"""

from __future__ import annotations

from tests.e2e.test_e2e_outputs import HIRADIX, SLOW_LOADS
from tests.e2e.workload import serve_all, shared_prefixes, tier_hits

PREFIXES, PREFIX_LEN = 8, 300


def test_selective_write_through_backs_up_prefixes_hit_twice(servers, judge) -> None:
    server = servers.start(
        (*HIRADIX, "--hicache-write-policy", "write_through_selective"), name="hiradix-selective", env=SLOW_LOADS
    )
    w = shared_prefixes(n_prefixes=PREFIXES, prefix_len=PREFIX_LEN, seed=30)
    pairs = [i for p in range(PREFIXES) for i in [j for j, q in enumerate(w.prefix_of) if q == p][:2]]
    prompts = tuple(w.prompts[i] for i in pairs) + tuple(w.prompts[i] for i in range(len(w.prompts)) if i not in pairs)
    answers = serve_all(server, prompts, w.max_new_tokens)
    judge(server, prompts, answers, w.max_new_tokens)
    hits = tier_hits(answers)
    assert hits["host"] > 0 and server.metric("sglang:load_back_tokens_total") >= hits["host"], hits
    backed_up = server.metric("sglang:hicache_backup_tokens_total")
    assert 0 < backed_up <= 2 * PREFIXES * PREFIX_LEN, f"{backed_up} tokens backed up: tails hit once went to host"
