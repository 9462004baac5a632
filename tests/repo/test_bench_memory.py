"""``bench/memory.py`` at a tiny size, so that it cannot rot: the driver runs each cache of
the installed SGLang in its own subprocess (0.5.18: hiradix.sglang and SGLang's
HiRadixCache; 0.5.23: hiradix.sglang and UnifiedRadixCache on its Rust core) and checks
that they cached the same tokens in the same nodes. Figures are not asserted (the machine
is shared), only that they were measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench"
# The script, loaded from its file: bench/ is no package (its scripts import their siblings
# by name, from their own folder).
_spec = importlib.util.spec_from_file_location("bench_memory", BENCH / "memory.py")
assert _spec is not None and _spec.loader is not None
memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)

pytestmark = pytest.mark.timeout(600)


def _row(impl: str, tokens: int, nodes: int | None, built: int = 1000, grown: int = 500) -> dict:
    return {
        "impl": impl,
        "page_size": 16,
        "target_tokens": 100,
        "cached_tokens": tokens,
        "nodes": nodes,
        "built_bytes": built,
        "grown_bytes": grown,
        "traced_built_bytes": None,
    }


def test_check_refuses_caches_that_disagree() -> None:
    with pytest.raises(AssertionError, match="cached tokens differ"):
        memory.check({"hiradix-0.5.18": _row("hiradix-0.5.18", 96, 3), "sglang-0.5.18": _row("sglang-0.5.18", 112, 3)})
    with pytest.raises(AssertionError, match="node counts differ"):
        memory.check({"hiradix-0.5.18": _row("hiradix-0.5.18", 96, 3), "sglang-0.5.18": _row("sglang-0.5.18", 96, 4)})


def test_table_divides_by_tokens_and_nodes_and_compares_with_the_smallest_sglang() -> None:
    runs = {
        "hiradix-0.5.23": _row("hiradix-0.5.23", 100, 4, 300, 100),
        "unified-rust": _row("unified-rust", 100, None, 700, 100),
        "unified-python": _row("unified-python", 100, 4, 1000, 600),
    }
    memory.check(runs)  # the Rust core's node count is the others'
    text = memory.table(list(runs.values()))
    assert "| 100 | 16 | 4* | SGLang 0.5.23 UnifiedRadixCache, Rust core | 8.0 | 200 |" in text
    assert "| 100 | 16 | 4 | hiradix.sglang (on 0.5.23) | 4.0 | 100 |" in text
    assert text.splitlines()[2].endswith("| 0.50 |")  # hiradix: 400 bytes against the Rust core's 800


@pytest.mark.slow  # runs bench/memory.py in subprocesses, one per cache
def test_a_tiny_run_measures_every_cache(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    v = version("sglang")
    if v == "0.5.18":
        impls, flag = "hiradix-0.5.18,sglang-0.5.18", "--python-v18"
    elif v == "0.5.23":
        impls, flag = "hiradix-0.5.23,unified-rust", "--python-v23"
    else:
        pytest.skip(f"bench/memory.py compares on SGLang 0.5.18 and 0.5.23, not {v}")
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "memory.py"),
            "--tokens",
            "3000",
            "--page-sizes",
            "16",
            "--impls",
            impls,
            flag,
            sys.executable,
            "--no-tracemalloc",
            "--timeout",
            "240",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == impls.split(",")
    assert len({r["cached_tokens"] for r in rows}) == 1 and rows[0]["cached_tokens"] >= 3000
    assert all(r["nodes"] and r["built_bytes"] + r["grown_bytes"] > 0 for r in rows)
    assert "| cached tokens | page |" in proc.stdout
