"""SGLang's view of the core's controller: :class:`SGLangCacheController` (the names SGLang's
scheduler and metrics read from ``tree_cache.cache_controller``) and the layer waits it
registers with SGLang's KV pools, so attention never reads KV a load is still filling.
"""

from __future__ import annotations

import logging
from typing import Any

from hiradix.cache.controller import HiCacheController
from hiradix.memory.pools import DeviceKVPool, HostKVPool
from hiradix.sglang.pools import device_pool_from_sglang

__all__ = ["DraftLayerWait", "SGLangCacheController", "register_layer_wait"]

logger = logging.getLogger(__name__)


class DraftLayerWait:
    """The layer counter a draft model's KV pool waits on: any draft layer is usable once
    the target's first layer is, because the draft's copies are submitted before the
    target's on the same engine (:meth:`HiCacheController.add_companion`). A draft's layer
    ids need not lie in the target's range (EAGLE-3 and MTP drafts number theirs after the
    target's), so the wait is for layer 0, whatever layer the pool asks for."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    @property
    def consumer_index(self) -> int:
        return int(self._counter.consumer_index)

    def wait_until(self, threshold: int, timeout: float | None = None) -> None:
        self._counter.wait_until(0, timeout)


def register_layer_wait(sglang_pool: Any, counter: Any) -> None:
    """Make SGLang's KV pool wait on ``counter`` before its attention reads a layer, as
    SGLang's own ``HiCacheController`` does at start-up
    (``mem_pool_device.register_layer_transfer_counter``): the pool's ``get_key_buffer`` /
    ``get_value_buffer`` wait for the layer only when a counter is registered, and without
    it the forward pass reads slots a load is still filling (wrong outputs). ``TypeError``
    for a pool without the hook, rather than a cache that serves unloaded KV."""
    register = getattr(sglang_pool, "register_layer_transfer_counter", None)
    if register is None:
        raise TypeError(
            f"hiradix.sglang: {type(sglang_pool).__name__} has no register_layer_transfer_counter; "
            "its attention could read KV before a load from host finishes"
        )
    register(counter)


class SGLangCacheController(HiCacheController):
    """The core's controller with the names SGLang's scheduler and metrics read from
    ``tree_cache.cache_controller``: ``mem_pool_host``, ``mem_pool_device``,
    ``write_policy``, ``io_backend``, ``page_size``, ``storage_backend``,
    ``storage_backend_type``, ``layer_done_counter`` and ``reset``.

    ``sglang_pool`` is SGLang's device KV pool that ``device_pool`` wraps: the layer-done
    counter is registered with it here (:func:`register_layer_wait`), as SGLang's
    controller registers its own, so every way of building the cache (the plugin's factory,
    a fork's ``HiRadixCache(params, server_args)``) makes attention wait for loads."""

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        write_policy: str,
        io_backend: str,
        sglang_pool: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device_pool, host_pool, **kwargs)
        self.write_policy = write_policy
        self.io_backend = io_backend
        self.page_size = device_pool.page_size
        self.storage_backend_type: str | None = None
        #: The attached L3 backend (SGLang reads its class name for metrics and the
        #: ``cached_tokens_details`` of a request, and 0.5.23's scheduler its layout).
        self.storage_backend: Any = None
        if sglang_pool is not None:
            register_layer_wait(sglang_pool, self.layer_done_counter)

    @property
    def mem_pool_host(self) -> HostKVPool:
        return self.host_pool

    @property
    def mem_pool_device(self) -> DeviceKVPool:
        return self.device_pool

    # SGLang's scheduler sets both to the model runner's forward stream at start-up (0.5.20
    # and 0.5.23): the copy engines then also wait for that stream before each operation.
    @property
    def load_fence_stream(self) -> Any:
        return self.load_engine.fence_stream

    @load_fence_stream.setter
    def load_fence_stream(self, stream: Any) -> None:
        self.load_engine.fence_stream = stream

    @property
    def write_fence_stream(self) -> Any:
        return self.write_engine.fence_stream

    @write_fence_stream.setter
    def write_fence_stream(self, stream: Any) -> None:
        self.write_engine.fence_stream = stream

    @property
    def has_draft(self) -> bool:
        """Whether a draft model's KV pool follows the target's (:meth:`set_draft_kv_pool`)."""
        return bool(self.companions)

    def set_draft_kv_pool(self, draft_device_pool: Any, draft_host_pool: Any = None) -> None:
        """SGLang 0.5.18's hook for speculative decoding with a separate draft model, whose
        KV pool is indexed by the target's token slots: from now on every backup and load
        also moves the draft's KV at the same slots (:meth:`add_draft`).

        SGLang's own ``draft_host_pool`` is not kept (hiradix's engines copy between
        hiradix pools; it is freed when SGLang drops it). ``ValueError`` for a draft pool
        kind hiradix cannot wrap. ``O(draft host pool)`` to allocate.
        """
        self.add_draft(device_pool_from_sglang(draft_device_pool), type(draft_device_pool).__name__, draft_device_pool)

    def add_draft(self, device: DeviceKVPool, name: str, sglang_pool: Any = None) -> None:
        """Make ``device`` (a draft model's KV, indexed by the target's token slots) follow
        the target's KV: a hiradix host pool with the target host pool's slots and layout
        is its L2 copy, and every later backup and load moves it at the same slots,
        submitted before the target's on the same engine, so the layer-done counter never
        reports a target layer before the draft's KV is in place (:meth:`add_companion`).
        L3 carries the target's KV only (:meth:`warn_draft_l3`). ``ValueError`` when the
        draft's page size or slot count differs from the target's. ``name`` is for the
        log; ``sglang_pool``, SGLang's pool that ``device`` wraps, gets a layer wait
        (:class:`DraftLayerWait`). ``O(draft host pool)`` to allocate."""
        host = HostKVPool(
            device.shape,
            self.host_pool.size,
            device.page_size,
            device.dtype,  # type: ignore[arg-type]
            self.host_pool.layout,
        )
        self.add_companion(device, host)
        if sglang_pool is not None:  # SGLang's pool ``device`` wraps: its attention waits too
            register_layer_wait(sglang_pool, DraftLayerWait(self.layer_done_counter))
        logger.info("hiradix: draft KV pool registered (%s, %d host slots)", name, host.size)
        self.warn_draft_l3()

    def warn_draft_l3(self) -> None:
        """Log, when there is both a draft pool and an L3, that L3 stores the target's KV
        only (as SGLang 0.5.18 for every storage backend but Mooncake; SGLang 0.5.20's and
        0.5.23's packed MTP pages carry the draft layers): a page loaded from L3 leaves
        the draft's KV of its slots stale, which can lower the draft's acceptance rate but
        never changes the target's output (it verifies every drafted token). ``O(1)``."""
        if self.has_draft and self.storage_backend_type is not None:
            logger.warning(
                "hiradix: L3 (%s) stores the target's KV only; the draft's KV of pages loaded from L3 "
                "is stale (draft acceptance may drop, outputs do not change)",
                self.storage_backend_type,
            )

    def reset(self) -> None:
        """Forget the layer-done indices (the cache's reset has already drained copies)."""
        self.layer_done_counter.reset()
