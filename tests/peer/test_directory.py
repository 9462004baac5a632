"""Directory shard and client view: conditional ops, replica writes, read fallback, re-publish."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import msgpack
import numpy as np
import pytest

from hiradix.peer.directory import (
    MISS,
    NO_PRODUCER,
    ON_DISK,
    PACKED_ENTRY,
    RESIDENT,
    DirectoryShard,
    DirectoryView,
    DirEntry,
    pack_entries,
    republish_plan,
)
from hiradix.peer.ring import HashRing

KEYS = [f"{i:064x}" for i in range(300)]


def entry(gen: int = 1, node: str = "p", resident: bool = True) -> DirEntry:
    return DirEntry(node, 4096 * gen, 7, 100, gen, resident)


class Cluster:
    """Shards behind an in-process ``call`` that round-trips through msgpack and can fail."""

    def __init__(self, nodes: list[str]) -> None:
        self.shards = {n: DirectoryShard() for n in nodes}
        self.down: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def call(self, owner: str, method: str, args: list[Any]) -> Any:
        self.calls.append((owner, method))
        if owner in self.down:
            raise ConnectionError(f"{owner} is down")
        wire_args = msgpack.unpackb(msgpack.packb(args))
        return msgpack.unpackb(msgpack.packb(self.shards[owner].dispatch(method, wire_args)))


# ---------------------------------------------------------------------- shard
def test_shard_put_get_delete_conditional() -> None:
    s = DirectoryShard()
    assert s.put("k", entry(2))
    assert not s.put("k", entry(1))  # stale re-publish from the same node
    assert s.get("k") == entry(2)
    assert s.put("k", entry(1, node="q"))  # another producer: last writer wins
    assert not s.delete("k", node="p", generation=2)  # p's eviction of its old copy
    assert s.delete("k", node="q", generation=1)
    assert s.get("k") is None and len(s) == 0
    assert not s.delete("k")


def test_shard_resident_and_batch_ops() -> None:
    s = DirectoryShard()
    assert s.batch_put([(k, entry(1)) for k in KEYS[:10]]) == 10
    assert s.set_resident(KEYS[0], False, node="p", generation=1)
    assert s.get(KEYS[0]) == entry(1, resident=False)
    assert not s.set_resident(KEYS[0], True, node="p", generation=9)
    assert s.batch_set_resident([(KEYS[1], "p", 1, False), (KEYS[2], "x", None, False)]) == 1
    assert s.batch_get([KEYS[0], "nope"]) == [entry(1, resident=False), None]
    assert s.batch_delete([(k, "p", None) for k in KEYS[:5]]) == 5
    assert len(s) == 5
    s.put("q", entry(1, node="q"))
    assert s.drop_node("p") == 5 and set(s.snapshot()) == {"q"}


def test_shard_dispatch_errors_are_clear() -> None:
    s = DirectoryShard()
    with pytest.raises(ValueError, match="unknown directory method"):
        s.dispatch("dir_nuke", [])
    assert s.dispatch("dir_put", [["k", [1, 2]]]) == 0 and "k" not in s  # refused for its key
    with pytest.raises(ValueError, match="malformed"):
        s.dispatch("dir_put", [[3, entry().to_wire()]])  # not a str key: the batch is malformed
    with pytest.raises(ValueError, match="malformed"):
        s.dispatch("dir_get", [3])
    with pytest.raises(ValueError, match="malformed"):
        DirEntry.from_wire(["n", -1, 0, 0, 0, True, 0])
    with pytest.raises(ValueError, match="malformed"):
        DirEntry.from_wire(["n", 1, 0, 0, 0, True, -1])
    with pytest.raises(ValueError, match="malformed"):
        DirEntry.from_wire(["n", 1, 0, 0, 0, True])  # no incarnation


# One wire field too wide for its PACKED_ENTRY column (or negative), by position in to_wire().
OVERSIZED = [(1, 1 << 64), (2, 1 << 32), (3, 1 << 64), (4, 1 << 64), (6, 1 << 64), (1, -1), (2, -1), (4, -1)]


@pytest.mark.parametrize(("field", "value"), OVERSIZED)
def test_an_entry_too_wide_for_its_packed_fields_is_malformed(field: int, value: int) -> None:
    wire = entry().to_wire()
    wire[field] = value
    with pytest.raises(ValueError, match="malformed"):
        DirEntry.from_wire(wire)
    edge = entry().to_wire()  # the largest values that fit are entries
    edge[1:5] = [(1 << 64) - 1, (1 << 32) - 1, (1 << 64) - 1, (1 << 64) - 1]
    edge[6] = (1 << 64) - 1
    assert DirEntry.from_wire(edge).to_wire() == edge


@pytest.mark.parametrize(("field", "value"), OVERSIZED)
def test_a_malformed_entry_is_refused_for_its_key_alone(field: int, value: int) -> None:
    """One producer's bad entry in a dir_put batch is that key's miss: the batch's other
    keys are stored, and later dir_get batches naming it answer every other key (an
    oversized field once failed pack_entries, so all keys of the batch missed)."""
    cl = Cluster(["a"])
    view = DirectoryView(HashRing(["a"]), cl.call, replicas=1)
    bad = entry(3).to_wire()
    bad[field] = value
    items = [[k, entry(2).to_wire()] for k in KEYS[:8]]
    items[4] = [KEYS[4], bad]
    # msgpack carries ints up to 2**64 - 1 and down to -2**63; wider ones cannot be sent.
    if value < 1 << 64:
        assert cl.call("a", "dir_put", items) == 7
    else:
        assert cl.shards["a"].dispatch("dir_put", items) == 7
    assert KEYS[4] not in cl.shards["a"]
    got = view.batch_get(KEYS[:8])
    assert got == [None if i == 4 else entry(2) for i in range(8)]
    assert view.failures == 0


def test_shard_is_thread_safe() -> None:
    s = DirectoryShard()
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        start.wait(timeout=10)
        for i in range(2000):
            k = f"k{i % 50}"
            s.put(k, entry(i, node=f"n{t}"))
            s.get(k)
            s.set_resident(k, i % 2 == 0, node=f"n{t}")
            s.delete(k, node=f"n{t}", generation=i - 1)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert all(isinstance(e, DirEntry) for e in s.snapshot().values())
    s.check_invariants()


def test_random_operations_keep_the_shard_consistent_and_equal_to_a_model() -> None:
    """Every kind of operation at random on one shard, against a dict-and-incarnations
    model of the documented rules, with ``check_invariants()`` after every step."""
    rng = np.random.default_rng(7)
    s = DirectoryShard()
    model: dict[str, DirEntry] = {}
    newest: dict[str, int] = {}
    keys, nodes = KEYS[:12], ["p", "q", "r"]

    def model_put(k: str, e: DirEntry) -> bool:
        known = newest.get(e.node)
        if known != e.incarnation:
            if known is not None and e.incarnation < known:
                return False
            for key in [key for key, old in model.items() if old.node == e.node]:
                del model[key]
            newest[e.node] = e.incarnation
        cur = model.get(k)
        if cur is not None and cur.node == e.node and cur.generation > e.generation:
            return False
        model[k] = e
        return True

    def matches(e: DirEntry, node: str | None, gen: int | None) -> bool:
        return (node is None or e.node == node) and (gen is None or e.generation == gen)

    for _ in range(3000):
        op = int(rng.integers(6))
        k, node = str(rng.choice(keys)), str(rng.choice(nodes))
        gen, inc = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        cond_node = node if rng.random() < 0.7 else None
        cond_gen = gen if rng.random() < 0.5 else None
        if op <= 1:
            e = DirEntry(node, 64 * gen, 7, 100, gen, bool(rng.random() < 0.7), incarnation=inc)
            assert s.put(k, e) == model_put(k, e)
        elif op == 2:
            cur = model.get(k)
            want = cur is not None and matches(cur, cond_node, cond_gen)
            assert s.delete(k, cond_node, cond_gen) == want
            if want:
                del model[k]
        elif op == 3:
            resident = bool(rng.random() < 0.5)
            cur = model.get(k)
            want = cur is not None and matches(cur, cond_node, cond_gen)
            assert s.set_resident(k, resident, cond_node, cond_gen) == want
            if want and cur is not None:
                model[k] = dataclasses.replace(cur, resident=resident)
        elif op == 4:
            gone = [key for key, e in model.items() if e.node == node]
            assert s.retire(node, inc) == (len(gone) if newest.get(node, inc) < inc and node in newest else 0)
            if node in newest and newest[node] < inc:
                for key in gone:
                    del model[key]
                newest[node] = inc
            elif node not in newest:
                newest[node] = inc
        else:
            gone = [key for key, e in model.items() if e.node == node]
            assert s.drop_node(node) == len(gone)
            for key in gone:
                del model[key]
            newest.pop(node, None)
        s.check_invariants()
        assert s.snapshot() == model


def test_newer_incarnation_replaces_whatever_the_generations() -> None:
    s = DirectoryShard()
    old = [(k, DirEntry("p", 64 * i, 7, 100, 1000 + i, incarnation=5)) for i, k in enumerate(KEYS[:10])]
    assert s.batch_put(old) == 10
    s.put(KEYS[50], DirEntry("q", 0, 1, 10, 3, incarnation=9))  # another node: untouched throughout
    # The restarted producer's generations start again from 1: its entries still win, and
    # every entry of its earlier run is gone, rewritten or not.
    assert s.put(KEYS[0], DirEntry("p", 64, 7, 100, 1, incarnation=6))
    assert s.get(KEYS[0]) == DirEntry("p", 64, 7, 100, 1, incarnation=6)
    assert [k for k in KEYS[:10] if k in s] == [KEYS[0]]
    # A late write of the replaced run is refused, and conditional ops see the new run only.
    assert not s.put(KEYS[1], DirEntry("p", 64, 7, 100, 2000, incarnation=5))
    assert s.batch_put([(KEYS[0], DirEntry("p", 64, 7, 100, 2000, incarnation=5))]) == 0
    assert s.get(KEYS[0]).generation == 1
    assert not s.delete(KEYS[0], "p", 1000)
    assert s.get(KEYS[50]) == DirEntry("q", 0, 1, 10, 3, incarnation=9)
    # Membership announcing a newer run drops the current one's entries before it publishes.
    assert s.retire("p", 7) == 1 and KEYS[0] not in s
    assert s.retire("p", 6) == 0  # never backwards
    assert not s.put(KEYS[0], DirEntry("p", 64, 7, 100, 1, incarnation=6))
    # A node that left is forgotten with its entries: whatever it runs as next is taken.
    assert s.put(KEYS[0], DirEntry("p", 64, 7, 100, 1, incarnation=7))
    assert s.drop_node("p") == 1
    assert s.put(KEYS[0], DirEntry("p", 64, 7, 100, 1, incarnation=3))
    # Residency flips keep the incarnation.
    assert s.set_resident(KEYS[0], False, "p", 1) and s.get(KEYS[0]).incarnation == 3


def test_incarnations_travel_in_get_answers() -> None:
    shard = DirectoryShard()
    shard.put("k", DirEntry("p", 64, 7, 100, 1, incarnation=2**62))
    view = DirectoryView(HashRing(["me"]), lambda o, m, a: 1 / 0, replicas=1, local_node="me", local_shard=shard)
    assert view.get("k") == DirEntry("p", 64, 7, 100, 1, incarnation=2**62)


# ---------------------------------------------------------------------- view
def test_view_writes_to_all_replicas_and_reads_primary() -> None:
    nodes = ["a", "b", "c", "d"]
    cl = Cluster(nodes)
    ring = HashRing(nodes)
    view = DirectoryView(ring, cl.call, replicas=2)
    acks = view.batch_put([(k, entry()) for k in KEYS])
    assert acks == [2] * len(KEYS)
    for k in KEYS:
        holders = {n for n, s in cl.shards.items() if k in s}
        assert holders == set(ring.owners(k, 2))
    # one call per owner, not per key
    assert len([c for c in cl.calls if c[1] == "dir_put"]) == len(nodes)
    cl.calls.clear()
    assert view.batch_get(KEYS) == [entry()] * len(KEYS)
    assert len(cl.calls) == len(nodes)


def test_view_falls_back_through_replicas() -> None:
    nodes = ["a", "b", "c"]
    cl = Cluster(nodes)
    ring = HashRing(nodes)
    view = DirectoryView(ring, cl.call, replicas=2)
    view.batch_put([(k, entry()) for k in KEYS])
    cl.down = {"a"}
    assert view.batch_get(KEYS) == [entry()] * len(KEYS)
    assert view.get(KEYS[0]) == entry()
    assert view.failures > 0
    # both owners of some key down -> a miss, never an exception
    k = next(k for k in KEYS if set(ring.owners(k, 2)) == {"a", "b"})
    cl.down = {"a", "b"}
    assert view.get(k) is None
    # writes count only the owners that answered
    assert view.put(k, entry(5)) == 0


def test_view_malformed_answers_are_failures() -> None:
    ring = HashRing(["a", "b"])
    good = DirectoryShard()
    good.put("k", entry())

    def call(owner: str, method: str, args: list[Any]) -> Any:
        if owner == ring.owner("k"):
            return ["garbage"] * len(args) if method == "dir_get" else "??"
        return good.dispatch(method, args)

    view = DirectoryView(ring, call, replicas=2)
    assert view.get("k") == entry()
    assert view.put("k", entry()) == 1


def test_view_miss_fallback_option() -> None:
    ring = HashRing(["a", "b"])
    cl = Cluster(["a", "b"])
    k = KEYS[0]
    secondary = ring.owners(k, 2)[1]
    cl.shards[secondary].put(k, entry())
    assert DirectoryView(ring, cl.call, replicas=2).get(k) is None
    assert DirectoryView(ring, cl.call, replicas=2, fallback_on_miss=True).get(k) == entry()


def test_view_local_shard_short_circuits() -> None:
    ring = HashRing(["me"])
    local = DirectoryShard()

    def call(owner: str, method: str, args: list[Any]) -> Any:
        raise AssertionError("no RPC to self")

    view = DirectoryView(ring, call, replicas=2, local_node="me", local_shard=local)
    assert view.put("k", entry()) == 1
    assert view.get("k") == entry()
    assert view.set_resident("k", False, node="p", generation=1) == 1
    assert local.get("k") == entry(resident=False)
    assert view.delete("k", node="p") == 1 and len(local) == 0


def test_view_empty_ring_and_bad_args() -> None:
    view = DirectoryView(HashRing(), lambda o, m, a: None)
    assert view.get("k") is None and view.put("k", entry()) == 0
    with pytest.raises(ValueError):
        DirectoryView(HashRing(), lambda o, m, a: None, replicas=0)
    with pytest.raises(TypeError):
        DirectoryView(HashRing(), None)  # type: ignore[arg-type]


def test_republish_on_join_and_leave() -> None:
    nodes = ["a", "b", "c"]
    cl = Cluster([*nodes, "d"])
    old = HashRing(nodes)
    view = DirectoryView(old, cl.call, replicas=2)
    mine = {k: entry() for k in KEYS}
    view.batch_put(list(mine.items()))

    new = old.copy()
    new.add_node("d")
    plan = republish_plan(mine, old, new, 2)
    assert set(plan) == {"d"}
    cl.calls.clear()
    assert view.republish(mine, old, new) == (len(plan["d"]), ())
    assert cl.calls == [("d", "dir_put")]
    for k in KEYS:
        for owner in new.owners(k, 2):
            assert k in cl.shards[owner], (k, owner)
    # "d" reads without fallback now that it holds its keys
    assert view.batch_get(KEYS) == [entry()] * len(KEYS)

    # a node dies: the survivors gain the keys it replicated
    newer = new.copy()
    newer.remove_node("a")
    cl.down = {"a"}
    view.republish(mine, new, newer)
    for k in KEYS:
        for owner in newer.owners(k, 2):
            assert k in cl.shards[owner]
    # fresh start: everything goes to all owners
    fresh = republish_plan(KEYS, None, newer, 2)
    assert sum(len(v) for v in fresh.values()) == 2 * len(KEYS)


def test_republish_names_the_owners_that_failed_and_calls_owners_through_the_given_runner() -> None:
    old = HashRing(["a", "b"])
    new = old.copy()
    new.add_node("c")
    new.add_node("d")
    cl = Cluster(["a", "b", "c", "d"])
    cl.down = {"c"}
    view = DirectoryView(old, cl.call, replicas=2)
    mine = {k: entry() for k in KEYS}
    plan = republish_plan(mine, old, new, 2)
    assert set(plan) == {"c", "d"}
    seen: list[list[str]] = []

    def runner(put: Any, owners: list[str]) -> list[bool]:
        seen.append(list(owners))
        return [put(o) for o in reversed(owners)][::-1]  # any order of calls; answers in order

    done = view.republish(mine, old, new, call_owners=runner)
    assert seen == [list(plan)] and view.ring is new
    assert done == (len(plan["d"]), ("c",))
    assert all(k in cl.shards["d"] for k in plan["d"]) and not cl.shards["c"].get(plan["c"][0])


# ---------------------------------------------------------------------- dir_exists
def _codes_from_wires(view: DirectoryView, keys: list[str]) -> bytes:
    return bytes(MISS if e is None else RESIDENT if e.resident else ON_DISK for e in view.batch_get(keys))


def test_shard_exists_codes_and_bad_keys() -> None:
    s = DirectoryShard()
    s.put("a", entry())
    s.put("b", entry(2, resident=False))
    assert s.dispatch("dir_exists", ["a", "b", "c", "a"]) == bytes([RESIDENT, ON_DISK, MISS, RESIDENT])
    assert s.dispatch("dir_exists", []) == b""
    for bad in ([3], ["a", b"b"], [None]):
        with pytest.raises(ValueError, match="malformed"):
            s.dispatch("dir_exists", bad)


@pytest.mark.parametrize("down", [set(), {"a"}, {"a", "b"}, {"a", "b", "c"}])
@pytest.mark.parametrize("fallback_on_miss", [False, True])
def test_view_exists_matches_get_wire(down: set[str], fallback_on_miss: bool) -> None:
    # Same rounds, same replica fallback, same failure count as batch_get.
    nodes = ["a", "b", "c"]
    cl = Cluster(nodes)
    ring = HashRing(nodes)
    writer = DirectoryView(ring, cl.call, replicas=2)
    writer.batch_put([(k, entry(resident=i % 3 != 0)) for i, k in enumerate(KEYS[:200])])
    for i, k in enumerate(KEYS[:200]):
        if i % 7 == 0:  # present on the secondary only: a miss unless fallback_on_miss
            cl.shards[ring.owners(k, 2)[0]].delete(k)
    cl.down = down
    keys = KEYS[::-1]  # misses (never written) mixed in, order scrambled
    v1 = DirectoryView(ring, cl.call, replicas=2, fallback_on_miss=fallback_on_miss)
    v2 = DirectoryView(ring, cl.call, replicas=2, fallback_on_miss=fallback_on_miss)
    got = v1.batch_exists(keys)
    assert got == _codes_from_wires(v2, keys)
    assert v1.failures == v2.failures
    assert (v1.failures > 0) == bool(down)
    if not down and not fallback_on_miss:
        assert got.count(ON_DISK) > 0 and got.count(RESIDENT) > 0 and got.count(MISS) > 0


def test_view_exists_malformed_answers_are_failures() -> None:
    ring = HashRing(["a", "b"])
    good = DirectoryShard()
    keys = KEYS[:40]
    for k in keys:
        good.put(k, entry(resident=False))
    primary = {k: ring.owner(k) for k in keys}
    keys_a = [k for k in keys if primary[k] == "a"]
    answers: dict[str, Any] = {}

    def call(owner: str, method: str, args: list[Any]) -> Any:
        if owner == "a" and method in answers:
            return answers[method](args)
        return good.dispatch(method, args)

    # A whole answer of the wrong type or length: the owner failed for all its keys.
    for bad in (lambda a: [1] * len(a), lambda a: b"\x01" * (len(a) + 1), lambda a: "x" * len(a), lambda a: None):
        answers["dir_exists"] = bad
        view = DirectoryView(ring, call, replicas=2)
        assert view.batch_exists(keys) == bytes([ON_DISK]) * len(keys)
        assert view.failures == 1
    # One bad byte: only that key fails over (counted once); the rest is taken as answered.
    answers["dir_exists"] = lambda a: bytes([9 if k == keys_a[0] else MISS for k in a])
    view = DirectoryView(ring, call, replicas=2)
    got = view.batch_exists(keys)
    assert got == bytes(ON_DISK if primary[k] == "b" or k == keys_a[0] else MISS for k in keys)
    assert view.failures == 1
    # Both owners fail: a miss, never an exception.
    view = DirectoryView(ring, lambda o, m, a: 1 / 0, replicas=2)
    assert view.batch_exists(keys) == bytes(len(keys)) and view.failures == 4  # 2 rounds x 2 owners


def test_view_exists_local_shard_short_circuits() -> None:
    ring = HashRing(["me"])
    shard = DirectoryShard()
    shard.put("k", entry())

    def call(owner: str, method: str, args: list[Any]) -> Any:
        raise AssertionError("no RPC to the local node")

    view = DirectoryView(ring, call, local_node="me", local_shard=shard)
    assert view.batch_exists(["k", "x"]) == bytes([RESIDENT, MISS])
    assert DirectoryView(HashRing(), call).batch_exists(["k"]) == bytes([MISS])


# ---------------------------------------------------------------------- packed dir_get
def test_packed_entries_round_trip_and_columns() -> None:
    entries = [
        entry(1, "p"),
        None,
        entry(2, "q", resident=False),
        entry(3, "p"),
        DirEntry("q", 2**63, 2**32 - 1, 0, 2**64 - 1),
    ]
    names, body, incs = pack_entries(entries)
    assert names == ["p", "q"] and incs == [0, 0] and len(body) == len(entries) * PACKED_ENTRY.itemsize
    assert int(np.frombuffer(body, PACKED_ENTRY)["node"][1]) == NO_PRODUCER
    shard = DirectoryShard()
    for i, e in enumerate(entries):
        if e is not None:
            shard.put(KEYS[i], e)
    view = DirectoryView(HashRing(["me"]), lambda o, m, a: 1 / 0, replicas=1, local_node="me", local_shard=shard)
    cols = view.batch_get_columns(KEYS[: len(entries)])
    assert cols.entries() == entries and view.batch_get(KEYS[: len(entries)]) == entries
    assert cols.node_index("q") == cols.nodes.index("q") and cols.node_index("zz") == -1
    assert pack_entries([]) == [[], b"", []]


def test_packed_answer_bad_record_fails_that_key_only() -> None:
    ring = HashRing(["a", "b"])
    good = DirectoryShard()
    keys = KEYS[:40]
    for i, k in enumerate(keys):
        good.put(k, entry(i + 1))
    keys_a = [k for k in keys if ring.owner(k) == "a"]
    answers: dict[str, Any] = {}

    def call(owner: str, method: str, args: list[Any]) -> Any:
        if owner == "a" and "dir_get" in answers:
            return answers["dir_get"](args)
        return good.dispatch(method, args)

    def node_out_of_range(args: list[Any]) -> Any:
        names, body, incs = good.dispatch("dir_get", args)
        recs = np.frombuffer(body, PACKED_ENTRY).copy()
        recs["node"][args.index(keys_a[0])] = len(names)  # names no node of the answer
        return [names, recs.tobytes(), incs]

    answers["dir_get"] = node_out_of_range
    view = DirectoryView(ring, call, replicas=2)
    assert view.batch_get(keys) == [entry(i + 1) for i in range(len(keys))]  # the bad one came from "b"
    assert view.failures == 1
    # Whole answers of the wrong shape: the owner failed for all its keys.
    for bad in (
        lambda a: None,
        lambda a: [["p"], b"\0" * PACKED_ENTRY.itemsize * len(a)],
        lambda a: [["p"], b"\0" * (PACKED_ENTRY.itemsize * len(a) + 1), [0]],
        lambda a: [[3], b"\0" * PACKED_ENTRY.itemsize * len(a), [0]],
        lambda a: ["p", b"\0" * PACKED_ENTRY.itemsize * len(a), [0]],
        lambda a: [["p"], "x", [0]],
        lambda a: [["p"], b"\0" * PACKED_ENTRY.itemsize * len(a), []],
        lambda a: [["p"], b"\0" * PACKED_ENTRY.itemsize * len(a), [-1]],
    ):
        answers["dir_get"] = bad
        view = DirectoryView(ring, call, replicas=2)
        assert view.batch_get(keys) == [entry(i + 1) for i in range(len(keys))]
        assert view.failures == 1
    # No second owner to fall back to: the keys of the failed owner are misses.
    view = DirectoryView(ring, call, replicas=1)
    got = view.batch_get(keys)
    assert [g is None for g in got] == [k in keys_a for k in keys]


class Split(Cluster):
    """``Cluster`` with the split ``begin`` form: requests are queued, answered on finish."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(nodes)
        self.events: list[tuple[str, str]] = []
        self.cancelled = 0

    def begin(self, owner: str, method: str, args: list[Any]) -> Any:
        self.events.append(("send", owner))
        if owner in self.down:
            raise ConnectionError(f"{owner} is down")
        split = self

        class Finish:
            def result(self) -> Any:
                split.events.append(("recv", owner))
                return split.call(owner, method, args)

            def cancel(self) -> None:
                split.cancelled += 1

        return Finish()


@pytest.mark.parametrize("down", [set(), {"a"}, {"a", "b"}])
@pytest.mark.parametrize("fallback_on_miss", [False, True])
def test_view_begin_gives_the_same_answers_and_failures(down: set[str], fallback_on_miss: bool) -> None:
    nodes = ["a", "b", "c"]
    cl, sp = Cluster(nodes), Split(nodes)
    ring = HashRing(nodes)
    for c in (cl, sp):
        DirectoryView(ring, c.call, replicas=2).batch_put([(k, entry(resident=i % 3 != 0)) for i, k in enumerate(KEYS)])
        for k in KEYS[::7]:
            c.shards[ring.owners(k, 2)[0]].delete(k)
        c.down = down
    keys = KEYS[::-1]
    v1 = DirectoryView(ring, cl.call, replicas=2, fallback_on_miss=fallback_on_miss)
    v2 = DirectoryView(ring, sp.call, replicas=2, fallback_on_miss=fallback_on_miss, begin=sp.begin)
    assert v2.batch_exists(keys) == v1.batch_exists(keys)
    assert v2.batch_get(keys) == v1.batch_get(keys)
    assert v2.failures == v1.failures
    # Within a round every request is sent before any answer is read.
    first_recv = next((i for i, e in enumerate(sp.events) if e[0] == "recv"), len(sp.events))
    assert all(e[0] == "send" for e in sp.events[:first_recv]) and first_recv >= 2 - len(down & {"a", "b"})


def test_view_begin_queries_the_local_shard_while_remote_calls_are_in_flight() -> None:
    ring = HashRing(["me", "far"])
    local = DirectoryShard()
    far = DirectoryShard()
    for k in KEYS[:64]:
        (local if ring.owner(k) == "me" else far).put(k, entry())
    order: list[str] = []

    class Probe(DirectoryShard):
        def dispatch(self, method: str, args: Any) -> Any:
            order.append("local")
            return local.dispatch(method, args)

    def begin(owner: str, method: str, args: list[Any]) -> Any:
        order.append("send")

        class Finish:
            def result(self) -> Any:
                order.append("recv")
                return far.dispatch(method, args)

            def cancel(self) -> None:
                raise AssertionError("nothing to cancel")

        return Finish()

    view = DirectoryView(ring, lambda o, m, a: 1 / 0, local_node="me", local_shard=Probe(), begin=begin)
    assert view.batch_exists(KEYS[:64]) == bytes([RESIDENT]) * 64
    assert order == ["send", "local", "recv"] and view.failures == 0


def test_view_begin_cancels_calls_in_flight_when_interrupted() -> None:
    ring = HashRing(["me", "b", "c"])
    sp = Split(["b", "c"])

    class Boom(DirectoryShard):
        def dispatch(self, method: str, args: Any) -> Any:
            raise KeyboardInterrupt  # not an owner failure: it propagates

    view = DirectoryView(ring, sp.call, local_node="me", local_shard=Boom(), begin=sp.begin)
    with pytest.raises(KeyboardInterrupt):
        view.batch_exists(KEYS[:64])
    assert sp.cancelled == 2 and not any(e[0] == "recv" for e in sp.events)
