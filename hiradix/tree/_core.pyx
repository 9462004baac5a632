# cython: language_level=3
"""The compiled HiRadixTree: a triple-state radix tree over token ids.

Same API and semantics as the pure-Python twin :mod:`hiradix.tree._reference`, which
documents every operation in prose; this module is about speed. Nodes are C structs in
an arena (see ``_core.pxd``), token and KV-index spans sit in parallel buffers, children
are found through one hash table, and both victim sets are indexed binary heaps, so a
victim costs ``O(log n)`` and nothing is ever re-heapified. The walks and gathers run
without the GIL.

The tree is not thread-safe: callers serialize operations (HiRadixCache does).

One module, several files (``include``, at module level, where Cython allows it): this one
holds the class and its public API (match/insert, eviction, tier moves, queries); the
private helpers are module-level functions over ``HiRadixTree self``, one file per concern:
``_core_inputs.pxi`` (argument checks), ``_core_hashing.pxi`` (page hashes),
``_core_records.pxi`` (result records), ``_core_arena.pxi`` (node slots, span buffers,
change log, namespaces, handles), ``_core_children.pxi`` (child table),
``_core_heaps.pxi`` (victim heaps), ``_core_nodes.pxi`` (split, descend, locks, gathers,
transfer groups) and ``_core_invariants.pxi`` (``check_invariants``).

Errors are the twin's, type for type (its module docstring has the table): ``KeyError``
for a handle naming no live node, ``TypeError`` for a non-integer handle, count or dtype,
``OverflowError`` for an integer the tree cannot store, ``ValueError`` for bad values
and states, :class:`hiradix.LockError` for a broken locking or transfer protocol. A
refused call changes nothing.
"""

cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport Py_INCREF, Py_REFCNT
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

import hashlib
from array import array

import numpy as np

from hiradix.tree._results import IOStatus, LockError
from hiradix.tree.policy import FIELDS, check_tree_args, get_policy, seed_digest, write_through_threshold

cnp.import_array()

cdef extern from "_sha256.h" nogil:
    void hr_sha256(const void* data, size_t length, uint8_t* out)
    void hr_hash_pages(const int32_t* tokens, size_t n_pages, size_t page_size,
                       const uint8_t* prev, uint8_t* out)
    void hr_digest_hex(const uint8_t* digest, char* out)
    int hr_sha256_accelerated()
    void hr_sha256_set_portable(int on)

cdef extern from "_platform.h" nogil:
    void* hr_buf_grow(void* old, size_t old_bytes, size_t new_bytes)
    void hr_buf_free(void* p, size_t bytes)
    void hr_slots_out_stream(int64_t* dst, const int32_t* src, size_t n)
    void hr_stream_fence()
    uint64_t hr_narrow(const int64_t* src, int32_t* dst, size_t n)
    uint64_t hr_high64(const int64_t* src, size_t n)
    size_t hr_common64(const int32_t* tree, const int64_t* key, const int32_t* dev, size_t n)
    void hr_slots_in(int32_t* dst, const int64_t* src, size_t n)
    void hr_slots_out(int64_t* dst, const int32_t* src, size_t n)
    void hr_prefetch_key(const int64_t* key, size_t n)
    void HR_PREFETCH(const void* p)

ROOT = 0
IO_NAMES = {IO_IDLE: "idle", IO_WRITING: "writing", IO_LOADING: "loading"}
cdef tuple IO_STATUSES = (IOStatus.IDLE, IOStatus.WRITING, IOStatus.LOADING)   # by IO_* value
cdef int64_t INT32_MIN_ = -2147483648
cdef int64_t INT32_MAX_ = 2147483647
cdef object INT64_MIN_ = -(2 ** 63)
cdef object INT64_MAX_ = 2 ** 63 - 1
cdef int64_t COMPACT_MIN = 1 << 16     # tokens of garbage before compaction is considered
# Releasing and retaking the GIL costs two mutex operations, 4% of a typical match in a
# profile; below this many tokens the work is shorter than that, so the GIL is kept.
cdef int64_t NOGIL_MIN = 4096
cdef enum:
    # Spans of a path _match64 records before touching any: deeper paths (a conversation
    # of more turns than this) take match_into's general path.
    MATCH64_DEPTH = 64
# Indices from which an eviction's result is written with non-temporal stores (1 MiB):
# larger than the caches, so nothing would be read back from them anyway.
cdef int64_t STREAM_MIN = 1 << 17


# Cython allows ``include`` at module level only, so the class's private helpers are
# module-level functions over ``HiRadixTree self`` (called directly, not through the
# class's method table), one file per concern; the class keeps the public API.
include "_core_inputs.pxi"
include "_core_hashing.pxi"
include "_core_records.pxi"
include "_core_arena.pxi"
include "_core_children.pxi"
include "_core_heaps.pxi"
include "_core_nodes.pxi"
include "_core_invariants.pxi"


cdef node_t _backup_target(HiRadixTree self, object node, str op) except -2:
    """The node a backup may begin on (``op`` names the caller in the errors): on the
    device, not backed up, no backup in flight."""
    cdef node_t i = _node(self, node)
    cdef Node* n = &self.nodes[i]
    if n.is_root or not n.on_device:
        raise ValueError(f"{op}: node {node} is not on the device")
    if n.io_status == IO_WRITING:
        raise LockError(f"{op}: node {node} has a backup in flight already")
    if n.backed_up:
        raise ValueError(f"{op}: node {node} is already backed up")
    return i


cdef int _start_writing(HiRadixTree self, node_t i, const index_t* hosts) except -1:
    """Begin a backup of node ``i`` (checked by the caller) to the host slots ``hosts``
    (its length of them): note them, mark it in flight and lock its path."""
    cdef Node* n = &self.nodes[i]
    hr_slots_in(self.host + n.key_off, hosts, n.key_len)
    self._ticket += 1
    n.pending = 1
    n.io_status = IO_WRITING
    n.io_ticket = self._ticket
    n.io_owner = 1
    _lock(self, i, 1)
    return 0


cdef int64_t _stored_from(HiRadixTree self, node_t node, const token_t* ptr, int64_t n) noexcept nogil:
    # Where an insert of ``ptr[:n]`` (page-aligned) below ``node`` starts storing device
    # slots: the length of the path's prefix already on the device, found read-only.
    # _insert writes slots only past it: those of evicted spans it re-materializes (the
    # walk stops at the first) and the new node's.
    cdef int64_t pos = 0, klen, m
    cdef node_t child
    while n - pos >= self.page_size:
        child = _find_child(self, node, ptr + pos)
        if child == NO_NODE or not self.nodes[child].on_device:
            break
        klen = self.nodes[child].key_len
        m = klen if klen < n - pos else n - pos
        m = _common_prefix(self.tokens + self.nodes[child].key_off, ptr + pos, m, self.page_size)
        pos += m
        if m < klen:
            break
        node = child
    return pos


cdef int64_t _check_stored_slots(HiRadixTree self, cnp.ndarray toks, const index_t* vptr, object extra_key,
                                 node_t start) except -1:
    # insert's check of its slots (OverflowError unless they fit the span buffers'
    # int32), before it changes anything, on the slots it will store only: those past
    # the prefix already on the device, whose slots are never read. Checked and narrowed
    # into slots_in in one pass (the value array is cold in a scheduler's insert, read
    # once, as 9cc467d's memcpy read it); returns where they start: slots_in[k] is the
    # slot of token ``start + k``. Checking the whole array (e308d39) read it twice, and
    # the prefix for nothing: 0.64-0.74x of a pre-touched tree's inserts at page 1 and 16
    # (bench/RESULTS_sglang_api.md, issue 47). O(stored + depth).
    cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
    cdef int64_t n = cnp.PyArray_SIZE(toks)
    cdef int64_t pos = 0
    cdef uint64_t high
    cdef node_t root = start
    n -= n % self.page_size
    if root == NO_NODE:
        if extra_key is None:
            root = self.root_idx
        elif isinstance(extra_key, str):  # (else _insert raises its TypeError, after this)
            found = self._namespaces.get(extra_key)
            if found is not None:
                root = <node_t>found
    _reserve_slots_in(self, n)
    if n >= NOGIL_MIN:
        with nogil:
            if root != NO_NODE:
                pos = _stored_from(self, root, ptr, n)
            high = hr_narrow(vptr + pos, self.slots_in, n - pos)
    else:
        if root != NO_NODE:
            pos = _stored_from(self, root, ptr, n)
        high = hr_narrow(vptr + pos, self.slots_in, n - pos)
    if high:
        _check_slots(vptr + pos, n - pos, "value")  # raises, naming the range
    return pos


cdef tuple _insert(HiRadixTree self, cnp.ndarray toks, int64_t stored, object extra_key, int64_t prio,
                   bint chunked, bint hold, int64_t* out, node_t start=NO_NODE):
    # insert's work on narrowed tokens and their device slots, staged in slots_in from
    # token ``stored`` on by _check_stored_slots (its descent stores none before): ``out``
    # gets the prefix length and the last node's handle; returns the nodes to back up.
    # With a ``start`` node (checked by the caller) the tokens continue its path: the
    # descent begins there, and its ancestors are stamped as a descent through them
    # would be.
    cdef const slot_t* sptr = self.slots_in  # sptr[pos - stored]: token pos's slot
    cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
    cdef int64_t n = cnp.PyArray_SIZE(toks)
    n -= n % self.page_size
    cdef node_t root = _ns_root(self, extra_key) if start == NO_NODE else start
    cdef double now = _tick(self)
    cdef node_t node = root, child, parent
    cdef int64_t pos = 0, plen = 0, prefix_len = 0
    cdef Node* c
    with nogil:
        _compact_before_append(self, n)
        while not self.nodes[root].is_root:  # O(depth in nodes), not in tokens
            _touch(self, root, now)
            _refresh(self, root)
            root = self.nodes[root].parent
        while pos < n:
            child = _step(self, node, ptr + pos, n - pos, now, &plen)
            if child == NO_NODE:
                break
            c = &self.nodes[child]
            if prio > c.priority:
                c.priority = prio
            if not c.on_device:
                # re-materialize: the recomputed KV replaces the evicted copy
                memcpy(self.dev + c.key_off, sptr + (pos - stored), plen * sizeof(slot_t))
                _set_device(self, child, 1)
                _size_delta(self, child, plen)
                _refresh(self, c.parent)
                if self._track:
                    _record(self, CHANGE_REFILLED, child, -1, plen)
            else:
                prefix_len += plen
                if not chunked:
                    c.hit_count += 1
            _refresh(self, child)
            node = child
            pos += plen
        if pos < n:
            parent = node
            node = _new_child(self, parent, ptr + pos, n - pos, now)
            c = &self.nodes[node]
            memcpy(self.dev + c.key_off, sptr + (pos - stored), (n - pos) * sizeof(slot_t))
            c.priority = prio
            if not chunked:
                c.hit_count = 1
            _set_device(self, node, 1)
            self._evictable += n - pos
            _refresh(self, node)
            _refresh(self, parent)
            if self._track:
                _record(self, CHANGE_INSERTED, node, -1, n - pos)
    out[0] = prefix_len
    out[1] = _handle(&self.nodes[node], node)
    if self.write_through_threshold <= 0 or chunked:
        return ()
    cdef tuple backup = _report_path(self, root, node)
    if hold and backup:  # kept protected until the caller's backups start
        node = _node(self, backup[len(backup) - 1])  # the deepest covers them all
        self.nodes[node].own_locks += 1
        _lock(self, node, 1)
    return backup


cdef class HiRadixTree:
    """Triple-state radix tree over token ids (compiled core).

    Parameters and semantics: see :class:`hiradix.tree._reference.HiRadixTree`.
    """

    def __cinit__(self, *args, **kwargs):
        self.n_cap = 0
        self.buf_cap = 0
        self.ht_cap = 0
        self.ns_cap = 0
        self.scratch_cap = 0
        self.slots_in_cap = 0
        self.changes_cap = 0
        _grow_nodes(self)
        _grow_table(self)
        _reserve_scratch(self, 64)
        self._namespaces = {}
        self._plans = set()

    def __dealloc__(self):
        # The only place memory is freed; grow helpers only ever grow.
        hr_buf_free(self.nodes, self.n_cap * sizeof(Node))
        free(self.free_stack)
        hr_buf_free(self.heap[0], self.n_cap * sizeof(HeapEntry))
        hr_buf_free(self.heap[1], self.n_cap * sizeof(HeapEntry))
        hr_buf_free(self.tokens, self.buf_cap * sizeof(token_t))
        hr_buf_free(self.dev, self.buf_cap * sizeof(slot_t))
        hr_buf_free(self.host, self.buf_cap * sizeof(slot_t))
        hr_buf_free(self.hashes, self.hash_bytes)
        free(self.ht_keys)
        free(self.ht_vals)
        free(self.seeds)
        free(self.seeded)
        free(self.scratch)
        free(self.slots_in)
        free(self.changes)

    def __init__(self, page_size=1, *, eviction_policy="lru", write_policy="write_through",
                 enable_hash=False, clock=None, chain_seed=None):
        check_tree_args(page_size, clock, chain_seed)
        self.page_size = page_size
        self._chain_seed = chain_seed
        self.policy = get_policy(eviction_policy)
        self.write_through_threshold = write_through_threshold(write_policy)   # validates it
        self.write_policy = write_policy
        self._write_back = write_policy == "write_back"
        self.enable_hash = bool(enable_hash)
        self._clock = clock
        for c in range(2):
            self._key_field[c] = -1
            self._key_sign[c] = 1.0
        for c, (field, sign) in enumerate(self.policy.key):
            self._key_field[c] = FIELDS.index(field)
            self._key_sign[c] = sign
        self._second_chance = self.policy.second_chance
        self._slru_threshold = self.policy.protected_threshold
        self.buf_len = 0
        _reserve_span(self, 1)     # sizes the hash buffer now that page_size is known
        _set_seed(self, 0, None)   # the default root's (it lives as long as the tree)
        self.reset()

    # ------------------------------------------------------------------ operations

    def reset(self):
        """Drop every node but the root (the caller frees all KV first). Handles of the
        dropped nodes go stale; the logical clock restarts, node counters and uids run
        on. ``O(n)``."""
        cdef int64_t k
        self._time = 0
        cdef node_t i
        cdef Node* root
        self.heap_n[0] = 0
        self.heap_n[1] = 0
        if self.n_used == 0:                 # first call, from __init__
            self.root_idx = _new_root(self, 0)
        else:
            for i in range(self.n_used):     # ascending, as the twin frees them
                if self.nodes[i].alive and i != self.root_idx:
                    self.nodes[i].heap_pos[0] = -1
                    self.nodes[i].heap_pos[1] = -1
                    _release(self, i)
        root = &self.nodes[self.root_idx]
        root.first_child = NO_NODE
        root.num_children = 0
        root.num_device_children = 0
        root.host_ref_counter = 0
        root.last_access_time = 0
        for k in range(self.ht_cap):
            self.ht_vals[k] = NO_NODE
        self.ht_count = 0
        self.buf_len = 0
        self.buf_garbage = 0
        self._namespaces = {}
        self._plans.clear()
        self.ns_n = 1
        self._sieve_hand[0] = 0
        self._sieve_hand[1] = 0
        self._evictable = 0
        self._protected = 0
        self._host_size = 0
        self._num_nodes = 0
        self.changes_n = 0       # records of the dropped nodes name stale handles

    def match_prefix(self, key, extra_key=None):
        """Longest cached prefix of ``key``; see the twin. ``O(len(key))``."""
        cdef int64_t out[5]
        cdef MatchResult r = MatchResult.__new__(MatchResult)
        r.device_indices = self.match_into(key, extra_key, out, -1, True)
        r.last_device_node = out[0]
        r.last_host_node = out[1]
        r.host_hit_length = out[2]
        r.last_node = out[3]
        return r

    cdef object match_into(self, object key, object extra_key, int64_t* out, Py_ssize_t limit, bint slots):
        # match_prefix of the first ``limit`` tokens of ``key`` (all when negative), its
        # result's fields in ``out`` (last device node, last host node, host hit length,
        # last node, device prefix length) and the device indices returned, or None
        # without ``slots`` (_core.pxd).
        cdef Py_buffer view
        cdef Py_ssize_t total
        cdef node_t ns_root
        if type(key) is array:
            # SGLang's scheduler keys (array('q')): matched as they are, without narrowing
            # them into a buffer first (_match64), in a namespace that exists already.
            if extra_key is None:
                ns_root = self.root_idx
            else:
                found = self._namespaces.get(extra_key)
                ns_root = NO_NODE if found is None else <node_t>found
            if ns_root != NO_NODE:
                PyObject_GetBuffer(key, &view, PyBUF_FORMAT)
                try:
                    if view.itemsize == 8 and view.format[0] in b"ql" and view.format[1] == 0:
                        total = view.len // 8
                        if 0 <= limit < total:
                            total = limit
                        result = _match64(self, <const int64_t*>view.buf, total, ns_root, out, slots)
                        if result is not None:
                            return result if slots else None
                finally:
                    PyBuffer_Release(&view)
        cdef cnp.ndarray toks = _as_tokens(key, limit)
        cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
        cdef int64_t n = cnp.PyArray_SIZE(toks)
        cdef node_t root = _ns_root(self, extra_key)
        cdef double now = _tick(self)
        cdef node_t node, last_dev, last_host
        cdef int64_t pos = 0, host_hit = 0
        n -= n % self.page_size
        if n >= NOGIL_MIN:
            with nogil:
                node = _descend(self, root, ptr, n, now, &pos)
        else:
            node = _descend(self, root, ptr, n, now, &pos)
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
        return _gather(self, root, last_dev, False) if slots else None

    def insert(self, key, value, extra_key=None, *, priority=0, bint chunked=False, bint hold=False, start=None):
        """Insert ``key`` with device indices ``value``; see the twin. ``O(len(key))``,
        plus ``O(depth)`` nodes with ``start``."""
        cdef node_t s = NO_NODE
        if start is not None:
            s = _node(self, start)
            if not self.nodes[s].is_root and not self.nodes[s].on_device:
                raise ValueError(f"insert: start node {start} is not on the device")
        cdef int64_t prio = _as_int64(priority, "priority")
        cdef cnp.ndarray toks = _as_tokens(key)
        cdef cnp.ndarray vals = _as_int64s(value, "value")
        if cnp.PyArray_SIZE(vals) != cnp.PyArray_SIZE(toks):
            raise ValueError(
                f"value has {cnp.PyArray_SIZE(vals)} indices for {cnp.PyArray_SIZE(toks)} tokens")
        cdef int64_t stored = _check_stored_slots(self, toks, <const index_t*>cnp.PyArray_DATA(vals), extra_key, s)
        cdef int64_t out[2]
        backup = _insert(self, toks, stored, extra_key, prio, chunked, hold, out, s)
        cdef InsertResult r = InsertResult.__new__(InsertResult)
        r.prefix_len = out[0]
        r.last_node = out[1]
        r.backup_nodes = backup
        return r

    cdef tuple insert_into(self, object key, const index_t* values, Py_ssize_t n, object extra_key,
                           int64_t priority, bint chunked, bint hold, int64_t* out):
        # insert of the first ``n`` tokens of ``key`` (a multiple of the page size, at
        # most its length) with the device indices ``values[:n]`` (_core.pxd).
        cdef cnp.ndarray toks = _as_tokens(key, n)
        if cnp.PyArray_SIZE(toks) != n:
            raise ValueError(f"insert_into: {n} tokens asked of a key of {cnp.PyArray_SIZE(toks)}")
        cdef int64_t stored = _check_stored_slots(self, toks, values, extra_key, NO_NODE)
        return _insert(self, toks, stored, extra_key, priority, chunked, hold, out)

    cdef int path_slots_into(self, int64_t handle, int64_t path_len, int64_t start, int64_t stop,
                             int32_t* dst) except -1:
        # (_core.pxd) ValueError if a node of the range is not on the device or the path
        # is shorter than ``start``. O(depth + stop - start).
        cdef node_t i = _node(self, handle)
        cdef int64_t e = path_len, s, lo, hi
        if not 0 <= start <= stop <= path_len:
            raise ValueError(f"path_slots_into: [{start}, {stop}) is not within [0, {path_len}]")
        while e > start:
            if self.nodes[i].key_len == 0:  # a root: the path is shorter than path_len
                raise ValueError(f"path_slots_into: the path to node {handle} is {path_len - e} tokens short")
            s = e - self.nodes[i].key_len
            lo = max(s, start)
            hi = min(e, stop)
            if hi > lo:
                if not self.nodes[i].on_device:
                    raise ValueError(f"path_slots_into: a node on the path to {handle} is not on the device")
                memcpy(dst + (lo - start), self.dev + self.nodes[i].key_off + (lo - s), (hi - lo) * sizeof(slot_t))
            e = s
            i = self.nodes[i].parent
        return 0

    def insert_host(self, node, key, host_value):
        """Attach host-only KV below the backed-up ``node``; see the twin. ``O(len(key))``."""
        cdef node_t mount = _node(self, node)
        if not self.nodes[mount].backed_up:
            raise ValueError(f"insert_host below node {node}, which is not backed up")
        cdef cnp.ndarray toks = _as_tokens(key)
        cdef cnp.ndarray hosts = _as_indices(host_value, "host_value")
        if cnp.PyArray_SIZE(hosts) != cnp.PyArray_SIZE(toks):
            raise ValueError(
                f"host_value has {cnp.PyArray_SIZE(hosts)} indices for {cnp.PyArray_SIZE(toks)} tokens")
        cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
        cdef const index_t* hptr = <const index_t*>cnp.PyArray_DATA(hosts)
        cdef int64_t n = cnp.PyArray_SIZE(toks)
        n -= n % self.page_size
        cdef double now = _tick(self)
        cdef node_t last = mount, child
        cdef int64_t pos = 0, plen = 0
        cdef InsertHostResult r = InsertHostResult.__new__(InsertHostResult)
        with nogil:
            _compact_before_append(self, n)
            _touch(self, mount, now)
            _refresh(self, mount)
            while pos < n:
                child = _step(self, last, ptr + pos, n - pos, now, &plen)
                if child == NO_NODE:
                    break
                _refresh(self, child)
                last = child
                pos += plen
            if pos < n and self.nodes[last].backed_up:
                child = _new_child(self, last, ptr + pos, n - pos, now)
                hr_slots_in(self.host + self.nodes[child].key_off, hptr + pos, n - pos)
                self.nodes[child].backed_up = 1
                self._host_size += n - pos
                _refresh(self, child)
                _refresh(self, last)
                if self._track:
                    _record(self, CHANGE_HOST_INSERTED, child, -1, n - pos)
                r.inserted_length = n - pos
                last = child
        r.matched_length = pos
        r.last_node = _handle(&self.nodes[last], last)
        return r

    def inc_lock_ref(self, node):
        """Take a lock owned by ``node`` (protecting it and its ancestors); returns the
        change of evictable_size. No-op on a root. ``O(depth)``."""
        cdef node_t i = _node(self, node)
        if self.nodes[i].is_root:
            return 0
        self.nodes[i].own_locks += 1
        return _lock(self, i, 1)

    def dec_lock_ref(self, node):
        """Release a lock taken by :meth:`inc_lock_ref` on this same node; ``LockError``
        if it holds none of its own (see the twin). No-op on a root. ``O(depth)``."""
        cdef node_t i = _node(self, node)
        cdef Node* n = &self.nodes[i]
        if n.is_root:
            return 0
        if n.own_locks <= 0:
            raise LockError(
                f"dec_lock_ref on node {node}, which holds no lock of its own "
                f"(lock_ref {n.lock_ref}, io_status {IO_NAMES[n.io_status]})")
        n.own_locks -= 1
        return _lock(self, i, -1)

    def dec_lock_refs(self, nodes):
        """``dec_lock_ref`` of each of ``nodes``, all or nothing; see the twin.
        ``O(sum of depths)``."""
        cdef list idx = []   # each handle's arena index, resolved once
        cdef dict need = {}  # arena index -> times named
        cdef node_t i
        cdef Node* n
        for h in nodes:
            i = _node(self, h)
            if not self.nodes[i].is_root:
                idx.append(i)
                need[i] = need.get(i, 0) + 1
        for j, k in need.items():
            n = &self.nodes[<node_t>j]
            if n.own_locks < k:
                raise LockError(
                    f"dec_lock_refs on node {_handle(n, j)}, named {k} times, which holds {n.own_locks} lock(s) "
                    f"of its own (lock_ref {n.lock_ref}, io_status {IO_NAMES[n.io_status]})")
        cdef int64_t total = 0
        for j in idx:
            i = j
            self.nodes[i].own_locks -= 1
            total += _lock(self, i, -1)
        return total

    def inc_host_ref(self, node):
        """Protect a node's host copy. ``O(log n)``."""
        cdef node_t i = _node(self, node)
        self.nodes[i].host_ref_counter += 1
        _refresh(self, i)

    def dec_host_ref(self, node):
        """Undo one :meth:`inc_host_ref`; ``LockError`` at zero. ``O(log n)``."""
        cdef node_t i = _node(self, node)
        if self.nodes[i].host_ref_counter <= 0:
            raise LockError(f"dec_host_ref on node {node}, whose host_ref_counter is 0")
        self.nodes[i].host_ref_counter -= 1
        _refresh(self, i)

    def evict(self, num_tokens):
        """Free at least ``num_tokens`` device tokens if possible; see the twin.
        ``O(k log n)`` for ``k`` victims."""
        cdef int64_t want = _as_int64(num_tokens, "num_tokens")
        cdef int64_t evicted = 0, k = 0, ln
        cdef node_t v
        cdef bint write_back = self._write_back
        with nogil:
            while evicted < want:
                v = _pop_victim(self, DEVICE_SET)
                if v == NO_NODE:
                    break
                ln = self.nodes[v].key_len
                evicted += ln
                _reserve_scratch(self, k + 1)
                self.scratch[3 * k] = self.nodes[v].key_off
                self.scratch[3 * k + 1] = ln
                self.scratch[3 * k + 2] = v
                if self.nodes[v].backed_up:
                    _demote(self, v)
                    if self._track:
                        _record(self, CHANGE_DEMOTED, v, -1, ln)
                elif write_back:
                    self.scratch[3 * k + 1] = 0     # nothing freed yet: back up first
                else:
                    if self._track:
                        _record(self, CHANGE_DELETED, v, -1, ln)
                    self._evictable -= ln
                    _delete_leaf(self, v)
                k += 1
        write_back_nodes = []
        backup = []
        if write_back:
            seen = set()
            for j in range(k):
                if self.scratch[3 * j + 1] == 0:
                    v = <node_t>self.scratch[3 * j + 2]
                    # Back in the victim set until backed up, as it was (a SIEVE lap
                    # included): nothing in this loop touched it after the pop.
                    _heap_push(self, DEVICE_SET, v)
                    write_back_nodes.append(_handle(&self.nodes[v], v))
                    _backup_chain(self, v, backup, seen)
        cdef EvictResult r = EvictResult.__new__(EvictResult)
        r.num_evicted = evicted
        r.device_indices = _spans(self, k, self.dev, _evict_buffer(self, k))
        r.write_back_nodes = tuple(write_back_nodes)
        r.backup_nodes = tuple(backup)
        return r

    def demote(self, node):
        """Drop the device copy of a backed-up, unlocked device leaf; returns the device
        indices to free. ``O(log n)``."""
        cdef node_t i = _node(self, node)
        cdef Node* n = &self.nodes[i]
        if n.is_root or not n.on_device or not n.backed_up:
            raise ValueError(f"demote: node {node} must be on the device and backed up")
        if n.num_device_children:
            raise ValueError(f"demote: node {node} has device children")
        _check_unpinned(self, i, "demote")
        out = _gather(self, n.parent, i, False)
        _demote(self, i)
        if self._track:
            _record(self, CHANGE_DEMOTED, i, -1, self.nodes[i].key_len)
        return out

    def drop(self, node):
        """Delete an unlocked device leaf that is not backed up; returns its device
        indices to free. ``O(log n)``."""
        cdef node_t i = _node(self, node)
        cdef Node* n = &self.nodes[i]
        if n.is_root or not n.on_device or n.backed_up:
            raise ValueError(f"drop: node {node} must be on the device and not backed up")
        if n.num_children:
            raise ValueError(f"drop: node {node} has children")
        _check_unpinned(self, i, "drop")
        out = _gather(self, n.parent, i, False)
        if self._track:
            _record(self, CHANGE_DELETED, i, -1, n.key_len)
        self._evictable -= n.key_len
        _delete_leaf(self, i)
        return out

    def evict_host(self, num_tokens):
        """Delete at least ``num_tokens`` host-only tokens if possible, deepest first.
        ``O(k log n)`` for ``k`` victims."""
        cdef int64_t want = _as_int64(num_tokens, "num_tokens")
        cdef int64_t evicted = 0, k = 0, ln
        cdef node_t v
        with nogil:
            while evicted < want:
                v = _pop_victim(self, HOST_SET)
                if v == NO_NODE:
                    break
                ln = self.nodes[v].key_len
                evicted += ln
                _reserve_scratch(self, k + 1)
                self.scratch[3 * k] = self.nodes[v].key_off
                self.scratch[3 * k + 1] = ln
                k += 1
                self._host_size -= ln
                if self._track:
                    _record(self, CHANGE_HOST_DELETED, v, -1, ln)
                _delete_leaf(self, v)
        cdef EvictHostResult r = EvictHostResult.__new__(EvictHostResult)
        r.num_evicted = evicted
        r.host_indices = _spans(self, k, self.host)
        return r

    # ------------------------------------------------------------------ tier moves

    def begin_backup(self, node, host_indices):
        """Start copying ``node`` to host slots ``host_indices``; see the twin. Returns the
        device indices to copy. ``O(depth + len)``."""
        cdef node_t i = _backup_target(self, node, "begin_backup")
        cdef cnp.ndarray hosts = _as_indices(host_indices, "host_indices")
        cdef Node* n = &self.nodes[i]
        cdef Node* p = &self.nodes[n.parent]
        if not (p.backed_up or p.io_status == IO_WRITING):
            raise ValueError(f"begin_backup: parent of node {node} is not backed up (continuity)")
        if cnp.PyArray_SIZE(hosts) != n.key_len:
            raise ValueError(
                f"begin_backup: {cnp.PyArray_SIZE(hosts)} host indices for {n.key_len} tokens")
        _start_writing(self, i, <const index_t*>cnp.PyArray_DATA(hosts))
        return _gather(self, self.nodes[i].parent, i, False)

    def backup_order(self, nodes):
        """Of ``nodes``, those a backup can start on now and their ancestors that can too,
        each once, parents first, with their lengths; see the twin.
        ``O(sum of the chosen nodes' depths among them)``."""
        cdef node_t i
        cdef Node* n
        waiting = {}
        for h in nodes:
            try:
                i = _node(self, h)
            except (KeyError, TypeError):
                continue
            while True:
                n = &self.nodes[i]
                if n.is_root or not n.on_device or n.backed_up or n.io_status != IO_IDLE:
                    break
                h = _handle(n, i)
                if h in waiting:
                    break
                waiting[h] = i
                i = n.parent
        ordered = {}
        sizes = []
        cdef list chain
        for first in waiting:
            chain = []
            h = first
            while h in waiting and h not in ordered:
                chain.append(h)
                i = self.nodes[<node_t>waiting[h]].parent
                h = _handle(&self.nodes[i], i)
            for h in reversed(chain):
                ordered[h] = None
                sizes.append(self.nodes[<node_t>waiting[h]].key_len)
        return list(ordered), sizes

    def begin_backups(self, nodes, host_indices):
        """:meth:`begin_backup` of each of ``nodes`` in order, skipping those whose parent
        is by then neither backed up nor being written; see the twin. Returns the started
        nodes' device indices and per node whether it started. ``O(sum of (depth + len))``."""
        cdef cnp.ndarray hosts = _as_indices(host_indices, "host_indices")
        cdef list idx = []
        cdef set seen = set()
        cdef node_t i
        cdef Node* n
        cdef Node* p
        cdef int64_t total = 0, start = 0, filled = 0
        for h in nodes:
            i = _backup_target(self, h, "begin_backups")
            n = &self.nodes[i]
            if i in seen:
                raise ValueError(f"begin_backups: node {h} is named twice")
            seen.add(i)
            idx.append(i)
            total += n.key_len
        if cnp.PyArray_SIZE(hosts) != total:
            raise ValueError(f"begin_backups: {cnp.PyArray_SIZE(hosts)} host indices for {total} tokens")
        cdef cnp.ndarray out = _empty(total, cnp.NPY_INT64)
        cdef const index_t* hptr = <const index_t*>cnp.PyArray_DATA(hosts)
        cdef index_t* dptr = <index_t*>cnp.PyArray_DATA(out)
        started = []
        for i in idx:
            n = &self.nodes[i]
            p = &self.nodes[n.parent]
            if p.backed_up or p.io_status == IO_WRITING:
                hr_slots_out(dptr + filled, self.dev + n.key_off, n.key_len)
                filled += n.key_len
                _start_writing(self, i, hptr + start)
                started.append(True)
            else:
                started.append(False)
            start += self.nodes[i].key_len
        return (out if filled == total else out[:filled].copy()), started

    def commit_backup(self, node, ok=True):
        """Finish :meth:`begin_backup` on this same node; returns whether the node is now
        backed up. ``LockError`` as in the twin. ``O(depth)``."""
        return _commit_backup(self, _node(self, node), bool(ok))

    def commit_backups(self, nodes, ok=True):
        """:meth:`commit_backup` of each of ``nodes`` in order; see the twin.
        ``O(sum of depths)``."""
        cdef bint success = bool(ok)
        return [_commit_backup(self, _node(self, node), success) for node in nodes]

    def evicted_host_indices(self, node):
        """Host indices of the evicted chain that ends at ``node`` (parents first)."""
        cdef node_t i = _node(self, node)
        cdef int64_t n
        return _gather(self, _device_anchor(self, i, &n), i, True)

    def plan_load_back(self, node, min_tokens=0, max_tokens=None):
        """Decide whether to load the evicted chain that ends at ``node`` (``n > 0``
        tokens, ``min_tokens <= n <= max_tokens``) and, if so, hold the plan with a lock
        of its own on ``node``; see the twin. ``O(depth + tokens)``."""
        cdef node_t i = _node(self, node)
        cdef int64_t lo = _as_int64(min_tokens, "min_tokens")
        cdef bint capped = max_tokens is not None
        cdef int64_t hi = _as_int64(max_tokens, "max_tokens") if capped else 0
        cdef int64_t h = _handle(&self.nodes[i], i)
        if h in self._plans:
            raise LockError(
                f"plan_load_back: node {node} holds a load-back plan already "
                "(begin_load_back or cancel_load_back ends it)")
        cdef int64_t n
        cdef node_t a = _device_anchor(self, i, &n)
        cdef LoadBackPlan r = LoadBackPlan.__new__(LoadBackPlan)
        r.anchor = _handle(&self.nodes[a], a)
        if n == 0 or n < lo or (capped and n > hi):
            r.host_indices = _empty(0, cnp.NPY_INT64)
            return r
        self._plans.add(h)
        _lock(self, i, 1)
        r.host_indices = _gather(self, a, i, True)
        return r

    def cancel_load_back(self, node):
        """Release the plan :meth:`plan_load_back` holds for ``node``; ``LockError`` if it
        holds none. ``O(depth)``."""
        cdef node_t i = _node(self, node)
        cdef int64_t h = _handle(&self.nodes[i], i)
        if h not in self._plans:
            raise LockError(f"cancel_load_back: node {node} holds no load-back plan")
        self._plans.remove(h)
        _lock(self, i, -1)

    def begin_load_back(self, node, device_indices):
        """Give the evicted chain ending at ``node`` device slots and lock it while the
        copy is in flight (a plan held for ``node`` ends: its lock becomes the copy's);
        returns the tokens loaded. ``O(depth + tokens)``."""
        cdef node_t i = _node(self, node)
        cdef cnp.ndarray devs = _as_indices(device_indices, "device_indices")
        cdef int64_t total, off = 0
        cdef node_t top = _device_anchor(self, i, &total)
        if top == i:
            raise ValueError(f"begin_load_back: node {node} is not evicted")
        if cnp.PyArray_SIZE(devs) != total:
            raise ValueError(f"begin_load_back: {cnp.PyArray_SIZE(devs)} device indices for {total} tokens")
        self._ticket += 1
        cdef const index_t* src = <const index_t*>cnp.PyArray_DATA(devs)
        cdef node_t m = i
        off = total
        while m != top:       # bottom-up, filling from the end
            off -= self.nodes[m].key_len
            hr_slots_in(self.dev + self.nodes[m].key_off, src + off, self.nodes[m].key_len)
            _set_device(self, m, 1)
            self.nodes[m].io_status = IO_LOADING
            self.nodes[m].io_ticket = self._ticket
            _size_delta(self, m, self.nodes[m].key_len)
            m = self.nodes[m].parent
        m = i
        cdef int64_t start = self.changes_n
        while m != top:
            _refresh(self, m)
            if self._track:
                _record(self, CHANGE_LOADED, m, -1, self.nodes[m].key_len)
            m = self.nodes[m].parent
        _refresh(self, top)
        if self._track:
            _reverse_changes(self, start)
        self.nodes[i].io_owner = 1
        cdef int64_t h = _handle(&self.nodes[i], i)
        if self._plans and h in self._plans:
            self._plans.remove(h)   # the plan's lock is the copy's now
        else:
            _lock(self, i, 1)
        return total

    def finish_load_back(self, node):
        """Mark the load started by :meth:`begin_load_back` on this same node as landed
        and unlock; ``LockError`` as in the twin. ``O(depth)``."""
        cdef node_t i = _node(self, node)
        _io_finish(self, i, _io_group_top(self, i, IO_LOADING, "finish_load_back"), False)
        self.nodes[i].io_owner = 0
        _lock(self, i, -1)

    # ------------------------------------------------------------------ queries

    @property
    def track_changes(self):
        """Whether the tree logs its changes for :meth:`take_changes` (off by default;
        turning it off drops the records not yet taken)."""
        return self._track

    @track_changes.setter
    def track_changes(self, on):
        self._track = bool(on)
        if not self._track:
            self.changes_n = 0

    def take_changes(self):
        """The change records since the last call, oldest first, as an ``(n, 4)`` int64
        array of ``(kind, node, other, tokens)`` rows (kinds: :class:`hiradix.Change`);
        empties the log. ``O(n)``."""
        cdef cnp.ndarray out = np.empty((self.changes_n, 4), dtype=np.int64)
        if self.changes_n:
            memcpy(cnp.PyArray_DATA(out), self.changes, self.changes_n * 4 * sizeof(int64_t))
        self.changes_n = 0
        return out

    @property
    def root(self):
        return _handle(&self.nodes[self.root_idx], self.root_idx)

    def namespace_root(self, extra_key):
        """Handle of the root of a namespace (created on first use)."""
        cdef node_t r = _ns_root(self, extra_key)
        return _handle(&self.nodes[r], r)

    def root_seed(self, node):
        """The hex digest the hash chain under root ``node`` starts from (``None``:
        unseeded); ``ValueError`` for a node that is not a root. ``O(1)``."""
        cdef node_t i = _node(self, node)
        if not self.nodes[i].is_root:
            raise ValueError(f"node {node} is not a root")
        cdef const uint8_t* seed = _seed(self, self.nodes[i].ns)
        return None if seed == NULL else PyBytes_FromStringAndSize(<const char*>seed, DIGEST).hex()

    def evictable_size(self):
        return self._evictable

    def protected_size(self):
        return self._protected

    def host_size(self):
        """Tokens backed up on the host (tombstones and device nodes alike)."""
        return self._host_size

    def device_size(self):
        return self._evictable + self._protected

    def num_nodes(self):
        """Nodes in the tree, roots excluded. ``O(1)``."""
        return self._num_nodes

    def evictable_leaves(self):
        """Device victim set, in eviction order. ``O(n log n)``."""
        return _victims(self, DEVICE_SET)

    def evictable_host_leaves(self):
        """Host victim set, in eviction order. ``O(n log n)``."""
        return _victims(self, HOST_SET)

    def is_alive(self, node):
        try:
            _node(self, node)
        except KeyError:
            return False
        return True

    def parent(self, node):
        """Parent handle, or -1 for a root. ``O(1)``."""
        cdef node_t p = self.nodes[_node(self, node)].parent
        return -1 if p == NO_NODE else _handle(&self.nodes[p], p)

    def children(self, node):
        """Child handles, oldest first (SGLang's dict order; see the twin). ``O(children)``."""
        cdef Node* n = &self.nodes[_node(self, node)]
        cdef Py_ssize_t k = n.num_children
        cdef node_t c = n.first_child
        cdef list kids = PyList_New(k)
        cdef object h
        while c != NO_NODE:     # the sibling list runs newest first: fill from the end
            k -= 1
            h = _handle(&self.nodes[c], c)
            Py_INCREF(h)
            PyList_SET_ITEM(kids, k, h)
            c = self.nodes[c].next_sibling
        return kids

    def num_children(self, node):
        """Number of children. ``O(1)``."""
        return self.nodes[_node(self, node)].num_children

    def key_len(self, node):
        """Tokens in a node's span. ``O(1)``."""
        return self.nodes[_node(self, node)].key_len

    def path_extent(self, node):
        """``(tokens, root)``: the tokens on the path from its root down to the end of
        ``node`` and that root's handle; see the twin. ``O(depth)``, in C."""
        cdef node_t i = _node(self, node)
        cdef int64_t tokens = 0
        while not self.nodes[i].is_root:
            tokens += self.nodes[i].key_len
            i = self.nodes[i].parent
        return tokens, _handle(&self.nodes[i], i)

    # Typed state of one node, each O(1), for adapters that build lazy node views; see
    # the twin for the meaning of each (node_info builds a dict and is for debugging).

    def is_root(self, node):
        """Whether the node is the root or a namespace root. ``O(1)``."""
        return bool(self.nodes[_node(self, node)].is_root)

    def is_evicted(self, node):
        """Whether the node's device copy is gone. ``O(1)``."""
        return not self.nodes[_node(self, node)].on_device

    def is_backed_up(self, node):
        """Whether the node has a committed host copy (a root does). ``O(1)``."""
        return bool(self.nodes[_node(self, node)].backed_up)

    def io_status(self, node):
        """The node's transfer state, an :class:`hiradix.IOStatus`. ``O(1)``."""
        return IO_STATUSES[self.nodes[_node(self, node)].io_status]

    def lock_ref(self, node):
        """Locks protecting the node (its own, its descendants', a transfer's). ``O(1)``."""
        return self.nodes[_node(self, node)].lock_ref

    def host_ref_counter(self, node):
        """Protections of the node's host copy. ``O(1)``."""
        return self.nodes[_node(self, node)].host_ref_counter

    def hit_count(self, node):
        """Non-chunked insert hits. ``O(1)``."""
        return self.nodes[_node(self, node)].hit_count

    def priority(self, node):
        """Highest priority of the inserts through the node. ``O(1)``."""
        return self.nodes[_node(self, node)].priority

    def last_access_time(self, node):
        """Clock at the last match/insert touching the node. ``O(1)``."""
        return self.nodes[_node(self, node)].last_access_time

    def creation_time(self, node):
        """Clock at the node's creation. ``O(1)``."""
        return self.nodes[_node(self, node)].creation_time

    def key(self, node):
        """A copy of the node's token ids (int32). ``O(key_len)``."""
        cdef Node* n = &self.nodes[_node(self, node)]
        out = np.empty(n.key_len, dtype=np.int32)
        if n.key_len:
            memcpy(cnp.PyArray_DATA(out), self.tokens + n.key_off, n.key_len * sizeof(token_t))
        return out

    def value(self, node):
        cdef node_t i = _node(self, node)
        if not self.nodes[i].on_device:
            return None
        if self.nodes[i].is_root:
            return np.empty(0, dtype=np.int64)
        return _gather(self, self.nodes[i].parent, i, False)

    def host_value(self, node):
        cdef node_t i = _node(self, node)
        if self.nodes[i].is_root or not self.nodes[i].backed_up:
            return None
        return _gather(self, self.nodes[i].parent, i, True)

    def enable_hashing(self):
        """Turn page hashes on in a tree built without them (an L3 attached at runtime
        keys its pages by them): hash every page the tree holds, each node's chain
        continuing from its parent's. No-op when they are on. ``O(cached tokens)``."""
        if self.enable_hash:
            return
        cdef int64_t hash_bytes = (self.buf_cap // self.page_size + 1) * DIGEST
        cdef void* p
        if hash_bytes > self.hash_bytes:
            p = hr_buf_grow(self.hashes, self.hash_bytes, hash_bytes)
            if p == NULL:
                raise MemoryError()
            self.hashes = <uint8_t*>p
            self.hash_bytes = hash_bytes
        cdef uint8_t* done = <uint8_t*>calloc(self.n_used + 1, 1)
        cdef node_t* path = <node_t*>malloc((self.n_used + 1) * sizeof(node_t))
        cdef node_t i, j, par
        cdef int64_t k, depth
        cdef const uint8_t* prev
        if done == NULL or path == NULL:
            free(done)
            free(path)
            raise MemoryError()
        with nogil:
            for i in range(self.n_used):
                if not self.nodes[i].alive or self.nodes[i].is_root or done[i]:
                    continue
                # Walk up to the nearest hashed node (or root), then hash back down.
                depth = 0
                j = i
                while not self.nodes[j].is_root and not done[j]:
                    path[depth] = j
                    depth += 1
                    j = self.nodes[j].parent
                for k in range(depth - 1, -1, -1):
                    j = path[k]
                    par = self.nodes[j].parent
                    if self.nodes[par].is_root:
                        prev = _seed(self, self.nodes[par].ns)
                    else:
                        prev = self.hashes + (
                            (self.nodes[par].key_off + self.nodes[par].key_len) // self.page_size - 1) * DIGEST
                    hr_hash_pages(self.tokens + self.nodes[j].key_off, self.nodes[j].key_len // self.page_size,
                                  self.page_size, prev, self.hashes + self.nodes[j].key_off // self.page_size * DIGEST)
                    done[j] = 1
        free(done)
        free(path)
        self.enable_hash = 1

    def hash_value(self, node):
        cdef node_t i = _node(self, node)
        cdef Node* n = &self.nodes[i]
        if not self.enable_hash or n.is_root:
            return None
        cdef int64_t first = n.key_off // self.page_size
        cdef int64_t pages = n.key_len // self.page_size
        raw = PyBytes_FromStringAndSize(<char*>(self.hashes + first * DIGEST), pages * DIGEST)
        return [raw[k * DIGEST:(k + 1) * DIGEST].hex() for k in range(pages)]

    def node_info(self, node):
        """Every field of a node, for debugging and tests."""
        cdef node_t i = _node(self, node)
        cdef Node* n = &self.nodes[i]
        return {
            "handle": _handle(n, i),
            "parent": -1 if n.parent == NO_NODE else _handle(&self.nodes[n.parent], n.parent),
            "key_len": n.key_len,
            "evicted": not n.on_device,
            "backuped": bool(n.backed_up),
            "lock_ref": n.lock_ref,
            "own_lock_ref": n.own_locks,
            "host_ref_counter": n.host_ref_counter,
            "hit_count": n.hit_count,
            "priority": n.priority,
            "last_access_time": n.last_access_time,
            "creation_time": n.creation_time,
            "io_status": IO_NAMES[n.io_status],
            "io_owner": bool(n.io_owner),
            "load_back_planned": _handle(n, i) in self._plans,
            "num_children": n.num_children,
        }

    def debug_counters(self):
        cdef node_t i
        live = sum(1 for i in range(self.n_used) if self.nodes[i].alive)
        return {"nodes_allocated": self.nodes_allocated, "nodes_freed": self.nodes_freed,
                "nodes_live": live}

    def reserve_tokens(self, n_tokens, evict_tokens=0):
        """Size the token and slot buffers for ``n_tokens`` cached tokens and touch their
        memory now, so that inserts up to that size never grow them nor take their
        first-touch page faults (huge pages zeroed by the kernel), at the cost of holding
        20 bytes a token for them from now on. Without it the buffers grow as tokens are
        cached (doubling their mapping, touching only what is written) and take those
        faults once, as they first reach each size. With ``evict_tokens``, evict's device
        indices of up to that many slots go into a reused buffer: a result that fits is
        a view of it whenever no earlier result (or anything made from one) still refers
        to it, else a new array as always. The buffer is made at the first evict and
        doubled up to ``evict_tokens`` as results outgrow it, so it holds about the
        largest eviction's slots and its faults are taken once, not at every evict.
        Capacity hints only: the tree still grows past them.
        ``O(n_tokens)`` once."""
        cdef int64_t n = _as_int64(n_tokens, "n_tokens")
        cdef int64_t e = _as_int64(evict_tokens, "evict_tokens")
        cdef int64_t start
        if n < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n}")
        if e < 0:
            raise ValueError(f"evict_tokens must be >= 0, got {e}")
        if e > self._evict_cap:
            self._evict_cap = e
        if n > self.buf_len:
            _reserve_span(self, n - self.buf_len, True)
        start = self.buf_hwm   # below it, written (touched) already
        if n > start:
            with nogil:
                memset(self.tokens + start, 0, (n - start) * sizeof(token_t))
                memset(self.dev + start, 0, (n - start) * sizeof(slot_t))
                memset(self.host + start, 0, (n - start) * sizeof(slot_t))
            self.buf_hwm = n

    def _test_compact(self):
        """Force a buffer compaction (tests check that nothing moves but offsets)."""
        _compact(self)

    def _test_buffers(self):
        """The span buffers' bookkeeping, in tokens, for tests of their memory: used
        length, garbage in it, high-water mark (written, so touched) and capacity."""
        return {"len": self.buf_len, "garbage": self.buf_garbage, "touched": self.buf_hwm, "capacity": self.buf_cap}

    # ------------------------------------------------------------------ invariants

    def check_invariants(self):
        """Verify every structural invariant against a full recount; raise
        ``AssertionError`` with the offending node's fields on failure. ``O(n log n)``."""
        _check_invariants(self)


cdef object _evict_buffer(HiRadixTree self, int64_t k):
    # The buffer evict's ``k`` spans of the scratch buffer may be written into (None: a
    # new array): reserve_tokens(evict_tokens=)'s, when the result fits its hint and no
    # earlier result still refers to it. Made at the first such evict and replaced by one
    # twice as large (up to the hint) when a result outgrows it, so it holds about the
    # largest eviction's slots, not the hint's, and its first-touch faults are taken once.
    cdef int64_t j, total = 0, size
    for j in range(k):
        total += self.scratch[3 * j + 1]
    if total == 0 or total > self._evict_cap:
        return None
    out = self._evict_out
    if out is not None and total <= (<cnp.ndarray>out).shape[0]:
        # Two references, the tree's and ``out``: no earlier result (a view) is alive.
        return out if Py_REFCNT(out) == 2 else None
    size = 0 if out is None else 2 * (<cnp.ndarray>out).shape[0]
    size = min(max(size, total, 4096), self._evict_cap)
    self._evict_out = _empty(size, cnp.NPY_INT64)
    return self._evict_out


cdef bint _commit_backup(HiRadixTree self, node_t i, bint ok) except -1:
    # commit_backup's body, shared with commit_backups.
    cdef node_t top = _io_group_top(self, i, IO_WRITING, "commit_backup")
    cdef bint success = ok and self.nodes[self.nodes[top].parent].backed_up
    cdef int64_t start = self.changes_n
    cdef node_t m = i
    _io_finish(self, i, top, success)
    if self._track and success:
        while True:
            _record(self, CHANGE_BACKED_UP, m, -1, self.nodes[m].key_len)
            if m == top:
                break
            m = self.nodes[m].parent
        _reverse_changes(self, start)
    self.nodes[i].io_owner = 0
    _lock(self, i, -1)
    return success
