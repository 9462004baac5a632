"""Long contexts: hiradix.sglang against SGLang's own hierarchical cache at million-token
requests and hundreds of thousands of leaves, both through SGLang's API on SGLang's CPU
pools, in one process (same machine, same minute). Issue 32, item 2.

Which SGLang is installed decides the pair (run once per venv):

- SGLang 0.5.18 (``.venv``): hiradix.sglang against 0.5.18's ``HiRadixCache``, both built
  by ``bench/sglang_api.py``'s ``build_cache`` (``create_tree_cache``, write_through,
  ``layer_first``, io ``direct``, host ratio 2; the CPU patches of
  ``bench/sglang_baselines.py``);
- SGLang 0.5.23 (``.venv-sglang23``): hiradix.sglang against 0.5.23's hierarchical
  ``UnifiedRadixCache`` on its Python tree core and on its Rust tree core, all built by
  ``tests/sglang/unified_env.py`` (``create_tree_cache`` with the flags published as a
  launched scheduler publishes them, its CPU stand-ins).

Pools: SGLang's ``MHATokenToKVPool`` (1 layer, 1 head, head_dim 1, bf16) sized for the
scenario, its ``TokenToKVPoolAllocator`` (page 1) and a ``ReqToTokenPool`` whose row
holds the whole request. Device slots handed back go to ``sglang_api.FreeCounter`` (an
O(1) counter) for every cache.

Scenarios (each cache built fresh, untimed; every timed call measured alone, wall time
and the calling thread's CPU time, ``time.thread_time``):

``chunked``  One request of ``--context`` tokens (default 1M, random ids) prefilled in
             ``--chunk``-token chunks (default 8K) through the scheduler's own calls: the
             request is admitted with ``req.init_next_round_input(cache)`` (0.5.23: and
             ``req.lock = cache.lock(req.last_node)``), each chunk's slots are written to
             its ``ReqToTokenPool`` row (the forward pass; untimed), then the timed call is
             0.5.18's ``cache.cache_unfinished_req(req, chunked=True)`` (after
             ``req.set_extend_range``) or 0.5.23's ``checkpoint_kv_cache(req, cache)`` (the
             body of the scheduler's ``stash_chunked_request``, after ``req.extend_end``),
             and then, timed on its own, ``cache.check_hicache_events()`` (the scheduler's
             once-per-step bookkeeping). Reported: the cost per chunk against the context
             length it reaches.
``bigram``   The same with EAGLE caches (``CacheInitParams.is_eagle``): every key is a
             bigram key, and the chunk call is the bigram insert + match (+ the row write
             and the lock move) of one prefill step.
``evict``    A tree of N evictable leaves (``--leaves``, default 10k, 30k, 100k, 300k):
             keys of a shared 16-token prefix and 4 tokens of their own, inserted (untimed)
             with ``check_hicache_events()`` every 256, every backup acknowledged; then
             ``--evict-calls`` calls of ``evict(EvictParams(num_tokens=1))`` (one page at
             page size 1), each timed, fewer (at least 5) for a cache whose calls take
             over ``--evict-budget`` seconds; the median per call.

Checked (a fast but wrong cache fails the run), between all caches of a run: after the
prefill, the tokens cached (evictable + protected), the length of a full-key match, the
request's ``ReqToTokenPool`` row (the tree's slots), its ``cache_protected_len`` (0.5.18:
and ``prefix_indices``); for eviction, the tokens each call evicted and those left
evictable. Each call's own results are checked too (cached tokens grow by the chunk).

Usage::

    PYTHONPATH=tests/stubs .venv/bin/python bench/long_context.py --quick          # a smoke run, seconds
    PYTHONPATH=tests/stubs .venv/bin/python bench/long_context.py --json lc18.json  # the table
    PYTHONPATH=tests/stubs .venv-sglang23/bin/python bench/long_context.py --json lc23.json
    .venv/bin/python bench/long_context.py --plot bench/long_context.png lc18.json lc23.json
    .venv/bin/python bench/long_context.py --report lc18.json   # the tables again
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import warnings
from array import array
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCENARIOS = ("chunked", "bigram", "evict")
PREFIX = 16  # shared tokens above the eviction scenario's leaves
LEAF = 4  # tokens of a leaf of its own
MARKS = (8192, 65536, 131072, 262144, 524288, 1048576)  # table rows (contexts)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def progress(it: Any, **kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(it, file=sys.stderr, leave=False, mininterval=1.0, **kw)


# ----------------------------------------------------------------------------- caches
class SGLang:
    """The installed SGLang: which caches to compare and how to drive a request."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        logging.getLogger("sglang").setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantizations
            import sglang
            from sglang.srt.managers.schedule_batch import Req
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
            from sglang.srt.mem_cache.radix_cache import RadixKey
            from sglang.srt.sampling.sampling_params import SamplingParams

            import hiradix.sglang as hs
            from hiradix.sglang.api import REQUEST_API
        self.torch, self.Req, self.SamplingParams = torch, Req, SamplingParams
        self.EvictParams, self.InsertParams, self.MatchPrefixParams, self.RadixKey = (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
            RadixKey,
        )
        self.version = sglang.__version__
        self.api = REQUEST_API
        if REQUEST_API == "cache_req":
            self.impls = ("hiradix", "sglang")
            self.labels = {"hiradix": "hiradix.sglang", "sglang": f"SGLang {self.version} HiRadixCache"}
        elif REQUEST_API == "checkpoint":
            self.impls = ("hiradix", "sglang", "sglang-rust")
            self.labels = {
                "hiradix": "hiradix.sglang",
                "sglang": f"SGLang {self.version} UnifiedRadixCache (Python core)",
                "sglang-rust": f"SGLang {self.version} UnifiedRadixCache (Rust core)",
            }
        else:
            raise SystemExit(f"SGLang {self.version}: this benchmark drives 0.5.18's and 0.5.23's request APIs")
        hs.register()
        self.stack = ExitStack()
        if self.v23:
            sys.path.insert(0, str(HERE.parent))
            from tests.sglang import unified_env as env

            self.env = env
            self.stack.enter_context(env.patch_sglang_for_cpu())
        else:
            import sglang_api

            sglang_api.patch_sglang_for_cpu()

    @property
    def v23(self) -> bool:
        return self.api == "checkpoint"

    def build(self, impl: str, pool_size: int, max_context: int, *, eagle: bool = False) -> tuple[Any, Any, Any]:
        """``(cache, req_to_token, freed)``: a cache built through SGLang's factory on CPU
        pools of ``pool_size`` slots and a 2-row ``ReqToTokenPool`` of ``max_context``."""
        import sglang_api
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        torch = self.torch
        req_to_token = ReqToTokenPool(size=2, max_context_len=max_context, device="cpu", enable_memory_saver=False)
        if not self.v23:
            cache, freed = sglang_api.build_cache(impl, 1, pool_size, req_to_token, {"is_eagle": eagle})
            return cache, req_to_token, freed
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        kv = MHATokenToKVPool(
            size=pool_size,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=1,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        alloc = TokenToKVPoolAllocator(size=pool_size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
        freed = sglang_api.FreeCounter()
        freed.install(alloc)
        pools = (kv, alloc, req_to_token)
        if impl == "hiradix":
            extra = json.dumps({"backup_copy": "inline"})
            e = self.env.build_hiradix(1, eagle=eagle, pools=pools, extra_config=extra)
        else:
            core = "rust" if impl == "sglang-rust" else "python"
            e = self.env.build(page_size=1, pools=pools, params={"is_eagle": eagle, "tree_core_backend": core})
            got = type(e.cache.tree_core).__name__
            if (core == "rust") != got.startswith("Rust"):
                raise RuntimeError(f"{impl}: asked for the {core} tree core, got {got}")
        return e.cache, req_to_token, freed

    def close(self, impl: str, cache: Any) -> None:
        if impl == "hiradix":
            cache.core.close()
        elif not self.v23:
            cache.release_host_resources()
        # 0.5.23: tests.sglang.unified_env shuts its caches down when the run ends

    # ------------------------------------------------------------------ a request
    def admit(self, cache: Any, req_to_token: Any, tokens: array) -> Any:
        """A request admitted as the scheduler admits it: its match (a miss), its lock
        (0.5.23) and a ``ReqToTokenPool`` row."""
        req = self.Req("long", "", tokens, self.SamplingParams(max_new_tokens=1))
        if self.v23:
            req.init_next_round_input(cache)
            req.lock = cache.lock(req.last_node)
            assert req_to_token.alloc([req]) is not None
        else:
            assert req_to_token.alloc([req]) is not None
            req.init_next_round_input(cache)
        assert req.prefix_len == 0 if self.v23 else len(req.prefix_indices) == 0
        return req

    def row(self, req: Any) -> int:
        return req.kv.req_pool_idx if self.v23 else req.req_pool_idx

    def protected_len(self, req: Any) -> int:
        return int(req.kv.cache_protected_len if self.v23 else req.cache_protected_len)

    def chunk_call(self, cache: Any, req: Any, start: int, end: int) -> Any:
        """What the scheduler does with a chunked request after its chunk ran: a closure."""
        if self.v23:
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            req.extend_end = end
            return lambda: checkpoint_kv_cache(req, cache)
        req.set_extend_range(start, end)
        return lambda: cache.cache_unfinished_req(req, chunked=True)

    def match_len(self, cache: Any, tokens: array, eagle: bool) -> int:
        m = cache.match_prefix(self.MatchPrefixParams(key=self.RadixKey(tokens, is_bigram=eagle)))
        return int(m.device_prefix_len) if self.v23 else len(m.device_indices)


def drain(cache: Any, timeout_s: float = 300.0) -> None:
    """Acknowledge every backup, as the scheduler's later steps would (bounded)."""
    deadline = time.monotonic() + timeout_s
    cache.check_hicache_events()  # starts the step's backups (hiradix batches them per step)
    while cache.ongoing_write_through:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(cache.ongoing_write_through)} backups in flight after {timeout_s} s")
        cache.check_hicache_events()
        time.sleep(0.001)  # a benchmark, not a test: let a copy thread run


class Timer:
    """Wall and calling-thread CPU time of one call."""

    __slots__ = ("cpu", "wall")

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def run(self, fn: Any) -> Any:
        w, t = time.perf_counter(), time.thread_time()
        out = fn()
        self.cpu.append(time.thread_time() - t)
        self.wall.append(time.perf_counter() - w)
        return out


# ----------------------------------------------------------------------------- scenarios
def prefill(sg: SGLang, impl: str, tokens: array, chunk: int, eagle: bool) -> dict:
    """One chunked prefill of ``tokens``; per-chunk timings and the end state."""
    torch = sg.torch
    total = len(tokens)
    cache, req_to_token, freed = sg.build(impl, total + 2, total + 8, eagle=eagle)
    req = sg.admit(cache, req_to_token, tokens)
    row = sg.row(req)
    slots = torch.arange(1, total + 1, dtype=torch.int32)  # as a fresh allocator hands them out
    call_t, events_t, ends = Timer(), Timer(), []
    gc.collect()
    gc.freeze()
    start = 0
    bigram = 1 if eagle else 0
    for end in progress(range(chunk, total + chunk, chunk), desc=f"{impl} {'bigram' if eagle else 'chunked'}"):
        end = min(end, total)
        req_to_token.write((row, slice(start, end)), slots[start:end])  # the chunk's forward pass
        call = sg.chunk_call(cache, req, start, end)
        call_t.run(call)
        events_t.run(cache.check_hicache_events)
        cached = cache.evictable_size() + cache.protected_size()
        if cached != end - bigram or sg.protected_len(req) != end - bigram:
            raise AssertionError(
                f"{impl}: after the chunk to {end}: {cached} tokens cached, protected length "
                f"{sg.protected_len(req)}; expected {end - bigram}"
            )
        ends.append(end)
        start = end
    gc.unfreeze()
    state = {
        "cached": cache.evictable_size() + cache.protected_size(),
        "match_len": sg.match_len(cache, tokens, eagle),
        "protected_len": sg.protected_len(req),
        "row": hash(req_to_token.req_to_token[row, :total].numpy().tobytes()),
        "freed": freed.tokens,
    }
    if not sg.v23:
        state["prefix_indices"] = hash(req.prefix_indices.to(torch.int32).numpy().tobytes())
    if state["match_len"] != total - bigram:
        raise AssertionError(f"{impl}: a full-key match found {state['match_len']} of {total - bigram}")
    if impl == "hiradix":
        cache.core.tree.check_invariants()
    sg.close(impl, cache)
    del cache, req
    gc.collect()
    return {
        "ends": ends,
        "call_wall": call_t.wall,
        "call_cpu": call_t.cpu,
        "events_wall": events_t.wall,
        "events_cpu": events_t.cpu,
        "state": state,
    }


def evict_run(sg: SGLang, impl: str, n_leaves: int, calls: int, budget_s: float) -> dict:
    """A tree of ``n_leaves`` evictable leaves, then ``calls`` one-page evictions (fewer,
    at least 5, where they take more than ``budget_s`` seconds of wall time in all)."""
    torch = sg.torch
    n_tokens = PREFIX + LEAF * n_leaves
    cache, _, freed = sg.build(impl, n_tokens + 2, 64)
    prefix = array("q", range(1, PREFIX + 1))
    insert, events = cache.insert, cache.check_hicache_events
    InsertParams, RadixKey = sg.InsertParams, sg.RadixKey
    values = torch.arange(1, n_tokens + 1, dtype=torch.int64)
    for i in progress(range(n_leaves), desc=f"{impl} build {n_leaves:,} leaves"):
        key = prefix + array("q", (100_000 + i, i % 977, i % 991, i % 997))
        if i == 0:
            v = values[: PREFIX + LEAF]
        else:
            v = torch.cat((values[:PREFIX], values[PREFIX + LEAF * i : PREFIX + LEAF * (i + 1)]))
        insert(InsertParams(key=RadixKey(key), value=v))
        if i % 256 == 255:
            events()
    drain(cache)
    evictable = cache.evictable_size()
    # (0.5.23's UnifiedRadixCache frees an insert's duplicate prefix slots itself)
    freed_before = freed.tokens
    if evictable != n_tokens or cache.protected_size() != 0:
        raise AssertionError(f"{impl}: {evictable} evictable of {n_tokens}, {cache.protected_size()} protected")
    t = Timer()
    evicted = []
    evict, EvictParams = cache.evict, sg.EvictParams
    gc.collect()
    gc.freeze()
    deadline = time.perf_counter() + budget_s
    for i in progress(range(calls), desc=f"{impl} evict at {n_leaves:,} leaves"):
        if i >= 5 and time.perf_counter() > deadline:
            break
        evicted.append(int(t.run(lambda: evict(EvictParams(num_tokens=1))).num_tokens_evicted))
    gc.unfreeze()
    left = cache.evictable_size()
    if sum(evicted) != evictable - left or freed.tokens - freed_before != sum(evicted):
        raise AssertionError(
            f"{impl}: evicted {sum(evicted)}, evictable {evictable} -> {left}, "
            f"{freed.tokens - freed_before} slots handed back"
        )
    if impl == "hiradix":
        cache.core.tree.check_invariants()
    sg.close(impl, cache)
    del cache, insert, events
    gc.collect()
    return {"wall": t.wall, "cpu": t.cpu, "evicted": evicted, "left": left}


def agree(results: dict[str, Any], what: str, key: str) -> None:
    """Every cache's ``key`` equal (a fast but wrong cache fails the run)."""
    seen = {impl: r[key] for impl, r in results.items()}
    if len({json.dumps(v, sort_keys=True) for v in seen.values()}) > 1:
        raise AssertionError(f"{what}: the caches disagree on {key}: {seen}")


# ----------------------------------------------------------------------------- driver
def median_of(runs: list[dict], field: str) -> list[float]:
    """Per call, the median over repeats of ``field``."""
    return [statistics.median(r[field][i] for r in runs) for i in range(len(runs[0][field]))]


def bench_prefill(sg: SGLang, args: argparse.Namespace, eagle: bool) -> dict:
    rng = np.random.default_rng(args.seed)
    tokens = array("q", rng.integers(0, 120_000, args.context, dtype=np.int64).tobytes())
    runs: dict[str, list[dict]] = {i: [] for i in args.impls}
    for r in range(-args.warmup, args.repeats):
        order = args.impls if r % 2 == 0 else args.impls[::-1]  # alternate: drift hits all alike
        for impl in order:
            res = prefill(sg, impl, tokens, args.chunk, eagle)
            log(
                f"  {'warm-up' if r < 0 else f'repeat {r + 1}'} {impl}: last chunk {res['call_cpu'][-1] * 1e3:.3f} ms "
                f"cpu, total {sum(res['call_wall']):.2f} s wall"
            )
            if r >= 0:
                runs[impl].append(res)
    agree({i: v[0]["state"] for i, v in runs.items()}, "bigram" if eagle else "chunked", "cached")
    for key in ("match_len", "protected_len", "row", "freed", "prefix_indices"):
        if key in runs[args.impls[0]][0]["state"]:
            agree({i: v[0]["state"] for i, v in runs.items()}, "bigram" if eagle else "chunked", key)
    out: dict[str, Any] = {"context": args.context, "chunk": args.chunk, "ends": runs[args.impls[0]][0]["ends"]}
    for impl, rs in runs.items():
        out[impl] = {f: median_of(rs, f) for f in ("call_wall", "call_cpu", "events_wall", "events_cpu")}
        out[impl]["state"] = rs[0]["state"]
    return out


def bench_evict(sg: SGLang, args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"leaves": args.leaves, "calls": args.evict_calls, "budget_s": args.evict_budget}
    for n in args.leaves:
        res = {}
        for impl in args.impls:
            res[impl] = evict_run(sg, impl, n, args.evict_calls, args.evict_budget)
            log(
                f"  {n:,} leaves {impl}: median {statistics.median(res[impl]['cpu']) * 1e6:.1f} us cpu per evict "
                f"({len(res[impl]['cpu'])} calls)"
            )
        # every cache evicted the same tokens call by call (over the calls all of them made)
        k = min(len(r["evicted"]) for r in res.values())
        agree({impl: {"evicted": r["evicted"][:k]} for impl, r in res.items()}, f"evict at {n} leaves", "evicted")
        out[str(n)] = {
            impl: {
                "wall": statistics.median(r["wall"]),
                "cpu": statistics.median(r["cpu"]),
                "wall_runs": r["wall"],
                "cpu_runs": r["cpu"],
                "evicted": sum(r["evicted"][:k]),
                "calls": len(r["cpu"]),
            }
            for impl, r in res.items()
        }
    return out


def machine() -> dict:
    sys.path.insert(0, str(HERE))
    import sglang_api

    return sglang_api.machine()  # the platform among the rest


def flat_ratio(ends: list[int], ys: list[float]) -> float:
    """Cost at the largest contexts over cost at the smallest: the median of the last
    eight chunks over that of the eight after the first (the first chunk of a request is
    its admission's: nothing to continue from yet); 1 for a cost independent of the
    context."""
    k = min(8, (len(ys) - 1) // 2) or 1
    first = ys[1 : 1 + k] if len(ys) > 1 else ys
    return statistics.median(ys[-k:]) / statistics.median(first)


def report(results: dict, meta: dict) -> str:
    labels = meta["labels"]
    impls = meta["impls"]
    lines = [
        f"SGLang {meta['sglang']}; {meta['machine']['cpu']}, {meta['machine']['nproc']} cores; load "
        f"{', '.join(f'{x:.2f}' for x in meta['machine']['load'])} before, "
        f"{', '.join(f'{x:.2f}' for x in meta['load_after'])} after; hiradix {meta['machine']['hiradix']}."
    ]
    for name in ("chunked", "bigram"):
        if name not in results:
            continue
        r = results[name]
        ends = r["ends"]
        rows = [i for i, e in enumerate(ends) if e in MARKS or i in (0, len(ends) - 1)]
        lines += [
            "",
            f"**{name}**: one {r['context']:,}-token request in {r['chunk']:,}-token chunks, "
            f"{'EAGLE bigram keys, ' if name == 'bigram' else ''}ms per chunk call (thread CPU / wall; "
            f"median of {meta['repeats']} repeats), and the step's `check_hicache_events`:",
            "",
            "| context | "
            + " | ".join(f"{labels[i]} call" for i in impls)
            + " | "
            + " | ".join(f"SGLang / hiradix ({i})" for i in impls[1:])
            + " | hiradix events |",
            "|---" * (2 * len(impls) + 1) + "|",
        ]
        for i in sorted(set(rows)):
            cells = [f"{r[impl]['call_cpu'][i] * 1e3:.3f} / {r[impl]['call_wall'][i] * 1e3:.3f}" for impl in impls]
            ratios = [f"{r[impl]['call_cpu'][i] / r['hiradix']['call_cpu'][i]:.0f}×" for impl in impls[1:]]
            lines.append(
                f"| {ends[i]:,} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(ratios)
                + f" | {r['hiradix']['events_cpu'][i] * 1e3:.3f} |"
            )
        k = min(8, len(ends) - 1) or 1
        tail = [statistics.median(r[impl]["call_cpu"][-k:]) for impl in impls]
        lines.append(
            f"| median of the last {k} chunks ({ends[-k]:,}–{ends[-1]:,}) | "
            + " | ".join(f"{t * 1e3:.3f}" for t in tail)
            + " | "
            + " | ".join(f"{t / tail[0]:.0f}×" for t in tail[1:])
            + " | |"
        )
        flat = [f"{flat_ratio(ends, r[impl]['call_cpu']):.2f}" for impl in impls]
        lines.append("| flatness: last 8 / chunks 2-9 | " + " | ".join(flat) + " |" + " |" * len(impls))
    if "evict" in results:
        r = results["evict"]
        lines += [
            "",
            f"**evict**: one page (`evict(EvictParams(num_tokens=1))`, page 1) with N evictable leaves, "
            f"µs per call (thread CPU / wall; median of up to {r['calls']} calls, fewer for a cache whose "
            f"calls took over {r.get('budget_s', '?')} s):",
            "",
            "| leaves | "
            + " | ".join(labels[i] for i in impls)
            + " | "
            + " | ".join(f"SGLang / hiradix ({i})" for i in impls[1:])
            + " |",
            "|---" * (2 * len(impls)) + "|",
        ]
        for n in r["leaves"]:
            x = r[str(n)]
            cells = [f"{x[i]['cpu'] * 1e6:,.1f} / {x[i]['wall'] * 1e6:,.1f}" if i in x else "not run" for i in impls]
            ratios = [f"{x[i]['cpu'] / x['hiradix']['cpu']:,.0f}×" if i in x else "" for i in impls[1:]]
            lines.append(f"| {n:,} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def plot(out: Path, files: list[Path]) -> None:
    """One PNG: cost per call against context (chunked, bigram) and against leaves
    (evict), every cache of every run given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    styles = {"hiradix": "-", "sglang": "--", "sglang-rust": ":"}
    for f in files:
        data = json.loads(f.read_text())
        meta, res = data["meta"], data["results"]
        for ax, name in zip(axes[:2], ("chunked", "bigram"), strict=True):
            if name not in res:
                continue
            r = res[name]
            for impl in meta["impls"]:
                ax.plot(
                    r["ends"],
                    [y * 1e3 for y in r[impl]["call_cpu"]],
                    styles[impl],
                    label=f"{meta['labels'][impl]} ({meta['sglang']})"
                    if impl != "hiradix"
                    else f"hiradix.sglang on SGLang {meta['sglang']}",
                )
        if "evict" in res:
            r = res["evict"]
            for impl in meta["impls"]:
                leaves = [n for n in r["leaves"] if impl in r[str(n)]]
                axes[2].plot(
                    leaves,
                    [r[str(n)][impl]["cpu"] * 1e6 for n in leaves],
                    styles[impl],
                    marker="o",
                    label=f"{meta['labels'][impl]}"
                    if impl != "hiradix"
                    else f"hiradix.sglang on SGLang {meta['sglang']}",
                )
    for ax, title, xl, yl, target in (
        (axes[0], "chunked prefill: cost per chunk call", "context (tokens)", "ms per call (thread CPU)", 0.2),
        (axes[1], "EAGLE bigram keys: cost per chunk call", "context (tokens)", "ms per call (thread CPU)", 1.0),
        (axes[2], "evict one page", "evictable leaves", "µs per call (thread CPU)", 50.0),
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(target, color="grey", linewidth=0.8)
        ax.text(ax.get_xlim()[0] if ax.lines else 1, target, " target", va="bottom", color="grey", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    log(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--impls", help="comma-separated subset of the installed SGLang's caches (default: all)")
    ap.add_argument("--context", type=int, default=1 << 20, help="tokens of the long request (default 1M)")
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per prefill chunk (default 8K)")
    ap.add_argument("--leaves", default="10000,30000,100000,300000")
    ap.add_argument("--evict-calls", type=int, default=50, help="evictions per cache and tree (default 50)")
    ap.add_argument(
        "--evict-budget",
        type=float,
        default=30.0,
        help="seconds of wall time after which a cache's evictions stop (at least 5; default 30)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="prefills per cache (default 3; medians)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed prefills per cache first (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (seconds): 16K context, 200 and 500 leaves, 5 evictions, 1 repeat",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument(
        "--plot", nargs="+", type=Path, metavar=("PNG", "JSON"), help="plot runs' JSON files into PNG and exit"
    )
    ap.add_argument("--report", type=Path, metavar="JSON", help="print the tables of a run's JSON file and exit")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(args.report.read_text())
        print(report(data["results"], data["meta"]))
        return 0
    if args.plot:
        if len(args.plot) < 2:
            ap.error("--plot PNG JSON [JSON ...]")
        plot(args.plot[0], args.plot[1:])
        return 0
    if args.quick:
        args.context, args.leaves, args.evict_calls, args.repeats, args.warmup = 1 << 14, "200,500", 5, 1, 0
    args.scenarios = args.scenarios.split(",")
    args.leaves = [int(x) for x in args.leaves.split(",")]
    if args.repeats < 1 or args.chunk < 1 or args.context < 2 * args.chunk:
        ap.error("need --repeats >= 1 and --context >= 2 chunks")
    sg = SGLang()
    with sg.stack:
        args.impls = tuple(args.impls.split(",")) if args.impls else sg.impls
        if args.impls[0] != "hiradix" or not set(args.impls) <= set(sg.impls):
            ap.error(f"--impls: hiradix first, then any of {sg.impls}")
        meta = {
            "sglang": sg.version,
            "impls": list(args.impls),
            "labels": sg.labels,
            "machine": machine(),
            "repeats": args.repeats,
            "warmup": args.warmup,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        log(
            f"SGLang {sg.version}; {meta['machine']['cpu']}, load {meta['machine']['load']}; "
            f"hiradix {meta['machine']['hiradix']}"
        )
        t0 = time.perf_counter()
        results: dict[str, Any] = {}
        for name in args.scenarios:
            log(f"{name}:")
            if name == "evict":
                results[name] = bench_evict(sg, args)
            else:
                results[name] = bench_prefill(sg, args, eagle=name == "bigram")
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        meta["load_after"] = os.getloadavg()
        print(report(results, meta))
        log(f"elapsed {meta['elapsed_s']} s")
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip tearing down the trees object by object
