"""The compiled row copy (``hiradix.memory._gather``) and the copy engine's use of it.

- Byte parity of the engine's compiled path against its torch path and against an oracle
  built page by page from :meth:`HostKVPool.get_page_bytes`, for every host layout, MHA and
  MLA, page sizes 1 and 16, every KV dtype, and random non-contiguous indices.
- ``copy_rows`` itself: merging of contiguous runs, every kind of bad input raises before
  a byte moves, overlapping buffers, the threaded split.
- The GIL is released during a large copy: shown with a huge switch interval, under which
  another Python thread can run only if the copying thread lets go of the GIL. No sleeps.

Without the extension (``HIRADIX_PUREPYTHON=1`` or not built) the ``copy_rows`` tests skip
and the engine tests check the torch path against the same oracle.
"""

from __future__ import annotations

import doctest
import random
import sys
import threading

import numpy as np
import pytest
import torch

from hiradix.memory import (
    HOST_LAYOUTS,
    DeviceKVPool,
    HostKVPool,
    KVShape,
    MHAShape,
    MLAShape,
    ThreadCopyEngine,
    fp8_dtypes,
)
from hiradix.memory import copy as copy_mod

NATIVE = copy_mod.NATIVE_AVAILABLE
needs_native = pytest.mark.skipif(not NATIVE, reason="hiradix.memory._gather not in use (not built or PUREPYTHON)")
T = 10.0  # seconds a wait may take before it is a failure; never used to order events

SHAPES: dict[str, KVShape] = {
    "mha": MHAShape(layer_num=3, head_num=2, head_dim=8),
    "mha_vdim": MHAShape(layer_num=2, head_num=2, head_dim=8, v_head_dim=4),
    "mla": MLAShape(layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, *fp8_dtypes()]
PAGES = 8


def _gather():  # type: ignore[no-untyped-def]
    from hiradix.memory import _gather

    return _gather


# ----------------------------------------------------------------------------- helpers
def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _fill(pool: DeviceKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layer_num):
        for buf in pool.layer_buffers(layer):
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _fill_host(host: HostKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = host.backing_tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _pools(shape: KVShape, ps: int, dtype: torch.dtype, layout: str) -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(shape, size=PAGES * ps, page_size=ps, dtype=dtype)
    host = HostKVPool.for_device(dev, ratio=2.0, layout=layout, reserve_bytes=0)  # type: ignore[arg-type]
    return dev, host


def _slots(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + o for p in pages for o in range(ps)], dtype=torch.int64)


def _indices(dev: DeviceKVPool, host: HostKVPool, rng: random.Random, scattered: bool) -> tuple[torch.Tensor, ...]:
    """Random device and host slots: whole pages in random order, or (``scattered``) single
    slots anywhere on both sides, neither page aligned nor contiguous."""
    ps = dev.page_size
    n_pages = 3
    if scattered:
        d = rng.sample(range(ps, dev.total_slots), n_pages * ps)
        h = rng.sample(range(host.size), n_pages * ps)
        return torch.tensor(d, dtype=torch.int64), torch.tensor(h, dtype=torch.int64)
    d_pages = rng.sample(range(1, dev.total_slots // ps), n_pages)  # page 0 is padding
    return _slots(d_pages, ps), _slots(rng.sample(range(host.page_num), n_pages), ps)


def _device_rows(dev: DeviceKVPool, slots: list[int]) -> list[list[torch.Tensor]]:
    """Per layer, per component: the bytes of ``slots``' rows (each ``[len(slots), row]``)."""
    idx = torch.tensor(slots, dtype=torch.int64)
    return [[_raw(b[idx]).view(len(slots), -1) for b in dev.layer_buffers(layer)] for layer in range(dev.layer_num)]


def _expected_page(host: HostKVPool, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """The bytes ``get_page_bytes`` must return for a page whose token ``t`` holds row
    ``rows[layer][comp][t]``, composed from the layouts' documented orders."""
    if host.layout == "page_first":  # [page_size, layers, comps, E]
        parts = [
            rows[layer][c][t] for t in range(host.page_size) for layer in range(len(rows)) for c in range(len(rows[0]))
        ]
    else:  # page_first_direct order, also layer_first's copy: [layers, comps, page_size, E]
        parts = [rows[layer][c].reshape(-1) for layer in range(len(rows)) for c in range(len(rows[0]))]
    return torch.cat(parts)


def _snapshot_dev(dev: DeviceKVPool) -> list[torch.Tensor]:
    return [_raw(b).clone() for layer in range(dev.layer_num) for b in dev.layer_buffers(layer)]


# ----------------------------------------------------------------------------- engine parity
ENGINES = [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="torch")]


def _backup_case(layout: str, shape: str, ps: int, dtype: torch.dtype, scattered: bool, seed: int) -> None:
    dev, host = _pools(SHAPES[shape], ps, dtype, layout)
    _fill(dev, seed)
    rng = random.Random(seed)
    d_idx, h_idx = _indices(dev, host, rng, scattered)
    hosts = {}
    for native in [True, False] if NATIVE else [False]:
        h = HostKVPool.for_device(dev, ratio=2.0, layout=layout, reserve_bytes=0)  # type: ignore[arg-type]
        _fill_host(h, seed + 1)  # the same background in both: untouched bytes must survive
        with ThreadCopyEngine(native=native) as eng:
            eng.backup(dev, h, d_idx, h_idx).wait(T)
        hosts[native] = h
    if NATIVE:
        assert torch.equal(_raw(hosts[True].backing_tensor), _raw(hosts[False].backing_tensor)), (
            "native and torch paths differ"
        )
    got = hosts[NATIVE]
    background = HostKVPool.for_device(dev, ratio=2.0, layout=layout, reserve_bytes=0)  # type: ignore[arg-type]
    _fill_host(background, seed + 1)
    # Oracle, page by page: every host page is either fully written (whole pages) or its
    # written tokens are the device rows and the rest is the background.
    written = dict(zip(h_idx.tolist(), d_idx.tolist(), strict=True))
    for start in range(0, host.size, ps):
        before = background.get_page_bytes(start)
        tokens = [written.get(start + t) for t in range(ps)]
        if all(t is None for t in tokens):
            assert torch.equal(got.get_page_bytes(start), before), f"page {start // ps} was written"
            continue
        rows = _page_rows_from(background, start)
        for t, src in enumerate(tokens):
            if src is not None:
                dev_rows = _device_rows(dev, [src])
                for layer in range(dev.layer_num):
                    for c in range(len(dev_rows[0])):
                        rows[layer][c][t] = dev_rows[layer][c][0]
        assert torch.equal(got.get_page_bytes(start), _expected_page(host, rows)), f"page {start // ps}"


def _page_rows_from(host: HostKVPool, start: int) -> list[list[torch.Tensor]]:
    """A page's rows per (layer, comp), read through ``get_page_layer_view`` (a view
    independent of the engine's byte offsets)."""
    page = start // host.page_size
    return [
        [_raw(v[page]).view(host.page_size, -1).clone() for v in host.get_page_layer_view(layer)]
        for layer in range(host.layer_num)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backup_bytes_match_torch_path_and_pages(layout: str, shape: str, ps: int, dtype: torch.dtype) -> None:
    seed = ps * 101 + len(layout) * 7 + len(shape)
    _backup_case(layout, shape, ps, dtype, scattered=False, seed=seed)
    _backup_case(layout, shape, ps, dtype, scattered=True, seed=seed + 1)


def _load_case(layout: str, shape: str, ps: int, dtype: torch.dtype, scattered: bool, seed: int) -> None:
    dev0, host = _pools(SHAPES[shape], ps, dtype, layout)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, host.size, ps):  # host content written page by page, by the pool itself
        host.set_page_bytes(start, torch.randint(0, 256, (host.page_bytes,), dtype=torch.uint8, generator=gen))
    rng = random.Random(seed)
    d_idx, h_idx = _indices(dev0, host, rng, scattered)
    devs = {}
    for native in [True, False] if NATIVE else [False]:
        dev = DeviceKVPool(dev0.shape, size=dev0.size, page_size=ps, dtype=dtype)
        _fill(dev, seed + 2)
        handle = ThreadCopyEngine(native=native)
        with handle as eng:
            h = eng.load(host, dev, h_idx, d_idx)
            for layer in range(dev.layer_num):
                h.wait_until(layer, T)
            h.wait(T)
        devs[native] = dev
    if NATIVE:
        for a, b in zip(_snapshot_dev(devs[True]), _snapshot_dev(devs[False]), strict=True):
            assert torch.equal(a, b), "native and torch paths differ"
    got = devs[NATIVE]
    background = DeviceKVPool(dev0.shape, size=dev0.size, page_size=ps, dtype=dtype)
    _fill(background, seed + 2)
    # Oracle: each loaded device row equals its token's row in the host page's bytes.
    pairs = dict(zip(d_idx.tolist(), h_idx.tolist(), strict=True))
    for slot in range(got.total_slots):
        want_rows = _device_rows(background, [slot])
        if slot in pairs:
            s = pairs[slot]
            page_rows = _split_page(host, host.get_page_bytes(s - s % ps), got)
            want_rows = [
                [page_rows[layer][c][s % ps : s % ps + 1] for c in range(len(page_rows[0]))]
                for layer in range(got.layer_num)
            ]
        have = _device_rows(got, [slot])
        for layer in range(got.layer_num):
            for c in range(len(have[0])):
                assert torch.equal(have[layer][c], want_rows[layer][c]), f"slot {slot} layer {layer} comp {c}"


def _split_page(host: HostKVPool, page: torch.Tensor, dev: DeviceKVPool) -> list[list[torch.Tensor]]:
    """Inverse of :func:`_expected_page`: a page's bytes as rows per (layer, comp)."""
    widths = [b[0].numel() * b.element_size() for b in dev.layer_buffers(0)]
    ps, layers = host.page_size, host.layer_num
    out: list[list[list[torch.Tensor]]] = [[[] for _ in widths] for _ in range(layers)]
    off = 0
    if host.layout == "page_first":
        for _t in range(ps):
            for layer in range(layers):
                for c, w in enumerate(widths):
                    out[layer][c].append(page[off : off + w])
                    off += w
        return [[torch.stack(rows) for rows in comps] for comps in out]
    result = []
    for _layer in range(layers):
        comps = []
        for w in widths:
            comps.append(page[off : off + ps * w].view(ps, w))
            off += ps * w
        result.append(comps)
    return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_load_bytes_match_torch_path_and_pages(layout: str, shape: str, ps: int, dtype: torch.dtype) -> None:
    seed = ps * 103 + len(layout) * 5 + len(shape)
    _load_case(layout, shape, ps, dtype, scattered=False, seed=seed)
    _load_case(layout, shape, ps, dtype, scattered=True, seed=seed + 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", ENGINES)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_large_round_trip_with_threads(layout: str, native: bool) -> None:
    # Big enough that each (layer, component) copy releases the GIL and is split over threads.
    shape = MHAShape(layer_num=2, head_num=8, head_dim=128)  # 2 KiB rows in fp16
    ps = 16
    dev = DeviceKVPool(shape, size=64 * ps, page_size=ps, dtype=torch.float16)
    host = HostKVPool.for_device(dev, ratio=1.0, layout=layout, reserve_bytes=0)  # type: ignore[arg-type]
    _fill(dev, 3)
    rng = random.Random(3)
    d_pages = rng.sample(range(1, 65), 64)
    d_idx = _slots(d_pages, ps)
    h_idx = _slots(rng.sample(range(64), 64), ps)
    before = _snapshot_dev(dev)
    with ThreadCopyEngine(native=native, copy_threads=2) as eng:
        eng.backup(dev, host, d_idx, h_idx).wait(T)
        for layer in range(dev.layer_num):
            for b in dev.layer_buffers(layer):
                b.zero_()
        back = _slots(d_pages[::-1], ps)  # each page lands on another device page
        eng.load(host, dev, h_idx, back).wait(T)
    after = _snapshot_dev(dev)
    row = shape.head_num * shape.head_dim * 2
    for a, b in zip(before, after, strict=True):
        a_rows, b_rows = a.view(-1, row), b.view(-1, row)
        assert torch.equal(b_rows[back], a_rows[d_idx])
        assert not b_rows[:ps].any()  # padding page untouched


def test_engine_options() -> None:
    with pytest.raises(ValueError, match="copy_threads"):
        ThreadCopyEngine(copy_threads=0)
    with pytest.raises(ValueError, match="copy_threads"):
        ThreadCopyEngine(copy_threads=True)  # type: ignore[arg-type]
    eng = ThreadCopyEngine(native=False)
    try:
        assert eng.native is False and eng.copy_threads >= 1
    finally:
        eng.close()
    if NATIVE:
        with ThreadCopyEngine() as eng2:
            assert eng2.native is True  # type: ignore[attr-defined]
    else:
        with pytest.raises(RuntimeError, match="not in use"):
            ThreadCopyEngine(native=True)


# ----------------------------------------------------------------------------- copy_rows
@needs_native
def test_copy_rows_doctests() -> None:
    res = doctest.testmod(_gather())
    assert res.failed == 0 and res.attempted > 0


@needs_native
@pytest.mark.parametrize("row", [1, 2, 8, 48])
def test_copy_rows_matches_numpy(row: int) -> None:
    g = _gather()
    rng = np.random.default_rng(row)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst = rng.integers(0, 256, 4096, dtype=np.uint8)
    n = 40
    s_off = rng.choice(np.arange(0, 4096 - row - 64, row), n, replace=False).astype(np.int64)
    d_off = rng.choice(np.arange(0, 4096 - row - 64, row), n, replace=False).astype(np.int64)
    expect = dst.copy()
    for d, s in zip(d_off, s_off, strict=True):
        expect[64 + d : 64 + d + row] = src[32 + s : 32 + s + row]
    g.copy_rows(dst, d_off, 64, src, s_off, 32, row)
    assert np.array_equal(dst, expect)


@needs_native
def test_copy_rows_merges_runs_contiguous_on_both_sides() -> None:
    g = _gather()
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    # Rows 0-3 contiguous on both sides, then a jump on the source side only, then on
    # the destination side only: three runs.
    d = np.array([0, 4, 8, 12, 16, 20, 40], dtype=np.int64)
    s = np.array([100, 104, 108, 112, 0, 4, 8], dtype=np.int64)
    assert g.copy_rows(dst, d, 0, src, s, 0, 4) == 3
    assert dst[:16].tolist() == list(range(100, 116))
    assert dst[16:24].tolist() == list(range(8)) and dst[40:44].tolist() == [8, 9, 10, 11]
    assert g.copy_rows(dst, np.arange(64, dtype=np.int64) * 4, 0, src, np.arange(64, dtype=np.int64) * 4, 0, 4) == 1
    assert g.copy_rows(dst, np.empty(0, np.int64), 0, src, np.empty(0, np.int64), 0, 4) == 0


def _bad_calls() -> list[tuple[str, dict, type[Exception], str]]:
    ok = np.array([0, 8, 16, 24], dtype=np.int64)
    src = np.arange(64, dtype=np.uint8)
    last_out = np.array([0, 8, 16, 57], dtype=np.int64)  # the last row ends 1 byte past
    return [
        ("dst row out of range", {"dst_offsets": last_out}, IndexError, r"dst_offsets\[3\] = 57"),
        ("src row out of range", {"src_offsets": np.array([0, 8, 16, 64], np.int64)}, IndexError, "src_offsets"),
        ("negative offset", {"src_offsets": np.array([0, -8, 16, 24], np.int64)}, IndexError, r"src_offsets\[1\]"),
        ("base pushes out", {"dst_base": 48}, IndexError, "dst_offsets"),
        ("row bigger than buffer", {"row_bytes": 128}, IndexError, "no room"),
        ("lengths differ", {"src_offsets": ok[:3]}, ValueError, "4 rows but src_offsets has 3"),
        ("misaligned offset", {"dst_offsets": np.array([0, 8, 18, 24], np.int64), "align": 4}, ValueError, "align"),
        ("misaligned row", {"row_bytes": 6, "align": 4}, ValueError, "row_bytes"),
        ("align not a power of two", {"align": 3}, ValueError, "power of two"),
        ("negative base", {"src_base": -1}, ValueError, "non-negative"),
        ("float dst", {"dst": np.zeros(16, np.float32)}, TypeError, "uint8"),
        ("float src", {"src": src.astype(np.float64)}, TypeError, "uint8"),
        ("2-D dst", {"dst": np.zeros((8, 8), np.uint8)}, TypeError, "1-D"),
        ("strided src", {"src": np.arange(128, dtype=np.uint8)[::2]}, TypeError, "contiguous"),
        ("int32 offsets", {"dst_offsets": ok.astype(np.int32)}, TypeError, "int64"),
        ("offsets as a list", {"src_offsets": [0, 8, 16, 24]}, TypeError, "int64"),
        ("tensor dst", {"dst": torch.zeros(64, dtype=torch.uint8)}, TypeError, "numpy"),
        ("threads", {"threads": 0}, ValueError, "threads"),
    ]


@needs_native
@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_copy_rows_bad_input_raises_and_copies_nothing(case: tuple) -> None:
    g = _gather()
    _name, override, exc, match = case
    dst = np.full(64, 0xEE, dtype=np.uint8)
    args = {
        "dst": dst,
        "dst_offsets": np.array([0, 8, 16, 24], dtype=np.int64),
        "dst_base": 0,
        "src": np.arange(64, dtype=np.uint8),
        "src_offsets": np.array([0, 8, 16, 24], dtype=np.int64),
        "src_base": 0,
        "row_bytes": 8,
    }
    args.update(override)
    with pytest.raises(exc, match=match):
        g.copy_rows(**args)
    assert (dst == 0xEE).all(), "a failed call wrote to dst"


@needs_native
def test_copy_rows_bad_last_row_of_a_large_copy_writes_nothing() -> None:
    # Large enough to run without the GIL (validation happens there too).
    g = _gather()
    row = 4096
    n = 64
    src = np.ones(n * row, np.uint8)
    dst = np.zeros(n * row, np.uint8)
    off = np.arange(n, dtype=np.int64) * row
    bad = off.copy()
    bad[-1] = n * row  # one row past the end
    with pytest.raises(IndexError):
        g.copy_rows(dst, bad, 0, src, off, 0, row)
    with pytest.raises(IndexError):
        g.copy_rows(dst, off, 0, src, bad, 0, row, 1, 2)
    assert not dst.any()


@needs_native
def test_copy_rows_read_only_dst_and_readonly_src() -> None:
    g = _gather()
    src = np.arange(16, dtype=np.uint8)
    src.flags.writeable = False  # a read-only source is fine
    dst = np.zeros(16, np.uint8)
    off = np.array([0], np.int64)
    assert g.copy_rows(dst, off, 0, src, off, 0, 16) == 1
    assert dst.tolist() == list(range(16))
    with pytest.raises(TypeError, match="writable"):
        g.copy_rows(src, off, 0, dst, off, 0, 16)
    g.copy_rows(bytearray(16), off, 0, b"x" * 16, off, 0, 16)  # any buffer-protocol object


@needs_native
def test_copy_rows_overlapping_buffers_copy_in_order() -> None:
    g = _gather()
    buf = np.arange(32, dtype=np.uint8)
    # Shift right by 4 within one buffer, rows in order: row 1 reads what row 0 wrote.
    g.copy_rows(buf, np.array([4, 8], np.int64), 0, buf, np.array([0, 4], np.int64), 0, 4)
    assert buf[:12].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    # One overlapping run (memmove semantics inside a run).
    buf = np.arange(32, dtype=np.uint8)
    g.copy_rows(buf[2:], np.array([0], np.int64), 0, buf, np.array([0], np.int64), 0, 16)
    assert buf[2:18].tolist() == list(range(16))


@needs_native
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_copy_rows_threads_give_the_same_bytes(threads: int) -> None:
    g = _gather()
    row = 1024
    n = (g.PARALLEL_MIN_BYTES // row) * 2 + 5  # above the split threshold, uneven slices
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, n * row, dtype=np.uint8)
    perm_d = rng.permutation(n).astype(np.int64) * row
    perm_s = rng.permutation(n).astype(np.int64) * row
    one = np.zeros(n * row, np.uint8)
    many = np.zeros(n * row, np.uint8)
    g.copy_rows(one, perm_d, 0, src, perm_s, 0, row)
    g.copy_rows(many, perm_d, 0, src, perm_s, 0, row, 1, threads)
    assert np.array_equal(one, many)
    assert np.array_equal(many.reshape(n, row)[perm_d // row], src.reshape(n, row)[perm_s // row])


# ----------------------------------------------------------------------------- GIL
class _HugeSwitchInterval:
    """While active, a thread that holds the GIL keeps it until it blocks or releases it
    explicitly: CPython asks it to drop the GIL only after the switch interval."""

    def __enter__(self) -> None:
        self._old = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)

    def __exit__(self, *exc: object) -> None:
        sys.setswitchinterval(self._old)


def _main_runs_during(copy: object) -> bool:
    """Run ``copy()`` in a worker. The worker signals ``started`` right before it; the main
    thread, woken by that signal, needs the GIL to record whether the copy has returned.
    With a huge switch interval it can only get the GIL mid-copy if the copy released it;
    otherwise it gets it once the worker finishes (the thread exits)."""
    started = threading.Event()
    finished: list[bool] = []
    progress = [0]

    def worker() -> None:
        started.set()
        copy()  # type: ignore[operator]
        finished.append(True)

    t = threading.Thread(target=worker)
    with _HugeSwitchInterval():
        t.start()
        assert started.wait(T)
        mid_copy = not finished  # we hold the GIL here
        if mid_copy:
            progress[0] += 1  # Python work done while the copy is still running
        t.join(T)  # blocks: releases the GIL so the worker can finish
    assert not t.is_alive()
    return mid_copy and progress[0] == 1


@needs_native
@pytest.mark.timeout(60)
def test_large_copy_releases_the_gil() -> None:
    g = _gather()
    row = 1 << 20
    n = 96  # 96 MiB copied, in 1 MiB rows out of a 16 MiB source
    src = np.ones(16 * row, np.uint8)
    dst = np.zeros(n * row, np.uint8)
    d_off = np.arange(n, dtype=np.int64) * row
    s_off = (np.arange(n, dtype=np.int64) % 16) * row
    # Scheduling can delay the main thread past the end of one copy: a few attempts.
    assert any(_main_runs_during(lambda: g.copy_rows(dst, d_off, 0, src, s_off, 0, row)) for _ in range(5))
    assert dst.all()


@needs_native
@pytest.mark.timeout(60)
def test_small_copy_keeps_the_gil() -> None:
    # The control for the test above: a copy below NOGIL_MIN_BYTES keeps the GIL, and the
    # same probe must then never see it mid-copy (this is what makes the probe meaningful).
    g = _gather()
    row = 256
    n = g.NOGIL_MIN_BYTES // row - 1
    src = np.ones(n * row, np.uint8)
    dst = np.zeros(n * row, np.uint8)
    off = np.arange(n, dtype=np.int64) * row

    def many_small_copies() -> None:  # long enough to be observable, GIL held throughout
        for _ in range(2000):
            g.copy_rows(dst, off, 0, src, off, 0, row)

    assert not any(_main_runs_during(many_small_copies) for _ in range(2))


# ----------------------------------------------------------------------------- planning helpers
@needs_native
# Powers of two take the shift-and-mask loop, the others the division loop.
@pytest.mark.parametrize(
    ("page_size", "page_stride", "slot_stride"),
    [(1, 256, 0), (4, 4096, 64), (16, 65536, 512), (3, 3072, 1024), (48, 98304, 2048), (7, 700, 100)],
)
def test_slot_offsets_follow_the_layout_formula(page_size: int, page_stride: int, slot_stride: int) -> None:
    slots = np.random.default_rng(page_size).integers(0, 1000, 300, dtype=np.int64)
    got = _gather().slot_offsets(slots, 1000, page_size, page_stride, slot_stride, "slots")
    want = (slots // page_size) * page_stride + (slots % page_size) * slot_stride
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert got is not slots and not np.shares_memory(got, slots)  # the caller may reuse its input


def _rows_of_runs(dev_off: np.ndarray, host_off: np.ndarray, run_bytes: np.ndarray, row: int) -> list:
    """The (device, host) byte offsets of every row the runs cover, in order."""
    out = []
    for d, h, n in zip(dev_off.tolist(), host_off.tolist(), run_bytes.tolist(), strict=True):
        assert n > 0 and n % row == 0
        out += [(d + j, h + j) for j in range(0, n, row)]
    return out


@needs_native
@pytest.mark.parametrize("host_sorted", [True, False])
def test_pair_runs_is_host_order_then_the_formula_per_component_merged(host_sorted: bool) -> None:
    """The whole plan in one call: pairs sorted by host slot (stable), each distinct
    component's rows by the layout formula, merged into maximal runs where a row follows
    the previous one on both sides; a component with ``reuse`` sharing the arrays it
    names; the inputs untouched."""
    rng = np.random.default_rng(5)
    # Random pairs plus stretches consecutive on both sides (what a step's write-through is).
    host = np.concatenate([rng.choice(2000, 150, replace=False), np.arange(2100, 2160), np.arange(3000, 3040)])
    dev = np.concatenate([rng.integers(0, 600, 150), np.arange(700, 760), np.arange(800, 840)]).astype(np.int64)
    host = host.astype(np.int64)
    if not host_sorted:
        perm = rng.permutation(len(host))
        host, dev = host[perm], dev[perm]
    dev_in, host_in = dev.copy(), host.copy()
    comps = ((-1, 64, 4096, 256, 64), (0, 64, 4096, 256, 64), (-1, 32, 2048, 32, 32), (-1, 32, 16 * 32, 32, 32))
    dev_off, host_off, run_bytes = _gather().pair_runs(dev, host, 900, 4000, 16, comps)
    order = np.argsort(host, kind="stable")
    d, h = dev[order], host[order]
    for c, (reuse, *_) in enumerate(comps):
        _, sdps, shps, shss, row = comps[c if reuse < 0 else reuse]
        rows = list(zip((d * sdps).tolist(), ((h // 16) * shps + (h % 16) * shss).tolist(), strict=True))
        assert _rows_of_runs(dev_off[c], host_off[c], run_bytes[c], row) == rows
        ends = list(zip((dev_off[c] + run_bytes[c]).tolist(), (host_off[c] + run_bytes[c]).tolist(), strict=True))
        starts = list(zip(dev_off[c].tolist(), host_off[c].tolist(), strict=True))
        assert all(e != s for e, s in zip(ends, starts[1:], strict=False)), "runs are maximal"
    # Component 2 (slot stride = row) merges within a host page; component 3's page
    # stride is 16 slots of rows, so a consecutive stretch is one run across pages too.
    assert len(run_bytes[3]) < len(run_bytes[2]) < len(d)
    assert dev_off[1] is dev_off[0] and host_off[1] is host_off[0] and run_bytes[1] is run_bytes[0]
    assert np.array_equal(dev, dev_in) and np.array_equal(host, host_in)


@needs_native
def test_pair_runs_refuses_bad_pairs() -> None:
    g = _gather()
    comps = ((-1, 8, 64, 8, 8),)
    with pytest.raises(ValueError, match="3 device indices but 2 host indices"):
        g.pair_runs(np.arange(3), np.arange(2), 10, 10, 4, comps)
    with pytest.raises(IndexError, match=r"device_indices out of range \[0, 10\)"):
        g.pair_runs(np.array([1, 10]), np.array([0, 1]), 10, 10, 4, comps)
    with pytest.raises(IndexError, match=r"host_indices out of range \[0, 8\)"):
        g.pair_runs(np.array([1, 2]), np.array([0, 8]), 10, 8, 4, comps)
    with pytest.raises(ValueError, match="host_page_size"):
        g.pair_runs(np.array([1]), np.array([0]), 10, 8, 0, comps)


@needs_native
def test_copy_runs_matches_numpy() -> None:
    g = _gather()
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst = rng.integers(0, 256, 4096, dtype=np.uint8)
    starts = np.sort(rng.choice(np.arange(0, 3800, 8), 30, replace=False)).astype(np.int64)
    lens = (np.minimum(np.diff(np.append(starts, 3800)), 8 * rng.integers(1, 6, 30)) // 8 * 8).astype(np.int64)
    s_off = rng.permutation(starts)
    expect = dst.copy()
    for d, s_, n in zip(starts, s_off, lens, strict=True):
        expect[64 + d : 64 + d + n] = src[32 + s_ : 32 + s_ + n]
    assert g.copy_runs(dst, starts, 64, src, s_off, 32, lens, 8) == 30
    assert np.array_equal(dst, expect)


@needs_native
@pytest.mark.parametrize(
    ("override", "exc", "match"),
    [
        ({"run_bytes": np.array([8, 8, 8, 41], np.int64)}, IndexError, "run 3"),
        ({"dst_offsets": np.array([0, 8, 16, 57], np.int64)}, IndexError, "run 3"),
        ({"src_offsets": np.array([0, -8, 16, 24], np.int64)}, IndexError, "run 1"),
        ({"run_bytes": np.array([8, -8, 8, 8], np.int64)}, IndexError, "run 1"),
        ({"run_bytes": np.array([8, 6, 8, 8], np.int64), "align": 4}, ValueError, "align=4"),
        ({"run_bytes": np.array([8, 8, 8], np.int64)}, ValueError, "4 runs"),
        ({"dst_base": 60}, IndexError, "run 0"),
        ({"threads": 9}, ValueError, "threads"),
    ],
)
def test_copy_runs_bad_input_raises_and_copies_nothing(override: dict, exc: type, match: str) -> None:
    g = _gather()
    dst = np.full(64, 0xEE, dtype=np.uint8)
    args = {
        "dst": dst,
        "dst_offsets": np.array([0, 8, 16, 24], np.int64),
        "dst_base": 0,
        "src": np.arange(64, dtype=np.uint8),
        "src_offsets": np.array([0, 8, 16, 24], np.int64),
        "src_base": 0,
        "run_bytes": np.array([8, 8, 8, 8], np.int64),
    } | override
    with pytest.raises(exc, match=match):
        g.copy_runs(**args)
    assert (dst == 0xEE).all(), "nothing may be copied when a run is bad"


@needs_native
def test_copy_runs_refuses_overlapping_buffers() -> None:
    buf = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _gather().copy_runs(buf[32:], np.array([0]), 0, buf, np.array([0]), 0, np.array([8]))
    assert buf.tolist() == list(range(64))


@needs_native
@pytest.mark.parametrize("bad", [-1, 1000])
def test_slot_offsets_name_the_bad_side_and_range(bad: int) -> None:
    slots = np.array([3, bad, 7], dtype=np.int64)
    msg = rf"host_indices out of range \[0, 1000\): min {min(3, bad)}, max {max(7, bad)}"
    with pytest.raises(IndexError, match=msg):
        _gather().slot_offsets(slots, 1000, 4, 64, 16, "host_indices")
    with pytest.raises(ValueError, match="page_size"):
        _gather().slot_offsets(slots, 1000, 0, 64, 16, "x")
    with pytest.raises(TypeError, match="int64"):
        _gather().slot_offsets(slots.astype(np.int32), 1000, 4, 64, 16, "x")


@needs_native
def test_is_sorted() -> None:
    assert _gather().is_sorted(np.array([], dtype=np.int64))
    assert _gather().is_sorted(np.array([1, 1, 2, 9], dtype=np.int64))
    assert not _gather().is_sorted(np.array([1, 3, 2], dtype=np.int64))
