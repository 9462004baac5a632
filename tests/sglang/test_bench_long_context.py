"""``bench/long_context.py --quick`` runs (issue 32): every scenario, every cache of the
installed SGLang, and the script's own equality checks between them, so the benchmark
cannot rot. Latencies are not asserted (the machine is shared); the run's checks are.
Runs in every SGLang venv: 0.5.18's HiRadixCache, 0.5.23's UnifiedRadixCache (both tree
cores); the script compares no cache on 0.5.20, where this test skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang import require_sglang
from tests.support import REPO, subprocess_env

require_sglang()

SCRIPT = REPO / "bench" / "long_context.py"
# Seconds. The quick run takes 30-40 s of CPU (SGLang's import, a dozen caches built); on
# this 2-core VM under a load of 20 (parallel suites) it took 2-7 minutes of wall time.
DEADLINE_S = 900


@pytest.mark.slow  # runs bench/long_context.py --quick in a subprocess
def test_long_context_quick_run_checks_every_scenario_and_cache(tmp_path: Path) -> None:
    from hiradix.sglang.api import REQUEST_API

    if REQUEST_API not in ("cache_req", "checkpoint"):
        pytest.skip("bench/long_context.py drives SGLang 0.5.18's and 0.5.23's request APIs")
    out = tmp_path / "lc.json"
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    meta, results = data["meta"], data["results"]
    impls = meta["impls"]
    assert impls[0] == "hiradix" and len(impls) >= 2
    for name in ("chunked", "bigram"):
        r = results[name]
        assert r["ends"] == list(range(r["chunk"], r["context"] + 1, r["chunk"]))
        for impl in impls:
            assert len(r[impl]["call_cpu"]) == len(r["ends"]) and all(t > 0 for t in r[impl]["call_wall"])
            assert r[impl]["state"]["match_len"] == r["context"] - (name == "bigram")
    for n in results["evict"]["leaves"]:
        evicted = {impl: results["evict"][str(n)][impl]["evicted"] for impl in impls}
        assert len(set(evicted.values())) == 1 and evicted["hiradix"] > 0
    assert "| context |" in proc.stdout and "| leaves |" in proc.stdout
