"""A long randomized scheduler loop driving hiradix.sglang with SGLang's own caller code:
real ``Req`` objects matched through ``Req.init_next_round_input`` (the scheduler's
match), host tails loaded back with ``InitLoadBackParams``, slots from SGLang's allocator
(evicting through ``EvictParams`` when short), chunked prefill through
``cache_unfinished_req``, decode, finish through ``cache_finished_req(kv_len_to_handle=)``,
aborts, and flushes (``reset``) when idle.

After every step: the bytes of every reused prefix are read back per layer from SGLang's KV
buffers (after the layer-done counter's ``wait_until``, as the attention backends do) and
compared with the KV the prefix was computed with, and slots are conserved on SGLang's
allocator: free + cached in the tree + held by running requests == size.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

from tests.sglang.pools import forward_read
from tests.sglang.v18.env import Env, record

pytestmark = pytest.mark.slow  # randomized scheduler loops over every layout and policy


class Loop:
    def __init__(self, env: Env, seed: int) -> None:
        self.env = env
        self.rng = np.random.default_rng(seed)
        ps = env.page_size
        self.prompts = [self.rng.integers(0, 30_000, int(self.rng.integers(2, 10)) * ps * 3).tolist() for _ in range(8)]
        self.running: list = []
        self.stats = {"steps": 0, "finished": 0, "aborted": 0, "reused": 0, "loaded": 0, "verified": 0, "flushes": 0}

    # ---------------------------------------------------------------- helpers
    def alloc(self, n: int) -> torch.Tensor | None:
        env = self.env
        short = n - env.allocator.available_size()
        if short > 0:
            env.cache.evict(EvictParams(num_tokens=short))
        return env.allocator.alloc(n) if n <= env.allocator.available_size() else None

    def held(self, req) -> int:
        """Slots the request owns outside the tree: whole pages (the allocator's unit)
        past its page-aligned, tree-owned prefix."""
        ps = self.env.page_size
        return -(-int(req.kv_allocated) // ps) * ps - int(record(req).cache_protected_len)

    def verify(self, req, upto: int, read: list[torch.Tensor] | None = None) -> None:
        """The request's first ``upto`` tokens' KV is what was computed for them, in the
        buffers as the forward pass read them (``read``; default the pool's own)."""
        env = self.env
        tokens = torch.tensor(list(req.full_untruncated_fill_ids[:upto]))
        slots = env.req_to_token.req_to_token[record(req).req_pool_idx, :upto].long()
        want = env.expected_kv(tokens, torch.arange(upto))
        for buf, w in zip(env.layers() if read is None else read, want, strict=True):
            assert torch.equal(buf[slots], w), f"request {req.rid}: reused KV differs"
        self.stats["verified"] += upto

    # ---------------------------------------------------------------- scheduler actions
    def admit(self) -> None:
        env, rng, ps = self.env, self.rng, self.env.page_size
        base = self.prompts[int(rng.integers(len(self.prompts)))]
        cut = int(rng.integers(ps, len(base) + 1))
        tokens = base[:cut] + rng.integers(0, 30_000, int(rng.integers(1, 3 * ps + 2))).tolist()
        req = env.new_req(tokens)
        req.init_next_round_input(env.cache)  # SGLang's own match call
        if req.host_hit_length > 0:
            loaded, req.last_node = env.cache.init_load_back(
                InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
            )
            req.prefix_indices = torch.cat([req.prefix_indices, loaded])
            record(req).cache_protected_len = len(req.prefix_indices)
            self.stats["loaded"] += len(loaded)
        env.cache.inc_lock_ref(req.last_node)
        prefix = len(req.prefix_indices)
        # chunked prefill: compute up to `end` now, the rest in a later step
        end = len(tokens) if rng.random() < 0.6 else max(prefix + 1, (prefix + len(tokens)) // 2)
        n = end - prefix
        slots = self.alloc((n + ps - 1) // ps * ps)
        if slots is None:
            env.cache.dec_lock_ref(req.last_node)
            env.req_to_token.free(req)
            return
        env.req_to_token.write((record(req).req_pool_idx, slice(0, prefix)), req.prefix_indices.to(torch.int32))
        env.req_to_token.write((record(req).req_pool_idx, slice(prefix, end)), slots[:n].to(torch.int32))
        req.kv_allocated = end
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
            slots = self.env.req_to_token.req_to_token[record(req).req_pool_idx, prefix:end].long()
            self.env.write_kv(slots, tokens, torch.arange(prefix, end))
        self.running = [(req, end, end) for req, _, end in self.running]

    def progress(self) -> None:
        env, rng = self.env, self.rng
        keep = []
        for req, _, end in self.running:
            total = len(req.full_untruncated_fill_ids)
            roll = rng.random()
            if end < total:  # the next chunk: insert what is computed, move the lock
                req.set_extend_range(0, end)
                env.cache.cache_unfinished_req(req, chunked=True)
                nxt = min(total, end + int(rng.integers(1, 2 * env.page_size + 2)))
                slots = self.alloc_tail(req, nxt)
                if slots is None:
                    self.finish(req, insert=False)
                    continue
                keep.append((req, end, nxt))
            elif roll < 0.15:
                self.finish(req, insert=False)  # abort
                self.stats["aborted"] += 1
            elif roll < 0.55:
                self.finish(req, insert=True)
                self.stats["finished"] += 1
            else:  # decode one token
                req.output_ids.append(int(rng.integers(0, 30_000)))
                req._refresh_fill_ids() if hasattr(req, "_refresh_fill_ids") else None
                slots = self.alloc_tail(req, end + 1)
                if slots is None:
                    self.finish(req, insert=True)
                    continue
                keep.append((req, end, end + 1))
        self.running = keep

    def alloc_tail(self, req, upto: int) -> torch.Tensor | None:
        """Slots for positions [kv_allocated, upto): the tail page's free rows first."""
        env, ps = self.env, self.env.page_size
        have = int(req.kv_allocated)
        if upto <= have:
            return torch.empty(0)
        last = int(env.req_to_token.req_to_token[record(req).req_pool_idx, have - 1]) if have else -1
        free_in_page = (ps - have % ps) % ps
        n_inplace = min(free_in_page, upto - have)
        inplace = torch.arange(last + 1, last + 1 + n_inplace)
        rest = upto - have - n_inplace
        fresh = self.alloc((rest + ps - 1) // ps * ps) if rest else torch.empty(0, dtype=torch.int64)
        if fresh is None:
            return None
        fresh = fresh[:rest]  # the rest of the last fresh page stays the request's
        slots = torch.cat([inplace, fresh.long()])
        env.req_to_token.write((record(req).req_pool_idx, slice(have, upto)), slots.to(torch.int32))
        req.kv_allocated = upto
        return slots

    def finish(self, req, insert: bool) -> None:
        env = self.env
        env.cache.cache_finished_req(req, is_insert=insert, kv_len_to_handle=int(req.kv_allocated))
        env.req_to_token.free(req)

    def step(self) -> None:
        env, rng = self.env, self.rng
        for _ in range(int(rng.integers(0, 3))):
            self.admit()
        consumer = env.cache.ready_to_load_host_cache()
        self.forward(consumer)
        self.progress()
        if rng.random() < 0.1:
            env.cache.evict(EvictParams(num_tokens=int(rng.integers(1, 64))))
        env.cache.check_hicache_events()
        if not self.running and rng.random() < 0.05:
            env.cache.reset()  # the scheduler's flush_cache sequence, only when idle
            env.req_to_token.clear()
            env.allocator.clear()
            self.stats["flushes"] += 1
        self.stats["steps"] += 1
        outstanding = sum(self.held(req) for req, _, _ in self.running)
        env.cache.check_invariants(outstanding)

    def drain(self) -> None:
        for req, _, _ in self.running:
            self.finish(req, insert=True)
        self.running = []
        self.env.cache.core.flush()
        self.env.cache.check_hicache_events()
        self.env.cache.check_invariants()


@pytest.mark.parametrize(
    ("page_size", "layout", "write_policy", "mla", "seed", "eagle", "kv_events", "backup_copy"),
    [
        (1, "layer_first", "write_through", False, 1, False, False, "inline"),
        (4, "page_first", "write_through_selective", False, 2, False, False, "thread"),
        (4, "page_first_direct", "write_back", False, 3, False, True, "inline"),
        (2, "layer_first", "write_through", True, 4, False, False, "thread"),
        # EAGLE bigram keys: a reused prefix of n bigrams is the KV of the first n tokens
        (1, "layer_first", "write_through", False, 5, True, True, "inline"),
        (4, "page_first", "write_back", False, 6, True, False, "thread"),
    ],
)
def test_randomized_scheduler_loop(
    make_env, page_size, layout, write_policy, mla, seed, eagle, kv_events, backup_copy
) -> None:
    env = make_env(
        page_size,
        size=256,
        layout=layout,
        write_policy=write_policy,
        mla=mla,
        eagle=eagle,
        kv_events=kv_events,
        extra_config=json.dumps({"backup_copy": backup_copy}),
    )
    loop = Loop(env, seed)
    events = 0
    for _ in range(250):
        loop.step()
        events += len(env.cache.take_events())  # the scheduler's per-step publish
    loop.drain()
    s = loop.stats
    assert s["finished"] > 20 and s["reused"] > 500 and s["verified"] >= s["reused"], s
    assert env.cache.protected_size() == 0
    assert (events > 0) == kv_events
