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
    now and then: the race the load-back tests must catch. Each load says on stderr when
    it starts (``LOAD_HELD``), so a test can act while one is in flight.
``HIRADIX_E2E_UNREGISTERED_COUNTER=1``
    the control: hiradix's layer-done counter is not registered with SGLang's KV pool
    (``hiradix.sglang.controller.register_layer_wait`` does nothing), what hiradix did before the
    fix. With slowed loads its outputs must be wrong, or the load-back tests prove nothing.
``HIRADIX_E2E_SLOW_PEER_READ_S``
    each remote READ this server's peer node serves over TCP (the transport's own test
    seam, ``responder_hook``) stalls that many seconds, its pages pinned, after saying so
    (``PEER_READ_HELD``): a test kills the server while another one reads from it.
``HIRADIX_E2E_PD_ON_CPU=1``
    a PD prefill server on the CPU with SGLang 0.5.23: its prefill stages a chunk's page
    indices through pinned memory and a ``torch.cuda.Event`` whenever the Mooncake sender
    takes host tensors (``_send_kv_chunk`` in ``sglang/srt/disaggregation/prefill.py``),
    neither of which a CPU torch has. The sender is told it does not, so SGLang takes its
    other path (``kv_to_page_indices``, as for the other transfer backends). Not hiradix's
    code: SGLang's PD transfer, which only moves the KV hiradix's cache holds.
``HIRADIX_E2E_NAIVE_PAGED_ALLOC=1``
    page sizes above 1 on the CPU: SGLang 0.5.18's and 0.5.20's paged allocator launches two
    Triton kernels (``alloc_extend_kernel``, ``alloc_decode_kernel``), which have no CPU
    driver. They are stood in for by SGLang's own ``alloc_extend_naive`` and the same
    arithmetic for decode in torch (0.5.23 takes its native paths on the CPU itself). Not
    hiradix's code: SGLang's allocator, which hands out the slots hiradix's tree holds.
``HIRADIX_E2E_STALL_AFTER_FINISH_S``
    the ordering suspected behind 0.5.20's wrong answers under load (issue 43), forced: under
    the overlap scheduler, right after a batch result in which a request finished, the
    scheduler waits (at most that many seconds) until the next request is in its socket from
    the tokenizer, so that request is admitted while the finished request's leftover step,
    already launched, has not had its result processed. Each stall says so on stderr
    (``FINISH_STALLED``). SGLang's scheduler, not hiradix's code; any cache, or none.

Unset, this module does nothing.
"""

from __future__ import annotations

import os
import sys

_DELAY = float(os.environ.get("HIRADIX_E2E_SLOW_LOAD_S", "0") or 0)
LOAD_HELD = "hiradix e2e fault: load held:"  # printed as each slowed load starts

if _DELAY > 0:
    import threading
    from typing import Any

    from hiradix.memory import copy as _copy

    _never = threading.Event()  # never set: waiting on it is a bounded stall of _DELAY seconds

    def _slow(kind: str, op_id: int, layer: int) -> None:
        if kind == "load":
            if layer == 0:  # a test waits for this line to act while a load is in flight
                print(f"{LOAD_HELD} {op_id}", file=sys.stderr, flush=True)
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


if os.environ.get("HIRADIX_E2E_PD_ON_CPU") == "1":
    from sglang.srt.disaggregation.mooncake import conn as _mooncake_conn

    if getattr(_mooncake_conn.MooncakeKVSender, "supports_host_tensor_indices", False):  # 0.5.23, not 0.5.18
        _mooncake_conn.MooncakeKVSender.supports_host_tensor_indices = False
        print("hiradix e2e harness: Mooncake's KV sender on its CPU index path", file=sys.stderr, flush=True)


if os.environ.get("HIRADIX_E2E_NAIVE_PAGED_ALLOC") == "1":
    from typing import Any as _Any

    import torch as _torch
    from sglang.srt.mem_cache.allocator import paged as _paged

    def _pages_needed(seq_lens: _Any, prefix_lens: _Any, page_size: int) -> int:
        return int(((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum())

    def _extend(
        prefix_lens: _Any, seq_lens: _Any, last_loc: _Any, free_pages: _Any, out: _Any, _bs: int, page_size: int
    ) -> None:
        # Like the kernel, fill ``out`` whatever the pool holds; the allocator then sees too
        # few free pages and returns None. The naive path would index past free_pages.
        if _pages_needed(seq_lens, prefix_lens, page_size) <= len(free_pages):
            _paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, page_size, out.device)

    def _decode(seq_lens: _Any, last_loc: _Any, free_pages: _Any, out: _Any, _bs: int, page_size: int) -> None:
        # A request whose new token starts a page takes the next free page, in batch order.
        starts = (seq_lens - 1) % page_size == 0
        rank = _torch.cumsum(starts.to(_torch.int64), 0) - 1
        if int(starts.sum()) > len(free_pages):
            return  # the allocator returns None
        pages = free_pages[rank.clamp(min=0, max=max(len(free_pages) - 1, 0))] if len(free_pages) else rank
        out.copy_(_torch.where(starts, pages * page_size, last_loc + 1))

    class _Launch:
        """``kernel[(grid,)](*args)``, the way the allocator launches a Triton kernel."""

        def __init__(self, fn: _Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: _Any) -> _Any:
            return self.fn

    _paged.alloc_extend_kernel = _Launch(_extend)
    _paged.alloc_decode_kernel = _Launch(_decode)
    print("hiradix e2e harness: SGLang's paged allocator on its naive CPU path", file=sys.stderr, flush=True)


_PEER_DELAY = float(os.environ.get("HIRADIX_E2E_SLOW_PEER_READ_S", "0") or 0)
PEER_READ_HELD = "hiradix e2e fault: peer read held"  # printed as each held READ starts

if _PEER_DELAY > 0:
    import threading as _threading
    from typing import Any as _Any

    from hiradix.transport import tcp as _tcp

    _peer_never = _threading.Event()  # never set: a bounded stall of _PEER_DELAY seconds

    def _held_read(rkeys: _Any) -> None:
        print(f"{PEER_READ_HELD}: {len(rkeys)} pages", file=sys.stderr, flush=True)
        _peer_never.wait(_PEER_DELAY)

    _tcp_init = _tcp.TcpTransport.__init__

    def _tcp_init_with_held_reads(self: _Any, *args: _Any, **kwargs: _Any) -> None:
        _tcp_init(self, *args, **kwargs)
        self.responder_hook = _held_read  # the transport's test seam (Transport.responder_hook)

    _tcp.TcpTransport.__init__ = _tcp_init_with_held_reads  # type: ignore[method-assign]
    print(f"hiradix e2e fault: every peer READ served held {_PEER_DELAY} s", file=sys.stderr, flush=True)


_STALL = float(os.environ.get("HIRADIX_E2E_STALL_AFTER_FINISH_S", "0") or 0)
FINISH_STALLED = "hiradix e2e fault: scheduler stalled after a finish"  # printed at each stall

if _STALL > 0:
    from typing import Any as _Any

    from sglang.srt.managers import scheduler as _scheduler

    _process = _scheduler.Scheduler.process_batch_result

    def _process_then_stall(self: _Any, batch: _Any, result: _Any, *args: _Any, **kwargs: _Any) -> _Any:
        done_before = {id(r) for r in batch.reqs if r.finished()}
        out = _process(self, batch, result, *args, **kwargs)
        if self.enable_overlap and any(r.finished() and id(r) not in done_before for r in batch.reqs):
            print(FINISH_STALLED, file=sys.stderr, flush=True)
            # until the client's next request is in the socket (not read: the loop reads it next)
            self.recv_from_tokenizer.poll(timeout=int(_STALL * 1000))
        return out

    _scheduler.Scheduler.process_batch_result = _process_then_stall  # type: ignore[method-assign]
    _said = f"hiradix e2e fault: the overlap scheduler stalls after each finish (at most {_STALL} s)"
    print(_said, file=sys.stderr, flush=True)
