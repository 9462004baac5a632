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


#: What :meth:`HiRadixTree.parent` answers for a root (the tree's or a namespace's), and
#: what a request's ``last_node`` holds before it matched anything: no node.
NO_NODE = -1


class IOStatus(enum.IntEnum):
    """Transfer state of a node, as ``HiRadixTree.io_status`` reports it (SGLang's
    ``tree_v2`` ``IOStatus``). The values are the core's ``IO_*`` constants."""

    IDLE = 0  # no copy in flight
    WRITING = 1  # device -> host backup in flight (begin_backup .. commit_backup)
    LOADING = 2  # host -> device load in flight (begin_load_back .. finish_load_back)


class Change(enum.IntEnum):
    """Kinds of the change records ``HiRadixTree.take_changes`` hands out while
    ``track_changes`` is on: what the tree did to its nodes, for a caller that mirrors
    per-node state of its own (SGLang's KV cache events). Each record is ``(kind, node,
    other, tokens)``; ``other`` is -1 unless a kind says otherwise. The values are the
    core's ``CHANGE_*`` constants.
    """

    INSERTED = 1  # insert made ``node``, on the device, of ``tokens`` tokens
    HOST_INSERTED = 2  # insert_host made ``node``, host only
    SPLIT = 3  # ``node`` (new) took the first ``tokens`` tokens of ``other``, now below it
    REFILLED = 4  # insert gave the evicted ``node`` device slots again (recomputed KV)
    LOADED = 5  # begin_load_back gave the evicted ``node`` device slots (chain parents first)
    BACKED_UP = 6  # commit_backup made ``node`` backed up (group parents first)
    DEMOTED = 7  # ``node`` lost its device copy and kept its host copy (evict, demote)
    DELETED = 8  # ``node`` was deleted from the device, no host copy (evict, drop); stale now
    HOST_DELETED = 9  # the host-only ``node`` was deleted (evict_host); stale now


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


@dataclass(frozen=True, slots=True)
class LoadBackPlan:
    """What ``plan_load_back`` decided for the evicted chain that ends at a node.

    ``anchor`` is the deepest node at or above that node whose KV is on the device (a
    root counts): what a request locks if nothing is loaded. ``host_indices`` are the
    chain's host slots, parents first, if it is to be loaded, and empty if not (nothing
    evicted, fewer tokens than the threshold, more than the quota). A plan with slots is
    *held*: a lock it owns on the node keeps ``anchor`` on the device and the chain on the
    host while the caller finds device slots (evicting), until ``begin_load_back`` of the
    node (whose lock it becomes) or ``cancel_load_back``.
    """

    anchor: int
    host_indices: IndexArray
