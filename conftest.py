"""Root pytest configuration: what the SGLang adapter's tests and doctests need.

SGLang imports ``torchvision`` at import time, and the PyPI torchvision wheel cannot load
with the CPU torch, so an import-only stub (``tests/stubs``) is put on ``sys.path`` when no
torchvision imports. Without a supported SGLang, ``hiradix/sglang`` is left out of doctest
collection (``import hiradix.sglang`` raises, by design, naming the versions it needs), and
``tests/sglang`` skips saying why.
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


# The stub answers every attribute (pytest would read its ``pytest_plugins``): never collected.
collect_ignore = ["tests/stubs"] + ([] if _sglang_supported() else ["hiradix/sglang"])
