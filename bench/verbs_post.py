"""Cost per chained RDMA READ work request: hiradix's verbs binding against pyverbs.

Both sides do the work a post does before the NIC sees it, with no device: build ``n``
READ work requests (scatter entry, remote address and rkey, every ``k``-th signalled)
and link them into one chain.

- hiradix: ``_verbs.WrChain.fill`` (the routine ``QueuePair.read_batch`` posts from):
  flat arrays in, one GIL-free loop over a preallocated ``ibv_send_wr`` array.
- pyverbs (Debian's ``python3-pyverbs``, rdma-core's own binding): one ``SGE`` and one
  ``SendWR`` object per item, ``set_wr_rdma``, linked through ``next_wr``. It runs under
  ``/usr/bin/python3`` (a subprocess) when this interpreter cannot import it.

Fixed seed, warm-up, repeats; medians (and minima) reported. Targets: at most 50 ns per
WR, at least 50x faster than pyverbs.

    .venv/bin/python bench/verbs_post.py [--n 4096] [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

SIGNAL_EVERY = 16

# Run by the pyverbs interpreter: print the per-WR times (ns) of each repeat as JSON.
PYVERBS_SNIPPET = r"""
import json, sys, time
import pyverbs.enums as e
from pyverbs.wr import SGE, SendWR
n, repeats, warm, k = (int(a) for a in sys.argv[1:5])
laddr = [0x10000000 + 4096 * i for i in range(n)]
raddr = [0x7f0000000000 + 4096 * ((i * 7919) % n) for i in range(n)]

def build():
    head = prev = None
    for i in range(n):
        wr = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(laddr[i], 4096, 0x1234)],
                    send_flags=e.IBV_SEND_SIGNALED if (i + 1) % k == 0 or i == n - 1 else 0)
        wr.set_wr_rdma(0xBEEF, raddr[i])
        if prev is None:
            head = wr
        else:
            prev.next_wr = wr
        prev = wr
    return head

for _ in range(warm):
    build()
out = []
for _ in range(repeats):
    t = time.perf_counter_ns()
    build()
    out.append((time.perf_counter_ns() - t) / n)
print(json.dumps(out))
"""


def bench_hiradix(n: int, repeats: int, warm: int, inner: int) -> list[float]:
    from hiradix.transport import _verbs

    rng = np.random.default_rng(0)
    laddr = 0x10000000 + 4096 * np.arange(n, dtype=np.uint64)
    raddr = 0x7F0000000000 + 4096 * rng.permutation(n).astype(np.uint64)
    length = np.full(n, 4096, dtype=np.uint64)
    rkey = np.full(n, 0xBEEF, dtype=np.uint32)
    lkey = np.full(n, 0x1234, dtype=np.uint32)
    chain = _verbs.WrChain(n)
    chain.fill(laddr, raddr, length, rkey, lkey, SIGNAL_EVERY, warm * inner)
    out = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        built = chain.fill(laddr, raddr, length, rkey, lkey, SIGNAL_EVERY, inner)
        out.append((time.perf_counter_ns() - t) / built)
    return out


def bench_pyverbs(n: int, repeats: int, warm: int) -> tuple[list[float], str]:
    args = [str(n), str(repeats), str(warm), str(SIGNAL_EVERY)]
    try:
        import pyverbs.wr  # noqa: F401

        python = sys.executable
    except ImportError:
        python = "/usr/bin/python3"  # Debian's python3-pyverbs is built for the system python
    if not os.path.exists(python):
        raise SystemExit(f"{python} not found: install python3-pyverbs (apt-get install python3-pyverbs)")
    proc = subprocess.run([python, "-c", PYVERBS_SNIPPET, *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"pyverbs run failed under {python}:\n{proc.stderr.strip()}")
    return json.loads(proc.stdout), python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="work requests per chain")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--inner", type=int, default=50, help="chains built per hiradix timing (its chain is fast)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    try:
        ours = bench_hiradix(a.n, a.repeats, a.warmup, a.inner)
    except ImportError:
        raise SystemExit("hiradix.transport._verbs is not built: apt-get install libibverbs-dev and rebuild") from None
    theirs, python = bench_pyverbs(a.n, a.repeats, a.warmup)
    med_o, med_t = statistics.median(ours), statistics.median(theirs)
    res = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "n": a.n,
        "signal_every": SIGNAL_EVERY,
        "repeats": a.repeats,
        "hiradix_ns_per_wr": {"median": med_o, "min": min(ours)},
        "pyverbs_ns_per_wr": {"median": med_t, "min": min(theirs)},
        "pyverbs_python": python,
        "speedup_median": med_t / med_o,
    }
    print(f"chain of {a.n} READ WRs, every {SIGNAL_EVERY}th signalled; {a.repeats} repeats after {a.warmup} warm-ups")
    print(f"{'binding':<22}{'median ns/WR':>14}{'min ns/WR':>12}")
    print(f"{'hiradix _verbs':<22}{med_o:>14.1f}{min(ours):>12.1f}")
    print(f"{'pyverbs (' + os.path.basename(python) + ')':<22}{med_t:>14.1f}{min(theirs):>12.1f}")
    print(f"hiradix is {med_t / med_o:.0f}x faster (medians); targets: <= 50 ns/WR, >= 50x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
