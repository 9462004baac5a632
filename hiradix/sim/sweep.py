"""Parameter sweeps: one workload replayed over a grid of capacities and policies.

:func:`run_sweep` replays every :class:`SweepCell` of a grid (device capacities x host
capacities x eviction policies x write policies) through :func:`~hiradix.sim.run.simulate`,
in worker processes started with ``spawn`` (safe with threads and any platform), one
cell per task. Cells are independent and each worker regenerates the workload from its
(picklable, deterministic) description, so the result does not depend on the number of
workers. :func:`sweep_table` and :func:`plot_sweep` give one table and one plot.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any

from hiradix.sim.config import SimConfig, SimWarning, format_tokens
from hiradix.sim.extras import figure, progress_bar
from hiradix.sim.generators import Workload
from hiradix.sim.run import simulate
from hiradix.sim.timing import TimingModel


@dataclass(frozen=True)
class SweepCell:
    """One configuration of a sweep (capacities in tokens, ``None`` = unbounded)."""

    device_tokens: int | None
    host_tokens: int | None
    eviction_policy: str
    write_policy: str


@dataclass(frozen=True)
class SweepRow:
    """The outcome of one cell: token hit rates, estimated TTFT and traffic."""

    cell: SweepCell
    requests: int
    device_hit_rate: float
    host_hit_rate: float
    l3_hit_rate: float
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    device_evicted_tokens: int
    host_evicted_tokens: int
    host_to_device_bytes: float
    device_to_host_bytes: float
    too_large_requests: int
    wall_s: float
    l3_write_tokens: int = 0
    prefetches: int = 0  # prefetches that found pages in L3

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready record (the cell's fields first)."""
        out = asdict(self)
        return {**out.pop("cell"), **out}


def grid(
    device_tokens: Iterable[int | None],
    host_tokens: Iterable[int | None],
    eviction_policies: Iterable[str],
    write_policies: Iterable[str],
) -> list[SweepCell]:
    """Every combination, in nested order (write policy varies fastest).

    >>> len(grid([1000, 2000], [None], ["lru", "lfu"], ["write_through"]))
    4
    """
    combos = itertools.product(device_tokens, host_tokens, eviction_policies, write_policies)
    return [SweepCell(*combo) for combo in combos]


def resolve_cells(
    config: SimConfig,
    cells: Iterable[SweepCell | tuple[Any, Any, str, str]],
    timing: TimingModel | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[SweepCell]:
    """Cells with their capacities in tokens: sizes in bytes and ``auto`` are resolved
    against ``config`` (:meth:`~hiradix.sim.config.SimConfig.resolve`; its model, TP and
    GPU). Configuration errors are raised here, before any worker starts; each distinct
    warning is passed to ``warn`` once (default: issued as
    :class:`~hiradix.sim.config.SimWarning`). ``O(cells)``."""
    out, seen = [], set()
    for cell in cells:
        device, host, eviction, write = (
            (cell.device_tokens, cell.host_tokens, cell.eviction_policy, cell.write_policy)
            if isinstance(cell, SweepCell)
            else cell
        )
        resolved = config.replace(
            device_tokens=device, host_tokens=host, eviction_policy=eviction, write_policy=write
        ).resolve(timing)
        for note in resolved.warnings:
            if note not in seen:
                seen.add(note)
                if warn is not None:
                    warn(note)
                else:
                    warnings.warn(note, SimWarning, stacklevel=2)
        out.append(SweepCell(resolved.device_tokens, resolved.host_tokens, eviction, write))
    return out


def run_cell(workload: Workload, cell: SweepCell, config: SimConfig, timing: TimingModel) -> SweepRow:
    """Replay ``workload`` with ``config`` and ``cell``'s settings through the same path as
    ``hiradix sim`` (:func:`~hiradix.sim.run.simulate`, i.e. a real ``HiRadixCache``).
    Configuration warnings are not repeated here (:func:`resolve_cells` tells them once).
    A module-level function, so that spawned workers can import it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SimWarning)
        result = simulate(
            workload,
            config,
            timing=timing,
            device_tokens=cell.device_tokens,
            host_tokens=cell.host_tokens,
            eviction_policy=cell.eviction_policy,
            write_policy=cell.write_policy,
        )
    stats, rates = result.stats, result.stats.rates()
    ttft = result.timing.percentiles()
    moved = timing.bytes_moved(stats)
    return SweepRow(
        cell=cell,
        requests=stats.requests,
        device_hit_rate=rates["device_token_hit_rate"],
        host_hit_rate=rates["host_token_hit_rate"],
        l3_hit_rate=rates["l3_token_hit_rate"],
        hit_rate=rates["token_hit_rate"],
        ideal_hit_rate=rates["ideal_token_hit_rate"],
        ttft_p50_s=ttft["p50"],
        ttft_p90_s=ttft["p90"],
        ttft_p99_s=ttft["p99"],
        device_evicted_tokens=stats.device_demoted_tokens + stats.device_deleted_tokens,
        host_evicted_tokens=stats.host_evicted_tokens,
        host_to_device_bytes=moved["host_to_device"],
        device_to_host_bytes=moved["device_to_host"],
        too_large_requests=stats.too_large_requests,
        wall_s=result.wall_s,
        l3_write_tokens=stats.l3_write_tokens,
        prefetches=stats.prefetch_completed + stats.prefetch_partial + stats.prefetch_failed,
    )


def run_sweep(
    workload: Workload,
    cells: Sequence[SweepCell],
    *,
    config: SimConfig | None = None,
    timing: TimingModel | None = None,
    jobs: int | None = None,
    progress: bool | None = False,
    **settings: Any,
) -> list[SweepRow]:
    """Run every cell; returns the rows in the order of ``cells``.

    Every cell starts from ``config`` (default :class:`~hiradix.sim.config.SimConfig`,
    ``hiradix sim``'s defaults) with ``settings`` applied (``l3_backend=None``,
    ``page_size=...``); the cell sets the capacities and policies. Capacities may be
    sizes in bytes or ``auto`` (see :func:`resolve_cells`, called here first).

    ``jobs`` worker processes (default: one per CPU, at most one per cell); ``jobs=1``
    runs in this process. ``progress`` as in :func:`~hiradix.sim.run.simulate`, one
    tick per finished cell, with the elapsed time and an estimate of the time left;
    when stderr is not a terminal (piped, logged) the bar is printed as plain lines at
    most every few seconds. An error in a cell (a bad trace line, say) is raised here.
    """
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    config = (config or SimConfig()).replace(**settings)
    timing = timing or config.timing_model()
    cells = resolve_cells(config, cells, timing)
    jobs = min(jobs or os.cpu_count() or 1, max(len(cells), 1))
    rows: list[SweepRow | None] = [None] * len(cells)
    piped = not sys.stderr.isatty()
    bar = progress_bar(
        total=len(cells),
        unit="run",
        file=sys.stderr,
        disable=progress is False,
        dynamic_ncols=not piped,
        ncols=80 if piped else None,
        mininterval=5.0 if piped else 0.1,
        ascii=piped,
        desc=f"sweep ({jobs} job{'s' if jobs != 1 else ''})",
    )
    with bar:
        if jobs == 1:
            for i, cell in enumerate(cells):
                rows[i] = run_cell(workload, cell, config, timing)
                bar.update()
        else:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(run_cell, workload, cell, config, timing): i for i, cell in enumerate(cells)}
                for future in as_completed(futures):
                    rows[futures[future]] = future.result()
                    bar.update()
    return [row for row in rows if row is not None]


def sweep_table(rows: Sequence[SweepRow]) -> str:
    """The rows as a fixed-width text table (hit rates in % of prompt tokens)."""
    header = (
        f"{'device':>8}{'host':>8}  {'eviction':<9}{'write':<24}{'device':>8}{'host':>8}{'L3':>8}{'total':>8}"
        f"{'ideal':>8}{'/ideal':>8}{'TTFT p50':>11}{'TTFT p90':>11}{'H2D':>10}"
    )
    lines = [header]
    for r in rows:
        c = r.cell
        of_ideal = f"{100 * r.hit_rate / r.ideal_hit_rate:.1f}%" if r.ideal_hit_rate else "-"
        lines.append(
            f"{format_tokens(c.device_tokens):>8}{format_tokens(c.host_tokens):>8}  {c.eviction_policy:<9}"
            f"{c.write_policy:<24}{100 * r.device_hit_rate:>7.2f}%{100 * r.host_hit_rate:>7.2f}%"
            f"{100 * r.l3_hit_rate:>7.2f}%"
            f"{100 * r.hit_rate:>7.2f}%{100 * r.ideal_hit_rate:>7.2f}%{of_ideal:>8}"
            f"{r.ttft_p50_s * 1000:>8.1f} ms{r.ttft_p90_s * 1000:>8.1f} ms{r.host_to_device_bytes / 1e9:>7.1f} GB"
        )
    return "\n".join(lines)


def plot_sweep(rows: Sequence[SweepRow], title: str = "") -> Any:
    """Total token hit rate against device capacity, one line per (host capacity,
    eviction policy, write policy); the ideal as a dashed line. Unbounded capacities sit
    at the right end."""
    capacities = sorted({r.cell.device_tokens for r in rows}, key=lambda c: (c is None, c or 0))
    position = {c: i for i, c in enumerate(capacities)}
    fig = figure(figsize=(9, 5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    series: dict[tuple[Any, ...], list[SweepRow]] = {}
    for r in rows:
        series.setdefault((r.cell.host_tokens, r.cell.eviction_policy, r.cell.write_policy), []).append(r)
    # Colour: eviction policy; line style: write policy; marker: host capacity.
    styles, markers = ["-", "--", "-.", ":"], ["o", "s", "^", "D", "v", "P"]
    write_policies = sorted({r.cell.write_policy for r in rows})
    policies = sorted({r.cell.eviction_policy for r in rows})
    hosts = sorted({r.cell.host_tokens for r in rows}, key=lambda c: (c is None, c or 0))
    for (host, policy, write), points in series.items():
        points.sort(key=lambda r: position[r.cell.device_tokens])
        ax.plot(
            [position[r.cell.device_tokens] for r in points],
            [100 * r.hit_rate for r in points],
            color=f"C{policies.index(policy) % 10}",
            marker=markers[hosts.index(host) % len(markers)],
            ls=styles[write_policies.index(write) % len(styles)],
            label=f"{policy}, {write}, host {format_tokens(host)}",
        )
    ideal = max((r.ideal_hit_rate for r in rows), default=0.0)
    ax.axhline(100 * ideal, color="k", ls="--", lw=1, label="ideal (infinite capacity)")
    ax.set_xticks(range(len(capacities)), [format_tokens(c) for c in capacities])
    # Scaled to the data (hit rates and the ideal), not 0-100%: sweeps of one workload
    # differ by a few points, which a full-scale axis draws as one line.
    values = [100 * r.hit_rate for r in rows] + [100 * ideal]
    lo, hi = min(values), max(values)
    pad = max(0.5, 0.1 * (hi - lo))
    ax.set(
        xlabel="device capacity (tokens)",
        ylabel="token hit rate, all tiers (%)",
        ylim=(max(0.0, lo - pad), min(100.0, hi + pad)),
    )
    ax.set_title(title or "Hit rate by capacity and policy")
    ax.legend(fontsize="small", loc="upper left", ncol=2)
    ax.grid(alpha=0.3)
    return fig
