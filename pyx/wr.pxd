from libc.stdint cimport uint32_t
from pyrdma._verbs.libibverbs cimport ibv_send_wr, ibv_recv_wr, ibv_sge
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.ah cimport AddressHandle

cdef class SGE:
    cdef ibv_sge sge
    cdef readonly object mr     # keeps the registered memory alive while the SGE exists

cdef class _WorkRequest:
    cdef ibv_sge *sges
    cdef list keepalive
    cdef int _take_sg_list(self, sg_list) except -1

cdef class SendWR(_WorkRequest):
    cdef ibv_send_wr wr
    cdef readonly AddressHandle ah   # a UD send's handle: checked open (and its pointer taken) at post time

cdef class RecvWR(_WorkRequest):
    cdef ibv_recv_wr wr

cdef class _WorkRequestSlots:
    cdef ibv_sge *sges
    cdef readonly int capacity
    cdef readonly int max_sge
    cdef readonly int count
    cdef list keepalive
    cdef int _allocate(self, int capacity, int max_sge, size_t wr_size) except -1
    cdef ibv_sge *_copy_sges(self, int i, ibv_sge *sges, int num_sge) except NULL
    cdef int _fill_count(self, offsets) except -1

cdef class SendWRList(_WorkRequestSlots):
    cdef ibv_send_wr *wrs
    cdef int n_ah                    # slots holding a SendWR with an AddressHandle
    cdef int _hold(self, int i, object obj) except -1

cdef class RecvWRList(_WorkRequestSlots):
    cdef ibv_recv_wr *wrs

cdef int fill_sge(ibv_sge *sge, MemoryRegion mr, Py_ssize_t offset, Py_ssize_t length) except -1
cdef uint32_t imm_data_be(imm) except? 0
