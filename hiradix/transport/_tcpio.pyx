# cython: language_level=3
"""The TCP transport's data plane in C: whole READ batches move without the GIL.

:class:`hiradix.transport.tcp.TcpTransport` hands this module flat arrays (remote address,
rkey, length, local address per item) and a connected socket's file descriptor.
:func:`read_frames` then sends the request frames, keeps a window of them in flight, and
receives every response straight into the destinations (``recvmsg`` with an iovec per
item), all in one call with the GIL released. :func:`send_response` is the responder's
half: one ``sendmsg`` loop whose iovec points at the registered region's memory.

The wire format is the one documented in :mod:`hiradix.transport.tcp`; the pure-Python
loops there (used with ``HIRADIX_PUREPYTHON=1``) speak exactly the same bytes, and the
transport conformance suite runs over both.

Error codes returned to Python: :data:`E_OK`, :data:`E_TIMEOUT` (the kernel's
``SO_RCVTIMEO``/``SO_SNDTIMEO`` or the batch deadline fired), :data:`E_CHANNEL` (EOF, a
reset, or a response that does not match its request: the channel cannot be trusted).
"""

import numpy as np

from libc.errno cimport EAGAIN, EINTR, errno

cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from "<sys/socket.h>" nogil:
    ctypedef long ssize_t
    struct iovec:
        void* iov_base
        size_t iov_len
    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    ssize_t recvmsg(int fd, msghdr* msg, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_WAITALL

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC

cdef enum:
    IOV_CHUNK = 512         # iovecs per sendmsg/recvmsg call (IOV_MAX is 1024)
    REQ_SIZE = 16           # REQ(magic u32, op u16, count u16, seq u32, reserved u32)
    ITEM_SIZE = 24          # ITEM(addr u64, length u64, rkey u32, reserved u32)
    RESP_SIZE = 24          # RESP(magic u32, op u16, count u16, seq u32, reserved u32, total u64)
    MAGIC = 0x58445248      # "HRDX"
    OP_READ = 1
    MAX_STATUS = 7          # Status.INVALID
    MAX_FRAME_ITEMS = 256   # tcp.MAX_ITEMS

cdef enum:
    ERR_OK = 0
    ERR_TIMEOUT = 1
    ERR_CHANNEL = 2

E_OK = ERR_OK
E_TIMEOUT = ERR_TIMEOUT
E_CHANNEL = ERR_CHANNEL


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline int _io_error() noexcept nogil:
    # SO_RCVTIMEO / SO_SNDTIMEO expiring on a blocking socket reads as EAGAIN.
    if errno == EAGAIN or errno == EWOULDBLOCK:
        return ERR_TIMEOUT
    return ERR_CHANNEL


cdef int _move_all(int fd, uint8_t* p, size_t n, bint receive) noexcept nogil:
    """Send or receive exactly ``n`` bytes at ``p``."""
    cdef ssize_t k
    while n:
        k = recv(fd, p, n, MSG_WAITALL) if receive else send(fd, p, n, MSG_NOSIGNAL)
        if k < 0:
            if errno == EINTR:
                continue
            return _io_error()
        if k == 0:
            return ERR_CHANNEL  # peer closed mid-frame
        p += k
        n -= <size_t>k
    return ERR_OK


cdef int _transfer_iov(int fd, iovec* iov, size_t count, bint receive) noexcept nogil:
    """Move every byte of ``iov[0:count]`` (all non-empty); partial calls resume in place."""
    cdef msghdr msg
    cdef ssize_t k
    cdef size_t i = 0
    cdef size_t left
    while i < count:
        msg.msg_name = NULL
        msg.msg_namelen = 0
        msg.msg_iov = &iov[i]
        msg.msg_iovlen = count - i if count - i < IOV_CHUNK else IOV_CHUNK
        msg.msg_control = NULL
        msg.msg_controllen = 0
        msg.msg_flags = 0
        if receive:
            k = recvmsg(fd, &msg, MSG_WAITALL)
        else:
            k = sendmsg(fd, &msg, MSG_NOSIGNAL)
        if k < 0:
            if errno == EINTR:
                continue
            return _io_error()
        if k == 0:
            return ERR_CHANNEL
        left = <size_t>k
        while left:
            if left >= iov[i].iov_len:
                left -= iov[i].iov_len
                i += 1
            else:
                iov[i].iov_base = <void*>(<uint8_t*>iov[i].iov_base + left)
                iov[i].iov_len -= left
                left = 0
    return ERR_OK


cdef inline void _put16(uint8_t* p, uint16_t v) noexcept nogil:
    memcpy(p, &v, 2)  # the wire is little-endian, as is every host this builds for


cdef inline void _put32(uint8_t* p, uint32_t v) noexcept nogil:
    memcpy(p, &v, 4)


cdef inline void _put64(uint8_t* p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)


cdef inline uint16_t _get16(const uint8_t* p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)
    return v


cdef inline uint32_t _get32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint64_t _get64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


def plan_frames(const uint64_t[::1] length, int max_items, uint64_t frame_bytes):
    """Cut items into frames of at most ``max_items`` items and ``frame_bytes`` payload
    bytes (an item is never split; one larger than ``frame_bytes`` travels alone).
    Returns the int64 start index of every frame followed by ``len(length)``.

    Runtime complexity: ``O(n)``.
    """
    cdef Py_ssize_t n = length.shape[0]
    out = np.empty(n + 1, dtype=np.int64)
    cdef int64_t[::1] starts = out
    cdef Py_ssize_t k, f = 0
    cdef int cnt = 0
    cdef uint64_t size = 0
    with nogil:
        for k in range(n):
            if cnt and (cnt == max_items or size + length[k] > frame_bytes):
                cnt = 0
                size = 0
            if cnt == 0:
                starts[f] = k
                f += 1
            cnt += 1
            size += length[k]
        starts[f] = n
    return out[: f + 1]


cdef int _send_requests(
    int fd, uint8_t* buf, const uint64_t* raddr, const uint32_t* rkey, const uint64_t* length,
    const int64_t* starts, Py_ssize_t first, Py_ssize_t last, uint32_t seq,
) noexcept nogil:
    """Frames ``first..last-1`` as one send; frame ``f`` carries sequence ``seq + f - first``."""
    cdef Py_ssize_t f, k
    cdef uint8_t* p = buf
    for f in range(first, last):
        _put32(p, MAGIC)
        _put16(p + 4, OP_READ)
        _put16(p + 6, <uint16_t>(starts[f + 1] - starts[f]))
        _put32(p + 8, <uint32_t>(seq + <uint32_t>(f - first)))
        _put32(p + 12, 0)
        p += REQ_SIZE
        for k in range(starts[f], starts[f + 1]):
            _put64(p, raddr[k])
            _put64(p + 8, length[k])
            _put32(p + 16, rkey[k])
            _put32(p + 20, 0)
            p += ITEM_SIZE
    return _move_all(fd, buf, <size_t>(p - buf), False)


cdef int _receive_frame(
    int fd, uint8_t* head, iovec* iov, const uint64_t* length, const uint64_t* laddr,
    Py_ssize_t a, Py_ssize_t b, uint32_t seq, uint8_t* status,
) noexcept nogil:
    """Receive the response to items ``a..b-1`` (sequence ``seq``) into their destinations;
    their statuses are written only once every byte of the frame has landed."""
    cdef Py_ssize_t count = b - a, k
    cdef int rc = _move_all(fd, head, RESP_SIZE + <size_t>count, True)
    if rc:
        return rc
    if (_get32(head) != MAGIC or _get16(head + 4) != OP_READ or _get16(head + 6) != count
            or _get32(head + 8) != seq):
        return ERR_CHANNEL  # the stream is out of step with our requests
    cdef uint64_t total = _get64(head + 16), expect = 0
    cdef size_t n_iov = 0
    cdef uint8_t code
    for k in range(count):
        code = head[RESP_SIZE + k]
        if code > MAX_STATUS:
            return ERR_CHANNEL
        if code == 0 and length[a + k]:
            expect += length[a + k]
            iov[n_iov].iov_base = <void*><uintptr_t>laddr[a + k]
            iov[n_iov].iov_len = <size_t>length[a + k]
            n_iov += 1
    if expect != total:
        return ERR_CHANNEL
    rc = _transfer_iov(fd, iov, n_iov, True)
    if rc:
        return rc
    memcpy(status + a, head + RESP_SIZE, <size_t>count)
    return ERR_OK


def read_frames(
    int fd,
    const uint64_t[::1] raddr,
    const uint32_t[::1] rkey,
    const uint64_t[::1] length,
    const uint64_t[::1] laddr,
    const int64_t[::1] starts,
    int window,
    uint32_t seq,
    double timeout,
    uint8_t[::1] status,
    object on_frame=None,
):
    """Run frames ``starts[0..]`` over the blocking socket ``fd`` with ``window`` requests
    in flight; item ``k``'s bytes land at ``laddr[k]`` and its status in ``status[k]``
    (items of frames not completed keep what ``status`` held). Frame ``f`` carries
    sequence ``seq + 1 + f``. The caller keeps every destination pinned.

    ``on_frame(a, b)``, when given, runs (with the GIL) as soon as the items ``a..b-1`` of
    a frame have landed and their statuses are written, while the next frames are already
    on the wire: the caller can use bytes still in cache. An exception from it ends the
    run and propagates once the buffers are freed.

    Returns ``(frames_done, error, last_seq)``; ``error`` is :data:`E_OK`,
    :data:`E_TIMEOUT` (also when ``timeout`` seconds pass between frames) or
    :data:`E_CHANNEL`. Runtime complexity: ``O(items + bytes)``, GIL released throughout.
    """
    cdef Py_ssize_t n_frames = starts.shape[0] - 1
    cdef Py_ssize_t n_items = raddr.shape[0]
    if rkey.shape[0] != n_items or length.shape[0] != n_items or laddr.shape[0] != n_items:
        raise ValueError("raddr, rkey, length and laddr must have the same length")
    if status.shape[0] != n_items:
        raise ValueError("status must have one byte per item")
    if n_frames < 1 or starts[0] != 0 or starts[n_frames] != n_items:
        raise ValueError("starts must run from 0 to the item count")
    if window < 1:
        raise ValueError("window must be positive")
    cdef Py_ssize_t f
    for f in range(n_frames):
        if not 0 < starts[f + 1] - starts[f] <= MAX_FRAME_ITEMS:
            raise ValueError(f"frame {f} must hold 1..{int(MAX_FRAME_ITEMS)} items")
    cdef uint8_t* req = <uint8_t*>malloc(<size_t>window * (REQ_SIZE + ITEM_SIZE * MAX_FRAME_ITEMS))
    cdef uint8_t* head = <uint8_t*>malloc(RESP_SIZE + MAX_FRAME_ITEMS)
    cdef iovec* iov = <iovec*>malloc(sizeof(iovec) * MAX_FRAME_ITEMS)
    if req == NULL or head == NULL or iov == NULL:
        free(req)
        free(head)
        free(iov)
        raise MemoryError()
    cdef Py_ssize_t done = 0, sent = 0, upto
    cdef int rc = ERR_OK
    cdef bint notify = on_frame is not None
    cdef object failure = None
    cdef double stop = _now() + timeout
    cdef uint32_t first_seq = seq + 1
    try:
        with nogil:
            while done < n_frames:
                if sent < n_frames and sent - done < window:
                    upto = min(n_frames, done + window)
                    rc = _send_requests(fd, req, &raddr[0], &rkey[0], &length[0], &starts[0], sent, upto,
                                        first_seq + <uint32_t>sent)
                    if rc:
                        break
                    sent = upto
                rc = _receive_frame(fd, head, iov, &length[0], &laddr[0], starts[done], starts[done + 1],
                                    first_seq + <uint32_t>done, &status[0])
                if rc:
                    break
                done += 1
                if notify:
                    with gil:
                        try:
                            on_frame(starts[done - 1], starts[done])
                        except BaseException as exc:  # re-raised below, after the frees
                            failure = exc
                    if failure is not None:
                        break
                if done < n_frames and _now() > stop:
                    rc = ERR_TIMEOUT
                    break
    finally:
        free(req)
        free(head)
        free(iov)
    if failure is not None:
        raise failure
    return done, rc, <uint32_t>(first_seq + <uint32_t>done - 1)


def send_response(int fd, const uint8_t[::1] head, const uint64_t[::1] src, const uint64_t[::1] length):
    """The responder's reply: ``head`` (response header and statuses) followed by
    ``length[k]`` bytes from the address ``src[k]`` of every served item (the caller
    passes only items whose status is OK, with their regions marked in flight).

    Returns an error code (:data:`E_OK`, :data:`E_TIMEOUT`, :data:`E_CHANNEL`).
    Runtime complexity: ``O(items + bytes)``, GIL released throughout.
    """
    cdef Py_ssize_t n = src.shape[0], k
    if length.shape[0] != n:
        raise ValueError("src and length must have the same length")
    cdef iovec* iov = <iovec*>malloc(sizeof(iovec) * (n + 1))
    if iov == NULL:
        raise MemoryError()
    cdef size_t n_iov = 0
    cdef int rc
    try:
        with nogil:
            if head.shape[0]:
                iov[0].iov_base = <void*>&head[0]
                iov[0].iov_len = <size_t>head.shape[0]
                n_iov = 1
            for k in range(n):
                if length[k]:
                    iov[n_iov].iov_base = <void*><uintptr_t>src[k]
                    iov[n_iov].iov_len = <size_t>length[k]
                    n_iov += 1
            rc = _transfer_iov(fd, iov, n_iov, False)
    finally:
        free(iov)
    return rc
