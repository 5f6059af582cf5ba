/* libibverbs and librdmacm, opened at run time instead of linked (include/pyrdma_dl.c).
 *
 * Every extension module that calls verbs or rdma_cm is built with pyrdma_dl.c, which defines the
 * libraries' non-inline entry points as hidden forwarders: the module has no NEEDED entry for
 * libibverbs.so.1 or librdmacm.so.1, `import pyrdma` works where rdma-core is absent, and the first
 * forwarder called (or pyrdma_dl_open) dlopens the library and resolves the versioned symbols once.
 * The inline functions of <infiniband/verbs.h> (post, poll, the extended QP/CQ ops) call through the
 * provider's ops tables and need no symbol, so they run as fast as when linked. */
#ifndef PYRDMA_DL_H
#define PYRDMA_DL_H

enum { PYRDMA_DL_VERBS = 0, PYRDMA_DL_RDMACM = 1 };

/* Open library `lib` (once, thread-safe) and resolve its entry points. Returns 0 when it is usable;
 * -1 when it is not, with *why (if why is not NULL) set to dlopen's error or "lacks SYMBOL@VERSION". */
int pyrdma_dl_open(int lib, const char **why);

/* The library's soname ("libibverbs.so.1"), and the file name handed to dlopen: the soname, or the
 * path in $PYRDMA_LIBIBVERBS / $PYRDMA_LIBRDMACM. NULL for an unknown `lib`. */
const char *pyrdma_dl_soname(int lib);
const char *pyrdma_dl_path(int lib);

/* 1 when the entry point `name` (e.g. "ibv_reg_dmabuf_mr") was resolved, 0 when its library is not
 * usable or lacks it; *version (if not NULL) is set to the symbol version looked up (NULL if unknown). */
int pyrdma_dl_has(const char *name, const char **version);

#endif
