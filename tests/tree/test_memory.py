"""The compiled tree's memory (issue 32 item 4, bench/RESULTS_memory.md): its token and
slot buffers hold what is cached, not a reserve; churn (evict and insert for long) keeps
their touched extent within a third of the live tokens; evict's reused result buffer
holds about the largest eviction, not its hint."""

from __future__ import annotations

import numpy as np

from tests.support import require_core

COMPACT_MIN = 1 << 16  # _core.pyx: garbage tokens below which nothing is compacted


def test_the_buffers_touch_what_is_cached_and_a_reserve_only_when_asked():
    tree = require_core().HiRadixTree(page_size=1)
    tree.reserve_tokens(0, evict_tokens=1_000_000)  # what hiradix.sglang asks at start-up
    assert tree._test_buffers()["touched"] == 0
    tree.insert(np.arange(10_000), np.arange(10_000))
    buffers = tree._test_buffers()
    assert buffers["len"] == buffers["touched"] == 10_000
    tree.reserve_tokens(50_000)  # an explicit reserve still sizes and touches
    buffers = tree._test_buffers()
    assert buffers["touched"] == 50_000 <= buffers["capacity"]
    tree.insert(np.arange(10_000, 20_000), np.arange(10_000, 20_000))
    assert tree._test_buffers()["touched"] == buffers["touched"]  # written within the reserve
    assert np.array_equal(tree.match_prefix(np.arange(10_000)).device_indices, np.arange(10_000))
    tree.check_invariants()


def test_churn_keeps_the_touched_buffers_within_a_third_of_the_live_tokens():
    """A server's steady state: inserts of new keys, each followed by evictions back to
    a live budget. Compacting before the buffers would write past their high-water mark,
    once deleted spans are a quarter of their length, bounds that mark by 4/3 of the
    live tokens (plus COMPACT_MIN and one insert); compacting only past half let it reach
    twice. Compaction moves offsets only: every cached key keeps its slots."""
    tree = require_core().HiRadixTree(page_size=1)
    live, length = 300_000, 1000
    rng = np.random.default_rng(5)
    slots: dict[int, np.ndarray] = {}
    next_slot = 0
    for i in range(3000):  # 3M tokens through a 300k-token budget
        key = np.concatenate(([i], rng.integers(0, 50_000, length - 1)))
        value = np.arange(next_slot, next_slot + length)
        next_slot += length
        slots[i] = (key, value)
        tree.insert(key, value)
        excess = tree.evictable_size() - live
        if excess > 0:
            tree.evict(excess)
        assert tree.evictable_size() <= live
    buffers = tree._test_buffers()
    assert buffers["touched"] <= live * 4 // 3 + COMPACT_MIN + length, buffers
    assert buffers["len"] - buffers["garbage"] == tree.evictable_size()
    tree.check_invariants()
    cached = 0
    for key, value in slots.values():
        got = tree.match_prefix(key).device_indices
        assert len(got) in (0, length)  # one node per key (distinct first tokens)
        if len(got):
            assert np.array_equal(got, value)
            cached += 1
    assert cached * length == tree.evictable_size()


def test_the_evict_buffer_grows_with_the_evictions_not_to_its_hint():
    """Made at the first evict (4096 slots at least), reused while no result holds it,
    replaced by a larger one when a result outgrows it: not the hint's million slots.
    (Buffers are named by id: a reference held here would count as a result's.)"""
    tree = require_core().HiRadixTree(page_size=1)
    tree.reserve_tokens(0, evict_tokens=1_000_000)
    for i in range(1200):  # 1200 leaves of 10 tokens, each a child of the root
        tree.insert([100_000 + i, *range(9)], np.arange(10 * i, 10 * i + 10))
    small = tree.evict(10).device_indices
    assert small.base is not None and small.base.shape[0] == 4096
    first = id(small.base)
    del small
    again = tree.evict(20).device_indices
    assert id(again.base) == first  # reused: nothing else held it
    del again
    large = tree.evict(10_000).device_indices
    assert len(large) == 10_000 and large.base is not None and id(large.base) != first
    assert 10_000 <= large.base.shape[0] < 1_000_000
    grown = id(large.base)
    held = tree.evict(100).device_indices  # ``large`` still holds the buffer: a new array
    assert held.base is None or id(held.base) != grown
    del large
    rest = tree.evict(10**9).device_indices
    assert len(rest) == 1200 * 10 - 10 - 20 - 10_000 - 100 and id(rest.base) == grown
    tree.check_invariants()
