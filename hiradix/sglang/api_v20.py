"""The request API of SGLang 0.5.20.

SGLang 0.5.20 still hands requests to a cache through 0.5.18's ``cache_unfinished_req`` /
``cache_finished_req`` and takes a match's device slots from ``MatchResult.device_indices``,
so :mod:`hiradix.sglang.cache_req`'s calls serve it. Three things differ from 0.5.18:

- the request record: the ``req_to_token`` row (``req_pool_idx``) and
  ``cache_protected_len`` moved from the ``Req`` to its ``ReqKvInfo`` (``req.kv``), as
  in 0.5.23; ``prefix_indices`` and ``last_node`` stay on the ``Req`` (:data:`RECORD`);
- a request's insert names its ``session_id`` (``InsertParams``), which the stores of
  0.5.20's KV events carry (:class:`~hiradix.sglang.events._Format20`);
- the server around the cache is 0.5.23's: the same options (read resolved: e.g.
  ``--hicache-ratio`` is unset until resolved), and L3 prefetches named by a
  ``CacheRequestHandle`` (:data:`~hiradix.sglang.options.SERVER_SINCE_020`, which refuses
  at start-up, naming the option, what this cache does not honour).
"""

from __future__ import annotations

from typing import Any

from hiradix.sglang.cache_req import CacheReqAPI, RequestRecord
from hiradix.sglang.options import SERVER_SINCE_020

__all__ = ["RECORD", "HiRadixCache"]


def _kv_info(req: Any) -> Any:
    return req.kv


def _session(req: Any) -> dict[str, Any]:
    return {"session_id": getattr(req, "session_id", None)}


#: ``req.kv`` holds the row and ``cache_protected_len``; inserts name the session.
RECORD = RequestRecord(kv=_kv_info, insert_extras=_session)


class HiRadixCache(CacheReqAPI):
    """hiradix's ``HiRadixCache`` for SGLang 0.5.20 (module docstring): 0.5.18's request
    calls on 0.5.20's request record, in 0.5.23's server."""

    server = SERVER_SINCE_020
    record = RECORD
