"""The request API of SGLang 0.5.15 to 0.5.18: :mod:`hiradix.sglang.cache_req`'s calls
(``cache_finished_req`` / ``cache_unfinished_req``) on a request that keeps its
``req_to_token`` row and ``cache_protected_len`` itself, in 0.5.18's server
(:data:`~hiradix.sglang.options.SERVER_V18`).
"""

from __future__ import annotations

from typing import Any

from hiradix.sglang.cache_req import CacheReqAPI, RequestRecord
from hiradix.sglang.options import SERVER_V18

__all__ = ["RECORD", "HiRadixCache"]


def _the_request(req: Any) -> Any:
    return req


def _no_extras(req: Any) -> dict[str, Any]:
    return {}


#: The request is its own KV record; its inserts name nothing more.
RECORD = RequestRecord(kv=_the_request, insert_extras=_no_extras)


class HiRadixCache(CacheReqAPI):
    """hiradix's ``HiRadixCache`` for SGLang 0.5.15 to 0.5.18 (module docstring)."""

    server = SERVER_V18
    record = RECORD
