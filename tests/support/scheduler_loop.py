"""A scheduler-like loop over :class:`HiRadixCache` with real KV pools, for the stress and
the multi-rank tests.

Each step admits a few requests (match, load back the host tail, lock, allocate the rest,
"compute" their KV), runs a forward pass that waits for every layer of the step's load
and checks the reused KV byte for byte, lets some running requests decode a few tokens,
finishes others, sometimes evicts on its own, and ends with ``check_hicache_events``.
Every random choice comes from one generator seeded by ``seed``, so every rank of a
multi-rank run makes the same calls; faults are injected by the caller, rank-locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hiradix.cache import HiRadixCache, Req
from hiradix.memory.copy import CopyError
from tests.support.kvdata import fill, mismatches, prefix_seeds


@dataclass
class Running:
    req: Req
    tree_part: int  # leading kv_indices that belong to the tree (locked), not to the request


@dataclass
class LoopStats:
    steps: int = 0
    admitted: int = 0
    rejected: int = 0
    finished: int = 0
    reused_tokens: int = 0
    loaded_tokens: int = 0
    verified_tokens: int = 0
    forward_errors: int = 0
    invariant_checks: int = 0


def _prompts(rng: np.random.Generator, page_size: int) -> list[np.ndarray]:
    """Shared prefixes (system prompts, conversations) the requests draw from."""
    lengths = [int(rng.integers(1, 6)) * page_size * 2 + int(rng.integers(0, 3)) for _ in range(12)]
    return [rng.integers(0, 50_000, n) for n in lengths]


def run_loop(
    cache: HiRadixCache,
    steps: int,
    seed: int,
    *,
    check: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> LoopStats:
    """Run ``steps`` scheduler steps; ``check_invariants`` after each one when ``check``.
    Ends with every request finished and :meth:`HiRadixCache.flush`."""
    rng = np.random.default_rng(seed)
    page = cache.page_size
    bases = _prompts(rng, page)
    running: list[Running] = []
    stats = LoopStats()
    counter = cache.cache_controller.layer_done_counter
    layer_num = cache.device_pool.layer_num

    def outstanding() -> int:  # device slots the running requests own: whole pages
        return sum(-(-len(r.req.kv_indices) // page) * page - r.tree_part for r in running)

    def extend(kv: torch.Tensor, k: int) -> torch.Tensor | None:
        """Slots for ``k`` more tokens after ``kv``, as a paged scheduler hands them out:
        the rest of the last partial page first, then whole new pages."""
        used = len(kv) % page
        head = torch.arange(int(kv[-1]) + 1, int(kv[-1]) + 1 + min(k, page - used)) if used else kv[:0]
        rest = k - len(head)
        if rest <= 0:
            return head
        pages = cache.alloc_device(-(-rest // page) * page)
        return None if pages is None else torch.cat((head, pages[:rest]))

    def finish(r: Running) -> None:
        req = r.req
        assert mismatches(cache.device_pool, req.kv_indices, prefix_seeds(req.token_ids)) == 0, (
            f"request {req.rid}: KV changed while it ran"
        )
        stats.verified_tokens += len(req.token_ids)
        cache.cache_finished_req(req)
        stats.finished += 1

    for step in range(steps):
        # ---- admit
        admitted: list[tuple[Req, torch.Tensor]] = []
        for _ in range(int(rng.integers(0, 3))):
            base = bases[int(rng.integers(len(bases)))]
            cut = int(rng.integers(len(base) // 2, len(base) + 1))
            prompt = np.concatenate((base[:cut], rng.integers(0, 50_000, int(rng.integers(1, 3 * page + 2)))))
            m = cache.match_prefix(prompt)
            loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
            cache.inc_lock_ref(node)
            prefix = torch.cat((m.device_indices, loaded))
            new = extend(prefix, len(prompt) - len(prefix))
            if new is None:
                cache.dec_lock_ref(node)
                stats.rejected += 1
                continue
            fill(cache.device_pool, new, prefix_seeds(prompt)[len(prefix) :])
            req = Req(f"{step}.{len(admitted)}", prompt, torch.cat((prefix, new)), prefix, node)
            running.append(Running(req, len(prefix)))
            admitted.append((req, prefix))
            stats.admitted += 1
            stats.reused_tokens += len(prefix)
            stats.loaded_tokens += len(loaded)
        # ---- forward: wait for each layer of the step's load, then read it
        counter.set_consumer(cache.ready_to_load_host_cache())
        errors_before = stats.forward_errors
        try:
            for layer in range(layer_num):
                counter.wait_until(layer, timeout=60)
                for req, prefix in admitted:
                    seeds = prefix_seeds(req.token_ids[: len(prefix)])
                    assert mismatches(cache.device_pool, prefix, seeds, [layer]) == 0, (
                        f"step {step}: request {req.rid} read wrong KV at layer {layer}"
                    )
        except CopyError:
            # The batch is retried next step; check_hicache_events below repairs the load
            # first. (Rank-local: multi-rank runs inject no load faults.)
            stats.forward_errors += 1
        # ---- decode / finish
        for r in list(running) if stats.forward_errors == errors_before else ():
            choice = rng.random()
            if choice < 0.35:
                running.remove(r)
                finish(r)
            elif choice < 0.5:
                extra = int(rng.integers(1, page + 2))
                got = extend(r.req.kv_indices, extra)
                if got is None:
                    running.remove(r)
                    finish(r)
                    continue
                tokens = np.concatenate((r.req.token_ids, rng.integers(0, 50_000, extra)))
                fill(cache.device_pool, got, prefix_seeds(tokens)[-extra:])
                r.req.token_ids = tokens
                r.req.kv_indices = torch.cat((r.req.kv_indices, got))
            elif choice < 0.6:
                cache.cache_unfinished_req(r.req)
                r.tree_part = len(r.req.token_ids) // page * page
        # ---- background pressure
        if rng.random() < 0.1:
            cache.evict(int(rng.integers(1, 4 * page)))
        if rng.random() < 0.1:
            cache.evict_host(int(rng.integers(1, 4 * page)))
        cache.check_hicache_events()
        stats.steps += 1
        if on_step is not None:
            on_step(step)
        if check:
            cache.check_invariants(outstanding_device=outstanding())
            stats.invariant_checks += 1
    for r in running:
        finish(r)
    running.clear()
    cache.flush()
    if check:
        cache.check_invariants()
    return stats


def tree_fingerprint(cache: HiRadixCache, namespaces: dict[str, int] | None = None) -> list[Any]:
    """The tree's structure without slot numbers (which may differ between ranks): the
    global root's, then each of ``namespaces`` (name -> root handle) in name order, each
    after its name."""
    tree = cache.tree
    out: list[Any] = []
    roots = [(None, tree.root), *((name, namespaces[name]) for name in sorted(namespaces or {}))]
    for name, root in roots:
        out.append(name)
        stack = [root]
        while stack:
            h = stack.pop()
            info = tree.node_info(h)
            out.append(
                (
                    tree.key(h).tolist() if tree.parent(h) != -1 else [],
                    info["evicted"],
                    info["backuped"],
                    info["lock_ref"],
                    info["host_ref_counter"],
                    info["hit_count"],
                    info["io_status"],
                )
            )
            stack.extend(reversed(tree.children(h)))
    return out


def prefetch_back(cache: HiRadixCache, seqs: list[np.ndarray]) -> list[int]:
    """Evict everything from device and host, then prefetch each sequence back from L3
    (waiting for each); returns the tokens each prefetch loaded. Every rank makes the
    same calls, so the multi-rank workers use it as is."""
    cache.evict(10**9)
    cache.evict_host(10**9)
    loaded = []
    for i, s in enumerate(seqs):
        m = cache.match_prefix(s)
        mount, mlen = cache.storage.prefetch_mount(m)
        if cache.storage.prefetch_from_storage(i, mount, s[mlen:]):
            cache.storage.wait_prefetch(i, 30)
            while not cache.storage.check_prefetch_progress(i):  # agreed: same number of calls everywhere
                cache.storage.wait_prefetch(i, 30)
        loaded.append(cache.storage.pop_prefetch_loaded_tokens(i))
        cache.check_hicache_events()
        cache.check_invariants()
    return loaded
