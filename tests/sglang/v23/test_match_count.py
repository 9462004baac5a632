"""On SGLang 0.5.23 the compiled ``match_prefix`` counts the device prefix without reading
its slots (the tree's ``match_into`` without ``slots``). The count is the Python method's
``len`` of the gathered slots on the paths the randomized run (:mod:`match_parity`) does
not reach: a path deeper than the spans the int64 walk records (the tree's general path
then serves), with a host-only tail below its device part, and a key long enough that the
walk drops the GIL."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tests.sglang import match_parity
from tests.sglang.pools import insert
from tests.sglang.unified_env import build_hiradix

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        match_parity.COMPILED is None, reason="hiradix.sglang._match is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


def both(cache: Any, tokens: list[int], **kw: Any) -> Any:
    """The compiled matcher's answer, checked against the method's."""
    params = MatchPrefixParams(key=RadixKey(array("q", tokens), **kw))
    compiled = cache.match_prefix(params)
    match_parity.same_result(compiled, match_parity.python_match(cache, params))
    cache.check_invariants()
    return compiled


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_deep_path_with_a_host_tail_counts_its_device_part(page_size: int) -> None:
    env = build_hiradix(page_size, size=4096)
    cache = env.cache
    assert match_parity.serves_compiled(cache, "match_prefix")
    tokens = list(range(1, 100 * page_size + 1))
    for n in range(page_size, len(tokens) + 1, page_size):  # 100 nested prefixes: 100 spans
        insert(env, tokens[:n])
    cache.core.flush()
    cache.check_hicache_events()  # every span backed up: the evictions leave host copies
    assert cache.evict(EvictParams(num_tokens=30 * page_size)).num_tokens_evicted == 30 * page_size
    m = both(cache, tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (70 * page_size, 30 * page_size)
    m = both(cache, tokens + [0] * page_size, limit=90 * page_size)  # cut at the limit, in the tail
    assert (m.device_prefix_len, m.host_hit_length) == (70 * page_size, 20 * page_size)
    m = both(cache, tokens[: 50 * page_size] + [0] * page_size)  # ends above the tail
    assert (m.device_prefix_len, m.host_hit_length) == (50 * page_size, 0)
    m = both(cache, tokens[: 40 * page_size])  # a 40-span path: the int64 walk serves it
    assert (m.device_prefix_len, m.host_hit_length) == (40 * page_size, 0)


def test_a_key_long_enough_to_drop_the_gil() -> None:
    env = build_hiradix(1, size=16384)
    cache = env.cache
    tokens = [(7 * i) % 30011 + 1 for i in range(6000)]
    insert(env, tokens[:2500])
    insert(env, tokens[:5000])
    cache.core.flush()
    cache.check_hicache_events()
    assert cache.evict(EvictParams(num_tokens=2500)).num_tokens_evicted == 2500
    m = both(cache, tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (2500, 2500)
    m = both(cache, tokens[:4800] + [0] * 300)  # splits the host-only node
    assert (m.device_prefix_len, m.host_hit_length) == (2500, 2300)
