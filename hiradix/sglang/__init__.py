"""hiradix inside SGLang: a drop-in ``HiRadixCache`` on SGLang's own pools, allocator,
requests and layer counter.

Two ways in:

- **Plugin** (stock SGLang): hiradix installs an entry point in SGLang's plugin group
  ``sglang.srt.plugins``, so SGLang calls :func:`register` at start-up and
  ``--enable-hierarchical-cache --radix-cache-backend hiradix`` selects this cache
  (``SGLANG_PLUGINS``, when set, must name ``hiradix``).
- **Import** (a fork): use :class:`HiRadixCache` where the fork builds
  ``sglang.srt.mem_cache.hiradix_cache.HiRadixCache``; the constructor is the same
  ``(params: CacheInitParams, server_args: ServerArgs)``.

The cache needs a supported SGLang (:data:`SUPPORTED_VERSIONS`): with a missing or
unsupported one, importing any of its names (``from hiradix.sglang import HiRadixCache``)
raises :class:`UnsupportedSGLang` naming the versions. :mod:`hiradix.sglang.storage`
(hiradix's L3 backends for SGLang's own HiCache) only needs SGLang's storage interface,
so this package itself imports with any SGLang, for that module's sake. Plain
``import hiradix`` never imports SGLang.
"""

from __future__ import annotations

from typing import Any

from hiradix._sglang_versions import SUPPORTED_VERSIONS, TESTED_VERSIONS, UnsupportedSGLang, check_sglang_version

_CACHE_NAMES = (
    "BACKEND_NAME",
    "SGLANG_VERSION",
    "HiRadixCache",
    "SGLangCacheController",
    "TreeNode",
    "create_cache",
    "register",
)

try:
    SGLANG_VERSION = check_sglang_version()
except UnsupportedSGLang as e:
    _UNSUPPORTED: UnsupportedSGLang | None = e
else:
    _UNSUPPORTED = None
    from hiradix.sglang.api import HiRadixCache
    from hiradix.sglang.controller import SGLangCacheController
    from hiradix.sglang.nodes import TreeNode
    from hiradix.sglang.plugin import BACKEND_NAME, create_cache, register


def __getattr__(name: str) -> Any:
    # Only reached for names not set above: the cache's, when this SGLang is unsupported.
    if name in _CACHE_NAMES and _UNSUPPORTED is not None:
        raise UnsupportedSGLang(str(_UNSUPPORTED))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "SGLANG_VERSION",
    "SUPPORTED_VERSIONS",
    "TESTED_VERSIONS",
    "HiRadixCache",
    "SGLangCacheController",
    "TreeNode",
    "UnsupportedSGLang",
    "check_sglang_version",
    "create_cache",
    "register",
]
