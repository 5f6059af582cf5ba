from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.librdmacm cimport rdma_event_channel, rdma_cm_id

cdef class CMEventChannel(VerbsObject):
    cdef rdma_event_channel *channel
    cdef object _lookup(self, long long serial)

cdef class CMID(VerbsObject):
    cdef rdma_cm_id *id
    cdef readonly CMEventChannel channel
    cdef readonly int ps
    cdef readonly object request       # the CONNECT_REQUEST event that made this id (passive side)
    cdef bint _own_channel             # synchronous id: its private channel, waited on by its calls
    cdef object _qp_ref                # weakref to the QueuePair made by create_qp
    cdef int _call(self, int rc, int err, str call) except -1
