"""Protection domain: the scope of MRs, QPs, SRQs and AHs."""
cimport cython
from libc.errno cimport errno
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release
from pyrdma._verbs.device cimport Context


@cython.no_gc_clear
cdef class ProtectionDomain(VerbsObject):
    def __init__(self, Context context not None):
        cdef int err = 0
        self._begin_init()
        parents = [context]
        adopt(self, parents)
        self.context = context
        self.pd = ibv_alloc_pd(context.ctx)
        if self.pd != NULL:
            self._closed = False
        else:
            err = errno
        release(parents)
        if self.pd == NULL:
            self._abandon()
            raise_errno("ibv_alloc_pd", err, repr(context))

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.pd != NULL:
            rc = ibv_dealloc_pd(self.pd)
            self.pd = NULL
            if rc:
                raise_errno("ibv_dealloc_pd", rc, repr(self))
        return 0

    def __repr__(self):
        name = self.context.name if self.context is not None else "?"
        return f"<ProtectionDomain on {name}{' closed' if self._closed else ''}>"
