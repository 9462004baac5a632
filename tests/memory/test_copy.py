"""Copy engine: byte-exact round trips, per-layer signalling, FIFO order and failures.

Ordering is never arranged with sleeps: a :class:`Gate` installed as the engine's
``layer_hook`` holds the worker before each layer until the test releases it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from hiradix.memory import (
    HOST_LAYOUTS,
    CopyEngine,
    CopyError,
    CudaCopyEngine,
    DeviceKVPool,
    HostKVPool,
    KVShape,
    MHAShape,
    MLAShape,
    ThreadCopyEngine,
    make_copy_engine,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU on this machine")
T = 10.0  # seconds any single wait in a test may take before it is a failure, never an ordering tool

SHAPES: dict[str, KVShape] = {
    "mha": MHAShape(layer_num=3, head_num=2, head_dim=8),
    "mha_vdim": MHAShape(layer_num=2, head_num=2, head_dim=8, v_head_dim=4),
    "mla": MLAShape(layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
PAGES = 8


def _pools(
    shape: KVShape, page_size: int, dtype: torch.dtype, layout: str = "layer_first", device: str = "cpu"
) -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(shape, size=PAGES * page_size, page_size=page_size, dtype=dtype, device=device)
    host = HostKVPool.for_device(dev, ratio=2.0, layout=layout, reserve_bytes=0)  # type: ignore[arg-type]
    return dev, host


def _fill_random(pool: DeviceKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layer_num):
        for buf in pool.layer_buffers(layer):
            raw = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _zero(pool: DeviceKVPool) -> None:
    for layer in range(pool.layer_num):
        for buf in pool.layer_buffers(layer):
            buf.zero_()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + o for p in pages for o in range(page_size)], dtype=torch.int64)


def _random_sets(
    dev: DeviceKVPool, host: HostKVPool, rng: random.Random, n_pages: int, whole_pages: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-contiguous, shuffled device and host slots for ``n_pages`` pages of tokens."""
    ps = dev.page_size
    dev_pages = rng.sample(range(1, dev.total_slots // ps), n_pages)  # page 0 is padding
    if whole_pages:
        host_idx = _page_slots(rng.sample(range(host.page_num), n_pages), ps)
    else:  # single slots scattered over the host pool: the (page, offset) path
        host_idx = torch.tensor(rng.sample(range(host.size), n_pages * ps), dtype=torch.int64)
    return _page_slots(dev_pages, ps), host_idx


@pytest.fixture
def engine() -> Iterator[ThreadCopyEngine]:
    eng = ThreadCopyEngine()
    yield eng
    eng.close()


class Gate:
    """A ``layer_hook`` that parks the worker before each layer of the operations in
    ``gated`` until :meth:`release` is called for that (op, layer)."""

    def __init__(self, gated: set[int] | None = None, fail_at: tuple[int, int] | None = None) -> None:
        self.gated = gated
        self.fail_at = fail_at
        self.calls: list[tuple[str, int, int]] = []
        self._arrived: dict[tuple[int, int], threading.Event] = {}
        self._release: dict[tuple[int, int], threading.Event] = {}
        self._lock = threading.Lock()

    def _ev(self, table: dict[tuple[int, int], threading.Event], key: tuple[int, int]) -> threading.Event:
        with self._lock:
            return table.setdefault(key, threading.Event())

    def __call__(self, kind: str, op_id: int, layer: int) -> None:
        self.calls.append((kind, op_id, layer))
        key = (op_id, layer)
        if self.gated is not None and op_id in self.gated:
            self._ev(self._arrived, key).set()
            assert self._ev(self._release, key).wait(T), f"gate {key} never released"
        if self.fail_at == key:
            raise RuntimeError(f"injected failure at op {op_id} layer {layer}")

    def arrived(self, op_id: int, layer: int) -> None:
        assert self._ev(self._arrived, (op_id, layer)).wait(T), f"worker never reached {(op_id, layer)}"

    def release(self, op_id: int, layer: int) -> None:
        self._ev(self._release, (op_id, layer)).set()

    def release_all(self, op_id: int, layer_num: int) -> None:
        for layer in range(layer_num):
            self.release(op_id, layer)


# ----------------------------------------------------------------------------- round trips
def _round_trip(eng: CopyEngine, dev: DeviceKVPool, host: HostKVPool, seed: int, whole_pages: bool) -> None:
    rng = random.Random(seed)
    _fill_random(dev, seed)
    n_pages = 3
    src_idx, host_idx = _random_sets(dev, host, rng, n_pages, whole_pages)
    expected = [
        [_bytes(buf[src_idx.to(buf.device)]) for buf in dev.layer_buffers(layer)] for layer in range(dev.layer_num)
    ]

    eng.backup(dev, host, src_idx.to(dev.device), host_idx).wait(T)
    ps = host.page_size
    for layer in range(dev.layer_num):
        for c, view in enumerate(host.get_page_layer_view(layer)):
            got = torch.stack([view[int(s) // ps, int(s) % ps] for s in host_idx])
            assert torch.equal(_bytes(got), expected[layer][c]), f"host layer {layer} comp {c}"

    _zero(dev)
    free_pages = sorted(set(range(1, dev.total_slots // dev.page_size)) - set((src_idx // dev.page_size).tolist()))
    dst_idx = _page_slots(rng.sample(free_pages, n_pages), dev.page_size)
    handle = eng.load(host, dev, host_idx, dst_idx.to(dev.device))
    for layer in range(dev.layer_num):
        handle.wait_until(layer, T)
        for c, buf in enumerate(dev.layer_buffers(layer)):
            if dev.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            assert torch.equal(_bytes(buf[dst_idx.to(buf.device)]), expected[layer][c]), f"device layer {layer}"
    handle.wait(T)
    assert eng.query(handle)
    mask = torch.ones(dev.total_slots, dtype=torch.bool)
    mask[dst_idx] = False
    for layer in range(dev.layer_num):
        for buf in dev.layer_buffers(layer):
            assert not _bytes(buf.cpu()[mask]).any(), "a load wrote outside its slots"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_round_trip_is_byte_identical(
    engine: ThreadCopyEngine, layout: str, shape: str, page_size: int, dtype: torch.dtype
) -> None:
    dev, host = _pools(SHAPES[shape], page_size, dtype, layout)
    _round_trip(engine, dev, host, seed=page_size * 31 + len(layout), whole_pages=True)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("native", [None, False], ids=["default", "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backup_now_lands_the_bytes_backup_would(layout: str, page_size: int, native: bool | None) -> None:
    """An inline engine's synchronous backup: the same host bytes as a queued backup of
    the same slots on another engine, with the hook called per layer as for backup."""
    dev, host = _pools(SHAPES["mha"], page_size, torch.bfloat16, layout)
    _, host2 = _pools(SHAPES["mha"], page_size, torch.bfloat16, layout)
    _fill_random(dev, 7)
    src_idx, host_idx = _random_sets(dev, host, random.Random(7), 3, whole_pages=False)
    host2.backing_tensor.zero_()  # pool buffers start as whatever the allocator hands out
    with ThreadCopyEngine() as queued:
        queued.backup(dev, host2, src_idx, host_idx).wait(T)
    calls: list[tuple[str, int, int]] = []
    for hook in (None, lambda kind, op, layer: calls.append((kind, op, layer))):
        host.backing_tensor.zero_()
        with ThreadCopyEngine(inline=True, native=native, layer_hook=hook) as eng:
            assert eng.backup_now(dev, host, src_idx, host_idx) is None
        assert torch.equal(_bytes(host.backing_tensor), _bytes(host2.backing_tensor))
    assert calls == [("backup", 0, layer) for layer in range(dev.layer_num)]


def test_backup_now_needs_an_open_inline_engine() -> None:
    dev, host = _pools(SHAPES["mla"], 1, torch.float32)
    with ThreadCopyEngine() as eng, pytest.raises(RuntimeError, match="inline"):
        eng.backup_now(dev, host, [1], [0])
    eng = ThreadCopyEngine(inline=True)
    with pytest.raises(IndexError):  # bad input raises as backup's does, copying nothing
        eng.backup_now(dev, host, [dev.total_slots], [0])
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.backup_now(dev, host, [1], [0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", ["mha", "mla"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_round_trip_scattered_host_slots(engine: ThreadCopyEngine, layout: str, shape: str) -> None:
    # Host slots that are not whole pages take the (page, offset) gather/scatter path.
    dev, host = _pools(SHAPES[shape], 16, torch.bfloat16, layout)
    _round_trip(engine, dev, host, seed=7, whole_pages=False)


@pytest.mark.timeout(60)
def test_one_device_pool_with_host_pools_of_every_layout(engine: ThreadCopyEngine) -> None:
    """The compiled copy's per-pair layout is kept per (device pool, host pool): one device
    pool backed up to host pools of each layout in turn, twice over, lands byte for byte
    in each (a layout kept for the wrong host pool would write the wrong rows)."""
    dev = DeviceKVPool(SHAPES["mha"], size=PAGES * 4, page_size=4, dtype=torch.float16)
    hosts = [HostKVPool.for_device(dev, ratio=2.0, layout=layout, reserve_bytes=0) for layout in HOST_LAYOUTS]
    for seed, host in enumerate(hosts * 2):
        _round_trip(engine, dev, host, seed=seed, whole_pages=seed % 2 == 0)


@pytest.mark.timeout(30)
def test_mismatched_pools_are_refused_every_time(engine: ThreadCopyEngine) -> None:
    """A refused pair stays refused (the check is not skipped once a pool is known), and
    the same pools still work with their right partners afterwards."""
    dev, host = _pools(SHAPES["mha"], 4, torch.float16)
    other_dev, other_host = _pools(SHAPES["mla"], 4, torch.float16)
    for _ in range(2):
        with pytest.raises(ValueError, match="shapes differ"):
            engine.backup(other_dev, host, [4], [0])
        with pytest.raises(ValueError, match="shapes differ"):
            engine.load(other_host, dev, [0], [4])
    _round_trip(engine, dev, host, seed=1, whole_pages=True)
    _round_trip(engine, other_dev, other_host, seed=2, whole_pages=True)


@pytest.mark.timeout(30)
def test_empty_transfer_completes(engine: ThreadCopyEngine) -> None:
    dev, host = _pools(SHAPES["mha"], 4, torch.float16)
    engine.backup(dev, host, [], []).wait(T)
    h = engine.load(host, dev, [], [])
    h.wait_until(dev.layer_num - 1, T)
    h.wait(T)
    assert h.done() and h.error is None


# ----------------------------------------------------------------------------- ordering
@pytest.mark.timeout(30)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_wait_until_returns_after_layer_lands_and_before_next(layout: str) -> None:
    shape = MHAShape(layer_num=4, head_num=2, head_dim=8)
    dev, host = _pools(shape, 4, torch.float32, layout)
    _fill_random(dev, 3)
    idx = _page_slots([1, 3, 6], 4)
    host_idx = _page_slots([5, 0, 2], 4)
    expected = [[_bytes(b[idx]) for b in dev.layer_buffers(layer)] for layer in range(shape.layer_num)]
    with ThreadCopyEngine() as warm:
        warm.backup(dev, host, idx, host_idx).wait(T)
    _zero(dev)

    gate = Gate(gated={0})
    snapshots: dict[int, tuple[bool, bool]] = {}
    observed = [threading.Event() for _ in range(shape.layer_num)]
    with ThreadCopyEngine(layer_hook=gate) as eng:
        handle = eng.load(host, dev, host_idx, idx)

        def forward() -> None:  # the model: compute layer i only after wait_until(i)
            for layer in range(shape.layer_num):
                handle.wait_until(layer, T)
                here = all(
                    torch.equal(_bytes(b[idx]), e)
                    for b, e in zip(dev.layer_buffers(layer), expected[layer], strict=True)
                )
                nxt = layer + 1 < shape.layer_num and any(_bytes(b[idx]).any() for b in dev.layer_buffers(layer + 1))
                snapshots[layer] = (here, nxt)
                observed[layer].set()

        t = threading.Thread(target=forward)
        t.start()
        for layer in range(shape.layer_num):
            gate.arrived(0, layer)  # worker parked before copying `layer`
            with pytest.raises(TimeoutError):
                handle.wait_until(layer, timeout=0)
            assert not eng.query(handle)
            gate.release(0, layer)
            assert observed[layer].wait(T)
        t.join(T)
        assert not t.is_alive()
        handle.wait(T)
    assert snapshots == {layer: (True, False) for layer in range(shape.layer_num)}


@pytest.mark.timeout(30)
def test_operations_complete_in_fifo_order() -> None:
    shape = MLAShape(layer_num=3, kv_lora_rank=8, qk_rope_head_dim=4)
    dev, host = _pools(shape, 2, torch.float16, "page_first")
    _fill_random(dev, 11)
    gate = Gate(gated={0})
    with ThreadCopyEngine(layer_hook=gate) as eng:
        a = _page_slots([1, 2], 2)
        h_idx = _page_slots([4, 7], 2)
        b = _page_slots([5, 6], 2)
        expected = [_bytes(dev.kv_buffer(layer)[a]) for layer in range(shape.layer_num)]
        backup = eng.backup(dev, host, a, h_idx)
        # Queued behind the backup without waiting for it: FIFO order means it reads the backed-up bytes.
        load = eng.load(host, dev, h_idx, b)
        later = [eng.load(host, dev, h_idx, b) for _ in range(3)]
        gate.arrived(0, 0)
        assert not any(eng.query(h) for h in (backup, load, *later))
        gate.release_all(0, shape.layer_num)
        later[-1].wait(T)
        assert all(h.done() and h.error is None for h in (backup, load, *later))
    ops = [op for _, op, _ in gate.calls]
    assert ops == sorted(ops) and [layer for *_, layer in gate.calls] == list(range(shape.layer_num)) * 5
    for layer in range(shape.layer_num):
        assert torch.equal(_bytes(dev.kv_buffer(layer)[b]), expected[layer])


# ----------------------------------------------------------------------------- failures
@pytest.mark.timeout(30)
def test_worker_exception_surfaces_and_does_not_block_later_ops() -> None:
    shape = MHAShape(layer_num=4, head_num=1, head_dim=4)
    dev, host = _pools(shape, 2, torch.float32)
    _fill_random(dev, 5)
    idx, h_idx = _page_slots([1, 4], 2), _page_slots([0, 3], 2)
    gate = Gate(gated={1}, fail_at=(1, 2))
    with ThreadCopyEngine(layer_hook=gate) as eng:
        eng.backup(dev, host, idx, h_idx).wait(T)
        failing = eng.load(host, dev, h_idx, _page_slots([2, 3], 2))
        blocked: list[BaseException] = []

        def waiter() -> None:  # already blocked on a layer that will never land
            try:
                failing.wait_until(3, T)
            except BaseException as exc:
                blocked.append(exc)

        t = threading.Thread(target=waiter)
        t.start()
        gate.release_all(1, shape.layer_num)
        t.join(T)
        assert not t.is_alive() and len(blocked) == 1 and isinstance(blocked[0], CopyError)

        failing.wait_until(0, T)
        failing.wait_until(1, T)  # landed before the failure: still good
        with pytest.raises(CopyError, match="injected failure") as info:
            failing.wait_until(2, T)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(CopyError):
            failing.wait(T)
        assert failing.done() and isinstance(failing.error, RuntimeError)

        after = eng.load(host, dev, h_idx, _page_slots([5, 6], 2))
        after.wait(T)
        assert after.error is None
        for layer in range(shape.layer_num):
            for buf in dev.layer_buffers(layer):
                assert torch.equal(_bytes(buf[_page_slots([5, 6], 2)]), _bytes(buf[idx]))


@pytest.mark.timeout(30)
def test_bad_requests_raise_at_submission(engine: ThreadCopyEngine) -> None:
    dev, host = _pools(SHAPES["mha"], 4, torch.float16)
    with pytest.raises(ValueError, match="device indices"):
        engine.backup(dev, host, [4, 5], [0])
    with pytest.raises(IndexError, match="host_indices"):
        engine.backup(dev, host, [4], [host.size])
    with pytest.raises(IndexError, match="device_indices"):
        engine.load(host, dev, [0], [dev.total_slots])
    with pytest.raises(TypeError):
        engine.load(host, dev, torch.tensor([0.0]), [4])
    other_dev, _ = _pools(SHAPES["mla"], 4, torch.float16)
    with pytest.raises(ValueError, match="shapes differ"):
        engine.backup(other_dev, host, [4], [0])
    bf_dev, _ = _pools(SHAPES["mha"], 4, torch.bfloat16)
    with pytest.raises(ValueError, match="dtypes differ"):
        engine.backup(bf_dev, host, [4], [0])
    with pytest.raises(IndexError):
        engine.load(host, dev, [0], [4]).wait_until(SHAPES["mha"].layer_num)


@pytest.mark.timeout(30)
def test_close_drains_queue_then_refuses() -> None:
    dev, host = _pools(SHAPES["mla"], 4, torch.float32)
    gate = Gate(gated={0})
    eng = ThreadCopyEngine(layer_hook=gate)
    handles = [eng.backup(dev, host, _page_slots([1], 4), _page_slots([0], 4)) for _ in range(3)]
    gate.arrived(0, 0)
    closer = threading.Thread(target=eng.close)
    closer.start()
    gate.release_all(0, dev.layer_num)
    closer.join(T)
    assert not closer.is_alive()
    assert all(h.done() and h.error is None for h in handles)
    with pytest.raises(RuntimeError, match="closed"):
        eng.load(host, dev, [0], [4])
    eng.close()  # idempotent


def test_make_copy_engine_picks_by_device() -> None:
    eng = make_copy_engine("cpu")
    try:
        assert isinstance(eng, ThreadCopyEngine)
    finally:
        eng.close()


@pytest.mark.skipif(CUDA, reason="checks the error raised without CUDA")
def test_cuda_engine_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaCopyEngine()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        make_copy_engine("cuda")


def test_cuda_engine_rejects_a_negative_layer_delay() -> None:
    with pytest.raises(ValueError, match="layer_delay_cycles"):
        CudaCopyEngine(layer_delay_cycles=-1)


def test_cuda_engine_rejects_dma_without_the_kernel_library() -> None:
    with pytest.raises(ValueError, match="dma=True"):
        CudaCopyEngine(kernel=False, dma=True)


# ----------------------------------------------------------------------------- CUDA
def _cuda_paths() -> list:
    """The CUDA engine's ways to move a layer, as its keyword arguments: the kernel in both
    modes, the copy engines over its plan, and the mapped torch fallback."""
    from hiradix.memory.kernel import cuda_kernel_available

    no_kernel = pytest.mark.skipif(not cuda_kernel_available(), reason="the CUDA kernel library was not built")
    return [
        pytest.param({"kernel": False}, id="mapped"),
        pytest.param({"kernel": True, "mode": "warp"}, id="warp", marks=no_kernel),
        pytest.param({"kernel": True, "mode": "wide"}, id="wide", marks=no_kernel),
        pytest.param({"kernel": True, "dma": True}, id="dma", marks=no_kernel),
    ]


@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _cuda_paths())
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", ["mha", "mla"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_cuda_round_trip_is_byte_identical(layout: str, shape: str, page_size: int, path: dict) -> None:
    dev, host = _pools(SHAPES[shape], page_size, torch.bfloat16, layout, device="cuda")
    eng = CudaCopyEngine(**path)
    try:
        _round_trip(eng, dev, host, seed=page_size, whole_pages=True)
        _round_trip(eng, dev, host, seed=page_size + 1, whole_pages=False)
    finally:
        eng.close()


@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _cuda_paths())
def test_cuda_wait_until_orders_the_current_stream(path: dict) -> None:
    shape = MHAShape(layer_num=4, head_num=8, head_dim=128)
    dev, host = _pools(shape, 16, torch.float16, "page_first_direct", device="cuda")
    _fill_random(dev, 1)
    idx = _page_slots([1, 2, 3], 16)
    h_idx = _page_slots([0, 5, 9], 16)
    expected = [_bytes(dev.k_buffer(layer)[idx.cuda()]) for layer in range(shape.layer_num)]
    # Each layer's copy starts ~10 ms late (the engine's test seam): a wait_until that did
    # not order the current stream would read the zeros below.
    with make_copy_engine("cuda", layer_delay_cycles=20_000_000, **path) as eng:
        eng.backup(dev, host, idx, h_idx).wait()
        _zero(dev)
        handle = eng.load(host, dev, h_idx, idx.cuda())
        sums = []
        for layer in range(shape.layer_num):
            handle.wait_until(layer)  # stream-ordered: the reads below are queued after the copy
            sums.append(dev.k_buffer(layer)[idx.cuda()].clone())
        handle.wait()
        assert eng.query(handle)
    torch.cuda.synchronize()
    for layer in range(shape.layer_num):
        assert torch.equal(_bytes(sums[layer]), expected[layer])


@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _cuda_paths())
def test_cuda_backup_waits_for_the_fence_stream(path: dict) -> None:
    """A backup submitted while another stream (a forward pass under SGLang's overlap
    scheduler) is still writing the KV copies what that stream wrote: the engine's copy
    stream waits for ``fence_stream`` as well as for the submitting thread's stream."""
    shape = MHAShape(layer_num=2, head_num=8, head_dim=128)
    dev, host = _pools(shape, 16, torch.float16, "page_first_direct", device="cuda")
    idx = _page_slots([1, 2], 16)
    h_idx = _page_slots([0, 3], 16)
    forward = torch.cuda.Stream()
    with make_copy_engine("cuda", **path) as eng:
        eng.fence_stream = forward
        with torch.cuda.stream(forward):
            torch.cuda._sleep(200_000_000)  # the forward pass is still busy ...
            for layer in range(shape.layer_num):
                for buf in dev.layer_buffers(layer):
                    buf[idx.cuda()] = 7  # ... and writes the KV last
        eng.backup(dev, host, idx, h_idx).wait()
    torch.cuda.synchronize()
    back = _pools(shape, 16, torch.float16, "page_first_direct", device="cuda")[0]
    with make_copy_engine("cuda", **path) as eng:
        eng.load(host, back, h_idx, idx.cuda()).wait()
    torch.cuda.synchronize()
    for layer in range(shape.layer_num):
        for buf in back.layer_buffers(layer):
            assert bool((buf[idx.cuda()] == 7).all()), "the backup copied KV before the forward stream wrote it"


def test_planning_caches_keep_no_pool_alive() -> None:
    """The copy planner's caches (per pool pair, and the pair planned last) hold the pools'
    storage only as long as the pools themselves live."""
    import gc

    import hiradix.memory.copy as copy_mod

    dev, host = _pools(SHAPES["mha"], 1, torch.float32)
    with ThreadCopyEngine(inline=True) as eng:
        eng.backup_now(dev, host, [1, 2], [0, 1])
        eng.backup_now(dev, host, [3], [2])  # served by the cached pair
    if copy_mod._LAST_PAIR is None:
        pytest.skip("the compiled copy is not in use: nothing is planned (HIRADIX_PUREPYTHON or not built)")
    layout = copy_mod._LAST_PAIR[2]  # its regions are views of both pools' storage
    assert layout() is not None
    del dev, host
    gc.collect()
    assert layout() is None
