"""Root pytest configuration: what the SGLang adapter's tests and doctests need.

SGLang imports ``torchvision`` at import time, and the PyPI torchvision wheel cannot load
with the CPU torch, so an import-only stub (``tests/stubs``) is put on ``sys.path`` when no
torchvision imports. Without a supported SGLang, ``hiradix/sglang`` is left out of doctest
collection (its cache's names raise, by design, naming the versions they need), and
``tests/sglang`` skips saying why. ``tests/sglang23`` (hiradix's cache on SGLang 0.5.23, and
0.5.23's own cache on hiradix's L3 backends) is collected only where the installed SGLang's
hierarchical cache is the ``UnifiedRadixCache`` (no ``hiradix_cache`` module): CI runs it in
``.venv-sglang23``.
The request-API module of hiradix.sglang for the other SGLang generation is left out of
doctest collection (it does not import there).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

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


def _sglang_has_unified_hicache() -> bool:
    # Where the files say so, without importing SGLang (seconds) at collection.
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    mem_cache = Path(next(iter(spec.submodule_search_locations))) / "srt" / "mem_cache"
    return (mem_cache / "unified_radix_cache.py").exists() and not (mem_cache / "hiradix_cache.py").exists()


# The stub answers every attribute (pytest would read its ``pytest_plugins``): never collected.
# hiradix.sglang's request API for the other SGLang generation does not import here.
# (api_v20 builds on api_v18, so it goes where api_v18 goes.)
collect_ignore = (["tests/stubs"] + ([] if _sglang_supported() else ["hiradix/sglang"])
                  + (["hiradix/sglang/api_v18.py", "hiradix/sglang/api_v20.py"] if _sglang_has_unified_hicache()
                     else ["tests/sglang23", "hiradix/sglang/api_v23.py"]))


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
