# Included by _core.pyx (one module: these are its module-level definitions).
# Node structure: stamping, splitting, descending, new children, locks, gathers of index
# spans, and the groups a transfer covers.

cdef void _touch(HiRadixTree self, node_t i, double now) noexcept nogil:
    self.nodes[i].last_access_time = now
    self.nodes[i].visited = 1


cdef void _size_delta(HiRadixTree self, node_t i, int64_t tokens) noexcept nogil:
    if self.nodes[i].lock_ref > 0:
        self._protected += tokens
    else:
        self._evictable += tokens


cdef void _set_device(HiRadixTree self, node_t i, bint on) noexcept nogil:
    cdef Node* n = &self.nodes[i]
    if n.on_device == on:
        return
    n.on_device = on
    self.nodes[n.parent].num_device_children += 1 if on else -1


cdef node_t _split(HiRadixTree self, node_t child, int64_t split_len) except -2 nogil:
    # The existing node keeps its handle and becomes the suffix, so handles held for
    # locks and transfers in flight stay valid; the new node takes the prefix. All
    # three states (and the hashes) are cut by moving one offset.
    cdef node_t new = _alloc(self)
    cdef Node* c = &self.nodes[child]
    cdef Node* nw = &self.nodes[new]
    cdef node_t parent = c.parent
    self._num_nodes += 1
    nw.key_off = c.key_off
    nw.key_len = split_len
    nw.ns = c.ns
    nw.lock_ref = c.lock_ref
    nw.hit_count = c.hit_count
    nw.priority = c.priority
    nw.last_access_time = c.last_access_time
    nw.creation_time = c.creation_time
    nw.io_status = c.io_status
    nw.io_ticket = c.io_ticket
    nw.visited = c.visited
    nw.sieve_lap = c.sieve_lap
    nw.on_device = c.on_device
    nw.backed_up = c.backed_up
    nw.pending = c.pending
    _table_replace(self, child, new)
    # new takes child's place among the parent's children
    nw.parent = parent
    nw.prev_sibling = c.prev_sibling
    nw.next_sibling = c.next_sibling
    if c.prev_sibling != NO_NODE:
        self.nodes[c.prev_sibling].next_sibling = new
    else:
        self.nodes[parent].first_child = new
    if c.next_sibling != NO_NODE:
        self.nodes[c.next_sibling].prev_sibling = new
    # child hangs below new
    c.key_off += split_len
    c.key_len -= split_len
    c.parent = new
    c.prev_sibling = NO_NODE
    c.next_sibling = NO_NODE
    nw.first_child = child
    nw.num_children = 1
    nw.num_device_children = c.on_device
    _table_put(self, child)
    _refresh(self, new)
    _refresh(self, child)
    if self._track:
        _record(self, CHANGE_SPLIT, new, _handle(&self.nodes[child], child), split_len)
    return new


cdef node_t _step(HiRadixTree self, node_t node, const token_t* toks, int64_t remaining, double now,
                  int64_t* plen) except -2 nogil:
    # One edge of a descent: find the child for the next page, stamp it, and split
    # it where the match ends inside it. Returns NO_NODE when nothing matches.
    cdef node_t child
    cdef int64_t klen, n
    if remaining < self.page_size:
        return NO_NODE
    child = _find_child(self, node, toks)
    if child == NO_NODE:
        return NO_NODE
    _touch(self, child, now)
    klen = self.nodes[child].key_len
    n = klen if klen < remaining else remaining
    n = _common_prefix(self.tokens + self.nodes[child].key_off, toks, n, self.page_size)
    if n < klen:
        child = _split(self, child, n)
    plen[0] = n
    return child


cdef node_t _new_child(HiRadixTree self, node_t parent, const token_t* toks, int64_t n,
                       double now) except -2 nogil:
    cdef node_t i
    cdef Node* nd
    cdef Node* p
    cdef const uint8_t* prev
    _reserve_span(self, n)
    i = _alloc(self)
    nd = &self.nodes[i]
    p = &self.nodes[parent]
    nd.key_off = self.buf_len
    nd.key_len = n
    nd.ns = p.ns
    nd.last_access_time = now
    nd.creation_time = now
    self.buf_len += n
    if self.buf_len > self.buf_hwm:
        self.buf_hwm = self.buf_len
    memcpy(self.tokens + nd.key_off, toks, n * sizeof(token_t))
    if self.enable_hash:
        if p.is_root:
            prev = _seed(self, p.ns)
        else:
            prev = self.hashes + ((p.key_off + p.key_len) // self.page_size - 1) * DIGEST
        hr_hash_pages(toks, n // self.page_size, self.page_size, prev,
                      self.hashes + nd.key_off // self.page_size * DIGEST)
    _link_child(self, parent, i)
    _table_put(self, i)
    self._num_nodes += 1
    return i


cdef void _delete_leaf(HiRadixTree self, node_t i) noexcept nogil:
    cdef node_t parent = self.nodes[i].parent
    _table_del(self, i)
    _unlink_child(self, i)
    _release(self, i)
    _refresh(self, parent)


cdef void _demote(HiRadixTree self, node_t i) noexcept nogil:
    _set_device(self, i, 0)
    self._evictable -= self.nodes[i].key_len
    _refresh(self, i)
    _refresh(self, self.nodes[i].parent)


cdef int _backup_chain(HiRadixTree self, node_t i, list out, set seen) except -1:
    # ``i`` and its ancestors that are neither backed up nor being written, parents
    # first, so backup continuity holds whatever order the copies finish in.
    chain = []
    cdef Node* n = &self.nodes[i]
    while not n.is_root and not n.backed_up and n.io_status != IO_WRITING:
        chain.append(_handle(n, i))
        i = n.parent
        n = &self.nodes[i]
    for h in reversed(chain):
        if h not in seen:
            seen.add(h)
            out.append(h)
    return 0


cdef int64_t _lock(HiRadixTree self, node_t i, int sign) noexcept nogil:
    cdef int64_t delta = 0
    cdef Node* n = &self.nodes[i]
    while not n.is_root:
        if n.on_device and n.lock_ref == (0 if sign > 0 else 1):
            self._evictable -= sign * n.key_len
            self._protected += sign * n.key_len
            delta -= sign * n.key_len
        n.lock_ref += sign
        _refresh(self, i)
        i = n.parent
        n = &self.nodes[i]
    return delta


cdef node_t _device_anchor(HiRadixTree self, node_t i, int64_t* evicted) noexcept nogil:
    # The deepest node at or above ``i`` on the device (a root is); ``evicted`` gets the
    # tokens of the evicted chain between them.
    cdef int64_t total = 0
    while not self.nodes[i].on_device:
        total += self.nodes[i].key_len
        i = self.nodes[i].parent
    evicted[0] = total
    return i


cdef object _gather(HiRadixTree self, node_t top_exclusive, node_t bottom, bint host):
    # Concatenated spans of the nodes strictly below ``top_exclusive`` down to
    # ``bottom``, filled from the end so no reversal is needed.
    cdef int64_t total = 0
    cdef node_t i = bottom
    cdef slot_t* src = self.host if host else self.dev
    while i != top_exclusive:
        total += self.nodes[i].key_len
        i = self.nodes[i].parent
    cdef cnp.ndarray out = _empty(total, cnp.NPY_INT64)
    cdef index_t* dst = <index_t*>cnp.PyArray_DATA(out)
    if total >= NOGIL_MIN:
        with nogil:
            _fill(self, top_exclusive, bottom, src, dst, total)
    else:
        _fill(self, top_exclusive, bottom, src, dst, total)
    return out


cdef void _fill(HiRadixTree self, node_t top_exclusive, node_t i, const slot_t* src, index_t* dst,
                int64_t total) noexcept nogil:
    while i != top_exclusive:
        total -= self.nodes[i].key_len
        hr_slots_out(dst + total, src + self.nodes[i].key_off, self.nodes[i].key_len)
        i = self.nodes[i].parent


cdef node_t _descend(HiRadixTree self, node_t node, const token_t* ptr, int64_t n, double now,
                     int64_t* pos) except -2 nogil:
    # Follow ``ptr[:n]`` down from ``node``, stamping and splitting as _step does;
    # returns the deepest matched node and sets ``pos`` to the matched length.
    cdef node_t child
    cdef int64_t plen = 0
    pos[0] = 0
    while pos[0] < n:
        child = _step(self, node, ptr + pos[0], n - pos[0], now, &plen)
        if child == NO_NODE:
            break
        _refresh(self, child)
        node = child
        pos[0] += plen
    return node


cdef int64_t _walk64(HiRadixTree self, const int64_t* key, int64_t n, node_t node, node_t* path,
                     int* depth, int64_t* cut, bint slots) noexcept nogil:
    # _match64's read-only descent: the spans ``key[:n]`` (page-aligned) matches, into
    # ``path``; ``cut`` is where the match ends inside the last one (0: at its end);
    # returns the matched length, or -1 for a path deeper than MATCH64_DEPTH. With
    # ``slots`` the spans' device slots are prefetched for the gather that follows; a
    # match that only counts them leaves them unread.
    cdef int64_t pos = 0, klen, m
    cdef node_t child
    depth[0] = 0
    cut[0] = 0
    while pos < n:
        child = _find_child64(self, node, key + pos)
        if child == NO_NODE:
            break
        if depth[0] == MATCH64_DEPTH:
            return -1
        klen = self.nodes[child].key_len
        m = klen if klen < n - pos else n - pos
        if klen + self.page_size <= n - pos:  # the key goes on past this span
            _prefetch_child64(self, child, key + pos + klen)
        m = <int64_t>hr_common64(self.tokens + self.nodes[child].key_off, key + pos,
                                 self.dev + self.nodes[child].key_off if slots else NULL, m)
        m -= m % self.page_size
        path[depth[0]] = child
        depth[0] += 1
        pos += m
        node = child
        if m < klen:
            cut[0] = m     # the match ends inside this span: _step splits it there
            break
    return pos


cdef object _match64(HiRadixTree self, const int64_t* key, int64_t total, node_t root, int64_t* out,
                     bint slots):
    # match_into's work on int64 ids (SGLang's array('q') keys), each read once where it
    # is, without narrowing the key into a buffer first. The descent first only reads
    # (_walk64), and the tree is touched and split as _descend does only once the ids not
    # matched are known to fit int32: a key with one that does not leaves the tree as it
    # was, as _as_tokens's OverflowError does. Returns None where match_into's general
    # path must serve (a path deeper than MATCH64_DEPTH; an id out of range, which that
    # path raises for); else the device indices, or True without ``slots`` (match_into's
    # ``out`` holds all the rest).
    cdef node_t path[MATCH64_DEPTH]
    cdef int depth = 0, d
    cdef int64_t n = total - total % self.page_size
    cdef int64_t pos, cut = 0, host_hit = 0
    cdef node_t node, last_dev, last_host
    hr_prefetch_key(key, n)
    if n >= NOGIL_MIN:
        with nogil:
            pos = _walk64(self, key, n, root, path, &depth, &cut, slots)
    else:
        pos = _walk64(self, key, n, root, path, &depth, &cut, slots)
    if pos < 0 or (pos < total and hr_high64(key + pos, total - pos)):
        return None
    cdef double now = _tick(self)
    node = root
    for d in range(depth):
        node = path[d]
        _touch(self, node, now)
        if d == depth - 1 and cut:
            node = _split(self, node, cut)
        _refresh(self, node)
    last_dev = node
    while not self.nodes[last_dev].on_device:
        host_hit += self.nodes[last_dev].key_len
        last_dev = self.nodes[last_dev].parent
    last_host = last_dev
    while not self.nodes[last_host].backed_up:
        last_host = self.nodes[last_host].parent
    out[0] = _handle(&self.nodes[last_dev], last_dev)
    out[1] = _handle(&self.nodes[last_host], last_host)
    out[2] = host_hit
    out[3] = _handle(&self.nodes[node], node)
    out[4] = pos - host_hit  # the device part: the path's top, down to last_dev
    return _gather(self, root, last_dev, False) if slots else True


cdef object _spans(HiRadixTree self, int64_t k, slot_t* buf, object reuse=None):
    # Concatenate ``k`` (offset, length) records of the scratch buffer, into a view of
    # ``reuse`` (an int64 array nothing else refers to: the caller checks) when it is
    # large enough.
    cdef int64_t j, total = 0, pos = 0
    for j in range(k):
        total += self.scratch[3 * j + 1]
    cdef cnp.ndarray out
    if reuse is not None and total <= (<cnp.ndarray>reuse).shape[0]:
        out = reuse[:total]
    else:
        out = _empty(total, cnp.NPY_INT64)
    cdef index_t* dst = <index_t*>cnp.PyArray_DATA(out)
    with nogil:
        if total >= STREAM_MIN:  # an eviction's worth: non-temporal stores (_platform.h)
            for j in range(k):
                hr_slots_out_stream(dst + pos, buf + self.scratch[3 * j], self.scratch[3 * j + 1])
                pos += self.scratch[3 * j + 1]
            hr_stream_fence()
        else:
            for j in range(k):
                hr_slots_out(dst + pos, buf + self.scratch[3 * j], self.scratch[3 * j + 1])
                pos += self.scratch[3 * j + 1]
    return out


cdef node_t _io_group_top(HiRadixTree self, node_t i, int status, str op) except -2:
    # The topmost node of ``i``'s transfer group: ``i`` and the ancestors split off it
    # while the transfer was in flight all carry its ticket. Only the node the
    # transfer was begun on may finish it: finishing from a split-off prefix would
    # release a lock on the wrong path.
    if self.nodes[i].io_status != status:
        raise LockError(
            f"{op}: node {_handle(&self.nodes[i], i)} has no {IO_NAMES[status]} transfer in flight "
            f"(io_status {IO_NAMES[self.nodes[i].io_status]}; finished already, or never begun)")
    if not self.nodes[i].io_owner:
        raise LockError(
            f"{op}: node {_handle(&self.nodes[i], i)} was split off the node its transfer was begun on; "
            "name that node (its handle is the split's lower part)")
    cdef int64_t ticket = self.nodes[i].io_ticket
    cdef node_t p = self.nodes[i].parent
    while not self.nodes[p].is_root and self.nodes[p].io_ticket == ticket:
        i = p
        p = self.nodes[i].parent
    return i


cdef int _check_unpinned(HiRadixTree self, node_t i, str op) except -1:
    cdef Node* n = &self.nodes[i]
    if n.lock_ref or n.io_status != IO_IDLE:
        raise LockError(
            f"{op}: node {_handle(n, i)} is locked (lock_ref {n.lock_ref}, "
            f"io_status {IO_NAMES[n.io_status]}); its slots may still be read")
    return 0


cdef void _io_finish(HiRadixTree self, node_t i, node_t top, bint backed_up) noexcept nogil:
    # Close the transfer of the group from ``i`` up to ``top``.
    cdef Node* m
    while True:
        m = &self.nodes[i]
        if backed_up:
            m.backed_up = 1
            self._host_size += m.key_len
        m.pending = 0
        m.io_status = IO_IDLE
        m.io_ticket = 0
        if i == top:
            break
        i = m.parent


cdef tuple _report_path(HiRadixTree self, node_t root, node_t last):
    # Nodes the write-through policy wants backed up after an insert: every path node
    # whose hit count reached the threshold, with the run of ancestors that are
    # neither backed up nor being written above it, parents first. Every node of the
    # path was hit, created or re-materialized (then it is backed up) by this insert,
    # so the final state decides. Walking up, a qualifying node opens a run and a
    # backed-up (or writing) node closes it; the union of runs needs no dedup.
    cdef node_t i = last
    cdef int64_t k = 0, j
    cdef bint in_run = False, eligible
    cdef Node* n
    while i != root:
        n = &self.nodes[i]
        eligible = not n.backed_up and n.io_status != IO_WRITING
        if eligible and n.hit_count >= self.write_through_threshold:
            in_run = True
        if eligible and in_run:
            _reserve_scratch(self, k + 1)
            self.scratch[k] = _handle(n, i)
            k += 1
        elif not eligible:
            in_run = False
        i = n.parent
    cdef object item
    cdef tuple out = PyTuple_New(k)
    for j in range(k):
        item = self.scratch[k - 1 - j]
        Py_INCREF(item)
        PyTuple_SET_ITEM(out, j, item)
    return out
