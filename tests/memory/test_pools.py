"""KV pools: the paged slot allocator, the device pool and the host pool's layouts."""

from __future__ import annotations

import itertools
import math
import mmap
import random

import pytest
import torch

from hiradix.memory import (
    HOST_LAYOUTS,
    DeviceKVPool,
    HostKVPool,
    MHAShape,
    MLAShape,
    PagedSlotAllocator,
    fp8_dtypes,
    read_meminfo,
)
from hiradix.memory.pools import HUGE_PAGE, PAGE_ORDERS, alloc_cpu_buffer, huge_pages_enabled

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU on this machine")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, *fp8_dtypes()[:1]]
SHAPES = {
    "mha": MHAShape(layer_num=3, head_num=2, head_dim=8),
    "mha_vdim": MHAShape(layer_num=2, head_num=2, head_dim=8, v_head_dim=4),
    "mla": MLAShape(layer_num=3, kv_lora_rank=16, qk_rope_head_dim=4),
}
NO_RESERVE = {"reserve_bytes": 0}


def _snapshot(a: PagedSlotAllocator) -> tuple[int, list[bool], list[int]]:
    a.check_invariants()
    return a.available_size(), a.allocated_pages(), sorted(a.free_pages().tolist())


# ----------------------------------------------------------------------------- allocator
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_is_page_aligned_and_skips_padding_page(page_size: int) -> None:
    a = PagedSlotAllocator(8 * page_size, page_size)
    assert a.total_slots == 9 * page_size
    seen: set[int] = set()
    for _ in range(4):
        idx = a.alloc(2 * page_size)
        assert idx is not None and idx.dtype == torch.int64 and idx.numel() == 2 * page_size
        pages = idx.view(-1, page_size)
        assert (pages[:, 0] % page_size == 0).all()
        assert (pages - pages[:, :1] == torch.arange(page_size)).all()
        assert int(idx.min()) >= page_size  # page 0 is padding
        seen |= set(idx.tolist())
    assert seen == set(range(page_size, 9 * page_size))
    assert a.available_size() == 0


def test_alloc_without_reserved_page_uses_slot_zero() -> None:
    a = PagedSlotAllocator(8, 4, reserve_first_page=False)
    assert a.total_slots == 8
    assert a.alloc(8).tolist() == list(range(8))  # type: ignore[union-attr]


def test_alloc_rejects_non_page_multiple_and_size_rounds_down() -> None:
    a = PagedSlotAllocator(10, 4)
    assert a.size == 8 and a.available_size() == 8
    for bad in (3, 5, -4):
        with pytest.raises(ValueError, match="multiple of page_size"):
            a.alloc(bad)
    assert a.available_size() == 8
    assert a.alloc(0).numel() == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        PagedSlotAllocator(8, 0)


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    a = PagedSlotAllocator(16, 4)
    assert a.alloc(12) is not None
    before = _snapshot(a)
    assert a.alloc(8) is None
    assert _snapshot(a) == before
    assert a.alloc(4) is not None
    assert a.alloc(4) is None


def test_batched_frees_are_pending_until_alloc_needs_them() -> None:
    a = PagedSlotAllocator(16, 4)
    idx = a.alloc(16)
    assert idx is not None and a.alloc(4) is None
    for page in idx.view(-1, 4):
        a.free(page)
        a.check_invariants()
    # Frees only queue: none was merged into the free list yet.
    assert a.pending_frees == 4
    assert a.available_size() == 16
    again = a.alloc(16)
    assert again is not None and sorted(again.tolist()) == sorted(idx.tolist())
    assert a.pending_frees == 0
    a.check_invariants()


def test_free_any_slot_frees_its_page_and_duplicates_are_one_free() -> None:
    a = PagedSlotAllocator(16, 4)
    idx = a.alloc(8)
    assert idx is not None
    a.free(torch.tensor([idx[1], idx[2], idx[2]]))  # two slots of the first page
    assert a.available_size() == 12
    assert a.is_allocated(idx).tolist() == [False] * 4 + [True] * 4


@pytest.mark.parametrize("bad", ["double", "never", "range_hi", "range_neg", "padding", "mixed"])
def test_bad_free_raises_and_changes_nothing(bad: str) -> None:
    a = PagedSlotAllocator(32, 4)
    idx = a.alloc(16)
    assert idx is not None
    a.free(idx[:4])
    before = _snapshot(a)
    arg = {
        "double": idx[:4],
        "never": torch.tensor([20, 21]),
        "range_hi": torch.tensor([a.total_slots]),
        "range_neg": torch.tensor([-1]),
        "padding": torch.tensor([0]),
        "mixed": torch.cat([idx[4:8], idx[:1]]),  # valid pages plus one double free
    }[bad]
    with pytest.raises(ValueError, match=r"double free|out of range"):
        a.free(arg)
    assert _snapshot(a) == before


def test_free_input_types() -> None:
    a = PagedSlotAllocator(16, 4)
    idx = a.alloc(16)
    assert idx is not None
    a.free([4, 5, 6, 7])
    a.free(idx[4:8].to(torch.int32))
    a.free([])
    a.free(torch.empty(0, dtype=torch.int64))
    with pytest.raises(TypeError):
        a.free(torch.tensor([8.0]))
    with pytest.raises(ValueError, match="1-D"):
        a.free(idx[8:].view(2, 4))
    assert a.available_size() == 8


def test_clear_frees_everything() -> None:
    a = PagedSlotAllocator(16, 4)
    idx = a.alloc(12)
    assert idx is not None
    a.free(idx[:4])
    a.clear()
    assert a.available_size() == 16 and a.allocated_pages() == [] and a.pending_frees == 0
    a.check_invariants()
    with pytest.raises(ValueError, match="double free"):
        a.free(idx[4:8])


@pytest.mark.parametrize("page_size", [1, 16])
def test_randomized_against_set_model(page_size: int) -> None:
    rng = random.Random(1234 + page_size)
    n_pages = 40
    a = PagedSlotAllocator(n_pages * page_size, page_size)
    held: list[list[int]] = []  # allocations not yet freed, as page lists
    free_pages = set(range(1, n_pages + 1))
    for _step in range(2500):
        op = rng.random()
        if op < 0.5:
            want = rng.randint(0, 6)
            idx = a.alloc(want * page_size)
            if want > len(free_pages):
                assert idx is None
            else:
                assert idx is not None and idx.numel() == want * page_size
                pages = sorted(set((idx // page_size).tolist()))
                assert len(pages) == want and set(pages) <= free_pages
                assert (idx.view(-1, page_size)[:, 0] % page_size == 0).all()
                free_pages -= set(pages)
                if pages:
                    held.append(pages)
        elif op < 0.9 and held:
            pages = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:  # free a random subset of slots covering every page
                slots = [p * page_size + rng.randrange(page_size) for p in pages]
            else:
                slots = [p * page_size + o for p in pages for o in range(page_size)]
            rng.shuffle(slots)
            a.free(slots)
            free_pages |= set(pages)
        else:  # an invalid free: a free page or out of range
            candidates = sorted(free_pages) + [0, n_pages + 1]
            page = rng.choice(candidates)
            with pytest.raises(ValueError):
                a.free([page * page_size])
        assert a.available_size() == len(free_pages) * page_size
        a.check_invariants()
    assert set(a.allocated_pages()) == set(range(1, n_pages + 1)) - free_pages


# ----------------------------------------------------------------------------- device pool
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_device_pool_shapes(kind: str, dtype: torch.dtype, page_size: int) -> None:
    shape = SHAPES[kind]
    pool = DeviceKVPool(shape, size=4 * page_size, page_size=page_size, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    assert pool.size == 4 * page_size and pool.total_slots == 5 * page_size
    assert pool.make_allocator().total_slots == pool.total_slots
    for layer in range(shape.layer_num):
        if isinstance(shape, MHAShape):
            v_dim = shape.v_head_dim or shape.head_dim
            assert pool.k_buffer(layer).shape == (pool.total_slots, shape.head_num, shape.head_dim)
            assert pool.v_buffer(layer).shape == (pool.total_slots, shape.head_num, v_dim)
            assert pool.k_buffer(layer).dtype == dtype and pool.k_buffer(layer).is_contiguous()
            with pytest.raises(TypeError):
                pool.kv_buffer(layer)
        else:
            width = shape.kv_lora_rank + shape.qk_rope_head_dim
            assert pool.kv_buffer(layer).shape == (pool.total_slots, 1, width)
            assert pool.k_buffer(layer) is pool.kv_buffer(layer)
            assert pool.v_buffer(layer).shape == (pool.total_slots, 1, shape.kv_lora_rank)
    expected = shape.layer_num * sum(math.prod(c) for c in shape.components) * item
    assert pool.bytes_per_token == expected
    assert (
        sum(b.numel() * item for layer in range(shape.layer_num) for b in pool.layer_buffers(layer)) == pool.size_bytes
    )
    with pytest.raises(IndexError):
        pool.k_buffer(shape.layer_num)


def test_bytes_per_token_matches_sglang_formulas() -> None:
    # MHA: layers * heads * (head_dim + v_head_dim) * itemsize; MLA: layers * (rank + rope) * itemsize.
    mha = DeviceKVPool(MHAShape(32, 8, 128), size=16, page_size=16, dtype=torch.bfloat16)
    assert mha.bytes_per_token == 32 * 8 * 256 * 2
    mla = DeviceKVPool(MLAShape(61, 512, 64), size=16, page_size=16, dtype=torch.bfloat16)
    assert mla.bytes_per_token == 61 * 576 * 2


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="head_num"):
        MHAShape(2, 0, 8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAShape(2, -1, 8)
    with pytest.raises(TypeError):
        DeviceKVPool("mha", size=16, page_size=4, dtype=torch.float16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no whole page"):
        DeviceKVPool(SHAPES["mha"], size=3, page_size=4, dtype=torch.float16)


@needs_cuda
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_device_pool_on_cuda(kind: str) -> None:
    pool = DeviceKVPool(SHAPES[kind], size=64, page_size=16, dtype=torch.bfloat16, device="cuda")
    assert pool.k_buffer(0).is_cuda
    a = pool.make_allocator()
    idx = a.alloc(32)
    assert idx is not None and idx.is_cuda
    a.free(idx)
    with pytest.raises(ValueError, match="double free"):
        a.free(idx)


# ----------------------------------------------------------------------------- host pool
def _host(kind: str, dtype: torch.dtype, page_size: int, layout: str, ratio: float = 2.0) -> HostKVPool:
    dev = DeviceKVPool(SHAPES[kind], size=4 * page_size, page_size=page_size, dtype=dtype)
    return HostKVPool.for_device(dev, ratio=ratio, layout=layout, **NO_RESERVE)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_host_pool_shapes_and_page_round_trip(kind: str, dtype: torch.dtype, page_size: int, layout: str) -> None:
    host = _host(kind, dtype, page_size, layout)
    shape = SHAPES[kind]
    assert host.size == 8 * page_size and host.page_num == 8
    assert host.pin_memory == CUDA
    assert host.bytes_per_token == DeviceKVPool(shape, page_size, page_size, dtype).bytes_per_token
    assert host.page_bytes == page_size * host.bytes_per_token
    assert host.backing_tensor.numel() * host.itemsize == host.size_bytes
    for layer in range(shape.layer_num):
        views = host.get_page_layer_view(layer)
        assert [tuple(v.shape) for v in views] == [(host.page_num, page_size, *c) for c in shape.components]
        if layout == "layer_first":
            assert [tuple(v.shape) for v in host.get_layer_view(layer)] == [(host.size, *c) for c in shape.components]
        else:
            with pytest.raises(ValueError, match="per-layer view"):
                host.get_layer_view(layer)

    gen = torch.Generator().manual_seed(7)
    pages = {}
    for start in range(0, host.size, page_size):
        data = torch.randint(0, 256, (host.page_bytes,), dtype=torch.uint8, generator=gen)
        host.set_page_bytes(start, data if start % 2 else bytes(data.numpy()))
        pages[start] = data
    for start, data in pages.items():  # no page write leaked into another page
        got = host.get_page_bytes(start)
        assert got.dtype == torch.uint8 and got.shape == (host.page_bytes,)
        assert torch.equal(got, data)


@pytest.mark.parametrize("order", PAGE_ORDERS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_host_layout_byte_order(kind: str, layout: str, order: str) -> None:
    """Each (layer, component, token) lands where the layout and page order say inside
    its page's bytes."""
    page_size = 4
    dev = DeviceKVPool(SHAPES[kind], size=4 * page_size, page_size=page_size, dtype=torch.float32)
    host = HostKVPool.for_device(dev, layout=layout, page_order=order, **NO_RESERVE)  # type: ignore[arg-type]
    shape = SHAPES[kind]
    comps = shape.components
    elems = [math.prod(c) for c in comps]
    per_layer = sum(elems)
    counter = 0
    expected: dict[tuple[int, int, int, int], torch.Tensor] = {}
    for layer in range(shape.layer_num):
        for c, view in enumerate(host.get_page_layer_view(layer)):
            for page in range(host.page_num):
                for t in range(page_size):
                    val = torch.arange(counter, counter + elems[c], dtype=torch.float32).view(comps[c])
                    counter += elems[c]
                    view[page, t] = val
                    expected[(page, layer, c, t)] = val
    for (page, layer, c, t), val in expected.items():
        flat = host.get_page_bytes(page * page_size).view(torch.float32)
        off_c = sum(elems[:c])
        layers = shape.layer_num
        if order == "sglang" and layout == "page_first":  # SGLang's [comps, page_size, layers, ...]
            start = page_size * layers * off_c + (t * layers + layer) * elems[c]
        elif order == "sglang":  # SGLang's layer_first / page_first_direct page: [comps, layers, page_size, ...]
            start = page_size * (layers * off_c + layer * elems[c]) + t * elems[c]
        elif layout == "page_first":  # [page_size, layers, comps, ...]
            start = t * layers * per_layer + layer * per_layer + off_c
        else:  # page_first_direct order, also what layer_first's copy uses: [layers, comps, page_size, ...]
            start = page_size * (layer * per_layer + off_c) + t * elems[c]
        assert torch.equal(flat[start : start + elems[c]], val.reshape(-1))
        if layout == "layer_first":
            assert torch.equal(host.get_layer_view(layer)[c][page * page_size + t], val)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_first_get_page_bytes_is_a_view(layout: str) -> None:
    host = _host("mha", torch.float16, 4, layout)
    view = host.get_page_bytes(4)
    view.fill_(0xAB)
    assert (host.get_page_bytes(4) == 0xAB).all()
    host.set_page_bytes(4, torch.zeros(host.page_bytes, dtype=torch.uint8))
    assert (view == 0).all()


def test_page_bytes_argument_errors() -> None:
    host = _host("mla", torch.float16, 4, "layer_first")
    for bad in (1, -4, host.size):
        with pytest.raises(ValueError, match="page start"):
            host.get_page_bytes(bad)
    with pytest.raises(ValueError, match="bytes, a page has"):
        host.set_page_bytes(0, b"\0" * (host.page_bytes - 1))
    with pytest.raises(TypeError):
        host.set_page_bytes(0, "text")
    # a typed tensor is taken by its bytes
    data = torch.randn(host.page_bytes // 2, dtype=torch.float16)
    host.set_page_bytes(4, data)
    assert torch.equal(host.get_page_bytes(4), data.view(torch.uint8))


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_alloc_free_double_free(layout: str) -> None:
    host = _host("mha", torch.float16, 16, layout)
    assert host.available_size() == host.size
    idx = host.alloc(host.size)
    assert idx is not None and int(idx.min()) == 0 and idx.device.type == "cpu"
    assert host.alloc(16) is None
    with pytest.raises(ValueError, match="multiple of page_size"):
        host.alloc(8)
    host.free(idx[:32])
    with pytest.raises(ValueError, match="double free"):
        host.free(idx[16:48])  # page 1 already free, page 2 still allocated: nothing changes
    assert host.available_size() == 32
    host.free(idx[32:48])
    assert host.available_size() == 48
    with pytest.raises(ValueError, match="out of range"):
        host.free([host.size])
    host.clear()
    assert host.available_size() == host.size


def test_host_sizing_by_ratio_and_gb() -> None:
    dev = DeviceKVPool(SHAPES["mha"], size=64, page_size=16, dtype=torch.float16)
    assert HostKVPool.for_device(dev, **NO_RESERVE).size == 128  # default ratio 2.0
    assert HostKVPool.for_device(dev, ratio=3.0, **NO_RESERVE).size == 192
    assert HostKVPool.for_device(dev, ratio=1.3, **NO_RESERVE).size == 80  # 83.2 -> whole pages
    gb = 0.001  # 1e6 bytes
    host = HostKVPool.for_device(dev, size_gb=gb, layout="page_first_direct", **NO_RESERVE)
    tokens = int(gb * 10**9) // dev.bytes_per_token
    assert host.size == tokens // 16 * 16 and host.size_bytes <= gb * 10**9
    assert host.shape == dev.shape and host.dtype == dev.dtype and host.page_size == dev.page_size
    with pytest.raises(ValueError, match="not both"):
        HostKVPool.for_device(dev, ratio=2.0, size_gb=1.0)
    with pytest.raises(ValueError, match="ratio must be"):
        HostKVPool.for_device(dev, ratio=0)
    with pytest.raises(ValueError, match="no whole page"):
        HostKVPool.for_device(dev, size_gb=1e-9)
    with pytest.raises(ValueError, match="layout"):
        HostKVPool.for_device(dev, layout="token_first")  # type: ignore[arg-type]


def test_host_pool_beyond_ram_fails_at_construction() -> None:
    dev = DeviceKVPool(MLAShape(61, 512, 64), size=16, page_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"does not fit: MemAvailable \d+ B .* reserve \d+ B") as err:
        HostKVPool.for_device(dev, size_gb=10**7)  # 10 PB
    assert "host KV pool of" in str(err.value) and "GiB" in str(err.value)


def test_reserve_is_applied(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       31457280 kB\nMemFree: 1 kB\nMemAvailable:    3145792 kB\n")
    total, avail = 31457280 * 1024, 3145792 * 1024  # 30 GiB, 3 GiB + 64 KiB
    assert read_meminfo(str(meminfo)) == (avail, total)
    shape = MHAShape(1, 1, 256)  # 1 KiB per token in fp16
    reserve = total // 10  # 10% of total (3 GiB) beats 2 GiB here
    fits = (avail - reserve) // 1024
    assert fits == 64
    HostKVPool(shape, fits, 16, torch.float16, meminfo_path=str(meminfo), pin_memory=False)
    with pytest.raises(ValueError, match="does not fit"):
        HostKVPool(shape, fits + 16, 16, torch.float16, meminfo_path=str(meminfo))
    # an explicit reserve replaces the default
    with pytest.raises(ValueError, match="does not fit"):
        HostKVPool(shape, 64, 16, torch.float16, meminfo_path=str(meminfo), reserve_bytes=avail - 32 * 1024)
    with pytest.raises(ValueError, match="reserve_bytes"):
        HostKVPool(shape, 64, 16, torch.float16, meminfo_path=str(meminfo), reserve_bytes=-1)
    meminfo.write_text("garbage\n")
    with pytest.raises(ValueError, match="cannot read"):
        read_meminfo(str(meminfo))


def test_default_reserve_uses_larger_of_10pct_and_2gib(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meminfo = tmp_path / "meminfo"
    gib_kb = 1 << 20
    # 10% of 4 GiB < 2 GiB, so 2 GiB is reserved and 64 KiB of the available memory may be used.
    meminfo.write_text(f"MemTotal: {4 * gib_kb} kB\nMemAvailable: {2 * gib_kb + 64} kB\n")
    shape = MHAShape(1, 1, 512)  # 2 KiB per token in fp16
    assert HostKVPool(shape, 32, 16, torch.float16, meminfo_path=str(meminfo)).size_bytes == 64 * 1024
    with pytest.raises(ValueError, match="does not fit"):
        HostKVPool(shape, 48, 16, torch.float16, meminfo_path=str(meminfo))


@needs_cuda
def test_host_pool_is_pinned_on_cuda() -> None:
    host = _host("mha", torch.bfloat16, 16, "page_first")
    assert host.pin_memory and host.backing_tensor.is_pinned()


@pytest.mark.parametrize("order", PAGE_ORDERS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_page_reads_and_writes_match_per_page_bytes(kind: str, layout: str, page_size: int, order: str) -> None:
    """read_pages / write_pages (the L3 path) agree byte for byte with get/set_page_bytes."""
    shape = MHAShape(3, 2, 4) if kind == "mha" else MLAShape(3, 6, 2)
    pool = HostKVPool(
        shape,
        8 * page_size,
        page_size,
        torch.bfloat16,
        layout,
        page_order=order,  # type: ignore[arg-type]
        reserve_bytes=0,
    )
    g = torch.Generator().manual_seed(page_size)
    pool.backing_tensor.view(torch.uint8).copy_(
        torch.randint(0, 256, (pool.backing_tensor.numel() * 2,), generator=g, dtype=torch.uint8)
    )
    starts = [5 * page_size, 0, 7 * page_size, 2 * page_size]
    out = torch.empty((4, pool.page_bytes), dtype=torch.uint8)
    pool.read_pages(starts, out)
    for row, s in zip(out, starts, strict=True):
        assert torch.equal(row, pool.get_page_bytes(s))
    new = torch.randint(0, 256, (4, pool.page_bytes), generator=g, dtype=torch.uint8)
    untouched = pool.get_page_bytes(page_size).clone()
    pool.write_pages(starts, new)
    for row, s in zip(new, starts, strict=True):
        assert torch.equal(pool.get_page_bytes(s), row)
    assert torch.equal(pool.get_page_bytes(page_size), untouched)
    # In place: page-first layouts in hiradix's order, and MLA (one component) in both.
    assert pool.pages_in_place == (layout != "layer_first" and (order == "hiradix" or kind == "mla"))
    if pool.pages_in_place:
        assert pool.pages_array()[7].tobytes() == new[2].numpy().tobytes()
    else:
        with pytest.raises(ValueError, match="not contiguous"):
            pool.pages_array()
    with pytest.raises(ValueError, match="page starts"):
        pool.read_pages([1] if page_size > 1 else [8], out[:1])
    with pytest.raises(ValueError, match="uint8"):
        pool.write_pages(starts, new[:2])


# ----------------------------------------------------------------------------- huge-page buffers
needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


@needs_thp
def test_alloc_cpu_buffer_large_is_2mib_aligned_mapping_of_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIRADIX_HUGEPAGES", raising=False)
    assert huge_pages_enabled()
    t = alloc_cpu_buffer((3 << 20) // 2 + 7, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == (3 << 20) // 2 + 7 and t.storage_offset() == 0
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.view(torch.uint8).any()  # anonymous memory reads as zeros
    t.fill_(1.5)
    assert float(t[-1]) == 1.5


def test_alloc_cpu_buffer_small_pinned_or_disabled_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    small = alloc_cpu_buffer(1000, torch.float16, zero=True)
    assert small.numel() == 1000 and not small.any()
    monkeypatch.setenv("HIRADIX_HUGEPAGES", "0")
    assert not huge_pages_enabled()
    big = alloc_cpu_buffer(3 << 20, torch.uint8, zero=True)
    assert big.numel() == 3 << 20 and not big.any()


@needs_thp
def test_cpu_device_pool_layers_share_one_huge_buffer_without_overlap() -> None:
    shape = MHAShape(layer_num=3, head_num=2, head_dim=64)
    dev = DeviceKVPool(shape, size=4096, page_size=16, dtype=torch.float16)
    bufs = [b for layer in range(3) for b in dev.layer_buffers(layer)]
    base = bufs[0].untyped_storage().data_ptr()
    assert base % HUGE_PAGE == 0
    assert all(b.untyped_storage().data_ptr() == base for b in bufs)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bufs)
    assert all(hi <= lo for (_, hi), (lo, _) in itertools.pairwise(spans))
    for i, b in enumerate(bufs):
        assert not b.any()
        b.fill_(i + 1)
    assert [int(b[0, 0, 0]) for b in bufs] == list(range(1, len(bufs) + 1))


@needs_thp
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_huge_host_pool_page_round_trip(layout: str) -> None:
    shape = MHAShape(layer_num=2, head_num=2, head_dim=64)
    host = HostKVPool(shape, 8192, 16, torch.float16, layout, **NO_RESERVE)  # type: ignore[arg-type]
    assert host.size_bytes >= HUGE_PAGE and host.backing_tensor.data_ptr() % HUGE_PAGE == 0
    page = torch.arange(host.page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    host.set_page_bytes(16 * 100, page)
    assert torch.equal(host.get_page_bytes(16 * 100), page)
