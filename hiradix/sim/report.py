"""Outputs of a simulation run: the summary table, JSON, PNG plots and an HTML report.

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
from hiradix.sim.config import format_gib, format_tokens
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


def to_json(result: SimResult) -> dict[str, Any]:
    """The run as JSON-ready data: workload, configuration, counters and rates, timing
    per scenario, bytes moved per tier, prefetch outcomes, wall time."""
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


def _figure() -> Any:
    from matplotlib.figure import Figure  # imported lazily: the summary alone never needs it

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def plot_hit_rate(result: SimResult) -> Any:
    """Cumulative token hit rate per tier over time (stacked), against the ideal."""
    fig, ax = _figure()
    tl = result.timeline
    prompt = np.cumsum(tl["prompt_tokens"]).astype(np.float64)
    prompt[prompt == 0] = np.nan
    x = _minutes(result)
    idx = _thin(len(x))
    bottom = np.zeros(len(idx))
    for name, column, color in (("device", "device_hit", "#1f77b4"), ("host", "host_hit", "#ff7f0e"),
                                ("L3", "l3_hit", "#2ca02c")):  # fmt: skip
        rate = (np.cumsum(tl[column]) / prompt)[idx]
        if column == "l3_hit" and not tl[column].any():
            continue
        ax.fill_between(x[idx], bottom, bottom + rate, step="post", alpha=0.7, color=color, label=f"{name} hit")
        bottom = bottom + rate
    ax.plot(x[idx], (np.cumsum(tl["ideal_hit"]) / prompt)[idx], "k--", lw=1.2, label="ideal (infinite capacity)")
    ax.set(xlabel="time since the first request (minutes)", ylabel="cumulative token hit rate", ylim=(0, 1))
    ax.set_title(f"Hit rate over time: {source_name(result)}")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def plot_ttft_cdf(result: SimResult) -> Any:
    """CDF of the estimated TTFT in each timing scenario (log time axis)."""
    fig, ax = _figure()
    for name in SCENARIOS:
        values = np.sort(result.timing.ttft[name])
        if not len(values):
            continue
        idx = _thin(len(values))
        ax.plot(values[idx] * 1000, (idx + 1) / len(values), lw=1.5, label=SCENARIO_LABELS[name])
    ax.set_xscale("log")
    ax.set(xlabel="estimated TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1))
    ax.set_title(f"TTFT CDF ({result.timing.timing.model.name}, idle-GPU service time)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, which="both")
    return fig


def plot_occupancy(result: SimResult) -> Any:
    """Tokens held by each tier after each request, with the capacities."""
    fig, ax = _figure()
    tl, cfg = result.timeline, result.config
    x = _minutes(result)
    idx = _thin(len(x))
    for name, column, capacity, color in (
        ("device", "device_used", cfg.get("device_tokens"), "#1f77b4"),
        ("host", "host_used", cfg.get("host_tokens"), "#ff7f0e"),
        ("L3", "l3_used", cfg.get("l3_tokens"), "#2ca02c"),
    ):
        if column == "l3_used" and not tl[column].any():
            continue
        ax.plot(x[idx], tl[column][idx] / 1e6, color=color, lw=1.5, label=f"{name} used")
        if capacity is not None:
            ax.axhline(capacity / 1e6, color=color, ls=":", lw=1, label=f"{name} capacity")
    ax.set(xlabel="time since the first request (minutes)", ylabel="tokens (millions)")
    ax.set_ylim(bottom=0)
    ax.set_title("Tier occupancy over time")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
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
body { font-family: system-ui, sans-serif; max-width: 60em; margin: 2em auto; color: #222; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
"""


def html_report(result: SimResult, rendered: dict[str, bytes] | None = None) -> str:
    """A self-contained HTML page: summary, TTFT table, the plots (embedded), JSON."""
    rendered = rendered or render_plots(result)
    data = to_json(result)
    rows = "".join(
        f"<tr><td>{SCENARIO_LABELS[name]}</td>"
        + "".join(f"<td>{_ms(s[k])}</td>" for k in ("p50_s", "p90_s", "p99_s", "mean_s"))
        + f"<td>{s['throughput_tokens_per_s']:,.0f}</td></tr>"
        for name, s in data["timing"]["scenarios"].items()
    )
    images = "".join(
        f"<h2>{html.escape(name.replace('_', ' '))}</h2>"
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        for name, png in rendered.items()
    )
    title = f"hiradix sim: {source_name(result)}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<pre>{html.escape(summary(result))}</pre>"
        "<h2>Estimated TTFT</h2><table><tr><th>scenario</th><th>p50</th><th>p90</th><th>p99</th>"
        f"<th>mean</th><th>prefill tokens/s</th></tr>{rows}</table>"
        f"{images}"
        f"<details><summary>JSON</summary><pre>{html.escape(json.dumps(data, indent=2))}</pre></details>"
        "</body></html>\n"
    )


def write_html(result: SimResult, path: str | Path, rendered: dict[str, bytes] | None = None) -> Path:
    """Write :func:`html_report` to ``path``; returns it."""
    path = Path(path)
    path.write_text(html_report(result, rendered), encoding="utf-8")
    return path
