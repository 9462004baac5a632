"""The read side of a peer-cache node: every path a page takes into the caller's memory.

:class:`Reader` serves :meth:`~hiradix.peer.node.PeerNode.read_into` and
:meth:`~hiradix.peer.node.PeerNode.read_pages`: one directory lookup (one RPC per owner),
then per page one of

- a zero-length page: a hit with no bytes;
- a page this node publishes itself: a memcpy out of its own pool (promoting it from disk
  first when it is only there), through the :class:`~hiradix.peer.producer.Producer`;
- a page whose producer holds it on disk only: a ``data_promote`` RPC to that producer
  first, then a remote read of the fresh location;
- a remote page: one batch READ per producer (:meth:`Reader._fetch`), verified as it lands.

A remote read lays its slots out in one of two ways (a *plan*), and one routine runs both:

- *in place* (:class:`_InPlace`), when the destination lies inside a local receive region
  (the host KV pool, :meth:`Reader.register_receive`): each slot is two READ items, its
  64-byte header into a receive lane and its payload straight into the page, verified there;
- *staged* (:class:`_Staged`), for any other destination: the whole slot into a receive
  lane, verified, then its payload copied out.

A read that fails in any way (no entry, another length, producer gone, READ failed, slot
stale or torn) is a miss, never a hit with wrong bytes; a slot that did not verify is
counted in :attr:`Reader.stale_reads`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hiradix._native import load
from hiradix.peer.directory import NO_PRODUCER, DirectoryView, DirEntry
from hiradix.peer.keyhash import key_digests
from hiradix.peer.pool import SLOT_HEADER_SIZE, verify_parts
from hiradix.transport.base import Status, Transport, view_at

if TYPE_CHECKING:
    from hiradix.net.rpc import RpcClient
    from hiradix.peer.membership import Membership
    from hiradix.peer.metrics import PeerMetrics
    from hiradix.peer.producer import Producer

__all__ = ["Reader", "ReaderSettings", "ReceiveRegion"]

log = logging.getLogger(__name__)

_verify: Any = load("hiradix.peer._verify")


def _chunk_bounds(ends: list[int], half: int) -> list[int]:
    """Cut slots with cumulative end offsets ``ends`` into runs of at most ``half`` bytes:
    the start index of every run, then ``len(ends)``. Every slot fits ``half`` on its own.

    >>> _chunk_bounds([10, 20, 30, 40, 45], 20)
    [0, 2, 4, 5]
    """
    bounds = [0]
    base = 0
    for j, end in enumerate(ends):
        if end - base > half:
            bounds.append(j)
            base = ends[j - 1]
    bounds.append(len(ends))
    return bounds


def _verify_copy(
    chunk: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    gens: np.ndarray,
    digests: np.ndarray,
    dsts: np.ndarray,
    good: np.ndarray,
    keys: list[str],
) -> int:
    """Verify every slot of a fetched chunk and copy the good payloads out; ``good`` is
    updated in place, the count of stale slots returned. Compiled: one GIL-free call
    (:func:`hiradix.peer._verify.verify_copy`); pure Python: :func:`verify_parts` per slot."""
    if _verify is not None:
        return int(_verify.verify_copy(chunk, offs, lens, gens, digests, dsts, good))
    stale = 0
    for j in range(len(offs)):
        if not good[j]:
            continue
        o, n = int(offs[j]), int(lens[j])
        head = chunk[o : o + SLOT_HEADER_SIZE]
        body = chunk[o + SLOT_HEADER_SIZE : o + SLOT_HEADER_SIZE + n]
        if verify_parts(head, body, keys[j], int(gens[j]), n):
            ctypes.memmove(int(dsts[j]), body.ctypes.data, n)
        else:
            good[j] = 0
            stale += 1
    return stale


def _verify_inplace(
    heads: np.ndarray,
    lens: np.ndarray,
    gens: np.ndarray,
    digests: np.ndarray,
    dsts: np.ndarray,
    good: np.ndarray,
    keys: list[str],
) -> int:
    """Verify slots whose headers were READ into ``heads`` (64 bytes each, in order) and
    whose payloads already lie at ``dsts``; ``good`` is updated in place, the count of
    stale slots returned. Compiled: :func:`hiradix.peer._verify.verify_inplace`."""
    if _verify is not None:
        return int(_verify.verify_inplace(heads, lens, gens, digests, dsts, good))
    stale = 0
    for j in range(len(lens)):
        if not good[j]:
            continue
        n = int(lens[j])
        head = heads[j * SLOT_HEADER_SIZE : (j + 1) * SLOT_HEADER_SIZE]
        if not verify_parts(head, view_at(int(dsts[j]), n), keys[j], int(gens[j]), n):
            good[j] = 0
            stale += 1
    return stale


class ReceiveRegion:
    """The registered buffer remote READs land in, cut into lanes leased one per read.

    Registered as a *local receive* region (``remote=False``): it is a destination for this
    node's READs only, and a peer presenting its rkey gets ``BAD_RKEY``. Only the published
    pools are remotely readable.
    """

    def __init__(self, transport: Transport, nbytes: int, lanes: int) -> None:
        self.lane_bytes = max(nbytes // lanes, 1 << 16)
        raw = np.empty(self.lane_bytes * lanes + 4096, dtype=np.uint8)
        # Touch every page now: a first-touch page fault per 4 KiB in the middle of a READ
        # costs more than the copy itself (measured: 0.3-0.6 GB/s on a cold lane).
        raw.fill(0)
        start = (-raw.ctypes.data) % 4096
        self._raw = raw
        self.buf = raw[start : start + self.lane_bytes * lanes]
        self._transport = transport
        self.region = transport.register(self.buf, remote=False)
        self._cond = threading.Condition()
        self._lanes = lanes
        self._free = list(range(lanes - 1, -1, -1))  # a stack: the hottest lane is reused first
        self._closed = False

    def close(self, timeout: float = 5.0) -> None:
        """Lease no more lanes, wait up to ``timeout`` seconds for the leased ones, then
        deregister the region and let its memory go at once. The node object graph is
        full of bound-method cycles, so without this the region (touched on purpose,
        64 MiB by default) would live on until the cyclic garbage collector ran.
        Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            drained = self._cond.wait_for(lambda: len(self._free) == self._lanes, timeout)
        if not drained:
            return  # a read still writes into a lane: keep the memory alive for it
        with contextlib.suppress(Exception):  # the transport may be closed already
            self._transport.deregister(self.region.rkey, timeout)
        self.buf = self._raw = np.empty(0, dtype=np.uint8)

    @contextlib.contextmanager
    def lease(self, timeout: float) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free) or self._closed, timeout) or self._closed:
                raise queue.Empty  # no lane within the timeout, or closing: the caller misses
            lane = self._free.pop()
        try:
            off = lane * self.lane_bytes
            yield self.region.addr + off, memoryview(self.buf[off : off + self.lane_bytes])  # type: ignore[arg-type]
        finally:
            with self._cond:
                self._free.append(lane)
                if self._closed:
                    self._cond.notify_all()  # close() waits for the last lane
                else:
                    self._cond.notify()


class _Plan:
    """How the slots ``idx`` (rows of the directory records ``rec``) of one producer are
    laid out in a leased receive lane and READ, in rounds that each fit the lane.

    A round ``(r0, r1)`` covers the slots at positions ``r0:r1`` of :attr:`idx`;
    :meth:`items` gives its READ items (``per_slot`` consecutive ones per slot) and
    :meth:`check` verifies the slots of a round whose items all landed OK.
    """

    per_slot: int

    def __init__(
        self, idx: np.ndarray, rec: np.ndarray, keys: Sequence[str], addrs: np.ndarray, lens: np.ndarray
    ) -> None:
        self.idx = idx
        self.keys = keys
        self.plens = lens[idx]
        self.gens = rec["generation"][idx]
        self.digests = key_digests([keys[i] for i in idx.tolist()])
        self.dsts = addrs[idx]
        self.raddr = rec["addr"][idx]
        self.rkey = rec["rkey"][idx]

    def _keys_at(self, at: np.ndarray) -> list[str]:
        return [self.keys[i] for i in self.idx[at].tolist()]

    def rounds(self) -> Iterable[tuple[int, int]]:
        raise NotImplementedError

    def items(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(remote addrs, rkeys, lengths, local addrs)`` of the round's READ items."""
        raise NotImplementedError

    def check(self, r0: int, ready: np.ndarray, good: np.ndarray) -> int:
        """Verify the round's slots at positions ``ready`` (relative to ``r0``); sets
        ``good`` (one per ready slot) and returns how many did not verify."""
        raise NotImplementedError


class _Staged(_Plan):
    """Whole slots (header and payload) back to back in the lane, verified there and their
    payloads copied out. A slot larger than the lane can never be read: it is dropped
    from :attr:`idx` (a miss)."""

    per_slot = 1

    def __init__(
        self,
        idx: np.ndarray,
        rec: np.ndarray,
        keys: Sequence[str],
        addrs: np.ndarray,
        lens: np.ndarray,
        base: int,
        lane: memoryview,
    ) -> None:
        need = lens[idx] + SLOT_HEADER_SIZE
        fits = need <= len(lane)
        idx, self.need = idx[fits], need[fits]
        super().__init__(idx, rec, keys, addrs, lens)
        ends = np.cumsum(self.need)
        self.offs = ends - self.need
        self.bounds = _chunk_bounds(ends.tolist(), len(lane))
        self.base = base
        self.lane = np.frombuffer(lane, dtype=np.uint8)

    def rounds(self) -> Iterable[tuple[int, int]]:
        return itertools.pairwise(self.bounds)

    def items(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rel = self.offs[r0:r1] - self.offs[r0]
        return self.raddr[r0:r1], self.rkey[r0:r1], self.need[r0:r1], rel + self.base

    def check(self, r0: int, ready: np.ndarray, good: np.ndarray) -> int:
        at = r0 + ready
        return _verify_copy(
            self.lane,
            self.offs[at] - self.offs[r0],
            self.plens[at],
            self.gens[at],
            self.digests[at],
            self.dsts[at],
            good,
            self._keys_at(at),
        )


class _InPlace(_Plan):
    """Each slot as two items, its header into the lane and its payload straight into its
    destination page (inside a local receive region), then header and CRC verified in
    place. No copy. A slot that fails is a miss and its page holds unspecified bytes.

    Whatever order the two items land in, a rewrite of the slot is caught: the header is
    zeroed first and generations never repeat, and a header read before the rewrite with
    a payload read during it fails the CRC. Every header has its own place in the lane, so
    a batch is one READ (in rounds when it has more slots than the lane has places)."""

    per_slot = 2

    def __init__(
        self,
        idx: np.ndarray,
        rec: np.ndarray,
        keys: Sequence[str],
        addrs: np.ndarray,
        lens: np.ndarray,
        base: int,
        lane: memoryview,
    ) -> None:
        super().__init__(idx, rec, keys, addrs, lens)
        hsize = SLOT_HEADER_SIZE
        self.pair_raddr = np.stack([self.raddr, self.raddr + np.uint64(hsize)], axis=1).ravel()
        self.pair_rkey = np.repeat(self.rkey, 2)
        heads_len = np.full(len(idx), hsize, dtype=np.uint64)
        self.pair_len = np.stack([heads_len, self.plens.astype(np.uint64)], axis=1).ravel()
        self.per_round = len(lane) // hsize  # slots whose headers fit the lane together
        self.heads = np.frombuffer(lane, dtype=np.uint8)[: self.per_round * hsize].reshape(self.per_round, hsize)
        self.head_at = np.arange(self.per_round, dtype=np.uint64) * np.uint64(hsize) + np.uint64(base)

    def rounds(self) -> Iterable[tuple[int, int]]:
        n = len(self.idx)
        return ((r0, min(n, r0 + self.per_round)) for r0 in range(0, n, self.per_round))

    def items(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        laddr = np.stack([self.head_at[: r1 - r0], self.dsts[r0:r1]], axis=1).ravel()
        two = slice(2 * r0, 2 * r1)
        return self.pair_raddr[two], self.pair_rkey[two], self.pair_len[two], laddr

    def check(self, r0: int, ready: np.ndarray, good: np.ndarray) -> int:
        at = r0 + ready
        return _verify_inplace(
            self.heads[ready].ravel(),
            self.plens[at],
            self.gens[at],
            self.digests[at],
            self.dsts[at],
            good,
            self._keys_at(at),
        )


@dataclass(frozen=True)
class ReaderSettings:
    """What a :class:`Reader` needs of the node's settings
    (:meth:`PeerConfig.reader_settings <hiradix.peer.config.PeerConfig.reader_settings>`)."""

    #: Seconds before a batch READ, and a producer's promote of disk-resident pages, give
    #: up (their pages are misses).
    read_timeout_s: float = 10.0
    promote_timeout_s: float = 10.0
    #: Size of the receive region staged reads land in, and how many reads may use it at once.
    recv_bytes: int = 64 << 20
    recv_lanes: int = 4


class Reader:
    """Every read path of a node (module docstring).

    Parameters
    ----------
    node_id:
        This node's id (its own pages are read locally).
    settings:
        Read and promote timeouts, and the receive region's size and lanes.
    transport:
        The node's transport: READs, and the receive regions registered with it.
    directory, membership, client:
        Where entries are looked up, producers' addresses, and the RPC client that asks a
        producer to promote disk-resident pages.
    producer:
        This node's pages (local reads).
    metrics:
        Records every read.
    """

    def __init__(
        self,
        node_id: str,
        settings: ReaderSettings,
        transport: Transport,
        directory: DirectoryView,
        membership: Membership,
        client: RpcClient,
        producer: Producer,
        metrics: PeerMetrics,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.transport = transport
        self.directory = directory
        self.membership = membership
        self.client = client
        self.producer = producer
        self.metrics = metrics
        self._lock = threading.Lock()
        self.stale_reads = 0  # remote slots fetched that failed verification
        self.recv = ReceiveRegion(transport, settings.recv_bytes, settings.recv_lanes)
        #: Local receive regions (the caller's host KV pool): ``(start, end, handle)``.
        #: Payloads are READ straight into them; they are never served to peers.
        self._receive_spans: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ receive regions
    def register_receive(self, buffer: Any) -> int:
        """Register ``buffer`` (the host KV pool) as a *local receive* region: remote
        payloads are READ straight into it, then verified in place. It is never published:
        the transport refuses any peer read of it, and no directory entry names it.
        Returns a handle for :meth:`deregister_receive`. Runtime complexity: ``O(regions)``.
        """
        region = self.transport.register(buffer, remote=False)
        with self._lock:
            self._receive_spans.append((region.addr, region.addr + region.length, region.rkey))
        return region.rkey

    def close(self) -> None:
        """Release the receive region (reads from now on miss). Idempotent."""
        self.recv.close()

    def deregister_receive(self, handle: int, timeout: float | None = None) -> None:
        """Undo :meth:`register_receive` (waits for reads landing in it).
        Runtime complexity: ``O(regions)``."""
        with self._lock:
            self._receive_spans = [s for s in self._receive_spans if s[2] != handle]
        self.transport.deregister(handle, timeout)

    def _direct_mask(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Which destinations lie inside a local receive region."""
        mask = np.zeros(len(addrs), dtype=bool)
        ends = addrs + lens.astype(np.uint64)
        for lo, hi, _ in self._receive_spans:
            mask |= (addrs >= np.uint64(lo)) & (ends <= np.uint64(hi))
        return mask

    # ------------------------------------------------------------------ reads
    def read_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[bool]:
        """Fill each of ``outs`` (writable flat bytes) with its key's verified page.

        ``False`` for a miss: no entry, another length, owner or producer unreachable,
        promote failed, READ failed or the fetched slot did not verify (stale or torn).
        Runtime complexity: ``O(total bytes)`` plus one RPC per owner and one batch READ
        per producer.
        """
        arrays = [np.frombuffer(o, dtype=np.uint8) for o in outs]
        for a in arrays:
            if a.size and not a.flags.writeable:
                raise ValueError("read_into needs writable destinations")
        addrs = np.fromiter((a.ctypes.data for a in arrays), dtype=np.uint64, count=len(arrays))
        lens = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        return self.read_pages(keys, addrs, lens, hold=arrays).tolist()

    def read_pages(self, keys: Sequence[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any = None) -> np.ndarray:
        """:meth:`read_into` for raw destinations: page ``i`` (exactly ``lengths[i]`` bytes)
        goes to the address ``addrs[i]``, which the caller keeps writable and alive (``hold``
        is kept referenced for the call). Returns a boolean array, one per key.

        This is the batch path of ``batch_get_v1``: no per-page Python objects besides the
        directory's wire lists; verification and copy run per READ chunk in one GIL-free
        call (:mod:`hiradix.peer._verify`), overlapped with the next chunk's READ.
        Runtime complexity: ``O(total bytes)`` plus one RPC per owner and one batch READ
        per producer.
        """
        t0 = time.perf_counter()
        n = len(keys)
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        lens = np.ascontiguousarray(lengths, dtype=np.int64)
        if addrs.shape != (n,) or lens.shape != (n,):
            raise ValueError(f"{n} keys need {n} addresses and lengths")
        ok = np.zeros(n, dtype=bool)
        cols = self.directory.batch_get_columns(keys)
        rec = cols.records
        node = rec["node"].astype(np.int64)
        hit = (node != NO_PRODUCER) & (rec["length"] == lens.astype(np.uint64))
        ok[hit & (lens == 0)] = True
        live = hit & (lens > 0)
        me = cols.node_index(self.node_id)
        for i in np.flatnonzero(live & (node == me)).tolist():
            entry = cols.entry(i)
            assert entry is not None
            ok[i] = self._read_local(keys[i], entry, view_at(int(addrs[i]), int(lens[i])))
        away = live & (node != me)
        cold = away & (rec["resident"] == 0)
        for j in np.unique(node[cold]).tolist():
            self._promote_for_read(cols.nodes[j], j, np.flatnonzero(cold & (node == j)), keys, rec)
        remote = away & (rec["resident"] != 0)  # promoted pages are resident now
        direct = self._direct_mask(addrs, lens) if remote.any() and self._receive_spans else np.zeros(n, dtype=bool)
        for j in np.unique(node[remote]).tolist():
            on = remote & (node == j)
            for in_place in (True, False):
                sel = on & direct if in_place else on & ~direct
                if sel.any():
                    self._fetch(cols.nodes[j], np.flatnonzero(sel), rec, keys, addrs, lens, ok, in_place)
        hits = int(ok.sum())
        self.metrics.record_read(n, hits, int(lens[ok].sum()), time.perf_counter() - t0)
        del hold
        return ok

    def _promote_for_read(self, node: str, j: int, idx: np.ndarray, keys: Sequence[str], rec: np.ndarray) -> None:
        """Ask ``node`` to bring the disk-resident pages ``idx`` back into its pool; the rows
        of ``rec`` that it promoted (same node, same length) are updated in place."""
        info = self.membership.info(node)
        if info is None:
            return
        try:
            fresh = self.client.call(
                info.rpc, "data_promote", [keys[i] for i in idx.tolist()], timeout=self.settings.promote_timeout_s
            )
        except Exception as exc:  # an unreachable owner: its pages are misses
            log.debug("promote on %s failed: %r", node, exc)
            return
        if not isinstance(fresh, list) or len(fresh) != len(idx):
            return
        for i, w in zip(idx.tolist(), fresh, strict=True):
            with contextlib.suppress(ValueError):
                if w is not None:
                    e = DirEntry.from_wire(w)
                    if e.length == int(rec["length"][i]) and e.node == node:
                        rec[i] = (j, True, 0, e.rkey, e.addr, e.length, e.generation)

    def _read_local(self, key: str, entry: DirEntry, out: memoryview) -> bool:
        if not entry.resident:
            promoted = self.producer.promote_local(key)
            if promoted is None:
                return False
            entry = promoted
        pool = self.producer.pool_holding(entry)
        if pool is None:
            return False
        # exact: an entry whose length is not the page's is this key's miss, never the batch's
        return pool.read_into(key, out, exact=True) == len(out)

    def _fetch(
        self,
        node: str,
        idx: np.ndarray,
        rec: np.ndarray,
        keys: Sequence[str],
        addrs: np.ndarray,
        lens: np.ndarray,
        ok: np.ndarray,
        in_place: bool,
    ) -> None:
        """READ the slots of ``idx`` (rows of ``rec``) from ``node`` through a leased
        receive lane, in place (:class:`_InPlace`) or staged (:class:`_Staged`), a round
        of the plan per READ, and set ``ok`` for those that verified. No lane within the
        read timeout, or ``node`` not a live member: all of them are misses."""
        info = self.membership.info(node)
        if info is None:
            return  # not a live member: its pages are misses
        timeout = self.settings.read_timeout_s
        try:
            with self.recv.lease(timeout) as (base, lane):
                plan = (_InPlace if in_place else _Staged)(idx, rec, keys, addrs, lens, base, lane)
                if not plan.idx.size:
                    return  # every slot larger than a lane
                stale = 0
                for r0, r1 in plan.rounds():
                    raddr, rkey, length, laddr = plan.items(r0, r1)
                    check = functools.partial(plan.check, r0)
                    stale += self._read_verified(
                        info.data, timeout, plan.idx[r0:r1], plan.per_slot, raddr, rkey, length, laddr, check, ok
                    )
                if stale:
                    with self._lock:
                        self.stale_reads += stale
        except queue.Empty:
            log.debug("no receive lane free within %ss: %d reads from %s are misses", timeout, len(idx), node)

    def _read_verified(
        self,
        peer: str,
        timeout: float,
        idx: np.ndarray,
        per_slot: int,
        raddr: np.ndarray,
        rkey: np.ndarray,
        length: np.ndarray,
        laddr: np.ndarray,
        check: Callable[[np.ndarray, np.ndarray], int],
        ok: np.ndarray,
    ) -> int:
        """One READ of ``len(idx)`` slots of ``per_slot`` consecutive items each. A slot is
        checked as soon as all of its items have landed OK (the transport's ``on_landed``:
        on TCP once per frame, from the reader thread, while later frames are still on the
        wire and the bytes in cache): ``check(slots, good)`` gets the slot positions, sets
        ``good`` (all ones on entry) and returns how many did not verify. Sets ``ok[idx]``
        and returns the count of slots read that did not verify."""
        m = len(idx)
        lock = threading.Lock()
        landed = np.zeros(m, dtype=np.uint8)  # items of each slot that landed OK
        good = np.zeros(m, dtype=np.uint8)
        stale = [0]

        def on_landed(items: np.ndarray, statuses: np.ndarray) -> None:
            slots = items[statuses == Status.OK] // per_slot
            with lock:
                np.add.at(landed, slots, 1)
                ready = np.unique(slots[landed[slots] == per_slot])
                landed[ready] = per_slot + 1  # taken: checked once
            if not ready.size:
                return
            g = np.ones(ready.size, dtype=np.uint8)
            bad = check(ready, g)
            with lock:
                good[ready] = g
                stale[0] += bad

        self.transport.read_batch_arrays(peer, raddr, rkey, length, laddr, timeout=timeout, on_landed=on_landed)
        ok[idx] = good.view(bool)
        return stale[0]
