"""RDMA READ throughput of hiradix's transport against ``ib_read_bw`` (perftest) on one NIC.

Needs RDMA hardware: a device in ``/sys/class/infiniband`` with an ACTIVE port, hiradix
built with ``libibverbs-dev``, and ``perftest`` for the reference. Target: hiradix reaches
at least 95% of ``ib_read_bw`` with the same message size and queue depth. On a machine
without RDMA it says why and exits with status 2.

What to run, on two hosts A (server) and B (client) joined by the RDMA fabric::

    # reference (perftest): A then B
    A$ ib_read_bw -d mlx5_0 -s 16384 -n 20000 --report_gbits
    B$ ib_read_bw -d mlx5_0 -s 16384 -n 20000 --report_gbits A
    # hiradix: A then B (same token on both)
    A$ HIRADIX_CLUSTER_TOKEN=... .venv/bin/python bench/rdma_read_bw.py serve --host 0.0.0.0 --port 7471
    B$ HIRADIX_CLUSTER_TOKEN=... .venv/bin/python bench/rdma_read_bw.py read --peer A:7471 \\
           --raddr ... --rkey ... --rlen ...   # as A's 'serve' line prints them
           --ib-read-bw-gbits <B's ib_read_bw figure>

On one host with a NIC (loopback through the NIC) both halves can run at once:
``bench/rdma_read_bw.py loop`` starts a server and a reader in one process, and runs
``ib_read_bw`` against itself when it is on the PATH.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from hiradix.transport import Status
from hiradix.transport.rdma import RdmaTransport, rdma_unavailable_reason


def _require_rdma() -> None:
    reason = rdma_unavailable_reason()
    if reason is not None:
        print(f"rdma_read_bw: cannot run here: {reason}.", file=sys.stderr)
        print("It needs a host with an RDMA NIC (ACTIVE port); see this script's docstring for what to run.")
        raise SystemExit(2)


def serve(a: argparse.Namespace) -> None:
    t = RdmaTransport(host=a.host, port=a.port, device=a.device, qp_depth=a.depth)
    buf = np.random.default_rng(0).integers(0, 256, a.pool_mb << 20, dtype=np.uint8)
    r = t.register(buf)
    print(f"serving {a.pool_mb} MiB at {t.address}: --raddr {r.addr} --rkey {r.rkey} --rlen {r.length}", flush=True)
    threading.Event().wait()


def read(a: argparse.Namespace, transport: RdmaTransport | None = None) -> float:
    t = transport or RdmaTransport(device=a.device, qp_depth=a.depth, channels_per_read=a.qps)
    dst = np.zeros(a.batch * a.size, dtype=np.uint8)
    lr = t.register(dst, remote=False)
    n_src = a.rlen // a.size
    rng = np.random.default_rng(1)
    rates = []
    for rep in range(a.warmup + a.repeats):
        pages = rng.integers(0, n_src, a.batch, dtype=np.uint64)
        raddr = a.raddr + pages * a.size
        laddr = lr.addr + np.arange(a.batch, dtype=np.uint64) * a.size
        length = np.full(a.batch, a.size, dtype=np.uint64)
        rkey = np.full(a.batch, a.rkey, dtype=np.uint32)
        t0 = time.perf_counter()
        st = t.read_batch_arrays(a.peer, raddr, rkey, length, laddr)
        dt = time.perf_counter() - t0
        if not (st == Status.OK).all():
            raise SystemExit(f"read failed: {np.unique(st, return_counts=True)}")
        if rep >= a.warmup:
            rates.append(a.batch * a.size * 8 / dt / 1e9)
    med = statistics.median(rates)
    print(
        f"hiradix RDMA READ: {a.batch} x {a.size} B per batch, {a.qps} QPs, depth {a.depth}: "
        f"median {med:.1f} Gb/s (min {min(rates):.1f}, max {max(rates):.1f}) over {a.repeats} batches"
    )
    if a.ib_read_bw_gbits:
        print(
            f"ib_read_bw: {a.ib_read_bw_gbits:.1f} Gb/s -> hiradix at {100 * med / a.ib_read_bw_gbits:.1f}% "
            "(target >= 95%)"
        )
    return med


def loop(a: argparse.Namespace) -> None:
    server = RdmaTransport(device=a.device, qp_depth=a.depth)
    buf = np.random.default_rng(0).integers(0, 256, a.pool_mb << 20, dtype=np.uint8)
    r = server.register(buf)
    a.peer, a.raddr, a.rkey, a.rlen = server.address, r.addr, r.rkey, r.length
    read(a)
    perf = shutil.which("ib_read_bw")
    if perf is None:
        print("ib_read_bw not found (apt-get install perftest): no reference figure")
        return
    dev = ["-d", a.device] if a.device else []
    srv = subprocess.Popen([perf, *dev, "-s", str(a.size), "-n", "20000", "--report_gbits"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # perftest's server must listen first; a benchmark, not a test
        out = subprocess.run(
            [perf, *dev, "-s", str(a.size), "-n", "20000", "--report_gbits", "localhost"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        print(out)
    finally:
        srv.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["serve", "read", "loop"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7471)
    ap.add_argument("--peer", default="")
    ap.add_argument("--raddr", type=int, default=0)
    ap.add_argument("--rkey", type=int, default=0)
    ap.add_argument("--rlen", type=int, default=0)
    ap.add_argument("--size", type=int, default=16384, help="bytes per READ (a KV page)")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--qps", type=int, default=2)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ib-read-bw-gbits", type=float, default=0.0)
    a = ap.parse_args()
    _require_rdma()
    if a.mode == "serve":
        serve(a)
    elif a.mode == "read":
        if not (a.peer and a.rkey and a.rlen):
            raise SystemExit("read needs --peer, --raddr, --rkey and --rlen (printed by 'serve')")
        read(a)
    else:
        loop(a)


if __name__ == "__main__":
    os.environ.setdefault("HIRADIX_CLUSTER_TOKEN", "rdma-read-bw-benchmark-token")
    main()
