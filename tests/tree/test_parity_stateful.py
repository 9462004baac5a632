"""Parity: a hypothesis state machine drives the Cython core and the pure-Python reference
with the same operations; every answer (or exception type), the sizes, both victim sets
and the whole tree must agree, and both trees must pass ``check_invariants()`` after every
step (marisa-trie / sortedcontainers style, with ``_reference`` as the oracle).

Bad calls are part of the run: the ``misuse`` rule draws one from ``MISUSES`` (lock and
transfer misuse, bad handles, out-of-range integers, wrong dtypes, shapes and lengths);
both trees must raise the exception type the table names, and any refused call made on
a tree in a known state must leave both trees exactly in that state.

Both trees log their changes (``track_changes``): after every step the two logs must be
equal, and replaying them into a :class:`~support.ChangeMirror` must give the tree's
nodes and tiers exactly; one rule runs an insert with the log off, which records nothing.

The matrix page size (1, 4, 16) x eviction policy x write policy is one TestCase class
per cell. Skipped, with the reason, when the core is not built or ``HIRADIX_PUREPYTHON``
is set. ``HIRADIX_PARITY_MAX_EXAMPLES`` scales the run (default: fits CI's budget).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.tree._results import LockError
from hiradix.tree.policy import WRITE_POLICIES, policy_names
from tests.support import (
    CORE_BUILT,
    CORE_IMPORT_ERROR,
    CORE_SKIP_REASON,
    OPS,
    PUREPYTHON,
    Allocator,
    ChangeMirror,
    CoarseClock,
    all_nodes,
    call_both,
    make_pair,
    normalize,
    parity_available,
    roots_of,
    sizes,
    tree_snapshot,
)

pytestmark = pytest.mark.slow  # hypothesis state machines, compiled core against the twin

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


# Every method that takes a node handle first, with valid-looking other arguments: a bad
# handle is refused before anything else is looked at.
HANDLE_CALLS: dict[str, tuple[Any, ...]] = {
    "insert_host": ([], []),
    "inc_lock_ref": (),
    "dec_lock_ref": (),
    "inc_host_ref": (),
    "dec_host_ref": (),
    "demote": (),
    "drop": (),
    "begin_backup": ([],),
    "commit_backup": (),
    "evicted_host_indices": (),
    "begin_load_back": ([],),
    "finish_load_back": (),
    "plan_load_back": (),
    "cancel_load_back": (),
    "is_alive": (),
    "parent": (),
    "children": (),
    "num_children": (),
    "key_len": (),
    "key": (),
    "value": (),
    "host_value": (),
    "hash_value": (),
    "node_info": (),
    "is_root": (),
    "is_evicted": (),
    "is_backed_up": (),
    "io_status": (),
    "lock_ref": (),
    "host_ref_counter": (),
    "hit_count": (),
    "priority": (),
    "last_access_time": (),
    "creation_time": (),
}
ACCESSORS = [name for name, extra in HANDLE_CALLS.items() if not extra and name not in (
    "inc_lock_ref", "dec_lock_ref", "inc_host_ref", "dec_host_ref", "demote", "drop",
    "commit_backup", "finish_load_back", "plan_load_back", "cancel_load_back",
)]  # fmt: skip
NOT_INTEGERS = [1.5, np.float64(2.0), None, "1", b"1"]
NO_SUCH_NODE = [-1, -(2**63), 2**63, 2**64, 12345 << 32, (1 << 32) | 1]
BAD_COUNTS: list[tuple[Any, type[Exception]]] = [
    (1.5, TypeError), (np.float32(3), TypeError), (None, TypeError), ("4", TypeError),
    (2**63, OverflowError), (-(2**63) - 1, OverflowError), (2**80, OverflowError),
]  # fmt: skip
BAD_TOKENS: list[tuple[Any, type[Exception]]] = [
    ([1, 2**31], OverflowError),
    ([-(2**31) - 1], OverflowError),
    (np.array([2**63], dtype=np.uint64), OverflowError),
    (np.array([2**40], dtype=np.int64), OverflowError),
    ([2**70, 1], OverflowError),  # an object array of Python ints
    ([1.0, 2.0], TypeError),
    ([True, False], TypeError),
    (["a", "b"], TypeError),
    ([1, None], TypeError),
    ([[1, 2], [3, 4]], ValueError),
    (7, ValueError),
]


def _bad_values(n: int) -> list[tuple[Any, type[Exception]]]:
    """Device/host index arrays that are wrong for a key of ``n`` tokens (``n >= 1``)."""
    return [
        (np.full(n, 2**63, dtype=np.uint64), OverflowError),
        ([2**70] * n, OverflowError),
        (np.zeros(n, dtype=np.float64), TypeError),
        (np.zeros((n, 1), dtype=np.int64), ValueError),
        (np.arange(n + 1), ValueError),
    ]


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
        self.core.track_changes = self.ref.track_changes = True
        self.dev = Allocator(0)
        self.host = Allocator(1 << 30)  # apart from the device slots, inside int32 (the span buffers)
        self.forget()

    def state(self, tree: Any) -> Any:
        """Everything observable about one tree, normalized (what a refused call must not
        change)."""
        ns = sorted(self.used_ns)  # tree_snapshot normalizes what it returns already
        return normalize(sizes(tree)), tree_snapshot(tree, ns), normalize(tree.debug_counters())

    def forget(self) -> None:
        """Drop what the machine remembers about the trees (after a reset)."""
        self.handles: list[int] = [self.ref.root]  # recently returned node handles
        self.mounts: list[int] = [self.ref.root]  # last_host_node of recent matches
        self.locks: list[int] = []
        self.host_refs: list[int] = []
        self.to_backup: deque[int] = deque()  # reported backup_nodes, parents first
        self.pending: deque[int] = deque()  # begun backups, in begin order
        self.loading: list[int] = []
        self.plans: list[int] = []  # nodes holding a load-back plan
        self.to_demote: list[int] = []
        self.used_ns: set[str] = set()
        self.known: Any = None  # the trees' state after the last step, while unchanged
        self.mirror = ChangeMirror(self.ref)  # what the change logs say the tree is

    # -- helpers
    def both(self, name: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """Call ``name`` on both trees (same answer or same exception type). A refused
        call on trees in a known state must leave both in that state."""
        OPS["parity (hypothesis)"] += 1
        ok, res = call_both(self.core, self.ref, name, *args, **kwargs)
        if ok:
            self.known = None
        elif self.known is not None:
            self.core.check_invariants()
            self.ref.check_invariants()
            for impl, tree in (("core", self.core), ("reference", self.ref)):
                if self.state(tree) != self.known:
                    raise AssertionError(
                        f"the refused {name}{args!r}{kwargs!r} ({res!r}) changed the {impl} tree\n"
                        f" now: {self.state(tree)!r}\n was: {self.known!r}"
                    )
        return ok, res

    def refused(self, expected: type[Exception], name: str, *args: Any, **kwargs: Any) -> None:
        """``name`` must be refused by both trees with exactly ``expected``."""
        ok, exc = self.both(name, *args, **kwargs)
        assert not ok, f"{name}{args!r}{kwargs!r} was accepted"
        assert type(exc) is expected, f"{name}{args!r}{kwargs!r} raised {exc!r}, expected {expected.__name__}"
        if expected is LockError:  # the message names the operation and the node
            assert name in str(exc) and f"node {int(args[0])}" in str(exc), str(exc)

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
        for name in ACCESSORS:
            self.both(name, h)

    # -- misuse: every call here must be refused, with the type MISUSES names
    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(sorted(MISUSES)), label="misuse")
        call = MISUSES[kind](self, data)
        if call is None:  # nothing in the tree to misuse this way right now
            return
        expected, name, args, kwargs = call
        self.refused(expected, name, *args, **kwargs)

    # -- writes
    @rule(
        data=st.data(),
        ns=namespaces,
        priority=priorities,
        chunked=st.sampled_from([False, False, False, True]),
        hold=st.booleans(),
    )
    def insert(self, data: st.DataObject, ns: str | None, priority: int, chunked: bool, hold: bool) -> None:
        key = data.draw(keys(self.page_size), label="key")
        ok, res = self.both("insert", key, self.dev(len(key)), ns, priority=priority, chunked=chunked, hold=hold)
        self.use_ns(ns)
        if ok:
            self.remember(res.last_node)
            if hold and res.backup_nodes:  # the insert locked the deepest of them: released by dec_lock_refs
                self.locks.append(res.backup_nodes[-1])
            if data.draw(st.booleans(), label="back up now?"):
                for h in res.backup_nodes:  # parents first, as a scheduler would
                    if not self.begin_backup(h):
                        break
            else:
                self.to_backup.extend(res.backup_nodes)

    @rule(data=st.data(), ns=namespaces)
    def insert_untracked(self, data: st.DataObject, ns: str | None) -> None:
        """With the log off nothing is recorded (records not yet taken are dropped);
        back on, the mirror starts again from the tree."""
        key = data.draw(keys(self.page_size), label="key")
        self.core.track_changes = self.ref.track_changes = False
        self.both("insert", key, self.dev(len(key)), ns)
        self.use_ns(ns)
        for tree in (self.core, self.ref):
            assert not tree.track_changes and tree.take_changes().shape == (0, 4)
            tree.track_changes = True
        self.mirror = ChangeMirror(self.ref, sorted(self.used_ns))

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
    def dec_lock_refs(self, data: st.DataObject) -> None:
        """A batch of releases; now and then with one more handle, which is refused (a
        LockError, nothing released) unless it holds a lock of its own to spare."""
        batch = self.locks[: data.draw(st.integers(0, len(self.locks)))]
        extra = bool(self.handles) and data.draw(st.booleans())
        if extra:
            batch = [*batch, self.draw_handle(data)]
        ok, _ = self.both("dec_lock_refs", batch)
        assert ok or extra, "held locks could not be released"
        if ok:
            for h in batch:
                if h in self.locks:
                    self.locks.remove(h)

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

    @rule(data=st.data(), raw=st.booleans())
    def begin_a_batch_of_backups(self, data: st.DataObject, raw: bool) -> None:
        """A scheduler step's write-throughs: ``backup_order`` of a mix of reported, live
        and stale handles (repeats included), then ``begin_backups`` of its answer, which
        skips nodes whose parent is not backed up or being written. With ``raw``, the
        drawn list goes to ``begin_backups`` as it is, to compare the refusals (a node
        named twice, one not on the device, ...), which must start nothing."""
        pool = list(self.to_backup) + self.live() + self.handles
        drawn = data.draw(st.lists(st.sampled_from(pool), max_size=6), label="nodes")
        ok, order = self.both("backup_order", drawn)
        assert ok, "backup_order refused a list of handles"
        nodes, sizes = (drawn, [self.key_len(h) for h in drawn]) if raw else order
        ok, res = self.both("begin_backups", nodes, self.host(sum(sizes)))
        if ok:
            _, started = res
            self.pending.extend(h for h, go in zip(nodes, started, strict=True) if go)

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

    @precondition(lambda self: self.pending)
    @rule(ok=oks, k=st.integers(1, 4))
    def commit_a_batch_of_backups(self, ok: bool, k: int) -> None:
        """A step's acknowledged batch: ``commit_backups`` of the oldest ``k`` in flight,
        in the order they were begun (parents first), each result compared."""
        batch = [self.pending.popleft() for _ in range(min(k, len(self.pending)))]
        done, _ = self.both("commit_backups", batch, ok)
        assert done, "commit_backups of backups in flight was refused"

    # -- load back
    @rule(data=st.data(), ns=namespaces)
    def demote_a_backed_up_insert(self, data: st.DataObject, ns: str | None) -> None:
        """Insert, back up what the insert reports and evict it all: an evicted chain to
        load back (random steps alone rarely make one)."""
        key = data.draw(keys(self.page_size), label="key")
        ok, res = self.both("insert", key, self.dev(len(key)), ns)
        self.use_ns(ns)
        if not ok:
            return
        self.remember(res.last_node)
        for h in res.backup_nodes:
            if not self.begin_backup(h):
                break
            self.pending.pop()
            self.both("commit_backup", h, True)
        self.both("evict", self.ref.evictable_size())
        if data.draw(st.booleans(), label="plan its load-back?"):
            self.plan(res.last_node, 0, None)

    @rule(data=st.data())
    def begin_load_back(self, data: st.DataObject) -> None:
        h = self.draw_valid(data, lambda t, h: t.value(h) is None)
        ok, hosts = self.both("evicted_host_indices", h)
        if not ok:
            hosts = []
        ok, _ = self.both("begin_load_back", h, self.dev(len(hosts)))
        if ok:
            self.loading.append(h)
            if h in self.plans:  # its plan ended: the plan's lock is the copy's
                self.plans.remove(h)

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def finish_load_back(self, data: st.DataObject) -> None:
        h = self.loading.pop(data.draw(st.integers(0, len(self.loading) - 1)))
        ok, _ = self.both("finish_load_back", h)
        assert ok, "finish_load_back of a load in flight was refused"

    @rule(
        data=st.data(),
        lo=st.sampled_from([0, 0, 1, 2, 5]),
        hi=st.sampled_from([None, None, None, -1, 0, 1, 3, 6]),
    )
    def plan_load_back(self, data: st.DataObject, lo: int, hi: int | None) -> None:
        """A scheduler's load-back decision, ``lo``/``hi`` pages for the threshold and the
        quota: the same plan from both, held (its lock) only if it names host slots."""
        h = self.draw_valid(data, lambda t, h: t.value(h) is None)
        self.plan(h, lo * self.page_size, None if hi is None else hi * self.page_size)

    def plan(self, h: int, lo: int, hi: int | None) -> None:
        ok, plan = self.both("plan_load_back", h, lo, hi)
        if ok and len(plan.host_indices):
            self.plans.append(h)

    @precondition(lambda self: self.plans)
    @rule(data=st.data(), go=st.booleans())
    def end_a_plan(self, data: st.DataObject, go: bool) -> None:
        """Device slots found (``begin_load_back``, whose lock the plan's becomes) or not
        (``cancel_load_back``). A begin is refused, the plan kept, where the chain left
        the host meanwhile (an insert refilled it, or a load below took it)."""
        h = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        if go:
            ok, hosts = self.both("evicted_host_indices", h)
            assert ok, "a node holding a plan is alive"
            ok, _ = self.both("begin_load_back", h, self.dev(len(hosts)))
            if ok:
                self.loading.append(h)
                return
        ok, _ = self.both("cancel_load_back", h)
        assert ok, "cancel_load_back of a held plan was refused"

    @precondition(lambda self: self.pending or self.loading or self.plans)
    @rule(data=st.data())
    def split_a_node_in_flight(self, data: st.DataObject) -> None:
        """Match into the middle of a node whose copy is in flight (or is planned): the
        prefix split off joins the transfer, which only the original handle may finish."""
        h = data.draw(st.sampled_from(list(self.pending) + self.loading + self.plans), label="node")
        n = self.key_len(h)
        if not self.ref.is_alive(h) or n < 2 * self.page_size:
            return
        path = [h]
        while not self.ref.is_root(path[-1]):
            path.append(self.ref.parent(path[-1]))
        ns = [k for k in sorted(self.used_ns) if self.ref.namespace_root(k) == path[-1]]
        prefix = [t for node in reversed(path[1:-1]) for t in self.ref.key(node).tolist()]
        cut = data.draw(st.integers(1, n // self.page_size - 1), label="pages") * self.page_size
        self.both("match_prefix", prefix + self.ref.key(h)[:cut].tolist(), ns[0] if ns else None)

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
        # sizes, victim sets, the whole tree and the node counters
        self.known = self.state(self.ref)
        core_state = self.state(self.core)
        if core_state != self.known:
            raise AssertionError(f"parity: tree state differs\n core: {core_state!r}\n  ref: {self.known!r}")
        # the change logs: equal, and complete (the mirror they build is the tree)
        changes = self.ref.take_changes()
        core_changes = self.core.take_changes()
        assert np.array_equal(core_changes, changes), f"change logs differ\n core: {core_changes}\n  ref: {changes}"
        self.mirror.apply(changes)
        self.mirror.check(self.ref, sorted(self.used_ns))


# ----------------------------------------------------------------------------- misuses
Call = tuple[type[Exception], str, tuple[Any, ...], dict[str, Any]]


def _nodes_where(m: ParityMachine, pred: Callable[[dict[str, Any]], bool]) -> list[int]:
    return [h for h in all_nodes(m.ref, sorted(m.used_ns)) if pred(m.ref.node_info(h))]


def _pick(m: ParityMachine, data: st.DataObject, pred: Callable[[dict[str, Any]], bool]) -> int | None:
    nodes = _nodes_where(m, pred)
    return data.draw(st.sampled_from(nodes), label="node") if nodes else None


def _lock_misuse(op: str, pred: Callable[[dict[str, Any]], bool], *extra: Any) -> Any:
    def make(m: ParityMachine, data: st.DataObject) -> Call | None:
        # Mostly a node split off one whose copy is in flight, when there is one: the
        # rarest way to get a transfer's ownership wrong.
        split_off = _nodes_where(m, lambda i: pred(i) and i["io_status"] != "idle" and not i["io_owner"])
        if split_off and data.draw(st.booleans(), label="split-off part?"):
            h: int | None = data.draw(st.sampled_from(split_off), label="node")
        else:
            h = _pick(m, data, pred)
        return None if h is None else (LockError, op, (h, *extra), {})

    return make


def _bad_handle(m: ParityMachine, data: st.DataObject) -> Call:
    """A non-integer handle (TypeError, never truncated) or an integer that names no live
    node: unknown, negative, beyond int64, freed (KeyError; ``is_alive`` answers False)."""
    if data.draw(st.booleans(), label="not an integer?"):
        name = data.draw(st.sampled_from(sorted(HANDLE_CALLS)), label="method")
        return TypeError, name, (data.draw(st.sampled_from(NOT_INTEGERS)), *HANDLE_CALLS[name]), {}
    name = data.draw(st.sampled_from(sorted(set(HANDLE_CALLS) - {"is_alive"})), label="method")
    # (1 << 32) | 1 names a live node once slot 1 has been reused: keep only dead ones
    dead = [h for h in NO_SUCH_NODE + m.handles if not m.ref.is_alive(h)]
    handle = data.draw(st.sampled_from(dead), label="handle")
    return KeyError, name, (handle, *HANDLE_CALLS[name]), {}


def _bad_count(m: ParityMachine, data: st.DataObject) -> Call:
    value, error = data.draw(st.sampled_from(BAD_COUNTS), label="count")
    name = data.draw(st.sampled_from(["evict", "evict_host", "plan_load_back"]), label="method")
    if name == "plan_load_back":  # min_tokens (None is a valid max_tokens), of a live node
        return error, name, (data.draw(st.sampled_from(m.live()), label="node"), value), {}
    return error, name, (value,), {}


def _bad_priority(m: ParityMachine, data: st.DataObject) -> Call:
    value, error = data.draw(st.sampled_from(BAD_COUNTS), label="priority")
    key = data.draw(keys(m.page_size), label="key")
    return error, "insert", (key, m.dev(len(key))), {"priority": value}


def _bad_tokens(m: ParityMachine, data: st.DataObject) -> Call:
    tokens, error = data.draw(st.sampled_from(BAD_TOKENS), label="tokens")
    name = data.draw(st.sampled_from(["insert", "match_prefix", "insert_host"]), label="method")
    n = int(np.size(tokens))
    if name == "insert":
        return error, name, (tokens, np.arange(n)), {}
    if name == "insert_host":
        return error, name, (m.ref.root, tokens, np.arange(n)), {}
    return error, name, (tokens,), {}


def _bad_indices(m: ParityMachine, data: st.DataObject) -> Call | None:
    name = data.draw(st.sampled_from(["insert", "insert_host", "begin_backup", "begin_load_back"]), label="method")
    if name in ("insert", "insert_host"):
        key = data.draw(keys(m.page_size).filter(bool), label="key")
        value, error = data.draw(st.sampled_from(_bad_values(len(key))), label="indices")
        return error, name, ((key, value) if name == "insert" else (m.ref.root, key, value)), {}
    if name == "begin_backup":
        h = _pick(m, data, lambda i: not i["evicted"] and not i["backuped"] and i["io_status"] == "idle")
        n = m.ref.key_len(h) if h is not None else 0
    else:
        h = _pick(m, data, lambda i: i["evicted"])
        n = len(m.ref.evicted_host_indices(h)) if h is not None else 0
    if h is None:
        return None
    # Indices are checked before the node's state: a wrong length is a ValueError whether
    # or not the parent is backed up.
    value, error = data.draw(st.sampled_from(_bad_values(n)), label="indices")
    return error, name, (h, value), {}


def _bad_extra_key(m: ParityMachine, data: st.DataObject) -> Call:
    extra = data.draw(st.sampled_from([5, b"ns", 1.5, ("a",)]), label="extra_key")
    name = data.draw(st.sampled_from(["insert", "match_prefix", "namespace_root"]), label="method")
    if name == "insert":
        return TypeError, name, ([1] * m.page_size, [0] * m.page_size, extra), {}
    if name == "match_prefix":
        return TypeError, name, ([1] * m.page_size, extra), {}
    return TypeError, name, (extra,), {}


def _wrong_state(m: ParityMachine, data: st.DataObject) -> Call | None:
    """Operations on a node in a state where they mean nothing: ValueError."""
    name = data.draw(st.sampled_from(["demote", "drop", "begin_backup", "begin_load_back", "insert_host"]))
    if name == "demote":  # evicted, or not backed up
        h = _pick(m, data, lambda i: i["evicted"] or not i["backuped"])
        return None if h is None else (ValueError, name, (h,), {})
    if name == "drop":  # evicted or backed up
        h = _pick(m, data, lambda i: i["evicted"] or i["backuped"])
        return None if h is None else (ValueError, name, (h,), {})
    if name == "begin_backup":  # evicted or committed already
        h = _pick(m, data, lambda i: i["evicted"] or (i["backuped"] and i["io_status"] != "writing"))
        return None if h is None else (ValueError, name, (h, np.arange(m.ref.key_len(h))), {})
    if name == "begin_load_back":  # on the device (the root included)
        h = _pick(m, data, lambda i: not i["evicted"])
        return ValueError, name, (m.ref.root if h is None else h, []), {}
    h = _pick(m, data, lambda i: not i["backuped"])  # insert_host below a node not backed up
    return None if h is None else (ValueError, name, (h, [1] * m.page_size, [0] * m.page_size), {})


MISUSES: dict[str, Callable[[ParityMachine, st.DataObject], Call | None]] = {
    # lock and transfer protocol: LockError
    "dec_lock_ref without a lock of its own": _lock_misuse("dec_lock_ref", lambda i: i["own_lock_ref"] == 0),
    "dec_host_ref at zero": _lock_misuse("dec_host_ref", lambda i: i["host_ref_counter"] == 0),
    "commit_backup not in flight (twice, never, split-off part)": _lock_misuse(
        "commit_backup", lambda i: i["io_status"] != "writing" or not i["io_owner"]
    ),
    "finish_load_back not in flight (twice, never, split-off part)": _lock_misuse(
        "finish_load_back", lambda i: i["io_status"] != "loading" or not i["io_owner"]
    ),
    "plan_load_back of a node holding a plan": _lock_misuse("plan_load_back", lambda i: i["load_back_planned"]),
    "cancel_load_back without a plan": _lock_misuse("cancel_load_back", lambda i: not i["load_back_planned"]),
    "begin_backup while in flight": _lock_misuse("begin_backup", lambda i: i["io_status"] == "writing", []),
    "demote a locked node": _lock_misuse(
        "demote", lambda i: i["lock_ref"] > 0 and not i["evicted"] and i["backuped"] and i["num_children"] == 0
    ),
    "drop a locked node": _lock_misuse(
        "drop", lambda i: i["lock_ref"] > 0 and not i["evicted"] and not i["backuped"] and i["num_children"] == 0
    ),
    # bad arguments
    "bad handle": _bad_handle,
    "bad count": _bad_count,
    "bad priority": _bad_priority,
    "bad tokens": _bad_tokens,
    "bad indices": _bad_indices,
    "bad extra_key": _bad_extra_key,
    "node in the wrong state": _wrong_state,
}


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
        pytest.skip("hiradix.tree._core is not built (pip install -e . compiles it)")
    assert CORE_IMPORT_ERROR is None, f"hiradix.tree._core is built but does not import: {CORE_IMPORT_ERROR!r}"
