/* libibverbs and librdmacm at run time: dlopen + dlvsym, as NCCL's ibvwrap does (pyrdma_dl.h).
 *
 * This file defines, with hidden visibility, each non-inline entry point the extension modules call
 * (and the ones verbs.h's inline functions call: ___ibv_query_port -> ibv_query_port, __ibv_reg_mr ->
 * ibv_reg_mr_iova2, ibv_query_gid_ex -> _ibv_query_gid_ex). Each forwards to the library's symbol of
 * the version a link against rdma-core's libibverbs.map / librdmacm.map binds today; the older
 * IBVERBS_1.0 ones are a different ABI, so plain dlsym (which may pick either) is not enough.
 *
 * It declares the functions itself, with struct pointers as void *, instead of including the rdma-core
 * headers: the ABI of a versioned symbol never changes, while the headers' prototypes do
 * (ibv_query_port's third argument became struct _compat_ibv_port_attr *). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyrdma_dl.h"

#define HIDDEN __attribute__((visibility("hidden")))

/* F(library, return type, name, version, optional, parameters, arguments, value on failure)
 * V(library, name, version, parameters, arguments): the same for functions returning void.
 * "On failure" (the library is absent or lacks the symbol): errno is ENOSYS and the function returns
 * what the real one returns on error (an errno value, -1 or NULL), so a caller that skipped
 * pyrdma_dl_open still gets an error, never a crash. Optional entry points (1) are newer than the
 * rest: their absence leaves the library usable, and the call that needs one checks pyrdma_dl_has. */
#define VERBS PYRDMA_DL_VERBS
#define RDMACM PYRDMA_DL_RDMACM
#define UNKNOWN "unknown"
#define PYRDMA_DL_FUNCTIONS(F, V) \
    F(VERBS, void *, ibv_get_device_list, "IBVERBS_1.1", 0, (int *num), (num), NULL) \
    V(VERBS, ibv_free_device_list, "IBVERBS_1.1", (void *list), (list)) \
    F(VERBS, const char *, ibv_get_device_name, "IBVERBS_1.1", 0, (void *dev), (dev), UNKNOWN) \
    F(VERBS, uint64_t, ibv_get_device_guid, "IBVERBS_1.1", 0, (void *dev), (dev), 0) \
    F(VERBS, void *, ibv_open_device, "IBVERBS_1.1", 0, (void *dev), (dev), NULL) \
    F(VERBS, int, ibv_close_device, "IBVERBS_1.1", 0, (void *ctx), (ctx), ENOSYS) \
    F(VERBS, int, ibv_query_device, "IBVERBS_1.1", 0, (void *ctx, void *attr), (ctx, attr), ENOSYS) \
    F(VERBS, int, ibv_query_port, "IBVERBS_1.1", 0, (void *ctx, uint8_t port, void *attr), \
      (ctx, port, attr), ENOSYS) \
    F(VERBS, int, ibv_query_gid, "IBVERBS_1.1", 0, (void *ctx, uint8_t port, int index, void *gid), \
      (ctx, port, index, gid), -1) \
    F(VERBS, int, _ibv_query_gid_ex, "IBVERBS_1.11", 1, \
      (void *ctx, uint32_t port, uint32_t index, void *entry, uint32_t flags, size_t entry_size), \
      (ctx, port, index, entry, flags, entry_size), ENOSYS) \
    F(VERBS, int, ibv_get_async_event, "IBVERBS_1.1", 0, (void *ctx, void *event), (ctx, event), -1) \
    V(VERBS, ibv_ack_async_event, "IBVERBS_1.1", (void *event), (event)) \
    F(VERBS, const char *, ibv_event_type_str, "IBVERBS_1.1", 0, (int event), (event), UNKNOWN) \
    F(VERBS, const char *, ibv_wc_status_str, "IBVERBS_1.1", 0, (int status), (status), UNKNOWN) \
    F(VERBS, const char *, ibv_port_state_str, "IBVERBS_1.1", 0, (int state), (state), UNKNOWN) \
    F(VERBS, const char *, ibv_node_type_str, "IBVERBS_1.1", 0, (int type), (type), UNKNOWN) \
    F(VERBS, int, ibv_fork_init, "IBVERBS_1.1", 0, (void), (), ENOSYS) \
    F(VERBS, void *, ibv_alloc_pd, "IBVERBS_1.1", 0, (void *ctx), (ctx), NULL) \
    F(VERBS, int, ibv_dealloc_pd, "IBVERBS_1.1", 0, (void *pd), (pd), ENOSYS) \
    F(VERBS, void *, ibv_reg_mr, "IBVERBS_1.1", 0, (void *pd, void *addr, size_t length, int access), \
      (pd, addr, length, access), NULL) \
    F(VERBS, void *, ibv_reg_mr_iova2, "IBVERBS_1.8", 0, \
      (void *pd, void *addr, size_t length, uint64_t iova, unsigned int access), \
      (pd, addr, length, iova, access), NULL) \
    F(VERBS, void *, ibv_reg_dmabuf_mr, "IBVERBS_1.12", 1, \
      (void *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access), \
      (pd, offset, length, iova, fd, access), NULL) \
    F(VERBS, int, ibv_dereg_mr, "IBVERBS_1.1", 0, (void *mr), (mr), ENOSYS) \
    F(VERBS, void *, ibv_create_comp_channel, "IBVERBS_1.0", 0, (void *ctx), (ctx), NULL) \
    F(VERBS, int, ibv_destroy_comp_channel, "IBVERBS_1.0", 0, (void *channel), (channel), ENOSYS) \
    F(VERBS, void *, ibv_create_cq, "IBVERBS_1.1", 0, \
      (void *ctx, int cqe, void *cq_context, void *channel, int comp_vector), \
      (ctx, cqe, cq_context, channel, comp_vector), NULL) \
    F(VERBS, int, ibv_destroy_cq, "IBVERBS_1.1", 0, (void *cq), (cq), ENOSYS) \
    F(VERBS, int, ibv_get_cq_event, "IBVERBS_1.1", 0, (void *channel, void **cq, void **cq_context), \
      (channel, cq, cq_context), -1) \
    V(VERBS, ibv_ack_cq_events, "IBVERBS_1.1", (void *cq, unsigned int nevents), (cq, nevents)) \
    F(VERBS, void *, ibv_create_srq, "IBVERBS_1.1", 0, (void *pd, void *attr), (pd, attr), NULL) \
    F(VERBS, int, ibv_destroy_srq, "IBVERBS_1.1", 0, (void *srq), (srq), ENOSYS) \
    F(VERBS, void *, ibv_create_ah, "IBVERBS_1.1", 0, (void *pd, void *attr), (pd, attr), NULL) \
    F(VERBS, int, ibv_destroy_ah, "IBVERBS_1.1", 0, (void *ah), (ah), ENOSYS) \
    F(VERBS, void *, ibv_create_qp, "IBVERBS_1.1", 0, (void *pd, void *attr), (pd, attr), NULL) \
    F(VERBS, int, ibv_destroy_qp, "IBVERBS_1.1", 0, (void *qp), (qp), ENOSYS) \
    F(VERBS, int, ibv_modify_qp, "IBVERBS_1.1", 0, (void *qp, void *attr, int mask), (qp, attr, mask), ENOSYS) \
    F(VERBS, int, ibv_query_qp, "IBVERBS_1.1", 0, (void *qp, void *attr, int mask, void *init_attr), \
      (qp, attr, mask, init_attr), ENOSYS) \
    F(VERBS, void *, ibv_qp_to_qp_ex, "IBVERBS_1.6", 1, (void *qp), (qp), NULL) \
    F(RDMACM, void *, rdma_create_event_channel, "RDMACM_1.0", 0, (void), (), NULL) \
    V(RDMACM, rdma_destroy_event_channel, "RDMACM_1.0", (void *channel), (channel)) \
    F(RDMACM, int, rdma_create_id, "RDMACM_1.0", 0, (void *channel, void **id, void *context, int ps), \
      (channel, id, context, ps), -1) \
    F(RDMACM, int, rdma_destroy_id, "RDMACM_1.0", 0, (void *id), (id), -1) \
    F(RDMACM, int, rdma_bind_addr, "RDMACM_1.0", 0, (void *id, void *addr), (id, addr), -1) \
    F(RDMACM, int, rdma_resolve_addr, "RDMACM_1.0", 0, (void *id, void *src, void *dst, int timeout_ms), \
      (id, src, dst, timeout_ms), -1) \
    F(RDMACM, int, rdma_resolve_route, "RDMACM_1.0", 0, (void *id, int timeout_ms), (id, timeout_ms), -1) \
    F(RDMACM, int, rdma_create_qp, "RDMACM_1.0", 0, (void *id, void *pd, void *attr), (id, pd, attr), -1) \
    V(RDMACM, rdma_destroy_qp, "RDMACM_1.0", (void *id), (id)) \
    F(RDMACM, int, rdma_connect, "RDMACM_1.0", 0, (void *id, void *param), (id, param), -1) \
    F(RDMACM, int, rdma_listen, "RDMACM_1.0", 0, (void *id, int backlog), (id, backlog), -1) \
    F(RDMACM, int, rdma_accept, "RDMACM_1.0", 0, (void *id, void *param), (id, param), -1) \
    F(RDMACM, int, rdma_reject, "RDMACM_1.0", 0, (void *id, const void *data, uint8_t length), \
      (id, data, length), -1) \
    F(RDMACM, int, rdma_disconnect, "RDMACM_1.0", 0, (void *id), (id), -1) \
    F(RDMACM, int, rdma_get_cm_event, "RDMACM_1.0", 0, (void *channel, void **event), (channel, event), -1) \
    F(RDMACM, int, rdma_ack_cm_event, "RDMACM_1.0", 0, (void *event), (event), -1) \
    F(RDMACM, int, rdma_migrate_id, "RDMACM_1.0", 0, (void *id, void *channel), (id, channel), -1) \
    F(RDMACM, const char *, rdma_event_str, "RDMACM_1.0", 0, (int event), (event), UNKNOWN)

struct library {
    const char *soname;
    const char *env;          /* overrides the file dlopen is given (a path, like NCCL's NCCL_IB_*) */
    pthread_once_t once;
    const char *path;
    int usable;
    char why[512];
};

static struct library libraries[] = {
    [VERBS] = {"libibverbs.so.1", "PYRDMA_LIBIBVERBS", PTHREAD_ONCE_INIT, NULL, 0, ""},
    [RDMACM] = {"librdmacm.so.1", "PYRDMA_LIBRDMACM", PTHREAD_ONCE_INIT, NULL, 0, ""},
};

static int ensure_open(int lib);

/* The resolved pointers and the forwarders. The parameters are in parentheses so that verbs.h's
 * function-like macros of the same name (ibv_query_port, ibv_reg_mr) could never expand here. */
#define DEFINE_FORWARDER(lib, ret, name, version, optional, params, args, failed) \
    static ret (*resolved_##name) params; \
    HIDDEN ret (name) params { \
        if (ensure_open(lib) != 0 || resolved_##name == NULL) { \
            errno = ENOSYS; \
            return failed; \
        } \
        return resolved_##name args; \
    }
#define DEFINE_VOID_FORWARDER(lib, name, version, params, args) \
    static void (*resolved_##name) params; \
    HIDDEN void (name) params { \
        if (ensure_open(lib) == 0 && resolved_##name != NULL) \
            resolved_##name args; \
    }
PYRDMA_DL_FUNCTIONS(DEFINE_FORWARDER, DEFINE_VOID_FORWARDER)

struct entry {
    int lib;
    const char *name;
    const char *version;
    int optional;
    void **slot;
};

#define ENTRY(lib, ret, name, version, optional, params, args, failed) \
    {lib, #name, version, optional, (void **)&resolved_##name},
#define VOID_ENTRY(lib, name, version, params, args) {lib, #name, version, 0, (void **)&resolved_##name},
static const struct entry entries[] = {PYRDMA_DL_FUNCTIONS(ENTRY, VOID_ENTRY)};
#define N_ENTRIES (sizeof(entries) / sizeof(entries[0]))

static void open_library(int lib) {
    struct library *l = &libraries[lib];
    const char *override = getenv(l->env);
    void *handle;
    size_t i;

    l->path = override && *override ? override : l->soname;
    /* RTLD_LOCAL: the symbols are reached through dlvsym only, and stay out of the global scope. */
    handle = dlopen(l->path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char *err = dlerror();
        snprintf(l->why, sizeof(l->why), "%s", err ? err : "dlopen failed");
        return;
    }
    for (i = 0; i < N_ENTRIES; i++) {
        if (entries[i].lib != lib)
            continue;
        *entries[i].slot = dlvsym(handle, entries[i].name, entries[i].version);
        if (*entries[i].slot == NULL && !entries[i].optional) {
            snprintf(l->why, sizeof(l->why), "%s lacks %s@%s (rdma-core too old?)", l->path,
                     entries[i].name, entries[i].version);
            return;    /* the handle stays open: harmless, and dlclose could run its destructors */
        }
    }
    l->usable = 1;
}

static void open_verbs(void) { open_library(VERBS); }
static void open_rdmacm(void) { open_library(RDMACM); }

static int ensure_open(int lib) {
    pthread_once(&libraries[lib].once, lib == VERBS ? open_verbs : open_rdmacm);
    return libraries[lib].usable ? 0 : -1;
}

HIDDEN int pyrdma_dl_open(int lib, const char **why) {
    if (lib != VERBS && lib != RDMACM) {
        if (why)
            *why = "no such library";
        return -1;
    }
    if (ensure_open(lib) == 0)
        return 0;
    if (why)
        *why = libraries[lib].why;
    return -1;
}

HIDDEN const char *pyrdma_dl_soname(int lib) {
    return lib == VERBS || lib == RDMACM ? libraries[lib].soname : NULL;
}

HIDDEN const char *pyrdma_dl_path(int lib) {
    if (lib != VERBS && lib != RDMACM)
        return NULL;
    ensure_open(lib);
    return libraries[lib].path;
}

HIDDEN int pyrdma_dl_has(const char *name, const char **version) {
    size_t i;
    if (version)
        *version = NULL;
    for (i = 0; i < N_ENTRIES; i++) {
        if (strcmp(entries[i].name, name) != 0)
            continue;
        if (version)
            *version = entries[i].version;
        return ensure_open(entries[i].lib) == 0 && *entries[i].slot != NULL;
    }
    return 0;
}
