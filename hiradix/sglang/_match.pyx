# cython: language_level=3
"""``match_prefix`` of :mod:`hiradix.sglang`, compiled for the scheduler's common key.

SGLang's scheduler matches every waiting request's prompt on every step, and the Python
layers around the tree's match were 40% of its cost: reading the params, two node views,
the slots' tensor and the result tuple took 1.9 us around a 2.7 us tree match of a
1,343-token key (``bench/sglang_api.py``, page 1). :class:`Matcher` does that work in C
for a key with nothing special about it (an ``array('q')`` of tokens, no namespace, no
bigrams; a ``limit``, which the scheduler always sets, the tree honours) and calls the
tree's ``match_into`` directly, without its result object; any other key goes to the
Python method it stands in front of. Both give the same ``MatchResult`` for every key
(``tests/sglang/test_match_compiled.py``).

Its twin is :meth:`hiradix.sglang.cache.HiRadixCacheBase.match_prefix` itself: with
``HIRADIX_PUREPYTHON=1`` or no compiler, no matcher is installed and the method serves.
"""

from cpython.array cimport array
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM
from libc.stdint cimport int64_t

from hiradix.tree._core cimport HiRadixTree

cdef extern from "Python.h":
    ctypedef struct TypeObject "PyTypeObject":
        PyObject* (*tp_alloc)(TypeObject*, Py_ssize_t)


def applies_to(tree):
    """Whether a cache on ``tree`` can take a :class:`Matcher`: the compiled tree only
    (the twin serves under ``HIRADIX_PUREPYTHON``, where no matcher is built either)."""
    return isinstance(tree, HiRadixTree)


cdef inline void _put(object tup, Py_ssize_t i, object item):
    Py_INCREF(item)  # PyTuple_SET_ITEM takes the reference over
    PyTuple_SET_ITEM(tup, i, item)


cdef class Matcher:
    """``cache.match_prefix`` for plain keys, a ``limit`` or not: ``Matcher(cache,
    general, node, wrap, result, tail)(params)`` returns what ``general(cache, params)``
    would.

    - ``general``: the Python ``match_prefix``, for every other key (and a disabled cache);
    - ``node``: the node view type, :class:`hiradix.sglang.nodes.TreeNode`, whose two
      fields (``_cache``, ``id``) a view is made of here without its ``__init__``;
    - ``wrap(device_indices)``: the result's first field from the matched slots (a CPU
      tensor of them, or their number on SGLang 0.5.23);
    - ``result`` / ``tail``: SGLang's ``MatchResult`` (a ``NamedTuple``) and the defaults
      of its fields after the first five. A result is allocated at its full length and
      filled, as ``tuple.__new__(result, items)`` does, without the temporary tuples.
    """

    cdef HiRadixTree tree
    cdef object cache, general, node, wrap, result
    cdef tuple tail

    def __init__(self, cache, general, node, wrap, result, tuple tail):
        if not issubclass(result, tuple):
            raise TypeError(f"Matcher: the result type must be a tuple (a NamedTuple), got {result!r}")
        self.cache = cache
        self.tree = cache.tree  # the cache's one tree for its life (reset empties it in place)
        self.general = general
        self.node = node
        self.wrap = wrap
        self.result = result
        self.tail = tail

    def __call__(self, params):
        cache = self.cache
        key = params.key
        ids = key.token_ids
        limit = key.limit  # the scheduler's: the prompt's length less one
        if (type(ids) is not array or (<array>ids).ob_descr.typecode != b"q" or key.is_bigram
                or key.extra_key is not None or key.cache_salt is not None
                or (limit is not None and (type(limit) is not int or limit < 0)) or cache.disable):
            return self.general(cache, params)
        cdef Py_ssize_t n = len(ids)
        cdef Py_ssize_t cap = -1 if limit is None else limit
        if 0 <= cap < n:
            n = cap
        if n < self.tree.page_size:
            return self.general(cache, params)
        # The tree matches whole pages only, and reads no token past the limit.
        cdef int64_t out[4]  # last device node, last host node, host hit length, last node
        indices = self.tree.match_into(ids, None, out, cap)
        # The deepest backed-up matched node, as the Python method picks it: the end of an
        # evicted tail, else the tree's anchor at or above the device part.
        cdef int64_t host = out[3] if out[2] else out[1]
        node = self._view(out[0])
        anchor = node if host == out[0] else self._view(host)
        return self._result(self.wrap(indices), node, anchor, out[2])

    cdef object _view(self, int64_t handle):
        view = object.__new__(self.node)
        view._cache = self.cache
        view.id = handle
        return view

    cdef object _result(self, object first, object node, object anchor, int64_t hit):
        # (device slots or their number, last_device_node, last_host_node, best_match_node,
        # host_hit_length) + the defaults: SGLang's field order.
        cdef tuple tail = self.tail
        cdef Py_ssize_t i, n = len(tail)
        cdef TypeObject* t = <TypeObject*>self.result
        cdef PyObject* p = t.tp_alloc(t, 5 + n)
        if p == NULL:
            raise MemoryError()
        res = <object>p
        Py_DECREF(res)  # the cast took a reference of its own
        _put(res, 0, first)
        _put(res, 1, node)
        _put(res, 2, anchor)
        _put(res, 3, anchor)
        _put(res, 4, hit)
        for i in range(n):
            _put(res, 5 + i, tail[i])
        return res
