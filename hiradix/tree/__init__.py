"""The tree layer: the triple-state radix tree over token ids, in two implementations.

- :mod:`~hiradix.tree._core` (``_core.pyx``, ``_core.pxd``, typed by ``_core.pyi``): the
  compiled tree, the one used unless ``HIRADIX_PUREPYTHON=1`` is set or it was not built;
- :mod:`~hiradix.tree._reference`: its pure-Python twin, the same API written to be plainly
  correct (the test oracle and the fallback);
- :mod:`~hiradix.tree.policy`: the eviction policies both trees share, declared as data;
- :mod:`~hiradix.tree._results`: the result records, node states and errors;
- :mod:`~hiradix.tree._unified` (``_unified.pyx``) and its twin :mod:`~hiradix.tree.unified`:
  ``UnifiedFullTree``, the tree SGLang 0.5.23's ``UnifiedRadixCache`` drives through
  ``hiradix.sglang.tree_core`` (the FULL component on the device tier).

``IMPLEMENTATION`` says which tree serves (``UNIFIED_IMPLEMENTATION`` which
``UnifiedFullTree``); ``hiradix`` re-exports the names in ``__all__`` (not these two: the
tree core is reached through ``hiradix.sglang.tree_core``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hiradix import _native
from hiradix.tree._results import NO_NODE, Change, IOStatus, LockError
from hiradix.tree.policy import EvictionPolicy, get_policy, policy_names, register_policy

if TYPE_CHECKING:
    # The type checker sees the compiled tree through its stub (``_core.pyi``); the twin
    # has the same API (tests/tree/test_errors.py compares the two with the stub).
    from hiradix.tree._core import ROOT, HiRadixTree, get_hash_str, namespace_seed, page_digests, page_hashes
    from hiradix.tree.unified import UnifiedFullTree  # the compiled one has the twin's API

    IMPLEMENTATION: str
    UNIFIED_IMPLEMENTATION: str
else:
    _impl = _native.load("hiradix.tree._core")
    if _impl is None:
        from hiradix.tree import _reference as _impl

    IMPLEMENTATION = "cython" if _impl.__name__ == "hiradix.tree._core" else "python"
    ROOT = _impl.ROOT
    HiRadixTree = _impl.HiRadixTree
    get_hash_str = _impl.get_hash_str
    namespace_seed = _impl.namespace_seed
    page_digests = _impl.page_digests
    page_hashes = _impl.page_hashes

    _unified = _native.load("hiradix.tree._unified")
    if _unified is None:
        from hiradix.tree import unified as _unified
    UNIFIED_IMPLEMENTATION = "cython" if _unified.__name__ == "hiradix.tree._unified" else "python"
    UnifiedFullTree = _unified.UnifiedFullTree

__all__ = [
    "IMPLEMENTATION",
    "NO_NODE",
    "ROOT",
    "Change",
    "EvictionPolicy",
    "HiRadixTree",
    "IOStatus",
    "LockError",
    "get_hash_str",
    "get_policy",
    "namespace_seed",
    "page_digests",
    "page_hashes",
    "policy_names",
    "register_policy",
]
