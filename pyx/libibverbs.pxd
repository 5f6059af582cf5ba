# C declarations of the parts of <infiniband/verbs.h> (rdma-core) that pyrdma wraps.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t

cdef extern from "<infiniband/verbs.h>" nogil:
    # Nested unions/structs of the C headers are declared under placeholder names: Cython
    # only ever emits field accesses for them, never the type names.
    cdef union ibv_gid:
        uint8_t raw[16]

    cdef struct ibv_device:
        char *name
        int node_type
        int transport_type

    cdef struct ibv_context:
        ibv_device *device
        int async_fd
        int num_comp_vectors

    cdef struct ibv_device_attr:
        char fw_ver[64]
        uint64_t node_guid
        uint64_t sys_image_guid
        uint64_t max_mr_size
        uint64_t page_size_cap
        uint32_t vendor_id
        uint32_t vendor_part_id
        uint32_t hw_ver
        int max_qp
        int max_qp_wr
        unsigned int device_cap_flags
        int max_sge
        int max_sge_rd
        int max_cq
        int max_cqe
        int max_mr
        int max_pd
        int max_qp_rd_atom
        int max_ee_rd_atom
        int max_res_rd_atom
        int max_qp_init_rd_atom
        int atomic_cap
        int max_mw
        int max_ah
        int max_srq
        int max_srq_wr
        int max_srq_sge
        uint16_t max_pkeys
        uint8_t local_ca_ack_delay
        uint8_t phys_port_cnt

    cdef struct ibv_port_attr:
        int state
        int max_mtu
        int active_mtu
        int gid_tbl_len
        uint32_t port_cap_flags
        uint32_t max_msg_sz
        uint32_t bad_pkey_cntr
        uint32_t qkey_viol_cntr
        uint16_t pkey_tbl_len
        uint16_t lid
        uint16_t sm_lid
        uint8_t lmc
        uint8_t max_vl_num
        uint8_t sm_sl
        uint8_t subnet_timeout
        uint8_t init_type_reply
        uint8_t active_width
        uint8_t active_speed
        uint8_t phys_state
        uint8_t link_layer

    cdef struct ibv_gid_entry:
        ibv_gid gid
        uint32_t gid_index
        uint32_t port_num
        uint32_t gid_type
        uint32_t ndev_ifindex

    cdef struct ibv_pd:
        ibv_context *context
        uint32_t handle

    cdef struct ibv_mr:
        ibv_context *context
        ibv_pd *pd
        void *addr
        size_t length
        uint32_t handle
        uint32_t lkey
        uint32_t rkey

    cdef struct ibv_comp_channel:
        ibv_context *context
        int fd
        int refcnt

    cdef struct ibv_cq:
        ibv_context *context
        ibv_comp_channel *channel
        void *cq_context
        uint32_t handle
        int cqe

    cdef struct ibv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t imm_data
        uint32_t qp_num
        uint32_t src_qp
        unsigned int wc_flags
        uint16_t pkey_index
        uint16_t slid
        uint8_t sl
        uint8_t dlid_path_bits

    cdef struct ibv_srq:
        ibv_context *context
        ibv_pd *pd
        uint32_t handle

    cdef struct ibv_srq_attr:
        uint32_t max_wr
        uint32_t max_sge
        uint32_t srq_limit

    cdef struct ibv_srq_init_attr:
        void *srq_context
        ibv_srq_attr attr

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    cdef struct ibv_ah:
        ibv_context *context
        ibv_pd *pd
        uint32_t handle

    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    cdef struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        int qp_type
        int sq_sig_all

    cdef struct ibv_qp:
        ibv_context *context
        void *qp_context
        ibv_pd *pd
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        uint32_t handle
        uint32_t qp_num
        int state
        int qp_type

    cdef struct ibv_qp_attr:
        int qp_state
        int cur_qp_state
        int path_mtu
        int path_mig_state
        uint32_t qkey
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_qp_cap cap
        ibv_ah_attr ah_attr
        ibv_ah_attr alt_ah_attr
        uint16_t pkey_index
        uint16_t alt_pkey_index
        uint8_t en_sqd_async_notify
        uint8_t sq_draining
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry
        uint8_t alt_port_num
        uint8_t alt_timeout

    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    cdef struct _ibv_wr_rdma:
        uint64_t remote_addr
        uint32_t rkey

    cdef struct _ibv_wr_atomic:
        uint64_t remote_addr
        uint64_t compare_add
        uint64_t swap
        uint32_t rkey

    cdef struct _ibv_wr_ud:
        ibv_ah *ah
        uint32_t remote_qpn
        uint32_t remote_qkey

    cdef union _ibv_wr_union:
        _ibv_wr_rdma rdma
        _ibv_wr_atomic atomic
        _ibv_wr_ud ud

    cdef struct ibv_mw:
        ibv_context *context
        ibv_pd *pd
        uint32_t rkey
        uint32_t handle
        int type

    cdef struct ibv_mw_bind_info:
        ibv_mr *mr
        uint64_t addr
        uint64_t length
        unsigned int mw_access_flags

    cdef struct ibv_mw_bind:
        uint64_t wr_id
        unsigned int send_flags
        ibv_mw_bind_info bind_info

    cdef struct _ibv_wr_bind_mw:
        ibv_mw *mw
        uint32_t rkey
        ibv_mw_bind_info bind_info

    cdef struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        int opcode
        unsigned int send_flags
        uint32_t imm_data          # network byte order (anonymous union in C)
        uint32_t invalidate_rkey   # the same union: LOCAL_INV and SEND_WITH_INV
        _ibv_wr_union wr
        _ibv_wr_bind_mw bind_mw    # an anonymous union in C (bind_mw / tso)

    cdef struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr *next
        ibv_sge *sg_list
        int num_sge

    # enums as plain ints
    enum:
        IBV_NODE_CA
        IBV_TRANSPORT_IB
        IBV_PORT_NOP, IBV_PORT_DOWN, IBV_PORT_INIT, IBV_PORT_ARMED, IBV_PORT_ACTIVE, IBV_PORT_ACTIVE_DEFER
        IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096
        IBV_LINK_LAYER_UNSPECIFIED, IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET
        IBV_GID_TYPE_IB, IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2
        IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_ATOMIC
        IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_EEC_OP_ERR, IBV_WC_LOC_PROT_ERR
        IBV_WC_WR_FLUSH_ERR, IBV_WC_MW_BIND_ERR, IBV_WC_BAD_RESP_ERR, IBV_WC_LOC_ACCESS_ERR
        IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_OP_ERR, IBV_WC_RETRY_EXC_ERR
        IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_LOC_RDD_VIOL_ERR, IBV_WC_REM_INV_RD_REQ_ERR, IBV_WC_REM_ABORT_ERR
        IBV_WC_INV_EECN_ERR, IBV_WC_INV_EEC_STATE_ERR, IBV_WC_FATAL_ERR, IBV_WC_RESP_TIMEOUT_ERR
        IBV_WC_GENERAL_ERR
        IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_COMP_SWAP, IBV_WC_FETCH_ADD
        IBV_WC_BIND_MW, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM
        IBV_WC_GRH, IBV_WC_WITH_IMM
        IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD
        IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR
        IBV_QP_STATE, IBV_QP_CUR_STATE, IBV_QP_EN_SQD_ASYNC_NOTIFY, IBV_QP_ACCESS_FLAGS, IBV_QP_PKEY_INDEX
        IBV_QP_PORT, IBV_QP_QKEY, IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_ALT_PATH, IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN, IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_PATH_MIG_STATE, IBV_QP_CAP, IBV_QP_DEST_QPN
        IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_READ
        IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD
        IBV_SEND_FENCE, IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_SEND_INLINE
        IBV_SRQ_MAX_WR, IBV_SRQ_LIMIT
        IBV_ATOMIC_NONE, IBV_ATOMIC_HCA, IBV_ATOMIC_GLOB
        IBV_ACCESS_MW_BIND, IBV_MW_TYPE_1, IBV_MW_TYPE_2
        IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV, IBV_WC_LOCAL_INV
        IBV_EVENT_CQ_ERR, IBV_EVENT_QP_FATAL, IBV_EVENT_QP_REQ_ERR, IBV_EVENT_QP_ACCESS_ERR, IBV_EVENT_COMM_EST
        IBV_EVENT_SQ_DRAINED, IBV_EVENT_PATH_MIG, IBV_EVENT_PATH_MIG_ERR, IBV_EVENT_DEVICE_FATAL
        IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, IBV_EVENT_LID_CHANGE, IBV_EVENT_PKEY_CHANGE
        IBV_EVENT_SM_CHANGE, IBV_EVENT_SRQ_ERR, IBV_EVENT_SRQ_LIMIT_REACHED, IBV_EVENT_QP_LAST_WQE_REACHED
        IBV_EVENT_CLIENT_REREGISTER, IBV_EVENT_GID_CHANGE, IBV_EVENT_WQ_FATAL

    cdef union ibv_async_event_element:       # placeholder name of the C anonymous union
        ibv_cq *cq
        ibv_qp *qp
        ibv_srq *srq
        int port_num

    cdef struct ibv_async_event:
        ibv_async_event_element element
        int event_type

    cdef struct _ibv_odp_transport_caps:
        uint32_t rc_odp_caps
        uint32_t uc_odp_caps
        uint32_t ud_odp_caps

    cdef struct ibv_odp_caps:
        uint64_t general_caps
        _ibv_odp_transport_caps per_transport_caps

    cdef struct ibv_device_attr_ex:
        ibv_device_attr orig_attr
        uint32_t comp_mask
        ibv_odp_caps odp_caps
        uint64_t completion_timestamp_mask
        uint64_t hca_core_clock

    # the extended CQ (ibv_create_cq_ex; polled with ibv_start_poll/ibv_next_poll/ibv_end_poll)
    cdef struct ibv_poll_cq_attr:
        uint32_t comp_mask

    cdef struct ibv_cq_ex:
        ibv_context *context
        uint64_t wr_id
        int status

    cdef struct ibv_cq_init_attr_ex:
        uint32_t cqe
        void *cq_context
        ibv_comp_channel *channel
        uint32_t comp_vector
        uint64_t wc_flags
        uint32_t comp_mask
        uint32_t flags

    enum:
        IBV_WC_EX_WITH_BYTE_LEN, IBV_WC_EX_WITH_IMM, IBV_WC_EX_WITH_QP_NUM, IBV_WC_EX_WITH_SRC_QP
        IBV_WC_EX_WITH_SLID, IBV_WC_EX_WITH_SL, IBV_WC_EX_WITH_DLID_PATH_BITS
        IBV_WC_EX_WITH_COMPLETION_TIMESTAMP, IBV_WC_EX_WITH_CVLAN, IBV_WC_EX_WITH_FLOW_TAG
        IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK, IBV_WC_STANDARD_FLAGS

    ibv_cq_ex *ibv_create_cq_ex(ibv_context *context, ibv_cq_init_attr_ex *cq_attr)
    ibv_cq *ibv_cq_ex_to_cq(ibv_cq_ex *cq)
    int ibv_start_poll(ibv_cq_ex *cq, ibv_poll_cq_attr *attr)
    int ibv_next_poll(ibv_cq_ex *cq)
    void ibv_end_poll(ibv_cq_ex *cq)
    int ibv_wc_read_opcode(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_vendor_err(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_byte_len(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_imm_data(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_qp_num(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_src_qp(ibv_cq_ex *cq)
    unsigned int ibv_wc_read_wc_flags(ibv_cq_ex *cq)
    uint32_t ibv_wc_read_slid(ibv_cq_ex *cq)
    uint8_t ibv_wc_read_sl(ibv_cq_ex *cq)
    uint8_t ibv_wc_read_dlid_path_bits(ibv_cq_ex *cq)
    uint64_t ibv_wc_read_completion_ts(ibv_cq_ex *cq)
    uint64_t ibv_wc_read_completion_wallclock_ns(ibv_cq_ex *cq)

    enum:
        IBV_ODP_SUPPORT, IBV_ODP_SUPPORT_IMPLICIT, IBV_ACCESS_ON_DEMAND
        IBV_ODP_SUPPORT_SEND, IBV_ODP_SUPPORT_RECV, IBV_ODP_SUPPORT_WRITE, IBV_ODP_SUPPORT_READ
        IBV_ODP_SUPPORT_ATOMIC, IBV_ODP_SUPPORT_SRQ_RECV

    int ibv_query_device_ex(ibv_context *context, const void *input, ibv_device_attr_ex *attr)

    int ibv_get_async_event(ibv_context *context, ibv_async_event *event)
    void ibv_ack_async_event(ibv_async_event *event)
    const char *ibv_event_type_str(int event)

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **list)
    const char *ibv_get_device_name(ibv_device *device)
    uint64_t ibv_get_device_guid(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *device_attr)
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr)
    int ibv_query_gid(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid)
    int ibv_query_gid_ex(ibv_context *context, uint32_t port_num, uint32_t gid_index,
                         ibv_gid_entry *entry, uint32_t flags)
    const char *ibv_wc_status_str(int status)
    const char *ibv_port_state_str(int port_state)
    const char *ibv_node_type_str(int node_type)

    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)

    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    ibv_mr *ibv_reg_dmabuf_mr(ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access)
    int ibv_dereg_mr(ibv_mr *mr)

    ibv_comp_channel *ibv_create_comp_channel(ibv_context *context)
    int ibv_destroy_comp_channel(ibv_comp_channel *channel)
    ibv_cq *ibv_create_cq(ibv_context *context, int cqe, void *cq_context,
                          ibv_comp_channel *channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)

    ibv_srq *ibv_create_srq(ibv_pd *pd, ibv_srq_init_attr *srq_init_attr)
    int ibv_destroy_srq(ibv_srq *srq)
    int ibv_post_srq_recv(ibv_srq *srq, ibv_recv_wr *recv_wr, ibv_recv_wr **bad_recv_wr)

    ibv_ah *ibv_create_ah(ibv_pd *pd, ibv_ah_attr *attr)
    int ibv_destroy_ah(ibv_ah *ah)

    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *qp_init_attr)
    int ibv_destroy_qp(ibv_qp *qp)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask)
    int ibv_query_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask, ibv_qp_init_attr *init_attr)
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
    ibv_mw *ibv_alloc_mw(ibv_pd *pd, int type)

    # the extended QP and its post API (ibv_wr_*); the op pointers are NULL for ops not enabled
    cdef struct ibv_qp_init_attr_ex:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        int qp_type
        int sq_sig_all
        uint32_t comp_mask
        ibv_pd *pd
        uint64_t send_ops_flags

    cdef struct ibv_qp_ex:
        ibv_qp qp_base
        uint64_t wr_id
        unsigned int wr_flags
        void *wr_atomic_cmp_swp
        void *wr_atomic_fetch_add
        void *wr_bind_mw
        void *wr_local_inv
        void *wr_rdma_read
        void *wr_rdma_write
        void *wr_rdma_write_imm
        void *wr_send
        void *wr_send_imm
        void *wr_send_inv
        void *wr_set_ud_addr
        void *wr_set_inline_data
        void *wr_set_sge
        void *wr_set_sge_list
        void *wr_start
        void *wr_complete
        void *wr_abort

    enum:
        IBV_QP_INIT_ATTR_PD, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
        IBV_QP_EX_WITH_RDMA_WRITE, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, IBV_QP_EX_WITH_SEND
        IBV_QP_EX_WITH_SEND_WITH_IMM, IBV_QP_EX_WITH_RDMA_READ, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
        IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD, IBV_QP_EX_WITH_LOCAL_INV, IBV_QP_EX_WITH_BIND_MW
        IBV_QP_EX_WITH_SEND_WITH_INV

    ibv_qp *ibv_create_qp_ex(ibv_context *context, ibv_qp_init_attr_ex *attr)
    ibv_qp_ex *ibv_qp_to_qp_ex(ibv_qp *qp)
    void ibv_wr_start(ibv_qp_ex *qp)
    int ibv_wr_complete(ibv_qp_ex *qp)
    void ibv_wr_abort(ibv_qp_ex *qp)
    void ibv_wr_rdma_write(ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr)
    void ibv_wr_rdma_write_imm(ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, uint32_t imm_data)
    void ibv_wr_rdma_read(ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr)
    void ibv_wr_send(ibv_qp_ex *qp)
    void ibv_wr_send_imm(ibv_qp_ex *qp, uint32_t imm_data)
    void ibv_wr_send_inv(ibv_qp_ex *qp, uint32_t invalidate_rkey)
    void ibv_wr_atomic_cmp_swp(ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, uint64_t compare, uint64_t swap)
    void ibv_wr_atomic_fetch_add(ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, uint64_t add)
    void ibv_wr_local_inv(ibv_qp_ex *qp, uint32_t invalidate_rkey)
    void ibv_wr_bind_mw(ibv_qp_ex *qp, ibv_mw *mw, uint32_t rkey, const ibv_mw_bind_info *bind_info)
    void ibv_wr_set_sge(ibv_qp_ex *qp, uint32_t lkey, uint64_t addr, uint32_t length)
    void ibv_wr_set_inline_data(ibv_qp_ex *qp, void *addr, size_t length)
    void ibv_wr_set_ud_addr(ibv_qp_ex *qp, ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey)
    int ibv_dealloc_mw(ibv_mw *mw)
    int ibv_bind_mw(ibv_qp *qp, ibv_mw *mw, ibv_mw_bind *mw_bind)
    uint32_t ibv_inc_rkey(uint32_t rkey)
    int ibv_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad_wr)

    int ibv_fork_init()
