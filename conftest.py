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

import importlib.util
import sys
from pathlib import Path

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
# hiradix.sglang's request API for the other SGLang generation does not import here, nor
# (on 0.5.23) its KV events, which are 0.5.18's.
collect_ignore = (["tests/stubs"] + ([] if _sglang_supported() else ["hiradix/sglang"])
                  + (["hiradix/sglang/api_v18.py", "hiradix/sglang/events.py"] if _sglang_has_unified_hicache()
                     else ["tests/sglang23", "hiradix/sglang/api_v23.py"]))
