"""Shared receive queues: one pool of receive buffers for many QPs."""
cimport cython
from libc.errno cimport errno
from libc.string cimport memset
from libc.stdint cimport uint64_t
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release, use, unuse
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.wr cimport RecvWR, RecvWRList, fill_sge

from pyrdma.errors import UsageError


@cython.no_gc_clear
cdef class SharedReceiveQueue(VerbsObject):
    def __init__(self, ProtectionDomain pd not None, int max_wr=256, int max_sge=1, int srq_limit=0):
        cdef ibv_srq_init_attr attr
        cdef int err = 0
        self._begin_init()
        pd._check_open()
        dev = pd.context.query_device()
        if not 1 <= max_wr <= dev.max_srq_wr:
            raise UsageError(f"max_wr={max_wr} outside 1..{dev.max_srq_wr} (device max_srq_wr)")
        if not 1 <= max_sge <= dev.max_srq_sge:
            raise UsageError(f"max_sge={max_sge} outside 1..{dev.max_srq_sge} (device max_srq_sge)")
        memset(&attr, 0, sizeof(attr))
        attr.attr.max_wr = max_wr
        attr.attr.max_sge = max_sge
        attr.attr.srq_limit = srq_limit
        parents = [pd]
        adopt(self, parents)
        self.pd = pd
        self.srq = ibv_create_srq(pd.pd, &attr)
        if self.srq != NULL:
            self._closed = False
        else:
            err = errno
        release(parents)
        if self.srq == NULL:
            self._abandon()
            raise_errno("ibv_create_srq", err, repr(pd))
        self.max_wr = attr.attr.max_wr
        self.max_sge = attr.attr.max_sge

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.srq != NULL:
            rc = ibv_destroy_srq(self.srq)
            self.srq = NULL
            if rc:
                raise_errno("ibv_destroy_srq", rc, repr(self))
        return 0

    def __repr__(self):
        return f"<SharedReceiveQueue max_wr={self.max_wr}{' closed' if self._closed else ''}>"

    cdef _post(self, ibv_recv_wr *wr):
        cdef ibv_recv_wr *bad = NULL
        cdef int rc
        use(self)    # refuses a closed SRQ; close() waits for the post to leave
        with nogil:
            rc = ibv_post_srq_recv(self.srq, wr, &bad)
        unuse(self)
        if rc:
            raise_errno("ibv_post_srq_recv", rc, repr(self))

    def post_recv(self, wr):
        """Post a RecvWR, a list of them, or a RecvWRList."""
        if self.srq == NULL:
            self._check_open()
        if isinstance(wr, RecvWR):
            self._post(&(<RecvWR>wr).wr)
        elif isinstance(wr, RecvWRList):
            if (<RecvWRList>wr).count:
                self._post((<RecvWRList>wr).wrs)
        else:
            for item in wr:
                self.post_recv(item)

    def post_recv_buf(self, MemoryRegion mr not None, Py_ssize_t offset, Py_ssize_t length, uint64_t wr_id=0):
        cdef ibv_recv_wr wr
        cdef ibv_sge sge
        if self.srq == NULL:
            self._check_open()
        fill_sge(&sge, mr, offset, length)
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        self._post(&wr)
