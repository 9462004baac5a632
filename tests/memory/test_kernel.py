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

from hiradix.memory import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVShape, MHAShape, MLAShape, ThreadCopyEngine
from hiradix.memory import kernel as K
from hiradix.memory.copy import CudaCopyEngine, _validate_cpu

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
) -> K.KernelPlan:
    """The plan the CUDA engine builds, run on CPU pools: the kernel's body thread by
    thread, or (``runs``) its rows merged into runs, one memmove each."""
    d, h = _validate_cpu(dev, host, d, h)
    p = K.plan(dev, host, d, h)
    assert p is not None
    merged = p.runs() if runs else None
    for layer in range(dev.layer_num):
        if merged is not None:
            p.copy_layer_runs(launcher, layer, merged, to_device)
        else:
            p.launch_layer(launcher, layer, p.offsets.data_ptr(), 0, to_device)
    return p


# ----------------------------------------------------------------------------- CPU emulation
@needs_emulation
@pytest.mark.parametrize("whole_pages", [True, False])
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_emulated_kernel_matches_the_torch_path(layout: str, shape: str, ps: int, whole_pages: bool) -> None:
    rng = random.Random(f"{layout}{shape}{ps}{whole_pages}")
    dev, host = _pools(SHAPES[shape], ps, torch.bfloat16, layout)
    _randomize(dev, host, rng.randrange(1 << 30))
    oracle = _twin(dev, host)
    launcher = K.EmulatedLauncher(blocks=3, threads=64)  # 192 threads: rows straddle threads and rounds
    with ThreadCopyEngine(native=False) as eng:
        for step in range(3):
            d, h = _slots(dev, host, rng, whole_pages)
            if step % 2 == 0:
                _emulate(dev, host, d, h, False, launcher)
                eng.backup(oracle[0], oracle[1], d, h).wait()
            else:
                _emulate(dev, host, d, h, True, launcher)
                eng.load(oracle[1], oracle[0], h, d).wait()
            _same((dev, host), oracle)


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
    assert (a.layers, a.rows, a.width) == (b.layers, b.rows, b.width)
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
@pytest.mark.parametrize(("blocks", "threads"), [(1, 32), (1, 1024), (7, 96), (64, 256)])
def test_emulated_kernel_covers_every_chunk_for_any_grid(blocks: int, threads: int) -> None:
    # Fewer threads than chunks (grid-stride rounds, unrolled tails) and more threads than
    # chunks (idle threads) alike.
    rng = random.Random(blocks * threads)
    dev, host = _pools(SHAPES["mha"], 4, torch.float32, "page_first")
    _randomize(dev, host, 7)
    oracle = _twin(dev, host)
    d, h = _slots(dev, host, rng, whole_pages=False)
    _emulate(dev, host, d, h, True, K.EmulatedLauncher(blocks, threads))
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
    if K._emu is not None:
        with pytest.raises(ValueError, match="width"):
            K._emu.launch(0, 1, 3, 1, 32)
        jobs = (K._Job * 5)()
        with pytest.raises(ValueError, match="bad launch"):
            K._emu.launch(ctypes.addressof(jobs), 5, 16, 1, 32)


@pytest.mark.skipif(not K.LIBRARY.exists(), reason="the kernel library was not built here (no nvcc at install)")
def test_built_kernel_library_loads_without_a_gpu_and_has_our_abi() -> None:
    # ctypes loading, the exported names and the ABI check run on any machine; only the
    # launches need a GPU.
    if K.pure_python():
        pytest.skip("HIRADIX_PUREPYTHON turns the compiled paths off")
    assert K.library_abi() == K.ABI


def test_kernel_is_off_by_default_until_measured_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIRADIX_CUDA_KERNEL", raising=False)
    assert not K.kernel_by_default()
    monkeypatch.setenv("HIRADIX_CUDA_KERNEL", "1")
    assert K.kernel_by_default() == K.cuda_kernel_available()


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


# ----------------------------------------------------------------------------- GPU
@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dma", [False, True], ids=["kernel", "dma"])
@pytest.mark.parametrize("whole_pages", [True, False])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_cuda_kernel_matches_the_torch_path(layout: str, shape: str, ps: int, whole_pages: bool, dma: bool) -> None:
    """The kernel's bytes (or, ``dma``, the copy engines' over the same plan) equal both
    oracles': the CUDA engine's torch path, and (compiled builds) the same plan run on the
    CPU over CPU copies of the pools."""
    rng = random.Random(f"cuda{layout}{shape}{ps}{whole_pages}")
    dtype = torch.uint8 if shape == "odd" else torch.bfloat16
    dev, host = _pools(SHAPES[shape], ps, dtype, layout, device="cuda")
    _randomize(dev, host, rng.randrange(1 << 30))
    oracle = _twin(dev, host)
    emulated = _twin(dev, host, "cpu") if K._emu is not None else None
    launcher = K.EmulatedLauncher(blocks=3, threads=64) if emulated else None
    with CudaCopyEngine(kernel=True, dma=dma) as eng, CudaCopyEngine(kernel=False) as ref:
        assert eng.uses_kernel and not ref.uses_kernel
        for step in range(4):
            d, h = _slots(dev, host, rng, whole_pages)
            to_device = step % 2 == 1
            if not to_device:
                eng.backup(dev, host, d, h).wait()
                ref.backup(oracle[0], oracle[1], d, h).wait()
            else:
                handle = eng.load(host, dev, h, d.cuda())
                ref.load(oracle[1], oracle[0], h, d).wait()
                handle.wait()
            if emulated is not None and launcher is not None:
                _emulate(emulated[0], emulated[1], d, h, to_device, launcher, runs=dma)
            torch.cuda.synchronize()
            _same((dev, host), oracle)
            if emulated is not None:
                _same((dev, host), emulated)


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
