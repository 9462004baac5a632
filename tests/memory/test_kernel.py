"""The CUDA gather/scatter kernel (:mod:`hiradix.memory.kernel`): plan, widths and bytes.

On every machine the kernel's body (``kvcopy.h``) runs on the CPU through
:class:`EmulatedLauncher`, every thread of the grid in turn, over the plan the CUDA engine
builds; the oracle is the torch indexing path of :class:`ThreadCopyEngine`, on a twin pair
of pools. On a GPU the same comparison runs with the real kernel against the CUDA engine's
torch path (``kernel=False``).
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hiradix.memory import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVShape, MHAShape, MLAShape, ThreadCopyEngine
from hiradix.memory import copy as C
from hiradix.memory import kernel as K
from hiradix.memory.copy import CudaCopyEngine, _prepare, _validate_cpu

CUDA = torch.cuda.is_available()
needs_emulation = pytest.mark.skipif(K._emu is None, reason="compiled extensions not in use (HIRADIX_PUREPYTHON)")
needs_kernel = pytest.mark.skipif(
    not K.cuda_kernel_available(), reason="no CUDA GPU here, or the kernel library was not built (no nvcc)"
)

SHAPES: dict[str, KVShape] = {
    "mha": MHAShape(layer_num=3, head_num=2, head_dim=8),
    "mha_vdim": MHAShape(layer_num=2, head_num=1, head_dim=8, v_head_dim=4),
    "mla": MLAShape(layer_num=2, kv_lora_rank=16, qk_rope_head_dim=4),
    "odd": MHAShape(layer_num=2, head_num=1, head_dim=3),  # 3-element rows: narrow chunks
}


def _pools(shape: KVShape, ps: int, dtype: torch.dtype, layout: str, device: str = "cpu", pin: bool | None = None):
    dev = DeviceKVPool(shape, size=6 * ps, page_size=ps, dtype=dtype, device=device)
    host = HostKVPool(shape, 12 * ps, ps, dtype, layout, reserve_bytes=0, pin_memory=pin)  # type: ignore[arg-type]
    return dev, host


def _randomize(dev: DeviceKVPool, host: HostKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(dev.layer_num):
        for buf in dev.layer_buffers(layer):
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    raw = host.backing_tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _twin(dev: DeviceKVPool, host: HostKVPool, device: str | None = None) -> tuple[DeviceKVPool, HostKVPool]:
    """A second pair of pools with the same bytes (the oracle's), on ``device`` (default:
    the device pool's)."""
    dev2 = DeviceKVPool(dev.shape, dev.size, dev.page_size, dev.dtype, device or dev.device)
    host2 = HostKVPool(
        dev.shape, host.size, host.page_size, host.dtype, host.layout, reserve_bytes=0, pin_memory=host.pin_memory
    )
    for layer in range(dev.layer_num):
        for a, b in zip(dev2.layer_buffers(layer), dev.layer_buffers(layer), strict=True):
            a.copy_(b)
    host2.backing_tensor.copy_(host.backing_tensor)
    return dev2, host2


def _same(a: tuple[DeviceKVPool, HostKVPool], b: tuple[DeviceKVPool, HostKVPool]) -> None:
    for layer in range(a[0].layer_num):
        for x, y in zip(a[0].layer_buffers(layer), b[0].layer_buffers(layer), strict=True):
            assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)), f"device layer {layer}"
    assert torch.equal(a[1].backing_tensor.view(torch.uint8), b[1].backing_tensor.view(torch.uint8)), "host pool"


def _slots(dev: DeviceKVPool, host: HostKVPool, rng: random.Random, whole_pages: bool):
    ps = dev.page_size
    pages = rng.sample(range(1, dev.total_slots // ps), 4)
    d = torch.tensor([p * ps + o for p in pages for o in range(ps)])
    if whole_pages:
        hp = rng.sample(range(host.page_num), 4)
        h = torch.tensor([p * ps + o for p in hp for o in range(ps)])
    else:
        h = torch.tensor(rng.sample(range(host.size), len(d)))
    return d, h


def _emulate(
    dev: DeviceKVPool,
    host: HostKVPool,
    d: torch.Tensor,
    h: torch.Tensor,
    to_device: bool,
    launcher: K.Launcher,
    runs: bool = False,
    per_layer: bool = False,
) -> K.KernelPlan:
    """The plan the CUDA engine builds, run on CPU pools: the kernel's body thread by
    thread through the whole-operation entry (or, ``per_layer``, one launch per layer), or
    (``runs``) its rows merged into runs, one memmove each."""
    d, h = _validate_cpu(dev, host, d, h)
    p = K.plan(dev, host, d, h)
    assert p is not None
    merged = p.runs() if runs else None
    if merged is not None:
        for layer in range(dev.layer_num):
            p.copy_layer_runs(launcher, layer, merged, to_device)
    elif per_layer:
        for layer in range(dev.layer_num):
            launcher.launch(p.jobs(layer, p.offsets.data_ptr(), 0, to_device), p.width, 0)
    else:
        launcher.launch_layers(p, p.offsets.data_ptr(), 0, to_device)
    return p


# ----------------------------------------------------------------------------- CPU emulation
@needs_emulation
@pytest.mark.parametrize("mode", sorted(K.MODES))
@pytest.mark.parametrize("whole_pages", [True, False])
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_emulated_kernel_matches_the_torch_path(layout: str, shape: str, ps: int, whole_pages: bool, mode: str) -> None:
    rng = random.Random(f"{layout}{shape}{ps}{whole_pages}{mode}")
    dev, host = _pools(SHAPES[shape], ps, torch.bfloat16, layout)
    _randomize(dev, host, rng.randrange(1 << 30))
    oracle = _twin(dev, host)
    # 3 x 64 threads: rows straddle threads, warps and rounds (wide); 6 warps over the rows (warp)
    launcher = K.EmulatedLauncher(blocks=3, threads=64, mode=mode)
    with ThreadCopyEngine(native=False) as eng:
        for step in range(4):
            d, h = _slots(dev, host, rng, whole_pages)
            per_layer = step >= 2  # the one-layer entry binds the same jobs
            if step % 2 == 0:
                _emulate(dev, host, d, h, False, launcher, per_layer=per_layer)
                eng.backup(oracle[0], oracle[1], d, h).wait()
            else:
                _emulate(dev, host, d, h, True, launcher, per_layer=per_layer)
                eng.load(oracle[1], oracle[0], h, d).wait()
            _same((dev, host), oracle)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_whole_pages_are_planned_one_offset_per_page(layout: str) -> None:
    dev, host = _pools(SHAPES["mha"], 4, torch.bfloat16, layout)
    whole = _validate_cpu(
        dev, host, torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]), torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    )
    p = K.plan(dev, host, *whole)
    assert p is not None and (p.groups, p.group_rows, p.rows) == (2, 4, 8)
    assert tuple(p.offsets.shape) == (4, 2)  # K and V: device and host offsets per page
    (d, hs), row = p.layers[0][0], p.layers[0][0][0].row_bytes
    assert p.offsets[0].tolist() == [4 * d.page_stride, 12 * d.page_stride]  # in host order
    assert p.offsets[1].tolist() == [0, 2 * hs.page_stride]
    assert p.row_offsets()[0].tolist() == [(4 + k) * d.page_stride for k in range(4)] + [
        (12 + k) * d.page_stride for k in range(4)
    ]
    assert d.page_stride == row
    # Not whole pages on either side: one offset per row.
    for dd, hh in (([12, 13, 14, 15], [9, 10, 11, 12]), ([12, 13, 15, 14], [8, 9, 10, 11]), ([1, 2, 3], [0, 1, 2])):
        p = K.plan(dev, host, *_validate_cpu(dev, host, torch.tensor(dd), torch.tensor(hh)))
        assert p is not None and (p.groups, p.group_rows) == (len(dd), 1)
    # A device page that runs past the pool is refused, not copied.
    last = dev.total_slots - 2
    with pytest.raises(IndexError, match="device_indices"):
        K.plan(dev, host, torch.tensor([last, last + 1, last + 2, last + 3]), torch.tensor([0, 1, 2, 3]))


@needs_emulation
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_runs_of_the_plan_move_the_bytes_of_the_torch_path(layout: str, shape: str, ps: int) -> None:
    # The copy engines' path (dma=True) on the CPU: the plan's rows merged into runs.
    rng = random.Random(f"runs{layout}{shape}{ps}")
    dev, host = _pools(SHAPES[shape], ps, torch.bfloat16, layout)
    _randomize(dev, host, rng.randrange(1 << 30))
    oracle = _twin(dev, host)
    launcher = K.EmulatedLauncher()
    with ThreadCopyEngine(native=False) as eng:
        for step in range(4):
            d, h = _slots(dev, host, rng, whole_pages=step < 2)
            if step % 2 == 0:
                _emulate(dev, host, d, h, False, launcher, runs=True)
                eng.backup(oracle[0], oracle[1], d, h).wait()
            else:
                _emulate(dev, host, d, h, True, launcher, runs=True)
                eng.load(oracle[1], oracle[0], h, d).wait()
            _same((dev, host), oracle)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_a_plan_from_the_pools_geometry_equals_a_plan_from_scratch(layout: str) -> None:
    dev, host = _pools(SHAPES["mha"], 4, torch.bfloat16, layout)
    geo = K.geometry(dev, host)
    assert geo is not None
    d, h = _validate_cpu(dev, host, torch.tensor([9, 4, 5, 13]), torch.tensor([40, 2, 3, 17]))
    a, b = K.plan(dev, host, d, h), K.plan(dev, host, d, h, geo)
    assert a is not None and b is not None
    assert (a.layers, a.rows, a.width, a.groups) == (b.layers, b.rows, b.width, b.groups)
    assert torch.equal(a.offsets, b.offsets)


def test_geometry_cache_computes_once_per_pool_pair_and_keeps_a_few(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = K.GeometryCache(kept=2)
    pairs = [_pools(SHAPES["mha"], 4, torch.bfloat16, layout) for layout in HOST_LAYOUTS]
    first = cache.get(*pairs[0])
    assert first is not None
    assert cache.get(*pairs[0]) is first and cache.computed == 1
    cache.get(*pairs[1])
    cache.get(*pairs[2])  # the oldest entry (pairs[0]) goes
    assert cache.computed == 3
    assert cache.get(*pairs[2]) is not None and cache.computed == 3
    cache.get(*pairs[0])
    assert cache.computed == 4
    # Pools the kernel cannot address (geometry None) are remembered as such.
    monkeypatch.setattr(K, "geometry", lambda dev, host: None)
    dev, host = _pools(SHAPES["mla"], 4, torch.bfloat16, "layer_first")
    assert cache.get(dev, host) is None and cache.get(dev, host) is None
    assert cache.computed == 5


@pytest.mark.parametrize(("layout", "rows_per_run"), [("layer_first", 4), ("page_first_direct", 4), ("page_first", 1)])
def test_runs_merge_only_rows_that_follow_on_both_sides(layout: str, rows_per_run: int) -> None:
    # page_first keeps a token's layers together on the host, so a layer's rows never
    # follow each other there; the two other layouts keep a page's rows of a layer together.
    dev, host = _pools(SHAPES["mha"], 4, torch.bfloat16, layout)
    d, h = _validate_cpu(dev, host, torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]), torch.tensor(list(range(8))))
    p = K.plan(dev, host, d, h)
    assert p is not None
    runs = p.runs()
    row = p.layers[0][0][0].row_bytes
    assert runs.count == 2 * 8 // rows_per_run  # K and V
    assert runs.sizes.tolist() == [rows_per_run * row] * runs.count
    assert runs.sizes.dtype == np.uintp
    if layout == "page_first_direct":  # a device page across two host pages: a run stops at the host page's end
        d, h = _validate_cpu(dev, host, torch.tensor([8, 9, 10, 11]), torch.tensor([2, 3, 4, 5]))
        p = K.plan(dev, host, d, h)
        assert p is not None
        assert p.runs().sizes.tolist() == [2 * row] * 4
    dev_off, host_off, lengths = K.merge_rows(np.array([0, 8, 24]), np.array([0, 16, 24]), 8)
    assert (dev_off.tolist(), host_off.tolist(), lengths.tolist()) == ([0, 8, 24], [0, 16, 24], [8, 8, 8])


@needs_emulation
@pytest.mark.parametrize("mode", sorted(K.MODES))
@pytest.mark.parametrize(("blocks", "threads"), [(1, 32), (1, 1024), (7, 96), (64, 256)])
def test_emulated_kernel_covers_every_chunk_for_any_grid(blocks: int, threads: int, mode: str) -> None:
    # Fewer threads (or warps) than chunks (grid-stride rounds, unrolled tails) and more
    # than chunks (idle threads) alike.
    rng = random.Random(blocks * threads)
    dev, host = _pools(SHAPES["mha"], 4, torch.float32, "page_first")
    _randomize(dev, host, 7)
    oracle = _twin(dev, host)
    d, h = _slots(dev, host, rng, whole_pages=False)
    _emulate(dev, host, d, h, True, K.EmulatedLauncher(blocks, threads, mode))
    with ThreadCopyEngine(native=False) as eng:
        eng.load(oracle[1], oracle[0], h, d).wait()
    _same((dev, host), oracle)


@needs_emulation
@pytest.mark.parametrize(
    ("shape", "dtype", "width"),
    [
        (MHAShape(2, 1, 8), torch.bfloat16, 16),  # 16-byte rows
        (MHAShape(2, 1, 4), torch.float16, 8),  # 8-byte rows
        (MHAShape(2, 1, 3), torch.float16, 2),  # 6-byte rows
        (MHAShape(2, 1, 3), torch.uint8, 1),  # 3-byte rows (an fp8-sized element)
    ],
)
def test_plan_picks_the_widest_chunk_that_divides_everything(shape: KVShape, dtype: torch.dtype, width: int) -> None:
    dev, host = _pools(shape, 2, dtype, "page_first")
    d, h = _validate_cpu(dev, host, [2, 3], [0, 1])
    p = K.plan(dev, host, d, h)
    assert p is not None and p.width == width
    _randomize(dev, host, 3)
    oracle = _twin(dev, host)
    _emulate(dev, host, torch.tensor([2, 3, 4]), torch.tensor([5, 0, 9]), False, K.EmulatedLauncher(1, 32))
    with ThreadCopyEngine(native=False) as eng:
        eng.backup(oracle[0], oracle[1], [2, 3, 4], [5, 0, 9]).wait()
    _same((dev, host), oracle)


@needs_emulation
def test_plan_sorts_rows_by_host_slot_and_keeps_the_pairs() -> None:
    dev, host = _pools(SHAPES["mha"], 1, torch.float32, "layer_first")
    d, h = torch.tensor([3, 1, 2]), torch.tensor([9, 4, 6])
    p = K.plan(dev, host, d, h)
    assert p is not None
    row = dev.layer_buffers(0)[0][0].numel() * 4
    assert p.offsets[0].tolist() == [1 * row, 2 * row, 3 * row]  # device offsets, in host order
    assert p.offsets[1].tolist() == [4 * row, 6 * row, 9 * row]


def test_launch_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="blocks"):
        K._check_grid(0, 64)
    with pytest.raises(ValueError, match="threads"):
        K._check_grid(1, 48)
    with pytest.raises(ValueError, match="mode"):
        K._grid("fast", None, None)
    assert K._grid("warp", None, None) == ("warp", *K.DEFAULT_GRID["warp"])
    if K._emu is not None:
        with pytest.raises(ValueError, match="width"):
            K._emu.launch(0, 1, 3, 0, 1, 32)
        with pytest.raises(ValueError, match="mode"):
            K._emu.launch(0, 1, 16, 2, 1, 32)
        jobs = (K._Job * 5)()
        with pytest.raises(ValueError, match="bad launch"):
            K._emu.launch(ctypes.addressof(jobs), 5, 16, 0, 1, 32)
        with pytest.raises(ValueError, match="bad operation"):
            K._emu.launch_layers(ctypes.addressof(jobs), 2, 1, 0, 0, 1, True, 16, 0, 1, 32)


@pytest.mark.skipif(not K.LIBRARY.exists(), reason="the kernel library was not built here (no nvcc at install)")
def test_built_kernel_library_loads_without_a_gpu_and_has_our_abi() -> None:
    # ctypes loading, the exported names and the ABI check run on any machine; only the
    # launches need a GPU.
    if K.pure_python():
        pytest.skip("HIRADIX_PUREPYTHON turns the compiled paths off")
    assert K.library_abi() == K.ABI


@pytest.mark.skipif(not K.LIBRARY.exists(), reason="the kernel library was not built here (no nvcc at install)")
def test_built_library_checks_each_launch_argument_in_its_place() -> None:
    """The ctypes signatures match the library's C ABI: each call below is wrong in exactly
    one argument and must be refused for it (cudaErrorInvalidValue, 1) before any CUDA
    work, so it runs without a GPU. An argument out of place would pass a check and fail
    later, differently (no device)."""
    if K.pure_python():
        pytest.skip("HIRADIX_PUREPYTHON turns the compiled paths off")
    lib = K._library()
    jobs = (K._Job * 2)()
    good = {"njobs": 2, "width": 16, "mode": 1, "blocks": 2, "threads": 64}
    for name, bad in (("njobs", 5), ("width", 3), ("mode", 2), ("blocks", 0), ("threads", 48)):
        a = {**good, name: bad}
        assert lib.hr_kvcopy_launch(jobs, a["njobs"], a["width"], a["mode"], a["blocks"], a["threads"], None) == 1
        op = {"layers": 1, "groups": 1, "group_rows": 1, **a}
        assert lib.hr_kvcopy_launch_layers(
            jobs, op["njobs"], op["layers"], None, op["groups"], op["group_rows"], 1, op["width"], op["mode"],
            op["blocks"], op["threads"], 0, None, None, None,
        ) == 1  # fmt: skip
    for name in ("layers", "groups", "group_rows"):
        op = {**good, "layers": 1, "groups": 1, "group_rows": 1, name: 0}
        assert lib.hr_kvcopy_launch_layers(
            jobs, op["njobs"], op["layers"], None, op["groups"], op["group_rows"], 1, op["width"], op["mode"],
            op["blocks"], op["threads"], 0, None, None, None,
        ) == 1  # fmt: skip
    assert "invalid argument" in lib.hr_kvcopy_error_string(1).decode()


def test_kernel_is_on_by_default_wherever_it_can_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIRADIX_CUDA_KERNEL", raising=False)
    assert K.kernel_by_default() == K.cuda_kernel_available()
    assert (K.kernel_unavailable_reason() is None) == K.cuda_kernel_available()
    if not CUDA:
        assert "no CUDA device" in (K.kernel_unavailable_reason() or "")
    monkeypatch.setenv("HIRADIX_CUDA_KERNEL", "0")
    assert not K.kernel_by_default()
    monkeypatch.setenv("HIRADIX_CUDA_KERNEL_MODE", "wide")
    assert K.default_mode() == "wide"
    monkeypatch.setenv("HIRADIX_CUDA_KERNEL_MODE", "fastest")
    with pytest.raises(ValueError, match="HIRADIX_CUDA_KERNEL_MODE"):
        K.default_mode()


def test_plan_refuses_gpu_indices_and_empty_copies() -> None:
    dev, host = _pools(SHAPES["mha"], 1, torch.float32, "layer_first")
    assert K.plan(dev, host, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)) is None
    if CUDA:
        with pytest.raises(ValueError, match="CPU"):
            K.plan(dev, host, torch.tensor([1]).cuda(), torch.tensor([0]))


def test_kernel_required_without_it_is_a_clear_error() -> None:
    if K.cuda_kernel_available():
        pytest.skip("the kernel is available here; this checks the error where it is not")
    if not CUDA:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            CudaCopyEngine(kernel=True)
    else:
        with pytest.raises(K.KernelError, match="not available"):
            CudaCopyEngine(kernel=True)


# ----------------------------------------------------------------------------- the mapped torch path
class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it, and the ones that read a value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("whole_pages", [True, False])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_mapped_torch_path_does_no_host_work_per_token(layout: str, whole_pages: bool) -> None:
    """The fallback where the kernel cannot serve: on a GPU its views alias the pinned host
    pool and every op below is a GPU kernel. Here, on CPU tensors, it must move the bytes of
    the torch path with the same ops for 4 tokens as for 256 (none per token) and never read
    a value back to the host (no ``.item()``, no ``.tolist()``, no sync)."""
    counts = []
    for pages in (1, 64):
        rng = random.Random(f"mapped{layout}{whole_pages}{pages}")
        shape = SHAPES["mha"]
        dev = DeviceKVPool(shape, size=(pages + 2) * 4, page_size=4, dtype=torch.bfloat16, device="cpu")
        host = HostKVPool(shape, (pages + 2) * 4, 4, torch.bfloat16, layout, reserve_bytes=0)  # type: ignore[arg-type]
        _randomize(dev, host, rng.randrange(1 << 30))
        oracle = _twin(dev, host)
        d = torch.tensor([p * 4 + o for p in rng.sample(range(1, pages + 2), pages) for o in range(4)])
        if whole_pages:
            h = torch.tensor([p * 4 + o for p in rng.sample(range(pages + 2), pages) for o in range(4)])
        else:
            h = torch.tensor(rng.sample(range(host.size), len(d)))
        dev_idx, hidx = _prepare(dev, host, d, h)
        ops = []
        for to_device in (False, True):
            step = C.mapped_load_layer if to_device else C.mapped_backup_layer
            views = [
                (
                    [C._as_bytes(b) for b in dev.layer_buffers(layer)],
                    [C._as_bytes(v) for v in host.get_page_layer_view(layer)],
                )
                for layer in range(dev.layer_num)
            ]
            with _OpCounter() as counter:
                for dbufs, hviews in views:
                    step(dbufs, hviews, hidx, dev_idx)
            ops.append(counter.ops)
        with ThreadCopyEngine(native=False) as eng:
            eng.backup(oracle[0], oracle[1], d, h).wait()
            eng.load(oracle[1], oracle[0], h, d).wait()
        _same((dev, host), oracle)
        counts.append(ops)
        for op_list in ops:
            assert not {"_local_scalar_dense", "item", "tolist", "_to_copy", "copy_"} & set(op_list), op_list
    assert counts[0] == counts[1], "the mapped path's host work grew with the tokens"
    assert len(counts[0][0]) <= 4 * SHAPES["mha"].layer_num * 2  # a few ops per (layer, component)


# ----------------------------------------------------------------------------- GPU
PATHS = {  # CudaCopyEngine's ways to move a layer, as the parity tests name them
    "wide": {"kernel": True, "mode": "wide"},
    "warp": {"kernel": True, "mode": "warp"},
    "dma": {"kernel": True, "dma": True},
    "mapped": {"kernel": False},
}


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("whole_pages", [True, False])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_cuda_kernel_matches_the_torch_path(layout: str, shape: str, ps: int, whole_pages: bool, path: str) -> None:
    """Every path's bytes on the GPU (the kernel in both modes, the copy engines over the
    same plan, the mapped torch fallback) equal both oracles': the CPU thread engine's
    torch path on CPU copies of the pools, and (compiled builds) the same plan run by the
    CPU emulation of the kernel."""
    rng = random.Random(f"cuda{layout}{shape}{ps}{whole_pages}{path}")
    dtype = torch.uint8 if shape == "odd" else torch.bfloat16
    dev, host = _pools(SHAPES[shape], ps, dtype, layout, device="cuda")
    _randomize(dev, host, rng.randrange(1 << 30))
    oracle = _twin(dev, host, "cpu")
    emulated = _twin(dev, host, "cpu") if K._emu is not None and path != "mapped" else None
    mode = PATHS[path].get("mode", "wide")
    launcher = K.EmulatedLauncher(blocks=3, threads=64, mode=mode) if emulated else None
    with CudaCopyEngine(**PATHS[path]) as eng, ThreadCopyEngine(native=False) as ref:
        assert eng.uses_kernel == (path != "mapped")
        for step in range(4):
            d, h = _slots(dev, host, rng, whole_pages)
            to_device = step % 2 == 1
            if not to_device:
                handle = eng.backup(dev, host, d, h)
                ref.backup(oracle[0], oracle[1], d, h).wait()
            else:
                handle = eng.load(host, dev, h, d.cuda())
                ref.load(oracle[1], oracle[0], h, d).wait()
            handle.wait()
            assert handle.duration_s is not None and handle.duration_s >= 0  # CUDA events, as stock's histograms
            if emulated is not None and launcher is not None:
                _emulate(emulated[0], emulated[1], d, h, to_device, launcher, runs=path == "dma")
            torch.cuda.synchronize()
            _same((dev, host), oracle)
            if emulated is not None:
                _same((dev, host), emulated)


@needs_kernel
@pytest.mark.timeout(60)
def test_cuda_engine_picks_the_kernel_by_default_and_says_why_not(caplog: pytest.LogCaptureFixture) -> None:
    with CudaCopyEngine() as eng:
        assert eng.uses_kernel and eng.mode == K.default_mode()
    dev, host = _pools(SHAPES["mha"], 4, torch.bfloat16, "page_first", device="cuda", pin=False)
    C._LOGGED.clear()
    with caplog.at_level("WARNING"), CudaCopyEngine(kernel=False) as eng:
        eng.backup(dev, host, [4, 5], [0, 1]).wait()  # unpinned: the staged path, logged once
        eng.backup(dev, host, [6, 7], [2, 3]).wait()
    assert sum("staged torch path" in r.message for r in caplog.records) == 1


@needs_kernel
@pytest.mark.timeout(60)
def test_cuda_kernel_needs_a_pinned_host_pool() -> None:
    dev, host = _pools(SHAPES["mha"], 4, torch.bfloat16, "page_first", device="cuda", pin=False)
    _randomize(dev, host, 1)
    oracle = _twin(dev, host)
    with CudaCopyEngine(kernel=True) as eng, pytest.raises(K.KernelError, match="pinned"):
        eng.backup(dev, host, [4, 5], [0, 1])
    with CudaCopyEngine() as eng, CudaCopyEngine(kernel=False) as ref:  # falls back: same bytes
        eng.backup(dev, host, [4, 5, 6, 7], [8, 9, 10, 11]).wait()
        ref.backup(oracle[0], oracle[1], [4, 5, 6, 7], [8, 9, 10, 11]).wait()
    _same((dev, host), oracle)


@needs_kernel
@pytest.mark.timeout(60)
def test_cuda_kernel_launch_errors_are_raised_not_ignored() -> None:
    launcher = K.CudaLauncher(blocks=1, threads=64)
    jobs = (K._Job * 5)()  # more components than one launch takes
    with pytest.raises(K.KernelError, match="launch failed"):
        launcher.launch(jobs, 16, torch.cuda.current_stream().cuda_stream)
