"""Root pytest configuration: what the SGLang adapter's tests and doctests need.

SGLang imports ``torchvision`` at import time, and the PyPI torchvision wheel cannot load
with the CPU torch, so an import-only stub (``tests/stubs``) is put on ``sys.path`` when no
torchvision imports. Without a supported SGLang, ``hiradix/sglang`` is left out of doctest
collection (its cache's names raise, by design, naming the versions they need), and
``tests/sglang`` skips saying why. Of ``tests/sglang``'s two suites only the installed
generation's is collected (:func:`tests.sglang.unified_hicache`): ``tests/sglang/v18``
(SGLang's ``HiRadixCache``: 0.5.18, 0.5.20) or ``tests/sglang/v23`` (its
``UnifiedRadixCache``: 0.5.23; CI runs it in ``.venv-sglang23``).
The request-API module of hiradix.sglang for the other SGLang generation is left out of
doctest collection (it does not import there).

``tests/`` and its folders are packages (``__init__.py``): pytest's default ``prepend``
import mode puts this folder, their root, on ``sys.path``, test modules import their
helpers as ``tests.support`` or ``tests.sglang.pools``, and two folders may hold files of
one name (``tests/cache/test_stress.py``, ``tests/tree/test_stress.py``).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.sglang import tree_core_seam, unified_hicache

_STUBS = Path(__file__).resolve().parent / "tests" / "stubs"

try:
    import torchvision  # noqa: F401
except Exception:  # missing, or a CUDA wheel that cannot load: the stub stands in
    sys.modules.pop("torchvision", None)
    sys.path.insert(0, str(_STUBS))


def _sglang_supported() -> bool:
    if importlib.util.find_spec("sglang") is None:
        return False
    from hiradix._sglang_plugin import UnsupportedSGLang, check_sglang_version

    try:
        check_sglang_version()
    except UnsupportedSGLang:
        return False
    return True


# The stub answers every attribute (pytest would read its ``pytest_plugins``): never collected.
# Of tests/sglang's two suites, the other generation's; hiradix.sglang's request API for the
# other SGLang generation does not import here.
# (0.5.20's request API is 0.5.18's, cache_req.py, so it goes where api_v18 goes.)
collect_ignore = (
    ["tests/stubs"]
    + ([] if _sglang_supported() else ["hiradix/sglang"])
    + (
        ["tests/sglang/v18", "hiradix/sglang/api_v18.py", "hiradix/sglang/api_v20.py", "hiradix/sglang/cache_req.py"]
        if unified_hicache()
        else ["tests/sglang/v23", "hiradix/sglang/api_v23.py"]
    )
    # the tree core implements 0.5.23's UnifiedTreeCoreInterface, which 0.5.18/0.5.20 predate
    + ([] if tree_core_seam() else ["hiradix/sglang/tree_core.py"])
)


# The suite's memory, bounded. Trees (the twin's nodes link to their parents) and peer nodes
# (components hold the node's bound methods) are reference cycles, which only the cyclic
# collector frees, and its full passes grow rarer as the heap grows: in the pure-Python
# suite, replays of the whole trace piled up to 9 GB and the kernel's OOM killer ended it.
# So a test after which the process has grown by half a GiB since the last collection is
# followed by one (otherwise the cost is one statm read per test).
_GROWTH = 512 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")
_rss_base: list[int] = []  # RSS after the last collection


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # no procfs: never collect here
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    rss = _rss()
    if not _rss_base:
        _rss_base.append(rss)
    elif rss - _rss_base[0] >= _GROWTH:
        gc.collect()
        _rss_base[0] = _rss()
