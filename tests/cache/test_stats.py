"""The cache layer's statistics are frozen dataclasses (``hiradix.cache.stats``), as
storage's are: ``get_stats()`` of the cache, the controller and the L3 pipeline returns a
typed snapshot taken at the call; ``stats`` stays the dict by name it was, now a copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hiradix.cache import CacheStats, ControllerStats, L3Stats
from hiradix.cache.l3 import PrefetchConfig
from hiradix.cache.stats import TIER_COUNTERS
from hiradix.storage import MemoryStorage
from tests.cache.test_cache import compute, make_cache


def test_cache_and_controller_stats_are_frozen_snapshots() -> None:
    with make_cache(page_size=4) as cache:
        before = cache.get_stats()
        assert isinstance(before, CacheStats) and isinstance(cache.cache_controller.get_stats(), ControllerStats)
        assert cache.stats == dict.fromkeys(cache.stats, 0) == dataclasses.asdict(before)
        compute(cache, np.arange(40) * 3)
        cache.flush()
        after, ctl = cache.get_stats(), cache.cache_controller.get_stats()
        assert after.backup_done_tokens == 40 == ctl.backup_tokens == cache.stats["backup_done_tokens"]
        assert before.backup_done_tokens == 0, "a snapshot does not follow later counts"
        with pytest.raises(dataclasses.FrozenInstanceError):
            after.backup_done_tokens = 0  # type: ignore[misc]
        copy = cache.stats
        copy["backup_done_tokens"] = -1
        assert cache.get_stats().backup_done_tokens == 40, "the dict is a copy, not the counters"


def test_l3_stats_snapshot() -> None:
    with make_cache(page_size=4) as cache:
        config = PrefetchConfig(threshold_tokens=4)
        ok, why = cache.storage.attach_storage_backend(MemoryStorage(), prefetch=config, inline=True)
        assert ok, why
        assert cache.storage.l3 is not None
        compute(cache, np.arange(32) * 5)
        cache.flush()
        snap = cache.storage.l3.get_stats()
        assert isinstance(snap, L3Stats)
        assert snap.backup_pages == 8 == cache.storage.l3.stats["backup_pages"]
        assert dataclasses.asdict(snap) == cache.storage.l3.stats


def test_the_cache_and_its_storage_tier_count_apart() -> None:
    # Each owns its counters; the cache's snapshot puts the two together.
    with make_cache(page_size=4) as cache:
        ok, why = cache.storage.attach_storage_backend(MemoryStorage(), inline=True)
        assert ok, why
        compute(cache, np.arange(32) * 5)
        cache.flush()
        tier = cache.storage.counters()
        assert set(tier) == set(TIER_COUNTERS) and tier["storage_backup_tokens"] == 32
        tier["storage_backup_tokens"] = -1  # a copy
        snap = cache.get_stats()
        assert snap.storage_backup_tokens == 32 and snap.backup_done_tokens == 32
        assert set(dataclasses.asdict(snap)) == set(cache.stats) and not set(TIER_COUNTERS) - set(cache.stats)
