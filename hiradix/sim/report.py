"""Outputs of a simulation run: the summary table, JSON, PNG plots and an HTML report.

Each carries the run's findings (:func:`findings`, :mod:`hiradix.sim.advice`): one line
for each tier that makes the estimated TTFT worse than the layout without it, with the
reason and the options that would change it (the TTFT CDF plot in a shorter form).

All functions take a :class:`~hiradix.sim.run.SimResult`. Plots use matplotlib's
object API on the Agg canvas (no pyplot, no display, no global backend switch), so they
work headless and in worker processes. The HTML report is one self-contained file:
the plots are embedded as base64 PNGs.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import hiradix
from hiradix.sim.advice import Finding, explain
from hiradix.sim.config import format_gib, format_tokens
from hiradix.sim.extras import figure
from hiradix.sim.run import SimResult
from hiradix.sim.timing import SCENARIOS

SCENARIO_LABELS = {
    "all_tiers": "all tiers",
    "no_l3": "without L3",
    "device_only": "device only",
    "no_cache": "no cache",
}
PLOTS = ("hit_rate", "ttft_cdf", "occupancy")
"""Names of the plots: ``{name}.png`` in :func:`write_plots`."""

_MAX_POINTS = 4000  # points per plotted line; longer series are thinned evenly


def format_bytes(n: float) -> str:
    """Decimal bytes: ``0 B``, ``12.3 MB``, ``4.56 TB``.

    >>> format_bytes(0), format_bytes(12_345_678), format_bytes(4.56e12)
    ('0 B', '12.3 MB', '4.56 TB')
    """
    for suffix, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f} B"


def plural(n: int, noun: str) -> str:
    """``1 request``, ``2,000 requests``.

    >>> plural(1, "request"), plural(2000, "request"), plural(0, "bad line")
    ('1 request', '2,000 requests', '0 bad lines')
    """
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def capacity(tokens: int | None, bytes_per_token: float) -> str:
    """A capacity in tokens and GiB: ``422.3k tokens (51.5 GiB)``, ``inf``.

    >>> capacity(2_000_000, 131072), capacity(None, 1)
    ('2M tokens (244 GiB)', 'unbounded')
    """
    if tokens is None:
        return "unbounded"
    return f"{format_tokens(tokens)} tokens ({format_gib(tokens * bytes_per_token)})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def source_name(result: SimResult) -> str:
    """``conversation_trace.jsonl`` for a trace, ``chat workload (seed 0)`` otherwise."""
    w = result.workload
    if w["workload"] == "trace":
        return Path(w["path"]).name
    if w["workload"].startswith("azure"):
        return f"{w['workload']} ({Path(w['path']).name}, seed {w['seed']})"
    return f"{w['workload']} workload (seed {w['seed']})"


def findings(result: SimResult) -> list[Finding]:
    """The tiers that make this run's estimated TTFT worse than the layout without them,
    with why and what would change it (:func:`hiradix.sim.advice.explain`)."""
    tl = result.timeline
    return explain(result.timing.timing, tl["input_tokens"], tl["device_hit"], tl["host_hit"], tl["l3_hit"])


def to_json(result: SimResult) -> dict[str, Any]:
    """The run as JSON-ready data: workload, configuration, counters and rates, timing
    per scenario, the findings on them, bytes moved per tier, prefetch outcomes, wall time."""
    stats, timing = result.stats, result.timing
    rates = stats.rates()
    return {
        "hiradix_version": hiradix.__version__,
        "implementation": result.implementation,
        "workload": result.workload,
        "trace": {
            "path": result.workload.get("path"),
            "requests": stats.requests,
            "bad_lines_skipped": result.bad_lines,
        },
        "config": result.config,
        "stats": stats.to_dict(),
        "hit_over_ideal": {
            "tokens": rates["token_hit_rate"] / rates["ideal_token_hit_rate"] if stats.ideal_hit_tokens else None,
            "blocks": rates["block_hit_rate"] / rates["ideal_block_hit_rate"] if stats.ideal_hit_blocks else None,
        },
        "timing": {"model": timing.timing.describe(), "scenarios": timing.summary()},
        "findings": [f.to_dict() for f in findings(result)],
        "bytes_moved": timing.timing.bytes_moved(stats),
        "prefetch": _prefetch(result),
        "wall_s": result.wall_s,
        "requests_per_s": stats.requests / result.wall_s if result.wall_s else 0.0,
    }


def _prefetch(result: SimResult) -> dict[str, Any]:
    s = result.stats
    counts = {"completed": s.prefetch_completed, "partial": s.prefetch_partial, "failed": s.prefetch_failed}
    applicable = bool(result.config.get("l3_backend")) or bool(sum(counts.values()) or s.l3_hit_tokens)
    return {"applicable": applicable, **counts}


def summary(result: SimResult) -> str:
    """The human-readable result table of ``hiradix sim``."""
    stats, cfg, rates = result.stats, result.config, result.stats.rates()

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    def row(name: str, tokens: int, token_rate: str, blocks: int | None = None, block_rate: str = "") -> str:
        block_text = "" if blocks is None else f"{blocks:>11,}"
        return f"  {name:<18}{tokens:>15,}{token_rate:>9}{block_text}{block_rate:>9}".rstrip()

    hit_tokens = stats.device_hit_tokens + stats.host_hit_tokens + stats.l3_hit_tokens
    hit_blocks = stats.device_hit_blocks + stats.host_hit_blocks + stats.l3_hit_blocks
    of_ideal = [
        pct(hit / ideal) if ideal else "-"
        for hit, ideal in ((hit_tokens, stats.ideal_hit_tokens), (hit_blocks, stats.ideal_hit_blocks))
    ]
    wall = result.wall_s
    rank_bytes = result.timing.timing.rank_bytes_per_token
    hw = result.hardware
    lines = [
        f"hiradix sim: {source_name(result)}, {plural(stats.requests, 'request')}"
        + (f" ({plural(result.bad_lines, 'bad line')} skipped)" if result.bad_lines else "")
        + f", {result.implementation} tree",
        f"  page {cfg['page_size']} tokens, device {capacity(cfg['device_tokens'], rank_bytes)} per GPU, "
        f"host {capacity(cfg['host_tokens'], rank_bytes)} per GPU, {cfg['eviction_policy']}, {cfg['write_policy']}",
        (
            f"  L3 {cfg['l3_backend']} {capacity(cfg.get('l3_tokens'), result.timing.timing.moved_bytes_per_token)}, "
            f"prefetch {cfg.get('prefetch_policy')}{'' if cfg.get('prefetch_wait', True) else ' (no wait)'}"
            if cfg.get("l3_backend")
            else "  no L3 tier"
        ),
    ]
    if hw:
        lines.append(
            f"  GPU           {hw['gpu']} {hw['gpu_memory_gib']:.0f} GiB, mem_fraction_static "
            f"{hw['mem_fraction_static']:g}, weights {hw['weights_gib_per_gpu']:.3g} GiB per GPU: KV room "
            f"{capacity(hw['device_fit_tokens'], rank_bytes)}"
        )
    lines += [*(f"  warning       {w}" for w in result.warnings)]
    lines += [
        "",
        f"  {'':<18}{'tokens':>15}{'rate':>9}{'blocks':>11}{'rate':>9}",
        row("device hit", stats.device_hit_tokens, pct(rates["device_token_hit_rate"]),
            stats.device_hit_blocks, pct(rates["device_block_hit_rate"])),
        row("host hit", stats.host_hit_tokens, pct(rates["host_token_hit_rate"]),
            stats.host_hit_blocks, pct(rates["host_block_hit_rate"])),
        row("L3 hit", stats.l3_hit_tokens, pct(rates["l3_token_hit_rate"]),
            stats.l3_hit_blocks, pct(rates["l3_block_hit_rate"])),
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
    lines.append(f"  too large     {plural(stats.too_large_requests, 'request')} did not fit on the device")
    if cfg.get("verify_bytes"):
        lines.append(
            f"  bytes         {stats.verified_tokens:,} reused tokens verified, {stats.corrupt_tokens:,} wrong"
            + ("" if not stats.corrupt_tokens else "  << WRONG KV BYTES")
        )
    lines += ["", *_timing_lines(result), ""]
    lines.append(
        f"  time          {wall:.1f} s, {stats.requests / wall if wall else 0:,.0f} requests/s, "
        f"{stats.prompt_tokens / wall / 1e6 if wall else 0:.1f}M prompt tokens/s"
    )
    return "\n".join(lines)


def _timing_lines(result: SimResult) -> list[str]:
    estimate = result.timing
    model = estimate.timing
    d = model.describe()
    lines = [
        f"  timing model  {d['model']} {d['kv_dtype']}{' MLA' if d['mla'] else ''}, "
        f"{d['kv_bytes_per_token'] / 1024:,.1f} KiB KV/token, tp {d['tp']}, "
        f"prefill {d['prefill_tokens_per_s']:,.0f} tokens/s, host link {d['pcie']['name']}, L3 link {d['l3']['name']}",
        f"  {'TTFT':<14}{'p50':>12}{'p90':>12}{'p99':>12}{'mean':>12}{'prefill tok/s':>16}",
    ]
    for name, s in estimate.summary().items():
        lines.append(
            f"  {SCENARIO_LABELS[name]:<14}{_ms(s['p50_s']):>12}{_ms(s['p90_s']):>12}{_ms(s['p99_s']):>12}"
            f"{_ms(s['mean_s']):>12}{s['throughput_tokens_per_s']:>16,.0f}"
        )
    lines += [f"  finding       {f.line()}" for f in findings(result)]
    moved = model.bytes_moved(result.stats)
    lines.append(
        f"  bytes moved   host to device {format_bytes(moved['host_to_device'])}, device to host "
        f"{format_bytes(moved['device_to_host'])}, L3 to host {format_bytes(moved['l3_to_host'])}, "
        f"host to L3 {format_bytes(moved['host_to_l3'])}"
    )
    p = _prefetch(result)
    lines.append(
        f"  prefetch      completed {p['completed']:,}, partial {p['partial']:,}, failed {p['failed']:,}"
        if p["applicable"]
        else "  prefetch      not applicable (no L3 tier in this replay)"
    )
    return lines


# ------------------------------------------------------------------------------- plots
def _thin(n: int) -> np.ndarray:
    """Indices of at most ``_MAX_POINTS`` evenly spaced points out of ``n``, last included."""
    if n <= _MAX_POINTS:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, _MAX_POINTS).round().astype(np.int64))


def _minutes(result: SimResult) -> np.ndarray:
    t = result.timeline["timestamp_ms"]
    return (t - t[0]) / 60_000 if len(t) else t


def config_line(result: SimResult) -> str:
    """One line naming the configuration, for plot titles and captions."""
    cfg, model = result.config, result.timing.timing
    l3 = f"L3 {cfg['l3_backend']} {format_tokens(cfg.get('l3_tokens'))}" if cfg.get("l3_backend") else "no L3"
    gpu = f" on {cfg['gpu']}" if cfg.get("gpu") else ""
    return (
        f"device {format_tokens(cfg['device_tokens'])}, host {format_tokens(cfg['host_tokens'])}, {l3} tokens; "
        f"{cfg['eviction_policy']}, {cfg['write_policy']}; {model.model.name} tp {model.tp}{gpu}"
    )


def _figure(rows: int = 1) -> Any:
    fig = figure(figsize=(9, 3.2 + 2.2 * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _titled(fig: Any, title: str, result: SimResult) -> None:
    fig.suptitle(f"{title}\n{config_line(result)}", fontsize="medium")


def window_size(n: int) -> int:
    """Requests per window of the windowed hit rate: about 50 windows, at least 20
    requests each (the whole run when shorter).

    >>> window_size(10), window_size(2000), window_size(23_608)
    (10, 40, 472)
    """
    return max(min(n, 20), n // 50)


def _windowed(values: np.ndarray, prompt: np.ndarray, w: int) -> np.ndarray:
    """Hit tokens over prompt tokens of the last ``w`` requests, at each request."""
    hits = np.convolve(values.astype(np.float64), np.ones(w), mode="full")[: len(values)]
    total = np.convolve(prompt.astype(np.float64), np.ones(w), mode="full")[: len(values)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, hits / np.where(total > 0, total, 1), np.nan)


def plot_hit_rate(result: SimResult) -> Any:
    """Token hit rate per tier over time (stacked), cumulative (top) and over a sliding
    window of requests (bottom), against the ideal. The y axes end just above the data."""
    fig, (cum_ax, win_ax) = _figure(2)
    tl = result.timeline
    x = _minutes(result)
    idx = _thin(len(x))
    prompt = np.cumsum(tl["prompt_tokens"]).astype(np.float64)
    prompt[prompt == 0] = np.nan
    w = window_size(len(x))
    tiers = (("device", "device_hit", "#1f77b4"), ("host", "host_hit", "#ff7f0e"), ("L3", "l3_hit", "#2ca02c"))
    top = 0.0
    for ax, rate_of in (
        (cum_ax, lambda col: np.cumsum(tl[col]) / prompt),
        (win_ax, lambda col: _windowed(tl[col], tl["prompt_tokens"], w)),
    ):
        bottom = np.zeros(len(idx))
        for name, column, color in tiers:
            if column == "l3_hit" and not tl[column].any():
                continue
            rate = np.nan_to_num(rate_of(column)[idx])
            ax.fill_between(x[idx], bottom, bottom + rate, step="post", alpha=0.7, color=color, label=f"{name} hit")
            bottom = bottom + rate
        ideal = rate_of("ideal_hit")[idx]
        ax.plot(x[idx], ideal, "k--", lw=1.2, label="ideal (infinite capacity)")
        top = max(top, float(np.nanmax(bottom, initial=0)), float(np.nanmax(ideal, initial=0)))
        ax.grid(alpha=0.3)
    for ax in (cum_ax, win_ax):
        ax.set_ylim(0, min(1.0, top * 1.1) or 1.0)
    cum_ax.set(ylabel="cumulative hit rate")
    win_ax.set(ylabel=f"hit rate, last {w:,} req.", xlabel="time since the first request (minutes)")
    cum_ax.legend(loc="lower right", fontsize="small")
    _titled(fig, f"Token hit rate over time: {source_name(result)}", result)
    return fig


def plot_ttft_cdf(result: SimResult) -> Any:
    """CDF of the estimated TTFT in each timing scenario (log time axis over the data)."""
    fig, (ax,) = _figure(1)
    lo, hi = np.inf, 0.0
    for name in SCENARIOS:
        values = np.sort(result.timing.ttft[name])
        if not len(values):
            continue
        idx = _thin(len(values))
        ax.plot(values[idx] * 1000, (idx + 1) / len(values), lw=1.5, label=SCENARIO_LABELS[name])
        lo, hi = min(lo, float(values[0])), max(hi, float(values[-1]))
    ax.set_xscale("log")
    if hi > 0:
        ax.set_xlim(lo * 1000 / 1.2, hi * 1000 * 1.2)
    ax.set(xlabel="estimated TTFT (ms, log scale)", ylabel="fraction of requests", ylim=(0, 1))
    notes = [f.short() for f in findings(result)]
    if notes:  # top left: the curves reach the top at the right
        ax.text(0.01, 0.98, "\n".join(notes), transform=ax.transAxes, va="top", ha="left", fontsize="small",
                wrap=True, bbox={"boxstyle": "round", "facecolor": "#fff4e5", "edgecolor": "#f0a020"})  # fmt: skip
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, which="both")
    _titled(fig, f"TTFT CDF ({result.timing.timing.model.name}, idle-GPU service time)", result)
    return fig


def plot_occupancy(result: SimResult) -> Any:
    """Tokens held by each tier after each request, one panel per tier, with its
    capacity; each panel's axis is scaled to that tier."""
    tl, cfg = result.timeline, result.config
    tiers = [
        ("device", "device_used", cfg.get("device_tokens"), "#1f77b4"),
        ("host", "host_used", cfg.get("host_tokens"), "#ff7f0e"),
        ("L3", "l3_used", cfg.get("l3_tokens") if cfg.get("l3_backend") else None, "#2ca02c"),
    ]
    tiers = [
        t
        for t in tiers
        if t[0] == "device" or (t[0] == "host" and t[2] != 0) or (t[0] == "L3" and cfg.get("l3_backend"))
    ]
    fig, axes = _figure(len(tiers))
    x = _minutes(result)
    idx = _thin(len(x))
    for ax, (name, column, capacity_tokens, color) in zip(axes, tiers, strict=True):
        used = tl[column][idx]
        ax.plot(x[idx], used / 1e3, color=color, lw=1.5, label=f"{name} used")
        top = float(used.max(initial=0))
        if capacity_tokens and capacity_tokens <= 1.5 * top:
            ax.axhline(
                capacity_tokens / 1e3, color=color, ls=":", lw=1, label=f"capacity {format_tokens(capacity_tokens)}"
            )
            top = max(top, capacity_tokens)
        elif capacity_tokens:  # far above the data: keep the axis on the data, say the capacity
            ax.plot([], [], " ", label=f"capacity {format_tokens(capacity_tokens)} (off scale)")
        ax.set_ylim(0, top / 1e3 * 1.08 or 1)
        ax.set(ylabel=f"{name} (k tokens)")
        ax.legend(loc="lower right", fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1].set(xlabel="time since the first request (minutes)")
    _titled(fig, "Tier occupancy over time", result)
    return fig


_PLOTTERS: dict[str, Callable[[SimResult], Any]] = {
    "hit_rate": plot_hit_rate,
    "ttft_cdf": plot_ttft_cdf,
    "occupancy": plot_occupancy,
}


def png_bytes(fig: Any) -> bytes:
    """``fig`` rendered as PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_plots(result: SimResult) -> dict[str, bytes]:
    """Every plot of :data:`PLOTS` as PNG bytes."""
    return {name: png_bytes(_PLOTTERS[name](result)) for name in PLOTS}


def write_plots(result: SimResult, folder: str | Path, rendered: dict[str, bytes] | None = None) -> list[Path]:
    """Write ``{name}.png`` for each of :data:`PLOTS` into ``folder`` (created if
    needed); returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in (rendered or render_plots(result)).items():
        path = folder / f"{name}.png"
        path.write_bytes(data)
        paths.append(path)
    return paths


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 64em; margin: 2em auto; color: #222; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; font-size: 0.85em; }
figure { margin: 1.5em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
caption { text-align: left; font-weight: 600; padding-bottom: 0.3em; }
td, th { padding: 0.2em 0.8em; text-align: right; font-variant-numeric: tabular-nums; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
.warning, .finding { background: #fff4e5; border-left: 4px solid #f0a020; padding: 0.5em 1em; }
"""

_CAPTIONS = {
    "hit_rate": "Share of prompt tokens each tier served, cumulative since the start (top) and over a "
    "sliding window of requests (bottom); the dashed line is what an infinite cache would serve.",
    "ttft_cdf": "Estimated time to first token per request on an idle GPU (no queueing), for the tiers as "
    "replayed and with lower tiers removed.",
    "occupancy": "Tokens each tier holds after each request (solid) against its capacity (dotted).",
    "capacity_curve": "Token hit rate an LRU cache of each size would reach on this workload, from one pass "
    "(hiradix.sim.curve), with the replayed tier sizes and the knee marked.",
}


def _table(caption: str, header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><caption>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"


def html_report(result: SimResult, rendered: dict[str, bytes] | None = None) -> str:
    """A self-contained HTML page: configuration, hits, transfers and TTFT as tables,
    the warnings, the plots (embedded, captioned), and the JSON."""
    rendered = rendered or render_plots(result)
    data = to_json(result)
    stats, rates, cfg = result.stats, result.stats.rates(), result.config
    rank_bytes = result.timing.timing.rank_bytes_per_token

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    config_rows = [
        ["workload", source_name(result)],
        ["requests", f"{stats.requests:,}"],
        ["device tier (per GPU)", capacity(cfg["device_tokens"], rank_bytes)],
        ["host tier (per GPU)", capacity(cfg["host_tokens"], rank_bytes)],
        [
            "L3 tier",
            f"{cfg['l3_backend']}, {capacity(cfg.get('l3_tokens'), result.timing.timing.moved_bytes_per_token)}, "
            f"prefetch {cfg.get('prefetch_policy')}"
            if cfg.get("l3_backend")
            else "none",
        ],
        ["page size", f"{cfg['page_size']} tokens"],
        ["policies", f"{cfg['eviction_policy']} eviction, {cfg['write_policy']}"],
        [
            "model",
            f"{result.timing.timing.model.name} {result.timing.timing.model.dtype}, tp {result.timing.timing.tp}",
        ],
    ]
    if result.hardware:
        hw = result.hardware
        config_rows.append(
            ["GPU", f"{hw['gpu']} {hw['gpu_memory_gib']:.0f} GiB, mem_fraction_static {hw['mem_fraction_static']:g}, "
             f"KV room {capacity(hw['device_fit_tokens'], rank_bytes)}"]
        )  # fmt: skip
    hit_tokens = stats.device_hit_tokens + stats.host_hit_tokens + stats.l3_hit_tokens
    hit_blocks = stats.device_hit_blocks + stats.host_hit_blocks + stats.l3_hit_blocks
    hit_rows = [
        ["device", f"{stats.device_hit_tokens:,}", pct(rates["device_token_hit_rate"]), f"{stats.device_hit_blocks:,}",
         pct(rates["device_block_hit_rate"])],
        ["host", f"{stats.host_hit_tokens:,}", pct(rates["host_token_hit_rate"]), f"{stats.host_hit_blocks:,}",
         pct(rates["host_block_hit_rate"])],
        ["L3", f"{stats.l3_hit_tokens:,}", pct(rates["l3_token_hit_rate"]), f"{stats.l3_hit_blocks:,}",
         pct(rates["l3_block_hit_rate"])],
        ["total", f"{hit_tokens:,}", pct(rates["token_hit_rate"]), f"{hit_blocks:,}", pct(rates["block_hit_rate"])],
        ["ideal (infinite)", f"{stats.ideal_hit_tokens:,}", pct(rates["ideal_token_hit_rate"]),
         f"{stats.ideal_hit_blocks:,}", pct(rates["ideal_block_hit_rate"])],
        ["prompt", f"{stats.prompt_tokens:,}", "", f"{stats.blocks:,}", ""],
    ]  # fmt: skip
    moved = data["bytes_moved"]
    transfer_rows = [
        ["device to host (backups)", f"{stats.backup_tokens:,}", format_bytes(moved["device_to_host"])],
        ["host to device (load back)", f"{stats.load_back_tokens:,}", format_bytes(moved["host_to_device"])],
        ["L3 to host (L3 hits)", f"{stats.l3_hit_tokens:,}", format_bytes(moved["l3_to_host"])],
        ["host to L3 (L3 writes)", f"{stats.l3_write_tokens:,}", format_bytes(moved["host_to_l3"])],
        ["evicted from device, kept on host", f"{stats.device_demoted_tokens:,}", ""],
        ["evicted from device, lost", f"{stats.device_deleted_tokens:,}", ""],
        ["evicted from host", f"{stats.host_evicted_tokens:,}", ""],
    ]
    ttft_rows = [
        [SCENARIO_LABELS[name], *(_ms(s[k]) for k in ("p50_s", "p90_s", "p99_s", "mean_s")),
         f"{s['throughput_tokens_per_s']:,.0f}"]
        for name, s in data["timing"]["scenarios"].items()
    ]  # fmt: skip
    warnings_html = "".join(f"<p class='warning'>Warning: {html.escape(w)}</p>" for w in result.warnings)
    findings_html = "".join(f"<p class='finding'>Finding: {html.escape(f['text'])}</p>" for f in data["findings"])
    images = "".join(
        f"<figure><img alt='{html.escape(name.replace('_', ' '))}' "
        f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        f"<figcaption>{html.escape(_CAPTIONS.get(name, ''))} {html.escape(config_line(result))}.</figcaption></figure>"
        for name, png in rendered.items()
    )
    title = f"hiradix sim: {source_name(result)}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{warnings_html}"
        + _table("Configuration", ["setting", "value"], config_rows)
        + _table("Hits per tier (tokens of page-aligned prompts; 512-token blocks)",
                 ["tier", "tokens", "rate", "blocks", "rate"], hit_rows)
        + _table("Transfers and evictions (bytes summed over ranks)", ["what", "tokens", "bytes"], transfer_rows)
        + _table(f"Estimated TTFT ({result.timing.timing.model.name}, idle GPU)",
                 ["scenario", "p50", "p90", "p99", "mean", "prefill tokens/s"], ttft_rows)
        + findings_html
        + f"<h2>Plots</h2>{images}"
        f"<details><summary>Text summary</summary><pre>{html.escape(summary(result))}</pre></details>"
        f"<details><summary>JSON</summary><pre>{html.escape(json.dumps(data, indent=2))}</pre></details>"
        "</body></html>\n"
    )  # fmt: skip


def write_html(result: SimResult, path: str | Path, rendered: dict[str, bytes] | None = None) -> Path:
    """Write :func:`html_report` to ``path``; returns it."""
    path = Path(path)
    path.write_text(html_report(result, rendered), encoding="utf-8")
    return path
