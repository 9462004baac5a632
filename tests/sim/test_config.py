"""SimConfig: sizes in tokens and bytes, GPU sizing of the device tier, and every
configuration error and warning, through the Python API and the CLI."""

from __future__ import annotations

import pytest

from hiradix.cli import main
from hiradix.sim.config import (
    GIB,
    GPUS,
    ConfigError,
    SimConfig,
    SimWarning,
    Size,
    sglang_mem_fraction_static,
)
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.run import simulate
from hiradix.sim.timing import LINKS

LLAMA8B_TOKEN = 131_072  # bytes of KV per token, bf16, one rank


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2M", Size(tokens=2_000_000)),
        ("500k", Size(tokens=500_000)),
        ("64GiB", Size(nbytes=64 * GIB)),
        ("80GB", Size(nbytes=80 * 10**9)),
        ("1.5TiB", Size(nbytes=int(1.5 * (1 << 40)))),
        ("inf", Size()),
        ("auto", Size(auto=True)),
    ],
)
def test_sizes_parse(text: str, size: Size) -> None:
    assert Size.parse(text) == size


@pytest.mark.parametrize("text", ["2X", "-5", "1.5", "GiB", "12 parsecs", ""])
def test_bad_sizes_are_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        Size.parse(text)


def test_bytes_turn_into_tokens_per_gpu_for_device_and_host_and_for_all_ranks_for_l3() -> None:
    r = SimConfig(device_tokens="16GiB", host_tokens="64GiB", l3_tokens="1TiB").resolve()
    assert r.device_tokens == 16 * GIB // LLAMA8B_TOKEN == 131_072
    assert r.host_tokens == 64 * GIB // LLAMA8B_TOKEN
    assert r.l3_tokens == (1 << 40) // LLAMA8B_TOKEN
    # TP 4 shards llama-3-8b's 8 KV heads: a rank holds a quarter of each token, so the
    # same GiB per GPU hold 4x the tokens; the L3 holds every rank's shard.
    r4 = SimConfig(tp=4, device_tokens="16GiB", l3_tokens="1TiB").resolve()
    assert r4.device_tokens == 4 * r.device_tokens and r4.l3_tokens == r.l3_tokens


def test_gpu_sizes_the_device_tier_from_memory_fraction_and_weights() -> None:
    assert sglang_mem_fraction_static(GPUS["h100"]) == 0.835
    r = SimConfig().resolve()  # auto on an H100, llama-3-8b bf16, TP 1
    kv = GPUS["h100"].memory_bytes * 0.835 - 8.03e9 * 2
    assert r.device_fit_tokens == int(kv // LLAMA8B_TOKEN)
    assert r.device_tokens == r.device_fit_tokens // 16 * 16 and 400_000 < r.device_tokens < 450_000
    assert r.host_tokens == 2 * r.device_tokens  # SGLang's default hicache ratio
    assert r.warnings == ()
    h200 = SimConfig(gpu="h200").resolve()
    assert h200.device_tokens > 2 * r.device_tokens
    half = SimConfig(mem_fraction_static=0.5).resolve()
    assert half.device_tokens < r.device_tokens


def test_a_device_tier_that_does_not_fit_warns_with_its_gib() -> None:
    r = SimConfig(device_tokens=2_000_000).resolve()
    assert r.device_tokens == 2_000_000  # kept: a what-if is allowed, but not silently
    (note,) = r.warnings
    assert "does not fit on h100" in note and "244 GiB" in note and "auto" in note


def test_weights_that_leave_no_room_are_an_error_for_auto() -> None:
    with pytest.raises(ConfigError, match="cannot be sized"):
        SimConfig(model="deepseek-v3", tp=8).resolve()  # 671 GB of fp8 weights over 8 x 80 GiB
    assert SimConfig(model="deepseek-v3", tp=8, gpu="h200").resolve().device_tokens > 0


def test_host_not_larger_than_device_warns_about_inclusion() -> None:
    (note,) = SimConfig(device_tokens=100_000, host_tokens=100_000).resolve().warnings
    assert "inclusive" in note
    assert SimConfig(device_tokens=100_000, host_tokens=0, l3_backend=None).resolve().warnings == ()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"host_tokens": 0}, "an L3 tier needs a host tier"),
        ({"l3_backend": None, "l3_tokens": 1000}, r"l3_tokens \(--l3-tokens\) set without an L3 tier"),
        ({"l3_backend": None, "prefetch_policy": "timeout"}, "prefetch_policy"),
        ({"l3_backend": None, "prefetch_wait": False}, "--no-prefetch-wait"),
        ({"l3_backend": None, "l3_link": "rdma"}, "l3_link"),
        ({"l3_path": "/tmp"}, "file backend"),
        ({"gpu": "tpu"}, "unknown GPU"),
        ({"device_tokens": 8}, "holds no page"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ],
)
def test_configuration_errors(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig().replace(**settings).resolve()


def test_unknown_settings_are_errors() -> None:
    with pytest.raises(ConfigError, match="unknown simulation setting"):
        SimConfig().replace(device=5)


def test_l3_link_follows_the_backend() -> None:
    assert SimConfig().timing_model().l3 == LINKS["tcp"]
    assert SimConfig(l3_backend="file").timing_model().l3 == LINKS["disk"]
    assert SimConfig(l3_link="rdma").timing_model().l3 == LINKS["rdma"]


def test_simulate_shares_the_defaults_warns_and_refuses_an_empty_workload() -> None:
    with pytest.warns(SimWarning, match="inclusive"):
        result = simulate(ChatWorkload(requests=20, seed=1), device_tokens=20_000, host_tokens=10_000)
    assert result.config["l3_backend"] == "memory" and result.config["l3_tokens"] == SimConfig().l3_tokens
    assert result.timing.timing.l3.name == "tcp" and result.hardware["gpu"] == "h100"
    assert "inclusive" in result.warnings[0]
    with pytest.raises(ValueError, match="empty workload"):
        simulate(ChatWorkload(requests=0, seed=1), device_tokens=20_000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host-tokens", "0"], "error: an L3 tier needs a host tier"),
        (["--l3-backend", "none", "--l3-tokens", "1M"], "error: l3_tokens (--l3-tokens) set without an L3 tier"),
        (["--l3-backend", "none", "--l3-gbps", "3"], "error: --l3-gbps set without an L3 tier"),
        (["--limit", "0"], "error: empty workload"),
        (["--model", "llama-3-70b", "--gpu", "a100-40g"], "error: the device tier cannot be sized"),
        (["--device", "2M"], "warning: the device tier (2M tokens, 244 GiB of KV per GPU) does not fit"),
        (["--device", "100k", "--host", "50k"], "warning: the host tier (50k tokens) is not larger"),
    ],
)
def test_cli_errors_and_warnings(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    status = main(["sim", "--workload", "chat", "--limit", "20", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert status == (2 if "error:" in message else 0)


def test_cli_shows_capacities_in_tokens_and_gib(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "chat", "--limit", "20", "--no-progress", "--device", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "device 131.1k tokens (16 GiB) per GPU, host 262.1k tokens (32 GiB) per GPU" in out
    assert "L3 memory 32M tokens (3.81 TiB)" in out and "GPU           h100 80 GiB" in out
    assert "20 requests" in out
