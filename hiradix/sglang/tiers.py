"""The adapter's calls that move KV between the tiers: SGLang's eviction, backup and
load-back calls and the step's event checks, on the core cache, with SGLang's metrics
(:class:`TierCalls`, a part of the adapter), and what the scheduler reads to tell whether
the cache is idle, and its contents for debugging.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult

from hiradix.sglang.paths import TreePaths
from hiradix.tree import NO_NODE

if TYPE_CHECKING:
    from hiradix.sglang.controller import SGLangCacheController
    from hiradix.sglang.metrics import MetricsReporter

__all__ = ["TierCalls"]


class TierCalls(TreePaths):
    """SGLang's calls that evict, back up and load KV, and the cache's in-flight work and
    sizes: a base of :class:`~hiradix.sglang.cache.HiRadixCacheBase`, which sets the
    fields below."""

    disable: bool
    cache_controller: SGLangCacheController
    metrics: MetricsReporter | None

    if TYPE_CHECKING:  # SGLang's BasePrefixCache's, a base of the adapter beside this one

        def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None: ...

    # SGLang's scheduler reads these to tell whether the cache is idle (before a flush or
    # a storage attach / detach): the core's in-flight operations.
    @property
    def ongoing_write_through(self) -> dict[int, Any]:
        return self.core.ongoing_write_through

    @property
    def ongoing_load_back(self) -> dict[int, Any]:
        return self.core.ongoing_load_back

    @property
    def ongoing_prefetch(self) -> dict[Any, Any]:
        return self.core.storage.ongoing_prefetch

    @property
    def ongoing_backup(self) -> list[Any]:
        return self.core.storage.ongoing_backup

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return int(self.tree.evictable_size())

    def protected_size(self) -> int:
        return int(self.tree.protected_size())

    def total_size(self) -> int:
        """Tokens cached on the device. ``O(1)``."""
        return int(self.tree.device_size())

    # ------------------------------------------------------------------ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens if possible (demote backed-up
        leaves, drop the rest; write-back backs up first). ``O(k log n)``."""
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        freed = self.core.evict(int(params.num_tokens))
        self._sync_events()
        if self.metrics is not None:
            self.update_eviction_metrics(freed, start)
            self.metrics.note_evicted(freed)
        return EvictResult(num_tokens_evicted=freed)

    def write_backup(self, node: Any, write_back: bool = False) -> int:
        """SGLang 0.5.18's ``HiRadixCache.write_backup``: start copying a device node's KV
        to host (evicting host KV for room once if needed) and return the tokens whose copy
        started; 0 when the node's parent is neither backed up nor being backed up (no gap
        in the backed-up chain), the node is on host already or in flight, or the host has
        no room. The copy completes, and the node counts as backed up, at a later
        ``writing_check`` / ``check_hicache_events``. ``write_back`` is accepted for
        SGLang's signature; unlike SGLang, hiradix keeps the parent rule under it too
        (its write-back evictions back a chain up parents first). ``O(tokens)``."""
        if self.disable:
            return 0
        started = self.core.write_backup(self._handle(node))
        self._sync_events()
        return started

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host-only tokens if possible. ``O(k log n)``."""
        freed = self.core.evict_host(num_tokens)
        self._sync_events()
        return freed

    # ------------------------------------------------------------------ load back
    def ready_to_load_host_cache(self) -> int:
        """Start the queued loads as one layer-wise load; the layer-done counter's slot
        index for the batch (``-1``: nothing to load)."""
        return self.core.ready_to_load_host_cache()

    def is_load_back_event_done(self, consumer_index: int) -> bool:
        if consumer_index < 0:
            return True
        if not self.cache_controller.layer_done_counter.events[consumer_index].finish_event.query():
            return False
        self.core.loading_check()
        return True

    def loading_check(self) -> None:
        self.core.loading_check()
        self._report_transfers()

    def writing_check(self, write_back: bool = False) -> None:
        self.core.writing_check(write_back=write_back)
        self._sync_events()
        self._report_transfers()

    def check_hicache_events(self) -> None:
        self.core.check_hicache_events()
        self._sync_events()
        self._report_transfers()

    def _report_transfers(self) -> None:
        """With ``--enable-metrics``, what the cache did since the last report, in
        SGLang's own metrics (:mod:`hiradix.sglang.metrics`). ``O(acks)``."""
        if self.metrics is not None:
            self.metrics.report(self.core)

    # ------------------------------------------------------------------ introspection
    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree holds, depth first. ``O(n)``."""
        out: list[np.ndarray] = []
        stack = [self.root_handle, *self._namespaces.values()]
        while stack:
            h = stack.pop()
            v = self.tree.value(h)
            if v is not None and self.tree.parent(h) != NO_NODE:
                out.append(v)
            stack.extend(self.tree.children(h))
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.from_numpy(np.concatenate(out)).to(self.device)

    def pretty_print(self) -> None:
        """Print the tree, one node per line (tokens, device/host state, lock count)."""
        tree = self.tree

        def walk(h: int, depth: int) -> None:
            key = tree.key(h)[:10].tolist()
            print(
                " " * depth + f"{tree.key_len(h)} {key} evicted={tree.is_evicted(h)} "
                f"backuped={tree.is_backed_up(h)} lock_ref={tree.lock_ref(h)}"
            )
            for c in self.tree.children(h):
                walk(c, depth + 2)

        for root in (self.root_handle, *self._namespaces.values()):
            walk(root, 0)
        print(f"#tokens: {self.total_size()}")
