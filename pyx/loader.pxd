cdef extern from "pyrdma_dl.h" nogil:
    enum:
        PYRDMA_DL_VERBS
        PYRDMA_DL_RDMACM
    int pyrdma_dl_open(int lib, const char **why)
    const char *pyrdma_dl_soname(int lib)
    const char *pyrdma_dl_path(int lib)
    int pyrdma_dl_has(const char *name, const char **version)

cdef int require_library(int lib, str call) except -1
cdef int require_entry_point(int lib, str name, str call) except -1
