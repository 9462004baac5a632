"""KV cache events (issue 11) on SGLang 0.5.23: with ``enable_kv_cache_events`` hiradix's
cache emits the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events of 0.5.23's
own ``UnifiedRadixCache`` (whose ``KVCacheEventRecorder`` runs on CPU): the same block ids
(namespaced by a LoRA adapter's ``extra_key``, or with ``format: dynamo`` by ``extra_key``
and ``cache_salt``), parents, tokens, media, ``cache_salt`` / ``session_id`` /
``lora_name`` fields and coalescing, in the same order, given the same operations
(:class:`Twin`): inserts, matches that split, backups acknowledged, evictions to the host,
an insert over evicted nodes, loads back, host evictions and resets, with and without
EAGLE bigram keys, on both of SGLang's tree cores (its default Rust one and the Python
one). An L3 prefetch's events are pinned (SGLang's own L3 path is not run beside it).

The ids are also pinned against SGLang's own hash helpers (``get_hash_str``,
``hash_str_to_int64``, ``kv_event_namespace_seed``, ``namespaced_block_hash``).
"""

from __future__ import annotations

import hashlib
import os
import random
from array import array
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
    kv_event_namespace_seed,
    namespaced_block_hash,
)
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64
from sglang23_env import build, build_hiradix
from sglang_pools import LAYERS, key, match, settle
from test_sglang23_cache import admit

import hiradix.sglang as hs

pytestmark = pytest.mark.usefixtures("sglang_cpu")


@pytest.fixture(params=["rust", "python"])
def tree_core(request, monkeypatch) -> str:
    """SGLang's tree core, picked as a server picks it: its default (Rust) or the Python
    one (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python). They differ in one thing hiradix
    follows: the Rust core coalesces removals only within one extra_key."""
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", request.param)
    return str(request.param)

GPU, CPU = StorageMedium.GPU, StorageMedium.CPU
LORA_ID = "0123456789abcdef0123456789abcdef"  # a LoRARef.lora_id: 32 hex characters
LORA_KEY = "adapter-prefix" + LORA_ID  # Req puts the adapter's id at the end of extra_key


def lora_names() -> KvEventLoraNames:
    """The scheduler's table, after admitting a request of adapter ``sql-lora``."""
    names = KvEventLoraNames()
    names.register(lora_id=LORA_ID, lora_name="sql-lora")

    class _Req:
        lora_id, extra_key = LORA_ID, LORA_KEY

    names.register(_Req(), "sql-lora")
    return names


def insert(env: Any, tokens: list[int], session_id: str | None = None, **kw: Any) -> int:
    """``sglang_pools.insert`` with the request's session (0.5.23's ``InsertParams``);
    frees the slots of the prefix that was on the device and returns its length.

    (0.5.23's own insert counts the evicted nodes it refills with the new slots in its
    ``prefix_len``, as adopted ranges; hiradix's does not, and keeps them. The length on
    the device, read by a match first, is the duplicate part in both.)"""
    extra = 1 if getattr(env, "eagle", False) else 0  # EAGLE: n + 1 tokens are n bigrams, one slot each
    n = max(len(tokens) - extra, 0) // env.page_size * env.page_size
    on_device = int(match(env, tokens[: n + extra], **kw).device_prefix_len)
    slots = env.allocator.alloc(n)
    assert slots is not None
    env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
    res = env.cache.insert(InsertParams(key=key(tokens[: n + extra], **kw), value=slots, session_id=session_id))
    if isinstance(env.cache, hs.HiRadixCache):
        assert res.prefix_len == on_device
    if on_device:
        env.allocator.free(slots[:on_device])
    return on_device


def load_back(env: Any, tokens: list[int], **kw: Any) -> int:
    """Load the host part of ``tokens``' match back as the scheduler does, waiting on every
    layer's completion signal. Returns the tokens loaded."""
    cache = env.cache
    req = env.new_req(tokens, **kw)
    m = cache.match_prefix(MatchPrefixParams(key=key(tokens, **kw), req=req))
    if not m.host_hit_length:
        return 0
    req.last_node, req.prefix_len = m.last_device_node, m.device_prefix_len
    req.last_host_node, req.best_match_node, req.host_hit_length = m.last_host_node, m.best_match_node, \
        m.host_hit_length
    loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                        host_hit_length=m.host_hit_length, req=req))
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(cache.ready_to_load_host_cache())
    for layer in range(LAYERS):
        counter.wait_until(layer)
    cache.check_hicache_events()
    return int(loaded)


class Twin:
    """hiradix's cache and SGLang 0.5.23's ``UnifiedRadixCache``, built alike, given the
    same operations; after each, both return the same thing and queue the same events."""

    def __init__(self, page_size: int, size: int = 128, eagle: bool = False, write_policy: str = "write_through",
                 **params: Any) -> None:
        p = {"enable_kv_cache_events": True, **params}
        self.ours = build_hiradix(page_size, size=size * page_size, eagle=eagle, write_policy=write_policy, params=p)
        self.theirs = build(page_size=page_size, size=size * page_size, params={**p, "is_eagle": eagle},
                            hicache_write_policy=write_policy)
        self.ours.eagle = self.theirs.eagle = eagle
        core = type(self.theirs.cache.tree_core).__name__
        want = "RustUnifiedTreeCore" if os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND") != "python" \
            else "UnifiedTreeCore"
        assert core == want, f"SGLang built a {core}"
        self.stats: dict[str, int] = {}
        self.log: list[Any] = []  # every event compared, oldest first
        assert self.events("built") == [AllBlocksCleared()]

    def events(self, what: str) -> list[Any]:
        ours, theirs = self.ours.cache.take_events(), self.theirs.cache.take_events()
        assert ours == theirs, f"after {what}:\nhiradix {ours}\nSGLang  {theirs}"
        self.log += ours
        for e in ours:
            medium = getattr(e, "medium", None)
            name = type(e).__name__ + ("" if medium is None else " " + StorageMedium(medium).value)
            self.stats[name] = self.stats.get(name, 0) + 1
        return ours

    def both(self, what: str, op: Any) -> Any:
        ours, theirs = op(self.ours), op(self.theirs)
        assert ours == theirs, f"{what}: hiradix {ours}, SGLang {theirs}"
        self.events(what)
        self.ours.cache.check_invariants()
        return ours

    def insert(self, tokens: list[int], **kw: Any) -> int:
        return self.both(f"insert {tokens[:6]}.. {kw}", lambda env: insert(env, tokens, **kw))

    def match(self, tokens: list[int], **kw: Any) -> tuple[int, int]:
        def op(env: Any) -> tuple[int, int]:
            m = match(env, tokens, **kw)
            return int(m.device_prefix_len), int(m.host_hit_length)

        return self.both(f"match {tokens[:6]}..", op)

    def settle(self) -> None:
        def op(env: Any) -> None:
            if env is self.ours:
                settle(env)
            else:  # SGLang's L1 -> L2 copies are synchronous on CPU: one check acks them
                env.cache.check_hicache_events()

        self.both("settle", op)

    def evict(self, n: int) -> int:
        return self.both(f"evict {n}", lambda env: int(env.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted))

    def evict_host(self, n: int) -> int:
        return self.both(f"evict_host {n}", lambda env: int(env.cache.evict_host(n)))

    def load_back(self, tokens: list[int], **kw: Any) -> int:
        return self.both(f"load back {tokens[:6]}..", lambda env: load_back(env, tokens, **kw))

    def reset(self) -> None:
        self.both("reset", lambda env: env.cache.reset())


def sglang_ids(tokens: list[int], page_size: int, *, cache_salt: str | None = None,
               seed: bytes | None = None) -> list[int]:
    """The event ids of ``tokens``' pages, computed with SGLang's own helpers: the chain
    (seeded by the legacy salt digest), then namespaced."""
    prior = None
    if cache_salt is not None:
        prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode()).hexdigest()
    ids = []
    for i in range(0, len(tokens), page_size):
        prior = get_hash_str(tokens[i: i + page_size], prior)
        ids.append(namespaced_block_hash(hash_str_to_int64(prior), namespace_seed=seed))
    return ids


# ---------------------------------------------------------------------------- pinned ids
@pytest.mark.parametrize("dynamo", [False, True])
def test_ids_and_fields_match_sglangs_hash_helpers(dynamo: bool) -> None:
    env = build_hiradix(2, params={"enable_kv_cache_events": True, "dynamo_kv_event_format": dynamo,
                                   "kv_event_lora_names": lora_names()})
    assert env.cache.take_events() == [AllBlocksCleared()]
    tokens = [1, 2, 3, 4, 5, 6]
    cases = [  # (extra_key, cache_salt, namespace seed of the ids, lora_name)
        (None, None, None, None),
        (None, "tenant", kv_event_namespace_seed(extra_key=None, cache_salt="tenant") if dynamo else None, None),
        ("plain", None, kv_event_namespace_seed(extra_key="plain", cache_salt=None) if dynamo else None, None),
        (LORA_KEY, "tenant", kv_event_namespace_seed(extra_key=LORA_KEY, cache_salt="tenant" if dynamo else None),
         "sql-lora"),
    ]
    for extra_key, salt, seed, lora_name in cases:
        insert(env, tokens, extra_key=extra_key, cache_salt=salt, session_id="s1")
        ids = sglang_ids(tokens, 2, cache_salt=salt, seed=seed)
        assert env.cache.take_events() == [
            BlockStored(block_hashes=ids, parent_block_hash=None, token_ids=tokens, block_size=2, lora_id=None,
                        medium=GPU, cache_salt=salt, session_id="s1", lora_name=lora_name)
        ], (extra_key, salt)
        insert(env, tokens[:2] + [9, 9], extra_key=extra_key, cache_salt=salt)  # a split, then the new leaf
        (leaf,) = env.cache.take_events()
        assert leaf.parent_block_hash == ids[0] and leaf.session_id is None
        assert leaf.block_hashes == sglang_ids(tokens[:2] + [9, 9], 2, cache_salt=salt, seed=seed)[1:]
        settle(env)
        stored = env.cache.take_events()
        assert [e.medium for e in stored] == [CPU, CPU] and stored[0].block_hashes == ids
        assert env.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8
        (removed,) = env.cache.take_events()
        assert type(removed) is BlockRemoved and removed.medium == GPU
        assert sorted(removed.block_hashes) == sorted(ids + leaf.block_hashes)
        assert env.cache.evict_host(8) == 8
        (removed,) = env.cache.take_events()
        assert removed.medium == CPU and sorted(removed.block_hashes) == sorted(ids + leaf.block_hashes)
    insert(env, tokens)
    env.cache.reset()
    assert [type(e) for e in env.cache.take_events()] == [BlockStored, AllBlocksCleared]


# ---------------------------------------------------------------------------- parity with SGLang
@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_scripted_life_cycle_matches_sglang(tree_core: str, page_size: int, eagle: bool) -> None:
    """Also with EAGLE bigram keys (ids of interleaved pairs, ``(a, b)`` token ids)."""
    twin = Twin(page_size, eagle=eagle)
    base = list(range(1, 12 * page_size + 1 + eagle))
    twin.insert(base, session_id="chat-1")  # BlockStored GPU, with the session
    twin.settle()  # BlockStored CPU_PINNED
    cut = 2 * page_size
    twin.insert(base[:cut] + [900 + i for i in range(2 * page_size)])  # a split, the new leaf stored
    twin.match(base[: 3 * page_size])  # a split: no event
    twin.settle()
    twin.evict(1000)  # everything to the host: one BlockRemoved GPU
    assert twin.load_back(base) == len(base) - eagle  # BlockStored GPU for the loaded chain
    twin.evict(1000)
    assert twin.insert(base, session_id="chat-2") == 0  # over evicted nodes: stored again (GPU), as 0.5.23
    assert twin.stats["BlockStored GPU"] == 4, twin.stats
    twin.evict(1000)
    twin.evict_host(1000)  # BlockRemoved CPU_PINNED
    twin.insert(base, cache_salt="s")  # a salted chain: cache_salt on the event
    twin.insert(base[: 3 * page_size] + [7] * page_size, cache_salt="s")
    twin.settle()
    twin.reset()  # AllBlocksCleared
    s = twin.stats
    assert s["BlockStored GPU"] >= 4 and s["BlockStored CPU_PINNED"] >= 3 and s["BlockRemoved GPU"] == 3, s
    assert s["BlockRemoved CPU_PINNED"] == 1 and s["AllBlocksCleared"] == 2, s


@pytest.mark.parametrize("dynamo", [False, True])
def test_namespaces_lora_names_and_sessions_match_sglang(tree_core: str, dynamo: bool) -> None:
    twin = Twin(2, dynamo_kv_event_format=dynamo, kv_event_lora_names=lora_names())
    tokens = list(range(1, 13))
    for extra_key, salt in ((None, None), (LORA_KEY, None), ("plain", "tenant"), (LORA_KEY, "tenant")):
        twin.insert(tokens, extra_key=extra_key, cache_salt=salt, session_id="s")
        twin.insert(tokens[:4] + [50, 51], extra_key=extra_key, cache_salt=salt, session_id="t")
        twin.settle()
    twin.evict(1000)
    twin.evict_host(1000)
    s = twin.stats
    assert s["BlockStored GPU"] == 8 and s["BlockStored CPU_PINNED"] >= 4, s


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 2])
def test_random_operations_emit_sglangs_events(tree_core: str, page_size: int, write_policy: str) -> None:
    """A seeded random mix of the operations above on prompts that share prefixes, in
    three namespaces, compared step by step."""
    rng = random.Random(23 + page_size + len(write_policy))
    twin = Twin(page_size, size=1024, write_policy=write_policy, kv_event_lora_names=lora_names())
    prompts = [[rng.randrange(1, 6) for _ in range(rng.randrange(2, 12) * page_size)] for _ in range(12)]
    spaces = [{}, {"cache_salt": "tenant"}, {"extra_key": LORA_KEY}]
    for _ in range(200):
        tokens, ns = rng.choice(prompts), rng.choice(spaces)
        op = rng.random()
        if op < 0.4:
            twin.insert(tokens, session_id=rng.choice([None, "a"]), **ns)
        elif op < 0.55:
            twin.match(tokens[: rng.randrange(1, len(tokens) + 1)], **ns)
        elif op < 0.7:
            twin.settle()
        elif op < 0.82:
            twin.evict(rng.randrange(1, 40))
        elif op < 0.9:
            twin.load_back(tokens, **ns)
        elif op < 0.98:
            twin.evict_host(rng.randrange(1, 40))
        else:
            twin.reset()
    for kind in ("BlockStored GPU", "BlockStored CPU_PINNED", "BlockRemoved GPU", "BlockRemoved CPU_PINNED"):
        assert twin.stats.get(kind, 0) > 0, twin.stats



# ---------------------------------------------------------------------------- L3
def test_an_l3_prefetch_stores_on_the_host_then_the_load_on_the_device() -> None:
    """A prefix prefetched from L3 into a salted namespace (``format: dynamo``): the pages
    that land are stored ``CPU_PINNED``, the load back stores them on the ``GPU``, with
    the ids SGLang's helpers give, the salt and no session."""
    env = build_hiradix(4, storage="memory", extra_config='{"prefetch_threshold": 8}',
                        params={"enable_kv_cache_events": True, "dynamo_kv_event_format": True})
    cache = env.cache
    tokens = list(range(200, 232))
    insert(env, tokens, cache_salt="tenant", session_id="s")
    settle(env)
    while cache.core.pending_storage()[1]:  # the L2 -> L3 writes
        cache.check_hicache_events()
    cache.reset()  # device and host empty; L3 keeps the pages
    assert type(cache.take_events()[-1]) is AllBlocksCleared
    req = env.new_req(tokens, cache_salt="tenant")
    req.init_next_round_input(cache)
    handle = req.cache_request_handle
    assert cache.prefetch_from_storage(handle, req.last_host_node, array("q", tokens),
                                       cache.get_last_hash_value(req.last_host_node), None)
    cache.core.wait_prefetch(handle, timeout=30)
    assert cache.check_prefetch_progress(handle)
    assert cache.pop_prefetch_loaded_span(handle) == (32, None)
    ids = sglang_ids(tokens, 4, cache_salt="tenant", seed=kv_event_namespace_seed(extra_key=None, cache_salt="tenant"))
    want = dict(block_hashes=ids, parent_block_hash=None, token_ids=tokens, block_size=4, lora_id=None,
                cache_salt="tenant", session_id=None, lora_name=None)
    assert cache.take_events() == [BlockStored(**want, medium=CPU)]
    assert load_back(env, tokens, cache_salt="tenant") == 32
    assert cache.take_events() == [BlockStored(**want, medium=GPU)]
    settle(env)
    cache.check_invariants()


# ---------------------------------------------------------------------------- requests
@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_checkpointed_and_released_match_sglang(tree_core: str, page_size: int) -> None:
    """Requests as 0.5.23's scheduler runs them (``admit``: match, load back, lock, row;
    ``checkpoint_kv_cache`` of a chunk; ``release_kv_cache`` at the finish), salted and
    with a session, their stores naming it; then a second request over the first."""
    twin = Twin(page_size)
    prompt = list(range(100, 100 + 5 * page_size + 2))

    def serve(env: Any, tokens: list[int], session_id: str | None) -> int:
        req = env.new_req(tokens, cache_salt="tenant")
        req.session_id = session_id
        prefix = admit(env, req)
        req.extend_end = len(tokens) - 1  # a chunk short of the prompt's end
        checkpoint_kv_cache(req, env.cache)
        req.extend_end = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, env.cache, checkpoint=True)
        return prefix

    assert twin.both("serve", lambda env: serve(env, prompt, "chat")) == 0
    twin.settle()
    assert twin.both("serve again", lambda env: serve(env, prompt + [1] * (2 * page_size), "chat-2")) > 0
    twin.settle()
    twin.evict(1000)
    twin.evict_host(1000)
    sessions = [(e.session_id, e.medium) for e in twin.log if isinstance(e, BlockStored)]
    assert ("chat", GPU) in sessions and ("chat-2", GPU) in sessions and (None, CPU) in sessions, sessions
    assert all(e.cache_salt == "tenant" for e in twin.log if isinstance(e, BlockStored)), twin.log
    assert twin.stats["BlockRemoved GPU"] >= 1 and twin.stats["BlockRemoved CPU_PINNED"] >= 1, twin.stats
