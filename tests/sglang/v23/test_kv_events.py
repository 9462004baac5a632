"""KV cache events (issue 11) on SGLang 0.5.23: with ``enable_kv_cache_events`` hiradix's
cache emits the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events of 0.5.23's
own ``UnifiedRadixCache`` (whose ``KVCacheEventRecorder`` runs on CPU): the same block ids
(namespaced by a LoRA adapter's ``extra_key``, or with ``format: dynamo`` by ``extra_key``
and ``cache_salt``), parents, tokens, media, ``cache_salt`` / ``session_id`` /
``lora_name`` fields and coalescing, in the same order, given the same operations
(``tests.sglang.unified_events.Twin``): inserts, matches that split, backups acknowledged, evictions to the host,
an insert over evicted nodes, loads back, host evictions and resets, with and without
EAGLE bigram keys, on both of SGLang's tree cores (its default Rust one and the Python
one). An L3 prefetch's events are pinned (SGLang's own L3 path is not run beside it).

The ids are also pinned against SGLang's own hash helpers (``get_hash_str``,
``hash_str_to_int64``, ``kv_event_namespace_seed``, ``namespaced_block_hash``).
"""

from __future__ import annotations

from typing import Any

import pytest
from sglang.srt.disaggregation.kv_events import kv_event_namespace_seed
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.events import KvEventLoraNames

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
from tests.sglang.v23.test_cache import admit

pytestmark = pytest.mark.usefixtures("sglang_cpu")
__all__ = ["tree_core"]  # the fixture, imported for this module's tests

LORA_ID = "0123456789abcdef0123456789abcdef"  # a LoRARef.lora_id: 32 hex characters
LORA_KEY = "adapter-prefix" + LORA_ID  # Req puts the adapter's id at the end of extra_key


def lora_names() -> KvEventLoraNames:
    """The scheduler's table, after admitting a request of adapter ``sql-lora``."""
    names = KvEventLoraNames()
    names.register(lora_id=LORA_ID, lora_name="sql-lora")

    class _Req:
        lora_id, extra_key = LORA_ID, LORA_KEY

    names.register(_Req(), "sql-lora")
    return names


# ---------------------------------------------------------------------------- pinned ids
@pytest.mark.parametrize("dynamo", [False, True])
def test_ids_and_fields_match_sglangs_hash_helpers(dynamo: bool) -> None:
    cases = [  # (extra_key, cache_salt, namespace seed of the ids, lora_name)
        (None, None, None, None),
        (None, "tenant", kv_event_namespace_seed(extra_key=None, cache_salt="tenant") if dynamo else None, None),
        ("plain", None, kv_event_namespace_seed(extra_key="plain", cache_salt=None) if dynamo else None, None),
        (
            LORA_KEY,
            "tenant",
            kv_event_namespace_seed(extra_key=LORA_KEY, cache_salt="tenant" if dynamo else None),
            "sql-lora",
        ),
    ]
    ids_and_fields(
        [(extra_key, salt, seed, {"lora_name": lora_name}) for extra_key, salt, seed, lora_name in cases],
        dynamo_kv_event_format=dynamo,
        kv_event_lora_names=lora_names(),
    )


# ---------------------------------------------------------------------------- parity with SGLang
@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_scripted_life_cycle_matches_sglang(tree_core: str, page_size: int, eagle: bool) -> None:
    """Also with EAGLE bigram keys (ids of interleaved pairs, ``(a, b)`` token ids)."""
    life_cycle(Twin(page_size, eagle=eagle), page_size, eagle)


@pytest.mark.parametrize("dynamo", [False, True])
def test_namespaces_lora_names_and_sessions_match_sglang(tree_core: str, dynamo: bool) -> None:
    namespaces_and_sessions(
        Twin(2, dynamo_kv_event_format=dynamo, kv_event_lora_names=lora_names()),
        [(None, None), (LORA_KEY, None), ("plain", "tenant"), (LORA_KEY, "tenant")],
    )


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 2])
def test_random_operations_emit_sglangs_events(tree_core: str, page_size: int, write_policy: str) -> None:
    """A seeded random mix of the operations above on prompts that share prefixes, in
    three namespaces, compared step by step."""
    twin = Twin(page_size, size=1024, write_policy=write_policy, kv_event_lora_names=lora_names())
    random_operations(
        twin, seed=23 + page_size + len(write_policy), spaces=[{}, {"cache_salt": "tenant"}, {"extra_key": LORA_KEY}]
    )


# ---------------------------------------------------------------------------- L3
def test_an_l3_prefetch_stores_on_the_host_then_the_load_on_the_device() -> None:
    """A prefix prefetched from L3 into a salted namespace (``format: dynamo``): the pages
    that land are stored ``CPU_PINNED``, the load back stores them on the ``GPU``, with
    the ids SGLang's helpers give, the salt and no session."""
    l3_prefetch_events(
        seed=kv_event_namespace_seed(extra_key=None, cache_salt="tenant"),
        fields={"lora_name": None},
        dynamo_kv_event_format=True,
    )


# ---------------------------------------------------------------------------- requests
@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_checkpointed_and_released_match_sglang(tree_core: str, page_size: int) -> None:
    """Requests as 0.5.23's scheduler runs them (``admit``: match, load back, lock, row;
    ``checkpoint_kv_cache`` of a chunk; ``release_kv_cache`` at the finish), salted and
    with a session, their stores naming it; then a second request over the first."""

    def serve(env: Any, tokens: list[int], session_id: str | None) -> int:
        req = env.new_req(tokens, cache_salt="tenant")
        req.session_id = session_id
        prefix = admit(env, req)
        req.extend_end = len(tokens) - 1  # a chunk short of the prompt's end
        checkpoint_kv_cache(req, env.cache)
        req.extend_end = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, env.cache, checkpoint=True)
        return prefix

    served_twice(Twin(page_size), page_size, serve)
