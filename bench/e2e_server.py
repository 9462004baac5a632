"""Stock SGLang's hierarchical cache against hiradix's, each inside a real SGLang server
(``python -m sglang.launch_server``), one after the other in one run on the same server
build.

The servers are the ones ``tests/e2e`` starts on a CPU-only machine (tiny Llama of
``tests/e2e/tiny_model.py``, SGLang's CPU engine, a 2,048-token device pool, host pool
twice that, ``layer_first`` host layout and ``direct`` I/O for both caches: stock's host
pool copies on CPU only that way). Stock's cache runs with the stand-ins for its CUDA-only
host-pool steps (``tests/e2e/inject/sitecustomize.py``); hiradix's through the plugin
(``--radix-cache-backend hiradix``).

Workload: ``--requests`` greedy requests over ``--prefixes`` shared 300-token prefixes
(each with a 16-token suffix of its own, 4 new tokens), so that prefixes leave the device and
load back from host. Each is sent at concurrency 1 and at ``--concurrency`` (default 32),
streaming, after ``--warmup`` requests that are not counted. Per cache and concurrency:

- requests/s over the measured requests (wall time);
- TTFT p50 / p99: from sending a request to its first streamed chunk;
- the scheduler process's CPU seconds per request (``/proc/PID/stat`` utime + stime of
  ``sglang::scheduler``, before and after the measured requests);
- outputs equal between the two caches (every request, token for token).

Each (cache, concurrency) runs ``--repeats`` times (default 3) on a fresh server, the two
caches alternating which goes first; the table gives the medians and their ratios.

Usage: ``python bench/e2e_server.py [--requests 1000] [--out bench/RESULTS_e2e_server.md]``
from the main venv (SGLang 0.5.18) or ``.venv-sglang23`` (the report names the version).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.e2e import tiny_model  # noqa: E402
from tests.e2e.server import Server, sglang_version  # noqa: E402
from tests.e2e.workload import shared_prefixes  # noqa: E402

COMMON = (
    "--enable-hierarchical-cache",
    "--max-total-tokens",
    "2048",
    "--hicache-ratio",
    "2",
    "--hicache-mem-layout",
    "layer_first",
    "--hicache-io-backend",
    "direct",
    "--enable-cache-report",
)
CACHES = {
    "stock": ((), {"HIRADIX_E2E_STOCK_ON_CPU": "1"}),
    "hiradix": (("--radix-cache-backend", "hiradix"), {}),
}


def scheduler_cpu_seconds(server: Server) -> float:
    """utime + stime of the server's scheduler process (found by its process title)."""
    assert server.proc is not None
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if name.startswith("sglang::schedul") and int(fields[2]) == os.getpgid(server.proc.pid):
            return (int(fields[11]) + int(fields[12])) / tick
    raise RuntimeError("no sglang::scheduler process in the server's process group")


def stream_one(server: Server, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[float, list[int]]:
    """Send one streaming request; ``(seconds to the first chunk, output ids)``."""
    body = {
        "input_ids": list(prompt),
        "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(
        server.url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(line[5:])
    assert ttft is not None, "no chunk streamed"
    return ttft, list(last.get("output_ids", []))


def run_phase(server: Server, prompts: list[tuple[int, ...]], max_new_tokens: int, concurrency: int) -> dict[str, Any]:
    cpu0, t0 = scheduler_cpu_seconds(server), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_one(server, p, max_new_tokens), prompts))
    wall, cpu = time.perf_counter() - t0, scheduler_cpu_seconds(server) - cpu0
    ttfts = sorted(r[0] for r in results)
    return {
        "rps": len(prompts) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "cpu_ms_per_req": 1e3 * cpu / len(prompts),
        "outputs": [r[1] for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="measured requests per phase")
    ap.add_argument("--warmup", type=int, default=64, help="uncounted requests first, per server")
    ap.add_argument("--prefixes", type=int, default=16, help="shared 300-token prefixes")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (cache, concurrency); medians reported")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this Markdown file")
    args = ap.parse_args()
    if min(args.requests, args.prefixes, args.concurrency, args.repeats) < 1 or args.warmup < 0:
        ap.error("--requests, --prefixes, --concurrency and --repeats must be positive, --warmup not negative")

    work = Path(tempfile.mkdtemp(prefix="hiradix-e2e-bench-"))
    model = tiny_model.build(work / "model")
    w = shared_prefixes(n_prefixes=args.prefixes, n_requests=args.warmup + args.requests, max_new_tokens=4, seed=7)
    warm, measured = list(w.prompts[: args.warmup]), list(w.prompts[args.warmup :])
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for conc in (1, args.concurrency):
            # Alternate which cache goes first, so that drift of the shared machine
            # does not favour one.
            for name in list(CACHES) if repeat % 2 == 0 else list(reversed(CACHES)):
                flags, env = CACHES[name]
                tag = f"{name}-{conc}-{repeat}"
                server = Server(model, (*COMMON, *flags), work / tag, env=env, name=tag)
                server.start()
                try:
                    run_phase(server, warm, w.max_new_tokens, conc)
                    r = run_phase(server, measured, w.max_new_tokens, conc)
                finally:
                    server.stop()
                runs.setdefault((name, conc), []).append(r)
                print(
                    f"{name:8s} c={conc:<3d} #{repeat} {r['rps']:7.1f} req/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                    f"p99 {r['ttft_p99_ms']:7.1f} ms  scheduler CPU {r['cpu_ms_per_req']:6.2f} ms/req",
                    flush=True,
                )
    figures = ("rps", "ttft_p50_ms", "ttft_p99_ms", "cpu_ms_per_req")
    rows = {key: {f: statistics.median(r[f] for r in rs) for f in figures} for key, rs in runs.items()}
    same = {
        conc: sum(
            a == b
            for s_run, h_run in zip(runs[("stock", conc)], runs[("hiradix", conc)], strict=True)
            for a, b in zip(s_run["outputs"], h_run["outputs"], strict=True)
        )
        for conc in (1, args.concurrency)
    }

    lines = [
        f"### SGLang {sglang_version()}, {args.requests} requests a phase ({args.warmup} warm-up), "
        f"{args.prefixes} prefixes, medians of {args.repeats} runs, {platform.machine()} {os.cpu_count()} vCPUs, "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        "| concurrency | cache | requests/s | TTFT p50 (ms) | TTFT p99 (ms) | scheduler CPU (ms/request) |",
        "|---|---|---|---|---|---|",
    ]
    for conc in (1, args.concurrency):
        for name in CACHES:
            r = rows[(name, conc)]
            lines.append(
                f"| {conc} | {name} | {r['rps']:.1f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                f"{r['cpu_ms_per_req']:.2f} |"
            )
        s, h = rows[("stock", conc)], rows[("hiradix", conc)]
        lines.append(
            f"| {conc} | hiradix / stock | {h['rps'] / s['rps']:.2f}x | "
            f"{h['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}x | {h['ttft_p99_ms'] / s['ttft_p99_ms']:.2f}x | "
            f"{h['cpu_ms_per_req'] / s['cpu_ms_per_req']:.2f}x ({same[conc]}/{len(measured) * args.repeats} "
            f"outputs equal) |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
