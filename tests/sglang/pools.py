"""What ``tests/sglang/v18`` (SGLang 0.5.18, main venv) and ``tests/sglang/v23`` (SGLang
0.5.23, ``.venv-sglang23``) share, and the tests of ``tests/sglang`` run on both: SGLang's
CPU pools of one shape, the KV bytes a test "computes" and checks, the TP worker stub the
cache factories call, the torch stand-ins for SGLang's direct host <-> device copy kernel,
a bounded wait on SGLang's queues, and the few cache calls the unit tests of both make
(``key``, ``insert``, ``match``, ``settle``). Only SGLang names that both versions have are
used here.
"""

from __future__ import annotations

import importlib.util
import time
from array import array
from collections.abc import Callable
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed", allow_module_level=True)

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

__all__ = [
    "HEADS",
    "HEAD_DIM",
    "LAYERS",
    "KVBuffers",
    "MTPDraft",
    "Worker",
    "attention_waits_for_load",
    "device_len",
    "forward_read",
    "insert",
    "key",
    "match",
    "mtp_draft_round_trip",
    "only_in_l3",
    "settle",
    "sglang_pools",
    "transfer_kv_direct",
    "wait_queue",
]

LAYERS = 3
HEADS = 2
HEAD_DIM = 4


class Worker:
    """The part of SGLang's TP worker the cache factories call."""

    def __init__(self) -> None:
        self.counter: Any = None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


def _kv_pool(page_size: int, size: int, mla: bool, *, layers: int) -> Any:
    if mla:
        return MLATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=torch.float32,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.float32,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def sglang_pools(page_size: int, size: int, mla: bool) -> tuple[Any, Any, Any]:
    """SGLang's CPU KV pool (MHA or MLA) of :data:`LAYERS` layers, its allocator (paged
    unless ``page_size`` is 1) and a ``ReqToTokenPool`` of 64 rows."""
    size = size // page_size * page_size
    kv = _kv_pool(page_size, size, mla, layers=LAYERS)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=size, page_size=page_size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False
        )
    req_to_token = ReqToTokenPool(size=64, max_context_len=4096, device="cpu", enable_memory_saver=False)
    return kv, alloc, req_to_token


def forward_read(kv: Any, worker_counter: Any, consumer: int, layers: range | None = None) -> list[torch.Tensor]:
    """SGLang's forward pass as the KV pool sees it, never a stand-in for the waits: SGLang's
    TP worker sets the batch's consumer index (``hicache_consumer_index``) on the counter
    the cache factory registered with it (``worker_counter``), then the attention backend
    reads each layer through the pool's ``get_key_buffer`` / ``get_value_buffer`` (MLA:
    ``get_key_buffer``), which wait for that layer's load only on a counter registered with
    the pool itself. The buffers as read, in :meth:`KVBuffers.layers`'s order (K layers,
    then V layers; MLA: one per layer), for the ``layers`` given (default: all)."""
    if worker_counter is not None:
        worker_counter.set_consumer(consumer)
    layers = range(kv.layer_num) if layers is None else layers
    keys, values = [], []
    for layer in layers:
        keys.append(kv.get_key_buffer(layer))
        if hasattr(kv, "v_buffer"):
            values.append(kv.get_value_buffer(layer))
    return keys + values


def attention_waits_for_load(
    env: Any, tokens: list[int], loaded_slots: Callable[[Any, Any], torch.Tensor] = lambda loaded, node: loaded
) -> None:
    """The pool's attention read waits for a load from host: with the load's first layer
    held back (the copy engine's layer hook blocks it), a reader thread's
    ``get_key_buffer(0)`` must not return until the layer is released, and must then read
    the loaded bytes. Without the layer-done counter registered with SGLang's pool, the
    read returns at once with the slots' stale bytes (what served wrong outputs in a real
    server). ``env`` is a hiradix cache environment with room for ``tokens``;
    ``loaded_slots(loaded, node)`` reads ``init_load_back``'s answer in its SGLang
    version's form as the slots loaded into."""
    import threading

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    cache = env.cache
    n = len(tokens)
    slots = env.allocator.alloc(n)
    env.write_kv(slots, torch.tensor(tokens), torch.arange(n))
    assert cache.insert(InsertParams(key=key(tokens), value=slots)).prefix_len == 0
    settle(env)
    assert cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == n
    for buf in env.layers():
        buf.zero_()
    m = match(env, tokens)
    assert device_len(m) == 0 and m.host_hit_length == n

    entered, release = threading.Event(), threading.Event()
    engine = cache.cache_controller.load_engine

    def hold_first_layer(kind: str, op_id: int, layer: int) -> None:
        if kind == "load" and layer == 0:
            entered.set()
            assert release.wait(60), "the test never released the load"

    engine.layer_hook = hold_first_layer
    try:
        loaded = loaded_slots(
            *cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
        )
        consumer = cache.ready_to_load_host_cache()
        assert entered.wait(60), "the load never started"
        read: list[Any] = []

        def attention() -> None:  # the forward pass, on its own thread
            got = forward_read(env.kv, env.worker.counter, consumer, range(1))[0]
            read.append(release.is_set())
            read.append(got)

        reader = threading.Thread(target=attention)
        reader.start()
        # A bound, not an order: a reader that does not wait returns within it.
        reader.join(timeout=2.0)
        returned_early = not reader.is_alive()
        release.set()
        reader.join(timeout=60)
        assert not reader.is_alive(), "the attention read never returned after the load finished"
        assert not returned_early and read[0], (
            "get_key_buffer returned while the load of its layer was held back: the layer-done counter is not "
            "registered with SGLang's KV pool"
        )
        want = env.expected_kv(torch.tensor(tokens), torch.arange(n))[0]
        assert torch.equal(read[1][loaded.long()], want)
    finally:
        release.set()
        engine.layer_hook = None
        settle(env)


class KVBuffers:
    """The device KV of a test environment (``kv`` an SGLang pool, ``mla`` its kind)."""

    kv: Any
    mla: bool

    def layers(self) -> list[torch.Tensor]:
        """Every device KV buffer, per layer and component (K layers, then V layers)."""
        if self.mla:
            return list(self.kv.kv_buffer)
        return [*self.kv.k_buffer, *self.kv.v_buffer]

    def write_kv(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """ "Compute" KV: every slot gets bytes derived from (token, position) only
        (:meth:`expected_kv`), so a reused prefix must read back identical bytes wherever
        it was cached."""
        for buf, val in zip(self.layers(), self.expected_kv(tokens, positions), strict=True):
            buf[slots.long()] = val

    def expected_kv(self, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """The KV :meth:`write_kv` gives each token, per buffer of :meth:`layers`: distinct
        in every layer, component, token and element, so a page read back in another byte
        order (components and layers swapped, tokens transposed) never compares equal."""
        out = []
        for i, buf in enumerate(self.layers()):
            inner = buf.shape[1:]
            elem = torch.arange(inner.numel(), dtype=torch.float32).view(1, *inner)
            base = tokens.to(torch.float32) * 7 + positions.to(torch.float32) * 13 + i * 101
            out.append((base.view(-1, *([1] * len(inner))) + elem * 3).remainder(997).to(buf.dtype))
        return out


class MTPDraft:
    """An MTP / NextN draft layer's KV pool as SGLang's draft model runner builds it: one
    layer of :func:`sglang_pools`'s geometry (SGLang 0.5.20 and 0.5.23 pack such pools into
    the target's host pages and require exactly that), ``size`` slots (whole pages of
    ``page_size``) indexed by the target's allocator; ``CacheInitParams.mtp_draft_device_pools``
    hands it to the cache. Its bytes come from the token alone, unlike any target layer's
    (:meth:`expected`)."""

    def __init__(self, page_size: int, size: int, mla: bool) -> None:
        self.mla = mla
        self.pool = _kv_pool(page_size, size // page_size * page_size, mla, layers=1)

    def buffers(self) -> list[torch.Tensor]:
        """The draft's device KV buffers (K and V, or the MLA latent)."""
        return list(self.pool.kv_buffer) if self.mla else [*self.pool.k_buffer, *self.pool.v_buffer]

    def expected(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The draft KV :meth:`write` gives ``tokens``, per buffer of :meth:`buffers`."""
        out = []
        for i, buf in enumerate(self.buffers()):
            inner = buf.shape[1:]
            elem = torch.arange(inner.numel(), dtype=torch.float32).view(1, *inner)
            base = tokens.to(torch.float32) * 5 + 500 + i * 37
            out.append((base.view(-1, *([1] * len(inner))) + elem).remainder(991))
        return out

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """ "Compute" the draft's KV of ``tokens`` at ``slots``."""
        for buf, val in zip(self.buffers(), self.expected(tokens), strict=True):
            buf[slots.long()] = val

    def holds(self, slots: torch.Tensor, tokens: torch.Tensor) -> bool:
        """Whether the draft's KV at ``slots`` is what :meth:`write` gave ``tokens``."""
        return all(
            torch.equal(buf[slots.long()], want)
            for buf, want in zip(self.buffers(), self.expected(tokens), strict=True)
        )

    def clobber(self) -> None:
        """Zero the draft's device KV: what a test reads back afterwards came from the host."""
        for buf in self.buffers():
            buf.zero_()


def copy_rows(dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor) -> None:
    dst.index_copy_(0, dst_indices.long(), src.index_select(0, src_indices.long()))


def transfer_kv_direct(
    src_layers: Any, dst_layers: Any, src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int
) -> None:
    """SGLang's ``transfer_kv_direct`` (an ``sgl_kernel`` op, imported only on an
    accelerator) in torch: the same row gathers and scatters, layer by layer."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        copy_rows(dst, dst_indices, src, src_indices)


def wait_queue(q: Any, n: int, timeout: float) -> None:
    """Block until SGLang's ``queue.Queue`` ``q`` holds ``n`` items (its own ``not_empty``
    condition, notified on every put); ``TimeoutError`` past ``timeout`` seconds."""
    with q.not_empty:  # holds q.mutex: read the deque itself (qsize() would take it again)
        if not q.not_empty.wait_for(lambda: len(q.queue) >= n, timeout):
            raise TimeoutError(f"{len(q.queue)} of {n} items after {timeout} s")


# ---------------------------------------------------------------------------- cache calls
def key(tokens: Any, **kw: Any) -> RadixKey:
    return RadixKey(array("q", tokens), **kw)


def insert(env: Any, tokens: Any, **kw: Any) -> int:
    """Insert ``tokens`` (page aligned) with freshly allocated slots holding their KV; free
    the duplicate prefix as the scheduler does. Returns the length that was already cached."""
    n = len(tokens) // env.page_size * env.page_size
    slots = env.allocator.alloc(n)
    assert slots is not None
    env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
    res = env.cache.insert(InsertParams(key=key(tokens[:n], **kw), value=slots))
    if res.prefix_len:
        env.allocator.free(slots[: res.prefix_len])
    return int(res.prefix_len)


def match(env: Any, tokens: Any, **kw: Any) -> MatchResult:
    return env.cache.match_prefix(MatchPrefixParams(key=key(tokens, **kw)))


def settle(env: Any) -> None:
    """Acknowledge every copy in flight (the scheduler's check_hicache_events, drained)."""
    env.cache.core.flush()
    env.cache.check_hicache_events()


def only_in_l3(env: Any, timeout: float = 30.0) -> None:
    """Back up what the cache holds (host, then L3) and reset it: device and host are
    empty, L3 keeps the pages. ``TimeoutError`` if the L3 writes are not done within
    ``timeout`` seconds."""
    settle(env)
    deadline = time.monotonic() + timeout
    while env.cache.core.storage.pending_storage()[1]:  # the L2 -> L3 writes
        if time.monotonic() > deadline:
            raise TimeoutError(f"L3 writes still pending after {timeout} s")
        env.cache.check_hicache_events()
    env.cache.reset()


def device_len(m: Any) -> int:
    """The device part of a match: 0.5.23's ``device_prefix_len``, or its slots (0.5.18, 0.5.20)."""
    n = getattr(m, "device_prefix_len", None)
    return int(len(m.device_indices) if n is None else n)


def mtp_draft_round_trip(env: Any, draft: MTPDraft, loaded_slots: Callable[[Any, Any], torch.Tensor]) -> Any:
    """An MTP draft's KV through host and back with the target's (EAGLE keys, page size 4):
    40 slots written (target and ``draft``), backed up, evicted to host, the device KV
    zeroed, then matched (all on the host) and loaded back into other slots. The draft's
    KV must be at the loaded slots when the first target layer is reported, the target's
    when the last is. ``loaded_slots(loaded, node)`` reads ``init_load_back``'s answer in
    its SGLang version's form (checking it loaded 40) as the slots loaded into. Returns the
    load's consumer index."""
    tokens = list(range(300, 341))  # EAGLE keys: 41 tokens are 40 bigrams, 40 slots
    n = 40
    held = env.allocator.alloc(8)  # so that the load lands on other slots than the insert
    slots = env.allocator.alloc(n)
    env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
    draft.write(slots, torch.tensor(tokens[:n]))
    assert env.cache.insert(InsertParams(key=key(tokens), value=slots)).prefix_len == 0
    settle(env)
    assert env.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == n
    env.allocator.free(held)
    for buf in env.layers():  # the bytes must come from the host
        buf.zero_()
    draft.clobber()
    m = match(env, tokens)
    assert device_len(m) == 0 and m.host_hit_length == n
    new = loaded_slots(
        *env.cache.init_load_back(
            InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
        )
    )
    assert not torch.equal(new.sort().values, slots.sort().values)
    consumer = env.cache.ready_to_load_host_cache()
    # The target's first layer, read as attention reads it (waiting for its load) ...
    forward_read(env.kv, env.worker.counter, consumer, range(1))
    # ... and the draft's, through the draft's own pool: its layer wait is registered too.
    assert draft.pool.layer_transfer_counter is not None
    draft.pool.get_key_buffer(draft.pool.start_layer)
    assert draft.holds(new, torch.tensor(tokens[:n]))
    read = forward_read(env.kv, None, consumer)
    want = env.expected_kv(torch.tensor(tokens[:n]), torch.arange(n))
    assert all(torch.equal(buf[new], w) for buf, w in zip(read, want, strict=True))
    return consumer
