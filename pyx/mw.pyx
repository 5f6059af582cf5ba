"""Memory windows: remote access to a part of a registered MR, granted and revoked by the owner.

Type 1 windows are bound with ``QueuePair.bind_mw`` (ibv_bind_mw) and unbound by a bind of length 0;
type 2 windows are bound by a BIND_MW work request and revoked with ``post_local_invalidate`` (or a
peer's SEND_WITH_INV). Either way the peer uses the window's ``rkey`` with the MR's addresses.
"""
cimport cython
from libc.errno cimport errno
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release
from pyrdma._verbs.pd cimport ProtectionDomain
import enum

from pyrdma.errors import UsageError


class MWType(enum.IntEnum):
    """ibv_mw_type."""
    TYPE_1 = IBV_MW_TYPE_1
    TYPE_2 = IBV_MW_TYPE_2


MW_TYPE_1, MW_TYPE_2 = MWType.TYPE_1, MWType.TYPE_2


@cython.no_gc_clear
cdef class MemoryWindow(VerbsObject):
    """``MemoryWindow(pd, type=MW_TYPE_2)``: a window in ``pd`` (ibv_alloc_mw), unbound at first."""

    def __init__(self, ProtectionDomain pd not None, int type=IBV_MW_TYPE_2):
        cdef int err = 0
        self._begin_init()
        if type not in (IBV_MW_TYPE_1, IBV_MW_TYPE_2):
            raise UsageError(f"memory window type must be MW_TYPE_1 or MW_TYPE_2, got {type}")
        parents = [pd]
        adopt(self, parents)
        self.pd = pd
        self.type = type
        self.mw = ibv_alloc_mw(pd.pd, type)
        if self.mw != NULL:
            self._closed = False
        else:
            err = errno
        release(parents)
        if self.mw == NULL:
            self._abandon()
            raise_errno("ibv_alloc_mw", err, f"type {type} window in {pd!r} (device max_mw="
                                             f"{pd.context.query_device().max_mw})")

    @property
    def rkey(self):
        """The key a peer uses now: it changes with every bind (its low 8 bits are a tag)."""
        self._check_open()
        return self.mw.rkey

    cdef int _set_bound(self, object mr, unsigned long long addr, unsigned long long length, unsigned int rkey,
                        object qp=None) except -1:
        # A bound window is a child of its MR (verbs refuses to deregister an MR with bound windows)
        # and, type 2, of the QP that bound it (rxe pins that QP: destroying it first would hang), so
        # closing either, or their PD or Context in any order, closes the window first.
        self._reparent(self.bound_mr, mr)
        self._reparent(self.bound_qp, qp if self.type == IBV_MW_TYPE_2 else None)
        self.bound_mr = mr
        self.bound_qp = qp if self.type == IBV_MW_TYPE_2 else None
        self.addr, self.length = addr, length
        if self.type == IBV_MW_TYPE_2:
            self.mw.rkey = rkey    # verbs leaves this to the caller for type 2
        return 0

    cdef int _reparent(self, object old, object new) except -1:
        if old is new:
            return 0
        if old is not None:
            (<VerbsObject>old)._children.pop(self._serial, None)
            self._parents.remove(old)
        if new is not None:
            (<VerbsObject>new)._adopt(self)
        return 0

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.mw != NULL:
            rc = ibv_dealloc_mw(self.mw)
            self.mw = NULL
            self.bound_mr = self.bound_qp = None
            if rc:
                raise_errno("ibv_dealloc_mw", rc, repr(self))
        return 0

    def __repr__(self):
        state = "closed" if self._closed else (f"bound 0x{self.addr:x}+{self.length}" if self.bound_mr is not None
                                               else "unbound")
        return f"<MemoryWindow type {self.type} {state}>"
