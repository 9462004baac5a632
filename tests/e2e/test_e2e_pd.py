"""Prefill/decode disaggregation with the peer cache, in real SGLang servers (issue 45).

One prefill server runs hiradix's cache (``--radix-cache-backend hiradix``) with HiCache
and the peer cache as L3; one decode server runs stock SGLang's decode with
``--disaggregation-decode-enable-offload-kvcache`` into the same peer cluster (its own peer
node, through SGLang's ``dynamic`` loader and hiradix's ``PeerStorage``). KV goes from
prefill to decode over ``mooncake_tcp``; the test plays the router (:mod:`tests.e2e.pd`).

Decode writes the pages it generated to L3 under SGLang's key chain (its
``DecodeKVCacheOffloadManager``: token-only ``get_hash_str`` chained on the prompt's page
hashes), so the prefill node reads them only with ``"l3_format": "sglang"`` (keys and page
bytes exactly SGLang's) and the same ``--hicache-mem-layout`` as decode's host pool. Then
in a multi-turn conversation, turn n+1's prefill reads turn n's answer from L3: pages the
prefill server never computed, written only by decode. Asserted per request, with every
output judged against ground truth (``transformers``, the ``judge`` fixture).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.pd import MOONCAKE_MISSING, PREFILL_ON_CPU, TRANSFER, PDPair
from tests.e2e.server import free_port, only_on
from tests.e2e.workload import conversations

pytestmark = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=MOONCAKE_MISSING or "")

TOKEN = {"HIRADIX_CLUSTER_TOKEN": "e2e-pd-cluster-token"}
#: Stand-ins for stock SGLang's CUDA-only host-pool steps (inject/sitecustomize.py): the
#: decode server's offload manager builds stock's host pool.
STOCK_ON_CPU = {"HIRADIX_E2E_STOCK_ON_CPU": "1"}
#: Both sides' host pools: SGLang's direct copies, layer_first (stock's only CPU layout);
#: SGLang-format pages must have the same layout on both sides.
HOST_POOL = ("--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--hicache-ratio", "2")

TURNS = 3
CONVERSATIONS = 16
#: Tokens a turn generates. Decode holds KV for all but the last (never forwarded), and the
#: next prefill loads those pages from host only if there are at least the cache's
#: ``load_back_threshold`` (10 tokens, SGLang's default): shorter, they are prefetched from
#: L3 and recomputed (SGLang still counts them as storage hits, and as cached tokens less
#: the same number of device tokens).
ANSWER = 16
PAGE = 1  # SGLang's default page size on the CPU


def _peer(rpc_port: int, seeds: list[str], **more: object) -> tuple[str, ...]:
    extra = {
        "backend_name": "hiradix-PeerStorage",
        "module_path": "hiradix.sglang.storage",
        "class_name": "PeerStorage",
        "interface_v1": 1,
        "l3_format": "sglang",  # decode's keys and pages are SGLang's
        "rpc_port": rpc_port,
        "seeds": seeds,
        "pool_size": "256MiB",
        "transport": "tcp",
        "connect_timeout_s": 1.0,
        "rpc_timeout_s": 2.0,
        "read_timeout_s": 2.0,
        "join_timeout_s": 120.0,  # the two servers start side by side
        **more,
    }
    return ("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra))


@pytest.fixture(scope="module")
def pd(module_servers: Any) -> Iterator[tuple[PDPair, int]]:
    """The PD pair, and the port of the decode peer node's metrics endpoint. Both servers
    start at once (a server takes 40-80 s to come up here)."""
    only_on(("0.5.18", "0.5.23"), "the issue's two versions; 0.5.20's PD path is 0.5.23's")
    bootstrap, peer_port, decode_metrics = free_port(), free_port(), free_port()
    prefill_args = (
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        bootstrap,
        *TRANSFER,
        "--enable-hierarchical-cache",
        "--radix-cache-backend",
        "hiradix",
        *HOST_POOL,
        "--max-total-tokens",
        "4096",
        "--enable-cache-report",
        # the answer pages are a few tokens beyond the prefill's own prefix: prefetch them,
        # and wait for them, so the hit is the same on every run
        "--hicache-storage-prefetch-policy",
        "wait_complete",
        *_peer(peer_port, [], prefetch_threshold=4),
    )
    decode_args = (
        "--disaggregation-mode",
        "decode",
        "--disaggregation-decode-enable-offload-kvcache",
        *TRANSFER,
        *HOST_POOL,
        "--max-total-tokens",
        "4096",
        "--enable-cache-report",
        *_peer(0, [f"127.0.0.1:{peer_port}"], metrics_enabled=True, metrics_port=decode_metrics),
    )
    started: dict[str, Any] = {}
    errors: list[BaseException] = []

    def start(name: str, args: tuple[Any, ...], env: dict[str, str]) -> None:
        try:
            started[name] = module_servers.start(args, name=name, env=env)
        except BaseException as e:  # raised below, once both have finished starting
            errors.append(e)

    threads = [
        threading.Thread(target=start, args=("pd-prefill", prefill_args, {**TOKEN, **PREFILL_ON_CPU})),
        threading.Thread(target=start, args=("pd-decode", decode_args, {**TOKEN, **STOCK_ON_CPU})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    prefill, decode = started["pd-prefill"], started["pd-decode"]
    assert "hiradix: hierarchical radix cache" in prefill.log_text()  # hiradix's cache on prefill
    assert "Enable offload kv cache for decode side" in decode.log_text()
    yield PDPair(prefill, decode, bootstrap), decode_metrics


def _pages_written(metrics_port: int) -> float:
    """Pages the decode server's peer node has written to the peer cache."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("hiradix_peer_write_requests_total"))


def _wait_pages_written(metrics_port: int, pages: float, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (written := _pages_written(metrics_port)) < pages:
        assert time.monotonic() < deadline, f"decode wrote {written} pages to L3 of {pages} expected"
        # Polling the decode node's counter: no event of its to wait on from here.
        time.sleep(0.2)


def test_next_turns_prefill_reads_the_answer_decode_wrote(pd: tuple[PDPair, int], judge: Any) -> None:
    """16 conversations x 3 turns behind shared system prompts, each turn carrying the
    earlier turns and answers; the conversations of one turn go four at a time. After each
    turn the decode server has written every answer's pages to L3 (its peer node's count
    of pages written, which only decode's offload feeds); then every request of the next
    turn hits, on the prefill server, its whole previous prompt and that answer's pages,
    part of them from L3: the answer's pages exist only there. Outputs equal ground truth."""
    pair, decode_metrics = pd
    work = conversations(n_prefixes=4, prefix_len=256, n_conversations=CONVERSATIONS, turns=TURNS, seed=45)
    history = [list(work.prefixes[p]) for p in work.prefix_of]
    previous: list[list[int]] = [[] for _ in history]
    answer_pages = (ANSWER - 1) // PAGE
    written = _pages_written(decode_metrics)
    hits_by_turn: list[int] = []
    for turn in range(TURNS):
        prompts = [history[c] + list(work.messages[c][turn]) for c in range(CONVERSATIONS)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: pair.generate(p, ANSWER), prompts))
        judge(pair, prompts, answers, ANSWER)
        storage = 0
        for c, answer in enumerate(answers):
            meta = answer["meta_info"]
            tiers = meta.get("cached_tokens_details") or {}
            storage += int(tiers.get("storage") or 0)
            if turn == 0:
                continue
            # Turn n's answer starts where turn n's prompt ended: the prefill server never
            # computed those tokens, so a hit past that point is a page decode wrote.
            covered = len(previous[c]) + answer_pages * PAGE
            assert meta["cached_tokens"] >= covered, (
                f"turn {turn + 1}, conversation {c}: the prefill hit {meta['cached_tokens']} tokens, "
                f"not the {len(previous[c])}-token previous prompt and its answer's {answer_pages} pages: {tiers}"
            )
            assert int(tiers.get("storage") or 0) >= answer_pages * PAGE, (turn, c, tiers)
        hits_by_turn.append(storage)
        written += CONVERSATIONS * answer_pages
        # The next turn must find this turn's answers in L3: decode writes them after it answers.
        _wait_pages_written(decode_metrics, written)
        for c in range(CONVERSATIONS):
            previous[c] = prompts[c]
            history[c] = prompts[c] + list(answers[c]["output_ids"])
    print(f"storage hits (tokens) by turn: {hits_by_turn}")
    assert pair.alive()
