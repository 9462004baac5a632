"""SGLang 0.5.23's ``UnifiedRadixCache`` on its three tree cores, side by side in one process:
the Rust core (``rust``, the ``mem_cache`` extension in SGLang's wheel), the Python core
(``python``) and hiradix's (``hiradix``, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix``:
``hiradix.sglang.tree_core`` over the compiled ``hiradix.tree._unified``, or its twin under
``HIRADIX_PUREPYTHON=1``). The FULL component on the device tier (no HiCache: hiradix's core
refuses it so far), page 1 and 16, through SGLang's own ``UnifiedRadixCache`` code, so each
figure is what the scheduler pays, wrapper included.

Workload, pools and requests are ``bench/sglang_api.py``'s (``bench/workload.py``: 200 system
prompts x 100 continuations, 256-2048 tokens, shuffled; ``--scale`` takes that fraction of the
prompts; device frees go to an O(1) counter for every core). Per repeat, for each core in turn
(the order rotates each repeat), on fresh caches (builds untimed):

``insert/s``      ``cache.insert(InsertParams(RadixKey(key), value))`` of every key, in order.
``match/s``       ``cache.match_prefix(MatchPrefixParams(RadixKey(key)))`` of every key on that
                  cache (all full hits; the scheduler reads ``device_prefix_len``).
``core_match/s``  the same matches, the core's ``match_prefix`` alone (``cache.tree_core``;
                  params built beforehand): the core's share of ``match/s``.
``evict_all``     one ``evict(EvictParams(evictable_size()))``: seconds.
``checkpoint/s``  a fresh cache: ``checkpoint_kv_cache(req, cache)`` of every sequence as a
                  running request (the scheduler's chunk checkpoint: insert, duplicate free, row
                  repointed, lock moved); untimed, each released as an abort.
``release/s``     a fresh cache: ``release_kv_cache(req, cache, checkpoint=True)`` of every
                  sequence as a finished request (checkpoint, tail freed, lock dropped).
``evict_1000``    on the release cache (all evictable): 1000 ``evict`` calls of
                  ``evictable // 1000`` tokens, plus one for the rest: seconds.

Checked untimed: every core caches the same number of tokens, full hits match the whole
aligned key on a sample, and the matched device indices agree between the cores on it; each
evict empties the tree; hiradix's ``check_invariants`` holds. Medians over ``--repeats``
after ``--warmup`` untimed repeats; the ratio rows divide hiradix's median by the Rust core's
measured in the same run (for seconds: Rust's over hiradix's; above 1 is faster).

Usage::

    PYTHONPATH=tests/stubs .venv-sglang23/bin/python bench/tree_core.py --scale 0.1 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from workload import make_workload  # noqa: E402

from hiradix.tree import UNIFIED_IMPLEMENTATION  # noqa: E402


def _import_sglang() -> None:
    """SGLang 0.5.23's cache and hiradix's tree core, imported once the arguments are parsed
    (``--help`` works without them)."""
    global EvictParams, InsertParams, MatchPrefixParams, CacheInitParams, checkpoint_kv_cache
    global release_kv_cache, RadixKey, ComponentType, UnifiedRadixCache, hs, HiradixTreeCore, sa
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang_api as sa
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        import hiradix.sglang as hs
        from hiradix.sglang.tree_core import HiradixTreeCore


CORES = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore", "hiradix": "HiradixTreeCore"}
RATES = ("insert_per_s", "match_per_s", "core_match_per_s", "checkpoint_per_s", "release_per_s")
TIMES = ("evict_all_s", "evict_1000_s")


def build(core: str, w: sa.Workload) -> tuple[Any, sa.FreeCounter]:
    alloc, freed = sa.cpu_pools(w.page_size, w.pool_size)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=w.req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=w.page_size,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=core,
    )
    cache = UnifiedRadixCache(params)
    got = type(cache.tree_core).__name__
    if got != CORES[core]:
        raise RuntimeError(f"{core}: UnifiedRadixCache built {got}, expected {CORES[core]} (a silent fallback)")
    return cache, freed


def timed(fn: Any) -> float:
    gc.collect()
    gc.freeze()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    gc.unfreeze()
    return dt


def one(core: str, w: sa.Workload, api: sa.Api23) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = len(w.keys)
    cache, _ = build(core, w)
    values = w.values

    def insert() -> None:
        ins = cache.insert
        for k, v in zip(w.keys, values, strict=True):
            ins(InsertParams(key=RadixKey(k), value=v))

    out["insert_per_s"] = n / timed(insert)
    cached = cache.evictable_size()

    def match() -> None:
        m = cache.match_prefix
        for k in w.keys:
            m(MatchPrefixParams(key=RadixKey(k))).device_prefix_len  # noqa: B018

    out["match_per_s"] = n / timed(match)
    params = [MatchPrefixParams(key=RadixKey(k)) for k in w.keys]

    def core_match() -> None:
        m = cache.tree_core.match_prefix
        for p in params:
            m(p)

    out["core_match_per_s"] = n / timed(core_match)
    sig = []
    for i in w.sample:
        r = cache.match_prefix(MatchPrefixParams(key=RadixKey(w.keys[i])))
        if r.device_prefix_len != w.aligned[i]:
            raise AssertionError(f"{core}: key {i} matched {r.device_prefix_len} of {w.aligned[i]}")
        sig.append(cache.tree_core.collect_full_device_indices(r.last_device_node, cache.tree_core.root_node_handle()))
    out["sig"] = [hash(s.numpy().tobytes()) for s in sig]
    out["cached"] = cached
    if isinstance(cache.tree_core, HiradixTreeCore):
        cache.tree_core.check_invariants()
    out["evict_all_s"] = timed(lambda: cache.evict(EvictParams(num_tokens=cache.evictable_size())))
    if cache.evictable_size() or cache.tree_core.total_size()[0]:
        raise AssertionError(f"{core}: evict-all left {cache.tree_core.total_size()}")
    del cache

    cache, _ = build(core, w)
    reqs = api.requests(w, finished=False)
    out["checkpoint_per_s"] = n / timed(lambda: [checkpoint_kv_cache(r, cache) for r in reqs])
    for r in reqs:
        release_kv_cache(r, cache, checkpoint=False)
    if cache.evictable_size() != cached:
        raise AssertionError(f"{core}: checkpoints cached {cache.evictable_size()}, inserts {cached}")
    del cache

    cache, _ = build(core, w)
    reqs = api.requests(w, finished=True)
    out["release_per_s"] = n / timed(lambda: [release_kv_cache(r, cache, checkpoint=True) for r in reqs])
    if cache.evictable_size() != cached or cache.protected_size():
        raise AssertionError(f"{core}: releases cached {cache.evictable_size()} ({cache.protected_size()} protected)")

    chunk = max(1, cache.evictable_size() // 1000)

    def evict_chunks() -> None:
        for _ in range(1000):
            cache.evict(EvictParams(num_tokens=chunk))
        if cache.evictable_size():
            cache.evict(EvictParams(num_tokens=cache.evictable_size()))

    out["evict_1000_s"] = timed(evict_chunks)
    if cache.evictable_size():
        raise AssertionError(f"{core}: chunked eviction left {cache.evictable_size()}")
    return out


def bench_page(ps: int, args: argparse.Namespace, cores: list[str]) -> dict[str, Any]:
    from sglang.srt.runtime_context import get_context

    seqs = make_workload(seed=args.seed, n_prompts=max(1, round(200 * args.scale)))
    w = sa.Workload(seqs, ps, args.seed)
    # the server's flags published as a launched server publishes them (the request calls read them)
    published = get_context().override_server_args(device="cpu", page_size=ps)
    published.install()
    try:
        return _bench_page(ps, args, cores, w)
    finally:
        published.restore()


def _bench_page(ps: int, args: argparse.Namespace, cores: list[str], w: sa.Workload) -> dict[str, Any]:
    api = sa.Api23()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cores}
    for rep in range(args.warmup + args.repeats):
        order = cores[rep % len(cores) :] + cores[: rep % len(cores)]
        for core in order:
            r = one(core, w, api)
            if rep >= args.warmup:
                runs[core].append(r)
            sa.log(f"page {ps} repeat {rep} {core}: " + " ".join(f"{k}={r[k]:.4g}" for k in (*RATES, *TIMES)))
    ref = runs[cores[0]][0]
    for core in cores[1:]:
        got = runs[core][0]
        if got["cached"] != ref["cached"] or got["sig"] != ref["sig"]:
            raise AssertionError(f"page {ps}: {core} caches or matches other slots than {cores[0]}")
    med = {c: {m: statistics.median(r[m] for r in runs[c]) for m in (*RATES, *TIMES)} for c in cores}
    allv = {c: {m: [r[m] for r in runs[c]] for m in (*RATES, *TIMES)} for c in cores}
    return {"median": med, "values": allv, "sequences": len(w.keys), "tokens": ref["cached"]}


def report(res: dict[int, dict[str, Any]], cores: list[str]) -> str:
    lines = []
    heads = ["insert/s", "match/s", "core match/s", "checkpoint/s", "release/s", "evict all (s)", "evict 1000x (s)"]
    for ps, r in res.items():
        lines.append(f"\npage {ps}: {r['sequences']} sequences, {r['tokens']} tokens cached\n")
        lines.append("| core | " + " | ".join(heads) + " |")
        lines.append("|---" * (len(heads) + 1) + "|")
        for c in cores:
            m = r["median"][c]
            cells = [f"{m[k]:,.0f}" for k in RATES] + [f"{m[k]:.4f}" for k in TIMES]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        for c in cores:
            if c == "rust":
                continue
            m, base = r["median"][c], r["median"]["rust"]
            cells = [f"{m[k] / base[k]:.2f}x" for k in RATES] + [f"{base[k] / m[k]:.2f}x" for k in TIMES]
            lines.append(f"| {c} / rust | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", default="rust,python,hiradix")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    _import_sglang()
    torch.set_num_threads(1)
    hs.register()
    sa.Api23().setup()
    cores = args.cores.split(",")
    if cores[0] != "rust":
        raise SystemExit("the Rust core comes first: the ratios are against it")
    res = {int(p): bench_page(int(p), args, cores) for p in args.page_sizes.split(",")}
    meta = {
        "machine": sa.machine(),
        "hiradix_tree": UNIFIED_IMPLEMENTATION,
        "scale": args.scale,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "purepython": os.environ.get("HIRADIX_PUREPYTHON", ""),
    }
    print(json.dumps(meta))
    print(report(res, cores))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": res}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
