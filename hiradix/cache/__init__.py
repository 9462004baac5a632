"""The cache layer: the tree, the KV pools and the tiers' copies behind SGLang-shaped methods.

- :mod:`~hiradix.cache.cache`: :class:`HiRadixCache`, the tree plus pools plus controller
  plus L3, its option objects (:class:`TreeOptions`, :class:`TierOptions`) and the request
  and observer types it takes;
- :mod:`~hiradix.cache.storage_tier`: :class:`StorageTier`, the cache's L3 prefetches and
  backups between the tree and the L3 threads, configured by :class:`StorageOptions`;
- :mod:`~hiradix.cache.controller`: :class:`HiCacheController`, the L1 <-> L2 queues and
  copy engines;
- :mod:`~hiradix.cache.l3`: :class:`L3Controller`, the L3 <-> L2 prefetch, IO and backup
  threads;
- :mod:`~hiradix.cache.distributed`: :class:`RankAgreement`, how a rank-local fact reaches
  every rank before the trees change;
- :mod:`~hiradix.cache.results`: :class:`CacheMatchResult`, what ``match_prefix`` found;
- :mod:`~hiradix.cache.stats`: the frozen snapshots of their counters (:class:`CacheStats`,
  :class:`ControllerStats`, :class:`L3Stats`).

``hiradix.cache.HiRadixCache`` is the public path (the names below are re-exported here; they
keep the module they are defined in, so that ``inspect`` finds their source).
"""

from hiradix.cache.cache import (
    CacheObserver,
    DeviceAllocator,
    HiRadixCache,
    Req,
    TierOptions,
    TreeFactory,
    TreeOptions,
)
from hiradix.cache.controller import HiCacheController
from hiradix.cache.distributed import LocalAgreement, MinReduceAgreement, RankAgreement, TorchDistAgreement
from hiradix.cache.l3 import PREFETCH_POLICIES, L3Controller, PrefetchConfig
from hiradix.cache.results import CacheMatchResult
from hiradix.cache.stats import CacheStats, ControllerStats, L3Stats
from hiradix.cache.storage_tier import OngoingPrefetch, StorageOptions, StorageTier

__all__ = [
    "PREFETCH_POLICIES",
    "CacheMatchResult",
    "CacheObserver",
    "CacheStats",
    "ControllerStats",
    "DeviceAllocator",
    "HiCacheController",
    "HiRadixCache",
    "L3Controller",
    "L3Stats",
    "LocalAgreement",
    "MinReduceAgreement",
    "OngoingPrefetch",
    "PrefetchConfig",
    "RankAgreement",
    "Req",
    "StorageOptions",
    "StorageTier",
    "TierOptions",
    "TorchDistAgreement",
    "TreeFactory",
    "TreeOptions",
]
