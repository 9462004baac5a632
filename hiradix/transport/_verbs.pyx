# cython: language_level=3
"""A small binding over rdma-core's libibverbs: what the RDMA transport needs, nothing more.

Built only where ``infiniband/verbs.h`` exists (Debian: ``libibverbs-dev``), against public
symbols only (the inline helpers of the header, ``ibv_post_send`` and ``ibv_poll_cq``,
call through the provider's function table, which is how every verbs application does it).

- :func:`device_names`, :class:`Device` (context + protection domain + port attributes),
  :class:`MemoryRegion` (an MR over existing host memory; it keeps the owner alive),
  :class:`QueuePair` (an RC queue pair with its own completion queue; RESET -> INIT ->
  RTR -> RTS from the peer's description ``(qp_num, psn, lid, gid, mtu)``).
- :meth:`QueuePair.read_batch` posts chained ``IBV_WR_RDMA_READ`` work requests, at most
  ``depth`` outstanding (the send queue's size: flow control), signalling every
  ``signal_every``-th and the last of each post, and polls completions in batches, all
  with the GIL released. Completions are matched by ``wr_id`` (the item's index); RC
  completes in order, so a successful completion of item ``k`` means every item before
  ``k`` has landed. Per-item statuses are :class:`hiradix.transport.base.Status` values.
- :class:`WrChain` builds and links ``n`` READ work requests into a preallocated array
  without posting them: the fill cost measured by ``bench/verbs_post.py`` on machines with
  no RDMA device, and the very routine :meth:`QueuePair.read_batch` posts from.
"""

from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset, strerror

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC

cdef extern from "infiniband/verbs.h" nogil:
    struct ibv_device:
        pass
    struct ibv_context:
        pass
    struct ibv_pd:
        pass
    struct ibv_cq:
        pass
    struct ibv_srq:
        pass
    struct ibv_comp_channel:
        pass
    struct ibv_mr:
        void* addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    struct ibv_qp:
        uint32_t qp_num
        int state
    struct ibv_port_attr:
        int state
        int active_mtu
        uint16_t lid
        uint8_t link_layer
    struct ibv_device_attr:
        int max_qp_wr
        int max_cqe
        int max_qp_rd_atom
    union ibv_gid:
        uint8_t raw[16]
    struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class
    struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num
    struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data
    struct ibv_qp_init_attr:
        void* qp_context
        ibv_cq* send_cq
        ibv_cq* recv_cq
        ibv_srq* srq
        ibv_qp_cap cap
        int qp_type
        int sq_sig_all
    struct ibv_qp_attr:
        int qp_state
        int path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry
    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey
    struct ibv_send_wr_rdma:
        uint64_t remote_addr
        uint32_t rkey
    union ibv_send_wr_wr:
        ibv_send_wr_rdma rdma
    struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr* next
        ibv_sge* sg_list
        int num_sge
        int opcode
        unsigned int send_flags
        ibv_send_wr_wr wr
    struct ibv_wc:
        uint64_t wr_id
        int status
        uint32_t vendor_err

    enum:
        IBV_PORT_ACTIVE
        IBV_LINK_LAYER_ETHERNET
        IBV_QPT_RC
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR
        IBV_QP_STATE
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_ACCESS_FLAGS
        IBV_QP_DEST_QPN
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_WR_RDMA_READ
        IBV_SEND_SIGNALED
        IBV_WC_SUCCESS
        IBV_WC_LOC_LEN_ERR
        IBV_WC_LOC_PROT_ERR
        IBV_WC_LOC_ACCESS_ERR
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_REM_ACCESS_ERR
        IBV_WC_REM_INV_REQ_ERR
        IBV_WC_RETRY_EXC_ERR
        IBV_WC_RNR_RETRY_EXC_ERR

    ibv_device** ibv_get_device_list(int* num_devices)
    void ibv_free_device_list(ibv_device** lst)
    const char* ibv_get_device_name(ibv_device* device)
    ibv_context* ibv_open_device(ibv_device* device)
    int ibv_close_device(ibv_context* context)
    int ibv_query_device(ibv_context* context, ibv_device_attr* attr)
    int ibv_query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr)
    int ibv_query_gid(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid)
    ibv_pd* ibv_alloc_pd(ibv_context* context)
    int ibv_dealloc_pd(ibv_pd* pd)
    ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr* mr)
    ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context,
                          ibv_comp_channel* channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq* cq)
    ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr)
    int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask)
    int ibv_destroy_qp(ibv_qp* qp)
    int ibv_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr)
    int ibv_poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc)
    const char* ibv_wc_status_str(int status)


# Per-item statuses: the values of hiradix.transport.base.Status (checked by a test).
cdef enum:
    ST_OK = 0
    ST_BAD_RKEY = 1
    ST_OUT_OF_BOUNDS = 2
    ST_PEER_UNREACHABLE = 3
    ST_TIMEOUT = 4
    ST_CHANNEL_ERROR = 5
    ST_BAD_LOCAL = 6
    ST_INVALID = 7

# Why read_batch stopped early (see QueuePair.read_batch).
cdef enum:
    C_NONE = 0
    C_REMOTE_ACCESS = 1
    C_CHANNEL = 2
    C_TIMEOUT = 3

cdef enum:
    POLL_BATCH = 32         # completions taken per ibv_poll_cq call
    DRAIN_SECONDS = 2       # bound on draining flushed WRs after a QP error
    SPINS_BEFORE_YIELD = 64  # empty polls before giving the core away once

STATUS_OK = ST_OK
CAUSE_NONE = C_NONE
CAUSE_REMOTE_ACCESS = C_REMOTE_ACCESS
CAUSE_CHANNEL = C_CHANNEL
CAUSE_TIMEOUT = C_TIMEOUT
#: libibverbs' port state ACTIVE and the QP states, for the transport's state machine.
PORT_ACTIVE = IBV_PORT_ACTIVE
QPS_RESET = IBV_QPS_RESET
QPS_INIT = IBV_QPS_INIT
QPS_RTR = IBV_QPS_RTR
QPS_RTS = IBV_QPS_RTS
QPS_ERR = IBV_QPS_ERR


class VerbsError(OSError):
    """A verbs call failed (the message names the call and the errno)."""


cdef int _raise(str call, int err) except -1:
    raise VerbsError(err, f"{call} failed: {strerror(err).decode()}")


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline uint8_t _map_wc(int wc_status) noexcept nogil:
    """The per-item Status of a failed completion."""
    if wc_status == IBV_WC_REM_ACCESS_ERR:
        # The responder's NIC refused the rkey or the range. The transport checks both
        # against the peer's published table before posting, so what reaches the NIC and
        # fails is a region deregistered since: a stale rkey.
        return ST_BAD_RKEY
    if wc_status == IBV_WC_LOC_PROT_ERR or wc_status == IBV_WC_LOC_ACCESS_ERR:
        return ST_BAD_LOCAL
    if wc_status == IBV_WC_LOC_LEN_ERR or wc_status == IBV_WC_REM_INV_REQ_ERR:
        return ST_INVALID
    if wc_status == IBV_WC_RETRY_EXC_ERR or wc_status == IBV_WC_RNR_RETRY_EXC_ERR:
        return ST_PEER_UNREACHABLE  # no ACK within the retry budget: the peer is gone
    return ST_CHANNEL_ERROR


def device_names():
    """Names of the RDMA devices libibverbs sees (``[]`` with no device or no kernel
    support). Runtime complexity: ``O(devices)``."""
    cdef int n = 0
    cdef ibv_device** lst = ibv_get_device_list(&n)
    if lst == NULL:
        return []
    try:
        return [ibv_get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        ibv_free_device_list(lst)


def wc_status_str(int status):
    """libibverbs' text for a work-completion status."""
    return ibv_wc_status_str(status).decode()


cdef int _fill_chain(ibv_send_wr* wrs, ibv_sge* sges, int64_t n, uint64_t first_id,
                     const uint64_t* laddr, const uint64_t* raddr, const uint64_t* length,
                     const uint32_t* rkey, const uint32_t* lkey, int64_t signal_every,
                     bint signal_last) noexcept nogil:
    """Build and link ``n`` READ work requests (``wr_id = first_id + i``), signalling
    every ``signal_every``-th by id and, with ``signal_last``, the last one."""
    cdef int64_t i
    cdef uint64_t wid
    cdef ibv_send_wr* wr
    for i in range(n):
        wid = first_id + <uint64_t>i
        sges[i].addr = laddr[i]
        sges[i].length = <uint32_t>length[i]
        sges[i].lkey = lkey[i]
        wr = &wrs[i]
        wr.wr_id = wid
        wr.next = &wrs[i + 1]
        wr.sg_list = &sges[i]
        wr.num_sge = 1
        wr.opcode = IBV_WR_RDMA_READ
        wr.send_flags = IBV_SEND_SIGNALED if (wid + 1) % <uint64_t>signal_every == 0 else 0
        wr.wr.rdma.remote_addr = raddr[i]
        wr.wr.rdma.rkey = rkey[i]
    if n:
        wrs[n - 1].next = NULL
        if signal_last:
            wrs[n - 1].send_flags = IBV_SEND_SIGNALED
    return 0


cdef class WrChain:
    """A preallocated array of ``capacity`` READ work requests and their scatter entries.

    :meth:`fill` builds and links a chain in it without posting (no device needed): the
    cost per work request of the post path, measured apart from the NIC.
    """

    cdef ibv_send_wr* wrs
    cdef ibv_sge* sges
    cdef readonly int64_t capacity

    def __cinit__(self, int64_t capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.wrs = <ibv_send_wr*>calloc(capacity, sizeof(ibv_send_wr))
        self.sges = <ibv_sge*>calloc(capacity, sizeof(ibv_sge))
        if self.wrs == NULL or self.sges == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.wrs)
        free(self.sges)

    def fill(self, const uint64_t[::1] laddr, const uint64_t[::1] raddr, const uint64_t[::1] length,
             const uint32_t[::1] rkey, const uint32_t[::1] lkey, int64_t signal_every=16, int64_t repeat=1):
        """Build and link the chain of ``len(laddr)`` items, ``repeat`` times over, with
        the GIL released; returns the number of work requests built. ``O(n * repeat)``."""
        cdef int64_t n = laddr.shape[0]
        cdef int64_t _r
        if n > self.capacity:
            raise ValueError(f"{n} items do not fit a chain of {self.capacity}")
        if raddr.shape[0] != n or length.shape[0] != n or rkey.shape[0] != n or lkey.shape[0] != n:
            raise ValueError("columns must have the same length")
        if signal_every < 1 or repeat < 0:
            raise ValueError("signal_every must be positive and repeat non-negative")
        if n == 0:
            return 0
        with nogil:
            for _r in range(repeat):
                _fill_chain(self.wrs, self.sges, n, 0, &laddr[0], &raddr[0], &length[0], &rkey[0],
                            &lkey[0], signal_every, True)
        return n * repeat

    def describe(self, int64_t i):
        """``(wr_id, remote_addr, rkey, local_addr, length, lkey, signalled, linked)`` of
        work request ``i``, for tests."""
        if not 0 <= i < self.capacity:
            raise IndexError(i)
        cdef ibv_send_wr* wr = &self.wrs[i]
        return (wr.wr_id, wr.wr.rdma.remote_addr, wr.wr.rdma.rkey, wr.sg_list.addr if wr.sg_list else 0,
                wr.sg_list.length if wr.sg_list else 0, wr.sg_list.lkey if wr.sg_list else 0,
                bool(wr.send_flags & IBV_SEND_SIGNALED), wr.next != NULL)


cdef class Device:
    """An opened RDMA device: context, protection domain, and one port's addressing.

    ``name=None`` takes the first device. Raises :class:`VerbsError` when there is none
    or it cannot be opened.
    """

    cdef ibv_context* ctx
    cdef ibv_pd* pd
    cdef readonly str name
    cdef readonly int ib_port
    cdef readonly int gid_index
    cdef readonly int lid
    cdef readonly bytes gid
    cdef readonly int mtu
    cdef readonly bint port_active
    cdef readonly bint ethernet
    cdef readonly int max_qp_wr
    cdef readonly int max_qp_rd_atom
    cdef readonly int max_cqe

    def __cinit__(self, name=None, int ib_port=1, int gid_index=0):
        cdef int n = 0
        cdef ibv_device** lst = ibv_get_device_list(&n)
        cdef ibv_device* dev = NULL
        cdef ibv_port_attr pattr
        cdef ibv_device_attr dattr
        cdef ibv_gid gid
        if lst == NULL or n == 0:
            if lst != NULL:
                ibv_free_device_list(lst)
            raise VerbsError(errno, "no RDMA device (ibv_get_device_list found none)")
        try:
            for i in range(n):
                if name is None or ibv_get_device_name(lst[i]).decode() == name:
                    dev = lst[i]
                    break
            if dev == NULL:
                raise VerbsError(0, f"no RDMA device named {name!r}")
            self.name = ibv_get_device_name(dev).decode()
            self.ctx = ibv_open_device(dev)
            if self.ctx == NULL:
                _raise("ibv_open_device", errno)
        finally:
            ibv_free_device_list(lst)
        self.ib_port = ib_port
        self.gid_index = gid_index
        memset(&pattr, 0, sizeof(pattr))
        memset(&dattr, 0, sizeof(dattr))
        rc = ibv_query_port(self.ctx, <uint8_t>ib_port, &pattr)
        if rc:
            _raise("ibv_query_port", rc)
        rc = ibv_query_device(self.ctx, &dattr)
        if rc:
            _raise("ibv_query_device", rc)
        rc = ibv_query_gid(self.ctx, <uint8_t>ib_port, gid_index, &gid)
        if rc:
            _raise("ibv_query_gid", rc)
        self.lid = pattr.lid
        self.mtu = pattr.active_mtu
        self.port_active = pattr.state == IBV_PORT_ACTIVE
        self.ethernet = pattr.link_layer == IBV_LINK_LAYER_ETHERNET
        self.gid = (<char*>gid.raw)[:16]
        self.max_qp_wr = dattr.max_qp_wr
        self.max_qp_rd_atom = dattr.max_qp_rd_atom
        self.max_cqe = dattr.max_cqe
        self.pd = ibv_alloc_pd(self.ctx)
        if self.pd == NULL:
            _raise("ibv_alloc_pd", errno)

    def reg_mr(self, owner, uintptr_t addr, size_t length, bint remote):
        """Register ``length`` bytes at ``addr`` (memory ``owner`` keeps alive) for local
        writes and, with ``remote``, remote READs. ``O(pages)`` in the kernel."""
        cdef int access = IBV_ACCESS_LOCAL_WRITE | (IBV_ACCESS_REMOTE_READ if remote else 0)
        cdef ibv_mr* mr
        if self.pd == NULL:
            raise VerbsError(0, "device is closed")
        with nogil:
            mr = ibv_reg_mr(self.pd, <void*>addr, length, access)
        if mr == NULL:
            _raise("ibv_reg_mr", errno)
        m = MemoryRegion.__new__(MemoryRegion)
        (<MemoryRegion>m).mr = mr
        (<MemoryRegion>m).owner = owner
        (<MemoryRegion>m).device = self
        return m

    def create_qp(self, int depth, uint32_t psn):
        """A new RC queue pair in INIT with a completion queue of its own, starting at
        ``psn``; ``depth`` send work requests at most outstanding (capped by the device)."""
        return QueuePair._new(self, depth, psn)

    def close(self):
        """Free the protection domain and close the device (after every QP and MR)."""
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL

    def __dealloc__(self):
        self.close()


cdef class MemoryRegion:
    """A registered memory region; holds the owner of the memory until :meth:`dereg`."""

    cdef ibv_mr* mr
    cdef object owner
    cdef Device device

    def __init__(self):
        raise TypeError("made by Device.reg_mr")

    @property
    def lkey(self):
        return self.mr.lkey if self.mr != NULL else 0

    @property
    def rkey(self):
        return self.mr.rkey if self.mr != NULL else 0

    def dereg(self, timeout=None):
        """Deregister: once this returns the NIC no longer touches the memory (reads of it
        in flight fail with a remote access error). Idempotent; ``timeout`` is unused (the
        kernel call is synchronous)."""
        if self.mr != NULL:
            rc = ibv_dereg_mr(self.mr)
            if rc:
                _raise("ibv_dereg_mr", rc)
            self.mr = NULL
            self.owner = None

    def __dealloc__(self):
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)


cdef class QueuePair:
    """An RC queue pair and its completion queue, driven by one thread at a time."""

    cdef ibv_qp* qp
    cdef ibv_cq* cq
    cdef Device device
    cdef ibv_send_wr* wrs
    cdef ibv_sge* sges
    cdef ibv_wc* wcs
    cdef readonly int depth
    cdef readonly uint32_t psn
    cdef readonly int state

    def __init__(self):
        raise TypeError("made by Device.create_qp")

    @staticmethod
    cdef QueuePair _new(Device device, int depth, uint32_t psn):
        cdef QueuePair self = QueuePair.__new__(QueuePair)
        cdef ibv_qp_init_attr init
        if device.ctx == NULL:
            raise VerbsError(0, "device is closed")
        if depth < 1:
            raise ValueError(f"depth must be positive, got {depth}")
        if depth > device.max_qp_wr:
            depth = device.max_qp_wr
        self.device = device
        self.depth = depth
        self.wrs = <ibv_send_wr*>calloc(depth, sizeof(ibv_send_wr))
        self.sges = <ibv_sge*>calloc(depth, sizeof(ibv_sge))
        self.wcs = <ibv_wc*>calloc(POLL_BATCH, sizeof(ibv_wc))
        if self.wrs == NULL or self.sges == NULL or self.wcs == NULL:
            raise MemoryError()
        self.cq = ibv_create_cq(device.ctx, depth, NULL, NULL, 0)
        if self.cq == NULL:
            _raise("ibv_create_cq", errno)
        memset(&init, 0, sizeof(init))
        init.send_cq = self.cq
        init.recv_cq = self.cq
        init.cap.max_send_wr = depth
        init.cap.max_recv_wr = 1
        init.cap.max_send_sge = 1
        init.cap.max_recv_sge = 1
        init.qp_type = IBV_QPT_RC
        init.sq_sig_all = 0
        self.qp = ibv_create_qp(device.pd, &init)
        if self.qp == NULL:
            _raise("ibv_create_qp", errno)
        self.state = IBV_QPS_RESET
        self.reset(psn)
        return self

    @property
    def qp_num(self):
        return self.qp.qp_num

    def desc(self):
        """This end's description for the peer: ``(qp_num, psn, lid, gid, mtu)``."""
        return (self.qp.qp_num, self.psn, self.device.lid, self.device.gid, self.device.mtu)

    cdef int _modify(self, ibv_qp_attr* attr, int mask, str what) except -1:
        rc = ibv_modify_qp(self.qp, attr, mask)
        if rc:
            self.state = IBV_QPS_ERR
            _raise(f"ibv_modify_qp({what})", rc)
        self.state = attr.qp_state
        return 0

    def reset(self, uint32_t psn):
        """Any state -> RESET -> INIT, starting again at ``psn`` (24 bits; flushed WRs are
        dropped with the RESET); :meth:`connect` brings it back up."""
        cdef ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RESET
        self._modify(&attr, IBV_QP_STATE, "RESET")
        self._drain_cq()
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_INIT
        attr.pkey_index = 0
        attr.port_num = <uint8_t>self.device.ib_port
        attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
        self._modify(&attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT")
        self.psn = psn & 0xFFFFFF

    def connect(self, uint32_t qp_num, uint32_t psn, int lid, bytes gid, int mtu):
        """INIT -> RTR -> RTS towards the peer's queue pair ``qp_num`` (its ``psn``,
        ``lid``, 16-byte ``gid`` and active ``mtu``; the smaller MTU is used)."""
        cdef ibv_qp_attr attr
        if len(gid) != 16:
            raise ValueError("gid must be 16 bytes")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTR
        attr.path_mtu = min(mtu, self.device.mtu)
        attr.dest_qp_num = qp_num
        attr.rq_psn = psn
        attr.max_dest_rd_atomic = <uint8_t>max(1, min(self.device.max_qp_rd_atom, 16))
        attr.min_rnr_timer = 12
        attr.ah_attr.dlid = <uint16_t>lid
        attr.ah_attr.port_num = <uint8_t>self.device.ib_port
        if self.device.ethernet or any(gid):
            # RoCE needs the GRH; on InfiniBand it is harmless when a GID is known.
            attr.ah_attr.is_global = 1
            memcpy(attr.ah_attr.grh.dgid.raw, <const char*>gid, 16)
            attr.ah_attr.grh.sgid_index = <uint8_t>self.device.gid_index
            attr.ah_attr.grh.hop_limit = 64
        self._modify(&attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
                     | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTS
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = <uint8_t>max(1, min(self.device.max_qp_rd_atom, 16))
        self._modify(&attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY
                     | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS")

    cdef void _drain_cq(self) noexcept nogil:
        while ibv_poll_cq(self.cq, POLL_BATCH, self.wcs) > 0:
            pass

    cdef int64_t _run(self, int64_t n, const uint64_t* laddr, const uint64_t* raddr, const uint64_t* length,
                      const uint32_t* rkey, const uint32_t* lkey, uint8_t* status, int64_t signal_every,
                      double deadline, int* cause) noexcept nogil:
        """The GIL-free loop of :meth:`read_batch`; returns the first item not OK.

        Every item starts as CHANNEL_ERROR (what a flushed or never-posted item reports)
        and becomes OK only when a completion at or after it succeeds.
        """
        cdef int64_t posted = 0, done = 0, m, i, k, first_bad = n, idx
        cdef int got, rc, spins = 0, wc
        cdef ibv_send_wr* bad = NULL
        cdef ibv_qp_attr attr
        cdef bint stopped = False  # no more posts: an error, a timeout or a failed post
        cause[0] = C_NONE
        memset(status, ST_CHANNEL_ERROR, n)
        while done < posted or (not stopped and posted < n):
            if not stopped and posted < n and posted - done < self.depth:
                # Flow control: never more than depth WRs outstanding on the send queue.
                m = min(<int64_t>self.depth - (posted - done), n - posted)
                _fill_chain(self.wrs, self.sges, m, <uint64_t>posted, &laddr[posted], &raddr[posted],
                            &length[posted], &rkey[posted], &lkey[posted], signal_every, True)
                bad = NULL
                rc = ibv_post_send(self.qp, self.wrs, &bad)
                if rc:
                    # The WRs before the bad one were posted; the rest never will be.
                    if bad != NULL:
                        posted += bad - self.wrs
                    stopped = True
                    first_bad = min(first_bad, posted)
                    cause[0] = C_CHANNEL
                else:
                    posted += m
            got = ibv_poll_cq(self.cq, POLL_BATCH, self.wcs)
            if got < 0:
                first_bad = min(first_bad, done)
                cause[0] = C_CHANNEL
                break
            for k in range(got):
                idx = <int64_t>self.wcs[k].wr_id
                if idx < done or idx >= posted:
                    continue  # not one of this batch's outstanding WRs
                wc = self.wcs[k].status
                if wc == IBV_WC_SUCCESS:
                    # RC completes in order: every item up to idx has landed.
                    for i in range(done, min(idx + 1, first_bad)):
                        status[i] = ST_OK
                elif wc != IBV_WC_WR_FLUSH_ERR and idx < first_bad:
                    for i in range(done, idx):
                        status[i] = ST_OK
                    status[idx] = _map_wc(wc)
                    first_bad = idx
                    cause[0] = C_REMOTE_ACCESS if wc == IBV_WC_REM_ACCESS_ERR else C_CHANNEL
                    stopped = True  # the QP is in ERR: the rest comes back flushed
                elif first_bad == n:
                    first_bad = done  # flushed with no error seen: the QP was moved to ERR
                    cause[0] = C_CHANNEL
                    stopped = True
                done = idx + 1
            if got:
                spins = 0
            else:
                spins += 1
                if spins >= SPINS_BEFORE_YIELD:
                    spins = 0
                    sched_yield()
            if (done < posted or posted < n and not stopped) and _now() > deadline:
                if cause[0] == C_TIMEOUT or cause[0] != C_NONE and stopped:
                    break  # the flushes never came back: the caller resets or destroys the QP
                # Move the QP to ERR so the NIC stops writing into our destinations, then
                # give the flushes a bounded time to come back.
                memset(&attr, 0, sizeof(attr))
                attr.qp_state = IBV_QPS_ERR
                ibv_modify_qp(self.qp, &attr, IBV_QP_STATE)
                memset(&status[done], ST_TIMEOUT, n - done)
                first_bad = min(first_bad, done)
                cause[0] = C_TIMEOUT
                stopped = True
                deadline = _now() + DRAIN_SECONDS
        return first_bad

    def read_batch(self, const uint64_t[::1] laddr, const uint64_t[::1] raddr, const uint64_t[::1] length,
                   const uint32_t[::1] rkey, const uint32_t[::1] lkey, uint8_t[::1] status,
                   int64_t signal_every, double timeout):
        """RDMA READ item ``i``: ``length[i]`` bytes from ``raddr[i]`` (peer region
        ``rkey[i]``) to ``laddr[i]`` (local region ``lkey[i]``), at most :attr:`depth`
        outstanding, with the GIL released; fills ``status`` (Status values).

        Returns ``(first_bad, cause)``: items before ``first_bad`` are OK; ``cause`` is
        :data:`CAUSE_NONE` (all OK), :data:`CAUSE_REMOTE_ACCESS` (item ``first_bad`` was
        refused by the peer's NIC; the rest were flushed as CHANNEL_ERROR and may be
        posted again once the QP is reset), :data:`CAUSE_CHANNEL` (the QP broke) or
        :data:`CAUSE_TIMEOUT` (``timeout`` seconds passed; the QP was moved to ERR so no
        byte lands after this returns). After any cause but NONE the QP is in ERR.
        Runtime complexity: ``O(n)`` work requests.
        """
        cdef int64_t n = laddr.shape[0]
        cdef int cause = C_NONE
        cdef int64_t first_bad
        cdef double deadline
        if raddr.shape[0] != n or length.shape[0] != n or rkey.shape[0] != n or lkey.shape[0] != n \
                or status.shape[0] != n:
            raise ValueError("columns must have the same length")
        if signal_every < 1:
            raise ValueError("signal_every must be positive")
        if self.state != IBV_QPS_RTS:
            raise VerbsError(0, f"queue pair is not ready to send (state {self.state})")
        if n == 0:
            return 0, C_NONE
        deadline = _now() + timeout
        with nogil:
            first_bad = self._run(n, &laddr[0], &raddr[0], &length[0], &rkey[0], &lkey[0], &status[0],
                                  signal_every, deadline, &cause)
        if cause != C_NONE:
            self.state = IBV_QPS_ERR
        return first_bad, cause

    def close(self):
        """Destroy the queue pair and its completion queue. Idempotent."""
        if self.qp != NULL:
            ibv_destroy_qp(self.qp)
            self.qp = NULL
        if self.cq != NULL:
            ibv_destroy_cq(self.cq)
            self.cq = NULL

    def __dealloc__(self):
        self.close()
        free(self.wrs)
        free(self.sges)
        free(self.wcs)
