# Included by _core.pyx (one module: these are its module-level definitions).
# Arena and spans: node slots, the token/index/hash buffers, compaction, the change log,
# namespaces and their seeds, and handles.

cdef inline int64_t _handle(Node* n, node_t i) noexcept nogil:
    return <int64_t>i | (<int64_t>n.gen << 32)


cdef int _cmp_first(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0]
    cdef int64_t y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


cdef int _grow_nodes(HiRadixTree self) except -1 nogil:
    cdef node_t cap = 64 if self.n_cap == 0 else 2 * self.n_cap
    cdef void* p
    cdef int s
    p = hr_buf_grow(self.nodes, self.n_cap * sizeof(Node), cap * sizeof(Node))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.nodes = <Node*>p
    p = realloc(self.free_stack, cap * sizeof(node_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.free_stack = <node_t*>p
    for s in range(2):
        p = hr_buf_grow(self.heap[s], self.n_cap * sizeof(HeapEntry), cap * sizeof(HeapEntry))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.heap[s] = <HeapEntry*>p
    self.n_cap = cap
    return 0


cdef int _reserve_span(HiRadixTree self, int64_t n, bint exact=False) except -1 nogil:
    # Room for ``n`` more tokens: doubling (amortized O(1) appends), or, for a capacity
    # hint (``exact``), exactly that many. The buffers are mapped, not touched
    # (hr_buf_grow: mremap, no copy), so a capacity costs memory only as far as tokens
    # are written (buf_hwm): doubling holds no untouched half in memory.
    cdef int64_t cap = self.buf_cap if self.buf_cap else 4096
    cdef int64_t pages, hash_bytes
    cdef void* p
    if self.buf_len + n <= self.buf_cap and self.hashes != NULL:
        return 0
    if exact:
        cap = max(cap, self.buf_len + n)
    while cap < self.buf_len + n:
        cap *= 2
    pages = cap // self.page_size + 1
    p = hr_buf_grow(self.tokens, self.buf_cap * sizeof(token_t), cap * sizeof(token_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.tokens = <token_t*>p
    p = hr_buf_grow(self.dev, self.buf_cap * sizeof(slot_t), cap * sizeof(slot_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.dev = <slot_t*>p
    p = hr_buf_grow(self.host, self.buf_cap * sizeof(slot_t), cap * sizeof(slot_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.host = <slot_t*>p
    hash_bytes = (pages if self.enable_hash else 1) * DIGEST
    if hash_bytes > self.hash_bytes:
        p = hr_buf_grow(self.hashes, self.hash_bytes, hash_bytes)
        if p == NULL:
            with gil:
                raise MemoryError()
        self.hashes = <uint8_t*>p
        self.hash_bytes = hash_bytes
    self.buf_cap = cap
    return 0


cdef int _grow_table(HiRadixTree self) except -1 nogil:
    cdef int64_t cap = 1024 if self.ht_cap == 0 else 2 * self.ht_cap
    cdef void* p
    cdef node_t i
    cdef int64_t k
    p = realloc(self.ht_keys, cap * sizeof(uint64_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.ht_keys = <uint64_t*>p
    p = realloc(self.ht_vals, cap * sizeof(node_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.ht_vals = <node_t*>p
    self.ht_cap = cap
    self.ht_count = 0
    for k in range(cap):
        self.ht_vals[k] = NO_NODE
    for i in range(self.n_used):   # re-file every child
        if self.nodes[i].alive and not self.nodes[i].is_root:
            _table_put(self, i)
    return 0


cdef int _reserve_slots_in(HiRadixTree self, int64_t n) except -1 nogil:
    # Room for ``n`` staged slots of an insert (slots_in): doubling.
    cdef int64_t cap = self.slots_in_cap if self.slots_in_cap else 4096
    cdef void* p
    if n <= self.slots_in_cap:
        return 0
    while cap < n:
        cap *= 2
    p = realloc(self.slots_in, cap * sizeof(slot_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.slots_in = <slot_t*>p
    self.slots_in_cap = cap
    return 0


cdef int _reserve_scratch(HiRadixTree self, int64_t triples) except -1 nogil:
    cdef int64_t cap = self.scratch_cap if self.scratch_cap else 64
    cdef void* p
    if triples <= self.scratch_cap:
        return 0
    while cap < triples:
        cap *= 2
    p = realloc(self.scratch, cap * 3 * sizeof(int64_t))
    if p == NULL:
        with gil:
            raise MemoryError()
    self.scratch = <int64_t*>p
    self.scratch_cap = cap
    return 0


cdef int _record(HiRadixTree self, int kind, node_t i, int64_t other, int64_t tokens) except -1 nogil:
    # One change-log row, naming node ``i`` by its handle (callers record a node before
    # they free it). Only called while tracking is on.
    cdef int64_t cap = self.changes_cap if self.changes_cap else 64
    cdef void* p
    cdef int64_t* row
    if self.changes_n == self.changes_cap:
        while cap <= self.changes_n:
            cap *= 2
        p = realloc(self.changes, cap * 4 * sizeof(int64_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.changes = <int64_t*>p
        self.changes_cap = cap
    row = self.changes + 4 * self.changes_n
    row[0] = kind
    row[1] = _handle(&self.nodes[i], i)
    row[2] = other
    row[3] = tokens
    self.changes_n += 1
    return 0


cdef void _reverse_changes(HiRadixTree self, int64_t start) noexcept nogil:
    # Rows recorded walking up a chain, put parents first.
    cdef int64_t a = start, b = self.changes_n - 1, k, t
    while a < b:
        for k in range(4):
            t = self.changes[4 * a + k]
            self.changes[4 * a + k] = self.changes[4 * b + k]
            self.changes[4 * b + k] = t
        a += 1
        b -= 1


cdef node_t _alloc(HiRadixTree self) except -2 nogil:
    cdef node_t i
    cdef int32_t gen
    cdef Node* n
    if self.free_n > 0:
        self.free_n -= 1
        i = self.free_stack[self.free_n]
        gen = self.nodes[i].gen
    else:
        if self.n_used == self.n_cap:
            _grow_nodes(self)
        i = self.n_used
        self.n_used += 1
        gen = 0
    n = &self.nodes[i]
    memset(n, 0, sizeof(Node))
    n.gen = gen
    n.alive = 1
    self._uid += 1
    n.uid = self._uid
    n.parent = NO_NODE
    n.first_child = NO_NODE
    n.next_sibling = NO_NODE
    n.prev_sibling = NO_NODE
    n.heap_pos[0] = -1
    n.heap_pos[1] = -1
    self.nodes_allocated += 1
    return i


cdef void _release(HiRadixTree self, node_t i) noexcept nogil:
    cdef Node* n = &self.nodes[i]
    if n.heap_pos[0] >= 0:
        _heap_remove(self, DEVICE_SET, i)
    if n.heap_pos[1] >= 0:
        _heap_remove(self, HOST_SET, i)
    n.alive = 0
    n.gen = (n.gen + 1) & 0x7FFFFFFF
    self.buf_garbage += n.key_len
    if not n.is_root:
        self._num_nodes -= 1
    self.free_stack[self.free_n] = i
    self.free_n += 1
    self.nodes_freed += 1


cdef int _compact_before_append(HiRadixTree self, int64_t n) except -1 nogil:
    # Before appending up to ``n`` tokens: compact instead of writing past the buffers'
    # high-water mark (memory not touched yet) when deleted spans are a quarter or more
    # of the used length. Memory then grows only while garbage is under a quarter, so the
    # touched buffers stay within 4/3 of the live tokens (plus COMPACT_MIN and one
    # insert) at their peak, where compacting only past half the buffer let them reach
    # twice. Hysteresis: a compaction empties the garbage and the next one waits for the
    # appends to reach the mark again, with a quarter of the length deleted since, so
    # its O(used length) cost is amortized over at least that many deleted tokens (each
    # inserted once): O(1) a token.
    if (self.buf_len + n > self.buf_hwm and self.buf_garbage > COMPACT_MIN
            and 4 * self.buf_garbage >= self.buf_len):
        _compact(self)
    return 0


cdef int _compact(HiRadixTree self) except -1 nogil:
    # Slide live spans down over deleted ones, in offset order (_compact_before_append
    # says when). Offsets move; nothing a caller sees does.
    cdef int64_t k = 0
    cdef int64_t j, off, ln, pos = 0
    cdef node_t i
    _reserve_scratch(self, self.n_used)
    for i in range(self.n_used):
        if self.nodes[i].alive and self.nodes[i].key_len > 0:
            self.scratch[2 * k] = self.nodes[i].key_off
            self.scratch[2 * k + 1] = i
            k += 1
    qsort(self.scratch, k, 2 * sizeof(int64_t), _cmp_first)
    for j in range(k):
        i = <node_t>self.scratch[2 * j + 1]
        off = self.nodes[i].key_off
        ln = self.nodes[i].key_len
        if off != pos:
            memmove(self.tokens + pos, self.tokens + off, ln * sizeof(token_t))
            memmove(self.dev + pos, self.dev + off, ln * sizeof(slot_t))
            memmove(self.host + pos, self.host + off, ln * sizeof(slot_t))
            if self.enable_hash:
                memmove(self.hashes + pos // self.page_size * DIGEST,
                        self.hashes + off // self.page_size * DIGEST,
                        ln // self.page_size * DIGEST)
            self.nodes[i].key_off = pos
        pos += ln
    self.buf_len = pos
    self.buf_garbage = 0
    return 0


cdef node_t _new_root(HiRadixTree self, int32_t ns) except -2 nogil:
    cdef node_t i = _alloc(self)
    cdef Node* n = &self.nodes[i]
    n.is_root = 1
    n.on_device = 1
    n.backed_up = 1
    n.lock_ref = 1       # a root is never evicted
    n.ns = ns
    return i


cdef int _set_seed(HiRadixTree self, int32_t ns, object extra_key) except -1:
    # Namespace ns's chain seed: chain_seed(extra_key) if given, else none for the
    # default root and namespace_seed(extra_key) for a named one.
    cdef void* p
    cdef int32_t cap
    if self._chain_seed is not None:
        value = self._chain_seed(extra_key)
    else:
        value = None if extra_key is None else namespace_seed(extra_key)
    cdef object digest = seed_digest(value, extra_key)
    if ns >= self.ns_cap:
        cap = 2 * self.ns_cap + 4
        p = realloc(self.seeds, cap * DIGEST)
        if p == NULL:
            raise MemoryError()
        self.seeds = <uint8_t*>p
        p = realloc(self.seeded, cap)
        if p == NULL:
            raise MemoryError()
        self.seeded = <uint8_t*>p
        self.ns_cap = cap
    self.seeded[ns] = digest is not None
    if digest is not None:
        memcpy(self.seeds + ns * DIGEST, <const char*>(<bytes>digest), DIGEST)
    return 0


cdef const uint8_t* _seed(HiRadixTree self, int32_t ns) noexcept nogil:
    return self.seeds + ns * DIGEST if self.seeded[ns] else NULL


cdef node_t _ns_root(HiRadixTree self, object extra_key) except -2:
    if extra_key is None:
        return self.root_idx
    root = self._namespaces.get(extra_key)
    if root is not None:
        return <node_t>root
    if not isinstance(extra_key, str):
        raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
    _set_seed(self, self.ns_n, extra_key)
    cdef node_t r = _new_root(self, self.ns_n)
    self.ns_n += 1
    self._namespaces[extra_key] = r
    return r


cdef node_t _node(HiRadixTree self, object handle) except -2:
    # __index__ semantics: TypeError for a float (never truncated); an integer beyond
    # int64 names no node, as in the twin.
    cdef int overflow = 0
    cdef int64_t h = PyLong_AsLongLongAndOverflow(handle, &overflow)
    cdef int64_t index = h & 0xFFFFFFFF
    if overflow or h < 0 or index >= self.n_used:
        raise KeyError(f"no node with handle {handle}")
    if not self.nodes[index].alive or self.nodes[index].gen != (h >> 32):
        raise KeyError(f"node handle {handle} is stale (its node was freed)")
    return <node_t>index


cdef double _tick(HiRadixTree self) except? -1:
    if self._clock is not None:
        return float(self._clock())
    self._time += 1
    return <double>self._time
