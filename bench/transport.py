"""Transport throughput: ``TcpTransport.read_batch`` against a raw Python socket, two
processes on loopback, the same bytes in the same run.

A responder process registers a region of pages and also runs a raw socket server over the
same memory (``sendall`` of each page; the consumer ``recv_into``\\ s it). The consumer
process reads every page of the region into a local registered buffer with one
``read_batch`` per repeat, then pulls the same bytes through the raw socket. Median and min
of ``--repeats`` after ``--warmup`` runs, per page size.

``--busy`` adds a pure-Python busy thread to the responder process: if the responder's hot
path held the GIL while moving bytes, throughput would collapse to the GIL switch interval.

    python bench/transport.py                  # 16 KiB .. 1 MiB pages, 64 MiB per run
    python bench/transport.py --busy           # the same with a GIL hog in the responder
    python bench/transport.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import threading
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: rawsock.py sits here

from rawsock import RawServer, connect, measure

from hiradix.transport import Status, TcpTransport

TOKEN = b"bench-transport-token-0123456789"
PAGES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def responder(conn, region_bytes: int, busy: bool, kw: dict) -> None:
    """Child process: publish a region, serve the transport and the raw socket."""
    t = TcpTransport(TOKEN, **kw)
    src = np.random.default_rng(0).integers(0, 256, size=region_bytes, dtype=np.uint8)
    r = t.register(src)
    stop = threading.Event()
    raw = RawServer(lambda page: src)  # every page size reads the region from its start
    if busy:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    conn.send((t.address, r.addr, r.rkey, r.length, raw.port, src[:4096].tobytes()))
    conn.recv()  # wait for "stop"
    stop.set()
    t.close()
    raw.close()


def run(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    kw: dict = {}
    proc = ctx.Process(target=responder, args=(child, args.region_mib << 20, args.busy, kw), daemon=True)
    proc.start()
    address, raddr, rkey, rlen, raw_port, head = parent.recv()
    ref = np.frombuffer(head, dtype=np.uint8)  # the region's first 4 KiB, checked after every read
    reader = TcpTransport(
        TOKEN,
        channels_per_read=args.channels,
        max_inflight_frames=args.window,
        frame_bytes=args.frame_kib << 10,
        timeout=60.0,
    )
    dst = np.zeros(rlen, dtype=np.uint8)
    lr = reader.register(dst)
    raw = connect(raw_port)
    rows = []
    try:
        for page in args.pages:
            n = rlen // page
            ops = [(raddr + i * page, rkey, page, lr.addr + i * page) for i in range(n)]
            get = partial(reader.read_batch, address, ops)
            row = {"page_kib": page >> 10, "pages": n} | measure(
                get,
                raw,
                dst,
                ref,
                page=page,
                n=n,
                warmup=args.warmup,
                repeats=args.repeats,
                name="transport",
                prefix="transport_",
                ok=Status.OK,
                clear=slice(0, 4096),
                sample=slice(0, 4096),
            )
            row["ratio_median"] = row.pop("ratio")
            rows.append(row)
            print(
                f"{page >> 10:5d} KiB x{n:5d}: transport {row['transport_gbps_median']:.2f} GB/s "
                f"(best {row['transport_gbps_best']:.2f}), raw {row['raw_gbps_median']:.2f} GB/s "
                f"(best {row['raw_gbps_best']:.2f}), ratio {row['ratio_median']:.2f}",
                flush=True,
            )
    finally:
        raw.close()
        reader.close()
        parent.send("stop")
        proc.join(10)
    return {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "busy_responder": args.busy,
        "channels_per_read": args.channels,
        "window": args.window,
        "frame_kib": args.frame_kib,
        "region_mib": args.region_mib,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=lambda s: [int(x) << 10 for x in s.split(",")], default=PAGES, help="KiB list")
    p.add_argument("--region-mib", type=int, default=64)
    p.add_argument("--channels", type=int, default=2)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--frame-kib", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--busy", action="store_true", help="run a GIL-hogging Python thread in the responder")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
