"""Request workloads for the real-server tests: token-id prompts with shared prefixes, sized
so that a prefix's KV leaves the device pool before it is asked for again."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Token ids the tiny model's tokenizer can decode (its vocabulary has 386 entries; the
#: first three are the special tokens).
LOW, HIGH = 3, 380


@dataclass(frozen=True)
class Workload:
    """``prompts[i]`` is ``prefixes[prefix_of[i]]`` followed by a suffix of its own."""

    prefixes: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...], ...]
    prefix_of: tuple[int, ...]
    max_new_tokens: int


def shared_prefixes(n_prefixes: int = 8, prefix_len: int = 300, n_requests: int = 40, suffix_len: int = 16,
                    max_new_tokens: int = 8, seed: int = 0) -> Workload:
    """``n_requests`` prompts cycling over ``n_prefixes`` prefixes in order: with fewer
    device slots than all prefixes together, least-recently-used eviction has sent each
    prefix to host by the time the cycle comes back to it, so from the second cycle on
    every request loads its prefix back."""
    rng = np.random.default_rng(seed)
    prefixes = tuple(tuple(int(t) for t in rng.integers(LOW, HIGH, prefix_len)) for _ in range(n_prefixes))
    prompts, owner = [], []
    for i in range(n_requests):
        p = i % n_prefixes
        prompts.append(prefixes[p] + tuple(int(t) for t in rng.integers(LOW, HIGH, suffix_len)))
        owner.append(p)
    return Workload(prefixes, tuple(prompts), tuple(owner), max_new_tokens)


def other_suffixes(work: Workload, seed: int, suffix_len: int = 16) -> Workload:
    """``work``'s prefixes, in the same order, each prompt with a new suffix."""
    rng = np.random.default_rng(seed)
    prompts = tuple(work.prefixes[p] + tuple(int(t) for t in rng.integers(LOW, HIGH, suffix_len))
                    for p in work.prefix_of)
    return Workload(work.prefixes, prompts, work.prefix_of, work.max_new_tokens)


def serve_all(server: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              concurrency: int = 1) -> list[dict[str, Any]]:
    """Send ``prompts`` to ``server`` (``concurrency`` requests in flight, the answers in
    prompt order) and return its answers."""
    if concurrency == 1:
        return [server.generate(list(p), max_new_tokens) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: server.generate(list(p), max_new_tokens), prompts))


def tier_hits(answers: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Tokens each tier served over ``answers`` (SGLang's ``cached_tokens_details``:
    ``device``, ``host`` and, with an L3, ``storage``), and ``cached`` in all."""
    total = {"device": 0, "host": 0, "storage": 0, "cached": 0}
    for a in answers:
        meta = a["meta_info"]
        total["cached"] += int(meta.get("cached_tokens") or 0)
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            if tier in total and isinstance(n, int):
                total[tier] += n
    return total


def wrong(answers: Sequence[dict[str, Any]], want: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the answers whose output tokens differ from ``want``'s."""
    return [i for i, (a, w) in enumerate(zip(answers, want, strict=True)) if list(a["output_ids"]) != list(w)]
