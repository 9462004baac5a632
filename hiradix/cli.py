"""The ``hiradix`` command line.

``hiradix sim`` replays a Mooncake-format trace through the tiered radix tree and prints
the hit rate of each tier against the infinite-capacity ideal (see
:mod:`hiradix.sim.replay` for the definitions). Run ``hiradix sim --help``.

Bad input (an unreadable or malformed trace, a bad option) ends with a one-line error on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, NoReturn

from tqdm import tqdm

import hiradix
from hiradix.policy import WRITE_POLICIES
from hiradix.sim import MooncakeTrace, Replayer, ReplayStats, TraceError

# ``../shared/traces/`` next to the repository root (the project's data folder).
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
TRACE_ENV = "HIRADIX_TRACE"

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int | None:
    """A token count such as ``2000000``, ``2M``, ``1.5m``, ``500k`` or ``2_000_000``
    (decimal suffixes), or ``inf`` for unbounded (``None``).

    >>> parse_tokens("1.5M"), parse_tokens("500k"), parse_tokens("inf")
    (1500000, 500000, None)
    """
    spec = text.strip().lower().replace("_", "")
    if spec in ("inf", "unbounded"):
        return None
    multiplier = _SUFFIXES.get(spec[-1:], 1)
    digits = spec[:-1] if multiplier > 1 else spec
    try:
        value = Decimal(digits) * multiplier
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value < 0 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(
            f"invalid token count {text!r}: use a whole number such as 2000000, 2M, 500k, or inf"
        )
    return int(value)


def format_tokens(n: int | None) -> str:
    """Short form of a capacity: ``2M``, ``1.5M``, ``500k``, ``inf``."""
    if n is None:
        return "inf"
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return str(n)


def _count(kind: str, minimum: int) -> Any:
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind} {text!r}: expected an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid {kind} {text!r}: must be >= {minimum}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """Reports usage errors on one line, with exit status 2 as argparse does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hiradix",
        description="hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"hiradix {hiradix.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = commands.add_parser(
        "sim",
        help="replay a request trace through the tiered tree and report hit rates per tier",
        description=(
            "Replay a Mooncake-format request trace through the tiered radix tree (device = GPU "
            "tier, host = CPU-memory tier) and report how many prompt tokens each tier served, "
            "against what an infinite cache would serve. KV slots are simulated: no KV data is "
            "stored, so full traces need little memory."
        ),
        epilog=(
            "Sizes are in tokens and accept decimal suffixes: 500k, 2M, 1.5G; 'inf' means "
            "unbounded. Hit rates count tokens of the page-aligned prompt, and 512-token "
            "trace blocks. Example: hiradix sim --limit 2000 --device-tokens 500k --json out.json"
        ),
    )
    sim.add_argument(
        "--trace",
        metavar="PATH",
        type=Path,
        help=f"trace file, one JSON request per line (default: ${TRACE_ENV}, else {DEFAULT_TRACE})",
    )
    sim.add_argument("--limit", metavar="N", type=_count("limit", 0), help="replay only the first N requests")
    sim.add_argument(
        "--device-tokens",
        metavar="SIZE",
        type=parse_tokens,
        default=2_000_000,
        help="device (GPU) tier capacity in tokens (default: 2M)",
    )
    sim.add_argument(
        "--host-tokens",
        metavar="SIZE",
        type=parse_tokens,
        default=8_000_000,
        help="host (CPU memory) tier capacity in tokens (default: 8M)",
    )
    sim.add_argument(
        "--page-size", metavar="N", type=_count("page size", 1), default=16, help="tokens per KV page (default: 16)"
    )
    sim.add_argument(
        "--eviction-policy",
        choices=hiradix.policy_names(),
        default="lru",
        metavar="NAME",
        help=f"which unlocked leaves each tier evicts first: {', '.join(hiradix.policy_names())} (default: lru)",
    )
    sim.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through",
        metavar="NAME",
        help=(
            "when device KV is copied to the host: on insert (write_through), on the second "
            "hit (write_through_selective), or on eviction (write_back) (default: write_through)"
        ),
    )
    sim.add_argument(
        "--skip-bad-lines", action="store_true", help="skip and count malformed trace lines instead of stopping"
    )
    sim.add_argument("--json", metavar="PATH", type=Path, help="also write the configuration and results as JSON")
    sim.add_argument(
        "--check-invariants-every",
        metavar="N",
        type=_count("request count", 0),
        default=0,
        help="check the tree's invariants and KV slot ownership every N requests (slow; default: never)",
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.set_defaults(run=run_sim)
    return parser


def _fail(message: str) -> int:
    print(f"hiradix sim: error: {message}", file=sys.stderr)
    return 2


def run_sim(args: argparse.Namespace) -> int:
    """Run ``hiradix sim``; returns the exit status."""
    path = args.trace or Path(os.environ.get(TRACE_ENV) or DEFAULT_TRACE)
    if not path.is_file():
        return _fail(f"trace not found: {path} (pass --trace PATH or set ${TRACE_ENV})")
    if args.json is not None and not args.json.resolve().parent.is_dir():
        return _fail(f"cannot write {args.json}: its folder does not exist")
    trace = MooncakeTrace(path, limit=args.limit, skip_bad=args.skip_bad_lines)
    replayer = Replayer(
        page_size=args.page_size,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        eviction_policy=args.eviction_policy,
        write_policy=args.write_policy,
        check_every=args.check_invariants_every,
    )
    start = time.perf_counter()
    try:
        with tqdm(
            trace,
            total=trace.count_lines(),
            unit="req",
            file=sys.stderr,
            disable=True if args.no_progress else None,  # None: off when stderr is not a terminal
            dynamic_ncols=True,
        ) as requests:
            stats = replayer.replay(requests)
    except TraceError as exc:
        return _fail(f"{exc} (--skip-bad-lines skips such lines)")
    except OSError as exc:
        return _fail(f"cannot read {path}: {exc.strerror or exc}")
    wall = time.perf_counter() - start
    report = {
        "hiradix_version": hiradix.__version__,
        "implementation": hiradix.IMPLEMENTATION,
        "trace": {"path": str(path), "requests": stats.requests, "bad_lines_skipped": trace.bad_lines},
        "config": replayer.config(),
        "stats": stats.to_dict(),
        "wall_s": wall,
        "requests_per_s": stats.requests / wall if wall else 0.0,
    }
    print(summary(report, stats))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            return _fail(f"cannot write {args.json}: {exc.strerror or exc}")
    return 0


def summary(report: dict[str, Any], stats: ReplayStats) -> str:
    """The human-readable result table of ``hiradix sim``."""
    cfg, rates = report["config"], stats.rates()

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    def row(name: str, tokens: int, token_rate: str, blocks: int | None = None, block_rate: str = "") -> str:
        block_text = "" if blocks is None else f"{blocks:>11,}"
        return f"  {name:<18}{tokens:>15,}{token_rate:>9}{block_text}{block_rate:>9}".rstrip()

    hit_tokens = stats.device_hit_tokens + stats.host_hit_tokens
    hit_blocks = stats.device_hit_blocks + stats.host_hit_blocks
    of_ideal = [
        pct(hit / ideal) if ideal else "-"
        for hit, ideal in ((hit_tokens, stats.ideal_hit_tokens), (hit_blocks, stats.ideal_hit_blocks))
    ]
    bad = report["trace"]["bad_lines_skipped"]
    wall = report["wall_s"]
    lines = [
        f"hiradix sim: {Path(report['trace']['path']).name}, {stats.requests:,} requests"
        + (f" ({bad:,} bad lines skipped)" if bad else "")
        + f", {report['implementation']} tree",
        f"  page {cfg['page_size']} tokens, device {format_tokens(cfg['device_tokens'])} tokens, "
        f"host {format_tokens(cfg['host_tokens'])} tokens, {cfg['eviction_policy']}, {cfg['write_policy']}",
        "",
        f"  {'':<18}{'tokens':>15}{'rate':>9}{'blocks':>11}{'rate':>9}",
        row("device hit", stats.device_hit_tokens, pct(rates["device_token_hit_rate"]),
            stats.device_hit_blocks, pct(rates["device_block_hit_rate"])),
        row("host hit", stats.host_hit_tokens, pct(rates["host_token_hit_rate"]),
            stats.host_hit_blocks, pct(rates["host_block_hit_rate"])),
        row("total hit", hit_tokens, pct(rates["token_hit_rate"]), hit_blocks, pct(rates["block_hit_rate"])),
        row("ideal (infinite)", stats.ideal_hit_tokens, pct(rates["ideal_token_hit_rate"]),
            stats.ideal_hit_blocks, pct(rates["ideal_block_hit_rate"])),
        row("miss", stats.miss_tokens, pct(1 - rates["token_hit_rate"]) if stats.prompt_tokens else "-"),
        row("prompt", stats.prompt_tokens, "", stats.blocks),
        "",
        f"  hit / ideal   {of_ideal[0]} of tokens, {of_ideal[1]} of blocks",
        f"  evictions     device to host {stats.device_demoted_tokens:,}, device dropped "
        f"{stats.device_deleted_tokens:,}, host dropped {stats.host_evicted_tokens:,} tokens",
        f"  transfers     backed up {stats.backup_tokens:,} tokens ({stats.backup_nodes:,} nodes), "
        f"loaded back {stats.load_back_tokens:,}, backups skipped (host full) {stats.backup_skipped_tokens:,}",
    ]  # fmt: skip
    if stats.write_back_failed_tokens:
        lines.append(f"  write-back    {stats.write_back_failed_tokens:,} victim tokens found no host room")
    lines += [
        f"  too large     {stats.too_large_requests:,} requests did not fit on the device",
        f"  time          {wall:.1f} s, {report['requests_per_s']:,.0f} requests/s, "
        f"{stats.prompt_tokens / wall / 1e6 if wall else 0:.1f}M prompt tokens/s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hiradix`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
