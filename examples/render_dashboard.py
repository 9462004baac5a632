"""Render a peer node's operator page (``/`` on its metrics port) to a PNG.

Starts a three-node peer cache in this process (TCP on loopback), drives a read workload
whose hit rate changes over time (a cold start, a warm phase, a burst of new prefixes),
samples the hit rate into the page's history as the metrics server would every few
seconds, then serves the page and screenshots it with headless Chromium. Without Chromium
it prints the page's summary and the HTML path instead. Run:

    python examples/render_dashboard.py --out docs/peer-dashboard.png

(the README's screenshot; ``apt-get install chromium`` if it is missing).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from hiradix.peer.metrics import MetricsServer
from hiradix.peer.node import InProcessCluster

PAGE = 64 << 10
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def key(i: int) -> str:
    return hashlib.sha256(f"prefix-{i}".encode()).hexdigest()


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def screenshot(url: str, out: Path, width: int, height: int) -> bool:
    """Screenshot ``url`` into ``out`` with headless Chromium; whether it worked."""
    browser = find_chromium()
    if browser is None:
        print("chromium not found (apt-get install chromium): no screenshot")
        return False
    with tempfile.TemporaryDirectory(prefix="hiradix-chromium-") as profile:
        cmd = [
            browser,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={out.resolve()}",
            url,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 or not out.exists():
        print("chromium failed:", proc.returncode, proc.stderr[-2000:])
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="PNG to write (default: a temporary file)")
    ap.add_argument("--rounds", type=int, default=60, help="workload rounds, one hit-rate sample each")
    ap.add_argument("--width", type=int, default=900)
    ap.add_argument("--height", type=int, default=860)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="hiradix-dashboard-") as tmp:
        out = args.out if args.out is not None else Path(tmp) / "peer-dashboard.png"
        with InProcessCluster(2, transport="tcp", pool_size=96 << 20, page_size=PAGE) as cluster:
            producer = cluster.nodes[0]
            # The node whose page is shown: with a disk tier, and its own pages published so
            # that its pool and disk usage are not empty.
            reader = cluster.add_node(disk_enabled=True, disk_path=str(Path(tmp) / "disk"), disk_size=1 << 30)
            rng = np.random.default_rng(7)
            pages = [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(64)]
            assert all(reader.publish_many([key(-1 - i) for i in range(300)], [pages[i % 64] for i in range(300)]))
            shared = 512  # prefixes the producer publishes: reads of them hit
            assert all(producer.publish_many([key(i) for i in range(shared)], [pages[i % 64] for i in range(shared)]))
            bufs = [bytearray(PAGE) for _ in range(32)]
            fresh = shared
            # Virtual time: one sample every 10 s, as if the workload ran for rounds x 10 s.
            for r in range(args.rounds):
                phase = r / max(args.rounds - 1, 1)
                # A cold start, a warm cache, a burst of new prefixes at two thirds, recovery.
                p_hit = min(phase / 0.2, 1.0) * (0.35 if 0.6 < phase < 0.72 else 0.9)
                keys = []
                for _ in bufs:
                    if rng.random() < p_hit:
                        keys.append(key(int(rng.integers(shared))))
                    else:
                        keys.append(key(fresh))  # never published: a real miss
                        fresh += 1
                reader.read_into(keys, [memoryview(b) for b in bufs])
                reader.metrics.sample(10.0 * r)
            if reader.disk is not None:
                reader.disk.flush()
            st = reader.status()
            print(
                f"node {st['node_id']}: {len(st['members'])} members, pool {st['pool']['used_bytes'] / 2**30:.3f} GiB,"
                f" hit rate {st['hit_rate'] * 100:.1f}% over {args.rounds} samples"
            )
            # Serve the reader's page; sample_s=inf: the history above is the whole chart.
            with MetricsServer(reader.metrics, port=0, sample_s=math.inf) as srv:
                page = Path(tmp) / "dashboard.html"
                page.write_text(reader.metrics.dashboard_html())
                print("dashboard at", srv.url + "/", "(HTML:", page, ")")
                if screenshot(srv.url + "/", out, args.width, args.height):
                    print("wrote", out, f"({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
