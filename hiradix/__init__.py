"""hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.

The tree comes from the compiled core :mod:`hiradix._core` unless ``HIRADIX_PUREPYTHON=1``
is set or the extension was not built, in which case the pure-Python twin
:mod:`hiradix._reference` (same API) is used. ``hiradix.IMPLEMENTATION`` says which.
"""

from __future__ import annotations

from typing import Any

from hiradix import _native
from hiradix._results import Change, IOStatus, LockError
from hiradix.policy import EvictionPolicy, get_policy, policy_names, register_policy

_impl: Any = _native.load("hiradix._core")
if _impl is None:
    from hiradix import _reference as _impl

IMPLEMENTATION = "cython" if _impl.__name__ == "hiradix._core" else "python"
ROOT: int = _impl.ROOT
HiRadixTree = _impl.HiRadixTree
get_hash_str = _impl.get_hash_str
namespace_seed = _impl.namespace_seed
page_digests = _impl.page_digests
page_hashes = _impl.page_hashes

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
