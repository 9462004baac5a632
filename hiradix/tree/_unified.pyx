# cython: language_level=3
"""The compiled ``UnifiedFullTree``: the FULL component's radix tree on the device tier, as
SGLang 0.5.23's tree core (``hiradix.sglang.tree_core``) drives it.

Same API and decisions as its pure-Python twin :mod:`hiradix.tree.unified`, which documents
every operation in prose (and the facts of SGLang's cores it follows); this module is about
speed. Nodes are C structs in an arena (``_unified.pxd``) named by ``slot | gen << 32``;
children are found through one open-addressing table keyed by (parent, namespace, first
page); the evictable device leaves are an intrusive list, and the eviction walk a binary
heap of C entries. The match walk runs without the GIL.

The tree is not thread-safe: callers serialize operations (SGLang's ``UnifiedRadixCache``
does).
"""

from cpython.list cimport PyList_GET_ITEM
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

from array import array

__all__ = ["UnifiedFullTree"]

NO_NODE_ID = -1  # a node id that names no node (the twin's NO_NODE)

cdef double STAMP_STEP = 0.00001  # each ancestor of a matched node is this much older


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    # splitmix64 finaliser: the low bits index the table
    h ^= h >> 30
    h *= <uint64_t>0xBF58476D1CE4E5B9
    h ^= h >> 27
    h *= <uint64_t>0x94D049BB133111EB
    h ^= h >> 31
    return h


cdef inline uint64_t _key_hash(node_t parent, int32_t ns, const token_t* page, int64_t page_size) noexcept nogil:
    cdef uint64_t h = (<uint64_t>(parent + 1) * <uint64_t>0x9E3779B97F4A7C15) ^ (<uint64_t>ns << 40)
    cdef int64_t k
    for k in range(page_size):
        h = (h ^ <uint64_t>page[k]) * <uint64_t>0x100000001B3
    return _mix(h)


cdef inline int64_t _common(const token_t* a, const token_t* b, int64_t n, int64_t page) noexcept nogil:
    # the common prefix of two spans, cut down to whole pages
    cdef int64_t i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i - i % page


cdef inline bint _heap_less(WalkEntry* a, WalkEntry* b) noexcept nogil:
    return a.t < b.t or (a.t == b.t and a.uid < b.uid)


cdef inline Py_ssize_t _vlen(object value) except -1:
    # len() of a torch tensor runs Tensor.__len__ in Python; its shape is read in C
    try:
        return value.shape[0]
    except AttributeError:
        return len(value)


cdef const token_t[::1] _as_tokens(object tokens) except *:
    # a buffer of int64 token ids (array('q'), as SGLang's RadixKey holds them) as it is;
    # anything else (a list, a tuple, another width) copied into one
    cdef const token_t[::1] mv
    try:
        mv = tokens
    except (TypeError, ValueError):
        mv = array("q", tokens)
    return mv


cdef class UnifiedFullTree:
    """The FULL component's radix tree on the device tier (see :mod:`hiradix.tree.unified`).

    ``page_size`` tokens make a page; keys are cut down to whole pages. Values (device
    indices) are opaque: the tree measures (``len``) and slices them, and keeps what it
    stores through ``copy_value`` (default: as given)."""

    def __cinit__(self, int64_t page_size, *, copy_value=None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._copy_value = copy_value
        self.values = []
        self.ns_index = {}
        self.clock = 0.0
        self.next_uid = 0
        self.walk_parent = NO_NODE
        self._reset()

    def __dealloc__(self):
        cdef node_t s
        if self.nodes != NULL:
            for s in range(self.n_hwm):
                if self.nodes[s].alive and self.nodes[s].toks != NULL:
                    free(self.nodes[s].toks)
        free(self.nodes)
        free(self.free_stack)
        free(self.ht_keys)
        free(self.ht_vals)
        free(self.heap)

    # ------------------------------------------------------------------ arena
    cdef int _reset(self) except -1:
        cdef node_t s
        if self.nodes != NULL:
            for s in range(self.n_hwm):
                if self.nodes[s].alive:
                    free(self.nodes[s].toks)
                    self.nodes[s].toks = NULL
                    self.nodes[s].alive = 0
                    self.nodes[s].gen += 1
        self.n_free = 0
        s = self.n_hwm - 1
        while s >= 0:  # lowest slot first out
            self.free_stack[self.n_free] = s
            self.n_free += 1
            s -= 1
        for s in range(self.n_hwm):
            self.values[s] = None
        self.n_live = 0
        self.evictable = 0
        self.protected = 0
        self.leaves_head = NO_NODE
        self.n_leaves = 0
        self.walking = False
        self.heap_len = 0
        self.heap_fresh = False
        self.walk_victim = NO_NODE
        self.walk_parent = NO_NODE
        self._ht_init(64)
        self.root_slot = self._alloc_node(0)
        self.nodes[self.root_slot].lock_ref = 1  # the root is never evictable
        self.nodes[self.root_slot].on_device = 1
        self.values[self.root_slot] = ()
        return 0

    cdef inline double _tick(self) noexcept:
        cdef double t = self.clock
        self.clock += 1.0
        return t

    cdef node_t _alloc_node(self, int64_t priority) except -2:
        cdef node_t s, cap
        cdef void* p
        cdef UNode* n
        cdef int32_t gen
        if self.n_free == 0:
            if self.n_hwm == self.n_cap:
                cap = 64 if self.n_cap == 0 else 2 * self.n_cap
                p = realloc(self.nodes, cap * sizeof(UNode))
                if p == NULL:
                    raise MemoryError()
                self.nodes = <UNode*>p
                p = realloc(self.free_stack, cap * sizeof(node_t))
                if p == NULL:
                    raise MemoryError()
                self.free_stack = <node_t*>p
                memset(&self.nodes[self.n_cap], 0, (cap - self.n_cap) * sizeof(UNode))
                self.n_cap = cap
            s = self.n_hwm
            self.n_hwm += 1
            self.values.append(None)
        else:
            self.n_free -= 1
            s = self.free_stack[self.n_free]
        n = &self.nodes[s]
        gen = n.gen
        memset(n, 0, sizeof(UNode))
        n.gen = gen
        n.alive = 1
        n.uid = self.next_uid
        self.next_uid += 1
        n.last_access_time = self._tick()
        n.creation_time = self._tick()
        n.priority = priority
        n.parent = NO_NODE
        n.first_child = n.last_child = n.next_sibling = n.prev_sibling = NO_NODE
        n.leaf_prev = n.leaf_next = NO_NODE
        self.n_live += 1
        return s

    cdef void _free_node(self, node_t s) noexcept:
        cdef UNode* n = &self.nodes[s]
        free(n.toks)
        n.toks = NULL
        n.alive = 0
        n.gen += 1
        self.free_stack[self.n_free] = s
        self.n_free += 1
        self.n_live -= 1

    cdef inline handle_t _handle(self, node_t s) noexcept:
        return <handle_t>s | (<handle_t>self.nodes[s].gen << 32)

    cdef node_t _slot(self, object node_id) except -2:
        cdef handle_t h
        cdef node_t s
        try:
            h = node_id
        except (TypeError, OverflowError):
            raise KeyError(f"node {node_id!r} is not in the tree") from None
        s = <node_t>(h & 0xFFFFFFFF)
        if h < 0 or s >= self.n_hwm or not self.nodes[s].alive or self.nodes[s].gen != <int32_t>(h >> 32):
            raise KeyError(f"node {node_id} is not in the tree")
        return s

    cdef int32_t _ns_id(self, object ns, bint create) except -2:
        if ns is None:
            return 0
        found = self.ns_index.get(ns)
        if found is None:
            if not create:
                return -1
            found = len(self.ns_index) + 1
            self.ns_index[ns] = found
        return <int32_t>found

    # ------------------------------------------------------------------ children
    cdef int _ht_init(self, int64_t cap) except -1:
        cdef void* p
        free(self.ht_keys)
        free(self.ht_vals)
        self.ht_keys = NULL
        self.ht_vals = NULL
        p = malloc(cap * sizeof(uint64_t))
        if p == NULL:
            raise MemoryError()
        self.ht_keys = <uint64_t*>p
        p = malloc(cap * sizeof(node_t))
        if p == NULL:
            raise MemoryError()
        self.ht_vals = <node_t*>p
        memset(self.ht_vals, 0xFF, cap * sizeof(node_t))  # NO_NODE everywhere
        self.ht_cap = cap
        self.ht_used = 0
        return 0

    cdef node_t _find_child(self, node_t parent, int32_t ns, const token_t* page) noexcept nogil:
        cdef uint64_t h = _key_hash(parent, ns, page, self.page_size)
        cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
        cdef uint64_t i = h & mask
        cdef node_t c
        while True:
            c = self.ht_vals[i]
            if c == NO_NODE:
                return NO_NODE
            if (self.ht_keys[i] == h and self.nodes[c].parent == parent and self.nodes[c].ns == ns
                    and memcmp(self.nodes[c].toks, page, self.page_size * sizeof(token_t)) == 0):
                return c
            i = (i + 1) & mask

    cdef void _ht_put(self, uint64_t h, node_t c) noexcept nogil:
        cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
        cdef uint64_t i = h & mask
        while self.ht_vals[i] != NO_NODE:
            i = (i + 1) & mask
        self.ht_keys[i] = h
        self.ht_vals[i] = c
        self.ht_used += 1

    cdef void _ht_add(self, node_t c) noexcept nogil:
        # room must have been reserved (_ht_reserve)
        self._ht_put(_key_hash(self.nodes[c].parent, self.nodes[c].ns, self.nodes[c].toks, self.page_size), c)

    cdef int _ht_reserve(self) except -1:
        # room for one more entry at a load of at most 1/2
        cdef int64_t old_cap = self.ht_cap
        cdef uint64_t* keys
        cdef node_t* vals
        cdef int64_t i
        if 2 * (self.ht_used + 1) > self.ht_cap:
            keys, vals = self.ht_keys, self.ht_vals
            self.ht_keys = NULL
            self.ht_vals = NULL
            try:
                self._ht_init(2 * old_cap)
            except MemoryError:
                free(keys)
                free(vals)
                raise
            for i in range(old_cap):
                if vals[i] != NO_NODE:
                    self._ht_put(keys[i], vals[i])
            free(keys)
            free(vals)
        return 0

    cdef uint64_t _ht_pos(self, node_t c) noexcept nogil:
        # the table slot holding child c (it is there)
        cdef uint64_t h = _key_hash(self.nodes[c].parent, self.nodes[c].ns, self.nodes[c].toks, self.page_size)
        cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
        cdef uint64_t i = h & mask
        while self.ht_vals[i] != c:
            i = (i + 1) & mask
        return i

    cdef void _ht_remove(self, node_t c) noexcept nogil:
        # backward-shift deletion: the table never holds tombstones
        cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
        cdef uint64_t i = self._ht_pos(c)
        cdef uint64_t j = i
        cdef uint64_t k
        while True:
            j = (j + 1) & mask
            if self.ht_vals[j] == NO_NODE:
                break
            k = self.ht_keys[j] & mask
            if (i <= j and i < k <= j) or (i > j and (i < k or k <= j)):
                continue
            self.ht_keys[i] = self.ht_keys[j]
            self.ht_vals[i] = self.ht_vals[j]
            i = j
        self.ht_vals[i] = NO_NODE
        self.ht_used -= 1

    cdef void _link_child(self, node_t parent, node_t c) noexcept nogil:
        cdef UNode* p = &self.nodes[parent]
        cdef UNode* n = &self.nodes[c]
        n.parent = parent
        n.prev_sibling = p.last_child
        n.next_sibling = NO_NODE
        if p.last_child != NO_NODE:
            self.nodes[p.last_child].next_sibling = c
        else:
            p.first_child = c
        p.last_child = c
        p.num_children += 1
        if n.on_device:
            p.num_device_children += 1

    cdef void _unlink_child(self, node_t c) noexcept nogil:
        cdef UNode* n = &self.nodes[c]
        cdef UNode* p = &self.nodes[n.parent]
        if n.prev_sibling != NO_NODE:
            self.nodes[n.prev_sibling].next_sibling = n.next_sibling
        else:
            p.first_child = n.next_sibling
        if n.next_sibling != NO_NODE:
            self.nodes[n.next_sibling].prev_sibling = n.prev_sibling
        else:
            p.last_child = n.prev_sibling
        p.num_children -= 1
        if n.on_device:
            p.num_device_children -= 1

    # ------------------------------------------------------------------ leaves
    cdef inline bint _is_device_leaf(self, node_t s) noexcept nogil:
        cdef UNode* n = &self.nodes[s]
        return n.parent != NO_NODE and n.on_device and n.lock_ref == 0 and n.num_device_children == 0

    cdef void _leaf_add(self, node_t s) noexcept nogil:
        cdef UNode* n = &self.nodes[s]
        n.in_leaves = 1
        n.leaf_prev = NO_NODE
        n.leaf_next = self.leaves_head
        if self.leaves_head != NO_NODE:
            self.nodes[self.leaves_head].leaf_prev = s
        self.leaves_head = s
        self.n_leaves += 1

    cdef void _leaf_discard(self, node_t s) noexcept nogil:
        cdef UNode* n = &self.nodes[s]
        if not n.in_leaves:
            return
        if n.leaf_prev != NO_NODE:
            self.nodes[n.leaf_prev].leaf_next = n.leaf_next
        else:
            self.leaves_head = n.leaf_next
        if n.leaf_next != NO_NODE:
            self.nodes[n.leaf_next].leaf_prev = n.leaf_prev
        n.in_leaves = 0
        n.leaf_prev = n.leaf_next = NO_NODE
        self.n_leaves -= 1

    cdef inline void _refresh_leaf(self, node_t s) noexcept nogil:
        if self._is_device_leaf(s):
            if not self.nodes[s].in_leaves:
                self._leaf_add(s)
        else:
            self._leaf_discard(s)

    # ------------------------------------------------------------------ reads
    @property
    def root(self):
        return self._handle(self.root_slot)

    def reset(self):
        """Drop every node; a new root (with a new id). Runtime complexity: ``O(nodes)``."""
        self._reset()

    def is_root(self, node_id):
        return self.nodes[self._slot(node_id)].parent == NO_NODE

    def is_evicted(self, node_id):
        cdef node_t s = self._slot(node_id)
        return self.nodes[s].parent != NO_NODE and not self.nodes[s].on_device

    def value(self, node_id):
        return self.values[self._slot(node_id)]

    def parent(self, node_id):
        cdef node_t p = self.nodes[self._slot(node_id)].parent
        return NO_NODE_ID if p == NO_NODE else self._handle(p)

    def children(self, node_id):
        cdef node_t c = self.nodes[self._slot(node_id)].first_child
        out = []
        while c != NO_NODE:
            out.append(self._handle(c))
            c = self.nodes[c].next_sibling
        return out

    def key_len(self, node_id):
        return self.nodes[self._slot(node_id)].key_len

    def lock_ref(self, node_id):
        return self.nodes[self._slot(node_id)].lock_ref

    def hit_count(self, node_id):
        return self.nodes[self._slot(node_id)].hit_count

    def last_access_time(self, node_id):
        return self.nodes[self._slot(node_id)].last_access_time

    def evictable_size(self):
        return self.evictable

    def protected_size(self):
        return self.protected

    def num_nodes(self):
        return self.n_live

    def path_values(self, from_id, until_id):
        """Device values from ``from_id`` up to (not including) ``until_id``, root first.
        Runtime complexity: ``O(depth)``."""
        cdef node_t until = self._slot(until_id)
        cdef node_t s = self._slot(from_id)
        out = []
        while s != until:
            if s == NO_NODE or not self.nodes[s].on_device:
                raise AssertionError("path crosses an evicted node")
            out.append(<object>PyList_GET_ITEM(self.values, s))
            s = self.nodes[s].parent
        out.reverse()
        return out

    def path_info(self, node_id):
        """``(id, parent id, start, end, value length or None, children)`` for each node on
        the root-to-node path, the root left out. Runtime complexity: ``O(depth)``."""
        cdef node_t s = self._slot(node_id)
        cdef int64_t end = 0
        cdef node_t c = s
        cdef UNode* n
        while self.nodes[c].parent != NO_NODE:
            end += self.nodes[c].key_len
            c = self.nodes[c].parent
        out = []
        while self.nodes[s].parent != NO_NODE:
            n = &self.nodes[s]
            out.append((self._handle(s), self._handle(n.parent), end - n.key_len, end,
                        n.key_len if n.on_device else None, n.num_children))
            end -= n.key_len
            s = n.parent
        out.reverse()
        return out

    def walk(self):
        """``(id, depth in tokens, parent id)`` for every node but the root, depth first
        in child order (SGLang's order for flattening values)."""
        out = []
        cdef node_t c = self.nodes[self.root_slot].first_child
        cdef int64_t depth = 0
        while c != NO_NODE:
            out.append((self._handle(c), depth, self._handle(self.nodes[c].parent)))
            if self.nodes[c].first_child != NO_NODE:  # down
                depth += self.nodes[c].key_len
                c = self.nodes[c].first_child
                continue
            while c != self.root_slot and self.nodes[c].next_sibling == NO_NODE:  # up
                c = self.nodes[c].parent
                if c != self.root_slot:
                    depth -= self.nodes[c].key_len
            if c == self.root_slot:
                break
            c = self.nodes[c].next_sibling
        return out

    # ------------------------------------------------------------------ match
    cdef int64_t _walk(self, const token_t* toks, int64_t n, int32_t ns, node_t* last, int64_t* cut) noexcept nogil:
        # the device walk: matched tokens; *last the deepest node entered, *cut the tokens
        # matched inside it when the match ends inside it (0: it matched whole)
        cdef node_t node = self.root_slot
        cdef node_t child
        cdef int64_t offset = 0
        cdef int64_t plen, m
        cut[0] = 0
        while offset < n:
            child = self._find_child(node, ns, toks + offset)
            if child == NO_NODE or not self.nodes[child].on_device:
                break
            m = self.nodes[child].key_len
            if m > n - offset:
                m = n - offset
            plen = _common(self.nodes[child].toks, toks + offset, m, self.page_size)
            offset += plen
            node = child
            if plen < self.nodes[child].key_len:
                cut[0] = plen
                break
        last[0] = node
        return offset

    def match(self, tokens, ns=None):
        """The longest cached device prefix of ``tokens`` (cut to whole pages) in namespace
        ``ns``: ``(matched tokens, deepest matched node)``. Splits the node where the match
        ends inside it, and stamps the matched path. Runtime complexity: ``O(len(tokens))``."""
        cdef const token_t[::1] mv = _as_tokens(tokens)
        cdef int64_t n = mv.shape[0] - mv.shape[0] % self.page_size
        cdef int32_t nsi = self._ns_id(ns, False)
        cdef node_t node = self.root_slot
        cdef int64_t cut = 0, hit = 0
        cdef double stamp
        self.heap_fresh = False  # stamps times
        if n and nsi >= 0:
            with nogil:
                hit = self._walk(&mv[0], n, nsi, &node, &cut)
            if cut:
                node = self._split(node, cut)
        stamp = self._tick()
        cdef node_t s = node
        while s != NO_NODE:
            self.nodes[s].last_access_time = stamp
            stamp -= STAMP_STEP
            s = self.nodes[s].parent
        return hit, self._handle(node)

    def match_device_prefix(self, tokens, ns=None):
        """Read-only: ``(matched tokens, deepest node, tokens of the nodes it pins)``."""
        cdef const token_t[::1] mv = _as_tokens(tokens)
        cdef int64_t n = mv.shape[0] - mv.shape[0] % self.page_size
        cdef int32_t nsi = self._ns_id(ns, False)
        cdef node_t node = self.root_slot
        cdef int64_t cut = 0, hit = 0, pinned = 0
        if n and nsi >= 0:
            hit = self._walk(&mv[0], n, nsi, &node, &cut)
        s = node
        while self.nodes[s].parent != NO_NODE:
            pinned += self.nodes[s].key_len
            s = self.nodes[s].parent
        return hit, self._handle(node), pinned

    cdef node_t _split(self, node_t child, int64_t split_len) except -2:
        # the prefix becomes a new node in the child's place; the child keeps its id
        cdef node_t new
        cdef UNode* c
        cdef UNode* w
        cdef node_t parent = self.nodes[child].parent
        cdef token_t* head
        cdef uint64_t pos
        value = self.values[child]
        if value is not None:
            first, rest = self._keep(value[:split_len]), self._keep(value[split_len:])
        self._ht_reserve()
        head = <token_t*>malloc(split_len * sizeof(token_t))
        if head == NULL:
            raise MemoryError()
        try:
            new = self._alloc_node(self.nodes[child].priority)
        except BaseException:
            free(head)
            raise
        # nothing below raises: the tree is never left half split
        c = &self.nodes[child]
        w = &self.nodes[new]
        pos = self._ht_pos(child)
        memcpy(head, c.toks, split_len * sizeof(token_t))
        memmove(c.toks, c.toks + split_len, (c.key_len - split_len) * sizeof(token_t))
        w.toks = head
        w.key_len = split_len
        c.key_len -= split_len
        w.ns = c.ns
        w.hit_count = c.hit_count
        w.creation_time = c.creation_time
        w.lock_ref = c.lock_ref
        w.on_device = c.on_device
        if value is not None:
            self.values[new] = first
            self.values[child] = rest
        # w takes c's place among the parent's children, and in the table
        w.parent = parent
        w.prev_sibling = c.prev_sibling
        w.next_sibling = c.next_sibling
        if c.prev_sibling != NO_NODE:
            self.nodes[c.prev_sibling].next_sibling = new
        else:
            self.nodes[parent].first_child = new
        if c.next_sibling != NO_NODE:
            self.nodes[c.next_sibling].prev_sibling = new
        else:
            self.nodes[parent].last_child = new
        self.ht_vals[pos] = new
        c.parent = NO_NODE
        c.prev_sibling = c.next_sibling = NO_NODE
        self._link_child(new, child)
        self._ht_add(child)  # room reserved above
        self.nodes[child].last_access_time = self._tick()
        self._refresh_leaf(new)
        self._refresh_leaf(child)
        return new

    cdef inline object _keep(self, object value):
        return value if self._copy_value is None else self._copy_value(value)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens, value, ns=None, *, int64_t priority=0, int64_t prev_prefix_len=0,
               int64_t inserted_len=0):
        """Cache ``tokens`` (cut to whole pages) with their device ``value`` (at least as
        long): ``(prefix_len, last node, frees, new_leaf)``. The overlap with what is cached
        past ``prev_prefix_len`` comes back in ``frees`` (slices of ``value``: the caller's
        duplicate slots); the rest becomes one new leaf. Nodes past ``inserted_len`` count a
        hit. Runtime complexity: ``O(len(tokens))``."""
        cdef const token_t[::1] mv = _as_tokens(tokens)
        cdef int64_t n = mv.shape[0] - mv.shape[0] % self.page_size
        cdef UNode* root = &self.nodes[self.root_slot]
        cdef node_t node = self.root_slot
        cdef node_t child, leaf
        cdef int64_t offset = 0, plen, m, dup_start
        cdef int32_t nsi
        cdef token_t* toks
        self.heap_fresh = False
        root.last_access_time = self._tick()
        if priority > root.priority:
            root.priority = priority
        frees = []
        if n == 0:
            return 0, self._handle(node), frees, False
        nsi = self._ns_id(ns, True)
        while offset < n:
            child = self._find_child(node, nsi, &mv[offset])
            if child == NO_NODE:
                break
            self.nodes[child].last_access_time = self._tick()
            m = self.nodes[child].key_len
            if m > n - offset:
                m = n - offset
            plen = _common(self.nodes[child].toks, &mv[offset], m, self.page_size)
            if plen < self.nodes[child].key_len:
                child = self._split(child, plen)
            if priority > self.nodes[child].priority:
                self.nodes[child].priority = priority
            if not self.nodes[child].on_device:
                self._unevict(child, self._keep(value[offset:offset + plen]))
            else:
                dup_start = prev_prefix_len - offset
                if dup_start < 0:
                    dup_start = 0
                if dup_start < plen:
                    frees.append(value[offset + dup_start:offset + plen])
            if offset + plen > inserted_len:
                self.nodes[child].hit_count += 1
            node = child
            offset += plen
        if offset == n:
            return offset, self._handle(node), frees, False
        toks = <token_t*>malloc((n - offset) * sizeof(token_t))
        if toks == NULL:
            raise MemoryError()
        memcpy(toks, &mv[offset], (n - offset) * sizeof(token_t))
        try:
            piece = self._keep(value[offset:n] if offset or _vlen(value) != n else value)
            self._ht_reserve()
            leaf = self._alloc_node(priority)
        except BaseException:
            free(toks)
            raise
        self.nodes[leaf].toks = toks
        self.nodes[leaf].key_len = n - offset
        self.nodes[leaf].ns = nsi
        self.nodes[leaf].on_device = 1
        self.values[leaf] = piece
        self._link_child(node, leaf)
        self._ht_add(leaf)
        self.evictable += n - offset
        self._refresh_leaf(leaf)
        self._refresh_leaf(node)
        if n > inserted_len:
            self.nodes[leaf].hit_count += 1
        return offset, self._handle(leaf), frees, True

    cdef void _unevict(self, node_t s, object value):
        cdef UNode* n = &self.nodes[s]
        self.values[s] = value
        n.on_device = 1
        if n.parent != NO_NODE:
            self.nodes[n.parent].num_device_children += 1
        if n.lock_ref > 0:
            self.protected += n.key_len
        else:
            self.evictable += n.key_len
        self._refresh_leaf(s)
        if n.parent != NO_NODE:
            self._refresh_leaf(n.parent)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node_id):
        """Lock the path from ``node_id`` to the root; the tokens moved from evictable to
        protected. Runtime complexity: ``O(depth)``."""
        cdef node_t anchor = self._slot(node_id)
        cdef node_t s = anchor
        cdef int64_t delta = 0
        cdef UNode* n
        self.heap_fresh = False
        while self.nodes[s].parent != NO_NODE and not self.nodes[s].on_device:
            self.nodes[s].lock_ref += 1
            s = self.nodes[s].parent
        while self.nodes[s].parent != NO_NODE:
            n = &self.nodes[s]
            if n.lock_ref == 0:
                self.evictable -= n.key_len
                self.protected += n.key_len
                delta += n.key_len
            n.lock_ref += 1
            self._leaf_discard(s)
            s = n.parent
        self._refresh_leaf(anchor)
        return delta

    def dec_lock_ref(self, node_id):
        """Release a lock :meth:`inc_lock_ref` took on ``node_id``.
        Runtime complexity: ``O(depth)``."""
        cdef node_t anchor = self._slot(node_id)
        cdef node_t s = anchor
        cdef UNode* n
        self.heap_fresh = False
        while self.nodes[s].parent != NO_NODE:
            n = &self.nodes[s]
            if n.lock_ref <= 0:
                raise AssertionError(f"FULL segment release hit lock_ref=0 on node {self._handle(s)}")
            if n.lock_ref == 1 and n.on_device:
                self.evictable += n.key_len
                self.protected -= n.key_len
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._refresh_leaf(s)
            s = n.parent
        self._refresh_leaf(anchor)

    # ------------------------------------------------------------------ eviction
    cdef int _heap_push(self, node_t s) except -1:
        cdef void* p
        cdef int64_t i, up
        cdef WalkEntry e
        if self.heap_len == self.heap_cap:
            p = realloc(self.heap, (2 * self.heap_cap + 64) * sizeof(WalkEntry))
            if p == NULL:
                raise MemoryError()
            self.heap = <WalkEntry*>p
            self.heap_cap = 2 * self.heap_cap + 64
        e.t = self.nodes[s].last_access_time
        e.uid = self.nodes[s].uid
        e.node = s
        e.gen = self.nodes[s].gen
        i = self.heap_len
        self.heap_len += 1
        while i > 0:
            up = (i - 1) >> 1
            if not _heap_less(&e, &self.heap[up]):
                break
            self.heap[i] = self.heap[up]
            i = up
        self.heap[i] = e
        return 0

    cdef void _sift_down(self, int64_t i) noexcept nogil:
        cdef WalkEntry e = self.heap[i]
        cdef int64_t c
        while True:
            c = 2 * i + 1
            if c >= self.heap_len:
                break
            if c + 1 < self.heap_len and _heap_less(&self.heap[c + 1], &self.heap[c]):
                c += 1
            if not _heap_less(&self.heap[c], &e):
                break
            self.heap[i] = self.heap[c]
            i = c
        self.heap[i] = e

    cdef int _heap_settle(self) except -1:
        # the walk's pending moves: the last victim's parent, if that made it a leaf, joins
        # the heap; a victim evict_leaf did not take leaves the heap stale
        cdef node_t s = self.walk_parent
        if self.walk_victim != NO_NODE:
            self.heap_fresh = False
            self.walk_victim = NO_NODE
        if (s != NO_NODE and self.nodes[s].alive and self.nodes[s].gen == self.walk_parent_gen
                and self.nodes[s].in_leaves):
            self._heap_push(s)
        self.walk_parent = NO_NODE
        return 0

    def evict_start(self, int64_t quota):
        """Begin an eviction walk that stops once ``quota`` tokens were freed. The heap
        of the last walk is kept and reused when the tree did not change since but by
        that walk's own evictions (it then holds exactly the evictable leaves).
        Runtime complexity: ``O(leaves)``, ``O(1)`` when reused."""
        cdef void* p
        cdef node_t s
        cdef int64_t i
        if self.walking:
            raise AssertionError("FULL device eviction already in progress")
        self.walk_quota = quota
        self.walk_parent = NO_NODE
        self.walk_victim = NO_NODE
        if self.heap_fresh:
            self.walking = True
            return
        if self.heap_cap < self.n_leaves:
            p = realloc(self.heap, (self.n_leaves + 64) * sizeof(WalkEntry))
            if p == NULL:
                raise MemoryError()
            self.heap = <WalkEntry*>p
            self.heap_cap = self.n_leaves + 64
        self.heap_len = 0
        s = self.leaves_head
        while s != NO_NODE:
            self.heap[self.heap_len].t = self.nodes[s].last_access_time
            self.heap[self.heap_len].uid = self.nodes[s].uid
            self.heap[self.heap_len].node = s
            self.heap[self.heap_len].gen = self.nodes[s].gen
            self.heap_len += 1
            s = self.nodes[s].leaf_next
        i = self.heap_len // 2 - 1
        while i >= 0:
            self._sift_down(i)
            i -= 1
        self.heap_fresh = True
        self.walking = True

    def evict_next(self, int64_t freed):
        """The next victim (a device leaf), or ``None`` when ``freed`` reached the quota
        or no leaf is left. Runtime complexity: ``O(log leaves)`` per victim."""
        cdef node_t s
        cdef WalkEntry e
        if not self.walking:
            raise AssertionError("FULL device eviction not started")
        self._heap_settle()
        while freed < self.walk_quota and self.heap_len > 0:
            e = self.heap[0]
            self.heap_len -= 1
            if self.heap_len > 0:
                self.heap[0] = self.heap[self.heap_len]
                self._sift_down(0)
            s = e.node
            if self.nodes[s].alive and self.nodes[s].gen == e.gen and self.nodes[s].in_leaves:
                self.walk_parent = self.nodes[s].parent
                self.walk_parent_gen = self.nodes[self.walk_parent].gen
                self.walk_victim = s
                return self._handle(s)
        return None

    def evict_end(self):
        if not self.walking:
            raise AssertionError("FULL device eviction not started")
        self._heap_settle()  # the heap stays for the next walk
        self.walking = False

    def evict_leaf(self, node_id):
        """Delete device leaf ``node_id`` (it has no host copy) and the ancestors it
        leaves childless with nothing cached; returns the device values to free.
        Runtime complexity: ``O(1)`` plus the ancestors deleted."""
        cdef node_t s = self._slot(node_id)
        cdef node_t cur, parent
        # the kept heap stays exact only when this is the walk's victim and no ancestor goes
        cdef bint fresh = self.heap_fresh and self.walking and s == self.walk_victim
        if not self.nodes[s].in_leaves:
            raise AssertionError(f"node {node_id} is not an evictable device leaf")
        self.heap_fresh = False
        if s == self.walk_victim:
            self.walk_victim = NO_NODE
        freed = [self.values[s]]
        self.evictable -= self.nodes[s].key_len
        self._leaf_discard(s)
        cur = self.nodes[s].parent
        self._remove(s)
        self._refresh_leaf(cur)
        while self.nodes[cur].parent != NO_NODE and self.nodes[cur].num_children == 0 and self.nodes[cur].lock_ref == 0:
            if self.nodes[cur].on_device:
                self._refresh_leaf(cur)
                break
            parent = self.nodes[cur].parent
            self._remove(cur)
            self._refresh_leaf(parent)
            cur = parent
            fresh = False
        self.heap_fresh = fresh
        return freed

    cdef void _remove(self, node_t s):
        self._ht_remove(s)
        self._unlink_child(s)
        self._leaf_discard(s)
        self.values[s] = None
        self._free_node(s)

    # ------------------------------------------------------------------ checks
    def check_invariants(self):
        """Parent/child links, the child table, page alignment, ``lock_ref >= 0``, the
        evictable and protected sizes and the leaf list against a full recount.
        ``AssertionError`` (with the tree's dump) on the first violation. Runtime
        complexity: ``O(n)``."""
        try:
            self._check()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.dump()}") from None

    def _check(self):
        cdef node_t root = self.root_slot
        cdef node_t s, c
        cdef int64_t evictable = 0, protected = 0, seen = 0, leaves = 0, kids, dev_kids, i
        cdef UNode* n
        assert self.nodes[root].alive and self.nodes[root].parent == NO_NODE, "root"
        assert self.nodes[root].lock_ref == 1, "root lock_ref"
        stack = [root]
        while stack:
            s = stack.pop()
            n = &self.nodes[s]
            seen += 1
            assert n.alive, f"slot {s}: a dead node in the tree"
            kids = dev_kids = 0
            c = n.first_child
            while c != NO_NODE:
                assert self.nodes[c].parent == s, f"node {self._handle(c)}: parent link"
                assert self._find_child(s, self.nodes[c].ns, self.nodes[c].toks) == c, (
                    f"node {self._handle(c)}: not in the child table"
                )
                kids += 1
                dev_kids += self.nodes[c].on_device
                stack.append(c)
                c = self.nodes[c].next_sibling
            assert kids == n.num_children, f"node {self._handle(s)}: {n.num_children} children, {kids} linked"
            assert dev_kids == n.num_device_children, f"node {self._handle(s)}: device children count"
            if s == root:
                continue
            h = self._handle(s)
            assert n.key_len > 0 and n.key_len % self.page_size == 0, f"node {h}: not whole pages"
            assert n.lock_ref >= 0, f"node {h}: lock_ref {n.lock_ref}"
            assert n.parent == root or self.nodes[n.parent].lock_ref >= n.lock_ref, (
                f"node {h}: locked more than its parent"
            )
            value = self.values[s]
            if n.on_device:
                assert value is not None and len(value) == n.key_len, f"node {h}: value length"
                if n.lock_ref > 0:
                    protected += n.key_len
                else:
                    evictable += n.key_len
            else:
                assert value is None, f"node {h}: an evicted node keeps a value"
                assert n.num_children, f"node {h}: an evicted leaf with no host copy"
            assert n.in_leaves == self._is_device_leaf(s), f"node {h}: leaf list"
            leaves += n.in_leaves
        assert seen == self.n_live, f"{self.n_live - seen} nodes in the arena are not in the tree"
        assert seen - 1 == self.ht_used, f"{self.ht_used} child table entries for {seen - 1} children"
        assert leaves == self.n_leaves, f"leaf list holds {self.n_leaves}, recount {leaves}"
        assert evictable == self.evictable, f"evictable {self.evictable}, recount {evictable}"
        assert protected == self.protected, f"protected {self.protected}, recount {protected}"
        if self.heap_fresh and not self.walking:
            kept = set()
            for i in range(self.heap_len):
                c = self.heap[i].node
                assert (self.nodes[c].alive and self.nodes[c].gen == self.heap[i].gen and self.nodes[c].in_leaves
                        and self.nodes[c].last_access_time == self.heap[i].t), "kept eviction heap is stale"
                kept.add(c)
            assert len(kept) == self.heap_len == self.n_leaves, "kept eviction heap is not the leaf set"

    def dump(self):
        """The tree, one node a line (id, tokens, value length, lock_ref, time)."""
        cdef node_t c, s
        cdef int64_t i
        cdef UNode* n
        lines = []
        stack = [(self.root_slot, -1)]
        while stack:
            s, depth = stack.pop()
            if s != self.root_slot:
                n = &self.nodes[s]
                toks = [n.toks[i] for i in range(min(n.key_len, 8))]
                vlen = len(self.values[s]) if n.on_device else None
                lines.append(
                    f"{'  ' * depth}#{self._handle(s)} tokens={toks}.. len={n.key_len} "
                    f"value={vlen} lock_ref={n.lock_ref} t={n.last_access_time}"
                )
            kids = []
            c = self.nodes[s].first_child
            while c != NO_NODE:
                kids.append((c, depth + 1))
                c = self.nodes[c].next_sibling
            stack.extend(reversed(kids))
        return "\n".join(lines) or "(empty)"
