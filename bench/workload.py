"""Deterministic prefix-sharing workload for the radix-tree benchmarks.

This module is shared by the hiradix benchmark and by
``bench/sglang_baselines.py`` (which runs inside the SGLang virtual
environments), so it depends on NumPy only and never imports hiradix.

Workload (``make_workload``), all draws from one
``rng = numpy.random.default_rng(seed)`` in this order:

1. ``n_prompts`` (200) system prompts.  For each prompt ``p`` in turn: its
   length ``Lp = rng.integers(128, 1024, endpoint=True)`` and its tokens
   ``rng.integers(0, vocab, Lp)``.
2. For each prompt ``p`` (in order) ``n_cont`` (100) continuations.  For each:
   a total length ``L = rng.integers(max(256, Lp + 1), 2048, endpoint=True)``
   and ``L - Lp`` fresh tokens ``rng.integers(0, vocab, L - Lp)``; the
   sequence is ``prompt_p + fresh`` (so every sequence extends its prompt by
   at least one token and is 256..2048 tokens long).
3. The list of all ``n_prompts * n_cont`` (20,000) sequences is shuffled with
   ``rng.permutation``.

Tokens are ``int32`` in ``[0, vocab)``.  With the defaults the workload has
20,000 sequences and about 26.4M tokens (26,362,330 for seed 0), of which
about 15.0M (15,015,247) are distinct tree tokens, since every prompt is
shared by its 100 continuations.

``make_long_key`` gives one 128K-token (131,072) key for the long-match
latency test, and ``describe`` summarises a workload.

Consumers that need page-aligned keys (page size > 1) truncate each key to a
multiple of the page size themselves; the workload is the same for all page
sizes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["describe", "make_long_key", "make_workload"]


def make_workload(seed: int = 0, n_prompts: int = 200, n_cont: int = 100, vocab: int = 32000) -> list[np.ndarray]:
    """Return the shuffled list of ``n_prompts * n_cont`` int32 token arrays."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n_prompts):
        plen = int(rng.integers(128, 1024, endpoint=True))
        prompts.append(rng.integers(0, vocab, plen, dtype=np.int32))
    seqs: list[np.ndarray] = []
    for prompt in prompts:
        plen = len(prompt)
        lo = max(256, plen + 1)
        for _ in range(n_cont):
            total = int(rng.integers(lo, 2048, endpoint=True))
            fresh = rng.integers(0, vocab, total - plen, dtype=np.int32)
            seqs.append(np.concatenate((prompt, fresh)))
    order = rng.permutation(len(seqs))
    return [seqs[i] for i in order]


def make_long_key(seed: int = 1, length: int = 131072, vocab: int = 32000) -> np.ndarray:
    """Return one int32 key of ``length`` (default 128K) uniform tokens."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, length, dtype=np.int32)


def describe(seqs: list[np.ndarray]) -> dict:
    """Count, total tokens and min/max length of a workload."""
    lens = [len(s) for s in seqs]
    return {
        "count": len(seqs),
        "total_tokens": int(sum(lens)),
        "min_len": int(min(lens)) if lens else 0,
        "max_len": int(max(lens)) if lens else 0,
    }


if __name__ == "__main__":
    import json
    import time

    t0 = time.perf_counter()
    w = make_workload()
    info = describe(w)
    info["build_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(info))
