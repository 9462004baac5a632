"""Result records of the pure-Python tree, and the node states and errors both trees share.

The Cython core returns ``cdef class`` records with the same names and read-only
attributes (constructing a dataclass from C costs more than the whole match); tests
compare the two attribute by attribute. :class:`IOStatus` and :class:`LockError` are
used by both implementations as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]


class IOStatus(enum.IntEnum):
    """Transfer state of a node, as ``HiRadixTree.io_status`` reports it (SGLang's
    ``tree_v2`` ``IOStatus``). The values are the core's ``IO_*`` constants."""

    IDLE = 0  # no copy in flight
    WRITING = 1  # device -> host backup in flight (begin_backup .. commit_backup)
    LOADING = 2  # host -> device load in flight (begin_load_back .. finish_load_back)


class LockError(RuntimeError):
    """A call that breaks the tree's locking or transfer protocol.

    Raised, with the tree left unchanged, for a release of something not held
    (``dec_lock_ref`` on a node that holds no lock of its own, ``dec_host_ref`` at zero),
    for a transfer finished that is not in flight on that node (a second
    ``commit_backup``, ``finish_load_back`` without a load, either one on a node split
    off the one the transfer was begun on), for a backup begun on a node whose backup is
    already in flight, and for freeing a node that something still pins (``demote`` or
    ``drop`` of a locked node, which includes every node with a copy in flight). Each of
    these would otherwise let a copy read or write slots that were handed out again.
    """


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices`` are the L1 KV indices of the matched prefix that is still on the
    device; ``host_hit_length`` tokens follow it on the evicted (host-only) tail that
    ends at ``last_node``, the deepest matched node. ``last_host_node`` is the deepest
    backed-up node at or above ``last_device_node``: the L2 anchor that the evicted tail
    hangs from (the seed's worked example: Node_A, not the tail's end).
    """

    device_indices: IndexArray
    last_device_node: int
    last_host_node: int
    host_hit_length: int
    last_node: int


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What ``insert`` did.

    ``prefix_len`` tokens were already on the device: the caller frees its own indices
    for them. ``backup_nodes`` must be backed up, in this order (parents first), to honour
    the write-through policy.
    """

    prefix_len: int
    last_node: int
    backup_nodes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InsertHostResult:
    """What ``insert_host`` did: ``matched_length`` tokens were already in the tree,
    the next ``inserted_length`` now live in a new host-only node. The caller frees the
    host indices of every other token."""

    matched_length: int
    inserted_length: int
    last_node: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What ``evict`` did.

    ``device_indices`` are to be freed now. Under write_back, ``write_back_nodes`` were
    chosen but are not backed up yet: back up ``backup_nodes`` (parents first), then
    ``demote`` each write-back node. ``num_evicted`` counts both.
    """

    num_evicted: int
    device_indices: IndexArray
    write_back_nodes: tuple[int, ...]
    backup_nodes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EvictHostResult:
    """What ``evict_host`` did: ``host_indices`` are to be freed."""

    num_evicted: int
    host_indices: IndexArray
