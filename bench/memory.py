"""Memory per cached token: the metadata hiradix.sglang's cache holds against SGLang's own
hierarchical caches, per cached token and per tree node, at page 1 and 16.

Caches measured, each built by its SGLang's ``create_tree_cache`` on SGLang's CPU pools
(hierarchical cache, write_through, ``layer_first`` host layout, io backend ``direct``,
host/device ratio 2), as the API benchmarks build them:

``hiradix-0.5.18``   hiradix.sglang (``--radix-cache-backend hiradix``) under SGLang 0.5.18
                     (``.venv``), built by ``bench/sglang_api.py``'s ``build_cache``;
``sglang-0.5.18``    SGLang 0.5.18's ``HiRadixCache`` (the same builder);
``hiradix-0.5.23``   hiradix.sglang under SGLang 0.5.23 (``.venv-sglang23``), built by
                     ``tests/sglang/unified_env.py``'s ``build_hiradix``;
``unified-python``   SGLang 0.5.23's hierarchical ``UnifiedRadixCache`` on its Python tree
                     core (``CacheInitParams.tree_core_backend="python"``, what
                     ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` selects), built by ``build``;
``unified-rust``     the same on its Rust tree core (0.5.23's default).

The KV pools are tiny (1 layer, 1 head, head_dim 1), so their bytes are small beside the
metadata, and are excluded anyway (below).

Each cache is measured in a fresh subprocess (the driver runs each SGLang's Python), so
nothing an earlier cache left in the heap counts:

1. the workload's keys (``array('q')``) and slot tensors are built (inputs, held
   throughout); ``gc.collect()``; ``R0`` = resident set (``/proc/self/statm``);
2. the cache is built with its pools; every tensor/array reachable from the device
   allocator, its KV pool, the host pool and the req-to-token pool is touched (rewritten
   in place, so pages the pools reserved but never wrote are resident in every
   cache alike) and its bytes summed (``pools``: KV, host and device free lists, the
   req-to-token rows); ``gc.collect()``; ``R1``;
3. every key is inserted (``insert(InsertParams(RadixKey(key), slots))`` then
   ``check_hicache_events()``, as ``bench/sglang_api.py``; key and slots are fresh copies
   per call, as a request's are, so that what a cache keeps a view of counts as its
   own), the backups drained (every
   node on device and host, as a write-through server holds them); ``gc.collect()``; ``R2``.

Reported: ``built`` = R1 - R0 - pools (what the cache itself holds when empty; until
bench/RESULTS_memory.md's run 2, for hiradix.sglang, its tree's token/slot buffers
reserved and touched at start-up for the device and host pools' capacity, 20 bytes a
token; since, they grow as tokens are cached), ``grown`` = R2 - R1 (what the inserts
added), and the headline ``metadata`` = built + grown, per cached token and per node. A
second subprocess per cache (up to ``--tracemalloc-max-tokens``) runs the same with
``tracemalloc`` started before the build
and gives the Python heap's share (Python objects, and numpy buffers, which numpy reports
to tracemalloc; not torch's storages nor the compiled tree's own C buffers, which only RSS
sees).

Workload: ``bench/workload.py``'s shared-prefix sequences (200 system prompts x 100
continuations at full scale, shuffled), the prompts scaled and the sequences taken in
workload order until about ``--tokens`` distinct tokens are cached. Sequence ``i``'s slots
are its prompt's slots (those of the first sequence with that prompt) for the prompt's
whole pages, fresh slots after, as a scheduler's request holds them after a prefix match;
the device pool holds every distinct token (so nothing is evicted), the host pool twice
that. The same keys and slots for every cache; the driver checks that all caches cache the
same number of tokens and (where the cache can count them) nodes; each worker checks that a
sample of keys are full device hits.

Usage::

    PYTHONPATH=. .venv/bin/python bench/memory.py --tokens 1000000,10000000 --json out.json   # the table
    PYTHONPATH=. .venv/bin/python bench/memory.py --tokens 20000 --page-sizes 16 --no-tracemalloc  # seconds
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

IMPLS = {
    # name: (venv python, label)
    "hiradix-0.5.18": (".venv", "hiradix.sglang (on 0.5.18)"),
    "sglang-0.5.18": (".venv", "SGLang 0.5.18 HiRadixCache"),
    "hiradix-0.5.23": (".venv-sglang23", "hiradix.sglang (on 0.5.23)"),
    "unified-python": (".venv-sglang23", "SGLang 0.5.23 UnifiedRadixCache, Python core"),
    "unified-rust": (".venv-sglang23", "SGLang 0.5.23 UnifiedRadixCache, Rust core"),
}
SGLANG_IMPLS = ("sglang-0.5.18", "unified-python", "unified-rust")
DISTINCT_PER_PROMPT = 15.0e6 / 200  # distinct tokens per system prompt in the full workload
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss() -> int:
    """Resident bytes of this process, after a full collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ----------------------------------------------------------------------------- workload
def workload(tokens: int, page_size: int, seed: int) -> tuple[list[array], list[Any], int]:
    """Keys (page aligned), their slot tensors and the device pool size (see the module
    docstring). Deterministic in ``tokens`` and ``seed``; the same sequences at every page
    size."""
    import numpy as np
    import torch
    from workload import make_workload

    n_prompts = max(1, math.ceil(tokens / DISTINCT_PER_PROMPT * 1.2))
    seqs = make_workload(seed=seed, n_prompts=n_prompts)
    ps = page_size
    prompt_len = 128  # every prompt is at least this long: its first tokens name it
    seen: dict[bytes, tuple[int, Any]] = {}  # prompt head -> (shared aligned length bound, slots)
    keys: list[array] = []
    values: list[Any] = []
    nxt = ps  # slot 0 is SGLang's padding slot: fresh slots from page_size on
    distinct = 0
    for s in seqs:
        n = len(s) // ps * ps
        if n == 0:
            continue
        head = s[:prompt_len].tobytes()
        fresh_from = 0
        first = seen.get(head)
        if first is not None:
            # the prompt's tokens are shared; its whole pages are cached (by the first)
            other_slots, other_seq = first
            common = int(np.argmin(np.concatenate((s[: len(other_seq)] == other_seq[: len(s)], [False]))))
            fresh_from = min(common // ps * ps, n, len(other_slots))
        new = n - fresh_from
        slots = torch.arange(nxt, nxt + new, dtype=torch.int64)
        nxt += new
        if fresh_from:
            slots = torch.cat((first[0][:fresh_from], slots))
        if first is None:
            seen[head] = (slots, s[:n])
        keys.append(array("q", s[:n].astype(np.int64).tobytes()))
        values.append(slots)
        distinct += new
        if distinct >= tokens:
            break
    else:
        raise RuntimeError(f"the workload of {n_prompts} prompts has only {distinct} distinct tokens")
    return keys, values, nxt


# ----------------------------------------------------------------------------- the pools
def _arrays(obj: Any, depth: int, seen: set[int], out: list[Any]) -> None:
    """Every tensor / ndarray reachable from ``obj`` through attributes, lists, tuples and
    dicts, ``depth`` levels deep."""
    import numpy as np
    import torch

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        out.append(obj)
        return
    if depth == 0 or isinstance(obj, (str, bytes, int, float, type)):
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        try:
            items = list(vars(obj).values())
        except TypeError:
            return
    for x in items:
        _arrays(x, depth - 1, seen, out)


def touch_pools(roots: list[Any]) -> tuple[int, int]:
    """Rewrite in place every buffer reachable from ``roots`` (values unchanged), so all
    their pages are resident; returns their bytes (each storage once), and those of numpy
    arrays alone (numpy reports its buffers to tracemalloc, torch does not)."""
    import numpy as np
    import torch

    found: list[Any] = []
    seen: set[int] = set()
    for r in roots:
        _arrays(r, 4, seen, found)
    total, numpy_bytes, done = 0, 0, set()
    for a in found:
        if isinstance(a, torch.Tensor):
            st = a.untyped_storage()
            if st.data_ptr() in done or st.nbytes() == 0:
                continue
            done.add(st.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8).set_(st)
            flat.add_(0)  # a write per byte: every page resident, nothing changed
            total += st.nbytes()
        else:
            base = a
            while isinstance(base.base, np.ndarray):
                base = base.base
            if base.ctypes.data in done or base.nbytes == 0 or not base.flags.c_contiguous:
                continue
            done.add(base.ctypes.data)
            if base.flags.writeable:
                flat = base.reshape(-1).view(np.uint8)
                flat += 0
            total += base.nbytes
            numpy_bytes += base.nbytes
    return total, numpy_bytes


# ----------------------------------------------------------------------------- caches
class Built:
    """One cache, the way to drain its backups and count its nodes."""

    def __init__(self, cache: Any, impl: str, roots: list[Any]) -> None:
        self.cache, self.impl, self.roots = cache, impl, roots

    def drain(self) -> None:
        cache = self.cache
        if self.impl.startswith("hiradix"):
            deadline = time.monotonic() + 300
            while cache.core.ongoing_write_through:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.impl}: backups still in flight after 300 s")
                cache.core.flush()
                cache.check_hicache_events()
        else:
            cache.check_hicache_events()  # SGLang's L1 -> L2 copies are synchronous on CPU
            if hasattr(cache, "writing_check"):
                cache.writing_check()
            if cache.ongoing_write_through:
                raise RuntimeError(f"{self.impl}: {len(cache.ongoing_write_through)} backups in flight")
        if cache.protected_size() != 0:
            raise AssertionError(f"{self.impl}: {cache.protected_size()} tokens protected after the acks")

    def nodes(self) -> int | None:
        """Tree nodes below the root(s); ``None`` where the cache cannot say (0.5.23's Rust
        core ports no ``root_node``)."""
        if self.impl.startswith("hiradix"):
            return int(self.cache.core.tree.num_nodes())
        if self.impl == "unified-rust":
            return None
        stack, n = list(self.cache.root_node.children.values()), 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n


def setup_v18() -> None:
    import sglang_api

    sglang_api.patch_sglang_for_cpu()
    sglang_api.hs.register()


def build_v18(impl: str, page_size: int, pool_size: int) -> Built:
    import sglang_api
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_to_token = ReqToTokenPool(size=64, max_context_len=4096, device="cpu", enable_memory_saver=False)
    cache, _freed = sglang_api.build_cache(impl.split("-")[0], page_size, pool_size, req_to_token)
    roots = [cache.token_to_kv_pool_allocator, cache.token_to_kv_pool_host, req_to_token]
    return Built(cache, impl, roots)


_V23_PATCH: Any = None


def setup_v23() -> None:
    global _V23_PATCH
    sys.path.insert(0, str(ROOT))
    from tests.sglang import pools as sglang_pools

    # 1 layer, 1 head, head_dim 1 (the tests' pools are 3 x 2 x 4): tiny KV, as on 0.5.18
    sglang_pools.LAYERS = sglang_pools.HEADS = sglang_pools.HEAD_DIM = 1
    from tests.sglang import unified_env as ue

    _V23_PATCH = ue.patch_sglang_for_cpu()
    _V23_PATCH.__enter__()  # held to the worker's end: the caches read the flags it publishes


def build_v23(impl: str, page_size: int, pool_size: int) -> Built:
    from tests.sglang import unified_env as ue

    if impl == "hiradix-0.5.23":
        env = ue.build_hiradix(page_size, size=pool_size)
        host = env.cache.token_to_kv_pool_host
    else:
        env = ue.build(page_size=page_size, size=pool_size, params={"tree_core_backend": impl.split("-")[1]})
        core = type(env.cache.tree_core).__name__
        want = "RustUnifiedTreeCore" if impl == "unified-rust" else "UnifiedTreeCore"
        if core != want:
            raise RuntimeError(f"{impl}: SGLang built a {core}")
        host = env.cache.cache_controller.mem_pool_host
    return Built(env.cache, impl, [env.allocator, env.kv, host, env.req_to_token])


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    impl, ps = args.worker, args.page_size
    t0 = time.perf_counter()
    keys, values, pool_size = workload(args.tokens, ps, args.seed)
    v23 = impl.endswith("0.5.23") or impl.startswith("unified")
    setup, builder = (setup_v23, build_v23) if v23 else (setup_v18, build_v18)
    setup()
    # A warm-up cache of the same kind, kept: the modules it imports on first use and what
    # is made once per process are in the baseline, not in the cache measured.
    warm = builder(impl, ps, 64 * ps)
    warm.drain()
    r0 = rss()
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start()
    built = builder(impl, ps, pool_size)
    cache = built.cache
    pools, numpy_pools = touch_pools(built.roots)
    r1 = rss()
    t1 = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
    import importlib

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a convenience only

        def tqdm(it: Any, **kw: Any) -> Any:
            return it

    insert, events = cache.insert, cache.check_hicache_events
    for k, v in tqdm(
        list(zip(keys, values, strict=True)), desc=f"{impl} page {ps}", disable=not args.progress, mininterval=2.0
    ):
        # A request's own copies, as the scheduler's are: SGLang's nodes keep views of the
        # slots (and its key slices), so what they retain is counted, not the inputs'
        # (held throughout, in the baseline); hiradix copies both into its buffers.
        insert(InsertParams(key=RadixKey(array("q", k)), value=v.clone()))
        events()
    built.drain()
    r2 = rss()
    t2 = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
    if args.tracemalloc:
        tracemalloc.stop()
    cached = int(cache.evictable_size())
    # checks (after the readings): a sample of keys are full device hits
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    for i in range(0, len(keys), max(1, len(keys) // 50)):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(keys[i])))
        n = getattr(m, "device_prefix_len", None)
        n = len(m.device_indices) if n is None else int(n)
        if n != len(keys[i]):
            raise AssertionError(f"{impl}: key {i} matched {n} of {len(keys[i])} tokens")
    return {
        "impl": impl,
        "page_size": ps,
        "target_tokens": args.tokens,
        "keys": len(keys),
        "cached_tokens": cached,
        "nodes": built.nodes(),
        "pool_slots": pool_size,
        "pools_bytes": pools,
        "built_bytes": r1 - r0 - pools,
        "grown_bytes": r2 - r1,
        "traced_built_bytes": (t1 - numpy_pools) if args.tracemalloc else None,
        "traced_grown_bytes": (t2 - t1) if args.tracemalloc else None,
        "tracemalloc": args.tracemalloc,
        "seconds": round(time.perf_counter() - t0, 1),
        "sglang": importlib.import_module("importlib.metadata").version("sglang"),
    }


# ----------------------------------------------------------------------------- driver
def run_worker(impl: str, ps: int, tokens: int, trace: bool, args: argparse.Namespace) -> dict | None:
    """One cache measured in its own subprocess; ``None`` if it ran past ``--timeout``."""
    venv, _ = IMPLS[impl]
    python = {".venv": args.python_v18, ".venv-sglang23": args.python_v23}[venv] or (
        Path(args.venv_root) / venv / "bin" / "python"
    )
    cmd = [
        str(python),
        str(Path(__file__).resolve()),
        "--worker",
        impl,
        "--page-size",
        str(ps),
        "--tokens",
        str(tokens),
        "--seed",
        str(args.seed),
    ]
    if trace:
        cmd.append("--tracemalloc")
    if args.progress:
        cmd.append("--progress")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "stubs"), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=None if args.progress else subprocess.PIPE,
            text=True,
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        log(f"  {impl:15s} page {ps:2d}: not measured, over --timeout {args.timeout:.0f} s")
        return None
    if p.returncode != 0:
        raise RuntimeError(
            f"{impl} page {ps} {tokens} tokens failed (rc {p.returncode}):\n{p.stderr or ''}\n{p.stdout[-2000:]}"
        )
    res = json.loads(p.stdout.strip().splitlines()[-1])
    log(
        f"  {impl:15s} page {ps:2d} {'tracemalloc' if trace else 'rss':11s}: {res['cached_tokens']:,} tokens, "
        f"{res['nodes']} nodes, built {res['built_bytes'] / 2**20:,.1f} MiB, grown "
        f"{res['grown_bytes'] / 2**20:,.1f} MiB ({time.perf_counter() - t0:.0f} s)"
    )
    return res


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for tokens in args.tokens_list:
        for ps in args.page_sizes:
            runs: dict[str, dict] = {}
            for impl in args.impls:
                res = run_worker(impl, ps, tokens, False, args)
                if res is None:
                    args.missed.append(f"{impl} at page {ps}, {tokens:,} tokens: over --timeout {args.timeout:.0f} s")
                    continue
                if args.tracemalloc and tokens <= args.tracemalloc_max_tokens:
                    tr = run_worker(impl, ps, tokens, True, args)
                    if tr is None:
                        runs[impl] = res
                        continue
                    if tr["cached_tokens"] != res["cached_tokens"]:
                        raise AssertionError(
                            f"{impl}: the tracemalloc run cached {tr['cached_tokens']} tokens, "
                            f"the RSS run {res['cached_tokens']}"
                        )
                    res["traced_built_bytes"] = tr["traced_built_bytes"]
                    res["traced_grown_bytes"] = tr["traced_grown_bytes"]
                runs[impl] = res
            if runs:
                check(runs)
            rows.extend(runs.values())
            if args.json:  # after every group: a run cut short keeps what it measured
                args.json.write_text(
                    json.dumps({"meta": args.meta, "rows": rows, "not_measured": args.missed}, indent=1)
                )
    return rows


def check(runs: dict[str, dict]) -> None:
    """Every cache cached the same tokens in the same number of nodes (where it counts them)."""
    tokens = {r["cached_tokens"] for r in runs.values()}
    if len(tokens) != 1:
        raise AssertionError("cached tokens differ: " + ", ".join(f"{i} {r['cached_tokens']}" for i, r in runs.items()))
    nodes = {r["nodes"] for r in runs.values() if r["nodes"] is not None}
    if len(nodes) > 1:
        raise AssertionError("node counts differ: " + ", ".join(f"{i} {r['nodes']}" for i, r in runs.items()))
    n = nodes.pop() if nodes else None
    for r in runs.values():
        r["nodes_counted"] = r["nodes"] is not None
        if r["nodes"] is None:
            r["nodes"] = n  # the same keys make the same radix tree (the other caches' count)


def metadata(r: dict) -> int:
    return int(r["built_bytes"] + r["grown_bytes"])


def table(rows: list[dict]) -> str:
    lines = [
        "| cached tokens | page | nodes | cache | metadata B/token | B/node | built MiB | grown MiB "
        "| tracemalloc B/token | vs smallest SGLang |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["target_tokens"], r["page_size"]), []).append(r)
    for (_, ps), rs in groups.items():
        theirs = [metadata(r) for r in rs if r["impl"] in SGLANG_IMPLS]
        smallest = min(theirs) if theirs else None
        for r in rs:
            tok, nodes = r["cached_tokens"], r["nodes"]
            traced = r.get("traced_built_bytes")
            tm = "" if traced is None else f"{(traced + r['traced_grown_bytes']) / tok:,.1f}"
            vs = "" if smallest is None else f"{metadata(r) / smallest:.2f}"
            # a group of caches none of which counts its nodes (the Rust core alone): unknown
            per_node = "" if nodes is None else f"{metadata(r) / nodes:,.0f}"
            counted = "?" if nodes is None else f"{nodes:,}{'' if r.get('nodes_counted', True) else '*'}"
            lines.append(
                f"| {tok:,} | {ps} | {counted} | {IMPLS[r['impl']][1]} "
                f"| {metadata(r) / tok:,.1f} | {per_node} | {r['built_bytes'] / 2**20:,.1f} "
                f"| {r['grown_bytes'] / 2**20:,.1f} | {tm} | {vs} |"
            )
    return "\n".join(lines)


def machine() -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": len(os.sched_getaffinity(0)),
        "load": os.getloadavg(),
        "commit": rev,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1000000,10000000", help="cached tokens to reach, comma separated")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-tracemalloc",
        dest="tracemalloc",
        action="store_false",
        help="skip the second (tracemalloc) subprocess per cache",
    )
    ap.add_argument(
        "--tracemalloc-max-tokens",
        type=float,
        default=2e6,
        help="the tracemalloc subprocess only up to this many tokens (default 2M: it doubles "
        "the run time, and the Python heap's share is the same at 10M)",
    )
    ap.add_argument(
        "--venv-root",
        default=str(Path(__file__).resolve().parent.parent),
        help="folder holding .venv and .venv-sglang23 (default: this checkout, where .ci/setup makes them)",
    )
    ap.add_argument("--python-v18", help="the Python of SGLang 0.5.18 (default VENV_ROOT/.venv/bin/python)")
    ap.add_argument("--python-v23", help="the Python of SGLang 0.5.23 (default VENV_ROOT/.venv-sglang23/bin/python)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    ap.add_argument("--progress", action="store_true", help="tqdm progress bars of the inserts")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--table-from",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="measure nothing: print the table of these --json files' rows (a later file's row "
        "replaces an earlier one's for the same cache, page size and size)",
    )
    # a worker: one cache, one page size, one size; prints its JSON row
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--page-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tracemalloc", action="store_true", dest="trace_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.tokens = int(args.tokens)
        args.tracemalloc = args.trace_worker
        import logging
        import warnings

        warnings.simplefilter("ignore")
        logging.getLogger("sglang").setLevel(logging.ERROR)
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.table_from:
        merged: dict[tuple[int, int, str], dict] = {}
        for f in args.table_from:
            for r in json.loads(f.read_text())["rows"]:
                merged[(r["target_tokens"], r["page_size"], r["impl"])] = r
        order = list(IMPLS)
        rows = [merged[k] for k in sorted(merged, key=lambda k: (k[0], k[1], order.index(k[2])))]
        for _, group in itertools.groupby(rows, key=lambda r: (r["target_tokens"], r["page_size"])):
            check({r["impl"]: r for r in group})
        print(table(rows))
        return 0
    args.tokens_list = [int(float(t)) for t in args.tokens.split(",")]
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.impls = args.impls.split(",")
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {list(IMPLS)}")
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.meta, args.missed = meta, []
    log(f"{meta['machine']}")
    t0 = time.perf_counter()
    rows = measure(args)
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    meta["load_after"] = os.getloadavg()
    print(table(rows))
    for m in args.missed:
        print(f"\nNot measured: {m}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "not_measured": args.missed}, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip tearing down millions of tree objects one by one
