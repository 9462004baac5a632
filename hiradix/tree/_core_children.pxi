# Included by _core.pyx (one module: these are its module-level definitions).
# Child table.
#
# Children: a global open-addressing table keyed by (parent, first page of the child),
# plus an intrusive sibling list per node for enumeration.
#
# A lookup costs one hash of page_size tokens and, usually, one probe: a system prompt
# with hundreds of continuations is as cheap to descend as one with a single child.
# Linear probing with backward-shift deletion keeps the table free of tombstones.

cdef uint64_t _page_hash(HiRadixTree self, node_t parent, const token_t* page) noexcept nogil:
    cdef uint64_t h = (<uint64_t>parent + 1) * <uint64_t>0x9E3779B97F4A7C15
    cdef int64_t k
    for k in range(self.page_size):
        h = (h ^ <uint32_t>page[k]) * <uint64_t>0x100000001B3
    return _mix(h)


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    # splitmix64 finaliser: the low bits index the table, so mix the high ones down
    h ^= h >> 30
    h *= <uint64_t>0xBF58476D1CE4E5B9
    h ^= h >> 27
    h *= <uint64_t>0x94D049BB133111EB
    h ^= h >> 31
    return h


cdef node_t _find_child(HiRadixTree self, node_t parent, const token_t* page) noexcept nogil:
    cdef uint64_t h = _page_hash(self, parent, page)
    cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
    cdef uint64_t slot = h & mask
    cdef node_t c
    while True:
        c = self.ht_vals[slot]
        if c == NO_NODE:
            return NO_NODE
        if (self.ht_keys[slot] == h and self.nodes[c].parent == parent
                and memcmp(self.tokens + self.nodes[c].key_off, page,
                           self.page_size * sizeof(token_t)) == 0):
            return c
        slot = (slot + 1) & mask


cdef inline uint64_t _page_hash64(HiRadixTree self, node_t parent, const int64_t* page) noexcept nogil:
    # _page_hash of a page of int64 ids: the same hash for ids that fit int32
    cdef uint64_t h = (<uint64_t>parent + 1) * <uint64_t>0x9E3779B97F4A7C15
    cdef int64_t k
    for k in range(self.page_size):
        h = (h ^ <uint32_t>page[k]) * <uint64_t>0x100000001B3
    return _mix(h)


cdef inline void _prefetch_child64(HiRadixTree self, node_t parent, const int64_t* page) noexcept nogil:
    # The table slot where _find_child64(parent, page) will start, requested ahead: the
    # match walk asks for the next span's slot before it compares the current span, so
    # the slot's misses (two arrays) overlap with that compare instead of preceding the
    # next lookup.
    cdef uint64_t slot = _page_hash64(self, parent, page) & <uint64_t>(self.ht_cap - 1)
    HR_PREFETCH(&self.ht_vals[slot])
    HR_PREFETCH(&self.ht_keys[slot])


cdef node_t _find_child64(HiRadixTree self, node_t parent, const int64_t* page) noexcept nogil:
    # _find_child of a page of int64 ids (_match64): the same hash as _page_hash's for ids
    # that fit int32; one that does not equals no token.
    cdef uint64_t h = _page_hash64(self, parent, page)
    cdef int64_t k
    cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
    cdef uint64_t slot = h & mask
    cdef node_t c
    cdef const token_t* toks
    while True:
        c = self.ht_vals[slot]
        if c == NO_NODE:
            return NO_NODE
        if self.ht_keys[slot] == h and self.nodes[c].parent == parent:
            toks = self.tokens + self.nodes[c].key_off
            k = 0
            while k < self.page_size and page[k] == <int64_t>toks[k]:
                k += 1
            if k == self.page_size:
                return c
        slot = (slot + 1) & mask


cdef int _table_put(HiRadixTree self, node_t child) except -1 nogil:
    cdef uint64_t h, mask, slot
    if 2 * (self.ht_count + 1) > self.ht_cap:
        # Growing re-files every linked node, ``child`` included (callers link it
        # to its parent first), so there is nothing left to add.
        return _grow_table(self)
    h = _page_hash(self, self.nodes[child].parent, self.tokens + self.nodes[child].key_off)
    mask = <uint64_t>(self.ht_cap - 1)
    slot = h & mask
    while self.ht_vals[slot] != NO_NODE:
        slot = (slot + 1) & mask
    self.ht_keys[slot] = h
    self.ht_vals[slot] = child
    self.ht_count += 1
    return 0


cdef void _table_replace(HiRadixTree self, node_t old, node_t new) noexcept nogil:
    # ``new`` takes the entry of ``old``: same parent, same first page (a split).
    cdef uint64_t h = _page_hash(self, self.nodes[old].parent, self.tokens + self.nodes[old].key_off)
    cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
    cdef uint64_t slot = h & mask
    while self.ht_vals[slot] != old:
        slot = (slot + 1) & mask
    self.ht_vals[slot] = new


cdef void _table_del(HiRadixTree self, node_t child) noexcept nogil:
    cdef uint64_t h = _page_hash(self, self.nodes[child].parent, self.tokens + self.nodes[child].key_off)
    cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
    cdef uint64_t hole = h & mask
    cdef uint64_t j, home
    while self.ht_vals[hole] != child:
        hole = (hole + 1) & mask
    # Backward shift: pull later entries of the probe run into the hole when their home
    # slot does not lie cyclically in (hole, j].
    j = hole
    while True:
        j = (j + 1) & mask
        if self.ht_vals[j] == NO_NODE:
            break
        home = self.ht_keys[j] & mask
        if ((j - home) & mask) >= ((j - hole) & mask):
            self.ht_keys[hole] = self.ht_keys[j]
            self.ht_vals[hole] = self.ht_vals[j]
            hole = j
    self.ht_vals[hole] = NO_NODE
    self.ht_count -= 1


cdef void _link_child(HiRadixTree self, node_t parent, node_t child) noexcept nogil:
    cdef Node* p = &self.nodes[parent]
    cdef Node* c = &self.nodes[child]
    c.parent = parent
    c.prev_sibling = NO_NODE
    c.next_sibling = p.first_child
    if p.first_child != NO_NODE:
        self.nodes[p.first_child].prev_sibling = child
    p.first_child = child
    p.num_children += 1
    if c.on_device:
        p.num_device_children += 1


cdef void _unlink_child(HiRadixTree self, node_t child) noexcept nogil:
    cdef Node* c = &self.nodes[child]
    cdef Node* p = &self.nodes[c.parent]
    if c.prev_sibling != NO_NODE:
        self.nodes[c.prev_sibling].next_sibling = c.next_sibling
    else:
        p.first_child = c.next_sibling
    if c.next_sibling != NO_NODE:
        self.nodes[c.next_sibling].prev_sibling = c.prev_sibling
    p.num_children -= 1
    if c.on_device:
        p.num_device_children -= 1
    c.prev_sibling = NO_NODE
    c.next_sibling = NO_NODE
