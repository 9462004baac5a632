# cython: language_level=3
"""``insert`` of :mod:`hiradix.sglang`, compiled for the scheduler's common call.

Every finished request (and every chunk of a chunked prefill) goes through the cache's
``insert``. Around the tree's 3.8 us insert of a 1,343-token key, the Python layers took
3.4 us: reading the params and the key, turning the slots' tensor into a numpy array
(0.7 us), the core cache's method and SGLang's ``InsertResult`` (``bench/sglang_api.py``,
page 1). :class:`Inserter` does that work in C for a call with nothing special about it
(the tokens an ``array('q')`` or a list, no namespace, no bigrams, the slots a CPU int64
or int32 tensor, no KV events to record) and calls the tree's ``insert_into`` directly,
reading the slots in place; any other call goes to the Python method it stands in front
of. Both leave the cache in the same state and return the same ``InsertResult``
(``tests/sglang/test_insert_compiled.py``).

SGLang 0.5.23's ``checkpoint`` (every chunk and every finish of a request) goes through
:meth:`Inserter.checkpoint` where it can: the insert, the match's walk and the rewrite of
the request's row in one call, without the key, params and result objects, the walk's
slot gather or torch's indexing of the row (a 1,343-token page-1 checkpoint 61 -> 37 us
in ``bench/sglang_api.py``'s loop; ``tests/sglang/v23/test_checkpoint_compiled.py``
drives both paths in lockstep).

Its twin is :meth:`hiradix.sglang.cache.HiRadixCacheBase.insert` itself (and the Python
half of ``api_v23.HiRadixCache.checkpoint``): with ``HIRADIX_PUREPYTHON=1`` or no compiler,
no inserter is made and the methods serve.
"""

cimport numpy as cnp
from cpython.array cimport array
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

from hiradix.tree._core cimport HiRadixTree, index_t

cnp.import_array()


def applies_to(tree):
    """Whether a cache on ``tree`` can take an :class:`Inserter`: the compiled tree only
    (the twin serves under ``HIRADIX_PUREPYTHON``, where no inserter is built either)."""
    return isinstance(tree, HiRadixTree)


cdef class Inserter:
    """``cache.insert`` for the scheduler's calls: ``Inserter(cache, general, result,
    tensor, int64, int32)(params)`` does and returns what ``general(cache, params)``
    would.

    - ``general``: the Python ``insert``, for every other call (and a disabled cache);
    - ``result``: SGLang's ``InsertResult``, made as ``result(prefix_len, total_len)``;
    - ``tensor``, ``int64``, ``int32``: ``torch.Tensor`` and the two slot dtypes read in
      place (int32 slots, as SGLang's ``req_to_token`` rows hold them, are widened into a
      buffer the inserter keeps), so this module does not import torch.

    The nodes the insert asks to back up go to the core cache's ``backups_asked``, as
    its own ``insert`` hands them on.
    """

    cdef HiRadixTree tree
    cdef object cache, core, general, result, tensor, int64, int32
    cdef int64_t* wide
    cdef Py_ssize_t wide_cap

    def __init__(self, cache, general, result, tensor, int64, int32):
        self.cache = cache
        self.core = cache.core
        self.tree = cache.tree  # the cache's one tree for its life (reset empties it in place)
        self.general = general
        self.result = result
        self.tensor = tensor
        self.int64 = int64
        self.int32 = int32

    def __dealloc__(self):
        free(self.wide)

    def __call__(self, params):
        cache = self.cache
        key = params.key
        ids = key.token_ids
        limit = key.limit
        value = params.value
        if ((type(ids) is not array or (<array>ids).ob_descr.typecode != b"q") and type(ids) is not list
                or key.is_bigram or key.extra_key is not None or key.cache_salt is not None
                or (limit is not None and (type(limit) is not int or limit < 0))
                or type(value) is not self.tensor or cache.disable or cache._events is not None):
            return self.general(cache, params)
        cdef Py_ssize_t n = len(ids)
        if limit is not None and <Py_ssize_t>limit < n:
            n = limit
        n -= n % self.tree.page_size
        dtype = value.dtype
        if (n == 0 or (dtype is not self.int64 and dtype is not self.int32) or not value.is_cpu
                or value.dim() != 1 or not value.is_contiguous() or value.numel() < n):
            return self.general(cache, params)  # (a short value: the method's error)
        priority = params.priority
        chunked = getattr(params, "chunked", False)  # 0.5.18's; 0.5.23 has no such flag
        if (priority is not None and type(priority) is not int) or (chunked is not False and chunked is not True):
            return self.general(cache, params)
        cdef int64_t prio
        try:
            prio = 0 if priority is None else priority
        except OverflowError:
            return self.general(cache, params)  # the method's error
        cdef const index_t* slots = <const index_t*><uintptr_t>value.data_ptr()
        if dtype is self.int32:
            slots = self._widen(<const int32_t*>slots, n)
        core = self.core
        cdef int64_t out[2]  # prefix length, last node
        backup = self.tree.insert_into(ids, slots, n, None, prio, chunked, core.batch_backups, out)
        if backup:
            core.backups_asked(backup)
        return self.result(out[0], n)

    def checkpoint(self, ids, row, Py_ssize_t n, int64_t protected, int64_t priority):
        """The tree's part of SGLang 0.5.23's ``checkpoint`` for a plain request
        (``HiRadixCache._compiled_checkpoint`` checks the request and the cache, as
        :meth:`__call__` checks its params): insert the first ``n`` tokens of ``ids`` with
        the row's slots ``row[:n]``, walk the key again as a match does (its effect on the
        eviction order and hit counts), and point ``row[protected:end]`` at the tree's
        slots, ``end`` being the prefix the tree held before. Returns ``(end, the last
        node's handle, duplicates)``: the row's slots ``[protected, end)`` as they were (a
        new int32 array, for the caller to free), or ``None``. Returns ``None`` without
        doing anything where the row is not a contiguous 1-D CPU int32 tensor of at least
        ``n`` slots, or ``protected`` is not within ``[0, n]``: the Python path serves
        those. ``O(n)``."""
        if (type(row) is not self.tensor or row.dtype is not self.int32 or not row.is_cpu or row.dim() != 1
                or not row.is_contiguous() or row.numel() < n or not 0 <= protected <= n):
            return None
        cdef int32_t* r = <int32_t*><uintptr_t>row.data_ptr()
        cdef const index_t* slots = self._widen(r, n)
        cdef int64_t out[2]  # prefix length, last node
        cdef int64_t walk[5]
        core = self.core
        backup = self.tree.insert_into(ids, slots, n, None, priority, False, core.batch_backups, out)
        if backup:
            core.backups_asked(backup)
        self.tree.match_into(ids, None, walk, n, False)  # walk[4]: the device prefix's length
        if walk[4] != n or walk[0] != out[1]:
            raise RuntimeError(f"checkpoint: {walk[4]} of {n} tokens cached after the insert")
        cdef int64_t end = out[0]
        if end <= protected:
            return end, out[1], None
        cdef cnp.npy_intp k = end - protected
        cdef cnp.ndarray dup = cnp.PyArray_EMPTY(1, &k, cnp.NPY_INT32, 0)
        memcpy(cnp.PyArray_DATA(dup), r + protected, k * sizeof(int32_t))
        self.tree.path_slots_into(out[1], n, protected, end, r + protected)
        return end, out[1], dup

    cdef const index_t* _widen(self, const int32_t* src, Py_ssize_t n) except NULL:
        cdef Py_ssize_t i
        cdef int64_t* buf
        if n > self.wide_cap:
            buf = <int64_t*>realloc(self.wide, n * sizeof(int64_t))
            if buf == NULL:
                raise MemoryError()
            self.wide = buf
            self.wide_cap = n
        for i in range(n):
            self.wide[i] = src[i]
        return self.wide
