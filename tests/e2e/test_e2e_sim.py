"""``hiradix sim`` checked against the real server: a workload served by SGLang with
hiradix's cache, recorded as a Mooncake trace and replayed through the simulator with the
server's settings, gets the same device and host hits, request by request.

The workload (:func:`workload.conversations`) is multi-turn chats behind six 512-token
system prompts, sent one request at a time, so that the arrival order is exact. The
device pool holds 2,048 tokens and the host pool twice that, so system prompts and
conversations leave the device for the host and come back, the host itself evicts, and a
request's hit often spans both tiers (a system prompt still on the device, the rest of its
conversation on the host).

What the trace has to model, as the server does it (SGLang 0.5.18's scheduler and
``hiradix.sglang``'s ``cache_unfinished_req`` / ``cache_finished_req``):

* **Each request is two inserts.** After its prefill the prompt is inserted
  (``cache_unfinished_req``: others can match it while it decodes), and when it finishes
  the prompt and the generated tokens whose KV was computed (all but the last: the
  request's ``kv_committed_len``) are inserted. So each request is recorded as two trace
  records: the prompt, then the prompt and its answer but the last token. Only the first
  record's hits are the request's; the second one's are the prompt's own, all on the
  device. Without the answers the next turn of a conversation would find its last answer
  missing (the check fails: asserted below), and without the prompt record the tree's
  nodes would split in other places, so evictions would free other amounts.
* **A match is at most ``len(prompt) - 1`` tokens** (SGLang keeps one token to compute
  the logits), where the simulator matches whole prompts. Every prompt here ends with a
  new user message, so no prompt is cached whole and the limit never binds (asserted).
* **The trace's 512-token blocks.** A Mooncake trace names whole blocks, and two prompts
  share whole blocks or a prefix of one (a block cut short): it cannot say that two
  prompts diverge inside a block. The workload's prompts diverge only where a system
  prompt ends (at 512 tokens: distinct first tokens) and a conversation's turns form one
  chain, so the trace gives the simulator a tree of exactly the server's shape (asserted:
  every two recorded sequences share as many tokens in the trace as on the server).
* **The pools:** the device pool is the server's ``max_total_num_tokens`` (read from
  ``/get_server_info``), the host pool ``--hicache-ratio`` times that plus one page, as
  SGLang 0.5.18 sizes it (``hiradix.sglang.pools.host_pool_for``); page size 1, LRU, the
  server's write policy, no L3, the cache's default load-back threshold (10 tokens: a
  shorter host tail is recomputed, on both sides).

The server's tree starts empty (``/flush_cache``: the readiness probes' requests leave a
token in it). With sequential arrivals the server's device pool holds nothing but the tree
and the one running request, as the simulator's does, so the hits are expected equal, not
close: the test asserts equality for every request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from server import only_on
from workload import conversations, serve_conversations

from hiradix.sim.generators import MooncakeWorkload
from hiradix.sim.run import SimResult, simulate
from hiradix.sim.trace import BLOCK_TOKENS, parse_line

HIRADIX = ("--enable-hierarchical-cache", "--radix-cache-backend", "hiradix", "--max-total-tokens", "2048",
           "--hicache-ratio", "2", "--page-size", "1", "--enable-cache-report")


def server_sequences(prompts: Sequence[Sequence[int]], answers: Sequence[dict[str, Any]]) -> list[tuple[int, ...]]:
    """What the server inserts into its tree for each request, in order: the prompt (after
    its prefill), then the prompt and the answer but its last token (at its finish)."""
    out: list[tuple[int, ...]] = []
    for prompt, answer in zip(prompts, answers, strict=True):
        out.append(tuple(prompt))
        out.append(tuple(prompt) + tuple(answer["output_ids"][:-1]))
    return out


def mooncake_lines(sequences: Sequence[Sequence[int]]) -> list[str]:
    """``sequences`` as Mooncake trace lines, one per sequence in order (timestamps 0, 1,
    ... ms). Block ``b`` of a sequence is named by the sequence's tokens up to and
    including the block's first token: two sequences get the same id for a block when they
    agree up to its start and on its first token. That is exact for sequences that
    diverge only at block starts, or within a block only by one being a prefix of the
    other (:func:`assert_same_sharing` checks it)."""
    ids: dict[tuple[int, ...], int] = {}
    lines = []
    for t, seq in enumerate(sequences):
        hash_ids = [ids.setdefault(tuple(seq[: b + 1]), len(ids)) for b in range(0, len(seq), BLOCK_TOKENS)]
        lines.append(json.dumps({"timestamp": t, "input_length": len(seq), "output_length": 0, "hash_ids": hash_ids}))
    return lines


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def common_prefixes(sequences: Sequence[np.ndarray]) -> np.ndarray:
    """``[i, j]``: the tokens sequences ``i`` and ``j`` share as a prefix."""
    n = len(sequences)
    out = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        out[i, i] = len(sequences[i])
        for j in range(i):
            out[i, j] = out[j, i] = _common_prefix(sequences[i], sequences[j])
    return out


def assert_same_sharing(sequences: Sequence[Sequence[int]], lines: Sequence[str]) -> np.ndarray:
    """Every two sequences share as many tokens in the trace as they do on the server (so
    the simulator's tree has the server's shape); returns the server's
    :func:`common_prefixes`."""
    server = common_prefixes([np.asarray(s, dtype=np.int64) for s in sequences])
    trace = common_prefixes([parse_line(line).tokens().astype(np.int64) for line in lines])
    differ = np.argwhere(server != trace)
    assert not len(differ), [(int(i), int(j), int(server[i, j]), int(trace[i, j])) for i, j in differ[:10]]
    return server


def replay(lines: Sequence[str], path: Path, info: dict[str, Any]) -> SimResult:
    """Replay the trace ``lines`` through the simulator with the server's settings (module
    docstring)."""
    path.write_text("\n".join(lines) + "\n")
    device = int(info["max_total_num_tokens"])
    page = int(info["page_size"])
    host = (int(device * float(info["hicache_ratio"])) // page + 1) * page
    return simulate(MooncakeWorkload(path), page_size=page, device_tokens=device, host_tokens=host,
                    eviction_policy=info["radix_eviction_policy"], write_policy=info["hicache_write_policy"],
                    l3_backend=None)


def server_hits(answers: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(device, host)`` tokens of each answer's ``cached_tokens_details`` (no details:
    nothing was cached)."""
    hits = []
    for a in answers:
        meta = a["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        device, host = int(details.get("device", 0)), int(details.get("host", 0))
        assert int(meta.get("cached_tokens") or 0) == device + host, meta  # no third tier here
        hits.append((device, host))
    return hits


def sim_hits(result: SimResult) -> list[tuple[int, int]]:
    """``(device, host)`` hit tokens of the requests' prompt records (every other record)."""
    device, host = result.timeline["device_hit"][0::2], result.timeline["host_hit"][0::2]
    return [(int(d), int(h)) for d, h in zip(device, host, strict=True)]


def test_sim_replay_hits_equal_the_servers_per_request(servers, tmp_path: Path) -> None:
    only_on(("0.5.18",), "the simulator's cache is the same code on every version; one run checks the model of a "
            "server's inserts, which the trace encodes for 0.5.18's scheduler")
    work = conversations(n_prefixes=6, n_conversations=16, turns=3, message_len=32, max_new_tokens=8, seed=30)
    server = servers.start(HIRADIX, name="sim-check")
    info = server.request("/get_server_info")
    assert info["page_size"] == 1 and info["radix_eviction_policy"] == "lru", info
    server.flush_cache()
    prompts, answers = serve_conversations(server, work)
    want = server_hits(answers)

    sequences = server_sequences(prompts, answers)
    lines = mooncake_lines(sequences)
    shared = assert_same_sharing(sequences, lines)
    # what each prompt shares with the sequences before it: all a cache without limits hits
    ideal = [max((int(shared[2 * i, j]) for j in range(2 * i)), default=0) for i in range(len(prompts))]
    assert all(n <= len(p) - 1 for n, p in zip(ideal, prompts, strict=True))  # SGLang's match limit never binds

    result = replay(lines, tmp_path / "trace.jsonl", info)
    got = sim_hits(result)
    assert result.stats.requests == len(sequences) and result.stats.too_large_requests == 0
    differ = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert differ == [], f"(request, server (device, host), simulator (device, host)): {differ}"

    # The check is not vacuous: the workload hit each tier alone and both at once, hit the
    # answers of earlier turns, lost some to evictions; and a trace of the prompts
    # alone (without the answers the server caches) disagrees.
    assert any(d and not h for d, h in want) and any(h and not d for d, h in want), want
    assert any(d and h for d, h in want), want
    assert any(d + h > len(work.prefixes[0]) for d, h in want), want
    assert result.stats.host_evicted_tokens > 0 and any(d + h < n for (d, h), n in zip(want, ideal, strict=True))
    prompts_only = replay(mooncake_lines(prompts), tmp_path / "prompts.jsonl", info)
    naive = [(int(d), int(h)) for d, h in zip(prompts_only.timeline["device_hit"], prompts_only.timeline["host_hit"],
                                              strict=True)]
    assert naive != want
