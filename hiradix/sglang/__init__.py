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

Importing this module needs a supported SGLang (:data:`SUPPORTED_VERSIONS`); plain
``import hiradix`` never imports SGLang.
"""

from __future__ import annotations

from hiradix._sglang_plugin import SUPPORTED_VERSIONS, TESTED_VERSIONS, UnsupportedSGLang, check_sglang_version

SGLANG_VERSION = check_sglang_version()

from hiradix.sglang.cache import HiRadixCache, SGLangCacheController  # noqa: E402
from hiradix.sglang.nodes import TreeNode  # noqa: E402
from hiradix.sglang.plugin import BACKEND_NAME, create_cache, register  # noqa: E402

__all__ = [
    "BACKEND_NAME",
    "SGLANG_VERSION",
    "SUPPORTED_VERSIONS",
    "TESTED_VERSIONS",
    "HiRadixCache",
    "SGLangCacheController",
    "TreeNode",
    "UnsupportedSGLang",
    "create_cache",
    "register",
]
