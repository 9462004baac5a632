"""Helpers shared by the test modules: which tree implementations exist, parity
comparison of results and whole trees, teardown checks, index allocators, and the
operation counter that the stress and property tests report at the end of a session.

Kept out of ``conftest.py`` so that test modules import it by name: ``from tests.support
import ...``. ``tests/`` and each folder below it are packages, so pytest (its default
``prepend`` import mode) puts the repository's root on ``sys.path``, where ``tests`` and
``hiradix`` both import from; processes the tests spawn inherit that ``sys.path``, and
Python subprocesses get it as ``PYTHONPATH`` from :func:`subprocess_env`.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hiradix.tree._reference as reference
from hiradix.tree import _results

#: The repository's root: ``tests/support/`` is two folders below it.
REPO = Path(__file__).resolve().parents[2]
#: The import-only ``torchvision`` stub SGLang's imports need with the CPU torch (conftest.py).
STUBS = REPO / "tests" / "stubs"


def subprocess_env(*first: Path, env: dict[str, str] | None = None, repo: bool = True) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``PYTHONPATH`` set for a Python
    subprocess that runs the repository's code: ``first`` (folders of its own, such as the
    real-server tests' stubs), then the repository's root (``hiradix``, ``tests.support``;
    left out with ``repo=False``, for a server that must import the installed hiradix)
    and ``tests/stubs``, then the ``PYTHONPATH`` it had."""
    out = dict(os.environ if env is None else env)
    parts = [*map(str, first), str(REPO) if repo else "", str(STUBS), out.get("PYTHONPATH", "")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return out


# ----------------------------------------------------------------------- implementations
PUREPYTHON = os.environ.get("HIRADIX_PUREPYTHON", "") not in ("", "0")
# Harness self-test: with the core missing, pair the reference with a second reference
# tree so that the parity machinery itself can be exercised. Never set in CI.
PARITY_SELFTEST = os.environ.get("HIRADIX_PARITY_SELFTEST", "") not in ("", "0")

try:
    core: Any = importlib.import_module("hiradix.tree._core")
    CORE_IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # not built (yet): the reference alone is tested
    core = None
    CORE_IMPORT_ERROR = exc

_PKG = Path(reference.__file__).resolve().parent
CORE_BUILT = any(_PKG.glob("_core*.so")) or any(_PKG.glob("_core*.pyd"))
CORE_ENABLED = core is not None and not PUREPYTHON

if PUREPYTHON:
    CORE_SKIP_REASON: str | None = "HIRADIX_PUREPYTHON is set: the compiled core is disabled"
elif core is None:
    CORE_SKIP_REASON = f"hiradix.tree._core is not importable ({CORE_IMPORT_ERROR}); run `pip install -e .`"
else:
    CORE_SKIP_REASON = None

IMPLEMENTATIONS: dict[str, Any] = {"reference": reference}
if CORE_ENABLED:
    IMPLEMENTATIONS["core"] = core


def require_core() -> Any:
    """The core module, or skip the calling test (fail if the core is built but broken)."""
    if CORE_ENABLED:
        return core
    if PARITY_SELFTEST and not PUREPYTHON:
        return reference
    if CORE_BUILT and not PUREPYTHON:
        pytest.fail(f"hiradix.tree._core is built but does not import: {CORE_IMPORT_ERROR!r}")
    pytest.skip(CORE_SKIP_REASON or "core unavailable")


def parity_available() -> bool:
    return CORE_ENABLED or (PARITY_SELFTEST and not PUREPYTHON)


def make_pair(**kwargs: Any) -> tuple[Any, Any]:
    """``(core_tree, reference_tree)`` built with the same arguments, for parity tests.

    A ``clock`` argument must be a zero-argument *factory* of clocks here (each tree needs
    its own, called the same number of times), passed as ``clock_factory``.
    """
    core_mod = require_core()
    factory = kwargs.pop("clock_factory", None)
    kw_core = dict(kwargs, clock=factory()) if factory else kwargs
    kw_ref = dict(kwargs, clock=factory()) if factory else kwargs
    return core_mod.HiRadixTree(**kw_core), reference.HiRadixTree(**kw_ref)


# ----------------------------------------------------------------------- clocks
class CoarseClock:
    """A clock with many ties: ``calls // 3``. Ties make the uid tie-break matter.

    Not a fake to drive (that is :class:`hiradix.transport.fake.FakeClock`, the one the
    tests inject): this one moves by itself as the tree reads it, the same way in the
    core and the reference, so that a parity run meets equal access times."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls // 3)


# ----------------------------------------------------------------------- raw sockets
#: What a socket call raises once the other end has hung up: a reset (it closed with our
#: bytes unread), a broken pipe (we wrote after its reset) or "not connected" (the reset
#: already tore our end down, e.g. before ``shutdown``).
HUNG_UP = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN})


def _rank_entry(target: Callable[..., None], *args: Any) -> None:
    """A :func:`run_ranks` process: ``target(*args)``, then out at once, its exit code
    saying whether it returned. By then the rank has written its result and destroyed its
    process groups, but interpreter finalization can still abort in gloo's C++ teardown
    (a group object that a cache still refers to dies with a worker thread joinable:
    "terminate called without an active exception", SIGABRT; seen once in a 2-rank run
    whose work had all succeeded, pytorch/pytorch#179291 describes the mechanism)."""
    import traceback

    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    target: Callable[..., None], world: int, out_dir: Path, config: dict[str, Any], timeout_s: float
) -> list[dict[str, Any]]:
    """Run ``target(rank, world, rendezvous, out_dir, config)`` in ``world`` spawned
    processes and return what each wrote to ``out_dir/rank{r}.json``. ``rendezvous`` is
    the process group's ``init_method``: a file in ``out_dir``, not a TCP port (a port
    found free beforehand can be taken by another process before rank 0 binds it, which
    failed a CI run with two suites at once). A rank still running after ``timeout_s``
    (the run takes seconds: it hung in a collective) is killed and fails the test, as does
    a nonzero exit."""
    import json
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    rendezvous = f"file://{out_dir / 'rendezvous'}"
    procs = [
        ctx.Process(target=_rank_entry, args=(target, r, world, rendezvous, str(out_dir), config), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {timeout_s} s: a collective hung"
    assert [p.exitcode for p in procs] == [0] * world, f"exit codes {[p.exitcode for p in procs]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def sglang_pp_tag_rank(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    """A :func:`run_ranks` target for hiradix.sglang's pipeline hand-down, on any SGLang. Two
    pipeline stages: stage 0 first sends an untagged message of its own (as the
    scheduler's stage-to-stage sends are), then agrees ``[5, 7]``; stage 1 agrees, then
    receives the untagged message. Each receive must get its own message."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hiradix.sglang.distributed import SGLangAgreement

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    agreement = SGLangAgreement(pp_group=dist.group.WORLD, pp_rank=rank, pp_size=world)
    if rank == 0:
        # isend: gloo's send completes only once a receive of its tag is posted, and
        # stage 1 receives the hand-down first
        own = dist.isend(torch.tensor([99, 99], dtype=torch.int64), dst=1)
        agreed = agreement._reduce_min([5, 7])
        other = [99, 99]
        own.wait()
        for work in agreement._sends:  # the hand-down is reaped at the next call; there is none
            work.wait()
    else:
        agreed = agreement._reduce_min([0, 0])
        t = torch.zeros(2, dtype=torch.int64)
        dist.recv(t, src=0)
        other = [int(v) for v in t.tolist()]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"agreed": agreed, "other": other}))
    dist.destroy_process_group()


class HostAllocFaults:
    """Rank-local host-allocation faults for the multi-rank tests: ``host.alloc_array`` (a
    host pool's, which every host allocation goes through) is wrapped to return ``None``,
    as a full pool does, with probability ``rate``
    per call, drawn from a generator seeded with ``seed``; :attr:`failures` counts them.
    The ranks' trees may stay identical only through the agreement."""

    def __init__(self, host: Any, seed: int, rate: float = 0.2) -> None:
        self.failures = 0
        rng = np.random.default_rng(seed)
        real_alloc = host.alloc_array

        def faulty_alloc(n: int) -> Any:
            if rng.random() < rate:
                self.failures += 1
                return None
            return real_alloc(n)

        host.alloc_array = faulty_alloc


def send_then_drain(sock: socket.socket, data: bytes, *, half_close: bool = True) -> bytes:
    """Send ``data`` (then ``SHUT_WR`` when ``half_close``) and read until the other end
    hangs up; return every byte that arrived.

    A server that refuses or drops a connection may hang up at any moment: before our
    ``sendall``, between it and ``shutdown``, or while we read. Each of those steps then
    fails with one of :data:`HUNG_UP`, which ends that step and not the test: the bytes
    that arrived before the hang-up are still read (the kernel keeps them across a reset)
    and returned for the caller to check. Any other error, a timeout included, is raised.
    """
    try:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
    except OSError as e:
        if e.errno not in HUNG_UP:
            raise
    got = bytearray()
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except OSError as e:
        if e.errno not in HUNG_UP:
            raise
    return bytes(got)


# ----------------------------------------------------------------------- normalization
RESULT_FIELDS: dict[str, tuple[str, ...]] = {
    cls.__name__: tuple(f.name for f in dataclasses.fields(cls))
    for cls in (
        _results.MatchResult,
        _results.InsertResult,
        _results.InsertHostResult,
        _results.EvictResult,
        _results.EvictHostResult,
        _results.LoadBackPlan,
    )
}


def normalize(x: Any) -> Any:
    """A plain, comparable form of a tree's answer (results attribute by attribute)."""
    name = type(x).__name__
    if name in RESULT_FIELDS:
        return (name, {f: normalize(getattr(x, f)) for f in RESULT_FIELDS[name]})
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.tolist())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [normalize(v) for v in x])
    if isinstance(x, dict):
        return {k: normalize(v) for k, v in x.items()}
    # Tagged so that 1 vs 1.0 vs True count as different answers.
    if isinstance(x, (bool, np.bool_)):
        return ("bool", bool(x))
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return ("float", float(x))
    return x


def assert_same(core_value: Any, ref_value: Any, what: str) -> None:
    a, b = normalize(core_value), normalize(ref_value)
    if a != b:
        raise AssertionError(f"parity: {what} differs\n core: {a!r}\n  ref: {b!r}")


def result_fields(result: Any) -> dict[str, Any]:
    """Attributes of a result record as plain values (works for both implementations)."""
    return normalize(result)[1]


# ----------------------------------------------------------------------- tree walks
def roots_of(tree: Any, extra_keys: Any = ()) -> list[int]:
    """Handles of the default root and of the (already used) namespace roots."""
    return [tree.root] + [tree.namespace_root(k) for k in extra_keys if k is not None]


def all_nodes(tree: Any, extra_keys: Any = ()) -> list[int]:
    """Every non-root handle reachable from the given roots, parents first."""
    out: list[int] = []
    stack = list(reversed(roots_of(tree, extra_keys)))
    while stack:
        h = stack.pop()
        kids = tree.children(h)
        out.extend(kids)
        stack.extend(reversed(kids))
    return out


def tree_snapshot(tree: Any, extra_keys: Any = ()) -> list[Any]:
    """Full structural dump: every node's fields, key and the three tiers' state."""
    snap = []
    for root in roots_of(tree, extra_keys):
        stack = [root]
        while stack:
            h = stack.pop()
            kids = tree.children(h)
            snap.append(
                (
                    normalize(tree.node_info(h)),
                    normalize(tree.key(h)),
                    normalize(tree.value(h)),
                    normalize(tree.host_value(h)),
                    normalize(tree.hash_value(h)),
                    kids,
                )
            )
            stack.extend(reversed(kids))
    return snap


def sizes(tree: Any) -> dict[str, Any]:
    return {
        "evictable_size": tree.evictable_size(),
        "protected_size": tree.protected_size(),
        "device_size": tree.device_size(),
        "host_size": tree.host_size(),
        "num_nodes": tree.num_nodes(),
        "evictable_leaves": list(tree.evictable_leaves()),
        "evictable_host_leaves": list(tree.evictable_host_leaves()),
    }


def assert_trees_equal(core_tree: Any, ref_tree: Any, extra_keys: Any = ()) -> None:
    assert_same(sizes(core_tree), sizes(ref_tree), "sizes and victim sets")
    assert_same(tree_snapshot(core_tree, extra_keys), tree_snapshot(ref_tree, extra_keys), "tree structure")


# ----------------------------------------------------------------------- teardown
def assert_counters_consistent(tree: Any) -> None:
    c = tree.debug_counters()
    assert c["nodes_live"] == c["nodes_allocated"] - c["nodes_freed"], f"node counters leak: {c}"


def assert_clean_teardown(tree: Any) -> None:
    """End-of-test check: invariants and node counters hold, and after ``reset()`` the tree
    is empty and holds no locks."""
    tree.check_invariants()
    assert_counters_consistent(tree)
    tree.reset()
    tree.check_invariants()
    assert_counters_consistent(tree)
    assert tree.protected_size() == 0, "locks are still held after reset()"
    assert (tree.evictable_size(), tree.host_size(), tree.num_nodes()) == (0, 0, 0)
    assert list(tree.evictable_leaves()) == [] and list(tree.evictable_host_leaves()) == []


# ----------------------------------------------------------------------- change log
class ChangeMirror:
    """A tree's nodes as its change log tells them: ``{handle: [key_len, on_device,
    backed_up]}`` built from one snapshot and then only from ``take_changes`` records.

    :meth:`apply` checks each record against the mirrored state (a node is deleted only
    where it is, split only where it is long enough, ...) and :meth:`check` compares the
    mirror with the tree, so a change the tree makes and does not report, or reports
    wrongly, fails the test.
    """

    def __init__(self, tree: Any, extra_keys: Any = ()) -> None:
        self.nodes = self.snapshot(tree, extra_keys)

    @staticmethod
    def snapshot(tree: Any, extra_keys: Any = ()) -> dict[int, list[Any]]:
        return {h: [tree.key_len(h), not tree.is_evicted(h), tree.is_backed_up(h)] for h in all_nodes(tree, extra_keys)}

    def apply(self, records: np.ndarray) -> None:
        Change = _results.Change
        assert records.dtype == np.int64 and records.ndim == 2 and records.shape[1] == 4, records
        for kind, node, other, tokens in records.tolist():
            state = self.nodes.get(node)
            where = f"{Change(kind).name} of node {node}: mirrored {state}"
            if kind in (Change.INSERTED, Change.HOST_INSERTED):
                assert state is None and other == -1 and tokens > 0, where
                self.nodes[node] = [tokens, kind == Change.INSERTED, kind == Change.HOST_INSERTED]
                continue
            if kind == Change.SPLIT:
                old = self.nodes[other]
                assert state is None and 0 < tokens < old[0], f"{where}, split of {other} {old}"
                old[0] -= tokens
                self.nodes[node] = [tokens, old[1], old[2]]
                continue
            assert state is not None and other == -1 and tokens == state[0], f"{where}, {tokens} tokens"
            if kind in (Change.REFILLED, Change.LOADED):
                assert not state[1] and state[2], where
                state[1] = True
            elif kind == Change.BACKED_UP:
                assert state[1] and not state[2], where
                state[2] = True
            elif kind == Change.DEMOTED:
                assert state[1] and state[2], where
                state[1] = False
            elif kind == Change.DELETED:
                assert state[1] and not state[2], where
                del self.nodes[node]
            elif kind == Change.HOST_DELETED:
                assert not state[1] and state[2], where
                del self.nodes[node]
            else:
                raise AssertionError(f"unknown change kind {kind}")

    def check(self, tree: Any, extra_keys: Any = ()) -> None:
        actual = self.snapshot(tree, extra_keys)
        assert self.nodes == actual, f"change log mirror\n mirror: {self.nodes}\n   tree: {actual}"


# ----------------------------------------------------------------------- allocation
class Allocator:
    """Hands out unique, increasing KV indices (never reused): enough for parity runs."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def __call__(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


# ----------------------------------------------------------------------- lockstep proxy
def call_both(core_tree: Any, ref_tree: Any, name: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """Call ``name`` on both trees; the outcomes must agree (same result, or the same
    exception type). Returns ``(ok, result)``."""
    outcome = []
    for t in (core_tree, ref_tree):
        try:
            outcome.append((True, getattr(t, name)(*args, **kwargs)))
        except (KeyError, ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
            outcome.append((False, exc))
    (ok_c, res_c), (ok_r, res_r) = outcome
    call = f"{name}{args!r}{kwargs!r}"
    if ok_c != ok_r:
        raise AssertionError(f"parity: {call} raised in one implementation only\n core: {res_c!r}\n  ref: {res_r!r}")
    if not ok_c:
        if type(res_c) is not type(res_r):
            raise AssertionError(f"parity: {call} raised different exceptions\n core: {res_c!r}\n  ref: {res_r!r}")
        return False, res_r
    assert_same(res_c, res_r, call)
    return True, res_c


class LockstepTree:
    """Looks like one tree; every method call runs on the core and on the reference and
    their answers (or exception types) must agree. Exceptions are re-raised."""

    def __init__(self, core_tree: Any, ref_tree: Any) -> None:
        self.core = core_tree
        self.ref = ref_tree

    @property
    def root(self) -> int:
        assert_same(self.core.root, self.ref.root, "root")
        return self.ref.root

    def check_invariants(self) -> None:
        self.core.check_invariants()
        self.ref.check_invariants()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def both(*args: Any, **kwargs: Any) -> Any:
            ok, res = call_both(self.core, self.ref, name, *args, **kwargs)
            if not ok:
                raise res
            return res

        return both


# ----------------------------------------------------------------------- op counting
#: Random operations run by the stress and property tests, by suite; printed at the end.
OPS: Counter[str] = Counter()
