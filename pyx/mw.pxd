from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.libibverbs cimport ibv_mw

cdef class MemoryWindow(VerbsObject):
    cdef ibv_mw *mw
    cdef readonly ProtectionDomain pd
    cdef readonly int type
    # the MR bound last (kept alive while bound) and its range; None when unbound
    cdef readonly object bound_mr
    cdef readonly object bound_qp    # type 2: the QP that bound it (the device pins that QP until unbound)
    cdef readonly unsigned long long addr
    cdef readonly unsigned long long length
    cdef int _set_bound(self, object mr, unsigned long long addr, unsigned long long length, unsigned int rkey, object qp=*) except -1
    cdef int _reparent(self, object old, object new) except -1
