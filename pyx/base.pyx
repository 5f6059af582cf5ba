"""Common base of every verbs object: explicit lifetimes and parent/child tracking.

Each object keeps strong references to its parents and weak references to its children;
``close()`` closes children first, so any teardown order is safe and nothing depends on
garbage-collection order.
"""
cimport cython
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, EINTR, EAGAIN
from cpython.pythread cimport PyThread_get_thread_ident
from posix.time cimport clock_gettime, CLOCK_MONOTONIC, timespec
from posix.unistd cimport usleep
import itertools
import weakref

from pyrdma.errors import RDMAError, RDMATimeoutError, UsageError

# A blocked wait looks at the closing flags and runs Python's signal handlers this often.
cdef int WAIT_SLICE_MS = 50

_creation_order = itertools.count(1)


@cython.no_gc_clear
cdef class VerbsObject:
    def __cinit__(self, *args, **kwargs):
        self._children = {}
        self._parents = []
        self._serial = next(_creation_order)
        # Closed until a subclass's __init__ succeeds, so an object made with __new__ or whose
        # __init__ failed is never used with a NULL handle.
        self._closed = True

    cdef int _begin_init(self) except -1:
        if self._initialised:
            raise UsageError(f"{type(self).__name__} is already initialised; create a new object",
                             obj=repr(self))
        self._initialised = True
        return 0

    cdef int _adopt(self, VerbsObject child) except -1:
        self._check_open()
        self._children[child._serial] = weakref.ref(child)
        child._parents.append(self)
        return 0

    cdef int _abandon(self) except -1:
        # the creation failed: forget the parents it was adopted by
        for parent in self._parents:
            (<VerbsObject>parent)._children.pop(self._serial, None)
        self._parents = []
        return 0

    # Each subclass writes out its own creation (adopt, the one C call, release; on NULL _abandon and
    # raise) and _destroy (the one C call on its handle, the handle NULLed, raise on failure): the
    # same shape in pd.pyx, cq.pyx, srq.pyx, ah.pyx, mw.pyx, mr.pyx and qp.pyx, kept as many copies
    # on purpose. A shared one would take the handle as void * and the call as a function pointer,
    # and the line a reader looks for, which verbs call makes or destroys this object, would be gone.
    cdef int _destroy(self) except -1:
        return 0

    cdef int _check_open(self) except -1:
        if self._closed or self._closing:
            return refuse(self)
        return 0

    cpdef close(self):
        """Release the verbs resource, closing every child first. Idempotent and thread-safe.

        Calls blocked on this object in another thread (poll_wait, wait, posts) are woken and raise
        UsageError; close() waits for them (GIL released) before destroying the handle."""
        cdef long me
        if self._closed:
            return
        me = PyThread_get_thread_ident()
        if self._closing:
            if self._closer != me:      # another thread is closing it: return once it is closed
                while not self._closed:
                    with nogil:
                        usleep(1000)
            return
        pyrdma_store_flag(&self._closing, 1)
        self._closer = me
        error = None
        try:
            while self._users > 0:      # blocked calls see _closing within ~50 ms and leave
                with nogil:
                    usleep(200)
            # No child can be added now (creation needs a use() of this parent), so the copy is complete.
            children = self._children.copy()
            for key in sorted(children, reverse=True):
                child = children[key]()
                if child is not None:
                    try:
                        (<VerbsObject>child).close()
                    except BaseException as exc:
                        error = error or exc
            try:
                self._destroy()
            except BaseException as exc:
                error = error or exc
        finally:
            # A failed destroy leaves the handle NULL too: the object is closed whatever happened.
            self._closed = True
            for parent in self._parents:
                (<VerbsObject>parent)._children.pop(self._serial, None)
        if error is not None:
            raise error

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


cdef int adopt(VerbsObject child, list parents) except -1:
    """Register ``child`` with each of ``parents`` (distinct, open) and use() each, so that none can be
    destroyed while the child's handle is created; release(parents) right after the C call. A close()
    of a parent waits for that, then finds the child among its children."""
    cdef VerbsObject parent
    try:
        for parent in parents:
            parent._adopt(child)
    except BaseException:
        child._abandon()
        raise
    # From the checks to release(): C only, so no finalizer can run and close a parent in use.
    for parent in parents:
        if parent._closed or parent._closing:
            child._abandon()
            return refuse(parent)
    for parent in parents:
        parent._users += 1
    return 0


cdef void release(list parents) noexcept:
    for parent in parents:
        unuse(<VerbsObject>parent)


cdef int refuse(VerbsObject obj) except -1:
    if obj._closed:
        raise UsageError(f"{type(obj).__name__} is closed (or was never opened)", obj=repr(obj))
    raise UsageError(f"{type(obj).__name__} is closed (closing)", obj=repr(obj))


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


cdef double wait_seconds(object timeout) except? -2.0:
    """A wait's ``timeout`` argument as wait_fd takes it: None is -1 (forever), a negative is 0."""
    if timeout is None:
        return -1.0
    return max(0.0, <double>timeout)


cdef int wait_fd(int fd, double timeout, fd_take_t take, void *arg, VerbsObject owner, VerbsObject also,
                 const long long *wake, str call, str take_call, bint raise_timeout=False) except -1:
    """The one interruptible wait on an event fd (completion channel, async events, CM channel).

    poll()s ``fd`` in slices of WAIT_SLICE_MS without the GIL; when it is readable, ``take(arg)`` runs,
    still without the GIL, and reads the event. Between slices: ``owner`` (and ``also``) closing from
    another thread raises UsageError("closed while waiting"), Python's signal handlers run
    (PyErr_CheckSignals, as pyzmq does, so Ctrl-C raises KeyboardInterrupt), and a nonzero ``*wake``
    returns at once. ``timeout`` in seconds, negative for none (wait_seconds). Returns 1 when take()
    got an event, 2 when woken, 0 on timeout, or raises RDMATimeoutError if ``raise_timeout``.
    Both objects are registered as in use (use()) only while the GIL is released over their handles."""
    cdef pollfd pfd
    cdef int rc, ms, err, got
    cdef double deadline = -1.0 if timeout < 0 else monotonic_now() + timeout
    cdef double left
    pfd.fd = fd
    pfd.events = POLLIN
    while True:
        if wake != NULL and wake[0] > 0:
            return 2
        if deadline < 0:
            ms = WAIT_SLICE_MS
        else:
            left = (deadline - monotonic_now()) * 1000.0
            ms = <int>min(max(0.0, left), <double>WAIT_SLICE_MS)
        if owner._closing or (also is not None and also._closing):
            raise UsageError("closed while waiting", call=call, obj=repr(owner))
        use(owner)
        if also is not None:
            try:
                use(also)
            except BaseException:
                unuse(owner)
                raise
        err = got = 0
        with nogil:
            rc = poll(&pfd, 1, ms)
            if rc < 0:
                err = errno
            elif rc > 0:
                got = take(arg)
                if got < 0:
                    err = -got
                    got = 0
        if also is not None:
            unuse(also)
        unuse(owner)
        if got:
            return 1
        if err and err != EINTR and err != EAGAIN:   # EAGAIN: another waiter took the event
            raise_errno("poll" if rc < 0 else take_call, err, repr(owner))
        if owner._closing or (also is not None and also._closing):
            raise UsageError("closed while waiting", call=call, obj=repr(owner))
        if deadline >= 0 and monotonic_now() >= deadline:
            if wake != NULL and wake[0] > 0:
                return 2
            if raise_timeout:
                raise RDMATimeoutError(f"no event within {timeout:g} s", call=call, obj=repr(owner))
            return 0
        PyErr_CheckSignals()   # Ctrl-C raises KeyboardInterrupt here (pyzmq's pattern)
