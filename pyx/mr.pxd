from cpython.buffer cimport Py_buffer
from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.libibverbs cimport ibv_mr

cdef class MemoryRegion(VerbsObject):
    cdef ibv_mr *mr
    cdef Py_buffer view
    cdef bint has_view
    cdef readonly ProtectionDomain pd
    cdef readonly object buffer     # the registered object (kept alive while registered)
    cdef readonly int access
    cdef readonly bint is_device_memory
    # hot-path copies of the C fields, valid after close() for bounds checks
    cdef readonly unsigned long long addr
    cdef readonly size_t length
    cdef readonly unsigned int lkey
    cdef readonly unsigned int rkey
    cdef _register(self, ProtectionDomain pd, void *addr, size_t length, int access, object owner)
    cdef _finish(self, ProtectionDomain pd, int access, object owner, list parents)
    cdef _release_view(self)
