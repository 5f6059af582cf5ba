"""Queue pairs (RC, UC, UD): creation, the RESET->INIT->RTR->RTS state machine, and posting."""
cimport cython
from libc.errno cimport errno
from libc.stdlib cimport calloc, free
from libc.string cimport memset, memcpy
from libc.stdint cimport uint32_t, uint64_t
import enum
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release, use, unuse, refuse
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.cq cimport CompletionQueue
from pyrdma._verbs.srq cimport SharedReceiveQueue
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.ah cimport AddressHandle
from pyrdma._verbs.mw cimport MemoryWindow
from pyrdma._verbs.wr cimport SendWR, RecvWR, SendWRList, RecvWRList, fill_sge, imm_data_be
import secrets
import weakref

from pyrdma._verbs.base import Attributes
from pyrdma.endpoint import Endpoint
from pyrdma.errors import UsageError, RDMAError

class QPType(enum.IntEnum):
    """ibv_qp_type: reliable connected, unreliable connected, unreliable datagram."""
    RC = IBV_QPT_RC
    UC = IBV_QPT_UC
    UD = IBV_QPT_UD


class QPState(enum.IntEnum):
    """ibv_qp_state."""
    RESET = IBV_QPS_RESET
    INIT = IBV_QPS_INIT
    RTR = IBV_QPS_RTR
    RTS = IBV_QPS_RTS
    SQD = IBV_QPS_SQD
    SQE = IBV_QPS_SQE
    ERR = IBV_QPS_ERR


QPT_RC, QPT_UC, QPT_UD = QPType.RC, QPType.UC, QPType.UD
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS = QPState.RESET, QPState.INIT, QPState.RTR, QPState.RTS
QPS_SQD, QPS_SQE, QPS_ERR = QPState.SQD, QPState.SQE, QPState.ERR
DEFAULT_QKEY = 0x11111111
UD_GRH_BYTES = 40   # a UD receive buffer starts with room for the global routing header

_QP_TYPE_NAMES = {m.value: m.name for m in QPType}
_STATE_NAMES = {m.value: m.name for m in QPState}
cdef int _REMOTE_ACCESS = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC


# ibv_qp_attr keeps these in narrow bit fields: a larger value would be cut, not refused
_FIELD_MAX = {"min_rnr_timer": 31, "hop_limit": 255, "traffic_class": 255, "sl": 15, "timeout": 31,
              "retry_cnt": 7, "rnr_retry": 7}


cdef _check_field(name, int value):
    hi = _FIELD_MAX[name]
    if not 0 <= value <= hi:
        raise UsageError(f"{name} must be within 0..{hi}, got {value}")


def qp_state_name(int state):
    return _STATE_NAMES.get(state, f"STATE_{state}")


@cython.no_gc_clear
cdef class QueuePair(VerbsObject):
    """A queue pair. ``connect(remote)`` takes it from RESET to RTS; the post_* methods post work (the
    ibv_wr_* batch API is QueuePairEx's, a subclass in qpex.pyx)."""

    def __init__(self, ProtectionDomain pd not None, int qp_type, CompletionQueue send_cq not None,
                 CompletionQueue recv_cq=None, int max_send_wr=128, int max_recv_wr=128,
                 int max_send_sge=1, int max_recv_sge=1, int max_inline_data=0,
                 SharedReceiveQueue srq=None, bint sq_sig_all=False, int port=1, gid_index=None):
        cdef ibv_qp_init_attr attr
        cdef int err = 0
        self._begin_init()
        pd._check_open()
        send_cq._check_open()
        if recv_cq is None:
            recv_cq = send_cq
        recv_cq._check_open()
        if qp_type not in _QP_TYPE_NAMES:
            raise UsageError(f"unsupported qp_type {qp_type}; use QPT_RC, QPT_UC or QPT_UD")
        dev = pd.context.query_device()
        for name, value, limit in (("max_send_wr", max_send_wr, dev.max_qp_wr),
                                   ("max_recv_wr", max_recv_wr, dev.max_qp_wr),
                                   ("max_send_sge", max_send_sge, dev.max_sge),
                                   ("max_recv_sge", max_recv_sge, dev.max_sge)):
            if not 1 <= value <= limit:
                raise UsageError(f"{name}={value} outside 1..{limit} (device limit)", obj=repr(pd.context))
        if max_inline_data < 0:
            raise UsageError(f"max_inline_data must be >= 0, got {max_inline_data}")
        if srq is not None:
            srq._check_open()
        # The kernel finds a CQ or SRQ by its handle number within the PD's context: one of another
        # context would name an unrelated object of this one (and pin it: its destroy fails EBUSY).
        for name, other in (("send_cq", send_cq.context), ("recv_cq", recv_cq.context),
                            ("srq", srq.pd.context if srq is not None else pd.context)):
            if other is not pd.context:
                raise UsageError(f"{name} belongs to {other!r}, the PD to {pd.context!r}; "
                                 f"a QP's resources must share one Context")
        gid_index = pd.context.best_gid_index(port) if gid_index is None else gid_index
        # Closing any resource this QP uses closes the QP first.
        parents = [pd, send_cq]
        if recv_cq is not send_cq:
            parents.append(recv_cq)
        if srq is not None:
            parents.append(srq)
        adopt(self, parents)
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = send_cq.cq
        attr.recv_cq = recv_cq.cq
        attr.srq = srq.srq if srq is not None else NULL
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = 0 if srq is not None else max_recv_wr
        attr.cap.max_send_sge = max_send_sge
        attr.cap.max_recv_sge = 0 if srq is not None else max_recv_sge
        attr.cap.max_inline_data = max_inline_data
        attr.qp_type = qp_type
        attr.sq_sig_all = sq_sig_all
        self.qp = self._create(pd, &attr)
        if self.qp != NULL:
            self._closed = False
        else:
            err = errno
        release(parents)
        if self.qp == NULL:
            self._abandon()
            hint = f" (max_inline_data={max_inline_data} may exceed what the device supports)" \
                if max_inline_data else ""
            self._create_failed(err, f"{_QP_TYPE_NAMES[qp_type]} QP in {pd!r}{hint}")
        self.pd, self.send_cq, self.recv_cq, self.srq = pd, send_cq, recv_cq, srq
        self.qp_type = qp_type
        self.qp_num = self.qp.qp_num
        self.psn = secrets.randbits(24)
        self.max_inline_data = attr.cap.max_inline_data
        self.cap = dict(max_send_wr=attr.cap.max_send_wr, max_recv_wr=attr.cap.max_recv_wr,
                        max_send_sge=attr.cap.max_send_sge, max_recv_sge=attr.cap.max_recv_sge,
                        max_inline_data=attr.cap.max_inline_data)
        self._state = IBV_QPS_RESET
        self.port = port
        self.gid_index = gid_index

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef ibv_qp *_create(self, ProtectionDomain pd, ibv_qp_init_attr *attr) noexcept:
        # C only: the parents are in use until release(). QueuePairEx creates it with ibv_create_qp_ex.
        return ibv_create_qp(pd.pd, attr)

    cdef int _create_failed(self, int err, str what) except -1:
        return raise_errno("ibv_create_qp", err, what)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.qp != NULL and self._cm_id != NULL:
            self.qp = NULL
            self._cm_destroy_qp(self._cm_id)    # rdma_destroy_qp: ibv_destroy_qp, and the id forgets it
            self._cm_id = NULL
        elif self.qp != NULL:
            rc = ibv_destroy_qp(self.qp)
            self.qp = NULL
            if rc:
                raise_errno("ibv_destroy_qp", rc, repr(self))
        return 0

    def __repr__(self):
        return (f"<QueuePair {_QP_TYPE_NAMES.get(self.qp_type)} qpn={self.qp_num} "
                f"{'closed' if self._closed else _STATE_NAMES.get(self._state)}>")

    @property
    def state(self):
        """The QP state as last set through this object or librdmacm (query() asks the device)."""
        if self.qp != NULL and not self._closing:
            self._state = self.qp.state
        return self._state

    @property
    def state_name(self):
        return _STATE_NAMES.get(self.state)

    # ---- state machine -------------------------------------------------------------------------

    cdef _modify(self, ibv_qp_attr *attr, int mask, str what):
        cdef int rc
        use(self)    # refuses a closed QP; close() waits for the call to leave
        with nogil:
            rc = ibv_modify_qp(self.qp, attr, mask)
        unuse(self)
        if rc:
            raise_errno("ibv_modify_qp", rc, f"{self!r} ({what})")
        self._state = attr.qp_state

    def to_init(self, port=None, access=None, int pkey_index=0, uint32_t qkey=DEFAULT_QKEY):
        """RESET -> INIT. ``access``: what the remote side may do (RC default: write, read, atomic)."""
        cdef ibv_qp_attr attr
        cdef int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT
        self._check_open()
        if self._state != IBV_QPS_RESET:
            raise UsageError(f"to_init needs a QP in RESET, this one is in {self.state_name}", obj=repr(self))
        if port is not None:
            self.port = port
            self.gid_index = self.pd.context.best_gid_index(port)
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_INIT
        attr.pkey_index = pkey_index
        attr.port_num = self.port
        if self.qp_type == IBV_QPT_UD:
            attr.qkey = qkey
            mask |= IBV_QP_QKEY
        else:
            if access is None:
                access = IBV_ACCESS_LOCAL_WRITE | (IBV_ACCESS_REMOTE_WRITE if self.qp_type == IBV_QPT_UC
                                                   else _REMOTE_ACCESS)
            attr.qp_access_flags = access
            mask |= IBV_QP_ACCESS_FLAGS
        self._modify(&attr, mask, "RESET->INIT")

    def to_rtr(self, remote=None, path_mtu=None, max_dest_rd_atomic=16, int min_rnr_timer=12,
               int hop_limit=64, int traffic_class=0, int sl=0):
        """INIT -> RTR. RC/UC need the peer's Endpoint; path MTU defaults to min(port, peer)."""
        cdef ibv_qp_attr attr
        cdef int mask = IBV_QP_STATE, i
        self._check_open()
        if self._state != IBV_QPS_INIT:
            raise UsageError(f"to_rtr needs a QP in INIT, this one is in {self.state_name}", obj=repr(self))
        _check_field("min_rnr_timer", min_rnr_timer)
        _check_field("hop_limit", hop_limit)
        _check_field("traffic_class", traffic_class)
        _check_field("sl", sl)
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTR
        if self.qp_type != IBV_QPT_UD:
            if not isinstance(remote, Endpoint):
                raise UsageError(f"{_QP_TYPE_NAMES[self.qp_type]} QPs need the peer's Endpoint to reach RTR")
            if len(remote.gid) != 16:
                raise UsageError(f"the peer's GID must be 16 bytes, got {len(remote.gid)}")
            if remote.qp_type != self.qp_type:
                raise UsageError(f"peer QP is {_QP_TYPE_NAMES.get(remote.qp_type, remote.qp_type)}, "
                                 f"this one is {_QP_TYPE_NAMES[self.qp_type]}")
            port_attr = self.pd.context.query_port(self.port)
            if path_mtu is None:
                path_mtu = min(port_attr.active_mtu, remote.mtu)
            attr.path_mtu = path_mtu
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.ah_attr.dlid = remote.lid
            attr.ah_attr.sl = sl
            attr.ah_attr.port_num = self.port
            if port_attr.link_layer == "Ethernet" or remote.gid != bytes(16) and remote.lid == 0:
                attr.ah_attr.is_global = 1
                for i in range(16):
                    attr.ah_attr.grh.dgid.raw[i] = remote.gid[i]
                attr.ah_attr.grh.sgid_index = self.gid_index
                attr.ah_attr.grh.hop_limit = hop_limit
                attr.ah_attr.grh.traffic_class = traffic_class
            mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
            if self.qp_type == IBV_QPT_RC:
                attr.max_dest_rd_atomic = min(max_dest_rd_atomic, self.pd.context.query_device().max_qp_rd_atom)
                attr.min_rnr_timer = min_rnr_timer
                mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER
            self.remote = remote
        self._modify(&attr, mask, "INIT->RTR")

    def to_rts(self, sq_psn=None, int timeout=14, int retry_cnt=7, int rnr_retry=7, max_rd_atomic=16):
        """RTR -> RTS. ``timeout`` is 4.096 us * 2^timeout per retry; 7 retries means 'forever' for RNR."""
        cdef ibv_qp_attr attr
        cdef int mask = IBV_QP_STATE | IBV_QP_SQ_PSN
        self._check_open()
        if self._state != IBV_QPS_RTR:
            raise UsageError(f"to_rts needs a QP in RTR, this one is in {self.state_name}", obj=repr(self))
        _check_field("timeout", timeout)
        _check_field("retry_cnt", retry_cnt)
        _check_field("rnr_retry", rnr_retry)
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTS
        attr.sq_psn = self.psn if sq_psn is None else sq_psn
        if self.qp_type == IBV_QPT_RC:
            attr.timeout = timeout
            attr.retry_cnt = retry_cnt
            attr.rnr_retry = rnr_retry
            attr.max_rd_atomic = min(max_rd_atomic, self.pd.context.query_device().max_qp_init_rd_atom)
            mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC
        self._modify(&attr, mask, "RTR->RTS")

    def connect(self, remote=None, access=None, path_mtu=None, int timeout=14, int retry_cnt=7,
                int rnr_retry=7, int min_rnr_timer=12):
        """RESET -> INIT -> RTR -> RTS in one call (UD needs no remote)."""
        # checked before the first transition, so a bad value leaves the QP where it was
        self._check_open()
        _check_field("timeout", timeout)
        _check_field("retry_cnt", retry_cnt)
        _check_field("rnr_retry", rnr_retry)
        _check_field("min_rnr_timer", min_rnr_timer)
        if self._state == IBV_QPS_RESET:
            self.to_init(access=access)
        self.to_rtr(remote, path_mtu=path_mtu, min_rnr_timer=min_rnr_timer)
        self.to_rts(timeout=timeout, retry_cnt=retry_cnt, rnr_retry=rnr_retry)
        return self

    def to_error(self):
        """Move to ERR: outstanding and later WRs complete with WR_FLUSH_ERR."""
        cdef ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_ERR
        self._modify(&attr, IBV_QP_STATE, "->ERR")

    def to_reset(self):
        """Move to RESET (queues emptied); the QP can then be connected again."""
        cdef ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RESET
        self._modify(&attr, IBV_QP_STATE, "->RESET")
        self.remote = None

    def query(self):
        """The device's view of the QP (ibv_query_qp); also refreshes ``state``."""
        cdef ibv_qp_attr a
        cdef ibv_qp_init_attr init
        cdef int rc
        cdef int mask = (IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MTU
                         | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_SQ_PSN | IBV_QP_CAP | IBV_QP_TIMEOUT
                         | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC
                         | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER | IBV_QP_QKEY)
        self._check_open()    # the call holds the GIL: nothing closes the QP under it
        memset(&a, 0, sizeof(a))
        rc = ibv_query_qp(self.qp, &a, mask, &init)
        if rc:
            raise_errno("ibv_query_qp", rc, repr(self))
        self._state = a.qp_state
        return Attributes("QPAttr", state=a.qp_state, state_name=_STATE_NAMES.get(a.qp_state),
                          path_mtu=a.path_mtu, qkey=a.qkey, rq_psn=a.rq_psn, sq_psn=a.sq_psn,
                          dest_qp_num=a.dest_qp_num, access_flags=a.qp_access_flags,
                          pkey_index=a.pkey_index, port_num=a.port_num, timeout=a.timeout,
                          retry_cnt=a.retry_cnt, rnr_retry=a.rnr_retry, max_rd_atomic=a.max_rd_atomic,
                          max_dest_rd_atomic=a.max_dest_rd_atomic, min_rnr_timer=a.min_rnr_timer,
                          max_send_wr=a.cap.max_send_wr, max_recv_wr=a.cap.max_recv_wr,
                          max_send_sge=a.cap.max_send_sge, max_recv_sge=a.cap.max_recv_sge,
                          max_inline_data=a.cap.max_inline_data)

    def endpoint(self, mr=None):
        """This QP's Endpoint record for the peer; with ``mr``, also that region's addr/rkey/length."""
        self._check_open()
        ctx = self.pd.context
        port_attr = ctx.query_port(self.port)
        ep = Endpoint(qpn=self.qp_num, psn=self.psn, lid=port_attr.lid,
                      gid=ctx.query_gid(self.port, self.gid_index), port=self.port,
                      gid_index=self.gid_index, mtu=port_attr.active_mtu, qp_type=self.qp_type)
        return ep.with_mr(mr) if mr is not None else ep

    # ---- posting -------------------------------------------------------------------------------

    cdef int _require_rts(self, str what) except -1:
        # the slow path of a send's state test: refuse a closed QP, and read the state again, since
        # librdmacm moves a CM id's QP itself (ibv_modify_qp records it)
        self._check_open()
        self._state = self.qp.state
        if self._state < IBV_QPS_RTS:
            raise UsageError(f"cannot {what} on a QP in {_STATE_NAMES.get(self._state)}; "
                             f"bring it to RTS first (connect())", obj=repr(self))
        return 0

    cdef int _post_send(self, ibv_send_wr *wr, list ahs=None) except -1:
        # ``ahs``: the AddressHandles the chain's UD WRs point at, checked open here, at post time
        cdef ibv_send_wr *bad = NULL
        cdef ibv_send_wr *w
        cdef int rc
        cdef AddressHandle ah
        # One test on the hot path: a closed QP keeps its last state (RTS), so its NULL handle is
        # what refuses it.
        if self.qp == NULL or self._closing or self._state < IBV_QPS_RTS:
            self._require_rts("post a send")
        if ahs is not None:
            for ah in ahs:
                if ah._closed or ah._closing:
                    return refuse(ah)
                if ah.pd is not self.pd:   # verbs requires the QP's own PD; the provider does not check
                    raise UsageError(f"{ah!r} belongs to another protection domain than the QP's {self.pd!r}",
                                     obj=repr(self))
        if self.qp_type == IBV_QPT_UD:
            # the provider dereferences a UD WR's address handle unchecked: a missing one is a crash
            w = wr
            while w != NULL:
                if w.wr.ud.ah == NULL:
                    raise UsageError(f"a send on a UD QP needs an AddressHandle (ah=); WR wr_id={w.wr_id} has none",
                                     obj=repr(self))
                w = w.next
        if ahs is not None:
            for ah in ahs:
                ah._users += 1
        # C only from here to the decrements: close() from another thread waits for the post.
        self._users += 1
        with nogil:
            rc = ibv_post_send(self.qp, wr, &bad)
        self._users -= 1
        if ahs is not None:
            for ah in ahs:
                ah._users -= 1
        if rc:
            index = 0
            while wr != NULL and wr != bad:
                wr = wr.next
                index += 1
            raise_errno("ibv_post_send", rc, f"{self!r} (work request #{index} of the chain)")
        return 0

    cdef int _post_recv(self, ibv_recv_wr *wr) except -1:
        cdef ibv_recv_wr *bad = NULL
        cdef int rc
        if self.qp == NULL or self._closing or self._state == IBV_QPS_RESET:
            self._check_open()
            self._state = self.qp.state
        if self._state == IBV_QPS_RESET:
            raise UsageError("cannot post a receive on a QP in RESET; call to_init() first", obj=repr(self))
        if self.srq is not None:
            raise UsageError("this QP takes receives from its SRQ; post to the SharedReceiveQueue", obj=repr(self))
        self._users += 1
        with nogil:
            rc = ibv_post_recv(self.qp, wr, &bad)
        self._users -= 1
        if rc:
            raise_errno("ibv_post_recv", rc, repr(self))
        return 0

    cdef int _post_send_ahs(self, ibv_send_wr *chain, list owners) except -1:
        # Post a chain whose WRs (owners[i]: a SendWR, or another keepalive object) may carry
        # AddressHandles: each handle's pointer is taken now, and _post_send checks it is open.
        cdef list ahs = []
        cdef int i
        cdef AddressHandle ah
        for i in range(len(owners)):
            owner = owners[i]
            if isinstance(owner, SendWR) and (<SendWR>owner).ah is not None:
                ahs.append((<SendWR>owner).ah)
        for i in range(len(owners)):
            owner = owners[i]
            if isinstance(owner, SendWR) and (<SendWR>owner).ah is not None:
                ah = (<SendWR>owner).ah
                chain[i].wr.ud.ah = ah.ah
        return self._post_send(chain, ahs)

    def post_send(self, wr):
        """Post a SendWR, a SendWRList, or a sequence of SendWRs (chained into one call)."""
        cdef ibv_send_wr *chain
        cdef int i, n
        if isinstance(wr, SendWR):
            self._check_wr(<SendWR>wr)
            if (<SendWR>wr).ah is None:
                self._post_send(&(<SendWR>wr).wr)
            else:
                self._post_send_ahs(&(<SendWR>wr).wr, [wr])
        elif isinstance(wr, SendWRList):
            self.post_send_list(wr)
        else:
            items = list(wr)
            n = len(items)
            if n == 0:
                return
            for item in items:
                if not isinstance(item, SendWR):
                    raise UsageError(f"expected SendWR items, got {type(item).__name__}")
                self._check_wr(<SendWR>item)
            chain = <ibv_send_wr *>calloc(n, sizeof(ibv_send_wr))
            if chain == NULL:
                raise MemoryError()
            try:
                for i in range(n):
                    memcpy(&chain[i], &(<SendWR>items[i]).wr, sizeof(ibv_send_wr))
                    chain[i].next = &chain[i + 1] if i + 1 < n else NULL
                self._post_send_ahs(chain, items)
            finally:
                free(chain)

    cdef _check_wr(self, SendWR wr):
        cdef int i
        cdef uint64_t total = 0    # 64 bits: several 4 GiB SGEs must not sum to a "small" inline send
        if wr.wr.send_flags & IBV_SEND_INLINE:
            for i in range(wr.wr.num_sge):
                total += wr.sges[i].length
            if total > self.max_inline_data:
                raise UsageError(f"inline send of {total} bytes exceeds max_inline_data={self.max_inline_data}",
                                 obj=repr(self))
        if (wr.wr.opcode in (IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD)
                and self.qp_type != IBV_QPT_RC):
            raise UsageError("RDMA READ and atomics need an RC QP", obj=repr(self))

    def post_send_list(self, SendWRList wrs not None, count=None):
        """Post the first ``count`` (default: all filled) WRs of ``wrs`` in one call, GIL released."""
        cdef int n = wrs.count if count is None else count
        cdef int i
        cdef uint64_t total
        cdef ibv_send_wr *saved
        if not 1 <= n <= wrs.count:
            raise UsageError(f"count={n} outside 1..{wrs.count} (filled WRs)")
        saved = wrs.wrs[n - 1].next
        wrs.wrs[n - 1].next = NULL
        try:
            if wrs.n_ah:
                self._post_send_ahs(wrs.wrs, wrs.keepalive[:n])
            else:
                self._post_send(wrs.wrs)
        finally:
            wrs.wrs[n - 1].next = saved

    def post_recv(self, wr):
        """Post a RecvWR, a RecvWRList, or a sequence of RecvWRs."""
        if isinstance(wr, RecvWR):
            self._post_recv(&(<RecvWR>wr).wr)
        elif isinstance(wr, RecvWRList):
            self.post_recv_list(wr)
        else:
            for item in wr:
                if not isinstance(item, RecvWR):
                    raise UsageError(f"expected RecvWR items, got {type(item).__name__}")
                self._post_recv(&(<RecvWR>item).wr)

    def post_recv_list(self, RecvWRList wrs not None, count=None):
        cdef int n = wrs.count if count is None else count
        cdef ibv_recv_wr *saved
        if not 1 <= n <= wrs.count:
            raise UsageError(f"count={n} outside 1..{wrs.count} (filled WRs)")
        saved = wrs.wrs[n - 1].next
        wrs.wrs[n - 1].next = NULL
        try:
            self._post_recv(wrs.wrs)
        finally:
            wrs.wrs[n - 1].next = saved

    # Fast paths: one WR built on the stack, no Python WR object.

    def post_write(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length, uint64_t remote_addr,
                   uint32_t rkey, uint64_t wr_id=0, bint signaled=True, imm=None, bint inline=False):
        """RDMA WRITE (WITH_IMM when ``imm`` is given) of mr[offset:offset+length] to remote_addr."""
        cdef ibv_send_wr wr
        cdef ibv_sge sge
        memset(&wr, 0, sizeof(wr))
        self._fill_local(&wr, &sge, mr, offset, length, wr_id, signaled, inline)
        if imm is None:
            wr.opcode = IBV_WR_RDMA_WRITE
        else:
            wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
            wr.imm_data = imm_data_be(imm)
        wr.wr.rdma.remote_addr = remote_addr
        wr.wr.rdma.rkey = rkey
        self._post_send(&wr)

    def post_read(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length, uint64_t remote_addr,
                  uint32_t rkey, uint64_t wr_id=0, bint signaled=True):
        """RDMA READ of ``length`` bytes at remote_addr into mr[offset:]."""
        cdef ibv_send_wr wr
        cdef ibv_sge sge
        if self.qp_type != IBV_QPT_RC:
            raise UsageError("RDMA READ needs an RC QP", obj=repr(self))
        memset(&wr, 0, sizeof(wr))
        self._fill_local(&wr, &sge, mr, offset, length, wr_id, signaled, False)
        wr.opcode = IBV_WR_RDMA_READ
        wr.wr.rdma.remote_addr = remote_addr
        wr.wr.rdma.rkey = rkey
        self._post_send(&wr)

    def post_send_buf(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length, uint64_t wr_id=0,
                      bint signaled=True, imm=None, bint inline=False, bint solicited=False,
                      AddressHandle ah=None, uint32_t remote_qpn=0, uint32_t remote_qkey=DEFAULT_QKEY):
        """SEND (WITH_IMM when ``imm`` is given) of mr[offset:offset+length]; UD QPs need ``ah`` and remote_qpn."""
        cdef ibv_send_wr wr
        cdef ibv_sge sge
        memset(&wr, 0, sizeof(wr))
        self._fill_local(&wr, &sge, mr, offset, length, wr_id, signaled, inline)
        if imm is None:
            wr.opcode = IBV_WR_SEND
        else:
            wr.opcode = IBV_WR_SEND_WITH_IMM
            wr.imm_data = imm_data_be(imm)
        if solicited:
            wr.send_flags |= IBV_SEND_SOLICITED
        if self.qp_type == IBV_QPT_UD:
            if ah is None:
                raise UsageError("a UD send needs an AddressHandle (ah=) and remote_qpn", obj=repr(self))
            wr.wr.ud.remote_qpn = remote_qpn
            wr.wr.ud.remote_qkey = remote_qkey
            wr.wr.ud.ah = ah.ah
            self._post_send(&wr, [ah])    # checks the handle is open, and holds it over the post
            return
        self._post_send(&wr)

    def post_recv_buf(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length, uint64_t wr_id=0):
        """Post one receive into mr[offset:offset+length] (UD: the first 40 bytes receive the GRH)."""
        cdef ibv_recv_wr wr
        cdef ibv_sge sge
        fill_sge(&sge, mr, offset, length)
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        self._post_recv(&wr)

    def post_atomic_fetch_add(self, MemoryRegion mr not None, Py_ssize_t offset, uint64_t remote_addr,
                              uint32_t rkey, uint64_t add, uint64_t wr_id=0, bint signaled=True):
        """Atomically add ``add`` to the 8 bytes at remote_addr; the old value lands in mr[offset:offset+8]."""
        self._post_atomic(IBV_WR_ATOMIC_FETCH_AND_ADD, mr, offset, remote_addr, rkey, add, 0, wr_id, signaled)

    def post_atomic_cmp_swap(self, MemoryRegion mr not None, Py_ssize_t offset, uint64_t remote_addr,
                             uint32_t rkey, uint64_t compare, uint64_t swap, uint64_t wr_id=0,
                             bint signaled=True):
        """If the 8 bytes at remote_addr equal ``compare``, store ``swap``; the old value lands in mr."""
        self._post_atomic(IBV_WR_ATOMIC_CMP_AND_SWP, mr, offset, remote_addr, rkey, compare, swap, wr_id,
                          signaled)

    cdef _post_atomic(self, int opcode, MemoryRegion mr, Py_ssize_t offset, unsigned long long remote_addr,
                      unsigned int rkey, unsigned long long compare_add, unsigned long long swap,
                      unsigned long long wr_id, bint signaled):
        cdef ibv_send_wr wr
        cdef ibv_sge sge
        if self.qp_type != IBV_QPT_RC:
            raise UsageError("atomics need an RC QP", obj=repr(self))
        memset(&wr, 0, sizeof(wr))
        self._fill_local(&wr, &sge, mr, offset, 8, wr_id, signaled, False)   # bounds first
        if remote_addr % 8 or sge.addr % 8:
            raise UsageError("atomics need 8-byte aligned local and remote addresses", obj=repr(self))
        wr.opcode = opcode
        wr.wr.atomic.remote_addr = remote_addr
        wr.wr.atomic.rkey = rkey
        wr.wr.atomic.compare_add = compare_add
        wr.wr.atomic.swap = swap
        self._post_send(&wr)

    # ---- memory windows ------------------------------------------------------------------------

    def bind_mw(self, MemoryWindow mw not None, MemoryRegion mr=None, Py_ssize_t offset=0, length=None,
                int access=IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, uint64_t wr_id=0,
                bint signaled=True):
        """Bind ``mw`` to mr[offset:offset+length] with remote ``access`` and return its new rkey.
        Type 1: ibv_bind_mw; ``mr=None`` (or length 0) unbinds it. Type 2: a BIND_MW work request
        with a fresh rkey tag; revoke it with post_local_invalidate(). The MR needs ACCESS_MW_BIND,
        and the bind completes on this QP's send CQ like any signaled send."""
        cdef ibv_mw_bind bind
        cdef ibv_send_wr wr
        cdef unsigned int rkey
        cdef int rc
        cdef Py_ssize_t size
        mw._check_open()
        if mw.pd is not self.pd:
            raise UsageError(f"{mw!r} belongs to another protection domain than the QP's {self.pd!r}", obj=repr(self))
        if access & ~_REMOTE_ACCESS or access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) and (
                mr is not None and not mr.access & IBV_ACCESS_LOCAL_WRITE):
            raise UsageError(f"window access 0x{access:x}: use ACCESS_REMOTE_* flags the MR allows "
                             f"(remote write and atomics need an MR with ACCESS_LOCAL_WRITE)", obj=repr(self))
        memset(&bind, 0, sizeof(bind))
        if mr is None and mw.type == IBV_MW_TYPE_1:
            # unbinding is a bind of length 0; providers (rxe) read the MR's lkey even then
            mr = mw.bound_mr
            if mr is None:
                raise UsageError(f"{mw!r} is not bound; there is nothing to unbind", obj=repr(self))
            length = 0
        if mr is not None:
            mr._check_open()
            if mr.pd is not self.pd:
                raise UsageError(f"{mr!r} belongs to another protection domain than the QP's", obj=repr(self))
            bind.bind_info.mr = mr.mr
            size = mr.length - offset if length is None else length
            if not size and mw.type == IBV_MW_TYPE_2:
                raise UsageError("a type 2 window is bound to at least one byte", obj=repr(self))
            if size:
                if offset < 0 or size < 0 or <size_t>offset > mr.length or <size_t>size > mr.length - offset:
                    raise UsageError(f"window [{offset}, {offset}+{size}) is outside the MR of {mr.length} bytes",
                                     obj=repr(self))
                if not mr.access & IBV_ACCESS_MW_BIND:
                    raise UsageError("the MR was registered without ACCESS_MW_BIND", obj=repr(mr))
                bind.bind_info.addr = mr.addr + offset
                bind.bind_info.length = size
                bind.bind_info.mw_access_flags = access
        else:
            raise UsageError("a type 2 window is revoked with post_local_invalidate(mw.rkey), not by an empty bind",
                             obj=repr(self))
        if self.qp == NULL or self._closing or self._state < IBV_QPS_RTS:
            self._require_rts("bind a window")
        if mw.type == IBV_MW_TYPE_1:
            bind.wr_id = wr_id
            bind.send_flags = IBV_SEND_SIGNALED if signaled else 0
            self._users += 1
            mw._users += 1
            with nogil:
                rc = ibv_bind_mw(self.qp, mw.mw, &bind)
            mw._users -= 1
            self._users -= 1
            if rc:
                raise_errno("ibv_bind_mw", rc, f"{mw!r} on {self!r}")
            rkey = mw.mw.rkey
        else:
            memset(&wr, 0, sizeof(wr))
            wr.wr_id = wr_id
            wr.opcode = IBV_WR_BIND_MW
            wr.send_flags = IBV_SEND_SIGNALED if signaled else 0
            rkey = ibv_inc_rkey(mw.mw.rkey)
            wr.bind_mw.mw = mw.mw
            wr.bind_mw.rkey = rkey
            wr.bind_mw.bind_info = bind.bind_info
            mw._users += 1
            try:
                self._post_send(&wr)
            finally:
                mw._users -= 1
        bound = bind.bind_info.length != 0
        mw._set_bound(mr if bound else None, bind.bind_info.addr if bound else 0, bind.bind_info.length, rkey,
                      self if bound else None)
        return rkey

    def post_local_invalidate(self, target, uint64_t wr_id=0, bint signaled=True):
        """LOCAL_INV: revoke ``target``, a type 2 MemoryWindow (then marked unbound) or an rkey; later
        remote accesses with that rkey fail."""
        cdef ibv_send_wr wr
        cdef MemoryWindow mw = None
        if isinstance(target, MemoryWindow):
            mw = target
            if mw.type != IBV_MW_TYPE_2:
                raise UsageError("LOCAL_INV revokes type 2 windows; unbind type 1 with bind_mw(mw, None)",
                                 obj=repr(self))
            rkey = mw.rkey
        else:
            rkey = target
            if not isinstance(rkey, int) or not 0 <= rkey <= 0xFFFFFFFF:
                raise UsageError(f"post_local_invalidate takes a MemoryWindow or a 32-bit rkey, got {target!r}",
                                 obj=repr(self))
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.opcode = IBV_WR_LOCAL_INV
        wr.send_flags = IBV_SEND_SIGNALED if signaled else 0
        wr.invalidate_rkey = <uint32_t>rkey
        self._post_send(&wr)
        if mw is not None:
            mw._set_bound(None, 0, 0, mw.mw.rkey)

    cdef int _fill_local(self, ibv_send_wr *wr, ibv_sge *sge, MemoryRegion mr, Py_ssize_t offset,
                         Py_ssize_t length, unsigned long long wr_id, bint signaled, bint inline) except -1:
        fill_sge(sge, mr, offset, length)
        if inline and <size_t>length > self.max_inline_data:
            raise UsageError(f"inline send of {length} bytes exceeds max_inline_data={self.max_inline_data}",
                             obj=repr(self))
        wr.wr_id = wr_id
        wr.sg_list = sge
        wr.num_sge = 1 if length > 0 else 0
        wr.send_flags = (IBV_SEND_SIGNALED if signaled else 0) | (IBV_SEND_INLINE if inline else 0)
        return 0


cdef QueuePair wrap_cm_qp(ibv_qp *qp, void *cm_id, void (*destroy)(void *) noexcept nogil, list parents,
                          ProtectionDomain pd, CompletionQueue send_cq, CompletionQueue recv_cq,
                          SharedReceiveQueue srq, int port, dict cap):
    """A QueuePair over the QP librdmacm created on ``cm_id`` (rdma_create_qp). ``parents`` (the PD,
    CQs, SRQ and the CM id) were adopt()ed by the caller; closing any of them closes this QP, whose one
    teardown path is ``destroy(cm_id)`` (rdma_destroy_qp)."""
    cdef QueuePair self = QueuePair.__new__(QueuePair)
    self._initialised = True
    for parent in parents:
        (<VerbsObject>parent)._children[self._serial] = weakref.ref(self)
        self._parents.append(parent)
    self.qp = qp
    self._cm_id = cm_id
    self._cm_destroy_qp = destroy
    self.pd, self.send_cq, self.recv_cq, self.srq = pd, send_cq, recv_cq, srq
    self.qp_type = qp.qp_type
    self.qp_num = qp.qp_num
    self.psn = 0
    self.cap = cap
    self.max_inline_data = cap["max_inline_data"]
    self.port = port
    self.gid_index = 0
    self._state = qp.state
    self._closed = False
    return self
