# C declarations of the parts of <rdma/rdma_cma.h> (librdmacm, rdma-core) that pyrdma wraps.
from libc.stdint cimport uint8_t, uint16_t, uint32_t
from pyrdma._verbs.libibverbs cimport ibv_context, ibv_qp, ibv_pd, ibv_qp_init_attr, ibv_ah_attr

cdef extern from "<netinet/in.h>" nogil:
    pass

cdef extern from "<rdma/rdma_cma.h>" nogil:
    cdef struct sockaddr:
        unsigned short sa_family

    enum rdma_cm_event_type:
        RDMA_CM_EVENT_ADDR_RESOLVED
        RDMA_CM_EVENT_ADDR_ERROR
        RDMA_CM_EVENT_ROUTE_RESOLVED
        RDMA_CM_EVENT_ROUTE_ERROR
        RDMA_CM_EVENT_CONNECT_REQUEST
        RDMA_CM_EVENT_CONNECT_RESPONSE
        RDMA_CM_EVENT_CONNECT_ERROR
        RDMA_CM_EVENT_UNREACHABLE
        RDMA_CM_EVENT_REJECTED
        RDMA_CM_EVENT_ESTABLISHED
        RDMA_CM_EVENT_DISCONNECTED
        RDMA_CM_EVENT_DEVICE_REMOVAL
        RDMA_CM_EVENT_MULTICAST_JOIN
        RDMA_CM_EVENT_MULTICAST_ERROR
        RDMA_CM_EVENT_ADDR_CHANGE
        RDMA_CM_EVENT_TIMEWAIT_EXIT

    enum rdma_port_space:
        RDMA_PS_IPOIB
        RDMA_PS_TCP
        RDMA_PS_UDP
        RDMA_PS_IB

    cdef struct rdma_event_channel:
        int fd

    cdef struct rdma_route:
        int num_paths

    cdef struct rdma_cm_id:
        ibv_context *verbs
        rdma_event_channel *channel
        void *context
        ibv_qp *qp
        rdma_route route
        int ps
        uint8_t port_num

    cdef struct rdma_conn_param:
        const void *private_data
        uint8_t private_data_len
        uint8_t responder_resources
        uint8_t initiator_depth
        uint8_t flow_control
        uint8_t retry_count
        uint8_t rnr_retry_count
        uint8_t srq
        uint32_t qp_num

    cdef struct rdma_ud_param:
        const void *private_data
        uint8_t private_data_len
        ibv_ah_attr ah_attr
        uint32_t qp_num
        uint32_t qkey

    cdef union _rdma_cm_event_param:
        rdma_conn_param conn
        rdma_ud_param ud

    cdef struct rdma_cm_event:
        rdma_cm_id *id
        rdma_cm_id *listen_id
        int event
        int status
        _rdma_cm_event_param param

    rdma_event_channel *rdma_create_event_channel()
    void rdma_destroy_event_channel(rdma_event_channel *channel)
    int rdma_create_id(rdma_event_channel *channel, rdma_cm_id **id, void *context, int ps)
    int rdma_destroy_id(rdma_cm_id *id)
    int rdma_bind_addr(rdma_cm_id *id, sockaddr *addr)
    int rdma_resolve_addr(rdma_cm_id *id, sockaddr *src_addr, sockaddr *dst_addr, int timeout_ms)
    int rdma_resolve_route(rdma_cm_id *id, int timeout_ms)
    int rdma_create_qp(rdma_cm_id *id, ibv_pd *pd, ibv_qp_init_attr *qp_init_attr)
    void rdma_destroy_qp(rdma_cm_id *id)
    int rdma_connect(rdma_cm_id *id, rdma_conn_param *conn_param)
    int rdma_listen(rdma_cm_id *id, int backlog)
    int rdma_accept(rdma_cm_id *id, rdma_conn_param *conn_param)
    int rdma_reject(rdma_cm_id *id, const void *private_data, uint8_t private_data_len)
    int rdma_disconnect(rdma_cm_id *id)
    int rdma_get_cm_event(rdma_event_channel *channel, rdma_cm_event **event)
    int rdma_ack_cm_event(rdma_cm_event *event)
    sockaddr *rdma_get_local_addr(rdma_cm_id *id)
    sockaddr *rdma_get_peer_addr(rdma_cm_id *id)
    const char *rdma_event_str(int event)
    int rdma_migrate_id(rdma_cm_id *id, rdma_event_channel *channel)
