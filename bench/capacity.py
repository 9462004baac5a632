"""Capacity curves of the conversation trace: the one-pass curve, timed, beside Mooncake's
Fig. 9 and checked against full replays (``bench/RESULTS_capacity.md``).

* Times :meth:`hiradix.sim.curve.CapacityCurve.from_requests` on the whole trace at page
  16 (``--repeats`` runs, median; each run reads the trace again).
* Prints the curve in Mooncake's unit: one cache entry per 512-token trace block (a
  block cut short at the end of a prompt is still one entry), the block hit rate over
  all blocks, LRU; and in the tree's (page 512 and page 16, whole pages only).
* ``--replays``: replays the trace through HiRadixCache (``simulate``; LRU,
  write_through, no L3) at several (device, host) sizes and prints replay against curve.
* ``--plot``: the PNG of the RESULTS file.

Run: ``python bench/capacity.py --trace PATH --replays --plot bench/capacity_conversation.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from hiradix.cli import default_trace
from hiradix.sim.curve import CapacityCurve, format_size, plot_curve, stack_positions
from hiradix.sim.generators import MooncakeWorkload
from hiradix.sim.report import png_bytes
from hiradix.sim.run import simulate
from hiradix.sim.trace import BLOCK_TOKENS, MooncakeTrace

MOONCAKE_SIZES = (3_000_000, 50_000_000)  # Fig. 9's two points, in tokens
REPLAYS = ((500_000, 2_000_000), (1_000_000, 4_000_000), (2_000_000, 8_000_000), (4_000_000, 16_000_000))


def block_curve(trace: Path) -> tuple[np.ndarray, int]:
    """Mooncake's unit: cumulative block hits at every capacity in blocks, and all blocks.
    Blocks are named by their prefix chain and touched deepest first, as the pages of
    :mod:`hiradix.sim.curve`, so the LRU cache is prefix-closed here too."""
    chain: dict[tuple[int, int], int] = {}
    keys: list[int] = []
    lengths: list[int] = []
    for request in MooncakeTrace(trace):
        parent = -1
        ids = []
        for block in request.hash_ids:
            parent = chain.setdefault((parent, block), len(chain))
            ids.append(parent)
        keys.extend(reversed(ids))
        lengths.append(len(ids))
    positions = stack_positions(np.asarray(keys), np.asarray(lengths))
    counts = np.bincount(positions, minlength=2)
    counts[0] = 0
    return np.cumsum(counts), len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=default_trace(),
        help="default: as hiradix sim ($HIRADIX_TRACE, ../shared, bundled)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replays", action="store_true", help="also replay through the cache (~30 s each)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    walls = []
    curve = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        curve = CapacityCurve.from_requests(MooncakeTrace(args.trace), page_size=16)
        walls.append(time.perf_counter() - start)
    assert curve is not None
    print(f"one pass, page 16: median {statistics.median(walls):.2f} s, min {min(walls):.2f} s of {len(walls)}")
    print(f"  pages: {curve.prompt_tokens // 16:,}; knee {format_size(curve.knee())} tokens")

    hits, blocks = block_curve(args.trace)
    ideal = hits[-1] / blocks
    page512 = CapacityCurve.from_requests(MooncakeTrace(args.trace), page_size=BLOCK_TOKENS)
    print(f"\nideal block hit rate: {ideal:.2%} (Mooncake unit), {page512.ideal_block_hit_rate:.2%} (page 512)")
    print(f"{'tokens':>8} {'Mooncake unit':>14} {'/max':>6} {'page 512':>9} {'/max':>6} {'page 16':>8} {'/max':>6}")
    sizes = sorted({*curve.sizes(500_000), *MOONCAKE_SIZES})
    for size in sizes:
        b = hits[min(size // BLOCK_TOKENS, len(hits) - 1)] / blocks
        p512 = page512.block_hit_rate(size)
        p16 = curve.block_hit_rate(size)
        print(
            f"{format_size(size):>8} {b:>14.2%} {b / ideal:>6.1%} {p512:>9.2%} "
            f"{p512 / page512.ideal_block_hit_rate:>6.1%} {p16:>8.2%} {p16 / curve.ideal_block_hit_rate:>6.1%}"
        )

    if args.replays:
        print("\nreplay (HiRadixCache, LRU, write_through, no L3) against the curve, page 16, token hit rates:")
        head = f"{'device':>7} {'host':>7} {'replay dev':>11} {'curve dev':>10} {'replay tot':>11} {'curve tot':>10}"
        print(head + "  wall")
        for device, host in REPLAYS:
            result = simulate(
                MooncakeWorkload(args.trace), page_size=16, device_tokens=device, host_tokens=host, l3_backend=None
            )
            rates = result.stats.rates()
            tiers = curve.tiers(device, host)
            print(
                f"{format_size(device):>7} {format_size(host):>7} {rates['device_token_hit_rate']:>11.2%} "
                f"{tiers['device']:>10.2%} {rates['token_hit_rate']:>11.2%} {tiers['total']:>10.2%}  "
                f"{result.wall_s:.0f} s"
            )

    if args.plot is not None:
        # The curve in Mooncake's unit, as a CapacityCurve of 512-token "pages" (every block
        # one entry), with the tree's page-16 curve over it.
        mooncake = CapacityCurve(
            page_size=BLOCK_TOKENS,
            requests=curve.requests,
            input_tokens=curve.input_tokens,
            prompt_tokens=blocks * BLOCK_TOKENS,
            blocks=blocks,
            token_hits=hits * BLOCK_TOKENS,
            block_hits=hits,
            max_prompt_tokens=curve.max_prompt_tokens,
        )
        title = "LRU block hit rate by capacity, Mooncake conversation trace\n"
        title += "(512-token blocks; GiB for llama-3-8b bf16)"
        marks = {f"Mooncake Fig. 9 ({format_size(s)})": s for s in MOONCAKE_SIZES}
        fig = plot_curve(mooncake, title, marks=marks, bytes_per_token=131_072, block=True)
        ax = fig.axes[0]
        pages = np.unique(np.geomspace(max(1, curve.max_pages // 10_000), curve.max_pages, 2000).astype(np.int64))
        y = 100 * curve.block_hits[pages] / curve.blocks
        ax.plot(pages * 16, y, "--", color="0.3", lw=1, label="tree, page 16")
        ax.legend(loc="upper left", fontsize=8)
        args.plot.write_bytes(png_bytes(fig))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
