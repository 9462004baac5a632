"""A long randomized scheduler loop driving hiradix.sglang on SGLang 0.5.23 with SGLang's own
caller code: real ``Req`` objects matched through ``Req.init_next_round_input`` (0.5.23's
``match_kv_cache``), L3 prefetches issued and collected as the scheduler's
``_prefetch_kvcache`` / ``get_new_batch_prefill`` do (by ``CacheRequestHandle``), host hits
loaded back with ``InitLoadBackParams``, matches held by ``TreeLock`` (``lock`` /
``unlock``), rows filled from ``prefix_device_indices``, slots from SGLang's allocator
(evicting through ``evict_from_tree_cache`` when short), chunked prefill through
``checkpoint_kv_cache``, decode, finish and abort through ``release_kv_cache`` (after
``finish(handle, ABORT)`` for an abort), waiting requests touched with
``touch_waiting_prefix``, and flushes (``reset``) when idle.

After every step: the bytes of every reused prefix are read back per layer from SGLang's KV
buffers (after the layer-done counter's ``wait_until``, as the attention backends do) and
compared with the KV the prefix was computed with; the tree's invariants hold; and slots are
conserved on SGLang's allocator: free + cached in the tree + held by running requests == size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, EvictParams, InitLoadBackParams
from sglang.srt.mem_cache.common import (
    checkpoint_kv_cache,
    evict_from_tree_cache,
    release_kv_cache,
    touch_waiting_prefix,
)

from tests.sglang.pools import MTPDraft, forward_read
from tests.sglang.unified_env import Env, build_hiradix

pytestmark = pytest.mark.usefixtures("sglang_cpu")

TIMEOUT = 60.0  # seconds; a prefetch ends on its signal in milliseconds


class Loop:
    def __init__(self, env: Env, seed: int, draft: MTPDraft | None = None) -> None:
        self.env = env
        self.draft = draft  # an MTP draft's KV pool, computed and checked with the target's
        self.cache = env.cache
        self.rng = np.random.default_rng(seed)
        ps = env.page_size
        self.prompts = [self.rng.integers(0, 30_000, int(self.rng.integers(2, 10)) * ps * 3).tolist() for _ in range(8)]
        self.running: list = []  # (req, prefix computed, end of this round)
        self.stats = {
            "steps": 0,
            "finished": 0,
            "aborted": 0,
            "reused": 0,
            "loaded": 0,
            "verified": 0,
            "flushes": 0,
            "l3_loaded": 0,
        }

    # ---------------------------------------------------------------- helpers
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots (whole pages) from SGLang's allocator, evicting as
        ``alloc_token_slots`` does; ``None`` when even eviction leaves too few."""
        evict_from_tree_cache(self.cache, n)
        return self.env.allocator.alloc(n) if n <= self.env.allocator.available_size() else None

    def held(self, req) -> int:
        """Slots the request owns outside the tree: whole pages (the allocator's unit)
        past its page-aligned, tree-owned prefix."""
        ps = self.env.page_size
        return -(-int(req.kv.kv_allocated_len) // ps) * ps - int(req.kv.cache_protected_len)

    def verify(self, req, upto: int, read: list[torch.Tensor] | None = None) -> None:
        """The request's first ``upto`` tokens' KV is what was computed for them, in the
        buffers as the forward pass read them (``read``; default the pool's own)."""
        env = self.env
        tokens = torch.tensor(list(req.full_untruncated_fill_ids[:upto]))
        slots = env.req_to_token.req_to_token[req.kv.req_pool_idx, :upto].long()
        want = env.expected_kv(tokens, torch.arange(upto))
        for buf, w in zip(env.layers() if read is None else read, want, strict=True):
            assert torch.equal(buf[slots], w), f"request {req.rid}: reused KV differs"
        if self.draft is not None:
            assert self.draft.holds(slots, tokens), f"request {req.rid}: the draft's reused KV differs"
        self.stats["verified"] += upto

    # ---------------------------------------------------------------- scheduler actions
    def prefetch(self, req) -> None:
        """The scheduler's ``_prefetch_kvcache`` at arrival, then its collection at
        admission (``check_prefetch_progress``, ``pop_prefetch_loaded_span``)."""
        cache = self.cache
        req.init_next_round_input(cache)
        anchor = req.last_host_node
        if not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            return
        matched = req.prefix_len + req.host_hit_length
        end = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
        handle = req.cache_request_handle
        started = cache.prefetch_from_storage(
            handle,
            anchor,
            req.full_untruncated_fill_ids[matched:end],
            cache.get_last_hash_value(anchor),
            cache.get_prefix_hash_values(anchor) if cache.hicache_storage_pass_prefix_keys else None,
            matched_prefix_tokens=req.full_untruncated_fill_ids[:matched],
            extra_key=req.extra_key,
            cache_salt=req.cache_salt,
            storage_hit_end=None,
        )
        if started:
            assert cache.core.storage.wait_prefetch(handle, timeout=TIMEOUT)
        assert cache.check_prefetch_progress(handle)
        loaded, _ = cache.pop_prefetch_loaded_span(handle)
        self.stats["l3_loaded"] += loaded

    def admit(self) -> None:
        env, cache, rng, ps = self.env, self.cache, self.rng, self.env.page_size
        base = self.prompts[int(rng.integers(len(self.prompts)))]
        cut = int(rng.integers(ps, len(base) + 1))
        tokens = base[:cut] + rng.integers(0, 30_000, int(rng.integers(1, 3 * ps + 2))).tolist()
        extra_key = "lora-a" if rng.random() < 0.15 else None
        req = env.new_req(tokens, extra_key=extra_key)
        if cache.enable_storage:
            self.prefetch(req)
        req.init_next_round_input(cache)  # SGLang's own match call
        if req.host_hit_length > 0:
            promised = req.host_hit_length
            loaded, req.last_node = cache.init_load_back(
                InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=promised, req=req)
            )
            assert loaded in (0, promised), "0.5.23 takes all of a host hit or none"
            req.prefix_len += loaded
            if cache.load_back_is_cache_owned():
                req.kv.cache_protected_len = req.prefix_len
            self.stats["loaded"] += loaded
        req.lock = cache.lock(req.last_node)
        prefix = req.prefix_len
        # chunked prefill: compute up to `end` now, the rest in a later step
        end = len(tokens) if rng.random() < 0.6 else max(prefix + 1, (prefix + len(tokens)) // 2)
        n = end - prefix
        slots = self.alloc(-(-n // ps) * ps)
        if slots is None:
            cache.unlock(req.lock)
            req.lock = None
            cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
            return
        prefix_slots = cache.prefix_device_indices(req)  # what alloc_for_extend writes
        assert env.req_to_token.alloc([req]) is not None
        row = req.kv.req_pool_idx
        env.req_to_token.write((row, slice(0, prefix)), prefix_slots.to(torch.int32))
        env.req_to_token.write((row, slice(prefix, end)), slots[:n].to(torch.int32))
        req.kv.kv_allocated_len = end
        req.extend_end = end
        self.stats["reused"] += prefix
        self.running.append((req, prefix, end))

    def forward(self, consumer: int) -> None:
        """The model's forward pass as SGLang runs it: the TP worker sets the step's
        consumer index, and attention reads each layer through SGLang's KV pool, which
        waits for that layer of the step's load (:func:`forward_read`)."""
        read = forward_read(self.env.kv, self.env.worker.counter, consumer)
        for req, prefix, end in self.running:
            if prefix:
                self.verify(req, prefix, read)  # the reused prefix, device or loaded back
            tokens = torch.tensor(list(req.full_untruncated_fill_ids[prefix:end]))
            slots = self.env.req_to_token.req_to_token[req.kv.req_pool_idx, prefix:end].long()
            self.env.write_kv(slots, tokens, torch.arange(prefix, end))
            if self.draft is not None:
                self.draft.write(slots, tokens)
            req.kv.kv_committed_len = end
        self.running = [(req, end, end) for req, _, end in self.running]

    def progress(self) -> None:
        rng = self.rng
        keep = []
        for req, _, end in self.running:
            total = len(req.full_untruncated_fill_ids)
            roll = rng.random()
            if end < total:  # the next chunk: publish what is computed, move the lock
                checkpoint_kv_cache(req, self.cache)
                nxt = min(total, end + int(rng.integers(1, 2 * self.env.page_size + 2)))
                if not self.alloc_tail(req, nxt):
                    self.abort(req)
                    continue
                req.extend_end = nxt
                keep.append((req, end, nxt))
            elif roll < 0.15:
                self.abort(req)
            elif roll < 0.55:
                self.finish(req)
            else:  # decode one token
                req.output_ids.append(int(rng.integers(0, 30_000)))
                req.refresh_fill_ids()
                if not self.alloc_tail(req, end + 1):
                    req.output_ids.pop()
                    req.refresh_fill_ids()
                    self.finish(req)
                    continue
                keep.append((req, end, end + 1))
        self.running = keep

    def alloc_tail(self, req, upto: int) -> bool:
        """Slots for positions [kv_allocated_len, upto): the tail page's free rows first."""
        env, ps = self.env, self.env.page_size
        have = int(req.kv.kv_allocated_len)
        if upto <= have:
            return True
        row = req.kv.req_pool_idx
        last = int(env.req_to_token.req_to_token[row, have - 1]) if have else -1
        n_inplace = min((ps - have % ps) % ps, upto - have)
        inplace = torch.arange(last + 1, last + 1 + n_inplace)
        rest = upto - have - n_inplace
        fresh = self.alloc(-(-rest // ps) * ps) if rest else torch.empty(0, dtype=torch.int64)
        if fresh is None:
            return False
        slots = torch.cat([inplace, fresh[:rest].long()])  # the rest of the last fresh page stays the request's
        env.req_to_token.write((row, slice(have, upto)), slots.to(torch.int32))
        req.kv.kv_allocated_len = upto
        return True

    def finish(self, req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.stats["finished"] += 1

    def abort(self, req) -> None:
        self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        release_kv_cache(req, self.cache, checkpoint=False)
        self.stats["aborted"] += 1

    def step(self) -> None:
        env, cache, rng = self.env, self.cache, self.rng
        if rng.random() < 0.2:  # a request still waiting keeps its prefix warm
            base = self.prompts[int(rng.integers(len(self.prompts)))]
            touch_waiting_prefix(env.new_req(base), cache)
        for _ in range(int(rng.integers(0, 3))):
            self.admit()
        consumer = cache.ready_to_load_host_cache()
        self.forward(consumer)
        self.progress()
        if rng.random() < 0.1:
            cache.evict(EvictParams(num_tokens=int(rng.integers(1, 64))))
        cache.flush_pending_backups()
        cache.check_hicache_events()
        if self.stats["steps"] % 60 == 59:  # an idle moment at least every 60 steps
            self.quiesce()
        if not self.running and rng.random() < 0.3:
            self.flush()
        self.stats["steps"] += 1
        cache.check_invariants(sum(self.held(req) for req, _, _ in self.running))

    def quiesce(self) -> None:
        """Compute what each running request has allocated, then finish them all."""
        self.forward(self.cache.ready_to_load_host_cache())
        for req, _, _ in self.running:
            self.finish(req)
        self.running = []

    def flush(self) -> None:
        """The scheduler's flush_cache sequence (only ever run when idle)."""
        self.cache.reset()
        self.env.req_to_token.clear()
        self.env.allocator.clear()
        self.stats["flushes"] += 1

    def drain(self) -> None:
        self.quiesce()
        self.cache.core.flush()
        self.cache.check_hicache_events()
        self.cache.check_invariants()


@pytest.mark.parametrize(
    ("page_size", "layout", "write_policy", "mla", "seed", "eagle", "storage"),
    [
        (1, "layer_first", "write_through", False, 1, False, None),
        (4, "page_first", "write_through_selective", False, 2, False, None),
        (4, "page_first_direct", "write_back", False, 3, False, None),
        (2, "layer_first", "write_through", True, 4, False, None),
        # L3: flushes empty device and host, later requests prefetch their pages back
        (4, "layer_first", "write_through", False, 5, False, "memory"),
        # EAGLE bigram keys: a reused prefix of n bigrams is the KV of the first n tokens
        (1, "layer_first", "write_through", False, 6, True, None),
    ],
)
def test_randomized_scheduler_loop(page_size, layout, write_policy, mla, seed, eagle, storage) -> None:
    env = build_hiradix(
        page_size,
        size=256,
        layout=layout,
        write_policy=write_policy,
        mla=mla,
        eagle=eagle,
        storage=storage,
        extra_config='{"prefetch_threshold": 4}' if storage else None,
    )
    loop = Loop(env, seed)
    for _ in range(250):
        loop.step()
    loop.drain()
    s = loop.stats
    assert s["finished"] > 20 and s["reused"] > 500 and s["verified"] >= s["reused"], s
    assert s["flushes"] > 0 and s["aborted"] > 0 and s["loaded"] > 0, s
    if storage:
        assert s["l3_loaded"] > 0, s
    assert env.cache.protected_size() == 0 and not env.cache.ongoing_prefetch


@pytest.mark.parametrize(
    ("page_size", "layout", "mla", "seed"), [(4, "page_first", True, 7), (1, "layer_first", False, 8)]
)
def test_randomized_scheduler_loop_with_an_mtp_draft(page_size, layout, mla, seed) -> None:
    """MTP speculative decoding (EAGLE keys, ``mtp_draft_device_pools``): every reused
    prefix, on the device or loaded back from host, also has the draft's KV it was computed
    with (no L3 here: L3 keeps the target's KV only)."""
    draft = MTPDraft(page_size, 256, mla)
    env = build_hiradix(
        page_size, size=256, layout=layout, mla=mla, eagle=True, params={"mtp_draft_device_pools": (draft.pool,)}
    )
    loop = Loop(env, seed, draft)
    for _ in range(250):
        loop.step()
    loop.drain()
    s = loop.stats
    assert s["finished"] > 20 and s["reused"] > 500 and s["verified"] >= s["reused"] and s["loaded"] > 0, s
    assert env.cache.protected_size() == 0
