"""The findings on estimated TTFT (hiradix.sim.advice): a tier that makes TTFT worse than
the layout without it is named, with the reason in the timing model's numbers and options
that, evaluated in the same model, remove it; a tier that helps gets no line. Break-evens
against hand-computed numbers and against the model itself. Workloads are a few hundred
generated requests, fast under either tree."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hiradix.cli import main
from hiradix.sim.advice import (
    METRICS,
    PLAN_REMEDIES,
    break_even_gbps,
    explain,
    per_token_break_even_gbps,
    per_token_seconds,
    round_up,
    ttft_metrics,
    worse_metrics,
)
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.report import findings, html_report, summary, to_json
from hiradix.sim.run import simulate
from hiradix.sim.timing import LINKS, Link, TimingModel

BPT = 131_072  # llama-3-8b bf16, tp 1


def plain(**kw: Any) -> TimingModel:
    """Round numbers: 20k tokens/s (50 us a token), no overhead, PCIe 25 GB/s and an L3
    link of 2 GB/s, both without latency, no layer-wise overlap."""
    defaults: dict[str, Any] = dict(
        prefill_tokens_per_s=20_000, overhead_ms=0, pcie=Link("p", 25, 0), l3=Link("l", 2, 0), layerwise=False
    )
    return TimingModel(**{**defaults, **kw})


def hits(seed: int = 0, n: int = 400) -> tuple[np.ndarray, ...]:
    """Per-request prompt lengths and device / host / L3 hits that add up to at most the prompt."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1_000, 20_000, n)
    device = (inputs * rng.uniform(0, 0.3, n)).astype(np.int64)
    host = (inputs * rng.uniform(0, 0.2, n)).astype(np.int64)
    l3 = (inputs * rng.uniform(0, 0.4, n) * (rng.random(n) < 0.6)).astype(np.int64)
    return inputs, device, host, l3


# ------------------------------------------------------------------------- break-evens
def test_per_token_costs_and_break_even_by_hand() -> None:
    t = per_token_seconds(plain())
    assert t["recompute"] == pytest.approx(50e-6)
    assert t["load"] == pytest.approx(BPT / 25e9)  # 5.24288 us
    assert t["fetch"] == pytest.approx(BPT / 2e9)  # 65.536 us
    # The L3 link at which fetch + load = recompute: 131072 B / (50 - 5.24288) us = 2.92853 GB/s.
    assert per_token_break_even_gbps(plain()) == pytest.approx(BPT / (50e-6 - BPT / 25e9) / 1e9)
    assert per_token_break_even_gbps(plain()) == pytest.approx(2.92853, rel=1e-5)
    # The default model: llama-3-8b at 24,633 tokens/s over PCIe 5: 3.45 GB/s, above TCP's 2.5.
    default = per_token_break_even_gbps(TimingModel())
    assert default == pytest.approx(3.4515, rel=1e-4) and default > LINKS["tcp"].bandwidth_gbps
    # A host link slower than recomputing leaves no L3 bandwidth that pays.
    assert per_token_break_even_gbps(plain(pcie=Link("p", 2, 0))) is None


def test_at_the_per_token_break_even_an_l3_hit_costs_what_recomputing_it_does() -> None:
    be = per_token_break_even_gbps(plain())
    assert be is not None
    at = plain(l3=Link("l", be, 0))
    with_l3 = at.ttft(10_000, 1_000, 2_000, 3_000)[()]
    without = at.ttft(10_000, 1_000, 2_000, 0)[()]
    assert with_l3 == pytest.approx(without, rel=1e-12)
    assert plain(l3=Link("l", be * 1.01, 0)).ttft(10_000, 1_000, 2_000, 3_000)[()] < without
    assert plain(l3=Link("l", be * 0.99, 0)).ttft(10_000, 1_000, 2_000, 3_000)[()] > without


def test_the_run_break_even_is_where_the_tier_stops_costing() -> None:
    """The finding's break-even is the slowest L3 link at which no metric is worse than
    without L3: just above it none is, just below it one is; the option it prints is at
    or above it."""
    timing = TimingModel(l3=LINKS["tcp"])
    inputs, device, host, l3 = hits(1)
    (finding,) = explain(timing, inputs, device, host, l3)
    be = finding.break_even_gbps
    assert be is not None and LINKS["tcp"].bandwidth_gbps < be < LINKS["rdma"].bandwidth_gbps
    without = ttft_metrics(timing.ttft(inputs, device, host, 0 * l3))

    def at(gbps: float) -> dict[str, float]:
        link = Link("tcp", gbps, LINKS["tcp"].latency_us)
        return ttft_metrics(TimingModel(l3=link).ttft(inputs, device, host, l3))

    assert worse_metrics(at(be * (1 + 1e-5)), without) == []
    assert worse_metrics(at(be * (1 - 1e-3)), without) != []
    option = next(o for o in finding.options if o.startswith("--l3-gbps "))
    value = float(option.split()[1])
    assert value >= be and value == round_up(be) and worse_metrics(at(value), without) == []


def test_break_even_bisection_and_rounding() -> None:
    # TTFT = 1 + 10 / gbps against a baseline of 2: equal at exactly 10 GB/s.
    baseline = dict.fromkeys(METRICS, 2.0)
    assert break_even_gbps(lambda g: np.array([1 + 10 / g]), baseline) == pytest.approx(10, rel=1e-5)
    assert break_even_gbps(lambda g: np.array([3.0]), baseline) is None  # no bandwidth is enough
    assert round_up(3.4412) == 3.5 and round_up(3.0) == 3.0 and round_up(0.01234) == 0.013


# ------------------------------------------------------------------------- explain
def test_l3_slower_than_prefill_is_named_with_its_options() -> None:
    timing = TimingModel(l3=LINKS["tcp"])
    findings_ = explain(timing, *hits(2))
    assert [f.tier for f in findings_] == ["L3"]
    f = findings_[0]
    assert f.scenario == "all_tiers" and f.baseline == "no_l3" and f.metric == "mean"
    line = f.line()
    assert line.startswith("L3 tier makes TTFT worse: mean ") and "\n" not in line
    assert "52.4 us over tcp at 2.5 GB/s" in line and "40.6 us to recompute" in line
    assert f"--l3-gbps {round_up(f.break_even_gbps or 0):g}" in line
    assert "--l3-link rdma" in line and line.endswith("or --l3-backend none")
    assert "slower than recomputing" in f.short()


def test_every_tier_helping_gives_no_finding() -> None:
    inputs, device, host, l3 = hits(2)
    timing = TimingModel(l3=LINKS["rdma"])
    assert explain(timing, inputs, device, host, l3) == []
    # ...and it helps indeed: each tier lowers every metric.
    scenarios = [(device, host, l3), (device, host, 0 * l3), (device, 0 * host, 0 * l3)]
    metrics = [ttft_metrics(timing.ttft(inputs, *split)) for split in scenarios]
    assert all(a[m] < b[m] for a, b in itertools.pairwise(metrics) for m in METRICS)
    assert explain(TimingModel(l3=LINKS["tcp"]), inputs, device, host, 0 * l3) == []  # no L3 hits, nothing to say


def test_worse_than_no_cache_is_said() -> None:
    """Long L3 hits over a slow link and nothing on the device: worse than no cache at all."""
    inputs = np.full(50, 8_000)
    zero = np.zeros(50, dtype=np.int64)
    (f,) = explain(TimingModel(l3=LINKS["tcp"]), inputs, zero, zero, inputs - 1_000)
    assert set(f.no_cache) == set(METRICS) and "with no cache" in f.line()


def test_a_link_latency_no_bandwidth_can_pay_for_is_named() -> None:
    """Per token the link is fast, but 20 ms per fetch outweighs 256-token hits: no
    bandwidth pays, and RDMA's 5 us would."""
    inputs, device, host = np.full(40, 4_096), np.zeros(40, dtype=np.int64), np.zeros(40, dtype=np.int64)
    l3 = np.full(40, 256)
    timing = TimingModel(l3=Link("slowlane", 40, 20_000))
    (f,) = explain(timing, inputs, device, host, l3)
    assert f.break_even_gbps is None and "no L3 bandwidth pays" in f.line()
    assert "20000 us per fetch" in f.line() and "256 tokens per L3 hit" in f.line()
    assert f.options == ("--l3-link rdma (45 GB/s)", "--l3-backend none")


def test_a_host_link_slower_than_prefill_is_named_with_its_options() -> None:
    """PCIe at 0.5 GB/s, no layer-wise overlap: a host hit costs more than recomputing."""
    inputs, device, host, l3 = hits(3)
    timing = TimingModel(pcie=Link("pcie4", 0.5, 10), layerwise=False, l3=LINKS["rdma"])
    found = {f.tier: f for f in explain(timing, inputs, device, host, 0 * l3)}
    f = found["host"]
    assert f.scenario == "no_l3" and f.baseline == "device_only"
    assert f.break_even_gbps is not None and f.break_even_gbps > 0.5
    assert f"--pcie-gbps {round_up(f.break_even_gbps):g}" in f.options
    assert "--host-link pcie5" in f.options and "no layer-wise overlap" in f.line()
    # The same in hiradix plan's words: no PCIe options there, the device layout instead.
    (p,) = explain(timing, inputs, device, host, 0 * l3, remedies=PLAN_REMEDIES)
    assert p.options == ("the device layout",)


# ------------------------------------------------------------------------- hiradix sim
@pytest.fixture(scope="module")
def tcp_result() -> Any:
    """A chat workload with a small device and host, so L3 serves a share, over TCP."""
    return simulate(ChatWorkload(requests=300, seed=3), device_tokens=20_000, host_tokens=40_000, l3_link="tcp")


def test_sim_report_names_the_l3_tier_that_costs_ttft(tcp_result: Any) -> None:
    assert tcp_result.stats.l3_hit_tokens > 0
    (f,) = findings(tcp_result)
    lines = [x for x in summary(tcp_result).splitlines() if x.startswith("  finding")]
    assert lines == [f"  finding       {f.line()}"]
    assert "L3 tier makes TTFT worse" in lines[0] and "--l3-gbps" in lines[0] and "--l3-backend none" in lines[0]
    s = tcp_result.timing.summary()
    assert s["all_tiers"]["mean_s"] > s["no_l3"]["mean_s"]  # what the line says
    data = json.loads(json.dumps(to_json(tcp_result)))
    assert [x["tier"] for x in data["findings"]] == ["L3"] and data["findings"][0]["text"] == f.line()
    assert "<p class='finding'>Finding: L3 tier makes TTFT worse" in html_report(tcp_result, rendered={})


def test_sim_report_says_nothing_when_every_tier_helps() -> None:
    result = simulate(ChatWorkload(requests=300, seed=3), device_tokens=20_000, host_tokens=40_000, l3_link="rdma")
    assert result.stats.l3_hit_tokens > 0 and result.stats.host_hit_tokens > 0
    assert findings(result) == [] and "finding" not in summary(result)
    assert to_json(result)["findings"] == [] and "class='finding'" not in html_report(result, rendered={})


def test_cli_sim_following_the_option_removes_the_finding(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--workload", "chat", "--limit", "300", "--seed", "3", "--device-tokens", "20k"]
    argv += ["--host-tokens", "40k", "--l3-link", "tcp", "--no-progress"]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  finding"))
    option = line[line.index("--l3-gbps") :].split(",")[0].split()
    assert main([*argv, *option]) == 0
    out = capsys.readouterr().out
    assert "finding" not in out and "L3 link tcp" in out


# ------------------------------------------------------------------------- hiradix plan
def test_cli_plan_names_a_layout_whose_l3_costs_ttft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hiradix.sim import MooncakeTrace
    from hiradix.sim.curve import CapacityCurve
    from tests.sim.test_curve import random_trace, write_trace

    trace = write_trace(tmp_path / "t.jsonl", random_trace(6, 300))
    target = round(CapacityCurve.from_requests(MooncakeTrace(trace), page_size=16).ideal_token_hit_rate * 0.8, 3)
    base = ["plan", "--trace", str(trace), "--target-hit-rate", str(target), "--no-progress"]
    assert main([*base, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    found = [x for x in out.splitlines() if x.startswith("  finding:")]
    assert len(found) == 1 and found[0].startswith("  finding: device+host+l3: L3 tier makes TTFT worse")
    assert "--l3-link rdma" in found[0] and found[0].endswith("or the device+host layout")
    assert any(x.startswith("  no cache") and "p90 TTFT" in x for x in out.splitlines())
    data = json.loads((tmp_path / "p.json").read_text())
    l3_plan = next(p for p in data["plans"] if p["layout"] == "device+host+l3")
    assert [f["tier"] for f in l3_plan["findings"]] == ["L3"]
    assert l3_plan["ttft_s_metrics"]["mean"] == pytest.approx(l3_plan["findings"][0]["worse_s"]["mean"]["with"])
    assert all(p["findings"] == [] for p in data["plans"] if p["layout"] != "device+host+l3")
    # Over RDMA the same layout helps: no finding.
    assert main([*base, "--l3-link", "rdma"]) == 0
    assert "finding" not in capsys.readouterr().out
