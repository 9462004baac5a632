"""Unit tests of the tree's semantics, run against every implementation (``tree_cls``).

``hiradix/tree/_reference.py`` is the specification; the seed document (``shared/seeds/000_*``,
sections HiRadixTree / Prefix Match / Insert / Eviction / State Transition) is quoted where
a test pins one of its examples.
"""

from __future__ import annotations

import array
import random

import numpy as np
import pytest

from hiradix.transport.fake import FakeClock
from hiradix.tree._reference import get_hash_str
from hiradix.tree._results import Change, LockError
from tests.support import ChangeMirror, all_nodes, result_fields


# ----------------------------------------------------------------------------- helpers
def seq(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start``."""
    return list(range(start, start + n))


def idx(start: int, n: int) -> np.ndarray:
    """``n`` KV indices from ``start``."""
    return np.arange(start, start + n, dtype=np.int64)


def backup(tree, node: int, host_start: int, ok: bool = True) -> bool:
    """Back up ``node`` to host slots from ``host_start`` in one begin/commit round."""
    n = len(tree.key(node))
    tree.begin_backup(node, idx(host_start, n))
    return tree.commit_backup(node, ok)


def insert_backed_up(tree, key, dev_start: int, host_start: int, **kw) -> int:
    """Insert ``key`` and back up every node the insert reports; returns its last node."""
    res = tree.insert(key, idx(dev_start, len(key)), **kw)
    for i, node in enumerate(res.backup_nodes):
        assert backup(tree, node, host_start + 1000 * i)
    return res.last_node


def info(tree, node: int) -> dict:
    return tree.node_info(node)


def whole_state(tree) -> dict:
    """Everything observable about a tree (for before/after comparisons)."""
    return {
        "nodes": [
            (
                info(tree, h),
                tree.key(h).tolist(),
                None if tree.value(h) is None else tree.value(h).tolist(),
                None if tree.host_value(h) is None else tree.host_value(h).tolist(),
            )
            for h in all_nodes(tree)
        ],
        "sizes": (tree.evictable_size(), tree.protected_size(), tree.host_size(), tree.num_nodes()),
        "leaves": (list(tree.evictable_leaves()), list(tree.evictable_host_leaves())),
    }


def hash_chain(tokens, page_size, prior=None) -> list[str]:
    """SGLang's chain: one ``get_hash_str`` per full page, each seeded by the previous."""
    out = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        prior = get_hash_str(tokens[start : start + page_size], prior)
        out.append(prior)
    return out


A, B, C = seq(100, 32), seq(200, 128), seq(400, 64)


def build_worked_example(tree):
    """The seed's example: root -> Node_A (device + backed up) -> Node_B (evicted, 128 tok)
    -> Node_C (evicted, 64 tok), built with insert / backup / evict only."""
    node_a = insert_backed_up(tree, A, 0, 10_000)
    node_b = insert_backed_up(tree, A + B, 100, 20_000)
    node_c = insert_backed_up(tree, A + B + C, 300, 30_000)
    tree.inc_lock_ref(node_a)  # keep Node_A on the device while its subtree goes
    assert tree.evict(len(B) + len(C)).num_evicted == len(B) + len(C)
    tree.dec_lock_ref(node_a)
    return node_a, node_b, node_c


# ----------------------------------------------------------------------------- prefix match
def test_worked_example_reports_the_host_hit_below_node_a(tree_cls):
    tree = tree_cls(1)
    node_a, node_b, node_c = build_worked_example(tree)
    assert info(tree, node_b)["evicted"] and info(tree, node_c)["evicted"]
    m = tree.match_prefix(A + B + C)
    assert m.host_hit_length == 192
    assert m.last_host_node == node_a
    assert m.last_device_node == node_a
    assert m.last_node == node_c
    assert np.array_equal(m.device_indices, tree.value(node_a))
    assert np.array_equal(m.device_indices, idx(0, len(A)))


def test_match_of_nothing_returns_the_root_and_no_indices(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2, 3], idx(0, 3))
    m = tree.match_prefix([9, 9])
    assert result_fields(m) == {
        "device_indices": ("ndarray", "int64", []),
        "last_device_node": tree.root,
        "last_host_node": tree.root,
        "host_hit_length": 0,
        "last_node": tree.root,
    }


def test_match_device_indices_are_int64(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2, 3], np.array([7, 8, 9], dtype=np.int32))
    assert tree.match_prefix([1, 2, 3]).device_indices.dtype == np.int64


def test_match_splits_a_node_where_the_match_ends(tree_cls):
    tree = tree_cls(1)
    whole = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    m = tree.match_prefix([1, 2, 9])
    assert m.last_node != whole
    assert tree.key(m.last_node).tolist() == [1, 2]
    assert tree.key(whole).tolist() == [3, 4]
    assert tree.parent(whole) == m.last_node
    assert tree.num_nodes() == 2


def test_last_host_node_is_the_deepest_backed_up_ancestor(tree_cls):
    tree = tree_cls(1)
    node_a = insert_backed_up(tree, [1, 2], 0, 100)
    tree.insert([1, 2, 3, 4], idx(10, 4))  # [3, 4]: on the device, not backed up yet
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.last_host_node == node_a
    assert m.host_hit_length == 0
    assert len(m.device_indices) == 4


# ----------------------------------------------------------------------------- page size
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_insert_truncates_the_key_to_whole_pages(tree_cls, page_size):
    tree = tree_cls(page_size)
    n = 2 * page_size + page_size // 2 + 1  # two pages and a partial one
    res = tree.insert(seq(0, n), idx(0, n))
    assert len(tree.key(res.last_node)) == (n // page_size) * page_size
    assert np.array_equal(tree.value(res.last_node), idx(0, (n // page_size) * page_size))
    assert tree.device_size() == (n // page_size) * page_size


@pytest.mark.parametrize("page_size", [4, 16])
def test_a_mismatch_inside_a_page_does_not_match_that_page(tree_cls, page_size):
    tree = tree_cls(page_size)
    key = seq(0, 3 * page_size)
    tree.insert(key, idx(0, len(key)))
    probe = key[: 2 * page_size - 1] + [-1] + key[2 * page_size :]  # last token of page 2 differs
    m = tree.match_prefix(probe)
    assert len(m.device_indices) == page_size


@pytest.mark.parametrize("page_size", [4, 16])
def test_a_mismatch_in_the_first_page_matches_nothing(tree_cls, page_size):
    tree = tree_cls(page_size)
    key = seq(0, 2 * page_size)
    tree.insert(key, idx(0, len(key)))
    m = tree.match_prefix([key[0] + 1000] + key[1:])
    assert len(m.device_indices) == 0 and m.last_node == tree.root


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_splits_happen_only_on_page_boundaries(tree_cls, page_size):
    tree = tree_cls(page_size)
    key = seq(0, 4 * page_size)
    tree.insert(key, idx(0, len(key)))
    for cut in range(1, len(key)):  # diverge at every token position
        other = key[:cut] + [5000 + cut] + key[cut + 1 :]
        tree.insert(other, idx(10_000 * cut, len(other)))
    for h in all_nodes(tree):
        assert len(tree.key(h)) % page_size == 0 and len(tree.key(h)) > 0
    tree.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_match_of_a_partial_page_is_truncated(tree_cls, page_size):
    tree = tree_cls(page_size)
    key = seq(0, 2 * page_size)
    tree.insert(key, idx(0, len(key)))
    m = tree.match_prefix(key[: 2 * page_size - 1])
    assert len(m.device_indices) == ((2 * page_size - 1) // page_size) * page_size


# ----------------------------------------------------------------------------- split
def test_split_keeps_value_host_value_and_hashes_aligned(tree_cls):
    page = 4
    tree = tree_cls(page, enable_hash=True)
    key = seq(0, 4 * page)
    node = insert_backed_up(tree, key, 0, 500)
    hashes = tree.hash_value(node)
    tree.match_prefix(key[: 2 * page] + [-7] * page)  # split after two pages
    top = tree.parent(node)
    assert top != tree.root
    assert tree.key(top).tolist() == key[: 2 * page]
    assert tree.value(top).tolist() == idx(0, 2 * page).tolist()
    assert tree.host_value(top).tolist() == idx(500, 2 * page).tolist()
    assert tree.hash_value(top) == hashes[:2]
    assert tree.key(node).tolist() == key[2 * page :]
    assert tree.value(node).tolist() == idx(2 * page, 2 * page).tolist()
    assert tree.host_value(node).tolist() == idx(500 + 2 * page, 2 * page).tolist()
    assert tree.hash_value(node) == hashes[2:]


def test_split_node_keeps_the_original_handle_as_the_suffix(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 9])
    assert tree.key(node).tolist() == [2, 3]
    assert info(tree, tree.parent(node))["lock_ref"] == 1  # the lock covers the new prefix
    assert tree.dec_lock_ref(node) == 3


def test_split_keeps_the_creation_time_of_the_original(tree_cls):
    clock = FakeClock(5)
    tree = tree_cls(1, clock=clock)
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    clock.advance(4)  # to 9
    tree.match_prefix([1, 4])
    top = tree.parent(node)
    assert info(tree, top)["creation_time"] == 5.0
    assert info(tree, node)["creation_time"] == 5.0


# ----------------------------------------------------------------------------- insert
def test_insert_of_a_new_key_reports_no_prefix(tree_cls):
    tree = tree_cls(1)
    res = tree.insert([1, 2, 3], idx(0, 3))
    assert res.prefix_len == 0
    assert tree.key(res.last_node).tolist() == [1, 2, 3]
    assert tree.evictable_size() == 3


def test_insert_of_an_existing_prefix_reports_it_for_freeing(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2, 3], idx(0, 3))
    res = tree.insert([1, 2, 3, 4, 5], idx(100, 5))
    assert res.prefix_len == 3
    assert tree.value(res.last_node).tolist() == [103, 104]  # only the new tokens are adopted
    assert tree.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [0, 1, 2, 103, 104]


def test_insert_rematerializes_an_evicted_node_instead_of_duplicating_it(tree_cls):
    tree = tree_cls(1)
    _node_a, node_b, node_c = build_worked_example(tree)
    nodes_before = tree.num_nodes()
    host_b = tree.host_value(node_b).tolist()
    res = tree.insert(A + B + C, idx(5000, len(A) + len(B) + len(C)))
    assert res.prefix_len == len(A)  # only Node_A's tokens were already on the device
    assert res.last_node == node_c
    assert tree.num_nodes() == nodes_before
    assert tree.value(node_b).tolist() == idx(5000 + len(A), len(B)).tolist()
    assert tree.host_value(node_b).tolist() == host_b
    assert tree.match_prefix(A + B + C).host_hit_length == 0
    assert tree.device_size() == len(A) + len(B) + len(C)


def test_insert_in_the_middle_of_an_evicted_node_splits_it_and_rematerializes_the_prefix(tree_cls):
    tree = tree_cls(1)
    _node_a, node_b, _ = build_worked_example(tree)
    res = tree.insert(A + B[:10], idx(7000, len(A) + 10))
    assert res.prefix_len == len(A)
    top = res.last_node
    assert tree.key(top).tolist() == B[:10]
    assert tree.value(top).tolist() == idx(7000 + len(A), 10).tolist()
    assert tree.value(node_b) is None  # the rest of B stays a tombstone


def test_insert_value_may_be_any_integer_dtype(tree_cls):
    tree = tree_cls(1)
    res = tree.insert([1, 2], np.array([3, 4], dtype=np.uint16))
    assert tree.value(res.last_node).dtype == np.int64


# ----------------------------------------------------------------------------- hit counts
@pytest.mark.parametrize(
    ("write_policy", "reported_on_hit"),
    [("write_through", 1), ("write_through_selective", 2), ("write_back", None)],
)
def test_insert_reports_backups_from_the_write_through_threshold(tree_cls, write_policy, reported_on_hit):
    tree = tree_cls(1, write_policy=write_policy)
    reported = []
    for hit in (1, 2, 3):
        res = tree.insert([1, 2, 3], idx(10 * hit, 3))
        if res.backup_nodes:
            reported.append(hit)
            assert res.backup_nodes == (res.last_node,)
    expected = [] if reported_on_hit is None else list(range(reported_on_hit, 4))
    assert reported == expected
    assert info(tree, res.last_node)["hit_count"] == 3


def test_chunked_inserts_neither_count_hits_nor_report_backups(tree_cls):
    tree = tree_cls(1, write_policy="write_through")
    res = tree.insert([1, 2, 3], idx(0, 3), chunked=True)
    assert res.backup_nodes == ()
    assert info(tree, res.last_node)["hit_count"] == 0
    res = tree.insert([1, 2, 3], idx(0, 3), chunked=True)
    assert info(tree, res.last_node)["hit_count"] == 0 and res.backup_nodes == ()


def test_match_does_not_count_a_hit(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    tree.match_prefix([1, 2, 3])
    assert info(tree, node)["hit_count"] == 1


def test_already_backed_up_nodes_are_not_reported_again(tree_cls):
    tree = tree_cls(1)
    insert_backed_up(tree, [1, 2, 3], 0, 100)
    assert tree.insert([1, 2, 3], idx(10, 3)).backup_nodes == ()


def test_nodes_in_flight_are_not_reported_again(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    tree.begin_backup(node, idx(100, 3))
    assert tree.insert([1, 2, 3], idx(10, 3)).backup_nodes == ()
    assert tree.commit_backup(node)


def test_backup_nodes_come_parents_first_and_include_unbacked_ancestors(tree_cls):
    tree = tree_cls(1, write_policy="write_through")
    top = tree.insert([1, 2], idx(0, 2), chunked=True).last_node  # never reported
    res = tree.insert([1, 2, 3, 4], idx(10, 4))
    assert res.backup_nodes == (top, res.last_node)


def test_hold_locks_the_deepest_node_to_back_up_and_nothing_below_it(tree_cls):
    """``insert(hold=True)`` protects the nodes it asks to back up until the caller
    releases them, as their backups' own locks would, and no more: with selective
    write-through the hot node can sit above the new leaf, which stays evictable."""
    tree = tree_cls(1, write_policy="write_through_selective")
    tree.insert([1, 2, 3, 4], idx(0, 4))
    res = tree.insert([1, 2, 7], idx(10, 3), hold=True)  # splits: [1, 2] now has two hits
    (top,) = res.backup_nodes
    assert tree.key(top).tolist() == [1, 2] and res.last_node != top
    assert (tree.protected_size(), tree.evictable_size()) == (2, 3)
    tree.dec_lock_refs([top])
    assert (tree.protected_size(), tree.evictable_size()) == (0, 5)
    res = tree.insert([5, 6], idx(20, 2), hold=True)  # one hit: nothing to back up, nothing held
    assert res.backup_nodes == () and tree.protected_size() == 0
    tree.check_invariants()


def test_selective_write_through_reports_the_ancestor_chain_of_a_hot_node(tree_cls):
    tree = tree_cls(1, write_policy="write_through_selective")
    tree.insert([1, 2, 3, 4], idx(0, 4))
    tree.insert([1, 2, 7], idx(10, 3))  # splits: [1, 2] now has two hits
    res = tree.insert([1, 2, 3, 4], idx(20, 4))
    top = tree.parent(res.last_node)
    assert tree.key(top).tolist() == [1, 2]
    assert res.backup_nodes == (top, res.last_node)


# ----------------------------------------------------------------------------- insert from a node
@pytest.mark.parametrize("page_size", [1, 2])
def test_insert_from_a_node_equals_the_insert_of_the_whole_key(tree_cls, page_size):
    """``insert(tail, start=node)`` (a chunked prefill's next chunk after the locked end
    of the last) leaves the tree as inserting the whole key from the root does: same
    nodes, values, sizes and prefix (counted over the tail), whatever the tail meets
    (nothing, a cached continuation, an evicted one, a split)."""
    chunks = [seq(1, 8), seq(9, 6), seq(15, 4)]
    other = seq(1, 8) + seq(9, 2) + [99, 98, 97, 96]  # a continuation cached by someone else
    trees = []
    for resume in (False, True):
        tree = tree_cls(page_size, write_policy="write_through")
        tree.insert(other, idx(500, len(other)))
        end, node = 0, tree.root
        for i, c in enumerate(chunks):
            key = [t for c in chunks[: i + 1] for t in c]
            values = idx(0, len(key))
            if resume:
                res = tree.insert(c, values[end:], chunked=True, start=node)
                prefix = end + res.prefix_len
            else:
                res = tree.insert(key, values, chunked=True)
                prefix = res.prefix_len
            # the first chunk and two tokens of the second are the other key's
            assert prefix == [8, 10, 14][i], (resume, i, prefix)
            end, node = len(key), res.last_node
            tree.check_invariants()
        m = tree.match_prefix([t for c in chunks for t in c])
        assert m.device_indices.tolist() == [*range(500, 510), *range(10, 18)] and m.last_device_node == node
        trees.append(whole_state(tree))
    assert trees[0] == trees[1]


def test_insert_from_a_node_stamps_its_ancestors_and_reports_their_backups(tree_cls):
    clock = FakeClock()
    tree = tree_cls(1, write_policy="write_through", clock=clock)
    top = tree.insert(seq(1, 4), idx(0, 4)).last_node  # hit once: reported, never backed up
    mid = tree.insert(seq(1, 6), idx(0, 6), chunked=True).last_node
    assert tree.parent(mid) == top
    clock.advance(5)
    res = tree.insert(seq(7, 2), idx(6, 2), start=mid)
    assert res.prefix_len == 0 and tree.parent(res.last_node) == mid
    assert info(tree, top)["last_access_time"] == info(tree, mid)["last_access_time"] == clock.now
    assert info(tree, mid)["hit_count"] == 0  # not descended: no hit counted
    assert res.backup_nodes == (top, mid, res.last_node)  # the unbacked chain, parents first
    tree.check_invariants()


def test_path_extent_is_the_tokens_from_the_nodes_root(tree_cls):
    tree = tree_cls(2)
    a = tree.insert(seq(1, 6), idx(0, 6)).last_node
    b = tree.insert(seq(1, 4) + [50, 51, 52, 53], idx(10, 8)).last_node  # splits a at 4
    c = tree.insert(seq(1, 4), idx(20, 4), "tenant").last_node
    assert tree.path_extent(a) == (6, tree.root) and tree.path_extent(b) == (8, tree.root)
    assert tree.path_extent(tree.parent(a)) == (4, tree.root)
    assert tree.path_extent(c) == (4, tree.namespace_root("tenant"))
    assert tree.path_extent(tree.root) == (0, tree.root)
    with pytest.raises(KeyError):
        tree.path_extent(a + (1 << 40))


def test_insert_from_a_node_refuses_an_evicted_or_stale_node(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, seq(1, 4), 0, 100)
    tree.evict(4)
    assert tree.is_evicted(node)
    with pytest.raises(ValueError, match="not on the device"):
        tree.insert(seq(5, 2), idx(4, 2), start=node)
    with pytest.raises(KeyError):
        tree.insert(seq(5, 2), idx(4, 2), start=node + (1 << 40))


# ----------------------------------------------------------------------------- backup
def test_begin_backup_returns_the_device_indices_and_locks_the_node(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], idx(40, 3)).last_node
    assert tree.begin_backup(node, idx(100, 3)).tolist() == [40, 41, 42]
    assert info(tree, node)["io_status"] == "writing"
    assert info(tree, node)["lock_ref"] == 1
    assert not info(tree, node)["backuped"]  # only after the commit
    assert tree.protected_size() == 3
    assert tree.commit_backup(node)
    assert info(tree, node)["backuped"] and info(tree, node)["io_status"] == "idle"
    assert tree.host_value(node).tolist() == [100, 101, 102]
    assert tree.host_size() == 3 and tree.protected_size() == 0


def test_begin_backup_refuses_a_node_whose_parent_is_not_backed_up(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    top = tree.insert([1, 2], idx(0, 2)).last_node
    child = tree.insert([1, 2, 3], idx(10, 3)).last_node
    before = whole_state(tree)
    with pytest.raises(ValueError):
        tree.begin_backup(child, idx(100, 1))
    assert whole_state(tree) == before
    tree.begin_backup(top, idx(200, 2))  # a parent in flight is good enough
    tree.begin_backup(child, idx(100, 1))
    assert tree.commit_backup(top) and tree.commit_backup(child)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("not on device", ValueError),
        ("already backed up", ValueError),
        ("in flight", LockError),
        ("wrong length", ValueError),
        ("root", ValueError),
    ],
)
def test_begin_backup_refuses_bad_requests(tree_cls, case, error):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    hosts = idx(100, 3)
    if case == "not on device":
        backup(tree, node, 100)
        tree.evict(3)
        hosts = idx(200, 3)
    elif case == "already backed up":
        backup(tree, node, 100)
    elif case == "in flight":
        tree.begin_backup(node, idx(100, 3))
    elif case == "wrong length":
        hosts = idx(100, 2)
    elif case == "root":
        node = tree.root
    before = whole_state(tree)
    with pytest.raises(error):
        tree.begin_backup(node, hosts)
    assert whole_state(tree) == before
    if case == "in flight":
        tree.commit_backup(node)


def test_failed_commit_leaves_the_tree_as_before_begin(tree_cls):
    tree = tree_cls(1)
    insert_backed_up(tree, [1, 2], 0, 100)
    node = tree.insert([1, 2, 3, 4], idx(10, 4)).last_node
    tree.insert([1, 2, 3, 4, 5], idx(20, 5))
    before = whole_state(tree)
    tree.begin_backup(node, idx(300, 2))
    assert whole_state(tree) != before
    assert tree.commit_backup(node, ok=False) is False
    assert whole_state(tree) == before


def test_child_commit_fails_when_its_parents_commit_failed(tree_cls):
    tree = tree_cls(1)
    top = tree.insert([1, 2], idx(0, 2)).last_node
    child = tree.insert([1, 2, 3], idx(10, 3)).last_node
    tree.begin_backup(top, idx(100, 2))
    tree.begin_backup(child, idx(200, 1))
    assert tree.commit_backup(top, ok=False) is False
    assert tree.commit_backup(child, ok=True) is False
    assert not info(tree, child)["backuped"] and not info(tree, top)["backuped"]
    assert tree.host_size() == 0 and tree.protected_size() == 0


def test_commit_without_a_backup_in_flight_is_refused(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    with pytest.raises(LockError, match="commit_backup: node"):
        tree.commit_backup(node)


def test_a_split_during_backup_commits_the_whole_group(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    tree.begin_backup(node, idx(100, 4))
    tree.match_prefix([1, 2, 9])  # splits the node in flight
    top = tree.parent(node)
    assert info(tree, top)["io_status"] == "writing"
    assert tree.commit_backup(node)
    assert tree.host_value(top).tolist() == [100, 101]
    assert tree.host_value(node).tolist() == [102, 103]
    assert info(tree, top)["io_status"] == "idle" and info(tree, top)["lock_ref"] == 0
    assert tree.host_size() == 4


def test_a_failed_commit_after_a_split_leaves_both_parts_unbacked(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    tree.begin_backup(node, idx(100, 4))
    tree.insert([1, 2, 8], idx(10, 3))  # splits and adds a sibling
    top = tree.parent(node)
    assert tree.commit_backup(node, ok=False) is False
    assert not info(tree, top)["backuped"] and not info(tree, node)["backuped"]
    assert tree.host_size() == 0 and tree.protected_size() == 0


# ----------------------------------------------------------------------------- insert_host
def test_insert_host_attaches_a_tombstone_below_the_root(tree_cls):
    tree = tree_cls(1)
    res = tree.insert_host(tree.root, [1, 2, 3], idx(100, 3))
    assert (res.matched_length, res.inserted_length) == (0, 3)
    assert tree.value(res.last_node) is None
    assert tree.host_value(res.last_node).tolist() == [100, 101, 102]
    assert tree.host_size() == 3 and tree.device_size() == 0
    m = tree.match_prefix([1, 2, 3])
    assert (m.host_hit_length, m.last_node, m.last_host_node) == (3, res.last_node, tree.root)


def test_insert_host_matches_existing_nodes_and_attaches_the_rest(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2, 3], 0, 100)
    res = tree.insert_host(node, [4, 5], idx(200, 2))
    assert (res.matched_length, res.inserted_length) == (0, 2)
    assert tree.parent(res.last_node) == node
    res = tree.insert_host(tree.root, [1, 2, 3, 4, 5, 6], idx(300, 6))
    assert (res.matched_length, res.inserted_length) == (5, 1)
    assert tree.host_value(res.last_node).tolist() == [305]
    assert tree.host_size() == 6


def test_insert_host_of_a_known_key_inserts_nothing(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2, 3], 0, 100)
    nodes = tree.num_nodes()
    res = tree.insert_host(tree.root, [1, 2, 3], idx(300, 3))
    assert (res.matched_length, res.inserted_length, res.last_node) == (3, 0, node)
    assert tree.num_nodes() == nodes


def test_insert_host_attaches_nothing_below_a_node_that_is_not_backed_up(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    res = tree.insert_host(tree.root, [1, 2, 3, 4, 5], idx(100, 5))
    assert (res.matched_length, res.inserted_length, res.last_node) == (3, 0, node)
    assert tree.num_nodes() == 1 and tree.host_size() == 0


def test_insert_host_refuses_a_mount_node_that_is_not_backed_up(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    before = whole_state(tree)
    with pytest.raises(ValueError):
        tree.insert_host(node, [4, 5], idx(100, 2))
    assert whole_state(tree) == before


def test_insert_host_splits_a_node_where_the_match_ends(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2, 3, 4], 0, 100)
    res = tree.insert_host(tree.root, [1, 2, 7, 8], idx(300, 4))
    assert (res.matched_length, res.inserted_length) == (2, 2)
    top = tree.parent(node)
    assert tree.parent(res.last_node) == top
    assert tree.host_value(top).tolist() == [100, 101]


@pytest.mark.parametrize("page_size", [4, 16])
def test_insert_host_is_page_aligned_and_hashed(tree_cls, page_size):
    tree = tree_cls(page_size, enable_hash=True)
    key = seq(0, 2 * page_size + 1)
    res = tree.insert_host(tree.root, key, idx(100, len(key)))
    assert res.inserted_length == 2 * page_size
    assert tree.hash_value(res.last_node) == hash_chain(key, page_size)


def test_insert_host_value_length_must_match_the_key(tree_cls):
    tree = tree_cls(1)
    with pytest.raises(ValueError):
        tree.insert_host(tree.root, [1, 2, 3], idx(100, 2))


# ----------------------------------------------------------------------------- locks
def test_lock_ref_deltas_move_tokens_between_evictable_and_protected(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    leaf = tree.insert([1, 2, 3, 4, 5], idx(10, 5)).last_node
    assert (tree.evictable_size(), tree.protected_size()) == (5, 0)
    assert tree.inc_lock_ref(leaf) == -5
    assert (tree.evictable_size(), tree.protected_size()) == (0, 5)
    assert tree.inc_lock_ref(leaf) == 0  # already protected
    assert tree.dec_lock_ref(leaf) == 0
    assert tree.dec_lock_ref(leaf) == 5
    assert (tree.evictable_size(), tree.protected_size()) == (5, 0)


def test_lock_ref_counts_only_device_tokens(tree_cls):
    tree = tree_cls(1)
    _node_a, node_b, node_c = build_worked_example(tree)
    assert tree.inc_lock_ref(node_c) == -len(A)
    assert info(tree, node_c)["lock_ref"] == 1 and info(tree, node_b)["lock_ref"] == 1
    assert tree.dec_lock_ref(node_c) == len(A)


def test_locked_nodes_are_not_evicted(tree_cls):
    tree = tree_cls(1)
    leaf = tree.insert([1, 2, 3], idx(0, 3)).last_node
    tree.inc_lock_ref(leaf)
    assert tree.evictable_leaves() == []
    assert tree.evict(3).num_evicted == 0
    tree.dec_lock_ref(leaf)
    assert tree.evict(3).num_evicted == 3


def test_dec_lock_ref_on_an_unlocked_node_raises_and_changes_nothing(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    leaf = tree.insert([1, 2, 3], idx(10, 3)).last_node
    before = whole_state(tree)
    with pytest.raises(LockError, match=f"dec_lock_ref on node {leaf}"):
        tree.dec_lock_ref(leaf)
    assert whole_state(tree) == before


def test_lock_on_the_root_is_a_no_op(tree_cls):
    tree = tree_cls(1)
    assert tree.inc_lock_ref(tree.root) == 0
    assert tree.dec_lock_ref(tree.root) == 0
    assert tree.protected_size() == 0


def test_dec_host_ref_without_a_reference_raises(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    with pytest.raises(LockError, match=f"dec_host_ref on node {node}"):
        tree.dec_host_ref(node)


# ----------------------------------------------------------------------------- evict
def test_evict_of_a_backed_up_leaf_leaves_a_tombstone(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2, 3], 0, 100)
    res = tree.evict(1)
    assert res.num_evicted == 3
    assert res.device_indices.tolist() == [0, 1, 2]
    assert (res.write_back_nodes, res.backup_nodes) == ((), ())
    assert tree.is_alive(node) and tree.value(node) is None
    assert tree.host_value(node).tolist() == [100, 101, 102]
    assert tree.evictable_host_leaves() == [node]
    assert (tree.device_size(), tree.host_size()) == (0, 3)


def test_write_through_evict_of_an_unbacked_leaf_deletes_it(tree_cls):
    tree = tree_cls(1, write_policy="write_through")
    node = tree.insert([1, 2, 3], idx(0, 3)).last_node
    res = tree.evict(3)
    assert res.device_indices.tolist() == [0, 1, 2]
    assert not tree.is_alive(node)
    assert tree.num_nodes() == 0 and tree.device_size() == 0


def test_evict_moves_up_to_parents_that_become_leaves(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    tree.insert([1, 2, 3], idx(10, 3))
    res = tree.evict(3)
    assert sorted(res.device_indices.tolist()) == [0, 1, 12]
    assert tree.num_nodes() == 0


def test_write_back_evict_reports_nodes_and_demote_completes_it(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    top = tree.insert([1, 2], idx(0, 2)).last_node
    leaf = tree.insert([1, 2, 3, 4], idx(10, 4)).last_node
    res = tree.evict(2)
    assert res.num_evicted == 2
    assert res.device_indices.tolist() == []
    assert res.write_back_nodes == (leaf,)
    assert res.backup_nodes == (top, leaf)  # parents first, unbacked ancestors included
    assert tree.value(leaf) is not None  # nothing freed yet
    for i, node in enumerate(res.backup_nodes):
        assert backup(tree, node, 100 + 10 * i)
    assert tree.demote(leaf).tolist() == [12, 13]
    assert tree.value(leaf) is None and tree.host_value(leaf).tolist() == [110, 111]
    assert tree.evictable_leaves() == [top]
    assert tree.evictable_host_leaves() == [leaf]


def test_write_back_evict_reports_each_victim_once(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    tree.insert([1], idx(0, 1))
    tree.insert([2], idx(1, 1))
    res = tree.evict(100)
    assert sorted(res.write_back_nodes) == sorted(set(res.write_back_nodes))
    assert len(res.write_back_nodes) == 2 and res.num_evicted == 2


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("not backed up", ValueError),
        ("has device children", ValueError),
        ("locked", LockError),
        ("evicted", ValueError),
        ("root", ValueError),
    ],
)
def test_demote_refuses_nodes_that_cannot_leave_the_device(tree_cls, case, error):
    tree = tree_cls(1)
    top = insert_backed_up(tree, [1, 2], 0, 100)
    target = top
    if case == "not backed up":
        target = tree.insert([5, 6], idx(20, 2), chunked=True).last_node
    elif case == "has device children":
        tree.insert([1, 2, 3], idx(10, 3), chunked=True)
    elif case == "locked":
        tree.inc_lock_ref(top)
    elif case == "evicted":
        tree.evict(2)
    elif case == "root":
        target = tree.root
    before = whole_state(tree)
    with pytest.raises(error):
        tree.demote(target)
    assert whole_state(tree) == before
    if case == "locked":
        tree.dec_lock_ref(top)


def test_evict_zero_tokens_does_nothing(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    res = tree.evict(0)
    assert res.num_evicted == 0 and res.device_indices.tolist() == []
    assert tree.device_size() == 2


def test_drop_deletes_an_unbacked_leaf_and_returns_its_indices(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    top = tree.insert([1, 2], idx(0, 2)).last_node
    leaf = tree.insert([1, 2, 3], idx(10, 3)).last_node
    assert tree.drop(leaf).tolist() == [12]
    assert not tree.is_alive(leaf)
    assert tree.evictable_leaves() == [top]
    assert (tree.device_size(), tree.num_nodes()) == (2, 1)


def test_drop_is_the_way_out_of_a_write_back_eviction(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    leaf = tree.insert([1, 2], idx(0, 2)).last_node
    res = tree.evict(2)
    assert res.write_back_nodes == (leaf,)
    assert tree.drop(leaf).tolist() == [0, 1]  # no host slot could be had for the backup
    assert tree.num_nodes() == 0


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("backed up", ValueError),
        ("locked", LockError),
        ("in flight", LockError),
        ("has children", ValueError),
        ("evicted", ValueError),
        ("root", ValueError),
    ],
)
def test_drop_refuses_nodes_it_must_not_delete(tree_cls, case, error):
    tree = tree_cls(1, write_policy="write_back")
    target = tree.insert([1, 2], idx(0, 2)).last_node
    if case == "backed up":
        backup(tree, target, 100)
    elif case == "locked":
        tree.inc_lock_ref(target)
    elif case == "in flight":
        tree.begin_backup(target, idx(100, 2))
    elif case == "has children":
        tree.insert([1, 2, 3], idx(10, 3))
    elif case == "evicted":
        backup(tree, target, 100)
        tree.evict(2)
    elif case == "root":
        target = tree.root
    before = whole_state(tree)
    with pytest.raises(error):
        tree.drop(target)
    assert whole_state(tree) == before
    if case == "locked":
        tree.dec_lock_ref(target)
    elif case == "in flight":
        tree.commit_backup(target)


def test_key_len_is_the_length_of_a_nodes_span(tree_cls):
    tree = tree_cls(4)
    node = tree.insert(seq(0, 11), idx(0, 11)).last_node
    assert tree.key_len(node) == 8 == len(tree.key(node))
    assert tree.key_len(tree.root) == 0
    tree.evict(8)
    with pytest.raises(KeyError):
        tree.key_len(node)


# ----------------------------------------------------------------------------- evict_host
def tombstone_chain(tree):
    """root -> [1, 2] -> [3, 4] -> [5, 6], all backed up and evicted."""
    nodes = [insert_backed_up(tree, [1, 2, 3, 4, 5, 6][: 2 * (i + 1)], 10 * i, 100 * (i + 1)) for i in range(3)]
    tree.evict(6)
    assert all(tree.value(n) is None for n in nodes)
    return nodes


def test_evict_host_removes_the_deepest_tombstone_first(tree_cls):
    tree = tree_cls(1)
    _n1, n2, n3 = tombstone_chain(tree)
    assert tree.evictable_host_leaves() == [n3]
    res = tree.evict_host(1)
    assert res.num_evicted == 2
    assert res.host_indices.tolist() == [300, 301]
    assert not tree.is_alive(n3)
    assert tree.evictable_host_leaves() == [n2]


def test_evict_host_cascades_to_parents_that_become_childless_tombstones(tree_cls):
    tree = tree_cls(1)
    _n1, _n2, _n3 = tombstone_chain(tree)
    res = tree.evict_host(6)
    assert res.num_evicted == 6
    assert res.host_indices.tolist() == [300, 301, 200, 201, 100, 101]
    assert tree.num_nodes() == 0 and tree.host_size() == 0


def test_evict_host_never_removes_device_nodes(tree_cls):
    tree = tree_cls(1)
    insert_backed_up(tree, [1, 2], 0, 100)
    res = tree.evict_host(100)
    assert res.num_evicted == 0 and res.host_indices.tolist() == []
    assert tree.host_size() == 2


def test_host_ref_counter_protects_a_tombstone_from_evict_host(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2], 0, 100)
    tree.evict(2)
    tree.inc_host_ref(node)
    assert tree.evictable_host_leaves() == []
    assert tree.evict_host(2).num_evicted == 0
    tree.dec_host_ref(node)
    assert tree.evictable_host_leaves() == [node]
    assert tree.evict_host(2).num_evicted == 2


def test_a_locked_tombstone_is_not_host_evictable(tree_cls):
    tree = tree_cls(1)
    node = insert_backed_up(tree, [1, 2], 0, 100)
    tree.evict(2)
    tree.inc_lock_ref(node)
    assert tree.evict_host(2).num_evicted == 0
    tree.dec_lock_ref(node)


# ----------------------------------------------------------------------------- load back
def test_load_back_restores_the_device_state(tree_cls):
    tree = tree_cls(1)
    _node_a, node_b, node_c = build_worked_example(tree)
    hosts = tree.evicted_host_indices(node_c)
    assert hosts.tolist() == tree.host_value(node_b).tolist() + tree.host_value(node_c).tolist()
    assert tree.begin_load_back(node_c, idx(9000, 192)) == 192
    assert tree.value(node_b).tolist() == idx(9000, 128).tolist()
    assert tree.value(node_c).tolist() == idx(9128, 64).tolist()
    assert info(tree, node_b)["io_status"] == "loading"
    m = tree.match_prefix(A + B + C)
    assert m.host_hit_length == 0 and m.last_device_node == node_c
    assert len(m.device_indices) == len(A) + 192
    tree.finish_load_back(node_c)
    assert info(tree, node_b)["io_status"] == "idle"
    assert tree.protected_size() == 0 and tree.evictable_size() == len(A) + 192


def test_nodes_being_loaded_are_locked(tree_cls):
    tree = tree_cls(1)
    node_a, _node_b, node_c = build_worked_example(tree)
    tree.begin_load_back(node_c, idx(9000, 192))
    assert info(tree, node_c)["lock_ref"] == 1 and info(tree, node_a)["lock_ref"] == 1
    assert tree.protected_size() == len(A) + 192
    assert tree.evict(10_000).num_evicted == 0
    tree.finish_load_back(node_c)
    assert tree.evict(10_000).num_evicted == len(A) + 192


def test_load_back_of_a_node_on_the_device_is_refused(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    assert tree.evicted_host_indices(node).tolist() == []
    with pytest.raises(ValueError):
        tree.begin_load_back(node, idx(0, 0))


def test_load_back_needs_one_device_index_per_token(tree_cls):
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    with pytest.raises(ValueError):
        tree.begin_load_back(node_c, idx(0, 191))


def test_finish_load_back_without_a_load_is_refused(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    with pytest.raises(LockError, match="finish_load_back: node"):
        tree.finish_load_back(node)


def test_a_split_during_load_back_finishes_the_whole_group(tree_cls):
    tree = tree_cls(1)
    _, node_b, node_c = build_worked_example(tree)
    tree.begin_load_back(node_c, idx(9000, 192))
    tree.match_prefix(A + B[:5] + [-1])
    top = tree.parent(node_b)
    assert info(tree, top)["io_status"] == "loading"
    tree.finish_load_back(node_c)
    assert info(tree, top)["io_status"] == "idle" and tree.protected_size() == 0


# ----------------------------------------------------------------------------- load-back plans
def test_a_plan_names_the_chain_and_its_device_anchor(tree_cls):
    tree = tree_cls(1)
    node_a, node_b, node_c = build_worked_example(tree)
    plan = tree.plan_load_back(node_c)
    assert plan.anchor == node_a
    assert plan.host_indices.dtype == np.int64
    assert plan.host_indices.tolist() == tree.evicted_host_indices(node_c).tolist()
    assert info(tree, node_c)["load_back_planned"] and not info(tree, node_b)["load_back_planned"]
    tree.check_invariants()
    tree.cancel_load_back(node_c)
    tree.check_invariants()


def test_a_plan_without_slots_changes_nothing(tree_cls):
    tree = tree_cls(1)
    node_a, _node_b, node_c = build_worked_example(tree)
    before = whole_state(tree)
    for node, lo, hi, anchor in (
        (node_c, 193, None, node_a),  # below the threshold: 192 tokens
        (node_c, 0, 191, node_a),  # beyond the quota
        (node_c, 0, 0, node_a),  # quota 0: the anchor alone
        (node_c, 0, -5, node_a),  # a quota already spent
        (node_a, 0, None, node_a),  # on the device: its own anchor
        (tree.root, 0, None, tree.root),
    ):
        plan = tree.plan_load_back(node, lo, hi)
        assert plan.anchor == anchor and plan.host_indices.tolist() == [], (node, lo, hi)
        assert whole_state(tree) == before
    with pytest.raises(LockError, match="cancel_load_back: node"):
        tree.cancel_load_back(node_c)


def test_the_threshold_and_quota_are_inclusive(tree_cls):
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    assert len(tree.plan_load_back(node_c, 192, 192).host_indices) == 192
    tree.cancel_load_back(node_c)


def test_a_held_plan_keeps_the_anchor_on_the_device_and_the_chain_on_the_host(tree_cls):
    tree = tree_cls(1)
    node_a, node_b, node_c = build_worked_example(tree)
    tree.plan_load_back(node_c)
    assert tree.protected_size() == len(A) and tree.evictable_size() == 0
    assert tree.evict(10_000).num_evicted == 0
    assert tree.evict_host(10_000).num_evicted == 0
    assert tree.value(node_a) is not None and tree.host_value(node_b) is not None
    tree.cancel_load_back(node_c)
    assert tree.protected_size() == 0 and tree.evictable_size() == len(A)
    assert tree.evict_host(10_000).num_evicted == len(B) + len(C)


def test_only_begin_or_cancel_releases_a_plan(tree_cls):
    """The plan's lock is its own: dec_lock_ref cannot take it, as with a transfer's."""
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    tree.plan_load_back(node_c)
    with pytest.raises(LockError, match="dec_lock_ref on node"):
        tree.dec_lock_ref(node_c)
    with pytest.raises(LockError, match="dec_lock_refs on node"):
        tree.dec_lock_refs([node_c])
    with pytest.raises(LockError, match="plan_load_back: node"):
        tree.plan_load_back(node_c)
    tree.check_invariants()
    tree.cancel_load_back(node_c)
    with pytest.raises(LockError, match="cancel_load_back: node"):
        tree.cancel_load_back(node_c)


def test_begin_load_back_takes_over_the_plans_lock(tree_cls):
    tree = tree_cls(1)
    node_a, _node_b, node_c = build_worked_example(tree)
    plan = tree.plan_load_back(node_c)
    assert tree.begin_load_back(node_c, idx(9000, len(plan.host_indices))) == 192
    assert info(tree, node_c)["lock_ref"] == 1 and info(tree, node_a)["lock_ref"] == 1
    assert not info(tree, node_c)["load_back_planned"]
    tree.check_invariants()
    with pytest.raises(LockError, match="cancel_load_back: node"):
        tree.cancel_load_back(node_c)
    tree.finish_load_back(node_c)
    assert tree.protected_size() == 0 and tree.evictable_size() == len(A) + 192
    tree.check_invariants()


def test_a_refused_begin_keeps_the_plan(tree_cls):
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    tree.plan_load_back(node_c)
    with pytest.raises(ValueError):
        tree.begin_load_back(node_c, idx(0, 191))
    assert info(tree, node_c)["load_back_planned"] and info(tree, node_c)["lock_ref"] == 1
    tree.cancel_load_back(node_c)
    assert info(tree, node_c)["lock_ref"] == 0


def test_a_plan_survives_a_split_of_its_chain(tree_cls):
    """A match into the planned chain splits it; the plan's handle is the lower part, and
    begin_load_back loads the whole chain, the new node included."""
    tree = tree_cls(1)
    node_a, node_b, node_c = build_worked_example(tree)
    plan = tree.plan_load_back(node_c)
    tree.match_prefix(A + B[:5] + [-1])
    top = tree.parent(node_b)
    assert top != node_a and tree.parent(top) == node_a
    tree.check_invariants()
    assert tree.evicted_host_indices(node_c).tolist() == plan.host_indices.tolist()
    tree.begin_load_back(node_c, idx(9000, 192))
    assert tree.value(top).tolist() == idx(9000, 5).tolist()
    tree.finish_load_back(node_c)
    assert tree.protected_size() == 0
    tree.check_invariants()


def test_plans_on_two_nodes_under_one_anchor(tree_cls):
    tree = tree_cls(1)
    node_a, node_b, node_c = build_worked_example(tree)
    assert tree.plan_load_back(node_b).anchor == tree.plan_load_back(node_c).anchor == node_a
    assert info(tree, node_b)["lock_ref"] == 2 and info(tree, node_a)["lock_ref"] == 2
    tree.begin_load_back(node_b, idx(9000, len(B)))  # loads node_b: node_c's chain shrinks
    tree.check_invariants()
    assert tree.plan_load_back(node_a).host_indices.tolist() == []
    tree.cancel_load_back(node_c)
    tree.finish_load_back(node_b)
    assert tree.protected_size() == 0
    tree.check_invariants()


def test_reset_drops_the_plans(tree_cls):
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    tree.plan_load_back(node_c)
    tree.reset()
    tree.check_invariants()
    _, _, node_c = build_worked_example(tree)
    assert len(tree.plan_load_back(node_c).host_indices) == 192  # not "held already"
    tree.cancel_load_back(node_c)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((1.5,), TypeError),
        (("1",), TypeError),
        ((None,), TypeError),
        ((0, 2.0), TypeError),
        ((2**63,), OverflowError),
        ((0, -(2**63) - 1), OverflowError),
    ],
)
def test_plan_load_back_refuses_bad_bounds(tree_cls, args, error):
    tree = tree_cls(1)
    _, _, node_c = build_worked_example(tree)
    before = whole_state(tree)
    with pytest.raises(error):
        tree.plan_load_back(node_c, *args)
    assert whole_state(tree) == before


@pytest.mark.parametrize("method", ["plan_load_back", "cancel_load_back"])
def test_plan_calls_refuse_bad_handles(tree_cls, method):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    tree.evict(2)  # not backed up: deleted, its handle stale
    for handle, error in ((node, KeyError), (-1, KeyError), (12345 << 32, KeyError), (1.0, TypeError)):
        with pytest.raises(error):
            getattr(tree, method)(handle)


# ----------------------------------------------------------------------------- namespaces
def test_identical_tokens_in_different_namespaces_never_share_a_node(tree_cls):
    tree = tree_cls(1)
    plain = tree.insert([1, 2, 3], idx(0, 3)).last_node
    a = tree.insert([1, 2, 3], idx(10, 3), extra_key="tenant-a").last_node
    b = tree.insert([1, 2, 3], idx(20, 3), extra_key="tenant-b").last_node
    assert len({plain, a, b}) == 3
    assert tree.parent(a) == tree.namespace_root("tenant-a") != tree.root
    assert tree.match_prefix([1, 2, 3], extra_key="tenant-a").device_indices.tolist() == [10, 11, 12]
    assert tree.match_prefix([1, 2, 3], extra_key="tenant-c").device_indices.tolist() == []
    assert tree.match_prefix([1, 2, 3]).device_indices.tolist() == [0, 1, 2]
    assert tree.num_nodes() == 3


def test_namespaces_have_different_hash_chains(tree_cls, impl_module):
    tree = tree_cls(4, enable_hash=True)
    key = seq(0, 8)
    plain = tree.insert(key, idx(0, 8)).last_node
    a = tree.insert(key, idx(10, 8), extra_key="a").last_node
    b = tree.insert(key, idx(20, 8), extra_key="b").last_node
    chains = [tree.hash_value(n) for n in (plain, a, b)]
    assert len({tuple(c) for c in chains}) == 3
    assert chains[1] == hash_chain(key, 4, impl_module.namespace_seed("a"))


def test_chain_seed_sets_where_each_roots_chain_starts(tree_cls, impl_module):
    key = seq(0, 8)
    # SGLang's chains: tokens only in every namespace, which still never share nodes.
    tree = tree_cls(4, enable_hash=True, chain_seed=lambda extra_key: None)
    a = tree.insert(key, idx(10, 8), extra_key="a").last_node
    plain = tree.insert(key, idx(0, 8)).last_node
    assert a != plain and tree.hash_value(a) == tree.hash_value(plain) == hash_chain(key, 4)
    assert tree.root_seed(tree.namespace_root("a")) is None and tree.root_seed(tree.root) is None
    # A seeded default root (hiradix.sglang's model namespace), stable across reset().
    seeds = {None: "11" * 32, "a": "22" * 32}
    calls = []
    tree = tree_cls(4, enable_hash=True, chain_seed=lambda k: calls.append(k) or seeds[k])
    plain = tree.insert(key, idx(0, 8)).last_node
    a = tree.insert(key, idx(10, 8), extra_key="a").last_node
    assert tree.hash_value(plain) == hash_chain(key, 4, "11" * 32)
    assert tree.hash_value(a) == hash_chain(key, 4, "22" * 32)
    assert calls == [None, "a"]  # once per root
    tree.check_invariants()
    tree.reset()
    assert tree.root_seed(tree.root) == "11" * 32
    # the default rule
    tree = tree_cls(4, enable_hash=True)
    assert tree.root_seed(tree.root) is None
    assert tree.root_seed(tree.namespace_root("b")) == impl_module.namespace_seed("b")
    with pytest.raises(ValueError, match="not a root"):
        tree.root_seed(tree.insert(key, idx(0, 8)).last_node)


@pytest.mark.parametrize(
    ("seed", "error"),
    [(lambda k: "ab", ValueError), (lambda k: 7, TypeError), (lambda k: "g" * 64, ValueError), ("00" * 32, TypeError)],
)
def test_a_bad_chain_seed_is_refused_naming_the_root(tree_cls, seed, error):
    with pytest.raises(error, match="chain_seed"):
        tree_cls(4, enable_hash=True, chain_seed=seed)


def test_namespace_root_is_stable(tree_cls):
    tree = tree_cls(1)
    assert tree.namespace_root(None) == tree.root
    assert tree.namespace_root("x") == tree.namespace_root("x")


def test_extra_key_must_be_a_string(tree_cls):
    tree = tree_cls(1)
    with pytest.raises(TypeError):
        tree.match_prefix([1, 2], extra_key=5)


# ----------------------------------------------------------------------------- hashes
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_hash_value_is_sglangs_chain(tree_cls, page_size):
    tree = tree_cls(page_size, enable_hash=True)
    key = seq(7, 3 * page_size)
    tree.insert(key[:page_size], idx(0, page_size))
    node = tree.insert(key, idx(0, len(key))).last_node
    parent = tree.parent(node)
    assert tree.hash_value(parent) + tree.hash_value(node) == hash_chain(key, page_size)


def test_hash_value_is_none_without_enable_hash(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    assert tree.hash_value(node) is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_enable_hashing_hashes_what_the_tree_holds_as_if_hashed_from_the_start(tree_cls, page_size):
    # An L3 attached at runtime to a cache built without hashes turns them on.
    rng = random.Random(page_size)
    keys = [[rng.randrange(6) for _ in range(page_size * rng.randrange(1, 9))] for _ in range(40)]
    spaces = [None, "tenant-a", None, "tenant-b"]
    plain, hashed = tree_cls(page_size), tree_cls(page_size, enable_hash=True)
    for k, key in enumerate(keys):
        for tree in (plain, hashed):
            tree.insert(key, idx(100 * k, len(key)), extra_key=spaces[k % 4])
    assert plain.hash_value(plain.match_prefix(keys[0]).last_node) is None
    plain.enable_hashing()
    plain.check_invariants()
    for k, key in enumerate(keys):
        a = plain.match_prefix(key, extra_key=spaces[k % 4]).last_node
        b = hashed.match_prefix(key, extra_key=spaces[k % 4]).last_node
        while not plain.is_root(a):
            assert plain.hash_value(a) == hashed.hash_value(b)
            a, b = plain.parent(a), hashed.parent(b)
    # What is inserted afterwards is hashed too, splits included.
    key = keys[0][:page_size] + [7] * page_size
    for tree in (plain, hashed):
        tree.insert(key, idx(9000, len(key)))
    node = plain.match_prefix(key).last_node
    assert plain.hash_value(plain.parent(node)) + plain.hash_value(node) == hash_chain(key, page_size)
    plain.enable_hashing()  # a second call changes nothing
    plain.check_invariants()


# ----------------------------------------------------------------------------- clock
def test_injected_clock_stamps_creation_and_access_times(tree_cls):
    clock = FakeClock(100)
    tree = tree_cls(1, clock=clock)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    assert (info(tree, node)["creation_time"], info(tree, node)["last_access_time"]) == (100.0, 100.0)
    clock.advance(150.5)  # to 250.5
    tree.match_prefix([1, 2])
    assert (info(tree, node)["creation_time"], info(tree, node)["last_access_time"]) == (100.0, 250.5)


def test_injected_clock_is_called_once_per_operation(tree_cls):
    clock = FakeClock(1)
    tree = tree_cls(1, clock=clock)
    tree.insert([1, 2, 3], idx(0, 3))
    tree.match_prefix([1, 2, 4])
    tree.insert_host(tree.root, [9], idx(100, 1))
    assert clock.calls == 3


def test_default_clock_is_a_logical_counter(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    assert info(tree, node)["creation_time"] == 1.0
    tree.match_prefix([1, 2])
    assert info(tree, node)["last_access_time"] == 2.0
    tree.insert([1, 2], idx(0, 2))
    assert info(tree, node)["last_access_time"] == 3.0


def test_reset_restarts_the_logical_clock(tree_cls):
    tree = tree_cls(1)
    tree.insert([1], idx(0, 1))
    tree.reset()
    node = tree.insert([2], idx(0, 1)).last_node
    assert info(tree, node)["creation_time"] == 1.0


# ----------------------------------------------------------------------------- inputs
TOKEN_INPUTS = {
    "list": lambda xs: list(xs),
    "numpy int32": lambda xs: np.array(xs, dtype=np.int32),
    "numpy int64": lambda xs: np.array(xs, dtype=np.int64),
    "numpy uint16": lambda xs: np.array(xs, dtype=np.uint16),
    "array q": lambda xs: array.array("q", xs),
    "tuple": lambda xs: tuple(xs),
    "numpy strided": lambda xs: np.repeat(np.array(xs, dtype=np.int64), 2)[::2],
    "numpy big-endian int32": lambda xs: np.array(xs, dtype=">i4"),
    "numpy big-endian int64": lambda xs: np.array(xs, dtype=">i8"),
    "numpy read-only": lambda xs: _read_only(np.array(xs, dtype=np.int32)),
}


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@pytest.mark.parametrize("kind", sorted(TOKEN_INPUTS))
def test_token_inputs_of_every_supported_kind_are_equivalent(tree_cls, kind):
    tree = tree_cls(1)
    convert = TOKEN_INPUTS[kind]
    res = tree.insert(convert([5, 6, 7]), convert([1, 2, 3]))
    assert tree.key(res.last_node).tolist() == [5, 6, 7]
    assert tree.match_prefix(convert([5, 6, 7, 8])).device_indices.tolist() == [1, 2, 3]
    assert tree.insert(convert([5, 6]), convert([8, 9])).prefix_len == 2


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_torch_cpu_tensors_are_accepted(tree_cls, dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    tree = tree_cls(1)
    key = torch.tensor([5, 6, 7], dtype=getattr(torch, dtype))
    res = tree.insert(key, torch.tensor([1, 2, 3], dtype=torch.int64))
    assert tree.key(res.last_node).tolist() == [5, 6, 7]
    assert tree.match_prefix(key).device_indices.tolist() == [1, 2, 3]


def test_empty_key_inserts_and_matches_nothing(tree_cls):
    tree = tree_cls(1)
    res = tree.insert([], [])
    assert (res.prefix_len, res.last_node, res.backup_nodes) == (0, tree.root, ())
    assert tree.match_prefix(np.array([], dtype=np.int64)).last_node == tree.root
    assert tree.num_nodes() == 0


def test_a_two_dimensional_key_is_refused(tree_cls):
    tree = tree_cls(1)
    with pytest.raises(ValueError):
        tree.insert(np.ones((2, 2), dtype=np.int32), idx(0, 4))
    with pytest.raises(ValueError):
        tree.match_prefix(np.ones((2, 2), dtype=np.int32))


def test_a_float_key_is_refused(tree_cls):
    tree = tree_cls(1)
    with pytest.raises(TypeError):
        tree.match_prefix(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        tree.insert([1, 2], np.array([1.5, 2.5]))


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**40])
def test_a_token_out_of_int32_range_is_refused(tree_cls, bad):
    tree = tree_cls(1)
    with pytest.raises(OverflowError):
        tree.insert(np.array([1, bad], dtype=np.int64), idx(0, 2))
    with pytest.raises(OverflowError):
        tree.match_prefix(np.array([1, bad], dtype=np.int64))
    assert tree.num_nodes() == 0


def test_int32_extremes_are_valid_tokens(tree_cls):
    tree = tree_cls(1)
    key = np.array([2**31 - 1, -(2**31)], dtype=np.int64)
    node = tree.insert(key, idx(0, 2)).last_node
    assert tree.key(node).tolist() == key.tolist()


@pytest.mark.parametrize("n", [7, 8, 9, 17, 1_100])
@pytest.mark.parametrize("as_input", [lambda a: a, lambda a: array.array("q", a.tobytes())], ids=["ndarray", "array q"])
def test_narrowing_checks_every_position_of_a_long_key(tree_cls, n, as_input):
    # The compiled narrowing runs in blocks of 8 with a scalar tail, prefetching 512 ids
    # ahead: a bad id in the first block, the middle, the tail or the last one is caught,
    # and every id of a good key is kept exactly.
    rng = np.random.default_rng(n)
    good = rng.integers(-(2**31), 2**31, size=n, dtype=np.int64)
    good[0], good[-1] = 2**31 - 1, -(2**31)
    tree = tree_cls(1)
    for pos in sorted({0, n // 2, n - 2, n - 1}):
        for bad in (2**31, -(2**31) - 1):
            key = good.copy()
            key[pos] = bad
            with pytest.raises(OverflowError):
                tree.insert(as_input(key), idx(0, n))
            with pytest.raises(OverflowError):
                tree.match_prefix(as_input(key))
    assert tree.num_nodes() == 0
    node = tree.insert(as_input(good), idx(0, n)).last_node
    assert tree.key(node).tolist() == good.tolist()
    assert tree.match_prefix(as_input(good)).device_indices.tolist() == idx(0, n).tolist()
    tree.check_invariants()


@pytest.mark.parametrize("n_values", [2, 4])
def test_a_value_of_the_wrong_length_is_refused(tree_cls, n_values):
    tree = tree_cls(1)
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], idx(0, n_values))
    assert tree.num_nodes() == 0


def test_a_stale_handle_raises_key_error(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    tree.evict(2)  # deletes the node (write_through, not backed up)
    newer = tree.insert([3, 4], idx(0, 2)).last_node  # may reuse the arena slot
    assert newer != node
    assert not tree.is_alive(node) and tree.is_alive(newer)
    for call in (tree.value, tree.key, tree.node_info, tree.inc_lock_ref, tree.parent, tree.children):
        with pytest.raises(KeyError):
            call(node)
    with pytest.raises(KeyError):
        tree.insert_host(node, [1], idx(0, 1))


def test_a_handle_from_before_reset_is_stale_afterwards(tree_cls):
    """The module docstring: a handle carries its slot's generation, "so a stale handle is
    detected instead of silently naming a newer node". reset() frees every node."""
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    tree.reset()
    newer = tree.insert([3, 4], idx(0, 2)).last_node
    assert newer != node
    assert not tree.is_alive(node)


@pytest.mark.parametrize("handle", [-1, 2**20, 12345 << 32])
def test_an_unknown_handle_raises_key_error(tree_cls, handle):
    tree = tree_cls(1)
    assert not tree.is_alive(handle)
    with pytest.raises(KeyError):
        tree.node_info(handle)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eviction_policy": "no-such-policy"},
        {"write_policy": "write_sometimes"},
        {"page_size": 0},
        {"page_size": -4},
    ],
    ids=["unknown policy", "unknown write policy", "page_size 0", "negative page_size"],
)
def test_bad_construction_arguments_raise_value_error(tree_cls, kwargs):
    with pytest.raises(ValueError):
        tree_cls(**kwargs)


# ----------------------------------------------------------------------------- queries
def test_children_come_oldest_first_as_in_sglangs_dict(tree_cls):
    """SGLang's ``children`` is a dict: a new child goes last and a deleted one leaves."""
    tree = tree_cls(1)
    for first in (9, 3, -5, 2**31 - 1, 0, -(2**31)):
        tree.insert([first, 1], idx(0, 2))
    assert [int(tree.key(h)[0]) for h in tree.children(tree.root)] == [9, 3, -5, 2**31 - 1, 0, -(2**31)]
    tree.evict(2)  # LRU: deletes the oldest, [9, 1]
    assert [int(tree.key(h)[0]) for h in tree.children(tree.root)] == [3, -5, 2**31 - 1, 0, -(2**31)]
    assert tree.num_children(tree.root) == 5


def test_a_split_keeps_the_childs_place_among_its_siblings(tree_cls):
    """SGLang's ``_split_node`` writes the new prefix under the same dict key."""
    tree = tree_cls(2)
    for page in ([1, 9, 7, 7], [1, -3], [0, 5]):
        tree.insert(page, idx(0, len(page)))
    first = tree.children(tree.root)[0]
    tree.match_prefix([1, 9])  # splits [1, 9, 7, 7] into [1, 9] -> [7, 7]
    kids = tree.children(tree.root)
    assert [tree.key(h).tolist() for h in kids] == [[1, 9], [1, -3], [0, 5]]
    assert tree.children(kids[0]) == [first] and tree.num_children(kids[0]) == 1


def test_root_has_no_parent(tree_cls):
    tree = tree_cls(1)
    assert tree.parent(tree.root) == -1
    assert tree.value(tree.root) is not None and len(tree.value(tree.root)) == 0
    assert tree.host_value(tree.root) is None


def test_node_counters_account_for_every_freed_node(tree_cls):
    tree = tree_cls(1)
    for i in range(5):
        tree.insert([i, 1, 2], idx(10 * i, 3))
    tree.evict(100)
    counters = tree.debug_counters()
    assert counters["nodes_live"] == 1  # the root
    assert counters["nodes_allocated"] - counters["nodes_freed"] == 1


def test_reset_forgets_everything(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2), extra_key="ns").last_node
    tree.inc_lock_ref(node)
    tree.reset()
    assert tree.num_nodes() == 0 and tree.protected_size() == 0
    assert not tree.is_alive(node)


# ----------------------------------------------------------------------------- more edges
def test_result_records_are_read_only(tree_cls):
    tree = tree_cls(1)
    res = tree.insert([1, 2], idx(0, 2))
    m = tree.match_prefix([1, 2])
    with pytest.raises(AttributeError):
        m.host_hit_length = 5
    with pytest.raises(AttributeError):
        res.prefix_len = 1


def test_handles_may_be_numpy_integers(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    assert tree.key(np.int64(node)).tolist() == [1, 2]
    assert tree.inc_lock_ref(np.int64(node)) == -2
    assert tree.dec_lock_ref(np.int64(node)) == 2


def test_a_fractional_page_size_is_refused(tree_cls):
    with pytest.raises(ValueError):
        tree_cls(2.5)


@pytest.mark.parametrize("page_size", [1, 2])
def test_hash_value_of_negative_and_extreme_tokens_follows_the_uint32_chain(tree_cls, page_size):
    tree = tree_cls(page_size, enable_hash=True)
    key = [-1, 2**31 - 1, -(2**31), 0]
    node = tree.insert(key, idx(0, 4)).last_node
    assert tree.hash_value(node) == hash_chain(key, page_size)


def test_an_integer_clock_is_stamped_as_float(tree_cls):
    tree = tree_cls(1, clock=lambda: 7)
    node = tree.insert([1], idx(0, 1)).last_node
    assert info(tree, node)["creation_time"] == 7.0
    assert isinstance(info(tree, node)["creation_time"], float)


def test_evict_of_a_negative_amount_does_nothing(tree_cls):
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    assert tree.evict(-5).num_evicted == 0
    assert tree.evict_host(-5).num_evicted == 0
    assert tree.device_size() == 2


def test_many_namespaces_each_get_a_root(tree_cls):
    tree = tree_cls(4, enable_hash=True)
    nodes = [tree.insert(seq(0, 8), idx(0, 8), extra_key=f"ns{i}").last_node for i in range(40)]
    assert len({tuple(tree.hash_value(n)) for n in nodes}) == 40
    assert len({tree.parent(n) for n in nodes}) == 40


def test_a_deep_chain_of_splits_matches_token_by_token(tree_cls):
    tree = tree_cls(1)
    key = seq(0, 200)
    tree.insert(key, idx(0, 200))
    for cut in range(199, 0, -7):
        tree.match_prefix(key[:cut] + [-1])
    assert tree.match_prefix(key).device_indices.tolist() == list(range(200))
    assert tree.num_nodes() > 20


# ----------------------------------------------------------------------------- change log
def changes(tree) -> list[tuple[str, int, int, int]]:
    """The records since the last call, kinds by name."""
    return [(Change(k).name, n, o, t) for k, n, o, t in tree.take_changes().tolist()]


def test_change_log_is_off_by_default_and_records_nothing(tree_cls):
    tree = tree_cls(1)
    assert tree.track_changes is False
    tree.insert([1, 2], idx(0, 2))
    tree.evict(2)
    out = tree.take_changes()
    assert out.shape == (0, 4) and out.dtype == np.int64


def test_insert_split_and_match_split_are_logged_with_their_lengths(tree_cls):
    tree = tree_cls(2)
    tree.track_changes = True
    a = tree.insert(seq(0, 6), idx(0, 6)).last_node
    assert changes(tree) == [("INSERTED", a, -1, 6)]
    b = tree.insert(seq(0, 4) + [9, 9], idx(10, 6)).last_node
    top = tree.parent(a)
    assert changes(tree) == [("SPLIT", top, a, 4), ("INSERTED", b, -1, 2)]
    tree.match_prefix(seq(0, 2))  # the match ends inside ``top``
    assert changes(tree) == [("SPLIT", tree.parent(top), top, 2)]
    assert changes(tree) == []  # taken: the log is empty


def test_tier_moves_are_logged_parents_first(tree_cls):
    tree = tree_cls(1)
    tree.track_changes = True
    res = tree.insert(seq(0, 4), idx(0, 4))
    (a,) = res.backup_nodes
    tree.begin_backup(a, idx(100, 4))
    tree.match_prefix(seq(0, 2))  # split while the backup is in flight: both parts commit
    top = tree.parent(a)
    assert tree.commit_backup(a)
    assert changes(tree)[-2:] == [("BACKED_UP", top, -1, 2), ("BACKED_UP", a, -1, 2)]
    assert tree.evict(4).num_evicted == 4
    assert changes(tree) == [("DEMOTED", a, -1, 2), ("DEMOTED", top, -1, 2)]
    tree.begin_load_back(a, idx(50, 4))
    assert changes(tree) == [("LOADED", top, -1, 2), ("LOADED", a, -1, 2)]
    tree.finish_load_back(a)
    tree.demote(a)
    assert changes(tree) == [("DEMOTED", a, -1, 2)]
    tree.insert(seq(0, 4), idx(60, 4))  # recomputed KV refills the evicted node
    assert changes(tree) == [("REFILLED", a, -1, 2)]
    tree.evict(4)
    changes(tree)
    assert tree.evict_host(4).num_evicted == 4
    assert changes(tree) == [("HOST_DELETED", a, -1, 2), ("HOST_DELETED", top, -1, 2)]
    assert not tree.is_alive(a)


def test_failed_commit_logs_nothing(tree_cls):
    tree = tree_cls(1)
    tree.track_changes = True
    a = tree.insert(seq(0, 3), idx(0, 3)).last_node
    changes(tree)
    tree.begin_backup(a, idx(100, 3))
    assert not tree.commit_backup(a, ok=False)
    assert changes(tree) == []


def test_deletions_and_host_inserts_are_logged(tree_cls):
    tree = tree_cls(1, write_policy="write_back")
    tree.track_changes = True
    a = tree.insert(seq(0, 3), idx(0, 3)).last_node
    b = tree.insert_host(tree.root, seq(10, 2), idx(100, 2)).last_node
    assert changes(tree) == [("INSERTED", a, -1, 3), ("HOST_INSERTED", b, -1, 2)]
    res = tree.evict(3)
    assert res.write_back_nodes == (a,) and changes(tree) == []  # nothing freed yet
    tree.drop(a)
    assert changes(tree) == [("DELETED", a, -1, 3)]


def test_write_through_eviction_logs_a_deleted_leaf(tree_cls):
    tree = tree_cls(1)
    tree.track_changes = True
    a = tree.insert(seq(0, 3), idx(0, 3)).last_node
    changes(tree)
    tree.evict(1)
    assert changes(tree) == [("DELETED", a, -1, 3)]


def test_turning_the_log_off_or_a_reset_drops_what_was_not_taken(tree_cls):
    tree = tree_cls(1)
    tree.track_changes = True
    tree.insert(seq(0, 3), idx(0, 3))
    tree.track_changes = False
    tree.track_changes = True
    assert changes(tree) == []
    tree.insert(seq(5, 3), idx(5, 3))
    tree.reset()
    assert changes(tree) == []


def test_a_long_change_log_grows_and_replays_to_the_tree(tree_cls):
    tree = tree_cls(1)
    tree.track_changes = True
    mirror = ChangeMirror(tree)
    for i in range(300):  # past any initial capacity of the log
        tree.insert([i % 7, i], idx(2 * i, 2))
    mirror.apply(tree.take_changes())
    mirror.check(tree)


def test_reserve_tokens_is_a_checked_hint_that_changes_nothing_observable(tree_cls):
    """``reserve_tokens`` sizes (and, in the core, touches) the buffers ahead of inserts:
    the tree then behaves exactly as without it, past the reserved size too."""
    plain, reserved = tree_cls(page_size=4), tree_cls(page_size=4)
    reserved.reserve_tokens(4096)
    reserved.reserve_tokens(0)  # never shrinks
    for bad, exc in ((1.5, TypeError), ("8", TypeError), (-1, ValueError), (2**70, OverflowError)):
        with pytest.raises(exc):
            reserved.reserve_tokens(bad)
    rng = np.random.default_rng(7)
    for i in range(40):  # 40 x 256 tokens: well past the 4096 reserved
        key = np.concatenate((np.arange(128), rng.integers(1000, 5000, 128)))
        value = np.arange(i * 256, (i + 1) * 256)
        a, b = plain.insert(key, value), reserved.insert(key, value)
        assert a.prefix_len == b.prefix_len
    for t in (plain, reserved):
        t.check_invariants()
    probe = np.concatenate((np.arange(128), rng.integers(1000, 5000, 128)))
    assert np.array_equal(plain.match_prefix(probe).device_indices, reserved.match_prefix(probe).device_indices)
    assert plain.evictable_size() == reserved.evictable_size()


@pytest.mark.parametrize("reserve", [False, True])
def test_a_large_eviction_hands_back_every_slot_once(tree_cls, reserve):
    """An eviction of more than a MiB of indices (the core writes those with
    non-temporal stores, from any alignment): every slot comes back once, in spans that
    match the nodes' values, into the reserved buffer or a new array."""
    tree = tree_cls(page_size=1)
    if reserve:
        tree.reserve_tokens(400_000, evict_tokens=400_000)
    rng = np.random.default_rng(3)
    slots = rng.permutation(400_000).astype(np.int64)  # scattered, as a real pool's
    lens = [1, 3, 150_001, 7, 99_999, 2, 149_987]  # odd sizes: spans start at any 8-byte offset
    start = 0
    for i, n in enumerate(lens):
        tree.insert(np.full(n, 1000 + i), slots[start : start + n])
        start += n
    evicted = tree.evict(start).device_indices
    assert len(evicted) == start and np.array_equal(np.sort(evicted), np.sort(slots[:start]))
    tree.check_invariants()


def test_reserved_evict_buffer_never_changes_a_result_still_held(tree_cls):
    """``reserve_tokens(evict_tokens=)`` lets evict's device indices share one touched
    buffer (the core; the twin ignores it). A result, or any view or tensor made from
    it, that is still alive keeps its values through later evicts: those get new
    arrays. Evictions past the buffer's size get new arrays too."""
    tree = tree_cls(page_size=1)
    tree.reserve_tokens(64, evict_tokens=8)
    for bad, exc in ((1.5, TypeError), (-1, ValueError)):
        with pytest.raises(exc):
            tree.reserve_tokens(0, evict_tokens=bad)
    for i in range(6):  # six leaves of 4 tokens, slots 4i..4i+3
        tree.insert([100 + i, 1, 2, 3], idx(4 * i, 4))
    first = tree.evict(4).device_indices
    kept = first.copy()
    exported = memoryview(first[1:])  # a view of a view, held through the buffer protocol
    del first
    second = tree.evict(4).device_indices
    assert np.array_equal(np.asarray(exported), kept[1:]), "an evict overwrote a result still held"
    assert not np.shares_memory(second, np.asarray(exported))
    exported.release()
    del exported
    third = tree.evict(4).device_indices  # nothing from the first is held any more
    held = third.copy()
    large = tree.evict(12).device_indices  # past the reserved 8: a new array
    assert np.array_equal(third, held) and len(large) == 12
    freed = np.concatenate((kept, second, third, large))
    assert sorted(freed.tolist()) == list(range(24))  # every slot once, whichever array
    tree.check_invariants()
