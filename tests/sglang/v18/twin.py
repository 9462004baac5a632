"""hiradix.sglang and SGLang 0.5.18's own ``HiRadixCache`` driven with the same operations
through SGLang's API, each on its own SGLang CPU pools (:func:`sglang_env.build`,
:func:`sglang_env.build_sglang`). Every operation's answer is compared: prefix lengths,
device hits, host hits, the last node's key, sizes, evicted counts, and the KV cache events
taken after it. The KV a match returns is checked against the KV its tokens were computed
with, in both caches.

Both caches copy for real: SGLang's synchronously on the CPU, hiradix's on its copy
engine, whose copies :meth:`Twin.settle` waits for (an event wait, no sleep) before both
acknowledge them, so the two see the same acknowledgements at the same step.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tests.sglang.v18.env import Env


def radix_key(tokens: list[int], extra_key: str | None = None, cache_salt: str | None = None) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


class Twin:
    """``ours`` (hiradix.sglang) and ``theirs`` (SGLang's) side by side."""

    def __init__(self, ours: Env, theirs: Env, *, eagle: bool = False) -> None:
        assert ours.page_size == theirs.page_size
        self.ours, self.theirs = ours, theirs
        self.envs = (ours, theirs)
        self.eagle = eagle
        self.ps = ours.page_size
        self.locks: list[tuple[Any, Any]] = []
        self.stats: Counter[str] = Counter()
        # the same host slots: host evictions happen at the same steps
        hosts = ours.cache.token_to_kv_pool_host.size, theirs.cache.token_to_kv_pool_host.size
        assert hosts[0] == hosts[1], hosts
        self.events("construction")

    # ------------------------------------------------------------------ checks
    def events(self, what: str) -> list[Any]:
        """Both caches' events since the last call: they must be equal."""
        mine, sglang = (env.cache.take_events() for env in self.envs)
        if mine != sglang:
            raise AssertionError(f"KV events differ after {what}\n hiradix: {mine}\n  sglang: {sglang}")
        for e in mine:
            self.stats[type(e).__name__] += 1
            self.stats[f"{type(e).__name__} blocks"] += len(getattr(e, "block_hashes", ()))
            if isinstance(e, BlockRemoved) and e.medium == StorageMedium.CPU and not what.startswith("evict_host"):
                self.stats["host evictions for backups"] += 1
        self.stats["checks"] += 1
        return mine

    def sizes_agree(self, what: str) -> None:
        a, b = (
            (env.cache.evictable_size(), env.cache.protected_size(), env.allocator.available_size())
            for env in self.envs
        )
        assert a == b, f"(evictable, protected, free) differ after {what}: hiradix {a}, sglang {b}"

    def slots(self, n_tokens: int) -> int:
        """Device slots a key of ``n_tokens`` tokens caches: bigrams with EAGLE, page aligned."""
        return max(n_tokens - (1 if self.eagle else 0), 0) // self.ps * self.ps

    def check_kv(self, env: Env, tokens: list[int], indices: torch.Tensor) -> None:
        """The slots of a hit hold the KV of their tokens (slot ``i``: token ``i`` at
        position ``i``, also for bigram ``i``)."""
        m = len(indices)
        want = env.expected_kv(torch.tensor(tokens[:m]), torch.arange(m))
        for buf, w in zip(env.layers(), want, strict=True):
            assert torch.equal(buf[indices.long()], w), "a hit's slots hold other KV"
        self.stats["kv verified"] += m

    # ------------------------------------------------------------------ operations
    def evict(self, n: int) -> None:
        freed = [env.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted for env in self.envs]
        assert freed[0] == freed[1], f"evict({n}) freed {freed}"
        self.events(f"evict({n})")
        self.sizes_agree(f"evict({n})")

    def evict_host(self, n: int) -> None:
        for env in self.envs:
            env.cache.evict_host(n)
        self.events(f"evict_host({n})")

    def insert(self, tokens: list[int], extra_key: str | None = None, cache_salt: str | None = None) -> int:
        """Insert ``tokens`` with fresh slots (evicting what is short first, as the
        scheduler's allocation does), freeing the duplicate prefix; returns it."""
        n = self.slots(len(tokens))
        if n == 0:
            return 0
        short = n - self.ours.allocator.available_size()
        if short > 0:
            self.evict(short)
            if self.ours.allocator.available_size() < n:  # the rest is locked (the same in both)
                self.stats["inserts without room"] += 1
                return 0
        prefixes = []
        for env in self.envs:
            slots = env.allocator.alloc(n)
            env.write_kv(slots, torch.tensor(tokens[:n]), torch.arange(n))
            key = radix_key(tokens[: n + (1 if self.eagle else 0)], extra_key, cache_salt)
            res = env.cache.insert(InsertParams(key=key, value=slots))
            if res.prefix_len:
                env.allocator.free(slots[: res.prefix_len])
            prefixes.append(res.prefix_len)
        assert prefixes[0] == prefixes[1], f"insert prefix lengths differ: {prefixes}"
        self.events(f"insert({len(tokens)} tokens)")
        self.sizes_agree("insert")
        return prefixes[0]

    def match(
        self, tokens: list[int], extra_key: str | None = None, cache_salt: str | None = None, limit: int | None = None
    ) -> tuple[Any, Any]:
        """Match on both: same device hit, host hit and last node key; the hit's KV
        checked. Returns both results."""
        results = []
        for env in self.envs:
            key = RadixKey(array("q", tokens), extra_key, limit=limit, cache_salt=cache_salt)
            m = env.cache.match_prefix(MatchPrefixParams(key=key))
            self.check_kv(env, tokens, m.device_indices)
            results.append(m)
        ours, theirs = results
        assert len(ours.device_indices) == len(theirs.device_indices), (
            f"device hits differ: {len(ours.device_indices)} vs {len(theirs.device_indices)}"
        )
        assert ours.host_hit_length == theirs.host_hit_length, (ours.host_hit_length, theirs.host_hit_length)
        # (last_host_node differs by design while a backup is in flight: SGLang counts a
        # node as backed up when its copy starts, hiradix when every rank acknowledged it)
        a, b = ours.last_device_node, theirs.last_device_node
        assert list(a.key.token_ids) == list(b.key.token_ids), (
            f"last nodes' keys differ: {list(a.key.token_ids)} vs {list(b.key.token_ids)}, matching {tokens}"
        )
        assert bool(a.key.is_bigram) == bool(b.key.is_bigram) or not len(b.key.token_ids)
        assert self.ours.cache.is_root(a) == (b is self.theirs.cache.root_node), "one last node is a root"
        self.events("match")  # a match splits; no event
        self.stats["hit tokens"] += len(ours.device_indices)
        self.stats["host hit tokens"] += ours.host_hit_length
        return ours, theirs

    def lock(self, tokens: list[int], extra_key: str | None = None) -> None:
        ours, theirs = self.match(tokens, extra_key)
        self.ours.cache.inc_lock_ref(ours.last_device_node)
        self.theirs.cache.inc_lock_ref(theirs.last_device_node)
        self.locks.append((ours.last_device_node, theirs.last_device_node))
        self.sizes_agree("inc_lock_ref")

    def unlock(self, i: int) -> None:
        ours, theirs = self.locks.pop(i)
        self.ours.cache.dec_lock_ref(ours)
        self.theirs.cache.dec_lock_ref(theirs)
        self.sizes_agree("dec_lock_ref")

    def settle(self) -> None:
        """Acknowledge every backup in flight on both (hiradix's copies waited for first)."""
        self.ours.cache.cache_controller.drain()
        for env in self.envs:
            env.cache.writing_check()
        self.events("writing_check")
        self.sizes_agree("writing_check")

    def load_back(self, tokens: list[int], extra_key: str | None = None) -> None:
        """Load a match's host tail back where both have the room without evicting (SGLang
        evicts the whole tail's length when short, hiradix only the shortfall)."""
        ours, theirs = self.match(tokens, extra_key)
        need = ours.host_hit_length
        if not need or min(env.allocator.available_size() for env in self.envs) < need:
            return
        loaded = []
        for env, m in zip(self.envs, (ours, theirs), strict=True):
            got, _ = env.cache.init_load_back(
                InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            loaded.append(len(got))
        assert loaded[0] == loaded[1], f"loaded {loaded}"
        self.events("init_load_back")
        for env in self.envs:
            env.cache.ready_to_load_host_cache()
        self.ours.cache.cache_controller.drain()
        for env in self.envs:
            env.cache.loading_check()
        self.events("loading_check")
        self.sizes_agree("loading_check")
        self.stats["loaded tokens"] += loaded[0]
        self.match(tokens, extra_key)  # the loaded KV is served

    def request(
        self, tokens: list[int], extra_key: str | None = None, cache_salt: str | None = None, chunk: int | None = None
    ) -> None:
        """A request through the scheduler's own calls on both caches: SGLang's ``Req``
        matched by ``init_next_round_input`` and locked, the rest allocated (a page at a
        time) and computed, then (``chunk``) ``cache_unfinished_req`` of a first chunk,
        and ``cache_finished_req``. Prefixes, protected lengths and events compared."""
        reqs = []
        for env in self.envs:
            req = env.new_req(tokens, extra_key=extra_key, cache_salt=cache_salt)
            req.init_next_round_input(env.cache)
            env.cache.inc_lock_ref(req.last_node)
            self.check_kv(env, tokens, req.prefix_indices)
            reqs.append(req)
        self.events("init_next_round_input")
        prefix = len(reqs[0].prefix_indices)
        assert prefix == len(reqs[1].prefix_indices), [len(r.prefix_indices) for r in reqs]
        need = -(-(len(tokens) - prefix) // self.ps) * self.ps
        short = need - self.ours.allocator.available_size()
        if short > 0:
            self.evict(short)
        if self.ours.allocator.available_size() < need:
            for env, req in zip(self.envs, reqs, strict=True):  # no room: give the request up
                env.cache.dec_lock_ref(req.last_node)
                env.req_to_token.free(req)
            self.stats["requests without room"] += 1
            return
        for env, req in zip(self.envs, reqs, strict=True):
            slots = env.allocator.alloc(need)[: len(tokens) - prefix]
            env.req_to_token.write((req.req_pool_idx, slice(0, prefix)), req.prefix_indices.to(torch.int32))
            env.req_to_token.write((req.req_pool_idx, slice(prefix, len(tokens))), slots.to(torch.int32))
            env.write_kv(slots, torch.tensor(tokens[prefix:]), torch.arange(prefix, len(tokens)))
        if chunk is not None and prefix < chunk < len(tokens):
            for env, req in zip(self.envs, reqs, strict=True):
                req.set_extend_range(0, chunk)
                env.cache.cache_unfinished_req(req, chunked=True)
                self.check_kv(env, tokens, req.prefix_indices[: req.cache_protected_len])
            assert reqs[0].cache_protected_len == reqs[1].cache_protected_len, [r.cache_protected_len for r in reqs]
            assert len(reqs[0].prefix_indices) == len(reqs[1].prefix_indices)
            self.events("cache_unfinished_req")
            self.sizes_agree("cache_unfinished_req")
            self.stats["chunks"] += 1
        for env, req in zip(self.envs, reqs, strict=True):
            env.cache.cache_finished_req(req, kv_len_to_handle=len(tokens))
            env.req_to_token.free(req)
        self.events("cache_finished_req")
        self.sizes_agree("cache_finished_req")
        self.stats["requests"] += 1

    def reset(self) -> None:
        """The scheduler's flush: the cache, then the pools."""
        for env in self.envs:
            env.cache.reset()
            env.req_to_token.clear()
            env.allocator.clear()
        self.locks.clear()
        want = ["AllBlocksCleared"] if self.ours.cache.enable_kv_cache_events else []
        assert [type(e).__name__ for e in self.events("reset")] == want


class Workload:
    """Seeded keys with shared prefixes: a few prompts (long enough for a host tail to
    pass SGLang's load-back threshold of 10 tokens), cut anywhere, plus new tokens; some in
    request namespaces (``extra_key``, ``cache_salt``)."""

    NAMESPACES = ((None, None), (None, None), ("lora-a", None), (None, "salt-1"), ("lora-a", "salt-1"))

    def __init__(self, seed: int, page_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.ps = page_size
        self.prompts = [
            self.tokens(int(self.rng.integers(12, 40)) // page_size * page_size + page_size) for _ in range(5)
        ]

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(1, 60, n).tolist()

    def key(self) -> tuple[list[int], str | None, str | None]:
        base = self.prompts[int(self.rng.integers(len(self.prompts)))]
        cut = int(self.rng.integers(1, len(base) + 1))
        extra, salt = self.NAMESPACES[int(self.rng.integers(len(self.NAMESPACES)))]
        return base[:cut] + self.tokens(int(self.rng.integers(0, 3 * self.ps + 2))), extra, salt


def run(twin: Twin, seed: int, steps: int, *, chunks: bool = True) -> Counter[str]:
    """``steps`` random operations on both caches, everything compared after each
    (``chunks``: some requests go through ``cache_unfinished_req`` first)."""
    w = Workload(seed, twin.ps)
    rng = w.rng
    for _ in range(steps):
        op = int(rng.integers(100))
        tokens, extra, salt = w.key()
        if op < 20:
            twin.insert(tokens, extra, salt)
        elif op < 30:
            chunk = int(rng.integers(1, len(tokens) + 1)) if op < 25 and chunks else None
            twin.request(tokens, extra, salt, chunk=chunk)
        elif op < 42:
            twin.match(tokens, extra, salt, limit=int(rng.integers(1, len(tokens) + 1)) if op < 36 else None)
        elif op < 54:
            twin.settle()
        elif op < 66:
            twin.evict(int(rng.integers(1, 16)) * twin.ps)
        elif op < 82:
            twin.load_back(tokens, extra)
        elif op < 88:
            twin.lock(tokens, extra)
        elif op < 94 and twin.locks:
            twin.unlock(int(rng.integers(len(twin.locks))))
        elif op < 99:
            twin.evict_host(int(rng.integers(1, 8)) * twin.ps)
        else:
            twin.reset()
    twin.stats["steps"] += steps
    return twin.stats
