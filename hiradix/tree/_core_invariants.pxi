# Included by _core.pyx (one module: these are its module-level definitions).
# Invariants: the full recount behind ``HiRadixTree.check_invariants``.

cdef int _check_invariants(HiRadixTree self) except -1:
    """The checks of :meth:`HiRadixTree.check_invariants`; raises ``AssertionError``."""
    cdef node_t i, c, p
    cdef Node* n
    cdef int64_t evictable = 0, protected = 0, host = 0, live = 0, nonroot = 0
    cdef int64_t kids, dev_kids, s, pos, owned
    cdef bint unlocked, want_dev, want_host, owner_below
    cdef HeapEntry fresh
    cdef uint8_t digest[32]
    cdef const uint8_t* prev

    def fail(msg, node_t i):
        raise AssertionError(f"{msg}: {self.node_info(_handle(&self.nodes[i], i))}")

    for i in range(self.n_used):
        n = &self.nodes[i]
        if not n.alive:
            continue
        live += 1
        kids = dev_kids = 0
        owned = n.own_locks + n.io_owner
        if self._plans and _handle(n, i) in self._plans:
            owned += 1    # a held load-back plan's lock
        owner_below = False
        c = n.first_child
        while c != NO_NODE:
            if self.nodes[c].parent != i:
                fail("child's parent link is wrong", c)
            if _find_child(self, i, self.tokens + self.nodes[c].key_off) != c:
                fail("child is not filed under its first page", c)
            kids += 1
            dev_kids += self.nodes[c].on_device
            owned += self.nodes[c].lock_ref
            owner_below |= n.io_status != IO_IDLE and self.nodes[c].io_ticket == n.io_ticket
            c = self.nodes[c].next_sibling
        if kids != n.num_children or dev_kids != n.num_device_children:
            fail("child counters differ from a recount", i)
        for s in range(2):
            pos = n.heap_pos[s]
            if pos >= 0 and (pos >= self.heap_n[s] or self.heap[s][pos].node != i):
                fail("heap position is wrong", i)
            if pos >= 0:
                _key(self, i, &fresh)
                if (_entry_less(&fresh, &self.heap[s][pos]) or fresh.uid != self.heap[s][pos].uid):
                    fail("cached heap key exceeds the node's key", i)
        if n.is_root:
            if n.parent != NO_NODE or n.key_len or n.lock_ref != 1:
                fail("malformed root", i)
            if n.heap_pos[0] >= 0 or n.heap_pos[1] >= 0:
                fail("root in a victim set", i)
            continue
        nonroot += 1
        p = n.parent
        if p == NO_NODE or not self.nodes[p].alive:
            fail("dangling parent", i)
        if n.key_len <= 0 or n.key_len % self.page_size or n.key_off % self.page_size:
            fail("key span is not page aligned", i)
        if n.key_off + n.key_len > self.buf_len:
            fail("key span beyond the buffer", i)
        if n.lock_ref < 0 or n.host_ref_counter < 0:
            fail("negative reference count", i)
        if n.lock_ref > self.nodes[p].lock_ref and not self.nodes[p].is_root:
            fail("lock_ref exceeds its parent's", i)
        if not n.on_device and not n.backed_up:
            fail("node is neither on the device nor backed up", i)
        if n.on_device and not self.nodes[p].on_device:
            fail("device node under an evicted parent", i)
        if n.backed_up and not self.nodes[p].backed_up:
            fail("backup continuity broken: backed-up node under a parent that is not", i)
        if (n.io_status == IO_WRITING) != n.pending or (n.pending and n.backed_up):
            fail("pending host indices disagree with io_status", i)
        if n.io_status != IO_IDLE and n.lock_ref == 0:
            fail("transfer in flight on an unlocked node", i)
        if n.io_owner and n.io_status == IO_IDLE:
            fail("transfer lock held without a transfer in flight", i)
        # A member of a transfer group that did not begin it is a prefix split off
        # the node that did, which is below it with the same ticket.
        if n.io_status != IO_IDLE and not n.io_owner and not owner_below:
            fail("transfer in flight without its owner below", i)
        # Every lock is owned by one node (a request's or a transfer's): lock_ref is
        # exactly the locks owned here and below.
        if n.own_locks < 0 or n.lock_ref != owned:
            fail(f"lock_ref differs from the locks owned at and below the node ({owned})", i)
        if self.enable_hash:
            if self.nodes[p].is_root:
                prev = _seed(self, self.nodes[p].ns)
            else:
                prev = self.hashes + DIGEST * (
                    (self.nodes[p].key_off + self.nodes[p].key_len) // self.page_size - 1)
            hr_hash_pages(self.tokens + n.key_off, 1, self.page_size, prev, digest)
            if memcmp(digest, self.hashes + n.key_off // self.page_size * DIGEST, DIGEST) != 0:
                fail("hash chain broken at the first page", i)
        if n.on_device:
            if n.lock_ref:
                protected += n.key_len
            else:
                evictable += n.key_len
        if n.backed_up:
            host += n.key_len
        unlocked = n.lock_ref == 0
        want_dev = unlocked and n.on_device and n.num_device_children == 0
        want_host = (unlocked and not n.on_device and n.backed_up
                     and n.host_ref_counter == 0 and n.num_children == 0)
        if (n.heap_pos[0] >= 0) != want_dev:
            fail("device victim set membership differs from a recount", i)
        if (n.heap_pos[1] >= 0) != want_host:
            fail("host victim set membership differs from a recount", i)
    for s in range(2):
        for pos in range(1, self.heap_n[s]):
            if _entry_less(&self.heap[s][pos], &self.heap[s][(pos - 1) >> 1]):
                fail("heap order violated", self.heap[s][pos].node)
    if (evictable, protected, host) != (self._evictable, self._protected, self._host_size):
        raise AssertionError(
            f"size counters (evictable, protected, host) = "
            f"{(self._evictable, self._protected, self._host_size)}, recount {(evictable, protected, host)}")
    if nonroot != self.ht_count or nonroot != self._num_nodes:
        raise AssertionError(f"{nonroot} nodes, child table holds {self.ht_count}, counter {self._num_nodes}")
    if live != self.nodes_allocated - self.nodes_freed:
        raise AssertionError(
            f"{live} live nodes, but {self.nodes_allocated} allocated - {self.nodes_freed} freed")
    for h in self._plans:
        if not self.is_alive(h):
            raise AssertionError(f"load-back plan held for node {h}, which is not alive")
    return 0
