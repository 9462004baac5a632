"""The compiled ``match_prefix`` (``hiradix.sglang._match``) gives what the Python method
gives, for every key, on SGLang 0.5.18 / 0.5.20 (results with the device slots); where it
is installed and where not (:mod:`tests.sglang.match_parity` drives the randomized run)."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

import hiradix.sglang as hs
from hiradix.sglang.nodes import TreeNode
from tests.sglang import match_parity
from tests.sglang.pools import insert

compiled = pytest.mark.skipif(
    match_parity.COMPILED is None, reason="hiradix.sglang._match is not built (HIRADIX_PUREPYTHON or no compiler)"
)


@compiled
def test_compiled_match_survives_reset_and_disable(make_env) -> None:
    env = make_env(1)
    tokens = list(range(1, 30))
    insert(env, tokens)
    params = MatchPrefixParams(key=RadixKey(array("q", tokens)))
    match_parity.same_result(env.cache.match_prefix(params), match_parity.python_match(env.cache, params))
    env.cache.reset()  # the tree is emptied in place: the matcher's tree is still the cache's
    assert len(env.cache.match_prefix(params).device_indices) == 0
    insert(env, tokens)
    assert env.cache.match_prefix(params).device_indices.tolist() == (
        match_parity.python_match(env.cache, params).device_indices.tolist()
    )
    env.cache.disable = True  # read on every call, as the method does
    match_parity.same_result(env.cache.match_prefix(params), match_parity.python_match(env.cache, params))
    assert len(env.cache.match_prefix(params).device_indices) == 0


@compiled
def test_the_schedulers_keys_stay_in_c(make_env) -> None:
    # Plain keys, with the limit SGLang's scheduler always sets, never reach the Python
    # method; a namespace, a list of tokens or a key shorter than a page do.
    env = make_env(4)
    tokens = list(range(1, 42))
    insert(env, tokens)
    calls: list[object] = []

    def general(cache, params):
        calls.append(params.key)
        return match_parity.python_match(cache, params)

    matcher = match_parity.COMPILED.Matcher(env.cache, general, TreeNode, *env.cache._compiled_match_spec())
    ids = array("q", tokens)
    for limit in (None, 0, 3, 4, 40, 41, 100):
        key = RadixKey(ids, limit=limit)
        match_parity.same_result(
            matcher(MatchPrefixParams(key=key)), match_parity.python_match(env.cache, MatchPrefixParams(key=key))
        )
    assert [k.limit for k in calls] == [0, 3]  # shorter than a page: the method's empty result
    del calls[:]
    for key in (RadixKey(ids, extra_key="x"), RadixKey(ids, cache_salt="s"), RadixKey(tokens), RadixKey(ids, limit=-1)):
        matcher(MatchPrefixParams(key=key))
    assert len(calls) == 4


def test_installed_only_where_it_applies(make_env, monkeypatch) -> None:
    env = make_env(1)
    assert match_parity.serves_compiled(env.cache, "match_prefix") == (match_parity.COMPILED is not None)
    # EAGLE's bigram keys always take the Python method
    assert not match_parity.serves_compiled(make_env(1, eagle=True).cache, "match_prefix")

    # and so does a subclass with a match_prefix of its own
    class Mine(hs.HiRadixCache):
        def match_prefix(self, params):  # type: ignore[override]
            return super().match_prefix(params)

    cache = make_env(1).cache
    cache.__class__ = Mine
    assert not match_parity.serves_compiled(cache, "match_prefix")
    cache.__class__ = hs.HiRadixCache
    assert match_parity.serves_compiled(cache, "match_prefix") == (match_parity.COMPILED is not None)
    # nor under HIRADIX_PUREPYTHON
    monkeypatch.setenv("HIRADIX_PUREPYTHON", "1")
    assert not match_parity.serves_compiled(make_env(1).cache, "match_prefix")
