"""Rank agreement over SGLang's cache process groups, as SGLang 0.5.18's HiRadixCache
agrees: MIN over the attention CP and TP groups (or the TP group when neither spans more
than one rank) on the first pipeline stage, then the first stage's answer handed down the
pipeline, so every rank of every stage acts on the same value. The hand-down carries
SGLang's own point-to-point tag for it, as SGLang's caches send theirs."""

from __future__ import annotations

from typing import Any

import torch

from hiradix.cache.distributed import MinReduceAgreement

__all__ = ["PP_SYNC_TAG", "SGLangAgreement"]


def _pp_sync_tag() -> int:
    """SGLang's tag for the cache's pipeline hand-down (``P2PTag.HIRADIX_PP_SYNC`` on
    0.5.18, renamed ``HICACHE_PP_SYNC`` by 0.5.23; both ``b"PpHi"`` read as a big-endian
    integer): the scheduler's own untagged sends between stages share the pipeline group,
    and a receive of the default tag could take one of theirs (or they one of ours)."""
    try:
        from sglang.srt.distributed.communication_tags import P2PTag
    except ImportError:  # a release without the module: the value both known releases use
        return int.from_bytes(b"PpHi", byteorder="big")
    for name in ("HICACHE_PP_SYNC", "HIRADIX_PP_SYNC"):
        tag = getattr(P2PTag, name, None)
        if tag is not None:
            return int(tag)
    return int.from_bytes(b"PpHi", byteorder="big")


#: The point-to-point tag of the pipeline hand-down (:func:`_pp_sync_tag`).
PP_SYNC_TAG = _pp_sync_tag()


def _world(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group=group))


def _same_rank_groups(groups: list[Any]) -> list[Any]:
    """New gloo groups with the ranks of each of ``groups``, in order.

    ``torch.distributed.new_group`` must be called by every rank of the world, with the
    same ranks, in the same order, while each rank holds only the groups it is in: under
    attention TP and CP, rank 0's are ``{0, 2}`` and ``{0, 1}``, rank 1's ``{1, 3}`` and
    ``{0, 1}``. So every rank shares its groups' ranks (one ``all_gather_object`` over the
    world) and all of them create every distinct group, in sorted order, each keeping its
    own. ``O(world x groups)`` to gather, one ``new_group`` per distinct group."""
    import torch.distributed as dist

    mine = [tuple(sorted(dist.get_process_group_ranks(g))) for g in groups]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    created = {
        ranks: dist.new_group(ranks=list(ranks), backend="gloo")
        for ranks in sorted({tuple(r) for per_rank in gathered for r in per_rank})
    }
    return [created[ranks] for ranks in mine]


class SGLangAgreement(MinReduceAgreement):
    """MIN-agreement over ``CacheInitParams``' groups (``tp_cache_group``,
    ``attn_cp_cache_group``, ``attn_tp_cache_group``, ``pp_cache_group``).

    Pipeline stages after the first receive the first stage's values instead of reducing
    (one small point-to-point message per call; the sends are reaped at the next call, so
    a stage never waits for the one after it). With one rank it reduces nothing.
    """

    def __init__(
        self,
        tp_group: Any = None,
        attn_cp_group: Any = None,
        attn_tp_group: Any = None,
        pp_group: Any = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> None:
        self.reduce_groups = [g for g in (attn_cp_group, attn_tp_group) if _world(g) > 1]
        if not self.reduce_groups and _world(tp_group) > 1:
            self.reduce_groups = [tp_group]
        self.pp_group = pp_group if pp_size > 1 and _world(pp_group) > 1 else None
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self._sends: list[Any] = []
        self.calls = 0

    def for_background_thread(self) -> SGLangAgreement:
        """An agreement over fresh process groups with the same ranks, for the L3 prefetch
        thread: collectives of two threads on one group would interleave differently on
        each rank (SGLang gives its prefetch thread groups of its own for the same
        reason). No pipeline hand-off: the prefetch outcome is agreed again by the
        scheduler thread. Every rank of the world must call it together (``new_group`` is
        collective over the world, see :func:`_same_rank_groups`)."""
        clone = SGLangAgreement()
        clone.reduce_groups = _same_rank_groups(self.reduce_groups)
        return clone

    def close(self) -> None:
        """Wait for the hand-downs still in flight: a stage that exited with its last one
        unsent would leave the next stage waiting in a receive (a reset connection, or
        a hang)."""
        for work in self._sends:
            work.wait()
        self._sends.clear()

    @property
    def single_rank(self) -> bool:
        return not self.reduce_groups and self.pp_group is None

    def _reduce_min(self, values: list[int]) -> list[int]:
        if self.single_rank:
            return values
        import torch.distributed as dist

        self.calls += 1
        t = torch.tensor(values, dtype=torch.int64)
        if self.pp_rank == 0:
            for group in self.reduce_groups:
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        if self.pp_group is not None:
            for work in self._sends:
                work.wait()
            self._sends.clear()
            if self.pp_rank > 0:
                dist.recv(t, group_src=self.pp_rank - 1, group=self.pp_group, tag=PP_SYNC_TAG)
            if self.pp_rank + 1 < self.pp_size:
                self._sends.append(
                    dist.isend(t.clone(), group_dst=self.pp_rank + 1, group=self.pp_group, tag=PP_SYNC_TAG)
                )
        return [int(v) for v in t.tolist()]
