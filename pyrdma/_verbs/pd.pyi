# Type stubs of pyrdma._verbs.pd (pyx/pd.pyx), checked against the built module by mypy.stubtest.
from typing_extensions import disjoint_base
from pyrdma._verbs.base import VerbsObject
from pyrdma._verbs.device import Context

@disjoint_base
class ProtectionDomain(VerbsObject):
    def __init__(self, context: Context) -> None: ...
    @property
    def context(self) -> Context: ...
