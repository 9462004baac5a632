"""The compiled ``UnifiedFullTree`` (``hiradix.tree._unified``) against its pure-Python twin
(``hiradix.tree.unified``), in lockstep on the tree alone: seeded random mixes of match,
read-only match, insert (fresh values, and values that reuse a match as a checkpoint does),
lock, unlock, whole eviction walks and reset, with tiny alphabets and short keys so that
splits, duplicate frees, re-inserts over evicted nodes and cascading deletes happen often.
After every step the answers, the sizes, the node count, the walk (depth first, in child
order) and the matched paths' values are compared through a node-id bijection (the two
trees mint ids their own way), and both trees run ``check_invariants``.

The lockstep against SGLang's own cores, through ``UnifiedRadixCache``, is
``tests/sglang/v23/test_tree_core_parity.py``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from hiradix import _native
from hiradix.tree import unified

_unified = _native.load("hiradix.tree._unified")
pytestmark = pytest.mark.skipif(
    _unified is None, reason="hiradix.tree._unified is not built here (or HIRADIX_PUREPYTHON=1)"
)


class Ids:
    """Compiled id -> twin id, built as ids appear; the same node must keep its partner."""

    def __init__(self) -> None:
        self.to_twin: dict[int, int] = {}
        self.from_twin: dict[int, int] = {}

    def same(self, mine: Any, theirs: Any, what: str) -> None:
        if mine is None or theirs is None or mine == -1 or theirs == -1:
            assert mine == theirs, f"{what}: {mine} vs twin {theirs}"
            return
        if mine in self.to_twin or theirs in self.from_twin:
            assert self.to_twin.get(mine) == theirs and self.from_twin.get(theirs) == mine, (
                f"{what}: node {mine} (paired with {self.to_twin.get(mine)}) vs twin node {theirs}"
            )
        self.to_twin[mine] = theirs
        self.from_twin[theirs] = mine


class Slots:
    """Fresh device values: tuples of never-reused ints (the tree slices and measures them)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _state(tree: Any, ids: Ids | None) -> Any:
    walk = tree.walk()
    rows = []
    for nid, depth, parent in walk:
        if ids is not None:
            nid, parent = ids.to_twin.get(nid, ("new", nid)), ids.to_twin.get(parent, ("new", parent))
        rows.append((nid, depth, parent))
    values = [tree.value(nid) for nid, _, _ in walk]
    locks = [tree.lock_ref(nid) for nid, _, _ in walk]
    hits = [tree.hit_count(nid) for nid, _, _ in walk]
    times = [tree.last_access_time(nid) for nid, _, _ in walk]
    return rows, values, locks, hits, times, tree.evictable_size(), tree.protected_size(), tree.num_nodes()


def _pair_walks(fast: Any, twin: Any, ids: Ids) -> None:
    """Pair the nodes of the two walks (same shape: checked by the state comparison)."""
    for (m, _, mp), (t, _, tp) in zip(fast.walk(), twin.walk(), strict=False):
        ids.same(m, t, "walk")
        ids.same(mp, tp, "walk parent")


def _tokens(rng: random.Random, prefixes: list[list[int]], page: int) -> list[int]:
    base = rng.choice(prefixes)
    cut = rng.randrange(0, len(base) + 1)
    return base[:cut] + [rng.randrange(1, 4) for _ in range(rng.randrange(0, 3 * page + 2))]


def _lockstep(seed: int, steps: int, page: int) -> dict[str, int]:
    assert _unified is not None
    fast = _unified.UnifiedFullTree(page, copy_value=tuple)
    twin = unified.UnifiedFullTree(page, copy_value=tuple)
    ids = Ids()
    ids.same(fast.root, twin.root, "root")
    rng = random.Random(seed)
    slots = Slots()
    prefixes = [[rng.randrange(1, 4) for _ in range(rng.randrange(page, 8 * page))] for _ in range(3)]
    held: list[tuple[int, int]] = []
    counts: dict[str, int] = {}
    ops = ["match", "peek", "insert", "insert_reuse", "lock", "unlock", "evict", "reset"]
    for step in range(steps):
        op = rng.choices(ops, [4, 1, 4, 3, 2, 2, 2, 0.1])[0]
        counts[op] = counts.get(op, 0) + 1
        where = f"seed {seed} page {page} step {step} ({op})"
        tokens = _tokens(rng, prefixes, page)
        ns = rng.choice([None, None, "lora-a", ("x", "salt")])
        if op in ("match", "lock"):
            a, b = fast.match(tokens, ns), twin.match(tokens, ns)
            assert a[0] == b[0], f"{where}: matched {a[0]} vs twin {b[0]}"
            ids.same(a[1], b[1], where)
            assert fast.path_values(a[1], fast.root) == twin.path_values(b[1], twin.root), where
            if op == "lock":
                da, db = fast.inc_lock_ref(a[1]), twin.inc_lock_ref(b[1])
                assert da == db, f"{where}: lock delta {da} vs {db}"
                held.append((a[1], b[1]))
        elif op == "peek":
            a, b = fast.match_device_prefix(tokens, ns), twin.match_device_prefix(tokens, ns)
            assert (a[0], a[2]) == (b[0], b[2]), f"{where}: {a} vs twin {b}"
            ids.same(a[1], b[1], where)
        elif op in ("insert", "insert_reuse"):
            n = len(tokens) - len(tokens) % page
            prev = 0
            if op == "insert_reuse":
                a, b = fast.match(tokens, ns), twin.match(tokens, ns)
                ids.same(a[1], b[1], where)
                prefix = sum(fast.path_values(a[1], fast.root), ())
                prev = a[0]
                value = prefix[:n] + slots.take(max(0, n - prev))
            else:
                value = slots.take(n)
            kw = dict(priority=rng.randrange(3), prev_prefix_len=prev, inserted_len=rng.choice([0, prev]))
            a, b = fast.insert(tokens, value, ns, **kw), twin.insert(tokens, value, ns, **kw)
            assert (a[0], list(a[2]), a[3]) == (b[0], list(b[2]), b[3]), f"{where}: {a} vs twin {b}"
            ids.same(a[1], b[1], where)
        elif op == "unlock" and held:
            m, t = held.pop(rng.randrange(len(held)))
            fast.dec_lock_ref(m)
            twin.dec_lock_ref(t)
        elif op == "evict":
            quota = rng.randrange(1, 6 * page + 1)
            fast.evict_start(quota)
            twin.evict_start(quota)
            freed = 0
            while True:
                a, b = fast.evict_next(freed), twin.evict_next(freed)
                ids.same(a, b, f"{where}: victim")
                if a is None:
                    break
                fa, fb = fast.evict_leaf(a), twin.evict_leaf(b)
                assert fa == fb, f"{where}: freed {fa} vs {fb}"
                freed += sum(len(v) for v in fa)
            fast.evict_end()
            twin.evict_end()
        elif op == "reset" and not held:
            fast.reset()
            twin.reset()
            ids = Ids()
            ids.same(fast.root, twin.root, "root after reset")
        fast.check_invariants()
        twin.check_invariants()
        _pair_walks(fast, twin, ids)
        assert _state(fast, ids) == _state(twin, None), f"{where}: states differ\n{fast.dump()}\n---\n{twin.dump()}"
    for m, t in held:
        fast.dec_lock_ref(m)
        twin.dec_lock_ref(t)
    assert fast.protected_size() == twin.protected_size() == 0
    fast.check_invariants()
    return counts


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_tree_matches_its_twin(seed: int, page: int) -> None:
    counts = _lockstep(seed, 400, page)
    assert counts.get("evict") and counts.get("insert_reuse") and counts.get("lock")


def test_compiled_tree_refuses_as_its_twin() -> None:
    assert _unified is not None
    for cls in (_unified.UnifiedFullTree, unified.UnifiedFullTree):
        with pytest.raises(ValueError, match="page_size"):
            cls(0)
        tree = cls(1)
        with pytest.raises(KeyError):
            tree.key_len(12345)
        with pytest.raises(AssertionError, match="not started"):
            tree.evict_next(0)
        tree.evict_start(1)
        with pytest.raises(AssertionError, match="already in progress"):
            tree.evict_start(1)
        tree.evict_end()
        _, leaf, _, _ = tree.insert([1, 2], (10, 11))
        with pytest.raises(AssertionError, match="lock_ref=0"):
            tree.dec_lock_ref(leaf)
        tree2 = cls(1)
        _, leaf2, _, _ = tree2.insert([1, 2], (10, 11))
        tree2.inc_lock_ref(leaf2)
        with pytest.raises(AssertionError, match="not an evictable device leaf"):
            tree2.evict_leaf(leaf2)


def test_compiled_tree_takes_any_token_sequence() -> None:
    """array('q') is read in place; lists, tuples and other widths are copied."""
    from array import array

    assert _unified is not None
    tree = _unified.UnifiedFullTree(2)
    tree.insert(array("q", [5, 6, 7, 8, 9]), (1, 2, 3, 4, 5))
    assert tree.match([5, 6, 7, 8])[0] == 4
    assert tree.match(array("i", [5, 6, 7]))[0] == 2
    assert tree.match((5, 6, 7, 8, 9))[0] == 4
    tree.check_invariants()


@pytest.mark.parametrize("mod", [unified, _unified], ids=["twin", "compiled"])
def test_kept_heap_follows_a_match_between_walks(mod: Any) -> None:
    """The heap kept between eviction walks must not serve stale times: a match between two
    walks makes the oldest leaf the newest, so the second walk takes the next one."""
    if mod is None:
        pytest.skip("hiradix.tree._unified is not built here (or HIRADIX_PUREPYTHON=1)")
    tree = mod.UnifiedFullTree(1, copy_value=tuple)
    leaves = [tree.insert([k, k], (2 * k, 2 * k + 1))[1] for k in (1, 2, 3, 4)]

    def evict_one() -> int:
        tree.evict_start(1)
        victim = tree.evict_next(0)
        tree.evict_leaf(victim)
        assert tree.evict_next(2) is None
        tree.evict_end()
        tree.check_invariants()
        return victim

    assert evict_one() == leaves[0]
    assert tree.match([2, 2])[1] == leaves[1]  # leaves[1] is now the newest
    assert evict_one() == leaves[2]
    assert evict_one() == leaves[3]
    assert evict_one() == leaves[1]
