"""Host time of one CUDA-engine operation before its first byte moves: what the scheduler
thread pays per load or backup on the kernel path (``CudaCopyEngine(kernel=True)``).

Per operation the engine validates the slot indices, plans the rows
(:func:`hiradix.memory.kernel.plan`) and builds one job array per layer (or, ``dma``, one
batch of runs per layer). The plan has two halves: the pools' geometry (a tensor view per
layer and component: independent of the indices) and the rows' offsets. ``cached`` keeps
the geometry per pool pair (:class:`~hiradix.memory.kernel.GeometryCache`, what the engine
does); ``fresh`` recomputes it every time (the engine before it). Both run here on CPU pools
of the GPU benchmark's shapes; the GPU adds only the launches (``bench/transfer_gpu.py``).

Each case times both variants alternated round by round (warm-up, repeats, medians).

Usage::

    python bench/kernel_plan.py          # tables for bench/RESULTS_transfer.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape, MLAShape
from hiradix.memory import kernel as K
from hiradix.memory.copy import _validate_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import interleaved, log, machine, shuffled_slots, write_outputs

MODELS = {
    "mha": MHAShape(layer_num=32, head_num=8, head_dim=128),
    "mla": MLAShape(layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64),
}


def operation(dev: DeviceKVPool, host: HostKVPool, d: torch.Tensor, h: torch.Tensor, cache: K.GeometryCache | None):
    """One operation's host work on the kernel path, up to the launches."""

    def run() -> None:
        dd, hh = _validate_cpu(dev, host, d, h)
        geo = cache.get(dev, host) if cache is not None else K.geometry(dev, host)
        assert geo is not None
        p = K.plan(dev, host, dd, hh, geo)
        assert p is not None
        for layer in range(dev.layer_num):
            p.jobs(layer, 0, 0, True)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,2048,16384", help="tokens per operation")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    ps = args.page_size
    rows = []
    for model, shape in MODELS.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            dev = DeviceKVPool(shape, size=tokens, page_size=ps, dtype=torch.bfloat16, device="cpu")
            host = HostKVPool(shape, tokens, ps, torch.bfloat16, "page_first", reserve_bytes=0, pin_memory=False)
            d = shuffled_slots(tokens // ps, ps, 1, 3)
            h = shuffled_slots(tokens // ps, ps, 0, 4)
            times = interleaved(
                {"fresh": operation(dev, host, d, h, None), "cached": operation(dev, host, d, h, K.GeometryCache())},
                args.repeats,
            )
            row = {"model": model, "tokens": tokens, "page_size": ps, "layers": shape.layer_num}
            for k, ts in times.items():
                row[f"{k}_ms"] = statistics.median(ts) * 1e3
            row["speedup"] = statistics.median(f / c for f, c in zip(times["fresh"], times["cached"], strict=True))
            rows.append(row)
            log(f"  {model} {tokens:6d} tokens: fresh {row['fresh_ms']:.3f} ms, cached {row['cached_ms']:.3f} ms")
            del dev, host
    m = machine()
    command = "python bench/kernel_plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"### Host time per kernel-path operation — {m['cpu']} ({m['nproc']} cores), {time.strftime('%Y-%m-%d')}",
        "",
        f"Command `{command}`; page {ps}, page_first host pool; {args.repeats} rounds after a warm-up, the two "
        "variants alternated, medians. `speedup` = median over rounds of fresh / cached.",
        "",
        "| model | layers | tokens | geometry each time | geometry kept per pool pair | speedup |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['layers']} | {r['tokens']} | {r['fresh_ms']:.3f} ms | {r['cached_ms']:.3f} ms | "
        f"{r['speedup']:.1f}× |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_outputs(args, text, {"machine": m, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
