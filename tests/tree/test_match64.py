"""The compiled tree matches SGLang's ``array('q')`` keys as int64 ids where they are
(``_match64``: no narrowing into a buffer, the tree touched and split only once the ids
are known to fit), and it must answer exactly as the twin, and as its own general path on
the same ids given otherwise: results, errors, and the tree after each call (timestamps,
splits, victim sets) included. Randomized over page sizes, limits, namespaces (existing
and new), evicted (host-only) tails, paths deeper than the spans it records, and ids out
of int32 range anywhere in a key."""

from __future__ import annotations

import random
from array import array
from typing import Any

import numpy as np
import pytest

from tests.support import assert_same, assert_trees_equal, make_pair, result_fields

BAD = (2**31, -(2**31) - 1, 2**40)


def call(tree: Any, name: str, *args: Any) -> tuple[bool, Any]:
    try:
        return True, getattr(tree, name)(*args)
    except (OverflowError, ValueError, KeyError) as exc:
        return False, type(exc)


def check(core: Any, ref: Any, name: str, *args: Any) -> Any:
    ok_c, a = call(core, name, *args)
    ok_r, b = call(ref, name, *args)
    assert ok_c == ok_r, (name, a, b)
    if ok_c and a is not None:
        assert_same(result_fields(a), result_fields(b), name)
    elif not ok_c:
        assert a is b, (name, a, b)
    return a if ok_c else None


def cut(tokens: list[int], n: int | None) -> array:
    """A key of the first ``n`` ids (all for ``None``): short of a page, of a span, or whole."""
    return array("q", tokens if n is None else tokens[:n])


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_int64_keys_match_as_the_twin_and_the_general_path(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    core, ref = make_pair(page_size=page_size)
    stems = [[rng.randrange(0, 50_000) for _ in range(rng.randrange(4, 200))] for _ in range(5)]
    namespaces = [None, None, "a", "b"]
    used_ns: set[str] = set()
    next_slot = 0
    for step in range(120):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 40))
        ]
        ns = rng.choice(namespaces)
        op = rng.random()
        if op < 0.3:
            value = np.arange(next_slot, next_slot + len(tokens), dtype=np.int64)
            next_slot += len(tokens)
            if check(core, ref, "insert", tokens, value, ns) is not None and ns is not None:
                used_ns.add(ns)
        elif op < 0.38:
            # back up and evict some leaves: their paths end in host-only tails
            for leaf in list(core.evictable_leaves())[:3]:
                if rng.random() < 0.5:
                    length = len(core.value(leaf))
                    host = np.arange(10**6 + step * 1000, 10**6 + step * 1000 + length, dtype=np.int64)
                    if check(core, ref, "begin_backup", leaf, host) is not None:
                        check(core, ref, "commit_backup", leaf)
            check(core, ref, "evict", rng.randrange(1, 40))
        else:
            n = rng.choice([None, None, rng.randrange(0, len(tokens) + 3)])
            key = list(tokens)
            if rng.random() < 0.15:  # an id no int32 holds, anywhere (matched part or not)
                key[rng.randrange(len(key))] = rng.choice(BAD)
            # the core on array('q') (_match64; its general path for a new namespace, a bad
            # id or a deep path) against the twin: results, errors and the trees after
            if check(core, ref, "match_prefix", cut(key, n), ns) is not None and ns is not None:
                used_ns.add(ns)  # a match in a new namespace makes its root
        assert_trees_equal(core, ref, sorted(used_ns))
        core.check_invariants()


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_path_deeper_than_the_recorded_spans_matches_alike(page_size: int) -> None:
    # 100 nested prefixes make a 100-span path: the core's int64 match records 64 spans
    # and hands the rest to its general path, which must answer the same.
    core, ref = make_pair(page_size=page_size)
    tokens = list(range(1, 100 * page_size + 1))
    for n in range(page_size, len(tokens) + 1, page_size):
        check(core, ref, "insert", tokens[:n], np.arange(n, dtype=np.int64))
    for key in (tokens, tokens[: 70 * page_size] + [0] * page_size, tokens[: 64 * page_size], tokens + [2**31]):
        check(core, ref, "match_prefix", array("q", key))
        assert_trees_equal(core, ref)
    core.check_invariants()


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_id_after_a_partial_match_leaves_the_tree_as_it_was(bad: int) -> None:
    # The match would end inside a span (a split) and stamp the nodes on the way: with an
    # id out of range past that point, nothing of that happens, as the twin raises first.
    core, ref = make_pair(page_size=1)
    check(core, ref, "insert", list(range(1, 51)), np.arange(50, dtype=np.int64))
    check(core, ref, "insert", list(range(1, 21)) + [99] * 10, np.arange(100, 130, dtype=np.int64))
    before = (core.num_nodes(), [core.node_info(h)["last_access_time"] for h in core.children(core.root)])
    for key in ([*range(1, 31), 7, bad], [*range(1, 11), bad], [bad], [*range(1, 51), bad]):
        check(core, ref, "match_prefix", array("q", key))
        assert_trees_equal(core, ref)
    assert (core.num_nodes(), [core.node_info(h)["last_access_time"] for h in core.children(core.root)]) == before
