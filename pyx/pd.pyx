"""Protection domain: the scope of MRs, QPs, SRQs and AHs."""
cimport cython
from libc.errno cimport errno
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno
from pyrdma._verbs.device cimport Context


@cython.no_gc_clear
cdef class ProtectionDomain(VerbsObject):
    def __init__(self, Context context not None):
        context._check_open()
        self.pd = ibv_alloc_pd(context.ctx)
        if self.pd == NULL:
            raise_errno("ibv_alloc_pd", errno, repr(context))
        self.context = context
        context._add_child(self)

    def __dealloc__(self):
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.pd != NULL:
            rc = ibv_dealloc_pd(self.pd)
            self.pd = NULL
            if rc:
                raise_errno("ibv_dealloc_pd", rc, repr(self))
        return 0

    def __repr__(self):
        return f"<ProtectionDomain on {self.context.name}{' closed' if self._closed else ''}>"
