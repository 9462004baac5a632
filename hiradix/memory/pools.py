"""Device (L1) and host (L2) KV pools.

A pool is a set of typed buffers indexed by KV slot. Its shape is described by one small
frozen record, :class:`MHAShape` (a K and a V buffer per layer) or :class:`MLAShape` (one
latent buffer per layer, ``kv_lora_rank + qk_rope_head_dim`` wide). Internally both are a
list of *components* per layer (``(K, V)`` or ``(latent,)``), each with a per-token shape,
so the host layouts below are written once for both attention kinds.

Host layouts (``HostKVPool(layout=...)``), with ``E`` a component's per-token element count:

``layer_first``
    One region per component ``[layers, slots, *shape]``, as SGLang's
    ``[2, layers, size, heads, dim]``. A layer is one contiguous ``[slots, *shape]``
    tensor per component (:meth:`HostKVPool.get_layer_view`); a page is ``layers x
    components`` separate runs.
``page_first``
    Token major, ``[slots, layers, components, *shape]``: SGLang's ``page_first``
    (``[size, layers, ...]``). Slots are page aligned, so every page is one contiguous
    run of bytes, and a token's KV for all layers sits together (what a per-token transfer
    kernel wants); one layer of one page is ``page_size`` strided runs.
``page_first_direct``
    ``[pages, layers, components, page_size, *shape]``: SGLang's ``page_first_direct``
    (``[page_num, layers, page_size, ...]``). A page is one contiguous run and, inside it,
    one layer of one component is again one contiguous run, so a layer-by-layer load is
    one plain copy per (page, layer, component): the "direct" I/O backend.

The K/V split sits *inside* the page in both page-first layouts (SGLang puts it outermost),
so that a page is a single run of bytes for L3 storage. ``get_page_bytes`` hands out that
run as a zero-copy view; for ``layer_first`` it gathers a copy in ``page_first_direct``
order.

Page byte order (``HostKVPool(page_order=...)``): what a page's bytes are when they leave
the pool for L3 (``get_page_bytes``, ``read_pages``, the storage backends' v1 calls).
``"hiradix"`` is the order above. ``"sglang"`` is SGLang 0.5.18's flat host page
(``get_data_page(flat=True)``), so that pages stored by a stock SGLang node of the same
layout are read here and the other way round: components outermost, ``[K|V, layer, token,
...]`` for ``layer_first`` and ``page_first_direct`` and ``[K|V, token, layer, ...]`` for
``page_first``. MHA pages in SGLang's order are gathered and scattered piece by piece (one
copy per layer and component, or per component for ``page_first``); an MLA page has one
component, so both orders are the same bytes and page-first MLA pages stay zero copy.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from hiradix import envvars
from hiradix._native import load
from hiradix.memory.allocator import PagedSlotAllocator

__all__ = [
    "HOST_LAYOUTS",
    "PAGE_ORDERS",
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "KVShape",
    "MHAShape",
    "MLAShape",
    "PageOrder",
    "alloc_cpu_buffer",
    "fp8_dtypes",
    "huge_pages_enabled",
    "read_meminfo",
]

HostLayout = Literal["layer_first", "page_first", "page_first_direct"]
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first", "page_first_direct")
PageOrder = Literal["hiradix", "sglang"]
PAGE_ORDERS: tuple[PageOrder, ...] = ("hiradix", "sglang")
GB = 10**9  # SGLang's --hicache-size is in GB (1e9 bytes), not GiB.
GIB = 1 << 30
_DEFAULT_RESERVE_MIN = 2 * GIB
HUGE_PAGE = 2 << 20  # x86-64 / arm64 transparent huge page


def huge_pages_enabled() -> bool:
    """Whether large CPU pool buffers are backed by transparent huge pages: on Linux,
    unless ``HIRADIX_HUGEPAGES=0``. Read at each allocation."""
    return hasattr(mmap, "MADV_HUGEPAGE") and envvars.flag("HIRADIX_HUGEPAGES")


def alloc_cpu_buffer(numel: int, dtype: torch.dtype, *, pin_memory: bool = False, zero: bool = False) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` elements for a KV pool; all zeros if ``zero``,
    otherwise whatever the allocator hands out (the mapping is zeros anyway).

    Buffers of 2 MiB and more (unless pinned, or :func:`huge_pages_enabled` says no) are a
    private anonymous mapping advised ``MADV_HUGEPAGE``, its tensor starting on a 2 MiB
    boundary. A page transfer touches pages all over a pool: layer_first copies one run
    per (layer, component) per page, page_first strides one row per token per layer.
    With 4 KiB pages a 256 MiB pool is 65536 TLB entries and nearly every run is a TLB
    miss (a page walk); with 2 MiB pages it is 128, which the second-level TLB holds (see
    ``bench/RESULTS_transfer.md``). Every page is faulted in here, at start-up (one write
    per 4 KiB page; the mapping is zeros, so nothing changes): with THP defrag at its
    default (``madvise``) the first write into each 2 MiB of an advised mapping compacts
    memory synchronously, which stalled a write-through copy on the scheduler thread for
    4.9 ms per huge page on this project's 24 GB VM (``bench/RESULTS_sglang_api.md``, run
    12), mid-serving. Pinned buffers are faulted in at allocation the same way (and SGLang's
    host pools are pinned); ``HIRADIX_PREFAULT=0`` leaves the faults to the first use.
    Where THP is off (``/sys/kernel/mm/transparent_hugepage/enabled`` = never) the advice
    is ignored and this is an ordinary mapping. Pinned buffers come from torch's pinned
    allocator (``cudaHostAlloc``) as before.

    >>> alloc_cpu_buffer(3 << 20, torch.float16).shape
    torch.Size([3145728])
    """
    nbytes = numel * _itemsize(dtype)
    if pin_memory or nbytes < HUGE_PAGE or not huge_pages_enabled():
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, pin_memory=pin_memory)
    # MAP_PRIVATE: mmap's default MAP_SHARED makes shmem, which follows shmem_enabled instead.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive, as the tensor keeps raw
    skip = -raw.ctypes.data % HUGE_PAGE
    buf = raw[skip : skip + nbytes]
    if envvars.flag("HIRADIX_PREFAULT"):
        buf[::4096] = 0
    return torch.from_numpy(buf).view(dtype)


def rows_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether each row ``t[i_0, .., i_lead-1]`` is one contiguous run of elements."""
    expect = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


_gather: Any = load("hiradix.memory._gather")  # the compiled row planning, where built


def in_host_order(dev: np.ndarray, host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (device slot, host slot) pairs sorted by host slot (stable), or the arrays
    themselves when they already are: both copy paths walk the host side in address
    order (``bench/RESULTS_transfer.md``). ``O(n)``, ``O(n log n)`` to sort."""
    in_order = _gather.is_sorted(host) if _gather is not None else bool(np.all(host[1:] >= host[:-1]))
    if in_order:
        return dev, host
    order = np.argsort(host, kind="stable")
    return dev[order], host[order]


def slot_offsets(
    slots: np.ndarray, limit: int, page_size: int, page_stride: int, slot_stride: int, name: str
) -> np.ndarray:
    """Byte offsets of the rows of int64 ``slots``: ``(s // page_size) * page_stride +
    (s % page_size) * slot_stride``, a new array; ``IndexError`` naming ``name`` when a
    slot is outside ``[0, limit)``. Compiled (:func:`_gather.slot_offsets`) where built,
    numpy otherwise. ``O(n)``."""
    if _gather is not None:
        return _gather.slot_offsets(slots, limit, page_size, page_stride, slot_stride, name)
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= limit):
        raise IndexError(f"{name} out of range [0, {limit}): min {int(slots.min())}, max {int(slots.max())}")
    return (slots // page_size) * page_stride + (slots % page_size) * slot_stride


def fp8_dtypes() -> tuple[torch.dtype, ...]:
    """The fp8 dtypes this torch build has (possibly none)."""
    names = ("float8_e4m3fn", "float8_e5m2")
    return tuple(d for d in (getattr(torch, n, None) for n in names) if isinstance(d, torch.dtype))


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True, slots=True)
class MHAShape:
    """Multi-head attention KV: per layer a K ``[slots, head_num, head_dim]`` and a V
    ``[slots, head_num, v_head_dim]`` buffer (``v_head_dim`` defaults to ``head_dim``).

    >>> MHAShape(layer_num=2, head_num=4, head_dim=8).elems_per_token
    128
    """

    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        _check_positive(layer_num=self.layer_num, head_num=self.head_num, head_dim=self.head_dim)
        if self.v_head_dim is not None:
            _check_positive(v_head_dim=self.v_head_dim)

    @property
    def components(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shape of each buffer of one layer: ``(K, V)``."""
        v = self.head_dim if self.v_head_dim is None else self.v_head_dim
        return ((self.head_num, self.head_dim), (self.head_num, v))

    @property
    def elems_per_token(self) -> int:
        """Elements one token occupies over all layers and components."""
        return self.layer_num * sum(math.prod(c) for c in self.components)


@dataclass(frozen=True, slots=True)
class MLAShape:
    """Multi-head latent attention KV: per layer one latent buffer
    ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``.

    >>> MLAShape(layer_num=2, kv_lora_rank=512, qk_rope_head_dim=64).components
    ((1, 576),)
    """

    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        _check_positive(
            layer_num=self.layer_num, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )

    @property
    def components(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shape of the one latent buffer of a layer."""
        return ((1, self.kv_lora_rank + self.qk_rope_head_dim),)

    @property
    def elems_per_token(self) -> int:
        """Elements one token occupies over all layers."""
        return self.layer_num * sum(math.prod(c) for c in self.components)


KVShape = MHAShape | MLAShape


def _itemsize(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _check_layer(layer: int, layer_num: int) -> int:
    if not 0 <= layer < layer_num:
        raise IndexError(f"layer {layer} out of range [0, {layer_num})")
    return layer


# ----------------------------------------------------------------------------- device
class _KVPoolBase:
    """What device and host pools share: a KV shape and a dtype."""

    shape: KVShape
    itemsize: int

    @property
    def is_mla(self) -> bool:
        """Whether this is an MLA (single latent buffer) pool."""
        return isinstance(self.shape, MLAShape)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's KV occupies over all layers. ``O(1)``."""
        return self.shape.elems_per_token * self.itemsize


class DeviceKVPool(_KVPoolBase):
    """The L1 pool: KV buffers on a torch device (``cuda`` or ``cpu``).

    ``size`` usable slots (rounded down to a page multiple) plus one leading padding page,
    as SGLang: buffers have :attr:`total_slots` ``= size + page_size`` rows and a
    :class:`PagedSlotAllocator` of the same ``size`` and ``page_size`` hands out slots
    ``page_size .. total_slots - 1``. Buffers start zeroed.

    >>> pool = DeviceKVPool(MHAShape(2, 4, 8), size=16, page_size=4, dtype=torch.float16)
    >>> tuple(pool.k_buffer(1).shape), pool.bytes_per_token
    ((20, 4, 8), 256)
    """

    def __init__(
        self, shape: KVShape, size: int, page_size: int, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> None:
        if not isinstance(shape, MHAShape | MLAShape):
            raise TypeError(f"shape must be MHAShape or MLAShape, got {type(shape).__name__}")
        _check_positive(page_size=page_size)
        self.shape = shape
        self.page_size = page_size
        self.size = (int(size) // page_size) * page_size
        if self.size < page_size:
            raise ValueError(f"size {size} holds no whole page of {page_size} slots")
        self.dtype = dtype
        self.itemsize = _itemsize(dtype)
        self.device = torch.device(device)
        self.layer_num = shape.layer_num
        self.total_slots = self.size + page_size
        # _buffers[component][layer]: separate per-layer tensors, as SGLang, so a layer's
        # attention kernel gets a plain contiguous [slots, *shape] buffer.
        self._buffers: list[list[torch.Tensor]] = self._allocate(shape.components)

    @classmethod
    def wrap(cls, shape: KVShape, buffers: list[list[torch.Tensor]], size: int, page_size: int) -> DeviceKVPool:
        """A pool over KV buffers that already exist (a serving engine's own), used in
        place: ``buffers[component][layer]`` is a ``[size + page_size, *component_shape]``
        tensor, components in :attr:`KVShape.components` order. Nothing is allocated or
        copied; shapes, dtypes and devices are checked. ``O(layers)``.

        >>> k = [torch.zeros(8, 2, 4) for _ in range(3)]
        >>> v = [torch.zeros(8, 2, 4) for _ in range(3)]
        >>> pool = DeviceKVPool.wrap(MHAShape(3, 2, 4), [k, v], size=4, page_size=4)
        >>> pool.k_buffer(2) is k[2], pool.make_allocator().available_size()
        (True, 4)
        """
        if not isinstance(shape, MHAShape | MLAShape):
            raise TypeError(f"shape must be MHAShape or MLAShape, got {type(shape).__name__}")
        _check_positive(page_size=page_size, size=size)
        if size % page_size:
            raise ValueError(f"size {size} is not a multiple of page_size {page_size}")
        comps = shape.components
        if len(buffers) != len(comps) or any(len(b) != shape.layer_num for b in buffers):
            raise ValueError(
                f"expected {len(comps)} component(s) x {shape.layer_num} layers of buffers, got "
                f"{[len(b) for b in buffers]}"
            )
        first = buffers[0][0]
        for comp, per_layer in zip(comps, buffers, strict=True):
            for t in per_layer:
                if tuple(t.shape) != (size + page_size, *comp) or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(
                        f"KV buffer {tuple(t.shape)} {t.dtype} on {t.device} does not match "
                        f"{(size + page_size, *comp)} {first.dtype} on {first.device}"
                    )
                if not t.is_contiguous():
                    raise ValueError("KV buffers must be contiguous")
        pool = cls.__new__(cls)
        pool.shape = shape
        pool.page_size = page_size
        pool.size = size
        pool.dtype = first.dtype
        pool.itemsize = _itemsize(first.dtype)
        pool.device = first.device
        pool.layer_num = shape.layer_num
        pool.total_slots = size + page_size
        pool._buffers = [list(b) for b in buffers]
        return pool

    def _allocate(self, components: tuple[tuple[int, ...], ...]) -> list[list[torch.Tensor]]:
        shapes = [(self.total_slots, *comp) for comp in components]
        if self.device.type != "cpu":
            return [
                [torch.zeros(sh, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)] for sh in shapes
            ]
        # On the CPU, one zeroed huge-page buffer (alloc_cpu_buffer) cut into the per-layer
        # tensors: even a pool whose layers are under 2 MiB each gets huge pages.
        sizes = [math.prod(sh) for sh in shapes]
        flat = alloc_cpu_buffer(self.layer_num * sum(sizes), self.dtype, zero=True)
        out: list[list[torch.Tensor]] = [[] for _ in shapes]
        off = 0
        for _ in range(self.layer_num):
            for c, (sh, n) in enumerate(zip(shapes, sizes, strict=True)):
                out[c].append(flat[off : off + n].view(sh))
                off += n
        return out

    @property
    def size_bytes(self) -> int:
        """Bytes of all buffers, padding page included."""
        return self.total_slots * self.bytes_per_token

    def make_allocator(self) -> PagedSlotAllocator:
        """A fresh allocator over this pool's slots (page 0 reserved as padding)."""
        return PagedSlotAllocator(self.size, self.page_size, self.device, reserve_first_page=True)

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K buffer ``[total_slots, heads, head_dim]``; for MLA the
        latent buffer (SGLang's ``get_key_buffer``). ``O(1)``."""
        return self._buffers[0][_check_layer(layer, self.layer_num)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V buffer; for MLA the view ``latent[..., :kv_lora_rank]``
        (SGLang's ``get_value_buffer``). ``O(1)``."""
        _check_layer(layer, self.layer_num)
        if isinstance(self.shape, MLAShape):
            return self._buffers[0][layer][..., : self.shape.kv_lora_rank]
        return self._buffers[1][layer]

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s MLA latent buffer ``[total_slots, 1, rank + rope]``. ``O(1)``.

        Raises ``TypeError`` on an MHA pool, whose K and V are separate
        (:meth:`k_buffer`, :meth:`v_buffer`).
        """
        if not isinstance(self.shape, MLAShape):
            raise TypeError("kv_buffer() is for MLA pools; an MHA pool has k_buffer() and v_buffer()")
        return self._buffers[0][_check_layer(layer, self.layer_num)]

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """All buffers of one layer in component order: ``(K, V)`` or ``(latent,)``."""
        _check_layer(layer, self.layer_num)
        return tuple(comp[layer] for comp in self._buffers)

    def __repr__(self) -> str:
        return (
            f"DeviceKVPool({self.shape}, size={self.size}, page_size={self.page_size}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# ----------------------------------------------------------------------------- host memory
def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """``(MemAvailable, MemTotal)`` in bytes, from ``path`` or, where it does not exist,
    from ``os.sysconf`` (available = free physical pages there)."""
    try:
        with open(path) as f:
            fields = {}
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    fields[name.strip()] = int(parts[0]) * scale
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        if path != "/proc/meminfo":
            raise ValueError(f"cannot read MemAvailable/MemTotal from {path}") from None
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _bytes_like(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        flat = data.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if isinstance(data, bytes | bytearray | memoryview):
        # bytearray(): torch.frombuffer wants a writable buffer.
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    raise TypeError(f"page data must be bytes-like or a tensor, got {type(data).__name__}")


class HostKVPool(_KVPoolBase):
    """The L2 pool: host KV buffers with the shapes of a device pool, and their allocator.

    Build it from a device pool with :meth:`for_device` (``ratio`` or ``size_gb``) or
    directly. The whole pool is one flat buffer of ``dtype`` (pinned when CUDA is
    available, unless ``pin_memory`` says otherwise; else on transparent huge pages, see
    :func:`alloc_cpu_buffer`); typed views of it give each layout (module docstring).
    Host slots are ``0 .. size - 1``: no padding page. ``page_order`` is the byte order of
    the pages it hands to L3: ``"hiradix"`` or SGLang 0.5.18's (module docstring).

    Before allocating, the size is checked against ``MemAvailable`` minus a reserve
    (``reserve_bytes``; default the larger of 10% of ``MemTotal`` and 2 GiB), and a pool
    that does not fit raises ``ValueError`` naming the sizes, instead of being OOM killed
    later when its pages are first touched.

    >>> dev = DeviceKVPool(MLAShape(2, 8, 4), size=8, page_size=4, dtype=torch.float32)
    >>> host = HostKVPool.for_device(dev, ratio=2.0, layout="page_first")
    >>> host.size, host.page_bytes, host.alloc(8).tolist()
    (16, 384, [0, 1, 2, 3, 4, 5, 6, 7])
    """

    def __init__(
        self,
        shape: KVShape,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layout: HostLayout = "layer_first",
        *,
        page_order: PageOrder = "hiradix",
        pin_memory: bool | None = None,
        reserve_bytes: int | None = None,
        meminfo_path: str = "/proc/meminfo",
    ) -> None:
        if not isinstance(shape, MHAShape | MLAShape):
            raise TypeError(f"shape must be MHAShape or MLAShape, got {type(shape).__name__}")
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {HOST_LAYOUTS}, got {layout!r}")
        if page_order not in PAGE_ORDERS:
            raise ValueError(f"page_order must be one of {PAGE_ORDERS}, got {page_order!r}")
        _check_positive(page_size=page_size)
        self.shape = shape
        self.layout: HostLayout = layout
        self.page_order: PageOrder = page_order
        self.page_size = page_size
        self.size = (int(size) // page_size) * page_size
        if self.size < page_size:
            raise ValueError(f"host pool size {size} holds no whole page of {page_size} slots")
        self.dtype = dtype
        self.itemsize = _itemsize(dtype)
        self.layer_num = shape.layer_num
        self.page_num = self.size // page_size
        self._comp_shapes = shape.components
        self._comp_elems = tuple(math.prod(c) for c in self._comp_shapes)
        self._comp_offsets = tuple(sum(self._comp_elems[:i]) for i in range(len(self._comp_elems)))
        self._elems_per_layer = sum(self._comp_elems)  # per token, one layer, all components
        self._elems_per_token = self.layer_num * self._elems_per_layer
        self._page_elems = page_size * self._elems_per_token

        need = self.size * self.bytes_per_token
        avail, total = read_meminfo(meminfo_path)
        reserve = max(total // 10, _DEFAULT_RESERVE_MIN) if reserve_bytes is None else int(reserve_bytes)
        if reserve < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve}")
        allowed = max(0, avail - reserve)
        if need > allowed:
            raise ValueError(
                f"host KV pool of {self.size} tokens x {self.bytes_per_token} B = {need} B ({need / GIB:.2f} GiB) "
                f"does not fit: MemAvailable {avail} B ({avail / GIB:.2f} GiB) minus reserve {reserve} B "
                f"({reserve / GIB:.2f} GiB) leaves {allowed} B ({allowed / GIB:.2f} GiB); "
                f"lower the ratio / size_gb or reserve_bytes"
            )
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        # Not zeroed: that would touch every page of a pool sized in tens of GB at
        # start-up; slots are written before they are read. Huge pages: alloc_cpu_buffer.
        self._buf = alloc_cpu_buffer(self.size * self._elems_per_token, dtype, pin_memory=self.pin_memory)
        self.allocator = PagedSlotAllocator(self.size, page_size, "cpu", reserve_first_page=False)

    @property
    def backing_tensor(self) -> torch.Tensor:
        """The one flat tensor that holds every layer and component of the pool (for code
        that needs its address or whether it is pinned, such as the CUDA copy kernel)."""
        return self._buf

    @classmethod
    def for_device(
        cls,
        device_pool: DeviceKVPool,
        *,
        ratio: float | None = None,
        size_gb: float | None = None,
        layout: HostLayout = "layer_first",
        page_order: PageOrder = "hiradix",
        pin_memory: bool | None = None,
        reserve_bytes: int | None = None,
        meminfo_path: str = "/proc/meminfo",
    ) -> HostKVPool:
        """A host pool shaped like ``device_pool``, of ``ratio x device_pool.size`` tokens or
        of ``size_gb`` GB (1e9 bytes, SGLang's ``--hicache-size``); give at most one
        (default ``ratio=2.0``, SGLang's ``--hicache-ratio`` default). Rounded down to
        whole pages.
        """
        if ratio is not None and size_gb is not None:
            raise ValueError("give ratio or size_gb, not both")
        if size_gb is not None:
            if not size_gb > 0:
                raise ValueError(f"size_gb must be > 0, got {size_gb}")
            size = int(size_gb * GB) // device_pool.bytes_per_token
        else:
            r = 2.0 if ratio is None else ratio
            if not r > 0:
                raise ValueError(f"ratio must be > 0, got {r}")
            size = int(device_pool.size * r)
        return cls(
            device_pool.shape,
            size,
            device_pool.page_size,
            device_pool.dtype,
            layout,
            page_order=page_order,
            pin_memory=pin_memory,
            reserve_bytes=reserve_bytes,
            meminfo_path=meminfo_path,
        )

    # ------------------------------------------------------------------ sizes
    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers. ``O(1)``."""
        return self.page_size * self.bytes_per_token

    @property
    def size_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.size * self.bytes_per_token

    # ------------------------------------------------------------------ allocation
    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Page-aligned host slots for ``n_tokens`` (a page multiple), or ``None``: the
        slots of :meth:`alloc_array` as a tensor. See :meth:`PagedSlotAllocator.alloc`."""
        slots = self.alloc_array(n_tokens)
        return None if slots is None else torch.from_numpy(slots)

    def alloc_array(self, n_tokens: int) -> np.ndarray | None:
        """Page-aligned host slots for ``n_tokens`` as an int64 numpy array, or ``None``
        (:meth:`PagedSlotAllocator.alloc_array`): every host allocation goes through
        here. ``O(n_tokens)``."""
        return self.allocator.alloc_array(n_tokens)

    def free(self, indices: Any) -> None:
        """Free the pages of ``indices``; ``ValueError`` on double free or out of range,
        changing nothing. See :meth:`PagedSlotAllocator.free`."""
        self.allocator.free(indices)

    @property
    def logical_size(self) -> int:
        """Slots the tree indexes: :attr:`size` (SGLang's name, read when it sizes a draft
        model's host pool to match). ``O(1)``."""
        return self.size

    def available_size(self) -> int:
        """Free host slots. ``O(1)``."""
        return self.allocator.available_size()

    def clear(self) -> None:
        """Free every slot (the data is left as it is). ``O(pages)``."""
        self.allocator.clear()

    # ------------------------------------------------------------------ views
    def get_layer_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer`` as one ``[size, *shape]`` view per component, ``(K, V)`` or
        ``(latent,)``. Only ``layer_first`` stores a layer as one strided block; the
        page-first layouts raise ``ValueError``. ``O(1)``.
        """
        _check_layer(layer, self.layer_num)
        if self.layout != "layer_first":
            raise ValueError(
                f"layout {self.layout!r} interleaves layers inside each page; only 'layer_first' has a per-layer view"
            )
        return tuple(self._layer_first_view(layer, c) for c in range(len(self._comp_shapes)))

    def get_page_layer_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer`` as one ``[page_num, page_size, *shape]`` view per component, in
        every layout (strided for the page-first ones): host slot ``s`` of the layer is
        ``view[s // page_size, s % page_size]``. The copy engine's per-layer target. ``O(1)``.
        """
        _check_layer(layer, self.layer_num)
        views = []
        for c, comp_shape in enumerate(self._comp_shapes):
            if self.layout == "layer_first":
                views.append(self._layer_first_view(layer, c).view(self.page_num, self.page_size, *comp_shape))
                continue
            inner = tuple(math.prod(comp_shape[i + 1 :]) for i in range(len(comp_shape)))
            if self.layout == "page_first":
                offset = layer * self._elems_per_layer + self._comp_offsets[c]
                token_stride = self._elems_per_token
            else:  # page_first_direct
                offset = self.page_size * (layer * self._elems_per_layer + self._comp_offsets[c])
                token_stride = self._comp_elems[c]
            views.append(
                self._buf.as_strided(
                    (self.page_num, self.page_size, *comp_shape),
                    (self._page_elems, token_stride, *inner),
                    self._buf.storage_offset() + offset,
                )
            )
        return tuple(views)

    def _layer_first_view(self, layer: int, comp: int) -> torch.Tensor:
        # Component regions [layers, slots, E_c] follow each other.
        base = self.size * self.layer_num * self._comp_offsets[comp]
        n = self.size * self._comp_elems[comp]
        start = base + layer * n
        return self._buf[start : start + n].view(self.size, *self._comp_shapes[comp])

    def _page_id(self, host_index: int) -> int:
        host_index = int(host_index)
        if not 0 <= host_index < self.size or host_index % self.page_size:
            raise ValueError(
                f"host_index {host_index} is not a page start in [0, {self.size}) with page_size {self.page_size}"
            )
        return host_index // self.page_size

    @property
    def pages_in_place(self) -> bool:
        """Whether each page's bytes, in :attr:`page_order`, are one contiguous run of the
        pool (row ``p`` of :meth:`pages_array`): page-first layouts in hiradix's order,
        and every page-first layout of an MLA pool (one component: both orders agree).
        Where they are not, pages are gathered and scattered (:meth:`read_pages`)."""
        return self.layout != "layer_first" and (self.page_order == "hiradix" or len(self._comp_shapes) == 1)

    def _page_pieces(self) -> list[tuple[torch.Tensor, int]]:
        # Where a page's bytes (in page_order) sit in the pool: (view, offset) pairs, each
        # view a uint8 [page_num, *inner] view of the pool whose row p holds page p's
        # bytes offset .. offset + inner bytes; together they cover the page once.
        raw = self._buf.view(torch.uint8)
        if self.pages_in_place:
            return [(raw.view(self.page_num, self.page_bytes), 0)]
        isz, ps, layers = self.itemsize, self.page_size, self.layer_num
        sglang = self.page_order == "sglang"
        pieces: list[tuple[torch.Tensor, int]] = []
        if self.layout == "page_first" and sglang:
            # SGLang's page_first page: per component, [token, layer, E] token major.
            rows = raw.view(self.page_num, ps, layers, self._elems_per_layer * isz)
            offset = 0
            for c, e in enumerate(self._comp_elems):
                start = self._comp_offsets[c] * isz
                pieces.append((rows[..., start : start + e * isz], offset))
                offset += ps * layers * e * isz
            return pieces
        for layer in range(layers):
            for c, e in enumerate(self._comp_elems):
                run = ps * e * isz
                if self.layout == "layer_first":  # component regions [layers, slots, E_c]
                    base = (self.size * layers * self._comp_offsets[c] + layer * self.size * e) * isz
                    view = raw[base : base + self.page_num * run].view(self.page_num, run)
                else:  # page_first_direct (the other page-first cases are in place)
                    start = ps * (layer * self._elems_per_layer + self._comp_offsets[c]) * isz
                    view = raw.view(self.page_num, self.page_bytes)[:, start : start + run]
                if sglang:  # [components, layers, page_size, E]: K of every layer, then V
                    offset = ps * (layers * self._comp_offsets[c] + layer * e) * isz
                else:  # [layers, components, page_size, E]
                    offset = ps * (layer * self._elems_per_layer + self._comp_offsets[c]) * isz
                pieces.append((view, offset))
        return pieces

    def get_page_bytes(self, host_index: int) -> torch.Tensor:
        """The bytes of the page starting at slot ``host_index``, in :attr:`page_order`,
        as a 1-D uint8 tensor of :attr:`page_bytes`.

        Where :attr:`pages_in_place` this is a zero-copy view of the pool (write to it and
        the pool changes); otherwise a gathered copy.
        Runtime complexity: ``O(1)`` for a view, ``O(page_bytes)`` for a copy.
        """
        page = self._page_id(host_index)
        if self.pages_in_place:
            start = page * self._page_elems
            return self._buf[start : start + self._page_elems].view(torch.uint8)
        out = torch.empty((1, self.page_bytes), dtype=torch.uint8)
        self.read_pages([host_index], out)
        return out[0]

    def set_page_bytes(self, host_index: int, data: Any) -> None:
        """Overwrite the page starting at slot ``host_index`` with ``data`` (bytes-like or a
        tensor of exactly :attr:`page_bytes` bytes, in the order :meth:`get_page_bytes`
        returns). Runtime complexity: ``O(page_bytes)``.
        """
        self._page_id(host_index)
        src = _bytes_like(data)
        if src.numel() != self.page_bytes:
            raise ValueError(f"page data has {src.numel()} bytes, a page has {self.page_bytes}")
        self.write_pages([host_index], src.cpu().view(1, -1))

    # ------------------------------------------------------------------ whole pages, batched
    def page_ids(self, host_indices: Any) -> np.ndarray:
        """Page numbers of page-start slots ``host_indices`` (int64 numpy); ``ValueError``
        if any is not a page start in the pool. ``O(n)``."""
        starts = np.asarray(host_indices.cpu() if isinstance(host_indices, torch.Tensor) else host_indices)
        starts = starts.astype(np.int64, copy=False).reshape(-1)
        if starts.size and (
            int(starts.min()) < 0 or int(starts.max()) >= self.size or bool((starts % self.page_size).any())
        ):
            raise ValueError(f"host indices must be page starts in [0, {self.size}) with page_size {self.page_size}")
        return starts // self.page_size

    def pages_array(self) -> np.ndarray:
        """The pool as a ``[page_num, page_bytes]`` uint8 numpy array sharing its memory:
        row ``p`` is page ``p``'s bytes in :meth:`get_page_bytes` order. Only where
        :attr:`pages_in_place` (elsewhere a page is scattered over the pool: use
        :meth:`read_pages` / :meth:`write_pages`). ``O(1)``."""
        if not self.pages_in_place:
            raise ValueError(
                f"{self.layout} pages in {self.page_order} order are not contiguous; use read_pages / write_pages"
            )
        return self._buf.view(torch.uint8).numpy().reshape(self.page_num, self.page_bytes)

    def _native_pieces_copy(self, pages: np.ndarray, rows: torch.Tensor, to_pool: bool) -> bool:
        # With the compiled row copy: one GIL-free copy_rows per piece, between the pool
        # and the page rows, each piece cut into its contiguous runs (one per page, or
        # per page, token and layer for SGLang's page_first order). False: not built.
        if _gather is None:
            return False
        pool_bytes = self._buf.view(torch.uint8).numpy()
        row_bytes = rows.numpy().reshape(-1)
        row_starts = np.arange(len(pages), dtype=np.int64) * self.page_bytes
        base = self._buf.view(torch.uint8).storage_offset()
        for view, offset in self._page_pieces():
            run = view.shape[-1]  # the innermost dimension is contiguous in every piece
            inner = np.zeros(1, dtype=np.int64)  # pool offsets of a piece's runs inside a page
            for size, stride in zip(view.shape[1:-1], view.stride()[1:-1], strict=True):
                inner = (inner[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
            first = int(view.storage_offset() - base)  # byte offset of the piece in page 0
            seg = (first + pages[:, None] * view.stride(0) + inner[None, :]).reshape(-1)
            dst = (row_starts[:, None] + np.arange(len(inner), dtype=np.int64)[None, :] * run).reshape(-1)
            if to_pool:
                _gather.copy_rows(pool_bytes, seg, 0, row_bytes, dst, offset, run)
            else:
                _gather.copy_rows(row_bytes, dst, offset, pool_bytes, seg, 0, run)
        return True

    def _check_rows(self, rows: torch.Tensor, n: int, name: str) -> None:
        if tuple(rows.shape) != (n, self.page_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 [{n}, {self.page_bytes}], got {rows.dtype} {tuple(rows.shape)}")

    def read_pages(self, host_indices: Any, out: torch.Tensor) -> None:
        """Copy the pages starting at ``host_indices`` into the rows of ``out`` (uint8
        ``[n, page_bytes]``), in :meth:`get_page_bytes` order: one copy (compiled and
        GIL-free where built) where :attr:`pages_in_place`, else one per piece of a page:
        per layer and component, or per component for SGLang's ``page_first`` order.
        Runtime complexity: ``O(n x page_bytes)``."""
        pages = torch.from_numpy(self.page_ids(host_indices))
        self._check_rows(out, len(pages), "out")
        if out.is_contiguous() and self._native_pieces_copy(pages.numpy(), out, to_pool=False):
            return
        if self.pages_in_place:
            torch.index_select(torch.from_numpy(self.pages_array()), 0, pages, out=out)
            return
        for view, offset in self._page_pieces():
            inner = view.shape[1:]
            out[:, offset : offset + math.prod(inner)].view(len(pages), *inner).copy_(view.index_select(0, pages))

    def write_pages(self, host_indices: Any, src: torch.Tensor) -> None:
        """Overwrite the pages starting at ``host_indices`` with the rows of ``src``
        (uint8 ``[n, page_bytes]``, :meth:`get_page_bytes` order); the inverse of
        :meth:`read_pages`. Runtime complexity: ``O(n x page_bytes)``."""
        pages = torch.from_numpy(self.page_ids(host_indices))
        self._check_rows(src, len(pages), "src")
        if src.is_contiguous() and self._native_pieces_copy(pages.numpy(), src, to_pool=True):
            return
        if self.pages_in_place:
            # index_copy_, not [pages] = ...: torch's advanced indexing is ~1000x slower
            # than index_select / index_copy_ on large index tensors (copy._row_plan).
            torch.from_numpy(self.pages_array()).index_copy_(0, pages, src)
            return
        for view, offset in self._page_pieces():
            inner = view.shape[1:]
            view.index_copy_(0, pages, src[:, offset : offset + math.prod(inner)].reshape(len(pages), *inner))

    def __repr__(self) -> str:
        return (
            f"HostKVPool({self.shape}, size={self.size}, page_size={self.page_size}, dtype={self.dtype}, "
            f"layout={self.layout!r}, page_order={self.page_order!r}, pinned={self.pin_memory})"
        )
