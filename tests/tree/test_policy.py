"""Eviction policies: one contract mixin for every registered policy (cachetools'
``CacheTestMixin``), one-line subclasses per policy plus their own specific tests, and
the registry's behaviour. Each test runs once per tree implementation (``tree_cls``)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import hiradix.tree.policy as policy_module
from hiradix.tree.policy import EvictionPolicy, get_policy, policy_names, register_policy
from tests.support import all_nodes, result_fields


# ----------------------------------------------------------------------------- helpers
def idx(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def insert(tree, key, start, **kw) -> int:
    """Insert ``key`` with device indices from ``start``; returns the last node."""
    return tree.insert(key, idx(start, len(key)), **kw).last_node


def backup(tree, node: int, host_start: int) -> None:
    tree.begin_backup(node, idx(host_start, len(tree.key(node))))
    assert tree.commit_backup(node)


def populate(tree, seed: int = 0) -> int:
    """A deterministic mixed workload: shared prefixes, repeated hits, priorities,
    matches, some backups, one held lock. Returns the locked node."""
    rng = random.Random(seed)
    keys = [[1, 2, 3], [1, 2, 4, 5], [1, 6], [7, 8, 9, 10], [7, 8, 11], [12], [13, 14], [1, 2, 3, 15]]
    for i, key in enumerate(keys):
        res = tree.insert(key, idx(100 * i, len(key)), priority=rng.randrange(4))
        if i % 3 == 0:
            for j, node in enumerate(res.backup_nodes):
                backup(tree, node, 10_000 + 100 * i + 10 * j)
    for _ in range(12):
        key = rng.choice(keys)
        if rng.random() < 0.5:
            tree.match_prefix(key)
        else:
            tree.insert(key, idx(5000, len(key)), priority=rng.randrange(4))
    locked = tree.match_prefix([7, 8, 11]).last_node
    tree.inc_lock_ref(locked)
    return locked


def siblings(tree, n: int, length: int = 2) -> list[int]:
    """``n`` leaves of ``length`` tokens directly under the root, in creation order;
    leaf ``i`` holds the device indices ``sib(i)``."""
    return [insert(tree, [1000 + i] * length, 10 * i) for i in range(n)]


def sib(i: int) -> list[int]:
    """Device indices of the ``i``-th leaf made by ``siblings``."""
    return [10 * i, 10 * i + 1]


def is_device_leaf(tree, h: int) -> bool:
    i = tree.node_info(h)
    return not i["evicted"] and i["lock_ref"] == 0 and all(tree.value(c) is None for c in tree.children(h))


def is_host_leaf(tree, h: int) -> bool:
    i = tree.node_info(h)
    return (
        i["evicted"] and i["backuped"] and i["lock_ref"] == 0 and i["host_ref_counter"] == 0 and i["num_children"] == 0
    )


def evict_one(tree) -> np.ndarray:
    """Evict the next victim alone (asking for one token evicts exactly one leaf)."""
    return tree.evict(1).device_indices


# ----------------------------------------------------------------------------- contract
class PolicyContract:
    """What every eviction policy guarantees. Subclasses set ``policy``."""

    policy: str

    def make(self, tree_cls, **kw):
        kw.setdefault("write_policy", "write_through")
        return tree_cls(1, eviction_policy=self.policy, **kw)

    @property
    def second_chance(self) -> bool:
        return get_policy(self.policy).second_chance

    def test_evictable_leaves_are_exactly_the_unlocked_device_leaves(self, tree_cls):
        tree = self.make(tree_cls)
        locked = populate(tree)
        listed = tree.evictable_leaves()
        assert len(listed) == len(set(listed))
        assert set(listed) == {h for h in all_nodes(tree) if is_device_leaf(tree, h)}
        assert locked not in listed and all(tree.node_info(h)["lock_ref"] == 0 for h in listed)
        tree.dec_lock_ref(locked)

    def test_evictable_host_leaves_are_exactly_the_free_childless_tombstones(self, tree_cls):
        tree = self.make(tree_cls)
        locked = populate(tree)
        tree.evict(10)
        listed = tree.evictable_host_leaves()
        assert set(listed) == {h for h in all_nodes(tree) if is_host_leaf(tree, h)}
        tree.dec_lock_ref(locked)

    def test_victims_come_in_the_listed_order(self, tree_cls):
        if self.second_chance:
            pytest.skip("second-chance policies may pass over the first listed leaf")
        tree = self.make(tree_cls)
        locked = populate(tree)
        while tree.evictable_leaves():
            first = tree.evictable_leaves()[0]
            expected = tree.value(first)
            assert evict_one(tree).tolist() == expected.tolist()
        tree.dec_lock_ref(locked)

    def test_a_bulk_eviction_takes_leaves_in_the_listed_order(self, tree_cls):
        if self.second_chance:
            pytest.skip("second-chance policies may pass over the first listed leaf")
        tree = self.make(tree_cls)
        for h in siblings(tree, 6)[::2]:
            tree.match_prefix(tree.key(h))
        order = tree.evictable_leaves()
        expected = np.concatenate([tree.value(h) for h in order[:4]])
        assert tree.evict(8).device_indices.tolist() == expected.tolist()
        assert tree.evictable_leaves() == order[4:]

    def test_host_victims_come_in_the_listed_order(self, tree_cls):
        if self.second_chance:
            pytest.skip("second-chance policies may pass over the first listed leaf")
        tree = self.make(tree_cls)
        for i, h in enumerate(siblings(tree, 5)):
            backup(tree, h, 500 + 10 * i)
        tree.evict(100)
        while tree.evictable_host_leaves():
            first = tree.evictable_host_leaves()[0]
            expected = tree.host_value(first)
            assert tree.evict_host(1).host_indices.tolist() == expected.tolist()

    def test_every_victim_was_an_evictable_leaf(self, tree_cls):
        tree = self.make(tree_cls)
        locked = populate(tree)
        while True:
            listed = {tree.value(h).tobytes(): h for h in tree.evictable_leaves()}
            freed = evict_one(tree)
            if len(freed) == 0:
                break
            assert freed.tobytes() in listed
        tree.dec_lock_ref(locked)

    def test_evicting_everything_empties_the_device(self, tree_cls):
        tree = self.make(tree_cls)
        locked = populate(tree)
        tree.dec_lock_ref(locked)
        total = tree.device_size()
        res = tree.evict(total)
        assert res.num_evicted == total and len(res.device_indices) == total
        assert tree.device_size() == 0 and tree.evictable_leaves() == []
        assert all(tree.node_info(h)["backuped"] for h in all_nodes(tree))  # only tombstones left

    def test_eviction_is_deterministic(self, tree_cls):
        runs = []
        for _ in range(2):
            tree = self.make(tree_cls)
            tree.dec_lock_ref(populate(tree, seed=7))
            runs.append([result_fields(tree.evict(2)) for _ in range(8)])
        assert runs[0] == runs[1]

    def test_a_locked_leaf_is_never_a_victim(self, tree_cls):
        tree = self.make(tree_cls)
        nodes = siblings(tree, 4)
        tree.inc_lock_ref(nodes[1])
        tree.evict(100)
        assert tree.value(nodes[1]).tolist() == [10, 11]
        assert tree.device_size() == 2
        tree.dec_lock_ref(nodes[1])


# ----------------------------------------------------------------------------- per policy
class TestLRU(PolicyContract):
    policy = "lru"

    def test_evicts_the_least_recently_matched_leaf(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b, _c = siblings(tree, 3)
        tree.match_prefix(tree.key(a))
        assert evict_one(tree).tolist() == sib(1)
        assert evict_one(tree).tolist() == sib(2)
        assert evict_one(tree).tolist() == sib(0)


class TestMRU(PolicyContract):
    policy = "mru"

    def test_evicts_the_most_recently_matched_leaf(self, tree_cls):
        tree = self.make(tree_cls)
        _a, b, _c = siblings(tree, 3)
        tree.match_prefix(tree.key(b))
        assert evict_one(tree).tolist() == sib(1)
        assert evict_one(tree).tolist() == sib(2)


class TestFIFO(PolicyContract):
    policy = "fifo"

    def test_evicts_the_oldest_leaf_whatever_its_use(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b, _c = siblings(tree, 3)
        tree.match_prefix(tree.key(a))
        tree.insert(tree.key(a), idx(0, 2))
        assert evict_one(tree).tolist() == sib(0)
        assert evict_one(tree).tolist() == sib(1)


class TestFILO(PolicyContract):
    policy = "filo"

    def test_evicts_the_newest_leaf_first(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b, _c = siblings(tree, 3)
        tree.match_prefix(tree.key(a))
        assert evict_one(tree).tolist() == sib(2)
        assert evict_one(tree).tolist() == sib(1)


class TestLFU(PolicyContract):
    policy = "lfu"

    def test_evicts_the_leaf_with_the_fewest_insert_hits(self, tree_cls):
        tree = self.make(tree_cls)
        a, b, c = siblings(tree, 3)
        for node, extra_hits in ((a, 2), (b, 1)):
            for _ in range(extra_hits):
                tree.insert(tree.key(node), idx(0, 2))
        tree.match_prefix(tree.key(c))  # a match is not a hit
        assert [tree.node_info(h)["hit_count"] for h in (a, b, c)] == [3, 2, 1]
        assert evict_one(tree).tolist() == sib(2)
        assert evict_one(tree).tolist() == sib(1)

    def test_ties_in_hits_go_to_the_least_recently_used(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b = siblings(tree, 2)
        tree.match_prefix(tree.key(a))
        assert evict_one(tree).tolist() == sib(1)


class TestPriority(PolicyContract):
    policy = "priority"

    def test_evicts_lower_priority_first(self, tree_cls):
        tree = self.make(tree_cls)
        a = insert(tree, [1, 1], 0, priority=5)
        b = insert(tree, [2, 2], 10, priority=1)
        c = insert(tree, [3, 3], 20, priority=3)
        tree.match_prefix([2, 2])
        assert [evict_one(tree).tolist() for _ in range(3)] == [[10, 11], [20, 21], [0, 1]]
        assert not any(tree.is_alive(h) for h in (a, b, c))

    def test_priority_is_the_max_along_insert_paths(self, tree_cls):
        tree = self.make(tree_cls)
        top = insert(tree, [1, 2], 0, priority=1)
        high = insert(tree, [1, 2, 3], 10, priority=7)
        low = insert(tree, [1, 2, 4], 20, priority=3)
        assert [tree.node_info(h)["priority"] for h in (top, high, low)] == [7, 7, 3]
        assert evict_one(tree).tolist() == [22]  # the priority-3 leaf goes first
        tree.insert([1, 2], idx(30, 2), priority=0)
        assert tree.node_info(top)["priority"] == 7  # never lowered

    def test_a_split_keeps_the_priority(self, tree_cls):
        tree = self.make(tree_cls)
        node = insert(tree, [1, 2, 3], 0, priority=4)
        tree.match_prefix([1, 9])
        assert tree.node_info(tree.parent(node))["priority"] == 4


class TestSLRU(PolicyContract):
    policy = "slru"

    def test_probationary_leaves_go_before_protected_ones(self, tree_cls):
        tree = self.make(tree_cls)
        hot = insert(tree, [1, 1], 0)
        tree.insert([1, 1], idx(0, 2))  # second hit: protected (threshold 2)
        cold = insert(tree, [2, 2], 10)  # more recent, but probationary
        assert get_policy("slru").protected_threshold == 2
        assert tree.evictable_leaves() == [cold, hot]
        assert evict_one(tree).tolist() == [10, 11]

    def test_within_a_segment_the_least_recent_goes_first(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b = siblings(tree, 2)
        tree.match_prefix(tree.key(a))
        assert evict_one(tree).tolist() == sib(1)


class TestSIEVE(PolicyContract):
    policy = "sieve"

    def test_a_visited_leaf_survives_one_sweep(self, tree_cls):
        tree = self.make(tree_cls)
        a, _b, _c = siblings(tree, 3)
        tree.match_prefix(tree.key(a))  # visited: gets a second chance
        assert evict_one(tree).tolist() == sib(1)
        assert tree.is_alive(a)
        assert evict_one(tree).tolist() == sib(2)
        assert evict_one(tree).tolist() == sib(0)

    def test_without_visits_it_evicts_in_insertion_order(self, tree_cls):
        tree = self.make(tree_cls)
        _a, _b, _c = siblings(tree, 3)
        assert [evict_one(tree).tolist() for _ in range(3)] == [sib(0), sib(1), sib(2)]

    def test_the_hand_wraps_around(self, tree_cls):
        tree = self.make(tree_cls)
        a, b = siblings(tree, 2)
        tree.match_prefix(tree.key(a))
        tree.match_prefix(tree.key(b))
        assert evict_one(tree).tolist() == [0, 1]  # both spared once, then the oldest
        assert tree.is_alive(b)


# Policies registered by other modules get the contract too.
_COVERED = {cls.policy for cls in PolicyContract.__subclasses__()}
for _name in policy_names():
    if _name not in _COVERED:
        globals()[f"TestContract_{_name}"] = type(f"TestContract_{_name}", (PolicyContract,), {"policy": _name})


# ----------------------------------------------------------------------------- registry
@pytest.fixture
def custom_policy():
    """A registered 'highest priority first' policy, removed again afterwards."""
    pol = register_policy(EvictionPolicy("test-highest-priority-first", (("priority", -1),)), replace=True)
    yield pol
    policy_module._REGISTRY.pop(pol.name, None)  # keep the registry as other tests expect it


@pytest.mark.parametrize("by", ["name", "object"])
def test_a_registered_custom_policy_drives_eviction(tree_cls, custom_policy, by):
    tree = tree_cls(1, eviction_policy=custom_policy.name if by == "name" else custom_policy)
    insert(tree, [1, 1], 0, priority=1)
    insert(tree, [2, 2], 10, priority=9)
    insert(tree, [3, 3], 20, priority=5)
    assert [evict_one(tree).tolist() for _ in range(3)] == [[10, 11], [20, 21], [0, 1]]


def test_a_custom_policy_is_listed(custom_policy):
    assert custom_policy.name in policy_names()
    assert get_policy(custom_policy.name) is custom_policy


def test_registering_a_taken_name_without_replace_is_refused():
    with pytest.raises(ValueError):
        register_policy(EvictionPolicy("lru", (("creation_time", 1),)))
    assert get_policy("lru").key == (("last_access_time", 1),)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"key": ()},
        {"key": (("priority", 1), ("hit_count", 1), ("creation_time", 1))},
        {"key": (("no_such_field", 1),)},
        {"key": (("priority", 0),)},
        {"key": (("priority", 2),)},
        {"key": (("priority", 1),), "protected_threshold": 0},
    ],
    ids=["no key", "three components", "unknown field", "sign 0", "sign 2", "threshold 0"],
)
def test_bad_policy_declarations_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        EvictionPolicy("bad", **kwargs)


def test_an_unknown_policy_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        get_policy("nope")
