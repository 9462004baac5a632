"""Agreement across ranks: the only way a rank-local fact may reach a collective.

With tensor (or pipeline) parallelism every rank runs its own tree, pools and copy
engines, and the trees must stay identical, or the ranks stop calling the same
collectives in the same order and the job hangs: the most common hard failure reported
against SGLang's HiCache. Its causes are all alike. A rank-local condition (an empty
queue, a copy that finished early, a host allocation that failed) decided whether a
collective ran, or changed the tree on one rank only.

hiradix therefore routes every such fact through a :class:`RankAgreement` before acting
on it, and the *number* of agreement calls made depends only on values that were
themselves agreed or on tree state (identical on every rank). Two operations suffice:

``min_int(x)``
    The minimum of one integer over the ranks: how many queued transfers have finished
    everywhere (SGLang's ``all_reduce(..., ReduceOp.MIN)`` in ``writing_check``).
``all_true(flags)``
    Element-wise AND of a list of booleans of the same length on every rank: which host
    allocations, copies or loads succeeded everywhere.

:class:`LocalAgreement` is the single-rank identity (no communication). For several ranks,
:class:`TorchDistAgreement` runs one ``all_reduce(MIN)`` per call over a
``torch.distributed`` process group (gloo on CPU, NCCL with a CUDA tensor device).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LocalAgreement", "MinReduceAgreement", "RankAgreement", "TorchDistAgreement"]


class RankAgreement(ABC):
    """Agreement over the ranks of one model replica. Calls are collective: every rank
    must make the same calls, in the same order, with lists of the same length."""

    world_size: int = 1
    rank: int = 0

    @abstractmethod
    def min_int(self, value: int) -> int:
        """The minimum of ``value`` over the ranks."""

    @abstractmethod
    def all_true(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise AND of ``flags`` over the ranks (``len(flags)`` may be 0, in which
        case no communication happens: the length is agreed by construction)."""

    def close(self) -> None:
        """Finish whatever this rank still owes the others (an agreement that hands its
        values on without waiting, as a pipeline stage does, sends the last one here);
        every rank calls it once, when its cache closes. No-op by default."""
        return None


class LocalAgreement(RankAgreement):
    """One rank: every value is already agreed.

    >>> LocalAgreement().min_int(3), LocalAgreement().all_true([True, False])
    (3, [True, False])
    """

    def min_int(self, value: int) -> int:
        return int(value)

    def all_true(self, flags: Sequence[bool]) -> list[bool]:
        return [bool(f) for f in flags]


class MinReduceAgreement(RankAgreement):
    """An agreement made of one collective: an element-wise MIN over a list of integers
    (:meth:`_reduce_min`). ``min_int`` reduces one value; ``all_true`` reduces 0/1 flags,
    and makes no call for an empty list."""

    @abstractmethod
    def _reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of ``values`` over the ranks (one collective)."""

    def min_int(self, value: int) -> int:
        return self._reduce_min([int(value)])[0]

    def all_true(self, flags: Sequence[bool]) -> list[bool]:
        if not flags:
            return []
        return [v == 1 for v in self._reduce_min([1 if f else 0 for f in flags])]


class TorchDistAgreement(MinReduceAgreement):
    """Agreement through ``torch.distributed.all_reduce(MIN)`` on ``group``.

    Parameters
    ----------
    group:
        The process group (``None``: the default group). It must be initialized.
    device:
        Device of the reduced tensors: ``"cpu"`` for gloo, a CUDA device for NCCL.

    Each call is one ``all_reduce`` of ``O(len(flags))`` integers. ``calls`` counts them,
    so tests can check that every rank made the same number.
    """

    def __init__(self, group: Any = None, device: str | torch.device = "cpu") -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self.group = group
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls = 0

    def _reduce_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        self.calls += 1
        return [int(v) for v in t.tolist()]
