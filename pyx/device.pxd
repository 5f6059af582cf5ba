from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.libibverbs cimport ibv_context, ibv_async_event, ibv_pd

cdef class Context(VerbsObject):
    cdef ibv_context *ctx
    cdef readonly str name
    cdef object _device_attr
    cdef dict _port_attr
    cdef dict _best_gid
    cdef bint _borrowed        # another library's context (librdmacm's): closing it only forgets it
    cdef bint _has_active_port(self)
    cdef int _check_port(self, int port) except -1
    cdef object _take_event(self, ibv_async_event *ev)

cdef Context borrow_context(ibv_context *ctx)
cdef bint reg_dmabuf_mr_works(ibv_pd *pd) noexcept
