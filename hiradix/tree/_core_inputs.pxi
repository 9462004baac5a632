# Included by _core.pyx (one module: these are its module-level definitions).
# Argument checks and conversions shared by every entry point (the twin's error types).

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


cdef cnp.ndarray _as_tokens(object key, Py_ssize_t limit=-1):
    """Token ids as a C-contiguous 1-D int32 array, without per-token Python work; only
    the first ``limit`` of them when ``limit`` is not negative (SGLang's ``RadixKey.limit``:
    the rest is not read)."""
    cdef cnp.ndarray arr
    cdef cnp.ndarray out
    cdef const int64_t* src
    cdef int32_t* dst
    cdef Py_ssize_t n
    cdef Py_buffer view
    cdef uint64_t high
    if type(key) is np.ndarray:
        arr = <cnp.ndarray>key
    elif type(key) is array:
        # SGLang's scheduler keys (array('q')): read through the buffer protocol, without
        # an intermediate numpy array (np.asarray costs about as much as the conversion).
        PyObject_GetBuffer(key, &view, PyBUF_FORMAT)
        try:
            if view.itemsize == 8 and view.format[0] in b"ql" and view.format[1] == 0:
                n = view.len // 8
                if 0 <= limit < n:
                    n = limit
                out = _empty(n, cnp.NPY_INT32)
                high = hr_narrow(<const int64_t*>view.buf, <int32_t*>cnp.PyArray_DATA(out), n)
                if not high:
                    return out
        finally:
            PyBuffer_Release(&view)
        arr = np.asarray(key)     # other typecodes, or an id out of range: the checks below
    else:
        arr = np.asarray(key)     # lists, CPU torch tensors (__array__), other buffers
    if cnp.PyArray_NDIM(arr) != 1:
        if cnp.PyArray_SIZE(arr) == 0:
            return np.empty(0, dtype=np.int32)
        raise ValueError(f"token ids must be 1-D, got shape {(<object>arr).shape}")
    if 0 <= limit < cnp.PyArray_SIZE(arr):
        arr = arr[:limit]
    if cnp.PyArray_TYPE(arr) == cnp.NPY_INT32 and cnp.PyArray_ISNOTSWAPPED(arr):
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = np.ascontiguousarray(arr)
        return arr
    if cnp.PyArray_SIZE(arr) == 0:
        return np.empty(0, dtype=np.int32)
    # The scheduler's keys are contiguous int64 already: no Python-level dtype checks.
    if (cnp.PyArray_TYPE(arr) != cnp.NPY_INT64 or not cnp.PyArray_IS_C_CONTIGUOUS(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        if arr.dtype.kind not in "iu":
            _reject_dtype(arr, "token ids", INT32_MIN_, INT32_MAX_)
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > INT32_MAX_:
            raise OverflowError(f"token id out of int32 range: min {int(arr.min())}, max {int(arr.max())}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    n = cnp.PyArray_SIZE(arr)
    out = _empty(n, cnp.NPY_INT32)
    src = <const int64_t*>cnp.PyArray_DATA(arr)
    dst = <int32_t*>cnp.PyArray_DATA(out)
    # Convert first, check after: without a branch in the loop the compiler vectorizes
    # it (a 1,343-token key: 1.3 us with an early exit, a fraction of that without).
    # ``t + 2**31`` fits 32 bits exactly when ``t`` fits int32, so any high bit in the OR
    # of the shifted values marks a token out of range.
    if n >= NOGIL_MIN:
        with nogil:
            high = hr_narrow(src, dst, n)
    else:
        high = hr_narrow(src, dst, n)
    if high:
        raise OverflowError(f"token id out of int32 range: min {int(arr.min())}, max {int(arr.max())}")
    return out


cdef cnp.ndarray _as_int64s(object value, str name):
    """Integers as a C-contiguous 1-D int64 array."""
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


cdef int _check_slots(const int64_t* p, int64_t n, str name) except -1:
    """``OverflowError`` unless all ``n`` slots fit int32, the type the span buffers store
    them in (a pool of 2**31 slots or more has none here). One vectorized pass."""
    cdef int64_t k, lo, hi
    if n == 0 or not hr_high64(p, n):
        return 0
    lo = hi = p[0]
    for k in range(n):
        lo = min(lo, p[k])
        hi = max(hi, p[k])
    raise OverflowError(f"{name} out of the tree's slot range (int32): min {lo}, max {hi}")


cdef cnp.ndarray _as_indices(object value, str name):
    """KV slot indices as a C-contiguous 1-D int64 array, each checked to fit int32
    (:func:`_check_slots`)."""
    cdef cnp.ndarray arr = _as_int64s(value, name)
    _check_slots(<const int64_t*>cnp.PyArray_DATA(arr), cnp.PyArray_SIZE(arr), name)
    return arr


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
