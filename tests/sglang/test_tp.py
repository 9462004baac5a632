"""hiradix.sglang's pipeline hand-down between two stages (gloo on loopback, spawned
processes) on the installed SGLang (every SGLang venv): it carries SGLang's PP-sync tag, so
an untagged message between the stages is never taken for it. The multi-rank runs of each
generation are in ``v18/test_tp.py`` and ``v23/test_tp.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.sglang import require_sglang
from tests.support import run_ranks, sglang_pp_tag_rank

require_sglang()

pytestmark = [
    pytest.mark.slow,  # two processes over gloo
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
]

TIMEOUT_S = 240  # the run takes seconds; past this a collective has hung


def test_pipeline_hand_down_uses_sglangs_tag(tmp_path: Path) -> None:
    # stage 0 sends an untagged message of its own before the hand-down; each of stage
    # 1's receives must get its own message
    r0, r1 = run_ranks(sglang_pp_tag_rank, 2, tmp_path, {}, TIMEOUT_S)
    assert r0 == {"agreed": [5, 7], "other": [99, 99]}
    assert r1 == {"agreed": [5, 7], "other": [99, 99]}, "a stage took another message for the hand-down"
