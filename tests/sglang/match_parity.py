"""The compiled ``match_prefix`` (``hiradix.sglang._match``) against the Python method it
stands in front of, on one cache: a randomized run of inserts, evictions (host-only
tails), lock changes and matches of every kind of key, both answers compared field by
field and the tree's invariants checked after every step.

Run on every SGLang version by ``tests/sglang/test_match_compiled.py`` (0.5.18's and
0.5.20's results carry the device slots, 0.5.23's the device prefix's length).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix._native import load
from hiradix.sglang.cache import HiRadixCacheBase
from tests.sglang.pools import insert

COMPILED = load("hiradix.sglang._match")


def python_match(cache: Any, params: Any) -> Any:
    """The twin: the class's method, whatever the instance has in front of it."""
    return HiRadixCacheBase.match_prefix(cache, params)


def serves_compiled(cache: Any, name: str) -> bool:
    """Whether ``cache``'s method ``name`` is served by its compiled callable (else the
    call is the Python method's, bound)."""
    return not isinstance(getattr(cache, name), MethodType)


def same_result(a: Any, b: Any) -> None:
    """Two ``MatchResult`` are the same: type, every field (nodes by handle, tensors by value)."""
    assert type(a) is type(b)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.device == y.device, i
            assert torch.equal(x, y), f"field {i}: {x.tolist()} != {y.tolist()}"
        else:
            assert type(x) is type(y) and x == y, f"field {i}: {x!r} != {y!r}"


def keys_of(tokens: list[int], rng: random.Random) -> list[RadixKey]:
    """The shapes of key a scheduler (or a caller) hands over: the common one (an
    ``array('q')``) and every one the compiled matcher passes on."""
    n = len(tokens)
    return [
        RadixKey(array("q", tokens)),
        RadixKey(array("q", tokens), limit=rng.randrange(0, n + 2)),
        RadixKey(array("q", tokens), extra_key=rng.choice(["a", "b"])),
        RadixKey(array("q", tokens), cache_salt="salt"),
        RadixKey(list(tokens)),
        RadixKey(array("l", tokens)),
        RadixKey(array("q", tokens[: rng.randrange(0, 3)])),  # shorter than a page, or empty
    ]


class SubKey(RadixKey):
    """A caller's own key type (with a ``__dict__``): the matcher learns where its fields
    live again whenever the type of the keys it gets changes."""


def odd_keys(tokens: list[int], rng: random.Random) -> list[RadixKey]:
    """Keys whose answer may be an error: an id no int32 holds (before or past the
    ``limit``), a field unset; and keys of another type, between the common ones."""
    n = len(tokens)
    bad = list(tokens)
    pos = rng.randrange(n)
    bad[pos] = rng.choice([2**31, -(2**31) - 1])
    unset = RadixKey(array("q", tokens))
    del unset.cache_salt
    sub = SubKey(array("q", tokens), limit=rng.choice([None, rng.randrange(0, n + 1)]))
    sub.note = "x"
    return [
        RadixKey(array("q", bad)),
        RadixKey(array("q", bad), limit=pos),  # the bad id is past the limit: not read
        RadixKey(array("q", bad), limit=rng.randrange(pos + 1, n + 2)),
        unset,
        sub,
        RadixKey(array("q", tokens)),
    ]


def same_outcome(cache: Any, params: Any) -> None:
    """The compiled matcher and the method both answer ``params`` alike, or both raise the
    same error (the tree left as it was: :func:`run` checks the invariants after)."""
    outcomes = []
    for match in (cache.match_prefix, lambda p: python_match(cache, p)):
        try:
            outcomes.append((True, match(params)))
        except (OverflowError, AttributeError) as exc:
            outcomes.append((False, type(exc)))
    (ok_a, a), (ok_b, b) = outcomes
    assert ok_a == ok_b, (params.key.token_ids, a, b)
    if ok_a:
        same_result(a, b)
    else:
        assert a is b


def token_source(rng: random.Random) -> Callable[[], list[int]]:
    """Prompts that share prefixes: each draw is one of six stems cut anywhere, plus up to
    23 fresh tokens."""
    stems = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(4, 40))] for _ in range(6)]

    def draw() -> list[int]:
        stem = rng.choice(stems)
        return stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 24))]

    return draw


def run(env: Any, *, seed: int, steps: int) -> int:
    """Drive ``env.cache``; every match is answered by both paths and compared. Returns
    the number of host hits seen (a run without any tests less than it should)."""
    cache = env.cache
    assert serves_compiled(cache, "match_prefix"), "the compiled matcher is not installed"
    rng = random.Random(seed)
    draw = token_source(rng)
    held: list[Any] = []
    host_hits = 0
    for _ in range(steps):
        tokens = draw()
        op = rng.random()
        if op < 0.35 and env.allocator.available_size() > len(tokens) + 64:
            ns = rng.choice([None, None, "a"])
            insert(env, tokens, **({} if ns is None else {"extra_key": ns}))
            if rng.random() < 0.5:
                cache.check_hicache_events()
        elif op < 0.45:
            cache.core.flush()
            cache.check_hicache_events()  # backups acknowledged: evictions leave host copies
            cache.evict(EvictParams(num_tokens=rng.randrange(1, 64)))
        elif op < 0.52 and held:
            cache.dec_lock_ref(held.pop(rng.randrange(len(held))))
        else:
            for key in keys_of(tokens, rng):
                params = MatchPrefixParams(key=key)
                calls = [lambda p=params: cache.match_prefix(p), lambda p=params: python_match(cache, p)]
                rng.shuffle(calls)  # a match may split a node: either may come first
                a, b = calls[0](), calls[1]()
                same_result(a, b)
                host_hits += a.host_hit_length > 0
                if rng.random() < 0.1 and len(held) < 4 and a.last_device_node != cache.root_node:
                    cache.inc_lock_ref(a.last_device_node)
                    held.append(a.last_device_node)
            if rng.random() < 0.3:
                for key in odd_keys(tokens, rng):
                    same_outcome(cache, MatchPrefixParams(key=key))
        cache.check_invariants()
    for node in held:
        cache.dec_lock_ref(node)
    cache.check_invariants()
    return host_hits
