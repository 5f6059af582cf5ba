"""Address handles: where a UD send goes."""
cimport cython
from libc.errno cimport errno
from libc.string cimport memset
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release
from pyrdma._verbs.pd cimport ProtectionDomain

from pyrdma.errors import UsageError


@cython.no_gc_clear
cdef class AddressHandle(VerbsObject):
    """``AddressHandle(pd, remote_endpoint, port=1, sgid_index=None)`` for UD sends to that peer."""

    def __init__(self, ProtectionDomain pd not None, remote, int port=1, sgid_index=None, int hop_limit=64):
        self._begin_init()
        gid = bytes(remote.gid)
        self._create(pd, remote.lid, gid, port, sgid_index, gid != bytes(16), hop_limit)

    @staticmethod
    def from_attrs(ProtectionDomain pd not None, int dlid, gid=bytes(16), int port=1, sgid_index=None,
                   is_global=None, int hop_limit=64):
        cdef AddressHandle self = AddressHandle.__new__(AddressHandle)
        self._begin_init()
        gid = bytes(gid)
        self._create(pd, dlid, gid, port, sgid_index, gid != bytes(16) if is_global is None else is_global,
                     hop_limit)
        return self

    cdef _create(self, ProtectionDomain pd, int dlid, bytes gid, int port, sgid_index, bint is_global,
                 int hop_limit):
        cdef ibv_ah_attr attr
        cdef int i, err = 0
        pd._check_open()
        if len(gid) != 16:
            raise UsageError(f"a GID is 16 bytes, got {len(gid)}")
        memset(&attr, 0, sizeof(attr))
        attr.dlid = dlid
        attr.port_num = port
        if is_global:
            attr.is_global = 1
            for i in range(16):
                attr.grh.dgid.raw[i] = gid[i]
            attr.grh.sgid_index = pd.context.best_gid_index(port) if sgid_index is None else sgid_index
            attr.grh.hop_limit = hop_limit
        parents = [pd]
        adopt(self, parents)
        self.pd = pd
        self.ah = ibv_create_ah(pd.pd, &attr)
        if self.ah != NULL:
            self._closed = False
        else:
            err = errno
        release(parents)
        if self.ah == NULL:
            self._abandon()
            raise_errno("ibv_create_ah", err, repr(pd))

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.ah != NULL:
            rc = ibv_destroy_ah(self.ah)
            self.ah = NULL
            if rc:
                raise_errno("ibv_destroy_ah", rc, repr(self))
        return 0

    def __repr__(self):
        return f"<AddressHandle{' closed' if self._closed else ''}>"
