"""Memory regions: zero-copy registration of buffer-protocol objects and of device memory."""
cimport cython
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_C_CONTIGUOUS,
                             PyBUF_WRITABLE, PyBUF_SIMPLE, PyBUF_ANY_CONTIGUOUS)
from libc.errno cimport errno
from libc.stdint cimport uintptr_t, uint64_t
import enum
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport VerbsObject, raise_errno, adopt, release
from pyrdma._verbs.loader cimport require_entry_point, PYRDMA_DL_VERBS
from pyrdma._verbs.pd cimport ProtectionDomain
from pyrdma._verbs.device cimport reg_dmabuf_mr_works
import numpy as np

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX

from pyrdma.errors import RDMAError, UsageError

class Access(enum.IntFlag):
    """ibv_access_flags of a memory region (and of a QP's remote access)."""
    LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
    REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
    REMOTE_READ = IBV_ACCESS_REMOTE_READ
    REMOTE_ATOMIC = IBV_ACCESS_REMOTE_ATOMIC
    MW_BIND = IBV_ACCESS_MW_BIND
    ON_DEMAND = IBV_ACCESS_ON_DEMAND


ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE = Access.LOCAL_WRITE, Access.REMOTE_WRITE
ACCESS_REMOTE_READ, ACCESS_REMOTE_ATOMIC = Access.REMOTE_READ, Access.REMOTE_ATOMIC
ACCESS_ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
ACCESS_MW_BIND = Access.MW_BIND     # memory windows may be bound to the MR (not part of ACCESS_ALL)
ACCESS_ON_DEMAND = Access.ON_DEMAND  # on-demand paging, where Context.query_odp().supported
cdef int _WRITE_BITS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC
PAGE_SIZE = 4096


def aligned_empty(size_t nbytes, size_t alignment=PAGE_SIZE):
    """An uninitialised numpy uint8 array of ``nbytes`` whose data starts on ``alignment``."""
    if nbytes == 0:
        raise UsageError("cannot allocate an empty buffer")
    if alignment == 0 or alignment & (alignment - 1):
        raise UsageError(f"alignment must be a power of two, got {alignment}")
    if nbytes > <size_t>PY_SSIZE_T_MAX - alignment:   # nbytes + alignment would wrap
        raise UsageError(f"cannot allocate {nbytes} bytes")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


cdef int _check_access(ProtectionDomain pd, int access) except -1:
    if access & ~(<int>ACCESS_ALL | IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND):
        raise UsageError(f"unknown access flags 0x{access:x}; use pyrdma.ACCESS_*")
    if access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) and not access & IBV_ACCESS_LOCAL_WRITE:
        raise UsageError("ACCESS_REMOTE_WRITE and ACCESS_REMOTE_ATOMIC require ACCESS_LOCAL_WRITE")
    if access & IBV_ACCESS_ON_DEMAND and not pd.context.query_odp().supported:
        raise UsageError(f"ACCESS_ON_DEMAND: {pd.context.name} has no on-demand paging "
                         f"(Context.query_odp().supported is False)", obj=repr(pd))
    return 0


@cython.no_gc_clear
cdef class MemoryRegion(VerbsObject):
    """A registered memory region.

    ``MemoryRegion(pd, buf, access)`` registers the memory of ``buf`` in place: any C-contiguous
    buffer-protocol object (numpy array, bytearray, memoryview, mmap). It must be writable when
    ``access`` has a write bit. The object is kept alive (a bytearray cannot be resized) until close().
    """

    def __init__(self, ProtectionDomain pd not None, buf, int access=IBV_ACCESS_LOCAL_WRITE):
        cdef int flags
        self._begin_init()
        pd._check_open()
        _check_access(pd, access)
        if buf is None:
            raise UsageError("buffer is None; pass a buffer-protocol object or use MemoryRegion.allocate")
        flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if access & _WRITE_BITS else 0)
        try:
            PyObject_GetBuffer(buf, &self.view, flags)
        except (BufferError, ValueError) as exc:   # numpy raises ValueError for non-contiguous
            _explain_buffer_error(buf, access, exc)
        except TypeError:
            raise UsageError(f"{type(buf).__name__} does not support the buffer protocol; "
                             f"pass a numpy array, bytearray or memoryview") from None
        self.has_view = True
        if self.view.len == 0:
            self._release_view()
            raise UsageError("cannot register an empty buffer")
        self._register(pd, <void *>self.view.buf, self.view.len, access, buf)

    cdef _register(self, ProtectionDomain pd, void *addr, size_t length, int access, object owner):
        cdef int err = 0
        parents = [pd]
        try:
            adopt(self, parents)
        except BaseException:
            self._release_view()
            raise
        with nogil:
            self.mr = ibv_reg_mr(pd.pd, addr, length, access)
            if self.mr == NULL:
                err = errno
        self._finish(pd, access, owner, parents)
        if self.mr == NULL:
            self._release_view()
            raise_errno("ibv_reg_mr", err, f"{length} bytes at 0x{<uintptr_t>addr:x} in {pd!r}")

    cdef _finish(self, ProtectionDomain pd, int access, object owner, list parents):
        # called with pd in use (see adopt); only C assignments until release
        if self.mr != NULL:
            self.addr = <uintptr_t>self.mr.addr
            self.length = self.mr.length
            self.lkey = self.mr.lkey
            self.rkey = self.mr.rkey
            self._closed = False
        release(parents)
        if self.mr == NULL:
            self._abandon()
            return
        self.pd = pd
        self.buffer = owner
        self.access = access

    @staticmethod
    def allocate(ProtectionDomain pd not None, size_t length, int access=IBV_ACCESS_LOCAL_WRITE):
        """Allocate a zeroed page-aligned buffer of ``length`` bytes and register it."""
        buf = aligned_empty(length)
        buf[:] = 0
        return MemoryRegion(pd, buf, access)

    @staticmethod
    def from_pointer(ProtectionDomain pd not None, uintptr_t addr, size_t length,
                     int access=IBV_ACCESS_LOCAL_WRITE, owner=None):
        """Register raw memory (e.g. GPU memory through nvidia-peermem). ``owner`` is kept alive."""
        cdef MemoryRegion self = MemoryRegion.__new__(MemoryRegion)
        self._begin_init()
        pd._check_open()
        _check_access(pd, access)
        if length == 0:
            raise UsageError("cannot register an empty range")
        self.is_device_memory = True
        self._register(pd, <void *>addr, length, access, owner)
        return self

    @staticmethod
    def from_dmabuf(ProtectionDomain pd not None, int fd, uint64_t offset, size_t length, uint64_t iova,
                    int access=IBV_ACCESS_LOCAL_WRITE, owner=None):
        """Register device memory exported as a dma-buf (ibv_reg_dmabuf_mr). ``owner`` is kept alive."""
        cdef MemoryRegion self = MemoryRegion.__new__(MemoryRegion)
        cdef int err = 0
        require_entry_point(PYRDMA_DL_VERBS, "ibv_reg_dmabuf_mr", "ibv_reg_dmabuf_mr")
        self._begin_init()
        pd._check_open()
        _check_access(pd, access)
        if length == 0:
            raise UsageError("cannot register an empty range")
        self.is_device_memory = True
        parents = [pd]
        adopt(self, parents)
        with nogil:
            self.mr = ibv_reg_dmabuf_mr(pd.pd, offset, length, iova, fd, access)
            if self.mr == NULL:
                err = errno
        self._finish(pd, access, owner, parents)
        if self.mr == NULL:
            raise_errno("ibv_reg_dmabuf_mr", err, f"dmabuf fd {fd} offset {offset} length {length}")
        return self

    cdef _release_view(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False

    def __dealloc__(self):
        self.close()    # the one teardown path (unreachable: no child and no call is left)
        self._release_view()    # a registration that failed leaves no handle but may hold the view

    cdef int _destroy(self) except -1:
        cdef int rc
        if self.mr != NULL:
            rc = ibv_dereg_mr(self.mr)
            self.mr = NULL
            if rc:
                raise_errno("ibv_dereg_mr", rc, repr(self))
        self._release_view()
        return 0

    def array(self, dtype=np.uint8, size_t offset=0, count=-1):
        """A numpy view of the registered host memory (it keeps the memory alive on its own)."""
        if self.is_device_memory or self.buffer is None:
            raise UsageError("array() needs host memory registered from a buffer object", obj=repr(self))
        raw = np.frombuffer(memoryview(self.buffer).cast("B"), dtype=np.uint8)
        if offset > raw.nbytes:
            raise UsageError(f"offset {offset} beyond the region's {raw.nbytes} bytes", obj=repr(self))
        raw = raw[offset:]
        dt = np.dtype(dtype)
        n = raw.nbytes // dt.itemsize if count < 0 else count
        if n * dt.itemsize > raw.nbytes:
            raise UsageError(f"{n} items of {dt} at offset {offset} exceed the region", obj=repr(self))
        return raw[:n * dt.itemsize].view(dt)

    def __repr__(self):
        state = " closed" if self._closed else ""
        return f"<MemoryRegion addr=0x{self.addr:x} length={self.length} lkey=0x{self.lkey:x} rkey=0x{self.rkey:x}{state}>"


cdef _explain_buffer_error(buf, int access, exc):
    cdef Py_buffer view
    try:
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        PyBuffer_Release(&view)
    except (BufferError, ValueError):
        pass
    ro = False
    try:
        ro = memoryview(buf).readonly
    except Exception:
        pass
    if ro and access & _WRITE_BITS:
        raise UsageError(f"{type(buf).__name__} buffer is read-only, but the access flags ask for write "
                         f"access; register a writable buffer or drop the write bits") from None
    raise UsageError(f"{type(buf).__name__} buffer is not C-contiguous; register a contiguous copy "
                     f"(e.g. numpy.ascontiguousarray)") from None


def probe_dmabuf(ProtectionDomain pd not None):
    """True when the provider implements ibv_reg_dmabuf_mr (Context.dmabuf_supported on a given PD)."""
    pd._check_open()     # the call below holds the GIL, so pd cannot be closed under it
    return reg_dmabuf_mr_works(pd.pd)
