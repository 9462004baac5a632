"""``hiradix sim`` checked against the real server: workloads served by SGLang with
hiradix's cache, recorded as Mooncake traces and replayed through the simulator with the
server's settings, get the same device and host hits, request by request.

The workloads (:func:`workload.conversations`) are multi-turn chats (16 conversations of
3 turns, 48 requests) behind six or seven 512-token system prompts, sent one request at a
time, so that the arrival order is exact. The device pool holds 2,048 tokens and the host
pool twice that, so system prompts and conversations leave the device for the host and
come back, the host itself evicts, and a request's hit often spans both tiers (a system
prompt still on the device, the rest of its conversation on the host).

What the trace has to model, as the server does it (SGLang 0.5.18's scheduler and
``hiradix.sglang``'s ``cache_unfinished_req`` / ``cache_finished_req``):

* **Each request is two inserts.** After its prefill the prompt is inserted
  (``cache_unfinished_req``: others can match it while it decodes), and when it finishes
  the prompt and the generated tokens whose KV is committed (the request's
  ``kv_committed_len``) are inserted. So each request is recorded as two trace records:
  the prompt, then the prompt and its answer. Only the first record's hits are the
  request's; the second one's are the prompt's own, all on the device. Without the answers
  the next turn of a conversation would find its last answer missing (the check fails:
  asserted below), and without the prompt record the tree's nodes would split in other
  places, so evictions would free other amounts.
* **The answer's last token.** Its KV is computed only by a decode step after it. With
  the overlap scheduler (SGLang's default, run here) that step is already prepared when
  the request finishes (``prepare_for_decode``: its slot allocated and counted in
  ``kv_committed_len``), so the whole answer is inserted; without it
  (``--disable-overlap-schedule``), all but the last token, and the trace follows the
  server's setting. Measured: a trace without the last token, under the overlap
  scheduler, fell one token short in every hit that reached an earlier answer (28 of the
  first workload's 48 requests).
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

One difference is SGLang's report, not the cache: ``cached_tokens_details`` counts a host
tail too short to load back as ``host`` (and takes it off ``device``), although it was
recomputed and the device served the rest (:func:`server_hits` reads it back; 1 of the
96 requests here, a conversation whose 8-token answer alone had left the device).

Each workload starts from an empty tree (``/flush_cache``: the server's readiness probes
send a request too). With sequential arrivals the server's device pool holds nothing but
the tree and the one running request, as the simulator's does, so the hits are expected
equal, not close: the test asserts equality for every request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hiradix.sim.generators import MooncakeWorkload
from hiradix.sim.run import SimResult, simulate
from hiradix.sim.trace import BLOCK_TOKENS, parse_line
from tests.e2e.server import only_on
from tests.e2e.workload import conversations, serve_conversations

#: ``(system prompts, seed)`` of the workloads (:func:`workload.conversations`), 48
#: requests each, served one after the other on one server, each from an empty tree.
WORKLOADS = ((6, 30), (7, 5))
PREFIX_LEN = 512  # a system prompt: one trace block
#: hiradix's default, which the server's cache uses (``hiradix.cache.HiRadixCache``): a
#: host tail shorter than this is recomputed, not loaded back.
LOAD_BACK_THRESHOLD = 10
HIRADIX = (
    "--enable-hierarchical-cache",
    "--radix-cache-backend",
    "hiradix",
    "--max-total-tokens",
    "2048",
    "--hicache-ratio",
    "2",
    "--page-size",
    "1",
    "--enable-cache-report",
)


def server_sequences(
    prompts: Sequence[Sequence[int]], answers: Sequence[dict[str, Any]], overlap: bool
) -> list[tuple[int, ...]]:
    """What the server inserts into its tree for each request, in order: the prompt (after
    its prefill), then the prompt and the answer's tokens whose KV was committed (at its
    finish): all of them with the ``overlap`` scheduler, all but the last without it
    (module docstring)."""
    out: list[tuple[int, ...]] = []
    for prompt, answer in zip(prompts, answers, strict=True):
        output = answer["output_ids"]
        out.append(tuple(prompt))
        out.append(tuple(prompt) + tuple(output[: len(output) - (not overlap)]))
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
    return simulate(
        MooncakeWorkload(path),
        page_size=page,
        device_tokens=device,
        host_tokens=host,
        eviction_policy=info["radix_eviction_policy"],
        write_policy=info["hicache_write_policy"],
        l3_backend=None,
        load_back_threshold=LOAD_BACK_THRESHOLD,
    )


def server_hits(answers: Sequence[dict[str, Any]]) -> tuple[list[tuple[int, int]], int]:
    """``(device, host)`` tokens each answer reused, from its ``cached_tokens_details``
    (none: nothing was cached), and how many answers were read through the rule below.

    SGLang splits a cached prefix with ``split_cached_prefix_by_tier``: ``host`` is the
    match's host hit and ``device`` the rest of the prefix after load-back, whether the
    host part was loaded back or not. A host tail shorter than the load-back threshold
    is never loaded (it is recomputed): the device then served the whole cached prefix
    and the host nothing, which SGLang reports as ``host`` = the tail and ``device`` short
    by as much. Such an answer is read as ``(device + host, 0)``."""
    hits, reread = [], 0
    for a in answers:
        meta = a["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        device, host = int(details.get("device", 0)), int(details.get("host", 0))
        assert int(meta.get("cached_tokens") or 0) == device + host, meta  # no third tier here
        if 0 < host < LOAD_BACK_THRESHOLD:
            device, host = device + host, 0
            reread += 1
        hits.append((device, host))
    return hits, reread


def sim_hits(result: SimResult) -> list[tuple[int, int]]:
    """``(device, host)`` hit tokens of the requests' prompt records (every other record)."""
    device, host = result.timeline["device_hit"][0::2], result.timeline["host_hit"][0::2]
    return [(int(d), int(h)) for d, h in zip(device, host, strict=True)]


def test_sim_replay_hits_equal_the_servers_per_request(servers, tmp_path: Path) -> None:
    only_on(
        ("0.5.18",),
        "the simulator's cache is the same code on every version; one run checks the trace's "
        "model of a server's inserts, written for 0.5.18's scheduler",
    )
    server = servers.start(HIRADIX, name="sim-check")
    info = server.request("/get_server_info")
    assert info["page_size"] == 1 and info["radix_eviction_policy"] == "lru", info
    overlap = not info["disable_overlap_schedule"]
    want: list[tuple[int, int]] = []
    got: list[tuple[int, int]] = []
    naive: list[tuple[int, int]] = []
    ideal: list[int] = []
    reread = host_evicted = 0
    for k, (n_prefixes, seed) in enumerate(WORKLOADS):
        work = conversations(
            n_prefixes=n_prefixes,
            prefix_len=PREFIX_LEN,
            n_conversations=16,
            turns=3,
            message_len=32,
            max_new_tokens=8,
            seed=seed,
        )
        server.flush_cache()  # an empty tree, as the simulator's
        prompts, answers = serve_conversations(server, work)
        hits, n = server_hits(answers)
        want += hits
        reread += n

        sequences = server_sequences(prompts, answers, overlap=overlap)
        lines = mooncake_lines(sequences)
        shared = assert_same_sharing(sequences, lines)
        # what each prompt shares with the sequences before it: all that a cache without
        # limits would hit; SGLang's match limit (len - 1) never binds
        tops = [max((int(shared[2 * i, j]) for j in range(2 * i)), default=0) for i in range(len(prompts))]
        assert all(t <= len(p) - 1 for t, p in zip(tops, prompts, strict=True))
        ideal += tops

        result = replay(lines, tmp_path / f"trace-{k}.jsonl", info)
        assert result.stats.requests == len(sequences) and result.stats.too_large_requests == 0
        got += sim_hits(result)
        host_evicted += result.stats.host_evicted_tokens
        prompts_only = replay(mooncake_lines(prompts), tmp_path / f"prompts-{k}.jsonl", info)
        naive += [
            (int(d), int(h))
            for d, h in zip(prompts_only.timeline["device_hit"], prompts_only.timeline["host_hit"], strict=True)
        ]

    differ = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert differ == [], f"(request, server (device, host), simulator (device, host)): {differ}"

    # The check is not vacuous: requests hit each tier alone and both at once, hit the
    # answers of earlier turns, had a host tail too short to load, lost some of their
    # history to evictions (the host's too); and a trace of the prompts alone (without
    # the answers the server caches) disagrees.
    assert any(d and not h for d, h in want) and any(h and not d for d, h in want), want
    assert any(d and h for d, h in want), want
    assert any(d + h > PREFIX_LEN for d, h in want), want
    assert reread > 0
    assert host_evicted > 0 and any(d + h < t for (d, h), t in zip(want, ideal, strict=True))
    assert sum(a != b for a, b in zip(naive, want, strict=True)) > len(want) // 3
