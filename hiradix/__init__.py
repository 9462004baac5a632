"""hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.

The layers are folders: :mod:`hiradix.tree` (the radix tree, compiled and its pure-Python
twin), :mod:`hiradix.memory`, :mod:`hiradix.storage`, :mod:`hiradix.peer`,
:mod:`hiradix.transport`, :mod:`hiradix.sglang` and :mod:`hiradix.sim`.

The tree comes from the compiled core :mod:`hiradix.tree._core` unless
``HIRADIX_PUREPYTHON=1`` is set or the extension was not built, in which case the
pure-Python twin :mod:`hiradix.tree._reference` (same API) is used.
``hiradix.IMPLEMENTATION`` says which.
"""

from __future__ import annotations

from hiradix.tree import (
    IMPLEMENTATION,
    ROOT,
    Change,
    EvictionPolicy,
    HiRadixTree,
    IOStatus,
    LockError,
    get_hash_str,
    get_policy,
    namespace_seed,
    page_digests,
    page_hashes,
    policy_names,
    register_policy,
)

__all__ = [
    "IMPLEMENTATION",
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
__version__ = "0.1.0"
