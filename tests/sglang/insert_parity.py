"""The compiled ``insert`` (``hiradix.sglang._insert``) against the Python method it stands
in front of, on two caches built alike: one randomized run of inserts (every shape of key
and of slot tensor a caller hands over), step events, flushes, evictions, matches and lock
changes, given to both; the first cache inserts through its inserter, the second through
the class's method. After every step both returned the same, and the two trees (every
node's fields, key, slots, host slots and hashes), the backups waiting for the step, the
sizes and the allocators agree; the tree's invariants are checked on both.

Run on every SGLang version by ``tests/sglang/test_insert_compiled.py``.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix._native import load
from hiradix.sglang.cache import HiRadixCacheBase
from tests.sglang.match_parity import serves_compiled, token_source
from tests.support import tree_snapshot

COMPILED = load("hiradix.sglang._insert")


def python_insert(cache: Any, params: Any) -> Any:
    """The twin: the class's method, whatever the instance has in front of it."""
    return HiRadixCacheBase.insert(cache, params)


def keys_of(tokens: list[int], rng: random.Random) -> RadixKey:
    """One of the keys a scheduler (or another caller) hands over: the common ones (an
    ``array('q')``, a list, either with a ``limit``) and those the inserter passes on."""
    n = len(tokens)
    return rng.choice(
        [
            lambda: RadixKey(array("q", tokens)),
            lambda: RadixKey(array("q", tokens), limit=rng.randrange(0, n + 2)),
            lambda: RadixKey(list(tokens)),
            lambda: RadixKey(list(tokens), limit=rng.randrange(0, n + 2)),
            lambda: RadixKey(array("q", tokens), extra_key=rng.choice(["a", "b"])),
            lambda: RadixKey(array("q", tokens), cache_salt="salt"),
            lambda: RadixKey(array("l", tokens)),
        ]
    )()


def values_of(slots: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The key's slots as a caller may hold them: int64 (SGLang's allocator), int32 (a
    ``req_to_token`` row), strided, or longer than the key (the rest is not read)."""
    kind = rng.randrange(4)
    if kind == 1:
        return slots.to(torch.int32)
    if kind == 2:
        return torch.stack((slots, slots)).t().reshape(-1)[::2]  # a strided view of the same slots
    if kind == 3:
        return torch.cat((slots, slots[: rng.randrange(0, 4)]))
    return slots


def agree(a: Any, b: Any, what: str) -> None:
    """Both caches are in the same state."""
    ca, cb = a.cache, b.cache
    spaces = sorted(ca._namespaces)
    assert spaces == sorted(cb._namespaces), what
    assert tree_snapshot(ca.tree, spaces) == tree_snapshot(cb.tree, spaces), f"trees differ after {what}"
    assert list(ca.core._pending_backups) == list(cb.core._pending_backups), what
    assert list(ca.core._held) == list(cb.core._held), what
    assert (
        ca.evictable_size(),
        ca.protected_size(),
        a.allocator.available_size(),
        ca.token_to_kv_pool_host.available_size(),
    ) == (
        cb.evictable_size(),
        cb.protected_size(),
        b.allocator.available_size(),
        cb.token_to_kv_pool_host.available_size(),
    ), what
    ca.check_invariants()
    cb.check_invariants()


def run(a: Any, b: Any, *, seed: int, steps: int) -> dict[str, int]:
    """Drive ``a`` (its inserter) and ``b`` (the Python method) alike; returns how many
    inserts of each kind ran (a run without prefix hits or backups tests less)."""
    assert serves_compiled(a.cache, "insert"), "the compiled inserter is not installed"
    b.cache._compiled_insert = None  # the class's method serves b
    rng = random.Random(seed)
    ps = a.page_size
    draw = token_source(rng)
    held: list[tuple[Any, Any]] = []
    seen = {"inserts": 0, "prefix hits": 0, "backups asked": 0}
    for step in range(steps):
        tokens = draw()
        op = rng.random()
        if op < 0.5 and a.allocator.available_size() > len(tokens) + 64:
            key = keys_of(tokens, rng)
            n = len(tokens) if key.limit is None else min(len(tokens), key.limit)
            n -= n % ps
            slots = [env.allocator.alloc(n) if n else torch.empty(0, dtype=torch.int64) for env in (a, b)]
            assert torch.equal(slots[0], slots[1]), "the allocators differ"
            for env, s in zip((a, b), slots, strict=True):
                env.write_kv(s, torch.tensor(tokens[:n]), torch.arange(n))
            value = values_of(slots[0], rng)
            params = InsertParams(key=key, value=value, priority=rng.choice([0, 0, 3, None]))
            if hasattr(params, "chunked"):  # 0.5.18's flag
                params.chunked = rng.random() < 0.15
            before = len(a.cache.core._pending_backups)
            ra, rb = a.cache.insert(params), python_insert(b.cache, params)
            assert ra == rb, f"step {step}: {ra} != {rb}"
            for env, s in zip((a, b), slots, strict=True):
                if ra.prefix_len:
                    env.allocator.free(s[: ra.prefix_len])
            seen["inserts"] += 1
            seen["prefix hits"] += ra.prefix_len > 0
            seen["backups asked"] += len(a.cache.core._pending_backups) > before
        elif op < 0.65:
            for env in (a, b):
                env.cache.check_hicache_events()
        elif op < 0.7:
            for env in (a, b):
                env.cache.core.flush()
        elif op < 0.8:
            n = rng.randrange(1, 64)
            assert a.cache.evict(EvictParams(num_tokens=n)) == b.cache.evict(EvictParams(num_tokens=n))
        elif op < 0.85 and held:
            for env, node in zip((a, b), held.pop(rng.randrange(len(held))), strict=True):
                env.cache.dec_lock_ref(node)
        else:
            params = MatchPrefixParams(key=RadixKey(array("q", tokens)))
            ma, mb = a.cache.match_prefix(params), b.cache.match_prefix(params)
            if len(held) < 4 and rng.random() < 0.3 and ma.last_device_node != a.cache.root_node:
                for env, m in zip((a, b), (ma, mb), strict=True):
                    env.cache.inc_lock_ref(m.last_device_node)
                held.append((ma.last_device_node, mb.last_device_node))
        agree(a, b, f"step {step}")
    for pair in held:
        for env, node in zip((a, b), pair, strict=True):
            env.cache.dec_lock_ref(node)
    agree(a, b, "the end")
    return seen
