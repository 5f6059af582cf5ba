"""Devices: list them, open a Context, query device, port and GID table."""
cimport cython
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memset
from libc.errno cimport errno, EBADF, ENOSYS, EOPNOTSUPP
from posix.fcntl cimport fcntl, F_GETFL, F_SETFL, O_NONBLOCK
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, refuse, use, unuse, monotonic_now, wait_fd, wait_seconds
from pyrdma._verbs.loader cimport require_library, require_entry_point, pyrdma_dl_has, PYRDMA_DL_VERBS
import enum
import ipaddress
import os
import socket

cdef struct async_event_take:
    ibv_context *ctx
    ibv_async_event ev


cdef int _take_async_event(void *arg) noexcept nogil:
    cdef async_event_take *take = <async_event_take *>arg
    if ibv_get_async_event(take.ctx, &take.ev) != 0:
        return -errno
    return 1

from pyrdma._verbs.base import Attributes
from pyrdma.errors import RDMAError, UsageError

class MTU(enum.IntEnum):
    """ibv_mtu: a path MTU as verbs encodes it (``mtu_to_bytes`` gives the bytes)."""
    MTU_256 = IBV_MTU_256
    MTU_512 = IBV_MTU_512
    MTU_1024 = IBV_MTU_1024
    MTU_2048 = IBV_MTU_2048
    MTU_4096 = IBV_MTU_4096


class PortState(enum.IntEnum):
    """ibv_port_state."""
    NOP = IBV_PORT_NOP
    DOWN = IBV_PORT_DOWN
    INIT = IBV_PORT_INIT
    ARMED = IBV_PORT_ARMED
    ACTIVE = IBV_PORT_ACTIVE
    ACTIVE_DEFER = IBV_PORT_ACTIVE_DEFER


class AtomicCap(enum.IntEnum):
    """ibv_atomic_cap: how far a device's atomics are atomic."""
    NONE = IBV_ATOMIC_NONE
    HCA = IBV_ATOMIC_HCA
    GLOB = IBV_ATOMIC_GLOB


MTU_256, MTU_512, MTU_1024, MTU_2048, MTU_4096 = MTU.MTU_256, MTU.MTU_512, MTU.MTU_1024, MTU.MTU_2048, MTU.MTU_4096
PORT_DOWN, PORT_INIT, PORT_ARMED, PORT_ACTIVE = PortState.DOWN, PortState.INIT, PortState.ARMED, PortState.ACTIVE
ATOMIC_NONE, ATOMIC_HCA, ATOMIC_GLOB = AtomicCap.NONE, AtomicCap.HCA, AtomicCap.GLOB

class AsyncEventType(enum.IntEnum):
    """ibv_event_type: what an asynchronous event reports."""
    CQ_ERR = IBV_EVENT_CQ_ERR
    QP_FATAL = IBV_EVENT_QP_FATAL
    QP_REQ_ERR = IBV_EVENT_QP_REQ_ERR
    QP_ACCESS_ERR = IBV_EVENT_QP_ACCESS_ERR
    COMM_EST = IBV_EVENT_COMM_EST
    SQ_DRAINED = IBV_EVENT_SQ_DRAINED
    PATH_MIG = IBV_EVENT_PATH_MIG
    PATH_MIG_ERR = IBV_EVENT_PATH_MIG_ERR
    DEVICE_FATAL = IBV_EVENT_DEVICE_FATAL
    PORT_ACTIVE = IBV_EVENT_PORT_ACTIVE
    PORT_ERR = IBV_EVENT_PORT_ERR
    LID_CHANGE = IBV_EVENT_LID_CHANGE
    PKEY_CHANGE = IBV_EVENT_PKEY_CHANGE
    SM_CHANGE = IBV_EVENT_SM_CHANGE
    SRQ_ERR = IBV_EVENT_SRQ_ERR
    SRQ_LIMIT_REACHED = IBV_EVENT_SRQ_LIMIT_REACHED
    QP_LAST_WQE_REACHED = IBV_EVENT_QP_LAST_WQE_REACHED
    CLIENT_REREGISTER = IBV_EVENT_CLIENT_REREGISTER
    GID_CHANGE = IBV_EVENT_GID_CHANGE
    WQ_FATAL = IBV_EVENT_WQ_FATAL


_QP_EVENTS = frozenset((IBV_EVENT_QP_FATAL, IBV_EVENT_QP_REQ_ERR, IBV_EVENT_QP_ACCESS_ERR, IBV_EVENT_COMM_EST,
                        IBV_EVENT_SQ_DRAINED, IBV_EVENT_PATH_MIG, IBV_EVENT_PATH_MIG_ERR,
                        IBV_EVENT_QP_LAST_WQE_REACHED))
_PORT_EVENTS = frozenset((IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, IBV_EVENT_LID_CHANGE, IBV_EVENT_PKEY_CHANGE,
                          IBV_EVENT_SM_CHANGE, IBV_EVENT_CLIENT_REREGISTER, IBV_EVENT_GID_CHANGE))


class AsyncEvent:
    """One asynchronous event of a device (already acknowledged): ``type`` (AsyncEventType),
    ``port`` for port events, ``qp_num`` for QP events, else None; ``description`` is verbs' text."""
    __slots__ = ("type", "port", "qp_num", "description")

    def __init__(self, type, port=None, qp_num=None, description=""):
        self.type, self.port, self.qp_num, self.description = type, port, qp_num, description

    def __repr__(self):
        where = f" port={self.port}" if self.port is not None else ""
        where += f" qp_num={self.qp_num}" if self.qp_num is not None else ""
        return f"<AsyncEvent {self.type.name}{where}>"


_ODP_OPS = (("send", IBV_ODP_SUPPORT_SEND), ("recv", IBV_ODP_SUPPORT_RECV), ("write", IBV_ODP_SUPPORT_WRITE),
            ("read", IBV_ODP_SUPPORT_READ), ("atomic", IBV_ODP_SUPPORT_ATOMIC), ("srq_recv", IBV_ODP_SUPPORT_SRQ_RECV))

_LINK_LAYERS = {IBV_LINK_LAYER_UNSPECIFIED: "InfiniBand",  # unspecified means IB in verbs
                IBV_LINK_LAYER_INFINIBAND: "InfiniBand",
                IBV_LINK_LAYER_ETHERNET: "Ethernet"}
_GID_TYPES = {IBV_GID_TYPE_IB: "IB", IBV_GID_TYPE_ROCE_V1: "RoCEv1", IBV_GID_TYPE_ROCE_V2: "RoCEv2"}


def mtu_to_bytes(int mtu):
    """Path-MTU enum (MTU_256..MTU_4096) to bytes."""
    if not IBV_MTU_256 <= mtu <= IBV_MTU_4096:
        raise UsageError(f"invalid MTU enum {mtu}; expected 1..5 (MTU_256..MTU_4096)")
    return 128 << mtu


def bytes_to_mtu(int nbytes):
    """Bytes (256..4096, a power of two) to the path-MTU enum."""
    for enum in range(IBV_MTU_256, IBV_MTU_4096 + 1):
        if 128 << enum == nbytes:
            return enum
    raise UsageError(f"invalid MTU {nbytes}; expected one of 256, 512, 1024, 2048, 4096")


class DeviceInfo:
    """One entry of the device list (no device opened)."""

    def __init__(self, name, guid, node_type, transport_type):
        self.name, self.guid, self.node_type, self.transport_type = name, guid, node_type, transport_type

    def __repr__(self):
        return f"DeviceInfo(name={self.name!r}, guid={self.guid!r})"


class GIDEntry:
    """One GID table entry: its type (IB, RoCEv1, RoCEv2), the netdev it belongs to (RoCE; None on
    InfiniBand) and, for IPv4-mapped GIDs, the IPv4 address."""

    def __init__(self, index, gid, gid_type, netdev=None):
        self.index, self.gid, self.gid_type, self.netdev = index, bytes(gid), gid_type, netdev
        addr = ipaddress.IPv6Address(self.gid)
        self.gid_str = addr.exploded
        self.ipv4 = str(addr.ipv4_mapped) if addr.ipv4_mapped is not None else None

    def __repr__(self):
        extra = f", ipv4={self.ipv4!r}" if self.ipv4 else ""
        extra += f", netdev={self.netdev!r}" if self.netdev else ""
        return f"GIDEntry(index={self.index}, gid={self.gid_str!r}, type={self.gid_type!r}{extra})"

    @property
    def local_scope(self):
        """True for a GID no other host can reach: IPv6 link-local (fe80::/10) or loopback (::1), an
        IPv4-mapped loopback (127/8) or link-local (169.254/16) address."""
        if self.ipv4 is not None:
            v4 = ipaddress.IPv4Address(self.ipv4)
            return v4.is_loopback or v4.is_link_local
        addr = ipaddress.IPv6Address(self.gid)
        return addr.is_link_local or addr.is_loopback


def gid_preference(entry):
    """Sort key of a RoCE port's GID entries, best first: RoCEv2, then a GID other hosts can reach
    (not link-local, not loopback: a device on a veth has an fe80 GID beside its IPv4 one), then
    IPv4-mapped (what perftest users pass with -x), then the lowest index. rxe0 on lo has only local
    GIDs; its IPv4-mapped 127.0.0.1 still wins."""
    return (entry.gid_type != "RoCEv2", entry.local_scope, entry.ipv4 is None, entry.index)


def _netdev_name(ifindex):
    if not ifindex:
        return None
    try:
        return socket.if_indextoname(ifindex)
    except OSError:       # the netdev went away since the query
        return None


cdef str _guid_str(uint64_t be_guid):
    # GUIDs come in network byte order; print them as ibv_devinfo does.
    raw = be_guid.to_bytes(8, "little")
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 16, 4))


def get_device_list():
    """List the RDMA devices libibverbs sees (possibly empty)."""
    cdef int n = 0
    cdef ibv_device **devs
    require_library(PYRDMA_DL_VERBS, "ibv_get_device_list")
    devs = ibv_get_device_list(&n)
    if devs == NULL:
        if errno == ENOSYS:   # the kernel has no RDMA support at all: no devices
            return []
        raise_errno("ibv_get_device_list", errno)
    try:
        return [DeviceInfo(devs[i].name.decode(), _guid_str(ibv_get_device_guid(devs[i])),
                           ibv_node_type_str(devs[i].node_type).decode(), devs[i].transport_type)
                for i in range(n)]
    finally:
        ibv_free_device_list(devs)


@cython.no_gc_clear
cdef class Context(VerbsObject):
    """An opened RDMA device. ``Context()`` opens the first device with an ACTIVE port."""

    def __init__(self, name=None):
        cdef int n = 0, i, err
        cdef ibv_device **devs
        cdef ibv_context *ctx
        require_library(PYRDMA_DL_VERBS, "ibv_open_device")
        devs = ibv_get_device_list(&n)
        self._begin_init()
        self._port_attr = {}
        self._best_gid = {}
        if devs == NULL or n == 0:
            if devs != NULL:
                ibv_free_device_list(devs)
            raise RDMAError("no RDMA devices found (no RDMA hardware or driver; for Soft-RoCE: "
                            "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`)",
                            call="ibv_get_device_list")
        names = [devs[i].name.decode() for i in range(n)]
        try:
            if name is not None:
                if name not in names:
                    raise RDMAError(f"no RDMA device named {name!r}; available: {', '.join(names)}",
                                    call="ibv_open_device")
                candidates = [names.index(name)]
            else:
                candidates = list(range(n))
            unopened = []
            for i in candidates:
                ctx = ibv_open_device(devs[i])
                if ctx == NULL:
                    err = _errno()      # before any Python runs
                    if name is not None:
                        raise_errno("ibv_open_device", err, names[i])
                    unopened.append((names[i], err))
                    continue
                self.ctx = ctx
                self.name = names[i]
                self._closed = False
                if name is not None or self._has_active_port():
                    return
                ibv_close_device(ctx)
                self.ctx = NULL
                self._closed = True
            if unopened:    # say why those failed: a device file missing from a container, say
                from pyrdma.advice import advice
                why = []
                for dev, err in unopened:
                    hint = advice("ibv_open_device", err, dev)
                    why.append(f"{dev} did not open [{os.strerror(err)}]" + (f": {hint}" if hint else ""))
                why = "; ".join(why)
                raise RDMAError(f"no RDMA device with an ACTIVE port; devices: {', '.join(names)}; {why}",
                                errno=unopened[0][1] or None, call="ibv_open_device")
            raise RDMAError(f"no RDMA device with an ACTIVE port; devices: {', '.join(names)}",
                            call="ibv_open_device")
        finally:
            ibv_free_device_list(devs)

    cdef bint _has_active_port(self):
        cdef ibv_device_attr attr
        cdef ibv_port_attr pattr
        cdef int p
        if ibv_query_device(self.ctx, &attr):
            return False
        for p in range(1, attr.phys_port_cnt + 1):
            if ibv_query_port(self.ctx, p, &pattr) == 0 and pattr.state == IBV_PORT_ACTIVE:
                return True
        return False

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.ctx != NULL and self._borrowed:
            self.ctx = NULL      # its owner (librdmacm) closes it
        elif self.ctx != NULL:
            rc = ibv_close_device(self.ctx)
            self.ctx = NULL
            if rc:
                raise_errno("ibv_close_device", _errno(), repr(self))
        return 0

    def __repr__(self):
        return f"<Context {self.name or '?'}{' closed' if self._closed else ''}>"

    def fileno(self):
        """The device's asynchronous-event fd (non-blocking), for select/poll/asyncio: readable when
        ``get_async_event(timeout=0)`` has an event to return."""
        self._check_open()
        fd = self.ctx.async_fd
        flags = fcntl(fd, F_GETFL)
        if flags >= 0 and not flags & O_NONBLOCK:
            fcntl(fd, F_SETFL, flags | O_NONBLOCK)
        return fd

    def get_async_event(self, timeout=None):
        """The next asynchronous event (port up/down, QP or CQ error, device fatal, ...) as an
        AsyncEvent, acknowledged; None when ``timeout`` seconds pass first (0: just look). Waits with
        the GIL released; Ctrl-C interrupts it, close() from another thread makes it raise UsageError."""
        cdef async_event_take take
        cdef int fd = self.fileno()
        take.ctx = self.ctx
        if wait_fd(fd, wait_seconds(timeout), _take_async_event, &take, self, None, NULL,
                   "Context.get_async_event", "ibv_get_async_event") == 0:
            return None
        return self._take_event(&take.ev)

    cdef object _take_event(self, ibv_async_event *ev):
        # read what the event points at, then ack at once: destroying its QP/CQ waits for the ack
        kind = ev.event_type
        port = ev.element.port_num if kind in _PORT_EVENTS else None
        qp_num = ev.element.qp.qp_num if kind in _QP_EVENTS else None
        ibv_ack_async_event(ev)
        try:
            kind = AsyncEventType(kind)
        except ValueError:
            pass
        return AsyncEvent(kind, port, qp_num, ibv_event_type_str(ev.event_type).decode())

    def query_device(self):
        """Device capabilities (ibv_query_device), cached."""
        cdef ibv_device_attr a
        self._check_open()
        if self._device_attr is None:
            rc = ibv_query_device(self.ctx, &a)
            if rc:
                raise_errno("ibv_query_device", rc, repr(self))
            self._device_attr = Attributes(
                "DeviceAttr", fw_ver=a.fw_ver.decode(errors="replace"), node_guid=_guid_str(a.node_guid),
                vendor_id=a.vendor_id, vendor_part_id=a.vendor_part_id, hw_ver=a.hw_ver,
                max_mr_size=a.max_mr_size, page_size_cap=a.page_size_cap, max_qp=a.max_qp,
                max_qp_wr=a.max_qp_wr, device_cap_flags=a.device_cap_flags, max_sge=a.max_sge,
                max_sge_rd=a.max_sge_rd, max_cq=a.max_cq, max_cqe=a.max_cqe, max_mr=a.max_mr,
                max_pd=a.max_pd, max_qp_rd_atom=a.max_qp_rd_atom, max_qp_init_rd_atom=a.max_qp_init_rd_atom,
                max_res_rd_atom=a.max_res_rd_atom, atomic_cap=a.atomic_cap, max_mw=a.max_mw,
                max_ah=a.max_ah, max_srq=a.max_srq, max_srq_wr=a.max_srq_wr, max_srq_sge=a.max_srq_sge,
                max_pkeys=a.max_pkeys, local_ca_ack_delay=a.local_ca_ack_delay,
                phys_port_cnt=a.phys_port_cnt)
        return self._device_attr

    def query_port(self, int port=1):
        """Port attributes (ibv_query_port): state, MTUs, LID, link layer, GID table length."""
        cdef ibv_port_attr a
        self._check_port(port)
        # checked right before the call: Python code above may let another thread close it
        self._check_open()
        memset(&a, 0, sizeof(a))
        rc = ibv_query_port(self.ctx, port, &a)
        if rc:
            raise_errno("ibv_query_port", rc, f"{self!r} port {port}")
        return Attributes(
            "PortAttr", port=port, state=a.state, state_name=ibv_port_state_str(a.state).decode(),
            max_mtu=a.max_mtu, active_mtu=a.active_mtu, active_mtu_bytes=128 << a.active_mtu,
            gid_tbl_len=a.gid_tbl_len, port_cap_flags=a.port_cap_flags, max_msg_sz=a.max_msg_sz,
            lid=a.lid, sm_lid=a.sm_lid, lmc=a.lmc, active_width=a.active_width,
            active_speed=a.active_speed, phys_state=a.phys_state,
            link_layer=_LINK_LAYERS.get(a.link_layer, str(a.link_layer)))

    cdef int _check_port(self, int port) except -1:
        nports = self.query_device().phys_port_cnt
        if not 1 <= port <= nports:
            raise UsageError(f"port {port} out of range; {self.name} has ports 1..{nports}", obj=repr(self))
        return 0

    def query_gid(self, int port, int index):
        """The 16-byte GID at ``index`` of ``port``'s table."""
        cdef ibv_gid gid
        self._check_port(port)
        self._check_open()
        rc = ibv_query_gid(self.ctx, port, index, &gid)
        if rc:
            raise_errno("ibv_query_gid", _errno() or rc, f"{self!r} port {port} index {index}")
        return bytes(gid.raw[:16])

    def gid_table(self, int port=1):
        """The populated GID entries of ``port`` with their types (IB, RoCEv1, RoCEv2)."""
        cdef ibv_gid_entry e
        cdef int i, rc
        self._check_open()
        require_entry_point(PYRDMA_DL_VERBS, "_ibv_query_gid_ex", "ibv_query_gid_ex")
        length = self.query_port(port).gid_tbl_len
        entries = []
        for i in range(length):
            self._check_open()     # the loop runs Python code between calls
            rc = ibv_query_gid_ex(self.ctx, port, i, &e, 0)
            if rc:
                continue   # ENODATA: empty slot
            raw = bytes(e.gid.raw[:16])
            if raw != bytes(16):
                entries.append(GIDEntry(i, raw, _GID_TYPES.get(e.gid_type, str(e.gid_type)),
                                        _netdev_name(e.ndev_ifindex)))
        return entries

    def best_gid_index(self, int port=1):
        """The GID index to use by default: 0 on InfiniBand; on RoCE the first by ``gid_preference``:
        RoCEv2, reachable from other hosts (not link-local or loopback), IPv4-mapped, lowest index;
        e.g. ::ffff:198.18.0.1 on a device whose netdev has that address, never its fe80 GID."""
        if port in self._best_gid:
            return self._best_gid[port]
        if self.query_port(port).link_layer != "Ethernet":
            best = 0
        else:
            entries = self.gid_table(port)
            if not entries:
                raise RDMAError(f"port {port} has an empty GID table (no IP address on its netdev?)",
                                obj=repr(self))
            best = min(entries, key=gid_preference).index
        self._best_gid[port] = best
        return best

    def query_odp(self):
        """On-demand paging capabilities (ibv_query_device_ex): ``supported``, ``implicit`` and, per
        transport (``rc``, ``uc``, ``ud``), the operations that may touch ODP memory. A device without ODP
        (rxe on older kernels, say) reports supported=False; MemoryRegion(..., ACCESS_ON_DEMAND) then refuses."""
        cdef ibv_device_attr_ex a
        cdef int rc
        self._check_open()
        memset(&a, 0, sizeof(a))
        rc = ibv_query_device_ex(self.ctx, NULL, &a)
        if rc == EOPNOTSUPP or rc == ENOSYS:
            return Attributes("OdpCaps", supported=False, implicit=False, rc=(), uc=(), ud=())
        if rc:
            raise_errno("ibv_query_device_ex", rc, repr(self))
        general = a.odp_caps.general_caps
        def ops(uint32_t caps):
            return tuple(name for name, bit in _ODP_OPS if caps & bit)
        return Attributes("OdpCaps", supported=bool(general & IBV_ODP_SUPPORT),
                          implicit=bool(general & IBV_ODP_SUPPORT_IMPLICIT),
                          rc=ops(a.odp_caps.per_transport_caps.rc_odp_caps),
                          uc=ops(a.odp_caps.per_transport_caps.uc_odp_caps),
                          ud=ops(a.odp_caps.per_transport_caps.ud_odp_caps))

    def dmabuf_supported(self):
        """Probe once, as NCCL does, whether ibv_reg_dmabuf_mr is implemented (on a PD of its own)."""
        cdef ibv_pd *pd
        cdef bint works
        # A bare ibv_pd, not a ProtectionDomain: device.pyx is below pd.pyx and mr.pyx and imports
        # neither. The calls hold the GIL, so nothing closes the context under them.
        self._check_open()
        pd = ibv_alloc_pd(self.ctx)
        if pd == NULL:
            raise_errno("ibv_alloc_pd", errno, repr(self))
        works = reg_dmabuf_mr_works(pd)
        ibv_dealloc_pd(pd)
        return works


cdef bint reg_dmabuf_mr_works(ibv_pd *pd) noexcept:
    """Whether the provider implements ibv_reg_dmabuf_mr: given fd -1 it fails with EBADF."""
    cdef ibv_mr *mr
    if not pyrdma_dl_has("ibv_reg_dmabuf_mr", NULL):    # rdma-core before IBVERBS_1.12
        return False
    mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE)
    if mr != NULL:
        ibv_dereg_mr(mr)
        return True
    return errno == EBADF


cdef Context borrow_context(ibv_context *ctx):
    """A Context over a device context another library opened and closes (librdmacm's id->verbs):
    its children (PDs, CQs, ...) work as on any Context; close() closes them and forgets the handle."""
    cdef Context self = Context.__new__(Context)
    self._initialised = True
    self._port_attr = {}
    self._best_gid = {}
    self.ctx = ctx
    self._borrowed = True
    self.name = ibv_get_device_name(ctx.device).decode()
    self._closed = False
    return self


cdef int _errno() noexcept:
    return errno
