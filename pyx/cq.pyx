"""Completion channels and completion queues; completions are polled into numpy arrays."""
cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_C_CONTIGUOUS
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno
from libc.limits cimport INT_MAX
from libc.stdint cimport uintptr_t
from posix.fcntl cimport fcntl, F_GETFL, F_SETFL, O_NONBLOCK
from posix.unistd cimport usleep
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport (VerbsObject, raise_errno, monotonic_now, adopt, release, use, unuse,
                                 pyrdma_load_flag, wait_fd, wait_seconds)
from pyrdma._verbs.device cimport Context
import enum

import numpy as np

from pyrdma.errors import CompletionError, RDMATimeoutError, UsageError

WC_DTYPE = np.dtype([("wr_id", "<u8"), ("status", "<u4"), ("opcode", "<u4"), ("vendor_err", "<u4"),
                     ("byte_len", "<u4"), ("imm_data", "<u4"), ("qp_num", "<u4"), ("src_qp", "<u4"),
                     ("wc_flags", "<u4"), ("pkey_index", "<u2"), ("slid", "<u2"), ("sl", "u1"),
                     ("dlid_path_bits", "u1")])
assert WC_DTYPE.itemsize == sizeof(wc_record)


class WCStatus(enum.IntEnum):
    """ibv_wc_status: how a work completion ended (``wcs["status"]``)."""
    SUCCESS = IBV_WC_SUCCESS
    LOC_LEN_ERR = IBV_WC_LOC_LEN_ERR
    LOC_QP_OP_ERR = IBV_WC_LOC_QP_OP_ERR
    LOC_EEC_OP_ERR = IBV_WC_LOC_EEC_OP_ERR
    LOC_PROT_ERR = IBV_WC_LOC_PROT_ERR
    WR_FLUSH_ERR = IBV_WC_WR_FLUSH_ERR
    MW_BIND_ERR = IBV_WC_MW_BIND_ERR
    BAD_RESP_ERR = IBV_WC_BAD_RESP_ERR
    LOC_ACCESS_ERR = IBV_WC_LOC_ACCESS_ERR
    REM_INV_REQ_ERR = IBV_WC_REM_INV_REQ_ERR
    REM_ACCESS_ERR = IBV_WC_REM_ACCESS_ERR
    REM_OP_ERR = IBV_WC_REM_OP_ERR
    RETRY_EXC_ERR = IBV_WC_RETRY_EXC_ERR
    RNR_RETRY_EXC_ERR = IBV_WC_RNR_RETRY_EXC_ERR
    LOC_RDD_VIOL_ERR = IBV_WC_LOC_RDD_VIOL_ERR
    REM_INV_RD_REQ_ERR = IBV_WC_REM_INV_RD_REQ_ERR
    REM_ABORT_ERR = IBV_WC_REM_ABORT_ERR
    INV_EECN_ERR = IBV_WC_INV_EECN_ERR
    INV_EEC_STATE_ERR = IBV_WC_INV_EEC_STATE_ERR
    FATAL_ERR = IBV_WC_FATAL_ERR
    RESP_TIMEOUT_ERR = IBV_WC_RESP_TIMEOUT_ERR
    GENERAL_ERR = IBV_WC_GENERAL_ERR


class WCOpcode(enum.IntEnum):
    """ibv_wc_opcode: what completed (``wcs["opcode"]``; receives have the RECV bit, 128)."""
    SEND = IBV_WC_SEND
    RDMA_WRITE = IBV_WC_RDMA_WRITE
    RDMA_READ = IBV_WC_RDMA_READ
    COMP_SWAP = IBV_WC_COMP_SWAP
    FETCH_ADD = IBV_WC_FETCH_ADD
    BIND_MW = IBV_WC_BIND_MW
    LOCAL_INV = IBV_WC_LOCAL_INV
    RECV = IBV_WC_RECV
    RECV_RDMA_WITH_IMM = IBV_WC_RECV_RDMA_WITH_IMM


class WCFlags(enum.IntFlag):
    """ibv_wc_flags (``wcs["wc_flags"]``)."""
    GRH = IBV_WC_GRH
    WITH_IMM = IBV_WC_WITH_IMM


# the flat names verbs programmers know (WC_SUCCESS, WC_RDMA_WRITE, WC_WITH_IMM, ...)
globals().update({f"WC_{m.name}": m for e in (WCStatus, WCOpcode, WCFlags) for m in e})

# A blocking wait gives up the C loop this often to run signal handlers (Ctrl-C) and see close().
cdef double CHECK_INTERVAL_S = 0.05
cdef enum:
    STOP_DONE = 0
    STOP_ERROR = 1
    STOP_TIMEOUT = 2
    STOP_CHECK = 3
    STOP_CLOSED = 4



def wc_status_str(int status):
    """Readable name of a completion status, e.g. 'remote access error'."""
    return ibv_wc_status_str(status).decode()


def wc_status_name(int status):
    """Symbolic name of a completion status, e.g. 'REM_ACCESS_ERR'."""
    try:
        return WCStatus(status).name
    except ValueError:
        return f"STATUS_{status}"


def wc_opcode_name(int opcode):
    try:
        return WCOpcode(opcode).name
    except ValueError:
        return f"OPCODE_{opcode}"


def check_wcs(wcs, Py_ssize_t n=-1):
    """Raise CompletionError for the first of the first ``n`` completions in ``wcs`` (default: all)
    whose status is not SUCCESS. The scan runs in C: it costs about what poll_into does, so checking
    every poll is the normal idiom (or let ``poll_wait(..., check=True)`` do it)."""
    cdef Py_buffer view
    cdef Py_ssize_t bad
    _get_wc_buffer(wcs, &view, False)
    try:
        if n < 0 or n > view.len // <Py_ssize_t>sizeof(wc_record):
            n = view.len // <Py_ssize_t>sizeof(wc_record)
        bad = _first_failed(<wc_record *>view.buf, n)
    finally:
        PyBuffer_Release(&view)
    if bad >= 0:
        raise _completion_error(wcs, bad, n)


cdef inline Py_ssize_t _first_failed(const wc_record *wc, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if wc[i].status != IBV_WC_SUCCESS:
            return i
    return -1


cdef object _completion_error(object wcs, Py_ssize_t index, Py_ssize_t polled):
    """The CompletionError for record ``index``; ``polled`` (how many records the call filled)
    rides along as ``exc.polled`` so the caller still sees the other completions."""
    wc = wcs[index]
    status = int(wc["status"])
    exc = CompletionError(status, wc_status_name(status), wr_id=int(wc["wr_id"]),
                          opcode=wc_opcode_name(int(wc["opcode"])), qp_num=int(wc["qp_num"]),
                          message=(f"completion of wr_id={int(wc['wr_id'])} on QP {int(wc['qp_num'])} "
                                   f"failed: {wc_status_name(status)} ({wc_status_str(status)})"))
    exc.polled = int(polled)
    return exc


cdef struct cq_event_take:
    ibv_comp_channel *channel
    void *ev_ctx


cdef int _take_cq_event(void *arg) noexcept nogil:
    # The ack follows at once: ibv_destroy_cq of the event's CQ waits for it.
    cdef cq_event_take *take = <cq_event_take *>arg
    cdef ibv_cq *ev_cq
    if ibv_get_cq_event(take.channel, &ev_cq, &take.ev_ctx) != 0:
        return -errno
    ibv_ack_cq_events(ev_cq, 1)
    return 1


@cython.no_gc_clear
cdef class CompChannel(VerbsObject):
    """A completion event channel; its fd works with select/poll/asyncio."""

    def __init__(self, Context context not None):
        cdef int err = 0
        self._begin_init()
        parents = [context]
        adopt(self, parents)
        self.context = context
        self.channel = ibv_create_comp_channel(context.ctx)
        if self.channel != NULL:
            self._closed = False
            # Non-blocking: two waits may both see the fd readable; the loser must not block in read().
            if fcntl(self.channel.fd, F_SETFL, fcntl(self.channel.fd, F_GETFL) | O_NONBLOCK) < 0:
                err = errno
        else:
            err = errno
        release(parents)
        if self.channel == NULL:
            self._abandon()
            raise_errno("ibv_create_comp_channel", err, repr(context))
        if err:
            self.close()
            raise_errno("fcntl", err, repr(context))

    def fileno(self):
        self._check_open()
        return self.channel.fd

    cdef int _deliver(self, long long serial) except -1:
        # An event read by one CQ's wait() for another CQ on this channel: count it there.
        ref = self._children.get(serial)
        cq = ref() if ref is not None else None
        if isinstance(cq, CompletionQueue):
            (<CompletionQueue>cq)._pending_events += 1
            self.redelivered += 1
        return 0

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.channel != NULL:
            rc = ibv_destroy_comp_channel(self.channel)
            self.channel = NULL
            if rc:
                raise_errno("ibv_destroy_comp_channel", rc, repr(self))
        return 0

    def __repr__(self):
        name = self.context.name if self.context is not None else "?"
        return f"<CompChannel on {name}{' closed' if self._closed else ''}>"


@cython.no_gc_clear
cdef class CompletionQueue(VerbsObject):
    """A completion queue. Completions are polled into WC_DTYPE numpy arrays, never one object each."""

    def __init__(self, Context context not None, int cqe=256, CompChannel channel=None, int comp_vector=0):
        cdef int err = 0
        self._begin_init()
        context._check_open()
        if cqe < 1:
            raise UsageError(f"cqe must be >= 1, got {cqe}")
        max_cqe = context.query_device().max_cqe
        if cqe > max_cqe:
            raise UsageError(f"cqe={cqe} exceeds the device limit max_cqe={max_cqe}", obj=repr(context))
        if channel is not None and channel.context is not context:
            raise UsageError(f"the CompChannel belongs to {channel.context!r}, not to {context!r}")
        parents = [context] if channel is None else [context, channel]
        adopt(self, parents)
        self.context = context
        self.channel = channel
        # cq_context carries the serial: a channel event names its CQ by it (see wait()).
        self.cq = ibv_create_cq(context.ctx, cqe, <void *><uintptr_t>self._serial,
                                channel.channel if channel is not None else NULL, comp_vector)
        if self.cq != NULL:
            self._closed = False
            self.cqe = self.cq.cqe
        else:
            err = errno
        release(parents)
        if self.cq == NULL:
            self._abandon()
            raise_errno("ibv_create_cq", err, repr(context))

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.cq != NULL:
            rc = ibv_destroy_cq(self.cq)
            self.cq = NULL
            if rc:
                raise_errno("ibv_destroy_cq", rc, repr(self))
        return 0

    def __repr__(self):
        return f"<CompletionQueue cqe={self.cqe}{' closed' if self._closed else ''}>"

    def req_notify(self, bint solicited_only=False):
        """Arm the CQ: the next (solicited) completion raises an event on the channel."""
        self._check_open()    # the call holds the GIL: nothing closes the CQ under it
        rc = ibv_req_notify_cq(self.cq, solicited_only)
        if rc:
            raise_errno("ibv_req_notify_cq", rc, repr(self))

    def wait(self, timeout=None):
        """Block (GIL released) until the channel delivers an event for this CQ; acks it.
        Returns False when ``timeout`` seconds pass first. Call req_notify() before, and poll after.

        Several CQs may share a channel: an event read by another CQ's wait() is kept for this one,
        so a wait here returns at once. Ctrl-C interrupts the wait; close() from another thread
        makes it raise UsageError."""
        cdef cq_event_take take
        cdef int got
        cdef double deadline, seconds
        cdef CompChannel ch
        self._check_open()
        ch = self.channel
        if ch is None:
            raise UsageError("wait() needs a CQ created with a CompChannel", obj=repr(self))
        ch._check_open()
        seconds = wait_seconds(timeout)
        deadline = -1.0 if seconds < 0 else monotonic_now() + seconds
        take.channel = ch.channel
        while True:
            if self._pending_events > 0:
                self._pending_events -= 1
                return True
            take.ev_ctx = NULL
            got = wait_fd(ch.channel.fd, -1.0 if deadline < 0 else max(0.0, deadline - monotonic_now()),
                          _take_cq_event, &take, self, ch, &self._pending_events,
                          "CompletionQueue.wait", "ibv_get_cq_event")
            if got == 0:
                return False
            if got == 1:
                if <uintptr_t>take.ev_ctx == <uintptr_t>self._serial:
                    return True
                ch._deliver(<long long><uintptr_t>take.ev_ctx)
            # got == 2: another CQ's wait() read our event; the loop's top returns it

    cdef int poll_c(self, wc_record *out, int n) noexcept nogil:
        # Poll straight into the caller's records, in chunks through a stack array of ibv_wc.
        cdef ibv_wc wc[32]
        cdef int got, i, total = 0, want
        while total < n:
            want = n - total
            if want > 32:
                want = 32
            got = ibv_poll_cq(self.cq, want, wc)
            if got < 0:
                return -1 if total == 0 else total
            for i in range(got):
                out[total + i].wr_id = wc[i].wr_id
                out[total + i].status = wc[i].status
                out[total + i].opcode = wc[i].opcode
                out[total + i].vendor_err = wc[i].vendor_err
                out[total + i].byte_len = wc[i].byte_len
                out[total + i].imm_data = _ntohl(wc[i].imm_data)
                out[total + i].qp_num = wc[i].qp_num
                out[total + i].src_qp = wc[i].src_qp
                out[total + i].wc_flags = wc[i].wc_flags
                out[total + i].pkey_index = wc[i].pkey_index
                out[total + i].slid = wc[i].slid
                out[total + i].sl = wc[i].sl
                out[total + i].dlid_path_bits = wc[i].dlid_path_bits
            total += got
            if got < want:
                break
        return total

    def poll(self, int max_entries=16):
        """Poll up to ``max_entries`` completions into a new WC_DTYPE array (length = number polled)."""
        if max_entries < 0:
            raise UsageError(f"max_entries must be >= 0, got {max_entries}")
        wcs = np.empty(max_entries, WC_DTYPE)
        n = self.poll_into(wcs)
        return wcs[:n]

    def poll_into(self, wcs, bint check=False):
        """Poll into the preallocated WC_DTYPE array ``wcs``; returns how many entries were filled.
        ``check=True``: raise CompletionError (``exc.polled`` = entries filled) if one of them failed."""
        cdef Py_buffer view
        cdef int n
        cdef Py_ssize_t bad = -1
        if self.cq == NULL or self._closing:
            self._check_open()
        _get_wc_buffer(wcs, &view, True)
        try:
            use(self)    # close() from another thread waits for this poll to leave
        except BaseException:
            PyBuffer_Release(&view)
            raise
        with nogil:
            n = self.poll_c(<wc_record *>view.buf, _records(&view))
            if check and n > 0:
                bad = _first_failed(<wc_record *>view.buf, n)
        unuse(self)
        PyBuffer_Release(&view)
        if n < 0:
            raise_errno("ibv_poll_cq", errno, repr(self))
        if bad >= 0:
            raise _completion_error(wcs, bad, n)
        return n

    def poll_wait(self, wcs, int min_entries=1, timeout=None, bint check=False):
        """Busy-poll (GIL released) until at least ``min_entries`` completions are in ``wcs``.

        Returns the number filled. When ``timeout`` seconds pass first it returns what it has, or
        raises RDMATimeoutError if that is nothing, so no polled completion is ever lost. Every
        CHECK_INTERVAL_S it takes the GIL to run signal handlers (Ctrl-C raises KeyboardInterrupt);
        a close() of the CQ from another thread makes it raise UsageError. ``check=True`` scans the
        statuses in C before returning and raises CompletionError for the first failed one (its
        ``polled`` attribute says how many entries of ``wcs`` were filled): the fast idiom."""
        cdef Py_buffer view
        cdef int n = 0, got = 0, cap, spins = 0, stop = STOP_DONE, err = 0
        cdef Py_ssize_t bad = -1
        cdef double deadline, now, next_check
        if self.cq == NULL or self._closing:
            self._check_open()
        _get_wc_buffer(wcs, &view, True)
        try:
            cap = _records(&view)
            if not 1 <= min_entries <= cap:
                raise UsageError(f"min_entries={min_entries} must be within 1..len(wcs)={cap}")
            deadline = -1.0 if timeout is None else monotonic_now() + timeout
            while True:
                use(self)
                next_check = monotonic_now() + CHECK_INTERVAL_S
                with nogil:
                    stop = STOP_DONE
                    while n < min_entries:
                        got = self.poll_c((<wc_record *>view.buf) + n, cap - n)
                        if got < 0:
                            err = errno
                            stop = STOP_ERROR
                            break
                        n += got
                        if got == 0:
                            spins += 1
                            # the clock and the closing flag only every 256 empty polls: the busy
                            # path stays a bare ibv_poll_cq
                            if spins & 255 == 0:
                                if pyrdma_load_flag(&self._closing):
                                    stop = STOP_CLOSED
                                    break
                                now = monotonic_now()
                                if deadline >= 0 and now > deadline:
                                    stop = STOP_TIMEOUT
                                    break
                                if now > next_check:
                                    stop = STOP_CHECK
                                    break
                unuse(self)
                if stop != STOP_CHECK:
                    break
                PyErr_CheckSignals()   # Ctrl-C raises KeyboardInterrupt here (pyzmq's pattern)
            if check and n > 0:
                bad = _first_failed(<wc_record *>view.buf, n)
        finally:
            PyBuffer_Release(&view)
        if bad >= 0:
            raise _completion_error(wcs, bad, n)
        if stop == STOP_ERROR:
            raise_errno("ibv_poll_cq", err, repr(self))
        if stop == STOP_CLOSED:
            raise UsageError("closed while waiting", call="CompletionQueue.poll_wait", obj=repr(self))
        if n == 0:
            raise RDMATimeoutError(f"no completion within {timeout} s", call="ibv_poll_cq", obj=repr(self))
        return n


cdef inline int _records(Py_buffer *view) noexcept nogil:
    # how many wc_records fit in the buffer, clamped to what the C int counters hold
    cdef Py_ssize_t n = view.len // <Py_ssize_t>sizeof(wc_record)
    return <int>n if n < INT_MAX else INT_MAX


cdef inline uint32_t _ntohl(uint32_t x) noexcept nogil:
    return ((x & 0xff) << 24) | ((x & 0xff00) << 8) | ((x >> 8) & 0xff00) | (x >> 24)


cdef int _get_wc_buffer(object wcs, Py_buffer *view, bint writable) except -1:
    # numpy's buffer format string for packed records varies with alignment, so check the dtype.
    dtype = getattr(wcs, "dtype", None)
    if dtype is not WC_DTYPE and dtype != WC_DTYPE:
        raise UsageError("wcs must be a numpy array of dtype pyrdma.WC_DTYPE "
                         "(e.g. numpy.empty(64, pyrdma.WC_DTYPE))")
    try:
        PyObject_GetBuffer(wcs, view, (PyBUF_WRITABLE if writable else 0) | PyBUF_C_CONTIGUOUS)
    except (BufferError, TypeError, ValueError):
        raise UsageError(f"wcs must be a {'writable, ' if writable else ''}C-contiguous numpy array of dtype "
                         f"pyrdma.WC_DTYPE") from None
    return 0
