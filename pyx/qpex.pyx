"""The extended post API (ibv_wr_*): a QueuePair created with ibv_create_qp_ex whose work requests are
built operation by operation in batches, as pyverbs' QPEx. Everything else (states, post_*, lifetime) is
the QueuePair's."""
cimport cython
from libc.string cimport memset
from libc.stdint cimport uint32_t, uint64_t
import contextlib
import enum
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport raise_errno
from pyrdma._verbs.loader cimport require_entry_point, PYRDMA_DL_VERBS
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.qp cimport QueuePair
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.ah cimport AddressHandle
from pyrdma._verbs.mw cimport MemoryWindow
from pyrdma._verbs.wr cimport fill_sge, imm_data_be

from pyrdma._verbs.qp import DEFAULT_QKEY
from pyrdma.errors import UsageError


class SendOps(enum.IntFlag):
    """ibv_qp_create_send_ops_flags: the ibv_wr_* operations a QueuePairEx offers."""
    RDMA_WRITE = IBV_QP_EX_WITH_RDMA_WRITE
    RDMA_WRITE_WITH_IMM = IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    SEND = IBV_QP_EX_WITH_SEND
    SEND_WITH_IMM = IBV_QP_EX_WITH_SEND_WITH_IMM
    RDMA_READ = IBV_QP_EX_WITH_RDMA_READ
    ATOMIC_CMP_AND_SWP = IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    ATOMIC_FETCH_AND_ADD = IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    LOCAL_INV = IBV_QP_EX_WITH_LOCAL_INV
    BIND_MW = IBV_QP_EX_WITH_BIND_MW
    SEND_WITH_INV = IBV_QP_EX_WITH_SEND_WITH_INV


_ALL_SEND_OPS = SendOps(0)
for _op in SendOps:
    _ALL_SEND_OPS |= _op


@cython.no_gc_clear
cdef class QueuePairEx(QueuePair):
    """A QueuePair with the extended post API (ibv_create_qp_ex): one batch at a time, wr_start(), then
    per work request an operation followed by its data (wr_set_sge / wr_set_inline_data, and
    wr_set_ud_addr on UD), then wr_complete() posts them all; ``with qp.wr_batch():`` does the three.
    The provider's op pointers are NULL for operations the QP was not created with: refused here."""

    def __init__(self, ProtectionDomain pd not None, int qp_type, send_cq, *args, send_ops, **kwargs):
        """QueuePair's arguments, and ``send_ops`` (SendOps flags): the ibv_wr_* operations it offers."""
        if self._initialised:
            self._begin_init()    # refuses a second __init__ before it could change send_ops
        send_ops = int(send_ops)
        if send_ops & ~int(_ALL_SEND_OPS) or send_ops <= 0:
            raise UsageError(f"send_ops 0x{send_ops:x}: use one or more pyrdma.SendOps flags")
        require_entry_point(PYRDMA_DL_VERBS, "ibv_qp_to_qp_ex", "ibv_create_qp_ex")
        self.send_ops = send_ops
        QueuePair.__init__(self, pd, qp_type, send_cq, *args, **kwargs)

    def __dealloc__(self):
        # Its own, though QueuePair's does the same: Cython clears this class's fields (_wr_keep,
        # which may hold the last reference to an MR) before it runs the base's __dealloc__, so the
        # batch is aborted and the QP destroyed here, while everything it points at is alive.
        self.close()

    cdef ibv_qp *_create(self, ProtectionDomain pd, ibv_qp_init_attr *attr) noexcept:
        cdef ibv_qp_init_attr_ex attrx
        cdef ibv_qp *qp
        memset(&attrx, 0, sizeof(attrx))
        attrx.send_cq, attrx.recv_cq, attrx.srq = attr.send_cq, attr.recv_cq, attr.srq
        attrx.cap = attr.cap
        attrx.qp_type, attrx.sq_sig_all = attr.qp_type, attr.sq_sig_all
        attrx.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
        attrx.pd = pd.pd
        attrx.send_ops_flags = self.send_ops
        qp = ibv_create_qp_ex(pd.context.ctx, &attrx)
        if qp != NULL:
            self.qpx = ibv_qp_to_qp_ex(qp)
            attr.cap = attrx.cap    # what the device granted
        return qp

    cdef int _create_failed(self, int err, str what) except -1:
        return raise_errno("ibv_create_qp_ex", err, f"{what} with send_ops {SendOps(self.send_ops)!r}")

    cdef int _destroy(self) except -1:
        if self.qpx != NULL and self._wr_open:
            ibv_wr_abort(self.qpx)
            self._wr_open = False
        self.qpx = NULL
        self._wr_keep = None
        return QueuePair._destroy(self)

    def wr_start(self):
        """Open a batch of work requests (ibv_wr_start)."""
        if self.qpx == NULL or self._closing or self._state < IBV_QPS_RTS:
            self._require_rts("post")
        if self._wr_open:
            raise UsageError("wr_start() inside an open batch; wr_complete() or wr_abort() it first", obj=repr(self))
        ibv_wr_start(self.qpx)
        self._wr_open = True
        self._wr_needs_data = self._wr_needs_addr = False
        self._wr_keep = []

    def wr_complete(self):
        """Post the batch (ibv_wr_complete); on an error none of it is posted."""
        cdef int rc
        if not self._wr_open:
            raise UsageError("wr_complete() without wr_start()", obj=repr(self))
        if self._wr_needs_data or self._wr_needs_addr:
            self.wr_abort()
            raise UsageError("the last work request of the batch has no "
                             f"{'data (wr_set_sge / wr_set_inline_data)' if self._wr_needs_data else 'destination (wr_set_ud_addr)'}"
                             "; the batch was aborted", obj=repr(self))
        self._users += 1
        with nogil:
            rc = ibv_wr_complete(self.qpx)
        self._users -= 1
        self._wr_open = False
        self._wr_keep = None
        if rc:
            raise_errno("ibv_wr_complete", rc, repr(self))

    def wr_abort(self):
        """Drop the open batch (ibv_wr_abort); nothing of it is posted."""
        if self._wr_open and self.qpx != NULL:
            ibv_wr_abort(self.qpx)
        self._wr_open = False
        self._wr_keep = None

    def wr_batch(self):
        """``with qp.wr_batch(): ...``: wr_start() on entry, wr_complete() on exit, wr_abort() on an exception."""
        return _wr_batch(self)

    cdef int _wr_op(self, unsigned long long op, void *fn, str name, unsigned long long wr_id, unsigned int flags,
                    bint data) except -1:
        if not self._wr_open:
            if self.qpx == NULL:
                self._check_open()
            raise UsageError(f"{name}() outside a batch; call wr_start() first", obj=repr(self))
        if not self.send_ops & op or fn == NULL:
            raise UsageError(f"{name}() needs {SendOps(op)!r} in the QP's send_ops", obj=repr(self))
        if self._wr_needs_data or self._wr_needs_addr:
            raise UsageError(f"{name}(): the previous work request has no "
                             f"{'data yet (wr_set_sge / wr_set_inline_data)' if self._wr_needs_data else 'destination (wr_set_ud_addr)'}",
                             obj=repr(self))
        if flags & ~(IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE):
            raise UsageError(f"unknown send flags 0x{flags:x}; use pyrdma.SEND_*", obj=repr(self))
        self.qpx.wr_id = wr_id
        self.qpx.wr_flags = flags
        self._wr_needs_data = data
        self._wr_needs_addr = self.qp_type == IBV_QPT_UD
        self._wr_inline = flags & IBV_SEND_INLINE != 0
        return 0

    cdef int _wr_data(self, void *fn, str name) except -1:
        if not self._wr_open or not self._wr_needs_data:
            raise UsageError(f"{name}() must follow an operation that takes data, inside a batch", obj=repr(self))
        if fn == NULL:
            raise UsageError(f"{name}() is not offered by this device's provider", obj=repr(self))
        return 0

    def wr_rdma_write(self, uint32_t rkey, uint64_t remote_addr, uint64_t wr_id=0,
                      unsigned int flags=IBV_SEND_SIGNALED, imm=None):
        """RDMA WRITE (WITH_IMM when ``imm`` is given); its data follows."""
        if imm is None:
            self._wr_op(IBV_QP_EX_WITH_RDMA_WRITE, self.qpx.wr_rdma_write if self.qpx else NULL,
                        "wr_rdma_write", wr_id, flags, True)
            ibv_wr_rdma_write(self.qpx, rkey, remote_addr)
        else:
            self._wr_op(IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, self.qpx.wr_rdma_write_imm if self.qpx else NULL,
                        "wr_rdma_write", wr_id, flags, True)
            ibv_wr_rdma_write_imm(self.qpx, rkey, remote_addr, imm_data_be(imm))

    def wr_rdma_read(self, uint32_t rkey, uint64_t remote_addr, uint64_t wr_id=0,
                     unsigned int flags=IBV_SEND_SIGNALED):
        """RDMA READ into the SGE that follows."""
        self._wr_op(IBV_QP_EX_WITH_RDMA_READ, self.qpx.wr_rdma_read if self.qpx else NULL, "wr_rdma_read",
                    wr_id, flags, True)
        ibv_wr_rdma_read(self.qpx, rkey, remote_addr)

    def wr_send(self, uint64_t wr_id=0, unsigned int flags=IBV_SEND_SIGNALED, imm=None, invalidate_rkey=None):
        """SEND (WITH_IMM when ``imm`` is given, WITH_INV with ``invalidate_rkey``); its data follows."""
        if imm is not None and invalidate_rkey is not None:
            raise UsageError("a send carries imm or invalidate_rkey, not both", obj=repr(self))
        if imm is not None:
            self._wr_op(IBV_QP_EX_WITH_SEND_WITH_IMM, self.qpx.wr_send_imm if self.qpx else NULL, "wr_send",
                        wr_id, flags, True)
            ibv_wr_send_imm(self.qpx, imm_data_be(imm))
        elif invalidate_rkey is not None:
            self._wr_op(IBV_QP_EX_WITH_SEND_WITH_INV, self.qpx.wr_send_inv if self.qpx else NULL, "wr_send",
                        wr_id, flags, True)
            ibv_wr_send_inv(self.qpx, <uint32_t>invalidate_rkey)
        else:
            self._wr_op(IBV_QP_EX_WITH_SEND, self.qpx.wr_send if self.qpx else NULL, "wr_send", wr_id, flags, True)
            ibv_wr_send(self.qpx)

    def wr_atomic_fetch_add(self, uint32_t rkey, uint64_t remote_addr, uint64_t add, uint64_t wr_id=0,
                            unsigned int flags=IBV_SEND_SIGNALED):
        """Atomic fetch-and-add; an 8-byte SGE for the old value follows."""
        if remote_addr % 8:
            raise UsageError("atomics need an 8-byte aligned remote address", obj=repr(self))
        self._wr_op(IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD, self.qpx.wr_atomic_fetch_add if self.qpx else NULL,
                    "wr_atomic_fetch_add", wr_id, flags, True)
        ibv_wr_atomic_fetch_add(self.qpx, rkey, remote_addr, add)

    def wr_atomic_cmp_swp(self, uint32_t rkey, uint64_t remote_addr, uint64_t compare, uint64_t swap,
                          uint64_t wr_id=0, unsigned int flags=IBV_SEND_SIGNALED):
        """Atomic compare-and-swap; an 8-byte SGE for the old value follows."""
        if remote_addr % 8:
            raise UsageError("atomics need an 8-byte aligned remote address", obj=repr(self))
        self._wr_op(IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, self.qpx.wr_atomic_cmp_swp if self.qpx else NULL,
                    "wr_atomic_cmp_swp", wr_id, flags, True)
        ibv_wr_atomic_cmp_swp(self.qpx, rkey, remote_addr, compare, swap)

    def wr_local_inv(self, uint32_t invalidate_rkey, uint64_t wr_id=0, unsigned int flags=IBV_SEND_SIGNALED):
        """LOCAL_INV of a type 2 window's (or an MR's) rkey."""
        self._wr_op(IBV_QP_EX_WITH_LOCAL_INV, self.qpx.wr_local_inv if self.qpx else NULL, "wr_local_inv",
                    wr_id, flags, False)
        ibv_wr_local_inv(self.qpx, invalidate_rkey)

    def wr_bind_mw(self, MemoryWindow mw not None, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length,
                   int access=IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, uint64_t wr_id=0,
                   unsigned int flags=IBV_SEND_SIGNALED):
        """BIND_MW of a type 2 window to mr[offset:offset+length]; returns the window's new rkey."""
        cdef ibv_mw_bind_info info
        cdef uint32_t rkey
        mw._check_open()
        mr._check_open()
        if mw.type != IBV_MW_TYPE_2:
            raise UsageError("wr_bind_mw binds type 2 windows; bind type 1 with bind_mw()", obj=repr(self))
        if mw.pd is not self.pd or mr.pd is not self.pd:
            raise UsageError("the window and the MR must belong to the QP's protection domain", obj=repr(self))
        if not mr.access & IBV_ACCESS_MW_BIND:
            raise UsageError("the MR was registered without ACCESS_MW_BIND", obj=repr(mr))
        if access & ~(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC):
            raise UsageError(f"window access 0x{access:x}: use ACCESS_REMOTE_* flags", obj=repr(self))
        if offset < 0 or length <= 0 or <size_t>offset > mr.length or <size_t>length > mr.length - offset:
            raise UsageError(f"window [{offset}, {offset}+{length}) is outside the MR of {mr.length} bytes",
                             obj=repr(self))
        self._wr_op(IBV_QP_EX_WITH_BIND_MW, self.qpx.wr_bind_mw if self.qpx else NULL, "wr_bind_mw", wr_id,
                    flags, False)
        info.mr = mr.mr
        info.addr = mr.addr + offset
        info.length = length
        info.mw_access_flags = access
        rkey = ibv_inc_rkey(mw.mw.rkey)
        ibv_wr_bind_mw(self.qpx, mw.mw, rkey, &info)
        self._wr_keep.append(mw)
        self._wr_keep.append(mr)
        mw._set_bound(mr, info.addr, length, rkey, self)
        return rkey

    def wr_set_sge(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length):
        """The data of the last operation: mr[offset:offset+length]."""
        cdef ibv_sge sge
        self._wr_data(self.qpx.wr_set_sge if self.qpx else NULL, "wr_set_sge")
        if self._wr_inline:   # the provider would send its (empty) inline buffer instead
            raise UsageError("wr_set_sge() after an operation flagged SEND_INLINE; use wr_set_inline_data()",
                             obj=repr(self))
        fill_sge(&sge, mr, offset, length)
        self._wr_keep.append(mr)
        ibv_wr_set_sge(self.qpx, sge.lkey, sge.addr, sge.length)
        self._wr_needs_data = False

    def wr_set_inline_data(self, data):
        """The data of the last operation, copied into the work request now (at most max_inline_data bytes)."""
        cdef Py_buffer view
        self._wr_data(self.qpx.wr_set_inline_data if self.qpx else NULL, "wr_set_inline_data")
        if not self._wr_inline:   # without the flag the provider reads the data as an SGE list
            raise UsageError("wr_set_inline_data() needs the operation flagged SEND_INLINE "
                             "(flags=SEND_SIGNALED | SEND_INLINE)", obj=repr(self))
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if <size_t>view.len > self.max_inline_data:
                raise UsageError(f"inline data of {view.len} bytes exceeds max_inline_data={self.max_inline_data}",
                                 obj=repr(self))
            ibv_wr_set_inline_data(self.qpx, view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        self._wr_needs_data = False

    def wr_set_ud_addr(self, AddressHandle ah not None, uint32_t remote_qpn, uint32_t remote_qkey=DEFAULT_QKEY):
        """The destination of the last operation on a UD QP."""
        if self.qp_type != IBV_QPT_UD:
            raise UsageError("wr_set_ud_addr is for UD QPs", obj=repr(self))
        if not self._wr_open or self.qpx.wr_set_ud_addr == NULL:
            raise UsageError("wr_set_ud_addr() must follow an operation, inside a batch", obj=repr(self))
        ah._check_open()
        if ah.pd is not self.pd:
            raise UsageError(f"{ah!r} belongs to another protection domain than the QP's {self.pd!r}", obj=repr(self))
        self._wr_keep.append(ah)
        ibv_wr_set_ud_addr(self.qpx, ah.ah, remote_qpn, remote_qkey)
        self._wr_needs_addr = False


@contextlib.contextmanager
def _wr_batch(QueuePairEx qp):
    qp.wr_start()
    try:
        yield qp
    except BaseException:
        qp.wr_abort()
        raise
    qp.wr_complete()
