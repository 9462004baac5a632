"""KV cache events (issue 11) on SGLang 0.5.20: with ``enable_kv_cache_events`` hiradix's
cache emits the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events of 0.5.20's
own ``UnifiedRadixCache`` (what its ``create_tree_cache`` builds for
``--enable-hierarchical-cache``; its ``KVCacheEventRecorder`` runs on CPU): the same block
ids (as hashed: 0.5.20 namespaces none), parents, tokens, media, ``cache_salt`` /
``session_id`` fields (no ``lora_name``) and coalescing, in the same order, given the same
operations (``tests.sglang.unified_events.Twin``, shared with the 0.5.23 tests): inserts,
matches that split, backups acknowledged, evictions to the host, an insert over evicted
nodes, loads back, host evictions and resets, with and without EAGLE bigram keys, on both
of 0.5.20's tree cores (its default Python one and the Rust one); then requests through
0.5.20's ``cache_unfinished_req`` / ``cache_finished_req``, whose stores name their
session. An L3 prefetch's events are pinned (SGLang's own L3 path is not run beside it).
The ids are also pinned against SGLang's own ``get_hash_str`` / ``hash_str_to_int64``.

Runs in ``.venv-sglang20`` (CI); skips elsewhere, saying why.
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang.v18.env import SGLANG_020

if not SGLANG_020:  # before the imports of 0.5.20's UnifiedRadixCache helpers
    pytest.skip(
        "needs SGLang 0.5.20 (CI: .venv-sglang20): 0.5.18's events are test_sglang_kv_events.py's, "
        "0.5.23's tests/sglang/v23's",
        allow_module_level=True,
    )

from collections.abc import Iterator
from typing import Any

from sglang.srt.disaggregation.kv_events import BlockStored
from sglang.srt.managers.schedule_batch import FINISH_LENGTH

from tests.sglang.unified_env import patch_sglang_for_cpu
from tests.sglang.unified_events import (
    Twin,
    ids_and_fields,
    l3_prefetch_events,
    life_cycle,
    namespaces_and_sessions,
    random_operations,
    served_twice,
    tree_core,
)

__all__ = ["tree_core"]  # the fixture, imported for this module's tests


@pytest.fixture(autouse=True)
def unified_cpu() -> Iterator[None]:
    """SGLang 0.5.20's caches run on CPU for the test (``patch_sglang_for_cpu`` of
    :mod:`tests.sglang.unified_env`); the caches built meanwhile are shut down at teardown."""
    with patch_sglang_for_cpu():
        yield


# ---------------------------------------------------------------------------- pinned ids
def test_the_format_is_0_5_20s() -> None:
    """0.5.20's ``BlockStored``: ``cache_salt`` and ``session_id``, no ``lora_name`` (0.5.23),
    no ``BlockStoredWithMetadata`` (0.5.18)."""
    import sglang.srt.disaggregation.kv_events as kv_events

    from hiradix.sglang.events import _Format20, event_format

    assert {"cache_salt", "session_id"} <= set(BlockStored.__struct_fields__)
    assert "lora_name" not in BlockStored.__struct_fields__
    assert not hasattr(kv_events, "BlockStoredWithMetadata") and not hasattr(kv_events, "namespaced_block_hash")
    assert type(event_format(None)) is _Format20


def test_ids_and_fields_match_sglangs_hash_helpers() -> None:
    # extra_key does not enter the ids: 0.5.20 has no namespaces
    ids_and_fields(
        [
            (extra_key, salt, None, {})
            for extra_key, salt in ((None, None), (None, "tenant"), ("plain", None), ("plain", "tenant"))
        ],
        strict=True,
    )


# ---------------------------------------------------------------------------- parity with SGLang
@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_scripted_life_cycle_matches_sglang(tree_core: str, page_size: int, eagle: bool) -> None:
    """Also with EAGLE bigram keys (ids of interleaved pairs, ``(a, b)`` token ids)."""
    life_cycle(Twin(page_size, eagle=eagle), page_size, eagle)


def test_namespaces_and_sessions_match_sglang(tree_core: str) -> None:
    """One prompt in four namespaces: the same ids in each but the salted ones, each
    namespace's stores apart, removals of one medium coalesced across them."""
    namespaces_and_sessions(
        Twin(2), [(None, None), ("plain", None), ("plain", "tenant"), (None, "tenant")], coalesced=True
    )


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 2])
def test_random_operations_emit_sglangs_events(tree_core: str, page_size: int, write_policy: str) -> None:
    """A seeded random mix of the operations above on prompts that share prefixes, in
    three namespaces, compared step by step."""
    twin = Twin(page_size, size=1024, write_policy=write_policy)
    random_operations(
        twin, seed=20 + page_size + len(write_policy), spaces=[{}, {"cache_salt": "tenant"}, {"extra_key": "plain"}]
    )


# ---------------------------------------------------------------------------- L3
def test_an_l3_prefetch_stores_on_the_host_then_the_load_on_the_device() -> None:
    """A salted prefix prefetched from L3: stored ``CPU_PINNED`` as it lands, ``GPU`` when
    loaded back, with the ids of SGLang's helpers (no namespace), the salt, no session."""
    l3_prefetch_events()


# ---------------------------------------------------------------------------- requests
@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_cached_unfinished_then_finished_match_sglang(tree_core: str, page_size: int) -> None:
    """Requests as 0.5.20's scheduler runs them: a match, a ``req_to_token`` row, a chunk
    cached by ``cache_unfinished_req``, then ``cache_finished_req``; salted and with a
    session, which their stores name; then a second request over the first."""

    def serve(env: Any, tokens: list[int], session_id: str) -> int:
        cache = env.cache
        req = env.new_req(tokens, cache_salt="tenant")
        req.session_id = session_id
        assert env.req_to_token.alloc([req]) is not None
        req.init_next_round_input(cache)  # SGLang's own match call
        cache.inc_lock_ref(req.last_node)
        prefix = len(req.prefix_indices)
        need = -(-(len(tokens) - prefix) // page_size) * page_size  # whole pages
        slots = env.allocator.alloc(need)[: len(tokens) - prefix]
        row = req.kv.req_pool_idx
        env.req_to_token.write((row, slice(0, prefix)), req.prefix_indices.to(torch.int32))
        env.req_to_token.write((row, slice(prefix, len(tokens))), slots.to(torch.int32))
        env.write_kv(slots, torch.tensor(tokens[prefix:]), torch.arange(prefix, len(tokens)))
        req.set_extend_range(0, len(tokens) - 1)  # a chunk short of the prompt's end
        cache.cache_unfinished_req(req, chunked=True)
        req.finished_reason = FINISH_LENGTH(length=0)
        cache.cache_finished_req(req, kv_len_to_handle=len(tokens))
        env.req_to_token.free(req)
        return prefix

    served_twice(Twin(page_size), page_size, serve)
