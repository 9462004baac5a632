"""The gather/scatter kernel behind :class:`~hiradix.memory.copy.CudaCopyEngine`: plan and launch.

A KV transfer between a device pool and a host pool is, per (layer, component), a list of
rows (one token's KV) moved between two byte offsets. :func:`plan` turns an operation's
slot indices into those offsets once (they are the same for every layer; a layer only moves
the two base addresses) and picks the widest chunk (16 bytes where everything is aligned)
that divides every row, base and stride. A :class:`Launcher` then runs one layer per call:

:class:`CudaLauncher`
    the CUDA kernel (``_kvcopy_cuda.cu``, built by ``setup.py`` where ``nvcc`` is found)
    on a stream. It reads or writes the pinned host pool *in place* through its mapped
    device address, as SGLang's per-layer transfer kernels do: no staging buffer, no host
    thread touching the bytes, one launch per layer for all its components.
:class:`EmulatedLauncher`
    the same kernel body (``kvcopy.h``) run thread by thread on the CPU
    (:mod:`hiradix.memory._kvcopy_emu`), so that CI, without a GPU, checks the plan, the
    widths and the kernel's index arithmetic byte for byte against the torch path.

:meth:`KernelPlan.runs` merges the rows into runs contiguous on both sides (a whole page of
a page-major layout is one run) for the other way to move them, the GPU's copy engines
(``Launcher.copy_runs``: one ``cudaMemcpyBatchAsync`` per layer; on the CPU, one
``memmove`` per run): no SM does the copy, so it cannot compete with the forward pass.

The grid is small on purpose: the copy shares the GPU with the model's forward pass, and a
zero-copy read over PCIe needs bytes in flight (``HR_UNROLL`` chunks per thread), not SMs.
``bench/transfer.py`` measures the choice (``bench/RESULTS_transfer.md``).
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hiradix import envvars
from hiradix._native import load, pure_python
from hiradix.memory.pools import DeviceKVPool, HostKVPool, in_host_order, rows_contiguous, slot_offsets

__all__ = [
    "DEFAULT_BLOCKS",
    "DEFAULT_THREADS",
    "CudaLauncher",
    "EmulatedLauncher",
    "Geometry",
    "KernelError",
    "KernelPlan",
    "Launcher",
    "Runs",
    "cuda_kernel_available",
    "geometry",
    "kernel_by_default",
    "library_abi",
    "merge_rows",
    "plan",
]

LIBRARY = Path(__file__).with_name("libhiradix_kvcopy.so")
ABI = 2
MAX_JOBS = 4  # HR_MAX_JOBS in _kvcopy_cuda.cu
DEFAULT_BLOCKS = 16
"""Blocks per component per launch (see the module docstring)."""
DEFAULT_THREADS = 512
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
        ("rows", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
    ]


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True, slots=True)
class _Side:
    """One (layer, component) buffer: row of slot ``s`` at byte
    ``ptr + (s // page_size) * page_stride + (s % page_size) * slot_stride``."""

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


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """One operation for the kernel: per layer, per component, the device and host
    :class:`_Side`; the byte offsets of every row (``offsets[2c]`` device,
    ``offsets[2c + 1]`` host, for component ``c``; CPU int64, the same for every layer);
    and the chunk ``width``."""

    layers: list[list[tuple[_Side, _Side]]]
    offsets: torch.Tensor
    rows: int
    width: int

    def jobs(self, layer: int, offsets_ptr: int, host_delta: int, to_device: bool) -> Any:
        """The ``hr_job`` array of ``layer``, for offsets stored at ``offsets_ptr`` (the
        layout of :attr:`offsets`) and host addresses shifted by ``host_delta`` (the
        pinned pool's device address minus its host address; 0 on the CPU)."""
        pairs = self.layers[layer]
        arr = (_Job * len(pairs))()
        row_stride = self.rows * 8
        for c, (d, h) in enumerate(pairs):
            dev_off, host_off = offsets_ptr + 2 * c * row_stride, offsets_ptr + (2 * c + 1) * row_stride
            if to_device:
                arr[c] = _Job(d.ptr, h.ptr + host_delta, dev_off, host_off, self.rows, d.row_bytes)
            else:
                arr[c] = _Job(h.ptr + host_delta, d.ptr, host_off, dev_off, self.rows, d.row_bytes)
        return arr

    def launch_layer(
        self, launcher: Launcher, layer: int, offsets_ptr: int, host_delta: int, to_device: bool, stream: int = 0
    ) -> None:
        """Copy ``layer``, all its components in one launch: host -> device if
        ``to_device``, else device -> host."""
        launcher.launch(self.jobs(layer, offsets_ptr, host_delta, to_device), self.width, stream)

    def runs(self) -> Runs:
        """The rows merged into :class:`Runs` (once per operation). ``O(n x components)``."""
        offsets = self.offsets.numpy()
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


@dataclass(frozen=True, slots=True)
class Geometry:
    """The half of a plan that depends on the pools alone, not on the indices: per layer,
    per component, the device and host :class:`_Side`, and the widest chunk ``width``
    that divides every row, stride and base. A pair of pools keeps it for life (their
    buffers never move), so :class:`~hiradix.memory.copy.CudaCopyEngine` computes it once
    per pair (``O(layers x components)`` tensor views: most of a plan's host time)."""

    layers: list[list[tuple[_Side, _Side]]]
    width: int


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


def plan(
    device_pool: DeviceKVPool,
    host_pool: HostKVPool,
    dev: torch.Tensor,
    host: torch.Tensor,
    geo: Geometry | None = None,
) -> KernelPlan | None:
    """The kernel plan for validated CPU int64 slot indices (paired in order), or ``None``
    where the kernel cannot address the pools (see :func:`geometry`; ``geo``, when given,
    is theirs, computed once) or there is nothing to copy.

    Rows are sorted by host slot, as the CPU row copy does: the host side is the one whose
    layouts scatter a page, and walking it in address order keeps each warp's reads (or
    writes) over PCIe in few, long runs. Runtime complexity: ``O(n log n)`` for the sort
    (skipped when in order), ``O(n x components)`` for the offsets.
    """
    if dev.device.type != "cpu" or host.device.type != "cpu":
        raise ValueError("plan() takes CPU indices")
    n = dev.numel()
    if n == 0:
        return None
    if geo is None:
        geo = geometry(device_pool, host_pool)
        if geo is None:
            return None
    dev_np, host_np = in_host_order(dev.numpy(), host.numpy())
    ps = host_pool.page_size
    rows: list[np.ndarray] = []
    for d, h in geo.layers[0]:
        rows.append(slot_offsets(dev_np, device_pool.total_slots, 1, d.page_stride, 0, "device_indices"))
        rows.append(slot_offsets(host_np, host_pool.size, ps, h.page_stride, h.slot_stride, "host_indices"))
    return KernelPlan(geo.layers, torch.from_numpy(np.stack(rows)), n, geo.width)


# ----------------------------------------------------------------------------- launchers
class Launcher:
    """Runs one layer of a :class:`KernelPlan`."""

    blocks: int
    threads: int

    def launch(self, jobs: Any, width: int, stream: int) -> None:
        raise NotImplementedError

    def copy_runs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i``
        (uintp arrays of one length; no two copies overlap)."""
        raise NotImplementedError


def _check_grid(blocks: int, threads: int) -> None:
    if not isinstance(blocks, int) or not 1 <= blocks <= 65535:
        raise ValueError(f"blocks must be an int in [1, 65535], got {blocks!r}")
    if not isinstance(threads, int) or threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")


class EmulatedLauncher(Launcher):
    """The kernel run on the CPU, thread by thread (:mod:`hiradix.memory._kvcopy_emu`):
    CI's stand-in for :class:`CudaLauncher`. Needs the compiled extensions."""

    def __init__(self, blocks: int = 2, threads: int = 64) -> None:
        if _emu is None:
            raise KernelError("the kernel emulation hiradix.memory._kvcopy_emu is not built (or HIRADIX_PUREPYTHON)")
        _check_grid(blocks, threads)
        self.blocks, self.threads = blocks, threads

    def launch(self, jobs: Any, width: int, stream: int = 0) -> None:
        _emu.launch(ctypes.addressof(jobs), len(jobs), width, self.blocks, self.threads)

    def copy_runs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int = 0) -> None:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(dst, src, size)


_C_INT, _PTR = ctypes.c_int, ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {  # the library's C ABI (_kvcopy_cuda.cu)
    "hr_kvcopy_abi": (_C_INT, []),
    "hr_kvcopy_launch": (_C_INT, [_PTR, _C_INT, _C_INT, _C_INT, _C_INT, _PTR]),
    "hr_kvcopy_runs": (_C_INT, [_PTR, _PTR, _PTR, ctypes.c_size_t, _PTR]),
    "hr_kvcopy_host_pointer": (_C_INT, [_PTR, ctypes.POINTER(_PTR)]),
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


def cuda_kernel_available() -> bool:
    """Whether the CUDA copy kernel is built, loadable and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        _library()
    except KernelError:
        return False
    return True


def kernel_by_default() -> bool:
    """Whether :class:`~hiradix.memory.copy.CudaCopyEngine` uses the kernel unless told
    otherwise: only with ``HIRADIX_CUDA_KERNEL=1`` (and :func:`cuda_kernel_available`).

    Off by default because on an H200 (``bench/RESULTS_transfer.md``, 2026-11-27) it reached
    55-66% of a contiguous pinned copy at page >= 16, short of the 80% bar set for turning it
    on, although it passed every parity and wait check and was 2.1-9.1x the torch path.
    ``bench/transfer_gpu.py`` and ``tests/memory/test_kernel.py`` are what a GPU session runs
    before turning it on.
    """
    return envvars.flag("HIRADIX_CUDA_KERNEL") and cuda_kernel_available()


def library_abi() -> int:
    """The ABI version of the built kernel library (loading it needs no GPU). Raises
    :class:`KernelError` where it is not built or not loadable."""
    return int(_library().hr_kvcopy_abi())


class CudaLauncher(Launcher):
    """The CUDA kernel, launched on a given stream. ``blocks`` per component and
    ``threads`` per block (defaults :data:`DEFAULT_BLOCKS`, :data:`DEFAULT_THREADS`)."""

    def __init__(self, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS) -> None:
        _check_grid(blocks, threads)
        self._lib = _library()
        self.blocks, self.threads = blocks, threads

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
        code = self._lib.hr_kvcopy_launch(jobs, len(jobs), width, self.blocks, self.threads, ctypes.c_void_p(stream))
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
