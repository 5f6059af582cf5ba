"""Common base of every verbs object: explicit lifetimes and parent/child tracking.

Each object keeps strong references to its parents and weak references to its children;
``close()`` closes children first, so any teardown order is safe and nothing depends on
garbage-collection order.
"""
cimport cython
from posix.time cimport clock_gettime, CLOCK_MONOTONIC, timespec
import itertools
import weakref

from pyrdma.errors import RDMAError, UsageError

_creation_order = itertools.count()


@cython.no_gc_clear
cdef class VerbsObject:
    def __cinit__(self, *args, **kwargs):
        self._children = weakref.WeakValueDictionary()
        self._parents = []
        # Closed until a subclass's __init__ succeeds (registering with its parent opens it), so an
        # object made with __new__ or whose __init__ failed is never used with a NULL handle.
        self._closed = True

    cdef _add_child(self, VerbsObject child):
        self._children[next(_creation_order)] = child
        child._parents.append(self)
        child._closed = False

    cdef int _destroy(self) except -1:
        return 0

    cdef int _check_open(self) except -1:
        if self._closed:
            raise UsageError(f"{type(self).__name__} is closed (or was never opened)", obj=repr(self))
        return 0

    cpdef close(self):
        """Release the verbs resource, closing every child first. Idempotent."""
        if self._closed:
            return
        for key in sorted(self._children.keys(), reverse=True):
            child = self._children.get(key)
            if child is not None:
                (<VerbsObject>child).close()
        self._destroy()
        self._closed = True

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Attributes:
    """A read-only record of attributes returned by a query (device, port, QP)."""

    def __init__(self, kind, **fields):
        self.__dict__["_kind"] = kind
        self.__dict__.update(fields)

    def __setattr__(self, name, value):
        raise AttributeError(f"{self._kind} attributes are read-only")

    def as_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "_kind"}

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"{self._kind}({body})"


cdef int raise_errno(str call, int err, object obj=None) except -1:
    from pyrdma.errors import raise_errno as _raise
    _raise(call, err, obj)
    return -1


cdef double monotonic_now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
