"""What the cache's calls return: a leaf of :mod:`hiradix.cache` that imports none of its
modules, so that the cache (:mod:`~hiradix.cache.cache`) and its L3 side
(:mod:`~hiradix.cache.storage_tier`) both take these types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CacheMatchResult"]


@dataclass(frozen=True, slots=True)
class CacheMatchResult:
    """What :meth:`HiRadixCache.match_prefix <hiradix.cache.cache.HiRadixCache.match_prefix>`
    found (SGLang's ``MatchResult``).

    ``device_indices`` (int64 tensor) are the device slots of the matched prefix on the
    device. ``host_hit_length`` more tokens are on the host only, in the evicted chain
    that ends at ``last_node``: pass ``last_node`` to :meth:`HiRadixCache.init_load_back
    <hiradix.cache.cache.HiRadixCache.init_load_back>`. ``last_host_node`` is the deepest
    backed-up node at or above ``last_device_node``.
    """

    device_indices: torch.Tensor
    last_device_node: int
    last_host_node: int
    host_hit_length: int
    last_node: int
