"""Published pool: slots, LRU, eviction callbacks, header verification, and a race torture test."""

from __future__ import annotations

import hashlib
import random
import sys
import threading
from typing import Any

import numpy as np
import pytest

from hiradix.peer.pool import (
    SLOT_HEADER_SIZE,
    EvictedPage,
    PublishedPool,
    key_digest,
    pack_header,
    verify_parts,
    verify_slot,
)

PAGE = 1024


def page_for(key: str, size: int = PAGE) -> bytes:
    """Deterministic page content of ``key`` (the test's independent oracle)."""
    out = b""
    i = 0
    while len(out) < size:
        out += hashlib.sha256(f"{key}/{i}".encode()).digest()
        i += 1
    return out[:size]


class FakeRegistrar:
    def __init__(self) -> None:
        self.registered: list[Any] = []
        self.deregistered: list[int] = []

    def register(self, buffer: Any) -> Any:
        from hiradix.peer.pool import LocalRegion

        self.registered.append(buffer)
        return LocalRegion(0x10000, 42, memoryview(buffer).nbytes)

    def deregister(self, rkey: int, timeout: float | None = None) -> None:
        self.deregistered.append(rkey)


def make_pool(slots: int, on_evict: Any = None, registrar: Any = None) -> PublishedPool:
    stride = SLOT_HEADER_SIZE + PAGE
    return PublishedPool(slots * stride, PAGE, on_evict=on_evict, registrar=registrar)


def test_set_get_and_location() -> None:
    reg = FakeRegistrar()
    pool = make_pool(4, registrar=reg)
    loc = pool.set("a", page_for("a"))
    assert loc is not None
    assert (loc.rkey, loc.addr, loc.length, loc.read_length) == (42, 0x10000, PAGE, PAGE + SLOT_HEADER_SIZE)
    assert pool.get("a") == page_for("a")
    assert pool.location("a") == loc
    assert pool.set("a", page_for("a")) == loc  # re-set is a touch, no new generation
    out = bytearray(PAGE + 10)
    assert pool.read_into("a", out) == PAGE and bytes(out[:PAGE]) == page_for("a")
    assert pool.get("zz") is None and pool.read_into("zz", out) is None and pool.location("zz") is None
    # what a remote READ of the slot returns verifies
    raw = bytes(pool.slot_view(loc.slot)[: loc.read_length])
    assert verify_slot(raw, "a", loc.generation, loc.length) == page_for("a")
    assert pool.used_bytes == PAGE and pool.capacity_bytes == 4 * PAGE and len(pool) == 1
    pool.close()
    pool.close()
    assert reg.deregistered == [42] and len(reg.registered) == 1
    with pytest.raises(RuntimeError, match="closed"):
        pool.set("b", b"x")


def test_unregistered_region_uses_real_address_and_alignment() -> None:
    pool = make_pool(2)
    assert pool.region.rkey == 0 and pool.region.addr % 4096 == 0
    assert pool.stride % 64 == 0


def test_lru_eviction_and_callback() -> None:
    evicted: list[EvictedPage] = []
    pool = make_pool(3, on_evict=evicted.append)
    locs = {k: pool.set(k, page_for(k)) for k in "abc"}
    pool.get("a")  # a is now most recent; b is the LRU victim
    d = pool.set("d", page_for("d"))
    assert d is not None
    assert [e.key for e in evicted] == ["b"]
    b = locs["b"]
    assert b is not None
    assert evicted[0] == EvictedPage("b", b.slot, b.generation, PAGE)
    assert d.slot == b.slot and d.generation > b.generation
    # a reader holding b's old location now gets a miss, not d's bytes
    raw = bytes(pool.slot_view(b.slot)[: b.read_length])
    assert verify_slot(raw, "b", b.generation) is None
    assert pool.evictions == 1 and set(pool.keys()) == {"a", "c", "d"}


def test_delete_frees_slot_without_callback() -> None:
    evicted: list[EvictedPage] = []
    pool = make_pool(1, on_evict=evicted.append)
    loc = pool.set("a", b"x" * 10)
    assert loc is not None
    assert pool.delete("a") and not pool.delete("a")
    assert verify_slot(bytes(pool.slot_view(loc.slot)), "a", loc.generation) is None
    assert pool.set("b", b"y" * 10) is not None and evicted == [] and pool.used_bytes == 10


def test_bad_inputs() -> None:
    pool = make_pool(1)
    with pytest.raises(ValueError, match="does not fit"):
        pool.set("a", b"")
    with pytest.raises(ValueError, match="does not fit"):
        pool.set("a", b"x" * (PAGE + 1))
    with pytest.raises(ValueError, match="holds no slot"):
        PublishedPool(10, PAGE)
    with pytest.raises(ValueError, match="page_size"):
        PublishedPool(10, 0)
    pool.set("a", b"abc")
    with pytest.raises(ValueError, match="smaller"):
        pool.read_into("a", bytearray(2))
    with pytest.raises(IndexError):
        pool.slot_view(5)


def test_accepts_numpy_and_torch_buffers() -> None:
    torch = pytest.importorskip("torch")
    pool = make_pool(2)
    arr = np.arange(64, dtype=np.float32)
    assert pool.set("np", arr) is not None and pool.get("np") == arr.tobytes()
    t = torch.arange(32, dtype=torch.int32)
    assert pool.set("t", t.numpy()) is not None and pool.get("t") == t.numpy().tobytes()


def test_verify_rejects_every_single_field() -> None:
    payload = page_for("k", 100)
    head = bytearray(pack_header("k", 9, payload))
    assert verify_parts(head, payload, "k", 9, 100)
    assert not verify_parts(head, payload, "k", 9, 99)  # length mismatch with the directory
    assert not verify_parts(head, payload[:50], "k", 9)  # short payload
    assert not verify_parts(head[:10], payload, "k", 9)  # short header
    assert not verify_parts(bytes(64), payload, "k", 0)  # zeroed (invalidated) header
    for pos in range(SLOT_HEADER_SIZE):
        bad = bytearray(head)
        bad[pos] ^= 0x01
        ok = verify_parts(bad, payload, "k", 9)
        assert not ok or pos in (12, 13, 14, 15, 60, 61, 62, 63), pos  # only reserved bytes are free
    flipped = bytearray(payload)
    flipped[57] ^= 0x80
    assert not verify_parts(head, flipped, "k", 9)


def test_torn_read_is_a_miss() -> None:
    """A READ that copies the header, then the slot is reused, then copies the payload."""
    pool = make_pool(1)
    a = pool.set("a", page_for("a"))
    assert a is not None
    view = pool.slot_view(a.slot)
    header = bytes(view[:SLOT_HEADER_SIZE])  # the READ has fetched the header...
    pool.set("b", page_for("b"))  # ...the slot is evicted and rewritten...
    payload = bytes(view[SLOT_HEADER_SIZE : SLOT_HEADER_SIZE + PAGE])  # ...then the payload arrives
    assert not verify_parts(header, payload, "a", a.generation)
    # payload first, header after (the fenced order): exact
    b = pool.location("b")
    assert b is not None
    payload = bytes(view[SLOT_HEADER_SIZE : SLOT_HEADER_SIZE + PAGE])
    pool.set("c", page_for("c"))
    header = bytes(view[:SLOT_HEADER_SIZE])
    assert not verify_parts(header, payload, "b", b.generation)


def test_concurrent_set_same_key_publishes_once() -> None:
    pool = make_pool(8)
    barrier = threading.Barrier(4)
    results: list[Any] = []

    def w() -> None:
        barrier.wait(timeout=10)
        results.append(pool.set("same", page_for("same")))

    ts = [threading.Thread(target=w) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert len(pool) == 1 and pool.used_bytes == PAGE
    final = pool.location("same")
    assert final is not None and all(r == final for r in results[-1:])
    assert len(pool.free_slots()) == 7  # the losers gave their slots back
    pool.check_invariants()


def header_claims(raw: bytes, key: str, generation: int) -> bool:
    """The header alone says ``key`` at ``generation`` (ignoring the CRC)."""
    gen = int.from_bytes(raw[16:24], "little")
    return raw[:4] == b"HRXP" and gen == generation and raw[24:56] == key_digest(key)


def test_torture_readers_never_see_a_wrong_page() -> None:
    """Writers evict and rewrite slots while readers copy slots out in small chunks (as a
    READ streams packets) and verify. Every accepted page must equal the key's content,
    checked against a SHA-256 computed independently of the pool's CRC."""
    slots, keys = 6, [f"key-{i}" for i in range(10)]
    pages = {k: page_for(k) for k in keys}
    expected = {k: hashlib.sha256(p).digest() for k, p in pages.items()}
    evictions: list[EvictedPage] = []
    pool = make_pool(slots, on_evict=evictions.append)
    stop = threading.Event()
    wrong: list[str] = []
    stats = {"hit": 0, "miss": 0, "torn_or_stale": 0, "caught_by_crc": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []
    progress = threading.Condition()
    writes = [0]

    def let_writers_run(rnd: random.Random) -> None:
        # Mid-READ, sometimes wait (on an event, not a sleep) until the writers have done a
        # few more operations, so slots really are rewritten under the reader's feet.
        if rnd.random() < 0.05:
            with progress:
                target = writes[0] + rnd.randint(1, 4)
                progress.wait_for(lambda: writes[0] >= target or stop.is_set(), timeout=10)

    def chunks(rnd: random.Random, view: memoryview, start: int, end: int) -> bytes:
        step = rnd.choice((64, 128, 256))
        parts = []
        for o in range(start, end, step):
            parts.append(bytes(view[o : min(o + step, end)]))
            let_writers_run(rnd)
        return b"".join(parts)

    def writer(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(200_000):
                if stop.is_set():
                    return
                k = rnd.choice(keys)
                if rnd.random() < 0.1:
                    pool.delete(k)
                else:
                    pool.set(k, pages[k])
                with progress:
                    writes[0] += 1
                    progress.notify_all()
        except BaseException as exc:
            errors.append(exc)

    def reader(seed: int, n_reads: int, payload_first: bool) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(n_reads):
                k = rnd.choice(keys)
                loc = pool.location(k, touch=False)  # what the directory would say
                if loc is None:
                    with lock:
                        stats["miss"] += 1
                    continue
                view = pool.slot_view(loc.slot)
                end = loc.read_length
                if payload_first:
                    body = chunks(rnd, view, SLOT_HEADER_SIZE, end)
                    head = bytes(view[:SLOT_HEADER_SIZE])
                    ok = verify_parts(head, body, k, loc.generation, loc.length)
                    got = body if ok else None
                else:
                    raw = chunks(rnd, view, 0, end)
                    v = verify_slot(raw, k, loc.generation, loc.length)
                    got = None if v is None else bytes(v)
                    if v is None and header_claims(raw, k, loc.generation):
                        with lock:
                            stats["caught_by_crc"] += 1  # header right, payload torn
                with lock:
                    if got is None:
                        stats["torn_or_stale"] += 1
                    elif hashlib.sha256(got).digest() != expected[k]:
                        wrong.append(k)
                    else:
                        stats["hit"] += 1
        except BaseException as exc:
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave threads as finely as CPython allows
    try:
        writers = [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
        readers = [threading.Thread(target=reader, args=(10 + s, 3000, s % 2 == 0)) for s in range(4)]
        for t in writers + readers:
            t.start()
        for t in readers:
            t.join(timeout=120)
        stop.set()
        for t in writers:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert not any(t.is_alive() for t in writers + readers)
    assert wrong == []
    assert stats["hit"] > 0 and len(evictions) > 0
    assert stats["torn_or_stale"] > 0  # the race was really exercised
    assert stats["caught_by_crc"] > 0  # ... including torn payloads behind a valid header
    # the pool's own bookkeeping survived the race
    assert len(pool) + len(pool.free_slots()) == slots and pool.held_slots() == []
    assert pool.used_bytes == PAGE * len(pool)
    pool.check_invariants()  # nothing being written, every published slot verifies
    print("torture:", stats, "evictions:", len(evictions))


def test_remote_read_through_the_fake_nic() -> None:
    """End to end over the transport seam: the pool registers with node A's NIC, node B
    READs a slot into its receive buffer and verifies it; after reuse the same READ is a miss."""
    fake = pytest.importorskip("hiradix.transport.fake")
    fabric = fake.FakeFabric()
    a, b = fake.FakeTransport(fabric, "a"), fake.FakeTransport(fabric, "b")
    try:
        pool = PublishedPool(2 * (SLOT_HEADER_SIZE + PAGE), PAGE, registrar=a)
        recv = np.zeros(SLOT_HEADER_SIZE + PAGE, dtype=np.uint8)
        local = b.register(recv)
        loc = pool.set("k", page_for("k"))
        assert loc is not None and loc.rkey == pool.region.rkey
        ops = [(loc.addr, loc.rkey, loc.read_length, local.addr)]
        assert [int(s) for s in b.read_batch("a", ops)] == [0]
        got = verify_slot(recv, "k", loc.generation, loc.length)
        assert got is not None and bytes(got) == page_for("k")
        pool.set("x", page_for("x"))
        pool.set("y", page_for("y"))  # evicts k and reuses its slot
        assert [int(s) for s in b.read_batch("a", ops)] == [0]
        assert verify_slot(recv, "k", loc.generation, loc.length) is None
        pool.close(timeout=5)
        assert [int(s) for s in b.read_batch("a", ops)] != [0]  # deregistered
    finally:
        a.close()
        b.close()


def test_republish_writes_a_fresh_slot_and_frees_the_old_one_last() -> None:
    """New bytes under a published key: the old slot keeps verifying (held) until release,
    then goes to the back of the free list with its bytes intact; identical bytes are a touch."""
    pool = make_pool(4)
    old = pool.set("k", page_for("k"))
    assert old is not None and old.replaced is None
    assert pool.set("k", page_for("k"), hold_replaced=True) == old  # identical: no write at all
    new = pool.set("k", page_for("k2"), hold_replaced=True)
    assert new is not None and new.slot != old.slot and new.generation > old.generation
    assert new.replaced == old.slot and pool.get("k") == page_for("k2")
    assert len(pool) == 1 and pool.used_bytes == PAGE and old.slot not in pool.free_slots()
    # A reader holding the old location still gets the old page, verified.
    raw = bytes(pool.slot_view(old.slot)[: old.read_length])
    assert verify_slot(raw, "k", old.generation) is not None
    pool.release(old.slot)
    assert pool.free_slots()[-1] == old.slot  # reused after every other free slot
    pool.check_invariants()
    assert verify_slot(bytes(pool.slot_view(old.slot)[: old.read_length]), "k", old.generation) is not None
    with pytest.raises(ValueError, match="not held"):
        pool.release(old.slot)
    # Without hold_replaced the old slot is freed at once (still to the back, bytes intact).
    third = pool.set("k", page_for("k3"))
    assert third is not None and third.replaced is None and pool.free_slots()[-1] == new.slot
    # Fill the pool: the old slots are reused last, and then the stale reader misses.
    for k in "abc":
        pool.set(k, page_for(k))
    assert verify_slot(bytes(pool.slot_view(old.slot)[: old.read_length]), "k", old.generation) is None


def test_generations_come_from_the_injected_source() -> None:
    gens = iter([10, 20, 30])
    pool = PublishedPool(4 * (SLOT_HEADER_SIZE + PAGE), PAGE, generations=lambda: next(gens))
    assert [pool.set(k, page_for(k)).generation for k in "ab"] == [10, 20]  # type: ignore[union-attr]


def test_read_into_exact_length() -> None:
    pool = make_pool(2)
    pool.set("k", page_for("k"))
    assert pool.read_into("k", bytearray(PAGE), exact=True) == PAGE
    assert pool.read_into("k", bytearray(PAGE // 2), exact=True) is None  # a miss, not an error
    assert pool.read_into("k", bytearray(2 * PAGE), exact=True) is None
    with pytest.raises(ValueError, match="smaller"):
        pool.read_into("k", bytearray(PAGE // 2))
