# Type stubs of pyrdma._verbs.loader (pyx/loader.pyx), checked against the built module by mypy.stubtest.
from typing import Optional, TypedDict

class _LibraryStatus(TypedDict):
    library: str
    path: str
    loaded: bool
    error: Optional[str]

def library_status() -> list[_LibraryStatus]: ...
def entry_point_available(name: str) -> bool: ...
