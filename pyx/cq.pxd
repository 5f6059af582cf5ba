from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from pyrdma._verbs.base cimport VerbsObject
from pyrdma._verbs.device cimport Context
from pyrdma._verbs.libibverbs cimport ibv_cq, ibv_cq_ex, ibv_comp_channel

# One work completion as stored in a WC_DTYPE numpy array (packed, host byte order).
cdef packed struct wc_record:
    uint64_t wr_id
    uint32_t status
    uint32_t opcode
    uint32_t vendor_err
    uint32_t byte_len
    uint32_t imm_data
    uint32_t qp_num
    uint32_t src_qp
    uint32_t wc_flags
    uint16_t pkey_index
    uint16_t slid
    uint8_t sl
    uint8_t dlid_path_bits

cdef class CompChannel(VerbsObject):
    cdef ibv_comp_channel *channel
    cdef readonly Context context
    # events taken for another CQ than the reader's (an asyncio waiter then wakes that CQ's waiter)
    cdef readonly unsigned long long redelivered
    cdef int _deliver(self, long long serial) except -1

cdef class CompletionQueue(VerbsObject):
    cdef ibv_cq *cq
    cdef readonly Context context
    cdef readonly CompChannel channel
    cdef readonly int cqe
    cdef long long _pending_events   # channel events for this CQ taken by another CQ's wait()
    cdef ibv_cq_ex *cq_ex            # an extended CQ (ibv_create_cq_ex); cq is then its ibv_cq view
    cdef readonly object wc_flags    # WCExFlags requested (extended CQs); None for a plain CQ
    cdef int ts_kind                 # which timestamp poll_into(timestamps=) reads: 0 none, 1 HCA clock, 2 ns
    cdef int poll_c(self, wc_record *out, int n) noexcept nogil
    cdef int poll_ts_c(self, wc_record *out, uint64_t *ts, int n) noexcept nogil
    cdef uint64_t *_timestamps(self, timestamps, int cap) except? NULL
