# Type stubs of pyrdma._verbs.ah (pyx/ah.pyx), checked against the built module by mypy.stubtest.
from typing import Optional
from typing_extensions import disjoint_base

from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.pd import ProtectionDomain
from pyrdma.endpoint import Endpoint
from pyrdma.errors import UsageError as UsageError

@disjoint_base
class AddressHandle(VerbsObject):
    def __init__(self, pd: ProtectionDomain, remote: Endpoint, port: int = ..., sgid_index: Optional[int] = ...,
                 hop_limit: int = ...) -> None: ...
    @staticmethod
    def from_attrs(pd: ProtectionDomain, dlid: int, gid: bytes = ..., port: int = ...,
                   sgid_index: Optional[int] = ..., is_global: Optional[bool] = ...,
                   hop_limit: int = ...) -> AddressHandle: ...
    @property
    def pd(self) -> ProtectionDomain: ...
