"""hiradix's counters in SGLang's own metrics (``--enable-metrics``), named and meant as
SGLang's hierarchical cache reports them.

SGLang's cache pushes into two collectors: the radix cache's (evictions, device <-> host
transfers, their durations, tokens dropped without a host copy) and, while an L3 is
attached, the storage one (``sglang:prefetched_tokens_total``, ``sglang:backuped_tokens_total``
and, on 0.5.20 and later, the L3 hits and the prefetch outcomes that came to nothing, by
SGLang's reason). hiradix counts all of it in its own stats (:class:`~hiradix.cache.stats`);
:class:`MetricsReporter` hands SGLang the difference since its last report, once per
scheduler step. Methods a version's collector lacks are skipped.

SGLang's own durations are CUDA-event timings and so absent on CPU; hiradix's come from
its copy engines' clocks (the thread engine and the inline writes; the CUDA engine does
not time its copies).
"""

from __future__ import annotations

import logging
from typing import Any

from hiradix.cache import HiRadixCache as CoreCache

logger = logging.getLogger(__name__)

#: SGLang's ``PoolName.KV``: the pool label of the target model's KV.
KV_POOL = "kv"


class MetricsReporter:
    """Pushes what the cache did since the last :meth:`report` into SGLang's radix cache
    ``collector`` (and :attr:`storage`, SGLang's ``StorageMetricsCollector``, while an
    L3 is attached and metrics are on). Counters only go up: each report hands over the
    difference from the values seen last."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self.storage: Any = None
        self._seen: dict[str, int] = {}
        self._l3: Any = None  # the L3 controller whose counters _seen holds ("l3." keys)

    def _delta(self, name: str, value: int) -> int:
        last = self._seen.get(name, 0)
        self._seen[name] = value
        return value - last

    def note_evicted(self, tokens: int) -> None:
        """``tokens`` device evictions the caller reported itself (SGLang's
        ``update_eviction_metrics`` in ``evict()``): not reported again."""
        self._seen["device_evicted"] = self._seen.get("device_evicted", 0) + tokens

    def attach_storage(self, backend: str, labels: dict[str, Any]) -> None:
        """Start reporting L3 metrics with SGLang's ``StorageMetricsCollector`` labelled
        as stock labels it (``storage_backend`` is the ``--hicache-storage-backend``
        name). One collector per process, relabelled on a later attach: a second would
        register its metrics twice."""
        from sglang.srt.observability.metrics_collector import StorageMetricsCollector

        labels = {"storage_backend": backend, **labels}
        if self.storage is None:
            self.storage = StorageMetricsCollector(labels=labels)
        elif set(self.storage.labels) == set(labels):
            self.storage.labels = labels
        else:
            logger.warning(
                "hiradix: storage metrics keep their labels %s (not %s): registered once per process",
                sorted(self.storage.labels),
                sorted(labels),
            )

    def report(self, core: CoreCache) -> None:
        """Hand SGLang the counters' growth since the last call. ``O(acks)``."""
        c = self.collector
        stats = core.get_stats()
        # Device evictions the cache made on its own (room for a load back) count as
        # SGLang's own load back counts them (it calls evict()).
        evicted = self._delta("device_evicted", stats.device_evicted_tokens)
        if evicted > 0:
            c.increment_eviction_num_tokens(evicted)
        dropped = self._delta("dropped", stats.write_back_dropped_tokens)
        if dropped > 0 and hasattr(c, "increment_dropped_tokens"):
            # Write-back nodes evicted without a host copy: SGLang's "host_pressure".
            c.increment_dropped_tokens(num_tokens=dropped, reason="host_pressure", pool=KV_POOL)
        controller = core.cache_controller
        transfers = controller.get_stats()
        per_token = controller.device_pool.bytes_per_token
        backed = self._delta("backup", transfers.backup_tokens)
        if backed > 0:
            c.increment_backup_num_tokens(num_tokens=backed, pool=KV_POOL)
            c.increment_backup_num_bytes(backed * per_token)
        loaded = self._delta("load", transfers.load_tokens)
        if loaded > 0:
            c.increment_load_back_num_tokens(num_tokens=loaded, pool=KV_POOL)
            c.increment_load_back_num_bytes(loaded * per_token)
        for seconds in controller.pop_durations("backup"):
            c.observe_backup_duration(seconds)
        for seconds in controller.pop_durations("load"):
            c.observe_load_back_duration(seconds)
        if self.storage is not None and core.storage.l3 is not None:
            self._report_storage(core, stats)

    def _report_storage(self, core: CoreCache, stats: Any) -> None:
        s, l3, page = self.storage, core.storage.l3, core.page_size
        assert l3 is not None
        if l3 is not self._l3:  # a new attach: its controller counts from zero
            self._seen = {k: v for k, v in self._seen.items() if not k.startswith("l3.")}
            self._l3 = l3
        l3_stats = l3.get_stats()
        counts: list[tuple[Any, tuple[str, ...], int]] = [
            (s.log_prefetched_tokens, (), self._delta("prefetched", stats.prefetch_loaded_tokens)),
            (s.log_backuped_tokens, (), self._delta("l3.backup", l3_stats.backup_pages) * page),
        ]
        if hasattr(s, "log_storage_prefetch_hit_tokens"):  # SGLang 0.5.20 and later
            unfulfilled = s.log_storage_prefetch_unfulfilled_tokens
            counts += [
                (s.log_storage_prefetch_hit_tokens, (), self._delta("l3.hit", l3_stats.prefetch_hit_pages) * page),
                # Prefetches that came to nothing, by SGLang's reason: pages found but not
                # read, and prefetches without host slots for them.
                (unfulfilled, ("storage_transfer",), self._delta("l3.failed", l3_stats.prefetch_failed_pages) * page),
                (unfulfilled, ("host_capacity",), self._delta("no_host", stats.prefetch_skipped_no_host)),
            ]
        for log, reason, n in counts:
            if n > 0:
                log(n, *reason)
