# Type stubs of pyrdma._verbs.device (pyx/device.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import List, Optional, Tuple
from typing_extensions import disjoint_base

from pyrdma._verbs.base import Attributes as Attributes, VerbsObject
from pyrdma.errors import RDMAError as RDMAError, UsageError as UsageError

class MTU(enum.IntEnum):
    MTU_256 = 1
    MTU_512 = 2
    MTU_1024 = 3
    MTU_2048 = 4
    MTU_4096 = 5

class PortState(enum.IntEnum):
    NOP = 0
    DOWN = 1
    INIT = 2
    ARMED = 3
    ACTIVE = 4
    ACTIVE_DEFER = 5

class AtomicCap(enum.IntEnum):
    NONE = 0
    HCA = 1
    GLOB = 2

class AsyncEventType(enum.IntEnum):
    CQ_ERR = 0
    QP_FATAL = 1
    QP_REQ_ERR = 2
    QP_ACCESS_ERR = 3
    COMM_EST = 4
    SQ_DRAINED = 5
    PATH_MIG = 6
    PATH_MIG_ERR = 7
    DEVICE_FATAL = 8
    PORT_ACTIVE = 9
    PORT_ERR = 10
    LID_CHANGE = 11
    PKEY_CHANGE = 12
    SM_CHANGE = 13
    SRQ_ERR = 14
    SRQ_LIMIT_REACHED = 15
    QP_LAST_WQE_REACHED = 16
    CLIENT_REREGISTER = 17
    GID_CHANGE = 18
    WQ_FATAL = 19

MTU_256: MTU
MTU_512: MTU
MTU_1024: MTU
MTU_2048: MTU
MTU_4096: MTU
PORT_DOWN: PortState
PORT_INIT: PortState
PORT_ARMED: PortState
PORT_ACTIVE: PortState
ATOMIC_NONE: AtomicCap
ATOMIC_HCA: AtomicCap
ATOMIC_GLOB: AtomicCap

class AsyncEvent:
    """One asynchronous event of a device (already acknowledged)."""
    type: AsyncEventType | int
    port: Optional[int]
    qp_num: Optional[int]
    description: str
    def __init__(self, type: AsyncEventType | int, port: Optional[int] = ..., qp_num: Optional[int] = ...,
                 description: str = ...) -> None: ...

class DeviceInfo:
    name: str
    guid: str
    node_type: str
    transport_type: int
    def __init__(self, name: str, guid: str, node_type: str, transport_type: int) -> None: ...

class GIDEntry:
    index: int
    gid: bytes
    gid_type: str
    netdev: Optional[str]
    gid_str: str
    ipv4: Optional[str]
    def __init__(self, index: int, gid: bytes, gid_type: str, netdev: Optional[str] = ...) -> None: ...
    @property
    def local_scope(self) -> bool: ...

def mtu_to_bytes(mtu: int) -> int: ...
def bytes_to_mtu(nbytes: int) -> int: ...
def gid_preference(entry: GIDEntry) -> Tuple[bool, bool, bool, int]: ...
def get_device_list() -> List[DeviceInfo]: ...

@disjoint_base
class Context(VerbsObject):
    """An opened RDMA device. ``Context()`` opens the first device with an ACTIVE port."""
    def __init__(self, name: Optional[str] = None) -> None: ...
    @property
    def name(self) -> str: ...
    def fileno(self) -> int: ...
    def get_async_event(self, timeout: Optional[float] = ...) -> Optional[AsyncEvent]: ...
    def query_device(self) -> Attributes: ...
    def query_port(self, port: int = ...) -> Attributes: ...
    def query_gid(self, port: int, index: int) -> bytes: ...
    def gid_table(self, port: int = ...) -> List[GIDEntry]: ...
    def best_gid_index(self, port: int = ...) -> int: ...
    def query_odp(self) -> Attributes: ...
    def dmabuf_supported(self) -> bool: ...
