"""Which ``HiRadixCache`` the installed SGLang gets: the one place that tells SGLang's
request APIs apart.

SGLang 0.5.15 to 0.5.18 hand requests to a cache through ``cache_finished_req`` /
``cache_unfinished_req`` (:mod:`hiradix.sglang.api_v18`); 0.5.23 through ``checkpoint`` /
``lock`` / ``path_device_indices`` (:mod:`hiradix.sglang.api_v23`). The choice reads
SGLang's ``BasePrefixCache`` (whether it declares ``checkpoint``); which versions may load
at all is :data:`~hiradix._sglang_plugin.SUPPORTED_VERSIONS` (0.5.20 is neither: it keeps
0.5.18's calls on 0.5.23's request record). Everything else is
:class:`~hiradix.sglang.cache.HiRadixCacheBase`, shared by both.
"""

from __future__ import annotations

import importlib

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

from hiradix.sglang.cache import HiRadixCacheBase

__all__ = ["REQUEST_API", "HiRadixCache"]

#: ``"checkpoint"`` (SGLang 0.5.23) or ``"cache_req"`` (0.5.15 to 0.5.18).
REQUEST_API = "checkpoint" if hasattr(BasePrefixCache, "checkpoint") else "cache_req"

#: hiradix's cache for the installed SGLang (a :class:`HiRadixCacheBase` subclass).
HiRadixCache: type[HiRadixCacheBase] = importlib.import_module(
    "hiradix.sglang.api_v23" if REQUEST_API == "checkpoint" else "hiradix.sglang.api_v18"
).HiRadixCache
