"""The published pool: the host region peers READ pages from (the second MR of the two-MR model).

SGLang's host KV buffer is L2 and gets overwritten, so its addresses cannot be handed to
other nodes. ``set`` therefore copies a page into a backend-owned region with fixed slots
(one memcpy) and the caller publishes the slot's ``(addr, rkey, length, generation)``. The
region is registered once with an injected :class:`Registrar` (a transport), so this module
needs no network to be tested.

Slot layout (``stride = round_up(SLOT_HEADER_SIZE + page_size, 64)`` bytes)::

    offset  size  field
    0       4     magic  b"HRXP"
    4       2     format version (1)
    6       2     flags (0)
    8       4     payload length in bytes
    12      4     reserved (0)
    16      8     generation (unique per write, never 0)
    24      32    SHA-256 of the key (full width; :func:`key_digest`)
    56      4     CRC-32 (zlib) of bytes 0..55 followed by the payload
    60      4     reserved (0)
    64      ...   payload

Why readers can trust what they fetch. A remote READ runs with no lock: the slot can be
evicted and rewritten while the bytes are in flight. Every write of a slot (1) zeroes the
header, (2) copies the payload, (3) writes the new header last, with a fresh generation. A
reader accepts a fetched slot only if the magic, version, length, key digest and the
generation it got from the directory all match and the CRC over header and payload is
right (:func:`verify_slot` / :func:`verify_parts`). So:

- a slot reused for another key fails the digest or generation check;
- a slot rewritten during a single front-to-back READ (header copied before the payload)
  carries the old header with a mixed payload and fails the CRC, except with probability
  about ``2**-32`` per torn read;
- when the payload is read first and the header after it (two reads, the second fenced),
  the check is exact: a header still carrying the expected generation proves that no rewrite
  started before the header was read, because a rewrite zeroes the header first and
  generations never repeat.

CRC-32 is used because zlib's implementation is fast, in the standard library, and releases
the GIL on large buffers; it is an integrity check against races and torn I/O, not against
an adversary (the cluster token guards who may connect at all).

Republishing a key never takes its live page away first. Identical bytes are only a touch
(no write, same generation). Other bytes go to a *fresh* slot; the index switches to it, and
the old slot is freed only afterwards, to the back of the free list with its bytes intact, so
a reader that looked the old location up still verifies the old page (or, once the slot is
reused, misses safely). With ``hold_replaced=True`` the old slot is not freed at all until the
caller's :meth:`PublishedPool.release`: the node first switches the directory entry, then
frees the slot.

Eviction is LRU over published slots. A slot being written is not in the LRU and cannot be
chosen. The eviction callback runs after the pool lock is released; it receives the
evicted ``(key, generation)`` so the store can delete exactly that directory entry (or mark
it non-resident when the disk tier holds the page), never a newer one.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hiradix.peer.keyhash import key_digest

try:  # ISA-L's crc32 gives zlib's values at 20+ GB/s (zlib: ~3 GB/s here); same slot format.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is optional
    _crc32 = zlib.crc32

__all__ = [
    "SLOT_HEADER_SIZE",
    "SLOT_MAGIC",
    "EvictedPage",
    "LocalRegion",
    "PublishedPool",
    "RegionLike",
    "Registrar",
    "SlotLocation",
    "key_digest",
    "pack_header",
    "verify_parts",
    "verify_slot",
]

SLOT_MAGIC = b"HRXP"
SLOT_VERSION = 1
SLOT_HEADER_SIZE = 64
SLOT_ALIGN = 64  # slot stride alignment: one cache line
_PREFIX = struct.Struct("<4sHHII Q32s")  # bytes 0..55, covered by the CRC
_HEADER = struct.Struct("<56sI4x")  # prefix, crc, reserved
assert _PREFIX.size == 56 and _HEADER.size == SLOT_HEADER_SIZE

Key = str | bytes

_memcmp = ctypes.CDLL(None).memcmp  # releases the GIL; ~10 GB/s (numpy's array_equal: ~4 GB/s)
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def pack_header(key: Key, generation: int, payload: Any) -> bytes:
    """The 64-byte header for ``payload`` (any buffer) written as ``key`` at ``generation``.

    Runtime complexity: ``O(len(payload))`` (the CRC).
    """
    length = memoryview(payload).nbytes
    prefix = _PREFIX.pack(SLOT_MAGIC, SLOT_VERSION, 0, length, 0, generation, key_digest(key))
    return _HEADER.pack(prefix, _crc32(payload, _crc32(prefix)))


def verify_parts(header: Any, payload: Any, key: Key, generation: int, length: int | None = None) -> bool:
    """Whether a fetched ``header`` (64 bytes) and ``payload`` are exactly ``key``'s page at
    ``generation``. ``payload`` may be longer than the page (only the header's length is
    checked); ``length``, when given, must equal the header's length.

    Never raises for bad bytes: anything that does not verify is ``False`` (a miss).
    Runtime complexity: ``O(length)`` (one CRC pass).

    >>> h = pack_header("k", 7, b"abc")
    >>> verify_parts(h, b"abc", "k", 7), verify_parts(h, b"abd", "k", 7), verify_parts(h, b"abc", "k", 8)
    (True, False, False)
    """
    hv = memoryview(header).cast("B")
    if hv.nbytes < SLOT_HEADER_SIZE:
        return False
    prefix, crc = _HEADER.unpack_from(hv)
    magic, version, _flags, n, _res, gen, digest = _PREFIX.unpack(prefix)
    if magic != SLOT_MAGIC or version != SLOT_VERSION or gen != generation or gen == 0:
        return False
    if length is not None and n != length:
        return False
    pv = memoryview(payload).cast("B")
    if pv.nbytes < n or digest != key_digest(key):
        return False
    return _crc32(pv[:n], _crc32(prefix)) == crc


def verify_slot(raw: Any, key: Key, generation: int, length: int | None = None) -> memoryview | None:
    """Verify a fetched slot (header followed by payload, as one READ returns it).

    Returns a view of the payload bytes, or ``None`` if the slot is not ``key``'s page at
    ``generation`` (evicted, reused, torn or corrupt: treat as a miss).
    Runtime complexity: ``O(length)``.

    >>> raw = pack_header("k", 3, b"page") + b"page"
    >>> bytes(verify_slot(raw, "k", 3))
    b'page'
    >>> verify_slot(raw, "other", 3) is None
    True
    """
    rv = memoryview(raw).cast("B")
    if rv.nbytes < SLOT_HEADER_SIZE:
        return None
    head, body = rv[:SLOT_HEADER_SIZE], rv[SLOT_HEADER_SIZE:]
    if not verify_parts(head, body, key, generation, length):
        return None
    n = struct.unpack_from("<I", head, 8)[0]
    return body[:n]


# ---------------------------------------------------------------------- injected transport
class RegionLike(Protocol):
    """What registration returns (the transport's ``Region`` satisfies it)."""

    @property
    def addr(self) -> int: ...
    @property
    def rkey(self) -> int: ...
    @property
    def length(self) -> int: ...


class Registrar(Protocol):
    """The part of a transport the pool needs: register its buffer once, deregister at close."""

    def register(self, buffer: Any) -> RegionLike: ...
    def deregister(self, rkey: int, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class LocalRegion:
    """Region of an unregistered pool (no transport): the real address, rkey 0."""

    addr: int
    rkey: int
    length: int


@dataclass(frozen=True)
class SlotLocation:
    """Where a published page lives: what the producer puts in the directory.

    ``addr`` is the slot start (header first); a reader fetches
    ``SLOT_HEADER_SIZE + length`` bytes from it and verifies them against ``generation``.
    ``replaced`` is the slot of the page this write superseded, held for the caller's
    :meth:`PublishedPool.release` (only with ``set(..., hold_replaced=True)``), else ``None``.
    """

    key: str
    slot: int
    addr: int
    rkey: int
    length: int
    generation: int
    replaced: int | None = None

    @property
    def read_length(self) -> int:
        """Bytes a reader must fetch: header plus payload."""
        return SLOT_HEADER_SIZE + self.length


@dataclass(frozen=True)
class EvictedPage:
    """Given to the eviction callback: the page that left the pool."""

    key: str
    slot: int
    generation: int
    length: int


@dataclass
class _Live:
    slot: int
    generation: int
    length: int


class PublishedPool:
    """Fixed-slot host pool with LRU eviction and self-verifying slots.

    Parameters
    ----------
    capacity_bytes:
        Size of the region; ``capacity_bytes // stride`` slots (at least one).
    page_size:
        Largest payload per slot, in bytes.
    registrar:
        Registers the region (a transport). ``None``: the region is local only and its
        :class:`LocalRegion` has ``rkey`` 0.
    on_evict:
        Called with an :class:`EvictedPage` for every page the LRU pushes out, after the
        pool lock is released. Exceptions propagate to the ``set`` that caused the eviction
        (after the pool state is consistent), so a broken callback is noticed.
    generations:
        Source of write generations (called under the pool lock; must never repeat nor
        return 0). A node shares one increasing source among its pools, so that the
        directory's "newer generation wins" also orders pages of different pools. Default:
        the pool's own counter.

    Thread-safe. ``set`` reserves a slot under the lock and copies (or compares) outside it,
    so writers work in parallel; local reads copy under the lock.

    >>> pool = PublishedPool(4 * 128, 64)
    >>> loc = pool.set("k", b"hello")
    >>> pool.get("k"), loc.length
    (b'hello', 5)
    """

    def __init__(
        self,
        capacity_bytes: int,
        page_size: int,
        *,
        registrar: Registrar | None = None,
        on_evict: Callable[[EvictedPage], None] | None = None,
        generations: Callable[[], int] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.stride = -(-(SLOT_HEADER_SIZE + self.page_size) // SLOT_ALIGN) * SLOT_ALIGN
        self.num_slots = int(capacity_bytes) // self.stride
        if self.num_slots < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no slot of {self.stride} bytes "
                f"(page_size={page_size} + {SLOT_HEADER_SIZE}-byte header)"
            )
        raw = np.zeros(self.num_slots * self.stride + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096  # page-align the region (registration likes it)
        self._buf = raw[start : start + self.num_slots * self.stride]
        self._raw = raw  # keeps the allocation alive
        self._registrar = registrar
        self.region: RegionLike = (
            registrar.register(self._buf)
            if registrar is not None
            else LocalRegion(int(self._buf.ctypes.data), 0, int(self._buf.nbytes))
        )
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Live] = OrderedDict()  # LRU order: oldest first
        # Free slots, reused oldest-freed first: a slot freed by a republish keeps its old
        # page readable for as long as possible (slot 0 is handed out first).
        self._free: deque[int] = deque(range(self.num_slots))
        self._held: set[int] = set()  # replaced slots waiting for release()
        self._writing = 0
        self._next_generation = generations if generations is not None else itertools.count(1).__next__
        self._used = 0
        self.evictions = 0
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def capacity_bytes(self) -> int:
        """Payload capacity: ``num_slots * page_size``."""
        return self.num_slots * self.page_size

    @property
    def used_bytes(self) -> int:
        """Payload bytes of the published pages."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        """Published keys, least recently used first. Runtime complexity: ``O(n)``."""
        with self._lock:
            return list(self._index)

    def _slot_addr(self, slot: int) -> int:
        return self.region.addr + slot * self.stride

    def _loc(self, key: str, live: _Live, replaced: int | None = None) -> SlotLocation:
        addr = self._slot_addr(live.slot)
        return SlotLocation(key, live.slot, addr, self.region.rkey, live.length, live.generation, replaced)

    def _holds(self, live: _Live, src: np.ndarray) -> bool:
        """Whether ``live``'s slot holds exactly ``src`` (memcmp, without the lock: the
        caller re-checks that ``live`` is still the key's publication afterwards)."""
        if live.length != src.nbytes:
            return False
        at = int(self._buf.ctypes.data) + live.slot * self.stride + SLOT_HEADER_SIZE
        return _memcmp(at, int(src.ctypes.data), live.length) == 0

    # ------------------------------------------------------------------ write
    def set(self, key: str, data: Any, *, hold_replaced: bool = False) -> SlotLocation | None:
        """Copy ``data`` (any C-contiguous buffer) into a slot and return where it lives.

        A key already published with the same bytes is only touched and its current
        location returned (same generation). With other bytes the page goes to another
        slot and the key switches to it; the superseded slot is freed afterwards (to the
        back of the free list, its bytes intact), or with ``hold_replaced`` kept until
        :meth:`release` of the returned ``replaced`` slot. Concurrent sets of one key: the
        last to finish is the key's page. Returns ``None`` when every slot is being
        written by other threads. ``ValueError`` if ``data`` is empty or larger than
        ``page_size``.

        Runtime complexity: ``O(len(data))`` for the compare, copy and CRC, ``O(1)`` otherwise.
        """
        if self._closed:
            raise RuntimeError("pool is closed")
        src = np.frombuffer(data, dtype=np.uint8)
        n = int(src.nbytes)
        if not 0 < n <= self.page_size:
            raise ValueError(f"page of {n} bytes does not fit a slot (1..{self.page_size} bytes)")
        with self._lock:
            seen = self._index.get(key)
            if seen is not None:
                self._index.move_to_end(key)  # also keeps it from being its own eviction victim
        if seen is not None and self._holds(seen, src):
            with self._lock:
                if self._index.get(key) is seen:  # still that publication: the compare stands
                    return self._loc(key, seen)
        evicted: EvictedPage | None = None
        with self._lock:
            if self._free:
                slot = self._free.popleft()
            elif self._index:
                old_key, old = self._index.popitem(last=False)
                slot = old.slot
                self._used -= old.length
                self.evictions += 1
                evicted = EvictedPage(old_key, old.slot, old.generation, old.length)
            else:
                return None
            gen = self._next_generation()
            self._writing += 1
            off = slot * self.stride
            # Invalidate before the payload changes: a reader of the old generation that
            # copies the header from now on fails; one that copied it earlier fails the CRC.
            self._buf[off : off + SLOT_HEADER_SIZE] = 0
        try:
            body = self._buf[off + SLOT_HEADER_SIZE : off + SLOT_HEADER_SIZE + n]
            body[:] = src
            self._buf[off : off + SLOT_HEADER_SIZE] = np.frombuffer(pack_header(key, gen, body), dtype=np.uint8)
        except BaseException:
            with self._lock:
                self._writing -= 1
                self._free.append(slot)
            if evicted is not None and self._on_evict is not None:
                self._on_evict(evicted)  # the old page is gone either way
            raise
        replaced: int | None = None
        with self._lock:
            self._writing -= 1
            prev = self._index.pop(key, None)
            live = _Live(slot, gen, n)
            self._index[key] = live  # the switch: from now on the key is this slot
            self._used += n
            if prev is not None:
                # Freed only now, bytes intact: a reader of the old location still verifies
                # the old page until the slot is reused (and then misses, never wrong bytes).
                self._used -= prev.length
                if hold_replaced:
                    self._held.add(prev.slot)
                    replaced = prev.slot
                else:
                    self._free.append(prev.slot)
            loc = self._loc(key, live, replaced)
        if evicted is not None and self._on_evict is not None:
            self._on_evict(evicted)
        return loc

    def release(self, slot: int) -> None:
        """Free ``slot``, which a ``set(..., hold_replaced=True)`` returned as ``replaced``,
        once nothing names it any more (the directory entry has switched). Its bytes stay
        intact until it is reused. ``ValueError`` if the slot is not held.

        Runtime complexity: ``O(1)``.
        """
        with self._lock:
            if slot not in self._held:
                raise ValueError(f"slot {slot} is not held")
            self._held.remove(slot)
            self._free.append(slot)

    def delete(self, key: str) -> bool:
        """Unpublish ``key`` and free its slot (no eviction callback: the caller is acting).

        Runtime complexity: ``O(1)``.
        """
        with self._lock:
            live = self._index.pop(key, None)
            if live is None:
                return False
            off = live.slot * self.stride
            self._buf[off : off + SLOT_HEADER_SIZE] = 0
            self._free.append(live.slot)
            self._used -= live.length
            return True

    # ------------------------------------------------------------------ local reads
    def location(self, key: str, touch: bool = True) -> SlotLocation | None:
        """Where ``key`` lives, or ``None``; ``touch`` marks it recently used.

        Runtime complexity: ``O(1)``.
        """
        with self._lock:
            live = self._index.get(key)
            if live is None:
                return None
            if touch:
                self._index.move_to_end(key)
            return self._loc(key, live)

    def get(self, key: str) -> bytes | None:
        """A copy of ``key``'s page, or ``None`` (touches it). Runtime: ``O(length)``."""
        with self._lock:
            live = self._index.get(key)
            if live is None:
                return None
            self._index.move_to_end(key)
            off = live.slot * self.stride + SLOT_HEADER_SIZE
            return self._buf[off : off + live.length].tobytes()

    def read_into(self, key: str, out: Any, *, exact: bool = False) -> int | None:
        """Copy ``key``'s page into the writable buffer ``out``; bytes copied or ``None``.

        ``exact``: a page whose length is not ``len(out)`` is ``None`` (a miss: the caller
        trusted a directory entry of another length). Otherwise ``ValueError`` if ``out`` is
        too small. Runtime complexity: ``O(length)``.
        """
        dst = np.frombuffer(out, dtype=np.uint8)
        with self._lock:
            live = self._index.get(key)
            if live is None or (exact and live.length != dst.nbytes):
                return None
            if dst.nbytes < live.length:
                raise ValueError(f"destination of {dst.nbytes} bytes is smaller than the page ({live.length})")
            self._index.move_to_end(key)
            off = live.slot * self.stride + SLOT_HEADER_SIZE
            dst[: live.length] = self._buf[off : off + live.length]
            return live.length

    def slot_view(self, slot: int) -> memoryview:
        """The raw bytes of ``slot`` (header and payload), live and unlocked: exactly what a
        remote READ sees. For the TCP responder, tests and diagnostics.

        Runtime complexity: ``O(1)``.
        """
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        off = slot * self.stride
        return memoryview(self._buf[off : off + self.stride])  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[SlotLocation]:
        with self._lock:
            locs = [self._loc(k, v) for k, v in self._index.items()]
        return iter(locs)

    def free_slots(self) -> list[int]:
        """The free slots, in the order they will be reused. ``O(num_slots)``."""
        with self._lock:
            return list(self._free)

    def held_slots(self) -> list[int]:
        """Slots replaced by a ``set(..., hold_replaced=True)`` and not yet released,
        ascending. ``O(held)``."""
        with self._lock:
            return sorted(self._held)

    def check_invariants(self, *, quiescent: bool = True) -> None:
        """Raise ``AssertionError`` unless the pool's state is consistent: every slot is
        exactly one of published, free, held or being written; published pages fit their
        slot and add up to :attr:`used_bytes`; with ``quiescent`` (no ``set`` running),
        nothing is being written and every published slot verifies as its key at its
        generation (header and CRC, as a remote reader checks it).
        ``O(num_slots + published bytes)``: for tests and debugging."""
        with self._lock:
            live = list(self._index.items())
            free, held, writing, used = list(self._free), set(self._held), self._writing, self._used
        published = [v.slot for _, v in live]
        every = published + free + sorted(held)
        assert len(set(every)) == len(every), "a slot is published, free or held twice"
        assert all(0 <= slot < self.num_slots for slot in every), "a slot number out of range"
        assert len(every) + writing == self.num_slots, (
            f"{len(published)} published + {len(free)} free + {len(held)} held + {writing} being written "
            f"!= {self.num_slots} slots"
        )
        assert all(0 < v.length <= self.page_size and v.generation > 0 for _, v in live), "a bad page record"
        assert used == sum(v.length for _, v in live), f"used_bytes {used} != the published pages' bytes"
        if quiescent:
            assert writing == 0, f"{writing} writes in flight in a quiescent pool"
            for key, v in live:
                raw = self.slot_view(v.slot)[: SLOT_HEADER_SIZE + v.length]
                assert verify_slot(raw, key, v.generation, v.length) is not None, (
                    f"slot {v.slot} does not verify as {key!r} at generation {v.generation}"
                )

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Deregister the region (waiting for reads in flight, per the transport) and refuse
        further writes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._registrar is not None:
            self._registrar.deregister(self.region.rkey, timeout)

    def __enter__(self) -> PublishedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
