"""Peer-cache remote get against a raw Python socket, two processes on loopback, same run.

The producer process starts a ``PeerNode`` (the head), publishes ``--total-mib`` of random
pages through ``PeerCacheStore.batch_set`` and runs a raw socket server over the same bytes
(``sendall`` of each page). The consumer process starts a second node that joins it and
reads every page with ``PeerCacheStore.batch_get_v1`` into a ``page_first`` host KV pool
(directory lookup, transport READ into the receive region, slot verification, copy into
the pool), then pulls the same bytes through the raw socket (``recv_into`` each page into
the same host pool). Warm-up runs, then repeats alternating the two; median and best.
Every repeat checks that every page arrived and compares a sample of bytes.

It also times ``batch_exists`` of 128 keys (p50 / p99 over ``--exists-reps`` calls), and,
when they are installed in separate venvs, runs PeerCache 0.8.4 (TCP mode) and Mooncake
Store (TCP) with the same page sizes (``--peercache-python``, ``--mooncake-python``;
skipped with a note otherwise). Last, with the hiradix venv's own Mooncake wheel
(requirements/mooncake.txt), hiradix's ``mooncake`` backend against Mooncake's own client
on the same pages in the same run (``peer_others.py hiradix-mooncake``, in a network
namespace of its own).

    python bench/peer.py                          # 16 KiB .. 1 MiB pages, 64 MiB per run
    python bench/peer.py --json out.json
    python bench/peer.py --no-others --repeats 11   # hiradix against the raw socket only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import secrets
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: rawsock.py sits here

from rawsock import RawServer, connect, exists_latency, measure

PAGES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]


def _keys(page: int, n: int) -> list[str]:
    return [f"bench-{page}-{i:06d}" for i in range(n)]


def producer(conn: Any, token: str, total: int, page_sizes: list[int]) -> None:
    """Child process: the head node with every page published, plus the raw server."""
    from hiradix.peer.config import PeerConfig
    from hiradix.peer.node import PeerNode
    from hiradix.peer.store import PeerCacheStore

    # One pool per page size (size classes), each holding all of that size's pages.
    pool = max(total // p * (p + 128) for p in page_sizes) + (4 << 20)
    node = PeerNode(PeerConfig(cluster_token=token, metrics_enabled=False, pool_size=pool))
    store = PeerCacheStore(node=node)
    pages: dict[int, np.ndarray] = {}
    for p in page_sizes:
        n = total // p
        data = np.random.default_rng(p).integers(0, 256, size=n * p, dtype=np.uint8)
        pages[p] = data
        keys = _keys(p, n)
        for s in range(0, n, 256):
            if not store.batch_set(keys[s : s + 256], [data[i * p : (i + 1) * p] for i in range(s, min(n, s + 256))]):
                raise RuntimeError("producer: batch_set failed")
    with RawServer(pages) as raw:
        conn.send((node.address, raw.port))
        conn.recv()  # "stop"
    node.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hiradix.memory.pools import HostKVPool, MHAShape
    from hiradix.peer.config import PeerConfig
    from hiradix.peer.node import PeerNode
    from hiradix.peer.store import PeerCacheStore

    token = secrets.token_hex(16)
    total = args.total_mib << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child, token, total, args.pages), daemon=True)
    proc.start()
    head, raw_port = parent.recv()
    node = PeerNode(
        PeerConfig(cluster_token=token, metrics_enabled=False, discovery_addr=head, pool_size=1 << 20),
        recv_bytes=args.recv_mib << 20,
    )
    store = PeerCacheStore(node=node)
    raw = connect(raw_port)
    rows = []
    try:
        for p in args.pages:
            n = total // p
            keys = _keys(p, n)
            # A page_first host pool whose page is exactly p bytes (fp16, 1 token per page).
            host = HostKVPool(MHAShape(1, 1, p // 4), n, 1, torch.float16, "page_first", pin_memory=False)
            assert host.page_bytes == p
            store.register_mem_pool_host(host)
            flat = host._buf.view(torch.uint8).numpy()
            ref = np.random.default_rng(p).integers(0, 256, size=n * p, dtype=np.uint8)
            idx = np.arange(n)
            get = partial(store.batch_get_v1, keys, idx)
            row = measure(
                get, raw, flat, ref, page=p, n=n, warmup=args.warmup, repeats=args.repeats, name="peer", prefix="peer_"
            )
            rows.append(row)
            print(
                f"{p >> 10:>5} KiB  peer {row['peer_gbps_median']:.2f} GB/s (best {row['peer_gbps_best']:.2f})"
                f"  raw {row['raw_gbps_median']:.2f} GB/s (best {row['raw_gbps_best']:.2f})  ratio {row['ratio']:.2f}"
                f"  paired {row['ratio_paired']:.2f}",
                flush=True,
            )
            del host, flat
        # batch_exists of 128 keys (all hits; owners spread over both nodes)
        keys = _keys(min(args.pages), total // min(args.pages))
        exists = exists_latency(store.batch_exists, keys, args.exists_reps)
        print(f"batch_exists(128): p50 {exists['p50_ms']:.3f} ms  p99 {exists['p99_ms']:.3f} ms", flush=True)
    finally:
        raw.close()
        store.close()
        node.close()
        parent.send("stop")
        proc.join(timeout=30)
    return {"rows": rows, "exists": exists}


def others(args: argparse.Namespace) -> dict[str, Any]:
    """PeerCache / Mooncake side by side when their venvs exist (bench/peer_others.py)."""
    out: dict[str, Any] = {}
    script = Path(__file__).with_name("peer_others.py")
    systems = [("peercache", args.peercache_python), ("mooncake", args.mooncake_python)]
    systems.append(("hiradix-mooncake", sys.executable))
    for name, py in systems:
        if not py or not Path(py).exists() or not script.exists():
            out[name] = {"skipped": f"no interpreter with {name} installed (pass --{name}-python)"}
            print(f"{name}: skipped ({out[name]['skipped']})", flush=True)
            continue
        import subprocess

        cmd = [py, str(script), name, "--total-mib", str(args.total_mib), "--repeats", str(args.repeats)]
        if name == "hiradix-mooncake":
            from hiradix.storage.mooncake import mooncake_available

            why = mooncake_available()
            if why is not None:
                out[name] = {"skipped": f"the Mooncake wheel does not import: {why}"}
                print(f"{name}: skipped ({out[name]['skipped']})", flush=True)
                continue
            # Mooncake's client listens on 0.0.0.0: a network namespace of its own (root).
            cmd = [sys.executable, "-m", "hiradix._netns", *cmd]
        cmd += ["--warmup", str(args.warmup), "--exists-reps", str(args.exists_reps)]
        cmd += ["--pages", *[str(p) for p in args.pages]]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.others_timeout)
        except subprocess.TimeoutExpired:
            out[name] = {"skipped": f"timed out after {args.others_timeout}s"}
            continue
        if res.returncode != 0:
            out[name] = {"skipped": f"failed: {res.stderr.strip()[-500:]}"}
            print(f"{name}: failed: {res.stderr.strip()[-300:]}", flush=True)
            continue
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
        if name == "hiradix-mooncake":
            for r in out[name]["rows"]:
                print(
                    f"hiradix mooncake backend {r['page_kib']:>5} KiB  {r['hiradix_gbps_median']:.2f} GB/s"
                    f"  mooncake client {r['client_gbps_median']:.2f} GB/s  paired {r['ratio_paired']:.2f}",
                    flush=True,
                )
            continue
        for r in out[name]["rows"]:
            print(
                f"{name} {r['page_kib']:>5} KiB  {r['gbps_median']:.2f} GB/s  raw {r['raw_gbps_median']:.2f} GB/s"
                f"  ratio {r['ratio']:.2f}  paired {r['ratio_paired']:.2f}",
                flush=True,
            )
        ex = out[name]["exists"]
        print(f"{name} exists(128): p50 {ex['p50_ms']:.3f} ms  p99 {ex['p99_ms']:.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=PAGES, help="page sizes in bytes")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes per run (per page size)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recv-mib", type=int, default=64, help="consumer receive region")
    ap.add_argument("--exists-reps", type=int, default=1000)
    # The other systems' venvs: $PEERCACHE_PYTHON / $MOONCAKE_PYTHON, else under
    # $HIRADIX_BENCH_VENVS (default .bench-venvs in the checkout, as bench/setup_sglang.sh).
    venvs = Path(os.environ.get("HIRADIX_BENCH_VENVS") or Path(__file__).resolve().parent.parent / ".bench-venvs")
    ap.add_argument(
        "--peercache-python", default=os.environ.get("PEERCACHE_PYTHON", str(venvs / "peercache/bin/python"))
    )
    ap.add_argument("--mooncake-python", default=os.environ.get("MOONCAKE_PYTHON", str(venvs / "mooncake/bin/python")))
    ap.add_argument("--others-timeout", type=float, default=600.0)
    ap.add_argument("--no-others", action="store_true", help="hiradix only (no PeerCache / Mooncake runs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, load {os.getloadavg()}")
    result = run(args)
    result["others"] = {} if args.no_others else others(args)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
