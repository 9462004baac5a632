# Included by _core.pyx (one module: these are its module-level definitions).
# Victim heaps: the eviction order of each tier.
#
# Two indexed binary min-heaps (device, host) of arena indices.
#
# Each node records its position in both heaps, so membership tests are O(1) and a
# key change, insertion or removal is one O(log n) sift. Nothing ever re-heapifies all
# leaves: SGLang's tree rebuilt a heap of every leaf on each evict() call, which cost up
# to 70 ms per call at 40k leaves.

cdef inline bint _entry_less(const HeapEntry* a, const HeapEntry* b) noexcept nogil:
    # Total order (k0, k1, uid), identical to EvictionPolicy.sort_key.
    if a.k0 != b.k0:
        return a.k0 < b.k0
    if a.k1 != b.k1:
        return a.k1 < b.k1
    return a.uid < b.uid


cdef double _field(HiRadixTree self, node_t i, int f) noexcept nogil:
    cdef Node* n = &self.nodes[i]
    if f == 0:
        return n.last_access_time
    if f == 1:
        return n.creation_time
    if f == 2:
        return <double>n.hit_count
    if f == 3:
        return <double>n.priority
    if f == 4:
        return 1.0 if n.hit_count >= self._slru_threshold else 0.0
    return <double>n.sieve_lap


cdef void _key(HiRadixTree self, node_t i, HeapEntry* e) noexcept nogil:
    # The node's current ordering key (k0, k1, uid), as EvictionPolicy.sort_key.
    e.k0 = self._key_sign[0] * _field(self, i, self._key_field[0])
    e.k1 = self._key_sign[1] * _field(self, i, self._key_field[1]) if self._key_field[1] >= 0 else 0.0
    e.uid = self.nodes[i].uid
    e.node = i


cdef void _heap_swap(HiRadixTree self, int s, node_t p, node_t q) noexcept nogil:
    cdef HeapEntry* h = self.heap[s]
    cdef HeapEntry tmp = h[p]
    h[p] = h[q]
    h[q] = tmp
    self.nodes[h[p].node].heap_pos[s] = p
    self.nodes[h[q].node].heap_pos[s] = q


cdef void _sift_up(HiRadixTree self, int s, node_t pos) noexcept nogil:
    cdef HeapEntry* h = self.heap[s]
    cdef node_t up
    while pos > 0:
        up = (pos - 1) >> 1
        if not _entry_less(&h[pos], &h[up]):
            break
        _heap_swap(self, s, pos, up)
        pos = up


cdef void _sift_down(HiRadixTree self, int s, node_t pos) noexcept nogil:
    cdef HeapEntry* h = self.heap[s]
    cdef node_t n = self.heap_n[s]
    cdef node_t child, best
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        best = child
        if child + 1 < n and _entry_less(&h[child + 1], &h[child]):
            best = child + 1
        if not _entry_less(&h[best], &h[pos]):
            break
        _heap_swap(self, s, pos, best)
        pos = best


cdef void _heap_push(HiRadixTree self, int s, node_t i) noexcept nogil:
    # The heap arrays have the arena's capacity, so a push never reallocates.
    cdef node_t pos = self.heap_n[s]
    _key(self, i, &self.heap[s][pos])
    self.nodes[i].heap_pos[s] = pos
    self.heap_n[s] += 1
    _sift_up(self, s, pos)


cdef void _heap_remove(HiRadixTree self, int s, node_t i) noexcept nogil:
    cdef node_t pos = self.nodes[i].heap_pos[s]
    cdef node_t last = self.heap_n[s] - 1
    if pos != last:
        _heap_swap(self, s, pos, last)
    self.heap_n[s] -= 1
    self.nodes[i].heap_pos[s] = -1
    if pos != last:
        _sift_up(self, s, pos)
        _sift_down(self, s, pos)


cdef void _set_member(HiRadixTree self, int s, node_t i, bint member) noexcept nogil:
    # Heap entries cache their key. A key that went down (MRU's touch) is sifted up
    # at once; one that went up (an LRU touch, a hit) is left stale and sifted down
    # only if it reaches the top (_pop_victim). Cached keys never exceed true ones,
    # so the top is the true minimum once its own key is fresh, and a touch of a
    # leaf costs no heap traffic at all.
    cdef HeapEntry e
    cdef node_t pos = self.nodes[i].heap_pos[s]
    if member:
        if pos < 0:
            if self._second_chance:   # a node entering a victim set joins its hand's lap
                self.nodes[i].sieve_lap = self._sieve_hand[s]
            _heap_push(self, s, i)
        else:
            _key(self, i, &e)
            if _entry_less(&e, &self.heap[s][pos]):
                self.heap[s][pos] = e
                _sift_up(self, s, pos)
    elif pos >= 0:
        _heap_remove(self, s, i)


cdef void _refresh(HiRadixTree self, node_t i) noexcept nogil:
    # Recompute a node's membership of both victim sets after any change to it.
    cdef Node* n = &self.nodes[i]
    cdef bint unlocked = not n.is_root and n.lock_ref == 0
    _set_member(self, DEVICE_SET, i, unlocked and n.on_device and n.num_device_children == 0)
    n = &self.nodes[i]
    _set_member(
        self, HOST_SET, i,
        unlocked and not n.on_device and n.backed_up and n.host_ref_counter == 0
        and n.num_children == 0,
    )


cdef node_t _pop_victim(HiRadixTree self, int s) noexcept nogil:
    # Smallest member of a heap, removed from it. A stale top gets its fresh key and
    # sinks. With SIEVE, a visited node loses its bit and moves to the next lap
    # instead of being evicted; every such step is paid for by an earlier access.
    cdef node_t i
    cdef Node* n
    cdef HeapEntry e
    while self.heap_n[s] > 0:
        i = self.heap[s][0].node
        _key(self, i, &e)
        if _entry_less(&self.heap[s][0], &e):
            self.heap[s][0] = e
            _sift_down(self, s, 0)
            continue
        n = &self.nodes[i]
        if self._second_chance:
            self._sieve_hand[s] = n.sieve_lap
            if n.visited:
                n.visited = 0
                n.sieve_lap += 1
                continue
        _heap_remove(self, s, i)
        return i
    return NO_NODE


cdef list _victims(HiRadixTree self, int s):
    cdef node_t k, i
    entries = []
    for k in range(self.heap_n[s]):
        i = self.heap[s][k].node
        entries.append((_sort_key(self, i), _handle(&self.nodes[i], i)))
    entries.sort()
    return [h for _, h in entries]


cdef tuple _sort_key(HiRadixTree self, node_t i):
    cdef HeapEntry e
    _key(self, i, &e)
    return (e.k0, e.k1, e.uid)
