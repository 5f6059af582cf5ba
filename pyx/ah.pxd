from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.libibverbs cimport ibv_ah

cdef class AddressHandle(VerbsObject):
    cdef ibv_ah *ah
    cdef readonly ProtectionDomain pd
    cdef _create(self, ProtectionDomain pd, int dlid, bytes gid, int port, sgid_index, bint is_global, int hop_limit)
