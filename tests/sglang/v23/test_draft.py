"""Speculative decoding's draft KV on SGLang 0.5.23 (issue 11).

0.5.23's scheduler hands an MTP / NextN draft's KV pools to the cache in
``CacheInitParams.mtp_draft_device_pools`` (its own ``UnifiedRadixCache`` packs them into
the target's host pages as extra layers); hiradix's cache moves them at the target's slots
on every backup and load, before the layer-done counter reports a target layer. A separate
draft model's pool (``sidecar_draft_device_pools``), which SGLang registers only with its
own ``UnifiedRadixCache``, and MTP draft Mamba state are refused, naming the field. Built
through SGLang's ``create_tree_cache`` with the fields set as 0.5.23's ``kv_cache_builder``
sets them.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

from tests.sglang.pools import LAYERS, MTPDraft, insert, match, mtp_draft_round_trip, only_in_l3, settle
from tests.sglang.unified_env import build_hiradix

pytestmark = pytest.mark.usefixtures("sglang_cpu")

PAGE = 4
SIZE = 512


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mla", [False, True])
def test_an_mtp_drafts_kv_follows_the_targets_through_host_and_back(mla: bool, layout: str) -> None:
    """Backed up, evicted to host and loaded back into other device slots: the draft's KV is
    at the loaded slots, byte for byte, by the time the first target layer is reported."""
    draft = MTPDraft(PAGE, SIZE, mla)
    env = build_hiradix(
        PAGE, size=SIZE, mla=mla, layout=layout, eagle=True, params={"mtp_draft_device_pools": (draft.pool,)}
    )
    controller = env.cache.cache_controller
    assert controller.has_draft and len(controller.companions) == 1
    dev = controller.companions[0][0]
    assert (dev.kv_buffer(0) if mla else dev.k_buffer(0)).data_ptr() == draft.buffers()[0].data_ptr()  # in place

    def loaded_slots(loaded: int, node: object) -> torch.Tensor:  # 0.5.23: the count loaded, the node
        assert loaded == 40
        return env.cache.path_device_indices(node)

    consumer = mtp_draft_round_trip(env, draft, loaded_slots)
    assert env.cache.is_load_back_event_done(consumer)
    settle(env)
    env.cache.check_invariants()


def test_l3_carries_the_targets_kv_with_a_draft_and_says_the_draft_is_not_stored(caplog) -> None:
    """With an L3, a draft changes nothing for the target's pages (written, read back into
    a reset cache, loaded to the device byte for byte), and start-up logs that the draft's
    KV of pages loaded from L3 is stale (SGLang 0.5.23's packed pages carry it)."""
    draft = MTPDraft(PAGE, SIZE, False)
    with caplog.at_level("WARNING", logger="hiradix.sglang.cache"):
        env = build_hiradix(
            PAGE,
            size=SIZE,
            storage="memory",
            extra_config='{"prefetch_threshold": 8}',
            params={"mtp_draft_device_pools": (draft.pool,)},
        )
    assert any("stores the target's KV only" in r.getMessage() for r in caplog.records)
    cache = env.cache
    tokens = list(range(200, 232))
    insert(env, tokens)
    only_in_l3(env)
    req = env.new_req(tokens)
    req.init_next_round_input(cache)
    handle = req.cache_request_handle
    assert cache.prefetch_from_storage(handle, req.last_host_node, array("q", tokens))
    cache.core.storage.wait_prefetch(handle, timeout=30)
    assert cache.check_prefetch_progress(handle)
    assert cache.pop_prefetch_loaded_span(handle) == (32, None)
    m = match(env, tokens)
    loaded, node = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=32))
    assert loaded == 32
    counter = cache.cache_controller.layer_done_counter
    counter.set_consumer(cache.ready_to_load_host_cache())
    counter.wait_until(LAYERS - 1)
    slots = cache.path_device_indices(node)
    for buf, w in zip(env.layers(), env.expected_kv(torch.tensor(tokens), torch.arange(32)), strict=True):
        assert torch.equal(buf[slots], w)
    settle(env)
    cache.check_invariants()


def test_hicache_size_counts_the_drafts_host_bytes() -> None:
    """As 0.5.23's packed host pages: with a draft, a ``--hicache-size`` budget holds fewer
    slots (target 3 layers x K,V x 2 heads x 4 x fp32 = 192 B a slot, draft 64 B)."""
    budget = 256 * 2048  # bytes: 2048 slots of target + draft
    draft = MTPDraft(PAGE, SIZE, False)
    env = build_hiradix(PAGE, size=SIZE, hicache_size=budget / 1e9, params={"mtp_draft_device_pools": (draft.pool,)})
    assert env.cache.cache_controller.mem_pool_host.size == (2048 // PAGE + 1) * PAGE
    assert env.cache.cache_controller.companions[0][1].size == (2048 // PAGE + 1) * PAGE
    alone = build_hiradix(PAGE, size=SIZE, hicache_size=budget / 1e9)
    assert alone.cache.cache_controller.mem_pool_host.size == (budget // 192 // PAGE + 1) * PAGE


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (lambda: {"mtp_draft_device_pools": (object(),)}, r"mtp_draft_device_pools\[0\] \(object\) is not supported"),
        # fewer slots than the target's allocator hands out
        (
            lambda: {"mtp_draft_device_pools": (MTPDraft(PAGE, SIZE // 2, False).pool,)},
            r"mtp_draft_device_pools\[0\] \(MHATokenToKVPool\) cannot follow the target's KV: .*fewer",
        ),
        (
            lambda: {"mtp_draft_device_pools": (MTPDraft(2, SIZE, False).pool,)},
            r"mtp_draft_device_pools\[0\].*page size",
        ),
        (lambda: {"sidecar_draft_device_pools": (MTPDraft(PAGE, SIZE, False).pool,)}, "sidecar_draft_device_pools"),
        (lambda: {"mtp_draft_mamba_pools": (object(),)}, "mtp_draft_mamba_pools"),
    ],
)
def test_draft_pools_hiradix_cannot_follow_are_startup_errors_naming_the_field(params, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_hiradix(PAGE, size=SIZE, params=params())
