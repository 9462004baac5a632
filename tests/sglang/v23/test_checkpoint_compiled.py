"""0.5.23's ``checkpoint`` in C (``Inserter.checkpoint`` in ``hiradix.sglang._insert``,
called by ``HiRadixCache._compiled_checkpoint``) leaves the cache, the requests' rows and
SGLang's allocator exactly as the Python path does: two caches driven in lockstep by the
randomized scheduler loop of ``test_scheduler_loop.py`` (the same seed, so the same
requests, chunks, finishes, aborts, evictions and flushes), one of them with the compiled
path switched off, compared after every step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sglang import insert_parity
from tests.sglang.unified_env import build_hiradix
from tests.sglang.v23.test_scheduler_loop import Loop
from tests.support import tree_snapshot

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        insert_parity.COMPILED is None, reason="hiradix.sglang._insert is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


class Counting:
    """The compiled inserter, its ``checkpoint`` results recorded."""

    def __init__(self, inserter: Any) -> None:
        self._real = inserter.checkpoint
        self.results: list[tuple[int, int, Any]] = []

    def checkpoint(self, *args: Any) -> tuple[int, int, Any]:
        out = self._real(*args)
        self.results.append(out)
        return out


def _state(loop: Loop) -> tuple:
    env, cache = loop.env, loop.cache
    spaces = sorted(cache._namespaces)
    rows = [
        env.req_to_token.req_to_token[req.kv.req_pool_idx, : int(req.kv.kv_allocated_len)].tolist()
        for req, _, _ in loop.running
    ]
    locks = [(int(req.kv.cache_protected_len), req.last_node.id) for req, _, _ in loop.running]
    return (
        tree_snapshot(cache.tree, spaces),
        rows,
        locks,
        cache.evictable_size(),
        cache.protected_size(),
        env.allocator.available_size(),
        loop.stats,
    )


@pytest.mark.parametrize(("page_size", "seed"), [(1, 21), (4, 22)])
def test_compiled_checkpoint_is_the_python_checkpoint(page_size: int, seed: int) -> None:
    loops = [Loop(build_hiradix(page_size, size=256), seed) for _ in range(2)]
    compiled, python = loops
    assert compiled.cache._inserter is not None, "the compiled inserter is not installed"
    python.cache._inserter = None  # the Python path serves this one
    counting = compiled.cache._inserter = Counting(compiled.cache._inserter)
    for step in range(200):
        for loop in loops:
            loop.step()
        a, b = _state(compiled), _state(python)
        assert a == b, f"step {step}: the compiled checkpoint left another state"
    for loop in loops:
        loop.drain()
    assert _state(compiled) == _state(python)
    s = compiled.stats
    assert len(counting.results) > 30 and s["finished"] > 20 and s["reused"] > 200, (len(counting.results), s)


def _admit(loop: Loop, tokens: list[int], computed: int) -> object:
    """A request matched, locked and given a row holding fresh slots for what it computes
    (``[prefix, computed)``), as the scheduler's prefill admits it."""
    env, cache = loop.env, loop.cache
    req = env.new_req(tokens)
    req.init_next_round_input(cache)
    req.lock = cache.lock(req.last_node)
    prefix = req.prefix_len
    assert env.req_to_token.alloc([req]) is not None
    ps = env.page_size
    fresh = loop.alloc(-(-(computed - prefix) // ps) * ps)
    row = req.kv.req_pool_idx
    env.req_to_token.write((row, slice(0, prefix)), cache.prefix_device_indices(req).to(torch.int32))
    env.req_to_token.write((row, slice(prefix, computed)), fresh[: computed - prefix].to(torch.int32))
    req.kv.kv_allocated_len = req.extend_end = computed
    loop.running.append((req, prefix, computed))
    return req


@pytest.mark.parametrize("page_size", [1, 4])
def test_duplicates_are_freed_and_the_row_points_at_the_trees_slots(page_size: int) -> None:
    """Two requests that computed the same prompt side by side (neither found it cached):
    the second one's checkpoint frees its own copies of what the first one put in the
    tree and points its row at the tree's slots, in C as in Python."""
    loops = [Loop(build_hiradix(page_size, size=256), 5) for _ in range(2)]
    loops[1].cache._inserter = None
    counting = loops[0].cache._inserter = Counting(loops[0].cache._inserter)
    prompt = list(range(100, 100 + 12 * page_size))
    for loop in loops:
        first, second = _admit(loop, prompt, len(prompt)), _admit(loop, prompt + [7] * page_size, len(prompt))
        free_before = loop.env.allocator.available_size()
        for req in (first, second):
            loop.cache.checkpoint(req, up_to=len(prompt))
        # the second request's copies of the prompt (whole pages) went back to the allocator
        assert loop.env.allocator.available_size() - free_before == len(prompt)
        rows = loop.env.req_to_token.req_to_token
        assert torch.equal(rows[first.kv.req_pool_idx, : len(prompt)], rows[second.kv.req_pool_idx, : len(prompt)])
    assert _state(loops[0]) == _state(loops[1])
    assert len(counting.results) == 2 and counting.results[1][2] is not None  # C served both, with duplicates


def test_a_request_with_a_namespace_takes_the_python_path() -> None:
    env = build_hiradix(1, size=64)
    loop = Loop(env, 3)
    counting = env.cache._inserter = Counting(env.cache._inserter)
    req = env.new_req(list(range(1, 9)), extra_key="lora-a")
    req.init_next_round_input(env.cache)
    req.lock = env.cache.lock(req.last_node)
    assert env.req_to_token.alloc([req]) is not None
    slots = loop.alloc(8)
    env.req_to_token.write((req.kv.req_pool_idx, slice(0, 8)), slots.to(torch.int32))
    req.kv.kv_allocated_len = req.extend_end = 8
    env.cache.checkpoint(req, up_to=8)
    assert not counting.results and int(req.kv.cache_protected_len) == 8  # served, by the Python path
