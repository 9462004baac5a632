# cython: language_level=3
"""Declarations of the compiled tree: C types, the node struct, the tree class's fields
(its private helpers are module-level functions, one ``_core_*.pxi`` per concern).

Nodes live in one arena array and name each other by index. A node's tokens, device
indices and host indices live at the same offset of three parallel buffers, so a split
only moves offsets and never copies KV indices; chained page hashes live in a fourth
buffer at ``offset / page_size`` pages.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int32_t token_t      # a token id
ctypedef int64_t index_t      # a KV slot index (device or host pool), as the API takes it
ctypedef int32_t slot_t       # a KV slot index as the span buffers store it (fits int32)
ctypedef int32_t node_t       # an arena index

cdef enum:
    NO_NODE = -1              # sentinel arena index
    IO_IDLE = 0
    IO_WRITING = 1            # device -> host backup in flight
    IO_LOADING = 2            # host -> device load back in flight
    DEVICE_SET = 0            # victim heap of L1 eviction
    HOST_SET = 1              # victim heap of L2 eviction
    DIGEST = 32               # bytes of one SHA-256 digest
    NUM_FIELDS = 6            # policy key fields, see hiradix/tree/policy.py
    CHANGE_INSERTED = 1       # change-log kinds: hiradix.tree._results.Change has the meanings
    CHANGE_HOST_INSERTED = 2
    CHANGE_SPLIT = 3
    CHANGE_REFILLED = 4
    CHANGE_LOADED = 5
    CHANGE_BACKED_UP = 6
    CHANGE_DEMOTED = 7
    CHANGE_DELETED = 8
    CHANGE_HOST_DELETED = 9

cdef struct Node:
    int64_t uid               # creation sequence number, never reused; final tie-break
    int64_t key_off           # first token's offset in the token/value/host buffers
    int64_t key_len           # tokens in the span; a positive multiple of page_size (0: root)
    int64_t hit_count         # non-chunked insert hits
    int64_t priority          # max request priority of inserts through this node
    int64_t io_ticket         # transfer in flight (shared by the parts of a split), 0: none
    int64_t sieve_lap         # SIEVE lap in which the hand next examines this node
    double last_access_time   # injected clock at the last match/insert touching the node
    double creation_time      # injected clock at creation (a split keeps the original's)
    node_t parent             # NO_NODE for a root
    node_t first_child        # intrusive doubly linked child list
    node_t next_sibling
    node_t prev_sibling
    int32_t num_children
    int32_t num_device_children  # children whose value is on the device
    int32_t gen               # generation of this arena slot; handles carry it
    int32_t lock_ref          # locks owned by the node and its descendants (requests, transfers)
    int32_t own_locks         # inc_lock_ref calls on this very node not yet undone
    int32_t host_ref_counter  # protections of the host copy alone
    int32_t ns                # namespace index: which seed the hash chain starts from
    int32_t heap_pos[2]       # position in the device / host victim heap, -1 if absent
    uint8_t alive             # slot holds a node
    uint8_t is_root
    uint8_t on_device         # value valid (L1 resident); 0 = evicted
    uint8_t backed_up         # host_value valid (L2 resident)
    uint8_t pending           # host buffer holds the slots of a backup in flight
    uint8_t io_status         # IO_IDLE / IO_WRITING / IO_LOADING
    uint8_t io_owner          # the transfer in flight was begun here (and holds a lock here)
    uint8_t visited           # SIEVE visited bit

cdef struct HeapEntry:
    double k0                 # first key component (signed), cached: may be stale low
    double k1                 # second key component (signed), 0 when unused
    int64_t uid               # node uid: the final tie-break
    node_t node               # arena index


cdef class HiRadixTree:
    # configuration
    cdef readonly int64_t page_size
    cdef readonly str write_policy
    cdef readonly object policy
    cdef readonly int64_t write_through_threshold
    cdef readonly bint enable_hash
    cdef object _clock
    cdef int _key_field[2]        # policy key fields (-1: unused)
    cdef double _key_sign[2]
    cdef bint _second_chance
    cdef int64_t _slru_threshold
    cdef bint _write_back

    # node arena
    cdef Node* nodes
    cdef node_t n_used            # high-water mark of the arena
    cdef node_t n_cap
    cdef node_t* free_stack       # LIFO of freed slots (same order as the twin)
    cdef node_t free_n

    # span buffers, parallel, indexed by Node.key_off
    cdef token_t* tokens
    cdef slot_t* dev              # checked into int32 at every entry (_check_slots)
    cdef slot_t* host
    cdef uint8_t* hashes          # DIGEST bytes per page, at key_off / page_size
    cdef int64_t buf_len
    cdef int64_t buf_cap
    cdef int64_t buf_garbage      # tokens of deleted spans still in the buffers
    cdef int64_t buf_hwm          # high-water mark of buf_len: the tokens' memory touched
    cdef int64_t hash_bytes       # capacity of the hash buffer in bytes

    # child table: open addressing on (parent, first page)
    cdef uint64_t* ht_keys
    cdef node_t* ht_vals
    cdef int64_t ht_cap
    cdef int64_t ht_count

    # victim heaps (indexed binary heaps of arena indices)
    cdef HeapEntry* heap[2]
    cdef node_t heap_n[2]

    # scratch of int64 triples for evict/evict_host records and compaction
    cdef int64_t* scratch
    cdef int64_t scratch_cap
    # insert's device slots past the prefix already on the device, checked and narrowed
    # to int32 in one pass before the tree changes (_check_stored_slots), copied into the
    # span buffers from here
    cdef slot_t* slots_in
    cdef int64_t slots_in_cap
    # reserve_tokens(evict_tokens=): an int64 buffer that evict's device indices are a
    # view of while no earlier result still refers to it, made at the first evict and
    # grown geometrically up to _evict_cap slots (None: not made yet)
    cdef object _evict_out
    cdef int64_t _evict_cap

    # change log (track_changes): rows of (kind, node handle, other handle, tokens)
    cdef bint _track
    cdef int64_t* changes
    cdef int64_t changes_n        # rows recorded since the last take_changes
    cdef int64_t changes_cap      # rows allocated

    # nodes (handles) holding a load-back plan (plan_load_back), each owning one lock there
    cdef set _plans

    # namespaces
    cdef dict _namespaces         # extra_key -> root arena index
    cdef uint8_t* seeds           # DIGEST bytes per namespace (0: the default root's)
    cdef uint8_t* seeded          # per namespace: 1 if its chain is seeded (seeds valid)
    cdef int32_t ns_n
    cdef int32_t ns_cap
    cdef object _chain_seed       # extra_key (None: default root) -> hex seed or None

    # counters
    cdef node_t root_idx
    cdef int64_t _uid
    cdef int64_t _time
    cdef int64_t _ticket
    cdef int64_t _sieve_hand[2]   # SIEVE: lap of the hand of each victim set
    cdef int64_t _evictable
    cdef int64_t _protected
    cdef int64_t _host_size
    cdef int64_t _num_nodes
    cdef readonly int64_t nodes_allocated
    cdef readonly int64_t nodes_freed

    # match_prefix's work for compiled callers (hiradix.sglang._match), without the result
    # object, on the first ``limit`` tokens of ``key`` (all when negative): returns the
    # device indices (``slots``; else None: their number alone, without reading them),
    # ``out`` (5 fields) gets the last device node, the last backed-up node, the host hit
    # length, the last matched node and the device prefix's length
    cdef object match_into(self, object key, object extra_key, int64_t* out, Py_ssize_t limit, bint slots)
    # insert's work for compiled callers (hiradix.sglang._insert), without the result
    # object: the first ``n`` tokens of ``key`` (a multiple of the page size, at most its
    # length) with the device indices ``values[:n]``; ``out`` gets the prefix length and
    # the last node, and the nodes to back up are returned (``hold`` as insert's)
    cdef tuple insert_into(self, object key, const index_t* values, Py_ssize_t n, object extra_key,
                           int64_t priority, bint chunked, bint hold, int64_t* out)
    # the device slots of positions [start, stop) of the path from the root down to node
    # ``handle``, whose span ends at position ``path_len``, into ``dst[:stop - start]``
    # (hiradix.sglang._insert's checkpoint writes them into a request's row)
    cdef int path_slots_into(self, int64_t handle, int64_t path_len, int64_t start, int64_t stop,
                             int32_t* dst) except -1
