# cython: language_level=3
"""GIL-free row copies between CPU byte buffers: the gather/scatter under the copy engine.

One primitive, :func:`copy_rows`. For each ``i`` it copies ``row_bytes`` bytes::

    dst[dst_base + dst_offsets[i] : ... + row_bytes] = src[src_base + src_offsets[i] : ... + row_bytes]

Every KV transfer between a device pool and a host pool is this shape: one row is one
token's KV of one (layer, component), and the offsets say where that token sits in each
layout (see :mod:`hiradix.memory.copy`). Rows that follow each other on *both* sides
(``offsets[i + 1] == offsets[i] + row_bytes``) are merged into one ``memcpy``, so a whole
page that is contiguous on both sides costs one call however many tokens it holds.

It is kept out of the tree core (``hiradix.tree._core``) on purpose: the tree does no I/O.

Contract:

- Everything is validated before the first byte moves: buffer types, lengths, and every
  row against the buffer it lands in, with arithmetic that cannot overflow. A bad request
  raises and leaves ``dst`` untouched.
- The copy runs without the GIL (``with nogil``) once it moves at least
  :data:`NOGIL_MIN_BYTES`; below that, dropping and retaking the GIL costs more than the
  copy and can stall the caller behind another thread's switch interval.
- Rows are copied in order, so a later row that writes the same bytes as an earlier one
  wins. When ``dst`` and ``src`` overlap in memory, rows are not merged and each is a
  ``memmove``: the result is that of copying the rows one at a time, in order.
- ``threads > 1`` cuts a large copy into equal slices of rows copied by that many POSIX
  threads (the caller's among them). Pages in random order are latency bound, not
  bandwidth bound, so a second thread helps when a core is free (``bench/transfer.py``).
"""

cimport cython
cimport numpy as cnp
import numpy as np
from libc.stdint cimport int64_t, uint8_t, uintptr_t
from libc.string cimport memcpy, memmove

NOGIL_MIN_BYTES = 1 << 16
PARALLEL_MIN_BYTES = 1 << 20
MAX_THREADS = 8
cnp.import_array()
cdef int64_t _NOGIL_MIN = NOGIL_MIN_BYTES
cdef int64_t _PARALLEL_MIN = PARALLEL_MIN_BYTES

# Software prefetch for rows that are copied one by one (not merged into a longer run):
# page_first rows sit one token stride apart (16 KiB in the benchmark's shape), where the
# hardware prefetchers do not follow, so each row's read would stall on memory. Reading
# the row PREFETCH_AHEAD rows on measured 1.1-1.2x on page_first and nothing on merged runs,
# which is why merged runs do not prefetch (bench/RESULTS_transfer.md).
cdef enum:
    PREFETCH_AHEAD = 4
    PREFETCH_MAX_ROW = 1024
    CACHE_LINE = 64

cdef extern from *:
    """
    #define HR_PREFETCH(p) __builtin_prefetch((p), 0, 0)
    """
    void HR_PREFETCH(const void* p) noexcept nogil


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t* thread, const void* attr, void* (*start)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t thread, void** retval)


cdef struct Job:
    uint8_t* dst            # destination, base already added
    const int64_t* doff     # this slice's destination row offsets (bytes)
    const uint8_t* src      # source, base already added
    const int64_t* soff     # this slice's source row offsets (bytes)
    Py_ssize_t n            # rows in this slice
    int64_t row             # bytes per row
    const int64_t* lens     # or, when not NULL, this slice's bytes per run (copy_runs)
    Py_ssize_t runs         # out: memcpy calls made


cdef void* _job_main(void* arg) noexcept nogil:
    cdef Job* job = <Job*>arg
    if job.lens != NULL:
        job.runs = _copy_runs(job.dst, job.doff, job.src, job.soff, job.lens, job.n)
    else:
        job.runs = _copy(job.dst, job.doff, job.src, job.soff, job.n, job.row, False)
    return NULL


cdef object _byte_buffer(object obj, str name, bint writable):
    """``obj`` as a C-contiguous 1-D uint8 memoryview, or a clear ``TypeError``."""
    cdef uint8_t[::1] rw
    cdef const uint8_t[::1] ro
    try:
        if writable:
            rw = obj
            return rw
        ro = obj
        return ro
    except (TypeError, ValueError, BufferError) as exc:
        kind = "writable " if writable else ""
        raise TypeError(
            f"{name} must be a {kind}C-contiguous 1-D uint8 buffer (for a CPU tensor: "
            f"t.view(torch.uint8).numpy()), got {type(obj).__name__}: {exc}"
        ) from None


cdef object _offsets(object obj, str name):
    cdef const int64_t[::1] off
    try:
        off = obj
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(
            f"{name} must be a C-contiguous 1-D int64 buffer (numpy int64 array), got {type(obj).__name__}: {exc}"
        ) from None
    return off


cdef int64_t _NO_ROWS = 0  # what an empty buffer's pointer points at (never read)


cdef inline bint _plain(object obj, int typenum, bint writable):
    """A C-contiguous 1-D numpy array of ``typenum``, native byte order (and writable):
    its data pointer serves without a buffer request, which costs more than a small copy."""
    return (type(obj) is np.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>obj) == typenum
            and cnp.PyArray_NDIM(<cnp.ndarray>obj) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>obj)
            and (not writable or cnp.PyArray_ISWRITEABLE(<cnp.ndarray>obj)))


cdef uint8_t* _bytes_ptr(object obj, str name, bint writable, Py_ssize_t* size, list keep) except NULL:
    """``obj``'s bytes as :func:`_byte_buffer` checks them: the data pointer and size; a
    buffer view needed for it is kept alive in ``keep``."""
    cdef uint8_t[::1] view
    if _plain(obj, cnp.NPY_UINT8, writable):
        size[0] = cnp.PyArray_SIZE(<cnp.ndarray>obj)
        return <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>obj)
    mv = _byte_buffer(obj, name, writable)
    keep.append(mv)
    size[0] = len(mv)
    if size[0] == 0:
        return <uint8_t*>&_NO_ROWS
    if writable:
        view = mv
        return &view[0]
    cdef const uint8_t[::1] ro = mv
    return <uint8_t*>&ro[0]


cdef const int64_t* _int64_ptr(object obj, str name, Py_ssize_t* n, list keep) except NULL:
    """``obj`` as :func:`_offsets` checks it: the data pointer and length."""
    if _plain(obj, cnp.NPY_INT64, False):
        n[0] = cnp.PyArray_SIZE(<cnp.ndarray>obj)
        return <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>obj)
    cdef const int64_t[::1] view = _offsets(obj, name)
    keep.append(view)
    n[0] = view.shape[0]
    return &view[0] if n[0] else &_NO_ROWS


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline Py_ssize_t _first_bad(const int64_t* off, Py_ssize_t n, int64_t limit,
                                  int64_t mask) noexcept nogil:
    """Index of the first offset outside ``[0, limit]`` or not a multiple of ``mask + 1``,
    or ``-1``. ``limit`` is the largest start a row may have: no sum is ever formed."""
    cdef Py_ssize_t i
    cdef int64_t o
    for i in range(n):
        o = off[i]
        if o < 0 or o > limit or (o & mask) != 0:
            return i
    return -1


@cython.boundscheck(False)
@cython.wraparound(False)
cdef Py_ssize_t _copy(uint8_t* dst, const int64_t* doff, const uint8_t* src, const int64_t* soff,
                      Py_ssize_t n, int64_t row, bint overlap) noexcept nogil:
    """Copy ``n`` validated rows, merging runs contiguous on both sides; returns the number
    of ``memcpy`` calls. ``d + length`` stays within the buffer: every row of a run was
    checked to end inside it."""
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t j
    cdef Py_ssize_t runs = 0
    cdef int64_t d, s, length, line
    cdef const uint8_t* pf
    while i < n:
        d = doff[i]
        s = soff[i]
        length = row
        j = i + 1
        # Merging rows is only exact when no row reads bytes an earlier row wrote.
        while not overlap and j < n and doff[j] == d + length and soff[j] == s + length:
            length += row
            j += 1
        if length == row and row <= PREFETCH_MAX_ROW and j + PREFETCH_AHEAD < n:
            pf = src + soff[j + PREFETCH_AHEAD]
            line = 0
            while line < row:
                HR_PREFETCH(pf + line)
                line += CACHE_LINE
        if overlap:
            memmove(dst + d, src + s, <size_t>length)
        else:
            memcpy(dst + d, src + s, <size_t>length)
        runs += 1
        i = j
    return runs


@cython.boundscheck(False)
@cython.wraparound(False)
cdef Py_ssize_t _copy_runs(uint8_t* dst, const int64_t* doff, const uint8_t* src, const int64_t* soff,
                           const int64_t* lens, Py_ssize_t n) noexcept nogil:
    """Copy ``n`` validated runs of ``lens[i]`` bytes between buffers that do not overlap."""
    cdef Py_ssize_t i
    for i in range(n):
        memcpy(dst + doff[i], src + soff[i], <size_t>lens[i])
    return n


cdef Py_ssize_t _copy_parallel(uint8_t* dst, const int64_t* doff, const uint8_t* src, const int64_t* soff,
                               Py_ssize_t n, int64_t row, int threads, const int64_t* lens=NULL) noexcept nogil:
    """:func:`_copy` with the rows cut into ``threads`` equal slices, one per thread (the
    caller's thread takes the first). A thread that cannot be started leaves its slice to
    the caller's thread, so the copy always completes."""
    cdef Job jobs[8]
    cdef pthread_t tids[8]
    cdef bint started[8]
    cdef int k
    cdef Py_ssize_t lo, hi
    cdef Py_ssize_t runs = 0
    for k in range(threads):
        lo = n * k // threads
        hi = n * (k + 1) // threads
        jobs[k].dst = dst
        jobs[k].doff = doff + lo
        jobs[k].src = src
        jobs[k].soff = soff + lo
        jobs[k].n = hi - lo
        jobs[k].row = row
        jobs[k].lens = NULL if lens == NULL else lens + lo
        jobs[k].runs = 0
    for k in range(1, threads):
        started[k] = pthread_create(&tids[k], NULL, _job_main, &jobs[k]) == 0
    _job_main(&jobs[0])
    for k in range(1, threads):
        if started[k]:
            pthread_join(tids[k], NULL)
        else:
            _job_main(&jobs[k])
    for k in range(threads):
        runs += jobs[k].runs
    return runs


def copy_rows(dst, dst_offsets, Py_ssize_t dst_base, src, src_offsets, Py_ssize_t src_base,
              Py_ssize_t row_bytes, Py_ssize_t align=1, int threads=1):
    """Copy ``len(dst_offsets)`` rows of ``row_bytes`` bytes from ``src`` to ``dst``.

    Row ``i`` goes from byte ``src_base + src_offsets[i]`` of ``src`` to byte
    ``dst_base + dst_offsets[i]`` of ``dst``. Rows contiguous on both sides are merged
    into one ``memcpy`` (unless the buffers overlap). The copy runs without the GIL once it moves
    :data:`NOGIL_MIN_BYTES` or more.

    Parameters
    ----------
    dst:
        Writable, C-contiguous 1-D uint8 buffer (a numpy array, ``bytearray``, or a CPU
        tensor's ``t.view(torch.uint8).numpy()``).
    dst_offsets, src_offsets:
        C-contiguous 1-D int64 arrays of equal length: byte offsets of the rows,
        relative to ``dst_base`` / ``src_base``. Must be ``>= 0``.
    dst_base, src_base:
        Byte offset added to every row (e.g. the start of one layer's region), ``>= 0``.
    src:
        C-contiguous 1-D uint8 buffer (read only is fine).
    row_bytes:
        Bytes per row, ``>= 0``.
    align:
        Element size of the data (a power of two). ``row_bytes``, both bases and every
        offset must be multiples of it, which catches offsets computed in elements
        instead of bytes.
    threads:
        Threads to split the rows over, ``1 .. MAX_THREADS`` (the caller's thread is one
        of them). Used only for copies of at least :data:`PARALLEL_MIN_BYTES` between
        buffers that do not overlap; then rows in different slices are copied
        concurrently, so rows that write the same bytes land in no defined order.

    Returns
    -------
    int
        The number of ``memcpy`` calls made (runs after merging).

    Raises
    ------
    TypeError
        A buffer or an offset array of the wrong type, dtype, shape or contiguity.
    ValueError
        Mismatched lengths, a negative or misaligned size or base.
    IndexError
        A row that would start before or end after its buffer.

    Nothing is copied when anything raises.

    Runtime complexity: ``O(n + n x row_bytes)``: one pass to validate, one to copy.

    >>> import numpy as np
    >>> src = np.arange(16, dtype=np.uint8)
    >>> dst = np.zeros(8, dtype=np.uint8)
    >>> copy_rows(dst, np.array([0, 2, 4]), 0, src, np.array([12, 14, 2]), 0, 2)
    2
    >>> dst.tolist()
    [12, 13, 14, 15, 2, 3, 0, 0]
    """
    cdef uint8_t[::1] d = _byte_buffer(dst, "dst", True)
    cdef const uint8_t[::1] s = _byte_buffer(src, "src", False)
    cdef const int64_t[::1] doff = _offsets(dst_offsets, "dst_offsets")
    cdef const int64_t[::1] soff = _offsets(src_offsets, "src_offsets")
    cdef Py_ssize_t n = doff.shape[0]
    if soff.shape[0] != n:
        raise ValueError(f"dst_offsets has {n} rows but src_offsets has {soff.shape[0]}")
    _check_args(align, dst_base, src_base, threads)
    if row_bytes < 0 or row_bytes % align:
        raise ValueError(f"row_bytes must be a non-negative multiple of align={align}, got {row_bytes}")
    if n == 0 or row_bytes == 0:
        return 0
    cdef Py_ssize_t dlen = d.shape[0]
    cdef Py_ssize_t slen = s.shape[0]
    # Largest valid row start relative to the base, formed without overflow: every operand
    # is non-negative and each subtraction is checked to stay so.
    if row_bytes > dlen or dst_base > dlen - row_bytes:
        raise IndexError(f"dst has {dlen} bytes: no room for a {row_bytes}-byte row at base {dst_base}")
    if row_bytes > slen or src_base > slen - row_bytes:
        raise IndexError(f"src has {slen} bytes: no room for a {row_bytes}-byte row at base {src_base}")
    cdef int64_t dlimit = dlen - row_bytes - dst_base
    cdef int64_t slimit = slen - row_bytes - src_base
    cdef int64_t mask = align - 1
    cdef uint8_t* dp = &d[0] + dst_base
    cdef const uint8_t* sp = &s[0] + src_base
    cdef const int64_t* dop = &doff[0]
    cdef const int64_t* sop = &soff[0]
    cdef uintptr_t d0 = <uintptr_t>&d[0]
    cdef uintptr_t s0 = <uintptr_t>&s[0]
    cdef bint overlap = d0 < s0 + <uintptr_t>slen and s0 < d0 + <uintptr_t>dlen
    cdef Py_ssize_t bad_d = -1
    cdef Py_ssize_t bad_s = -1
    cdef Py_ssize_t runs = 0
    # n * row_bytes may overflow for absurd inputs, but then the rows cannot all be in
    # bounds; the comparison only picks GIL or no GIL.
    cdef bint release = n >= (_NOGIL_MIN + row_bytes - 1) // row_bytes
    cdef int par = 1
    if threads > 1 and not overlap and n >= (_PARALLEL_MIN + row_bytes - 1) // row_bytes:
        par = threads if threads < n else <int>n
    if release:
        with nogil:
            bad_d = _first_bad(dop, n, dlimit, mask)
            if bad_d < 0:
                bad_s = _first_bad(sop, n, slimit, mask)
                if bad_s < 0:
                    if par > 1:
                        runs = _copy_parallel(dp, dop, sp, sop, n, row_bytes, par)
                    else:
                        runs = _copy(dp, dop, sp, sop, n, row_bytes, overlap)
    else:
        bad_d = _first_bad(dop, n, dlimit, mask)
        if bad_d < 0:
            bad_s = _first_bad(sop, n, slimit, mask)
            if bad_s < 0:
                runs = _copy(dp, dop, sp, sop, n, row_bytes, overlap)
    if bad_d >= 0:
        _raise_bad("dst", bad_d, doff[bad_d], dst_base, row_bytes, dlen, align)
    if bad_s >= 0:
        _raise_bad("src", bad_s, soff[bad_s], src_base, row_bytes, slen, align)
    return runs


cdef int _check_args(Py_ssize_t align, Py_ssize_t dst_base, Py_ssize_t src_base, int threads) except -1:
    """The checks copy_rows and copy_runs share: ``ValueError`` naming the argument."""
    if align < 1 or (align & (align - 1)) != 0:
        raise ValueError(f"align must be a power of two, got {align}")
    if dst_base < 0 or src_base < 0 or dst_base % align or src_base % align:
        raise ValueError(
            f"dst_base and src_base must be non-negative multiples of align={align}, got {dst_base}, {src_base}"
        )
    if threads < 1 or threads > MAX_THREADS:
        raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
    return 0


cdef int _raise_bad(str name, Py_ssize_t i, int64_t off, Py_ssize_t base, Py_ssize_t row,
                    Py_ssize_t length, Py_ssize_t align) except -1:
    if off >= 0 and off % align:
        raise ValueError(f"{name}_offsets[{i}] = {off} is not a multiple of align={align}")
    raise IndexError(
        f"{name}_offsets[{i}] = {off}: a {row}-byte row at base {base} does not fit in {name}'s {length} bytes"
    )


@cython.boundscheck(False)
@cython.wraparound(False)
def copy_runs(dst, dst_offsets, Py_ssize_t dst_base, src, src_offsets, Py_ssize_t src_base, run_bytes,
              Py_ssize_t align=1, int threads=1):
    """Copy ``len(dst_offsets)`` runs between two buffers that do not overlap: run ``i``
    is ``run_bytes[i]`` bytes from byte ``src_base + src_offsets[i]`` of ``src`` to byte
    ``dst_base + dst_offsets[i]`` of ``dst``. :func:`copy_rows` with a length per row, for
    plans whose rows are already merged (:func:`pair_runs`).

    Arguments and errors as :func:`copy_rows`, with ``run_bytes`` (C-contiguous 1-D int64,
    one per run, each ``>= 0`` and a multiple of ``align``) for ``row_bytes``. A run that
    does not fit raises ``IndexError`` naming it, and buffers that overlap raise
    ``ValueError`` (runs are not ordered rows). Nothing is copied when anything raises.
    The GIL is released from :data:`NOGIL_MIN_BYTES` moved; ``threads`` splits the runs
    from :data:`PARALLEL_MIN_BYTES`. Returns the number of runs.

    Runtime complexity: ``O(n + bytes)``.

    >>> import numpy as np
    >>> src = np.arange(16, dtype=np.uint8)
    >>> dst = np.zeros(8, dtype=np.uint8)
    >>> copy_runs(dst, np.array([0, 6]), 0, src, np.array([10, 2]), 0, np.array([4, 2]))
    2
    >>> dst.tolist()
    [10, 11, 12, 13, 0, 0, 2, 3]
    """
    keep = []
    cdef Py_ssize_t dlen, slen, n, ns, nl
    cdef uint8_t* d = _bytes_ptr(dst, "dst", True, &dlen, keep)
    cdef const uint8_t* s = _bytes_ptr(src, "src", False, &slen, keep)
    cdef const int64_t* doff = _int64_ptr(dst_offsets, "dst_offsets", &n, keep)
    cdef const int64_t* soff = _int64_ptr(src_offsets, "src_offsets", &ns, keep)
    cdef const int64_t* lens = _int64_ptr(run_bytes, "run_bytes", &nl, keep)
    if ns != n or nl != n:
        raise ValueError(f"dst_offsets has {n} runs but src_offsets has {ns}, run_bytes {nl}")
    _check_args(align, dst_base, src_base, threads)
    if n == 0:
        return 0
    cdef uintptr_t d0 = <uintptr_t>d
    cdef uintptr_t s0 = <uintptr_t>s
    if d0 < s0 + <uintptr_t>slen and s0 < d0 + <uintptr_t>dlen:
        raise ValueError("copy_runs: dst and src overlap")
    if dst_base > dlen or src_base > slen:
        raise IndexError(f"base {dst_base} / {src_base} is past dst's {dlen} / src's {slen} bytes")
    cdef int64_t dlimit = dlen - dst_base
    cdef int64_t slimit = slen - src_base
    cdef int64_t mask = align - 1
    cdef int64_t total = 0
    cdef int64_t ln, o, q
    cdef Py_ssize_t i, bad = -1
    for i in range(n):  # every bound checked before anything moves; no sum can overflow
        ln, o, q = lens[i], doff[i], soff[i]
        if (ln < 0 or o < 0 or q < 0 or ln > dlimit or o > dlimit - ln or ln > slimit or q > slimit - ln
                or (ln | o | q) & mask):
            bad = i
            break
        total += ln
    if bad >= 0:
        ln, o, q = lens[bad], doff[bad], soff[bad]
        if ln >= 0 and o >= 0 and q >= 0 and (ln | o | q) & mask:
            raise ValueError(f"run {bad} (dst {o}, src {q}, {ln} bytes) is not a multiple of align={align}")
        raise IndexError(
            f"run {bad}: {ln} bytes from src offset {q} (base {src_base}, {slen} bytes) to dst offset {o} "
            f"(base {dst_base}, {dlen} bytes) does not fit"
        )
    cdef uint8_t* dp = d + dst_base
    cdef const uint8_t* sp = s + src_base
    cdef int par = threads if threads < n else <int>n
    if par > 1 and total >= _PARALLEL_MIN:
        with nogil:
            _copy_parallel(dp, doff, sp, soff, n, 0, par, lens)
    elif total >= _NOGIL_MIN:
        with nogil:
            _copy_runs(dp, doff, sp, soff, lens, n)
    else:
        _copy_runs(dp, doff, sp, soff, lens, n)
    return n


# ----------------------------------------------------------------------------- planning
@cython.cdivision(True)
cdef inline int64_t _floordiv(int64_t v, int64_t d) noexcept nogil:
    """``v // d`` for ``v >= 0``, ``d >= 1`` (checked by the callers): C division, without
    the sign fix-ups and zero check of Python semantics."""
    return v / d


def slot_offsets(slots, int64_t limit, int64_t page_size, int64_t page_stride, int64_t slot_stride, str name):
    """Byte offsets of the rows of ``slots`` (a 1-D int64 buffer): slot ``s`` at
    ``(s // page_size) * page_stride + (s % page_size) * slot_stride``, as a new int64
    array. Raises ``IndexError`` naming ``name`` when a slot lies outside ``[0, limit)``.

    The CUDA kernel path plans its rows with these (device side, host side; the CPU copy
    plans merged runs, :func:`pair_runs`): one pass each, where the same in torch took
    about ten small tensor operations. Runtime complexity: ``O(n)``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return _slot_offsets(_offsets(slots, name), limit, page_size, page_stride, slot_stride, name)


cdef inline int _shift_of(int64_t page_size) noexcept nogil:
    """``log2(page_size)`` for a power of two (1 included), so that slots split into page
    and offset by shift and mask, without a division; ``-1`` otherwise."""
    cdef int shift = 0
    if page_size & (page_size - 1):
        return -1
    while (<int64_t>1 << shift) < page_size:
        shift += 1
    return shift


@cython.boundscheck(False)
@cython.wraparound(False)
cdef object _slot_offsets(const int64_t[::1] s, int64_t limit, int64_t page_size, int64_t page_stride,
                          int64_t slot_stride, str name):
    cdef Py_ssize_t n = s.shape[0]
    cdef Py_ssize_t i
    cdef int64_t v
    cdef bint bad = False
    cdef int shift = _shift_of(page_size)
    cdef int64_t mask = page_size - 1
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        if shift >= 0:
            for i in range(n):
                v = s[i]
                if v < 0 or v >= limit:
                    bad = True
                    break
                o[i] = (v >> shift) * page_stride + (v & mask) * slot_stride
        else:
            for i in range(n):
                v = s[i]
                if v < 0 or v >= limit:
                    bad = True
                    break
                o[i] = _floordiv(v, page_size) * page_stride + (v - _floordiv(v, page_size) * page_size) * slot_stride
    if bad:
        raise IndexError(f"{name} out of range [0, {limit}): min {min(s)}, max {max(s)}")
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
cdef bint _sorted(const int64_t[::1] s) noexcept:
    cdef Py_ssize_t i
    for i in range(1, s.shape[0]):
        if s[i] < s[i - 1]:
            return False
    return True


def pair_runs(dev, host, int64_t dev_limit, int64_t host_limit, int64_t host_page_size, tuple components):
    """The whole plan of one transfer in one call: the (device slot, host slot) pairs put
    in host-slot order (stable; the arrays as they are when already sorted), then per
    component ``(reuse, dev_page_stride, host_page_stride, host_slot_stride, row_bytes)``
    its runs: the device byte offsets, the host byte offsets and the bytes of each, where
    consecutive rows that follow each other on *both* sides are one run (a page or a
    whole allocation contiguous in both layouts is one ``memcpy``), or component
    ``reuse``'s runs when ``reuse >= 0`` (K and V alike). Device slot ``s`` sits at
    ``s * dev_page_stride``, host slot ``s`` at ``(s // host_page_size) *
    host_page_stride + (s % host_page_size) * host_slot_stride``. Returns the three
    tuples, for :func:`copy_runs`.

    ``ValueError`` for lengths that differ, ``IndexError`` naming the side for a slot out
    of range. The scheduler thread plans every write-through batch with this: a step's
    new nodes are runs of consecutive slots on both sides, so a plan of thousands of
    rows is a handful of runs. ``O(n)`` per distinct component, ``O(n log n)`` to sort
    pairs not in host order.

    >>> d, h, n = pair_runs(np.array([4, 5, 6, 9]), np.array([0, 1, 2, 3]), 16, 16, 1,
    ...                     ((-1, 8, 8, 0, 8), (0, 8, 8, 0, 8)))
    >>> [a.tolist() for a in (d[0], h[0], n[0])], d[1] is d[0]
    ([[32, 72], [0, 24], [24, 8]], True)
    """
    if host_page_size < 1:
        raise ValueError(f"host_page_size must be >= 1, got {host_page_size}")
    keep = []
    cdef Py_ssize_t n, nh
    cdef const int64_t* d = _int64_ptr(dev, "device_indices", &n, keep)
    cdef const int64_t* h = _int64_ptr(host, "host_indices", &nh, keep)
    if nh != n:
        raise ValueError(f"{n} device indices but {nh} host indices")
    dev_off = []
    host_off = []
    lengths = []
    cdef Py_ssize_t reuse
    cdef bint checked = False
    for component in components:
        reuse = component[0]
        if reuse >= 0:
            dev_off.append(dev_off[reuse])
            host_off.append(host_off[reuse])
            lengths.append(lengths[reuse])
            continue
        runs = _runs(d, h, n, dev_limit, host_limit, host_page_size, component[1], component[2], component[3],
                     component[4], not checked)
        if runs is None:  # host slots out of order: sort the pairs (stably) and plan again
            order = np.argsort(host, kind="stable")
            sorted_dev = np.ascontiguousarray(np.asarray(dev)[order], dtype=np.int64)
            sorted_host = np.ascontiguousarray(np.asarray(host)[order], dtype=np.int64)
            keep += [sorted_dev, sorted_host]
            d = <const int64_t*>cnp.PyArray_DATA(sorted_dev)
            h = <const int64_t*>cnp.PyArray_DATA(sorted_host)
            runs = _runs(d, h, n, dev_limit, host_limit, host_page_size, component[1], component[2],
                         component[3], component[4], True)
        checked = True
        dev_off.append(runs[0])
        host_off.append(runs[1])
        lengths.append(runs[2])
    if not checked and n:  # no component to plan: the pairs are still checked
        _runs(d, h, n, dev_limit, host_limit, host_page_size, 1, 1, 1, 1, True)
    return tuple(dev_off), tuple(host_off), tuple(lengths)


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)
cdef object _runs(const int64_t* d, const int64_t* h, Py_ssize_t n, int64_t dev_limit, int64_t host_limit,
                  int64_t page_size, int64_t dev_stride, int64_t page_stride, int64_t slot_stride, int64_t row,
                  bint check):
    # Rows i-1 and i are one run when both slots advance by one and the layouts put the
    # rows side by side: device rows when dev_stride == row; host rows within a page when
    # slot_stride == row, and across a page boundary when the next page starts where the
    # last row of the previous one ends. One pass; with ``check``, it also checks every
    # slot's range (a run's first and last slot bound all of it) and the host order (a
    # run ascends, so only run boundaries can descend): ``None`` when it descends.
    cdef Py_ssize_t i = 0, j, k = 0
    cdef int64_t v, w, top
    cdef int bad = 0
    cdef bint dev_next = dev_stride == row
    cdef bint in_page = dev_next and page_size > 1 and slot_stride == row
    cdef bint across = dev_next and page_stride == (page_size - 1) * slot_stride + row
    cdef bint merge = in_page or across
    cdef int shift = _shift_of(page_size)
    cdef int64_t mask = page_size - 1
    cdef cnp.npy_intp dims = n
    dout = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT64, 0)
    hout = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT64, 0)
    lout = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT64, 0)
    cdef int64_t* od = <int64_t*>cnp.PyArray_DATA(dout)
    cdef int64_t* oh = <int64_t*>cnp.PyArray_DATA(hout)
    cdef int64_t* ol = <int64_t*>cnp.PyArray_DATA(lout)
    with nogil:
        while i < n:
            v = d[i]
            w = h[i]
            j = i + 1
            if in_page and across or page_size == 1 and across:  # every slot boundary merges
                # Eight rows at a time while they all continue the run: a fixed-length
                # loop the compiler vectorizes (a step's write-through is a few long runs).
                while j + 8 <= n and _continues8(d + j, h + j, v + (j - i), w + (j - i)):
                    j += 8
                while j < n and d[j] - v == j - i and h[j] - w == j - i:
                    j += 1
            elif merge:
                while (j < n and d[j] == d[j - 1] + 1 and h[j] == h[j - 1] + 1
                       and ((in_page if (h[j] % page_size if shift < 0 else h[j] & mask) else across))):
                    j += 1
            if check:
                top = j - i - 1  # the run's last slots are v + top and w + top
                if v < 0 or v >= dev_limit or top >= dev_limit - v:
                    bad = 1
                    break
                if w < 0 or w >= host_limit or top >= host_limit - w:
                    bad = 2
                    break
                if i and w < h[i - 1]:
                    bad = 4
                    break
            od[k] = v * dev_stride
            if shift >= 0:
                oh[k] = (w >> shift) * page_stride + (w & mask) * slot_stride
            else:
                oh[k] = (w / page_size) * page_stride + (w % page_size) * slot_stride
            ol[k] = (j - i) * row
            k += 1
            i = j
    if bad == 1:
        lo, hi = _min_max(d, n)
        raise IndexError(f"device_indices out of range [0, {dev_limit}): min {lo}, max {hi}")
    if bad == 2:
        lo, hi = _min_max(h, n)
        raise IndexError(f"host_indices out of range [0, {host_limit}): min {lo}, max {hi}")
    if bad == 4:
        return None
    return dout[:k], hout[:k], lout[:k]


cdef inline bint _continues8(const int64_t* d, const int64_t* h, int64_t dv, int64_t hw) noexcept nogil:
    """Whether ``d[t] == dv + t`` and ``h[t] == hw + t`` for ``t`` in ``0 .. 7``."""
    cdef int64_t acc = 0
    cdef int t
    for t in range(8):
        acc |= (d[t] - dv - t) | (h[t] - hw - t)
    return acc == 0


cdef tuple _min_max(const int64_t* a, Py_ssize_t n):
    cdef int64_t lo = a[0], hi = a[0]
    cdef Py_ssize_t i
    for i in range(1, n):
        lo = a[i] if a[i] < lo else lo
        hi = a[i] if a[i] > hi else hi
    return lo, hi


@cython.boundscheck(False)
@cython.wraparound(False)
def is_sorted(slots):
    """Whether the 1-D int64 buffer ``slots`` is in non-decreasing order. ``O(n)``."""
    return _sorted(_offsets(slots, "slots"))
