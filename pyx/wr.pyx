"""Scatter/gather entries and work requests, single and in preallocated lists for batch posting."""
from libc.stdlib cimport calloc, free
from libc.string cimport memset, memcpy
from libc.stdint cimport uint32_t, uint64_t, int64_t, int32_t
import enum
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.mr cimport MemoryRegion
from pyrdma._verbs.ah cimport AddressHandle
import numpy as np

from pyrdma.errors import UsageError

class WROpcode(enum.IntEnum):
    """ibv_wr_opcode: what a send work request does."""
    RDMA_WRITE = IBV_WR_RDMA_WRITE
    RDMA_WRITE_WITH_IMM = IBV_WR_RDMA_WRITE_WITH_IMM
    SEND = IBV_WR_SEND
    SEND_WITH_IMM = IBV_WR_SEND_WITH_IMM
    RDMA_READ = IBV_WR_RDMA_READ
    ATOMIC_CMP_AND_SWP = IBV_WR_ATOMIC_CMP_AND_SWP
    ATOMIC_FETCH_AND_ADD = IBV_WR_ATOMIC_FETCH_AND_ADD


class SendFlags(enum.IntFlag):
    """ibv_send_flags of a send work request."""
    FENCE = IBV_SEND_FENCE
    SIGNALED = IBV_SEND_SIGNALED
    SOLICITED = IBV_SEND_SOLICITED
    INLINE = IBV_SEND_INLINE


WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM = WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM
WR_SEND, WR_SEND_WITH_IMM, WR_RDMA_READ = WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.RDMA_READ
WR_ATOMIC_CMP_AND_SWP, WR_ATOMIC_FETCH_AND_ADD = WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD
SEND_FENCE, SEND_SIGNALED, SEND_SOLICITED, SEND_INLINE = (SendFlags.FENCE, SendFlags.SIGNALED, SendFlags.SOLICITED,
                                                          SendFlags.INLINE)

_OPCODES = {m.value: m.name for m in WROpcode}
cdef int _ALL_SEND_FLAGS = IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE
# Bounds on what a WR or a WR list may hold, far above any device's limits, so that every size
# computed from them fits a size_t and the C int fields of verbs.
MAX_SGE_PER_WR = 1 << 16
MAX_LIST_BYTES = 1 << 32


cdef inline uint32_t htonl(uint32_t x) noexcept nogil:
    return ((x & 0xff) << 24) | ((x & 0xff00) << 8) | ((x >> 8) & 0xff00) | (x >> 24)


cdef uint32_t imm_data_be(imm) except? 0:
    """``imm`` as a work request's immediate data: 32 bits, in network byte order."""
    if not 0 <= imm <= 0xFFFFFFFF:
        raise UsageError(f"imm {imm} does not fit in 32 bits")
    return htonl(<uint32_t>imm)


cdef int fill_sge(ibv_sge *sge, MemoryRegion mr, Py_ssize_t offset, Py_ssize_t length) except -1:
    """Point ``sge`` at [offset, offset+length) of ``mr``, refusing anything outside the region."""
    if mr.mr == NULL:
        raise UsageError("the MemoryRegion is closed", obj=repr(mr))
    # offset + length could overflow: compare against what is left after offset instead
    if offset < 0 or length < 0 or <size_t>offset > mr.length or <size_t>length > mr.length - <size_t>offset:
        raise UsageError(f"SGE [{offset}, {int(offset) + int(length)}) is outside the MR of {mr.length} bytes",
                         obj=repr(mr))
    if length > 0xFFFFFFFF:
        raise UsageError(f"SGE length {length} exceeds 2^32-1")
    sge.addr = mr.addr + offset
    sge.length = <uint32_t>length
    sge.lkey = mr.lkey
    return 0


cdef int _check_inline_total(ibv_sge *sges, int num) except -1:
    # Providers sum inline lengths in 32 bits: a larger total could pass their max_inline check.
    cdef uint64_t total = 0
    cdef int i
    for i in range(num):
        total += sges[i].length
    if total > 0xFFFFFFFF:
        raise UsageError(f"inline send of {total} bytes; inline data is far smaller (max_inline_data)")
    return 0


cdef int _check_opcode(int opcode, int flags, imm) except -1:
    if opcode not in _OPCODES:
        raise UsageError(f"unknown opcode {opcode}; use pyrdma.WR_*")
    if flags & ~_ALL_SEND_FLAGS:
        raise UsageError(f"unknown send flags 0x{flags:x}; use pyrdma.SEND_*")
    with_imm = opcode in (IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM)
    if with_imm and imm is None:
        raise UsageError(f"{_OPCODES[opcode]} needs imm_data")
    if not with_imm and imm is not None:
        raise UsageError(f"imm_data given for {_OPCODES[opcode]}; use a *_WITH_IMM opcode")
    if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
        raise UsageError(f"imm_data {imm} does not fit in 32 bits")
    return 0


cdef class SGE:
    """A scatter/gather entry: ``SGE(mr, offset=0, length=None)`` (default: to the region's end)."""

    def __init__(self, MemoryRegion mr not None, Py_ssize_t offset=0, length=None):
        fill_sge(&self.sge, mr, offset, (mr.length - offset) if length is None else length)
        self.mr = mr

    @staticmethod
    def raw(uint64_t addr, uint32_t length, uint32_t lkey):
        """An unchecked SGE from raw values (the device checks the lkey)."""
        cdef SGE s = SGE.__new__(SGE)
        s.sge.addr, s.sge.length, s.sge.lkey = addr, length, lkey
        return s

    @property
    def addr(self):
        return self.sge.addr

    @property
    def length(self):
        return self.sge.length

    @property
    def lkey(self):
        return self.sge.lkey

    def __repr__(self):
        return f"SGE(addr=0x{self.sge.addr:x}, length={self.sge.length}, lkey=0x{self.sge.lkey:x})"


cdef ibv_sge *_copy_sg_list(sg_list, list keepalive, int *num) except? NULL:
    cdef ibv_sge *sges
    cdef int i
    items = list(sg_list)
    if len(items) > MAX_SGE_PER_WR:
        raise UsageError(f"{len(items)} SGEs in one WR; at most {MAX_SGE_PER_WR}")
    num[0] = len(items)
    if not items:
        return NULL
    sges = <ibv_sge *>calloc(len(items), sizeof(ibv_sge))
    if sges == NULL:
        raise MemoryError()
    for i, item in enumerate(items):
        if isinstance(item, MemoryRegion):
            item = SGE(item)
        if not isinstance(item, SGE):
            free(sges)
            raise UsageError(f"sg_list entries must be SGE or MemoryRegion, got {type(item).__name__}")
        sges[i] = (<SGE>item).sge
        keepalive.append(item)
    return sges


cdef class _WorkRequest:
    """What SendWR and RecvWR share: the WR's SGEs in C memory, and what keeps their memory alive."""

    cdef int _take_sg_list(self, sg_list) except -1:
        """Copy ``sg_list`` (SGEs or MemoryRegions) into this WR's SGE array; returns their number."""
        cdef int num = 0
        keepalive = []
        sges = _copy_sg_list(sg_list, keepalive, &num)
        free(self.sges)    # __init__ called again: the old list goes only once the new one exists
        self.sges = sges
        self.keepalive = keepalive
        return num

    def __dealloc__(self):
        free(self.sges)


cdef class SendWR(_WorkRequest):
    """A send work request (SEND, WRITE, READ, atomics; with immediate data, UD addressing)."""

    def __init__(self, int opcode=IBV_WR_SEND, sg_list=(), uint64_t wr_id=0, int flags=IBV_SEND_SIGNALED,
                 imm_data=None, uint64_t remote_addr=0, uint32_t rkey=0, uint64_t compare_add=0,
                 uint64_t swap=0, AddressHandle ah=None, uint32_t remote_qpn=0, uint32_t remote_qkey=0):
        cdef int num
        _check_opcode(opcode, flags, imm_data)
        num = self._take_sg_list(sg_list)
        self.ah = None
        memset(&self.wr, 0, sizeof(self.wr))
        self.wr.wr_id = wr_id
        self.wr.sg_list = self.sges
        self.wr.num_sge = num
        self.wr.opcode = opcode
        self.wr.send_flags = flags
        if imm_data is not None:
            self.wr.imm_data = htonl(imm_data)
        if flags & IBV_SEND_INLINE:
            _check_inline_total(self.sges, num)
        if opcode in (IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD):
            if num != 1 or self.sges[0].length != 8:
                raise UsageError("atomic WRs need exactly one 8-byte SGE")
            if remote_addr % 8 or self.sges[0].addr % 8:
                raise UsageError("atomic WRs need 8-byte aligned local and remote addresses")
            self.wr.wr.atomic.remote_addr = remote_addr
            self.wr.wr.atomic.rkey = rkey
            self.wr.wr.atomic.compare_add = compare_add
            self.wr.wr.atomic.swap = swap
        elif ah is not None:
            ah._check_open()
            self.ah = ah     # the post takes the pointer, once it has checked the handle is open
            self.wr.wr.ud.remote_qpn = remote_qpn
            self.wr.wr.ud.remote_qkey = remote_qkey
        else:
            self.wr.wr.rdma.remote_addr = remote_addr
            self.wr.wr.rdma.rkey = rkey

    @property
    def wr_id(self):
        return self.wr.wr_id

    @property
    def opcode(self):
        return self.wr.opcode

    @property
    def flags(self):
        return self.wr.send_flags

    @property
    def num_sge(self):
        return self.wr.num_sge

    def __repr__(self):
        return (f"SendWR({_OPCODES.get(self.wr.opcode)}, wr_id={self.wr.wr_id}, num_sge={self.wr.num_sge}, "
                f"flags=0x{self.wr.send_flags:x})")


cdef class RecvWR(_WorkRequest):
    """A receive work request: where an incoming SEND lands."""

    def __init__(self, sg_list=(), uint64_t wr_id=0):
        cdef int num = self._take_sg_list(sg_list)
        memset(&self.wr, 0, sizeof(self.wr))
        self.wr.wr_id = wr_id
        self.wr.sg_list = self.sges
        self.wr.num_sge = num

    @property
    def wr_id(self):
        return self.wr.wr_id

    @property
    def num_sge(self):
        return self.wr.num_sge

    def __repr__(self):
        return f"RecvWR(wr_id={self.wr.wr_id}, num_sge={self.wr.num_sge})"


cdef _as_array(value, int n, dtype, str name):
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        return np.full(n, arr, dtype=dtype)
    if arr.shape != (n,):
        raise UsageError(f"{name} has {arr.size} entries, expected {n}")
    return np.ascontiguousarray(arr)


cdef int _check_list_size(int capacity, int max_sge, size_t wr_size) except -1:
    # in size_t, after the bounds: capacity * max_sge in C int wrapped and the list wrote past its end
    if capacity < 1 or max_sge < 1:
        raise UsageError("capacity and max_sge must be >= 1")
    if max_sge > MAX_SGE_PER_WR:
        raise UsageError(f"max_sge={max_sge} exceeds {MAX_SGE_PER_WR}")
    if <size_t>capacity * (wr_size + <size_t>max_sge * sizeof(ibv_sge)) > <size_t>MAX_LIST_BYTES:
        raise UsageError(f"a list of {capacity} WRs with {max_sge} SGEs each exceeds {MAX_LIST_BYTES} bytes")
    return 0


ctypedef fused any_wr:
    ibv_send_wr
    ibv_recv_wr


cdef int _chain(any_wr *wrs, int count) noexcept:
    """Link wrs[0..count) into the one chain a post takes; returns count."""
    cdef int i
    for i in range(count):
        wrs[i].next = &wrs[i + 1] if i + 1 < count else NULL
    return count


cdef class _WorkRequestSlots:
    """What SendWRList and RecvWRList share: ``capacity`` slots of ``max_sge`` SGEs each, and per slot
    the object that keeps its memory alive. Each subclass holds its own typed array of WRs."""

    cdef int _allocate(self, int capacity, int max_sge, size_t wr_size) except -1:
        _check_list_size(capacity, max_sge, wr_size)
        self.sges = <ibv_sge *>calloc(<size_t>capacity * <size_t>max_sge, sizeof(ibv_sge))
        if self.sges == NULL:
            raise MemoryError()
        self.capacity = capacity
        self.max_sge = max_sge
        self.keepalive = [None] * capacity
        return 0

    def __dealloc__(self):
        free(self.sges)

    def __len__(self):
        return self.count

    cdef ibv_sge *_copy_sges(self, int i, ibv_sge *sges, int num_sge) except NULL:
        """Copy a WR's SGEs into slot ``i``'s; returns where they now are."""
        if not 0 <= i < self.capacity:
            raise UsageError(f"index {i} outside 0..{self.capacity - 1}")
        if num_sge > self.max_sge:
            raise UsageError(f"WR has {num_sge} SGEs, list allows {self.max_sge}")
        memcpy(&self.sges[<size_t>i * self.max_sge], sges, <size_t>num_sge * sizeof(ibv_sge))
        return &self.sges[<size_t>i * self.max_sge]

    cdef int _fill_count(self, offsets) except -1:
        n = np.size(offsets)
        if not 1 <= n <= self.capacity:
            raise UsageError(f"{n} WRs do not fit in a list of capacity {self.capacity}")
        return n


cdef class SendWRList(_WorkRequestSlots):
    """SendWRList(int capacity, int max_sge=1)

    ``capacity`` send WRs in C memory, chained, posted in one ibv_post_send (see QueuePair.post_send_list).

    Fill them one by one with ``set(i, SendWR)`` or all at once, vectorised, with ``fill(...)``."""

    def __cinit__(self, int capacity, int max_sge=1):
        self._allocate(capacity, max_sge, sizeof(ibv_send_wr))
        self.wrs = <ibv_send_wr *>calloc(capacity, sizeof(ibv_send_wr))
        if self.wrs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.wrs)

    cdef int _hold(self, int i, object obj) except -1:
        # keep slot i's owner alive, counting the slots whose WR carries an AddressHandle
        old = self.keepalive[i]
        if isinstance(old, SendWR) and (<SendWR>old).ah is not None:
            self.n_ah -= 1
        if isinstance(obj, SendWR) and (<SendWR>obj).ah is not None:
            self.n_ah += 1
        self.keepalive[i] = obj
        return 0

    def set(self, int i, SendWR wr not None):
        """Copy ``wr`` into slot ``i``; the list then holds slots 0..max(i, count-1)."""
        cdef ibv_sge *sges = self._copy_sges(i, wr.sges, wr.wr.num_sge)
        memcpy(&self.wrs[i], &wr.wr, sizeof(ibv_send_wr))
        self.wrs[i].sg_list = sges
        self._hold(i, wr)
        self.count = _chain(self.wrs, max(i + 1, self.count))

    def fill(self, int opcode, MemoryRegion mr not None, offsets, lengths, remote_addrs=0, uint32_t rkey=0,
             wr_ids=None, flags=IBV_SEND_SIGNALED, imm=None, compare_add=0, swap=0):
        """Fill slots 0..n-1 (n = len(offsets)) with one-SGE WRs over ``mr``; every argument but
        ``opcode``, ``mr`` and ``rkey`` may be a scalar or an array of n values."""
        cdef int i, n
        cdef int64_t[::1] off, ln
        cdef uint64_t[::1] raddr, ids, cadd, swp
        cdef int32_t[::1] fl
        cdef uint32_t[::1] imms
        n = self._fill_count(offsets)
        _check_opcode(opcode, flags if np.ndim(flags) == 0 else int(np.bitwise_or.reduce(np.asarray(flags))),
                      None if imm is None else (imm if np.ndim(imm) == 0 else int(np.max(imm))))
        if imm is not None and np.ndim(imm) and np.size(imm) and int(np.min(imm)) < 0:
            raise UsageError(f"imm_data {int(np.min(imm))} does not fit in 32 bits")
        off = _as_array(offsets, n, np.int64, "offsets")
        ln = _as_array(lengths, n, np.int64, "lengths")
        raddr = _as_array(remote_addrs, n, np.uint64, "remote_addrs")
        ids = _as_array(np.arange(n) if wr_ids is None else wr_ids, n, np.uint64, "wr_ids")
        fl = _as_array(flags, n, np.int32, "flags")
        imms = _as_array(0 if imm is None else imm, n, np.uint32, "imm")
        cadd = _as_array(compare_add, n, np.uint64, "compare_add")
        swp = _as_array(swap, n, np.uint64, "swap")
        atomic = opcode in (IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD)
        for i in range(n):
            if atomic and (ln[i] != 8 or off[i] % 8 or raddr[i] % 8):
                raise UsageError("atomic WRs need 8-byte lengths and 8-byte aligned addresses")
            memset(&self.wrs[i], 0, sizeof(ibv_send_wr))
            fill_sge(&self.sges[<size_t>i * self.max_sge], mr, off[i], ln[i])
            self.wrs[i].wr_id = ids[i]
            self.wrs[i].sg_list = &self.sges[<size_t>i * self.max_sge]
            self.wrs[i].num_sge = 1 if ln[i] > 0 else 0
            self.wrs[i].opcode = opcode
            self.wrs[i].send_flags = fl[i]
            self.wrs[i].imm_data = htonl(imms[i])
            if atomic:
                self.wrs[i].wr.atomic.remote_addr = raddr[i]
                self.wrs[i].wr.atomic.rkey = rkey
                self.wrs[i].wr.atomic.compare_add = cadd[i]
                self.wrs[i].wr.atomic.swap = swp[i]
            else:
                self.wrs[i].wr.rdma.remote_addr = raddr[i]
                self.wrs[i].wr.rdma.rkey = rkey
            self._hold(i, mr)
        self.count = _chain(self.wrs, n)


cdef class RecvWRList(_WorkRequestSlots):
    """RecvWRList(int capacity, int max_sge=1)

    ``capacity`` receive WRs in C memory, posted in one call (QueuePair/SRQ.post_recv_list)."""

    def __cinit__(self, int capacity, int max_sge=1):
        self._allocate(capacity, max_sge, sizeof(ibv_recv_wr))
        self.wrs = <ibv_recv_wr *>calloc(capacity, sizeof(ibv_recv_wr))
        if self.wrs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.wrs)

    def set(self, int i, RecvWR wr not None):
        cdef ibv_sge *sges = self._copy_sges(i, wr.sges, wr.wr.num_sge)
        memcpy(&self.wrs[i], &wr.wr, sizeof(ibv_recv_wr))
        self.wrs[i].sg_list = sges
        self.keepalive[i] = wr
        self.count = _chain(self.wrs, max(i + 1, self.count))

    def fill(self, MemoryRegion mr not None, offsets, lengths, wr_ids=None):
        cdef int i, n
        cdef int64_t[::1] off, ln
        cdef uint64_t[::1] ids
        n = self._fill_count(offsets)
        off = _as_array(offsets, n, np.int64, "offsets")
        ln = _as_array(lengths, n, np.int64, "lengths")
        ids = _as_array(np.arange(n) if wr_ids is None else wr_ids, n, np.uint64, "wr_ids")
        for i in range(n):
            fill_sge(&self.sges[<size_t>i * self.max_sge], mr, off[i], ln[i])
            self.wrs[i].wr_id = ids[i]
            self.wrs[i].sg_list = &self.sges[<size_t>i * self.max_sge]
            self.wrs[i].num_sge = 1
            self.keepalive[i] = mr
        self.count = _chain(self.wrs, n)
