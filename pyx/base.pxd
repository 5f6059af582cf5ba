from libc.stdint cimport uint64_t

cdef extern from "<poll.h>" nogil:
    cdef struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum: POLLIN

cdef extern from "pyrdma_guard.h" nogil:
    int pyrdma_load_flag(const int *p)
    void pyrdma_store_flag(int *p, int v)
    void pyrdma_bump_word(uint64_t *p)

cdef class VerbsObject:
    cdef object __weakref__
    cdef dict _children        # child serial -> weakref to the child (serials follow creation order)
    cdef list _parents         # strong refs, so a parent is never freed before its child
    cdef readonly long long _serial
    cdef bint _closed
    cdef bint _initialised     # __init__ ran once: a second call would overwrite (leak) the handle
    # close() sets _closing, waits until _users is 0, closes the children, then destroys. _users
    # counts calls that run with the GIL released over this object's handle; they register (use())
    # only around C code, never around Python code, so close() never waits on its own thread.
    cdef int _closing
    cdef int _users
    cdef long _closer          # thread running close(), so a nested close on that thread returns
    cdef int _begin_init(self) except -1
    cdef int _adopt(self, VerbsObject child) except -1
    cdef int _abandon(self) except -1
    cdef int _destroy(self) except -1
    cdef int _check_open(self) except -1
    cpdef close(self)

cdef int refuse(VerbsObject obj) except -1
cdef int adopt(VerbsObject child, list parents) except -1
cdef void release(list parents) noexcept


cdef inline int use(VerbsObject obj) except -1:
    """Register a call about to use ``obj``'s handle without the GIL; refused once closing."""
    if obj._closed or obj._closing:
        return refuse(obj)
    obj._users += 1
    return 0


cdef inline void unuse(VerbsObject obj) noexcept:
    obj._users -= 1


cdef int raise_errno(str call, int err, object obj=*) except -1
cdef double monotonic_now() noexcept nogil


# wait_fd's "take one event" step, run without the GIL once the fd is readable: 1 when it took an
# event, 0 when there was none after all, -errno on failure (-EAGAIN: another waiter took it).
ctypedef int (*fd_take_t)(void *arg) noexcept nogil

cdef double wait_seconds(object timeout) except? -2.0
cdef int wait_fd(int fd, double timeout, fd_take_t take, void *arg, VerbsObject owner, VerbsObject also,
                 const long long *wake, str call, str take_call, bint raise_timeout=*) except -1
