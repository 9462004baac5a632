"""Chained page-hash benchmark: hiradix's C SHA-256 against SGLang-style ``hashlib``.

For each page size, hashes one chain over ``--tokens`` random tokens and reports
nanoseconds per token (median over ``--repeats`` after a warm-up) for:

``hiradix (SHA-NI)``   ``hiradix.page_digests``: C, no GIL, SHA extensions if the CPU has them
``hiradix (portable)`` the same C code with the SHA extensions switched off
``hashlib per page``   one ``hashlib.sha256`` per page, as SGLang's ``get_hash_str`` does

The issue's target is under 25 ns/token at page size 16 on this machine.

Usage: ``python bench/hashing.py [--tokens 1000000] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

import numpy as np

from hiradix.tree import _core


def hashlib_chain(tokens: np.ndarray, page_size: int) -> bytes:
    prev = b""
    data = tokens.astype("<u4")
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256(prev)
        h.update(data[start : start + page_size].tobytes())
        prev = h.digest()
    return prev


def median_ns_per_token(fn, n_tokens: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n_tokens * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--page-sizes", default="1,16,64")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**31 - 1, args.tokens, dtype=np.int32)
    print(
        f"SHA extensions in use: {_core.sha256_accelerated()}; {args.tokens:,} tokens, "
        f"{args.repeats} repeats, median ns/token\n"
    )
    print("| page size | hiradix (SHA-NI) | hiradix (portable) | hashlib per page | SHA-NI speed-up |")
    print("|---|---|---|---|---|")
    for ps in (int(p) for p in args.page_sizes.split(",")):
        fast = median_ns_per_token(lambda ps=ps: _core.page_digests(tokens, ps), args.tokens, args.repeats)
        _core._test_set_portable_sha256(True)
        try:
            portable = median_ns_per_token(lambda ps=ps: _core.page_digests(tokens, ps), args.tokens, args.repeats)
        finally:
            _core._test_set_portable_sha256(False)
        n_ref = min(args.tokens, 200_000)
        ref = median_ns_per_token(lambda ps=ps, n=n_ref: hashlib_chain(tokens[:n], ps), n_ref, 3)
        print(f"| {ps} | {fast:.1f} | {portable:.1f} | {ref:.1f} | {ref / fast:.0f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
