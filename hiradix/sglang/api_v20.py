"""The request API of SGLang 0.5.20 on :class:`~hiradix.sglang.cache.HiRadixCacheBase`.

SGLang 0.5.20 still hands requests to a cache through 0.5.18's ``cache_unfinished_req`` /
``cache_finished_req`` and takes a match's device slots from ``MatchResult.device_indices``,
so :mod:`hiradix.sglang.api_v18`'s bodies run unchanged. Three things differ:

- the request record: the ``req_to_token`` row (``req_pool_idx``) and
  ``cache_protected_len`` moved from the ``Req`` to its ``ReqKvInfo`` (``req.kv``), as
  in 0.5.23; ``prefix_indices`` and ``last_node`` stay on the ``Req``;
- a request's insert names its ``session_id`` (``InsertParams``), which the stores of
  0.5.20's KV events carry (:class:`~hiradix.sglang.events._Format20`);
- the server around the cache is 0.5.23's: the same options (read resolved: e.g.
  ``--hicache-ratio`` is unset until resolved), and L3
  prefetches named by a ``CacheRequestHandle``; all of that is
  :class:`~hiradix.sglang.api_v23.ServerSince020`, which refuses at start-up, naming the
  option, what this cache does not honour.
"""

from __future__ import annotations

from typing import Any

from hiradix.sglang import api_v18
from hiradix.sglang.api_v23 import ServerSince020

__all__ = ["HiRadixCache"]


class HiRadixCache(ServerSince020, api_v18.HiRadixCache):
    """hiradix's ``HiRadixCache`` for SGLang 0.5.20 (module docstring): 0.5.18's request
    calls on 0.5.20's request record, in 0.5.23's server."""

    @staticmethod
    def _kv_record(req: Any) -> Any:
        """0.5.20 keeps ``req_pool_idx`` and ``cache_protected_len`` on ``req.kv``."""
        return req.kv

    @staticmethod
    def _insert_extras(req: Any) -> dict[str, Any]:
        """0.5.20's inserts name the request's session: its KV events' stores carry it."""
        return {"session_id": getattr(req, "session_id", None)}
