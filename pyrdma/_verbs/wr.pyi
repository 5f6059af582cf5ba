# Type stubs of pyrdma._verbs.wr (pyx/wr.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, Iterable, Optional, Sequence, Union
from typing_extensions import disjoint_base

import numpy.typing as npt

from pyrdma._verbs.ah import AddressHandle
from pyrdma._verbs.mr import MemoryRegion
from pyrdma.errors import UsageError as UsageError

class WROpcode(enum.IntEnum):
    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6

class SendFlags(enum.IntFlag):
    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8

WR_RDMA_WRITE: WROpcode
WR_RDMA_WRITE_WITH_IMM: WROpcode
WR_SEND: WROpcode
WR_SEND_WITH_IMM: WROpcode
WR_RDMA_READ: WROpcode
WR_ATOMIC_CMP_AND_SWP: WROpcode
WR_ATOMIC_FETCH_AND_ADD: WROpcode
SEND_FENCE: SendFlags
SEND_SIGNALED: SendFlags
SEND_SOLICITED: SendFlags
SEND_INLINE: SendFlags
MAX_LIST_BYTES: int
MAX_SGE_PER_WR: int

_Ints = Union[int, Sequence[int], npt.ArrayLike]

@disjoint_base
class SGE:
    def __init__(self, mr: MemoryRegion, offset: int = ..., length: Optional[int] = ...) -> None: ...
    @staticmethod
    def raw(addr: int, length: int, lkey: int) -> SGE: ...
    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def mr(self) -> Optional[MemoryRegion]: ...

@disjoint_base
class SendWR:
    def __init__(self, opcode: int = ..., sg_list: Iterable[SGE] = ..., wr_id: int = ..., flags: int = ...,
                 imm_data: Optional[int] = ..., remote_addr: int = ..., rkey: int = ..., compare_add: int = ...,
                 swap: int = ..., ah: Optional[AddressHandle] = ..., remote_qpn: int = ...,
                 remote_qkey: int = ...) -> None: ...
    @property
    def wr_id(self) -> int: ...
    @property
    def opcode(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def num_sge(self) -> int: ...
    @property
    def ah(self) -> Optional[AddressHandle]: ...

@disjoint_base
class RecvWR:
    def __init__(self, sg_list: Iterable[SGE] = ..., wr_id: int = ...) -> None: ...
    @property
    def wr_id(self) -> int: ...
    @property
    def num_sge(self) -> int: ...

@disjoint_base
class _WorkRequestSlots:
    def __len__(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_sge(self) -> int: ...
    @property
    def count(self) -> int: ...

@disjoint_base
class SendWRList(_WorkRequestSlots):
    def __new__(cls, capacity: int, max_sge: int = ...) -> SendWRList: ...
    def set(self, i: int, wr: SendWR) -> None: ...
    def fill(self, opcode: int, mr: MemoryRegion, offsets: _Ints, lengths: _Ints, remote_addrs: _Ints = ...,
             rkey: int = ..., wr_ids: Optional[_Ints] = ..., flags: int = ..., imm: Optional[int] = ...,
             compare_add: _Ints = ..., swap: _Ints = ...) -> None: ...

@disjoint_base
class RecvWRList(_WorkRequestSlots):
    def __new__(cls, capacity: int, max_sge: int = ...) -> RecvWRList: ...
    def set(self, i: int, wr: RecvWR) -> None: ...
    def fill(self, mr: MemoryRegion, offsets: _Ints, lengths: _Ints, wr_ids: Optional[_Ints] = ...) -> None: ...
