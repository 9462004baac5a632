"""Layer-wise loads consumed through SGLang's own KV pool: the overlap it buys and the
bytes it guarantees.

hiradix's controller registers its layer-done counter with SGLang's KV pool
(``register_layer_transfer_counter``, :class:`hiradix.sglang.controller.SGLangCacheController`),
so SGLang's attention, which reads layer ``i`` through the pool's ``get_key_buffer(i)`` /
``get_value_buffer(i)``, waits for that layer of the batch's load: on a GPU, the compute
stream waits on the layer's CUDA event, recorded on the copy stream after its copy. Both
sections below drive SGLang's ``MHATokenToKVPool`` (Llama-3-8B at TP 1: 32 layers, 8 KV
heads of 128, bf16) and never call ``wait_until`` themselves; the consumer index is set on
the counter as SGLang's TP worker sets ``hicache_consumer_index``.

**D. Overlap.** A load of ``--pipeline-mib`` of layer_first host pages (page 16) consumed by
a synthetic Llama-3-8B forward: per layer, the pool's K and V reads of the loaded rows
(the attention's data dependency), then the layer's four projections (``[T, 4096] @
[4096, 6144]``, ``[4096, 4096]``, ``[4096, 28672]``, ``[14336, 4096]``). ``T`` is chosen
so that compute is a set multiple of the load. Timed with CUDA events on the compute
stream: load alone, compute alone (no consumer: no waits), both pipelined; ideal =
max(load, compute) + one layer's load. Target: pipelined <= 1.10 x ideal. Beside them, the
forward with a load in flight that it does not wait for (contention alone: the GEMM
slowdown, target at most 5%), and the host's time to submit the load.

**W. Wait correctness.** Many rounds of: zero the device rows, load random host pages into
them with every layer's copy deliberately slowed (the engine's ``layer_delay_cycles``
spin), and snapshot each layer's rows straight after the pool's ``get_key_buffer`` /
``get_value_buffer`` returned, on the compute stream. Every snapshot is compared with the
bytes an independent CPU load of the same host pages gives. With the counter registered no
layer may be stale; the control run unregisters it (what hiradix did before the fix) and
must see stale layers, or the check proves nothing.

Both sections run for each path (``--paths``): hiradix's ``warp`` and ``wide`` kernel modes,
``dma`` (the same rows as runs on the copy engines) and ``mapped`` (the torch fallback:
torch's index kernels over the mapped host pool), and SGLang 0.5.23's own kernels driven
layer by layer through the same controller (``sgl-reg``, ``sgl-tma``:
``sglang_kernels.SGLangLayerEngine``); ``-high`` appended puts the copy stream at the
highest priority. On a machine without CUDA
``--device cpu`` runs the same code on CPU pools with the thread engine (its layer hook
slows the loads), a dry run of the script; timings then mean nothing.

SGLang: an installed one, or its source through ``--sglang-src`` (a folder or tarball; see
``bench/gpu/sglang_src.py``, used on the GPU machines, which cannot install it).

Usage (on the GPU machine, after ``source bench/gpu/setup.sh``)::

    python bench/layer_wait_gpu.py --sglang-src .gpu/sglang-0.5.23.tar.gz \\
        --json $OUT/layer_wait.json --md $OUT/layer_wait.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import log, machine, write_outputs

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
MIB = 1 << 20
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # K and V rows of every layer, bf16


def load_sglang(src: str | None) -> Any:
    """SGLang's ``memory_pool`` module: the installed SGLang, or its source at ``src``."""
    if src is None:
        import sglang.srt.mem_cache.memory_pool as mp

        return mp
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from sglang_src import CALLED, PLACEHOLDERS, load_memory_pool

    mp = load_memory_pool(src)
    log(f"SGLang from {mp.__file__}; placeholders for missing packages: {', '.join(PLACEHOLDERS) or 'none'}")
    log(f"placeholders called while importing: {', '.join(CALLED) or 'none'}")
    return mp


@dataclass
class Rig:
    """SGLang's KV pool, the hiradix pools over it, and the controller whose counter is
    registered with it: what ``hiradix.sglang`` builds inside a server."""

    kv: Any  # sglang.srt.mem_cache.memory_pool.MHATokenToKVPool
    ctrl: Any  # hiradix.sglang.controller.SGLangCacheController
    engine: Any
    device: torch.device

    @property
    def counter(self) -> Any:
        return self.ctrl.layer_done_counter

    def start_load(self, h: torch.Tensor, d: torch.Tensor) -> int:
        """Queue and submit one load; returns its consumer index (the batch's
        ``hicache_consumer_index``)."""
        self.ctrl.load(h, d)
        return int(self.ctrl.start_loading())

    def finish(self) -> None:
        self.ctrl.ack_loads(wait_all=True)

    def close(self) -> None:
        self.finish()
        self.ctrl.close()
        self.engine.close()


CUDA_PATHS = {  # CudaCopyEngine's arguments per path
    "warp": {"kernel": True, "mode": "warp"},
    "wide": {"kernel": True, "mode": "wide"},
    "dma": {"kernel": True, "dma": True},
    "mapped": {"kernel": False},
}
SGLANG_PATHS = {"sgl-reg": "register", "sgl-tma": "tma"}  # SGLang's kernels, per layer: variant


def make_engine(path: str, delay: float) -> Any:
    """The copy engine of a CUDA ``path`` (``-high`` appended: its copy stream at the
    highest priority); ``delay`` GPU cycles spun before each layer."""
    from hiradix.memory import CudaCopyEngine

    base, high = path.removesuffix("-high"), path.endswith("-high")
    if base in SGLANG_PATHS:
        from sglang_kernels import SGLangLayerEngine

        return SGLangLayerEngine(SGLANG_PATHS[base], layer_delay_cycles=int(delay), stream_priority=-100 if high else 0)
    if base not in CUDA_PATHS:
        raise ValueError(f"unknown path {path!r}: {sorted(CUDA_PATHS) + sorted(SGLANG_PATHS)} (or with -high)")
    return CudaCopyEngine(**CUDA_PATHS[base], stream_priority=-100 if high else 0, layer_delay_cycles=int(delay))


def make_rig(mp: Any, device: str, tokens: int, host_tokens: int, path: str, delay: float) -> Rig:
    """``path``: a key of :data:`CUDA_PATHS` or :data:`SGLANG_PATHS` (``-high`` appended:
    the copy stream at the highest priority), or ``thread`` (CPU). ``delay``: the
    per-layer slow-down, GPU cycles (CUDA) or seconds (CPU)."""
    from hiradix.memory import HostKVPool, ThreadCopyEngine
    from hiradix.sglang.controller import SGLangCacheController
    from hiradix.sglang.pools import device_pool_from_sglang

    kv = mp.MHATokenToKVPool(
        size=tokens,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device=device,
        enable_memory_saver=False,
    )
    dev = device_pool_from_sglang(kv)
    host = HostKVPool(dev.shape, host_tokens, PAGE, DTYPE, "layer_first", reserve_bytes=0)
    if device == "cuda":
        engine: Any = make_engine(path, delay)
    else:

        def slow(kind: str, op_id: int, layer: int) -> None:
            time.sleep(delay)  # the dry run's stand-in for a slow link, never an ordering

        engine = ThreadCopyEngine(native=False, layer_hook=slow if delay else None)
    ctrl = SGLangCacheController(
        dev, host, write_policy="write_through", io_backend="kernel", sglang_pool=kv, load_engine=engine
    )
    return Rig(kv, ctrl, engine, dev.device)


def pages(rng: torch.Generator, first: int, count: int, n_pages: int) -> torch.Tensor:
    """Slots of ``n_pages`` distinct random pages among pages ``first .. count - 1``."""
    chosen = torch.randperm(count - first, generator=rng)[:n_pages] + first
    return (chosen[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


class Timer:
    """Milliseconds of a function: CUDA events on the current stream, or wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


class Forward:
    """Llama-3-8B's per-layer projections for ``tokens`` tokens (bf16), one weight set
    shared by every layer (the bytes a matmul reads are the same either way). ``shrink``
    divides every width (the CPU dry run's model; 1 on a GPU)."""

    def __init__(self, tokens: int, device: torch.device, shrink: int = 1) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        hid, q, kv, mlp = (n // shrink for n in (4096, 4096, 2048, 14336))

        def w(k: int, n: int) -> torch.Tensor:
            return torch.randn(k, n, device=device, dtype=DTYPE, generator=g) / 64

        self.q, self.mlp = q, mlp
        self.x = torch.randn(tokens, hid, device=device, dtype=DTYPE, generator=g)
        self.w = [w(hid, q + kv), w(q, hid), w(hid, 2 * mlp), w(mlp, hid)]

    def layer(self) -> None:
        qkv = self.x @ self.w[0]
        _ = qkv[:, : self.q] @ self.w[1]
        gu = self.x @ self.w[2]
        _ = gu[:, : self.mlp] @ self.w[3]


def attention_reads(kv: Any, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """What the attention takes of layer ``layer``: the loaded rows of K and V, read through
    SGLang's pool (which waits for the layer when a counter is registered)."""
    return kv.get_key_buffer(layer).index_select(0, rows), kv.get_value_buffer(layer).index_select(0, rows)


# ----------------------------------------------------------------------------- D
def bench_overlap(mp: Any, args: argparse.Namespace, path: str) -> list[dict]:
    n_pages = max(1, args.pipeline_mib * MIB // (TOKEN_BYTES * PAGE))
    tokens = n_pages * PAGE
    rig = make_rig(mp, args.device, tokens + PAGE, tokens + 2 * PAGE, path, 0)
    timer = Timer(rig.device)
    rng = torch.Generator().manual_seed(7)
    h = pages(rng, 0, tokens // PAGE + 1, n_pages)
    d = pages(rng, 1, tokens // PAGE + 1, n_pages)
    d_dev = d.to(rig.device)
    rows = []

    submits: list[float] = []

    def load() -> None:
        t0 = time.perf_counter()
        idx = rig.start_load(h, d)
        submits.append((time.perf_counter() - t0) * 1e3)
        rig.counter.set_consumer(idx)
        rig.counter.wait_until(LAYERS - 1)  # the time the last layer lands, for the baseline only

    def forward(fwd: Forward, consumer: int) -> None:
        rig.counter.set_consumer(consumer)
        for layer in range(LAYERS):
            attention_reads(rig.kv, layer, d_dev)  # kernels reading the loaded rows
            fwd.layer()

    def settle(ms: float) -> float:
        rig.finish()
        return ms

    for _ in range(2):
        settle(timer(load))
    load_ms = statistics.median(settle(timer(load)) for _ in range(args.repeats))
    probe = Forward(1024, rig.device, args.shrink)
    for _ in range(2):
        timer(lambda p=probe: forward(p, -1))
    per_1024 = statistics.median(timer(lambda p=probe: forward(p, -1)) for _ in range(3))
    del probe
    for ratio in args.ratios:
        t_tokens = max(64, round(1024 * ratio * load_ms / per_1024 / 64) * 64)
        fwd = Forward(t_tokens, rig.device, args.shrink)

        def pipelined(fwd: Forward = fwd) -> None:
            forward(fwd, rig.start_load(h, d))

        for _ in range(2):
            timer(lambda fwd=fwd: forward(fwd, -1))
            settle(timer(pipelined))

        def contended(fwd: Forward = fwd) -> None:  # a load in flight, the forward not waiting for it
            rig.start_load(h, d)
            forward(fwd, -1)

        t: dict[str, list[float]] = {"load": [], "compute": [], "pipelined": [], "contended": []}
        for _ in range(args.repeats):  # alternated round by round
            t["load"].append(settle(timer(load)))
            t["compute"].append(timer(lambda fwd=fwd: forward(fwd, -1)))
            t["pipelined"].append(settle(timer(pipelined)))
            t["contended"].append(settle(timer(contended)))
        ideals = [max(lo, co) + lo / LAYERS for lo, co in zip(t["load"], t["compute"], strict=True)]
        row = {
            "path": path,
            "compute_over_load": ratio,
            "tokens": t_tokens,
            "load_mib": tokens * TOKEN_BYTES / MIB,
            "load_ms": statistics.median(t["load"]),
            "compute_ms": statistics.median(t["compute"]),
            "pipelined_ms": statistics.median(t["pipelined"]),
            "ideal_ms": statistics.median(ideals),
            "ratio": statistics.median(p / i for p, i in zip(t["pipelined"], ideals, strict=True)),
            "submit_ms": statistics.median(submits),
            "contended_ms": statistics.median(t["contended"]),
            "gemm_slowdown": statistics.median(c / a for c, a in zip(t["contended"], t["compute"], strict=True)) - 1,
        }
        rows.append(row)
        log(
            f"  D {path} r={ratio}: load {row['load_ms']:.2f} ms, compute {row['compute_ms']:.2f} ms, "
            f"pipelined {row['pipelined_ms']:.2f} ms, ideal {row['ideal_ms']:.2f} ms, ratio {row['ratio']:.3f}, "
            f"host submit {row['submit_ms']:.2f} ms, compute beside a load {row['contended_ms']:.2f} ms "
            f"({row['gemm_slowdown']:+.1%})"
        )
        del fwd
    rig.close()
    return rows


# ----------------------------------------------------------------------------- W
class Oracle:
    """Each layer's K and V rows as an independent CPU load of the host pages gives them
    (the thread engine's torch path, into a CPU pool of the device pool's size)."""

    def __init__(self, rig: Rig) -> None:
        from hiradix.memory import DeviceKVPool, ThreadCopyEngine

        self.host = rig.ctrl.host_pool
        self.cpu = DeviceKVPool(self.host.shape, rig.ctrl.device_pool.size, PAGE, DTYPE, "cpu")
        self.engine = ThreadCopyEngine(native=False, inline=True)

    def __call__(self, h: torch.Tensor, d: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.engine.load(self.host, self.cpu, h, d).wait()
        return [(self.cpu.layer_buffers(i)[0][d], self.cpu.layer_buffers(i)[1][d]) for i in range(LAYERS)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))


def check_waits(mp: Any, args: argparse.Namespace, path: str) -> list[dict]:
    n_pages = args.check_pages
    dev_pages, host_pages = 4 * n_pages + 1, 8 * n_pages
    delay = args.delay
    rig = make_rig(mp, args.device, dev_pages * PAGE, host_pages * PAGE, path, delay)
    raw = rig.ctrl.host_pool.backing_tensor.view(torch.uint8)
    g = torch.Generator().manual_seed(11)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    rng = torch.Generator().manual_seed(13)
    oracle = Oracle(rig)
    out = []
    for registered in (True, False):
        rig.kv.register_layer_transfer_counter(rig.counter if registered else None)
        stale_layers = stale_rounds = 0
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            h = pages(rng, 0, host_pages, n_pages)
            d = pages(rng, 1, dev_pages, n_pages)
            d_dev = d.to(rig.device)
            for layer in range(LAYERS):  # stale bytes: what a read before the load would see
                for buf in (rig.kv.k_buffer[layer], rig.kv.v_buffer[layer]):
                    buf.index_fill_(0, d_dev, 0)
            idx = rig.start_load(h, d)
            rig.counter.set_consumer(idx)  # SGLang's TP worker: the batch's hicache_consumer_index
            snaps = [tuple(x.clone() for x in attention_reads(rig.kv, layer, d_dev)) for layer in range(LAYERS)]
            rig.finish()
            if rig.device.type == "cuda":
                torch.cuda.synchronize()
            want = oracle(h, d)
            bad = sum(  # bitwise: random bytes hold NaNs, which never compare equal as bf16
                not (_same_bits(k, wk) and _same_bits(v, wv)) for (k, v), (wk, wv) in zip(snaps, want, strict=True)
            )
            stale_layers += bad
            stale_rounds += bad > 0
        row = {
            "path": path,
            "counter_registered": registered,
            "rounds": args.rounds,
            "layers_checked": args.rounds * LAYERS,
            "stale_layers": stale_layers,
            "stale_rounds": stale_rounds,
            "tokens_per_load": n_pages * PAGE,
            "delay": delay,
            "seconds": time.perf_counter() - t0,
        }
        out.append(row)
        log(
            f"  W {path} registered={registered}: {stale_layers}/{row['layers_checked']} layers stale "
            f"in {stale_rounds}/{args.rounds} rounds ({row['seconds']:.1f} s)"
        )
    rig.kv.register_layer_transfer_counter(rig.counter)
    oracle.engine.close()
    rig.close()
    return out


# ----------------------------------------------------------------------------- report
def report(meta: dict, overlap: list[dict], waits: list[dict]) -> str:
    lines = [
        f"## layer-wise loads through SGLang's KV pool — {meta['device_name']}, {meta['date']}",
        "",
        f"Command `{meta['command']}`; SGLang {meta['sglang']} `MHATokenToKVPool` (Llama-3-8B, TP 1, bf16, "
        f"page {PAGE}), hiradix's `SGLangCacheController` registering its counter with it; torch {meta['torch']}.",
    ]
    if overlap:
        lines += [
            "",
            f"### D. Overlap ({overlap[0]['load_mib']:.0f} MiB per load, layer_first host pool; "
            f"{meta['repeats']} rounds, medians; {meta['timer']})",
            "",
            "`compute beside a load`: the same forward while a load runs that it does not wait for (contention "
            "alone); `GEMM slowdown` = that / compute alone - 1.",
            "",
            "| path | compute / load | tokens | load | compute | pipelined | ideal | pipelined / ideal "
            "| host time to submit the load | compute beside a load | GEMM slowdown |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['path']} | {r['compute_over_load']} | {r['tokens']} | {r['load_ms']:.2f} ms | "
            f"{r['compute_ms']:.2f} ms | {r['pipelined_ms']:.2f} ms | {r['ideal_ms']:.2f} ms | {r['ratio']:.3f} | "
            f"{r.get('submit_ms', float('nan')):.2f} ms | {r.get('contended_ms', float('nan')):.2f} ms | "
            f"{r.get('gemm_slowdown', float('nan')):+.1%} |"
            for r in overlap
        ]
        worst = max(overlap, key=lambda r: r["ratio"])
        ok = sum(r["ratio"] <= 1.10 for r in overlap)
        lines.append(
            f"\nTarget (pipelined <= 1.10 x ideal): {ok}/{len(overlap)} cases; highest {worst['ratio']:.3f} "
            f"({worst['path']}, compute/load {worst['compute_over_load']})."
        )
        for path in dict.fromkeys(r["path"] for r in overlap):
            mine = [r for r in overlap if r["path"] == path]
            slow = max(r.get("gemm_slowdown", float("nan")) for r in mine)
            ratios = ", ".join(format(r["ratio"], ".3f") for r in mine)
            at = ", ".join(str(r["compute_over_load"]) for r in mine)
            lines.append(
                f"`{path}`: pipelined / ideal {ratios} at compute/load {at}; GEMM slowdown at most {slow:+.1%} "
                "(targets 1.10 and 5%)."
            )
    if waits:
        lines += [
            "",
            f"### W. Wait correctness ({waits[0]['tokens_per_load']} tokens per load, every layer's copy slowed "
            f"(the spin per layer: {meta['delay_unit']}); snapshots taken right after `get_key_buffer` / "
            "`get_value_buffer`, checked against an independent CPU load)",
            "",
            "| path | spin per layer | counter registered with the pool | rounds | layers checked | stale layers "
            "| stale rounds |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['path']} | {r['delay']:g} | {'yes' if r['counter_registered'] else 'no (control)'} | "
            f"{r['rounds']} | {r['layers_checked']} | {r['stale_layers']} | {r['stale_rounds']} |"
            for r in waits
        ]
        good = all(r["stale_layers"] == 0 for r in waits if r["counter_registered"])
        seen = all(r["stale_layers"] > 0 for r in waits if not r["counter_registered"])
        control = "stale layers seen, so the check can fail" if seen else "no stale layer seen: it proved nothing"
        lines.append(f"\nRegistered: {'no stale layer' if good else 'STALE LAYERS READ'}; control: {control}.")
    lines.append("")
    return "\n".join(lines)


def _guarded(name: str, fn: Callable[[], list[dict]]) -> list[dict]:
    """One path's section; a failure is logged with its traceback and the others still run."""
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception:
        log(f"  {name} failed:\n{traceback.format_exc()}")
        return []
    finally:
        log(f"  {name}: {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the logic")
    ap.add_argument("--sglang-src", default=None, help="SGLang's source (folder or .tar.gz) when it is not installed")
    ap.add_argument(
        "--paths", default=None, help="engine paths (default: warp,wide,mapped,sgl-reg,sgl-tma on CUDA, thread on CPU)"
    )
    ap.add_argument("--pipeline-mib", type=int, default=1024, help="MiB per load in section D")
    ap.add_argument("--ratios", default="0.5,1,2", help="compute/load ratios for section D")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=200, help="rounds per run in section W")
    ap.add_argument("--check-pages", type=int, default=16, help="pages per load in section W")
    ap.add_argument(
        "--delay", type=float, default=None, help="per-layer slow-down in W: GPU cycles (default 200000) or CPU seconds"
    )
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: D,W")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.shrink = 1 if cuda else 32
    if cuda and not torch.cuda.is_available():
        log("--device cuda needs a CUDA GPU; torch.cuda.is_available() is False here (--device cpu: a dry run)")
        return 2
    args.ratios = [float(r) for r in args.ratios.split(",")]
    paths = (args.paths or ("warp,wide,mapped,sgl-reg,sgl-tma" if cuda else "thread")).split(",")
    if args.delay is None:
        args.delay = 200_000 if cuda else 0.002
    skip = {s.strip().upper() for s in args.skip.split(",") if s.strip()}
    mp = load_sglang(args.sglang_src)
    from importlib.metadata import version

    if cuda and any(p.partition("-high")[0] in ("warp", "wide", "dma") for p in paths):
        from hiradix.memory import kernel as K

        if not K.cuda_kernel_available():
            log(f"the kernel paths need the kernel library: {K.kernel_unavailable_reason()}")
            return 2
    if cuda and any(p.partition("-high")[0] in SGLANG_PATHS for p in paths):
        try:
            import sglang_kernels as sk

            sk.load_sglang_kernels(args.sglang_src or sk.DEFAULT_SOURCE)
        except Exception as exc:  # the rest of the benchmark goes on without SGLang's kernels
            log(f"SGLang's kernels cannot be loaded ({exc!r}); leaving their paths out")
            paths = [p for p in paths if p.partition("-high")[0] not in SGLANG_PATHS]
    meta = {
        "machine": machine(),
        "device_name": torch.cuda.get_device_name() if cuda else "CPU dry run (timings meaningless)",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/layer_wait_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "sglang": version("sglang"),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "timer": "CUDA events on the compute stream" if cuda else "wall clock",
        "delay_unit": "GPU cycles" if cuda else "seconds",
    }
    waits: list[dict] = []
    overlap: list[dict] = []

    def save() -> None:  # after every path: a run stopped by its time limit keeps what it measured
        write_outputs(args, report(meta, overlap, waits), {"meta": meta, "overlap": overlap, "waits": waits})

    for path in paths:  # W first: the correctness check outranks the timing
        if "W" not in skip:
            waits += _guarded(f"W {path}", lambda path=path: check_waits(mp, args, path))
            save()
    for path in paths:
        if "D" not in skip:
            overlap += _guarded(f"D {path}", lambda path=path: bench_overlap(mp, args, path))
            save()
            if cuda:
                torch.cuda.empty_cache()
    if args.sglang_src:
        from sglang_src import CALLED

        meta["placeholders_called"] = list(CALLED)
        log(f"placeholders called in the whole run: {', '.join(CALLED) or 'none'}")
    text = report(meta, overlap, waits)
    print(text)
    write_outputs(args, text, {"meta": meta, "overlap": overlap, "waits": waits})
    bad = any(r["stale_layers"] for r in waits if r["counter_registered"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
