from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.libibverbs cimport ibv_srq, ibv_recv_wr

cdef class SharedReceiveQueue(VerbsObject):
    cdef ibv_srq *srq
    cdef readonly ProtectionDomain pd
    cdef readonly int max_wr
    cdef readonly int max_sge
    cdef _post(self, ibv_recv_wr *wr)
