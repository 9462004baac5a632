"""KV cache events of SGLang's own ``UnifiedRadixCache`` beside hiradix's cache: what the
event parity tests of SGLang 0.5.20 (``tests/sglang/v18/test_kv_events_v20.py``) and
0.5.23 (``tests/sglang/v23/test_kv_events.py``) share. :class:`Twin` gives both
caches, built alike (:mod:`tests.sglang.unified_env`), the same operations and compares what
they return and the events they queue after each; :func:`sglang_ids` computes event ids
with SGLang's own hash helpers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from array import array
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed", allow_module_level=True)

from sglang.srt.disaggregation import kv_events as sglang_events
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StorageMedium
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

import hiradix.sglang as hs
from tests.sglang.pools import LAYERS, device_len, key, match, only_in_l3, settle
from tests.sglang.unified_env import build, build_hiradix

GPU, CPU = StorageMedium.GPU, StorageMedium.CPU


@pytest.fixture(params=["rust", "python"])
def tree_core(request, monkeypatch) -> str:
    """SGLang's tree core, picked as a server picks it (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND):
    the Rust one (0.5.23's default) or the Python one (0.5.20's). On 0.5.23 they differ in
    one thing hiradix follows: the Rust core coalesces removals only within one extra_key."""
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", request.param)
    return str(request.param)


def insert(env: Any, tokens: list[int], session_id: str | None = None, **kw: Any) -> int:
    """``sglang_pools.insert`` with the request's session (``InsertParams`` of 0.5.20 on);
    frees the slots of the prefix that was on the device and returns its length.

    (SGLang's own insert counts the evicted nodes it refills with the new slots in its
    ``prefix_len``, as adopted ranges; hiradix's does not, and keeps them. The length on
    the device, read by a match first, is the duplicate part in both.)"""
    extra = 1 if getattr(env, "eagle", False) else 0  # EAGLE: n + 1 tokens are n bigrams, one slot each
    n = max(len(tokens) - extra, 0) // env.page_size * env.page_size
    on_device = device_len(match(env, tokens[: n + extra], **kw))
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
    req.last_node, req.prefix_len = m.last_device_node, device_len(m)
    req.last_host_node, req.best_match_node, req.host_hit_length = (
        m.last_host_node,
        m.best_match_node,
        m.host_hit_length,
    )
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req)
    )
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(cache.ready_to_load_host_cache())
    for layer in range(LAYERS):
        counter.wait_until(layer)
    cache.check_hicache_events()
    # 0.5.23 returns the count loaded, 0.5.20 the slots loaded into
    return int(loaded) if isinstance(loaded, int) else len(loaded)


class Twin:
    """hiradix's cache and SGLang's own ``UnifiedRadixCache`` (0.5.20 or 0.5.23), built alike, given the
    same operations; after each, both return the same thing and queue the same events."""

    def __init__(
        self, page_size: int, size: int = 128, eagle: bool = False, write_policy: str = "write_through", **params: Any
    ) -> None:
        p = {"enable_kv_cache_events": True, **params}
        self.ours = build_hiradix(page_size, size=size * page_size, eagle=eagle, write_policy=write_policy, params=p)
        self.theirs = build(
            page_size=page_size,
            size=size * page_size,
            params={**p, "is_eagle": eagle},
            hicache_write_policy=write_policy,
        )
        self.ours.eagle = self.theirs.eagle = eagle
        core = type(self.theirs.cache.tree_core).__name__
        # the core the server flag names (its default where unset: 0.5.20's Python, 0.5.23's Rust)
        want = (
            "RustUnifiedTreeCore" if envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get() == "rust" else "UnifiedTreeCore"
        )
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
            return device_len(m), int(m.host_hit_length)

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


def sglang_ids(
    tokens: list[int], page_size: int, *, cache_salt: str | None = None, seed: bytes | None = None
) -> list[int]:
    """The event ids of ``tokens``' pages, computed with SGLang's own helpers: the chain
    (seeded by the legacy salt digest), then, given a ``seed`` (0.5.23), namespaced."""
    prior = None
    if cache_salt is not None:
        prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode()).hexdigest()
    ids = []
    for i in range(0, len(tokens), page_size):
        prior = get_hash_str(tokens[i : i + page_size], prior)
        block_id = hash_str_to_int64(prior)
        if seed is not None:  # 0.5.20 has no namespaces (nor namespaced_block_hash)
            block_id = sglang_events.namespaced_block_hash(block_id, namespace_seed=seed)
        ids.append(block_id)
    return ids


# ---------------------------------------------------------------------------- operation sequences
Namespace = tuple[str | None, str | None, bytes | None, dict[str, Any]]


def ids_and_fields(cases: list[Namespace], *, strict: bool = False, **params: Any) -> None:
    """Pin the events of hiradix's cache (page size 2, ``params`` more ``CacheInitParams``
    fields) against SGLang's hash helpers: for each ``(extra_key, cache_salt, seed, fields)``
    of ``cases``, a stored chain with a session, a split's new leaf, their backups, their
    removal from the device and then from the host, with the ids :func:`sglang_ids` gives
    (namespaced by ``seed``, 0.5.23) and ``fields`` more ``BlockStored`` fields; then a
    reset. ``strict`` also pins the leaf's salt and that a backup names no session (what
    the 0.5.20 test checks beyond 0.5.23's)."""
    env = build_hiradix(2, params={"enable_kv_cache_events": True, **params})
    assert env.cache.take_events() == [AllBlocksCleared()]
    tokens = [1, 2, 3, 4, 5, 6]
    for extra_key, salt, seed, fields in cases:
        insert(env, tokens, extra_key=extra_key, cache_salt=salt, session_id="s1")
        ids = sglang_ids(tokens, 2, cache_salt=salt, seed=seed)
        assert env.cache.take_events() == [
            BlockStored(
                block_hashes=ids,
                parent_block_hash=None,
                token_ids=tokens,
                block_size=2,
                lora_id=None,
                medium=GPU,
                cache_salt=salt,
                session_id="s1",
                **fields,
            )
        ], (extra_key, salt)
        insert(env, tokens[:2] + [9, 9], extra_key=extra_key, cache_salt=salt)  # a split, then the new leaf
        (leaf,) = env.cache.take_events()
        assert leaf.parent_block_hash == ids[0] and leaf.session_id is None
        assert leaf.block_hashes == sglang_ids(tokens[:2] + [9, 9], 2, cache_salt=salt, seed=seed)[1:]
        settle(env)
        stored = env.cache.take_events()
        assert [e.medium for e in stored] == [CPU, CPU] and stored[0].block_hashes == ids
        if strict:
            assert leaf.cache_salt == salt
            assert all(e.session_id is None for e in stored)  # a backup names no session
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


def namespaces_and_sessions(
    twin: Twin, spaces: list[tuple[str | None, str | None]], *, coalesced: bool = False
) -> None:
    """One prompt and a split of it in each of the namespaces ``spaces`` (``(extra_key,
    cache_salt)``), with sessions, backed up, then evicted from the device and the host,
    compared step by step. ``coalesced``: each medium's removals are one event across the
    namespaces (0.5.20; 0.5.23's Rust core coalesces only within one ``extra_key``)."""
    tokens = list(range(1, 13))
    for extra_key, salt in spaces:
        twin.insert(tokens, extra_key=extra_key, cache_salt=salt, session_id="s")
        twin.insert(tokens[:4] + [50, 51], extra_key=extra_key, cache_salt=salt, session_id="t")
        twin.settle()
    twin.evict(1000)
    twin.evict_host(1000)
    s = twin.stats
    assert s["BlockStored GPU"] == 8 and s["BlockStored CPU_PINNED"] >= 4, s
    if coalesced:
        assert s["BlockRemoved GPU"] == 1 and s["BlockRemoved CPU_PINNED"] == 1, s


def served_twice(twin: Twin, page_size: int, serve: Any) -> None:
    """Two salted requests, the second over the first's prompt, each run by
    ``serve(env, tokens, session_id)`` (the scheduler's calls of one SGLang version, which
    returns the prefix matched) on both caches; then both evicted. The stores on the device
    name the request's session, the backups none; every store names the salt."""
    prompt = list(range(100, 100 + 5 * page_size + 2))
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


def l3_prefetch_events(*, seed: bytes | None = None, fields: dict[str, Any] | None = None, **params: Any) -> None:
    """A prefix prefetched from L3 into a salted namespace, on hiradix's cache alone
    (SGLang's own L3 path is not run beside it): the pages that land are stored
    ``CPU_PINNED``, the load back stores them on the ``GPU``, with the ids SGLang's helpers
    give (namespaced by ``seed``, 0.5.23), the salt and no session. ``fields`` are more
    ``BlockStored`` fields, ``params`` more ``CacheInitParams`` fields."""
    env = build_hiradix(
        4, storage="memory", extra_config='{"prefetch_threshold": 8}', params={"enable_kv_cache_events": True, **params}
    )
    cache = env.cache
    tokens = list(range(200, 232))
    insert(env, tokens, cache_salt="tenant", session_id="s")
    only_in_l3(env)
    assert type(cache.take_events()[-1]) is AllBlocksCleared
    req = env.new_req(tokens, cache_salt="tenant")
    req.init_next_round_input(cache)
    handle = req.cache_request_handle
    assert cache.prefetch_from_storage(
        handle, req.last_host_node, array("q", tokens), cache.get_last_hash_value(req.last_host_node), None
    )
    cache.core.storage.wait_prefetch(handle, timeout=30)
    assert cache.check_prefetch_progress(handle)
    assert cache.pop_prefetch_loaded_span(handle) == (32, None)
    want = dict(
        block_hashes=sglang_ids(tokens, 4, cache_salt="tenant", seed=seed),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        cache_salt="tenant",
        session_id=None,
        **(fields or {}),
    )
    assert cache.take_events() == [BlockStored(**want, medium=CPU)]
    assert load_back(env, tokens, cache_salt="tenant") == 32
    assert cache.take_events() == [BlockStored(**want, medium=GPU)]
    settle(env)
    cache.check_invariants()


def life_cycle(twin: Twin, page_size: int, eagle: bool) -> None:
    """A scripted life cycle, compared step by step: inserts (one with a session), a split
    by an insert and one by a match, backups acknowledged, eviction to the host, a load
    back, an insert over evicted nodes, host eviction, a salted chain, a reset."""
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
    # over evicted nodes: stored again (GPU), as 0.5.20's and 0.5.23's _unevict_node_on_insert
    assert twin.insert(base, session_id="chat-2") == 0
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


def random_operations(twin: Twin, *, seed: int, spaces: list[dict[str, Any]], steps: int = 200) -> None:
    """A seeded random mix of :func:`life_cycle`'s operations on prompts that share
    prefixes, each in one of the namespaces ``spaces`` (``RadixKey`` keywords), compared
    step by step; every kind of store and removal must have been compared."""
    rng = random.Random(seed)
    page_size = twin.ours.page_size
    prompts = [[rng.randrange(1, 6) for _ in range(rng.randrange(2, 12) * page_size)] for _ in range(12)]
    for _ in range(steps):
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
