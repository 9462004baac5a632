"""Host time of one CUDA-engine operation before its first byte moves: what the scheduler
thread pays per load or backup on the kernel path (``CudaCopyEngine``'s default on a GPU).

Per operation the engine validates the slot indices, plans the offsets
(:func:`hiradix.memory.kernel.plan`, the pools' geometry kept per pool pair) and queues
every layer. Two variants, alternated round by round (warm-up, repeats, medians):

``rows``  the engine before issue 44: owned, checked copies of the indices, the rows sorted
          by host slot, one offset per row, and one job array built in Python per layer
          (``KernelPlan.jobs``), each launched by its own call
``pages`` the engine now: the indices read in place and checked while the offsets are
          computed, one offset per page where whole pages move (the pages sorted, not the
          rows), and the job templates kept with the geometry, so one call queues every
          layer (the launch itself, a few microseconds in C, is not timed here)

Both run here on CPU pools of the GPU benchmark's shapes; the GPU adds only the launches
(``bench/transfer_gpu.py``, section Q, times the whole submit on the device). Target
(issue 44): at most 0.3 ms for an operation of 1,024 pages.

Usage::

    python bench/kernel_plan.py          # tables for bench/RESULTS_transfer.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape, MLAShape
from hiradix.memory import kernel as K
from hiradix.memory.copy import _validate_cpu, as_index_array

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import interleaved, log, machine, shuffled_slots, write_outputs

MODELS = {
    "mha": MHAShape(layer_num=32, head_num=8, head_dim=128),
    "mla": MLAShape(layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64),
}


def operation(dev: DeviceKVPool, host: HostKVPool, d: torch.Tensor, h: torch.Tensor, per_row: bool):
    """One operation's host work on the kernel path, up to the launches."""
    cache = K.GeometryCache()

    def run() -> None:
        geo = cache.get(dev, host)
        assert geo is not None
        if per_row:  # owned, checked copies of the indices; the rows sorted; a job array per layer
            dd, hh = _validate_cpu(dev, host, d, h)
            with _rows_only():
                p = K.plan(dev, host, dd, hh, geo)
            assert p is not None
            for layer in range(dev.layer_num):
                p.jobs(layer, 0, 0, True)
        else:  # the indices read in place and checked by the plan; the pages sorted; the templates kept
            p = K.plan(dev, host, as_index_array(d, "device_indices"), as_index_array(h, "host_indices"), geo)
            assert p is not None
            p.geometry.templates(True, 0)

    return run


@contextlib.contextmanager
def _rows_only() -> Iterator[None]:
    """Plans with one offset per row, as before pages were grouped."""
    saved = K._page_groups
    K._page_groups = lambda dev, host, ps: 1
    try:
        yield
    finally:
        K._page_groups = saved


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
                {"rows": operation(dev, host, d, h, True), "pages": operation(dev, host, d, h, False)}, args.repeats
            )
            row = {"model": model, "tokens": tokens, "page_size": ps, "layers": shape.layer_num}
            for k, ts in times.items():
                row[f"{k}_ms"] = statistics.median(ts) * 1e3
            row["speedup"] = statistics.median(f / c for f, c in zip(times["rows"], times["pages"], strict=True))
            rows.append(row)
            log(f"  {model} {tokens:6d} tokens: rows {row['rows_ms']:.3f} ms, pages {row['pages_ms']:.3f} ms")
            del dev, host
    m = machine()
    command = "python bench/kernel_plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"### Host time per kernel-path operation — {m['cpu']} ({m['nproc']} cores), {time.strftime('%Y-%m-%d')}",
        "",
        f"Command `{command}`; page {ps}, page_first host pool; {args.repeats} rounds after a warm-up, the two "
        f"variants alternated, medians; load average {os.getloadavg()[0]:.1f}. `speedup` = median over rounds of "
        "rows / pages.",
        "",
        "| model | layers | tokens | pages | a row's offset, a job array per layer (before) | a page's offset, "
        "one call (now) | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['layers']} | {r['tokens']} | {r['tokens'] // r['page_size']} | {r['rows_ms']:.3f} ms | "
        f"{r['pages_ms']:.3f} ms | {r['speedup']:.1f}× |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_outputs(args, text, {"machine": m, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
