"""rdma-core's libraries, opened at run time (include/pyrdma_dl.c): the checks that turn a missing
libibverbs.so.1 / librdmacm.so.1, or a missing newer entry point, into pyrdma's MissingLibraryError.

The modules do not link rdma-core, so ``import pyrdma`` works without it; the calls that start using
a library (opening a device, an rdma_cm event channel) call require_library first. Each module holds
its own copy of the loader; all of them open the same file, so this module's answer is theirs.
``$PYRDMA_LIBIBVERBS`` and ``$PYRDMA_LIBRDMACM`` name another file to open (a path), as NCCL's
``NCCL_IB_*`` settings do; they are read once, on first use."""
from pyrdma.errors import MissingLibraryError


cdef str _text(const char *s):
    return s.decode(errors="replace") if s != NULL else None


cdef int require_library(int lib, str call) except -1:
    """Raise MissingLibraryError, naming ``call``, unless library ``lib`` is loaded (loading it once)."""
    cdef const char *why = NULL
    if pyrdma_dl_open(lib, &why) == 0:
        return 0
    raise MissingLibraryError(_text(pyrdma_dl_soname(lib)), _text(why), path=_text(pyrdma_dl_path(lib)),
                              call=call)


cdef int require_entry_point(int lib, str name, str call) except -1:
    """Raise MissingLibraryError unless library ``lib`` is loaded and has the optional entry point ``name``."""
    cdef const char *version = NULL
    require_library(lib, call)
    if pyrdma_dl_has(name.encode(), &version):
        return 0
    path = _text(pyrdma_dl_path(lib))
    symbol = f"{name}@{_text(version)}" if version != NULL else name
    raise MissingLibraryError(_text(pyrdma_dl_soname(lib)), f"{path} lacks {symbol}", path=path,
                              symbol=symbol, call=call)


def library_status():
    """One dict per rdma-core library: ``library`` (soname), ``path`` (the file opened), ``loaded``
    and ``error`` (why it is not usable, else None). Opens the libraries that are not open yet."""
    cdef const char *why
    status = []
    for lib in (PYRDMA_DL_VERBS, PYRDMA_DL_RDMACM):
        why = NULL
        loaded = pyrdma_dl_open(lib, &why) == 0
        status.append({"library": _text(pyrdma_dl_soname(lib)), "path": _text(pyrdma_dl_path(lib)),
                       "loaded": loaded, "error": None if loaded else _text(why)})
    return status


def entry_point_available(str name):
    """Whether rdma-core's entry point ``name`` (e.g. "ibv_reg_dmabuf_mr") is there to call."""
    return bool(pyrdma_dl_has(name.encode(), NULL))
