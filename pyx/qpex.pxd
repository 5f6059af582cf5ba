from pyrdma._verbs.qp cimport QueuePair
from pyrdma._verbs.libibverbs cimport ibv_qp_ex

cdef class QueuePairEx(QueuePair):
    # the batch between wr_start() and wr_complete()
    cdef ibv_qp_ex *qpx
    cdef readonly unsigned long long send_ops
    cdef bint _wr_open
    cdef bint _wr_needs_data
    cdef bint _wr_needs_addr    # UD: the last operation has no wr_set_ud_addr yet
    cdef bint _wr_inline        # the last operation was flagged SEND_INLINE: its data comes inline
    cdef list _wr_keep
    cdef int _wr_op(self, unsigned long long op, void *fn, str name, unsigned long long wr_id, unsigned int flags, bint data) except -1
    cdef int _wr_data(self, void *fn, str name) except -1
