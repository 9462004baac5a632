"""PeerCache 0.8.4 (TCP mode) and Mooncake Store (TCP) under the workload of ``bench/peer.py``.

Run by ``bench/peer.py`` with the interpreter of a separate venv that has the system
installed (never the hiradix venv for these two; neither is a hiradix dependency), and
``hiradix-mooncake`` (hiradix's Mooncake backend against Mooncake's own client) with the
hiradix venv, which has the pinned wheel::

    .bench-venvs/peercache/bin/python bench/peer_others.py peercache --pages 16384 65536
    .bench-venvs/mooncake/bin/python bench/peer_others.py mooncake
    .venv/bin/python -m hiradix._netns .venv/bin/python bench/peer_others.py hiradix-mooncake

Same shape as our bench: a producer process publishes ``--total-mib`` of random pages per
page size and serves the same bytes over a raw socket; a consumer process reads every page
into a host buffer through the system's batch get, alternating repeat by repeat with a raw
``recv_into`` of the same bytes (the same-run baseline); then ``batch_exists`` of 128 keys.
Prints progress on stderr and one JSON line on stdout.

Only public APIs are used: PeerCache's ``PeerCacheStore`` (SGLang HiCache storage:
``register_mem_pool_host``, ``batch_set_v1``, ``batch_get_v1``, ``batch_exists``) with
``protocol="tcp"``; Mooncake's ``MooncakeDistributedStore`` (``setup``, ``register_buffer``,
``batch_put_from``, ``batch_get_into``, ``batch_is_exist``) with ``protocol="tcp"``, a
``mooncake_master`` on 127.0.0.1 and the P2P handshake instead of a metadata server.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: rawsock.py sits here

from rawsock import RawServer, connect, exists_latency, measure

PAGES = [16 << 10, 64 << 10, 256 << 10, 1 << 20]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _keys(page: int, n: int) -> list[str]:
    return [f"bench-{page}-{i:06d}" for i in range(n)]


def _data(page: int, n: int) -> np.ndarray:
    return np.random.default_rng(page).integers(0, 256, size=n * page, dtype=np.uint8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- PeerCache
class _KVBuffer:
    """The two calls PeerCache makes on ``mem_pool_host.kv_buffer``."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def numel(self) -> int:
        return int(self.arr.size)

    def element_size(self) -> int:
        return 1


class _HostPool:
    """A page-first host pool as PeerCache sees SGLang's: ``kv_buffer`` plus
    ``get_page_buffer_meta`` (one pointer and size per page)."""

    def __init__(self, arr: np.ndarray, page: int) -> None:
        self.page_bytes = page
        self.kv_buffer = _KVBuffer(arr)

    def get_page_buffer_meta(self, host_indices: Any) -> tuple[list[int], list[int]]:
        base = self.kv_buffer.data_ptr()
        idx = list(host_indices)
        return [base + int(i) * self.page_bytes for i in idx], [self.page_bytes] * len(idx)


def _pc_store(discovery: str, node_id: str, seg_bytes: int) -> Any:
    from peercache.store import PeerCacheStore

    cfg = SimpleNamespace(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        is_mla_model=True,  # one object per page, as our page_first pool
        extra_config={
            "discovery_addr": discovery,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "node_id": node_id,
            "global_segment_size": seg_bytes,
            "metrics_enabled": False,
            "disk_enabled": False,
            "heartbeat_interval": 0.2,
            "member_ttl": 30.0,
        },
    )
    return PeerCacheStore(cfg)


def _pc_producer(conn: Any, total: int, pages: list[int]) -> None:
    from peercache.discovery import DiscoveryServer

    meta = DiscoveryServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{meta.start()}"
    seg = sum(total // p * (p + 4096) for p in pages) + (64 << 20)
    store = _pc_store(addr, "producer", seg)
    data = {p: _data(p, total // p) for p in pages}
    big = np.concatenate([data[p] for p in pages])
    host = _HostPool(big, 1)  # byte-addressed: page index = byte offset
    store.register_mem_pool_host(host)
    base = 0
    for p in pages:
        n = total // p
        keys = _keys(p, n)
        host.page_bytes = p
        for s in range(0, n, 256):
            e = min(n, s + 256)
            first = base // p
            ok = store.batch_set_v1(keys[s:e], list(range(first + s, first + e)))
            if not all(ok):
                raise RuntimeError(f"peercache producer: batch_set_v1 failed at page {p}")
        base += n * p
    with RawServer(data) as raw:
        conn.send((addr, raw.port))
        conn.recv()
    store.close()
    meta.stop()


def run_peercache(args: argparse.Namespace) -> dict[str, Any]:
    total = args.total_mib << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pc_producer, args=(child, total, args.pages), daemon=True)
    proc.start()
    addr, raw_port = parent.recv()
    store = _pc_store(addr, "consumer", 64 << 20)
    deadline = time.time() + 20
    while time.time() < deadline and len(store.runtime.ring) < 2:
        time.sleep(0.05)
    # The producer published alone; its entries move to the keys' new owners when it
    # sees the consumer join (re-publish on a membership change). Wait until all resolve.
    probe = _keys(min(args.pages), total // min(args.pages))
    while time.time() < deadline + 30 and int(store.batch_exists(probe)) < len(probe):
        time.sleep(0.2)
    raw = connect(raw_port, timeout=120)
    try:
        rows = []
        for p, n, keys, flat in _sweep(args, total):
            store.register_mem_pool_host(_HostPool(flat, p))
            idx = list(range(n))

            def get(keys: list[str] = keys, idx: list[int] = idx) -> list[bool]:
                out: list[bool] = []
                for s in range(0, len(keys), args.batch):
                    out += store.batch_get_v1(keys[s : s + args.batch], idx[s : s + args.batch])
                return out

            rows.append(_measure("peercache", p, n, flat, get, raw, args))
        exists = _exists_lat(
            lambda ks: int(store.batch_exists(ks)), _keys(min(args.pages), total // min(args.pages)), args
        )
    finally:
        raw.close()
        store.close()
        parent.send("stop")
        proc.join(timeout=30)
    return {"system": "peercache 0.8.4 (tcp)", "rows": rows, "exists": exists}


# ---------------------------------------------------------------------- Mooncake
def _mc_store(master: str, seg_bytes: int, buf_bytes: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", seg_bytes, buf_bytes, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    return store


def _mc_producer(conn: Any, master: str, total: int, pages: list[int]) -> None:
    seg = sum(total // p * p for p in pages) + (64 << 20)
    store = _mc_store(master, seg, 64 << 20)
    data = {p: _data(p, total // p) for p in pages}
    for p in pages:
        arr = data[p]
        n = total // p
        if store.register_buffer(int(arr.ctypes.data), int(arr.nbytes)) != 0:
            raise RuntimeError("mooncake register_buffer failed")
        keys = _keys(p, n)
        base = int(arr.ctypes.data)
        for s in range(0, n, 256):
            e = min(n, s + 256)
            rc = store.batch_put_from(keys[s:e], [base + i * p for i in range(s, e)], [p] * (e - s))
            if any(r != 0 for r in rc):
                raise RuntimeError(f"mooncake producer: batch_put_from failed at page {p}: {set(rc)}")
    with RawServer(data) as raw:
        conn.send(raw.port)
        conn.recv()
    store.close()


def run_mooncake(args: argparse.Namespace) -> dict[str, Any]:
    total = args.total_mib << 20
    exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")
    if exe is None:
        raise RuntimeError("mooncake_master not found next to this interpreter")
    port = _free_port()
    master = f"127.0.0.1:{port}"
    mlog = open(os.environ.get("MOONCAKE_MASTER_LOG", "/tmp/mooncake_master.log"), "w")  # noqa: SIM115
    mproc = subprocess.Popen(
        [exe, f"--rpc_port={port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=false"],
        stdout=mlog,
        stderr=subprocess.STDOUT,
    )
    time.sleep(1.5)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_mc_producer, args=(child, master, total, args.pages), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("mooncake producer did not come up")
        raw_port = parent.recv()
        # Joins after every put: no object lands in the consumer's own segment.
        store = _mc_store(master, 16 << 20, 16 << 20)
        raw = connect(raw_port, timeout=120)
        try:
            rows = []
            for p, n, keys, flat in _sweep(args, total):
                if store.register_buffer(int(flat.ctypes.data), int(flat.nbytes)) != 0:
                    raise RuntimeError("mooncake register_buffer failed")
                ptrs = [int(flat.ctypes.data) + i * p for i in range(n)]

                def get(keys: list[str] = keys, ptrs: list[int] = ptrs, p: int = p) -> list[bool]:
                    out: list[bool] = []
                    for s in range(0, len(keys), args.batch):
                        ks = keys[s : s + args.batch]
                        rc = store.batch_get_into(ks, ptrs[s : s + args.batch], [p] * len(ks))
                        out += [r == p for r in rc]
                    return out

                rows.append(_measure("mooncake", p, n, flat, get, raw, args))
                store.unregister_buffer(int(flat.ctypes.data))

            def exists(ks: list[str]) -> int:
                n = 0
                for r in store.batch_is_exist(ks):
                    if r != 1:
                        break
                    n += 1
                return n

            ex = _exists_lat(exists, _keys(min(args.pages), total // min(args.pages)), args)
        finally:
            raw.close()
            store.close()
    finally:
        parent.send("stop")
        proc.join(timeout=30)
        mproc.terminate()
        mproc.wait(timeout=10)
        mlog.close()
    return {"system": "mooncake store (tcp)", "rows": rows, "exists": ex}


# ---------------------------------------------------------------------- hiradix over Mooncake
def run_hiradix_mooncake(args: argparse.Namespace) -> dict[str, Any]:
    """hiradix's ``mooncake`` backend against Mooncake's own client, same run, same pages.

    A producer process puts every page with Mooncake's client (``batch_put_from``), as in
    :func:`run_mooncake`. The consumer is one :class:`hiradix.storage.mooncake.MooncakeStorage`
    with a ``page_first`` host KV pool registered. Each round times
    ``MooncakeStorage.batch_get_v1`` of every page into the pool, then the same pages with
    the backend's Mooncake client called directly (``batch_get_into`` in batches of
    ``--batch`` keys, into the same pool memory), each after the pool was zeroed and
    checked after. The paired ratio is the median over rounds of hiradix over client speed.
    Runs with the hiradix venv (the wheel of requirements/mooncake.txt installed), in a
    network namespace of its own when ``bench/peer.py`` starts it.
    """
    import torch

    from hiradix.memory.pools import HostKVPool, MHAShape
    from hiradix.storage import StorageConfig, create_backend
    from hiradix.storage.mooncake import MooncakeMaster

    total = args.total_mib << 20
    master = MooncakeMaster(log_path=os.environ.get("MOONCAKE_MASTER_LOG", "/tmp/mooncake_master.log"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_mc_producer, args=(child, master.addr, total, args.pages), daemon=True)
    proc.start()
    rows = []
    try:
        if not parent.poll(300):
            raise RuntimeError("mooncake producer did not come up")
        parent.recv()  # the raw server's port: unused here (the baseline is Mooncake's client)
        cfg = {"master_server_addr": master.addr, "global_segment_size": 16 << 20, "max_batch_keys": args.batch}
        store = create_backend("mooncake", StorageConfig(extra_config=cfg))
        client = store.client  # type: ignore[attr-defined]
        try:
            for p in args.pages:
                n = total // p
                keys = _keys(p, n)
                host = HostKVPool(MHAShape(1, 1, p // 4), n, 1, torch.float16, "page_first", pin_memory=False)
                assert host.page_bytes == p
                store.register_mem_pool_host(host)
                flat = host.pages_array().reshape(-1)
                ref = _data(p, n)
                idx = np.arange(n)
                base = int(flat.ctypes.data)
                ptrs = [base + i * p for i in range(n)]

                def ours(keys: list[str] = keys, idx: np.ndarray = idx) -> int:
                    return sum(store.batch_get_v1(keys, idx))

                def theirs(keys: list[str] = keys, ptrs: list[int] = ptrs, p: int = p) -> int:
                    hits = 0
                    for s in range(0, len(keys), args.batch):
                        rc = client.batch_get_into(
                            keys[s : s + args.batch], ptrs[s : s + args.batch], [p] * len(keys[s : s + args.batch])
                        )
                        hits += sum(r == p for r in rc)
                    return hits

                t_ours: list[float] = []
                t_theirs: list[float] = []
                for rep in range(args.warmup + args.repeats):
                    for fn, times in ((ours, t_ours), (theirs, t_theirs)):
                        flat[:] = 0
                        t0 = time.perf_counter()
                        hits = fn()
                        dt = time.perf_counter() - t0
                        if hits != n or not np.array_equal(flat[::4099], ref[::4099]):
                            raise RuntimeError(f"{fn.__name__} get failed at page {p}: {n - hits} misses")
                        if rep >= args.warmup:
                            times.append(dt)
                gb = n * p / 1e9
                row = {
                    "page_kib": p >> 10,
                    "hiradix_gbps_median": gb / float(np.median(t_ours)),
                    "hiradix_gbps_best": gb / min(t_ours),
                    "client_gbps_median": gb / float(np.median(t_theirs)),
                    "client_gbps_best": gb / min(t_theirs),
                    "ratio_paired": float(np.median([b / a for a, b in zip(t_ours, t_theirs, strict=True)])),
                }
                rows.append(row)
                _log(
                    f"hiradix-mooncake {p >> 10:>5} KiB  hiradix {row['hiradix_gbps_median']:.2f} GB/s"
                    f"  client {row['client_gbps_median']:.2f} GB/s  paired {row['ratio_paired']:.2f}"
                )
                del host, flat
        finally:
            store.close()
    finally:
        parent.send("stop")
        proc.join(timeout=30)
        master.close()
    return {"system": "hiradix mooncake backend vs mooncake client (tcp)", "rows": rows}


# ---------------------------------------------------------------------- shared
def _sweep(args: Any, total: int) -> Iterator[tuple[int, int, list[str], np.ndarray]]:
    """Per page size: page bytes, page count, keys and a zeroed destination for them all."""
    for p in args.pages:
        n = total // p
        yield p, n, _keys(p, n), np.zeros(n * p, dtype=np.uint8)


def _measure(name: str, p: int, n: int, flat: np.ndarray, get: Any, raw: socket.socket, args: Any) -> dict[str, Any]:
    row = measure(get, raw, flat, _data(p, n), page=p, n=n, warmup=args.warmup, repeats=args.repeats, name=name)
    _log(
        f"{name} {p >> 10:>5} KiB  {row['gbps_median']:.2f} GB/s"
        f"  raw {row['raw_gbps_median']:.2f}  ratio {row['ratio']:.2f}  paired {row['ratio_paired']:.2f}"
    )
    return row


def _exists_lat(fn: Any, keys: list[str], args: Any) -> dict[str, Any]:
    out = exists_latency(fn, keys, args.exists_reps)
    _log(f"exists(128): p50 {out['p50_ms']:.3f} ms  p99 {out['p99_ms']:.3f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("system", choices=["peercache", "mooncake", "hiradix-mooncake"])
    ap.add_argument("--pages", type=int, nargs="+", default=PAGES)
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="keys per batch get call (default: all for peercache; 512 for mooncake and hiradix-mooncake, whose"
        " batch_get_into of 4096 keys over TCP missed 1758 of them here while batches of 512 all hit)",
    )
    ap.add_argument("--exists-reps", type=int, default=1000)
    args = ap.parse_args()
    if args.batch <= 0:
        args.batch = 1 << 30 if args.system == "peercache" else 512
    runs = {"peercache": run_peercache, "mooncake": run_mooncake, "hiradix-mooncake": run_hiradix_mooncake}
    result = runs[args.system](args)
    result["load"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
