from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.cq cimport CompletionQueue
from pyrdma._verbs.srq cimport SharedReceiveQueue
from pyrdma._verbs.libibverbs cimport ibv_qp, ibv_qp_init_attr, ibv_send_wr, ibv_recv_wr, ibv_qp_attr, ibv_sge
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.wr cimport SendWR

cdef class QueuePair(VerbsObject):
    cdef ibv_qp *qp
    cdef readonly ProtectionDomain pd
    cdef readonly CompletionQueue send_cq
    cdef readonly CompletionQueue recv_cq
    cdef readonly SharedReceiveQueue srq
    cdef readonly int qp_type
    cdef readonly unsigned int qp_num
    cdef readonly unsigned int psn
    cdef readonly int port
    cdef readonly int gid_index
    cdef readonly unsigned int max_inline_data
    cdef readonly dict cap
    cdef readonly object remote
    cdef int _state
    # A QP that librdmacm created on a CM id (rdma_create_qp): destroyed through _cm_destroy_qp(_cm_id)
    cdef void *_cm_id
    cdef void (*_cm_destroy_qp)(void *cm_id) noexcept nogil
    cdef ibv_qp *_create(self, ProtectionDomain pd, ibv_qp_init_attr *attr) noexcept
    cdef int _create_failed(self, int err, str what) except -1
    cdef int _require_rts(self, str what) except -1
    cdef int _post_send(self, ibv_send_wr *wr, list ahs=*) except -1
    cdef int _post_recv(self, ibv_recv_wr *wr) except -1
    cdef int _post_send_ahs(self, ibv_send_wr *chain, list owners) except -1
    cdef _modify(self, ibv_qp_attr *attr, int mask, str what)
    cdef _check_wr(self, SendWR wr)
    cdef _post_atomic(self, int opcode, MemoryRegion mr, Py_ssize_t offset, unsigned long long remote_addr, unsigned int rkey, unsigned long long compare_add, unsigned long long swap, unsigned long long wr_id, bint signaled)
    cdef int _fill_local(self, ibv_send_wr *wr, ibv_sge *sge, MemoryRegion mr, Py_ssize_t offset, Py_ssize_t length, unsigned long long wr_id, bint signaled, bint inline) except -1

cdef QueuePair wrap_cm_qp(ibv_qp *qp, void *cm_id, void (*destroy)(void *) noexcept nogil, list parents,
                          ProtectionDomain pd, CompletionQueue send_cq, CompletionQueue recv_cq,
                          SharedReceiveQueue srq, int port, dict cap)
