# Type stubs of pyrdma._verbs.cm (pyx/cm.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, Dict, Optional, Tuple
from typing_extensions import disjoint_base

from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.cq import CompletionQueue
from pyrdma._verbs.device import Context
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma._verbs.qp import QueuePair
from pyrdma._verbs.srq import SharedReceiveQueue
from pyrdma.errors import RDMAError as RDMAError, RDMATimeoutError as RDMATimeoutError
from pyrdma.errors import UsageError as UsageError

class CMEventType(enum.IntEnum):
    ADDR_RESOLVED = 0
    ADDR_ERROR = 1
    ROUTE_RESOLVED = 2
    ROUTE_ERROR = 3
    CONNECT_REQUEST = 4
    CONNECT_RESPONSE = 5
    CONNECT_ERROR = 6
    UNREACHABLE = 7
    REJECTED = 8
    ESTABLISHED = 9
    DISCONNECTED = 10
    DEVICE_REMOVAL = 11
    MULTICAST_JOIN = 12
    MULTICAST_ERROR = 13
    ADDR_CHANGE = 14
    TIMEWAIT_EXIT = 15

class PortSpace(enum.IntEnum):
    IPOIB = 2
    TCP = 262
    UDP = 273
    IB = 319

PS_TCP: PortSpace
PS_UDP: PortSpace

class CMEvent:
    type: CMEventType | int
    status: int
    id: Optional[CMID]
    listen_id: Optional[CMID]
    private_data: bytes
    param: Dict[str, Any]
    def __init__(self, type: CMEventType | int, status: int = ..., id: Optional[CMID] = ...,
                 listen_id: Optional[CMID] = ..., private_data: bytes = ...,
                 param: Optional[Dict[str, Any]] = ...) -> None: ...

@disjoint_base
class CMEventChannel(VerbsObject):
    def __init__(self) -> None: ...
    def fileno(self) -> int: ...
    def get_event(self, timeout: Optional[float] = ...) -> Optional[CMEvent]: ...

@disjoint_base
class CMID(VerbsObject):
    def __init__(self, channel: Optional[CMEventChannel] = None, ps: int = ...) -> None: ...
    # None until the id is bound or resolved; typed loosely (Context | Any) so that code which uses it
    # after resolve_addr/bind_addr, as the README does, needs no None check.
    @property
    def context(self) -> Context | Any: ...
    @property
    def port_num(self) -> int: ...
    @property
    def local_addr(self) -> Optional[Tuple[str, int]]: ...
    @property
    def peer_addr(self) -> Optional[Tuple[str, int]]: ...
    @property
    def qp(self) -> Optional[QueuePair]: ...
    @property
    def channel(self) -> CMEventChannel: ...
    @property
    def ps(self) -> int: ...
    @property
    def request(self) -> Optional[CMEvent]: ...
    def wait_event(self, expected: int, timeout: Optional[float] = ...) -> CMEvent: ...
    def bind_addr(self, host: Optional[str] = ..., port: int = ...) -> None: ...
    def resolve_addr(self, host: str, port: int, src: Optional[str] = ..., timeout: float = ...) -> None: ...
    def resolve_route(self, timeout: float = ...) -> None: ...
    def create_qp(self, pd: ProtectionDomain, send_cq: CompletionQueue, recv_cq: Optional[CompletionQueue] = ...,
                  max_send_wr: int = ..., max_recv_wr: int = ..., max_send_sge: int = ..., max_recv_sge: int = ...,
                  max_inline_data: int = ..., srq: Optional[SharedReceiveQueue] = ...,
                  sq_sig_all: bool = ...) -> QueuePair: ...
    def listen(self, backlog: int = ...) -> None: ...
    def get_request(self, timeout: Optional[float] = ...) -> CMID: ...
    def connect(self, private_data: Optional[bytes] = ..., responder_resources: int = ..., initiator_depth: int = ...,
                retry_count: int = ..., rnr_retry_count: int = ...,
                timeout: Optional[float] = ...) -> Optional[CMEvent]: ...
    def accept(self, private_data: Optional[bytes] = ..., responder_resources: int = ..., initiator_depth: int = ...,
               retry_count: int = ..., rnr_retry_count: int = ..., qkey: Optional[int] = ...,
               timeout: Optional[float] = ...) -> Optional[CMEvent]: ...
    def reject(self, private_data: Optional[bytes] = ...) -> None: ...
    def disconnect(self) -> None: ...
