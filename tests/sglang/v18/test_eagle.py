"""EAGLE bigram keys (issue 11): with ``is_eagle`` a key of ``n + 1`` tokens is ``n``
bigrams ``(t[i], t[i+1])`` with one device slot each, as in SGLang 0.5.18's RadixCache /
HiRadixCache. hiradix.sglang must give SGLang's prefix lengths, device slots (their KV),
host hits, last nodes (keys with the boundary token) and events for the same operations:
pinned cases, then random operations and requests on hiradix.sglang and SGLang's own
``HiRadixCache`` side by side (:mod:`twin`), and the L3 round trip.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tests.sglang.pools import MTPDraft, forward_read, mtp_draft_round_trip, settle
from tests.sglang.v18.env import build, build_sglang, needs_sglang_020, patch_sglang_for_parity, record
from tests.sglang.v18.twin import Twin, run


@pytest.fixture
def twin_of(monkeypatch):
    made: list[Twin] = []

    def make(
        page_size: int = 1, *, write_policy: str = "write_through", kv_events: bool = False, size: int = 128
    ) -> Twin:
        patch_sglang_for_parity(monkeypatch, 8.0)
        kw = dict(size=size * page_size, write_policy=write_policy, hicache_ratio=8.0, kv_events=kv_events, eagle=True)
        twin = Twin(build(page_size, **kw), build_sglang(page_size, **kw), eagle=True)
        made.append(twin)
        return twin

    yield make
    for twin in made:
        twin.ours.cache.core.close()
        twin.theirs.cache.release_host_resources()


def key(tokens, **kw) -> RadixKey:
    return RadixKey(array("q", tokens), **kw)


def match(env, tokens, **kw):
    return env.cache.match_prefix(MatchPrefixParams(key=key(tokens, **kw)))


def insert(env, tokens, **kw) -> int:
    """Insert ``tokens`` (``len - 1`` bigrams, page aligned) with fresh slots."""
    n = (len(tokens) - 1) // env.page_size * env.page_size
    slots = env.allocator.alloc(n)
    env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
    res = env.cache.insert(InsertParams(key=key(tokens, **kw), value=slots))
    if res.prefix_len:
        env.allocator.free(slots[: res.prefix_len])
    return res.prefix_len


# ---------------------------------------------------------------------------- pinned cases
def test_a_key_of_n_plus_one_tokens_caches_n_bigrams(make_env) -> None:
    env = make_env(eagle=True)
    assert insert(env, [1, 2, 3, 4, 5]) == 0
    assert env.cache.total_size() == 4
    assert len(match(env, [1, 2, 3, 4, 5]).device_indices) == 4
    assert len(match(env, [1, 2, 3, 4, 5, 6]).device_indices) == 4
    assert len(match(env, [1, 2, 3, 4, 9]).device_indices) == 3  # the last bigram (4, 9) differs
    assert len(match(env, [7, 2, 3, 4, 5]).device_indices) == 0  # so does the first, (7, 2)
    assert len(match(env, [1]).device_indices) == 0 and len(match(env, []).device_indices) == 0
    assert len(match(env, [1, 2, 3, 4, 5], limit=3).device_indices) == 2  # the limit caps raw tokens
    assert insert(env, [1, 2, 3, 4, 5, 6]) == 4
    env.cache.check_invariants()


def test_bigram_pages_are_aligned_on_bigrams(make_env) -> None:
    env = make_env(4, eagle=True)
    assert insert(env, list(range(10, 19))) == 0  # 9 tokens: 8 bigrams, two pages
    assert env.cache.total_size() == 8
    assert len(match(env, list(range(10, 18))).device_indices) == 4  # 7 bigrams: one page
    assert len(match(env, list(range(10, 17)) + [99, 18]).device_indices) == 4
    env.cache.check_invariants()


def test_nodes_show_sglangs_bigram_keys(make_env) -> None:
    env = make_env(eagle=True)
    insert(env, [1, 2, 3, 4, 5])
    insert(env, [1, 2, 3, 8, 9])  # splits after the bigrams (1, 2), (2, 3)
    m = match(env, [1, 2, 3, 8, 9])
    node = m.last_device_node
    assert node.key.is_bigram and list(node.key.token_ids) == [3, 8, 9] and len(node.key) == 2
    parent = node.parent
    assert list(parent.key.token_ids) == [1, 2, 3] and len(parent.key) == 2
    assert set(parent.children) == {(3, 4), (3, 8)}
    (ns_root,) = [c for k, c in env.cache.root_node.children.items() if k[0] == "namespace"]
    assert list(ns_root.children) == [(1, 2)]


def test_a_bigram_key_reaching_a_plain_cache_is_an_error(make_env) -> None:
    env = make_env()
    with pytest.raises(ValueError, match="is_eagle"):
        env.cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3], is_bigram=True)))


def test_requests_cache_their_bigrams_and_keep_the_rest(make_env) -> None:
    env = make_env(4, eagle=True)
    prompt = list(range(100, 122))  # 22 tokens: 21 bigrams, 20 aligned
    req = env.new_req(prompt)
    req.init_next_round_input(env.cache)
    slots = env.allocator.alloc(24)
    env.req_to_token.write((record(req).req_pool_idx, slice(0, 22)), slots[:22])
    env.write_kv(slots[:22], torch.tensor(prompt), torch.arange(22))
    req.set_extend_range(0, 22)
    env.cache.cache_unfinished_req(req)
    assert record(req).cache_protected_len == 20 and len(req.prefix_indices) == 22
    req.output_ids.extend([7, 8])
    env.req_to_token.write((record(req).req_pool_idx, slice(22, 24)), slots[22:24])
    env.cache.cache_finished_req(req, kv_len_to_handle=24)  # 23 bigrams: 20 cached, the rest freed
    env.req_to_token.free(req)
    env.cache.core.flush()
    env.cache.check_hicache_events()
    assert env.cache.protected_size() == 0 and env.cache.total_size() == 20
    env.cache.check_invariants()
    again = env.new_req([*prompt, 7, 8, 9])
    again.init_next_round_input(env.cache)
    assert len(again.prefix_indices) == 20


# ---------------------------------------------------------------------------- parity with SGLang
def test_scripted_bigram_operations_match_sglang(twin_of) -> None:
    twin = twin_of(2)
    base = list(range(1, 26))
    assert twin.insert(base) == 0
    assert twin.insert(base[:9] + [40, 41, 42]) == 8
    twin.match(base[:7])  # splits
    twin.match([*base[:5], 99])
    twin.match(base, limit=12)
    twin.settle()
    twin.evict(64)
    twin.load_back(base)
    twin.request(base + [50, 51], chunk=15)
    twin.request([base[0], 77, 78, 79, 80])
    twin.reset()
    assert twin.stats["loaded tokens"] == 24 and twin.stats["requests"] == 2


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective"])
@pytest.mark.slow  # a long randomized run against SGLang's own cache
def test_random_bigram_operations_match_sglang(twin_of, page_size: int, write_policy: str) -> None:
    twin = twin_of(page_size, write_policy=write_policy, kv_events=page_size == 1)
    s = run(twin, seed=100 + page_size * 10 + len(write_policy), steps=300)
    assert s["requests"] > 10 and s["chunks"] > 3 and s["hit tokens"] > 0 and s["kv verified"] > s["hit tokens"], s
    if write_policy == "write_through":  # (selective backs up on a second hit: fewer host copies)
        assert s["host hit tokens"] > 0, s
    if page_size == 1:  # events compared too: bigram token pairs, bigram ids
        assert s["BlockStored"] > 0 and s["BlockRemoved"] > 0, s


# ---------------------------------------------------------------------------- L3
def test_bigram_pages_round_trip_through_storage(make_env) -> None:
    env = make_env(
        4, storage="memory", extra_config='{"prefetch_threshold": 8}', prefetch_policy="wait_complete", eagle=True
    )
    cache = env.cache
    tokens = list(range(200, 233))  # 33 tokens: 32 bigrams
    insert(env, tokens)
    env.cache.core.flush()
    cache.check_hicache_events()
    while cache.core.storage.pending_storage()[1]:  # the L2 -> L3 writes
        cache.check_hicache_events()
    cache.reset()  # device and host empty; L3 keeps the pages
    req = env.new_req(tokens)
    req.init_next_round_input(cache)
    assert cache.query_storage_hit_length(req.last_host_node, tokens) == 32
    assert cache.query_storage_hit_length(req.last_host_node, [201, *tokens[1:]]) == 0  # another first bigram
    assert cache.prefetch_from_storage(req.rid, req.last_host_node, tokens)
    cache.core.storage.wait_prefetch(req.rid, timeout=10)
    assert cache.check_prefetch_progress(req.rid)
    assert cache.pop_prefetch_loaded_tokens(req.rid) == 32
    m = match(env, tokens)
    assert m.host_hit_length == 32
    loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=32))
    read = forward_read(env.kv, env.worker.counter, cache.ready_to_load_host_cache())
    for buf, w in zip(read, env.expected_kv(torch.tensor(tokens[:32]), torch.arange(32)), strict=True):
        assert torch.equal(buf[loaded], w)
    env.cache.core.flush()
    cache.check_hicache_events()
    cache.check_invariants()


def test_sglang_itself_agrees_on_the_pinned_lengths(monkeypatch) -> None:
    """The pinned bigram lengths above are SGLang's own (its cache, same calls)."""
    patch_sglang_for_parity(monkeypatch)
    env = build_sglang(eagle=True)
    assert insert(env, [1, 2, 3, 4, 5]) == 0
    assert len(match(env, [1, 2, 3, 4, 9]).device_indices) == 3
    assert len(match(env, [1, 2, 3, 4, 5], limit=3).device_indices) == 2
    assert insert(env, [1, 2, 3, 4, 5, 6]) == 4
    env.cache.release_host_resources()


# ---------------------------------------------------------------------------- draft model KV
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_draft_models_kv_follows_the_targets_through_host_and_back(make_env, sglang_cpu, layout: str) -> None:
    """Speculative decoding with a separate draft model: SGLang's own start-up code
    (``kv_cache_builder._register_legacy_hicache_draft``) registers the draft's KV pool with
    ``tree_cache.cache_controller``. Evicted to host and loaded back, the draft's KV
    returns byte for byte at the target's new slots, together with the target's."""
    from sglang.srt.mem_cache.kv_cache_builder import _register_legacy_hicache_draft
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    env = make_env(4, layout=layout, eagle=True)
    draft = MHATokenToKVPool(
        size=env.kv.size,
        page_size=4,
        dtype=torch.float32,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    server_args = type("Args", (), {"hicache_mem_layout": layout, "hicache_storage_backend": None})()
    _register_legacy_hicache_draft(tree_cache=env.cache, draft_pool=draft, server_args=server_args, page_size=4)
    controller = env.cache.cache_controller
    assert controller.has_draft and len(controller.companions) == 1

    def draft_kv(tokens: torch.Tensor) -> torch.Tensor:  # bytes from the token only
        return (tokens.to(torch.float32).view(-1, 1, 1) * 5 + torch.arange(8.0).view(1, 1, 8)).remainder(991)

    tokens = list(range(500, 541))  # 40 bigrams
    n = 40
    slots = env.allocator.alloc(n)
    env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
    for buf in (draft.k_buffer[0], draft.v_buffer[0]):
        buf[slots] = draft_kv(torch.tensor(tokens[:n]))
    env.cache.insert(InsertParams(key=key(tokens), value=slots))
    env.cache.core.flush()
    env.cache.check_hicache_events()
    assert env.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == n
    for buf in (*env.layers(), draft.k_buffer[0], draft.v_buffer[0]):
        buf.zero_()  # the bytes must come from the host
    m = match(env, tokens)
    assert len(m.device_indices) == 0 and m.host_hit_length == n
    loaded, _ = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    read = forward_read(env.kv, env.worker.counter, env.cache.ready_to_load_host_cache())
    want = env.expected_kv(torch.tensor(tokens[:n]), torch.arange(n))
    assert all(torch.equal(buf[loaded], w) for buf, w in zip(read, want, strict=True))
    # The draft model's attention reads its own pool, which waits on the load too.
    assert draft.layer_transfer_counter is not None
    for buf in (draft.get_key_buffer(draft.start_layer), draft.get_value_buffer(draft.start_layer)):
        assert torch.equal(buf[loaded], draft_kv(torch.tensor(tokens[:n])))
    env.cache.check_invariants()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mla", [False, True])
def test_an_mtp_drafts_kv_follows_the_targets_on_0_5_20(make_env, mla: bool, layout: str) -> None:
    """SGLang 0.5.20 hands an MTP / NextN draft's KV pools to the cache in
    ``CacheInitParams.mtp_draft_device_pools`` (its scheduler's ``kv_cache_builder``; there
    is no ``set_draft_kv_pool`` call any more). Backed up, evicted to host and loaded back
    into other device slots, the draft's KV is at the loaded slots, byte for byte, by the
    time the first target layer is reported."""
    needs_sglang_020("0.5.18 registers a draft pool through set_draft_kv_pool (the test above)")
    draft = MTPDraft(4, 512, mla)
    env = make_env(4, size=512, mla=mla, layout=layout, eagle=True, params={"mtp_draft_device_pools": (draft.pool,)})
    controller = env.cache.cache_controller
    assert controller.has_draft and len(controller.companions) == 1

    def loaded_slots(loaded: torch.Tensor, node: object) -> torch.Tensor:  # 0.5.20: the slots loaded into
        assert len(loaded) == 40
        return loaded

    mtp_draft_round_trip(env, draft, loaded_slots)
    settle(env)
    env.cache.check_invariants()
