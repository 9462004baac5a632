"""Copy engine: KV transfers between a :class:`DeviceKVPool` and a :class:`HostKVPool`.

Two operations, both asynchronous, both returning a handle:

``backup(device_pool, host_pool, device_indices, host_indices)``
    Device -> host, all layers (SGLang's write / backup).
``load(host_pool, device_pool, host_indices, device_indices)``
    Host -> device, layer by layer. The :class:`LoadHandle` is SGLang's
    ``LayerDoneCounter`` for one load: the forward pass calls ``wait_until(i)`` before it
    computes layer ``i``, so layer ``i`` may run as soon as its KV has landed while later
    layers are still copying.

Operations of one engine complete in submission order (one FIFO queue or one stream).

:class:`ThreadCopyEngine` (CPU, or any device, without CUDA streams) runs the copies on one
worker thread; per-layer completion is a condition plus a landed-layer counter. With
``inline=True`` it runs each operation on the caller's thread instead, before ``backup`` /
``load`` returns (same validation, copies and handles; for simulators and tests that must
not depend on thread timing).
:class:`CudaCopyEngine` issues them on a dedicated copy stream and records one CUDA event
per layer; ``wait_until`` makes the *current stream* wait on the event instead of blocking
the host.

The per-layer copy is a gather on one side and a scatter on the other: on the device side
``index_select`` / ``index_copy_`` over the ``[slots, *shape]`` buffer, on the host side
advanced indexing over :meth:`HostKVPool.get_page_layer_view` (``[pages, page_size,
*shape]``, strided for the page-first layouts), indexed by whole pages when the host
indices are whole aligned pages and by ``(page, offset)`` pairs otherwise. The torch ops
release the GIL in their kernels; the worker holds it only between ops.

For CPU pools :class:`ThreadCopyEngine` uses the compiled run copy
:func:`hiradix.memory._gather.copy_runs` instead, when it is built (and
``HIRADIX_PUREPYTHON`` is not set): each (layer, component) is one call that moves runs of
token rows between the two pools' backing storage, at byte offsets planned once per
operation (:func:`~hiradix.memory._gather.pair_runs`, which merges rows contiguous on both
sides into one run), running without the GIL on large copies. No temporary is made: a
gather and a scatter in torch are two passes over the data through an intermediate
tensor, this is one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from hiradix._native import load
from hiradix.memory import kernel as _kernel
from hiradix.memory.pools import DeviceKVPool, HostKVPool, rows_contiguous

logger = logging.getLogger(__name__)

__all__ = [
    "CopyEngine",
    "CopyError",
    "CopyHandle",
    "CudaCopyEngine",
    "LoadHandle",
    "ThreadCopyEngine",
    "make_copy_engine",
    "mapped_backup_layer",
    "mapped_load_layer",
]

_gather: Any = load("hiradix.memory._gather")  # not built: the torch path does the copies

NATIVE_AVAILABLE = _gather is not None
"""Whether the compiled row copy (:mod:`hiradix.memory._gather`) is in use for CPU pools."""

LayerHook = Callable[[str, int, int], None]
"""``hook(kind, op_id, layer)``: called by the worker before it copies ``layer`` of
operation ``op_id`` (``kind`` is ``"backup"`` or ``"load"``). A test seam: a hook that
waits on an event lets a test hold the worker between layers; a hook that raises
injects a copy failure."""


class CopyError(RuntimeError):
    """A copy operation failed on the engine's worker; ``__cause__`` is the original error."""


# ----------------------------------------------------------------------------- handles
class CopyHandle(ABC):
    """An operation submitted to a :class:`CopyEngine`.

    The destination's bytes are valid once :meth:`wait` returns or :meth:`done` (the
    engine's ``query``) has returned ``True`` without an :attr:`error`.
    """

    op_id: int
    kind: str
    layer_num: int

    @abstractmethod
    def done(self) -> bool:
        """Whether the operation has finished, successfully or not. Never blocks. ``O(1)``."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer has landed. Raises :class:`CopyError` if the operation
        failed and ``TimeoutError`` if ``timeout`` seconds pass first."""

    @property
    @abstractmethod
    def error(self) -> BaseException | None:
        """The failure of a finished operation, or ``None``."""

    @property
    def duration_s(self) -> float | None:
        """Seconds from the copy's first layer starting to its last landing, once it has
        finished; ``None`` before, or where the engine does not time its copies."""
        return None


class LoadHandle(CopyHandle):
    """A host -> device load, signalled layer by layer (SGLang's ``LayerDoneCounter``)."""

    @abstractmethod
    def wait_until(self, layer: int, timeout: float | None = None) -> None:
        """Return once layer ``layer`` of this load is usable by the forward pass.

        Raises :class:`CopyError` if that layer did not land (the operation failed at or
        before it) and ``TimeoutError`` if ``timeout`` seconds pass first.
        """


def _check_layer_arg(layer: int, layer_num: int) -> None:
    if not 0 <= layer < layer_num:
        raise IndexError(f"layer {layer} out of range [0, {layer_num})")


class _ThreadHandle(LoadHandle):
    """Completion state of one :class:`ThreadCopyEngine` operation: a condition and the
    count of layers landed so far. A failure records the error and releases every waiter;
    layers that landed before it stay good."""

    def __init__(self, op_id: int, kind: str, layer_num: int) -> None:
        self.op_id = op_id
        self.kind = kind
        self.layer_num = layer_num
        self._cond = threading.Condition()
        self._landed = 0  # layers 0 .. _landed - 1 are in the destination
        self._finished = False
        self._error: BaseException | None = None
        self._started = self._ended = 0.0  # perf_counter() at the first layer and the finish

    # ---- worker side
    def _mark_layer(self, layer: int) -> None:
        with self._cond:
            self._landed = layer + 1
            if self._landed == self.layer_num:
                self._ended = time.perf_counter()
                self._finished = True
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._finished = True
            self._cond.notify_all()

    # ---- caller side
    def done(self) -> bool:
        with self._cond:
            return self._finished

    @property
    def error(self) -> BaseException | None:
        with self._cond:
            return self._error

    @property
    def duration_s(self) -> float | None:
        with self._cond:
            return self._ended - self._started if self._ended else None

    def _raise(self) -> None:
        raise CopyError(f"{self.kind} #{self.op_id} failed: {self._error!r}") from self._error

    def wait(self, timeout: float | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"{self.kind} #{self.op_id} not done after {timeout} s")
            if self._error is not None:
                self._raise()

    def wait_until(self, layer: int, timeout: float | None = None) -> None:
        _check_layer_arg(layer, self.layer_num)
        with self._cond:
            if not self._cond.wait_for(lambda: self._landed > layer or self._finished, timeout):
                raise TimeoutError(f"{self.kind} #{self.op_id} layer {layer} not landed after {timeout} s")
            if self._landed <= layer:
                self._raise()

    def __repr__(self) -> str:
        return f"<{self.kind} #{self.op_id}: {self._landed}/{self.layer_num} layers, error={self._error!r}>"


# ----------------------------------------------------------------------------- validation
@dataclass(frozen=True, slots=True)
class _HostIndex:
    """Host slots of one transfer, pre-split for indexing ``get_page_layer_view``:
    ``pages`` when the slots are whole aligned pages (index the page dim only), else
    ``(page, offset)`` per slot."""

    n: int
    pages: torch.Tensor | None
    page: torch.Tensor | None
    offset: torch.Tensor | None


def _as_index(indices: Any, name: str) -> torch.Tensor:
    t = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices, dtype=torch.int64)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be integer, got {t.dtype}")
    return t.to(torch.int64)


def _check_range(t: torch.Tensor, hi: int, name: str) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= hi):
        raise IndexError(f"{name} out of range [0, {hi}): min {int(t.min())}, max {int(t.max())}")


def _validate(
    device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked, owned int64 copies of the indices: device ones on the pool's device, host
    ones on the CPU."""
    dev, host = _validate_cpu(device_pool, host_pool, device_indices, host_indices)
    return dev.to(device_pool.device), host


def _check_pools(device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
    if not isinstance(device_pool, DeviceKVPool) or not isinstance(host_pool, HostKVPool):
        raise TypeError("expected a DeviceKVPool and a HostKVPool")
    if device_pool.shape.components != host_pool.shape.components or device_pool.layer_num != host_pool.layer_num:
        raise ValueError(f"pool shapes differ: device {device_pool.shape}, host {host_pool.shape}")
    if device_pool.dtype != host_pool.dtype:
        raise ValueError(f"pool dtypes differ: device {device_pool.dtype}, host {host_pool.dtype}")


def _validate_cpu(
    device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked, owned int64 CPU copies of the indices (CUDA indices are read back: a sync)."""
    _check_pools(device_pool, host_pool)
    dev = _as_index(device_indices, "device_indices").cpu()
    host = _as_index(host_indices, "host_indices").cpu()
    if dev.numel() != host.numel():
        raise ValueError(f"{dev.numel()} device indices but {host.numel()} host indices")
    _check_range(dev, device_pool.total_slots, "device_indices")
    _check_range(host, host_pool.size, "host_indices")
    # Own the indices: the caller may reuse its tensors while the copy is queued.
    return dev.clone(), host.clone()


def as_index_array(indices: Any, name: str) -> np.ndarray:
    """``indices`` as a 1-D int64 numpy array (a view where it already is one): the
    compiled path's input, and the controller's queued writes. Same errors as
    :func:`_as_index`. ``O(1)`` for an int64 array or CPU tensor, else ``O(n)``."""
    if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1 and indices.flags.c_contiguous:
        return indices  # the planned paths' own arrays: no checks to repeat
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise TypeError(f"{name} must be integer, got {indices.dtype}")
        a = (indices if indices.device.type == "cpu" else indices.cpu()).numpy()
    else:
        a = np.asarray(indices)
        if a.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
        if a.size == 0:
            return np.empty(0, dtype=np.int64)
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integer, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _prepare(
    device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
) -> tuple[torch.Tensor, _HostIndex]:
    """Checked CPU indices (device ones as given, host ones pre-split): the CUDA engine's
    torch paths' input."""
    dev, host = _validate_cpu(device_pool, host_pool, device_indices, host_indices)
    return dev, _host_index(host, host_pool.page_size)


def _host_index(host: torch.Tensor, ps: int) -> _HostIndex:
    n = host.numel()
    if n % ps == 0:
        rows = host.view(-1, ps)
        starts = rows[:, 0]
        if bool((starts % ps == 0).all()) and bool((rows == starts[:, None] + torch.arange(ps)).all()):
            return _HostIndex(n, starts // ps, None, None)
    return _HostIndex(n, None, host // ps, host % ps)


def _host_gather(view: torch.Tensor, hidx: _HostIndex) -> torch.Tensor:
    """Rows of a ``[pages, page_size, *shape]`` host view as a contiguous ``[n, *shape]``."""
    if hidx.pages is not None:
        return view.index_select(0, hidx.pages).view(hidx.n, *view.shape[2:])
    return view[hidx.page, hidx.offset]


def _host_scatter(view: torch.Tensor, hidx: _HostIndex, src: torch.Tensor) -> None:
    """Write ``src`` ``[n, *shape]`` into the host rows (through the strided view)."""
    if hidx.pages is not None:
        view.index_copy_(0, hidx.pages, src.view(-1, *view.shape[1:]))
    else:
        view[hidx.page, hidx.offset] = src


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as uint8 (last dim times the item size), a view. The copies move
    bytes, and torch's index kernels are not built for every KV dtype (no fp8
    ``index_copy_`` on the CPU)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _layer_pairs(device_pool: DeviceKVPool, host_pool: HostKVPool, layer: int) -> list[tuple[torch.Tensor, ...]]:
    """(device buffer, host page-layer view) per component of ``layer``, both as bytes."""
    return [
        (_as_bytes(d), _as_bytes(h))
        for d, h in zip(device_pool.layer_buffers(layer), host_pool.get_page_layer_view(layer), strict=True)
    ]


def _backup_layer(
    device_pool: DeviceKVPool, host_pool: HostKVPool, dev: torch.Tensor, hidx: _HostIndex, layer: int
) -> None:
    for dbuf, hview in _layer_pairs(device_pool, host_pool, layer):
        _host_scatter(hview, hidx, dbuf.index_select(0, dev).cpu())


def _load_layer(
    host_pool: HostKVPool, device_pool: DeviceKVPool, hidx: _HostIndex, dev: torch.Tensor, layer: int
) -> None:
    for dbuf, hview in _layer_pairs(device_pool, host_pool, layer):
        dbuf.index_copy_(0, dev, _host_gather(hview, hidx).to(dbuf.device))


# ----------------------------------------------------------------------------- compiled row copies
@dataclass(frozen=True, slots=True)
class _Region:
    """One (layer, component) buffer of a pool, as bytes of its backing storage. Slot
    ``s``'s row of :attr:`row_bytes` bytes starts at byte
    ``base + (s // page_size) * page_stride + (s % page_size) * slot_stride`` of :attr:`buf`
    (for a device buffer ``page_size`` is 1 and only ``page_stride`` is used)."""

    buf: np.ndarray  # uint8 view of the whole storage; keeps it alive
    base: int
    page_stride: int
    slot_stride: int
    row_bytes: int


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    # The whole storage, not the view: page-first layer views are strided over all of it.
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def _device_regions(pool: DeviceKVPool) -> list[list[_Region]] | None:
    if pool.device.type != "cpu":
        return None
    out = []
    for layer in range(pool.layer_num):
        regions = []
        for buf in pool.layer_buffers(layer):
            if not rows_contiguous(buf, 1):
                return None
            isz = buf.element_size()
            row = buf[0].numel() * isz
            regions.append(_Region(_storage_bytes(buf), int(buf.storage_offset()) * isz, buf.stride(0) * isz, 0, row))
        out.append(regions)
    return out


def _host_regions(pool: HostKVPool) -> list[list[_Region]] | None:
    out = []
    for layer in range(pool.layer_num):
        regions = []
        for view in pool.get_page_layer_view(layer):  # [pages, page_size, *shape]
            if view.device.type != "cpu" or not rows_contiguous(view, 2):
                return None
            isz = view.element_size()
            row = view[0, 0].numel() * isz
            regions.append(
                _Region(
                    _storage_bytes(view),
                    int(view.storage_offset()) * isz,
                    view.stride(0) * isz,
                    view.stride(1) * isz,
                    row,
                )
            )
        out.append(regions)
    return out


# Per pool, computed once: a pool's buffers are allocated in its constructor and never
# replaced. Weak keys, so a cached plan never keeps a dropped pool's memory alive.
_REGIONS: weakref.WeakKeyDictionary[Any, list[list[_Region]] | None] = weakref.WeakKeyDictionary()
_REGIONS_LOCK = threading.Lock()


def _regions(pool: DeviceKVPool | HostKVPool) -> list[list[_Region]] | None:
    """The pool's regions per layer and component, or ``None`` where the compiled copy
    cannot address it (not on the CPU, or rows not contiguous)."""
    with _REGIONS_LOCK:
        try:
            return _REGIONS[pool]
        except KeyError:
            pass
    plan = _device_regions(pool) if isinstance(pool, DeviceKVPool) else _host_regions(pool)
    with _REGIONS_LOCK:
        _REGIONS[pool] = plan
    return plan


class _RowPlan(NamedTuple):  # a tuple: one is built per transfer, and a frozen dataclass's __init__ costs 1 us
    """One operation's runs for :func:`_gather.copy_runs`: byte offsets and lengths per
    component (the same for every layer; the layer moves only each region's ``base``)."""

    dev: list[list[_Region]]
    host: list[list[_Region]]
    dev_off: tuple[np.ndarray, ...]
    host_off: tuple[np.ndarray, ...]
    run_bytes: tuple[np.ndarray, ...]
    align: int


def _row_plan(
    device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
) -> _RowPlan | None:
    """Validate an operation and plan it for the compiled copy, or return ``None`` (before
    checking the indices) where the torch path must serve: not built, a pool not on the
    CPU, or rows it cannot address. Raises as :func:`_validate` does for bad input.

    Rows are put in the order of their *host* slots, in both directions. The host pool is
    the large side whose layouts scatter a page (layer_first: one run per layer and
    component; page_first: one row per token stride), and on huge-page-backed pools
    walking it in address order measured 1.06-1.3x faster than walking it in the order
    given (random pages), whether it is read (load) or written (backup). Sorting by the
    source side instead, which is what the 4 KiB-page pools preferred, lost 5-30% on
    backups (``bench/RESULTS_transfer.md``). The pairing of slots is unchanged; only
    rows that name the same destination slot twice could land differently, and the
    torch path leaves that undefined too.

    The plan is one compiled call (:func:`_gather.pair_runs`: order, range checks and
    every component's runs, rows that follow each other on both sides merged): the
    scheduler thread pays this once per step's batch of write-throughs, whose new nodes
    are runs of consecutive slots on both sides, so thousands of rows plan into a handful
    of ``memcpy`` calls. Offsets per row, validated and merged again at copy time, cost
    three times as much (``bench/RESULTS_sglang_api.md``, run 12). The arrays are new, so
    the caller may reuse its index arrays at once.

    Runtime complexity: ``O(n)``, plus ``O(n log n)`` to sort rows not in host order.
    """
    if _gather is None:
        return None
    layout = _pair_layout(device_pool, host_pool)
    if layout is None:
        return None
    dev = as_index_array(device_indices, "device_indices")
    host = as_index_array(host_indices, "host_indices")
    # One compiled call: host order, range checks, and the runs of every component (K and
    # V alike share one set of arrays).
    dev_off, host_off, run_bytes = _gather.pair_runs(
        dev, host, device_pool.total_slots, host_pool.size, host_pool.page_size, layout.components
    )
    return _RowPlan(layout.dev, layout.host, dev_off, host_off, run_bytes, device_pool.itemsize)


# No slots: ``weakref_slot`` is Python 3.11+, and a weak reference to it is kept in _LAST_PAIR.
@dataclass(frozen=True)
class _PairLayout:
    """What every plan between one device pool and one host pool shares: their regions,
    and per component the strides of its rows and the earlier component whose offset
    arrays it can reuse (``-1``: none)."""

    dev: list[list[_Region]]
    host: list[list[_Region]]
    components: tuple[tuple[int, int, int, int, int], ...]  # (reuse, dev page, host page, host slot strides, row)


# Per (device pool, host pool), computed once like _REGIONS: checking that strides do not
# change with the layer walks every layer, which a plan per write-through must not repeat.
_PAIRS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, _PairLayout | None]] = weakref.WeakKeyDictionary()


def _pair_layout(device_pool: DeviceKVPool, host_pool: HostKVPool) -> _PairLayout | None:
    """The shared part of :func:`_row_plan` for these pools, or ``None`` where the compiled
    copy cannot serve (a pool it cannot address, or strides that change with the layer).
    Mismatched pools raise as :func:`_check_pools` does, each time (failures are not kept).
    ``O(1)`` once known, ``O(layers * components)`` the first time."""
    global _LAST_PAIR
    last = _LAST_PAIR  # one read: another thread may replace it, never change it
    if last is not None and last[0]() is device_pool and last[1]() is host_pool:
        cached = last[2]()
        if cached is not None:
            return cached
    with _REGIONS_LOCK:
        known = _PAIRS.get(device_pool)
        if known is not None and host_pool in known:
            layout = known[host_pool]
            if layout is not None:
                _LAST_PAIR = (weakref.ref(device_pool), weakref.ref(host_pool), weakref.ref(layout))
            return layout
    _check_pools(device_pool, host_pool)
    layout = _compute_pair_layout(device_pool, host_pool)
    with _REGIONS_LOCK:
        _PAIRS.setdefault(device_pool, weakref.WeakKeyDictionary())[host_pool] = layout
    return layout


# The pair planned last, so that a scheduler step's plan skips the two weak-dictionary
# lookups under the lock. All weak: the layout holds views of the pools' storage, which
# must go with the pools (it lives on in _PAIRS exactly as long as they do).
_LAST_PAIR: tuple[weakref.ref[Any], weakref.ref[Any], weakref.ref[_PairLayout]] | None = None


def _compute_pair_layout(device_pool: DeviceKVPool, host_pool: HostKVPool) -> _PairLayout | None:
    if device_pool.device.type != "cpu":
        return None
    dregs, hregs = _regions(device_pool), _regions(host_pool)
    if dregs is None or hregs is None:
        return None
    components: list[tuple[int, int, int, int, int]] = []
    for c, (d, h) in enumerate(zip(dregs[0], hregs[0], strict=True)):
        # Strides must not change with the layer, or one offset array would not serve all.
        if any((r[c].page_stride, r[c].row_bytes) != (d.page_stride, d.row_bytes) for r in dregs) or any(
            (r[c].page_stride, r[c].slot_stride) != (h.page_stride, h.slot_stride) for r in hregs
        ):
            return None
        if d.row_bytes != h.row_bytes:
            raise ValueError(f"component {c}: device rows have {d.row_bytes} bytes, host rows {h.row_bytes}")
        strides = (d.page_stride, h.page_stride, h.slot_stride, d.row_bytes)
        reuse = c - 1 if c and strides == components[c - 1][1:] else -1
        components.append((reuse, *strides))
    return _PairLayout(dregs, hregs, tuple(components))


def _native_backup_layers(plan: _RowPlan, layers: range, threads: int) -> None:
    """The compiled backup of ``layers`` (one layer per step of a queued backup, every
    layer in one loop for :meth:`ThreadCopyEngine.backup_now`), the plan read once."""
    copy = _gather.copy_runs
    dev_off, host_off, run_bytes, align = plan.dev_off, plan.host_off, plan.run_bytes, plan.align
    for layer in layers:
        for c, (d, h) in enumerate(zip(plan.dev[layer], plan.host[layer], strict=True)):
            copy(h.buf, host_off[c], h.base, d.buf, dev_off[c], d.base, run_bytes[c], align, threads)


def _native_load_layer(plan: _RowPlan, layer: int, threads: int) -> None:
    for c, (d, h) in enumerate(zip(plan.dev[layer], plan.host[layer], strict=True)):
        _gather.copy_runs(
            d.buf, plan.dev_off[c], d.base, h.buf, plan.host_off[c], h.base, plan.run_bytes[c], plan.align, threads
        )


def _default_copy_threads() -> int:
    # A second thread helps a random-page gather only when a core is free for it; on a busy
    # 2-core machine it made copies slower (bench/RESULTS_transfer.md). Half the cores, at
    # most 4: the rest run the model.
    return max(1, min(4, (os.cpu_count() or 1) // 2))


# ----------------------------------------------------------------------------- engines
class CopyEngine(ABC):
    """Moves KV pages between a device pool and a host pool, asynchronously and in
    submission order. Use as a context manager or call :meth:`close`.

    ``fence_stream``: a CUDA stream each later operation also waits for before it starts,
    besides the submitting thread's current stream: the stream a model's forward pass runs
    on when that is not the scheduler's own (SGLang's overlap scheduler sets its
    controller's ``load_fence_stream`` / ``write_fence_stream`` to it, so a backup never
    copies KV a forward is still writing, and a load never overwrites slots a forward
    still reads). ``None`` (the default): no other stream. Engines of CPU pools copy on
    the caller's order alone and ignore it."""

    fence_stream: Any = None

    @abstractmethod
    def backup(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> CopyHandle:
        """Queue a device -> host copy of slots ``device_indices`` into ``host_indices``
        (equal length, paired in order), all layers. Runtime: ``O(n)`` to validate; the
        copy itself is ``O(n x bytes_per_token)`` on the engine."""

    @abstractmethod
    def load(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool, host_indices: Any, device_indices: Any
    ) -> LoadHandle:
        """Queue a host -> device copy, layer by layer; the handle signals each layer as it
        lands. Runtime as :meth:`backup`."""

    def query(self, handle: CopyHandle) -> bool:
        """Whether ``handle`` has finished (successfully or not). Never blocks. ``O(1)``."""
        return handle.done()

    @abstractmethod
    def close(self) -> None:
        """Finish the queued operations and release the engine. Idempotent."""

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_STOP = object()


class ThreadCopyEngine(CopyEngine):
    """Copy engine backed by one worker thread and a FIFO queue (any torch device; the
    engine for CPU pools and for CI).

    ``layer_hook`` (see :data:`LayerHook`) is a test seam called by the worker before each
    layer (an attribute of the same name: a test may set it between operations). An
    exception in an operation (from a copy or the hook) fails that operation only: its
    waiters are released with a :class:`CopyError` and the next operation runs.

    ``native`` picks how CPU pools are copied: ``None`` (the default) uses the compiled
    GIL-free row copy when it is built (:data:`NATIVE_AVAILABLE`), ``False`` always uses
    torch indexing, ``True`` requires the compiled copy (``RuntimeError`` otherwise). Pools
    on other devices always take the torch path. The bytes that land are the same either way.
    ``copy_threads`` (compiled copy only; default half the cores, 1 to 4) splits each large
    (layer, component) copy over that many threads, the worker being one of them.

    ``inline=True`` starts no worker: each operation runs on the caller's thread and its
    handle is finished when ``backup`` / ``load`` returns. Handles behave as usual (a
    failure is recorded on the handle and raised as :class:`CopyError` by ``wait``, not by
    the submitting call), operations still complete in submission order, and
    ``layer_hook`` is still called before each layer. Nothing overlaps the caller, so it is
    for simulators and deterministic tests, not for a server.

    >>> from hiradix.memory import MHAShape
    >>> dev = DeviceKVPool(MHAShape(2, 1, 4), size=4, page_size=2, dtype=torch.float32)
    >>> host = HostKVPool.for_device(dev, ratio=1.0, reserve_bytes=0)
    >>> dev.k_buffer(1)[2:4] = 1.0
    >>> with ThreadCopyEngine() as eng:
    ...     eng.backup(dev, host, [2, 3], [0, 1]).wait()
    ...     _ = dev.k_buffer(1).zero_()
    ...     h = eng.load(host, dev, [0, 1], [4, 5])
    ...     h.wait_until(1)
    >>> dev.k_buffer(1)[4:6].sum().item()
    8.0
    """

    def __init__(
        self,
        *,
        layer_hook: LayerHook | None = None,
        name: str = "hiradix-copy",
        native: bool | None = None,
        copy_threads: int | None = None,
        inline: bool = False,
    ) -> None:
        threads = _default_copy_threads() if copy_threads is None else copy_threads
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 8:
            raise ValueError(f"copy_threads must be an int in [1, 8], got {copy_threads!r}")
        self.copy_threads = threads
        if native and not NATIVE_AVAILABLE:
            raise RuntimeError(
                "native=True but the compiled row copy hiradix.memory._gather is not in use "
                "(not built, or HIRADIX_PUREPYTHON is set)"
            )
        self.native = NATIVE_AVAILABLE if native is None else bool(native)
        self.layer_hook = layer_hook
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed/_next_id; submission order = queue order
        self._closed = False
        self._next_id = 0
        self.inline = bool(inline)
        self._thread: threading.Thread | None = None
        if not self.inline:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _submit(self, kind: str, layer_num: int, step: Callable[[int], None]) -> _ThreadHandle:
        with self._lock:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            handle = _ThreadHandle(self._next_id, kind, layer_num)
            self._next_id += 1
            if not self.inline:
                self._queue.put((handle, step))
                return handle
        # Inline: outside the lock, as on the worker (a hook may submit or close).
        self._execute(handle, step)
        return handle

    def _execute(self, handle: _ThreadHandle, step: Callable[[int], None]) -> None:
        """Run one operation layer by layer; a failure goes to the handle's waiters."""
        handle._started = time.perf_counter()
        try:
            for layer in range(handle.layer_num):
                if self.layer_hook is not None:
                    self.layer_hook(handle.kind, handle.op_id, layer)
                step(layer)
                handle._mark_layer(layer)
        except BaseException as exc:  # handed to the waiters, never swallowed
            handle._fail(exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt & co. still stop the caller
                raise

    def _backup_step(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        device_indices: Any,
        host_indices: Any,
        plan: _RowPlan | None,
    ) -> Callable[[int], None]:
        """A validated backup, as its per-layer copy: the compiled one when ``plan`` (from
        :func:`_row_plan`) is given, else torch's."""
        if plan is not None:
            return lambda layer: _native_backup_layers(plan, range(layer, layer + 1), self.copy_threads)
        dev, host = _validate(device_pool, host_pool, device_indices, host_indices)
        hidx = _host_index(host, host_pool.page_size)
        return lambda layer: _backup_layer(device_pool, host_pool, dev, hidx, layer)

    def backup(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> CopyHandle:
        plan = _row_plan(device_pool, host_pool, device_indices, host_indices) if self.native else None
        step = self._backup_step(device_pool, host_pool, device_indices, host_indices, plan)
        return self._submit("backup", device_pool.layer_num, step)

    def backup_now(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> None:
        """:meth:`backup` on an inline engine, run to completion on the caller's thread
        without a handle (a scheduler step's write-through: no handle, condition or ack
        to make). A failed copy raises what the copy raised; layers before it landed.
        ``layer_hook`` is called as for :meth:`backup`. ``RuntimeError`` on an engine
        with a worker (this would overtake its queue) or a closed one. ``O(tokens)``."""
        if not self.inline:
            raise RuntimeError("backup_now needs an inline engine (ThreadCopyEngine(inline=True))")
        with self._lock:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            op_id = self._next_id
            self._next_id += 1
        plan = _row_plan(device_pool, host_pool, device_indices, host_indices) if self.native else None
        if plan is not None and self.layer_hook is None:  # every layer in one loop, without a step per layer
            _native_backup_layers(plan, range(device_pool.layer_num), self.copy_threads)
            return
        step = self._backup_step(device_pool, host_pool, device_indices, host_indices, plan)
        for layer in range(device_pool.layer_num):
            if self.layer_hook is not None:
                self.layer_hook("backup", op_id, layer)
            step(layer)

    def load(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool, host_indices: Any, device_indices: Any
    ) -> LoadHandle:
        plan = _row_plan(device_pool, host_pool, device_indices, host_indices) if self.native else None
        if plan is not None:
            return self._submit(
                "load", device_pool.layer_num, lambda layer: _native_load_layer(plan, layer, self.copy_threads)
            )
        dev, host = _validate(device_pool, host_pool, device_indices, host_indices)
        hidx = _host_index(host, host_pool.page_size)
        return self._submit(
            "load", device_pool.layer_num, lambda layer: _load_layer(host_pool, device_pool, hidx, dev, layer)
        )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            handle, step = item
            with contextlib.suppress(BaseException):  # the handle holds the error
                self._execute(handle, step)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is None:  # inline: every operation already ran
                return
            self._queue.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join()


# ----------------------------------------------------------------------------- CUDA
class _CudaHandle(LoadHandle):
    """One operation on a :class:`CudaCopyEngine`: a CUDA event per layer, recorded on the
    copy stream after that layer's copy, and (where timed) one before the first.
    ``finalize`` (the legacy path's backups) scatters the pinned staging buffers into the
    host pool once the last event has fired."""

    def __init__(
        self,
        op_id: int,
        kind: str,
        events: list[torch.cuda.Event],
        device: torch.device,
        keep_alive: list[torch.Tensor],
        finalize: Callable[[], None] | None = None,
        start: torch.cuda.Event | None = None,
    ) -> None:
        self.op_id = op_id
        self.kind = kind
        self.layer_num = len(events)
        self._events = events
        self._start = start
        self._device = device
        self._keep_alive = keep_alive  # offsets, indices and staging in flight
        self._finalize = finalize
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._duration: float | None = None

    def _complete(self) -> None:
        with self._lock:
            if self._finalize is not None and self._error is None:
                fin, self._finalize = self._finalize, None
                try:
                    fin()
                except BaseException as exc:  # re-raised by wait()
                    self._error = exc
            if self._start is not None:
                # Stock SGLang times its load-back and backups with CUDA events, too. Where
                # the ring has given the events to a later operation already (a handle first
                # seen done after 64 more), there is no figure: never an error.
                try:
                    ms = self._start.elapsed_time(self._events[-1])
                except RuntimeError:
                    ms = -1.0
                self._duration = ms / 1e3 if ms >= 0 else None
                self._start = None
            self._keep_alive = []

    def done(self) -> bool:
        if not self._events[-1].query():
            return False
        self._complete()
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def duration_s(self) -> float | None:
        """Seconds the copy took on the GPU (CUDA events), once done; ``None`` before or
        where not timed."""
        return self._duration

    def wait(self, timeout: float | None = None) -> None:
        # CUDA events have no timed wait; timeout is accepted for interface parity.
        self._events[-1].synchronize()
        self._complete()
        if self._error is not None:
            raise CopyError(f"{self.kind} #{self.op_id} failed: {self._error!r}") from self._error

    def wait_until(self, layer: int, timeout: float | None = None) -> None:
        """Make the *current stream* wait for layer ``layer``'s event; does not block the host."""
        _check_layer_arg(layer, self.layer_num)
        torch.cuda.current_stream(self._device).wait_event(self._events[layer])


class _EventRing:
    """Timing-enabled CUDA events for a copy stream's operations, made once and reused:
    ``take(layers)`` gives ``layers + 1`` events (a start and one per layer) and their raw
    handles as the C array the kernel library records into. Events are reused after
    ``slots`` later operations. Reuse is safe on one stream: a slow reader of an old
    handle then waits for a later operation of the same in-order stream, never for less
    than its own."""

    def __init__(self, stream: torch.cuda.Stream, slots: int = 64) -> None:
        self._stream = stream
        self._slots: list[tuple[list[torch.cuda.Event], Any] | None] = [None] * slots
        self._next = 0

    def take(self, layers: int) -> tuple[list[torch.cuda.Event], Any]:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot is None or len(slot[0]) != layers + 1:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(layers + 1)]
            for ev in events:  # a first record creates the CUDA event behind the handle
                ev.record(self._stream)
            handles = (ctypes.c_void_p * layers)(*(ev.cuda_event for ev in events[1:]))
            slot = self._slots[i] = (events, handles)
        return slot


def _mapped_alias(host_pool: HostKVPool, device: torch.device) -> torch.Tensor | None:
    """The pinned host pool's bytes as a tensor on ``device`` (unified addressing: a
    GPU kernel reads and writes them in place over PCIe), or ``None`` where the pool is not
    pinned or torch will not take the address."""
    buf = host_pool.backing_tensor
    if not buf.is_pinned():
        return None
    nbytes = buf.numel() * buf.element_size()

    mapped = type("Mapped", (), {})()  # torch.as_tensor reads the CUDA array interface of the pinned bytes
    mapped.__cuda_array_interface__ = {
        "shape": (nbytes,),
        "typestr": "|u1",
        "data": (buf.data_ptr(), False),
        "version": 3,
        "strides": None,
    }
    try:
        alias = torch.as_tensor(mapped, device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    return alias if alias.data_ptr() == buf.data_ptr() else None


def _mapped_views(host_pool: HostKVPool, alias: torch.Tensor, layer: int) -> list[torch.Tensor]:
    """``get_page_layer_view(layer)``'s components as bytes, over ``alias`` (the pool's
    bytes on the GPU, :func:`_mapped_alias`)."""
    base = host_pool.backing_tensor.data_ptr()
    out = []
    for view in host_pool.get_page_layer_view(layer):
        b = _as_bytes(view)
        out.append(alias.as_strided(b.shape, b.stride(), b.data_ptr() - base))
    return out


def mapped_load_layer(
    dbufs: list[torch.Tensor], hviews: list[torch.Tensor], hidx: _HostIndex, dev: torch.Tensor
) -> None:
    """One layer host -> device on the GPU alone: gather the host rows through their
    mapped views (the GPU reads pinned memory in place) and scatter them into the device
    buffers. A fixed number of torch ops per component, whatever the rows: no host pass
    over the KV, no per-token host work. Device-agnostic (CI runs it on CPU tensors)."""
    for dbuf, hview in zip(dbufs, hviews, strict=True):
        dbuf.index_copy_(0, dev, _host_gather(hview, hidx))


def mapped_backup_layer(
    dbufs: list[torch.Tensor], hviews: list[torch.Tensor], hidx: _HostIndex, dev: torch.Tensor
) -> None:
    """One layer device -> host on the GPU alone: gather the device rows and scatter them
    into the mapped host views in place. As :func:`mapped_load_layer`, no host work per
    token."""
    for dbuf, hview in zip(dbufs, hviews, strict=True):
        _host_scatter(hview, hidx, dbuf.index_select(0, dev))


def _host_index_on(hidx: _HostIndex, device: torch.device) -> _HostIndex:
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return _HostIndex(hidx.n, to(hidx.pages), to(hidx.page), to(hidx.offset))


class CudaCopyEngine(CopyEngine):
    """Copy engine on a dedicated CUDA copy stream, one event per layer.

    Every operation first makes the copy stream wait on the current stream (so it sees
    the KV the compute stream wrote and does not overwrite slots still being read), then
    moves the layers in order, recording one event after each: ``wait_until(i)`` makes the
    *current stream* wait for layer ``i`` without blocking the host. The host's part is
    validating the indices, planning the offsets once (one per page where whole pages move)
    and one call that queues every layer; nothing waits for the GPU.

    Three ways to move a layer, the same bytes every way:

    ``kernel`` (the default wherever the library loads on a CUDA device; ``kernel=False`` or
    ``HIRADIX_CUDA_KERNEL=0`` turn it off; :mod:`hiradix.memory.kernel`)
        one launch of the gather/scatter kernel per layer, reading (load) or writing
        (backup) the pinned host pool in place over PCIe. ``mode`` ``warp`` (a few blocks,
        a warp per row, streaming accesses: made to run beside a forward pass) or ``wide``
        (many blocks); default ``HIRADIX_CUDA_KERNEL_MODE``. The offsets go up from pinned
        memory on the copy stream, asynchronously.
    mapped torch (the fallback where the kernel is off or cannot serve)
        torch's own index kernels on the GPU over the pinned host pool viewed as device
        memory (unified addressing): a gather and a scatter per component, no host pass
        over the KV and no per-token host work. Logged once, with the reason.
    staged torch (only for a host pool that is not pinned, which the GPU cannot address)
        each layer's host rows gathered by the CPU into pinned staging, copied, scattered
        with ``index_copy_``; backups scattered on the host when first seen done. Two host
        passes a layer; logged once.

    ``dma=True`` (needs the kernel library): the same plan, but each layer's rows, merged
    into runs contiguous on both sides, go to the GPU's copy engines in one
    ``cudaMemcpyBatchAsync`` (:meth:`~hiradix.memory.kernel.KernelPlan.copy_layer_runs`)
    instead of the SM kernel. Measured on an H200 (``bench/RESULTS_transfer.md``): no faster
    than the kernel at page >= 16, far slower where runs are single rows. Kept for
    measurement.

    ``kernel=True`` requires the kernel and raises
    :class:`~hiradix.memory.kernel.KernelError` where it cannot serve; ``blocks`` and
    ``threads`` set its grid per component (defaults per mode).

    ``stream_priority``: the copy stream's CUDA priority (lower is higher; torch clamps it
    to the device's range).

    ``layer_delay_cycles`` (a test seam, the GPU's counterpart of
    :class:`ThreadCopyEngine`'s ``layer_hook``): spin that many GPU clock cycles on the
    copy stream before each layer, so loads land late and a consumer that does not wait
    for a layer's event reads stale bytes. 0 (the default) adds nothing.

    Handles report ``duration_s`` from CUDA events (start to last layer), which SGLang's
    load-back and backup histograms take. Index validation runs on the host: CUDA index
    tensors are read back once (a sync); pass CPU indices to avoid it.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        kernel: bool | None = None,
        mode: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
        dma: bool = False,
        stream_priority: int = 0,
        layer_delay_cycles: int = 0,
    ) -> None:
        if layer_delay_cycles < 0:
            raise ValueError(f"layer_delay_cycles must be >= 0, got {layer_delay_cycles}")
        if dma and kernel is False:
            raise ValueError("dma=True goes through the kernel library's plan; it cannot be combined with kernel=False")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaCopyEngine needs CUDA, but torch.cuda.is_available() is False; use ThreadCopyEngine "
                "(or make_copy_engine('cpu'))"
            )
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a cuda device, got {dev}")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self._launcher: _kernel.CudaLauncher | None = None
        self._require_kernel = kernel is True or dma
        if kernel or dma:
            self._launcher = _kernel.CudaLauncher(blocks, threads, mode)
        elif kernel is None:
            if _kernel.kernel_by_default():
                self._launcher = _kernel.CudaLauncher(blocks, threads, mode)
            else:
                why = _kernel.kernel_unavailable_reason() or "HIRADIX_CUDA_KERNEL=0"
                _log_once(f"hiradix: CUDA copies take the mapped torch path, not the kernel: {why}")
        self.dma = dma
        self._geometries = _kernel.GeometryCache()
        self._stream = torch.cuda.Stream(device=self.device, priority=stream_priority)
        self._events = _EventRing(self._stream)
        self._aliases: dict[int, tuple[HostKVPool, torch.Tensor | None]] = {}
        self._deltas: dict[int, tuple[HostKVPool, int]] = {}  # a pinned pool's device-address shift, for life
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self.layer_delay_cycles = layer_delay_cycles

    def _delay(self) -> None:
        """The test seam's spin before a layer (on the copy stream, the current one here)."""
        if self.layer_delay_cycles:
            torch.cuda._sleep(self.layer_delay_cycles)

    @property
    def uses_kernel(self) -> bool:
        """Whether operations go through the CUDA kernel (where the pools allow)."""
        return self._launcher is not None

    @property
    def mode(self) -> str | None:
        """The kernel's mode, or ``None`` where the kernel is not used."""
        return None if self._launcher is None else self._launcher.mode

    def _begin(self, device_pool: DeviceKVPool) -> int:
        if self._closed:
            raise RuntimeError("copy engine is closed")
        if _same_device(device_pool.device, self.device) is False:
            raise ValueError(f"device pool is on {device_pool.device}, engine on {self.device}")
        op_id = self._next_id
        self._next_id += 1
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.fence_stream is not None:
            self._stream.wait_stream(self.fence_stream)
        return op_id

    def _kernel_plan(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> tuple[_kernel.KernelPlan, int] | None:
        """The kernel's plan and the host pool's device-address shift, or ``None`` for the
        torch paths (no kernel, or pools it cannot address)."""
        if self._launcher is None:
            return None
        # No owned copies of the indices: the plan turns them into offsets now, and checks
        # each against its pool (slot_offsets).
        _check_pools(device_pool, host_pool)
        dev = as_index_array(device_indices, "device_indices")
        host = as_index_array(host_indices, "host_indices")
        try:
            delta = self._host_delta(host_pool)
            geo = self._geometries.get(device_pool, host_pool)
            p = None if geo is None else _kernel.plan(device_pool, host_pool, dev, host, geo, pin=True)
            if p is None or delta % p.width:
                raise _kernel.KernelError(f"the kernel cannot address these pools ({device_pool}, {host_pool})")
        except _kernel.KernelError as exc:
            if self._require_kernel:
                raise
            _log_once(f"hiradix: a copy takes the torch path, not the kernel: {exc}")
            return None
        return p, delta

    def _run_kernel(
        self, kind: str, device_pool: DeviceKVPool, p: _kernel.KernelPlan, delta: int, to_device: bool
    ) -> _CudaHandle:
        launcher = self._launcher
        assert launcher is not None
        layers = device_pool.layer_num
        with self._lock:
            op_id = self._begin(device_pool)
            events, handles = self._events.take(layers)
            if self.dma:
                runs = p.runs()
                with torch.cuda.stream(self._stream):
                    events[0].record(self._stream)
                    for layer in range(layers):
                        self._delay()
                        p.copy_layer_runs(launcher, layer, runs, to_device, self._stream.cuda_stream)
                        events[layer + 1].record(self._stream)
                return _CudaHandle(op_id, kind, events[1:], self.device, [], start=events[0])
            with torch.cuda.stream(self._stream):
                offsets = p.offsets.to(self.device, non_blocking=True)  # from pinned memory: asynchronous
                launcher.launch_layers(
                    p,
                    offsets.data_ptr(),
                    delta,
                    to_device,
                    self._stream.cuda_stream,
                    events[0].cuda_event,
                    handles,
                    self.layer_delay_cycles,
                )
        return _CudaHandle(op_id, kind, events[1:], self.device, [p.offsets, offsets], start=events[0])

    def _host_delta(self, host_pool: HostKVPool) -> int:
        """The launcher's :meth:`~hiradix.memory.kernel.CudaLauncher.host_delta` of a host
        pool, asked once per pool (its pinned buffer never moves), not once per operation."""
        assert self._launcher is not None
        hit = self._deltas.get(id(host_pool))
        if hit is None or hit[0] is not host_pool:
            hit = self._deltas[id(host_pool)] = (host_pool, self._launcher.host_delta(host_pool))
        return hit[1]

    def _alias(self, host_pool: HostKVPool) -> torch.Tensor | None:
        hit = self._aliases.get(id(host_pool))
        if hit is None or hit[0] is not host_pool:
            alias = _mapped_alias(host_pool, self.device)
            if alias is None:
                _log_once(
                    "hiradix: a host pool is not pinned (or torch cannot address it from the GPU): its copies "
                    "gather KV on the host (the staged torch path)"
                )
            hit = self._aliases[id(host_pool)] = (host_pool, alias)
        return hit[1]

    def _run_mapped(
        self,
        kind: str,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        alias: torch.Tensor,
        dev: torch.Tensor,
        hidx: _HostIndex,
    ) -> _CudaHandle:
        layers = device_pool.layer_num
        step = mapped_load_layer if kind == "load" else mapped_backup_layer
        with self._lock:
            op_id = self._begin(device_pool)
            events, _ = self._events.take(layers)
            with torch.cuda.stream(self._stream):
                events[0].record(self._stream)
                dev_idx = dev.to(self.device, non_blocking=True)
                hidx_dev = _host_index_on(hidx, self.device)
                for layer in range(layers):
                    self._delay()
                    dbufs = [_as_bytes(d) for d in device_pool.layer_buffers(layer)]
                    step(dbufs, _mapped_views(host_pool, alias, layer), hidx_dev, dev_idx)
                    events[layer + 1].record(self._stream)
        keep = [dev_idx, *(t for t in (hidx_dev.pages, hidx_dev.page, hidx_dev.offset) if t is not None)]
        return _CudaHandle(op_id, kind, events[1:], self.device, keep, start=events[0])

    def load(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool, host_indices: Any, device_indices: Any
    ) -> LoadHandle:
        return self._copy("load", device_pool, host_pool, device_indices, host_indices)

    def backup(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> CopyHandle:
        return self._copy("backup", device_pool, host_pool, device_indices, host_indices)

    def _copy(
        self, kind: str, device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices: Any, host_indices: Any
    ) -> _CudaHandle:
        """One operation on the first path that can serve it: the kernel, the mapped torch
        path, or (an unpinned host pool) the staged one."""
        planned = self._kernel_plan(device_pool, host_pool, device_indices, host_indices)
        if planned is not None:
            return self._run_kernel(kind, device_pool, *planned, to_device=kind == "load")
        dev, hidx = _prepare(device_pool, host_pool, device_indices, host_indices)
        alias = self._alias(host_pool)
        if alias is not None:
            return self._run_mapped(kind, device_pool, host_pool, alias, dev, hidx)
        if kind == "load":
            return self._staged_load(host_pool, device_pool, dev, hidx)
        return self._staged_backup(device_pool, host_pool, dev, hidx)

    def _staged(
        self, device_pool: DeviceKVPool, dev: torch.Tensor, step: Callable[[int, torch.Tensor], list]
    ) -> tuple[int, list[torch.cuda.Event], list[torch.Tensor]]:
        """The staged path's frame: on the copy stream, ``step(layer, dev_idx)`` for every
        layer (it returns the tensors to keep alive), an event after each."""
        with self._lock:
            op_id = self._begin(device_pool)
            events: list[torch.cuda.Event] = []
            with torch.cuda.stream(self._stream):
                dev_idx = dev.to(self.device, non_blocking=True)
                keep: list[torch.Tensor] = [dev_idx]
                for layer in range(device_pool.layer_num):
                    self._delay()
                    keep += step(layer, dev_idx)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    events.append(ev)
        return op_id, events, keep

    def _staged_load(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool, dev: torch.Tensor, hidx: _HostIndex
    ) -> _CudaHandle:
        def step(layer: int, dev_idx: torch.Tensor) -> list:
            keep = []
            for dbuf, hview in _layer_pairs(device_pool, host_pool, layer):
                staged = _host_gather(hview, hidx).pin_memory()
                on_dev = staged.to(self.device, non_blocking=True)
                dbuf.index_copy_(0, dev_idx, on_dev)
                keep += [staged, on_dev]
            return keep

        op_id, events, keep = self._staged(device_pool, dev, step)
        return _CudaHandle(op_id, "load", events, self.device, keep)

    def _staged_backup(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, dev: torch.Tensor, hidx: _HostIndex
    ) -> _CudaHandle:
        staged_all: list[tuple[int, int, torch.Tensor]] = []

        def step(layer: int, dev_idx: torch.Tensor) -> list:
            keep = []
            for c, (dbuf, _) in enumerate(_layer_pairs(device_pool, host_pool, layer)):
                gathered = dbuf.index_select(0, dev_idx)
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)
                keep += [gathered, staged]
                staged_all.append((layer, c, staged))
            return keep

        op_id, events, keep = self._staged(device_pool, dev, step)

        def finalize() -> None:
            for layer, c, staged in staged_all:
                _host_scatter(_as_bytes(host_pool.get_page_layer_view(layer)[c]), hidx, staged)

        return _CudaHandle(op_id, "backup", events, self.device, keep, finalize)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._stream.synchronize()


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    """Log ``message`` (a warning) the first time this process sees it."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same, ``cuda`` meaning the current CUDA device."""

    def norm(d: torch.device) -> torch.device:
        if d.type == "cuda" and d.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return d

    return norm(a) == norm(b)


def make_copy_engine(device: str | torch.device, **kwargs: Any) -> CopyEngine:
    """The copy engine for a device pool on ``device``: :class:`CudaCopyEngine` for a CUDA
    device, :class:`ThreadCopyEngine` otherwise (``kwargs`` go to the constructor).

    >>> eng = make_copy_engine("cpu")
    >>> type(eng).__name__
    'ThreadCopyEngine'
    >>> eng.close()
    """
    if torch.device(device).type == "cuda":
        return CudaCopyEngine(device, **kwargs)
    return ThreadCopyEngine(**kwargs)
