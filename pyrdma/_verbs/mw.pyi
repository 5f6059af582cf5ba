# Type stubs of pyrdma._verbs.mw (pyx/mw.pyx), checked against the built module by mypy.stubtest.
import enum
from typing import Any, Optional
from typing_extensions import disjoint_base

from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.mr import MemoryRegion
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma.errors import UsageError as UsageError

class MWType(enum.IntEnum):
    TYPE_1 = 1
    TYPE_2 = 2

MW_TYPE_1: MWType
MW_TYPE_2: MWType

@disjoint_base
class MemoryWindow(VerbsObject):
    def __init__(self, pd: ProtectionDomain, type: int = ...) -> None: ...
    @property
    def rkey(self) -> int: ...
    @property
    def pd(self) -> ProtectionDomain: ...
    @property
    def type(self) -> int: ...
    @property
    def bound_mr(self) -> Optional[MemoryRegion]: ...
    @property
    def bound_qp(self) -> Any: ...
    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
