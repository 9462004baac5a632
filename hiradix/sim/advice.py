"""What the estimated TTFT means: where a tier makes it worse, why, and what would change it.

The timing model (:mod:`hiradix.sim.timing`) prices every hit. A token found on the device
costs nothing; a recomputed one costs ``1 / prefill_tokens_per_s``; one loaded back from the
host costs its PCIe transfer (partly hidden under the compute with layer-wise overlap); one
fetched from L3 costs its L3 transfer, fully exposed, and then that PCIe load. So a lower
tier pays only while moving a token's KV is faster than recomputing it. Per token, with
``b`` the KV bytes one rank moves::

    recompute = 1 / prefill_rate
    load      = b / pcie_bandwidth
    fetch     = b / l3_bandwidth

An L3 hit saves time only when ``fetch + load < recompute``, that is when the L3 link is
faster than (:func:`per_token_break_even_gbps`)::

    break_even = b / (1 / prefill_rate - b / pcie_bandwidth)      bytes/s

For llama-3-8b bf16 on one H100 (24,633 tokens/s) with PCIe 5 that is 3.45 GB/s: above
TCP's 2.5 GB/s, far below RDMA's 45. The rule leaves out the per-transfer latency and how
much of the load the compute hides, so for a workload :func:`explain` solves the
break-even exactly, on the requests and hits themselves: the slowest link at which the
scenario with the tier is no worse than the one without it on any headline metric (mean,
p50, p90, p99 TTFT), by bisection. Every request's TTFT only falls as a link gets faster,
so each metric is monotone in the bandwidth and the bisection is exact to its tolerance.

:func:`explain` compares each tier's scenario with the next cheaper one (all tiers against
no L3, no L3 against device only; a device hit never costs time) and returns one
:class:`Finding` per tier that makes any metric worse: by how much, against no cache too
where the layout is worse than no cache at all, the reason in the model's own numbers, and
the options that, evaluated in the same model, would remove it. ``hiradix sim`` and
``hiradix plan`` print each as one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hiradix.sim.timing import LINKS, Link, TimingModel

METRICS = ("mean", "p50", "p90", "p99")
"""The TTFT summaries the reports headline, in the order findings name them."""

_REL_TOL = 1e-9  # "worse" means worse by more than rounding
_FASTEST_GBPS = 1e6  # a link this fast moves a token in well under a nanosecond


@dataclass(frozen=True)
class Remedies:
    """How one command spells each remedy; ``None`` where the command has no such option."""

    l3_gbps: str | None = "--l3-gbps"
    l3_link: str | None = "--l3-link"
    drop_l3: str | None = "--l3-backend none"
    pcie_gbps: str | None = "--pcie-gbps"
    host_link: str | None = "--host-link"
    layerwise: str | None = "without --no-layerwise"
    drop_host: str | None = None


SIM_REMEDIES = Remedies()
"""``hiradix sim``'s options."""

PLAN_REMEDIES = Remedies(
    drop_l3="the device+host layout",
    pcie_gbps=None,
    host_link=None,
    layerwise=None,
    drop_host="the device layout",
)
"""``hiradix plan``'s options (it models PCIe 5 with layer-wise overlap, fixed)."""


@dataclass(frozen=True)
class Finding:
    """One tier that makes estimated TTFT worse than the cheaper layout without it.

    ``worse`` maps each metric of :data:`METRICS` the tier makes worse to ``(with the
    tier, without it)`` in seconds; ``no_cache`` the metrics on which the layout with the
    tier is worse than no cache at all, to no cache's value. ``break_even_gbps`` is the
    slowest link (the L3 link for ``L3``, the host link for ``host``) at which the tier
    stops making any metric worse, ``None`` when no bandwidth is enough.
    """

    tier: str  # "L3" or "host"
    scenario: str  # the timing scenario with the tier (hiradix.sim.timing.SCENARIOS)
    baseline: str  # the scenario without it
    worse: dict[str, tuple[float, float]]
    no_cache: dict[str, float]
    cause: str  # short: what is slower than what
    reason: str  # the numbers behind it
    options: tuple[str, ...]
    break_even_gbps: float | None

    @property
    def metric(self) -> str:
        """The headline metric: the first of :data:`METRICS` the tier makes worse."""
        return next(m for m in METRICS if m in self.worse)

    def line(self) -> str:
        """The finding in one line: what is worse and by how much, why, and what to change.

        >>> f = Finding("L3", "all_tiers", "no_l3", {"mean": (0.6, 0.5), "p99": (2.0, 1.5)}, {"mean": 0.55},
        ...             "c", "why", ("--x 1", "--y"), 3.0)
        >>> f.line()  # doctest: +NORMALIZE_WHITESPACE
        'L3 tier makes TTFT worse: mean 600.0 ms vs 500.0 ms without it (+20.0%; p99 too), 550.0 ms with no cache;
         why; options: --x 1 or --y'
        """
        m = self.metric
        with_tier, without = self.worse[m]
        also = [x for x in METRICS if x in self.worse and x != m]
        text = (
            f"{self.tier} tier makes TTFT worse: {m} {_ms(with_tier)} vs {_ms(without)} without it "
            f"(+{100 * (with_tier / without - 1) if without else float('inf'):.1f}%"
            + (f"; {', '.join(also)} too" if also else "")
            + ")"
        )
        if m in self.no_cache:
            text += f", {_ms(self.no_cache[m])} with no cache"
        text += f"; {self.reason}"
        if self.options:
            text += f"; options: {_or(self.options)}"
        return text

    def short(self) -> str:
        """A shorter form, for a plot: the tier, the headline metric and the cause."""
        with_tier, without = self.worse[self.metric]
        return f"{self.tier} raises {self.metric} TTFT {without * 1000:,.1f} -> {_ms(with_tier)}: {self.cause}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with :meth:`line` as ``text``."""
        return {
            "tier": self.tier,
            "scenario": self.scenario,
            "baseline": self.baseline,
            "worse_s": {m: {"with": a, "without": b} for m, (a, b) in self.worse.items()},
            "no_cache_s": self.no_cache,
            "cause": self.cause,
            "options": list(self.options),
            "break_even_gbps": self.break_even_gbps,
            "text": self.line(),
        }


def ttft_metrics(ttft: Any) -> dict[str, float]:
    """Mean, p50, p90 and p99 of per-request TTFTs (seconds; all 0.0 with none).
    ``O(requests)``.

    >>> ttft_metrics([1.0, 3.0])["mean"]
    2.0
    """
    values = np.asarray(ttft, dtype=np.float64)
    if not values.size:
        return dict.fromkeys(METRICS, 0.0)
    p50, p90, p99 = np.percentile(values, (50, 90, 99))
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def worse_metrics(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """The metrics of :data:`METRICS` on which ``a`` is worse (slower) than ``b``."""
    return [m for m in METRICS if a[m] > b[m] * (1 + _REL_TOL)]


def per_token_seconds(timing: TimingModel) -> dict[str, float]:
    """Seconds per token of one rank's KV: ``recompute``, ``load`` (host to device over
    the host link) and ``fetch`` (over the L3 link), latencies left out. ``O(1)``.

    >>> {k: round(v * 1e6, 1) for k, v in per_token_seconds(TimingModel(l3=LINKS["tcp"])).items()}
    {'recompute': 40.6, 'load': 2.6, 'fetch': 52.4}
    """
    b = timing.rank_bytes_per_token
    return {
        "recompute": 1.0 / timing.prefill_rate,
        "load": b / (timing.pcie.bandwidth_gbps * 1e9),
        "fetch": b / (timing.l3.bandwidth_gbps * 1e9),
    }


def per_token_break_even_gbps(timing: TimingModel) -> float | None:
    """The L3 link bandwidth (GB/s) at which fetching and loading a token's KV takes as long
    as recomputing it (module docstring); ``None`` when the host link alone is already
    slower than recomputing. ``O(1)``.

    >>> round(per_token_break_even_gbps(TimingModel()), 2)
    3.45
    """
    t = per_token_seconds(timing)
    spare = t["recompute"] - t["load"]
    return timing.rank_bytes_per_token / spare / 1e9 if spare > 0 else None


def break_even_gbps(
    ttft_at: Callable[[float], Any], baseline: dict[str, float], *, lo: float = 1e-3, hi: float = _FASTEST_GBPS
) -> float | None:
    """The smallest bandwidth (GB/s) at which ``ttft_at(gbps)`` (per-request TTFTs) is no
    worse than ``baseline`` on any metric; ``None`` if not even at ``hi``. ``ttft_at`` must
    be non-increasing in the bandwidth for every request (a faster link never slows a
    request), which makes every metric monotone: bisection on a log scale, to 1e-6
    relative. ``O(60 x ttft_at)``."""

    def ok(gbps: float) -> bool:
        return not worse_metrics(ttft_metrics(ttft_at(gbps)), baseline)

    if not ok(hi):
        return None
    if ok(lo):
        return lo
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-6:
            break
    return hi


def round_up(x: float, digits: int = 2) -> float:
    """``x`` rounded up to ``digits`` significant digits.

    >>> round_up(3.4412), round_up(45.0), round_up(0.01234)
    (3.5, 45.0, 0.013)
    """
    if x <= 0:
        return x
    scale = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return round(math.ceil(x / scale * (1 - 1e-12)) * scale, 12)


def explain(
    timing: TimingModel,
    input_tokens: Any,
    device_hit: Any,
    host_hit: Any,
    l3_hit: Any,
    *,
    remedies: Remedies = SIM_REMEDIES,
) -> list[Finding]:
    """The tiers that make estimated TTFT worse than the cheaper layout without them (module
    docstring), L3 first; empty when every tier helps or breaks even. Arrays per request,
    as :meth:`TimingModel.ttft` takes them. ``O(requests x 60)`` per finding."""
    inputs = np.asarray(input_tokens, dtype=np.float64)
    device, host, l3 = (np.asarray(x, dtype=np.float64) for x in (device_hit, host_hit, l3_hit))
    zero = np.zeros_like(device)
    with_l3 = ttft_metrics(timing.ttft(inputs, device, host, l3))
    no_l3 = ttft_metrics(timing.ttft(inputs, device, host, zero))
    device_only = ttft_metrics(timing.ttft(inputs, device, zero, zero))
    no_cache = ttft_metrics(timing.ttft(inputs, zero, zero, zero))
    findings = []
    if l3.any() and worse_metrics(with_l3, no_l3):
        findings.append(_l3_finding(timing, (inputs, device, host, l3), with_l3, no_l3, no_cache, remedies))
    if host.any() and worse_metrics(no_l3, device_only):
        findings.append(_host_finding(timing, (inputs, device, host), no_l3, device_only, no_cache, remedies))
    return findings


def _l3_finding(
    timing: TimingModel,
    hits: tuple[np.ndarray, ...],
    with_l3: dict[str, float],
    no_l3: dict[str, float],
    no_cache: dict[str, float],
    remedies: Remedies,
) -> Finding:
    link = timing.l3

    def ttft_with(new: Link) -> Any:
        return replace(timing, l3=new).ttft(*hits)

    def fixes(new: Link) -> bool:
        return not worse_metrics(ttft_metrics(ttft_with(new)), no_l3)

    be = break_even_gbps(lambda gbps: ttft_with(Link(link.name, gbps, link.latency_us)), no_l3)
    t = per_token_seconds(timing)
    kv = _kib(timing.rank_bytes_per_token)
    costs = f"a token's {kv} KV takes {_us(t['fetch'])} over {_link(link)} + {_us(t['load'])} over PCIe"
    pays = f"; L3 pays above {be:.3g} GB/s" if be is not None else "; no L3 bandwidth pays"
    if t["fetch"] + t["load"] >= t["recompute"]:
        cause = f"L3 link ({link.name}, {link.bandwidth_gbps:g} GB/s) slower than recomputing"
        reason = f"{costs} vs {_us(t['recompute'])} to recompute{pays}"
    else:
        cause = f"L3 link's {link.latency_us:g} us per fetch and exposed PCIe loads outweigh short hits"
        per_hit = float(hits[3][hits[3] > 0].mean())
        reason = (
            f"{costs} vs {_us(t['recompute'])} to recompute, but the {link.latency_us:g} us per fetch and the "
            f"host loads no longer hidden under recompute outweigh {per_hit:,.0f} tokens per L3 hit{pays}"
        )
    options = []
    if be is not None and remedies.l3_gbps:
        options.append(f"{remedies.l3_gbps} {round_up(be):g}")
    rdma = LINKS["rdma"]
    if remedies.l3_link and link.name != rdma.name and rdma.bandwidth_gbps > link.bandwidth_gbps and fixes(rdma):
        options.append(f"{remedies.l3_link} rdma ({rdma.bandwidth_gbps:g} GB/s)")
    if remedies.drop_l3:
        options.append(remedies.drop_l3)
    return Finding(
        tier="L3",
        scenario="all_tiers",
        baseline="no_l3",
        worse={m: (with_l3[m], no_l3[m]) for m in worse_metrics(with_l3, no_l3)},
        no_cache={m: no_cache[m] for m in worse_metrics(with_l3, no_cache)},
        cause=cause + (f", break-even {be:.3g} GB/s" if be is not None else ""),
        reason=reason,
        options=tuple(options),
        break_even_gbps=be,
    )


def _host_finding(
    timing: TimingModel,
    hits: tuple[np.ndarray, ...],
    no_l3: dict[str, float],
    device_only: dict[str, float],
    no_cache: dict[str, float],
    remedies: Remedies,
) -> Finding:
    inputs, device, host = hits
    zero = np.zeros_like(device)
    link = timing.pcie

    def ttft_with(**changes: Any) -> Any:
        return replace(timing, **changes).ttft(inputs, device, host, zero)

    def fixes(**changes: Any) -> bool:
        return not worse_metrics(ttft_metrics(ttft_with(**changes)), device_only)

    be = break_even_gbps(lambda gbps: ttft_with(pcie=Link(link.name, gbps, link.latency_us)), device_only)
    t = per_token_seconds(timing)
    kv = _kib(timing.rank_bytes_per_token)
    exposed = "all of it exposed: no layer-wise overlap" if not timing.layerwise else "not all hidden by compute"
    reason = (
        f"a token's {kv} KV takes {_us(t['load'])} over {_link(link)} ({exposed}) vs {_us(t['recompute'])} "
        "to recompute" + (f"; the host pays above {be:.3g} GB/s" if be is not None else "")
    )
    options = []
    if not timing.layerwise and remedies.layerwise and fixes(layerwise=True):
        options.append(remedies.layerwise)
    if be is not None and remedies.pcie_gbps:
        options.append(f"{remedies.pcie_gbps} {round_up(be):g}")
    pcie5 = LINKS["pcie5"]
    if remedies.host_link and link.bandwidth_gbps < pcie5.bandwidth_gbps and fixes(pcie=pcie5):
        options.append(f"{remedies.host_link} pcie5")
    if remedies.drop_host:
        options.append(remedies.drop_host)
    return Finding(
        tier="host",
        scenario="no_l3",
        baseline="device_only",
        worse={m: (no_l3[m], device_only[m]) for m in worse_metrics(no_l3, device_only)},
        no_cache={m: no_cache[m] for m in worse_metrics(no_l3, no_cache)},
        cause=f"host link ({link.name}, {link.bandwidth_gbps:g} GB/s) slower than recomputing"
        + (f", break-even {be:.3g} GB/s" if be is not None else ""),
        reason=reason,
        options=tuple(options),
        break_even_gbps=be,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:,.4g} KiB"


def _link(link: Link) -> str:
    return f"{link.name} at {link.bandwidth_gbps:g} GB/s"


def _or(options: tuple[str, ...]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]
