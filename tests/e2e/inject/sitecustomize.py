"""Fault injection for the real-server tests: a slow host -> device load, and the control
run that must fail without the layer-done counter.

``tests/e2e`` puts this folder on a server's ``PYTHONPATH`` so that Python imports this
module at the start of every process of that server (the scheduler included). Python
swallows an error raised here, so every fault says on stderr (the server's log) that it is
in place, and the tests assert that line and the fault's effect.

``HIRADIX_E2E_SLOW_LOAD_S``
    each layer of every load that hiradix's thread copy engine runs takes that many seconds
    longer, as a loaded host or a slow PCIe link would make it: the engine's own test seam,
    ``layer_hook``, set on every engine with a worker made in the process (the load engine;
    the inline write engine keeps its one-loop path). A forward pass that does not
    wait for the layer-done counter then reads KV before it lands, every time rather than
    now and then: the race the load-back tests must catch.
``HIRADIX_E2E_UNREGISTERED_COUNTER=1``
    the control: hiradix's layer-done counter is not registered with SGLang's KV pool
    (``hiradix.sglang.controller.register_layer_wait`` does nothing), what hiradix did before the
    fix. With slowed loads its outputs must be wrong, or the load-back tests prove nothing.

Unset, this module does nothing.
"""

from __future__ import annotations

import os
import sys

_DELAY = float(os.environ.get("HIRADIX_E2E_SLOW_LOAD_S", "0") or 0)

if _DELAY > 0:
    import threading
    from typing import Any

    from hiradix.memory import copy as _copy

    _never = threading.Event()  # never set: waiting on it is a bounded stall of _DELAY seconds

    def _slow(kind: str, op_id: int, layer: int) -> None:
        if kind == "load":
            _never.wait(_DELAY)

    _init = _copy.ThreadCopyEngine.__init__

    def _init_with_slow_loads(self: Any, *args: Any, **kwargs: Any) -> None:
        _init(self, *args, **kwargs)
        if not self.inline:  # the load engine (a worker); the inline write engine keeps its one-loop path
            self.layer_hook = _slow  # the engine's test seam (ThreadCopyEngine's docstring)

    _copy.ThreadCopyEngine.__init__ = _init_with_slow_loads  # type: ignore[method-assign]
    print(f"hiradix e2e fault: every load slowed by {_DELAY} s a layer", file=sys.stderr, flush=True)

if os.environ.get("HIRADIX_E2E_UNREGISTERED_COUNTER") == "1":
    from typing import Any as _Any

    from hiradix.sglang import controller as _sglang_controller

    def _unregistered(sglang_pool: _Any, counter: _Any) -> None:
        print("hiradix e2e fault: layer-done counter NOT registered (control run)", file=sys.stderr, flush=True)

    _sglang_controller.register_layer_wait = _unregistered


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
