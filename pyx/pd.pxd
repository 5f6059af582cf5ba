from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.device cimport Context
from pyrdma._verbs.libibverbs cimport ibv_pd

cdef class ProtectionDomain(VerbsObject):
    cdef ibv_pd *pd
    cdef readonly Context context
