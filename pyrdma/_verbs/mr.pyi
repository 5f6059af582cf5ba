# Type stubs of pyrdma._verbs.mr (pyx/mr.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, Optional
from typing_extensions import disjoint_base

import numpy as np
import numpy.typing as npt

from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma.errors import RDMAError as RDMAError, UsageError as UsageError

class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    MW_BIND = 16
    ON_DEMAND = 64

ACCESS_LOCAL_WRITE: Access
ACCESS_REMOTE_WRITE: Access
ACCESS_REMOTE_READ: Access
ACCESS_REMOTE_ATOMIC: Access
ACCESS_ALL: Access
ACCESS_MW_BIND: Access
ACCESS_ON_DEMAND: Access
PAGE_SIZE: int

def aligned_empty(nbytes: int, alignment: int = ...) -> npt.NDArray[np.uint8]: ...
def probe_dmabuf(pd: ProtectionDomain) -> bool: ...

@disjoint_base
class MemoryRegion(VerbsObject):
    """A registered memory region: ``MemoryRegion(pd, buf, access)`` registers ``buf`` in place."""
    def __init__(self, pd: ProtectionDomain, buf: Any, access: int = ...) -> None: ...
    @staticmethod
    def allocate(pd: ProtectionDomain, length: int, access: int = ...) -> MemoryRegion: ...
    @staticmethod
    def from_pointer(pd: ProtectionDomain, addr: int, length: int, access: int = ...,
                     owner: Any = ...) -> MemoryRegion: ...
    @staticmethod
    def from_dmabuf(pd: ProtectionDomain, fd: int, offset: int, length: int, iova: int, access: int = ...,
                    owner: Any = ...) -> MemoryRegion: ...
    def array(self, dtype: npt.DTypeLike = ..., offset: int = ..., count: int = ...) -> npt.NDArray[Any]: ...
    @property
    def pd(self) -> ProtectionDomain: ...
    @property
    def buffer(self) -> Any: ...
    @property
    def access(self) -> int: ...
    @property
    def is_device_memory(self) -> bool: ...
    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def rkey(self) -> int: ...
