# Included by _core.pyx (one module: these are its module-level definitions).
# The result records (``cdef class``, read-only attributes; the twin's dataclasses' names).

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


@cython.final
@cython.freelist(16)
cdef class LoadBackPlan:
    """See :class:`hiradix.tree._results.LoadBackPlan`."""

    cdef readonly int64_t anchor
    cdef readonly object host_indices

    def __init__(self, *args, **kwargs):
        _refuse_init(self)

    def __repr__(self):
        return _record_repr(self, ("anchor", "host_indices"))
