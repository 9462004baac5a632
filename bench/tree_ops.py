"""Tree-operation benchmark: hiradix's Cython core against its pure-Python twin and,
when their virtual environments exist, SGLang's own trees, all in one run.

Workload (``bench/workload.py``): 200 system prompts (128-1024 tokens) x 100
continuations, total length 256-2048 tokens, seeded and shuffled; 20k sequences,
26.4M tokens. Keys are cut to whole pages at page size 16.

Figures, each the median (and min) over ``--repeats`` fresh trees after one warm-up:

``insert/s``       insert every sequence into an empty tree, in workload order
``match/s``        ``match_prefix`` of every sequence afterwards (all full hits)
``evict_all_s``    one ``evict(everything)`` call
``evict_chunks_s`` the same tokens evicted in 1000 equal calls, on a rebuilt tree
``match_128k_us``  ``match_prefix`` latency of one fully cached 131,072-token key

Two hiradix variants are measured:

``plain``  no host tier: nodes reported for backup are left alone, so ``evict``
           deletes them: the work of a RadixCache.
``hi``     write_through: every node ``insert`` reports is backed up right away with
           ``begin_backup`` + ``commit_backup`` (host slots from a counter), so
           ``evict`` demotes to tombstones: the work of HiRadixCache's tree.

Ratios are against the pure-Python twin and the SGLang trees measured in this same run
(the machines are shared and noisy, so figures from another run are not compared).

Usage::

    python bench/tree_ops.py                      # everything available, ~10 min
    python bench/tree_ops.py --scale 0.1 --repeats 1 --no-sglang   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import describe, make_long_key, make_workload  # noqa: E402

# The SGLang baseline venvs that bench/setup_sglang.sh makes (same variable, same default).
VENVS = Path(os.environ.get("HIRADIX_BENCH_VENVS") or HERE.parent / ".bench-venvs")
SGLANG_IMPLS = {
    # name: (venv, --impl of sglang_baselines.py)
    "sglang-0.5.18 RadixCache": ("sglang-0.5.18", "radix"),
    "sglang-0.5.18 HiRadixCache": ("sglang-0.5.18", "hiradix"),
    "sglang-0.5.23 UnifiedRadixCache (Rust)": ("sglang-0.5.23", "unified"),
}
METRICS = ("insert_per_s", "match_per_s", "evict_all_s", "evict_chunks_s", "match_128k_us")
HIGHER_IS_BETTER = {"insert_per_s": True, "match_per_s": True}
# The hiradix phases' clock: wall time by default; --clock thread times the calling thread's
# CPU time instead (page faults included, time descheduled on a shared machine not).
CLOCK = time.perf_counter


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version()}


# ----------------------------------------------------------------------------- hiradix
class HiradixRunner:
    """Drives one hiradix tree class through the benchmark phases."""

    def __init__(self, tree_cls: type, page_size: int, variant: str) -> None:
        self.tree_cls = tree_cls
        self.page_size = page_size
        self.variant = variant
        self.write_policy = "write_through"

    def new_tree(self):
        return self.tree_cls(self.page_size, write_policy=self.write_policy)

    def build(self, keys: list[np.ndarray], values: list[np.ndarray]):
        """A fresh tree with every key inserted; returns (tree, seconds)."""
        tree = self.new_tree()
        insert = tree.insert
        host_next = 0
        gc.collect()
        t0 = CLOCK()
        if self.variant == "hi":
            begin, commit, key_len = tree.begin_backup, tree.commit_backup, tree.key_len
            for k, v in zip(keys, values, strict=True):
                for node in insert(k, v).backup_nodes:
                    n = key_len(node)
                    begin(node, np.arange(host_next, host_next + n))
                    commit(node)
                    host_next += n
        else:
            for k, v in zip(keys, values, strict=True):
                insert(k, v)
        return tree, CLOCK() - t0

    def run_once(self, keys, values, long_key) -> dict:
        tree, t_insert = self.build(keys, values)
        match = tree.match_prefix
        t0 = CLOCK()
        for k in keys:
            match(k)
        t_match = CLOCK() - t0
        total = tree.evictable_size()
        t0 = CLOCK()
        tree.evict(total)
        t_evict = CLOCK() - t0
        assert tree.evictable_size() == 0
        del tree
        tree, _ = self.build(keys, values)
        total = tree.evictable_size()
        chunk = max(1, total // 1000)
        t0 = CLOCK()
        while tree.evictable_size() > 0:
            tree.evict(chunk)
        t_chunks = CLOCK() - t0
        del tree
        return {
            "insert_per_s": len(keys) / t_insert,
            "match_per_s": len(keys) / t_match,
            "evict_all_s": t_evict,
            "evict_chunks_s": t_chunks,
            "match_128k_us": self.long_match_us(long_key),
        }

    def long_match_us(self, long_key: np.ndarray, iters: int = 300) -> float:
        tree = self.new_tree()
        key = long_key[: len(long_key) // self.page_size * self.page_size]
        tree.insert(key, np.arange(len(key), dtype=np.int64))
        times = []
        for _ in range(iters):
            t0 = CLOCK()
            tree.match_prefix(key)
            times.append(CLOCK() - t0)
        return statistics.median(times) * 1e6


def summarize(runs: list[dict]) -> dict:
    out = {}
    for m in METRICS:
        vals = [r[m] for r in runs]
        best = max(vals) if HIGHER_IS_BETTER.get(m) else min(vals)
        out[m] = {"median": statistics.median(vals), "best": best, "runs": vals}
    return out


def bench_hiradix(tree_cls, page_size, variant, keys, values, long_key, repeats, warm, full_warmup) -> dict:
    runner = HiradixRunner(tree_cls, page_size, variant)
    runner.run_once(*warm)  # warm-up on a small slice
    if full_warmup:  # and at full size: the first big buffers of a process fault in fresh pages
        runner.run_once(keys, values, long_key)
    runs = []
    for r in range(repeats):
        runs.append(runner.run_once(keys, values, long_key))
        log(f"    repeat {r + 1}/{repeats}: " + ", ".join(f"{m}={runs[-1][m]:.4g}" for m in METRICS))
    return summarize(runs)


# ----------------------------------------------------------------------------- sglang
def bench_sglang(name: str, page_size: int, repeats: int, scale: float) -> dict | None:
    venv, impl = SGLANG_IMPLS[name]
    py = VENVS / venv / "bin" / "python"
    if not py.exists():
        log(f"  {name}: skipped ({py} not found; see bench/README_sglang.md)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            str(py),
            str(HERE / "sglang_baselines.py"),
            "--impl",
            impl,
            "--page-size",
            str(page_size),
            "--repeats",
            str(repeats),
            "--scale",
            str(scale),
            "--json",
            str(out),
        ]
        env = dict(os.environ, PYTHONPATH=str(VENVS / "stubs"))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            log(f"  {name}: failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
            return None
        data = json.loads(out.read_text())
    res: dict = {"version": data.get("sglang_version", "")}
    for m in (*METRICS, "match_prefix_only_per_s"):
        fig = data["metrics"].get(m)
        if fig is not None:
            best = fig["max"] if HIGHER_IS_BETTER.get(m) else fig["min"]
            res[m] = {"median": fig["median"], "best": best}
    return res


# ----------------------------------------------------------------------------- report
def ratio(ours: float, theirs: float, metric: str) -> float:
    return ours / theirs if HIGHER_IS_BETTER.get(metric) else theirs / ours


def fmt(metric: str, v: float) -> str:
    if metric.endswith("per_s"):
        return f"{v / 1e3:,.1f}k"
    if metric.endswith("_us"):
        return f"{v:,.1f} µs"
    return f"{v:.3f} s"


def report(results: dict, meta: dict) -> str:
    lines = [
        f"## tree_ops — {meta['machine']['cpu']} ({meta['machine']['nproc']} cores), {meta['date']}",
        "",
        f"Workload: {meta['workload']['count']} sequences, {meta['workload']['total_tokens']:,} tokens "
        f"(scale {meta['scale']}); {meta['repeats']} repeats, medians; command `{meta['command']}`.",
        "Speed-ups (×) are medians of ours over theirs, measured in this run (for times: theirs / ours).",
        "",
    ]
    for ps, by_impl in results.items():
        lines += [
            f"### page size {ps}",
            "",
            "| implementation | " + " | ".join(METRICS) + " |",
            "|---|" + "---|" * len(METRICS),
        ]
        for name, res in by_impl.items():
            if res is None:
                continue
            lines.append(
                f"| {name} | " + " | ".join(fmt(m, res[m]["median"]) if m in res else "n/a" for m in METRICS) + " |"
            )
        lines.append("")
        pairs = [
            ("hiradix core (plain)", "hiradix twin (plain)"),
            ("hiradix core (hi)", "hiradix twin (hi)"),
            ("hiradix core (plain)", "sglang-0.5.18 RadixCache"),
            ("hiradix core (hi)", "sglang-0.5.18 HiRadixCache"),
            ("hiradix core (plain)", "sglang-0.5.23 UnifiedRadixCache (Rust)"),
        ]
        lines += ["| ours vs theirs | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        for ours, theirs in pairs:
            a, b = by_impl.get(ours), by_impl.get(theirs)
            if not a or not b:
                continue
            lines.append(
                f"| {ours} / {theirs} | "
                + " | ".join(
                    f"{ratio(a[m]['median'], b[m]['median'], m):,.1f}×" if m in a and m in b else "n/a" for m in METRICS
                )
                + " |"
            )
        rust = by_impl.get("sglang-0.5.23 UnifiedRadixCache (Rust)") or {}
        core = by_impl.get("hiradix core (plain)")
        if core and "match_prefix_only_per_s" in rust:
            alone = rust["match_prefix_only_per_s"]["median"]
            lines.append(
                f"\nThe Rust core's `match_prefix` alone, without gathering device indices: "
                f"{fmt('match_per_s', alone)}/s; hiradix core (plain) match, indices included, is "
                f"{core['match_per_s']['median'] / alone:.1f}× that."
            )
        if core:
            c = core["evict_chunks_s"]["median"] / core["evict_all_s"]["median"]
            lines.append(f"\nhiradix core (plain): evicting in 1000 chunks costs {c:.2f}× one call.")
        core = by_impl.get("hiradix core (hi)")
        if core:
            c = core["evict_chunks_s"]["median"] / core["evict_all_s"]["median"]
            lines.append(f"hiradix core (hi): evicting in 1000 chunks costs {c:.2f}× one call.")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes (default 1,16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 200 system prompts")
    ap.add_argument("--no-sglang", action="store_true", help="skip the SGLang baselines")
    ap.add_argument("--no-twin", action="store_true", help="skip the pure-Python twin (slow)")
    ap.add_argument("--twin-repeats", type=int, default=1, help="repeats for the slow twin")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "tree_ops.json")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall", help="hiradix phases' clock (default wall)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter

    from hiradix.tree import _reference

    try:
        from hiradix.tree import _core
    except ImportError:
        log("hiradix.tree._core is not built: pip install -e . first")
        return 2

    n_prompts = max(1, round(200 * args.scale))
    seqs = make_workload(n_prompts=n_prompts)
    long_key = make_long_key()
    small = make_workload(seed=7, n_prompts=5, n_cont=20)
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "scale": args.scale,
        "repeats": args.repeats,
        "clock": args.clock,
        "workload": describe(seqs),
        "command": "python bench/tree_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    log(f"workload: {meta['workload']}")
    results: dict = {}
    for ps in (int(p) for p in args.page_sizes.split(",")):
        # Each implementation gets its inputs in its own format, prepared before timing and
        # laid out in workload order (the SGLang runner does the same with its lists and
        # tensors): here fresh contiguous int32 arrays.
        keys = [np.array(s[: len(s) // ps * ps]) for s in seqs]
        values, start = [], 0
        for k in keys:
            values.append(np.arange(start, start + len(k), dtype=np.int64))
            start += len(k)
        wkeys = [s[: len(s) // ps * ps] for s in small]
        warm = (wkeys, [np.arange(len(k), dtype=np.int64) + 10**9 for k in wkeys], long_key[:4096])
        by_impl: dict = {}
        for variant in ("plain", "hi"):
            gc.collect()
            log(f"page {ps}: hiradix core ({variant})")
            by_impl[f"hiradix core ({variant})"] = bench_hiradix(
                _core.HiRadixTree, ps, variant, keys, values, long_key, args.repeats, warm, True
            )
            if not args.no_twin:
                log(f"page {ps}: hiradix twin ({variant})")
                by_impl[f"hiradix twin ({variant})"] = bench_hiradix(
                    _reference.HiRadixTree, ps, variant, keys, values, long_key, args.twin_repeats, warm, False
                )
        if not args.no_sglang:
            for name in SGLANG_IMPLS:
                log(f"page {ps}: {name}")
                by_impl[name] = bench_sglang(name, ps, args.repeats, args.scale)
        results[ps] = by_impl
    text = report(results, meta)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
