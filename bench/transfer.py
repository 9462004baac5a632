"""KV transfer benchmark: the copy engine between a device pool and a host pool.

The "device" pool here is a CPU pool, so every figure is a CPU->CPU copy (the engine CI
runs and the CPU twin of the GPU path). H2D/D2H on a GPU, the CUDA kernel and the overlap
with a forward pass on the GPU are ``bench/transfer_gpu.py``.

**A. Page copies** (``backup`` = device -> host, all layers; ``load`` = host -> device).
For each host layout x direction x page size, ``--total-mib`` of whole pages are moved in
random page order on both sides (every page of both pools, shuffled), through
:class:`ThreadCopyEngine` (submit to ``wait()``), with:

``native``   the compiled GIL-free row copy (the engine's default for CPU pools)
``torch``    the engine's torch indexing path (``native=False``), the fallback

The baseline is a plain contiguous copy of the same number of bytes between two other
buffers allocated like the pools (huge pages, faulted in): ``memmove`` (one thread,
``ctypes.memmove``) and ``torch.Tensor.copy_`` (torch's default threads). Baselines and
the copy under test are timed in alternation, round by round (:func:`interleaved`), and
``% base`` is the median over rounds of (faster baseline of the round) / (copy of the
round). Target: ``native`` >= 80% of it for pages of 16 KiB and up. Both pools are
faulted in with non-zero bytes first. ``HIRADIX_HUGEPAGES=0`` runs it on 4 KiB pages.

**B. Layer-wise pipeline.** A load of ``--pipeline-mib`` is consumed by a synthetic forward
pass: for each layer, ``wait_until(layer)`` and then a compute step that releases the GIL
(a float32 matmul with ``torch.set_num_threads(1)``), calibrated to a chosen multiple of
the per-layer copy time. Reported: load alone, compute alone, load + compute pipelined,
and the ideal ``max(load, compute) + one layer of the shorter side`` (the first layer's
load cannot overlap compute, or the last layer's compute cannot overlap a load). Target:
pipelined <= 1.10 x ideal.

Model shape: Llama-3-8B's KV at tensor parallelism 8 (32 layers, 1 KV head of 128, bf16):
256 bytes per (token, layer, K or V) row, 16 KiB per token, so page sizes of 1, 4, 16 and 64
tokens are pages of 16 KiB, 64 KiB, 256 KiB and 1 MiB.

Usage::

    python bench/transfer.py                 # ~3 min on 2 cores
    python bench/transfer.py --quick         # smoke run, ~20 s
    python bench/transfer.py --json bench/results/transfer.json --md bench/RESULTS_transfer.md
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hiradix.memory import HOST_LAYOUTS, CopyEngine, DeviceKVPool, HostKVPool, MHAShape, ThreadCopyEngine
from hiradix.memory import copy as copy_mod
from hiradix.memory.pools import alloc_cpu_buffer, huge_pages_enabled

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
SHAPE = MHAShape(layer_num=32, head_num=1, head_dim=128)
DTYPE = torch.bfloat16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    cpu = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": [round(x, 2) for x in load],
        "thp": thp_setting(),
        "huge_pages": huge_pages_enabled(),
    }


def write_outputs(args: argparse.Namespace, text: str, data: dict) -> None:
    """The report as printed to ``--md`` and the figures to ``--json``, where given."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
        log(f"wrote {args.json}")
    if args.md:
        args.md.write_text(text)
        log(f"wrote {args.md}")


def thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "n/a"


def anon_huge_mib() -> float:
    """This process's anonymous memory in transparent huge pages, MiB (0 where unknown)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "runs": times}


# ----------------------------------------------------------------------------- pools
@dataclass
class Case:
    """A device pool and a host pool of ``n_pages`` pages each, and every page of both in
    a random order: what one benchmarked copy moves."""

    dev: DeviceKVPool
    host: HostKVPool
    d_idx: torch.Tensor
    h_idx: torch.Tensor
    nbytes: int

    @classmethod
    def make(cls, page_size: int, total_bytes: int, layout: str, seed: int) -> Case:
        tokens = max(1, total_bytes // (page_size * bytes_per_token())) * page_size
        dev = DeviceKVPool(SHAPE, size=tokens, page_size=page_size, dtype=DTYPE)
        host = HostKVPool(SHAPE, tokens, page_size, DTYPE, layout, reserve_bytes=0)  # type: ignore[arg-type]
        # Fault in every page of both pools, with non-zero bytes. Untouched anonymous memory
        # reads as the shared zero page, which stays in cache: a backup from a device pool
        # never written would measure a cache-resident read, not a copy.
        host._buf.view(torch.uint8).fill_(0x5A)
        for layer in range(SHAPE.layer_num):
            for buf in dev.layer_buffers(layer):
                buf.view(torch.uint8).fill_(0xA5)
        n_pages = tokens // page_size
        return cls(
            dev,
            host,
            shuffled_slots(n_pages, page_size, 1, seed),  # device page 0 is padding
            shuffled_slots(n_pages, page_size, 0, seed + 1),
            tokens * bytes_per_token(),
        )

    def run(self, eng: CopyEngine, direction: str) -> None:
        if direction == "backup":
            eng.backup(self.dev, self.host, self.d_idx, self.h_idx).wait()
        else:
            eng.load(self.host, self.dev, self.h_idx, self.d_idx).wait()


def bytes_per_token() -> int:
    return SHAPE.elems_per_token * torch.empty((), dtype=DTYPE).element_size()


def shuffled_slots(n_pages: int, page_size: int, first_page: int, seed: int) -> torch.Tensor:
    pages = list(range(first_page, first_page + n_pages))
    random.Random(seed).shuffle(pages)
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


# ----------------------------------------------------------------------------- A
class Baseline:
    """Plain copies of the same number of bytes between two other buffers, allocated as the
    pools are (huge pages unless ``HIRADIX_HUGEPAGES=0``) and faulted in, so the baseline
    and the pools pay the same TLB and first-touch costs."""

    def __init__(self, total: int, page_bytes: int) -> None:
        self.src = alloc_cpu_buffer(total, torch.uint8).fill_(1)
        self.dst = alloc_cpu_buffer(total, torch.uint8).fill_(2)
        src, dst = self.src, self.dst
        self.fns: dict[str, Callable[[], object]] = {
            "memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), total),
            "torch_copy": lambda: dst.copy_(src),
        }
        if copy_mod.NATIVE_AVAILABLE:
            # The ceiling for random page order: every page one memcpy, pages shuffled on
            # both sides, no layout at all (what "memcpy gathering pages" measures in DESIGN.md).
            from hiradix.memory import _gather

            n = total // page_bytes
            g = torch.Generator().manual_seed(page_bytes)
            d_off = (torch.randperm(n, generator=g) * page_bytes).numpy()
            s_off = (torch.randperm(n, generator=g) * page_bytes).numpy()
            s_np, d_np = src.numpy(), dst.numpy()
            self.fns["random_pages"] = lambda: _gather.copy_rows(d_np, d_off, 0, s_np, s_off, 0, page_bytes)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Run every function once to warm up, then ``repeats`` rounds of each in turn: on a
    shared machine the load changes from second to second, and a baseline timed minutes
    before the copy it is compared with measures another machine."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def bench_layout(args: argparse.Namespace, ps: int, layout: str) -> list[dict]:
    huge0 = anon_huge_mib()
    case = Case.make(ps, args.total_mib * MIB, layout, seed=ps * 7 + 1)
    nbytes = case.nbytes
    # Share of the two pools' bytes in huge pages (approximate: other allocations count too).
    pool_huge = min(1.0, (anon_huge_mib() - huge0) * MIB / (case.dev.size_bytes + case.host.size_bytes))
    base = Baseline(nbytes, ps * bytes_per_token())
    rows = []
    for direction in ("backup", "load"):
        row: dict = {
            "layout": layout,
            "direction": direction,
            "page_size": ps,
            "page_kib": ps * bytes_per_token() / 1024,
            "bytes": nbytes,
            "pool_huge": pool_huge,
        }
        base_times: dict[str, list[float]] = {k: [] for k in base.fns}
        paths = [(f"native{t}", True, t) for t in args.copy_threads] + [("torch", False, 1)]
        for path, native, threads in paths:
            if native and not copy_mod.NATIVE_AVAILABLE:
                continue
            with ThreadCopyEngine(native=native, copy_threads=threads) as eng:
                reps = args.repeats if native else max(1, args.repeats // 2)
                fns = {**base.fns, path: lambda e=eng, d=direction: case.run(e, d)}
                times = interleaved(fns, reps)  # type: ignore[arg-type]
            for k in base.fns:
                base_times[k] += times[k]
            t = statistics.median(times[path])
            row[f"{path}_s"] = t
            row[f"{path}_gbs"] = nbytes / t / 1e9
            # Per round: the faster contiguous copy of that round over this path's time.
            row[f"{path}_vs_base"] = statistics.median(
                min(m, c) / x for m, c, x in zip(times["memmove"], times["torch_copy"], times[path], strict=True)
            )
        for k, ts in base_times.items():
            row[f"{k}_gbs"] = nbytes / statistics.median(ts) / 1e9
        rows.append(row)
        log(
            f"  {layout:18s} {direction:6s} {row['page_kib']:7.0f} KiB: "
            + ", ".join(f"{k}={row[k]:.2f}" for k in row if k.endswith(("gbs", "vs_base")))
        )
    return rows


def bench_pages(args: argparse.Namespace, page_sizes: list[int]) -> list[dict]:
    rows = []
    for ps in page_sizes:
        for layout in HOST_LAYOUTS:
            gc.collect()
            rows += bench_layout(args, ps, layout)
    return rows


# ----------------------------------------------------------------------------- B
class Compute:
    """A per-layer compute step that releases the GIL: ``reps`` float32 ``k x k`` matmuls
    (run with ``torch.set_num_threads(1)``)."""

    def __init__(self, k: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(k, k, generator=g)
        self.b = torch.randn(k, k, generator=g)
        self.out = torch.empty(k, k)
        self.reps = 1

    def step(self) -> None:
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.out)

    def calibrate(self, seconds: float) -> None:
        self.reps = 100
        per_rep = median_time(self.step, 9, warmup=2)["median"] / 100
        self.reps = max(1, round(seconds / per_rep))


def pipelined(eng: CopyEngine, case: Case, comp: Compute) -> None:
    """The forward pass over a load: layer ``i`` is computed right after ``wait_until(i)``."""
    h = eng.load(case.host, case.dev, case.h_idx, case.d_idx)
    for layer in range(SHAPE.layer_num):
        h.wait_until(layer)
        comp.step()
    h.wait()


def forward(comp: Compute) -> None:
    for _ in range(SHAPE.layer_num):
        comp.step()


def bench_pipeline(args: argparse.Namespace, ratios: list[float]) -> list[dict]:
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = Case.make(16, args.pipeline_mib * MIB, "page_first_direct", seed=5)
        layers = SHAPE.layer_num
        comp = Compute()
        with ThreadCopyEngine() as eng:
            load = median_time(lambda: case.run(eng, "load"), args.repeats)["median"]
            for r in ratios:
                comp.calibrate(r * load / layers)
                # Interleaved rounds, as in section A: the ideal of a round comes from the
                # load and compute times of the same round.
                times = interleaved(
                    {
                        "load": lambda: case.run(eng, "load"),
                        "compute": lambda: forward(comp),
                        "pipelined": lambda: pipelined(eng, case, comp),
                    },
                    args.repeats,
                )
                ideals = [
                    max(lo, co) + min(lo, co) / layers for lo, co in zip(times["load"], times["compute"], strict=True)
                ]
                load_now = statistics.median(times["load"])
                compute = statistics.median(times["compute"])
                total = statistics.median(times["pipelined"])
                ideal = statistics.median(ideals)
                ratio = statistics.median(p / i for p, i in zip(times["pipelined"], ideals, strict=True))
                rows.append(
                    {
                        "compute_over_load": r,
                        "layers": layers,
                        "copy_threads": eng.copy_threads,
                        "load_s": load_now,
                        "compute_s": compute,
                        "pipelined_s": total,
                        "ideal_s": ideal,
                        "ratio": ratio,
                        "serial_s": load_now + compute,
                    }
                )
                log(
                    f"  compute/load {r}: load {load_now * 1e3:.1f} ms, compute {compute * 1e3:.1f} ms, "
                    f"pipelined {total * 1e3:.1f} ms, ideal {ideal * 1e3:.1f} ms, ratio {ratio:.3f}"
                )
    finally:
        torch.set_num_threads(threads)
    return rows


# ----------------------------------------------------------------------------- report
def report(meta: dict, pages: list[dict], pipe: list[dict]) -> str:
    m = meta["machine"]
    lines = [
        f"## transfer — {m['cpu']} ({m['nproc']} cores), {meta['date']}",
        "",
        f"Command `{meta['command']}`; {meta['repeats']} repeats after one warm-up, medians "
        f"(the torch path: half the repeats). torch {m['torch']} with {m['torch_threads']} threads; "
        f"load average {m['loadavg_start']} at the start, {meta['loadavg_end']} at the end.",
        f"Shape: {SHAPE} {DTYPE} ({bytes_per_token() // 1024} KiB per token); {meta['total_mib']} MiB "
        "of whole pages per copy, random page order on both sides. Device pool on the CPU. "
        f"THP `{m.get('thp', 'n/a')}`; pools and baseline buffers on huge pages: {m.get('huge_pages', False)} "
        "(`huge` column: share of the two pools' bytes the kernel backed with huge pages).",
        "",
        "### A. Page copies, CPU <-> CPU",
        "",
        "GB/s. `nativeN` = compiled row copy with `copy_threads=N`; `torch` = the torch indexing path; "
        "`% base` = median over rounds of the faster contiguous baseline (memmove or torch `copy_`, "
        "timed in the same round) / time; "
        "`random pages` = one memcpy per whole page, pages shuffled on both sides (no layout): "
        "the ceiling for random page order on this machine.",
        "",
    ]
    paths = meta["native_paths"] + ["torch"]
    lines.append(
        "| layout | direction | page | huge | memmove | torch copy_ | random pages | "
        + " | ".join(f"{p} | {p} % base" for p in paths)
        + " | best native / random pages | best native / torch |"
    )
    lines.append("|---|---|---|---|---|---|---|" + "---|---|" * len(paths) + "---|---|")
    for r in pages:
        cells = []
        for p in paths:
            cells.append(f"{r[p + '_gbs']:.2f} | {r[p + '_vs_base']:.0%}" if p + "_gbs" in r else "n/a | n/a")
        best = max((r[p + "_gbs"] for p in meta["native_paths"] if p + "_gbs" in r), default=None)
        rp = r.get("random_pages_gbs")
        lines.append(
            f"| {r['layout']} | {r['direction']} | {r['page_kib']:.0f} KiB | {r.get('pool_huge', 0):.0%} | "
            f"{r['memmove_gbs']:.2f} | "
            f"{r['torch_copy_gbs']:.2f} | "
            + (f"{rp:.2f}" if rp else "n/a")
            + " | "
            + " | ".join(cells)
            + " | "
            + (f"{best / rp:.0%} | " if best and rp else "n/a | ")
            + (f"{best / r['torch_gbs']:.1f}× |" if best else "n/a |")
        )
    for p in meta["native_paths"]:
        have = [r for r in pages if p + "_vs_base" in r]
        if have:
            worst = min(have, key=lambda r: r[p + "_vs_base"])
            big = [r for r in have if r["page_kib"] >= 16]
            n_ok = sum(r[p + "_vs_base"] >= 0.8 for r in big)
            lines.append(
                f"\n`{p}`: {n_ok}/{len(big)} cases at >= 80% of the baseline; lowest "
                f"{worst[p + '_vs_base']:.0%} ({worst['layout']} {worst['direction']}, "
                f"{worst['page_kib']:.0f} KiB pages)."
            )
    lines += [
        "",
        "### B. Layer-wise pipeline (load + per-layer compute on one torch thread)",
        "",
        f"page_first_direct, page size 16, {meta['pipeline_mib']} MiB per load, {SHAPE.layer_num} layers; "
        "ideal = max(load, compute) + one layer of the shorter side; load, compute and pipelined are timed "
        "in alternation and `pipelined / ideal` is the median over rounds.",
        "",
        "| compute / load | load | compute | serial (sum) | pipelined | ideal | pipelined / ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pipe:
        lines.append(
            f"| {r['compute_over_load']} | {r['load_s'] * 1e3:.1f} ms | {r['compute_s'] * 1e3:.1f} ms | "
            f"{r['serial_s'] * 1e3:.1f} ms | {r['pipelined_s'] * 1e3:.1f} ms | {r['ideal_s'] * 1e3:.1f} ms | "
            f"{r['ratio']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run")
    ap.add_argument("--page-sizes", default="1,4,16,64", help="tokens per page (16 KiB per token)")
    ap.add_argument("--total-mib", type=int, default=256, help="MiB moved per copy in section A")
    ap.add_argument("--pipeline-mib", type=int, default=256, help="MiB per load in section B")
    ap.add_argument("--ratios", default="0.5,1,2", help="compute/load time ratios for section B")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-threads", default="1,2", help="copy_threads values for the native path")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: A,B")
    ap.add_argument("--json", type=Path, default=None, help="write the raw results here")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.page_sizes, args.total_mib, args.pipeline_mib, args.repeats = "1,16", 32, 32, 3
    skip = {s.strip().upper() for s in args.skip.split(",") if s.strip()}
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.copy_threads = [int(t) for t in args.copy_threads.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    torch.manual_seed(0)
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/transfer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": args.repeats,
        "total_mib": args.total_mib,
        "pipeline_mib": args.pipeline_mib,
        "native_available": copy_mod.NATIVE_AVAILABLE,
        "native_paths": [f"native{t}" for t in args.copy_threads] if copy_mod.NATIVE_AVAILABLE else [],
    }
    if not copy_mod.NATIVE_AVAILABLE:
        log("the compiled row copy is not in use (not built or HIRADIX_PUREPYTHON): torch path only")
    pages = [] if "A" in skip else bench_pages(args, page_sizes)
    pipe = [] if "B" in skip else bench_pipeline(args, ratios)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    text = report(meta, pages, pipe)
    print(text)
    write_outputs(args, text, {"meta": meta, "pages": pages, "pipeline": pipe})
    return 0


if __name__ == "__main__":
    sys.exit(main())
