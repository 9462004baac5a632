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
``HIRADIX_PUREPYTHON=1`` or no compiler, no matcher is made and the method serves.

:class:`CompiledMethod` is how a cache's calls reach its matcher (and its inserter,
:mod:`hiradix.sglang._insert`): the class attribute in place of the Python method, which
hands an instance's compiled callable straight to the caller, with no Python frame between.
"""

from cpython.array cimport array
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM
from libc.stdint cimport int64_t

from types import MemberDescriptorType

from hiradix.tree._core cimport HiRadixTree

cdef extern from "Python.h":
    ctypedef struct TypeObject "PyTypeObject":
        PyObject* (*tp_alloc)(TypeObject*, Py_ssize_t)

cdef extern from "Python.h":
    object PyObject_GenericGetDict(object obj, void* context)
    PyObject* PyDict_GetItem(object d, object key)  # borrowed; NULL when missing
    object PyMethod_New(object func, object obj)

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    int T_OBJECT_EX

# The fields of SGLang's RadixKey the matcher reads, in the order of Matcher.key_slots.
cdef tuple KEY_FIELDS = ("token_ids", "limit", "is_bigram", "extra_key", "cache_salt")
cdef enum:
    N_KEY_FIELDS = 5


def applies_to(tree):
    """Whether a cache on ``tree`` can take a :class:`Matcher`: the compiled tree only
    (the twin serves under ``HIRADIX_PUREPYTHON``, where no matcher is built either)."""
    return isinstance(tree, HiRadixTree)


cdef inline void _put(object tup, Py_ssize_t i, object item):
    Py_INCREF(item)  # PyTuple_SET_ITEM takes the reference over
    PyTuple_SET_ITEM(tup, i, item)


cdef Py_ssize_t _slot(type cls, str name):
    """The offset in ``cls``'s instances of its ``__slots__`` field ``name`` (an object
    field, unset until assigned), or -1 when ``cls.name`` is anything else (a property,
    a class attribute, a field of a ``__dict__``)."""
    descr = getattr(cls, name, None)
    if type(descr) is not MemberDescriptorType:
        return -1
    cdef PyMemberDef* member = (<PyMemberDescrObject*><PyObject*>descr).d_member
    return member.offset if member.type == T_OBJECT_EX else -1


cdef inline PyObject* _field(object obj, Py_ssize_t offset):
    # A __slots__ field read where the member descriptor would read it (NULL: unset).
    return (<PyObject**>(<char*><PyObject*>obj + offset))[0]


cdef inline void _set_field(PyObject* obj, Py_ssize_t offset, object value):
    # A __slots__ field of a new instance (NULL before) set as its descriptor would.
    Py_INCREF(value)
    (<PyObject**>(<char*>obj + offset))[0] = <PyObject*>value


cdef class CompiledMethod:
    """A method an instance may serve with a compiled callable of its own:
    ``name = CompiledMethod(function, attr)`` in a class body, for ``def name`` itself.
    Read on an instance whose field ``attr`` holds a callable (not ``None``), the method
    is that callable, so a call such as ``cache.match_prefix(params)`` goes straight to C;
    on any other instance it is ``function`` bound to it, and on the class ``function``
    itself (the Python method, the compiled one's twin). A subclass's own method of the
    same name shadows it, as any method's. ``O(1)`` a lookup: where ``attr`` is a
    ``__slots__`` field of the instance's type (learnt from the first instance, again
    whenever the type changes) one pointer read, as Python's lookup of an instance
    attribute would make it; else a read of the instance's ``__dict__``."""

    cdef readonly object __func__
    cdef readonly str attr
    cdef type owner  # the type whose instances the offset is for
    cdef Py_ssize_t offset  # attr's slot in them (-1: read from the __dict__)

    def __init__(self, function, str attr):
        if not callable(function):
            raise TypeError(f"CompiledMethod: {function!r} is not callable")
        self.__func__ = function
        self.attr = attr
        self.owner = None

    @property
    def __wrapped__(self):
        return self.__func__

    @property
    def __name__(self):
        return self.__func__.__name__

    def __get__(self, obj, objtype):
        if obj is None:
            return self.__func__
        cdef PyObject* compiled
        if type(obj) is not self.owner:
            self.offset = _slot(type(obj), self.attr)
            self.owner = type(obj)
        if self.offset >= 0:
            compiled = _field(obj, self.offset)
        else:
            compiled = PyDict_GetItem(PyObject_GenericGetDict(obj, NULL), self.attr)
        if compiled != NULL and compiled != <PyObject*>None:
            return <object>compiled
        return PyMethod_New(self.__func__, obj)


cdef class Matcher:
    """``cache.match_prefix`` for plain keys, a ``limit`` or not: ``Matcher(cache,
    general, node, wrap, result, tail)(params)`` returns what ``general(cache, params)``
    would.

    - ``general``: the Python ``match_prefix``, for every other key (and a disabled cache);
    - ``node``: the node view type, :class:`hiradix.sglang.nodes.TreeNode`, whose two
      fields (``_cache``, ``id``) a view is made of here without its ``__init__``;
    - ``wrap(device_indices)``: the result's first field from the matched slots (a CPU
      tensor of them), or ``len`` for their number (SGLang 0.5.23): the tree then
      counts them without reading or copying them;
    - ``result`` / ``tail``: SGLang's ``MatchResult`` (a ``NamedTuple``) and the defaults
      of its fields after the first five. A result is allocated at its full length and
      filled, as ``tuple.__new__(result, items)`` does, without the temporary tuples.
    """

    cdef HiRadixTree tree
    cdef object cache, general, node, wrap, result
    cdef tuple tail
    cdef bint count  # wrap is len: the tree's walk counts the slots (match_into's out[4])
    # Where the fields live in the node views (-1: made through object.__new__ and
    # setattr instead) and in the keys of type key_type (KEY_FIELDS; learnt from the
    # first key, again whenever the type changes; -1: read through getattr).
    cdef Py_ssize_t node_cache, node_id
    cdef type key_type
    cdef Py_ssize_t key_slots[N_KEY_FIELDS]

    def __init__(self, cache, general, node, wrap, result, tuple tail):
        if not issubclass(result, tuple):
            raise TypeError(f"Matcher: the result type must be a tuple (a NamedTuple), got {result!r}")
        self.cache = cache
        self.tree = cache.tree  # the cache's one tree for its life (reset empties it in place)
        self.general = general
        self.node = node
        self.wrap = wrap
        self.count = wrap is len
        self.result = result
        self.tail = tail
        self.node_cache = _slot(node, "_cache")
        self.node_id = _slot(node, "id")
        if self.node_cache < 0 or self.node_id < 0:
            self.node_cache = self.node_id = -1
        self.key_type = None

    cdef int _learn(self, type cls) except -1:
        # Each of SGLang's RadixKey fields is a __slots__ field (0.5.18 to 0.5.23): read
        # where it lives, five getattr calls (about 0.1 us) are saved on every match.
        cdef Py_ssize_t i
        self.key_type = cls
        for i in range(N_KEY_FIELDS):
            self.key_slots[i] = _slot(cls, KEY_FIELDS[i])
            if self.key_slots[i] < 0:
                self.key_slots[0] = -1
                return 0
        return 0

    def __call__(self, params):
        cache = self.cache
        key = params.key
        cdef PyObject* fields[N_KEY_FIELDS]
        cdef Py_ssize_t i
        cdef bint special
        if type(key) is not self.key_type:
            self._learn(type(key))
        if self.key_slots[0] >= 0:
            for i in range(N_KEY_FIELDS):
                fields[i] = _field(key, self.key_slots[i])
                if fields[i] == NULL:  # unset: the method raises as SGLang's would
                    return self.general(cache, params)
            ids = <object>fields[0]
            limit = <object>fields[1]
            special = (<object>fields[2] or fields[3] != <PyObject*>None
                       or fields[4] != <PyObject*>None)
        else:
            ids = key.token_ids
            limit = key.limit
            special = key.is_bigram or key.extra_key is not None or key.cache_salt is not None
        # limit: the scheduler's, the prompt's length less one
        if (type(ids) is not array or (<array>ids).ob_descr.typecode != b"q" or special
                or (limit is not None and (type(limit) is not int or limit < 0)) or cache.disable):
            return self.general(cache, params)
        cdef Py_ssize_t n = len(ids)
        cdef Py_ssize_t cap = -1 if limit is None else limit
        if 0 <= cap < n:
            n = cap
        if n < self.tree.page_size:
            return self.general(cache, params)
        # The tree matches whole pages only, and reads no token past the limit.
        # last device node, last host node, host hit length, last node, device prefix length
        cdef int64_t out[5]
        if self.count:
            self.tree.match_into(ids, None, out, cap, False)
            first = out[4]
        else:
            first = self.wrap(self.tree.match_into(ids, None, out, cap, True))
        # The deepest backed-up matched node, as the Python method picks it: the end of an
        # evicted tail, else the tree's anchor at or above the device part.
        cdef int64_t host = out[3] if out[2] else out[1]
        node = self._view(out[0])
        anchor = node if host == out[0] else self._view(host)
        return self._result(first, node, anchor, out[2])

    cdef object _view(self, int64_t handle):
        cdef TypeObject* t
        cdef PyObject* p
        if self.node_cache < 0:
            view = object.__new__(self.node)
            view._cache = self.cache
            view.id = handle
            return view
        # object.__new__'s allocation, and the two fields set where their descriptors
        # would set them: about half the cost of the calls above
        t = <TypeObject*>self.node
        p = t.tp_alloc(t, 0)
        if p == NULL:
            raise MemoryError()
        view = <object>p
        Py_DECREF(view)  # the cast took a reference of its own
        _set_field(p, self.node_cache, self.cache)
        _set_field(p, self.node_id, handle)
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
