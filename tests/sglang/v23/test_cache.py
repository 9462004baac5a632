"""hiradix.sglang on SGLang 0.5.23, which ships no HiRadixCache: the cache built as 0.5.23's
scheduler builds a registered one (``--radix-cache-backend hiradix`` through
``create_tree_cache``, SGLang's CPU pools, allocator, ``Req`` and ``ReqToTokenPool``),
against the behaviours SGLang's own unit tests check of its radix and hierarchical caches
(sgl-project/sglang ``test/``: insert and match, page alignment, key limits, namespaces,
locks, eviction, host hits and load back, L3 prefetch), written anew, and 0.5.23's request
API driven by SGLang's own caller code (``match_kv_cache`` through
``Req.init_next_round_input``, ``checkpoint_kv_cache``, ``release_kv_cache``,
``prefix_device_indices``). Every test ends with the tree's invariants and slot
conservation on SGLang's allocator.
"""

from __future__ import annotations

import io
from array import array
from contextlib import redirect_stdout

import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheRequestOutcome,
    EvictParams,
    InitLoadBackParams,
    TreeLock,
)
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.registry import get_radix_cache_factory

import hiradix.sglang as hs
from tests.sglang.pools import attention_waits_for_load, forward_read, insert, key, match, only_in_l3, settle
from tests.sglang.unified_env import build_hiradix

pytestmark = pytest.mark.usefixtures("sglang_cpu")


def admit(env, req) -> int:
    """What 0.5.23's scheduler does to start a request's prefill, with its own calls:
    match (``init_next_round_input`` -> ``match_kv_cache``), load a host hit back, lock the
    match (``TreeLock``), give it a ``req_to_token`` row holding the prefix
    (``prefix_device_indices``) and fresh slots for the rest; "compute" the new KV. Returns
    the prefix length."""
    cache = env.cache
    req.init_next_round_input(cache)
    if req.host_hit_length > 0:
        loaded, req.last_node = cache.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
        )
        assert loaded in (0, req.host_hit_length)
        req.prefix_len += loaded
        assert cache.load_back_is_cache_owned()
        req.kv.cache_protected_len = req.prefix_len
    req.lock = cache.lock(req.last_node)
    prefix = req.prefix_len
    prefix_slots = cache.prefix_device_indices(req)
    total = len(req.origin_input_ids)
    fresh = env.allocator.alloc(-(-(total - prefix) // env.page_size) * env.page_size)
    assert fresh is not None
    assert env.req_to_token.alloc([req]) is not None
    env.req_to_token.write((req.kv.req_pool_idx, slice(0, prefix)), prefix_slots.to(torch.int32))
    env.req_to_token.write((req.kv.req_pool_idx, slice(prefix, total)), fresh[: total - prefix].to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = total
    req.extend_end = total
    env.write_kv(
        fresh[: total - prefix], torch.tensor(list(req.origin_input_ids[prefix:])), torch.arange(prefix, total)
    )
    return prefix


# ---------------------------------------------------------------------------- construction
def test_built_by_sglangs_registry_as_a_prefix_cache() -> None:
    env = build_hiradix()
    assert isinstance(env.cache, hs.HiRadixCache) and isinstance(env.cache, BasePrefixCache)
    assert get_radix_cache_factory(hs.BACKEND_NAME) is hs.create_cache
    assert env.worker.counter is env.cache.cache_controller.layer_done_counter
    # ... and with SGLang's KV pool, whose attention reads wait on it (SGLang's own
    # controller registers its counter there; without it, load-backs served wrong outputs)
    assert env.kv.layer_transfer_counter is env.cache.cache_controller.layer_done_counter
    assert env.cache.token_to_kv_pool_allocator is env.allocator
    # sized as SGLang sizes it: ratio x device, in pages, plus one page
    assert env.cache.cache_controller.mem_pool_host.size == 2 * env.allocator.size + env.page_size
    assert env.cache.supports_prefix_sharing() and not env.cache.supports_mamba() and not env.cache.supports_swa()
    # the scheduler's idle check (before a flush or a storage attach) reads these
    assert not (
        env.cache.ongoing_write_through
        or env.cache.ongoing_load_back
        or env.cache.ongoing_prefetch
        or env.cache.ongoing_backup
    )
    env.cache.check_invariants()


@pytest.mark.parametrize("mla", [False, True])
def test_attention_read_waits_for_a_load_from_host(mla: bool) -> None:
    env = build_hiradix(mla=mla)

    def loaded_slots(loaded: int, node: object) -> torch.Tensor:  # 0.5.23: the count loaded, the node
        assert loaded == 40
        return env.cache.path_device_indices(node)

    attention_waits_for_load(env, list(range(500, 540)), loaded_slots)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"hierarchical": False}, "needs --enable-hierarchical-cache"),
        ({"eviction_policy": "tlru"}, "radix-eviction-policy 'tlru'"),
        # options SGLang 0.5.20 added
        ({"params": {"eviction_policy_config": {"decay": 0.5}}}, "radix-eviction-policy-config"),
        ({"hicache_host_memory_mode": "buffer_only"}, "hicache-host-memory-mode 'buffer_only'"),
        ({"hicache_storage_prefetch_retry_max_attempts": 3}, "hicache-storage-prefetch-retry-max-attempts 3"),
        ({"hicache_ratio": None, "hicache_host_memory_fraction": 0.5}, "hicache-host-memory-fraction"),
        ({"disaggregation_decode_retraction_backup": "host_pool"}, "retraction-backup host_pool"),
        (
            {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True},
            "disaggregation-decode-enable-radix-cache",
        ),
        ({"enable_lmcache": True}, "enable-lmcache"),
    ],
)
def test_unsupported_options_are_startup_errors_naming_the_option(kwargs, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_hiradix(**kwargs)


# ---------------------------------------------------------------------------- match / insert
@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match_longest_prefix(page_size: int) -> None:
    env = build_hiradix(page_size)
    assert insert(env, list(range(16))) == 0
    assert insert(env, list(range(8))) == 8  # fully cached already
    m = match(env, [*range(12), 99, 98, 97, 96])
    assert m.device_prefix_len == 12 and m.host_hit_length == 0
    path = env.cache.path_device_indices(m.last_device_node)
    assert len(path) == 12 and path.dtype == torch.int64
    assert path.tolist() == env.cache.path_device_indices(match(env, list(range(16))).last_device_node)[:12].tolist()
    assert match(env, [5, 6, 7]).device_prefix_len == 0
    empty = match(env, [])
    assert empty.device_prefix_len == 0 and env.cache.is_root(empty.last_device_node)
    assert len(env.cache.path_device_indices(empty.last_device_node)) == 0
    env.cache.check_invariants()


def test_extra_key_and_cache_salt_keep_entries_apart() -> None:
    env = build_hiradix(1)
    insert(env, list(range(10)))
    insert(env, list(range(10)), extra_key="lora-a")
    assert match(env, list(range(10)), extra_key="lora-b").device_prefix_len == 0
    assert match(env, list(range(10)), extra_key="lora-a").device_prefix_len == 10
    assert match(env, list(range(10)), cache_salt="tenant").device_prefix_len == 0
    insert(env, list(range(10)), cache_salt="tenant")
    m = match(env, list(range(10)), cache_salt="tenant")
    assert m.device_prefix_len == 10 and m.last_device_node.key.cache_salt == "tenant"
    # SGLang's DFS-weight scheduling order walks root_node: it reaches every namespace
    nodes = [
        match(env, list(range(10)), **kw).last_device_node
        for kw in ({}, {"extra_key": "lora-a"}, {"cache_salt": "tenant"}, {"extra_key": "lora-a"})
    ]
    order = env.cache.dfs_weight_order(nodes)
    assert sorted(order) == [0, 1, 2, 3] and abs(order.index(1) - order.index(3)) == 1
    env.cache.check_invariants()


def test_touch_prefix_refreshes_lru_order() -> None:
    env = build_hiradix(1)
    insert(env, list(range(10)))
    insert(env, list(range(100, 110)))
    settle(env)
    env.cache.touch_prefix(key(list(range(10))))  # the older entry becomes the newer
    assert env.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 10
    assert match(env, list(range(10))).device_prefix_len == 10
    assert match(env, list(range(100, 110))).device_prefix_len == 0
    env.cache.check_invariants()


# ---------------------------------------------------------------------------- locks and eviction
def test_tree_locks_move_tokens_between_evictable_and_protected() -> None:
    env = build_hiradix(1)
    insert(env, list(range(10)))
    settle(env)
    node = match(env, list(range(10))).last_device_node
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (10, 0)
    lock = env.cache.lock(node)
    assert isinstance(lock, TreeLock) and lock.node == node
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (0, 10)
    assert env.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 0
    env.cache.unlock(lock)
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (10, 0)
    assert env.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 10
    env.cache.check_invariants()


def test_evicted_backed_up_prefix_is_a_host_hit_and_loads_back_bytes_equal() -> None:
    env = build_hiradix(4)
    tokens = list(range(40))
    insert(env, tokens)
    settle(env)
    assert env.cache.evict(EvictParams(num_tokens=40)).num_tokens_evicted == 40
    env.cache.check_invariants()
    for buf in env.layers():  # clobber the device copy: the bytes must come from the host
        buf.zero_()
    m = match(env, tokens)
    assert m.device_prefix_len == 0 and m.host_hit_length == 40
    assert m.best_match_node.evicted and m.best_match_node.backuped
    loaded, node = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert loaded == 40 and node == m.best_match_node  # all of the promised tokens, as 0.5.23 requires
    slots = env.cache.path_device_indices(node)
    consumer = env.cache.ready_to_load_host_cache()
    want = env.expected_kv(torch.tensor(tokens), torch.arange(40))
    # The forward pass reads through SGLang's pool, which waits for each layer's load.
    for i, buf in enumerate(forward_read(env.kv, env.worker.counter, consumer)):
        assert torch.equal(buf[slots], want[i])
    assert env.cache.is_load_back_event_done(consumer)
    assert match(env, tokens).device_prefix_len == 40
    env.cache.check_invariants()


def test_load_back_below_threshold_loads_nothing() -> None:
    env = build_hiradix(1)
    insert(env, list(range(5)))  # below SGLang's load_back_threshold of 10
    settle(env)
    env.cache.evict(EvictParams(num_tokens=5))
    m = match(env, list(range(5)))
    assert m.host_hit_length == 5
    loaded, node = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert loaded == 0 and env.cache.is_root(node)


# ---------------------------------------------------------------------------- requests
def test_checkpoint_then_release_through_sglangs_caller_code() -> None:
    """A chunked prefill and a finish as 0.5.23's scheduler runs them: the chunk is
    ``checkpoint_kv_cache``'d (the row takes the tree's slots, the lock moves, the
    protected length advances), the finished request goes through ``release_kv_cache``
    (checkpoint, free the rest of the row, unlock), and a second request reuses it all."""
    env = build_hiradix(4)
    cache = env.cache
    prompt = list(range(100, 122))  # 22 tokens: 20 aligned + 2
    req = env.new_req(prompt)
    assert admit(env, req) == 0
    req.extend_end = 22
    checkpoint_kv_cache(req, cache)
    assert req.kv.cache_protected_len == 20 and req.prefix_len == 22
    assert req.lock is not None and req.lock.node == req.last_node
    settle(env)  # the write-through backup holds its own lock until it lands
    assert cache.protected_size() == 20 and req.last_node.lock_ref == 1
    row = env.req_to_token.req_to_token[req.kv.req_pool_idx]
    assert row[:20].long().tolist() == cache.path_device_indices(req.last_node).tolist()
    # decode two tokens into the tail page, then finish
    tail = int(row[21])
    req.output_ids.extend([7, 8])
    env.req_to_token.write((req.kv.req_pool_idx, slice(22, 24)), torch.tensor([tail + 1, tail + 2], dtype=torch.int32))
    env.write_kv(torch.tensor([tail + 1, tail + 2]), torch.tensor([7, 8]), torch.tensor([22, 23]))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = 24
    req.finished_reason = FINISH_LENGTH(length=2)
    release_kv_cache(req, cache, checkpoint=True)
    assert req.lock is None and not req.kv.holds_kv
    settle(env)
    assert cache.protected_size() == 0 and cache.total_size() == 24
    cache.check_invariants()
    # a second request reuses the whole prefix, with its bytes
    again = env.new_req([*prompt, 7, 8, 9])
    assert admit(env, again) == 24
    slots = env.req_to_token.req_to_token[again.kv.req_pool_idx, :24].long()
    for buf, w in zip(env.layers(), env.expected_kv(torch.tensor([*prompt, 7, 8]), torch.arange(24)), strict=True):
        assert torch.equal(buf[slots], w)
    again.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(again, cache, checkpoint=True)
    settle(env)
    cache.check_invariants()


def test_aborted_request_frees_everything_it_owns() -> None:
    env = build_hiradix(1)
    req = env.new_req(list(range(12)))
    admit(env, req)
    env.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
    release_kv_cache(req, env.cache, checkpoint=False)
    assert env.cache.total_size() == 0 and env.allocator.available_size() == env.allocator.size
    env.cache.check_invariants()


# ---------------------------------------------------------------------------- introspection
def test_sizes_flatten_print_and_reset() -> None:
    env = build_hiradix(1)
    insert(env, list(range(10)))
    insert(env, [*range(4), 40, 41])
    assert env.cache.total_size() == 12
    first = env.cache.path_device_indices(match(env, list(range(10))).last_device_node).tolist()
    second = env.cache.path_device_indices(match(env, [0, 1, 2, 3, 40, 41]).last_device_node)[4:].tolist()
    assert sorted(env.cache.all_values_flatten().tolist()) == sorted(first + second)
    out = io.StringIO()
    with redirect_stdout(out):
        env.cache.pretty_print()
    assert "#tokens: 12" in out.getvalue()
    assert "Available tokens" in env.cache.available_and_evictable_str()
    assert env.cache.take_events() == []
    env.cache.reset()
    assert env.cache.total_size() == 0 and env.allocator.available_size() == env.allocator.size
    assert match(env, list(range(10))).device_prefix_len == 0
    env.cache.check_invariants()


# ---------------------------------------------------------------------------- storage (L3)
def test_storage_backup_prefetch_round_trip_by_request_handle() -> None:
    """L3 through 0.5.23's calls: the prefetch is named by the request's
    ``CacheRequestHandle`` (with the scheduler's keyword arguments), its end is read with
    ``pop_prefetch_loaded_span``, and the loaded bytes equal the written ones."""
    env = build_hiradix(4, storage="memory", extra_config='{"prefetch_threshold": 8}')
    cache = env.cache
    tokens = list(range(200, 232))
    insert(env, tokens)
    only_in_l3(env)
    assert cache.enable_storage
    req = env.new_req(tokens)
    req.init_next_round_input(cache)
    handle = req.cache_request_handle
    anchor = req.last_host_node
    assert cache.is_root(anchor)
    assert cache.prefetch_from_storage(
        handle,
        anchor,
        array("q", tokens),
        cache.get_last_hash_value(anchor),
        None,
        matched_prefix_tokens=array("q"),
        extra_key=None,
        cache_salt=None,
        storage_hit_end=None,
    )
    assert len(cache.ongoing_prefetch) == 1
    cache.core.storage.wait_prefetch(handle, timeout=30)
    assert cache.check_prefetch_progress(handle)
    assert cache.pop_prefetch_loaded_span(handle) == (32, None)
    m = match(env, tokens)
    assert m.host_hit_length == 32
    loaded, node = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=32))
    assert loaded == 32
    read = forward_read(env.kv, env.worker.counter, cache.ready_to_load_host_cache())
    slots = cache.path_device_indices(node)
    for buf, w in zip(read, env.expected_kv(torch.tensor(tokens), torch.arange(32)), strict=True):
        assert torch.equal(buf[slots], w)
    # an attempt that ends aborted gives its prefetch back
    other = env.new_req(list(range(300, 332)))
    other.init_next_round_input(cache)
    assert cache.prefetch_from_storage(other.cache_request_handle, other.last_host_node, array("q", range(300, 332)))
    cache.finish(other.cache_request_handle, CacheRequestOutcome.ABORT)
    assert not cache.ongoing_prefetch
    settle(env)
    cache.check_invariants()


# ---------------------------------------------------------------------------- plugin
def test_plugin_registers_on_0_5_23(caplog) -> None:
    """SGLang's plugin hook registers the backend here (no "not registered" warning), and
    registering again is a no-op (SGLang loads plugins once per process)."""
    import hiradix._sglang_plugin as plugin

    with caplog.at_level("WARNING", logger="hiradix._sglang_plugin"):
        plugin.register()
        plugin.register()
    assert "not registered" not in caplog.text
    assert get_radix_cache_factory(hs.BACKEND_NAME) is hs.create_cache
    assert hs.SGLANG_VERSION.startswith("0.5.23")
