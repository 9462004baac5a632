"""Parity: a hypothesis state machine drives the Cython core and the pure-Python reference
with the same operations; every answer (or exception type), the sizes, both victim sets
and the whole tree must agree, and both trees must pass ``check_invariants()`` after every
step (marisa-trie / sortedcontainers style, with ``_reference`` as the oracle).

The matrix page size (1, 4, 16) x eviction policy x write policy is one TestCase class
per cell. Skipped, with the reason, when the core is not built or ``HIRADIX_PUREPYTHON``
is set. ``HIRADIX_PARITY_MAX_EXAMPLES`` scales the run (default: fits CI's budget).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import (
    CORE_BUILT,
    CORE_IMPORT_ERROR,
    CORE_SKIP_REASON,
    OPS,
    PUREPYTHON,
    Allocator,
    CoarseClock,
    all_nodes,
    assert_same,
    assert_trees_equal,
    call_both,
    make_pair,
    parity_available,
    roots_of,
)

from hiradix.policy import WRITE_POLICIES, policy_names

PAGE_SIZES = (1, 4, 16)
NAMESPACES = (None, "tenant-a", "tenant-b")
MAX_EXAMPLES = int(os.environ.get("HIRADIX_PARITY_MAX_EXAMPLES", "6"))
STEPS = int(os.environ.get("HIRADIX_PARITY_STEPS", "50"))


# ----------------------------------------------------------------------------- strategies
def page_pool(page_size: int) -> list[tuple[int, ...]]:
    """A few page contents over tokens 0..3, including two that differ only in their last
    token, so keys share prefixes and diverge inside pages."""
    if page_size == 1:
        return [(t,) for t in range(4)]
    return [(a,) * page_size for a in range(3)] + [(0,) * (page_size - 1) + (1,)]


def keys(page_size: int) -> st.SearchStrategy[list[int]]:
    """Up to 6 pages from the pool plus a partial page (dropped by the tree)."""
    pages = st.lists(st.sampled_from(page_pool(page_size)), max_size=6)
    tail = st.lists(st.integers(0, 3), max_size=page_size - 1)
    return st.builds(lambda ps, t: [tok for p in ps for tok in p] + t, pages, tail)


def can_back_up(tree: Any, h: int) -> bool:
    """``begin_backup`` would accept ``h``: on the device, idle, not backed up, and its
    parent backed up or being written."""
    info = tree.node_info(h)
    parent = tree.node_info(tree.parent(h))
    return (
        not info["evicted"]
        and not info["backuped"]
        and info["io_status"] == "idle"
        and (parent["backuped"] or parent["io_status"] == "writing")
    )


def can_demote(tree: Any, h: int) -> bool:
    """``demote`` would accept ``h``: a backed-up, unlocked device leaf."""
    info = tree.node_info(h)
    return (
        not info["evicted"]
        and info["backuped"]
        and info["lock_ref"] == 0
        and all(tree.value(c) is None for c in tree.children(h))
    )


def can_drop(tree: Any, h: int) -> bool:
    """``drop`` would accept ``h``: an unlocked, idle, childless device node that is not
    backed up."""
    info = tree.node_info(h)
    return (
        not info["evicted"]
        and not info["backuped"]
        and info["lock_ref"] == 0
        and info["io_status"] == "idle"
        and info["num_children"] == 0
    )


namespaces = st.sampled_from(NAMESPACES)
priorities = st.sampled_from([0, 0, 1, 3, -2])
oks = st.sampled_from([True, True, True, False])


# ----------------------------------------------------------------------------- machine
class ParityMachine(RuleBasedStateMachine):
    """Core and reference side by side. Subclasses fix the configuration."""

    page_size = 1
    policy = "lru"
    write_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        kwargs: dict[str, Any] = dict(
            page_size=self.page_size,
            eviction_policy=self.policy,
            write_policy=self.write_policy,
            # Hashes in two of three write policies; ties in time on page size 4.
            enable_hash=self.write_policy != "write_through_selective",
        )
        if self.page_size == 4:
            kwargs["clock_factory"] = CoarseClock
        self.core, self.ref = make_pair(**kwargs)
        self.dev = Allocator(0)
        self.host = Allocator(1 << 40)
        self.forget()

    def forget(self) -> None:
        """Drop what the machine remembers about the trees (after a reset)."""
        self.handles: list[int] = [self.ref.root]  # recently returned node handles
        self.mounts: list[int] = [self.ref.root]  # last_host_node of recent matches
        self.locks: list[int] = []
        self.host_refs: list[int] = []
        self.to_backup: deque[int] = deque()  # reported backup_nodes, parents first
        self.pending: deque[int] = deque()  # begun backups, in begin order
        self.loading: list[int] = []
        self.to_demote: list[int] = []
        self.used_ns: set[str] = set()

    # -- helpers
    def both(self, name: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        OPS["parity (hypothesis)"] += 1
        return call_both(self.core, self.ref, name, *args, **kwargs)

    def remember(self, *handles: int) -> None:
        for h in handles:
            if h in self.handles:
                self.handles.remove(h)
            self.handles.append(h)
        del self.handles[:-40]

    def use_ns(self, ns: str | None) -> None:
        if ns is not None:
            self.used_ns.add(ns)

    def live(self) -> list[int]:
        """Every node of the reference tree now (roots included)."""
        return roots_of(self.ref, sorted(self.used_ns)) + all_nodes(self.ref, sorted(self.used_ns))

    def draw_handle(self, data: st.DataObject, pool: list[int] | None = None) -> int:
        """A handle from ``pool``, or else mostly a live node and sometimes a recently
        returned one (which may be stale by now)."""
        if pool is None:
            pool = self.live() if data.draw(st.integers(0, 3), label="live?") else self.handles
        return data.draw(st.sampled_from(pool), label="node")

    def draw_valid(self, data: st.DataObject, valid: Any) -> int:
        """Mostly a live node for which ``valid(reference_tree, handle)`` holds, so that the
        operation gets past its checks; sometimes any handle, to compare the refusals."""
        nodes = [h for h in all_nodes(self.ref, sorted(self.used_ns)) if valid(self.ref, h)]
        if nodes and data.draw(st.integers(0, 4), label="valid?"):
            return data.draw(st.sampled_from(nodes), label="node")
        return self.draw_handle(data)

    def key_len(self, h: int) -> int:
        return len(self.ref.key(h)) if self.ref.is_alive(h) else 1

    # -- reads
    @rule(data=st.data(), ns=namespaces)
    def match_prefix(self, data: st.DataObject, ns: str | None) -> None:
        key = data.draw(keys(self.page_size), label="key")
        ok, m = self.both("match_prefix", key, ns)
        self.use_ns(ns)
        if ok:
            self.remember(m.last_node, m.last_device_node, m.last_host_node)
            self.mounts = (self.mounts + [m.last_host_node])[-10:]

    @rule(data=st.data())
    def probe_a_handle(self, data: st.DataObject) -> None:
        h = self.draw_handle(data)
        self.both("is_alive", h)
        self.both("node_info", h)
        self.both("key_len", h)
        self.both("evicted_host_indices", h)

    # -- writes
    @rule(data=st.data(), ns=namespaces, priority=priorities, chunked=st.sampled_from([False, False, False, True]))
    def insert(self, data: st.DataObject, ns: str | None, priority: int, chunked: bool) -> None:
        key = data.draw(keys(self.page_size), label="key")
        ok, res = self.both("insert", key, self.dev(len(key)), ns, priority=priority, chunked=chunked)
        self.use_ns(ns)
        if ok:
            self.remember(res.last_node)
            if data.draw(st.booleans(), label="back up now?"):
                for h in res.backup_nodes:  # parents first, as a scheduler would
                    if not self.begin_backup(h):
                        break
            else:
                self.to_backup.extend(res.backup_nodes)

    @rule(data=st.data())
    def insert_host(self, data: st.DataObject) -> None:
        mount = self.draw_handle(data, self.mounts if data.draw(st.booleans()) else self.handles)
        key = data.draw(keys(self.page_size), label="key")
        ok, res = self.both("insert_host", mount, key, self.host(len(key)))
        if ok:
            self.remember(res.last_node)

    # -- locks
    @rule(data=st.data())
    def inc_lock_ref(self, data: st.DataObject) -> None:
        h = self.draw_handle(data)
        ok, _ = self.both("inc_lock_ref", h)
        if ok:
            self.locks.append(h)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def dec_lock_ref(self, data: st.DataObject) -> None:
        h = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        ok, _ = self.both("dec_lock_ref", h)
        assert ok, "a held lock could not be released"

    @rule(data=st.data())
    def inc_host_ref(self, data: st.DataObject) -> None:
        h = self.draw_handle(data)
        ok, _ = self.both("inc_host_ref", h)
        if ok:
            self.host_refs.append(h)

    @precondition(lambda self: self.host_refs)
    @rule(data=st.data())
    def dec_host_ref(self, data: st.DataObject) -> None:
        h = self.host_refs.pop(data.draw(st.integers(0, len(self.host_refs) - 1)))
        self.both("dec_host_ref", h)  # KeyError in both if the node was deleted meanwhile

    # -- eviction
    @rule(n=st.integers(0, 12), complete=st.booleans(), commit_ok=oks)
    def evict(self, n: int, complete: bool, commit_ok: bool) -> None:
        ok, res = self.both("evict", n * self.page_size)
        if not ok:
            return
        if complete and res.write_back_nodes:  # write-back: back up, commit, demote
            begun = []
            for h in res.backup_nodes:
                ok, _ = self.both("begin_backup", h, self.host(self.key_len(h)))
                if not ok:
                    break
                begun.append(h)
            for h in begun:
                self.both("commit_backup", h, commit_ok)
            for h in res.write_back_nodes:
                self.both("demote", h)
        else:
            self.to_demote.extend(res.write_back_nodes)
            self.to_backup.extend(res.backup_nodes)

    @rule(n=st.integers(0, 12))
    def evict_host(self, n: int) -> None:
        self.both("evict_host", n * self.page_size)

    @precondition(lambda self: self.to_demote)
    @rule()
    def demote_reported(self) -> None:
        self.both("demote", self.to_demote.pop(0))

    @rule(data=st.data())
    def demote_any(self, data: st.DataObject) -> None:
        self.both("demote", self.draw_valid(data, can_demote))

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.both("drop", self.draw_valid(data, can_drop))

    # -- backup
    @precondition(lambda self: self.to_backup)
    @rule()
    def begin_reported_backup(self) -> None:
        self.begin_backup(self.to_backup.popleft())

    @rule(data=st.data())
    def begin_any_backup(self, data: st.DataObject) -> None:
        self.begin_backup(self.draw_valid(data, can_back_up))

    def begin_backup(self, h: int) -> bool:
        ok, _ = self.both("begin_backup", h, self.host(self.key_len(h)))
        if ok:
            self.pending.append(h)
        return ok

    @precondition(lambda self: self.pending)
    @rule(ok=oks)
    def commit_backup(self, ok: bool) -> None:
        done, _ = self.both("commit_backup", self.pending.popleft(), ok)
        assert done, "commit_backup of a backup in flight was refused"

    # -- load back
    @rule(data=st.data())
    def begin_load_back(self, data: st.DataObject) -> None:
        h = self.draw_valid(data, lambda t, h: t.value(h) is None)
        ok, hosts = self.both("evicted_host_indices", h)
        if not ok:
            hosts = []
        ok, _ = self.both("begin_load_back", h, self.dev(len(hosts)))
        if ok:
            self.loading.append(h)

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def finish_load_back(self, data: st.DataObject) -> None:
        h = self.loading.pop(data.draw(st.integers(0, len(self.loading) - 1)))
        ok, _ = self.both("finish_load_back", h)
        assert ok, "finish_load_back of a load in flight was refused"

    # -- rarely
    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll == 0:
            self.both("reset")
            self.forget()

    # -- after every step
    @invariant()
    def trees_agree(self) -> None:
        self.core.check_invariants()
        self.ref.check_invariants()
        assert_same(self.core.debug_counters(), self.ref.debug_counters(), "debug_counters")
        assert_trees_equal(self.core, self.ref, sorted(self.used_ns))


# ----------------------------------------------------------------------------- the matrix
SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
_skip = pytest.mark.skipif(not parity_available(), reason=CORE_SKIP_REASON or "core unavailable")

for _ps in PAGE_SIZES:
    for _policy in policy_names():
        for _wp in WRITE_POLICIES:
            _name = f"p{_ps}_{_policy}_{_wp}"
            _machine = type(
                f"Parity_{_name}",
                (ParityMachine,),
                {"page_size": _ps, "policy": _policy, "write_policy": _wp},
            )
            _case = _machine.TestCase
            _case.settings = SETTINGS
            globals()[f"TestParity_{_name}"] = _skip(_case)
del _ps, _policy, _wp, _name, _machine, _case  # pytest would collect the last one twice


def test_a_built_core_imports():
    """A compiled extension that fails to import must not silently turn parity off."""
    if PUREPYTHON:
        pytest.skip("HIRADIX_PUREPYTHON is set: the compiled core is disabled")
    if not CORE_BUILT:
        pytest.skip("hiradix._core is not built (pip install -e . compiles it)")
    assert CORE_IMPORT_ERROR is None, f"hiradix._core is built but does not import: {CORE_IMPORT_ERROR!r}"
