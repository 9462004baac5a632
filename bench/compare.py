"""A paired speed gate: two commits built the same way, benchmarked alternately in one
sitting, each operation's HEAD/BASE ratio with its spread; non-zero exit on a slowdown.

Each revision is checked out in a temporary ``git worktree`` under ``--workdir`` and built
in place there (``python setup.py build_ext --inplace`` with this interpreter, so the same
Python, Cython, numpy and compiler for both; ``HIRADIX_CUDA=0 HIRADIX_VERBS=0``: the CUDA
kernel and the verbs binding are not on these paths). Then, for ``--rounds`` rounds, every
benchmark runs once per build, in the order BASE, HEAD in even rounds and HEAD, BASE in
odd ones, so a change of load between rounds moves both sides. The benchmark scripts are
this checkout's (the same driver code for both sides); each run imports its own
worktree's ``hiradix`` (``PYTHONPATH``), which the run prints and this script checks.

``--base-build wheel`` / ``--head-build wheel`` build that side as ``pip install`` does
instead: ``pip wheel`` under pip's build isolation (the build requirements pyproject.toml
pins, fetched into a fresh environment), installed with ``pip install --target`` beside the
worktree. With one revision on both sides (``compare.py HEAD HEAD --head-build wheel``)
that measures the build users get against the in-place one.

Benchmarks (quick settings, ``--scale`` of the 200-prompt workload, page sizes 1 and 16):

``tree_ops``    ``bench/tree_ops.py --no-sglang --no-twin --repeats 1 --clock thread``: the
                core's plain and hi trees, fresh fill (insert into a new tree), match, evict.
``sglang_api``  ``bench/sglang_api.py --impls hiradix --step 8 --repeats 1``: insert,
                finish, match, evict-all and load-back (after evict-all, every key's host
                hit loaded back; ``init_load_back`` also alone) through SGLang 0.5.18's API
                on fresh caches, over the calling thread's CPU time (the figures least
                moved by sharing the machine).
``churn``       ``bench/churn.py --repeats 1``: fresh fill against steady state (a cache
                that filled once, inserting while it evicts), core and hiradix.sglang.

A *ratio* is HEAD's speed over BASE's in one round (for a time, BASE's over HEAD's), so
below 1 is slower. Each operation reports the median ratio over the rounds and their
min-max. An operation fails the gate when its median ratio is below ``1 - threshold``
(default 15%: paired rounds on a shared 2-core machine scatter by about +-10%); ``--gate``
names which operations may fail it (default: the throughputs, not the millisecond-long
evictions, which are reported only). Exit status: 0 pass, 1 a slowdown, 2 a failure to
build or run.

Usage::

    .venv/bin/python bench/compare.py a2e52f3                 # a2e52f3 against HEAD
    .venv/bin/python bench/compare.py a2e52f3 HEAD --rounds 5 --benches sglang_api
    .venv/bin/python bench/compare.py BASE --head-tree .      # the working tree (built in place)
    .venv/bin/python bench/compare.py a2e52f3 --dry-run       # the plan, nothing built or run
    .venv/bin/python bench/compare.py HEAD HEAD --head-build wheel   # pip's build against in place
    .venv/bin/python bench/compare.py a2e52f3 --benches sglang_api \
        --python .venv-sglang23/bin/python --build-python .venv/bin/python   # through SGLang 0.5.23
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ("tree_ops", "sglang_api", "churn")
BUILDS = ("inplace", "wheel")
BUILD_ENV = {"HIRADIX_CUDA": "0", "HIRADIX_VERBS": "0"}
# Printed first by every run (stderr): the hiradix that run imported.
IMPORT_TAG = "compare: hiradix from "
RUNNER = (
    "import runpy, sys, hiradix; "
    f"print({IMPORT_TAG!r} + hiradix.__file__, file=sys.stderr, flush=True); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


# ----------------------------------------------------------------------------- builds
class Side:
    """One build: a revision in a worktree (``made``: ours to remove) or a given tree, built
    in place or (``build="wheel"``) as a wheel installed into ``site`` beside it."""

    def __init__(self, label: str, rev: str | None, tree: Path | None, workdir: Path, build: str = "inplace") -> None:
        self.label, self.build = label, build
        if tree is not None:
            self.tree, self.rev, self.made = tree.resolve(), f"tree {tree}", False
        else:
            assert rev is not None
            self.rev = git("rev-parse", "--short=9", f"{rev}^{{commit}}")
            self.tree, self.made = workdir / f"{label.lower()}-{self.rev}", True
        # Where the run imports hiradix from: the tree itself, or the wheel's install.
        self.site = self.tree if build == "inplace" else workdir / f"{label.lower()}-site"

    def build_cmds(self, python: str) -> list[list[str]]:
        if self.build == "inplace":
            return [[python, "setup.py", "build_ext", "--inplace", "-q"]]
        wheels = self.site.with_name(f"{self.site.name}-wheel")
        return [
            [python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(self.tree)],
            [python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(self.site), "--find-links", str(wheels),
             "--no-index", "hiradix"],
        ]  # fmt: skip

    def prepare(self, python: str, dry_run: bool) -> None:
        if not self.made and self.build == "inplace":
            log(f"{self.label}: {self.tree} as it is (not built here)")
            return
        cmds = self.build_cmds(python)
        where = f"git worktree add --detach {self.tree} {self.rev}; " if self.made else ""
        log(f"{self.label}: {where}{'; '.join(shlex.join(c) for c in cmds)} (in {self.tree})")
        if dry_run:
            return
        if self.made:
            if self.tree.exists():
                self.remove()
            git("worktree", "add", "--detach", str(self.tree), self.rev)
        t0 = time.perf_counter()
        for cmd in cmds:
            proc = subprocess.run(cmd, cwd=self.tree, env={**os.environ, **BUILD_ENV}, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{self.label} ({self.rev}): {shlex.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
        log(f"{self.label}: built ({self.build}) in {time.perf_counter() - t0:.0f} s")

    def remove(self) -> None:
        if self.made and self.tree.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(self.tree)], cwd=ROOT, check=False)
        if self.site != self.tree:
            for made in (self.site, self.site.with_name(f"{self.site.name}-wheel")):
                shutil.rmtree(made, ignore_errors=True)


# ----------------------------------------------------------------------------- benchmarks
def bench_args(name: str, scale: float, page_sizes: str, out: Path) -> list[str]:
    common = ["--scale", str(scale), "--page-sizes", page_sizes]
    if name == "tree_ops":
        return [
            str(HERE / "tree_ops.py"),
            *common,
            "--repeats",
            "1",
            "--no-sglang",
            "--no-twin",
            "--clock",
            "thread",
            "--out",
            str(out),
        ]
    if name == "sglang_api":
        return [
            str(HERE / "sglang_api.py"),
            *common,
            *("--repeats", "1", "--warmup", "1", "--impls", "hiradix", "--step", "8", "--json", str(out)),
        ]
    return [str(HERE / "churn.py"), *common, "--repeats", "1", "--json", str(out)]


def figures(name: str, data: dict) -> dict[str, tuple[float, bool]]:
    """Operation -> (figure, higher is better) from one run's JSON."""
    out: dict[str, tuple[float, bool]] = {}
    for ps, res in data["results"].items():
        if name == "tree_ops":
            for variant in ("plain", "hi"):
                r = res[f"hiradix core ({variant})"]
                for m, label in (("insert_per_s", "insert"), ("match_per_s", "match"), ("evict_all_s", "evict_all")):
                    out[f"tree_ops p{ps} {variant} {label}"] = (r[m]["median"], m.endswith("per_s"))
        elif name == "sglang_api":
            r = res["hiradix"]
            for op in ("insert", "finish", "match", "load_back"):
                out[f"sglang_api p{ps} {op}"] = (r[f"{op}_per_thread_s"]["median"], True)
            out[f"sglang_api p{ps} init_load_back"] = (r["init_load_back_per_thread_s"]["median"], True)
            out[f"sglang_api p{ps} evict_all"] = (r["evict_all_thread_s"]["median"], False)
        else:
            for impl, r in res.items():
                if impl == "capacity":
                    continue
                for m in ("fresh_insert_per_s", "steady_insert_per_s", "steady_churn_per_s"):
                    out[f"churn p{ps} {impl} {m.removesuffix('_per_s')}"] = (r[m]["median"], True)
    # An operation a run could not measure (NaN: load-back through SGLang 0.5.23's API) is
    # left out rather than compared.
    return {op: v for op, v in out.items() if not math.isnan(v[0])}


def run_one(side: Side, name: str, args: argparse.Namespace) -> dict[str, tuple[float, bool]]:
    with tempfile.TemporaryDirectory(prefix="hiradix-compare-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [args.python, "-c", RUNNER, *bench_args(name, args.scale, args.page_sizes, out)]
        stubs = str(side.tree / "tests" / "stubs")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(side.site), stubs))}
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        imported = next(
            (ln[len(IMPORT_TAG) :] for ln in proc.stderr.splitlines() if ln.startswith(IMPORT_TAG)), "(nothing)"
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{side.label} {name}: rc {proc.returncode}:\n{proc.stderr[-3000:]}")
        if not Path(imported).resolve().is_relative_to(side.site):
            raise RuntimeError(f"{side.label} {name}: imported hiradix from {imported}, not from {side.site}")
        log(f"  {side.label:4s} {name}: hiradix from {imported}")
        return figures(name, json.loads(out.read_text()))


# ----------------------------------------------------------------------------- report
def speed_ratio(head: float, base: float, higher: bool) -> float:
    return head / base if higher else base / head


def summarize(rounds: list[dict[str, dict]], threshold: float, gate: str) -> tuple[list[str], list[str]]:
    """The table's rows and the operations that failed the gate."""
    ops = [op for op in rounds[0]["HEAD"] if all(op in r["BASE"] and op in r["HEAD"] for r in rounds)]
    rows, failed = [], []
    for op in ops:
        base = [r["BASE"][op][0] for r in rounds]
        head = [r["HEAD"][op][0] for r in rounds]
        higher = rounds[0]["HEAD"][op][1]
        ratios = [speed_ratio(h, b, higher) for h, b in zip(head, base, strict=True)]
        med = statistics.median(ratios)
        gated = gate == "all" or higher
        verdict = "ok"
        if med < 1 - threshold:
            verdict = "SLOWER" if gated else "slower (not gated)"
            if gated:
                failed.append(op)
        unit = "/s" if higher else " s"
        rows.append(
            f"| {op} | {fmt(statistics.median(base), higher)}{unit} | {fmt(statistics.median(head), higher)}{unit} "
            f"| {med:.2f} | {min(ratios):.2f}-{max(ratios):.2f} | {verdict} |"
        )
    return rows, failed


def fmt(v: float, higher: bool) -> str:
    return f"{v / 1e3:,.1f}k" if higher else f"{v * 1e3:,.2f}m"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="BASE revision (the last landed commit)")
    ap.add_argument("head", nargs="?", default="HEAD", help="HEAD revision (default HEAD)")
    ap.add_argument("--base-tree", type=Path, help="use this built checkout as BASE instead of building")
    ap.add_argument("--head-tree", type=Path, help="use this built checkout as HEAD (e.g. . for the working tree)")
    for label in ("base", "head"):
        ap.add_argument(
            f"--{label}-build", choices=BUILDS, default="inplace", help="in place (default) or pip's wheel build"
        )
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds, alternating the order (default 3)")
    ap.add_argument("--benches", default=",".join(BENCHES), help=f"of {', '.join(BENCHES)} (default all)")
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of the 200-prompt workload (default 0.05)")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--threshold", type=float, default=0.15, help="allowed slowdown of a median ratio (0.15)")
    ap.add_argument("--gate", choices=("throughput", "all"), default="throughput", help="which operations may fail")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs both sides (and builds them)")
    ap.add_argument(
        "--build-python",
        help="interpreter that builds both sides, where --python's venv has no Cython "
        "(e.g. .venv builds, .venv-sglang23 runs SGLang 0.5.23's API; same CPython)",
    )
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where worktrees go (/tmp)")
    ap.add_argument("--keep", action="store_true", help="leave the worktrees (and builds) in place")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = ap.parse_args(argv)
    # Absolute (not resolved: a venv's python is a link that must stay one): both sides build
    # in their worktree and run in a temporary folder.
    args.python = os.path.abspath(args.python)
    args.build_python = args.build_python and os.path.abspath(args.build_python)
    benches = [b for b in args.benches.split(",") if b]
    if not set(benches) <= set(BENCHES) or args.rounds < 1:
        ap.error(f"--benches of {', '.join(BENCHES)}; --rounds >= 1")
    workdir = args.workdir / f"hiradix-compare-{os.getpid()}"
    sides = {
        "BASE": Side("BASE", args.base, args.base_tree, workdir, args.base_build),
        "HEAD": Side("HEAD", args.head, args.head_tree, workdir, args.head_build),
    }
    log(
        f"BASE {sides['BASE'].rev} ({args.base_build}), HEAD {sides['HEAD'].rev} ({args.head_build}); "
        f"python {args.python}; load {os.getloadavg()}"
    )
    rounds: list[dict[str, dict]] = []
    try:
        for side in sides.values():
            side.prepare(args.build_python or args.python, args.dry_run)
        for r in range(args.rounds):
            order = ("BASE", "HEAD") if r % 2 == 0 else ("HEAD", "BASE")
            log(f"round {r + 1}/{args.rounds}: {' then '.join(order)}, load {os.getloadavg()[0]:.2f}")
            if args.dry_run:
                for b in benches:
                    log(f"  {shlex.join(bench_args(b, args.scale, args.page_sizes, Path('out.json')))}")
                continue
            this: dict[str, dict] = {"BASE": {}, "HEAD": {}}
            for b in benches:
                for label in order:
                    this[label].update(run_one(sides[label], b, args))
            rounds.append(this)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        log(f"compare: {exc}")
        return 2
    finally:
        if not args.keep:
            for side in sides.values():
                side.remove()
            if workdir.exists():
                workdir.rmdir()
    if args.dry_run:
        return 0
    rows, failed = summarize(rounds, args.threshold, args.gate)
    print(
        f"HEAD {sides['HEAD'].rev} ({args.head_build}) / BASE {sides['BASE'].rev} ({args.base_build}): "
        f"{args.rounds} paired rounds, scale {args.scale}, "
        f"load after {os.getloadavg()[0]:.2f}; ratio = HEAD's speed / BASE's (below 1: slower), "
        f"median and min-max over rounds; gate: median below {1 - args.threshold:.2f}\n"
    )
    print("| operation | BASE | HEAD | HEAD/BASE | min-max | |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps({"base": sides["BASE"].rev, "head": sides["HEAD"].rev, "rounds": rounds}))
    if failed:
        print(f"\nslower beyond {args.threshold:.0%}: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
