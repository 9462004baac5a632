"""hiradix.sglang against a real SGLang, one installed version per venv.

``v18/`` drives the generation whose hierarchical cache is SGLang's ``HiRadixCache``
(0.5.18, and 0.5.20, which still ships it), ``v23/`` the generation whose hierarchical
cache is the ``UnifiedRadixCache`` (0.5.23); the root ``conftest.py`` collects only the
folder of the installed generation (:func:`unified_hicache`). The ``test_*.py`` files here
are the tests both generations share, written once: they reach the installed version
through the fixtures of ``conftest.py`` here, and run in every SGLang venv.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def unified_hicache() -> bool:
    """Whether the installed SGLang's hierarchical cache is the ``UnifiedRadixCache``: its
    ``mem_cache`` has ``unified_radix_cache.py`` and no ``hiradix_cache.py`` (0.5.18 ships
    the first unused, 0.5.20 the second). Read from the files, without importing SGLang
    (seconds) at collection."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    mem_cache = Path(next(iter(spec.submodule_search_locations))) / "srt" / "mem_cache"
    return (mem_cache / "unified_radix_cache.py").exists() and not (mem_cache / "hiradix_cache.py").exists()


def tree_core_seam() -> bool:
    """Whether the installed SGLang's ``UnifiedTreeCoreInterface`` is 0.5.23's, the one
    ``hiradix.sglang.tree_core`` implements (it has ``TreePathNodeInfo``; 0.5.18 and 0.5.20
    ship an older one). Read from the file, without importing SGLang, at collection."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    interface = (
        Path(next(iter(spec.submodule_search_locations)))
        / "srt"
        / "mem_cache"
        / "unified_cache"
        / "unified_tree_core_interface.py"
    )
    return interface.exists() and "class TreePathNodeInfo" in interface.read_text(encoding="utf-8")


def require_sglang() -> None:
    """Skip the calling test module, saying why, without a supported SGLang (called at its
    top, as the shared tests here do)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (CI runs tests/sglang in each SGLang venv)", allow_module_level=True)
    from hiradix._sglang_versions import UnsupportedSGLang, check_sglang_version

    try:
        check_sglang_version()
    except UnsupportedSGLang as e:
        pytest.skip(str(e), allow_module_level=True)
