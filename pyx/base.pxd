cdef class VerbsObject:
    cdef object __weakref__
    cdef object _children      # WeakValueDictionary: creation order -> child
    cdef object _parents       # strong refs, so a parent is never freed before its child
    cdef bint _closed
    cdef _add_child(self, VerbsObject child)
    cdef int _destroy(self) except -1
    cdef int _check_open(self) except -1
    cpdef close(self)

cdef int raise_errno(str call, int err, object obj=*) except -1
cdef double monotonic_now() noexcept nogil
