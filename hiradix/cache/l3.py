"""The storage side of the controller: L3 <-> L2 prefetch and L2 -> L3 backup threads.

Three background threads, each with its own queue, move bytes between a
:class:`~hiradix.storage.base.StorageBackend` and the host pool; none of them touches
the tree (the cache does, on the scheduler thread, when it consumes their results):

- **prefetch thread**: for each :class:`PrefetchOperation`, computes the chained page
  hashes of its tokens, asks ``batch_exists`` in batches of ``batch_pages`` (128) pages,
  stopping at the first miss (longest prefix), and agrees the hit count across ranks by
  MIN. Below ``threshold_tokens`` (256) the operation is revoked; otherwise it goes to the
  IO thread. The agreement is made for *every* operation, in queue order, even one
  already terminated (with a local hit count of 0), so ranks never disagree on which
  collectives run.
- **IO thread**: reads the hit pages into the host slots allocated in advance
  (``batch_get_v1``, zero copy into the pool; ``batch_get`` for generic backends),
  batch by batch, stopping at the first page that fails or when the operation is
  terminated. ``completed_pages`` only ever counts pages that landed.
- **backup thread**: writes backed-up host pages to L3 (``batch_set_v1`` or
  ``batch_set``) while the cache keeps the node's host copy protected.

Slots of a prefetch that were allocated but not filled are released only once the IO
thread is done with the operation (the release queue), since a terminated operation may
still have a batch in flight.

No exception ends a thread. A backend that raises (its own ``batch_*`` override, a bad
host pool, a key function) or an agreement that fails turns into misses for that one
operation: a failed query counts 0 local hits (and the agreement is still made, so no
other rank waits on this one forever), a failed read keeps only the pages that landed
before it, a failed backup stores nothing. Each is logged with the backend's name (the
first of each kind with its traceback) and counted in :attr:`L3Controller.stats`
(``prefetch_query_errors``, ``agreement_errors``, ``prefetch_read_errors``,
``backup_errors``); every operation still reaches done.

Prefetch policies decide when the scheduler may stop waiting (:meth:`PrefetchConfig.can_terminate`):
``best_effort`` at once, ``wait_complete`` when the IO is done, ``timeout`` when done or
after ``min(timeout_max_s, timeout_base_s + timeout_per_ki_token_s * tokens / 1024)``
(defaults 2.0 s, 0.1 s per 1024 tokens, 30 s), measured on an injectable clock.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import hiradix
from hiradix.cache.distributed import LocalAgreement, RankAgreement
from hiradix.cache.stats import L3Stats, zeros
from hiradix.memory.pools import HostKVPool
from hiradix.storage.base import StorageBackend, StorageExtraInfo

__all__ = ["PREFETCH_POLICIES", "BackupOperation", "L3Controller", "PrefetchConfig", "PrefetchOperation"]

log = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

KeyFn = Callable[[Sequence[str]], list[str]]
"""Turns chained page hashes into storage keys (rank suffix, see :mod:`hiradix.storage.keys`)."""


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    """How L3 prefetches run (SGLang's ``--hicache-storage-prefetch-policy`` and friends).

    ``capacity_tokens`` bounds the host tokens held by prefetches in flight (default: half
    the host pool). It is checked against ``threshold_tokens`` when the controller is
    built, so prefetching cannot be silently disabled by a capacity that admits nothing.

    >>> PrefetchConfig(policy="timeout").timeout_for(4096)
    2.4
    """

    policy: str = "best_effort"
    threshold_tokens: int = 256
    batch_pages: int = 128
    timeout_base_s: float = 2.0
    timeout_per_ki_token_s: float = 0.1
    timeout_max_s: float = 30.0
    capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {self.policy!r}")
        if self.threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {self.threshold_tokens}")
        if self.batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {self.batch_pages}")
        for name in ("timeout_base_s", "timeout_per_ki_token_s", "timeout_max_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.capacity_tokens is not None and self.capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1 or None, got {self.capacity_tokens}")

    def timeout_for(self, tokens: int) -> float:
        """The ``timeout`` policy's deadline for a prefetch of ``tokens`` tokens (s)."""
        return round(min(self.timeout_max_s, self.timeout_base_s + self.timeout_per_ki_token_s * tokens / 1024), 9)


@dataclass(eq=False)
class PrefetchOperation:
    """One request's L3 -> L2 prefetch, shared between the scheduler and the threads.

    The threads write ``hit_pages``, ``completed_pages``, ``revoked`` and ``io_done``;
    the scheduler writes ``terminated``. All under ``lock``.
    """

    request_id: Any
    host_indices: torch.Tensor
    tokens: np.ndarray
    prior_hash: str | None
    start_time: float
    prefix_keys: list[str] | None = None  # storage keys of the pages before ``tokens``, for the backend
    keys: list[str] = field(default_factory=list)
    hit_pages: int = 0
    completed_pages: int = 0
    revoked: bool = False
    terminated: bool = False
    io_done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self) -> bool:
        """The threads are done with this operation (its slots may be freed)."""
        return self.io_done.is_set()


@dataclass(eq=False)
class BackupOperation:
    """One node's L2 -> L3 write."""

    op_id: int
    node: int
    keys: list[str]
    host_indices: torch.Tensor
    prefix_keys: list[str] | None = None  # storage keys of the node's ancestors' pages
    done: threading.Event = field(default_factory=threading.Event)
    stored_pages: int = 0


_STOP = object()


class L3Controller:
    """Runs the prefetch, IO and backup threads for one rank (module docstring).

    Parameters
    ----------
    backend:
        The L3 storage; ``register_mem_pool_host(host_pool)`` is called here.
    host_pool:
        The L2 pool the pages land in and are read from.
    config:
        Prefetch policy and limits.
    key_fn:
        Storage keys of chained page hashes (default: the hashes themselves).
    agreement:
        Agreement used *by the prefetch thread* for hit counts. With several ranks give
        it a process group of its own: its collectives run concurrently with the
        scheduler's.
    clock:
        Seconds, for prefetch start times (``time.monotonic`` by default).
    inline:
        Run every operation to completion in the caller's thread instead of on the three
        threads (same code, no hand-offs): for a simulator that would wait for each one
        anyway. A prefetch is then complete when :meth:`prefetch` returns.
    """

    def __init__(
        self,
        backend: StorageBackend,
        host_pool: HostKVPool,
        *,
        config: PrefetchConfig | None = None,
        key_fn: KeyFn | None = None,
        agreement: RankAgreement | None = None,
        clock: Callable[[], float] = time.monotonic,
        inline: bool = False,
    ) -> None:
        if not isinstance(backend, StorageBackend):
            raise TypeError(f"backend must be a StorageBackend, got {type(backend).__name__}")
        self.backend = backend
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.config = config or PrefetchConfig()
        capacity = self.config.capacity_tokens
        self.capacity_tokens = host_pool.size // 2 if capacity is None else capacity
        if self.capacity_tokens < max(self.config.threshold_tokens, self.page_size):
            raise ValueError(
                f"prefetch capacity {self.capacity_tokens} tokens is below the prefetch threshold "
                f"{self.config.threshold_tokens} (page {self.page_size}): no prefetch could ever run; "
                f"raise capacity_tokens or the host pool size, or lower threshold_tokens"
            )
        self.key_fn: KeyFn = key_fn or list
        self.agreement = agreement or LocalAgreement()
        self.clock = clock
        self.use_v1 = backend.capabilities.supports_v1
        if self.use_v1:
            backend.register_mem_pool_host(host_pool)
        self._prefetch_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._io_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._backup_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._backup_ids = 0
        self._stopped = False
        self._stats = zeros(L3Stats)  # counted here under _stats_lock; read as a snapshot (stats)
        self._stats_lock = threading.Lock()
        self.inline = inline
        self._threads = []
        if not inline:
            self._threads = [
                threading.Thread(target=self._prefetch_loop, name="hiradix-l3-prefetch", daemon=True),
                threading.Thread(target=self._io_loop, name="hiradix-l3-io", daemon=True),
                threading.Thread(target=self._backup_loop, name="hiradix-l3-backup", daemon=True),
            ]
        for t in self._threads:
            t.start()

    def get_stats(self) -> L3Stats:
        """A snapshot of the pipeline's counters (:class:`~hiradix.cache.stats.L3Stats`),
        taken under the lock the threads count under. ``O(counters)``."""
        with self._stats_lock:
            return L3Stats(**self._stats)

    @property
    def stats(self) -> dict[str, int]:
        """The same counters as a plain dict by name (a copy; the form they had before
        :meth:`get_stats`, kept for callers that read or serialize them so)."""
        return dataclasses.asdict(self.get_stats())

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _failed(self, kind: str, what: str) -> None:
        """Count and log an exception (being handled) that turned an operation into
        misses: ``kind`` is its stats counter. The first of each kind is logged with its
        traceback, later ones on one line each (a dead backend fails every operation)."""
        with self._stats_lock:
            self._stats[kind] += 1
            first = self._stats[kind] == 1
        exc = sys.exc_info()[1]
        log.warning(
            "L3 %s failed (backend %s, %s), treated as misses: %r",
            what,
            self.backend.name,
            type(self.backend).__name__,
            exc,
            exc_info=first,
        )

    # ------------------------------------------------------------------ scheduler side
    def prefetch(
        self,
        request_id: Any,
        host_indices: torch.Tensor,
        tokens: np.ndarray,
        prior_hash: str | None,
        prefix_hashes: Sequence[str] | None = None,
    ) -> PrefetchOperation:
        """Queue a prefetch of the page-aligned ``tokens`` into ``host_indices`` (one slot
        per token, allocated by the caller). ``prior_hash`` is the hash of the page before
        ``tokens`` (or the namespace seed, or ``None``). ``prefix_hashes``, the page hashes
        before ``tokens``, are handed to the backend as keys in each call's
        :class:`~hiradix.storage.base.StorageExtraInfo` (SGLang's
        ``hicache_storage_pass_prefix_keys``). ``O(1)`` plus ``O(prefix)``."""
        if self._stopped:
            raise RuntimeError("L3 controller is stopped")
        if len(tokens) % self.page_size or len(host_indices) != len(tokens):
            raise ValueError(f"prefetch of {len(tokens)} tokens into {len(host_indices)} slots (page {self.page_size})")
        op = PrefetchOperation(
            request_id,
            host_indices,
            np.asarray(tokens),
            prior_hash,
            self.clock(),
            prefix_keys=self.prefix_keys_of(prefix_hashes),
        )
        self._count(prefetch_ops=1)
        if self.inline:
            if self._query_and_decide(op):
                self._io_one(op)
        else:
            self._prefetch_q.put(op)
        return op

    def can_terminate(self, op: PrefetchOperation) -> bool:
        """Whether the policy lets the scheduler stop waiting for ``op`` now (rank-local;
        the cache agrees it across ranks). ``O(1)``."""
        with op.lock:
            if op.io_done.is_set() or op.revoked:
                return True
        policy = self.config.policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        return self.clock() - op.start_time >= self.config.timeout_for(len(op.tokens))

    def terminate(self, op: PrefetchOperation) -> int:
        """Stop ``op`` and return the pages that landed so far (rank-local; the threads
        read no further pages for it). ``O(1)``."""
        with op.lock:
            op.terminated = True
            return op.completed_pages

    def backup(
        self, node: int, hashes: Sequence[str], host_indices: torch.Tensor, prefix_hashes: Sequence[str] | None = None
    ) -> BackupOperation:
        """Queue an L2 -> L3 write of a node's pages (``hashes``: its chained page
        hashes, one per page of ``host_indices``; ``prefix_hashes``: its ancestors', for
        the backend, as in :meth:`prefetch`). The caller protects the node's host copy
        until :meth:`BackupOperation.done`. ``O(pages + prefix)``."""
        if self._stopped:
            raise RuntimeError("L3 controller is stopped")
        if len(hashes) * self.page_size != len(host_indices):
            raise ValueError(f"{len(hashes)} page hashes for {len(host_indices)} host slots (page {self.page_size})")
        self._backup_ids += 1
        op = BackupOperation(
            self._backup_ids, node, self.key_fn(hashes), host_indices, prefix_keys=self.prefix_keys_of(prefix_hashes)
        )
        self._count(backup_ops=1)
        if self.inline:
            self._backup_one(op)
        else:
            self._backup_q.put(op)
        return op

    def stop(self) -> None:
        """Finish every queued operation (terminated ones end at once) and join the
        threads. The prefetch thread still makes its agreement call for each queued
        operation, as every rank does. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.inline:
            return
        self._prefetch_q.put(_STOP)  # the prefetch thread forwards it to the IO thread
        self._backup_q.put(_STOP)
        for t in self._threads:
            t.join()

    # ------------------------------------------------------------------ threads
    def prefix_keys_of(self, prefix_hashes: Sequence[str] | None) -> list[str] | None:
        """The storage keys of the page hashes ``prefix_hashes`` (``None`` stays ``None``).
        ``O(prefix)``."""
        return None if prefix_hashes is None else self.key_fn(list(prefix_hashes))

    @staticmethod
    def _info(prefix: list[str] | None, keys: list[str], first: int) -> StorageExtraInfo | None:
        """The extra info of a call on ``keys[first:...]``: the keys of every page before
        it (SGLang grows its prefix batch by batch the same way). ``O(prefix)``."""
        if prefix is None:
            return None
        return StorageExtraInfo(prefix_keys=(*prefix, *keys[:first]))

    def _page_starts(self, host_indices: torch.Tensor, first: int, n: int) -> torch.Tensor:
        ps = self.page_size
        return host_indices[first * ps : (first + n) * ps : ps]

    def hit_pages(
        self, tokens: Any, prior_hash: str | None, prefix_keys: list[str] | None = None
    ) -> tuple[list[str], int]:
        """The L3 keys of the whole pages of ``tokens`` (chained from ``prior_hash``) and
        how many leading ones L3 holds, asked ``batch_pages`` at a time (``prefix_keys``:
        the storage keys before them, passed on). Rank-local, in the caller's thread; a
        backend error propagates. ``O(pages)``."""
        keys = self.key_fn(list(hiradix.page_hashes(tokens, self.page_size, prior_hash)))
        hits = 0
        step = self.config.batch_pages
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            got = self.backend.batch_exists(batch, self._info(prefix_keys, keys, start))  # errors: misses already
            hits += got
            if got < len(batch):
                break
        return keys, hits

    def _query(self, op: PrefetchOperation) -> int:
        """Hash the tokens and count the leading pages L3 holds."""
        op.keys, hits = self.hit_pages(op.tokens, op.prior_hash, op.prefix_keys)
        return hits

    def _query_and_decide(self, op: PrefetchOperation) -> bool:
        """Agree the hit count of ``op`` and decide its fate; ``True`` if its pages are
        to be read. The agreement call is made whatever this rank's state."""
        with op.lock:
            skip = op.terminated
        local = 0
        if not skip:
            try:
                local = self._query(op)
            except Exception:  # a miss on this rank; the agreement below must still run
                self._failed("prefetch_query_errors", f"query of prefetch {op.request_id!r}")
        try:
            hits = self.agreement.min_int(local)  # every op, every rank, in queue order
        except Exception:  # the collective itself failed: nothing can be agreed, nothing loads
            self._failed("agreement_errors", f"hit agreement of prefetch {op.request_id!r}")
            hits = 0
        enough = hits * self.page_size >= max(self.config.threshold_tokens, 1)
        with op.lock:
            op.hit_pages = hits
            if not enough or op.terminated:
                op.revoked = not enough
                op.io_done.set()
        if op.revoked:
            self._count(prefetch_revoked=1)
        if op.io_done.is_set():
            return False
        self._count(prefetch_hit_pages=hits)
        return True

    def _io_one(self, op: PrefetchOperation) -> None:
        try:
            self._transfer(op)
        except Exception:  # the pages that landed before it count; the rest are misses
            self._failed("prefetch_read_errors", f"read of prefetch {op.request_id!r}")
            with op.lock:
                lost = op.hit_pages - op.completed_pages
            self._count(prefetch_failed_pages=lost)
        finally:
            op.io_done.set()

    def _prefetch_loop(self) -> None:
        while True:
            op = self._prefetch_q.get()
            if op is _STOP:
                self._io_q.put(_STOP)
                return
            if self._query_and_decide(op):
                self._io_q.put(op)

    def _io_loop(self) -> None:
        while True:
            op = self._io_q.get()
            if op is _STOP:
                return
            self._io_one(op)

    def _transfer(self, op: PrefetchOperation) -> None:
        step = self.config.batch_pages
        for first in range(0, op.hit_pages, step):
            with op.lock:
                if op.terminated:
                    return
            n = min(step, op.hit_pages - first)
            keys = op.keys[first : first + n]
            starts = self._page_starts(op.host_indices, first, n)
            results = self._read(keys, starts, self._info(op.prefix_keys, op.keys, first))
            good = 0
            for ok in results:
                if not ok:
                    break
                good += 1
            with op.lock:
                op.completed_pages += good
            self._count(prefetch_loaded_pages=good, prefetch_failed_pages=n - good)
            if good < n:
                return  # longest prefix: pages after a failed one are useless

    def _read(self, keys: list[str], starts: torch.Tensor, info: StorageExtraInfo | None) -> list[bool]:
        if self.use_v1:
            return self.backend.batch_get_v1(keys, starts, info)
        # generic backend: read into one [n, page_bytes] buffer, scatter the good pages at once
        pool = self.host_pool
        buf = torch.empty((len(keys), pool.page_bytes), dtype=torch.uint8)
        got = self.backend.batch_get(keys, list(buf))
        out = [page is not None for page in got]
        good = [i for i, ok in enumerate(out) if ok]
        if good:
            pool.write_pages(starts[good], buf[good])
        return out

    def _backup_loop(self) -> None:
        while True:
            op = self._backup_q.get()
            if op is _STOP:
                return
            self._backup_one(op)

    def _backup_one(self, op: BackupOperation) -> None:
        try:
            starts = self._page_starts(op.host_indices, 0, len(op.keys))
            if self.use_v1:
                results = self.backend.batch_set_v1(op.keys, starts, self._info(op.prefix_keys, op.keys, 0))
                stored = sum(results)
            else:
                pages = torch.empty((len(op.keys), self.host_pool.page_bytes), dtype=torch.uint8)
                self.host_pool.read_pages(starts, pages)
                stored = len(op.keys) if self.backend.batch_set(op.keys, list(pages)) else 0
            op.stored_pages = stored
            self._count(backup_pages=stored, backup_failed_pages=len(op.keys) - stored)
        except Exception:  # a storage error is a failed backup (a later miss), never a crash
            op.stored_pages = 0
            self._failed("backup_errors", f"backup of node {op.node}")
            self._count(backup_failed_pages=len(op.keys))
        finally:
            op.done.set()
