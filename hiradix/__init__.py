"""hiradix: a multi-tier (GPU / host / storage) radix KV cache for LLM serving.

The tree comes from the compiled core :mod:`hiradix._core` unless ``HIRADIX_PUREPYTHON=1``
is set or the extension was not built, in which case the pure-Python twin
:mod:`hiradix._reference` (same API) is used. ``hiradix.IMPLEMENTATION`` says which.
"""

from __future__ import annotations

import os

from hiradix.policy import EvictionPolicy, get_policy, policy_names, register_policy

if os.environ.get("HIRADIX_PUREPYTHON", "") not in ("", "0"):
    from hiradix._reference import (
        ROOT,
        HiRadixTree,
        get_hash_str,
        namespace_seed,
        page_digests,
        page_hashes,
    )

    IMPLEMENTATION = "python"
else:
    try:
        from hiradix._core import (  # type: ignore[assignment]
            ROOT,
            HiRadixTree,
            get_hash_str,
            namespace_seed,
            page_digests,
            page_hashes,
        )

        IMPLEMENTATION = "cython"
    except ImportError:  # no compiler at install time: msgpack-style fallback
        from hiradix._reference import (  # type: ignore[assignment]
            ROOT,
            HiRadixTree,
            get_hash_str,
            namespace_seed,
            page_digests,
            page_hashes,
        )

        IMPLEMENTATION = "python"

__all__ = [
    "IMPLEMENTATION",
    "ROOT",
    "EvictionPolicy",
    "HiRadixTree",
    "get_hash_str",
    "get_policy",
    "namespace_seed",
    "page_digests",
    "page_hashes",
    "policy_names",
    "register_policy",
]
__version__ = "0.1.0"
