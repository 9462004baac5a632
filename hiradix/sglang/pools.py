"""SGLang's device KV pools as hiradix pools, used in place, and the host pool beside them."""

from __future__ import annotations

from typing import Any

from hiradix.memory.pools import GB, HOST_LAYOUTS, DeviceKVPool, HostKVPool, MHAShape, MLAShape, PageOrder

__all__ = ["device_pool_from_sglang", "host_pool_for"]


def device_pool_from_sglang(kv_cache: Any, page_size: int | None = None) -> DeviceKVPool:
    """A :class:`DeviceKVPool` over the buffers of SGLang's ``MHATokenToKVPool`` or
    ``MLATokenToKVPool``: loads and backups read and write the model's own KV in place.

    ``page_size``, where given, is the page size the caller has read elsewhere (the
    adapter's ``CacheInitParams.page_size``): the pool's own must be the same, since the
    adapter pages requests by the one and the cache pages slots by the other.

    Raises ``ValueError`` naming what is not supported: other pool kinds (SWA, DSA,
    hybrid), head-major (HND) buffers, layers split across pipeline stages in a way the
    buffers do not show; and naming both page sizes when they differ. ``O(layers)``.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    name = type(kv_cache).__name__
    # Exact types: subclasses (SWA, DSA, quantized or hybrid pools) lay out or index their
    # buffers in other ways.
    if type(kv_cache) not in (MHATokenToKVPool, MLATokenToKVPool):
        raise ValueError(f"hiradix.sglang supports MHATokenToKVPool and MLATokenToKVPool, not {name}")
    size, pool_page_size = int(kv_cache.size), int(kv_cache.page_size)
    if page_size is not None and int(page_size) != pool_page_size:
        raise ValueError(
            f"hiradix.sglang: SGLang's page size disagrees with itself: CacheInitParams.page_size is {page_size}, "
            f"the KV pool ({name}) has page_size {pool_page_size}"
        )
    page_size = pool_page_size
    if type(kv_cache) is MLATokenToKVPool:
        buffers = list(kv_cache.kv_buffer)
        mla = MLAShape(len(buffers), int(kv_cache.kv_lora_rank), int(kv_cache.qk_rope_head_dim))
        width = buffers[0].shape[-1] if buffers else None
        if width != mla.kv_lora_rank + mla.qk_rope_head_dim:
            raise ValueError(f"{name}: latent width {width} is not kv_lora_rank + qk_rope_head_dim (quantized MLA KV?)")
        return DeviceKVPool.wrap(mla, [buffers], size, page_size)
    if getattr(kv_cache, "kv_cache_layout", "nhd") != "nhd":
        layout = kv_cache.kv_cache_layout
        raise ValueError(f"{name}: only token-major (NHD) KV buffers are supported, not {layout!r}")
    k, v = list(kv_cache.k_buffer), list(kv_cache.v_buffer)
    head_dim = int(kv_cache.head_dim)
    v_head_dim = int(getattr(kv_cache, "v_head_dim", head_dim))
    shape = MHAShape(len(k), int(kv_cache.head_num), head_dim, None if v_head_dim == head_dim else v_head_dim)
    return DeviceKVPool.wrap(shape, [k, v], size, page_size)


def host_pool_for(
    device_pool: DeviceKVPool,
    *,
    ratio: float,
    size_gb: float,
    layout: str,
    page_order: PageOrder = "hiradix",
    extra_bytes_per_token: int = 0,
) -> HostKVPool:
    """The host (L2) pool for ``device_pool`` as SGLang sizes it: ``--hicache-size`` GB when
    it is above 0, else ``--hicache-ratio`` times the device pool, in whole pages plus one
    more (SGLang 0.5.18's ``page_num = size // page_size + 1``: with the same slots, host
    evictions happen exactly when SGLang's do), handing L3 pages in ``page_order``. The pool
    must be larger than the device pool (SGLang's rule: the host must hold everything the
    device does). ``extra_bytes_per_token``: host bytes each slot costs beyond the target's
    (draft pools that share the slots), counted against ``--hicache-size``.
    """
    if layout not in HOST_LAYOUTS:
        raise ValueError(f"--hicache-mem-layout {layout!r} is not supported by hiradix; use one of {HOST_LAYOUTS}")
    if size_gb and size_gb > 0:
        tokens = int(size_gb * GB) // (device_pool.bytes_per_token + extra_bytes_per_token)
    elif ratio > 0:
        tokens = int(device_pool.size * ratio)
    else:
        raise ValueError(f"--hicache-ratio must be > 0, got {ratio}")
    ps = device_pool.page_size
    pool = HostKVPool(
        device_pool.shape,
        (tokens // ps + 1) * ps,
        ps,
        device_pool.dtype,
        layout,
        page_order=page_order,  # type: ignore[arg-type]
    )
    if pool.size <= device_pool.size:
        raise ValueError(
            f"the host KV pool ({pool.size} tokens) must be larger than the device pool ({device_pool.size} tokens): "
            f"raise --hicache-ratio (now {ratio}) or --hicache-size (now {size_gb})"
        )
    return pool
