"""Completion channels and completion queues; completions are polled into numpy arrays."""
cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_C_CONTIGUOUS
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, ENOENT, EOPNOTSUPP, ENOSYS
from libc.string cimport memset
from libc.limits cimport INT_MAX
from libc.stdint cimport uintptr_t, uint16_t, uint64_t
from posix.fcntl cimport fcntl, F_GETFL, F_SETFL, O_NONBLOCK
from posix.unistd cimport usleep
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport (VerbsObject, raise_errno, monotonic_now, adopt, release, use, unuse,
                                 pyrdma_load_flag, wait_fd, wait_seconds)
from pyrdma._verbs.device cimport Context
import enum
import os

import numpy as np

from pyrdma.errors import CompletionError, RDMATimeoutError, UsageError
from pyrdma.errors import raise_errno as raise_py_errno

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


class WCExFlags(enum.IntFlag):
    """ibv_create_cq_wc_flags: what an extended CQ (``CompletionQueue(..., wc_flags=)``) records with
    each completion. STANDARD (the fields of WC_DTYPE) is always requested; COMPLETION_TIMESTAMP (the
    device clock) and COMPLETION_TIMESTAMP_WALLCLOCK (nanoseconds) fill ``poll_into(timestamps=)``."""
    WITH_BYTE_LEN = IBV_WC_EX_WITH_BYTE_LEN
    WITH_IMM = IBV_WC_EX_WITH_IMM
    WITH_QP_NUM = IBV_WC_EX_WITH_QP_NUM
    WITH_SRC_QP = IBV_WC_EX_WITH_SRC_QP
    WITH_SLID = IBV_WC_EX_WITH_SLID
    WITH_SL = IBV_WC_EX_WITH_SL
    WITH_DLID_PATH_BITS = IBV_WC_EX_WITH_DLID_PATH_BITS
    COMPLETION_TIMESTAMP = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
    CVLAN = IBV_WC_EX_WITH_CVLAN
    FLOW_TAG = IBV_WC_EX_WITH_FLOW_TAG
    COMPLETION_TIMESTAMP_WALLCLOCK = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK
    STANDARD = IBV_WC_STANDARD_FLAGS


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


cdef inline void _read_ex(ibv_cq_ex *cq, wc_record *rec, uint64_t *ts, int ts_kind) noexcept nogil:
    rec.wr_id = cq.wr_id
    rec.status = cq.status
    rec.vendor_err = ibv_wc_read_vendor_err(cq)
    rec.qp_num = ibv_wc_read_qp_num(cq)
    rec.pkey_index = 0          # an extended CQ has no pkey_index
    if cq.status == IBV_WC_SUCCESS:
        rec.opcode = ibv_wc_read_opcode(cq)
        rec.byte_len = ibv_wc_read_byte_len(cq)
        rec.wc_flags = ibv_wc_read_wc_flags(cq)
        rec.imm_data = _ntohl(ibv_wc_read_imm_data(cq)) if rec.wc_flags & IBV_WC_WITH_IMM else 0
        rec.src_qp = ibv_wc_read_src_qp(cq)
        rec.slid = <uint16_t>ibv_wc_read_slid(cq)
        rec.sl = ibv_wc_read_sl(cq)
        rec.dlid_path_bits = ibv_wc_read_dlid_path_bits(cq)
    else:                       # only wr_id, status, vendor_err and qp_num are valid on an error
        rec.opcode = rec.byte_len = rec.wc_flags = rec.imm_data = rec.src_qp = 0
        rec.slid = 0
        rec.sl = rec.dlid_path_bits = 0
    if ts != NULL:
        if ts_kind == 2:
            ts[0] = ibv_wc_read_completion_wallclock_ns(cq)
        elif ts_kind == 1:
            ts[0] = ibv_wc_read_completion_ts(cq)
        else:
            ts[0] = 0


cdef int _poll_ex(ibv_cq_ex *cq, wc_record *out, uint64_t *ts, int ts_kind, int n) noexcept nogil:
    """Up to ``n`` completions of an extended CQ into ``out`` (and ``ts``); -1 with errno on failure.

    One completion per ibv_start_poll/ibv_end_poll batch, never ibv_next_poll: rxe's next_poll, on
    finding the queue empty, already stores the consumer index and drops the CQ's lock, so the
    ibv_end_poll the verbs flow calls next advances past a completion not yet written (it was lost,
    and a stale record returned in its place). A batch of one is correct on every provider."""
    cdef ibv_poll_cq_attr attr
    cdef int rc, total = 0
    attr.comp_mask = 0
    while total < n:
        rc = ibv_start_poll(cq, &attr)
        if rc == ENOENT:
            break
        if rc:
            if total == 0:
                errno = rc      # nothing to end: start_poll failed
                return -1
            break               # the next poll reports it
        _read_ex(cq, out + total, ts + total if ts != NULL else NULL, ts_kind)
        ibv_end_poll(cq)
        total += 1
    return total


cdef int _refused_cq_ex(Context context, uint64_t flags, int err) except -1:
    """ibv_create_cq_ex failed: say which flag the device lacks, where that is why."""
    cdef ibv_device_attr_ex a
    extra = WCExFlags(flags & ~(<uint64_t>IBV_WC_STANDARD_FLAGS))
    if extra:
        memset(&a, 0, sizeof(a))
        has_ts = ibv_query_device_ex(context.ctx, NULL, &a) == 0 and a.completion_timestamp_mask != 0
        why = "" if has_ts else "; query_device_ex: completion_timestamp_mask is 0, no completion clock"
        cause = os.strerror(err) if err else "no reason given"
        raise_py_errno("ibv_create_cq_ex", err, repr(context),
                       f"{context.name} refused the extended CQ's wc_flags {extra!r} ({cause}{why})")
    if err in (EOPNOTSUPP, ENOSYS):
        raise_py_errno("ibv_create_cq_ex", err, repr(context), f"{context.name} has no extended CQ")
    raise_py_errno("ibv_create_cq_ex", err, repr(context))
    return -1


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

    def __init__(self, Context context not None, int cqe=256, CompChannel channel=None, int comp_vector=0,
                 bint extended=False, wc_flags=None):
        """``extended=True`` (or any ``wc_flags``, a WCExFlags) makes it with ibv_create_cq_ex: it is
        polled with ibv_start_poll/next_poll/end_poll into the same WC_DTYPE arrays, and with
        COMPLETION_TIMESTAMP(_WALLCLOCK) in ``wc_flags`` poll_into/poll_wait fill ``timestamps=``.
        A flag the device does not offer is refused with an RDMAError that names it."""
        cdef int err = 0
        cdef ibv_cq_init_attr_ex attr
        cdef uint64_t flags = 0
        self._begin_init()
        context._check_open()
        if cqe < 1:
            raise UsageError(f"cqe must be >= 1, got {cqe}")
        max_cqe = context.query_device().max_cqe
        if cqe > max_cqe:
            raise UsageError(f"cqe={cqe} exceeds the device limit max_cqe={max_cqe}", obj=repr(context))
        if channel is not None and channel.context is not context:
            raise UsageError(f"the CompChannel belongs to {channel.context!r}, not to {context!r}")
        if wc_flags is not None:
            extended = True
            try:
                flags = int(WCExFlags(wc_flags)) | IBV_WC_STANDARD_FLAGS
            except (TypeError, ValueError):
                raise UsageError(f"wc_flags must be WCExFlags, got {wc_flags!r}") from None
        elif extended:
            flags = IBV_WC_STANDARD_FLAGS
        if flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK:
            self.ts_kind = 2
        elif flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP:
            self.ts_kind = 1
        parents = [context] if channel is None else [context, channel]
        adopt(self, parents)
        self.context = context
        self.channel = channel
        # cq_context carries the serial: a channel event names its CQ by it (see wait()).
        if extended:
            memset(&attr, 0, sizeof(attr))
            attr.cqe = cqe
            attr.cq_context = <void *><uintptr_t>self._serial
            attr.channel = channel.channel if channel is not None else NULL
            attr.comp_vector = comp_vector
            attr.wc_flags = flags
            self.cq_ex = ibv_create_cq_ex(context.ctx, &attr)
            if self.cq_ex != NULL:
                self.cq = ibv_cq_ex_to_cq(self.cq_ex)
        else:
            self.cq = ibv_create_cq(context.ctx, cqe, <void *><uintptr_t>self._serial,
                                    channel.channel if channel is not None else NULL, comp_vector)
        if self.cq != NULL:
            self._closed = False
            self.cqe = self.cq.cqe
            self.wc_flags = WCExFlags(flags) if extended else None
        else:
            err = errno
        release(parents)
        if self.cq == NULL:
            self._abandon()
            if extended:
                _refused_cq_ex(context, flags, err)
            raise_errno("ibv_create_cq", err, repr(context))

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.cq != NULL:
            rc = ibv_destroy_cq(self.cq)      # an extended CQ too (through its ibv_cq view)
            self.cq = NULL
            self.cq_ex = NULL
            if rc:
                raise_errno("ibv_destroy_cq", rc, repr(self))
        return 0

    def __repr__(self):
        ext = f" extended {self.wc_flags!r}" if self.wc_flags is not None else ""
        return f"<CompletionQueue cqe={self.cqe}{ext}{' closed' if self._closed else ''}>"

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
        return self.poll_ts_c(out, NULL, n)

    cdef int poll_ts_c(self, wc_record *out, uint64_t *ts, int n) noexcept nogil:
        # Poll straight into the caller's records: an extended CQ through ibv_start_poll, a plain one
        # in chunks through a stack array of ibv_wc. ``ts`` (extended CQs with a timestamp flag only)
        # receives each completion's timestamp.
        cdef ibv_wc wc[32]
        if self.cq_ex != NULL:          # ibv_start_poll/ibv_end_poll (see _poll_ex)
            return _poll_ex(self.cq_ex, out, ts, self.ts_kind, n)
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

    def poll_into(self, wcs, bint check=False, timestamps=None):
        """Poll into the preallocated WC_DTYPE array ``wcs``; returns how many entries were filled.
        ``check=True``: raise CompletionError (``exc.polled`` = entries filled) if one of them failed.
        ``timestamps``: a uint64 array (at least len(wcs)) that receives each completion's timestamp
        (extended CQs made with WCExFlags.COMPLETION_TIMESTAMP or COMPLETION_TIMESTAMP_WALLCLOCK)."""
        cdef Py_buffer view
        cdef int n, cap
        cdef Py_ssize_t bad = -1
        cdef uint64_t *ts = NULL
        if self.cq == NULL or self._closing:
            self._check_open()
        _get_wc_buffer(wcs, &view, True)
        try:
            cap = _records(&view)
            if timestamps is not None:
                ts = self._timestamps(timestamps, cap)
            use(self)    # close() from another thread waits for this poll to leave
        except BaseException:
            PyBuffer_Release(&view)
            raise
        with nogil:
            n = self.poll_ts_c(<wc_record *>view.buf, ts, cap)
            if check and n > 0:
                bad = _first_failed(<wc_record *>view.buf, n)
        unuse(self)
        PyBuffer_Release(&view)
        if n < 0:
            raise_errno("ibv_poll_cq", errno, repr(self))
        if bad >= 0:
            raise _completion_error(wcs, bad, n)
        return n

    cdef uint64_t *_timestamps(self, timestamps, int cap) except? NULL:
        if self.ts_kind == 0:
            raise UsageError("timestamps= needs an extended CQ made with wc_flags=WCExFlags.COMPLETION_TIMESTAMP "
                             "(or COMPLETION_TIMESTAMP_WALLCLOCK)", obj=repr(self))
        if not isinstance(timestamps, np.ndarray) or timestamps.dtype != np.uint64 \
                or not timestamps.flags.c_contiguous or not timestamps.flags.writeable or timestamps.size < cap:
            raise UsageError(f"timestamps must be a writable C-contiguous uint64 array of at least {cap} "
                             f"entries (len(wcs)), got {type(timestamps).__name__}", obj=repr(self))
        return <uint64_t *><uintptr_t>timestamps.ctypes.data

    def poll_wait(self, wcs, int min_entries=1, timeout=None, bint check=False, timestamps=None):
        """Busy-poll (GIL released) until at least ``min_entries`` completions are in ``wcs``.

        Returns the number filled. When ``timeout`` seconds pass first it returns what it has, or
        raises RDMATimeoutError if that is nothing, so no polled completion is ever lost. Every
        CHECK_INTERVAL_S it takes the GIL to run signal handlers (Ctrl-C raises KeyboardInterrupt);
        a close() of the CQ from another thread makes it raise UsageError. ``check=True`` scans the
        statuses in C before returning and raises CompletionError for the first failed one (its
        ``polled`` attribute says how many entries of ``wcs`` were filled): the fast idiom.
        ``timestamps``: as for poll_into."""
        cdef uint64_t *ts = NULL
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
            if timestamps is not None:
                ts = self._timestamps(timestamps, cap)
            deadline = -1.0 if timeout is None else monotonic_now() + timeout
            while True:
                use(self)
                next_check = monotonic_now() + CHECK_INTERVAL_S
                with nogil:
                    stop = STOP_DONE
                    while n < min_entries:
                        got = self.poll_ts_c((<wc_record *>view.buf) + n, ts + n if ts != NULL else NULL, cap - n)
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
