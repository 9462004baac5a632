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

The module's four servers start side by side and serve all its tests: the decode server,
prefill A (the conversations above), prefill B (the next turn on the other prefill reads
its prefix through the peer cache) and a prefill with hiradix's own key format (the
control: it never hits decode's pages). Then the faults of issue 45's item 4, on the same
servers: requests aborted while their KV is in flight, prefill B killed mid-conversation,
and the decode server restarted between turns (the last test: every pair shares it).
``docs/sglang/pd.md`` has the configuration, what a CPU machine needs and what each fault
produced.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from hiradix import envvars
from tests.e2e.pd import MOONCAKE_MISSING, PREFILL_ON_CPU, TRANSFER, PDPair
from tests.e2e.server import REQUEST_TIMEOUT_S, ServerError, free_port, only_on
from tests.e2e.workload import conversations, tier_hits

# Skipped where mooncake is missing, except where the real-server tests are required (CI):
# there the fixture below fails, naming the package, rather than the PD tests guarding nothing.
REQUIRED = envvars.flag("HIRADIX_E2E_REQUIRED")
pytestmark = pytest.mark.skipif(MOONCAKE_MISSING is not None and not REQUIRED, reason=MOONCAKE_MISSING or "")

TOKEN = {"HIRADIX_CLUSTER_TOKEN": "e2e-pd-cluster-token"}
#: Stand-ins for stock SGLang's CUDA-only host-pool steps (inject/sitecustomize.py): the
#: decode server's offload manager builds stock's host pool.
STOCK_ON_CPU = {"HIRADIX_E2E_STOCK_ON_CPU": "1"}
#: SGLang's idle memory check, strict: a leaked slot or lock stops the scheduler (as in the
#: other real-server tests).
STRICT_MEM = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
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


def _peer(rpc_port: int, seeds: list[str], l3_format: str = "sglang", **more: object) -> tuple[str, ...]:
    extra = {
        "backend_name": "hiradix-PeerStorage",
        "module_path": "hiradix.sglang.storage",
        "class_name": "PeerStorage",
        "interface_v1": 1,
        "l3_format": l3_format,
        "rpc_port": rpc_port,
        "seeds": seeds,
        "pool_size": "256MiB",
        "transport": "tcp",
        "connect_timeout_s": 1.0,
        "rpc_timeout_s": 2.0,
        "read_timeout_s": 2.0,
        "join_timeout_s": 120.0,  # the servers start side by side
        **more,
    }
    return ("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra))


def _prefill_args(bootstrap: int, peer_port: int, seeds: list[str], l3_format: str, **more: object) -> tuple[Any, ...]:
    """A prefill server with hiradix's cache and the peer cache as L3 in ``l3_format``."""
    return (
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
        # the answer's pages are a few tokens beyond the prefill's own prefix: prefetch them,
        # and wait for them, so the hit is the same on every run
        "--hicache-storage-prefetch-policy",
        "wait_complete",
        *_peer(peer_port, seeds, l3_format, prefetch_threshold=4, **more),
    )


@dataclass(frozen=True)
class Deployment:
    """The module's servers: one decode server and three prefill servers in one peer
    cluster, each prefill paired with the decode server. ``pair`` and ``other`` have
    SGLang's key format, ``hiradix_keys`` hiradix's own. ``decode_metrics`` and
    ``prefill_metrics``: the ports of the decode's and ``pair``'s prefill's peer nodes'
    metrics endpoints."""

    pair: PDPair
    other: PDPair
    hiradix_keys: PDPair
    decode_metrics: int
    prefill_metrics: int


@pytest.fixture(scope="module")
def pd(module_servers: Any) -> Iterator[Deployment]:
    """The module's servers, all started at once (a server takes 40-80 s to come up here;
    side by side, four take about as long as two one after the other)."""
    only_on(("0.5.18", "0.5.23"), "the issue's two versions; 0.5.20's PD path is 0.5.23's")
    if MOONCAKE_MISSING is not None:
        pytest.fail(f"HIRADIX_E2E_REQUIRED=1 and the PD tests cannot run: {MOONCAKE_MISSING}")
    peer_port, decode_metrics, prefill_metrics = free_port(), free_port(), free_port()
    seeds = [f"127.0.0.1:{peer_port}"]  # the first prefill's peer node seeds the cluster
    bootstraps = {name: free_port() for name in ("pd-prefill", "pd-prefill-b", "pd-prefill-hiradix-keys")}
    prefill_env = {**TOKEN, **PREFILL_ON_CPU, **STRICT_MEM}
    to_start = {
        "pd-prefill": (
            _prefill_args(
                bootstraps["pd-prefill"], peer_port, [], "sglang", metrics_enabled=True, metrics_port=prefill_metrics
            ),
            prefill_env,
        ),
        "pd-prefill-b": (_prefill_args(bootstraps["pd-prefill-b"], 0, seeds, "sglang"), prefill_env),
        "pd-prefill-hiradix-keys": (
            _prefill_args(bootstraps["pd-prefill-hiradix-keys"], 0, seeds, "hiradix"),
            prefill_env,
        ),
        "pd-decode": (
            (
                "--disaggregation-mode",
                "decode",
                "--disaggregation-decode-enable-offload-kvcache",
                *TRANSFER,
                *HOST_POOL,
                "--max-total-tokens",
                "4096",
                "--enable-cache-report",
                *_peer(0, seeds, metrics_enabled=True, metrics_port=decode_metrics),
            ),
            {**TOKEN, **STOCK_ON_CPU, **STRICT_MEM},
        ),
    }
    started: dict[str, Any] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        args, env = to_start[name]
        try:
            started[name] = module_servers.start(args, name=name, env=env)
        except BaseException as e:  # raised below, once all have finished starting
            errors.append(e)

    threads = [threading.Thread(target=start, args=(name,)) for name in to_start]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    decode = started["pd-decode"]
    assert "Enable offload kv cache for decode side" in decode.log_text()
    pairs = {}
    for name, bootstrap in bootstraps.items():
        assert "hiradix: hierarchical radix cache" in started[name].log_text()  # hiradix's cache on prefill
        pairs[name] = PDPair(started[name], decode, bootstrap, name=name.replace("-prefill", ""))
    yield Deployment(
        pairs["pd-prefill"], pairs["pd-prefill-b"], pairs["pd-prefill-hiradix-keys"], decode_metrics, prefill_metrics
    )


def _peer_metric(metrics_port: int, name: str) -> float:
    """The sum of ``name``'s samples on a peer node's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.split("{")[0].split(" ")[0] == name)


def _pages_written(metrics_port: int) -> float:
    """Pages the decode server's peer node has written to the peer cache."""
    return _peer_metric(metrics_port, "hiradix_peer_write_requests_total")


def _peer_reads(metrics_port: int) -> tuple[float, float]:
    """A peer node's pages asked for and pages found (and verified)."""
    return (
        _peer_metric(metrics_port, "hiradix_peer_read_requests_total"),
        _peer_metric(metrics_port, "hiradix_peer_read_hits_total"),
    )


def _wait_members(metrics_port: int, members: int, timeout: float = 60.0) -> None:
    """Until a peer node's view of the cluster has ``members`` live members."""
    deadline = time.monotonic() + timeout
    while (seen := _peer_metric(metrics_port, "hiradix_peer_members")) != members:
        assert time.monotonic() < deadline, f"the peer node sees {seen} members, not {members}"
        # Polling the node's membership gauge: no event of its to wait on from here.
        time.sleep(0.2)


def _wait_pages_written(metrics_port: int, pages: float, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (written := _pages_written(metrics_port)) < pages:
        assert time.monotonic() < deadline, f"decode wrote {written} pages to L3 of {pages} expected"
        # Polling the decode node's counter: no event of its to wait on from here.
        time.sleep(0.2)


class Chats:
    """``n`` conversations of :func:`~tests.e2e.workload.conversations`, served a turn at a
    time through a PD pair (four requests at a time), each turn carrying the earlier turns
    and answers."""

    def __init__(self, n: int, seed: int) -> None:
        self.work = conversations(n_prefixes=4, prefix_len=256, n_conversations=n, turns=TURNS, seed=seed)
        self.history = [list(self.work.prefixes[p]) for p in self.work.prefix_of]
        self.previous: list[list[int]] = [[] for _ in self.history]  # each one's last prompt

    def turn(self, pair: PDPair, judge: Any, t: int) -> list[dict[str, Any]]:
        """Serve turn ``t`` of every conversation, judge the answers and return them."""
        prompts = [h + list(self.work.messages[c][t]) for c, h in enumerate(self.history)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: pair.generate(p, ANSWER), prompts))
        judge(pair, prompts, answers, ANSWER)
        for c, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            self.previous[c] = prompt
            self.history[c] = prompt + list(answer["output_ids"])
        return answers


#: Pages of a turn's answer that decode holds KV for and writes to L3.
ANSWER_PAGES = (ANSWER - 1) // PAGE


def test_next_turns_prefill_reads_the_answer_decode_wrote(pd: Deployment, judge: Any) -> None:
    """16 conversations x 3 turns behind shared system prompts, each turn carrying the
    earlier turns and answers. After each turn the decode server has written every
    answer's pages to L3 (its peer node's count of pages written, which only decode's
    offload feeds); then every request of the next turn hits, on the prefill server, its
    whole previous prompt and that answer's pages, those from L3: the prefill server never
    computed them. Outputs equal ground truth."""
    chats = Chats(CONVERSATIONS, seed=45)
    written = _pages_written(pd.decode_metrics)
    hits_by_turn: list[int] = []
    for turn in range(TURNS):
        previous = [list(p) for p in chats.previous]
        answers = chats.turn(pd.pair, judge, turn)
        storage = 0
        for c, answer in enumerate(answers):
            meta = answer["meta_info"]
            tiers = meta.get("cached_tokens_details") or {}
            storage += int(tiers.get("storage") or 0)
            if turn == 0:
                continue
            # Turn n's answer starts where turn n's prompt ended: the prefill server never
            # computed those tokens, so a hit past that point is a page decode wrote.
            covered = len(previous[c]) + ANSWER_PAGES * PAGE
            assert meta["cached_tokens"] >= covered, (
                f"turn {turn + 1}, conversation {c}: the prefill hit {meta['cached_tokens']} tokens, "
                f"not the {len(previous[c])}-token previous prompt and its answer's {ANSWER_PAGES} pages: {tiers}"
            )
            assert int(tiers.get("storage") or 0) >= ANSWER_PAGES * PAGE, (turn, c, tiers)
        hits_by_turn.append(storage)
        written += CONVERSATIONS * ANSWER_PAGES
        # The next turn must find this turn's answers in L3: decode writes them after it answers.
        _wait_pages_written(pd.decode_metrics, written)
    print(f"storage hits (tokens) by turn: {hits_by_turn}")
    assert pd.pair.alive()


def test_next_turn_on_the_other_prefill_reads_its_prefix_through_the_peer_cache(pd: Deployment, judge: Any) -> None:
    """Four conversations whose turns alternate between two prefill servers (A, B, A), one
    decode server behind both. Before each next turn, the prefill server that served the
    turn has its cache flushed (which returns once its writes to L3 are done, and empties
    its tree) and decode has written the answers. So each next turn's whole prefix comes
    from the peer cache: the earlier prompts from the other prefill's pool (or, for A's
    third turn, from both), the answers from decode's. Outputs equal ground truth."""
    chats = Chats(4, seed=47)
    written = _pages_written(pd.decode_metrics)
    hits_by_turn: list[dict[str, int]] = []
    for turn, pair in enumerate((pd.pair, pd.other, pd.pair)):
        previous = [list(p) for p in chats.previous]
        answers = chats.turn(pair, judge, turn)
        hits_by_turn.append(tier_hits(answers))
        for c, answer in enumerate(answers):
            if turn == 0:
                continue
            meta = answer["meta_info"]
            tiers = meta.get("cached_tokens_details") or {}
            # Past its system prompt (which a conversation served just before may have put
            # on the device), a conversation's tokens are its own: this prefill server
            # holds none of them, so all of them come from the peer cache.
            covered = len(previous[c]) + ANSWER_PAGES * PAGE
            own = covered - len(chats.work.prefixes[chats.work.prefix_of[c]])
            assert meta["cached_tokens"] >= covered and int(tiers.get("storage") or 0) >= own, (
                f"turn {turn + 1} on {pair.name}, conversation {c}: {meta['cached_tokens']} tokens hit ({tiers}) of "
                f"a {len(previous[c])}-token previous prompt and its answer's {ANSWER_PAGES} pages, at least {own} "
                "of them from the peer cache"
            )
        pair.prefill.flush_cache()
        written += 4 * ANSWER_PAGES
        _wait_pages_written(pd.decode_metrics, written)
    print(f"hits (tokens) by turn, A, B, A: {hits_by_turn}")
    assert pd.pair.alive() and pd.other.alive()


def test_a_prefill_with_hiradix_keys_never_hits_decodes_pages(pd: Deployment, judge: Any) -> None:
    """The control: a prefill server in the same peer cluster with hiradix's own (default)
    ``l3_format``, whose keys are namespaced, against the same decode server. Decode writes
    every answer's pages as before, and the next turn on this prefill hits none of them (its
    cache covers at most the previous prompt): decode's pages are found only under SGLang's
    keys. Outputs equal ground truth."""
    pair = pd.hiradix_keys
    chats = Chats(4, seed=46)
    written = _pages_written(pd.decode_metrics)
    chats.turn(pair, judge, 0)
    _wait_pages_written(pd.decode_metrics, written + 4 * ANSWER_PAGES)
    previous = [list(p) for p in chats.previous]
    for c, answer in enumerate(chats.turn(pair, judge, 1)):
        meta = answer["meta_info"]
        assert meta["cached_tokens"] <= len(previous[c]), (c, len(previous[c]), meta.get("cached_tokens_details"))


# ---------------------------------------------------------------------------- faults
# Issue 45, item 4. Each fault ends in exact outputs (judged against ground truth) or a
# clear error for the request it hit, never a hang, a dead scheduler or a wrong token. They
# run after the tests above, on the module's servers: the one that kills prefill B, then
# the one that restarts the decode server (the last: every pair shares it).

#: What SGLang's idle memory check logs (``raise_error_or_warn``; it raises instead under
#: ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``, which every PD server here runs with).
LEAKS = ("memory leak detected", "KV double free", "use-after-free")


def _no_leaks(*servers: Any) -> None:
    for server in servers:
        text = server.log_text()
        assert not any(leak in text for leak in LEAKS), f"{server.name} logged a leak:\n{server.log_tail(60)}"


def test_requests_aborted_while_their_kv_is_in_flight(pd: Deployment, judge: Any) -> None:
    """Four requests, each aborted by its ``rid`` on both servers as soon as the prefill
    server has run the first of their batches (their KV on its way to decode, or decoding).
    Each ends in a finished answer (judged), an aborted one or a clear error, none hangs;
    then the same prompts served again are exact, both servers stay up, and neither logs a
    leaked slot (their idle memory check is strict: a leak would stop the scheduler)."""
    pair = pd.pair
    chats = Chats(4, seed=50)
    prompts = [h + list(chats.work.messages[c][0]) for c, h in enumerate(chats.history)]
    rids = [f"pd-abort-{uuid.uuid4().hex}" for _ in prompts]
    outcomes: list[Any] = [None] * len(prompts)

    def send(i: int) -> None:
        try:
            outcomes[i] = pair.generate(prompts[i], 64, rid=rids[i])
        except ServerError as e:  # a clear error for this request: allowed
            outcomes[i] = e

    batches = pair.prefill.log_text().count("Prefill batch")
    senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in senders:
        t.start()
    pair.prefill.wait_log("Prefill batch", batches + 1, timeout=120)
    for rid in rids:
        for server in (pair.decode, pair.prefill):
            server.request("/abort_request", {"rid": rid})
    for t in senders:
        t.join(timeout=REQUEST_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in senders), "an aborted request never answered"
    finished = [
        i
        for i, o in enumerate(outcomes)
        if isinstance(o, dict)
        and ((o.get("decode_meta_info") or {}).get("finish_reason") or {}).get("type") == "length"
        and len(o["output_ids"]) == 64
    ]
    kinds = [
        "error" if isinstance(o, ServerError) else "finished" if i in finished else "aborted"
        for i, o in enumerate(outcomes)
    ]
    print(f"aborted requests: {kinds}")
    if finished:
        judge(pair, [prompts[i] for i in finished], [outcomes[i] for i in finished], 64)
    chats.turn(pair, judge, 0)  # the next requests: the same prompts, exact
    assert pair.alive()
    _no_leaks(pair.prefill, pair.decode)


def test_a_prefill_killed_mid_conversation_the_next_turn_on_the_other_misses(pd: Deployment, judge: Any) -> None:
    """Four conversations: turn 1 on prefill B, whose pages go to its peer pool (flushed),
    decode writes the answers; B is killed with ``kill -9``, its published pages gone. Turn
    2 goes to prefill A: its prefix starts with B's pages, so it reads nothing from L3
    (decode's answer pages follow B's in the chain) and recomputes; outputs exact, A up,
    no error, and A's view of the cluster drops B."""
    chats = Chats(4, seed=48)
    written = _pages_written(pd.decode_metrics)
    chats.turn(pd.other, judge, 0)
    pd.other.prefill.flush_cache()  # B's pages are in its peer pool
    _wait_pages_written(pd.decode_metrics, written + 4 * ANSWER_PAGES)
    members = _peer_metric(pd.prefill_metrics, "hiradix_peer_members")
    asked, found = _peer_reads(pd.prefill_metrics)
    pd.other.prefill.kill9()
    start = time.monotonic()
    answers = chats.turn(pd.pair, judge, 1)
    took = time.monotonic() - start
    storage = [int((a["meta_info"].get("cached_tokens_details") or {}).get("storage") or 0) for a in answers]
    asked2, found2 = _peer_reads(pd.prefill_metrics)
    print(
        f"prefill B killed: turn 2 on A in {took:.1f} s, storage hits {storage}, "
        f"A's peer reads: {asked2 - asked:.0f} pages asked for, {found2 - found:.0f} found"
    )
    assert storage == [0] * 4, storage
    assert pd.pair.alive(), pd.pair.prefill.log_tail()
    _wait_members(pd.prefill_metrics, members - 1)
    _no_leaks(pd.pair.prefill, pd.pair.decode)


def test_decode_restarted_between_turns_its_stale_pages_are_misses(pd: Deployment, judge: Any) -> None:
    """SGLang issue #30322 (a stale L3 entry after a decode restart made ``load_back``
    fail). Four conversations: turn 1 served, decode has written the answers to its peer
    node's pool; decode is killed with ``kill -9`` and started again (its peer node comes
    back empty, under a new id). Turn 2: the previous answers' pages are gone, so the
    prefill hits at most the previous prompt and recomputes the rest; outputs exact, the
    prefill's scheduler up. Turn 3: the restarted decode wrote turn 2's answers, and the
    prefill reads them from L3 again."""
    pair = pd.pair
    chats = Chats(4, seed=49)
    written = _pages_written(pd.decode_metrics)
    chats.turn(pair, judge, 0)
    _wait_pages_written(pd.decode_metrics, written + 4 * ANSWER_PAGES)
    members = _peer_metric(pd.prefill_metrics, "hiradix_peer_members")
    pair.decode.kill9()
    pair.decode.start()  # a fresh port; the same peer metrics port, its counters from 0
    assert "Enable offload kv cache for decode side" in pair.decode.log_text()
    _wait_members(pd.prefill_metrics, members)  # the old decode node gone, the new one in
    asked, found = _peer_reads(pd.prefill_metrics)
    previous = [list(p) for p in chats.previous]
    answers = chats.turn(pair, judge, 1)
    asked2, found2 = _peer_reads(pd.prefill_metrics)
    details = [a["meta_info"].get("cached_tokens_details") for a in answers]
    print(
        f"decode restarted: turn 2 hits {details}, "
        f"the prefill's peer reads: {asked2 - asked:.0f} pages asked for, {found2 - found:.0f} found"
    )
    for c, answer in enumerate(answers):
        assert answer["meta_info"]["cached_tokens"] <= len(previous[c]), (c, len(previous[c]), details[c])
        assert int((details[c] or {}).get("storage") or 0) == 0, (c, details[c])
    assert pair.prefill.alive(), pair.prefill.log_tail()
    _wait_pages_written(pd.decode_metrics, 4 * ANSWER_PAGES)
    previous = [list(p) for p in chats.previous]
    answers = chats.turn(pair, judge, 2)
    for c, answer in enumerate(answers):
        meta = answer["meta_info"]
        tiers = meta.get("cached_tokens_details") or {}
        assert meta["cached_tokens"] >= len(previous[c]) + ANSWER_PAGES * PAGE, (c, len(previous[c]), tiers)
        assert int(tiers.get("storage") or 0) >= ANSWER_PAGES * PAGE, (c, tiers)
    print(f"turn 3 after the restart: storage hits {[a['meta_info']['cached_tokens_details'] for a in answers]}")
    assert pair.alive()
    _no_leaks(pair.prefill, pair.decode)
