# cython: language_level=3
"""Batch key hashing for the peer cache: one SHA-256 per key, in C.

A key's SHA-256 (of its UTF-8 bytes) is both the 32-byte digest a published-pool slot
header carries (:func:`hiradix.peer.pool.key_digest`) and, through its first 8 bytes read
big-endian, the key's position on the consistent-hash ring
(:func:`hiradix.peer.ring.hash64`). :func:`key_digests` computes them for a whole batch
in one call: the UTF-8 pointers are collected with the GIL held
(``str`` keeps its UTF-8 form cached, so ASCII keys are not copied), then the hashes run in
one C loop (SHA-NI when the CPU has it), without the GIL for batches of at least
:data:`NOGIL_MIN_BLOCKS` SHA-256 blocks.

The GIL stays held for small batches on purpose: a 128-key batch hashes in a few
microseconds, while taking the GIL back can wait up to the interpreter's switch interval
(5 ms) behind another thread, which would land in the caller's tail latency.

The pure-Python fallback (``HIRADIX_PUREPYTHON=1`` or no compiler) is
:mod:`hiradix.peer.keyhash` over :mod:`hashlib`; it gives the same values.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc

import numpy as np

cdef extern from "_sha256.h" nogil:
    void hr_sha256(const void* data, size_t length, uint8_t* out)
    int hr_sha256_accelerated()

#: Batches needing at least this many 64-byte SHA-256 blocks are hashed without the GIL
#: (about 100 us of work: enough to pay for releasing and retaking it).
NOGIL_MIN_BLOCKS = 2048
cdef Py_ssize_t _NOGIL_MIN = NOGIL_MIN_BLOCKS


def sha256_accelerated() -> bool:
    """Whether the SHA-256 runs on the x86 SHA extensions (else portable C)."""
    return bool(hr_sha256_accelerated())


cdef struct _Span:
    const char *data  # the key's UTF-8 (or raw) bytes, owned by a Python object kept alive
    Py_ssize_t size   # their length in bytes


cdef Py_ssize_t _spans(tuple ks, list hold, _Span *spans) except -1:
    """Fill ``spans`` with each key's bytes; return the SHA-256 block count of the batch."""
    cdef Py_ssize_t i, blocks = 0
    cdef object k
    for i in range(len(ks)):
        k = ks[i]
        if isinstance(k, str):
            spans[i].data = PyUnicode_AsUTF8AndSize(k, &spans[i].size)
        else:
            if not isinstance(k, bytes):
                k = bytes(memoryview(k))  # bytearray, memoryview; TypeError for the rest
                hold.append(k)
            spans[i].data = PyBytes_AS_STRING(k)
            spans[i].size = PyBytes_GET_SIZE(k)
        blocks += (spans[i].size + 72) >> 6  # + 0x80 pad byte + 8-byte length
    return blocks


cdef void _digest_run(const _Span *spans, Py_ssize_t n, uint8_t *out) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        hr_sha256(spans[i].data, <size_t>spans[i].size, out + 32 * i)


def key_digests(keys) -> np.ndarray:
    """Each key's SHA-256 (``str`` keys as UTF-8) as rows of an ``(n, 32)`` ``uint8`` array.

    ``UnicodeEncodeError`` for a ``str`` that is not valid UTF-8 (lone surrogates), as
    ``str.encode`` would; ``TypeError`` for a key that is neither ``str`` nor bytes-like.
    Runtime complexity: ``O(total key bytes)``.

    >>> import hashlib
    >>> key_digests(["abc"])[0].tobytes() == hashlib.sha256(b"abc").digest()
    True
    """
    cdef tuple ks = tuple(keys)
    cdef Py_ssize_t n = len(ks), blocks
    cdef list hold = []
    out = np.empty((n, 32), dtype=np.uint8)
    if n == 0:
        return out
    cdef uint8_t[:, ::1] view = out
    cdef _Span *spans = <_Span *>malloc(n * sizeof(_Span))
    if spans == NULL:
        raise MemoryError()
    try:
        blocks = _spans(ks, hold, spans)
        if blocks >= _NOGIL_MIN:
            with nogil:
                _digest_run(spans, n, &view[0, 0])
        else:
            _digest_run(spans, n, &view[0, 0])
    finally:
        free(spans)
    return out
