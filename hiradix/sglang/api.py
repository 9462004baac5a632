"""Which ``HiRadixCache`` the installed SGLang gets: the one place that tells SGLang's
request APIs apart.

SGLang 0.5.15 to 0.5.18 hand requests to a cache through ``cache_finished_req`` /
``cache_unfinished_req`` and keep the request's ``req_to_token`` row on the ``Req``
(:mod:`hiradix.sglang.api_v18`); 0.5.20 makes the same calls on a request whose row lives
in its KV record ``req.kv`` (:mod:`hiradix.sglang.api_v20`); 0.5.23 calls ``checkpoint`` /
``lock`` / ``path_device_indices`` (:mod:`hiradix.sglang.api_v23`). The choice reads
SGLang's ``BasePrefixCache``: whether it declares ``checkpoint``, else whether it declares
``free_kv_row(kv, ranges)``, the base method that frees a request's row through that KV
record and came with it. Which versions may load at all is
:data:`~hiradix._sglang_versions.SUPPORTED_VERSIONS`.

Each generation's module is one class on :class:`~hiradix.sglang.cache.HiRadixCacheBase`
(the translator, shared by all), composed of its server's options and refusals (an
:class:`~hiradix.sglang.options.Server`) and its request calls (0.5.18's and 0.5.20's from
:mod:`hiradix.sglang.cache_req`, each with its own
:class:`~hiradix.sglang.cache_req.RequestRecord`); no version module imports another, so
a new SGLang release is one more module here.
"""

from __future__ import annotations

import importlib

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

from hiradix.sglang.cache import HiRadixCacheBase

__all__ = ["REQUEST_API", "HiRadixCache"]

#: ``"checkpoint"`` (SGLang 0.5.23), ``"cache_req_kv"`` (0.5.20: 0.5.18's calls, the row on
#: ``req.kv``) or ``"cache_req"`` (0.5.15 to 0.5.18).
REQUEST_API = (
    "checkpoint"
    if hasattr(BasePrefixCache, "checkpoint")
    else "cache_req_kv"
    if hasattr(BasePrefixCache, "free_kv_row")
    else "cache_req"
)

_MODULES = {
    "checkpoint": "hiradix.sglang.api_v23",
    "cache_req_kv": "hiradix.sglang.api_v20",
    "cache_req": "hiradix.sglang.api_v18",
}

#: hiradix's cache for the installed SGLang (a :class:`HiRadixCacheBase` subclass).
HiRadixCache: type[HiRadixCacheBase] = importlib.import_module(_MODULES[REQUEST_API]).HiRadixCache
