# Type stubs of pyrdma._verbs.cq (pyx/cq.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, Optional
from typing_extensions import disjoint_base

import numpy as np
import numpy.typing as npt

from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.device import Context
from pyrdma.errors import CompletionError as CompletionError, RDMATimeoutError as RDMATimeoutError
from pyrdma.errors import UsageError as UsageError

class WCStatus(enum.IntEnum):
    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21

class WCOpcode(enum.IntEnum):
    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    BIND_MW = 5
    LOCAL_INV = 6
    RECV = 128
    RECV_RDMA_WITH_IMM = 129

class WCFlags(enum.IntFlag):
    GRH = 1
    WITH_IMM = 2

class WCExFlags(enum.IntFlag):
    WITH_BYTE_LEN = 1
    WITH_IMM = 2
    WITH_QP_NUM = 4
    WITH_SRC_QP = 8
    WITH_SLID = 16
    WITH_SL = 32
    WITH_DLID_PATH_BITS = 64
    COMPLETION_TIMESTAMP = 128
    CVLAN = 256
    FLOW_TAG = 512
    COMPLETION_TIMESTAMP_WALLCLOCK = 2048
    STANDARD = 127

# The structured dtype of a work completion (wr_id, status, opcode, byte_len, imm_data, qp_num, ...).
WC_DTYPE: np.dtype[np.void]

WC_SUCCESS: WCStatus
WC_LOC_LEN_ERR: WCStatus
WC_LOC_QP_OP_ERR: WCStatus
WC_LOC_EEC_OP_ERR: WCStatus
WC_LOC_PROT_ERR: WCStatus
WC_WR_FLUSH_ERR: WCStatus
WC_MW_BIND_ERR: WCStatus
WC_BAD_RESP_ERR: WCStatus
WC_LOC_ACCESS_ERR: WCStatus
WC_REM_INV_REQ_ERR: WCStatus
WC_REM_ACCESS_ERR: WCStatus
WC_REM_OP_ERR: WCStatus
WC_RETRY_EXC_ERR: WCStatus
WC_RNR_RETRY_EXC_ERR: WCStatus
WC_LOC_RDD_VIOL_ERR: WCStatus
WC_REM_INV_RD_REQ_ERR: WCStatus
WC_REM_ABORT_ERR: WCStatus
WC_INV_EECN_ERR: WCStatus
WC_INV_EEC_STATE_ERR: WCStatus
WC_FATAL_ERR: WCStatus
WC_RESP_TIMEOUT_ERR: WCStatus
WC_GENERAL_ERR: WCStatus
WC_SEND: WCOpcode
WC_RDMA_WRITE: WCOpcode
WC_RDMA_READ: WCOpcode
WC_COMP_SWAP: WCOpcode
WC_FETCH_ADD: WCOpcode
WC_BIND_MW: WCOpcode
WC_LOCAL_INV: WCOpcode
WC_RECV: WCOpcode
WC_RECV_RDMA_WITH_IMM: WCOpcode
WC_GRH: WCFlags
WC_WITH_IMM: WCFlags

def wc_status_str(status: int) -> str: ...
def wc_status_name(status: int) -> str: ...
def wc_opcode_name(opcode: int) -> str: ...
def check_wcs(wcs: npt.NDArray[np.void], n: int = ...) -> None: ...

@disjoint_base
class CompChannel(VerbsObject):
    def __init__(self, context: Context) -> None: ...
    def fileno(self) -> int: ...
    @property
    def context(self) -> Context: ...
    @property
    def redelivered(self) -> int: ...

@disjoint_base
class CompletionQueue(VerbsObject):
    def __init__(self, context: Context, cqe: int = ..., channel: Optional[CompChannel] = ..., comp_vector: int = ...,
                 extended: bool = ..., wc_flags: Optional[int] = ...) -> None: ...
    def req_notify(self, solicited_only: bool = ...) -> None: ...
    def wait(self, timeout: Optional[float] = ...) -> bool: ...
    def poll(self, max_entries: int = ...) -> npt.NDArray[np.void]: ...
    def poll_into(self, wcs: npt.NDArray[np.void], check: bool = ...,
                  timestamps: Optional[npt.NDArray[np.uint64]] = ...) -> int: ...
    def poll_wait(self, wcs: npt.NDArray[np.void], min_entries: int = ..., timeout: Optional[float] = ...,
                  check: bool = ..., timestamps: Optional[npt.NDArray[np.uint64]] = ...) -> int: ...
    @property
    def context(self) -> Context: ...
    @property
    def channel(self) -> Optional[CompChannel]: ...
    @property
    def cqe(self) -> int: ...
    @property
    def wc_flags(self) -> int: ...
