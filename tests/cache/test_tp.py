"""Two ranks over torch.distributed (gloo, CPU, loopback) with asymmetric faults: one
rank's host allocations fail at random, the other's backup copies fail now and then. With
agreement the run completes (no hang) and both trees are identical; without it the same
faults make them diverge, which is what the agreement is for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.cache import tp_worker
from tests.support import OPS, run_ranks

pytestmark = pytest.mark.slow  # multi-process tensor-parallel caches

WORLD = 2
TIMEOUT_S = 240  # the run takes seconds; past this it has hung


def _run(tmp_path: Path, target: Any = tp_worker.rank_main, **overrides: Any) -> list[dict[str, Any]]:
    config = {
        "agree": True,
        "page": 4,
        "device": 128,
        "host": 192,
        "policy": "lru",
        "write_policy": "write_through",
        "faulty_rank": 1,
        "fail_rate": 0.2,
        "steps": 300,
        "seed": 7,
    } | overrides
    return run_ranks(target, WORLD, tmp_path, config, TIMEOUT_S)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_two_ranks_with_asymmetric_faults_stay_identical(tmp_path: Path, write_policy: str) -> None:
    r0, r1 = _run(tmp_path, write_policy=write_policy)
    OPS["tp_loop_steps"] += r0["stats"]["steps"]
    assert r1["host_alloc_faults"] > 0 and r0["host_alloc_faults"] == 0, "faults were asymmetric"
    assert r0["copy_faults"] > 0 and r1["copy_faults"] == 0
    assert r0["agreement_calls"] == r1["agreement_calls"] > 0, "the ranks made different collectives"
    assert r0["fingerprint"] == r1["fingerprint"], "trees diverged"
    assert (r0["nodes"], r0["host_size"], r0["device_size"]) == (r1["nodes"], r1["host_size"], r1["device_size"])
    assert r0["stats"] == r1["stats"]
    assert r0["stats"]["invariant_checks"] == 300


def test_without_agreement_the_same_faults_make_trees_diverge(tmp_path: Path) -> None:
    """The control: the same run with each rank deciding alone (no collectives at all)."""
    r0, r1 = _run(tmp_path, agree=False)
    assert r1["host_alloc_faults"] > 0
    assert r0["fingerprint"] != r1["fingerprint"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_two_ranks_agree_on_l3_hit_length(tmp_path: Path) -> None:
    """Rank 1's L3 lacks pages rank 0 has: both load only what both have."""
    r0, r1 = _run(tmp_path, target=tp_worker.l3_rank_main)
    assert r0["loaded"] == r1["loaded"]
    assert r0["loaded"][0] == r0["loaded"][2] == 160  # both ranks hold these whole
    assert r0["loaded"][1] == 5 * 16  # MIN: rank 1 stops after 5 pages
    assert r0["loaded"][3] == 0  # rank 1 has none: revoked on both
    assert r0["fingerprint"] == r1["fingerprint"] and r0["host_size"] == r1["host_size"]
