"""Result records of the pure-Python tree.

The Cython core returns ``cdef class`` records with the same names and read-only
attributes (constructing a dataclass from C costs more than the whole match); tests
compare the two attribute by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]


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
