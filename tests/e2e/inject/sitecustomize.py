"""Fault injection for the real-server tests: a slow host -> device load.

``tests/e2e`` puts this folder on a server's ``PYTHONPATH`` so that Python imports this
module at the start of every process of that server (the scheduler included). With
``HIRADIX_E2E_SLOW_LOAD_S`` set, each layer of every load that hiradix's copy engine runs
takes that many seconds longer, as a loaded host or a slow PCIe link would make it. A
forward pass that does not wait for the layer-done counter then reads KV before it lands,
every time rather than now and then: the race the load-back tests must catch. Unset, this
module does nothing.
"""

from __future__ import annotations

import os

_DELAY = float(os.environ.get("HIRADIX_E2E_SLOW_LOAD_S", "0") or 0)

if _DELAY > 0:
    import threading
    from typing import Any

    from hiradix.memory import copy as _copy

    _execute = _copy.ThreadCopyEngine._execute
    _never = threading.Event()  # never set: waiting on it is a bounded stall of _DELAY seconds

    def _slow_execute(self: Any, handle: Any, step: Any) -> None:
        if handle.kind == "load":
            inner = step

            def step(layer: int) -> None:
                _never.wait(_DELAY)
                inner(layer)

        _execute(self, handle, step)

    _copy.ThreadCopyEngine._execute = _slow_execute  # type: ignore[method-assign]


if os.environ.get("HIRADIX_E2E_STOCK_ON_CPU") == "1":
    # Stock SGLang's own hierarchical cache has CUDA-only steps a CPU server cannot take
    # (it is not hiradix's code): pinning its host pool with cudaHostRegister, a 10 GiB
    # host-memory reserve check, and the direct-I/O copy from sgl_kernel. Stood in for
    # here, for the servers that run stock's cache beside hiradix's (its outputs, and
    # hiradix's L3 backends under it): no-ops for the pinning, no reserve for kilobyte
    # pools, and the same row gathers and scatters in torch.
    from typing import Any as _Any

    import sglang.srt.mem_cache.pool_host.base as _phb
    import sglang.srt.mem_cache.pool_host.common as _phc
    import sglang.srt.mem_cache.pool_host.mha as _phm

    def _transfer_kv_direct(
        src_layers: _Any, dst_layers: _Any, src_indices: _Any, dst_indices: _Any, page_size: int
    ) -> None:
        for src, dst in zip(src_layers, dst_layers, strict=True):
            rows = src.index_select(0, src_indices.long().to(src.device))
            dst.index_copy_(0, dst_indices.long().to(dst.device), rows)

    _phc._cuda_host_register = lambda *args, **kwargs: None
    _phc._cuda_host_unregister = lambda *args, **kwargs: None
    _phb.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    _phm.transfer_kv_direct = _transfer_kv_direct
