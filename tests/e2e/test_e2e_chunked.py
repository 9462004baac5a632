"""Long prompts prefilled in chunks in a real server: 1.6-2.4k-token prompts with
``--chunked-prefill-size 256``, so SGLang inserts each prompt's KV into hiradix chunk by
chunk (``cache_unfinished_req``) before the last chunk; and prefixes partly on the device,
partly on host: the prompts share a 700-token head that every request keeps hot, and their
long documents do not fit the device pool together, so they go to host between cycles and
load back under the head. Greedy outputs equal ground truth (``judge``); loads are slowed as
in ``test_e2e_outputs.py``.

That the paths ran is read off the server: SGLang's log line for every prefill batch
(``#new-token``) shows no batch above 256 new tokens and at least as many batches as the
chunks the uncached tokens need, and ``cached_tokens_details`` shows each later prompt's
head on the device and its document on host.
"""

from __future__ import annotations

import math
import re

from tests.e2e.server import NOT_ON_020
from tests.e2e.test_e2e_outputs import SLOW_LOADS
from tests.e2e.workload import long_documents, serve_all, tier_hits

pytestmark = NOT_ON_020

CHUNK = 256
HEAD = 700
CHUNKED = (
    "--enable-hierarchical-cache",
    "--radix-cache-backend",
    "hiradix",
    "--max-total-tokens",
    "4096",
    "--hicache-ratio",
    "3",
    "--chunked-prefill-size",
    str(CHUNK),
    "--enable-cache-report",
    "--enable-metrics",
)
NEW_TOKENS = re.compile(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)")


def test_long_prompts_prefill_in_chunks_over_prefixes_partly_on_host(servers, judge) -> None:
    server = servers.start(CHUNKED, name="hiradix-chunked", env=SLOW_LOADS)
    before = len(NEW_TOKENS.findall(server.log_text()))  # the server's own warm-up request
    w = long_documents(head_len=HEAD, seed=20)
    assert min(map(len, w.prompts)) > 1500 and max(map(len, w.prompts)) < 2500
    answers = serve_all(server, w.prompts, w.max_new_tokens)
    judge(server, w.prompts, answers, w.max_new_tokens)

    batches = [int(n) for n in NEW_TOKENS.findall(server.log_text())[before:]]
    uncached = [len(p) - int(a["meta_info"]["cached_tokens"]) for p, a in zip(w.prompts, answers, strict=True)]
    chunks = sum(math.ceil(n / CHUNK) for n in uncached)
    assert max(batches) <= CHUNK, f"a prefill batch of {max(batches)} new tokens: not chunked at {CHUNK}"
    # the first cycle's documents take 4-7 chunks each
    assert len(batches) >= chunks > 2 * len(w.prompts), (len(batches), chunks, uncached)

    docs = len(w.prefixes)
    for prompt_no, a in enumerate(answers[docs:], start=docs):
        hits = tier_hits([a])
        doc = len(w.prefixes[w.prefix_of[prompt_no]]) - HEAD
        # the head from the device, the document (all but a token or two) from host
        assert hits["device"] >= HEAD and hits["host"] >= doc - 2, (prompt_no, doc, hits)
    assert server.metric("sglang:load_back_tokens_total") >= tier_hits(answers[docs:])["host"]
