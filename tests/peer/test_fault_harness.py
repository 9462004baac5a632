"""The fault harness's short version (``bench/fault_harness.py --short``): real ``hiradix
peer serve`` processes on loopback, kill -9, restart, SIGSTOP/SIGCONT and pool pressure.

It asserts invariants only, never latencies or miss counts (the machine is shared): no page
is ever read with wrong bytes, every scenario ran, and the restarted and the continued
nodes recovered (ready, their pages readable through every other node) within the
harness's deadline. The harness runs as a subprocess under a hard deadline; on expiry it
gets SIGTERM, which it turns into a clean shutdown of its nodes (each also has a
``--lifetime``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

HARNESS = REPO / "bench" / "fault_harness.py"
HARD_DEADLINE_S = 60  # the harness's own budget is lower, so it stops first and says why

pytestmark = [pytest.mark.timeout(HARD_DEADLINE_S + 30), pytest.mark.slow]  # slow: the fault harness's timed scenarios


def test_short_fault_run_reads_no_wrong_bytes_and_recovers(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    cmd = [sys.executable, str(HARNESS), "--short", "--seed", "1", "--budget", str(HARD_DEADLINE_S - 10)]
    proc = subprocess.Popen(
        [*cmd, "--json", str(out), "--keep-logs", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        text, _ = proc.communicate(timeout=HARD_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness kills its nodes on the way out
        text, _ = proc.communicate(timeout=20)
        pytest.fail(f"the short fault run took over {HARD_DEADLINE_S}s:\n{text}")
    assert out.exists(), text
    res = json.loads(out.read_text())
    scenarios = {(s["name"], s["round"]): s for s in res["scenarios"]}

    assert res["total"]["wrong"] == 0, text
    assert set(scenarios) == {("baseline", 0), ("kill9", 1), ("restart", 1), ("sigstop", 1), ("pool_pressure", 1)}, text
    assert res["total"]["reads"] > 0 and all(s["reads"] > 0 for s in scenarios.values()), text
    # The killed node came back with its own command: ready, rejoined, and its new pages
    # readable through every other node; the continued one's pages were readable again.
    restart = scenarios["restart", 1]["recovery"]
    for what in ("status_ready_s", "http_ready_s", "rejoined_s", "readable_s"):
        assert restart[what] is not None, text
    assert scenarios["sigstop", 1]["recovery"]["readable_s"] is not None, text
    assert scenarios["pool_pressure", 1]["notes"]["evictions"] > 0, text
    assert proc.returncode == (0 if res["ok"] else 1), text
