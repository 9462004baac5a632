"""Write a prefix through a cache to L3 and read it back into another, as SGLang's
scheduler drives them: the round trip of the L3 interop tests, for hiradix.sglang's cache
and SGLang's own. Waits are bounded and end on real completion signals (hiradix's prefetch
and backup events, SGLang's ack queues and, wrapped with behaviour unchanged, its prefetch
I/O); no sleeps."""

from __future__ import annotations

from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tests.sglang.pools import LAYERS, forward_read, wait_queue
from tests.sglang.v18.env import Env, PageTransfers

PAGE = 4
N = 32  # tokens per test: 8 pages
TIMEOUT = 60.0  # seconds; each wait ends on its signal in milliseconds
MODEL = "org/model-7b"


def tokens_of(seed: int) -> list[int]:
    return [1000 + 37 * seed + 11 * i for i in range(N)]


def radix_key(tokens: list[int], extra_key: str | None) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key)


def write(env: Env, tokens: list[int], extra_key: str | None = None) -> None:
    """Prefill ``tokens`` (fresh KV) into ``env``'s cache, wait until write-through put
    every page in L3, then evict them from L1 and L2."""
    cache = env.cache
    slots = env.allocator.alloc(N)
    env.write_kv(slots, torch.tensor(tokens), torch.arange(N))
    assert cache.insert(InsertParams(key=radix_key(tokens, extra_key), value=slots)).prefix_len == 0
    if env.impl == "hiradix":
        cache.core.flush()  # the L1 -> L2 copy
        cache.check_hicache_events()  # its ack queues the L2 -> L3 write (and may ack it at once)
        assert all(op.done.wait(TIMEOUT) for op in list(cache.core.storage.ongoing_backup))
        cache.check_hicache_events()
        assert cache.core.storage.pending_storage() == (0, 0, 0)
        assert cache.core.storage.l3.stats["backup_pages"] == N // PAGE
    else:
        cache.check_hicache_events()  # acks the (synchronous on CPU) L1 -> L2 copy, queues the L3 write
        assert cache.ongoing_backup
        wait_queue(cache.cache_controller.ack_backup_queue, 1, TIMEOUT)
        cache.check_hicache_events()
        assert not cache.ongoing_backup and not cache.ongoing_write_through
    assert cache.evict(EvictParams(num_tokens=N)).num_tokens_evicted == N
    cache.evict_host(N)
    m = cache.match_prefix(MatchPrefixParams(key=radix_key(tokens, extra_key)))
    assert len(m.device_indices) == 0 and m.host_hit_length == 0, "still cached in L1 or L2"


def read(env: Env, tokens: list[int], extra_key: str | None = None, rid: str = "r") -> None:
    """Prefetch ``tokens`` from L3 into ``env``'s (fresh) cache as SGLang's scheduler does,
    load them back to the device and compare every layer, component, token and element
    with the KV that was written."""
    cache = env.cache
    key = radix_key(tokens, extra_key)
    m = cache.match_prefix(MatchPrefixParams(key=key))
    assert len(m.device_indices) == 0 and m.host_hit_length == 0
    transfers = PageTransfers(cache) if env.impl == "sglang" else None
    # The scheduler's _prefetch_kvcache: the mount point's last hash (None at a root).
    cache.prefetch_from_storage(rid, m.last_host_node, array("q", tokens), cache.get_last_hash_value(m.last_host_node))
    if transfers is None:
        assert cache.core.storage.wait_prefetch(rid, TIMEOUT)
    else:
        wait_queue(cache.cache_controller.prefetch_hit_queue, 1, TIMEOUT)  # L3 answered batch_exists
        cache.check_hicache_events()  # host slots for the hits; the I/O thread starts reading
        assert transfers.done[rid].wait(TIMEOUT)
    assert cache.check_prefetch_progress(rid)
    assert cache.pop_prefetch_loaded_tokens(rid) == N, "L3 did not hold every page"
    m = cache.match_prefix(MatchPrefixParams(key=key))
    assert len(m.device_indices) == 0 and m.host_hit_length == N
    for buf in env.layers():  # the device must get its bytes from the load
        buf.zero_()
    loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=N))
    assert len(loaded) == N
    read = forward_read(env.kv, env.worker.counter, cache.ready_to_load_host_cache())
    want = env.expected_kv(torch.tensor(tokens), torch.arange(N))
    for i, (buf, w) in enumerate(zip(read, want, strict=True)):
        assert torch.equal(buf[loaded], w), f"buffer {i} (layer {i % LAYERS}) differs"
