"""KV transfer benchmark on a CUDA GPU: hiradix's :class:`CudaCopyEngine` paths and SGLang
0.5.23's own HiCache transfer kernels, on the same pools, against the link's limit. (The
layer-wise overlap with a forward pass, through SGLang's KV pool, is
``bench/layer_wait_gpu.py``.)

Paths (``--paths``; every one checked byte for byte against the pools' expected contents
after its first copy, so a fast path that moves the wrong bytes is reported, not ranked):

``warp``     the gather/scatter kernel (:mod:`hiradix.memory.kernel`) in its few-block mode:
             a warp per row, streaming loads and stores; one call queues every layer
``wide``     the same kernel with many blocks, chunks striped over every thread
``dma``      the same plan on the GPU's copy engines (``dma=True``): each layer's rows merged
             into runs contiguous on both sides, one ``cudaMemcpyBatchAsync`` per layer
``mapped``   the engine's torch fallback (``kernel=False``): torch's index kernels over the
             pinned host pool viewed as device memory, no host pass
``sgl-reg``  SGLang 0.5.23's JIT register kernel (``block_quota=2``), called as SGLang's
             host pool calls it for that layout and direction (``bench/sglang_kernels.py``)
``sgl-tma``  SGLang 0.5.23's JIT TMA kernel (``block_quota=4``, sm_90+)
``contig``   the baseline: one ``copy_`` of the same number of bytes between a contiguous
             pinned host buffer and a device buffer (the link's limit)

**A. Page copies** (``load`` = H2D into the device pool, ``backup`` = D2H into the host
pool). For each model x host layout x page size, ``--total-mib`` of whole pages in random
page order on both sides, timed from submission to completion (``torch.cuda.synchronize``),
the paths in alternation round by round; ``% link`` is the median over rounds of contig time
/ path time, and ``/ sgl`` the median of the best SGLang kernel's time / the path's.
Targets: the default path >= 0.95 x SGLang's best kernel at page >= 16 in layer_first and
page_first, load and backup.

**Q. Queued.** The same copies with the host's part hidden: a spin holds the copy stream
until the path has planned and queued every layer, and CUDA events time the GPU alone (from
the spin's end to the last layer), with the host's submit time beside it. Cases: page 16 in
random order at ``--total-mib``; page 16 in *identity order* (pages in order on both sides:
the ceiling of SM-driven copies on this machine); page 16 at 1 GiB; and the submit time of
an operation of 1,024 pages (target: at most 0.3 ms).

**G. Grid.** Each kernel mode's blocks per component, swept on one case (page 16,
page_first), since the copy shares the SMs with the model.

Models: ``mha`` = Llama-3-8B at TP 1 (32 layers, 8 KV heads of 128, bf16: 2 KiB rows,
128 KiB per token); ``mla`` = DeepSeek-V3 (61 layers, 512 + 64 latent, bf16: 1152 B rows).

Usage (on the GPU machine, after ``source bench/gpu/setup.sh``)::

    python bench/transfer_gpu.py --sglang-src .gpu/sglang-0.5.23.tar.gz \\
        --json $OUT/transfer_gpu.json --md $OUT/transfer_gpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hiradix.memory import HOST_LAYOUTS, CudaCopyEngine, DeviceKVPool, HostKVPool, KVShape, MHAShape, MLAShape
from hiradix.memory import kernel as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import log, machine, shuffled_slots, write_outputs

MIB = 1 << 20
DTYPE = torch.bfloat16
MODELS: dict[str, KVShape] = {
    "mha": MHAShape(layer_num=32, head_num=8, head_dim=128),
    "mla": MLAShape(layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64),
}
ENGINES: dict[str, dict] = {  # hiradix's paths: CudaCopyEngine's arguments
    "warp": {"kernel": True, "mode": "warp"},
    "wide": {"kernel": True, "mode": "wide"},
    "dma": {"kernel": True, "dma": True},
    "mapped": {"kernel": False},
}
SGLANG = {"sgl-reg": "register", "sgl-tma": "tma", "sgl-default": "default"}  # SGLang's kernels: variant
DEFAULT_PATHS = "warp,wide,mapped,sgl-reg,sgl-tma,sgl-default"  # dma: measured twice, kept out (slow)


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel": K.cuda_kernel_available(),
        "default_mode": K.default_mode(),
    }


class Case:
    """A device pool and a pinned host pool of ``n_pages`` pages each, every page of both
    in a random order (``identity``: in order), a contiguous pinned/device pair of the same
    bytes, and the engines and SGLang kernels to move them with."""

    def __init__(self, model: str, ps: int, total: int, layout: str, seed: int, identity: bool = False) -> None:
        shape = MODELS[model]
        self.model, self.layout, self.ps = model, layout, ps
        self.per_token = shape.elems_per_token * 2
        tokens = max(1, total // (ps * self.per_token)) * ps
        self.dev = DeviceKVPool(shape, size=tokens, page_size=ps, dtype=DTYPE, device="cuda")
        self.host = HostKVPool(shape, tokens, ps, DTYPE, layout, reserve_bytes=0)  # type: ignore[arg-type]
        assert self.host.pin_memory
        g = torch.Generator(device="cuda").manual_seed(seed)
        raw = self.host.backing_tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=g).cpu())
        for layer in range(shape.layer_num):
            for buf in self.dev.layer_buffers(layer):
                b = buf.view(torch.uint8)
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda", generator=g))
        n_pages = tokens // ps
        if identity:
            self.d_idx = torch.arange(ps, ps + tokens)  # device page 0 is padding
            self.h_idx = torch.arange(tokens)
        else:
            self.d_idx = shuffled_slots(n_pages, ps, 1, seed)
            self.h_idx = shuffled_slots(n_pages, ps, 0, seed + 1)
        self.d_cuda, self.h_cuda = self.d_idx.cuda(), self.h_idx.cuda()
        self.nbytes = tokens * self.per_token
        self.pages = n_pages
        self.pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda").fill_(2)

    def submit(self, path: str, direction: str, engines: dict[str, CudaCopyEngine]) -> Callable[[], Any]:
        """A function that queues one copy of the whole case on ``path`` (no waiting)."""
        if path == "contig":
            if direction == "backup":
                return lambda: self.pinned.copy_(self.flat, non_blocking=True)
            return lambda: self.flat.copy_(self.pinned, non_blocking=True)
        if path in SGLANG:
            import sglang_kernels as sk

            variant = SGLANG[path]
            sk.plan(self.dev, self.host, direction, variant)  # raises NotImplementedError where SGLang has none
            if direction == "backup":
                return lambda: sk.sglang_backup(
                    self.dev, self.host, self.d_cuda, self.h_cuda, variant, host_idx_cpu=self.h_idx
                )
            return lambda: sk.sglang_load(self.dev, self.host, self.h_cuda, self.d_cuda, variant)
        eng = engines[path]
        if direction == "backup":
            return lambda: eng.backup(self.dev, self.host, self.d_idx, self.h_idx)
        return lambda: eng.load(self.host, self.dev, self.h_idx, self.d_idx)

    def check(self, path: str, direction: str) -> str | None:
        """After a copy on ``path``: whether the rows moved are equal on both sides
        (``None``) or how they differ (sampled layers: first, middle, last)."""
        if path == "contig":
            return None
        import sglang_kernels as sk

        torch.cuda.synchronize()
        n = self.dev.layer_num
        bad = sk.compare_rows(self.dev, self.host, self.h_cuda, self.d_cuda, layers=sorted({0, n // 2, n - 1}))
        return "; ".join(bad[:3]) or None

    def scramble(self, direction: str) -> None:
        """Make the destination of ``direction`` differ from its source again (so the byte
        check after a path's copy sees that path's bytes, not an earlier path's)."""
        if direction == "load":
            for layer in range(self.dev.layer_num):
                for buf in self.dev.layer_buffers(layer):
                    buf.view(torch.uint8).bitwise_not_()
        else:
            self.host.backing_tensor.view(torch.uint8).bitwise_not_()
        torch.cuda.synchronize()


def _make_engines(paths: list[str], blocks: int | None) -> dict[str, CudaCopyEngine]:
    return {p: CudaCopyEngine(**ENGINES[p], blocks=None if p == "dma" else blocks) for p in paths if p in ENGINES}


def _usable(case: Case, paths: list[str], direction: str, engines: dict) -> tuple[dict[str, Callable], dict]:
    """The paths that run on ``case`` (each checked for bytes once), and why the others do
    not (SGLang has no kernel for it, a failure, wrong bytes)."""
    fns: dict[str, Callable[[], Any]] = {}
    notes: dict[str, str] = {}
    for path in ["contig", *paths]:
        try:
            fn = case.submit(path, direction, engines)
            case.scramble(direction)
            fn()
            bad = case.check(path, direction)
        except NotImplementedError as exc:
            notes[path] = f"n/a: {exc}"
            continue
        except Exception as exc:  # reported in the table; the benchmark goes on
            notes[path] = f"failed: {type(exc).__name__}: {str(exc)[-300:]}"
            log(f"  {path} {direction}: {notes[path]}")
            continue
        if bad:
            notes[path] = f"WRONG BYTES: {bad}"
            log(f"  {path} {direction}: {notes[path]}")
            continue
        fns[path] = fn
    return fns, notes


def _time(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds per copy, submission to completion, paths alternated round by round after
    one warm-up round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                times[k].append(time.perf_counter() - t0)
    return times


def _ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def bench_pages(args: argparse.Namespace) -> list[dict]:
    rows = []
    for model in args.models:
        for ps in args.page_sizes:
            for layout in args.layouts:
                case = Case(model, ps, args.total_mib * MIB, layout, seed=ps * 7 + 1)
                engines = _make_engines(args.paths, args.blocks)
                for direction in ("backup", "load"):
                    fns, notes = _usable(case, args.paths, direction, engines)
                    times = _time(fns, args.repeats)
                    row: dict = {
                        "model": model,
                        "layout": layout,
                        "direction": direction,
                        "page_size": ps,
                        "page_kib": ps * case.per_token / 1024,
                        "bytes": case.nbytes,
                        "notes": notes,
                    }
                    sgl = [k for k in times if k in SGLANG]
                    for k, ts in times.items():
                        row[f"{k}_gbs"] = case.nbytes / statistics.median(ts) / 1e9
                        row[f"{k}_vs_link"] = _ratio(times["contig"], ts)
                    if sgl:
                        best = min(sgl, key=lambda k: statistics.median(times[k]))
                        row["sgl_best"] = best
                        for k in times:
                            if k not in SGLANG and k != "contig":
                                row[f"{k}_vs_sgl"] = _ratio(times[best], times[k])
                    rows.append(row)
                    log(
                        f"  {model} {layout:18s} {direction:6s} ps={ps:3d}: "
                        + ", ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith(("gbs", "_sgl")))
                        + (f" [{'; '.join(f'{k}: {v[:80]}' for k, v in notes.items())}]" if notes else "")
                    )
                for eng in engines.values():
                    eng.close()
                del case
                torch.cuda.empty_cache()
                args.progress(rows)
    return rows


SPIN_CYCLES = 100_000_000  # ~50 ms at 2 GHz: longer than any path's host part here


def _gpu_ms(stream: torch.cuda.Stream, submit: Callable[[], Any]) -> tuple[float, float]:
    """(GPU ms, host submit ms) of ``submit``'s work on ``stream`` (the engine's copy
    stream, or the current stream for SGLang's kernels and the contiguous copy), timed from
    the end of a spin that holds the stream until ``submit`` has queued everything."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN_CYCLES)
        start.record(stream)
        t0 = time.perf_counter()
        submit()
        host = (time.perf_counter() - t0) * 1e3
        end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end), host


def _queued_rows(args: argparse.Namespace, label: str, case: Case) -> list[dict]:
    engines = _make_engines(args.paths, args.blocks)
    side = torch.cuda.Stream()
    rows = []
    for direction in ("backup", "load"):
        fns, notes = _usable(case, args.paths, direction, engines)
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
        for i in range(args.repeats + 1):  # the first round warms up
            for name, fn in fns.items():
                stream = engines[name]._stream if name in engines else side
                r = _gpu_ms(stream, fn)
                if i:
                    got[name].append(r)
        row: dict = {
            "case": label,
            "layout": case.layout,
            "page_size": case.ps,
            "pages": case.pages,
            "direction": direction,
            "bytes": case.nbytes,
            "notes": notes,
        }
        for k, rs in got.items():
            row[f"{k}_gpu_gbs"] = case.nbytes / (statistics.median(g for g, _ in rs) / 1e3) / 1e9
            row[f"{k}_submit_ms"] = statistics.median(h for _, h in rs)
        rows.append(row)
        log(
            f"  Q {label:24s} {direction:6s}: "
            + ", ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith(("gbs", "_ms")))
        )
    for eng in engines.values():
        eng.close()
    return rows


def bench_queued(args: argparse.Namespace) -> list[dict]:
    rows = []
    cases = [
        ("random, page 16", "page_first", args.total_mib * MIB, False),
        ("identity order, page 16", "page_first", args.total_mib * MIB, True),
        ("random, page 16, layer_first", "layer_first", args.total_mib * MIB, False),
        ("1 GiB, page 16", "page_first", 1024 * MIB, False),
        ("1024 pages, page 16", "layer_first", 1024 * 16 * 128 * 1024, False),
    ]
    for label, layout, total, identity in cases:
        try:
            case = Case("mha", 16, total, layout, seed=53, identity=identity)
            rows += _queued_rows(args, label, case)
        except Exception:  # a section's failure is logged; the others still run
            log(f"  Q {label}: failed\n{traceback.format_exc()}")
        case = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
    return rows


def bench_grid(args: argparse.Namespace) -> list[dict]:
    rows = []
    case = Case("mha", 16, args.total_mib * MIB, "page_first", seed=3)
    for direction in ("load", "backup"):
        fns: dict[str, Callable[[], Any]] = {"contig": case.submit("contig", direction, {})}
        engines = {(mode, b): CudaCopyEngine(kernel=True, mode=mode, blocks=b) for mode in K.MODES for b in args.grid}
        for (mode, b), eng in engines.items():
            fns[f"{mode}-b{b}"] = case.submit(mode, direction, {mode: eng})
        times = _time(fns, args.repeats)
        for (mode, b), _ in engines.items():
            ts = times[f"{mode}-b{b}"]
            rows.append(
                {
                    "direction": direction,
                    "mode": mode,
                    "blocks": b,
                    "threads": K.DEFAULT_GRID[mode][1],
                    "gbs": case.nbytes / statistics.median(ts) / 1e9,
                    "vs_link": _ratio(times["contig"], ts),
                }
            )
            log(f"  grid {direction} {mode} blocks={b}: {rows[-1]['gbs']:.2f} GB/s, {rows[-1]['vs_link']:.0%} of link")
        for eng in engines.values():
            eng.close()
    return rows


# ----------------------------------------------------------------------------- report
def _cell(r: dict, key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else "n/a"


def report(meta: dict, pages: list[dict], grid: list[dict], queued: list[dict]) -> str:
    g, m = meta["gpu"], meta["machine"]
    paths = meta["paths"]
    ours = [p for p in paths if p in ENGINES]
    lines = [
        f"## transfer on the GPU — {g['gpu']} ({g['sms']} SMs), {m['cpu']} ({m['nproc']} cores), {meta['date']}",
        "",
        f"Command `{meta['command']}`; torch {g['torch']} (CUDA {g['cuda']}); {meta['repeats']} rounds after one "
        f"warm-up, paths alternated round by round, medians. Host pools pinned; bf16. The kernel's default mode "
        f"here: `{g['default_mode']}`. Every path's bytes were checked after its first copy of each case.",
    ]
    if pages:
        lines += [
            "",
            f"### A. Page copies ({meta['total_mib']} MiB of whole pages per copy, random page order on both sides)",
            "",
            "GB/s, and for hiradix's paths the ratio to SGLang's fastest kernel on the same case (`/ sgl`, median "
            "over rounds of its time / the path's; > 1 is faster). `contig` = one contiguous pinned `copy_` of the "
            "same bytes (the link).",
            "",
            "| model | layout | direction | page | contig | "
            + " | ".join(paths)
            + " | SGLang's best | "
            + " | ".join(f"{p} / sgl" for p in ours)
            + " |",
            "|---|---|---|---|---|" + "---|" * (len(paths) + 1 + len(ours)),
        ]
        for r in pages:
            lines.append(
                f"| {r['model']} | {r['layout']} | {r['direction']} | {r['page_size']} ({r['page_kib']:.0f} KiB) | "
                f"{_cell(r, 'contig_gbs', '.1f')} | "
                + " | ".join(_cell(r, f"{p}_gbs", ".1f") for p in paths)
                + f" | {r.get('sgl_best', 'n/a')} | "
                + " | ".join(_cell(r, f"{p}_vs_sgl", ".2f") for p in ours)
                + " |"
            )
        notes = sorted({f"{k}: {v}" for r in pages for k, v in r["notes"].items()})
        if notes:
            lines += ["", "Paths that did not run on some cases:", ""] + [f"- {n}" for n in notes]
        target = [r for r in pages if r["page_size"] >= 16 and r["layout"] in ("page_first", "layer_first")]
        for p in ours:
            have = [r for r in target if f"{p}_vs_sgl" in r]
            if have:
                ok = sum(r[f"{p}_vs_sgl"] >= 0.95 for r in have)
                worst = min(have, key=lambda r: r[f"{p}_vs_sgl"])
                link = [r[f"{p}_vs_link"] for r in have if f"{p}_vs_link" in r]
                lines.append(
                    f"\n`{p}` >= 0.95 x SGLang's best at page >= 16 (layer_first, page_first): {ok}/{len(have)} "
                    f"cases; lowest {worst[f'{p}_vs_sgl']:.2f} ({worst['model']} {worst['layout']} "
                    f"{worst['direction']}, page {worst['page_size']}); % of the link {min(link):.0%}-{max(link):.0%}."
                )
    if queued:
        qpaths = ["contig", *paths]
        lines += [
            "",
            "### Q. GPU time alone, and the host's submit time (mha, page 16)",
            "",
            "GB/s over the GPU's time from the spin's end to the last layer / host ms to plan and queue the "
            "operation. `identity order`: pages in order on both sides (the ceiling of SM-driven copies).",
            "",
            "| case | pages | direction | " + " | ".join(qpaths) + " |",
            "|---|---|---|" + "---|" * len(qpaths),
        ]
        for r in queued:
            cells = [
                f"{r[f'{p}_gpu_gbs']:.1f} / {r[f'{p}_submit_ms']:.2f} ms" if f"{p}_gpu_gbs" in r else "n/a"
                for p in qpaths
            ]
            lines.append(f"| {r['case']} | {r['pages']} | {r['direction']} | " + " | ".join(cells) + " |")
        big = [r for r in queued if r["pages"] == 1024]
        for p in ours:
            subs = [r[f"{p}_submit_ms"] for r in big if f"{p}_submit_ms" in r]
            if subs:
                lines.append(
                    f"\n`{p}` host submit per operation of 1,024 pages: {max(subs):.3f} ms at most (target 0.3 ms)."
                )
    if grid:
        lines += [
            "",
            "### G. Kernel grid (mha, page_first, page 16)",
            "",
            "| direction | mode | blocks per component | threads | GB/s | % link |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['direction']} | {r['mode']} | {r['blocks']} | {r['threads']} | {r['gbs']:.2f} | {r['vs_link']:.0%} |"
            for r in grid
        ]
    lines.append("")
    return "\n".join(lines)


def _section(name: str, fn: Callable[[], list[dict]]) -> list[dict]:
    """Run one section; a failure is logged with its traceback and the others still run."""
    t0 = time.perf_counter()
    try:
        rows = fn()
    except Exception:
        log(f"section {name} failed:\n{traceback.format_exc()}")
        rows = []
    log(f"section {name}: {time.perf_counter() - t0:.0f} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mha,mla")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--layouts", default=",".join(HOST_LAYOUTS))
    ap.add_argument("--paths", default=DEFAULT_PATHS, help=f"paths to time (default {DEFAULT_PATHS})")
    ap.add_argument("--total-mib", type=int, default=256, help="MiB per copy in sections A, Q and G")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=None, help="kernel blocks per component (default: per mode)")
    ap.add_argument("--grid", default="1,2,4,16", help="blocks swept in section G")
    ap.add_argument("--sglang-src", default=None, help="SGLang's source for its kernels (the carried tarball)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: A,Q,G")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    if not K.cuda_kernel_available():
        log(f"needs a CUDA GPU and the kernel library: {K.kernel_unavailable_reason()}")
        return 2
    args.models = args.models.split(",")
    args.layouts = args.layouts.split(",")
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.grid = [int(b) for b in args.grid.split(",") if b]
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in args.paths if p not in ENGINES and p not in SGLANG]
    if unknown:
        ap.error(f"unknown paths {unknown}; known: {sorted(ENGINES) + sorted(SGLANG)}")
    if any(p in SGLANG for p in args.paths):
        try:
            import sglang_kernels as sk

            sk.load_sglang_kernels(args.sglang_src or sk.DEFAULT_SOURCE)
        except Exception:
            log(f"SGLang's kernels cannot be loaded; timing hiradix's paths alone:\n{traceback.format_exc()}")
            args.paths = [p for p in args.paths if p not in SGLANG]
    skip = {s.strip().upper() for s in args.skip.split(",") if s.strip()}
    meta = {
        "machine": machine(),
        "gpu": gpu_info(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/transfer_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": args.repeats,
        "total_mib": args.total_mib,
        "paths": args.paths,
    }
    got: dict[str, list[dict]] = {"queued": [], "grid": [], "pages": []}

    def save(pages: list[dict] | None = None) -> None:
        # After every section and every case of A: a run stopped by its time limit keeps
        # what it measured.
        data = {**got, "pages": got["pages"] if pages is None else pages}
        write_outputs(args, report(meta, data["pages"], data["grid"], data["queued"]), {"meta": meta, **data})

    args.progress = save
    for key, name, fn in (("queued", "Q", bench_queued), ("grid", "G", bench_grid), ("pages", "A", bench_pages)):
        if name not in skip:
            got[key] = _section(name, lambda fn=fn: fn(args))
            save()
    print(report(meta, got["pages"], got["grid"], got["queued"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
