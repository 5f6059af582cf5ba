"""pyrdma: RDMA verbs from Python.

The low level (``pyrdma._verbs``, Cython over libibverbs) mirrors verbs object by object;
this package re-exports it and adds the out-of-band connection helpers, collectives
(``pyrdma.collectives``) and perftest-style benchmarks (``pyrdma.perf``).
"""
from pyrdma.errors import (RDMAError, UsageError, CompletionError, RDMATimeoutError, WireFormatError,
                           PeerError, MissingLibraryError)
from pyrdma.endpoint import Endpoint

from pyrdma._verbs.device import (get_device_list, Context, DeviceInfo, GIDEntry, gid_preference, mtu_to_bytes,
                                  bytes_to_mtu, MTU_256, MTU_512, MTU_1024, MTU_2048, MTU_4096, PORT_DOWN, PORT_INIT,
                                  PORT_ARMED, PORT_ACTIVE, ATOMIC_NONE, ATOMIC_HCA, ATOMIC_GLOB, MTU, PortState,
                                  AtomicCap, AsyncEvent, AsyncEventType)
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma._verbs.mr import (MemoryRegion, aligned_empty, probe_dmabuf, ACCESS_LOCAL_WRITE,
                              ACCESS_REMOTE_WRITE, ACCESS_REMOTE_READ, ACCESS_REMOTE_ATOMIC, ACCESS_ALL, ACCESS_MW_BIND,
                              ACCESS_ON_DEMAND, Access)
from pyrdma._verbs.cq import (CompChannel, CompletionQueue, WC_DTYPE, wc_status_str, wc_status_name,
                              wc_opcode_name, check_wcs, WC_SUCCESS, WC_LOC_LEN_ERR, WC_LOC_QP_OP_ERR,
                              WC_LOC_PROT_ERR, WC_WR_FLUSH_ERR, WC_BAD_RESP_ERR, WC_LOC_ACCESS_ERR,
                              WC_REM_INV_REQ_ERR, WC_REM_ACCESS_ERR, WC_REM_OP_ERR, WC_RETRY_EXC_ERR,
                              WC_RNR_RETRY_EXC_ERR, WC_GENERAL_ERR, WC_SEND, WC_RDMA_WRITE, WC_RDMA_READ,
                              WC_COMP_SWAP, WC_FETCH_ADD, WC_RECV, WC_RECV_RDMA_WITH_IMM, WC_GRH,
                              WC_WITH_IMM, WCStatus, WCOpcode, WCFlags, WCExFlags)
from pyrdma._verbs.wr import (SGE, SendWR, RecvWR, SendWRList, RecvWRList, WR_RDMA_WRITE,
                              WR_RDMA_WRITE_WITH_IMM, WR_SEND, WR_SEND_WITH_IMM, WR_RDMA_READ,
                              WR_ATOMIC_CMP_AND_SWP, WR_ATOMIC_FETCH_AND_ADD, SEND_FENCE, SEND_SIGNALED,
                              SEND_SOLICITED, SEND_INLINE, WROpcode, SendFlags)
from pyrdma._verbs.srq import SharedReceiveQueue
from pyrdma._verbs.ah import AddressHandle
from pyrdma._verbs.mw import MemoryWindow, MWType, MW_TYPE_1, MW_TYPE_2
from pyrdma._verbs.qp import (QueuePair, qp_state_name, QPT_RC, QPT_UC, QPT_UD, QPS_RESET, QPS_INIT,
                              QPS_RTR, QPS_RTS, QPS_SQD, QPS_SQE, QPS_ERR, DEFAULT_QKEY, UD_GRH_BYTES, QPType,
                              QPState)
from pyrdma._verbs.qpex import QueuePairEx, SendOps
from pyrdma._verbs.cm import CMEventChannel, CMID, CMEvent, CMEventType, PortSpace
from pyrdma.connect import Connection, accept, connect

__version__ = "0.1.0"
