"""The cache layer's statistics: frozen snapshots of each part's counters, as storage has
them (:meth:`StorageBackend.get_stats <hiradix.storage.base.StorageBackend.get_stats>`).

Each part counts into a private dict on its hot path (one ``+=`` per event, as before) and
``get_stats()`` hands out a snapshot: :meth:`HiRadixCache.get_stats
<hiradix.cache.HiRadixCache.get_stats>` a :class:`CacheStats`,
:meth:`HiCacheController.get_stats <hiradix.cache.HiCacheController.get_stats>` a
:class:`ControllerStats`, :meth:`L3Controller.get_stats
<hiradix.cache.L3Controller.get_stats>` an :class:`L3Stats`. The ``stats`` attribute each
had, a dict by counter name, stays for the callers that read it that way (and serialize it
as JSON): it is now a read-only copy, ``dataclasses.asdict(get_stats())``.

>>> s = ControllerStats(backup_tokens=8, load_tokens=4, backup_failed_tokens=0, load_failed_tokens=0)
>>> s.backup_tokens, dataclasses.asdict(s)["load_tokens"]
(8, 4)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["TIER_COUNTERS", "CacheStats", "ControllerStats", "L3Stats", "zeros"]


def zeros(cls: type) -> dict[str, int]:
    """A fresh counter dict for the fields of the stats class ``cls``, all 0: what the owner
    counts into on its hot path (one ``+=`` per event). ``O(fields)``."""
    return {f.name: 0 for f in dataclasses.fields(cls)}


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of a :class:`~hiradix.cache.HiRadixCache`, in tokens unless named otherwise.

    ``backup_*``: device -> host backups started, landed on every rank, failed;
    ``host_alloc_failed_tokens``: backups skipped for want of host slots;
    ``load_back_tokens`` / ``load_retries``: host -> device loads and their retries after a
    device allocation failed; ``device_evicted_tokens`` / ``host_evicted_tokens``: freed by
    eviction; ``write_back_dropped_tokens``: write-back nodes evicted without a host copy;
    ``prefetch_*``: L3 prefetches started, skipped (the L3 pipeline's capacity full, no
    host slots), loaded, and wasted (slots allocated but not filled);
    ``storage_backup_tokens``: queued for backup to L3.
    """

    backup_started_tokens: int
    backup_done_tokens: int
    backup_failed_tokens: int
    host_alloc_failed_tokens: int
    load_back_tokens: int
    load_retries: int
    device_evicted_tokens: int
    write_back_dropped_tokens: int
    host_evicted_tokens: int
    prefetch_started_tokens: int
    prefetch_skipped_capacity: int
    prefetch_skipped_no_host: int
    prefetch_loaded_tokens: int
    prefetch_wasted_tokens: int
    storage_backup_tokens: int


#: The :class:`CacheStats` counters the cache's L3 side
#: (:class:`~hiradix.cache.storage_tier.StorageTier`) counts in its own dict; the cache counts
#: the others in its own, and :meth:`HiRadixCache.get_stats
#: <hiradix.cache.HiRadixCache.get_stats>` puts the two together.
TIER_COUNTERS = (
    "prefetch_started_tokens",
    "prefetch_skipped_capacity",
    "prefetch_skipped_no_host",
    "prefetch_loaded_tokens",
    "prefetch_wasted_tokens",
    "storage_backup_tokens",
)


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """Counters of a :class:`~hiradix.cache.HiCacheController`: tokens of the acknowledged
    backups and loads, and of those whose copy failed on some rank."""

    backup_tokens: int
    load_tokens: int
    backup_failed_tokens: int
    load_failed_tokens: int


@dataclass(frozen=True, slots=True)
class L3Stats:
    """Counters of an :class:`~hiradix.cache.L3Controller`.

    ``prefetch_ops`` / ``prefetch_revoked``: prefetch operations queued, and revoked below
    the threshold; ``prefetch_hit_pages`` / ``prefetch_loaded_pages`` /
    ``prefetch_failed_pages``: pages found in L3 (agreed), read into the host pool, and not
    read; ``backup_ops`` / ``backup_pages`` / ``backup_failed_pages``: backups to L3;
    ``*_errors``: exceptions turned into misses, by kind (module docstring of
    :mod:`hiradix.cache.l3`).
    """

    prefetch_ops: int
    prefetch_revoked: int
    prefetch_hit_pages: int
    prefetch_loaded_pages: int
    prefetch_failed_pages: int
    backup_ops: int
    backup_pages: int
    backup_failed_pages: int
    prefetch_query_errors: int
    agreement_errors: int
    prefetch_read_errors: int
    backup_errors: int
