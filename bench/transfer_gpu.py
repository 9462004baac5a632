"""KV transfer benchmark on a CUDA GPU: :class:`CudaCopyEngine` between a device pool and a
pinned host pool, against the link's limit. (The layer-wise overlap with a forward pass,
through SGLang's KV pool, is ``bench/layer_wait_gpu.py``.)

**A. Page copies** (``load`` = H2D into the device pool, ``backup`` = D2H into the host
pool). For each host layout x model x page size, ``--total-mib`` of whole pages in random
page order on both sides, through:

``kernel``  the gather/scatter kernel (:mod:`hiradix.memory.kernel`): one launch per layer,
            reading or writing the pinned host pool in place
``dma``     the same plan on the GPU's copy engines (``dma=True``): each layer's rows merged
            into runs contiguous on both sides, one ``cudaMemcpyBatchAsync`` per layer
``torch``   the engine's torch indexing path (``kernel=False``): host gather or scatter
            on the CPU, a pinned staging copy, ``index_copy_`` / ``index_select`` on the GPU
``contig``  the baseline: one ``copy_`` of the same number of bytes between a contiguous
            pinned host buffer and a device buffer (the link's limit)

Each is timed from submission to completion (``torch.cuda.synchronize``), the three in
alternation round by round; ``% link`` is the median over rounds of contig time / path
time. Target: kernel >= 80% of contig at page >= 16 for page_first and layer_first (and the
same bar, reported, for ``dma``).

**Q. Queued.** The same copies with the host's part hidden: a spin holds the copy stream
until the engine has planned and queued every layer, and CUDA events time the GPU alone
(from the spin's end to the last layer), with the host's submit time beside it. It tells
the copy's own rate from the engine's per-operation cost.

**G. Grid.** The kernel's blocks per component, swept on one case, since the copy shares
the SMs with the model.

Models: ``mha`` = Llama-3-8B at TP 1 (32 layers, 8 KV heads of 128, bf16: 2 KiB rows,
128 KiB per token); ``mla`` = DeepSeek-V3 (61 layers, 512 + 64 latent, bf16: 1152 B rows).

Usage (on the GPU machine, after ``source bench/gpu/setup.sh``)::

    python bench/transfer_gpu.py --json $OUT/transfer_gpu.json --md $OUT/transfer_gpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hiradix.memory import HOST_LAYOUTS, CudaCopyEngine, DeviceKVPool, HostKVPool, KVShape, MHAShape, MLAShape
from hiradix.memory import kernel as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import interleaved, log, machine, shuffled_slots, write_outputs

MIB = 1 << 20
DTYPE = torch.bfloat16
MODELS: dict[str, KVShape] = {
    "mha": MHAShape(layer_num=32, head_num=8, head_dim=128),
    "mla": MLAShape(layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64),
}


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel": K.cuda_kernel_available(),
    }


class Case:
    """A device pool and a pinned host pool of ``n_pages`` pages each, every page of both
    in a random order, and a contiguous pinned/device pair of the same bytes."""

    def __init__(self, model: str, ps: int, total: int, layout: str, seed: int) -> None:
        shape = MODELS[model]
        self.per_token = shape.elems_per_token * 2
        tokens = max(1, total // (ps * self.per_token)) * ps
        self.dev = DeviceKVPool(shape, size=tokens, page_size=ps, dtype=DTYPE, device="cuda")
        self.host = HostKVPool(shape, tokens, ps, DTYPE, layout, reserve_bytes=0)  # type: ignore[arg-type]
        assert self.host.pin_memory
        self.host._buf.view(torch.uint8).fill_(0x5A)
        for layer in range(shape.layer_num):
            for buf in self.dev.layer_buffers(layer):
                buf.view(torch.uint8).fill_(0xA5)
        n_pages = tokens // ps
        self.d_idx = shuffled_slots(n_pages, ps, 1, seed)  # device page 0 is padding
        self.h_idx = shuffled_slots(n_pages, ps, 0, seed + 1)
        self.nbytes = tokens * self.per_token
        self.pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda").fill_(2)

    def op(self, eng: CudaCopyEngine, direction: str) -> Callable[[], None]:
        def run() -> None:
            if direction == "backup":
                eng.backup(self.dev, self.host, self.d_idx, self.h_idx).wait()
            else:
                eng.load(self.host, self.dev, self.h_idx, self.d_idx).wait()
            torch.cuda.synchronize()

        return run

    def contig(self, direction: str) -> Callable[[], None]:
        def run() -> None:
            if direction == "backup":
                self.pinned.copy_(self.flat, non_blocking=True)
            else:
                self.flat.copy_(self.pinned, non_blocking=True)
            torch.cuda.synchronize()

        return run


def bench_pages(args: argparse.Namespace) -> list[dict]:
    rows = []
    for model in args.models:
        for ps in args.page_sizes:
            for layout in HOST_LAYOUTS:
                case = Case(model, ps, args.total_mib * MIB, layout, seed=ps * 7 + 1)
                with (
                    CudaCopyEngine(kernel=True, blocks=args.blocks) as kern,
                    CudaCopyEngine(kernel=True, dma=True) as dma,
                    CudaCopyEngine(kernel=False) as ref,
                ):
                    for direction in ("backup", "load"):
                        fns = {
                            "contig": case.contig(direction),
                            "kernel": case.op(kern, direction),
                            "dma": case.op(dma, direction),
                        }
                        if not args.no_torch:
                            fns["torch"] = case.op(ref, direction)
                        times = interleaved(fns, args.repeats)
                        row: dict = {
                            "model": model,
                            "layout": layout,
                            "direction": direction,
                            "page_size": ps,
                            "page_kib": ps * case.per_token / 1024,
                            "bytes": case.nbytes,
                        }
                        for k, ts in times.items():
                            row[f"{k}_gbs"] = case.nbytes / statistics.median(ts) / 1e9
                            row[f"{k}_vs_link"] = statistics.median(
                                c / t for c, t in zip(times["contig"], ts, strict=True)
                            )
                        if "torch" in times:
                            row["kernel_vs_torch"] = statistics.median(
                                t / k for t, k in zip(times["torch"], times["kernel"], strict=True)
                            )
                        rows.append(row)
                        log(
                            f"  {model} {layout:18s} {direction:6s} ps={ps:3d}: "
                            + ", ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith(("gbs", "link")))
                        )
                del case
                torch.cuda.empty_cache()
    return rows


SPIN_CYCLES = 100_000_000  # ~50 ms at 2 GHz: longer than any engine's host part here


def _gpu_ms(stream: torch.cuda.Stream, submit: Callable[[], None]) -> tuple[float, float]:
    """(GPU ms, host submit ms) of ``submit``'s work on ``stream``, timed from the end of a
    spin that holds the stream until ``submit`` has queued everything."""
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


def _queued_rows(args: argparse.Namespace, layout: str, ps: int) -> list[dict]:
    case = Case("mha", ps, args.total_mib * MIB, layout, seed=ps * 5 + 3)
    engines = {"kernel": CudaCopyEngine(kernel=True, blocks=args.blocks), "dma": CudaCopyEngine(kernel=True, dma=True)}
    side = torch.cuda.Stream()
    rows = []
    for direction in ("backup", "load"):

        def submit(eng: CudaCopyEngine, direction: str = direction) -> None:
            if direction == "backup":
                eng.backup(case.dev, case.host, case.d_idx, case.h_idx)
            else:
                eng.load(case.host, case.dev, case.h_idx, case.d_idx)

        def contig(direction: str = direction) -> None:
            with torch.cuda.stream(side):
                case.contig(direction)()

        got: dict[str, list[tuple[float, float]]] = {"contig": [], **{k: [] for k in engines}}
        for i in range(args.repeats + 1):  # the first round warms up
            for name, eng in engines.items():
                r = _gpu_ms(eng._stream, lambda eng=eng: submit(eng))
                if i:
                    got[name].append(r)
            r = _gpu_ms(side, contig)
            if i:
                got["contig"].append(r)
        row: dict = {"layout": layout, "page_size": ps, "direction": direction, "bytes": case.nbytes}
        for k, rs in got.items():
            row[f"{k}_gpu_gbs"] = case.nbytes / (statistics.median(g for g, _ in rs) / 1e3) / 1e9
            row[f"{k}_submit_ms"] = statistics.median(h for _, h in rs)
        rows.append(row)
        log(
            f"  Q {layout:18s} ps={ps:3d} {direction:6s}: "
            + ", ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith(("gbs", "_ms")))
        )
    for eng in engines.values():
        eng.close()
    return rows


def bench_queued(args: argparse.Namespace) -> list[dict]:
    rows = []
    for layout in ("layer_first", "page_first_direct", "page_first"):
        for ps in (16, 64):
            rows += _queued_rows(args, layout, ps)
            torch.cuda.empty_cache()
    return rows


def bench_grid(args: argparse.Namespace) -> list[dict]:
    rows = []
    case = Case("mha", 16, args.total_mib * MIB, "page_first", seed=3)
    for direction in ("load", "backup"):
        fns = {"contig": case.contig(direction)}
        engines = {b: CudaCopyEngine(kernel=True, blocks=b) for b in args.grid}
        for b, eng in engines.items():
            fns[f"b{b}"] = case.op(eng, direction)
        times = interleaved(fns, args.repeats)
        for b in args.grid:
            ts = times[f"b{b}"]
            rows.append(
                {
                    "direction": direction,
                    "blocks": b,
                    "gbs": case.nbytes / statistics.median(ts) / 1e9,
                    "vs_link": statistics.median(c / t for c, t in zip(times["contig"], ts, strict=True)),
                }
            )
            log(f"  grid {direction} blocks={b}: {rows[-1]['gbs']:.2f} GB/s, {rows[-1]['vs_link']:.0%} of link")
        for eng in engines.values():
            eng.close()
    return rows


# ----------------------------------------------------------------------------- report
def report(meta: dict, pages: list[dict], grid: list[dict], queued: list[dict] | None = None) -> str:
    g, m = meta["gpu"], meta["machine"]
    lines = [
        f"## transfer on the GPU — {g['gpu']} ({g['sms']} SMs), {m['cpu']} ({m['nproc']} cores), {meta['date']}",
        "",
        f"Command `{meta['command']}`; torch {g['torch']} (CUDA {g['cuda']}); {meta['repeats']} rounds after one "
        "warm-up, paths alternated round by round, medians. Host pools pinned; bf16.",
        "",
        f"### A. Page copies ({meta['total_mib']} MiB of whole pages per copy, random page order on both sides)",
        "",
        "GB/s. `kernel` = the gather/scatter kernel "
        f"({meta['blocks']} blocks x {K.DEFAULT_THREADS} threads per component), `dma` = the same rows merged into "
        "runs for the copy engines (one `cudaMemcpyBatchAsync` per layer), `torch` = the torch indexing path, "
        "`contig` = one contiguous pinned `copy_` of the same bytes (the link). `% link` = median over rounds of "
        "contig time / path time.",
        "",
        "| model | layout | direction | page | contig | kernel | kernel % link | dma | dma % link | torch "
        "| torch % link | kernel / torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pages:
        torch_cells = (
            f"{r['torch_gbs']:.2f} | {r['torch_vs_link']:.0%} | {r['kernel_vs_torch']:.1f}×"
            if "torch_gbs" in r
            else "n/a | n/a | n/a"
        )
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['direction']} | {r['page_size']} ({r['page_kib']:.0f} KiB) | "
            f"{r['contig_gbs']:.2f} | {r['kernel_gbs']:.2f} | {r['kernel_vs_link']:.0%} | {r['dma_gbs']:.2f} | "
            f"{r['dma_vs_link']:.0%} | {torch_cells} |"
        )
    target = [r for r in pages if r["page_size"] >= 16 and r["layout"] in ("page_first", "layer_first")]
    for path in ("kernel", "dma") if target else ():
        key = f"{path}_vs_link"
        ok = sum(r[key] >= 0.8 for r in target)
        worst = min(target, key=lambda r: r[key])
        lines.append(
            f"\nTarget ({path} >= 80% of the link at page >= 16, page_first and layer_first): {ok}/{len(target)} "
            f"cases; lowest {worst[key]:.0%} ({worst['model']} {worst['layout']} {worst['direction']}, "
            f"page {worst['page_size']})."
        )
    if queued:
        lines += [
            "",
            "### Q. GPU time alone (mha; the copy stream held by a spin until everything is queued)",
            "",
            "GB/s over the GPU's time from the spin's end to the last layer; `submit` = the host's time to plan "
            "and queue the operation.",
            "",
            "| layout | page | direction | contig | kernel | kernel % contig | kernel submit | dma | dma % contig "
            "| dma submit |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['layout']} | {r['page_size']} | {r['direction']} | {r['contig_gpu_gbs']:.2f} | "
            f"{r['kernel_gpu_gbs']:.2f} | {r['kernel_gpu_gbs'] / r['contig_gpu_gbs']:.0%} | "
            f"{r['kernel_submit_ms']:.2f} ms | {r['dma_gpu_gbs']:.2f} | {r['dma_gpu_gbs'] / r['contig_gpu_gbs']:.0%} | "
            f"{r['dma_submit_ms']:.2f} ms |"
            for r in queued
        ]
    if grid:
        lines += [
            "",
            "### G. Kernel grid (mha, page_first, page 16)",
            "",
            "| direction | blocks per component | GB/s | % link |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['direction']} | {r['blocks']} | {r['gbs']:.2f} | {r['vs_link']:.0%} |" for r in grid]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mha,mla")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--total-mib", type=int, default=1024, help="MiB per copy in sections A and G")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=K.DEFAULT_BLOCKS, help="kernel blocks per component")
    ap.add_argument("--grid", default="4,8,16,32,64,132", help="blocks swept in section G")
    ap.add_argument("--no-torch", action="store_true", help="leave the torch path out of section A")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: A,Q,G")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    if not K.cuda_kernel_available():
        log("needs a CUDA GPU and the kernel library (built by setup.py where nvcc is found)")
        return 2
    args.models = args.models.split(",")
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.grid = [int(b) for b in args.grid.split(",") if b]
    skip = {s.strip().upper() for s in args.skip.split(",") if s.strip()}
    meta = {
        "machine": machine(),
        "gpu": gpu_info(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/transfer_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": args.repeats,
        "total_mib": args.total_mib,
        "blocks": args.blocks,
    }
    queued = [] if "Q" in skip else bench_queued(args)
    grid = [] if "G" in skip else bench_grid(args)
    pages = [] if "A" in skip else bench_pages(args)
    text = report(meta, pages, grid, queued)
    print(text)
    write_outputs(args, text, {"meta": meta, "pages": pages, "grid": grid, "queued": queued})
    return 0


if __name__ == "__main__":
    sys.exit(main())
