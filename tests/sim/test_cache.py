"""The replayer goes through HiRadixCache with all three tiers: L3 hits and prefetches
happen at small capacities with the cache's invariants checked along the way, the
memory and file backends serve the same hits, replays are deterministic, capacities
order the hits as they should, and the CLI runs with an L3 tier end to end.

Uses the first few hundred requests of ``../shared/traces/conversation_trace.jsonl``
(skips, saying so, when it is missing) and generated workloads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hiradix.cache import HiRadixCache
from hiradix.cli import SHARED_TRACE, TRACE_ENV, main
from hiradix.sim import MooncakeTrace, Replayer
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.report import PLOTS

pytestmark = pytest.mark.slow  # replays of the conversation trace through the cache with an L3

TRACE = Path(os.environ.get(TRACE_ENV) or SHARED_TRACE)
needs_trace = pytest.mark.skipif(
    not TRACE.is_file(), reason=f"the Mooncake conversation trace is not at {TRACE} (set ${TRACE_ENV})"
)
PUREPYTHON = os.environ.get("HIRADIX_PUREPYTHON", "") not in ("", "0")
SMALL = {"device_tokens": 300_000, "host_tokens": 1_000_000}


def replay(limit: int, tree_cls: Any = None, **options: Any) -> tuple[Replayer, Any]:
    with Replayer(tree_cls, **{**SMALL, **options}) as replayer:
        stats = replayer.replay(MooncakeTrace(TRACE, limit=limit))
    return replayer, stats


@needs_trace
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_small_capacities_exercise_every_tier_with_l3(tree_cls: Any, write_policy: str) -> None:
    """Device, host and L3 all serve hits, prefetches complete, and the cache's invariants
    (tree and slot conservation in both pools) hold every 10 requests."""
    replayer, stats = replay(
        600, tree_cls, write_policy=write_policy, l3_backend="memory", l3_tokens=4_000_000, check_every=10
    )
    assert isinstance(replayer.cache, HiRadixCache)
    assert stats.requests == 600 and stats.too_large_requests == 0
    assert stats.device_hit_tokens > 0 and stats.host_hit_tokens > 0 and stats.l3_hit_tokens > 0
    assert stats.prefetch_completed > 0 and stats.prefetch_issued >= stats.prefetch_completed
    assert stats.prefetch_failed == stats.prefetch_partial == 0  # waited for, from memory: never short
    assert stats.load_back_tokens == stats.host_hit_tokens + stats.l3_hit_tokens
    assert stats.l3_write_tokens > 0 and stats.host_evicted_tokens > 0 and stats.device_demoted_tokens > 0
    assert stats.device_hit_tokens + stats.host_hit_tokens + stats.l3_hit_tokens <= stats.ideal_hit_tokens
    assert replayer.cache.stats["prefetch_loaded_tokens"] >= stats.l3_hit_tokens
    config = replayer.config()
    assert (config["l3_backend"], config["l3_tokens"], config["prefetch_policy"]) == (
        "memory",
        4_000_000,
        "best_effort",
    )
    assert config["cache"] == "hiradix.cache.cache.HiRadixCache"


@needs_trace
def test_replays_are_deterministic_and_the_file_backend_serves_the_same_hits(tmp_path: Path) -> None:
    """Copies run inline and the replayer waits for the L3 threads, so two replays give
    the same counters; a file-backed L3 (unbounded, like the memory one here) holds the
    same pages and so serves the same hits."""
    runs = [replay(300, l3_backend="memory")[1], replay(300, l3_backend="memory")[1]]
    runs.append(replay(300, l3_backend="file", l3_path=str(tmp_path / "l3"))[1])
    assert runs[0].l3_hit_tokens > 0
    assert runs[0] == runs[1] == runs[2]
    assert any((tmp_path / "l3").iterdir())


@needs_trace
def test_more_l3_never_hits_less_in_l3() -> None:
    """On a fixed slice with fixed device and host, a larger L3 serves at least as many L3
    tokens (LRU storage; the prefetches and their host evictions are the same)."""
    hits = [replay(500, l3_backend="memory", l3_tokens=cap)[1].l3_hit_tokens for cap in (250_000, 1_000_000, None)]
    assert hits == sorted(hits) and hits[0] < hits[-1], hits


@needs_trace
def test_without_waiting_best_effort_keeps_the_invariants() -> None:
    """``prefetch_wait=False``: best_effort ends each prefetch at once with what landed;
    hits depend on thread timing, the cache stays consistent."""
    replayer, stats = replay(200, l3_backend="memory", prefetch_wait=False, check_every=20)
    assert stats.requests == 200
    assert stats.prefetch_issued > 0
    assert replayer.config()["prefetch_wait"] is False


def test_wait_complete_policy_on_a_generated_workload() -> None:
    with Replayer(device_tokens=20_000, host_tokens=40_000, l3_backend="memory", prefetch_policy="wait_complete") as r:
        stats = r.replay(ChatWorkload(requests=200, seed=4))
    assert stats.l3_hit_tokens > 0 and stats.prefetch_completed > 0
    assert r.occupancy()["l3_used"] == 0  # detached on close


def test_no_host_tier_without_l3_deletes_every_eviction() -> None:
    with Replayer(device_tokens=20_000, host_tokens=0, check_every=10) as r:
        stats = r.replay(ChatWorkload(requests=100, seed=4))
    assert stats.host_hit_tokens == stats.l3_hit_tokens == stats.backup_tokens == 0
    assert stats.device_deleted_tokens > 0 and r.config()["l3_backend"] is None


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="prefetch policy"):
        Replayer(prefetch_policy="eventually")
    with pytest.raises(ValueError, match="l3_backend"):
        Replayer(l3_backend="tape")
    with pytest.raises(ValueError, match="device_tokens"):
        Replayer(device_tokens=-1)
    with pytest.raises(ValueError, match="needs a host tier"):
        Replayer(host_tokens=0, l3_backend="memory")
    with pytest.raises(ValueError, match="would be ignored"):
        Replayer(l3_tokens=1000)
    with pytest.raises(ValueError, match="file backend"):
        Replayer(l3_backend="memory", l3_path="/tmp")


@needs_trace
def test_cli_with_l3_writes_json_plots_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    argv = ["sim", "--trace", str(TRACE), "--limit", "300", "--device-tokens", "300k", "--host-tokens", "1M"]
    argv += ["--l3-tokens", "4M", "--prefetch-policy", "timeout", "--no-progress", "--check-invariants-every", "100"]
    assert main([*argv, "--json", str(out), "--plots", str(tmp_path / "p"), "--html", str(tmp_path / "r.html")]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["l3_backend"] == "memory" and data["config"]["l3_tokens"] == 4_000_000
    assert data["config"]["prefetch_policy"] == "timeout"
    assert data["stats"]["l3_hit_tokens"] > 0 and data["prefetch"]["applicable"] is True
    assert data["bytes_moved"]["host_to_l3"] == data["stats"]["l3_write_tokens"] * 131_072 > 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted(f"{n}.png" for n in PLOTS)
    assert (tmp_path / "r.html").read_text().count("data:image/png;base64,") == len(PLOTS)
    text = capsys.readouterr().out
    assert "L3 memory 4M tokens (" in text and "GiB), prefetch timeout" in text and "L3 hit" in text


def test_cli_l3_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--workload", "chat", "--limit", "80", "--device-tokens", "20k", "--host-tokens", "40k"]
    assert main([*argv, "--l3-backend", "none", "--no-progress"]) == 0
    assert "no L3 tier" in capsys.readouterr().out
    assert main([*argv, "--l3-backend", "file", "--l3-path", str(tmp_path / "l3"), "--no-progress"]) == 0
    assert "L3 file" in capsys.readouterr().out and (tmp_path / "l3").is_dir()
    assert main([*argv, "--l3-path", str(tmp_path), "--no-progress"]) == 2
    assert "l3_path is for the file backend (--l3-backend file)" in capsys.readouterr().err
