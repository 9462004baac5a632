"""The compiled ``insert`` (``hiradix.sglang._insert``) does what the Python method does, for
every call, on SGLang 0.5.18 / 0.5.20; where it is installed and where not; which calls it
keeps in C (:mod:`tests.sglang.insert_parity` drives the randomized run)."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, InsertResult, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tests.sglang import insert_parity

pytestmark = pytest.mark.slow  # randomized parity of the compiled insert against the Python one, thousands of steps

compiled = pytest.mark.skipif(
    insert_parity.COMPILED is None, reason="hiradix.sglang._insert is not built (HIRADIX_PUREPYTHON or no compiler)"
)


@compiled
def test_compiled_insert_is_the_python_insert_with_backups_in_the_insert(make_env, monkeypatch) -> None:
    monkeypatch.setenv("HIRADIX_BATCH_BACKUPS", "0")  # each insert starts its own backups
    a, b = make_env(1, size=2048), make_env(1, size=2048)
    assert not a.cache.core.batch_backups
    seen = insert_parity.run(a, b, seed=5, steps=300)
    assert seen["prefix hits"] > 10, seen


def spy(env) -> tuple[object, list[object]]:
    """An inserter on ``env``'s cache whose Python fallback records what reaches it."""
    calls: list[object] = []

    def general(cache, params):
        calls.append(params)
        return insert_parity.python_insert(cache, params)

    return insert_parity.COMPILED.Inserter(
        env.cache, general, InsertResult, torch.Tensor, torch.int64, torch.int32
    ), calls


@compiled
def test_the_schedulers_calls_stay_in_c(make_env) -> None:
    # A finished request's insert (a list of tokens, int32 slots from req_to_token), the
    # bench's (array('q'), int64 slots), with a limit: never the Python method.
    env = make_env(4)
    inserter, calls = spy(env)
    tokens = list(range(1, 43))
    s = env.allocator.alloc(40)
    assert inserter(InsertParams(key=RadixKey(tokens), value=s.to(torch.int32))) == InsertResult(0, 40)
    t = env.allocator.alloc(40)
    r = inserter(InsertParams(key=RadixKey(array("q", tokens[:20] + [99] * 22), limit=41), value=t, priority=2))
    assert r == InsertResult(20, 40)
    assert calls == []
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    assert m.device_indices.tolist() == s.tolist()
    # Every other call is the method's: a namespace, a bigram key, slots it cannot read in
    # place, a float priority, a key shorter than a page, a disabled cache.
    others = [
        InsertParams(key=RadixKey(array("q", tokens), extra_key="lora"), value=s),
        InsertParams(key=RadixKey(array("q", tokens), cache_salt="x"), value=s),
        InsertParams(key=RadixKey(array("q", tokens), is_bigram=True), value=s),
        InsertParams(key=RadixKey(array("q", tokens)), value=None),
        InsertParams(key=RadixKey(array("q", tokens)), value=s.to(torch.int16)),
        InsertParams(key=RadixKey(array("q", tokens)), value=torch.stack((s, s)).t().reshape(-1)[::2]),
        InsertParams(key=RadixKey(array("q", tokens)), value=s, priority=1.0),
        InsertParams(key=RadixKey(array("q", tokens[:3])), value=s[:3]),
        InsertParams(key=RadixKey(array("i", tokens)), value=s),
    ]
    for p in others[:2] + others[3:]:  # (the bigram key is refused by the method: no EAGLE here)
        inserter(p)
    with pytest.raises(ValueError, match="bigram"):
        inserter(others[2])
    assert calls == others[:2] + others[3:] + [others[2]]
    env.cache.disable = True  # read on every call, as the method does
    assert inserter(InsertParams(key=RadixKey(tokens), value=s)) == InsertResult(0)
    assert len(calls) == len(others) + 1
    env.cache.tree.check_invariants()  # (the namespaced inserts above reuse s: no slot conservation)


@compiled
def test_with_kv_events_the_method_records_them(make_env) -> None:
    env = make_env(1, kv_events=True)
    inserter, calls = spy(env)
    env.cache.take_events()
    inserter(InsertParams(key=RadixKey(array("q", [1, 2, 3])), value=env.allocator.alloc(3)))
    assert len(calls) == 1 and [type(e).__name__ for e in env.cache.take_events()] == ["BlockStored"]


@compiled
def test_a_short_value_is_the_methods_error(make_env) -> None:
    env = make_env(1)
    s = env.allocator.alloc(3)
    with pytest.raises(ValueError, match="indices"):
        env.cache.insert(InsertParams(key=RadixKey(array("q", [1, 2, 3, 4])), value=s))
    assert env.cache.evictable_size() == 0  # nothing inserted; the slots are still the caller's
    env.allocator.free(s)
    env.cache.check_invariants()


def test_installed_on_the_instance_where_it_applies(make_env, monkeypatch) -> None:
    env = make_env(1)
    assert insert_parity.serves_compiled(env.cache, "insert") == (insert_parity.COMPILED is not None)
    assert not insert_parity.serves_compiled(make_env(1, eagle=True).cache, "insert")  # bigram keys: the method
    monkeypatch.setenv("HIRADIX_PUREPYTHON", "1")
    assert not insert_parity.serves_compiled(make_env(1).cache, "insert")


@compiled
def test_the_inserter_survives_reset(make_env) -> None:
    env = make_env(1)
    tokens = list(range(1, 30))
    env.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=env.allocator.alloc(29)))
    env.cache.reset()  # the tree is emptied in place: the inserter's tree is still the cache's
    env.allocator.clear()
    s = env.allocator.alloc(29)
    assert env.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=s)).prefix_len == 0
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    assert m.device_indices.tolist() == s.tolist()
    env.cache.check_invariants()
