"""HiCacheController: queues, copy engines and cross-rank agreement for L1 <-> L2 moves.

The controller moves bytes; it never decides what to move (the tree does) and never
touches the tree (the cache does). Its parts:

- **Write queue -> one backup.** :meth:`HiCacheController.write` queues one node's
  device -> host copy; :meth:`start_writing` merges everything queued into one copy-engine
  operation (one pass over the layers, whatever the number of nodes) and appends a
  :class:`TransferAck` to the write-ack queue.
- **Load queue -> one load.** :meth:`load` queues a host -> device copy; the scheduler's
  ``ready_to_load_host_cache`` calls :meth:`start_loading` just before the forward pass,
  which merges the queue into one layer-by-layer load and registers it with the
  :class:`LayerDoneCounter` the model waits on (``wait_until(layer)``).
- **Two engines.** Writes and loads run on separate engines (SGLang's write and load
  streams), so a load the forward pass is waiting for never queues behind a large backup.
- **Companion pools.** :meth:`HiCacheController.add_companion` adds a pair of pools whose
  KV follows the main pair slot for slot (SGLang's separate draft model for speculative
  decoding keeps its own KV at the target's token slots). Every backup and load also moves
  the companions' KV, submitted first on the same engine: engines complete in submission
  order, so a load's layer events (which the forward pass waits on) imply the companions'
  KV is in place, and an ack covers every pool.
- **Agreement.** With several ranks, the acks are consumed only as far as every rank has
  finished (:meth:`ack_writes` / :meth:`ack_loads`: MIN over the finished counts, then
  AND over the copy outcomes), and host allocations are kept only if every rank got
  them (:meth:`alloc_host`). The number of agreement calls depends only on agreed values,
  never on a rank-local one, so no rank can skip a collective the others make.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hiradix.cache.distributed import LocalAgreement, RankAgreement
from hiradix.cache.stats import ControllerStats, zeros
from hiradix.memory.copy import (
    CopyEngine,
    CopyError,
    CopyHandle,
    LayerHook,
    LoadHandle,
    ThreadCopyEngine,
    as_index_array,
    make_copy_engine,
)
from hiradix.memory.pools import DeviceKVPool, HostKVPool

logger = logging.getLogger(__name__)

__all__ = [
    "CacheOperation",
    "HiCacheController",
    "LayerDoneCounter",
    "LayerLoadingEvent",
    "OperationBatch",
    "TransferAck",
]


def _wait_finished(handle: CopyHandle) -> None:
    """Block until ``handle`` has finished; a failure is read later from ``handle.error``
    (and agreed across ranks), so it is not raised here."""
    with contextlib.suppress(CopyError):
        handle.wait()


def _as_long(indices: Any) -> torch.Tensor:
    """Indices as an int64 CPU tensor, without a conversion where they already are one
    (or an int64 numpy array, which the tree returns: a view, not a copy). The write
    path runs this twice per backed-up node on the scheduler thread, and the general
    conversions cost about 1 (``.to``) and 2.7 us (``as_tensor``) each."""
    if (
        type(indices) is np.ndarray
        and indices.dtype == np.int64
        and indices.flags.c_contiguous
        and indices.flags.writeable
    ):
        return torch.from_numpy(indices)
    if isinstance(indices, torch.Tensor):
        if indices.dtype is torch.int64 and indices.is_cpu:
            return indices
        return indices.to(dtype=torch.int64, device="cpu")
    return torch.as_tensor(indices, dtype=torch.int64)


def _merged(batches: Sequence[OperationBatch]) -> OperationBatch:
    """``batches`` as one, node after node (one batch: itself; the engines copy what they
    keep). Numpy indices stay numpy (the write path's), anything else becomes a tensor."""
    if len(batches) == 1:
        return batches[0]
    nodes: list[int] = []
    bounds = [0]
    for b in batches:
        nodes.extend(b.nodes)
        base = bounds[-1]
        bounds.extend(base + e for e in b.bounds[1:])
    if all(type(b.device_indices) is np.ndarray and type(b.host_indices) is np.ndarray for b in batches):
        dev: Any = np.concatenate([b.device_indices for b in batches])
        host: Any = np.concatenate([b.host_indices for b in batches])
    else:
        dev = torch.cat([_as_long(b.device_indices) for b in batches])
        host = torch.cat([_as_long(b.host_indices) for b in batches])
    return OperationBatch(tuple(nodes), tuple(bounds), dev, host)


def _check_pair(kind: str, dev: Any, host: Any) -> None:
    if dev.ndim != 1 or host.ndim != 1:
        raise ValueError(f"{kind}: indices must be 1-D, got shapes {tuple(dev.shape)} and {tuple(host.shape)}")
    if dev.shape[0] != host.shape[0]:
        raise ValueError(f"{kind}: {dev.shape[0]} device indices for {host.shape[0]} host indices")


@dataclass(frozen=True, slots=True)
class CacheOperation:
    """One node's transfer: ``device_indices[i]`` pairs with ``host_indices[i]``."""

    node: int
    device_indices: torch.Tensor
    host_indices: torch.Tensor


@dataclass(frozen=True, slots=True)
class OperationBatch:
    """The transfers of several nodes, node after node: ``nodes[i]`` owns rows
    ``bounds[i]:bounds[i + 1]`` of the 1-D int64 index arrays (numpy on the write path,
    tensors where they were given so; ``device_indices[j]`` pairs with
    ``host_indices[j]``). One object per step's worth of backups, however many nodes:
    the per-node views are made only when someone asks (:meth:`ops`)."""

    nodes: tuple[int, ...]
    bounds: tuple[int, ...]
    device_indices: Any
    host_indices: Any

    def ops(self) -> tuple[CacheOperation, ...]:
        """One :class:`CacheOperation` per node, with int64 CPU tensors (views where the
        indices are). ``O(nodes)``."""
        dev, host = _as_long(self.device_indices), _as_long(self.host_indices)
        b = self.bounds
        return tuple(CacheOperation(n, dev[b[i] : b[i + 1]], host[b[i] : b[i + 1]]) for i, n in enumerate(self.nodes))


@dataclass(slots=True)
class TransferAck:
    """One merged transfer on the ack queue: its nodes' batch (in queue order), its
    handle, and the handles of the same transfer on the companion pools (submitted
    before it)."""

    ack_id: int
    batch: OperationBatch
    handle: CopyHandle
    companions: tuple[CopyHandle, ...] = ()

    @property
    def nodes(self) -> tuple[int, ...]:
        return self.batch.nodes

    @property
    def ops(self) -> tuple[CacheOperation, ...]:
        """The per-node operations (:meth:`OperationBatch.ops`). ``O(nodes)``."""
        return self.batch.ops()

    def done(self) -> bool:
        """Whether the copy finished, successfully or not, in every pool. Never blocks.
        ``O(companions)``."""
        if not self.handle.done():
            return False
        return not self.companions or all(h.done() for h in self.companions)

    @property
    def ok(self) -> bool:
        """Whether the copy landed completely in every pool (only meaningful once
        :meth:`done`)."""
        return (
            self.done()
            and self.handle.error is None
            and (not self.companions or all(h.error is None for h in self.companions))
        )

    def wait(self) -> None:
        """Block until the copy has finished in every pool (a failure is read from
        :attr:`ok`, not raised)."""
        for h in (*self.companions, self.handle):
            _wait_finished(h)

    @property
    def tokens(self) -> int:
        return int(self.batch.host_indices.shape[0])


class LayerLoadingEvent:
    """One slot of the :class:`LayerDoneCounter` (SGLang's ``LayerLoadingEvent``): the
    load bound to it, if any. ``finish_event`` is the slot itself, so SGLang's
    ``events[i].finish_event.query()`` / ``.synchronize()`` work unchanged."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle: LoadHandle | None = None

    @property
    def finish_event(self) -> LayerLoadingEvent:
        return self

    def query(self) -> bool:
        """Whether the bound load has finished (successfully or not). Never blocks."""
        return self.handle is None or self.handle.done()

    def synchronize(self) -> None:
        """Block until the bound load has finished (a failure is read from its ack)."""
        if self.handle is not None:
            _wait_finished(self.handle)

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` of the bound load is usable."""
        if self.handle is not None:
            self.handle.wait_until(layer, timeout)


class LayerDoneCounter:
    """Layer-wise completion of the loads the forward pass consumes, with SGLang's contract
    (``sglang.srt.managers.cache_controller.LayerDoneCounter``), so SGLang's attention
    backends and memory pools wait on it unchanged:

    - :meth:`update_producer` binds a new load to the next of ``num_counters`` rotating
      slots and returns the slot's index (the batch's ``hicache_consumer_index``);
    - :meth:`set_consumer` selects the slot of the batch being run (``-1``: none);
    - :meth:`wait_until` blocks until layer ``threshold`` of that load has landed;
    - :meth:`reset` forgets both indices; ``events[i].finish_event.query()`` tells
      whether slot ``i``'s load is done.

    Three slots, as SGLang: one load being consumed, one being prepared, one in flight
    with overlap scheduling. Where SGLang asserts that a slot being reused is finished,
    this waits for it, so a fourth load in flight costs a wait, never a corrupted
    consumer.
    """

    def __init__(self, num_layers: int, num_counters: int = 3) -> None:
        if num_layers < 1 or num_counters < 1:
            raise ValueError(f"num_layers and num_counters must be >= 1, got {num_layers}, {num_counters}")
        self.num_layers = num_layers
        self.num_counters = num_counters
        self.events = [LayerLoadingEvent() for _ in range(num_counters)]
        self.producer_index = -1
        self.consumer_index = -1

    @property
    def layer_num(self) -> int:
        return self.num_layers

    def update_producer(self, handle: LoadHandle | None = None) -> int:
        """Bind ``handle`` to the next slot; returns the slot index. ``O(1)`` unless the
        slot's previous load is still running (then it waits for it)."""
        index = (self.producer_index + 1) % self.num_counters
        event = self.events[index]
        event.synchronize()
        event.handle = handle
        self.producer_index = index
        return index

    def set_consumer(self, index: int) -> None:
        """Make :meth:`wait_until` wait on slot ``index`` (``-1``: on nothing)."""
        if not -1 <= index < self.num_counters:
            raise IndexError(f"consumer index {index} out of range [-1, {self.num_counters})")
        self.consumer_index = index

    def wait_until(self, threshold: int, timeout: float | None = None) -> None:
        """Block until layer ``threshold`` of the consumer's load is usable; raises
        :class:`~hiradix.memory.copy.CopyError` if it failed to land."""
        if not 0 <= threshold < self.num_layers:
            raise IndexError(f"layer {threshold} out of range [0, {self.num_layers})")
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold, timeout)

    def reset(self) -> None:
        """Forget the producer and consumer indices (SGLang calls it on flush)."""
        self.producer_index = -1
        self.consumer_index = -1

    def retire(self, handle: LoadHandle) -> None:
        """Unbind a finished load (called when its ack is consumed). ``O(num_counters)``."""
        for event in self.events:
            if event.handle is handle:
                event.handle = None


_STAT_KEYS = {kind: (f"{kind}_tokens", f"{kind}_failed_tokens") for kind in ("backup", "load")}


@dataclass
class _Queue:
    pending: list[OperationBatch] = field(default_factory=list)
    acks: deque[TransferAck] = field(default_factory=deque)


class HiCacheController:
    """Moves KV between a device pool and a host pool for one rank.

    Parameters
    ----------
    device_pool, host_pool:
        The L1 and L2 pools (same shape, page size and dtype).
    agreement:
        Cross-rank agreement (:class:`~hiradix.cache.distributed.LocalAgreement` for one rank).
    write_engine, load_engine:
        Copy engines for backups and loads; by default one each from
        :func:`~hiradix.memory.copy.make_copy_engine` for the device pool's device.
    layer_hook:
        Passed to default CPU engines (a test seam, see
        :data:`~hiradix.memory.copy.LayerHook`).
    inline_copies:
        Build the default engines as ``ThreadCopyEngine(inline=True)``: every copy runs
        on the caller's thread when it is submitted (``start_writing`` /
        ``start_loading``), so a replay does not depend on thread timing. CPU pools only
        (``ValueError`` for a CUDA device pool); engines passed in are used as they are.
        Default engines, inline or not, are closed by :meth:`close`.
    inline_writes:
        Only the default *write* engine inline (as ``inline_copies``, CPU pools only):
        backups cost the caller their copy, and no thread hand-off, once per
        ``start_writing``, while loads keep their worker so that layer-wise loads still
        overlap the caller. What :mod:`hiradix.sglang` does on CPU pools, where SGLang
        copies in the scheduler thread too.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        agreement: RankAgreement | None = None,
        write_engine: CopyEngine | None = None,
        load_engine: CopyEngine | None = None,
        layer_hook: LayerHook | None = None,
        inline_copies: bool = False,
        inline_writes: bool = False,
    ) -> None:
        if (device_pool.shape, device_pool.page_size, device_pool.dtype) != (
            host_pool.shape,
            host_pool.page_size,
            host_pool.dtype,
        ):
            raise ValueError(
                f"device and host pools differ: {device_pool.shape}/{device_pool.page_size}/{device_pool.dtype} "
                f"vs {host_pool.shape}/{host_pool.page_size}/{host_pool.dtype}"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.agreement = agreement or LocalAgreement()
        kwargs: dict[str, Any] = {}
        if layer_hook is not None and device_pool.device.type != "cuda":
            kwargs["layer_hook"] = layer_hook
        if (inline_copies or inline_writes) and device_pool.device.type == "cuda":
            option = "inline_copies" if inline_copies else "inline_writes"
            raise ValueError(f"{option} runs copies on the caller's thread: CPU device pools only")
        if inline_copies:
            kwargs["inline"] = True
        self._owned: list[CopyEngine] = []
        if write_engine is None:
            write_kwargs = {**kwargs, "inline": True} if inline_writes else kwargs
            write_engine = make_copy_engine(device_pool.device, **write_kwargs)
            self._owned.append(write_engine)
        if load_engine is None:
            load_engine = make_copy_engine(device_pool.device, **kwargs)
            self._owned.append(load_engine)
        self.write_engine = write_engine
        self.load_engine = load_engine
        self.layer_done_counter = LayerDoneCounter(device_pool.layer_num)
        self._writes = _Queue()
        self._loads = _Queue()
        self._ack_ids = itertools.count()
        self._companions: list[tuple[DeviceKVPool, HostKVPool]] = []
        self._stats = zeros(ControllerStats)  # counted here; read as a snapshot (stats)
        self._durations: dict[str, deque[float]] = {k: deque(maxlen=1024) for k in ("backup", "load")}

    def get_stats(self) -> ControllerStats:
        """A snapshot of the acknowledged transfers' counters
        (:class:`~hiradix.cache.stats.ControllerStats`). ``O(counters)``."""
        return ControllerStats(**self._stats)

    @property
    def stats(self) -> dict[str, int]:
        """The same counters as a plain dict by name (a copy; the form they had before
        :meth:`get_stats`, kept for callers that read or serialize them so)."""
        return dataclasses.asdict(self.get_stats())

    def add_companion(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        """Move the KV of ``device_pool`` / ``host_pool`` along with every later backup and
        load, at the same device and host indices (see the module docstring). Both must
        have the main pools' page size and at least their slots, and match each other in
        shape and dtype; ``ValueError`` names what differs. ``O(1)``."""
        ps = self.device_pool.page_size
        if (device_pool.shape, device_pool.dtype) != (host_pool.shape, host_pool.dtype):
            raise ValueError(
                f"companion device and host pools differ: {device_pool.shape}/{device_pool.dtype} "
                f"vs {host_pool.shape}/{host_pool.dtype}"
            )
        if device_pool.page_size != ps or host_pool.page_size != ps:
            raise ValueError(f"companion pools have page size {device_pool.page_size}/{host_pool.page_size}, not {ps}")
        if device_pool.size < self.device_pool.size or host_pool.size < self.host_pool.size:
            raise ValueError(
                f"companion pools hold {device_pool.size}/{host_pool.size} slots, fewer than the main pools' "
                f"{self.device_pool.size}/{self.host_pool.size}: the indices are shared"
            )
        self._companions.append((device_pool, host_pool))

    @property
    def companions(self) -> tuple[tuple[DeviceKVPool, HostKVPool], ...]:
        """The ``(device, host)`` companion pairs, in the order they were added."""
        return tuple(self._companions)

    # ------------------------------------------------------------------ allocation
    def alloc_host(self, sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """Host slots for each of ``sizes`` tokens, kept only where *every* rank got them
        (int64 CPU tensors; :meth:`alloc_host_arrays` gives numpy views). ``O(tokens)``."""
        return [None if a is None else torch.from_numpy(a) for a in self.alloc_host_arrays(sizes)[0]]

    def alloc_host_arrays(self, sizes: Sequence[int]) -> tuple[list[np.ndarray | None], np.ndarray | None]:
        """Host slots for each of ``sizes`` tokens as int64 numpy arrays, kept only where
        *every* rank got them, and the whole allocation they are consecutive views of
        when one allocation served them all (else ``None``).

        One agreement call (none for an empty list). Where any rank failed, this rank's
        slots are freed again and ``None`` is returned, so all ranks see the same outcome.
        Runtime complexity: one allocation of the total when it fits (each size then gets
        a view of it: the write-through path, once per scheduler step), else
        ``O(len(sizes))`` allocations.
        """
        alloc = self.host_pool.alloc_array
        got: list[np.ndarray | None]
        whole = alloc(sum(sizes)) if len(sizes) > 1 else None
        if whole is not None:
            got, start = [], 0
            for n in sizes:
                got.append(whole[start : start + n])
                start += n
        else:
            got = [alloc(n) for n in sizes]
        agreed = self.agreement.all_true([True] * len(got) if whole is not None else [g is not None for g in got])
        if all(agreed):
            return got, whole if whole is not None else (got[0] if len(got) == 1 else None)
        out: list[np.ndarray | None] = []
        for slots, ok in zip(got, agreed, strict=True):
            if slots is not None and not ok:
                self.host_pool.free(slots)
                slots = None
            out.append(slots)
        return out, None

    # ------------------------------------------------------------------ writes
    def write(self, device_indices: Any, host_indices: Any, node: int = -1) -> CacheOperation:
        """Queue a device -> host copy for ``node``; returns the queued operation (its
        indices as int64 CPU tensors). ``O(1)``; see :meth:`start_writing`."""
        dev, host = _as_long(device_indices), _as_long(host_indices)
        _check_pair("write", dev, host)
        self._writes.pending.append(OperationBatch((node,), (0, dev.shape[0]), dev, host))
        return CacheOperation(node, dev, host)

    def write_many(
        self, nodes: Sequence[int], sizes: Sequence[int], device_indices: Any, host_indices: Any
    ) -> OperationBatch:
        """Queue the device -> host copies of ``nodes``, node after node: ``nodes[i]`` owns
        the next ``sizes[i]`` of the index pairs. One object for the lot (a scheduler
        step's write-throughs), so the per-node cost is a few list appends.
        ``O(len(nodes))``; see :meth:`start_writing`."""
        dev = as_index_array(device_indices, "device_indices")
        host = as_index_array(host_indices, "host_indices")
        _check_pair("write_many", dev, host)
        if len(nodes) != len(sizes):
            raise ValueError(f"write_many: {len(nodes)} nodes but {len(sizes)} sizes")
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        if bounds[-1] != dev.shape[0]:
            raise ValueError(f"write_many: sizes add up to {bounds[-1]}, not {dev.shape[0]} index pairs")
        batch = OperationBatch(tuple(nodes), tuple(bounds), dev, host)
        self._writes.pending.append(batch)
        return batch

    def start_writing(self) -> TransferAck | None:
        """Submit every queued write as one backup; ``None`` if nothing was queued.
        Runtime complexity: ``O(tokens)`` to merge the indices."""
        pending = self._writes.pending
        if not pending:
            return None
        batch = _merged(pending)
        self._writes.pending = []
        dev, host = batch.device_indices, batch.host_indices
        extra = tuple(self.write_engine.backup(d, h, dev, host) for d, h in self._companions)
        handle = self.write_engine.backup(self.device_pool, self.host_pool, dev, host)
        ack = TransferAck(next(self._ack_ids), batch, handle, extra)
        self._writes.acks.append(ack)
        return ack

    @property
    def writes_now(self) -> bool:
        """Whether :meth:`write_now` may copy: the write engine is an inline
        :class:`~hiradix.memory.copy.ThreadCopyEngine` and no write is queued unsubmitted
        (which a copy now would overtake). ``O(1)``."""
        engine = self.write_engine
        return isinstance(engine, ThreadCopyEngine) and engine.inline and not self._writes.pending

    def write_now(self, device_indices: Any, host_indices: Any) -> bool:
        """Copy device -> host on the caller's thread, the companion pools first, and
        agree the outcome: ``True`` only if the copy landed on every rank (one agreement
        call, so every rank must call it at the same point, as the cache does). A failed
        copy is logged and counted, never raised: its caller leaves the nodes as they
        were. Only while :attr:`writes_now` (``RuntimeError`` otherwise). Counted in
        :meth:`get_stats` as an acknowledged backup. ``O(tokens)``."""
        if not self.writes_now:
            raise RuntimeError("write_now needs an inline write engine and no queued write")
        dev = as_index_array(device_indices, "device_indices")
        host = as_index_array(host_indices, "host_indices")
        _check_pair("write_now", dev, host)
        engine = self.write_engine
        assert isinstance(engine, ThreadCopyEngine)
        ok = True
        start = time.perf_counter()
        try:
            for d, h in self._companions:
                engine.backup_now(d, h, dev, host)
            engine.backup_now(self.device_pool, self.host_pool, dev, host)
        except Exception:  # a failed copy is a failed backup, never an error in the scheduler
            logger.warning("hiradix: a backup of %d tokens failed", host.shape[0], exc_info=True)
            ok = False
        elapsed = time.perf_counter() - start
        ok = self.agreement.all_true([ok])[0]
        done_key, failed_key = _STAT_KEYS["backup"]
        self._stats[done_key if ok else failed_key] += int(host.shape[0])
        if ok:
            self._durations["backup"].append(elapsed)
        return ok

    def ack_writes(self, wait_all: bool = False) -> list[tuple[TransferAck, bool]]:
        """Pop the write acks that every rank has finished, each with its agreed outcome
        (``True`` only if the copy landed on every rank).

        ``wait_all`` waits for every queued backup first (write-back eviction). One or two
        agreement calls. Runtime complexity: ``O(acks)``.
        """
        return self._ack(self._writes, wait_all, "backup")

    # ------------------------------------------------------------------ loads
    def load(self, host_indices: Any, device_indices: Any, node: int = -1) -> None:
        """Queue a host -> device copy for ``node``. ``O(1)``; see :meth:`start_loading`."""
        dev, host = _as_long(device_indices), _as_long(host_indices)
        _check_pair("load", dev, host)
        self._loads.pending.append(OperationBatch((node,), (0, dev.shape[0]), dev, host))

    def start_loading(self) -> int:
        """Submit every queued load as one layer-by-layer load, register it with
        :attr:`layer_done_counter` and return its producer id (``-1``: nothing queued)."""
        pending = self._loads.pending
        if not pending:
            return -1
        batch = _merged(pending)
        self._loads.pending = []
        dev, host = batch.device_indices, batch.host_indices
        # Companions first: the engine is FIFO, so the layer events below imply them.
        extra = tuple(self.load_engine.load(h, d, host, dev) for d, h in self._companions)
        handle = self.load_engine.load(self.host_pool, self.device_pool, host, dev)
        self._loads.acks.append(TransferAck(next(self._ack_ids), batch, handle, extra))
        return self.layer_done_counter.update_producer(handle)

    def ack_loads(self, wait_all: bool = False) -> list[tuple[TransferAck, bool]]:
        """Pop the load acks every rank has finished, with agreed outcomes (see
        :meth:`ack_writes`)."""
        acks = self._ack(self._loads, wait_all, "load")
        for ack, _ in acks:
            assert isinstance(ack.handle, LoadHandle)
            self.layer_done_counter.retire(ack.handle)
        return acks

    def load_again(self, ack: TransferAck) -> None:
        """Copy the loads of ``ack`` (a failed one from :meth:`ack_loads`) again from their
        host copy, which a failed load leaves intact, into every pool, and wait for them:
        the caller unlocks their device slots next. Raises
        :class:`~hiradix.memory.copy.CopyError` if a copy fails again. ``O(tokens)``."""
        batch = ack.batch
        dev, host = batch.device_indices, batch.host_indices
        handles = [self.load_engine.load(h, d, host, dev) for d, h in self._companions]
        handles.append(self.load_engine.load(self.host_pool, self.device_pool, host, dev))
        for handle in handles:
            handle.wait()

    # ------------------------------------------------------------------ common
    def _ack(self, q: _Queue, wait_all: bool, kind: str) -> list[tuple[TransferAck, bool]]:
        if wait_all:
            for ack in q.acks:
                ack.wait()
            local = len(q.acks)
        else:
            local = 0
            for ack in q.acks:  # the finished prefix: acks are consumed in order
                if not ack.done():
                    break
                local += 1
        n = self.agreement.min_int(local)
        if n == 0:
            return []
        if n > local:
            # A pipeline stage after the first takes the first stage's count, which its own
            # copies may not have reached yet: wait for them (they are submitted; a count
            # past the queue means the stages diverged, which must not be papered over).
            if n > len(q.acks):
                raise RuntimeError(f"the ranks agreed on {n} {kind} acks; this rank has {len(q.acks)} queued")
            for i in range(local, n):
                q.acks[i].wait()
        popped = [q.acks.popleft() for _ in range(n)]
        agreed = self.agreement.all_true([a.ok for a in popped])
        done_key, failed_key = _STAT_KEYS[kind]
        for ack, ok in zip(popped, agreed, strict=True):
            self._stats[done_key if ok else failed_key] += ack.tokens
            if ok and ack.handle.duration_s is not None:
                self._durations[kind].append(ack.handle.duration_s)
        return list(zip(popped, agreed, strict=True))

    def pop_durations(self, kind: str) -> list[float]:
        """The copy times (seconds) of the ``"backup"`` or ``"load"`` acks acknowledged
        since the last call, where the copy engine times its copies (the thread engine by
        the clock, the CUDA engine by CUDA events; the last 1,024 kept). For metrics.
        ``O(acks)``."""
        q = self._durations[kind]
        out = list(q)
        q.clear()
        return out

    def drain(self) -> None:
        """Wait for every submitted copy to finish (their acks stay queued)."""
        for q in (self._writes, self._loads):
            for ack in q.acks:
                ack.wait()

    def close(self) -> None:
        """Finish submitted copies, stop the engines this controller created and finish
        what the agreement still owes the other ranks (:meth:`RankAgreement.close`)."""
        for engine in self._owned:
            engine.close()
        self._owned.clear()
        self.agreement.close()
