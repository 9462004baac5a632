# cython: language_level=3
"""The compiled HiRadixTree: a triple-state radix tree over token ids.

Same API and semantics as the pure-Python twin :mod:`hiradix.tree._reference`, which
documents every operation in prose; this module is about speed. Nodes are C structs in
an arena (see ``_core.pxd``), token and KV-index spans sit in parallel buffers, children
are found through one hash table, and both victim sets are indexed binary heaps, so a
victim costs ``O(log n)`` and nothing is ever re-heapified. The walks and gathers run
without the GIL.

The tree is not thread-safe: callers serialize operations (HiRadixCache does).

Errors are the twin's, type for type (its module docstring has the table): ``KeyError``
for a handle naming no live node, ``TypeError`` for a non-integer handle, count or dtype,
``OverflowError`` for an integer the tree cannot store, ``ValueError`` for bad values
and states, :class:`hiradix.LockError` for a broken locking or transfer protocol. A
refused call changes nothing.
"""

cimport cython
cimport numpy as cnp
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, qsort, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

import hashlib

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


# ----------------------------------------------------------------------------- inputs
cdef int _reject_dtype(cnp.ndarray arr, str name, object lo, object hi) except -1:
    """Raise for a non-integer dtype as the twin's ``reject_dtype``: ``OverflowError`` for
    an object array of Python ints one of which is outside ``[lo, hi]``, else ``TypeError``."""
    if arr.dtype.kind == "O" and all(type(x) is int for x in arr.flat):
        small, large = min(arr.flat), max(arr.flat)
        if small < lo or large > hi:
            raise OverflowError(f"{name} out of range: min {small}, max {large}")
    raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")


cdef int64_t _as_int64(object x, str name) except? -1:
    """An integer argument: ``TypeError`` for floats and other non-integers (never
    truncated), ``OverflowError`` beyond int64."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(x, &overflow)
    if overflow:
        raise OverflowError(f"{name} = {x} does not fit in int64")
    return v


cdef cnp.ndarray _as_tokens(object key):
    """Token ids as a C-contiguous 1-D int32 array, without per-token Python work."""
    cdef cnp.ndarray arr
    cdef cnp.ndarray out
    cdef const int64_t* src
    cdef int32_t* dst
    cdef Py_ssize_t k, n
    cdef int64_t t
    if type(key) is np.ndarray:
        arr = <cnp.ndarray>key
    else:
        arr = np.asarray(key)     # lists, array('q'), CPU torch tensors (__array__)
    if cnp.PyArray_NDIM(arr) != 1:
        if cnp.PyArray_SIZE(arr) == 0:
            return np.empty(0, dtype=np.int32)
        raise ValueError(f"token ids must be 1-D, got shape {(<object>arr).shape}")
    if cnp.PyArray_TYPE(arr) == cnp.NPY_INT32 and cnp.PyArray_ISNOTSWAPPED(arr):
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = np.ascontiguousarray(arr)
        return arr
    if cnp.PyArray_SIZE(arr) == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        _reject_dtype(arr, "token ids", INT32_MIN_, INT32_MAX_)
    if (cnp.PyArray_TYPE(arr) != cnp.NPY_INT64 or not cnp.PyArray_IS_C_CONTIGUOUS(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > INT32_MAX_:
            raise OverflowError(f"token id out of int32 range: min {int(arr.min())}, max {int(arr.max())}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    n = cnp.PyArray_SIZE(arr)
    out = np.empty(n, dtype=np.int32)
    src = <const int64_t*>cnp.PyArray_DATA(arr)
    dst = <int32_t*>cnp.PyArray_DATA(out)
    cdef bint bad = False
    with nogil:
        for k in range(n):
            t = src[k]
            if t < INT32_MIN_ or t > INT32_MAX_:
                bad = True
                break
            dst[k] = <int32_t>t
    if bad:
        raise OverflowError(f"token id out of int32 range: min {int(arr.min())}, max {int(arr.max())}")
    return out


cdef cnp.ndarray _as_indices(object value, str name):
    """KV indices as a C-contiguous 1-D int64 array."""
    cdef cnp.ndarray arr
    if type(value) is np.ndarray:
        arr = <cnp.ndarray>value
    else:
        arr = np.asarray(value)
    if (cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_TYPE(arr) == cnp.NPY_INT64
            and cnp.PyArray_ISNOTSWAPPED(arr)):
        if cnp.PyArray_IS_C_CONTIGUOUS(arr):
            return arr
        return np.ascontiguousarray(arr)
    if cnp.PyArray_SIZE(arr) == 0:
        return np.empty(0, dtype=np.int64)
    if cnp.PyArray_NDIM(arr) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {(<object>arr).shape}")
    if arr.dtype.kind not in "iu":
        _reject_dtype(arr, name, INT64_MIN_, INT64_MAX_)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > INT64_MAX_:
        raise OverflowError(f"{name} out of int64 range: max {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype=np.int64)


cdef inline cnp.ndarray _empty(int64_t n, int typenum):
    cdef cnp.npy_intp dims = n
    return cnp.PyArray_EMPTY(1, &dims, typenum, 0)


cdef inline int64_t _common_prefix(const token_t* a, const token_t* b, int64_t n,
                                   int64_t page_size) noexcept nogil:
    """Page-aligned length of the common prefix of two token spans of length ``n``."""
    cdef int64_t i = 0
    # memcmp compares 64 tokens at a time with vector instructions; the scalar loop
    # only locates the mismatch inside the last block.
    while i + 64 <= n and memcmp(a + i, b + i, 64 * sizeof(token_t)) == 0:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i - i % page_size


# ----------------------------------------------------------------------------- hashing
def get_hash_str(token_ids, prior_hash=None):
    """SHA-256 of one page chained on ``prior_hash`` (SGLang's ``get_hash_str``).

    >>> get_hash_str([1, 2, 3, 4])
    'cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72'
    """
    cdef cnp.ndarray toks = _as_tokens(token_ids)
    n = cnp.PyArray_SIZE(toks)
    if n == 0:
        h = hashlib.sha256(bytes.fromhex(prior_hash) if prior_hash else b"")
        return h.hexdigest()
    return page_hashes(toks, n, prior_hash)[0]


def page_digests(tokens, Py_ssize_t page_size, prior_hash=None):
    """Chained digests of every full page of ``tokens`` as an ``(n_pages, 32)`` uint8
    array. Runs in C (SHA-NI when the CPU has it) without the GIL. ``O(len(tokens))``."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    cdef cnp.ndarray toks = _as_tokens(tokens)
    cdef size_t pages = <size_t>(cnp.PyArray_SIZE(toks) // page_size)
    cdef bytes prev_bytes = bytes.fromhex(prior_hash) if prior_hash else b""
    if prior_hash and len(prev_bytes) != DIGEST:
        raise ValueError("prior_hash must be 64 hex digits")
    cdef cnp.ndarray out = np.empty((pages, DIGEST), dtype=np.uint8)
    cdef const uint8_t* prev = <const uint8_t*>prev_bytes if prior_hash else NULL
    cdef const int32_t* src = <const int32_t*>cnp.PyArray_DATA(toks)
    cdef uint8_t* dst = <uint8_t*>cnp.PyArray_DATA(out)
    with nogil:
        hr_hash_pages(src, pages, <size_t>page_size, prev, dst)
    return out


def page_hashes(tokens, Py_ssize_t page_size, prior_hash=None):
    """Chained hashes (lowercase hex) of every full page of ``tokens``."""
    digests = page_digests(tokens, page_size, prior_hash)
    return [row.tobytes().hex() for row in digests]


def namespace_seed(str extra_key):
    """Digest that seeds the hash chain of a namespace (hex)."""
    return hashlib.sha256(b"hiradix-namespace\x00" + extra_key.encode()).hexdigest()


def sha256_accelerated():
    """Whether page hashing uses the CPU's SHA extensions."""
    return bool(hr_sha256_accelerated())


def _test_set_portable_sha256(bint on):
    """Force the portable SHA-256 path (tests compare both paths)."""
    hr_sha256_set_portable(on)


# ----------------------------------------------------------------------------- results
# The records are cdef classes with freelists (constructing a dataclass from C costs more
# than a whole match). Freelists only work on base types, so they share these two helpers
# rather than a base class.
cdef _refuse_init(obj):
    raise TypeError(f"{type(obj).__name__} is only made by HiRadixTree")


cdef str _record_repr(obj, tuple fields):
    parts = []
    for name in fields:
        value = getattr(obj, name)
        parts.append(f"{name}=<{len(value)} indices>" if name.endswith("_indices") else f"{name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


@cython.final
@cython.freelist(16)
cdef class MatchResult:
    """See :class:`hiradix.tree._results.MatchResult`."""

    cdef readonly object device_indices
    cdef readonly int64_t last_device_node
    cdef readonly int64_t last_host_node
    cdef readonly int64_t host_hit_length
    cdef readonly int64_t last_node

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(
            self, ("device_indices", "last_device_node", "last_host_node", "host_hit_length", "last_node"))


@cython.final
@cython.freelist(16)
cdef class InsertResult:
    """See :class:`hiradix.tree._results.InsertResult`."""

    cdef readonly int64_t prefix_len
    cdef readonly int64_t last_node
    cdef readonly tuple backup_nodes

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(self, ("prefix_len", "last_node", "backup_nodes"))


@cython.final
@cython.freelist(16)
cdef class InsertHostResult:
    """See :class:`hiradix.tree._results.InsertHostResult`."""

    cdef readonly int64_t matched_length
    cdef readonly int64_t inserted_length
    cdef readonly int64_t last_node

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(self, ("matched_length", "inserted_length", "last_node"))


@cython.final
@cython.freelist(16)
cdef class EvictResult:
    """See :class:`hiradix.tree._results.EvictResult`."""

    cdef readonly int64_t num_evicted
    cdef readonly object device_indices
    cdef readonly tuple write_back_nodes
    cdef readonly tuple backup_nodes

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(self, ("num_evicted", "device_indices", "write_back_nodes", "backup_nodes"))


@cython.final
@cython.freelist(16)
cdef class EvictHostResult:
    """See :class:`hiradix.tree._results.EvictHostResult`."""

    cdef readonly int64_t num_evicted
    cdef readonly object host_indices

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(self, ("num_evicted", "host_indices"))


cdef inline int64_t _handle(Node* n, node_t i) noexcept nogil:
    return <int64_t>i | (<int64_t>n.gen << 32)


cdef inline bint _entry_less(const HeapEntry* a, const HeapEntry* b) noexcept nogil:
    # Total order (k0, k1, uid), identical to EvictionPolicy.sort_key.
    if a.k0 != b.k0:
        return a.k0 < b.k0
    if a.k1 != b.k1:
        return a.k1 < b.k1
    return a.uid < b.uid


cdef int _cmp_first(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0]
    cdef int64_t y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


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
        self.changes_cap = 0
        self._grow_nodes()
        self._grow_table()
        self._reserve_scratch(64)
        self._namespaces = {}

    def __dealloc__(self):
        # The only place memory is freed; grow helpers only ever grow.
        hr_buf_free(self.nodes, self.n_cap * sizeof(Node))
        free(self.free_stack)
        hr_buf_free(self.heap[0], self.n_cap * sizeof(HeapEntry))
        hr_buf_free(self.heap[1], self.n_cap * sizeof(HeapEntry))
        hr_buf_free(self.tokens, self.buf_cap * sizeof(token_t))
        hr_buf_free(self.dev, self.buf_cap * sizeof(index_t))
        hr_buf_free(self.host, self.buf_cap * sizeof(index_t))
        hr_buf_free(self.hashes, self.hash_bytes)
        free(self.ht_keys)
        free(self.ht_vals)
        free(self.seeds)
        free(self.seeded)
        free(self.scratch)
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
        self._reserve_span(1)     # sizes the hash buffer now that page_size is known
        self._set_seed(0, None)   # the default root's (it lives as long as the tree)
        self.reset()

    # ------------------------------------------------------------------ memory
    cdef int _grow_nodes(self) except -1 nogil:
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

    cdef int _reserve_span(self, int64_t n) except -1 nogil:
        cdef int64_t cap = self.buf_cap if self.buf_cap else 4096
        cdef int64_t pages, hash_bytes
        cdef void* p
        if self.buf_len + n <= self.buf_cap and self.hashes != NULL:
            return 0
        while cap < self.buf_len + n:
            cap *= 2
        pages = cap // self.page_size + 1
        p = hr_buf_grow(self.tokens, self.buf_cap * sizeof(token_t), cap * sizeof(token_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.tokens = <token_t*>p
        p = hr_buf_grow(self.dev, self.buf_cap * sizeof(index_t), cap * sizeof(index_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.dev = <index_t*>p
        p = hr_buf_grow(self.host, self.buf_cap * sizeof(index_t), cap * sizeof(index_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.host = <index_t*>p
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

    cdef int _grow_table(self) except -1 nogil:
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
                self._table_put(i)
        return 0

    cdef int _reserve_scratch(self, int64_t triples) except -1 nogil:
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

    cdef int _record(self, int kind, node_t i, int64_t other, int64_t tokens) except -1 nogil:
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

    cdef void _reverse_changes(self, int64_t start) noexcept nogil:
        # Rows recorded walking up a chain, put parents first.
        cdef int64_t a = start, b = self.changes_n - 1, k, t
        while a < b:
            for k in range(4):
                t = self.changes[4 * a + k]
                self.changes[4 * a + k] = self.changes[4 * b + k]
                self.changes[4 * b + k] = t
            a += 1
            b -= 1

    cdef node_t _alloc(self) except -2 nogil:
        cdef node_t i
        cdef int32_t gen
        cdef Node* n
        if self.free_n > 0:
            self.free_n -= 1
            i = self.free_stack[self.free_n]
            gen = self.nodes[i].gen
        else:
            if self.n_used == self.n_cap:
                self._grow_nodes()
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

    cdef void _release(self, node_t i) noexcept nogil:
        cdef Node* n = &self.nodes[i]
        if n.heap_pos[0] >= 0:
            self._heap_remove(DEVICE_SET, i)
        if n.heap_pos[1] >= 0:
            self._heap_remove(HOST_SET, i)
        n.alive = 0
        n.gen = (n.gen + 1) & 0x7FFFFFFF
        self.buf_garbage += n.key_len
        if not n.is_root:
            self._num_nodes -= 1
        self.free_stack[self.free_n] = i
        self.free_n += 1
        self.nodes_freed += 1

    cdef int _compact(self) except -1 nogil:
        # Slide live spans down over deleted ones, in offset order. Runs only when more
        # than half the buffers are garbage, so its O(live) cost is amortized over the
        # deletions that made the garbage.
        cdef int64_t k = 0
        cdef int64_t j, off, ln, pos = 0
        cdef node_t i
        self._reserve_scratch(self.n_used)
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
                memmove(self.dev + pos, self.dev + off, ln * sizeof(index_t))
                memmove(self.host + pos, self.host + off, ln * sizeof(index_t))
                if self.enable_hash:
                    memmove(self.hashes + pos // self.page_size * DIGEST,
                            self.hashes + off // self.page_size * DIGEST,
                            ln // self.page_size * DIGEST)
                self.nodes[i].key_off = pos
            pos += ln
        self.buf_len = pos
        self.buf_garbage = 0
        return 0

    cdef node_t _new_root(self, int32_t ns) except -2 nogil:
        cdef node_t i = self._alloc()
        cdef Node* n = &self.nodes[i]
        n.is_root = 1
        n.on_device = 1
        n.backed_up = 1
        n.lock_ref = 1       # a root is never evicted
        n.ns = ns
        return i

    cdef int _set_seed(self, int32_t ns, object extra_key) except -1:
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

    cdef const uint8_t* _seed(self, int32_t ns) noexcept nogil:
        return self.seeds + ns * DIGEST if self.seeded[ns] else NULL

    cdef node_t _ns_root(self, object extra_key) except -2:
        if extra_key is None:
            return self.root_idx
        root = self._namespaces.get(extra_key)
        if root is not None:
            return <node_t>root
        if not isinstance(extra_key, str):
            raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        self._set_seed(self.ns_n, extra_key)
        cdef node_t r = self._new_root(self.ns_n)
        self.ns_n += 1
        self._namespaces[extra_key] = r
        return r

    cdef node_t _node(self, object handle) except -2:
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

    cdef double _tick(self) except? -1:
        if self._clock is not None:
            return float(self._clock())
        self._time += 1
        return <double>self._time

    # ------------------------------------------------------------------ structure
    cdef void _touch(self, node_t i, double now) noexcept nogil:
        self.nodes[i].last_access_time = now
        self.nodes[i].visited = 1

    cdef void _size_delta(self, node_t i, int64_t tokens) noexcept nogil:
        if self.nodes[i].lock_ref > 0:
            self._protected += tokens
        else:
            self._evictable += tokens

    cdef void _set_device(self, node_t i, bint on) noexcept nogil:
        cdef Node* n = &self.nodes[i]
        if n.on_device == on:
            return
        n.on_device = on
        self.nodes[n.parent].num_device_children += 1 if on else -1

    cdef node_t _split(self, node_t child, int64_t split_len) except -2 nogil:
        # The existing node keeps its handle and becomes the suffix, so handles held for
        # locks and transfers in flight stay valid; the new node takes the prefix. All
        # three states (and the hashes) are cut by moving one offset.
        cdef node_t new = self._alloc()
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
        self._table_replace(child, new)
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
        self._table_put(child)
        self._refresh(new)
        self._refresh(child)
        if self._track:
            self._record(CHANGE_SPLIT, new, _handle(&self.nodes[child], child), split_len)
        return new

    cdef node_t _step(self, node_t node, const token_t* toks, int64_t remaining, double now,
                      int64_t* plen) except -2 nogil:
        # One edge of a descent: find the child for the next page, stamp it, and split
        # it where the match ends inside it. Returns NO_NODE when nothing matches.
        cdef node_t child
        cdef int64_t klen, n
        if remaining < self.page_size:
            return NO_NODE
        child = self._find_child(node, toks)
        if child == NO_NODE:
            return NO_NODE
        self._touch(child, now)
        klen = self.nodes[child].key_len
        n = klen if klen < remaining else remaining
        n = _common_prefix(self.tokens + self.nodes[child].key_off, toks, n, self.page_size)
        if n < klen:
            child = self._split(child, n)
        plen[0] = n
        return child

    cdef node_t _new_child(self, node_t parent, const token_t* toks, int64_t n,
                           double now) except -2 nogil:
        cdef node_t i
        cdef Node* nd
        cdef Node* p
        cdef const uint8_t* prev
        self._reserve_span(n)
        i = self._alloc()
        nd = &self.nodes[i]
        p = &self.nodes[parent]
        nd.key_off = self.buf_len
        nd.key_len = n
        nd.ns = p.ns
        nd.last_access_time = now
        nd.creation_time = now
        self.buf_len += n
        memcpy(self.tokens + nd.key_off, toks, n * sizeof(token_t))
        if self.enable_hash:
            if p.is_root:
                prev = self._seed(p.ns)
            else:
                prev = self.hashes + ((p.key_off + p.key_len) // self.page_size - 1) * DIGEST
            hr_hash_pages(toks, n // self.page_size, self.page_size, prev,
                          self.hashes + nd.key_off // self.page_size * DIGEST)
        self._link_child(parent, i)
        self._table_put(i)
        self._num_nodes += 1
        return i

    cdef void _delete_leaf(self, node_t i) noexcept nogil:
        cdef node_t parent = self.nodes[i].parent
        self._table_del(i)
        self._unlink_child(i)
        self._release(i)
        self._refresh(parent)

    cdef void _demote(self, node_t i) noexcept nogil:
        self._set_device(i, 0)
        self._evictable -= self.nodes[i].key_len
        self._refresh(i)
        self._refresh(self.nodes[i].parent)

    cdef int _backup_chain(self, node_t i, list out, set seen) except -1:
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

    cdef int64_t _lock(self, node_t i, int sign) noexcept nogil:
        cdef int64_t delta = 0
        cdef Node* n = &self.nodes[i]
        while not n.is_root:
            if n.on_device and n.lock_ref == (0 if sign > 0 else 1):
                self._evictable -= sign * n.key_len
                self._protected += sign * n.key_len
                delta -= sign * n.key_len
            n.lock_ref += sign
            self._refresh(i)
            i = n.parent
            n = &self.nodes[i]
        return delta

    cdef object _gather(self, node_t top_exclusive, node_t bottom, bint host):
        # Concatenated spans of the nodes strictly below ``top_exclusive`` down to
        # ``bottom``, filled from the end so no reversal is needed.
        cdef int64_t total = 0
        cdef node_t i = bottom
        cdef index_t* src = self.host if host else self.dev
        while i != top_exclusive:
            total += self.nodes[i].key_len
            i = self.nodes[i].parent
        cdef cnp.ndarray out = _empty(total, cnp.NPY_INT64)
        cdef index_t* dst = <index_t*>cnp.PyArray_DATA(out)
        if total >= NOGIL_MIN:
            with nogil:
                self._fill(top_exclusive, bottom, src, dst, total)
        else:
            self._fill(top_exclusive, bottom, src, dst, total)
        return out

    cdef void _fill(self, node_t top_exclusive, node_t i, const index_t* src, index_t* dst,
                    int64_t total) noexcept nogil:
        while i != top_exclusive:
            total -= self.nodes[i].key_len
            memcpy(dst + total, src + self.nodes[i].key_off, self.nodes[i].key_len * sizeof(index_t))
            i = self.nodes[i].parent

    cdef node_t _descend(self, node_t node, const token_t* ptr, int64_t n, double now,
                         int64_t* pos) except -2 nogil:
        # Follow ``ptr[:n]`` down from ``node``, stamping and splitting as _step does;
        # returns the deepest matched node and sets ``pos`` to the matched length.
        cdef node_t child
        cdef int64_t plen = 0
        pos[0] = 0
        while pos[0] < n:
            child = self._step(node, ptr + pos[0], n - pos[0], now, &plen)
            if child == NO_NODE:
                break
            self._refresh(child)
            node = child
            pos[0] += plen
        return node

    cdef object _spans(self, int64_t k, index_t* buf):
        # Concatenate ``k`` (offset, length) records of the scratch buffer.
        cdef int64_t j, total = 0, pos = 0
        for j in range(k):
            total += self.scratch[3 * j + 1]
        cdef cnp.ndarray out = _empty(total, cnp.NPY_INT64)
        cdef index_t* dst = <index_t*>cnp.PyArray_DATA(out)
        with nogil:
            for j in range(k):
                memcpy(dst + pos, buf + self.scratch[3 * j], self.scratch[3 * j + 1] * sizeof(index_t))
                pos += self.scratch[3 * j + 1]
        return out

    cdef node_t _io_group_top(self, node_t i, int status, str op) except -2:
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

    cdef int _check_unpinned(self, node_t i, str op) except -1:
        cdef Node* n = &self.nodes[i]
        if n.lock_ref or n.io_status != IO_IDLE:
            raise LockError(
                f"{op}: node {_handle(n, i)} is locked (lock_ref {n.lock_ref}, "
                f"io_status {IO_NAMES[n.io_status]}); its slots may still be read")
        return 0

    cdef void _io_finish(self, node_t i, node_t top, bint backed_up) noexcept nogil:
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

    # ------------------------------------------------------------------ child table
    # Children: a global open-addressing table keyed by (parent, first page of the child),
    # plus an intrusive sibling list per node for enumeration.
    #
    # A lookup costs one hash of page_size tokens and, usually, one probe: a system prompt
    # with hundreds of continuations is as cheap to descend as one with a single child.
    # Linear probing with backward-shift deletion keeps the table free of tombstones.

    cdef uint64_t _page_hash(self, node_t parent, const token_t* page) noexcept nogil:
        cdef uint64_t h = (<uint64_t>parent + 1) * <uint64_t>0x9E3779B97F4A7C15
        cdef int64_t k
        for k in range(self.page_size):
            h = (h ^ <uint32_t>page[k]) * <uint64_t>0x100000001B3
        # splitmix64 finaliser: the low bits index the table, so mix the high ones down
        h ^= h >> 30
        h *= <uint64_t>0xBF58476D1CE4E5B9
        h ^= h >> 27
        h *= <uint64_t>0x94D049BB133111EB
        h ^= h >> 31
        return h

    cdef node_t _find_child(self, node_t parent, const token_t* page) noexcept nogil:
        cdef uint64_t h = self._page_hash(parent, page)
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

    cdef int _table_put(self, node_t child) except -1 nogil:
        cdef uint64_t h, mask, slot
        if 2 * (self.ht_count + 1) > self.ht_cap:
            # Growing re-files every linked node, ``child`` included (callers link it
            # to its parent first), so there is nothing left to add.
            return self._grow_table()
        h = self._page_hash(self.nodes[child].parent, self.tokens + self.nodes[child].key_off)
        mask = <uint64_t>(self.ht_cap - 1)
        slot = h & mask
        while self.ht_vals[slot] != NO_NODE:
            slot = (slot + 1) & mask
        self.ht_keys[slot] = h
        self.ht_vals[slot] = child
        self.ht_count += 1
        return 0

    cdef void _table_replace(self, node_t old, node_t new) noexcept nogil:
        # ``new`` takes the entry of ``old``: same parent, same first page (a split).
        cdef uint64_t h = self._page_hash(self.nodes[old].parent, self.tokens + self.nodes[old].key_off)
        cdef uint64_t mask = <uint64_t>(self.ht_cap - 1)
        cdef uint64_t slot = h & mask
        while self.ht_vals[slot] != old:
            slot = (slot + 1) & mask
        self.ht_vals[slot] = new

    cdef void _table_del(self, node_t child) noexcept nogil:
        cdef uint64_t h = self._page_hash(self.nodes[child].parent, self.tokens + self.nodes[child].key_off)
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

    cdef void _link_child(self, node_t parent, node_t child) noexcept nogil:
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

    cdef void _unlink_child(self, node_t child) noexcept nogil:
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

    # ------------------------------------------------------------------ victim heaps
    # Victim heaps: two indexed binary min-heaps (device, host) of arena indices.
    #
    # Each node records its position in both heaps, so membership tests are O(1) and a
    # key change, insertion or removal is one O(log n) sift. Nothing ever re-heapifies all
    # leaves: SGLang's tree rebuilt a heap of every leaf on each evict() call, which cost up
    # to 70 ms per call at 40k leaves.

    cdef double _field(self, node_t i, int f) noexcept nogil:
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

    cdef void _key(self, node_t i, HeapEntry* e) noexcept nogil:
        # The node's current ordering key (k0, k1, uid), as EvictionPolicy.sort_key.
        e.k0 = self._key_sign[0] * self._field(i, self._key_field[0])
        e.k1 = self._key_sign[1] * self._field(i, self._key_field[1]) if self._key_field[1] >= 0 else 0.0
        e.uid = self.nodes[i].uid
        e.node = i

    cdef void _heap_swap(self, int s, node_t p, node_t q) noexcept nogil:
        cdef HeapEntry* h = self.heap[s]
        cdef HeapEntry tmp = h[p]
        h[p] = h[q]
        h[q] = tmp
        self.nodes[h[p].node].heap_pos[s] = p
        self.nodes[h[q].node].heap_pos[s] = q

    cdef void _sift_up(self, int s, node_t pos) noexcept nogil:
        cdef HeapEntry* h = self.heap[s]
        cdef node_t up
        while pos > 0:
            up = (pos - 1) >> 1
            if not _entry_less(&h[pos], &h[up]):
                break
            self._heap_swap(s, pos, up)
            pos = up

    cdef void _sift_down(self, int s, node_t pos) noexcept nogil:
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
            self._heap_swap(s, pos, best)
            pos = best

    cdef void _heap_push(self, int s, node_t i) noexcept nogil:
        # The heap arrays have the arena's capacity, so a push never reallocates.
        cdef node_t pos = self.heap_n[s]
        self._key(i, &self.heap[s][pos])
        self.nodes[i].heap_pos[s] = pos
        self.heap_n[s] += 1
        self._sift_up(s, pos)

    cdef void _heap_remove(self, int s, node_t i) noexcept nogil:
        cdef node_t pos = self.nodes[i].heap_pos[s]
        cdef node_t last = self.heap_n[s] - 1
        if pos != last:
            self._heap_swap(s, pos, last)
        self.heap_n[s] -= 1
        self.nodes[i].heap_pos[s] = -1
        if pos != last:
            self._sift_up(s, pos)
            self._sift_down(s, pos)

    cdef void _set_member(self, int s, node_t i, bint member) noexcept nogil:
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
                self._heap_push(s, i)
            else:
                self._key(i, &e)
                if _entry_less(&e, &self.heap[s][pos]):
                    self.heap[s][pos] = e
                    self._sift_up(s, pos)
        elif pos >= 0:
            self._heap_remove(s, i)

    cdef void _refresh(self, node_t i) noexcept nogil:
        # Recompute a node's membership of both victim sets after any change to it.
        cdef Node* n = &self.nodes[i]
        cdef bint unlocked = not n.is_root and n.lock_ref == 0
        self._set_member(DEVICE_SET, i, unlocked and n.on_device and n.num_device_children == 0)
        n = &self.nodes[i]
        self._set_member(
            HOST_SET, i,
            unlocked and not n.on_device and n.backed_up and n.host_ref_counter == 0
            and n.num_children == 0,
        )

    cdef node_t _pop_victim(self, int s) noexcept nogil:
        # Smallest member of a heap, removed from it. A stale top gets its fresh key and
        # sinks. With SIEVE, a visited node loses its bit and moves to the next lap
        # instead of being evicted; every such step is paid for by an earlier access.
        cdef node_t i
        cdef Node* n
        cdef HeapEntry e
        while self.heap_n[s] > 0:
            i = self.heap[s][0].node
            self._key(i, &e)
            if _entry_less(&self.heap[s][0], &e):
                self.heap[s][0] = e
                self._sift_down(s, 0)
                continue
            n = &self.nodes[i]
            if self._second_chance:
                self._sieve_hand[s] = n.sieve_lap
                if n.visited:
                    n.visited = 0
                    n.sieve_lap += 1
                    continue
            self._heap_remove(s, i)
            return i
        return NO_NODE

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
            self.root_idx = self._new_root(0)
        else:
            for i in range(self.n_used):     # ascending, as the twin frees them
                if self.nodes[i].alive and i != self.root_idx:
                    self.nodes[i].heap_pos[0] = -1
                    self.nodes[i].heap_pos[1] = -1
                    self._release(i)
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
        cdef cnp.ndarray toks = _as_tokens(key)
        cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
        cdef int64_t n = cnp.PyArray_SIZE(toks)
        cdef node_t root = self._ns_root(extra_key)
        cdef double now = self._tick()
        cdef node_t node, last_dev, last_host
        cdef int64_t pos = 0, host_hit = 0
        n -= n % self.page_size
        if n >= NOGIL_MIN:
            with nogil:
                node = self._descend(root, ptr, n, now, &pos)
        else:
            node = self._descend(root, ptr, n, now, &pos)
        last_dev = node
        while not self.nodes[last_dev].on_device:
            host_hit += self.nodes[last_dev].key_len
            last_dev = self.nodes[last_dev].parent
        last_host = last_dev
        while not self.nodes[last_host].backed_up:
            last_host = self.nodes[last_host].parent
        cdef MatchResult r = MatchResult.__new__(MatchResult)
        r.device_indices = self._gather(root, last_dev, False)
        r.last_device_node = _handle(&self.nodes[last_dev], last_dev)
        r.last_host_node = _handle(&self.nodes[last_host], last_host)
        r.host_hit_length = host_hit
        r.last_node = _handle(&self.nodes[node], node)
        return r

    def insert(self, key, value, extra_key=None, *, priority=0, bint chunked=False):
        """Insert ``key`` with device indices ``value``; see the twin. ``O(len(key))``."""
        cdef int64_t prio = _as_int64(priority, "priority")
        cdef cnp.ndarray toks = _as_tokens(key)
        cdef cnp.ndarray vals = _as_indices(value, "value")
        if cnp.PyArray_SIZE(vals) != cnp.PyArray_SIZE(toks):
            raise ValueError(
                f"value has {cnp.PyArray_SIZE(vals)} indices for {cnp.PyArray_SIZE(toks)} tokens")
        cdef const token_t* ptr = <const token_t*>cnp.PyArray_DATA(toks)
        cdef const index_t* vptr = <const index_t*>cnp.PyArray_DATA(vals)
        cdef int64_t n = cnp.PyArray_SIZE(toks)
        n -= n % self.page_size
        cdef node_t root = self._ns_root(extra_key)
        cdef double now = self._tick()
        cdef node_t node = root, child, parent
        cdef int64_t pos = 0, plen = 0, prefix_len = 0
        cdef Node* c
        with nogil:
            if self.buf_garbage > COMPACT_MIN and 2 * self.buf_garbage > self.buf_len:
                self._compact()
            while pos < n:
                child = self._step(node, ptr + pos, n - pos, now, &plen)
                if child == NO_NODE:
                    break
                c = &self.nodes[child]
                if prio > c.priority:
                    c.priority = prio
                if not c.on_device:
                    # re-materialize: the recomputed KV replaces the evicted copy
                    memcpy(self.dev + c.key_off, vptr + pos, plen * sizeof(index_t))
                    self._set_device(child, 1)
                    self._size_delta(child, plen)
                    self._refresh(c.parent)
                    if self._track:
                        self._record(CHANGE_REFILLED, child, -1, plen)
                else:
                    prefix_len += plen
                    if not chunked:
                        c.hit_count += 1
                self._refresh(child)
                node = child
                pos += plen
            if pos < n:
                parent = node
                node = self._new_child(parent, ptr + pos, n - pos, now)
                c = &self.nodes[node]
                memcpy(self.dev + c.key_off, vptr + pos, (n - pos) * sizeof(index_t))
                c.priority = prio
                if not chunked:
                    c.hit_count = 1
                self._set_device(node, 1)
                self._evictable += n - pos
                self._refresh(node)
                self._refresh(parent)
                if self._track:
                    self._record(CHANGE_INSERTED, node, -1, n - pos)
        cdef InsertResult r = InsertResult.__new__(InsertResult)
        r.prefix_len = prefix_len
        r.last_node = _handle(&self.nodes[node], node)
        if self.write_through_threshold > 0 and not chunked:
            r.backup_nodes = self._report_path(root, node)
        else:
            r.backup_nodes = ()
        return r

    cdef tuple _report_path(self, node_t root, node_t last):
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
                self._reserve_scratch(k + 1)
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

    def insert_host(self, node, key, host_value):
        """Attach host-only KV below the backed-up ``node``; see the twin. ``O(len(key))``."""
        cdef node_t mount = self._node(node)
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
        cdef double now = self._tick()
        cdef node_t last = mount, child
        cdef int64_t pos = 0, plen = 0
        cdef InsertHostResult r = InsertHostResult.__new__(InsertHostResult)
        with nogil:
            if self.buf_garbage > COMPACT_MIN and 2 * self.buf_garbage > self.buf_len:
                self._compact()
            self._touch(mount, now)
            self._refresh(mount)
            while pos < n:
                child = self._step(last, ptr + pos, n - pos, now, &plen)
                if child == NO_NODE:
                    break
                self._refresh(child)
                last = child
                pos += plen
            if pos < n and self.nodes[last].backed_up:
                child = self._new_child(last, ptr + pos, n - pos, now)
                memcpy(self.host + self.nodes[child].key_off, hptr + pos, (n - pos) * sizeof(index_t))
                self.nodes[child].backed_up = 1
                self._host_size += n - pos
                self._refresh(child)
                self._refresh(last)
                if self._track:
                    self._record(CHANGE_HOST_INSERTED, child, -1, n - pos)
                r.inserted_length = n - pos
                last = child
        r.matched_length = pos
        r.last_node = _handle(&self.nodes[last], last)
        return r

    def inc_lock_ref(self, node):
        """Take a lock owned by ``node`` (protecting it and its ancestors); returns the
        change of evictable_size. No-op on a root. ``O(depth)``."""
        cdef node_t i = self._node(node)
        if self.nodes[i].is_root:
            return 0
        self.nodes[i].own_locks += 1
        return self._lock(i, 1)

    def dec_lock_ref(self, node):
        """Release a lock taken by :meth:`inc_lock_ref` on this same node; ``LockError``
        if it holds none of its own (see the twin). No-op on a root. ``O(depth)``."""
        cdef node_t i = self._node(node)
        cdef Node* n = &self.nodes[i]
        if n.is_root:
            return 0
        if n.own_locks <= 0:
            raise LockError(
                f"dec_lock_ref on node {node}, which holds no lock of its own "
                f"(lock_ref {n.lock_ref}, io_status {IO_NAMES[n.io_status]})")
        n.own_locks -= 1
        return self._lock(i, -1)

    def inc_host_ref(self, node):
        """Protect a node's host copy. ``O(log n)``."""
        cdef node_t i = self._node(node)
        self.nodes[i].host_ref_counter += 1
        self._refresh(i)

    def dec_host_ref(self, node):
        """Undo one :meth:`inc_host_ref`; ``LockError`` at zero. ``O(log n)``."""
        cdef node_t i = self._node(node)
        if self.nodes[i].host_ref_counter <= 0:
            raise LockError(f"dec_host_ref on node {node}, whose host_ref_counter is 0")
        self.nodes[i].host_ref_counter -= 1
        self._refresh(i)

    def evict(self, num_tokens):
        """Free at least ``num_tokens`` device tokens if possible; see the twin.
        ``O(k log n)`` for ``k`` victims."""
        cdef int64_t want = _as_int64(num_tokens, "num_tokens")
        cdef int64_t evicted = 0, k = 0, ln
        cdef node_t v
        cdef bint write_back = self._write_back
        with nogil:
            while evicted < want:
                v = self._pop_victim(DEVICE_SET)
                if v == NO_NODE:
                    break
                ln = self.nodes[v].key_len
                evicted += ln
                self._reserve_scratch(k + 1)
                self.scratch[3 * k] = self.nodes[v].key_off
                self.scratch[3 * k + 1] = ln
                self.scratch[3 * k + 2] = v
                if self.nodes[v].backed_up:
                    self._demote(v)
                    if self._track:
                        self._record(CHANGE_DEMOTED, v, -1, ln)
                elif write_back:
                    self.scratch[3 * k + 1] = 0     # nothing freed yet: back up first
                else:
                    if self._track:
                        self._record(CHANGE_DELETED, v, -1, ln)
                    self._evictable -= ln
                    self._delete_leaf(v)
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
                    self._heap_push(DEVICE_SET, v)
                    write_back_nodes.append(_handle(&self.nodes[v], v))
                    self._backup_chain(v, backup, seen)
        cdef EvictResult r = EvictResult.__new__(EvictResult)
        r.num_evicted = evicted
        r.device_indices = self._spans(k, self.dev)
        r.write_back_nodes = tuple(write_back_nodes)
        r.backup_nodes = tuple(backup)
        return r

    def demote(self, node):
        """Drop the device copy of a backed-up, unlocked device leaf; returns the device
        indices to free. ``O(log n)``."""
        cdef node_t i = self._node(node)
        cdef Node* n = &self.nodes[i]
        if n.is_root or not n.on_device or not n.backed_up:
            raise ValueError(f"demote: node {node} must be on the device and backed up")
        if n.num_device_children:
            raise ValueError(f"demote: node {node} has device children")
        self._check_unpinned(i, "demote")
        out = self._gather(n.parent, i, False)
        self._demote(i)
        if self._track:
            self._record(CHANGE_DEMOTED, i, -1, self.nodes[i].key_len)
        return out

    def drop(self, node):
        """Delete an unlocked device leaf that is not backed up; returns its device
        indices to free. ``O(log n)``."""
        cdef node_t i = self._node(node)
        cdef Node* n = &self.nodes[i]
        if n.is_root or not n.on_device or n.backed_up:
            raise ValueError(f"drop: node {node} must be on the device and not backed up")
        if n.num_children:
            raise ValueError(f"drop: node {node} has children")
        self._check_unpinned(i, "drop")
        out = self._gather(n.parent, i, False)
        if self._track:
            self._record(CHANGE_DELETED, i, -1, n.key_len)
        self._evictable -= n.key_len
        self._delete_leaf(i)
        return out

    def evict_host(self, num_tokens):
        """Delete at least ``num_tokens`` host-only tokens if possible, deepest first.
        ``O(k log n)`` for ``k`` victims."""
        cdef int64_t want = _as_int64(num_tokens, "num_tokens")
        cdef int64_t evicted = 0, k = 0, ln
        cdef node_t v
        with nogil:
            while evicted < want:
                v = self._pop_victim(HOST_SET)
                if v == NO_NODE:
                    break
                ln = self.nodes[v].key_len
                evicted += ln
                self._reserve_scratch(k + 1)
                self.scratch[3 * k] = self.nodes[v].key_off
                self.scratch[3 * k + 1] = ln
                k += 1
                self._host_size -= ln
                if self._track:
                    self._record(CHANGE_HOST_DELETED, v, -1, ln)
                self._delete_leaf(v)
        cdef EvictHostResult r = EvictHostResult.__new__(EvictHostResult)
        r.num_evicted = evicted
        r.host_indices = self._spans(k, self.host)
        return r

    # ------------------------------------------------------------------ tier moves
    def begin_backup(self, node, host_indices):
        """Start copying ``node`` to host slots ``host_indices``; see the twin. Returns the
        device indices to copy. ``O(depth + len)``."""
        cdef node_t i = self._node(node)
        cdef cnp.ndarray hosts = _as_indices(host_indices, "host_indices")
        cdef Node* n = &self.nodes[i]
        if n.is_root or not n.on_device:
            raise ValueError(f"begin_backup: node {node} is not on the device")
        if n.io_status == IO_WRITING:
            raise LockError(f"begin_backup: node {node} has a backup in flight already")
        if n.backed_up:
            raise ValueError(f"begin_backup: node {node} is already backed up")
        cdef Node* p = &self.nodes[n.parent]
        if not (p.backed_up or p.io_status == IO_WRITING):
            raise ValueError(f"begin_backup: parent of node {node} is not backed up (continuity)")
        if cnp.PyArray_SIZE(hosts) != n.key_len:
            raise ValueError(
                f"begin_backup: {cnp.PyArray_SIZE(hosts)} host indices for {n.key_len} tokens")
        memcpy(self.host + n.key_off, cnp.PyArray_DATA(hosts), n.key_len * sizeof(index_t))
        self._ticket += 1
        n.pending = 1
        n.io_status = IO_WRITING
        n.io_ticket = self._ticket
        n.io_owner = 1
        self._lock(i, 1)
        return self._gather(self.nodes[i].parent, i, False)

    def commit_backup(self, node, ok=True):
        """Finish :meth:`begin_backup` on this same node; returns whether the node is now
        backed up. ``LockError`` as in the twin. ``O(depth)``."""
        cdef node_t i = self._node(node)
        cdef node_t top = self._io_group_top(i, IO_WRITING, "commit_backup")
        cdef bint success = bool(ok) and self.nodes[self.nodes[top].parent].backed_up
        cdef int64_t start = self.changes_n
        cdef node_t m = i
        self._io_finish(i, top, success)
        if self._track and success:
            while True:
                self._record(CHANGE_BACKED_UP, m, -1, self.nodes[m].key_len)
                if m == top:
                    break
                m = self.nodes[m].parent
            self._reverse_changes(start)
        self.nodes[i].io_owner = 0
        self._lock(i, -1)
        return success

    def evicted_host_indices(self, node):
        """Host indices of the evicted chain that ends at ``node`` (parents first)."""
        cdef node_t i = self._node(node)
        cdef node_t top = i
        while not self.nodes[top].on_device:
            top = self.nodes[top].parent
        return self._gather(top, i, True)

    def begin_load_back(self, node, device_indices):
        """Give the evicted chain ending at ``node`` device slots and lock it while the
        copy is in flight; returns the tokens loaded. ``O(depth + tokens)``."""
        cdef node_t i = self._node(node)
        cdef cnp.ndarray devs = _as_indices(device_indices, "device_indices")
        cdef node_t top = i
        cdef int64_t total = 0, off = 0
        while not self.nodes[top].on_device:
            total += self.nodes[top].key_len
            top = self.nodes[top].parent
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
            memcpy(self.dev + self.nodes[m].key_off, src + off, self.nodes[m].key_len * sizeof(index_t))
            self._set_device(m, 1)
            self.nodes[m].io_status = IO_LOADING
            self.nodes[m].io_ticket = self._ticket
            self._size_delta(m, self.nodes[m].key_len)
            m = self.nodes[m].parent
        m = i
        cdef int64_t start = self.changes_n
        while m != top:
            self._refresh(m)
            if self._track:
                self._record(CHANGE_LOADED, m, -1, self.nodes[m].key_len)
            m = self.nodes[m].parent
        self._refresh(top)
        if self._track:
            self._reverse_changes(start)
        self.nodes[i].io_owner = 1
        self._lock(i, 1)
        return total

    def finish_load_back(self, node):
        """Mark the load started by :meth:`begin_load_back` on this same node as landed
        and unlock; ``LockError`` as in the twin. ``O(depth)``."""
        cdef node_t i = self._node(node)
        self._io_finish(i, self._io_group_top(i, IO_LOADING, "finish_load_back"), False)
        self.nodes[i].io_owner = 0
        self._lock(i, -1)

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
        cdef node_t r = self._ns_root(extra_key)
        return _handle(&self.nodes[r], r)

    def root_seed(self, node):
        """The hex digest the hash chain under root ``node`` starts from (``None``:
        unseeded); ``ValueError`` for a node that is not a root. ``O(1)``."""
        cdef node_t i = self._node(node)
        if not self.nodes[i].is_root:
            raise ValueError(f"node {node} is not a root")
        cdef const uint8_t* seed = self._seed(self.nodes[i].ns)
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

    cdef list _victims(self, int s):
        cdef node_t k, i
        entries = []
        for k in range(self.heap_n[s]):
            i = self.heap[s][k].node
            entries.append((self._sort_key(i), _handle(&self.nodes[i], i)))
        entries.sort()
        return [h for _, h in entries]

    cdef tuple _sort_key(self, node_t i):
        cdef HeapEntry e
        self._key(i, &e)
        return (e.k0, e.k1, e.uid)

    def evictable_leaves(self):
        """Device victim set, in eviction order. ``O(n log n)``."""
        return self._victims(DEVICE_SET)

    def evictable_host_leaves(self):
        """Host victim set, in eviction order. ``O(n log n)``."""
        return self._victims(HOST_SET)

    def is_alive(self, node):
        try:
            self._node(node)
        except KeyError:
            return False
        return True

    def parent(self, node):
        """Parent handle, or -1 for a root. ``O(1)``."""
        cdef node_t p = self.nodes[self._node(node)].parent
        return -1 if p == NO_NODE else _handle(&self.nodes[p], p)

    def children(self, node):
        """Child handles, oldest first (SGLang's dict order; see the twin). ``O(children)``."""
        cdef Node* n = &self.nodes[self._node(node)]
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
        return self.nodes[self._node(node)].num_children

    def key_len(self, node):
        """Tokens in a node's span. ``O(1)``."""
        return self.nodes[self._node(node)].key_len

    # Typed state of one node, each O(1), for adapters that build lazy node views; see
    # the twin for the meaning of each (node_info builds a dict and is for debugging).
    def is_root(self, node):
        """Whether the node is the root or a namespace root. ``O(1)``."""
        return bool(self.nodes[self._node(node)].is_root)

    def is_evicted(self, node):
        """Whether the node's device copy is gone. ``O(1)``."""
        return not self.nodes[self._node(node)].on_device

    def is_backed_up(self, node):
        """Whether the node has a committed host copy (a root does). ``O(1)``."""
        return bool(self.nodes[self._node(node)].backed_up)

    def io_status(self, node):
        """The node's transfer state, an :class:`hiradix.IOStatus`. ``O(1)``."""
        return IO_STATUSES[self.nodes[self._node(node)].io_status]

    def lock_ref(self, node):
        """Locks protecting the node (its own, its descendants', a transfer's). ``O(1)``."""
        return self.nodes[self._node(node)].lock_ref

    def host_ref_counter(self, node):
        """Protections of the node's host copy. ``O(1)``."""
        return self.nodes[self._node(node)].host_ref_counter

    def hit_count(self, node):
        """Non-chunked insert hits. ``O(1)``."""
        return self.nodes[self._node(node)].hit_count

    def priority(self, node):
        """Highest priority of the inserts through the node. ``O(1)``."""
        return self.nodes[self._node(node)].priority

    def last_access_time(self, node):
        """Clock at the last match/insert touching the node. ``O(1)``."""
        return self.nodes[self._node(node)].last_access_time

    def creation_time(self, node):
        """Clock at the node's creation. ``O(1)``."""
        return self.nodes[self._node(node)].creation_time

    def key(self, node):
        """A copy of the node's token ids (int32). ``O(key_len)``."""
        cdef Node* n = &self.nodes[self._node(node)]
        out = np.empty(n.key_len, dtype=np.int32)
        if n.key_len:
            memcpy(cnp.PyArray_DATA(out), self.tokens + n.key_off, n.key_len * sizeof(token_t))
        return out

    def value(self, node):
        cdef node_t i = self._node(node)
        if not self.nodes[i].on_device:
            return None
        if self.nodes[i].is_root:
            return np.empty(0, dtype=np.int64)
        return self._gather(self.nodes[i].parent, i, False)

    def host_value(self, node):
        cdef node_t i = self._node(node)
        if self.nodes[i].is_root or not self.nodes[i].backed_up:
            return None
        return self._gather(self.nodes[i].parent, i, True)

    def hash_value(self, node):
        cdef node_t i = self._node(node)
        cdef Node* n = &self.nodes[i]
        if not self.enable_hash or n.is_root:
            return None
        cdef int64_t first = n.key_off // self.page_size
        cdef int64_t pages = n.key_len // self.page_size
        raw = PyBytes_FromStringAndSize(<char*>(self.hashes + first * DIGEST), pages * DIGEST)
        return [raw[k * DIGEST:(k + 1) * DIGEST].hex() for k in range(pages)]

    def node_info(self, node):
        """Every field of a node, for debugging and tests."""
        cdef node_t i = self._node(node)
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
            "num_children": n.num_children,
        }

    def debug_counters(self):
        cdef node_t i
        live = sum(1 for i in range(self.n_used) if self.nodes[i].alive)
        return {"nodes_allocated": self.nodes_allocated, "nodes_freed": self.nodes_freed,
                "nodes_live": live}

    def _test_compact(self):
        """Force a buffer compaction (tests check that nothing moves but offsets)."""
        self._compact()

    # ------------------------------------------------------------------ invariants
    def check_invariants(self):
        """Verify every structural invariant against a full recount; raise
        ``AssertionError`` with the offending node's fields on failure. ``O(n log n)``."""
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
            owner_below = False
            c = n.first_child
            while c != NO_NODE:
                if self.nodes[c].parent != i:
                    fail("child's parent link is wrong", c)
                if self._find_child(i, self.tokens + self.nodes[c].key_off) != c:
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
                    self._key(i, &fresh)
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
                    prev = self._seed(self.nodes[p].ns)
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
