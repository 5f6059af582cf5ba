# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The one-call path of the blocking collectives on host memory, over RDMA or TCP (pyrdma._hostcalls).

A warm blocking allreduce, reduce, broadcast, allgather, reduce-scatter, all-to-all, gather, scatter,
barrier, send or recv of host memory is one C call: HostCollectives takes the buffer by the buffer
protocol, finds the call prepared for its shape (pyrdma.collectives.hostplans makes each HostCall
from the general path's own spec of the call: one plan, one description), and runs the copy in, the
engine's schedule (pyx/engine.pyx) and the copy out without the GIL, under the executor's ExecLock. Python runs only
to prepare a new shape, register new memory and raise errors; what a method does not take (it
returns None) goes the Communicator's general way.
"""
cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_C_CONTIGUOUS
from cpython.bytes cimport PyBytes_FromString, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.long cimport PyLong_AsLongAndOverflow
from cpython.pythread cimport (PyThread_get_thread_ident, PyThread_type_lock, PyThread_allocate_lock,
                               PyThread_free_lock, PyThread_release_lock, PyLockStatus, PY_LOCK_ACQUIRED)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, free
from posix.time cimport timespec, clock_gettime, CLOCK_MONOTONIC
from posix.types cimport clockid_t, time_t, pid_t
from posix.unistd cimport getpid
from libc.string cimport memcmp, memcpy, memmove, strcmp
from pyrdma._verbs.base cimport monotonic_now
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._engine cimport Engine, HostRegion, Program, DESC_SIZE, FAIL_NONE

from numpy import ndarray as _ndarray, empty as _empty, empty_like as _empty_like

from pyrdma.errors import UsageError

cdef extern from "pythread.h":
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds, int intr_flag) nogil

cdef double SIGNAL_CHECK = 0.05     # how often a wait for the lock runs the signal handlers
# A blocking point-to-point message of at most this many bytes runs holding the GIL until it has to
# wait (Engine._execute_holding_gil): an inline send that posts and returns never releases it. A
# GIL release and retake cost about as much as a Python call, which in the VM is ~1 us of a 30 us
# ping-pong; larger copies leave the GIL to other threads, as every run did before.
cdef int64_t HOLD_GIL_BYTES = 65536

# Where a HostCall works: through the transport's buffer (a copy in and out), or in the caller's
# memory: its input (an allreduce in place; a scatter's root sends from it), its output (a gather's
# root receives into it) or both, the input first and the output from ``nbytes`` on (an all-to-all).
cdef enum:
    _LENT_NONE = 0
    _LENT_IN = 1
    _LENT_OUT = 2
    _LENT_BOTH = 3
LENT_NONE, LENT_IN, LENT_OUT, LENT_BOTH = _LENT_NONE, _LENT_IN, _LENT_OUT, _LENT_BOTH

# op="avg" in the transport's buffer (as specs' Avg): floating-point inputs divided by n after the
# copy in, with the bits of work.prescale (float32 and float64: one IEEE division each; bfloat16
# through float32, to nearest even; float16 through float32, toward zero: _scale_half), integer
# results after the run, before the copy out (truncated, as pyrdma._reduce.divide)
cdef enum:
    _AVG_NONE = 0
    _AVG_SCALE = 1
    _AVG_DIVIDE = 2
AVG_NONE, AVG_SCALE, AVG_DIVIDE = _AVG_NONE, _AVG_SCALE, _AVG_DIVIDE

cdef extern from "pyrdma_reduce.h" nogil:
    int pyrdma_divide(void *buf, size_t count, int dtype, int64_t n)
    const size_t pyrdma_itemsize[8]
    float pyrdma_half_to_float(uint16_t h)
    uint16_t pyrdma_float_to_half(float f)

cdef extern from "<math.h>" nogil:
    float fabsf(float x)

cdef int FLOAT16_CODE = 4           # pyrdma._reduce's


cdef void _scale_half(uint16_t *p, size_t count, int64_t n) noexcept nogil:
    """p[i] /= n for float16 as avg.scale_down does it: through float32, rounded to nearest, then
    one step back toward zero where that rounded away from it (so n scaled values cannot sum past
    the largest half where their mean is finite)."""
    cdef size_t i
    cdef float q, d = <float>n
    cdef uint16_t r
    for i in range(count):
        q = pyrdma_half_to_float(p[i]) / d
        r = pyrdma_float_to_half(q)
        if fabsf(pyrdma_half_to_float(r)) > fabsf(q):
            r -= 1
        p[i] = r


@cython.final
cdef class HostCall:
    """A blocking collective on host memory, prepared once by the Communicator (for an allreduce,
    per buffer format, size, op and algorithm: hostplans.allreduce): the Program, the description
    (whose call number HostCollectives patches per call), the reduction codes, and the work area:
    the transport's own buffer (``work_region``), with a copy in (``nbytes`` at ``in_offset``) and a
    copy out (``out_bytes``, default nbytes, from ``result_offset``); or the caller's memory
    (``lent``, a LENT_ kind; ``work_region`` None), whose input has ``nbytes`` and output
    ``out_bytes``. ``own``: (from, to, length) of a copy before the run (an all-to-all's,
    gather's or scatter's own block, which no message carries): within the transport's buffer, or
    from the caller's input to its output (to the input itself where the call has no output).
    ``rdesc``: an exchange's (a send and a receive at once) description of what it receives.
    ``avg``: (AVG_SCALE or AVG_DIVIDE, n) of an op="avg" through the transport's buffer."""
    cdef Program program
    cdef uint8_t desc[DESC_SIZE]
    cdef uint8_t rdesc[DESC_SIZE]                    # an exchange's receive description (has_rdesc)
    cdef bint has_rdesc
    cdef int dtype, op, lent
    cdef int64_t nbytes, result_offset, work_bytes, in_offset, out_bytes
    cdef int64_t own_from, own_to, own_len
    cdef object work_region                          # a MemoryRegion (RDMA) or HostRegion (TCP)
    cdef int avg_kind                                # AVG_
    cdef int64_t avg_n

    def __init__(self, Program program not None, bytes desc not None, int dtype, int op, int64_t nbytes,
                 int64_t result_offset, int64_t work_bytes, work_region=None, own=(0, 0, 0),
                 int64_t in_offset=0, int64_t out_bytes=-1, int lent=-1, bytes rdesc=None, avg=(_AVG_NONE, 0)):
        cdef int64_t area
        if len(desc) != DESC_SIZE or (rdesc is not None and len(rdesc) != DESC_SIZE):
            raise UsageError(f"a description has {DESC_SIZE} bytes, got {len(desc)}")
        if not 0 <= dtype < 8 or not 0 <= op < 4:
            raise UsageError(f"bad reduction codes dtype={dtype} op={op}")
        if lent < 0:
            lent = _LENT_NONE if work_region is not None else _LENT_IN
        if not _LENT_NONE <= lent <= _LENT_BOTH or (lent == _LENT_NONE) != (work_region is not None):
            raise UsageError(f"HostCall: lent={lent} with work_region={work_region!r}")
        if out_bytes < 0:
            out_bytes = nbytes
        # the work area: the transport's buffer, or the lent memory (an all-to-all's: both)
        area = (work_bytes if lent == _LENT_NONE else nbytes if lent == _LENT_IN else out_bytes if lent == _LENT_OUT
                else nbytes + out_bytes)
        if nbytes < 0 or result_offset < 0 or in_offset < 0 or out_bytes < 0 or program.extent > area \
                or work_bytes != area or (lent == _LENT_NONE and (
                    result_offset + out_bytes > work_bytes or in_offset + nbytes > work_bytes)) \
                or (lent != _LENT_NONE and (result_offset or in_offset)):
            raise UsageError("HostCall: the result or the schedule is outside the work area")
        self.own_from, self.own_to, self.own_len = own
        if self.own_len < 0 or self.own_from < 0 or self.own_to < 0 or (lent == _LENT_NONE and max(
                self.own_from, self.own_to) + self.own_len > work_bytes) or (lent != _LENT_NONE and self.own_len and (
                self.own_from + self.own_len > nbytes or self.own_to + self.own_len > out_bytes)):
            raise UsageError("HostCall: the own block's copy is outside the work area")
        self.lent = lent
        self.program = program
        memcpy(self.desc, <char *>desc, DESC_SIZE)
        self.has_rdesc = rdesc is not None
        if self.has_rdesc:
            memcpy(self.rdesc, <char *>rdesc, DESC_SIZE)
        self.dtype, self.op = dtype, op
        self.nbytes, self.result_offset, self.work_bytes = nbytes, result_offset, work_bytes
        self.in_offset, self.out_bytes = in_offset, out_bytes
        self.work_region = work_region
        self.avg_kind, self.avg_n = avg
        # (scaled: the floating-point codes, 4 to 7; divided: the integers, 0 to 3)
        if self.avg_kind != _AVG_NONE and (lent != _LENT_NONE or self.avg_n <= 0 or (
                self.avg_kind == _AVG_SCALE and dtype < 4) or (self.avg_kind == _AVG_DIVIDE and dtype > 3)
                or self.avg_kind not in (_AVG_SCALE, _AVG_DIVIDE)):
            raise UsageError(f"HostCall: avg={avg!r} for dtype {dtype}, lent={lent}")


@cython.final
cdef class AlltoallvPlan:
    """Blocking all-to-alls with counts of one buffer format, prepared once (hostplans.alltoallv):
    the schedule's ``steps`` serve any counts whose every piece fits one message, so a call only
    fills in the chunks (HostCollectives.alltoallv): chunk i carries this rank's send piece
    ``pieces[i]`` (< size) or its receive piece ``pieces[i] - size``. ``desc``, ``dtype``, ``op``:
    the HostCall's; a call works in the caller's memory from ``lend_total`` bytes of input and
    output together or ``lend_each`` in each (-1: never; specs.alltoall_lend_sizes). By the write
    algorithm a pair's block of ``written_from`` bytes or more (-1: none) is written, not sent: the
    steps are those of one set of written blocks (HostCollectives.alltoallv keys a plan by it).
    The last call built is kept with its counts and lending: a loop of one set of counts builds
    its call once."""
    cdef const int64_t[:, ::1] steps        # (typed once: a view per call costs more than the schedule's check)
    cdef const int64_t[::1] pieces
    cdef bytes desc
    cdef int dtype, op
    cdef int64_t lend_total, lend_each, written_from
    cdef object region                      # the transport's buffer, as a call without lending last took it
    cdef HostCall last                      # the last call's, for its byte bounds (send, then receive) and lending
    cdef bytes last_bounds
    cdef bint last_lent

    def __init__(self, steps not None, pieces not None, bytes desc not None, int dtype, int op,
                 int64_t lend_total, int64_t lend_each, int64_t written_from):
        self.steps, self.pieces = steps, pieces
        self.desc, self.dtype, self.op = desc, dtype, op
        self.lend_total, self.lend_each, self.written_from = lend_total, lend_each, written_from

    cdef bint lends(self, int64_t in_bytes, int64_t out_bytes):
        return (self.lend_total >= 0 and in_bytes + out_bytes >= self.lend_total) or \
            (self.lend_each >= 0 and min(in_bytes, out_bytes) >= self.lend_each)


cdef object _MISSING = object()


cdef struct region_t:
    uint64_t addr, length
    uint32_t lkey, rkey
    bint closed


cdef inline region_t _region(object r):
    """A work area's MemoryRegion or HostRegion, as the one-call path uses it."""
    cdef region_t out
    cdef MemoryRegion mr
    cdef HostRegion hr
    if type(r) is HostRegion:
        hr = <HostRegion>r
        out.addr, out.length, out.lkey, out.rkey, out.closed = hr.addr, hr.length, 0, 0, hr.closed
    else:
        mr = <MemoryRegion>r
        out.addr, out.length, out.lkey, out.rkey, out.closed = mr.addr, mr.length, mr.lkey, mr.rkey, mr._closed
    return out


cdef bytes _format(Py_buffer *view):
    if view.format == NULL:
        return b"B"
    return PyBytes_FromString(view.format)


cdef bint _overlap(Py_buffer *a, Py_buffer *b):
    cdef uintptr_t x = <uintptr_t>a.buf, y = <uintptr_t>b.buf
    return x < y + <uintptr_t>b.len and y < x + <uintptr_t>a.len


cdef bint _same_format(Py_buffer *a, Py_buffer *b):
    cdef const char *fa = a.format
    cdef const char *fb = b.format
    if fa == NULL:
        fa = "B"
    if fb == NULL:
        fb = "B"
    return strcmp(fa, fb) == 0


@cython.final
cdef class ExecLock:
    """The Communicator's lock around a running collective: reentrant like threading.RLock
    (acquire, release, ``with``), and HostCollectives takes it by C calls. Taken as a Python method
    call, an RLock cost a tenth of an 8 B allreduce in the VM (about 5 of 50 us)."""
    cdef PyThread_type_lock lock
    cdef unsigned long owner
    cdef int count

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    cdef int _take(self, double timeout) except -1:
        """1 once held, 0 after ``timeout`` seconds (< 0: no limit). The wait runs without the GIL
        and runs the signal handlers every SIGNAL_CHECK, so Ctrl-C ends it."""
        cdef unsigned long me = <unsigned long>PyThread_get_thread_ident()
        cdef PyLockStatus got
        cdef double deadline = monotonic_now() + timeout if timeout > 0 else 0.0
        cdef double step
        if self.count and self.owner == me:
            self.count += 1
            return 1
        got = PyThread_acquire_lock_timed(self.lock, 0, 0)
        while got != PY_LOCK_ACQUIRED:
            step = SIGNAL_CHECK
            if timeout >= 0:
                step = min(step, deadline - monotonic_now())
                if step <= 0:
                    return 0
            with nogil:
                got = PyThread_acquire_lock_timed(self.lock, <long long>(step * 1e6) + 1, 0)
            if got != PY_LOCK_ACQUIRED:
                PyErr_CheckSignals()
        self.owner, self.count = me, 1
        return 1

    cdef int _give(self) except -1:
        if self.count == 0 or self.owner != <unsigned long>PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self.count -= 1
        if self.count == 0:
            self.owner = 0
            PyThread_release_lock(self.lock)
        return 0

    def acquire(self, blocking=True, timeout=-1):
        """As threading.RLock.acquire: True once held, False if ``timeout`` seconds passed."""
        return bool(self._take(float(timeout) if blocking else 0.0))

    def release(self):
        self._give()

    def __enter__(self):
        self._take(-1.0)
        return self

    def __exit__(self, *exc):
        self._give()


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    ctypedef unsigned long pthread_t
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_condattr_init(pthread_condattr_t *a)
    int pthread_condattr_setclock(pthread_condattr_t *a, clockid_t clock)
    int pthread_condattr_destroy(pthread_condattr_t *a)
    int pthread_cond_init(pthread_cond_t *c, const pthread_condattr_t *a)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const timespec *t)
    int pthread_cond_signal(pthread_cond_t *c)
    int pthread_create(pthread_t *t, const void *attr, void *(*fn)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t t, void **ret)


ctypedef struct waker_t:
    pthread_mutex_t mutex
    pthread_cond_t cond                 # the timer thread's: armed, or closing
    PyThread_type_lock wake             # released to wake the sleeper (held while it may sleep)
    double deadline                     # CLOCK_MONOTONIC seconds of the next wake-up (0: none)
    double delay
    int idle_ticks                      # ticks in a row with nothing armed
    bint signaled, closing, parked


cdef double _clock() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef void _signal_sleeper(waker_t *w) noexcept nogil:
    if not w.signaled:
        w.signaled = True
        PyThread_release_lock(w.wake)


cdef int IDLE_TICKS = 50        # a Waker's timer ticks this many delays after the last arm() before it parks


cdef void *_waker_timer(void *arg) noexcept nogil:
    cdef waker_t *w = <waker_t *>arg
    cdef timespec until
    cdef double now, wake_at
    pthread_mutex_lock(&w.mutex)
    while not w.closing:
        now = _clock()
        if w.deadline != 0 and now >= w.deadline:
            w.deadline = 0
            _signal_sleeper(w)
        if w.deadline == 0:
            w.idle_ticks += 1
            if w.idle_ticks > IDLE_TICKS:
                # parked: the next arm() signals (a thread switch); while calls come often the
                # timer ticks instead, and arm() only sets the deadline
                w.parked = True
                pthread_cond_wait(&w.cond, &w.mutex)
                w.parked = False
                w.idle_ticks = 0
                continue
            wake_at = now + w.delay
        else:
            w.idle_ticks = 0
            wake_at = w.deadline
        until.tv_sec = <time_t>wake_at
        until.tv_nsec = <long>((wake_at - <double>until.tv_sec) * 1e9)
        pthread_cond_timedwait(&w.cond, &w.mutex, &until)
    pthread_mutex_unlock(&w.mutex)
    return NULL


@cython.final
cdef class Waker:
    """Wakes the communicator's thread (executor._Queue) ``delay`` seconds after a call is queued,
    unless the queue was emptied first (disarm): a caller that queues a call and soon waits for it
    runs it itself, and a thread woken at every put only took the GIL from it (two thread switches
    per call, most of a non-blocking call's cost over TCP). A thread of its own (C, never holding the
    GIL) keeps the time, so arming it costs no GIL hand-over."""
    cdef waker_t *w
    cdef pthread_t timer
    cdef bint started
    cdef pid_t pid                      # the process that made it (a fork's child has no timer thread)

    def __cinit__(self):
        cdef pthread_condattr_t attr
        self.w = <waker_t *>calloc(1, sizeof(waker_t))
        if self.w == NULL:
            raise MemoryError()
        self.w.wake = PyThread_allocate_lock()
        if self.w.wake == NULL:
            free(self.w)
            self.w = NULL
            raise MemoryError()
        PyThread_acquire_lock_timed(self.w.wake, 0, 0)
        pthread_mutex_init(&self.w.mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.w.cond, &attr)
        pthread_condattr_destroy(&attr)
        self.pid = getpid()

    def __init__(self, double delay):
        self.w.delay = delay

    def start(self):
        """Start the timer thread (with the communicator's)."""
        if self.started:
            return
        if pthread_create(&self.timer, NULL, _waker_timer, self.w) != 0:
            raise OSError("pyrdma: cannot start the communicator's timer thread")
        self.started = True

    def arm(self):
        """A call was queued: wake the sleeper after the delay (if not armed already)."""
        cdef waker_t *w = self.w
        with nogil:
            pthread_mutex_lock(&w.mutex)
            if w.deadline == 0 and not w.closing:
                w.deadline = _clock() + w.delay
                if w.parked:
                    pthread_cond_signal(&w.cond)
            pthread_mutex_unlock(&w.mutex)

    def disarm(self):
        """The queue is empty: no wake-up is due (the caller looks at the queue again after this)."""
        cdef waker_t *w = self.w
        with nogil:
            pthread_mutex_lock(&w.mutex)
            w.deadline = 0
            pthread_mutex_unlock(&w.mutex)

    def wake(self):
        """Wake the sleeper now (to stop it)."""
        cdef waker_t *w = self.w
        with nogil:
            pthread_mutex_lock(&w.mutex)
            _signal_sleeper(w)
            pthread_mutex_unlock(&w.mutex)

    def sleep(self):
        """Block (without the GIL) until woken."""
        cdef waker_t *w = self.w
        with nogil:
            PyThread_acquire_lock_timed(w.wake, -1, 0)
            pthread_mutex_lock(&w.mutex)
            w.signaled = False
            pthread_mutex_unlock(&w.mutex)

    def close(self):
        """Stop the timer thread (arm() does nothing after this)."""
        cdef waker_t *w = self.w
        if self.pid != getpid():
            # a fork's child: the timer is the parent's, and its mutex may have been held at the fork
            self.started = False
            w.closing = True
            return
        with nogil:
            pthread_mutex_lock(&w.mutex)
            w.closing = True
            pthread_cond_signal(&w.cond)
            pthread_mutex_unlock(&w.mutex)
        if self.started:
            with nogil:
                pthread_join(self.timer, NULL)
        self.started = False

    def __dealloc__(self):
        cdef waker_t *w = self.w
        if w == NULL:
            return
        self.close()
        if self.pid != getpid():
            return          # a fork's child: left as the fork found it (destroying a waited-on cond blocks)
        pthread_cond_destroy(&w.cond)
        pthread_mutex_destroy(&w.mutex)
        PyThread_free_lock(w.wake)
        free(w)


# The kinds of call that HostCollectives prepares: an index into its ``lasts`` and the first field of
# a prepared call's key (KIND_NAMES: their names, as hostplans takes them)
cdef enum:
    K_ALLREDUCE, K_REDUCE, K_BROADCAST, K_ALLGATHER, K_REDUCE_SCATTER, K_ALLTOALL, K_GATHER, K_SCATTER
    K_SEND, K_RECV, K_SCATTER_PARTS, K_EXCHANGE
cdef tuple KIND_NAMES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "gather",
                         "scatter", "send", "recv", "scatter_parts", "exchange")


@cython.final
cdef class _LastCall:
    """The last call of one kind (allreduce, gather, send, ...) and the key it was prepared for,
    compared in C before the dict: building and hashing the key tuple is Python work that every
    call of a loop of one shape would repeat (about 5% of an 8 B allreduce in the VM; a
    ping-pong's messages and the small gathers and scatters pay for it too)."""
    cdef HostCall call
    cdef bytes format
    cdef Py_ssize_t nbytes
    cdef int peer                    # the root, or the peer of a message (-1: none)
    cdef object how                  # the algorithm, or the tag of a message
    cdef object op                   # a reduction's op (None: none)

    cdef bint matches(self, Py_buffer *view, int peer, how, op):
        cdef const char *fmt = view.format
        if fmt == NULL:
            fmt = "B"
        return self.call is not None and view.len == self.nbytes and peer == self.peer \
            and (how is self.how or how == self.how) and (op is self.op or op == self.op) \
            and strcmp(fmt, <char *>self.format) == 0

    cdef void remember(self, HostCall call, bytes format, Py_ssize_t nbytes, int peer, how, op):
        self.call, self.format, self.nbytes, self.peer, self.how, self.op = call, format, nbytes, peer, how, op


@cython.final
cdef class _Queued:
    """A one-call run queued on the communicator's thread (HostCollectives.submit, or collect for a
    batch's own job): the call, its objects, the buffers it works on (held, so that they stay as
    they were checked) and its numbers, all taken when it was submitted: the collectives' call
    number, or a message's number for its pair of ranks (``peer`` >= 0; an exchange's receive
    from ``src`` >= 0 takes ``rseq`` too)."""
    cdef HostCollectives host
    cdef HostCall call
    cdef object result, source
    cdef Py_buffer view, out_view
    cdef bint has_view, has_out      # held (NULL in _run where not)
    cdef bint out_is_view            # _run's out_view was its view (a message's)
    cdef int64_t seq, rseq
    cdef int peer, src
    cdef bint receive

    def __call__(self):
        try:
            done = self.host._run(self.call, self.result, &self.view if self.has_view else NULL,
                                  &self.out_view if self.has_out else &self.view if self.out_is_view else NULL,
                                  self.source, self.peer, self.receive, self.src, self.seq, self.rseq)
            return None if self.peer >= 0 and not self.receive else done    # a send: as the general path's
        finally:
            self._release()

    cdef void _release(self):
        if self.has_out:
            PyBuffer_Release(&self.out_view)
        if self.has_view:
            PyBuffer_Release(&self.view)
        self.has_view = self.has_out = False

    def __dealloc__(self):
        self._release()


@cython.final
cdef class ExecState:
    """What HostCollectives reads of the executor at every call, as C fields rather than instance
    attributes (a dict lookup each: about a fifth of a warm gather's instructions went to
    attribute reads): pyrdma.collectives.executor.Executor's ``state``; Python sees them as
    attributes. ``idle``: no call is queued and the executor is neither closed nor broken; ``seq``:
    the next collective's call number."""
    cdef public bint idle
    cdef public uint64_t seq

    def __cinit__(self):
        self.idle = True                  # a new executor's: nothing queued yet


@cython.final
cdef class HostCollectives:
    """Blocking collectives on host memory as one C call each (both links): ``allreduce(buf, op,
    algorithm)`` and ``reduce`` in place, ``broadcast``, ``allgather``, ``reduce_scatter``,
    ``alltoall``, ``gather``, ``scatter``, ``barrier()`` and the messages of Communicator.send/recv.
    The buffer comes by the buffer protocol, the prepared HostCall (pyrdma.collectives.hostplans)
    from the last call of its kind or a dict keyed by (kind, format, bytes, ...), and the copy in,
    the schedule and the copy out run without the GIL. Python runs only to prepare a new shape,
    register new memory in place, and raise errors, so a call costs about as much as a Python
    function call whatever its size. submit(method, *args) queues one of them instead, to run on
    the communicator's thread (the non-blocking forms). What a method does not take (it returns
    None) goes the Communicator's general way."""
    cdef Engine engine
    cdef ExecLock lock                                    # the executor's lock
    cdef ExecState ex                                     # the executor's state
    cdef object executor, comm, transport, plans          # the executor, the communicator, ..., hostplans
    cdef dict calls
    cdef HostCall barrier_call
    cdef tuple lasts                                      # the _LastCall of each kind (K_)
    cdef object lent_in, lent_out                         # the last registrations of lent inputs, outputs
    cdef list sent, received                              # the communicator's messages per peer so far
    cdef unsigned long queuer                             # the thread in submit() (0: none): its runs are queued
    cdef bint collecting                                  # in collect(): the queued runs are returned

    def __init__(self, Engine engine not None, executor, comm, transport, plans):
        """``executor``: the communicator's pyrdma.collectives.executor.Executor (the order of calls,
        their numbers, the failure state, the lock); ``comm``: the Communicator, whose calls
        ``plans`` (pyrdma.collectives.hostplans, which imports this module: handed in, not imported
        back) prepares."""
        self.engine, self.executor, self.comm, self.transport, self.plans = engine, executor, comm, transport, plans
        self.ex = executor.state
        self.lock = executor.lock
        self.calls = {}
        self.sent, self.received = executor.sent, executor.received
        self.lasts = tuple(_LastCall() for _ in KIND_NAMES)

    def submit(self, method, *args):
        """The Handle of ``method(*args)``, a blocking collective of this class (allreduce,
        reduce, broadcast, allgather, reduce_scatter, alltoall, gather, scatter, barrier) made
        non-blocking: checked and looked up now, queued behind the calls before it and run as one
        C call on the communicator's thread; None where the general path must run it. A shape not
        prepared yet is prepared now, within the transport's buffer as it is while calls are
        queued (growing it would close a region that a running call uses): one that needs more
        takes the general path, whose run grows it."""
        self.queuer = PyThread_get_thread_ident()
        try:
            done = method(*args)
        finally:
            self.queuer = 0
        return done[0] if type(done) is tuple else done

    def collect(self, method, *args):
        """As submit, but the run is returned instead of queued (a callable that runs it and
        returns what the blocking method would): a step of a non-blocking batch, whose own queued
        job runs it (Communicator._batch). Its numbers are taken now, as submit's."""
        self.collecting = True
        try:
            return self.submit(method, *args)
        finally:
            self.collecting = False

    cdef inline bint _takes(self):
        """Whether a call may go the one-call way now: queued (submit), run at once where nothing
        is queued, or queued behind the calls that are and waited for (_run); not in a closed or
        failed group (the general path raises its error)."""
        cdef ExecState ex = self.ex
        return self._queuing() or ex.idle or (not self.executor.closed and self.executor.broken is None)

    cdef inline bint _queuing(self):
        """Whether this thread is in submit() (another thread's calls run as they would)."""
        return self.queuer != 0 and self.queuer == PyThread_get_thread_ident()

    cdef object _enqueue(self, HostCall call, object result, Py_buffer *view, Py_buffer *out_view, object source,
                         int peer, bint receive, int src):
        """The Handle of ``call``'s run queued on the communicator's thread (_run's arguments),
        its buffers held until it has run, its numbers the next ones (the next call's, or the
        pair's next message's); in collect() (messages only) the run itself, not queued."""
        cdef _Queued job = _Queued.__new__(_Queued)
        cdef list counters
        job.host, job.call, job.result, job.source = self, call, result, source
        job.peer, job.receive, job.src = peer, receive, src
        # held, not checked again (the caller's views were): no format asked for, which numpy
        # would build again at every call
        if view != NULL:
            PyObject_GetBuffer(view.obj, &job.view, PyBUF_C_CONTIGUOUS)
            job.has_view = True
        if out_view != NULL and out_view != view:
            PyObject_GetBuffer(out_view.obj, &job.out_view, PyBUF_C_CONTIGUOUS)
            job.has_out = True
        job.out_is_view = out_view != NULL and out_view == view
        if peer < 0:
            job.seq = self.ex.seq
            return self.executor.submit(False, job, seq=True)
        counters = self.received if receive and src < 0 else self.sent
        job.seq = counters[peer]
        counters[peer] = job.seq + 1
        if src >= 0:
            job.rseq = self.received[src]
            self.received[src] = job.rseq + 1
        return job if self.collecting else self.executor.submit(False, job, seq=False)

    def forget(self):
        """Drop the prepared calls: what they were prepared under (the Communicator's cost_model,
        max_work_bytes or zero_copy_bytes) has changed."""
        self._forget()

    cpdef object allreduce(self, buf, op, algorithm):
        """``buf``, reduced in place; or None where the general path must run the call: not a
        writable C-contiguous buffer, a collective still queued, a failed or closed group, or a
        call that the Communicator does not prepare (it raises the errors of bad arguments)."""
        cdef Py_buffer view
        cdef _LastCall last
        if not self._takes():
            return None
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            last = self._last(K_ALLREDUCE)
            call = last.call if last.matches(&view, -1, algorithm, op) else self._last_or_prepared(
                K_ALLREDUCE, &view, -1, algorithm, op, self.plans.allreduce, (self.comm, buf, op, algorithm))
            if call is None or (<HostCall>call).nbytes != view.len:
                return None
            return self._run(<HostCall>call, buf, &view)
        finally:
            PyBuffer_Release(&view)

    cpdef object reduce(self, buf, op, root, algorithm):
        """(buf,) on root, (None,) elsewhere, of a reduce of ``buf`` into itself on ``root`` (the
        other ranks' buffers are only read); None where the general path must run it (as
        allreduce)."""
        cdef Py_buffer view
        cdef _LastCall last
        if not self._takes() or type(root) is not int or not 0 <= <long>root < self.engine.size:
            return None
        is_root = root == self.engine.rank
        try:
            PyObject_GetBuffer(buf, &view, (PyBUF_WRITABLE if is_root else 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            last = self._last(K_REDUCE)
            call = last.call if last.matches(&view, <int>root, algorithm, op) else self._last_or_prepared(
                K_REDUCE, &view, <int>root, algorithm, op, self.plans.reduce, (self.comm, buf, op, root, algorithm))
            if call is None or (<HostCall>call).nbytes != view.len:
                return None
            return (self._run(<HostCall>call, buf if is_root else None, &view),)
        finally:
            PyBuffer_Release(&view)

    cpdef object broadcast(self, buf, root, algorithm):
        """``buf``, holding the root's data on every rank; None where the general path must run it
        (as allreduce; also over RDMA from the zero-copy size on, where it works in ``buf`` itself)."""
        cdef Py_buffer view
        cdef _LastCall last
        if not self._takes() or type(root) is not int or not 0 <= <long>root < self.engine.size:
            return None
        try:
            PyObject_GetBuffer(buf, &view, (0 if root == self.engine.rank else PyBUF_WRITABLE) | PyBUF_FORMAT
                               | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            last = self._last(K_BROADCAST)
            call = last.call if last.matches(&view, <int>root, algorithm, None) else self._last_or_prepared(
                K_BROADCAST, &view, <int>root, algorithm, None, self.plans.broadcast, (self.comm, buf, root, algorithm))
            if call is None:
                return None
            return self._run(<HostCall>call, buf, &view)
        finally:
            PyBuffer_Release(&view)

    cpdef object allgather(self, buf, out):
        """``out`` (a new array when None and buf is a numpy array, as the general path makes it)
        holding every rank's ``buf`` in rank order; None where the general path must run it (as
        allreduce)."""
        cdef int n = self.engine.size
        if not self._takes():
            return None
        if out is None:
            if type(buf) is not _ndarray:
                return None
            out = _empty((n * buf.shape[0],) + buf.shape[1:] if buf.ndim else (n,), buf.dtype)
        return self._into(K_ALLGATHER, buf, out, None, n, self.plans.allgather)

    cpdef object reduce_scatter(self, buf, out, op):
        """``out`` (a new 1-D array when None and buf is a numpy array) holding this rank's
        segment of the reduction of ``buf``; None where the general path must run it (as
        allreduce)."""
        cdef Py_buffer view
        cdef _LastCall last
        cdef HostCall call
        if not self._takes():
            return None
        if out is None:
            if type(buf) is not _ndarray:
                return None
            try:                      # the segment's length is the prepared call's
                PyObject_GetBuffer(buf, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            except Exception:
                return None
            try:
                last = self._last(K_REDUCE_SCATTER)
                found = last.call if last.matches(&view, -1, None, op) else self._last_or_prepared(
                    K_REDUCE_SCATTER, &view, -1, None, op, self.plans.reduce_scatter, (self.comm, buf, None, op))
                if found is None:
                    return None
                call = <HostCall>found
                out = _empty(call.out_bytes // view.itemsize, buf.dtype)
            finally:
                PyBuffer_Release(&view)
        return self._into(K_REDUCE_SCATTER, buf, out, op, 0, self.plans.reduce_scatter)

    cdef object _into(self, int kind, buf, out, op, Py_ssize_t times, prepare):
        """``out`` of an all-to-all, allgather or reduce-scatter (``kind``, prepared by
        ``prepare(comm, buf, out, op)``; ``op`` None but for a reduction): ``buf`` read, the
        call's result written into ``out``, other memory with ``times`` x buf's bytes (0: the
        prepared call's out_bytes) and buf's format; None where the general path must run it."""
        cdef Py_buffer view, oview
        cdef _LastCall last = self._last(kind)
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            try:
                PyObject_GetBuffer(out, &oview, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            except Exception:
                return None
            try:
                # (in place, as FSDP's all-gather of a shard that lies in the output, is fine
                # through the transport's buffer: the input is copied in before the output is
                # written; a lent call refuses any overlap below)
                if not _same_format(&view, &oview) or (times and oview.len != times * view.len):
                    return None
                call = last.call if last.matches(&view, -1, None, op) else self._last_or_prepared(
                    kind, &view, -1, None, op, prepare, (self.comm, buf, out, op))
                if call is None or (<HostCall>call).out_bytes != oview.len or (<HostCall>call).nbytes != view.len \
                        or ((<HostCall>call).lent != _LENT_NONE and _overlap(&view, &oview)):
                    return None
                return self._run(<HostCall>call, out, &view, &oview, buf)
            finally:
                PyBuffer_Release(&oview)
        finally:
            PyBuffer_Release(&view)

    cpdef object alltoall(self, buf, out):
        """``out`` (a new array like ``buf`` when None and buf is a numpy array) holding the equal
        pieces of every rank's all-to-all; or None where the general path must run it (as
        allreduce)."""
        if not self._takes():
            return None
        if out is None:
            if type(buf) is not _ndarray:
                return None
            out = _empty_like(buf)
        return self._into(K_ALLTOALL, buf, out, None, 1, self.plans.alltoall)

    cpdef object alltoallv(self, buf, out, send_counts, recv_counts):
        """``out`` (a new array of buf's dtype when None and buf is a 1-d numpy array) holding an
        all-to-all's pieces of the given element counts (sequences of ints, one per rank); or None
        where the general path must run it (as allreduce; also a piece over max_message, and counts
        that are not plain ints or do not add up: that path names the error). The plan is the
        format's (AlltoallvPlan): only the chunks and the layout are the call's."""
        cdef Engine engine = self.engine
        cdef int n = engine.size, r = engine.rank
        cdef Py_buffer view, oview
        cdef int64_t *bounds
        cdef int64_t base, total, own
        cdef bint lent
        if not self._takes():
            return None
        bounds = <int64_t *>malloc(2 * (n + 1) * sizeof(int64_t))
        if bounds == NULL:
            raise MemoryError()
        try:
            try:
                PyObject_GetBuffer(buf, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            except Exception:
                return None
            try:
                if not _bounds(send_counts, n, view.itemsize, engine.max_message, bounds) \
                        or not _bounds(recv_counts, n, view.itemsize, engine.max_message, bounds + n + 1):
                    return None
                base, total = bounds[n], bounds[2 * n + 1]
                own = bounds[r + 1] - bounds[r]
                if base != view.len or own != bounds[n + 2 + r] - bounds[n + 1 + r] or base + total == 0:
                    return None
                plan = self._prepared(("alltoallv", _format(&view)), self.plans.alltoallv, (self.comm, buf))
                if plan is None:
                    return None
                written = _written(bounds, bounds + n + 1, n, (<AlltoallvPlan>plan).written_from)
                if written is not None:
                    plan = self._prepared(("alltoallv", _format(&view), written), self.plans.alltoallv,
                                          (self.comm, buf, written))
                    if plan is None:
                        return None
                if out is None:
                    if type(buf) is not _ndarray or buf.ndim != 1:
                        return None
                    out = _empty(total // view.itemsize, buf.dtype)
                try:
                    PyObject_GetBuffer(out, &oview, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
                except Exception:
                    return None
                try:
                    if not _same_format(&view, &oview) or oview.len != total:
                        return None
                    lent = (<AlltoallvPlan>plan).lends(base, total) and not _overlap(&view, &oview)
                    call = (<AlltoallvPlan>plan).last
                    # (building one, its chunks, Program and HostCall, takes ~0.5 us on the host,
                    # ~40 us of a 120 us 8 B call in the emulated VM)
                    if call is None or lent != (<AlltoallvPlan>plan).last_lent or memcmp(
                            bounds, <char *>(<AlltoallvPlan>plan).last_bounds, 2 * (n + 1) * sizeof(int64_t)):
                        call = self._alltoallv_call(<AlltoallvPlan>plan, bounds, bounds + n + 1, lent)
                        if call is None:
                            return None
                        (<AlltoallvPlan>plan).last, (<AlltoallvPlan>plan).last_lent = call, lent
                        (<AlltoallvPlan>plan).last_bounds = PyBytes_FromStringAndSize(
                            <char *>bounds, 2 * (n + 1) * sizeof(int64_t))
                    return self._run(<HostCall>call, out, &view, &oview, buf)
                finally:
                    PyBuffer_Release(&oview)
            finally:
                PyBuffer_Release(&view)
        finally:
            free(bounds)

    cdef HostCall _alltoallv_call(self, AlltoallvPlan plan, const int64_t *sb, const int64_t *rb, bint lent):
        """The HostCall of one all-to-all with the byte bounds ``sb`` (send) and ``rb`` (receive),
        in the caller's memory (``lent``) or through the transport's buffer, as specs.alltoall lays
        it out; None beside queued calls where the buffer would have to grow (as _prepared)."""
        cdef Engine engine = self.engine
        cdef int n = engine.size, r = engine.rank
        cdef Py_ssize_t i, nchunks = plan.pieces.shape[0]
        cdef int64_t p, base = sb[n], total = rb[n]
        chunks = _empty((nchunks, 3), "i8")
        cdef int64_t[:, ::1] c = chunks
        for i in range(nchunks):
            p = plan.pieces[i]
            if p < n:
                c[i, 0], c[i, 1] = sb[p], sb[p + 1] - sb[p]
            else:
                p -= n
                c[i, 0], c[i, 1] = base + rb[p], rb[p + 1] - rb[p]
            c[i, 2] = 0
        cdef Program prog = Program.__new__(Program)
        prog._check(r, n, engine.max_message, plan.steps, c, (plan, chunks))
        own = sb[r + 1] - sb[r]
        if lent:
            return HostCall(prog, plan.desc, plan.dtype, plan.op, base, 0, base + total, None,
                            own=(sb[r], rb[r], own), out_bytes=total, lent=_LENT_BOTH)
        region = plan.region
        if region is None or _region(region).closed or _region(region).length < <uint64_t>(base + total):
            if not self.ex.idle and not self.transport.own_fits(base + total):
                return None
            region = plan.region = self.transport.own_region(base + total)
        return HostCall(prog, plan.desc, plan.dtype, plan.op, base, base, base + total, region,
                        own=(sb[r], base + rb[r], own), out_bytes=total)

    cpdef object gather(self, buf, out, root, algorithm):
        """(out,) on root, (None,) elsewhere, of a gather of ``buf`` (out: a new array when None
        and buf is a numpy array); None where the general path must run it (as allreduce)."""
        cdef int n = self.engine.size
        if not self._takes() or type(root) is not int or not 0 <= <long>root < n:
            return None
        is_root = root == self.engine.rank
        if is_root and out is None:
            if type(buf) is not _ndarray or buf.ndim == 0:
                return None
            out = _empty((n * buf.shape[0],) + buf.shape[1:], buf.dtype)
        return self._rooted(K_GATHER, buf, False, out if is_root else None, root, algorithm)

    cpdef object scatter(self, buf, out, root, algorithm):
        """(out,) of a scatter from ``root`` (out: a new array when None and buf is a numpy
        array); None where the general path must run it (as allreduce)."""
        cdef int n = self.engine.size
        if not self._takes() or type(root) is not int or not 0 <= <long>root < n:
            return None
        if out is None:
            if type(buf) is not _ndarray or buf.ndim == 0 or buf.shape[0] % n:
                return None
            out = _empty((buf.shape[0] // n,) + buf.shape[1:], buf.dtype)
        if type(buf) is list and root == self.engine.rank:
            return None if self._queuing() or not self.ex.idle else self._scatter_parts(buf, out, <int>root, algorithm)
        return self._rooted(K_SCATTER, out, True, buf if root == self.engine.rank else None, root, algorithm)

    cdef object _scatter_parts(self, list pieces, out, int root, algorithm):
        """(out,) of a scatter root's list of pieces, each sent from where it lies
        (hostplans.scatter_parts: over TCP, from the size the cost model lends at); None where the
        general path must run it."""
        cdef Engine engine = self.engine
        cdef int n = engine.size, i, held = 0
        cdef Py_buffer oview
        cdef Py_buffer *views
        if len(pieces) != n:
            return None
        try:
            PyObject_GetBuffer(out, &oview, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        views = <Py_buffer *>malloc(n * sizeof(Py_buffer))
        try:
            if views == NULL:
                return None
            for i in range(n):
                try:
                    PyObject_GetBuffer(pieces[i], &views[i], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
                except Exception:
                    return None
                held += 1
                if views[i].len != oview.len or not _same_format(&views[i], &oview):
                    return None
            calls = self._prepared((K_SCATTER_PARTS, _format(&oview), oview.len, root, algorithm),
                                   self.plans.scatter_parts, (self.comm, pieces, out, root, algorithm))
            if calls is None:
                return None
            return (self._run_parts(<tuple>calls, views, &oview, out, root),)
        finally:
            for i in range(held):
                PyBuffer_Release(&views[i])
            free(views)
            PyBuffer_Release(&oview)

    cdef object _run_parts(self, tuple calls, Py_buffer *views, Py_buffer *out_view, object out, int root):
        """Run a scatter root's parts (one prepared call per other rank, in rank order from the
        root's next, each sending that rank's piece from where it lies) as one call of the
        collectives' numbering, then copy the root's own piece into ``out``; returns ``out``."""
        cdef Engine engine = self.engine
        cdef HostCall call
        cdef Program prog
        cdef int n = engine.size, i, p, rc = 0
        cdef uint64_t seq
        cdef ExecState ex
        self.lock._take(-1.0)
        try:
            ex = self.ex
            if not ex.idle or engine.fail_kind != FAIL_NONE:
                return None
            seq = ex.seq
            ex.seq = seq + 1
            try:
                for i in range(n - 1):
                    p = (root + 1 + i) % n
                    call = <HostCall>calls[i]
                    prog = call.program
                    _number(call, engine, seq)
                    engine._begin(prog, <uint64_t><uintptr_t>views[p].buf, call.work_bytes, 0, call.desc,
                                  call.dtype, call.op, None, False, 0)
                    # the last part's wait covers every part's sends (their pieces live until the
                    # call returns), so a part sent by address does not hold the next one back
                    # until its reader has read it
                    engine.defer_sends = engine.sockets and i < n - 2
                    try:
                        with nogil:
                            rc = engine._execute(prog.steps, prog.nsteps, prog.chunks)
                    finally:
                        engine._end()
                    if rc < 0:
                        raise self.transport.engine_failed()
                # after the sends (the last part waits for them all): ``out`` may be one of the pieces
                memmove(out_view.buf, views[root].buf, <size_t>out_view.len)
            except BaseException as exc:
                self.executor.fail(exc)
                raise
            return out
        finally:
            self.lock._give()

    cdef object _rooted(self, int kind, piece, bint piece_out, full, root, algorithm):
        """(result,) of a gather or scatter (``kind``) of this rank's ``piece`` (gather: read from it;
        scatter: written into it, ``piece_out``) and, on the root, ``full``, every rank's pieces in
        rank order (gather: written; scatter: read; None elsewhere); None where the general path
        must run it."""
        cdef Py_buffer pview, fview
        cdef Py_buffer *fp = NULL
        cdef _LastCall last = self._last(kind)
        try:
            PyObject_GetBuffer(piece, &pview, (PyBUF_WRITABLE if piece_out else 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            if full is not None:
                try:
                    PyObject_GetBuffer(full, &fview, (0 if piece_out else PyBUF_WRITABLE) | PyBUF_FORMAT
                                       | PyBUF_C_CONTIGUOUS)
                except Exception:
                    return None
                fp = &fview
            try:
                if fp != NULL and (fview.len != self.engine.size * pview.len or not _same_format(&pview, fp)):
                    return None
                call = last.call if last.matches(&pview, <int>root, algorithm, None) else self._last_or_prepared(
                    kind, &pview, <int>root, algorithm, None, self.plans.rooted_copy,
                    (self.comm, KIND_NAMES[kind], piece, full, root, algorithm))
                if call is None or ((<HostCall>call).lent != _LENT_NONE and fp != NULL and _overlap(&pview, fp)):
                    return None
                if piece_out:                   # scatter: from the root's full array into the piece
                    return (self._run(<HostCall>call, piece, fp, &pview, full),)
                return (self._run(<HostCall>call, full, &pview, fp, piece),)
            finally:
                if fp != NULL:
                    PyBuffer_Release(&fview)
        finally:
            PyBuffer_Release(&pview)

    def exchange(self, sendbuf, dst, recvbuf, src, send_tag, recv_tag):
        """(elements received,) of a blocking send of ``sendbuf`` to ``dst`` while ``recvbuf``
        receives from ``src`` (Communicator.sendrecv, a batch of one send and one receive), each
        message the pair's next; None where the general path must run it (as allreduce)."""
        cdef Py_buffer view, oview
        cdef Engine engine = self.engine
        if type(send_tag) is not int or type(recv_tag) is not int or type(dst) is not int or type(src) is not int \
                or not 0 <= dst < engine.size or not 0 <= src < engine.size or engine.rank in (dst, src):
            return None
        try:
            PyObject_GetBuffer(sendbuf, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            try:
                PyObject_GetBuffer(recvbuf, &oview, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
            except Exception:
                return None
            try:
                key = (K_EXCHANGE, _format(&view), view.len, _format(&oview), oview.len, dst, src, send_tag, recv_tag)
                call = self._prepared(key, self.plans.exchange, (self.comm, sendbuf, dst, recvbuf, src, send_tag,
                                                                 recv_tag))
                if call is None or ((<HostCall>call).lent != _LENT_NONE and _overlap(&view, &oview)):
                    return None
                return (self._run(<HostCall>call, recvbuf, &view, &oview, sendbuf, dst, True, src),)
            finally:
                PyBuffer_Release(&oview)
        finally:
            PyBuffer_Release(&view)

    def message(self, buf, peer, tag, bint receive):
        """A blocking send of ``buf`` to ``peer`` (``buf`` once sent), or receive from it (the
        elements received): what _message does (a step of a batch, Communicator._one_call_steps;
        isend and irecv through submit)."""
        if type(peer) is not int or not 0 <= peer < self.engine.size:
            return None
        return self._message(buf, peer, tag, receive)

    cdef object _message(self, buf, int peer, tag, bint receive):
        """A blocking send of ``buf`` to ``peer`` (``buf`` once sent), or receive from it (the
        elements received) as the pair's next message; None where the general path must run it (as
        allreduce; over RDMA from the zero-copy size on: a rendezvous)."""
        cdef Py_buffer view
        cdef Engine engine = self.engine
        cdef _LastCall last = self._last(K_RECV if receive else K_SEND)
        if type(tag) is not int or not 0 <= peer < engine.size or peer == engine.rank:
            return None
        try:
            PyObject_GetBuffer(buf, &view, (PyBUF_WRITABLE if receive else 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        except Exception:
            return None
        try:
            # the last call of this direction first: a ping-pong repeats one of each (_run
            # looks at the executor's state under its lock)
            if last.matches(&view, peer, tag, None):
                return self._run(last.call, buf, &view, &view, None, peer, receive)
            if not engine.sockets and self.comm.zero_copy_bytes and view.len >= self.comm.zero_copy_bytes:
                return None                     # over RDMA: a rendezvous, the general path's
            call = self._last_or_prepared(K_RECV if receive else K_SEND, &view, peer, tag, None, self.plans.message,
                                          (self.comm, buf, peer, tag, receive))
            if call is None:
                return None
            return self._run(<HostCall>call, buf, &view, &view, None, peer, receive)
        finally:
            PyBuffer_Release(&view)

    cdef inline _LastCall _last(self, int kind):
        return <_LastCall>self.lasts[kind]

    cdef object _last_or_prepared(self, int kind, Py_buffer *view, int peer, how, op, prepare, tuple args):
        """The HostCall of a ``kind`` call on ``view`` whose key is not its last call's (the callers
        look at that first, before they build ``args``): the one prepared for the key
        (``prepare(*args)``, a function of hostplans, the first time), remembered as the last; None
        where the general path must run it (also for an unhashable op or algorithm, which that path
        names in its error)."""
        cdef _LastCall last = self._last(kind)
        key = (kind, _format(view), view.len, peer, how, op)
        call = self._prepared(key, prepare, args)
        if call is not None:
            last.remember(<HostCall>call, key[1], view.len, peer, how, op)
        return call

    cdef object _prepared(self, tuple key, prepare, tuple args):
        """What is prepared for ``key`` (``prepare(*args)`` the first time); None where the general
        path must run the call (also for an unhashable key)."""
        try:
            call = self.calls.get(key, _MISSING)
        except TypeError:
            return None
        if call is _MISSING:
            if len(self.calls) >= 256:
                self._forget()
            if self.ex.idle:
                call = self.calls[key] = prepare(*args)
                return call
            # beside queued calls, one of which may be running: within the transport's buffer as it
            # is (growing it would close a region in use), else the general path runs this one and
            # grows it (hostplans.beside_queued). (Refusing every shape first met while a call was
            # queued sent a DDP's later buckets, or an irecv behind its isend, the general way at
            # every call.)
            got = self.plans.beside_queued(prepare, args)
            if got is None:
                return None
            call = self.calls[key] = got[0]
        return call

    cdef void _forget(self):
        """Drop the prepared calls (the dict is full, or what they were prepared under changed)."""
        self.calls.clear()
        for last in self.lasts:
            (<_LastCall>last).call = None

    cpdef object barrier(self):
        """True once every rank has entered the barrier; None where the general path must run it."""
        comm = self.comm
        if not self._takes():
            return None
        if self.barrier_call is None:
            self.barrier_call = self._prepared(("barrier",), self.plans.barrier, (comm,))
            if self.barrier_call is None:
                return None
        # (True: taken; a queued one's wait() gives None, as the general path's)
        return self._run(self.barrier_call, None if self._queuing() else True, NULL)

    cdef object _run(self, HostCall call, object result, Py_buffer *view, Py_buffer *out_view=NULL,
                     object source=None, int peer=-1, bint receive=False, int src=-1, int64_t queued=-1,
                     int64_t queued_r=0):
        """Run a prepared call on ``view`` (NULL: no data, as a barrier's; ``source``: its object,
        where it is not ``result``), its result copied into or worked on in ``out_view`` (NULL:
        view), and return ``result``. ``peer`` >= 0: a message to that rank (or, ``receive``, from
        it), whose description takes the pair's next message number instead of the collectives'
        call number; a receive copies out what arrived and returns its element count. ``src`` >= 0:
        an exchange, a message to ``peer`` while one from ``src`` arrives in ``out_view``. In
        submit() the run is queued instead (the Handle), and a blocking message behind queued calls
        is queued and waited for; ``queued`` >= 0: that queued run, on the communicator's thread or
        its waiter's, numbered ``queued`` (an exchange's receive ``queued_r``)."""
        cdef Engine engine = self.engine
        cdef Program prog = call.program
        cdef region_t region, region2
        cdef uint8_t *data = <uint8_t *>view.buf if view != NULL else NULL
        cdef uint8_t *out_data = <uint8_t *>out_view.buf if out_view != NULL else data
        cdef uint8_t *work
        cdef uint64_t seq, rseq = 0
        cdef ExecState ex
        cdef int64_t got = 0
        cdef int rc
        cdef bint copy = call.lent == _LENT_NONE
        cdef Py_ssize_t item = (out_view if src >= 0 else view).itemsize if receive else 1
        cdef list counters
        if queued < 0:
            if self._queuing():
                return self._enqueue(call, result, view, out_view, source, peer, receive, src)
            if not self.ex.idle:
                # a blocking call behind queued ones (an isend's, then this recv; a DDP bucket's
                # allreduce, then this one): queued after them and waited for, as the general
                # path's would be
                done = self._enqueue(call, result, view, out_view, source, peer, receive, src).wait()
                return done if receive else result
        self.lock._take(-1.0)
        try:
            ex = self.ex
            if queued >= 0:
                if engine.fail_kind != FAIL_NONE:
                    raise self.transport.engine_failed()
            elif not ex.idle or engine.fail_kind != FAIL_NONE:
                return None
            # the call is accepted: its number is taken, as in submit (a queued one's was then)
            if queued >= 0:
                seq, rseq = <uint64_t>queued, <uint64_t>queued_r
            elif peer < 0:
                seq = ex.seq
                ex.seq = seq + 1
            else:
                counters = self.received if receive and src < 0 else self.sent
                seq = counters[peer]
                counters[peer] = seq + 1
                if src >= 0:
                    rseq = self.received[src]
                    self.received[src] = rseq + 1
            try:
                if copy:
                    region = _region(call.work_region)
                    if region.closed:           # the transport's own buffer has grown since
                        call.work_region = self.transport.own_region(call.work_bytes)
                        region = _region(call.work_region)
                    work = <uint8_t *><uintptr_t>region.addr
                elif call.lent == _LENT_OUT:
                    region = self._lent(result, out_view, True)
                    work = out_data
                else:
                    region = self._lent(result if source is None else source, view, False)
                    work = data
                    if call.lent == _LENT_BOTH:
                        region2 = self._lent(result, out_view, True)
                _number(call, engine, seq)
                if src >= 0:
                    _number_receive(call, engine, rseq)
                # the own buffer may be read remotely (a scatter's OFFER), lent memory not; a queued
                # run is in the background unless its waiter runs it (executor._Queue.help)
                engine._begin(prog, <uint64_t><uintptr_t>work, call.work_bytes, region.lkey, call.desc,
                              call.dtype, call.op, None, queued >= 0 and self.transport.background,
                              region.rkey if copy else 0)
                if call.lent == _LENT_BOTH:
                    engine._second_area(call.nbytes, <uint64_t><uintptr_t>out_data, region2.lkey, region2.rkey)
                # from the transport's buffer the sends need not be complete when the call returns
                # (the caller's memory is not theirs): the next run that writes there waits for them
                engine.defer_sends = copy and not engine.sockets
                try:
                    rc = _drained(engine) if copy else 0
                    if rc == 0 and peer >= 0 and call.work_bytes <= HOLD_GIL_BYTES:
                        _copy_in(call, work, data, out_data, copy)
                        rc = engine._execute_holding_gil(prog)
                        if rc == 0:
                            got = _copy_out(call, engine, work, out_data, copy, receive)
                    elif rc == 0:
                        with nogil:
                            _copy_in(call, work, data, out_data, copy)
                            rc = engine._execute(prog.steps, prog.nsteps, prog.chunks)
                            if rc == 0:
                                got = _copy_out(call, engine, work, out_data, copy, receive)
                finally:
                    engine._end()
                if rc < 0:
                    raise self.transport.engine_failed()
                if receive and got % item:
                    raise UsageError(f"rank {peer if src < 0 else src} sent {got} bytes, not whole {item}-byte "
                                     f"elements")
            except BaseException as exc:
                self.executor.fail(exc)
                raise
            return got // item if receive else result
        finally:
            self.lock._give()

    cdef region_t _lent(self, buf, Py_buffer *view, bint output) except *:
        """The region of lent memory: over TCP the buffer itself (nothing to register), over RDMA
        its registration (_registration)."""
        cdef region_t region
        if self.engine.sockets:
            region.addr, region.length = <uint64_t><uintptr_t>view.buf, view.len
            region.lkey = region.rkey = 0
            region.closed = False
            return region
        return _region(self._registration(buf, view, output))

    cdef object _registration(self, buf, Py_buffer *view, bint output):
        """The registration that covers the buffer (the last one of a lent input, or ``output``,
        else the transport's cache)."""
        cdef uint64_t addr = <uint64_t><uintptr_t>view.buf
        cdef region_t mr
        last = self.lent_out if output else self.lent_in
        if last is not None:
            mr = _region(last)
            if not mr.closed and mr.addr <= addr and addr + <uint64_t>view.len <= mr.addr + mr.length:
                return last
        last = self.plans.registration(self.comm, buf)
        mr = _region(last)
        if addr < mr.addr or addr + <uint64_t>view.len > mr.addr + mr.length:
            raise UsageError("the registration does not cover the buffer")
        if output:
            self.lent_out = last
        else:
            self.lent_in = last
        return last


cdef bint _bounds(object counts, int n, Py_ssize_t itemsize, int64_t max_piece, int64_t *bounds) except -1:
    """Fill ``bounds`` (n + 1) with the byte offsets of ``counts`` (a list or tuple of n ints, or
    a 1-d integer ndarray); False where they are not that, or a count is negative or over
    ``max_piece`` bytes."""
    cdef Py_ssize_t i
    cdef long long x
    cdef int overflow
    if type(counts) is _ndarray:
        counts = counts.tolist()
    if (type(counts) is not list and type(counts) is not tuple) or len(counts) != n:
        return False
    bounds[0] = 0
    for i in range(n):
        c = counts[i]
        if type(c) is not int:
            return False
        x = PyLong_AsLongAndOverflow(c, &overflow)
        if overflow or x < 0 or x > max_piece // itemsize:
            return False
        bounds[i + 1] = bounds[i] + x * itemsize
    return True


cdef object _written(const int64_t *sb, const int64_t *rb, int n, int64_t written_from):
    """None where no piece of the byte offsets ``sb`` and ``rb`` (n + 1 each) has ``written_from``
    bytes (-1: none is written), else the bytes saying which do: [p] for send piece p, [n + q] for
    receive piece q (hostplans.alltoallv's ``written``)."""
    cdef int i
    cdef bint any_written = False
    if written_from < 0:
        return None
    for i in range(n):
        if sb[i + 1] - sb[i] >= written_from or rb[i + 1] - rb[i] >= written_from:
            any_written = True
    if not any_written:
        return None
    out = bytearray(2 * n)
    for i in range(n):
        out[i] = sb[i + 1] - sb[i] >= written_from
        out[n + i] = rb[i + 1] - rb[i] >= written_from
    return bytes(out)


cdef inline void _put_number(uint8_t *desc, uint64_t seq) noexcept:
    """Write ``seq`` as a description's number (its first 8 bytes, little-endian)."""
    cdef int i
    for i in range(8):
        desc[i] = (seq >> (8 * i)) & 0xFF


cdef inline void _number_receive(HostCall call, Engine engine, uint64_t seq) noexcept:
    """Expect an exchange's receive description, numbered ``seq`` (the pair's next message)."""
    memcpy(engine.rdesc, call.rdesc, DESC_SIZE)
    _put_number(engine.rdesc, seq)


cdef inline void _number(HostCall call, Engine engine, uint64_t seq) noexcept:
    """Give the call's description its number (the collectives', or the pair's next message's),
    and expect the same in what arrives."""
    _put_number(call.desc, seq)
    memcpy(engine.rdesc, call.desc, DESC_SIZE)


cdef inline void _copy_in(HostCall call, uint8_t *work, const uint8_t *data, uint8_t *out_data,
                          bint copy) noexcept nogil:
    """A run's copies before it: the input into the transport's buffer (``copy``: the call works
    there), the own block (within that buffer, or from the caller's input to its output)."""
    if copy and call.nbytes:
        memcpy(work + call.in_offset, data, <size_t>call.nbytes)
    if call.own_len:
        if copy:
            memcpy(work + call.own_to, work + call.own_from, <size_t>call.own_len)
        else:
            memcpy(out_data + call.own_to, data + call.own_from, <size_t>call.own_len)
    if call.avg_kind == _AVG_SCALE:
        if call.dtype == FLOAT16_CODE:
            _scale_half(<uint16_t *>(work + call.in_offset), <size_t>call.nbytes // 2, call.avg_n)
        else:
            pyrdma_divide(work + call.in_offset, <size_t>call.nbytes // pyrdma_itemsize[call.dtype], call.dtype,
                          call.avg_n)


cdef inline int64_t _copy_out(HostCall call, Engine engine, const uint8_t *work, uint8_t *out_data,
                              bint copy, bint receive) noexcept nogil:
    """A run's copy after it out of the transport's buffer: the result, or a receive's message
    (whose length it returns), from ``result_offset``."""
    cdef int64_t got = 0
    if receive:
        got = engine.received
        if got and copy:
            memcpy(out_data, work + call.result_offset, <size_t>got)
    elif copy and call.out_bytes:
        if call.avg_kind == _AVG_DIVIDE:
            pyrdma_divide(work + call.result_offset, <size_t>call.out_bytes // pyrdma_itemsize[call.dtype],
                          call.dtype, call.avg_n)
        memcpy(out_data, work + call.result_offset, <size_t>call.out_bytes)
    return got


cdef int _drained(Engine engine) except? -1:
    """The engine's _drain, in the run just begun (0, or -1 on failure): at once where no send is
    pending, else without the GIL."""
    cdef int rc
    if not engine._sends_pending():
        return 0
    with nogil:
        rc = engine._drain()
    return rc


# Communicator.send and Communicator.recv (the class takes these functions as its methods): a warm
# blocking message of host memory over RDMA is then one C call, without a Python frame of the
# method's own (in the Soft-RoCE VM every Python-level step of a ping-pong costs about a microsecond)

def communicator_send(self, buf, dst, tag=0):
    """Send ``buf`` to rank ``dst``. Messages from one rank to another arrive in the order sent
    (with the same tag, as MPI); the receiver's ``recv`` must name this rank and tag. Small
    messages go eagerly into the receiver's slots; a message of zero_copy_bytes or more is sent
    straight from ``buf``. Returns once ``buf`` may be reused."""
    if _host_message(self, buf, dst, tag, False) is not None:
        return None
    return self._call(_spec_module().p2p, buf, dst, None, tag, blocking=True)


def communicator_recv(self, buf, src, tag=0):
    """Receive the next message of rank ``src`` with ``tag`` into ``buf``; returns the number of
    elements received (the message may be shorter than buf; longer is an error naming both
    sizes, never a truncation)."""
    done = _host_message(self, buf, src, tag, True)
    if done is not None:
        return done
    return self._call(_spec_module().p2p, buf, None, src, tag, blocking=True)


# The Communicator's blocking collectives, taken by the class as its methods as send and recv are:
# a warm call of host memory is its HostCollectives method's C call, without a Python frame of the
# method's own (callgrind, 2 ranks, 8 B: the frame was about a fifth of an allreduce's or a gather's
# instructions, and in the Soft-RoCE VM each instruction of Python is dear); anything else runs the
# general path, Communicator._call of the collective's spec (pyrdma.collectives.specs).

def communicator_allreduce(self, buf, out=None, op="sum", algorithm="auto", dtype=None):
    """Element-wise ``op`` of ``buf`` over all ranks, into ``out`` (default: ``buf``, in place).
    Returns the result buffer."""
    host = self._host
    if out is None and host is not None:
        key = host_key(op, dtype)
        if key is not None:
            done = (<HostCollectives?>host).allreduce(buf, key, algorithm)
            if done is not None:
                return done
    return self._call(_spec_module().allreduce, buf, out, op, algorithm, blocking=True, dtype=dtype)


def communicator_reduce(self, buf, out=None, op="sum", root=0, algorithm="auto", dtype=None):
    """Element-wise ``op`` over all ranks, delivered to ``root`` only (into ``out``, default in
    place). Returns the result on root and None elsewhere; other ranks' buffers are unchanged."""
    host = self._host
    if out is None and host is not None:
        key = host_key(op, dtype)
        if key is not None:
            done = (<HostCollectives?>host).reduce(buf, key, root, algorithm)
            if done is not None:
                return done[0]
    return self._call(_spec_module().reduce, buf, out, op, root, algorithm, blocking=True, dtype=dtype)


def communicator_broadcast(self, buf, root=0, algorithm="auto"):
    """Copy root's ``buf`` into ``buf`` on every rank (same size everywhere). Returns ``buf``."""
    host = self._host
    if host is not None:
        done = (<HostCollectives?>host).broadcast(buf, root, algorithm)
        if done is not None:
            return done
    return self._call(_spec_module().broadcast, buf, root, algorithm, blocking=True)


def communicator_allgather(self, buf, out=None):
    """Every rank's ``buf`` (the same size on all ranks), concatenated in rank order into ``out``
    (size * buf.size elements; default a new array concatenated along the first axis, shape
    (size * len(buf),) + buf.shape[1:], as torch's all_gather_into_tensor)."""
    host = self._host
    if host is not None:
        done = (<HostCollectives?>host).allgather(buf, out)
        if done is not None:
            return done
    return self._call(_spec_module().allgather, buf, out, blocking=True)


def communicator_reduce_scatter(self, buf, out=None, op="sum", dtype=None):
    """Element-wise ``op`` of ``buf`` over all ranks; rank i receives segment i of
    ``segment_bounds(len(buf))`` into ``out`` (default a new 1-D array). Returns ``out``."""
    host = self._host
    if host is not None:
        key = host_key(op, dtype)
        if key is not None:
            done = (<HostCollectives?>host).reduce_scatter(buf, out, key)
            if done is not None:
                return done
    return self._call(_spec_module().reduce_scatter, buf, out, op, blocking=True, dtype=dtype)


def communicator_barrier(self):
    """Return once every rank has entered the barrier."""
    host = self._host
    if host is None or (<HostCollectives?>host).barrier() is None:
        self._call(_spec_module().barrier, blocking=True)


def communicator_gather(self, buf, out=None, root=0, algorithm="auto"):
    """Every rank's ``buf`` (the same size everywhere) to ``root``, in rank order, into ``out``
    there (default a new array of shape (size * len(buf),) + buf.shape[1:], as allgather).
    Returns out on root, None elsewhere."""
    host = self._host
    if host is not None:
        done = (<HostCollectives?>host).gather(buf, out, root, algorithm)
        if done is not None:
            return done[0]
    return self._call(_spec_module().gather, buf, out, root, algorithm, blocking=True)


def communicator_scatter(self, buf, out=None, root=0, algorithm="auto"):
    """Root's ``buf`` holds ``size`` equal pieces in rank order; rank i receives piece i into
    ``out`` (default a new array of shape (len(buf) // size,) + buf.shape[1:]). ``buf`` may also
    be a list of the ``size`` pieces (as mpi4py's scatter takes one), each sent from where it
    lies from the zero-copy size on. Elsewhere ``buf`` may be None when ``out`` is given (or an
    array of the root's shape: its piece shape is used). Returns out."""
    host = self._host
    if host is not None:
        full = self._joined(buf) if type(buf) is list and root == self.rank else buf
        done = (<HostCollectives?>host).scatter(full, out, root, algorithm)
        if done is not None:
            return done[0]
    return self._call(_spec_module().scatter, buf, out, root, algorithm, blocking=True)


def communicator_alltoall(self, buf, out=None, send_counts=None, recv_counts=None):
    """Rank i's piece j of ``buf`` goes to rank j, which stores it as its piece i of ``out``.
    Without counts the pieces are equal (buf is split in ``size``; out, default a new array
    like buf, likewise); with ``send_counts`` (element counts per rank, zeros allowed, pieces
    contiguous in rank order, as MPI_Alltoallv and torch's input_split_sizes) they may differ,
    and ``recv_counts`` (output_split_sizes) is exchanged first when not given. Returns out."""
    host = self._host
    if host is not None:
        if send_counts is None and recv_counts is None:
            done = (<HostCollectives?>host).alltoall(buf, out)
        else:
            done = (<HostCollectives?>host).alltoallv(buf, out, send_counts, recv_counts)
        if done is not None:
            return done
    return self._call(_spec_module().alltoall, buf, out, send_counts, recv_counts, blocking=True)


cpdef object host_key(op, dtype):
    """A reduction's op as the one-call path keys it (hostplans.op_and_dtype): ``op`` without a
    ``dtype``, (op, "bfloat16") for bfloat16 values held as uint16 bits (the torch backend's
    bfloat16 tensors); None where the general path must run the call."""
    if dtype is None:
        return op
    return (op, dtype) if type(dtype) is str and dtype == "bfloat16" and op is not None else None


cdef object _specs = None


cdef object _spec_module():
    """pyrdma.collectives.specs, the general path's plans (imported on first use: the collectives
    package imports this module)."""
    global _specs
    if _specs is None:
        from pyrdma.collectives import specs
        _specs = specs
    return _specs


cdef object _host_message(comm, buf, peer, tag, bint receive):
    """The one-call path's result (HostCollectives._message), or None where the general path runs."""
    cdef int overflow = 0
    cdef long p
    host = comm._host
    if host is None or type(peer) is not int:
        return None
    p = PyLong_AsLongAndOverflow(peer, &overflow)
    cdef HostCollectives h = <HostCollectives?>host
    if overflow or not 0 <= p < h.engine.size:
        return None
    return h._message(buf, <int>p, tag, receive)
