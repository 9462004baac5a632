"""The tree's error contract and its typed node accessors, against every implementation.

Errors (``hiradix.tree._reference`` module docstring): ``KeyError`` for a handle naming no live
node, ``TypeError`` for non-integers (never truncated) and non-integer dtypes,
``OverflowError`` for integers the tree cannot store, ``ValueError`` for bad shapes,
lengths and node states, :class:`hiradix.LockError` for a broken locking or transfer
protocol. Every refused call leaves the tree exactly as it was; the parity state machine
(``test_parity_stateful.py``) draws the same misuses at random and compares the two trees.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import hiradix
from hiradix.transport.fake import FakeClock
from hiradix.tree._results import IOStatus, LockError
from tests.support import IMPLEMENTATIONS
from tests.tree.test_unit import backup, idx, whole_state


def refused(tree, error, call, *args, **kwargs):
    """``call(*args, **kwargs)`` raises exactly ``error`` and changes nothing."""
    before = whole_state(tree)
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    assert type(caught.value) is error, repr(caught.value)
    tree.check_invariants()
    assert whole_state(tree) == before
    return str(caught.value)


def lock_refused(tree, op: str, node: int, *args) -> str:
    """A LockError whose message names the operation and the node."""
    msg = refused(tree, LockError, getattr(tree, op), node, *args)
    assert op in msg and f"node {node}" in msg, msg
    return msg


# ----------------------------------------------------------------------------- exports
def test_lock_error_is_a_runtime_error_exported_by_hiradix():
    assert hiradix.LockError is LockError and issubclass(LockError, RuntimeError)
    assert hiradix.IOStatus is IOStatus
    assert [(s.name, int(s)) for s in IOStatus] == [("IDLE", 0), ("WRITING", 1), ("LOADING", 2)]


def _public_methods(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_core_twin_and_stub_declare_the_same_tree_api():
    """A method added to one implementation only (or missing from the stub) fails here."""
    stub = ast.parse((Path(hiradix.__file__).parent / "tree" / "_core.pyi").read_text())
    (cls,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "HiRadixTree"]
    declared = _public_methods(n.name for n in cls.body if isinstance(n, ast.FunctionDef))
    declared |= _public_methods(
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    )
    for name, module in IMPLEMENTATIONS.items():
        tree = module.HiRadixTree(1)
        assert _public_methods(dir(tree)) == declared, name


# ----------------------------------------------------------------------------- locks
def test_dec_lock_ref_needs_a_lock_of_the_nodes_own(tree_cls):
    tree = tree_cls(1)
    top = tree.insert([1, 2], idx(0, 2)).last_node
    leaf = tree.insert([1, 2, 3], idx(10, 3)).last_node
    lock_refused(tree, "dec_lock_ref", leaf)  # never locked
    tree.inc_lock_ref(leaf)
    # top's lock_ref is 1, but the lock is leaf's: releasing it from top would leave
    # leaf locked under an unlocked parent
    msg = lock_refused(tree, "dec_lock_ref", top)
    assert "no lock of its own" in msg
    assert tree.dec_lock_ref(leaf) == 3
    lock_refused(tree, "dec_lock_ref", leaf)  # released twice


def test_a_lock_survives_a_split_of_its_node(tree_cls):
    """The locked handle stays the split's lower part, so it still owns the lock."""
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    tree.inc_lock_ref(node)
    prefix = tree.match_prefix([1, 2, 9]).last_node  # splits [1, 2] off
    assert tree.parent(node) == prefix and tree.lock_ref(prefix) == 1
    lock_refused(tree, "dec_lock_ref", prefix)
    assert tree.dec_lock_ref(node) == 4
    assert tree.protected_size() == 0


@pytest.mark.parametrize("kind", ["backup", "load"])
def test_dec_lock_ref_cannot_release_a_transfers_lock(tree_cls, kind):
    """The copy in flight keeps its slots: a stray release must not make them evictable."""
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    if kind == "backup":
        tree.begin_backup(node, idx(100, 2))
    else:
        backup(tree, node, 100)
        tree.evict(2)
        tree.begin_load_back(node, idx(50, 2))
    lock_refused(tree, "dec_lock_ref", node)
    assert tree.evict(2).num_evicted == 0
    if kind == "backup":
        assert tree.commit_backup(node)
    else:
        tree.finish_load_back(node)
    assert tree.lock_ref(node) == 0


def test_dec_host_ref_below_zero_is_refused(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    lock_refused(tree, "dec_host_ref", node)
    tree.inc_host_ref(node)
    tree.dec_host_ref(node)
    lock_refused(tree, "dec_host_ref", node)
    lock_refused(tree, "dec_host_ref", tree.root)


# ----------------------------------------------------------------------------- transfers
def test_a_backup_is_committed_once(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    lock_refused(tree, "commit_backup", node)  # never begun
    tree.begin_backup(node, idx(100, 2))
    lock_refused(tree, "begin_backup", node, idx(200, 2))  # begun twice
    lock_refused(tree, "finish_load_back", node)  # the wrong kind of transfer
    assert tree.commit_backup(node)
    msg = lock_refused(tree, "commit_backup", node)  # committed twice
    assert "no writing transfer in flight" in msg


def test_a_load_is_finished_once(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    backup(tree, node, 100)
    tree.evict(2)
    lock_refused(tree, "finish_load_back", node)  # never begun
    tree.begin_load_back(node, idx(50, 2))
    lock_refused(tree, "commit_backup", node)  # the wrong kind of transfer
    tree.finish_load_back(node)
    lock_refused(tree, "finish_load_back", node)  # finished twice


@pytest.mark.parametrize("kind", ["backup", "load"])
def test_a_transfer_is_finished_on_the_node_it_was_begun_on(tree_cls, kind):
    """A split during the copy makes a prefix that shares the transfer; finishing from it
    used to release the lock on the wrong path (lock_ref below the child's)."""
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    if kind == "backup":
        tree.begin_backup(node, idx(100, 4))
    else:
        backup(tree, node, 100)
        tree.evict(4)
        tree.begin_load_back(node, idx(50, 4))
    prefix = tree.match_prefix([1, 2]).last_node
    assert tree.parent(node) == prefix and tree.io_status(prefix) == tree.io_status(node) != IOStatus.IDLE
    op = "commit_backup" if kind == "backup" else "finish_load_back"
    msg = lock_refused(tree, op, prefix)
    assert "split off" in msg
    getattr(tree, op)(node)
    assert tree.io_status(prefix) == tree.io_status(node) == IOStatus.IDLE
    assert tree.protected_size() == 0


@pytest.mark.parametrize("kind", ["writing", "loading"])
def test_nodes_with_a_copy_in_flight_are_neither_demoted_nor_dropped(tree_cls, kind):
    tree = tree_cls(1, write_policy="write_back")
    node = tree.insert([1, 2], idx(0, 2)).last_node
    if kind == "writing":
        tree.begin_backup(node, idx(100, 2))
        lock_refused(tree, "drop", node)
        assert tree.evict(2).num_evicted == 0
        assert tree.commit_backup(node)
    else:
        backup(tree, node, 100)
        tree.demote(node)
        tree.begin_load_back(node, idx(50, 2))
        lock_refused(tree, "demote", node)
        assert tree.evict(2).num_evicted == 0
        tree.finish_load_back(node)
    assert tree.demote(node).tolist() == ([0, 1] if kind == "writing" else [50, 51])


# ----------------------------------------------------------------------------- bad input
NOT_INTEGERS = [1.5, np.float64(2.0), None, "1"]


@pytest.mark.parametrize("handle", NOT_INTEGERS, ids=repr)
def test_a_handle_that_is_not_an_integer_is_a_type_error(tree_cls, handle):
    """The core used to truncate a float handle to a live node."""
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    for call in (tree.key, tree.inc_lock_ref, tree.is_alive, tree.io_status, tree.children):
        refused(tree, TypeError, call, handle)


@pytest.mark.parametrize("handle", [-1, 2**63, 2**64, -(2**63) - 1, 7 << 32])
def test_an_integer_naming_no_node_is_a_key_error(tree_cls, handle):
    """Beyond int64 too: the core used to raise OverflowError there."""
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    assert not tree.is_alive(handle)
    for call in (tree.key, tree.dec_lock_ref, tree.lock_ref, tree.commit_backup):
        refused(tree, KeyError, call, handle)


@pytest.mark.parametrize(
    ("value", "error"),
    [(1.5, TypeError), (None, TypeError), ("3", TypeError), (2**63, OverflowError), (-(2**63) - 1, OverflowError)],
    ids=repr,
)
def test_counts_and_priorities_are_int64(tree_cls, value, error):
    """The core truncated floats and the twin accepted any Python number."""
    tree = tree_cls(1)
    tree.insert([1, 2], idx(0, 2))
    refused(tree, error, tree.evict, value)
    refused(tree, error, tree.evict_host, value)
    refused(tree, error, tree.insert, [5, 6], idx(10, 2), priority=value)
    assert tree.evict(np.int64(2)).num_evicted == 2  # numpy integers are integers


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        (np.array([1, 2**31], dtype=np.int64), OverflowError),
        (np.array([2**63], dtype=np.uint64), OverflowError),
        ([2**70, 1], OverflowError),  # numpy makes an object array of it
        ([1.0, 2.0], TypeError),
        ([True], TypeError),
        (np.array([1, 2], dtype=object), TypeError),  # small ints, but an object dtype
        ([[1, 2]], ValueError),
    ],
    ids=["int64 beyond int32", "uint64", "python int beyond 64 bits", "float", "bool", "object", "2-D"],
)
def test_bad_token_ids_are_refused_alike_everywhere(tree_cls, tokens, error):
    tree = tree_cls(1)
    n = int(np.size(tokens))
    refused(tree, error, tree.insert, tokens, idx(0, n))
    refused(tree, error, tree.match_prefix, tokens)
    refused(tree, error, tree.insert_host, tree.root, tokens, idx(0, n))


@pytest.mark.parametrize(
    ("indices", "error"),
    [
        (np.array([2**63, 1], dtype=np.uint64), OverflowError),  # used to wrap to a negative
        ([2**70, 1], OverflowError),
        (np.array([1, 2**31], dtype=np.int64), OverflowError),  # slots are stored as int32
        ([-(2**31) - 1, 1], OverflowError),
        ([1.0, 2.0], TypeError),
        (np.zeros((2, 1), dtype=np.int64), ValueError),
        ([1, 2, 3], ValueError),
    ],
    ids=[
        "uint64 beyond int64",
        "python int beyond 64 bits",
        "int64 beyond int32",
        "below int32",
        "float",
        "2-D",
        "wrong length",
    ],
)
def test_bad_kv_indices_are_refused_alike_everywhere(tree_cls, indices, error):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    refused(tree, error, tree.insert, [5, 6], indices)
    refused(tree, error, tree.insert_host, tree.root, [5, 6], indices)
    refused(tree, error, tree.begin_backup, node, indices)
    refused(tree, error, tree.begin_backups, [node], indices)
    backup(tree, node, 100)
    tree.evict(2)
    refused(tree, error, tree.begin_load_back, node, indices)


@pytest.mark.parametrize("page_size", [1, 2])
def test_insert_checks_only_the_slots_it_stores(tree_cls, page_size):
    """Slots of the prefix already on the device are never read, so they are not checked
    (reading the whole value array cost 28% of an insert, issue 47); those the insert
    stores are: the new node's, an evicted span's it re-materializes, a split's tail."""
    big = 2**31
    tree = tree_cls(page_size)
    node = tree.insert([1, 2, 3, 4], idx(0, 4)).last_node
    res = tree.insert([1, 2, 3, 4, 5, 6], [big, big, -big - 1, big, 10, 11])  # prefix unread
    assert res.prefix_len == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == [0, 1, 2, 3, 10, 11]
    assert tree.insert([5, 6], [big, big], start=node).prefix_len == 2  # continued, on the device
    refused(tree, OverflowError, tree.insert, [5, 6, 7, 8], [big, big, big, 1], start=node)
    refused(tree, OverflowError, tree.insert, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 10, 11, big, 13])
    refused(tree, OverflowError, tree.insert, [1, 2, 9, 9], [0, 1, big, 3])  # the tail past a split
    refused(tree, OverflowError, tree.insert, [1, 2, 3, 4], [0, 1, 2, big], extra_key="other namespace")
    backup(tree, node, 100)
    tree.evict(tree.evictable_size())  # all of it to host: a re-insert stores every slot
    refused(tree, OverflowError, tree.insert, [1, 2, 3, 4], [0, 1, 2, big])
    tree.check_invariants()


def test_kv_indices_at_the_int32_bounds_round_trip_through_every_tier(tree_cls):
    """The span buffers keep slots in 4 bytes: the extremes they take come back as given."""
    lo, hi = -(2**31), 2**31 - 1
    tree = tree_cls(1)
    node = tree.insert([1, 2, 3], [hi, lo, 0]).last_node
    assert tree.match_prefix([1, 2, 3]).device_indices.tolist() == [hi, lo, 0]
    assert tree.begin_backup(node, [lo, hi, 7]).tolist() == [hi, lo, 0]
    assert tree.commit_backup(node)
    assert tree.host_value(node).tolist() == [lo, hi, 7]
    assert tree.evict(3).device_indices.tolist() == [hi, lo, 0]
    assert tree.evicted_host_indices(node).tolist() == [lo, hi, 7]
    assert tree.begin_load_back(node, [lo + 1, hi - 1, 5]) == 3
    tree.finish_load_back(node)
    assert tree.match_prefix([1, 2, 3]).device_indices.tolist() == [lo + 1, hi - 1, 5]
    tree.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"page_size": 2**64}, OverflowError),
        ({"eviction_policy": 5}, TypeError),
        ({"write_policy": 5}, TypeError),
        ({"write_policy": ["write_back"]}, TypeError),
        ({"clock": 5}, TypeError),
    ],
    ids=repr,
)
def test_bad_construction_arguments_are_refused_alike(tree_cls, kwargs, error):
    with pytest.raises(error):
        tree_cls(**kwargs)


def test_a_refused_call_does_not_tick_the_clock(tree_cls):
    clock = FakeClock()
    tree = tree_cls(1, clock=clock)
    for call, args, kwargs in [
        (tree.insert, ([1, 2], idx(0, 3)), {}),
        (tree.insert, ([1, 2], idx(0, 2)), {"priority": 0.5}),
        (tree.insert, ([1, 2], idx(0, 2), 7), {}),
        (tree.match_prefix, ([2**31],), {}),
        (tree.insert_host, (tree.root, [1], [1.5]), {}),
    ]:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            call(*args, **kwargs)
    assert clock.calls == 0


# ----------------------------------------------------------------------------- accessors
def test_typed_accessors_follow_a_node_through_its_lifecycle(tree_cls):
    clock = FakeClock(5.0)
    tree = tree_cls(1, clock=clock, write_policy="write_through_selective")
    node = tree.insert([1, 2], idx(0, 2), priority=3).last_node
    clock.advance(1)
    tree.insert([1, 2], idx(0, 2))

    def state():
        return (tree.is_evicted(node), tree.is_backed_up(node), tree.io_status(node), tree.lock_ref(node))

    assert state() == (False, False, IOStatus.IDLE, 0)
    assert (tree.hit_count(node), tree.priority(node)) == (2, 3)
    assert (tree.creation_time(node), tree.last_access_time(node)) == (5.0, 6.0)
    tree.begin_backup(node, idx(100, 2))
    assert state() == (False, False, IOStatus.WRITING, 1)
    tree.commit_backup(node)
    assert state() == (False, True, IOStatus.IDLE, 0)
    tree.evict(2)
    assert state() == (True, True, IOStatus.IDLE, 0)
    tree.inc_host_ref(node)
    assert tree.host_ref_counter(node) == 1
    tree.dec_host_ref(node)
    tree.begin_load_back(node, idx(50, 2))
    assert state() == (False, True, IOStatus.LOADING, 1)
    assert isinstance(tree.io_status(node), IOStatus)
    tree.finish_load_back(node)
    tree.inc_lock_ref(node)
    assert state() == (False, True, IOStatus.IDLE, 1)
    tree.dec_lock_ref(node)


def test_typed_accessors_agree_with_node_info(tree_cls):
    tree = tree_cls(2)
    tree.insert([1, 2, 3, 4], idx(0, 4), priority=2)
    leaf = tree.insert([1, 2, 3, 4, 5, 6], idx(10, 6)).last_node
    mid = tree.match_prefix([1, 2, 7, 7]).last_node
    tree.inc_lock_ref(leaf)
    ns_root = tree.namespace_root("tenant")
    for h in (tree.root, ns_root, mid, tree.parent(leaf), leaf):
        info = tree.node_info(h)
        assert tree.is_root(h) == (info["parent"] == -1)
        assert tree.is_evicted(h) == info["evicted"]
        assert tree.is_backed_up(h) == info["backuped"]
        assert tree.io_status(h).name.lower() == info["io_status"]
        assert tree.num_children(h) == info["num_children"] == len(tree.children(h))
        for name in ("lock_ref", "host_ref_counter", "hit_count", "priority", "last_access_time", "creation_time"):
            value = getattr(tree, name)(h)
            assert value == info[name] and type(value) is type(info[name]), name
    assert tree.is_root(ns_root) and tree.is_backed_up(tree.root) and not tree.is_evicted(tree.root)
    tree.dec_lock_ref(leaf)


def test_accessors_of_a_freed_node_raise_key_error(tree_cls):
    tree = tree_cls(1)
    node = tree.insert([1, 2], idx(0, 2)).last_node
    tree.evict(2)
    for name in ("is_root", "is_evicted", "is_backed_up", "io_status", "lock_ref", "host_ref_counter",
                 "hit_count", "priority", "last_access_time", "creation_time", "num_children"):  # fmt: skip
        with pytest.raises(KeyError):
            getattr(tree, name)(node)
