# Type stubs of pyrdma._verbs.qpex (pyx/qpex.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, ContextManager, Optional

from typing_extensions import disjoint_base

from pyrdma._verbs.ah import AddressHandle
from pyrdma._verbs.cq import CompletionQueue
from pyrdma._verbs.mr import MemoryRegion
from pyrdma._verbs.mw import MemoryWindow
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma._verbs.qp import DEFAULT_QKEY as DEFAULT_QKEY, QueuePair
from pyrdma._verbs.srq import SharedReceiveQueue
from pyrdma.errors import UsageError as UsageError

class SendOps(enum.IntFlag):
    RDMA_WRITE = 1
    RDMA_WRITE_WITH_IMM = 2
    SEND = 4
    SEND_WITH_IMM = 8
    RDMA_READ = 16
    ATOMIC_CMP_AND_SWP = 32
    ATOMIC_FETCH_AND_ADD = 64
    LOCAL_INV = 128
    BIND_MW = 256
    SEND_WITH_INV = 512

@disjoint_base
class QueuePairEx(QueuePair):
    def __init__(self, pd: ProtectionDomain, qp_type: int, send_cq: CompletionQueue,
                 recv_cq: Optional[CompletionQueue] = ..., max_send_wr: int = ..., max_recv_wr: int = ...,
                 max_send_sge: int = ..., max_recv_sge: int = ..., max_inline_data: int = ...,
                 srq: Optional[SharedReceiveQueue] = ..., sq_sig_all: bool = ..., port: int = ...,
                 gid_index: Optional[int] = ..., *, send_ops: int) -> None: ...
    def wr_start(self) -> None: ...
    def wr_complete(self) -> None: ...
    def wr_abort(self) -> None: ...
    def wr_batch(self) -> ContextManager[QueuePairEx]: ...
    def wr_rdma_write(self, rkey: int, remote_addr: int, wr_id: int = ..., flags: int = ...,
                      imm: Optional[int] = ...) -> None: ...
    def wr_rdma_read(self, rkey: int, remote_addr: int, wr_id: int = ..., flags: int = ...) -> None: ...
    def wr_send(self, wr_id: int = ..., flags: int = ..., imm: Optional[int] = ...,
                invalidate_rkey: Optional[int] = ...) -> None: ...
    def wr_atomic_fetch_add(self, rkey: int, remote_addr: int, add: int, wr_id: int = ...,
                            flags: int = ...) -> None: ...
    def wr_atomic_cmp_swp(self, rkey: int, remote_addr: int, compare: int, swap: int, wr_id: int = ...,
                          flags: int = ...) -> None: ...
    def wr_local_inv(self, invalidate_rkey: int, wr_id: int = ..., flags: int = ...) -> None: ...
    def wr_bind_mw(self, mw: MemoryWindow, mr: MemoryRegion, offset: int, length: int, access: int = ...,
                   wr_id: int = ..., flags: int = ...) -> int: ...
    def wr_set_sge(self, mr: MemoryRegion, offset: int, length: int) -> None: ...
    def wr_set_inline_data(self, data: Any) -> None: ...
    def wr_set_ud_addr(self, ah: AddressHandle, remote_qpn: int, remote_qkey: int = ...) -> None: ...
    @property
    def send_ops(self) -> int: ...
