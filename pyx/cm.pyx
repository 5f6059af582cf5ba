"""rdma_cm (librdmacm): address and route resolution, listen/accept/connect, the QP on a CM id.

A ``CMID`` made without a channel is synchronous: it gets a private ``CMEventChannel`` and each call
that starts a CM exchange (resolve_addr, resolve_route, connect, accept, get_request) waits for its
event, interruptibly, and raises on an error event. A ``CMID`` made on a caller's channel is
asynchronous: the calls return at once and the caller reads ``CMEvent`` objects from the channel
(``get_event``, or its ``fileno`` under select/asyncio). Events are acknowledged as soon as they are
read, so destroying an id never waits on an event the caller holds.
"""
cimport cython
from libc.errno cimport errno
from libc.string cimport memset, memcpy
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uintptr_t
from posix.fcntl cimport fcntl, F_GETFL, F_SETFL, O_NONBLOCK
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.librdmacm cimport *
from pyrdma._verbs.base cimport (VerbsObject, raise_errno, adopt, release, use, unuse, refuse, monotonic_now,
                                 wait_fd, wait_seconds)
from pyrdma._verbs.device cimport Context, borrow_context
from pyrdma._verbs.loader cimport require_library, PYRDMA_DL_RDMACM
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.cq cimport CompletionQueue
from pyrdma._verbs.srq cimport SharedReceiveQueue
from pyrdma._verbs.qp cimport QueuePair, wrap_cm_qp
import enum
import socket
import struct
import weakref

from pyrdma.errors import RDMAError, UsageError, RDMATimeoutError



class CMEventType(enum.IntEnum):
    """rdma_cm_event_type."""
    ADDR_RESOLVED = RDMA_CM_EVENT_ADDR_RESOLVED
    ADDR_ERROR = RDMA_CM_EVENT_ADDR_ERROR
    ROUTE_RESOLVED = RDMA_CM_EVENT_ROUTE_RESOLVED
    ROUTE_ERROR = RDMA_CM_EVENT_ROUTE_ERROR
    CONNECT_REQUEST = RDMA_CM_EVENT_CONNECT_REQUEST
    CONNECT_RESPONSE = RDMA_CM_EVENT_CONNECT_RESPONSE
    CONNECT_ERROR = RDMA_CM_EVENT_CONNECT_ERROR
    UNREACHABLE = RDMA_CM_EVENT_UNREACHABLE
    REJECTED = RDMA_CM_EVENT_REJECTED
    ESTABLISHED = RDMA_CM_EVENT_ESTABLISHED
    DISCONNECTED = RDMA_CM_EVENT_DISCONNECTED
    DEVICE_REMOVAL = RDMA_CM_EVENT_DEVICE_REMOVAL
    MULTICAST_JOIN = RDMA_CM_EVENT_MULTICAST_JOIN
    MULTICAST_ERROR = RDMA_CM_EVENT_MULTICAST_ERROR
    ADDR_CHANGE = RDMA_CM_EVENT_ADDR_CHANGE
    TIMEWAIT_EXIT = RDMA_CM_EVENT_TIMEWAIT_EXIT


class PortSpace(enum.IntEnum):
    """rdma_port_space: TCP gives RC connections, UDP gives UD queue pairs."""
    IPOIB = RDMA_PS_IPOIB
    TCP = RDMA_PS_TCP
    UDP = RDMA_PS_UDP
    IB = RDMA_PS_IB


PS_TCP, PS_UDP = PortSpace.TCP, PortSpace.UDP
# Events that end a synchronous exchange with an error, whatever it waited for.
_ERROR_EVENTS = frozenset((CMEventType.ADDR_ERROR, CMEventType.ROUTE_ERROR, CMEventType.CONNECT_ERROR,
                           CMEventType.UNREACHABLE, CMEventType.REJECTED, CMEventType.DEVICE_REMOVAL))


class CMEvent:
    """One rdma_cm event, already acknowledged. ``type`` (CMEventType), ``status`` (0, a negative
    errno, or a reject reason), ``id`` (the CMID it is about; for CONNECT_REQUEST the new id, not
    yet accepted), ``listen_id``, ``private_data`` (bytes), and ``param``: for connection events
    ``responder_resources``, ``initiator_depth``, ``retry_count``, ``rnr_retry_count``, ``srq``,
    ``qp_num``; for UD ids ``qp_num``, ``qkey`` and ``ah_attr`` (a dict: dlid, sl, port_num,
    is_global, dgid, sgid_index, hop_limit, traffic_class, flow_label) to address the peer."""
    __slots__ = ("type", "status", "id", "listen_id", "private_data", "param")

    def __init__(self, type, status=0, id=None, listen_id=None, private_data=b"", param=None):
        self.type, self.status, self.id, self.listen_id = type, status, id, listen_id
        self.private_data, self.param = private_data, param or {}

    def __repr__(self):
        status = f" status={self.status}" if self.status else ""
        name = self.type.name if isinstance(self.type, CMEventType) else self.type
        return f"<CMEvent {name}{status} id={self.id!r}>"


# A copy of one event, taken without the GIL before it is acknowledged.
cdef struct event_copy:
    int event
    int status
    int ps
    rdma_cm_id *id
    long long id_serial
    long long listen_serial
    rdma_conn_param conn
    rdma_ud_param ud
    uint8_t pdata[256]
    int pdata_len


cdef inline long long _serial_of(rdma_cm_id *id) noexcept nogil:
    return <long long><uintptr_t>id.context if id != NULL else 0


cdef void _copy_event(rdma_cm_event *ev, event_copy *out) noexcept nogil:
    cdef const void *pdata
    out.event = ev.event
    out.status = ev.status
    out.id = ev.id
    out.ps = ev.id.ps if ev.id != NULL else 0
    out.id_serial = _serial_of(ev.id)
    out.listen_serial = _serial_of(ev.listen_id)
    memcpy(&out.conn, &ev.param.conn, sizeof(rdma_conn_param))
    memcpy(&out.ud, &ev.param.ud, sizeof(rdma_ud_param))
    if out.ps == RDMA_PS_UDP:
        pdata, out.pdata_len = ev.param.ud.private_data, ev.param.ud.private_data_len
    else:
        pdata, out.pdata_len = ev.param.conn.private_data, ev.param.conn.private_data_len
    if pdata == NULL:
        out.pdata_len = 0
    if out.pdata_len:
        memcpy(out.pdata, pdata, out.pdata_len)


cdef struct cm_event_take:
    rdma_event_channel *channel
    event_copy copy


cdef int _take_cm_event(void *arg) noexcept nogil:
    # copied and acknowledged at once, so destroying the event's id never waits on it
    cdef cm_event_take *take = <cm_event_take *>arg
    cdef rdma_cm_event *ev = NULL
    if rdma_get_cm_event(take.channel, &ev) != 0:
        return -errno
    _copy_event(ev, &take.copy)
    rdma_ack_cm_event(ev)
    return 1


cdef void _destroy_cm_qp(void *id) noexcept nogil:
    rdma_destroy_qp(<rdma_cm_id *>id)


cdef bytes _sockaddr(host, port):
    """A sockaddr_in/sockaddr_in6 for ``host`` (numeric address or name; None: any) and ``port``."""
    if not 0 <= port <= 0xFFFF:
        raise UsageError(f"port must be within 0..65535, got {port}")
    if host is None or host == "":
        host = "0.0.0.0"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve {host!r}: {exc}") from None
    if family == socket.AF_INET:
        return struct.pack("=H", family) + struct.pack("!H4s8x", port, socket.inet_aton(addr[0]))
    if family == socket.AF_INET6:
        return (struct.pack("=H", family) + struct.pack("!HI16s", port, addr[2],
                                                        socket.inet_pton(socket.AF_INET6, addr[0]))
                + struct.pack("=I", addr[3]))
    raise UsageError(f"{host!r} is neither IPv4 nor IPv6")


cdef object _addr_tuple(sockaddr *sa):
    cdef const unsigned char *raw = <const unsigned char *>sa
    if sa == NULL:
        return None
    if sa.sa_family == socket.AF_INET:
        port, addr = struct.unpack("!H4s", raw[2:8])
        return socket.inet_ntoa(addr), port
    if sa.sa_family == socket.AF_INET6:
        port, _, addr = struct.unpack("!HI16s", raw[2:24])
        return socket.inet_ntop(socket.AF_INET6, addr), port
    return None


cdef int _ms(timeout, str name) except? -1:
    if timeout is None or not 0 < timeout <= 2147483:
        raise UsageError(f"{name} must be a number of seconds within (0, 2147483], got {timeout!r}")
    return max(1, <int>(timeout * 1000))


cdef bytes _private(private_data, int limit):
    data = bytes(private_data) if private_data is not None else b""
    if len(data) > limit:
        raise UsageError(f"private_data is {len(data)} bytes; this port space carries at most {limit}")
    return data


@cython.no_gc_clear
cdef class CMEventChannel(VerbsObject):
    """An rdma_cm event channel: CM ids made on it report their events here. ``fileno()`` is
    readable when ``get_event(timeout=0)`` has an event."""

    def __init__(self):
        require_library(PYRDMA_DL_RDMACM, "rdma_create_event_channel")
        self._begin_init()
        with nogil:
            self.channel = rdma_create_event_channel()
        if self.channel == NULL:
            raise_errno("rdma_create_event_channel", errno)
        self._closed = False

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        if self.channel != NULL:
            with nogil:
                rdma_destroy_event_channel(self.channel)
            self.channel = NULL
        return 0

    def __repr__(self):
        fd = self.channel.fd if self.channel != NULL else -1
        return f"<CMEventChannel fd={fd}{' closed' if self._closed else ''}>"

    def fileno(self):
        """The channel's fd (made non-blocking), for select/poll/asyncio."""
        self._check_open()
        fd = self.channel.fd
        flags = fcntl(fd, F_GETFL)
        if flags >= 0 and not flags & O_NONBLOCK:
            fcntl(fd, F_SETFL, flags | O_NONBLOCK)
        return fd

    cdef object _lookup(self, long long serial):
        ref = self._children.get(serial)
        return ref() if ref is not None else None

    def get_event(self, timeout=None):
        """The next CMEvent, acknowledged; None when ``timeout`` seconds pass first (0: just look).
        Waits with the GIL released; Ctrl-C interrupts it, close() from another thread makes it raise
        UsageError."""
        cdef cm_event_take take
        cdef int fd = self.fileno()
        take.channel = self.channel
        if wait_fd(fd, wait_seconds(timeout), _take_cm_event, &take, self, None, NULL,
                   "CMEventChannel.get_event", "rdma_get_cm_event") == 0:
            return None
        return _make_event(self, &take.copy)

cdef object _make_event(CMEventChannel self, event_copy *c):
    cdef int i
    kind = c.event
    try:
        kind = CMEventType(kind)
    except ValueError:
        pass
    listen = self._lookup(c.listen_serial) if c.listen_serial else None
    if c.event == RDMA_CM_EVENT_CONNECT_REQUEST:
        cm_id = _wrap_request(self, c.id, c.ps)
    else:
        cm_id = self._lookup(c.id_serial)
    if c.ps == RDMA_PS_UDP:
        a = &c.ud.ah_attr
        param = dict(qp_num=c.ud.qp_num, qkey=c.ud.qkey,
                     ah_attr=dict(dlid=a.dlid, sl=a.sl, port_num=a.port_num, is_global=a.is_global,
                                  dgid=bytes([a.grh.dgid.raw[i] for i in range(16)]),
                                  sgid_index=a.grh.sgid_index, hop_limit=a.grh.hop_limit,
                                  traffic_class=a.grh.traffic_class, flow_label=a.grh.flow_label))
    else:
        param = dict(responder_resources=c.conn.responder_resources, initiator_depth=c.conn.initiator_depth,
                     retry_count=c.conn.retry_count, rnr_retry_count=c.conn.rnr_retry_count,
                     srq=c.conn.srq, qp_num=c.conn.qp_num)
    event = CMEvent(kind, c.status, cm_id, listen, bytes(c.pdata[:c.pdata_len]), param)
    if c.event == RDMA_CM_EVENT_CONNECT_REQUEST and cm_id is not None:
        (<CMID>cm_id).request = event
    return event


cdef CMID _wrap_request(CMEventChannel channel, rdma_cm_id *id, int ps):
    # librdmacm made a new id for a connection request, on the listener's channel.
    cdef CMID self = CMID.__new__(CMID)
    self._initialised = True
    channel._adopt(self)
    self.channel = channel
    self.id = id
    self.ps = ps
    id.context = <void *><uintptr_t>self._serial
    self._closed = False
    return self


@cython.no_gc_clear
cdef class CMID(VerbsObject):
    """An rdma_cm id: ``CMID(channel=None, ps=PortSpace.TCP)``. Without a channel it is synchronous
    (its calls wait for their events); on a channel, the caller reads the events."""

    def __init__(self, CMEventChannel channel=None, int ps=RDMA_PS_TCP):
        cdef int rc, err = 0
        self._begin_init()
        if ps not in (RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB, RDMA_PS_IPOIB):
            raise UsageError(f"unsupported port space {ps}; use PortSpace.TCP or PortSpace.UDP")
        own = channel is None
        if own:
            channel = CMEventChannel()
        parents = [channel]
        try:
            adopt(self, parents)
        except BaseException:
            if own:
                channel.close()
            raise
        self.channel, self.ps, self._own_channel = channel, ps, own
        with nogil:
            rc = rdma_create_id(channel.channel, &self.id, <void *><uintptr_t>self._serial,
                                <rdma_port_space>ps)
            if rc:
                err = errno
        release(parents)
        if rc:
            self.id = NULL
            self._abandon()
            if own:
                channel.close()
            raise_errno("rdma_create_id", err, repr(channel))
        self._closed = False

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc = 0, err = 0
        if self.id != NULL:
            with nogil:
                rc = rdma_destroy_id(self.id)
                if rc:
                    err = errno
            self.id = NULL
        if self._own_channel and self.channel is not None:
            self.channel.close()    # a parent closed from its child: a nested close on this thread returns
        if rc:
            raise_errno("rdma_destroy_id", err, repr(self))
        return 0

    def __repr__(self):
        if self._closed or self.id == NULL:
            return f"<CMID {PortSpace(self.ps).name if self.ps else '?'} closed>"
        local, peer = self.local_addr, self.peer_addr
        where = f" {local[0]}:{local[1]}" if local else ""
        where += f" -> {peer[0]}:{peer[1]}" if peer and peer[1] else ""
        return f"<CMID {PortSpace(self.ps).name}{where}>"

    cdef int _call(self, int rc, int err, str call) except -1:
        if rc:
            raise_errno(call, err, repr(self))
        return 0

    # ---- what the id knows ---------------------------------------------------------------------

    @property
    def context(self):
        """The verbs Context of the device the id is bound to (None before the address is bound or
        resolved). It is librdmacm's own context: make the PD and CQs for create_qp on it."""
        self._check_open()
        if self.id.verbs == NULL:
            return None
        key = <uintptr_t>self.id.verbs
        ctx = _contexts.get(key)
        if ctx is None or ctx.closed:
            ctx = borrow_context(self.id.verbs)
            _contexts[key] = ctx
        return ctx

    @property
    def port_num(self):
        self._check_open()
        return self.id.port_num

    @property
    def local_addr(self):
        """(address, port) the id is bound to, or None."""
        if self._closed or self.id == NULL:
            return None
        return _addr_tuple(rdma_get_local_addr(self.id))

    @property
    def peer_addr(self):
        """(address, port) of the peer, or None."""
        if self._closed or self.id == NULL:
            return None
        return _addr_tuple(rdma_get_peer_addr(self.id))

    @property
    def qp(self):
        """The QueuePair create_qp made on this id, while it is open; else None."""
        qp = self._qp_ref() if self._qp_ref is not None else None
        return qp if qp is not None and not qp.closed else None

    # ---- synchronous waits ---------------------------------------------------------------------

    def wait_event(self, expected, timeout=None):
        """Synchronous ids: wait for the next event of this id and check it is ``expected`` (a
        CMEventType); an error event, another type or the timeout raise. Returns the CMEvent."""
        return self._wait(CMEventType(expected), timeout, f"CMID.wait_event({CMEventType(expected).name})")

    def _wait(self, expected, timeout, call):
        if not self._own_channel:
            raise UsageError("this id reports its events on a caller's CMEventChannel: read them there",
                             obj=repr(self))
        ev = self.channel.get_event(timeout)
        if ev is None:
            raise RDMATimeoutError(f"no {expected.name} event within {timeout} s", call=call, obj=repr(self))
        if ev.type != expected:
            name = ev.type.name if isinstance(ev.type, CMEventType) else ev.type
            err = -ev.status if ev.status < 0 else None
            what = f"status {ev.status}" if ev.status >= 0 else "error"
            raise RDMAError(f"got {name} ({what}) while waiting for {expected.name}", errno=err, call=call,
                            obj=repr(self))
        return ev

    # ---- addresses and routes ------------------------------------------------------------------

    def bind_addr(self, host=None, int port=0):
        """Bind to a local address (None: any) and port (0: any); binding to an RDMA device's address
        fixes ``context``."""
        cdef bytes sa = _sockaddr(host, port)
        cdef sockaddr *sap = <sockaddr *><char *>sa
        cdef int rc, err = 0
        use(self)
        with nogil:
            rc = rdma_bind_addr(self.id, sap)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_bind_addr")

    def resolve_addr(self, host, int port, src=None, timeout=2.0):
        """Resolve the destination address (and the local device); synchronous ids wait for
        ADDR_RESOLVED. ``src``: a local address to resolve from."""
        cdef bytes dst = _sockaddr(host, port)
        cdef bytes srcaddr = _sockaddr(src, 0) if src is not None else None
        cdef sockaddr *srcp = <sockaddr *><char *>srcaddr if srcaddr is not None else NULL
        cdef sockaddr *dstp = <sockaddr *><char *>dst
        cdef int ms = _ms(timeout, "timeout"), rc, err = 0
        use(self)
        with nogil:
            rc = rdma_resolve_addr(self.id, srcp, dstp, ms)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_resolve_addr")
        if self._own_channel:
            self._wait(CMEventType.ADDR_RESOLVED, timeout + 5.0, "rdma_resolve_addr")

    def resolve_route(self, timeout=2.0):
        """Resolve the route to the resolved address; synchronous ids wait for ROUTE_RESOLVED."""
        cdef int ms = _ms(timeout, "timeout"), rc, err = 0
        use(self)
        with nogil:
            rc = rdma_resolve_route(self.id, ms)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_resolve_route")
        if self._own_channel:
            self._wait(CMEventType.ROUTE_RESOLVED, timeout + 5.0, "rdma_resolve_route")

    # ---- the queue pair ------------------------------------------------------------------------

    def create_qp(self, ProtectionDomain pd not None, CompletionQueue send_cq not None,
                  CompletionQueue recv_cq=None, int max_send_wr=128, int max_recv_wr=128,
                  int max_send_sge=1, int max_recv_sge=1, int max_inline_data=0,
                  SharedReceiveQueue srq=None, bint sq_sig_all=False):
        """Create the id's QP (rdma_create_qp: RC on a TCP id, UD on a UDP id) and return it as a
        QueuePair for the usual post_* calls. librdmacm moves it through its states (a UD QP is in RTS
        at once; an RC QP when the connection is established). The PD and CQs must be on ``context``.
        Closing the id, the PD or a CQ closes the QP (rdma_destroy_qp)."""
        cdef ibv_qp_init_attr attr
        cdef int rc, err = 0
        self._check_open()
        if recv_cq is None:
            recv_cq = send_cq
        for obj in (pd, send_cq, recv_cq) + ((srq,) if srq is not None else ()):
            (<VerbsObject>obj)._check_open()
        if self.id.verbs == NULL:
            raise UsageError("the id has no device yet: bind_addr or resolve_addr first", obj=repr(self))
        if pd.context.ctx != self.id.verbs or send_cq.context.ctx != self.id.verbs \
                or recv_cq.context.ctx != self.id.verbs:
            raise UsageError("the PD and CQs must be made on this id's context (cm_id.context)", obj=repr(self))
        if self.qp is not None:
            raise UsageError("this id already has a QP", obj=repr(self))
        for name, value in (("max_send_wr", max_send_wr), ("max_recv_wr", max_recv_wr),
                            ("max_send_sge", max_send_sge), ("max_recv_sge", max_recv_sge)):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if max_inline_data < 0:
            raise UsageError(f"max_inline_data must be >= 0, got {max_inline_data}")
        parents = [pd, send_cq] + ([recv_cq] if recv_cq is not send_cq else []) \
            + ([srq] if srq is not None else []) + [self]
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = send_cq.cq
        attr.recv_cq = recv_cq.cq
        attr.srq = srq.srq if srq is not None else NULL
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = 0 if srq is not None else max_recv_wr
        attr.cap.max_send_sge = max_send_sge
        attr.cap.max_recv_sge = 0 if srq is not None else max_recv_sge
        attr.cap.max_inline_data = max_inline_data
        attr.qp_type = IBV_QPT_UD if self.ps in (RDMA_PS_UDP, RDMA_PS_IPOIB) else IBV_QPT_RC
        attr.sq_sig_all = sq_sig_all
        for parent in parents:
            use(<VerbsObject>parent)
        with nogil:
            rc = rdma_create_qp(self.id, pd.pd, &attr)
            err = errno if rc else 0
        for parent in parents:
            unuse(<VerbsObject>parent)
        self._call(rc, err, "rdma_create_qp")
        cap = dict(max_send_wr=attr.cap.max_send_wr, max_recv_wr=attr.cap.max_recv_wr,
                   max_send_sge=attr.cap.max_send_sge, max_recv_sge=attr.cap.max_recv_sge,
                   max_inline_data=attr.cap.max_inline_data)
        qp = wrap_cm_qp(self.id.qp, <void *>self.id, _destroy_cm_qp, parents, pd, send_cq, recv_cq, srq,
                        self.id.port_num, cap)
        self._qp_ref = weakref.ref(qp)
        return qp

    # ---- connections ---------------------------------------------------------------------------

    def listen(self, int backlog=16):
        """Listen for connection requests on the bound address."""
        cdef int rc, err = 0
        use(self)
        with nogil:
            rc = rdma_listen(self.id, backlog)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_listen")

    def get_request(self, timeout=None):
        """Synchronous listening ids: wait for a connection request and return its new CMID
        (synchronous too; ``.request`` is the CONNECT_REQUEST event with the peer's private data).
        Accept it (after create_qp) or reject it."""
        cdef CMID new
        cdef CMEventChannel own
        cdef int rc, err = 0
        ev = self._wait(CMEventType.CONNECT_REQUEST, timeout, "rdma_get_request")
        new = ev.id
        # Give the new id a channel of its own (as librdmacm's synchronous ids do), so that it outlives
        # this listener and its events do not mix with the listener's requests.
        own = CMEventChannel()
        use(new)
        use(own)
        with nogil:
            rc = rdma_migrate_id(new.id, own.channel)
            err = errno if rc else 0
        unuse(own)
        unuse(new)
        if rc:
            own.close()
            new.close()
            raise_errno("rdma_migrate_id", err, repr(new))
        self.channel._children.pop(new._serial, None)
        new._parents.remove(self.channel)
        own._adopt(new)
        new.channel = own
        new._own_channel = True
        return new

    def connect(self, private_data=None, int responder_resources=1, int initiator_depth=1,
                int retry_count=7, int rnr_retry_count=7, timeout=10.0):
        """Connect to the resolved peer (after resolve_route and create_qp). Synchronous ids wait for
        ESTABLISHED and return that CMEvent (for UD ids its ``param`` addresses the peer); REJECTED,
        UNREACHABLE or CONNECT_ERROR raise RDMAError."""
        cdef rdma_conn_param p
        cdef bytes data = _private(private_data, 56 if self.ps == RDMA_PS_TCP else 180)
        cdef int rc, err = 0
        _conn_param(&p, data, responder_resources, initiator_depth, retry_count, rnr_retry_count)
        use(self)
        with nogil:
            rc = rdma_connect(self.id, &p)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_connect")
        if self._own_channel:
            return self._wait(CMEventType.ESTABLISHED, timeout, "rdma_connect")

    def accept(self, private_data=None, int responder_resources=1, int initiator_depth=1,
               int retry_count=7, int rnr_retry_count=7, qkey=None, timeout=10.0):
        """Accept the connection request this id came from (after create_qp). Synchronous RC ids
        wait for ESTABLISHED and return it (UD ids have no such event: None)."""
        cdef rdma_conn_param p
        cdef bytes data = _private(private_data, 196 if self.ps == RDMA_PS_TCP else 136)
        cdef int rc, err = 0
        self._check_open()
        _conn_param(&p, data, responder_resources, initiator_depth, retry_count, rnr_retry_count)
        if self.id.qp != NULL:
            p.qp_num = self.id.qp.qp_num
        use(self)
        with nogil:
            rc = rdma_accept(self.id, &p)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_accept")
        if self._own_channel and self.ps == RDMA_PS_TCP:
            return self._wait(CMEventType.ESTABLISHED, timeout, "rdma_accept")
        return None

    def reject(self, private_data=None):
        """Reject the connection request this id came from."""
        cdef bytes data = _private(private_data, 148)
        cdef const char *pdata = <const char *>data if data else NULL
        cdef uint8_t plen = len(data)
        cdef int rc, err = 0
        use(self)
        with nogil:
            rc = rdma_reject(self.id, pdata, plen)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_reject")

    def disconnect(self):
        """Disconnect (the QP goes to ERR, its outstanding work is flushed); the peer gets
        DISCONNECTED, and so does this id."""
        cdef int rc, err = 0
        use(self)
        with nogil:
            rc = rdma_disconnect(self.id)
            err = errno if rc else 0
        unuse(self)
        self._call(rc, err, "rdma_disconnect")


cdef int _conn_param(rdma_conn_param *p, bytes data, int responder_resources, int initiator_depth,
                     int retry_count, int rnr_retry_count) except -1:
    """Fill ``p`` for rdma_connect / rdma_accept, refusing values its narrow fields would cut. It
    points into ``data``: the caller keeps that until the call."""
    for name, value, hi in (("responder_resources", responder_resources, 255),
                            ("initiator_depth", initiator_depth, 255), ("retry_count", retry_count, 7),
                            ("rnr_retry_count", rnr_retry_count, 7)):
        if not 0 <= value <= hi:
            raise UsageError(f"{name} must be within 0..{hi}, got {value}")
    memset(p, 0, sizeof(p[0]))
    p.private_data = <const char *>data if data else NULL
    p.private_data_len = len(data)
    p.responder_resources = responder_resources
    p.initiator_depth = initiator_depth
    p.retry_count = retry_count
    p.rnr_retry_count = rnr_retry_count
    return 0


# librdmacm's device contexts live as long as the library: one borrowed Context each.
_contexts = {}
