"""SGLang 0.5.23's own JIT HiCache transfer kernels, run on hiradix's pools (issue 44, item 5).

The anchor for :class:`~hiradix.memory.CudaCopyEngine`: the kernels stock SGLang loads KV
back with, built from SGLang's carried source (``.gpu/sglang-0.5.23.tar.gz``, see
``bench/gpu/README.md``) by SGLang's own JIT loader (``apache-tvm-ffi`` + ``ninja`` + nvcc),
and called through SGLang's own Python entry points in
``sglang.kernels.ops.kvcache.hicache``, the way SGLang's host pools
(``sglang/srt/mem_cache/pool_host/mha.py`` and ``mla.py``, ``io_backend="kernel"``) call
them, only on a :class:`~hiradix.memory.DeviceKVPool` and a pinned
:class:`~hiradix.memory.HostKVPool`. Nothing of SGLang's is copied here: this module picks
the entry point and hands it hiradix's tensors and pointer tables.

What SGLang 0.5.23 calls, per host layout and direction (MHA; MLA takes the ``*_mla``
twin of each, with the latent buffer):

================  ===========================================  ===========================================
layout            load (host -> device, per layer)             backup (device -> host, all layers)
================  ===========================================  ===========================================
``layer_first``   ``transfer_hicache_one_layer`` on the         ``transfer_hicache_all_layer`` over per-layer
                  layer's K and V                               pointer tables, row strides in bytes
``page_first``    ``transfer_hicache_one_layer`` on the         with packed device rows (ours):
                  strided per-layer view (row stride = one      ``transfer_hicache_all_layer_staged_lf_pf``;
                  token over all layers)                        otherwise ``transfer_hicache_all_layer``
                                                                with the token stride
================  ===========================================  ===========================================

The variants (``variant=``):

``"register"``  the register kernel (``hicache.cuh``, ``HiCacheKernel``) at SGLang's CUDA
                block quota, ``DEFAULT_BLOCK_QUOTA`` = 2: what SGLang runs with
                ``SGLANG_HICACHE_TMA_TRANSFER=0``.
``"tma"``       the TMA kernel (``hicache_tma.cuh``, sm_90+), block quota
                ``TMA_BLOCK_QUOTA`` = 4, where SGLang's own gate (``use_hicache_tma_kernel``)
                takes it; where the gate would fall back to the register kernel (page size
                not a multiple of the rows a TMA chunk moves, e.g. page 1; a GPU below sm_90)
                this raises ``NotImplementedError`` saying why, rather than time the
                register kernel under the TMA's name.
``"staged"``    SGLang's page_first write-back (``staged_write_back.cuh``: a relayout kernel
                into device staging, then ``cudaMemcpyBatchAsync`` of whole pages), the
                backup stock SGLang runs for page_first. It writes each component's pages as
                ``[page_size, layers, row]`` runs, which is hiradix's page_first for MLA (one
                component) but not for MHA, whose K|V split sits inside each (token, layer)
                row: there it raises ``NotImplementedError``. Load has no staged kernel.
``"default"``   whatever stock SGLang 0.5.23 picks on this GPU (``SGLANG_HICACHE_TMA_TRANSFER``
                defaults to on): the TMA kernel where its gate passes, else the register
                kernel; page_first backup is the staged write-back.

For page_first backup, ``"register"`` and ``"tma"`` run ``transfer_hicache_all_layer``
with hiradix's token stride: SGLang's own page_first branch for device rows that are not
packed (its staged write-back does not have a TMA or register-kernel form). :func:`plan`
says, for each case, which SGLang function and kernel run, so a table can label its rows.

Index tensors are CUDA int64, paired in order (``host_idx[i]`` <-> ``dev_idx[i]``), as
SGLang's controller hands them to the kernels; the staged write-back also needs the host
indices on the CPU (SGLang keeps them there for it), given as ``host_idx_cpu=`` or copied
once (a synchronising ``.cpu()``). The kernels launch on the current stream; the caller
synchronises.

Fail soft: every failure (import, JIT build with the compiler's message, a case SGLang has
no kernel for) is an exception from the call that met it; nothing is caught here, so a
benchmark can record it and go on.

Warm the JIT cache first (one nvcc run per module; ``--arch 90`` compiles for sm_90 on a
machine without a GPU)::

    python bench/sglang_kernels.py --compile-only [--arch 90] [--source .gpu/sglang-0.5.23.tar.gz]

``python bench/sglang_kernels.py --self-test`` (on a GPU) runs every case on small pools and
checks the bytes. Never imported by the package or its tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import sglang_src

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_SOURCE",
    "VARIANTS",
    "Plan",
    "SGLangLayerEngine",
    "compare_rows",
    "compile_modules",
    "load_sglang_kernels",
    "plan",
    "sglang_backup",
    "sglang_load",
]

Variant = Literal["register", "tma", "staged", "default"]
VARIANTS: tuple[Variant, ...] = ("register", "tma", "staged", "default")
Direction = Literal["load", "backup"]
HICACHE = "sglang.kernels.ops.kvcache.hicache"
DEFAULT_SOURCE = str(Path(__file__).resolve().parent.parent / ".gpu" / "sglang-0.5.23.tar.gz")
#: Where SGLang's JIT loader keeps its builds (``SGLANG_JIT_CACHE_DIR``) unless set already.
DEFAULT_CACHE_DIR = "/tmp/sglang-jit"
#: Row widths the transfer benchmark moves: Llama-3-8B's K or V row (8 heads x 128 x bf16)
#: and DeepSeek-V3's MLA latent row (576 x bf16).
ROW_BYTES = (2048, 1152)
#: Row widths of the staged write-back's modules: MLA rows only (it cannot target an MHA
#: page_first pool of hiradix's, see the module docstring).
STAGED_ROW_BYTES = (1152,)


# ----------------------------------------------------------------------------- loading
def _find_cuda_home() -> str | None:
    """The CUDA root whose ``lib64`` holds ``libcudart`` (SGLang links ``-L$CUDA_HOME/lib64
    -lcudart``). SGLang takes ``nvcc``'s grandparent, which is wrong where ``nvcc`` on
    ``PATH`` is a wrapper script (``/usr/local/bin/nvcc`` on this project's CPU machines)."""
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.isfile(os.path.join(home, "bin", "nvcc")) and any(Path(home, "lib64").glob("libcudart.so*")):
            return home
    return None


def _ensure_ninja() -> None:
    """Put a ``ninja`` executable on ``PATH`` (SGLang's loader runs ``ninja -f build.ninja``):
    the one there, else the ``ninja`` wheel's, which ``pip install --target DIR`` puts in
    ``DIR/bin`` (``bench/gpu/setup.sh``: ``/tmp/site/bin``)."""
    if shutil.which("ninja"):
        return
    dirs = [Path(p) / "bin" for p in sys.path if p]
    with contextlib.suppress(ImportError):
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, Path(ninja.BIN_DIR))
    for d in dirs:
        if (d / "ninja").is_file() and os.access(d / "ninja", os.X_OK):
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            return
    raise RuntimeError("no ninja executable: SGLang's JIT loader needs one (the ninja wheel, bench/gpu/prepare.sh)")


def load_sglang_kernels(
    source: str | Path = DEFAULT_SOURCE, *, dest: str | Path = "/tmp/sglang-src"
) -> types.ModuleType:
    """Import SGLang's ``sglang.kernels.ops.kvcache.hicache`` from its source (the carried
    tarball, or an installed SGLang), through :mod:`sglang_src`'s placeholders, and set up
    what its JIT loader reads: ``SGLANG_JIT_CACHE_DIR`` (default :data:`DEFAULT_CACHE_DIR`),
    ``CUDA_HOME`` (see :func:`_find_cuda_home`) and ``ninja`` on ``PATH``; each only where
    it is not set already. Nothing compiles here: each kernel module is built (or taken
    from the cache) on first use, or by :func:`compile_modules`. ``O(1)`` after the first
    call (about 3 s of imports)."""
    os.environ.setdefault("SGLANG_JIT_CACHE_DIR", DEFAULT_CACHE_DIR)
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        home = _find_cuda_home()
        if home:
            os.environ["CUDA_HOME"] = home
    _ensure_ninja()
    return sglang_src.load_sglang_module(source, HICACHE, dest=dest)


def _hc() -> types.ModuleType:
    mod = sys.modules.get(HICACHE)
    if mod is None:
        raise RuntimeError("call load_sglang_kernels() first")
    return mod


# ----------------------------------------------------------------------------- modules
# SGLang's module factories (cache_once: each is built once per process, or found in the
# JIT cache). Private names of SGLang's, called directly so that a build error reaches the
# caller with the compiler's message: SGLang's own gates log it and fall back instead.
def _register_module(hc: types.ModuleType, row_bytes: int) -> Any:
    unroll = hc._default_unroll(row_bytes)
    if not hc._tiles_across_lanes(row_bytes, unroll):
        raise NotImplementedError(
            f"SGLang's register kernel does not take {row_bytes}-byte rows (its host pool falls back to sgl_kernel)"
        )
    return hc._jit_hicache_module(element_size=row_bytes, unroll=unroll, block_quota=hc.DEFAULT_BLOCK_QUOTA)


def _tma_module(hc: types.ModuleType) -> Any:
    return hc._jit_hicache_tma_module(block_quota=hc.TMA_BLOCK_QUOTA)


def _staged_module(hc: types.ModuleType, row_bytes: int) -> Any:
    return hc._jit_hicache_staged_module(
        element_size=row_bytes, unroll=hc._default_unroll(row_bytes), block_quota=hc.DEFAULT_BLOCK_QUOTA
    )


def _module_builders(
    hc: types.ModuleType, row_bytes: tuple[int, ...], staged_row_bytes: tuple[int, ...]
) -> dict[str, Callable[[], Any]]:
    builders: dict[str, Callable[[], Any]] = {}
    for rb in row_bytes:
        builders[f"register-{rb}"] = lambda rb=rb: _register_module(hc, rb)
    builders["tma"] = lambda: _tma_module(hc)
    for rb in staged_row_bytes:
        builders[f"staged-{rb}"] = lambda rb=rb: _staged_module(hc, rb)
    return builders


def compile_modules(
    row_bytes: tuple[int, ...] = ROW_BYTES,
    staged_row_bytes: tuple[int, ...] = STAGED_ROW_BYTES,
    *,
    arch: int | None = None,
    jobs: int | None = None,
) -> dict[str, dict]:
    """Build (or find in the JIT cache) every SGLang module the variants use: the register
    kernel per width of ``row_bytes``, the TMA kernel (one module for every width) and the
    staged write-back per width of ``staged_row_bytes``, all at once (one nvcc each). ``arch``
    (e.g. ``90``) compiles for that GPU instead of the local one, through SGLang's
    ``override_jit_cuda_arch``; on the device leave it out, so the cache key is the one the
    benchmark will look up (an H100/H200 gives sm_90a either way). Returns, per module,
    ``{"ok", "seconds", "error"}``; never raises for a failed build."""
    hc = _hc()
    from sglang.kernels.jit.utils import override_jit_cuda_arch

    ctx = override_jit_cuda_arch(arch // 10, arch % 10) if arch else contextlib.nullcontext()
    builders = _module_builders(hc, row_bytes, staged_row_bytes)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()

    def timed(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    with ctx, ThreadPoolExecutor(max_workers=jobs or len(builders)) as pool:
        futures = {pool.submit(timed, fn): name for name, fn in builders.items()}
        for fut in as_completed(futures):
            name = futures[fut]
            try:
                results[name] = {"ok": True, "seconds": round(fut.result(), 2), "error": None}
            except Exception as e:  # reported, never raised: the benchmark goes on without it
                results[name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 2), "error": str(e)}
            r = results[name]
            print(f"[sglang-jit] {name}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s", flush=True)
            if not r["ok"]:
                print(r["error"][-4000:], flush=True)
    return results


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True, slots=True)
class Plan:
    """What one (pool pair, direction, variant) runs: SGLang's entry point and kernel."""

    direction: Direction
    layout: str
    mla: bool
    variant: Variant
    function: str  #: SGLang's function in ``sglang.kernels.ops.kvcache.hicache``
    kernel: Literal["register", "tma", "staged"]
    block_quota: int  #: CTAs per launch at most (the staged write-back: of its relayout kernel)
    note: str = ""

    def label(self) -> str:
        """A short row label, e.g. ``sglang-tma (transfer_hicache_one_layer, 4 CTAs)``."""
        return f"sglang-{self.kernel} ({self.function}, {self.block_quota} CTAs)"


def _row_bytes(pool: Any) -> int:
    comps = pool.shape.components
    if len({c for c in comps}) != 1:
        raise NotImplementedError(
            "K and V rows of different widths: SGLang's AsymmetricMHATokenToKVPoolHost moves them with sgl_kernel "
            "only, no JIT kernel"
        )
    n = 1
    for d in comps[0]:
        n *= d
    return n * pool.itemsize


def _tma_refusal(hc: types.ModuleType, row_bytes: int, page_size: int) -> str | None:
    """Why SGLang's gate (``use_hicache_tma_kernel``) would not take the TMA kernel for
    these rows and pages, or ``None`` where it would. A build failure raises (with the
    compiler's message) instead of reading as a refusal, as it does in SGLang's gate."""
    from sglang.srt.environ import envs

    if not envs.SGLANG_HICACHE_TMA_TRANSFER.get():
        return "SGLANG_HICACHE_TMA_TRANSFER is off"
    if row_bytes % 16:
        return f"{row_bytes}-byte rows are not a multiple of 16 bytes"
    cap = torch.cuda.get_device_capability()
    if cap[0] < 9:
        return f"the TMA kernel needs sm_90 or newer; this GPU is sm_{cap[0]}{cap[1]}"
    rows = hc.hicache_tma_rows_per_chunk(row_bytes)
    if page_size % rows:
        return (
            f"page size {page_size} is not a multiple of the {rows} rows a TMA chunk moves at {row_bytes} bytes a row "
            "(SGLang runs its register kernel here)"
        )
    if not _tma_module(hc).fits_device(torch.cuda.current_device()):
        return "the TMA kernel's shared-memory ring does not fit this GPU"
    if not hc.use_hicache_tma_kernel(element_size=row_bytes, block_quota=hc.TMA_BLOCK_QUOTA, page_size=page_size):
        return "SGLang's use_hicache_tma_kernel says no"
    return None


_PLANS: dict[tuple, Plan] = {}


def plan(dev: Any, host: Any, direction: Direction, variant: Variant) -> Plan:
    """Which SGLang entry point and kernel ``variant`` runs for ``direction`` between
    ``dev`` and ``host`` (module docstring). Builds the kernel's JIT module (the first
    time; a failed build raises with the compiler's message); raises
    ``NotImplementedError`` saying why where SGLang has no such kernel for the case.
    Cached per (layout, kind, row width, page size, direction, variant)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if direction not in ("load", "backup"):
        raise ValueError(f"direction must be 'load' or 'backup', got {direction!r}")
    hc = _hc()
    layout, mla, ps = host.layout, bool(host.is_mla), host.page_size
    if layout not in ("layer_first", "page_first"):
        raise NotImplementedError(
            f"host layout {layout!r}: SGLang moves it with io_backend 'direct' (sgl_kernel), no JIT kernel"
        )
    if dev.page_size != ps or dev.shape != host.shape or dev.dtype != host.dtype:
        raise ValueError("device and host pools differ in page size, shape or dtype")
    if not host.pin_memory:
        raise ValueError("SGLang's kernels read and write the host pool in place: it must be pinned")
    rb = _row_bytes(host)
    key = (layout, mla, rb, ps, direction, variant)
    if key in _PLANS:
        return _PLANS[key]
    suffix = "_mla" if mla else ""
    staged_default = direction == "backup" and layout == "page_first"
    kind = variant
    note = ""
    if variant == "default" and staged_default:
        kind = "staged"
    elif variant == "default":
        # SGLang's gate logs a failed TMA build and takes the register kernel; so does this.
        try:
            kind = "tma" if _tma_refusal(hc, rb, ps) is None else "register"
        except Exception as e:
            kind, note = "register", f"the TMA kernel failed to build: {str(e)[-500:]}"
    if kind == "staged":
        if direction == "load":
            raise NotImplementedError("SGLang has no staged kernel for load (its load is one kernel per layer)")
        if layout != "page_first":
            raise NotImplementedError("SGLang's staged write-back is for the page_first host layout only")
        if not mla:
            raise NotImplementedError(
                "SGLang's staged page_first write-back copies each component's page as one [page_size, layers, row] "
                "run; hiradix's MHA page_first keeps K|V inside each (token, layer) row, so it cannot be the target"
            )
        _staged_module(hc, rb)
        p = Plan(direction, layout, mla, variant, f"transfer_hicache_all_layer{suffix}_staged_lf_pf", "staged",
                 hc.DEFAULT_BLOCK_QUOTA, "stock SGLang's page_first backup")  # fmt: skip
    else:
        if kind == "tma":
            why = _tma_refusal(hc, rb, ps)
            if why is not None:
                raise NotImplementedError(f"SGLang's TMA kernel is not used here: {why}")
            quota = hc.TMA_BLOCK_QUOTA
        else:
            _register_module(hc, rb)
            quota = hc.DEFAULT_BLOCK_QUOTA
        if direction == "load":
            fn = f"transfer_hicache_one_layer{suffix}"
        else:
            fn = f"transfer_hicache_all_layer{suffix}"
            if staged_default:
                note = "SGLang's page_first branch for unpacked device rows; stock (packed rows) stages instead"
        p = Plan(direction, layout, mla, variant, fn, kind, quota, note)  # type: ignore[arg-type]
    _PLANS[key] = p
    return p


@contextlib.contextmanager
def _tma_gate(hc: types.ModuleType, take: bool | None) -> Iterator[None]:
    """SGLang's entry points ask ``use_hicache_tma_kernel`` (a module global, memoised per
    argument tuple) whether to take the TMA kernel. ``take`` answers it for the duration:
    ``False`` is what ``SGLANG_HICACHE_TMA_TRANSFER=0`` answers, ``True`` is only given
    where :func:`plan` found that SGLang's own gate says yes; ``None`` leaves it alone."""
    if take is None:
        yield
        return
    real = hc.use_hicache_tma_kernel
    hc.use_hicache_tma_kernel = lambda **_: take
    try:
        yield
    finally:
        hc.use_hicache_tma_kernel = real


# ----------------------------------------------------------------------------- pools
class _Binding:
    """What SGLang's host pool builds once at start-up, for one (device, host) pair:
    per-layer views, the pointer tables of the all-layer kernels and the staging buffer of
    the staged write-back (made on first use)."""

    def __init__(self, dev: Any, host: Any) -> None:
        device = dev.device
        self.dev_bufs = [dev.layer_buffers(layer) for layer in range(dev.layer_num)]
        # [page_num, page_size, *shape] per component, strided in page_first; the kernels
        # view it as [size, row] with the row stride as is (SGLang's k_data_refs).
        self.host_views = [host.get_page_layer_view(layer) for layer in range(host.layer_num)]
        n_comp = len(self.dev_bufs[0])

        def table(tensors: list[torch.Tensor]) -> torch.Tensor:
            # CUDA's UVA: a pinned host address is the device address (SGLang's
            # make_kernel_ptr_table does the same without sgl_kernel).
            return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)

        self.dev_ptrs = [table([bufs[c] for bufs in self.dev_bufs]) for c in range(n_comp)]
        self.host_ptrs = [table([views[c] for views in self.host_views]) for c in range(n_comp)]
        self.dev_stride = self.dev_bufs[0][0].stride(0) * dev.itemsize
        self.host_stride = self.host_views[0][0].stride(1) * host.itemsize
        self.row_elems = self.dev_bufs[0][0][0].numel()
        self.staging: torch.Tensor | None = None

    def staging_for(self, dev: Any, host: Any) -> torch.Tensor:
        # SGLang's MLA host pool: min(page_num, 64) pages of [tokens, layers, 1, row].
        if self.staging is None:
            tokens = min(host.page_num, 64) * host.page_size
            self.staging = torch.empty((tokens, host.layer_num, 1, self.row_elems), dtype=host.dtype, device=dev.device)
        return self.staging


_BINDINGS: weakref.WeakKeyDictionary[Any, tuple[weakref.ref, _Binding]] = weakref.WeakKeyDictionary()


def _binding(dev: Any, host: Any) -> _Binding:
    hit = _BINDINGS.get(host)
    if hit is not None and hit[0]() is dev:
        return hit[1]
    b = _Binding(dev, host)
    _BINDINGS[host] = (weakref.ref(dev), b)
    return b


def _check_indices(a: torch.Tensor, b: torch.Tensor) -> None:
    for t in (a, b):
        if not (isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.int64 and t.dim() == 1):
            raise TypeError("indices must be 1-D CUDA int64 tensors")
    if a.numel() != b.numel():
        raise ValueError(f"index tensors differ in length: {a.numel()} and {b.numel()}")


def sglang_load(
    dev: Any,
    host: Any,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    variant: Variant,
    *,
    layers: range | None = None,
) -> Plan:
    """Load every layer (or ``layers``) host -> device with SGLang's kernel, one call per
    layer as SGLang's ``load_to_device_per_layer`` (``transfer_hicache_one_layer[_mla]``);
    rows ``host_idx[i]`` -> ``dev_idx[i]``. Returns the :class:`Plan` that ran. Launches on
    the current stream and does not synchronise. ``O(layers)`` launches."""
    _check_indices(host_idx, dev_idx)
    p = plan(dev, host, "load", variant)
    hc, b = _hc(), _binding(dev, host)
    ps, el = host.page_size, b.row_elems
    which = range(dev.layer_num) if layers is None else layers
    dev_bufs, host_views = [b.dev_bufs[i] for i in which], [b.host_views[i] for i in which]
    with _tma_gate(hc, None if variant == "default" else p.kernel == "tma"):
        if host.is_mla:
            fn = hc.transfer_hicache_one_layer_mla
            for (d,), (h,) in zip(dev_bufs, host_views, strict=True):
                fn(page_size=ps, cache_dst=d, cache_src=h, indices_dst=dev_idx, indices_src=host_idx, element_dim=el)
        else:
            fn = hc.transfer_hicache_one_layer
            for (dk, dv), (hk, hv) in zip(dev_bufs, host_views, strict=True):
                fn(
                    page_size=ps,
                    k_cache_dst=dk,
                    v_cache_dst=dv,
                    k_cache_src=hk,
                    v_cache_src=hv,
                    indices_dst=dev_idx,
                    indices_src=host_idx,
                    element_dim=el,
                )
    return p


def sglang_backup(
    dev: Any,
    host: Any,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    variant: Variant,
    *,
    host_idx_cpu: torch.Tensor | None = None,
) -> Plan:
    """Back up every layer device -> host with SGLang's kernel, in one call as SGLang's
    ``backup_from_device_all_layer`` (module docstring for which); rows ``dev_idx[i]`` ->
    ``host_idx[i]``. The staged write-back takes the host indices on the CPU:
    ``host_idx_cpu`` (int64), else ``host_idx.cpu()`` here, which synchronises. Returns the
    :class:`Plan` that ran. Launches on the current stream and does not synchronise."""
    _check_indices(host_idx, dev_idx)
    p = plan(dev, host, "backup", variant)
    hc, b = _hc(), _binding(dev, host)
    ps, isz = host.page_size, host.itemsize
    if p.kernel == "staged":
        dst = host.backing_tensor.view(host.size, host.layer_num, 1, b.row_elems)
        hc.transfer_hicache_all_layer_mla_staged_lf_pf(
            ptr_src=b.dev_ptrs[0],
            src_indices=dev_idx,
            dst_indices=host_idx.cpu() if host_idx_cpu is None else host_idx_cpu,
            staging=b.staging_for(dev, host),
            dst=dst,
            page_size=ps,
        )
        return p
    with _tma_gate(hc, None if variant == "default" else p.kernel == "tma"):
        if host.is_mla:
            hc.transfer_hicache_all_layer_mla(
                page_size=ps,
                ptr_dst=b.host_ptrs[0],
                indices_dst=host_idx,
                ptr_src=b.dev_ptrs[0],
                indices_src=dev_idx,
                cache_dst_stride_bytes=b.host_stride,
                cache_src_stride_bytes=b.dev_stride,
                element_size=b.row_elems * isz,
            )
        else:
            hc.transfer_hicache_all_layer(
                page_size=ps,
                k_ptr_dst=b.host_ptrs[0],
                v_ptr_dst=b.host_ptrs[1],
                indices_dst=host_idx,
                k_ptr_src=b.dev_ptrs[0],
                v_ptr_src=b.dev_ptrs[1],
                indices_src=dev_idx,
                kv_cache_dst_stride_bytes=b.host_stride,
                kv_cache_src_stride_bytes=b.dev_stride,
                element_size=b.row_elems * isz,
            )
    return p


# ----------------------------------------------------------------------------- engine
class _LayerHandle:
    """One load of :class:`SGLangLayerEngine`: an event per layer on its stream (hiradix's
    ``LoadHandle`` interface, as the controller and SGLang's pool use it)."""

    def __init__(self, events: list[torch.cuda.Event], start: torch.cuda.Event, keep: list[torch.Tensor]) -> None:
        self.layer_num = len(events)
        self._events, self._start, self._keep = events, start, keep

    def done(self) -> bool:
        return bool(self._events[-1].query())

    @property
    def error(self) -> BaseException | None:
        return None

    @property
    def duration_s(self) -> float | None:
        return self._start.elapsed_time(self._events[-1]) / 1e3 if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        self._events[-1].synchronize()

    def wait_until(self, layer: int, timeout: float | None = None) -> None:
        torch.cuda.current_stream().wait_event(self._events[layer])


class SGLangLayerEngine:
    """SGLang's kernels behind hiradix's copy-engine interface (``hiradix.memory.CopyEngine``'s
    methods; loads layer by layer, the way stock SGLang's controller loads:
    ``load_to_device_per_layer`` on its own stream, an event after each layer), so the same
    controller, counter and pool drive stock's kernels and ours in
    ``bench/layer_wait_gpu.py``. ``layer_delay_cycles`` spins before each layer (the wait
    check's slowed loads); ``stream_priority`` as hiradix's engine. Imports nothing of
    hiradix, so the JIT warm-up runs while hiradix is still being built."""

    fence_stream: torch.cuda.Stream | None = None

    def __init__(self, variant: Variant, *, layer_delay_cycles: int = 0, stream_priority: int = 0) -> None:
        self.variant = variant
        self.layer_delay_cycles = layer_delay_cycles
        self._stream = torch.cuda.Stream(priority=stream_priority)

    def _indices(self, a: Any) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64).to("cuda", non_blocking=True)

    def load(self, host_pool: Any, device_pool: Any, host_indices: Any, device_indices: Any) -> _LayerHandle:
        self._stream.wait_stream(torch.cuda.current_stream())
        if self.fence_stream is not None:
            self._stream.wait_stream(self.fence_stream)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(device_pool.layer_num + 1)]
        with torch.cuda.stream(self._stream):
            h, d = self._indices(host_indices), self._indices(device_indices)
            events[0].record()
            for layer in range(device_pool.layer_num):
                if self.layer_delay_cycles:
                    torch.cuda._sleep(self.layer_delay_cycles)
                sglang_load(device_pool, host_pool, h, d, self.variant, layers=range(layer, layer + 1))
                events[layer + 1].record()
        return _LayerHandle(events[1:], events[0], [h, d])

    def backup(self, device_pool: Any, host_pool: Any, device_indices: Any, host_indices: Any) -> _LayerHandle:
        self._stream.wait_stream(torch.cuda.current_stream())
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        with torch.cuda.stream(self._stream):
            d, h = self._indices(device_indices), self._indices(host_indices)
            events[0].record()
            sglang_backup(device_pool, host_pool, d, h, self.variant)
            events[1].record()
        return _LayerHandle(events[1:], events[0], [h, d])

    def query(self, handle: _LayerHandle) -> bool:
        return handle.done()

    def close(self) -> None:
        self._stream.synchronize()


# ----------------------------------------------------------------------------- bytes
def compare_rows(
    dev: Any, host: Any, host_idx: torch.Tensor, dev_idx: torch.Tensor, *, layers: list[int] | None = None
) -> list[str]:
    """Compare, byte for byte, device rows ``dev_idx[i]`` with host rows ``host_idx[i]`` of
    every layer (or of ``layers``) and component, by plain indexing (no copy engine, no
    SGLang): after a load or a backup they must be equal. Returns one line per (layer,
    component) that differs, empty where all are equal. ``O(layers x rows)`` bytes moved
    to the CPU."""
    h_idx = host_idx.cpu()
    bad = []
    for layer in range(dev.layer_num) if layers is None else layers:
        for c, (d, h) in enumerate(zip(dev.layer_buffers(layer), host.get_page_layer_view(layer), strict=True)):
            d_rows = d.index_select(0, dev_idx).cpu().view(torch.uint8)
            h_rows = h.flatten(0, 1).index_select(0, h_idx).view(torch.uint8)
            if not torch.equal(d_rows, h_rows):
                n = int((d_rows != h_rows).flatten(1).any(1).sum())
                bad.append(f"layer {layer} component {c}: {n} of {len(h_idx)} rows differ")
    return bad


# ----------------------------------------------------------------------------- self-test
def _self_test(args: argparse.Namespace) -> int:
    from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape, MLAShape

    shapes = {"mha": MHAShape(layer_num=4, head_num=8, head_dim=128), "mla": MLAShape(4, 512, 64)}
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for model, shape in shapes.items():
        for layout in ("layer_first", "page_first"):
            for ps in args.page_sizes:
                pages = 32
                dev = DeviceKVPool(shape, size=pages * ps, page_size=ps, dtype=torch.bfloat16, device="cuda")
                host = HostKVPool(shape, pages * ps, ps, torch.bfloat16, layout, pin_memory=True, reserve_bytes=0)  # type: ignore[arg-type]
                raw = host.backing_tensor.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, (raw.numel(),), generator=gen, dtype=torch.uint8))
                h_pages = torch.randperm(pages, generator=gen)[: pages // 2]
                d_pages = torch.randperm(pages, generator=gen)[: pages // 2] + 1  # device page 0 is padding
                offs = torch.arange(ps)
                h_idx = (h_pages[:, None] * ps + offs).flatten().cuda()
                d_idx = (d_pages[:, None] * ps + offs).flatten().cuda()
                for variant in VARIANTS:
                    for direction in ("load", "backup"):
                        case = f"{model} {layout} page {ps} {direction} {variant}"
                        try:
                            if direction == "load":
                                for layer in range(shape.layer_num):
                                    for t in dev.layer_buffers(layer):
                                        t.zero_()
                                p = sglang_load(dev, host, h_idx, d_idx, variant)
                            else:
                                for layer in range(shape.layer_num):
                                    for t in dev.layer_buffers(layer):
                                        t.view(torch.int16).random_()
                                p = sglang_backup(dev, host, d_idx, h_idx, variant)
                            torch.cuda.synchronize()
                            bad = compare_rows(dev, host, h_idx, d_idx)
                        except NotImplementedError as e:
                            print(f"{case}: not in SGLang: {e}")
                            continue
                        except Exception as e:
                            failures += 1
                            print(f"{case}: FAILED: {type(e).__name__}: {str(e)[-2000:]}")
                            continue
                        failures += bool(bad)
                        print(f"{case}: {p.label()}{' ' + p.note if p.note else ''}: {'; '.join(bad) or 'bytes ok'}")
    placeholders = ", ".join(sglang_src.PLACEHOLDERS) or "none"
    print(f"placeholders: {placeholders}; called: {', '.join(sglang_src.CALLED) or 'none'}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--source", default=DEFAULT_SOURCE, help="SGLang's source: the carried tarball or a folder")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true", help="build the JIT modules into the cache and stop")
    mode.add_argument("--self-test", action="store_true", help="every case on small pools, bytes checked (GPU)")
    ap.add_argument("--arch", type=int, default=None, help="compile for this sm (e.g. 90) instead of the local GPU")
    ap.add_argument("--row-bytes", default=",".join(map(str, ROW_BYTES)), help="row widths to build for")
    ap.add_argument("--staged-row-bytes", default=",".join(map(str, STAGED_ROW_BYTES)), help="same, staged write-back")
    ap.add_argument("--jobs", type=int, default=None, help="modules built at once (default: all)")
    ap.add_argument("--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--json", default=None, help="write the compile results here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    load_sglang_kernels(args.source)
    print(
        f"[sglang-jit] imported in {time.perf_counter() - t0:.1f} s; cache {os.environ['SGLANG_JIT_CACHE_DIR']}, "
        f"CUDA_HOME {os.environ.get('CUDA_HOME')}, ninja {shutil.which('ninja')}",
        flush=True,
    )
    print(f"[sglang-jit] placeholders for missing packages: {', '.join(sglang_src.PLACEHOLDERS) or 'none'}", flush=True)
    if args.self_test:
        if not torch.cuda.is_available():
            print("[sglang-jit] --self-test needs a CUDA GPU", flush=True)
            return 2
        return _self_test(args)
    t1 = time.perf_counter()
    rows = tuple(int(x) for x in args.row_bytes.split(",") if x)
    staged = tuple(int(x) for x in args.staged_row_bytes.split(",") if x)
    results = compile_modules(rows, staged, arch=args.arch, jobs=args.jobs)
    wall = time.perf_counter() - t1
    print(f"[sglang-jit] {sum(r['ok'] for r in results.values())}/{len(results)} modules in {wall:.1f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": round(wall, 2), "modules": results}, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
