"""The gather/scatter kernel behind :class:`~hiradix.memory.copy.CudaCopyEngine`: plan and launch.

A KV transfer between a device pool and a host pool is, per (layer, component), a list of
rows (one token's KV) moved between two byte offsets. :func:`plan` turns an operation's
slot indices into those offsets once (they are the same for every layer; a layer only moves
the two base addresses): one offset per *page* where whole pages move (a group of rows at
fixed strides on both sides), one per row otherwise. It picks the widest chunk (16 bytes
where everything is aligned) that divides every row, base and stride. A :class:`Launcher`
then queues the operation, every layer, in one call:

:class:`CudaLauncher`
    the CUDA kernel (``_kvcopy_cuda.cu``, built by ``setup.py`` where ``nvcc`` is found,
    and carried by the wheels) on a stream. It reads or writes the pinned host pool *in
    place* through its mapped device address, as SGLang's per-layer transfer kernels do: no
    staging buffer, no host thread touching the bytes, one launch per layer for all its
    components, each layer's event recorded by the library (``hr_kvcopy_launch_layers``).
:class:`EmulatedLauncher`
    the same kernel bodies (``kvcopy.h``) run thread by thread on the CPU
    (:mod:`hiradix.memory._kvcopy_emu`), so that CI, without a GPU, checks the plan, the
    widths, the modes and the kernel's index arithmetic byte for byte against the torch path.

Two :data:`MODES` share the rows among threads: ``wide`` (chunks striped over many blocks;
the default, the mode measured on an H200) and ``warp`` (a few blocks, a warp per row,
streaming loads and stores that leave L2 to the forward pass; not yet measured on a GPU).
``HIRADIX_CUDA_KERNEL_MODE`` picks one; ``bench/transfer_gpu.py`` and
``bench/layer_wait_gpu.py`` measure both beside SGLang's own kernels, and the default is to
be the fastest that passes the parity and wait checks (``bench/RESULTS_transfer.md``).

:meth:`KernelPlan.runs` merges the rows into runs contiguous on both sides (a whole page of
a page-major layout is one run) for the other way to move them, the GPU's copy engines
(``Launcher.copy_runs``: one ``cudaMemcpyBatchAsync`` per layer; on the CPU, one
``memmove`` per run): no SM does the copy, so it cannot compete with the forward pass.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hiradix import envvars
from hiradix._native import load, pure_python
from hiradix.memory.pools import DeviceKVPool, HostKVPool, in_host_order, rows_contiguous, slot_offsets

__all__ = [
    "DEFAULT_GRID",
    "MODES",
    "CudaLauncher",
    "EmulatedLauncher",
    "Geometry",
    "GeometryCache",
    "KernelError",
    "KernelPlan",
    "Launcher",
    "Runs",
    "cuda_kernel_available",
    "default_mode",
    "geometry",
    "kernel_by_default",
    "kernel_unavailable_reason",
    "library_abi",
    "merge_rows",
    "plan",
]

LIBRARY = Path(__file__).with_name("libhiradix_kvcopy.so")
ABI = 3
MAX_JOBS = 4  # HR_MAX_JOBS in _kvcopy_cuda.cu
MODES = {"wide": 0, "warp": 1}  # HR_MODE_WIDE, HR_MODE_WARP in kvcopy.h
DEFAULT_GRID = {"wide": (16, 512), "warp": (4, 1024)}
"""(blocks per component, threads per block) of each mode, unless told otherwise."""
WIDTHS = (16, 8, 4, 2, 1)

_emu: Any = load("hiradix.memory._kvcopy_emu")


class KernelError(RuntimeError):
    """The CUDA kernel library could not be used, or a launch failed."""


class _Job(ctypes.Structure):
    """``hr_job`` of ``kvcopy.h``."""

    _fields_ = [
        ("dst", ctypes.c_void_p),
        ("src", ctypes.c_void_p),
        ("dst_off", ctypes.c_void_p),
        ("src_off", ctypes.c_void_p),
        ("groups", ctypes.c_int64),
        ("group_rows", ctypes.c_int64),
        ("dst_row_stride", ctypes.c_int64),
        ("src_row_stride", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
    ]


def default_mode() -> str:
    """The kernel mode ``HIRADIX_CUDA_KERNEL_MODE`` names (``ValueError`` for another)."""
    mode = envvars.text("HIRADIX_CUDA_KERNEL_MODE") or "wide"
    if mode not in MODES:
        raise ValueError(f"HIRADIX_CUDA_KERNEL_MODE must be one of {sorted(MODES)}, got {mode!r}")
    return mode


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True, slots=True)
class _Side:
    """One (layer, component) buffer: row of slot ``s`` at byte
    ``ptr + (s // page_size) * page_stride + (s % page_size) * slot_stride``. The device
    side is slot-major: its "page" is one slot and ``slot_stride`` is unused."""

    ptr: int
    page_stride: int
    slot_stride: int
    row_bytes: int


def _device_side(buf: torch.Tensor) -> _Side:
    isz = buf.element_size()
    return _Side(buf.data_ptr(), buf.stride(0) * isz, 0, buf[0].numel() * isz)


def _host_side(view: torch.Tensor) -> _Side:
    isz = view.element_size()
    return _Side(view.data_ptr(), view.stride(0) * isz, view.stride(1) * isz, view[0, 0].numel() * isz)


@dataclass(frozen=True)
class Geometry:
    """The half of a plan that depends on the pools alone, not on the indices: per layer,
    per component, the device and host :class:`_Side`, and the widest chunk ``width``
    that divides every row, stride and base. A pair of pools keeps it for life (their
    buffers never move), so :class:`~hiradix.memory.copy.CudaCopyEngine` computes it once
    per pair (``O(layers x components)`` tensor views: most of a plan's host time), with
    the job templates of both directions (:meth:`templates`)."""

    layers: list[list[tuple[_Side, _Side]]]
    width: int
    _templates: dict[tuple[bool, int], Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def components(self) -> int:
        return len(self.layers[0])

    def templates(self, to_device: bool, host_delta: int = 0) -> Any:
        """``hr_job`` templates of every layer (``layers x components``, layer-major): bases,
        row strides and row size, host addresses shifted by ``host_delta`` (the pinned
        pool's device address minus its host address; 0 on the CPU). Built once per
        direction and shift."""
        key = (to_device, host_delta)
        arr = self._templates.get(key)
        if arr is None:
            arr = (_Job * (len(self.layers) * self.components))()
            i = 0
            for pairs in self.layers:
                for d, h in pairs:
                    host_ptr = h.ptr + host_delta
                    if to_device:
                        arr[i] = _Job(d.ptr, host_ptr, None, None, 0, 1, d.page_stride, h.slot_stride, d.row_bytes)
                    else:
                        arr[i] = _Job(host_ptr, d.ptr, None, None, 0, 1, h.slot_stride, d.page_stride, d.row_bytes)
                    i += 1
            self._templates[key] = arr
        return arr


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """One operation for the kernel: the pools' :class:`Geometry`; the byte offsets of
    every group of rows (``offsets[2c]`` device, ``offsets[2c + 1]`` host, for component
    ``c``; CPU int64, pinned when asked for, the same for every layer); ``group_rows`` rows
    per group (the page size where whole pages move, else 1)."""

    geometry: Geometry
    offsets: torch.Tensor
    groups: int
    group_rows: int

    @property
    def rows(self) -> int:
        return self.groups * self.group_rows

    @property
    def width(self) -> int:
        return self.geometry.width

    @property
    def layers(self) -> list[list[tuple[_Side, _Side]]]:
        return self.geometry.layers

    def jobs(self, layer: int, offsets_ptr: int, host_delta: int, to_device: bool) -> Any:
        """The bound ``hr_job`` array of ``layer`` alone, for offsets stored at
        ``offsets_ptr`` (the layout of :attr:`offsets`): what one launch of the kernel
        takes (:meth:`Launcher.launch`; tests and the one-layer entry)."""
        tmpl = self.geometry.templates(to_device, host_delta)
        ncomp = self.geometry.components
        arr = (_Job * ncomp)()
        for c in range(ncomp):
            arr[c] = tmpl[layer * ncomp + c]
            dev = offsets_ptr + 2 * c * self.groups * 8
            host = dev + self.groups * 8
            arr[c].dst_off, arr[c].src_off = (dev, host) if to_device else (host, dev)
            arr[c].groups, arr[c].group_rows = self.groups, self.group_rows
        return arr

    def row_offsets(self) -> np.ndarray:
        """Every row's offsets (``[2 x components, rows]``, the layout of :attr:`offsets`
        with groups expanded). ``O(rows x components)``."""
        off = self.offsets.numpy()
        if self.group_rows == 1:
            return off
        k = np.arange(self.group_rows, dtype=np.int64)
        out: list[np.ndarray] = []
        for d, h in self.layers[0]:
            for stride, row in ((d.page_stride, off[len(out)]), (h.slot_stride, off[len(out) + 1])):
                out.append((row[:, None] + k * stride).reshape(-1))
        return np.stack(out)

    def runs(self) -> Runs:
        """The rows merged into :class:`Runs` (once per operation). ``O(n x components)``."""
        offsets = self.row_offsets()
        dev_off, host_off, sizes = [], [], []
        for c, (d, _) in enumerate(self.layers[0]):
            do, ho, n = merge_rows(offsets[2 * c], offsets[2 * c + 1], d.row_bytes)
            dev_off.append(do)
            host_off.append(ho)
            sizes.append(n)
        return Runs(dev_off, host_off, np.concatenate(sizes).astype(np.uintp))

    def copy_layer_runs(self, launcher: Launcher, layer: int, runs: Runs, to_device: bool, stream: int = 0) -> None:
        """Copy ``layer`` as the :class:`Runs` ``runs``, all components in one batch,
        host -> device if ``to_device``, else device -> host. The host pool is addressed
        by its host address (unified addressing: the copy engines take it as is)."""
        pairs = self.layers[layer]
        dev = np.concatenate([d.ptr + off for (d, _), off in zip(pairs, runs.dev_off, strict=True)])
        host = np.concatenate([h.ptr + off for (_, h), off in zip(pairs, runs.host_off, strict=True)])
        dsts, srcs = (dev, host) if to_device else (host, dev)
        launcher.copy_runs(dsts.astype(np.uintp), srcs.astype(np.uintp), runs.sizes, stream)


@dataclass(frozen=True, slots=True)
class Runs:
    """A :class:`KernelPlan`'s rows merged into runs contiguous on both sides: per
    component, the device and host byte offsets where each run starts (int64, the same
    for every layer, as the plan's offsets), and ``sizes``, every component's run lengths
    in bytes, concatenated in component order (size_t: one layer's batch)."""

    dev_off: list[np.ndarray]
    host_off: list[np.ndarray]
    sizes: np.ndarray

    @property
    def count(self) -> int:
        """Runs per layer, all components together."""
        return int(self.sizes.size)


def merge_rows(dev_off: np.ndarray, host_off: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (paired device and host byte offsets, ``row_bytes`` each) merged into runs: a
    row starts a new run unless it follows the previous one on both sides. Returns the
    runs' device offsets, host offsets and lengths in bytes. ``O(n)``.

    >>> d, h, n = merge_rows(np.array([0, 8, 16, 40]), np.array([0, 8, 16, 24]), 8)
    >>> d.tolist(), h.tolist(), n.tolist()
    ([0, 40], [0, 24], [24, 8])
    """
    n = dev_off.size
    starts_run = np.ones(n, dtype=bool)
    if n > 1:
        starts_run[1:] = (dev_off[1:] != dev_off[:-1] + row_bytes) | (host_off[1:] != host_off[:-1] + row_bytes)
    starts = np.flatnonzero(starts_run)
    lengths = np.diff(np.append(starts, n)) * row_bytes
    return dev_off[starts], host_off[starts], lengths


def geometry(device_pool: DeviceKVPool, host_pool: HostKVPool) -> Geometry | None:
    """The :class:`Geometry` of two pools, or ``None`` where the kernel cannot address them
    (rows not dense, strides that change with the layer, more than :data:`MAX_JOBS`
    components); the torch path serves then. Raises ``ValueError`` for pools whose rows
    differ in size."""
    if len(device_pool.layer_buffers(0)) > MAX_JOBS:
        return None
    layers: list[list[tuple[_Side, _Side]]] = []
    for layer in range(device_pool.layer_num):
        pairs = []
        for dbuf, hview in zip(device_pool.layer_buffers(layer), host_pool.get_page_layer_view(layer), strict=True):
            if not rows_contiguous(dbuf, 1) or not rows_contiguous(hview, 2):
                return None
            pairs.append((_device_side(dbuf), _host_side(hview)))
        layers.append(pairs)
    first = layers[0]
    for pairs in layers[1:]:
        for (d0, h0), (d, h) in zip(first, pairs, strict=True):
            if (d.page_stride, d.row_bytes, h.page_stride, h.slot_stride) != (
                d0.page_stride,
                d0.row_bytes,
                h0.page_stride,
                h0.slot_stride,
            ):
                return None
    g = 0
    for c, (d, h) in enumerate(first):
        if d.row_bytes != h.row_bytes:
            raise ValueError(f"component {c}: device rows have {d.row_bytes} bytes, host rows {h.row_bytes}")
        g = math.gcd(g, d.row_bytes, d.page_stride, h.page_stride, h.slot_stride)
    for pairs in layers:
        for d, h in pairs:
            g = math.gcd(g, d.ptr, h.ptr)
    return Geometry(layers, next(w for w in WIDTHS if g % w == 0))


class GeometryCache:
    """The :func:`geometry` of the last few pool pairs (``kept``), each computed once. An
    entry holds its pools, so their ids stay theirs, and is recomputed should their first
    buffers move."""

    def __init__(self, kept: int = 8) -> None:
        self.kept = kept
        self._entries: dict[tuple[int, int], tuple[DeviceKVPool, HostKVPool, tuple[int, int], Geometry | None]] = {}
        self.computed = 0  # geometries computed, for tests

    def get(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> Geometry | None:
        key = (id(device_pool), id(host_pool))
        bases = (device_pool.layer_buffers(0)[0].data_ptr(), host_pool.backing_tensor.data_ptr())
        hit = self._entries.get(key)
        if hit is not None and hit[2] == bases:
            return hit[3]
        geo = geometry(device_pool, host_pool)
        self.computed += 1
        self._entries.pop(key, None)
        if len(self._entries) >= self.kept:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (device_pool, host_pool, bases, geo)
        return geo


def _page_groups(dev: np.ndarray, host: np.ndarray, ps: int) -> int:
    """``ps`` where the rows come in groups of ``ps`` that are each one whole, aligned host
    page and ``ps`` consecutive device slots (what paged allocators hand out), else 1.
    ``O(n)``."""
    n = dev.size
    if ps == 1 or n % ps:
        return 1
    h, d = host.reshape(-1, ps), dev.reshape(-1, ps)
    k = np.arange(ps, dtype=np.int64)
    if (h[:, 0] % ps).any() or not np.array_equal(h, h[:, :1] + k) or not np.array_equal(d, d[:, :1] + k):
        return 1
    return ps


def _cpu_array(indices: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        if indices.device.type != "cpu":
            raise ValueError("plan() takes CPU indices")
        return indices.numpy()
    return indices


def plan(
    device_pool: DeviceKVPool,
    host_pool: HostKVPool,
    dev: torch.Tensor | np.ndarray,
    host: torch.Tensor | np.ndarray,
    geo: Geometry | None = None,
    pin: bool = False,
) -> KernelPlan | None:
    """The kernel plan for CPU int64 slot indices (tensors or arrays, paired in order; each
    checked against its pool here: ``IndexError`` naming the side), or ``None``
    where the kernel cannot address the pools (see :func:`geometry`; ``geo``, when given,
    is theirs, computed once) or there is nothing to copy. ``pin``: the offsets in pinned
    memory (torch's caching host allocator), for an asynchronous upload.

    Rows are sorted by host slot, as the CPU row copy does: the host side is the one whose
    layouts scatter a page, and walking it in address order keeps each warp's reads (or
    writes) over PCIe in few, long runs. Where whole pages move, the offsets are one per
    page, and the sort is over the pages. Runtime complexity: ``O(n)`` to find the pages,
    ``O(g log g)`` to sort the ``g`` groups (skipped when in order), ``O(g x components)``
    for the offsets.
    """
    dev_np, host_np = _cpu_array(dev), _cpu_array(host)
    n = dev_np.size
    if n != host_np.size:
        raise ValueError(f"{n} device indices but {host_np.size} host indices")
    if n == 0:
        return None
    if geo is None:
        geo = geometry(device_pool, host_pool)
        if geo is None:
            return None
    ps = host_pool.page_size
    gr = _page_groups(dev_np, host_np, ps)
    if gr > 1:  # a page's rows stay together in any order of the pages: sort the pages alone
        dev_np, host_np = np.ascontiguousarray(dev_np[::gr]), np.ascontiguousarray(host_np[::gr])
    dev_np, host_np = in_host_order(dev_np, host_np)
    groups = n // gr
    ncomp = geo.components
    offsets = torch.empty((2 * ncomp, groups), dtype=torch.int64, pin_memory=pin)
    out = offsets.numpy()
    for c, (d, h) in enumerate(geo.layers[0]):
        out[2 * c] = slot_offsets(dev_np, device_pool.total_slots, 1, d.page_stride, 0, "device_indices")
        out[2 * c + 1] = slot_offsets(host_np, host_pool.size, ps, h.page_stride, h.slot_stride, "host_indices")
    if gr > 1 and int(dev_np.max()) + gr > device_pool.total_slots:
        raise IndexError(f"device_indices out of range [0, {device_pool.total_slots})")
    return KernelPlan(geo, offsets, groups, gr)


# ----------------------------------------------------------------------------- launchers
class Launcher:
    """Runs a :class:`KernelPlan`: one layer (:meth:`launch`) or a whole operation
    (:meth:`launch_layers`), in :attr:`mode` with :attr:`blocks` x :attr:`threads` per
    component."""

    blocks: int
    threads: int
    mode: str

    def launch(self, jobs: Any, width: int, stream: int) -> None:
        """One launch over the bound jobs of one layer (:meth:`KernelPlan.jobs`)."""
        raise NotImplementedError

    def launch_layers(
        self,
        p: KernelPlan,
        offsets_ptr: int,
        host_delta: int,
        to_device: bool,
        stream: int = 0,
        start: int = 0,
        events: Any = None,
        delay_cycles: int = 0,
    ) -> None:
        """Every layer of ``p``, in order, with the offsets at ``offsets_ptr`` (device
        memory on a GPU): host -> device if ``to_device``, else device -> host. On a GPU,
        ``start`` (an event handle, 0 for none) is recorded first and ``events[i]`` after
        layer ``i``; ``delay_cycles`` spins before each layer (the test seam)."""
        tmpl = p.geometry.templates(to_device, host_delta)
        op = (tmpl, p.geometry.components, len(p.layers), offsets_ptr, p.groups, p.group_rows, int(to_device))
        self._queue((*op, p.width, MODES[self.mode], self.blocks, self.threads), stream, start, events, delay_cycles)

    def _queue(self, op: tuple, stream: int, start: int, events: Any, delay_cycles: int) -> None:
        """``hr_kvcopy_launch_layers`` with ``op``, its arguments up to the grid."""
        raise NotImplementedError

    def copy_runs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i``
        (uintp arrays of one length; no two copies overlap)."""
        raise NotImplementedError


def _grid(mode: str | None, blocks: int | None, threads: int | None) -> tuple[str, int, int]:
    """The mode and grid a launcher runs: the defaults of ``mode`` (:data:`DEFAULT_GRID`;
    ``HIRADIX_CUDA_KERNEL_MODE`` when ``mode`` is ``None``) where not given, checked."""
    mode = default_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    b, t = DEFAULT_GRID[mode]
    blocks, threads = b if blocks is None else blocks, t if threads is None else threads
    _check_grid(blocks, threads)
    return mode, blocks, threads


def _check_grid(blocks: int, threads: int) -> None:
    if not isinstance(blocks, int) or not 1 <= blocks <= 65535:
        raise ValueError(f"blocks must be an int in [1, 65535], got {blocks!r}")
    if not isinstance(threads, int) or threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")


class EmulatedLauncher(Launcher):
    """The kernel run on the CPU, thread by thread (:mod:`hiradix.memory._kvcopy_emu`):
    CI's stand-in for :class:`CudaLauncher`. Needs the compiled extensions."""

    def __init__(self, blocks: int = 2, threads: int = 64, mode: str = "wide") -> None:
        if _emu is None:
            raise KernelError("the kernel emulation hiradix.memory._kvcopy_emu is not built (or HIRADIX_PUREPYTHON)")
        self.mode, self.blocks, self.threads = _grid(mode, blocks, threads)

    def launch(self, jobs: Any, width: int, stream: int = 0) -> None:
        _emu.launch(ctypes.addressof(jobs), len(jobs), width, MODES[self.mode], self.blocks, self.threads)

    def _queue(self, op: tuple, stream: int, start: int, events: Any, delay_cycles: int) -> None:
        _emu.launch_layers(ctypes.addressof(op[0]), *op[1:])

    def copy_runs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int = 0) -> None:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(dst, src, size)


_C_INT, _PTR, _I64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {  # the library's C ABI (_kvcopy_cuda.cu)
    "hr_kvcopy_abi": (_C_INT, []),
    "hr_kvcopy_launch": (_C_INT, [_PTR, _C_INT, _C_INT, _C_INT, _C_INT, _C_INT, _PTR]),
    "hr_kvcopy_launch_layers": (
        _C_INT,
        [
            _PTR,
            _C_INT,
            _C_INT,
            _PTR,
            _I64,
            _I64,
            _C_INT,
            _C_INT,
            _C_INT,
            _C_INT,
            _C_INT,
            ctypes.c_longlong,
            _PTR,
            _PTR,
            _PTR,
        ],
    ),
    "hr_kvcopy_runs": (_C_INT, [_PTR, _PTR, _PTR, ctypes.c_size_t, _PTR]),
    "hr_kvcopy_host_pointer": (_C_INT, [_PTR, ctypes.POINTER(_PTR)]),
    "hr_kvcopy_probe": (_C_INT, [ctypes.POINTER(_C_INT), ctypes.POINTER(_C_INT)]),
    "hr_kvcopy_error_string": (ctypes.c_char_p, [_C_INT]),
}
_LIB_LOCK = threading.Lock()
_LIB: Any = None
_LIB_ERROR: str | None = None


def _library() -> Any:
    """The loaded kernel library, or raise :class:`KernelError` saying why not."""
    global _LIB, _LIB_ERROR
    with _LIB_LOCK:
        if _LIB is None and _LIB_ERROR is None:
            if pure_python():
                _LIB_ERROR = "turned off (HIRADIX_PUREPYTHON)"
            elif not LIBRARY.exists():
                _LIB_ERROR = f"{LIBRARY.name} was not built (no nvcc when hiradix was installed)"
            else:
                try:
                    lib = ctypes.CDLL(str(LIBRARY))
                    for name, (restype, argtypes) in _SIGNATURES.items():
                        fn = getattr(lib, name)
                        fn.restype, fn.argtypes = restype, argtypes
                    if lib.hr_kvcopy_abi() != ABI:
                        raise KernelError(f"{LIBRARY.name} has ABI {lib.hr_kvcopy_abi()}, expected {ABI}: rebuild")
                    _LIB = lib
                except (OSError, AttributeError, KernelError) as exc:
                    _LIB_ERROR = f"{LIBRARY.name} could not be loaded: {exc}"
        if _LIB is None:
            raise KernelError(f"the CUDA copy kernel is not available: {_LIB_ERROR}")
        return _LIB


_PROBED: dict[int, str | None] = {}


def kernel_unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot serve here (no CUDA device, library not built or not
    loadable, a driver older than the library's CUDA, no code for this GPU), or ``None``
    where it can. Asks the device once per process and device."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        lib = _library()
    except KernelError as exc:
        return str(exc)
    device = torch.cuda.current_device()
    if device not in _PROBED:
        driver, runtime = ctypes.c_int(), ctypes.c_int()
        code = lib.hr_kvcopy_probe(ctypes.byref(driver), ctypes.byref(runtime))
        _PROBED[device] = (
            None
            if code == 0
            else (
                f"{LIBRARY.name} cannot run on {torch.cuda.get_device_name(device)} (CUDA driver "
                f"{driver.value // 1000}.{driver.value % 1000 // 10}, library built with CUDA "
                f"{runtime.value // 1000}.{runtime.value % 1000 // 10}): "
                f"{lib.hr_kvcopy_error_string(code).decode()} (cudaError {code})"
            )
        )
    return _PROBED[device]


def cuda_kernel_available() -> bool:
    """Whether the CUDA copy kernel is built, loadable and a CUDA device is present."""
    return kernel_unavailable_reason() is None


def kernel_by_default() -> bool:
    """Whether :class:`~hiradix.memory.copy.CudaCopyEngine` uses the kernel unless told
    otherwise: wherever it is available (:func:`cuda_kernel_available`), unless
    ``HIRADIX_CUDA_KERNEL=0``.

    On by default because it is the fastest path measured that passes the parity and wait
    checks (``bench/RESULTS_transfer.md``: on an H200, 2.4-8.3x the torch path, which
    gathers every layer's rows with the host CPU).
    """
    return envvars.flag("HIRADIX_CUDA_KERNEL") and cuda_kernel_available()


def library_abi() -> int:
    """The ABI version of the built kernel library (loading it needs no GPU). Raises
    :class:`KernelError` where it is not built or not loadable."""
    return int(_library().hr_kvcopy_abi())


class CudaLauncher(Launcher):
    """The CUDA kernel, launched on a given stream: ``mode`` (default
    ``HIRADIX_CUDA_KERNEL_MODE``), ``blocks`` per component and ``threads`` per block
    (defaults: :data:`DEFAULT_GRID` of the mode)."""

    def __init__(self, blocks: int | None = None, threads: int | None = None, mode: str | None = None) -> None:
        self.mode, self.blocks, self.threads = _grid(mode, blocks, threads)
        self._lib = _library()

    def _error(self, code: int) -> str:
        return f"{self._lib.hr_kvcopy_error_string(code).decode()} (cudaError {code})"

    def host_delta(self, host_pool: HostKVPool) -> int:
        """The pinned host pool's device address minus its host address (0 under unified
        addressing). Raises :class:`KernelError` if the pool is not pinned and mapped."""
        buf = host_pool.backing_tensor
        if not buf.is_pinned():
            raise KernelError("the host pool is not in pinned memory; the kernel cannot reach it")
        out = ctypes.c_void_p()
        code = self._lib.hr_kvcopy_host_pointer(ctypes.c_void_p(buf.data_ptr()), ctypes.byref(out))
        if code:
            raise KernelError(f"the host pool has no device address: {self._error(code)}")
        return int(out.value or 0) - buf.data_ptr()

    def launch(self, jobs: Any, width: int, stream: int) -> None:
        code = self._lib.hr_kvcopy_launch(
            jobs, len(jobs), width, MODES[self.mode], self.blocks, self.threads, ctypes.c_void_p(stream)
        )
        if code:
            raise KernelError(f"kernel launch failed: {self._error(code)}")

    def _queue(self, op: tuple, stream: int, start: int, events: Any, delay_cycles: int) -> None:
        code = self._lib.hr_kvcopy_launch_layers(*op, delay_cycles, stream, start or None, events)
        if code:
            raise KernelError(f"kernel launch failed: {self._error(code)}")

    def copy_runs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if not dsts.size == srcs.size == sizes.size:
            raise ValueError(f"copy_runs: {dsts.size} destinations, {srcs.size} sources, {sizes.size} sizes")
        for a in (dsts, srcs, sizes):
            if a.dtype != np.uintp or not a.flags.c_contiguous:
                raise ValueError("copy_runs takes C-contiguous uintp arrays")
        code = self._lib.hr_kvcopy_runs(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size, ctypes.c_void_p(stream)
        )
        if code:
            raise KernelError(f"copy-engine batch failed: {self._error(code)}")
