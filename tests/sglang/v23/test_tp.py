"""hiradix.sglang with more than one rank on SGLang 0.5.23: gloo ranks in subprocesses
(:mod:`tests.sglang.v23.rank`), the cache built by 0.5.23's ``create_tree_cache`` with SGLang's
cache groups in ``CacheInitParams`` and driven by 0.5.23's request API (the randomized
scheduler loop, byte checks after every step), while the ranks see different host
capacity, host-allocation failures and L3 hits. With the agreement every rank makes the
same collectives and ends with the same tree; the control run without groups shows the
same differences make them diverge. The pipeline hand-down is checked on its own: it must
use SGLang's tag, so an untagged message between stages is never taken for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.sglang import unified_env as sglang_unified_env  # noqa: F401  (skips this module without SGLang 0.5.20+)
from tests.support import run_ranks

TIMEOUT_S = 300  # a run takes seconds to a minute; past this a collective has hung

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"
)


def _run(tmp_path: Path, world: int = 2, **config: Any) -> list[dict[str, Any]]:
    from tests.sglang.v23 import rank as sglang23_rank

    cfg = {
        "shape": "tp",
        "page": 4,
        "layout": "page_first",
        "write_policy": "write_through",
        "storage": "memory",
        "seed": 11,
        "steps": 80,
        "host_ratio": [2.0] * world,
        "host_faults_rank": 1,
        "l3_faults_rank": 0,
    } | config
    return run_ranks(sglang23_rank.loop_main, world, tmp_path, cfg, TIMEOUT_S)


def _assert_agreed(results: list[dict[str, Any]]) -> None:
    first = results[0]
    assert first["calls"] > 0
    for r in results[1:]:
        assert r["calls"] == first["calls"], "the ranks made different collectives"
        assert r["fingerprint"] == first["fingerprint"], "trees diverged"
        assert r["stats"] == first["stats"]
    s = first["stats"]
    # the loop did what it is for: reuse, loads back, L3 loads, every reused byte checked
    assert s["reused"] > 0 and s["verified"] >= s["reused"] and s["loaded"] > 0, s


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_two_tp_ranks_agree_on_l3_hits_and_host_capacity(tmp_path: Path, write_policy: str) -> None:
    # rank 0's L3 misses pages rank 1 hits; rank 1 has the smaller host pool and its
    # allocations fail at random besides
    results = _run(tmp_path, write_policy=write_policy, host_ratio=[2.0, 1.5])
    r0, r1 = results
    assert r0["l3_cuts"] > 0 and r1["l3_cuts"] == 0, "L3 faults were not asymmetric"
    assert r1["host_failures"] > 0 and r0["host_failures"] == 0, "host faults were not asymmetric"
    assert r1["host_size"] < r0["host_size"]
    _assert_agreed(results)
    assert r0["stats"]["l3_loaded"] > 0, r0["stats"]


def test_four_ranks_agree_over_attention_tp_and_cp_groups(tmp_path: Path) -> None:
    # faults on ranks in different attention-TP and CP groups: only MIN over both reaches
    # every rank
    results = _run(
        tmp_path,
        world=4,
        shape="attn_tp_cp",
        steps=60,
        host_faults_rank=3,
        l3_faults_rank=1,
        host_ratio=[2.0, 2.0, 1.5, 2.0],
    )
    assert results[3]["host_failures"] > 0 and results[1]["l3_cuts"] > 0
    _assert_agreed(results)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_two_pipeline_stages_take_the_first_stages_decisions(tmp_path: Path, write_policy: str) -> None:
    # SGLang's pp_cache_group / pp_rank / pp_size: the first stage's L3 misses pages the
    # second hits and its host allocations fail at random; the second stage receives every
    # agreed outcome from it (under SGLang's PP-sync tag) and ends with the same tree
    results = _run(tmp_path, shape="pp", write_policy=write_policy, host_faults_rank=0, l3_faults_rank=0)
    r0, r1 = results
    assert r0["l3_cuts"] > 0 and r0["host_failures"] > 0, "the first stage's faults did not happen"
    assert r1["l3_cuts"] == r1["host_failures"] == 0
    _assert_agreed(results)
    assert r0["stats"]["l3_loaded"] > 0, r0["stats"]


def test_without_the_groups_the_same_differences_diverge(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, shape="none", host_ratio=[2.0, 1.5])
    assert (r0["l3_cuts"] > 0 or r1["host_failures"] > 0) and r0["fingerprint"] != r1["fingerprint"]
