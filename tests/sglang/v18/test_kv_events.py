"""KV cache events (issue 11): with ``enable_kv_cache_events`` hiradix.sglang emits SGLang
0.5.18's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, with the same block ids,
parents, tokens, block sizes, media and metadata, in the same order, as SGLang's own
``HiRadixCache`` given the same operations (:mod:`twin`): inserts, requests through
``cache_unfinished_req`` / ``cache_finished_req``, matches that split, backups
acknowledged, evictions to the host and out of the tree, loads back, host evictions (also
forced by a full host pool), namespaces with and without ``cache_salt``, and resets.

Block ids are also pinned against SGLang's own ``get_hash_str`` / ``hash_str_to_int64``.
``write_back`` is the one policy whose events are hiradix's own order (a write-back
victim's host copy is stored before its device copy is removed; SGLang reports the
removal first and picks its victims differently): pinned here, not compared.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest
import torch

from tests.sglang.v18.env import NO_KV_EVENTS, SGLANG_020

if SGLANG_020:  # before the imports of 0.5.18's event classes, which 0.5.20 no longer has
    pytest.skip(f"SGLang 0.5.20: {NO_KV_EVENTS}", allow_module_level=True)

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoredWithMetadata,
    StorageMedium,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

from hiradix.sglang.events import salt_seed
from tests.sglang.v18.env import build, build_sglang, patch_sglang_for_parity
from tests.sglang.v18.twin import Twin, run

GPU, CPU = StorageMedium.GPU, StorageMedium.CPU


@pytest.fixture
def twin_of(monkeypatch):
    made: list[Twin] = []

    def make(
        page_size: int = 1,
        *,
        write_policy: str = "write_through",
        eagle: bool = False,
        size: int = 128,
        hicache_ratio: float = 8.0,
        kv_events: bool = True,
    ) -> Twin:
        patch_sglang_for_parity(monkeypatch, hicache_ratio)
        kw = dict(
            size=size * page_size,
            write_policy=write_policy,
            hicache_ratio=hicache_ratio,
            kv_events=kv_events,
            eagle=eagle,
        )
        twin = Twin(build(page_size, **kw), build_sglang(page_size, **kw), eagle=eagle)
        made.append(twin)
        return twin

    yield make
    for twin in made:
        twin.ours.cache.core.close()
        twin.theirs.cache.release_host_resources()


def sglang_id(tokens: list[int], prior: str | None = None) -> tuple[int, str]:
    """SGLang's own block id of one page, and its digest (to chain the next page)."""
    digest = get_hash_str(tokens, prior)
    return hash_str_to_int64(digest), digest


def insert(env, tokens: list[int], **kw) -> int:
    n = len(tokens) // env.page_size * env.page_size
    slots = env.allocator.alloc(n)
    res = env.cache.insert(InsertParams(key=RadixKey(array("q", tokens[:n]), **kw), value=slots))
    if res.prefix_len:
        env.allocator.free(slots[: res.prefix_len])
    return res.prefix_len


def settle(env) -> None:
    env.cache.core.flush()
    env.cache.check_hicache_events()


# ---------------------------------------------------------------------------- pinned cases
def test_events_are_off_by_default_and_start_with_all_blocks_cleared(make_env) -> None:
    env = make_env()
    insert(env, [1, 2, 3])
    assert env.cache.take_events() == [] and env.cache.kv_event_queue == []
    assert env.cache.tree.track_changes is False  # no change log without events
    env = make_env(kv_events=True)
    assert env.cache.take_events() == [AllBlocksCleared()]
    assert env.cache.take_events() == []


def test_an_insert_stores_its_pages_chained_with_sglangs_ids(make_env) -> None:
    env = make_env(2, kv_events=True)
    env.cache.take_events()
    insert(env, [1, 2, 3, 4, 5, 6])
    a, d1 = sglang_id([1, 2])
    b, d2 = sglang_id([3, 4], d1)
    c, _ = sglang_id([5, 6], d2)
    assert env.cache.take_events() == [
        BlockStored(
            block_hashes=[a, b, c],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 5, 6],
            block_size=2,
            lora_id=None,
            medium=GPU,
        )
    ]
    insert(env, [1, 2, 9, 9])  # splits after the first page: only the new leaf is stored
    e, _ = sglang_id([9, 9], d1)
    assert env.cache.take_events() == [
        BlockStored(block_hashes=[e], parent_block_hash=a, token_ids=[9, 9], block_size=2, lora_id=None, medium=GPU)
    ]
    settle(env)  # the backups land: the split node's two parts (one chain), then the new leaf
    assert env.cache.take_events() == [
        BlockStored(
            block_hashes=[a, b, c],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 5, 6],
            block_size=2,
            lora_id=None,
            medium=CPU,
        ),
        BlockStored(block_hashes=[e], parent_block_hash=a, token_ids=[9, 9], block_size=2, lora_id=None, medium=CPU),
    ]


def test_cache_salt_events_carry_metadata_and_a_salted_chain(make_env) -> None:
    env = make_env(kv_events=True)
    env.cache.take_events()
    insert(env, [5, 6], extra_key="lora", cache_salt="tenant")
    seed = hashlib.sha256(b"sglang-cache-salt-v1\0tenant").hexdigest()
    assert salt_seed("tenant") == seed
    x, dx = sglang_id([5], seed)
    y, _ = sglang_id([6], dx)
    (event,) = env.cache.take_events()
    assert isinstance(event, BlockStoredWithMetadata) and event.metadata.cache_salt == "tenant"
    assert event.block_hashes == [x, y] and event.parent_block_hash is None and event.token_ids == [5, 6]
    insert(env, [5, 6], extra_key="lora")  # extra_key alone does not enter the ids
    (plain,) = env.cache.take_events()
    p5, d5 = sglang_id([5])
    assert type(plain) is BlockStored and plain.block_hashes == [p5, sglang_id([6], d5)[0]]


def test_removals_of_one_medium_are_coalesced_and_reset_clears(make_env) -> None:
    env = make_env(kv_events=True)
    for tokens in ([1, 2], [3, 4], [5, 6]):
        insert(env, tokens)
    settle(env)
    env.cache.take_events()
    env.cache.evict(EvictParams(num_tokens=6))
    (removed,) = env.cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == GPU and len(removed.block_hashes) == 6
    env.cache.evict_host(6)
    (removed,) = env.cache.take_events()
    assert removed.medium == CPU and len(removed.block_hashes) == 6
    insert(env, [7, 8])
    env.cache.reset()
    assert [type(e) for e in env.cache.take_events()] == [BlockStored, AllBlocksCleared]


def test_write_back_stores_the_host_copy_before_removing_the_device_copy(make_env) -> None:
    env = make_env(kv_events=True, write_policy="write_back")
    env.cache.take_events()
    insert(env, [1, 2, 3])
    env.cache.take_events()
    assert env.cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 3
    stored, removed = env.cache.take_events()
    assert (stored.medium, removed.medium) == (CPU, GPU) and stored.block_hashes == removed.block_hashes
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3]))))
    assert m.host_hit_length == 3


def test_batched_backups_evict_a_full_host_pool_at_the_step(make_env) -> None:
    """Batched backups (the default) take their host slots at the step's
    ``check_hicache_events``: an insert that needs host room evicts nothing itself
    (SGLang's would, inside the insert), its node stays protected until the step, and
    then the host-only KV is removed before the new node is stored; its copy is the
    inserted KV (loaded back and read per layer)."""
    env = make_env(size=16, hicache_ratio=1.5, kv_events=True)  # 25 host slots (SGLang counts 17 device ones)
    assert env.cache.core.batch_backups and env.cache.token_to_kv_pool_host.size == 25

    def put(tokens: list[int]) -> None:
        slots = env.allocator.alloc(len(tokens))
        env.write_kv(slots, torch.tensor(tokens), torch.arange(len(tokens)))
        assert env.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots)).prefix_len == 0

    a, b = list(range(1, 17)), list(range(101, 113))
    put(a)
    settle(env)
    assert env.cache.evict(EvictParams(num_tokens=16)).num_tokens_evicted == 16  # a: host-only, 16 slots
    env.cache.take_events()
    put(b)  # 12 tokens, 9 host slots free
    assert [(type(e), e.medium) for e in env.cache.take_events()] == [(BlockStored, GPU)]
    assert env.cache.protected_size() == 12 and env.cache.evictable_size() == 0  # waiting for the step
    assert env.cache.evict(EvictParams(num_tokens=12)).num_tokens_evicted == 0
    settle(env)
    removed, stored = env.cache.take_events()
    assert (type(removed), removed.medium, len(removed.block_hashes)) == (BlockRemoved, CPU, 16)
    assert (type(stored), stored.medium, stored.token_ids) == (BlockStored, CPU, b)
    assert env.cache.protected_size() == 0 and env.cache.evictable_size() == 12
    assert env.cache.evict(EvictParams(num_tokens=12)).num_tokens_evicted == 12
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", b))))
    assert m.host_hit_length == 12 and len(m.device_indices) == 0
    got, _ = env.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
    )
    assert len(got) == 12
    env.cache.ready_to_load_host_cache()
    settle(env)
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", b))))
    want = env.expected_kv(torch.tensor(b), torch.arange(12))
    for layer, w in zip(env.layers(), want, strict=True):
        assert torch.equal(layer[m.device_indices.long()], w)


# ---------------------------------------------------------------------------- parity with SGLang
def test_a_scripted_life_cycle_matches_sglang(twin_of) -> None:
    twin = twin_of(2)
    base = list(range(1, 25))
    twin.insert(base)  # BlockStored GPU
    twin.settle()  # BlockStored CPU_PINNED
    twin.insert(base[:8] + [40, 41, 42, 43])  # a split, the new leaf stored, its backup begun
    twin.match(base[:6])  # a split: no event
    twin.settle()
    twin.evict(64)  # everything to the host: one BlockRemoved GPU, in SGLang's victim order
    twin.load_back(base)  # BlockStored GPU for the loaded chain
    twin.evict(64)
    twin.evict_host(64)  # BlockRemoved CPU_PINNED
    twin.insert(base, cache_salt="s")  # a salted chain, with metadata
    twin.request(base + [50, 51, 52], cache_salt="s", chunk=len(base) + 1)
    twin.settle()
    twin.reset()  # AllBlocksCleared
    s = twin.stats
    assert s["loaded tokens"] == 24 and s["BlockRemoved"] >= 3 and s["AllBlocksCleared"] == 2, s
    assert s["BlockStored"] >= 4 and s["BlockStoredWithMetadata"] >= 2, s


def test_an_insert_over_evicted_nodes_stores_nothing_as_sglang(twin_of) -> None:
    """SGLang 0.5.18 records no event when an insert recomputes a node that was evicted
    to the host (it sets the device value and moves on); neither does hiradix."""
    twin = twin_of(1)
    twin.insert(list(range(1, 9)))
    twin.settle()
    twin.evict(8)
    assert twin.insert(list(range(1, 9))) == 0
    assert twin.events("checked") == [] and twin.stats["BlockStored"] == 2


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective"])
def test_random_operations_emit_sglangs_events(twin_of, page_size: int, write_policy: str) -> None:
    twin = twin_of(page_size, write_policy=write_policy)
    s = run(twin, seed=page_size * 10 + len(write_policy), steps=300)
    # every kind of event and operation was compared, not only trivial ones
    for kind in ("BlockStored", "BlockStoredWithMetadata", "BlockRemoved", "AllBlocksCleared"):
        assert s[kind] > 0, s
    assert s["requests"] > 10 and s["chunks"] > 3 and s["hit tokens"] > 0 and s["host hit tokens"] > 0, s


def test_a_full_host_pool_evicts_at_the_same_steps_as_sglang(twin_of, monkeypatch) -> None:
    """Host KV evicted to make room for new nodes' backups, the host pool barely larger
    than the device pool. (Not with chunked requests: their nodes are backed up only by a
    later insert through them, which SGLang does mid-walk, evicting host KV before it
    stores the insert's new node, and hiradix after the insert, for all its backups at
    once, agreed across ranks; then the CPU removals come in another order.) With each
    insert's backups started in the insert (``HIRADIX_BATCH_BACKUPS=0``): batched, they
    start at the step, and so do the host evictions they need
    (:func:`test_batched_backups_evict_a_full_host_pool_at_the_step`)."""
    monkeypatch.setenv("HIRADIX_BATCH_BACKUPS", "0")
    twin = twin_of(1, hicache_ratio=1.1)
    s = run(twin, seed=11, steps=300, chunks=False)
    assert s["host evictions for backups"] > 3 and s["requests"] > 10, s
