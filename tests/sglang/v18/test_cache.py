"""hiradix.sglang against the behaviour SGLang's own unit tests check of RadixCache and
HiRadixCache (sgl-project/sglang ``test_radix_cache_unit.py`` and the HiCache scheduler
paths), written anew for the adapter, on SGLang's real CPU pools, allocator, ``Req`` and
``ReqToTokenPool``. Every test ends with the slot-conservation check on SGLang's allocator.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    EvictParams,
    IncLockRefResult,
    InitLoadBackParams,
    MatchResult,
)

import hiradix.sglang as hs
from tests.sglang.pools import LAYERS, attention_waits_for_load, forward_read, insert, match, settle
from tests.sglang.v18.env import build, needs_sglang_020, record


# ---------------------------------------------------------------------------- construction
def test_built_by_sglangs_registry_as_a_prefix_cache(make_env) -> None:
    env = make_env()
    assert isinstance(env.cache, hs.HiRadixCache) and isinstance(env.cache, BasePrefixCache)
    assert env.worker.counter is env.cache.cache_controller.layer_done_counter
    # ... and with SGLang's KV pool, whose attention reads wait on it (SGLang's own
    # controller registers its counter there; without it, load-backs served wrong outputs)
    assert env.kv.layer_transfer_counter is env.cache.cache_controller.layer_done_counter
    assert env.cache.token_to_kv_pool_allocator is env.allocator
    # sized as SGLang sizes it: ratio x device, in pages, plus one page
    assert env.cache.cache_controller.mem_pool_host.size == 2 * env.allocator.size + env.page_size
    assert env.cache.is_tree_cache() and not env.cache.is_chunk_cache()
    env.cache.check_invariants()


def _params_by_hand(req_to_token: object, alloc: object) -> object:
    """SGLang's ``CacheInitParams`` as a fork building the cache by hand passes them (page 1, LRU)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        eviction_policy="lru",
    )


def test_built_by_hand_registers_the_counter_with_the_pool() -> None:
    """A fork's scheduler builds ``HiRadixCache(params, server_args)`` itself, with no
    factory and no TP worker: SGLang's pool must wait on the counter all the same."""
    from tests.sglang.v18.env import parity_pools_and_args

    kv, alloc, req_to_token, server_args = parity_pools_and_args(1, 256)
    params = _params_by_hand(req_to_token, alloc)
    cache = hs.HiRadixCache(params, server_args)
    try:
        assert kv.layer_transfer_counter is cache.cache_controller.layer_done_counter
    finally:
        cache.shutdown()
        cache.core.close()


def test_a_page_size_the_pool_does_not_have_is_a_startup_error() -> None:
    """The adapter pages requests by ``CacheInitParams.page_size``, the cache slots by the
    KV pool's: built with two that differ, it refuses to start, naming both."""
    from tests.sglang.v18.env import parity_pools_and_args

    _, alloc, req_to_token, server_args = parity_pools_and_args(4, 256)
    params = _params_by_hand(req_to_token, alloc)
    with pytest.raises(
        ValueError, match=r"CacheInitParams.page_size is 1, the KV pool \(MHATokenToKVPool\) has page_size 4"
    ):
        hs.HiRadixCache(params, server_args)


def test_write_backup_as_sglangs_unit_tests_call_it(make_env) -> None:
    """SGLang 0.5.18's public ``write_backup(node, write_back=False)``: a device node whose
    parent is backed up is copied to host (its token count returned); a child of a node not
    on host is refused with 0, as SGLang refuses a gap in the backed-up chain."""
    env = make_env(write_policy="write_back")  # nothing backs up by itself
    cache = env.cache
    insert(env, list(range(40)))
    insert(env, list(range(20)) + list(range(100, 120)))  # splits: [0..20) and two children
    m = match(env, list(range(20)) + list(range(100, 120)))
    child = m.last_device_node
    parent = child.parent
    assert not parent.backuped and not child.backuped
    assert cache.write_backup(child) == 0  # its parent is not on host
    assert cache.write_backup(parent) == 20
    settle(env)
    assert parent.backuped
    assert cache.write_backup(child, write_back=True) == 20
    settle(env)
    assert child.backuped and cache.write_backup(child) == 0  # on host already
    cache.check_invariants()


def test_fence_streams_reach_the_copy_engines(make_env) -> None:
    """SGLang 0.5.20's and 0.5.23's schedulers set the controller's ``load_fence_stream``
    and ``write_fence_stream`` to the forward stream: the copy engines wait for it."""
    controller = make_env().cache.cache_controller
    assert controller.load_fence_stream is None and controller.write_fence_stream is None
    stream = object()
    controller.load_fence_stream = stream
    controller.write_fence_stream = stream
    assert controller.load_engine.fence_stream is stream and controller.write_engine.fence_stream is stream


@pytest.mark.parametrize("mla", [False, True])
def test_attention_read_waits_for_a_load_from_host(make_env, mla: bool) -> None:
    attention_waits_for_load(make_env(mla=mla), list(range(500, 540)))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"hicache_ratio": 0.5}, "hicache-ratio"),
        ({"storage": "memory", "extra_config": "{not json"}, "extra-config"),
        # token-only L3 chains of an EAGLE tree's second tokens would name other requests' pages
        ({"storage": "memory", "extra_config": '{"l3_format": "sglang"}', "eagle": True}, "l3_format 'sglang'"),
        ({"extra_config": '{"backup_copy": "later"}'}, "backup_copy must be one of"),
    ],
)
def test_unsupported_options_are_startup_errors_naming_the_option(kwargs, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build(**kwargs)


@pytest.mark.parametrize(
    ("extra", "inline"), [(None, True), ('{"backup_copy": "inline"}', True), ('{"backup_copy": "thread"}', False)]
)
def test_backup_copies_run_inline_on_cpu_pools_unless_asked_for_a_thread(extra, inline: bool) -> None:
    """On CPU pools a step's backups are copied on the scheduler thread by default; loads
    keep their thread either way. The bytes round-trip the same way in both modes."""
    env = build(4, extra_config=extra)
    ctrl = env.cache.cache_controller
    assert ctrl.write_engine.inline is inline and not ctrl.load_engine.inline
    tokens = list(range(40))
    insert(env, tokens)
    settle(env)
    assert env.cache.evict(EvictParams(num_tokens=40)).num_tokens_evicted == 40
    for buf in env.layers():  # the bytes must come back from the host copy
        buf.zero_()
    m = match(env, tokens)
    loaded, _ = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert len(loaded) == 40
    settle(env)
    for buf, want in zip(env.layers(), env.expected_kv(torch.tensor(tokens), torch.arange(40)), strict=True):
        assert torch.equal(buf[loaded], want)
    env.cache.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"params": {"eviction_policy_config": {"decay": 0.5}}}, "radix-eviction-policy-config"),
        ({"hicache_host_memory_mode": "buffer_only"}, "hicache-host-memory-mode 'buffer_only'"),
        ({"hicache_storage_prefetch_retry_max_attempts": 3}, "hicache-storage-prefetch-retry-max-attempts 3"),
        ({"disaggregation_decode_retraction_backup": "host_pool"}, "retraction-backup host_pool"),
        ({"enable_lmcache": True}, "enable-lmcache"),
    ],
)
def test_options_sglang_020_added_are_startup_errors_naming_the_option(kwargs, named: str) -> None:
    needs_sglang_020("these options are SGLang 0.5.20's (0.5.18 has none of them)")
    with pytest.raises(ValueError, match=named):
        build(**kwargs)


# ---------------------------------------------------------------------------- match / insert
@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match_longest_prefix(make_env, page_size: int) -> None:
    env = make_env(page_size)
    assert insert(env, list(range(16))) == 0
    assert insert(env, list(range(8))) == 8  # fully cached already
    m = match(env, [*range(12), 99, 98, 97, 96])
    assert len(m.device_indices) == 12
    assert m.device_indices.dtype == torch.int64
    assert len(match(env, [5, 6, 7]).device_indices) == 0
    empty = match(env, [])
    assert len(empty.device_indices) == 0 and env.cache.is_root(empty.last_device_node)
    env.cache.check_invariants()


def test_match_results_are_sglangs_with_its_defaults(make_env) -> None:
    """A match builds SGLang's MatchResult without its generated constructor: the same
    tuple as the constructor's, every later field at SGLang's default."""
    env = make_env(4)
    insert(env, list(range(16)))
    m = match(env, list(range(16)))
    assert type(m) is MatchResult and len(m) == len(MatchResult._fields)
    assert m == MatchResult(*m[:5])
    for field, default in MatchResult._field_defaults.items():
        if field != "host_hit_length":
            assert getattr(m, field) == default, field


def test_extra_key_and_cache_salt_keep_entries_apart(make_env) -> None:
    env = make_env()
    insert(env, list(range(10)))
    insert(env, list(range(10)), extra_key="lora-a")
    assert len(match(env, list(range(10)), extra_key="lora-b").device_indices) == 0
    assert len(match(env, list(range(10)), extra_key="lora-a").device_indices) == 10
    assert len(match(env, list(range(10)), cache_salt="tenant").device_indices) == 0
    assert len(match(env, list(range(10)), extra_key="lora-a", cache_salt="tenant").device_indices) == 0
    insert(env, list(range(10)), cache_salt="tenant")
    m = match(env, list(range(10)), cache_salt="tenant")
    assert len(m.device_indices) == 10
    assert m.last_device_node.key.cache_salt == "tenant" and m.last_device_node.key.extra_key is None
    # the global root's children reach every namespace (the DFS-weight policy walks them)
    seen, stack = 0, [env.cache.root_node]
    while stack:
        node = stack.pop()
        seen += len(node.key) if not env.cache.is_root(node) else 0
        stack.extend(node.children.values())
    assert seen == 30
    env.cache.check_invariants()


def test_node_views_carry_sglangs_fields(make_env) -> None:
    env = make_env(storage="memory")  # page hashes are computed with an L3 backend, as in SGLang
    insert(env, list(range(10)))
    insert(env, [*range(5), 50, 51, 52])  # splits at 5
    settle(env)
    m = match(env, [*range(5), 50, 51, 52])
    leaf = m.last_device_node
    parent = leaf.parent
    assert list(leaf.key.token_ids) == [50, 51, 52] and len(parent.key) == 5
    assert parent.parent == env.cache.root_node and leaf in parent.children.values()
    assert not leaf.evicted and leaf.backuped and leaf.lock_ref == 0
    assert leaf.value.tolist() == m.device_indices[5:].tolist()
    assert len(leaf.host_value) == 3 and leaf.hit_count >= 0 and leaf.last_access_time > 0
    assert match(env, list(range(8))).last_device_node == match(env, list(range(8))).last_device_node  # equal views
    assert {leaf: 1}[match(env, [*range(5), 50, 51, 52]).last_device_node] == 1  # hash like SGLang's dict keys
    assert env.cache.is_backuped(leaf) and env.cache.get_last_hash_value(leaf) == leaf.hash_value[-1]
    assert env.cache.get_prefix_hash_values(leaf) == parent.hash_value


# ---------------------------------------------------------------------------- locks and eviction
def test_lock_refs_move_tokens_between_evictable_and_protected(make_env) -> None:
    env = make_env()
    insert(env, list(range(10)))
    settle(env)
    node = match(env, list(range(10))).last_device_node
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (10, 0)
    res = env.cache.inc_lock_ref(node)
    assert isinstance(res, IncLockRefResult) and res.delta == -10
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (0, 10)
    assert env.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 0
    assert env.cache.dec_lock_ref(node, res.to_dec_params()).delta == 10
    assert env.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 10
    env.cache.check_invariants()


def test_evicted_backed_up_prefix_is_a_host_hit_and_loads_back_bytes_equal(make_env) -> None:
    env = make_env(4)
    tokens = list(range(40))
    insert(env, tokens)
    settle(env)
    assert env.cache.evict(EvictParams(num_tokens=40)).num_tokens_evicted == 40
    env.cache.check_invariants()
    for buf in env.layers():  # clobber the device copy: the bytes must come from the host
        buf.zero_()
    m = match(env, tokens)
    assert len(m.device_indices) == 0 and m.host_hit_length == 40
    assert m.best_match_node.evicted and m.best_match_node.backuped
    loaded, node = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert len(loaded) == 40 and node == m.best_match_node
    consumer = env.cache.ready_to_load_host_cache()
    want = env.expected_kv(torch.tensor(tokens), torch.arange(40))
    # The forward pass reads through SGLang's pool, which waits for each layer's load.
    for i, buf in enumerate(forward_read(env.kv, env.worker.counter, consumer)):
        assert torch.equal(buf[loaded], want[i])
    assert env.cache.is_load_back_event_done(consumer)
    assert len(match(env, tokens).device_indices) == 40
    env.cache.check_invariants()


def test_load_back_below_threshold_is_skipped(make_env) -> None:
    env = make_env()
    insert(env, list(range(5)))  # below SGLang's load_back_threshold of 10
    settle(env)
    env.cache.evict(EvictParams(num_tokens=5))
    m = match(env, list(range(5)))
    loaded, node = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert len(loaded) == 0 and env.cache.is_root(node)


# ---------------------------------------------------------------------------- requests
def test_cache_unfinished_then_finished_req_on_sglang_req(make_env) -> None:
    env = make_env(4)
    prompt = list(range(100, 122))  # 22 tokens: 20 aligned + 2
    req = env.new_req(prompt)
    req.init_next_round_input(env.cache)
    assert len(req.prefix_indices) == 0
    slots = env.allocator.alloc(24)
    env.req_to_token.write((record(req).req_pool_idx, slice(0, 22)), slots[:22])
    env.write_kv(slots[:22], torch.tensor(prompt), torch.arange(22))
    req.set_extend_range(0, 22)  # what the scheduler's PrefillAdder records for the chunk
    env.cache.cache_unfinished_req(req)
    assert record(req).cache_protected_len == 20 and len(req.prefix_indices) == 22
    settle(env)  # the write-through backup holds its own lock until it lands
    assert env.cache.protected_size() == 20 and req.last_node.lock_ref == 1
    # decode two tokens into the tail page, then finish
    req.output_ids.extend([7, 8])
    env.req_to_token.write((record(req).req_pool_idx, slice(22, 24)), slots[22:24])
    env.cache.cache_finished_req(req, kv_len_to_handle=24)
    env.req_to_token.free(req)
    settle(env)
    assert env.cache.protected_size() == 0 and env.cache.total_size() == 24
    env.cache.check_invariants()
    # a second request reuses the whole prefix
    again = env.new_req([*prompt, 7, 8, 9])
    again.init_next_round_input(env.cache)
    assert len(again.prefix_indices) == 24


@pytest.mark.parametrize(("page_size", "eagle"), [(1, False), (4, False), (4, True)])
def test_chunked_prefill_continues_from_the_locked_node_as_sglang_ends(
    make_env, make_sglang, page_size: int, eagle: bool
) -> None:
    """A chunked prefill of several chunks (unaligned ends) through the scheduler's
    ``cache_unfinished_req(req, chunked=True)``, beside another request that cached part
    of the prompt mid-chunk: after every chunk hiradix's row, ``prefix_indices`` (int64),
    protected length and the slots it freed are SGLang's own HiRadixCache's, and from the
    second chunk on the insert continues from the request's locked node (``start``)."""
    if eagle and hs.api.REQUEST_API != "cache_req":
        pytest.skip("the EAGLE variant is 0.5.18's")
    prompt = list(range(1000, 1070))
    other = prompt[:30] + [5, 6, 7, 8, 9, 10, 11, 12]  # shares 30 tokens: the second chunk meets them
    envs = [make_env(page_size, eagle=eagle), make_sglang(page_size, eagle=eagle)]
    starts: list[object] = []
    insert_below = envs[0].cache.core.insert_below

    def spy(*args, **kwargs):
        starts.append(kwargs.get("start"))
        return insert_below(*args, **kwargs)

    envs[0].cache.core.insert_below = spy
    reqs = []
    for env in envs:
        req = env.new_req(prompt)  # admitted on a miss: every slot its own
        req.init_next_round_input(env.cache)
        assert len(req.prefix_indices) == 0
        env.cache.inc_lock_ref(req.last_node)
        slots = env.allocator.alloc(-(-len(prompt) // page_size) * page_size)
        env.req_to_token.write((record(req).req_pool_idx, slice(0, len(prompt))), slots[: len(prompt)])
        reqs.append(req)
        r = env.new_req(other)  # then another request caches part of its prompt
        r.init_next_round_input(env.cache)
        slots = env.allocator.alloc(-(-len(other) // page_size) * page_size)
        env.req_to_token.write((record(r).req_pool_idx, slice(0, len(other))), slots[: len(other)])
        env.cache.cache_finished_req(r, kv_len_to_handle=len(other))
    freed = [env.allocator.available_size() for env in envs]
    starts.clear()
    for k, end in enumerate((13, 41, 58, 70)):
        for env, req in zip(envs, reqs, strict=True):
            req.set_extend_range(0, end)
            env.cache.cache_unfinished_req(req, chunked=True)
        ours, theirs = reqs
        assert record(ours).cache_protected_len == record(theirs).cache_protected_len
        rows = [env.req_to_token.req_to_token[record(r).req_pool_idx, :end] for env, r in zip(envs, reqs, strict=True)]
        assert torch.equal(rows[0], rows[1]), k
        assert ours.prefix_indices.dtype == torch.int64 and torch.equal(ours.prefix_indices, theirs.prefix_indices)
        assert torch.equal(ours.prefix_indices, rows[0].long())
        gained = [env.allocator.available_size() - f for env, f in zip(envs, freed, strict=True)]
        assert gained[0] == gained[1], (k, gained)
        # the first chunk inserts the whole key; the later ones continue from the locked node
        assert len([start for start in starts if start is not None]) == k, starts
        envs[0].cache.tree.check_invariants()
    for env, req in zip(envs, reqs, strict=True):
        env.cache.cache_finished_req(req, kv_len_to_handle=len(prompt))
    ours, theirs = (env.cache.evictable_size() + env.cache.protected_size() for env in envs)
    assert ours == theirs == (78 if page_size == 1 else 76)  # the prompt, and the other's 8 (aligned)


def test_finished_req_without_insert_frees_everything_it_owns(make_env) -> None:
    env = make_env()
    req = env.new_req(list(range(12)))
    req.init_next_round_input(env.cache)
    slots = env.allocator.alloc(12)
    env.req_to_token.write((record(req).req_pool_idx, slice(0, 12)), slots)
    env.cache.cache_finished_req(req, is_insert=False, kv_len_to_handle=12)
    assert env.cache.total_size() == 0
    env.cache.check_invariants()


# ---------------------------------------------------------------------------- introspection
def test_sizes_flatten_print_and_reset(make_env) -> None:
    env = make_env()
    insert(env, list(range(10)))
    insert(env, [*range(4), 40, 41])
    assert env.cache.total_size() == 12
    first = match(env, list(range(10))).device_indices.tolist()
    second = match(env, [0, 1, 2, 3, 40, 41]).device_indices[4:].tolist()
    assert sorted(env.cache.all_values_flatten().tolist()) == sorted(first + second)
    out = io.StringIO()
    with redirect_stdout(out):
        env.cache.pretty_print()
    assert "#tokens: 12" in out.getvalue()
    assert env.cache.take_events() == []
    env.cache.reset()
    assert env.cache.total_size() == 0 and env.allocator.available_size() == env.allocator.size
    assert len(match(env, list(range(10))).device_indices) == 0
    env.cache.check_invariants()


def test_layer_done_counter_follows_sglangs_contract(make_env) -> None:
    env = make_env()
    counter = env.cache.cache_controller.layer_done_counter
    assert counter.num_layers == LAYERS and len(counter.events) == 3
    counter.set_consumer(-1)
    counter.wait_until(LAYERS - 1)  # nothing to wait for
    assert env.cache.ready_to_load_host_cache() == -1
    assert all(e.finish_event.query() for e in counter.events)
    counter.reset()
    assert (counter.producer_index, counter.consumer_index) == (-1, -1)


# ---------------------------------------------------------------------------- storage (L3)
def test_storage_backup_prefetch_round_trip(make_env) -> None:
    env = make_env(4, storage="memory", extra_config='{"prefetch_threshold": 8}', prefetch_policy="wait_complete")
    cache = env.cache
    tokens = list(range(200, 232))
    insert(env, tokens)
    settle(env)
    while cache.core.storage.pending_storage()[1]:  # the L2 -> L3 writes
        cache.core.storage.l3.drain() if hasattr(cache.core.storage.l3, "drain") else None
        cache.check_hicache_events()
    cache.reset()  # device and host empty; L3 keeps the pages
    assert cache.enable_storage
    req = env.new_req(tokens)
    req.init_next_round_input(cache)
    assert cache.query_storage_hit_length(req.last_host_node, tokens) == 32
    assert cache.prefetch_from_storage(req.rid, req.last_host_node, tokens)
    cache.core.storage.wait_prefetch(req.rid, timeout=10)
    assert cache.check_prefetch_progress(req.rid)
    assert cache.pop_prefetch_loaded_tokens(req.rid) == 32
    m = match(env, tokens)
    assert m.host_hit_length == 32
    loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=32))
    want = env.expected_kv(torch.tensor(tokens), torch.arange(32))
    read = forward_read(env.kv, env.worker.counter, cache.ready_to_load_host_cache())
    for buf, w in zip(read, want, strict=True):
        assert torch.equal(buf[loaded], w)
    settle(env)
    cache.check_invariants()


# ---------------------------------------------------------------------------- plugin
def test_plugin_entry_point_is_discovered_by_sglang() -> None:
    """The installed distribution's entry point in SGLang's plugin group names our
    registration function, and SGLang's own loader finds and loads it."""
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from hiradix._sglang_plugin import register

    try:
        distribution("hiradix")
    except PackageNotFoundError:
        pytest.skip(
            "hiradix is imported from a path entry, not installed: no entry point to discover "
            "(pip install -e ., or .ci/link_checkout.py as .ci/run does)"
        )
    (ep,) = [e for e in entry_points(group=GENERAL_PLUGINS_GROUP) if e.name == "hiradix"]
    assert ep.load() is register
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "hiradix" in plugins
    plugins["hiradix"][0]()  # idempotent: registered once already
    assert get_radix_cache_factory("hiradix") is hs.create_cache


def test_plugin_respects_sglang_plugins_filter(monkeypatch) -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert "hiradix" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


def test_unsupported_sglang_version_is_a_warning_for_the_plugin_and_an_error_on_import(monkeypatch, caplog) -> None:
    """On an SGLang the adapter does not support (0.5.14 has no radix-cache registry), SGLang
    still starts: the plugin logs why it does not register; importing the adapter says which
    versions it needs."""
    import hiradix._sglang_plugin as plugin
    import hiradix._sglang_versions as versions

    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.5.14")
    monkeypatch.delenv("HIRADIX_SGLANG_ANY_VERSION", raising=False)
    with pytest.raises(versions.UnsupportedSGLang, match=r"0\.5\.18, 0\.5\.20, 0\.5\.23 .*0\.5\.14 is installed"):
        versions.check_sglang_version()
    calls = []
    monkeypatch.setattr("hiradix.sglang.plugin.register", lambda: calls.append(1))
    with caplog.at_level("WARNING", logger="hiradix._sglang_plugin"):
        plugin.register()
    assert calls == [] and "not registered" in caplog.text and "0.5.14" in caplog.text
