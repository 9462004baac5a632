"""``bench/compare.py``, the paired speed gate, so that it cannot rot: its plan without
building (``--dry-run``), its ratio summary and gate on made-up rounds, and one tiny real
round with this checkout on both sides. Figures are not asserted (the machine is shared),
only that they were measured, by the hiradix each side was told to import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import REPO

_spec = importlib.util.spec_from_file_location("bench_compare", REPO / "bench" / "compare.py")
assert _spec is not None and _spec.loader is not None
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dry_run_prints_the_plan_and_builds_nothing(tmp_path):
    proc = _run("HEAD~1", "HEAD", "--dry-run", "--rounds", "2", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "build_ext --inplace" in proc.stderr
    assert "round 2/2: HEAD then BASE" in proc.stderr
    assert "sglang_api.py" in proc.stderr and "tree_ops.py" in proc.stderr and "churn.py" in proc.stderr
    assert not any(tmp_path.iterdir())  # no worktree made


def test_summary_ratios_and_gate():
    rounds = [
        {"BASE": {"op/s": (100.0, True), "t": (1.0, False)}, "HEAD": {"op/s": (80.0, True), "t": (0.5, False)}},
        {"BASE": {"op/s": (100.0, True), "t": (1.0, False)}, "HEAD": {"op/s": (70.0, True), "t": (0.5, False)}},
    ]
    rows, failed = compare.summarize(rounds, 0.15, "throughput")
    assert failed == ["op/s"]
    assert "| 0.75 | 0.70-0.80 | SLOWER |" in rows[0]
    assert "| 2.00 | 2.00-2.00 | ok |" in rows[1]  # a time halved: twice the speed
    assert compare.summarize(rounds, 0.35, "throughput")[1] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_tiny_round_reports_every_operation():
    proc = _run(
        "unused",
        *("--base-tree", ".", "--head-tree", "."),
        *("--rounds", "1", "--scale", "0.005", "--page-sizes", "16", "--benches", "tree_ops,churn"),
        "--threshold",
        "0.99",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"hiradix from {REPO.resolve()}/hiradix/__init__.py") == 4
    assert "| tree_ops p16 plain insert |" in proc.stdout
    assert "| churn p16 core plain steady_insert |" in proc.stdout
