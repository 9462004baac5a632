# cython: language_level=3
"""Declarations of the compiled ``UnifiedFullTree`` (``_unified.pyx``): the node struct, the
eviction walk's heap entry and the class's fields.

Nodes live in one arena array addressed by slot; a node id handed out is the slot with the
slot's generation above it (``slot | gen << 32``), so an id is never reused although slots
are. Tokens are kept per node (``toks``); values (the device indices, opaque to the tree)
sit in a Python list at the node's slot.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int64_t token_t      # a token id, as SGLang's RadixKey holds it (array('q'))
ctypedef int32_t node_t       # an arena slot
ctypedef int64_t handle_t     # a node id: slot | generation << 32, never reused

cdef enum:
    NO_NODE = -1              # sentinel arena slot


cdef struct UNode:
    token_t* toks             # the node's own tokens (malloc'd, key_len of them; NULL: root)
    int64_t key_len           # tokens; a positive multiple of page_size (0: the root)
    int64_t uid               # creation sequence number, never reused: the heap's tie-break
    int64_t hit_count         # inserts that went through it (one per request)
    int64_t priority          # the highest insert priority seen
    double last_access_time   # the tree's clock at the last touch (ticks, see _tick)
    double creation_time      # the tree's clock when its tokens were first cached
    node_t parent             # NO_NODE for the root
    node_t first_child        # children in insertion order (a split keeps the place)
    node_t last_child
    node_t next_sibling
    node_t prev_sibling
    node_t leaf_prev          # the intrusive list of evictable device leaves
    node_t leaf_next
    int32_t num_children
    int32_t num_device_children  # children whose value is on the device
    int32_t lock_ref          # path locks through this node
    int32_t ns                # namespace index (0: None), see UnifiedFullTree.ns_index
    int32_t gen               # generation of this slot: ids carry it
    uint8_t alive             # the slot holds a node
    uint8_t on_device         # the value is valid (not evicted)
    uint8_t in_leaves         # on the evictable device leaf list


cdef struct WalkEntry:
    double t                  # last_access_time when pushed
    int64_t uid               # tie-break
    node_t node               # arena slot
    int32_t gen               # the slot's generation when pushed


cdef class UnifiedFullTree:
    cdef readonly int64_t page_size
    cdef object _copy_value       # keeps a value the tree stores (default: identity)
    # arena
    cdef UNode* nodes
    cdef node_t n_cap             # slots allocated
    cdef node_t n_hwm             # slots ever used
    cdef node_t* free_stack
    cdef node_t n_free
    cdef int64_t n_live
    cdef list values              # slot -> value (None: evicted or free)
    cdef dict ns_index            # namespace object -> index (None is 0)
    cdef node_t root_slot
    cdef double clock
    cdef int64_t next_uid
    # sizes
    cdef int64_t evictable
    cdef int64_t protected
    cdef node_t leaves_head
    cdef int64_t n_leaves
    # children: open addressing keyed by (parent, namespace, first page)
    cdef uint64_t* ht_keys
    cdef node_t* ht_vals
    cdef int64_t ht_cap
    cdef int64_t ht_used
    # the eviction walk
    cdef WalkEntry* heap
    cdef int64_t heap_len
    cdef int64_t heap_cap
    cdef bint walking
    cdef int64_t walk_quota
    cdef node_t walk_parent       # the last victim's parent (NO_NODE: none)
    cdef int32_t walk_parent_gen
    cdef node_t walk_victim       # the last victim until evict_leaf takes it (NO_NODE: none)
    cdef bint heap_fresh          # the kept heap holds exactly the evictable leaves, times current
    cdef int _heap_settle(self) except -1
    # private helpers (_unified.pyx)
    cdef int _reset(self) except -1
    cdef inline double _tick(self) noexcept
    cdef node_t _alloc_node(self, int64_t priority) except -2
    cdef void _free_node(self, node_t s) noexcept
    cdef inline handle_t _handle(self, node_t s) noexcept
    cdef node_t _slot(self, object node_id) except -2
    cdef int32_t _ns_id(self, object ns, bint create) except -2
    cdef int _ht_init(self, int64_t cap) except -1
    cdef node_t _find_child(self, node_t parent, int32_t ns, const token_t* page) noexcept nogil
    cdef void _ht_put(self, uint64_t h, node_t c) noexcept nogil
    cdef void _ht_add(self, node_t c) noexcept nogil
    cdef int _ht_reserve(self) except -1
    cdef uint64_t _ht_pos(self, node_t c) noexcept nogil
    cdef void _ht_remove(self, node_t c) noexcept nogil
    cdef void _link_child(self, node_t parent, node_t c) noexcept nogil
    cdef void _unlink_child(self, node_t c) noexcept nogil
    cdef inline bint _is_device_leaf(self, node_t s) noexcept nogil
    cdef void _leaf_add(self, node_t s) noexcept nogil
    cdef void _leaf_discard(self, node_t s) noexcept nogil
    cdef inline void _refresh_leaf(self, node_t s) noexcept nogil
    cdef int64_t _walk(self, const token_t* toks, int64_t n, int32_t ns, node_t* last, int64_t* cut) noexcept nogil
    cdef node_t _split(self, node_t child, int64_t split_len) except -2
    cdef inline object _keep(self, object value)
    cdef void _unevict(self, node_t s, object value)
    cdef int _heap_push(self, node_t s) except -1
    cdef void _sift_down(self, int64_t i) noexcept nogil
    cdef void _remove(self, node_t s)
