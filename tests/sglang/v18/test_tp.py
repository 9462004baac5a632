"""Two TP ranks (gloo on loopback) running hiradix.sglang with SGLang's TP group in
``CacheInitParams``: one rank's host allocations fail at random. With the agreement the
ranks make the same collectives and end with identical trees; the control run without a
TP group shows the same faults make them diverge. The pipeline hand-down is checked on its
own: it carries SGLang's tag, so an untagged message between stages is never taken for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.sglang.v18 import env as sglang_env  # noqa: F401  (skips this module without SGLang)
from tests.support import run_ranks

pytestmark = pytest.mark.slow  # two-process TP/PP runs over gloo, about a minute each

WORLD = 2
TIMEOUT_S = 240  # the run takes seconds; past this a collective has hung


def _run(tmp_path: Path, **config: Any) -> list[dict[str, Any]]:
    from tests.sglang.v18 import rank as sglang_rank

    cfg = {"agree": True, "page": 4, "write_policy": "write_through", "seed": 11, "steps": 80} | config
    return run_ranks(sglang_rank.rank_main, WORLD, tmp_path, cfg, TIMEOUT_S)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_two_tp_ranks_agree_through_sglangs_group(tmp_path: Path, write_policy: str) -> None:
    r0, r1 = _run(tmp_path, write_policy=write_policy)
    assert r1["failures"] > 0 and r0["failures"] == 0, "faults were asymmetric"
    assert r0["calls"] == r1["calls"] > 0, "the ranks made different collectives"
    assert r0["fingerprint"] == r1["fingerprint"], "trees diverged"
    assert r0["stats"] == r1["stats"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_two_pipeline_stages_take_the_first_stages_decisions(tmp_path: Path, write_policy: str) -> None:
    # SGLang's pp_cache_group / pp_rank / pp_size in CacheInitParams: the first stage's host
    # allocations fail at random; the second receives every agreed outcome from it (under
    # SGLang's PP-sync tag) and ends with the same tree.
    r0, r1 = _run(tmp_path, write_policy=write_policy, pp=True)
    assert r0["failures"] > 0 and r1["failures"] == 0, "faults were asymmetric"
    assert r0["calls"] == r1["calls"] > 0, "the stages made different hand-downs"
    assert r0["fingerprint"] == r1["fingerprint"], "trees diverged"
    assert r0["stats"] == r1["stats"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_without_the_tp_group_the_same_faults_diverge(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, agree=False)
    assert r1["failures"] > 0 and r0["fingerprint"] != r1["fingerprint"]
