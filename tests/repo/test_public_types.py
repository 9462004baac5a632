"""The public classes are typed: mypy sees ``hiradix.HiRadixTree`` through the compiled
tree's stub (``hiradix/tree/_core.pyi``), not as ``Any``, so a caller's wrong call is an
error before it runs. Skipped, saying why, where mypy is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[dev]')")

SNIPPET = """\
import hiradix
from hiradix.cache import HiRadixCache
reveal_type(hiradix.HiRadixTree)
tree = hiradix.HiRadixTree(page_size=4)
reveal_type(tree.match_prefix([1, 2, 3, 4]).last_node)
tree.insert_host(tree.root)
reveal_type(HiRadixCache)
"""


@pytest.mark.slow  # runs mypy on the package
def test_hiradix_tree_resolves_to_the_stubbed_class(tmp_path: Path) -> None:
    snippet = tmp_path / "uses_hiradix.py"
    snippet.write_text(SNIPPET)
    # From the repository root, where mypy finds the package and its stubs as CI has them.
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(snippet)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    notes = [line for line in out.splitlines() if "Revealed type" in line]
    assert len(notes) == 3, out
    assert notes[0].endswith('-> hiradix.tree._core.HiRadixTree"'), out
    assert notes[1].endswith('"int"') or notes[1].endswith('"builtins.int"'), out
    assert "hiradix.cache.cache.HiRadixCache" in notes[2], out
    # Typed, not Any: the call missing its arguments is reported.
    assert "Missing positional argument" in out and '"insert_host" of "HiRadixTree"' in out, out
