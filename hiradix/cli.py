"""The ``hiradix`` command line.

``hiradix sim`` replays a workload (by default the Mooncake conversation trace) through
the three-tier :class:`~hiradix.cache.HiRadixCache` (L3: in-memory storage by default),
prints hit rates per tier against the infinite-capacity ideal (see
:mod:`hiradix.sim.replay` for the definitions) and the estimated TTFT (see
:mod:`hiradix.sim.timing`), with one ``finding`` line for each tier that makes TTFT worse
than the layout without it (:mod:`hiradix.sim.advice`), and optionally writes JSON, PNG
plots and an HTML report.
``hiradix sweep`` (also spelled ``hiradix sim sweep``) replays one workload over a grid
of capacities and policies on every core. ``hiradix plan`` computes the hit rate at every
capacity from one pass over a trace (:mod:`hiradix.sim.curve`) and the cheapest tier
sizes for a target hit rate, with each layout's estimated TTFT and the same findings.
``hiradix peer serve|status`` runs or inspects a peer-cache
node. Run ``hiradix sim --help``.

Bad input (an unreadable or malformed trace, a bad option) ends with a one-line error on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

import hiradix
from hiradix import envvars
from hiradix.cache.l3 import PREFETCH_POLICIES
from hiradix.peer.cli import add_subparsers as add_peer_subparsers
from hiradix.sim import TraceError
from hiradix.sim.advice import PLAN_REMEDIES, Finding, explain, ttft_metrics
from hiradix.sim.config import GPUS, ConfigError, ResolvedConfig, SimConfig, SimWarning, Size, format_tokens
from hiradix.sim.generators import AZURE_FILES, WORKLOADS, Workload, make_workload
from hiradix.sim.report import render_plots, source_name, summary, to_json, write_html, write_plots
from hiradix.sim.run import SimResult, simulate
from hiradix.sim.timing import DTYPE_BYTES, LINKS, MODELS, Link, ModelShape, TimingModel
from hiradix.storage.base import StorageError
from hiradix.tree.policy import WRITE_POLICIES

if TYPE_CHECKING:
    from hiradix.sim.curve import CapacityCurve, Plan

__all__ = ["BUNDLED_TRACE", "SHARED_TRACE", "TRACE_ENV", "build_parser", "default_trace", "main"]

# The full Mooncake conversation trace where a source checkout has it: ``../shared/traces/``
# beside the repository root (the project's data folder).
SHARED_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
# Its first 1,000 requests, installed with the package (``hiradix/sim/data/README.md``).
BUNDLED_TRACE = Path(__file__).resolve().parent / "sim" / "data" / "conversation_excerpt.jsonl"
TRACE_ENV = "HIRADIX_TRACE"


def default_trace() -> Path:
    """The trace read when ``--trace`` is not given: ``$HIRADIX_TRACE``, else the full trace
    beside a source checkout, else the bundled excerpt."""
    env = envvars.path(TRACE_ENV)
    if env is not None:
        return env
    return SHARED_TRACE if SHARED_TRACE.is_file() else BUNDLED_TRACE


def _size(text: str) -> Size:
    """argparse type: a :class:`~hiradix.sim.config.Size` (tokens, bytes, inf or auto)."""
    try:
        return Size.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _list_of(parse: Any, choices: Any = None) -> Any:
    """argparse type: a comma-separated list of ``parse`` values (each in ``choices``)."""

    def parse_list(text: str) -> list[Any]:
        items = [parse(item) for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        for item in items if choices is not None else ():
            if item not in choices:
                raise argparse.ArgumentTypeError(f"invalid choice {item!r}: choose from {', '.join(choices)}")
        return items

    return parse_list


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


def _positive(kind: str) -> Any:
    """argparse type: a finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"invalid {kind} {text!r}: expected a number > 0")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """Reports usage errors on one line, with exit status 2 as argparse does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="trace",
        metavar="NAME",
        help=(
            "what to replay: trace (the Mooncake-format trace, default), chat (multi-turn "
            "conversations), agent (agent loops with tool outputs), system-prompt (shared system "
            "prompts), azure-conv / azure-code (Azure LLM trace arrivals and lengths with "
            "synthetic shared prefixes)"
        ),
    )
    group.add_argument(
        "--trace",
        metavar="PATH",
        type=Path,
        help=(
            f"trace file: for --workload trace one JSON request per line (default: ${TRACE_ENV}, "
            "else ../shared/traces/conversation_trace.jsonl beside a source checkout, else the "
            "bundled excerpt of its first 1,000 requests); for azure-* the Azure CSV (default: beside it)"
        ),
    )
    group.add_argument(
        "--limit",
        "--requests",
        dest="limit",
        metavar="N",
        type=_count("request count", 0),
        help="replay only the first N requests of a trace; generate N requests (default 2000) of a synthetic workload",
    )
    group.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the synthetic workloads (default: 0)")
    group.add_argument(
        "--skip-bad-lines", action="store_true", help="skip and count malformed trace lines instead of stopping"
    )


_DEFAULTS = SimConfig()


def _add_l3_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("L3 storage tier (see hiradix.sim.replay)")
    group.add_argument(
        "--l3-backend",
        choices=["memory", "file", "peer", "mooncake", "none"],
        metavar="NAME",
        help="L3 backend: memory (in-process pages, LRU), file (segment files under --l3-path), peer (an "
        "in-process peer-cache cluster on loopback TCP), mooncake (Mooncake Store; --l3-master, else a private "
        f"mooncake_master on 127.0.0.1), none (default: {_DEFAULTS.l3_backend})",
    )
    group.add_argument(
        "--l3-tokens",
        "--l3",
        dest="l3_tokens",
        metavar="SIZE",
        type=_size,
        help="L3 capacity, all ranks together: tokens (32M), bytes (4TiB) or inf (default: 32M tokens)",
    )
    group.add_argument(
        "--l3-path", metavar="DIR", help="folder of the file backend (default: a temporary folder, removed after)"
    )
    group.add_argument(
        "--l3-master",
        metavar="HOST:PORT",
        help="mooncake_master of --l3-backend mooncake (default: start a private one on 127.0.0.1, stopped after)",
    )
    group.add_argument(
        "--verify-bytes",
        action="store_true",
        help="write token-derived KV bytes and check every reused prefix against them, through every tier",
    )
    group.add_argument(
        "--prefetch-policy",
        choices=list(PREFETCH_POLICIES),
        metavar="NAME",
        help=f"when a request stops waiting for its L3 prefetch: {', '.join(PREFETCH_POLICIES)} "
        f"(default: {_DEFAULTS.prefetch_policy})",
    )
    group.add_argument(
        "--prefetch-threshold",
        metavar="TOKENS",
        type=_count("prefetch threshold", 0),
        help=f"fewest missed tokens worth an L3 prefetch (default: {_DEFAULTS.prefetch_threshold})",
    )
    group.add_argument(
        "--no-prefetch-wait",
        action="store_true",
        help=(
            "do not let prefetches and L3 writes finish between requests: the policy then ends a "
            "prefetch with whatever landed so far, and results depend on thread timing"
        ),
    )


def _add_model_options(group: Any) -> None:
    """``--model``, ``--kv-dtype`` and ``--tp``: what sets the KV bytes per token and the
    prefill rate (``hiradix sim``, ``sweep`` and ``plan`` alike)."""
    group.add_argument(
        "--model",
        choices=list(MODELS),
        default="llama-3-8b",
        metavar="NAME",
        help=f"model shape, sets KV bytes/token and prefill rate: {', '.join(MODELS)} (default: llama-3-8b)",
    )
    group.add_argument(
        "--kv-dtype", choices=list(DTYPE_BYTES), default="bf16", metavar="DTYPE", help="KV cache dtype (default: bf16)"
    )
    group.add_argument("--tp", metavar="N", type=_count("tp", 1), default=1, help="tensor-parallel ranks (default: 1)")


def _add_timing_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("timing model (see hiradix.sim.timing)")
    _add_model_options(group)
    group.add_argument(
        "--gpu",
        choices=list(GPUS),
        default=_DEFAULTS.gpu,
        metavar="NAME",
        help=f"GPU of each rank, sizes the device tier (--device-tokens auto) and checks it fits: "
        f"{', '.join(GPUS)} (default: {_DEFAULTS.gpu})",
    )
    group.add_argument(
        "--mem-fraction-static",
        metavar="F",
        type=_positive("memory fraction"),
        help="fraction of GPU memory for weights and KV, as SGLang's option (default: SGLang 0.5.18's for the GPU)",
    )
    group.add_argument(
        "--prefill-tps",
        metavar="TOKENS/S",
        type=_positive("prefill rate"),
        help="prefill throughput in tokens/s (default: from the model size, 989 TFLOPS at 40%% MFU per rank)",
    )
    group.add_argument(
        "--host-link",
        choices=["pcie5", "pcie4"],
        default="pcie5",
        metavar="NAME",
        help="host <-> GPU link: pcie5 (50 GB/s) or pcie4 (25 GB/s) (default: pcie5)",
    )
    group.add_argument(
        "--l3-link",
        choices=["rdma", "tcp", "disk"],
        metavar="NAME",
        help="L3 link: rdma (45 GB/s), tcp (2.5 GB/s) to a peer's host memory, or disk (6 GB/s) "
        "(default: what the backend uses: disk for --l3-backend file, else tcp; rdma only when asked)",
    )
    group.add_argument("--pcie-gbps", metavar="GB/S", type=_positive("bandwidth"), help="override the host link GB/s")
    group.add_argument("--l3-gbps", metavar="GB/S", type=_positive("bandwidth"), help="override the L3 link GB/s")
    group.add_argument(
        "--overhead-ms",
        metavar="MS",
        type=float,
        default=5.0,
        help="fixed per-request time (scheduling, first decode) (default: 5)",
    )
    group.add_argument(
        "--no-layerwise", action="store_true", help="do not overlap host load-back with compute layer by layer"
    )


def _add_cache_options(parser: argparse.ArgumentParser, sweep: bool) -> None:
    group = parser.add_argument_group("cache")
    group.add_argument(
        "--page-size", metavar="N", type=_count("page size", 1), default=16, help="tokens per KV page (default: 16)"
    )
    if sweep:
        names = hiradix.policy_names()
        group.add_argument(
            "--device-tokens",
            "--device",
            dest="device_tokens",
            metavar="LIST",
            type=_list_of(_size),
            default=[Size(tokens=100_000), Size(tokens=200_000), Size(auto=True)],
            help="device capacities per GPU to try: tokens, bytes or auto (default: 100k,200k,auto)",
        )
        group.add_argument(
            "--host-tokens",
            "--host",
            dest="host_tokens",
            metavar="LIST",
            type=_list_of(_size),
            default=[Size(auto=True)],
            help="host capacities per GPU to try: tokens, bytes, inf or auto, twice the device (default: auto)",
        )
        group.add_argument(
            "--eviction-policies",
            metavar="LIST",
            type=_list_of(str.strip, names),
            default=["lru", "lfu", "slru", "sieve"],
            help=f"eviction policies to try, from {', '.join(names)} (default: lru,lfu,slru,sieve)",
        )
        group.add_argument(
            "--write-policies",
            metavar="LIST",
            type=_list_of(str.strip, WRITE_POLICIES),
            default=["write_through"],
            help=f"write policies to try, from {', '.join(WRITE_POLICIES)} (default: write_through)",
        )
        return
    group.add_argument(
        "--device-tokens",
        "--device",
        dest="device_tokens",
        metavar="SIZE",
        type=_size,
        help="device (GPU) tier per GPU: tokens (500k), bytes (40GiB), inf, or auto: the KV pool SGLang "
        "leaves on --gpu after the model's weights (default: auto)",
    )
    group.add_argument(
        "--host-tokens",
        "--host",
        dest="host_tokens",
        metavar="SIZE",
        type=_size,
        help="host (CPU memory) tier per GPU: tokens (4M), bytes (64GiB), inf, or auto: twice the device, "
        "SGLang's default --hicache-ratio (default: auto)",
    )
    group.add_argument(
        "--eviction-policy",
        choices=hiradix.policy_names(),
        default="lru",
        metavar="NAME",
        help=f"which unlocked leaves each tier evicts first: {', '.join(hiradix.policy_names())} (default: lru)",
    )
    group.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through",
        metavar="NAME",
        help=(
            "when device KV is copied to the host: on insert (write_through), on the second "
            "hit (write_through_selective), or on eviction (write_back) (default: write_through)"
        ),
    )


_EPILOG = (
    "Sizes are tokens with decimal suffixes (500k, 2M, 1.5G) or bytes (64GiB, 80GB, 1.5TiB: KV bytes per "
    "token of --model, --kv-dtype and --tp; device and host per GPU, L3 for all ranks); 'inf' means unbounded. "
    "Hit rates count tokens of the page-aligned prompt, and 512-token trace blocks. TTFT is an "
    "estimate on an idle GPU (no queueing) from the timing model. "
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hiradix",
        description="hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"hiradix {hiradix.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = commands.add_parser(
        "sim",
        help="replay a workload through the three-tier cache: hit rates per tier, estimated TTFT, plots",
        description=(
            "Replay a workload (by default the Mooncake conversation trace) through HiRadixCache "
            "(device = GPU tier, host = CPU-memory tier, L3 = storage tier) and report how many "
            "prompt tokens each tier served against what an infinite cache would serve, with the "
            "TTFT and traffic a timing model estimates from them. Every request goes through the "
            "real cache, with KV pools of 2 bytes per token, so full traces need little memory. "
            "See also: hiradix sim sweep --help."
        ),
        epilog=_EPILOG + "Examples: hiradix sim --limit 2000 --device-tokens 500k --json out.json; "
        "hiradix sim --workload chat --model llama-3-70b --tp 4 --html report.html",
    )
    _add_workload_options(sim)
    _add_cache_options(sim, sweep=False)
    _add_l3_options(sim)
    _add_timing_options(sim)
    out = sim.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=Path, help="also write the configuration and results as JSON")
    out.add_argument(
        "--plots", metavar="DIR", type=Path, help="write hit_rate.png, ttft_cdf.png and occupancy.png into DIR"
    )
    out.add_argument("--html", metavar="FILE", type=Path, help="write a self-contained HTML report (plots embedded)")
    out.add_argument(
        "--curve",
        action="store_true",
        help="also compute the one-pass capacity curve (hiradix plan) over the same workload: print what it "
        "predicts for these tier sizes beside the replay, and add the curve, with the sizes marked, to "
        "--plots/--html",
    )
    out.add_argument(
        "--check-invariants-every",
        metavar="N",
        type=_count("request count", 0),
        default=0,
        help="check the tree's invariants and KV slot ownership every N requests (slow; default: never)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.set_defaults(run=run_sim)

    sweep = commands.add_parser(
        "sweep",
        help="replay one workload over capacities x eviction policies x write policies, on every core",
        description=(
            "Replay one workload for every combination of device capacity, host capacity, "
            "eviction policy and write policy, in parallel worker processes, and print one table "
            "(optionally JSON and a plot of hit rate against device capacity). Also spelled "
            "'hiradix sim sweep'."
        ),
        epilog=_EPILOG + "Example: hiradix sweep --device-tokens 250k,1M,inf --eviction-policies lru,sieve "
        "--write-policies write_through,write_back --plot sweep.png",
    )
    _add_workload_options(sweep)
    _add_cache_options(sweep, sweep=True)
    _add_l3_options(sweep)
    _add_timing_options(sweep)
    out = sweep.add_argument_group("output")
    out.add_argument("--jobs", metavar="N", type=_count("job count", 1), help="worker processes (default: CPU count)")
    out.add_argument("--json", metavar="PATH", type=Path, help="also write the rows as JSON")
    out.add_argument("--plot", metavar="FILE", type=Path, help="write the hit rate by capacity and policy as a PNG")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sweep.set_defaults(run=run_sweep)
    _add_plan_parser(commands)
    add_peer_subparsers(commands)
    return parser


class _UsageError(Exception):
    """A problem with the command's input, reported on one line with exit status 2."""


def _fail(command: str, message: str) -> int:
    print(f"hiradix {command}: error: {message}", file=sys.stderr)
    return 2


def _workload(args: argparse.Namespace) -> Workload:
    default = default_trace()
    path = args.trace
    if args.workload == "trace":
        path = path or default
        if path == BUNDLED_TRACE:
            print(
                "hiradix: note: reading the bundled excerpt of the Mooncake conversation trace (its first "
                f"1,000 requests); pass --trace PATH or set ${TRACE_ENV} for the full trace",
                file=sys.stderr,
            )
    elif args.workload in AZURE_FILES:
        path = path or default.parent / AZURE_FILES[args.workload]
    if path is not None and not path.is_file():
        hint = f"pass --trace PATH or set ${TRACE_ENV}" if args.workload == "trace" else "pass --trace PATH"
        raise _UsageError(f"trace not found: {path} ({hint})")
    try:
        return make_workload(
            args.workload,
            trace_dir=default.parent,
            path=path,
            requests=args.limit,
            seed=args.seed,
            skip_bad=args.skip_bad_lines,
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _config(args: argparse.Namespace, command: str) -> ResolvedConfig:
    """The run's :class:`SimConfig` from the options given (the rest: its defaults),
    checked; its warnings are printed on stderr."""
    settings: dict[str, Any] = {
        "page_size": args.page_size,
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "tp": args.tp,
        "gpu": args.gpu,
        "mem_fraction_static": args.mem_fraction_static,
        "host_link": args.host_link,
    }
    if command == "sim":
        settings.update(
            eviction_policy=args.eviction_policy,
            write_policy=args.write_policy,
            check_every=args.check_invariants_every,
            device_tokens=args.device_tokens,
            host_tokens=args.host_tokens,
        )
    for name in ("l3_tokens", "l3_path", "l3_master", "prefetch_policy", "prefetch_threshold", "l3_link"):
        settings[name] = getattr(args, name)
    if args.verify_bytes:
        settings["verify_bytes"] = True
    if args.no_prefetch_wait:
        settings["prefetch_wait"] = False
    config = SimConfig().replace(**{k: v for k, v in settings.items() if v is not None})
    if args.l3_backend is not None:  # "none" is None, so not filtered above
        config = config.replace(l3_backend=None if args.l3_backend == "none" else args.l3_backend)
    if config.l3_backend is None and args.l3_gbps is not None:
        raise _UsageError("--l3-gbps set without an L3 tier (--l3-backend none): it would be ignored")
    base = config.timing_model()
    overrides: dict[str, Any] = {
        "prefill_tokens_per_s": args.prefill_tps,
        "overhead_ms": args.overhead_ms,
        "layerwise": not args.no_layerwise,
    }
    if args.pcie_gbps:
        overrides["pcie"] = Link(base.pcie.name, args.pcie_gbps, base.pcie.latency_us)
    if args.l3_gbps:
        overrides["l3"] = Link(base.l3.name, args.l3_gbps, base.l3.latency_us)
    resolved = config.resolve(config.timing_model(**overrides))
    for note in resolved.warnings:
        print(f"hiradix {command}: warning: {note}", file=sys.stderr)
    return resolved


def _json_config(config: SimConfig) -> dict[str, Any]:
    return {k: repr(v) if isinstance(v, Size) else v for k, v in dataclasses.asdict(config).items()}


def _check_writable(path: Path | None) -> None:
    if path is not None and not path.resolve().parent.is_dir():
        raise _UsageError(f"cannot write {path}: its folder does not exist")


def run_sim(args: argparse.Namespace) -> int:
    """Run ``hiradix sim``; returns the exit status."""
    workload: Workload | None = None
    try:
        resolved = _config(args, "sim")
        workload = _workload(args)
        result = _replay(args, workload, resolved)
    except (_UsageError, ValueError, StorageError, OSError) as exc:
        return _fail("sim", _sim_error(args, exc, workload))
    print(summary(result))
    curve_png = _sim_curve(args, workload, resolved, result) if args.curve else None
    try:
        _write_sim_outputs(args, result, curve_png)
    except OSError as exc:
        return _fail("sim", f"cannot write {exc.filename}: {exc.strerror or exc}")
    if result.stats.corrupt_tokens:
        return _fail("sim", f"{result.stats.corrupt_tokens:,} reused tokens came back with wrong KV bytes")
    return 0


def _replay(args: argparse.Namespace, workload: Workload, resolved: ResolvedConfig) -> SimResult:
    """``hiradix sim``'s replay, once its output paths are checked (:class:`_UsageError`)."""
    _check_writable(args.json)
    _check_writable(args.html)
    if args.plots is not None and args.plots.exists() and not args.plots.is_dir():
        raise _UsageError(f"--plots {args.plots}: not a folder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SimWarning)  # printed by _config, once
        return simulate(
            workload,
            resolved.config,
            timing=resolved.timing,
            progress=False if args.no_progress else None,
        )


def _sim_error(args: argparse.Namespace, exc: Exception, workload: Workload | None) -> str:
    """The one-line message of ``hiradix sim``'s error ``exc``, raised before the report."""
    if isinstance(exc, TraceError):
        is_trace = workload is not None and workload.name == "trace"
        return f"{exc} (--skip-bad-lines skips such lines)" if is_trace else str(exc)
    if isinstance(exc, StorageError):  # an L3 backend that cannot be built (no Mooncake wheel, no master)
        return f"--l3-backend {args.l3_backend}: {exc}"
    if isinstance(exc, OSError):
        return f"cannot read {exc.filename or args.trace}: {exc.strerror or exc}"
    # a _UsageError, or a ValueError: ConfigError, an empty trace, a generator running out of block ids
    return str(exc)


def _write_sim_outputs(args: argparse.Namespace, result: SimResult, curve_png: bytes | None) -> None:
    """``hiradix sim --json/--plots/--html``: the files asked for (``curve_png``: the
    capacity curve of ``--curve``, added to the plots)."""
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(result), indent=2) + "\n")
    if args.plots is None and args.html is None:
        return
    rendered = render_plots(result)
    if curve_png is not None:
        rendered["capacity_curve"] = curve_png
    if args.plots is not None:
        paths = write_plots(result, args.plots, rendered)
        print(f"  plots         {', '.join(str(p) for p in paths)}")
    if args.html is not None:
        print(f"  html          {write_html(result, args.html, rendered)}")


def _sim_curve(args: argparse.Namespace, workload: Workload, resolved: ResolvedConfig, result: Any) -> bytes | None:
    """``hiradix sim --curve``: the one-pass curve over the replayed workload, its
    prediction for the replayed tier sizes printed beside the replay's hit rates, and the
    curve as PNG bytes (the sizes marked) when plots or HTML are asked for."""
    from hiradix.sim.curve import CapacityCurve, plot_curve
    from hiradix.sim.report import png_bytes

    curve = CapacityCurve.from_requests(
        workload, page_size=resolved.config.page_size, progress=False if args.no_progress else None
    )
    device = resolved.device_tokens if resolved.device_tokens is not None else curve.max_useful_tokens
    host = resolved.host_tokens if resolved.host_tokens is not None else curve.max_useful_tokens
    predicted = curve.tiers(device, host)
    rates = result.stats.rates()
    print(
        f"  curve         LRU prediction for these sizes: device {predicted['device']:.2%}, device+host "
        f"{predicted['device'] + predicted['host']:.2%} (replayed: {rates['device_token_hit_rate']:.2%}, "
        f"{rates['device_token_hit_rate'] + rates['host_token_hit_rate']:.2%}); knee {format_tokens(curve.knee())} "
        "tokens; the curve is exact for LRU when every prompt fits the device and an upper bound otherwise "
        "(hiradix.sim.curve)"
    )
    if args.plots is None and args.html is None:
        return None
    marks = {"device": device, "device + host": host}
    title = f"Capacity curve, {source_name(result)}, page {curve.page_size}"
    return png_bytes(plot_curve(curve, title, marks=marks, bytes_per_token=int(resolved.timing.rank_bytes_per_token)))


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``hiradix sweep``; returns the exit status."""
    from hiradix.sim.report import png_bytes
    from hiradix.sim.sweep import grid, plot_sweep, resolve_cells, run_sweep, sweep_table

    try:
        resolved = _config(args, "sweep")
        workload = _workload(args)
        timing = resolved.timing
        _check_writable(args.json)
        _check_writable(args.plot)
        cells = resolve_cells(
            resolved.config,
            grid(args.device_tokens, args.host_tokens, args.eviction_policies, args.write_policies),
            timing,
            warn=lambda note: print(f"hiradix sweep: warning: {note}", file=sys.stderr),
        )
        rows = run_sweep(
            workload,
            cells,
            config=resolved.config,
            timing=timing,
            jobs=args.jobs,
            progress=False if args.no_progress else None,
        )
    except _UsageError as exc:
        return _fail("sweep", str(exc))
    except (TraceError, ValueError) as exc:
        return _fail("sweep", str(exc))
    except OSError as exc:
        return _fail("sweep", f"cannot read {exc.filename or args.trace}: {exc.strerror or exc}")
    description = workload.describe()
    name = Path(description["path"]).name if "path" in description else f"{workload.name} (seed {args.seed})"
    print(f"hiradix sweep: {name}, {rows[0].requests if rows else 0:,} requests, {len(rows)} runs, {timing.model.name}")
    print(sweep_table(rows))
    try:
        if args.json is not None:
            data = {
                "hiradix_version": hiradix.__version__,
                "implementation": hiradix.IMPLEMENTATION,
                "workload": description,
                "page_size": args.page_size,
                "config": _json_config(resolved.config),
                "hardware": resolved.hardware(),
                "timing": timing.describe(),
                "rows": [row.to_dict() for row in rows],
            }
            args.json.write_text(json.dumps(data, indent=2) + "\n")
        if args.plot is not None:
            args.plot.write_bytes(png_bytes(plot_sweep(rows, f"Hit rate by capacity and policy: {name}")))
            print(f"plot: {args.plot}")
    except OSError as exc:
        return _fail("sweep", f"cannot write {exc.filename}: {exc.strerror or exc}")
    return 0


# ---------------------------------------------------------------------------- hiradix plan
def _fraction(text: str) -> float:
    """argparse type: a hit rate as a fraction in (0, 1] (``0.35``) or a percentage (``35%``)."""
    spec = text.strip()
    try:
        value = float(spec[:-1]) / 100 if spec.endswith("%") else float(spec)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"invalid hit rate {text!r}: expected a fraction in (0, 1] or a percentage")
    return value


def _prices(text: str) -> dict[str, float]:
    """argparse type: ``TIER=PRICE`` pairs, comma-separated (``host=4,l3=0.2``)."""
    from hiradix.sim.curve import check_prices

    prices: dict[str, float] = {}
    for item in text.split(","):
        tier, sep, price = item.partition("=")
        try:
            if not sep:
                raise ValueError
            prices[tier.strip()] = float(price)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid price {item!r}: expected TIER=PRICE, e.g. host=4") from None
    try:
        check_prices(prices)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return prices


def _finite_tokens(text: str) -> int:
    try:
        size = Size.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size.tokens is None:
        raise argparse.ArgumentTypeError(f"invalid token count {text!r}: must be a finite number of tokens")
    return size.tokens


def _add_plan_parser(commands: Any) -> None:
    from hiradix.sim.curve import DEFAULT_PRICES

    plan = commands.add_parser(
        "plan",
        help="capacity planning: hit rate at every cache size from one pass, the knee, the cheapest tier sizes",
        description=(
            "Compute the LRU hit rate of the tree at every capacity from one pass over a workload "
            "(LRU stack positions over pages; see hiradix.sim.curve for when this is exact), print it "
            "at round sizes with the knee of the curve, and the cheapest device / host / L3 sizes "
            "that reach a target token hit rate at the given prices per GiB, with each layout's estimated "
            "TTFT and a finding line where a tier makes it worse than the same sizes without that tier. "
            "Tiers are inclusive: each holds what the tiers above it hold."
        ),
        epilog=_EPILOG
        + "Example: hiradix plan --trace conversation_trace.jsonl --target-hit-rate 35%% --prices l3=5 --plot c.png",
    )
    _add_workload_options(plan)
    group = plan.add_argument_group("plan")
    group.add_argument(
        "--page-size", metavar="N", type=_count("page size", 1), default=16, help="tokens per KV page (default: 16)"
    )
    _add_model_options(group)
    group.add_argument(
        "--target-hit-rate",
        metavar="RATE",
        type=_fraction,
        help="token hit rate to reach, as 0.35 or 35%% (default: 90%% of the ideal, i.e. unbounded, hit rate)",
    )
    group.add_argument(
        "--target-p90-ttft",
        metavar="SECONDS",
        type=_positive("TTFT target"),
        help="instead of a hit rate: the cheapest sizes whose p90 TTFT (estimated per request with the "
        "simulator's timing model, on an idle GPU) is at most SECONDS",
    )
    group.add_argument(
        "--l3-link",
        choices=["rdma", "tcp", "disk"],
        default="tcp",
        help="the L3 link of the TTFT estimates and --target-p90-ttft (default: tcp, what the peer cache runs "
        "on today)",
    )
    group.add_argument("--l3-gbps", metavar="GB/S", type=_positive("bandwidth"), help="override the L3 link GB/s")
    group.add_argument(
        "--prices",
        metavar="TIER=PRICE,...",
        type=_prices,
        default={},
        help="prices per GiB of the tiers device, host, l3 (default: "
        + ", ".join(f"{t}={p:g}" for t, p in DEFAULT_PRICES.items())
        + "; see hiradix.sim.curve.DEFAULT_PRICES)",
    )
    group.add_argument(
        "--min-device-tokens",
        metavar="SIZE",
        type=_finite_tokens,
        help="smallest device size to consider (default: the longest prompt, so that every request fits)",
    )
    out = plan.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=Path, help="also write the curve and the plans as JSON")
    out.add_argument("--plot", metavar="FILE", type=Path, help="write the curve, knee and chosen sizes as a PNG")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    plan.set_defaults(run=run_plan)


@dataclasses.dataclass
class _Plan:
    """What ``hiradix plan`` computed, for its report: the curve from the one pass over
    the workload (and the pass's wall time), the timing model of the TTFT estimates, the
    hit-rate target and the cheapest layouts, best first."""

    workload: Workload
    model: ModelShape
    curve: CapacityCurve
    wall: float
    timing: TimingModel
    target: float
    plans: list[Plan]

    @property
    def bytes_per_token(self) -> int:
        return self.model.bytes_per_token

    def gib(self, tokens: int) -> str:
        from hiradix.sim.curve import GIB

        return f"{tokens * self.bytes_per_token / GIB:,.1f}"


def run_plan(args: argparse.Namespace) -> int:
    """Run ``hiradix plan``; returns the exit status."""
    from hiradix.sim.curve import check_prices

    model = MODELS[args.model].with_dtype(args.kv_dtype)
    try:
        run = _plan(args, model)
    except _UsageError as exc:
        return _fail("plan", str(exc))
    except TraceError as exc:
        return _fail("plan", f"{exc} (--skip-bad-lines skips such lines)")
    except ValueError as exc:
        return _fail("plan", str(exc))
    except OSError as exc:
        return _fail("plan", f"cannot read {exc.filename or args.trace}: {exc.strerror or exc}")
    prices = check_prices(args.prices)
    description = run.workload.describe()
    name = Path(description["path"]).name if "path" in description else f"{run.workload.name} (seed {args.seed})"
    _print_plan_curve(run, name)
    checked, no_cache_ttft = _print_plan_layouts(args, run, prices)
    try:
        if args.json is not None:
            data = _plan_json(args, run, description, prices, checked, no_cache_ttft)
            args.json.write_text(json.dumps(data, indent=2) + "\n")
        if args.plot is not None:
            _write_plan_plot(args.plot, run, name)
    except OSError as exc:
        return _fail("plan", f"cannot write {exc.filename}: {exc.strerror or exc}")
    return 0


def _plan(args: argparse.Namespace, model: ModelShape) -> _Plan:
    """``hiradix plan``'s computation: the workload read, the output paths checked, the
    curve from one pass and the cheapest layouts for the target. Raises
    :class:`_UsageError` (and the workload's errors)."""
    import time

    from hiradix.sim.curve import CapacityCurve
    from hiradix.sim.generators import MooncakeWorkload

    workload = _workload(args)
    _check_writable(args.json)
    _check_writable(args.plot)
    start = time.perf_counter()
    source: Any = workload.trace() if isinstance(workload, MooncakeWorkload) else workload
    curve = CapacityCurve.from_requests(
        source,
        page_size=args.page_size,
        progress=not args.no_progress,
        total=None if args.no_progress else workload.count(),
    )
    wall = time.perf_counter() - start
    target = args.target_hit_rate or 0.9 * curve.ideal_token_hit_rate
    l3_link = LINKS[args.l3_link]
    if args.l3_gbps is not None:
        l3_link = Link(l3_link.name, args.l3_gbps, l3_link.latency_us)
    timing = TimingModel(model=model, tp=args.tp, l3=l3_link)
    run = _Plan(workload, model, curve, wall, timing, target, plans=[])
    run.plans = _plan_layouts(args, run)
    return run


def _plan_layouts(args: argparse.Namespace, run: _Plan) -> list[Plan]:
    """The cheapest layouts, best first, for ``--target-p90-ttft`` if given, else for the
    hit-rate target. Raises :class:`_UsageError` when both targets are given or when no
    layout reaches the TTFT target."""
    from hiradix.sim.curve import recommend, recommend_for_ttft

    curve, timing = run.curve, run.timing
    if args.target_p90_ttft is None:
        return recommend(
            curve,
            run.target,
            bytes_per_token=run.bytes_per_token,
            prices=args.prices,
            min_device_tokens=args.min_device_tokens,
        )
    if args.target_hit_rate is not None:
        raise _UsageError("give --target-hit-rate or --target-p90-ttft, not both")
    plans = recommend_for_ttft(
        curve,
        timing,
        args.target_p90_ttft,
        bytes_per_token=run.bytes_per_token,
        prices=args.prices,
        min_device_tokens=args.min_device_tokens,
    )
    if not plans:
        no_cache = float(np.percentile(curve.ttft(timing, 0), 90))
        raise _UsageError(
            f"no layout reaches a p90 TTFT of {args.target_p90_ttft:g} s (no cache: {no_cache:.3g} s; "
            f"with everything cached on the device: "
            f"{float(np.percentile(curve.ttft(timing, curve.max_useful_tokens), 90)):.3g} s)"
        )
    return plans


def _print_plan_curve(run: _Plan, name: str) -> None:
    """``hiradix plan``'s first part: the workload, the ideal hit rate, the knee and the
    hit rate at round sizes."""
    from hiradix.sim.curve import format_size

    curve, model, bpt = run.curve, run.model, run.bytes_per_token
    knee = curve.knee()
    print(
        f"hiradix plan: {name}, {curve.requests:,} requests, {format_tokens(curve.prompt_tokens)} prompt tokens, "
        f"page {curve.page_size}, {model.name} {model.dtype} ({bpt:,} KV bytes/token); one pass in {run.wall:.1f} s"
    )
    print(
        f"  ideal (unbounded)  {curve.ideal_token_hit_rate:.2%} of tokens, {curve.ideal_block_hit_rate:.2%} of blocks; "
        f"reached at {format_size(curve.max_useful_tokens)} tokens ({run.gib(curve.max_useful_tokens)} GiB)"
    )
    print(
        f"  knee               {format_size(knee)} tokens ({run.gib(knee)} GiB): {curve.token_hit_rate(knee):.2%} of "
        "tokens"
    )
    print()
    print(f"  {'capacity':>9} {'GiB':>10} {'token hit':>10} {'block hit':>10} {'/ideal':>7}")
    for size in curve.sizes():
        rate = curve.token_hit_rate(size)
        small = " *" if size < curve.max_prompt_tokens else ""
        print(
            f"  {format_tokens(size):>9} {run.gib(size):>10} {rate:>10.2%} {curve.block_hit_rate(size):>10.2%} "
            f"{rate / curve.ideal_token_hit_rate:>7.1%}{small}"
        )
    if curve.sizes()[0] < curve.max_prompt_tokens:
        print(f"  * below the longest prompt ({format_size(curve.max_prompt_tokens)} tokens): approximate")
    print()


def _print_plan_layouts(
    args: argparse.Namespace, run: _Plan, prices: dict[str, float]
) -> tuple[list[tuple[dict[str, float], list[Finding]]], dict[str, float]]:
    """``hiradix plan``'s second part: the cheapest layouts with their estimated TTFT,
    the no-cache TTFT, the recommendation and the findings. Returns each layout's
    :func:`_plan_ttft` and the no-cache TTFT metrics."""
    from hiradix.sim.curve import format_size

    curve, timing, plans = run.curve, run.timing, run.plans
    goal = (
        f"a p90 TTFT of at most {args.target_p90_ttft:g} s (tp {args.tp}, L3 over {args.l3_link})"
        if args.target_p90_ttft is not None
        else f"a {run.target:.2%} token hit rate"
    )
    print(
        f"Cheapest sizes for {goal} (prices per GiB: "
        + ", ".join(f"{t} {p:g}" for t, p in prices.items())
        + "; tiers inclusive):"
    )
    print(
        f"  {'layout':<15} {'device':>7} {'host':>7} {'L3':>7} {'dev hit':>8} {'host hit':>8} {'L3 hit':>7} "
        f"{'total':>7} {'GiB dev/host/L3':>24} {'cost':>12}  estimated TTFT (idle GPU)"
    )
    checked = [_plan_ttft(curve, timing, plan) for plan in plans]
    for plan, (metrics, _) in zip(plans, checked, strict=True):
        gibs = f"{plan.device_gib:,.0f}/{plan.host_gib:,.0f}/{plan.l3_gib:,.0f}"
        print(
            f"  {plan.layout:<15} {format_size(plan.device_tokens):>7} {format_size(plan.host_tokens):>7} "
            f"{format_size(plan.l3_tokens):>7} {plan.device_hit_rate:>8.2%} {plan.host_hit_rate:>8.2%} "
            f"{plan.l3_hit_rate:>7.2%} {plan.hit_rate:>7.2%} {gibs:>24} {plan.cost:>12,.0f}"
            f"  p90 TTFT {metrics['p90']:.3g} s, mean {metrics['mean']:.3g} s"
        )
    no_cache_ttft = ttft_metrics(curve.ttft(timing, 0))
    print(
        f"  {'no cache':<15} {'':>7} {'':>7} {'':>7} {'':>8} {'':>8} {'':>7} {0:>7.2%} {'':>24} {'':>12}"
        f"  p90 TTFT {no_cache_ttft['p90']:.3g} s, mean {no_cache_ttft['mean']:.3g} s"
    )
    best = plans[0]
    print(
        f"  recommended: {best.layout}, device {format_size(best.device_tokens)}, host "
        f"{format_size(best.host_tokens)}, L3 {format_size(best.l3_tokens)} tokens, cost {best.cost:,.0f}"
    )
    for plan, (_, found) in zip(plans, checked, strict=True):
        for finding in found:
            print(f"  finding: {plan.layout}: {finding.line()}")
    return checked, no_cache_ttft


def _plan_json(
    args: argparse.Namespace,
    run: _Plan,
    description: dict[str, Any],
    prices: dict[str, float],
    checked: list[tuple[dict[str, float], list[Finding]]],
    no_cache_ttft: dict[str, float],
) -> dict[str, Any]:
    """``hiradix plan --json``: the workload, the curve and each layout with its TTFT and findings."""
    return {
        "hiradix_version": hiradix.__version__,
        "workload": description,
        "model": run.model.name,
        "kv_dtype": run.model.dtype,
        "bytes_per_token": run.bytes_per_token,
        "wall_s": run.wall,
        "target_hit_rate": None if args.target_p90_ttft is not None else run.target,
        "target_p90_ttft_s": args.target_p90_ttft,
        "prices": prices,
        "curve": run.curve.to_dict(),
        "no_cache_ttft_s": no_cache_ttft,
        "plans": [
            {**p.to_dict(), "ttft_s_metrics": metrics, "findings": [f.to_dict() for f in found]}
            for p, (metrics, found) in zip(run.plans, checked, strict=True)
        ],
    }


def _write_plan_plot(path: Path, run: _Plan, name: str) -> None:
    """``hiradix plan --plot``: the curve as a PNG, the recommended sizes marked."""
    from hiradix.sim.curve import plot_curve
    from hiradix.sim.report import png_bytes

    best = run.plans[0]
    marks = {"device": best.device_tokens, "host": best.host_tokens, "L3": best.l3_tokens}
    marks = {k: v for k, v in marks.items() if v}
    title = f"LRU hit rate by capacity: {name}, page {run.curve.page_size}"
    path.write_bytes(png_bytes(plot_curve(run.curve, title, marks=marks, bytes_per_token=run.bytes_per_token)))
    print(f"  plot: {path}")


def _plan_ttft(curve: Any, timing: TimingModel, plan: Any) -> tuple[dict[str, float], list[Finding]]:
    """A plan's estimated TTFT (mean, p50, p90, p99 in seconds, :meth:`CapacityCurve.ttft`)
    and the tiers of it that make TTFT worse than the same sizes without them
    (:func:`hiradix.sim.advice.explain`). ``O(pages)``."""
    device = curve.request_hit_tokens(plan.device_tokens)
    host = curve.request_hit_tokens(max(plan.device_tokens, plan.host_tokens))
    top = curve.request_hit_tokens(max(plan.device_tokens, plan.host_tokens, plan.l3_tokens))
    hits = (curve.request_inputs, device, host - device, top - host)
    return ttft_metrics(timing.ttft(*hits)), explain(timing, *hits, remedies=PLAN_REMEDIES)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hiradix`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["sim", "sweep"]:  # ``hiradix sim sweep`` is ``hiradix sweep``
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
