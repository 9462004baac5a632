"""The timing model against hand-computed numbers, the L3 fields of the replay records,
and the outputs: summary, JSON, PNG plots, the HTML report, and the CLI writing them
all. Workloads are a few hundred generated requests, fast under either tree."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hiradix.cli import main
from hiradix.sim import Replayer, ReplayStats, Served
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.replay import RequestRecord
from hiradix.sim.report import PLOTS, html_report, render_plots, summary, to_json, write_html, write_plots
from hiradix.sim.run import Timeline, simulate
from hiradix.sim.timing import LINKS, MODELS, Link, ModelShape, TimingModel

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------ timing model
@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        ("llama-3-8b", "bf16", 2 * 32 * 8 * 128 * 2),  # 131,072
        ("llama-3-8b", "fp8", 2 * 32 * 8 * 128 * 1),
        ("llama-3-70b", "bf16", 2 * 80 * 8 * 128 * 2),  # 327,680
        ("llama-3-70b", "fp32", 2 * 80 * 8 * 128 * 4),
        ("deepseek-v3", "bf16", 61 * (512 + 64) * 2),  # 70,272: one latent, no separate V
    ],
)
def test_kv_bytes_per_token_from_the_model_shape(model: str, dtype: str, expected: int) -> None:
    assert MODELS[model].with_dtype(dtype).bytes_per_token == expected


def test_model_shape_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        MODELS["llama-3-8b"].with_dtype("int3")
    with pytest.raises(ValueError, match="kv_heads must be 1"):
        ModelShape("x", layers=2, kv_heads=2, head_dim=8, active_params=1e9, mla=True)
    with pytest.raises(ValueError, match="does not divide"):
        TimingModel(model=MODELS["llama-3-8b"], tp=3)


def test_prefill_rate_from_flops() -> None:
    # 989 TFLOPS x 0.4 MFU / (2 x 8.03e9 FLOPs per token) = 24,632.6 tokens/s per rank.
    assert TimingModel().prefill_rate == pytest.approx(989e12 * 0.4 / (2 * 8.03e9))
    assert TimingModel(model=MODELS["deepseek-v3"], tp=8).prefill_rate == pytest.approx(8 * 989e12 * 0.4 / 74e9)
    assert TimingModel(prefill_tokens_per_s=1234).prefill_rate == 1234


def plain(**kw: Any) -> TimingModel:
    """Round numbers: 20k tokens/s, no overhead, PCIe 25 GB/s with no latency, an L3
    link of 5 GB/s and 100 us, llama-3-8b (131,072 B/token, 32 layers)."""
    defaults: dict[str, Any] = dict(
        prefill_tokens_per_s=20_000, overhead_ms=0, pcie=Link("p", 25, 0), l3=Link("l", 5, 100), layerwise=False
    )
    return TimingModel(**{**defaults, **kw})


def test_ttft_by_hand() -> None:
    """10,000 prompt tokens: 2,000 on the device, 4,000 on the host, 1,000 in L3."""
    bpt = 131_072
    compute = 3000 / 20_000  # 0.15 s
    load = 5000 * bpt / 25e9  # host + L3 tokens over PCIe: 0.0262144 s
    fetch = 100e-6 + 1000 * bpt / 5e9  # 0.0263144 s
    assert plain().ttft(10_000, 2000, 4000, 1000)[()] == pytest.approx(compute + load + fetch)  # 0.2025288
    # Layer-wise: the load hides under the compute but for one layer's share.
    assert plain(layerwise=True).ttft(10_000, 2000, 4000, 1000)[()] == pytest.approx(compute + load / 32 + fetch)
    # A load longer than the compute: only the excess (plus one layer) is exposed.
    one = 1 / 20_000
    long_load = 1000 * bpt / 25e9
    expected = one + (long_load - one) + long_load / 32
    assert plain(layerwise=True).ttft(1000, 0, 1000, 0)[()] == pytest.approx(expected)
    # A full device hit still computes one token; the overhead is added to everything.
    assert plain(overhead_ms=5).ttft(100, 100, 0, 0)[()] == pytest.approx(0.005 + one)


def test_scenarios_recompute_the_tiers_they_drop() -> None:
    estimate = plain().estimate([10_000, 1000], [2000, 0], [4000, 1000], [1000, 0])
    bpt = 131_072
    first = {
        "all_tiers": 0.15 + 5000 * bpt / 25e9 + 100e-6 + 1000 * bpt / 5e9,
        "no_l3": 4000 / 20_000 + 4000 * bpt / 25e9,
        "device_only": 8000 / 20_000,
        "no_cache": 10_000 / 20_000,
    }
    for name, value in first.items():
        assert estimate.ttft[name][0] == pytest.approx(value), name
    assert estimate.ttft["no_cache"][1] == pytest.approx(1000 / 20_000)
    assert estimate.throughput("no_cache") == pytest.approx(11_000 / (0.5 + 0.05))  # = the prefill rate
    p = estimate.percentiles("device_only", (0, 50, 100))
    assert p == pytest.approx({"p0": 0.05, "p50": 0.225, "p100": 0.4})


def test_tensor_parallel_shards_mha_and_replicates_mla() -> None:
    mha = TimingModel(model=MODELS["llama-3-70b"], tp=4)
    assert mha.rank_bytes_per_token == 327_680 / 4 and mha.moved_bytes_per_token == 327_680
    wide = TimingModel(model=MODELS["llama-3-70b"], tp=16)  # 16 ranks, 8 KV heads: each head twice
    assert wide.rank_bytes_per_token == 327_680 / 8 and wide.moved_bytes_per_token == 2 * 327_680
    mla = TimingModel(model=MODELS["deepseek-v3"], tp=8)
    assert mla.rank_bytes_per_token == 70_272 and mla.moved_bytes_per_token == 8 * 70_272
    # Per-rank bytes set the transfer time: 4 ranks load a 70B host hit as fast as one rank 1/4 of it.
    t = dataclasses.replace(mha, prefill_tokens_per_s=1e12, overhead_ms=0, layerwise=False, pcie=Link("p", 10))
    assert t.ttft(1001, 0, 1000, 0)[()] == pytest.approx(1e-12 + 1000 * 327_680 / 4 / 10e9)


def test_bytes_moved_per_tier() -> None:
    stats = ReplayStats(load_back_tokens=10, backup_tokens=20, l3_hit_tokens=3, l3_write_tokens=4)
    moved = TimingModel(model=MODELS["llama-3-8b"]).bytes_moved(stats)
    assert moved == {
        "host_to_device": 10 * 131_072,
        "device_to_host": 20 * 131_072,
        "l3_to_host": 3 * 131_072,
        "host_to_l3": 4 * 131_072,
    }


def test_link_presets_and_zero_transfers() -> None:
    assert LINKS["pcie5"].seconds(0) == 0.0
    assert LINKS["tcp"].seconds(2.5e9) == pytest.approx(1 + 50e-6)
    assert np.array_equal(LINKS["disk"].seconds(np.array([0, 0])), [0.0, 0.0])
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link("x", 0)


# -------------------------------------------------------------- L3 fields of the replay
def test_served_defaults_keep_old_callers_working() -> None:
    served = Served(5, 3, True)
    assert (served.l3_hit, served.prefetch) == (0, "")
    with pytest.raises(ValueError, match="prefetch must be"):
        Served(0, 0, True, prefetch="maybe")


class FakeL3Replayer(Replayer):
    """Stands in for the coming cache with an L3: reports up to 512 missed tokens of
    each request as an L3 hit, with alternating prefetch outcomes."""

    def serve(self, prompt: np.ndarray) -> Served:
        served = super().serve(prompt)
        l3 = min(len(prompt) - served.device_hit - served.host_hit, 512)
        outcome = "completed" if self.stats.requests % 2 else "partial"
        return dataclasses.replace(served, l3_hit=l3, prefetch=outcome if l3 else "")


def test_l3_hits_and_prefetch_outcomes_are_counted_and_reported(tree_cls: Any) -> None:
    workload = ChatWorkload(requests=50, seed=1)
    timeline = Timeline()
    replayer = FakeL3Replayer(tree_cls, device_tokens=20_000, host_tokens=40_000)
    stats = replayer.replay(workload, timeline)
    columns = timeline.arrays()
    assert stats.l3_hit_tokens == int(columns["l3_hit"].sum()) > 0
    assert stats.l3_hit_blocks > 0
    assert stats.prefetch_completed + stats.prefetch_partial == int(np.count_nonzero(columns["l3_hit"]))
    assert (
        stats.miss_tokens == stats.prompt_tokens - stats.device_hit_tokens - stats.host_hit_tokens - stats.l3_hit_tokens
    )
    assert stats.rates()["l3_token_hit_rate"] == stats.l3_hit_tokens / stats.prompt_tokens


def test_the_observer_sees_every_request_with_occupancy(tree_cls: Any) -> None:
    records: list[RequestRecord] = []
    replayer = Replayer(tree_cls, device_tokens=20_000, host_tokens=40_000)
    stats = replayer.replay(ChatWorkload(requests=60, seed=2), records.append)
    assert len(records) == stats.requests == 60
    assert sum(r.served.device_hit for r in records) == stats.device_hit_tokens
    assert all(r.device_used <= 20_000 and r.host_used <= 40_000 and r.l3_used == 0 for r in records)
    assert (records[-1].device_used, records[-1].host_used) == (
        replayer.occupancy()["device_used"],
        replayer.occupancy()["host_used"],
    )


# --------------------------------------------------------------------------- outputs
@pytest.fixture(scope="module")
def result() -> Any:
    return simulate(ChatWorkload(requests=200, seed=5), device_tokens=20_000, host_tokens=100_000, l3_backend=None)


def test_summary_and_json(result: Any) -> None:
    text = summary(result)
    for needle in ("chat workload (seed 5), 200 requests", "device hit", "host hit", "L3 hit", "ideal (infinite)",
                   "all tiers", "without L3", "device only", "no cache", "bytes moved", "not applicable"):  # fmt: skip
        assert needle in text, needle
    data = json.loads(json.dumps(to_json(result)))
    assert data["stats"]["requests"] == 200 and data["workload"]["workload"] == "chat"
    assert data["prefetch"] == {"applicable": False, "completed": 0, "partial": 0, "failed": 0}
    assert set(data["timing"]["scenarios"]) == {"all_tiers", "no_l3", "device_only", "no_cache"}
    assert data["bytes_moved"]["host_to_device"] == result.stats.load_back_tokens * 131_072
    p = data["timing"]["scenarios"]["all_tiers"]
    assert p["p50_s"] <= p["p90_s"] <= p["p99_s"]
    assert data["timing"]["scenarios"]["no_cache"]["mean_s"] >= p["mean_s"]


def test_plots_and_html_are_self_contained(result: Any, tmp_path: Path) -> None:
    rendered = render_plots(result)
    paths = write_plots(result, tmp_path / "plots", rendered)
    assert [p.name for p in paths] == [f"{name}.png" for name in PLOTS]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    page = write_html(result, tmp_path / "report.html", rendered).read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(PLOTS) and all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    assert "http://" not in page and "https://" not in page  # nothing fetched when opened
    assert page == html_report(result, rendered)


# ------------------------------------------------------------------------------ CLI
def test_cli_writes_json_plots_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    argv = ["sim", "--workload", "chat", "--limit", "150", "--seed", "3", "--device-tokens", "20k"]
    argv += ["--host-tokens", "100k", "--model", "deepseek-v3", "--tp", "8", "--l3-link", "tcp", "--no-progress"]
    assert main([*argv, "--json", str(out), "--plots", str(tmp_path / "p"), "--html", str(tmp_path / "r.html")]) == 0
    data = json.loads(out.read_text())
    assert data["stats"]["requests"] == 150 and data["workload"] == json.loads(
        json.dumps(ChatWorkload(150, 3).describe())
    )
    model = data["timing"]["model"]
    assert (model["model"], model["kv_bytes_per_token"], model["tp"], model["l3"]["name"]) == (
        "deepseek-v3",
        70_272,
        8,
        "tcp",
    )
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted(f"{n}.png" for n in PLOTS)
    assert (tmp_path / "r.html").read_text().count("data:image/png;base64,") == len(PLOTS)
    text = capsys.readouterr().out
    assert "chat workload (seed 3), 150 requests" in text and "deepseek-v3 bf16 MLA" in text


def test_cli_replays_an_azure_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{10 + i:02d}.0000000,{500 + 300 * i},20" for i in range(20)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert main(["sim", "--workload", "azure-code", "--trace", str(path), "--no-progress"]) == 0
    assert "azure-code (azure.csv, seed 0), 20 requests" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "azure-conv", "--trace", "/nonexistent.csv"], "trace not found: /nonexistent.csv"),
        (["--workload", "azure-conv", "--trace", "BADCSV"], ":2: negative token count"),
        (["--workload", "chat", "--tp", "3"], "does not divide"),
        (["--workload", "chat", "--html", "/nonexistent/r.html"], "its folder does not exist"),
        (["--workload", "chat", "--model", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["--workload", "chat", "--prefill-tps", "0"], "expected a number > 0"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-1,44\n")
    argv = [str(bad) if a == "BADCSV" else a for a in argv]
    try:
        status = main(["sim", *argv, "--limit", "20", "--no-progress"])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
